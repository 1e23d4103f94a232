// File-system helpers for crash-safe output: recursive mkdir, directory fsync, tree removal,
// and JSON files written to a temporary name, fsynced and renamed into place.
#pragma once
#include <jansson.h>

#include "common/util.h"

int fs_mkdir_p(const char *path, MoeErr err);
int fs_fsync_dir(const char *path, MoeErr err);
int fs_remove_tree(const char *path); // 0 or -1; a missing path counts as removed
bool fs_exists(const char *path);
bool fs_is_dir(const char *path);
// Whether two paths name one file (same device and inode), whatever their spelling: links, "./",
// "a/../". A path that does not exist yet names the same file as another when their folders are
// the same folder and their last components are equal.
bool fs_same_file(const char *a, const char *b);
// Writes `root` as indented JSON to path via "path.tmp", fsync and rename.
int fs_write_json_atomic(const char *path, json_t *root, MoeErr err);
// Writes `root` to a new file (no rename) and fsyncs it: for files inside a temporary directory.
int fs_write_json_synced(const char *path, json_t *root, MoeErr err);

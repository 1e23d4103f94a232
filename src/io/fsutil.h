// File-system helpers for crash-safe output: recursive mkdir, directory fsync, tree removal,
// directory locks, and JSON files written to a temporary name, fsynced and renamed into place.
#pragma once
#include <jansson.h>

#include "common/util.h"

int fs_mkdir_p(const char *path, MoeErr err);
int fs_fsync_dir(const char *path, MoeErr err);
int fs_remove_tree(const char *path); // 0 or -1; a missing path counts as removed
bool fs_exists(const char *path);
bool fs_is_dir(const char *path);
bool fs_dir_empty(const char *path); // a directory with no entries (false for anything else)
// The folder of path ("." when it has none, "/" for the root) into dir; returns the last component.
const char *fs_split(const char *path, char *dir, size_t len);
// Copies the regular file src (`what` names it in messages) to a new file dst, fsynced.
int fs_copy_file(const char *src, const char *dst, const char *what, MoeErr err);
// Opens an existing regular file read-only; returns the descriptor, or -1 with a message naming the
// path and `what` it is ("config file"). A directory, FIFO, device or socket is refused at once:
// opening a FIFO for reading would wait for a writer forever.
int fs_open_regular(const char *path, const char *what, MoeErr err);
// The same as a FILE (read, binary).
FILE *fs_fopen_regular(const char *path, const char *what, MoeErr err);
// Reads a whole file opened by fs_open_regular into a new buffer of *len bytes plus a NUL; -1 with a
// message naming the path and `what` it is.
int fs_read_file(const char *path, const char *what, uint8_t **data, size_t *len, MoeErr err);
// Parses JSON text read from `path` (duplicate keys refused); NULL with a message
// "path:line:column: malformed JSON: ...".
json_t *fs_parse_json(const char *path, const char *text, size_t len, MoeErr err);
// Reads a JSON file (duplicate keys refused) opened by fs_open_regular; NULL with a message, for
// malformed JSON "path:line:column: malformed JSON: ...".
json_t *fs_load_json(const char *path, const char *what, MoeErr err);
// Whether two paths name one file (same device and inode), whatever their spelling: links, "./",
// "a/../". A path that does not exist yet names the same file as another when their folders are
// the same folder and their last components are equal.
bool fs_same_file(const char *a, const char *b);
// Takes an exclusive lock (flock) on DIR/.lock, creating DIR and the file, and writes this
// process's PID and host into it. The lock lasts until the descriptor is closed or the process
// ends (however it ends). Returns the descriptor, or -1 with a message naming the directory and
// the holder when another process has it.
int fs_lock_dir(const char *dir, MoeErr err);
// Puts the complete directory `tmp` at `final` (same file system) with renames: an existing `final`
// (an empty directory, or one being replaced) is first renamed to `old`, which is removed once `tmp`
// is in place; then the parent of `final` is fsynced. A crash leaves `final` either as it was or
// whole; `old` may be left behind for the caller to clean.
int fs_replace_dir(const char *tmp, const char *final, const char *old, MoeErr err);
// Writes `root` as indented JSON to path via "path.tmp", fsync and rename.
int fs_write_json_atomic(const char *path, json_t *root, MoeErr err);
// Writes `root` to a new file (no rename) and fsyncs it: for files inside a temporary directory.
int fs_write_json_synced(const char *path, json_t *root, MoeErr err);

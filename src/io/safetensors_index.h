// The index of a sharded safetensors checkpoint (Hugging Face format, see docs/FORMATS.md):
// PREFIX.safetensors.index.json = {"metadata": {"total_size": bytes}, "weight_map": {tensor: file}}.
// A validating reader (every shard it names is a plain file name in the index's own folder) and a
// writer that builds the index from the shard files.
#pragma once
#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/util.h"

typedef struct {
    char *path;          // the index file, for messages
    json_t *map;         // weight_map: tensor name -> shard file name (all strings, checked)
    uint64_t total_size; // metadata.total_size: bytes of tensor data over all shards
    bool has_total_size; // absent in some hand-made indexes
} StIndex;

// Parses and checks index text (`path` names it in messages): weight_map must be an object of
// shard file names (no '/', not "." or "..", at most 255 bytes) and metadata.total_size, when
// present, a non-negative integer. On failure returns -1 with a message naming path and entry.
int st_index_parse(StIndex *ix, const char *text, size_t len, const char *path, MoeErr err);
int st_index_load(StIndex *ix, const char *path, MoeErr err); // reads the file, then parses
void st_index_free(StIndex *ix);

const char *st_index_file(const StIndex *ix, const char *tensor); // its shard, NULL if absent
// "DIR/PREFIX.safetensors.index.json" into buf.
void st_index_path(char *buf, size_t len, const char *dir, const char *prefix);
// Writes DIR/PREFIX.safetensors.index.json (fsynced, not renamed: for a temporary directory) from
// the shard files DIR/PREFIX-*: every tensor of each mapped to its file, and their bytes summed
// into total_size. Opening each shard also validates it.
int st_index_write(const char *dir, const char *prefix, MoeErr err);

// The tensors of one kind of a safetensors checkpoint directory, found by name: through
// PREFIX.safetensors.index.json and the shards it names, or in a single PREFIX.safetensors (a
// moe.c checkpoint's "model" and "optimizer" files, a Hugging Face model's "model" files). Shards
// open on first use and stay open until the set is closed.
#pragma once
#include <stdbool.h>
#include <stddef.h>

#include "common/util.h"
#include "io/safetensors.h"
#include "io/safetensors_index.h"

typedef struct {
    char dir[4096], prefix[64];
    StIndex index;      // the index (index.map NULL: a single file)
    char **names;       // (n) files opened so far
    SafeTensors **files; // (n) each allocated once: pointers to them stay valid
    size_t n;
} StSet;

// Whether DIR holds PREFIX.safetensors.index.json or PREFIX.safetensors.
bool st_set_exists(const char *dir, const char *prefix);
// Reads the index when there is one; fails naming the directory when neither file is there.
int st_set_open(StSet *s, const char *dir, const char *prefix, MoeErr err);
void st_set_close(StSet *s);
// The tensor `name` and the open file that holds it (into *file); NULL with a message naming the
// index or the file when the set lacks it.
const StTensor *st_set_find(StSet *s, const char *name, const SafeTensors **file, MoeErr err);
// Every tensor name of the set (the index's weight_map, or the single file's tensors) into a
// malloc'd array the caller frees (the names belong to the set); -1 with a message on a bad file.
int st_set_names(StSet *s, const char ***names, size_t *n, MoeErr err);

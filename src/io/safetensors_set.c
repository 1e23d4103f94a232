// Tensors of a sharded or single-file safetensors checkpoint, found by name (see safetensors_set.h).
#include "io/safetensors_set.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "io/fsutil.h"

static void st_set_single_name(const StSet *s, char *buf, size_t len) {
    snprintf(buf, len, "%s.safetensors", s->prefix);
}

bool st_set_exists(const char *dir, const char *prefix) {
    char index[4300], single[4300];
    st_index_path(index, sizeof index, dir, prefix);
    snprintf(single, sizeof single, "%s/%s.safetensors", dir, prefix);
    return fs_exists(index) || fs_exists(single);
}

int st_set_open(StSet *s, const char *dir, const char *prefix, MoeErr err) {
    memset(s, 0, sizeof *s);
    snprintf(s->dir, sizeof s->dir, "%s", dir);
    snprintf(s->prefix, sizeof s->prefix, "%s", prefix);
    char path[4300];
    st_index_path(path, sizeof path, dir, prefix);
    if (fs_exists(path)) return st_index_load(&s->index, path, err);
    if (!st_set_exists(dir, prefix))
        return moe_err(err, "%s: holds neither %s.safetensors.index.json nor %s.safetensors", dir, prefix, prefix);
    return 0;
}

void st_set_close(StSet *s) {
    for (size_t i = 0; i < s->n; i++) st_close(s->files[i]), free(s->files[i]), free(s->names[i]);
    free(s->files), free(s->names);
    st_index_free(&s->index);
    memset(s, 0, sizeof *s);
}

// The shard file `file` (a name in s->dir), opened on first use.
static const SafeTensors *st_set_file(StSet *s, const char *file, MoeErr err) {
    for (size_t i = 0; i < s->n; i++)
        if (!strcmp(s->names[i], file)) return s->files[i];
    char path[4700];
    snprintf(path, sizeof path, "%s/%s", s->dir, file);
    SafeTensors *sf = moe_malloc(sizeof *sf);
    if (st_open(sf, path, err)) return free(sf), NULL;
    s->files = moe_realloc(s->files, (s->n + 1) * sizeof(SafeTensors *));
    s->names = moe_realloc(s->names, (s->n + 1) * sizeof(char *));
    s->files[s->n] = sf, s->names[s->n] = moe_strdup(file);
    return s->files[s->n++];
}

const StTensor *st_set_find(StSet *s, const char *name, const SafeTensors **file, MoeErr err) {
    char single[128];
    const char *f = single;
    if (s->index.map) f = st_index_file(&s->index, name);
    else st_set_single_name(s, single, sizeof single);
    if (!f) {
        moe_err(err, "%s: tensor '%s' is missing", s->index.path, name);
        return NULL;
    }
    const SafeTensors *sf = st_set_file(s, f, err);
    const StTensor *t = sf ? st_find(sf, name) : NULL;
    if (sf && !t) moe_err(err, "%s: tensor '%s' is missing", sf->path, name);
    *file = sf;
    return t;
}

int st_set_names(StSet *s, const char ***names, size_t *n, MoeErr err) {
    *names = NULL, *n = 0;
    if (s->index.map) {
        *names = moe_calloc(json_object_size(s->index.map) + 1, sizeof(char *));
        const char *key;
        json_t *value;
        json_object_foreach(s->index.map, key, value)(*names)[(*n)++] = key;
        return 0;
    }
    char single[128];
    st_set_single_name(s, single, sizeof single);
    const SafeTensors *sf = st_set_file(s, single, err);
    if (!sf) return -1;
    *names = moe_calloc(sf->n_tensors + 1, sizeof(char *));
    for (size_t i = 0; i < sf->n_tensors; i++) (*names)[(*n)++] = sf->tensors[i].name;
    return 0;
}

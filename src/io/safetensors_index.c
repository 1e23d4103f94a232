// Reader and writer of sharded-checkpoint indexes (see safetensors_index.h). A file name from the
// index is joined to the checkpoint folder, so names that would leave it ("../x", "/etc/x") are
// refused.
#include "io/safetensors_index.h"

#include "io/fsutil.h"
#include "io/safetensors.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ST_INDEX_MAX_NAME 255 // NAME_MAX of Linux file systems

// Why `name` is not a plain file name of the index's folder, or NULL when it is one.
static const char *st_index_bad_name(const char *name) {
    size_t n = strlen(name);
    if (n == 0) return "is empty";
    if (n > ST_INDEX_MAX_NAME) return "is longer than 255 bytes";
    if (strchr(name, '/')) return "contains '/' (shards must sit beside the index)";
    if (!strcmp(name, ".") || !strcmp(name, "..")) return "is not a file name";
    return NULL;
}

static int st_index_check_map(const StIndex *ix, MoeErr err) {
    const char *tensor;
    json_t *file;
    json_object_foreach(ix->map, tensor, file) {
        if (!json_is_string(file))
            return moe_err(err, "%s: weight_map entry '%s' is not a file name string", ix->path,
                           tensor);
        const char *why = st_index_bad_name(json_string_value(file));
        if (why)
            return moe_err(err, "%s: weight_map entry '%s': file name \"%.300s\" %s", ix->path,
                           tensor, json_string_value(file), why);
    }
    return 0;
}

static int st_index_check_total(StIndex *ix, const json_t *root, MoeErr err) {
    const json_t *meta = json_object_get(root, "metadata");
    const json_t *total = json_is_object(meta) ? json_object_get(meta, "total_size") : NULL;
    if (meta && !json_is_object(meta))
        return moe_err(err, "%s: \"metadata\" is not an object", ix->path);
    if (!total) return 0;
    if (!json_is_integer(total) || json_integer_value(total) < 0)
        return moe_err(err, "%s: metadata.total_size is not a non-negative integer", ix->path);
    ix->total_size = (uint64_t)json_integer_value(total), ix->has_total_size = true;
    return 0;
}

// Takes ownership of root (NULL: the JSON did not parse, jerr says why).
static int st_index_from_json(StIndex *ix, json_t *root, const json_error_t *jerr,
                              const char *path, MoeErr err) {
    memset(ix, 0, sizeof *ix);
    ix->path = moe_strdup(path);
    json_t *map = root ? json_object_get(root, "weight_map") : NULL;
    int rc = 0;
    if (!root)
        rc = moe_err(err, "%s: not a safetensors index: %s (line %d, column %d)", path, jerr->text,
                     jerr->line, jerr->column);
    else if (!json_is_object(map))
        rc = moe_err(err, "%s: not a safetensors index (no \"weight_map\" object of tensor names "
                     "to shard files)", path);
    if (!rc) {
        ix->map = json_incref(map);
        rc = st_index_check_map(ix, err);
    }
    if (!rc) rc = st_index_check_total(ix, root, err);
    json_decref(root);
    if (rc) st_index_free(ix);
    return rc;
}

int st_index_parse(StIndex *ix, const char *text, size_t len, const char *path, MoeErr err) {
    json_error_t jerr;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
    return st_index_from_json(ix, root, &jerr, path, err);
}

int st_index_load(StIndex *ix, const char *path, MoeErr err) {
    json_t *root = fs_load_json(path, "safetensors index", err); // a regular file, or a message
    if (!root) {
        memset(ix, 0, sizeof *ix);
        return -1;
    }
    return st_index_from_json(ix, root, NULL, path, err);
}

void st_index_free(StIndex *ix) {
    json_decref(ix->map);
    free(ix->path);
    memset(ix, 0, sizeof *ix);
}

const char *st_index_file(const StIndex *ix, const char *tensor) {
    return json_string_value(json_object_get(ix->map, tensor)); // NULL when absent
}

void st_index_path(char *buf, size_t len, const char *dir, const char *prefix) {
    snprintf(buf, len, "%s/%s.safetensors.index.json", dir, prefix);
}

int st_index_write(const char *dir, const char *prefix, MoeErr err) {
    DIR *d = opendir(dir);
    if (!d) return moe_err(err, "%s: cannot list (%s)", dir, strerror(errno));
    json_t *map = json_object();
    uint64_t total = 0;
    size_t plen = strlen(prefix);
    struct dirent *e;
    int rc = 0;
    while (!rc && (e = readdir(d))) {
        if (strncmp(e->d_name, prefix, plen) || e->d_name[plen] != '-') continue;
        char path[4300];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        SafeTensors sf;
        if ((rc = st_open(&sf, path, err))) break;
        for (size_t i = 0; i < sf.n_tensors; i++) {
            json_object_set_new(map, sf.tensors[i].name, json_string(e->d_name));
            total += sf.tensors[i].end - sf.tensors[i].begin;
        }
        st_close(&sf);
    }
    closedir(d);
    json_t *root = json_pack("{s:{s:I}, s:o}", "metadata", "total_size", (json_int_t)total,
                             "weight_map", map);
    char path[4300];
    st_index_path(path, sizeof path, dir, prefix);
    if (!rc) rc = fs_write_json_synced(path, root, err);
    json_decref(root);
    return rc;
}

// `moe ckpt verify`: checks a checkpoint directory without loading a model. For the model and the
// optimizer files: the index against the shards (every tensor it maps is in that shard, every
// tensor of a shard is mapped to it, total_size adds up, no shard left out) and every tensor's
// bytes against its checksum; then train_state.json. Problems are reported and counted, never
// fatal, so that one run lists them all.
#include <dirent.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"
#include "io/fsutil.h"
#include "io/safetensors.h"
#include "io/safetensors_index.h"

typedef struct {
    FILE *out;
    size_t problems;
    size_t files, tensors, checked, unchecked; // of the current kind (model or optimizer)
    uint64_t bytes;
} Verify;

static void verify_problem(Verify *v, const char *message) {
    fprintf(v->out, "  FAIL %s\n", message);
    v->problems++;
}

// Names of the files of one kind: the index's shards and the PREFIX-*.safetensors in the folder.
typedef struct {
    char **names;
    size_t n;
} NameList;

static void names_add(NameList *l, const char *name) {
    for (size_t i = 0; i < l->n; i++)
        if (!strcmp(l->names[i], name)) return;
    l->names = moe_realloc(l->names, (l->n + 1) * sizeof(char *));
    l->names[l->n++] = moe_strdup(name);
}

static void names_free(NameList *l) {
    for (size_t i = 0; i < l->n; i++) free(l->names[i]);
    free(l->names);
}

static bool is_shard_of(const char *name, const char *prefix) {
    size_t n = strlen(name), p = strlen(prefix), ext = strlen(".safetensors");
    return !strncmp(name, prefix, p) && name[p] == '-' && n > p + ext &&
           !strcmp(name + n - ext, ".safetensors");
}

static NameList shard_files(const char *dir, const char *prefix, const StIndex *ix) {
    NameList l = {0};
    const char *tensor;
    json_t *file;
    json_object_foreach(ix->map, tensor, file) names_add(&l, json_string_value(file));
    DIR *d = opendir(dir);
    for (struct dirent *e; d && (e = readdir(d));)
        if (is_shard_of(e->d_name, prefix)) names_add(&l, e->d_name);
    if (d) closedir(d);
    return l;
}

// Every tensor of an open file against its checksum (and, with an index, against the index).
static void verify_tensors(Verify *v, const SafeTensors *st, const char *file, const StIndex *ix) {
    MoeErr err;
    for (size_t i = 0; i < st->n_tensors; i++) {
        const StTensor *t = &st->tensors[i];
        const char *mapped = ix ? st_index_file(ix, t->name) : file;
        if (!mapped || strcmp(mapped, file)) {
            moe_err(err, "%s: tensor '%s' is in %s but the index %s", ix->path,
                     t->name, file, mapped ? "maps it to another file" : "does not list it");
            verify_problem(v, err);
        }
        v->tensors++, v->bytes += t->end - t->begin;
        if (!t->has_checksum) v->unchecked++;
        else if (st_verify(st, t, err)) verify_problem(v, err);
        else v->checked++;
    }
}

// Each tensor the index maps to `file` must be in it.
static void verify_index_entries(Verify *v, const SafeTensors *st, const char *file,
                                 const StIndex *ix) {
    const char *tensor;
    json_t *mapped;
    json_object_foreach(ix->map, tensor, mapped) {
        if (strcmp(json_string_value(mapped), file) || st_find(st, tensor)) continue;
        MoeErr err;
        moe_err(err, "%s: tensor '%s' is mapped to %s, which does not hold it",
                 ix->path, tensor, file);
        verify_problem(v, err);
    }
}

static void verify_file(Verify *v, const char *dir, const char *file, const StIndex *ix) {
    char path[4400];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    SafeTensors st;
    MoeErr err;
    v->files++;
    if (st_open(&st, path, err)) {
        verify_problem(v, err);
        return;
    }
    verify_tensors(v, &st, file, ix);
    if (ix) verify_index_entries(v, &st, file, ix);
    st_close(&st);
}

static void verify_indexed(Verify *v, const char *dir, const char *prefix, const char *index) {
    StIndex ix;
    MoeErr err;
    if (st_index_load(&ix, index, err)) {
        verify_problem(v, err);
        return;
    }
    NameList files = shard_files(dir, prefix, &ix);
    for (size_t i = 0; i < files.n; i++) verify_file(v, dir, files.names[i], &ix);
    if (ix.has_total_size && ix.total_size != v->bytes) {
        moe_err(err, "%s: metadata.total_size is %llu but the shards hold %llu bytes "
                 "of tensors", index, (unsigned long long)ix.total_size,
                 (unsigned long long)v->bytes);
        verify_problem(v, err);
    }
    names_free(&files);
    st_index_free(&ix);
}

// One kind of file: PREFIX.safetensors.index.json and its shards, or a single PREFIX.safetensors.
static void verify_kind(Verify *v, const char *dir, const char *prefix, bool required) {
    char index[4300], single[4300], file[64];
    st_index_path(index, sizeof index, dir, prefix);
    snprintf(file, sizeof file, "%s.safetensors", prefix);
    snprintf(single, sizeof single, "%s/%s", dir, file);
    v->files = v->tensors = v->checked = v->unchecked = 0, v->bytes = 0;
    size_t before = v->problems;
    if (fs_exists(index)) verify_indexed(v, dir, prefix, index);
    else if (fs_exists(single)) verify_file(v, dir, file, NULL);
    else {
        if (required) {
            MoeErr err;
            moe_err(err, "%s: neither %s nor %s", dir, index, single);
            verify_problem(v, err);
        } else {
            fprintf(v->out, "  %s: none (weights only: a run resumed from it starts the AdamW moments from zero)\n", prefix);
        }
        return;
    }
    char bytes[32];
    fprintf(v->out, "  %s: %zu file%s, %zu tensors, %s bytes: %zu checksums match", prefix,
            v->files, v->files == 1 ? "" : "s", v->tensors, moe_fmt_count(bytes, sizeof bytes, v->bytes),
            v->checked);
    if (v->unchecked) fprintf(v->out, ", %zu tensors have none (written before checksums)", v->unchecked);
    fprintf(v->out, "%s\n", v->problems > before ? "; problems above" : "");
}

size_t ckpt_verify(const char *ckpt_dir, FILE *out) {
    Verify v = {.out = out};
    fprintf(out, "checkpoint %s\n", ckpt_dir);
    verify_kind(&v, ckpt_dir, "model", true);
    verify_kind(&v, ckpt_dir, "optimizer", false);
    Config cfg;
    TrainState state;
    MoeErr err;
    if (ckpt_read_state(ckpt_dir, &cfg, &state, err)) verify_problem(&v, err);
    else fprintf(out, "  train_state.json: step %lld, config valid\n", (long long)state.step);
    return v.problems;
}

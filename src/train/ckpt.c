// Checkpoint save, discovery and load (see ckpt.h).
#include "ckpt.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "io/fsutil.h"
#include "io/safetensors.h"
#include "train.h"

#define CKPT_FORMAT "moe.c checkpoint 1"

// One tensor of a checkpoint file: a name and where its values live in backend memory.
typedef struct {
    char name[PARAM_NAME_LEN + 16];
    size_t rows, cols;  // held here; cols 0: a vector
    size_t global_rows; // rows of the global tensor in the file
    size_t row_begin;   // first global row held here
    void *data;         // f32 buffer
} CkptTensor;

// The tensors of model.safetensors (moments = false) or optimizer.safetensors (moments = true).
static CkptTensor *ckpt_tensors(Model *m, bool moments, size_t *n) {
    const ModelConfig *c = &m->cfg;
    size_t cap = m->reg.n * 2 + (size_t)c->n_layers, k = 0;
    CkptTensor *t = moe_calloc(cap, sizeof(CkptTensor));
    for (size_t i = 0; i < m->reg.n; i++) {
        const ParamInfo *p = &m->reg.p[i];
        for (int which = 0; which < (moments ? 2 : 1); which++) {
            CkptTensor *x = &t[k++];
            if (moments) snprintf(x->name, sizeof x->name, "%s.%s", p->name, which ? "exp_avg_sq" : "exp_avg");
            else snprintf(x->name, sizeof x->name, "%s", p->name);
            x->rows = p->shape[0], x->cols = p->ndim == 2 ? p->shape[1] : 0;
            x->global_rows = p->global_rows, x->row_begin = p->row_begin;
            void *base = !moments ? m->params : which ? m->adam_v : m->adam_m;
            x->data = model_f32(m, base, p->offset);
        }
    }
    for (int l = c->n_dense_layers; l < c->n_layers && !moments; l++) {
        CkptTensor *x = &t[k++];
        snprintf(x->name, sizeof x->name, "model.layers.%d.mlp.expert_bias", l);
        x->rows = x->global_rows = c->n_experts, x->cols = 0;
        x->data = model_f32(m, m->expert_bias, (size_t)l * c->n_experts);
    }
    *n = k;
    return t;
}

static int write_tensor_file(const char *path, Model *m, bool moments, int step, MoeErr err) {
    size_t n;
    CkptTensor *t = ckpt_tensors(m, moments, &n);
    StWriter w;
    if (st_writer_open(&w, path, err)) return free(t), -1;
    char step_text[32];
    snprintf(step_text, sizeof step_text, "%d", step);
    st_writer_meta(&w, "format", CKPT_FORMAT);
    st_writer_meta(&w, "step", step_text);
    for (size_t i = 0; i < n; i++) {
        MOE_ASSERT(t[i].rows == t[i].global_rows); // slices are gathered before writing
        size_t shape[2] = {t[i].rows, t[i].cols};
        st_writer_add(&w, t[i].name, ST_F32, t[i].cols ? 2 : 1, shape);
    }
    int rc = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        size_t count = t[i].rows * (t[i].cols ? t[i].cols : 1);
        float *host = moe_malloc(count * sizeof(float));
        m->ops->download_f32(host, t[i].data, count);
        rc = st_writer_write(&w, host, count * sizeof(float), err);
        free(host);
    }
    free(t);
    if (rc) {
        st_writer_abort(&w);
        return -1;
    }
    if (st_writer_close(&w, err)) return unlink(path), -1;
    return 0;
}

static int write_state(const char *path, const Config *cfg, const TrainState *st, MoeErr err) {
    json_t *root = json_object();
    json_object_set_new(root, "format", json_string(CKPT_FORMAT));
    json_object_set_new(root, "step", json_integer(st->step));
    json_object_set_new(root, "data_position", json_integer((json_int_t)st->data_position));
    json_object_set_new(root, "config", config_to_json(cfg));
    int rc = fs_write_json_synced(path, root, err);
    json_decref(root);
    return rc;
}

// Parses "step-N"; returns N or -1.
static int step_of(const char *name) {
    if (strncmp(name, "step-", 5) || !name[5]) return -1;
    char *end;
    long v = strtol(name + 5, &end, 10);
    return *end || v < 0 || v > 2147483647L ? -1 : (int)v;
}

// Steps of all checkpoint directories in run_dir, ascending; returns the count.
static size_t list_steps(const char *run_dir, int **steps) {
    *steps = NULL;
    DIR *d = opendir(run_dir);
    if (!d) return 0;
    size_t n = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        int s = step_of(e->d_name);
        if (s < 0) continue;
        *steps = moe_realloc(*steps, (n + 1) * sizeof(int));
        (*steps)[n++] = s;
    }
    closedir(d);
    for (size_t i = 1; i < n; i++) // insertion sort: few entries
        for (size_t j = i; j > 0 && (*steps)[j - 1] > (*steps)[j]; j--) {
            int tmp = (*steps)[j];
            (*steps)[j] = (*steps)[j - 1], (*steps)[j - 1] = tmp;
        }
    return n;
}

static void prune(const char *run_dir, int keep) {
    int *steps;
    size_t n = list_steps(run_dir, &steps);
    for (size_t i = 0; i + (size_t)keep < n; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/step-%d", run_dir, steps[i]);
        fs_remove_tree(path);
    }
    free(steps);
}

int ckpt_save(const char *run_dir, Model *m, const Config *cfg, const TrainState *st, int keep,
              MoeErr err) {
    char tmp[4096], final[4096], old[4096], file[4200];
    snprintf(tmp, sizeof tmp, "%s/.tmp-step-%d", run_dir, st->step);
    snprintf(final, sizeof final, "%s/step-%d", run_dir, st->step);
    snprintf(old, sizeof old, "%s/.old-step-%d", run_dir, st->step);
    fs_remove_tree(tmp);
    if (fs_mkdir_p(tmp, err)) return -1;
    int rc = 0;
    snprintf(file, sizeof file, "%s/model.safetensors", tmp);
    rc = rc ? rc : write_tensor_file(file, m, false, st->step, err);
    snprintf(file, sizeof file, "%s/optimizer.safetensors", tmp);
    rc = rc ? rc : write_tensor_file(file, m, true, st->step, err);
    snprintf(file, sizeof file, "%s/train_state.json", tmp);
    rc = rc ? rc : write_state(file, cfg, st, err);
    rc = rc ? rc : fs_fsync_dir(tmp, err);
    if (rc) {
        fs_remove_tree(tmp);
        return -1;
    }
    // A checkpoint of the same step may exist (a resumed run saving again): swap it out whole.
    if (fs_exists(final) && rename(final, old))
        return fs_remove_tree(tmp), moe_err(err, "%s: cannot replace (%s)", final, strerror(errno));
    if (rename(tmp, final))
        return fs_remove_tree(tmp), moe_err(err, "%s: cannot rename into place (%s)", final, strerror(errno));
    fs_remove_tree(old);
    if (fs_fsync_dir(run_dir, err)) return -1;
    prune(run_dir, keep);
    return 0;
}

int ckpt_latest(const char *run_dir, char *path, size_t len) {
    int *steps;
    size_t n = list_steps(run_dir, &steps);
    int step = n ? steps[n - 1] : -1;
    free(steps);
    if (step >= 0) snprintf(path, len, "%s/step-%d", run_dir, step);
    return step;
}

void ckpt_clean_partial(const char *run_dir) {
    DIR *d = opendir(run_dir);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (strncmp(e->d_name, ".tmp-step-", 10) && strncmp(e->d_name, ".old-step-", 10)) continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", run_dir, e->d_name);
        fs_remove_tree(path);
    }
    closedir(d);
}

int ckpt_resolve(const char *arg, char *path, size_t len, MoeErr err) {
    char state[4200];
    snprintf(state, sizeof state, "%s/train_state.json", arg);
    if (fs_exists(state)) {
        snprintf(path, len, "%s", arg);
        return 0;
    }
    if (!fs_is_dir(arg)) return moe_err(err, "%s: no such checkpoint or run directory", arg);
    if (ckpt_latest(arg, path, len) < 0)
        return moe_err(err, "%s: holds no checkpoint (no step-N directory with train_state.json)", arg);
    return 0;
}

int ckpt_read_state(const char *ckpt_dir, Config *cfg, TrainState *st, MoeErr err) {
    char path[4200];
    snprintf(path, sizeof path, "%s/train_state.json", ckpt_dir);
    json_error_t jerr;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &jerr);
    if (!root) return moe_err(err, "%s: cannot read checkpoint state (%s)", path, jerr.text);
    json_t *format = json_object_get(root, "format"), *step = json_object_get(root, "step");
    json_t *pos = json_object_get(root, "data_position"), *config = json_object_get(root, "config");
    int rc = 0;
    if (!json_is_string(format) || strcmp(json_string_value(format), CKPT_FORMAT))
        rc = moe_err(err, "%s: not a moe.c checkpoint state (key 'format' must be \"%s\")", path, CKPT_FORMAT);
    else if (!json_is_integer(step) || !json_is_integer(pos) || json_integer_value(step) < 0 ||
             json_integer_value(pos) < 0)
        rc = moe_err(err, "%s: keys 'step' and 'data_position' must be non-negative integers", path);
    else if (!config)
        rc = moe_err(err, "%s: key 'config' is missing", path);
    if (!rc) {
        config_defaults(cfg);
        rc = config_apply_json(cfg, config, path, err);
    }
    MoeErr why;
    if (!rc && config_validate(cfg, why)) rc = moe_err(err, "%s: saved config: %.400s", path, why);
    if (!rc) st->step = (int)json_integer_value(step), st->data_position = (uint64_t)json_integer_value(pos);
    json_decref(root);
    return rc;
}

static int load_tensor(const SafeTensors *sf, const CkptTensor *t, Model *m, MoeErr err) {
    const StTensor *x = st_find(sf, t->name);
    if (!x) return moe_err(err, "%s: tensor '%s' is missing", sf->path, t->name);
    size_t ndim = t->cols ? 2 : 1, width = t->cols ? t->cols : 1, count = t->rows * width;
    if ((size_t)x->ndim != ndim || x->shape[0] != t->global_rows || (ndim == 2 && x->shape[1] != t->cols))
        return moe_err(err, "%s: tensor '%s' has shape [%zu%s%zu] in the file but the model needs "
                       "[%zu%s%zu]", sf->path, t->name, x->shape[0], x->ndim > 1 ? ", " : "",
                       x->ndim > 1 ? x->shape[1] : 0, t->global_rows, t->cols ? ", " : "", t->cols);
    float *host = moe_malloc(count * sizeof(float));
    int rc = st_read_f32(sf, x, t->row_begin * width, count, host, err);
    if (!rc) m->ops->upload_f32(t->data, host, count);
    free(host);
    return rc;
}

static int load_file(const char *path, Model *m, bool moments, MoeErr err) {
    SafeTensors sf;
    if (st_open(&sf, path, err)) return -1;
    size_t n;
    CkptTensor *t = ckpt_tensors(m, moments, &n);
    int rc = 0;
    for (size_t i = 0; i < n && !rc; i++) rc = load_tensor(&sf, &t[i], m, err);
    free(t);
    st_close(&sf);
    return rc;
}

int ckpt_load(const char *ckpt_dir, Model *m, bool with_optimizer, MoeErr err) {
    char path[4300];
    snprintf(path, sizeof path, "%s/model.safetensors", ckpt_dir);
    if (load_file(path, m, false, err)) return -1;
    if (with_optimizer) {
        snprintf(path, sizeof path, "%s/optimizer.safetensors", ckpt_dir);
        if (load_file(path, m, true, err)) return -1;
    }
    model_sync_compute_weights(m);
    return 0;
}

void ckpt_open_model(const char *arg, Config *cfg, Model *m, size_t B, size_t S) {
    MoeErr err;
    char dir[4200];
    TrainState st;
    if (ckpt_resolve(arg, dir, sizeof dir, err) || ckpt_read_state(dir, cfg, &st, err))
        moe_fatal("%s", err);
    model_init(m, &cfg->model, train_backend(cfg), B ? B : (size_t)cfg->train.micro_batch,
               S ? S : (size_t)cfg->train.seq_len);
    if (ckpt_load(dir, m, false, err)) moe_fatal("%s", err);
}

// Checkpoint save, discovery and load (see ckpt.h).
#include "ckpt.h"

#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "io/fsutil.h"
#include "io/safetensors.h"
#include "io/safetensors_index.h"
#include "io/safetensors_set.h"

// ---------------------------------------------------------------- which tensors a rank writes

// One tensor of a checkpoint file: a name and where its values live in backend memory.
typedef struct {
    char name[PARAM_NAME_LEN + 16];
    size_t rows, cols;  // cols 0: a vector
    void *data;         // f32 buffer
} CkptTensor;

typedef struct {
    CkptTensor *t;
    size_t n, cap;
} TensorList;

static void list_add(TensorList *l, const char *name, const char *suffix, size_t rows, size_t cols,
                     void *data) {
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 64;
        l->t = moe_realloc(l->t, l->cap * sizeof(CkptTensor));
    }
    CkptTensor *x = &l->t[l->n++];
    snprintf(x->name, sizeof x->name, "%s%s", name, suffix);
    x->rows = rows, x->cols = cols, x->data = data;
}

// Where the values of each region are for this rank's files: the weights or the AdamW moments
// (m, v), whole (gathered from the shards where they are sharded).
typedef struct {
    void *w[PARAM_N_REGIONS], *m[PARAM_N_REGIONS], *v[PARAM_N_REGIONS];
    bool owned[3][PARAM_N_REGIONS]; // w, m, v: gathered into a buffer of their own
} RegionValues;

// Dense tensors are written by the first data-parallel rank of a stage, a rank's experts by the
// first rank of its expert-data-parallel group; both are whole tensors.
static bool writes_region(const Model *m, ParamRegion r) {
    return m->reg.region_size[r] > 0 && model_region_group(m, r)->rank == 0;
}

static void list_param(TensorList *l, Model *m, const ParamInfo *p, const RegionValues *rv, bool moments) {
    size_t cols = p->ndim == 2 ? p->shape[1] : 0;
    MOE_ASSERT(p->shape[0] == p->global_rows); // slices are gathered before writing
    ParamRegion r = params_region(p);
    size_t rel = p->offset - m->reg.region_begin[r];
    if (!moments) {
        list_add(l, p->name, "", p->shape[0], cols, model_f32(m, rv->w[r], rel));
        return;
    }
    list_add(l, p->name, ".exp_avg", p->shape[0], cols, model_f32(m, rv->m[r], rel));
    list_add(l, p->name, ".exp_avg_sq", p->shape[0], cols, model_f32(m, rv->v[r], rel));
}

static TensorList file_tensors(Model *m, const RegionValues *rv, bool moments) {
    TensorList l = {0};
    for (size_t i = 0; i < m->reg.n; i++) {
        const ParamInfo *p = &m->reg.p[i];
        if (writes_region(m, params_region(p))) list_param(&l, m, p, rv, moments);
    }
    const ModelConfig *c = &m->cfg;
    if (!moments && writes_region(m, PARAM_DENSE))
        for (int layer = 0; layer < c->n_layers; layer++) {
            if (!model_holds_layer(m, layer) || !model_layer_is_moe(c, layer)) continue;
            char name[PARAM_NAME_LEN];
            snprintf(name, sizeof name, "model.layers.%d.mlp.expert_bias", layer);
            list_add(&l, name, "", c->n_experts, 0, model_f32(m, m->expert_bias, (size_t)layer * c->n_experts));
        }
    return l;
}

// ---------------------------------------------------------------- writing

// A checkpoint is a state to come back to: one with a NaN or infinity is never written.
static int check_finite(const char *path, const char *name, const float *x, size_t n, MoeErr err) {
    size_t i = moe_first_non_finite(x, n);
    if (i == n) return 0;
    return moe_err(err, "%s: tensor '%s' holds %g at element %zu: weights or AdamW moments that are not "
                   "finite are not saved (the run diverged; try a lower train.lr)", path, name, x[i], i);
}

static int write_tensor_file(const char *path, Model *m, const TensorList *l, int64_t step, MoeErr err) {
    StWriter w;
    if (st_writer_open(&w, path, err)) return -1;
    char step_text[32];
    snprintf(step_text, sizeof step_text, "%" PRId64, step);
    st_writer_meta(&w, "format", CKPT_FORMAT);
    st_writer_meta(&w, "step", step_text);
    for (size_t i = 0; i < l->n; i++) {
        size_t shape[2] = {l->t[i].rows, l->t[i].cols};
        st_writer_add(&w, l->t[i].name, ST_F32, l->t[i].cols ? 2 : 1, shape);
    }
    int rc = 0;
    for (size_t i = 0; i < l->n && !rc; i++) {
        size_t count = l->t[i].rows * (l->t[i].cols ? l->t[i].cols : 1);
        float *host = moe_malloc(count * sizeof(float));
        m->ops->download_f32(host, l->t[i].data, count);
        rc = check_finite(path, l->t[i].name, host, count, err);
        if (!rc) rc = st_writer_write(&w, host, count * sizeof(float), err);
        free(host);
    }
    if (rc) {
        st_writer_abort(&w);
        return -1;
    }
    if (st_writer_close(&w, err)) return unlink(path), -1;
    return 0;
}

static void shard_name(char *buf, size_t len, const char *dir, const char *prefix, int k, int n) {
    snprintf(buf, len, "%s/%s-%05d-of-%05d.safetensors", dir, prefix, k + 1, n);
}

// The values of a pass's file (the weights; or the moments) whole for the writers (collective).
static void gather_values(RegionValues *rv, const Optimizer *o, Model *m, bool moments) {
    for (int r = 0; r < PARAM_N_REGIONS; r++) {
        const OptShard *s = &o->region[r];
        if (moments) {
            rv->m[r] = model_gather_region(m, (ParamRegion)r, s->m, s->shard, &rv->owned[1][r]);
            rv->v[r] = model_gather_region(m, (ParamRegion)r, s->v, s->shard, &rv->owned[2][r]);
        } else {
            rv->w[r] = model_gather_region(m, (ParamRegion)r, model_master(m, m->master_begin[r]),
                                           m->master_size[r], &rv->owned[0][r]);
        }
    }
}

static void free_values(RegionValues *rv, Model *m) {
    void **bufs[3] = {rv->w, rv->m, rv->v};
    for (int k = 0; k < 3; k++)
        for (int r = 0; r < PARAM_N_REGIONS; r++)
            if (rv->owned[k][r]) m->ops->free(bufs[k][r]);
}

// This rank's model and optimizer shard files (nothing when it owns no tensors), one kind at a
// time: only one kind's gathered regions are held at once.
static int write_rank_files(const char *tmp, Model *m, const Optimizer *o, int64_t step, MoeErr err) {
    const Layout *lay = &m->par->lay;
    int k = lay->stage * lay->ep + lay->ep_rank, n = lay->pp * lay->ep;
    char path[4300];
    int rc = 0;
    for (int moments = 0; moments < 2; moments++) {
        RegionValues rv = {0};
        gather_values(&rv, o, m, moments);
        TensorList l = file_tensors(m, &rv, moments);
        shard_name(path, sizeof path, tmp, moments ? "optimizer" : "model", k, n);
        if (l.n && !rc) rc = write_tensor_file(path, m, &l, step, err);
        free(l.t);
        free_values(&rv, m);
    }
    return rc;
}

int ckpt_write_state(const char *ckpt_dir, const Config *cfg, const TrainState *st, const Layout *lay,
                     MoeErr err) {
    char path[4200];
    snprintf(path, sizeof path, "%s/train_state.json", ckpt_dir);
    json_t *root = json_object();
    json_object_set_new(root, "format", json_string(CKPT_FORMAT));
    json_object_set_new(root, "step", json_integer(st->step));
    json_object_set_new(root, "data_position", json_integer((json_int_t)st->data_position));
    json_object_set_new(root, "written_by", lay ? json_pack("{s:i, s:i, s:i}", "pp", lay->pp, "dp", lay->dp,
                                                            "ep", lay->ep) : json_string("moe import"));
    json_object_set_new(root, "config", config_to_json(cfg));
    int rc = fs_write_json_synced(path, root, err);
    json_decref(root);
    return rc;
}

// Parses "step-N" (N a 64-bit count of steps); returns N or -1.
static int64_t step_of(const char *name) {
    if (strncmp(name, "step-", 5) || name[5] < '0' || name[5] > '9') return -1;
    char *end;
    errno = 0;
    long long v = strtoll(name + 5, &end, 10);
    return *end || errno ? -1 : (int64_t)v;
}

// Steps of all checkpoint directories in run_dir, ascending; returns the count.
static size_t list_steps(const char *run_dir, int64_t **steps) {
    *steps = NULL;
    DIR *d = opendir(run_dir);
    if (!d) return 0;
    size_t n = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        int64_t s = step_of(e->d_name);
        if (s < 0) continue;
        *steps = moe_realloc(*steps, (n + 1) * sizeof(int64_t));
        (*steps)[n++] = s;
    }
    closedir(d);
    for (size_t i = 1; i < n; i++) // insertion sort: few entries
        for (size_t j = i; j > 0 && (*steps)[j - 1] > (*steps)[j]; j--) {
            int64_t tmp = (*steps)[j];
            (*steps)[j] = (*steps)[j - 1], (*steps)[j - 1] = tmp;
        }
    return n;
}

static void prune(const char *run_dir, int keep) {
    int64_t *steps;
    size_t n = list_steps(run_dir, &steps);
    for (size_t i = 0; i + (size_t)keep < n; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/step-%" PRId64, run_dir, steps[i]);
        fs_remove_tree(path);
    }
    free(steps);
}

// Rank 0's part: indices and state into the temporary directory, then the atomic rename.
static int publish(const char *run_dir, const char *tmp, const Config *cfg, const TrainState *st,
                   const Layout *lay, int keep, MoeErr err) {
    char final[4096], old[4096];
    snprintf(final, sizeof final, "%s/step-%" PRId64, run_dir, st->step);
    snprintf(old, sizeof old, "%s/.old-step-%" PRId64, run_dir, st->step);
    if (st_index_write(tmp, "model", err) || st_index_write(tmp, "optimizer", err) ||
        ckpt_write_state(tmp, cfg, st, lay, err) || fs_fsync_dir(tmp, err))
        return -1;
    // A checkpoint of the same step may exist (a resumed run saving again): swap it out whole.
    if (fs_replace_dir(tmp, final, old, err)) return -1;
    prune(run_dir, keep);
    return 0;
}

int ckpt_save(const char *run_dir, Model *m, const Optimizer *o, const Config *cfg,
              const TrainState *st, int keep, MoeErr err) {
    Comm *w = m->par->world;
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s/.tmp-step-%" PRId64, run_dir, st->step);
    int rc = 0;
    if (w->rank == 0) {
        fs_remove_tree(tmp);
        rc = fs_mkdir_p(tmp, err);
    }
    if (!w->ops->all_ok(w, rc == 0))
        return rc ? -1 : moe_err(err, "rank 0 could not create %s", tmp);
    rc = write_rank_files(tmp, m, o, st->step, err);
    bool written = w->ops->all_ok(w, rc == 0);
    if (written && w->rank == 0) rc = publish(run_dir, tmp, cfg, st, &m->par->lay, keep, err);
    if (w->rank == 0 && (!written || rc)) fs_remove_tree(tmp);
    bool published = w->ops->all_ok(w, rc == 0);
    if (rc) return -1;
    if (!written) return moe_err(err, "another rank could not write its checkpoint files");
    if (!published) return moe_err(err, "rank 0 could not complete the checkpoint");
    return 0;
}

// ---------------------------------------------------------------- discovery

int64_t ckpt_latest(const char *run_dir, char *path, size_t len) {
    int64_t *steps;
    size_t n = list_steps(run_dir, &steps);
    int64_t step = n ? steps[n - 1] : -1;
    free(steps);
    if (step >= 0) snprintf(path, len, "%s/step-%" PRId64, run_dir, step);
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
    json_t *root = fs_load_json(path, "checkpoint state", err);
    if (!root) return -1;
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
    if (!rc) st->step = (int64_t)json_integer_value(step), st->data_position = (uint64_t)json_integer_value(pos);
    json_decref(root);
    return rc;
}

// ---------------------------------------------------------------- reading

// Reads elements [first, first + count) of the global tensor `name` (rows x cols) into dst (f32).
static int read_range(StSet *r, Model *m, const char *name, size_t rows, size_t cols,
                      size_t first, size_t count, void *dst, MoeErr err) {
    const SafeTensors *sf;
    const StTensor *x = st_set_find(r, name, &sf, err);
    if (!x) return -1;
    size_t ndim = cols ? 2 : 1;
    if ((size_t)x->ndim != ndim || x->shape[0] != rows || (ndim == 2 && x->shape[1] != cols))
        return moe_err(err, "%s: tensor '%s' has shape [%zu%s%zu] in the file but the model needs "
                       "[%zu%s%zu]", sf->path, name, x->shape[0], x->ndim > 1 ? ", " : "",
                       x->ndim > 1 ? x->shape[1] : 0, rows, cols ? ", " : "", cols);
    // A whole tensor's read checks its checksum; for a slice (this rank's share of the
    // moments) the whole tensor is read once more to check it.
    if (count != x->numel && st_verify(sf, x, err)) return -1;
    float *host = moe_malloc((count ? count : 1) * sizeof(float));
    int rc = st_read_f32(sf, x, first, count, host, err);
    size_t bad = rc ? count : moe_first_non_finite(host, count);
    if (bad < count)
        rc = moe_err(err, "%s: tensor '%s' holds %g at element %zu: a checkpoint with values that are not "
                     "finite cannot be used (resume from an earlier step-N)", sf->path, name, host[bad], first + bad);
    if (!rc) m->ops->upload_f32(dst, host, count);
    free(host);
    return rc;
}

static size_t param_cols(const ParamInfo *p) { return p->ndim == 2 ? p->shape[1] : 0; }

// Reads the elements in flat [lo, hi) of tensor p's values (its name + suffix) to `base`, where
// element lo lives (nothing when p has none there).
static int read_part(StSet *r, Model *m, const ParamInfo *p, const char *suffix, size_t lo, size_t hi,
                     void *base, MoeErr err) {
    size_t a, b;
    if (!params_part(p, lo, hi, &a, &b)) return 0;
    size_t cols = param_cols(p), first = p->row_begin * (cols ? cols : 1) + (a - p->offset);
    char name[PARAM_NAME_LEN + 16];
    snprintf(name, sizeof name, "%s%s", p->name, suffix);
    return read_range(r, m, name, p->global_rows, cols, first, b - a, model_f32(m, base, a - lo), err);
}

// Each rank reads the part of every tensor its master weights hold.
static int load_weights(StSet *r, Model *m, MoeErr err) {
    for (size_t i = 0; i < m->reg.n; i++) {
        const ParamInfo *p = &m->reg.p[i];
        size_t lo = m->master_begin[params_region(p)], hi = lo + m->master_size[params_region(p)];
        if (read_part(r, m, p, "", lo, hi, model_master(m, lo), err)) return -1;
    }
    const ModelConfig *c = &m->cfg;
    for (int l = 0; l < c->n_layers; l++) {
        if (!model_holds_layer(m, l) || !model_layer_is_moe(c, l)) continue;
        char name[PARAM_NAME_LEN];
        snprintf(name, sizeof name, "model.layers.%d.mlp.expert_bias", l);
        if (read_range(r, m, name, c->n_experts, 0, 0, c->n_experts,
                       model_f32(m, m->expert_bias, (size_t)l * c->n_experts), err))
            return -1;
    }
    return 0;
}

// Each rank reads the part of every tensor's moments that falls in its shards.
static int load_moments(StSet *r, Model *m, const Optimizer *o, MoeErr err) {
    for (size_t i = 0; i < m->reg.n; i++) {
        const ParamInfo *p = &m->reg.p[i];
        const OptShard *s = &o->region[params_region(p)];
        size_t lo = s->shard_begin, hi = lo + s->shard;
        if (read_part(r, m, p, ".exp_avg", lo, hi, s->m, err) || read_part(r, m, p, ".exp_avg_sq", lo, hi, s->v, err))
            return -1;
    }
    return 0;
}

bool ckpt_has_moments(const char *ckpt_dir) { return st_set_exists(ckpt_dir, "optimizer"); }

int ckpt_load(const char *ckpt_dir, Model *m, const Optimizer *o, MoeErr err) {
    StSet r;
    if (st_set_open(&r, ckpt_dir, "model", err)) return -1;
    m->ops->zero(m->params, m->master_len * m->ops->f32_size); // region padding is zero
    int rc = load_weights(&r, m, err);
    st_set_close(&r);
    if (!rc && o) {
        if (st_set_open(&r, ckpt_dir, "optimizer", err)) return -1;
        rc = load_moments(&r, m, o, err);
        st_set_close(&r);
    }
    if (!rc) model_sync_compute_weights(m);
    return rc;
}

// Hugging Face export and import (see hf.h): the list of tensors from the parameter registry, the
// safetensors shards and their index, the output directory, and the tokenizer files.
#include "train/hf.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "io/fsutil.h"
#include "io/safetensors_set.h"
#include "model/model.h"
#include "train/ckpt.h"
#include "train/setup.h"

// ---------------------------------------------------------------- which tensors

// One tensor of the output and where its values come from in the input.
typedef struct {
    char name[PARAM_NAME_LEN + 16];
    char src[PARAM_NAME_LEN + 16]; // "" : zeros (the balancing bias of an import)
    int ndim;
    size_t shape[2];
    size_t numel;
} HfTensor;

typedef struct {
    HfTensor *t;
    size_t n;
} HfTensors;

static void tensors_add(HfTensors *l, const char *name, const char *src, int ndim, const size_t *shape) {
    l->t = moe_realloc(l->t, (l->n + 1) * sizeof(HfTensor));
    HfTensor *x = &l->t[l->n++];
    snprintf(x->name, sizeof x->name, "%s", name);
    snprintf(x->src, sizeof x->src, "%s", src);
    x->ndim = ndim, x->shape[0] = shape[0], x->shape[1] = ndim == 2 ? shape[1] : 0;
    x->numel = ndim == 2 ? shape[0] * shape[1] : shape[0];
}

// Every parameter of cfg's model, from the registry of a one-process model sized on the counting
// backend (nothing is allocated), so the names and shapes are exactly those moe.c trains. Export:
// transformers names from moe.c ones; import: the reverse, the LM head from the embedding when
// tied, and the zero balancing bias of each MoE layer (which transformers does not have).
static HfTensors hf_model_tensors(const Config *cfg, HfClass cls, bool export, bool tied) {
    Parallel par;
    Model m;
    setup_single_process(&par, cfg);
    model_init(&m, &cfg->model, ops_counting(false), &par, 1, 1, 1, 1, (ModelModes){0}); // the registry alone
    HfTensors l = {0};
    for (size_t i = 0; i < m.reg.n; i++) {
        const ParamInfo *p = &m.reg.p[i];
        char hf[PARAM_NAME_LEN + 16];
        hf_tensor_name(cls, p->name, hf, sizeof hf);
        if (tied && !strcmp(p->name, "lm_head.weight")) snprintf(hf, sizeof hf, "model.embed_tokens.weight");
        tensors_add(&l, export ? hf : p->name, export ? p->name : hf, p->ndim, p->shape);
    }
    const ModelConfig *c = &cfg->model;
    for (int layer = 0; layer < c->n_layers && !export; layer++) {
        char name[PARAM_NAME_LEN];
        size_t E = (size_t)c->n_experts;
        snprintf(name, sizeof name, "model.layers.%d.mlp.expert_bias", layer);
        if (model_layer_is_moe(c, layer)) tensors_add(&l, name, "", 1, &E);
    }
    model_free(&m);
    parallel_free(&par);
    return l;
}

// The values of t (numel floats) from the input set: its shape checked, every value finite.
static int read_source(StSet *src, const HfTensor *t, float *buf, MoeErr err) {
    if (!t->src[0]) {
        memset(buf, 0, t->numel * sizeof(float));
        return 0;
    }
    const SafeTensors *sf;
    const StTensor *x = st_set_find(src, t->src, &sf, err);
    if (!x) return -1;
    if (x->ndim != t->ndim || x->shape[0] != t->shape[0] || (t->ndim == 2 && x->shape[1] != t->shape[1])) {
        char have[64], want[64];
        st_format_shape(x->shape, x->ndim, have, sizeof have);
        st_format_shape(t->shape, t->ndim, want, sizeof want);
        return moe_err(err, "%s: tensor '%s' has shape %s but the config makes it %s", sf->path, t->src, have, want);
    }
    if (st_read_f32(sf, x, 0, t->numel, buf, err)) return -1;
    size_t bad = moe_first_non_finite(buf, t->numel);
    if (bad < t->numel)
        return moe_err(err, "%s: tensor '%s' holds %g at element %zu: weights that are not finite are not "
                       "converted", sf->path, t->src, buf[bad], bad);
    return 0;
}

// ---------------------------------------------------------------- shards

typedef struct {
    const char *dir;       // where the shards go
    StDtype dtype;         // F32 or BF16
    uint64_t max_bytes;    // per shard (a larger tensor gets a shard of its own)
    bool single_name;      // one shard is "model.safetensors" (Hugging Face), not model-00001-of-00001
    const char *format;    // "__metadata__" format: "pt" (transformers) or CKPT_FORMAT
} HfShards;

// Shard of each tensor, in order, starting a new one when the next tensor would pass max_bytes.
static size_t plan_shards(const HfTensors *l, const HfShards *w, size_t *shard_of) {
    size_t shard = 0;
    uint64_t bytes = 0, esize = st_dtype_size(w->dtype);
    for (size_t i = 0; i < l->n; i++) {
        uint64_t size = l->t[i].numel * esize;
        if (bytes && bytes + size > w->max_bytes) shard++, bytes = 0;
        shard_of[i] = shard, bytes += size;
    }
    return l->n ? shard + 1 : 0;
}

static int write_values(StWriter *sw, StDtype dtype, const float *x, size_t n, MoeErr err) {
    if (dtype == ST_F32) return st_writer_write(sw, x, n * sizeof(float), err);
    uint16_t *half = moe_malloc((n ? n : 1) * sizeof(uint16_t));
    for (size_t i = 0; i < n; i++) half[i] = st_f32_to_bf16(x[i]);
    int rc = st_writer_write(sw, half, n * sizeof(uint16_t), err);
    free(half);
    return rc;
}

static int write_shard(const HfShards *w, const HfTensors *l, const size_t *shard_of, size_t k, size_t n,
                       StSet *src, MoeErr err) {
    char path[4400];
    if (n == 1 && w->single_name) snprintf(path, sizeof path, "%s/model.safetensors", w->dir);
    else snprintf(path, sizeof path, "%s/model-%05zu-of-%05zu.safetensors", w->dir, k + 1, n);
    StWriter sw;
    if (st_writer_open(&sw, path, err)) return -1;
    st_writer_meta(&sw, "format", w->format);
    for (size_t i = 0; i < l->n; i++)
        if (shard_of[i] == k) st_writer_add(&sw, l->t[i].name, w->dtype, l->t[i].ndim, l->t[i].shape);
    int rc = 0;
    for (size_t i = 0; i < l->n && !rc; i++) {
        if (shard_of[i] != k) continue;
        float *buf = moe_malloc((l->t[i].numel ? l->t[i].numel : 1) * sizeof(float));
        rc = read_source(src, &l->t[i], buf, err);
        if (!rc) rc = write_values(&sw, w->dtype, buf, l->t[i].numel, err);
        free(buf);
    }
    if (rc) st_writer_abort(&sw);
    return rc || st_writer_close(&sw, err) ? -1 : 0;
}

// The tensors of l into shards of w->dir (with model.safetensors.index.json when there are several,
// or always for a moe.c checkpoint); returns the shard count, or -1.
static long write_shards(const HfShards *w, const HfTensors *l, StSet *src, MoeErr err) {
    size_t *shard_of = moe_malloc((l->n ? l->n : 1) * sizeof(size_t));
    size_t n = plan_shards(l, w, shard_of);
    int rc = 0;
    for (size_t k = 0; k < n && !rc; k++) rc = write_shard(w, l, shard_of, k, n, src, err);
    free(shard_of);
    if (!rc && (n > 1 || !w->single_name)) rc = st_index_write(w->dir, "model", err);
    return rc ? -1 : (long)n;
}

// ---------------------------------------------------------------- the output directory

// Written whole into a hidden temporary directory beside it, then renamed into place.
typedef struct {
    char final[4096], tmp[4200], old[4200];
} HfOut;

// Whether `inner` (an existing path) is `outer` or inside it.
static bool path_within(const char *inner, const char *outer) {
    char a[PATH_MAX], b[PATH_MAX];
    if (!realpath(inner, a) || !realpath(outer, b)) return false;
    size_t n = strlen(b);
    return !strncmp(a, b, n) && (a[n] == 0 || a[n] == '/' || n == 1);
}

// Refuses an output that is not a directory, a non-empty one without --force, one that is not an
// earlier export or import (no config.json) even with it, and one holding the input.
static int out_begin(HfOut *d, const char *out, const char *input, bool force, MoeErr err) {
    snprintf(d->final, sizeof d->final, "%s", out);
    for (size_t n = strlen(d->final); n > 1 && d->final[n - 1] == '/'; n--) d->final[n - 1] = 0;
    char config[4200], parent[4096];
    snprintf(config, sizeof config, "%s/config.json", d->final);
    if (fs_exists(d->final) && !fs_is_dir(d->final))
        return moe_err(err, "%s exists and is not a directory; choose another output directory", d->final);
    if (fs_exists(d->final) && path_within(input, d->final))
        return moe_err(err, "%s holds the input %s; choose another output directory", d->final, input);
    if (fs_is_dir(d->final) && !fs_dir_empty(d->final) && !force)
        return moe_err(err, "%s is not empty; pass --force to replace it (everything in it is deleted)", d->final);
    if (fs_is_dir(d->final) && !fs_dir_empty(d->final) && !fs_exists(config))
        return moe_err(err, "%s is not empty and holds no config.json, so it is not an earlier export or "
                       "import; --force replaces only those: choose another output directory", d->final);
    const char *base = fs_split(d->final, parent, sizeof parent);
    snprintf(d->tmp, sizeof d->tmp, "%s/.%s.moe-tmp", parent, base);
    snprintf(d->old, sizeof d->old, "%s/.%s.moe-old", parent, base);
    fs_remove_tree(d->tmp), fs_remove_tree(d->old); // left by a run that crashed
    return fs_mkdir_p(d->tmp, err);
}

static int out_publish(HfOut *d, int rc, MoeErr err) {
    if (!rc) rc = fs_fsync_dir(d->tmp, err) || fs_replace_dir(d->tmp, d->final, d->old, err) ? -1 : 0;
    if (rc) fs_remove_tree(d->tmp);
    return rc;
}

static int write_json(const char *dir, const char *file, json_t *j, MoeErr err) {
    char path[4400];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    int rc = fs_write_json_synced(path, j, err);
    json_decref(j);
    return rc;
}

// ---------------------------------------------------------------- tokenizer

#define HF_EOS_TOKEN "<|endoftext|>"

// The character GPT-2's ByteLevel pre-tokenizer writes for byte b: printable bytes stand for
// themselves, the others for U+0100 onwards in byte order.
static unsigned byte_char(unsigned b) {
    unsigned n = 0;
    for (unsigned x = 0; x < 256; x++) {
        bool printable = (x >= '!' && x <= '~') || (x >= 0xa1 && x <= 0xac) || x >= 0xae;
        if (x == b) return printable ? b : 256 + n;
        n += !printable;
    }
    return 0;
}

// A tokenizer.json whose ids are the bytes (0..255) and EOS 256: a ByteLevel pre-tokenizer without
// its splitting regex and a BPE model without merges, so every byte is one token.
static json_t *byte_tokenizer_json(void) {
    json_t *vocab = json_object();
    for (unsigned b = 0; b < 256; b++) {
        unsigned c = byte_char(b);
        char utf8[3] = {(char)c, 0, 0};
        if (c >= 0x80) utf8[0] = (char)(0xc0 | c >> 6), utf8[1] = (char)(0x80 | (c & 0x3f));
        json_object_set_new(vocab, utf8, json_integer(b));
    }
    json_t *level = json_pack("{s:s, s:b, s:b, s:b}", "type", "ByteLevel", "add_prefix_space", 0,
                              "trim_offsets", 0, "use_regex", 0);
    return json_pack("{s:s, s:n, s:n, s:[{s:i, s:s, s:b, s:b, s:b, s:b, s:b}], s:n, s:O, s:n, s:o, "
                     "s:{s:s, s:n, s:n, s:n, s:n, s:b, s:b, s:b, s:o, s:[]}}",
                     "version", "1.0", "truncation", "padding",
                     "added_tokens", "id", 256, "content", HF_EOS_TOKEN, "single_word", 0, "lstrip", 0,
                     "rstrip", 0, "normalized", 0, "special", 1,
                     "normalizer", "pre_tokenizer", level, "post_processor", "decoder", level,
                     "model", "type", "BPE", "dropout", "unk_token", "continuing_subword_prefix",
                     "end_of_word_suffix", "fuse_unk", 0, "byte_fallback", 0, "ignore_merges", 0,
                     "vocab", vocab, "merges");
}

int hf_write_tokenizer(const char *dir, const Config *cfg, const char *tokenizer_json, const char **what,
                       MoeErr err) {
    char path[4400];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    bool bytes = !tokenizer_json && hf_byte_eos(&cfg->model) >= 0;
    *what = tokenizer_json ? tokenizer_json : bytes ? "byte-level"
                                                    : "none (the run's vocabulary is not the byte one: pass --tokenizer FILE)";
    if (!tokenizer_json && !bytes) return 0;
    int rc = tokenizer_json ? fs_copy_file(tokenizer_json, path, "tokenizer", err)
                            : write_json(dir, "tokenizer.json", byte_tokenizer_json(), err);
    // The literal text "<|endoftext|>" stays bytes (split_special_tokens), as moe data prepare reads it.
    json_t *config = json_pack("{s:s, s:i, s:b}", "tokenizer_class", "PreTrainedTokenizerFast",
                               "model_max_length", cfg->train.seq_len, "clean_up_tokenization_spaces", 0);
    if (bytes) json_object_update_new(config, json_pack("{s:s, s:b}", "eos_token", HF_EOS_TOKEN, "split_special_tokens", 1));
    if (!rc) return write_json(dir, "tokenizer_config.json", config, err);
    json_decref(config);
    return rc;
}

// ---------------------------------------------------------------- export

// The loss-free balancing bias steers which experts moe.c picks; transformers routes by the scores
// alone, so a bias that differs between the experts of a layer cannot be exported (one that is the
// same for all of them picks the same experts and is dropped).
static int check_expert_bias(StSet *src, const ModelConfig *c, HfClass cls, MoeErr err) {
    size_t E = (size_t)c->n_experts;
    float *b = moe_malloc(E * sizeof(float));
    int rc = 0;
    for (int layer = 0; layer < c->n_layers && !rc; layer++) {
        if (!model_layer_is_moe(c, layer)) continue;
        HfTensor t = {.ndim = 1, .shape = {E}, .numel = E};
        snprintf(t.src, sizeof t.src, "model.layers.%d.mlp.expert_bias", layer);
        if ((rc = read_source(src, &t, b, err))) break;
        for (size_t e = 1; e < E && !rc; e++)
            if (b[e] != b[0])
                rc = moe_err(err, "cannot export to Hugging Face: %s cannot express the loss-free balancing bias "
                             "(model.bias_gamma = %g): tensor '%s' differs between experts (%g for expert 0, %g "
                             "for expert %zu), so it changes which experts moe.c picks, and %s routes by the "
                             "router's scores alone", hf_class_name(cls), c->bias_gamma, t.src, b[0], b[e], e,
                             hf_class_name(cls));
    }
    free(b);
    return rc;
}

int hf_export(const char *ckpt_arg, const char *out_dir, const HfOptions *o, MoeErr err) {
    char dir[4200];
    Config cfg;
    TrainState st;
    HfClass cls;
    StSet src;
    if (ckpt_resolve(ckpt_arg, dir, sizeof dir, err) || ckpt_read_state(dir, &cfg, &st, err) ||
        hf_class_of(&cfg.model, &cls, err) || st_set_open(&src, dir, "model", err))
        return -1;
    HfOut d;
    int rc = check_expert_bias(&src, &cfg.model, cls, err);
    if (!rc) rc = out_begin(&d, out_dir, dir, o->force, err);
    if (rc) return st_set_close(&src), -1;
    HfTensors l = hf_model_tensors(&cfg, cls, true, false);
    HfShards w = {d.tmp, o->bf16 ? ST_BF16 : ST_F32, o->max_shard_bytes, true, "pt"};
    long shards = write_shards(&w, &l, &src, err);
    const char *tokenizer = "";
    rc = shards < 0 || write_json(d.tmp, "config.json", hf_config_json(&cfg, cls, o->bf16), err) ||
         write_json(d.tmp, "generation_config.json", hf_generation_config_json(&cfg), err) ||
         hf_write_tokenizer(d.tmp, &cfg, o->tokenizer, &tokenizer, err) ? -1 : 0;
    rc = out_publish(&d, rc, err);
    if (!rc)
        printf("exported %s (step %lld) to %s: %s, %zu tensors in %ld file%s (%s); tokenizer: %s\n", dir,
               (long long)st.step, d.final, hf_class_name(cls), l.n, shards, shards == 1 ? "" : "s",
               o->bf16 ? "bf16" : "fp32", tokenizer);
    free(l.t);
    st_set_close(&src);
    return rc;
}

// ---------------------------------------------------------------- import

// Every tensor of the input must become one of moe.c's (a tensor of a layer moe.c does not have
// would otherwise be dropped without a word); a tied LM head's copy and RoPE tables are not needed.
static int check_all_used(StSet *src, const HfTensors *l, bool tied, MoeErr err) {
    const char **names;
    size_t n;
    if (st_set_names(src, &names, &n, err)) return -1;
    int rc = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        bool used = (tied && !strcmp(names[i], "lm_head.weight")) || strstr(names[i], "rotary_emb.inv_freq");
        for (size_t j = 0; j < l->n && !used; j++) used = !strcmp(l->t[j].src, names[i]);
        if (!used)
            rc = moe_err(err, "%s: tensor '%s' is not part of the model config.json describes (moe.c reads "
                         "per-expert weights mlp.experts.N.{gate,up,down}_proj.weight); nothing was imported",
                         src->dir, names[i]);
    }
    free(names);
    return rc;
}

int hf_import(const char *hf_dir, const char *out_dir, const HfOptions *o, MoeErr err) {
    char path[4200];
    snprintf(path, sizeof path, "%s/config.json", hf_dir);
    Config cfg;
    HfClass cls;
    bool tied;
    StSet src;
    if (hf_config_read(path, &cfg, &cls, &tied, err) || st_set_open(&src, hf_dir, "model", err)) return -1;
    HfTensors l = hf_model_tensors(&cfg, cls, false, tied);
    HfOut d;
    char out_key[4200];
    snprintf(out_key, sizeof out_key, "train.out=%s", out_dir); // the run directory it becomes
    int rc = check_all_used(&src, &l, tied, err) || config_apply_override(&cfg, out_key, err) ? -1 : 0;
    if (!rc) rc = out_begin(&d, out_dir, hf_dir, o->force, err);
    if (!rc) {
        char step[4300];
        snprintf(step, sizeof step, "%s/step-0", d.tmp);
        HfShards w = {step, ST_F32, o->max_shard_bytes, false, CKPT_FORMAT};
        TrainState st = {0};
        rc = fs_mkdir_p(step, err) || write_shards(&w, &l, &src, err) < 0 ||
             ckpt_write_state(step, &cfg, &st, NULL, err) || fs_fsync_dir(step, err) ||
             write_json(d.tmp, "config.json", config_to_json(&cfg), err) ? -1 : 0;
        rc = out_publish(&d, rc, err);
    }
    if (!rc) {
        printf("imported %s (%s, %zu tensors) to %s/step-0: FP32 weights, no optimizer state\n", hf_dir,
               hf_class_name(cls), l.n, d.final);
        if (tied)
            printf("note: tie_word_embeddings: lm_head.weight is a copy of model.embed_tokens.weight (moe.c's "
                   "LM head is its own tensor; training moves the two apart)\n");
    }
    free(l.t);
    st_set_close(&src);
    return rc;
}

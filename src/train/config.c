// The key table and everything it drives: JSON config files, dotted overrides, help text, the
// saved config.json, comparison of model sections, and suggestions for mistyped keys.
#include "config.h"

#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "dist/parallel.h"
#include "io/fsutil.h"

typedef enum { KEY_INT, KEY_REAL, KEY_BOOL, KEY_STR, KEY_ENUM } KeyType;

typedef struct {
    const char *key;
    KeyType type;
    size_t offset;             // into Config
    size_t size;               // bytes of a string field
    const char *const *names;  // enum values, NULL-terminated
    const char *help;
} ConfigKey;

static const char *const QK_NORM_NAMES[] = {"none", "full", "head", NULL};
static const char *const NORM_NAMES[] = {"pre", "reordered", NULL};
static const char *const ROUTER_NAMES[] = {"softmax", "sigmoid", NULL};
static const char *const SCHED_NAMES[] = {"cosine", "linear", "constant", NULL};
static const char *const RECOMPUTE_NAMES[] = {"none", "selective", "full", NULL};
static const char *const EXCHANGE_NAMES[] = {"auto", "direct", "sendrecv", NULL}; // ExchangeMode
static const char *const PRECISION_NAMES[] = {"bf16", "fp8", NULL};
static const char *const FP8_RECIPE_NAMES[] = {"blockwise", "blockwise_pow2", NULL};

// One table row per key; the section and field names become the dotted key.
#define F(sec, fld) .key = #sec "." #fld, .offset = offsetof(Config, sec.fld)
#define INT(sec, fld, h) {F(sec, fld), .type = KEY_INT, .help = h}
#define REAL(sec, fld, h) {F(sec, fld), .type = KEY_REAL, .help = h}
#define BOOL(sec, fld, h) {F(sec, fld), .type = KEY_BOOL, .help = h}
#define STR(sec, fld, h)                                                                         \
    {F(sec, fld), .type = KEY_STR, .size = sizeof(((Config *)0)->sec.fld), .help = h}
#define ENUM(sec, fld, n, h) {F(sec, fld), .type = KEY_ENUM, .names = n, .help = h}

static const ConfigKey KEYS[] = {
    INT(model, vocab_size, "vocabulary size V (token ids must be below it)"),
    INT(model, d_model, "model width D"),
    INT(model, n_layers, "number of transformer blocks L"),
    INT(model, n_heads, "query heads"),
    INT(model, n_kv_heads, "key/value heads (grouped-query attention; divides n_heads)"),
    INT(model, head_dim, "head width (0: d_model / n_heads)"),
    REAL(model, rope_theta, "RoPE base"),
    REAL(model, norm_eps, "RMSNorm epsilon"),
    ENUM(model, qk_norm, QK_NORM_NAMES, "QK-norm over the full q/k width, per head, or none"),
    ENUM(model, norm_placement, NORM_NAMES, "pre-norm (HF OLMoE) or reordered norm (OLMo-core)"),
    INT(model, n_dense_layers, "leading layers with a dense SwiGLU instead of experts"),
    INT(model, dense_hidden, "hidden width of the dense layers"),
    INT(model, n_experts, "experts per MoE layer E"),
    INT(model, top_k, "experts per token K"),
    INT(model, expert_hidden, "expert hidden width H"),
    INT(model, shared_hidden, "hidden width of a shared expert (0: none)"),
    ENUM(model, router, ROUTER_NAMES, "router score function"),
    BOOL(model, norm_topk_prob, "renormalise the chosen expert weights to sum 1"),
    REAL(model, capacity_factor, "0: dropless; else per-expert capacity ceil(cf T K / E)"),
    BOOL(model, random_routing, "benchmark mode: uniform noise replaces router scores"),
    REAL(model, lb_coef, "load-balance loss coefficient (OLMo-core formula, mean over layers)"),
    REAL(model, z_coef, "router z-loss coefficient (mean over layers)"),
    REAL(model, lm_z_coef, "LM-head z-loss coefficient"),
    REAL(model, bias_gamma, "loss-free balancing bias step (0: off)"),
    REAL(model, init_std, "std of the truncated-normal initialisation"),
    INT(train, steps, "optimizer steps of the run"),
    INT(train, micro_batch, "sequences per micro-batch, over all data-parallel ranks together"),
    INT(train, micro_batches, "micro-batches per optimizer step (gradient accumulation)"),
    INT(train, seq_len, "sequence length S"),
    REAL(train, lr, "peak learning rate"),
    REAL(train, min_lr_ratio, "final learning rate as a fraction of lr"),
    INT(train, warmup, "linear warmup steps"),
    ENUM(train, schedule, SCHED_NAMES, "learning-rate decay after warmup"),
    REAL(train, weight_decay, "AdamW decoupled weight decay (none on norms and embeddings)"),
    REAL(train, beta1, "AdamW beta1"),
    REAL(train, beta2, "AdamW beta2"),
    REAL(train, eps, "AdamW epsilon"),
    REAL(train, clip, "global gradient-norm clip (0: off)"),
    INT(train, seed, "seed of initialisation, data order and routing noise"),
    INT(train, log_every, "steps between progress lines"),
    INT(train, eval_every, "steps between validation losses (0: never)"),
    INT(train, eval_batches, "micro-batches of validation data per evaluation"),
    INT(train, ckpt_every, "steps between checkpoints (0: only at the end)"),
    INT(train, keep_ckpts, "checkpoints kept (older ones are deleted)"),
    STR(train, out, "run directory: config.json, metrics.jsonl, step-N/ checkpoints"),
    STR(train, device, "compute backend: cpu, cuda (a build with make CUDA=1), or cpu-sharded (the CPU with a "
                       "compute copy of the weights apart from the fp32 master weights, which are then sharded "
                       "over the data-parallel ranks as on a GPU: tests that layout)"),
    INT(train, threads, "CPU threads (0: all cores; at most 4 per core are used, 4096 at most)"),
    ENUM(train, recompute, RECOMPUTE_NAMES, "activations recomputed in the backward instead of kept: none; "
                                            "selective (QK-norm + RoPE, norm, SwiGLU, router-score outputs, "
                                            "dispatched rows and, with pre-norm, the residual after attention); "
                                            "full (only each layer's input kept, the forward rerun in the backward)"),
    ENUM(train, precision, PRECISION_NAMES, "expert GEMMs and dense linear layers in bf16 (fp32 on the CPU) or "
                                            "fp8: E4M3 operands with fp32 block scales (train.fp8_recipe; the "
                                            "dense layers as train.fp8_dense says), emulated by the CPU backend"),
    ENUM(train, fp8_recipe, FP8_RECIPE_NAMES, "fp8 scaling: blockwise (DeepSeek-V3: 1x128 activation and 128x128 "
                                              "weight blocks, scale amax / 448) or blockwise_pow2 (power-of-two "
                                              "scales)"),
    BOOL(train, fp8_dense, "with precision fp8: the dense linear layers (QKV and output projections, dense and "
                           "shared MLPs) in FP8 too; false keeps them in bf16 beside FP8 experts (the router and "
                           "the LM head always are): a slower step whose losses stay closer to bf16's (docs/FP8.md)"),
    BOOL(train, fp8_dense_qkv, "with precision fp8 and train.fp8_dense: the attention's QKV projection in FP8 "
                               "too; false keeps it alone in bf16 (to see which dense layer moves a run's "
                               "losses, docs/FP8.md)"),
    BOOL(train, fp8_dense_out, "with precision fp8 and train.fp8_dense: the attention's output projection in "
                               "FP8 too; false keeps it alone in bf16 (as train.fp8_dense_qkv)"),
    BOOL(train, fp8_qkv_forward, "with the QKV projection in FP8 (train.fp8_dense, train.fp8_dense_qkv): its "
                                 "forward product in FP8 too; false runs that one product in bf16, its input and "
                                 "weight gradients still in FP8 (docs/FP8.md)"),
    BOOL(train, fp8_fused_dispatch, "with precision fp8 and one expert-parallel rank: the experts' FP8 "
                                    "inputs and output gradients quantised straight from the tokens' rows, "
                                    "so the dispatch and the combine's backward copy none (the same "
                                    "results, two passes a layer less, three with selective recompute)"),
    BOOL(train, fp8_fused_swiglu, "with precision fp8: the experts' SwiGLU backward writes the FP8 operands "
                                  "of the products it feeds (the gate|up gradient's rows and token-major "
                                  "copy; with one expert-parallel rank the weighted h's token-major copy) "
                                  "instead of bf16 tensors that are quantised after (the same results, "
                                  "full-size passes a layer less; expert_hidden a multiple of 128 and "
                                  "train.fp8_exchange off, else no effect)"),
    BOOL(train, fp8_wgrad_blocks, "with precision fp8: the weight gradients read their inputs (the "
                                  "activations) with a scale per 128 tokens x 128 columns, as the weights, "
                                  "instead of one per column and 128 tokens: the experts' products then "
                                  "promote as the forward's do (~25% faster alone), at a coarser "
                                  "quantisation of those operands (docs/FP8.md)"),
    BOOL(train, fp8_fused_update, "with precision fp8: the optimizer's update of the experts' weights writes "
                                  "their FP8 copies in the same pass instead of a bf16 copy that is quantised "
                                  "after (the same results, 4 bytes a parameter less to move), where one rank "
                                  "holds each expert's master weights whole; where several share them, each "
                                  "quantises its part and they gather codes instead of bf16 weights"),
    BOOL(train, fp8_exchange, "with precision fp8: the experts' inputs and their output gradients travel "
                              "between expert-parallel ranks as E4M3 codes and fp32 scales (D + 4 D / 128 "
                              "bytes a row instead of 2 D) and the weight gradients read them dequantised "
                              "(one rounding more; set it alike on every layout compared, one rank included)"),
    BOOL(train, deterministic, "GPU runs bitwise reproducible: cuDNN's deterministic attention backward "
                               "(every other kernel sums in a fixed order always; the CPU always is)"),
    REAL(train, comm_timeout, "seconds without progress before a rank of a multi-rank run ends "
                              "the job (a peer died or hangs; 0: wait forever)"),
    BOOL(train, launch_ahead, "queue each step before the previous step's metrics are read, so the host's part "
                              "(batch, uploads, graph launch) overlaps the device's work (same results)"),
    BOOL(train, optimizer_overlap, "each step's parameter update (AdamW, weight gather, FP8 copies) runs layer "
                                   "by layer beside the next step's forward, each layer's before its forward "
                                   "reads it (same results)"),
    STR(data, train, "training tokens: a file, a comma list, or a mix file (.txt/.mix)"),
    STR(data, val, "validation tokens (empty: no validation)"),
    INT(data, token_bytes, "2 or 4 bytes per token in headerless files (0: from vocab_size)"),
    STR(data, tokenizer, "tokenizer.json the data was made with (moe data prepare --tokenizer); moe sample "
                         "decodes with it (empty: bytes)"),
    STR(data, tokenizer_xxh3, "XXH3-64 of data.tokenizer, filled in by moe train (empty); a run refuses a "
                              "tokenizer file that differs from it"),
    INT(parallel, pp, "pipeline stages (data-parallel size = ranks / pp)"),
    INT(parallel, ep, "expert-parallel ranks per MoE layer (divides the data-parallel size)"),
    INT(parallel, virtual_stages, "model chunks per pipeline stage: > 1 interleaves the 1F1B schedule (a smaller "
                                  "bubble for more activations; train.micro_batches a multiple of parallel.pp)"),
    ENUM(parallel, exchange, EXCHANGE_NAMES, "expert rows between ranks: written into the owner's "
                                             "memory (direct, one node), NCCL/MPI transfers (sendrecv), or auto"),
    REAL(parallel, recv_capacity, "direct exchange: rows a rank's experts can receive, in units of the rows "
                                  "it routes (0: room for the worst case; past it rows are dropped and counted)"),
    INT(parallel, exchange_chunks, "direct exchange: chunks of each MoE layer's experts (lowered to the most that "
                                   "divide the experts held here evenly); a chunk's rows travel while the previous "
                                   "chunk computes (1: the exchange, then the experts)"),
    INT(parallel, push_ctas, "thread blocks (GPU SMs) of a row push while it overlaps compute (exchange_chunks > "
                             "1; with 1 a push runs alone on every SM; 0: no bound)"),
    BOOL(parallel, overlap_grad_reduce, "reduce-scatter gradients in buckets of whole layers during the "
                                        "backward of the layers before them (false: all after the backward)"),
    REAL(parallel, grad_bucket_mb, "least MB of fp32 gradients reduced at once during the backward (smaller "
                                   "layers join the next; 0: every layer alone)"),
};
#define N_KEYS (sizeof KEYS / sizeof KEYS[0])

void config_defaults(Config *c) {
    memset(c, 0, sizeof *c);
    model_config_defaults(&c->model);
    c->train = (TrainConfig){
        .steps = 600, .micro_batch = 16, .micro_batches = 1, .seq_len = 128,
        .lr = 3e-3, .min_lr_ratio = 0.1, .warmup = 30, .schedule = SCHED_COSINE,
        .weight_decay = 0.1, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .clip = 1.0,
        .seed = 1, .log_every = 10, .eval_every = 100, .eval_batches = 20,
        .ckpt_every = 200, .keep_ckpts = 2, .fp8_dense = true, .fp8_dense_qkv = true, .fp8_dense_out = true,
        .fp8_qkv_forward = true, .fp8_fused_dispatch = true, .fp8_fused_swiglu = true,
        .fp8_wgrad_blocks = true, .fp8_fused_update = true,
    };
    snprintf(c->train.out, sizeof c->train.out, "runs/default");
    snprintf(c->train.device, sizeof c->train.device, "cpu");
    snprintf(c->data.train, sizeof c->data.train, "data/tinyshakespeare_train.npy");
    snprintf(c->data.val, sizeof c->data.val, "data/tinyshakespeare_val.npy");
    config_reset_placement(c);
}

void config_reset_placement(Config *c) {
    c->parallel = (ParallelConfig){.pp = 1, .ep = 1, .virtual_stages = 1, .overlap_grad_reduce = true,
                                   .grad_bucket_mb = 32, .exchange_chunks = 1, .push_ctas = 24};
    snprintf(c->train.device, sizeof c->train.device, "cpu");
    c->train.threads = 0;
    c->train.comm_timeout = 600;
    c->train.launch_ahead = true;
    c->train.optimizer_overlap = false;
}

static const ConfigKey *find_key(const char *key) {
    for (size_t i = 0; i < N_KEYS; i++)
        if (!strcmp(KEYS[i].key, key)) return &KEYS[i];
    return NULL;
}

static int unknown_key(const char *key, const char *source, MoeErr err) {
    const char *names[N_KEYS];
    for (size_t i = 0; i < N_KEYS; i++) names[i] = KEYS[i].key;
    const char *guess = moe_suggest(key, names, N_KEYS);
    char hint[160] = "";
    if (guess) snprintf(hint, sizeof hint, " (did you mean '%s'?)", guess);
    else snprintf(hint, sizeof hint, " (`moe train --help` lists every key)");
    return moe_err(err, "%s: config key '%s' is unknown%s", source, key, hint);
}

// A section is known when some key starts with "section.".
static bool known_section(const char *section) {
    size_t len = strlen(section);
    for (size_t i = 0; i < N_KEYS; i++)
        if (!strncmp(KEYS[i].key, section, len) && KEYS[i].key[len] == '.') return true;
    return false;
}

static int enum_index(const ConfigKey *k, const char *v) {
    for (int i = 0; k->names[i]; i++)
        if (!strcmp(k->names[i], v)) return i;
    return -1;
}

static int bad_value(const ConfigKey *k, const char *text, const char *source, MoeErr err) {
    static const char *const WHAT[] = {"an integer", "a number", "true or false", "a string", ""};
    if (k->type != KEY_ENUM)
        return moe_err(err, "%s: config key '%s' must be %s, got '%s'", source, k->key,
                       WHAT[k->type], text);
    char choices[256] = "";
    for (int i = 0; k->names[i]; i++)
        snprintf(choices + strlen(choices), sizeof choices - strlen(choices), "%s%s",
                 i ? ", " : "", k->names[i]);
    return moe_err(err, "%s: config key '%s' must be one of %s, got '%s'", source, k->key,
                   choices, text);
}

// Parses text into the field of key k; the one parser serves both overrides and JSON values.
static int set_from_text(Config *c, const ConfigKey *k, const char *text, const char *source,
                         MoeErr err) {
    char *field = (char *)c + k->offset, *end;
    errno = 0;
    switch (k->type) {
    case KEY_INT: {
        long v = strtol(text, &end, 10);
        if (!*text || *end || errno || v < -2147483647L || v > 2147483647L) break;
        *(int *)field = (int)v;
        return 0;
    }
    case KEY_REAL: {
        double v = strtod(text, &end);
        if (!*text || *end || errno || !isfinite(v)) break;
        *(double *)field = v;
        return 0;
    }
    case KEY_BOOL:
        if (strcmp(text, "true") && strcmp(text, "false") && strcmp(text, "1") && strcmp(text, "0"))
            break;
        *(bool *)field = !strcmp(text, "true") || !strcmp(text, "1");
        return 0;
    case KEY_STR: {
        if (strlen(text) >= k->size)
            return moe_err(err, "%s: config key '%s' is longer than %zu characters", source,
                           k->key, k->size - 1);
        json_t *utf8 = json_string(text); // NULL unless UTF-8: config.json could not hold it
        if (!utf8)
            return moe_err(err, "%s: config key '%s' is not UTF-8 text (config.json must be able "
                           "to save it); rename the path", source, k->key);
        json_decref(utf8);
        snprintf(field, k->size, "%s", text);
        return 0;
    }
    case KEY_ENUM: {
        int i = enum_index(k, text);
        if (i < 0) break;
        *(int *)field = i;
        return 0;
    }
    }
    return bad_value(k, text, source, err);
}

// A JSON scalar as the text set_from_text parses; -1 when its JSON type cannot fit the key
// (buf then holds the JSON for the message). Integers are accepted for real-valued keys.
static int json_value_text(const ConfigKey *k, json_t *v, char *buf, size_t len) {
    bool textual = k->type == KEY_STR || k->type == KEY_ENUM;
    if (json_is_string(v) && textual)
        snprintf(buf, len, "%s", json_string_value(v));
    else if (json_is_integer(v) && (k->type == KEY_INT || k->type == KEY_REAL))
        snprintf(buf, len, "%" JSON_INTEGER_FORMAT, json_integer_value(v));
    else if (json_is_real(v) && k->type == KEY_REAL)
        snprintf(buf, len, "%.17g", json_real_value(v));
    else if (json_is_boolean(v) && k->type == KEY_BOOL)
        snprintf(buf, len, "%s", json_is_true(v) ? "true" : "false");
    else {
        char *s = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
        snprintf(buf, len, "%s", s ? s : "?");
        free(s);
        return -1;
    }
    return 0;
}

int config_apply_json(Config *c, json_t *root, const char *source, MoeErr err) {
    if (!json_is_object(root))
        return moe_err(err, "%s: a config must be a JSON object with sections \"model\", "
                       "\"train\" and \"data\"", source);
    const char *section;
    json_t *obj;
    json_object_foreach(root, section, obj) {
        if (!known_section(section)) return unknown_key(section, source, err);
        if (!json_is_object(obj))
            return moe_err(err, "%s: section '%s' must be a JSON object", source, section);
        const char *name;
        json_t *v;
        json_object_foreach(obj, name, v) {
            char key[256], text[CONFIG_PATH_LEN + 64];
            snprintf(key, sizeof key, "%s.%s", section, name);
            const ConfigKey *k = find_key(key);
            if (!k) return unknown_key(key, source, err);
            if (json_value_text(k, v, text, sizeof text)) return bad_value(k, text, source, err);
            if (set_from_text(c, k, text, source, err)) return -1;
        }
    }
    return 0;
}

int config_load_file(Config *c, const char *path, MoeErr err) {
    json_t *root = fs_load_json(path, "config file", err);
    if (!root) return -1;
    int rc = config_apply_json(c, root, path, err);
    json_decref(root);
    return rc;
}

int config_apply_override(Config *c, const char *assignment, MoeErr err) {
    const char *eq = strchr(assignment, '=');
    if (!eq || eq == assignment)
        return moe_err(err, "argument '%s' is not a key=value override (e.g. train.steps=50)",
                       assignment);
    char key[256];
    snprintf(key, sizeof key, "%.*s", (int)(eq - assignment), assignment);
    const ConfigKey *k = find_key(key);
    if (!k) return unknown_key(key, "command line", err);
    return set_from_text(c, k, eq + 1, "command line", err);
}

static int check_train(const TrainConfig *t, MoeErr err) {
    const struct { int v; const char *key; int min; } ints[] = {
        {t->steps, "train.steps", 1},         {t->micro_batch, "train.micro_batch", 1},
        {t->micro_batches, "train.micro_batches", 1}, {t->seq_len, "train.seq_len", 1},
        {t->warmup, "train.warmup", 0},       {t->log_every, "train.log_every", 1},
        {t->eval_every, "train.eval_every", 0}, {t->eval_batches, "train.eval_batches", 1},
        {t->ckpt_every, "train.ckpt_every", 0}, {t->keep_ckpts, "train.keep_ckpts", 1},
        {t->threads, "train.threads", 0},
    };
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++)
        if (ints[i].v < ints[i].min)
            return moe_err(err, "config key '%s' = %d must be >= %d", ints[i].key, ints[i].v,
                           ints[i].min);
    if (!(t->lr > 0) || !(t->min_lr_ratio >= 0 && t->min_lr_ratio <= 1))
        return moe_err(err, "train.lr = %g must be > 0 and train.min_lr_ratio = %g in [0, 1]",
                       t->lr, t->min_lr_ratio);
    if (!(t->beta1 >= 0 && t->beta1 < 1) || !(t->beta2 >= 0 && t->beta2 < 1) || !(t->eps > 0))
        return moe_err(err, "train.beta1 = %g and train.beta2 = %g must be in [0, 1), train.eps "
                       "= %g > 0", t->beta1, t->beta2, t->eps);
    if (!(t->comm_timeout >= 0))
        return moe_err(err, "train.comm_timeout = %g must be >= 0 seconds (0: no watchdog)",
                       t->comm_timeout);
    if (!(t->weight_decay >= 0) || !(t->clip >= 0))
        return moe_err(err, "train.weight_decay = %g and train.clip = %g must be >= 0",
                       t->weight_decay, t->clip);
    if (strcmp(t->device, "cpu") && strcmp(t->device, "cuda") && strcmp(t->device, "cpu-sharded"))
        return moe_err(err, "train.device = '%s' is unknown (choices: cpu, cuda, cpu-sharded)", t->device);
    if (!t->out[0]) return moe_err(err, "train.out must name a run directory");
    if (t->threads > CONFIG_MAX_THREADS)
        return moe_err(err, "train.threads = %d is more than the %d threads moe.c runs (0: one per core)",
                       t->threads, CONFIG_MAX_THREADS);
    return 0;
}

// The products are taken in double, where they cannot overflow.
int config_check_sizable(const Config *c, MoeErr err) {
    const ModelConfig *m = &c->model;
    double T = (double)c->train.micro_batch * c->train.seq_len, E = model_n_moe_layers(m) ? m->n_experts : 0;
    double rows = T * m->top_k, wide = m->d_model > 2.0 * m->expert_hidden ? m->d_model : 2.0 * m->expert_hidden;
    const struct { double n; const char *what; } sizes[] = {
        {model_param_counts(m).total, "parameters (mostly model.n_layers x model.n_experts x 3 x "
                                      "model.d_model x model.expert_hidden)"},
        {T * c->train.micro_batches, "tokens of a step (train.micro_batch x train.seq_len x train.micro_batches)"},
        {T * (double)model_qkv_width(m), "attention activations (tokens x q, k, v widths)"},
        {T * E, "router scores (tokens x model.n_experts)"},
        {E ? rows * wide : 0, "expert rows (tokens x model.top_k x the wider of d_model, 2 expert_hidden)"},
        {T * 2.0 * (m->dense_hidden > m->shared_hidden ? m->dense_hidden : m->shared_hidden),
         "dense or shared-expert activations"},
        {(double)m->vocab_size * m->d_model, "embedding (model.vocab_size x model.d_model)"},
        {(double)m->n_layers * E, "expert biases (model.n_layers x model.n_experts)"},
    };
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        if (sizes[i].n > CONFIG_MAX_ELEMENTS)
            return moe_err(err, "the %s come to %.4g elements, more than moe.c sizes in one buffer (2^44 = "
                           "%.4g)", sizes[i].what, sizes[i].n, CONFIG_MAX_ELEMENTS);
    return 0;
}

// What train.device's backend can run, asked before anything starts (a build without the backend
// refuses it when it would start). The CPU backend declares no limits.
static int check_device_limits(const Config *c, MoeErr err) {
    const OpsLimits *limits = strcmp(c->train.device, "cuda") ? NULL : ops_cuda_limits();
    char backend[64];
    snprintf(backend, sizeof backend, "train.device = %s", c->train.device);
    return limits ? model_config_check_limits(&c->model, limits, backend, err) : 0;
}

// FP8 products read E4M3 rows through TMA, which moves 16-byte units: every width they multiply is
// a multiple of 16 (the experts': d_model and expert_hidden; with train.fp8_dense the dense layers':
// d_model, the QKV width, the attention output's and the dense and shared MLPs' hidden widths).
static int check_precision(const Config *c, MoeErr err) {
    const ModelConfig *m = &c->model;
    if (c->train.fp8_exchange && c->train.precision != PRECISION_FP8)
        return moe_err(err, "train.fp8_exchange = true sends the experts' inputs as FP8 rows: it needs "
                       "train.precision = fp8 (or set train.fp8_exchange = false)");
    if (c->train.precision != PRECISION_FP8) return 0;
    if (model_n_moe_layers(m) && (m->d_model % 16 || m->expert_hidden % 16))
        return moe_err(err, "train.precision = fp8 multiplies E4M3 rows of 16-byte units: model.d_model = %d and "
                       "model.expert_hidden = %d must be multiples of 16 (or use train.precision = bf16)",
                       m->d_model, m->expert_hidden);
    size_t qkv = model_qkv_width(m), att = (size_t)m->n_heads * m->head_dim;
    bool dense = m->n_dense_layers > 0 && m->dense_hidden % 16;
    if (c->train.fp8_dense && (m->d_model % 16 || qkv % 16 || att % 16 || dense || m->shared_hidden % 16))
        return moe_err(err, "train.fp8_dense multiplies the dense layers' E4M3 rows of 16-byte units: model.d_model "
                       "= %d, the QKV width %zu, n_heads x head_dim = %zu, model.dense_hidden = %d (with dense "
                       "layers) and model.shared_hidden = %d must be multiples of 16 (or set train.fp8_dense = false)",
                       m->d_model, qkv, att, m->dense_hidden, m->shared_hidden);
    return 0;
}

int config_validate(Config *c, MoeErr err) {
    if (model_config_validate(&c->model, err) || check_train(&c->train, err) || check_device_limits(c, err) ||
        check_precision(c, err))
        return -1;
    if (c->data.token_bytes != 0 && c->data.token_bytes != 2 && c->data.token_bytes != 4)
        return moe_err(err, "data.token_bytes = %d must be 0 (auto), 2 or 4", c->data.token_bytes);
    if (!c->data.train[0]) return moe_err(err, "data.train must name the training tokens");
    const char *h = c->data.tokenizer_xxh3;
    if (h[0] && (strlen(h) != 16 || strspn(h, "0123456789abcdef") != 16))
        return moe_err(err, "data.tokenizer_xxh3 = '%s' must be 16 lowercase hex digits (or empty: moe train "
                       "fills it in from data.tokenizer)", h);
    if (c->parallel.pp < 1 || c->parallel.ep < 1)
        return moe_err(err, "parallel.pp = %d and parallel.ep = %d must be at least 1",
                       c->parallel.pp, c->parallel.ep);
    if (pipeline_check(c->parallel.pp, c->parallel.virtual_stages, c->train.micro_batches, err)) return -1;
    if (!(c->parallel.grad_bucket_mb >= 0))
        return moe_err(err, "parallel.grad_bucket_mb = %g must be >= 0 (0: a bucket per layer)",
                       c->parallel.grad_bucket_mb);
    if (c->parallel.exchange_chunks < 1 || c->parallel.push_ctas < 0)
        return moe_err(err, "parallel.exchange_chunks = %d must be at least 1 and parallel.push_ctas = %d at "
                       "least 0 (0: no bound)", c->parallel.exchange_chunks, c->parallel.push_ctas);
    if (!(c->parallel.recv_capacity >= 0))
        return moe_err(err, "parallel.recv_capacity = %g must be >= 0 (0: room for the worst case; e.g. 2 "
                       "holds twice an even share)", c->parallel.recv_capacity);
    if (c->parallel.recv_capacity > 0 && c->parallel.exchange == EXCHANGE_SENDRECV)
        return moe_err(err, "parallel.recv_capacity bounds the direct exchange's receive buffers; with "
                       "parallel.exchange=sendrecv leave it at 0");
    return 0;
}

static json_t *key_to_json(const Config *c, const ConfigKey *k) {
    const char *field = (const char *)c + k->offset;
    switch (k->type) {
    case KEY_INT: return json_integer(*(const int *)field);
    case KEY_REAL: return json_real(*(const double *)field);
    case KEY_BOOL: return json_boolean(*(const bool *)field);
    case KEY_STR: return json_string(field);
    case KEY_ENUM: return json_string(k->names[*(const int *)field]);
    }
    return NULL;
}

json_t *config_to_json(const Config *c) {
    json_t *root = json_object();
    for (size_t i = 0; i < N_KEYS; i++) {
        const char *dot = strchr(KEYS[i].key, '.');
        char section[32];
        snprintf(section, sizeof section, "%.*s", (int)(dot - KEYS[i].key), KEYS[i].key);
        json_t *sec = json_object_get(root, section);
        if (!sec) json_object_set_new(root, section, sec = json_object());
        json_object_set_new(sec, dot + 1, key_to_json(c, &KEYS[i]));
    }
    return root;
}

static void key_text(const Config *c, const ConfigKey *k, char *buf, size_t len) {
    json_t *v = key_to_json(c, k);
    char *s = json_dumps(v, JSON_ENCODE_ANY | JSON_REAL_PRECISION(17));
    snprintf(buf, len, "%s", s);
    free(s);
    json_decref(v);
}

void config_write_text(const Config *c, FILE *f) {
    char value[CONFIG_PATH_LEN + 64];
    for (size_t i = 0; i < N_KEYS; i++) {
        key_text(c, &KEYS[i], value, sizeof value);
        fprintf(f, "%s = %s\n", KEYS[i].key, value);
    }
}

const char *config_model_diff(const Config *x, const Config *y, char *a, char *b, size_t len) {
    for (size_t i = 0; i < N_KEYS; i++) {
        if (strncmp(KEYS[i].key, "model.", 6)) continue;
        key_text(x, &KEYS[i], a, len);
        key_text(y, &KEYS[i], b, len);
        if (strcmp(a, b)) return KEYS[i].key;
    }
    return NULL;
}

void config_print_keys(FILE *f) {
    static const char *const TYPE[] = {"int", "real", "bool", "string", "choice"};
    Config d;
    config_defaults(&d);
    for (size_t i = 0; i < N_KEYS; i++) {
        char v[CONFIG_PATH_LEN + 8];
        key_text(&d, &KEYS[i], v, sizeof v);
        fprintf(f, "  %-24s %-6s %-32s %s\n", KEYS[i].key, TYPE[KEYS[i].type], v, KEYS[i].help);
    }
}

const char *config_recompute_name(Recompute r) { return RECOMPUTE_NAMES[r]; }

// Setting up a run from its config (see setup.h).
#include "setup.h"

#include <omp.h>
#include <stdio.h>
#include <string.h>

#include "ckpt.h"
#include "dist/comm_nccl.h"
#include "dist/pipeline.h"
#include "optim.h"
#include "text/tokenizer.h"

// More threads than cores only wait for each other: train.threads is capped at 4 per core.
static void set_threads(int threads) {
    int cap = 4 * moe_cpu_cores();
    if (threads > cap)
        fprintf(stderr, "note: train.threads = %d is more than 4 per core (%d cores here); using %d\n", threads,
                moe_cpu_cores(), cap);
    if (threads > 0) omp_set_num_threads(threads < cap ? threads : cap);
}

const Ops *setup_backend(const Config *cfg) {
    set_threads(cfg->train.threads);
    if (!strcmp(cfg->train.device, "cpu-sharded")) return ops_cpu_sharded();
    if (strcmp(cfg->train.device, "cuda")) return ops_cpu();
    const Ops *ops = ops_cuda(comm_local_rank(0), cfg->train.deterministic); // one GPU per process on a node
    if (!ops) moe_fatal("train.device = cuda, but this moe was built without CUDA (build with make CUDA=1)");
    return ops;
}

void setup_dataset(Dataset *ds, const Config *cfg, const char *spec, bool shuffle) {
    MoeErr err;
    if (dataset_open(ds, spec, (size_t)cfg->train.seq_len, (size_t)cfg->model.vocab_size,
                     cfg->data.token_bytes, (uint64_t)cfg->train.seed, shuffle, err))
        moe_fatal("%s", err);
}

void setup_tokenizer(Config *cfg) {
    DataConfig *d = &cfg->data;
    if (!d->tokenizer[0]) return;
    MoeErr err;
    Tokenizer *tok = tokenizer_load(d->tokenizer, err);
    if (!tok) moe_fatal("data.tokenizer: %s", err);
    if (d->tokenizer_xxh3[0] && strcmp(d->tokenizer_xxh3, tokenizer_hash(tok)))
        moe_fatal("data.tokenizer %s is not the file this run was set up with (its XXH3-64 is %s, "
                  "data.tokenizer_xxh3 is %s): its ids would mean other text; restore the file, or pass "
                  "data.tokenizer_xxh3= to take this one", d->tokenizer, tokenizer_hash(tok), d->tokenizer_xxh3);
    if (tokenizer_vocab_size(tok) > (size_t)cfg->model.vocab_size)
        moe_fatal("data.tokenizer %s has ids up to %zu, but model.vocab_size is %d: set model.vocab_size=%zu "
                  "(or more)", d->tokenizer, tokenizer_vocab_size(tok) - 1, cfg->model.vocab_size,
                  tokenizer_vocab_size(tok));
    snprintf(d->tokenizer_xxh3, sizeof d->tokenizer_xxh3, "%s", tokenizer_hash(tok));
    tokenizer_free(tok);
}

ParallelSpec setup_parallel_spec(const Config *cfg) {
    const ModelConfig *mc = &cfg->model;
    return (ParallelSpec){
        .layout = {.pp = cfg->parallel.pp, .ep = cfg->parallel.ep, .v = cfg->parallel.virtual_stages,
                   .n_layers = mc->n_layers, .n_experts = mc->n_experts, .has_moe = model_n_moe_layers(mc) > 0,
                   .micro_batch = cfg->train.micro_batch, .micro_batches = cfg->train.micro_batches},
        .exchange = (ExchangeMode)cfg->parallel.exchange,
        .recv_capacity = cfg->parallel.recv_capacity,
        .exchange_chunks = cfg->parallel.exchange_chunks, .push_ctas = cfg->parallel.push_ctas,
    };
}

void setup_single_process(Parallel *par, const Config *cfg) {
    ParallelSpec s = setup_parallel_spec(cfg);
    s.layout.pp = s.layout.ep = s.layout.v = s.layout.micro_batches = 1;
    parallel_init(par, comm_self(sizeof(float)), &s);
    par->owned_world = par->world; // freed by parallel_free
}

ModelModes setup_model_modes(const Config *cfg) {
    const TrainConfig *t = &cfg->train;
    return (ModelModes){.recompute = t->recompute, .fp8 = t->precision == PRECISION_FP8,
                        .how = t->fp8_recipe == FP8_RECIPE_BLOCKWISE_POW2 ? FP8_SCALE_POW2 : FP8_SCALE_AMAX,
                        .fp8_dense = t->fp8_dense, .fp8_act_qkv = !t->fp8_dense_qkv,
                        .fp8_act_out = !t->fp8_dense_out, .fp8_act_qkv_forward = !t->fp8_qkv_forward,
                        .fp8_fused_dispatch = t->fp8_fused_dispatch,
                        .fp8_fused_swiglu = t->fp8_fused_swiglu,
                        .fp8_exchange = t->fp8_exchange, .fp8_wgrad_blocks = t->fp8_wgrad_blocks,
                        .fp8_fused_update = t->fp8_fused_update};
}

void setup_plan_rank(const Config *cfg, int world, int rank, const Ops *ops, Parallel *par, Comm groups[4],
                     Model *m, Optimizer *o) {
    MoeErr err;
    ParallelSpec spec = setup_parallel_spec(cfg); // exchange auto is planned as direct (one node)
    if (parallel_plan(par, groups, world, rank, &spec, err)) moe_fatal("%s", err);
    model_init(m, &cfg->model, ops, par, (size_t)par->lay.micro_per_rank, (size_t)cfg->train.seq_len, 0,
               cfg->train.micro_batches, setup_model_modes(cfg));
    optim_init(o, m);
}

TrainMemory setup_memory_of(const Model *m, const Optimizer *o) {
    double P = (double)m->reg.total, f32 = (double)m->ops->f32_size;
    TrainMemory r = {.params = P, .optimizer = (double)o->state_bytes, .total = (double)m->mem.bytes,
                     .activations = (double)m->act_bytes, .weights = (double)m->master_len * f32,
                     .compute_weights = (double)model_compute_weight_elems(m) * m->ops->act_size,
                     .fp8_weights = m->fp8 ? (double)m->fp8->weight_bytes : 0,
                     .grads = P * f32 + (double)o->grad_bytes, .exchange = (double)m->exchange_bytes};
    r.scratch = r.total - r.weights - r.compute_weights - r.fp8_weights - r.grads - r.optimizer - r.activations;
    return r;
}

// The rows of a memory table (setup_print_memory, setup_memory_json): titles, keys and bytes.
enum { MEMORY_ROWS = 9 };
static const char *const MEMORY_TITLES[MEMORY_ROWS] = {
    "fp32 master weights", "compute weights (act copy)", "FP8 weights", "gradients (fp32)",
    "optimizer state (AdamW m, v)", "activations kept", "expert exchange buffers", "workspace and scratch", "total"};
static const char *const MEMORY_KEYS[MEMORY_ROWS] = {"weights", "compute_weights", "fp8_weights", "grads", "optimizer",
                                                     "activations", "exchange", "scratch", "total"};

static void memory_rows(const TrainMemory *p, double v[MEMORY_ROWS]) {
    double rows[MEMORY_ROWS] = {p->weights, p->compute_weights, p->fp8_weights, p->grads, p->optimizer,
                                p->activations - p->exchange, p->exchange, p->scratch, p->total};
    memcpy(v, rows, sizeof rows);
}

void setup_print_memory(const char *indent, const TrainMemory *plans, const char *const *heads, int n) {
    printf("%s%-30s", indent, "");
    for (int c = 0; c < n; c++) printf(" %16s", heads[c]);
    for (int row = 0; row < MEMORY_ROWS; row++) {
        printf("\n%s%-30s", indent, MEMORY_TITLES[row]);
        for (int c = 0; c < n; c++) {
            double v[MEMORY_ROWS];
            memory_rows(&plans[c], v);
            printf(" %12.4g GiB", v[row] / 1073741824.0);
        }
    }
    printf("\n");
}

json_t *setup_memory_json(const TrainMemory *p) {
    double v[MEMORY_ROWS];
    memory_rows(p, v);
    json_t *o = json_object();
    for (int row = 0; row < MEMORY_ROWS; row++) json_object_set_new(o, MEMORY_KEYS[row], json_integer((json_int_t)v[row]));
    return o;
}

TrainMemory setup_memory_plan(const Config *cfg, int world, int rank, bool bf16) {
    return setup_memory_plan_on(cfg, world, rank, ops_counting(bf16));
}

TrainMemory setup_memory_plan_on(const Config *cfg, int world, int rank, const Ops *counting) {
    Parallel par;
    Comm groups[4];
    Model m;
    Optimizer o;
    setup_plan_rank(cfg, world, rank, counting, &par, groups, &m, &o);
    TrainMemory r = setup_memory_of(&m, &o);
    model_free(&m);
    return r;
}

void setup_check_memory(const Config *cfg, const Ops *ops, int world, int rank, bool training) {
    const double GiB = 1073741824.0;
    double avail = ops->memory_available ? (double)ops->memory_available() : 0;
    ModelFloor f = model_memory_floor(&cfg->model);
    double floor = ((training ? f.weights : f.weights / 4) + f.table) / world;
    if (avail > 0 && floor > avail)
        moe_fatal("the model needs at least %.4g GiB per rank (%.4g parameters: fp32 weights%s, over %d "
                  "rank(s)), but %.4g GiB are available to the %s backend here; use a smaller model or more "
                  "ranks", floor / GiB, model_param_counts(&cfg->model).total,
                  training ? ", gradients and AdamW moments" : "", world, avail / GiB, ops->name);
    MoeErr err;
    if (config_check_sizable(cfg, err)) moe_fatal("%s", err);
    if (!training || avail <= 0) return;
    double plan = setup_memory_plan_on(cfg, world, rank, ops_counting_like(ops)).total;
    if (plan > avail)
        moe_fatal("rank %d's memory plan is %.4g GiB (weights, gradients, optimizer state and activations of "
                  "train.micro_batch = %d sequences of train.seq_len = %d), but %.4g GiB are available to the "
                  "%s backend here; lower train.micro_batch or the model size, or use more ranks", rank,
                  plan / GiB, cfg->train.micro_batch, cfg->train.seq_len, avail / GiB, ops->name);
}

void setup_model_from_ckpt(const char *arg, Config *cfg, Parallel *par, Model *m, size_t B, size_t S) {
    MoeErr err;
    char dir[4200];
    TrainState st;
    if (ckpt_resolve(arg, dir, sizeof dir, err) || ckpt_read_state(dir, cfg, &st, err))
        moe_fatal("%s", err);
    const Ops *ops = setup_backend(cfg);
    setup_check_memory(cfg, ops, 1, 0, false);
    setup_single_process(par, cfg);
    model_init(m, &cfg->model, ops, par, B ? B : (size_t)cfg->train.micro_batch,
               S ? S : (size_t)cfg->train.seq_len, 1, 1, (ModelModes){0}); // no backward
    if (ckpt_load(dir, m, NULL, err)) moe_fatal("%s", err);
}

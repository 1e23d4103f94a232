// `moe inspect CONFIG.json|DIR`: parameter counts, FLOPs per token and the memory plan of a model,
// measured by sizing the real model on a backend that only counts allocations.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "io/fsutil.h"
#include "dist/pipeline.h"
#include "train/train.h"

static const CliSpec SPEC = {
    .command = "moe inspect",
    .usage = "CONFIG.json|DIR [key=value ...] [--world N]",
    .summary = "Prints total and active parameters, FLOPs per token (moe-model.md accounting:\n"
               "causal attention at half, training = 3 x forward) and the memory plan of a\n"
               "config file, a run directory or a checkpoint directory.",
    .opts = (const CliOption[]){
        {"--world", "N", "memory per rank for N ranks laid out by parallel.pp and parallel.ep"},
        {NULL}},
};

static void load_config(const char *arg, Config *cfg) {
    MoeErr err;
    char ckpt[4200], run_config[4200];
    config_defaults(cfg);
    snprintf(run_config, sizeof run_config, "%s/config.json", arg);
    if (!fs_is_dir(arg)) {
        if (config_load_file(cfg, arg, err)) moe_fatal("%s", err);
    } else if (fs_exists(run_config)) {
        if (config_load_file(cfg, run_config, err)) moe_fatal("%s", err);
    } else {
        TrainState st;
        if (ckpt_resolve(arg, ckpt, sizeof ckpt, err) || ckpt_read_state(ckpt, cfg, &st, err))
            moe_fatal("%s", err);
    }
}

typedef struct {
    double params, optimizer, total; // per rank: parameters held, optimizer state bytes, all bytes
} RankMemory;

// Sizes rank `rank`'s model and optimizer on a backend that only counts what is allocated.
static RankMemory rank_memory(const Config *cfg, int world, int rank, bool bf16) {
    const ModelConfig *mc = &cfg->model;
    Parallel par;
    Comm groups[4];
    MoeErr err;
    if (parallel_plan(&par, groups, world, rank, cfg->parallel.pp, cfg->parallel.ep, mc->n_layers,
                      mc->n_experts, model_n_moe_layers(mc) > 0, cfg->train.micro_batch, err))
        moe_fatal("%s", err);
    par.exchange = (ExchangeMode)cfg->parallel.exchange; // auto is planned as direct (one node)
    par.recv_capacity = cfg->parallel.recv_capacity;
    Model m;
    Optimizer o;
    int slots = pipeline_slots(par.lay.pp, par.lay.stage, cfg->train.micro_batches);
    model_init(&m, mc, ops_counting(bf16), &par, (size_t)par.lay.micro_per_rank,
               (size_t)cfg->train.seq_len, slots, cfg->train.micro_batches);
    optim_init(&o, &m);
    RankMemory r = {(double)m.reg.total, (double)o.state_bytes, (double)m.bytes};
    model_free(&m);
    return r;
}

static void print_memory(const Config *cfg, int world) {
    RankMemory worst[2] = {{0}};
    for (int rank = 0; rank < world; rank++)
        for (int bf16 = 0; bf16 < 2; bf16++) {
            RankMemory r = rank_memory(cfg, world, rank, bf16);
            worst[bf16].params = r.params > worst[bf16].params ? r.params : worst[bf16].params;
            worst[bf16].optimizer = r.optimizer > worst[bf16].optimizer ? r.optimizer : worst[bf16].optimizer;
            worst[bf16].total = r.total > worst[bf16].total ? r.total : worst[bf16].total;
        }
    const double GiB = 1073741824.0;
    printf("  memory per rank (%d ranks: pp %d, ep %d; the largest rank), micro-batch %d x %d:\n",
           world, cfg->parallel.pp, cfg->parallel.ep, cfg->train.micro_batch, cfg->train.seq_len);
    printf("    parameters held        %.4gM\n", worst[0].params / 1e6);
    printf("    optimizer state        %.0f bytes (this rank's shard of the AdamW moments)\n", worst[0].optimizer);
    printf("    whole plan, CPU backend (fp32)                   %.4g GiB\n", worst[0].total / GiB);
    printf("    whole plan, bf16 activations + bf16 weight copy  %.4g GiB\n", worst[1].total / GiB);
    if (cfg->parallel.ep > 1 && cfg->parallel.recv_capacity == 0 && cfg->parallel.exchange != EXCHANGE_SENDRECV) {
        Config bounded = *cfg; // the expert rows a rank receives are sized for the worst case
        bounded.parallel.recv_capacity = 2;
        double most = 0;
        for (int rank = 0; rank < world; rank++) {
            double total = rank_memory(&bounded, world, rank, true).total;
            most = total > most ? total : most;
        }
        if (most < worst[1].total)
            printf("    the same with parallel.recv_capacity=2           %.4g GiB (rows received: twice an even "
                   "share, not the worst case)\n", most / GiB);
    }
}

int cmd_inspect(int argc, char **argv, Comm *world) {
    const char *values[1] = {0};
    char **pos;
    int n_pos;
    cli_parse(&SPEC, argc, argv, values, &pos, &n_pos);
    cli_single_rank(SPEC.command, world);
    if (n_pos < 1 || strchr(pos[0], '=')) {
        cli_usage(&SPEC, false);
        free(pos);
        return 1;
    }
    Config cfg;
    load_config(pos[0], &cfg);
    cli_override_and_validate(&cfg, n_pos - 1, pos + 1);
    const ModelConfig *c = &cfg.model;
    ParamCounts p = model_param_counts(c);
    double S = cfg.train.seq_len, fwd = model_forward_flops_per_token(c, (size_t)S);
    double tokens = (double)cfg.train.micro_batch * S * cfg.train.micro_batches;
    printf("%s\n", pos[0]);
    printf("  layers %d (%d dense, %d MoE), d_model %d, heads %d/%d x %d, experts %d top-%d x %d",
           c->n_layers, c->n_dense_layers, model_n_moe_layers(c), c->d_model, c->n_heads,
           c->n_kv_heads, c->head_dim, c->n_experts, c->top_k, c->expert_hidden);
    printf("%s, vocab %d\n", c->shared_hidden ? " + shared" : "", c->vocab_size);
    printf("  parameters       %.4gM total, %.4gM active per token (embedding %.4gM)\n",
           p.total / 1e6, p.active / 1e6, p.embedding / 1e6);
    printf("  FLOPs per token  %.4g GFLOP forward, %.4g GFLOP training (3 x forward) at seq %g\n",
           fwd / 1e9, 3 * fwd / 1e9, S);
    printf("  FLOPs per step   %.4g TFLOP (%g tokens)\n", 3 * fwd * tokens / 1e12, tokens);
    print_memory(&cfg, values[0] ? (int)cli_number("--world", values[0], 1, 65536) : 1);
    free(pos);
    return 0;
}

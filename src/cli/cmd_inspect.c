// `moe inspect CONFIG.json|DIR`: parameter counts, FLOPs per token and the memory plan of a model
// (also under each activation-recompute mode), measured by sizing the real model on a backend that
// only counts allocations.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "train/setup.h"
#include "train/train.h"

static const CliSpec SPEC = {
    .command = "moe inspect",
    .usage = "CONFIG.json|DIR [key=value ...] [--world N]",
    .summary = "Prints total and active parameters, FLOPs per token (docs/MODEL.md accounting:\n"
               "causal attention at half, training = 3 x forward) and the memory plan of a\n"
               "config file, a run directory or a checkpoint directory, with the activations and\n"
               "whole plan under each train.recompute mode side by side.",
    .opts = (const CliOption[]){
        {"--world", "N", "memory per rank for N ranks laid out by parallel.pp and parallel.ep"},
        {NULL}},
};

static const double GiB = 1073741824.0;

// A model that cannot be sized here (the table of its tensors would not fit) or at all (a buffer
// past CONFIG_MAX_ELEMENTS) gets its arithmetic floor instead of the exact plan; returns whether.
static bool print_floor(const Config *cfg, int world) {
    MoeErr why;
    ModelFloor f = model_memory_floor(&cfg->model);
    double host = (double)moe_host_memory_available();
    if (!config_check_sizable(cfg, why) && !(host > 0 && f.table > host / 4)) return false;
    if (host > 0 && f.table > host / 4)
        snprintf(why, sizeof why, "the table of its tensors alone would take %.4g GiB of the %.4g GiB of host "
                 "memory available here", f.table / GiB, host / GiB);
    printf("  memory per rank (%d ranks), at least: %.4g GiB for fp32 weights, gradients and AdamW moments "
           "and the tensor table\n    (the exact plan is not sized: %s)\n", world, (f.weights + f.table) / world / GiB,
           why);
    return true;
}

static double max_of(double a, double b) { return a > b ? a : b; }

// Each number of the plan at its largest over the ranks of the layout (TrainMemory is all doubles).
static TrainMemory worst_plan(const Config *cfg, int world, bool bf16) {
    enum { FIELDS = sizeof(TrainMemory) / sizeof(double) };
    TrainMemory w = {0};
    for (int rank = 0; rank < world; rank++) {
        TrainMemory r = setup_memory_plan(cfg, world, rank, bf16);
        for (int i = 0; i < FIELDS; i++) ((double *)&w)[i] = max_of(((double *)&w)[i], ((const double *)&r)[i]);
    }
    return w;
}

static const char *const RECOMPUTE_LABELS[] = {"none", "selective", "full"}; // Recompute

// The plan under each train.recompute mode side by side: activations kept and the whole plan.
static void print_recompute_plans(const Config *cfg, int world) {
    TrainMemory plan[2][3];
    for (int mode = 0; mode < 3; mode++) {
        Config c = *cfg;
        c.train.recompute = (Recompute)mode;
        for (int bf16 = 0; bf16 < 2; bf16++) plan[bf16][mode] = worst_plan(&c, world, bf16);
    }
    char head[64];
    snprintf(head, sizeof head, "by train.recompute (this config: %s)", RECOMPUTE_LABELS[cfg->train.recompute]);
    printf("    %-44s", head);
    for (int mode = 0; mode < 3; mode++) printf(" %12s", RECOMPUTE_LABELS[mode]);
    const char *rows[4] = {"activations, bf16", "whole plan, bf16", "activations, CPU backend (fp32)",
                           "whole plan, CPU backend (fp32)"};
    for (int row = 0; row < 4; row++) {
        printf("\n      %-42s", rows[row]);
        for (int mode = 0; mode < 3; mode++) {
            const TrainMemory *p = &plan[row < 2][mode];
            printf(" %8.4g GiB", (row % 2 ? p->total : p->activations) / GiB);
        }
    }
    printf("\n");
}

static void print_memory(const Config *cfg, int world) {
    if (print_floor(cfg, world)) return;
    TrainMemory worst[2] = {worst_plan(cfg, world, false), worst_plan(cfg, world, true)};
    printf("  memory per rank (%d ranks: pp %d, ep %d; the largest rank), micro-batch %d x %d:\n",
           world, cfg->parallel.pp, cfg->parallel.ep, cfg->train.micro_batch, cfg->train.seq_len);
    printf("    parameters held        %.4gM\n", worst[0].params / 1e6);
    printf("    optimizer state        %.0f bytes (this rank's shard of the AdamW moments)\n", worst[0].optimizer);
    printf("    by purpose (CPU backend: fp32 activations; GPU: bf16 activations and a bf16 weight copy):\n");
    const char *heads[2] = {"CPU backend", "GPU (bf16)"};
    setup_print_memory("      ", worst, heads, 2);
    printf("    host memory available here %.4g GiB\n", moe_host_memory_available() / GiB);
    if (cfg->parallel.ep > 1 && cfg->parallel.recv_capacity == 0 && cfg->parallel.exchange != EXCHANGE_SENDRECV) {
        Config bounded = *cfg; // the expert rows a rank receives are sized for the worst case
        bounded.parallel.recv_capacity = 2;
        double most = worst_plan(&bounded, world, true).total;
        if (most < worst[1].total)
            printf("    the GPU total with parallel.recv_capacity=2 %.4g GiB (rows received: twice an even "
                   "share, not the worst case)\n", most / GiB);
    }
    print_recompute_plans(cfg, world);
}

int cmd_inspect(int argc, char **argv, Comm *world) {
    const char *values[1] = {0};
    Config cfg;
    char **pos = cli_config_command(&SPEC, argc, argv, values, world, &cfg);
    if (!pos) return 1;
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

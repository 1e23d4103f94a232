// `moe inspect CONFIG.json|DIR`: parameter counts, FLOPs per token and the memory plan of a model,
// measured by sizing the real model on a backend that only counts allocations.
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "io/fsutil.h"
#include "train/train.h"

static const CliSpec SPEC = {
    .command = "moe inspect",
    .usage = "CONFIG.json|DIR [key=value ...]",
    .summary = "Prints total and active parameters, FLOPs per token (moe-model.md accounting:\n"
               "causal attention at half, training = 3 x forward) and the memory plan of a\n"
               "config file, a run directory or a checkpoint directory.",
    .opts = (const CliOption[]){{NULL}},
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

static double plan_bytes(const Config *cfg, bool bf16) {
    Model m;
    model_init(&m, &cfg->model, ops_counting(bf16), (size_t)cfg->train.micro_batch,
               (size_t)cfg->train.seq_len);
    double bytes = (double)m.bytes;
    model_free(&m);
    return bytes;
}

int cmd_inspect(int argc, char **argv) {
    const char *values[1] = {0};
    char **pos;
    int n_pos;
    cli_parse(&SPEC, argc, argv, values, &pos, &n_pos);
    if (n_pos < 1 || strchr(pos[0], '=')) {
        cli_usage(&SPEC, false);
        return 1;
    }
    Config cfg;
    MoeErr err;
    load_config(pos[0], &cfg);
    for (int i = 1; i < n_pos; i++)
        if (config_apply_override(&cfg, pos[i], err)) moe_fatal("%s", err);
    if (config_validate(&cfg, err)) moe_fatal("%s", err);
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
    printf("  memory (one process, micro-batch %d x %d):\n", cfg.train.micro_batch, cfg.train.seq_len);
    printf("    weights, grads, AdamW moments  %.4g GiB (fp32: 16 bytes per parameter)\n",
           p.total * 16 / 1073741824.0);
    printf("    whole plan, CPU backend (fp32)          %.4g GiB\n", plan_bytes(&cfg, false) / 1073741824.0);
    printf("    whole plan, bf16 activations + bf16 weight copy  %.4g GiB\n",
           plan_bytes(&cfg, true) / 1073741824.0);
    return 0;
}

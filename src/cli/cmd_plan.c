// `moe plan CONFIG --gpus N`: the layouts of a config on N devices that fit in their memory, with
// the predicted step time, throughput, pipeline bubble and exposed communication of each (the
// model: docs/SCALING.md), before any device is bought or booked.
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "dist/pipeline.h"
#include "plan/plan.h"

static const CliSpec SPEC = {
    .command = "moe plan",
    .usage = "CONFIG.json|DIR --gpus N [key=value ...] [--gpus-per-node G] [--gpu NAME] [--calibration FILE]\n"
             "                [--intra-bw GB/s] [--inter-bw GB/s] [--top K] [--layout pp=P,ep=E,micro=B,v=V]",
    .summary = "Searches the layouts of the config's model and global batch (train.micro_batch x\n"
               "train.micro_batches sequences) on N devices: pipeline stages, data and expert\n"
               "parallelism, sequences per rank in a micro-batch and the gradient accumulation that\n"
               "keeps the batch, interleaved pipeline chunks (parallel.virtual_stages) and activation\n"
               "recompute (train.recompute). Each is sized exactly (the plan `moe inspect` prints,\n"
               "plus the runtime's memory) and its step predicted from a calibration of kernel rates\n"
               "and an alpha-beta model of the links; the fastest that fit are printed.\n"
               "docs/SCALING.md explains the model.",
    .opts = (const CliOption[]){
        {"--gpus", "N", "devices in the run"},
        {"--gpus-per-node", "G", "devices per node, joined by NVLink (default 8; with --gpu cpu: all)"},
        {"--gpu", "NAME", "device kind: h100, h200 (default), b200, or cpu (CPU ranks of this host)"},
        {"--calibration", "FILE", "kernel and link rates (default: the device's file in configs/calibration/ "
                                  "beside moe, else the h200 one scaled by the datasheets)"},
        {"--intra-bw", "GB/s", "link bandwidth per device inside a node (default: the calibration's)"},
        {"--inter-bw", "GB/s", "network bandwidth per device between nodes (default: 80% of its NIC)"},
        {"--top", "K", "layouts printed (default 5)"},
        {"--layout", "SPEC", "predict this layout only, e.g. pp=2,ep=8,micro=1,v=2,recompute=1 (micro: sequences "
                             "per rank; recompute: 0 none, 1 selective, 2 full; unset keys: the config's)"},
        {NULL}},
};
enum { OPT_GPUS, OPT_PER_NODE, OPT_GPU, OPT_CALIB, OPT_INTRA, OPT_INTER, OPT_TOP, OPT_LAYOUT, N_OPTS };

static const double GiB = 1073741824.0;

// The device's calibration in configs/calibration/ beside the moe binary, or the h200 one.
static void default_calibration(const char *gpu, char *path, size_t len) {
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    exe[n > 0 ? n : 0] = '\0';
    char *slash = strrchr(exe, '/');
    if (slash) *slash = '\0';
    snprintf(path, len, "%s/configs/calibration/%s.json", slash ? exe : ".", gpu);
    if (access(path, R_OK)) snprintf(path, len, "%s/configs/calibration/h200.json", slash ? exe : ".");
}

static void print_header(const char *what, const Config *cfg, int world, const PlanMachine *m, const char *calib) {
    const ModelConfig *c = &cfg->model;
    ParamCounts p = model_param_counts(c);
    printf("%s: %.4gB parameters (%.4gB active), %d layers, %d experts top-%d; global batch %d x %d tokens\n", what,
           p.total / 1e9, p.active / 1e9, c->n_layers, c->n_experts, c->top_k,
           cfg->train.micro_batch * cfg->train.micro_batches, cfg->train.seq_len);
    printf("devices      %d x %s (%.4g GiB), %d per node\n", world, m->dev->what, m->dev->memory_gib, m->per_node);
    printf("links        inside a node %.0f GB/s (expert rows %.0f GB/s), between nodes %.0f GB/s per device; "
           "latency %.0f us\n", m->intra_bps / 1e9, m->exchange_bps / 1e9, m->inter_bps / 1e9, m->latency_s * 1e6);
    printf("calibration  %s (%s, %s): %s\n", calib, m->calib->device, m->calib->backend, m->calib->source);
    char fallbacks[256];
    calib_fallback_names(m->calib, fallbacks, sizeof fallbacks);
    if (fallbacks[0])
        printf("             FP8 families not in it, priced as the bf16 ones they replace: %s\n", fallbacks);
    if (m->matrix_scale != 1 || m->memory_scale != 1)
        printf("             carried to %s by datasheet ratios: matrix rates x %.3g, memory-bound x %.3g "
               "(an estimate)\n", m->dev->name, m->matrix_scale, m->memory_scale);
}

static void print_row_header(void) {
    printf("\n  #  pp  v   dp   ep  micro x accum  recompute  memory GiB   step ms  tok/s/dev  TFLOP/s/dev  bubble  "
           "exposed comm ms: dp-rs  dp-ag  all-red   pp  exchange\n");
}

static void print_row(int i, const PlanCandidate *c) {
    const PlanLayout *l = &c->lay;
    const PlanResult *r = &c->res;
    printf("%3d %3d %2d %4d %4d %6d x %-5d %-9s %9.2f%s %9.1f %10.0f %12.1f %6.1f%% %24.1f %6.1f %8.1f %4.1f %9.1f\n",
           i, l->pp, l->v, l->dp, l->ep, l->micro_per_rank, l->micro_batches, config_recompute_name((Recompute)l->recompute),
           r->memory_bytes / GiB, r->fits ? " " : "!",
           r->step_s * 1e3, r->tokens_per_s, r->tflops, 100 * r->bubble, 1e3 * r->comm_s[PLAN_COMM_DP_REDUCE_SCATTER],
           1e3 * r->comm_s[PLAN_COMM_DP_ALL_GATHER], 1e3 * r->comm_s[PLAN_COMM_ALL_REDUCE],
           1e3 * r->comm_s[PLAN_COMM_PP], 1e3 * r->comm_s[PLAN_COMM_EXCHANGE]);
}

static void print_detail(const PlanCandidate *c, const PlanMachine *m) {
    const PlanLayout *l = &c->lay;
    const PlanResult *r = &c->res;
    printf("\nlayout       pp %d x dp %d (ep %d), %d sequences per rank x %d micro-batches", l->pp, l->dp, l->ep,
           l->micro_per_rank, l->micro_batches);
    if (l->v > 1) printf(", interleaved 1F1B with %d chunks a stage", l->v);
    if (l->recompute) printf(", train.recompute=%s", config_recompute_name((Recompute)l->recompute));
    printf("\n");
    printf("memory       %.5g GiB per device (largest rank: exact plan %.5g GiB + runtime and communicators), "
           "%s %.4g GiB\n", r->memory_bytes / GiB, r->plan_bytes / GiB, r->fits ? "fits" : "DOES NOT FIT", m->dev->memory_gib);
    printf("step         %.2f ms predicted, %.0f tokens/s and %.1f model TFLOP/s per device\n", r->step_s * 1e3,
           r->tokens_per_s, r->tflops);
    printf("bubble       %.1f%% of the pipeline part idle on its busiest stage (equal stages, free transfers: %.1f%%)\n",
           100 * r->bubble, 100 * r->ideal_bubble);
    if (l->pp > 1) printf("             non-interleaved 1F1B with equal stages: %.1f%%\n",
                          100 * pipeline_bubble_fraction(l->pp, 1, l->micro_batches));
    printf("kernels ms  ");
    for (int f = 0; f < KERNEL_N_FAMILIES; f++) printf(" %s %.1f", KERNEL_FAMILY_NAMES[f], 1e3 * r->kernel_s[f]);
    printf("\nexposed comm");
    for (int k = 0; k < PLAN_N_COMM; k++) printf(" %s %.2f ms%s", PLAN_COMM_NAMES[k], 1e3 * r->comm_s[k], k + 1 < PLAN_N_COMM ? "," : "");
    printf("\n");
}

static void run_search(const Config *cfg, int world, const PlanMachine *m, int top) {
    PlanCandidate *c;
    size_t n;
    PlanStats st;
    plan_search(cfg, world, m, &c, &n, &st);
    size_t fit = n - st.too_large;
    printf("searched     %zu layouts: %zu impossible, %zu past memory, %zu fit\n", st.tried, st.invalid, st.too_large, fit);
    if (!fit) {
        printf("no layout fits: use more devices, a smaller model or a smaller train.micro_batch x seq_len%s\n",
               n ? "; the smallest:" : "");
        if (n) printf("  pp %d (v %d), dp %d, ep %d, %d sequences per rank: %.2f GiB per device\n", c[0].lay.pp,
                      c[0].lay.v, c[0].lay.dp, c[0].lay.ep, c[0].lay.micro_per_rank, c[0].res.memory_bytes / GiB);
    } else {
        print_row_header();
        for (size_t i = 0; i < fit && i < (size_t)top; i++) print_row((int)i + 1, &c[i]);
        print_detail(&c[0], m);
    }
    free(c);
}

static void run_layout(Config *cfg, int world, const PlanMachine *m, const char *spec) {
    MoeErr err;
    PlanCandidate c;
    if (plan_layout_from(cfg, world, spec, &c.lay, err)) moe_fatal("%s", err);
    plan_apply(cfg, &c.lay);
    if (config_validate(cfg, err) || plan_evaluate(cfg, world, m, false, &c.res, err))
        moe_fatal("--layout %s: %s", spec, err);
    print_row_header(), print_row(1, &c), print_detail(&c, m);
}

int cmd_plan(int argc, char **argv, Comm *world) {
    const char *v[N_OPTS] = {0};
    Config cfg;
    char **pos = cli_config_command(&SPEC, argc, argv, v, world, &cfg);
    if (!pos) return 1;
    if (!v[OPT_GPUS]) moe_fatal("moe plan: --gpus N is required (the devices to plan for; see moe plan --help)");
    int gpus = (int)cli_number("--gpus", v[OPT_GPUS], 1, 1 << 20);
    const char *gpu = v[OPT_GPU] ? v[OPT_GPU] : "h200";
    const PlanDevice *dev = plan_device_find(gpu);
    if (!dev) moe_fatal("--gpu %s is not in the device table (%s)", gpu, plan_device_names());
    int per_node = v[OPT_PER_NODE] ? (int)cli_number("--gpus-per-node", v[OPT_PER_NODE], 1, 1 << 20)
                   : strcmp(gpu, "cpu") ? 8 : gpus;
    char path[PATH_MAX + 64];
    if (v[OPT_CALIB]) snprintf(path, sizeof path, "%s", v[OPT_CALIB]);
    else if (!strcmp(gpu, "cpu")) moe_fatal("--gpu cpu needs --calibration FILE (write one: moe bench --calibrate FILE)");
    else default_calibration(gpu, path, sizeof path);
    Calib calib;
    PlanMachine m;
    MoeErr err;
    if (calib_load(&calib, path, err) ||
        plan_machine_init(&m, dev, &calib, per_node, v[OPT_INTRA] ? cli_number("--intra-bw", v[OPT_INTRA], 1e-3, 1e6) : 0,
                          v[OPT_INTER] ? cli_number("--inter-bw", v[OPT_INTER], 1e-3, 1e6) : 0, err) ||
        plan_machine_check(&m, gpus, err))
        moe_fatal("%s", err);
    print_header(pos[0], &cfg, gpus, &m, path);
    if (v[OPT_LAYOUT]) run_layout(&cfg, gpus, &m, v[OPT_LAYOUT]);
    else run_search(&cfg, gpus, &m, v[OPT_TOP] ? (int)cli_number("--top", v[OPT_TOP], 1, 1000) : 5);
    free(pos);
    return 0;
}

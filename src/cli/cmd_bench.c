// `moe bench CONFIG`: training throughput on random token ids, with the FLOP accounting, MFU,
// memory and a per-phase time breakdown.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "cli.h"
#include "io/fsutil.h"
#include "ops/profile_ops.h"
#include "train/train.h"

static const CliSpec SPEC = {
    .command = "moe bench",
    .usage = "CONFIG.json [key=value ...] [--warmup N] [--steps N] [--kernels [--only FAMILIES]] [--json OUT.json]\n"
             "       moe bench --calibrate OUT.json [CONFIG.json] [key=value ...] [--gpu NAME]",
    .summary = "Trains the config's model on random token ids (like the PyTorch baseline) and\n"
               "reports tokens/s, model TFLOP/s (docs/MODEL.md accounting: causal attention at half,\n"
               "training = 3 x forward, no recompute counted), MFU against 989 TFLOP/s (H200 dense\n"
               "bf16 datasheet) and against the measured matrix-product rate, memory, where each\n"
               "rank's step time goes (the timed steps run twice: each waiting for the step before's\n"
               "metrics, and each queued before them; train.launch_ahead picks the one reported as the\n"
               "step), and a per-phase breakdown of one more step with every kernel timed. With\n"
               "--kernels, times each component kernel alone on the config's shapes instead (attention,\n"
               "grouped GEMMs with balanced, Zipf and sparse expert loads, dense GEMMs, memory-bound kernels;\n"
               "--only picks some of these families) against ceilings measured in the same run.\n"
               "MOE_KERNELS=builtin (or attention=builtin, grouped=builtin) selects the built-in CUDA\n"
               "kernels instead of cuDNN's and CUTLASS's.\n"
               "With --calibrate, measures the rate of every kernel family at three sizes of the config's\n"
               "shapes (default: the bundled model on the CPU) and, on several ranks (mpirun), the\n"
               "communication rates, and writes them as the calibration file `moe plan` reads\n"
               "(docs/SCALING.md).",
    .opts = (const CliOption[]){
        {"--warmup", "N", "untimed steps first (default 3; the first runs eagerly, the second records the graph)"},
        {"--steps", "N", "timed steps (default 10)"},
        {"--kernels", NULL, "time each component kernel alone instead of training steps"},
        {"--only", "FAMILIES", "with --kernels: time these families only, a comma list of attention, grouped, "
                               "dense, memory (default all)"},
        {"--json", "OUT.json", "also write the report's numbers (throughput, memory by purpose, startup) as JSON"},
        {"--calibrate", "OUT.json", "write a calibration file for moe plan instead"},
        {"--gpu", "NAME", "with --calibrate: the device it describes (moe plan's table; default h200 for "
                          "train.device=cuda, else cpu)"},
        {NULL}},
};

static const double GiB = 1073741824.0;

// The memory of rank 0 by purpose, planned (a counting backend) and allocated by the run, then
// what the backend measured: device memory in use and its peak (a GPU: every allocation of the
// process, libraries' workspaces and the context included), or the CPU process's peak resident
// memory.
static void print_memory(const BenchReport *r, json_t *record) {
    bool gpu = r->memory_in_use > 0;
    printf("memory       plan %.4g GiB, allocated %.4g GiB; ", r->plan.total / GiB, r->allocated.total / GiB);
    if (gpu) printf("measured on the device: %.4g GiB in use after the run, peak %.4g GiB\n", r->memory_in_use / GiB,
                    r->memory_peak / GiB);
    else printf("measured: peak resident memory of the process %.4g GiB\n", r->memory_peak / GiB);
    const TrainMemory cols[2] = {r->plan, r->allocated};
    const char *heads[2] = {"plan", "allocated"};
    setup_print_memory("  ", cols, heads, 2);
    if (gpu) printf("  %-30s %12.4g GiB (in use beyond the allocations: runtime, libraries, communicators)\n",
                    "device peak - allocated", ((double)r->memory_peak - r->allocated.total) / GiB);
    json_t *m = json_object();
    json_object_set_new(m, "plan", setup_memory_json(&r->plan));
    json_object_set_new(m, "allocated", setup_memory_json(&r->allocated));
    json_object_set_new(m, gpu ? "device_in_use" : "host_in_use", gpu ? json_integer((json_int_t)r->memory_in_use) : json_null());
    json_object_set_new(m, gpu ? "device_peak" : "host_peak_resident", json_integer((json_int_t)r->memory_peak));
    json_object_set_new(record, "memory", m);
}

static json_t *step_times_json(const StepTimes *m) {
    return json_pack("{s:f, s:f, s:f, s:f, s:f}", "step_ms", m->step_ms, "stage_ms", m->stage_ms, "launch_ms",
                     m->launch_ms, "wait_ms", m->wait_ms, "device_ms", m->device_ms);
}

// Where the timed steps' time went, rank by rank, both ways of queuing them; and what the recorded
// step holds.
static void print_host_part(const BenchReport *r, json_t *record) {
    static const char *const MODES[2] = {"each step waited", "one step ahead"};
    static const char *const KEYS[2] = {"waited", "ahead"};
    printf("host part    ms a step, timed both ways (train.launch_ahead picks the step line's): each step's metrics\n"
           "             waited for before the next is queued, or the next queued first. stage: batches, StepInfo,\n"
           "             uploads queued; launch: the step's work queued (a graph launch); wait: for its metrics;\n"
           "             device: the step's work from start to end (events); idle: step - device\n");
    printf("  %4s  %-18s %9s %8s %8s %9s %9s %8s\n", "rank", "steps", "step", "stage", "launch", "wait", "device",
           "idle");
    json_t *modes = json_object();
    for (int k = 0; k < 2; k++) {
        json_t *ranks = json_array();
        for (int j = 0; j < r->n_times; j++) {
            const StepTimes *m = &r->times[k][j];
            printf("  %4d  %-18s %9.2f %8.2f %8.2f %9.2f %9.2f %8.2f\n", j, MODES[k], m->step_ms, m->stage_ms,
                   m->launch_ms, m->wait_ms, m->device_ms, m->step_ms - m->device_ms);
            json_array_append_new(ranks, step_times_json(m));
        }
        json_object_set_new(modes, KEYS[k], ranks);
    }
    json_object_set_new(record, "steps_by_rank", modes);
    const GraphCounts *g = &r->graph_nodes;
    if (r->graph)
        printf("graph        recorded (second warm-up step) and instantiated in %.2f s: %zu nodes (%zu kernels, %zu "
               "memcpy, %zu memset, %zu host, %zu event record/wait, %zu other)\n", r->capture_s, g->nodes, g->kernels,
               g->memcpys, g->memsets, g->hosts, g->events, g->other);
    printf("NCCL         %zu operations a step (collectives, sends and receives queued or recorded)\n", r->nccl_calls);
    json_object_set_new(record, "graph_nodes", json_pack("{s:i, s:i, s:i, s:i, s:i, s:i, s:i}", "nodes",
                        (json_int_t)g->nodes, "kernels", (json_int_t)g->kernels, "memcpy", (json_int_t)g->memcpys,
                        "memset", (json_int_t)g->memsets, "host", (json_int_t)g->hosts, "event",
                        (json_int_t)g->events, "other", (json_int_t)g->other));
    json_object_set_new(record, "nccl_calls_per_step", json_integer((json_int_t)r->nccl_calls));
}

// The device's clock and power during the timed steps (below its highest clock, every
// compute-bound kernel runs that much slower than `moe bench --kernels` times it alone), and the
// energy of a step on this rank's board: its mean draw times the step.
static void print_clocks(const ClockSummary *c, double ms_per_step, double tokens_per_rank, json_t *record) {
    clock_summary_print("during the timed steps", c);
    if (!c->samples) return;
    double joules = c->power_w_mean * ms_per_step / 1e3;
    printf("energy       %.0f J a step on this rank's board (mean draw x step time), %.0f tokens per J\n", joules,
           tokens_per_rank / joules);
    json_object_set_new(record, "joules_per_step", json_real(joules));
    json_object_set_new(record, "clocks", json_pack("{s:i, s:f, s:f, s:f, s:f, s:f, s:f, s:f}", "samples",
                        (json_int_t)c->samples, "sm_mhz_median", c->sm_mhz_median, "sm_mhz_min", c->sm_mhz_min,
                        "sm_max_mhz", c->sm_max_mhz, "power_w_mean", c->power_w_mean, "power_limit_w",
                        c->power_limit_w, "power_capped_share", c->power_capped_share, "thermal_share",
                        c->thermal_share));
}

// Prints the report and fills `record` with its numbers (--json).
static void print_report(const Config *cfg, const BenchReport *r, json_t *record) {
    const ModelConfig *c = &cfg->model;
    ParamCounts p = model_param_counts(c);
    double tokens = (double)cfg->train.micro_batches * cfg->train.micro_batch * cfg->train.seq_len;
    double flops_tok = 3 * model_forward_flops_per_token(c, (size_t)cfg->train.seq_len);
    double sec = r->ms_per_step / 1e3, tflops = flops_tok * tokens / sec / 1e12;
    char tps[32];
    moe_fmt_count(tps, sizeof tps, (uint64_t)(tokens / sec + 0.5));
    printf("model        %.3fB total / %.3fB active parameters, %.4g GFLOP/token training "
           "(3 x forward; causal attention at half)\n", p.total / 1e9, p.active / 1e9, flops_tok / 1e9);
    printf("device       %s, matrix product %.1f TFLOP/s measured\n", cfg->train.device, r->matmul_tflops);
    if (r->matmul_sustained_tflops > 0) bench_print_sustained(r->matmul_sustained_tflops, &r->matmul_clocks);
    printf("step         %.2f ms (mean of timed steps, %s, %s), %.0f tokens on %d rank(s)\n", r->ms_per_step,
           r->graph ? "replayed graph" : "run as queued",
           r->launch_ahead ? "each queued before the previous one's metrics are read" : "each after the previous "
           "one's metrics", tokens, r->ranks);
    if (r->graph)
        printf("graph alone  %.2f ms a replay, back to back (the host's part of a step: %.2f ms)\n", r->graph_only_ms,
               r->ms_per_step - r->graph_only_ms);
    printf("throughput   %s tokens/s, %.1f model TFLOP/s (per rank: %.0f tokens/s, %.1f TFLOP/s)\n", tps, tflops,
           tokens / sec / r->ranks, tflops / r->ranks);
    double per_rank = tflops / r->ranks;
    printf("MFU          %.1f%% of 989 TFLOP/s, %.1f%% of the measured %.1f TFLOP/s", 100 * per_rank / 989,
           100 * per_rank / r->matmul_tflops, r->matmul_tflops);
    if (r->matmul_sustained_tflops > 0) printf(", %.1f%% of the sustained %.1f", 100 * per_rank /
                                               r->matmul_sustained_tflops, r->matmul_sustained_tflops);
    printf(" (per rank)\n");
    json_t *numbers = json_pack("{s:s, s:i, s:f, s:f, s:b, s:b, s:f, s:f, s:f, s:f, s:f}", "device",
                                cfg->train.device, "ranks", r->ranks, "tokens_per_step", tokens, "ms_per_step",
                                r->ms_per_step, "launch_ahead", r->launch_ahead, "graph", r->graph, "graph_only_ms",
                                r->graph_only_ms, "tokens_per_s", tokens / sec, "model_tflops", tflops, "mfu",
                                per_rank / 989, "matmul_tflops", r->matmul_tflops);
    if (r->matmul_sustained_tflops > 0)
        json_object_set_new(numbers, "matmul_sustained_tflops", json_real(r->matmul_sustained_tflops));
    json_object_update(record, numbers);
    json_decref(numbers);
    print_clocks(&r->clocks, r->ms_per_step, tokens / r->ranks, record);
    print_memory(r, record);
    train_report_startup(r->startup, 1, record);
    print_host_part(r, record);
    json_object_set_new(record, "graph_capture_s", json_real(r->capture_s));
    double total = 0;
    for (int i = 0; i < PROFILE_N_PHASES; i++) total += r->phase_ms[i];
    printf("phases       one step with every kernel timed: %.1f ms of kernels in %.1f ms (the rest: "
           "communication and gaps)\n", total, r->profiled_ms);
    for (int i = 0; i < PROFILE_N_PHASES; i++)
        printf("  %-24s %8.2f ms  %5.1f%%\n", PROFILE_PHASE_NAMES[i], r->phase_ms[i],
               total > 0 ? 100 * r->phase_ms[i] / total : 0);
    printf("ops          the same step per op, longest first (calls, ms, share, phase):\n");
    for (int i = 0; i < r->n_ops; i++)
        printf("  %-24s %5d %8.2f ms  %5.1f%%  %s\n", r->ops[i].name, r->ops[i].calls, r->ops[i].ms,
               total > 0 ? 100 * r->ops[i].ms / total : 0, PROFILE_PHASE_NAMES[r->ops[i].phase]);
    printf("loss         %.4f (cross-entropy of the last timed step)\n", r->loss);
    json_object_set_new(record, "loss", json_real(r->loss));
    if (model_n_moe_layers(c))
        printf("experts      load max/mean %.2f (worst MoE layer, last timed step; 1.00 = even), "
               "%.2f%% of slots dropped\n", r->load_imbalance, 100 * r->drop_rate);
}

enum { OPT_WARMUP, OPT_STEPS, OPT_KERNELS, OPT_ONLY, OPT_JSON, OPT_CALIBRATE, OPT_GPU, N_OPTS };

// `moe bench --calibrate OUT.json [CONFIG.json] [key=value ...]`.
static int calibrate(const char *out, const char *gpu, char **pos, int n_pos, Comm *world) {
    Config cfg;
    bool file = n_pos > 0 && !strchr(pos[0], '=');
    if (file) cli_load_config(pos[0], &cfg);
    else config_defaults(&cfg);
    cli_override_and_validate(&cfg, n_pos - file, pos + file);
    bench_calibrate(&cfg, world, gpu ? gpu : strcmp(cfg.train.device, "cuda") ? "cpu" : "h200", out);
    return 0;
}

int cmd_bench(int argc, char **argv, Comm *world) {
    const char *values[N_OPTS] = {0};
    char **pos;
    int n_pos;
    cli_parse(&SPEC, argc, argv, values, &pos, &n_pos);
    if (values[OPT_CALIBRATE]) {
        int rc = calibrate(values[OPT_CALIBRATE], values[OPT_GPU], pos, n_pos, world);
        free(pos);
        return rc;
    }
    if (n_pos < 1 || strchr(pos[0], '=')) return cli_misuse(&SPEC, pos);
    Config cfg;
    MoeErr err;
    config_defaults(&cfg);
    if (config_load_file(&cfg, pos[0], err)) moe_fatal("%s", err);
    cli_override_and_validate(&cfg, n_pos - 1, pos + 1);
    if (values[OPT_ONLY] && !values[OPT_KERNELS])
        moe_fatal("moe bench: --only picks the kernel families that --kernels times; add --kernels");
    if (values[OPT_KERNELS]) {
        unsigned families = bench_kernel_families(values[OPT_ONLY]);
        cli_single_rank("moe bench --kernels", world);
        bench_kernels(&cfg, families);
        free(pos);
        return 0;
    }
    int warmup = values[OPT_WARMUP] ? (int)cli_number("--warmup", values[OPT_WARMUP], 2, 1000) : 3;
    int steps = values[OPT_STEPS] ? (int)cli_number("--steps", values[OPT_STEPS], 1, 100000) : 10;
    if (world->rank == 0) printf("moe bench %s: %d warm-up steps, %d timed\n", pos[0], warmup, steps);
    BenchReport r;
    train_bench(&cfg, world, warmup, steps, &r);
    json_t *record = json_pack("{s:s}", "config", pos[0]);
    if (world->rank == 0) print_report(&cfg, &r, record);
    if (world->rank == 0 && values[OPT_JSON] && fs_write_json_atomic(values[OPT_JSON], record, err))
        moe_fatal("--json: %s", err);
    json_decref(record);
    free(pos);
    return 0;
}

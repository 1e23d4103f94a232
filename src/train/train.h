// The training loop: data, micro-batches through the pipeline schedule, optimizer, logging,
// validation and checkpoints, for any backend behind the ops interface and any parallel layout.
#pragma once
#include "ckpt.h"
#include "config.h"
#include "io/tokens.h"
#include "model/model.h"
#include "ops/device_monitor.h"
#include "ops/profile_ops.h"
#include "setup.h"

// Trains cfg on the ranks of `world` (layout from cfg->parallel) from scratch, or from `resume` (a
// checkpoint directory) when non-NULL, up to train.steps or, when stop_at > 0, until step stop_at
// (saving a checkpoint there: for jobs with a time limit; the schedule still follows train.steps).
// Writes config.json, metrics.jsonl and checkpoints under cfg->train.out. Exits on errors.
void train_run(const Config *cfg, Comm *world, const char *resume, int64_t stop_at);

// Mean cross-entropy per token over the first max_seqs sequences of ds (in file order, whole
// micro-batches of all data-parallel ranks; *evaluated says how many), summed over the ranks.
double eval_loss(Model *m, Dataset *ds, size_t max_seqs, size_t *evaluated);

// Evaluation reads whole micro-batches of train.micro_batch sequences: -1 with a message naming
// `what` (e.g. "data.val FILE") when ds holds fewer.
int eval_check_data(const Dataset *ds, const Config *cfg, const char *what, MoeErr err);

// The startup of a process, phase by phase: the backend started (a GPU's context), the config
// checked and the memory planned (data opened, communicators made), the model and optimizer
// allocated, the weights initialised (or a checkpoint loaded), the first step done.
typedef enum { STARTUP_BACKEND, STARTUP_PLAN, STARTUP_ALLOC, STARTUP_INIT, STARTUP_STEP, STARTUP_N } StartupPhase;
// Prints a startup from when each phase ended (seconds since the program was loaded) as one line,
// and adds it to a JSON record as "startup": {"backend_s", ..., "first_step_s", "total_s"}.
void train_report_startup(const double end[STARTUP_N], int64_t step, json_t *record);

// Where the time of training steps went (summed over steps, or their means): the host's
// milliseconds preparing each (batches read, StepInfo, their uploads queued), queuing its work (a
// graph launch; or every kernel and communication, as a step that is not replayed queues them) and
// waiting for its metrics; the backend's from the start of its work to its metrics' download
// (events); whole steps (train_bench, events).
typedef struct {
    double stage_ms, launch_ms, wait_ms, device_ms, step_ms;
} StepTimes;

#define BENCH_RANKS 8 // ranks whose step timings a benchmark reports

typedef struct {
    double matmul_tflops;  // the backend's square matrix-product rate (bf16 8192^3 on a GPU)
    double matmul_sustained_tflops; // the same sustained for 2 s (0: not measured: no clock readings)
    ClockSummary matmul_clocks;     // the device's clocks while it was timed
    double ms_per_step;    // mean over the timed steps (CUDA events on a GPU), queued as train.launch_ahead says
    bool launch_ahead;     // ms_per_step is that of steps queued one ahead
    StepTimes times[2][BENCH_RANKS]; // timed steps of the first ranks: [0] each step's metrics waited for
                                     // before the next is queued, [1] the next queued first
    int n_times;           // ranks in times
    GraphCounts graph_nodes; // the recorded step's nodes (zero: no graph, or not known)
    size_t nccl_calls;     // NCCL operations a step queues or records
    double loss;           // CE of the last timed step (sanity)
    double load_imbalance; // the last timed step's worst MoE layer: max / mean expert load
    double drop_rate;      // the last timed step: dropped / routed slots, mean over MoE layers
    bool graph;            // steps replayed a recorded graph
    double graph_only_ms;  // that graph replayed back to back, no host work between (0: no graph)
    size_t memory_in_use;  // device memory in use after the run (0 when unknown)
    size_t memory_peak;    // the most in use during it (Ops.memory_peak; 0 when unknown)
    TrainMemory plan;      // this rank's memory plan, sized on a counting backend before the run
    TrainMemory allocated; // what its model and optimizer allocated
    double phase_ms[PROFILE_N_PHASES]; // one profiled step, kernels timed one by one
    ProfileOpTime ops[PROFILE_MAX_OPS]; // the same step per op, longest first
    int n_ops;
    double profiled_ms;    // that step's whole time (the rest: communication and gaps)
    int ranks;             // ranks of the run (tokens are over all of them)
    double startup[STARTUP_N]; // when each phase of the startup ended (train_report_startup)
    double capture_s;      // seconds recording the step's graph and instantiating it took (0: no graph)
    ClockSummary clocks;   // this rank's device clock and power during the timed steps (device_monitor.h)
} BenchReport;

// The backend's matrix-product rate (TFLOP/s) on a large square product of random values (bf16
// 8192^3 on a GPU), in a burst of 10.
double train_matmul_tflops(const Ops *ops);
// The same product repeated for `seconds` (as many as burst_tflops, train_matmul_tflops' rate,
// says fit), timed over the second half: on a GPU, the rate the device sustains once it meets its
// power limit, with its clocks read then.
double train_matmul_tflops_sustained(const Ops *ops, double burst_tflops, double seconds, ClockSummary *clocks);

// Trains `warmup` then `steps` steps of cfg on random token ids (nothing written) and measures.
void train_bench(const Config *cfg, Comm *world, int warmup, int steps, BenchReport *r);

// What a training step reports: losses, learning rate, gradient norm, throughput, per MoE layer
// the real expert loads (a falling balance loss does not prove balanced work, so both are shown),
// under train.precision=fp8 the shares of values the FP8 quantisation flushed to zero or
// saturated, per tensor class, and on a GPU its clock and power. Built from the metrics buffer the
// model fills in backend memory. The run's log of them, metrics.jsonl: one JSON object per line,
// every write checked.
#pragma once
#include <jansson.h>
#include <stdio.h>

#include "model/model.h"
#include "ops/device_monitor.h"

typedef struct {
    double *load;          // (E) routed slots per expert over the step
    double imbalance;      // max load / mean load
    double min_over_mean;  // min load / mean load
    double drop_rate;      // dropped slots / routed slots
    double lb, z;          // this layer's aux losses (mean over micro-batches)
} LayerLoad;

typedef struct {
    int64_t step, steps;
    double loss, ce, lb, z, lm_z; // loss = ce + coefficients x aux losses
    double lr, grad_norm;
    double tokens;         // tokens trained on through this step, all ranks (from the data position)
    double tokens_per_sec, elapsed_s;
    double eta_s;          // console only: seconds to the run's last step (NAN: not known yet)
    double pipeline_wait;  // share of the step rank 0 spent in pipeline transfers (bubble + comm)
    int n_moe, E;
    LayerLoad *layers;     // (n_moe)
    const uint64_t *fp8;   // (FP8_CLASSES, FP8_COUNTS) the step's FP8 counters, all ranks (ops/fp8.h);
                           // NULL: not in FP8 (set by the caller; not freed here)
    const ClockSummary *clocks; // rank 0's device during the step (device_monitor.h); NULL or no
                                // readings: not known (set by the caller)
} StepReport;

// `metrics` is the host copy of the model's metrics after a step of n_micro micro-batches of
// T tokens each.
void report_build(StepReport *r, const ModelConfig *c, const float *metrics, size_t n_micro,
                  size_t T);
void report_free(StepReport *r);
bool report_finite(const StepReport *r);
double report_worst_imbalance(const StepReport *r);      // max/mean expert load of the worst layer
double report_drop_rate(const StepReport *r);            // dropped / routed slots, mean over layers
void report_print(const StepReport *r, FILE *f);          // one console line
json_t *report_to_json(const StepReport *r);              // its metrics.jsonl record
// The keys of a record's "fp8" object: tensor class c's (Fp8Class) and counter i's (ops/fp8.h).
const char *report_fp8_class_key(int c);
const char *report_fp8_count_key(int i);

typedef struct {
    FILE *file;
    char path[4200];
    size_t dropped;             // lines removed when the log was reopened for a resume
    int64_t best_val_step;      // validation records of the whole run (kept on a resume, or
    double best_val;            // written since): the lowest loss and its step (-1: none yet),
    int64_t last_val_step;      // and the latest
    double last_val;
} MetricsLog;

// Opens run_dir/metrics.jsonl: empty for a new run; for a run resumed at `step`, the records up
// to that step are kept and the rest dropped (the steps it redoes, and a last line cut short by a
// crash or a full disk), so that every step is logged once and every line is whole JSON. The
// validation records kept start the log's best and latest validation loss.
int metrics_log_open(MetricsLog *log, const char *run_dir, bool resume, int64_t step, MoeErr err);
// Appends `record` as one line and flushes; takes the reference. -1 with a message naming the log
// when it cannot be written (a full disk): the run must stop rather than lose its metrics.
int metrics_log_write(MetricsLog *log, json_t *record, MoeErr err);
// The validation record of a step; a non-finite loss is written as null (JSON has no NaN).
json_t *metrics_val_record(int64_t step, double loss, size_t sequences);
void metrics_log_close(MetricsLog *log);

// A run's metrics.jsonl read back for its pictures (`moe plot`): the step records as series over
// the steps (with train.precision=fp8 the shares of values its quantisation flushed to zero and
// saturated), the validation losses, and per MoE layer each expert's share of the routed slots.
// Each step appears once: a record of a step at or before the previous one starts the log again
// from there (a resumed run redid those steps: its records replace the earlier ones, and the
// validation records from that step on). No drawing here, so the unit tests read it without cairo.
#pragma once
#include <stddef.h>

#include "common/util.h"

typedef enum {
    HIST_CE,              // training cross-entropy (the validation loss is one too)
    HIST_LR,
    HIST_GRAD_NORM,
    HIST_TOKENS,          // tokens trained on through the step (logs before this field: NaN)
    HIST_TOKENS_PER_SEC,
    HIST_IMBALANCE,       // max/mean expert load of the step's worst MoE layer
    HIST_FP8_FLUSHED,     // from here one series per FP8 tensor class (Fp8Class: weights, activations,
                          // gradients): the percentage of its values flushed to zero (NaN: not fp8)
    HIST_FP8_SATURATED = HIST_FP8_FLUSHED + 3, // the same for the values saturated
    HIST_SERIES = HIST_FP8_SATURATED + 3
} HistSeries;

// Expert shares are kept for at most this many steps, evenly spread (every `stride`-th step
// record): enough for a heatmap a few thousand pixels wide, whatever the run's length.
#define HIST_MAX_ROWS 2048

typedef struct {
    size_t n, cap;              // step records, in step order
    double *step;               // (n)
    double *v[HIST_SERIES];     // (n) each; NaN where a record has no value (null or missing)
    int n_moe, E;               // MoE layers and experts per layer (0: no expert loads recorded)
    size_t n_rows, rows_cap;    // the step records with expert shares: every stride-th one
    size_t stride;
    size_t *row;                // (n_rows) their index in the series
    float *share;               // (n_rows, n_moe, E) slots routed to the expert / the layer's slots
    float *row_max, *row_min;   // (n_rows, n_moe) max/mean and min/mean expert load per layer
    size_t n_val, val_cap;
    double *val_step, *val_loss; // (n_val) in step order
} RunHistory;

// Reads `path` (a metrics.jsonl). -1 with a message naming the file (and line) when it cannot be
// read, a line is not a JSON record with an integer "step", the expert loads change shape, or it
// holds no step record. A last line cut short (a crash mid-write) is left out with a warning on
// stderr.
int history_read(RunHistory *h, const char *path, MoeErr err);
void history_free(RunHistory *h);
// Fills the missing token counts (logs written before records had them) as step x tokens_per_step.
void history_fill_tokens(RunHistory *h, double tokens_per_step);
// The tokens through `step` (NaN when no record of that step has them).
double history_tokens_at(const RunHistory *h, double step);
// out[i] = the mean of y over records [i - before, i + after] (clipped to [0, n); NaN left out; NaN
// where y[i] or all of them are).
void history_window_mean(const double *y, size_t n, size_t before, size_t after, double *out);
// out (h->n) = 100 (m_h - m_ref) / m_ref: h's training cross-entropy against ref's at the same step,
// each a mean over the `window` step records ending there (history_window_mean); NaN where ref has
// no record of the step.
void history_loss_gap(const RunHistory *h, const RunHistory *ref, size_t window, double *out);

// The optimizer step over the parameter registry: learning-rate schedule, global gradient norm,
// AdamW (decoupled weight decay, none on norms and embeddings), loss-free bias balancing.
#pragma once
#include "config.h"
#include "model/model.h"

// Learning rate of 1-based step `step`: linear warmup, then cosine or linear decay to
// lr * min_lr_ratio at the last step, or constant.
double optim_lr(const TrainConfig *t, int step);
// Writes this step's StepInfo (lr, step, routing-noise seed) to backend memory; call before the
// step's forwards.
void optim_begin_step(Model *m, const TrainConfig *t, int step);
// Gradient norm into metrics[METRIC_GRAD_NORM_SQ], clipped AdamW update of every parameter,
// bias update from the step's expert loads, and a fresh compute copy of the weights.
void optim_step(Model *m, const TrainConfig *t, void *metrics);

// The optimizer: learning-rate schedule, global gradient norm, and AdamW (decoupled weight decay,
// none on norms and embeddings) sharded ZeRO-1 style: each parameter region (dense, experts) is
// replicated over a group of ranks; gradients are reduce-scattered over the group, each rank
// updates its shard with its own moments and fp32 master weights (where the backend keeps a
// separate compute copy, the master weights held are that shard alone: Model.master_begin), and
// the compute weights are all-gathered back. The
// reduction can run in buckets of whole layers, each started as soon as the backward of the
// step's last micro-batch is done with them, on the backend's side queue (overlapping the
// backward of the layers before): a region is laid out in layer order and the backward runs the
// layers in reverse, so what is final is always the region's tail.
#pragma once
#include "config.h"
#include "model/model.h"

typedef struct {
    Comm *group;               // ranks holding this region
    size_t begin, size;        // the region in the flat buffers (size divisible by the group)
    size_t shard_begin, shard; // this rank's part: flat [shard_begin, shard_begin + shard)
    size_t reduced_from;       // flat: the tail [reduced_from, begin + size) is queued for reduction
    void *grad;                // f32 (shard) summed gradient (the model's own when the group is 1)
    void *m, *v;               // f32 (shard) AdamW moments
} OptShard;

typedef struct {
    OptShard region[PARAM_N_REGIONS];
    size_t state_bytes;        // optimizer state of this rank: its shards of the AdamW moments
    size_t grad_bytes;         // its reduced gradient shards of its own (regions over several ranks)
    bool overlap;              // train.optimizer_overlap: each step's update waits for the next forward
    void *norm_sq;             // f32 (1) the latest step's global gradient norm squared (its update's clip)
    StepInfo *step_info;       // backend memory: the latest step's StepInfo (its update's learning rate
                               // and bias correction; Model.step_info may already hold the next step's)
    const TrainConfig *train;  // the latest step's AdamW settings
    int queued, joined;        // units (model_param_unit) of the pending update: those before `queued`
                               // are queued, those before `joined` complete before the main queue's
                               // later work; n_layers + 1: none pending
} Optimizer;

// Sets up the shards of m's regions with zero moments and zero gradients, nothing pending (memory
// freed with the model).
void optim_init(Optimizer *o, Model *m);
// After the backward of held layer l for the step's last micro-batch: queues the reduction of
// the gradients of l and the layers after it that are not queued yet, once they are at least
// min_bucket elements (a bucket per layer when layers are that large; small ones join).
void optim_grads_ready(Optimizer *o, Model *m, int l, size_t min_bucket);
// Learning rate of 1-based step `step`: linear warmup, then cosine or linear decay to
// lr * min_lr_ratio at the last step, or constant.
double optim_lr(const TrainConfig *t, int64_t step);
// The StepInfo of step `step` (lr, step, routing-noise seed), for Model.step_info before the
// step's forwards.
StepInfo optim_step_info(const TrainConfig *t, int64_t step);
// The end of a step: reduce-scatter of the gradients not queued yet (all of them unless
// optim_grads_ready ran), the global gradient norm (over every rank; also into
// metrics[METRIC_GRAD_NORM_SQ]), the step's StepInfo kept, and the loss-free bias update from the
// step's expert loads (metrics must already hold the totals over all ranks). Then the update, unit
// by unit of the forward (model_param_unit): clipped AdamW on the shards, all-gather of the
// weights, their FP8 copies (train.precision = fp8), the gradients zeroed for the next step. Without
// o->overlap it runs here; with it, it is pending: optim_unit_begins runs each unit's beside the
// next step's forward, optim_flush whatever is left. Either way the same operations on the same
// values.
void optim_step(Optimizer *o, Model *m, const TrainConfig *t, void *metrics);
// Before a forward's unit reads its weights (ForwardArgs.unit_begins): the main queue's later work
// waits for the pending update of the unit and those before it, and the next unit's is queued on
// the side queue, to run beside the unit's forward.
void optim_unit_begins(Optimizer *o, Model *m, int unit);
// Completes the pending update (nothing when none is): before anything outside a step reads or
// writes weights or optimizer state (evaluation, checkpoints).
void optim_flush(Optimizer *o, Model *m);
// Whether an update is pending.
bool optim_pending(const Optimizer *o, const Model *m);

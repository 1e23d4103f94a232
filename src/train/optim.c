// Sharded AdamW and the learning-rate schedule (see optim.h).
#include "optim.h"

#include <math.h>

void optim_init(Optimizer *o, Model *m) {
    const Ops *ops = m->ops;
    o->state_bytes = o->grad_bytes = 0;
    for (int r = 0; r < PARAM_N_REGIONS; r++) {
        OptShard *s = &o->region[r];
        s->group = model_region_group(m, (ParamRegion)r);
        s->begin = m->reg.region_begin[r], s->size = m->reg.region_size[r];
        model_region_shard(m, (ParamRegion)r, &s->shard_begin, &s->shard);
        s->reduced_from = s->begin + s->size;
        size_t bytes = s->shard * ops->f32_size;
        s->grad = s->group->size > 1 ? model_alloc(m, bytes) : model_f32(m, m->grads, s->begin);
        o->grad_bytes += s->group->size > 1 ? bytes : 0;
        s->m = model_alloc(m, bytes), s->v = model_alloc(m, bytes);
        ops->zero(s->m, bytes), ops->zero(s->v, bytes);
        o->state_bytes += 2 * bytes;
    }
    ops->zero(m->grads, m->reg.total * ops->f32_size); // then zeroed by each update that read them
    o->norm_sq = model_alloc(m, ops->f32_size);
    o->step_info = model_alloc(m, sizeof(StepInfo));
    o->overlap = false;
    o->queued = o->joined = m->cfg.n_layers + 1;
}

// Queues the reduce-scatter of the gradients [from, reduced_from) of a region on the side queue.
static void reduce_grads(OptShard *s, Model *m, size_t from) {
    const Ops *ops = m->ops;
    if (s->group->size == 1 || from >= s->reduced_from) return;
    if (ops->side_begin) ops->side_begin();
    comm_reduce_scatter_part(s->group, model_f32(m, m->grads, s->begin), s->grad, s->shard,
                             from - s->begin, s->reduced_from - s->begin, COMM_F32);
    if (ops->side_end) ops->side_end();
    s->reduced_from = from;
}

// Where the tensors of units u and after (model_param_unit) start in a region (its end when it has
// none of them): a region is laid out in the forward's order. Layer l's reduction bucket starts
// there too: the head, after the last layer, goes with the last layer's bucket, the embedding,
// first, with the step's last call.
static size_t units_from(const OptShard *s, const Model *m, int u) {
    size_t start = s->begin + s->size;
    for (size_t i = 0; i < m->reg.n; i++) {
        const ParamInfo *p = &m->reg.p[i];
        if (model_param_unit(m, p) >= u && p->offset >= s->begin && p->offset < start) start = p->offset;
    }
    return start;
}

void optim_grads_ready(Optimizer *o, Model *m, int l, size_t min_bucket) {
    for (int r = 0; r < PARAM_N_REGIONS; r++) {
        OptShard *s = &o->region[r];
        size_t from = units_from(s, m, l);
        if (s->reduced_from - from >= min_bucket) reduce_grads(s, m, from);
    }
}

double optim_lr(const TrainConfig *t, int64_t step) {
    if (step <= t->warmup) return t->lr * (double)step / (t->warmup + 1.0);
    if (t->schedule == SCHED_CONSTANT || t->steps <= t->warmup) return t->lr;
    double progress = (double)(step - t->warmup) / (double)(t->steps - t->warmup);
    progress = progress > 1 ? 1 : progress;
    double floor = t->lr * t->min_lr_ratio;
    double shape = t->schedule == SCHED_COSINE ? 0.5 * (1 + cos(M_PI * progress)) : 1 - progress;
    return floor + (t->lr - floor) * shape;
}

// StepInfo.step (int32 on the device) only corrects AdamW's bias, which is 1 long before 2^31.
StepInfo optim_step_info(const TrainConfig *t, int64_t step) {
    return (StepInfo){.lr = (float)optim_lr(t, step), .step = step < INT32_MAX ? (int32_t)step : INT32_MAX,
                      .seed = rng_hash64((uint64_t)t->seed, (uint64_t)step)};
}

static AdamWArgs adamw_args(const TrainConfig *t, bool decay) {
    return (AdamWArgs){.beta1 = (float)t->beta1, .beta2 = (float)t->beta2, .eps = (float)t->eps,
                       .weight_decay = decay ? (float)t->weight_decay : 0.0f, .clip = (float)t->clip};
}

// AdamW over the shard's part of flat [lo, hi), one call per run of adjacent tensors with the same
// weight decay (the runs cut at the part's edges; region padding belongs to no tensor and stays
// zero), writing the compute weights into `window` (element x at x - first; model_compute_window).
static void adamw_part(const Optimizer *o, Model *m, const OptShard *s, size_t lo, size_t hi, void *window,
                       size_t first) {
    const Ops *ops = m->ops;
    const ParamRegistry *r = &m->reg;
    lo = size_max(lo, s->shard_begin);
    hi = size_min(hi, s->shard_begin + s->shard);
    for (size_t i = 0; i < r->n;) {
        size_t j = i;
        while (j + 1 < r->n && r->p[j + 1].decay == r->p[i].decay &&
               r->p[j + 1].offset == r->p[j].offset + r->p[j].numel)
            j++;
        size_t a = size_max(r->p[i].offset, lo);
        size_t b = size_min(r->p[j].offset + r->p[j].numel, hi);
        i = j + 1;
        if (a >= b) continue;
        AdamWArgs args = adamw_args(o->train, r->p[j].decay);
        void *act = ops->act_aliases_f32 ? NULL : model_act(m, window, a - first);
        size_t at = a - s->shard_begin;
        ops->adamw_update(model_master(m, a), act, model_f32(m, s->grad, at), model_f32(m, s->m, at),
                          model_f32(m, s->v, at), b - a, args, o->step_info, o->norm_sq);
    }
}

// The weight decay of the registered tensors in flat [a, b), which all share one (an FP8 weight
// tensor's, one registered tensor an expert).
static bool span_decay(const ParamRegistry *r, size_t a, size_t b) {
    int decay = -1;
    for (size_t i = 0; i < r->n; i++)
        if (r->p[i].offset >= a && r->p[i].offset < b) {
            MOE_ASSERT(decay < 0 || decay == r->p[i].decay);
            decay = r->p[i].decay;
        }
    MOE_ASSERT(decay >= 0);
    return decay;
}

// AdamW on flat [a, b) of region r where it is one weight tensor whose FP8 copy the update makes
// (model_fp8_update_target: the ops' adamw_update_fp8, its compute weights never written). Returns
// whether it was.
static bool update_fp8_span(const Optimizer *o, Model *m, ParamRegion r, size_t a, size_t b) {
    const Ops *ops = m->ops;
    const OptShard *s = &o->region[r];
    uint64_t *counts;
    const Fp8Weights *t = ops->adamw_update_fp8 ? model_fp8_update_target(m, r, a, b, &counts) : NULL;
    if (!t) return false;
    MOE_ASSERT(a >= s->shard_begin && b <= s->shard_begin + s->shard); // a group of one rank: the region
    size_t at = a - s->shard_begin;
    ops->adamw_update_fp8(model_master(m, a), model_f32(m, s->grad, at), model_f32(m, s->m, at),
                          model_f32(m, s->v, at), t->q, t->scales, t->scales_t, t->El, t->N, t->K,
                          adamw_args(o->train, span_decay(&m->reg, a, b)), o->step_info, o->norm_sq, m->fp8->how,
                          counts);
    return true;
}

// AdamW on this rank's shard of flat [a, b) of region r, then its compute weights made whole and
// their FP8 copies made (model_compute_weights_ready), or both at once (update_fp8_span).
static void update_span(const Optimizer *o, Model *m, ParamRegion r, size_t a, size_t b) {
    if (update_fp8_span(o, m, r, a, b)) return;
    size_t first;
    void *window = model_compute_window(m, r, a, &first);
    adamw_part(o, m, &o->region[r], a, b, window, first);
    model_compute_weights_ready(m, r, a, b, window, first);
}

// The update of units [u0, u1), queued where work goes now: per region, their tensors' update
// (update_span, a span at a time: model_compute_span_end), and their gradients zeroed
// (read until here; the next step's backward accumulates into them) but the experts' weight
// gradients, which its first write overwrites (model_grads_consumed). Elementwise, so any split into
// units computes the same values.
static void update_units(const Optimizer *o, Model *m, int u0, int u1) {
    for (int r = 0; r < PARAM_N_REGIONS; r++) {
        const OptShard *s = &o->region[r];
        size_t a = units_from(s, m, u0), b = units_from(s, m, u1);
        for (size_t x = a, y; x < b; x = y) {
            y = model_compute_span_end(m, (ParamRegion)r, x, b);
            update_span(o, m, (ParamRegion)r, x, y);
        }
        if (r != PARAM_EXPERT && a < b) m->ops->zero(model_f32(m, m->grads, a), (b - a) * m->ops->f32_size);
    }
    model_grads_consumed(m, u0, u1);
}

// Whether unit u has tensors on this rank.
static bool unit_held(const Model *m, int u) {
    if (u < 0) return m->first_stage;
    return u < m->cfg.n_layers ? model_holds_layer(m, u) : m->last_stage;
}

// The first unit at or after u with tensors on this rank (n_layers + 1: none).
static int held_from(const Model *m, int u) {
    while (u <= m->cfg.n_layers && !unit_held(m, u)) u++;
    return u;
}

// Queues the update of the pending units up to `unit` on the side queue, after the main queue's work
// so far.
static void queue_units(Optimizer *o, Model *m, int unit) {
    const Ops *ops = m->ops;
    if (unit < o->queued || unit > m->cfg.n_layers) return;
    if (ops->side_begin) ops->side_begin();
    update_units(o, m, o->queued, unit + 1);
    if (ops->side_end) ops->side_end();
    o->queued = held_from(m, unit + 1);
}

bool optim_pending(const Optimizer *o, const Model *m) { return o->joined <= m->cfg.n_layers; }

void optim_unit_begins(Optimizer *o, Model *m, int unit) {
    if (unit < o->joined) return;
    queue_units(o, m, unit);
    if (m->ops->side_join) m->ops->side_join();
    o->joined = o->queued;
    queue_units(o, m, o->queued); // the next one, beside this unit's forward
}

void optim_flush(Optimizer *o, Model *m) {
    if (!optim_pending(o, m)) return;
    if (m->ops->side_join) m->ops->side_join();
    update_units(o, m, o->queued, m->cfg.n_layers + 1);
    o->queued = o->joined = m->cfg.n_layers + 1;
}

void optim_step(Optimizer *o, Model *m, const TrainConfig *t, void *metrics) {
    const Ops *ops = m->ops;
    const ModelConfig *c = &m->cfg;
    MOE_ASSERT(!optim_pending(o, m));
    for (int r = 0; r < PARAM_N_REGIONS; r++) reduce_grads(&o->region[r], m, o->region[r].begin);
    if (ops->side_join) ops->side_join();
    ops->zero(o->norm_sq, ops->f32_size);
    for (int r = 0; r < PARAM_N_REGIONS; r++) {
        OptShard *s = &o->region[r];
        s->reduced_from = s->begin + s->size;
        ops->sum_squares(o->norm_sq, s->grad, s->shard);
    }
    Comm *world = m->par->world;
    world->ops->all_reduce_sum(world, o->norm_sq, 1, COMM_F32); // each element lives in one shard
    ops->copy(model_f32(m, metrics, METRIC_GRAD_NORM_SQ), o->norm_sq, ops->f32_size);
    ops->copy(o->step_info, m->step_info, sizeof(StepInfo));
    if (c->bias_gamma > 0) // reads the step's loads, which the next step's metrics replace
        for (int l = 0; l < c->n_layers; l++)
            if (model_holds_layer(m, l) && model_layer_is_moe(c, l))
                ops->router_bias_update(model_f32(m, m->expert_bias, (size_t)l * c->n_experts),
                                        model_f32(m, metrics, model_metric_router(c, l - c->n_dense_layers)),
                                        (size_t)c->n_experts, (float)c->bias_gamma);
    o->train = t;
    o->queued = o->joined = held_from(m, -1);
    if (!o->overlap) optim_flush(o, m);
}

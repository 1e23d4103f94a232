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

// Where the tensors of layers l and after start in a region (its end when it has none of them).
// Tensors of no layer (embedding, head) are not counted: the head, after the last layer, goes
// with the last layer's bucket, the embedding, first, with the step's last call.
static size_t layers_from(const OptShard *s, const Model *m, int l) {
    size_t start = s->begin + s->size;
    for (size_t i = 0; i < m->reg.n; i++) {
        const ParamInfo *p = &m->reg.p[i];
        if (p->layer >= l && p->offset >= s->begin && p->offset < start) start = p->offset;
    }
    return start;
}

void optim_grads_ready(Optimizer *o, Model *m, int l, size_t min_bucket) {
    for (int r = 0; r < PARAM_N_REGIONS; r++) {
        OptShard *s = &o->region[r];
        size_t from = layers_from(s, m, l);
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

// AdamW over the shard, one call per run of adjacent tensors with the same weight decay (the
// runs cut at the shard's edges; region padding belongs to no tensor and stays zero).
static void adamw_shard(Model *m, const OptShard *s, const TrainConfig *t, const void *norm_sq) {
    const Ops *ops = m->ops;
    const ParamRegistry *r = &m->reg;
    size_t lo = s->shard_begin, hi = s->shard_begin + s->shard;
    for (size_t i = 0; i < r->n;) {
        size_t j = i;
        while (j + 1 < r->n && r->p[j + 1].decay == r->p[i].decay &&
               r->p[j + 1].offset == r->p[j].offset + r->p[j].numel)
            j++;
        size_t a = r->p[i].offset > lo ? r->p[i].offset : lo;
        size_t b = r->p[j].offset + r->p[j].numel < hi ? r->p[j].offset + r->p[j].numel : hi;
        i = j + 1;
        if (a >= b) continue;
        AdamWArgs args = {.beta1 = (float)t->beta1, .beta2 = (float)t->beta2, .eps = (float)t->eps,
                          .weight_decay = r->p[j].decay ? (float)t->weight_decay : 0.0f,
                          .clip = (float)t->clip};
        void *act = ops->act_aliases_f32 ? NULL : model_act(m, m->params_act, a);
        ops->adamw_update(model_master(m, a), act, model_f32(m, s->grad, a - lo),
                          model_f32(m, s->m, a - lo), model_f32(m, s->v, a - lo), b - a, args,
                          m->step_info, norm_sq);
    }
}

void optim_step(Optimizer *o, Model *m, const TrainConfig *t, void *metrics) {
    const Ops *ops = m->ops;
    const ModelConfig *c = &m->cfg;
    void *norm_sq = model_f32(m, metrics, METRIC_GRAD_NORM_SQ);
    for (int r = 0; r < PARAM_N_REGIONS; r++) reduce_grads(&o->region[r], m, o->region[r].begin);
    if (ops->side_join) ops->side_join();
    for (int r = 0; r < PARAM_N_REGIONS; r++) {
        OptShard *s = &o->region[r];
        s->reduced_from = s->begin + s->size;
        ops->sum_squares(norm_sq, s->grad, s->shard);
    }
    Comm *world = m->par->world;
    world->ops->all_reduce_sum(world, norm_sq, 1, COMM_F32); // each element lives in one shard
    for (int r = 0; r < PARAM_N_REGIONS; r++) {
        OptShard *s = &o->region[r];
        adamw_shard(m, s, t, norm_sq);
        if (s->group->size > 1)
            s->group->ops->all_gather(s->group, model_act(m, m->params_act, s->shard_begin),
                                      model_act(m, m->params_act, s->begin), s->shard, COMM_ACT);
    }
    model_quantize_fp8_weights(m); // the compute weights are final: their FP8 copies follow
    if (c->bias_gamma > 0)
        for (int l = 0; l < c->n_layers; l++)
            if (model_holds_layer(m, l) && model_layer_is_moe(c, l))
                ops->router_bias_update(model_f32(m, m->expert_bias, (size_t)l * c->n_experts),
                                        model_f32(m, metrics, model_metric_router(c, l - c->n_dense_layers)),
                                        (size_t)c->n_experts, (float)c->bias_gamma);
}

// AdamW and the learning-rate schedule, applied tensor run by tensor run from the registry.
#include "optim.h"

#include <math.h>

double optim_lr(const TrainConfig *t, int step) {
    if (step <= t->warmup) return t->lr * step / (t->warmup + 1.0);
    if (t->schedule == SCHED_CONSTANT || t->steps <= t->warmup) return t->lr;
    double progress = (double)(step - t->warmup) / (double)(t->steps - t->warmup);
    progress = progress > 1 ? 1 : progress;
    double floor = t->lr * t->min_lr_ratio;
    double shape = t->schedule == SCHED_COSINE ? 0.5 * (1 + cos(M_PI * progress)) : 1 - progress;
    return floor + (t->lr - floor) * shape;
}

void optim_begin_step(Model *m, const TrainConfig *t, int step) {
    StepInfo info = {.lr = (float)optim_lr(t, step), .step = step,
                     .seed = rng_hash64((uint64_t)t->seed, (uint64_t)step)};
    m->ops->upload(m->step_info, &info, sizeof info);
}

// Consecutive tensors with the same weight decay are adjacent in the flat buffers: one call each.
static void adamw_all(Model *m, const TrainConfig *t, const void *norm_sq) {
    const Ops *ops = m->ops;
    const ParamRegistry *r = &m->reg;
    for (size_t i = 0; i < r->n;) {
        size_t j = i;
        while (j + 1 < r->n && r->p[j + 1].decay == r->p[i].decay) j++;
        size_t off = r->p[i].offset, n = r->p[j].offset + r->p[j].numel - off;
        AdamWArgs a = {.beta1 = (float)t->beta1, .beta2 = (float)t->beta2, .eps = (float)t->eps,
                       .weight_decay = r->p[i].decay ? (float)t->weight_decay : 0.0f,
                       .clip = (float)t->clip};
        void *act = ops->act_aliases_f32 ? NULL : model_act(m, m->params_act, off);
        ops->adamw_update(model_f32(m, m->params, off), act, model_f32(m, m->grads, off),
                          model_f32(m, m->adam_m, off), model_f32(m, m->adam_v, off), n, a,
                          m->step_info, norm_sq);
        i = j + 1;
    }
}

void optim_step(Model *m, const TrainConfig *t, void *metrics) {
    const Ops *ops = m->ops;
    const ModelConfig *c = &m->cfg;
    void *norm_sq = model_f32(m, metrics, METRIC_GRAD_NORM_SQ);
    ops->sum_squares(norm_sq, m->grads, m->reg.total);
    adamw_all(m, t, norm_sq);
    if (c->bias_gamma > 0)
        for (int l = c->n_dense_layers; l < c->n_layers; l++)
            ops->router_bias_update(model_f32(m, m->expert_bias, (size_t)l * c->n_experts),
                                    model_f32(m, metrics, model_metric_router(c, l - c->n_dense_layers)),
                                    (size_t)c->n_experts, (float)c->bias_gamma);
}

// Layout arithmetic and validation (see layout.h).
#include "layout.h"

void layout_stage_layers(int n_layers, int n, int vs, int *begin, int *end) {
    int base = n_layers / n, extra = n_layers % n;
    *begin = vs * base + (vs < extra ? vs : extra);
    *end = *begin + base + (vs < extra ? 1 : 0);
}

static int check(int world, const LayoutSpec *s, MoeErr err) {
    int pp = s->pp, ep = s->ep;
    if (pp < 1 || ep < 1)
        return moe_err(err, "parallel.pp = %d and parallel.ep = %d must be at least 1", pp, ep);
    if (world % pp)
        return moe_err(err, "%d ranks cannot form parallel.pp = %d pipeline stages (the number of "
                       "ranks must be a multiple of parallel.pp)", world, pp);
    if (pp > s->n_layers)
        return moe_err(err, "parallel.pp = %d stages is more than model.n_layers = %d", pp, s->n_layers);
    if (pipeline_check(pp, s->v, s->micro_batches, err)) return -1;
    if (pp * s->v > s->n_layers)
        return moe_err(err, "parallel.pp = %d stages x parallel.virtual_stages = %d chunks is more than "
                       "model.n_layers = %d (each chunk holds a layer at least)", pp, s->v, s->n_layers);
    int dp = world / pp;
    if (dp % ep)
        return moe_err(err, "parallel.ep = %d must divide the data-parallel size %d (= %d ranks / "
                       "parallel.pp = %d)", ep, dp, world, pp);
    if (ep > 1 && !s->has_moe)
        return moe_err(err, "parallel.ep = %d but the model has no MoE layers", ep);
    if (s->has_moe && s->n_experts % ep)
        return moe_err(err, "model.n_experts = %d must be a multiple of parallel.ep = %d", s->n_experts, ep);
    if (s->micro_batch % dp)
        return moe_err(err, "train.micro_batch = %d sequences (per micro-batch, all ranks together) "
                       "must be a multiple of the data-parallel size %d", s->micro_batch, dp);
    return 0;
}

int layout_init(Layout *l, int world, int rank, const LayoutSpec *s, MoeErr err) {
    if (check(world, s, err)) return -1;
    *l = (Layout){.world = world, .rank = rank, .pp = s->pp, .dp = world / s->pp, .ep = s->ep, .v = s->v};
    l->edp = l->dp / s->ep;
    l->stage = rank / l->dp;
    l->dp_rank = rank % l->dp;
    l->ep_rank = l->dp_rank % s->ep;
    l->edp_rank = l->dp_rank / s->ep;
    for (int c = 0; c < s->v; c++)
        layout_stage_layers(s->n_layers, s->pp * s->v, c * s->pp + l->stage, &l->layer_begin[c], &l->layer_end[c]);
    int per = s->has_moe ? s->n_experts / s->ep : 0;
    l->expert_begin = l->ep_rank * per;
    l->expert_end = l->expert_begin + per;
    l->micro_per_rank = s->micro_batch / l->dp;
    return 0;
}

// Builds the communicators of a layout (see parallel.h).
#include "parallel.h"

void parallel_init(Parallel *p, Comm *world, const ParallelSpec *s) {
    MoeErr err;
    if (layout_init(&p->lay, world->size, world->rank, &s->layout, err)) moe_fatal("%s", err);
    const Layout *l = &p->lay;
    p->world = world, p->owned_world = NULL;
    p->exchange = s->exchange, p->recv_capacity = s->recv_capacity;
    p->exchange_chunks = s->exchange_chunks, p->push_ctas = s->push_ctas;
    p->dp = world->ops->split(world, l->stage, l->dp_rank);
    p->ep = world->ops->split(world, l->stage * l->edp + l->edp_rank, l->ep_rank);
    p->edp = world->ops->split(world, l->stage * l->ep + l->ep_rank, l->edp_rank);
}

void parallel_free(Parallel *p) {
    Comm *groups[3] = {p->dp, p->ep, p->edp};
    for (int i = 0; i < 3; i++) groups[i]->ops->free(groups[i]);
    if (p->owned_world) p->owned_world->ops->free(p->owned_world);
}

int parallel_plan(Parallel *p, Comm groups[4], int world, int rank, const ParallelSpec *s, MoeErr err) {
    if (layout_init(&p->lay, world, rank, &s->layout, err)) return -1;
    const Layout *l = &p->lay;
    groups[0] = (Comm){.rank = rank, .size = world};
    groups[1] = (Comm){.rank = l->dp_rank, .size = l->dp};
    groups[2] = (Comm){.rank = l->ep_rank, .size = l->ep};
    groups[3] = (Comm){.rank = l->edp_rank, .size = l->edp};
    p->exchange = s->exchange, p->recv_capacity = s->recv_capacity, p->owned_world = NULL;
    p->exchange_chunks = s->exchange_chunks, p->push_ctas = s->push_ctas;
    p->world = &groups[0], p->dp = &groups[1], p->ep = &groups[2], p->edp = &groups[3];
    return 0;
}

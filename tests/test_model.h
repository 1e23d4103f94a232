// Helpers for tests that build a model in one process.
#pragma once
#include "common/real.h"
#include "dist/parallel.h"
#include "model/model.h"

// A one-rank layout holding every layer and expert of c.
static inline void test_single_parallel(Parallel *p, const ModelConfig *c) {
    ParallelSpec s = {.layout = {.pp = 1, .ep = 1, .v = 1, .n_layers = c->n_layers, .n_experts = c->n_experts,
                                 .has_moe = model_n_moe_layers(c) > 0, .micro_batch = 1, .micro_batches = 1}};
    parallel_init(p, comm_self(sizeof(real)), &s);
}

static inline void test_free_parallel(Parallel *p) {
    Comm *world = p->world;
    parallel_free(p);
    world->ops->free(world);
}

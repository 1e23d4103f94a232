// The layout search of `moe plan`: every way to run a config's model and global batch on N devices
// (pipeline stages and their chunks, data and expert parallelism, micro-batch size and gradient
// accumulation, activation recompute: the table of knobs in plan.c), each predicted by plan_evaluate; those that fit in
// memory ranked by step time.
#pragma once
#include <stddef.h>

#include "plan/cost.h"

// The knobs a layout sets; micro_per_rank x dp sequences per micro-batch, micro_batches of them;
// v model chunks a pipeline stage (interleaved 1F1B when > 1); recompute: train.recompute (Recompute).
typedef struct {
    int pp, v, dp, ep, micro_per_rank, micro_batches, recompute;
} PlanLayout;

typedef struct {
    PlanLayout lay;
    PlanResult res;
} PlanCandidate;

typedef struct {
    size_t tried, invalid, too_large; // layouts enumerated, refused by validation, past memory
} PlanStats;

// The config with layout l on `world` devices (the global batch kept).
void plan_apply(Config *c, const PlanLayout *l);
// The layout "pp=2,ep=8,micro=2,v=2,recompute=1" names on `world` devices (keys: pp, ep, micro:
// sequences per rank in a micro-batch, v, recompute: 0 none, 1 selective, 2 full); keys not given keep cfg's
// values (micro: train.micro_batch over the ranks).
int plan_layout_from(const Config *cfg, int world, const char *spec, PlanLayout *l, MoeErr err);
// Evaluates every layout of cfg on `world` devices of m; *out (freed by the caller) holds the
// valid ones: those that fit fastest first, then the others (not priced) smallest first.
void plan_search(const Config *cfg, int world, const PlanMachine *m, PlanCandidate **out, size_t *n,
                 PlanStats *stats);

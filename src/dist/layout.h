// The parallel layout of a run: world = pp x dp ranks; pipeline stages own consecutive layers (with
// v virtual stages, `parallel.virtual_stages`, the layers form pp v runs and stage s holds runs s,
// s + pp, ...: one model chunk each); inside a stage, dense parameters are replicated over its dp ranks, and each MoE layer's experts
// are split over ep ranks (ep divides dp) and replicated over the dp / ep ranks of an expert-data-
// parallel group. Ranks: rank = stage * dp + dp_rank, dp_rank = edp_rank * ep + ep_rank.
#pragma once
#include <stdbool.h>

#include "common/util.h"
#include "dist/pipeline.h"

typedef struct {
    int world, rank;
    int pp, dp, ep, edp;                        // edp = dp / ep
    int v;                                      // model chunks of a stage (virtual stages)
    int stage, dp_rank, ep_rank, edp_rank;
    int layer_begin[PIPE_MAX_CHUNKS], layer_end[PIPE_MAX_CHUNKS]; // layers of each chunk of this stage
    int expert_begin, expert_end;               // experts of this rank in every MoE layer
    int micro_per_rank;                         // sequences of a micro-batch on this rank
} Layout;

// What a layout is asked for (the parallel section) and what it must fit (model and batch).
typedef struct {
    int pp, ep;              // pipeline stages; expert-parallel ranks per MoE layer
    int v;                   // model chunks a stage holds (interleaved 1F1B when > 1)
    int n_layers, n_experts;
    bool has_moe;            // the model has MoE layers
    int micro_batch;         // sequences of a micro-batch, all data-parallel ranks together
    int micro_batches;       // micro-batches of a step (the pipeline schedule needs them)
} LayoutSpec;

// Checks the layout of `world` ranks against the spec and fills the position of `rank`. Errors
// name the keys and say what to change.
int layout_init(Layout *l, int world, int rank, const LayoutSpec *s, MoeErr err);
// Layers [begin, end) of virtual stage vs of n: a balanced split, earlier ones taking the remainder.
void layout_stage_layers(int n_layers, int n, int vs, int *begin, int *end);
// The stage holding the embedding (virtual stage 0), and the one holding the head (the last).
static inline bool layout_first_stage(const Layout *l) { return l->stage == 0; }
static inline bool layout_last_stage(const Layout *l) { return l->stage == l->pp - 1; }
// Whether chunk c of this stage is the first or the last virtual stage.
static inline bool layout_first_chunk(const Layout *l, int c) { return layout_first_stage(l) && c == 0; }
static inline bool layout_last_chunk(const Layout *l, int c) { return layout_last_stage(l) && c == l->v - 1; }
// The rank at (stage, dp_rank).
static inline int layout_rank_of(const Layout *l, int stage, int dp_rank) {
    return stage * l->dp + dp_rank;
}

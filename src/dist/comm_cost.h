// A communicator that moves nothing and reports each call's kind and bytes, for pricing the
// communication of a step by running the real code on it (`moe plan`, with ops_costing).
#pragma once
#include "comm.h"

typedef enum {
    COMM_COST_ALL_REDUCE,     // bytes: the buffer
    COMM_COST_REDUCE_SCATTER, // bytes: every rank's input (size x its block); a rooted reduce of a
                              // part counts as that part's share of a reduce-scatter
    COMM_COST_ALL_GATHER,     // bytes: the gathered output; a broadcast of a part counts as that
                              // part's share of an all-gather
    COMM_COST_ALL_TO_ALL,     // bytes: what this rank sends
    COMM_COST_P2P,            // bytes: what this rank sends or receives
    COMM_COST_SYNC,           // a fence or barrier: latency only
} CommCostKind;

typedef struct {
    void (*charge)(void *ctx, const Comm *c, CommCostKind kind, CommType t, double bytes);
    void *ctx;
} CommCost;

// Turns c (rank and size already set; e.g. by parallel_plan) into a costing communicator whose
// calls go to cost (which must outlive c); act elements take act_bytes.
void comm_costing(Comm *c, CommCost *cost, size_t act_bytes);

// A process's place in a parallel run: its layout and the communicators of the groups it belongs
// to. A single process gets the same struct with one-rank communicators, so the model and the
// training loop run one code path for every layout.
#pragma once
#include "comm.h"
#include "layout.h"

// How expert rows travel between expert-parallel ranks: written straight into the owner's memory
// (direct: one node, peer memory) or as NCCL/MPI transfers planned on the host (sendrecv); auto
// takes direct where the ranks can reach each other's memory.
typedef enum { EXCHANGE_AUTO, EXCHANGE_DIRECT, EXCHANGE_SENDRECV } ExchangeMode;

// Everything a process's place in a run is made from.
typedef struct {
    LayoutSpec layout;
    ExchangeMode exchange;
    double recv_capacity;  // direct exchange: receive rows per rank in units of its own routed rows
                           // (0: room for the worst case, every ep rank sending it everything)
    int exchange_chunks;   // direct exchange: chunks of an MoE call's experts whose rows travel
                           // while the previous chunk computes (1: the exchange, then the experts)
    int push_ctas;         // thread blocks of a row push beside compute (0: no bound)
} ParallelSpec;

typedef struct {
    Layout lay;
    ExchangeMode exchange; // from the spec
    double recv_capacity;  // from the spec
    int exchange_chunks;   // from the spec
    int push_ctas;         // from the spec
    Comm *world;
    Comm *dp;   // the ranks of this stage: replicas of its dense parameters, the data split
    Comm *ep;   // the ranks that split this rank's MoE layers' experts among them
    Comm *edp;  // the ranks that hold the same experts as this one
    Comm *owned_world; // a world made for this Parallel alone (freed by parallel_free), or NULL
} Parallel;

// Validates the layout (exits with the message on every rank when it is impossible) and builds
// the sub-communicators.
void parallel_init(Parallel *p, Comm *world, const ParallelSpec *s);
void parallel_free(Parallel *p);
// The layout of `rank` among `world` ranks without communicating: the communicators in `groups`
// (4 of them) carry only rank and size, for sizing memory (`moe inspect`). Returns -1 with a
// message when the layout is impossible.
int parallel_plan(Parallel *p, Comm groups[4], int world, int rank, const ParallelSpec *s, MoeErr err);

// The communicator of one process: every collective is a copy or nothing. It is the world of a
// build without MPI, and serves any build for work that a layout leaves on a single rank.
#include "dist/comm.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

static void comm_self_copy(Comm *c, void *dst, const void *src, size_t n, CommType t) {
    if (dst != src && n) memmove(dst, src, n * c->elem_bytes[t]);
}

// The sum over one rank is the buffer itself.
static void comm_self_all_reduce_sum(Comm *c, void *buf, size_t n, CommType t) {}
static void comm_self_all_reduce_max(Comm *c, void *buf, size_t n) {}

static void comm_self_reduce_scatter_sum(Comm *c, const void *send, void *recv, size_t n,
                                         CommType t) {
    comm_self_copy(c, recv, send, n, t);
}

static void comm_self_reduce_sum(Comm *c, const void *send, void *recv, size_t n, CommType t,
                                 int root) {
    comm_self_copy(c, recv, send, n, t);
}

static void comm_self_broadcast(Comm *c, void *buf, size_t n, CommType t, int root) {}

static void comm_self_all_gather(Comm *c, const void *send, void *recv, size_t n, CommType t) {
    comm_self_copy(c, recv, send, n, t);
}

static void comm_self_all_to_all_v(Comm *c, const void *send, const size_t *send_counts,
                                   void *recv, const size_t *recv_counts, CommType t) {
    MOE_ASSERT(send_counts[0] == recv_counts[0]);
    comm_self_copy(c, recv, send, send_counts[0], t);
}

// A transfer on one rank means a layout bug upstream, not bad input.
static void comm_self_no_peer(int peer) __attribute__((noreturn));
static void comm_self_no_peer(int peer) {
    moe_fatal("internal error: point-to-point transfer with rank %d on a one-rank communicator",
              peer);
}

static void comm_self_send(Comm *c, const void *buf, size_t n, CommType t, int peer) {
    comm_self_no_peer(peer);
}

static void comm_self_recv(Comm *c, void *buf, size_t n, CommType t, int peer) {
    comm_self_no_peer(peer);
}

static void comm_self_sendrecv(Comm *c, const void *send, size_t n_send, int to, void *recv,
                               size_t n_recv, int from, CommType t) {
    comm_self_no_peer(to);
}

static void comm_self_barrier(Comm *c) {}

static bool comm_self_all_ok(Comm *c, bool ok) { return ok; }

static Comm *comm_self_split(Comm *c, int color, int key) {
    return comm_self(c->elem_bytes[COMM_F32]);
}

static void comm_self_free(Comm *c) { free(c); }

static const CommOps comm_self_ops = {
    .all_reduce_sum = comm_self_all_reduce_sum,
    .all_reduce_max = comm_self_all_reduce_max,
    .reduce_scatter_sum = comm_self_reduce_scatter_sum,
    .reduce_sum = comm_self_reduce_sum,
    .broadcast = comm_self_broadcast,
    .all_gather = comm_self_all_gather,
    .all_to_all_v = comm_self_all_to_all_v,
    .send = comm_self_send,
    .recv = comm_self_recv,
    .sendrecv = comm_self_sendrecv,
    .barrier = comm_self_barrier,
    .all_ok = comm_self_all_ok,
    .split = comm_self_split,
    .free = comm_self_free,
};

Comm *comm_self(size_t elem_size) {
    Comm *c = moe_malloc(sizeof *c);
    *c = (Comm){.ops = &comm_self_ops, .rank = 0, .size = 1,
                .elem_bytes = {elem_size, elem_size, sizeof(int32_t), sizeof(uint64_t), 1}};
    return c;
}

#ifndef MOE_MPI
// Without MPI the world is this one process.
Comm *comm_world_init(int *argc, char ***argv, size_t elem_size) { return comm_self(elem_size); }

void comm_world_finalize(Comm *world) { comm_self_free(world); }

bool comm_has_mpi(void) { return false; }
#endif

// The costing communicator declared in comm_cost.h.
#include "dist/comm_cost.h"

static void charge(Comm *c, CommCostKind kind, CommType t, double elems) {
    CommCost *cost = c->impl;
    cost->charge(cost->ctx, c, kind, t, elems * (double)c->elem_bytes[t]);
}

static void cost_all_reduce(Comm *c, void *buf, size_t n, CommType t) { charge(c, COMM_COST_ALL_REDUCE, t, (double)n); }
static void cost_all_reduce_max(Comm *c, void *buf, size_t n) { cost_all_reduce(c, buf, n, COMM_F32); }
static void cost_reduce_scatter(Comm *c, const void *send, void *recv, size_t n, CommType t) {
    charge(c, COMM_COST_REDUCE_SCATTER, t, (double)n * c->size);
}
static void cost_reduce(Comm *c, const void *send, void *recv, size_t n, CommType t, int root) {
    charge(c, COMM_COST_REDUCE_SCATTER, t, (double)n);
}
static void cost_broadcast(Comm *c, void *buf, size_t n, CommType t, int root) {
    charge(c, COMM_COST_ALL_GATHER, t, (double)n);
}
static void cost_all_gather(Comm *c, const void *send, void *recv, size_t n, CommType t) {
    charge(c, COMM_COST_ALL_GATHER, t, (double)n * c->size);
}
static void cost_all_to_all_v(Comm *c, const void *send, const size_t *send_counts, void *recv,
                              const size_t *recv_counts, CommType t) {
    double n = 0;
    for (int r = 0; r < c->size; r++) n += r == c->rank ? 0 : (double)send_counts[r];
    charge(c, COMM_COST_ALL_TO_ALL, t, n);
}
static void cost_send(Comm *c, const void *buf, size_t n, CommType t, int peer) { charge(c, COMM_COST_P2P, t, (double)n); }
static void cost_recv(Comm *c, void *buf, size_t n, CommType t, int peer) { charge(c, COMM_COST_P2P, t, (double)n); }
static void cost_sendrecv(Comm *c, const void *send, size_t n_send, int to, void *recv, size_t n_recv, int from,
                          CommType t) {
    charge(c, COMM_COST_P2P, t, (double)(n_send > n_recv ? n_send : n_recv));
}
static void cost_sync(Comm *c) { charge(c, COMM_COST_SYNC, COMM_I32, 0); }
static bool cost_all_ok(Comm *c, bool ok) { return ok; }
static void cost_peer_free(Comm *c, PeerMem *pm) {}
static void cost_free(Comm *c) {}

static const CommOps COST_OPS = {
    .all_reduce_sum = cost_all_reduce, .all_reduce_max = cost_all_reduce_max, .reduce_scatter_sum = cost_reduce_scatter,
    .reduce_sum = cost_reduce,
    .broadcast = cost_broadcast, .all_gather = cost_all_gather, .all_to_all_v = cost_all_to_all_v,
    .send = cost_send, .recv = cost_recv,
    .sendrecv = cost_sendrecv, .barrier = cost_sync, .all_ok = cost_all_ok, .peer_free = cost_peer_free,
    .fence = cost_sync, .free = cost_free,
};

void comm_costing(Comm *c, CommCost *cost, size_t act_bytes) {
    c->ops = &COST_OPS;
    c->impl = cost;
    c->elem_bytes[COMM_ACT] = act_bytes, c->elem_bytes[COMM_F32] = 4, c->elem_bytes[COMM_I32] = 4;
    c->elem_bytes[COMM_U64] = 8, c->elem_bytes[COMM_U8] = 1;
}

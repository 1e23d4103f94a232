// Expert-parallel exchange bandwidth on GPUs (run under mpirun, one rank per GPU): the rows of a
// 32,768-token, d_model 2048, top-4 batch go to the ranks owning their experts and come back (the
// combine), by both paths: NCCL grouped send/recv (all-to-all-v with host counts) and direct
// writes into the owners' memory (plan from device offsets, pushes between stream-ordered
// fences). Timed with CUDA events; reports GB/s of rows leaving each GPU, each call counted, and
// what a fence costs on its own.
#include <stdio.h>
#include <stdlib.h>

#include "common/util.h"
#include "dist/comm_nccl.h"
#include "ops/exchange_plan.h"
#include "ops/ops.h"

enum { T = 32768, K = 4, D = 2048, EL = 8, WARMUP = 3, REPS = 20 };

typedef struct {
    const Ops *ops;
    Comm *w;
    size_t n, rows;     // ranks; rows this rank routes (T K)
    void *a, *b;        // (rows, D) send/recv path buffers
    PeerMem recv, back; // direct: the owners' receive buffers, the sources' return buffers
    void *recv_peers, *back_peers; // backend tables of their bases
    int32_t *plan;      // direct: this rank's plan
    size_t ctas;        // direct: thread blocks a push may take (0: no bound)
} Bench;

static void sendrecv_round(Bench *b) {
    size_t *counts = moe_calloc(b->n, sizeof(size_t));
    for (size_t j = 0; j < b->n; j++) counts[j] = b->rows / b->n * D; // balanced routing
    b->w->ops->all_to_all_v(b->w, b->a, counts, b->b, counts, COMM_ACT); // dispatch
    b->w->ops->all_to_all_v(b->w, b->b, counts, b->a, counts, COMM_ACT); // combine
    free(counts);
}

static void direct_round(Bench *b) {
    size_t E = b->n * EL;
    const int32_t *dispatch = b->plan + EL + 1, *ret = dispatch + 4 * E;
    b->w->ops->fence(b->w);
    b->ops->moe_push_rows(b->recv_peers, 0, b->a, (PushBlocks){dispatch, E, 1, 0}, D, b->rows, b->ctas);
    b->w->ops->fence(b->w);
    b->ops->moe_push_rows(b->back_peers, 0, b->recv.base, (PushBlocks){ret, E, 1, 0}, D, b->rows, b->ctas);
    b->w->ops->fence(b->w);
}

static void fence_round(Bench *b) {
    for (int i = 0; i < 3; i++) b->w->ops->fence(b->w);
}

static double time_ms(Bench *b, void (*round)(Bench *)) {
    void *e0 = b->ops->event_create(), *e1 = b->ops->event_create();
    for (int i = 0; i < WARMUP; i++) round(b);
    b->ops->sync();
    b->ops->event_record(e0);
    for (int i = 0; i < REPS; i++) round(b);
    b->ops->event_record(e1);
    double ms = b->ops->event_elapsed_ms(e0, e1) / REPS;
    return ms;
}

static void *peer_table(const Ops *ops, const PeerMem *pm, size_t n) {
    void *t = ops->alloc(n * sizeof(void *));
    ops->upload(t, pm->peers, n * sizeof(void *));
    return t;
}

// Balanced routing over E = n EL experts: every rank routes rows / E rows to each; the plan made
// on the device from the gathered offsets, as the model does.
static void direct_setup(Bench *b) {
    size_t E = b->n * EL, bytes = b->rows * D * 2;
    MOE_CHECK(b->w->ops->peer_alloc(b->w, bytes, &b->recv) == 0 && b->w->ops->peer_alloc(b->w, bytes, &b->back) == 0,
              "bench_exchange: the GPUs cannot map each other's memory (CUDA IPC)");
    b->recv_peers = peer_table(b->ops, &b->recv, b->n), b->back_peers = peer_table(b->ops, &b->back, b->n);
    int32_t *off = moe_malloc((E + 1) * sizeof(int32_t));
    for (size_t g = 0; g <= E; g++) off[g] = (int32_t)(g * (b->rows / E));
    int32_t *mine = b->ops->alloc((E + 1) * 4), *all = b->ops->alloc(b->n * (E + 1) * 4);
    b->plan = b->ops->alloc(exchange_plan_len(b->n, EL) * 4);
    b->ops->upload(mine, off, (E + 1) * 4);
    b->w->ops->all_gather(b->w, mine, all, E + 1, COMM_I32);
    float *dropped = b->ops->alloc(sizeof(float));
    b->ops->zero(dropped, sizeof(float));
    b->ops->moe_exchange_plan(b->plan, all, b->n, EL, (size_t)b->w->rank, b->rows, dropped); // room for all
    free(off);
    b->ops->free(dropped);
}

int main(int argc, char **argv) {
    Comm *host = comm_world_init(&argc, &argv, sizeof(float));
    Bench b = {.ops = ops_cuda(comm_local_rank(host->rank), false)};
    size_t ctas = argc > 1 ? (size_t)atoi(argv[1]) : 24;
    b.w = comm_nccl_world(host, b.ops->stream);
    b.n = (size_t)b.w->size, b.rows = (size_t)T * K;
    b.a = b.ops->alloc(b.rows * D * 2), b.b = b.ops->alloc(b.rows * D * 2);
    b.ops->zero(b.a, b.rows * D * 2), b.ops->zero(b.b, b.rows * D * 2);
    direct_setup(&b);
    double ms_sr = time_ms(&b, sendrecv_round), ms_direct = time_ms(&b, direct_round);
    b.ctas = ctas;
    double ms_bounded = time_ms(&b, direct_round), ms_fences = time_ms(&b, fence_round);
    double crossing = 2.0 * (double)(b.rows - b.rows / b.n) * D * 2; // bytes leaving this GPU per round
    if (b.w->rank == 0) {
        printf("exchange: %zu ranks, %zu rows of %d bf16 per rank, dispatch + combine (each call counted)\n",
               b.n, b.rows, D);
        printf("  send/recv (NCCL)   %.3f ms  %.1f GB/s crossing per GPU\n", ms_sr, crossing / (ms_sr * 1e-3) / 1e9);
        printf("  direct writes      %.3f ms  %.1f GB/s crossing per GPU (3 fences included)\n", ms_direct,
               crossing / (ms_direct * 1e-3) / 1e9);
        printf("  direct, %3zu CTAs   %.3f ms  %.1f GB/s crossing per GPU (3 fences included)\n", ctas, ms_bounded,
               crossing / (ms_bounded * 1e-3) / 1e9);
        printf("  of which fences    %.1f us each (3 per round, timed alone)\n", ms_fences * 1e3 / 3);
    }
    b.w->ops->peer_free(b.w, &b.recv), b.w->ops->peer_free(b.w, &b.back);
    b.w->ops->free(b.w);
    comm_world_finalize(host);
    return 0;
}

// Expert-parallel exchange bandwidth on GPUs (run under mpirun, one rank per GPU): the rows of a
// 32,768-token, d_model 2048, top-4 batch go to the ranks owning their experts (the all-to-all-v
// of the send/recv path) and come back (the combine), timed with CUDA events. Reports GB/s of data
// crossing between GPUs, counting each direction.
#include <stdio.h>
#include <stdlib.h>

#include "common/util.h"
#include "dist/comm_nccl.h"
#include "ops/ops.h"

int main(int argc, char **argv) {
    Comm *host = comm_world_init(&argc, &argv, sizeof(float));
    const Ops *ops = ops_cuda(comm_local_rank(host->rank));
    Comm *w = comm_nccl_world(host);
    size_t T = 32768, K = 4, D = 2048, n = (size_t)w->size, rows = T * K, reps = 20;
    // Balanced routing: each rank sends rows / n to every rank (itself included).
    size_t *counts = moe_calloc(n, sizeof(size_t));
    for (size_t j = 0; j < n; j++) counts[j] = rows / n * D;
    void *a = ops->alloc(rows * D * 2), *b = ops->alloc(rows * D * 2);
    ops->zero(a, rows * D * 2), ops->zero(b, rows * D * 2);
    void *e0 = ops->event_create(), *e1 = ops->event_create();
    for (size_t i = 0; i < 3; i++) w->ops->all_to_all_v(w, a, counts, b, counts, COMM_ACT);
    ops->sync();
    ops->event_record(e0);
    for (size_t i = 0; i < reps; i++) {
        w->ops->all_to_all_v(w, a, counts, b, counts, COMM_ACT); // dispatch
        w->ops->all_to_all_v(w, b, counts, a, counts, COMM_ACT); // combine
    }
    ops->event_record(e1);
    double ms = ops->event_elapsed_ms(e0, e1) / reps;
    double crossing = 2.0 * (double)(rows - rows / n) * D * 2; // bytes leaving this GPU, both calls
    if (w->rank == 0)
        printf("exchange: %zu ranks, %zu rows of %zu bf16 per rank, dispatch + combine %.3f ms, %.1f GB/s "
               "crossing per GPU (each direction counted once per call)\n",
               n, rows, D, ms, crossing / (ms * 1e-3) / 1e9);
    w->ops->free(w);
    comm_world_finalize(host);
    return 0;
}

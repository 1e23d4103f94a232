// Benchmark of cpu_gemm on the shapes that dominate training (forward x*W^T, input grad dout*W,
// weight grad dout^T*x, small expert groups): prints GFLOP/s per shape and thread count.
// Usage: bench_gemm [max_threads]   (default: every processor, counting 1, 2, 4, ... up to it)
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

#include "common/util.h"
#include "ops/cpu/cpu_gemm.h"

typedef struct {
    const char *what;
    bool trans_a, trans_b;
    size_t M, N, K;
} Shape;

static const Shape shapes[] = {
    {"fwd x*W^T", false, true, 2048, 128, 128},
    {"fwd x*W^T", false, true, 2048, 256, 128},
    {"fwd x*W^T", false, true, 2048, 512, 128},
    {"fwd x*W^T", false, true, 2048, 1024, 128},
    {"fwd x*W^T", false, true, 2048, 257, 128},
    {"dx dout*W", false, false, 2048, 128, 256},
    {"dx dout*W", false, false, 2048, 128, 512},
    {"dx dout*W", false, false, 2048, 128, 1024},
    {"dW dout^T*x", true, false, 128, 128, 2048},
    {"dW dout^T*x", true, false, 512, 128, 2048},
    {"dW dout^T*x", true, false, 1024, 128, 2048},
    {"expert fwd", false, true, 37, 256, 128},
    {"expert fwd", false, true, 600, 512, 128},
    {"expert dW", true, false, 512, 128, 37},
    {"expert dW", true, false, 512, 128, 600},
    {"square", false, false, 1024, 1024, 1024},
};

static real *random_matrix(size_t n, uint64_t key) {
    real *m = moe_malloc(n * sizeof(real));
    for (size_t i = 0; i < n; i++) m[i] = (real)(2 * rng_uniform(key, i) - 1);
    return m;
}

// Times single calls for at least 0.3 s (after one warm-up call) and returns the GFLOP/s of the
// fastest: the minimum is the least disturbed by other processes on a shared machine.
static double time_shape(const Shape *s, const real *A, const real *B, real *C) {
    size_t lda = s->trans_a ? s->M : s->K, ldb = s->trans_b ? s->K : s->N;
    cpu_gemm(s->trans_a, s->trans_b, s->M, s->N, s->K, 1, A, lda, B, ldb, 0, C, s->N);
    double best = 1e30, total = 0;
    for (size_t reps = 0; total < 0.3 || reps < 3; reps++) {
        double start = moe_time_sec();
        cpu_gemm(s->trans_a, s->trans_b, s->M, s->N, s->K, 1, A, lda, B, ldb, 0, C, s->N);
        double t = moe_time_sec() - start;
        total += t;
        if (t < best) best = t;
    }
    return 2.0 * (double)s->M * (double)s->N * (double)s->K / best * 1e-9;
}

int main(int argc, char **argv) {
    int max_threads = argc > 1 ? atoi(argv[1]) : omp_get_num_procs();
    if (max_threads < 1) max_threads = 1;
    printf("cpu_gemm %s, GFLOP/s\n%-12s %2s %2s %5s %5s %5s", REAL_NAME, "shape", "tA", "tB", "M", "N",
           "K");
    for (int t = 1; t <= max_threads; t *= 2) printf("  %3d thr", t);
    printf("\n");
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        const Shape *s = &shapes[i];
        real *A = random_matrix(s->M * s->K, 1), *B = random_matrix(s->K * s->N, 2);
        real *C = moe_malloc(s->M * s->N * sizeof(real));
        printf("%-12s %2d %2d %5zu %5zu %5zu", s->what, s->trans_a, s->trans_b, s->M, s->N, s->K);
        for (int t = 1; t <= max_threads; t *= 2) {
            omp_set_num_threads(t);
            printf("  %7.1f", time_shape(s, A, B, C));
            fflush(stdout);
        }
        printf("\n");
        free(A), free(B), free(C);
    }
    return 0;
}

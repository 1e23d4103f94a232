// Tests: cpu_gemm against a long-double triple loop over many shapes, all four transposes, padded
// leading dimensions, alpha and beta (with NaN in C when beta == 0), and bit-identical results
// for 1, 2 and 3 threads.
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "ops/cpu/cpu_gemm.h"
#include "test.h"

// Fills the gaps between rows of C (ldc > N): cpu_gemm must leave them alone.
#define SENTINEL ((real)12345)
#define RTOL (sizeof(real) == 8 ? 1e-12 : 1e-4)
#define ATOL (sizeof(real) == 8 ? 1e-12 : 1e-4)

typedef struct {
    bool trans_a, trans_b;
    size_t M, N, K;
    size_t pad; // extra elements on every leading dimension
    double alpha, beta;
} GemmCase;

// A stored operand with the shape and stride a case implies.
typedef struct {
    real *p;
    size_t ld;
} Mat;

static Mat random_mat(size_t rows, size_t cols, size_t pad, uint64_t key) {
    Mat m = {moe_malloc(rows * (cols + pad) * sizeof(real)), cols + pad};
    for (size_t i = 0; i < rows * m.ld; i++) m.p[i] = (real)(2 * rng_uniform(key, i) - 1);
    return m;
}

// Element (r, c) of op(X).
static long double op_elem(Mat x, bool trans, size_t r, size_t c) {
    return trans ? x.p[c * x.ld + r] : x.p[r * x.ld + c];
}

// C before the call: random where beta reads it, NaN where beta == 0 must ignore it; sentinels
// in the padding.
static Mat initial_c(const GemmCase *t, uint64_t key) {
    Mat c = random_mat(t->M, t->N, t->pad, key);
    for (size_t i = 0; i < t->M; i++)
        for (size_t j = 0; j < c.ld; j++)
            if (j >= t->N) c.p[i * c.ld + j] = SENTINEL;
            else if (t->beta == 0) c.p[i * c.ld + j] = (real)NAN;
    return c;
}

static void reference(const GemmCase *t, Mat a, Mat b, Mat c0, double *out) {
    for (size_t i = 0; i < t->M; i++) {
        for (size_t j = 0; j < t->N; j++) {
            long double sum = 0;
            for (size_t k = 0; k < t->K; k++)
                sum += op_elem(a, t->trans_a, i, k) * op_elem(b, t->trans_b, k, j);
            long double prior = t->beta == 0 ? 0 : t->beta * (long double)c0.p[i * c0.ld + j];
            out[i * t->N + j] = (double)(t->alpha * sum + prior);
        }
    }
}

static void check_case(const GemmCase *t, uint64_t seed) {
    Mat a = t->trans_a ? random_mat(t->K, t->M, t->pad, seed) : random_mat(t->M, t->K, t->pad, seed);
    Mat b = t->trans_b ? random_mat(t->N, t->K, t->pad, seed + 1)
                       : random_mat(t->K, t->N, t->pad, seed + 1);
    Mat c = initial_c(t, seed + 2);
    Mat c0 = {moe_malloc(t->M * c.ld * sizeof(real)), c.ld};
    memcpy(c0.p, c.p, t->M * c.ld * sizeof(real));
    cpu_gemm(t->trans_a, t->trans_b, t->M, t->N, t->K, (real)t->alpha, a.p, a.ld, b.p, b.ld,
             (real)t->beta, c.p, c.ld);

    double *got = moe_malloc(t->M * t->N * sizeof(double));
    double *expected = moe_malloc(t->M * t->N * sizeof(double));
    reference(t, a, b, c0, expected);
    size_t pad_changed = 0;
    for (size_t i = 0; i < t->M; i++)
        for (size_t j = 0; j < c.ld; j++)
            if (j < t->N) got[i * t->N + j] = c.p[i * c.ld + j];
            else pad_changed += c.p[i * c.ld + j] != SENTINEL;
    char what[160];
    snprintf(what, sizeof what, "tA=%d tB=%d M=%zu N=%zu K=%zu pad=%zu alpha=%g beta=%g",
             t->trans_a, t->trans_b, t->M, t->N, t->K, t->pad, t->alpha, t->beta);
    test_check_arrays(what, got, expected, t->M * t->N, RTOL, ATOL);
    CHECK_MSG(pad_changed == 0, "%s: %zu padding elements of C were written", what, pad_changed);
    free(a.p), free(b.p), free(c.p), free(c0.p), free(got), free(expected);
}

// Every shape under every transpose and (alpha, beta) pair, with tight and padded strides.
static void check_shapes(const size_t (*shapes)[3], size_t n_shapes) {
    static const double scalars[][2] = {{1, 0}, {-0.75, 1}, {1.5, 0.5}};
    uint64_t seed = 100;
    for (size_t s = 0; s < n_shapes; s++)
        for (int trans = 0; trans < 4; trans++)
            for (size_t ab = 0; ab < sizeof scalars / sizeof scalars[0]; ab++)
                for (size_t pad = 0; pad <= 5; pad += 5, seed += 3) {
                    GemmCase t = {trans & 1, trans >> 1, shapes[s][0], shapes[s][1], shapes[s][2],
                                  pad, scalars[ab][0], scalars[ab][1]};
                    check_case(&t, seed);
                }
}

static void test_gemm_degenerate_sizes(void) {
    static const size_t shapes[][3] = {{0, 0, 0}, {0, 5, 3}, {5, 0, 3}, {5, 3, 0}, {1, 1, 1},
                                       {1, 1, 7}, {1, 9, 1}, {9, 1, 1}, {2, 3, 4}, {1, 300, 1},
                                       {300, 1, 5}, {1, 1, 700}, {0, 40, 40}, {40, 40, 0}};
    check_shapes(shapes, sizeof shapes / sizeof shapes[0]);
}

// Odd primes and sizes around the register tile, cache blocks and the small-product cut-off.
static void test_gemm_odd_shapes(void) {
    static const size_t shapes[][3] = {{37, 53, 29}, {13, 17, 600}, {31, 32, 33}, {64, 64, 64},
                                       {97, 130, 257}, {11, 257, 23}, {300, 7, 19}, {25, 33, 512},
                                       {50, 49, 48}, {7, 601, 13}};
    check_shapes(shapes, sizeof shapes / sizeof shapes[0]);
}

// Large enough for many tiles, several K blocks and several threads.
static void test_gemm_large_shapes(void) {
    static const size_t shapes[][3] = {{151, 131, 520}, {600, 37, 129}};
    check_shapes(shapes, sizeof shapes / sizeof shapes[0]);
}

// Random shapes, transposes, paddings and scalars from a fixed seed: reaches size combinations
// (tile and panel remainders) that the hand-picked lists miss.
static void test_gemm_random_shapes(void) {
    static const double betas[] = {0, 1, 0.5, -2};
    Rng rng = {2024};
    for (int i = 0; i < 200; i++) {
        uint64_t r = rng_next(&rng);
        GemmCase t = {r & 1, (r >> 1) & 1, 1 + (r >> 8) % 90, 1 + (r >> 16) % 90,
                      1 + (r >> 24) % 300, (r >> 40) % 4, 2 * rng_next_uniform(&rng) - 1,
                      betas[(r >> 2) % 4]};
        check_case(&t, r);
    }
}

// K == 0 and alpha == 0 scale C by beta without reading A or B (NaN there must not leak in).
static void test_gemm_no_products(void) {
    real a[6] = {NAN, NAN, NAN, NAN, NAN, NAN}, b[6] = {NAN, NAN, NAN, NAN, NAN, NAN};
    real c[6] = {1, 2, 3, 4, 5, 6};
    cpu_gemm(false, false, 2, 3, 0, 1, a, 1, b, 3, (real)0.5, c, 3);
    for (int i = 0; i < 6; i++) CHECK_CLOSE(c[i], 0.5 * (i + 1), 0, 0);
    cpu_gemm(true, true, 2, 3, 2, 0, a, 2, b, 2, 2, c, 3);
    for (int i = 0; i < 6; i++) CHECK_CLOSE(c[i], i + 1, 0, 0);
    for (int i = 0; i < 6; i++) c[i] = NAN;
    cpu_gemm(false, false, 2, 3, 0, 1, a, 1, b, 3, 0, c, 3);
    for (int i = 0; i < 6; i++) CHECK_CLOSE(c[i], 0, 0, 0);
}

// Same inputs give bit-identical C for 1, 2 and 3 threads, on shapes big enough to be split.
static void test_gemm_thread_count_bit_identical(void) {
    static const size_t shapes[][3] = {{203, 301, 517}, {1000, 130, 70}, {64, 700, 300}};
    int saved = omp_get_max_threads();
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        for (int trans = 0; trans < 4; trans++) {
            GemmCase t = {trans & 1, trans >> 1, shapes[s][0], shapes[s][1], shapes[s][2], 3, 0.7, 0.5};
            Mat a = t.trans_a ? random_mat(t.K, t.M, t.pad, 7) : random_mat(t.M, t.K, t.pad, 7);
            Mat b = t.trans_b ? random_mat(t.N, t.K, t.pad, 8) : random_mat(t.K, t.N, t.pad, 8);
            size_t bytes = t.M * (t.N + t.pad) * sizeof(real);
            real *first = NULL;
            for (int threads = 1; threads <= 3; threads++) {
                Mat c = initial_c(&t, 9);
                omp_set_num_threads(threads);
                cpu_gemm(t.trans_a, t.trans_b, t.M, t.N, t.K, (real)t.alpha, a.p, a.ld, b.p, b.ld,
                         (real)t.beta, c.p, c.ld);
                if (!first) {
                    first = c.p;
                    continue;
                }
                CHECK_MSG(memcmp(first, c.p, bytes) == 0,
                          "tA=%d tB=%d M=%zu N=%zu K=%zu: %d threads differ from 1 thread",
                          t.trans_a, t.trans_b, t.M, t.N, t.K, threads);
                free(c.p);
            }
            free(first), free(a.p), free(b.p);
        }
    }
    omp_set_num_threads(saved);
}

const TestCase gemm_tests[] = {
    {"gemm_degenerate_sizes", test_gemm_degenerate_sizes},
    {"gemm_odd_shapes", test_gemm_odd_shapes},
    {"gemm_large_shapes", test_gemm_large_shapes},
    {"gemm_random_shapes", test_gemm_random_shapes},
    {"gemm_no_products", test_gemm_no_products},
    {"gemm_thread_count_bit_identical", test_gemm_thread_count_bit_identical},
    {0},
};

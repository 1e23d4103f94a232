// The FP8 recipe (ops/fp8.h) and its CPU emulation: E4M3 rounding checked exhaustively against the
// format's definition in double precision (every code, every midpoint, random values against a
// brute-force nearest code), saturation, subnormals and block scales; then the quantisation ops
// (layouts, zero blocks, outliers, values past 448) and the FP8 products against double-precision
// sums of the dequantised operands.
#include <stdlib.h>
#include <string.h>

#include "common/real.h"
#include "common/rng.h"
#include "ops/ops.h"
#include "test.h"

// ---------------------------------------------------------------- E4M3 in double precision

// The value of a code from the format's definition (sign, 4 exponent bits of bias 7, 3 mantissa
// bits; exponent 0 is subnormal; S.1111.111 is NaN).
static double e4m3_value(int c) {
    int e = (c >> 3) & 15, m = c & 7;
    double a = e == 15 && m == 7 ? NAN : e == 0 ? m * pow(2, -9) : (1 + m / 8.0) * pow(2, e - 7);
    return c & 0x80 ? -a : a;
}

// The code nearest to x by scanning every finite code (ties to the even code), saturating.
static int e4m3_nearest(double x) {
    int best = 0;
    double best_d = INFINITY;
    for (int c = 0; c < 0x7f; c++) {
        double d = fabs(fabs(x) - e4m3_value(c));
        if (d < best_d || (d == best_d && c % 2 == 0)) best = c, best_d = d;
    }
    return (x < 0 || (x == 0 && signbit(x)) ? 0x80 : 0) | best;
}

static void test_e4m3_every_code(void) {
    for (int c = 0; c < 256; c++) {
        double v = e4m3_value(c);
        float got = fp8_e4m3_decode((uint8_t)c);
        if (isnan(v)) {
            CHECK_MSG(isnan(got) && fp8_e4m3_encode(got) == FP8_E4M3_NAN, "code 0x%02x: NaN", c);
            continue;
        }
        CHECK_MSG(got == v && !signbit(got) == !signbit(v), "code 0x%02x decodes to %g, not %g", c, got, v);
        CHECK_MSG(fp8_e4m3_encode((float)v) == c, "%g encodes to 0x%02x, not 0x%02x", v,
                  fp8_e4m3_encode((float)v), c);
    }
    CHECK(fp8_e4m3_decode(0x7e) == FP8_E4M3_MAX && fp8_e4m3_decode(0x38) == 1 && fp8_e4m3_decode(0x01) == 0x1p-9);
}

// Midpoints between neighbouring codes round to the even one; a step either side rounds to the
// nearer one; random magnitudes over the whole range agree with the brute-force nearest code.
static void test_e4m3_ties_and_nearest(void) {
    for (int c = 0; c < 0x7e; c++)
        for (int sign = 0; sign < 2; sign++) {
            double lo = e4m3_value(c), hi = e4m3_value(c + 1), mid = (lo + hi) / 2, s = sign ? -1 : 1;
            int even = c % 2 == 0 ? c : c + 1, bit = sign ? 0x80 : 0;
            CHECK_MSG(fp8_e4m3_encode((float)(s * mid)) == (bit | even), "tie %g", s * mid);
            CHECK_MSG(fp8_e4m3_encode(nextafterf((float)(s * mid), 0)) == (bit | c), "below tie %g", s * mid);
            CHECK_MSG(fp8_e4m3_encode(nextafterf((float)(s * mid), (float)(s * INFINITY))) == (bit | (c + 1)),
                      "above tie %g", s * mid);
        }
    for (uint64_t i = 0; i < 20000; i++) {
        float x = (float)(ldexp(rng_uniform(7, 2 * i), (int)(rng_uniform(8, 2 * i) * 30) - 14));
        x = rng_uniform(9, i) < 0.5 ? -x : x;
        CHECK_MSG(fp8_e4m3_encode(x) == e4m3_nearest(x), "%.9g: 0x%02x, nearest 0x%02x", x, fp8_e4m3_encode(x),
                  e4m3_nearest(x));
    }
}

static void test_e4m3_saturation_and_nan(void) {
    float big[] = {448, 449, 464, 480, 1e4f, 3e38f, INFINITY};
    for (size_t i = 0; i < sizeof big / sizeof big[0]; i++) {
        CHECK_MSG(fp8_e4m3_encode(big[i]) == 0x7e, "%g saturates to 448", big[i]);
        CHECK_MSG(fp8_e4m3_encode(-big[i]) == 0xfe, "%g saturates to -448", -big[i]);
    }
    CHECK(fp8_e4m3_encode(NAN) == FP8_E4M3_NAN && isnan(fp8_e4m3_decode(0xff)));
    CHECK(fp8_e4m3_encode(447) == 0x7e && fp8_e4m3_encode(431) == 0x7d); // 432: tie of 416 (0x7d) and 448
}

// Subnormals are the multiples of 2^-9 below 2^-6, rounded to even; past 7.5 x 2^-9 they round up
// to the smallest normal.
static void test_e4m3_subnormals(void) {
    CHECK(fp8_e4m3_encode(0x1p-9f) == 0x01 && fp8_e4m3_encode(-0x1p-9f) == 0x81);
    CHECK(fp8_e4m3_encode(0x1p-10f) == 0x00);         // tie between 0 and 2^-9: even
    CHECK(fp8_e4m3_encode(0x1.0001p-10f) == 0x01);
    CHECK(fp8_e4m3_encode(3 * 0x1p-10f) == 0x02);     // tie between 1 and 2: even
    CHECK(fp8_e4m3_encode(7.5f * 0x1p-9f) == 0x08);   // tie between 7 and 2^-6: even (0x08)
    CHECK(fp8_e4m3_encode(1e-30f) == 0x00 && fp8_e4m3_encode(-1e-30f) == 0x80);
    CHECK(fp8_e4m3_decode(0x07) == 7 * 0x1p-9f && fp8_e4m3_decode(0x08) == 0x1p-6f);
}

static void test_block_scales(void) {
    CHECK(fp8_block_scale(0, FP8_SCALE_AMAX) == 1 && fp8_block_scale(0, FP8_SCALE_POW2) == 1);
    CHECK(fp8_block_scale(1e-44f, FP8_SCALE_AMAX) == 1); // amax / 448 underflows to 0
    CHECK(fp8_block_scale(448, FP8_SCALE_AMAX) == 1 && fp8_block_scale(896, FP8_SCALE_AMAX) == 2);
    CHECK(fp8_block_scale(500, FP8_SCALE_POW2) == 2 && fp8_block_scale(1792, FP8_SCALE_POW2) == 4);
    CHECK(fp8_block_scale(1, FP8_SCALE_POW2) == 0x1p-8f && fp8_block_scale(448, FP8_SCALE_POW2) == 1);
    // Scales stay normal, so that their inverses are finite; an infinite scale's inverse is 0.
    CHECK(fp8_block_scale(1e-40f, FP8_SCALE_AMAX) == 0x1p-126f && fp8_block_scale(1e-40f, FP8_SCALE_POW2) == 0x1p-126f);
    CHECK(fp8_scale_inverse(0x1p-126f) == 0x1p126f && fp8_scale_inverse(INFINITY) == 0);
    CHECK(fp8_quantize(1e-40f, fp8_scale_inverse(0x1p-126f)) == fp8_e4m3_encode(1e-40f * 0x1p126f));
    // The largest magnitude of a block lands on +-448 (or just below with power-of-two scales).
    float amaxes[] = {1e-3f, 0.37f, 1, 3.3e3f, 1e30f};
    for (size_t i = 0; i < sizeof amaxes / sizeof amaxes[0]; i++) {
        float a = amaxes[i];
        CHECK_MSG(fp8_quantize(-a, fp8_scale_inverse(fp8_block_scale(a, FP8_SCALE_AMAX))) == 0xfe, "amax %g", a);
        float s = fp8_block_scale(a, FP8_SCALE_POW2);
        double back = fp8_e4m3_decode(fp8_quantize(a, fp8_scale_inverse(s))) * (double)s;
        CHECK_MSG(fabs(back - a) <= a / 16 && a / s <= 448 && a / s > 224, "pow2 amax %g: scale %g", a, s);
    }
}


// ---------------------------------------------------------------- the CPU emulation ops

#define ops (ops_cpu())

// Normal values of scale 1 with outliers: every 37th value x1000, every 101st past E4M3's range.
static real *rnd_outliers(size_t n, uint64_t seed) {
    real *x = malloc(n * sizeof(real));
    for (size_t i = 0; i < n; i++)
        x[i] = rng_normal(seed, i) * (i % 101 == 5 ? 3e3 : i % 37 == 3 ? 1e3 : 1);
    return x;
}

// A quantised value's distance from its source is at most half a step of E4M3 at its magnitude:
// 2^-4 of it for normal codes, 2^-10 x scale for subnormal ones.
static bool within_half_step(double x, double back, double scale) {
    return fabs(back - x) <= fmax(fabs(x) / 16, scale * 0x1p-10);
}

static const Fp8Scaling SCALINGS[2] = {FP8_SCALE_AMAX, FP8_SCALE_POW2};

// Experts of the grouped tests: 3 rows, none, 167 (a block and a short one), 130.
static const int32_t OFFSETS[5] = {0, 3, 3, 170, 300};
#define N_EXPERTS 4
#define N_ROWS 300


// Rows in the experts' groups: each expert's scales one packed (Kb, rows) matrix.
static void test_fp8_quantize_rows(void) {
    size_t R = N_ROWS, K = 300, Kb = fp8_blocks(K);
    real *x = rnd_outliers(R * K, 1), *scales = malloc(Kb * R * sizeof(real));
    for (size_t k = 128; k < 256; k++) x[200 * K + k] = 0; // row 200's second block is all zeros
    uint8_t *q = malloc(R * K);
    for (int h = 0; h < 2; h++) {
        ops->fp8_quantize_rows(q, scales, x, OFFSETS, N_EXPERTS, R, K, SCALINGS[h], NULL);
        for (size_t e = 0; e < N_EXPERTS; e++) {
            size_t r0 = (size_t)OFFSETS[e], rows = (size_t)OFFSETS[e + 1] - r0;
            for (size_t r = r0; r < r0 + rows; r++)
                for (size_t kb = 0; kb < Kb; kb++) {
                    float amax = 0;
                    for (size_t k = kb * 128; k < K && k < kb * 128 + 128; k++) amax = fmaxf(amax, fabsf((float)x[r * K + k]));
                    double s = scales[Kb * r0 + kb * rows + r - r0];
                    CHECK_MSG(s == fp8_block_scale(amax, SCALINGS[h]), "row %zu block %zu: scale %g", r, kb, s);
                    for (size_t k = kb * 128; k < K && k < kb * 128 + 128; k++)
                        CHECK_MSG(within_half_step(x[r * K + k], fp8_e4m3_decode(q[r * K + k]) * s, s), "[%zu, %zu]", r, k);
                }
        }
        CHECK(scales[Kb * 170 + 1 * 130 + 30] == 1 && q[200 * K + 130] == 0);
    }
    free(x), free(scales), free(q);
}

// The rows of the token-major copies back in row layout: (R, C) dequantised.
static double *deq_cols(const uint8_t *qt, const real *scales, size_t C, Fp8ColBlocks blocks) {
    size_t Rt = fp8_expert_cols(N_ROWS, N_EXPERTS), Cs = fp8_col_scales(C, blocks), width = fp8_col_block(blocks);
    double *x = malloc(N_ROWS * C * sizeof(double));
    for (size_t e = 0; e < N_EXPERTS; e++) {
        size_t p = fp8_expert_col((size_t)OFFSETS[e], e);
        for (size_t i = 0; i < (size_t)(OFFSETS[e + 1] - OFFSETS[e]); i++)
            for (size_t c = 0; c < C; c++)
                x[(OFFSETS[e] + i) * C + c] =
                    fp8_e4m3_decode(qt[c * Rt + p + i]) * scales[((p + i) / 128) * Cs + c / width];
    }
    return x;
}

// Rows quantised in groups of offsets (NULL: one group of R rows), dequantised: (R, K).
static double *deq_rows(const uint8_t *q, const real *scales, const int32_t *offsets, size_t E, size_t R, size_t K) {
    size_t Kb = fp8_blocks(K);
    double *x = malloc(R * K * sizeof(double));
    for (size_t g = 0; g < (offsets ? E : 1); g++) {
        size_t r0 = offsets ? (size_t)offsets[g] : 0, rows = offsets ? (size_t)offsets[g + 1] - r0 : R;
        for (size_t i = 0; i < rows; i++)
            for (size_t k = 0; k < K; k++)
                x[(r0 + i) * K + k] = fp8_e4m3_decode(q[(r0 + i) * K + k]) * scales[Kb * r0 + k / 128 * rows + i];
    }
    return x;
}

static double *deq_weights(const uint8_t *q, const real *scales, size_t E, size_t N, size_t K) {
    size_t Nb = fp8_blocks(N), Kb = fp8_blocks(K);
    double *w = malloc(E * N * K * sizeof(double));
    for (size_t e = 0; e < E; e++)
        for (size_t n = 0; n < N; n++)
            for (size_t k = 0; k < K; k++)
                w[(e * N + n) * K + k] = fp8_e4m3_decode(q[(e * N + n) * K + k]) * scales[(e * Kb + k / 128) * Nb + n / 128];
    return w;
}

// Token-major copies in `blocks`, 200 columns wide (two column blocks, the second short): each
// scale is its block's (rows of one expert, 1 or 128 columns), each value within half a step;
// columns 128-199 of the last expert's rows are zeros (scale 1, codes 0).
static void check_quantize_cols(Fp8ColBlocks blocks) {
    size_t C = 200, Rt = fp8_expert_cols(N_ROWS, N_EXPERTS), Cs = fp8_col_scales(C, blocks);
    size_t width = fp8_col_block(blocks);
    real *x = rnd_outliers(N_ROWS * C, 2), *scales = malloc(Rt / 128 * Cs * sizeof(real));
    for (size_t r = 170; r < 300; r++)
        for (size_t c = 128; c < C; c++) x[r * C + c] = 0;
    uint8_t *qt = malloc(C * Rt);
    memset(qt, 0x55, C * Rt);
    ops->fp8_quantize_cols(qt, scales, x, OFFSETS, N_EXPERTS, N_ROWS, C, FP8_SCALE_AMAX, blocks, NULL);
    double *back = deq_cols(qt, scales, C, blocks);
    size_t row_blocks = 0;
    for (size_t e = 0; e < N_EXPERTS; e++) {
        size_t r0 = (size_t)OFFSETS[e], r1 = (size_t)OFFSETS[e + 1], p = fp8_expert_col(r0, e);
        for (size_t b = r0; b < r1; b += 128, row_blocks++)
            for (size_t cb = 0; cb < Cs; cb++) {
                float amax = 0;
                for (size_t r = b; r < r1 && r < b + 128; r++)
                    for (size_t c = cb * width; c < C && c < (cb + 1) * width; c++)
                        amax = fmaxf(amax, fabsf((float)x[r * C + c]));
                double sc = scales[((p + b - r0) / 128) * Cs + cb];
                CHECK_MSG(sc == fp8_block_scale(amax, FP8_SCALE_AMAX), "expert %zu rows from %zu block %zu", e, b, cb);
                for (size_t r = b; r < r1 && r < b + 128; r++)
                    for (size_t c = cb * width; c < C && c < (cb + 1) * width; c++)
                        CHECK_MSG(within_half_step(x[r * C + c], back[r * C + c], sc), "row %zu col %zu", r, c);
            }
    }
    size_t p3 = fp8_expert_col(170, 3);
    CHECK(scales[(p3 / 128) * Cs + 128 / width] == 1 && qt[150 * Rt + p3 + 5] == 0);
    // Every byte outside the experts' columns is 0 (0x55 poison before), every other scale block 1.
    size_t zeros = 0, ones = 0, used = (size_t)OFFSETS[N_EXPERTS];
    for (size_t i = 0; i < C * Rt; i++) zeros += qt[i] == 0 || qt[i] == 0x80;
    for (size_t i = 0; i < Rt / 128 * Cs; i++) ones += scales[i] == 1;
    CHECK_MSG(zeros >= (Rt - used) * C, "padding columns hold zero codes (%zu zeros)", zeros);
    CHECK_MSG(ones >= (Rt / 128 - row_blocks) * Cs, "padding blocks have scale 1 (%zu ones)", ones);
    free(x), free(scales), free(qt), free(back);
}

static void test_fp8_quantize_cols(void) {
    check_quantize_cols(FP8_COLS_1X128);
    check_quantize_cols(FP8_COLS_128X128);
}

static void test_fp8_quantize_weights(void) {
    size_t E = 2, N = 200, K = 260, Nb = fp8_blocks(N), Kb = fp8_blocks(K);
    real *w = rnd_outliers(E * N * K, 3), *s = malloc(E * Nb * Kb * sizeof(real)), *st = malloc(E * Nb * Kb * sizeof(real));
    for (size_t n = 128; n < 200; n++)
        for (size_t k = 0; k < 128; k++) w[(1 * N + n) * K + k] = 0; // expert 1's block (1, 0) is all zeros
    uint8_t *q = malloc(E * N * K), *qt = malloc(E * N * K);
    ops->fp8_quantize_weights(q, s, st, w, E, N, K, FP8_SCALE_AMAX, NULL);
    ops->fp8_transpose_codes(qt, q, E, N, K);
    double *back = deq_weights(q, s, E, N, K);
    for (size_t e = 0; e < E; e++)
        for (size_t n = 0; n < N; n++)
            for (size_t k = 0; k < K; k++) {
                size_t i = (e * N + n) * K + k;
                double sc = s[(e * Kb + k / 128) * Nb + n / 128];
                CHECK_MSG(within_half_step(w[i], back[i], sc), "w[%zu, %zu, %zu]", e, n, k);
                CHECK_MSG(qt[(e * K + k) * N + n] == q[i], "transpose at [%zu, %zu, %zu]", e, n, k);
                CHECK(st[(e * Nb + n / 128) * Kb + k / 128] == sc);
            }
    CHECK(s[(1 * Kb + 0) * Nb + 1] == 1);
    free(w), free(s), free(st), free(q), free(qt), free(back);
}

// A weight tensor quantised by parts, as the ranks of an expert-data-parallel group do: each part's
// block maxima (from a copy holding 10^4 outside it: nothing else read), their largest, then each
// part's codes (nothing else written). Parts cut blocks and rows anywhere, one is empty; the codes,
// scales and counts are those of the whole tensor at once.
static void test_fp8_quantize_weights_parts(void) {
    size_t E = 3, N = 200, K = 136, Nb = fp8_blocks(N), Kb = fp8_blocks(K), n = E * N * K, nb = E * Nb * Kb;
    const size_t cut[] = {0, 7777, 40000, 40000, 40064, n};
    real *w = rnd_outliers(n, 5), *part = malloc(n * sizeof(real)), *amax = malloc(nb * sizeof(real));
    real *all = calloc(nb, sizeof(real)), *s = malloc(nb * sizeof(real)), *st = malloc(nb * sizeof(real));
    real *s1 = malloc(nb * sizeof(real)), *st1 = malloc(nb * sizeof(real));
    uint8_t *q = malloc(n), *q1 = malloc(n);
    uint64_t whole[FP8_COUNTS] = {0}, parts[FP8_COUNTS] = {0};
    ops->fp8_quantize_weights(q1, s1, st1, w, E, N, K, FP8_SCALE_AMAX, whole);
    for (size_t p = 0; p + 1 < sizeof cut / sizeof cut[0]; p++) {
        for (size_t i = 0; i < n; i++) part[i] = i >= cut[p] && i < cut[p + 1] ? w[i] : 1e4f;
        ops->fp8_weights_amax(amax, part, E, N, K, cut[p], cut[p + 1]);
        for (size_t b = 0; b < nb; b++) all[b] = amax[b] > all[b] ? amax[b] : all[b];
    }
    memset(q, 0x5a, n);
    for (size_t p = 0; p + 1 < sizeof cut / sizeof cut[0]; p++) {
        for (size_t i = 0; i < n; i++) part[i] = i >= cut[p] && i < cut[p + 1] ? w[i] : 1e4f;
        ops->fp8_quantize_weights_part(q, s, st, all, part, E, N, K, cut[p], cut[p + 1], FP8_SCALE_AMAX, parts);
        size_t outside = 0;
        for (size_t i = cut[p + 1]; i < n; i++) outside += q[i] != 0x5a;
        CHECK_MSG(outside == 0, "part %zu wrote %zu codes past its end", p, outside);
    }
    CHECK_MSG(!memcmp(q, q1, n), "codes by parts differ from the whole tensor's");
    CHECK_MSG(!memcmp(s, s1, nb * sizeof(real)) && !memcmp(st, st1, nb * sizeof(real)), "scales differ");
    CHECK_MSG(!memcmp(parts, whole, sizeof whole), "counts by parts %llu values, %llu flushed; whole %llu, %llu",
              (unsigned long long)parts[FP8_COUNT_VALUES], (unsigned long long)parts[FP8_COUNT_FLUSHED],
              (unsigned long long)whole[FP8_COUNT_VALUES], (unsigned long long)whole[FP8_COUNT_FLUSHED]);
    CHECK_MSG(whole[FP8_COUNT_FLUSHED] > 0 && whole[FP8_COUNT_VALUES] == n, "the test's values flush none");
    free(w), free(part), free(amax), free(all), free(s), free(st), free(s1), free(st1), free(q), free(q1);
}

// Rows gathered from tokens' quantised rows: the same codes and scales as the rows quantised through
// the map (each token's row read by several experts' rows), all experts and a chunk of them (expert
// 1 on: the rows before it left as they were).
static void test_fp8_gather_rows(void) {
    size_t T = 97, R = N_ROWS, K = 300, Kb = fp8_blocks(K);
    real *x = rnd_outliers(T * K, 5), *ts = malloc(Kb * T * sizeof(real));
    uint8_t *tq = malloc(T * K), *q[2] = {malloc(R * K), malloc(R * K)};
    real *s[2] = {malloc(Kb * R * sizeof(real)), malloc(Kb * R * sizeof(real))};
    int32_t *map = malloc(R * sizeof(int32_t));
    for (size_t r = 0; r < R; r++) map[r] = (int32_t)((r * 31 + 7) % T);
    ops->fp8_quantize_rows(tq, ts, x, NULL, 1, T, K, FP8_SCALE_AMAX, NULL);
    for (int chunk = 0; chunk < 2; chunk++) {
        for (int i = 0; i < 2; i++) memset(q[i], 0x55, R * K), memset(s[i], 0xff, Kb * R * sizeof(real));
        const int32_t *off = OFFSETS + chunk;
        size_t E = N_EXPERTS - (size_t)chunk;
        ops->fp8_gather_rows(q[0], s[0], tq, ts, map, off, E, R, K, T);
        ops->fp8_quantize_rows_cols(q[1], s[1], NULL, NULL, x, map, off, E, R, K, FP8_SCALE_AMAX, FP8_COLS_1X128,
                                    NULL);
        CHECK_MSG(!memcmp(q[0], q[1], R * K), "%s: gathered codes differ from the rows quantised through the map",
                  chunk ? "experts 1.." : "all experts");
        CHECK_MSG(!memcmp(s[0], s[1], Kb * R * sizeof(real)), "%s: gathered scales differ",
                  chunk ? "experts 1.." : "all experts");
        CHECK_MSG(!chunk || (q[0][0] == 0x55 && q[0][3 * K - 1] == 0x55), "rows of no group were written");
    }
    free(x), free(ts), free(tq), free(map);
    for (int i = 0; i < 2; i++) free(q[i]), free(s[i]);
}

// The FP8 exchange's ops on a chunk of experts (1 to 3 of OFFSETS: rows 3-299, row 0-2 in no group):
// the grouped scales to row-major rows of pitch 8 (> Kb = 3) and back; the rows dequantised, each
// value its code's times its block's scale in fp32. Outputs start as NaN: rows of no group and the
// pitch's padding stay so.
static void test_fp8_exchange_ops(void) {
    size_t R = N_ROWS, K = 300, Kb = fp8_blocks(K), pitch = 8;
    const int32_t *chunk = OFFSETS + 1;
    real *x = rnd_outliers(R * K, 4), *scales = malloc(Kb * R * sizeof(real)), *back = malloc(Kb * R * sizeof(real));
    real *rows = malloc(R * pitch * sizeof(real)), *deq = malloc(R * K * sizeof(real));
    uint8_t *q = malloc(R * K);
    for (size_t i = 0; i < Kb * R; i++) back[i] = NAN;
    for (size_t i = 0; i < R * pitch; i++) rows[i] = NAN;
    for (size_t i = 0; i < R * K; i++) deq[i] = NAN;
    ops->fp8_quantize_rows(q, scales, x, chunk, N_EXPERTS - 1, R, K, FP8_SCALE_AMAX, NULL);
    ops->fp8_regroup_scales(rows, scales, chunk, N_EXPERTS - 1, R, Kb, pitch, true);
    ops->fp8_regroup_scales(back, rows, chunk, N_EXPERTS - 1, R, Kb, pitch, false);
    ops->fp8_dequantize_rows(deq, q, back, chunk, N_EXPERTS - 1, R, K);
    for (size_t e = 1; e < N_EXPERTS; e++) {
        size_t r0 = (size_t)OFFSETS[e], n = (size_t)OFFSETS[e + 1] - r0;
        for (size_t i = 0; i < n; i++)
            for (size_t kb = 0; kb < pitch; kb++) {
                real got = rows[(r0 + i) * pitch + kb];
                if (kb >= Kb) {
                    CHECK_MSG(isnan(got), "row %zu: padding scale %zu written", r0 + i, kb);
                    continue;
                }
                real s = scales[Kb * r0 + kb * n + i];
                CHECK_MSG(got == s && back[Kb * r0 + kb * n + i] == s, "row %zu block %zu: %g, %g, not %g", r0 + i, kb,
                          got, back[Kb * r0 + kb * n + i], s);
                for (size_t k = kb * 128; k < K && k < kb * 128 + 128; k++)
                    CHECK_MSG(deq[(r0 + i) * K + k] == (real)(fp8_e4m3_decode(q[(r0 + i) * K + k]) * (float)s),
                              "[%zu, %zu] dequantised", r0 + i, k);
            }
    }
    for (size_t r = 0; r < 3; r++) CHECK_MSG(isnan(rows[r * pitch]) && isnan(deq[r * K]), "row %zu in no group", r);
    CHECK(isnan(back[0]));
    free(x), free(scales), free(back), free(rows), free(deq), free(q);
}

// ref (M, N) = sum over k < K of a[i a_m + k a_k] b[j b_n + k b_k], and the sums of |terms|.
static void ref_product(double *ref, double *abs_sum, const double *a, size_t a_m, size_t a_k, const double *b,
                        size_t b_n, size_t b_k, size_t M, size_t N, size_t K) {
    for (size_t i = 0; i < M; i++)
        for (size_t j = 0; j < N; j++) {
            double s = 0, t = 0;
            for (size_t k = 0; k < K; k++) {
                double v = a[i * a_m + k * a_k] * b[j * b_n + k * b_k];
                s += v, t += fabs(v);
            }
            ref[i * N + j] = s, abs_sum[i * N + j] = t;
        }
}

// |got - ref| <= rel x sum |terms| + base for every element of (M, N) with row stride ld.
static void check_product(const char *what, const real *got, size_t ld, const double *ref, const double *abs_sum,
                          size_t M, size_t N, double rel, double base) {
    for (size_t i = 0; i < M; i++)
        for (size_t j = 0; j < N; j++) {
            double g = got[i * ld + j] - base, r = ref[i * N + j];
            if (!(fabs(g - r) <= rel * abs_sum[i * N + j])) {
                TEST_FAIL("%s [%zu, %zu]: %.9g, expected %.9g (tolerance %.3g)", what, i, j, g, r, rel * abs_sum[i * N + j]);
                return;
            }
        }
}

// fp32 sums of 128 exact products, each block's sum rounded once more by its scale and once by the
// accumulator: the emulation is within (128 + Kb + 2) units of 2^-24 of sum |terms| from the exact
// sum of the dequantised operands.
static double fp32_block_sum_tol(size_t K) { return (double)(FP8_BLOCK + fp8_blocks(K) + 2) * 0x1p-24; }

// The weight gradient per expert from token-major copies of x (R, K) in `blocks` and dy (R, N) in
// 1x128, against the exact product of the dequantised copies: added to dw (an empty expert's
// untouched), then written over it (an empty expert's zeros).
static void check_grouped_wgrad(const real *x, const real *dy, size_t R, size_t E, size_t N, size_t K,
                                Fp8ColBlocks blocks) {
    size_t Rt = fp8_expert_cols(R, E);
    uint8_t *xt = malloc(K * Rt), *dyt = malloc(N * Rt);
    real *xts = malloc(Rt / 128 * K * sizeof(real)), *dyts = malloc(Rt / 128 * N * sizeof(real));
    real *dw = malloc(E * N * K * sizeof(real));
    ops->fp8_quantize_cols(xt, xts, x, OFFSETS, E, R, K, FP8_SCALE_AMAX, blocks, NULL);
    ops->fp8_quantize_cols(dyt, dyts, dy, OFFSETS, E, R, N, FP8_SCALE_AMAX, FP8_COLS_1X128, NULL);
    double *XT = deq_cols(xt, xts, K, blocks), *DYT = deq_cols(dyt, dyts, N, FP8_COLS_1X128);
    double *ref = malloc(N * K * sizeof(double)), *abs_sum = malloc(N * K * sizeof(double));
    for (int accumulate = 1; accumulate >= 0; accumulate--) {
        for (size_t i = 0; i < E * N * K; i++) dw[i] = accumulate ? 1.5 : NAN;
        ops->fp8_grouped_matmul_wgrad(dw, dyt, dyts, xt, xts, blocks, OFFSETS, E, N, K, R, accumulate);
        for (size_t e = 0; e < E; e++) {
            size_t r0 = (size_t)OFFSETS[e], rows = (size_t)(OFFSETS[e + 1] - OFFSETS[e]);
            ref_product(ref, abs_sum, DYT + r0 * N, 1, N, XT + r0 * K, 1, K, N, K, rows);
            check_product(accumulate ? "weight gradient added" : "weight gradient written over", dw + e * N * K, K,
                          ref, abs_sum, N, K, fp32_block_sum_tol(rows), accumulate ? 1.5 : 0);
        }
        CHECK(dw[1 * N * K + 17] == (accumulate ? 1.5 : 0)); // the empty expert's
    }
    free(xt), free(dyt), free(xts), free(dyts), free(dw), free(XT), free(DYT), free(ref), free(abs_sum);
}

static void test_fp8_grouped_products(void) {
    size_t R = N_ROWS, E = N_EXPERTS, N = 136, K = 260;
    size_t Kb = fp8_blocks(K), Nb = fp8_blocks(N);
    real *x = rnd_outliers(R * K, 4), *dy = rnd_outliers(R * N, 5), *w = rnd_outliers(E * N * K, 6);
    uint8_t *xq = malloc(R * K), *dyq = malloc(R * N), *wq = malloc(E * N * K), *wqt = malloc(E * N * K);
    real *xs = malloc(Kb * R * sizeof(real)), *dys = malloc(Nb * R * sizeof(real)), *ws = malloc(E * Kb * Nb * sizeof(real));
    real *wst = malloc(E * Kb * Nb * sizeof(real));
    ops->fp8_quantize_rows(xq, xs, x, OFFSETS, E, R, K, FP8_SCALE_AMAX, NULL);
    ops->fp8_quantize_rows(dyq, dys, dy, OFFSETS, E, R, N, FP8_SCALE_AMAX, NULL);
    ops->fp8_quantize_weights(wq, ws, wst, w, E, N, K, FP8_SCALE_AMAX, NULL);
    ops->fp8_transpose_codes(wqt, wq, E, N, K);
    double *X = deq_rows(xq, xs, OFFSETS, E, R, K), *DY = deq_rows(dyq, dys, OFFSETS, E, R, N), *W = deq_weights(wq, ws, E, N, K);
    double *ref = malloc(R * (N > K ? N : K) * sizeof(double)), *abs_sum = malloc(R * (N > K ? N : K) * sizeof(double));
    real *y = malloc(R * N * sizeof(real)), *dx = malloc(R * K * sizeof(real));
    ops->fp8_grouped_matmul(y, xq, xs, wq, ws, OFFSETS, E, N, K, R);
    ops->fp8_grouped_matmul(dx, dyq, dys, wqt, wst, OFFSETS, E, K, N, R);
    for (size_t e = 0; e < E; e++) {
        size_t r0 = (size_t)OFFSETS[e], rows = (size_t)(OFFSETS[e + 1] - OFFSETS[e]);
        ref_product(ref, abs_sum, X + r0 * K, K, 1, W + e * N * K, K, 1, rows, N, K);
        check_product("forward", y + r0 * N, N, ref, abs_sum, rows, N, fp32_block_sum_tol(K), 0);
        ref_product(ref, abs_sum, DY + r0 * N, N, 1, W + e * N * K, 1, K, rows, K, N);
        check_product("input gradient", dx + r0 * K, K, ref, abs_sum, rows, K, fp32_block_sum_tol(N), 0);
        // Against the unquantised operands: each factor within 2^-4 (+ subnormal steps) of its value.
        double *x64 = malloc(rows * K * sizeof(double)), *w64 = malloc(N * K * sizeof(double));
        for (size_t i = 0; i < rows * K; i++) x64[i] = x[r0 * K + i];
        for (size_t i = 0; i < N * K; i++) w64[i] = w[e * N * K + i];
        ref_product(ref, abs_sum, x64, K, 1, w64, K, 1, rows, N, K);
        check_product("forward against the unquantised operands", y + r0 * N, N, ref, abs_sum, rows, N, 0.13, 0);
        free(x64), free(w64);
    }
    check_grouped_wgrad(x, dy, R, E, N, K, FP8_COLS_1X128);
    check_grouped_wgrad(x, dy, R, E, N, K, FP8_COLS_128X128);
    real *yd = malloc(R * N * sizeof(real));
    ops->fp8_quantize_rows(xq, xs, x, NULL, 0, R, K, FP8_SCALE_AMAX, NULL);
    free(X);
    X = deq_rows(xq, xs, NULL, 0, R, K);
    ops->fp8_matmul(yd, xq, xs, wq, ws, R, N, K);
    ref_product(ref, abs_sum, X, K, 1, W, K, 1, R, N, K);
    check_product("dense", yd, N, ref, abs_sum, R, N, fp32_block_sum_tol(K), 0);
    free(x), free(dy), free(w), free(xq), free(dyq), free(wq), free(wqt), free(xs), free(dys);
    free(ws), free(wst), free(X), free(DY), free(W), free(ref), free(abs_sum);
    free(y), free(dx), free(yd);
}

// The products' arithmetic, bit for bit: each output's fp32 partial sums of a block in K order from
// zero, promoted with one fma of the two scales' product, as one scalar loop computes them (the
// emulation sums in vector lanes along the output columns, in tiles with short edges here: M, N and
// K are not multiples of the tile or of 128), and NaN codes giving NaN.
static void test_fp8_products_order(void) {
    size_t M = 37, N = 70, K = 300, Kb = fp8_blocks(K), Nb = fp8_blocks(N);
    real *x = rnd_outliers(M * K, 8), *w = rnd_outliers(N * K, 9), *y = malloc(M * N * sizeof(real));
    uint8_t *xq = malloc(M * K), *wq = malloc(N * K);
    real *xs = malloc(Kb * M * sizeof(real)), *ws = malloc(Kb * Nb * sizeof(real));
    real *wst = malloc(Kb * Nb * sizeof(real));
    ops->fp8_quantize_rows(xq, xs, x, NULL, 0, M, K, FP8_SCALE_AMAX, NULL);
    ops->fp8_quantize_weights(wq, ws, wst, w, 1, N, K, FP8_SCALE_AMAX, NULL);
    xq[5 * K + 200] = FP8_E4M3_NAN; // row 5's outputs NaN
    ops->fp8_matmul(y, xq, xs, wq, ws, M, N, K);
    size_t wrong = 0;
    for (size_t i = 0; i < M; i++)
        for (size_t j = 0; j < N; j++) {
            float acc = 0;
            for (size_t kb = 0; kb < Kb; kb++) {
                float part = 0;
                for (size_t k = kb * FP8_BLOCK; k < K && k < (kb + 1) * FP8_BLOCK; k++)
                    part += (float)(e4m3_value(xq[i * K + k]) * e4m3_value(wq[j * K + k])); // exact
                acc = fmaf(part, (float)xs[kb * M + i] * (float)ws[kb * Nb + j / FP8_BLOCK], acc);
            }
            bool same = i == 5 ? isnan(y[i * N + j]) : y[i * N + j] == (real)acc;
            if (!same && wrong++ == 0) TEST_FAIL("[%zu, %zu]: %.9g, expected %.9g", i, j, (double)y[i * N + j], acc);
        }
    CHECK_MSG(wrong == 0, "%zu of %zu outputs differ", wrong, M * N);
    free(x), free(w), free(y), free(xq), free(wq), free(xs), free(ws), free(wst);
}

// ---------------------------------------------------------------- overflow and underflow counters

static void expect_counts(const char *what, const uint64_t n[FP8_COUNTS], uint64_t values, uint64_t flushed,
                          uint64_t saturated, uint64_t nan) {
    CHECK_MSG(n[FP8_COUNT_VALUES] == values && n[FP8_COUNT_FLUSHED] == flushed && n[FP8_COUNT_SATURATED] == saturated &&
                  n[FP8_COUNT_NAN] == nan,
              "%s: values %llu, flushed %llu, saturated %llu, NaN %llu; expected %llu, %llu, %llu, %llu", what,
              (unsigned long long)n[FP8_COUNT_VALUES], (unsigned long long)n[FP8_COUNT_FLUSHED],
              (unsigned long long)n[FP8_COUNT_SATURATED], (unsigned long long)n[FP8_COUNT_NAN],
              (unsigned long long)values, (unsigned long long)flushed, (unsigned long long)saturated,
              (unsigned long long)nan);
}

// Rows of 200 (a block and a short one) crafted for known counts. Row 0: a block scaled 1 by its
// 448 holding ten values of 2^-11 and one of 2^-10 (a tie: to the even code, 0) that flush, one
// just above 2^-10 that does not, a zero; its short block (72 values) holds an infinity: the block's
// scale is infinite (AMAX), so the infinity saturates and the 71 others flush. Row 1: a NaN and a
// -0 (neither flushed), then five -2^-11 beside -448. Row 2: a block of amax 2^-120, whose scale
// (2^-120 / 448, subnormal) is raised to 2^-126: 2^-120 scales to 64, 2^-136 to 2^-10 (a tie: to
// 0, flushed), 2^-135 to 2^-9 (the smallest subnormal code). Row 3: ones.
static real *crafted_rows(size_t K) {
    real *x = malloc(4 * K * sizeof(real));
    for (size_t i = 0; i < 4 * K; i++) x[i] = i / K == 2 ? 0 : 1;
    x[0] = 448;
    for (int i = 1; i <= 10; i++) x[i] = 0x1p-11f;
    x[11] = 0x1p-10f, x[12] = nextafterf(0x1p-10f, 1), x[13] = 0, x[133] = INFINITY;
    x[K + 3] = NAN, x[K + 4] = -0.0f, x[K + 128] = -448;
    for (size_t i = 129; i <= 133; i++) x[K + i] = -0x1p-11f;
    x[2 * K] = 0x1p-120f, x[2 * K + 1] = 0x1p-136f, x[2 * K + 2] = 0x1p-135f;
    return x;
}

static void test_fp8_counts_rows(void) {
    size_t K = 200;
    real *x = crafted_rows(K), *scales = malloc(4 * fp8_blocks(K) * sizeof(real));
    uint8_t *q = malloc(4 * K);
    uint64_t n[FP8_COUNTS] = {0}, pow2[FP8_COUNTS] = {0}, last3[FP8_COUNTS] = {0};
    static const int32_t LAST3[2] = {1, 4};
    ops->fp8_quantize_rows(q, scales, x, NULL, 0, 4, K, FP8_SCALE_AMAX, n);
    expect_counts("rows, amax scales", n, 4 * K, 11 + 71 + 5 + 1, 1, 1);
    CHECK(q[2 * K] == fp8_e4m3_encode(64) && q[2 * K + 1] == 0 && q[2 * K + 2] == 1);
    CHECK(q[133] == FP8_E4M3_NAN && q[K + 3] == FP8_E4M3_NAN);
    ops->fp8_quantize_rows(q, scales, x, NULL, 0, 4, K, FP8_SCALE_POW2, pow2); // the same scales but row 1's first
    expect_counts("rows, power-of-two scales", pow2, 4 * K, 88, 1, 1);
    ops->fp8_quantize_rows(q, scales, x, LAST3, 1, 4, K, FP8_SCALE_AMAX, last3); // rows 1-3: no infinity
    expect_counts("rows 1-3 as a group", last3, 3 * K, 6, 0, 1);
    ops->fp8_quantize_rows(q, scales, x, NULL, 0, 4, K, FP8_SCALE_AMAX, n); // counters add up
    expect_counts("rows twice", n, 8 * K, 2 * 88, 2, 2);
    free(x), free(scales), free(q);
}

// Token-major copies: column 0 of the one nonempty expert (130 rows: blocks of 128 and 2) holds
// 448 and twenty values of 2^-11 in its first block; column 1 a NaN. Padding columns count nothing.
static void test_fp8_counts_cols(void) {
    static const int32_t OFF[3] = {0, 0, 130};
    size_t R = 130, C = 2, Rt = fp8_expert_cols(R, 2);
    real *x = malloc(R * C * sizeof(real)), *scales = malloc(Rt / 128 * C * sizeof(real));
    for (size_t i = 0; i < R * C; i++) x[i] = 1;
    x[0] = 448, x[5 * C + 1] = NAN;
    for (size_t r = 1; r <= 20; r++) x[r * C] = 0x1p-11f;
    uint8_t *qt = malloc(C * Rt);
    uint64_t n[FP8_COUNTS] = {0};
    ops->fp8_quantize_cols(qt, scales, x, OFF, 2, R, C, FP8_SCALE_AMAX, FP8_COLS_1X128, n);
    expect_counts("token-major copies", n, R * C, 20, 0, 1);
    free(x), free(scales), free(qt);
}

// Weights (130, 130): block (0, 0) holds 448 and ten values of 2^-11; block (1, 1), 2 x 2 values,
// an infinity (saturated) and three ones (flushed under its infinite scale).
static void test_fp8_counts_weights(void) {
    size_t N = 130, K = 130;
    real *w = malloc(N * K * sizeof(real)), *s = malloc(4 * sizeof(real)), *st = malloc(4 * sizeof(real));
    for (size_t i = 0; i < N * K; i++) w[i] = 1;
    w[0] = 448, w[129 * K + 129] = -INFINITY;
    for (size_t k = 0; k < 10; k++) w[K + k] = 0x1p-11f;
    uint8_t *q = malloc(N * K);
    uint64_t n[FP8_COUNTS] = {0};
    ops->fp8_quantize_weights(q, s, st, w, 1, N, K, FP8_SCALE_AMAX, n);
    expect_counts("weights", n, N * K, 13, 1, 0);
    free(w), free(s), free(st), free(q);
}

// The fused SwiGLU counts what quantising its output counts; without storing its output, the same
// codes, scales and counts.
static void test_fp8_counts_swiglu(void) {
    size_t R = 50, H = 200;
    real *gu = rnd_outliers(R * 2 * H, 7), *h = malloc(R * H * sizeof(real)), *s = malloc(R * 2 * sizeof(real));
    real *s2 = malloc(R * 2 * sizeof(real));
    uint8_t *q = malloc(R * H), *q2 = malloc(R * H);
    uint64_t fused[FP8_COUNTS] = {0}, rows[FP8_COUNTS] = {0}, unstored[FP8_COUNTS] = {0};
    ops->swiglu_forward_fp8(h, q, s, gu, NULL, 0, R, H, FP8_SCALE_AMAX, fused);
    ops->swiglu_forward_fp8(NULL, q2, s2, gu, NULL, 0, R, H, FP8_SCALE_AMAX, unstored);
    CHECK(!memcmp(q2, q, R * H) && !memcmp(s2, s, R * 2 * sizeof(real)) && !memcmp(unstored, fused, sizeof fused));
    ops->fp8_quantize_rows(q, s, h, NULL, 0, R, H, FP8_SCALE_AMAX, rows);
    expect_counts("fused SwiGLU", fused, rows[FP8_COUNT_VALUES], rows[FP8_COUNT_FLUSHED], rows[FP8_COUNT_SATURATED],
                  rows[FP8_COUNT_NAN]);
    CHECK_MSG(fused[FP8_COUNT_VALUES] == R * H && fused[FP8_COUNT_FLUSHED] > 0, "%llu flushed",
              (unsigned long long)fused[FP8_COUNT_FLUSHED]);
    free(gu), free(h), free(s), free(q), free(s2), free(q2);
}

const TestCase fp8_tests[] = {
    {"fp8_e4m3_every_code", test_e4m3_every_code},
    {"fp8_e4m3_ties_and_nearest", test_e4m3_ties_and_nearest},
    {"fp8_e4m3_saturation_and_nan", test_e4m3_saturation_and_nan},
    {"fp8_e4m3_subnormals", test_e4m3_subnormals},
    {"fp8_block_scales", test_block_scales},
    {"fp8_quantize_rows", test_fp8_quantize_rows},
    {"fp8_quantize_cols", test_fp8_quantize_cols},
    {"fp8_quantize_weights", test_fp8_quantize_weights},
    {"fp8_quantize_weights_parts", test_fp8_quantize_weights_parts},
    {"fp8_gather_rows", test_fp8_gather_rows},
    {"fp8_exchange_ops", test_fp8_exchange_ops},
    {"fp8_grouped_products", test_fp8_grouped_products},
    {"fp8_products_order", test_fp8_products_order},
    {"fp8_counts_rows", test_fp8_counts_rows},
    {"fp8_counts_cols", test_fp8_counts_cols},
    {"fp8_counts_weights", test_fp8_counts_weights},
    {"fp8_counts_swiglu", test_fp8_counts_swiglu},
    {NULL, NULL},
};

// The FP8 recipe emulated on the CPU (ops/fp8.h, docs/FP8.md): quantisation to E4M3 codes with
// fp32 block scales, bit for bit as the CUDA kernels do it, and the products as Hopper runs them:
// per 128-long block of the reduction, the exact products of two E4M3 values summed in fp32, times
// the two blocks' scales, added to an fp32 accumulator. The oracle of every FP8 CUDA kernel.
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "cpu_ops.h"

// ---------------------------------------------------------------- quantisation

// *q = x's code under inverse scale inv, counted into c (FP8_COUNTS).
static void fp8_code_counted(uint8_t *q, float x, float inv, uint64_t c[FP8_COUNTS]) {
    uint8_t code = *q = fp8_quantize(x, inv);
    c[FP8_COUNT_VALUES]++;
    c[FP8_COUNT_FLUSHED] += fp8_flushed(x, code);
    c[FP8_COUNT_SATURATED] += fp8_saturated(x, inv);
    c[FP8_COUNT_NAN] += x != x;
}

// c (FP8_COUNTS) added to counts (NULL: nothing), atomically (blocks run in parallel).
static void fp8_add_counts(uint64_t *counts, const uint64_t c[FP8_COUNTS]) {
    for (int i = 0; counts && i < FP8_COUNTS; i++) {
#pragma omp atomic
        counts[i] += c[i];
    }
}

// The block x[r xr + c xc] (r < rows, c < cols) to codes q[r qr + c qc] under one scale, returned;
// what it counts added to counts (FP8_COUNTS; NULL: nothing).
static float fp8_quantize_block(uint8_t *q, size_t qr, size_t qc, const real *x, size_t xr, size_t xc,
                                size_t rows, size_t cols, Fp8Scaling how, uint64_t *counts) {
    float amax = 0;
    for (size_t r = 0; r < rows; r++)
        for (size_t c = 0; c < cols; c++) amax = fmaxf(amax, fabsf((float)x[r * xr + c * xc]));
    float s = fp8_block_scale(amax, how), inv = fp8_scale_inverse(s);
    uint64_t n[FP8_COUNTS] = {0};
    for (size_t r = 0; r < rows; r++)
        for (size_t c = 0; c < cols; c++) fp8_code_counted(&q[r * qr + c * qc], (float)x[r * xr + c * xc], inv, n);
    fp8_add_counts(counts, n);
    return s;
}

static size_t min_size(size_t a, size_t b) { return a < b ? a : b; }

// The first row and the rows of group g of offsets (NULL: one group of all R rows).
static void fp8_group(const int32_t *offsets, size_t g, size_t R, size_t *r0, size_t *rows) {
    *r0 = offsets ? (size_t)offsets[g] : 0;
    *rows = offsets ? (size_t)offsets[g + 1] - *r0 : R;
}

void cpu_fp8_quantize_rows(void *q_, void *scales_, const void *x_, const int32_t *offsets, size_t E, size_t R,
                           size_t K, Fp8Scaling how, uint64_t *counts) {
    uint8_t *q = q_;
    real *scales = scales_;
    const real *x = x_;
    size_t Kb = fp8_blocks(K);
    for (size_t g = 0; g < (offsets ? E : 1); g++) {
        size_t r0, rows;
        fp8_group(offsets, g, R, &r0, &rows);
#pragma omp parallel for schedule(static)
        for (size_t i = 0; i < rows; i++)
            for (size_t kb = 0; kb < Kb; kb++) {
                size_t at = (r0 + i) * K + kb * FP8_BLOCK;
                scales[fp8_row_scale_index(Kb, r0, rows, i, kb)] = fp8_quantize_block(
                    q + at, 0, 1, x + at, 0, 1, 1, min_size(FP8_BLOCK, K - kb * FP8_BLOCK), how, counts);
            }
    }
}

void cpu_fp8_gather_rows(void *q_, void *scales_, const void *tq_, const void *tscales_, const int32_t *x_rows,
                         const int32_t *offsets, size_t E, size_t R, size_t K, size_t T) {
    uint8_t *q = q_;
    real *scales = scales_;
    const uint8_t *tq = tq_;
    const real *tscales = tscales_;
    size_t Kb = fp8_blocks(K);
    for (size_t g = 0; g < E; g++) {
        size_t r0, rows;
        fp8_group(offsets, g, R, &r0, &rows);
        for (size_t i = 0; i < rows; i++) {
            size_t t = (size_t)x_rows[r0 + i];
            memcpy(q + (r0 + i) * K, tq + t * K, K);
            for (size_t kb = 0; kb < Kb; kb++) // tscales: one group of T rows
                scales[fp8_row_scale_index(Kb, r0, rows, i, kb)] = tscales[fp8_row_scale_index(Kb, 0, T, t, kb)];
        }
    }
}

// The two ops one after the other: the emulation of the fused kernel is its definition.
void cpu_swiglu_forward_fp8(void *out, void *q, void *scales, const void *gu, const int32_t *offsets, size_t E,
                            size_t R, size_t H, Fp8Scaling how, uint64_t *counts) {
    real *h = out ? out : moe_malloc(R * H * sizeof(real)); // out NULL: the output quantised, not kept
    cpu_swiglu_forward(h, gu, R, H, offsets, E);
    cpu_fp8_quantize_rows(q, scales, h, offsets, E, R, H, how, counts);
    if (!out) free(h);
}

// The norm (with b, the residual add first) then the rows' quantisation, as the ops do them.
void cpu_rmsnorm_forward_fp8(void *sum, void *out, void *rstd, void *q, void *scales, const void *a, const void *b,
                             const void *w, size_t R, size_t W, float eps, Fp8Scaling how, uint64_t *counts) {
    if (b) cpu_add_rmsnorm_forward(sum, out, rstd, a, b, w, R, W, eps);
    else cpu_rmsnorm_forward(out, rstd, a, w, R, W, eps);
    cpu_fp8_quantize_rows(q, scales, out, NULL, 1, R, W, how, counts);
}

void cpu_fp8_quantize_cols(void *qt_, void *scales_, const void *x_, const int32_t *offsets, size_t E,
                           size_t R, size_t C, Fp8Scaling how, Fp8ColBlocks blocks, uint64_t *counts) {
    uint8_t *qt = qt_;
    real *scales = scales_;
    const real *x = x_;
    size_t Rt = fp8_expert_cols(R, E), Cs = fp8_col_scales(C, blocks), width = fp8_col_block(blocks);
    memset(qt, 0, C * Rt);
    for (size_t i = 0; i < Rt / FP8_BLOCK * Cs; i++) scales[i] = 1;
    for (size_t e = 0; e < E; e++) {
        size_t r0, rows;
        fp8_group(offsets, e, R, &r0, &rows);
        size_t p = fp8_expert_col(r0, e);
#pragma omp parallel for schedule(static)
        for (size_t cb = 0; cb < Cs; cb++)
            for (size_t j = 0; j < fp8_blocks(rows); j++) {
                size_t r = j * FP8_BLOCK, c = cb * width;
                scales[fp8_col_scale_at(p / FP8_BLOCK + j, c, C, blocks)] =
                    fp8_quantize_block(qt + c * Rt + p + r, 1, Rt, x + (r0 + r) * C + c, C, 1,
                                       min_size(FP8_BLOCK, rows - r), min_size(width, C - c), how, counts);
            }
    }
}

// The two ops one after the other (the oracle of the one-pass kernel; either alone where the other's
// output is NULL), on the rows gathered first where x_rows maps them (rows of no group zero).
void cpu_fp8_quantize_rows_cols(void *q, void *scales, void *qt, void *scales_t, const void *x_,
                                const int32_t *x_rows, const int32_t *offsets, size_t E, size_t R, size_t K,
                                Fp8Scaling how, Fp8ColBlocks blocks, uint64_t *counts) {
    const real *x = x_;
    real *rows = NULL; // (R, K) the rows of x_rows
    if (x_rows) {
        size_t lo = offsets ? (size_t)offsets[0] : 0, hi = offsets ? (size_t)offsets[E] : R;
        rows = moe_calloc(R * K, sizeof(real));
        for (size_t r = lo; r < hi; r++) memcpy(rows + r * K, x + (size_t)x_rows[r] * K, K * sizeof(real));
    }
    if (q) cpu_fp8_quantize_rows(q, scales, rows ? rows : x, offsets, E, R, K, how, counts);
    if (qt) cpu_fp8_quantize_cols(qt, scales_t, rows ? rows : x, offsets, E, R, K, how, blocks, counts);
    free(rows);
}

// The ops one after the other (the oracle of the fused kernel), the gradients (and hw) in scratch.
void cpu_swiglu_backward_fp8(void *q, void *scales, void *qt, void *scales_t, void *row_dot, void *hwt, void *hw_scales,
                             const void *dout, const void *gu, const void *row_w, const int32_t *offsets, size_t E,
                             size_t R, size_t H, Fp8Scaling how, Fp8ColBlocks hw_blocks, uint64_t *grads,
                             uint64_t *acts) {
    real *dgu = moe_malloc(R * 2 * H * sizeof(real)), *hw = row_dot ? moe_malloc(R * H * sizeof(real)) : NULL;
    cpu_swiglu_backward(dgu, row_dot, hw, dout, gu, row_w, R, H, offsets, E);
    cpu_fp8_quantize_rows_cols(q, scales, qt, scales_t, dgu, NULL, offsets, E, R, 2 * H, how, FP8_COLS_1X128, grads);
    if (row_dot) cpu_fp8_quantize_cols(hwt, hw_scales, hw, offsets, E, R, H, how, hw_blocks, acts);
    free(dgu), free(hw);
}

// Block (e, nb, kb) of w (E, N, K), its values in flat [lo, hi): their largest magnitude (0: none),
// returned; with q, also their codes under inverse scale inv in q (E, N, K), counted into c.
static float fp8_weight_block(uint8_t *q, const real *w, size_t e, size_t nb, size_t kb, size_t N, size_t K,
                              size_t lo, size_t hi, float inv, uint64_t c[FP8_COUNTS]) {
    float amax = 0;
    for (size_t n = nb * FP8_BLOCK; n < min_size((nb + 1) * FP8_BLOCK, N); n++)
        for (size_t k = kb * FP8_BLOCK; k < min_size((kb + 1) * FP8_BLOCK, K); k++) {
            size_t f = e * N * K + n * K + k;
            if (f < lo || f >= hi) continue;
            amax = fmaxf(amax, fabsf((float)w[f]));
            if (q) fp8_code_counted(&q[f], (float)w[f], inv, c);
        }
    return amax;
}

void cpu_fp8_weights_amax(void *amax_, const void *w_, size_t E, size_t N, size_t K, size_t lo, size_t hi) {
    real *amax = amax_;
    const real *w = w_;
    size_t Nb = fp8_blocks(N), Kb = fp8_blocks(K);
#pragma omp parallel for collapse(2) schedule(static)
    for (size_t e = 0; e < E; e++)
        for (size_t nb = 0; nb < Nb; nb++)
            for (size_t kb = 0; kb < Kb; kb++)
                amax[e * Kb * Nb + kb * Nb + nb] = fp8_weight_block(NULL, w, e, nb, kb, N, K, lo, hi, 0, NULL);
}

void cpu_fp8_quantize_weights_part(void *q_, void *scales_, void *scales_t_, const void *amax_, const void *w_,
                                   size_t E, size_t N, size_t K, size_t lo, size_t hi, Fp8Scaling how,
                                   uint64_t *counts) {
    uint8_t *q = q_;
    real *scales = scales_, *scales_t = scales_t_;
    const real *w = w_, *amax = amax_;
    size_t Nb = fp8_blocks(N), Kb = fp8_blocks(K);
#pragma omp parallel for collapse(2) schedule(static)
    for (size_t e = 0; e < E; e++)
        for (size_t nb = 0; nb < Nb; nb++)
            for (size_t kb = 0; kb < Kb; kb++) {
                float s = fp8_block_scale((float)amax[e * Kb * Nb + kb * Nb + nb], how);
                uint64_t c[FP8_COUNTS] = {0};
                fp8_weight_block(q, w, e, nb, kb, N, K, lo, hi, fp8_scale_inverse(s), c);
                fp8_add_counts(counts, c);
                scales[e * Kb * Nb + kb * Nb + nb] = s;
                scales_t[e * Nb * Kb + nb * Kb + kb] = s;
            }
}

// The whole tensor as one part.
void cpu_fp8_quantize_weights(void *q, void *scales, void *scales_t, const void *w, size_t E, size_t N, size_t K,
                              Fp8Scaling how, uint64_t *counts) {
    real *amax = moe_malloc(E * fp8_blocks(N) * fp8_blocks(K) * sizeof(real));
    cpu_fp8_weights_amax(amax, w, E, N, K, 0, E * N * K);
    cpu_fp8_quantize_weights_part(q, scales, scales_t, amax, w, E, N, K, 0, E * N * K, how, counts);
    free(amax);
}

void cpu_fp8_transpose_codes(void *qt_, const void *q_, size_t E, size_t N, size_t K) {
    uint8_t *qt = qt_;
    const uint8_t *q = q_;
#pragma omp parallel for collapse(2) schedule(static)
    for (size_t e = 0; e < E; e++)
        for (size_t k = 0; k < K; k++)
            for (size_t n = 0; n < N; n++) qt[e * K * N + k * N + n] = q[e * N * K + n * K + k];
}

void cpu_fp8_regroup_scales(void *out_, const void *in_, const int32_t *offsets, size_t E, size_t R, size_t Kb,
                            size_t pitch, bool to_rows) {
    real *out = out_;
    const real *in = in_;
    for (size_t g = 0; g < E; g++) {
        size_t r0, rows;
        fp8_group(offsets, g, R, &r0, &rows);
        for (size_t i = 0; i < rows; i++)
            for (size_t kb = 0; kb < Kb; kb++) {
                size_t grouped = fp8_row_scale_index(Kb, r0, rows, i, kb), row_major = (r0 + i) * pitch + kb;
                if (to_rows) out[row_major] = in[grouped];
                else out[grouped] = in[row_major];
            }
    }
}

void cpu_fp8_dequantize_rows(void *x_, const void *q_, const void *scales_, const int32_t *offsets, size_t E,
                             size_t R, size_t K) {
    real *x = x_;
    const uint8_t *q = q_;
    const real *scales = scales_;
    size_t Kb = fp8_blocks(K);
    for (size_t g = 0; g < E; g++) {
        size_t r0, rows;
        fp8_group(offsets, g, R, &r0, &rows);
#pragma omp parallel for schedule(static)
        for (size_t i = 0; i < rows; i++)
            for (size_t k = 0; k < K; k++) {
                float s = (float)scales[fp8_row_scale_index(Kb, r0, rows, i, k / FP8_BLOCK)];
                x[(r0 + i) * K + k] = (real)(fp8_e4m3_decode(q[(r0 + i) * K + k]) * s);
            }
    }
}

// ---------------------------------------------------------------- products

// One operand as the products read it: row i's codes from q + i ld along the reduction; the scale
// of (row i, reduction block kb) at s[i / rows_per_scale * s_row + kb * s_block].
typedef struct {
    const uint8_t *q;
    size_t ld;
    const real *s;
    size_t rows_per_scale, s_row, s_block;
} Fp8Operand;

static float fp8_scale_of(const Fp8Operand *o, size_t i, size_t kb) {
    return (float)o->s[i / o->rows_per_scale * o->s_row + kb * o->s_block];
}

// out[i ldo + j] (= or +=) sum over k < K of a[i, k] b[j, k] (i < M, j < N), promoted per block.
static void fp8_gemm(real *out, size_t ldo, const Fp8Operand *a, const Fp8Operand *b, size_t M, size_t N,
                     size_t K, bool accumulate) {
    float value[256];
    for (int c = 0; c < 256; c++) value[c] = fp8_e4m3_decode((uint8_t)c);
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < M; i++)
        for (size_t j = 0; j < N; j++) {
            const uint8_t *qa = a->q + i * a->ld, *qb = b->q + j * b->ld;
            float acc = 0;
            for (size_t k0 = 0; k0 < K; k0 += FP8_BLOCK) {
                float part = 0; // exact products of E4M3 values (8 significant bits), summed in fp32
                for (size_t k = k0; k < min_size(k0 + FP8_BLOCK, K); k++) part += value[qa[k]] * value[qb[k]];
                acc += part * (fp8_scale_of(a, i, k0 / FP8_BLOCK) * fp8_scale_of(b, j, k0 / FP8_BLOCK));
            }
            real *o = out + i * ldo + j;
            *o = accumulate ? *o + (real)acc : (real)acc;
        }
}

// The group of `rows` rows from row0 quantised by fp8_quantize_rows, K long.
static Fp8Operand fp8_rows(const void *q, const void *scales, size_t row0, size_t rows, size_t K) {
    return (Fp8Operand){(const uint8_t *)q + row0 * K, K, (const real *)scales + fp8_blocks(K) * row0, 1, 1, rows};
}

// Weights quantised by fp8_quantize_weights: matrix e of (N, K).
static Fp8Operand fp8_weights(const void *q, const void *scales, size_t e, size_t N, size_t K) {
    size_t Nb = fp8_blocks(N);
    return (Fp8Operand){(const uint8_t *)q + e * N * K, K, (const real *)scales + e * fp8_blocks(K) * Nb,
                        FP8_BLOCK, 1, Nb};
}

// Token-major copies of fp8_quantize_cols (C, Rt) in `blocks`: the columns from p (a multiple of 128).
static Fp8Operand fp8_token_major(const void *qt, const void *scales, size_t p, size_t Rt, size_t C,
                                  Fp8ColBlocks blocks) {
    const real *s = (const real *)scales + fp8_col_scale_at(p / FP8_BLOCK, 0, C, blocks);
    return (Fp8Operand){(const uint8_t *)qt + p, Rt, s, fp8_col_block(blocks), 1, fp8_col_scales(C, blocks)};
}

void cpu_fp8_grouped_matmul(void *out, const void *a, const void *a_scales, const void *b, const void *b_scales,
                            const int32_t *offsets, size_t E, size_t N, size_t K, size_t R) {
    for (size_t e = 0; e < E; e++) {
        size_t r0 = (size_t)offsets[e], rows = (size_t)(offsets[e + 1] - offsets[e]);
        Fp8Operand A = fp8_rows(a, a_scales, r0, rows, K), B = fp8_weights(b, b_scales, e, N, K);
        fp8_gemm((real *)out + r0 * N, N, &A, &B, rows, N, K, false);
    }
}

void cpu_fp8_grouped_matmul_wgrad(void *dw, const void *dout_t, const void *dout_scales, const void *x_t,
                                  const void *x_scales, Fp8ColBlocks x_blocks, const int32_t *offsets, size_t E,
                                  size_t N, size_t K, size_t R, bool accumulate) {
    size_t Rt = fp8_expert_cols(R, E);
    for (size_t e = 0; e < E; e++) {
        size_t r0, rows;
        fp8_group(offsets, e, R, &r0, &rows);
        size_t p = fp8_expert_col(r0, e);
        Fp8Operand A = fp8_token_major(dout_t, dout_scales, p, Rt, N, FP8_COLS_1X128);
        Fp8Operand B = fp8_token_major(x_t, x_scales, p, Rt, K, x_blocks);
        fp8_gemm((real *)dw + e * N * K, K, &A, &B, N, K, rows, accumulate); // no rows: + 0, or 0
    }
}

void cpu_fp8_matmul(void *out, const void *a, const void *a_scales, const void *b, const void *b_scales, size_t M,
                    size_t N, size_t K) {
    Fp8Operand A = fp8_rows(a, a_scales, 0, M, K), B = fp8_weights(b, b_scales, 0, N, K);
    fp8_gemm(out, N, &A, &B, M, N, K, false);
}

// The FP8 recipe emulated on the CPU (ops/fp8.h, docs/FP8.md): quantisation to E4M3 codes with
// fp32 block scales, bit for bit as the CUDA kernels do it, and the products as Hopper runs them:
// per 128-long block of the reduction, the exact products of two E4M3 values summed in fp32, times
// the two blocks' scales, added to an fp32 accumulator. The oracle of every FP8 CUDA kernel.
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "cpu_gemm.h"
#include "cpu_ops.h"

// ---------------------------------------------------------------- quantisation

// The codes of v[i] (i < n) under inverse scale inv into q[i], counted into c (FP8_COUNTS). One
// loop without branches or aliasing, which the compiler vectorises.
static void fp8_codes_counted(uint8_t *restrict q, const float *restrict v, size_t n, float inv,
                              uint64_t c[FP8_COUNTS]) {
    uint64_t flushed = 0, saturated = 0, nan = 0;
    for (size_t i = 0; i < n; i++) {
        uint8_t code = q[i] = fp8_quantize(v[i], inv);
        flushed += fp8_flushed(v[i], code);
        saturated += fp8_saturated(v[i], inv);
        nan += v[i] != v[i];
    }
    c[FP8_COUNT_VALUES] += n, c[FP8_COUNT_FLUSHED] += flushed, c[FP8_COUNT_SATURATED] += saturated;
    c[FP8_COUNT_NAN] += nan;
}

// c (FP8_COUNTS) added to counts (NULL: nothing), atomically (threads add theirs at the same time).
static void fp8_add_counts(uint64_t *counts, const uint64_t c[FP8_COUNTS]) {
    for (int i = 0; counts && i < FP8_COUNTS; i++) {
#pragma omp atomic
        counts[i] += c[i];
    }
}

// Largest magnitudes (NaN ignored, as fmaxf ignores it) are taken on the magnitudes' bits, whose
// order as integers is theirs as floats, so that the loops vectorise: the larger of amax (such
// bits) and |x|'s bits (0 for NaN); fp8_bits_float gives the largest magnitude back.
static inline uint32_t fp8_amax_bits(uint32_t amax, float x) {
    uint32_t b = fp8_float_bits(x) & 0x7fffffffu;
    b &= -(uint32_t)(b <= 0x7f800000u); // a mask, not a select: GCC 12 vectorises only this
    return b > amax ? b : amax;
}

// A block of at most FP8_BLOCK x FP8_BLOCK values to codes under one scale, returned: `lines`
// lines of `len` values, x[l x_line + i x_step] to q[l q_line + i] (i < len); what it counts added
// to n (FP8_COUNTS, a thread's own: the callers add them up once a thread). The values are gathered
// first, so that the codes of a line are one contiguous run whatever x's layout.
static float fp8_quantize_block(uint8_t *q, size_t q_line, const real *x, size_t x_line, size_t x_step,
                                size_t lines, size_t len, Fp8Scaling how, uint64_t n[FP8_COUNTS]) {
    float v[FP8_BLOCK * FP8_BLOCK]; // (lines, len)
    for (size_t l = 0; l < lines; l++)
        for (size_t i = 0; i < len; i++) v[l * len + i] = (float)x[l * x_line + i * x_step];
    uint32_t amax = 0;
    for (size_t j = 0; j < lines * len; j++) amax = fp8_amax_bits(amax, v[j]);
    float s = fp8_block_scale(fp8_bits_float(amax), how), inv = fp8_scale_inverse(s);
    for (size_t l = 0; l < lines; l++) fp8_codes_counted(q + l * q_line, v + l * len, len, inv, n);
    return s;
}

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
#pragma omp parallel
    {
        uint64_t n[FP8_COUNTS] = {0};
        for (size_t g = 0; g < (offsets ? E : 1); g++) {
            size_t r0, rows;
            fp8_group(offsets, g, R, &r0, &rows);
#pragma omp for schedule(static)
            for (size_t i = 0; i < rows; i++)
                for (size_t kb = 0; kb < Kb; kb++) {
                    size_t at = (r0 + i) * K + kb * FP8_BLOCK;
                    scales[fp8_row_scale_index(Kb, r0, rows, i, kb)] = fp8_quantize_block(
                        q + at, 0, x + at, 0, 1, 1, size_min(FP8_BLOCK, K - kb * FP8_BLOCK), how, n);
                }
        }
        fp8_add_counts(counts, n);
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
#pragma omp parallel
    {
        uint64_t n[FP8_COUNTS] = {0};
        for (size_t e = 0; e < E; e++) {
            size_t r0, rows;
            fp8_group(offsets, e, R, &r0, &rows);
            size_t p = fp8_expert_col(r0, e);
#pragma omp for schedule(static)
            for (size_t cb = 0; cb < Cs; cb++)
                for (size_t j = 0; j < fp8_blocks(rows); j++) {
                    size_t r = j * FP8_BLOCK, c = cb * width;
                    scales[fp8_col_scale_at(p / FP8_BLOCK + j, c, C, blocks)] =
                        fp8_quantize_block(qt + c * Rt + p + r, Rt, x + (r0 + r) * C + c, 1, C,
                                           size_min(width, C - c), size_min(FP8_BLOCK, rows - r), how, n);
                }
        }
        fp8_add_counts(counts, n);
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
// returned; with q, also their codes under inverse scale inv in q (E, N, K), counted into c. A line
// of the block at a time, its values in [lo, hi) one contiguous run.
static float fp8_weight_block(uint8_t *q, const real *w, size_t e, size_t nb, size_t kb, size_t N, size_t K,
                              size_t lo, size_t hi, float inv, uint64_t c[FP8_COUNTS]) {
    uint32_t amax = 0;
    size_t k0 = kb * FP8_BLOCK, k1 = size_min(k0 + FP8_BLOCK, K);
    for (size_t n = nb * FP8_BLOCK; n < size_min((nb + 1) * FP8_BLOCK, N); n++) {
        size_t line = (e * N + n) * K, f0 = size_max(line + k0, lo), f1 = size_min(line + k1, hi);
        if (f0 >= f1) continue;
        float v[FP8_BLOCK];
        for (size_t f = f0; f < f1; f++) v[f - f0] = (float)w[f];
        for (size_t i = 0; i < f1 - f0; i++) amax = fp8_amax_bits(amax, v[i]);
        if (q) fp8_codes_counted(q + f0, v, f1 - f0, inv, c);
    }
    return fp8_bits_float(amax);
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

// The products run on decoded copies of the operands: E4M3 codes are exact in fp32, so each term
// is the same product of two floats, and a tile of FP8_MR x FP8_NR outputs (cpu_gemm's register
// tile, in fp32 lanes) sums its terms in vector lanes along the output columns, each output in K
// order from zero as one scalar loop would (the same bits for any tile shape or thread count).
// Reading each code through the decode table in that scalar loop took 90% of the default small
// model's fp8 step on the CPU.
#define FP8_NR (2 * CPU_VEC_BYTES / sizeof(float))
#define FP8_MR CPU_GEMM_MR

static void fp8_decode_line(float *restrict v, const uint8_t *restrict q, size_t n) {
    for (size_t i = 0; i < n; i++) v[i] = fp8_e4m3_decode(q[i]);
}

// o's first `rows` rows decoded and their scales spread out, padded to `padded` rows (values 0,
// scales 1). As the tiles' rows (`panels` false): values (padded, K) and scales (padded, Kb). As
// their columns (`panels` true): values in panels of FP8_NR rows, row i's value k at
// (i / FP8_NR) K FP8_NR + k FP8_NR + i % FP8_NR, so that a tile reads FP8_NR consecutive values a
// K step, and scales (Kb, padded). A row is decoded in one vectorised loop into `line` (K), then
// copied to its panel.
static void fp8_decode_operand(float *values, float *scales, const Fp8Operand *o, size_t rows, size_t padded,
                               size_t K, bool panels) {
    size_t Kb = fp8_blocks(K);
#pragma omp parallel
    {
        float *line = panels ? moe_malloc(K * sizeof(float)) : NULL;
#pragma omp for schedule(static)
        for (size_t i = 0; i < padded; i++) {
            float *v = panels ? line : values + i * K;
            if (i < rows) fp8_decode_line(v, o->q + i * o->ld, K);
            else memset(v, 0, K * sizeof(float));
            if (panels)
                for (size_t k = 0; k < K; k++) values[i / FP8_NR * K * FP8_NR + k * FP8_NR + i % FP8_NR] = line[k];
            for (size_t kb = 0; kb < Kb; kb++)
                scales[panels ? kb * padded + i : i * Kb + kb] = i < rows ? fp8_scale_of(o, i, kb) : 1.0f;
        }
        free(line);
    }
}

// tile (FP8_MR x FP8_NR) = the sums over kc steps k of a[i rs + k ds] b[k FP8_NR + j], each from
// zero in k order: cpu_gemm's micro-kernel in fp32 (the products of E4M3 values are exact).
CPU_GEMM_DEFINE_KERNEL(fp8_block_sums, float)

// The outputs [i0, + FP8_MR) x [j0, + FP8_NR) of fp8_gemm from the decoded operands (a (Mp, K),
// sa (Mp, Kb); b in panels, sb (Kb, Np)), those below M and N written.
static void fp8_gemm_tile(real *out, size_t ldo, const float *a, const float *sa, const float *b, const float *sb,
                          size_t i0, size_t j0, size_t M, size_t N, size_t Np, size_t K, bool accumulate) {
    size_t Kb = fp8_blocks(K);
    const float *panel = b + j0 * K; // (K, FP8_NR)
    float acc[FP8_MR][FP8_NR] = {{0}}, part[FP8_MR][FP8_NR];
    for (size_t kb = 0; kb < Kb; kb++) {
        size_t k0 = kb * FP8_BLOCK;
        fp8_block_sums(size_min(FP8_BLOCK, K - k0), a + i0 * K + k0, K, 1, panel + k0 * FP8_NR, part[0]);
        for (size_t r = 0; r < FP8_MR; r++) {
            float s = sa[(i0 + r) * Kb + kb];
            for (size_t c = 0; c < FP8_NR; c++) acc[r][c] = fmaf(part[r][c], s * sb[kb * Np + j0 + c], acc[r][c]);
        }
    }
    for (size_t r = 0; r < size_min(FP8_MR, M - i0); r++)
        for (size_t c = 0; c < size_min(FP8_NR, N - j0); c++) {
            real *o = out + (i0 + r) * ldo + j0 + c;
            *o = accumulate ? *o + (real)acc[r][c] : (real)acc[r][c];
        }
}

// out[i ldo + j] (= or +=) sum over k < K of a[i, k] b[j, k] (i < M, j < N), promoted per block:
// each block's fp32 sum times the two blocks' scales, added to an fp32 accumulator with one fma.
static void fp8_gemm(real *out, size_t ldo, const Fp8Operand *a, const Fp8Operand *b, size_t M, size_t N,
                     size_t K, bool accumulate) {
    size_t Mp = size_round_up(M, FP8_MR), Np = size_round_up(N, FP8_NR), Kb = fp8_blocks(K);
    float *av = moe_malloc(Mp * K * sizeof(float)), *sa = moe_malloc(Mp * Kb * sizeof(float)); // (Mp, K), (Mp, Kb)
    float *bp = moe_malloc(Np * K * sizeof(float)), *sb = moe_malloc(Kb * Np * sizeof(float)); // panels, (Kb, Np)
    fp8_decode_operand(av, sa, a, M, Mp, K, false);
    fp8_decode_operand(bp, sb, b, N, Np, K, true);
#pragma omp parallel for collapse(2) schedule(static)
    for (size_t i0 = 0; i0 < Mp; i0 += FP8_MR)
        for (size_t j0 = 0; j0 < Np; j0 += FP8_NR)
            fp8_gemm_tile(out, ldo, av, sa, bp, sb, i0, j0, M, N, Np, K, accumulate);
    free(av), free(sa), free(bp), free(sb);
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

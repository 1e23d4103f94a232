// The FP8 training recipe (DeepSeek-V3, docs/FP8.md), shared by the CPU emulation and the CUDA
// kernels so both quantise to the same bits: E4M3 rounding (nearest, ties to even, saturating at
// +-448, NaN kept), the scale of a block from its largest magnitude, and the block geometry (1x128
// blocks of activations along the reduction dimension, 128x128 blocks of weights, fp32 partial
// sums promoted every 128 along the reduction). Header-only and free of libc calls but frexpf,
// ldexpf and rintf, so CUDA code can include it; device code on sm_89 and later converts with the
// hardware's saturating E4M3 conversion, which gives the same codes (build/test_cuda compares the
// two on every fp32 input).
#pragma once
#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#ifdef __CUDACC__
#include <cuda_fp8.h>
#endif

#ifdef __CUDACC__
#define FP8_FN static inline __host__ __device__
#else
#define FP8_FN static inline
#endif

#define FP8_E4M3_MAX 448.0f // largest finite E4M3 value (1.75 x 2^8)
#define FP8_E4M3_NAN 0x7f   // the code conversions give NaN (S.1111.111 is E4M3's only NaN)
#define FP8_BLOCK 128       // block edge: scales and accumulator promotion every FP8_BLOCK along K

// How a block's scale is chosen from its largest magnitude amax: amax / 448 (AMAX), or the power of
// two at or above it (POW2: scaling is exact, dequantisation a shift of the exponent).
typedef enum { FP8_SCALE_AMAX, FP8_SCALE_POW2 } Fp8Scaling;

FP8_FN uint32_t fp8_float_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

// The float whose bits are u (fp8_float_bits's inverse).
FP8_FN float fp8_bits_float(uint32_t u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}

// E4M3 (the "fn" variant: no infinities, one NaN per sign) nearest to x, ties to the even code;
// magnitudes past 448 (infinities too) saturate to +-448, NaN gives FP8_E4M3_NAN. In integer
// operations (the CPU's conversion, and the oracle of the GPU's), without branches, so that a loop
// of them vectorises: both the subnormal code and the normal one are computed and one is chosen.
FP8_FN uint8_t fp8_e4m3_encode_exact(float x) {
    uint32_t u = fp8_float_bits(x), b = u & 0x7fffffffu; // b: |x|'s bits
    float a = fabsf(x);
    float small = a < 0x1p-6f ? a : 0x1p-6f; // in range for the conversion whatever x is (NaN too)
    uint32_t sub = (uint32_t)rintf(small * 0x1p9f); // below 2^-6: multiples of 2^-9 (8: 2^-6)
    uint32_t r = b + 0x7ffffu + ((b >> 20) & 1u); // the 23-bit mantissa rounded to 3 bits, ties to even
    uint32_t normal = ((r >> 23) - 120u) << 3 | ((r >> 20) & 7u); // exponent rebiased from 127 to 7
    uint32_t saturates = (normal > 0x7eu) | (b >= 0x7f800000u); // past 448, or infinite
    uint32_t code = a < 0x1p-6f ? sub : saturates ? 0x7eu : normal;
    return a != a ? (uint8_t)FP8_E4M3_NAN : (uint8_t)((u >> 24 & 0x80u) | code);
}

// fp8_e4m3_encode_exact's code of x; on sm_89 and later one cvt.rn.satfinite.e4m3x2.f32.
FP8_FN uint8_t fp8_e4m3_encode(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    return (uint8_t)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
#else
    return fp8_e4m3_encode_exact(x);
#endif
}

// The codes of a and b as they lie in memory, a's first; on sm_89 and later one conversion for both.
FP8_FN uint16_t fp8_e4m3_encode2(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    return (uint16_t)__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
#else
    return (uint16_t)(fp8_e4m3_encode(a) | fp8_e4m3_encode(b) << 8);
#endif
}

// The value of E4M3 code c, in integer operations and masks (no branches, calls or selects), so that
// a loop of them vectorises: a normal code's bits are a float's with the exponent rebiased from 7 to
// 127, a subnormal's value is its mantissa times 2^-9, and the sign bit moves from bit 7 to bit 31.
FP8_FN float fp8_e4m3_decode(uint8_t c) {
    uint32_t mag = c & 0x7fu, subnormal = -(uint32_t)(mag < 8), nan = -(uint32_t)(mag == 0x7fu);
    uint32_t bits = (fp8_float_bits((float)(mag & 7u) * 0x1p-9f) & subnormal) | (((mag << 20) + (120u << 23)) & ~subnormal);
    return fp8_bits_float((bits & ~nan) | (0x7fc00000u & nan) | (uint32_t)(c & 0x80u) << 24);
}

// amax / FP8_E4M3_MAX as IEEE division rounds it wherever the quotient is a normal float. On the
// GPU: the product by the rounded reciprocal and one FMA's correction (3 instructions, against the
// division's ~10 and its slow-path branch); below 2^-126 it may differ from the division, where
// fp8_scale_of_quotient raises both to 2^-126 (or both give 0). build/test_cuda checks every amax.
FP8_FN float fp8_amax_quotient(float amax) {
#ifdef __CUDA_ARCH__
    const float r = 1.0f / FP8_E4M3_MAX;
    float q = amax * r, e = fmaf(-q, FP8_E4M3_MAX, amax);
    return e != e ? q : fmaf(e, r, q); // an infinite or NaN amax: the product's
#else
    return amax / FP8_E4M3_MAX;
#endif
}

// fp8_block_scale from the quotient s = amax / FP8_E4M3_MAX.
FP8_FN float fp8_scale_of_quotient(float s, Fp8Scaling how) {
    if (!(s > 0)) return s != s ? s : 1.0f;
    if (s < 0x1p-126f) return 0x1p-126f;
    if (how == FP8_SCALE_AMAX || s == INFINITY) return s;
    int e;
    float m = frexpf(s, &e); // s = m 2^e, m in [0.5, 1)
    return ldexpf(1.0f, m == 0.5f ? e - 1 : e);
}

// The scale of a block whose largest magnitude is amax: values are stored as e4m3(x inv), inv =
// fp8_scale_inverse(scale), one division a block and a product a value, and read as e4m3 x scale.
// An all-zero block (or one so small that amax / 448 is 0) gets scale 1, so its codes are zeros; a
// scale below the smallest normal float is raised to it, so that its inverse is finite (a block of
// amax below 448 x 2^-126, smaller than any value training meets, then uses less of E4M3's range);
// a block holding an infinity gets an infinite scale (either scaling: frexpf of an infinity leaves
// its exponent unspecified), whose inverse 0 codes its finite values 0 and its infinities NaN.
FP8_FN float fp8_block_scale(float amax, Fp8Scaling how) { return fp8_scale_of_quotient(fp8_amax_quotient(amax), how); }

// What values of a block of scale s are multiplied by before rounding to E4M3 (finite for every
// scale fp8_block_scale gives but an infinite one, whose inverse is 0).
FP8_FN float fp8_scale_inverse(float s) { return 1.0f / s; }

FP8_FN uint8_t fp8_quantize(float x, float inv) { return fp8_e4m3_encode(x * inv); }

// What quantisation counts (docs/FP8.md, "Overflow and underflow"): per tensor class, u64 counters
// in backend memory, FP8_COUNTS of them a class, that the quantisation ops add to. VALUES: the
// values quantised; FLUSHED: nonzero finite values whose code is +-0 (fp8_flushed); SATURATED:
// values past E4M3's range once scaled (fp8_saturated); NAN: NaN values (their code is NaN).
typedef enum { FP8_COUNT_VALUES, FP8_COUNT_FLUSHED, FP8_COUNT_SATURATED, FP8_COUNT_NAN, FP8_COUNTS } Fp8Count;
typedef enum { FP8_CLASS_WEIGHTS, FP8_CLASS_ACTIVATIONS, FP8_CLASS_GRADIENTS, FP8_CLASSES } Fp8Class;

// Scaled magnitudes past this one have no E4M3 code as their nearest rounding (that would be 480,
// past the largest, 448): their code +-448 is a saturation. Up to it, +-448 is the nearest code.
#define FP8_E4M3_SATURATE 464.0f

// x, nonzero, got code c of +-0: flushed to zero. (No non-finite x gets code 0: NaN codes NaN, an
// infinity +-448, or NaN under an infinite scale.)
FP8_FN bool fp8_flushed(float x, uint8_t c) { return (x != 0) & ((c & 0x7f) == 0); }

// x quantised under a scale of inverse inv (fp8_scale_inverse) saturates: an infinity, or a
// magnitude past FP8_E4M3_SATURATE once scaled. Scales from the block's amax keep finite values at
// 448 and below (up to the roundings of the inverse and the product), so in practice saturation
// flags infinities.
FP8_FN bool fp8_saturated(float x, float inv) { return (fabsf(x) == INFINITY) | (fabsf(x * inv) > FP8_E4M3_SATURATE); }

// Whether a block of largest finite magnitude amax (an infinity: INFINITY) can hold saturated values
// under a scale of inverse inv: the product rounds monotonically, so none can when amax cannot.
FP8_FN bool fp8_block_may_saturate(float amax, float inv) { return !(amax * inv <= FP8_E4M3_SATURATE); }

// Blocks along a dimension of n elements (the last one may be short).
FP8_FN size_t fp8_blocks(size_t n) { return (n + FP8_BLOCK - 1) / FP8_BLOCK; }

// Where the scale of block kb of row r0 + i lies in the scales fp8_quantize_rows writes for a group
// of `rows` rows from r0, Kb blocks wide: each group's scales are block-major (Kb, rows), after
// those of the rows before it.
FP8_FN size_t fp8_row_scale_index(size_t Kb, size_t r0, size_t rows, size_t i, size_t kb) {
    return Kb * r0 + kb * rows + i;
}

// Token-major (transposed) copies of grouped rows, for the weight gradient, whose reduction runs
// over each expert's rows: expert e's rows start at column fp8_expert_col(offsets[e], e), a
// multiple of 128, so that its scale blocks start with its first row and every expert's columns
// start 16-byte aligned; experts never overlap (each starts at least 128 x ceil(rows / 128)
// columns after the one before). R rows over E experts fit in fp8_expert_cols(R, E) columns.
FP8_FN size_t fp8_expert_col(size_t offset, size_t e) { return FP8_BLOCK * (offset / FP8_BLOCK + e); }
FP8_FN size_t fp8_expert_cols(size_t R, size_t E) { return FP8_BLOCK * (fp8_blocks(R) + E); }

// The scale blocks of a token-major copy (qt (C, Rt), 128 tokens a block along Rt): FP8_COLS_1X128,
// a scale per column and 128 tokens (scales (Rt / 128, C): the recipe's activations and gradients);
// FP8_COLS_128X128, a scale per 128 columns and 128 tokens, as the weights' blocks (scales (Rt /
// 128, fp8_blocks(C))). The weight gradients read their inputs' copies (the activations x) in
// 128x128 blocks unless train.fp8_wgrad_blocks is false: each promotion of such a product then
// scales a row of partial sums by one number, as the forward's do (docs/FP8.md).
typedef enum { FP8_COLS_1X128, FP8_COLS_128X128 } Fp8ColBlocks;

// Columns of a token-major copy in `blocks` that share a scale: 128 or 1.
FP8_FN size_t fp8_col_block(Fp8ColBlocks blocks) { return blocks == FP8_COLS_128X128 ? FP8_BLOCK : 1; }

// Scales a row of token-major blocks holds: a copy C columns wide in `blocks`.
FP8_FN size_t fp8_col_scales(size_t C, Fp8ColBlocks blocks) {
    return (C + fp8_col_block(blocks) - 1) / fp8_col_block(blocks);
}

// Where the scale of columns [c, ...) of token-major block b (tokens [128 b, + 128)) lies in the
// scales of a copy C columns wide in `blocks` (c a multiple of fp8_col_block(blocks)).
FP8_FN size_t fp8_col_scale_at(size_t b, size_t c, size_t C, Fp8ColBlocks blocks) {
    return b * fp8_col_scales(C, blocks) + c / fp8_col_block(blocks);
}

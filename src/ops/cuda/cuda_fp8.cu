// FP8 quantisation on the GPU (the recipe of ops/fp8.h, bit for bit as the CPU emulation does it):
// bf16 rows in 1x128 blocks (alone, or fused with the SwiGLU that produces them), the token-major
// per-expert copies the weight gradient reads (alone, or with the rows of the same tensor from one
// read of it), weights in 128x128 blocks with their transpose; and the dense FP8 product, run as a
// grouped one of one group (cuda_grouped_sm90_fp8.cu).
#include "cuda_common.cuh"
#include "cuda_mma.cuh"
#include "cuda_ops.h"

// The group of row r among offsets (E + 1) i32 (NULL: one group of R rows): its first row and its
// row count; false for rows of no group (before the first, as in a chunk of experts, or past the last).
__device__ bool fp8_row_group(const int32_t *offsets, int E, int R, int r, int *r0, int *rows) {
    if (!offsets) {
        *r0 = 0, *rows = R;
        return true;
    }
    if (r < offsets[0] || r >= offsets[E]) return false;
    int lo = 0, hi = E - 1; // the last group starting at or before r (empty groups start there too)
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (offsets[mid] <= r) lo = mid;
        else hi = mid - 1;
    }
    *r0 = offsets[lo], *rows = offsets[lo + 1] - offsets[lo];
    return true;
}

// Bit 7 of each byte of a word of codes: the code's magnitude is 0 (+-0: ~((m + 0x7f) | m) with m
// the magnitude; no carry leaves a byte, as m < 0x80), or 0x7f (NaN: m + 1).
__device__ __forceinline__ uint32_t fp8_codes_zero(uint32_t word) {
    uint32_t m = word & 0x7f7f7f7fu;
    return ~((m + 0x7f7f7f7fu) | m) & 0x80808080u;
}
__device__ __forceinline__ uint32_t fp8_codes_nan(uint32_t word) {
    return ((word & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u;
}

// Whether any of the n codes packed in words is +-0 or NaN. About 10 instructions for 8 codes.
template <int n>
__device__ __forceinline__ bool fp8_codes_zero_or_nan(const uint32_t *words) {
    uint32_t flags = 0;
#pragma unroll
    for (int i = 0; i < n / 4; i++) flags |= fp8_codes_zero(words[i]) | fp8_codes_nan(words[i]);
    return flags;
}

// Magnitudes of packed bf16 pairs: the sign bits cleared.
__device__ __forceinline__ uint4 fp8_piece_abs(uint4 u) {
    return make_uint4(u.x & 0x7fff7fffu, u.y & 0x7fff7fffu, u.z & 0x7fff7fffu, u.w & 0x7fff7fffu);
}

// Bit 7 of byte i % 4 of word i / 4: value i of a piece (packed bf16) is not +-0 (bit 15 of each
// half of magnitude + 0x7fff; no carry leaves a half), lined up with the piece's code bytes.
__device__ __forceinline__ uint2 fp8_piece_nonzero(uint4 piece) {
    uint4 a = fp8_piece_abs(piece);
    uint32_t w[4] = {a.x + 0x7fff7fffu, a.y + 0x7fff7fffu, a.z + 0x7fff7fffu, a.w + 0x7fff7fffu};
    return make_uint2(__byte_perm(w[0], w[1], 0x7531), __byte_perm(w[2], w[3], 0x7531));
}

// What a piece (8 bf16 values, packed) quantised to codes flushes and holds as NaN, as flushed |
// NaN << 16, where none of its values may saturate (fp8_block_may_saturate false for their blocks):
// then the block holds no infinity (its scale is finite), so a NaN code is exactly a NaN value, and a
// flushed value is a nonzero one whose code is +-0 (fp8_flushed): bit masks and population counts,
// the sums of fp8_count_values_of's value by value. Only a piece with a zero or NaN code can add
// any (fp8_codes_zero_or_nan, the cheaper test, comes first).
__device__ __forceinline__ uint32_t fp8_piece_counts(uint4 piece, uint2 codes) {
    uint2 nz = fp8_piece_nonzero(piece);
    const uint32_t words[2] = {codes.x, codes.y}, nonzero[2] = {nz.x, nz.y};
    uint32_t flushed = 0, nan = 0;
#pragma unroll
    for (int i = 0; i < 2; i++)
        flushed += __popc(fp8_codes_zero(words[i]) & nonzero[i]), nan += __popc(fp8_codes_nan(words[i]));
    return flushed | nan << 16;
}

// A warp's sums of fp8_piece_counts (each lane's, packed: at most 65,535 a warp) added to counts, by
// the whole warp.
__device__ __forceinline__ void fp8_add_piece_counts(uint64_t *counts, uint32_t packed) {
    uint32_t sum = __reduce_add_sync(0xffffffffu, packed);
    if ((threadIdx.x & 31) || !sum) return;
    if (sum & 0xffffu) atomicAdd((unsigned long long *)&counts[FP8_COUNT_FLUSHED], (unsigned long long)(sum & 0xffffu));
    if (sum >> 16) atomicAdd((unsigned long long *)&counts[FP8_COUNT_NAN], (unsigned long long)(sum >> 16));
}

// A piece quantised (its values packed in piece, its codes) sorted for the counters (counts NULL:
// none): where a value may saturate (sat), bit into flagged, for the value-by-value path after the
// kernel's loop; else its fp8_piece_counts added to packed where its codes hold a zero or NaN (the
// one packed test first).
__device__ __forceinline__ void fp8_piece_counts_or_flag(const uint64_t *counts, uint4 piece, uint2 codes, bool sat,
                                                         uint32_t bit, uint32_t *flagged, uint32_t *packed) {
    const uint32_t words[2] = {codes.x, codes.y};
    if (counts && sat) *flagged |= bit;
    else if (counts && fp8_codes_zero_or_nan<8>(words)) *packed += fp8_piece_counts(piece, codes);
}

// What the first `valid` (up to n) values of a piece, value(i) (as quantised) with their codes q as
// stored, flush, saturate and hold as NaN under a scale of inverse inv (col: column i's inverse
// col[i] instead),
// added to counts; bit i of sat: value i may saturate (fp8_block_may_saturate of a bound of its
// magnitude), fp8_saturated evaluated for those only. The lanes of the warp that got here add their
// sums with one atomic per counter.
template <int n, typename Value>
__device__ __forceinline__ void fp8_count_values_of(uint64_t *counts, Value value, const uint8_t *q, int valid,
                                                    float inv, const float *col, uint32_t sat) {
    uint32_t c[3] = {0, 0, 0}; // flushed, saturated, NaN
    for (int i = 0; i < n && i < valid; i++) {
        float v = value(i);
        c[0] += fp8_flushed(v, q[i]);
        c[1] += ((sat >> i) & 1) && fp8_saturated(v, col ? col[i] : inv);
        c[2] += v != v;
    }
    const int at[3] = {FP8_COUNT_FLUSHED, FP8_COUNT_SATURATED, FP8_COUNT_NAN};
    uint32_t lanes = __activemask(), first = __ffs(lanes) - 1;
    for (int i = 0; i < 3; i++) {
        uint32_t sum = __reduce_add_sync(lanes, c[i]);
        if (sum && (threadIdx.x & 31) == first) atomicAdd((unsigned long long *)&counts[at[i]], (unsigned long long)sum);
    }
}

// The rare path of fp8_count, the values read again from x: it reloads what it reads (from L1 or
// L2, just read or written by this thread), so that the kernels' registers stay those of the
// quantisation alone.
template <int n>
__device__ __noinline__ void fp8_count_piece(uint64_t *counts, const bf16 *x, const uint8_t *q, int valid, float inv,
                                             const float *col, uint32_t sat) {
    if (valid <= 0) return;
    fp8_count_values_of<n>(counts, [=](int i) { return bf(x[i]); }, q, valid, inv, col, sat);
}

// The same for a piece of a SwiGLU's output, recomputed from its gate values g (the up values H
// further on) as swiglu_forward_fp8_kernel rounds it, so that the output need not be stored.
template <int n>
__device__ __noinline__ void fp8_count_swiglu_piece(uint64_t *counts, const bf16 *g, int H, const uint8_t *q,
                                                    int valid, float inv, uint32_t sat) {
    fp8_count_values_of<n>(counts, [=](int i) { return bf(to_bf(swiglu_value(bf(g[i]), bf(g[i + H])))); }, q, valid,
                           inv, NULL, sat);
}

// Whether a piece (its codes packed in words, sat as fp8_count_piece's) takes the rare path: a
// flushed or NaN value has a code of magnitude 0 or 0x7f, so a piece without such a code or a value
// that may saturate (nearly every piece) costs this one packed test.
template <int n>
__device__ __forceinline__ bool fp8_needs_count(const uint32_t *words, uint32_t sat) {
    return sat || fp8_codes_zero_or_nan<n>(words);
}

// Adds to counts (NULL: nothing) what a piece of n values quantised to the codes packed in words
// (4 a word) flushes, saturates and holds as NaN (FP8_COUNT_VALUES aside: fp8_count_values); the
// rest as fp8_count_piece, which runs only where fp8_needs_count.
template <int n>
__device__ __forceinline__ void fp8_count(uint64_t *counts, const uint32_t *words, uint32_t sat, const bf16 *x,
                                          const uint8_t *q, int valid, float inv, const float *col) {
    if (counts && fp8_needs_count<n>(words, sat)) fp8_count_piece<n>(counts, x, q, valid, inv, col, sat);
}

// The values a launch quantises (the rows of the groups of offsets, as fp8_row_group, times width),
// added to counts by its first thread.
__device__ void fp8_count_values(uint64_t *counts, const int32_t *offsets, int E, int64_t R, int64_t width) {
    if (!counts || blockIdx.x || blockIdx.y || blockIdx.z || threadIdx.x) return;
    int64_t rows = offsets ? offsets[E] - offsets[0] : R;
    atomicAdd((unsigned long long *)&counts[FP8_COUNT_VALUES], (unsigned long long)(rows * width));
}

// sat for fp8_count: all n values of a block of largest magnitude amax and scale inverse inv may
// saturate, or none.
__device__ __forceinline__ uint32_t fp8_may_saturate_all(float amax, float inv) {
    return fp8_block_may_saturate(amax, inv) ? 0xffffffffu : 0u;
}

static bool aligned16(const void *p) { return (uintptr_t)p % 16 == 0; }

// 8 values of a row from p as packed bf16 (values [from, n) read, the rest 0): one 16-byte load
// (vec: the piece whole or wholly outside, and aligned) or value by value.
__device__ __forceinline__ uint4 fp8_load_piece(const bf16 *p, int n, bool vec, int from = 0) {
    if (vec) return n > from ? *reinterpret_cast<const uint4 *>(p) : make_uint4(0, 0, 0, 0);
    uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
    for (int i = 0; i < 8; i++)
        if (i >= from && i < n) w[i / 2] |= (uint32_t)__bfloat16_as_ushort(p[i]) << (16 * (i % 2));
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// The first n (up to 8) values of a piece of packed bf16 (pack8) to p: one 16-byte store (vec, n 8)
// or value by value.
__device__ __forceinline__ void fp8_store_piece(bf16 *p, uint4 piece, int n, bool vec) {
    if (vec && n >= 8) *reinterpret_cast<uint4 *>(p) = piece;
    else
#pragma unroll
        for (int i = 0; i < 8; i++)
            if (i < n) p[i] = __ushort_as_bfloat16((uint16_t)((&piece.x)[i / 2] >> (16 * (i % 2))));
}

// The larger of each pair of two packed bf16 pairs (one instruction for two values; a NaN loses to a
// number, as in fmaxf, so a maximum of magnitudes equals fmaxf's of the values as floats).
__device__ __forceinline__ uint32_t fp8_max2(uint32_t a, uint32_t b) {
    __nv_bfloat162 r = __hmax2(*reinterpret_cast<const __nv_bfloat162 *>(&a), *reinterpret_cast<const __nv_bfloat162 *>(&b));
    return *reinterpret_cast<const uint32_t *>(&r);
}

// The largest magnitude of a piece's 8 values (packed bf16), computed on the packed pairs.
__device__ __forceinline__ float fp8_piece_amax(uint4 piece) {
    uint4 a = fp8_piece_abs(piece);
    uint32_t m = fp8_max2(fp8_max2(a.x, a.y), fp8_max2(a.z, a.w));
    m = fp8_max2(m, m >> 16);
    return __uint_as_float(m << 16);
}

// The 4 codes of values v under the scale of inverse inv, packed as they lie in memory.
__device__ __forceinline__ uint32_t fp8_codes4(const float v[4], float inv) {
    return (uint32_t)fp8_e4m3_encode2(v[0] * inv, v[1] * inv) | (uint32_t)fp8_e4m3_encode2(v[2] * inv, v[3] * inv) << 16;
}

// The 8 codes of values v, value i under the scale of inverse inv[step i], packed as they lie in
// memory: 4 conversions of two values each.
__device__ __forceinline__ uint2 fp8_codes8(const float v[8], const float *inv, int step) {
    uint32_t w[2] = {0, 0};
#pragma unroll
    for (int i = 0; i < 8; i += 2)
        w[i / 4] |= (uint32_t)fp8_e4m3_encode2(v[i] * inv[step * i], v[i + 1] * inv[step * (i + 1)]) << (8 * (i % 4));
    return make_uint2(w[0], w[1]);
}

// The row blocks' quantisation shared by the rows' kernels and the one pass: a half-warp holds N
// 1x128 blocks, piece j of each lane (8 values, columns from 8 (lane % 16)) in block j, amax[j] its
// largest magnitude. The blocks' maxima come from a transposed butterfly: each of the first log2 N
// steps halves the maxima a lane carries (sending the half its partner keeps), so that after N - 1 +
// 4 - log2 N shuffles (not 4 N) lanes 16 / N j to 16 / N (j + 1) - 1 of the half-warp hold block
// j's; those lanes compute its scale and inverse (one division pair a lane, not N), and N shuffles
// bring every lane the inverses. Returns the lane's block (*own; -1 for all but the block's first
// lane, which stores its scale *s), inv[j] and sat (bit j: block j may saturate).
template <int N>
__device__ void fp8_row_scales(const float amax[N], float inv[N], uint32_t *sat, float *s, int *own, Fp8Scaling how) {
    constexpr int SPAN = 16 / N; // lanes that end up holding a block's maximum
    int lane = threadIdx.x & 15, half = threadIdx.x & 16;
    float a[N];
#pragma unroll
    for (int j = 0; j < N; j++) a[j] = amax[j];
#pragma unroll
    for (int o = 8, n = N; n > 1; o >>= 1, n >>= 1) {
        bool upper = lane & o;
#pragma unroll
        for (int i = 0; i < n / 2; i++) {
            float send = upper ? a[i] : a[i + n / 2], keep = upper ? a[i + n / 2] : a[i];
            a[i] = fmaxf(keep, __shfl_xor_sync(0xffffffffu, send, o));
        }
    }
#pragma unroll
    for (int o = SPAN / 2; o > 0; o >>= 1) a[0] = fmaxf(a[0], __shfl_xor_sync(0xffffffffu, a[0], o));
    *s = fp8_block_scale(a[0], how);
    float mine = fp8_scale_inverse(*s);
    uint32_t may = __ballot_sync(0xffffffffu, fp8_block_may_saturate(a[0], mine));
    *sat = 0, *own = lane % SPAN ? -1 : lane / SPAN;
#pragma unroll
    for (int j = 0; j < N; j++) {
        inv[j] = __shfl_sync(0xffffffffu, mine, half + SPAN * j);
        *sat |= ((may >> (half + SPAN * j)) & 1u) << j;
    }
}

// Lane's piece v of block kb of row r (as fp8_row_scales) to codes under inverse inv into q (vec:
// one 8-byte store; a template constant of the kernels, so that theirs holds no other path).
// Returns the codes.
__device__ __forceinline__ uint2 fp8_store_row_codes(uint8_t *q, int K, int r, int kb, const float v[8], float inv,
                                                     bool vec) {
    int k = kb * FP8_BLOCK + 8 * (threadIdx.x & 15);
    uint2 codes = fp8_codes8(v, &inv, 0);
    uint8_t *dst = q + (size_t)r * K + k;
    if (vec) {
        if (k < K) *reinterpret_cast<uint2 *>(dst) = codes;
    } else
#pragma unroll
        for (int i = 0; i < 8; i++)
            if (k + i < K) dst[i] = (uint8_t)((i < 4 ? codes.x : codes.y) >> (8 * (i % 4)));
    return codes;
}

// fp8_count of the piece fp8_store_row_codes stored for block kb of row r, the values as quantised
// at row xr of x (with swiglu_up > 0, x holds the gate values of a SwiGLU whose output they are,
// rows of 2 swiglu_up, and the rare path recomputes them: fp8_count_swiglu_piece).
__device__ __noinline__ void fp8_count_row_piece(uint64_t *counts, const bf16 *x, const uint8_t *q, int K, int r,
                                                 int xr, int kb, float inv, bool sat, int swiglu_up) {
    int k = kb * FP8_BLOCK + 8 * (threadIdx.x & 15);
    size_t ld = swiglu_up ? 2 * (size_t)swiglu_up : (size_t)K;
    const uint8_t *dst = q + (size_t)r * K + k;
    uint32_t all = sat ? 0xffffffffu : 0u;
    if (swiglu_up) fp8_count_swiglu_piece<8>(counts, x + xr * ld + k, swiglu_up, dst, K - k, inv, all);
    else fp8_count_piece<8>(counts, x + xr * ld + k, dst, K - k, inv, NULL, all);
}

// Where the scale of block kb of row r (in the group of rows from r0) lies in scales, laid out as
// fp8_quantize_rows writes them.
__device__ __forceinline__ float *fp8_row_scale_at(float *scales, int K, int r, int r0, int rows, int kb) {
    return scales + fp8_row_scale_index(fp8_blocks((size_t)K), (size_t)r0, (size_t)rows, (size_t)(r - r0), (size_t)kb);
}

__device__ __forceinline__ void fp8_store_row_scale(float *scales, int K, int r, int r0, int rows, int kb, float s) {
    *fp8_row_scale_at(scales, K, r, r0, rows, kb) = s;
}

// The rows' kernels (fp8_quantize_rows, and the SwiGLU that produces rows): a half-warp per 1x128
// block, a 16-byte piece (8 values) a lane; a warp covers FP8_R_PAIRS pairs of consecutive blocks
// (in row-major (row, block) order, so each load of the warp reads 512 contiguous bytes) and issues
// all their loads before the first amax, so that a thread has FP8_R_PAIRS x 16 bytes (or twice
// that) in flight. The blocks' scales by fp8_row_scales, codes 8 bytes a lane; a block's group (a
// binary search of offsets, once for the pieces of a group) only matters for the stores. Indices
// are 32-bit (fp8_check_index), addresses 64-bit.
#define FP8_R_THREADS 256
#define FP8_R_PAIRS 4

// The row r[j] and block kb[j] of each of this thread's FP8_R_PAIRS pieces among R rows of Kb
// blocks (r[j] >= R: no piece).
__device__ void fp8_row_pieces(int R, int Kb, int r[FP8_R_PAIRS], int kb[FP8_R_PAIRS]) {
    int warp = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    int block = warp * 2 * FP8_R_PAIRS + ((threadIdx.x >> 4) & 1), rr = block / Kb, bb = block % Kb;
#pragma unroll
    for (int j = 0; j < FP8_R_PAIRS; j++) {
        r[j] = min(rr, R), kb[j] = bb;
        for (bb += 2; bb >= Kb; bb -= Kb) rr++;
    }
}

// Whether row r (of R) is in a group of offsets: that of the last lookup (*rows nonzero) when it
// holds r, else fp8_row_group's, into r0 and rows.
__device__ __forceinline__ bool fp8_row_in_group(const int32_t *offsets, int E, int R, int r, int *r0, int *rows) {
    return r < R && ((*rows && r >= *r0 && r < *r0 + *rows) || fp8_row_group(offsets, E, R, r, r0, rows));
}

// Row r of the tensor quantised is row fp8_source_row(x_rows, r) of x (x_rows NULL: r itself);
// its piece at column c starts at fp8_piece_src.
__device__ __forceinline__ int fp8_source_row(const int32_t *x_rows, int r) { return x_rows ? x_rows[r] : r; }
__device__ __forceinline__ const bf16 *fp8_piece_src(const bf16 *x, const int32_t *x_rows, int r, int C, int c) {
    return x + (size_t)fp8_source_row(x_rows, r) * C + c;
}

// The codes and scales of the rows' kernels' pieces, packed as bf16 in piece (the values as stored
// at x; swiglu_up as fp8_count_row_piece), a block at a time (fp8_row_scales of one block: one pass
// over a piece's values; measured, the scales of a half-warp's FP8_R_PAIRS blocks at once ran slower
// here, as the values had to be read twice and the kernel lost a block an SM to registers), then
// the counters' rare path for the pieces that need it.
__device__ __forceinline__ void fp8_store_row_pieces(uint8_t *q, float *scales, const bf16 *x, const int32_t *offsets,
                                                     int E, int R, int K, const int rs[FP8_R_PAIRS],
                                                     const int kbs[FP8_R_PAIRS], const uint4 piece[FP8_R_PAIRS],
                                                     bool vec, Fp8Scaling how, uint64_t *counts, int swiglu_up = 0,
                                                     const int32_t *x_rows = NULL) {
    int r0 = 0, rows = 0; // the group of the last row looked up: the next pieces' rows are mostly in it
    float invs[FP8_R_PAIRS];
    uint32_t flagged = 0, sats = 0, packed = 0; // bit j: piece j takes the rare path, its block may saturate;
    // packed: fp8_piece_counts of the other pieces
#pragma unroll
    for (int j = 0; j < FP8_R_PAIRS; j++) {
        float v[8], s;
        uint32_t sat;
        int own;
        unpack8(v, piece[j]);
        float amax = fp8_piece_amax(piece[j]);
        fp8_row_scales<1>(&amax, &invs[j], &sat, &s, &own, how); // by the whole half-warp: before any exit
        if (!fp8_row_in_group(offsets, E, R, rs[j], &r0, &rows)) continue;
        uint2 codes = fp8_store_row_codes(q, K, rs[j], kbs[j], v, invs[j], vec);
        fp8_piece_counts_or_flag(counts, piece[j], codes, sat & 1u, 1u << j, &flagged, &packed);
        sats |= (sat & 1u) << j;
        if (own == 0) fp8_store_row_scale(scales, K, rs[j], r0, rows, kbs[j], s);
    }
    if (counts) fp8_add_piece_counts(counts, packed);
    for (int j = 0; flagged && j < FP8_R_PAIRS; j++)
        if ((flagged >> j) & 1)
            fp8_count_row_piece(counts, x, q, K, rs[j], fp8_source_row(x_rows, rs[j]), kbs[j], invs[j], (sats >> j) & 1,
                                swiglu_up);
}

// VEC: K a multiple of 8, x 16-byte and q 8-byte aligned (every piece whole or wholly outside).
// GATHER: row r is row x_rows[r] of x (fp8_source_row; only rows of the groups are read), else r.
template <bool VEC, bool GATHER>
__global__ void __launch_bounds__(FP8_R_THREADS)
fp8_quantize_rows_kernel(uint8_t *q, float *scales, const bf16 *x, const int32_t *x_rows, const int32_t *offsets,
                         int E, int R, int K, Fp8Scaling how, uint64_t *counts) {
    fp8_count_values(counts, offsets, E, R, K);
    int rs[FP8_R_PAIRS], kbs[FP8_R_PAIRS], c = 8 * (threadIdx.x & 15), r0 = 0, rows = 0;
    fp8_row_pieces(R, (int)fp8_blocks((size_t)K), rs, kbs);
    uint4 raw[FP8_R_PAIRS];
#pragma unroll
    for (int j = 0; j < FP8_R_PAIRS; j++) {
        int k = kbs[j] * FP8_BLOCK + c;
        bool in = GATHER ? fp8_row_in_group(offsets, E, R, rs[j], &r0, &rows) : rs[j] < R;
        raw[j] = in ? fp8_load_piece(fp8_piece_src(x, GATHER ? x_rows : NULL, rs[j], K, k), K - k, VEC)
                    : make_uint4(0, 0, 0, 0);
    }
    fp8_store_row_pieces(q, scales, x, offsets, E, R, K, rs, kbs, raw, VEC, how, counts, 0, GATHER ? x_rows : NULL);
}

// SwiGLU with its output's quantised rows in the same pass (the pieces of the rows' kernel, the
// gate's and the up projection's loads all issued first): the values rounded to bf16 as stored,
// then quantised, so that the codes are those of fp8_quantize_rows on the stored output; with out
// NULL not stored (the counters' rare path recomputes them from gu). VEC: H a multiple of 8, gu and
// out (where stored) 16-byte and q 8-byte aligned.
template <bool VEC>
__global__ void __launch_bounds__(FP8_R_THREADS)
swiglu_forward_fp8_kernel(bf16 *out, uint8_t *q, float *scales, const bf16 *gu, const int32_t *offsets, int E, int R,
                          int H, Fp8Scaling how, uint64_t *counts) {
    fp8_count_values(counts, offsets, E, R, H);
    int rs[FP8_R_PAIRS], kbs[FP8_R_PAIRS], c = 8 * (threadIdx.x & 15);
    fp8_row_pieces(R, (int)fp8_blocks((size_t)H), rs, kbs);
    uint4 gate[FP8_R_PAIRS], up[FP8_R_PAIRS];
#pragma unroll
    for (int j = 0; j < FP8_R_PAIRS; j++) {
        int k = kbs[j] * FP8_BLOCK + c;
        const bf16 *g = gu + (size_t)rs[j] * 2 * H + k;
        gate[j] = rs[j] < R ? fp8_load_piece(g, H - k, VEC) : make_uint4(0, 0, 0, 0);
        up[j] = rs[j] < R ? fp8_load_piece(g + H, H - k, VEC) : make_uint4(0, 0, 0, 0);
    }
    int r0 = 0, rows = 0;
#pragma unroll
    for (int j = 0; j < FP8_R_PAIRS; j++) {
        int k = kbs[j] * FP8_BLOCK + c;
        float g[8], u[8], v[8];
        unpack8(g, gate[j]), unpack8(u, up[j]);
        for (int i = 0; i < 8; i++) v[i] = swiglu_value(g[i], u[i]);
        gate[j] = pack8(v); // the output as stored: each value rounded to nearest bf16, as to_bf rounds it
        if (out && fp8_row_in_group(offsets, E, R, rs[j], &r0, &rows))
            fp8_store_piece(out + (size_t)rs[j] * H + k, gate[j], H - k, VEC);
    }
    fp8_store_row_pieces(q, scales, gu, offsets, E, R, H, rs, kbs, gate, VEC, how, counts, H);
}

// The quantisation kernels index rows, columns and row blocks in 32 bits (addresses in 64): R rows
// (or token-major columns) of K must keep R times K's blocks, and R and K, below INT_MAX.
static void fp8_check_index(size_t R, size_t K) {
    if (R * fp8_blocks(K) + K + (size_t)FP8_R_THREADS * 2 * FP8_R_PAIRS >= (size_t)INT_MAX)
        moe_fatal("%s:%d: FP8 quantisation of %zu rows of %zu: past the kernels' 32-bit indices; use a smaller "
                  "train.micro_batch", __FILE__, __LINE__, R, K);
}

// The grid of the rows' kernels for R rows of K: a warp per 2 FP8_R_PAIRS blocks.
static unsigned fp8_rows_grid(size_t R, size_t K) {
    fp8_check_index(R, K);
    size_t warps = (R * fp8_blocks(K) + 2 * FP8_R_PAIRS - 1) / (2 * FP8_R_PAIRS);
    return cuda_blocks(warps * 32, FP8_R_THREADS);
}

// The rows of x (R, K), or with x_rows the rows it names (fp8_source_row).
static void fp8_quantize_rows_launch(void *q, void *scales, const void *x, const int32_t *x_rows,
                                     const int32_t *offsets, size_t E, size_t R, size_t K, Fp8Scaling how,
                                     uint64_t *counts) {
    if (!R || !K) return;
    bool vec = K % 8 == 0 && aligned16(x) && (uintptr_t)q % 8 == 0;
    static decltype(&fp8_quantize_rows_kernel<true, true>) const kernels[2][2] = {
        {fp8_quantize_rows_kernel<false, false>, fp8_quantize_rows_kernel<false, true>},
        {fp8_quantize_rows_kernel<true, false>, fp8_quantize_rows_kernel<true, true>}};
    kernels[vec][x_rows != NULL]<<<fp8_rows_grid(R, K), FP8_R_THREADS, 0, cuda_ctx.stream>>>(
        (uint8_t *)q, (float *)scales, (const bf16 *)x, x_rows, offsets, (int)E, (int)R, (int)K, how, counts);
    CUDA_LAUNCH_CHECK();
}

extern "C" void cuda_fp8_quantize_rows(void *q, void *scales, const void *x, const int32_t *offsets, size_t E, size_t R,
                                       size_t K, Fp8Scaling how, uint64_t *counts) {
    fp8_quantize_rows_launch(q, scales, x, NULL, offsets, E, R, K, how, counts);
}

extern "C" void cuda_swiglu_forward_fp8(void *out, void *q, void *scales, const void *gu, const int32_t *offsets,
                                        size_t E, size_t R, size_t H, Fp8Scaling how, uint64_t *counts) {
    if (!R || !H) return;
    bool vec = H % 8 == 0 && aligned16(gu) && aligned16(out) && (uintptr_t)q % 8 == 0; // NULL is aligned
    auto kernel = vec ? swiglu_forward_fp8_kernel<true> : swiglu_forward_fp8_kernel<false>;
    kernel<<<fp8_rows_grid(R, H), FP8_R_THREADS, 0, cuda_ctx.stream>>>(
        (bf16 *)out, (uint8_t *)q, (float *)scales, (const bf16 *)gu, offsets, (int)E, (int)R, (int)H, how, counts);
    CUDA_LAUNCH_CHECK();
}

// RMSNorm (with ADD, of sum = a + b) and its output's rows quantised in the same pass: a warp per
// row, as rmsnorm_forward's kernel (rmsnorm_row_rstd, then the normalised values as it rounds and
// stores them); lane l's values of iteration i (columns 256 i + 8 l on) are a piece of block 2 i + l /
// 16, so a half-warp holds a block, as in the rows' kernels: FP8_R_PAIRS iterations at a time go
// through fp8_store_row_pieces (blocks past W: no piece), whose codes, scales and counts are then
// fp8_quantize_rows' of the stored output. W a multiple of 8, the buffers 16-byte aligned.
template <bool ADD>
__global__ void rmsnorm_forward_fp8_kernel(bf16 *out, float *rstd, bf16 *sum, uint8_t *q, float *scales, const bf16 *a,
                                           const bf16 *b, const bf16 *w, int R, int W, float eps, Fp8Scaling how,
                                           uint64_t *counts) {
    fp8_count_values(counts, NULL, 1, R, W);
    int r = (int)((blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32), lane = threadIdx.x & 31;
    if (r >= R) return;
    size_t row = (size_t)r * W;
    const bf16 *xr = ADD ? sum + row : a + row;
    float rs = rmsnorm_row_rstd<ADD>(ADD ? sum + row : NULL, a + row, ADD ? b + row : NULL, W, eps, lane);
    for (int j0 = 0; j0 < W; j0 += 256 * FP8_R_PAIRS) {
        int rs_of[FP8_R_PAIRS], kbs[FP8_R_PAIRS];
        uint4 piece[FP8_R_PAIRS];
#pragma unroll
        for (int p = 0; p < FP8_R_PAIRS; p++) {
            int j = j0 + 256 * p + 8 * lane;
            float v[8] = {0, 0, 0, 0, 0, 0, 0, 0}, g[8];
            if (j < W) {
                load8(v, xr + j), load8(g, w + j);
                for (int k = 0; k < 8; k++) v[k] *= rs * g[k];
            }
            piece[p] = pack8(v);
            if (j < W) *reinterpret_cast<uint4 *>(out + row + j) = piece[p];
            kbs[p] = (j0 + 256 * p) / FP8_BLOCK + lane / 16;
            rs_of[p] = kbs[p] * FP8_BLOCK < W ? r : R;
        }
        fp8_store_row_pieces(q, scales, out, NULL, 1, R, W, rs_of, kbs, piece, true, how, counts);
    }
    if (lane == 0) rstd[r] = rs;
}

extern "C" void cuda_rmsnorm_forward_fp8(void *sum, void *out, void *rstd, void *q, void *scales, const void *a,
                                         const void *b, const void *w, size_t R, size_t W, float eps, Fp8Scaling how,
                                         uint64_t *counts) {
    if (!R) return;
    fp8_check_index(R, W);
    bool aligned = aligned16(out) && aligned16(a) && aligned16(b) && aligned16(sum) && aligned16(w) && aligned16(q);
    if (W % 8 || !aligned)
        moe_fatal("%s:%d: rmsnorm_forward_fp8 needs a width that is a multiple of 8 (got %zu) and 16-byte aligned "
                  "buffers (the model calls it only so)", __FILE__, __LINE__, W);
    auto kernel = b ? rmsnorm_forward_fp8_kernel<true> : rmsnorm_forward_fp8_kernel<false>;
    kernel<<<cuda_blocks(R * 32, 256), 256, 0, cuda_ctx.stream>>>(
        (bf16 *)out, (float *)rstd, (bf16 *)sum, (uint8_t *)q, (float *)scales, (const bf16 *)a, (const bf16 *)b,
        (const bf16 *)w, (int)R, (int)W, eps, how, counts);
    CUDA_LAUNCH_CHECK();
}

// The rows of x that land in token-major block b (columns [128 b, 128 b + 128)): first row and
// count, 0 rows for a block of no expert (past an expert's rows, or before the first expert's when
// offsets[0] > 0, as for a chunk of experts). Its expert, returned, is the last one starting at or
// before it.
__device__ int fp8_block_rows(const int32_t *offsets, int E, int b, int *first, int *n) {
    int lo = 0, hi = E - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if ((int)fp8_expert_col((size_t)offsets[mid], (size_t)mid) <= FP8_BLOCK * b) lo = mid;
        else hi = mid - 1;
    }
    int into = FP8_BLOCK * b - (int)fp8_expert_col((size_t)offsets[lo], (size_t)lo);
    int rows = offsets[lo + 1] - offsets[lo];
    *first = offsets[lo] + into;
    *n = into >= 0 && into < rows ? min(FP8_BLOCK, rows - into) : 0;
    return lo;
}

// The 16-byte chunk where the codes of row i's chunk c lie in the shared tile: XOR-ed with the row's
// 16-row group, so that neither the row-major writes nor the transposed reads share a bank.
__device__ __forceinline__ int fp8_tile_chunk(int i, int c) { return c ^ ((i >> 4) & 7); }

// Four words a, b, c, d of four bytes each as a 4x4 byte matrix (a word a row), transposed: word m
// then holds byte m of a, b, c and d, in that order.
__device__ __forceinline__ void fp8_transpose4(uint32_t &a, uint32_t &b, uint32_t &c, uint32_t &d) {
    uint32_t t0 = __byte_perm(a, b, 0x5140), t1 = __byte_perm(a, b, 0x7362); // a0 b0 a1 b1, a2 b2 a3 b3
    uint32_t t2 = __byte_perm(c, d, 0x5140), t3 = __byte_perm(c, d, 0x7362); // c0 d0 c1 d1, c2 d2 c3 d3
    a = __byte_perm(t0, t2, 0x5410), b = __byte_perm(t0, t2, 0x7632);
    c = __byte_perm(t1, t3, 0x5410), d = __byte_perm(t1, t3, 0x7632);
}

// Thread t's share (of 256) of the transpose of a 128x128 tile of codes (swizzled as
// fp8_tile_chunk): columns [4 (t / 8), + 4) of rows [16 (t % 8), + 16) read as 16 words, transposed
// in registers, stored as 4 rows of 16 bytes of dst (tile column j at dst + j ld), for the tile's
// first cols columns and rows rows. vec: 16-byte stores (dst, ld and rows multiples of 16).
__device__ __forceinline__ void fp8_store_transposed(const uint4 (*tile)[FP8_BLOCK / 16], uint8_t *dst, int64_t ld,
                                                     int64_t cols, int64_t rows, bool vec) {
    int kq = threadIdx.x / 8, r = threadIdx.x % 8;
    uint32_t col[16];
#pragma unroll
    for (int ii = 0; ii < 16; ii++) {
        int i = 16 * r + ii;
        col[ii] = reinterpret_cast<const uint32_t *>(&tile[i][fp8_tile_chunk(i, kq / 4)])[kq % 4];
    }
    dst += 4 * kq * ld + 16 * r;
    if (vec) {
#pragma unroll
        for (int g = 0; g < 4; g++) fp8_transpose4(col[4 * g], col[4 * g + 1], col[4 * g + 2], col[4 * g + 3]);
#pragma unroll
        for (int m = 0; m < 4; m++)
            if (16 * r < rows && 4 * kq + m < cols)
                *reinterpret_cast<uint4 *>(dst + m * ld) = make_uint4(col[m], col[4 + m], col[8 + m], col[12 + m]);
    } else {
#pragma unroll
        for (int m = 0; m < 4; m++)
#pragma unroll
            for (int ii = 0; ii < 16; ii++)
                if (4 * kq + m < cols && 16 * r + ii < rows) dst[m * ld + ii] = (uint8_t)(col[ii] >> (8 * m));
    }
}

// The token-major copies' kernel: a block of FP8_C_THREADS threads per (128 columns, token-major
// block b). Thread t stages FP8_C_PIECES 16-byte pieces in its own slots of shared memory, all
// issued (cp.async) before any arithmetic: columns [8 (t % 16), + 8) of rows t / 16 + 16 p, so it
// holds 8 columns of 8 rows and keeps their maxima in registers (taken on the packed bf16 pairs);
// the columns' amax then by one shuffle (lanes l and l + 16 share columns) and a shared row of
// partial maxima per warp. Codes go to a 128x128 shared tile (8 bytes a piece, swizzled as the
// weights' so that neither side has bank conflicts) and out, transposed, in 16-byte stores along the
// token dimension: 128 contiguous bytes per column and 8 lanes. With ROWS, the rows of the tile too
// (fp8_quantize_rows_cols): a half-warp holds 8 rows' 128 columns, so their 1x128 blocks' scales
// come from the same registers at once (fp8_row_scales of 8 blocks) and their codes go out in 8-byte
// stores; the rows of an expert are exactly those of its token-major blocks. The pieces are read from
// shared memory by each pass that needs them rather than held in registers, so that 4 blocks fit an
// SM (measured on scale-E8's shapes: 2 blocks with the pieces in registers, 2,180-2,720 GB/s; 4
// staged, 2,450-2,950, and the step's expert passes 12.33 ms against 13.82; a persistent kernel with
// two tiles in flight was slower than either).
#define FP8_C_THREADS 256
#define FP8_C_PIECES (FP8_BLOCK * FP8_BLOCK / 8 / FP8_C_THREADS)
#define FP8_C_RESIDENT 4
#define FP8_C_STAGE_BYTES (FP8_C_PIECES * FP8_C_THREADS * 16)

// The tile's scales (THREADS threads) into scales and their inverses into inv (shared, one a
// column), from each thread's maxima of its 8 columns, in `blocks`: a scale per column (the block's
// row of them: FP8_COLS_1X128), or one for all 128 columns (scales[0]: FP8_COLS_128X128) from the
// warps' largest values (the same two barriers: an extra one cost the fused SwiGLU backward 4-8%).
template <int THREADS = FP8_C_THREADS>
__device__ void fp8_column_scales(float *inv, float *scales, float amax[8], int64_t cols, Fp8Scaling how,
                                  Fp8ColBlocks blocks) {
    bool block = blocks == FP8_COLS_128X128;
    __shared__ float part[THREADS / 32][FP8_BLOCK]; // the warps' maxima per column (block: part[w][0], all)
    int t = threadIdx.x, c8 = t % 16;
    for (int j = 0; j < 8; j++) amax[j] = fmaxf(amax[j], __shfl_xor_sync(0xffffffffu, amax[j], 16));
    if (block) { // uniform over the block
        float m = amax[0];
        for (int j = 1; j < 8; j++) m = fmaxf(m, amax[j]);
        for (int o = 8; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (t % 32 == 0) part[t / 32][0] = m;
    } else if (t % 32 < 16)
        for (int j = 0; j < 8; j++) part[t / 32][8 * c8 + j] = amax[j];
    __syncthreads();
    if (t < FP8_BLOCK) {
        float m = 0;
        for (int w = 0; w < THREADS / 32; w++) m = fmaxf(m, part[w][block ? 0 : t]);
        float s = fp8_block_scale(m, how);
        inv[t] = fp8_scale_inverse(s);
        if (block ? t == 0 : t < cols) scales[t] = s;
    }
    __syncthreads();
}

// This thread's pieces of the tile's rows [first, first + n) at column c (piece p: tile row t / 16 +
// 16 p) into its slots (piece p at slots[p FP8_C_THREADS], so that a warp's 32 slots are 512
// contiguous bytes) by cp.async where a piece is whole (vec) or past the rows (zeros), else value by
// value; waited for.
__device__ void fp8_cols_stage(uint4 *slots, const bf16 *x, const int32_t *x_rows, int first, int n, int C, int c,
                               bool vec) {
    // The sources first, so that the row indices' loads are all in flight at once (each index read
    // after the previous piece's copy made 8 dependent round trips: 16% of the experts' pass).
    const bf16 *src[FP8_C_PIECES];
#pragma unroll
    for (int p = 0; p < FP8_C_PIECES; p++) {
        int i = (int)threadIdx.x / 16 + 16 * p;
        src[p] = i < n ? fp8_piece_src(x, x_rows, first + i, C, c) : x;
    }
#pragma unroll
    for (int p = 0; p < FP8_C_PIECES; p++) {
        bool row = (int)threadIdx.x / 16 + 16 * p < n;
        uint4 *slot = slots + p * FP8_C_THREADS;
        if (!row || (vec && c < C)) cp_async16(slot, src[p], row);
        else *slot = fp8_load_piece(src[p], C - c, vec);
    }
    cp_async_commit();
    cp_async_wait_all();
}

// Where a block of the token-major kernels works: token-major block b of Rt columns, its rows
// [first, first + n) of the group of rows [r0, r0 + rows) (fp8_block_rows).
struct Fp8TileRows {
    int b, first, n, r0, rows, Rt;
};

__device__ __forceinline__ Fp8TileRows fp8_tile_rows(const int32_t *offsets, int E, int b, int Rt) {
    Fp8TileRows at;
    at.b = b, at.Rt = Rt;
    int e = fp8_block_rows(offsets, E, b, &at.first, &at.n);
    at.r0 = offsets[e], at.rows = offsets[e + 1] - at.r0;
    return at;
}

// One 128x128 tile (tile column kb: columns [128 kb, + 128) of a tensor C columns wide, of which the
// first `cols` exist) quantised by a block of THREADS threads, THREADS / 16 rows apart: the thread's
// pieces piece(p) (packed bf16, tile rows t / 16 + THREADS / 16 p, columns 8 (t % 16) on: a
// half-warp holds 128 columns of its pieces' rows) to the token-major codes at qt (tile column j at
// qt + j Rt) and their scales at scales_t (the tile's in `blocks`: one a column, or one for the
// tile, fp8_column_scales), and with ROWS to the rows' codes and scales
// of row block kb too (q, scales as fp8_quantize_rows writes them; vec: 8-byte stores). The columns'
// amax by one shuffle (lanes l and l + 16 share columns) and a shared row of partial maxima per
// warp; the rows' scales from the same registers at once (fp8_row_scales of the thread's blocks);
// codes to the shared tile (8 bytes a piece, swizzled so that neither side has bank conflicts) and
// out, transposed, in 16-byte stores along the token dimension by 256 of the threads. The counters'
// rare path (counts non-NULL) after a barrier: col_count(p, i, codes) for piece p (tile row i) whose
// token-major codes (in the tile) need it, row_count(p, i, inv) for one whose row codes do (inv:
// its row scale's inverse as stored). Ends with a barrier: tile and inv free again.
template <int THREADS, bool ROWS, typename Piece, typename ColCount, typename RowCount>
__device__ __forceinline__ void fp8_tile_quantize(uint4 (*tile)[FP8_BLOCK / 16], float *inv, Piece piece,
                                                  ColCount col_count, RowCount row_count, uint8_t *q, float *scales,
                                                  uint8_t *qt, float *scales_t, int C, int kb, int cols,
                                                  const Fp8TileRows &at, bool vec, Fp8Scaling how, Fp8ColBlocks blocks,
                                                  uint64_t *counts) {
    constexpr int PIECES = FP8_BLOCK * FP8_BLOCK / 8 / THREADS, STEP = THREADS / 16;
    int t = threadIdx.x, c8 = t % 16;
    uint4 cmax = make_uint4(0, 0, 0, 0); // the thread's columns' maxima as packed bf16 pairs
    float amax[8], rmax[PIECES], v[8];   // the columns' maxima, the pieces' (ROWS)
#pragma unroll
    for (int p = 0; p < PIECES; p++) {
        uint4 a = fp8_piece_abs(piece(p));
        cmax = make_uint4(fp8_max2(cmax.x, a.x), fp8_max2(cmax.y, a.y), fp8_max2(cmax.z, a.z), fp8_max2(cmax.w, a.w));
        if (ROWS) rmax[p] = fp8_piece_amax(piece(p));
    }
    unpack8(amax, cmax);
    fp8_column_scales<THREADS>(inv, scales_t, amax, cols, how, blocks);
    float cinv[8], rinv[PIECES], rs; // the thread's columns' inverses; ROWS: the row blocks', the scale it stores
    for (int j = 0; j < 8; j++) cinv[j] = inv[8 * c8 + j];
    uint32_t rsat, sat = 0; // amax[j] bounds the thread's values of column j
    int own;
    if (ROWS) fp8_row_scales<PIECES>(rmax, rinv, &rsat, &rs, &own, how);
    for (int j = 0; j < 8; j++) sat |= (uint32_t)fp8_block_may_saturate(amax[j], cinv[j]) << j;
    // Bit p: piece p's token-major codes (flagged) or its row's (row_flagged) take fp8_count's rare
    // path, after the loop (fewer live registers, no branch in it).
    uint32_t flagged = 0, row_flagged = 0, packed = 0; // packed: fp8_piece_counts of the other pieces
#pragma unroll
    for (int p = 0; p < PIECES; p++) {
        int i = t / 16 + STEP * p;
        unpack8(v, piece(p));
        uint2 codes = fp8_codes8(v, cinv, 1);
        reinterpret_cast<uint2 *>(&tile[i][fp8_tile_chunk(i, c8 / 2)])[c8 % 2] = codes;
        fp8_piece_counts_or_flag(counts, piece(p), codes, sat, 1u << p, &flagged, &packed);
        if (ROWS && i < at.n) {
            uint2 row_codes = fp8_store_row_codes(q, C, at.first + i, kb, v, rinv[p], vec);
            fp8_piece_counts_or_flag(counts, piece(p), row_codes, (rsat >> p) & 1, 1u << p, &row_flagged, &packed);
            if (p == own) fp8_store_row_scale(scales, C, at.first + i, at.r0, at.rows, kb, rs);
        }
    }
    if (counts) fp8_add_piece_counts(counts, packed);
    // The rows' inverses come from their scales as stored (by other lanes, seen after the barrier),
    // not held in registers through the loop.
    __syncthreads();
    for (int p = 0; (flagged | row_flagged) && p < PIECES; p++) {
        int i = t / 16 + STEP * p;
        if ((flagged >> p) & 1)
            col_count(p, i, (const uint8_t *)&tile[i][fp8_tile_chunk(i, c8 / 2)] + 8 * (c8 % 2), sat);
        if (ROWS && ((row_flagged >> p) & 1))
            row_count(p, i, fp8_scale_inverse(*fp8_row_scale_at(scales, C, at.first + i, at.r0, at.rows, kb)),
                      (rsat >> p) & 1);
    }
    if (t < FP8_C_THREADS) // fp8_store_transposed's threads (measured with 512: all, each half the share, no faster)
        fp8_store_transposed(tile, qt, at.Rt, cols, FP8_BLOCK, vec);
    __syncthreads();
}

// VEC: C a multiple of 8, x and qt 16-byte aligned (and q 8-byte aligned with ROWS). x_rows: as
// fp8_source_row; blocks: the token-major copy's scale blocks. Dynamic shared
// memory: FP8_C_STAGE_BYTES, the threads' slots.
template <bool ROWS, bool VEC>
__global__ void __launch_bounds__(FP8_C_THREADS, FP8_C_RESIDENT)
fp8_quantize_cols_kernel(uint8_t *qt, float *scales_t, uint8_t *q, float *scales, const bf16 *x, const int32_t *x_rows,
                         const int32_t *offsets, int E, int C, int Rt, Fp8Scaling how, Fp8ColBlocks blocks,
                         uint64_t *counts) {
    fp8_count_values(counts, offsets, E, 0, ROWS ? 2 * C : C); // with ROWS: counted as two quantisations
    __shared__ uint4 tile[FP8_BLOCK][FP8_BLOCK / 16];
    __shared__ float inv[FP8_BLOCK]; // the columns' scale inverses
    extern __shared__ uint4 stage[];  // (FP8_C_PIECES, FP8_C_THREADS) slots
    int t = threadIdx.x, c8 = t % 16, c0 = blockIdx.x * FP8_BLOCK, c = c0 + 8 * c8, b = blockIdx.y;
    Fp8TileRows at = fp8_tile_rows(offsets, E, b, Rt);
    const uint4 *raw = stage + t; // piece p at raw[p FP8_C_THREADS]
    fp8_cols_stage(stage + t, x, x_rows, at.first, at.n, C, c, VEC);
    fp8_tile_quantize<FP8_C_THREADS, ROWS>(
        tile, inv, [&](int p) { return raw[p * FP8_C_THREADS]; },
        [&](int p, int i, const uint8_t *codes, uint32_t sat) {
            fp8_count_piece<8>(counts, i < at.n ? fp8_piece_src(x, x_rows, at.first + i, C, c) : x, codes,
                               i < at.n ? C - c : 0, 0, inv + 8 * c8, sat);
        },
        [&](int p, int i, float rinv, bool rsat) {
            fp8_count_row_piece(counts, x, q, C, at.first + i, fp8_source_row(x_rows, at.first + i), blockIdx.x, rinv,
                                rsat, 0);
        },
        q, scales, qt + (size_t)c0 * Rt + (size_t)FP8_BLOCK * b,
        scales_t + fp8_col_scale_at(b, c0, C, blocks), C, blockIdx.x, C - c0, at, VEC, how, blocks, counts);
}

// The token-major copies of x (R, C), and with q its rows too (q NULL: the copies alone); x_rows as
// fp8_source_row.
static void fp8_quantize_cols_launch(void *qt, void *scales_t, void *q, void *scales, const void *x,
                                     const int32_t *x_rows, const int32_t *offsets, size_t E, size_t R, size_t C,
                                     Fp8Scaling how, Fp8ColBlocks blocks, uint64_t *counts) {
    if (!C) return;
    if (!offsets) offsets = cuda_fp8_one_group(R);
    size_t Rt = fp8_expert_cols(R, E);
    fp8_check_index(Rt, C);
    bool vec = C % 8 == 0 && aligned16(x) && aligned16(qt) && (uintptr_t)q % 8 == 0;
    dim3 grid((unsigned)fp8_blocks(C), (unsigned)(Rt / FP8_BLOCK));
    static decltype(&fp8_quantize_cols_kernel<true, true>) const kernels[2][2] = {
        {fp8_quantize_cols_kernel<false, false>, fp8_quantize_cols_kernel<false, true>},
        {fp8_quantize_cols_kernel<true, false>, fp8_quantize_cols_kernel<true, true>}};
    static bool sized[2][2];
    auto kernel = kernels[q != NULL][vec];
    if (!sized[q != NULL][vec]) {
        CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, FP8_C_STAGE_BYTES));
        sized[q != NULL][vec] = true;
    }
    kernel<<<grid, FP8_C_THREADS, FP8_C_STAGE_BYTES, cuda_ctx.stream>>>(
        (uint8_t *)qt, (float *)scales_t, (uint8_t *)q, (float *)scales, (const bf16 *)x, x_rows, offsets, (int)E,
        (int)C, (int)Rt, how, blocks, counts);
    CUDA_LAUNCH_CHECK();
}

extern "C" void cuda_fp8_quantize_cols(void *qt, void *scales, const void *x, const int32_t *offsets, size_t E,
                                       size_t R, size_t C, Fp8Scaling how, Fp8ColBlocks blocks, uint64_t *counts) {
    fp8_quantize_cols_launch(qt, scales, NULL, NULL, x, NULL, offsets, E, R, C, how, blocks, counts);
}

extern "C" void cuda_fp8_quantize_rows_cols(void *q, void *scales, void *qt, void *scales_t, const void *x,
                                            const int32_t *x_rows, const int32_t *offsets, size_t E, size_t R,
                                            size_t K, Fp8Scaling how, Fp8ColBlocks blocks, uint64_t *counts) {
    if (qt) fp8_quantize_cols_launch(qt, scales_t, q, scales, x, x_rows, offsets, E, R, K, how, blocks, counts);
    else fp8_quantize_rows_launch(q, scales, x, x_rows, offsets, E, R, K, how, counts);
}

// ---------------------------------------------------------------- the SwiGLU backward with its FP8 operands

// The fused SwiGLU backward's blocks (swiglu_backward_fp8_kernel): FP8_S_THREADS threads a 128x128
// tile, FP8_S_PIECES 16-byte pieces of a tile a thread, piece p of thread t in tile row t / 16 +
// FP8_S_STEP p; slots for the gate and up pieces, and 2 blocks an SM.
#define FP8_S_THREADS 512
#define FP8_S_PIECES (FP8_BLOCK * FP8_BLOCK / 8 / FP8_S_THREADS)
#define FP8_S_STEP (FP8_S_THREADS / 16)
#define FP8_S_RESIDENT 2
#define FP8_S_STAGE_BYTES (2 * FP8_S_PIECES * FP8_S_THREADS * 16)

// The counters' rare path for a piece of hw = w silu(gate) up (not stored), recomputed from its
// gate values g (the up values H further on) as swiglu_hw8 computes and pack8 rounds them.
__device__ __noinline__ void fp8_count_hw_piece(uint64_t *counts, const bf16 *g, int H, float w, const uint8_t *q,
                                                int valid, const float *col, uint32_t sat) {
    fp8_count_values_of<8>(
        counts, [=](int i) { return bf(to_bf(swiglu_value(bf(g[i]), bf(g[i + H])) * w)); }, q, valid, 0.0f, col,
        sat);
}

// The fused SwiGLU backward (swiglu_backward_fp8): a block per token-major block b (128 rows of one
// expert, as fp8_quantize_cols_kernel's), walking the hidden width in 128-column tiles jt. Each
// thread stages its gate and up pieces in its own slots of shared memory by cp.async and loads its
// output gradient's pieces into registers; per piece, with HW (row_dot and hw: one expert-parallel
// rank) h = silu(gate) up, the row sums and hw = row_w h (held as packed bf16), then the gate and
// up gradients, written over the gate and up slots as bf16. Then the tiles: hw's token-major codes
// (tile row jt of hwt), the gate gradient's rows and token-major codes (block jt), the up gradient's
// (block H / 128 + jt). Every value is rounded to bf16 as swiglu_backward stores it, so codes,
// scales and counts are bit for bit those of swiglu_backward, fp8_quantize_rows_cols and
// fp8_quantize_cols one after the other, and row_dot is summed in the order of swiglu_backward's
// kernel (its lane l adds the columns of tiles l / 16, + 2, ...: here a thread's two running sums,
// even tiles and odd ones, then the same butterfly). A tile's three tensors must be held until their
// column scales are known (~96 KB: gate and up slots, hw and the output gradient in registers), so
// 2 tiles an SM: with 256 threads a tile (8 warps, 128 registers) the kernel took 1.06 ms alone on
// scale-E8's experts, with 512 (16 warps, 64 registers) 0.71 ms (docs/PERF.md, eighteenth session).
template <bool HW>
__global__ void __launch_bounds__(FP8_S_THREADS, FP8_S_RESIDENT)
swiglu_backward_fp8_kernel(uint8_t *q, float *scales, uint8_t *qt, float *scales_t, float *row_dot, uint8_t *hwt,
                           float *hw_scales, const bf16 *dout, const bf16 *gu, const float *row_w,
                           const int32_t *offsets, int E, int H, int Rt, Fp8Scaling how, Fp8ColBlocks hw_blocks,
                           uint64_t *grads, uint64_t *acts) {
    fp8_count_values(grads, offsets, E, 0, 4 * (int64_t)H); // the gradients' rows and token-major copy
    if (HW) fp8_count_values(acts, offsets, E, 0, H);
    __shared__ uint4 tile[FP8_BLOCK][FP8_BLOCK / 16];
    __shared__ float inv[FP8_BLOCK]; // the columns' scale inverses of the tile being quantised
    extern __shared__ uint4 stage[];  // (2, PIECES, THREADS): gate slots, then up slots
    constexpr int PIECES = FP8_S_PIECES, THREADS = FP8_S_THREADS;
    __shared__ float sums[2][PIECES][THREADS]; // HW: row_dot's running sums, even and odd tiles
    int t = threadIdx.x, c8 = t % 16, C = 2 * H;
    Fp8TileRows at = fp8_tile_rows(offsets, E, blockIdx.x, Rt);
    uint4 *gs = stage + t, *us = stage + PIECES * THREADS + t; // piece p at [p THREADS]
    auto weight = [&](int i) { return i < at.n ? (row_w ? row_w[at.first + i] : 1.0f) : 0.0f; }; // tile row i's
#pragma unroll
    for (int p = 0; HW && p < PIECES; p++) sums[0][p][t] = sums[1][p][t] = 0.0f;
    for (int jt = 0; jt < H / FP8_BLOCK; jt++) {
        int c = FP8_BLOCK * jt + 8 * c8;
        uint4 d[PIECES], hw[PIECES];
#pragma unroll
        for (int p = 0; p < PIECES; p++) {
            int i = t / 16 + FP8_S_STEP * p;
            const bf16 *g = i < at.n ? gu + (size_t)(at.first + i) * C + c : gu;
            cp_async16(gs + p * THREADS, g, i < at.n), cp_async16(us + p * THREADS, g + H, i < at.n);
        }
        cp_async_commit();
#pragma unroll
        for (int p = 0; p < PIECES; p++) {
            int i = t / 16 + FP8_S_STEP * p;
            d[p] = i < at.n ? *reinterpret_cast<const uint4 *>(dout + (size_t)(at.first + i) * H + c)
                            : make_uint4(0, 0, 0, 0);
        }
        cp_async_wait_all();
#pragma unroll
        for (int p = 0; p < PIECES; p++) {
            float g[8], u[8], dv[8], h[8], w = weight(t / 16 + FP8_S_STEP * p);
            unpack8(g, gs[p * THREADS]), unpack8(u, us[p * THREADS]), unpack8(dv, d[p]);
            if (HW) {
                float *sum = &sums[jt & 1][p][t];
                *sum = swiglu_hw8(h, g, u, dv, w, *sum);
                hw[p] = pack8(h);
            }
            swiglu_grad8(g, u, dv, w);
            gs[p * THREADS] = pack8(g), us[p * THREADS] = pack8(u);
        }
        auto codes_t = [&](uint8_t *codes, int kb) {
            return codes + (size_t)kb * FP8_BLOCK * Rt + (size_t)FP8_BLOCK * at.b;
        };
        auto no_rows = [](int, int, float, bool) {};
        if (HW)
            fp8_tile_quantize<THREADS, false>(
                tile, inv, [&](int p) { return hw[p]; },
                [&](int p, int i, const uint8_t *codes, uint32_t sat) {
                    fp8_count_hw_piece(acts, gu + (size_t)(at.first + i) * C + c, H, weight(i), codes,
                                       i < at.n ? 8 : 0, inv + 8 * c8, sat);
                },
                no_rows, NULL, NULL, codes_t(hwt, jt),
                hw_scales + fp8_col_scale_at(at.b, FP8_BLOCK * jt, H, hw_blocks), H, jt, FP8_BLOCK, at, true, how,
                hw_blocks, acts);
        const uint4 *slots[2] = {gs, us};
#pragma unroll
        for (int half = 0; half < 2; half++) {
            int kb = half * (H / FP8_BLOCK) + jt;
            auto slot = [&](int p) { return (const bf16 *)&slots[half][p * THREADS]; };
            fp8_tile_quantize<THREADS, true>(
                tile, inv, [&](int p) { return slots[half][p * THREADS]; },
                [&](int p, int i, const uint8_t *codes, uint32_t sat) {
                    fp8_count_piece<8>(grads, slot(p), codes, i < at.n ? 8 : 0, 0.0f, inv + 8 * c8, sat);
                },
                [&](int p, int i, float rinv, bool rsat) {
                    fp8_count_piece<8>(grads, slot(p), q + (size_t)(at.first + i) * C + kb * FP8_BLOCK + 8 * c8, 8,
                                       rinv, NULL, rsat ? 0xffffffffu : 0u);
                },
                q, scales, codes_t(qt, kb), scales_t + fp8_col_scale_at(at.b, FP8_BLOCK * kb, C, FP8_COLS_1X128), C,
                kb, FP8_BLOCK, at, true, how, FP8_COLS_1X128, grads);
        }
    }
#pragma unroll
    for (int p = 0; HW && p < PIECES; p++) {
        int i = t / 16 + FP8_S_STEP * p;
        float v = sums[0][p][t] + sums[1][p][t]; // swiglu_backward's lanes l and l + 16, then its butterfly
        for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (c8 == 0 && i < at.n) row_dot[at.first + i] = v;
    }
}

extern "C" void cuda_swiglu_backward_fp8(void *q, void *scales, void *qt, void *scales_t, void *row_dot, void *hwt,
                                         void *hw_scales, const void *dout, const void *gu, const void *row_w,
                                         const int32_t *offsets, size_t E, size_t R, size_t H, Fp8Scaling how,
                                         Fp8ColBlocks hw_blocks, uint64_t *grads, uint64_t *acts) {
    if (!H) return;
    bool aligned = aligned16(dout) && aligned16(gu) && aligned16(qt) && aligned16(hwt) && (uintptr_t)q % 8 == 0;
    if (H % FP8_BLOCK || !aligned)
        moe_fatal("%s:%d: swiglu_backward_fp8 needs a hidden width that is a multiple of %d (got %zu) and 16-byte "
                  "aligned buffers (the model calls it only so)", __FILE__, __LINE__, FP8_BLOCK, H);
    if (!offsets) offsets = cuda_fp8_one_group(R);
    size_t Rt = fp8_expert_cols(R, E);
    fp8_check_index(Rt, 2 * H);
    auto kernel = row_dot ? swiglu_backward_fp8_kernel<true> : swiglu_backward_fp8_kernel<false>;
    static bool sized[2];
    if (!sized[row_dot != NULL]) {
        CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, FP8_S_STAGE_BYTES));
        sized[row_dot != NULL] = true;
    }
    kernel<<<(unsigned)(Rt / FP8_BLOCK), FP8_S_THREADS, FP8_S_STAGE_BYTES, cuda_ctx.stream>>>(
        (uint8_t *)q, (float *)scales, (uint8_t *)qt, (float *)scales_t, (float *)row_dot, (uint8_t *)hwt,
        (float *)hw_scales, (const bf16 *)dout, (const bf16 *)gu, (const float *)row_w, offsets, (int)E, (int)H,
        (int)Rt, how, hw_blocks, grads, acts);
    CUDA_LAUNCH_CHECK();
}

// The weights' kernel: a block of FP8_W_THREADS threads per 128x128 block, each thread holding
// FP8_W_PIECES pieces of 16 consecutive values of a row.
#define FP8_W_THREADS 256
#define FP8_W_PIECES (FP8_BLOCK * FP8_BLOCK / 16 / FP8_W_THREADS)
#define FP8_W_RESIDENT 3

// The codes of a weight piece (its 16 values packed as bf16 in raw, from column k of row n of the
// matrix whose codes start at qe) under inverse inv to q (VEC: one 16-byte store; else value by
// value, within the matrix's N rows and K columns), with their counts (x: the values as fp8_count's
// rare path reads them again); only the piece's values [begin, end) where it lies across a part's
// end (INT_MAX: none). fp8_quantize_weights_kernel and adamw_fp8_kernel share it: the same codes.
template <bool VEC>
__device__ __forceinline__ void fp8_store_weight_piece(uint8_t *qe, const uint4 raw[2], int64_t n, int64_t k,
                                                       int64_t N, int64_t K, float inv, uint32_t sat, const bf16 *x,
                                                       uint64_t *counts, int begin = 0, int end = INT_MAX) {
    uint32_t word[4];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float v[8];
        unpack8(v, raw[h]);
        word[2 * h] = fp8_codes4(v, inv), word[2 * h + 1] = fp8_codes4(v + 4, inv);
    }
    uint8_t *dst = qe + n * K + k;
    if (VEC) {
        if (n < N && k < K && begin < end)
            *reinterpret_cast<uint4 *>(dst) = make_uint4(word[0], word[1], word[2], word[3]);
    } else
#pragma unroll
        for (int j = 0; j < 16; j++)
            if (n < N && k + j < K && j >= begin && j < end) dst[j] = (uint8_t)(word[j / 4] >> (8 * (j % 4)));
    if (begin < end) // codes as stored
        fp8_count<16>(counts, word, sat, x + begin, dst + begin, n < N ? min((int)(K - k), end) - begin : 0, inv, NULL);
}

// What a launch of fp8_quantize_weights_kernel makes: the whole tensor's codes and scales from its
// blocks' largest magnitudes (WHOLE), or for a flat part [lo, hi) of its elements the blocks'
// largest magnitudes over the part (AMAX), or the part's codes under the largest magnitudes given,
// with every block's scales (PART).
enum Fp8WeightsPass { FP8_WEIGHTS_WHOLE, FP8_WEIGHTS_AMAX, FP8_WEIGHTS_PART };

// The values [*begin, *end) of the 16 from flat element f that lie in the flat part [lo, hi) (a
// run, as the part is one; 0 <= begin, end <= 16).
__device__ __forceinline__ void fp8_part_span(int64_t f, int64_t lo, int64_t hi, int *begin, int *end) {
    *begin = (int)min(max(lo - f, (int64_t)0), (int64_t)16), *end = (int)min(max(hi - f, (int64_t)0), (int64_t)16);
}

// One block per 128x128 block (kb, nb) of weight matrix e. Its values stay in registers as packed
// bf16 (16-byte loads: 32 registers, 80 in all, so 3 blocks fit an SM; as fp32 they took 128
// registers and 2 blocks, at ~2.3 TB/s on olmoe-L8's experts; held to 64 for 4 blocks, they spill)
// from the amax to the codes, which go to q in 16-byte stores. VEC: N and K multiples of 16 and
// 16-byte aligned buffers, so that every piece is whole or wholly outside (a part's ends too); else
// loads and stores go value by value. PASS (Fp8WeightsPass): WHOLE (lo 0, hi E N K) takes its
// block's amax from its values; AMAX writes amax_out (E, Kb, Nb) alone; PART reads its block's amax
// from amax_in (E, Kb, Nb). A part's pieces read and write only its values, and a block holding none
// of them (by its first and last elements' flat indices) no values at all; its scales still.
template <bool VEC, Fp8WeightsPass PASS>
__global__ void __launch_bounds__(FP8_W_THREADS, FP8_W_RESIDENT)
fp8_quantize_weights_kernel(uint8_t *q, float *scales, float *scales_t, float *amax_out, const float *amax_in,
                            const bf16 *w, int64_t N, int64_t K, int64_t lo, int64_t hi, Fp8Scaling how,
                            uint64_t *counts) {
    fp8_count_values(counts, NULL, 0, hi - lo, 1); // the part's values
    __shared__ float scratch[32];
    int64_t e = blockIdx.z, kb = blockIdx.x, nb = blockIdx.y, Kb = gridDim.x, Nb = gridDim.y;
    int64_t n0 = nb * FP8_BLOCK, k0 = kb * FP8_BLOCK, at = (e * Kb + kb) * Nb + nb;
    int64_t first = (e * N + n0) * K + k0; // the block's first and last elements' flat indices
    int64_t last = (e * N + min(n0 + FP8_BLOCK, N) - 1) * K + min(k0 + FP8_BLOCK, K) - 1;
    bool none = PASS != FP8_WEIGHTS_WHOLE && (first >= hi || last < lo); // none of the part's values
    const bf16 *we = w + e * N * K;
    uint4 raw[FP8_W_PIECES][2]; // piece p's 16 values, 8 a half
    float amax = 0;
#pragma unroll
    for (int p = 0; p < FP8_W_PIECES; p++) {
        int u = threadIdx.x + p * FP8_W_THREADS, begin = 0, end = INT_MAX; // the part's values (WHOLE: all)
        int64_t n = n0 + u / 8, k = k0 + 16 * (u % 8);
        if (PASS != FP8_WEIGHTS_WHOLE) fp8_part_span((e * N + n) * K + k, lo, hi, &begin, &end);
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int valid = n < N && !none ? (int)min(K - k - 8 * h, (int64_t)min(end - 8 * h, 8)) : 0;
            raw[p][h] = fp8_load_piece(we + n * K + k + 8 * h, valid, VEC, max(begin - 8 * h, 0));
            amax = fmaxf(amax, fp8_piece_amax(raw[p][h]));
        }
    }
    if (PASS == FP8_WEIGHTS_PART) amax = amax_in[at];
    else amax = block_max(amax, scratch);
    if (PASS == FP8_WEIGHTS_AMAX) {
        if (threadIdx.x == 0) amax_out[at] = amax;
        return;
    }
    float s = fp8_block_scale(amax, how), inv = fp8_scale_inverse(s);
    uint32_t sat = fp8_may_saturate_all(amax, inv);
    if (!none)
#pragma unroll
        for (int p = 0; p < FP8_W_PIECES; p++) {
            int u = threadIdx.x + p * FP8_W_THREADS, begin = 0, end = INT_MAX;
            int64_t n = n0 + u / 8, k = k0 + 16 * (u % 8);
            if (PASS != FP8_WEIGHTS_WHOLE) fp8_part_span((e * N + n) * K + k, lo, hi, &begin, &end);
            fp8_store_weight_piece<VEC>(q + e * N * K, raw[p], n, k, N, K, inv, sat, we + n * K + k, counts, begin,
                                        end);
        }
    if (threadIdx.x == 0) scales[at] = s, scales_t[(e * Nb + nb) * Kb + kb] = s;
}

// fp8_quantize_weights_kernel's pass over the flat part [lo, hi) of w (E, N, K) bf16 (the whole
// tensor: lo 0, hi E N K); VEC where a part's ends keep the 16-value pieces whole inside or outside.
template <Fp8WeightsPass PASS>
static void fp8_weights_launch(void *q, void *scales, void *scales_t, void *amax_out, const void *amax_in,
                               const void *w, size_t E, size_t N, size_t K, size_t lo, size_t hi, Fp8Scaling how,
                               uint64_t *counts) {
    if (!E || !N || !K) return;
    if (lo > hi || hi > E * N * K)
        moe_fatal("%s:%d: FP8 weights' part [%zu, %zu) is not within their %zu values", __FILE__, __LINE__, lo, hi,
                  E * N * K);
    bool vec = N % 16 == 0 && K % 16 == 0 && lo % 16 == 0 && hi % 16 == 0 && aligned16(q) && aligned16(w);
    dim3 grid((unsigned)fp8_blocks(K), (unsigned)fp8_blocks(N), (unsigned)E);
    auto kernel = vec ? fp8_quantize_weights_kernel<true, PASS> : fp8_quantize_weights_kernel<false, PASS>;
    kernel<<<grid, FP8_W_THREADS, 0, cuda_ctx.stream>>>((uint8_t *)q, (float *)scales, (float *)scales_t,
                                                        (float *)amax_out, (const float *)amax_in, (const bf16 *)w,
                                                        (int64_t)N, (int64_t)K, (int64_t)lo, (int64_t)hi, how, counts);
    CUDA_LAUNCH_CHECK();
}

extern "C" void cuda_fp8_quantize_weights(void *q, void *scales, void *scales_t, const void *w, size_t E, size_t N,
                                          size_t K, Fp8Scaling how, uint64_t *counts) {
    fp8_weights_launch<FP8_WEIGHTS_WHOLE>(q, scales, scales_t, NULL, NULL, w, E, N, K, 0, E * N * K, how, counts);
}

// amax (E, Kb, Nb) f32: each block's largest magnitude over the part's values (0: none of them).
extern "C" void cuda_fp8_weights_amax(void *amax, const void *w, size_t E, size_t N, size_t K, size_t lo, size_t hi) {
    fp8_weights_launch<FP8_WEIGHTS_AMAX>(NULL, NULL, NULL, amax, NULL, w, E, N, K, lo, hi, FP8_SCALE_AMAX, NULL);
}

// The part's codes into q (the rest left as it is) and every block's scales, from amax (E, Kb, Nb)
// f32, the largest magnitudes over all the parts: those of the whole tensor's quantisation.
extern "C" void cuda_fp8_quantize_weights_part(void *q, void *scales, void *scales_t, const void *amax, const void *w,
                                               size_t E, size_t N, size_t K, size_t lo, size_t hi, Fp8Scaling how,
                                               uint64_t *counts) {
    fp8_weights_launch<FP8_WEIGHTS_PART>(q, scales, scales_t, NULL, amax, w, E, N, K, lo, hi, how, counts);
}

// AdamW on the first `valid` (up to 4) of 4 consecutive parameters from p, with g, m and v at the
// same offsets (VEC: all 4 or none, in 16-byte loads and stores); w gets the new values, 0 past valid.
template <bool VEC>
__device__ __forceinline__ void adamw_quad(float w[4], float *p, const float *g, float *m, float *v, int valid,
                                           AdamWArgs a, const AdamWStep &k) {
    if (VEC && valid > 0) {
        float4 pv = *reinterpret_cast<const float4 *>(p), gv = *reinterpret_cast<const float4 *>(g);
        float4 mv = *reinterpret_cast<const float4 *>(m), vv = *reinterpret_cast<const float4 *>(v);
        w[0] = adamw_one(&mv.x, &vv.x, pv.x, gv.x, a, k), w[1] = adamw_one(&mv.y, &vv.y, pv.y, gv.y, a, k);
        w[2] = adamw_one(&mv.z, &vv.z, pv.z, gv.z, a, k), w[3] = adamw_one(&mv.w, &vv.w, pv.w, gv.w, a, k);
        *reinterpret_cast<float4 *>(p) = make_float4(w[0], w[1], w[2], w[3]);
        *reinterpret_cast<float4 *>(m) = mv, *reinterpret_cast<float4 *>(v) = vv;
        return;
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        w[i] = 0;
        if (!VEC && i < valid) w[i] = p[i] = adamw_one(&m[i], &v[i], p[i], g[i], a, k);
    }
}

// The fused update's blocks: FP8_AW_THREADS threads, FP8_AW_RESIDENT of them an SM.
#define FP8_AW_THREADS 512
#define FP8_AW_RESIDENT 2

// AdamW (adamw_kernel's arithmetic: its bits) on a weight tensor's 128x128 block (kb, nb) of matrix
// e, then the block's FP8 codes and scale from the new weights rounded to bf16, as
// fp8_quantize_weights_kernel makes them from the compute copy (its bits): the compute copy, which
// went to memory between the two kernels (2 bytes written and 2 read again a parameter), waits in a
// shared tile instead (32 KB), where the counters' rare path reads it. The update goes as
// adamw_kernel's, 4 parameters a thread at a time, a warp along a row (fully used 512-byte loads;
// with 16 parameters a thread at once, 95 registers and 2 blocks of 256 an SM, it ran at half
// adamw_kernel's rate); the codes from fp8_quantize_weights_kernel's pieces of 16 values of a row,
// 2 a thread. VEC as fp8_quantize_weights_kernel's, with the fp32 arrays 16-byte aligned too.
template <bool VEC>
__global__ void __launch_bounds__(FP8_AW_THREADS, FP8_AW_RESIDENT)
adamw_fp8_kernel(float *p, const float *g, float *m, float *v, uint8_t *q, float *scales, float *scales_t, int64_t N,
                 int64_t K, AdamWArgs a, const StepInfo *step, const float *grad_norm_sq, Fp8Scaling how,
                 uint64_t *counts) {
    fp8_count_values(counts, NULL, 0, (int64_t)gridDim.z * N, K);
    __shared__ float scratch[32];
    __shared__ __align__(16) bf16 tile[FP8_BLOCK][FP8_BLOCK]; // the new weights
    AdamWStep k = adamw_step(a, step, grad_norm_sq);
    int64_t e = blockIdx.z, kb = blockIdx.x, nb = blockIdx.y, Kb = gridDim.x, Nb = gridDim.y;
    int64_t n0 = nb * FP8_BLOCK, k0 = kb * FP8_BLOCK;
    float amax = 0;
#pragma unroll 2
    for (int i = threadIdx.x; i < FP8_BLOCK * FP8_BLOCK / 4; i += FP8_AW_THREADS) {
        int r = i / (FP8_BLOCK / 4), c = 4 * (i % (FP8_BLOCK / 4));
        int64_t n = n0 + r, col = k0 + c, at = e * N * K + n * K + col;
        float w[4];
        adamw_quad<VEC>(w, p + at, g + at, m + at, v + at, n < N ? (int)min(K - col, (int64_t)4) : 0, a, k);
        uint2 pair = make_uint2(pack_bf16(w[0], w[1]), pack_bf16(w[2], w[3]));
        *reinterpret_cast<uint2 *>(&tile[r][c]) = pair;
        amax = fmaxf(amax, fp8_piece_amax(make_uint4(pair.x, pair.y, 0, 0)));
    }
    amax = block_max(amax, scratch); // its barriers also make the tile whole
    float s = fp8_block_scale(amax, how), inv = fp8_scale_inverse(s);
    uint32_t sat = fp8_may_saturate_all(amax, inv);
#pragma unroll
    for (int u = threadIdx.x; u < FP8_BLOCK * FP8_BLOCK / 16; u += FP8_AW_THREADS) {
        int r = u / 8, c = 16 * (u % 8);
        const uint4 *raw = reinterpret_cast<const uint4 *>(&tile[r][c]);
        fp8_store_weight_piece<VEC>(q + e * N * K, raw, n0 + r, k0 + c, N, K, inv, sat, &tile[r][c], counts);
    }
    if (threadIdx.x == 0) scales[(e * Kb + kb) * Nb + nb] = s, scales_t[(e * Nb + nb) * Kb + kb] = s;
}

extern "C" void cuda_adamw_update_fp8(void *param, const void *grad, void *m, void *v, void *q, void *scales,
                                      void *scales_t, size_t E, size_t N, size_t K, AdamWArgs a, const StepInfo *step,
                                      const void *grad_norm_sq, Fp8Scaling how, uint64_t *counts) {
    if (!E || !N || !K) return;
    bool vec = N % 16 == 0 && K % 16 == 0 && aligned16(param) && aligned16(grad) && aligned16(m) && aligned16(v) &&
               aligned16(q);
    dim3 grid((unsigned)fp8_blocks(K), (unsigned)fp8_blocks(N), (unsigned)E);
    auto kernel = vec ? adamw_fp8_kernel<true> : adamw_fp8_kernel<false>;
    kernel<<<grid, FP8_AW_THREADS, 0, cuda_ctx.stream>>>((float *)param, (const float *)grad, (float *)m, (float *)v,
                                                        (uint8_t *)q, (float *)scales, (float *)scales_t, (int64_t)N,
                                                        (int64_t)K, a, step, (const float *)grad_norm_sq, how, counts);
    CUDA_LAUNCH_CHECK();
}

// One block of FP8_W_THREADS per 128x128 block (kb, nb) of matrix e of q: its codes into the shared
// tile in 16-byte loads (4 a thread), then out to qt as fp8_store_transposed writes them (a thread
// transposes 16 rows x 4 columns in registers and stores 4 rows of 16 bytes). vec as
// fp8_quantize_weights_kernel's (N and K multiples of 16, 16-byte aligned buffers); else value by
// value. Bound by memory: 2 bytes moved a code.
__global__ void __launch_bounds__(FP8_W_THREADS)
fp8_transpose_codes_kernel(uint8_t *qt, const uint8_t *q, int64_t N, int64_t K, bool vec) {
    __shared__ uint4 tile[FP8_BLOCK][FP8_BLOCK / 16];
    int64_t e = blockIdx.z, n0 = blockIdx.y * (int64_t)FP8_BLOCK, k0 = blockIdx.x * (int64_t)FP8_BLOCK;
    const uint8_t *qe = q + e * N * K;
#pragma unroll
    for (int p = 0; p < FP8_BLOCK * FP8_BLOCK / 16 / FP8_W_THREADS; p++) {
        int u = threadIdx.x + p * FP8_W_THREADS, i = u / 8, c = u % 8;
        int64_t n = n0 + i, k = k0 + 16 * c;
        uint32_t word[4] = {0, 0, 0, 0};
        if (vec && n < N && k < K) {
            uint4 codes = *reinterpret_cast<const uint4 *>(qe + n * K + k);
            word[0] = codes.x, word[1] = codes.y, word[2] = codes.z, word[3] = codes.w;
        } else
#pragma unroll
            for (int j = 0; j < 16; j++)
                if (n < N && k + j < K) word[j / 4] |= (uint32_t)qe[n * K + k + j] << (8 * (j % 4));
        tile[i][fp8_tile_chunk(i, c)] = make_uint4(word[0], word[1], word[2], word[3]);
    }
    __syncthreads();
    fp8_store_transposed(tile, qt + e * K * N + k0 * N + n0, N, K - k0, N - n0, vec);
}

extern "C" void cuda_fp8_transpose_codes(void *qt, const void *q, size_t E, size_t N, size_t K) {
    if (!E || !N || !K) return;
    bool vec = N % 16 == 0 && K % 16 == 0 && aligned16(q) && aligned16(qt);
    dim3 grid((unsigned)fp8_blocks(K), (unsigned)fp8_blocks(N), (unsigned)E);
    fp8_transpose_codes_kernel<<<grid, FP8_W_THREADS, 0, cuda_ctx.stream>>>((uint8_t *)qt, (const uint8_t *)q,
                                                                           (int64_t)N, (int64_t)K, vec);
    CUDA_LAUNCH_CHECK();
}

// The FP8 expert exchange's (train.fp8_exchange) small ops. Scales regrouped: a thread per (row,
// block) of R rows of Kb blocks, in row-major order.
__global__ void fp8_regroup_scales_kernel(float *out, const float *in, const int32_t *offsets, int E, int R, int Kb,
                                          int64_t pitch, bool to_rows) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)R * Kb) return;
    int r = (int)(i / Kb), kb = (int)(i % Kb), r0, rows;
    if (!fp8_row_group(offsets, E, R, r, &r0, &rows)) return;
    size_t grouped = fp8_row_scale_index((size_t)Kb, (size_t)r0, (size_t)rows, (size_t)(r - r0), (size_t)kb);
    int64_t row_major = r * pitch + kb;
    if (to_rows) out[row_major] = in[grouped];
    else out[grouped] = in[row_major];
}

extern "C" void cuda_fp8_regroup_scales(void *out, const void *in, const int32_t *offsets, size_t E, size_t R,
                                        size_t Kb, size_t pitch, bool to_rows) {
    if (!R || !Kb) return;
    fp8_check_index(R, Kb * FP8_BLOCK);
    fp8_regroup_scales_kernel<<<cuda_blocks(R * Kb, 256), 256, 0, cuda_ctx.stream>>>(
        (float *)out, (const float *)in, offsets, (int)E, (int)R, (int)Kb, (int64_t)pitch, to_rows);
    CUDA_LAUNCH_CHECK();
}

// FP8 rows gathered (fp8_gather_rows): a warp per row of R (those of no group leave at once), its
// codes in 16-byte pieces (vec: K a multiple of 16 and both buffers 16-byte aligned), FP8_G_PIECES a
// lane loaded before any is stored, or byte by byte; then its scales, a lane a block, the first 32
// loaded with the codes. The row's token is requested before its group's search, which does not need
// it: every load a lane makes is in flight at once (loaded after the previous piece's store, each
// piece waited for the last: 2% of the kernel's time, docs/PERF.md, twenty-fifth session). Bound by
// memory (~3.6 TB/s): each token's codes are read once for each of its expert rows (top_k times).
#define FP8_G_PIECES 4
__global__ void fp8_gather_rows_kernel(uint8_t *q, float *scales, const uint8_t *tq, const float *tscales,
                                       const int32_t *x_rows, const int32_t *offsets, int E, int R, int K, int T,
                                       bool vec) {
    int r = (int)((blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32), lane = threadIdx.x % 32, r0, rows;
    if (r >= R) return;
    int64_t t = x_rows[r];
    if (!fp8_row_group(offsets, E, R, r, &r0, &rows)) return;
    const uint8_t *src = tq + t * K;
    uint8_t *dst = q + (int64_t)r * K;
    int Kb = (int)fp8_blocks((size_t)K);
    auto token_scale = [&](int kb) { // tscales: one group of T rows
        return tscales[fp8_row_scale_index((size_t)Kb, 0, (size_t)T, (size_t)t, (size_t)kb)];
    };
    float first = lane < Kb ? token_scale(lane) : 0.0f;
    if (vec)
        for (int c0 = 16 * lane; c0 < K; c0 += 16 * 32 * FP8_G_PIECES) {
            uint4 piece[FP8_G_PIECES];
#pragma unroll
            for (int i = 0; i < FP8_G_PIECES; i++)
                if (c0 + 16 * 32 * i < K) piece[i] = *reinterpret_cast<const uint4 *>(src + c0 + 16 * 32 * i);
#pragma unroll
            for (int i = 0; i < FP8_G_PIECES; i++)
                if (c0 + 16 * 32 * i < K) *reinterpret_cast<uint4 *>(dst + c0 + 16 * 32 * i) = piece[i];
        }
    else
        for (int c = lane; c < K; c += 32) dst[c] = src[c];
    for (int kb = lane; kb < Kb; kb += 32)
        *fp8_row_scale_at(scales, K, r, r0, rows, kb) = kb < 32 ? first : token_scale(kb);
}

extern "C" void cuda_fp8_gather_rows(void *q, void *scales, const void *tq, const void *tscales, const int32_t *x_rows,
                                     const int32_t *offsets, size_t E, size_t R, size_t K, size_t T) {
    if (!R || !K) return;
    fp8_check_index(R, K), fp8_check_index(T, K);
    bool vec = K % 16 == 0 && aligned16(q) && aligned16(tq);
    fp8_gather_rows_kernel<<<cuda_blocks(R * 32, 256), 256, 0, cuda_ctx.stream>>>(
        (uint8_t *)q, (float *)scales, (const uint8_t *)tq, (const float *)tscales, x_rows, offsets, (int)E, (int)R,
        (int)K, (int)T, vec);
    CUDA_LAUNCH_CHECK();
}

// Rows dequantised: a thread per 16 codes of a row, all in one 1x128 block (one 16-byte load and two
// 16-byte stores with vec: K a multiple of 16 and both buffers 16-byte aligned; else value by
// value), converted two at a time by the hardware (E4M3 to fp16 is exact) and multiplied by their
// block's scale in fp32.
__global__ void fp8_dequantize_rows_kernel(bf16 *x, const uint8_t *q, const float *scales, const int32_t *offsets,
                                           int E, int R, int K, bool vec) {
    int64_t pieces = (K + 15) / 16, i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)R * pieces) return;
    int r = (int)(i / pieces), k = (int)(i % pieces) * 16, n = min(16, K - k), r0, rows;
    if (!fp8_row_group(offsets, E, R, r, &r0, &rows)) return;
    float s = scales[(int64_t)fp8_blocks((size_t)K) * r0 + (int64_t)(k / FP8_BLOCK) * rows + (r - r0)];
    const uint8_t *src = q + (int64_t)r * K + k;
    uint32_t w[4] = {0, 0, 0, 0};
    if (vec) {
        uint4 codes = *reinterpret_cast<const uint4 *>(src);
        w[0] = codes.x, w[1] = codes.y, w[2] = codes.z, w[3] = codes.w;
    } else
        for (int j = 0; j < n; j++) w[j / 4] |= (uint32_t)src[j] << (8 * (j % 4));
    bf16 *dst = x + (int64_t)r * K + k;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; j += 2) {
            uint32_t word = w[(8 * h + j) / 4] >> (8 * (j % 4));
            __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(word & 0xffffu), __NV_E4M3);
            float2 f = __half22float2(*reinterpret_cast<const __half2 *>(&raw));
            v[j] = f.x * s, v[j + 1] = f.y * s;
        }
        fp8_store_piece(dst + 8 * h, pack8(v), n - 8 * h, vec);
    }
}

extern "C" void cuda_fp8_dequantize_rows(void *x, const void *q, const void *scales, const int32_t *offsets, size_t E,
                                         size_t R, size_t K) {
    if (!R || !K) return;
    fp8_check_index(R, K);
    bool vec = K % 16 == 0 && aligned16(x) && aligned16(q);
    fp8_dequantize_rows_kernel<<<cuda_blocks(R * ((K + 15) / 16), 256), 256, 0, cuda_ctx.stream>>>(
        (bf16 *)x, (const uint8_t *)q, (const float *)scales, offsets, (int)E, (int)R, (int)K, vec);
    CUDA_LAUNCH_CHECK();
}

__global__ void fp8_one_group(int32_t *offsets, int32_t rows) { offsets[0] = 0, offsets[1] = rows; }

const int32_t *cuda_fp8_one_group(size_t rows) {
    static void *buf;
    static size_t have;
    int32_t *offsets = (int32_t *)cuda_grow_scratch(&buf, &have, 2 * sizeof(int32_t));
    fp8_one_group<<<1, 1, 0, cuda_ctx.stream>>>(offsets, (int32_t)rows);
    CUDA_LAUNCH_CHECK();
    return offsets;
}

extern "C" void cuda_fp8_matmul(void *out, const void *a, const void *a_scales, const void *b, const void *b_scales,
                                size_t M, size_t N, size_t K) {
    if (cuda_lt_fp8_matmul(out, a, a_scales, b, b_scales, M, N, K)) return;
    cuda_fp8_grouped_matmul(out, a, a_scales, b, b_scales, cuda_fp8_one_group(M), 1, N, K, M);
}

// Every fp32 bit pattern through the recipe's GPU code and its reference, counting those that
// differ and keeping the first: fp8_e4m3_encode (the hardware conversion here) against
// fp8_e4m3_encode_exact (FP8_CHECK_ENCODER), or fp8_block_scale (its quotient by an FMA correction)
// against the scale of IEEE division's quotient (FP8_CHECK_SCALE_AMAX, _POW2; every finite amax and
// infinity, as magnitudes are).
__device__ bool fp8_recipe_differs(Fp8Check what, uint32_t u) {
    float x = __uint_as_float(u);
    if (what == FP8_CHECK_ENCODER) return fp8_e4m3_encode(x) != fp8_e4m3_encode_exact(x);
    if (u > 0x7f800000u) return false;
    Fp8Scaling how = what == FP8_CHECK_SCALE_AMAX ? FP8_SCALE_AMAX : FP8_SCALE_POW2;
    return __float_as_uint(fp8_block_scale(x, how)) !=
           __float_as_uint(fp8_scale_of_quotient(__fdiv_rn(x, FP8_E4M3_MAX), how));
}

__global__ void fp8_recipe_check_kernel(Fp8Check what, unsigned long long *bad, uint32_t *first) {
    uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    unsigned long long n = 0;
    for (uint64_t u = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; u < (1ull << 32); u += stride) {
        if (fp8_recipe_differs(what, (uint32_t)u)) {
            if (!n) atomicMin(first, (uint32_t)u);
            n++;
        }
    }
    if (n) atomicAdd(bad, n);
}

extern "C" uint64_t cuda_fp8_recipe_mismatches(Fp8Check what, uint32_t *first) {
    unsigned long long *bad;
    uint32_t *lowest;
    CUDA_CHECK(cudaMalloc(&bad, sizeof *bad + sizeof *lowest));
    lowest = (uint32_t *)(bad + 1);
    CUDA_CHECK(cudaMemset(bad, 0, sizeof *bad));
    CUDA_CHECK(cudaMemset(lowest, 0xff, sizeof *lowest));
    fp8_recipe_check_kernel<<<4096, 256, 0, cuda_ctx.stream>>>(what, bad, lowest);
    CUDA_LAUNCH_CHECK();
    unsigned long long n;
    CUDA_CHECK(cudaMemcpyAsync(&n, bad, sizeof n, cudaMemcpyDeviceToHost, cuda_ctx.stream));
    CUDA_CHECK(cudaMemcpyAsync(first, lowest, sizeof *first, cudaMemcpyDeviceToHost, cuda_ctx.stream));
    CUDA_CHECK(cudaStreamSynchronize(cuda_ctx.stream));
    CUDA_CHECK(cudaFree(bad));
    return n;
}

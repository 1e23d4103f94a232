// FP8 quantisation on the GPU (the recipe of ops/fp8.h, bit for bit as the CPU emulation does it):
// bf16 rows in 1x128 blocks (alone, or fused with the SwiGLU that produces them), the token-major
// per-expert copies the weight gradient reads, weights in 128x128 blocks with their transpose; and
// the dense FP8 product, run as a grouped one of one group (cuda_grouped_sm90_fp8.cu).
#include "cuda_common.cuh"
#include "cuda_ops.h"

// The group of row r among offsets (E + 1) i32 (NULL: one group of R rows): its first row and its
// row count; false for rows of no group (before the first, as in a chunk of experts, or past the last).
__device__ bool fp8_row_group(const int32_t *offsets, int E, int64_t R, int64_t r, int64_t *r0, int64_t *rows) {
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

// The 1x128 block of a row that a warp quantises (a warp per (row, block)): the row r, its group's
// first row r0 and row count, the block kb, the lane's first column k and element at; vec: whole
// 4-value pieces (K % 4 == 0), moved 8 bytes (bf16) or 4 (codes) at a time.
typedef struct {
    int64_t r, r0, rows, kb, k, at;
    bool vec;
} Fp8RowBlock;

// This warp's block of R rows of K among offsets (as fp8_row_group); false: the row is in no group.
__device__ bool fp8_row_block(const int32_t *offsets, int E, int64_t R, int K, Fp8RowBlock *b) {
    int64_t warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5, Kb = (int64_t)fp8_blocks((size_t)K);
    b->r = warp / Kb, b->kb = warp % Kb;
    b->k = b->kb * FP8_BLOCK + 4 * (threadIdx.x & 31), b->at = b->r * K + b->k;
    b->vec = (K & 3) == 0 && b->k < K;
    return b->r < R && fp8_row_group(offsets, E, R, b->r, &b->r0, &b->rows);
}

// The lane's 4 values from p (n of them in the row; the rest 0), and back as bf16.
__device__ __forceinline__ void fp8_load4(float v[4], const bf16 *p, int64_t n, bool vec) {
    if (vec) {
        uint2 u = *reinterpret_cast<const uint2 *>(p);
        const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&u);
        float2 a = __bfloat1622float2(h[0]), b = __bfloat1622float2(h[1]);
        v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
    } else {
        for (int i = 0; i < 4; i++) v[i] = i < n ? bf(p[i]) : 0.0f;
    }
}

__device__ __forceinline__ void fp8_store4(bf16 *p, const float v[4], int64_t n, bool vec) {
    if (vec) {
        __nv_bfloat162 h[2] = {__floats2bfloat162_rn(v[0], v[1]), __floats2bfloat162_rn(v[2], v[3])};
        *reinterpret_cast<uint2 *>(p) = *reinterpret_cast<const uint2 *>(h);
    } else {
        for (int i = 0; i < 4 && i < n; i++) p[i] = to_bf(v[i]);
    }
}

// The block's scale from the warp's values (4 a lane) and their codes into q and scales, laid out
// as fp8_quantize_rows writes them.
__device__ void fp8_store_row_block(uint8_t *q, float *scales, const Fp8RowBlock *b, const float v[4], int K,
                                    Fp8Scaling how) {
    float amax = 0;
    for (int i = 0; i < 4; i++) amax = fmaxf(amax, fabsf(v[i]));
    float s = fp8_block_scale(warp_max(amax), how);
    uint32_t codes = 0;
    for (int i = 0; i < 4; i++) codes |= (uint32_t)fp8_quantize(v[i], s) << (8 * i);
    if (b->vec) *reinterpret_cast<uint32_t *>(q + b->at) = codes;
    else
        for (int i = 0; i < 4; i++)
            if (b->k + i < K) q[b->at + i] = (uint8_t)(codes >> (8 * i));
    if ((threadIdx.x & 31) == 0) scales[(int64_t)fp8_blocks((size_t)K) * b->r0 + b->kb * b->rows + (b->r - b->r0)] = s;
}

__global__ void fp8_quantize_rows_kernel(uint8_t *q, float *scales, const bf16 *x, const int32_t *offsets, int E,
                                         int64_t R, int K, Fp8Scaling how) {
    Fp8RowBlock b;
    if (!fp8_row_block(offsets, E, R, K, &b)) return; // the whole warp leaves
    float v[4];
    fp8_load4(v, x + b.at, K - b.k, b.vec);
    fp8_store_row_block(q, scales, &b, v, K, how);
}

extern "C" void cuda_fp8_quantize_rows(void *q, void *scales, const void *x, const int32_t *offsets, size_t E, size_t R,
                                       size_t K, Fp8Scaling how) {
    size_t warps = R * fp8_blocks(K);
    fp8_quantize_rows_kernel<<<cuda_blocks(warps * 32, 256), 256, 0, cuda_ctx.stream>>>(
        (uint8_t *)q, (float *)scales, (const bf16 *)x, offsets, (int)E, (int64_t)R, (int)K, how);
    CUDA_LAUNCH_CHECK();
}

// SwiGLU with its output's quantised rows in the same pass (a warp per (row, 128-block), as the
// quantisation alone): the values rounded to bf16 as stored, then quantised, so that the codes are
// those of fp8_quantize_rows on the stored output.
__global__ void swiglu_forward_fp8_kernel(bf16 *out, uint8_t *q, float *scales, const bf16 *gu,
                                          const int32_t *offsets, int E, int64_t R, int H, Fp8Scaling how) {
    Fp8RowBlock b;
    if (!fp8_row_block(offsets, E, R, H, &b)) return;
    float g[4], u[4], v[4];
    const bf16 *gate = gu + b.r * 2 * H + b.k;
    fp8_load4(g, gate, H - b.k, b.vec), fp8_load4(u, gate + H, H - b.k, b.vec);
    for (int i = 0; i < 4; i++) v[i] = bf(to_bf(swiglu_value(g[i], u[i])));
    fp8_store4(out + b.at, v, H - b.k, b.vec);
    fp8_store_row_block(q, scales, &b, v, H, how);
}

extern "C" void cuda_swiglu_forward_fp8(void *out, void *q, void *scales, const void *gu, const int32_t *offsets,
                                        size_t E, size_t R, size_t H, Fp8Scaling how) {
    if (!R) return;
    size_t warps = R * fp8_blocks(H);
    swiglu_forward_fp8_kernel<<<cuda_blocks(warps * 32, 256), 256, 0, cuda_ctx.stream>>>(
        (bf16 *)out, (uint8_t *)q, (float *)scales, (const bf16 *)gu, offsets, (int)E, (int64_t)R, (int)H, how);
    CUDA_LAUNCH_CHECK();
}

// The rows of x that land in token-major block b (columns [128 b, 128 b + 128)): first row and
// count, 0 rows for a block of no expert (past an expert's rows, or before the first expert's when
// offsets[0] > 0, as for a chunk of experts). Its expert is the last one starting at or before it.
__device__ void fp8_block_rows(const int32_t *offsets, int E, int64_t b, int64_t *first, int64_t *n) {
    int lo = 0, hi = E - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if ((int64_t)fp8_expert_col((size_t)offsets[mid], (size_t)mid) <= FP8_BLOCK * b) lo = mid;
        else hi = mid - 1;
    }
    int64_t into = FP8_BLOCK * b - (int64_t)fp8_expert_col((size_t)offsets[lo], (size_t)lo);
    int64_t rows = offsets[lo + 1] - offsets[lo];
    *first = offsets[lo] + into;
    *n = into >= 0 && into < rows ? min((int64_t)FP8_BLOCK, rows - into) : 0;
}

// Block (32, 8) per (32 columns, token-major block b): the 128 x 32 tile through shared memory,
// a column's amax over the tile, 4 codes a thread written along the token dimension.
__global__ void fp8_quantize_cols_kernel(uint8_t *qt, float *scales, const bf16 *x, const int32_t *offsets, int E,
                                         int64_t C, int64_t Rt, Fp8Scaling how) {
    __shared__ float tile[FP8_BLOCK][33], part[8][32], scale[32];
    int tx = threadIdx.x, ty = threadIdx.y;
    int64_t c0 = (int64_t)blockIdx.x * 32, b = blockIdx.y, first, n;
    fp8_block_rows(offsets, E, b, &first, &n);
    float amax = 0;
    for (int i = ty; i < FP8_BLOCK; i += 8) {
        tile[i][tx] = i < n && c0 + tx < C ? bf(x[(first + i) * C + c0 + tx]) : 0.0f;
        amax = fmaxf(amax, fabsf(tile[i][tx]));
    }
    part[ty][tx] = amax;
    __syncthreads();
    if (ty == 0) {
        for (int j = 1; j < 8; j++) amax = fmaxf(amax, part[j][tx]);
        scale[tx] = fp8_block_scale(amax, how);
        if (c0 + tx < C) scales[b * C + c0 + tx] = scale[tx];
    }
    __syncthreads();
    for (int cl = ty; cl < 32 && c0 + cl < C; cl += 8) {
        uint32_t codes = 0;
        for (int i = 0; i < 4; i++) codes |= (uint32_t)fp8_quantize(tile[4 * tx + i][cl], scale[cl]) << (8 * i);
        *reinterpret_cast<uint32_t *>(qt + (c0 + cl) * Rt + FP8_BLOCK * b + 4 * tx) = codes;
    }
}

extern "C" void cuda_fp8_quantize_cols(void *qt, void *scales, const void *x, const int32_t *offsets, size_t E,
                                       size_t R, size_t C, Fp8Scaling how) {
    size_t Rt = fp8_expert_cols(R, E);
    dim3 grid((unsigned)((C + 31) / 32), (unsigned)(Rt / FP8_BLOCK)), block(32, 8);
    fp8_quantize_cols_kernel<<<grid, block, 0, cuda_ctx.stream>>>((uint8_t *)qt, (float *)scales, (const bf16 *)x,
                                                                  offsets, (int)E, (int64_t)C, (int64_t)Rt, how);
    CUDA_LAUNCH_CHECK();
}

// The weights' kernel: a block of FP8_W_THREADS threads per 128x128 block, each thread holding
// FP8_W_PIECES pieces of 16 consecutive values of a row.
#define FP8_W_THREADS 256
#define FP8_W_PIECES (FP8_BLOCK * FP8_BLOCK / 16 / FP8_W_THREADS)

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

// One block per 128x128 block (kb, nb) of weight matrix e. Its values stay in registers (16-byte
// loads) from the amax to the codes, which go to q in 16-byte stores and, through the shared tile,
// to qt: a thread reads 16 rows x 4 columns of codes as 16 words, transposes them in registers and
// stores 4 rows of qt, 16 bytes each. vec: N and K multiples of 16 and 16-byte aligned buffers, so
// that every piece is whole or wholly outside; else loads and stores go value by value.
__global__ void __launch_bounds__(FP8_W_THREADS)
fp8_quantize_weights_kernel(uint8_t *q, uint8_t *qt, float *scales, float *scales_t, const bf16 *w, int64_t N,
                            int64_t K, bool vec, Fp8Scaling how) {
    __shared__ uint4 tile[FP8_BLOCK][FP8_BLOCK / 16];
    __shared__ float scratch[32];
    int64_t e = blockIdx.z, kb = blockIdx.x, nb = blockIdx.y, Kb = gridDim.x, Nb = gridDim.y;
    int64_t n0 = nb * FP8_BLOCK, k0 = kb * FP8_BLOCK;
    const bf16 *we = w + e * N * K;
    float v[FP8_W_PIECES][16], amax = 0;
#pragma unroll
    for (int p = 0; p < FP8_W_PIECES; p++) {
        int u = threadIdx.x + p * FP8_W_THREADS;
        int64_t n = n0 + u / 8, k = k0 + 16 * (u % 8);
        if (vec && n < N && k < K) load8(v[p], we + n * K + k), load8(v[p] + 8, we + n * K + k + 8);
        else
#pragma unroll
            for (int j = 0; j < 16; j++) v[p][j] = n < N && k + j < K ? bf(we[n * K + k + j]) : 0.0f;
#pragma unroll
        for (int j = 0; j < 16; j++) amax = fmaxf(amax, fabsf(v[p][j]));
    }
    float s = fp8_block_scale(block_max(amax, scratch), how);
#pragma unroll
    for (int p = 0; p < FP8_W_PIECES; p++) {
        int u = threadIdx.x + p * FP8_W_THREADS, i = u / 8, c = u % 8;
        int64_t n = n0 + i, k = k0 + 16 * c;
        uint32_t word[4] = {0, 0, 0, 0};
#pragma unroll
        for (int j = 0; j < 16; j++) word[j / 4] |= (uint32_t)fp8_quantize(v[p][j], s) << (8 * (j % 4));
        uint4 codes = make_uint4(word[0], word[1], word[2], word[3]);
        tile[i][fp8_tile_chunk(i, c)] = codes;
        uint8_t *dst = q + e * N * K + n * K + k;
        if (vec && n < N && k < K) *reinterpret_cast<uint4 *>(dst) = codes;
        else
#pragma unroll
            for (int j = 0; j < 16; j++)
                if (n < N && k + j < K) dst[j] = (uint8_t)(word[j / 4] >> (8 * (j % 4)));
    }
    __syncthreads();
    int kq = threadIdx.x / 8, r = threadIdx.x % 8; // columns [4 kq, + 4) of rows [16 r, + 16)
    int64_t n = n0 + 16 * r;
    uint32_t col[16];
#pragma unroll
    for (int ii = 0; ii < 16; ii++) {
        int i = 16 * r + ii;
        col[ii] = reinterpret_cast<const uint32_t *>(&tile[i][fp8_tile_chunk(i, kq / 4)])[kq % 4];
    }
    uint8_t *dst = qt + e * K * N + (k0 + 4 * kq) * N + n;
    if (vec) {
#pragma unroll
        for (int g = 0; g < 4; g++) fp8_transpose4(col[4 * g], col[4 * g + 1], col[4 * g + 2], col[4 * g + 3]);
#pragma unroll
        for (int m = 0; m < 4; m++)
            if (n < N && k0 + 4 * kq + m < K)
                *reinterpret_cast<uint4 *>(dst + m * N) = make_uint4(col[m], col[4 + m], col[8 + m], col[12 + m]);
    } else {
#pragma unroll
        for (int m = 0; m < 4; m++)
#pragma unroll
            for (int ii = 0; ii < 16; ii++)
                if (k0 + 4 * kq + m < K && n + ii < N) dst[m * N + ii] = (uint8_t)(col[ii] >> (8 * m));
    }
    if (threadIdx.x == 0) scales[(e * Kb + kb) * Nb + nb] = s, scales_t[(e * Nb + nb) * Kb + kb] = s;
}

static bool aligned16(const void *p) { return (uintptr_t)p % 16 == 0; }

extern "C" void cuda_fp8_quantize_weights(void *q, void *qt, void *scales, void *scales_t, const void *w, size_t E,
                                          size_t N, size_t K, Fp8Scaling how) {
    if (!E || !N || !K) return;
    bool vec = N % 16 == 0 && K % 16 == 0 && aligned16(q) && aligned16(qt) && aligned16(w);
    dim3 grid((unsigned)fp8_blocks(K), (unsigned)fp8_blocks(N), (unsigned)E);
    fp8_quantize_weights_kernel<<<grid, FP8_W_THREADS, 0, cuda_ctx.stream>>>(
        (uint8_t *)q, (uint8_t *)qt, (float *)scales, (float *)scales_t, (const bf16 *)w, (int64_t)N, (int64_t)K, vec,
        how);
    CUDA_LAUNCH_CHECK();
}

__global__ void fp8_one_group(int32_t *offsets, int32_t rows) { offsets[0] = 0, offsets[1] = rows; }

extern "C" void cuda_fp8_matmul(void *out, const void *a, const void *a_scales, const void *b, const void *b_scales,
                                size_t M, size_t N, size_t K) {
    static void *buf;
    static size_t have;
    int32_t *offsets = (int32_t *)cuda_grow_scratch(&buf, &have, 2 * sizeof(int32_t));
    fp8_one_group<<<1, 1, 0, cuda_ctx.stream>>>(offsets, (int32_t)M);
    CUDA_LAUNCH_CHECK();
    cuda_fp8_grouped_matmul(out, a, a_scales, b, b_scales, offsets, 1, N, K, M);
}

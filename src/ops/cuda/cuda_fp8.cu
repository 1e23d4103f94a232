// FP8 quantisation on the GPU (the recipe of ops/fp8.h, bit for bit as the CPU emulation does it):
// bf16 rows in 1x128 blocks, the token-major per-expert copies the weight gradient reads, weights in
// 128x128 blocks with their transpose; and the dense FP8 product, run as a grouped one of one group
// (cuda_grouped_sm90_fp8.cu).
#include "cuda_common.cuh"
#include "cuda_ops.h"

// The group of row r among offsets (E + 1) i32 (NULL: one group of R rows): its first row and its
// row count; false for rows past every group.
__device__ bool fp8_row_group(const int32_t *offsets, int E, int64_t R, int64_t r, int64_t *r0, int64_t *rows) {
    if (!offsets) {
        *r0 = 0, *rows = R;
        return true;
    }
    if (r >= offsets[E]) return false;
    int lo = 0, hi = E - 1; // the last group starting at or before r (empty groups start there too)
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (offsets[mid] <= r) lo = mid;
        else hi = mid - 1;
    }
    *r0 = offsets[lo], *rows = offsets[lo + 1] - offsets[lo];
    return true;
}

// One warp per (row, 128-block): 4 values a lane, 8-byte loads and 4-byte stores when K % 4 == 0.
__global__ void fp8_quantize_rows_kernel(uint8_t *q, float *scales, const bf16 *x, const int32_t *offsets, int E,
                                         int64_t R, int K, Fp8Scaling how) {
    int64_t warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5, Kb = (int64_t)fp8_blocks((size_t)K);
    int lane = threadIdx.x & 31;
    int64_t r = warp / Kb, kb = warp % Kb, r0, rows;
    if (r >= R || !fp8_row_group(offsets, E, R, r, &r0, &rows)) return; // the whole warp leaves
    int64_t k = kb * FP8_BLOCK + 4 * lane, at = r * K + k;
    bool vec = (K & 3) == 0 && k < K;
    float v[4], amax = 0;
    if (vec) {
        uint2 u = *reinterpret_cast<const uint2 *>(x + at);
        const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&u);
        float2 a = __bfloat1622float2(h[0]), b = __bfloat1622float2(h[1]);
        v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
    } else {
        for (int i = 0; i < 4; i++) v[i] = k + i < K ? bf(x[at + i]) : 0.0f;
    }
    for (int i = 0; i < 4; i++) amax = fmaxf(amax, fabsf(v[i]));
    float s = fp8_block_scale(warp_max(amax), how);
    uint32_t codes = 0;
    for (int i = 0; i < 4; i++) codes |= (uint32_t)fp8_quantize(v[i], s) << (8 * i);
    if (vec) *reinterpret_cast<uint32_t *>(q + at) = codes;
    else
        for (int i = 0; i < 4; i++)
            if (k + i < K) q[at + i] = (uint8_t)(codes >> (8 * i));
    if (lane == 0) scales[Kb * r0 + kb * rows + (r - r0)] = s;
}

extern "C" void cuda_fp8_quantize_rows(void *q, void *scales, const void *x, const int32_t *offsets, size_t E, size_t R,
                                       size_t K, Fp8Scaling how) {
    size_t warps = R * fp8_blocks(K);
    fp8_quantize_rows_kernel<<<cuda_blocks(warps * 32, 256), 256, 0, cuda_ctx.stream>>>(
        (uint8_t *)q, (float *)scales, (const bf16 *)x, offsets, (int)E, (int64_t)R, (int)K, how);
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

// One block per 128x128 block (kb, nb) of weight matrix e: its amax, the codes row-major into q and,
// through shared memory, column-major into qt.
__global__ void fp8_quantize_weights_kernel(uint8_t *q, uint8_t *qt, float *scales, float *scales_t, const bf16 *w,
                                            int N, int K, Fp8Scaling how) {
    __shared__ uint8_t codes[FP8_BLOCK][FP8_BLOCK + 4];
    __shared__ float scratch[32];
    int64_t e = blockIdx.z, kb = blockIdx.x, nb = blockIdx.y, Kb = gridDim.x, Nb = gridDim.y;
    int64_t n0 = nb * FP8_BLOCK, k0 = kb * FP8_BLOCK, base = e * N * K;
    int rows = (int)min((int64_t)FP8_BLOCK, N - n0), cols = (int)min((int64_t)FP8_BLOCK, K - k0);
    float amax = 0;
    for (int at = threadIdx.x; at < FP8_BLOCK * FP8_BLOCK; at += blockDim.x) {
        int i = at / FP8_BLOCK, j = at % FP8_BLOCK;
        if (i < rows && j < cols) amax = fmaxf(amax, fabsf(bf(w[base + (n0 + i) * K + k0 + j])));
    }
    float s = fp8_block_scale(block_max(amax, scratch), how);
    for (int at = threadIdx.x; at < FP8_BLOCK * FP8_BLOCK; at += blockDim.x) {
        int i = at / FP8_BLOCK, j = at % FP8_BLOCK;
        if (i < rows && j < cols) {
            uint8_t c = fp8_quantize(bf(w[base + (n0 + i) * K + k0 + j]), s);
            q[base + (n0 + i) * K + k0 + j] = c;
            codes[i][j] = c;
        }
    }
    __syncthreads();
    for (int at = threadIdx.x; at < FP8_BLOCK * FP8_BLOCK; at += blockDim.x) {
        int j = at / FP8_BLOCK, i = at % FP8_BLOCK;
        if (i < rows && j < cols) qt[base + (k0 + j) * N + n0 + i] = codes[i][j];
    }
    if (threadIdx.x == 0) scales[(e * Kb + kb) * Nb + nb] = s, scales_t[(e * Nb + nb) * Kb + kb] = s;
}

extern "C" void cuda_fp8_quantize_weights(void *q, void *qt, void *scales, void *scales_t, const void *w, size_t E,
                                          size_t N, size_t K, Fp8Scaling how) {
    dim3 grid((unsigned)fp8_blocks(K), (unsigned)fp8_blocks(N), (unsigned)E);
    fp8_quantize_weights_kernel<<<grid, 256, 0, cuda_ctx.stream>>>((uint8_t *)q, (uint8_t *)qt, (float *)scales,
                                                                   (float *)scales_t, (const bf16 *)w, (int)N,
                                                                   (int)K, how);
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

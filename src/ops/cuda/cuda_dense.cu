// CUDA kernels for the dense ops: embedding, RMSNorm, residual add, SwiGLU, fused cross-entropy,
// sum of squares, AdamW, the fp32 -> bf16 weight copy and the initial weights. Reductions are in fp32.
#include <cub/cub.cuh>

#include "common/rng.h"
#include "cuda_common.cuh"
#include "cuda_mma.cuh"
#include "cuda_ops.h"

#define STREAM cuda_ctx.stream

// ---------------------------------------------------------------- embedding

__global__ void embedding_forward_kernel(bf16 *out, const int32_t *tokens, const bf16 *wte, size_t T, size_t D) {
    size_t t = blockIdx.x;
    const bf16 *row = wte + (size_t)tokens[t] * D;
    for (size_t j = threadIdx.x; j < D; j += blockDim.x) out[t * D + j] = row[j];
}

// Backward: the positions sorted by token (CUB's stable radix sort), then a block per run of equal
// tokens adds that run's gradient rows to the token's row, in position order (deterministic, no
// atomics).
__global__ void iota_kernel(int32_t *v, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) v[i] = (int32_t)i;
}

__global__ void embedding_backward_kernel(float *dwte, const bf16 *dout, const int32_t *sorted_tokens,
                                          const int32_t *positions, size_t T, size_t D) {
    size_t i = blockIdx.x;
    int32_t token = sorted_tokens[i];
    if (i > 0 && sorted_tokens[i - 1] == token) return; // not the start of a run
    float *row = dwte + (size_t)token * D;
    for (size_t j = 8 * threadIdx.x; j < D; j += 8 * blockDim.x) {
        float acc[8] = {}, v[8];
        for (size_t k = i; k < T && sorted_tokens[k] == token; k++) {
            load8(v, dout + (size_t)positions[k] * D + j);
            for (int e = 0; e < 8; e++) acc[e] += v[e];
        }
        for (int e = 0; e < 8; e++) row[j + e] += acc[e];
    }
}

extern "C" void cuda_embedding_forward(void *out, const int32_t *tokens, const void *wte, size_t T, size_t D) {
    if (!T) return;
    embedding_forward_kernel<<<(unsigned)T, 256, 0, STREAM>>>((bf16 *)out, tokens, (const bf16 *)wte, T, D);
    CUDA_LAUNCH_CHECK();
}

extern "C" void cuda_embedding_backward(void *dwte, const void *dout, const int32_t *tokens, size_t T, size_t D, size_t V) {
    static void *buf;
    static size_t have;
    if (!T) return;
    int bits = 1;
    while (bits < 31 && ((size_t)1 << bits) < V) bits++;
    size_t temp = 0;
    CUDA_CHECK(cub::DeviceRadixSort::SortPairs(NULL, temp, (const int32_t *)NULL, (int32_t *)NULL,
                                               (const int32_t *)NULL, (int32_t *)NULL, (int)T, 0, bits, STREAM));
    size_t ints = (3 * T + 63) / 64 * 64; // positions, sorted tokens, sorted positions; CUB's part 256-byte aligned
    char *base = (char *)cuda_grow_scratch(&buf, &have, ints * sizeof(int32_t) + temp);
    int32_t *iota = (int32_t *)base, *sorted_tokens = iota + T, *positions = sorted_tokens + T;
    iota_kernel<<<cuda_blocks(T, 256), 256, 0, STREAM>>>(iota, T);
    CUDA_LAUNCH_CHECK();
    CUDA_CHECK(cub::DeviceRadixSort::SortPairs(base + ints * sizeof(int32_t), temp, tokens, sorted_tokens, iota,
                                               positions, (int)T, 0, bits, STREAM));
    embedding_backward_kernel<<<(unsigned)T, 128, 0, STREAM>>>((float *)dwte, (const bf16 *)dout, sorted_tokens,
                                                               positions, T, D);
    CUDA_LAUNCH_CHECK();
}

// ---------------------------------------------------------------- RMSNorm

// Forward: one warp per row. ADD: the row is sum = a + b (x = a), rounded to bf16 and written
// first, then normalised (each lane reads back the values it wrote).
template <bool ADD>
__global__ void rmsnorm_forward_kernel(bf16 *out, float *rstd, bf16 *sum, const bf16 *x, const bf16 *b, const bf16 *w,
                                       size_t R, size_t W, float eps) {
    size_t r = (size_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x & 31;
    if (r >= R) return;
    const bf16 *xr = ADD ? sum + r * W : x + r * W;
    float rs = rmsnorm_row_rstd<ADD>(ADD ? sum + r * W : NULL, x + r * W, ADD ? b + r * W : NULL, W, eps, lane);
    for (size_t j = 8 * lane; j < W; j += 256) {
        float v[8], g[8];
        load8(v, xr + j), load8(g, w + j);
        for (int k = 0; k < 8; k++) v[k] *= rs * g[k];
        store8(out + r * W + j, v);
    }
    if (lane == 0) rstd[r] = rs;
}

// Backward: a block takes ROWS rows at a time, striding over the rows; thread tid holds the
// 16-byte chunks tid + k blockDim (k < CHUNKS) of each row (dout, x and, accumulating, dx's old
// values, all loaded before the first sum waits on them), so the row dots reduce over the block
// and each thread sums the weight gradient of its own columns in registers. Each block writes its
// sums to a row of dw_part, and cuda_add_column_sums adds the rows to dw in a fixed order
// (deterministic, no atomics).
#define NORM_BACKWARD_THREADS 256

template <int CHUNKS, int ROWS>
__global__ void rmsnorm_backward_kernel(bf16 *dx, float *dw_part, const bf16 *dout, const bf16 *x, const bf16 *w,
                                        const float *rstd, size_t R, size_t W, bool accumulate) {
    __shared__ float red[32][ROWS];
    int W8 = (int)(W / 8), lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    float wv[CHUNKS][8], dw[CHUNKS][8] = {};
#pragma unroll
    for (int k = 0; k < CHUNKS; k++) {
        int c = k * blockDim.x + threadIdx.x;
        if (c < W8) load8(wv[k], w + 8 * c);
    }
    for (size_t r0 = (size_t)blockIdx.x * ROWS; r0 < R; r0 += (size_t)gridDim.x * ROWS) {
        uint4 gu[ROWS][CHUNKS], xu[ROWS][CHUNKS], ou[ROWS][CHUNKS]; // ou: dx's old values (accumulate)
        float dot[ROWS];
#pragma unroll
        for (int q = 0; q < ROWS; q++) {
            dot[q] = 0;
#pragma unroll
            for (int k = 0; k < CHUNKS; k++) {
                int c = k * blockDim.x + threadIdx.x;
                bool in = r0 + q < R && c < W8;
                uint4 zero = make_uint4(0, 0, 0, 0);
                gu[q][k] = in ? *reinterpret_cast<const uint4 *>(dout + (r0 + q) * W + 8 * c) : zero;
                xu[q][k] = in ? *reinterpret_cast<const uint4 *>(x + (r0 + q) * W + 8 * c) : zero;
                ou[q][k] = in && accumulate ? *reinterpret_cast<const uint4 *>(dx + (r0 + q) * W + 8 * c) : zero;
                float g[8], xv[8];
                unpack8(g, gu[q][k]), unpack8(xv, xu[q][k]);
                for (int e = 0; e < 8; e++) dot[q] += c < W8 ? g[e] * wv[k][e] * xv[e] : 0.0f;
            }
            dot[q] = warp_sum(dot[q]);
            if (lane == 0) red[warp][q] = dot[q];
        }
        __syncthreads();
#pragma unroll
        for (int q = 0; q < ROWS; q++) {
            dot[q] = 0;
            for (int i = 0; i < nwarps; i++) dot[q] += red[i][q];
        }
        __syncthreads();
#pragma unroll
        for (int q = 0; q < ROWS; q++) {
            if (r0 + q >= R) break;
            float rs = rstd[r0 + q], coef = dot[q] * rs * rs * rs / (float)W;
#pragma unroll
            for (int k = 0; k < CHUNKS; k++) {
                int c = k * blockDim.x + threadIdx.x;
                if (c >= W8) continue;
                float g[8], xv[8], v[8], old[8];
                unpack8(g, gu[q][k]), unpack8(xv, xu[q][k]), unpack8(old, ou[q][k]);
                for (int e = 0; e < 8; e++) {
                    dw[k][e] += g[e] * xv[e] * rs;
                    v[e] = rs * wv[k][e] * g[e] - coef * xv[e] + old[e];
                }
                store8(dx + (r0 + q) * W + 8 * c, v);
            }
        }
    }
#pragma unroll
    for (int k = 0; k < CHUNKS; k++) {
        int c = k * blockDim.x + threadIdx.x;
        if (c >= W8) continue;
        float4 *out = reinterpret_cast<float4 *>(dw_part + (size_t)blockIdx.x * W + 8 * c);
        out[0] = make_float4(dw[k][0], dw[k][1], dw[k][2], dw[k][3]);
        out[1] = make_float4(dw[k][4], dw[k][5], dw[k][6], dw[k][7]);
    }
}

extern "C" void cuda_rmsnorm_forward(void *out, void *rstd, const void *x, const void *w, size_t R, size_t W, float eps) {
    if (!R) return;
    rmsnorm_forward_kernel<false><<<cuda_blocks(R, 8), 256, 0, STREAM>>>((bf16 *)out, (float *)rstd, NULL, (const bf16 *)x,
                                                                      NULL, (const bf16 *)w, R, W, eps);
    CUDA_LAUNCH_CHECK();
}

extern "C" void cuda_add_rmsnorm_forward(void *sum, void *out, void *rstd, const void *a, const void *b, const void *w,
                                         size_t R, size_t W, float eps) {
    if (!R) return;
    rmsnorm_forward_kernel<true><<<cuda_blocks(R, 8), 256, 0, STREAM>>>(
        (bf16 *)out, (float *)rstd, (bf16 *)sum, (const bf16 *)a, (const bf16 *)b, (const bf16 *)w, R, W, eps);
    CUDA_LAUNCH_CHECK();
}

extern "C" void cuda_rmsnorm_backward(void *dx, void *dw, const void *dout, const void *x, const void *w,
                                      const void *rstd, size_t R, size_t W, bool accumulate_dx) {
    static void *part_buf;
    static size_t part_have;
    if (!R) return;
    size_t W8 = W / 8, threads = (W8 + 31) / 32 * 32;
    if (threads > NORM_BACKWARD_THREADS) threads = NORM_BACKWARD_THREADS;
    size_t chunks = (W8 + threads - 1) / threads;
    MOE_CHECK(chunks <= 8, "RMSNorm backward: rows of %zu values are more than its blocks hold (%d)", W,
              8 * 8 * NORM_BACKWARD_THREADS);
    auto kernel = chunks == 1 ? rmsnorm_backward_kernel<1, 4>
                  : chunks == 2 ? rmsnorm_backward_kernel<2, 2>
                  : chunks <= 4 ? rmsnorm_backward_kernel<4, 1>
                                : rmsnorm_backward_kernel<8, 1>;
    int resident = 0; // blocks per multiprocessor: one wave of blocks strides over the rows
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, (int)threads, 0));
    size_t rows = chunks == 1 ? 4 : chunks == 2 ? 2 : 1, blocks = (R + rows - 1) / rows;
    if (blocks > (size_t)cuda_ctx.sm_count * resident) blocks = (size_t)cuda_ctx.sm_count * resident;
    float *part = (float *)cuda_grow_scratch(&part_buf, &part_have, blocks * W * sizeof(float));
    kernel<<<(unsigned)blocks, (unsigned)threads, 0, STREAM>>>((bf16 *)dx, part, (const bf16 *)dout, (const bf16 *)x,
                                                               (const bf16 *)w, (const float *)rstd, R, W, accumulate_dx);
    CUDA_LAUNCH_CHECK();
    cuda_add_column_sums((float *)dw, part, blocks, W, W);
}

// ---------------------------------------------------------------- sums over rows

// Column sums of part (rows, stride) in a fixed order. Block (bx, by) sums rows [by * per,
// (by + 1) * per) of columns bx * blockDim.x + threadIdx.x in blockDim.y slices of rows, then the
// slices; out (gridDim.y, cols) gets the block's sum (= or += when accumulate).
__global__ void column_sums_kernel(float *out, const float *part, size_t rows, size_t per, size_t cols, size_t stride,
                                   bool accumulate) {
    extern __shared__ float slice[]; // (blockDim.y, blockDim.x)
    size_t j = (size_t)blockIdx.x * blockDim.x + threadIdx.x, r1 = ((size_t)blockIdx.y + 1) * per;
    float s = 0;
    if (j < cols)
        for (size_t r = blockIdx.y * per + threadIdx.y; r < r1 && r < rows; r += blockDim.y) s += part[r * stride + j];
    slice[threadIdx.y * blockDim.x + threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y || j >= cols) return;
    for (unsigned y = 1; y < blockDim.y; y++) s += slice[y * blockDim.x + threadIdx.x];
    float *o = out + (size_t)blockIdx.y * cols + j;
    *o = accumulate ? *o + s : s;
}

// Tall inputs in two passes: blocks of row ranges into a scratch of partial rows, then those.
void cuda_add_column_sums(float *dst, const float *part, size_t rows, size_t cols, size_t stride) {
    static void *mid_buf;
    static size_t mid_have;
    if (!cols) return;
    unsigned x = cols < 32 ? (unsigned)cols : 32, y = 256 / x;
    size_t smem = (size_t)x * y * sizeof(float), col_blocks = cuda_blocks(cols, x);
    size_t groups = (rows + 32 * y - 1) / (32 * y); // row ranges of about 32 rows a thread
    if (groups > 1024) groups = 1024;
    if (groups > 1) {
        size_t per = (rows + groups - 1) / groups;
        float *mid = (float *)cuda_grow_scratch(&mid_buf, &mid_have, groups * cols * sizeof(float));
        column_sums_kernel<<<dim3((unsigned)col_blocks, (unsigned)groups), dim3(x, y), smem, STREAM>>>(
            mid, part, rows, per, cols, stride, false);
        CUDA_LAUNCH_CHECK();
        part = mid, rows = groups, stride = cols;
    }
    column_sums_kernel<<<dim3((unsigned)col_blocks, 1), dim3(x, y), smem, STREAM>>>(dst, part, rows, rows, cols, stride,
                                                                                    true);
    CUDA_LAUNCH_CHECK();
}

// ---------------------------------------------------------------- element-wise

// Element-wise kernels take 8 values per step (every width they see is a multiple of 8).
__global__ void add_kernel(bf16 *out, const bf16 *a, const bf16 *b, size_t n8) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n8; i += (size_t)gridDim.x * blockDim.x) {
        float x[8], y[8];
        load8(x, a + 8 * i), load8(y, b + 8 * i);
        for (int j = 0; j < 8; j++) x[j] += y[j];
        store8(out + 8 * i, x);
    }
}

__global__ void add_tail_kernel(bf16 *out, const bf16 *a, const bf16 *b, size_t from, size_t n) {
    for (size_t i = from + threadIdx.x; i < n; i += blockDim.x) out[i] = to_bf(bf(a[i]) + bf(b[i]));
}

extern "C" void cuda_add(void *out, const void *a, const void *b, size_t n) {
    if (!n) return;
    if (n >= 8) add_kernel<<<cuda_blocks(n / 8, 256 * 4), 256, 0, STREAM>>>((bf16 *)out, (const bf16 *)a, (const bf16 *)b, n / 8);
    if (n % 8) add_tail_kernel<<<1, 32, 0, STREAM>>>((bf16 *)out, (const bf16 *)a, (const bf16 *)b, n / 8 * 8, n);
    CUDA_LAUNCH_CHECK();
}

// The 8-element groups [*first, *end) of the rows a SwiGLU call works on (ops.h), within R.
__device__ __forceinline__ void groups_used(size_t R, size_t H, const int32_t *rows, size_t n, size_t *first,
                                            size_t *end) {
    size_t lo = rows ? (size_t)rows[0] : 0, hi = rows ? (size_t)rows[n] : R;
    hi = hi < R ? hi : R, lo = lo < hi ? lo : hi;
    *first = lo * H / 8, *end = hi * H / 8;
}

__global__ void swiglu_forward_kernel(bf16 *out, const bf16 *gu, size_t R, size_t H, const int32_t *rows, size_t n) {
    size_t first, n8;
    groups_used(R, H, rows, n, &first, &n8);
    for (size_t i = first + (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n8; i += (size_t)gridDim.x * blockDim.x) {
        size_t r = (8 * i) / H, j = (8 * i) % H;
        float g[8], u[8];
        load8(g, gu + r * 2 * H + j), load8(u, gu + r * 2 * H + H + j);
        for (int k = 0; k < 8; k++) g[k] = swiglu_value(g[k], u[k]);
        store8(out + 8 * i, g);
    }
}

__global__ void swiglu_backward_kernel(bf16 *dgu, const bf16 *dout, const bf16 *gu, const float *row_w, size_t R,
                                       size_t H, const int32_t *rows, size_t n) {
    size_t first, n8;
    groups_used(R, H, rows, n, &first, &n8);
    for (size_t i = first + (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n8; i += (size_t)gridDim.x * blockDim.x) {
        size_t r = (8 * i) / H, j = (8 * i) % H;
        float g[8], u[8], d[8];
        load8(g, gu + r * 2 * H + j), load8(u, gu + r * 2 * H + H + j), load8(d, dout + 8 * i);
        swiglu_grad8(g, u, d, row_w ? row_w[r] : 1.0f);
        store8(dgu + r * 2 * H + j, g), store8(dgu + r * 2 * H + H + j, u);
    }
}

// With the combine weights' gradients (ops.h): a warp per row, h = silu(gate) up again, row_dot =
// dout . h summed in a fixed order, hw = row_w h, and the gate|up gradients as above.
__global__ void swiglu_backward_rows_kernel(bf16 *dgu, float *row_dot, bf16 *hw, const bf16 *dout, const bf16 *gu,
                                            const float *row_w, size_t R, size_t H, const int32_t *rows, size_t n) {
    size_t hi = rows ? (size_t)rows[n] : R, lo = rows ? (size_t)rows[0] : 0;
    hi = hi < R ? hi : R;
    int lane = threadIdx.x & 31;
    size_t warps = (size_t)gridDim.x * (blockDim.x / 32);
    for (size_t r = lo + (size_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; r < hi; r += warps) {
        float w = row_w[r], dot = 0;
        for (size_t j = 8 * lane; j < H; j += 256) {
            float g[8], u[8], d[8], h[8];
            load8(g, gu + r * 2 * H + j), load8(u, gu + r * 2 * H + H + j), load8(d, dout + r * H + j);
            dot = swiglu_hw8(h, g, u, d, w, dot);
            store8(hw + r * H + j, h);
            swiglu_grad8(g, u, d, w);
            store8(dgu + r * 2 * H + j, g), store8(dgu + r * 2 * H + H + j, u);
        }
        dot = warp_sum(dot);
        if (lane == 0) row_dot[r] = dot;
    }
}

extern "C" void cuda_swiglu_forward(void *out, const void *gu, size_t R, size_t H, const int32_t *rows, size_t n) {
    if (!R) return;
    swiglu_forward_kernel<<<cuda_blocks(R * H / 8, 256 * 2), 256, 0, STREAM>>>((bf16 *)out, (const bf16 *)gu, R, H, rows, n);
    CUDA_LAUNCH_CHECK();
}

extern "C" void cuda_swiglu_backward(void *dgu, void *row_dot, void *hw, const void *dout, const void *gu,
                                     const void *row_w, size_t R, size_t H, const int32_t *rows, size_t n) {
    if (!R) return;
    if (row_dot)
        swiglu_backward_rows_kernel<<<cuda_blocks(R, 8 * 4), 256, 0, STREAM>>>(
            (bf16 *)dgu, (float *)row_dot, (bf16 *)hw, (const bf16 *)dout, (const bf16 *)gu, (const float *)row_w, R,
            H, rows, n);
    else
        swiglu_backward_kernel<<<cuda_blocks(R * H / 8, 256 * 2), 256, 0, STREAM>>>(
            (bf16 *)dgu, (const bf16 *)dout, (const bf16 *)gu, (const float *)row_w, R, H, rows, n);
    CUDA_LAUNCH_CHECK();
}

// ---------------------------------------------------------------- cross-entropy (a block per row)

// Running (max, sum of exp(v - max)) of a softmax: fold in another pair.
__device__ __forceinline__ void softmax_fold(float &m, float &s, float m2, float s2) {
    if (m2 == -INFINITY) return;
    if (m2 > m) s = s * __expf(m - m2) + s2, m = m2;
    else s += s2 * __expf(m2 - m);
}

// One pass for the row's log-sum-exp (running max and sum), one for the gradient, written over
// the logits. VEC: 16-byte accesses (V a multiple of 8). The row's loss terms go to row_loss
// (rows, 2): (lse - logit of the target, lse^2), summed in a fixed order afterwards.
template <bool VEC>
__global__ void cross_entropy_kernel(bf16 *logits, float *row_loss, const int32_t *targets, size_t V,
                                     float ce_scale, float z_scale, bool want_grad) {
    __shared__ float2 red[32];
    bf16 *row = logits + (size_t)blockIdx.x * V;
    int target = targets[blockIdx.x], lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    size_t n = VEC ? V / 8 : V;
    float m = -INFINITY, s = 0, t_logit = target >= 0 ? bf(row[target]) : 0.0f;
    for (size_t i = threadIdx.x; i < n && target >= 0; i += blockDim.x) {
        float v[8], cm = -INFINITY, cs = 0;
        if (VEC) load8(v, row + 8 * i);
        else v[0] = bf(row[i]);
        for (int e = 0; e < (VEC ? 8 : 1); e++) cm = fmaxf(cm, v[e]);
        for (int e = 0; e < (VEC ? 8 : 1); e++) cs += __expf(v[e] - cm);
        softmax_fold(m, s, cm, cs);
    }
    for (int o = 16; o > 0; o >>= 1) softmax_fold(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
    if (lane == 0) red[warp] = make_float2(m, s);
    __syncthreads(); // also: the target logit was read before any thread overwrites the row
    m = -INFINITY, s = 0;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) softmax_fold(m, s, red[w].x, red[w].y);
    float lse = m + logf(s);
    if (threadIdx.x == 0) {
        row_loss[2 * blockIdx.x] = target >= 0 ? lse - t_logit : 0.0f;
        row_loss[2 * blockIdx.x + 1] = target >= 0 ? lse * lse : 0.0f;
    }
    if (!want_grad) return;
    for (size_t i = threadIdx.x; i < n; i += blockDim.x) { // ignored position (target < 0): no gradient
        float v[8];
        if (VEC) load8(v, row + 8 * i);
        else v[0] = bf(row[i]);
        for (int e = 0; e < (VEC ? 8 : 1); e++) {
            size_t col = VEC ? 8 * i + e : i;
            float p = __expf(v[e] - lse);
            v[e] = target < 0 ? 0.0f : ce_scale * (p - (col == (size_t)target ? 1.0f : 0.0f)) + z_scale * 2.0f * lse * p;
        }
        if (VEC) store8(row + 8 * i, v);
        else row[i] = to_bf(v[0]);
    }
}

extern "C" void cuda_cross_entropy(void *logits, void *loss_acc, const int32_t *targets, size_t N, size_t V,
                                   float ce_scale, float z_scale, bool want_grad) {
    static void *rows_buf;
    static size_t rows_have;
    if (!N) return;
    float *row_loss = (float *)cuda_grow_scratch(&rows_buf, &rows_have, 2 * N * sizeof(float));
    auto kernel = V % 8 == 0 ? cross_entropy_kernel<true> : cross_entropy_kernel<false>;
    kernel<<<(unsigned)N, 512, 0, STREAM>>>((bf16 *)logits, row_loss, targets, V, ce_scale, z_scale, want_grad);
    CUDA_LAUNCH_CHECK();
    cuda_add_column_sums((float *)loss_acc, row_loss, N, 2, 2);
}

// ---------------------------------------------------------------- optimizer

// Each block writes its sum to part[blockIdx.x]; the block sums are added in a fixed order.
// 16-byte loads where x is 16-byte aligned (parameter regions are), the last n % 4 values one by one.
__global__ void sum_squares_kernel(float *part, const float *x, size_t n) {
    __shared__ float scratch[32];
    float s = 0;
    size_t stride = (size_t)gridDim.x * blockDim.x, first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t n4 = ((uintptr_t)x % 16 == 0) ? n / 4 : 0;
    for (size_t i = first; i < n4; i += stride) {
        float4 v = reinterpret_cast<const float4 *>(x)[i];
        s += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    for (size_t i = 4 * n4 + first; i < n; i += stride) s += x[i] * x[i];
    s = block_sum(s, scratch);
    if (threadIdx.x == 0) part[blockIdx.x] = s;
}

extern "C" void cuda_sum_squares(void *acc, const void *x, size_t n) {
    static void *part_buf;
    static size_t part_have;
    if (!n) return;
    unsigned blocks = cuda_blocks(n, 256 * 16);
    if (blocks > (unsigned)cuda_ctx.sm_count * 8) blocks = (unsigned)cuda_ctx.sm_count * 8;
    float *part = (float *)cuda_grow_scratch(&part_buf, &part_have, (size_t)cuda_ctx.sm_count * 8 * sizeof(float));
    sum_squares_kernel<<<blocks, 256, 0, STREAM>>>(part, (const float *)x, n);
    CUDA_LAUNCH_CHECK();
    cuda_add_column_sums((float *)acc, part, blocks, 1, 1);
}

// AdamW is memory-bound (30 bytes a parameter): 16-byte loads of 4 parameters at a time where
// every array allows it, else one at a time.
template <bool VEC>
__global__ void adamw_kernel(float *p, bf16 *p_act, const float *g, float *m, float *v, size_t n, AdamWArgs a,
                             const StepInfo *step, const float *grad_norm_sq) {
    AdamWStep k = adamw_step(a, step, grad_norm_sq);
    size_t start = (size_t)blockIdx.x * blockDim.x + threadIdx.x, stride = (size_t)gridDim.x * blockDim.x;
    size_t n_vec = VEC ? n / 4 : 0;
    for (size_t i = start; i < n_vec; i += stride) {
        float4 pv = ((float4 *)p)[i], gv = ((const float4 *)g)[i], mv = ((float4 *)m)[i], vv = ((float4 *)v)[i];
        pv.x = adamw_one(&mv.x, &vv.x, pv.x, gv.x, a, k), pv.y = adamw_one(&mv.y, &vv.y, pv.y, gv.y, a, k);
        pv.z = adamw_one(&mv.z, &vv.z, pv.z, gv.z, a, k), pv.w = adamw_one(&mv.w, &vv.w, pv.w, gv.w, a, k);
        ((float4 *)p)[i] = pv, ((float4 *)m)[i] = mv, ((float4 *)v)[i] = vv;
        if (p_act) ((uint2 *)p_act)[i] = make_uint2(pack_bf16(pv.x, pv.y), pack_bf16(pv.z, pv.w));
    }
    for (size_t i = 4 * n_vec + start; i < n; i += stride) {
        p[i] = adamw_one(&m[i], &v[i], p[i], g[i], a, k);
        if (p_act) p_act[i] = to_bf(p[i]);
    }
}

static bool aligned(const void *ptr, size_t bytes) { return (uintptr_t)ptr % bytes == 0; }

extern "C" void cuda_adamw_update(void *param, void *param_act, const void *grad, void *m, void *v, size_t n,
                                  AdamWArgs a, const StepInfo *step, const void *grad_norm_sq) {
    if (!n) return;
    bool vec = aligned(param, 16) && aligned(grad, 16) && aligned(m, 16) && aligned(v, 16) && aligned(param_act, 8);
    unsigned blocks = cuda_blocks(vec ? n / 4 + 1 : n, 256 * 2);
    if (vec)
        adamw_kernel<true><<<blocks, 256, 0, STREAM>>>((float *)param, (bf16 *)param_act, (const float *)grad, (float *)m,
                                                       (float *)v, n, a, step, (const float *)grad_norm_sq);
    else
        adamw_kernel<false><<<blocks, 256, 0, STREAM>>>((float *)param, (bf16 *)param_act, (const float *)grad, (float *)m,
                                                        (float *)v, n, a, step, (const float *)grad_norm_sq);
    CUDA_LAUNCH_CHECK();
}

__global__ void cast_kernel(bf16 *dst, const float *src, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = to_bf(src[i]);
}

extern "C" void cuda_cast_f32_to_act(void *dst, const void *src, size_t n) {
    if (!n) return;
    cast_kernel<<<cuda_blocks(n, 256 * 4), 256, 0, STREAM>>>((bf16 *)dst, (const float *)src, n);
    CUDA_LAUNCH_CHECK();
}

// ---------------------------------------------------------------- initial weights

// The same double operations as the CPU's (common/rng.h): bitwise the same floats.
__global__ void init_params_kernel(float *dst, size_t n, uint64_t key, uint64_t counter_begin, double std, bool ones) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = ones ? 1.0f : rng_init_value(key, counter_begin + i, std);
}

extern "C" void cuda_init_params(void *dst, size_t n, uint64_t key, uint64_t counter_begin, double std, bool ones) {
    if (!n) return;
    init_params_kernel<<<cuda_blocks(n, 256), 256, 0, STREAM>>>((float *)dst, n, key, counter_begin, std, ones);
    CUDA_LAUNCH_CHECK();
}

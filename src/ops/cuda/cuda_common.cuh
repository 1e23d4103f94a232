// Shared by the CUDA backend's files: the checks of library calls (common/gpu_check.h), the
// backend's streams and library handles, bf16 helpers, and small launch and reduction helpers.
#pragma once
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "common/gpu_check.h"
#include "common/util.h"
#include "ops/ops.h"

typedef __nv_bfloat16 bf16;

// Experts per layer and choices per token the MoE kernels hold in fixed shared-memory and register
// arrays (cuda_moe.cu); declared to config validation by the backend's OpsLimits.
#define CUDA_MAX_EXPERTS 256
#define CUDA_MAX_TOP_K 16

// The backend's stream (every kernel and copy runs on it, so a step can be captured as a graph):
// `stream` is the current one, the main stream or, between side_begin and side_end, the side
// stream that communication overlapping the main one runs on. cuBLASLt state. Made by cuda_init.
typedef struct {
    cudaStream_t stream, main, side;
    cudaEvent_t fork, join;
    bool side_pending; // work went to the side stream since its last join
    cublasLtHandle_t lt;
    void *workspace;
    size_t workspace_bytes;
    int sm_count;
    // Kernel choices (cuda_init, from the device and the MOE_KERNELS environment variable):
    // library kernels (cuDNN attention, CUTLASS sm90 grouped GEMM) or the built-in mma.sync ones.
    bool builtin_attention, builtin_grouped;
    bool fp8; // the FP8 recipe's products (CUTLASS sm90 kernels) run here: a Hopper GPU
    bool cutlass_fp8_dense; // the dense FP8 products on CUTLASS's grouped kernel, not cuBLASLt's
    bool fp8_rows_128;      // the experts' FP8 forward and input gradient on 128 x 128 tiles, not 128 x 256
    bool fp8_wgrad_128;     // their weight gradients with x in 128x128 blocks likewise
    // train.deterministic: kernels with a faster order-dependent variant take the fixed-order one
    // (cuDNN's attention backward; every other kernel sums in a fixed order always).
    bool deterministic;
} CudaContext;

extern CudaContext cuda_ctx;
void cuda_init(void);

// Grow-only device scratch of one call site: sized by its first call, which runs before any step is
// recorded as a graph (a captured step never reallocates).
void *cuda_grow_scratch(void **buf, size_t *have, size_t bytes);

// The dense FP8 products through cuBLASLt (cuda_gemm.cu): false, nothing run, where it has no
// kernel for the shape or the operands' alignment (the caller runs CUTLASS's then).
bool cuda_lt_fp8_matmul(void *out, const void *a, const void *a_scales, const void *b, const void *b_scales,
                        size_t M, size_t N, size_t K);
bool cuda_lt_fp8_wgrad(float *dw, const void *dout_t, const void *dout_scales, const void *x_t, const void *x_scales,
                       Fp8ColBlocks x_blocks, size_t N, size_t K, size_t R, size_t Rt, bool accumulate);

// Row offsets {0, rows} (2) i32 of one group in device memory, written in stream order before the
// next kernel reads them (cuda_fp8.cu): the FP8 ops' NULL offsets, one group of all rows.
const int32_t *cuda_fp8_one_group(size_t rows);

// dst (cols) f32 += the sum over rows of part (rows, stride) f32, in a fixed order (cuda_dense.cu):
// the deterministic second half of the reductions that write a row of partial sums per block.
void cuda_add_column_sums(float *dst, const float *part, size_t rows, size_t cols, size_t stride);

static inline unsigned cuda_blocks(size_t n, unsigned threads) {
    size_t b = (n + threads - 1) / threads;
    return (unsigned)(b < 1 ? 1 : b > 2147483647u ? 2147483647u : b);
}

__device__ __forceinline__ float bf(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ bf16 to_bf(float x) { return __float2bfloat16(x); }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// A reduction over the block (any multiple of 32 threads) by a warp reduction and its identity;
// every thread gets the result. `scratch` holds 32 floats of shared memory.
template <float (*warp_reduce)(float)>
__device__ __forceinline__ float block_reduce(float v, float *scratch, float identity) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_reduce(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : identity;
    return warp_reduce(v);
}

__device__ __forceinline__ float block_sum(float v, float *scratch) { return block_reduce<warp_sum>(v, scratch, 0.0f); }
__device__ __forceinline__ float block_max(float v, float *scratch) {
    return block_reduce<warp_max>(v, scratch, -INFINITY);
}

// The logistic sigmoid of g by the hardware's approximate exponential and reciprocal (two MUFU
// instructions, within ~2 ulp of fp32; an IEEE division would add ~8 instructions and a slow-path
// branch a value, which the SwiGLU kernels, bound by instruction issue, paid for): 0 for g below
// about -88 (1 + e^-g overflows; the reciprocal of infinity is 0), 1 above about 17. e^-g is
// 2^(-g log2 e) with subnormal results flushed to zero (ex2.approx.ftz: the MUFU alone, where
// __expf adds a range test and two multiplications to keep them): 1 + e^-g is then 1 either way,
// so the bits are __expf's.
__device__ __forceinline__ float swiglu_sigmoid(float g) {
    float e;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(g * -1.4426950408889634f));
    return __fdividef(1.0f, 1.0f + e);
}

// SwiGLU of one gate and up value, silu(g) u = g sigmoid(g) u: every kernel that computes it
// (cuda_dense.cu's forward, the fused FP8 one of cuda_fp8.cu) gets the same bits, and the backward
// (cuda_dense.cu) the same sigmoid.
__device__ __forceinline__ float swiglu_value(float g, float u) { return g * swiglu_sigmoid(g) * u; }

// The SwiGLU gradients of one 8-value piece: d (the output's gradient) weighted by w, gate and up
// gradients over g and u (dgu may be gu: each thread reads its values before writing them). Shared
// by the backward kernels of cuda_dense.cu and the fused FP8 one of cuda_fp8.cu: the same bits.
__device__ __forceinline__ void swiglu_grad8(float g[8], float u[8], const float d[8], float w) {
    for (int k = 0; k < 8; k++) {
        float s = swiglu_sigmoid(g[k]), dy = d[k] * w, gate = g[k];
        g[k] = dy * u[k] * s * (1.0f + gate * (1.0f - s));
        u[k] = dy * gate * s;
    }
}

// The expert rows' part of the SwiGLU backward for one 8-value piece (swiglu_backward with row_dot,
// ops.h): h = silu(g) u again, returned dot plus d . h summed in order, then h times the row's
// combine weight w (hw). Shared as swiglu_grad8 is.
__device__ __forceinline__ float swiglu_hw8(float h[8], const float g[8], const float u[8], const float d[8], float w,
                                            float dot) {
    for (int q = 0; q < 8; q++) {
        h[q] = swiglu_value(g[q], u[q]);
        dot += d[q] * h[q], h[q] *= w;
    }
    return dot;
}

// AdamW's step constants and its update of one parameter (m and v in place; returns the new
// parameter): adamw_kernel (cuda_dense.cu) and the one that also makes the FP8 copies (cuda_fp8.cu)
// share them, so both give the same bits. The update is spelled out in round-to-nearest intrinsics,
// which the compiler never fuses into FMAs: written as plain expressions, it contracted them one way
// in one kernel and another way in the other (v's bits differed in about one value in a hundred).
struct AdamWStep {
    float scale, bc1, bc2, lr, decay;
};

__device__ __forceinline__ AdamWStep adamw_step(AdamWArgs a, const StepInfo *step, const float *grad_norm_sq) {
    float norm = sqrtf(*grad_norm_sq);
    return {a.clip > 0 && norm > a.clip ? a.clip / (norm + 1e-6f) : 1.0f, 1.0f - powf(a.beta1, (float)step->step),
            1.0f - powf(a.beta2, (float)step->step), step->lr, 1.0f - step->lr * a.weight_decay};
}

__device__ __forceinline__ float adamw_one(float *m, float *v, float p, float g, AdamWArgs a, const AdamWStep &k) {
    g = __fmul_rn(g, k.scale);
    *m = __fmaf_rn(a.beta1, *m, __fmul_rn(1.0f - a.beta1, g));
    *v = __fmaf_rn(a.beta2, *v, __fmul_rn(__fmul_rn(1.0f - a.beta2, g), g));
    float step = __fdiv_rn(__fdiv_rn(*m, k.bc1), __fadd_rn(__fsqrt_rn(__fdiv_rn(*v, k.bc2)), a.eps));
    return __fmaf_rn(p, k.decay, -__fmul_rn(k.lr, step));
}

// 8 bf16 values (16 bytes) to and from fp32: the unit of the memory-bound kernels' loads.
__device__ __forceinline__ void unpack8(float v[8], uint4 u) {
    const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&u);
    for (int i = 0; i < 4; i++) {
        float2 f = __bfloat1622float2(h[i]);
        v[2 * i] = f.x, v[2 * i + 1] = f.y;
    }
}

__device__ __forceinline__ uint4 pack8(const float v[8]) {
    uint4 u;
    __nv_bfloat162 *h = reinterpret_cast<__nv_bfloat162 *>(&u);
    for (int i = 0; i < 4; i++) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    return u;
}

__device__ __forceinline__ void load8(float v[8], const bf16 *p) { unpack8(v, *reinterpret_cast<const uint4 *>(p)); }

__device__ __forceinline__ void store8(bf16 *p, const float v[8]) { *reinterpret_cast<uint4 *>(p) = pack8(v); }

// The first pass of RMSNorm over a row of W values (a multiple of 8) by one warp, lane `lane` taking
// 8 values every 256: with ADD the row is sum = x + b, rounded to bf16 and written (each lane reads
// back only what it wrote); returns 1 / rms of the row (x's, or sum's). rmsnorm_forward's kernel
// and the one that also quantises its output (cuda_fp8.cu) share it: the same bits.
template <bool ADD>
__device__ __forceinline__ float rmsnorm_row_rstd(bf16 *sum, const bf16 *x, const bf16 *b, size_t W, float eps,
                                                  int lane) {
    float ss = 0;
    for (size_t j = 8 * lane; j < W; j += 256) {
        float v[8];
        load8(v, x + j);
        if (ADD) {
            float v2[8];
            load8(v2, b + j);
            for (int k = 0; k < 8; k++) v[k] = bf(to_bf(v[k] + v2[k]));
            store8(sum + j, v);
        }
        for (int k = 0; k < 8; k++) ss += v[k] * v[k];
    }
    return rsqrtf(warp_sum(ss) / (float)W + eps);
}

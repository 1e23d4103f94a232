// CUDA kernels for the dense ops: embedding, RMSNorm, residual add, SwiGLU, fused cross-entropy,
// sum of squares, AdamW and the fp32 -> bf16 weight copy. Reductions are in fp32; weight
// gradients are summed per block in shared memory, then added to the fp32 gradient atomically.
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

__global__ void embedding_backward_kernel(float *dwte, const bf16 *dout, const int32_t *tokens, size_t T, size_t D) {
    size_t t = blockIdx.x;
    float *row = dwte + (size_t)tokens[t] * D;
    for (size_t j = threadIdx.x; j < D; j += blockDim.x) atomicAdd(&row[j], bf(dout[t * D + j]));
}

extern "C" void cuda_embedding_forward(void *out, const int32_t *tokens, const void *wte, size_t T, size_t D) {
    if (!T) return;
    embedding_forward_kernel<<<(unsigned)T, 256, 0, STREAM>>>((bf16 *)out, tokens, (const bf16 *)wte, T, D);
    CUDA_LAUNCH_CHECK();
}

extern "C" void cuda_embedding_backward(void *dwte, const void *dout, const int32_t *tokens, size_t T, size_t D, size_t V) {
    if (!T) return;
    embedding_backward_kernel<<<(unsigned)T, 256, 0, STREAM>>>((float *)dwte, (const bf16 *)dout, tokens, T, D);
    CUDA_LAUNCH_CHECK();
}

// ---------------------------------------------------------------- RMSNorm (one warp per row)

__global__ void rmsnorm_forward_kernel(bf16 *out, float *rstd, const bf16 *x, const bf16 *w, size_t R, size_t W, float eps) {
    size_t r = (size_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x & 31;
    if (r >= R) return;
    const bf16 *xr = x + r * W;
    float ss = 0;
    for (size_t j = 8 * lane; j < W; j += 256) {
        float v[8];
        load8(v, xr + j);
        for (int k = 0; k < 8; k++) ss += v[k] * v[k];
    }
    float rs = rsqrtf(warp_sum(ss) / (float)W + eps);
    for (size_t j = 8 * lane; j < W; j += 256) {
        float v[8], g[8];
        load8(v, xr + j), load8(g, w + j);
        for (int k = 0; k < 8; k++) v[k] *= rs * g[k];
        store8(out + r * W + j, v);
    }
    if (lane == 0) rstd[r] = rs;
}

// Rows in chunks per block: dx row by row (a warp each), dw summed in shared memory first.
#define NORM_ROWS_PER_BLOCK 64

__global__ void rmsnorm_backward_kernel(bf16 *dx, float *dw, const bf16 *dout, const bf16 *x, const bf16 *w,
                                        const float *rstd, size_t R, size_t W, bool accumulate) {
    extern __shared__ float dw_part[]; // (W)
    for (size_t j = threadIdx.x; j < W; j += blockDim.x) dw_part[j] = 0;
    __syncthreads();
    int lane = threadIdx.x & 31, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
    size_t r0 = (size_t)blockIdx.x * NORM_ROWS_PER_BLOCK;
    for (size_t r = r0 + warp; r < r0 + NORM_ROWS_PER_BLOCK && r < R; r += nwarps) {
        const bf16 *xr = x + r * W, *gr = dout + r * W;
        float rs = rstd[r], dot = 0;
        for (size_t j = lane; j < W; j += 32) {
            float g = bf(gr[j]), xv = bf(xr[j]);
            dot += g * bf(w[j]) * xv;
            atomicAdd(&dw_part[j], g * xv * rs);
        }
        float c = warp_sum(dot) * rs * rs * rs / (float)W;
        for (size_t j = lane; j < W; j += 32) {
            float v = rs * bf(w[j]) * bf(gr[j]) - c * bf(xr[j]);
            dx[r * W + j] = to_bf(accumulate ? bf(dx[r * W + j]) + v : v);
        }
    }
    __syncthreads();
    for (size_t j = threadIdx.x; j < W; j += blockDim.x) atomicAdd(&dw[j], dw_part[j]);
}

extern "C" void cuda_rmsnorm_forward(void *out, void *rstd, const void *x, const void *w, size_t R, size_t W, float eps) {
    if (!R) return;
    rmsnorm_forward_kernel<<<cuda_blocks(R, 8), 256, 0, STREAM>>>((bf16 *)out, (float *)rstd, (const bf16 *)x,
                                                               (const bf16 *)w, R, W, eps);
    CUDA_LAUNCH_CHECK();
}

extern "C" void cuda_rmsnorm_backward(void *dx, void *dw, const void *dout, const void *x, const void *w,
                                      const void *rstd, size_t R, size_t W, bool accumulate_dx) {
    if (!R) return;
    rmsnorm_backward_kernel<<<cuda_blocks(R, NORM_ROWS_PER_BLOCK), 256, W * sizeof(float), STREAM>>>(
        (bf16 *)dx, (float *)dw, (const bf16 *)dout, (const bf16 *)x, (const bf16 *)w, (const float *)rstd,
        R, W, accumulate_dx);
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

__device__ __forceinline__ size_t rows_used(size_t R, const int32_t *row_count) {
    return row_count && (size_t)*row_count < R ? (size_t)*row_count : R;
}

__global__ void swiglu_forward_kernel(bf16 *out, const bf16 *gu, size_t R, size_t H, const int32_t *row_count) {
    size_t n8 = rows_used(R, row_count) * H / 8;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n8; i += (size_t)gridDim.x * blockDim.x) {
        size_t r = (8 * i) / H, j = (8 * i) % H;
        float g[8], u[8];
        load8(g, gu + r * 2 * H + j), load8(u, gu + r * 2 * H + H + j);
        for (int k = 0; k < 8; k++) g[k] = g[k] / (1.0f + __expf(-g[k])) * u[k];
        store8(out + 8 * i, g);
    }
}

__global__ void swiglu_backward_kernel(bf16 *dgu, const bf16 *dout, const bf16 *gu, size_t R, size_t H,
                                       const int32_t *row_count) {
    size_t n8 = rows_used(R, row_count) * H / 8;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n8; i += (size_t)gridDim.x * blockDim.x) {
        size_t r = (8 * i) / H, j = (8 * i) % H;
        float g[8], u[8], d[8], dg[8], du[8];
        load8(g, gu + r * 2 * H + j), load8(u, gu + r * 2 * H + H + j), load8(d, dout + 8 * i);
        for (int k = 0; k < 8; k++) {
            float s = 1.0f / (1.0f + __expf(-g[k]));
            dg[k] = d[k] * u[k] * s * (1.0f + g[k] * (1.0f - s));
            du[k] = d[k] * g[k] * s;
        }
        store8(dgu + r * 2 * H + j, dg), store8(dgu + r * 2 * H + H + j, du);
    }
}

extern "C" void cuda_swiglu_forward(void *out, const void *gu, size_t R, size_t H, const int32_t *row_count) {
    if (!R) return;
    swiglu_forward_kernel<<<cuda_blocks(R * H / 8, 256 * 2), 256, 0, STREAM>>>((bf16 *)out, (const bf16 *)gu, R, H, row_count);
    CUDA_LAUNCH_CHECK();
}

extern "C" void cuda_swiglu_backward(void *dgu, const void *dout, const void *gu, size_t R, size_t H,
                                     const int32_t *row_count) {
    if (!R) return;
    swiglu_backward_kernel<<<cuda_blocks(R * H / 8, 256 * 2), 256, 0, STREAM>>>((bf16 *)dgu, (const bf16 *)dout,
                                                                              (const bf16 *)gu, R, H, row_count);
    CUDA_LAUNCH_CHECK();
}

// ---------------------------------------------------------------- cross-entropy (a block per row)

__global__ void cross_entropy_kernel(bf16 *logits, float *loss_acc, const int32_t *targets, size_t V,
                                     float ce_scale, float z_scale, bool want_grad) {
    __shared__ float scratch[32];
    bf16 *row = logits + (size_t)blockIdx.x * V;
    int target = targets[blockIdx.x];
    if (target < 0) { // ignored position: no loss, no gradient
        if (want_grad)
            for (size_t v = threadIdx.x; v < V; v += blockDim.x) row[v] = to_bf(0.0f);
        return;
    }
    float mx = -INFINITY;
    for (size_t v = threadIdx.x; v < V; v += blockDim.x) mx = fmaxf(mx, bf(row[v]));
    mx = block_max(mx, scratch);
    float sum = 0;
    for (size_t v = threadIdx.x; v < V; v += blockDim.x) sum += __expf(bf(row[v]) - mx);
    sum = block_sum(sum, scratch);
    float lse = mx + logf(sum);
    if (threadIdx.x == 0) {
        atomicAdd(&loss_acc[0], lse - bf(row[target]));
        atomicAdd(&loss_acc[1], lse * lse);
    }
    __syncthreads(); // the target logit is read above before any thread overwrites the row
    if (!want_grad) return;
    for (size_t v = threadIdx.x; v < V; v += blockDim.x) {
        float p = __expf(bf(row[v]) - lse);
        row[v] = to_bf(ce_scale * (p - (v == (size_t)target ? 1.0f : 0.0f)) + z_scale * 2.0f * lse * p);
    }
}

extern "C" void cuda_cross_entropy(void *logits, void *loss_acc, const int32_t *targets, size_t N, size_t V,
                                   float ce_scale, float z_scale, bool want_grad) {
    if (!N) return;
    cross_entropy_kernel<<<(unsigned)N, 512, 0, STREAM>>>((bf16 *)logits, (float *)loss_acc, targets, V, ce_scale,
                                                     z_scale, want_grad);
    CUDA_LAUNCH_CHECK();
}

// ---------------------------------------------------------------- optimizer

__global__ void sum_squares_kernel(float *acc, const float *x, size_t n) {
    __shared__ float scratch[32];
    float s = 0;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        s += x[i] * x[i];
    s = block_sum(s, scratch);
    if (threadIdx.x == 0) atomicAdd(acc, s);
}

extern "C" void cuda_sum_squares(void *acc, const void *x, size_t n) {
    if (!n) return;
    unsigned blocks = cuda_blocks(n, 256 * 8);
    if (blocks > (unsigned)cuda_ctx.sm_count * 8) blocks = (unsigned)cuda_ctx.sm_count * 8;
    sum_squares_kernel<<<blocks, 256, 0, STREAM>>>((float *)acc, (const float *)x, n);
    CUDA_LAUNCH_CHECK();
}

// AdamW is memory-bound (30 bytes a parameter): 16-byte loads of 4 parameters at a time where
// every array allows it, else one at a time.
struct AdamWStep {
    float scale, bc1, bc2, lr, decay;
};

__device__ __forceinline__ AdamWStep adamw_step(AdamWArgs a, const StepInfo *step, const float *grad_norm_sq) {
    float norm = sqrtf(*grad_norm_sq);
    return {a.clip > 0 && norm > a.clip ? a.clip / (norm + 1e-6f) : 1.0f, 1.0f - powf(a.beta1, (float)step->step),
            1.0f - powf(a.beta2, (float)step->step), step->lr, 1.0f - step->lr * a.weight_decay};
}

__device__ __forceinline__ float adamw_one(float *m, float *v, float p, float g, AdamWArgs a, const AdamWStep &k) {
    g *= k.scale;
    *m = a.beta1 * *m + (1.0f - a.beta1) * g;
    *v = a.beta2 * *v + (1.0f - a.beta2) * g * g;
    return p * k.decay - k.lr * (*m / k.bc1) / (sqrtf(*v / k.bc2) + a.eps);
}

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

// CUDA kernels for attention: QK-norm + RoPE on packed qkv rows, and causal grouped-query flash
// attention (forward keeps only each row's log-sum-exp; backward recomputes the probabilities).
// Tiles of 64 queries x 64 keys go through tensor cores (WMMA); the online softmax and the
// probability gradients run on the tiles in shared memory.
#include <mma.h>

#include "cuda_common.cuh"
#include "cuda_ops.h"

using namespace nvcuda;

#define STREAM cuda_ctx.stream

// Grow-only scratch of the attention backward (dQ accumulator and row dots): sized by the first
// backward, which runs before any step is recorded as a graph.
static void *attn_scratch(size_t bytes) {
    static void *buf;
    static size_t have;
    if (bytes > have) {
        if (buf) CUDA_CHECK(cudaFree(buf));
        CUDA_CHECK(cudaMalloc(&buf, bytes));
        have = bytes;
    }
    return buf;
}

// ---------------------------------------------------------------- QK-norm + RoPE

typedef struct {
    int n_groups, q_groups; // groups normalised per token; the first q_groups are q's
    int width;              // elements per group
} NormGroups;

static NormGroups norm_groups(AttnDims d, QkNorm mode) {
    if (mode == QK_NORM_NONE) return (NormGroups){0, 0, 0};
    if (mode == QK_NORM_FULL) return (NormGroups){2, 1, 0};
    return (NormGroups){(int)(d.Hq + d.Hkv), (int)d.Hq, (int)d.hd};
}

// Start, width and weight index base of group g of a token row (FULL: q then k, whole width).
__device__ __forceinline__ void group_span(int g, NormGroups ng, AttnDims d, int *start, int *width) {
    if (ng.width) { // per head
        *start = g * (int)d.hd, *width = (int)d.hd;
    } else {
        *start = g == 0 ? 0 : (int)(d.Hq * d.hd);
        *width = (int)((g == 0 ? d.Hq : d.Hkv) * d.hd);
    }
}

__device__ __forceinline__ int rstd_index(int g, NormGroups ng, AttnDims d) {
    return ng.width ? g : (g == 0 ? 0 : (int)d.Hq);
}

__device__ void rope_pairs(float *row, bf16 *out, const float *rope_s, AttnDims d, bool inverse) {
    int half = (int)d.hd / 2, heads = (int)(d.Hq + d.Hkv);
    for (int i = threadIdx.x; i < heads * half; i += blockDim.x) {
        int h = i / half, j = i % half;
        float c = rope_s[2 * j], s = inverse ? -rope_s[2 * j + 1] : rope_s[2 * j + 1];
        float x1 = row[h * d.hd + j], x2 = row[h * d.hd + j + half];
        float y1 = x1 * c - x2 * s, y2 = x2 * c + x1 * s;
        if (out) out[h * d.hd + j] = to_bf(y1), out[h * d.hd + j + half] = to_bf(y2);
        else row[h * d.hd + j] = y1, row[h * d.hd + j + half] = y2;
    }
}

__global__ void qkv_norm_rope_forward_kernel(bf16 *qkv, float *rstd, const bf16 *raw, const bf16 *wq,
                                             const bf16 *wk, const float *rope, AttnDims d, NormGroups ng,
                                             float eps) {
    extern __shared__ float row[]; // (C)
    size_t t = blockIdx.x, C = (d.Hq + 2 * d.Hkv) * d.hd, nr = d.Hq + d.Hkv;
    for (size_t j = threadIdx.x; j < C; j += blockDim.x) row[j] = bf(raw[t * C + j]);
    __syncthreads();
    int lane = threadIdx.x & 31, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
    for (int g = warp; g < ng.n_groups; g += nwarps) {
        int start, width;
        group_span(g, ng, d, &start, &width);
        const bf16 *w = g < ng.q_groups ? wq : wk;
        float ss = 0;
        for (int j = lane; j < width; j += 32) ss += row[start + j] * row[start + j];
        float rs = rsqrtf(warp_sum(ss) / (float)width + eps);
        __syncwarp();
        for (int j = lane; j < width; j += 32) row[start + j] *= rs * bf(w[j]);
        if (lane == 0) rstd[t * nr + rstd_index(g, ng, d)] = rs;
    }
    __syncthreads();
    rope_pairs(row, qkv + t * C, rope + (t % d.S) * d.hd, d, false);
    for (size_t j = nr * d.hd + threadIdx.x; j < C; j += blockDim.x) qkv[t * C + j] = to_bf(row[j]);
}

#define QKV_TOKENS_PER_BLOCK 16

// Per token: undo RoPE on the gradient, then the norm's backward; weight gradients summed over the
// block's tokens in shared memory first.
__global__ void qkv_norm_rope_backward_kernel(bf16 *draw, float *dwq, float *dwk, const bf16 *dqkv,
                                              const bf16 *raw, const bf16 *wq, const bf16 *wk,
                                              const float *rstd, const float *rope, AttnDims d, NormGroups ng) {
    extern __shared__ float smem[];
    size_t C = (d.Hq + 2 * d.Hkv) * d.hd, nr = d.Hq + d.Hkv, T = d.B * d.S;
    int wq_n = ng.width ? ng.width : (int)(d.Hq * d.hd), wk_n = ng.width ? ng.width : (int)(d.Hkv * d.hd);
    float *g_row = smem, *x_row = smem + C, *dw_q = smem + 2 * C, *dw_k = dw_q + wq_n;
    for (int j = threadIdx.x; j < wq_n + wk_n; j += blockDim.x) dw_q[j] = 0;
    int lane = threadIdx.x & 31, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
    for (size_t t = (size_t)blockIdx.x * QKV_TOKENS_PER_BLOCK; t < T && t < ((size_t)blockIdx.x + 1) * QKV_TOKENS_PER_BLOCK; t++) {
        __syncthreads();
        for (size_t j = threadIdx.x; j < C; j += blockDim.x) g_row[j] = bf(dqkv[t * C + j]), x_row[j] = bf(raw[t * C + j]);
        __syncthreads();
        rope_pairs(g_row, NULL, rope + (t % d.S) * d.hd, d, true);
        __syncthreads();
        for (int g = warp; g < ng.n_groups; g += nwarps) {
            int start, width;
            group_span(g, ng, d, &start, &width);
            bool is_q = g < ng.q_groups;
            const bf16 *w = is_q ? wq : wk;
            float *dw = is_q ? dw_q : dw_k;
            float rs = rstd[t * nr + rstd_index(g, ng, d)], dot = 0;
            for (int j = lane; j < width; j += 32) {
                float gj = g_row[start + j], xj = x_row[start + j];
                dot += gj * bf(w[j]) * xj;
                atomicAdd(&dw[j], gj * xj * rs);
            }
            float c = warp_sum(dot) * rs * rs * rs / (float)width;
            __syncwarp();
            for (int j = lane; j < width; j += 32)
                g_row[start + j] = rs * bf(w[j]) * g_row[start + j] - c * x_row[start + j];
        }
        __syncthreads();
        for (size_t j = threadIdx.x; j < C; j += blockDim.x) draw[t * C + j] = to_bf(g_row[j]);
    }
    __syncthreads();
    if (!ng.n_groups) return;
    for (int j = threadIdx.x; j < wq_n; j += blockDim.x) atomicAdd(&dwq[j], dw_q[j]);
    for (int j = threadIdx.x; j < wk_n; j += blockDim.x) atomicAdd(&dwk[j], dw_k[j]);
}

extern "C" void cuda_qkv_norm_rope_forward(void *qkv, void *rstd, const void *qkv_raw, const void *wq, const void *wk,
                                           const void *rope, AttnDims d, QkNorm mode, float eps) {
    size_t T = d.B * d.S, C = (d.Hq + 2 * d.Hkv) * d.hd;
    if (!T) return;
    qkv_norm_rope_forward_kernel<<<(unsigned)T, 256, C * sizeof(float), STREAM>>>(
        (bf16 *)qkv, (float *)rstd, (const bf16 *)qkv_raw, (const bf16 *)wq, (const bf16 *)wk, (const float *)rope,
        d, norm_groups(d, mode), eps);
    CUDA_LAUNCH_CHECK();
}

extern "C" void cuda_qkv_norm_rope_backward(void *dqkv_raw, void *dwq, void *dwk, const void *dqkv,
                                            const void *qkv_raw, const void *wq, const void *wk, const void *rstd,
                                            const void *rope, AttnDims d, QkNorm mode) {
    size_t T = d.B * d.S, C = (d.Hq + 2 * d.Hkv) * d.hd;
    if (!T) return;
    NormGroups ng = norm_groups(d, mode);
    size_t wn = ng.width ? 2 * (size_t)ng.width : (d.Hq + d.Hkv) * d.hd;
    size_t smem = (2 * C + wn) * sizeof(float);
    static size_t configured;
    if (smem > 48 * 1024 && smem > configured) {
        CUDA_CHECK(cudaFuncSetAttribute(qkv_norm_rope_backward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        configured = smem;
    }
    qkv_norm_rope_backward_kernel<<<cuda_blocks(T, QKV_TOKENS_PER_BLOCK), 256, smem, STREAM>>>(
        (bf16 *)dqkv_raw, (float *)dwq, (float *)dwk, (const bf16 *)dqkv, (const bf16 *)qkv_raw, (const bf16 *)wq,
        (const bf16 *)wk, (const float *)rstd, (const float *)rope, d, ng);
    CUDA_LAUNCH_CHECK();
}

// ---------------------------------------------------------------- flash attention

#define AT_B 64        // queries and keys per tile
#define AT_WARPS 4     // each warp owns 16 rows of a 64-row tile
#define AT_THREADS (32 * AT_WARPS)
#define PAD_H 8        // bf16 padding of head-dim rows
#define SF_LD (AT_B + 4)
#define PS_LD (AT_B + 8)

typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> Acc;

// Copies rows [r0, r0 + 64) of one head (hd columns at column `col` of rows of width C) into a
// shared tile; rows past `rows` are zero.
template <int HD>
__device__ void load_head_tile(bf16 (*tile)[HD + PAD_H], const bf16 *base, size_t C, size_t col, int r0, int rows) {
    for (int c = threadIdx.x; c < AT_B * HD / 8; c += blockDim.x) {
        int r = c / (HD / 8), v = (c % (HD / 8)) * 8;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (r0 + r < rows) val = *reinterpret_cast<const uint4 *>(base + (size_t)(r0 + r) * C + col + v);
        *reinterpret_cast<uint4 *>(&tile[r][v]) = val;
    }
}

// s (16 x 64) = a (16 x HD, row-major) b^T where b is a 64 x HD tile (keys x head dim).
template <int HD>
__device__ void tile_qkt(float *s, int lds, const bf16 *a, int lda, const bf16 (*b)[HD + PAD_H]) {
    for (int j = 0; j < AT_B / 16; j++) {
        Acc acc;
        wmma::fill_fragment(acc, 0.0f);
        for (int kk = 0; kk < HD; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> fb;
            wmma::load_matrix_sync(fa, a + kk, lda);
            wmma::load_matrix_sync(fb, &b[16 * j][kk], HD + PAD_H);
            wmma::mma_sync(acc, fa, fb, acc);
        }
        wmma::store_matrix_sync(s + 16 * j, acc, lds, wmma::mem_row_major);
    }
}

// c (16 x HD, fp32 in shared memory, ldc) += a (16 x 64) b (64 x HD); a row- or column-major.
template <int HD, typename ALayout>
__device__ void tile_accumulate(float *c, int ldc, const bf16 *a, int lda, int a_step, const bf16 (*b)[HD + PAD_H]) {
    for (int n = 0; n < HD / 16; n++) {
        Acc acc;
        wmma::load_matrix_sync(acc, c + 16 * n, ldc, wmma::mem_row_major);
        for (int kk = 0; kk < AT_B / 16; kk++) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, ALayout> fa;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> fb;
            wmma::load_matrix_sync(fa, a + kk * a_step, lda);
            wmma::load_matrix_sync(fb, &b[16 * kk][16 * n], HD + PAD_H);
            wmma::mma_sync(acc, fa, fb, acc);
        }
        wmma::store_matrix_sync(c + 16 * n, acc, ldc, wmma::mem_row_major);
    }
}

template <int HD> struct FwdSmem {
    bf16 q[AT_B][HD + PAD_H], k[AT_B][HD + PAD_H], v[AT_B][HD + PAD_H];
    float s[AT_B][SF_LD];
    bf16 p[AT_B][PS_LD];
    float o[AT_B][HD + 4];
    float m[AT_B], l[AT_B];
};

template <int HD>
__global__ void __launch_bounds__(AT_THREADS) attention_forward_kernel(bf16 *out, float *lse, const bf16 *qkv, AttnDims d) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    FwdSmem<HD> &sm = *reinterpret_cast<FwdSmem<HD> *>(smem_raw);
    int qt = blockIdx.x, h = blockIdx.y, b = blockIdx.z, S = (int)d.S, q0 = qt * AT_B;
    int g = h / (int)(d.Hq / d.Hkv);
    size_t C = (d.Hq + 2 * d.Hkv) * HD;
    const bf16 *base = qkv + (size_t)b * d.S * C;
    float scale = rsqrtf((float)HD);
    load_head_tile<HD>(sm.q, base, C, (size_t)h * HD, q0, S);
    for (int i = threadIdx.x; i < AT_B * (HD + 4); i += blockDim.x) (&sm.o[0][0])[i] = 0;
    for (int i = threadIdx.x; i < AT_B; i += blockDim.x) sm.m[i] = -INFINITY, sm.l[i] = 0;
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31, w0 = warp * 16;
    int row = w0 + lane / 2, half = lane & 1;
    for (int kt = 0; kt <= qt; kt++) {
        int k0 = kt * AT_B;
        __syncthreads(); // the previous tile's K and V are no longer read
        load_head_tile<HD>(sm.k, base, C, (d.Hq + g) * HD, k0, S);
        load_head_tile<HD>(sm.v, base, C, (d.Hq + d.Hkv + g) * HD, k0, S);
        __syncthreads();
        tile_qkt<HD>(&sm.s[w0][0], SF_LD, &sm.q[w0][0], HD + PAD_H, sm.k);
        __syncwarp();
        // online softmax: two lanes per row, 32 keys each
        float mx = -INFINITY;
        for (int c = half * 32; c < half * 32 + 32; c++) {
            bool ok = k0 + c <= q0 + row && k0 + c < S;
            float v = ok ? sm.s[row][c] * scale : -INFINITY;
            sm.s[row][c] = v;
            mx = fmaxf(mx, v);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        float m_old = sm.m[row], m_new = fmaxf(m_old, mx);
        float sum = 0;
        for (int c = half * 32; c < half * 32 + 32; c++) {
            float p = m_new == -INFINITY ? 0.0f : __expf(sm.s[row][c] - m_new);
            sm.p[row][c] = to_bf(p);
            sum += p;
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        float alpha = m_old == -INFINITY ? 0.0f : __expf(m_old - m_new);
        for (int c = half * (HD / 2); c < (half + 1) * (HD / 2); c++) sm.o[row][c] *= alpha;
        __syncwarp();
        if (half == 0) sm.m[row] = m_new, sm.l[row] = sm.l[row] * alpha + sum;
        __syncwarp();
        tile_accumulate<HD, wmma::row_major>(&sm.o[w0][0], HD + 4, &sm.p[w0][0], PS_LD, 16, sm.v);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < AT_B * HD; i += blockDim.x) {
        int r = i / HD, c = i % HD;
        if (q0 + r >= S) continue;
        size_t t = (size_t)b * d.S + q0 + r;
        out[t * d.Hq * HD + (size_t)h * HD + c] = to_bf(sm.o[r][c] / sm.l[r]);
    }
    for (int r = threadIdx.x; r < AT_B; r += blockDim.x)
        if (q0 + r < S) lse[((size_t)b * d.Hq + h) * d.S + q0 + r] = sm.m[r] + logf(sm.l[r]);
}

// D[t, h] = sum over the head dim of dO * O (a warp per (token, head)).
__global__ void attention_row_dot_kernel(float *D, const bf16 *dout, const bf16 *out, size_t n, int hd) {
    size_t i = (size_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (i >= n) return;
    int lane = threadIdx.x & 31;
    float s = 0;
    for (int j = lane; j < hd; j += 32) s += bf(dout[i * hd + j]) * bf(out[i * hd + j]);
    s = warp_sum(s);
    if (lane == 0) D[i] = s;
}

template <int HD> struct BwdSmem {
    bf16 k[AT_B][HD + PAD_H], v[AT_B][HD + PAD_H], q[AT_B][HD + PAD_H], dout[AT_B][HD + PAD_H];
    float s[AT_B][SF_LD], dp[AT_B][SF_LD];
    bf16 p[AT_B][PS_LD], ds[AT_B][PS_LD];
    float dk[AT_B][HD + 4], dv[AT_B][HD + 4];
    float lse[AT_B], dsum[AT_B];
};

// One block per (key tile, kv head, batch): loops over the group's query heads and the query tiles
// that see its keys; accumulates dK, dV in shared memory and adds dQ to an fp32 buffer atomically.
template <int HD>
__global__ void __launch_bounds__(AT_THREADS) attention_backward_kernel(bf16 *dqkv, float *dq, const bf16 *dout,
                                                                        const bf16 *qkv, const float *lse,
                                                                        const float *D, AttnDims d) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    BwdSmem<HD> &sm = *reinterpret_cast<BwdSmem<HD> *>(smem_raw);
    int kt = blockIdx.x, g = blockIdx.y, b = blockIdx.z, S = (int)d.S, k0 = kt * AT_B;
    int group = (int)(d.Hq / d.Hkv), n_qt = (S + AT_B - 1) / AT_B;
    size_t C = (d.Hq + 2 * d.Hkv) * HD, Dq = d.Hq * HD;
    const bf16 *base = qkv + (size_t)b * d.S * C, *dbase = dout + (size_t)b * d.S * Dq;
    float scale = rsqrtf((float)HD);
    load_head_tile<HD>(sm.k, base, C, (d.Hq + g) * HD, k0, S);
    load_head_tile<HD>(sm.v, base, C, (d.Hq + d.Hkv + g) * HD, k0, S);
    for (int i = threadIdx.x; i < AT_B * (HD + 4); i += blockDim.x) (&sm.dk[0][0])[i] = 0, (&sm.dv[0][0])[i] = 0;
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31, w0 = warp * 16;
    for (int h = g * group; h < (g + 1) * group; h++)
        for (int qt = kt; qt < n_qt; qt++) {
            int q0 = qt * AT_B;
            __syncthreads(); // the previous iteration's tiles are no longer read
            load_head_tile<HD>(sm.q, base, C, (size_t)h * HD, q0, S);
            load_head_tile<HD>(sm.dout, dbase, Dq, (size_t)h * HD, q0, S);
            for (int r = threadIdx.x; r < AT_B; r += blockDim.x) {
                bool ok = q0 + r < S;
                sm.lse[r] = ok ? lse[((size_t)b * d.Hq + h) * d.S + q0 + r] : 0.0f;
                sm.dsum[r] = ok ? D[((size_t)b * d.S + q0 + r) * d.Hq + h] : 0.0f;
            }
            __syncthreads();
            tile_qkt<HD>(&sm.s[w0][0], SF_LD, &sm.q[w0][0], HD + PAD_H, sm.k);    // S = Q K^T
            tile_qkt<HD>(&sm.dp[w0][0], SF_LD, &sm.dout[w0][0], HD + PAD_H, sm.v); // dP = dO V^T
            __syncwarp();
            for (int i = lane; i < 16 * AT_B; i += 32) {
                int r = w0 + i / AT_B, c = i % AT_B;
                bool ok = k0 + c <= q0 + r && q0 + r < S && k0 + c < S;
                float p = ok ? __expf(sm.s[r][c] * scale - sm.lse[r]) : 0.0f;
                sm.p[r][c] = to_bf(p);
                sm.ds[r][c] = to_bf(p * (sm.dp[r][c] - sm.dsum[r]));
            }
            __syncthreads();
            // warp w: keys 16w..16w+15 of dV += P^T dO and dK += dS^T Q (column-major views of P, dS)
            tile_accumulate<HD, wmma::col_major>(&sm.dv[w0][0], HD + 4, &sm.p[0][w0], PS_LD, 16 * PS_LD, sm.dout);
            tile_accumulate<HD, wmma::col_major>(&sm.dk[w0][0], HD + 4, &sm.ds[0][w0], PS_LD, 16 * PS_LD, sm.q);
            // warp w: queries 16w..16w+15 of dQ += dS K, staged 16 x 16 through its rows of dp
            for (int n = 0; n < HD / 16; n++) {
                Acc acc;
                wmma::fill_fragment(acc, 0.0f);
                for (int kk = 0; kk < AT_B / 16; kk++) {
                    wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa;
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> fb;
                    wmma::load_matrix_sync(fa, &sm.ds[w0][16 * kk], PS_LD);
                    wmma::load_matrix_sync(fb, &sm.k[16 * kk][16 * n], HD + PAD_H);
                    wmma::mma_sync(acc, fa, fb, acc);
                }
                wmma::store_matrix_sync(&sm.dp[w0][0], acc, SF_LD, wmma::mem_row_major);
                __syncwarp();
                for (int i = lane; i < 256; i += 32) {
                    int r = i / 16, c = i % 16;
                    if (q0 + w0 + r < S)
                        atomicAdd(&dq[((size_t)b * d.S + q0 + w0 + r) * Dq + (size_t)h * HD + 16 * n + c],
                                  sm.dp[w0 + r][c] * scale);
                }
                __syncwarp();
            }
        }
    __syncthreads();
    for (int i = threadIdx.x; i < AT_B * HD; i += blockDim.x) {
        int r = i / HD, c = i % HD;
        if (k0 + r >= S) continue;
        bf16 *row = dqkv + ((size_t)b * d.S + k0 + r) * C;
        row[(d.Hq + g) * HD + c] = to_bf(sm.dk[r][c] * scale);
        row[(d.Hq + d.Hkv + g) * HD + c] = to_bf(sm.dv[r][c]);
    }
}

// dqkv's q columns from the fp32 dQ accumulator.
__global__ void attention_dq_kernel(bf16 *dqkv, const float *dq, size_t T, size_t Dq, size_t C) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < T * Dq; i += (size_t)gridDim.x * blockDim.x)
        dqkv[(i / Dq) * C + i % Dq] = to_bf(dq[i]);
}

template <typename Smem, typename Kernel> static void raise_smem(Kernel k) {
    CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sizeof(Smem)));
}

template <int HD> static void attention_forward_hd(void *out, void *lse, const void *qkv, AttnDims d) {
    static bool configured;
    if (!configured) raise_smem<FwdSmem<HD>>(attention_forward_kernel<HD>), configured = true;
    dim3 grid((unsigned)((d.S + AT_B - 1) / AT_B), (unsigned)d.Hq, (unsigned)d.B);
    attention_forward_kernel<HD><<<grid, AT_THREADS, sizeof(FwdSmem<HD>), STREAM>>>((bf16 *)out, (float *)lse,
                                                                                    (const bf16 *)qkv, d);
    CUDA_LAUNCH_CHECK();
}

template <int HD>
static void attention_backward_hd(void *dqkv, const void *dout, const void *qkv, const void *out, const void *lse, AttnDims d) {
    static bool configured;
    if (!configured) raise_smem<BwdSmem<HD>>(attention_backward_kernel<HD>), configured = true;
    size_t T = d.B * d.S, Dq = d.Hq * HD, C = (d.Hq + 2 * d.Hkv) * HD;
    float *dq = (float *)attn_scratch((T * Dq + T * d.Hq) * sizeof(float)), *D = dq + T * Dq;
    CUDA_CHECK(cudaMemsetAsync(dq, 0, T * Dq * sizeof(float), STREAM));
    attention_row_dot_kernel<<<cuda_blocks(T * d.Hq, 8), 256, 0, STREAM>>>(D, (const bf16 *)dout, (const bf16 *)out,
                                                                           T * d.Hq, HD);
    CUDA_LAUNCH_CHECK();
    dim3 grid((unsigned)((d.S + AT_B - 1) / AT_B), (unsigned)d.Hkv, (unsigned)d.B);
    attention_backward_kernel<HD><<<grid, AT_THREADS, sizeof(BwdSmem<HD>), STREAM>>>(
        (bf16 *)dqkv, dq, (const bf16 *)dout, (const bf16 *)qkv, (const float *)lse, D, d);
    CUDA_LAUNCH_CHECK();
    attention_dq_kernel<<<cuda_blocks(T * Dq, 256 * 4), 256, 0, STREAM>>>((bf16 *)dqkv, dq, T, Dq, C);
    CUDA_LAUNCH_CHECK();
}

#define DISPATCH_HD(hd, call)                                                                    \
    switch (hd) {                                                                                \
    case 16: call(16); break;                                                                    \
    case 32: call(32); break;                                                                    \
    case 64: call(64); break;                                                                    \
    case 128: call(128); break;                                                                  \
    default: moe_fatal("the CUDA attention supports head_dim 16, 32, 64 or 128, not %zu", hd);  \
    }

extern "C" void cuda_attention_forward(void *out, void *lse, const void *qkv, AttnDims d) {
    if (!d.B || !d.S) return;
#define FWD(HD) attention_forward_hd<HD>(out, lse, qkv, d)
    DISPATCH_HD(d.hd, FWD)
#undef FWD
}

extern "C" void cuda_attention_backward(void *dqkv, const void *dout, const void *qkv, const void *out,
                                        const void *lse, AttnDims d) {
    if (!d.B || !d.S) return;
#define BWD(HD) attention_backward_hd<HD>(dqkv, dout, qkv, out, lse, d)
    DISPATCH_HD(d.hd, BWD)
#undef BWD
}

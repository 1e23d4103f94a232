// CUDA kernels for attention: QK-norm + RoPE on packed qkv rows, and causal grouped-query flash
// attention (forward keeps only each row's log-sum-exp; backward recomputes the probabilities).
// Attention runs through cuDNN (cuda_attention_cudnn.cu) where it has an engine for the shape;
// the built-in kernels here serve the other shapes and GPUs: tiles of 64 queries x 64 keys through
// tensor cores (mma.sync) with the scores, probabilities and accumulators in registers, as
// FlashAttention-2 does.
#include "cuda_common.cuh"
#include "cuda_mma.cuh"
#include "cuda_ops.h"

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

// Fragment layouts: see cuda_mma.cuh. The C tiles of two adjacent n8 blocks are, packed to bf16,
// the A fragment of the next product: probabilities never leave registers.
#define AT_B 64                 // queries and keys per tile
#define AT_WARPS 4              // each warp owns 16 rows of a tile
#define AT_THREADS (32 * AT_WARPS)
#define AT_PAD 8                // bf16 padding of each row (no ldmatrix bank conflicts)

template <int HD> using Tile = bf16[AT_B][HD + AT_PAD];

// Rows [r0, r0 + 64) of one head (HD columns at `col` of rows of width ld) into a tile,
// asynchronously; rows past `rows` are zero.
template <int HD>
__device__ void tile_load(Tile<HD> &tile, const bf16 *base, size_t ld, size_t col, int r0, int rows) {
    for (int c = threadIdx.x; c < AT_B * HD / 8; c += blockDim.x) {
        int r = c / (HD / 8), v = (c % (HD / 8)) * 8;
        bool ok = r0 + r < rows;
        cp_async16(&tile[r][v], ok ? base + (size_t)(r0 + r) * ld + col + v : base, ok);
    }
}

template <int HD> __device__ __forceinline__ void frag_a(uint32_t a[4], const Tile<HD> &t, int r0, int c0) {
    ldsm_a(a, &t[0][0], HD + AT_PAD, r0, c0);
}

// B (k, n) = tile[n][k] (the keys of K as columns), two n8 blocks from n0.
template <int HD> __device__ __forceinline__ void frag_b_rows(uint32_t b[4], const Tile<HD> &t, int n0, int c0) {
    ldsm_b_nk(b, &t[0][0], HD + AT_PAD, n0, c0);
}

// B (k, n) = tile[k][n] (keys x head dim), two n8 blocks from c0.
template <int HD> __device__ __forceinline__ void frag_b_cols(uint32_t b[4], const Tile<HD> &t, int k0, int c0) {
    ldsm_b_kn(b, &t[0][0], HD + AT_PAD, c0, k0);
}

// acc (16 x 64: eight n8 blocks) = A (16 x HD, fragments in registers) times B (k, n) = b[n][k].
template <int HD>
__device__ __forceinline__ void product_frags(float acc[8][4], const uint32_t fa[HD / 16][4], const Tile<HD> &b) {
    for (int j = 0; j < 8; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    for (int kk = 0; kk < HD / 16; kk++)
        for (int jp = 0; jp < 4; jp++) {
            uint32_t fb[4];
            frag_b_rows<HD>(fb, b, jp * 16, kk * 16);
            mma16816(acc[2 * jp], fa[kk], fb[0], fb[1]);
            mma16816(acc[2 * jp + 1], fa[kk], fb[2], fb[3]);
        }
}

// The A fragments of rows [r0, r0 + 16) of a tile, all of the head dim.
template <int HD> __device__ __forceinline__ void frags_rows(uint32_t fa[HD / 16][4], const Tile<HD> &a, int r0) {
    for (int kk = 0; kk < HD / 16; kk++) frag_a<HD>(fa[kk], a, r0, kk * 16);
}

// acc (16 x 64) = rows [r0, r0 + 16) of `a` times B (k, n) = b[n][k] over HD.
template <int HD>
__device__ __forceinline__ void product_rows(float acc[8][4], const Tile<HD> &a, int r0, const Tile<HD> &b) {
    uint32_t fa[HD / 16][4];
    frags_rows<HD>(fa, a, r0);
    product_frags<HD>(acc, fa, b);
}

// out (16 x HD: HD/8 n8 blocks) += P (16 x 64, the C tiles of a previous product, packed) times
// B (k, n) = b[k][n] (keys x head dim).
template <int HD>
__device__ __forceinline__ void product_accumulate(float out[HD / 8][4], const float p[8][4], const Tile<HD> &b) {
    for (int i = 0; i < 4; i++) {
        uint32_t pa[4] = {pack_bf16(p[2 * i][0], p[2 * i][1]), pack_bf16(p[2 * i][2], p[2 * i][3]),
                          pack_bf16(p[2 * i + 1][0], p[2 * i + 1][1]), pack_bf16(p[2 * i + 1][2], p[2 * i + 1][3])};
        for (int np = 0; np < HD / 16; np++) {
            uint32_t fb[4];
            frag_b_cols<HD>(fb, b, 16 * i, 16 * np);
            mma16816(out[2 * np], pa, fb[0], fb[1]);
            mma16816(out[2 * np + 1], pa, fb[2], fb[3]);
        }
    }
}

template <int HD> struct FwdSmem {
    Tile<HD> q, k[2], v[2];
};

// A block per (query tile, query head, batch); the heaviest tiles (most keys) start first.
template <int HD>
__global__ void __launch_bounds__(AT_THREADS) attention_forward_kernel(bf16 *out, float *lse, const bf16 *qkv, AttnDims d) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    FwdSmem<HD> &sm = *reinterpret_cast<FwdSmem<HD> *>(smem_raw);
    int qt = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z, S = (int)d.S, q0 = qt * AT_B;
    int kvh = h / (int)(d.Hq / d.Hkv);
    size_t C = (d.Hq + 2 * d.Hkv) * HD;
    const bf16 *base = qkv + (size_t)b * d.S * C;
    const float scale = rsqrtf((float)HD);
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane / 4, t = lane % 4, w0 = warp * 16;
    tile_load<HD>(sm.q, base, C, (size_t)h * HD, q0, S);
    tile_load<HD>(sm.k[0], base, C, (d.Hq + kvh) * HD, 0, S);
    tile_load<HD>(sm.v[0], base, C, (d.Hq + d.Hkv + kvh) * HD, 0, S);
    cp_async_commit();
    float o[HD / 8][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0, 0};
    for (int n = 0; n < HD / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0;
    uint32_t qf[HD / 16][4]; // this warp's queries, loaded once
    for (int kt = 0; kt <= qt; kt++) {
        int st = kt & 1, k0 = kt * AT_B;
        cp_async_wait_all();
        __syncthreads(); // tile kt is in; every warp is done with tile kt - 1
        if (kt < qt) {
            tile_load<HD>(sm.k[st ^ 1], base, C, (d.Hq + kvh) * HD, k0 + AT_B, S);
            tile_load<HD>(sm.v[st ^ 1], base, C, (d.Hq + d.Hkv + kvh) * HD, k0 + AT_B, S);
        }
        cp_async_commit();
        if (kt == 0) frags_rows<HD>(qf, sm.q, w0);
        float s[8][4];
        product_frags<HD>(s, qf, sm.k[st]);
        // scale, causal mask, online softmax over the two rows this lane holds
        float mx[2] = {-INFINITY, -INFINITY};
        for (int j = 0; j < 8; j++)
            for (int e = 0; e < 4; e++) {
                int qi = q0 + w0 + g + (e / 2) * 8, ki = k0 + j * 8 + 2 * t + (e % 2);
                float v = ki <= qi && ki < S ? s[j][e] * scale : -INFINITY;
                s[j][e] = v;
                mx[e / 2] = fmaxf(mx[e / 2], v);
            }
        float alpha[2], use[2], sum[2] = {0, 0};
        for (int r = 0; r < 2; r++) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            float m_new = fmaxf(m[r], mx[r]);
            use[r] = m_new == -INFINITY ? 0.0f : m_new;
            alpha[r] = __expf(m[r] - use[r]);
            m[r] = m_new;
        }
        for (int j = 0; j < 8; j++)
            for (int e = 0; e < 4; e++) {
                float p = __expf(s[j][e] - use[e / 2]);
                s[j][e] = p;
                sum[e / 2] += p;
            }
        for (int r = 0; r < 2; r++) {
            sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 1);
            sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 2);
            l[r] = l[r] * alpha[r] + sum[r];
        }
        for (int n = 0; n < HD / 8; n++) o[n][0] *= alpha[0], o[n][1] *= alpha[0], o[n][2] *= alpha[1], o[n][3] *= alpha[1];
        product_accumulate<HD>(o, s, sm.v[st]);
    }
    for (int r = 0; r < 2; r++) {
        int qi = q0 + w0 + g + r * 8;
        if (qi >= S) continue;
        size_t row = ((size_t)b * d.S + qi) * d.Hq * HD + (size_t)h * HD;
        float inv = 1.0f / l[r];
        for (int n = 0; n < HD / 8; n++)
            *reinterpret_cast<uint32_t *>(&out[row + n * 8 + 2 * t]) = pack_bf16(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
        if (t == 0) lse[((size_t)b * d.Hq + h) * d.S + qi] = m[r] + logf(l[r]);
    }
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
    Tile<HD> k, v, q, dout;
    bf16 ds[AT_B][AT_B + AT_PAD]; // dS^T: [key][query]
    float lse[AT_B], dsum[AT_B];
};

// A block per (key tile, kv head, batch); each warp owns 16 keys and keeps their dK, dV in
// registers while it walks the group's query heads and the query tiles that see those keys.
// S^T = K Q^T, P^T, dP^T = V dO^T, dS^T in registers; dQ = dS K through dS^T in shared memory,
// added to an fp32 buffer atomically.
template <int HD>
__global__ void __launch_bounds__(AT_THREADS) attention_backward_kernel(bf16 *dqkv, float *dq, const bf16 *dout,
                                                                        const bf16 *qkv, const float *lse,
                                                                        const float *D, AttnDims d) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    BwdSmem<HD> &sm = *reinterpret_cast<BwdSmem<HD> *>(smem_raw);
    int kt = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z, S = (int)d.S, k0 = kt * AT_B;
    int group = (int)(d.Hq / d.Hkv), n_qt = (S + AT_B - 1) / AT_B;
    size_t C = (d.Hq + 2 * d.Hkv) * HD, Dq = d.Hq * HD;
    const bf16 *base = qkv + (size_t)b * d.S * C, *dbase = dout + (size_t)b * d.S * Dq;
    const float scale = rsqrtf((float)HD);
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane / 4, t = lane % 4, w0 = warp * 16;
    tile_load<HD>(sm.k, base, C, (d.Hq + kvh) * HD, k0, S);
    tile_load<HD>(sm.v, base, C, (d.Hq + d.Hkv + kvh) * HD, k0, S);
    cp_async_commit();
    float dk[HD / 8][4], dv[HD / 8][4];
    for (int n = 0; n < HD / 8; n++)
        for (int e = 0; e < 4; e++) dk[n][e] = dv[n][e] = 0;
    for (int h = kvh * group; h < (kvh + 1) * group; h++)
        for (int qt = kt; qt < n_qt; qt++) {
            int q0 = qt * AT_B;
            __syncthreads(); // the previous iteration's Q, dO and dS^T are no longer read
            tile_load<HD>(sm.q, base, C, (size_t)h * HD, q0, S);
            tile_load<HD>(sm.dout, dbase, Dq, (size_t)h * HD, q0, S);
            cp_async_commit();
            for (int r = threadIdx.x; r < AT_B; r += blockDim.x) {
                bool ok = q0 + r < S;
                sm.lse[r] = ok ? lse[((size_t)b * d.Hq + h) * d.S + q0 + r] : 0.0f;
                sm.dsum[r] = ok ? D[((size_t)b * d.S + q0 + r) * d.Hq + h] : 0.0f;
            }
            cp_async_wait_all();
            __syncthreads();
            float p[8][4], dp[8][4];
            product_rows<HD>(p, sm.k, w0, sm.q);     // S^T (keys x queries)
            product_rows<HD>(dp, sm.v, w0, sm.dout); // dP^T
            for (int j = 0; j < 8; j++)
                for (int e = 0; e < 4; e++) {
                    int ki = k0 + w0 + g + (e / 2) * 8, qc = j * 8 + 2 * t + (e % 2), qi = q0 + qc;
                    bool ok = ki <= qi && qi < S && ki < S;
                    float pv = ok ? __expf(p[j][e] * scale - sm.lse[qc]) : 0.0f;
                    p[j][e] = pv;
                    dp[j][e] = pv * (dp[j][e] - sm.dsum[qc]); // now dS^T
                }
            product_accumulate<HD>(dv, p, sm.dout); // dV += P^T dO
            product_accumulate<HD>(dk, dp, sm.q);   // dK += dS^T Q (scaled at the end)
            for (int j = 0; j < 8; j++) {
                *reinterpret_cast<uint32_t *>(&sm.ds[w0 + g][j * 8 + 2 * t]) = pack_bf16(dp[j][0], dp[j][1]);
                *reinterpret_cast<uint32_t *>(&sm.ds[w0 + g + 8][j * 8 + 2 * t]) = pack_bf16(dp[j][2], dp[j][3]);
            }
            __syncthreads();
            // dQ rows [w0, w0 + 16) of this query tile: A (query, key) = ds[key][query] transposed
            float acc[HD / 8][4];
            for (int n = 0; n < HD / 8; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0;
            for (int kk = 0; kk < AT_B; kk += 16) {
                uint32_t fa[4];
                ldsm_a_trans(fa, &sm.ds[0][0], AT_B + AT_PAD, w0, kk);
                for (int np = 0; np < HD / 16; np++) {
                    uint32_t fb[4];
                    frag_b_cols<HD>(fb, sm.k, kk, 16 * np);
                    mma16816(acc[2 * np], fa, fb[0], fb[1]);
                    mma16816(acc[2 * np + 1], fa, fb[2], fb[3]);
                }
            }
            for (int r = 0; r < 2; r++) {
                int qi = q0 + w0 + g + r * 8;
                if (qi >= S) continue;
                float *row = dq + ((size_t)b * d.S + qi) * Dq + (size_t)h * HD;
                for (int n = 0; n < HD / 8; n++)
                    atomicAdd(reinterpret_cast<float2 *>(&row[n * 8 + 2 * t]),
                              make_float2(acc[n][2 * r] * scale, acc[n][2 * r + 1] * scale));
            }
        }
    for (int r = 0; r < 2; r++) {
        int ki = k0 + w0 + g + r * 8;
        if (ki >= S) continue;
        bf16 *row = dqkv + ((size_t)b * d.S + ki) * C;
        for (int n = 0; n < HD / 8; n++) {
            *reinterpret_cast<uint32_t *>(&row[(d.Hq + kvh) * HD + n * 8 + 2 * t]) =
                pack_bf16(dk[n][2 * r] * scale, dk[n][2 * r + 1] * scale);
            *reinterpret_cast<uint32_t *>(&row[(d.Hq + d.Hkv + kvh) * HD + n * 8 + 2 * t]) =
                pack_bf16(dv[n][2 * r], dv[n][2 * r + 1]);
        }
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
    default: MOE_ASSERT(!"head_dim in CUDA_LIMITS");                                             \
    }

extern "C" void cuda_attention_forward(void *out, void *lse, const void *qkv, AttnDims d) {
    if (!d.B || !d.S) return;
    if (!cuda_ctx.builtin_attention && cuda_attention_forward_cudnn(out, lse, qkv, d)) return;
#define FWD(HD) attention_forward_hd<HD>(out, lse, qkv, d)
    DISPATCH_HD(d.hd, FWD)
#undef FWD
}

extern "C" void cuda_attention_backward(void *dqkv, const void *dout, const void *qkv, const void *out,
                                        const void *lse, AttnDims d) {
    if (!d.B || !d.S) return;
    if (!cuda_ctx.builtin_attention && cuda_attention_backward_cudnn(dqkv, dout, qkv, out, lse, d, false)) return;
#define BWD(HD) attention_backward_hd<HD>(dqkv, dout, qkv, out, lse, d)
    DISPATCH_HD(d.hd, BWD)
#undef BWD
}

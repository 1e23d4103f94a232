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

// The attention backward's dQ accumulator and row dots.
static void *attn_scratch(size_t bytes) {
    static void *buf;
    static size_t have;
    return cuda_grow_scratch(&buf, &have, bytes);
}

// ---------------------------------------------------------------- QK-norm + RoPE
//
// A block holds one token's qkv row in registers as 16-byte chunks of 8 values: thread tid holds
// chunks c = i * blockDim + tid, i < QKV_CHUNKS. blockDim is a multiple of 32 and a head is
// hd / 8 <= 16 consecutive chunks, so a head lies in aligned consecutive lanes of one warp: the
// per-head norm reduces with shuffles, and RoPE's partner of a chunk (the same pairs in the head's
// other half) is lane ^ (hd / 16). The whole-width norm (QK_NORM_FULL) reduces over the block. Each
// row is read once and written once in 16-byte accesses. The weight gradients are summed per block
// and then over blocks, each in a fixed order: deterministic, no atomics.

#define QKV_CHUNKS 8        // chunks per thread at most
#define QKV_MAX_THREADS 384 // a block's at most: the backward fits in 170 registers then (6 blocks of 64 an SM)

typedef struct {
    int C8, qk8, q8, head8; // chunks per row, of the q and k heads, of the q heads, per head
} QkvChunks;

__host__ __device__ static QkvChunks qkv_chunks(AttnDims d) {
    return {(int)((d.Hq + 2 * d.Hkv) * d.hd / 8), (int)((d.Hq + d.Hkv) * d.hd / 8), (int)(d.Hq * d.hd / 8),
            (int)(d.hd / 8)};
}

// Threads of a block that holds n8 chunks of a row.
static unsigned qkv_threads(int n8) {
    unsigned per = (unsigned)((n8 + QKV_CHUNKS - 1) / QKV_CHUNKS);
    MOE_CHECK(per <= QKV_MAX_THREADS, "QK-norm + RoPE: a qkv row of %d values is more than one block holds (%d); "
              "use fewer heads or a smaller head_dim", n8 * 8, QKV_MAX_THREADS * QKV_CHUNKS * 8);
    return (per + 31) / 32 * 32;
}

// Sum of v over the lanes of one head (head8 aligned lanes). Every lane of the warp calls it.
__device__ __forceinline__ float head_sum(float v, int head8) {
    for (int o = head8 / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// (q, k) sums over the block in a fixed order; every thread gets them. red: 32 float2 of shared memory.
__device__ float2 block_sum2(float q, float k, float2 *red) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    q = warp_sum(q), k = warp_sum(k);
    if (lane == 0) red[warp] = make_float2(q, k);
    __syncthreads();
    float2 s = make_float2(0, 0);
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) s.x += red[w].x, s.y += red[w].y;
    __syncthreads();
    return s;
}

// The (cos, sin) pairs of a token's RoPE table row at this thread's 8 positions of a head half:
// the same for every chunk the thread holds (cc: the chunks' place in their heads).
struct RopeChunk {
    float4 r[4]; // (cos, sin) of positions j0 + 2i and j0 + 2i + 1
};

__device__ __forceinline__ RopeChunk rope_load(const float *table_row, int cc, int head8) {
    const float4 *p = reinterpret_cast<const float4 *>(table_row + 2 * (cc % (head8 / 2)) * 8);
    return {{p[0], p[1], p[2], p[3]}};
}

// RoPE of a chunk of 8 values: positions j0..j0+7 of a head's first or second half; the partner
// lane holds the same positions of the other half. inverse: rotate back (the gradient's transpose).
// Every lane of the warp calls it.
__device__ __forceinline__ void rope_chunk(float v[8], const RopeChunk &rc, int cc, int head8, bool inverse) {
    int half8 = head8 / 2;
    float sgn = (cc < half8) != inverse ? -1.0f : 1.0f, p[8];
    for (int e = 0; e < 8; e++) p[e] = __shfl_xor_sync(0xffffffffu, v[e], half8);
    for (int e = 0; e < 8; e += 2) {
        float4 q = rc.r[e / 2];
        v[e] = v[e] * q.x + sgn * p[e] * q.y;
        v[e + 1] = v[e + 1] * q.z + sgn * p[e + 1] * q.w;
    }
}

// The norm weights of chunk c (a q or k chunk).
template <int MODE>
__device__ __forceinline__ void chunk_weight(float w[8], int c, QkvChunks k, const bf16 *wq, const bf16 *wk) {
    bool is_q = c < k.q8;
    int at = MODE == QK_NORM_HEAD ? (c % k.head8) * 8 : (is_q ? c : c - k.q8) * 8;
    load8(w, (is_q ? wq : wk) + at);
}

// rstd of chunk c's group in the token's (Hq + Hkv) row: per head, or q at 0 and k at Hq.
template <int MODE>
__device__ __forceinline__ int rstd_slot(int c, QkvChunks k, int Hq) {
    return MODE == QK_NORM_HEAD ? c / k.head8 : (c < k.q8 ? 0 : Hq);
}

// The whole-width norm's (q, k) sums of f(chunk) over the token's q and k chunks (of the first n8
// chunks the block holds).
template <typename F>
__device__ __forceinline__ float2 full_sums(QkvChunks k, int n8, float2 *red, F f) {
    float sq = 0, sk = 0;
    #pragma unroll
    for (int i = 0; i < QKV_CHUNKS && i * (int)blockDim.x < n8; i++) {
        int c = i * blockDim.x + threadIdx.x;
        float s = f(i, c);
        if (c < k.q8) sq += s;
        else if (c < k.qk8) sk += s;
    }
    return block_sum2(sq, sk, red);
}

template <int MODE>
__global__ void qkv_norm_rope_forward_kernel(bf16 *qkv, float *rstd, const bf16 *raw, const bf16 *wq,
                                             const bf16 *wk, const float *rope, AttnDims d, float eps) {
    __shared__ float2 red[32];
    QkvChunks k = qkv_chunks(d);
    size_t t = blockIdx.x, nr = d.Hq + d.Hkv;
    const uint4 *in = reinterpret_cast<const uint4 *>(raw + t * k.C8 * 8);
    uint4 *out = reinterpret_cast<uint4 *>(qkv + t * k.C8 * 8), u[QKV_CHUNKS];
    #pragma unroll
    for (int i = 0; i < QKV_CHUNKS; i++) {
        int c = i * blockDim.x + threadIdx.x;
        u[i] = c < k.C8 ? in[c] : make_uint4(0, 0, 0, 0);
    }
    auto squares = [&](int i, int c) {
        float v[8], s = 0;
        unpack8(v, u[i]);
        for (int e = 0; e < 8; e++) s += v[e] * v[e];
        return s;
    };
    float2 full = MODE == QK_NORM_FULL ? full_sums(k, k.C8, red, squares) : make_float2(0, 0);
    float rs_q = rsqrtf(full.x / (float)(d.Hq * d.hd) + eps), rs_k = rsqrtf(full.y / (float)(d.Hkv * d.hd) + eps);
    int cc = threadIdx.x % k.head8;
    RopeChunk cs = rope_load(rope + (t % d.S) * d.hd, cc, k.head8);
    #pragma unroll
    for (int i = 0; i < QKV_CHUNKS && i * (int)blockDim.x < k.C8; i++) { // block-uniform: shuffles inside
        int c = i * blockDim.x + threadIdx.x;
        float v[8], w[8], rs = c < k.q8 ? rs_q : rs_k;
        if (MODE == QK_NORM_HEAD) rs = rsqrtf(head_sum(squares(i, c), k.head8) / (float)d.hd + eps);
        unpack8(v, u[i]);
        if (MODE != QK_NORM_NONE && c < k.qk8) {
            chunk_weight<MODE>(w, c, k, wq, wk);
            for (int e = 0; e < 8; e++) v[e] *= rs * w[e];
            if (MODE == QK_NORM_HEAD ? c % k.head8 == 0 : c == 0 || c == k.q8)
                rstd[t * nr + rstd_slot<MODE>(c, k, (int)d.Hq)] = rs;
        }
        rope_chunk(v, cs, cc, k.head8, false);
        if (c < k.qk8) out[c] = pack8(v);
        else if (c < k.C8) out[c] = u[i]; // v passes through
    }
}

// The gradient of chunk i with RoPE undone (every lane of the warp calls it).
__device__ __forceinline__ void unrotated_grad(float g[8], uint4 gu, const RopeChunk &cs, int cc, int head8) {
    unpack8(g, gu);
    rope_chunk(g, cs, cc, head8, true);
}

// Grid: token-striding blocks; dw_part (gridDim, nw): each block's weight-gradient sums, nw =
// Dq + Dk (FULL) or 2 hd (HEAD: dwq then dwk). draw may be dqkv: in place, the block holds only the
// q and k chunks, and v's gradient stays where it is.
template <int MODE>
__global__ void __launch_bounds__(QKV_MAX_THREADS)
    qkv_norm_rope_backward_kernel(bf16 *draw, float *dw_part, const bf16 *dqkv, const bf16 *raw,
                                              const bf16 *wq, const bf16 *wk, const float *rstd, const float *rope,
                                              AttnDims d) {
    extern __shared__ float dw_acc[]; // FULL: (Dq + Dk), each value owned by one thread; HEAD: (blockDim, 16)
    __shared__ float2 red[32];
    QkvChunks k = qkv_chunks(d);
    size_t T = d.B * d.S, nr = d.Hq + d.Hkv;
    int cc = threadIdx.x % k.head8, n8 = draw == dqkv ? k.qk8 : k.C8;
    float dwh_q[8] = {}, dwh_k[8] = {}; // HEAD: this thread's dwq and dwk sums at its 8 positions of a head
    auto own_dw = [&](float *dst, const float *src) { // FULL: copy this thread's share of dw_acc
        #pragma unroll
        for (int i = 0; i < QKV_CHUNKS; i++) {
            int c = i * blockDim.x + threadIdx.x;
            if (c < k.qk8)
                for (int e = 0; e < 8; e++) dst[c * 8 + e] = src ? src[c * 8 + e] : 0.0f;
        }
    };
    if (MODE == QK_NORM_FULL) own_dw(dw_acc, NULL);
    for (size_t t = blockIdx.x; t < T; t += gridDim.x) {
        const uint4 *g_in = reinterpret_cast<const uint4 *>(dqkv + t * k.C8 * 8);
        const uint4 *x_in = reinterpret_cast<const uint4 *>(raw + t * k.C8 * 8);
        uint4 *out = reinterpret_cast<uint4 *>(draw + t * k.C8 * 8), gu[QKV_CHUNKS], xu[QKV_CHUNKS];
        #pragma unroll
        for (int i = 0; i < QKV_CHUNKS; i++) {
            int c = i * blockDim.x + threadIdx.x;
            gu[i] = c < n8 ? g_in[c] : make_uint4(0, 0, 0, 0);
            xu[i] = MODE != QK_NORM_NONE && c < k.qk8 ? x_in[c] : make_uint4(0, 0, 0, 0);
        }
        RopeChunk cs = rope_load(rope + (t % d.S) * d.hd, cc, k.head8);
        // sum over the group of g w x (g: the gradient of the normalised values)
        auto gwx = [&](int i, int c) {
            float g[8], x[8], w[8], s = 0;
            unrotated_grad(g, gu[i], cs, cc, k.head8);
            if (c >= k.qk8) return 0.0f;
            unpack8(x, xu[i]);
            chunk_weight<MODE>(w, c, k, wq, wk);
            for (int e = 0; e < 8; e++) s += g[e] * w[e] * x[e];
            return s;
        };
        float2 full = MODE == QK_NORM_FULL ? full_sums(k, n8, red, gwx) : make_float2(0, 0);
        #pragma unroll
        for (int i = 0; i < QKV_CHUNKS && i * (int)blockDim.x < n8; i++) { // block-uniform: shuffles inside
            int c = i * blockDim.x + threadIdx.x;
            float dot = MODE == QK_NORM_HEAD ? head_sum(gwx(i, c), k.head8) : c < k.q8 ? full.x : full.y;
            float g[8], x[8], w[8];
            unrotated_grad(g, gu[i], cs, cc, k.head8);
            if (c >= k.qk8) {
                if (c < n8) out[c] = gu[i]; // v's gradient passes through (not in place)
                continue;
            }
            if (MODE != QK_NORM_NONE) {
                float rs = rstd[t * nr + rstd_slot<MODE>(c, k, (int)d.Hq)];
                int width = MODE == QK_NORM_HEAD ? (int)d.hd : (c < k.q8 ? k.q8 : k.qk8 - k.q8) * 8;
                float coef = dot * rs * rs * rs / (float)width;
                unpack8(x, xu[i]);
                chunk_weight<MODE>(w, c, k, wq, wk);
                for (int e = 0; e < 8; e++) {
                    if (MODE == QK_NORM_FULL) dw_acc[c * 8 + e] += g[e] * x[e] * rs;
                    else if (c < k.q8) dwh_q[e] += g[e] * x[e] * rs;
                    else dwh_k[e] += g[e] * x[e] * rs;
                    g[e] = rs * w[e] * g[e] - coef * x[e];
                }
            }
            out[c] = pack8(g);
        }
    }
    if (MODE == QK_NORM_NONE) return;
    float *part = dw_part + (size_t)blockIdx.x * (MODE == QK_NORM_HEAD ? 2 * d.hd : k.qk8 * 8);
    if (MODE == QK_NORM_FULL) {
        own_dw(part, dw_acc);
    } else {
        for (int e = 0; e < 8; e++) dw_acc[threadIdx.x * 16 + e] = dwh_q[e], dw_acc[threadIdx.x * 16 + 8 + e] = dwh_k[e];
        __syncthreads();
        for (int j = threadIdx.x; j < 2 * (int)d.hd; j += blockDim.x) { // j = which * hd + position
            int which = j / (int)d.hd, pos = j % (int)d.hd;
            float s = 0;
            for (int th = pos / 8; th < (int)blockDim.x; th += k.head8) s += dw_acc[th * 16 + which * 8 + pos % 8];
            part[j] = s;
        }
    }
}

extern "C" void cuda_qkv_norm_rope_forward(void *qkv, void *rstd, const void *qkv_raw, const void *wq, const void *wk,
                                           const void *rope, AttnDims d, QkNorm mode, float eps) {
    size_t T = d.B * d.S;
    if (!T) return;
    auto kernel = mode == QK_NORM_FULL ? qkv_norm_rope_forward_kernel<QK_NORM_FULL>
                  : mode == QK_NORM_HEAD ? qkv_norm_rope_forward_kernel<QK_NORM_HEAD>
                                         : qkv_norm_rope_forward_kernel<QK_NORM_NONE>;
    kernel<<<(unsigned)T, qkv_threads(qkv_chunks(d).C8), 0, STREAM>>>((bf16 *)qkv, (float *)rstd, (const bf16 *)qkv_raw,
                                                       (const bf16 *)wq, (const bf16 *)wk, (const float *)rope, d, eps);
    CUDA_LAUNCH_CHECK();
}

extern "C" void cuda_qkv_norm_rope_backward(void *dqkv_raw, void *dwq, void *dwk, const void *dqkv,
                                            const void *qkv_raw, const void *wq, const void *wk, const void *rstd,
                                            const void *rope, AttnDims d, QkNorm mode) {
    static void *part_buf;
    static size_t part_have;
    size_t T = d.B * d.S;
    if (!T) return;
    QkvChunks k = qkv_chunks(d);
    unsigned threads = qkv_threads(dqkv_raw == dqkv ? k.qk8 : k.C8);
    int nw = mode == QK_NORM_HEAD ? 2 * (int)d.hd : k.qk8 * 8, nq = mode == QK_NORM_HEAD ? (int)d.hd : k.q8 * 8;
    size_t smem = mode == QK_NORM_FULL ? (size_t)nw * sizeof(float) : mode == QK_NORM_HEAD ? threads * 16 * sizeof(float) : 0;
    auto kernel = mode == QK_NORM_FULL ? qkv_norm_rope_backward_kernel<QK_NORM_FULL>
                  : mode == QK_NORM_HEAD ? qkv_norm_rope_backward_kernel<QK_NORM_HEAD>
                                         : qkv_norm_rope_backward_kernel<QK_NORM_NONE>;
    if (smem > 48 * 1024) CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    int resident = 0; // token-striding blocks, one wave of them (rows of the partial sums)
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, (int)threads, smem));
    size_t blocks = (size_t)cuda_ctx.sm_count * (resident > 0 ? resident : 1);
    if (blocks > T) blocks = T;
    float *part = mode == QK_NORM_NONE ? NULL
                                       : (float *)cuda_grow_scratch(&part_buf, &part_have, blocks * nw * sizeof(float));
    kernel<<<(unsigned)blocks, threads, smem, STREAM>>>((bf16 *)dqkv_raw, part, (const bf16 *)dqkv, (const bf16 *)qkv_raw,
                                              (const bf16 *)wq, (const bf16 *)wk, (const float *)rstd,
                                              (const float *)rope, d);
    CUDA_LAUNCH_CHECK();
    if (mode == QK_NORM_NONE) return;
    cuda_add_column_sums((float *)dwq, part, blocks, (size_t)nq, (size_t)nw);
    cuda_add_column_sums((float *)dwk, part + nq, blocks, (size_t)(nw - nq), (size_t)nw);
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
    if (!cuda_ctx.builtin_attention && cuda_attention_forward_cudnn(out, lse, qkv, d, cuda_ctx.deterministic)) return;
#define FWD(HD) attention_forward_hd<HD>(out, lse, qkv, d)
    DISPATCH_HD(d.hd, FWD)
#undef FWD
}

// The scratch of the call that runs at these dims: cuDNN's workspace, or the built-in backward's
// fp32 dQ and row sums (attention_backward_hd).
extern "C" size_t cuda_attention_workspace(AttnDims d) {
    size_t T = d.B * d.S, bytes;
    if (!cuda_ctx.builtin_attention && cuda_attention_workspace_cudnn(d, cuda_ctx.deterministic, &bytes)) return bytes;
    return (T * d.Hq * d.hd + T * d.Hq) * sizeof(float);
}

extern "C" void cuda_attention_backward(void *dqkv, const void *dout, const void *qkv, const void *out,
                                        const void *lse, AttnDims d) {
    if (!d.B || !d.S) return;
    if (!cuda_ctx.builtin_attention && cuda_attention_backward_cudnn(dqkv, dout, qkv, out, lse, d, cuda_ctx.deterministic))
        return;
    if (cuda_ctx.deterministic)
        moe_fatal("train.deterministic = true needs cuDNN's attention, and %s (B %zu S %zu heads %zu/%zu hd %zu): the "
                  "built-in attention backward adds dQ atomically, in no fixed order. Run without MOE_KERNELS=builtin "
                  "or attention=builtin, or set train.deterministic=false",
                  cuda_ctx.builtin_attention ? "MOE_KERNELS chose the built-in kernels" : "cuDNN has no engine for this shape",
                  d.B, d.S, d.Hq, d.Hkv, d.hd);
#define BWD(HD) attention_backward_hd<HD>(dqkv, dout, qkv, out, lse, d)
    DISPATCH_HD(d.hd, BWD)
#undef BWD
}

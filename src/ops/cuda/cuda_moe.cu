// CUDA kernels for the mixture-of-experts ops, all on the device: the router (a thread per token),
// its aux losses, a stable counting sort of the routed slots into expert-contiguous rows (per-block
// histograms, a scan over blocks, then ranks from warp matching), the weighted combine, the
// expert-parallel regroup, and loss-free bias balancing. Offsets never leave the GPU.
#include "common/rng.h"
#include "cuda_common.cuh"
#include "cuda_ops.h"
#include "ops/exchange_plan.h"

#define STREAM cuda_ctx.stream

// ---------------------------------------------------------------- router

// Softmax or sigmoid scores of one token, its top-k (by logit when no bias or noise steers the
// choice: the same order as the scores, and exactly what the CPU reference picks), weights, and
// lse^2 (T) for the z-loss (the aux sums over tokens follow in a fixed order).
__global__ void router_forward_kernel(float *scores, int32_t *topk_idx, float *topk_w, int32_t *counts, float *lse2,
                                      const bf16 *logits, const float *bias, const StepInfo *step, RouterArgs a) {
    int E = (int)a.E, K = (int)a.K;
    size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t < a.T) {
        const bf16 *l = logits + t * E;
        float *s = scores + t * E;
        float mx = -INFINITY, sum = 0;
        for (int e = 0; e < E; e++) mx = fmaxf(mx, bf(l[e]));
        for (int e = 0; e < E; e++) sum += expf(bf(l[e]) - mx);
        float lse = mx + logf(sum);
        for (int e = 0; e < E; e++) {
            float x = bf(l[e]);
            s[e] = a.kind == ROUTER_SOFTMAX ? expf(x - lse) : 1.0f / (1.0f + expf(-x));
        }
        lse2[t] = lse * lse;
        int idx[CUDA_MAX_TOP_K];
        float wsum = 0;
        for (int k = 0; k < K; k++) {
            int best = -1;
            double best_v = 0;
            for (int e = 0; e < E; e++) {
                bool taken = false;
                for (int j = 0; j < k; j++) taken |= idx[j] == e;
                if (taken) continue;
                double v = a.random ? rng_routing_noise(step->seed, a.layer, a.token_base + t, E, e)
                           : bias ? (double)s[e] : (double)bf(l[e]);
                if (bias) v += bias[e];
                if (best < 0 || v > best_v) best = e, best_v = v;
            }
            idx[k] = best;
            float w = a.random ? (float)rng_routing_noise(step->seed, a.layer, a.token_base + t, E, best) : s[best];
            topk_w[t * K + k] = w;
            wsum += w;
            topk_idx[t * K + k] = best;
            atomicAdd(&counts[best], 1);
        }
        if (a.renorm)
            for (int k = 0; k < K; k++) topk_w[t * K + k] /= wsum;
    }
}

__global__ void router_counts_to_aux_kernel(float *aux, const int32_t *counts, int E) {
    for (int e = threadIdx.x; e < E; e += blockDim.x) aux[e] = (float)counts[e];
}

extern "C" void cuda_router_forward(void *scores, int32_t *topk_idx, void *topk_w, int32_t *counts, void *aux,
                                    const void *logits, const void *bias, const StepInfo *step, RouterArgs a) {
    static void *lse2_buf;
    static size_t lse2_have;
    CUDA_CHECK(cudaMemsetAsync(counts, 0, a.E * sizeof(int32_t), STREAM));
    CUDA_CHECK(cudaMemsetAsync(aux, 0, router_aux_len(a.E) * sizeof(float), STREAM));
    float *lse2 = (float *)cuda_grow_scratch(&lse2_buf, &lse2_have, (a.T ? a.T : 1) * sizeof(float));
    if (a.T) {
        router_forward_kernel<<<cuda_blocks(a.T, 128), 128, 0, STREAM>>>(
            (float *)scores, topk_idx, (float *)topk_w, counts, lse2, (const bf16 *)logits, (const float *)bias, step, a);
        CUDA_LAUNCH_CHECK();
        cuda_add_column_sums((float *)aux + a.E, (const float *)scores, a.T, a.E, a.E); // score sums
        cuda_add_column_sums((float *)aux + 2 * a.E, lse2, a.T, 1, 1);
    }
    router_counts_to_aux_kernel<<<1, 256, 0, STREAM>>>((float *)aux, counts, (int)a.E);
    CUDA_LAUNCH_CHECK();
}

// LB = (E / K) sum_e (c_e / T) (P_e / T), Z = sum lse^2 / T over the micro-batch (T_global).
__global__ void router_aux_loss_kernel(float *stats, const float *aux, RouterArgs a, float weight) {
    __shared__ float scratch[32];
    int E = (int)a.E;
    float T = (float)a.T_global, lb = 0;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        lb += aux[e] / T * aux[E + e] / T;
        stats[e] += weight * aux[e];
    }
    lb = block_sum(lb, scratch);
    if (threadIdx.x == 0) {
        stats[router_stat_lb(E)] += weight * lb * (float)E / (float)a.K;
        stats[router_stat_z(E)] += weight * aux[2 * E] / T;
    }
}

extern "C" void cuda_router_aux_loss(void *stats, const void *aux, RouterArgs a, float weight) {
    router_aux_loss_kernel<<<1, 256, 0, STREAM>>>((float *)stats, (const float *)aux, a, weight);
    CUDA_LAUNCH_CHECK();
}

__global__ void router_backward_kernel(bf16 *dlogits, const float *dtopk_w, const bf16 *logits, const float *scores,
                                       const int32_t *topk_idx, const float *topk_w, const float *aux, RouterArgs a) {
    size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= a.T) return;
    int E = (int)a.E, K = (int)a.K;
    float Tg = (float)a.T_global, lb_scale = a.lb_grad * (float)E / (float)K / (Tg * Tg);
    const float *s = scores + t * E, *dw = dtopk_w + t * K, *w = topk_w + t * K;
    const int32_t *idx = topk_idx + t * K;
    float wdw = 0, ssum = 0;
    for (int k = 0; k < K; k++) wdw += dw[k] * w[k], ssum += s[idx[k]];
    const bf16 *l = logits + t * E;
    float mx = -INFINITY, sum = 0;
    for (int e = 0; e < E; e++) mx = fmaxf(mx, bf(l[e]));
    for (int e = 0; e < E; e++) sum += expf(bf(l[e]) - mx);
    float lse = mx + logf(sum);
    // ds[e] = lb part + the chosen weights' part; sum_e ds s for the softmax Jacobian
    float sds = 0;
    for (int e = 0; e < E; e++) {
        float ds = lb_scale * aux[e];
        for (int k = 0; k < K && !a.random; k++)
            if (idx[k] == e) ds += a.renorm ? (dw[k] - wdw) / ssum : dw[k];
        sds += ds * s[e];
    }
    for (int e = 0; e < E; e++) {
        float ds = lb_scale * aux[e];
        for (int k = 0; k < K && !a.random; k++)
            if (idx[k] == e) ds += a.renorm ? (dw[k] - wdw) / ssum : dw[k];
        float g = a.kind == ROUTER_SOFTMAX ? s[e] * (ds - sds) : ds * s[e] * (1.0f - s[e]);
        float p = expf(bf(l[e]) - lse);
        dlogits[t * E + e] = to_bf(g + a.z_grad * 2.0f * lse * p / Tg);
    }
}

extern "C" void cuda_router_backward(void *dlogits, const void *dtopk_w, const void *logits, const void *scores,
                                     const int32_t *topk_idx, const void *topk_w, const void *aux, RouterArgs a) {
    if (!a.T) return;
    router_backward_kernel<<<cuda_blocks(a.T, 128), 128, 0, STREAM>>>(
        (bf16 *)dlogits, (const float *)dtopk_w, (const bf16 *)logits, (const float *)scores, topk_idx,
        (const float *)topk_w, (const float *)aux, a);
    CUDA_LAUNCH_CHECK();
}

// ---------------------------------------------------------------- dispatch (stable counting sort)

#define SORT_CHUNK 1024 // slots per block (32 warps x 32)

// Scratch of the sort: per-block histograms, grown on first use (before any step is recorded).
static int32_t *sort_scratch(size_t n) {
    static void *buf;
    static size_t have;
    return (int32_t *)cuda_grow_scratch(&buf, &have, n * sizeof(int32_t));
}

__global__ void sort_histogram_kernel(int32_t *block_counts, const int32_t *topk_idx, size_t n, int E) {
    __shared__ int32_t hist[CUDA_MAX_EXPERTS];
    for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
    __syncthreads();
    size_t i = (size_t)blockIdx.x * SORT_CHUNK + threadIdx.x;
    if (i < n) atomicAdd(&hist[topk_idx[i]], 1);
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) block_counts[(size_t)blockIdx.x * E + e] = hist[e];
}

// Offsets of the kept rows (capacity caps each expert), each block's first rank per expert, and
// the dropped slots into stats. One thread per expert, then one for the prefix.
__global__ void sort_scan_kernel(int32_t *block_counts, int32_t *offsets, float *stats, const int32_t *counts,
                                 int n_blocks, int E, int capacity) {
    __shared__ int32_t kept[CUDA_MAX_EXPERTS];
    int e = threadIdx.x;
    if (e < E) {
        int running = 0;
        for (int b = 0; b < n_blocks; b++) {
            int c = block_counts[(size_t)b * E + e];
            block_counts[(size_t)b * E + e] = running;
            running += c;
        }
        kept[e] = capacity > 0 && counts[e] > capacity ? capacity : counts[e];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int dropped = 0;
        offsets[0] = 0;
        for (int j = 0; j < E; j++) offsets[j + 1] = offsets[j] + kept[j], dropped += counts[j] - kept[j];
        stats[router_stat_dropped(E)] += (float)dropped;
    }
}

// Rank of each slot among its expert's slots in token order: earlier blocks (scan), earlier warps
// of this block (per-warp histograms), earlier lanes of this warp (match).
__global__ void sort_rank_kernel(int32_t *slot_pos, const int32_t *block_first, const int32_t *offsets,
                                 const int32_t *topk_idx, size_t n, int E) {
    __shared__ int32_t warp_hist[SORT_CHUNK / 32][CUDA_MAX_EXPERTS];
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    for (int e = lane; e < E; e += 32) warp_hist[warp][e] = 0;
    __syncwarp();
    size_t i = (size_t)blockIdx.x * SORT_CHUNK + threadIdx.x;
    int e = i < n ? topk_idx[i] : -1;
    unsigned same = __match_any_sync(0xffffffffu, e);
    int in_warp = __popc(same & ((1u << lane) - 1));
    if (e >= 0 && in_warp == 0) warp_hist[warp][e] = __popc(same);
    __syncthreads();
    if (e < 0) return;
    int rank = block_first[(size_t)blockIdx.x * E + e] + in_warp;
    for (int w = 0; w < warp; w++) rank += warp_hist[w][e];
    int kept = offsets[e + 1] - offsets[e];
    slot_pos[i] = rank < kept ? offsets[e] + rank : -1;
}

// Rows in 16-byte vectors by one warp, ROW_BATCH vectors a lane loaded before any is stored (the
// loads of a row in flight together).
#define ROW_BATCH 4

__device__ __forceinline__ void warp_copy_row(uint4 *__restrict__ dst, const uint4 *__restrict__ src, size_t n16,
                                              int lane) {
    for (size_t j0 = lane; j0 < n16; j0 += 32 * ROW_BATCH) {
        uint4 v[ROW_BATCH];
#pragma unroll
        for (int b = 0; b < ROW_BATCH; b++)
            if (j0 + 32 * b < n16) v[b] = src[j0 + 32 * b];
#pragma unroll
        for (int b = 0; b < ROW_BATCH; b++)
            if (j0 + 32 * b < n16) dst[j0 + 32 * b] = v[b];
    }
}

// A warp per slot.
__global__ void gather_rows_kernel(bf16 *xp, const bf16 *x, const int32_t *slot_pos, size_t n, int K, size_t D) {
    size_t i = (size_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (i >= n) return;
    int pos = slot_pos[i];
    if (pos < 0) return;
    warp_copy_row(reinterpret_cast<uint4 *>(xp + (size_t)pos * D), reinterpret_cast<const uint4 *>(x + (i / K) * D),
                  D / 8, threadIdx.x & 31);
}

extern "C" void cuda_moe_dispatch_forward(void *xp, int32_t *slot_pos, int32_t *offsets, void *stats, const void *x,
                                          const int32_t *topk_idx, const int32_t *counts, size_t T, size_t K, size_t E,
                                          size_t D, size_t capacity) {
    size_t n = T * K;
    unsigned blocks = cuda_blocks(n, SORT_CHUNK);
    int32_t *block_counts = sort_scratch((size_t)blocks * E);
    sort_histogram_kernel<<<blocks, SORT_CHUNK, 0, STREAM>>>(block_counts, topk_idx, n, (int)E);
    CUDA_LAUNCH_CHECK();
    sort_scan_kernel<<<1, CUDA_MAX_EXPERTS, 0, STREAM>>>(block_counts, offsets, (float *)stats, counts, (int)blocks,
                                                         (int)E, (int)capacity);
    CUDA_LAUNCH_CHECK();
    sort_rank_kernel<<<blocks, SORT_CHUNK, 0, STREAM>>>(slot_pos, block_counts, offsets, topk_idx, n, (int)E);
    CUDA_LAUNCH_CHECK();
    if (!n || !xp) return;
    gather_rows_kernel<<<cuda_blocks(n, 8), 256, 0, STREAM>>>((bf16 *)xp, (const bf16 *)x, slot_pos, n, (int)K, D);
    CUDA_LAUNCH_CHECK();
}

// out[t] = base[t] (NULL: 0; may be out) + sum over kept slots of w * rows[pos] (w NULL: 1);
// combine and dispatch backward.
__global__ void sum_slot_rows_kernel(bf16 *out, const bf16 *base, const bf16 *rows, const int32_t *slot_pos,
                                     const float *w, int K, size_t D) {
    size_t t = blockIdx.x;
    for (size_t j = 8 * threadIdx.x; j < D; j += 8 * blockDim.x) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, v[8];
        if (base) load8(acc, base + t * D + j);
        for (int k = 0; k < K; k++) {
            int pos = slot_pos[t * K + k];
            if (pos < 0) continue;
            float wk = w ? w[t * K + k] : 1.0f;
            load8(v, rows + (size_t)pos * D + j);
            for (int q = 0; q < 8; q++) acc[q] += wk * v[q];
        }
        store8(out + t * D + j, acc);
    }
}

extern "C" void cuda_moe_dispatch_backward(void *dx, const void *dxp, const int32_t *slot_pos, size_t T, size_t K,
                                           size_t D, bool accumulate_dx) {
    if (!T) return;
    sum_slot_rows_kernel<<<(unsigned)T, 256, 0, STREAM>>>((bf16 *)dx, accumulate_dx ? (const bf16 *)dx : NULL,
                                                          (const bf16 *)dxp, slot_pos, NULL, (int)K, D);
    CUDA_LAUNCH_CHECK();
}

extern "C" void cuda_moe_combine_forward(void *out, const void *base, const void *y, const int32_t *slot_pos,
                                         const void *topk_w, size_t T, size_t K, size_t D) {
    if (!T) return;
    sum_slot_rows_kernel<<<(unsigned)T, 256, 0, STREAM>>>((bf16 *)out, (const bf16 *)base, (const bf16 *)y, slot_pos,
                                                          (const float *)topk_w, (int)K, D);
    CUDA_LAUNCH_CHECK();
}

// A warp per slot: dy[pos] = w dout[t]; dw = dout[t] . y[pos] (0 for a dropped slot). Without y:
// dy[pos] = dout[t] (not with dy NULL) and row_w[pos] = w.
__global__ void combine_backward_kernel(bf16 *__restrict__ dy, float *dtopk_w, float *row_w,
                                        const bf16 *__restrict__ dout, const bf16 *__restrict__ y,
                                        const int32_t *slot_pos, const float *topk_w, size_t n, int K, size_t D) {
    size_t i = (size_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x & 31;
    if (i >= n) return;
    int pos = slot_pos[i];
    if (pos < 0) {
        if (lane == 0 && y) dtopk_w[i] = 0;
        return;
    }
    const bf16 *g = dout + (i / K) * D;
    float w = topk_w[i], dot = 0;
    if (!y) {
        w = 1.0f;
        if (lane == 0) row_w[pos] = topk_w[i];
        if (!dy) return;
    }
#pragma unroll 4
    for (size_t j = 8 * lane; j < D; j += 256) {
        float gv[8], yv[8];
        load8(gv, g + j);
        if (y) load8(yv, y + (size_t)pos * D + j);
        for (int q = 0; q < 8; q++) dot += y ? gv[q] * yv[q] : 0.0f, gv[q] *= w;
        store8(dy + (size_t)pos * D + j, gv);
    }
    dot = warp_sum(dot);
    if (lane == 0 && y) dtopk_w[i] = dot;
}

extern "C" void cuda_moe_combine_backward(void *dy, void *dtopk_w, void *row_w, const void *dout, const void *y,
                                          const int32_t *slot_pos, const void *topk_w, size_t T, size_t K, size_t D) {
    size_t n = T * K;
    if (!n) return;
    combine_backward_kernel<<<cuda_blocks(n, 8), 256, 0, STREAM>>>((bf16 *)dy, (float *)dtopk_w, (float *)row_w,
                                                                   (const bf16 *)dout, (const bf16 *)y, slot_pos,
                                                                   (const float *)topk_w, n, (int)K, D);
    CUDA_LAUNCH_CHECK();
}

__global__ void slot_values_kernel(float *dtopk_w, const float *row_dot, const int32_t *slot_pos, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dtopk_w[i] = slot_pos[i] < 0 ? 0.0f : row_dot[slot_pos[i]];
}

__global__ void row_tokens_kernel(int32_t *row_token, const int32_t *slot_pos, size_t n, int K) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && slot_pos[i] >= 0) row_token[slot_pos[i]] = (int32_t)(i / K);
}

extern "C" void cuda_moe_row_tokens(int32_t *row_token, const int32_t *slot_pos, size_t T, size_t K) {
    size_t n = T * K;
    if (!n) return;
    row_tokens_kernel<<<(unsigned)((n + 255) / 256), 256, 0, STREAM>>>(row_token, slot_pos, n, (int)K);
    CUDA_LAUNCH_CHECK();
}

extern "C" void cuda_moe_slot_values(void *dtopk_w, const void *row_dot, const int32_t *slot_pos, size_t n) {
    if (!n) return;
    slot_values_kernel<<<(unsigned)((n + 255) / 256), 256, 0, STREAM>>>((float *)dtopk_w, (const float *)row_dot,
                                                                         slot_pos, n);
    CUDA_LAUNCH_CHECK();
}

// Regroup in two launches: one thread scans the (source, expert) block counts into each block's
// start in both orders, then warps copy rows (16-byte vectors) found by binary search over the
// source-major starts. Both directions walk the source-major positions.
__global__ void regroup_scan_kernel(int32_t *starts, const int32_t *counts, int ep, int El) {
    int32_t *src = starts, *exp = starts + ep * El, *total = starts + 2 * ep * El;
    int pos = 0;
    for (int b = 0; b < ep * El; b++) src[b] = pos, pos += counts[b];
    *total = pos;
    pos = 0;
    for (int e = 0; e < El; e++)
        for (int r = 0; r < ep; r++) exp[r * El + e] = pos, pos += counts[r * El + e];
}

__global__ void regroup_rows_kernel(bf16 *out, const bf16 *in, const int32_t *starts, int ep, int El, size_t D,
                                    bool to_expert_major) {
    const int32_t *src = starts, *exp = starts + ep * El;
    int total = starts[2 * ep * El], nb = ep * El, lane = threadIdx.x & 31;
    size_t warps = (size_t)gridDim.x * (blockDim.x / 32);
    for (size_t i = (size_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; i < (size_t)total; i += warps) {
        int lo = 0, hi = nb - 1; // last block whose source-major start is <= i
        while (lo < hi) {
            int mid = (lo + hi + 1) / 2;
            if (src[mid] <= (int)i) lo = mid; else hi = mid - 1;
        }
        size_t a = i, b = (size_t)exp[lo] + (i - (size_t)src[lo]);
        size_t from = to_expert_major ? a : b, to = to_expert_major ? b : a;
        const uint4 *s4 = reinterpret_cast<const uint4 *>(in + from * D);
        uint4 *d4 = reinterpret_cast<uint4 *>(out + to * D);
        warp_copy_row(d4, s4, D / 8, lane);
    }
}

// The direct exchange's plan: a thread per entry (E + 1 of them; E is at most a few hundred); each
// block sums its threads' dropped rows and adds them once.
__global__ void exchange_plan_kernel(int32_t *plan, const int32_t *all_offsets, size_t n, size_t El, size_t rank,
                                     size_t cap, float *dropped) {
    __shared__ float scratch[32];
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    float mine = i <= n * El ? (float)exchange_plan_entry(plan, all_offsets, n, El, rank, i, cap) : 0.0f;
    float total = block_sum(mine, scratch);
    if (threadIdx.x == 0 && total > 0) atomicAdd(dropped, total);
}

extern "C" void cuda_moe_exchange_plan(int32_t *plan, const int32_t *all_offsets, size_t n, size_t El, size_t rank,
                                       size_t cap, void *dropped) {
    size_t entries = n * El + 1;
    exchange_plan_kernel<<<cuda_blocks(entries, 128), 128, 0, STREAM>>>(plan, all_offsets, n, El, rank, cap,
                                                                         (float *)dropped);
    CUDA_LAUNCH_CHECK();
}

// Block k of a push's selection (ops.h PushBlocks).
__device__ __forceinline__ const int32_t *push_block(const PushBlocks &sel, int k) {
    return sel.blocks + 4 * ((size_t)k / sel.run * sel.stride + (size_t)k % sel.run);
}

// The selection's rows, block after block, are split into one contiguous run per warp (16-byte
// vectors, up to 8 loads in flight per lane before its stores), so at any moment the warps are
// spread over every destination: the rows bound for a peer cross NVLink from the start instead of
// queueing behind the local ones. Each thread block sums the selected blocks' rows into `starts`
// (shared); a warp finds its first row's block by binary search over them, then walks on (rows at
// or past R were dropped: zeros go out). Unbounded, 4 blocks of 256 threads per SM; bounded to
// `ctas` blocks (to run beside other kernels), blocks of 1024 threads, so that the few SMs still
// keep as many loads in flight. The stores go straight to the owner's memory; the fence makes them
// visible to the peer before the next stream-ordered fence completes.
#define PUSH_UNROLL 8
__global__ void __launch_bounds__(1024) push_rows_kernel(void *const *peers, size_t dst_offset, const bf16 *__restrict__ in, PushBlocks sel,
                                 size_t D, size_t R) {
    __shared__ int32_t starts[CUDA_MAX_EXPERTS + 1]; // (selected blocks + 1) row starts
    int n_sel = (int)(sel.run * sel.runs), lane = threadIdx.x & 31;
    for (int k = threadIdx.x; k < n_sel; k += blockDim.x) starts[k + 1] = push_block(sel, k)[1];
    __syncthreads();
    if (threadIdx.x == 0) {
        starts[0] = 0;
        for (int k = 0; k < n_sel; k++) starts[k + 1] += starts[k];
    }
    __syncthreads();
    size_t total = (size_t)starts[n_sel], warps = (size_t)gridDim.x * (blockDim.x / 32);
    size_t warp = (size_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, per = (total + warps - 1) / warps;
    size_t first = warp * per, end = first + per < total ? first + per : total, n4 = D / 8;
    int lo = 0, hi = n_sel - 1; // last selected block whose first row is <= first
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if ((size_t)starts[mid] <= first) lo = mid; else hi = mid - 1;
    }
    for (size_t p = first; p < end; p++) {
        while (lo + 1 < n_sel && (size_t)starts[lo + 1] <= p) lo++;
        const int32_t *b = push_block(sel, lo);
        size_t i = p - (size_t)starts[lo], src = (size_t)b[0] + i;
        bf16 *dst = (bf16 *)((char *)peers[b[2]] + dst_offset) + ((size_t)b[3] + i) * D;
        const uint4 *s4 = reinterpret_cast<const uint4 *>(in + src * D);
        uint4 *d4 = reinterpret_cast<uint4 *>(dst);
        bool kept = src < R;
        for (size_t j0 = lane; j0 < n4; j0 += 32 * PUSH_UNROLL) {
            uint4 v[PUSH_UNROLL];
#pragma unroll
            for (int u = 0; u < PUSH_UNROLL; u++)
                if (j0 + 32 * u < n4) v[u] = kept ? s4[j0 + 32 * u] : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int u = 0; u < PUSH_UNROLL; u++)
                if (j0 + 32 * u < n4) d4[j0 + 32 * u] = v[u];
        }
    }
    __threadfence_system();
}

extern "C" void cuda_moe_push_rows(void *const *peers, size_t dst_offset, const void *in, PushBlocks sel, size_t D,
                                   size_t R, size_t ctas) {
    if (!sel.run || !sel.runs) return;
    MOE_ASSERT(sel.run * sel.runs <= CUDA_MAX_EXPERTS);
    unsigned threads = ctas ? 1024 : 256, grid = cuda_blocks(R, threads / 32); // a warp's worth of rows each
    unsigned most = ctas ? (unsigned)ctas : (unsigned)cuda_ctx.sm_count * 4;
    if (grid > most) grid = most;
    push_rows_kernel<<<grid, threads, 0, STREAM>>>(peers, dst_offset, (const bf16 *)in, sel, D, R);
    CUDA_LAUNCH_CHECK();
}

extern "C" void cuda_moe_regroup(void *out, const void *in, const int32_t *counts, size_t ep, size_t El, size_t D,
                                 bool to_expert_major) {
    if (!ep || !El) return;
    int32_t *starts = sort_scratch(2 * ep * El + 1); // the sort's scratch is free between its uses
    regroup_scan_kernel<<<1, 1, 0, STREAM>>>(starts, counts, (int)ep, (int)El);
    CUDA_LAUNCH_CHECK();
    regroup_rows_kernel<<<(unsigned)cuda_ctx.sm_count * 4, 256, 0, STREAM>>>((bf16 *)out, (const bf16 *)in, starts,
                                                                             (int)ep, (int)El, D, to_expert_major);
    CUDA_LAUNCH_CHECK();
}

__global__ void bias_update_kernel(float *bias, const float *loads, int E, float gamma) {
    __shared__ float scratch[32];
    float total = 0;
    for (int e = threadIdx.x; e < E; e += blockDim.x) total += loads[e];
    float mean = block_sum(total, scratch) / (float)E;
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        bias[e] += gamma * (float)((mean > loads[e]) - (mean < loads[e]));
}

extern "C" void cuda_router_bias_update(void *bias, const void *loads, size_t E, float gamma) {
    bias_update_kernel<<<1, 256, 0, STREAM>>>((float *)bias, (const float *)loads, (int)E, gamma);
    CUDA_LAUNCH_CHECK();
}

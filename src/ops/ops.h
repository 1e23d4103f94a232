// The ops interface: everything the model orchestration asks of a backend (memory and kernels),
// as one struct of function pointers. The CPU backend (src/ops/cpu) is the readable reference and
// the oracle for every other backend; a CUDA backend fills the same struct.
//
// Pointers named in shape comments live in backend memory. Their element types:
//   act  compute precision (the CPU backend: `real`; a GPU backend: bf16)
//   f32  fp32 for master weights, gradients, optimizer moments, norms, router and loss math
//        (the CPU backend: `real` as well)
//   i32  int32 (token ids, expert indices, offsets, counts)
//   u64  uint64 (the FP8 quantisation's counters)
//   e4m3 one byte a value, FP8 E4M3 codes of the FP8 recipe (ops/fp8.h; its scales are f32)
// Weight gradients accumulate (+=) so micro-batches add up, but for the experts' (grouped products'
// accumulate_dw: a step's first write overwrites them); activation gradients overwrite unless an
// `accumulate` flag says otherwise. Per-step values that change every step (learning
// rate, step number, routing-noise key) are read from a StepInfo in backend memory, so a backend
// can record one step and replay it.
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ops/fp8.h"

#ifdef __cplusplus
extern "C" {
#endif

// Index helpers are also used by CUDA kernels.
#ifdef __CUDACC__
#define OPS_FN static inline __host__ __device__
#else
#define OPS_FN static inline
#endif

typedef enum { QK_NORM_NONE, QK_NORM_FULL, QK_NORM_HEAD } QkNorm;
typedef enum { ROUTER_SOFTMAX, ROUTER_SIGMOID } RouterKind;

typedef struct {
    float lr;      // learning rate of this step
    int32_t step;  // 1-based optimizer step (AdamW bias correction)
    uint64_t seed; // key of this step's routing noise (random-routing mode)
} StepInfo;

typedef struct {
    size_t B, S, Hq, Hkv, hd; // batch, sequence, query heads, key/value heads, head dim
} AttnDims;

typedef struct {
    size_t T, E, K;    // tokens of this call, experts, experts per token
    size_t T_global;   // tokens of the micro-batch over all data-parallel ranks (loss means)
    RouterKind kind;
    bool renorm;       // chosen weights renormalised to sum 1
    bool random;       // scores replaced by uniform noise for choice and weights
    uint64_t layer;    // key of the routing noise, with the step seed
    uint64_t token_base; // global index of this call's first token (noise counter)
    float lb_grad;     // d(total loss) / d(the micro-batch's load-balance loss)
    float z_grad;      // d(total loss) / d(the micro-batch's router z-loss)
} RouterArgs;

// The router's per-call summary, f32 (router_aux_len(E)): routed slots per expert, summed scores
// per expert, summed logsumexp^2. Summed over the data-parallel ranks, it gives the load-balance
// and z-losses of the whole micro-batch, as one rank holding every token would compute them.
OPS_FN size_t router_aux_len(size_t E) { return 2 * E + 1; }

// Per MoE layer, the router keeps running statistics in one f32 array of router_stats_len(E):
// [0, E) routed slots per expert, then dropped slots, load-balance loss sum, z-loss sum.
OPS_FN size_t router_stats_len(size_t E) { return E + 3; }
OPS_FN size_t router_stat_dropped(size_t E) { return E; }
OPS_FN size_t router_stat_lb(size_t E) { return E + 1; }
OPS_FN size_t router_stat_z(size_t E) { return E + 2; }

// Blocks of an exchange plan (ops.h moe_exchange_plan) that one push moves: `runs` runs of `run`
// consecutive blocks, run j starting at block j * stride of `blocks` (n x 4 i32 {src_row, rows,
// dst_rank, dst_row}); e.g. every dispatch block is one run of E, the dispatch blocks of local
// experts [e0, e1) on every rank are n runs of e1 - e0 with stride El.
typedef struct {
    const int32_t *blocks;
    size_t run, runs, stride;
} PushBlocks;

typedef struct {
    float beta1, beta2, eps;
    float weight_decay; // decoupled; 0 for norms and embeddings
    float clip;         // global-norm clip threshold (0 = no clipping)
} AdamWArgs;

// What a backend's kernels can take, declared once by the backend; config validation asks before
// anything is allocated (as ggml's supports_op does) and model_init again for programs that skip
// it, so kernels never check. 0, or no head widths listed: no limit.
typedef struct {
    size_t max_experts;    // model.n_experts
    size_t max_top_k;      // model.top_k
    size_t width_multiple; // model.d_model and every hidden width in use are multiples of it
    size_t head_dims[4];   // model.head_dim is one of these
} OpsLimits;

// What a recorded graph holds (a CUDA graph's nodes by type).
typedef struct {
    size_t nodes, kernels, memcpys, memsets, hosts, events, other; // events: records and waits
} GraphCounts;

// The device's clock and power at one moment (Ops.device_clocks): what a benchmark reports beside
// its rates, since a GPU at its power limit lowers its clock and every compute-bound kernel slows.
typedef struct {
    double t_s;                    // when it was read (moe_time_sec)
    double sm_mhz, sm_max_mhz;     // the multiprocessors' clock now, and the highest it can run at
    double power_w, power_limit_w; // the board's draw (averaged by the device over its last second) and its limit
    double energy_j;               // the board's energy counter (since the driver loaded; < 0: not known)
    bool power_capped;             // the clock is held below its highest by the power limit now
    bool thermal;                  // ... or by temperature
} DeviceClocks;

typedef struct Ops {
    const char *name;
    const OpsLimits *limits;      // NULL: whatever the model can express
    size_t act_size, f32_size;    // bytes per element of act and f32 buffers
    bool act_aliases_f32;         // act and f32 are the same type: compute weights = master weights
    size_t logits_chunk;          // LM-head logits computed at a time (elements of act)
    bool sizing_only;             // nothing is stored (counting backends): values need not be computed

    // ---- memory (sizes in bytes) ----
    void *(*alloc)(size_t bytes);
    void (*free)(void *p);
    void (*zero)(void *p, size_t bytes);
    void (*copy)(void *dst, const void *src, size_t bytes);           // within the backend
    void (*upload)(void *dst, const void *host_src, size_t bytes);    // raw bytes (i32, StepInfo)
    void (*download)(void *host_dst, const void *src, size_t bytes);
    void (*upload_f32)(void *dst, const float *host_src, size_t n);   // host float -> f32 buffer
    void (*download_f32)(float *host_dst, const void *src, size_t n); // f32 buffer -> host float
    void (*download_act)(float *host_dst, const void *src, size_t n); // act buffer -> host float
    // Transfers queued in order with the work, for a host that runs ahead of it: they return at
    // once, so their host memory (from host_alloc: pinned on a GPU) must stay as it is (upload) or
    // go unread (download) until the queue has passed them (event_wait on an event after them).
    void *(*host_alloc)(size_t bytes);
    void (*host_free)(void *p);
    void (*upload_queued)(void *dst, const void *host_src, size_t bytes);
    void (*download_f32_queued)(float *host_dst, const void *src, size_t n);
    void (*download_queued)(void *host_dst, const void *src, size_t bytes); // raw bytes (u64)
    void (*cast_f32_to_act)(void *dst, const void *src, size_t n);
    // dst (n) f32 = the initial values of elements [counter_begin, counter_begin + n) of a tensor
    // keyed by key: rng_init_value(key, i, std) (common/rng.h), or 1 when `ones`; bitwise the same
    // on every backend, so any range of a tensor can be initialised where it lives.
    void (*init_params)(void *dst, size_t n, uint64_t key, uint64_t counter_begin, double std, bool ones);
    void (*sync)(void); // waits for queued work (no-op on the CPU)
    size_t (*memory_in_use)(void); // device bytes in use now (0 when not known)
    size_t (*memory_peak)(void);   // the most bytes in use so far (0 when not known; NULL: no query)
    size_t (*memory_available)(void); // bytes it can still allocate (0 when not known; NULL: no query)
    // Bytes of library workspace the attention of these dims allocates beside the model's buffers
    // (cuDNN's, e.g. its backward's fp32 dQ accumulator), so a memory plan can count it (NULL: none).
    size_t (*attention_workspace)(AttnDims d);
    // The device's clock and power now; false when they cannot be read (NULL: no such query).
    // Called from a thread of its own while the queues run (device_monitor.h).
    bool (*device_clocks)(DeviceClocks *out);

    // ---- recording and timing (graph entries NULL where work runs eagerly) ----
    void (*capture_begin)(void);       // queued work from here on is recorded, not run
    void *(*capture_end)(void);        // the recorded work as a replayable graph
    void (*graph_launch)(void *graph); // queues one replay
    void (*graph_free)(void *graph);   // after its replays finish (NCCL work in it holds its comms)
    void (*graph_count)(const void *graph, GraphCounts *out); // its nodes (NULL: not known)
    void *(*event_create)(void);
    void (*event_record)(void *event); // marks this point of the queued work
    float (*event_elapsed_ms)(void *start, void *end); // waits for end
    void (*event_wait)(void *event);                   // until the queued work passes it
    void (*event_free)(void *event);
    // A second queue for communication that overlaps the main one (NULL: everything runs in order).
    void (*side_begin)(void); // work queued from here runs on the side queue, after the main's so far
    void (*side_end)(void);   // back to the main queue; its later work does not wait for the side's
    void (*side_join)(void);  // the main queue's later work waits for all work queued on the side
    // The queue work goes to now (a cudaStream_t: main or side), for a communication library that
    // queues on it (NCCL); NULL where work runs on the host.
    void *(*stream)(void);

    // ---- dense layers ----
    // out (T, D) = wte[tokens]; wte (V, D) act
    void (*embedding_forward)(void *out, const int32_t *tokens, const void *wte, size_t T, size_t D);
    // dwte (V, D) f32 += scatter of dout (T, D) act by tokens
    void (*embedding_backward)(void *dwte, const void *dout, const int32_t *tokens, size_t T,
                               size_t D, size_t V);
    // out (M, N) act = x (M, K) act . w (N, K)^T act   (+ out when accumulate)
    void (*matmul_forward)(void *out, const void *x, const void *w, size_t M, size_t N, size_t K,
                           bool accumulate);
    // dx (M, K) act = dout . w (+= when accumulate_dx; skipped when dx is NULL);
    // dw (N, K) f32 += dout^T . x
    void (*matmul_backward)(void *dx, void *dw, const void *dout, const void *x, const void *w,
                            size_t M, size_t N, size_t K, bool accumulate_dx);
    // out (R, W) act = x / rms(x) * w; rstd (R) f32 keeps 1 / rms for the backward
    void (*rmsnorm_forward)(void *out, void *rstd, const void *x, const void *w, size_t R,
                            size_t W, float eps);
    // dx (R, W) act (= or +=); dw (W) f32 +=
    void (*rmsnorm_backward)(void *dx, void *dw, const void *dout, const void *x, const void *w,
                             const void *rstd, size_t R, size_t W, bool accumulate_dx);
    // out = a + b, n elements act (out may alias a or b)
    void (*add)(void *out, const void *a, const void *b, size_t n);
    // sum (R, W) act = a + b (as add), then out and rstd = rmsnorm_forward of sum: a residual add
    // and the norm that reads its result, in one pass
    void (*add_rmsnorm_forward)(void *sum, void *out, void *rstd, const void *a, const void *b, const void *w,
                                size_t R, size_t W, float eps);

    // ---- attention (packed qkv rows: C = (Hq + 2 Hkv) hd, q heads then k heads then v heads) ----
    // qkv (T, C) act = RoPE(QK-norm(qkv_raw)); v copied. wq: (Hq hd) for FULL, (hd) for HEAD;
    // wk likewise with Hkv; rstd (T, Hq + Hkv) f32; rope (S, hd / 2, 2) f32 cos, sin.
    void (*qkv_norm_rope_forward)(void *qkv, void *rstd, const void *qkv_raw, const void *wq,
                                  const void *wk, const void *rope, AttnDims d, QkNorm mode,
                                  float eps);
    // dqkv_raw (T, C) act = backward of the above; dwq, dwk f32 +=. dqkv_raw may be dqkv (in
    // place: v's gradient, the same in both, is left where it is)
    void (*qkv_norm_rope_backward)(void *dqkv_raw, void *dwq, void *dwk, const void *dqkv,
                                   const void *qkv_raw, const void *wq, const void *wk,
                                   const void *rstd, const void *rope, AttnDims d, QkNorm mode);
    // causal attention: out (T, Hq hd) act; lse (B, Hq, S) f32 log-sum-exp of each score row
    void (*attention_forward)(void *out, void *lse, const void *qkv, AttnDims d);
    // dqkv (T, C) act
    void (*attention_backward)(void *dqkv, const void *dout, const void *qkv, const void *out,
                               const void *lse, AttnDims d);

    // ---- SwiGLU (rows of gu hold gate then up; rows used: [rows[0], rows[n]) of the n + 1 i32
    // row offsets `rows` (backend) when non-NULL, e.g. some experts' rows, else all R) ----
    // out (R, H) act = silu(gate) * up
    void (*swiglu_forward)(void *out, const void *gu, size_t R, size_t H, const int32_t *rows, size_t n);
    // dgu (R, 2H) act from dout (R, H) act, each row's gradient scaled by row_w[r] first (row_w
    // (R) f32, NULL: 1). dgu may be gu: each value is read before it is written. With row_dot
    // non-NULL, the same pass also gives the combine weights' gradients from the expert rows, so the
    // expert outputs need not be kept: dout . y = dout . (h W^T) = (dout W) . h. Per row, with h =
    // silu(gate) * up again and dout the down projection's input gradient of the unweighted rows:
    // row_dot (R) f32 [r] = dout[r] . h[r] and hw (R, H) act = row_w[r] h[r] (the down projection's
    // weight-gradient input).
    void (*swiglu_backward)(void *dgu, void *row_dot, void *hw, const void *dout, const void *gu,
                            const void *row_w, size_t R, size_t H, const int32_t *rows, size_t n);

    // ---- mixture of experts ----
    // From logits (T, E) act: scores (T, E) f32 (softmax or sigmoid; real scores even in random
    // mode), the top-k choice by score + bias (bias (E) f32 or NULL) into topk_idx (T, K) i32,
    // weights topk_w (T, K) f32, counts (E) i32 of routed slots, and this call's aux summary.
    void (*router_forward)(void *scores, int32_t *topk_idx, void *topk_w, int32_t *counts,
                           void *aux, const void *logits, const void *bias, const StepInfo *step,
                           RouterArgs a);
    // From the micro-batch's aux summary: adds weight x (loads, load-balance loss, z-loss) to stats
    // (the weight lets one data-parallel rank of several report them).
    void (*router_aux_loss)(void *stats, const void *aux, RouterArgs a, float weight);
    // dlogits (T, E) act from dtopk_w (T, K) f32 and the aux losses (aux: the micro-batch summary)
    void (*router_backward)(void *dlogits, const void *dtopk_w, const void *logits,
                            const void *scores, const int32_t *topk_idx, const void *topk_w,
                            const void *aux, RouterArgs a);
    // Counting sort of the routed slots into expert-contiguous rows: offsets (E + 1) i32 (rows of
    // expert e are [offsets[e], offsets[e+1])), slot_pos (T, K) i32 (row of each slot, -1 when
    // dropped), xp (R, D) act rows gathered from x (T, D) (xp NULL: not gathered; a consumer reads
    // them from x through moe_row_tokens). Within an expert, rows keep token order. capacity 0 =
    // dropless; else at most `capacity` rows per expert, the rest dropped and counted.
    void (*moe_dispatch_forward)(void *xp, int32_t *slot_pos, int32_t *offsets, void *stats,
                                 const void *x, const int32_t *topk_idx, const int32_t *counts,
                                 size_t T, size_t K, size_t E, size_t D, size_t capacity);
    // dx (T, D) act (= or +=) sum over a token's kept slots of dxp rows
    void (*moe_dispatch_backward)(void *dx, const void *dxp, const int32_t *slot_pos, size_t T,
                                  size_t K, size_t D, bool accumulate_dx);
    // out (T, D) act = base + sum_k topk_w[t, k] * y[slot_pos[t, k]], summed in fp32 and rounded
    // once (base (T, D) act, e.g. the residual stream; NULL: 0; may be out)
    void (*moe_combine_forward)(void *out, const void *base, const void *y, const int32_t *slot_pos,
                                const void *topk_w, size_t T, size_t K, size_t D);
    // For kept slots: with the expert outputs y (R, D) act, dy (R, D) act = topk_w dout rows and
    // dtopk_w (T, K) f32 = dout . y (0 for dropped slots). Without them (y NULL: the combine
    // weights' gradients come from the expert rows, swiglu_backward's row_dot), dy = the dout rows
    // unweighted (dy NULL: not copied; a consumer reads them from dout through moe_row_tokens) and
    // row_w (R) f32 = the weight of each row's slot; dtopk_w is not written.
    void (*moe_combine_backward)(void *dy, void *dtopk_w, void *row_w, const void *dout, const void *y,
                                 const int32_t *slot_pos, const void *topk_w, size_t T, size_t K,
                                 size_t D);
    // dtopk_w (n) f32 [i] = row_dot[slot_pos[i]] (0 for a dropped slot)
    void (*moe_slot_values)(void *dtopk_w, const void *row_dot, const int32_t *slot_pos, size_t n);
    // The token of each expert row: row_token[slot_pos[t, k]] = t for the kept slots of slot_pos (T,
    // K) i32 (rows of no kept slot are not written), so that row r of the dispatched rows is row
    // row_token[r] of the tokens' (T, D) tensor.
    void (*moe_row_tokens)(int32_t *row_token, const int32_t *slot_pos, size_t T, size_t K);
    // Rows grouped by (source rank, local expert) <-> by (local expert, source rank), for the rows
    // an expert-parallel rank receives: counts (ep, El) i32 rows per source and expert; out, in
    // (rows, D) act. to_expert_major false applies the inverse.
    void (*moe_regroup)(void *out, const void *in, const int32_t *counts, size_t ep, size_t El,
                        size_t D, bool to_expert_major);
    // The direct expert exchange of rank `rank` among n expert-parallel ranks with El experts each
    // (E = n El), from every rank's dispatch offsets all_offsets (n, E + 1) i32. Writes plan i32:
    // [0, El] the expert-major offsets of the rows this rank receives (source ranks in order
    // within an expert), then E dispatch blocks (this rank's rows of global expert g, to their
    // owner) and E return blocks (index e n + s: what source s sent to local expert e, back to s),
    // each {src_row, rows, dst_rank, dst_row}; the return blocks tile their source rows from 0.
    // Every receive buffer holds `cap` rows: rows past it are dropped (dispatch blocks cut short,
    // offsets stopped at cap) and this rank's dropped rows added to *dropped (f32, one value).
    void (*moe_exchange_plan)(int32_t *plan, const int32_t *all_offsets, size_t n, size_t El,
                              size_t rank, size_t cap, void *dropped);
    // Rows [src_row, src_row + rows) of in (R, D) act go to rows from dst_row of the buffer at
    // byte dst_offset from peers[dst_rank] (peers: backend array of base pointers, writable from
    // here), per block of the selection b (blocks as moe_exchange_plan writes them). Source rows at
    // or past R were dropped: their destination rows get zeros. ctas: the most thread blocks
    // (SMs' worth of work) a GPU gives it, so that it can run beside other kernels (0: no bound).
    void (*moe_push_rows)(void *const *peers, size_t dst_offset, const void *in, PushBlocks b,
                          size_t D, size_t R, size_t ctas);
    // Per expert e, rows [offsets[e], offsets[e+1]): out (R, N) act = x (R, K) . w[e] (N, K)^T.
    // R: rows of the buffers, a bound on offsets[E] (which stays in backend memory).
    void (*grouped_matmul_forward)(void *out, const void *x, const void *w, const int32_t *offsets,
                                   size_t E, size_t N, size_t K, size_t R);
    // dx (R, K) act = dout . w[e]; dw (E, N, K) f32 = dout^T . x per expert, added to dw when
    // accumulate_dw (either skipped when NULL). An expert without rows adds nothing, or (not
    // accumulate_dw) gets zeros: every dw[e] is written, so a first write needs no zeroed dw.
    void (*grouped_matmul_backward)(void *dx, void *dw, const void *dout, const void *x,
                                    const void *w, const int32_t *offsets, size_t E, size_t N,
                                    size_t K, size_t R, bool accumulate_dw);
    // Loss-free balancing: bias[e] += gamma * sign(mean(loads) - loads[e]); bias, loads (E) f32
    void (*router_bias_update)(void *bias, const void *loads, size_t E, float gamma);

    // ---- FP8 products (DeepSeek-V3 recipe, ops/fp8.h and docs/FP8.md; Kb = fp8_blocks(K)) ----
    // NULL where the backend cannot run them (the CUDA backend off Hopper).
    // Every product is out = a . b^T with both operands K-contiguous (Hopper's FP8 tensor cores
    // read no other layout), so each operand has the copy its product needs: rows of activations in
    // 1x128 blocks along K, their token-major copies for the weight gradient, and weights in
    // 128x128 blocks with their transpose for the input gradient. Scales are block-index-major (the
    // row index fastest), as CUTLASS's sm90 kernels read them. The quantisations add what they
    // count (ops/fp8.h: values, flushed, saturated, NaN) to counts, u64 (FP8_COUNTS) in backend
    // memory (NULL: nothing counted); the counts are integers, so any order gives the same totals.
    // x (R, K) act in 1x128 blocks: q (R, K) e4m3; scales f32 per group of rows, the groups of
    // offsets (E + 1) i32 as grouped_matmul_forward's (NULL: one group of R rows): group g's scales
    // are (Kb, rows of g) at Kb offsets[g], so each expert's scales are one packed matrix. Rows of no
    // group (before offsets[0] or from offsets[E] on) are left as they are.
    void (*fp8_quantize_rows)(void *q, void *scales, const void *x, const int32_t *offsets, size_t E,
                              size_t R, size_t K, Fp8Scaling how, uint64_t *counts);
    // SwiGLU and the quantised rows of its output in one pass: out (R, H) act as swiglu_forward on
    // the rows of offsets (E + 1) i32 (NULL: all R), and q, scales bit for bit as fp8_quantize_rows
    // (q, scales, out, offsets, E, R, H, how, counts) then writes them. out NULL: the output is
    // quantised but not stored (where nothing reads it but its quantised rows).
    void (*swiglu_forward_fp8)(void *out, void *q, void *scales, const void *gu, const int32_t *offsets,
                               size_t E, size_t R, size_t H, Fp8Scaling how, uint64_t *counts);
    // A pre-norm and the quantised rows of its output in one pass: with b NULL, out and rstd as
    // rmsnorm_forward of a; else sum, out and rstd as add_rmsnorm_forward of a and b. q, scales bit
    // for bit as fp8_quantize_rows(q, scales, out, NULL, 1, R, W, how, counts) then writes them.
    void (*rmsnorm_forward_fp8)(void *sum, void *out, void *rstd, void *q, void *scales, const void *a,
                                const void *b, const void *w, size_t R, size_t W, float eps, Fp8Scaling how,
                                uint64_t *counts);
    // The rows of each expert of x (R, C) act (offsets as grouped_matmul_forward; NULL: one group of
    // all R rows with E = 1, a dense layer's), transposed, in blocks of 128 rows from the expert's
    // first row: qt (C, Rt) e4m3 with Rt = fp8_expert_cols(R, E) and expert e's rows at columns
    // [fp8_expert_col(offsets[e], e), + its rows); scales (Rt / 128, fp8_col_scales(C, blocks)) f32,
    // a scale per column and 128 rows (FP8_COLS_1X128) or per 128 columns and 128 rows
    // (FP8_COLS_128X128). Columns of no expert are all-zero blocks (codes 0, scale 1).
    void (*fp8_quantize_cols)(void *qt, void *scales, const void *x, const int32_t *offsets, size_t E,
                              size_t R, size_t C, Fp8Scaling how, Fp8ColBlocks blocks, uint64_t *counts);
    // Both copies of one tensor from one read of it (the output gradient of a product, for
    // the input and the weight gradient): q, scales bit for bit as fp8_quantize_rows(q, scales, x,
    // offsets, E, R, K, how) writes them and qt, scales_t as fp8_quantize_cols(qt, scales_t, x,
    // offsets, E, R, K, how, blocks) does; counted as those two quantisations are. With x_rows (R) i32, row r
    // of the tensor quantised is row x_rows[r] of x (the dispatched rows read from the tokens' tensor,
    // moe_row_tokens; NULL: row r), for the rows of the groups. q NULL: the token-major copy alone;
    // qt NULL: the rows alone (as the op alone, from rows x_rows names).
    void (*fp8_quantize_rows_cols)(void *q, void *scales, void *qt, void *scales_t, const void *x,
                                   const int32_t *x_rows, const int32_t *offsets, size_t E, size_t R, size_t K,
                                   Fp8Scaling how, Fp8ColBlocks blocks, uint64_t *counts);
    // swiglu_backward with its output's FP8 operands from the same pass, the output itself not stored:
    // the gate|up gradient dgu (R, 2H) of dout (R, H) act and gu (R, 2H) act, each row's gradient
    // scaled by row_w (R) f32 first (NULL: 1), on the rows of offsets (E + 1) i32 (NULL: all R) as
    // swiglu_backward computes and rounds it, quantised to q, scales, qt, scales_t bit for bit as
    // fp8_quantize_rows_cols(q, scales, qt, scales_t, dgu, NULL, offsets, E, R, 2H, how, FP8_COLS_1X128, grads)
    // writes and counts them (the gate|up products' input and weight gradients read them). With
    // row_dot (R) f32 non-NULL also row_dot and hw as swiglu_backward computes them, hw quantised to
    // hwt, hw_scales as fp8_quantize_cols(hwt, hw_scales, hw, offsets, E, R, H, how, hw_blocks, acts) writes and
    // counts them (the down projection's weight gradient reads them). H a multiple of 128.
    void (*swiglu_backward_fp8)(void *q, void *scales, void *qt, void *scales_t, void *row_dot, void *hwt,
                                void *hw_scales, const void *dout, const void *gu, const void *row_w,
                                const int32_t *offsets, size_t E, size_t R, size_t H, Fp8Scaling how,
                                Fp8ColBlocks hw_blocks, uint64_t *grads, uint64_t *acts);
    // The scales of FP8 rows (R of them, Kb blocks a row) between the grouped layout fp8_quantize_rows
    // writes for offsets (E + 1) i32 (group g's (Kb, rows of g) at Kb offsets[g]) and row-major
    // (R, pitch) f32 (row r's Kb scales from r pitch; pitch >= Kb): to_rows from the grouped layout to
    // the row-major one, else back; rows of no group are left as they are. The FP8 expert exchange's
    // (train.fp8_exchange): a row's scales travel beside its codes, as a row.
    void (*fp8_regroup_scales)(void *out, const void *in, const int32_t *offsets, size_t E, size_t R, size_t Kb,
                               size_t pitch, bool to_rows);
    // FP8 rows gathered: row r of each group of offsets (E + 1) i32 of q (R, K) e4m3 and its scales
    // (as fp8_quantize_rows lays them out for offsets) = row x_rows[r] of tq (T, K) e4m3 and its
    // scales tscales, as fp8_quantize_rows writes them for one group of T rows; rows of no group are
    // left as they are. After fp8_quantize_rows(tq, tscales, x, NULL, 1, T, K, how, ..), q and scales
    // are bit for bit what fp8_quantize_rows_cols(q, scales, NULL, NULL, x, x_rows, offsets, E, R, K,
    // how, ..) writes: rows read more than once are quantised once.
    void (*fp8_gather_rows)(void *q, void *scales, const void *tq, const void *tscales, const int32_t *x_rows,
                            const int32_t *offsets, size_t E, size_t R, size_t K, size_t T);
    // x (R, K) act = the values of FP8 rows q (R, K) e4m3 with scales f32 as fp8_quantize_rows writes
    // them for offsets (E + 1) i32: each code's value times its block's scale in fp32, rounded to act;
    // rows of no group are left as they are.
    void (*fp8_dequantize_rows)(void *x, const void *q, const void *scales, const int32_t *offsets, size_t E,
                                size_t R, size_t K);
    // w (E, N, K) act in 128x128 blocks: q (E, N, K) e4m3, scales (E, Kb, Nb) f32 and scales_t (E, Nb,
    // Kb) f32 (the same scales, those of the transpose fp8_transpose_codes makes).
    void (*fp8_quantize_weights)(void *q, void *scales, void *scales_t, const void *w, size_t E, size_t N,
                                 size_t K, Fp8Scaling how, uint64_t *counts);
    // fp8_quantize_weights over the part flat [lo, hi) of w's elements (element e N K + n K + k; a
    // rank's shard of the weights, whose other parts w need not hold), in two passes with the ranks
    // holding the other parts: fp8_weights_amax writes amax (E, Kb, Nb) f32, each 128x128 block's
    // largest magnitude over the part's values in it (0 where it has none); after the parts' largest
    // (a max all-reduce), fp8_quantize_weights_part writes the part's codes into q (E, N, K) e4m3 (the
    // rest left as it is) under the scales of amax, every block's scales and scales_t from amax, and
    // counts the part's values. With the amax of all the parts, the codes and scales are bit for bit
    // fp8_quantize_weights'.
    void (*fp8_weights_amax)(void *amax, const void *w, size_t E, size_t N, size_t K, size_t lo, size_t hi);
    void (*fp8_quantize_weights_part)(void *q, void *scales, void *scales_t, const void *amax, const void *w,
                                      size_t E, size_t N, size_t K, size_t lo, size_t hi, Fp8Scaling how,
                                      uint64_t *counts);
    // qt (E, K, N) e4m3 = the transpose of each matrix of q (E, N, K) e4m3: the weights' codes as the
    // input gradient reads them (the same codes; scales_t of fp8_quantize_weights are theirs).
    void (*fp8_transpose_codes)(void *qt, const void *q, size_t E, size_t N, size_t K);
    // Per expert (offsets as grouped_matmul_forward), out (R, N) act = a (R, K) . b[e] (N, K)^T, a
    // rows (fp8_quantize_rows with the same offsets), b weights (scales (E, Kb, Nb)): the forward
    // (a = x, b = w) and the input gradient (a = dout, b = the transposed weights and scales, N and
    // K swapped).
    void (*fp8_grouped_matmul)(void *out, const void *a, const void *a_scales, const void *b,
                               const void *b_scales, const int32_t *offsets, size_t E, size_t N,
                               size_t K, size_t R);
    // Per expert, dw[e] (N, K) f32 = dout^T . x over the expert's rows, added to dw when accumulate
    // (an expert without rows: as grouped_matmul_backward's dw), from their token-major copies
    // (fp8_quantize_cols of the same offsets, NULL included): dout_t (N, Rt) e4m3 with scales
    // (Rt / 128, N) (FP8_COLS_1X128), x_t (K, Rt) e4m3 with scales (Rt / 128, fp8_col_scales(K,
    // x_blocks)).
    void (*fp8_grouped_matmul_wgrad)(void *dw, const void *dout_t, const void *dout_scales,
                                     const void *x_t, const void *x_scales, Fp8ColBlocks x_blocks,
                                     const int32_t *offsets, size_t E, size_t N, size_t K, size_t R,
                                     bool accumulate);
    // out (M, N) act = a (M, K) . b (N, K)^T: a rows (one group: scales (Kb, M)), b weights
    // (scales (Kb, Nb))
    void (*fp8_matmul)(void *out, const void *a, const void *a_scales, const void *b,
                       const void *b_scales, size_t M, size_t N, size_t K);

    // ---- loss and optimizer ----
    // Cross-entropy of logits (N, V) act against targets (N) i32 (< 0: ignored). Adds the summed
    // loss and summed logsumexp^2 to loss_acc[0], loss_acc[1] (f32). With want_grad, overwrites
    // logits with d(total)/d(logits) = ce_scale * (softmax - onehot) + z_scale * 2 lse softmax.
    void (*cross_entropy)(void *logits, void *loss_acc, const int32_t *targets, size_t N, size_t V,
                          float ce_scale, float z_scale, bool want_grad);
    // acc[0] (f32) += sum of squares of x (n) f32
    void (*sum_squares)(void *acc, const void *x, size_t n);
    // AdamW step on n elements: param f32, param_act act (NULL when it aliases param), grad, m, v
    // f32. Gradients are scaled by min(1, clip / norm) with norm = sqrt(*grad_norm_sq).
    void (*adamw_update)(void *param, void *param_act, const void *grad, void *m, void *v,
                         size_t n, AdamWArgs a, const StepInfo *step, const void *grad_norm_sq);
    // adamw_update of the E matrices (N, K) of one weight tensor, param_act NULL, and their FP8
    // copies (q, scales, scales_t as fp8_quantize_weights makes them) from the updated weights in act
    // precision, in one pass: the same values and codes as adamw_update into a compute copy followed
    // by fp8_quantize_weights of it, with no compute copy written (NULL: the backend has no such
    // pass).
    void (*adamw_update_fp8)(void *param, const void *grad, void *m, void *v, void *q, void *scales, void *scales_t,
                             size_t E, size_t N, size_t K, AdamWArgs a, const StepInfo *step,
                             const void *grad_norm_sq, Fp8Scaling how, uint64_t *counts);
} Ops;

// n act elements of normal(0, scale^2) values keyed by seed (ops_fill.c; waits for the copies).
void ops_fill_random(const Ops *o, void *act, size_t n, uint64_t seed, float scale);

const Ops *ops_cpu(void);
// The CPU backend with a compute copy of the weights apart from the fp32 master weights, as a GPU
// backend keeps them (act_aliases_f32 false; the copy is exact): the master weights are then
// sharded over the data-parallel ranks, so CPU ranks run the GPU's ZeRO-1 layout.
const Ops *ops_cpu_sharded(void);
// The CUDA backend (act = bf16) on GPU `device` (modulo the GPUs visible) when the build has it
// (make CUDA=1), else NULL. The first call picks the GPU for the process.
const Ops *ops_cuda(int device, bool deterministic);
// The CUDA backend's limits, known without starting it (no GPU touched); NULL when the build has
// no CUDA backend.
const OpsLimits *ops_cuda_limits(void);
// Sizing only (allocations are counted by the model, no kernels): fp32 activations, or bf16 ones
// as a GPU backend keeps them.
const Ops *ops_counting(bool bf16_activations);
// Sizing only, with backend's element sizes, logits chunk and weight layout (a compute copy apart
// from the master weights or not): the exact plan of that backend.
const Ops *ops_counting_like(const Ops *backend);

#ifdef __cplusplus
}
#endif

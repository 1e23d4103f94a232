// The costing backend declared in cost_ops.h: every kernel entry reports its family and work (the
// FLOPs of docs/MODEL.md's accounting, or the bytes it reads and writes) and touches no memory.
#include "cost_ops.h"

#include <string.h>

const char *const KERNEL_FAMILY_NAMES[KERNEL_N_FAMILIES] = {
    "dense_gemm", "grouped_fwd", "grouped_dgrad", "grouped_wgrad", "attention_fwd", "attention_bwd",
    "fp8_grouped", "fp8_grouped_wgrad", "fp8_dense", "elementwise", "qk_norm_rope", "routing", "optimizer",
    "fp8_quantize"};

static CostSink *sink;
static double A; // bytes of an act element
static const double F = 4; // bytes of an f32 element

static void charge(KernelFamily f, double work, double size, double moved) {
    if (work > 0) sink->kernel(sink->ctx, f, work, size, moved);
}

static void bytes(KernelFamily f, double n) { charge(f, n, n, n); }

// A product (M, N) = (M, K) . (N, K)^T as FLOPs and the act elements of its operands and result.
static void product(KernelFamily f, double M, double N, double K, double groups) {
    double flops = 2 * M * N * K;
    charge(f, flops, flops / groups, (M * K + groups * N * K + M * N) * A);
}

// Rows a grouped kernel works on: what its buffer holds, at most the rows a rank routes on average.
static double expert_rows(size_t R) {
    return sink->routed_rows && sink->routed_rows < R ? (double)sink->routed_rows : (double)R;
}

// The share of expert_rows(R) a call over `n` of `of` experts (a chunk of an MoE layer) works on.
static double share_rows(size_t R, size_t n, size_t of) {
    return expert_rows(R) * (of && n < of ? (double)n / (double)of : 1.0);
}

static void cost_zero(void *p, size_t n) { bytes(KERNEL_ELEMENTWISE, (double)n); }
static void cost_copy(void *d, const void *s, size_t n) { bytes(KERNEL_ELEMENTWISE, 2.0 * n); }
static void cost_sync(void) {}
static void cost_download(void *host, const void *src, size_t n) { memset(host, 0, n); }

static void cost_embedding_forward(void *o, const int32_t *t, const void *w, size_t T, size_t D) {
    bytes(KERNEL_ELEMENTWISE, 2.0 * T * D * A);
}
static void cost_embedding_backward(void *dw, const void *d, const int32_t *t, size_t T, size_t D, size_t V) {
    bytes(KERNEL_ELEMENTWISE, (double)T * D * (A + 2 * F)); // dout read, rows of dW read and written
}
static void cost_matmul_forward(void *o, const void *x, const void *w, size_t M, size_t N, size_t K, bool acc) {
    product(KERNEL_DENSE_GEMM, (double)M, (double)N, (double)K, 1);
}
static void cost_matmul_backward(void *dx, void *dw, const void *d, const void *x, const void *w, size_t M, size_t N,
                                 size_t K, bool acc) {
    if (dx) product(KERNEL_DENSE_GEMM, (double)M, (double)K, (double)N, 1);
    if (dw) product(KERNEL_DENSE_GEMM, (double)N, (double)K, (double)M, 1);
}
static void cost_rmsnorm_forward(void *o, void *r, const void *x, const void *w, size_t R, size_t W, float eps) {
    bytes(KERNEL_ELEMENTWISE, 2.0 * R * W * A + R * F);
}
static void cost_add_rmsnorm_forward(void *s, void *o, void *r, const void *a, const void *b, const void *w, size_t R,
                                     size_t W, float eps) {
    bytes(KERNEL_ELEMENTWISE, 4.0 * R * W * A + R * F);
}
static void cost_rmsnorm_backward(void *dx, void *dw, const void *d, const void *x, const void *w, const void *r,
                                  size_t R, size_t W, bool acc) {
    bytes(KERNEL_ELEMENTWISE, (acc ? 4.0 : 3.0) * R * W * A + R * F);
}
static void cost_add(void *o, const void *a, const void *b, size_t n) { bytes(KERNEL_ELEMENTWISE, 3.0 * n * A); }

static double qkv_elems(AttnDims d) { return (double)d.B * d.S * (d.Hq + 2 * d.Hkv) * d.hd; }
static void cost_qkv_norm_rope_forward(void *q, void *r, const void *raw, const void *wq, const void *wk,
                                       const void *rope, AttnDims d, QkNorm m, float e) {
    bytes(KERNEL_QK_NORM_ROPE, 2 * qkv_elems(d) * A);
}
static void cost_qkv_norm_rope_backward(void *dr, void *dwq, void *dwk, const void *dq, const void *raw,
                                        const void *wq, const void *wk, const void *r, const void *rope,
                                        AttnDims d, QkNorm m) {
    double qk = (double)d.B * d.S * (d.Hq + d.Hkv) * d.hd; // in place v's gradient stays where it is
    bytes(KERNEL_QK_NORM_ROPE, 3 * (dr == dq ? qk : qkv_elems(d)) * A);
}

// QK^T and PV, causal at half (docs/MODEL.md); the backward counts 2.5 x.
static double attention_flops(AttnDims d) { return 2.0 * d.B * d.Hq * (double)d.S * d.S * d.hd; }
static void cost_attention_forward(void *o, void *l, const void *q, AttnDims d) {
    charge(KERNEL_ATTENTION_FWD, attention_flops(d), attention_flops(d), 0);
}
static void cost_attention_backward(void *dq, const void *dout, const void *q, const void *o, const void *l,
                                    AttnDims d) {
    charge(KERNEL_ATTENTION_BWD, 2.5 * attention_flops(d), 2.5 * attention_flops(d), 0);
}
static double swiglu_rows(size_t R, const int32_t *rows, size_t n) {
    return rows ? share_rows(R, n, sink->local_experts) : (double)R;
}
static void cost_swiglu_forward(void *o, const void *g, size_t R, size_t H, const int32_t *rows, size_t n) {
    bytes(KERNEL_ELEMENTWISE, 3.0 * swiglu_rows(R, rows, n) * H * A);
}
// reads dout and gu, writes dgu (and with the row dots hw): 5 H per row, 6 H
static void cost_swiglu_backward(void *dg, void *dot, void *hw, const void *d, const void *g, const void *w, size_t R,
                                 size_t H, const int32_t *rows, size_t n) {
    bytes(KERNEL_ELEMENTWISE, (dot ? 6.0 : 5.0) * swiglu_rows(R, rows, n) * H * A);
}
static void cost_router_forward(void *s, int32_t *i, void *w, int32_t *c, void *aux, const void *l, const void *b,
                                const StepInfo *st, RouterArgs a) {
    bytes(KERNEL_ROUTING, (double)a.T * a.E * (A + F) + 8.0 * a.T * a.K);
}
static void cost_router_aux_loss(void *s, const void *aux, RouterArgs a, float w) {
    bytes(KERNEL_ROUTING, (2.0 * a.E + 1) * F);
}
static void cost_router_backward(void *dl, const void *dw, const void *l, const void *s, const int32_t *i,
                                 const void *w, const void *aux, RouterArgs a) {
    bytes(KERNEL_ROUTING, (double)a.T * a.E * (2 * A + F) + 8.0 * a.T * a.K);
}
static void cost_dispatch_forward(void *xp, int32_t *p, int32_t *o, void *s, const void *x, const int32_t *i,
                                  const int32_t *c, size_t T, size_t K, size_t E, size_t D, size_t cap) {
    bytes(KERNEL_ROUTING, (xp ? 2.0 * T * K * D * A : 0) + 8.0 * T * K);
}
static void cost_dispatch_backward(void *dx, const void *dxp, const int32_t *p, size_t T, size_t K, size_t D,
                                   bool acc) {
    bytes(KERNEL_ROUTING, (double)(T * K + T) * D * A);
}
static void cost_combine_forward(void *o, const void *base, const void *y, const int32_t *p, const void *w, size_t T,
                                 size_t K, size_t D) {
    bytes(KERNEL_ROUTING, (double)(T * K + (base ? 2 : 1) * T) * D * A);
}
static void cost_combine_backward(void *dy, void *dw, void *rw, const void *d, const void *y, const int32_t *p,
                                  const void *w, size_t T, size_t K, size_t D) {
    bytes(KERNEL_ROUTING, dy ? (double)((y ? 2 : 1) * T * K + T) * D * A : 12.0 * T * K);
}
static void cost_slot_values(void *dw, const void *d, const int32_t *p, size_t n) { bytes(KERNEL_ROUTING, 12.0 * n); }
static void cost_row_tokens(int32_t *rt, const int32_t *p, size_t T, size_t K) { bytes(KERNEL_ROUTING, 8.0 * T * K); }
static void cost_regroup(void *o, const void *i, const int32_t *c, size_t ep, size_t El, size_t D, bool f) {
    bytes(KERNEL_ROUTING, 2.0 * (double)sink->routed_rows * D * A);
}
static void cost_exchange_plan(int32_t *p, const int32_t *o, size_t n, size_t El, size_t r, size_t cap, void *d) {
    bytes(KERNEL_ROUTING, 4.0 * n * (n * El + 1) + 16.0 * 5 * n * El);
}
static void cost_push_rows(void *const *p, size_t off, const void *in, PushBlocks b, size_t D, size_t R,
                           size_t ctas) {
    sink->push_rows(sink->ctx, share_rows(R, b.run * b.runs, sink->experts) * D * A);
}

// Per expert: (rows_e, N) = (rows_e, K) . w_e (N, K)^T, the input gradient likewise, the weight
// gradient (N, K) f32 += dout_e^T . x_e; the size a rate is read at is the FLOPs per expert.
static void grouped(KernelFamily f, size_t E, size_t N, size_t K, size_t R) {
    double rows = share_rows(R, E, sink->local_experts), flops = 2 * rows * N * K, weights = (double)E * N * K;
    bool wgrad = f == KERNEL_GROUPED_WGRAD || f == KERNEL_FP8_GROUPED_WGRAD;
    double moved = rows * (N + K) * A + (wgrad ? 2 * F : A) * weights;
    charge(f, flops, flops / (double)E, moved);
}
static void cost_grouped_forward(void *o, const void *x, const void *w, const int32_t *off, size_t E, size_t N,
                                 size_t K, size_t R) {
    grouped(KERNEL_GROUPED_FWD, E, N, K, R);
}
// A weight gradient added to dw (acc) reads it back in its epilogue: E N K f32 more than the
// product written over, which the calibration times (the first write of a step).
static void wgrad_readback(bool acc, size_t E, size_t N, size_t K) {
    if (acc) bytes(KERNEL_ELEMENTWISE, (double)E * N * K * F);
}
static void cost_grouped_backward(void *dx, void *dw, const void *d, const void *x, const void *w,
                                  const int32_t *off, size_t E, size_t N, size_t K, size_t R, bool acc) {
    if (dx) grouped(KERNEL_GROUPED_DGRAD, E, N, K, R);
    if (dw) grouped(KERNEL_GROUPED_WGRAD, E, N, K, R), wgrad_readback(acc, E, N, K);
}
// FP8 (train.precision = fp8), in families of their own: the quantisations (and SwiGLU with its
// quantised output) read act values and write a byte each (scales aside), in KERNEL_FP8_QUANTIZE;
// the products count as the bf16 ones do, the experts' forward and input gradient (one op) in
// KERNEL_FP8_GROUPED, their weight gradient in KERNEL_FP8_GROUPED_WGRAD, the dense layers' three
// products in KERNEL_FP8_DENSE. A calibration without these families prices them at the rates of
// the bf16 families they replace (grouped_fwd, grouped_wgrad, dense_gemm, elementwise: plan/calib.h).
// Offsets NULL: one group of all R rows, a dense layer's operand.
static double fp8_rows(size_t R, const int32_t *off) { return off ? expert_rows(R) : (double)R; }
static void cost_fp8_rows(void *q, void *s, const void *x, const int32_t *off, size_t E, size_t R, size_t K,
                          Fp8Scaling h, uint64_t *n) {
    bytes(KERNEL_FP8_QUANTIZE, fp8_rows(R, off) * K * (A + 1));
}
// the norm's bytes (as the op alone), and the rows' codes written (the norm's output not read again)
static void cost_rmsnorm_fp8(void *s, void *o, void *r, void *q, void *qs, const void *a, const void *b, const void *w,
                             size_t R, size_t W, float eps, Fp8Scaling h, uint64_t *n) {
    if (b) cost_add_rmsnorm_forward(s, o, r, a, b, w, R, W, eps);
    else cost_rmsnorm_forward(o, r, a, w, R, W, eps);
    bytes(KERNEL_FP8_QUANTIZE, (double)R * W);
}
static void cost_swiglu_fp8(void *o, void *q, void *s, const void *g, const int32_t *off, size_t E, size_t R,
                            size_t H, Fp8Scaling h, uint64_t *n) {
    bytes(KERNEL_FP8_QUANTIZE, swiglu_rows(R, off, E) * H * (3 * A + 1));
}
// reads dout and gu (3 H act values a row), writes the gate|up gradient's rows and token-major codes
// (4 H bytes) and with the row dots hw's token-major codes (H)
static void cost_swiglu_backward_fp8(void *q, void *s, void *qt, void *st, void *dot, void *hwt, void *hws,
                                     const void *d, const void *g, const void *w, const int32_t *off, size_t E,
                                     size_t R, size_t H, Fp8Scaling h, Fp8ColBlocks hb, uint64_t *ng,
                                     uint64_t *na) {
    bytes(KERNEL_FP8_QUANTIZE, swiglu_rows(R, off, E) * H * (3 * A + (dot ? 5 : 4)));
}
static void cost_fp8_cols(void *q, void *s, const void *x, const int32_t *off, size_t E, size_t R, size_t C,
                          Fp8Scaling h, Fp8ColBlocks b, uint64_t *n) {
    bytes(KERNEL_FP8_QUANTIZE, fp8_rows(R, off) * C * (A + 1));
}
static void cost_fp8_rows_cols(void *q, void *s, void *qt, void *st, const void *x, const int32_t *xr,
                               const int32_t *off, size_t E, size_t R, size_t K, Fp8Scaling h, Fp8ColBlocks b,
                               uint64_t *n) {
    bytes(KERNEL_FP8_QUANTIZE, fp8_rows(R, off) * K * (A + (q != NULL) + (qt != NULL)));
}
static void cost_fp8_weights(void *q, void *s, void *st, const void *w, size_t E, size_t N, size_t K, Fp8Scaling h,
                             uint64_t *n) {
    bytes(KERNEL_FP8_QUANTIZE, (double)E * N * K * (A + 1));
}
static void cost_fp8_weights_amax(void *a, const void *w, size_t E, size_t N, size_t K, size_t lo, size_t hi) {
    bytes(KERNEL_FP8_QUANTIZE, (double)(hi - lo) * A);
}
static void cost_fp8_weights_part(void *q, void *s, void *st, const void *a, const void *w, size_t E, size_t N,
                                  size_t K, size_t lo, size_t hi, Fp8Scaling h, uint64_t *n) {
    bytes(KERNEL_FP8_QUANTIZE, (double)(hi - lo) * (A + 1));
}
// codes and scales read and written
static void cost_fp8_gather_rows(void *q, void *s, const void *tq, const void *ts, const int32_t *xr,
                                 const int32_t *off, size_t E, size_t R, size_t K, size_t T) {
    bytes(KERNEL_FP8_QUANTIZE, fp8_rows(R, off) * 2 * (K + fp8_blocks(K) * F));
}
static void cost_fp8_transpose(void *qt, const void *q, size_t E, size_t N, size_t K) {
    bytes(KERNEL_FP8_QUANTIZE, (double)E * N * K * 2);
}
// scales read and written (f32), and rows dequantised: codes and scales read, act written
static void cost_fp8_regroup_scales(void *o, const void *i, const int32_t *off, size_t E, size_t R, size_t Kb,
                                    size_t pitch, bool to_rows) {
    bytes(KERNEL_FP8_QUANTIZE, fp8_rows(R, off) * Kb * 2 * F);
}
static void cost_fp8_dequantize(void *x, const void *q, const void *s, const int32_t *off, size_t E, size_t R,
                                size_t K) {
    bytes(KERNEL_FP8_QUANTIZE, fp8_rows(R, off) * (K * (A + 1) + fp8_blocks(K) * F));
}
static void cost_fp8_grouped(void *o, const void *a, const void *as, const void *b, const void *bs,
                             const int32_t *off, size_t E, size_t N, size_t K, size_t R) {
    grouped(KERNEL_FP8_GROUPED, E, N, K, R);
}
// The experts' weight gradient with its activations in 128x128 blocks runs the forward's loop (one
// scale a row at each promotion, overlapped with the next product): KERNEL_FP8_GROUPED's rate.
static void cost_fp8_wgrad(void *dw, const void *d, const void *ds, const void *x, const void *xs, Fp8ColBlocks xb,
                           const int32_t *off, size_t E, size_t N, size_t K, size_t R, bool acc) {
    if (off) grouped(xb == FP8_COLS_128X128 ? KERNEL_FP8_GROUPED : KERNEL_FP8_GROUPED_WGRAD, E, N, K, R);
    else product(KERNEL_FP8_DENSE, (double)N, (double)K, (double)R, 1);
    wgrad_readback(acc, E, N, K);
}
static void cost_fp8_matmul(void *o, const void *a, const void *as, const void *b, const void *bs, size_t M, size_t N,
                            size_t K) {
    product(KERNEL_FP8_DENSE, (double)M, (double)N, (double)K, 1);
}
static void cost_bias_update(void *b, const void *l, size_t E, float g) { bytes(KERNEL_OPTIMIZER, 3.0 * E * F); }
static void cost_cross_entropy(void *l, void *acc, const int32_t *t, size_t N, size_t V, float ce, float z, bool g) {
    bytes(KERNEL_ELEMENTWISE, (g ? 2.0 : 1.0) * N * V * A);
}
static void cost_sum_squares(void *acc, const void *x, size_t n) { bytes(KERNEL_OPTIMIZER, (double)n * F); }
// param, m and v read and written, the gradient read (f32), the act copy written where it is one
static void cost_adamw(void *p, void *pa, const void *g, void *m, void *v, size_t n, AdamWArgs a, const StepInfo *s,
                       const void *ns) {
    bytes(KERNEL_OPTIMIZER, (double)n * (7 * F + (pa ? A : 0)));
}
// the same, the codes written in place of the act copy
static void cost_adamw_fp8(void *p, const void *g, void *m, void *v, void *q, void *qs, void *qst, size_t E, size_t N,
                           size_t K, AdamWArgs a, const StepInfo *s, const void *ns, Fp8Scaling h, uint64_t *n) {
    bytes(KERNEL_OPTIMIZER, (double)E * N * K * (7 * F + 1));
}

const Ops *ops_costing(bool bf16_activations, CostSink *s) {
    static Ops o;
    sink = s, A = bf16_activations ? 2 : 4;
    o = *ops_counting(bf16_activations);
    o.name = "cost";
    o.zero = cost_zero, o.copy = cost_copy, o.sync = cost_sync, o.download = cost_download;
    o.embedding_forward = cost_embedding_forward, o.embedding_backward = cost_embedding_backward;
    o.matmul_forward = cost_matmul_forward, o.matmul_backward = cost_matmul_backward;
    o.rmsnorm_forward = cost_rmsnorm_forward, o.rmsnorm_backward = cost_rmsnorm_backward, o.add = cost_add;
    o.add_rmsnorm_forward = cost_add_rmsnorm_forward;
    o.qkv_norm_rope_forward = cost_qkv_norm_rope_forward, o.qkv_norm_rope_backward = cost_qkv_norm_rope_backward;
    o.attention_forward = cost_attention_forward, o.attention_backward = cost_attention_backward;
    o.swiglu_forward = cost_swiglu_forward, o.swiglu_backward = cost_swiglu_backward;
    o.router_forward = cost_router_forward, o.router_aux_loss = cost_router_aux_loss;
    o.router_backward = cost_router_backward;
    o.moe_dispatch_forward = cost_dispatch_forward, o.moe_dispatch_backward = cost_dispatch_backward;
    o.moe_combine_forward = cost_combine_forward, o.moe_combine_backward = cost_combine_backward;
    o.moe_slot_values = cost_slot_values;
    o.moe_row_tokens = cost_row_tokens;
    o.moe_regroup = cost_regroup, o.moe_exchange_plan = cost_exchange_plan, o.moe_push_rows = cost_push_rows;
    o.grouped_matmul_forward = cost_grouped_forward, o.grouped_matmul_backward = cost_grouped_backward;
    o.fp8_quantize_rows = cost_fp8_rows, o.fp8_quantize_cols = cost_fp8_cols, o.fp8_quantize_weights = cost_fp8_weights;
    o.fp8_weights_amax = cost_fp8_weights_amax, o.fp8_quantize_weights_part = cost_fp8_weights_part;
    o.fp8_transpose_codes = cost_fp8_transpose, o.fp8_gather_rows = cost_fp8_gather_rows;
    o.fp8_regroup_scales = cost_fp8_regroup_scales, o.fp8_dequantize_rows = cost_fp8_dequantize;
    o.swiglu_forward_fp8 = cost_swiglu_fp8, o.fp8_quantize_rows_cols = cost_fp8_rows_cols;
    o.rmsnorm_forward_fp8 = cost_rmsnorm_fp8;
    o.swiglu_backward_fp8 = cost_swiglu_backward_fp8;
    o.fp8_grouped_matmul = cost_fp8_grouped, o.fp8_grouped_matmul_wgrad = cost_fp8_wgrad;
    o.fp8_matmul = cost_fp8_matmul;
    o.router_bias_update = cost_bias_update, o.cross_entropy = cost_cross_entropy;
    o.sum_squares = cost_sum_squares, o.adamw_update = cost_adamw, o.adamw_update_fp8 = cost_adamw_fp8;
    return &o;
}

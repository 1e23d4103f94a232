// A backend that runs another one and times every kernel with its events, summing the time per
// phase (attention, expert GEMMs, routing and permutation, dense GEMMs, optimizer, rest): the
// breakdown of `moe bench`. One profiled backend at a time (its state is this file's).
#include "profile_ops.h"

#include <stdlib.h>
#include <string.h>

#include "common/util.h"

#define PROFILE_MAX_CALLS 8192

static const Ops *inner;
static Ops wrapped;
static void **events;     // (2 PROFILE_MAX_CALLS) start and end of each call
static int *phases;       // (PROFILE_MAX_CALLS)
static const char **op_names; // (PROFILE_MAX_CALLS) the op of each call
static int n_calls;

const char *const PROFILE_PHASE_NAMES[PROFILE_N_PHASES] = {
    "attention", "expert GEMMs", "routing and permutation", "dense GEMMs", "optimizer",
    "expert row pushes", "rest"};

static void begin(void) {
    MOE_CHECK(n_calls < PROFILE_MAX_CALLS, "profiler: more than %d kernel calls in one profiled run", PROFILE_MAX_CALLS);
    inner->event_record(events[2 * n_calls]);
}

static void end(ProfilePhase phase, const char *op) {
    inner->event_record(events[2 * n_calls + 1]);
    phases[n_calls] = phase;
    op_names[n_calls++] = op;
}

// One wrapper per op: time the inner call under its phase.
#define WRAP(name, phase, params, args)                                                          \
    static void prof_##name params {                                                             \
        begin();                                                                                 \
        inner->name args;                                                                        \
        end(phase, #name);                                                                       \
    }

WRAP(embedding_forward, PHASE_REST, (void *o, const int32_t *t, const void *w, size_t T, size_t D), (o, t, w, T, D))
WRAP(embedding_backward, PHASE_REST, (void *dw, const void *d, const int32_t *t, size_t T, size_t D, size_t V),
     (dw, d, t, T, D, V))
WRAP(matmul_forward, PHASE_DENSE_GEMM, (void *o, const void *x, const void *w, size_t M, size_t N, size_t K, bool acc),
     (o, x, w, M, N, K, acc))
WRAP(matmul_backward, PHASE_DENSE_GEMM,
     (void *dx, void *dw, const void *d, const void *x, const void *w, size_t M, size_t N, size_t K, bool acc),
     (dx, dw, d, x, w, M, N, K, acc))
WRAP(rmsnorm_forward, PHASE_REST, (void *o, void *r, const void *x, const void *w, size_t R, size_t W, float eps),
     (o, r, x, w, R, W, eps))
WRAP(rmsnorm_backward, PHASE_REST,
     (void *dx, void *dw, const void *d, const void *x, const void *w, const void *r, size_t R, size_t W, bool acc),
     (dx, dw, d, x, w, r, R, W, acc))
WRAP(add, PHASE_REST, (void *o, const void *a, const void *b, size_t n), (o, a, b, n))
WRAP(add_rmsnorm_forward, PHASE_REST,
     (void *s, void *o, void *r, const void *a, const void *b, const void *w, size_t R, size_t W, float eps),
     (s, o, r, a, b, w, R, W, eps))
WRAP(qkv_norm_rope_forward, PHASE_ATTENTION,
     (void *q, void *r, const void *raw, const void *wq, const void *wk, const void *rope, AttnDims d, QkNorm m, float e),
     (q, r, raw, wq, wk, rope, d, m, e))
WRAP(qkv_norm_rope_backward, PHASE_ATTENTION,
     (void *dr, void *dwq, void *dwk, const void *dq, const void *raw, const void *wq, const void *wk, const void *r,
      const void *rope, AttnDims d, QkNorm m),
     (dr, dwq, dwk, dq, raw, wq, wk, r, rope, d, m))
WRAP(attention_forward, PHASE_ATTENTION, (void *o, void *l, const void *q, AttnDims d), (o, l, q, d))
WRAP(attention_backward, PHASE_ATTENTION,
     (void *dq, const void *d, const void *q, const void *o, const void *l, AttnDims a), (dq, d, q, o, l, a))
WRAP(swiglu_forward, PHASE_REST, (void *o, const void *g, size_t R, size_t H, const int32_t *r, size_t n),
     (o, g, R, H, r, n))
WRAP(swiglu_backward, PHASE_REST,
     (void *dg, void *dot, void *hw, const void *d, const void *g, const void *w, size_t R, size_t H, const int32_t *r,
      size_t n),
     (dg, dot, hw, d, g, w, R, H, r, n))
WRAP(router_forward, PHASE_ROUTING,
     (void *s, int32_t *i, void *w, int32_t *c, void *aux, const void *l, const void *b, const StepInfo *st, RouterArgs a),
     (s, i, w, c, aux, l, b, st, a))
WRAP(router_aux_loss, PHASE_ROUTING, (void *s, const void *aux, RouterArgs a, float w), (s, aux, a, w))
WRAP(router_backward, PHASE_ROUTING,
     (void *dl, const void *dw, const void *l, const void *s, const int32_t *i, const void *w, const void *aux, RouterArgs a),
     (dl, dw, l, s, i, w, aux, a))
WRAP(moe_dispatch_forward, PHASE_ROUTING,
     (void *xp, int32_t *p, int32_t *o, void *s, const void *x, const int32_t *i, const int32_t *c, size_t T, size_t K,
      size_t E, size_t D, size_t cap),
     (xp, p, o, s, x, i, c, T, K, E, D, cap))
WRAP(moe_dispatch_backward, PHASE_ROUTING,
     (void *dx, const void *dxp, const int32_t *p, size_t T, size_t K, size_t D, bool acc), (dx, dxp, p, T, K, D, acc))
WRAP(moe_combine_forward, PHASE_ROUTING,
     (void *o, const void *b, const void *y, const int32_t *p, const void *w, size_t T, size_t K, size_t D),
     (o, b, y, p, w, T, K, D))
WRAP(moe_combine_backward, PHASE_ROUTING,
     (void *dy, void *dw, void *rw, const void *d, const void *y, const int32_t *p, const void *w, size_t T, size_t K,
      size_t D),
     (dy, dw, rw, d, y, p, w, T, K, D))
WRAP(moe_slot_values, PHASE_ROUTING, (void *dw, const void *d, const int32_t *p, size_t n), (dw, d, p, n))
WRAP(moe_row_tokens, PHASE_ROUTING, (int32_t *rt, const int32_t *p, size_t T, size_t K), (rt, p, T, K))
WRAP(moe_regroup, PHASE_ROUTING, (void *o, const void *i, const int32_t *c, size_t ep, size_t El, size_t D, bool f),
     (o, i, c, ep, El, D, f))
WRAP(moe_exchange_plan, PHASE_ROUTING,
     (int32_t *p, const int32_t *o, size_t n, size_t El, size_t r, size_t cap, void *d), (p, o, n, El, r, cap, d))
WRAP(moe_push_rows, PHASE_EXCHANGE,
     (void *const *p, size_t off, const void *i, PushBlocks b, size_t D, size_t R, size_t c), (p, off, i, b, D, R, c))
WRAP(grouped_matmul_forward, PHASE_EXPERT_GEMM,
     (void *o, const void *x, const void *w, const int32_t *off, size_t E, size_t N, size_t K, size_t R),
     (o, x, w, off, E, N, K, R))
WRAP(grouped_matmul_backward, PHASE_EXPERT_GEMM,
     (void *dx, void *dw, const void *d, const void *x, const void *w, const int32_t *off, size_t E, size_t N, size_t K,
      size_t R, bool acc),
     (dx, dw, d, x, w, off, E, N, K, R, acc))
// The FP8 ops' phase: an expert GEMM's, or with NULL offsets (one group of all rows) a dense layer's.
static ProfilePhase fp8_phase(const int32_t *off) { return off ? PHASE_EXPERT_GEMM : PHASE_DENSE_GEMM; }

WRAP(fp8_quantize_rows, fp8_phase(off),
     (void *q, void *s, const void *x, const int32_t *off, size_t E, size_t R, size_t K, Fp8Scaling h, uint64_t *n),
     (q, s, x, off, E, R, K, h, n))
// the SwiGLU's phase, forward and backward, which now also quantise its output and gradient (the
// quantisation alone: expert GEMMs)
WRAP(swiglu_forward_fp8, PHASE_REST,
     (void *o, void *q, void *s, const void *g, const int32_t *off, size_t E, size_t R, size_t H, Fp8Scaling h,
      uint64_t *n),
     (o, q, s, g, off, E, R, H, h, n))
// the norm's phase, as rmsnorm_forward's
WRAP(rmsnorm_forward_fp8, PHASE_REST,
     (void *s, void *o, void *r, void *q, void *qs, const void *a, const void *b, const void *w, size_t R, size_t W,
      float eps, Fp8Scaling h, uint64_t *n),
     (s, o, r, q, qs, a, b, w, R, W, eps, h, n))
WRAP(swiglu_backward_fp8, PHASE_REST,
     (void *q, void *s, void *qt, void *st, void *dot, void *hwt, void *hws, const void *d, const void *g,
      const void *w, const int32_t *off, size_t E, size_t R, size_t H, Fp8Scaling h, Fp8ColBlocks hb, uint64_t *ng,
      uint64_t *na),
     (q, s, qt, st, dot, hwt, hws, d, g, w, off, E, R, H, h, hb, ng, na))
WRAP(fp8_quantize_cols, fp8_phase(off),
     (void *q, void *s, const void *x, const int32_t *off, size_t E, size_t R, size_t C, Fp8Scaling h,
      Fp8ColBlocks b, uint64_t *n),
     (q, s, x, off, E, R, C, h, b, n))
WRAP(fp8_quantize_rows_cols, fp8_phase(off),
     (void *q, void *s, void *qt, void *st, const void *x, const int32_t *xr, const int32_t *off, size_t E, size_t R,
      size_t K, Fp8Scaling h, Fp8ColBlocks b, uint64_t *n),
     (q, s, qt, st, x, xr, off, E, R, K, h, b, n))
WRAP(fp8_quantize_weights, PHASE_EXPERT_GEMM,
     (void *q, void *s, void *st, const void *w, size_t E, size_t N, size_t K, Fp8Scaling h, uint64_t *n),
     (q, s, st, w, E, N, K, h, n))
WRAP(fp8_weights_amax, PHASE_EXPERT_GEMM, (void *a, const void *w, size_t E, size_t N, size_t K, size_t lo, size_t hi),
     (a, w, E, N, K, lo, hi))
WRAP(fp8_quantize_weights_part, PHASE_EXPERT_GEMM,
     (void *q, void *s, void *st, const void *a, const void *w, size_t E, size_t N, size_t K, size_t lo, size_t hi,
      Fp8Scaling h, uint64_t *n),
     (q, s, st, a, w, E, N, K, lo, hi, h, n))
WRAP(fp8_transpose_codes, PHASE_EXPERT_GEMM, (void *qt, const void *q, size_t E, size_t N, size_t K),
     (qt, q, E, N, K))
WRAP(fp8_gather_rows, PHASE_EXPERT_GEMM,
     (void *q, void *s, const void *tq, const void *ts, const int32_t *xr, const int32_t *off, size_t E, size_t R,
      size_t K, size_t T),
     (q, s, tq, ts, xr, off, E, R, K, T))
WRAP(fp8_regroup_scales, PHASE_ROUTING,
     (void *o, const void *i, const int32_t *off, size_t E, size_t R, size_t Kb, size_t p, bool t),
     (o, i, off, E, R, Kb, p, t))
WRAP(fp8_dequantize_rows, PHASE_EXPERT_GEMM,
     (void *x, const void *q, const void *s, const int32_t *off, size_t E, size_t R, size_t K), (x, q, s, off, E, R, K))
WRAP(fp8_grouped_matmul, PHASE_EXPERT_GEMM,
     (void *o, const void *a, const void *as, const void *b, const void *bs, const int32_t *off, size_t E, size_t N,
      size_t K, size_t R),
     (o, a, as, b, bs, off, E, N, K, R))
WRAP(fp8_grouped_matmul_wgrad, fp8_phase(off),
     (void *dw, const void *d, const void *ds, const void *x, const void *xs, Fp8ColBlocks xb, const int32_t *off,
      size_t E, size_t N, size_t K, size_t R, bool acc),
     (dw, d, ds, x, xs, xb, off, E, N, K, R, acc))
WRAP(fp8_matmul, PHASE_DENSE_GEMM,
     (void *o, const void *a, const void *as, const void *b, const void *bs, size_t M, size_t N, size_t K),
     (o, a, as, b, bs, M, N, K))
WRAP(router_bias_update, PHASE_OPTIMIZER, (void *b, const void *l, size_t E, float g), (b, l, E, g))
WRAP(cross_entropy, PHASE_REST,
     (void *l, void *acc, const int32_t *t, size_t N, size_t V, float ce, float z, bool g), (l, acc, t, N, V, ce, z, g))
WRAP(sum_squares, PHASE_OPTIMIZER, (void *acc, const void *x, size_t n), (acc, x, n))
WRAP(adamw_update, PHASE_OPTIMIZER,
     (void *p, void *pa, const void *g, void *m, void *v, size_t n, AdamWArgs a, const StepInfo *s, const void *ns),
     (p, pa, g, m, v, n, a, s, ns))
WRAP(adamw_update_fp8, PHASE_OPTIMIZER,
     (void *p, const void *g, void *m, void *v, void *q, void *qs, void *qst, size_t E, size_t N, size_t K,
      AdamWArgs a, const StepInfo *s, const void *ns, Fp8Scaling h, uint64_t *n),
     (p, g, m, v, q, qs, qst, E, N, K, a, s, ns, h, n))

const Ops *ops_profiled(const Ops *backend) {
    inner = backend;
    wrapped = *backend;
    wrapped.name = "profiled";
    wrapped.capture_begin = NULL; // timed calls run as they are queued
#define SET(name) wrapped.name = prof_##name
    SET(embedding_forward), SET(embedding_backward), SET(matmul_forward), SET(matmul_backward);
    SET(rmsnorm_forward), SET(rmsnorm_backward), SET(add), SET(add_rmsnorm_forward), SET(qkv_norm_rope_forward);
    SET(qkv_norm_rope_backward);
    SET(attention_forward), SET(attention_backward), SET(swiglu_forward), SET(swiglu_backward);
    SET(router_forward), SET(router_aux_loss), SET(router_backward), SET(moe_dispatch_forward);
    SET(moe_dispatch_backward), SET(moe_combine_forward), SET(moe_combine_backward), SET(moe_regroup);
    SET(moe_slot_values), SET(moe_row_tokens);
    SET(moe_exchange_plan), SET(moe_push_rows);
    SET(grouped_matmul_forward), SET(grouped_matmul_backward), SET(router_bias_update), SET(cross_entropy);
    SET(fp8_quantize_rows), SET(swiglu_forward_fp8), SET(swiglu_backward_fp8), SET(fp8_quantize_cols);
    SET(fp8_quantize_weights), SET(fp8_weights_amax), SET(fp8_quantize_weights_part), SET(rmsnorm_forward_fp8);
    SET(fp8_transpose_codes), SET(fp8_gather_rows), SET(fp8_regroup_scales), SET(fp8_dequantize_rows);
    SET(fp8_quantize_rows_cols), SET(fp8_grouped_matmul), SET(fp8_grouped_matmul_wgrad), SET(fp8_matmul);
    SET(sum_squares), SET(adamw_update), SET(adamw_update_fp8);
#undef SET
    if (!events) {
        events = moe_malloc(2 * PROFILE_MAX_CALLS * sizeof(void *));
        phases = moe_malloc(PROFILE_MAX_CALLS * sizeof(int));
        op_names = moe_malloc(PROFILE_MAX_CALLS * sizeof(char *));
        for (int i = 0; i < 2 * PROFILE_MAX_CALLS; i++) events[i] = backend->event_create();
    }
    n_calls = 0;
    return &wrapped;
}

void profile_reset(void) { n_calls = 0; }

static int by_ms_descending(const void *a, const void *b) {
    double x = ((const ProfileOpTime *)a)->ms, y = ((const ProfileOpTime *)b)->ms;
    return (x < y) - (x > y);
}

int profile_collect(double ms[PROFILE_N_PHASES], ProfileOpTime ops[PROFILE_MAX_OPS]) {
    int n_ops = 0;
    for (int p = 0; p < PROFILE_N_PHASES; p++) ms[p] = 0;
    for (int i = 0; i < n_calls; i++) {
        double t = inner->event_elapsed_ms(events[2 * i], events[2 * i + 1]);
        ms[phases[i]] += t;
        int k = 0;
        while (k < n_ops && (ops[k].name != op_names[i] || ops[k].phase != phases[i])) k++; // names: WRAP literals
        if (k == n_ops) {
            MOE_CHECK(n_ops < PROFILE_MAX_OPS, "profiler: more than %d distinct ops", PROFILE_MAX_OPS);
            ops[n_ops++] = (ProfileOpTime){op_names[i], phases[i], 0, 0};
        }
        ops[k].ms += t;
        ops[k].calls++;
    }
    qsort(ops, (size_t)n_ops, sizeof *ops, by_ms_descending);
    return n_ops;
}

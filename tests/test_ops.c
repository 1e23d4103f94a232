// Op-level tests of the CPU backend in double precision: each op's backward against central finite
// differences of sum(out * R) for a random R, and the exact semantics that the model relies on
// (accumulate flags, row counts, capacity order, ties, ignored targets, untouched rows).
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/real.h"
#include "common/util.h"
#include "ops/device_monitor.h"
#include "ops/ops.h"
#include "test.h"

// The backend under test; a GPU backend will run these same checks against this one.
#define ops (ops_cpu())

static real *rnd(size_t n, uint64_t seed, double scale) {
    real *x = malloc((n ? n : 1) * sizeof(real));
    for (size_t i = 0; i < n; i++) x[i] = scale * rng_normal(seed, i);
    return x;
}

static real *poisoned(size_t n) {
    real *x = malloc((n ? n : 1) * sizeof(real));
    for (size_t i = 0; i < n; i++) x[i] = NAN;
    return x;
}

static double dot(const real *a, const real *b, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; i++) s += (double)a[i] * b[i];
    return s;
}

// Central differences of the scalar f(ctx) with respect to every element of x; compared with g.
typedef double (*ScalarFn)(void *ctx);
static void fd_check(const char *what, ScalarFn f, void *ctx, real *x, size_t n, const real *g) {
    double *num = malloc(n * sizeof(double)), *ana = malloc(n * sizeof(double));
    for (size_t i = 0; i < n; i++) {
        real saved = x[i];
        x[i] = saved + 1e-6;
        double up = f(ctx);
        x[i] = saved - 1e-6;
        double down = f(ctx);
        x[i] = saved;
        num[i] = (up - down) / 2e-6;
        ana[i] = g[i];
    }
    test_check_arrays(what, ana, num, n, 1e-6, 1e-9);
    free(num);
    free(ana);
}

// ---------------------------------------------------------------- attention

typedef struct {
    AttnDims d;
    QkNorm mode;
    real *qkv, *out, *lse, *R, *raw, *wq, *wk, *rstd, *rope;
} AttnCtx;

static size_t attn_C(AttnDims d) { return (d.Hq + 2 * d.Hkv) * d.hd; }

static double attn_loss(void *p) {
    AttnCtx *c = p;
    ops->attention_forward(c->out, c->lse, c->qkv, c->d);
    return dot(c->out, c->R, c->d.B * c->d.S * c->d.Hq * c->d.hd);
}

static void check_attention(AttnDims d) {
    size_t T = d.B * d.S, C = attn_C(d), n_out = T * d.Hq * d.hd;
    AttnCtx c = {.d = d, .qkv = rnd(T * C, 1, 1), .out = poisoned(n_out), .lse = poisoned(d.B * d.Hq * d.S),
                 .R = rnd(n_out, 2, 1)};
    real *dqkv = poisoned(T * C);
    attn_loss(&c);
    ops->attention_backward(dqkv, c.R, c.qkv, c.out, c.lse, d);
    char what[96];
    snprintf(what, sizeof what, "attention B%zu S%zu Hq%zu Hkv%zu hd%zu", d.B, d.S, d.Hq, d.Hkv, d.hd);
    fd_check(what, attn_loss, &c, c.qkv, T * C, dqkv);
    // causality: the first position attends only to itself, so its output is its own v
    attn_loss(&c);
    for (size_t j = 0; j < d.hd; j++)
        CHECK_CLOSE(c.out[j], c.qkv[(d.Hq + d.Hkv) * d.hd + j], 1e-12, 1e-12);
    free(c.qkv), free(c.out), free(c.lse), free(c.R), free(dqkv);
}

static void test_attention_fd(void) {
    check_attention((AttnDims){1, 1, 1, 1, 2});
    check_attention((AttnDims){2, 5, 2, 1, 4});
    check_attention((AttnDims){1, 7, 4, 2, 2});
    check_attention((AttnDims){2, 3, 3, 3, 6});
}

static double qkv_loss(void *p) {
    AttnCtx *c = p;
    size_t T = c->d.B * c->d.S;
    ops->qkv_norm_rope_forward(c->qkv, c->rstd, c->raw, c->wq, c->wk, c->rope, c->d, c->mode, 1e-5f);
    return dot(c->qkv, c->R, T * attn_C(c->d));
}

static real *rope_table(size_t S, size_t hd) {
    real *t = malloc(S * hd * sizeof(real));
    for (size_t s = 0; s < S; s++)
        for (size_t i = 0; i < hd / 2; i++) {
            double a = (double)s * pow(10000.0, -2.0 * i / hd);
            t[s * hd + 2 * i] = cos(a), t[s * hd + 2 * i + 1] = sin(a);
        }
    return t;
}

static void check_qkv_norm_rope(AttnDims d, QkNorm mode) {
    size_t T = d.B * d.S, C = attn_C(d);
    size_t wqn = mode == QK_NORM_HEAD ? d.hd : d.Hq * d.hd, wkn = mode == QK_NORM_HEAD ? d.hd : d.Hkv * d.hd;
    AttnCtx c = {.d = d, .mode = mode, .raw = rnd(T * C, 3, 1), .qkv = poisoned(T * C), .R = rnd(T * C, 4, 1),
                 .wq = rnd(wqn, 5, 1), .wk = rnd(wkn, 6, 1), .rstd = poisoned(T * (d.Hq + d.Hkv)),
                 .rope = rope_table(d.S, d.hd)};
    real *draw = poisoned(T * C), *dwq = calloc(wqn, sizeof(real)), *dwk = calloc(wkn, sizeof(real));
    qkv_loss(&c);
    ops->qkv_norm_rope_backward(draw, dwq, dwk, c.R, c.raw, c.wq, c.wk, c.rstd, c.rope, d, mode);
    static const char *names[] = {"none", "full", "head"};
    char what[96];
    snprintf(what, sizeof what, "qkv_norm_rope %s: d raw", names[mode]);
    fd_check(what, qkv_loss, &c, c.raw, T * C, draw);
    if (mode != QK_NORM_NONE) {
        snprintf(what, sizeof what, "qkv_norm_rope %s: d wq", names[mode]);
        fd_check(what, qkv_loss, &c, c.wq, wqn, dwq);
        snprintf(what, sizeof what, "qkv_norm_rope %s: d wk", names[mode]);
        fd_check(what, qkv_loss, &c, c.wk, wkn, dwk);
    }
    // in place (the model's call): the same gradients, bit for bit, v's left where it was
    real *in_place = malloc(T * C * sizeof(real)), *dwq2 = calloc(wqn, sizeof(real)), *dwk2 = calloc(wkn, sizeof(real));
    memcpy(in_place, c.R, T * C * sizeof(real));
    memset(dwq, 0, wqn * sizeof(real)), memset(dwk, 0, wkn * sizeof(real));
    ops->qkv_norm_rope_backward(draw, dwq, dwk, c.R, c.raw, c.wq, c.wk, c.rstd, c.rope, d, mode);
    ops->qkv_norm_rope_backward(in_place, dwq2, dwk2, in_place, c.raw, c.wq, c.wk, c.rstd, c.rope, d, mode);
    CHECK_MSG(!memcmp(in_place, draw, T * C * sizeof(real)) && !memcmp(dwq, dwq2, wqn * sizeof(real)) &&
                  !memcmp(dwk, dwk2, wkn * sizeof(real)),
              "qkv_norm_rope %s: the backward in place differs from the one into another buffer", names[mode]);
    free(c.raw), free(c.qkv), free(c.R), free(c.wq), free(c.wk), free(c.rstd), free(c.rope);
    free(draw), free(dwq), free(dwk), free(in_place), free(dwq2), free(dwk2);
}

static void test_qkv_norm_rope_fd(void) {
    for (int mode = 0; mode < 3; mode++) {
        check_qkv_norm_rope((AttnDims){2, 3, 2, 1, 4}, (QkNorm)mode);
        check_qkv_norm_rope((AttnDims){1, 5, 3, 3, 2}, (QkNorm)mode);
    }
}

// ---------------------------------------------------------------- dense ops

typedef struct {
    size_t R, W;
    real *x, *w, *out, *rstd, *Rw;
} NormCtx;

static double norm_loss(void *p) {
    NormCtx *c = p;
    ops->rmsnorm_forward(c->out, c->rstd, c->x, c->w, c->R, c->W, 1e-5f);
    return dot(c->out, c->Rw, c->R * c->W);
}

static void test_rmsnorm_fd_and_accumulate(void) {
    NormCtx c = {.R = 5, .W = 7, .x = rnd(35, 7, 1), .w = rnd(7, 8, 1), .out = poisoned(35),
                 .rstd = poisoned(5), .Rw = rnd(35, 9, 1)};
    real *dx = poisoned(35), *dw = calloc(7, sizeof(real));
    norm_loss(&c);
    ops->rmsnorm_backward(dx, dw, c.Rw, c.x, c.w, c.rstd, 5, 7, false);
    fd_check("rmsnorm d x", norm_loss, &c, c.x, 35, dx);
    fd_check("rmsnorm d w", norm_loss, &c, c.w, 7, dw);
    real *acc = rnd(35, 10, 1), *dw2 = calloc(7, sizeof(real));
    real *expected = malloc(35 * sizeof(real));
    for (size_t i = 0; i < 35; i++) expected[i] = acc[i] + dx[i];
    ops->rmsnorm_backward(acc, dw2, c.Rw, c.x, c.w, c.rstd, 5, 7, true);
    for (size_t i = 0; i < 35; i++) CHECK_CLOSE(acc[i], expected[i], 1e-12, 1e-14);
    free(c.x), free(c.w), free(c.out), free(c.rstd), free(c.Rw), free(dx), free(dw), free(acc);
    free(dw2), free(expected);
}

typedef struct {
    size_t R, H;
    real *gu, *out, *Rw;
    int32_t *rows; // offsets of the rows used (2 expert groups), or NULL
} SwiCtx;

static double swiglu_loss(void *p) {
    SwiCtx *c = p;
    ops->swiglu_forward(c->out, c->gu, c->R, c->H, c->rows, 2);
    size_t first = c->rows ? (size_t)c->rows[0] : 0, end = c->rows ? (size_t)c->rows[2] : c->R;
    return dot(c->out + first * c->H, c->Rw + first * c->H, (end - first) * c->H);
}

// Rows [1, 4) of 5 used (the rows of two experts): finite differences there, the rest untouched.
static void test_swiglu_fd_and_row_range(void) {
    int32_t rows[3] = {1, 2, 4};
    SwiCtx c = {.R = 5, .H = 4, .gu = rnd(40, 11, 2), .out = poisoned(20), .Rw = rnd(20, 12, 1), .rows = rows};
    real *dgu = poisoned(40);
    swiglu_loss(&c);
    ops->swiglu_backward(dgu, NULL, NULL, c.Rw, c.gu, NULL, 5, 4, rows, 2);
    fd_check("swiglu d gu (used rows)", swiglu_loss, &c, c.gu + 8, 3 * 8, dgu + 8);
    bool untouched = true;
    for (size_t i = 0; i < 20; i++) untouched &= isnan(c.out[i]) == (i < 4 || i >= 16);
    for (size_t i = 0; i < 40; i++) untouched &= isnan(dgu[i]) == (i < 8 || i >= 32);
    CHECK_MSG(untouched, "rows outside [rows[0], rows[n]) were written, or used ones were not");
    free(c.gu), free(c.out), free(c.Rw), free(dgu);
}

static void test_matmul_backward_accumulates(void) {
    size_t M = 5, N = 3, K = 4;
    real *x = rnd(M * K, 13, 1), *w = rnd(N * K, 14, 1), *dout = rnd(M * N, 15, 1);
    real *dx = rnd(M * K, 16, 1), *dx0 = malloc(M * K * sizeof(real)), *dw = rnd(N * K, 17, 1);
    real *dw0 = malloc(N * K * sizeof(real));
    memcpy(dx0, dx, M * K * sizeof(real)), memcpy(dw0, dw, N * K * sizeof(real));
    ops->matmul_backward(dx, dw, dout, x, w, M, N, K, true);
    for (size_t m = 0; m < M; m++)
        for (size_t k = 0; k < K; k++) {
            double e = dx0[m * K + k];
            for (size_t n = 0; n < N; n++) e += dout[m * N + n] * w[n * K + k];
            CHECK_CLOSE(dx[m * K + k], e, 1e-12, 1e-12);
        }
    for (size_t n = 0; n < N; n++)
        for (size_t k = 0; k < K; k++) {
            double e = dw0[n * K + k];
            for (size_t m = 0; m < M; m++) e += dout[m * N + n] * x[m * K + k];
            CHECK_CLOSE(dw[n * K + k], e, 1e-12, 1e-12);
        }
    free(x), free(w), free(dout), free(dx), free(dx0), free(dw), free(dw0);
}

static void test_embedding_backward_accumulates_repeats(void) {
    int32_t tokens[5] = {2, 0, 2, 2, 1};
    real *dout = rnd(5 * 3, 18, 1), *dwte = rnd(4 * 3, 19, 1), *before = malloc(12 * sizeof(real));
    memcpy(before, dwte, 12 * sizeof(real));
    ops->embedding_backward(dwte, dout, tokens, 5, 3, 4);
    for (size_t j = 0; j < 3; j++) {
        CHECK_CLOSE(dwte[2 * 3 + j], before[2 * 3 + j] + dout[0 * 3 + j] + dout[2 * 3 + j] + dout[3 * 3 + j], 1e-12, 1e-12);
        CHECK_CLOSE(dwte[3 * 3 + j], before[3 * 3 + j], 0, 0); // unused row unchanged
    }
    free(dout), free(dwte), free(before);
}

typedef struct {
    size_t N, V;
    real *logits, *work, acc[2];
    int32_t *targets;
    float zs;
} CeCtx;

static double ce_loss(void *p) {
    CeCtx *c = p;
    memcpy(c->work, c->logits, c->N * c->V * sizeof(real));
    c->acc[0] = c->acc[1] = 0;
    ops->cross_entropy(c->work, c->acc, c->targets, c->N, c->V, 1, c->zs, false);
    return c->acc[0] + c->zs * c->acc[1];
}

static void test_cross_entropy_fd_and_ignore(void) {
    int32_t targets[4] = {3, -1, 0, 6};
    CeCtx c = {.N = 4, .V = 7, .logits = rnd(28, 20, 2), .work = poisoned(28), .targets = targets, .zs = 0.1f};
    real *grad = malloc(28 * sizeof(real));
    memcpy(grad, c.logits, sizeof(real) * 28);
    real acc[2] = {0, 0};
    ops->cross_entropy(grad, acc, targets, 4, 7, 1, c.zs, true);
    fd_check("cross-entropy + z d logits", ce_loss, &c, c.logits, 28, grad);
    for (size_t v = 0; v < 7; v++) CHECK_MSG(grad[7 + v] == 0, "ignored row has gradient %g", (double)grad[7 + v]);
    double lse = 0;
    for (size_t v = 0; v < 7; v++) lse += exp(c.logits[v]);
    lse = log(lse);
    CHECK_CLOSE(acc[0], ce_loss(&c) - c.zs * c.acc[1], 1e-12, 1e-12);
    CHECK_MSG(acc[1] >= lse * lse, "z sum %g below the first row's lse^2 %g", (double)acc[1], lse * lse);
    free(c.logits), free(c.work), free(grad);
}

// ---------------------------------------------------------------- mixture of experts

typedef struct {
    RouterArgs a;
    real *logits, *scores, *w, *stats, *aux, *Rw, *bias;
    int32_t *idx, *counts;
    StepInfo step;
} RouterCtx;

static double router_loss(void *p) {
    RouterCtx *c = p;
    size_t E = c->a.E;
    memset(c->stats, 0, router_stats_len(E) * sizeof(real));
    ops->router_forward(c->scores, c->idx, c->w, c->counts, c->aux, c->logits, c->bias, &c->step, c->a);
    ops->router_aux_loss(c->stats, c->aux, c->a, 1);
    return dot(c->w, c->Rw, c->a.T * c->a.K) + c->a.lb_grad * c->stats[router_stat_lb(E)] +
           c->a.z_grad * c->stats[router_stat_z(E)];
}

static void check_router(RouterKind kind, bool renorm, bool random, bool bias) {
    size_t T = 9, E = 5, K = 2;
    RouterCtx c = {.a = {.T = T, .T_global = T, .E = E, .K = K, .kind = kind, .renorm = renorm,
                         .random = random, .layer = 3, .lb_grad = 0.7f, .z_grad = 0.2f},
                   .logits = rnd(T * E, 21, 1.5), .scores = poisoned(T * E), .w = poisoned(T * K),
                   .stats = calloc(router_stats_len(E), sizeof(real)), .aux = poisoned(router_aux_len(E)),
                   .Rw = rnd(T * K, 22, 1), .bias = bias ? rnd(E, 23, 0.3) : NULL,
                   .idx = malloc(T * K * sizeof(int32_t)), .counts = malloc(E * sizeof(int32_t)),
                   .step = {.seed = 99}};
    router_loss(&c);
    real *dlogits = poisoned(T * E);
    ops->router_backward(dlogits, c.Rw, c.logits, c.scores, c.idx, c.w, c.aux, c.a);
    char what[96];
    snprintf(what, sizeof what, "router %s%s%s%s", kind == ROUTER_SOFTMAX ? "softmax" : "sigmoid",
             renorm ? " renorm" : "", random ? " random" : "", bias ? " bias" : "");
    fd_check(what, router_loss, &c, c.logits, T * E, dlogits);
    router_loss(&c);
    // LB against its definition: (E / K) sum_e (c_e / T) * mean_t score
    double lb = 0;
    for (size_t e = 0; e < E; e++) {
        double P = 0;
        for (size_t t = 0; t < T; t++) P += c.scores[t * E + e] / T;
        lb += (double)c.counts[e] / T * P;
    }
    CHECK_CLOSE(c.stats[router_stat_lb(E)], lb * E / K, 1e-12, 1e-12);
    int total = 0;
    for (size_t e = 0; e < E; e++) total += c.counts[e];
    CHECK_MSG(total == (int)(T * K), "counts sum to %d, expected %zu", total, T * K);
    if (renorm)
        for (size_t t = 0; t < T; t++) CHECK_CLOSE(c.w[t * K] + c.w[t * K + 1], 1, 1e-12, 1e-12);
    free(c.logits), free(c.scores), free(c.w), free(c.stats), free(c.aux), free(c.Rw), free(c.bias);
    free(c.idx), free(c.counts), free(dlogits);
}

static void test_router_fd(void) {
    check_router(ROUTER_SOFTMAX, false, false, false);
    check_router(ROUTER_SOFTMAX, true, false, true);
    check_router(ROUTER_SIGMOID, false, false, false);
    check_router(ROUTER_SIGMOID, true, false, true);
    check_router(ROUTER_SOFTMAX, false, true, false);
    check_router(ROUTER_SIGMOID, true, true, false);
}

// Two halves of a batch, their aux summaries summed, give the whole batch's losses and gradients:
// what data-parallel ranks rely on.
static void test_router_split_batch(void) {
    size_t T = 8, E = 4, K = 2;
    real *logits = rnd(T * E, 40, 1), *scores = poisoned(T * E), *w = poisoned(T * K), *Rw = rnd(T * K, 41, 1);
    real aux[9], half_aux[9], stats[7] = {0}, split_stats[7] = {0};
    int32_t idx[16], counts[4];
    StepInfo step = {.seed = 1};
    RouterArgs whole = {.T = T, .T_global = T, .E = E, .K = K, .kind = ROUTER_SOFTMAX, .lb_grad = 0.5f, .z_grad = 0.3f};
    ops->router_forward(scores, idx, w, counts, aux, logits, NULL, &step, whole);
    ops->router_aux_loss(stats, aux, whole, 1);
    real *dl_whole = poisoned(T * E), *dl_split = poisoned(T * E);
    ops->router_backward(dl_whole, Rw, logits, scores, idx, w, aux, whole);
    RouterArgs half = whole;
    half.T = T / 2;
    real sum[9] = {0};
    for (int h = 0; h < 2; h++) {
        half.token_base = h * T / 2;
        ops->router_forward(scores + h * (T / 2) * E, idx + h * (T / 2) * K, w + h * (T / 2) * K, counts,
                            half_aux, logits + h * (T / 2) * E, NULL, &step, half);
        for (int i = 0; i < 9; i++) sum[i] += half_aux[i];
    }
    ops->router_aux_loss(split_stats, sum, half, 1);
    for (int h = 0; h < 2; h++)
        ops->router_backward(dl_split + h * (T / 2) * E, Rw + h * (T / 2) * K, logits + h * (T / 2) * E,
                             scores + h * (T / 2) * E, idx + h * (T / 2) * K, w + h * (T / 2) * K, sum, half);
    for (int i = 0; i < 7; i++) CHECK_CLOSE(split_stats[i], stats[i], 1e-12, 1e-12);
    double a[32], b[32];
    for (size_t i = 0; i < T * E; i++) a[i] = dl_split[i], b[i] = dl_whole[i];
    test_check_arrays("router gradient from two halves", a, b, T * E, 1e-12, 1e-14);
    free(logits), free(scores), free(w), free(Rw), free(dl_whole), free(dl_split);
}

static void test_router_ties_bias_and_noise(void) {
    size_t T = 2, E = 4, K = 2;
    real logits[8] = {0, 0, 0, 0, 1, 1, 1, 1}, scores[8], w[4], stats[7] = {0}, aux[9], bias[4] = {0, 0, 0.5, 0.5};
    int32_t idx[4], counts[4];
    StepInfo step = {.seed = 5};
    RouterArgs a = {.T = T, .T_global = T, .E = E, .K = K, .kind = ROUTER_SOFTMAX};
    ops->router_forward(scores, idx, w, counts, aux, logits, NULL, &step, a);
    ops->router_aux_loss(stats, aux, a, 1);
    CHECK_MSG(idx[0] == 0 && idx[1] == 1, "ties must choose the lowest indices, got %d %d", idx[0], idx[1]);
    CHECK_CLOSE(stats[router_stat_lb(E)], 1.0, 1e-12, 0); // uniform scores: LB = 1 whatever the counts
    ops->router_forward(scores, idx, w, counts, aux, logits, bias, &step, a);
    CHECK_MSG(idx[0] == 2 && idx[1] == 3, "bias must steer the choice, got %d %d", idx[0], idx[1]);
    CHECK_CLOSE(w[0], 0.25, 1e-12, 0); // weights stay the unbiased scores
    a.random = true;
    int32_t idx2[4];
    ops->router_forward(scores, idx, w, counts, aux, logits, NULL, &step, a);
    ops->router_forward(scores, idx2, w, counts, aux, logits, NULL, &step, a);
    CHECK_MSG(!memcmp(idx, idx2, sizeof idx), "random routing must repeat for the same seed and layer");
    bool differs = false;
    for (uint64_t s = 1; s < 20 && !differs; s++) {
        StepInfo other = {.seed = s * 7919};
        ops->router_forward(scores, idx2, w, counts, aux, logits, NULL, &other, a);
        differs = memcmp(idx, idx2, sizeof idx) != 0;
    }
    CHECK_MSG(differs, "random routing never changed with the seed");
}

// Sources 0, 1, 2 send rows for local experts 0 and 1: source 0 two rows for expert 0 and one for
// expert 1, source 1 one for expert 0, source 2 two for expert 1. Expert-major order is then
// rows 0, 1, 3 (expert 0) and 2, 4, 5 (expert 1).
static void test_regroup_round_trip(void) {
    size_t ep = 3, El = 2, D = 2, rows = 6, order[6] = {0, 1, 3, 2, 4, 5};
    int32_t counts[6] = {2, 1, 1, 0, 0, 2}; // (source, expert)
    real *in = rnd(rows * D, 50, 1), *mid = poisoned(rows * D), *back = poisoned(rows * D);
    ops->moe_regroup(mid, in, counts, ep, El, D, true);
    double a[12], b[12];
    for (size_t i = 0; i < rows * D; i++) a[i] = mid[i], b[i] = in[order[i / D] * D + i % D];
    test_check_arrays("regroup to expert-major", a, b, rows * D, 0, 0);
    ops->moe_regroup(back, mid, counts, ep, El, D, false);
    for (size_t i = 0; i < rows * D; i++) a[i] = back[i], b[i] = in[i];
    test_check_arrays("regroup there and back", a, b, rows * D, 0, 0);
    free(in), free(mid), free(back);
}

// Expert 1 gets no tokens; capacity 2 drops the third slot of expert 0 (token order kept). The
// rows' tokens (moe_row_tokens) name the rows the dispatch gathers; without xp it gathers nothing
// and sorts the same, and the combine's backward without dy writes only the rows' weights.
static void test_dispatch_combine_capacity(void) {
    size_t T = 4, K = 2, E = 3, D = 3;
    int32_t idx[8] = {0, 2, 0, 2, 2, 0, 0, 2}, counts[3] = {4, 0, 4}, slot[8], offsets[4];
    real *x = rnd(T * D, 24, 1), *xp = poisoned(6 * D), stats[6] = {0};
    ops->moe_dispatch_forward(xp, slot, offsets, stats, x, idx, counts, T, K, E, D, 2);
    int32_t want_off[4] = {0, 2, 2, 4}, want_slot[8] = {0, 2, 1, 3, -1, -1, -1, -1};
    CHECK_MSG(!memcmp(offsets, want_off, sizeof want_off), "offsets %d %d %d %d", offsets[0], offsets[1], offsets[2], offsets[3]);
    CHECK_MSG(!memcmp(slot, want_slot, sizeof want_slot), "slot positions differ (first: %d %d %d %d)", slot[0], slot[1], slot[2], slot[3]);
    CHECK_CLOSE(stats[router_stat_dropped(E)], 4, 0, 0);
    for (size_t j = 0; j < D; j++) CHECK_CLOSE(xp[1 * D + j], x[1 * D + j], 0, 0); // row 1 = token 1
    int32_t tokens[4], want_tokens[4] = {0, 1, 0, 1}, slot2[8], offsets2[4];
    ops->moe_row_tokens(tokens, slot, T, K);
    CHECK_MSG(!memcmp(tokens, want_tokens, sizeof tokens), "row tokens %d %d %d %d", tokens[0], tokens[1], tokens[2],
              tokens[3]);
    ops->moe_dispatch_forward(NULL, slot2, offsets2, stats, x, idx, counts, T, K, E, D, 2);
    CHECK_MSG(!memcmp(slot2, slot, sizeof slot) && !memcmp(offsets2, offsets, sizeof offsets),
              "the dispatch without rows sorts otherwise");
    // combine: dropped slots contribute nothing and get zero weight gradient
    real w[8] = {.5, .5, .3, .7, .2, .8, .6, .4}, *y = rnd(4 * D, 25, 1), *out = poisoned(T * D);
    ops->moe_combine_forward(out, NULL, y, slot, w, T, K, D);
    for (size_t j = 0; j < D; j++) {
        CHECK_CLOSE(out[0 * D + j], .5 * y[0 * D + j] + .5 * y[2 * D + j], 1e-12, 1e-12);
        CHECK_CLOSE(out[3 * D + j], 0, 0, 0);
    }
    real *res = poisoned(T * D); // with a base (the residual): base + the sum, a dropped token's row the base
    ops->moe_combine_forward(res, x, y, slot, w, T, K, D);
    for (size_t i = 0; i < T * D; i++) CHECK_CLOSE(res[i], x[i] + out[i], 1e-12, 1e-12);
    free(res);
    real *dout = rnd(T * D, 26, 1), *dy = poisoned(4 * D), dw[8], row_w[4];
    ops->moe_combine_backward(NULL, NULL, row_w, dout, NULL, slot, w, T, K, D);
    for (size_t i = 0; i < T * K; i++)
        if (slot[i] >= 0) CHECK_CLOSE(row_w[slot[i]], w[i], 0, 0);
    ops->moe_combine_backward(dy, dw, NULL, dout, y, slot, w, T, K, D);
    CHECK_CLOSE(dw[4], 0, 0, 0);
    CHECK_CLOSE(dw[0], dot(dout, y, D), 1e-12, 1e-12);
    real *dx = rnd(T * D, 27, 1), *dx0 = malloc(T * D * sizeof(real));
    memcpy(dx0, dx, T * D * sizeof(real));
    ops->moe_dispatch_backward(dx, dy, slot, T, K, D, true);
    for (size_t j = 0; j < D; j++) {
        CHECK_CLOSE(dx[j], dx0[j] + dy[0 * D + j] + dy[2 * D + j], 1e-12, 1e-12);
        CHECK_CLOSE(dx[3 * D + j], dx0[3 * D + j], 0, 0);
    }
    free(x), free(xp), free(y), free(out), free(dout), free(dy), free(dx), free(dx0);
}

// One MoE call's backward from the expert rows (one expert-parallel rank: the outputs y are not
// kept) against the one from y: the combine weights' gradients dout . y = (dout W) . h, the down
// projection's weight gradient from unweighted rows and weighted h, the gate|up gradient from the
// weighted SwiGLU backward, written over the gate|up rows as the model does. Capacity 3 drops a slot
// of expert 2 (rows past offsets[E] unused).
static void test_combine_weight_backward(void) {
    size_t T = 5, K = 2, E = 3, D = 4, H = 3, R = T * K;
    int32_t idx[10] = {0, 2, 1, 2, 2, 0, 0, 1, 2, 1}, counts[3] = {3, 3, 4}, slot[10], off[4];
    real *x = rnd(T * D, 40, 1), *xp = poisoned(R * D), stats[6] = {0};
    ops->moe_dispatch_forward(xp, slot, off, stats, x, idx, counts, T, K, E, D, 3);
    real *gu = rnd(R * 2 * H, 41, 1), *h = poisoned(R * H), *wd = rnd(E * D * H, 42, 1), *y = poisoned(R * D);
    ops->swiglu_forward(h, gu, R, H, off, E);
    ops->grouped_matmul_forward(y, h, wd, off, E, D, H, R);
    real w[10] = {.5, .5, .3, .7, .2, .8, .6, .4, .9, .1}, *dout = rnd(T * D, 43, 1);
    real *dy = poisoned(R * D), dw_ref[10], *dwd_ref = calloc(E * D * H, sizeof(real));
    real *dh = poisoned(R * H), *dgu_ref = poisoned(R * 2 * H);
    ops->moe_combine_backward(dy, dw_ref, NULL, dout, y, slot, w, T, K, D);
    ops->grouped_matmul_backward(dh, dwd_ref, dy, h, wd, off, E, D, H, R, true);
    ops->swiglu_backward(dgu_ref, NULL, NULL, dh, gu, NULL, R, H, off, E);
    real row_w[10], row_dot[10], dw[10], *hw = poisoned(R * H), *dwd = calloc(E * D * H, sizeof(real));
    real *dgu = malloc(R * 2 * H * sizeof(real));
    memcpy(dgu, gu, R * 2 * H * sizeof(real));
    ops->moe_combine_backward(dy, NULL, row_w, dout, NULL, slot, w, T, K, D);
    ops->grouped_matmul_backward(dh, NULL, dy, NULL, wd, off, E, D, H, R, false);
    ops->swiglu_backward(dgu, row_dot, hw, dh, dgu, row_w, R, H, off, E);
    ops->grouped_matmul_backward(NULL, dwd, dy, hw, wd, off, E, D, H, R, true);
    ops->moe_slot_values(dw, row_dot, slot, T * K);
    CHECK_MSG(slot[8] == -1, "slot 8 (the fourth of expert 2) kept at row %d", slot[8]);
    CHECK_CLOSE(dw_ref[8], 0, 0, 0);
    test_check_arrays("combine weights' gradients from the rows", dw, dw_ref, T * K, 1e-12, 1e-14);
    test_check_arrays("down projection's weight gradient from the rows", dwd, dwd_ref, E * D * H, 1e-12, 1e-14);
    test_check_arrays("gate|up gradient from the rows", dgu, dgu_ref, (size_t)off[E] * 2 * H, 1e-12, 1e-14);
    free(x), free(xp), free(gu), free(h), free(wd), free(y), free(dout), free(dy), free(dwd_ref), free(dh);
    free(dgu_ref), free(hw), free(dwd), free(dgu);
}

typedef struct {
    size_t E, N, K, R;
    const int32_t *off;
    real *x, *w, *out, *Rw;
} GroupCtx;

static double grouped_loss(void *p) {
    GroupCtx *c = p;
    ops->grouped_matmul_forward(c->out, c->x, c->w, c->off, c->E, c->N, c->K, c->R);
    return dot(c->out, c->Rw, (size_t)c->off[c->E] * c->N);
}

static void test_grouped_matmul_fd_empty_expert(void) {
    int32_t off[5] = {0, 3, 3, 8, 9}; // expert 1 empty; 2 trailing rows unused
    GroupCtx c = {.E = 4, .N = 5, .K = 3, .R = 11, .off = off, .x = rnd(33, 28, 1), .w = rnd(60, 29, 1),
                  .out = poisoned(55), .Rw = rnd(55, 30, 1)};
    real *dx = poisoned(33), *dw = poisoned(60), *dw2 = malloc(60 * sizeof(real)); // dw written over
    grouped_loss(&c);
    ops->grouped_matmul_backward(dx, dw, c.Rw, c.x, c.w, off, 4, 5, 3, 11, false);
    fd_check("grouped matmul d x", grouped_loss, &c, c.x, 27, dx);
    fd_check("grouped matmul d w", grouped_loss, &c, c.w, 60, dw);
    for (size_t i = 15; i < 30; i++) CHECK_MSG(dw[i] == 0, "empty expert's gradient %g, not written 0", (double)dw[i]);
    for (size_t i = 45; i < 55; i++) CHECK_MSG(isnan(c.out[i]), "row past offsets[E] written");
    memcpy(dw2, dw, 60 * sizeof(real));
    dw2[20] = 7; // added to: twice the gradient, the empty expert's block as it was
    ops->grouped_matmul_backward(NULL, dw2, c.Rw, c.x, c.w, off, 4, 5, 3, 11, true);
    for (size_t i = 0; i < 60; i++)
        CHECK_MSG(dw2[i] == (i == 20 ? 7 : 2 * dw[i]), "dw added to: %g at %zu, want %g", (double)dw2[i], i,
                  i == 20 ? 7.0 : 2 * (double)dw[i]);
    free(c.x), free(c.w), free(c.out), free(c.Rw), free(dx), free(dw), free(dw2);
}

static void test_bias_update_signs(void) {
    real bias[4] = {0, 0, 0, 0}, loads[4] = {10, 2, 4, 4};
    ops->router_bias_update(bias, loads, 4, 0.5f);
    CHECK(bias[0] == -0.5 && bias[1] == 0.5 && bias[2] == 0.5 && bias[3] == 0.5);
    real even[2] = {3, 3}, b2[2] = {0.1, 0.2};
    ops->router_bias_update(b2, even, 2, 1);
    CHECK(b2[0] == (real)0.1 && b2[1] == (real)0.2);
}

// ---------------------------------------------------------------- optimizer

static void test_adamw_matches_formula(void) {
    size_t n = 6;
    real *p = rnd(n, 31, 1), *g = rnd(n, 32, 1), *m = rnd(n, 33, 0.1), *v = rnd(n, 34, 0.1);
    for (size_t i = 0; i < n; i++) v[i] = fabs(v[i]);
    real *p0 = malloc(n * sizeof(real)), *m0 = malloc(n * sizeof(real)), *v0 = malloc(n * sizeof(real));
    memcpy(p0, p, n * sizeof(real)), memcpy(m0, m, n * sizeof(real)), memcpy(v0, v, n * sizeof(real));
    real norm_sq = 0;
    ops->sum_squares(&norm_sq, g, n);
    CHECK_CLOSE(norm_sq, dot(g, g, n), 1e-12, 0);
    AdamWArgs a = {.beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f, .clip = 0.5f};
    StepInfo st = {.lr = 0.01f, .step = 3};
    ops->adamw_update(p, NULL, g, m, v, n, a, &st, &norm_sq);
    double scale = 0.5 / (sqrt(norm_sq) + 1e-6);
    for (size_t i = 0; i < n; i++) {
        double gi = g[i] * scale, b1 = 0.9f, b2 = 0.95f;
        double mi = b1 * m0[i] + (1 - b1) * gi, vi = b2 * v0[i] + (1 - b2) * gi * gi;
        double pi = p0[i] * (1 - 0.01f * 0.1f) -
                    0.01f * (mi / (1 - pow(b1, 3))) / (sqrt(vi / (1 - pow(b2, 3))) + 1e-8f);
        CHECK_CLOSE(p[i], pi, 1e-9, 1e-12);
        CHECK_CLOSE(m[i], mi, 1e-12, 1e-15);
    }
    free(p), free(g), free(m), free(v), free(p0), free(m0), free(v0);
}

#define T(name) {#name, name}
// The direct exchange among 3 simulated ranks with 2 experts each, in one process: every rank's
// plan from the same gathered dispatch offsets; each rank's rows pushed into the owners' receive
// buffers must land expert-major (sources in rank order within an expert, as the send/recv path's
// regroup leaves them), and the return blocks must bring every row back to its source position.
// With receive buffers of `cap` rows, rows past cap are dropped: never written, counted, and
// returned as zeros. chunks 2: each way in two pushes, one per local expert (the blocks of
// parallel.exchange_chunks), which must land the same.
static void check_direct_exchange(int cap, int chunks) {
    enum { N = 3, EL = 2, E = N * EL, D = 3, ROOM = 40 };
    int32_t counts[N][E] = {{2, 0, 1, 3, 0, 1}, {0, 0, 4, 1, 2, 0}, {1, 5, 0, 0, 0, 2}};
    int32_t all[N * (E + 1)], plans[N][EL + 1 + 8 * E];
    for (int s = 0; s < N; s++) {
        all[s * (E + 1)] = 0;
        for (int g = 0; g < E; g++) all[s * (E + 1) + g + 1] = all[s * (E + 1) + g] + counts[s][g];
    }
    real dropped[N] = {0}, want_dropped[N] = {0};
    for (int r = 0; r < N; r++) ops->moe_exchange_plan(plans[r], all, N, EL, (size_t)r, (size_t)cap, &dropped[r]);
    real *src[N], *recv[N], *back[N];
    for (int r = 0; r < N; r++)
        src[r] = rnd(ROOM * D, 80 + (uint64_t)r, 1), recv[r] = poisoned(ROOM * D), back[r] = poisoned(ROOM * D);
    for (int s = 0; s < N; s++)
        for (int c = 0; c < chunks; c++) { // experts [c EL / chunks, (c + 1) EL / chunks) of every rank
            PushBlocks b = {plans[s] + EL + 1 + 4 * c * EL / chunks, EL / chunks, N, EL};
            ops->moe_push_rows((void *const *)recv, 0, src[s], b, D, (size_t)all[s * (E + 1) + E], 0);
        }
    real *want_back[N];
    for (int s = 0; s < N; s++) want_back[s] = calloc(ROOM * D, sizeof(real));
    for (int j = 0; j < N; j++) { // expected: j's experts in order, sources in order within each
        int row = 0;
        for (int e = 0; e < EL; e++) {
            int start = row < cap ? row : cap;
            CHECK_MSG(plans[j][e] == start, "rank %d: expert %d starts at %d, not %d", j, e, plans[j][e], start);
            for (int s = 0; s < N; s++)
                for (int i = 0; i < counts[s][j * EL + e]; i++, row++) {
                    int at = all[s * (E + 1) + j * EL + e] + i;
                    if (row >= cap) {
                        want_dropped[s]++;
                        continue;
                    }
                    memcpy(want_back[s] + at * D, src[s] + at * D, D * sizeof(real));
                    for (int d = 0; d < D; d++)
                        CHECK_MSG(recv[j][row * D + d] == src[s][at * D + d], "rank %d row %d: got %g, want %g",
                                  j, row, (double)recv[j][row * D + d], (double)src[s][at * D + d]);
                }
        }
        int kept = row < cap ? row : cap;
        CHECK_MSG(plans[j][EL] == kept, "rank %d keeps %d rows, plan says %d", j, kept, plans[j][EL]);
        CHECK_MSG(isnan(recv[j][kept * D]), "rank %d: a row past the kept ones was written", j);
    }
    for (int j = 0; j < N; j++)
        for (int c = 0; c < chunks; c++) { // what every source sent this chunk's experts here
            PushBlocks b = {plans[j] + EL + 1 + 4 * E + 4 * c * EL / chunks * N, EL / chunks * N, 1, 0};
            ops->moe_push_rows((void *const *)back, 0, recv[j], b, D, (size_t)cap, 0);
        }
    for (int s = 0; s < N; s++) {
        int sent = all[s * (E + 1) + E];
        CHECK_MSG(dropped[s] == want_dropped[s], "rank %d: %g rows counted dropped, %g were", s,
                  (double)dropped[s], (double)want_dropped[s]);
        CHECK_MSG(!memcmp(back[s], want_back[s], (size_t)sent * D * sizeof(real)),
                  "rank %d: kept rows did not return home, or dropped ones not as zeros", s);
        CHECK_MSG(isnan(back[s][sent * D]), "rank %d: a row past the sent ones was written", s);
    }
    for (int r = 0; r < N; r++) free(src[r]), free(recv[r]), free(back[r]), free(want_back[r]);
}

static void test_direct_exchange(void) {
    for (int chunks = 1; chunks <= 2; chunks++) {
        check_direct_exchange(40, chunks); // room for everything (rank 1 receives 9 rows, the most)
        check_direct_exchange(9, chunks);  // exactly full
        check_direct_exchange(5, chunks);  // rows dropped on every rank
        check_direct_exchange(0, chunks);
    }
}

// One reading: at time t (s), SM clock mhz of 1,980, draw w of a 700 W limit, energy counter j (J;
// < 0: not known), held back by the power limit / by temperature.
static DeviceClocks reading(double t, double mhz, double w, double j, bool capped, bool thermal) {
    return (DeviceClocks){.t_s = t, .sm_mhz = mhz, .sm_max_mhz = 1980, .power_w = w, .power_limit_w = 700,
                          .energy_j = j, .power_capped = capped, .thermal = thermal};
}

// The summary of clock readings: median (odd and even counts), lowest, highest possible, the shares
// held back, the mean draw from the energy counter over the readings' span (from the draws when a
// counter is not known); no readings gives zeros.
static void test_clock_summary(void) {
    DeviceClocks s[4] = {reading(10, 1620, 690, 5000, true, false), reading(10.5, 1980, 300, 5200, false, false),
                         reading(11, 1500, 700, 5600, true, true), reading(12, 1700, 1110, -1, true, false)};
    ClockSummary c;
    clock_summary_of(s, 3, &c);
    CHECK(c.queried && c.samples == 3);
    CHECK_CLOSE(c.sm_mhz_median, 1620, 0, 0);
    CHECK_CLOSE(c.sm_mhz_min, 1500, 0, 0);
    CHECK_CLOSE(c.sm_max_mhz, 1980, 0, 0);
    CHECK_CLOSE(c.power_w_mean, 600, 1e-12, 0); // 600 J in 1 s
    CHECK_CLOSE(c.power_limit_w, 700, 0, 0);
    CHECK_CLOSE(c.power_capped_share, 2.0 / 3, 1e-12, 0);
    CHECK_CLOSE(c.thermal_share, 1.0 / 3, 1e-12, 0);
    clock_summary_of(s, 4, &c);
    CHECK_CLOSE(c.sm_mhz_median, (1620 + 1700) / 2.0, 0, 0);
    CHECK_CLOSE(c.power_w_mean, 700, 1e-12, 0); // the last counter unknown: the mean of the draws
    clock_summary_of(s, 0, &c);
    CHECK(c.queried && c.samples == 0 && c.sm_mhz_median == 0 && c.power_w_mean == 0);
}

static bool fake_clocks(DeviceClocks *out) {
    *out = reading(moe_time_sec(), 1650, 695, -1, true, false);
    return true;
}

static bool no_clocks(DeviceClocks *out) { return false; }

// The monitor reads on its own thread until stopped; a backend without the query gives no monitor
// (nothing printed), one whose readings fail gives a summary without readings.
static void test_device_monitor(void) {
    Ops o = *ops_cpu();
    ClockSummary c;
    CHECK(o.device_clocks == NULL && device_monitor_start(&o, 1) == NULL);
    device_monitor_stop(NULL, &c);
    CHECK(!c.queried && c.samples == 0);
    o.device_clocks = fake_clocks;
    DeviceMonitor *m = device_monitor_start(&o, 1);
    struct timespec wait = {0, 30 * 1000 * 1000};
    nanosleep(&wait, NULL);
    device_monitor_stop(m, &c);
    CHECK_MSG(c.queried && c.samples >= 2, "%zu readings in 30 ms at one a millisecond", c.samples);
    CHECK_CLOSE(c.sm_mhz_median, 1650, 0, 0);
    CHECK_CLOSE(c.power_capped_share, 1, 0, 0);
    o.device_clocks = no_clocks;
    device_monitor_stop(device_monitor_start(&o, 1), &c);
    CHECK(c.queried && c.samples == 0);
}

static int clock_readings; // counting_clocks' readings so far

static bool counting_clocks(DeviceClocks *out) {
    *out = reading(moe_time_sec(), ++clock_readings, 600, -1, false, false);
    return true;
}

// A take summarises the readings since the one before and drops them: the clocks read (numbered
// 1, 2, ... by counting_clocks) after the first take are all past its count.
static void test_device_monitor_take(void) {
    Ops o = *ops_cpu();
    o.device_clocks = counting_clocks;
    clock_readings = 0;
    ClockSummary first, second, rest;
    DeviceMonitor *m = device_monitor_start(&o, 1);
    struct timespec wait = {0, 20 * 1000 * 1000};
    nanosleep(&wait, NULL);
    device_monitor_take(m, &first);
    nanosleep(&wait, NULL);
    device_monitor_take(m, &second);
    device_monitor_stop(m, &rest);
    CHECK_MSG(first.samples >= 1 && first.sm_mhz_min == 1, "%zu readings, lowest %g", first.samples,
              first.sm_mhz_min);
    CHECK_MSG(second.samples >= 1 && second.sm_mhz_min > (double)first.samples, "%zu readings from %g after %zu",
              second.samples, second.sm_mhz_min, first.samples);
    CHECK(rest.queried && first.samples + second.samples + rest.samples <= (size_t)clock_readings);
    device_monitor_take(NULL, &rest);
    CHECK(!rest.queried && rest.samples == 0);
}

const TestCase ops_tests[] = {
    T(test_clock_summary),
    T(test_device_monitor),
    T(test_device_monitor_take),
    T(test_attention_fd),
    T(test_qkv_norm_rope_fd),
    T(test_rmsnorm_fd_and_accumulate),
    T(test_swiglu_fd_and_row_range),
    T(test_matmul_backward_accumulates),
    T(test_embedding_backward_accumulates_repeats),
    T(test_cross_entropy_fd_and_ignore),
    T(test_router_fd),
    T(test_router_split_batch),
    T(test_router_ties_bias_and_noise),
    T(test_regroup_round_trip),
    T(test_direct_exchange),
    T(test_dispatch_combine_capacity),
    T(test_combine_weight_backward),
    T(test_grouped_matmul_fd_empty_expert),
    T(test_bias_update_signs),
    T(test_adamw_matches_formula),
    {0},
};

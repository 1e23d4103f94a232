// `moe bench --kernels CONFIG`: each component kernel timed alone on the config's shapes (one
// micro-batch), through the ops interface of the config's device, with the FLOPs or bytes counted
// here, the rate reached, the ceiling measured in the same run (matrix product on random values,
// device copy) and the aim the project holds it to. A regression shows as one line. On the GPU the
// FP8 recipe's products follow their bf16 lines, aimed at 1.6x (experts) and 1.5x (dense) of the
// bf16 rates just measured, with the quantisation kernels they read. Last, the device's clock and
// power while they ran: one kernel alone seldom meets the power limit that a whole step does.
// `--only` times some of the families (attention, grouped, dense, memory) and skips the rest.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"
#include "cli.h"
#include "common/rng.h"
#include "train/setup.h"
#include "train/train.h"

void *bench_rand_act(Bench *b, size_t n, uint64_t seed, float scale) {
    void *p = b->o->alloc(n * b->o->act_size);
    ops_fill_random(b->o, p, n, seed, scale);
    return p;
}

void *bench_zero_buf(Bench *b, size_t bytes) {
    void *p = b->o->alloc(bytes);
    b->o->zero(p, bytes);
    return p;
}

void bench_fp8_alloc(Bench *b, BenchFp8 *q, size_t E, size_t N, size_t K, size_t R) {
    const Ops *o = b->o;
    size_t Kb = fp8_blocks(K), Nb = fp8_blocks(N), Rt = fp8_expert_cols(R, E), f = o->f32_size;
    *q = (BenchFp8){.xq = o->alloc(R * K), .xs = o->alloc(Kb * R * f), .dyq = o->alloc(R * N),
                    .dys = o->alloc(Nb * R * f), .xt = o->alloc(K * Rt), .xts = o->alloc(Rt / FP8_BLOCK * K * f),
                    .dyt = o->alloc(N * Rt), .dyts = o->alloc(Rt / FP8_BLOCK * N * f), .wq = o->alloc(E * N * K),
                    .wqt = o->alloc(E * N * K), .ws = o->alloc(E * Kb * Nb * f), .wst = o->alloc(E * Kb * Nb * f)};
}

void bench_fp8_free(Bench *b, BenchFp8 *q) {
    BENCH_FREE_ALL(b, q->xq, q->xs, q->dyq, q->dys, q->xt, q->xts, q->dyt, q->dyts, q->wq, q->wqt, q->ws, q->wst);
}

// One line of the table: a matrix kernel (flops > 0, against the matrix ceiling) or a memory-bound
// one (bytes, against the copy bandwidth). aim: TFLOP/s or GB/s to reach (0: none set).
static void report(const Bench *b, const char *name, const char *shape, double ms, double flops, double bytes, double aim) {
    bool matrix = flops > 0;
    double rate = matrix ? flops / (ms * 1e-3) / 1e12 : bytes / (ms * 1e-3) / 1e9;
    double ceiling = matrix ? b->matmul : b->copy;
    char aim_s[32] = "";
    if (aim > 0 && b->aims) snprintf(aim_s, sizeof aim_s, "%6.0f %s", aim, rate >= aim ? "met" : "MISSED");
    printf("  %-30s %-26s %9.3f ms %8.1f %-7s %5.1f%%  %s\n", name, shape, ms, rate, matrix ? "TFLOP/s" : "GB/s",
           100 * rate / ceiling, aim_s);
}

// The line of the `kind` ("grouped", "fp8") forward of product `what` sustained for a second
// (BENCH_SUSTAINED_MS): its rate and the clocks and power it ran at.
static void report_sustained(const char *kind, const char *what, const char *shape, double ms, double flops,
                             const ClockSummary *c) {
    char name[64];
    snprintf(name, sizeof name, "%s %s forward sustained", kind, what);
    printf("  %-30s %-26s %9.3f ms %8.1f TFLOP/s at SM clock median %.0f MHz (lowest %.0f), %.0f W of %.0f\n",
           name, shape, ms, flops / (ms * 1e-3) / 1e12, c->sm_mhz_median, c->sm_mhz_min, c->power_w_mean,
           c->power_limit_w);
}
#define REPORT_SUSTAINED(b, kind, what, shape, est_ms, flops, call)                              \
    do {                                                                                         \
        ClockSummary held_;                                                                      \
        double t_ = BENCH_SUSTAINED_MS(b, est_ms, &held_, call);                                 \
        report_sustained(kind, what, shape, t_, flops, &held_);                                  \
    } while (0)

// Causal attention of shape d, forward and backward; aimed (issue targets for hd 128) when aims.
static void bench_attention_case(Bench *b, AttnDims d, bool aims) {
    size_t T = d.B * d.S, C = (d.Hq + 2 * d.Hkv) * d.hd, Dq = d.Hq * d.hd;
    void *qkv = bench_rand_act(b, T * C, 11, 1.0f), *dout = bench_rand_act(b, T * Dq, 12, 1.0f);
    void *out = b->o->alloc(T * Dq * b->o->act_size), *dqkv = b->o->alloc(T * C * b->o->act_size);
    void *lse = b->o->alloc(d.B * d.Hq * d.S * b->o->f32_size);
    double fwd = 4.0 * d.B * d.Hq * (double)d.S * d.S * d.hd / 2; // QK^T and PV, causal half
    char shape[64];
    snprintf(shape, sizeof shape, "B%zu S%zu H%zu/%zu hd%zu", d.B, d.S, d.Hq, d.Hkv, d.hd);
    double f = BENCH_TIME_MS(b, 10, b->o->attention_forward(out, lse, qkv, d));
    double g = BENCH_TIME_MS(b, 10, b->o->attention_backward(dqkv, dout, qkv, out, lse, d));
    report(b, "attention forward", shape, f, fwd, 0, aims ? 550 : 0);
    report(b, "attention backward (2.5x fwd)", shape, g, 2.5 * fwd, 0, aims ? 430 : 0);
    report(b, "attention forward+backward", shape, f + g, 3.5 * fwd, 0, aims ? 470 : 0);
    BENCH_FREE_ALL(b, qkv, dout, out, dqkv, lse);
}

// QK-norm + RoPE of shape d: the forward (reads the projection, writes qkv), the backward in place
// as the model calls it (reads the q and k gradients and the kept q and k, writes their gradients).
static void bench_qk_norm_rope(Bench *b, AttnDims d, QkNorm mode) {
    const Ops *o = b->o;
    size_t T = d.B * d.S, C = (d.Hq + 2 * d.Hkv) * d.hd, QK = (d.Hq + d.Hkv) * d.hd, f = o->f32_size;
    double a = (double)o->act_size;
    void *raw = bench_rand_act(b, T * C, 13, 1.0f), *qkv = o->alloc(T * C * o->act_size);
    void *dqkv = bench_rand_act(b, T * C, 14, 1.0f), *w = bench_rand_act(b, QK, 15, 1.0f);
    void *rstd = o->alloc(T * (d.Hq + d.Hkv) * f), *rope = bench_zero_buf(b, d.S * d.hd * f);
    void *dw = bench_zero_buf(b, QK * f);
    void *wk = (char *)w + d.Hq * d.hd * o->act_size, *dwk = (char *)dw + d.Hq * d.hd * f;
    char shape[64];
    snprintf(shape, sizeof shape, "T%zu C%zu", T, C);
    report(b, "qk-norm + rope forward", shape,
           BENCH_TIME_MS(b, 10, o->qkv_norm_rope_forward(qkv, rstd, raw, w, wk, rope, d, mode, 1e-5f)), 0,
           2.0 * T * C * a, 0);
    report(b, "qk-norm + rope backward", shape,
           BENCH_TIME_MS(b, 10, o->qkv_norm_rope_backward(dqkv, dw, dwk, dqkv, raw, w, wk, rstd, rope, d, mode)), 0,
           3.0 * T * QK * a, 0);
    BENCH_FREE_ALL(b, raw, qkv, dqkv, w, rstd, rope, dw);
}

// The config's attention, then the same tokens and width with grouped-query heads (a quarter of
// the KV heads) and with heads of 64 (twice as many), where the config has neither.
static void bench_attention(Bench *b, const Config *cfg) {
    const ModelConfig *c = &cfg->model;
    AttnDims d = {(size_t)cfg->train.micro_batch, (size_t)cfg->train.seq_len, (size_t)c->n_heads,
                  (size_t)c->n_kv_heads, (size_t)c->head_dim};
    bench_qk_norm_rope(b, d, c->qk_norm);
    bench_attention_case(b, d, d.hd == 128);
    if (d.Hkv == d.Hq && d.Hq % 4 == 0) bench_attention_case(b, (AttnDims){d.B, d.S, d.Hq, d.Hq / 4, d.hd}, false);
    if (d.hd == 128) bench_attention_case(b, (AttnDims){d.B, d.S, 2 * d.Hq, 2 * d.Hkv, 64}, false);
}

// Expert loads (bench.h): Zipf shares capped at T, as top-k picks distinct experts.
static bool expert_sparse(const char *kind, size_t e) { return kind[0] == 's' && e % 2; }

static double expert_share(const char *kind, size_t e) {
    return kind[0] == 'z' ? 1.0 / (double)(e + 1) : expert_sparse(kind, e) ? 0 : 1;
}

void bench_expert_rows(const char *kind, size_t T, size_t K, size_t E, int32_t *offsets) {
    double *want = calloc(E, sizeof(double)), R = (double)T * K, left = R;
    bool *capped = calloc(E, sizeof(bool));
    for (int pass = 0; pass < 8; pass++) { // water-filling of the Zipf shares under the cap T
        double share = 0;
        for (size_t e = 0; e < E; e++)
            if (!capped[e]) share += expert_share(kind, e);
        for (size_t e = 0; e < E; e++)
            if (!capped[e]) want[e] = left * expert_share(kind, e) / share;
        bool again = false;
        for (size_t e = 0; e < E; e++)
            if (!capped[e] && want[e] > (double)T) want[e] = (double)T, capped[e] = true, left -= (double)T, again = true;
        if (!again) break;
    }
    offsets[0] = 0;
    size_t given = 0;
    for (size_t e = 0; e < E; e++) {
        size_t rows = expert_sparse(kind, e) ? e % 4 : (size_t)want[e];
        if (e == E - 1 && !expert_sparse(kind, e)) rows = (size_t)R - given; // the rounding remainder
        given += rows, offsets[e + 1] = offsets[e] + (int32_t)rows;
    }
    free(want), free(capped);
}

// The FP8 recipe's expert products on the rows of a bf16 case (bf16_ms: its forward, input- and
// weight-gradient times; the FP8 ones go to fp8_ms, the weight gradient's as train.fp8_wgrad_blocks
// has it by default), aimed at 1.6x the bf16 rates, and the quantisations they read (bytes
// read and written; scales counted), counting what they flush and saturate as training does: x's
// rows and token-major copy, dy's both from one pass (as the backward makes them). The weights'
// (once a step, for every expert weight) and the transpose of their codes (each backward) are aimed
// at 2 TB/s, half the copy rate. dy's
// pass also from rows gathered through a map (as the model reads the layer's output gradient: each
// expert row a token's row, here a random one of dy's).
static void bench_grouped_fp8(Bench *b, const char *what, const char *shape, const void *doff, size_t rows, size_t E,
                              size_t N, size_t Kd, size_t R, const void *x, const void *w, const void *dy,
                              const double bf16_ms[3], bool sustain, double fp8_ms[3]) {
    const Ops *o = b->o;
    size_t Kb = fp8_blocks(Kd), Nb = fp8_blocks(N), Rt = fp8_expert_cols(R, E), a = o->act_size, f = o->f32_size;
    BenchFp8 q;
    bench_fp8_alloc(b, &q, E, N, Kd, R);
    void *y = o->alloc(R * N * a), *dx = o->alloc(R * Kd * a), *dw = bench_zero_buf(b, E * N * Kd * f);
    uint64_t *n = bench_zero_buf(b, FP8_COUNTS * sizeof(uint64_t));
    char name[64];
    double flops = 2.0 * rows * N * Kd, ms;
    // bytes written: the rows' codes and scales of `rows` rows, the token-major copies' of Rt columns
    double code = 1 + (double)f / FP8_BLOCK, rows_out = (double)rows * Kd * code, cols_out = (double)Rt * Kd * code;
    double dy_out = ((double)rows + Rt) * N * code;
    ms = BENCH_TIME_MS(b, 10, o->fp8_quantize_rows(q.xq, q.xs, x, doff, E, R, Kd, FP8_SCALE_AMAX, n));
    report(b, "  fp8 quantise rows (x)", shape, ms, 0, (double)rows * Kd * a + rows_out, 0);
    ms = BENCH_TIME_MS(b, 10, o->fp8_dequantize_rows(dx, q.xq, q.xs, doff, E, R, Kd));
    report(b, "  fp8 dequantise rows (x, exchange)", shape, ms, 0, rows_out + (double)rows * Kd * a, 0);
    ms = BENCH_TIME_MS(b, 10, o->fp8_quantize_cols(q.xt, q.xts, x, doff, E, R, Kd, FP8_SCALE_AMAX, FP8_COLS_1X128, n));
    report(b, "  fp8 quantise token-major (x)", shape, ms, 0, (double)rows * Kd * a + cols_out, 0);
    ms = BENCH_TIME_MS(b, 10, o->fp8_quantize_rows_cols(q.dyq, q.dys, q.dyt, q.dyts, dy, NULL, doff, E, R, N,
                                                        FP8_SCALE_AMAX, FP8_COLS_1X128, n));
    report(b, "  fp8 quantise rows+cols (dy)", shape, ms, 0, (double)rows * N * a + dy_out, 0);
    int32_t *map = moe_malloc(R * sizeof(int32_t)), *dmap = o->alloc(R * sizeof(int32_t));
    for (size_t r = 0; r < R; r++) map[r] = (int32_t)(rng_hash64(7, r) % (rows ? rows : 1));
    o->upload(dmap, map, R * sizeof(int32_t));
    free(map);
    ms = BENCH_TIME_MS(b, 10, o->fp8_quantize_rows_cols(q.dyq, q.dys, q.dyt, q.dyts, dy, dmap, doff, E, R, N,
                                                        FP8_SCALE_AMAX, FP8_COLS_1X128, n));
    report(b, "  fp8 quantise rows+cols gathered", shape, ms, 0, (double)rows * N * a + dy_out, 0);
    o->free(dmap);
    ms = BENCH_TIME_MS(b, 10, o->fp8_quantize_weights(q.wq, q.ws, q.wst, w, E, N, Kd, FP8_SCALE_AMAX, n));
    report(b, "  fp8 quantise weights", shape, ms, 0, (double)E * N * Kd * (a + 1) + 2.0 * E * Kb * Nb * f, 2000);
    // half of them, as one of two expert-data-parallel ranks does (train.fp8_fused_update): the part's
    // block maxima, then its codes (the maxima's all-reduce between is not timed here)
    size_t half = E * N * Kd / 2 / 16 * 16;
    void *amax = bench_zero_buf(b, E * Kb * Nb * f);
    ms = BENCH_TIME_MS(b, 10, (o->fp8_weights_amax(amax, w, E, N, Kd, 0, half),
                               o->fp8_quantize_weights_part(q.wq, q.ws, q.wst, amax, w, E, N, Kd, 0, half,
                                                            FP8_SCALE_AMAX, n)));
    report(b, "  fp8 quantise weights, half (2 passes)", shape, ms, 0,
           (double)half * (2 * a + 1) + 3.0 * E * Kb * Nb * f, 2000);
    ms = BENCH_TIME_MS(b, 10, o->fp8_transpose_codes(q.wqt, q.wq, E, N, Kd));
    report(b, "  fp8 weights' codes transposed", shape, ms, 0, 2.0 * E * N * Kd, 2000);
    snprintf(name, sizeof name, "fp8 %s forward", what);
    fp8_ms[0] = BENCH_TIME_MS(b, 10, o->fp8_grouped_matmul(y, q.xq, q.xs, q.wq, q.ws, doff, E, N, Kd, R));
    report(b, name, shape, fp8_ms[0], flops, 0, 1.6 * flops / (bf16_ms[0] * 1e-3) / 1e12);
    snprintf(name, sizeof name, "fp8 %s input grad", what);
    fp8_ms[1] = BENCH_TIME_MS(b, 10, o->fp8_grouped_matmul(dx, q.dyq, q.dys, q.wqt, q.wst, doff, E, Kd, N, R));
    report(b, name, shape, fp8_ms[1], flops, 0, 1.6 * flops / (bf16_ms[1] * 1e-3) / 1e12);
    snprintf(name, sizeof name, "fp8 %s weight grad, x 1x128", what);
    ms = BENCH_TIME_MS(b, 10, o->fp8_grouped_matmul_wgrad(dw, q.dyt, q.dyts, q.xt, q.xts, FP8_COLS_1X128, doff, E, N,
                                                          Kd, R, false));
    report(b, name, shape, ms, flops, 0, 1.6 * flops / (bf16_ms[2] * 1e-3) / 1e12);
    // the experts' default (train.fp8_wgrad_blocks): x's token-major copy in 128x128 blocks
    ms = BENCH_TIME_MS(b, 10,
                       o->fp8_quantize_cols(q.xt, q.xts, x, doff, E, R, Kd, FP8_SCALE_AMAX, FP8_COLS_128X128, n));
    report(b, "  fp8 quantise token-major (x, 128x128)", shape, ms, 0, (double)rows * Kd * a + cols_out, 0);
    snprintf(name, sizeof name, "fp8 %s weight grad", what);
    fp8_ms[2] = BENCH_TIME_MS(b, 10, o->fp8_grouped_matmul_wgrad(dw, q.dyt, q.dyts, q.xt, q.xts, FP8_COLS_128X128, doff,
                                                                E, N, Kd, R, false));
    report(b, name, shape, fp8_ms[2], flops, 0, 1.6 * flops / (bf16_ms[2] * 1e-3) / 1e12);
    if (sustain) // after the bursts above, which a sustained run would slow
        REPORT_SUSTAINED(b, "fp8", what, shape, fp8_ms[0], flops,
                         o->fp8_grouped_matmul(y, q.xq, q.xs, q.wq, q.ws, doff, E, N, Kd, R));
    bench_fp8_free(b, &q);
    BENCH_FREE_ALL(b, y, dx, dw, n, amax);
}

// One product of the experts (N, Kd) on rows of a kind of load, bf16 and, on the GPU, FP8; the three
// products' times added to ms_sum (bf16, fp8; fp8 stays 0 where not timed).
static void bench_grouped_case(Bench *b, const Config *cfg, const char *kind, const char *what, size_t N, size_t Kd,
                               double ms_sum[2]) {
    const ModelConfig *c = &cfg->model;
    size_t T = (size_t)cfg->train.micro_batch * cfg->train.seq_len, E = (size_t)c->n_experts;
    size_t R = T * c->top_k + 4 * E;
    int32_t *off = malloc((E + 1) * sizeof(int32_t));
    bench_expert_rows(kind, T, (size_t)c->top_k, E, off);
    void *doff = b->o->alloc((E + 1) * sizeof(int32_t));
    b->o->upload(doff, off, (E + 1) * sizeof(int32_t));
    double flops = 2.0 * off[E] * N * Kd, aim = E <= 8 ? 620 : 580, ms[3];
    void *x = bench_rand_act(b, R * Kd, 21, 1.0f), *w = bench_rand_act(b, E * N * Kd, 22, 0.02f), *dy = bench_rand_act(b, R * N, 23, 1.0f);
    void *y = b->o->alloc(R * N * b->o->act_size), *dx = b->o->alloc(R * Kd * b->o->act_size);
    void *dw = bench_zero_buf(b, E * N * Kd * b->o->f32_size);
    char name[64], shape[64];
    snprintf(shape, sizeof shape, "E%zu %s N%zu K%zu", E, kind, N, Kd);
    snprintf(name, sizeof name, "grouped %s forward", what);
    report(b, name, shape, ms[0] = BENCH_TIME_MS(b, 10, b->o->grouped_matmul_forward(y, x, w, doff, E, N, Kd, R)), flops, 0, aim);
    snprintf(name, sizeof name, "grouped %s input grad", what);
    ms[1] = BENCH_TIME_MS(b, 10, b->o->grouped_matmul_backward(dx, NULL, dy, x, w, doff, E, N, Kd, R, false));
    report(b, name, shape, ms[1], flops, 0, aim);
    // the weight gradient as a step's first write makes it (overwriting dw), then added to dw
    snprintf(name, sizeof name, "grouped %s weight grad", what);
    ms[2] = BENCH_TIME_MS(b, 10, b->o->grouped_matmul_backward(NULL, dw, dy, x, w, doff, E, N, Kd, R, false));
    report(b, name, shape, ms[2], flops, 0, aim);
    double add = BENCH_TIME_MS(b, 10, b->o->grouped_matmul_backward(NULL, dw, dy, x, w, doff, E, N, Kd, R, true));
    report(b, "  adding to dw", shape, add, flops, 0, 0);
    // FP8 on the GPU only (the CPU backend's emulation is a reference, not a kernel to time); the
    // forwards of balanced loads then sustained, in both precisions (where the clocks are read)
    bool sustain = b->o->device_clocks && !strcmp(kind, "balanced");
    double fp8_ms[3] = {0};
    if (b->aims && b->o->fp8_grouped_matmul)
        bench_grouped_fp8(b, what, shape, doff, (size_t)off[E], E, N, Kd, R, x, w, dy, ms, sustain, fp8_ms);
    if (sustain)
        REPORT_SUSTAINED(b, "grouped", what, shape, ms[0], flops,
                         b->o->grouped_matmul_forward(y, x, w, doff, E, N, Kd, R));
    for (int i = 0; i < 3; i++) ms_sum[0] += ms[i], ms_sum[1] += fp8_ms[i];
    BENCH_FREE_ALL(b, doff, x, w, dy, y, dx, dw);
    free(off);
}

static void bench_grouped(Bench *b, const Config *cfg) {
    const ModelConfig *c = &cfg->model;
    size_t D = (size_t)c->d_model, H = (size_t)c->expert_hidden;
    const char *kinds[3] = {"balanced", "zipf", "sparse"};
    for (int k = 0; k < 3; k++) {
        double ms[2] = {0, 0}; // the six products' times summed: bf16, fp8
        bench_grouped_case(b, cfg, kinds[k], "up+gate", 2 * H, D, ms);
        bench_grouped_case(b, cfg, kinds[k], "down", D, H, ms);
        // the experts' FP8 products against bf16's as a step runs them (issue 13's 1.6x on the bench shapes)
        if (ms[1] > 0)
            printf("  experts' six products, %-8s fp8 %.3f ms against bf16 %.3f ms: %.3fx bf16 (aim 1.6x: %s)\n",
                   kinds[k], ms[1], ms[0], ms[0] / ms[1], ms[0] >= 1.6 * ms[1] ? "met" : "MISSED");
    }
}

// The FP8 dense product of x (M, K) and w (N, K) (rows and weights quantised first, timed too),
// aimed at 1.5x the bf16 forward's rate (bf16_ms).
static void bench_dense_fp8(Bench *b, const char *shape, const void *x, const void *w, size_t M, size_t N, size_t K,
                            double bf16_ms) {
    const Ops *o = b->o;
    size_t Kb = fp8_blocks(K), Nb = fp8_blocks(N), f = o->f32_size;
    void *xq = o->alloc(M * K), *xs = o->alloc(Kb * M * f), *wq = o->alloc(N * K);
    void *ws = o->alloc(Kb * Nb * f), *wst = o->alloc(Kb * Nb * f), *y = o->alloc(M * N * o->act_size);
    double flops = 2.0 * M * N * K;
    double q = BENCH_TIME_MS(b, 10, o->fp8_quantize_rows(xq, xs, x, NULL, 1, M, K, FP8_SCALE_AMAX, NULL));
    report(b, "  fp8 quantise rows", shape, q, 0, (double)M * K * (o->act_size + 1 + (double)f / FP8_BLOCK), 0);
    o->fp8_quantize_weights(wq, ws, wst, w, 1, N, K, FP8_SCALE_AMAX, NULL);
    double ms = BENCH_TIME_MS(b, 10, o->fp8_matmul(y, xq, xs, wq, ws, M, N, K));
    report(b, "  fp8 forward", shape, ms, flops, 0, 1.5 * flops / (bf16_ms * 1e-3) / 1e12);
    BENCH_FREE_ALL(b, xq, xs, wq, ws, wst, y);
}

static void bench_dense_case(Bench *b, const char *name, size_t M, size_t N, size_t K, bool fp8) {
    void *x = bench_rand_act(b, M * K, 31, 1.0f), *w = bench_rand_act(b, N * K, 32, 0.02f), *dy = bench_rand_act(b, M * N, 33, 1.0f);
    void *y = b->o->alloc(M * N * b->o->act_size), *dx = b->o->alloc(M * K * b->o->act_size);
    void *dw = bench_zero_buf(b, N * K * b->o->f32_size);
    char shape[64];
    snprintf(shape, sizeof shape, "%zu x %zu x %zu", M, N, K);
    double flops = 2.0 * M * N * K, ms = BENCH_TIME_MS(b, 10, b->o->matmul_forward(y, x, w, M, N, K, false));
    report(b, name, shape, ms, flops, 0, 0);
    report(b, "  backward (dx and dw)", shape, BENCH_TIME_MS(b, 10, b->o->matmul_backward(dx, dw, dy, x, w, M, N, K, false)),
           2 * flops, 0, 0);
    if (fp8 && b->aims && b->o->fp8_matmul) bench_dense_fp8(b, shape, x, w, M, N, K, ms);
    BENCH_FREE_ALL(b, x, w, dy, y, dx, dw);
}

// The rows of one chunk of the LM head's logits the benchmarks time, of a step's T tokens.
static size_t head_chunk_rows(size_t T) { return T < 8192 ? T : 8192; }

// The dense layers' products: QKV and output projections (with FP8's) and one chunk of the LM head.
static void bench_dense(Bench *b, const Config *cfg) {
    const ModelConfig *c = &cfg->model;
    size_t T = (size_t)cfg->train.micro_batch * cfg->train.seq_len, D = (size_t)c->d_model;
    bench_dense_case(b, "dense QKV projection", T, model_qkv_width(c), D, true);
    bench_dense_case(b, "dense output projection", T, D, (size_t)c->n_heads * c->head_dim, true);
    bench_dense_case(b, "dense LM head (one chunk)", head_chunk_rows(T), (size_t)c->vocab_size, D, false);
}

// The loss with its gradient written over one chunk of the LM head's logits (head_chunk_rows): the
// logits read, the gradient written.
static void bench_cross_entropy(Bench *b, const Config *cfg) {
    const Ops *o = b->o;
    size_t rows = head_chunk_rows((size_t)cfg->train.micro_batch * cfg->train.seq_len);
    size_t V = (size_t)cfg->model.vocab_size;
    int32_t *tg = moe_malloc(rows * sizeof(int32_t));
    for (size_t r = 0; r < rows; r++) tg[r] = (int32_t)(rng_hash64(44, r) % V);
    void *logits = bench_rand_act(b, rows * V, 43, 1.0f), *loss = bench_zero_buf(b, 2 * o->f32_size);
    void *targets = o->alloc(rows * sizeof(int32_t));
    o->upload(targets, tg, rows * sizeof(int32_t));
    free(tg);
    char shape[64];
    snprintf(shape, sizeof shape, "%zu x %zu", rows, V);
    report(b, "cross-entropy with its gradient", shape,
           BENCH_TIME_MS(b, 10, o->cross_entropy(logits, loss, targets, rows, V, 1.0f / rows, 1e-4f, true)), 0,
           2.0 * rows * V * o->act_size, 0);
    BENCH_FREE_ALL(b, logits, loss, targets);
}

// The update of one layer's experts' gate|up weights with their FP8 copies: AdamW into a compute
// copy, then its quantisation (the staged path), against both in one pass (adamw_update_fp8). The
// arrays: a model's parameters' (at least the tensor's).
static void bench_adamw_fp8(Bench *b, const ModelConfig *c, void *param, void *param_act, void *grad, void *m, void *v,
                            void *step, void *norm, AdamWArgs args) {
    const Ops *o = b->o;
    if (!o->adamw_update_fp8 || !c->n_experts) return;
    size_t E = (size_t)c->n_experts, N = 2 * (size_t)c->expert_hidden, K = (size_t)c->d_model, n = E * N * K;
    size_t blocks = E * fp8_blocks(N) * fp8_blocks(K), f = o->f32_size;
    void *q = o->alloc(n), *qs = o->alloc(blocks * f), *qst = o->alloc(blocks * f);
    void *counts = bench_zero_buf(b, FP8_COUNTS * sizeof(uint64_t));
    char shape[64];
    snprintf(shape, sizeof shape, "E%zu N%zu K%zu", E, N, K);
    double ms = BENCH_TIME_MS(b, 3, (o->adamw_update(param, param_act, grad, m, v, n, args, step, norm),
                                     o->fp8_quantize_weights(q, qs, qst, param_act, E, N, K, FP8_SCALE_AMAX, counts)));
    // AdamW's 30 bytes a parameter, then its compute copy read and the codes written
    report(b, "AdamW then FP8 weights (experts' gate|up)", shape, ms, 0, 33.0 * n, 0);
    ms = BENCH_TIME_MS(b, 3, o->adamw_update_fp8(param, grad, m, v, q, qs, qst, E, N, K, args, step, norm,
                                                 FP8_SCALE_AMAX, counts));
    report(b, "  in one pass (adamw_update_fp8)", shape, ms, 0, 29.0 * n, 0); // no compute copy
    BENCH_FREE_ALL(b, q, qs, qst, counts);
}

static void bench_memory_bound(Bench *b, const Config *cfg) {
    const ModelConfig *c = &cfg->model;
    const Ops *o = b->o;
    size_t T = (size_t)cfg->train.micro_batch * cfg->train.seq_len, D = (size_t)c->d_model;
    size_t H = (size_t)c->expert_hidden, R = T * c->top_k, a = o->act_size, f = o->f32_size;
    char shape[64];
    void *x = bench_rand_act(b, R * 2 * H, 41, 1.0f), *y = o->alloc(R * 2 * H * a), *w = bench_rand_act(b, D, 42, 1.0f);
    void *rstd = o->alloc(T * f);
    snprintf(shape, sizeof shape, "%zu x %zu", T, D);
    void *dw = bench_zero_buf(b, D * f), *s = o->alloc(T * D * a);
    report(b, "rmsnorm forward", shape, BENCH_TIME_MS(b, 10, o->rmsnorm_forward(y, rstd, x, w, T, D, 1e-5f)), 0,
           2.0 * T * D * a, 0);
    report(b, "  with the add (fused)", shape,
           BENCH_TIME_MS(b, 10, o->add_rmsnorm_forward(s, y, rstd, x, x, w, T, D, 1e-5f)), 0, 4.0 * T * D * a, 0);
    report(b, "rmsnorm backward (dx +=)", shape,
           BENCH_TIME_MS(b, 10, o->rmsnorm_backward(y, dw, x, x, w, rstd, T, D, true)), 0, 4.0 * T * D * a, 0);
    report(b, "residual add", shape, BENCH_TIME_MS(b, 10, o->add(y, x, x, T * D)), 0, 3.0 * T * D * a, 0);
    BENCH_FREE_ALL(b, dw, s);
    bench_cross_entropy(b, cfg);
    snprintf(shape, sizeof shape, "%zu x %zu", R, H);
    report(b, "swiglu forward", shape, BENCH_TIME_MS(b, 10, o->swiglu_forward(y, x, R, H, NULL, 0)), 0, 3.0 * R * H * a, 0);
    void *hw = o->alloc(R * H * a), *row_w = bench_zero_buf(b, R * f), *row_dot = o->alloc(R * f);
    report(b, "swiglu backward", shape, BENCH_TIME_MS(b, 10, o->swiglu_backward(y, NULL, NULL, x, x, NULL, R, H, NULL, 0)),
           0, 5.0 * R * H * a, 0);
    report(b, "  with the row dots (fused)", shape,
           BENCH_TIME_MS(b, 10, o->swiglu_backward(y, row_dot, hw, x, x, row_w, R, H, NULL, 0)), 0,
           6.0 * R * H * a + 2.0 * R * f, 0);
    BENCH_FREE_ALL(b, hw, row_w, row_dot);
    if (b->aims && o->swiglu_forward_fp8) { // FP8: with the rows of its output quantised in the same pass
        void *q = o->alloc(R * H), *qs = o->alloc(fp8_blocks(H) * R * f);
        void *n = bench_zero_buf(b, FP8_COUNTS * sizeof(uint64_t)); // counted, as in training
        report(b, "  with fp8 rows (fused)", shape,
               BENCH_TIME_MS(b, 10, o->swiglu_forward_fp8(y, q, qs, x, NULL, 1, R, H, FP8_SCALE_AMAX, n)), 0,
               R * H * (3.0 * a + 1 + (double)f / FP8_BLOCK), 0);
        BENCH_FREE_ALL(b, q, qs, n);
    }
    if (b->aims && o->swiglu_backward_fp8 && H % FP8_BLOCK == 0) { // FP8: the backward's operands in the same pass
        size_t Rt = fp8_expert_cols(R, 1), Tb = Rt / FP8_BLOCK;
        void *q = o->alloc(R * 2 * H), *qs = o->alloc(fp8_blocks(2 * H) * R * f), *qt = o->alloc(2 * H * Rt);
        void *qts = o->alloc(Tb * 2 * H * f), *hwt = o->alloc(H * Rt), *hws = o->alloc(Tb * H * f);
        void *row_w = o->alloc(R * f), *row_dot = o->alloc(R * f);
        float *weights = moe_malloc(R * sizeof(float)); // nonzero combine weights: nonzero gradients
        for (size_t i = 0; i < R; i++) weights[i] = 0.25f + 0.125f * (float)(i % 7);
        o->upload_f32(row_w, weights, R);
        free(weights);
        size_t counts = FP8_COUNTS * sizeof(uint64_t);
        void *ng = bench_zero_buf(b, counts), *na = bench_zero_buf(b, counts);
        // dout and gu read; the gradient's rows, its token-major copy and hw's written, with their scales
        double bytes = R * H * (3.0 * a + 2) + 3.0 * H * Rt +
                       (2.0 * H / FP8_BLOCK * R + Tb * (2.0 * H + (double)H / FP8_BLOCK) + 2.0 * R) * f;
        report(b, "  with the row dots and fp8 operands (fused)", shape,
               BENCH_TIME_MS(b, 10, o->swiglu_backward_fp8(q, qs, qt, qts, row_dot, hwt, hws, x, x, row_w, NULL, 1, R,
                                                           H, FP8_SCALE_AMAX, FP8_COLS_128X128, ng, na)),
               0, bytes, 0);
        BENCH_FREE_ALL(b, q, qs, qt, qts, hwt, hws, row_w, row_dot, ng, na);
    }
    BENCH_FREE_ALL(b, x, y, w, rstd);
    ParamCounts p = model_param_counts(c);
    size_t n = (size_t)p.total;
    void *param = bench_zero_buf(b, n * f), *param_act = o->alloc(n * a), *grad = bench_zero_buf(b, n * f);
    void *m = bench_zero_buf(b, n * f), *v = bench_zero_buf(b, n * f), *norm = bench_zero_buf(b, f);
    StepInfo si = {1e-4f, 1, 0};
    void *step = o->alloc(sizeof si);
    o->upload(step, &si, sizeof si);
    AdamWArgs args = {0.9f, 0.95f, 1e-8f, 0.1f, 0};
    snprintf(shape, sizeof shape, "%.3fB parameters", n / 1e9);
    // param, m, v read and written, grad read (fp32), the bf16 copy written: 30 bytes a parameter
    report(b, "AdamW (one call, all params)", shape,
           BENCH_TIME_MS(b, 3, o->adamw_update(param, param_act, grad, m, v, n, args, step, norm)), 0, 30.0 * n, 0);
    bench_adamw_fp8(b, c, param, param_act, grad, m, v, step, norm, args);
    BENCH_FREE_ALL(b, param, param_act, grad, m, v, norm, step);
}

static double copy_gbs(Bench *b) {
    size_t bytes = b->o->stream ? (size_t)1 << 30 : (size_t)1 << 26;
    void *src = bench_zero_buf(b, bytes), *dst = b->o->alloc(bytes);
    double ms = BENCH_TIME_MS(b, 10, b->o->copy(dst, src, bytes));
    BENCH_FREE_ALL(b, src, dst);
    return 2.0 * bytes / (ms * 1e-3) / 1e9;
}

void bench_open(Bench *b, const Config *cfg) {
    *b = (Bench){setup_backend(cfg), NULL, NULL, 0, 0, !strcmp(cfg->train.device, "cuda")};
    b->e0 = b->o->event_create(), b->e1 = b->o->event_create();
    b->matmul = train_matmul_tflops(b->o), b->copy = copy_gbs(b);
}

void bench_print_sustained(double tflops, const ClockSummary *c) {
    printf("             sustained for 2 s: %.1f TFLOP/s", tflops);
    if (c->samples) printf(" (SM clock median %.0f MHz, %.0f W of %.0f)", c->sm_mhz_median, c->power_w_mean,
                           c->power_limit_w);
    printf("\n");
}

void bench_idle(const Bench *b, double seconds) {
    b->o->sync();
    struct timespec pause = {(time_t)seconds, (long)((seconds - (time_t)seconds) * 1e9)};
    nanosleep(&pause, NULL);
}

void bench_close(Bench *b) { b->o->event_free(b->e0), b->o->event_free(b->e1); }

// The kernel families, in the order they are timed, and what times each.
static const struct {
    const char *name;
    void (*bench)(Bench *, const Config *);
} FAMILIES[] = {
    {"attention", bench_attention}, {"grouped", bench_grouped}, {"dense", bench_dense}, {"memory", bench_memory_bound}};
enum { N_FAMILIES = sizeof FAMILIES / sizeof FAMILIES[0] };

unsigned bench_kernel_families(const char *list) {
    if (!list) return (1u << N_FAMILIES) - 1;
    unsigned mask = 0;
    for (const char *p = list;; p++) {
        size_t n = strcspn(p, ",");
        int f = 0;
        while (f < N_FAMILIES && !(strlen(FAMILIES[f].name) == n && !strncmp(p, FAMILIES[f].name, n))) f++;
        if (f == N_FAMILIES) {
            char names[64] = ""; // the families' names, from the table
            for (int g = 0; g < N_FAMILIES; g++)
                snprintf(names + strlen(names), sizeof names - strlen(names), "%s%s", g ? ", " : "", FAMILIES[g].name);
            moe_fatal("moe bench --only: '%.*s' is not a kernel family (a comma list of %s)", (int)n, p, names);
        }
        mask |= 1u << f;
        p += n;
        if (!*p) return mask;
    }
}

void bench_kernels(const Config *cfg, unsigned families) {
    setvbuf(stdout, NULL, _IOLBF, 0); // each line out as soon as it is measured
    Bench b;
    bench_open(&b, cfg);
    printf("ceilings     matrix product %.1f TFLOP/s (large square product, random values), copy %.0f GB/s (read + write)\n",
           b.matmul, b.copy);
    ClockSummary held;
    if (b.o->device_clocks) { // where the rates below fall at the power limit, as in a training step
        bench_print_sustained(train_matmul_tflops_sustained(b.o, b.matmul, 2.0, &held), &held);
        bench_idle(&b, 1.0);
    }
    printf("  %-30s %-26s %12s %16s %6s  %s\n", "kernel", "shape", "time", "rate", "of ceil", "aim");
    DeviceMonitor *clocks = device_monitor_start(b.o, 10);
    for (int f = 0; f < N_FAMILIES; f++)
        if (families >> f & 1) FAMILIES[f].bench(&b, cfg);
    ClockSummary summary;
    device_monitor_stop(clocks, &summary);
    clock_summary_print("while these were timed (a training step runs at its own: moe bench prints it)", &summary);
    bench_close(&b);
}

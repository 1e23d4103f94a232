// `moe bench --calibrate OUT.json [CONFIG]`: the calibration file of `moe plan` (plan/calib.h),
// measured on this backend. Each kernel family is timed at three token counts of the config's
// shapes (a sixteenth, a quarter and all of train.micro_batch x train.seq_len); the work of each
// timed call (FLOPs or bytes, and its problem size) is what the costing backend reports for the
// same call, so the rates mean exactly what the planner multiplies them by. The FP8 recipe's
// families are measured on every backend that has its kernels (train.precision need not be fp8);
// on one without them (the CUDA backend off Hopper) they are written as the bf16 families they
// replace (calib_fill_fallbacks). On several ranks (mpirun) the communication rates are measured
// too; rank 0 writes the file.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "cli.h"
#include "dist/comm_nccl.h"
#include "ops/cost_ops.h"
#include "plan/calib.h"
#include "train/setup.h"

// What the calls of one family at one token count did: their work, seconds and sizes.
typedef struct {
    double work, seconds, log_size; // log_size: work-weighted sum of log(size)
} LevelSum;

typedef struct {
    Bench b;
    const Ops *cost;   // the costing backend: reports what each call does
    CostSink sink;
    KernelFamily family;
    double work, size; // of the call being reported
    int reps;          // timed calls at least
    double sustain_ms; // and as many more as fill this much time back to back (the clocks of a busy GPU)
    Fp8Scaling fp8_how; // the scales of the config's FP8 recipe
    LevelSum level[KERNEL_N_FAMILIES];
    Calib cal;
} Calibration;

static void record_work(void *ctx, KernelFamily f, double work, double size, double bytes) {
    Calibration *c = ctx;
    MOE_ASSERT(c->work == 0 || c->family == f); // one family per measured call
    c->family = f, c->work += work, c->size = size;
}

static void record_push(void *ctx, double bytes) {}

static void calibrate_record(Calibration *c, double ms) {
    LevelSum *l = &c->level[c->family];
    if (c->work > 0 && ms > 0) l->work += c->work, l->seconds += ms * 1e-3, l->log_size += c->work * log(c->size);
    c->work = 0;
}

// One point per family for the calls of a token count: their summed work over their summed time
// (the mix of kernels a step runs at that size), at their work-weighted mean size.
static void calibrate_level_done(Calibration *c) {
    for (int f = 0; f < KERNEL_N_FAMILIES; f++) {
        LevelSum *l = &c->level[f];
        if (l->work > 0) calib_add_point(&c->cal, (KernelFamily)f, exp(l->log_size / l->work), l->work / l->seconds);
        *l = (LevelSum){0};
    }
}

// Repetitions of a call of est_ms that fill c->sustain_ms (at least c->reps, at most 5000).
static int sustained_reps(const Calibration *c, double est_ms) {
    double n = est_ms > 0 ? ceil(c->sustain_ms / est_ms) : c->reps;
    return n < c->reps ? c->reps : n > 5000 ? 5000 : (int)n;
}

// Times `call` (an expression using `o`) on the backend, repeated back to back for c->sustain_ms
// (a GPU in a training step runs at the clocks of sustained load, not those of a short burst),
// then reports it on the costing backend.
#define CALIBRATE(c, call)                                                                       \
    do {                                                                                         \
        const Ops *o = (c)->b.o;                                                                 \
        double ms_ = (c)->sustain_ms > 0 ? BENCH_TIME_MS(&(c)->b, 2, call) : 0;                  \
        ms_ = BENCH_TIME_MS(&(c)->b, sustained_reps(c, ms_), call);                              \
        o = (c)->cost;                                                                           \
        call;                                                                                    \
        calibrate_record(c, ms_);                                                                \
    } while (0)

// The dense products (N, K) of the model's shapes: QKV projection, output projection, LM head (last:
// the one that never runs in FP8).
enum { DENSE_SHAPES = 3 };
static void dense_shapes(const ModelConfig *m, size_t shapes[DENSE_SHAPES][2]) {
    size_t D = (size_t)m->d_model, s[DENSE_SHAPES][2] = {{model_qkv_width(m), D}, {D, (size_t)m->n_heads * m->head_dim},
                                                         {(size_t)m->vocab_size, D}};
    memcpy(shapes, s, sizeof s);
}

static void measure_dense(Calibration *c, const ModelConfig *m, size_t T) {
    size_t shapes[DENSE_SHAPES][2];
    dense_shapes(m, shapes);
    for (int s = 0; s < DENSE_SHAPES; s++) {
        size_t N = shapes[s][0], K = shapes[s][1];
        Bench *b = &c->b;
        void *x = bench_rand_act(b, T * K, 31, 1), *w = bench_rand_act(b, N * K, 32, 0.02f);
        void *dy = bench_rand_act(b, T * N, 33, 1), *y = b->o->alloc(T * N * b->o->act_size);
        void *dx = b->o->alloc(T * K * b->o->act_size), *dw = bench_zero_buf(b, N * K * b->o->f32_size);
        CALIBRATE(c, o->matmul_forward(y, x, w, T, N, K, false));
        CALIBRATE(c, o->matmul_backward(dx, dw, dy, x, w, T, N, K, false));
        BENCH_FREE_ALL(b, x, w, dy, y, dx, dw);
    }
}

// The backend's row offsets (E + 1) of T tokens' top-k rows spread evenly over the experts, with the
// costing backend charging grouped kernels that many rows (free them with the backend's free).
static int32_t *balanced_offsets(Calibration *c, const ModelConfig *m, size_t T) {
    size_t E = (size_t)m->n_experts, bytes = (E + 1) * sizeof(int32_t);
    int32_t *off = moe_malloc(bytes), *doff = c->b.o->alloc(bytes);
    bench_expert_rows("balanced", T, (size_t)m->top_k, E, off);
    c->b.o->upload(doff, off, bytes);
    free(off);
    c->sink.routed_rows = T * (size_t)m->top_k;
    return doff;
}

// Both expert products (up+gate, down) forward, input and weight gradient, balanced loads.
static void measure_grouped(Calibration *c, const ModelConfig *m, size_t T) {
    size_t E = (size_t)m->n_experts, R = T * (size_t)m->top_k, D = (size_t)m->d_model, H = (size_t)m->expert_hidden;
    size_t shapes[2][2] = {{2 * H, D}, {D, H}};
    Bench *b = &c->b;
    int32_t *doff = balanced_offsets(c, m, T);
    for (int s = 0; s < 2; s++) {
        size_t N = shapes[s][0], Kd = shapes[s][1];
        void *x = bench_rand_act(b, R * Kd, 21, 1), *w = bench_rand_act(b, E * N * Kd, 22, 0.02f);
        void *dy = bench_rand_act(b, R * N, 23, 1), *y = b->o->alloc(R * N * b->o->act_size);
        void *dx = b->o->alloc(R * Kd * b->o->act_size), *dw = bench_zero_buf(b, E * N * Kd * b->o->f32_size);
        CALIBRATE(c, o->grouped_matmul_forward(y, x, w, doff, E, N, Kd, R));
        CALIBRATE(c, o->grouped_matmul_backward(dx, NULL, dy, x, w, doff, E, N, Kd, R, false));
        CALIBRATE(c, o->grouped_matmul_backward(NULL, dw, dy, x, w, doff, E, N, Kd, R, false)); // a step's first write
        BENCH_FREE_ALL(b, x, w, dy, y, dx, dw);
    }
    b->o->free(doff);
}

// An FP8 product out (R, N) = a (R, K) . b[e] (N, K)^T per group of off, or with off NULL
// fp8_matmul's one group of all R rows (a dense layer's), as the model runs them.
static void fp8_product(const Ops *o, void *out, const void *a, const void *as, const void *b, const void *bs,
                        const int32_t *off, size_t E, size_t N, size_t K, size_t R) {
    if (off) o->fp8_grouped_matmul(out, a, as, b, bs, off, E, N, K, R);
    else o->fp8_matmul(out, a, as, b, bs, R, N, K);
}

// An FP8 linear layer w (E, N, K) on R rows in the groups of off (NULL: one group, a dense layer's)
// with the ops the model runs: the weights' two copies (once a step); x's rows and token-major copy
// from one read, the forward; dy's likewise, the input gradient; the rows of dy and the copy of x
// alone (a backward that makes one without the other); the weight gradient.
static void measure_fp8_layer(Calibration *c, const int32_t *off, size_t E, size_t N, size_t K, size_t R) {
    Bench *b = &c->b;
    Fp8Scaling h = c->fp8_how;
    BenchFp8 q;
    bench_fp8_alloc(b, &q, E, N, K, R);
    void *x = bench_rand_act(b, R * K, 51, 1), *w = bench_rand_act(b, E * N * K, 52, 0.02f);
    void *dy = bench_rand_act(b, R * N, 53, 1), *y = b->o->alloc(R * N * b->o->act_size);
    void *dx = b->o->alloc(R * K * b->o->act_size), *dw = bench_zero_buf(b, E * N * K * b->o->f32_size);
    CALIBRATE(c, o->fp8_quantize_weights(q.wq, q.ws, q.wst, w, E, N, K, h, NULL));
    CALIBRATE(c, o->fp8_transpose_codes(q.wqt, q.wq, E, N, K));
    CALIBRATE(c, o->fp8_quantize_rows_cols(q.xq, q.xs, q.xt, q.xts, x, NULL, off, E, R, K, h, FP8_COLS_1X128, NULL));
    CALIBRATE(c, fp8_product(o, y, q.xq, q.xs, q.wq, q.ws, off, E, N, K, R));
    CALIBRATE(c,
              o->fp8_quantize_rows_cols(q.dyq, q.dys, q.dyt, q.dyts, dy, NULL, off, E, R, N, h, FP8_COLS_1X128, NULL));
    CALIBRATE(c, fp8_product(o, dx, q.dyq, q.dys, q.wqt, q.wst, off, E, K, N, R));
    CALIBRATE(c, o->fp8_quantize_rows(q.dyq, q.dys, dy, off, E, R, N, h, NULL));
    // the weight gradient with x in 1x128 blocks (KERNEL_FP8_GROUPED_WGRAD; in 128x128 blocks it runs
    // the forward's loop and is priced at KERNEL_FP8_GROUPED's rate, ops/cost_ops.c)
    CALIBRATE(c, o->fp8_quantize_cols(q.xt, q.xts, x, off, E, R, K, h, FP8_COLS_1X128, NULL));
    CALIBRATE(c, o->fp8_grouped_matmul_wgrad(dw, q.dyt, q.dyts, q.xt, q.xts, FP8_COLS_1X128, off, E, N, K, R, false));
    bench_fp8_free(b, &q);
    BENCH_FREE_ALL(b, x, w, dy, y, dx, dw);
}

// The FP8 recipe's kernels: both expert layers (balanced loads) and SwiGLU with its quantised
// output between them, the dense products but the LM head (train.fp8_dense).
static void measure_fp8(Calibration *c, const ModelConfig *m, size_t T) {
    size_t E = (size_t)m->n_experts, R = T * (size_t)m->top_k, D = (size_t)m->d_model, H = (size_t)m->expert_hidden;
    size_t f = c->b.o->f32_size, dense[DENSE_SHAPES][2];
    Bench *b = &c->b;
    int32_t *doff = balanced_offsets(c, m, T);
    measure_fp8_layer(c, doff, E, 2 * H, D, R);
    measure_fp8_layer(c, doff, E, D, H, R);
    void *gu = bench_rand_act(b, R * 2 * H, 54, 1), *act = b->o->alloc(R * H * b->o->act_size);
    void *q = b->o->alloc(R * H), *qs = b->o->alloc(fp8_blocks(H) * R * f);
    CALIBRATE(c, o->swiglu_forward_fp8(act, q, qs, gu, doff, E, R, H, c->fp8_how, NULL));
    BENCH_FREE_ALL(b, gu, act, q, qs, doff);
    dense_shapes(m, dense);
    for (int s = 0; s < DENSE_SHAPES - 1; s++) measure_fp8_layer(c, NULL, 1, dense[s][0], dense[s][1], T);
}

// Attention and the QK-norm + RoPE passes on T tokens (sequences of seq_len, or one of T).
static void measure_attention(Calibration *c, const ModelConfig *m, size_t T, size_t S) {
    S = S < T ? S : T;
    AttnDims d = {T / S, S, (size_t)m->n_heads, (size_t)m->n_kv_heads, (size_t)m->head_dim};
    size_t n = d.B * d.S, C = model_qkv_width(m), Dq = d.Hq * d.hd, f = c->b.o->f32_size;
    Bench *b = &c->b;
    void *raw = bench_rand_act(b, n * C, 11, 1), *qkv = bench_rand_act(b, n * C, 12, 1), *dout = bench_rand_act(b, n * Dq, 13, 1);
    void *out = b->o->alloc(n * Dq * b->o->act_size), *dqkv = bench_rand_act(b, n * C, 16, 1);
    void *lse = b->o->alloc(d.B * d.Hq * d.S * f), *rstd = b->o->alloc(n * (d.Hq + d.Hkv) * f);
    void *wq = bench_rand_act(b, Dq, 14, 1), *wk = bench_rand_act(b, d.Hkv * d.hd, 15, 1);
    void *rope = bench_zero_buf(b, d.S * d.hd * f), *dwq = bench_zero_buf(b, Dq * f), *dwk = bench_zero_buf(b, d.Hkv * d.hd * f);
    CALIBRATE(c, o->attention_forward(out, lse, qkv, d));
    CALIBRATE(c, o->attention_backward(dqkv, dout, qkv, out, lse, d));
    CALIBRATE(c, o->qkv_norm_rope_forward(qkv, rstd, raw, wq, wk, rope, d, m->qk_norm, 1e-5f));
    CALIBRATE(c, o->qkv_norm_rope_backward(dqkv, dwq, dwk, dqkv, raw, wq, wk, rstd, rope, d, m->qk_norm)); // in place
    BENCH_FREE_ALL(b, raw, qkv, dout, out, dqkv, lse, rstd, wq, wk, rope, dwq, dwk);
}

// Norms, adds, SwiGLU (elementwise) and the router, dispatch and combine (routing).
static void measure_memory_bound(Calibration *c, const ModelConfig *m, size_t T) {
    size_t D = (size_t)m->d_model, E = (size_t)m->n_experts, K = (size_t)m->top_k, H = (size_t)m->expert_hidden;
    size_t R = T * K, f = c->b.o->f32_size, a = c->b.o->act_size;
    size_t rows = R * 2 * H > T * D ? R * 2 * H : T * D; // elements of x and y: every call's operand fits
    Bench *b = &c->b;
    void *x = bench_rand_act(b, rows, 41, 1), *y = b->o->alloc(rows * a), *w = bench_rand_act(b, D, 42, 1);
    void *rstd = b->o->alloc(T * f), *dw = bench_zero_buf(b, D * f), *logits = bench_rand_act(b, T * E, 43, 1);
    void *scores = b->o->alloc(T * E * f), *topw = b->o->alloc(R * f), *aux = bench_zero_buf(b, (2 * E + 1) * f);
    void *stats = bench_zero_buf(b, (E + 3) * f), *xp = b->o->alloc(R * D * a), *step = bench_zero_buf(b, sizeof(StepInfo));
    int32_t *idx = b->o->alloc(R * 4), *counts = b->o->alloc(E * 4), *offsets = b->o->alloc((E + 1) * 4), *pos = b->o->alloc(R * 4);
    RouterArgs ra = {.T = T, .E = E, .K = K, .T_global = T, .kind = m->router};
    CALIBRATE(c, o->rmsnorm_forward(y, rstd, x, w, T, D, 1e-5f));
    CALIBRATE(c, o->rmsnorm_backward(y, dw, x, x, w, rstd, T, D, false));
    CALIBRATE(c, o->add(y, x, x, T * D));
    CALIBRATE(c, o->swiglu_forward(y, x, R, H, NULL, 0));
    CALIBRATE(c, o->swiglu_backward(y, NULL, NULL, x, x, NULL, R, H, NULL, 0));
    CALIBRATE(c, o->router_forward(scores, idx, topw, counts, aux, logits, NULL, step, ra));
    CALIBRATE(c, o->moe_dispatch_forward(xp, pos, offsets, stats, x, idx, counts, T, K, E, D, 0));
    CALIBRATE(c, o->moe_combine_forward(y, NULL, xp, pos, topw, T, K, D));
    CALIBRATE(c, o->moe_dispatch_backward(y, xp, pos, T, K, D, false));
    BENCH_FREE_ALL(b, x, y, w, rstd, dw, logits, scores, topw, aux, stats, xp, step, idx, counts, offsets, pos);
}

static void measure_optimizer(Calibration *c, size_t n) {
    Bench *b = &c->b;
    size_t f = b->o->f32_size;
    void *p = bench_zero_buf(b, n * f), *pa = b->o->act_aliases_f32 ? NULL : b->o->alloc(n * b->o->act_size);
    void *g = bench_zero_buf(b, n * f), *m = bench_zero_buf(b, n * f), *v = bench_zero_buf(b, n * f);
    void *norm = bench_zero_buf(b, f), *step = b->o->alloc(sizeof(StepInfo));
    StepInfo si = {1e-4f, 1, 0};
    b->o->upload(step, &si, sizeof si);
    AdamWArgs args = {0.9f, 0.95f, 1e-8f, 0.1f, 0};
    CALIBRATE(c, o->adamw_update(p, pa, g, m, v, n, args, step, norm));
    CALIBRATE(c, o->sum_squares(norm, g, n));
    BENCH_FREE_ALL(b, p, g, m, v, norm, step);
    if (pa) b->o->free(pa);
}

// ---------------------------------------------------------------- communication (several ranks)

// Seconds per call of `call`, the mean over the ranks.
#define COMM_SECONDS(c, w, call)                                                                 \
    ({                                                                                           \
        double ms_ = BENCH_TIME_MS(&(c)->b, (c)->reps, call);                                    \
        float sum_ = (float)ms_;                                                                 \
        void *buf_ = bench_zero_buf(&(c)->b, (c)->b.o->f32_size);                                \
        (c)->b.o->upload_f32(buf_, &sum_, 1);                                                    \
        (w)->ops->all_reduce_sum(w, buf_, 1, COMM_F32);                                          \
        (c)->b.o->download_f32(&sum_, buf_, 1);                                                  \
        (c)->b.o->free(buf_);                                                                    \
        sum_ / (w)->size * 1e-3;                                                                 \
    })

static void measure_comm(Calibration *c, Comm *w, size_t bytes) {
    const Ops *o = c->b.o;
    int p = w->size, peer = w->rank ^ 1;
    size_t n = bytes / o->f32_size / (size_t)p * (size_t)p, per = n / (size_t)p;
    void *send = bench_zero_buf(&c->b, n * o->f32_size), *recv = bench_zero_buf(&c->b, n * o->f32_size);
    size_t *counts = moe_malloc((size_t)p * sizeof(size_t));
    for (int r = 0; r < p; r++) counts[r] = per;
    double ring = (double)(p - 1) / p * (double)n * o->f32_size;
    c->cal.latency_s = COMM_SECONDS(c, w, w->ops->all_reduce_sum(w, send, 1, COMM_F32));
    c->cal.collective_bps = ring / COMM_SECONDS(c, w, w->ops->reduce_scatter_sum(w, send, recv, per, COMM_F32));
    c->cal.exchange_bps = ring / COMM_SECONDS(c, w, w->ops->all_to_all_v(w, send, counts, recv, counts, COMM_F32));
    if (peer < p)
        c->cal.p2p_bps = (double)n * o->f32_size /
                         COMM_SECONDS(c, w, w->ops->sendrecv(w, send, n, peer, recv, n, peer, COMM_F32));
    else c->cal.p2p_bps = c->cal.exchange_bps; // an odd last rank has no partner: the exchange rate
    c->cal.has_comm = true;
    snprintf(c->cal.comm_from, sizeof c->cal.comm_from, "moe bench --calibrate on %d ranks, %.0f MB buffers: "
             "latency = a one-element all-reduce; collective = reduce-scatter bus rate; exchange = all-to-all-v; "
             "p2p = sendrecv between rank pairs; grad_reduce_hidden not measured (0)", p, bytes / 1e6);
    BENCH_FREE_ALL(&c->b, send, recv);
    free(counts);
}

// ---------------------------------------------------------------- the file

// This process's resident memory (the CPU's runtime beside the plan), or the device's in use.
static double runtime_bytes(const Ops *o) {
    if (o->memory_in_use && o->memory_in_use()) return (double)o->memory_in_use();
    long pages = 0, resident = 0;
    FILE *f = fopen("/proc/self/statm", "r");
    if (f && fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    if (f) fclose(f);
    return (double)resident * 4096;
}

static void print_calibration(const Calib *c, const char *out) {
    printf("calibration %s (%s, %s):\n", out, c->device, c->backend);
    for (int f = 0; f < KERNEL_N_FAMILIES; f++) {
        const CalibCurve *k = &c->family[f];
        bool matrix = kernel_family_is_matrix((KernelFamily)f);
        printf("  %-17s", KERNEL_FAMILY_NAMES[f]);
        for (int i = 0; i < k->n; i++)
            printf(" %.3g%s: %.4g", k->size[i], matrix ? " FLOP" : " B", k->rate[i] / (matrix ? 1e12 : 1e9));
        printf(" %s%s%s\n", matrix ? "TFLOP/s" : "GB/s", k->fallback ? "; " : "", k->fallback ? k->from : "");
    }
    if (c->has_comm)
        printf("  comm: latency %.1f us, collective %.1f GB/s, exchange %.1f GB/s, p2p %.1f GB/s\n", c->latency_s * 1e6,
               c->collective_bps / 1e9, c->exchange_bps / 1e9, c->p2p_bps / 1e9);
    printf("  copy %.1f GB/s, runtime memory %.3f GiB\n", c->copy_bps / 1e9, c->runtime_bytes / 1073741824.0);
}

void bench_calibrate(const Config *cfg, Comm *world, const char *device, const char *out) {
    bool gpu = !strcmp(cfg->train.device, "cuda");
    Calibration c = {.reps = gpu ? 10 : 2, .sustain_ms = gpu ? 200 : 0, .fp8_how = setup_model_modes(cfg).how};
    double start_rss = runtime_bytes(ops_cpu());
    bench_open(&c.b, cfg);
    c.sink = (CostSink){.kernel = record_work, .push_rows = record_push, .ctx = &c};
    c.cost = ops_costing(c.b.o->act_size == 2, &c.sink);
    snprintf(c.cal.device, sizeof c.cal.device, "%s", device);
    snprintf(c.cal.backend, sizeof c.cal.backend, "%s", cfg->train.device);
    snprintf(c.cal.source, sizeof c.cal.source, "measured by moe bench --calibrate on the shapes of d_model %d, %d "
             "experts top-%d, hidden %d, sequences of %d", cfg->model.d_model, cfg->model.n_experts, cfg->model.top_k,
             cfg->model.expert_hidden, cfg->train.seq_len);
    c.cal.copy_bps = c.b.copy * 1e9, c.cal.kernel_overhead_s = 0;
    const ModelConfig *m = &cfg->model;
    size_t T = (size_t)cfg->train.micro_batch * cfg->train.seq_len, params = (size_t)model_param_counts(m).total;
    for (size_t div = 16; div >= 1; div /= 4) {
        size_t t = T / div > 0 ? T / div : 1;
        measure_dense(&c, m, t);
        measure_grouped(&c, m, t);
        if (c.b.o->fp8_grouped_matmul) measure_fp8(&c, m, t);
        measure_attention(&c, m, t, (size_t)cfg->train.seq_len);
        measure_memory_bound(&c, m, t);
        measure_optimizer(&c, params / div > 0 ? params / div : 1);
        calibrate_level_done(&c);
    }
    Comm *w = world->size > 1 && !strcmp(cfg->train.device, "cuda") ? comm_nccl_world(world, c.b.o->stream) : world;
    if (w->size > 1) measure_comm(&c, w, c.b.o->stream ? (size_t)256 << 20 : (size_t)8 << 20);
    c.cal.runtime_bytes = c.b.o->memory_in_use && c.b.o->memory_in_use() ? runtime_bytes(c.b.o) : start_rss;
    snprintf(c.cal.memory_from, sizeof c.cal.memory_from, "runtime = %s when the calibration started; communicator "
             "not measured (0)", c.b.o->stream ? "device memory in use" : "this process's resident memory");
    bench_close(&c.b);
    if (w != world) w->ops->free(w);
    calib_fill_fallbacks(&c.cal);
    MoeErr err;
    if (calib_check(&c.cal, out, err)) moe_fatal("%s", err);
    if (world->rank != 0) return;
    if (calib_save(&c.cal, out, err)) moe_fatal("%s", err);
    print_calibration(&c.cal, out);
}

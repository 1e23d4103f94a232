// Tests of the model layout and the training layer: fused parameter layout, parameter counts,
// layout-independent init, gradient accumulation over micro-batches, learning-rate schedule, step
// reports, and checkpoint save/load/prune.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "io/fsutil.h"
#include "io/safetensors.h"
#include "test.h"
#include "test_model.h"
#include "train/ckpt.h"
#include "train/metrics.h"
#include "train/optim.h"
#include "train/train.h"

static ModelConfig small_model(void) {
    ModelConfig c;
    model_config_defaults(&c);
    c.vocab_size = 17, c.d_model = 8, c.n_layers = 3, c.n_heads = 2, c.n_kv_heads = 1;
    c.n_experts = 4, c.top_k = 2, c.expert_hidden = 6, c.n_dense_layers = 1, c.dense_hidden = 12;
    c.shared_hidden = 5;
    MoeErr err;
    if (model_config_validate(&c, err)) TEST_FAIL("%s", err);
    return c;
}

static size_t offset_of(const Model *m, const char *name) {
    const ParamInfo *p = params_find(&m->reg, name);
    if (!p) TEST_FAIL("tensor %s not registered", name);
    return p ? p->offset : (size_t)-1;
}

static void test_fused_layout(void) {
    ModelConfig c = small_model();
    Parallel par;
    test_single_parallel(&par, &c);
    Model m;
    model_init(&m, &c, ops_cpu(), &par, 2, 4, 1, 1, (ModelModes){0});
    size_t D = 8, hd = 4, H = 6;
    CHECK(offset_of(&m, "model.layers.1.self_attn.k_proj.weight") ==
          offset_of(&m, "model.layers.1.self_attn.q_proj.weight") + 2 * hd * D);
    CHECK(offset_of(&m, "model.layers.1.self_attn.v_proj.weight") ==
          offset_of(&m, "model.layers.1.self_attn.k_proj.weight") + hd * D);
    for (int e = 0; e < 4; e++) {
        char gate[96], up[96], down[96];
        snprintf(gate, sizeof gate, "model.layers.2.mlp.experts.%d.gate_proj.weight", e);
        snprintf(up, sizeof up, "model.layers.2.mlp.experts.%d.up_proj.weight", e);
        snprintf(down, sizeof down, "model.layers.2.mlp.experts.%d.down_proj.weight", e);
        CHECK(offset_of(&m, gate) == m.layer[2].experts_gu + e * 2 * H * D);
        CHECK(offset_of(&m, up) == m.layer[2].experts_gu + e * 2 * H * D + H * D);
        CHECK(offset_of(&m, down) == m.layer[2].experts_down + e * D * H);
    }
    CHECK(offset_of(&m, "model.layers.0.mlp.up_proj.weight") == m.layer[0].dense_gu + 12 * D);
    CHECK(params_find(&m.reg, "model.layers.0.mlp.gate.weight") == NULL); // dense layer: no router
    CHECK(params_find(&m.reg, "model.layers.2.mlp.shared_expert.down_proj.weight") != NULL);
    ParamCounts pc = model_param_counts(&c);
    size_t held = 0;
    for (size_t i = 0; i < m.reg.n; i++) held += m.reg.p[i].numel;
    CHECK_MSG(pc.total == (double)held, "counted %.0f parameters, registry holds %zu", pc.total, held);
    const ParamInfo *norm = params_find(&m.reg, "model.norm.weight"), *emb = params_find(&m.reg, "model.embed_tokens.weight");
    CHECK(norm && !norm->decay && norm->ones && emb && !emb->decay);
    CHECK(params_find(&m.reg, "lm_head.weight")->decay);
    // every dense tensor precedes every expert tensor: two regions to shard
    CHECK(m.reg.region_begin[PARAM_EXPERT] >= offset_of(&m, "lm_head.weight") + 17 * 8);
    CHECK(m.layer[1].experts_gu == m.reg.region_begin[PARAM_EXPERT]);
    model_free(&m);
    test_free_parallel(&par);
}

// Sizing on ops_counting_like(backend) counts what the backend allocates, byte for byte; a compute
// copy apart from the master weights (ops_cpu_sharded) is one more buffer of every parameter.
static void test_memory_plan_exact(void) {
    ModelConfig c = small_model();
    const Ops *backends[2] = {ops_cpu(), ops_cpu_sharded()};
    size_t bytes[2], P = 0;
    for (int i = 0; i < 2; i++) {
        Parallel par;
        test_single_parallel(&par, &c);
        Model real_m, plan_m;
        model_init(&real_m, &c, backends[i], &par, 2, 4, 1, 1, (ModelModes){0});
        model_init(&plan_m, &c, ops_counting_like(backends[i]), &par, 2, 4, 1, 1, (ModelModes){0});
        bytes[i] = real_m.mem.bytes, P = real_m.reg.total;
        CHECK_MSG(plan_m.mem.bytes == real_m.mem.bytes, "%s: plan %zu bytes, allocated %zu", backends[i]->name,
                  plan_m.mem.bytes, real_m.mem.bytes);
        CHECK_MSG(real_m.master_len == P, "%s: one process holds every master weight (%zu of %zu)", backends[i]->name,
                  real_m.master_len, P);
        model_free(&real_m), model_free(&plan_m);
        test_free_parallel(&par);
    }
    CHECK_MSG(bytes[1] - bytes[0] == P * sizeof(real), "the compute copy takes %zu bytes, not %zu",
              bytes[1] - bytes[0], P * sizeof(real));
}

// The same tensor gets the same values whatever else is registered (any layout, any rank).
static void test_init_independent_of_layout(void) {
    ParamInfo a = {.name = "model.layers.3.mlp.experts.7.up_proj.weight", .numel = 50, .offset = 0};
    ParamInfo b = a;
    b.offset = 12345;
    float va[50], vb[50];
    params_init_values(&a, 9, 0.02, va);
    params_init_values(&b, 9, 0.02, vb);
    CHECK(!memcmp(va, vb, sizeof va));
    double mx = 0;
    for (int i = 0; i < 50; i++) mx = fabs(va[i]) > mx ? fabs(va[i]) : mx;
    CHECK_MSG(mx <= 0.06 + 1e-7 && mx > 0, "init magnitude %g outside the 3-sigma truncation", mx);
}

// The backends' init op is params_init_values computed in place: bitwise, for a whole tensor and for
// ranges of it (a shard from an odd element on), writing nothing past its n elements; norms get ones.
static void test_init_op_matches_values(void) {
    const Ops *o = ops_cpu();
    enum { ROWS = 37, COLS = 29, N = ROWS * COLS };
    ParamInfo p = {.name = "model.layers.1.self_attn.q_proj.weight", .ndim = 2, .shape = {ROWS, COLS}, .numel = N};
    float want[N];
    params_init_values(&p, 4, 0.02, want);
    real *got = o->alloc((N + 1) * o->f32_size);
    const size_t ranges[4][2] = {{0, N}, {331, 500}, {N - 1, 1}, {7, 0}}; // first element, count
    for (int r = 0; r < 4; r++) {
        size_t begin = ranges[r][0], n = ranges[r][1], bad = 0;
        for (size_t i = 0; i <= N; i++) got[i] = NAN;
        o->init_params(got, n, params_init_key(&p, 4), begin, 0.02, false);
        for (size_t i = 0; i < n; i++) bad += (float)got[i] != want[begin + i];
        CHECK_MSG(!bad, "elements [%zu, %zu): %zu differ from params_init_values", begin, begin + n, bad);
        CHECK_MSG(isnan(got[n]), "element %zu past the range was written", n);
    }
    o->init_params(got, N, params_init_key(&p, 5), 0, 0.02, false);
    CHECK_MSG((float)got[0] != want[0] && (float)got[1] != want[1], "another seed gave the same values");
    p.ones = true;
    params_init_values(&p, 4, 0.02, want);
    o->init_params(got, N, params_init_key(&p, 4), 0, 0.02, true);
    for (size_t i = 0; i < N; i++) CHECK_MSG(want[i] == 1 && got[i] == 1, "norm weight %zu: %g, %g", i, want[i], (double)got[i]);
    o->free(got);
}

// Two micro-batches of one sequence accumulate the same gradient as one batch of two (CE only:
// the router aux losses are defined per micro-batch).
static void test_micro_batch_accumulation(void) {
    ModelConfig c = small_model();
    c.lb_coef = c.z_coef = 0;
    size_t S = 5, P;
    int32_t seqs[2 * 6];
    for (int i = 0; i < 12; i++) seqs[i] = (int32_t)(rng_hash64(5, (uint64_t)i) % 17);
    Parallel par;
    test_single_parallel(&par, &c);
    Model one, two;
    model_init(&one, &c, ops_cpu(), &par, 2, S, 1, 1, (ModelModes){0});
    model_init(&two, &c, ops_cpu(), &par, 2, S, 1, 1, (ModelModes){0});
    model_init_weights(&one, 3);
    model_init_weights(&two, 3);
    P = one.reg.total;
    real *metrics = calloc(model_metrics_len(&c), sizeof(real));
    LossScales sc = {.ce = 1.0f / (2 * S)};
    ForwardArgs a = {.B = 2, .S = S, .train = true, .scales = sc, .metrics = metrics};
    memset(one.grads, 0, P * sizeof(real));
    model_set_batch(&one, 0, seqs, 2, S);
    model_forward(&one, &a);
    model_backward(&one, &a);
    memset(two.grads, 0, P * sizeof(real));
    for (int b = 0; b < 2; b++) {
        ForwardArgs a1 = {.B = 1, .S = S, .train = true, .scales = sc, .metrics = metrics, .token_base = (uint64_t)b * S};
        model_set_batch(&two, 0, seqs + b * (S + 1), 1, S);
        model_forward(&two, &a1);
        model_backward(&two, &a1);
    }
    double *g1 = malloc(P * sizeof(double)), *g2 = malloc(P * sizeof(double));
    for (size_t i = 0; i < P; i++) g1[i] = ((real *)one.grads)[i], g2[i] = ((real *)two.grads)[i];
    test_check_arrays("micro-batch gradients", g2, g1, P, 1e-10, 1e-13);
    free(g1), free(g2), free(metrics);
    model_free(&one);
    model_free(&two);
    test_free_parallel(&par);
}

// How a test step runs its products in FP8 (NULL: all in act precision): the expert products with
// scaling `how`, the dense linear layers' too or not, the experts' operands read from the tokens'
// rows or not (train.fp8_fused_dispatch), the experts' SwiGLU backward making the FP8 operands or
// not (train.fp8_fused_swiglu), the optimizer's update making the experts' FP8 copies or not
// (train.fp8_fused_update), and with the dense layers in FP8 the attention's QKV or output
// projection in act precision all the same (train.fp8_dense_qkv, _out = false), or QKV's forward
// product alone (train.fp8_qkv_forward = false).
typedef struct {
    Fp8Scaling how;
    bool dense, fused, swiglu, wgrad_blocks, update, act_qkv, act_out, act_qkv_forward;
} TestFp8;

// What a test model of recompute mode r with products as *fp8 says (NULL: act precision) allocates.
static ModelModes test_modes(Recompute r, const TestFp8 *fp8) {
    return fp8 ? (ModelModes){.recompute = r, .fp8 = true, .how = fp8->how, .fp8_dense = fp8->dense,
                              .fp8_fused_dispatch = fp8->fused, .fp8_fused_swiglu = fp8->swiglu,
                              .fp8_wgrad_blocks = fp8->wgrad_blocks, .fp8_fused_update = fp8->update,
                              .fp8_act_qkv = fp8->act_qkv, .fp8_act_out = fp8->act_out,
                              .fp8_act_qkv_forward = fp8->act_qkv_forward}
               : (ModelModes){.recompute = r};
}

// The parameter count (*P) and metrics length (*len) of a model of config c.
static void model_sizes(const ModelConfig *c, size_t *P, size_t *len) {
    Model sizing;
    Parallel par;
    test_single_parallel(&par, c);
    model_init(&sizing, c, ops_counting(false), &par, 1, 1, 1, 1, (ModelModes){0});
    *P = sizing.reg.total, *len = model_metrics_len(c);
    model_free(&sizing);
    test_free_parallel(&par);
}

// One step's forward and backward of two micro-batches in flight (two slots: both forwards, then
// both backwards, as a pipeline stage runs them) under a recompute mode, with products in FP8 as
// *fp8 says: the gradients and the metrics (losses, loads, drops) into grads (P) and metrics, what
// the step's quantisations counted into counts (MODEL_FP8_COUNTS; NULL: not wanted), the
// activation bytes returned.
static size_t recompute_step(const ModelConfig *c, Recompute mode, const TestFp8 *fp8, real *grads, real *metrics,
                             uint64_t *counts) {
    size_t B = 2, S = 6, T = B * S;
    Parallel par;
    test_single_parallel(&par, c);
    Model m;
    model_init(&m, c, ops_cpu(), &par, B, S, 2, 2, test_modes(mode, fp8));
    model_init_weights(&m, 3);
    for (int i = 0; i < c->n_layers * c->n_experts; i++) ((real *)m.expert_bias)[i] = (real)(0.01 * (i % 5));
    StepInfo info = {.lr = 1e-3f, .step = 1, .seed = 11};
    m.ops->upload(m.step_info, &info, sizeof info);
    int32_t seqs[2 * 2 * 7];
    for (int i = 0; i < 2 * 2 * 7; i++) seqs[i] = (int32_t)(rng_hash64(9, (uint64_t)i) % (uint64_t)c->vocab_size);
    LossScales sc = {.ce = 1.0f / (2 * T), .lm_z = 1e-3f / (2 * T), .lb = 0.1f, .z = 0.01f};
    ForwardArgs a[2];
    for (int j = 0; j < 2; j++) {
        model_set_batch(&m, j, seqs + j * B * (S + 1), B, S);
        a[j] = (ForwardArgs){.B = B, .S = S, .micro = j, .slot = j, .train = true, .token_base = (uint64_t)j * T,
                             .scales = sc, .metrics = metrics};
    }
    memset(metrics, 0, model_metrics_len(c) * sizeof(real));
    memset(m.grads, 0, m.reg.total * sizeof(real));
    if (fp8) memset(m.fp8->counts, 0, MODEL_FP8_COUNTS * sizeof(uint64_t));
    model_forward(&m, &a[0]), model_forward(&m, &a[1]);
    model_backward(&m, &a[0]), model_backward(&m, &a[1]);
    memcpy(grads, m.grads, m.reg.total * sizeof(real));
    if (counts) memcpy(counts, m.fp8->counts, MODEL_FP8_COUNTS * sizeof(uint64_t));
    size_t bytes = m.act_bytes;
    model_free(&m);
    test_free_parallel(&par);
    return bytes;
}

// Every recompute mode gives bitwise the gradients and metrics of keeping everything (nothing
// counted twice, the same routing), with less activation memory: selective < none, full < selective;
// so does every mode with the expert and dense products in FP8 (the dense layers' accumulating
// products included: the shared expert's down projection, and with reordered norms the input
// gradients of the QKV and gate|up projections), keeping everything with the experts' operands read
// from the tokens' rows (train.fp8_fused_dispatch; the other modes gather them).
static void test_recompute_bitwise(void) {
    ModelConfig cfgs[4];
    const char *names[4] = {"pre-norm, full qk-norm, dense first, shared expert, bias",
                            "reordered, head qk-norm, sigmoid renorm, capacity 0.5",
                            "pre-norm, no qk-norm, random routing, capacity 0.75, shared expert",
                            "reordered, full qk-norm, random routing, dense first, shared expert"};
    for (int i = 0; i < 4; i++) cfgs[i] = small_model(); // 1 dense + 2 MoE layers, shared expert
    cfgs[0].bias_gamma = 0.01;
    cfgs[1].norm_placement = NORM_REORDERED, cfgs[1].qk_norm = QK_NORM_HEAD, cfgs[1].router = ROUTER_SIGMOID;
    cfgs[1].norm_topk_prob = true, cfgs[1].capacity_factor = 0.5, cfgs[1].shared_hidden = 0;
    cfgs[1].n_dense_layers = 0;
    cfgs[2].qk_norm = QK_NORM_NONE, cfgs[2].random_routing = true, cfgs[2].capacity_factor = 0.75;
    cfgs[2].n_dense_layers = 0;
    cfgs[3].norm_placement = NORM_REORDERED, cfgs[3].random_routing = true;
    const TestFp8 fp8 = {.how = FP8_SCALE_AMAX, .dense = true, .fused = true, .swiglu = true, .wgrad_blocks = true,
                         .update = true};
    for (int i = 0; i < 4 * 2; i++) {
        const ModelConfig *c = &cfgs[i / 2];
        const char *name = names[i / 2], *precision = i % 2 ? "FP8" : "exact";
        size_t P, len;
        model_sizes(c, &P, &len);
        real *grads[3], *metrics[3];
        size_t bytes[3];
        for (int mode = 0; mode < 3; mode++) {
            grads[mode] = calloc(P, sizeof(real)), metrics[mode] = calloc(len, sizeof(real));
            bytes[mode] = recompute_step(c, (Recompute)mode, i % 2 ? &fp8 : NULL, grads[mode], metrics[mode], NULL);
        }
        for (int mode = 1; mode < 3; mode++) {
            const char *what = mode == RECOMPUTE_SELECTIVE ? "selective" : "full";
            CHECK_MSG(!memcmp(grads[mode], grads[0], P * sizeof(real)), "%s, %s: %s recompute: gradients differ from "
                      "none", name, precision, what);
            CHECK_MSG(!memcmp(metrics[mode], metrics[0], len * sizeof(real)),
                      "%s, %s: %s recompute: metrics (losses, loads, drops) differ from none", name, precision, what);
            CHECK_MSG(bytes[mode] < bytes[mode - 1], "%s, %s: %s recompute keeps %zu activation bytes, not fewer than "
                      "%zu", name, precision, what, bytes[mode], bytes[mode - 1]);
        }
        if (c->capacity_factor > 0) // the drops the test claims to cover happen
            CHECK_MSG(metrics[0][model_metric_router(c, 0) + router_stat_dropped((size_t)c->n_experts)] > 0,
                      "%s, %s: no slot dropped", name, precision);
        for (int mode = 0; mode < 3; mode++) free(grads[mode]), free(metrics[mode]);
    }
}

static double rel_l2(const real *got, const real *want, size_t n) {
    double d = 0, w = 0;
    for (size_t i = 0; i < n; i++) d += ((double)got[i] - want[i]) * ((double)got[i] - want[i]), w += (double)want[i] * want[i];
    return sqrt(d / w);
}

// The values the FP8 quantisations of the dense layers count in one micro-batch of T tokens, per
// class: per layer, the forward's rows of the inputs of QKV (T, D), the output projection (T, Hq hd)
// and the MLP's gate|up (T, D) and down (T, H) projections, and the backward's token-major copies of
// the same (activations); the backward's rows of their output gradients (T, C), (T, D), (T, 2H),
// (T, D) and token-major copies of the same (gradients). H: the dense or shared MLP's hidden width.
// Without QKV or the output projection (fp8->act_qkv, act_out) where those run in act precision,
// without QKV's input's rows where its forward alone does (act_qkv_forward).
static void dense_fp8_values(const ModelConfig *c, size_t T, const TestFp8 *fp8, uint64_t *activations,
                             uint64_t *gradients) {
    size_t D = (size_t)c->d_model, C = model_qkv_width(c), Dq = (size_t)c->n_heads * c->head_dim;
    size_t qkv_in = fp8->act_qkv ? 0 : fp8->act_qkv_forward ? 1 : 2; // copies of QKV's input
    *activations = *gradients = 0;
    for (int l = 0; l < c->n_layers; l++) {
        size_t H = (size_t)(model_layer_is_moe(c, l) ? c->shared_hidden : c->dense_hidden);
        *activations += T * (qkv_in * D + 2 * ((fp8->act_out ? 0 : Dq) + (H ? D + H : 0)));
        *gradients += 2 * T * ((fp8->act_qkv ? 0 : C) + (fp8->act_out ? 0 : D) + (H ? 2 * H + D : 0));
    }
}

// The values of class c quantised in a run, from its counters (MODEL_FP8_COUNTS).
static unsigned long long fp8_values(const uint64_t *counts, Fp8Class c) {
    return counts[(size_t)c * FP8_COUNTS + FP8_COUNT_VALUES];
}

// The products in FP8 (the CPU emulation of train.precision = fp8): with the dense layers in FP8 or
// not, and both scalings, the loss within 0.1% of exact products' and the expert gradients within
// `tol` relative L2 (E4M3 keeps 4 significant bits: a factor's error is at most 2^-4 of it, about
// 3.6% rms, a product of two about 5%), yet they differ (the FP8 path ran); the dense layer's weight
// gradients within `tol` with the dense layers in FP8 but more than 1% off, within 1% without them.
// Full and selective recompute give them bitwise (quantisation is a pure function). The dense
// layers' quantisations add exactly their operands' values to the counters (dense_fp8_values; no
// drops here, so the experts' count the same in both), the weights none in a step. With QKV or the
// output projection in act precision (train.fp8_dense_qkv, _out = false) the counters lose exactly
// that product's operands and the gradients move (the switch took effect). With QKV's forward alone
// in act precision (train.fp8_qkv_forward = false) the loss is QKV-in-act-precision's bit for bit
// (the same forward), the gradients neither its nor FP8's (the backward in FP8), and the counters
// lose exactly the rows of QKV's input.
static void fp8_step_case(ModelConfig c, const char *config, double tol) {
    Model sizing;
    Parallel par;
    test_single_parallel(&par, &c);
    model_init(&sizing, &c, ops_counting(false), &par, 1, 1, 1, 1, (ModelModes){0});
    size_t P = sizing.reg.total, len = model_metrics_len(&c), experts = sizing.layer[2].experts_gu;
    size_t expert_len = sizing.layer[2].experts_down + (size_t)c.n_experts * c.d_model * c.expert_hidden - experts;
    size_t dense = sizing.layer[0].wqkv; // layer 0's weights, a dense layer
    size_t dense_len = sizing.layer[0].dense_down + (size_t)c.d_model * c.dense_hidden - dense;
    model_free(&sizing);
    test_free_parallel(&par);
    enum { EXACT, DENSE, DENSE_FULL, DENSE_SELECTIVE, DENSE_POW2, EXPERTS, BLOCKS, ACT_QKV, ACT_OUT, ACT_QKV_FORWARD,
           RUNS };
    const TestFp8 modes[RUNS] = {[DENSE] = {FP8_SCALE_AMAX, true}, [DENSE_FULL] = {FP8_SCALE_AMAX, true},
                                 [DENSE_SELECTIVE] = {FP8_SCALE_AMAX, true}, [DENSE_POW2] = {FP8_SCALE_POW2, true},
                                 [EXPERTS] = {FP8_SCALE_AMAX, false},
                                 [BLOCKS] = {FP8_SCALE_AMAX, true, .wgrad_blocks = true},
                                 [ACT_QKV] = {FP8_SCALE_AMAX, true, .act_qkv = true},
                                 [ACT_OUT] = {FP8_SCALE_AMAX, true, .act_out = true},
                                 [ACT_QKV_FORWARD] = {FP8_SCALE_AMAX, true, .act_qkv_forward = true}};
    const Recompute recompute[RUNS] = {[DENSE_FULL] = RECOMPUTE_FULL, [DENSE_SELECTIVE] = RECOMPUTE_SELECTIVE};
    const char *names[RUNS] = {"exact", "FP8 amax", "FP8 amax, full recompute", "FP8 amax, selective recompute",
                               "FP8 pow2", "FP8 experts only", "FP8 amax, weight gradients' inputs in 128x128 blocks",
                               "FP8 amax, QKV in act precision", "FP8 amax, output projection in act precision",
                               "FP8 amax, QKV's forward in act precision"};
    real *grads[RUNS], *metrics[RUNS];
    uint64_t counts[RUNS][MODEL_FP8_COUNTS];
    for (int i = 0; i < RUNS; i++) {
        grads[i] = calloc(P, sizeof(real)), metrics[i] = calloc(len, sizeof(real));
        bool fp8 = i != EXACT;
        recompute_step(&c, recompute[i], fp8 ? &modes[i] : NULL, grads[i], metrics[i], fp8 ? counts[i] : NULL);
    }
    for (int i = DENSE_FULL; i <= DENSE_SELECTIVE; i++)
        CHECK_MSG(!memcmp(grads[i], grads[DENSE], P * sizeof(real)) &&
                  !memcmp(metrics[i], metrics[DENSE], len * sizeof(real)),
                  "%s: %s differs from FP8 keeping everything", config, names[i]);
    CHECK_MSG(memcmp(grads[DENSE] + dense, grads[EXPERTS] + dense, dense_len * sizeof(real)),
              "%s: the dense layers' gradients are the same with the dense layers in FP8 and in act precision", config);
    // 128x128 blocks for the weight gradients' inputs: the same forward, other weight gradients.
    CHECK_MSG(memcmp(grads[BLOCKS] + dense, grads[DENSE] + dense, dense_len * sizeof(real)) &&
                  memcmp(grads[BLOCKS] + experts, grads[DENSE] + experts, expert_len * sizeof(real)) &&
                  !memcmp(metrics[BLOCKS], metrics[DENSE], len * sizeof(real)),
              "%s: 128x128 blocks for the weight gradients' inputs: another forward, or the same dense or expert "
              "weight gradients", config);
    for (int i = DENSE; i < RUNS; i++) {
        if (i == DENSE_FULL || i == DENSE_SELECTIVE) continue;
        double ce = metrics[i][METRIC_CE], ce0 = metrics[EXACT][METRIC_CE];
        double ge = rel_l2(grads[i] + experts, grads[EXACT] + experts, expert_len);
        double gd = rel_l2(grads[i] + dense, grads[EXACT] + dense, dense_len);
        CHECK_MSG(fabs(ce - ce0) <= 1e-3 * fabs(ce0) && ce != ce0, "%s: %s: loss %.6g vs exact %.6g", config, names[i], ce,
                  ce0);
        CHECK_MSG(ge < tol && ge > 0, "%s: %s: expert gradients differ from exact ones by %.3g (relative L2)",
                  config, names[i], ge);
        CHECK_MSG(modes[i].dense ? gd > 0.01 && gd < tol : gd < 0.01,
                  "%s: %s: dense-layer gradients differ from exact ones by %.3g (relative L2)", config, names[i], gd);
    }
    for (int i = ACT_QKV; i <= ACT_QKV_FORWARD; i++)
        CHECK_MSG(memcmp(grads[i], grads[DENSE], P * sizeof(real)), "%s: %s: the gradients of FP8 keeping everything",
                  config, names[i]);
    CHECK_MSG(metrics[ACT_QKV_FORWARD][METRIC_CE] == metrics[ACT_QKV][METRIC_CE] &&
                  memcmp(grads[ACT_QKV_FORWARD], grads[ACT_QKV], P * sizeof(real)),
              "%s: %s: loss %.9g against %.9g with QKV in act precision (want the same), or the same gradients",
              config, names[ACT_QKV_FORWARD], metrics[ACT_QKV_FORWARD][METRIC_CE], metrics[ACT_QKV][METRIC_CE]);
    const int counted[] = {DENSE, ACT_QKV, ACT_OUT, ACT_QKV_FORWARD};
    for (size_t k = 0; k < sizeof counted / sizeof *counted; k++) {
        int i = counted[k];
        uint64_t act, grad, *with = counts[i], *without = counts[EXPERTS];
        dense_fp8_values(&c, 2 * 6, &modes[i], &act, &grad); // per micro-batch of 2 x 6 tokens; the step has two
        unsigned long long more_act = fp8_values(with, FP8_CLASS_ACTIVATIONS) - fp8_values(without, FP8_CLASS_ACTIVATIONS);
        unsigned long long more_grad = fp8_values(with, FP8_CLASS_GRADIENTS) - fp8_values(without, FP8_CLASS_GRADIENTS);
        unsigned long long weights = fp8_values(with, FP8_CLASS_WEIGHTS) + fp8_values(without, FP8_CLASS_WEIGHTS);
        CHECK_MSG(more_act == 2 * act && more_grad == 2 * grad && weights == 0,
                  "%s: %s counted %llu more activation values than the experts alone (want %llu), %llu more "
                  "gradient values (want %llu); weight values counted in the steps: %llu (want 0)", config,
                  names[i], more_act, (unsigned long long)(2 * act), more_grad, (unsigned long long)(2 * grad), weights);
    }
    for (int i = 0; i < RUNS; i++) free(grads[i]), free(metrics[i]);
}

// Pre-norm: 10% (measured: expert gradients 5.3-5.9% off, dense-layer ones 5.6-6.6% with the dense
// layers in FP8, 0.02% without). Reordered norms (the dense input gradients add to the residual's):
// 20%, as the norm after each attention and MLP brings its output, FP8 error included, to the
// residual's scale (measured: 4.4-10.7%; 7.1-9.8%, 0.01%); random routing, as FP8 there moves
// slots between experts otherwise (their gradients wholesale).
static void test_fp8_step(void) {
    ModelConfig reordered = small_model();
    reordered.norm_placement = NORM_REORDERED, reordered.random_routing = true;
    fp8_step_case(small_model(), "pre-norm", 0.1);
    fp8_step_case(reordered, "reordered norms", 0.2);
}

// The codes and scales of m's FP8 weights that differ from a fresh quantisation of its master
// weights (one rank: they hold every tensor, and a CPU compute copy is exact).
static size_t fp8_stale_values(const Model *m) {
    size_t stale = 0;
    for (size_t i = 0; i < m->fp8->n_weights; i++) {
        const Fp8Weights *t = &m->fp8->weights[i];
        size_t n = t->El * t->N * t->K, blocks = t->El * fp8_blocks(t->N) * fp8_blocks(t->K);
        uint8_t *q = malloc(n);
        real *s = malloc(blocks * sizeof(real)), *st = malloc(blocks * sizeof(real));
        m->ops->fp8_quantize_weights(q, s, st, model_master(m, t->off), t->El, t->N, t->K, m->fp8->how, NULL);
        for (size_t j = 0; j < n; j++) stale += q[j] != ((uint8_t *)t->q)[j];
        for (size_t j = 0; j < blocks; j++)
            stale += (s[j] != ((real *)t->scales)[j]) + (st[j] != ((real *)t->scales_t)[j]);
        free(q), free(s), free(st);
    }
    return stale;
}

// The codes of m's FP8 weights, back to back (n_weights tensors of El N K each), into q (or, with
// compare, the number of tensors none of whose codes differ from q's).
static size_t fp8_codes(const Model *m, uint8_t *q, bool compare) {
    size_t unchanged = 0;
    for (size_t i = 0; i < m->fp8->n_weights; i++) {
        const Fp8Weights *t = &m->fp8->weights[i];
        size_t n = t->El * t->N * t->K;
        if (compare) unchanged += !memcmp(q, t->q, n);
        else memcpy(q, t->q, n);
        q += n;
    }
    return unchanged;
}

// The bytes of the FP8 copies (codes and both scales) of the weights of small_model(), whose every
// matrix is one 128x128 block: per layer QKV (C, D), output projection (D, Hq hd), the dense or
// shared MLP's gate|up (2H, D) and down (D, H), and per MoE layer its experts' gate|up (E, 2H, D)
// and down (E, D, H); and the buffer of the largest one's transposed codes.
static size_t small_fp8_weight_bytes(const ModelConfig *c) {
    size_t E = (size_t)c->n_experts, D = (size_t)c->d_model, He = (size_t)c->expert_hidden;
    size_t C = model_qkv_width(c), Dq = (size_t)c->n_heads * c->head_dim, bytes = 0, largest = 0;
    for (int l = 0; l < c->n_layers; l++) {
        bool moe = model_layer_is_moe(c, l);
        size_t H = (size_t)(moe ? c->shared_hidden : c->dense_hidden), sizes[4] = {C * D, D * Dq, 2 * H * D, D * H};
        bytes += C * D + D * Dq + 3 * H * D + 8 * sizeof(real);
        for (int i = 0; i < 4; i++) largest = sizes[i] > largest ? sizes[i] : largest;
        if (moe) bytes += 3 * E * He * D + 4 * E * sizeof(real);
        if (moe && 2 * E * He * D > largest) largest = 2 * E * He * D;
    }
    return bytes + largest;
}

// The FP8 copies of the expert and dense weights follow the master weights on `ops`: after
// initialisation, after each of three training steps (whose updates change the codes of every tensor)
// and after new weights are set, they are bit for bit what quantising the master weights gives then;
// each optimizer step counts every one of their values once (class weights). The memory plan counts
// them and the dense layers' scratch exactly, and with a compute copy apart from the masters
// (ops_cpu_sharded) the experts' compute weights are staged: one tensor's in place of the experts'
// region, which the optimizer's updates leave alone with `update` (train.fp8_fused_update: its
// adamw_update_fp8 makes the experts' codes) and write over without. The final master weights and
// codes go to params and codes.
static void fp8_weight_copies_case(const Ops *ops, bool update, real *params, uint8_t *codes, size_t cap) {
    ModelConfig c = small_model();
    Config cfg;
    config_defaults(&cfg);
    cfg.model = c, cfg.train.lr = 1e-2, cfg.train.warmup = 0;
    size_t B = 2, S = 6, T = B * S;
    Parallel par;
    test_single_parallel(&par, &c);
    Model m;
    Optimizer o;
    const TestFp8 fp8 = {.how = FP8_SCALE_AMAX, .dense = true, .swiglu = true, .wgrad_blocks = true, .update = update};
    model_init(&m, &c, ops, &par, B, S, 1, 1, test_modes(RECOMPUTE_NONE, &fp8));
    optim_init(&o, &m);
    model_init_weights(&m, 3);
    CHECK_MSG(m.fp8->n_weights == 16, "%zu FP8 weight tensors, not 4 per layer and 2 more per MoE layer",
              m.fp8->n_weights);
    Model plan;
    Optimizer plan_o;
    model_init(&plan, &c, ops_counting_like(ops), &par, B, S, 1, 1, test_modes(RECOMPUTE_NONE, &fp8));
    optim_init(&plan_o, &plan);
    size_t want = small_fp8_weight_bytes(&c), E = (size_t)c.n_experts, span = 2 * E * c.expert_hidden * c.d_model;
    CHECK_MSG(plan.mem.bytes == m.mem.bytes && m.fp8->weight_bytes == want, "%s: plan %zu bytes, allocated %zu; FP8 "
              "weights %zu bytes, not %zu", ops->name, plan.mem.bytes, m.mem.bytes, m.fp8->weight_bytes, want);
    size_t staged = ops->act_aliases_f32 ? 0 : m.reg.region_begin[PARAM_EXPERT] + span;
    CHECK_MSG((m.expert_stage != NULL) == !ops->act_aliases_f32 && model_compute_weight_elems(&m) == staged,
              "%s: compute weights of %zu elements, not %zu (the experts' staged: %d)", ops->name,
              model_compute_weight_elems(&m), staged, m.expert_stage != NULL);
    model_free(&plan);
    CHECK_MSG(fp8_stale_values(&m) == 0, "FP8 weights stale after initialisation");
    size_t n = 0;
    for (size_t i = 0; i < m.fp8->n_weights; i++) n += m.fp8->weights[i].El * m.fp8->weights[i].N * m.fp8->weights[i].K;
    CHECK_MSG(m.reg.total <= cap && n <= cap, "%s: %zu parameters and %zu codes exceed the test's buffers of %zu",
              ops->name, m.reg.total, n, cap);
    uint8_t *before = malloc(n);
    real *metrics = calloc(model_metrics_len(&c), sizeof(real)), *stage = m.expert_stage;
    for (size_t i = 0; stage && i < span; i++) stage[i] = NAN; // what the steps' updates write over
    int32_t seqs[2 * 7];
    for (int step = 1; step <= 3; step++) {
        for (int i = 0; i < 2 * 7; i++) seqs[i] = (int32_t)(rng_hash64((uint64_t)step, (uint64_t)i) % 17);
        ForwardArgs a = {.B = B, .S = S, .train = true, .scales = {.ce = 1.0f / T}, .metrics = metrics};
        fp8_codes(&m, before, false);
        memset(m.grads, 0, m.reg.total * sizeof(real));
        memset(metrics, 0, model_metrics_len(&c) * sizeof(real));
        StepInfo info = optim_step_info(&cfg.train, step);
        m.ops->upload(m.step_info, &info, sizeof info);
        model_set_batch(&m, 0, seqs, B, S);
        model_forward(&m, &a);
        model_backward(&m, &a);
        memset(m.fp8->counts, 0, MODEL_FP8_COUNTS * sizeof(uint64_t));
        optim_step(&o, &m, &cfg.train, metrics);
        size_t unchanged = fp8_codes(&m, before, true);
        CHECK_MSG(unchanged == 0, "step %d changed no FP8 code of %zu weight tensors", step, unchanged);
        CHECK_MSG(fp8_stale_values(&m) == 0, "FP8 weights stale after step %d", step);
        uint64_t counted = m.fp8->counts[FP8_CLASS_WEIGHTS * FP8_COUNTS + FP8_COUNT_VALUES];
        CHECK_MSG(counted == n, "step %d counted %llu weight values, not %zu", step, (unsigned long long)counted, n);
    }
    size_t written = 0;
    for (size_t i = 0; stage && i < span; i++) written += !isnan(stage[i]);
    CHECK_MSG(!stage || written == (update ? 0 : span), "%s: the updates wrote %zu of the %zu staged expert "
              "weights, not %s", ops->name, written, span, update ? "none (adamw_update_fp8 makes their FP8 "
              "copies without them)" : "all (train.fp8_fused_update off)");
    if (m.reg.total <= cap && n <= cap) {
        memcpy(params, m.params, m.reg.total * sizeof(real));
        fp8_codes(&m, codes, false);
    }
    model_init_weights(&m, 4);
    CHECK_MSG(fp8_stale_values(&m) == 0, "FP8 weights stale after new weights were set");
    free(before), free(metrics);
    model_free(&m);
    test_free_parallel(&par);
}

// ... on the CPU backend, and with the experts' compute weights staged, their codes made by the
// update or apart (the same values bit for bit: the CPU's compute copy is exact).
static void test_fp8_weight_copies(void) {
    size_t P = 1 << 20; // more than small_model()'s parameters and codes (checked by the case)
    real *params[3];
    uint8_t *codes[3];
    for (int i = 0; i < 3; i++) params[i] = calloc(P, sizeof(real)), codes[i] = calloc(P, 1);
    fp8_weight_copies_case(ops_cpu(), true, params[0], codes[0], P);
    fp8_weight_copies_case(ops_cpu_sharded(), true, params[1], codes[1], P);
    fp8_weight_copies_case(ops_cpu_sharded(), false, params[2], codes[2], P);
    for (int i = 1; i < 3; i++)
        CHECK_MSG(!memcmp(params[0], params[i], P * sizeof(real)) && !memcmp(codes[0], codes[i], P),
                  "three steps with the experts' compute weights staged (codes made %s) differ from the CPU "
                  "backend's", i == 1 ? "by the update" : "apart");
    for (int i = 0; i < 3; i++) free(params[i]), free(codes[i]);
}

// The memory plan of c (B x S tokens) under recompute mode r with products as *fp8 says (NULL: act
// precision): all bytes and those of the activations.
static void plan_bytes(const ModelConfig *c, size_t B, size_t S, Recompute r, const TestFp8 *fp8, size_t *all,
                       size_t *acts) {
    Parallel par;
    test_single_parallel(&par, c);
    Model m;
    model_init(&m, c, ops_counting_like(ops_cpu()), &par, B, S, 1, 1, test_modes(r, fp8));
    *all = m.mem.bytes, *acts = m.act_bytes;
    model_free(&m);
    test_free_parallel(&par);
}

// The bytes FP8 products add to the memory plan of c (B x S tokens), their operands, with the dense
// layers in FP8 or not: under full recompute, which keeps no FP8 input (nor lends scratch).
static size_t fp8_plan_bytes(const ModelConfig *c, size_t B, size_t S, bool dense) {
    size_t all, acts, all0, acts0;
    const TestFp8 fp8 = {.how = FP8_SCALE_AMAX, .dense = dense, .swiglu = true, .wgrad_blocks = true, .update = true};
    plan_bytes(c, B, S, RECOMPUTE_FULL, &fp8, &all, &acts);
    plan_bytes(c, B, S, RECOMPUTE_FULL, NULL, &all0, &acts0);
    return (all - acts) - (all0 - acts0);
}

// The FP8 memory of a model of dense layers only (small_model's, 3 of them; T = 12 tokens), byte for
// byte: with the dense layers in FP8, per layer the copies of QKV (C, D) = (16, 8), the output
// projection (8, 8), gate|up (24, 8) and down (8, 12) with one block scale each for both layouts,
// the buffer of the largest one's transposed codes (24, 8), and scratch for the widest dense
// product: rows (T, 24) with one scale a row, token-major copies of
// output gradients (24, Tt) and inputs (12, Tt) with Tt = 256 (one group: 128 past the 12 rows)
// and a scale per 128 columns, and the counters (the sum of an accumulating product reuses
// Scratch.dxf); without them, the counters alone.
static void test_fp8_dense_memory(void) {
    ModelConfig c = small_model();
    c.n_dense_layers = c.n_layers;
    size_t T = 12, D = 8, r = sizeof(real), Tt = 256;
    size_t weights = 3 * (16 * D + D * 8 + 24 * D + D * 12 + 2 * 4 * r) + 24 * D;
    size_t scratch = T * 24 + T * r + 24 * Tt + 24 * 2 * r + 12 * Tt + 12 * 2 * r;
    size_t counters = MODEL_FP8_COUNTS * sizeof(uint64_t);
    size_t with = fp8_plan_bytes(&c, 2, 6, true), without = fp8_plan_bytes(&c, 2, 6, false);
    CHECK_MSG(with == weights + scratch + counters && without == counters,
              "FP8 memory of dense layers: %zu bytes with them in FP8 (want %zu), %zu without (want %zu)", with,
              weights + scratch + counters, without, counters);
}

// The memory an FP8 plan of small_model() (3 layers: 1 dense, 2 MoE of 4 experts, top 2; D = 8)
// takes beyond an act-precision one for T = 1024 tokens, byte for byte. With recompute none the
// token-major FP8 copies (one code a value, an f32 scale per 128) replace per layer the attention
// norm's output n1 (T, D), its copy (D, Tt) with Tt = 128 (8 + 1) = 1152 columns (one group: 128
// past the rows), and per MoE layer the experts' rows (R, D), R = 2048, their copy (D, Tt) with Tt
// = 128 (16 + 4) = 2560 (a block past each expert's rows). The one buffer of each replaced tensor
// that the forward still writes, shared by every layer, is the backward's scratch (n1's dn, xp's
// scratch B), which the plan counts there already. So the activations change by the copies less the
// tensors, the rest of the plan by the FP8 operands and, with train.fp8_fused_dispatch, the token of
// each expert row (Scratch.row_token, R i32: the copies are then quantised from the layer's
// tensors). With reordered norms n1 is no QKV input (no copy); with the dense layers in act
// precision neither; recompute full and selective keep as in act precision, and with the fused
// dispatch quantise the layer input's rows once a token (Fp8Operands.tokens: T codes of D and a
// scale each, D < 128) before gathering the experts' rows.
static void test_fp8_kept_inputs_memory(void) {
    ModelConfig c = small_model(), reordered = small_model();
    reordered.norm_placement = NORM_REORDERED;
    size_t T = 1024, R = 2 * T, D = 8, r = sizeof(real);
    size_t n1 = T * D * r, n1_t = D * 1152 + 1152 / 128 * D * r, xp = R * D * r, xe_t = D * 2560 + 2560 / 128 * D * r;
    ptrdiff_t acts_xe = 2 * ((ptrdiff_t)xe_t - (ptrdiff_t)xp), acts_n1 = 3 * ((ptrdiff_t)n1_t - (ptrdiff_t)n1);
    const struct {
        const ModelConfig *c;
        Recompute r;
        bool dense, fused;
        ptrdiff_t acts;
        const char *name;
    } cases[] = {{&c, RECOMPUTE_NONE, true, false, acts_n1 + acts_xe, "pre-norm"},
                 {&c, RECOMPUTE_NONE, true, true, acts_n1 + acts_xe, "pre-norm, fused dispatch"},
                 {&c, RECOMPUTE_NONE, false, false, acts_xe, "pre-norm, dense layers in act precision"},
                 {&reordered, RECOMPUTE_NONE, true, false, acts_xe, "reordered norms"},
                 {&c, RECOMPUTE_SELECTIVE, true, true, 0, "selective recompute"},
                 {&c, RECOMPUTE_FULL, true, true, 0, "full recompute"}};
    CHECK_MSG(acts_n1 + acts_xe < 0, "the copies keep more than the tensors they replace");
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        size_t all, acts, all0, acts0;
        const TestFp8 fp8 = {.how = FP8_SCALE_AMAX, .dense = cases[i].dense, .fused = cases[i].fused, .swiglu = true,
                             .wgrad_blocks = true, .update = true};
        plan_bytes(cases[i].c, 2, T / 2, cases[i].r, &fp8, &all, &acts);
        plan_bytes(cases[i].c, 2, T / 2, cases[i].r, NULL, &all0, &acts0);
        ptrdiff_t got = (ptrdiff_t)acts - (ptrdiff_t)acts0, rest = (ptrdiff_t)(all - acts) - (ptrdiff_t)(all0 - acts0);
        bool tokens = cases[i].fused && cases[i].r != RECOMPUTE_NONE; // no copy kept: Fp8Operands.tokens
        ptrdiff_t want_rest = (ptrdiff_t)fp8_plan_bytes(cases[i].c, 2, T / 2, cases[i].dense) +
                              (cases[i].fused ? (ptrdiff_t)(R * sizeof(int32_t)) : 0) +
                              (tokens ? (ptrdiff_t)(T * D + T * r) : 0);
        CHECK_MSG(got == cases[i].acts && rest == want_rest, "%s: FP8 keeps %td activation bytes more than act "
                  "precision (want %td) and %td more beside them (want %td)", cases[i].name, got, cases[i].acts,
                  rest, want_rest);
    }
}

// With recompute none an FP8 step keeps the token-major copies of the QKV and expert gate|up inputs
// from the forward (two micro-batches in flight, each its own; the experts' operands read from the
// tokens' rows, train.fp8_fused_dispatch): the gradients and metrics are bitwise those of full
// recompute (which makes them in the backward, from gathered rows), and each product input is still
// quantised twice a micro-batch, as rows and token-major (class activations): per layer the inputs
// of QKV (T, D), the output projection (T, Hq hd) and the MLP's gate|up (T, D) and down (T, H)
// (dense_fp8_values), per MoE layer the experts' rows (T K, D) and (T K, He); the output gradients
// as before too (class gradients: the experts' (T K, D) and (T K, 2 He) besides the dense layers').
static void test_fp8_kept_inputs_step(void) {
    ModelConfig c = small_model();
    size_t P, len;
    model_sizes(&c, &P, &len);
    const TestFp8 fp8 = {.how = FP8_SCALE_AMAX, .dense = true, .fused = true, .swiglu = true, .wgrad_blocks = true,
                         .update = true};
    real *grads[2] = {calloc(P, sizeof(real)), calloc(P, sizeof(real))};
    real *metrics[2] = {calloc(len, sizeof(real)), calloc(len, sizeof(real))};
    uint64_t counts[MODEL_FP8_COUNTS], full_counts[MODEL_FP8_COUNTS];
    recompute_step(&c, RECOMPUTE_NONE, &fp8, grads[0], metrics[0], counts);
    recompute_step(&c, RECOMPUTE_FULL, &fp8, grads[1], metrics[1], full_counts);
    CHECK_MSG(!memcmp(grads[0], grads[1], P * sizeof(real)) && !memcmp(metrics[0], metrics[1], len * sizeof(real)),
              "FP8 with kept token-major inputs differs from full recompute");
    size_t T = 2 * 6, K = (size_t)c.top_k, D = (size_t)c.d_model, He = (size_t)c.expert_hidden;
    uint64_t act, grad;
    dense_fp8_values(&c, T, &fp8, &act, &grad);
    act += 2 * (uint64_t)(2 * T * K * (D + He)); // two MoE layers
    grad += 2 * (uint64_t)(2 * T * K * (D + 2 * He));
    CHECK_MSG(fp8_values(counts, FP8_CLASS_ACTIVATIONS) == 2 * act &&
              fp8_values(counts, FP8_CLASS_GRADIENTS) == 2 * grad,
              "a step counted %llu activation values (want %llu) and %llu gradient values (want %llu)",
              fp8_values(counts, FP8_CLASS_ACTIVATIONS), (unsigned long long)(2 * act),
              fp8_values(counts, FP8_CLASS_GRADIENTS), (unsigned long long)(2 * grad));
    for (int i = 0; i < 2; i++) free(grads[i]), free(metrics[i]);
}

// train.fp8_fused_swiglu with an expert_hidden of 128 (the fused SwiGLU backward writes the FP8
// operands of the products it feeds, from scratch the model lends it): under every recompute mode
// the gradients, metrics and FP8 counters are bitwise those of the SwiGLU backward's stored outputs
// quantised after (false), with the experts' operands read from the tokens' rows and gathered.
static void test_fp8_fused_swiglu(void) {
    ModelConfig c = small_model();
    c.expert_hidden = 128;
    size_t P, len;
    model_sizes(&c, &P, &len);
    real *grads[2] = {calloc(P, sizeof(real)), calloc(P, sizeof(real))};
    real *metrics[2] = {calloc(len, sizeof(real)), calloc(len, sizeof(real))};
    uint64_t counts[2][MODEL_FP8_COUNTS];
    size_t bytes[2];
    const char *names[3] = {"none", "selective", "full"};
    for (int r = RECOMPUTE_NONE; r <= RECOMPUTE_FULL; r++)
        for (int mode = 0; mode < 4; mode++) {
            bool dispatch = mode & 1, blocks = mode & 2;
            for (int fused = 0; fused < 2; fused++) {
                TestFp8 fp8 = {.how = FP8_SCALE_AMAX, .dense = true, .fused = dispatch, .swiglu = fused,
                               .wgrad_blocks = blocks, .update = true};
                bytes[fused] = recompute_step(&c, (Recompute)r, &fp8, grads[fused], metrics[fused], counts[fused]);
            }
            CHECK_MSG(!memcmp(grads[0], grads[1], P * sizeof(real)) &&
                          !memcmp(metrics[0], metrics[1], len * sizeof(real)) &&
                          !memcmp(counts[0], counts[1], sizeof counts[0]),
                      "recompute %s%s%s: the fused FP8 SwiGLU backward's step differs from the unfused one",
                      names[r], dispatch ? ", fused dispatch" : "", blocks ? ", 128x128 blocks" : "");
            // No buffer for the experts' SwiGLU output (Model.expert_hact; recompute_step's 12 tokens),
            // but where selective recompute's shared SwiGLU buffer serves as that anyway.
            size_t hact = r == RECOMPUTE_SELECTIVE ? 0 : model_routed_rows(&c, 12) * c.expert_hidden * sizeof(real);
            CHECK_MSG(bytes[0] - bytes[1] == hact, "recompute %s%s: the fused FP8 SwiGLU backward's activations take "
                      "%zu bytes less than the unfused one's, not %zu", names[r], dispatch ? ", fused dispatch" : "",
                      bytes[0] - bytes[1], hact);
        }
    for (int i = 0; i < 2; i++) free(grads[i]), free(metrics[i]);
}

// train.optimizer_overlap: a step's update is left pending, the weights as they were; completed unit
// by unit (as the next step's forward asks for them) or by a flush after the first unit, it gives
// bitwise the weights and moments of the update made at once, with clipping that bites, and zeroes
// the gradients it read but the experts' weights', which it marks for the next backward to overwrite.
static void test_optimizer_overlap(void) {
    Config cfg;
    config_defaults(&cfg);
    cfg.model = small_model();
    cfg.train.clip = 1e-3;
    size_t B = 1, S = 4;
    Parallel par;
    test_single_parallel(&par, &cfg.model);
    int32_t seqs[5];
    for (int i = 0; i < 5; i++) seqs[i] = (int32_t)(rng_hash64(7, (uint64_t)i) % 17);
    Model m[3];
    Optimizer o[3];
    real *metrics = calloc(model_metrics_len(&cfg.model), sizeof(real)), *before = NULL;
    for (int k = 0; k < 3; k++) {
        model_init(&m[k], &cfg.model, ops_cpu(), &par, B, S, 1, 1, (ModelModes){0});
        optim_init(&o[k], &m[k]);
        o[k].overlap = k > 0;
        model_init_weights(&m[k], 5);
        if (k == 0) before = malloc(m[k].reg.total * sizeof(real)), memcpy(before, m[k].params, m[k].reg.total * sizeof(real));
        StepInfo info = optim_step_info(&cfg.train, 1);
        m[k].ops->upload(m[k].step_info, &info, sizeof info);
        ForwardArgs a = {.B = B, .S = S, .train = true, .scales = {.ce = 1.0f / (B * S)}, .metrics = metrics};
        memset(metrics, 0, model_metrics_len(&cfg.model) * sizeof(real));
        model_set_batch(&m[k], 0, seqs, B, S);
        model_forward(&m[k], &a);
        model_backward(&m[k], &a);
        optim_step(&o[k], &m[k], &cfg.train, metrics);
    }
    CHECK_MSG(metrics[METRIC_GRAD_NORM_SQ] > 1e-6f, "gradient norm^2 %g: no clipping", (double)metrics[METRIC_GRAD_NORM_SQ]);
    size_t bytes = m[0].reg.total * sizeof(real);
    CHECK_MSG(!optim_pending(&o[0], &m[0]) && optim_pending(&o[1], &m[1]) && !memcmp(m[1].params, before, bytes) &&
              memcmp(m[0].params, before, bytes), "the update ran at once, or left pending with changed weights");
    for (int u = -1; u <= cfg.model.n_layers; u++) optim_unit_begins(&o[1], &m[1], u);
    optim_unit_begins(&o[2], &m[2], -1);
    optim_flush(&o[2], &m[2]);
    for (int k = 0; k < 3; k++) {
        size_t n = o[k].region[PARAM_EXPERT].shard * sizeof(real), nonzero = 0, marked = 0;
        size_t e0 = m[k].reg.region_begin[PARAM_EXPERT], e1 = e0 + m[k].reg.region_size[PARAM_EXPERT];
        for (size_t i = 0; i < m[k].reg.total; i++) nonzero += (i < e0 || i >= e1) && ((real *)m[k].grads)[i] != 0;
        for (int l = 0; l < cfg.model.n_layers; l++) marked += m[k].expert_dw_written[l];
        CHECK_MSG(!optim_pending(&o[k], &m[k]) && !memcmp(m[k].params, m[0].params, bytes) &&
                  !memcmp(o[k].region[PARAM_EXPERT].v, o[0].region[PARAM_EXPERT].v, n) && nonzero == 0 && marked == 0,
                  "model %d: pending %d, weights or moments differ from the update at once, %zu gradients not zeroed, "
                  "%zu layers' expert gradients not marked to be written over", k, optim_pending(&o[k], &m[k]), nonzero,
                  marked);
    }
    for (int k = 0; k < 3; k++) model_free(&m[k]);
    free(metrics), free(before);
    test_free_parallel(&par);
}

static void test_lr_schedule(void) {
    TrainConfig t = {.steps = 110, .lr = 1.0, .min_lr_ratio = 0.1, .warmup = 10, .schedule = SCHED_COSINE};
    CHECK_CLOSE(optim_lr(&t, 1), 1.0 / 11, 1e-12, 0);
    CHECK_CLOSE(optim_lr(&t, 10), 10.0 / 11, 1e-12, 0);
    CHECK_CLOSE(optim_lr(&t, 60), 0.55, 1e-12, 0); // halfway: floor + half the range
    CHECK_CLOSE(optim_lr(&t, 110), 0.1, 1e-12, 0);
    t.schedule = SCHED_LINEAR;
    CHECK_CLOSE(optim_lr(&t, 35), 1.0 - 0.9 * 0.25, 1e-12, 0);
    CHECK_CLOSE(optim_lr(&t, 200), 0.1, 1e-12, 0); // past the end: stays at the floor
    t.schedule = SCHED_CONSTANT;
    CHECK_CLOSE(optim_lr(&t, 80), 1.0, 0, 0);
}

static void test_step_report(void) {
    ModelConfig c = small_model(); // 2 MoE layers, E = 4
    size_t len = model_metrics_len(&c);
    float *m = calloc(len, sizeof(float));
    m[METRIC_CE] = 2.0f * 100, m[METRIC_GRAD_NORM_SQ] = 9;
    float *l0 = m + model_metric_router(&c, 0), *l1 = m + model_metric_router(&c, 1);
    float loads[4] = {10, 30, 20, 20};
    memcpy(l0, loads, sizeof loads);
    l0[router_stat_lb(4)] = 2.4f, l0[router_stat_z(4)] = 0.4f, l0[router_stat_dropped(4)] = 8;
    for (int e = 0; e < 4; e++) l1[e] = 20;
    l1[router_stat_lb(4)] = 2.0f, l1[router_stat_z(4)] = 0.2f;
    StepReport r = {0};
    report_build(&r, &c, m, 2, 50);
    CHECK_CLOSE(r.ce, 2.0, 1e-6, 0);
    CHECK_CLOSE(r.grad_norm, 3.0, 1e-6, 0);
    CHECK_CLOSE(r.layers[0].imbalance, 1.5, 1e-6, 0);
    CHECK_CLOSE(r.layers[0].min_over_mean, 0.5, 1e-6, 0);
    CHECK_CLOSE(r.layers[0].drop_rate, 0.1, 1e-6, 0);
    CHECK_CLOSE(r.layers[1].imbalance, 1.0, 1e-6, 0);
    CHECK_CLOSE(r.lb, (1.2 + 1.0) / 2, 1e-6, 0);
    CHECK_CLOSE(r.loss, 2.0 + c.lb_coef * 1.1 + c.z_coef * 0.15, 1e-6, 0);
    report_free(&r);
    free(m);
}

// JSON has no NaN: a non-finite value is logged as null, and the record stays valid JSON.
static void test_records_without_nan(void) {
    ModelConfig c = small_model();
    float *m = calloc(model_metrics_len(&c), sizeof(float));
    m[METRIC_CE] = NAN, m[METRIC_GRAD_NORM_SQ] = INFINITY;
    StepReport r = {.step = 7};
    report_build(&r, &c, m, 1, 10);
    json_t *records[2] = {report_to_json(&r), metrics_val_record(7, NAN, 8)};
    const char *want[2] = {"\"loss\":null", "\"val_loss\":null"};
    for (int i = 0; i < 2; i++) {
        char *text = json_dumps(records[i], JSON_COMPACT);
        json_t *back = text ? json_loads(text, 0, NULL) : NULL;
        CHECK_MSG(text && strstr(text, want[i]) && back, "record %d: %s", i, text ? text : "(not written)");
        free(text);
        json_decref(back);
        json_decref(records[i]);
    }
    report_free(&r);
    free(m);
}

// A step's device readings: in its record as "device" and on its console line where there are
// some; neither where there are none (the CPU, or no readings).
static void test_records_with_device_clocks(void) {
    ModelConfig c = small_model();
    float *m = calloc(model_metrics_len(&c), sizeof(float));
    StepReport r = {.step = 3};
    report_build(&r, &c, m, 1, 10);
    ClockSummary clocks = {.queried = true, .samples = 20, .sm_mhz_median = 1605, .power_w_mean = 692,
                           .power_capped_share = 1};
    for (int with = 0; with < 2; with++) {
        r.clocks = with ? &clocks : NULL;
        json_t *rec = report_to_json(&r), *dev = json_object_get(rec, "device");
        CHECK_MSG(with ? dev && json_number_value(json_object_get(dev, "sm_mhz")) == 1605 &&
                             json_number_value(json_object_get(dev, "power_capped")) == 1
                       : !dev, "with readings %d: device %s", with, dev ? "logged" : "not logged");
        json_decref(rec);
        char line[1024] = "";
        FILE *f = fmemopen(line, sizeof line - 1, "w");
        report_print(&r, f);
        fclose(f);
        bool shown = strstr(line, "1605 MHz 692 W (power limit)") != NULL;
        CHECK_MSG(shown == (with == 1), "console line: %s", line);
    }
    report_free(&r);
    free(m);
}

static void test_checkpoint_round_trip_and_prune(void) {
    char dir[] = "/tmp/moe-ckpt-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    ModelConfig mc = small_model();
    Config cfg;
    config_defaults(&cfg);
    cfg.model = mc;
    Parallel par;
    test_single_parallel(&par, &mc);
    Model a, b;
    Optimizer oa, ob;
    model_init(&a, &mc, ops_cpu(), &par, 1, 4, 1, 1, (ModelModes){0});
    model_init(&b, &mc, ops_cpu(), &par, 1, 4, 1, 1, (ModelModes){0});
    optim_init(&oa, &a);
    optim_init(&ob, &b);
    model_init_weights(&a, 1);
    model_init_weights(&b, 2);
    real *ma = oa.region[PARAM_EXPERT].m, *bias = a.expert_bias;
    for (size_t i = 0; i < oa.region[PARAM_EXPERT].shard; i++) ma[i] = (real)(float)(0.001 * (double)i);
    bias[2 * mc.n_experts + 1] = 0.25;
    MoeErr err;
    for (int step = 1; step <= 3; step++) {
        TrainState st = {.step = step, .data_position = 40 * (uint64_t)step};
        CHECK_MSG(ckpt_save(dir, &a, &oa, &cfg, &st, 2, err) == 0, "%s", err);
    }
    char path[4200], want[4300];
    CHECK(ckpt_latest(dir, path, sizeof path) == 3);
    snprintf(want, sizeof want, "%s/step-1", dir);
    CHECK_MSG(!fs_exists(want), "step-1 should have been pruned (keep 2)");
    snprintf(want, sizeof want, "%s/model.safetensors.index.json", path);
    CHECK_MSG(fs_exists(want), "no index in %s", path);
    CHECK_MSG(ckpt_load(path, &b, &ob, err) == 0, "%s", err);
    size_t bad = 0;
    for (size_t i = 0; i < a.reg.total; i++)
        bad += ((real *)b.params)[i] != (real)(float)((real *)a.params)[i];
    for (size_t i = 0; i < oa.region[PARAM_EXPERT].shard; i++)
        bad += ((real *)ob.region[PARAM_EXPERT].m)[i] != ma[i];
    CHECK_MSG(bad == 0, "%zu parameters or moments differ after a round trip", bad);
    CHECK(((real *)b.expert_bias)[2 * mc.n_experts + 1] == (real)0.25);
    Config saved;
    TrainState st;
    CHECK_MSG(ckpt_read_state(path, &saved, &st, err) == 0, "%s", err);
    CHECK(st.step == 3 && st.data_position == 120 && saved.model.shared_hidden == 5);
    fs_remove_tree(dir);
    model_free(&a);
    model_free(&b);
    test_free_parallel(&par);
}

// Writes value over element 0 of tensor `name` in a safetensors file (F32), as damage would.
// Renames the header's checksum keys (same length), as if the file was written before checksums.
static void strip_checksums(const char *path) {
    FILE *f = fopen(path, "r+b");
    uint64_t n = 0;
    CHECK_MSG(f && fread(&n, 8, 1, f) == 1 && n < ((uint64_t)1 << 30), "cannot read the header of %s", path);
    char *h = calloc(n + 1, 1);
    CHECK_MSG(f && h && fread(h, 1, n, f) == n, "cannot read the header of %s", path);
    for (char *p = h; (p = strstr(p, "\"xxh3_64:")); p += 9) memcpy(p, "\"xxh3_00:", 9);
    CHECK_MSG(fseek(f, 8, SEEK_SET) == 0 && fwrite(h, 1, n, f) == n, "cannot rewrite the header of %s", path);
    fclose(f);
    free(h);
}

static void poke_tensor(const char *path, const char *name, float value) {
    SafeTensors sf;
    MoeErr err;
    CHECK_MSG(st_open(&sf, path, err) == 0, "%s", err);
    const StTensor *t = st_find(&sf, name);
    FILE *f = fopen(path, "r+b");
    CHECK_MSG(t && f && fseek(f, (long)(sf.data_start + t->begin), SEEK_SET) == 0 &&
              fwrite(&value, sizeof value, 1, f) == 1, "cannot write %s in %s", name, path);
    if (f) fclose(f);
    st_close(&sf);
    strip_checksums(path); // the value, not the checksum, is under test
}

#define CHECK_FAILS_WITH(call, err, fragment)                                                     \
    CHECK_MSG((call) != 0 && strstr(err, fragment), "%s: expected a failure naming \"%s\", got \"%s\"", \
              #call, fragment, err)

// A NaN in the weights or moments is never saved, and one found in a file is refused by name.
static void test_checkpoint_non_finite(void) {
    char dir[] = "/tmp/moe-ckpt-XXXXXX", path[4200], file[4300];
    CHECK(mkdtemp(dir) != NULL);
    Config cfg;
    config_defaults(&cfg);
    cfg.model = small_model();
    Parallel par;
    test_single_parallel(&par, &cfg.model);
    Model m;
    Optimizer o;
    model_init(&m, &cfg.model, ops_cpu(), &par, 1, 4, 1, 1, (ModelModes){0});
    optim_init(&o, &m);
    model_init_weights(&m, 1);
    MoeErr err = "";
    TrainState st = {.step = 1};
    real *v = o.region[PARAM_EXPERT].v, *w = m.params;
    v[5] = NAN;
    CHECK_FAILS_WITH(ckpt_save(dir, &m, &o, &cfg, &st, 2, err), err, ".exp_avg_sq' holds nan at element 5");
    v[5] = 0, w[0] = INFINITY;
    CHECK_FAILS_WITH(ckpt_save(dir, &m, &o, &cfg, &st, 2, err), err, "model.embed_tokens.weight' holds inf");
    CHECK_MSG(ckpt_latest(dir, path, sizeof path) < 0, "a checkpoint was written: %s", path);
    w[0] = 0;
    CHECK_MSG(ckpt_save(dir, &m, &o, &cfg, &st, 2, err) == 0, "%s", err);
    ckpt_latest(dir, path, sizeof path);
    snprintf(file, sizeof file, "%s/model-00001-of-00001.safetensors", path);
    poke_tensor(file, "model.norm.weight", NAN);
    CHECK_FAILS_WITH(ckpt_load(path, &m, &o, err), err, "tensor 'model.norm.weight' holds nan at element 0");
    fs_remove_tree(dir);
    model_free(&m);
    test_free_parallel(&par);
}

// The matrix-product rates on the CPU: positive and finite, the sustained one timed over its
// repetitions; no clock readings from a backend without them.
static void test_matmul_rates(void) {
    const Ops *o = ops_cpu();
    ClockSummary c;
    double burst = train_matmul_tflops(o), sustained = train_matmul_tflops_sustained(o, burst, 0.05, &c);
    CHECK_MSG(burst > 0 && isfinite(burst) && sustained > 0 && isfinite(sustained), "burst %g, sustained %g TFLOP/s",
              burst, sustained);
    CHECK(!c.queried && c.samples == 0);
}

const TestCase train_tests[] = {
    {"train_records_with_device_clocks", test_records_with_device_clocks},
    {"train_matmul_rates", test_matmul_rates},
    {"model_fused_layout_and_counts", test_fused_layout},
    {"model_init_independent_of_layout", test_init_independent_of_layout},
    {"model_init_op_matches_values", test_init_op_matches_values},
    {"model_memory_plan_exact", test_memory_plan_exact},
    {"model_micro_batch_accumulation", test_micro_batch_accumulation},
    {"model_recompute_bitwise", test_recompute_bitwise},
    {"model_fp8_fused_swiglu", test_fp8_fused_swiglu},
    {"model_fp8_step", test_fp8_step},
    {"model_fp8_weight_copies", test_fp8_weight_copies},
    {"model_fp8_dense_memory", test_fp8_dense_memory},
    {"model_fp8_kept_inputs_memory", test_fp8_kept_inputs_memory},
    {"model_fp8_kept_inputs_step", test_fp8_kept_inputs_step},
    {"train_optimizer_overlap", test_optimizer_overlap},
    {"train_lr_schedule", test_lr_schedule},
    {"train_step_report", test_step_report},
    {"train_records_without_nan", test_records_without_nan},
    {"train_checkpoint_round_trip_and_prune", test_checkpoint_round_trip_and_prune},
    {"train_checkpoint_non_finite", test_checkpoint_non_finite},
    {0},
};

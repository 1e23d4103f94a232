// Every parameter gradient of the whole model against central finite differences, in double
// precision, on tiny configs that together reach every option: both norm placements, GQA, per-head
// and full QK-norm, shared expert, dense first layer, softmax and sigmoid routers, renormalised
// weights, capacity drops, random routing and loss-free bias.
#include <stdlib.h>
#include <string.h>

#include "test.h"
#include "test_model.h"

// Small enough for thousands of forwards, large enough that every expert sees tokens.
static ModelConfig tiny_config(void) {
    ModelConfig c;
    model_config_defaults(&c);
    c.vocab_size = 13, c.d_model = 8, c.n_layers = 2, c.n_heads = 2, c.n_kv_heads = 1;
    c.head_dim = 4, c.dense_hidden = 10, c.n_experts = 4, c.top_k = 2, c.expert_hidden = 6;
    c.lb_coef = 0.3, c.z_coef = 0.05, c.lm_z_coef = 0.02;
    return c;
}

typedef struct {
    Parallel par;
    Model m;
    int32_t *seqs; // (B, S + 1)
    size_t B, S;
    real *metrics;
    LossScales scales;
} GradProblem;

static ForwardArgs forward_args(GradProblem *g, bool train) {
    return (ForwardArgs){.B = g->B, .S = g->S, .train = train, .token_base = 7, .scales = g->scales,
                         .metrics = g->metrics};
}

// Total loss of one forward, exactly as the scales weight each summed quantity.
static double total_loss(GradProblem *g, bool train) {
    const ModelConfig *c = &g->m.cfg;
    memset(g->metrics, 0, model_metrics_len(c) * sizeof(real));
    ForwardArgs a = forward_args(g, train);
    model_forward(&g->m, &a);
    double L = g->metrics[METRIC_CE] * g->scales.ce + g->metrics[METRIC_LM_Z] * g->scales.lm_z;
    for (int i = 0; i < model_n_moe_layers(c); i++) {
        const real *st = g->metrics + model_metric_router(c, i);
        L += st[router_stat_lb(c->n_experts)] * g->scales.lb + st[router_stat_z(c->n_experts)] * g->scales.z;
    }
    return L;
}

static void problem_init(GradProblem *g, const ModelConfig *cfg, size_t B, size_t S, unsigned seed) {
    ModelConfig c = *cfg;
    MoeErr err;
    if (model_config_validate(&c, err)) TEST_FAIL("config invalid: %s", err);
    g->B = B, g->S = S;
    test_single_parallel(&g->par, &c);
    model_init(&g->m, &c, ops_cpu(), &g->par, B, S, 1, 1, (ModelModes){0});
    model_init_weights(&g->m, seed);
    // Larger, non-unit weights than a real init so every path carries a visible gradient.
    real *p = g->m.params;
    for (size_t i = 0; i < g->m.reg.n; i++) {
        const ParamInfo *pi = &g->m.reg.p[i];
        for (size_t j = 0; j < pi->numel; j++)
            p[pi->offset + j] = (pi->ones ? 1.0 : 0.0) + 0.4 * rng_normal(seed + 1, pi->offset + j);
    }
    real *bias = g->m.expert_bias;
    for (size_t i = 0; i < (size_t)c.n_layers * c.n_experts; i++)
        bias[i] = c.bias_gamma > 0 ? 0.05 * rng_normal(seed + 2, i) : 0;
    g->seqs = malloc(B * (S + 1) * sizeof(int32_t));
    for (size_t i = 0; i < B * (S + 1); i++)
        g->seqs[i] = (int32_t)(rng_hash64(seed + 3, i) % (uint64_t)c.vocab_size);
    model_set_batch(&g->m, 0, g->seqs, B, S);
    g->metrics = calloc(model_metrics_len(&c), sizeof(real));
    int n_moe = model_n_moe_layers(&c);
    g->scales = (LossScales){.ce = 1.0f / (float)(B * S), .lm_z = (float)c.lm_z_coef / (float)(B * S),
                             .lb = n_moe ? (float)c.lb_coef / n_moe : 0,
                             .z = n_moe ? (float)c.z_coef / n_moe : 0};
}

static void problem_free(GradProblem *g) {
    model_free(&g->m);
    test_free_parallel(&g->par);
    free(g->seqs);
    free(g->metrics);
}

// Compares the analytic gradient of every element of every parameter with (L(p+h) - L(p-h)) / 2h.
static void check_model_gradients(const char *what, const ModelConfig *cfg, size_t B, size_t S) {
    GradProblem g;
    problem_init(&g, cfg, B, S, 11);
    size_t P = g.m.reg.total;
    memset(g.m.grads, 0, P * sizeof(real));
    total_loss(&g, true);
    ForwardArgs a = forward_args(&g, true);
    model_backward(&g.m, &a);
    double *analytic = malloc(P * sizeof(double)), *numeric = malloc(P * sizeof(double));
    real *p = g.m.params, *grad = g.m.grads;
    const double h = 1e-5;
    for (size_t i = 0; i < P; i++) {
        analytic[i] = grad[i];
        real saved = p[i];
        p[i] = saved + h;
        double up = total_loss(&g, false);
        p[i] = saved - h;
        double down = total_loss(&g, false);
        p[i] = saved;
        numeric[i] = (up - down) / (2 * h);
    }
    for (size_t t = 0; t < g.m.reg.n; t++) {
        const ParamInfo *pi = &g.m.reg.p[t];
        char label[160];
        snprintf(label, sizeof label, "%s: %s", what, pi->name);
        test_check_arrays(label, analytic + pi->offset, numeric + pi->offset, pi->numel, 1e-5, 1e-8);
    }
    // A gradient check on all-zero gradients proves nothing: every tensor must receive some signal.
    for (size_t t = 0; t < g.m.reg.n; t++) {
        const ParamInfo *pi = &g.m.reg.p[t];
        double norm = 0;
        for (size_t j = 0; j < pi->numel; j++) norm += fabs(analytic[pi->offset + j]);
        CHECK_MSG(norm > 0, "%s: %s has an all-zero gradient", what, pi->name);
    }
    free(analytic);
    free(numeric);
    problem_free(&g);
}

static void test_grad_pre_norm_full_qk_softmax(void) {
    ModelConfig c = tiny_config();
    check_model_gradients("pre/full/softmax", &c, 2, 5);
}

static void test_grad_reordered_head_qk_sigmoid_renorm(void) {
    ModelConfig c = tiny_config();
    c.norm_placement = NORM_REORDERED, c.qk_norm = QK_NORM_HEAD;
    c.router = ROUTER_SIGMOID, c.norm_topk_prob = true;
    check_model_gradients("reordered/head/sigmoid/renorm", &c, 2, 5);
}

static void test_grad_shared_expert_dense_first_layer(void) {
    ModelConfig c = tiny_config();
    c.n_layers = 3, c.n_dense_layers = 1, c.shared_hidden = 5, c.qk_norm = QK_NORM_NONE;
    c.norm_topk_prob = true;
    check_model_gradients("dense-first/shared/no-qk-norm", &c, 2, 4);
}

static void test_grad_capacity_drops_no_gqa(void) {
    ModelConfig c = tiny_config();
    c.capacity_factor = 0.6, c.n_kv_heads = 2;
    check_model_gradients("capacity 0.6/MHA", &c, 2, 5);
}

static void test_grad_wide_gqa_reordered(void) {
    ModelConfig c = tiny_config();
    c.n_heads = 4, c.n_kv_heads = 2, c.head_dim = 2, c.norm_placement = NORM_REORDERED;
    c.n_experts = 5, c.top_k = 3;
    check_model_gradients("GQA 4/2, E5 K3", &c, 1, 7);
}

static void test_grad_random_routing(void) {
    ModelConfig c = tiny_config();
    c.random_routing = true;
    check_model_gradients("random routing", &c, 2, 4);
}

static void test_grad_loss_free_bias(void) {
    ModelConfig c = tiny_config();
    c.bias_gamma = 0.01, c.router = ROUTER_SIGMOID;
    check_model_gradients("loss-free bias", &c, 2, 4);
}

// The capacity config must really drop slots, or its test checks nothing of the drop path.
static void test_capacity_config_drops(void) {
    ModelConfig c = tiny_config();
    c.capacity_factor = 0.6;
    GradProblem g;
    problem_init(&g, &c, 2, 5, 11);
    total_loss(&g, false);
    size_t E = c.n_experts;
    double dropped = 0, routed = 0;
    for (int i = 0; i < model_n_moe_layers(&c); i++) {
        const real *st = g.metrics + model_metric_router(&c, i);
        dropped += st[router_stat_dropped(E)];
        for (size_t e = 0; e < E; e++) routed += st[e];
    }
    CHECK_MSG(dropped > 0 && dropped < routed, "dropped %g of %g slots", dropped, routed);
    problem_free(&g);
}

const TestCase gradcheck_tests[] = {
    {"gradcheck_pre_norm_full_qk_softmax", test_grad_pre_norm_full_qk_softmax},
    {"gradcheck_reordered_head_qk_sigmoid_renorm", test_grad_reordered_head_qk_sigmoid_renorm},
    {"gradcheck_shared_expert_dense_first_layer", test_grad_shared_expert_dense_first_layer},
    {"gradcheck_capacity_drops_no_gqa", test_grad_capacity_drops_no_gqa},
    {"gradcheck_wide_gqa_reordered", test_grad_wide_gqa_reordered},
    {"gradcheck_random_routing", test_grad_random_routing},
    {"gradcheck_loss_free_bias", test_grad_loss_free_bias},
    {"capacity_config_really_drops", test_capacity_config_drops},
    {0},
};

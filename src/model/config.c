// Model config defaults, validation with messages that name the key, and derived counts.
#include "config.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "params.h"

// The bundled default: a small MoE that learns tinyshakespeare bytes in minutes on two cores.
void model_config_defaults(ModelConfig *c) {
    *c = (ModelConfig){
        .vocab_size = 257, // bytes + EOS
        .d_model = 128,
        .n_layers = 4,
        .n_heads = 4,
        .n_kv_heads = 2,
        .head_dim = 0,
        .rope_theta = 10000,
        .norm_eps = 1e-5,
        .qk_norm = QK_NORM_FULL,
        .norm_placement = NORM_PRE,
        .n_dense_layers = 0,
        .dense_hidden = 512,
        .n_experts = 8,
        .top_k = 2,
        .expert_hidden = 256,
        .shared_hidden = 0,
        .router = ROUTER_SOFTMAX,
        .norm_topk_prob = false,
        .capacity_factor = 0,
        .random_routing = false,
        .lb_coef = 0.01,
        .z_coef = 0.001,
        .lm_z_coef = 0,
        .bias_gamma = 0,
        .init_std = 0.02,
    };
}

static int positive(int v, const char *key, MoeErr err) {
    return v > 0 ? 0 : moe_err(err, "config key '%s' must be a positive integer, got %d", key, v);
}

static int check_sizes(const ModelConfig *c, MoeErr err) {
    const struct { int v; const char *key; } sizes[] = {
        {c->vocab_size, "model.vocab_size"}, {c->d_model, "model.d_model"},
        {c->n_layers, "model.n_layers"},     {c->n_heads, "model.n_heads"},
        {c->n_kv_heads, "model.n_kv_heads"},
    };
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        if (positive(sizes[i].v, sizes[i].key, err)) return -1;
    if (c->n_dense_layers < 0 || c->n_dense_layers > c->n_layers)
        return moe_err(err, "config key 'model.n_dense_layers' = %d must be between 0 and "
                       "model.n_layers = %d", c->n_dense_layers, c->n_layers);
    if (c->n_dense_layers > 0 && positive(c->dense_hidden, "model.dense_hidden", err)) return -1;
    if (c->shared_hidden < 0)
        return moe_err(err, "config key 'model.shared_hidden' = %d must be >= 0 (0: no shared "
                       "expert)", c->shared_hidden);
    return 0;
}

static int check_heads(ModelConfig *c, MoeErr err) {
    if (c->n_heads % c->n_kv_heads)
        return moe_err(err, "model.n_kv_heads = %d must divide model.n_heads = %d (grouped-query "
                       "attention shares each key/value head among n_heads / n_kv_heads query "
                       "heads)", c->n_kv_heads, c->n_heads);
    if (c->head_dim == 0) {
        if (c->d_model % c->n_heads)
            return moe_err(err, "model.d_model = %d is not divisible by model.n_heads = %d (or set "
                           "model.head_dim explicitly)", c->d_model, c->n_heads);
        c->head_dim = c->d_model / c->n_heads;
    }
    if (c->head_dim < 2 || c->head_dim % 2)
        return moe_err(err, "model.head_dim = %d must be even and positive (RoPE rotates pairs)",
                       c->head_dim);
    return 0;
}

static int check_experts(const ModelConfig *c, MoeErr err) {
    if (model_n_moe_layers(c) == 0) return 0;
    if (positive(c->n_experts, "model.n_experts", err) || positive(c->top_k, "model.top_k", err) ||
        positive(c->expert_hidden, "model.expert_hidden", err))
        return -1;
    if (c->top_k > c->n_experts)
        return moe_err(err, "model.top_k = %d is larger than model.n_experts = %d", c->top_k,
                       c->n_experts);
    return 0;
}

static int check_reals(const ModelConfig *c, MoeErr err) {
    const struct { double v; const char *key; bool strict; } reals[] = {
        {c->rope_theta, "model.rope_theta", true},  {c->norm_eps, "model.norm_eps", true},
        {c->init_std, "model.init_std", true},      {c->capacity_factor, "model.capacity_factor", false},
        {c->lb_coef, "model.lb_coef", false},       {c->z_coef, "model.z_coef", false},
        {c->lm_z_coef, "model.lm_z_coef", false},   {c->bias_gamma, "model.bias_gamma", false},
    };
    for (size_t i = 0; i < sizeof reals / sizeof reals[0]; i++) {
        double v = reals[i].v;
        if (!(reals[i].strict ? v > 0 : v >= 0)) // also rejects NaN
            return moe_err(err, "config key '%s' = %g must be %s", reals[i].key, v,
                           reals[i].strict ? "> 0" : ">= 0");
    }
    return 0;
}

int model_config_validate(ModelConfig *c, MoeErr err) {
    if (check_sizes(c, err) || check_heads(c, err) || check_experts(c, err) || check_reals(c, err))
        return -1;
    return 0;
}

static int check_widths(const ModelConfig *c, size_t multiple, const char *backend, MoeErr err) {
    bool moe = model_n_moe_layers(c) > 0;
    const struct { int v; const char *key; bool used; } widths[] = {
        {c->d_model, "model.d_model", true}, {c->expert_hidden, "model.expert_hidden", moe},
        {c->dense_hidden, "model.dense_hidden", c->n_dense_layers > 0},
        {c->shared_hidden, "model.shared_hidden", moe}};
    for (size_t i = 0; i < sizeof widths / sizeof widths[0]; i++)
        if (widths[i].used && (size_t)widths[i].v % multiple)
            return moe_err(err, "%s needs %s to be a multiple of %zu (it is %d)", backend, widths[i].key,
                           multiple, widths[i].v);
    return 0;
}

// head_dim one of the listed widths (none listed: any), else a message listing them.
static int check_head_dim(const ModelConfig *c, const OpsLimits *l, const char *backend, MoeErr err) {
    size_t n = 0, max = sizeof l->head_dims / sizeof l->head_dims[0];
    for (; n < max && l->head_dims[n]; n++)
        if ((size_t)c->head_dim == l->head_dims[n]) return 0;
    if (n == 0) return 0;
    char list[64] = "";
    for (size_t i = 0; i < n; i++) {
        size_t len = strlen(list);
        snprintf(list + len, sizeof list - len, "%s%zu", i == 0 ? "" : i + 1 == n ? " or " : ", ", l->head_dims[i]);
    }
    return moe_err(err, "%s supports model.head_dim %s (it is %d)", backend, list, c->head_dim);
}

int model_config_check_limits(const ModelConfig *c, const OpsLimits *l, const char *backend, MoeErr err) {
    bool moe = model_n_moe_layers(c) > 0;
    if (moe && l->max_experts && (size_t)c->n_experts > l->max_experts)
        return moe_err(err, "%s supports model.n_experts up to %zu (it is %d)", backend, l->max_experts,
                       c->n_experts);
    if (moe && l->max_top_k && (size_t)c->top_k > l->max_top_k)
        return moe_err(err, "%s supports model.top_k up to %zu (it is %d)", backend, l->max_top_k, c->top_k);
    if (l->width_multiple > 1 && check_widths(c, l->width_multiple, backend, err)) return -1;
    return check_head_dim(c, l, backend, err);
}

static double attention_params(const ModelConfig *c) {
    double D = c->d_model, hd = c->head_dim;
    double qk_norm = c->qk_norm == QK_NORM_FULL ? (c->n_heads + c->n_kv_heads) * hd
                     : c->qk_norm == QK_NORM_HEAD ? 2 * hd : 0;
    return D * (double)model_qkv_width(c) + c->n_heads * hd * D + qk_norm + 2 * D; // + 2 norms
}

ParamCounts model_param_counts(const ModelConfig *c) {
    double D = c->d_model, V = c->vocab_size;
    double dense_ffn = 3.0 * D * c->dense_hidden;
    double expert = 3.0 * D * c->expert_hidden, shared = 3.0 * D * c->shared_hidden;
    double router = (double)c->n_experts * D;
    int n_moe = model_n_moe_layers(c);
    ParamCounts p = {.embedding = V * D};
    double common = V * D + D + V * D + c->n_layers * attention_params(c) +
                    c->n_dense_layers * dense_ffn + n_moe * (router + shared);
    p.total = common + n_moe * c->n_experts * expert;
    p.active = common + n_moe * c->top_k * expert;
    return p;
}

ModelFloor model_memory_floor(const ModelConfig *c) {
    double tensors = 3.0 * c->n_experts * model_n_moe_layers(c) + c->n_layers;
    return (ModelFloor){.weights = 16 * model_param_counts(c).total, .table = tensors * sizeof(ParamInfo)};
}

size_t model_expert_capacity(const ModelConfig *c, size_t T) {
    if (c->capacity_factor <= 0) return 0;
    return (size_t)ceil(c->capacity_factor * (double)T * c->top_k / c->n_experts);
}

size_t model_routed_rows(const ModelConfig *c, size_t T) {
    size_t slots = T * c->top_k, cap = model_expert_capacity(c, T);
    return cap && cap * c->n_experts < slots ? cap * c->n_experts : slots;
}

double model_forward_flops_per_token(const ModelConfig *c, size_t S) {
    double D = c->d_model, hd = c->head_dim, Hq = c->n_heads, Hkv = c->n_kv_heads;
    double attn = 2 * D * (2 * Hq * hd + 2 * Hkv * hd) + 2.0 * 2.0 * (double)S * Hq * hd / 2;
    double dense = 2 * 3 * D * c->dense_hidden;
    double moe = 2 * D * c->n_experts + 2 * 3 * D * c->expert_hidden * c->top_k +
                 2 * 3 * D * c->shared_hidden;
    int n_moe = model_n_moe_layers(c);
    return c->n_layers * attn + c->n_dense_layers * dense + n_moe * moe +
           2 * D * c->vocab_size;
}

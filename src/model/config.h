// The model's shape and options (the "model" section of a config file), their validation, and
// what follows from them: parameter counts and FLOPs per token (accounting of docs/MODEL.md).
#pragma once
#include <stdbool.h>
#include <stddef.h>

#include "common/util.h"
#include "ops/ops.h"

typedef enum { NORM_PRE, NORM_REORDERED } NormPlacement;

// Activations dropped after the forward and recomputed in the backward (train.recompute), each
// dropped buffer one for every layer and slot (model.c, Model.shared):
// - none: every activation the backward reads is kept;
// - selective: the cheap ones are recomputed (QK-norm + RoPE output, RMSNorm outputs, SwiGLU
//   activations, router scores, dispatched rows), the products that feed attention, the attention
//   output and its log-sum-exp are kept;
// - full: only each layer's input is kept; its backward reruns its whole forward first.
typedef enum { RECOMPUTE_NONE, RECOMPUTE_SELECTIVE, RECOMPUTE_FULL } Recompute;

typedef struct {
    int vocab_size;        // V
    int d_model;           // D
    int n_layers;          // L
    int n_heads;           // Hq
    int n_kv_heads;        // Hkv (divides Hq)
    int head_dim;          // hd (0: d_model / n_heads)
    double rope_theta;
    double norm_eps;
    QkNorm qk_norm;
    NormPlacement norm_placement;
    int n_dense_layers;    // the first layers use a dense SwiGLU instead of experts
    int dense_hidden;      // hidden width of those dense layers
    int n_experts;         // E
    int top_k;             // K
    int expert_hidden;     // H
    int shared_hidden;     // hidden width of a shared expert added to every MoE layer (0: none)
    RouterKind router;
    bool norm_topk_prob;   // renormalise the chosen weights to sum 1
    double capacity_factor; // 0: dropless; else capacity = ceil(cf * T * K / E) per expert
    bool random_routing;   // benchmark mode: uniform noise replaces the scores
    double lb_coef;        // load-balance loss coefficient (OLMo-core formula)
    double z_coef;         // router z-loss coefficient
    double lm_z_coef;      // LM-head z-loss coefficient
    double bias_gamma;     // loss-free balancing step (0: off)
    double init_std;
} ModelConfig;

void model_config_defaults(ModelConfig *c);
// Fills derived values (head_dim) and checks every constraint; on failure names the key.
int model_config_validate(ModelConfig *c, MoeErr err);

// Refuses a (validated) model the backend's kernels cannot run: the message starts with `backend`
// (e.g. "train.device = cuda") and names the key and the limit.
int model_config_check_limits(const ModelConfig *c, const OpsLimits *l, const char *backend, MoeErr err);

static inline bool model_layer_is_moe(const ModelConfig *c, int layer) {
    return layer >= c->n_dense_layers;
}
static inline int model_n_moe_layers(const ModelConfig *c) {
    return c->n_layers - c->n_dense_layers;
}
static inline size_t model_qkv_width(const ModelConfig *c) { // C: packed q, k, v per token
    return (size_t)(c->n_heads + 2 * c->n_kv_heads) * c->head_dim;
}

typedef struct {
    double total, active;       // parameters (active: what one token's forward touches)
    double embedding;           // input embedding (excluded from FLOPs)
} ParamCounts;

ParamCounts model_param_counts(const ModelConfig *c);

// Lower bounds of what training the whole model takes, by arithmetic alone (nothing is sized, so a
// config of any size can be judged): backend memory for fp32 weights, gradients and AdamW moments
// (16 bytes per parameter) and host memory for the table of its tensors (an entry per expert
// tensor at least). Over n ranks, the rank holding most holds at least 1/n of each.
typedef struct {
    double weights, table; // bytes
} ModelFloor;
ModelFloor model_memory_floor(const ModelConfig *c);

// Per-expert capacity of a MoE call of T tokens on one rank (0: dropless).
size_t model_expert_capacity(const ModelConfig *c, size_t T);
// Rows a rank dispatches in a MoE call of T tokens: every routed slot (dropless) or E x capacity,
// whichever is smaller.
size_t model_routed_rows(const ModelConfig *c, size_t T);
// Forward FLOPs per token at sequence length S (causal attention counted at half).
double model_forward_flops_per_token(const ModelConfig *c, size_t S);

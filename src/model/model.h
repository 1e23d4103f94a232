// The MoE language model: parameters, activation memory, and the forward/backward orchestration,
// written once in C against the ops interface and shared by every backend.
#pragma once
#include <stdint.h>

#include "config.h"
#include "ops/ops.h"
#include "params.h"

// Offsets of one layer's tensors in the flat parameter buffers (fused groups are adjacent).
typedef struct {
    size_t attn_norm, wqkv, q_norm, k_norm, wo, ffn_norm; // wqkv (C, D): q_proj | k_proj | v_proj
    size_t router;                    // (E, D)
    size_t experts_gu, experts_down;  // (E, 2H, D): gate | up per expert; (E, D, H)
    size_t shared_gu, shared_down;    // (2Hs, D), (D, Hs)
    size_t dense_gu, dense_down;      // (2Hd, D), (D, Hd)
} LayerParams;

// Activations one layer keeps for its backward. T = B S tokens, R rows of the expert buffers.
typedef struct {
    void *n1, *n1_rstd;        // act (T, D), f32 (T): attention-side norm output and 1/rms
    void *qkv_raw, *qkv;       // act (T, C): projection, then QK-norm + RoPE
    void *qk_rstd;             // f32 (T, Hq + Hkv)
    void *att, *att_lse;       // act (T, Hq hd), f32 (B, Hq, S)
    void *ap;                  // act (T, D) attention output projection
    void *h;                   // act (T, D) residual stream after attention
    void *n2, *n2_rstd;        // act (T, D), f32 (T): feed-forward-side norm
    void *f;                   // act (T, D) feed-forward output
    void *gu, *hact;           // act: dense (T, 2Hd), (T, Hd); MoE (R, 2H), (R, H)
    void *logits, *scores;     // act (T, E), f32 (T, E)
    int32_t *topk_idx;         // (T, K)
    void *topk_w;              // f32 (T, K)
    int32_t *counts, *offsets; // (E), (E + 1)
    int32_t *slot_pos;         // (T, K)
    void *xp, *y;              // act (R, D): dispatched rows, expert outputs
    void *sgu, *sact;          // act (T, 2Hs), (T, Hs): shared expert
} LayerActs;

// Gradient scratch shared by all layers, sized for the largest layer.
typedef struct {
    void *dres;               // act (T, D) gradient of the residual stream
    void *dn;                 // act (T, D)
    void *datt;               // act (T, Hq hd)
    void *dqkv, *dqkv_raw;    // act (T, C)
    void *dgu, *dhact;        // act (max R or T, 2 max(H, Hd, Hs)), (.., max hidden)
    void *dy, *dxp;           // act (R, D)
    void *dlogits;            // act (T, E)
    void *dtopk_w;            // f32 (T, K)
    void *dxf;                // act (T, D) gradient of the final-norm output
} Scratch;

// d(total loss) / d(each summed quantity a forward produces)
typedef struct {
    float ce;   // per token cross-entropy
    float lm_z; // per token LM-head logsumexp^2
    float lb;   // per call load-balance loss
    float z;    // per call router z-loss
} LossScales;

typedef struct {
    size_t B, S;        // this call's batch (at most what the model was sized for)
    bool train;         // keep activations, compute LM-head gradients for the backward
    uint64_t batch_id;  // salt of the routing noise (global index of the first sequence)
    LossScales scales;
    void *metrics;      // f32 accumulators (model_metrics_len)
} ForwardArgs;

typedef struct {
    ModelConfig cfg;
    const Ops *ops;
    ParamRegistry reg;
    LayerParams *layer;          // (L)
    size_t wte, final_norm, lm_head;
    void *params;                // f32 (P) master weights
    void *params_act;            // act (P) compute weights (== params when the backend aliases)
    void *grads;                 // f32 (P)
    void *adam_m, *adam_v;       // f32 (P)
    void *expert_bias;           // f32 (L, E) loss-free balancing bias (0 for dense layers)
    void *rope;                  // f32 (S, hd / 2, 2)
    StepInfo *step_info;         // backend memory, written before each step
    void *metrics_scratch;       // f32 (model_metrics_len) for forwards whose metrics are unused
    size_t B, S;                 // activation memory is sized for B x S
    int32_t *tokens, *targets;   // (B S)
    LayerActs *acts;             // (L)
    void **resid;                // (L + 1) act (T, D): input of each layer, then the last output
    void *xf, *xf_rstd;          // act (T, D), f32 (T): final norm
    void *logits;                // act (chunk, V) LM-head logits, one chunk at a time
    size_t logit_rows;           // rows per chunk
    Scratch s;
    void **allocs;               // every backend allocation, for model_free
    size_t n_allocs;
    size_t bytes;                // their total size
} Model;

// Metrics accumulated in backend memory during a step (f32): [0] summed CE, [1] summed LM
// logsumexp^2, [2] gradient norm squared, then router_stats_len(E) values per MoE layer.
enum { METRIC_CE, METRIC_LM_Z, METRIC_GRAD_NORM_SQ, METRIC_ROUTER };
size_t model_metrics_len(const ModelConfig *c);
static inline size_t model_metric_router(const ModelConfig *c, int moe_index) {
    return METRIC_ROUTER + (size_t)moe_index * router_stats_len((size_t)c->n_experts);
}

// Builds the registry and allocates parameters, optimizer state and activations for B x S.
void model_init(Model *m, const ModelConfig *cfg, const Ops *ops, size_t B, size_t S);
void model_free(Model *m);
// Random initial weights (params_init_values), zero moments and bias.
void model_init_weights(Model *m, unsigned seed);
// Refreshes the compute copy after the master weights changed (load, optimizer).
void model_sync_compute_weights(Model *m);

void *model_alloc(Model *m, size_t bytes); // backend memory freed with the model
void *model_act(const Model *m, void *base, size_t offset);  // element offset in an act buffer
void *model_f32(const Model *m, void *base, size_t offset);  // element offset in an f32 buffer

// Uploads B sequences of S + 1 tokens (inputs and shifted targets).
void model_set_batch(Model *m, const int32_t *seqs, size_t B, size_t S);
// Forward of the batch set last; in training mode also the LM-head gradient (fused loss).
void model_forward(Model *m, const ForwardArgs *a);
// Backward after a training forward: accumulates every parameter gradient.
void model_backward(Model *m, const ForwardArgs *a);
// Next-token logits (V) of the last position of one sequence of n tokens, on the host.
void model_last_logits(Model *m, const int32_t *tokens, size_t n, float *logits);

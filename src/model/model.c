// Model orchestration: parameter registration in fused layouts, memory planning, and the forward
// and backward passes of every block, expressed only through the ops interface.
#include "model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

// ---------------------------------------------------------------- registry and memory

static size_t add_layer_param(Model *m, int l, int expert, const char *suffix, size_t rows,
                              size_t cols, bool decay, bool ones) {
    char name[256];
    snprintf(name, sizeof name, "model.layers.%d.%s", l, suffix);
    return params_add(&m->reg, name, rows, cols, decay, ones, l, expert);
}

// gate_proj and up_proj registered back to back form one (2H, D) weight; experts registered one
// after another make expert e's fused weight block e of an (E, 2H, D) tensor.
static size_t add_gate_up(Model *m, int l, const char *prefix, int expert, size_t H) {
    char suffix[128];
    snprintf(suffix, sizeof suffix, "%s.gate_proj.weight", prefix);
    size_t gu = add_layer_param(m, l, expert, suffix, H, m->cfg.d_model, true, false);
    snprintf(suffix, sizeof suffix, "%s.up_proj.weight", prefix);
    add_layer_param(m, l, expert, suffix, H, m->cfg.d_model, true, false);
    return gu;
}

static size_t add_down(Model *m, int l, const char *prefix, int expert, size_t H) {
    char suffix[128];
    snprintf(suffix, sizeof suffix, "%s.down_proj.weight", prefix);
    return add_layer_param(m, l, expert, suffix, m->cfg.d_model, H, true, false);
}

static void register_attention(Model *m, int l, LayerParams *p) {
    const ModelConfig *c = &m->cfg;
    size_t D = c->d_model, hd = c->head_dim, Hq = c->n_heads, Hkv = c->n_kv_heads;
    p->attn_norm = add_layer_param(m, l, -1, "input_layernorm.weight", D, 0, false, true);
    p->wqkv = add_layer_param(m, l, -1, "self_attn.q_proj.weight", Hq * hd, D, true, false);
    add_layer_param(m, l, -1, "self_attn.k_proj.weight", Hkv * hd, D, true, false);
    add_layer_param(m, l, -1, "self_attn.v_proj.weight", Hkv * hd, D, true, false);
    if (c->qk_norm != QK_NORM_NONE) {
        bool head = c->qk_norm == QK_NORM_HEAD;
        p->q_norm = add_layer_param(m, l, -1, "self_attn.q_norm.weight", head ? hd : Hq * hd, 0, false, true);
        p->k_norm = add_layer_param(m, l, -1, "self_attn.k_norm.weight", head ? hd : Hkv * hd, 0, false, true);
    }
    p->wo = add_layer_param(m, l, -1, "self_attn.o_proj.weight", D, Hq * hd, true, false);
    p->ffn_norm = add_layer_param(m, l, -1, "post_attention_layernorm.weight", D, 0, false, true);
}

// Dense part of a feed-forward layer: the router and shared expert of a MoE layer, or a dense MLP.
static void register_ffn_dense(Model *m, int l, LayerParams *p) {
    const ModelConfig *c = &m->cfg;
    if (!model_layer_is_moe(c, l)) {
        p->dense_gu = add_gate_up(m, l, "mlp", -1, c->dense_hidden);
        p->dense_down = add_down(m, l, "mlp", -1, c->dense_hidden);
        return;
    }
    p->router = add_layer_param(m, l, -1, "mlp.gate.weight", c->n_experts, c->d_model, true, false);
    if (c->shared_hidden) {
        p->shared_gu = add_gate_up(m, l, "mlp.shared_expert", -1, c->shared_hidden);
        p->shared_down = add_down(m, l, "mlp.shared_expert", -1, c->shared_hidden);
    }
}

// This rank's experts of a MoE layer: all gate|up blocks, then all down blocks.
static void register_experts(Model *m, int l, LayerParams *p) {
    const ModelConfig *c = &m->cfg;
    int e0 = m->par->lay.expert_begin;
    char prefix[64];
    for (int pass = 0; pass < 2; pass++)
        for (int e = e0; e < e0 + m->n_experts_local; e++) {
            snprintf(prefix, sizeof prefix, "mlp.experts.%d", e);
            size_t off = pass ? add_down(m, l, prefix, e, c->expert_hidden)
                              : add_gate_up(m, l, prefix, e, c->expert_hidden);
            if (e == e0) *(pass ? &p->experts_down : &p->experts_gu) = off;
        }
}

// Shards start on 64-element boundaries, whatever the group size.
#define REGION_ALIGN 64

static void register_params(Model *m) {
    const ModelConfig *c = &m->cfg;
    size_t D = c->d_model, V = c->vocab_size;
    m->layer = moe_calloc(c->n_layers, sizeof(LayerParams));
    m->expert_dw_written = moe_calloc(c->n_layers, sizeof(bool));
    params_begin_region(&m->reg, PARAM_DENSE);
    if (m->first_stage) m->wte = params_add(&m->reg, "model.embed_tokens.weight", V, D, false, false, -1, -1);
    for (int l = 0; l < c->n_layers; l++)
        if (model_holds_layer(m, l)) {
            register_attention(m, l, &m->layer[l]);
            register_ffn_dense(m, l, &m->layer[l]);
        }
    if (m->last_stage) {
        m->final_norm = params_add(&m->reg, "model.norm.weight", D, 0, false, true, -1, -1);
        m->lm_head = params_add(&m->reg, "lm_head.weight", V, D, true, false, -1, -1);
    }
    params_end_region(&m->reg, PARAM_DENSE, REGION_ALIGN * (size_t)m->par->dp->size);
    params_begin_region(&m->reg, PARAM_EXPERT);
    for (int l = 0; l < c->n_layers; l++)
        if (model_holds_layer(m, l) && model_layer_is_moe(c, l)) register_experts(m, l, &m->layer[l]);
    params_end_region(&m->reg, PARAM_EXPERT, REGION_ALIGN * (size_t)m->par->edp->size);
}

void *model_alloc(Model *m, size_t bytes) { return pool_alloc(&m->mem, bytes); }

Comm *model_region_group(const Model *m, ParamRegion r) {
    return r == PARAM_DENSE ? m->par->dp : m->par->edp;
}

void model_region_shard(const Model *m, ParamRegion r, size_t *begin, size_t *size) {
    const Comm *g = model_region_group(m, r);
    *size = m->reg.region_size[r] / (size_t)g->size;
    *begin = m->reg.region_begin[r] + (size_t)g->rank * *size;
}

// The part of each region the master weights hold (see Model.master_begin).
static void init_master(Model *m) {
    m->master_len = 0;
    for (int r = 0; r < PARAM_N_REGIONS; r++) {
        if (m->ops->act_aliases_f32)
            m->master_begin[r] = m->reg.region_begin[r], m->master_size[r] = m->reg.region_size[r];
        else
            model_region_shard(m, (ParamRegion)r, &m->master_begin[r], &m->master_size[r]);
        m->master_len += m->master_size[r];
    }
}

void *model_master(const Model *m, size_t offset) {
    ParamRegion r = offset >= m->reg.region_begin[PARAM_EXPERT] ? PARAM_EXPERT : PARAM_DENSE;
    MOE_ASSERT(offset >= m->master_begin[r] && offset <= m->master_begin[r] + m->master_size[r]);
    size_t before = r == PARAM_EXPERT ? m->master_size[PARAM_DENSE] : 0; // the regions back to back
    return (char *)m->params + (before + offset - m->master_begin[r]) * m->ops->f32_size;
}

bool model_master_part(const Model *m, const ParamInfo *p, size_t *a, size_t *b) {
    ParamRegion r = params_region(p);
    return params_part(p, m->master_begin[r], m->master_begin[r] + m->master_size[r], a, b);
}

// full (size x n) on the group's rank 0 = every rank's shard (n) in rank order; the others send.
static void gather_to_first(Comm *g, const Ops *ops, const void *shard, void *full, size_t n) {
    if (g->rank != 0) {
        g->ops->send(g, shard, n, COMM_F32, 0);
        return;
    }
    ops->copy(full, shard, n * ops->f32_size);
    if (g->ops->group_begin) g->ops->group_begin();
    for (int j = 1; j < g->size; j++)
        g->ops->recv(g, (char *)full + (size_t)j * n * ops->f32_size, n, COMM_F32, j);
    if (g->ops->group_end) g->ops->group_end();
}

void *model_gather_region(Model *m, ParamRegion r, void *held, size_t n_held, bool *owned) {
    Comm *g = model_region_group(m, r);
    const Ops *ops = m->ops;
    *owned = false;
    if (n_held == m->reg.region_size[r]) return held;
    *owned = g->rank == 0;
    void *full = *owned ? ops->alloc(m->reg.region_size[r] * ops->f32_size) : NULL;
    gather_to_first(g, ops, held, full, n_held);
    return full;
}

void *model_act(const Model *m, void *base, size_t offset) {
    return (char *)base + offset * m->ops->act_size;
}

void *model_f32(const Model *m, void *base, size_t offset) {
    return (char *)base + offset * m->ops->f32_size;
}

static void *act_buf(Model *m, size_t n) { return pool_act(&m->mem, n); }
static void *f32_buf(Model *m, size_t n) { return pool_f32(&m->mem, n); }
static int32_t *i32_buf(Model *m, size_t n) { return pool_i32(&m->mem, n); }

bool model_holds_layer(const Model *m, int l) {
    for (int c = 0; c < m->n_chunks; c++)
        if (l >= m->chunk[c].layer_begin && l < m->chunk[c].layer_end) return true;
    return false;
}

void model_grads_consumed(Model *m, int u0, int u1) {
    for (int l = u0 < 0 ? 0 : u0; l < u1 && l < m->cfg.n_layers; l++) m->expert_dw_written[l] = false;
}

static int chunk_layers(const ModelChunk *k) { return k->layer_end - k->layer_begin; }

static int n_local_moe_layers(const Model *m) {
    int n = 0;
    for (int l = 0; l < m->cfg.n_layers; l++) n += model_holds_layer(m, l) && model_layer_is_moe(&m->cfg, l);
    return n;
}

static int n_local_layers(const Model *m) {
    int n = 0;
    for (int c = 0; c < m->n_chunks; c++) n += chunk_layers(&m->chunk[c]);
    return n;
}

// MoE calls whose expert rows are kept: each MoE layer of a chunk, once per activation slot.
static int moe_calls(const Model *m) {
    int n = 0;
    for (int c = 0; c < m->n_chunks; c++)
        for (int l = m->chunk[c].layer_begin; l < m->chunk[c].layer_end; l++)
            n += m->chunk[c].n_slots * model_layer_is_moe(&m->cfg, l);
    return n;
}

// A layer's buffer of n elements: `shared` when the recompute mode drops it (non-NULL), else its own.
static void *layer_act(Model *m, void *shared, size_t n) { return shared ? shared : act_buf(m, n); }
static void *layer_f32(Model *m, void *shared, size_t n) { return shared ? shared : f32_buf(m, n); }
static int32_t *layer_i32(Model *m, int32_t *shared, size_t n) { return shared ? shared : i32_buf(m, n); }

bool model_keeps_fp8_n1(const Model *m) {
    return m->fp8 && m->fp8->dense[FP8_DENSE_QKV] && m->recompute == RECOMPUTE_NONE &&
           m->cfg.norm_placement == NORM_PRE;
}

// FP8 experts held here on one expert-parallel rank, in one exchange chunk: their rows are the
// dispatched rows of this rank's tokens, in one call over every expert.
static bool fp8_experts_one_chunk(const Model *m) {
    return m->fp8 && m->par->ep->size == 1 && m->xchg.chunks == 1 && n_local_moe_layers(m) > 0;
}

bool model_keeps_fp8_xe(const Model *m) { return m->recompute == RECOMPUTE_NONE && fp8_experts_one_chunk(m); }

// Whether the experts' FP8 operands are read from the tokens' rows of the layer's input and output
// gradient (train.fp8_fused_dispatch; one expert-parallel rank, one exchange chunk, no
// train.fp8_exchange; reads_token_rows): the dispatch and the combine's backward then copy no rows.
static bool model_reads_token_rows(const Model *m) {
    return fp8_experts_one_chunk(m) && m->fp8->fused_dispatch && !m->fp8->exchange;
}

// A kept token-major FP8 copy (Fp8Cols) of an input of K columns, R rows in El groups.
static Fp8Cols alloc_fp8_cols(Model *m, size_t R, size_t El, size_t K) {
    size_t Tt = fp8_expert_cols(R, El);
    return (Fp8Cols){.q = model_alloc(m, K * Tt), .scales = model_alloc(m, Tt / FP8_BLOCK * K * m->ops->f32_size)};
}

static void alloc_moe_acts(Model *m, LayerActs *a, size_t T) {
    const ModelConfig *c = &m->cfg;
    const LayerActs *sh = &m->shared;
    size_t D = c->d_model, E = c->n_experts, K = c->top_k;
    size_t R = model_routed_rows(c, T), Rr = moe_exchange_received_rows(&m->xchg, T);
    bool ep = m->par->ep->size > 1;
    a->logits = layer_act(m, sh->logits, T * E), a->scores = layer_f32(m, sh->scores, T * E);
    a->topk_idx = layer_i32(m, sh->topk_idx, T * K), a->topk_w = layer_f32(m, sh->topk_w, T * K);
    a->aux = f32_buf(m, router_aux_len(E)); // every mode keeps it: the micro-batch's (summed over dp)
    a->counts = layer_i32(m, sh->counts, E), a->offsets = layer_i32(m, sh->offsets, E + 1);
    a->slot_pos = layer_i32(m, sh->slot_pos, T * K);
    a->xp = layer_act(m, sh->xp, R * D);
    if (ep) a->y = sh->y ? sh->y : moe_exchange_buf(&m->xchg, R);
    a->xe = !ep ? a->xp : sh->xe ? sh->xe : moe_exchange_recv_buf(&m->xchg, Rr);
    if (model_keeps_fp8_xe(m)) a->xe_t = alloc_fp8_cols(m, Rr, (size_t)m->n_experts_local, D);
    if (ep && sh->routes.offsets) a->routes = sh->routes;
    else if (ep) moe_exchange_routes_init(&m->xchg, &a->routes);
    if (c->shared_hidden)
        a->sgu = layer_act(m, sh->sgu, T * 2 * c->shared_hidden), a->sact = layer_act(m, sh->sact, T * c->shared_hidden);
}

// train.fp8_exchange (fp8_exchanges), and with several expert-parallel ranks (receives_fp8): the rows
// that travel to the experts, their inputs (LayerActs.xe) and the output gradients of their down
// projection (Scratch.dye8), arrive as FP8 rows: codes (Rr, D), then their scales (Rr, send_pitch)
// row-major (received_scales).
static bool fp8_exchanges(const Model *m) { return m->fp8 && m->fp8->exchange; }
static bool receives_fp8(const Model *m) { return fp8_exchanges(m) && m->par->ep->size > 1; }

// With one expert-parallel rank no MoE layer keeps its experts' SwiGLU output: they share
// Model.expert_hact (alloc_expert_hact), and the backward takes the combine weights' gradients from
// the kept gate|up rows.
static bool experts_share_hact(const Model *m) { return m->par->ep->size == 1 && n_local_moe_layers(m) > 0; }

// Whether the experts' SwiGLU backward makes the FP8 operands of the products it feeds in the same
// pass (fused_swiglu_backward, fused_swiglu_grads; train.fp8_fused_swiglu): in FP8 without
// train.fp8_exchange (whose backward writes the experts' inputs' row scales, or with one rank their
// rows too, into Fp8Operands while it holds the gate|up gradient's), and with an expert_hidden in
// whole 128-column blocks (a gate block then never shares a 1x128 block of the gate|up gradient with
// an up block).
static bool fuses_swiglu_fp8(const Model *m) {
    return m->fp8 && m->fp8->fused_swiglu && !fp8_exchanges(m) && n_local_moe_layers(m) > 0 &&
           m->cfg.expert_hidden % FP8_BLOCK == 0;
}

// Where fuses_swiglu_fp8 with one expert-parallel rank: the token-major copy of the experts' gate|up
// gradient (Rr rows over El experts, 2 expert_hidden wide) in scratch A (codes, then their scales);
// and its bytes.
static size_t fused_dgu_cols_bytes(const Model *m, size_t Rr, size_t El) {
    size_t C = 2 * (size_t)m->cfg.expert_hidden, Tt = fp8_expert_cols(Rr, El);
    return C * Tt + Tt / FP8_BLOCK * C * m->ops->f32_size;
}
static Fp8Cols fused_dgu_cols(const Model *m, size_t Rr, size_t El) {
    size_t C = 2 * (size_t)m->cfg.expert_hidden;
    return (Fp8Cols){.q = m->s.dgu, .scales = (char *)m->s.dgu + C * fp8_expert_cols(Rr, El)};
}

// The buffers of a MoE or a dense layer, or with both (the shared set of full recompute) of a
// layer of either kind: the larger of their SwiGLU sizes.
static void alloc_layer_acts(Model *m, LayerActs *a, size_t T, bool moe, bool dense) {
    const ModelConfig *c = &m->cfg;
    const LayerActs *sh = &m->shared;
    size_t D = c->d_model, C = model_qkv_width(c), Dq = (size_t)c->n_heads * c->head_dim;
    size_t expert = moe ? moe_exchange_received_rows(&m->xchg, T) * c->expert_hidden : 0; // rows x width
    size_t hidden = size_max(experts_share_hact(m) ? 0 : expert, dense ? T * c->dense_hidden : 0); // hact's, if kept
    a->n1 = layer_act(m, sh->n1, T * D), a->n1_rstd = layer_f32(m, sh->n1_rstd, T);
    if (model_keeps_fp8_n1(m)) a->n1_t = alloc_fp8_cols(m, T, 1, D);
    a->qkv_raw = layer_act(m, sh->qkv_raw, T * C), a->qkv = layer_act(m, sh->qkv, T * C);
    a->qk_rstd = layer_f32(m, sh->qk_rstd, T * (c->n_heads + c->n_kv_heads));
    a->att = layer_act(m, sh->att, T * Dq), a->att_lse = layer_f32(m, sh->att_lse, T * c->n_heads);
    a->ap = layer_act(m, sh->ap, T * D), a->h = layer_act(m, sh->h, T * D);
    a->n2 = layer_act(m, sh->n2, T * D), a->n2_rstd = layer_f32(m, sh->n2_rstd, T);
    a->f = layer_act(m, sh->f, T * D);
    a->gu = layer_act(m, sh->gu, 2 * size_max(expert, hidden));
    a->hact = hidden ? layer_act(m, sh->hact, hidden) : NULL;
    if (moe) alloc_moe_acts(m, a, T);
}

// Rows x hidden width of the largest SwiGLU (experts, dense and shared MLPs) of a call of T tokens.
static size_t swiglu_elems(const Model *m, size_t T) {
    const ModelConfig *c = &m->cfg;
    bool moe = model_n_moe_layers(c) > 0;
    size_t rows = size_max(moe ? moe_exchange_received_rows(&m->xchg, T) : 0, T);
    size_t hidden = size_max(c->n_dense_layers ? (size_t)c->dense_hidden : 0, (size_t)c->shared_hidden);
    return rows * size_max(hidden, moe ? (size_t)c->expert_hidden : 0);
}

// Rows of the LM-head logits computed at a time (the backend's chunk of logits), for calls of T tokens.
static size_t head_logit_rows(const Model *m, size_t T) {
    size_t rows = m->ops->logits_chunk / m->cfg.vocab_size;
    return rows < 1 ? 1 : rows > T ? T : rows;
}

// Rows received as FP8 (receives_fp8) that the backward dequantises into scratch A (the down
// projection's output gradients) and B (the experts' inputs), d_model wide; else 0.
static size_t received_fp8_rows(const Model *m, size_t T) {
    return receives_fp8(m) && model_n_moe_layers(&m->cfg) > 0 ? moe_exchange_received_rows(&m->xchg, T) : 0;
}

// Elements of gradient scratch A (Scratch), for calls of T tokens; on the last stage the head's
// logits too (alloc_head).
static size_t scratch_a_elems(const Model *m, size_t T) {
    const ModelConfig *c = &m->cfg;
    size_t R = model_n_moe_layers(c) > 0 ? model_routed_rows(c, T) : 0;
    size_t logits = m->last_stage ? head_logit_rows(m, T) * c->vocab_size : 0;
    R = size_max(R, received_fp8_rows(m, T)); // the down projection's output gradients dequantised
    size_t act = m->ops->act_size, dgu_cols = 0, Rr = moe_exchange_received_rows(&m->xchg, T);
    if (fuses_swiglu_fp8(m) && m->par->ep->size == 1) // fused_swiglu_backward's
        dgu_cols = size_ceil_div(fused_dgu_cols_bytes(m, Rr, m->n_experts_local), act);
    return size_max(size_max(size_max(R * (size_t)c->d_model, 2 * swiglu_elems(m, T)), dgu_cols),
                    size_max(T * model_qkv_width(c), logits));
}

// Elements of gradient scratch B (Scratch), for calls of T tokens: with selective recompute it also
// holds the shared SwiGLU activations at its top, beside dhact at its bottom, and qkv
// (alloc_selective_shared); on the last stage the final norm's output (alloc_head). At least (T, C)
// in every mode, though only selective recompute's qkv needs it since the QK-norm backward works in
// place: without it the bench shapes save nothing (R D is larger) and ep=2 ~67 MB, and the CPU memory
// rows of tests/data/plan-measured.tsv, measured with it, would have to be measured again.
static size_t scratch_b_elems(const Model *m, size_t T) {
    const ModelConfig *c = &m->cfg;
    bool moe = model_n_moe_layers(c) > 0, ep = m->par->ep->size > 1;
    size_t R = moe && !ep ? model_routed_rows(c, T) : received_fp8_rows(m, T); // with ep, the inputs dequantised
    size_t xf = m->last_stage ? T * (size_t)c->d_model : 0;
    size_t swiglu = (m->recompute == RECOMPUTE_SELECTIVE ? 2 : 1) * swiglu_elems(m, T);
    return size_max(size_max(R * (size_t)c->d_model, swiglu), size_max(T * model_qkv_width(c), xf));
}

// Elements of scratch datt: (T, Hq hd), with selective recompute and pre-norm at least (T, D) for h.
static size_t scratch_datt_elems(const Model *m, size_t T) {
    const ModelConfig *c = &m->cfg;
    bool h = m->recompute == RECOMPUTE_SELECTIVE && c->norm_placement == NORM_PRE;
    return T * size_max((size_t)c->n_heads * c->head_dim, h ? (size_t)c->d_model : 0);
}

// Selective recompute: the activations it drops are recomputed in the backward, cheaply, into one
// buffer each for every layer and slot (sized for the largest layer): the QK-norm + RoPE output and
// its 1/rms (from the kept projection), the RMSNorm outputs (one buffer: a pre-norm backward reruns
// each norm just before its use, a reordered backward reads neither) and with pre-norm their 1/rms,
// the SwiGLU activations of experts, dense and shared MLPs (one buffer, from the kept gate|up rows),
// the router's logits (one small product from the layer's input), scores, choice, weights and
// counts, and with one expert-parallel rank the dispatched rows (gathered again from the layer's
// input). With pre-norm, the residual stream after attention too (h = in + att Wo^T again, from the
// kept attention output: one dense product a layer, residual_recompute). Not read by the backward
// at all: with pre-norm the attention projection and the feed-forward output; with several
// expert-parallel ranks the rows sent to the experts. The rows this rank's experts received (xe)
// stay kept per layer there: recomputing them would redo the exchange.
//
// The large ones live in the backward's scratch (alloc_scratch), which no forward reads (FP8's
// Fp8Operands.sum is Scratch.dxf, lent to none of them), where no backward step reads them while
// it writes that scratch (layer_backward's order; docs/ARCHITECTURE.md, activation memory):
// - qkv in B: written just before the attention kernel's backward reads it, which writes dqkv to A
//   (the QK-norm backward then makes the projection's gradient in place there, from the kept
//   projection, not from qkv).
// - the SwiGLU activations at B's top, dhact at its bottom (B holds both: scratch_b_elems); B's
//   later contents (dgu is A; the rows' gradient dxp, B) come after their last read.
// - xp (one expert-parallel rank) in B from its bottom: the forward gathers it after attention
//   and its gate|up product reads it before the SwiGLU writes B's top; the backward gathers it again
//   after the SwiGLU backward has read dhact (rows_recompute), and the gate|up product's backward
//   reads it for the weight gradient before writing dxp over it (expert_backward). With several
//   ranks xp is read by the forward alone: A, which their forward leaves alone (y is kept).
// - h (pre-norm) in datt: last read by the feed-forward norm's backward, before the attention
//   backward writes datt; ap and f (pre-norm) in dn: ap is read once, by the add that recomputes h,
//   before the feed-forward backward writes dn; f is not read by the backward.
// - n1 and n2 in dxf, which the head alone uses as its gradient, after the layers, and FP8 only as
//   the sum of an accumulating dense product: the shared expert's down projection (forward: n2's last
//   reader, the gate|up product, came before; reordered, n1 was added to h before and n2 comes
//   after), and with reordered norms the QKV and gate|up input gradients (whose backward reads no
//   norm output); a pre-norm backward accumulates through no FP8 dense product.
static void alloc_selective_shared(Model *m, size_t T) {
    const ModelConfig *c = &m->cfg;
    const Scratch *g = &m->s;
    LayerActs *s = &m->shared;
    size_t E = c->n_experts, K = c->top_k, swiglu = swiglu_elems(m, T);
    bool pre = c->norm_placement == NORM_PRE;
    s->qkv = g->dhact, s->qk_rstd = f32_buf(m, T * (c->n_heads + c->n_kv_heads));
    s->n1 = s->n2 = g->dxf;
    if (pre) s->ap = s->f = g->dn, s->h = g->datt, s->n1_rstd = s->n2_rstd = f32_buf(m, T);
    s->hact = s->sact = model_act(m, g->dhact, scratch_b_elems(m, T) - swiglu);
    if (n_local_moe_layers(m) == 0) return;
    s->logits = act_buf(m, T * E), s->scores = f32_buf(m, T * E);
    s->topk_idx = i32_buf(m, T * K), s->topk_w = f32_buf(m, T * K), s->counts = i32_buf(m, E);
    s->aux = f32_buf(m, router_aux_len(E)); // a recomputed router's own summary (not the kept one)
    s->xp = m->par->ep->size > 1 ? g->dy : g->dhact;
}

// Recompute none with FP8 copies kept in place of the attention norm's output or the experts' rows
// (model_keeps_fp8_n1, _xe): the forward alone reads those, so one buffer serves every layer and
// slot: the backward's scratch (alloc_scratch), as no forward reads its dn or B: n1 is dn (T, D), xp
// is B (with one expert-parallel rank at least (R, D)).
static void alloc_fp8_kept_shared(Model *m) {
    if (model_keeps_fp8_n1(m)) m->shared.n1 = m->s.dn;
    if (model_keeps_fp8_xe(m)) m->shared.xp = m->s.dhact;
}

// With one expert-parallel rank no MoE layer keeps its experts' SwiGLU output (Model.expert_hact):
// one buffer serves them all, selective recompute's shared SwiGLU buffer where there is one; none
// where the SwiGLU backward is fused with its FP8 operands (fuses_swiglu_fp8: the forward stores only
// the output's codes and the backward makes hw's token-major copy from gu, so nothing reads it).
static void alloc_expert_hact(Model *m, size_t T) {
    if (!experts_share_hact(m) || fuses_swiglu_fp8(m)) return;
    size_t n = moe_exchange_received_rows(&m->xchg, T) * m->cfg.expert_hidden;
    m->expert_hact = m->shared.hact ? m->shared.hact : act_buf(m, n);
}

// Full recompute: one layer's buffers, for a layer of any kind held here, serve every layer and
// slot; each layer keeps only its input (SlotActs.resid) and router summary, and its backward
// reruns its forward into these first. With several expert-parallel ranks the rerun redoes the
// expert exchange: every rank of the ep group reruns the same layer at the same point of its
// backward, so the exchange is consistent (and the buffers peers write are these, once).
static void alloc_full_shared(Model *m, size_t T) {
    int moe = n_local_moe_layers(m);
    LayerActs one = {0};
    alloc_layer_acts(m, &one, T, moe > 0, moe < n_local_layers(m)); // Model.shared empty: all its own
    m->shared = one;
}

static void alloc_scratch(Model *m, size_t T) {
    const ModelConfig *c = &m->cfg;
    size_t D = c->d_model;
    bool moe = model_n_moe_layers(c) > 0;
    size_t R = moe ? model_routed_rows(c, T) : 0, Rr = moe ? moe_exchange_received_rows(&m->xchg, T) : 0;
    bool ep = m->par->ep->size > 1;
    Scratch *s = &m->s;
    s->dres = act_buf(m, T * D), s->datt = act_buf(m, scratch_datt_elems(m, T)), s->dn = act_buf(m, T * D);
    void *a = act_buf(m, scratch_a_elems(m, T)); // dy, dgu, dqkv
    void *b = act_buf(m, scratch_b_elems(m, T)); // dhact, dxp
    s->dqkv = a, s->dgu = a, s->dhact = b;
    s->dxf = act_buf(m, T * D);
    if (moe) {
        s->dy = a, s->dxp = ep ? moe_exchange_buf(&m->xchg, R) : b;
        s->dlogits = act_buf(m, T * c->n_experts), s->dtopk_w = f32_buf(m, T * c->top_k);
        if (ep) s->dxe = moe_exchange_buf(&m->xchg, Rr);
        else s->row_w = f32_buf(m, Rr), s->row_dot = f32_buf(m, Rr);
        if (receives_fp8(m)) s->dye8 = moe_exchange_recv_buf(&m->xchg, Rr);
        if (model_reads_token_rows(m)) s->row_token = i32_buf(m, Rr);
    }
}

// The head's buffers (last stage): its final-norm output xf in scratch B and a chunk of logits in
// scratch A. The head runs after the layers, whose scratch and shared buffers are then free (none
// holds anything from one layer's forward or backward to the next), and no forward or backward
// calls it between two steps of theirs.
static void alloc_head(Model *m, size_t T) {
    m->xf = m->s.dhact, m->xf_rstd = f32_buf(m, T);
    m->logit_rows = head_logit_rows(m, T);
    m->logits = m->s.dqkv;
}

// cos and sin of position s times frequency theta^(-2i / hd), for i < hd / 2
static void upload_rope(Model *m, size_t S) {
    size_t hd = m->cfg.head_dim, half = hd / 2;
    m->rope = f32_buf(m, S * hd);
    if (m->ops->sizing_only) return;
    float *tab = moe_malloc(S * hd * sizeof(float));
    for (size_t s = 0; s < S; s++)
        for (size_t i = 0; i < half; i++) {
            double angle = (double)s * pow(m->cfg.rope_theta, -2.0 * (double)i / (double)hd);
            tab[s * hd + 2 * i] = (float)cos(angle);
            tab[s * hd + 2 * i + 1] = (float)sin(angle);
        }
    m->ops->upload_f32(m->rope, tab, S * hd);
    free(tab);
}

size_t model_metrics_len(const ModelConfig *c) {
    return METRIC_ROUTER + (size_t)model_n_moe_layers(c) * router_stats_len((size_t)c->n_experts);
}

// The output of a chunk's last layer: the head's input in the last chunk, read by the head alone,
// within the forward that writes it, so scratch dn (no backward reads it, and the head reads no dn;
// the last layer's forward reads dn's other tenants, n1 with FP8 inputs kept and selective
// recompute's f, before its output add writes it, which may alias f); else the slot's own, which the
// next chunk reads.
static void *chunk_output(Model *m, const ModelChunk *k, size_t T) {
    return k->last && chunk_layers(k) > 0 ? m->s.dn : act_buf(m, T * m->cfg.d_model);
}

// One slot of a chunk; the gradient of its output waits in a buffer of its own when several chunks
// interleave (a chunk's backward is then not right after the one that produced it).
static void alloc_slot(Model *m, const ModelChunk *k, SlotActs *slot, size_t T) {
    int n = chunk_layers(k);
    slot->resid = moe_calloc((size_t)n + 1, sizeof(void *));
    for (int i = 0; i < n; i++) slot->resid[i] = act_buf(m, T * m->cfg.d_model);
    slot->resid[n] = chunk_output(m, k, T);
    slot->layer = moe_calloc((size_t)n, sizeof(LayerActs));
    for (int i = 0; i < n; i++) {
        bool moe = model_layer_is_moe(&m->cfg, k->layer_begin + i);
        alloc_layer_acts(m, &slot->layer[i], T, moe, !moe);
    }
    slot->grad = m->n_chunks > 1 ? act_buf(m, T * m->cfg.d_model) : NULL;
}

// The chunks of this rank: their layers and n_slots activations in flight (0: what the schedule keeps).
static void init_chunks(Model *m, int n_slots, int n_micro) {
    const Layout *l = &m->par->lay;
    m->n_chunks = l->v;
    for (int c = 0; c < l->v; c++) {
        ModelChunk *k = &m->chunk[c];
        *k = (ModelChunk){.layer_begin = l->layer_begin[c], .layer_end = l->layer_end[c],
                          .first = layout_first_chunk(l, c), .last = layout_last_chunk(l, c),
                          .n_slots = n_slots ? n_slots : pipeline_slots(l->pp, l->v, l->stage, c, n_micro)};
    }
}

static AttnDims attn_dims(const Model *m, size_t B, size_t S) {
    const ModelConfig *c = &m->cfg;
    return (AttnDims){B, S, (size_t)c->n_heads, (size_t)c->n_kv_heads, (size_t)c->head_dim};
}

// The FP8 copy of the weight tensor at offset `off` of the compute weights, (El, N, K).
static Fp8Weights alloc_fp8_weights(Model *m, size_t off, size_t El, size_t N, size_t K) {
    size_t scale_bytes = El * fp8_blocks(N) * fp8_blocks(K) * m->ops->f32_size;
    return (Fp8Weights){.off = off, .El = El, .N = N, .K = K, .q = model_alloc(m, El * N * K),
                        .scales = model_alloc(m, scale_bytes), .scales_t = model_alloc(m, scale_bytes)};
}

// What one kind of FP8 product (the experts', the dense layers') needs of the activation scratch:
// R rows and Tt token-major columns, times its products' widest rows (the larger of N and K), output
// gradients (N) and inputs (K).
typedef struct {
    size_t R, Tt, rows, out, in;
} Fp8Extent;

// The most FP8 weight tensors of one layer (add_layer_fp8_weights).
enum { FP8_LAYER_TENSORS = 6 };

// A weight tensor (El, N, K) whose products run in FP8: its FP8 copies, and the widths of its
// products in the extent x of their kind.
static void add_fp8_weights(Model *m, Fp8Extent *x, size_t off, size_t El, size_t N, size_t K) {
    Fp8Operands *o = m->fp8;
    o->weights[o->n_weights++] = alloc_fp8_weights(m, off, El, N, K);
    x->rows = size_max(x->rows, size_max(N, K)), x->out = size_max(x->out, N), x->in = size_max(x->in, K);
}

// Layer l's weights whose products run in FP8: those of its attention projections and its dense or
// shared MLP that Fp8Operands.dense puts in FP8 (extent `dense`); in a MoE layer its experts'
// (`experts`).
static void add_layer_fp8_weights(Model *m, int l, Fp8Extent *dense, Fp8Extent *experts) {
    const ModelConfig *c = &m->cfg;
    const LayerParams *p = &m->layer[l];
    size_t D = c->d_model, Dq = (size_t)c->n_heads * c->head_dim, El = (size_t)m->n_experts_local;
    bool moe = model_layer_is_moe(c, l);
    size_t H = (size_t)(moe ? c->shared_hidden : c->dense_hidden);
    if (m->fp8->dense[FP8_DENSE_QKV]) add_fp8_weights(m, dense, p->wqkv, 1, model_qkv_width(c), D);
    if (m->fp8->dense[FP8_DENSE_OUT]) add_fp8_weights(m, dense, p->wo, 1, D, Dq);
    if (m->fp8->dense[FP8_DENSE_MLP] && H) {
        add_fp8_weights(m, dense, moe ? p->shared_gu : p->dense_gu, 1, 2 * H, D);
        add_fp8_weights(m, dense, moe ? p->shared_down : p->dense_down, 1, D, H);
    }
    if (moe) {
        add_fp8_weights(m, experts, p->experts_gu, El, 2 * (size_t)c->expert_hidden, D);
        add_fp8_weights(m, experts, p->experts_down, El, D, c->expert_hidden);
    }
}

// The activation scratch (Fp8Operands), each buffer for the largest need of the n extents.
static void alloc_fp8_scratch(Model *m, const Fp8Extent *x, int n) {
    Fp8Operands *o = m->fp8;
    size_t rows = 0, row_blocks = 0, out = 0, in = 0, f = m->ops->f32_size;
    for (int i = 0; i < n; i++) {
        rows = size_max(rows, x[i].R * x[i].rows), row_blocks = size_max(row_blocks, x[i].R * fp8_blocks(x[i].rows));
        out = size_max(out, x[i].out * x[i].Tt), in = size_max(in, x[i].in * x[i].Tt);
    }
    o->rows = model_alloc(m, rows), o->row_scales = model_alloc(m, row_blocks * f);
    o->dout_t = model_alloc(m, out), o->dout_t_scales = model_alloc(m, out / FP8_BLOCK * f);
    o->x_t = model_alloc(m, in), o->x_t_scales = model_alloc(m, in / FP8_BLOCK * f);
}

// train.fp8_exchange with several expert-parallel ranks: the send buffers of R rows.
static void alloc_fp8_send(Model *m, size_t R) {
    Fp8Operands *o = m->fp8;
    o->send = model_alloc(m, R * m->cfg.d_model), o->send_scales = model_alloc(m, R * o->send_pitch * m->ops->f32_size);
}

// The FP8 products' operands (ModelModes.fp8); their buffers come after the model's (alloc_fp8_operands).
static Fp8Operands *fp8_operands_new(const Model *m, ModelModes modes) {
    if (!m->ops->fp8_grouped_matmul && !m->ops->sizing_only)
        moe_fatal("train.precision = fp8: the %s backend has no FP8 products here (the CUDA backend's need a "
                  "Hopper GPU, compute capability 9.0); use train.precision = bf16", m->ops->name);
    Fp8Operands *o = moe_calloc(1, sizeof *o);
    o->how = modes.how, o->fused_dispatch = modes.fp8_fused_dispatch;
    o->dense[FP8_DENSE_QKV] = modes.fp8_dense && !modes.fp8_act_qkv;
    o->dense[FP8_DENSE_OUT] = modes.fp8_dense && !modes.fp8_act_out;
    o->dense[FP8_DENSE_MLP] = modes.fp8_dense;
    o->act_forward[FP8_DENSE_QKV] = modes.fp8_act_qkv_forward;
    o->exchange = modes.fp8_exchange, o->fused_swiglu = modes.fp8_fused_swiglu;
    o->fused_update = modes.fp8_fused_update;
    o->x_cols = modes.fp8_wgrad_blocks ? FP8_COLS_128X128 : FP8_COLS_1X128;
    size_t f = m->ops->f32_size;
    o->send_pitch = (fp8_blocks(m->cfg.d_model) * f + 15) / 16 * 16 / f; // 16-byte rows of scales
    return o;
}

// Whether each rank of the experts' data-parallel group quantises its part of their staged compute
// weights and the group gathers the codes (Fp8Operands.fused_update with several ranks in it).
static bool quantizes_expert_parts(const Model *m) {
    return m->fp8->fused_update && !m->ops->act_aliases_f32 && n_local_moe_layers(m) > 0 &&
           model_region_group(m, PARAM_EXPERT)->size > 1;
}

// The FP8 copies of the weights (made by model_sync_compute_weights), the buffer of their transposed
// codes and the activation scratch.
static void alloc_fp8_operands(Model *m) {
    const ModelConfig *c = &m->cfg;
    size_t T = m->B * m->S, Rr = moe_exchange_received_rows(&m->xchg, T), El = (size_t)m->n_experts_local;
    Fp8Operands *o = m->fp8;
    o->weights = moe_calloc(FP8_LAYER_TENSORS * (size_t)n_local_layers(m), sizeof *o->weights);
    bool sends = receives_fp8(m) && n_local_moe_layers(m) > 0;
    size_t R = model_routed_rows(c, T); // rows a sender quantises (their grouped scales: row_scales)
    Fp8Extent experts = {.R = sends ? size_max(Rr, R) : Rr, .Tt = fp8_expert_cols(Rr, El)};
    Fp8Extent dense_x = {.R = T, .Tt = fp8_expert_cols(T, 1)};
    size_t before = m->mem.bytes, largest = 0, blocks = 0;
    for (int l = 0; l < c->n_layers; l++)
        if (model_holds_layer(m, l)) add_layer_fp8_weights(m, l, &dense_x, &experts);
    for (size_t i = 0; i < o->n_weights; i++) {
        const Fp8Weights *t = &o->weights[i];
        largest = size_max(largest, t->El * t->N * t->K);
        blocks = size_max(blocks, t->El * fp8_blocks(t->N) * fp8_blocks(t->K));
    }
    o->wt = model_alloc(m, largest);
    if (quantizes_expert_parts(m)) o->amax = model_alloc(m, blocks * m->ops->f32_size);
    o->weight_bytes = m->mem.bytes - before;
    alloc_fp8_scratch(m, (Fp8Extent[]){experts, dense_x}, 2);
    if (sends) alloc_fp8_send(m, R);
    if (model_reads_token_rows(m) && !model_keeps_fp8_xe(m) && n_local_moe_layers(m) > 0) {
        o->tokens = model_alloc(m, T * c->d_model);
        o->token_scales = model_alloc(m, fp8_blocks(c->d_model) * T * m->ops->f32_size);
    }
    o->sum = m->s.dxf;
    o->counts = model_alloc(m, MODEL_FP8_COUNTS * sizeof(uint64_t));
    if (!m->ops->sizing_only) m->ops->zero(o->counts, MODEL_FP8_COUNTS * sizeof(uint64_t));
}

// The elements of the largest tensor of a MoE layer's experts: the gate|up one (El, 2H, D).
static size_t expert_stage_elems(const Model *m) {
    return (size_t)m->n_experts_local * 2 * m->cfg.expert_hidden * m->cfg.d_model;
}

// With FP8 products and a compute copy apart from the master weights, the experts' compute weights
// are staged a tensor at a time (Model.expert_stage): params_act then ends where the experts' region
// begins.
static void alloc_compute_weights(Model *m) {
    const Ops *ops = m->ops;
    m->act_len = m->reg.total;
    if (ops->act_aliases_f32) {
        m->params_act = m->params;
        return;
    }
    if (m->fp8 && n_local_moe_layers(m) > 0) {
        m->act_len = m->reg.region_begin[PARAM_EXPERT];
        m->expert_stage = act_buf(m, expert_stage_elems(m));
    }
    m->params_act = act_buf(m, m->act_len);
}

size_t model_compute_weight_elems(const Model *m) {
    if (m->ops->act_aliases_f32) return 0;
    return m->act_len + (m->expert_stage ? expert_stage_elems(m) : 0);
}

void model_init(Model *m, const ModelConfig *cfg, const Ops *ops, const Parallel *par, size_t B,
                size_t S, int n_slots, int n_micro, ModelModes modes) {
    MoeErr err;
    char backend[64];
    snprintf(backend, sizeof backend, "the %s backend", ops->name);
    if (ops->limits && model_config_check_limits(cfg, ops->limits, backend, err)) moe_fatal("%s", err);
    memset(m, 0, sizeof *m);
    m->cfg = *cfg;
    m->ops = m->mem.ops = ops;
    m->par = par;
    init_chunks(m, n_slots, n_micro);
    m->n_experts_local = par->lay.expert_end - par->lay.expert_begin;
    m->first_stage = layout_first_stage(&par->lay), m->last_stage = layout_last_stage(&par->lay);
    m->B = B, m->S = S, m->n_micro = n_micro, m->recompute = modes.recompute;
    if (modes.fp8) m->fp8 = fp8_operands_new(m, modes);
    register_params(m);
    size_t P = m->reg.total, T = B * S;
    init_master(m);
    m->params = f32_buf(m, m->master_len);
    alloc_compute_weights(m);
    m->grads = f32_buf(m, P);
    m->expert_bias = f32_buf(m, (size_t)cfg->n_layers * cfg->n_experts);
    m->step_info = model_alloc(m, sizeof(StepInfo));
    ops->zero(m->step_info, sizeof(StepInfo));
    m->metrics_scratch = f32_buf(m, model_metrics_len(cfg));
    upload_rope(m, S);
    m->tokens = i32_buf(m, (size_t)n_micro * T), m->targets = i32_buf(m, (size_t)n_micro * T);
    size_t before_exchange = m->mem.bytes;
    int kept_calls = moe_calls(m); // calls whose expert rows are kept
    if (m->recompute == RECOMPUTE_FULL && kept_calls) kept_calls = 1;
    moe_exchange_init(&m->xchg, cfg, ops, par, &m->mem, T, kept_calls, model_exchange_row_bytes(m));
    m->exchange_bytes = m->mem.bytes - before_exchange;
    alloc_scratch(m, T); // first: selective recompute and FP8 lend parts of it to activations
    size_t before_acts = m->mem.bytes;
    if (m->recompute == RECOMPUTE_SELECTIVE) alloc_selective_shared(m, T);
    alloc_fp8_kept_shared(m);
    alloc_expert_hact(m, T);
    if (m->recompute == RECOMPUTE_FULL) alloc_full_shared(m, T);
    for (int c = 0; c < m->n_chunks; c++) {
        ModelChunk *k = &m->chunk[c];
        k->slots = moe_calloc((size_t)k->n_slots, sizeof(SlotActs));
        for (int i = 0; i < k->n_slots; i++) alloc_slot(m, k, &k->slots[i], T);
    }
    m->act_bytes = m->exchange_bytes + m->mem.bytes - before_acts;
    if (m->last_stage) alloc_head(m, T);
    if (ops->attention_workspace) m->mem.bytes += ops->attention_workspace(attn_dims(m, B, S)); // the library's
    if (m->fp8) alloc_fp8_operands(m);
}

// The counters of tensor class c (docs/FP8.md: the forward's rows and the token-major copies of the
// input, the backward's or those the forward keeps, are activations; the backward's rows and
// token-major copies of the output gradient are gradients).
static uint64_t *fp8_counts(const Fp8Operands *o, Fp8Class c) { return o->counts + (size_t)c * FP8_COUNTS; }

void *model_compute_window(const Model *m, ParamRegion r, size_t a, size_t *first) {
    bool staged = r == PARAM_EXPERT && m->expert_stage;
    *first = staged ? a : 0;
    return staged ? m->expert_stage : m->params_act;
}

// The FP8 weight tensor that holds flat offset w, or NULL.
static const Fp8Weights *fp8_tensor_holding(const Model *m, size_t w) {
    for (size_t i = 0; i < m->fp8->n_weights; i++) {
        const Fp8Weights *t = &m->fp8->weights[i];
        if (w >= t->off && w < t->off + t->El * t->N * t->K) return t;
    }
    return NULL;
}

// The FP8 weight tensor that starts at flat offset a, or NULL.
static const Fp8Weights *fp8_weights_from(const Model *m, size_t a) {
    const Fp8Weights *t = fp8_tensor_holding(m, a);
    return t && t->off == a ? t : NULL;
}

size_t model_compute_span_end(const Model *m, ParamRegion r, size_t a, size_t b) {
    const Fp8Weights *t = r == PARAM_EXPERT && m->expert_stage ? fp8_weights_from(m, a) : NULL;
    return t ? size_min(b, a + t->El * t->N * t->K) : b; // b: the region's padding after its last tensor
}

// The FP8 copies of the weights in flat [a, b) from their compute weights in window (from flat
// offset first on).
static void quantize_fp8_weights(Model *m, size_t a, size_t b, void *window, size_t first) {
    const Fp8Operands *o = m->fp8;
    for (size_t i = 0; o && i < o->n_weights; i++) {
        const Fp8Weights *t = &o->weights[i];
        if (t->off < a || t->off >= b) continue;
        MOE_ASSERT(t->off >= first && t->off + t->El * t->N * t->K <= b);
        m->ops->fp8_quantize_weights(t->q, t->scales, t->scales_t, model_act(m, window, t->off - first), t->El, t->N,
                                     t->K, o->how, fp8_counts(o, FP8_CLASS_WEIGHTS));
    }
}

// This rank's part [*lo, *hi) of flat [a, b) of region r: its master weights' (empty: *lo = *hi).
static void master_span(const Model *m, ParamRegion r, size_t a, size_t b, size_t *lo, size_t *hi) {
    *lo = size_max(a, m->master_begin[r]);
    *hi = size_max(*lo, size_min(b, m->master_begin[r] + m->master_size[r]));
}

// With Fp8Operands.amax, the experts' FP8 weight tensor that is flat [a, b) of region r, which each
// rank quantises by parts (quantize_expert_part); else NULL (none, or the region's padding).
static const Fp8Weights *expert_part_tensor(const Model *m, ParamRegion r, size_t a, size_t b) {
    const Fp8Weights *t = r == PARAM_EXPERT && m->fp8 && m->fp8->amax ? fp8_weights_from(m, a) : NULL;
    return t && a + t->El * t->N * t->K == b ? t : NULL;
}

// The codes of this rank's part of t (flat [a, b)), its compute weights w from a (this part's only):
// the part's block maxima, their largest over the group, the part's codes under those (and every
// block's scales): the codes and scales of quantising the whole tensor, once the group has gathered
// the codes.
static void quantize_expert_part(Model *m, ParamRegion r, const Fp8Weights *t, size_t a, size_t b, const void *w) {
    Comm *g = model_region_group(m, r);
    size_t lo, hi;
    master_span(m, r, a, b, &lo, &hi);
    m->ops->fp8_weights_amax(m->fp8->amax, w, t->El, t->N, t->K, lo - a, hi - a);
    g->ops->all_reduce_max(g, m->fp8->amax, t->El * fp8_blocks(t->N) * fp8_blocks(t->K));
    m->ops->fp8_quantize_weights_part(t->q, t->scales, t->scales_t, m->fp8->amax, w, t->El, t->N, t->K, lo - a, hi - a,
                                      m->fp8->how, fp8_counts(m->fp8, FP8_CLASS_WEIGHTS));
}

void model_compute_weights_ready(Model *m, ParamRegion r, size_t a, size_t b, void *window, size_t first) {
    Comm *g = model_region_group(m, r);
    size_t begin = m->reg.region_begin[r], shard = m->reg.region_size[r] / (size_t)g->size;
    MOE_ASSERT(a >= first && a <= b && (r != PARAM_EXPERT || !m->expert_stage || b - first <= expert_stage_elems(m)));
    void *w = model_act(m, window, a - first);
    const Fp8Weights *t = expert_part_tensor(m, r, a, b);
    if (t) quantize_expert_part(m, r, t, a, b, w);
    if (g->size > 1) comm_all_gather_window(g, t ? t->q : w, shard, a - begin, b - begin, t ? COMM_U8 : COMM_ACT);
    if (!t) quantize_fp8_weights(m, a, b, window, first);
}

const Fp8Weights *model_fp8_update_target(const Model *m, ParamRegion r, size_t a, size_t b, uint64_t **counts) {
    if (r != PARAM_EXPERT || !m->expert_stage || !m->fp8->fused_update || model_region_group(m, r)->size > 1)
        return NULL;
    const Fp8Weights *t = fp8_weights_from(m, a);
    if (!t || a + t->El * t->N * t->K != b) return NULL; // the region's padding
    *counts = fp8_counts(m->fp8, FP8_CLASS_WEIGHTS);
    return t;
}

void model_free(Model *m) {
    if (m->fp8) free(m->fp8->weights);
    free(m->fp8);
    moe_exchange_free(&m->xchg);
    pool_free(&m->mem);
    for (int c = 0; c < m->n_chunks; c++) {
        ModelChunk *k = &m->chunk[c];
        for (int i = 0; i < k->n_slots; i++) {
            for (int l = 0; l < chunk_layers(k) && m->recompute != RECOMPUTE_FULL; l++) // full: shared's
                moe_exchange_routes_free(&k->slots[i].layer[l].routes);
            free(k->slots[i].resid);
            free(k->slots[i].layer);
        }
        free(k->slots);
    }
    moe_exchange_routes_free(&m->shared.routes);
    free(m->layer);
    free(m->expert_dw_written);
    params_free(&m->reg);
    memset(m, 0, sizeof *m);
}

// Each tensor's part held in the master weights computed in place by the backend; what lies between
// tensors (region padding) is zero.
void model_init_weights(Model *m, unsigned seed) {
    const Ops *ops = m->ops;
    ops->zero(m->params, m->master_len * ops->f32_size); // region padding stays zero
    for (size_t i = 0; i < m->reg.n; i++) {
        const ParamInfo *p = &m->reg.p[i];
        size_t a, b; // the elements of p the master weights hold
        if (model_master_part(m, p, &a, &b))
            ops->init_params(model_master(m, a), b - a, params_init_key(p, seed),
                             params_init_counter(p) + (a - p->offset), m->cfg.init_std, p->ones);
    }
    ops->zero(m->grads, m->reg.total * ops->f32_size);
    ops->zero(m->expert_bias, (size_t)m->cfg.n_layers * m->cfg.n_experts * ops->f32_size);
    model_sync_compute_weights(m);
}

// The compute weights of flat [a, b) of region r cast from this rank's master weights, then made whole
// (model_compute_weights_ready).
static void sync_span(Model *m, ParamRegion r, size_t a, size_t b) {
    size_t first, lo, hi;
    master_span(m, r, a, b, &lo, &hi);
    void *window = model_compute_window(m, r, a, &first);
    if (lo < hi) m->ops->cast_f32_to_act(model_act(m, window, lo - first), model_master(m, lo), hi - lo);
    model_compute_weights_ready(m, r, a, b, window, first);
}

// Where the backend aliases them the compute weights are the master weights, whole on every rank:
// only their FP8 copies are made. Else each region, a span at a time (model_compute_span_end: the
// region, or staged experts a tensor at a time).
void model_sync_compute_weights(Model *m) {
    if (m->ops->act_aliases_f32) {
        quantize_fp8_weights(m, 0, m->reg.total, m->params_act, 0);
        return;
    }
    for (int r = 0; r < PARAM_N_REGIONS; r++) {
        size_t end = m->reg.region_begin[r] + m->reg.region_size[r];
        for (size_t a = m->reg.region_begin[r], b; a < end; a = b) {
            b = model_compute_span_end(m, (ParamRegion)r, a, end);
            sync_span(m, (ParamRegion)r, a, b);
        }
    }
}

static int32_t *micro_tokens(const Model *m, int micro) { return m->tokens + (size_t)micro * m->B * m->S; }
static int32_t *micro_targets(const Model *m, int micro) { return m->targets + (size_t)micro * m->B * m->S; }

void model_split_batch(const int32_t *seqs, size_t B, size_t S, int32_t *split) {
    for (size_t b = 0; b < B; b++) {
        memcpy(split + b * S, seqs + b * (S + 1), S * sizeof(int32_t));
        memcpy(split + (B + b) * S, seqs + b * (S + 1) + 1, S * sizeof(int32_t));
    }
}

static void upload_batch(Model *m, int micro, const int32_t *split, size_t B, size_t S,
                         void (*upload)(void *dst, const void *host_src, size_t bytes)) {
    MOE_ASSERT(B <= m->B && S <= m->S && micro < m->n_micro);
    upload(micro_tokens(m, micro), split, B * S * sizeof(int32_t));
    upload(micro_targets(m, micro), split + B * S, B * S * sizeof(int32_t));
}

void model_queue_batch(Model *m, int micro, const int32_t *split, size_t B, size_t S) {
    upload_batch(m, micro, split, B, S, m->ops->upload_queued);
}

void model_set_batch(Model *m, int micro, const int32_t *seqs, size_t B, size_t S) {
    int32_t *split = moe_malloc(2 * B * S * sizeof(int32_t));
    model_split_batch(seqs, B, S, split);
    upload_batch(m, micro, split, B, S, m->ops->upload);
    free(split);
}

void *model_stage_input(const Model *m, int chunk, int slot) { return m->chunk[chunk].slots[slot].resid[0]; }
void *model_stage_output(const Model *m, int chunk, int slot) {
    const ModelChunk *k = &m->chunk[chunk];
    return k->slots[slot].resid[chunk_layers(k)];
}
void *model_stage_grad(const Model *m, int chunk, int slot) {
    void *grad = m->chunk[chunk].slots[slot].grad;
    return grad ? grad : m->s.dres;
}

// ---------------------------------------------------------------- forward

static void *W(const Model *m, size_t off) {
    MOE_ASSERT(off < m->act_len); // staged experts' compute weights are not read here (FP8 products)
    return model_act(m, m->params_act, off);
}
static void *G(const Model *m, size_t off) { return model_f32(m, m->grads, off); }

static SlotActs *slot_of(const Model *m, const ForwardArgs *a) { return &m->chunk[a->chunk].slots[a->slot]; }

// Layer l's activations of a micro-batch, and its input and output in the residual stream.
static LayerActs *acts(const Model *m, const ForwardArgs *a, int l) {
    return &slot_of(m, a)->layer[l - m->chunk[a->chunk].layer_begin];
}
static void *resid(const Model *m, const ForwardArgs *a, int l) {
    return slot_of(m, a)->resid[l - m->chunk[a->chunk].layer_begin];
}

// A layer's kept token-major FP8 copy (model_keeps_fp8_n1, _xe), NULL where the model keeps none:
// the backward reads it; a training forward writes it (forward_cols; not a recompute's: none is
// kept under recompute, nor an evaluation's).
static const Fp8Cols *kept_cols(const Fp8Cols *c) { return c->q ? c : NULL; }
static const Fp8Cols *forward_cols(const Fp8Cols *c, const ForwardArgs *a) { return a->train ? kept_cols(c) : NULL; }

static int moe_index(const ModelConfig *c, int l) { return l - c->n_dense_layers; }

static RouterArgs router_args(const Model *m, int l, const ForwardArgs *a) {
    const ModelConfig *c = &m->cfg;
    size_t T = a->B * a->S;
    return (RouterArgs){
        .T = T, .T_global = T * (size_t)m->par->dp->size, .E = c->n_experts, .K = c->top_k,
        .kind = c->router, .renorm = c->norm_topk_prob, .random = c->random_routing,
        .layer = (uint64_t)l, .token_base = a->token_base,
        .lb_grad = a->scales.lb, .z_grad = a->scales.z,
    };
}

static const int32_t *expert_offsets(const Model *m, const LayerActs *x) {
    return m->par->ep->size > 1 ? x->routes.offsets : x->offsets;
}

// Layer l's router statistics in a metrics buffer.
static void *router_stats(const Model *m, void *metrics, int l) {
    return model_f32(m, metrics, model_metric_router(&m->cfg, moe_index(&m->cfg, l)));
}

// Scores, choice, weights and counts from the logits, and this call's summary into aux.
static void router_choose(Model *m, int l, LayerActs *x, void *aux, const ForwardArgs *a) {
    const ModelConfig *c = &m->cfg;
    const void *bias = c->bias_gamma > 0 ? model_f32(m, m->expert_bias, (size_t)l * c->n_experts) : NULL;
    m->ops->router_forward(x->scores, x->topk_idx, x->topk_w, x->counts, aux, x->logits, bias, m->step_info,
                           router_args(m, l, a));
}

// The router's logits from the layer's feed-forward input, then router_choose.
static void router_logits_choose(Model *m, int l, LayerActs *x, const void *in, void *aux, const ForwardArgs *a) {
    const ModelConfig *c = &m->cfg;
    m->ops->matmul_forward(x->logits, in, W(m, m->layer[l].router), a->B * a->S, c->n_experts, c->d_model, false);
    router_choose(m, l, x, aux, a);
}

// Router: local choice, then the micro-batch's aux summary summed over the data-parallel ranks. A
// recompute's summary goes to scratch: the kept one is already summed and counted in the metrics.
static void route(Model *m, int l, LayerActs *x, const void *in, const ForwardArgs *a) {
    const Ops *ops = m->ops;
    size_t E = m->cfg.n_experts;
    router_logits_choose(m, l, x, in, a->recompute ? m->shared.aux : x->aux, a);
    if (a->recompute) return;
    Comm *dp = m->par->dp;
    dp->ops->all_reduce_sum(dp, x->aux, router_aux_len(E), COMM_F32);
    ops->router_aux_loss(router_stats(m, a->metrics, l), x->aux, router_args(m, l, a), dp->rank == 0 ? 1.0f : 0.0f);
}

// Counting sort of the routed slots (dropped slots counted in stats) and the gather of their rows
// of `in` into xp (NULL: not gathered, reads_token_rows).
static void dispatch(const Model *m, LayerActs *x, void *xp, const void *in, void *stats, size_t T) {
    const ModelConfig *c = &m->cfg;
    m->ops->moe_dispatch_forward(xp, x->slot_pos, x->offsets, stats, in, x->topk_idx, x->counts, T, c->top_k,
                                 c->n_experts, c->d_model, model_expert_capacity(c, T));
}

// Experts [e0, ...) of an FP8 copy of weights (alloc_fp8_operands): those whose compute weights (N, K
// each) start at offset w (a dense layer's: its one matrix).
static Fp8Weights fp8_weights_at(const Model *m, size_t w, size_t N, size_t K) {
    const Fp8Weights *t = fp8_tensor_holding(m, w);
    if (!t) moe_fatal("%s:%d: no FP8 copy of the weights at offset %zu", __FILE__, __LINE__, w);
    MOE_ASSERT(t->N == N && t->K == K && (w - t->off) % (N * K) == 0);
    size_t e0 = (w - t->off) / (N * K), s = e0 * fp8_blocks(N) * fp8_blocks(K) * m->ops->f32_size;
    return (Fp8Weights){.off = w, .El = t->El - e0, .N = N, .K = K, .q = (char *)t->q + e0 * N * K,
                        .scales = (char *)t->scales + s, .scales_t = (char *)t->scales_t + s};
}

// out (R, N) = a . b[e]^T from quantised rows a (e4m3 (R, K), their scales in Fp8Operands.row_scales)
// and FP8 weights b with their scales, per group of rows of off (experts), or with off NULL one group
// of all R rows (a dense layer's product: R may be fewer rows than the model was sized for).
static void fp8_product(const Model *m, void *out, const void *a, const void *b, const void *b_scales,
                        const int32_t *off, size_t El, size_t N, size_t K, size_t R) {
    const Fp8Operands *q = m->fp8;
    if (off) m->ops->fp8_grouped_matmul(out, a, q->row_scales, b, b_scales, off, El, N, K, R);
    else m->ops->fp8_matmul(out, a, q->row_scales, b, b_scales, R, N, K);
}

// Per group of rows of off (El experts; NULL: one group of all R rows), out (R, N) = x (R, K) .
// w[e] (N, K)^T in FP8 with the compute weights at offset w: from the weights' FP8 copy and x's
// rows, quantised here unless they are made already: xq (non-NULL), x's codes (R, K) with their
// scales in Fp8Operands.row_scales (the kernel that wrote x wrote them, swiglu_fp8; or they came
// through the FP8 exchange); with x_t (non-NULL) also x's token-major copy for the backward, from
// the same read of x, where x_rows (non-NULL) may name the rows of x that make the operand
// (fp8_quantize_rows_cols).
static void fp8_forward(const Model *m, void *out, const void *x, const int32_t *x_rows, const void *xq,
                        const Fp8Cols *x_t, size_t w, const int32_t *off, size_t El, size_t N, size_t K, size_t R) {
    const Fp8Operands *q = m->fp8;
    Fp8Weights wq = fp8_weights_at(m, w, N, K);
    uint64_t *acts = fp8_counts(q, FP8_CLASS_ACTIVATIONS);
    MOE_ASSERT(!(xq && (x_t || x_rows)));
    if (x_t || x_rows)
        m->ops->fp8_quantize_rows_cols(q->rows, q->row_scales, x_t ? x_t->q : NULL, x_t ? x_t->scales : NULL, x,
                                       x_rows, off, El, R, K, q->how, q->x_cols, acts);
    else if (!xq) m->ops->fp8_quantize_rows(q->rows, q->row_scales, x, off, El, R, K, q->how, acts);
    fp8_product(m, out, xq ? xq : q->rows, wq.q, wq.scales, off, El, N, K, R);
}

// In FP8, dout's token-major copy (the weight gradient's operand) in fp8_backward: made there when
// dw is wanted; made beside dout's rows though dw is not wanted yet (KEEP: the next call, with the
// same dout, takes it); or made by the call before (KEPT: not made again).
typedef enum { DOUT_T_MAKE, DOUT_T_KEEP, DOUT_T_KEPT } DoutCopy;

// dout's FP8 operands made before fp8_backward (by the FP8 exchange or the fused SwiGLU backward):
// its rows' codes (their scales in Fp8Operands.row_scales) and its token-major copy.
typedef struct {
    const void *rows;
    Fp8Cols t;
} Fp8Made;

// x's token-major FP8 copy into t, the weight gradient's operand (Fp8Operands.x_cols blocks, counted
// as activations), for the El groups of off (NULL: one of all R rows), R rows of K.
static void input_cols(const Model *m, const Fp8Cols *t, const void *x, const int32_t *off, size_t El, size_t R,
                       size_t K) {
    const Fp8Operands *q = m->fp8;
    m->ops->fp8_quantize_cols(t->q, t->scales, x, off, El, R, K, q->how, q->x_cols,
                              fp8_counts(q, FP8_CLASS_ACTIVATIONS));
}

// The backward of fp8_forward in FP8 (its groups): dx (R, K) = dout . w[e] from quantised rows of dout
// and the weights' codes transposed here (into Fp8Operands.wt); dw (El, N, K) f32 = dout^T . x per
// group (added to dw when accumulate_dw) from token-major copies of dout and x (either skipped when
// NULL): x's the forward kept (x_t, x unread) or, with x_t NULL, made here; dout's two copies from
// one read of it when both are made here, where dout_rows (non-NULL) may name the rows of dout that
// make the operand (fp8_quantize_rows_cols); or, with made (non-NULL), both made already (dout_t
// KEPT; dout unread). dout's token-major copy is Fp8Operands.dout_t unless made says otherwise.
static void fp8_backward(const Model *m, void *dx, void *dw, bool accumulate_dw, const void *dout,
                         const int32_t *dout_rows, const Fp8Made *made, const void *x, const Fp8Cols *x_t,
                         size_t w, const int32_t *off, size_t El, size_t N, size_t K, size_t R, DoutCopy dout_t) {
    const Ops *ops = m->ops;
    const Fp8Operands *q = m->fp8;
    Fp8Weights wq = fp8_weights_at(m, w, N, K);
    // every read of dout and x before dx is written
    uint64_t *grads = fp8_counts(q, FP8_CLASS_GRADIENTS);
    bool make_t = dout_t == DOUT_T_KEEP || (dw && dout_t == DOUT_T_MAKE);
    MOE_ASSERT(!dout_rows || (dx && make_t));
    MOE_ASSERT(!made || dout_t == DOUT_T_KEPT); // so make_t is false
    Fp8Cols dt = made ? made->t : (Fp8Cols){.q = q->dout_t, .scales = q->dout_t_scales};
    if (dx && make_t)
        ops->fp8_quantize_rows_cols(q->rows, q->row_scales, dt.q, dt.scales, dout, dout_rows, off, El, R, N, q->how,
                                    FP8_COLS_1X128, grads);
    else if (dx && !made) ops->fp8_quantize_rows(q->rows, q->row_scales, dout, off, El, R, N, q->how, grads);
    else if (make_t) ops->fp8_quantize_cols(dt.q, dt.scales, dout, off, El, R, N, q->how, FP8_COLS_1X128, grads);
    Fp8Cols xt = x_t ? *x_t : (Fp8Cols){.q = q->x_t, .scales = q->x_t_scales};
    if (dw && !x_t) input_cols(m, &xt, x, off, El, R, K);
    if (dx) {
        ops->fp8_transpose_codes(q->wt, wq.q, El, N, K);
        fp8_product(m, dx, made ? made->rows : q->rows, q->wt, wq.scales_t, off, El, K, N, R);
    }
    if (dw)
        ops->fp8_grouped_matmul_wgrad(dw, dt.q, dt.scales, xt.q, xt.scales, q->x_cols, off, El, N, K, R, accumulate_dw);
}

// Per expert, out (Rr, N) = x (Rr, K) . w[e] (N, K)^T with the compute weights at offset w: in act
// precision, or in FP8 (fp8_forward; x_rows, xq and x_t as there).
static void expert_forward(const Model *m, void *out, const void *x, const int32_t *x_rows, const void *xq,
                           const Fp8Cols *x_t, size_t w, const int32_t *off, size_t El, size_t N, size_t K, size_t Rr) {
    if (m->fp8) fp8_forward(m, out, x, x_rows, xq, x_t, w, off, El, N, K, Rr);
    else m->ops->grouped_matmul_forward(out, x, W(m, w), off, El, N, K, Rr);
}

// dx (Rr, K) = dout . w[e]; dw (El, N, K) f32 = dout^T . x per expert, added to dw when
// accumulate_dw (either skipped when NULL), with the compute weights at offset w: in act precision,
// or in FP8 (fp8_backward, x_t and dout_t as there; dout_rows and made too). Every read of x comes
// before dx is written, so dx may be x's buffer (selective recompute's xp and dxp): the weight
// gradient first, then the input gradient (two products either way).
static void expert_backward(const Model *m, void *dx, void *dw, bool accumulate_dw, const void *dout,
                            const int32_t *dout_rows, const Fp8Made *made, const void *x, const Fp8Cols *x_t,
                            size_t w, const int32_t *off, size_t El, size_t N, size_t K, size_t Rr, DoutCopy dout_t) {
    if (m->fp8) {
        fp8_backward(m, dx, dw, accumulate_dw, dout, dout_rows, made, x, x_t, w, off, El, N, K, Rr, dout_t);
        return;
    }
    if (dw) m->ops->grouped_matmul_backward(NULL, dw, dout, x, W(m, w), off, El, N, K, Rr, accumulate_dw);
    if (dx) m->ops->grouped_matmul_backward(dx, NULL, dout, x, W(m, w), off, El, N, K, Rr, false);
}

// The FP8 operands of dense linear layer k's products; NULL: those run in act precision.
static const Fp8Operands *dense_fp8(const Model *m, Fp8Dense k) {
    return m->fp8 && m->fp8->dense[k] ? m->fp8 : NULL;
}

// Where a dense FP8 product of (T, width) writes: an FP8 product only writes its output (the sm90
// kernels' epilogue adds no source here), so one that adds to its output (accumulate; every such
// output is (T, D)) writes Fp8Operands.sum and fp8_accumulate adds it: out + bf16(product), one
// rounding more than the act-precision product's out + product. Scratch and an add rather than an
// accumulating FP8 kernel: no kernel changes, and the sum's buffer costs no memory (Scratch.dxf).
static void *fp8_target(const Model *m, void *out, bool accumulate, size_t width) {
    MOE_ASSERT(!accumulate || width == (size_t)m->cfg.d_model);
    return accumulate ? m->fp8->sum : out;
}

static void fp8_accumulate(const Model *m, void *out, bool accumulate, size_t n) {
    if (accumulate) m->ops->add(out, out, m->fp8->sum, n);
}

// The FP8 operands of dense linear layer k's forward product; NULL: it runs in act precision.
static const Fp8Operands *dense_fp8_forward(const Model *m, Fp8Dense k) {
    const Fp8Operands *q = dense_fp8(m, k);
    return q && !q->act_forward[k] ? q : NULL;
}

// Dense linear layer k, out (T, N) (= or +=) x (T, K) . w (N, K)^T with the compute weights at
// offset w: in act precision, or (dense_fp8_forward) in FP8 (fp8_forward; xq and x_t as there). In
// act precision with x_t non-NULL (the backward's products in FP8: Fp8Operands.act_forward), x's
// token-major copy is kept there all the same.
static void dense_forward(const Model *m, Fp8Dense k, void *out, const void *x, const void *xq, const Fp8Cols *x_t,
                          size_t w, size_t T, size_t N, size_t K, bool accumulate) {
    if (!dense_fp8_forward(m, k)) {
        m->ops->matmul_forward(out, x, W(m, w), T, N, K, accumulate);
        if (x_t) input_cols(m, x_t, x, NULL, 1, T, K);
        return;
    }
    fp8_forward(m, fp8_target(m, out, accumulate, N), x, NULL, xq, x_t, w, NULL, 1, N, K, T);
    fp8_accumulate(m, out, accumulate, T * N);
}

// Its backward: dx (T, K) (= or += with accumulate_dx) dout . w; dw (N, K) f32 += dout^T . x (in FP8
// from x's kept token-major copy x_t where non-NULL).
static void dense_backward(const Model *m, Fp8Dense k, void *dx, void *dw, const void *dout, const void *x,
                           const Fp8Cols *x_t, size_t w, size_t T, size_t N, size_t K, bool accumulate_dx) {
    if (!dense_fp8(m, k)) {
        m->ops->matmul_backward(dx, dw, dout, x, W(m, w), T, N, K, accumulate_dx);
        return;
    }
    fp8_backward(m, fp8_target(m, dx, accumulate_dx, K), dw, true, dout, NULL, NULL, x, x_t, w, NULL, 1, N, K, T,
                 DOUT_T_MAKE);
    fp8_accumulate(m, dx, accumulate_dx, T * K);
}

// A SwiGLU, hact (R, H) from gu (R, 2H) on the rows of the El groups of off (NULL: all R rows), and
// with FP8 operands q (NULL: none) the quantised rows of hact in the same pass: the down
// projection's operand (fp8_forward's xq: swiglu_rows); with q, hact NULL leaves the output unstored.
static void swiglu_fp8(const Model *m, const Fp8Operands *q, void *hact, const void *gu, const int32_t *off,
                       size_t El, size_t H, size_t R) {
    if (q)
        m->ops->swiglu_forward_fp8(hact, q->rows, q->row_scales, gu, off, El, R, H, q->how,
                                   fp8_counts(q, FP8_CLASS_ACTIVATIONS));
    else m->ops->swiglu_forward(hact, gu, R, H, off, El);
}

// The codes swiglu_fp8 wrote with FP8 operands q (NULL: none, and none written).
static const void *swiglu_rows(const Fp8Operands *q) { return q ? q->rows : NULL; }

// A dense or shared SwiGLU MLP: out (T, D) (= or +=) down(swiglu(gu(in))).
static void swiglu_mlp_forward(const Model *m, void *out, const void *in, void *gu, void *hact,
                               size_t gu_w, size_t down_w, size_t T, size_t H, bool accumulate) {
    size_t D = m->cfg.d_model;
    const Fp8Operands *q = dense_fp8(m, FP8_DENSE_MLP);
    dense_forward(m, FP8_DENSE_MLP, gu, in, NULL, NULL, gu_w, T, 2 * H, D, false);
    swiglu_fp8(m, q, hact, gu, NULL, 0, H, T);
    dense_forward(m, FP8_DENSE_MLP, out, hact, swiglu_rows(q), NULL, down_w, T, D, H, accumulate);
}

// One MoE call's expert work on chunk [e0, e1) of its local experts (moe_exchange_pipeline): the
// forward's or the backward's, on the layer's buffers.
typedef struct {
    Model *m;
    int l;
    LayerActs *x;
    size_t Rr;            // rows of the expert-major buffers
    void *ye;             // forward: (Rr, D) the experts' outputs
    const Fp8Cols *xe_t;  // forward: where xe's token-major FP8 copy is kept (NULL: not kept)
    void *dye, *dxe;      // backward: (Rr, D) gradients of the experts' outputs (receives_fp8: FP8 rows,
                          // Scratch.dye8) and inputs
    const void *in;       // the layer's feed-forward input (T, D), whose rows rows_recompute gathers again
                          // (or token_cols reads through `rows`)
    const void *dout;     // backward: the gradient of the layer's feed-forward output (T, D)
    bool accumulate_dw;   // backward: the weight gradients add to what the step wrote before
    const int32_t *rows;  // the token of each expert row (Scratch.row_token) where the experts' inputs are
                          // quantised from `in` and the down projection's output gradients from `dout`
                          // (reads_token_rows): xe and dye then hold no rows; NULL: they do
    const ForwardArgs *a; // the call's
} ExpertWork;

// The offsets of experts [e0, ...) of a call, and their weights (or weight gradients) in the
// tensor at `off` of (El, rows, cols) per expert.
static const int32_t *chunk_offsets(const ExpertWork *w, size_t e0) { return expert_offsets(w->m, w->x) + e0; }
static size_t expert_tensor(size_t off, size_t e0, size_t rows, size_t cols) { return off + e0 * rows * cols; }

// The experts' SwiGLU output: the layer's own with several expert-parallel ranks, else the one
// buffer every MoE layer shares (Model.expert_hact; NULL with the fused FP8 SwiGLU backward, where
// the forward stores only the output's codes).
static void *experts_hact(const Model *m, const LayerActs *x) {
    return experts_share_hact(m) ? m->expert_hact : x->hact;
}

// The received rows' row-major scales, after their codes (Rr, D) in the buffer they landed in.
static void *received_scales(const Model *m, const void *xe, size_t Rr) { return (char *)xe + Rr * m->cfg.d_model; }

// The scales of the received rows of the El experts of off into Fp8Operands.row_scales, grouped as
// the products read them.
static void received_row_scales(const Model *m, const void *xe, const int32_t *off, size_t El, size_t Rr) {
    const Fp8Operands *q = m->fp8;
    m->ops->fp8_regroup_scales(q->row_scales, received_scales(m, xe, Rr), off, El, Rr, fp8_blocks(m->cfg.d_model),
                               q->send_pitch, false);
}

// What the exchange sends of rows (R, D) act in this rank's dispatch order (its groups `offsets`,
// E + 1) into `at`: the rows themselves; or (receives_fp8) quantised here, counted in class c, their
// codes and their scales row-major (Fp8Operands.send, send_scales) as two tensors (the codes, then
// the scales at received_scales).
static ExchangeRows experts_send(const Model *m, const void *rows, const int32_t *offsets, void *at, size_t T,
                                 size_t Rr, Fp8Class c) {
    if (!receives_fp8(m)) return moe_exchange_act_rows(&m->xchg, rows, at);
    const Ops *ops = m->ops;
    const Fp8Operands *q = m->fp8;
    size_t D = m->cfg.d_model, E = m->cfg.n_experts, R = model_routed_rows(&m->cfg, T);
    ops->fp8_quantize_rows(q->send, q->row_scales, rows, offsets, E, R, D, q->how, fp8_counts(q, c));
    ops->fp8_regroup_scales(q->send_scales, q->row_scales, offsets, E, R, fp8_blocks(D), q->send_pitch, true);
    return (ExchangeRows){.n = 2, .rows = {q->send, q->send_scales}, .at = {at, received_scales(m, at, Rr)},
                          .width = {moe_exchange_width(&m->xchg, D),
                                    moe_exchange_width(&m->xchg, q->send_pitch * ops->f32_size)}};
}

// train.fp8_exchange: the token-major copy t of rows that travel as FP8 (the El experts of off, Rr
// rows, d_model wide), counted in class c, from their FP8 rows (codes, scales in
// Fp8Operands.row_scales) dequantised into x (Rr, D) act: what every layout can make, as the rows'
// values do not travel between ranks, their codes do.
static void dequantised_cols(const Model *m, const Fp8Cols *t, void *x, const void *codes, const int32_t *off,
                             size_t El, size_t Rr, Fp8Class c) {
    const Fp8Operands *q = m->fp8;
    size_t D = m->cfg.d_model;
    m->ops->fp8_dequantize_rows(x, codes, q->row_scales, off, El, Rr, D);
    Fp8ColBlocks blocks = c == FP8_CLASS_ACTIVATIONS ? q->x_cols : FP8_COLS_1X128; // an input's, or a gradient's
    m->ops->fp8_quantize_cols(t->q, t->scales, x, off, El, Rr, D, q->how, blocks, fp8_counts(q, c));
}

size_t model_exchange_row_bytes(const Model *m) {
    size_t D = m->cfg.d_model;
    return receives_fp8(m) ? D + m->fp8->send_pitch * m->ops->f32_size : D * m->ops->act_size;
}

// train.fp8_exchange: the FP8 rows of rows (Rr, d_model wide) of the experts of off (n) that travel
// as FP8, returned (their codes; scales in Fp8Operands.row_scales), and their token-major copy t
// (counted in class c) from them dequantised: rows received (several ranks) hold them already and
// are dequantised into `scratch`; else (one rank) rows holds act values, quantised here (counted in
// row_counts; NULL: not counted) and dequantised into rows itself, whose last reader this is.
static const void *exchanged_rows(const ExpertWork *w, void *rows, const Fp8Cols *t, void *scratch,
                                  const int32_t *off, size_t n, Fp8Class c, uint64_t *row_counts) {
    Model *m = w->m;
    const Fp8Operands *q = m->fp8;
    if (receives_fp8(m)) {
        received_row_scales(m, rows, off, n, w->Rr);
        dequantised_cols(m, t, scratch, rows, off, n, w->Rr, c);
        return rows;
    }
    m->ops->fp8_quantize_rows(q->rows, q->row_scales, rows, off, n, w->Rr, m->cfg.d_model, q->how, row_counts);
    dequantised_cols(m, t, rows, q->rows, off, n, w->Rr, c);
    return q->rows;
}

// Pre-norm MoE layer l whose experts read the tokens' FP8 rows (Fp8Operands.tokens): its second
// norm writes them in its own pass (layer_norm_forward), so token_input_rows does not make them.
static bool norm_makes_tokens(const Model *m, int l) {
    return m->fp8 && m->fp8->tokens && m->cfg.norm_placement == NORM_PRE && model_layer_is_moe(&m->cfg, l);
}

// Where the experts read the tokens' rows and keep no token-major copy of them (Fp8Operands.tokens):
// the gate|up product's input rows of experts [e0, e0 + n) as FP8 from the layer input's rows
// quantised once (a token's rows for its top_k experts share their codes and scales; here, or by the
// norm that made the input: norm_makes_tokens), gathered into Fp8Operands.rows; returned. The same
// codes and scales as the rows quantised through the map (fp8_gather_rows); counted once a token.
static const void *token_input_rows(const ExpertWork *w, const int32_t *off, size_t n) {
    Model *m = w->m;
    const Fp8Operands *q = m->fp8;
    size_t T = w->a->B * w->a->S, D = m->cfg.d_model;
    if (!norm_makes_tokens(m, w->l))
        m->ops->fp8_quantize_rows(q->tokens, q->token_scales, w->in, NULL, 1, T, D, q->how,
                                  fp8_counts(q, FP8_CLASS_ACTIVATIONS));
    m->ops->fp8_gather_rows(q->rows, q->row_scales, q->tokens, q->token_scales, w->rows, off, n, w->Rr, D, T);
    return q->rows;
}

// The gate|up product's input of experts [e0, e0 + n) in FP8: its codes, with their scales in
// Fp8Operands.row_scales, where they are made before the product (NULL: fp8_forward quantises them).
// Received through the FP8 exchange; gathered from the tokens' quantised rows (token_input_rows); or,
// with train.fp8_exchange and one rank, where the forward keeps the token-major copy xe_t
// (exchanged_rows).
static const void *experts_input_rows(const ExpertWork *w, const int32_t *off, size_t n) {
    Model *m = w->m;
    if (receives_fp8(m)) {
        received_row_scales(m, w->x->xe, off, n, w->Rr);
        return w->x->xe;
    }
    if (m->fp8 && m->fp8->tokens) return token_input_rows(w, off, n);
    if (!fp8_exchanges(m) || !w->xe_t) return NULL;
    return exchanged_rows(w, w->x->xe, w->xe_t, NULL, off, n, FP8_CLASS_ACTIVATIONS,
                          fp8_counts(m->fp8, FP8_CLASS_ACTIVATIONS));
}

static void experts_forward(void *ctx, size_t e0, size_t e1) {
    const ExpertWork *w = ctx;
    Model *m = w->m;
    const LayerParams *p = &m->layer[w->l];
    size_t D = m->cfg.d_model, H = m->cfg.expert_hidden, n = e1 - e0;
    const int32_t *off = chunk_offsets(w, e0);
    void *hact = experts_hact(m, w->x);
    const void *xq = experts_input_rows(w, off, n);
    expert_forward(m, w->x->gu, w->rows ? w->in : w->x->xe, xq ? NULL : w->rows, xq, xq ? NULL : w->xe_t,
                   expert_tensor(p->experts_gu, e0, 2 * H, D), off, n, 2 * H, D, w->Rr);
    // In FP8 the shared output (one expert-parallel rank) is not stored: only its quantised rows are
    // read, and the backward makes its own from gu (swiglu_backward's hw).
    swiglu_fp8(m, m->fp8, m->fp8 && experts_share_hact(m) ? NULL : hact, w->x->gu, off, n, H, w->Rr);
    expert_forward(m, w->ye, hact, NULL, swiglu_rows(m->fp8), NULL, expert_tensor(p->experts_down, e0, D, H), off, n,
                   D, H, w->Rr);
}

// In FP8 with one expert-parallel rank (one exchange chunk) and no train.fp8_exchange, nothing but
// quantisations reads the dispatched rows (the forward's rows and, where kept, their token-major
// copy; the backward's copy, made there where not kept) or the combine's gradient rows (the down
// projection's rows and token-major copy, from one read): with Fp8Operands.fused_dispatch those read
// the rows of the layer's input and output gradient through Scratch.row_token instead
// (model_reads_token_rows), so that neither is made (two full-size passes a layer less; with
// selective recompute also the backward's second gather).
static bool reads_token_rows(const Model *m) { return m->s.row_token != NULL; }

// The token of each expert row of layer acts x into Scratch.row_token, returned.
static const int32_t *row_tokens(Model *m, const LayerActs *x, size_t T) {
    m->ops->moe_row_tokens(m->s.row_token, x->slot_pos, T, (size_t)m->cfg.top_k);
    return m->s.row_token;
}

// out (T, D) = the MoE layer's output, plus resid (T, D) where non-NULL (added by the combine).
static void moe_forward(Model *m, int l, LayerActs *x, const void *in, void *out, const void *resid,
                        const ForwardArgs *a) {
    const ModelConfig *c = &m->cfg;
    const LayerParams *p = &m->layer[l];
    size_t T = a->B * a->S, D = c->d_model, E = c->n_experts, K = c->top_k;
    void *stats = router_stats(m, a->metrics, l);
    const Fp8Cols *xe_t = forward_cols(&x->xe_t, a);
    bool token_rows = reads_token_rows(m);
    route(m, l, x, in, a);
    dispatch(m, x, token_rows ? NULL : x->xp, in, stats, T);
    moe_exchange_route(&m->xchg, &x->routes, x->offsets, model_f32(m, stats, router_stat_dropped(E)), T);
    void *y = x->y ? x->y : m->s.dy; // one expert-parallel rank: not kept (scratch A until the combine)
    ExpertWork w = {.m = m, .l = l, .x = x, .Rr = moe_exchange_received_rows(&m->xchg, T),
                    .ye = m->par->ep->size > 1 ? m->s.dxe : y, .xe_t = xe_t, .in = in,
                    .rows = token_rows ? row_tokens(m, x, T) : NULL, .a = a};
    ExchangeRows send = experts_send(m, x->xp, x->offsets, x->xe, T, w.Rr, FP8_CLASS_ACTIVATIONS);
    moe_exchange_pipeline(&m->xchg, &x->routes, &send, w.ye, y, experts_forward, &w);
    m->ops->moe_combine_forward(out, resid, y, x->slot_pos, x->topk_w, T, K, D);
    if (c->shared_hidden)
        swiglu_mlp_forward(m, out, in, x->sgu, x->sact, p->shared_gu, p->shared_down, T, c->shared_hidden, true);
}

// The feed-forward output f = ffn(in) into out (T, D); with resid (T, D) non-NULL, resid + f: in the
// MoE combine's pass, or by an add after a dense MLP (which writes f first).
static void ffn_forward(Model *m, int l, LayerActs *x, const void *in, void *out, const void *resid,
                        const ForwardArgs *a) {
    const LayerParams *p = &m->layer[l];
    size_t T = a->B * a->S;
    if (model_layer_is_moe(&m->cfg, l)) {
        moe_forward(m, l, x, in, out, resid, a);
        return;
    }
    swiglu_mlp_forward(m, x->f, in, x->gu, x->hact, p->dense_gu, p->dense_down, T, m->cfg.dense_hidden, false);
    if (resid) m->ops->add(out, resid, x->f, T * m->cfg.d_model);
}

// The attention output's projection, ap (T, D) = att . Wo^T: the forward's, and selective
// recompute's again (residual_recompute) with the same product, so the same values.
static void attention_projection(const Model *m, LayerActs *x, const LayerParams *p, size_t T) {
    const ModelConfig *c = &m->cfg;
    dense_forward(m, FP8_DENSE_OUT, x->ap, x->att, NULL, NULL, p->wo, T, c->d_model, (size_t)c->n_heads * c->head_dim,
                  false);
}

// Attention from the layer's input `in` (with in_t non-NULL: keeping its token-major FP8 copy there;
// in_q non-NULL: in's FP8 rows, made already).
static void attention_forward(Model *m, int l, LayerActs *x, const void *in, const void *in_q, const Fp8Cols *in_t,
                              AttnDims d) {
    const Ops *ops = m->ops;
    const ModelConfig *c = &m->cfg;
    const LayerParams *p = &m->layer[l];
    size_t T = d.B * d.S, D = c->d_model, C = model_qkv_width(c);
    dense_forward(m, FP8_DENSE_QKV, x->qkv_raw, in, in_q, in_t, p->wqkv, T, C, D, false);
    ops->qkv_norm_rope_forward(x->qkv, x->qk_rstd, x->qkv_raw, W(m, p->q_norm), W(m, p->k_norm),
                               m->rope, d, c->qk_norm, (float)c->norm_eps);
    ops->attention_forward(x->att, x->att_lse, x->qkv, d);
    attention_projection(m, x, p, T);
}

// A pre-norm of `a` (and with b non-NULL, of sum = a + b: the residual add in the same pass) into
// out and rstd with the norm weight at w, and with q non-NULL its output's FP8 rows into q and
// scales in the same pass too (rmsnorm_forward_fp8), for a product that reads them (the quantised
// rows the product would otherwise make from out). Returns q.
static const void *layer_norm_forward(const Model *m, void *sum, void *out, void *rstd, const void *a, const void *b,
                                      size_t w, size_t T, void *q, void *scales) {
    const Ops *ops = m->ops;
    size_t D = m->cfg.d_model;
    float eps = (float)m->cfg.norm_eps;
    if (q)
        ops->rmsnorm_forward_fp8(sum, out, rstd, q, scales, a, b, W(m, w), T, D, eps, m->fp8->how,
                                 fp8_counts(m->fp8, FP8_CLASS_ACTIVATIONS));
    else if (b) ops->add_rmsnorm_forward(sum, out, rstd, a, b, W(m, w), T, D, eps);
    else ops->rmsnorm_forward(out, rstd, a, W(m, w), T, D, eps);
    return q;
}

// pre-norm:   h = x + attn(norm1(x));  out = h + ffn(norm2(h))
// reordered:  h = x + norm1(attn(x));  out = h + norm2(ffn(h))
// A recompute leaves out alone: it is kept (the next layer's input). Pre-norm adds h as the
// feed-forward output is made (f itself is written only by a recompute, which no backward reads),
// and h's add and the second norm are one pass.
static void layer_forward(Model *m, int l, const ForwardArgs *a) {
    const Ops *ops = m->ops;
    const ModelConfig *c = &m->cfg;
    LayerActs *x = acts(m, a, l);
    const LayerParams *p = &m->layer[l];
    size_t T = a->B * a->S, D = c->d_model;
    float eps = (float)c->norm_eps;
    const void *in = resid(m, a, l);
    void *out = resid(m, a, l + 1);
    AttnDims d = attn_dims(m, a->B, a->S);
    if (c->norm_placement == NORM_PRE) {
        // With FP8 dense layers the QKV product's rows come from the norm where no token-major copy
        // of its input is kept (that one pass makes both), and the experts' from the second norm
        // (norm_makes_tokens).
        const Fp8Cols *n1_t = forward_cols(&x->n1_t, a);
        const Fp8Operands *q = n1_t ? NULL : dense_fp8_forward(m, FP8_DENSE_QKV);
        const void *n1q = layer_norm_forward(m, NULL, x->n1, x->n1_rstd, in, NULL, p->attn_norm, T,
                                             q ? q->rows : NULL, q ? q->row_scales : NULL);
        attention_forward(m, l, x, x->n1, n1q, n1_t, d);
        bool tokens = norm_makes_tokens(m, l);
        layer_norm_forward(m, x->h, x->n2, x->n2_rstd, in, x->ap, p->ffn_norm, T, tokens ? m->fp8->tokens : NULL,
                           tokens ? m->fp8->token_scales : NULL);
        if (a->recompute) ffn_forward(m, l, x, x->n2, x->f, NULL, a);
        else ffn_forward(m, l, x, x->n2, out, x->h, a);
    } else {
        attention_forward(m, l, x, in, NULL, NULL, d);
        ops->rmsnorm_forward(x->n1, x->n1_rstd, x->ap, W(m, p->attn_norm), T, D, eps);
        ops->add(x->h, in, x->n1, T * D);
        ffn_forward(m, l, x, x->h, x->f, NULL, a);
        ops->rmsnorm_forward(x->n2, x->n2_rstd, x->f, W(m, p->ffn_norm), T, D, eps);
        if (!a->recompute) ops->add(out, x->h, x->n2, T * D);
    }
}

// Final norm, LM head and loss in chunks of rows, so the full (T, V) logits never exist; in
// training each chunk's logit gradient is folded into the LM-head and final-norm gradients at once.
static void head_forward(Model *m, const ForwardArgs *a) {
    const Ops *ops = m->ops;
    size_t T = a->B * a->S, D = m->cfg.d_model, V = m->cfg.vocab_size;
    const int32_t *targets = micro_targets(m, a->micro);
    void *last = model_stage_output(m, a->chunk, a->slot);
    ops->rmsnorm_forward(m->xf, m->xf_rstd, last, W(m, m->final_norm), T, D, (float)m->cfg.norm_eps);
    for (size_t r0 = 0; r0 < T; r0 += m->logit_rows) {
        size_t n = T - r0 < m->logit_rows ? T - r0 : m->logit_rows;
        void *xf = model_act(m, m->xf, r0 * D);
        ops->matmul_forward(m->logits, xf, W(m, m->lm_head), n, V, D, false);
        ops->cross_entropy(m->logits, model_f32(m, a->metrics, METRIC_CE), targets + r0, n, V,
                           a->scales.ce, a->scales.lm_z, a->train);
        if (a->train)
            ops->matmul_backward(model_act(m, m->s.dxf, r0 * D), G(m, m->lm_head), m->logits, xf,
                                 W(m, m->lm_head), n, V, D, false);
    }
    if (a->train)
        ops->rmsnorm_backward(model_stage_grad(m, a->chunk, a->slot), G(m, m->final_norm), m->s.dxf, last,
                              W(m, m->final_norm), m->xf_rstd, T, D, false);
}

int model_param_unit(const Model *m, const ParamInfo *p) {
    if (p->layer >= 0) return p->layer;
    return m->first_stage && p->offset == m->wte ? -1 : m->cfg.n_layers;
}

static void unit_begins(const ForwardArgs *a, int unit) {
    if (a->unit_begins) a->unit_begins(a->hook_ctx, unit);
}

void model_forward(Model *m, const ForwardArgs *a) {
    const ModelChunk *k = &m->chunk[a->chunk];
    MOE_ASSERT(a->B <= m->B && a->S <= m->S && a->chunk < m->n_chunks && a->slot < k->n_slots &&
               a->micro < m->n_micro);
    if (k->first) {
        unit_begins(a, -1);
        m->ops->embedding_forward(model_stage_input(m, a->chunk, a->slot), micro_tokens(m, a->micro),
                                  W(m, m->wte), a->B * a->S, m->cfg.d_model);
    }
    for (int l = k->layer_begin; l < k->layer_end; l++) {
        unit_begins(a, l);
        layer_forward(m, l, a);
    }
    if (k->last) {
        unit_begins(a, m->cfg.n_layers);
        head_forward(m, a);
    }
}

// ---------------------------------------------------------------- backward

// Selective recompute: SwiGLU activations (rows used: as ops.h swiglu_forward's) again from the
// kept gate|up rows, before the down projection's backward (the forward's kernel on the same inputs).
static void swiglu_recompute(const Model *m, void *hact, const void *gu, size_t R, size_t H,
                             const int32_t *rows, size_t n) {
    if (m->recompute == RECOMPUTE_SELECTIVE) m->ops->swiglu_forward(hact, gu, R, H, rows, n);
}

static void swiglu_mlp_backward(const Model *m, void *din, const void *dout, const void *in,
                                const void *gu, void *hact, size_t gu_w, size_t down_w,
                                size_t T, size_t H, bool accumulate) {
    size_t D = m->cfg.d_model;
    swiglu_recompute(m, hact, gu, T, H, NULL, 0);
    dense_backward(m, FP8_DENSE_MLP, m->s.dhact, G(m, down_w), dout, hact, NULL, down_w, T, D, H, false);
    m->ops->swiglu_backward(m->s.dgu, NULL, NULL, m->s.dhact, gu, NULL, T, H, NULL, 0);
    dense_backward(m, FP8_DENSE_MLP, din, G(m, gu_w), m->s.dgu, in, NULL, gu_w, T, 2 * H, D, accumulate);
}

// Selective recompute: the router's logits, scores, choice, weights and counts again from the
// layer's feed-forward input (the forward's kernels on the same inputs; the call's summary goes to
// scratch).
static void moe_recompute(Model *m, int l, LayerActs *x, const void *in, const ForwardArgs *a) {
    if (m->recompute == RECOMPUTE_SELECTIVE) router_logits_choose(m, l, x, in, m->shared.aux, a);
}

// Selective recompute with one expert-parallel rank: the dispatched rows xp again from the layer's
// input, for the gate|up product's weight gradient, once the SwiGLU backward has read dhact in
// scratch B, which xp shares (alloc_selective_shared; the forward's kernel on the same inputs: it
// rewrites the kept offsets and positions with the same values; the drop counts go to scratch).
// Several ranks keep the received rows (no exchange is redone).
static void rows_recompute(const ExpertWork *w) {
    Model *m = w->m;
    if (m->recompute != RECOMPUTE_SELECTIVE || m->par->ep->size > 1 || w->rows) return;
    MOE_ASSERT(m->xchg.chunks == 1); // one call over every expert: no chunk's rows are read after this
    dispatch(m, w->x, w->x->xp, w->in, router_stats(m, m->metrics_scratch, w->l), w->a->B * w->a->S);
}

// Where the experts' inputs are read from the tokens' rows (reads_token_rows) and no copy is kept: the
// gate|up weight gradient's token-major copy of them into Fp8Operands.x_t (described in *xt,
// returned), from the layer's input through Scratch.row_token (no gather).
static const Fp8Cols *token_cols(const ExpertWork *w, Fp8Cols *xt, const int32_t *off, size_t n) {
    const Model *m = w->m;
    const Fp8Operands *q = m->fp8;
    *xt = (Fp8Cols){.q = q->x_t, .scales = q->x_t_scales};
    m->ops->fp8_quantize_rows_cols(NULL, NULL, xt->q, xt->scales, w->in, w->rows, off, n, w->Rr, m->cfg.d_model, q->how,
                                   q->x_cols, fp8_counts(q, FP8_CLASS_ACTIVATIONS));
    return xt;
}

// train.fp8_exchange in the backward (no copy kept): the gate|up weight gradient's token-major copy
// of the experts' inputs into Fp8Operands.x_t (described in *xt, returned) by exchanged_rows: the
// received rows dequantised into scratch B, whose dhact the SwiGLU backward has read; with one rank
// the rows quantised again, uncounted (the forward counted them).
static const Fp8Cols *exchanged_cols(const ExpertWork *w, Fp8Cols *xt, const int32_t *off, size_t n) {
    const Fp8Operands *q = w->m->fp8;
    *xt = (Fp8Cols){.q = q->x_t, .scales = q->x_t_scales};
    exchanged_rows(w, w->x->xe, xt, w->m->s.dhact, off, n, FP8_CLASS_ACTIVATIONS, NULL);
    return xt;
}

// train.fp8_exchange (else NULL): the down projection's output gradients dye as FP8 rows and their
// token-major copy (Fp8Operands.dout_t) by exchanged_rows, into *made (returned): the received rows
// dequantised into scratch A, whose dgu the SwiGLU backward writes after; with one rank dye's rows
// quantised here, after which the down projection's products read dye only through these copies.
static const Fp8Made *exchanged_dout(const ExpertWork *w, Fp8Made *made, const int32_t *off, size_t n) {
    const Fp8Operands *q = w->m->fp8;
    if (!fp8_exchanges(w->m)) return NULL;
    made->t = (Fp8Cols){.q = q->dout_t, .scales = q->dout_t_scales};
    made->rows = exchanged_rows(w, w->dye, &made->t, w->m->s.dgu, off, n, FP8_CLASS_GRADIENTS,
                                fp8_counts(q, FP8_CLASS_GRADIENTS));
    return made;
}

// With one expert-parallel rank in FP8 (fuses_swiglu_fp8), after the down projection's input
// gradient: the SwiGLU backward with the FP8 operands of the products it feeds from one pass
// (swiglu_backward_fp8; neither the gate|up gradient nor the weighted h is stored), then the down
// projection's weight gradient. The gate|up gradient's rows go to Fp8Operands.rows and its token-major
// copy to scratch A (fused_dgu_cols; free: any rows' gradients dye there were last read by that input
// gradient, which kept their token-major copy in Fp8Operands.dout_t), the weighted h's token-major
// copy to Fp8Operands.x_t. Returns the gate|up gradient's operands, in *made.
static const Fp8Made *fused_swiglu_backward(const ExpertWork *w, Fp8Made *made, size_t down, const int32_t *off,
                                            size_t n) {
    Model *m = w->m;
    const Fp8Operands *q = m->fp8;
    const Scratch *s = &m->s;
    size_t D = m->cfg.d_model, H = m->cfg.expert_hidden, Rr = w->Rr;
    Fp8Cols hw_t = {.q = q->x_t, .scales = q->x_t_scales};
    *made = (Fp8Made){.rows = q->rows, .t = fused_dgu_cols(m, Rr, n)};
    m->ops->swiglu_backward_fp8(q->rows, q->row_scales, made->t.q, made->t.scales, s->row_dot, hw_t.q, hw_t.scales,
                                s->dhact, w->x->gu, s->row_w, off, n, Rr, H, q->how, q->x_cols,
                                fp8_counts(q, FP8_CLASS_GRADIENTS), fp8_counts(q, FP8_CLASS_ACTIVATIONS));
    expert_backward(m, NULL, G(m, down), w->accumulate_dw, NULL, NULL, NULL, NULL, &hw_t, down, off, n, D, H, Rr,
                    DOUT_T_KEPT);
    return made;
}

// With several expert-parallel ranks in FP8 (fuses_swiglu_fp8; no row dots: those layers keep their
// SwiGLU output), after the down projection's products: the SwiGLU backward with the gate|up
// gradient's rows (Fp8Operands.rows) and token-major copy (Fp8Operands.dout_t, which that weight
// gradient has read) from one pass, the gradient itself not stored. Returns its operands, in *made.
static const Fp8Made *fused_swiglu_grads(const ExpertWork *w, Fp8Made *made, const int32_t *off, size_t n) {
    const Model *m = w->m;
    const Fp8Operands *q = m->fp8;
    *made = (Fp8Made){.rows = q->rows, .t = {.q = q->dout_t, .scales = q->dout_t_scales}};
    m->ops->swiglu_backward_fp8(q->rows, q->row_scales, made->t.q, made->t.scales, NULL, NULL, NULL, m->s.dhact,
                                w->x->gu, NULL, off, n, w->Rr, m->cfg.expert_hidden, q->how, q->x_cols,
                                fp8_counts(q, FP8_CLASS_GRADIENTS), NULL);
    return made;
}

static void experts_backward(void *ctx, size_t e0, size_t e1) {
    const ExpertWork *w = ctx;
    Model *m = w->m;
    const Ops *ops = m->ops;
    const LayerParams *p = &m->layer[w->l];
    const Scratch *s = &m->s;
    LayerActs *x = w->x;
    size_t D = m->cfg.d_model, H = m->cfg.expert_hidden, n = e1 - e0, Rr = w->Rr;
    size_t down = expert_tensor(p->experts_down, e0, D, H), gu = expert_tensor(p->experts_gu, e0, 2 * H, D);
    const int32_t *off = chunk_offsets(w, e0);
    void *dgu = s->dgu;
    Fp8Made dye_made, dgu_made;
    const Fp8Made *dgu_q = NULL; // the gate|up gradient's FP8 operands where the SwiGLU backward made them
    if (experts_share_hact(m)) {
        // The rows' unweighted gradients. One SwiGLU backward also gives the combine weights'
        // gradients and the weighted h for the down projection's weight gradient; it writes the
        // gate|up gradient over the kept gate|up rows (their last read), as dgu's scratch A still
        // holds the rows' gradients dye, which that weight gradient reads after it (or, with
        // train.fp8_exchange, their token-major copy made first).
        const Fp8Made *dye_q = exchanged_dout(w, &dye_made, off, n);
        expert_backward(m, s->dhact, NULL, false, w->rows ? w->dout : w->dye, w->rows, dye_q, NULL, NULL, down, off,
                        n, D, H, Rr, dye_q ? DOUT_T_KEPT : DOUT_T_KEEP);
        if (fuses_swiglu_fp8(m)) dgu_q = fused_swiglu_backward(w, &dgu_made, down, off, n);
        else {
            dgu = x->gu;
            ops->swiglu_backward(dgu, s->row_dot, m->expert_hact, s->dhact, x->gu, s->row_w, Rr, H, off, n);
            expert_backward(m, NULL, G(m, down), w->accumulate_dw, w->dye, NULL, NULL, m->expert_hact, NULL, down,
                            off, n, D, H, Rr, DOUT_T_KEPT);
        }
    } else {
        swiglu_recompute(m, x->hact, x->gu, Rr, H, off, n);
        MOE_ASSERT(!w->rows);
        const Fp8Made *dye_q = exchanged_dout(w, &dye_made, off, n);
        expert_backward(m, s->dhact, G(m, down), w->accumulate_dw, w->dye, NULL, dye_q, x->hact, NULL, down, off, n,
                        D, H, Rr, dye_q ? DOUT_T_KEPT : DOUT_T_MAKE);
        if (fuses_swiglu_fp8(m)) dgu_q = fused_swiglu_grads(w, &dgu_made, off, n);
        else ops->swiglu_backward(dgu, NULL, NULL, s->dhact, x->gu, NULL, Rr, H, off, n);
    }
    rows_recompute(w);
    Fp8Cols made;
    const Fp8Cols *xe_t = kept_cols(&x->xe_t);
    if (!xe_t && fp8_exchanges(m)) xe_t = exchanged_cols(w, &made, off, n);
    else if (!xe_t && w->rows) xe_t = token_cols(w, &made, off, n);
    expert_backward(m, w->dxe, G(m, gu), w->accumulate_dw, dgu, NULL, dgu_q, x->xe, xe_t, gu, off, n, 2 * H, D, Rr,
                    dgu_q ? DOUT_T_KEPT : DOUT_T_MAKE);
}

// With several expert-parallel ranks the combine gradient dy goes straight into the exchange
// buffer dxp that the expert input gradients come back to: a chunk's dy rows are pushed before its
// gradients return to the same rows (moe_exchange_pipeline), and the scratch dy shares with dgu
// would be overwritten by the experts' backward while later chunks' rows still wait to be read.
static void moe_backward(Model *m, int l, LayerActs *x, void *din, const void *dout,
                         const void *in, bool accumulate, const ForwardArgs *a) {
    const Ops *ops = m->ops;
    const ModelConfig *c = &m->cfg;
    const LayerParams *p = &m->layer[l];
    const Scratch *s = &m->s;
    size_t T = a->B * a->S, D = c->d_model, E = c->n_experts, K = c->top_k;
    bool ep = m->par->ep->size > 1;
    moe_recompute(m, l, x, in, a);
    if (c->shared_hidden) {
        swiglu_mlp_backward(m, din, dout, in, x->sgu, x->sact, p->shared_gu, p->shared_down, T,
                            c->shared_hidden, accumulate);
        accumulate = true;
    }
    void *dy = ep ? s->dxp : s->dy;
    const int32_t *rows = reads_token_rows(m) ? row_tokens(m, x, T) : NULL;
    ops->moe_combine_backward(rows ? NULL : dy, s->dtopk_w, s->row_w, dout, x->y, x->slot_pos, x->topk_w, T, K, D);
    ExpertWork w = {.m = m, .l = l, .x = x, .Rr = moe_exchange_received_rows(&m->xchg, T),
                    .dye = !ep ? s->dy : receives_fp8(m) ? s->dye8 : s->dxe, .dxe = ep ? s->dxe : s->dxp,
                    .in = in, .dout = dout, .rows = rows,
                    .accumulate_dw = m->expert_dw_written[l], .a = a};
    ExchangeRows send = experts_send(m, dy, x->offsets, w.dye, T, w.Rr, FP8_CLASS_GRADIENTS);
    moe_exchange_pipeline(&m->xchg, &x->routes, &send, w.dxe, s->dxp, experts_backward, &w);
    m->expert_dw_written[l] = true; // by every chunk of experts: the next call adds to them
    if (!x->y) ops->moe_slot_values(s->dtopk_w, s->row_dot, x->slot_pos, T * K);
    ops->moe_dispatch_backward(din, s->dxp, x->slot_pos, T, K, D, accumulate);
    ops->router_backward(s->dlogits, s->dtopk_w, x->logits, x->scores, x->topk_idx, x->topk_w,
                         x->aux, router_args(m, l, a));
    ops->matmul_backward(din, G(m, p->router), s->dlogits, in, W(m, p->router), T, E, D, true);
}

static void ffn_backward(Model *m, int l, LayerActs *x, void *din, const void *dout,
                         const void *in, bool accumulate, const ForwardArgs *a) {
    const LayerParams *p = &m->layer[l];
    if (model_layer_is_moe(&m->cfg, l)) moe_backward(m, l, x, din, dout, in, accumulate, a);
    else swiglu_mlp_backward(m, din, dout, in, x->gu, x->hact, p->dense_gu, p->dense_down,
                             a->B * a->S, m->cfg.dense_hidden, accumulate);
}

static void attention_backward(Model *m, int l, LayerActs *x, void *din, const void *dout,
                               const void *in, bool accumulate, AttnDims d) {
    const Ops *ops = m->ops;
    const ModelConfig *c = &m->cfg;
    const LayerParams *p = &m->layer[l];
    const Scratch *s = &m->s;
    size_t T = d.B * d.S, D = c->d_model, C = model_qkv_width(c);
    dense_backward(m, FP8_DENSE_OUT, s->datt, G(m, p->wo), dout, x->att, NULL, p->wo, T, D, d.Hq * d.hd, false);
    if (m->recompute == RECOMPUTE_SELECTIVE) // the forward's values again (the same kernel on the same inputs)
        ops->qkv_norm_rope_forward(x->qkv, x->qk_rstd, x->qkv_raw, W(m, p->q_norm), W(m, p->k_norm), m->rope, d,
                                   c->qk_norm, (float)c->norm_eps);
    ops->attention_backward(s->dqkv, s->datt, x->qkv, x->att, x->att_lse, d);
    ops->qkv_norm_rope_backward(s->dqkv, G(m, p->q_norm), G(m, p->k_norm), s->dqkv, x->qkv_raw, // in place
                                W(m, p->q_norm), W(m, p->k_norm), x->qk_rstd, m->rope, d,
                                c->qk_norm);
    dense_backward(m, FP8_DENSE_QKV, din, G(m, p->wqkv), s->dqkv, in, kept_cols(&x->n1_t), p->wqkv, T, C, D,
                   accumulate);
}

// Selective recompute, pre-norm: a norm's output again from its kept input (the forward's kernel
// on the same input; it rewrites the kept 1/rms with the same values). A reordered-norm backward
// reads no norm output.
static void norm_recompute(const Model *m, void *out, void *rstd, const void *in, size_t w, size_t T) {
    if (m->recompute == RECOMPUTE_SELECTIVE)
        m->ops->rmsnorm_forward(out, rstd, in, W(m, w), T, m->cfg.d_model, (float)m->cfg.norm_eps);
}

// Full recompute: the layer's forward again from its kept input, into the shared buffers, with the
// same routing (same noise keys, the kept bias) and without counting metrics twice.
static void layer_recompute(Model *m, int l, const ForwardArgs *a) {
    if (m->recompute != RECOMPUTE_FULL) return;
    ForwardArgs r = *a;
    r.metrics = m->metrics_scratch, r.recompute = true;
    layer_forward(m, l, &r);
}

// Selective recompute, pre-norm: the residual stream after attention, h = in + att Wo^T, again (the
// forward's projection and add on the same inputs, FP8 or not, so the same values) into its shared
// buffer.
static void residual_recompute(const Model *m, LayerActs *x, const LayerParams *p, const void *in, size_t T) {
    if (m->recompute != RECOMPUTE_SELECTIVE) return;
    attention_projection(m, x, p, T);
    m->ops->add(x->h, in, x->ap, T * m->cfg.d_model);
}

// On entry s.dres holds d(layer output); on return d(layer input).
static void layer_backward(Model *m, int l, const ForwardArgs *a) {
    const Ops *ops = m->ops;
    const ModelConfig *c = &m->cfg;
    LayerActs *x = acts(m, a, l);
    const LayerParams *p = &m->layer[l];
    void *dres = m->s.dres, *dn = m->s.dn;
    const void *in = resid(m, a, l);
    size_t T = a->B * a->S, D = c->d_model;
    AttnDims d = attn_dims(m, a->B, a->S);
    layer_recompute(m, l, a);
    if (c->norm_placement == NORM_PRE) {
        residual_recompute(m, x, p, in, T);
        norm_recompute(m, x->n2, x->n2_rstd, x->h, p->ffn_norm, T);
        ffn_backward(m, l, x, dn, dres, x->n2, false, a);
        ops->rmsnorm_backward(dres, G(m, p->ffn_norm), dn, x->h, W(m, p->ffn_norm), x->n2_rstd, T, D, true);
        norm_recompute(m, x->n1, x->n1_rstd, in, p->attn_norm, T);
        attention_backward(m, l, x, dn, dres, x->n1, false, d);
        ops->rmsnorm_backward(dres, G(m, p->attn_norm), dn, in, W(m, p->attn_norm), x->n1_rstd, T, D, true);
    } else {
        ops->rmsnorm_backward(dn, G(m, p->ffn_norm), dres, x->f, W(m, p->ffn_norm), x->n2_rstd, T, D, false);
        ffn_backward(m, l, x, dres, dn, x->h, true, a);
        ops->rmsnorm_backward(dn, G(m, p->attn_norm), dres, x->ap, W(m, p->attn_norm), x->n1_rstd, T, D, false);
        attention_backward(m, l, x, dres, dn, in, true, d);
    }
}

void model_backward(Model *m, const ForwardArgs *a) {
    MOE_ASSERT(a->train);
    const ModelChunk *k = &m->chunk[a->chunk];
    void *grad = model_stage_grad(m, a->chunk, a->slot);
    if (grad != m->s.dres) m->ops->copy(m->s.dres, grad, a->B * a->S * m->cfg.d_model * m->ops->act_size);
    for (int l = k->layer_end - 1; l >= k->layer_begin; l--) {
        layer_backward(m, l, a);
        if (a->layer_done) a->layer_done(a->hook_ctx, l);
    }
    if (k->first)
        m->ops->embedding_backward(G(m, m->wte), m->s.dres, micro_tokens(m, a->micro), a->B * a->S,
                                   m->cfg.d_model, m->cfg.vocab_size);
}

// ---------------------------------------------------------------- inference

void model_last_logits(Model *m, const int32_t *tokens, size_t n, float *logits) {
    MOE_ASSERT(n >= 1 && n <= m->S && m->first_stage && m->last_stage);
    const Ops *ops = m->ops;
    size_t D = m->cfg.d_model, V = m->cfg.vocab_size;
    ops->upload(micro_tokens(m, 0), tokens, n * sizeof(int32_t));
    ForwardArgs a = {.B = 1, .S = n, .train = false, .metrics = m->metrics_scratch};
    ops->embedding_forward(model_stage_input(m, 0, 0), micro_tokens(m, 0), W(m, m->wte), n, D);
    for (int l = 0; l < m->cfg.n_layers; l++) layer_forward(m, l, &a);
    ops->rmsnorm_forward(m->xf, m->xf_rstd, model_act(m, model_stage_output(m, 0, 0), (n - 1) * D),
                         W(m, m->final_norm), 1, D, (float)m->cfg.norm_eps);
    ops->matmul_forward(m->logits, m->xf, W(m, m->lm_head), 1, V, D, false);
    ops->download_act(logits, m->logits, V);
}

// The MoE language model: parameters, activation memory, and the forward/backward orchestration,
// written once in C against the ops interface and shared by every backend. A process holds the
// layers of its pipeline stage and, in each MoE layer, the experts of its expert-parallel rank;
// one process with one-rank communicators is the plain case of the same code.
#pragma once
#include <stdint.h>

#include "config.h"
#include "dist/parallel.h"
#include "moe_exchange.h"
#include "ops/ops.h"
#include "params.h"
#include "pool.h"

// Offsets of one layer's tensors in the flat parameter buffers (fused groups are adjacent).
typedef struct {
    size_t attn_norm, wqkv, q_norm, k_norm, wo, ffn_norm; // wqkv (C, D): q_proj | k_proj | v_proj
    size_t router;                    // (E, D)
    size_t experts_gu, experts_down;  // local experts: (El, 2H, D) gate | up; (El, D, H)
    size_t shared_gu, shared_down;    // (2Hs, D), (D, Hs)
    size_t dense_gu, dense_down;      // (2Hd, D), (D, Hd)
} LayerParams;

// A token-major FP8 copy of a product's input x (R, K), kept from the forward for the weight
// gradient (fp8_quantize_cols' layout; q NULL: not kept, the backward quantises x itself).
typedef struct {
    void *q;                   // e4m3 (K, Tt)
    void *scales;              // f32 (Tt / 128, K)
} Fp8Cols;

// Activations of one layer for its backward. T = B S tokens, R routed rows of this rank,
// Rr rows its experts receive (R when not expert-parallel). A buffer that train.recompute drops
// points into Model.shared (one buffer for every layer and slot; selective recompute's largest ones
// are gradient scratch, Scratch); `aux` is always the layer's own.
typedef struct {
    void *n1, *n1_rstd;        // act (T, D), f32 (T): attention-side norm output and 1/rms
    Fp8Cols n1_t;              // (D, fp8_expert_cols(T, 1)): n1's token-major FP8 copy, the QKV weight
                               // gradient's operand, where the model keeps it (model_keeps_fp8_n1)
    void *qkv_raw, *qkv;       // act (T, C): projection, then QK-norm + RoPE
    void *qk_rstd;             // f32 (T, Hq + Hkv)
    void *att, *att_lse;       // act (T, Hq hd), f32 (B, Hq, S)
    void *ap;                  // act (T, D) attention output projection
    void *h;                   // act (T, D) residual stream after attention
    void *n2, *n2_rstd;        // act (T, D), f32 (T): feed-forward-side norm
    void *f;                   // act (T, D) feed-forward output
    void *gu, *hact;           // act: dense (T, 2Hd), (T, Hd); MoE (Rr, 2H), (Rr, H) expert-major
                               // (MoE hact only with several expert-parallel ranks: Model.expert_hact;
                               // with one, the backward writes the gate|up gradient over MoE gu)
    void *logits, *scores;     // act (T, E), f32 (T, E)
    int32_t *topk_idx;         // (T, K)
    void *topk_w;              // f32 (T, K)
    void *aux;                 // f32 (2E + 1): routed slots, score sums, lse^2 sum (summed over dp)
    int32_t *counts, *offsets; // (E), (E + 1): this rank's routed slots per expert, sorted offsets
    int32_t *slot_pos;         // (T, K)
    void *xp, *y;              // act (R, D): dispatched rows, their expert outputs (same order; y
                               // only with several expert-parallel ranks, else scratch A until the combine)
    void *xe;                  // act (Rr, D) rows for this rank's experts, expert-major (== xp); with
                               // train.fp8_exchange and several expert-parallel ranks their e4m3 codes
                               // (Rr, D) then their f32 scales (Rr, Fp8Operands.send_pitch) in its bytes
    Fp8Cols xe_t;              // (D, fp8_expert_cols(Rr, El)): xe's token-major FP8 copy, the experts'
                               // gate|up weight gradient's operand, where kept (model_keeps_fp8_xe)
    ExchangeRoutes routes;     // how this call's rows travel to the experts' ranks and back
    void *sgu, *sact;          // act (T, 2Hs), (T, Hs): shared expert
} LayerActs;

// One weight tensor kept in FP8: a copy of the compute weights (El, N, K) at flat offset `off` (this
// rank's El experts of a MoE layer, or a dense layer's weight with El = 1), refreshed whenever the
// compute weights change (model_compute_weights_ready). The input gradient reads the codes
// transposed, made from q where it runs (Fp8Operands.wt), with the scales of the transpose.
typedef struct {
    size_t off, El, N, K;
    void *q;                   // e4m3 (El, N, K): the forward's codes
    void *scales, *scales_t;   // f32 (El, Kb, Nb), (El, Nb, Kb): q's, and those of its transpose
} Fp8Weights;

// The dense linear layers' products that can run in FP8 beside the experts' (Fp8Operands.dense).
typedef enum { FP8_DENSE_QKV, FP8_DENSE_OUT, FP8_DENSE_MLP, FP8_DENSE_KINDS } Fp8Dense;

// The FP8 products' operands (model_init with modes.fp8; docs/FP8.md): the weights of every product in FP8
// held here, kept from one change of the compute weights to the next, and the activation operands,
// scratch shared by every layer and product (nothing in it outlives a product). A product (N, K)
// reads rows of its input (T, K) or output gradient (T, N) and token-major copies (N, Tt), (K, Tt):
// the expert products Rr received rows over El local experts with Tt = fp8_expert_cols(Rr, El)
// columns, the dense ones T = B S tokens with Tt = fp8_expert_cols(T, 1) (one group); each buffer
// is sized for the larger need of the two kinds.
typedef struct {
    Fp8Scaling how;
    Fp8ColBlocks x_cols;        // the scale blocks of the token-major copies of the products' inputs
                                // that their weight gradients read (train.fp8_wgrad_blocks); the output
                                // gradients' copies are in 1x128
    bool dense[FP8_DENSE_KINDS]; // which dense linear layers' products run in FP8 too, not only the
                                 // experts': the attention's QKV and output projections, the dense
                                 // and shared MLPs
    bool act_forward[FP8_DENSE_KINDS]; // of those, the ones whose forward product runs in act precision
                                       // all the same, their two backward products in FP8 (the QKV
                                       // projection with train.fp8_qkv_forward = false)
    bool fused_dispatch;        // with one expert-parallel rank, the experts' operands and the down
                                // projections' output gradients read from the tokens' rows
                                // (Scratch.row_token: the dispatch and the combine's backward copy none)
    bool fused_swiglu;          // the experts' SwiGLU backward makes the FP8 operands of the products it
                                // feeds (swiglu_backward_fp8), where expert_hidden is a multiple of 128
                                // and not with `exchange`
    bool fused_update;          // the optimizer's update of the staged experts' weights makes their FP8
                                // copies (model_fp8_update_target), or with several ranks in the
                                // expert-data-parallel group each rank quantises its shard's part and
                                // the group gathers codes, not the compute weights (amax)
    void *amax;                 // f32 (El, Kb, Nb) of the largest expert tensor, or NULL: with
                                // fused_update and several expert-data-parallel ranks, the block maxima
                                // of a rank's part, then of every part (model_compute_weights_ready)
    bool exchange;              // train.fp8_exchange: the experts' inputs and the down projections' output
                                // gradients are quantised where they are dispatched and travel as FP8 rows
                                // (codes, then their scales row-major: LayerActs.xe, Scratch.dye8); the
                                // weight gradients read token-major copies of their values dequantised,
                                // with one rank too
    size_t send_pitch;          // with exchange: f32 scales a row of them, Kb rounded up to 16-byte rows
    void *send, *send_scales;   // with exchange and several expert-parallel ranks: e4m3 (R, D) and f32
                                // (R, send_pitch), the rows sent (R routed rows in dispatch order): the
                                // forward's inputs, the backward's output gradients
    Fp8Weights *weights;        // (n_weights): per layer held, with `dense` its wqkv (C, D), wo (D, Hq hd),
                                // then the dense or shared MLP's gate|up (2H, D) and down (D, H); in a
                                // MoE layer its experts' gate|up (El, 2H, D) then down (El, D, H)
    size_t n_weights;
    void *wt;                   // e4m3 (the largest El N K of them): the transposed codes of the weights an
                                // input gradient reads, made from their q just before it
                                // (fp8_transpose_codes): one buffer instead of a second copy of every
                                // weight (3.1 GiB on olmoe-L8)
    size_t weight_bytes;        // the bytes of their codes and scales and of wt (of Model.mem)
    void *rows, *row_scales;    // e4m3 (Rr or T, max(N, K)), f32: the rows of a forward or input gradient
    void *dout_t, *dout_t_scales; // e4m3 (N, Tt), f32 (Tt / 128, N): token-major output gradient
    void *x_t, *x_t_scales;       // e4m3 (K, Tt), f32 (Tt / 128, K): token-major input
    void *tokens, *token_scales;  // e4m3 (T, D), f32 (Kb, T) or NULL: where the experts' inputs are read
                                  // from the tokens' rows (fused_dispatch) and no token-major copy of them
                                  // is kept, the layer input's rows quantised once a token, then
                                  // gathered into `rows` (fp8_gather_rows; token_input_rows)
    void *sum;                  // act (T, D): a dense product that adds to its output, before the add (the
                                // FP8 products only write theirs); Scratch.dxf, free outside the head
    uint64_t *counts;           // u64 (FP8_CLASSES, FP8_COUNTS): what the quantisations counted (ops/fp8.h),
                                // per class, since the trainer last zeroed them (each step)
} Fp8Operands;

// The FP8 counters' length (Fp8Operands.counts).
enum { MODEL_FP8_COUNTS = FP8_CLASSES * FP8_COUNTS };

// What one micro-batch in flight keeps in one model chunk (a pipeline stage holds several).
typedef struct {
    void **resid;              // (n_local + 1) act (T, D): input of each layer of the chunk, then output
    LayerActs *layer;          // (n_local)
    void *grad;                // act (T, D) gradient of the chunk's output, received or from the loss,
                               // waiting for the chunk's backward (several chunks; NULL: s.dres)
} SlotActs;

// Consecutive layers a rank holds (a virtual pipeline stage), with their activations in flight.
typedef struct {
    int layer_begin, layer_end;
    bool first, last;          // the first virtual stage (embeds the tokens), the last (head and loss)
    int n_slots;
    SlotActs *slots;           // (n_slots)
} ModelChunk;

// Gradient scratch shared by all layers and slots, sized for the largest layer. The largest
// gradients of a layer's backward take turns in two buffers (A, B), each read by the next step
// only: feed-forward dy (A) -> dhact (B) -> dgu (A) -> dxp (B, with one expert-parallel rank;
// with several it is an exchange buffer peers write), attention dqkv (A, the QK-norm backward's
// output in place). With one
// expert-parallel rank dy (A) is also read by the down projection's weight gradient after dhact
// (B), and A holds a MoE forward's expert outputs until the combine; with the fused FP8 SwiGLU
// backward (model.c, fused_swiglu_backward) A then holds the gate|up gradient's token-major copy.
// With FP8 inputs kept (model_keeps_fp8_n1, _xe) dn is the buffer the forward's n1 shares, and B the
// one its xp shares;
// selective recompute lends B, A, datt, dn and dxf to its recomputed values (model.c,
// alloc_selective_shared), and the head's xf and logits are B and A (alloc_head).
typedef struct {
    void *dres;               // act (T, D) gradient of the residual stream (stage in/out gradient)
    void *dn;                 // act (T, D)
    void *datt;               // act (T, Hq hd); selective recompute with pre-norm: (T, max(Hq hd, D))
    void *dqkv;               // act (T, C): A
    void *dgu, *dhact;        // act (max rows, 2 max hidden), (max rows, max hidden): A, B
    void *dy, *dxp;           // act (R, D) in dispatch order: A, B (or an exchange buffer)
    void *dxe;                // act (Rr, D)
    void *dye8;               // with train.fp8_exchange and several expert-parallel ranks: the down
                              // projection's output gradients received as FP8 rows (codes (Rr, D),
                              // then their scales), apart from dxe, which the input gradients of
                              // earlier chunks are written to while later chunks' rows land
    void *dlogits;            // act (T, E)
    void *dtopk_w;            // f32 (T, K)
    void *row_w, *row_dot;    // f32 (Rr), one expert-parallel rank: each expert row's combine weight,
                              // and the gradient of that weight (swiglu_backward's row_dot)
    int32_t *row_token;       // i32 (Rr) with Fp8Operands.fused_dispatch, one expert-parallel rank and no
                              // fp8_exchange (model.c, reads_token_rows): the token of each expert row
                              // (moe_row_tokens), whose rows of the layer's input and output gradient
                              // the quantisations read in place of the dispatched rows and the
                              // combine's gradient rows, which are then not made
    void *dxf;                // act (T, D) gradient of the final-norm output (within the head's forward; the
                              // FP8 dense products' Fp8Operands.sum and selective recompute's n1, n2 outside it)
} Scratch;

// d(total loss) / d(each summed quantity a forward produces)
typedef struct {
    float ce;   // per token cross-entropy
    float lm_z; // per token LM-head logsumexp^2
    float lb;   // per call load-balance loss
    float z;    // per call router z-loss
} LossScales;

typedef struct {
    size_t B, S;        // this rank's batch (at most what the model was sized for)
    int micro;          // which of the step's uploaded batches (model_set_batch)
    int chunk;          // which model chunk of this rank (0 unless the pipeline interleaves)
    int slot;           // activation slot of this micro-batch in that chunk
    bool train;         // keep activations, compute LM-head gradients for the backward
    bool recompute;     // set by the model for a backward's rerun of a layer's forward (train.recompute
                        // = full): metrics go to scratch, the kept router summary stays as it is
    uint64_t token_base; // this rank's first token within the step's global batch (noise counter)
    LossScales scales;
    void *metrics;      // f32 accumulators (model_metrics_len)
    void (*layer_done)(void *ctx, int layer); // backward: called after each layer's (NULL: not)
    void (*unit_begins)(void *ctx, int unit);  // forward: called before each unit (model_param_unit)
                                               // reads its weights (NULL: not)
    void *hook_ctx;                            // ctx of both
} ForwardArgs;

// What a model allocates beyond its shape: the activations train.recompute drops, and whether the
// expert products run in FP8 (train.precision = fp8), with which scaling (train.fp8_recipe) and
// with the dense linear layers' products too (train.fp8_dense: QKV, output projection, dense and
// shared MLPs; never the router nor the LM head; train.fp8_dense_qkv and _out take the attention's
// projections out of that one at a time, train.fp8_qkv_forward the QKV projection's forward alone).
typedef struct {
    Recompute recompute;
    bool fp8;
    Fp8Scaling how;
    bool fp8_dense;
    bool fp8_act_qkv;        // with fp8_dense, the attention's QKV projection in act precision all the
                             // same (train.fp8_dense_qkv = false; zero, as unset: in FP8 with the rest)
    bool fp8_act_out;        // the same for its output projection (train.fp8_dense_out = false)
    bool fp8_act_qkv_forward; // with the QKV projection in FP8, its forward product in act precision,
                              // its backward's in FP8 (train.fp8_qkv_forward = false)
    bool fp8_fused_dispatch; // train.fp8_fused_dispatch (Fp8Operands.fused_dispatch)
    bool fp8_fused_swiglu;   // train.fp8_fused_swiglu (Fp8Operands.fused_swiglu)
    bool fp8_exchange;       // train.fp8_exchange (Fp8Operands.exchange)
    bool fp8_wgrad_blocks;   // train.fp8_wgrad_blocks (Fp8Operands.x_cols)
    bool fp8_fused_update;   // train.fp8_fused_update (Fp8Operands.fused_update)
} ModelModes;

typedef struct {
    ModelConfig cfg;
    const Ops *ops;
    const Parallel *par;
    int n_chunks;                // model chunks held here (pipeline virtual stages)
    ModelChunk chunk[PIPE_MAX_CHUNKS];
    int n_experts_local;         // El experts held here in each MoE layer
    bool first_stage, last_stage; // holds the embedding; holds the final norm, head and loss
    ParamRegistry reg;
    LayerParams *layer;          // (L), valid for held layers
    size_t wte, final_norm, lm_head;
    void *params;                // f32 (master_len) master weights: each region's [master_begin,
                                 // + master_size) back to back (model_master addresses them)
    size_t master_begin[PARAM_N_REGIONS], master_size[PARAM_N_REGIONS], master_len;
                                 // the part of each region held in params: the whole region when the
                                 // backend aliases (params == params_act), else this rank's shard
                                 // of the region's group (ZeRO-1: the compute copy alone is whole)
    void *params_act;            // act (act_len) compute weights (== params when the backend aliases): every
                                 // tensor's but, where the experts' are staged, those of the experts' region
    size_t act_len;              // P, or with staged experts the elements before the experts' region
    void *expert_stage;          // act (El, 2H, D) or NULL: with FP8 products and a compute copy apart from
                                 // the master weights, the experts' compute weights are needed only to make
                                 // their FP8 copies, so one tensor of a layer's experts at a time is staged
                                 // here, by the optimizer's update (and model_sync_compute_weights)
                                 // (model_compute_window, model_compute_span_end)
    void *grads;                 // f32 (P)
    bool *expert_dw_written;     // (L) the layer's expert weight gradients written since the
                                 // optimizer last read them: the next write adds to them, where the
                                 // first overwrites them (so the optimizer need not zero them)
    void *expert_bias;           // f32 (L, E) loss-free balancing bias (0 for dense layers)
    void *expert_hact;           // act (Rr, H), one expert-parallel rank (else NULL): the experts' SwiGLU
                                 // output of the MoE layer running, in the forward, and its rows
                                 // weighted by their combine weights in the backward. Not kept: the
                                 // backward takes the combine weights' gradients as (dout W) . h from the
                                 // kept gate|up rows (swiglu_backward's row_dot), so neither h nor
                                 // the expert outputs y are kept in any train.recompute mode. NULL too
                                 // with train.fp8_fused_swiglu in effect, where nothing reads it.
    void *rope;                  // f32 (S, hd / 2, 2)
    StepInfo *step_info;         // backend memory, written before each step
    void *metrics_scratch;       // f32 (model_metrics_len) for forwards whose metrics are unused
    size_t B, S;                 // activation memory is sized for B x S per slot
    int n_micro;
    Recompute recompute;
    LayerActs shared;            // the buffers `recompute` drops, shared by every layer and slot and
                                 // sized for the largest layer (NULL: kept per layer; model.c)
    size_t act_bytes;            // bytes of activation memory: every slot's buffers, the shared ones
                                 // and the expert exchange's (moe inspect)
    size_t exchange_bytes;       // of act_bytes: the expert exchange's own (peer memory, rows in transit)
    int32_t *tokens, *targets;   // (n_micro, B S): every batch of a step, uploaded before it runs
    void *xf, *xf_rstd;          // act (T, D) (scratch B), f32 (T): final norm (last stage)
    void *logits;                // act (chunk, V) LM-head logits, one chunk at a time (scratch A)
    size_t logit_rows;           // rows per chunk
    Scratch s;
    MoeExchange xchg;            // how expert rows travel between expert-parallel ranks
    Fp8Operands *fp8;            // the expert (and dense) products in FP8 (ModelModes.fp8); NULL: in act precision
    MemPool mem;                 // every backend allocation (mem.bytes: their total size)
} Model;

// Metrics accumulated in backend memory during a step (f32): [0] summed CE, [1] summed LM
// logsumexp^2, [2] gradient norm squared, then router_stats_len(E) values per MoE layer (all
// layers of the model, whichever stage holds them).
enum { METRIC_CE, METRIC_LM_Z, METRIC_GRAD_NORM_SQ, METRIC_ROUTER };
size_t model_metrics_len(const ModelConfig *c);
static inline size_t model_metric_router(const ModelConfig *c, int moe_index) {
    return METRIC_ROUTER + (size_t)moe_index * router_stats_len((size_t)c->n_experts);
}

// Whether the forward keeps the token-major FP8 copy of a product's input for the weight gradient in
// place of the input itself (docs/FP8.md, "In the model"): with FP8 products and train.recompute =
// none, of the attention norm's output (the QKV projection's input; the dense layers in FP8,
// pre-norm), and of the experts' rows (the gate|up projection's input; one expert-parallel rank,
// one exchange chunk, MoE layers held here). The act tensor is then read by the forward only: one buffer serves
// every layer and slot, and the backward as scratch (n1's is Scratch.dn, xp's scratch B).
bool model_keeps_fp8_n1(const Model *m);
bool model_keeps_fp8_xe(const Model *m);
// Bytes a row of an MoE call's rows takes to the experts' ranks: d_model act values, or with
// train.fp8_exchange (several expert-parallel ranks) its FP8 codes and scales.
size_t model_exchange_row_bytes(const Model *m);
// Where the compute weights of flat [a, ...) in region r are written, read and gathered: the
// buffer, with *first the flat offset of its first element (element x at model_act(m, buffer, x -
// *first)): params_act from 0, or with the experts staged (Model.expert_stage) the stage, which then
// holds one tensor of a layer's experts from a, its first element, on.
void *model_compute_window(const Model *m, ParamRegion r, size_t a, size_t *first);
// The end of the span of flat [a, b) of region r from a whose compute weights are made at once
// (model_compute_weights_ready): b, or with staged experts that of their tensor starting at a (a
// tensor's start, or the region's padding after the last one).
size_t model_compute_span_end(const Model *m, ParamRegion r, size_t a, size_t b);
// The elements of the compute weights apart from the master weights (params_act and the stage; 0
// where the backend aliases them).
size_t model_compute_weight_elems(const Model *m);
// The compute weights of flat [a, b) of region r made whole and final: this rank's part of them is
// already in the window (model_compute_window(m, r, a, &first)), its group gathers the others' parts
// (a collective over it where it has several ranks), then the FP8 copies of the weights in [a, b)
// are quantised again from them (none without FP8 products; counted in FP8_CLASS_WEIGHTS); or, for
// an experts' tensor with Fp8Operands.amax, each rank quantises its part under the whole tensor's
// block scales and the group gathers the codes (the compute weights stay this rank's part). Whatever
// changes the compute weights calls it: model_sync_compute_weights (initialisation, checkpoint
// loads; all of them) and the optimizer's update (those it updated), a span at a time
// (model_compute_span_end).
void model_compute_weights_ready(Model *m, ParamRegion r, size_t a, size_t b, void *window, size_t first);
// The FP8 copy of the weight tensor that is flat [a, b) of region r where the optimizer makes it in
// its update instead (the ops' adamw_update_fp8) and skips the compute weights and
// model_compute_weights_ready: with train.fp8_fused_update, the experts staged (Model.expert_stage:
// their compute weights exist only to be quantised) and the region's group of one rank (nothing to
// gather); else NULL.
// *counts: the counters its values are added to (class weights).
const Fp8Weights *model_fp8_update_target(const Model *m, ParamRegion r, size_t a, size_t b, uint64_t **counts);

// Builds the registry of this rank's tensors and allocates parameters, activations for n_slots
// micro-batches in flight in each chunk (0: as many as the pipeline schedule of n_micro micro-batches
// keeps, pipeline_slots) and token buffers for n_micro per step, each B x S (B sequences on this
// rank), keeping what modes.recompute does not recompute, and with modes.fp8 the FP8 products'
// operands: room for the FP8 copies of their weights (made by model_sync_compute_weights, which
// model_init_weights and checkpoint loads call) and scratch for the activations. Exits when the backend's limits (Ops.limits) refuse cfg, or
// when modes.fp8 asks for FP8 products the backend lacks.
void model_init(Model *m, const ModelConfig *cfg, const Ops *ops, const Parallel *par, size_t B,
                size_t S, int n_slots, int n_micro, ModelModes modes);
void model_free(Model *m);
// Random initial weights (params_init_values) and zero bias. Collective over the regions' groups
// (model_sync_compute_weights).
void model_init_weights(Model *m, unsigned seed);
// Refreshes the compute copy after the master weights changed (load): each rank casts the part it
// holds and, where that is a shard, the group all-gathers the copy (collective over both groups).
void model_sync_compute_weights(Model *m);

// The group of ranks holding a region (dense: the stage's data-parallel ranks; experts: the ranks
// holding the same experts), and this rank's shard of it: flat [*begin, *begin + *size).
Comm *model_region_group(const Model *m, ParamRegion r);
void model_region_shard(const Model *m, ParamRegion r, size_t *begin, size_t *size);
// The master weight at flat element `offset` (inside the part of its region held here).
void *model_master(const Model *m, size_t offset);
// The elements of tensor p the master weights hold: flat [*a, *b); false when none.
bool model_master_part(const Model *m, const ParamInfo *p, size_t *a, size_t *b);
// Region r whole on its group's rank 0 for a checkpoint writer (collective over the group), from
// `held`: the whole region (returned as it is, *owned = false) or this rank's shard (n_held
// elements, gathered there into a new backend buffer, *owned = true: free with ops->free; NULL on
// the group's other ranks).
void *model_gather_region(Model *m, ParamRegion r, void *held, size_t n_held, bool *owned);

void *model_alloc(Model *m, size_t bytes); // backend memory freed with the model
void *model_act(const Model *m, void *base, size_t offset);  // element offset in an act buffer
void *model_f32(const Model *m, void *base, size_t offset);  // element offset in an f32 buffer

// Uploads B sequences of S + 1 tokens (inputs and shifted targets) as batch `micro` of the step.
void model_set_batch(Model *m, int micro, const int32_t *seqs, size_t B, size_t S);
// The same in two parts, for a host that runs ahead of the queued work: the sequences split into
// host memory `split` (2 B S: the inputs, then the targets), then its upload queued (returns at
// once; `split`, from Ops.host_alloc, must stay as it is until the queue has passed the upload).
void model_split_batch(const int32_t *seqs, size_t B, size_t S, int32_t *split);
void model_queue_batch(Model *m, int micro, const int32_t *split, size_t B, size_t S);
// A chunk's input (its first layer's; filled by the previous virtual stage) and output of a slot,
// and where the gradient of that output is received (or left by the loss).
void *model_stage_input(const Model *m, int chunk, int slot);
void *model_stage_output(const Model *m, int chunk, int slot);
void *model_stage_grad(const Model *m, int chunk, int slot);
// Whether layer l is one of this rank's.
bool model_holds_layer(const Model *m, int l);
// The optimizer has read (and no longer needs) the gradients of units [u0, u1) (-1: the embedding,
// n_layers: the head): the next backward overwrites their expert weight gradients at its first
// write. Every other gradient it adds to, so the optimizer zeroes those.
void model_grads_consumed(Model *m, int u0, int u1);
// The forward's units of weights, in the order it reads them: -1 the embedding, 0 .. n_layers - 1
// the layers, n_layers the final norm and LM head. The unit of a tensor of this rank:
int model_param_unit(const Model *m, const ParamInfo *p);
// Forward of a slot's batch through one chunk's layers; the first virtual stage embeds the tokens,
// the last applies the head and the loss (and in training its gradient, ready for the backward).
void model_forward(Model *m, const ForwardArgs *a);
// Backward of a training forward, from the gradient of the chunk's output (model_stage_grad);
// afterwards s.dres holds the gradient of the chunk's input (for the previous virtual stage).
void model_backward(Model *m, const ForwardArgs *a);
// Next-token logits (V) of the last position of one sequence of n tokens, on the host (a model
// held whole by one process).
void model_last_logits(Model *m, const int32_t *tokens, size_t n, float *logits);

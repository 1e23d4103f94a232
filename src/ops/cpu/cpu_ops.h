// Declarations shared by the CPU backend's files (src/ops/cpu/*.c): each file implements one
// group of ops from ops.h in `real` precision, and cpu_backend.c collects them into the Ops table.
#pragma once
#include "common/real.h"
#include "ops/ops.h"

// Row-wise RMSNorm helpers, shared by rmsnorm and QK-norm. A "row group" is W consecutive values.
real cpu_rms_group_forward(real *y, const real *x, const real *w, size_t W, float eps); // -> rstd
void cpu_rms_group_backward(real *dx, const real *dy, const real *x, const real *w, real rstd,
                            size_t W, bool accumulate);
// dw[j] += sum over rows t < T and groups g < G of dy * x * rstd, where element j of group g of row
// t sits at t * ld + g * W + j and its rstd at rstd[t * ldr + g].
void cpu_rms_dw_accumulate(real *dw, const real *dy, const real *x, const real *rstd, size_t T,
                           size_t G, size_t W, size_t ld, size_t ldr);

// dense (cpu_dense.c)
void cpu_embedding_forward(void *out, const int32_t *tokens, const void *wte, size_t T, size_t D);
void cpu_embedding_backward(void *dwte, const void *dout, const int32_t *tokens, size_t T, size_t D,
                            size_t V);
void cpu_matmul_forward(void *out, const void *x, const void *w, size_t M, size_t N, size_t K,
                        bool accumulate);
void cpu_matmul_backward(void *dx, void *dw, const void *dout, const void *x, const void *w,
                         size_t M, size_t N, size_t K, bool accumulate_dx);
void cpu_rmsnorm_forward(void *out, void *rstd, const void *x, const void *w, size_t R, size_t W,
                         float eps);
void cpu_rmsnorm_backward(void *dx, void *dw, const void *dout, const void *x, const void *w,
                          const void *rstd, size_t R, size_t W, bool accumulate_dx);
void cpu_add(void *out, const void *a, const void *b, size_t n);
void cpu_add_rmsnorm_forward(void *sum, void *out, void *rstd, const void *a, const void *b, const void *w, size_t R,
                             size_t W, float eps);
void cpu_swiglu_forward(void *out, const void *gu, size_t R, size_t H, const int32_t *rows, size_t n);
void cpu_swiglu_backward(void *dgu, void *row_dot, void *hw, const void *dout, const void *gu, const void *row_w,
                         size_t R, size_t H, const int32_t *rows, size_t n);
void cpu_cross_entropy(void *logits, void *loss_acc, const int32_t *targets, size_t N, size_t V,
                       float ce_scale, float z_scale, bool want_grad);

// attention (cpu_attention.c)
void cpu_qkv_norm_rope_forward(void *qkv, void *rstd, const void *qkv_raw, const void *wq,
                               const void *wk, const void *rope, AttnDims d, QkNorm mode, float eps);
void cpu_qkv_norm_rope_backward(void *dqkv_raw, void *dwq, void *dwk, const void *dqkv,
                                const void *qkv_raw, const void *wq, const void *wk,
                                const void *rstd, const void *rope, AttnDims d, QkNorm mode);
void cpu_attention_forward(void *out, void *lse, const void *qkv, AttnDims d);
void cpu_attention_backward(void *dqkv, const void *dout, const void *qkv, const void *out,
                            const void *lse, AttnDims d);

// mixture of experts (cpu_moe.c)
void cpu_router_forward(void *scores, int32_t *topk_idx, void *topk_w, int32_t *counts, void *aux,
                        const void *logits, const void *bias, const StepInfo *step, RouterArgs a);
void cpu_router_aux_loss(void *stats, const void *aux, RouterArgs a, float weight);
void cpu_router_backward(void *dlogits, const void *dtopk_w, const void *logits, const void *scores,
                         const int32_t *topk_idx, const void *topk_w, const void *aux,
                         RouterArgs a);
void cpu_moe_regroup(void *out, const void *in, const int32_t *counts, size_t ep, size_t El,
                     size_t D, bool to_expert_major);
void cpu_moe_exchange_plan(int32_t *plan, const int32_t *all_offsets, size_t n, size_t El, size_t rank,
                           size_t cap, void *dropped);
void cpu_moe_push_rows(void *const *peers, size_t dst_offset, const void *in, PushBlocks sel, size_t D, size_t R,
                       size_t ctas);
void cpu_moe_dispatch_forward(void *xp, int32_t *slot_pos, int32_t *offsets, void *stats,
                              const void *x, const int32_t *topk_idx, const int32_t *counts,
                              size_t T, size_t K, size_t E, size_t D, size_t capacity);
void cpu_moe_dispatch_backward(void *dx, const void *dxp, const int32_t *slot_pos, size_t T,
                               size_t K, size_t D, bool accumulate_dx);
void cpu_moe_combine_forward(void *out, const void *base, const void *y, const int32_t *slot_pos, const void *topk_w,
                             size_t T, size_t K, size_t D);
void cpu_moe_combine_backward(void *dy, void *dtopk_w, void *row_w, const void *dout, const void *y,
                              const int32_t *slot_pos, const void *topk_w, size_t T, size_t K, size_t D);
void cpu_moe_slot_values(void *dtopk_w, const void *row_dot, const int32_t *slot_pos, size_t n);
void cpu_moe_row_tokens(int32_t *row_token, const int32_t *slot_pos, size_t T, size_t K);
void cpu_grouped_matmul_forward(void *out, const void *x, const void *w, const int32_t *offsets,
                                size_t E, size_t N, size_t K, size_t R);
void cpu_grouped_matmul_backward(void *dx, void *dw, const void *dout, const void *x, const void *w,
                                 const int32_t *offsets, size_t E, size_t N, size_t K, size_t R, bool accumulate_dw);
void cpu_router_bias_update(void *bias, const void *loads, size_t E, float gamma);

// FP8 recipe emulation (cpu_fp8.c)
void cpu_fp8_quantize_rows(void *q, void *scales, const void *x, const int32_t *offsets, size_t E, size_t R,
                           size_t K, Fp8Scaling how, uint64_t *counts);
void cpu_swiglu_forward_fp8(void *out, void *q, void *scales, const void *gu, const int32_t *offsets, size_t E,
                            size_t R, size_t H, Fp8Scaling how, uint64_t *counts);
void cpu_rmsnorm_forward_fp8(void *sum, void *out, void *rstd, void *q, void *scales, const void *a, const void *b,
                             const void *w, size_t R, size_t W, float eps, Fp8Scaling how, uint64_t *counts);
void cpu_fp8_quantize_cols(void *qt, void *scales, const void *x, const int32_t *offsets, size_t E,
                           size_t R, size_t C, Fp8Scaling how, Fp8ColBlocks blocks, uint64_t *counts);
void cpu_swiglu_backward_fp8(void *q, void *scales, void *qt, void *scales_t, void *row_dot, void *hwt,
                             void *hw_scales, const void *dout, const void *gu, const void *row_w,
                             const int32_t *offsets, size_t E, size_t R, size_t H, Fp8Scaling how,
                             Fp8ColBlocks hw_blocks, uint64_t *grads, uint64_t *acts);
void cpu_fp8_quantize_rows_cols(void *q, void *scales, void *qt, void *scales_t, const void *x, const int32_t *x_rows,
                                const int32_t *offsets, size_t E, size_t R, size_t K, Fp8Scaling how,
                                Fp8ColBlocks blocks, uint64_t *counts);
void cpu_fp8_quantize_weights(void *q, void *scales, void *scales_t, const void *w, size_t E,
                              size_t N, size_t K, Fp8Scaling how, uint64_t *counts);
void cpu_fp8_weights_amax(void *amax, const void *w, size_t E, size_t N, size_t K, size_t lo, size_t hi);
void cpu_fp8_quantize_weights_part(void *q, void *scales, void *scales_t, const void *amax, const void *w,
                                   size_t E, size_t N, size_t K, size_t lo, size_t hi, Fp8Scaling how,
                                   uint64_t *counts);
void cpu_fp8_transpose_codes(void *qt, const void *q, size_t E, size_t N, size_t K);
void cpu_fp8_gather_rows(void *q, void *scales, const void *tq, const void *tscales, const int32_t *x_rows,
                         const int32_t *offsets, size_t E, size_t R, size_t K, size_t T);
void cpu_fp8_regroup_scales(void *out, const void *in, const int32_t *offsets, size_t E, size_t R, size_t Kb,
                            size_t pitch, bool to_rows);
void cpu_fp8_dequantize_rows(void *x, const void *q, const void *scales, const int32_t *offsets, size_t E,
                             size_t R, size_t K);
void cpu_fp8_grouped_matmul(void *out, const void *a, const void *a_scales, const void *b,
                            const void *b_scales, const int32_t *offsets, size_t E, size_t N, size_t K,
                            size_t R);
void cpu_fp8_grouped_matmul_wgrad(void *dw, const void *dout_t, const void *dout_scales, const void *x_t,
                                  const void *x_scales, Fp8ColBlocks x_blocks, const int32_t *offsets, size_t E,
                                  size_t N, size_t K, size_t R, bool accumulate);
void cpu_fp8_matmul(void *out, const void *a, const void *a_scales, const void *b, const void *b_scales,
                    size_t M, size_t N, size_t K);

// optimizer (cpu_optim.c)
void cpu_sum_squares(void *acc, const void *x, size_t n);
void cpu_adamw_update(void *param, void *param_act, const void *grad, void *m, void *v, size_t n,
                      AdamWArgs a, const StepInfo *step, const void *grad_norm_sq);
void cpu_adamw_update_fp8(void *param, const void *grad, void *m, void *v, void *q, void *scales, void *scales_t,
                          size_t E, size_t N, size_t K, AdamWArgs a, const StepInfo *step, const void *grad_norm_sq,
                          Fp8Scaling how, uint64_t *counts);

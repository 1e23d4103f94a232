// Declarations shared by the CUDA backend's files: each .cu file implements one group of ops from
// ops.h on the backend's stream (act = bf16, f32 = float), and cuda_backend.cu collects them.
#pragma once
#include "ops/ops.h"

#ifdef __cplusplus
extern "C" {
#endif

// dense (cuda_dense.cu)
void cuda_embedding_forward(void *out, const int32_t *tokens, const void *wte, size_t T, size_t D);
void cuda_embedding_backward(void *dwte, const void *dout, const int32_t *tokens, size_t T, size_t D, size_t V);
void cuda_rmsnorm_forward(void *out, void *rstd, const void *x, const void *w, size_t R, size_t W, float eps);
void cuda_rmsnorm_backward(void *dx, void *dw, const void *dout, const void *x, const void *w,
                           const void *rstd, size_t R, size_t W, bool accumulate_dx);
void cuda_add(void *out, const void *a, const void *b, size_t n);
void cuda_add_rmsnorm_forward(void *sum, void *out, void *rstd, const void *a, const void *b, const void *w, size_t R,
                              size_t W, float eps);
void cuda_swiglu_forward(void *out, const void *gu, size_t R, size_t H, const int32_t *rows, size_t n);
void cuda_swiglu_backward(void *dgu, void *row_dot, void *hw, const void *dout, const void *gu, const void *row_w,
                          size_t R, size_t H, const int32_t *rows, size_t n);
void cuda_cross_entropy(void *logits, void *loss_acc, const int32_t *targets, size_t N, size_t V,
                        float ce_scale, float z_scale, bool want_grad);
void cuda_sum_squares(void *acc, const void *x, size_t n);
void cuda_adamw_update(void *param, void *param_act, const void *grad, void *m, void *v, size_t n,
                       AdamWArgs a, const StepInfo *step, const void *grad_norm_sq);
void cuda_cast_f32_to_act(void *dst, const void *src, size_t n);
void cuda_init_params(void *dst, size_t n, uint64_t key, uint64_t counter_begin, double std, bool ones);

// matrix products (cuda_gemm.cu)
void cuda_matmul_forward(void *out, const void *x, const void *w, size_t M, size_t N, size_t K, bool accumulate);
void cuda_matmul_backward(void *dx, void *dw, const void *dout, const void *x, const void *w,
                          size_t M, size_t N, size_t K, bool accumulate_dx);
void cuda_grouped_matmul_forward(void *out, const void *x, const void *w, const int32_t *offsets,
                                 size_t E, size_t N, size_t K, size_t R);
void cuda_grouped_matmul_backward(void *dx, void *dw, const void *dout, const void *x, const void *w,
                                  const int32_t *offsets, size_t E, size_t N, size_t K, size_t R, bool accumulate_dw);
// dw[e] (nk) f32 = 0 for each expert e without rows in offsets (E + 1): what a weight gradient that
// overwrites writes there, where its product has no tiles.
void cuda_grouped_zero_empty(float *dw, const int32_t *offsets, size_t E, size_t nk);

// Hopper grouped GEMM (cuda_grouped_sm90.cu, CUTLASS) on at most GROUPED_MAX_E experts: FWD out = a
// . b[e]^T, DGRAD d = a . b[e], WGRAD d[e] += a^T . b over each expert's rows, WGRAD_SET d[e] = a^T . b
// (an expert without rows untouched by either: cuda_grouped_zero_empty; see the file).
#define GROUPED_MAX_E 1024
typedef enum { GROUPED_FWD, GROUPED_DGRAD, GROUPED_WGRAD, GROUPED_WGRAD_SET } GroupedOp;
void cuda_grouped_sm90(GroupedOp op, const void *a, const void *b, void *d, const int32_t *offsets,
                       size_t E, size_t N, size_t K);

// FP8 recipe (ops/fp8.h): quantisation and the dense product (cuda_fp8.cu), the grouped products
// on CUTLASS's sm90 blockwise-scaled kernels (cuda_grouped_sm90_fp8.cu; Hopper only).
// The recipe's GPU code against its reference over all 2^32 fp32 inputs (test_cuda): the count
// of inputs that differ, and in *first the lowest such bit pattern. ENCODER: fp8_e4m3_encode
// against fp8_e4m3_encode_exact; SCALE_AMAX, SCALE_POW2: fp8_block_scale against the scale of the
// IEEE quotient amax / 448.
typedef enum { FP8_CHECK_ENCODER, FP8_CHECK_SCALE_AMAX, FP8_CHECK_SCALE_POW2 } Fp8Check;
uint64_t cuda_fp8_recipe_mismatches(Fp8Check what, uint32_t *first);
void cuda_fp8_quantize_rows(void *q, void *scales, const void *x, const int32_t *offsets, size_t E, size_t R,
                            size_t K, Fp8Scaling how, uint64_t *counts);
void cuda_swiglu_forward_fp8(void *out, void *q, void *scales, const void *gu, const int32_t *offsets, size_t E,
                             size_t R, size_t H, Fp8Scaling how, uint64_t *counts);
void cuda_rmsnorm_forward_fp8(void *sum, void *out, void *rstd, void *q, void *scales, const void *a, const void *b,
                              const void *w, size_t R, size_t W, float eps, Fp8Scaling how, uint64_t *counts);
void cuda_fp8_quantize_cols(void *qt, void *scales, const void *x, const int32_t *offsets, size_t E, size_t R,
                            size_t C, Fp8Scaling how, Fp8ColBlocks blocks, uint64_t *counts);
void cuda_swiglu_backward_fp8(void *q, void *scales, void *qt, void *scales_t, void *row_dot, void *hwt,
                              void *hw_scales, const void *dout, const void *gu, const void *row_w,
                              const int32_t *offsets, size_t E, size_t R, size_t H, Fp8Scaling how,
                              Fp8ColBlocks hw_blocks, uint64_t *grads, uint64_t *acts);
void cuda_fp8_quantize_rows_cols(void *q, void *scales, void *qt, void *scales_t, const void *x, const int32_t *x_rows,
                                 const int32_t *offsets, size_t E, size_t R, size_t K, Fp8Scaling how,
                                 Fp8ColBlocks blocks, uint64_t *counts);
void cuda_fp8_quantize_weights(void *q, void *scales, void *scales_t, const void *w, size_t E, size_t N,
                               size_t K, Fp8Scaling how, uint64_t *counts);
void cuda_fp8_weights_amax(void *amax, const void *w, size_t E, size_t N, size_t K, size_t lo, size_t hi);
void cuda_fp8_quantize_weights_part(void *q, void *scales, void *scales_t, const void *amax, const void *w, size_t E,
                                    size_t N, size_t K, size_t lo, size_t hi, Fp8Scaling how, uint64_t *counts);
void cuda_adamw_update_fp8(void *param, const void *grad, void *m, void *v, void *q, void *scales, void *scales_t,
                           size_t E, size_t N, size_t K, AdamWArgs a, const StepInfo *step, const void *grad_norm_sq,
                           Fp8Scaling how, uint64_t *counts);
void cuda_fp8_transpose_codes(void *qt, const void *q, size_t E, size_t N, size_t K);
void cuda_fp8_gather_rows(void *q, void *scales, const void *tq, const void *tscales, const int32_t *x_rows,
                          const int32_t *offsets, size_t E, size_t R, size_t K, size_t T);
void cuda_fp8_regroup_scales(void *out, const void *in, const int32_t *offsets, size_t E, size_t R, size_t Kb,
                             size_t pitch, bool to_rows);
void cuda_fp8_dequantize_rows(void *x, const void *q, const void *scales, const int32_t *offsets, size_t E, size_t R,
                              size_t K);
void cuda_fp8_grouped_matmul(void *out, const void *a, const void *a_scales, const void *b, const void *b_scales,
                             const int32_t *offsets, size_t E, size_t N, size_t K, size_t R);
void cuda_fp8_grouped_matmul_wgrad(void *dw, const void *dout_t, const void *dout_scales, const void *x_t,
                                   const void *x_scales, Fp8ColBlocks x_blocks, const int32_t *offsets, size_t E,
                                   size_t N, size_t K, size_t R, bool accumulate);
void cuda_fp8_matmul(void *out, const void *a, const void *a_scales, const void *b, const void *b_scales, size_t M,
                     size_t N, size_t K);

// attention (cuda_attention.cu)
void cuda_qkv_norm_rope_forward(void *qkv, void *rstd, const void *qkv_raw, const void *wq,
                                const void *wk, const void *rope, AttnDims d, QkNorm mode, float eps);
void cuda_qkv_norm_rope_backward(void *dqkv_raw, void *dwq, void *dwk, const void *dqkv,
                                 const void *qkv_raw, const void *wq, const void *wk,
                                 const void *rstd, const void *rope, AttnDims d, QkNorm mode);
void cuda_attention_forward(void *out, void *lse, const void *qkv, AttnDims d);
void cuda_attention_backward(void *dqkv, const void *dout, const void *qkv, const void *out,
                             const void *lse, AttnDims d);
size_t cuda_attention_workspace(AttnDims d);
// The GPU's clock and power through NVML (cuda_clocks.cu): opened for a CUDA ordinal (false when
// NVML or the device is not there, and the query reports nothing), then read (Ops.device_clocks).
bool cuda_clocks_open(int device);
bool cuda_device_clocks(DeviceClocks *out);
// The same through cuDNN (cuda_attention_cudnn.cu); false when cuDNN has no engine for the shape.
bool cuda_attention_forward_cudnn(void *out, void *lse, const void *qkv, AttnDims d, bool deterministic);
// *bytes: the larger of the forward's and the backward's cuDNN workspace at these dims; false when
// cuDNN has no engine for one of them.
bool cuda_attention_workspace_cudnn(AttnDims d, bool deterministic, size_t *bytes);
bool cuda_attention_backward_cudnn(void *dqkv, const void *dout, const void *qkv, const void *out,
                                   const void *lse, AttnDims d, bool deterministic);

// mixture of experts (cuda_moe.cu)
void cuda_router_forward(void *scores, int32_t *topk_idx, void *topk_w, int32_t *counts, void *aux,
                         const void *logits, const void *bias, const StepInfo *step, RouterArgs a);
void cuda_router_aux_loss(void *stats, const void *aux, RouterArgs a, float weight);
void cuda_router_backward(void *dlogits, const void *dtopk_w, const void *logits, const void *scores,
                          const int32_t *topk_idx, const void *topk_w, const void *aux, RouterArgs a);
void cuda_moe_dispatch_forward(void *xp, int32_t *slot_pos, int32_t *offsets, void *stats,
                               const void *x, const int32_t *topk_idx, const int32_t *counts,
                               size_t T, size_t K, size_t E, size_t D, size_t capacity);
void cuda_moe_dispatch_backward(void *dx, const void *dxp, const int32_t *slot_pos, size_t T,
                                size_t K, size_t D, bool accumulate_dx);
void cuda_moe_combine_forward(void *out, const void *base, const void *y, const int32_t *slot_pos, const void *topk_w,
                              size_t T, size_t K, size_t D);
void cuda_moe_combine_backward(void *dy, void *dtopk_w, void *row_w, const void *dout, const void *y,
                               const int32_t *slot_pos, const void *topk_w, size_t T, size_t K, size_t D);
void cuda_moe_slot_values(void *dtopk_w, const void *row_dot, const int32_t *slot_pos, size_t n);
void cuda_moe_row_tokens(int32_t *row_token, const int32_t *slot_pos, size_t T, size_t K);
void cuda_moe_exchange_plan(int32_t *plan, const int32_t *all_offsets, size_t n, size_t El, size_t rank,
                            size_t cap, void *dropped);
void cuda_moe_push_rows(void *const *peers, size_t dst_offset, const void *in, PushBlocks sel, size_t D, size_t R,
                        size_t ctas);
void cuda_moe_regroup(void *out, const void *in, const int32_t *counts, size_t ep, size_t El,
                      size_t D, bool to_expert_major);
void cuda_router_bias_update(void *bias, const void *loads, size_t E, float gamma);

#ifdef __cplusplus
}
#endif

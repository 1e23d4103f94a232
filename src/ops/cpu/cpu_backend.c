// The CPU backend: host memory and the table of CPU kernels behind the ops interface.
#include <stdlib.h>
#include <string.h>

#include "common/rng.h"
#include "common/util.h"
#include "cpu_ops.h"

static void *cpu_alloc(size_t bytes) {
    void *p = aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
    MOE_CHECK(p, "out of host memory allocating %zu bytes for the CPU backend", bytes);
    return p;
}

static void cpu_free(void *p) { free(p); }
static void cpu_zero(void *p, size_t bytes) { memset(p, 0, bytes); }
static void cpu_copy(void *dst, const void *src, size_t bytes) { memmove(dst, src, bytes); }
static void cpu_sync(void) {}

static void cpu_upload_f32(void *dst_, const float *src, size_t n) {
    real *dst = dst_;
    for (size_t i = 0; i < n; i++) dst[i] = (real)src[i];
}

static void cpu_download_f32(float *dst, const void *src_, size_t n) {
    const real *src = src_;
    for (size_t i = 0; i < n; i++) dst[i] = (float)src[i];
}

// Threads only for tensors large enough to repay starting them (norm weights are one row).
static void cpu_init_params(void *dst_, size_t n, uint64_t key, uint64_t counter_begin, double std, bool ones) {
    real *dst = dst_;
#pragma omp parallel for schedule(static) if (n >= 16384)
    for (size_t i = 0; i < n; i++) dst[i] = ones ? 1 : (real)rng_init_value(key, counter_begin + i, std);
}

static size_t cpu_memory_in_use(void) { return 0; }

// Events of the CPU are wall-clock times: work runs when it is queued.
static void *cpu_event_create(void) { return moe_calloc(1, sizeof(double)); }
static void cpu_event_record(void *e) { *(double *)e = moe_time_sec(); }
static float cpu_event_elapsed_ms(void *a, void *b) {
    return (float)(1e3 * (*(double *)b - *(double *)a));
}
static void cpu_event_wait(void *e) {}
static void cpu_event_free(void *e) { free(e); }

static void cpu_cast_f32_to_act(void *dst, const void *src, size_t n) {
    if (dst != src) memcpy(dst, src, n * sizeof(real));
}

static const Ops CPU_OPS = {
    .name = "cpu",
    .act_size = sizeof(real),
    .f32_size = sizeof(real),
    .act_aliases_f32 = true,
    .logits_chunk = (size_t)1 << 22,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .zero = cpu_zero,
    .copy = cpu_copy,
    .upload = cpu_copy,
    .download = cpu_copy,
    .upload_f32 = cpu_upload_f32,
    .download_f32 = cpu_download_f32,
    .download_act = cpu_download_f32,
    .host_alloc = cpu_alloc,
    .host_free = cpu_free,
    .upload_queued = cpu_copy,
    .download_f32_queued = cpu_download_f32,
    .download_queued = cpu_copy,
    .cast_f32_to_act = cpu_cast_f32_to_act,
    .init_params = cpu_init_params,
    .sync = cpu_sync,
    .memory_in_use = cpu_memory_in_use,
    .memory_peak = moe_process_peak_memory,
    .memory_available = moe_host_memory_available,
    .event_create = cpu_event_create,
    .event_record = cpu_event_record,
    .event_elapsed_ms = cpu_event_elapsed_ms,
    .event_wait = cpu_event_wait,
    .event_free = cpu_event_free,
    .embedding_forward = cpu_embedding_forward,
    .embedding_backward = cpu_embedding_backward,
    .matmul_forward = cpu_matmul_forward,
    .matmul_backward = cpu_matmul_backward,
    .rmsnorm_forward = cpu_rmsnorm_forward,
    .add_rmsnorm_forward = cpu_add_rmsnorm_forward,
    .rmsnorm_backward = cpu_rmsnorm_backward,
    .add = cpu_add,
    .qkv_norm_rope_forward = cpu_qkv_norm_rope_forward,
    .qkv_norm_rope_backward = cpu_qkv_norm_rope_backward,
    .attention_forward = cpu_attention_forward,
    .attention_backward = cpu_attention_backward,
    .swiglu_forward = cpu_swiglu_forward,
    .swiglu_backward = cpu_swiglu_backward,
    .router_forward = cpu_router_forward,
    .router_aux_loss = cpu_router_aux_loss,
    .router_backward = cpu_router_backward,
    .moe_dispatch_forward = cpu_moe_dispatch_forward,
    .moe_dispatch_backward = cpu_moe_dispatch_backward,
    .moe_combine_forward = cpu_moe_combine_forward,
    .moe_combine_backward = cpu_moe_combine_backward,
    .moe_slot_values = cpu_moe_slot_values,
    .moe_row_tokens = cpu_moe_row_tokens,
    .moe_regroup = cpu_moe_regroup,
    .moe_exchange_plan = cpu_moe_exchange_plan,
    .moe_push_rows = cpu_moe_push_rows,
    .grouped_matmul_forward = cpu_grouped_matmul_forward,
    .grouped_matmul_backward = cpu_grouped_matmul_backward,
    .router_bias_update = cpu_router_bias_update,
    .fp8_quantize_rows = cpu_fp8_quantize_rows,
    .swiglu_forward_fp8 = cpu_swiglu_forward_fp8,
    .rmsnorm_forward_fp8 = cpu_rmsnorm_forward_fp8,
    .fp8_quantize_cols = cpu_fp8_quantize_cols,
    .fp8_quantize_rows_cols = cpu_fp8_quantize_rows_cols,
    .swiglu_backward_fp8 = cpu_swiglu_backward_fp8,
    .fp8_quantize_weights = cpu_fp8_quantize_weights,
    .fp8_weights_amax = cpu_fp8_weights_amax,
    .fp8_quantize_weights_part = cpu_fp8_quantize_weights_part,
    .fp8_transpose_codes = cpu_fp8_transpose_codes,
    .fp8_regroup_scales = cpu_fp8_regroup_scales,
    .fp8_gather_rows = cpu_fp8_gather_rows,
    .fp8_dequantize_rows = cpu_fp8_dequantize_rows,
    .fp8_grouped_matmul = cpu_fp8_grouped_matmul,
    .fp8_grouped_matmul_wgrad = cpu_fp8_grouped_matmul_wgrad,
    .fp8_matmul = cpu_fp8_matmul,
    .cross_entropy = cpu_cross_entropy,
    .sum_squares = cpu_sum_squares,
    .adamw_update = cpu_adamw_update,
    .adamw_update_fp8 = cpu_adamw_update_fp8,
};

const Ops *ops_cpu(void) { return &CPU_OPS; }

const Ops *ops_cpu_sharded(void) {
    static Ops ops;
    ops = CPU_OPS;
    ops.name = "cpu-sharded";
    ops.act_aliases_f32 = false; // act is still `real`: the compute copy is an exact copy
    return &ops;
}

// A backend that runs nothing and reports what each kernel call would do: its family and its work
// (FLOPs of matrix kernels, bytes moved by the others), so that a planner running the real model
// code on it prices every kernel of a step without an op list of its own (`moe plan`). Memory is
// counted as on the counting backend (ops_counting), so the same model gives the exact plan too.
#pragma once
#include "ops.h"

// Kernel families, each priced by one measured rate (a calibration file, docs/SCALING.md).
typedef enum {
    KERNEL_DENSE_GEMM,     // FLOPs; size: FLOPs of the call
    KERNEL_GROUPED_FWD,    // FLOPs; size: FLOPs per expert
    KERNEL_GROUPED_DGRAD,
    KERNEL_GROUPED_WGRAD,
    KERNEL_ATTENTION_FWD,  // FLOPs (causal at half); size: FLOPs of the call
    KERNEL_ATTENTION_BWD,  // counted as 2.5 x the forward
    // train.precision = fp8 (docs/FP8.md); a calibration without them prices these at the bf16
    // families' rates (plan/calib.h)
    KERNEL_FP8_GROUPED,    // FLOPs; size: FLOPs per expert (the expert forward and input gradient: one kernel)
    KERNEL_FP8_GROUPED_WGRAD,
    KERNEL_FP8_DENSE,      // FLOPs; size: FLOPs of the call (the dense layers' products, weight gradient too)
    KERNEL_ELEMENTWISE,    // bytes; size: bytes of the call (norms, adds, SwiGLU, loss, embedding)
    KERNEL_QK_NORM_ROPE,   // bytes
    KERNEL_ROUTING,        // bytes (router, dispatch, combine, exchange plan)
    KERNEL_OPTIMIZER,      // bytes (AdamW, gradient norm)
    KERNEL_FP8_QUANTIZE,   // bytes (the FP8 quantisations, SwiGLU with its quantised output)
    KERNEL_N_FAMILIES
} KernelFamily;

extern const char *const KERNEL_FAMILY_NAMES[KERNEL_N_FAMILIES];
// Matrix families are measured in FLOPs (rates in TFLOP/s), the rest in bytes (GB/s).
static inline bool kernel_family_is_matrix(KernelFamily f) { return f <= KERNEL_FP8_DENSE; }

// Where the calls are reported. Grouped GEMMs and SwiGLU over expert rows see only the rows their
// buffers can hold (the real counts stay on the device): they are charged `routed_rows` rows, what
// a rank receives on average under balanced routing (set it before each forward or backward).
// `bytes`: what the call reads and writes (for the memory-bound families, its work; a matrix kernel
// with a thin operand, such as the router's, can be bound by it rather than by its FLOPs).
typedef struct {
    void (*kernel)(void *ctx, KernelFamily f, double work, double size, double bytes);
    void (*push_rows)(void *ctx, double bytes); // expert rows this rank writes into its ep peers
    void *ctx;
    size_t routed_rows;
    // Experts of a rank and of the model: a call over some of them (a chunk of an MoE layer,
    // parallel.exchange_chunks) is charged their share of routed_rows (0: every call all of it).
    size_t local_experts, experts;
} CostSink;

// The costing backend with act elements of 2 bytes (bf16, as a GPU keeps them) or 4 (the CPU),
// reporting to `sink` (which must outlive its use; one costing backend at a time).
const Ops *ops_costing(bool bf16_activations, CostSink *sink);

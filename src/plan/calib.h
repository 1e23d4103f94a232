// Calibration files: the measured rate of each kernel family at a few problem sizes, the
// communication rates of one node and the memory a run takes beside its plan, for one device and
// backend (`moe bench --calibrate OUT.json` writes one; `moe plan` reads it). Rates between
// measured sizes are interpolated linearly in log(size)-log(rate); outside, the nearest holds.
// The FP8 families are optional in a file (older ones have none): a missing one takes the points of
// the bf16 family it replaces (calib_fill_fallbacks). The format is described in docs/SCALING.md.
#pragma once
#include <stdbool.h>

#include "common/util.h"
#include "ops/cost_ops.h"

#define CALIB_MAX_POINTS 16
#define CALIB_TEXT_LEN 1024

// Rates at increasing problem sizes: FLOP/s against FLOPs (matrix families), else bytes/s against
// bytes (the file writes TFLOP/s and GB/s).
typedef struct {
    int n;
    double size[CALIB_MAX_POINTS], rate[CALIB_MAX_POINTS];
    char from[CALIB_TEXT_LEN]; // how the points were obtained (optional)
    bool fallback;             // not in the file or not measured: the points of the family it replaces
} CalibCurve;

typedef struct {
    char device[32];   // a name of the device table (plan/device.h)
    char backend[32];  // "cuda" (bf16 activations) or "cpu" (fp32)
    char source[CALIB_TEXT_LEN]; // measured by moe bench --calibrate, or derived (and from what)
    CalibCurve family[KERNEL_N_FAMILIES];
    double kernel_overhead_s; // added to every kernel call (launch, synchronisation)
    double copy_bps;          // device copy, bytes read + written per second: matrix kernels' floor
    // Communication within one node (has_comm false: not measured; multi-rank plans refuse it).
    bool has_comm;
    double latency_s;          // one collective's or fence's fixed cost
    double collective_bps;     // ring reduce-scatter / all-gather bus bandwidth, bytes/s
    double p2p_bps;            // send/recv between two ranks (pipeline transfers)
    double exchange_bps;       // expert rows leaving a rank toward its expert-parallel peers
    double grad_reduce_hidden; // share of the gradient reduction the backward hides when overlapped
    char comm_from[CALIB_TEXT_LEN];
    // Memory beside the exact plan.
    double runtime_bytes;      // context, library workspaces (GPU); the process itself (CPU)
    double communicator_bytes; // each communicator of several ranks (NCCL buffers)
    char memory_from[CALIB_TEXT_LEN];
} Calib;

int calib_load(Calib *c, const char *path, MoeErr err);
int calib_save(const Calib *c, const char *path, MoeErr err);
// Checks the points of every family (at least one, sizes increasing, all positive).
int calib_check(const Calib *c, const char *source, MoeErr err);
// Gives each FP8 family without points those of the bf16 family it replaces (fp8_grouped: grouped_fwd,
// fp8_grouped_wgrad: grouped_wgrad, fp8_dense: dense_gemm, fp8_quantize: elementwise), marked fallback:
// the FP8 ops priced as they were before they had families.
void calib_fill_fallbacks(Calib *c);
// "fp8_dense as dense_gemm, ..." for the families that are fallbacks; "" when none is.
void calib_fallback_names(const Calib *c, char *out, size_t len);
// Adds a measured point to a family, keeping sizes increasing (a repeated size keeps the faster).
void calib_add_point(Calib *c, KernelFamily f, double size, double rate);
// FLOP/s or bytes/s of family f at a call of `size`.
double calib_rate(const Calib *c, KernelFamily f, double size);

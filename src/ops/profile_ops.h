// Per-phase kernel timing of any backend (see profile_ops.c).
#pragma once
#include "ops.h"

typedef enum {
    PHASE_ATTENTION, PHASE_EXPERT_GEMM, PHASE_ROUTING, PHASE_DENSE_GEMM, PHASE_OPTIMIZER, PHASE_EXCHANGE,
    PHASE_REST,
    PROFILE_N_PHASES
} ProfilePhase;

extern const char *const PROFILE_PHASE_NAMES[PROFILE_N_PHASES];

// The backend with every kernel timed (memory and transfer entries pass through untimed).
const Ops *ops_profiled(const Ops *backend);
void profile_reset(void);
#define PROFILE_MAX_OPS 64

typedef struct {
    const char *name; // the Ops entry, e.g. "rmsnorm_forward"
    int phase;        // ProfilePhase
    int calls;
    double ms;
} ProfileOpTime;

// Milliseconds per phase of the calls since ops_profiled or profile_reset (waits for them), and the
// same time per op and phase (an FP8 op serves experts and dense layers), longest first; returns the
// number of such rows.
int profile_collect(double ms[PROFILE_N_PHASES], ProfileOpTime ops[PROFILE_MAX_OPS]);

// The step time and memory of one layout, predicted: each pipeline stage's model is sized and run
// once on the costing backend (ops_costing) and costing communicators, which price every kernel
// from a calibration and every collective and expert exchange by an alpha-beta model of the links
// (NVLink inside a node, the network between nodes); the stages' forward and backward times then go
// through the pipeline schedule itself (plan/pipe_time.h), and the optimizer's time follows.
#pragma once
#include "ops/cost_ops.h"
#include "plan/calib.h"
#include "plan/device.h"
#include "train/config.h"

// Communication a step exposes, by kind (seconds on the slowest stage).
typedef enum {
    PLAN_COMM_DP_REDUCE_SCATTER, // ZeRO-1: gradients over the data-parallel (dense) and expert-data-
    PLAN_COMM_DP_ALL_GATHER,     // parallel (experts) groups, then the updated weights back
    PLAN_COMM_ALL_REDUCE,        // gradient norm and metrics (world), router summaries (dp)
    PLAN_COMM_PP,                // pipeline transfers (activations and their gradients)
    PLAN_COMM_EXCHANGE,          // expert rows between expert-parallel ranks, with their plans
    PLAN_N_COMM
} PlanComm;

extern const char *const PLAN_COMM_NAMES[PLAN_N_COMM];

// What a layout runs on.
typedef struct {
    const PlanDevice *dev;
    const Calib *calib;
    int per_node;              // devices of a node
    double matrix_scale;       // dev's peak over the calibrated device's (1 when the same)
    double memory_scale;       // dev's HBM bandwidth over the calibrated device's
    double intra_bps;          // collectives and transfers inside a node, per device and direction
    double exchange_bps;       // expert rows inside a node
    double p2p_bps;            // pipeline transfers inside a node
    double inter_bps;          // between nodes
    double latency_s;          // a collective step inside a node
    double latency_inter_s;    // between nodes
} PlanMachine;

// Links given in GB/s (0: from the calibration, or the device table scaled like the calibration's
// own links for another device).
int plan_machine_init(PlanMachine *m, const PlanDevice *dev, const Calib *c, int per_node, double intra_gbps,
                      double inter_gbps, MoeErr err);

// Whether `world` devices can be planned on m: links known for what they span.
int plan_machine_check(const PlanMachine *m, int world, MoeErr err);

typedef struct {
    bool fits;                  // every rank's memory fits the device
    double step_s;              // 0 when not priced (past memory, and plan_evaluate was told to stop)
    double memory_bytes;        // the largest rank: exact plan + runtime + communicators
    double plan_bytes;          // the exact plan of that rank (what `moe inspect` prints)
    double bubble;              // idle share of the pipeline part of the step, on its busiest stage
    double ideal_bubble;        // (pp - 1) / (v M + pp - 1): equal stages, free transfers
    double comm_s[PLAN_N_COMM]; // exposed per kind, on the stage that takes longest
    double kernel_s[KERNEL_N_FAMILIES]; // kernel time per family on that stage
    double tokens_per_s;        // per device
    double tflops;              // model FLOPs per device (docs/MODEL.md accounting)
} PlanResult;

// Predicts a step of cfg (layout: cfg->parallel; batch: cfg->train) on `world` devices of m; with
// fitting_only, a layout past memory is sized but not priced. Returns -1 with a message when the
// layout is impossible.
int plan_evaluate(const Config *cfg, int world, const PlanMachine *m, bool fitting_only, PlanResult *r, MoeErr err);

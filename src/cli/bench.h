// Timing single kernels through the ops interface of a backend, shared by `moe bench --kernels`
// (bench_kernels.c) and `moe bench --calibrate` (bench_calibrate.c).
#pragma once
#include <stdbool.h>
#include <stdint.h>

#include "dist/comm.h"
#include "ops/device_monitor.h"
#include "ops/ops.h"
#include "train/config.h"

typedef struct {
    const Ops *o;
    void *e0, *e1;
    double matmul, copy; // ceilings measured here: TFLOP/s, GB/s
    bool aims;           // the aims are for the GPU
} Bench;

// Milliseconds per call of `call` (two untimed calls first, then reps timed by the backend's events).
#define BENCH_TIME_MS(b, reps, call)                                                             \
    ({                                                                                           \
        for (int w_ = 0; w_ < 2; w_++) call;                                                     \
        (b)->o->event_record((b)->e0);                                                           \
        for (int r_ = 0; r_ < (reps); r_++) call;                                                \
        (b)->o->event_record((b)->e1);                                                           \
        (b)->o->event_elapsed_ms((b)->e0, (b)->e1) / (reps);                                     \
    })

// Milliseconds per call of `call` repeated back to back for about a second (est_ms a call, as timed
// by BENCH_TIME_MS), the device's clocks and power meanwhile summarised into *clocks: a kernel that
// holds a GPU at its power limit runs at a lower clock sustained than in a short burst. A second
// idle follows, so that the next burst timed does not start at the clock this one left.
#define BENCH_SUSTAINED_MS(b, est_ms, clocks, call)                                              \
    ({                                                                                           \
        DeviceMonitor *m_ = device_monitor_start((b)->o, 10);                                    \
        double s_ = BENCH_TIME_MS(b, (int)(1e3 / (est_ms)) + 1, call);                           \
        device_monitor_stop(m_, clocks);                                                         \
        bench_idle(b, 1.0);                                                                      \
        s_;                                                                                      \
    })

// Frees a list of buffers: BENCH_FREE_ALL(b, p, q, ...).
#define BENCH_FREE_ALL(b, ...)                                                                   \
    do {                                                                                         \
        void *list_[] = {__VA_ARGS__};                                                           \
        for (size_t i_ = 0; i_ < sizeof list_ / sizeof list_[0]; i_++) (b)->o->free(list_[i_]);  \
    } while (0)

// Waits `seconds` with the device idle (its queue drained first).
void bench_idle(const Bench *b, double seconds);
// The report line of the matrix product sustained for 2 s (train_matmul_tflops_sustained) and the
// clocks it ran at.
void bench_print_sustained(double tflops, const ClockSummary *c);
// The backend of cfg (train.device, threads), its events and ceilings (matrix product, copy).
void bench_open(Bench *b, const Config *cfg);
void bench_close(Bench *b);
void *bench_rand_act(Bench *b, size_t n, uint64_t seed, float scale);
void *bench_zero_buf(Bench *b, size_t bytes);
// The FP8 operands of a layer's products (R, N) = (R, K) . w (E, N, K)^T over E groups of rows
// (ops.h): the quantised rows of x (R, K) and dy (R, N) with their scales, their token-major copies
// (fp8_expert_cols(R, E) columns) with theirs, and the weights' two layouts with theirs.
typedef struct {
    void *xq, *xs, *dyq, *dys, *xt, *xts, *dyt, *dyts, *wq, *wqt, *ws, *wst;
} BenchFp8;

// Allocates q's buffers (uninitialised) for those products; bench_fp8_free frees them.
void bench_fp8_alloc(Bench *b, BenchFp8 *q, size_t E, size_t N, size_t K, size_t R);
void bench_fp8_free(Bench *b, BenchFp8 *q);
// Row offsets (E + 1) of R = T K routed rows over E experts: "balanced", "zipf" (expert e's share
// ~ 1 / (e + 1), none above T) or "sparse" (every other expert 0-3 rows, the rest balanced).
void bench_expert_rows(const char *kind, size_t T, size_t K, size_t E, int32_t *offsets);
// `moe bench --calibrate`: measures the calibration of cfg's backend (rank 0 writes it to `out`) as
// the device table's `device` (bench_calibrate.c).
void bench_calibrate(const Config *cfg, Comm *world, const char *device, const char *out);

// CPU reference kernels for the optimizer: deterministic sum of squares (gradient norm) and AdamW
// with decoupled weight decay and global-norm clipping read from backend memory (also with the FP8
// copies of the weights it updates).
#include <math.h>

#include "common/util.h"
#include "cpu_ops.h"

// Fixed-size chunks summed in order: the result does not depend on the thread count.
#define SUMSQ_CHUNK 4096

void cpu_sum_squares(void *acc_, const void *x_, size_t n) {
    real *acc = acc_;
    const real *x = x_;
    size_t n_chunks = size_ceil_div(n, SUMSQ_CHUNK);
    double total = 0;
#pragma omp parallel for ordered schedule(static)
    for (size_t c = 0; c < n_chunks; c++) {
        double s = 0;
        size_t end = (c + 1) * SUMSQ_CHUNK < n ? (c + 1) * SUMSQ_CHUNK : n;
        for (size_t i = c * SUMSQ_CHUNK; i < end; i++) s += (double)x[i] * x[i];
#pragma omp ordered
        total += s;
    }
    acc[0] += (real)total;
}

void cpu_adamw_update(void *param_, void *param_act, const void *grad_, void *m_, void *v_,
                      size_t n, AdamWArgs a, const StepInfo *step, const void *grad_norm_sq) {
    real *p = param_, *pa = param_act, *m = m_, *v = v_;
    const real *g = grad_;
    double norm = sqrt((double)*(const real *)grad_norm_sq);
    real scale = a.clip > 0 && norm > a.clip ? (real)(a.clip / (norm + 1e-6)) : 1;
    real bc1 = (real)(1 - pow(a.beta1, step->step)), bc2 = (real)(1 - pow(a.beta2, step->step));
    real lr = step->lr, decay = 1 - step->lr * a.weight_decay;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        real gi = g[i] * scale;
        m[i] = a.beta1 * m[i] + (1 - a.beta1) * gi;
        v[i] = a.beta2 * v[i] + (1 - a.beta2) * gi * gi;
        p[i] = p[i] * decay - lr * (m[i] / bc1) / (real_sqrt(v[i] / bc2) + a.eps);
        if (pa) pa[i] = p[i]; // the CPU computes in the master precision: the copy is exact
    }
}

// The CPU's compute copy is the master weights themselves (act is real): the codes come from them.
void cpu_adamw_update_fp8(void *param, const void *grad, void *m, void *v, void *q, void *scales, void *scales_t,
                          size_t E, size_t N, size_t K, AdamWArgs a, const StepInfo *step, const void *grad_norm_sq,
                          Fp8Scaling how, uint64_t *counts) {
    cpu_adamw_update(param, NULL, grad, m, v, E * N * K, a, step, grad_norm_sq);
    cpu_fp8_quantize_weights(q, scales, scales_t, param, E, N, K, how, counts);
}

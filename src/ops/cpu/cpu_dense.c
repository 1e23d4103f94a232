// CPU reference kernels for the dense ops: embedding, matmul, RMSNorm, residual add, SwiGLU and
// cross-entropy. Reductions run in double and in a fixed order, so results do not depend on the
// number of OpenMP threads.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "cpu_gemm.h"
#include "cpu_ops.h"

void cpu_embedding_forward(void *out_, const int32_t *tokens, const void *wte_, size_t T, size_t D) {
    real *out = out_;
    const real *wte = wte_;
#pragma omp parallel for schedule(static)
    for (size_t t = 0; t < T; t++) memcpy(out + t * D, wte + (size_t)tokens[t] * D, D * sizeof(real));
}

void cpu_embedding_backward(void *dwte_, const void *dout_, const int32_t *tokens, size_t T,
                            size_t D, size_t V) {
    real *dwte = dwte_;
    const real *dout = dout_;
    // Parallel over columns so each dwte element is summed by one thread in token order.
#pragma omp parallel for schedule(static)
    for (size_t j = 0; j < D; j++)
        for (size_t t = 0; t < T; t++) dwte[(size_t)tokens[t] * D + j] += dout[t * D + j];
}

void cpu_matmul_forward(void *out, const void *x, const void *w, size_t M, size_t N, size_t K,
                        bool accumulate) {
    cpu_gemm(false, true, M, N, K, 1, x, K, w, K, accumulate ? 1 : 0, out, N);
}

void cpu_matmul_backward(void *dx, void *dw, const void *dout, const void *x, const void *w,
                         size_t M, size_t N, size_t K, bool accumulate_dx) {
    if (dx) cpu_gemm(false, false, M, K, N, 1, dout, N, w, K, accumulate_dx ? 1 : 0, dx, K);
    cpu_gemm(true, false, N, K, M, 1, dout, N, x, K, 1, dw, K);
}

real cpu_rms_group_forward(real *y, const real *x, const real *w, size_t W, float eps) {
    double ss = 0;
    for (size_t j = 0; j < W; j++) ss += (double)x[j] * x[j];
    real rstd = (real)(1.0 / sqrt(ss / (double)W + eps));
    for (size_t j = 0; j < W; j++) y[j] = x[j] * rstd * w[j];
    return rstd;
}

// y = x r w with r = (mean(x^2) + eps)^(-1/2):  dx = r w dy - x r^3 / W * sum(dy w x)
void cpu_rms_group_backward(real *dx, const real *dy, const real *x, const real *w, real rstd,
                            size_t W, bool accumulate) {
    double dot = 0;
    for (size_t j = 0; j < W; j++) dot += (double)dy[j] * w[j] * x[j];
    real c = (real)(dot * rstd * rstd * rstd / (double)W);
    for (size_t j = 0; j < W; j++) {
        real g = rstd * w[j] * dy[j] - c * x[j];
        dx[j] = accumulate ? dx[j] + g : g;
    }
}

// Rows are summed in fixed chunks whose partial sums are added in chunk order: the result does
// not depend on the thread count, and each chunk walks its rows contiguously.
#define RMS_DW_CHUNK 64

void cpu_rms_dw_accumulate(real *dw, const real *dy, const real *x, const real *rstd, size_t T,
                           size_t G, size_t W, size_t ld, size_t ldr) {
    size_t n_chunks = size_ceil_div(T, RMS_DW_CHUNK);
    double *partial = moe_calloc(n_chunks * W, sizeof(double));
#pragma omp parallel for schedule(static)
    for (size_t c = 0; c < n_chunks; c++) {
        double *acc = partial + c * W;
        size_t end = (c + 1) * RMS_DW_CHUNK < T ? (c + 1) * RMS_DW_CHUNK : T;
        for (size_t t = c * RMS_DW_CHUNK; t < end; t++)
            for (size_t g = 0; g < G; g++) {
                const real *dyr = dy + t * ld + g * W, *xr = x + t * ld + g * W;
                real r = rstd[t * ldr + g];
                for (size_t j = 0; j < W; j++) acc[j] += (double)(dyr[j] * xr[j] * r);
            }
    }
    for (size_t j = 0; j < W; j++) {
        double s = 0;
        for (size_t c = 0; c < n_chunks; c++) s += partial[c * W + j];
        dw[j] += (real)s;
    }
    free(partial);
}

void cpu_rmsnorm_forward(void *out_, void *rstd_, const void *x_, const void *w, size_t R, size_t W,
                         float eps) {
    real *out = out_, *rstd = rstd_;
    const real *x = x_;
#pragma omp parallel for schedule(static)
    for (size_t r = 0; r < R; r++) rstd[r] = cpu_rms_group_forward(out + r * W, x + r * W, w, W, eps);
}

void cpu_add_rmsnorm_forward(void *sum, void *out, void *rstd, const void *a, const void *b, const void *w, size_t R,
                             size_t W, float eps) {
    cpu_add(sum, a, b, R * W);
    cpu_rmsnorm_forward(out, rstd, sum, w, R, W, eps);
}

void cpu_rmsnorm_backward(void *dx_, void *dw, const void *dout_, const void *x_, const void *w,
                          const void *rstd_, size_t R, size_t W, bool accumulate_dx) {
    real *dx = dx_;
    const real *dout = dout_, *x = x_, *rstd = rstd_;
    cpu_rms_dw_accumulate(dw, dout, x, rstd, R, 1, W, W, 1);
#pragma omp parallel for schedule(static)
    for (size_t r = 0; r < R; r++)
        cpu_rms_group_backward(dx + r * W, dout + r * W, x + r * W, w, rstd[r], W, accumulate_dx);
}

void cpu_add(void *out_, const void *a_, const void *b_, size_t n) {
    real *out = out_;
    const real *a = a_, *b = b_;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

// Rows [*first, *end) a SwiGLU call works on (ops.h), within R.
static void rows_used(size_t R, const int32_t *rows, size_t n, size_t *first, size_t *end) {
    size_t lo = rows ? (size_t)rows[0] : 0, hi = rows ? (size_t)rows[n] : R;
    *end = hi < R ? hi : R, *first = lo < *end ? lo : *end;
}

static real sigmoid(real x) { return 1 / (1 + real_exp(-x)); }
static real swiglu_value(real g, real u) { return g * sigmoid(g) * u; }

void cpu_swiglu_forward(void *out_, const void *gu_, size_t R, size_t H, const int32_t *rows, size_t n) {
    real *out = out_;
    const real *gu = gu_;
    size_t first, end;
    rows_used(R, rows, n, &first, &end);
#pragma omp parallel for schedule(static)
    for (size_t r = first; r < end; r++)
        for (size_t j = 0; j < H; j++) {
            real g = gu[r * 2 * H + j], u = gu[r * 2 * H + H + j];
            out[r * H + j] = swiglu_value(g, u);
        }
}

// dgu may be gu: a row's gate and up values are read before their gradients are written.
void cpu_swiglu_backward(void *dgu_, void *row_dot_, void *hw_, const void *dout_, const void *gu_,
                         const void *row_w_, size_t R, size_t H, const int32_t *rows, size_t n) {
    real *dgu = dgu_, *row_dot = row_dot_, *hw = hw_;
    const real *dout = dout_, *gu = gu_, *row_w = row_w_;
    size_t first, end;
    rows_used(R, rows, n, &first, &end);
#pragma omp parallel for schedule(static)
    for (size_t r = first; r < end; r++) {
        real w = row_w ? row_w[r] : 1;
        double dot = 0;
        for (size_t j = 0; j < H; j++) {
            real g = gu[r * 2 * H + j], u = gu[r * 2 * H + H + j], d = dout[r * H + j], s = sigmoid(g);
            if (row_dot) {
                real h = swiglu_value(g, u);
                dot += (double)d * h;
                hw[r * H + j] = w * h;
            }
            d *= w;
            dgu[r * 2 * H + j] = d * u * s * (1 + g * (1 - s));
            dgu[r * 2 * H + H + j] = d * g * s;
        }
        if (row_dot) row_dot[r] = (real)dot;
    }
}

// One row: returns the loss and writes lse; with grad, turns the row into its gradient.
static double cross_entropy_row(real *row, int32_t target, size_t V, float ce_scale,
                                float z_scale, bool want_grad, double *lse_out) {
    double mx = -INFINITY;
    for (size_t v = 0; v < V; v++) mx = row[v] > mx ? row[v] : mx;
    double sum = 0;
    for (size_t v = 0; v < V; v++) sum += exp(row[v] - mx);
    double lse = mx + log(sum);
    double loss = lse - row[target];
    *lse_out = lse;
    if (want_grad) {
        for (size_t v = 0; v < V; v++) {
            double p = exp(row[v] - lse);
            row[v] = (real)(ce_scale * (p - (v == (size_t)target)) + z_scale * 2.0 * lse * p);
        }
    }
    return loss;
}

void cpu_cross_entropy(void *logits_, void *loss_acc_, const int32_t *targets, size_t N, size_t V,
                       float ce_scale, float z_scale, bool want_grad) {
    real *logits = logits_, *loss_acc = loss_acc_;
    double *loss = moe_malloc(2 * N * sizeof(double)); // (N) losses, then (N) lse^2
#pragma omp parallel for schedule(static)
    for (size_t n = 0; n < N; n++) {
        real *row = logits + n * V;
        if (targets[n] < 0) { // ignored position: no loss, no gradient
            if (want_grad) memset(row, 0, V * sizeof(real));
            loss[n] = loss[N + n] = 0;
            continue;
        }
        double lse;
        loss[n] = cross_entropy_row(row, targets[n], V, ce_scale, z_scale, want_grad, &lse);
        loss[N + n] = lse * lse;
    }
    double ce = 0, z = 0;
    for (size_t n = 0; n < N; n++) ce += loss[n], z += loss[N + n];
    loss_acc[0] += (real)ce;
    loss_acc[1] += (real)z;
    free(loss);
}

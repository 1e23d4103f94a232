// CPU reference kernels for attention: QK-norm + RoPE on packed qkv rows, and causal attention with
// grouped key/value heads. Attention keeps only the log-sum-exp of each score row (as flash
// attention does) and recomputes the probabilities in the backward.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_ops.h"

static size_t qkv_width(AttnDims d) { return (d.Hq + 2 * d.Hkv) * d.hd; }

// Rotate-half RoPE of one head in place; `inverse` applies the transpose (the backward).
static void rope_head(real *x, const real *rope_s, size_t hd, bool inverse) {
    size_t half = hd / 2;
    for (size_t i = 0; i < half; i++) {
        real c = rope_s[2 * i], s = inverse ? -rope_s[2 * i + 1] : rope_s[2 * i + 1];
        real x1 = x[i], x2 = x[i + half];
        x[i] = x1 * c - x2 * s;
        x[i + half] = x2 * c + x1 * s;
    }
}

// Layout of the norm groups of q (is_k false) or k: G groups of width W, weight shared across them.
static void norm_groups(AttnDims d, QkNorm mode, bool is_k, size_t *G, size_t *W) {
    size_t heads = is_k ? d.Hkv : d.Hq;
    *G = mode == QK_NORM_HEAD ? heads : 1;
    *W = mode == QK_NORM_HEAD ? d.hd : heads * d.hd;
}

void cpu_qkv_norm_rope_forward(void *qkv_, void *rstd_, const void *qkv_raw_, const void *wq,
                               const void *wk, const void *rope_, AttnDims d, QkNorm mode,
                               float eps) {
    real *qkv = qkv_, *rstd = rstd_;
    const real *raw = qkv_raw_, *rope = rope_;
    size_t C = qkv_width(d), T = d.B * d.S, nr = d.Hq + d.Hkv;
#pragma omp parallel for schedule(static)
    for (size_t t = 0; t < T; t++) {
        const real *src = raw + t * C;
        real *dst = qkv + t * C;
        memcpy(dst, src, C * sizeof(real));
        for (int is_k = 0; is_k < 2 && mode != QK_NORM_NONE; is_k++) {
            size_t G, W, base = is_k ? d.Hq * d.hd : 0;
            norm_groups(d, mode, is_k, &G, &W);
            for (size_t g = 0; g < G; g++)
                rstd[t * nr + (is_k ? d.Hq : 0) + g] = cpu_rms_group_forward(
                    dst + base + g * W, src + base + g * W, is_k ? wk : wq, W, eps);
        }
        for (size_t h = 0; h < nr; h++) rope_head(dst + h * d.hd, rope + (t % d.S) * d.hd, d.hd, false);
    }
}

void cpu_qkv_norm_rope_backward(void *dqkv_raw_, void *dwq, void *dwk, const void *dqkv_,
                                const void *qkv_raw_, const void *wq, const void *wk,
                                const void *rstd_, const void *rope_, AttnDims d, QkNorm mode) {
    real *draw = dqkv_raw_;
    const real *dqkv = dqkv_, *raw = qkv_raw_, *rstd = rstd_, *rope = rope_;
    size_t C = qkv_width(d), T = d.B * d.S, nr = d.Hq + d.Hkv;
    // 1. undo RoPE: draw holds d(normed q, k) and dv
#pragma omp parallel for schedule(static)
    for (size_t t = 0; t < T; t++) {
        if (draw != dqkv) memcpy(draw + t * C, dqkv + t * C, C * sizeof(real));
        for (size_t h = 0; h < nr; h++) rope_head(draw + t * C + h * d.hd, rope + (t % d.S) * d.hd, d.hd, true);
    }
    if (mode == QK_NORM_NONE) return;
    // 2. norm weight gradients, then 3. input gradients in place (each group reads only itself)
    for (int is_k = 0; is_k < 2; is_k++) {
        size_t G, W, base = is_k ? d.Hq * d.hd : 0;
        norm_groups(d, mode, is_k, &G, &W);
        cpu_rms_dw_accumulate(is_k ? dwk : dwq, draw + base, raw + base, rstd + (is_k ? d.Hq : 0),
                              T, G, W, C, nr);
#pragma omp parallel for schedule(static)
        for (size_t t = 0; t < T; t++)
            for (size_t g = 0; g < G; g++) {
                size_t o = t * C + base + g * W;
                cpu_rms_group_backward(draw + o, draw + o, raw + o, is_k ? wk : wq,
                                       rstd[t * nr + (is_k ? d.Hq : 0) + g], W, false);
            }
    }
}

static real dot(const real *a, const real *b, size_t n) {
    real s = 0;
    for (size_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static void axpy(real *y, real a, const real *x, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] += a * x[i];
}

void cpu_attention_forward(void *out_, void *lse_, const void *qkv_, AttnDims d) {
    real *out = out_, *lse = lse_;
    const real *qkv = qkv_;
    size_t C = qkv_width(d), group = d.Hq / d.Hkv;
    real scale = (real)(1.0 / sqrt((double)d.hd));
#pragma omp parallel
    {
        real *p = calloc(d.S, sizeof(real)); // scores of one query row
#pragma omp for collapse(3) schedule(static)
        for (size_t b = 0; b < d.B; b++)
            for (size_t h = 0; h < d.Hq; h++)
                for (size_t i = 0; i < d.S; i++) {
                    const real *q = qkv + (b * d.S + i) * C + h * d.hd;
                    size_t koff = (d.Hq + h / group) * d.hd, voff = koff + d.Hkv * d.hd;
                    real mx = -INFINITY;
                    for (size_t j = 0; j <= i; j++) {
                        p[j] = scale * dot(q, qkv + (b * d.S + j) * C + koff, d.hd);
                        mx = p[j] > mx ? p[j] : mx;
                    }
                    double sum = 0;
                    for (size_t j = 0; j <= i; j++) sum += p[j] = real_exp(p[j] - mx);
                    real *o = out + (b * d.S + i) * d.Hq * d.hd + h * d.hd;
                    memset(o, 0, d.hd * sizeof(real));
                    for (size_t j = 0; j <= i; j++)
                        axpy(o, (real)(p[j] / sum), qkv + (b * d.S + j) * C + voff, d.hd);
                    lse[(b * d.Hq + h) * d.S + i] = (real)(mx + log(sum));
                }
        free(p);
    }
}

// dS = P (dP - rowsum(dO * O)), dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO. One task per
// (batch, kv head) owns that head's dk, dv and the dq of its query heads: no write is shared.
void cpu_attention_backward(void *dqkv_, const void *dout_, const void *qkv_, const void *out_,
                            const void *lse_, AttnDims d) {
    real *dqkv = dqkv_;
    const real *dout = dout_, *qkv = qkv_, *out = out_, *lse = lse_;
    size_t C = qkv_width(d), group = d.Hq / d.Hkv, Dq = d.Hq * d.hd;
    real scale = (real)(1.0 / sqrt((double)d.hd));
#pragma omp parallel for collapse(2) schedule(static)
    for (size_t b = 0; b < d.B; b++)
        for (size_t g = 0; g < d.Hkv; g++) {
            size_t koff = (d.Hq + g) * d.hd, voff = koff + d.Hkv * d.hd;
            for (size_t s = 0; s < d.S; s++) {
                real *row = dqkv + (b * d.S + s) * C;
                memset(row + koff, 0, d.hd * sizeof(real));
                memset(row + voff, 0, d.hd * sizeof(real));
                for (size_t h = g * group; h < (g + 1) * group; h++) memset(row + h * d.hd, 0, d.hd * sizeof(real));
            }
            for (size_t h = g * group; h < (g + 1) * group; h++)
                for (size_t i = 0; i < d.S; i++) {
                    size_t ti = b * d.S + i;
                    const real *q = qkv + ti * C + h * d.hd, *dO = dout + ti * Dq + h * d.hd;
                    real Di = dot(dO, out + ti * Dq + h * d.hd, d.hd);
                    real l = lse[(b * d.Hq + h) * d.S + i];
                    real *dq = dqkv + ti * C + h * d.hd;
                    for (size_t j = 0; j <= i; j++) {
                        size_t tj = b * d.S + j;
                        const real *k = qkv + tj * C + koff, *v = qkv + tj * C + voff;
                        real p = real_exp(scale * dot(q, k, d.hd) - l);
                        real ds = p * (dot(dO, v, d.hd) - Di);
                        axpy(dq, scale * ds, k, d.hd);
                        axpy(dqkv + tj * C + koff, scale * ds, q, d.hd);
                        axpy(dqkv + tj * C + voff, p, dO, d.hd);
                    }
                }
        }
}

// CPU reference kernels for the mixture-of-experts ops: router (scores, top-k, aux losses), the
// counting-sort dispatch of routed token rows into expert-contiguous order, the weighted combine
// back, the expert-parallel regroup and direct exchange (plan, row pushes into peer memory),
// grouped expert matmuls over per-expert row offsets, and loss-free bias balancing.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "ops/exchange_plan.h"
#include "cpu_gemm.h"
#include "cpu_ops.h"

// Softmax of one row of E logits into p; returns the log-sum-exp.
static double softmax_row(real *p, const real *logits, size_t E) {
    double mx = -INFINITY, sum = 0;
    for (size_t e = 0; e < E; e++) mx = logits[e] > mx ? logits[e] : mx;
    for (size_t e = 0; e < E; e++) sum += exp(logits[e] - mx);
    double lse = mx + log(sum);
    for (size_t e = 0; e < E; e++) p[e] = (real)exp(logits[e] - lse);
    return lse;
}

// The K largest of v (E), ties to the lowest index, into idx (K).
static void topk_row(int32_t *idx, const double *v, size_t E, size_t K) {
    for (size_t k = 0; k < K; k++) {
        int32_t best = -1;
        for (size_t e = 0; e < E; e++) {
            bool taken = false;
            for (size_t j = 0; j < k; j++) taken |= idx[j] == (int32_t)e;
            if (!taken && (best < 0 || v[e] > v[best])) best = (int32_t)e;
        }
        idx[k] = best;
    }
}

// Scores, choice and weights of token t; returns the row's router log-sum-exp (for the z-loss).
static double route_token(size_t t, real *scores, int32_t *idx, real *w, const real *logits,
                          const real *bias, const StepInfo *step, RouterArgs a, double *choice,
                          real *tmp) {
    size_t E = a.E, K = a.K;
    double lse = softmax_row(a.kind == ROUTER_SOFTMAX ? scores : tmp, logits, E);
    if (a.kind == ROUTER_SIGMOID)
        for (size_t e = 0; e < E; e++) scores[e] = (real)(1.0 / (1.0 + exp(-(double)logits[e])));
    // Without bias or noise the choice goes by logit: the order of the scores, and a value every
    // backend has exactly (scores differ in the last bits between backends).
    for (size_t e = 0; e < E; e++) {
        double noise = a.random ? rng_routing_noise(step->seed, a.layer, a.token_base + t, E, e) : 0;
        tmp[e] = a.random ? (real)noise : scores[e]; // the values the weights come from
        choice[e] = a.random ? noise : bias ? (double)scores[e] + bias[e] : (double)logits[e];
        if (a.random && bias) choice[e] += bias[e];
    }
    topk_row(idx, choice, E, K);
    double sum = 0;
    for (size_t k = 0; k < K; k++) sum += w[k] = tmp[idx[k]];
    if (a.renorm)
        for (size_t k = 0; k < K; k++) w[k] = (real)(w[k] / sum);
    return lse;
}

void cpu_router_forward(void *scores_, int32_t *topk_idx, void *topk_w_, int32_t *counts,
                        void *aux_, const void *logits_, const void *bias_, const StepInfo *step,
                        RouterArgs a) {
    real *scores = scores_, *topk_w = topk_w_, *aux = aux_;
    const real *logits = logits_, *bias = bias_;
    size_t T = a.T, E = a.E, K = a.K;
    double *lse = moe_malloc(T * sizeof(double));
#pragma omp parallel
    {
        double *choice = moe_malloc(E * sizeof(double));
        real *tmp = moe_malloc(E * sizeof(real));
#pragma omp for schedule(static)
        for (size_t t = 0; t < T; t++)
            lse[t] = route_token(t, scores + t * E, topk_idx + t * K, topk_w + t * K,
                                 logits + t * E, bias, step, a, choice, tmp);
        free(choice);
        free(tmp);
    }
    memset(counts, 0, E * sizeof(int32_t));
    for (size_t i = 0; i < T * K; i++) counts[topk_idx[i]]++;
    double z = 0;
    for (size_t e = 0; e < E; e++) {
        double P = 0;
        for (size_t t = 0; t < T; t++) P += scores[t * E + e];
        aux[e] = (real)counts[e];
        aux[E + e] = (real)P;
    }
    for (size_t t = 0; t < T; t++) z += lse[t] * lse[t];
    aux[2 * E] = (real)z;
    free(lse);
}

// LB = (E / K) sum_e (c_e / T) (P_e / T) with P_e the summed score (OLMo-core's formula);
// Z = sum_t lse_t^2 / T; T counts the micro-batch's tokens over all data-parallel ranks.
void cpu_router_aux_loss(void *stats_, const void *aux_, RouterArgs a, float weight) {
    real *stats = stats_;
    const real *aux = aux_;
    size_t E = a.E;
    double T = (double)a.T_global, lb = 0;
    for (size_t e = 0; e < E; e++) {
        lb += (double)aux[e] / T * (double)aux[E + e] / T;
        stats[e] += weight * aux[e];
    }
    stats[router_stat_lb(E)] += (real)(weight * lb * (double)E / (double)a.K);
    stats[router_stat_z(E)] += (real)(weight * aux[2 * E] / T);
}

void cpu_router_backward(void *dlogits_, const void *dtopk_w_, const void *logits_,
                         const void *scores_, const int32_t *topk_idx, const void *topk_w_,
                         const void *aux_, RouterArgs a) {
    real *dlogits = dlogits_;
    const real *dtopk_w = dtopk_w_, *logits = logits_, *scores = scores_, *topk_w = topk_w_;
    const real *aux = aux_;
    size_t T = a.T, E = a.E, K = a.K;
    double Tg = (double)a.T_global;
    double lb_scale = a.lb_grad * (double)E / (double)K / (Tg * Tg);
#pragma omp parallel
    {
        double *ds = moe_malloc(E * sizeof(double));
        real *p = moe_malloc(E * sizeof(real));
#pragma omp for schedule(static)
        for (size_t t = 0; t < T; t++) {
            const real *s = scores + t * E, *dw = dtopk_w + t * K, *w = topk_w + t * K;
            const int32_t *idx = topk_idx + t * K;
            for (size_t e = 0; e < E; e++) ds[e] = lb_scale * aux[e];
            if (!a.random) { // weights are chosen scores (renormalised: w_k = s_k / sum_j s_j)
                double wdw = 0, ssum = 0;
                for (size_t k = 0; k < K; k++) wdw += dw[k] * w[k], ssum += s[idx[k]];
                for (size_t k = 0; k < K; k++)
                    ds[idx[k]] += a.renorm ? (dw[k] - wdw) / ssum : dw[k];
            }
            double lse = softmax_row(p, logits + t * E, E);
            double sds = 0;
            for (size_t e = 0; e < E; e++) sds += ds[e] * s[e];
            for (size_t e = 0; e < E; e++) {
                double g = a.kind == ROUTER_SOFTMAX ? s[e] * (ds[e] - sds) : ds[e] * s[e] * (1 - s[e]);
                dlogits[t * E + e] = (real)(g + a.z_grad * 2.0 * lse * p[e] / Tg);
            }
        }
        free(ds);
        free(p);
    }
}

void cpu_moe_dispatch_forward(void *xp_, int32_t *slot_pos, int32_t *offsets, void *stats_,
                              const void *x_, const int32_t *topk_idx, const int32_t *counts,
                              size_t T, size_t K, size_t E, size_t D, size_t capacity) {
    real *xp = xp_, *stats = stats_;
    const real *x = x_;
    int32_t *fill = moe_calloc(E, sizeof(int32_t));
    offsets[0] = 0;
    for (size_t e = 0; e < E; e++) {
        int32_t kept = capacity && (size_t)counts[e] > capacity ? (int32_t)capacity : counts[e];
        offsets[e + 1] = offsets[e] + kept;
    }
    size_t dropped = 0;
    for (size_t i = 0; i < T * K; i++) { // token order within each expert; later slots drop first
        int32_t e = topk_idx[i];
        bool keep = fill[e] < offsets[e + 1] - offsets[e];
        slot_pos[i] = keep ? offsets[e] + fill[e]++ : -1;
        dropped += !keep;
    }
    stats[router_stat_dropped(E)] += (real)dropped;
    free(fill);
    if (!xp) return;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < T * K; i++)
        if (slot_pos[i] >= 0) memcpy(xp + (size_t)slot_pos[i] * D, x + (i / K) * D, D * sizeof(real));
}

// out[t] = base[t] (NULL: 0; may be out) + the sum over the kept slots k of token t of w[t, k] *
// rows[slot_pos[t, k]] (w NULL: weight 1). Serves the combine and the backward of the dispatch.
static void sum_slot_rows(real *out, const real *base, const real *rows, const int32_t *slot_pos, const real *w,
                          size_t T, size_t K, size_t D) {
#pragma omp parallel for schedule(static)
    for (size_t t = 0; t < T; t++) {
        real *row = out + t * D;
        if (!base) memset(row, 0, D * sizeof(real));
        else if (base != out) memcpy(row, base + t * D, D * sizeof(real));
        for (size_t k = 0; k < K; k++) {
            int32_t pos = slot_pos[t * K + k];
            if (pos < 0) continue;
            real wk = w ? w[t * K + k] : 1;
            for (size_t j = 0; j < D; j++) row[j] += wk * rows[(size_t)pos * D + j];
        }
    }
}

void cpu_moe_dispatch_backward(void *dx, const void *dxp, const int32_t *slot_pos, size_t T,
                               size_t K, size_t D, bool accumulate_dx) {
    sum_slot_rows(dx, accumulate_dx ? dx : NULL, dxp, slot_pos, NULL, T, K, D);
}

void cpu_moe_combine_forward(void *out, const void *base, const void *y, const int32_t *slot_pos, const void *topk_w,
                             size_t T, size_t K, size_t D) {
    sum_slot_rows(out, base, y, slot_pos, topk_w, T, K, D);
}

void cpu_moe_combine_backward(void *dy_, void *dtopk_w_, void *row_w_, const void *dout_, const void *y_,
                              const int32_t *slot_pos, const void *topk_w_, size_t T, size_t K,
                              size_t D) {
    real *dy = dy_, *dw = dtopk_w_, *row_w = row_w_;
    const real *dout = dout_, *y = y_, *w = topk_w_;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < T * K; i++) {
        int32_t pos = slot_pos[i];
        const real *g = dout + (i / K) * D;
        if (pos < 0) {
            if (y) dw[i] = 0;
        } else if (!y) {
            if (dy) memcpy(dy + (size_t)pos * D, g, D * sizeof(real));
            row_w[pos] = w[i];
        } else {
            real *d = dy + (size_t)pos * D;
            double acc = 0;
            for (size_t j = 0; j < D; j++) acc += (double)g[j] * y[(size_t)pos * D + j], d[j] = w[i] * g[j];
            dw[i] = (real)acc;
        }
    }
}

void cpu_moe_slot_values(void *dtopk_w_, const void *row_dot_, const int32_t *slot_pos, size_t n) {
    real *dw = dtopk_w_;
    const real *row_dot = row_dot_;
    for (size_t i = 0; i < n; i++) dw[i] = slot_pos[i] < 0 ? 0 : row_dot[slot_pos[i]];
}

void cpu_moe_row_tokens(int32_t *row_token, const int32_t *slot_pos, size_t T, size_t K) {
    for (size_t i = 0; i < T * K; i++)
        if (slot_pos[i] >= 0) row_token[slot_pos[i]] = (int32_t)(i / K);
}

// Rows arrive grouped by source rank, each source's rows by local expert; experts want their rows
// together. Both orders list the same (source, expert) blocks, so one walk over the blocks moves
// every block between its two positions.
void cpu_moe_regroup(void *out_, const void *in_, const int32_t *counts, size_t ep, size_t El,
                     size_t D, bool to_expert_major) {
    real *out = out_;
    const real *in = in_;
    size_t *src_major = moe_malloc(ep * El * sizeof(size_t)), *exp_major = moe_malloc(ep * El * sizeof(size_t));
    size_t pos = 0;
    for (size_t r = 0; r < ep; r++)
        for (size_t e = 0; e < El; e++) src_major[r * El + e] = pos, pos += (size_t)counts[r * El + e];
    pos = 0;
    for (size_t e = 0; e < El; e++)
        for (size_t r = 0; r < ep; r++) exp_major[r * El + e] = pos, pos += (size_t)counts[r * El + e];
#pragma omp parallel for schedule(static)
    for (size_t b = 0; b < ep * El; b++) {
        size_t from = to_expert_major ? src_major[b] : exp_major[b];
        size_t to = to_expert_major ? exp_major[b] : src_major[b];
        memcpy(out + to * D, in + from * D, (size_t)counts[b] * D * sizeof(real));
    }
    free(src_major);
    free(exp_major);
}

void cpu_moe_exchange_plan(int32_t *plan, const int32_t *all_offsets, size_t n, size_t El, size_t rank,
                           size_t cap, void *dropped) {
    int32_t total = 0;
    for (size_t i = 0; i <= n * El; i++) total += exchange_plan_entry(plan, all_offsets, n, El, rank, i, cap);
    *(real *)dropped += (real)total;
}

void cpu_moe_push_rows(void *const *peers, size_t dst_offset, const void *in_, PushBlocks sel, size_t D, size_t R,
                       size_t ctas) {
    const real *in = in_;
#pragma omp parallel for schedule(static)
    for (size_t b = 0; b < sel.run * sel.runs; b++) {
        const int32_t *k = sel.blocks + 4 * (b / sel.run * sel.stride + b % sel.run);
        real *dst = (real *)((char *)peers[k[2]] + dst_offset) + (size_t)k[3] * D;
        size_t from = (size_t)k[0], rows = (size_t)k[1];
        size_t kept = from >= R ? 0 : R - from < rows ? R - from : rows; // rows past R were dropped
        memcpy(dst, in + from * D, kept * D * sizeof(real));
        memset(dst + kept * D, 0, (rows - kept) * D * sizeof(real));
    }
}

void cpu_grouped_matmul_forward(void *out_, const void *x_, const void *w_, const int32_t *offsets,
                                size_t E, size_t N, size_t K, size_t R) {
    real *out = out_;
    const real *x = x_, *w = w_;
    for (size_t e = 0; e < E; e++) {
        size_t r0 = (size_t)offsets[e], n = (size_t)(offsets[e + 1] - offsets[e]);
        cpu_gemm(false, true, n, N, K, 1, x + r0 * K, K, w + e * N * K, K, 0, out + r0 * N, N);
    }
}

void cpu_grouped_matmul_backward(void *dx_, void *dw_, const void *dout_, const void *x_,
                                 const void *w_, const int32_t *offsets, size_t E, size_t N,
                                 size_t K, size_t R, bool accumulate_dw) {
    real *dx = dx_, *dw = dw_;
    const real *dout = dout_, *x = x_, *w = w_;
    for (size_t e = 0; e < E; e++) { // an expert without rows: a product of K = 0, dw[e] times beta
        size_t r0 = (size_t)offsets[e], n = (size_t)(offsets[e + 1] - offsets[e]);
        if (dx) cpu_gemm(false, false, n, K, N, 1, dout + r0 * N, N, w + e * N * K, K, 0, dx + r0 * K, K);
        if (dw) cpu_gemm(true, false, N, K, n, 1, dout + r0 * N, N, x + r0 * K, K, accumulate_dw, dw + e * N * K, K);
    }
}

void cpu_router_bias_update(void *bias_, const void *loads_, size_t E, float gamma) {
    real *bias = bias_;
    const real *loads = loads_;
    double mean = 0;
    for (size_t e = 0; e < E; e++) mean += loads[e];
    mean /= (double)E;
    for (size_t e = 0; e < E; e++)
        bias[e] += gamma * (real)((mean > loads[e]) - (mean < loads[e]));
}

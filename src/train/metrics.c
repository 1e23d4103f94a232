// Step reports: from the raw metrics buffer to a console line and a JSON-lines record.
#include "metrics.h"

#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdlib.h>

static void layer_load(LayerLoad *L, const float *stats, size_t E, size_t n_micro) {
    L->load = moe_malloc(E * sizeof(double));
    double total = 0, mx = 0, mn = INFINITY;
    for (size_t e = 0; e < E; e++) {
        L->load[e] = stats[e];
        total += stats[e];
        mx = stats[e] > mx ? stats[e] : mx;
        mn = stats[e] < mn ? stats[e] : mn;
    }
    double mean = total / (double)E;
    L->imbalance = mean > 0 ? mx / mean : 0;
    L->min_over_mean = mean > 0 ? mn / mean : 0;
    L->drop_rate = total > 0 ? stats[router_stat_dropped(E)] / total : 0;
    L->lb = stats[router_stat_lb(E)] / (double)n_micro;
    L->z = stats[router_stat_z(E)] / (double)n_micro;
}

void report_build(StepReport *r, const ModelConfig *c, const float *metrics, size_t n_micro,
                  size_t T) {
    double tokens = (double)n_micro * (double)T;
    r->ce = metrics[METRIC_CE] / tokens;
    r->lm_z = metrics[METRIC_LM_Z] / tokens;
    r->grad_norm = sqrt(metrics[METRIC_GRAD_NORM_SQ]);
    r->n_moe = model_n_moe_layers(c);
    r->E = c->n_experts;
    r->layers = moe_calloc(r->n_moe ? r->n_moe : 1, sizeof(LayerLoad));
    r->lb = r->z = 0;
    for (int i = 0; i < r->n_moe; i++) {
        layer_load(&r->layers[i], metrics + model_metric_router(c, i), (size_t)c->n_experts, n_micro);
        r->lb += r->layers[i].lb / r->n_moe;
        r->z += r->layers[i].z / r->n_moe;
    }
    r->loss = r->ce + c->lb_coef * r->lb + c->z_coef * r->z + c->lm_z_coef * r->lm_z;
}

void report_free(StepReport *r) {
    for (int i = 0; i < r->n_moe; i++) free(r->layers[i].load);
    free(r->layers);
    r->layers = NULL;
}

bool report_finite(const StepReport *r) { return isfinite(r->loss) && isfinite(r->grad_norm); }

double report_worst_imbalance(const StepReport *r) {
    double worst = 0;
    for (int i = 0; i < r->n_moe; i++) worst = r->layers[i].imbalance > worst ? r->layers[i].imbalance : worst;
    return worst;
}

double report_drop_rate(const StepReport *r) {
    double drop = 0;
    for (int i = 0; i < r->n_moe; i++) drop += r->layers[i].drop_rate / r->n_moe;
    return drop;
}

void report_print(const StepReport *r, FILE *f) {
    char tps[32];
    moe_fmt_count(tps, sizeof tps, (uint64_t)(r->tokens_per_sec + 0.5));
    fprintf(f, "step %5" PRId64 "/%" PRId64 " | loss %.4f | ce %.4f", r->step, r->steps, r->loss, r->ce);
    if (r->n_moe) {
        double drop = report_drop_rate(r);
        fprintf(f, " lb %.3f z %.3f | load max/mean %.2f", r->lb, r->z, report_worst_imbalance(r));
        if (drop > 0) fprintf(f, " drop %.1f%%", 100 * drop);
    }
    fprintf(f, " | lr %.2e | gnorm %.3f | %s tok/s\n", r->lr, r->grad_norm, tps);
    fflush(f);
}

void report_write_json(const StepReport *r, FILE *f) {
    json_t *o = json_pack("{s:I, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f}", "step", (json_int_t)r->step,
                          "loss", r->loss, "ce", r->ce, "lb_loss", r->lb, "z_loss", r->z,
                          "lm_z_loss", r->lm_z, "lr", r->lr, "grad_norm", r->grad_norm,
                          "tokens_per_sec", r->tokens_per_sec, "elapsed_s", r->elapsed_s,
                          "pipeline_wait", r->pipeline_wait);
    if (!o) return; // jansson refuses NaN and Inf; callers stop on those before logging
    json_t *layers = json_array();
    for (int i = 0; i < r->n_moe; i++) {
        const LayerLoad *L = &r->layers[i];
        json_t *load = json_array();
        for (int e = 0; e < r->E; e++) json_array_append_new(load, json_real(L->load[e]));
        json_array_append_new(layers, json_pack("{s:i, s:o, s:f, s:f, s:f, s:f, s:f}", "moe_layer", i,
                                                "load", load, "imbalance", L->imbalance,
                                                "min_over_mean", L->min_over_mean, "drop_rate",
                                                L->drop_rate, "lb_loss", L->lb, "z_loss", L->z));
    }
    json_object_set_new(o, "moe_layers", layers);
    json_dumpf(o, f, JSON_COMPACT | JSON_REAL_PRECISION(9));
    fputc('\n', f);
    fflush(f);
    json_decref(o);
}

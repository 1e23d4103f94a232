// Step reports: from the raw metrics buffer to a console line and a JSON-lines record; the
// metrics.jsonl log with checked writes and its repair for a resume.
#include "metrics.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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

static const char *const FP8_CLASS_KEYS[FP8_CLASSES] = {"weights", "activations", "gradients"};
static const char *const FP8_COUNT_KEYS[FP8_COUNTS] = {"values", "flushed", "saturated", "nan"};

const char *report_fp8_class_key(int c) { return FP8_CLASS_KEYS[c]; }
const char *report_fp8_count_key(int i) { return FP8_COUNT_KEYS[i]; }

// Class c's counters (FP8_COUNTS) among counts (FP8_CLASSES, FP8_COUNTS).
static const uint64_t *fp8_class_counts(const uint64_t *counts, int c) { return counts + (size_t)c * FP8_COUNTS; }

// The share of class c's values that counter i counted (NaN: no values).
static double fp8_share(const uint64_t *counts, int c, int i) {
    const uint64_t *n = fp8_class_counts(counts, c);
    return n[FP8_COUNT_VALUES] ? (double)n[i] / (double)n[FP8_COUNT_VALUES] : NAN;
}

// " | fp8 flushed w .. a .. g ..", then the saturated and NaN shares of the classes that have any.
static void fp8_print(const uint64_t *counts, FILE *f) {
    fprintf(f, " | fp8 flushed");
    for (int c = 0; c < FP8_CLASSES; c++)
        fprintf(f, " %c %.3g%%", FP8_CLASS_KEYS[c][0], 100 * fp8_share(counts, c, FP8_COUNT_FLUSHED));
    for (int i = FP8_COUNT_SATURATED; i < FP8_COUNTS; i++)
        for (int c = 0; c < FP8_CLASSES; c++)
            if (fp8_class_counts(counts, c)[i])
                fprintf(f, ", %s %s %.3g%%", FP8_COUNT_KEYS[i], FP8_CLASS_KEYS[c], 100 * fp8_share(counts, c, i));
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
    char elapsed[32], eta[32];
    fprintf(f, " | lr %.2e | gnorm %.3f", r->lr, r->grad_norm);
    if (r->fp8) fp8_print(r->fp8, f);
    if (r->clocks && r->clocks->samples)
        fprintf(f, " | %.0f MHz %.0f W%s", r->clocks->sm_mhz_median, r->clocks->power_w_mean,
                r->clocks->power_capped_share >= 0.5 ? " (power limit)" : "");
    fprintf(f, " | %s tok/s | %s elapsed, ETA %s\n", tps, moe_fmt_duration(elapsed, sizeof elapsed, r->elapsed_s),
            moe_fmt_duration(eta, sizeof eta, r->eta_s));
    fflush(f);
}

// A JSON number, or null for NaN and infinities (JSON has no spelling for them).
static json_t *json_number(double v) { return isfinite(v) ? json_real(v) : json_null(); }

static void set_numbers(json_t *o, const char *const *keys, const double *values, size_t n) {
    for (size_t i = 0; i < n; i++) json_object_set_new(o, keys[i], json_number(values[i]));
}

static json_t *layer_to_json(const LayerLoad *L, int index, int E) {
    static const char *const KEYS[] = {"imbalance", "min_over_mean", "drop_rate", "lb_loss", "z_loss"};
    const double values[] = {L->imbalance, L->min_over_mean, L->drop_rate, L->lb, L->z};
    json_t *o = json_object(), *load = json_array();
    for (int e = 0; e < E; e++) json_array_append_new(load, json_number(L->load[e]));
    json_object_set_new(o, "moe_layer", json_integer(index));
    json_object_set_new(o, "load", load);
    set_numbers(o, KEYS, values, sizeof values / sizeof values[0]);
    return o;
}

// {class: {"values": count, "flushed": share, "saturated": share, "nan": share}}
static json_t *fp8_to_json(const uint64_t *counts) {
    json_t *o = json_object();
    for (int c = 0; c < FP8_CLASSES; c++) {
        json_t *k = json_object();
        json_object_set_new(k, FP8_COUNT_KEYS[FP8_COUNT_VALUES],
                            json_integer((json_int_t)fp8_class_counts(counts, c)[FP8_COUNT_VALUES]));
        for (int i = FP8_COUNT_FLUSHED; i < FP8_COUNTS; i++)
            json_object_set_new(k, FP8_COUNT_KEYS[i], json_number(fp8_share(counts, c, i)));
        json_object_set_new(o, FP8_CLASS_KEYS[c], k);
    }
    return o;
}

json_t *report_to_json(const StepReport *r) {
    static const char *const KEYS[] = {"loss", "ce", "lb_loss", "z_loss", "lm_z_loss", "lr", "grad_norm",
                                       "tokens", "tokens_per_sec", "elapsed_s", "pipeline_wait"};
    const double values[] = {r->loss, r->ce, r->lb, r->z, r->lm_z, r->lr, r->grad_norm,
                             r->tokens, r->tokens_per_sec, r->elapsed_s, r->pipeline_wait};
    json_t *o = json_object(), *layers = json_array();
    json_object_set_new(o, "step", json_integer(r->step));
    set_numbers(o, KEYS, values, sizeof values / sizeof values[0]);
    for (int i = 0; i < r->n_moe; i++) json_array_append_new(layers, layer_to_json(&r->layers[i], i, r->E));
    json_object_set_new(o, "moe_layers", layers);
    if (r->fp8) json_object_set_new(o, "fp8", fp8_to_json(r->fp8));
    if (r->clocks && r->clocks->samples) {
        static const char *const DEV[] = {"sm_mhz", "power_w", "power_capped", "thermal"};
        const double dev[] = {r->clocks->sm_mhz_median, r->clocks->power_w_mean, r->clocks->power_capped_share,
                              r->clocks->thermal_share};
        json_t *d = json_object();
        set_numbers(d, DEV, dev, sizeof dev / sizeof dev[0]);
        json_object_set_new(o, "device", d);
    }
    return o;
}

json_t *metrics_val_record(int64_t step, double loss, size_t sequences) {
    json_t *o = json_object();
    json_object_set_new(o, "step", json_integer(step));
    json_object_set_new(o, "val_loss", json_number(loss));
    json_object_set_new(o, "val_sequences", json_integer((json_int_t)sequences));
    return o;
}

// ---------------------------------------------------------------- metrics.jsonl

// Follows the run's validation losses (for the summary at its end).
static void log_note(MetricsLog *log, const json_t *record) {
    json_t *v = json_object_get(record, "val_loss"), *s = json_object_get(record, "step");
    if (!json_is_number(v) || !json_is_integer(s)) return;
    log->last_val = json_number_value(v);
    log->last_val_step = json_integer_value(s);
    if (log->best_val_step < 0 || log->last_val < log->best_val)
        log->best_val = log->last_val, log->best_val_step = log->last_val_step;
}

// A record a resumed run keeps (and notes): a whole line (ended by its newline) holding a JSON
// object of a step not after the checkpoint's.
static bool log_line_kept(MetricsLog *log, const char *line, size_t n, int64_t step) {
    if (line[n - 1] != '\n') return false;
    json_t *o = json_loadb(line, n, 0, NULL), *s = json_object_get(o, "step");
    bool kept = json_is_integer(s) && json_integer_value(s) <= step;
    if (kept) log_note(log, o);
    json_decref(o);
    return kept;
}

// Cuts the log after its last record kept (records are in step order); counts the lines dropped.
static int log_truncate(MetricsLog *log, int64_t step, MoeErr err) {
    char *line = NULL;
    size_t cap = 0, at = 0, keep = 0;
    ssize_t n;
    rewind(log->file);
    while ((n = getline(&line, &cap, log->file)) > 0) {
        if (!log->dropped && log_line_kept(log, line, (size_t)n, step)) keep = at + (size_t)n;
        else log->dropped++;
        at += (size_t)n;
    }
    free(line);
    if (ferror(log->file) || ftruncate(fileno(log->file), (off_t)keep) || fseek(log->file, 0, SEEK_END))
        return moe_err(err, "%s: cannot repair the metrics log for the resume (%s)", log->path, strerror(errno));
    return 0;
}

int metrics_log_open(MetricsLog *log, const char *run_dir, bool resume, int64_t step, MoeErr err) {
    memset(log, 0, sizeof *log);
    log->best_val_step = log->last_val_step = -1;
    snprintf(log->path, sizeof log->path, "%s/metrics.jsonl", run_dir);
    log->file = fopen(log->path, resume ? "a+" : "w");
    if (!log->file) return moe_err(err, "%s: cannot write the metrics log (%s)", log->path, strerror(errno));
    if (resume && log_truncate(log, step, err)) return metrics_log_close(log), -1;
    return 0;
}

int metrics_log_write(MetricsLog *log, json_t *record, MoeErr err) {
    errno = 0;
    bool bad = json_dumpf(record, log->file, JSON_COMPACT | JSON_REAL_PRECISION(9)) != 0;
    bad |= fputc('\n', log->file) == EOF;
    bad |= fflush(log->file) != 0;
    log_note(log, record);
    json_decref(record);
    if (bad)
        return moe_err(err, "%s: cannot write the metrics log (%s%s)", log->path, strerror(errno),
                       errno == ENOSPC || errno == EFBIG ? ": the disk is full or the file size limit reached" : "");
    return 0;
}

void metrics_log_close(MetricsLog *log) {
    if (log->file) fclose(log->file);
    log->file = NULL;
}

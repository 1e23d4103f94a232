// Reads a run's metrics.jsonl back into series for its pictures (see history.h).
#include "history.h"

#include <jansson.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "io/fsutil.h"
#include "ops/fp8.h"
#include "train/metrics.h"

_Static_assert(HIST_FP8_SATURATED - HIST_FP8_FLUSHED == FP8_CLASSES, "a series per FP8 tensor class");

// The keys of the series read as they are (HIST_IMBALANCE comes from the layers).
static const char *const SERIES_KEYS[HIST_IMBALANCE] = {"ce", "lr", "grad_norm", "tokens", "tokens_per_sec"};

static double number_or_nan(const json_t *v) { return json_is_number(v) ? json_number_value(v) : NAN; }

// The first index of the ascending steps[0, n) at or after `step`.
static size_t lower_bound(const double *steps, size_t n, double step) {
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (steps[mid] < step) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

// A step record at or before the last one: the log starts again at that step.
static void rewind_steps(RunHistory *h, double step) {
    h->n = lower_bound(h->step, h->n, step);
    while (h->n_rows && h->row[h->n_rows - 1] >= h->n) h->n_rows--;
    h->n_val = lower_bound(h->val_step, h->n_val, step);
}

static void reserve_steps(RunHistory *h) {
    if (h->n < h->cap) return;
    h->cap = h->cap ? 2 * h->cap : 1024;
    h->step = moe_realloc(h->step, h->cap * sizeof(double));
    for (int s = 0; s < HIST_SERIES; s++) h->v[s] = moe_realloc(h->v[s], h->cap * sizeof(double));
}

static size_t layer_values(const RunHistory *h) { return (size_t)h->n_moe * (size_t)h->E; }

static void copy_row(RunHistory *h, size_t to, size_t from) {
    size_t per = layer_values(h), L = (size_t)h->n_moe;
    h->row[to] = h->row[from];
    memmove(h->share + to * per, h->share + from * per, per * sizeof(float));
    memmove(h->row_max + to * L, h->row_max + from * L, L * sizeof(float));
    memmove(h->row_min + to * L, h->row_min + from * L, L * sizeof(float));
}

// Past HIST_MAX_ROWS rows, every other one goes and the stride doubles.
static void thin_rows(RunHistory *h) {
    size_t kept = 0;
    h->stride *= 2;
    for (size_t r = 0; r < h->n_rows; r++)
        if (h->row[r] % h->stride == 0) copy_row(h, kept++, r);
    h->n_rows = kept;
}

// Room for one more row of expert shares; false when step record `index` keeps none.
static bool reserve_row(RunHistory *h, size_t index) {
    if (index % h->stride) return false;
    if (h->n_rows == HIST_MAX_ROWS) thin_rows(h);
    if (index % h->stride) return false;
    if (h->n_rows < h->rows_cap) return true;
    size_t L = (size_t)h->n_moe;
    h->rows_cap = h->rows_cap ? 2 * h->rows_cap : 64;
    h->row = moe_realloc(h->row, h->rows_cap * sizeof(size_t));
    h->share = moe_realloc(h->share, h->rows_cap * layer_values(h) * sizeof(float));
    h->row_max = moe_realloc(h->row_max, h->rows_cap * L * sizeof(float));
    h->row_min = moe_realloc(h->row_min, h->rows_cap * L * sizeof(float));
    return true;
}

// One layer's loads as shares of its routed slots (NaN when it routed none).
static void layer_shares(const json_t *load, size_t E, float *share) {
    double total = 0;
    for (size_t e = 0; e < E; e++) total += fmax(0, number_or_nan(json_array_get(load, e)));
    for (size_t e = 0; e < E; e++) share[e] = (float)(number_or_nan(json_array_get(load, e)) / total);
}

// The shape of a record's expert loads must be the run's: the first record with loads sets it.
static int check_layers(RunHistory *h, const json_t *layers, const char *where, MoeErr err) {
    size_t L = json_array_size(layers), E = json_array_size(json_object_get(json_array_get(layers, 0), "load"));
    if (!h->n_moe) h->n_moe = (int)L, h->E = (int)E;
    for (size_t l = 0; l < L; l++)
        if (json_array_size(json_object_get(json_array_get(layers, l), "load")) != E) E = 0;
    if (L == (size_t)h->n_moe && E == (size_t)h->E && E) return 0;
    return moe_err(err, "%s: the record's \"moe_layers\" are %zu layers of %zu expert loads, but the first "
                   "record with loads has %d layers of %d (is this one run's log?)", where, L, E, h->n_moe, h->E);
}

// The expert loads of step record `index`: its worst layer's max/mean load, and a row of shares
// when the record is one that keeps them.
static int read_layers(RunHistory *h, const json_t *layers, size_t index, const char *where, MoeErr err) {
    h->v[HIST_IMBALANCE][index] = NAN;
    if (!json_array_size(layers)) return 0; // no MoE layer (or a record without loads)
    if (check_layers(h, layers, where, err)) return -1;
    bool keep = reserve_row(h, index);
    size_t L = (size_t)h->n_moe, r = h->n_rows;
    for (size_t l = 0; l < L; l++) {
        const json_t *layer = json_array_get(layers, l);
        double max = number_or_nan(json_object_get(layer, "imbalance"));
        if (!(h->v[HIST_IMBALANCE][index] >= max)) h->v[HIST_IMBALANCE][index] = max;
        if (!keep) continue;
        layer_shares(json_object_get(layer, "load"), (size_t)h->E, h->share + (r * L + l) * (size_t)h->E);
        h->row_max[r * L + l] = (float)max;
        h->row_min[r * L + l] = (float)number_or_nan(json_object_get(layer, "min_over_mean"));
    }
    if (keep) h->row[h->n_rows++] = index;
    return 0;
}

// The FP8 counters of step record `index` (its "fp8" object; NaN without one): each class's
// flushed and saturated shares, in percent.
static void read_fp8(RunHistory *h, const json_t *fp8, size_t index) {
    for (int c = 0; c < FP8_CLASSES; c++) {
        const json_t *k = json_object_get(fp8, report_fp8_class_key(c));
        h->v[HIST_FP8_FLUSHED + c][index] = 100 * number_or_nan(json_object_get(k, report_fp8_count_key(FP8_COUNT_FLUSHED)));
        h->v[HIST_FP8_SATURATED + c][index] =
            100 * number_or_nan(json_object_get(k, report_fp8_count_key(FP8_COUNT_SATURATED)));
    }
}

static int add_step(RunHistory *h, const json_t *o, double step, const char *where, MoeErr err) {
    if (h->n && step <= h->step[h->n - 1]) rewind_steps(h, step);
    reserve_steps(h);
    h->step[h->n] = step;
    for (int s = 0; s < HIST_IMBALANCE; s++) h->v[s][h->n] = number_or_nan(json_object_get(o, SERIES_KEYS[s]));
    read_fp8(h, json_object_get(o, "fp8"), h->n);
    if (read_layers(h, json_object_get(o, "moe_layers"), h->n, where, err)) return -1;
    h->n++;
    return 0;
}

static void add_val(RunHistory *h, const json_t *o, double step) {
    if (h->n_val && step <= h->val_step[h->n_val - 1]) h->n_val = lower_bound(h->val_step, h->n_val, step);
    if (h->n_val == h->val_cap) {
        h->val_cap = h->val_cap ? 2 * h->val_cap : 64;
        h->val_step = moe_realloc(h->val_step, h->val_cap * sizeof(double));
        h->val_loss = moe_realloc(h->val_loss, h->val_cap * sizeof(double));
    }
    h->val_step[h->n_val] = step;
    h->val_loss[h->n_val++] = number_or_nan(json_object_get(o, "val_loss"));
}

static int read_line(RunHistory *h, const char *line, size_t len, const char *path, size_t number, MoeErr err) {
    char where[4300];
    snprintf(where, sizeof where, "%s:%zu", path, number);
    if (strspn(line, " \t\r\n") == len) return 0;
    json_error_t je;
    json_t *o = json_loadb(line, len, 0, &je);
    if (!o && line[len - 1] != '\n') { // getline's last line: cut short by a crash or a full disk
        fprintf(stderr, "warning: %s: the last line is cut short (a run stopped mid-write?); left out\n", where);
        return 0;
    }
    json_t *step = json_object_get(o, "step");
    int rc = 0;
    if (!json_is_object(o)) rc = moe_err(err, "%s: not a JSON record (%s)", where, o ? "not an object" : je.text);
    else if (!json_is_integer(step)) rc = moe_err(err, "%s: the record has no integer \"step\"", where);
    else if (json_object_get(o, "val_loss")) add_val(h, o, (double)json_integer_value(step));
    else rc = add_step(h, o, (double)json_integer_value(step), where, err);
    json_decref(o);
    return rc;
}

int history_read(RunHistory *h, const char *path, MoeErr err) {
    memset(h, 0, sizeof *h);
    h->stride = 1;
    FILE *f = fs_fopen_regular(path, "metrics log", err);
    if (!f) return -1;
    char *line = NULL;
    size_t cap = 0, number = 0;
    ssize_t len;
    int rc = 0;
    while (!rc && (len = getline(&line, &cap, f)) > 0) rc = read_line(h, line, (size_t)len, path, ++number, err);
    if (!rc && ferror(f)) rc = moe_err(err, "%s: cannot read the metrics log", path);
    if (!rc && !h->n)
        rc = moe_err(err, "%s: no training step recorded (%s): nothing to plot", path,
                     number ? "only validation records" : "the file is empty");
    free(line);
    fclose(f);
    if (rc) history_free(h);
    return rc;
}

void history_free(RunHistory *h) {
    free(h->step);
    for (int s = 0; s < HIST_SERIES; s++) free(h->v[s]);
    free(h->row), free(h->share), free(h->row_max), free(h->row_min);
    free(h->val_step), free(h->val_loss);
    memset(h, 0, sizeof *h);
}

void history_fill_tokens(RunHistory *h, double tokens_per_step) {
    for (size_t i = 0; i < h->n; i++)
        if (isnan(h->v[HIST_TOKENS][i])) h->v[HIST_TOKENS][i] = h->step[i] * tokens_per_step;
}

void history_window_mean(const double *y, size_t n, size_t before, size_t after, double *out) {
    double *sum = moe_calloc(n + 1, sizeof(double)), *count = moe_calloc(n + 1, sizeof(double));
    for (size_t i = 0; i < n; i++) {
        bool ok = isfinite(y[i]);
        sum[i + 1] = sum[i] + (ok ? y[i] : 0);
        count[i + 1] = count[i] + ok;
    }
    for (size_t i = 0; i < n; i++) {
        size_t lo = i > before ? i - before : 0, hi = i + after + 1 < n ? i + after + 1 : n;
        double c = count[hi] - count[lo];
        out[i] = c > 0 && isfinite(y[i]) ? (sum[hi] - sum[lo]) / c : NAN;
    }
    free(sum);
    free(count);
}

void history_loss_gap(const RunHistory *h, const RunHistory *ref, size_t window, double *out) {
    double *mh = moe_malloc((h->n + 1) * sizeof(double)), *mr = moe_malloc((ref->n + 1) * sizeof(double));
    history_window_mean(h->v[HIST_CE], h->n, window - 1, 0, mh);
    history_window_mean(ref->v[HIST_CE], ref->n, window - 1, 0, mr);
    for (size_t i = 0; i < h->n; i++) {
        size_t j = lower_bound(ref->step, ref->n, h->step[i]);
        out[i] = j < ref->n && ref->step[j] == h->step[i] ? 100 * (mh[i] - mr[j]) / mr[j] : NAN;
    }
    free(mh);
    free(mr);
}

double history_tokens_at(const RunHistory *h, double step) {
    size_t i = lower_bound(h->step, h->n, step);
    return i < h->n && h->step[i] == step ? h->v[HIST_TOKENS][i] : NAN;
}

// Axis ranges, nice tick values and tick labels for the pictures of a run (see ticks.h).
#include "ticks.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

PlotRange plot_range_empty(void) { return (PlotRange){INFINITY, -INFINITY}; }

bool plot_range_is_empty(PlotRange r) { return !(r.lo <= r.hi); }

void plot_range_add(PlotRange *r, const double *v, size_t n, bool positive) {
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(v[i]) || (positive && v[i] <= 0)) continue;
        r->lo = fmin(r->lo, v[i]);
        r->hi = fmax(r->hi, v[i]);
    }
}

bool plot_range_wants_log(PlotRange r) { return !plot_range_is_empty(r) && r.lo > 0 && r.hi > 10 * r.lo; }

PlotRange plot_range_padded(PlotRange r, double pad, bool log) {
    if (plot_range_is_empty(r)) return log ? (PlotRange){1, 10} : (PlotRange){0, 1};
    if (log) {
        double a = log10(r.lo), b = log10(r.hi), m = b - a > 1e-9 ? (b - a) * pad : 0.3;
        return (PlotRange){pow(10, a - m), pow(10, b + m)};
    }
    double span = r.hi - r.lo, m = span * pad;
    if (!(span > 1e-12 * fmax(fabs(r.lo), fabs(r.hi)))) m = r.lo == 0 ? 1 : 0.1 * fabs(r.lo); // one value
    if (!isfinite(m)) m = 0; // a span past the largest double: shown as it is
    return (PlotRange){r.lo - m, r.hi + m};
}

// The smallest of 1, 2, 5 x 10^k that cuts `span` into at most about `target` steps.
static double nice_step(double span, int target) {
    static const double FACTORS[] = {1, 2, 5, 10};
    double raw = span / target, mag = pow(10, floor(log10(raw)));
    for (size_t i = 0; i < sizeof FACTORS / sizeof FACTORS[0]; i++)
        if (FACTORS[i] * mag >= raw * (1 - 1e-9)) return FACTORS[i] * mag;
    return 10 * mag;
}

// The next smaller of 1, 2, 5 x 10^k below `step` (one of them).
static double smaller_nice(double step) {
    double mag = pow(10, floor(log10(step) + 1e-9)), f = step / mag;
    return f > 4 ? 2 * mag : f > 1.5 ? mag : mag / 2;
}

// The multiples of step inside r.
static size_t ticks_every(PlotRange r, double step, double *ticks) {
    double first = ceil(r.lo / step - 1e-9);
    if (fabs(first) > 1e15) return 0; // ticks closer than the doubles there
    size_t n = 0;
    for (double k = first; n < PLOT_MAX_TICKS; k++) {
        double v = k * step;
        if (v > r.hi + step * 1e-9) break;
        ticks[n++] = fabs(v) < step * 1e-9 ? 0 : v;
    }
    return n;
}

// About `target` steps, but at least two ticks where a smaller nice step (not below min_step) gives
// them: a narrow axis otherwise may show one tick alone.
static size_t linear_ticks(PlotRange r, int target, double min_step, double *ticks) {
    double span = r.hi - r.lo;
    if (!(span > 0) || !isfinite(span)) return 0;
    double step = fmax(nice_step(span, target), min_step);
    size_t n = ticks_every(r, step, ticks);
    while (n < 2 && smaller_nice(step) >= min_step && smaller_nice(step) >= span / PLOT_MAX_TICKS)
        n = ticks_every(r, step = smaller_nice(step), ticks);
    return n;
}

static size_t log_ticks(PlotRange r, int target, double *ticks) {
    static const double SUB[] = {1, 2, 5};
    if (!(r.lo > 0 && r.hi > r.lo && isfinite(r.hi))) return 0;
    int d0 = (int)ceil(log10(r.lo) - 1e-9), d1 = (int)floor(log10(r.hi) + 1e-9);
    int decades = d1 - d0 + 1, every = (decades + target - 1) / target, subs = decades <= 2 ? 3 : 1;
    if (decades < 1) return linear_ticks(r, target, 0, ticks);
    size_t n = 0;
    for (int d = d0 - 1; d <= d1; d++) {
        for (int s = 0; s < subs && n < PLOT_MAX_TICKS; s++) {
            double v = SUB[s] * pow(10, d);
            bool shown = subs > 1 || (d % every + every) % every == 0;
            if (shown && v >= r.lo * (1 - 1e-9) && v <= r.hi * (1 + 1e-9)) ticks[n++] = v;
        }
    }
    return n;
}

size_t plot_ticks(PlotRange r, bool log, int target, double min_step, double *ticks) {
    return log ? log_ticks(r, target, ticks) : linear_ticks(r, target, min_step, ticks);
}

typedef enum { LABEL_PLAIN, LABEL_SI, LABEL_SCI } LabelStyle;

static LabelStyle label_style(const double *ticks, size_t n) {
    double big = 0, small = INFINITY;
    for (size_t i = 0; i < n; i++) {
        double a = fabs(ticks[i]);
        big = fmax(big, a);
        if (a > 0) small = fmin(small, a);
    }
    if (big == 0) return LABEL_PLAIN;
    if (big >= 1e4 && small >= 1 && big < 1e18) return LABEL_SI;
    return big >= 1e4 || big < 1e-2 || small < 1e-3 ? LABEL_SCI : LABEL_PLAIN;
}

// Digits after the point that show multiples of `spacing`.
static int decimals(double spacing) {
    if (!(spacing > 0) || !isfinite(spacing)) return 0;
    int d = (int)ceil(-log10(spacing) - 1e-9);
    return d < 0 ? 0 : d > 9 ? 9 : d;
}

// "%.*f" of v without trailing zeros ("1.50" -> "1.5", "2.0" -> "2").
static void format_fixed(char *buf, size_t len, double v, int digits) {
    snprintf(buf, len, "%.*f", digits, v);
    if (!strchr(buf, '.')) return;
    size_t n = strlen(buf);
    while (buf[n - 1] == '0') buf[--n] = 0;
    if (buf[n - 1] == '.') buf[--n] = 0;
    if (!strcmp(buf, "-0")) strcpy(buf, "0");
}

static void format_tick(char *buf, double v, double spacing, LabelStyle style) {
    static const char *const SI[] = {"", "k", "M", "G", "T", "P"};
    char number[PLOT_LABEL_LEN];
    int e = v == 0 ? 0 : (int)floor(log10(fabs(v)) + 1e-9);
    if (v == 0 || style == LABEL_PLAIN) {
        format_fixed(buf, PLOT_LABEL_LEN, v, decimals(spacing));
    } else if (style == LABEL_SI) {
        int k = e / 3 > 5 ? 5 : e / 3;
        double unit = pow(1000, k);
        format_fixed(number, sizeof number, v / unit, decimals(spacing / unit));
        snprintf(buf, PLOT_LABEL_LEN, "%s%s", number, SI[k]);
    } else {
        double unit = pow(10, e);
        int digits = decimals(spacing / unit);
        format_fixed(number, sizeof number, v / unit, digits > 3 ? 3 : digits);
        if (e) snprintf(buf, PLOT_LABEL_LEN, "%se%d", number, e);
        else snprintf(buf, PLOT_LABEL_LEN, "%s", number);
    }
}

void plot_tick_labels(const double *ticks, size_t n, bool log, char (*labels)[PLOT_LABEL_LEN]) {
    LabelStyle style = label_style(ticks, n);
    double spacing = n >= 2 ? ticks[1] - ticks[0] : n ? fabs(ticks[0]) : 1;
    for (size_t i = 0; i < n; i++) format_tick(labels[i], ticks[i], log ? fabs(ticks[i]) : spacing, style);
}

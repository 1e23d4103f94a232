// The pictures of runs (see figures.h): which panels each figure holds, where they go, and what is
// drawn in them from the runs' histories, with the primitives of plot.c.
#include "figures.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "plot/plot.h"
#include "train/metrics.h"

#define FIG_W FIGURE_WIDTH
#define TITLE_H 40
#define SMOOTH_MIN_STEPS 100 // shorter series are drawn as they are

static const PlotColor MUTED = {0.45, 0.45, 0.45};

typedef struct {
    const PlotRun *runs;
    size_t n;
} RunSet;

// A panel of one series of every run against the steps (or the tokens).
typedef struct {
    const char *title, *y_label;
    const char *missing;  // the note when no run recorded the series (NULL: "not recorded")
    HistSeries series;
    bool by_tokens;
    bool auto_log;  // a log axis when the values span more than a decade
    bool smooth;    // each step faint, a running mean over it
    bool val;       // the validation losses too
    bool legend;
} Panel;

// The x of each step record: its step, or the tokens through it.
static const double *xs_of(const RunHistory *h, bool by_tokens) { return by_tokens ? h->v[HIST_TOKENS] : h->step; }

// The x of each validation record (a new array).
static double *val_xs(const RunHistory *h, bool by_tokens) {
    double *x = moe_malloc((h->n_val + 1) * sizeof(double));
    for (size_t i = 0; i < h->n_val; i++) x[i] = by_tokens ? history_tokens_at(h, h->val_step[i]) : h->val_step[i];
    return x;
}

// What the panel shows of every run, and whether its y axis is logarithmic.
static PlotAxesSpec panel_spec(const RunSet *rs, const Panel *p, const char *x_label) {
    PlotRange x = plot_range_empty(), y = plot_range_empty(), positive = plot_range_empty();
    for (size_t r = 0; r < rs->n; r++) {
        const RunHistory *h = rs->runs[r].h;
        plot_range_add(&x, xs_of(h, p->by_tokens), h->n, false);
        for (int pos = 0; pos < 2; pos++) {
            PlotRange *to = pos ? &positive : &y;
            plot_range_add(to, h->v[p->series], h->n, pos);
            if (p->val) plot_range_add(to, h->val_loss, h->n_val, pos);
        }
    }
    bool log = p->auto_log && plot_range_wants_log(positive) && positive.lo == y.lo;
    return (PlotAxesSpec){.title = p->title, .x_label = x_label, .y_label = p->y_label, .log_y = log,
                          .x = plot_range_padded(x, 0.01, false), .y = plot_range_padded(log ? positive : y, 0.05, log)};
}

static void draw_run(const PlotAxes *a, const RunHistory *h, const Panel *p, PlotColor color) {
    const double *x = xs_of(h, p->by_tokens), *y = h->v[p->series];
    PlotStyle line = {.color = color, .width = 2, .alpha = 1};
    if (p->smooth && h->n >= SMOOTH_MIN_STEPS) {
        double *mean = moe_malloc(h->n * sizeof(double));
        history_window_mean(y, h->n, h->n / 100, h->n / 100, mean);
        PlotColor faint = {0.7 + 0.3 * color.r, 0.7 + 0.3 * color.g, 0.7 + 0.3 * color.b}; // opaque: smaller files
        plot_series(a, x, y, h->n, &(PlotStyle){.color = faint, .width = 1, .alpha = 1});
        plot_series(a, x, mean, h->n, &line);
        free(mean);
    } else {
        plot_series(a, x, y, h->n, &line);
    }
    if (!p->val) return;
    double *vx = val_xs(h, p->by_tokens);
    plot_series(a, vx, h->val_loss, h->n_val, &(PlotStyle){.color = color, .width = 2, .alpha = 1, .dashed = true, .dot = 3});
    free(vx);
}

static bool any_val(const RunSet *rs) {
    for (size_t r = 0; r < rs->n; r++)
        if (rs->runs[r].h->n_val) return true;
    return false;
}

// One run: what its lines are; several: which run each colour is (and that dashes are validation).
static void panel_legend(const PlotAxes *a, const RunSet *rs, const Panel *p) {
    PlotLegendEntry e[12];
    size_t n = 0;
    bool val = p->val && any_val(rs);
    if (rs->n == 1) {
        e[n++] = (PlotLegendEntry){p->val ? "training" : p->y_label, {.color = plot_palette(0), .width = 2, .alpha = 1}};
    } else {
        for (size_t r = 0; r < rs->n && n < 10; r++)
            e[n++] = (PlotLegendEntry){rs->runs[r].name, {.color = plot_palette(r), .width = 2, .alpha = 1}};
    }
    if (val) e[n++] = (PlotLegendEntry){"validation", {.color = rs->n == 1 ? plot_palette(0) : MUTED, .width = 2,
                                                        .alpha = 1, .dashed = true, .dot = 3}};
    if (rs->n > 1 || val) plot_legend(a, e, n);
}

static void draw_panel(cairo_t *cr, PlotBox box, const RunSet *rs, const Panel *p) {
    PlotAxesSpec spec = panel_spec(rs, p, p->by_tokens ? "tokens" : "step");
    char y_label[96];
    snprintf(y_label, sizeof y_label, "%s%s", p->y_label, spec.log_y ? " (log scale)" : "");
    spec.y_label = y_label;
    PlotAxes a = plot_axes(cr, box, &spec);
    bool any = false;
    for (size_t r = 0; r < rs->n; r++) {
        const RunHistory *h = rs->runs[r].h;
        draw_run(&a, h, p, plot_palette(r));
        PlotRange x = plot_range_empty(), y = plot_range_empty();
        plot_range_add(&x, xs_of(h, p->by_tokens), h->n, false);
        plot_range_add(&y, h->v[p->series], h->n, false);
        any |= !plot_range_is_empty(x) && !plot_range_is_empty(y);
    }
    if (!any) plot_note(&a, p->by_tokens ? "no token counts recorded" : p->missing ? p->missing : "not recorded");
    if (p->legend) panel_legend(&a, rs, p);
}

static void figure_title(cairo_t *cr, const RunSet *rs, const char *what) {
    char text[4400];
    if (rs->n == 1) snprintf(text, sizeof text, "%s: %s", what, rs->runs[0].name);
    else snprintf(text, sizeof text, "%s: %zu runs", what, rs->n);
    plot_title(cr, (PlotBox){0, 0, FIG_W, TITLE_H}, text);
}

// Panels in a grid of `cols` columns under the title.
static PlotBox grid_box(size_t i, size_t cols, size_t rows, double height) {
    double w = (FIG_W - 20) / (double)cols, h = (height - TITLE_H - 10) / (double)rows;
    return (PlotBox){10 + w * (double)(i % cols), TITLE_H + h * (double)(i / cols), w, h};
}

#define GAP_STEPS 20 // the training losses of several runs compared as means over this many steps

// Each later run's training cross-entropy against the first run's at the same steps, in percent of
// the first's, both as GAP_STEPS-step means (FP8 against bf16 from the same start, say).
static void draw_loss_gap(cairo_t *cr, PlotBox box, const RunSet *rs) {
    double **gap = moe_calloc(rs->n, sizeof *gap);
    PlotRange x = plot_range_empty(), y = plot_range_empty();
    plot_range_add(&y, (double[]){0}, 1, false); // the reference's own line
    for (size_t r = 1; r < rs->n; r++) {
        const RunHistory *h = rs->runs[r].h;
        gap[r] = moe_malloc((h->n + 1) * sizeof(double));
        history_loss_gap(h, rs->runs[0].h, GAP_STEPS, gap[r]);
        plot_range_add(&x, h->step, h->n, false);
        plot_range_add(&y, gap[r], h->n, false);
    }
    char title[160];
    snprintf(title, sizeof title, "training loss against %.80s's (%d-step means)", rs->runs[0].name, GAP_STEPS);
    PlotAxesSpec spec = {.title = title, .x_label = "step", .y_label = "difference (%)",
                         .x = plot_range_padded(x, 0.01, false), .y = plot_range_padded(y, 0.05, false)};
    PlotAxes a = plot_axes(cr, box, &spec);
    plot_hline(&a, 0, plot_palette(0));
    for (size_t r = 1; r < rs->n; r++) {
        plot_series(&a, rs->runs[r].h->step, gap[r], rs->runs[r].h->n,
                    &(PlotStyle){.color = plot_palette(r), .width = 2, .alpha = 1});
        free(gap[r]);
    }
    free(gap);
}

#define LOSS_H 480
#define LOSS_RUNS_H 800 // several runs: a row more, their differences from the first
static int loss_height(const RunSet *rs) { return rs->n > 1 ? LOSS_RUNS_H : LOSS_H; }

static void draw_loss(cairo_t *cr, void *ctx) {
    const RunSet *rs = ctx;
    Panel steps = {.title = "against steps", .y_label = "nats per token", .series = HIST_CE, .auto_log = true,
                   .smooth = true, .val = true, .legend = true};
    Panel tokens = steps;
    tokens.title = "against tokens", tokens.by_tokens = true, tokens.legend = false;
    size_t rows = rs->n > 1 ? 2 : 1;
    figure_title(cr, rs, "training and validation loss");
    draw_panel(cr, grid_box(0, 2, rows, loss_height(rs)), rs, &steps);
    draw_panel(cr, grid_box(1, 2, rows, loss_height(rs)), rs, &tokens);
    if (rs->n > 1) draw_loss_gap(cr, grid_box(1, 1, 2, loss_height(rs)), rs);
}

#define TRAINING_H 800
static void draw_training(cairo_t *cr, void *ctx) {
    const RunSet *rs = ctx;
    const Panel panels[] = {
        {.title = "learning rate", .y_label = "learning rate", .series = HIST_LR, .legend = rs->n > 1},
        {.title = "gradient norm (before clipping)", .y_label = "gradient norm", .series = HIST_GRAD_NORM,
         .auto_log = true, .smooth = true},
        {.title = "throughput", .y_label = "tokens/s", .series = HIST_TOKENS_PER_SEC, .smooth = true},
        {.title = "expert load, worst MoE layer", .y_label = "max/mean load", .series = HIST_IMBALANCE, .smooth = true,
         .missing = "no expert loads recorded (no MoE layer)"},
    };
    figure_title(cr, rs, "training");
    for (size_t i = 0; i < 4; i++) draw_panel(cr, grid_box(i, 2, 2, TRAINING_H), rs, &panels[i]);
}

// Whether any run recorded series s at some step.
static bool any_recorded(const RunSet *rs, HistSeries s) {
    for (size_t r = 0; r < rs->n; r++)
        for (size_t i = 0; i < rs->runs[r].h->n; i++)
            if (isfinite(rs->runs[r].h->v[s][i])) return true;
    return false;
}

#define FP8_H 640
// A row of panels per counter (flushed, saturated), a column per tensor class.
static void draw_fp8(cairo_t *cr, void *ctx) {
    const RunSet *rs = ctx;
    figure_title(cr, rs, "FP8 values flushed to zero and saturated");
    for (int row = 0; row < 2; row++)
        for (int c = 0; c < FP8_CLASSES; c++) {
            char title[64];
            snprintf(title, sizeof title, "%s %s", report_fp8_class_key(c), row ? "saturated" : "flushed to zero");
            Panel p = {.title = title, .y_label = "% of values", .auto_log = true, .smooth = true,
                       .series = (HistSeries)((row ? HIST_FP8_SATURATED : HIST_FP8_FLUSHED) + c),
                       .missing = "not recorded (no fp8 run)", .legend = row == 0 && c == 0};
            draw_panel(cr, grid_box((size_t)(row * FP8_CLASSES + c), FP8_CLASSES, 2, FP8_H), rs, &p);
        }
}

// ---------------------------------------------------------------- expert loads of one run

typedef struct {
    const PlotRun *run;
    double vmax;            // the top of the colour scale of every layer (percent)
    bool beyond;            // some cells are above it
    size_t cols;            // heatmap columns
    double row_h;
} ExpertFigure;

// The steps the heatmap spans: its columns split them evenly, and with a column per row each
// row's step is in the middle of its column.
static PlotRange heat_steps(const RunHistory *h, size_t cols) {
    double s0 = h->step[h->row[0]], s1 = h->step[h->row[h->n_rows - 1]];
    double half = cols > 1 ? (s1 - s0) / (2.0 * (double)(cols - 1)) : 0.5;
    return (PlotRange){s0 - half, s1 + half};
}

// Layer l's shares (percent) as cells (E, cols): each column the mean of the rows whose steps
// fall in it.
static double *expert_cells(const RunHistory *h, int l, size_t cols) {
    size_t E = (size_t)h->E, L = (size_t)h->n_moe;
    double *cells = moe_calloc(E * cols, sizeof(double)), *count = moe_calloc(cols, sizeof(double));
    PlotRange x = heat_steps(h, cols);
    for (size_t r = 0; r < h->n_rows; r++) {
        size_t c = (size_t)((h->step[h->row[r]] - x.lo) / (x.hi - x.lo) * (double)cols);
        c = c < cols ? c : cols - 1;
        count[c]++;
        for (size_t e = 0; e < E; e++) cells[e * cols + c] += 100.0 * h->share[(r * L + (size_t)l) * E + e];
    }
    for (size_t e = 0; e < E; e++)
        for (size_t c = 0; c < cols; c++) cells[e * cols + c] = count[c] ? cells[e * cols + c] / count[c] : NAN;
    free(count);
    return cells;
}

static int compare_doubles(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

// The top of a run's colour scale: the 99.5th percentile of all its layers' cells.
static void share_scale(ExpertFigure *f) {
    const RunHistory *h = f->run->h;
    size_t per = (size_t)h->E * f->cols, n = 0;
    double *all = moe_malloc(per * (size_t)h->n_moe * sizeof(double));
    for (int l = 0; l < h->n_moe; l++) {
        double *cells = expert_cells(h, l, f->cols);
        for (size_t i = 0; i < per; i++)
            if (isfinite(cells[i])) all[n++] = cells[i];
        free(cells);
    }
    qsort(all, n, sizeof(double), compare_doubles);
    f->vmax = n ? all[(size_t)((double)(n - 1) * 0.995)] : 0;
    f->beyond = n && all[n - 1] > f->vmax;
    f->vmax = f->vmax > 0 ? f->vmax : 1;
    free(all);
}

// One layer: the heatmap with its colour bar, and the max/mean and min/mean load beside it.
static void draw_layer(cairo_t *cr, const ExpertFigure *f, int l, PlotBox row) {
    const RunHistory *h = f->run->h;
    char title[96];
    snprintf(title, sizeof title, "MoE layer %d: share of routed tokens per expert", l);
    PlotAxesSpec heat = {.title = title, .x_label = "step", .y_label = "expert", .integer_y = true,
                         .x = heat_steps(h, f->cols), .y = {-0.5, h->E - 0.5}};
    PlotAxes a = plot_axes(cr, (PlotBox){row.x, row.y, row.w * 0.58, row.h}, &heat);
    double *cells = expert_cells(h, l, f->cols);
    plot_heatmap(&a, cells, (size_t)h->E, f->cols, f->vmax);
    free(cells);
    plot_colorbar(cr, (PlotBox){row.x + row.w * 0.58 + 6, row.y, 80, row.h}, f->vmax, f->beyond, "% of tokens",
                  100.0 / h->E, "1/E");
    double *x = moe_malloc(h->n_rows * 3 * sizeof(double)), *ymax = x + h->n_rows, *ymin = ymax + h->n_rows;
    for (size_t r = 0; r < h->n_rows; r++) {
        x[r] = h->step[h->row[r]];
        ymax[r] = h->row_max[r * (size_t)h->n_moe + (size_t)l];
        ymin[r] = h->row_min[r * (size_t)h->n_moe + (size_t)l];
    }
    PlotRange y = {0, 1};
    plot_range_add(&y, ymax, h->n_rows, false);
    PlotAxesSpec imb = {.title = "load against the mean", .x_label = "step", .y_label = "load / mean load",
                        .x = heat.x, .y = plot_range_padded(y, 0.05, false)};
    PlotAxes b = plot_axes(cr, (PlotBox){row.x + row.w * 0.58 + 92, row.y, row.w * 0.42 - 92, row.h}, &imb);
    plot_hline(&b, 1, MUTED);
    PlotLegendEntry e[2] = {{"max/mean", {.color = plot_palette(3), .width = 2, .alpha = 1}},
                            {"min/mean", {.color = plot_palette(0), .width = 2, .alpha = 1, .dashed = true}}};
    plot_series(&b, x, ymax, h->n_rows, &e[0].style);
    plot_series(&b, x, ymin, h->n_rows, &e[1].style);
    if (l == 0) plot_legend(&b, e, 2);
    free(x);
}

static void draw_experts(cairo_t *cr, void *ctx) {
    const ExpertFigure *f = ctx;
    RunSet one = {f->run, 1};
    figure_title(cr, &one, "expert load per MoE layer");
    for (int l = 0; l < f->run->h->n_moe; l++)
        draw_layer(cr, f, l, (PlotBox){10, TITLE_H + f->row_h * l, FIG_W - 20, f->row_h});
}

// ---------------------------------------------------------------- files

static double scale_of(const FigureOptions *o) { return (double)o->width / FIG_W; }

static int write_loss(const char *base, const FigureOptions *o, const void *ctx, MoeErr err) {
    return plot_write(base, o->svg, scale_of(o), FIG_W, loss_height(ctx), draw_loss, (void *)ctx, err);
}

static int write_training(const char *base, const FigureOptions *o, const void *ctx, MoeErr err) {
    return plot_write(base, o->svg, scale_of(o), FIG_W, TRAINING_H, draw_training, (void *)ctx, err);
}

static int write_fp8(const char *base, const FigureOptions *o, const void *ctx, MoeErr err) {
    return plot_write(base, o->svg, scale_of(o), FIG_W, FP8_H, draw_fp8, (void *)ctx, err);
}

static int write_experts(const char *base, const FigureOptions *o, const void *ctx, MoeErr err) {
    const RunHistory *h = ((const PlotRun *)ctx)->h;
    ExpertFigure f = {.run = ctx, .cols = h->n_rows < 320 ? h->n_rows : 320};
    double rows = 7000.0 / h->n_moe;
    f.row_h = rows < 170 ? 170 : rows > 250 ? 250 : rows;
    share_scale(&f);
    return plot_write(base, o->svg, scale_of(o), FIG_W, (int)(TITLE_H + f.row_h * h->n_moe + 10), draw_experts,
                      &f, err);
}

typedef int (*FigureWriter)(const char *base, const FigureOptions *o, const void *ctx, MoeErr err);

static int write_one(const FigureOptions *o, const char *name, FigureWriter write, const void *ctx, FILE *out,
                     MoeErr err) {
    char base[4300];
    snprintf(base, sizeof base, "%s/%s", o->out_dir, name);
    if (write(base, o, ctx, err)) return -1;
    fprintf(out, "wrote %s.png%s%s%s\n", base, o->svg ? " and " : "", o->svg ? base : "", o->svg ? ".svg" : "");
    return 0;
}

int figures_write(const PlotRun *runs, size_t n, const FigureOptions *opt, FILE *out, MoeErr err) {
    RunSet rs = {runs, n};
    if (write_one(opt, "loss", write_loss, &rs, out, err) || write_one(opt, "training", write_training, &rs, out, err))
        return -1;
    if (!any_recorded(&rs, HIST_FP8_FLUSHED)) fprintf(out, "no FP8 counters recorded (no fp8 run): no fp8.png\n");
    else if (write_one(opt, "fp8", write_fp8, &rs, out, err)) return -1;
    for (size_t r = 0; r < n; r++) {
        char name[32];
        if (n == 1) snprintf(name, sizeof name, "experts");
        else snprintf(name, sizeof name, "experts-%zu", r + 1);
        if (!runs[r].h->n_rows) fprintf(out, "%s: no expert loads recorded (no MoE layer): no %s.png\n", runs[r].name, name);
        else if (write_one(opt, name, write_experts, &runs[r], out, err)) return -1;
    }
    return 0;
}

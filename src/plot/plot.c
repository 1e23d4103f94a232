// Drawing primitives of the pictures of a run, on cairo (see plot.h): text, axes with nice ticks,
// lines, dots, legends, heatmaps with colour bars, and figures written to PNG and SVG files.
#include "plot.h"

#include <cairo-svg.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FONT "DejaVu Sans"
#define TICK_FONT 12.0
#define LABEL_FONT 13.0
#define TITLE_FONT 14.0

static const PlotColor INK = {0.15, 0.15, 0.15}, GRID = {0.9, 0.9, 0.9}, FRAME = {0.55, 0.55, 0.55};

PlotColor plot_palette(size_t i) {
    static const PlotColor COLORS[] = { // Tableau 10
        {0.122, 0.467, 0.706}, {1.000, 0.498, 0.055}, {0.173, 0.627, 0.173}, {0.839, 0.153, 0.157},
        {0.580, 0.404, 0.741}, {0.549, 0.337, 0.294}, {0.890, 0.467, 0.761}, {0.498, 0.498, 0.498},
        {0.737, 0.741, 0.133}, {0.090, 0.745, 0.812}};
    return COLORS[i % (sizeof COLORS / sizeof COLORS[0])];
}

static void set_color(cairo_t *cr, PlotColor c, double alpha) { cairo_set_source_rgba(cr, c.r, c.g, c.b, alpha); }

static void set_font(cairo_t *cr, double size, bool bold) {
    cairo_select_font_face(cr, FONT, CAIRO_FONT_SLANT_NORMAL, bold ? CAIRO_FONT_WEIGHT_BOLD : CAIRO_FONT_WEIGHT_NORMAL);
    cairo_set_font_size(cr, size);
}

static double text_width(cairo_t *cr, const char *s) {
    cairo_text_extents_t e;
    cairo_text_extents(cr, s, &e);
    return e.x_advance;
}

// Text in the current font, its box's point (ax, ay) at (x, y): (0, 0) top left, (0.5, 0.5) centre,
// (1, 1) bottom right. The box is the font's height (ascent to descent), whatever the letters.
static void text_at(cairo_t *cr, double x, double y, const char *s, double ax, double ay) {
    cairo_font_extents_t f;
    cairo_font_extents(cr, &f);
    set_color(cr, INK, 1);
    cairo_move_to(cr, x - text_width(cr, s) * ax, y - (f.ascent + f.descent) * ay + f.ascent);
    cairo_show_text(cr, s);
}

void plot_title(cairo_t *cr, PlotBox box, const char *text) {
    set_font(cr, TITLE_FONT + 3, true);
    text_at(cr, box.x + box.w / 2, box.y + 8, text, 0.5, 0);
}

// Pixels of a value, kept within what cairo's fixed-point coordinates hold (the area clips).
static double clamp_px(double v) { return v < -1e6 ? -1e6 : v > 1e6 ? 1e6 : v; }

static double map_x(const PlotAxes *a, double x) {
    return clamp_px(a->area.x + (x - a->x.lo) / (a->x.hi - a->x.lo) * a->area.w);
}

static double map_y(const PlotAxes *a, double y) {
    double v = a->log_y ? log10(y) : y;
    return clamp_px(a->area.y + a->area.h - (v - a->y.lo) / (a->y.hi - a->y.lo) * a->area.h);
}

static int tick_target(double pixels, double spacing) { return pixels / spacing < 2 ? 2 : (int)(pixels / spacing); }

// The ticks of one axis with their labels (in the tick font).
typedef struct {
    size_t n;
    double v[PLOT_MAX_TICKS];
    char label[PLOT_MAX_TICKS][PLOT_LABEL_LEN];
    double widest;
} AxisTicks;

static void axis_ticks(cairo_t *cr, AxisTicks *t, PlotRange r, bool log, double pixels, double spacing,
                       bool integer) {
    t->n = plot_ticks(r, log, tick_target(pixels, spacing), integer ? 1 : 0, t->v);
    plot_tick_labels(t->v, t->n, log, t->label);
    set_font(cr, TICK_FONT, false);
    t->widest = 0;
    for (size_t i = 0; i < t->n; i++) t->widest = fmax(t->widest, text_width(cr, t->label[i]));
}

static void line(cairo_t *cr, double x0, double y0, double x1, double y1) {
    cairo_move_to(cr, x0, y0);
    cairo_line_to(cr, x1, y1);
    cairo_stroke(cr);
}

static void draw_grid(const PlotAxes *a, const AxisTicks *xt, const AxisTicks *yt) {
    cairo_t *cr = a->cr;
    PlotBox b = a->area;
    cairo_set_line_width(cr, 1);
    set_color(cr, GRID, 1);
    for (size_t i = 0; i < xt->n; i++) line(cr, round(map_x(a, xt->v[i])) + 0.5, b.y, round(map_x(a, xt->v[i])) + 0.5, b.y + b.h);
    for (size_t i = 0; i < yt->n; i++) line(cr, b.x, round(map_y(a, yt->v[i])) + 0.5, b.x + b.w, round(map_y(a, yt->v[i])) + 0.5);
    set_color(cr, FRAME, 1);
    cairo_rectangle(cr, b.x + 0.5, b.y + 0.5, b.w - 1, b.h - 1);
    cairo_stroke(cr);
    set_font(cr, TICK_FONT, false);
    for (size_t i = 0; i < xt->n; i++) text_at(cr, map_x(a, xt->v[i]), b.y + b.h + 4, xt->label[i], 0.5, 0);
    for (size_t i = 0; i < yt->n; i++) text_at(cr, b.x - 5, map_y(a, yt->v[i]), yt->label[i], 1, 0.5);
}

static void draw_labels(const PlotAxes *a, PlotBox box, const PlotAxesSpec *spec) {
    cairo_t *cr = a->cr;
    set_font(cr, TITLE_FONT, true);
    if (spec->title) text_at(cr, a->area.x + a->area.w / 2, box.y + 4, spec->title, 0.5, 0);
    set_font(cr, LABEL_FONT, false);
    if (spec->x_label) text_at(cr, a->area.x + a->area.w / 2, box.y + box.h - 2, spec->x_label, 0.5, 1);
    if (!spec->y_label) return;
    cairo_save(cr);
    cairo_translate(cr, box.x + 2, a->area.y + a->area.h / 2);
    cairo_rotate(cr, -M_PI / 2);
    text_at(cr, 0, 0, spec->y_label, 0.5, 0);
    cairo_restore(cr);
}

PlotAxes plot_axes(cairo_t *cr, PlotBox box, const PlotAxesSpec *spec) {
    PlotAxes a = {.cr = cr, .x = spec->x, .log_y = spec->log_y, .y = spec->y};
    if (spec->log_y) a.y = (PlotRange){log10(spec->y.lo), log10(spec->y.hi)};
    AxisTicks xt, yt;
    double top = 26, bottom = 40, right = 14;
    axis_ticks(cr, &yt, spec->y, spec->log_y, box.h - top - bottom, 40, spec->integer_y);
    double left = yt.widest + 30;
    a.area = (PlotBox){box.x + left, box.y + top, box.w - left - right, box.h - top - bottom};
    axis_ticks(cr, &xt, spec->x, false, a.area.w, 110, true);
    draw_grid(&a, &xt, &yt);
    draw_labels(&a, box, spec);
    return a;
}

static bool shown(const PlotAxes *a, double x, double y) { return isfinite(x) && isfinite(y) && (!a->log_y || y > 0); }

// The points in pixels, those within one pixel column merged into their mean; NaN marks a gap.
// px and py hold 2n values.
static size_t pixel_points(const PlotAxes *a, const double *x, const double *y, size_t n, double *px, double *py) {
    size_t m = 0, k = 0;
    double sx = 0, sy = 0, column = NAN;
    for (size_t i = 0; i <= n; i++) {
        bool ok = i < n && shown(a, x[i], y[i]);
        double X = ok ? map_x(a, x[i]) : NAN;
        if (k && !(floor(X) == column)) px[m] = sx / k, py[m++] = sy / k, k = 0;
        if (!ok) {
            if (i < n && m && !isnan(px[m - 1])) px[m] = py[m] = NAN, m++;
            continue;
        }
        if (!k) column = floor(X), sx = sy = 0;
        sx += X, sy += map_y(a, y[i]), k++;
    }
    return m;
}

static void set_style(cairo_t *cr, const PlotStyle *s) {
    static const double DASH[] = {7, 4};
    set_color(cr, s->color, s->alpha);
    cairo_set_line_width(cr, s->width);
    cairo_set_dash(cr, DASH, s->dashed ? 2 : 0, 0);
    cairo_set_line_join(cr, CAIRO_LINE_JOIN_ROUND);
}

static void dot(cairo_t *cr, double x, double y, double r) {
    cairo_new_sub_path(cr);
    cairo_arc(cr, x, y, r, 0, 2 * M_PI);
    cairo_fill(cr);
}

void plot_series(const PlotAxes *a, const double *x, const double *y, size_t n, const PlotStyle *s) {
    cairo_t *cr = a->cr;
    double *px = moe_malloc((2 * n + 1) * sizeof(double)), *py = moe_malloc((2 * n + 1) * sizeof(double));
    size_t m = pixel_points(a, x, y, n, px, py), points = 0;
    cairo_save(cr);
    cairo_rectangle(cr, a->area.x, a->area.y, a->area.w, a->area.h);
    cairo_clip(cr);
    set_style(cr, s);
    for (size_t i = 0; i < m; i++) {
        if (isnan(px[i])) continue;
        points++;
        if (i == 0 || isnan(px[i - 1])) cairo_move_to(cr, px[i], py[i]);
        else cairo_line_to(cr, px[i], py[i]);
    }
    if (s->width > 0) cairo_stroke(cr);
    cairo_new_path(cr);
    double r = points == 1 ? fmax(s->dot, 3) : s->dot;
    for (size_t i = 0; i < m && r > 0; i++)
        if (!isnan(px[i])) dot(cr, px[i], py[i], r);
    cairo_restore(cr);
    free(px);
    free(py);
}

void plot_hline(const PlotAxes *a, double y, PlotColor color) {
    PlotStyle s = {.color = color, .width = 1, .alpha = 1, .dashed = true};
    double x[2] = {a->x.lo, a->x.hi}, v[2] = {y, y};
    plot_series(a, x, v, 2, &s);
}

void plot_note(const PlotAxes *a, const char *text) {
    set_font(a->cr, LABEL_FONT, false);
    text_at(a->cr, a->area.x + a->area.w / 2, a->area.y + a->area.h / 2, text, 0.5, 0.5);
}

void plot_legend(const PlotAxes *a, const PlotLegendEntry *entries, size_t n) {
    cairo_t *cr = a->cr;
    double wide = 0, row = 18, sample = 26;
    set_font(cr, TICK_FONT, false);
    for (size_t i = 0; i < n; i++) wide = fmax(wide, text_width(cr, entries[i].name));
    PlotBox b = {a->area.x + a->area.w - wide - sample - 24, a->area.y + 8, wide + sample + 16, row * (double)n + 8};
    cairo_rectangle(cr, b.x, b.y, b.w, b.h);
    cairo_set_source_rgba(cr, 1, 1, 1, 0.85);
    cairo_fill_preserve(cr);
    set_color(cr, FRAME, 1);
    cairo_set_line_width(cr, 1);
    cairo_stroke(cr);
    for (size_t i = 0; i < n; i++) {
        const PlotStyle *s = &entries[i].style;
        double y = b.y + 4 + row * ((double)i + 0.5), x = b.x + 6;
        set_style(cr, s);
        if (s->width > 0) line(cr, x, y, x + sample - 4, y);
        if (s->dot > 0) dot(cr, x + (sample - 4) / 2, y, s->dot);
        set_font(cr, TICK_FONT, false);
        text_at(cr, x + sample, y, entries[i].name, 0, 0.5);
    }
    cairo_set_dash(cr, NULL, 0, 0);
}

// Viridis (matplotlib's perceptually uniform map) at t in [0, 1], from nine of its colours.
static PlotColor viridis(double t) {
    static const PlotColor STOPS[] = {{0.267, 0.004, 0.329}, {0.282, 0.157, 0.471}, {0.243, 0.286, 0.537},
                                      {0.192, 0.408, 0.557}, {0.149, 0.510, 0.557}, {0.122, 0.620, 0.537},
                                      {0.208, 0.718, 0.475}, {0.431, 0.808, 0.345}, {0.992, 0.906, 0.145}};
    double u = (t < 0 ? 0 : t > 1 ? 1 : t) * 8;
    int i = u >= 8 ? 7 : (int)u;
    double f = u - i;
    const PlotColor *a = &STOPS[i], *b = &STOPS[i + 1];
    return (PlotColor){a->r + f * (b->r - a->r), a->g + f * (b->g - a->g), a->b + f * (b->b - a->b)};
}

static uint32_t pixel_of(PlotColor c) {
    return 0xff000000u | (uint32_t)(c.r * 255 + 0.5) << 16 | (uint32_t)(c.g * 255 + 0.5) << 8 | (uint32_t)(c.b * 255 + 0.5);
}

// cells as an image, one pixel per cell, row 0 at the bottom.
static cairo_surface_t *heatmap_image(const double *cells, size_t rows, size_t cols, double vmax) {
    cairo_surface_t *img = cairo_image_surface_create(CAIRO_FORMAT_RGB24, (int)cols, (int)rows);
    unsigned char *data = cairo_image_surface_get_data(img);
    int stride = cairo_image_surface_get_stride(img);
    cairo_surface_flush(img);
    for (size_t r = 0; r < rows && data; r++) {
        uint32_t *px = (uint32_t *)(data + (size_t)stride * (rows - 1 - r));
        for (size_t c = 0; c < cols; c++) {
            double v = cells[r * cols + c];
            px[c] = isnan(v) ? pixel_of(GRID) : pixel_of(viridis(vmax > 0 ? v / vmax : 0));
        }
    }
    cairo_surface_mark_dirty(img);
    return img;
}

// An image stretched over a box, its pixels kept sharp.
static void paint_image(cairo_t *cr, cairo_surface_t *img, PlotBox box) {
    cairo_save(cr);
    cairo_rectangle(cr, box.x, box.y, box.w, box.h);
    cairo_clip(cr);
    cairo_translate(cr, box.x, box.y);
    cairo_scale(cr, box.w / cairo_image_surface_get_width(img), box.h / cairo_image_surface_get_height(img));
    cairo_set_source_surface(cr, img, 0, 0);
    cairo_pattern_set_filter(cairo_get_source(cr), CAIRO_FILTER_NEAREST);
    cairo_paint(cr);
    cairo_restore(cr);
}

void plot_heatmap(const PlotAxes *a, const double *cells, size_t rows, size_t cols, double vmax) {
    if (!rows || !cols) return;
    cairo_surface_t *img = heatmap_image(cells, rows, cols, vmax);
    double top = map_y(a, (double)rows - 0.5), bottom = map_y(a, -0.5);
    paint_image(a->cr, img, (PlotBox){a->area.x, top, a->area.w, bottom - top});
    cairo_surface_destroy(img);
    set_color(a->cr, FRAME, 1);
    cairo_set_line_width(a->cr, 1);
    cairo_rectangle(a->cr, a->area.x + 0.5, a->area.y + 0.5, a->area.w - 1, a->area.h - 1);
    cairo_stroke(a->cr);
}

void plot_colorbar(cairo_t *cr, PlotBox box, double vmax, bool beyond, const char *label, double mark,
                   const char *mark_label) {
    enum { STEPS = 256 };
    double ramp[STEPS];
    for (int i = 0; i < STEPS; i++) ramp[i] = vmax * (i + 0.5) / STEPS;
    PlotBox bar = {box.x, box.y + 36, 14, box.h - 36 - 40};
    cairo_surface_t *img = heatmap_image(ramp, STEPS, 1, vmax);
    paint_image(cr, img, bar);
    cairo_surface_destroy(img);
    if (beyond) {
        set_color(cr, viridis(1), 1);
        cairo_move_to(cr, bar.x, bar.y);
        cairo_line_to(cr, bar.x + bar.w / 2, bar.y - 10);
        cairo_line_to(cr, bar.x + bar.w, bar.y);
        cairo_fill(cr);
    }
    PlotAxes a = {.cr = cr, .area = bar, .x = {0, 1}, .y = {0, vmax > 0 ? vmax : 1}};
    AxisTicks t;
    axis_ticks(cr, &t, a.y, false, bar.h, 30, false);
    for (size_t i = 0; i < t.n; i++)
        if (!(fabs(map_y(&a, t.v[i]) - map_y(&a, mark)) < 16)) text_at(cr, bar.x + bar.w + 4, map_y(&a, t.v[i]), t.label[i], 0, 0.5);
    set_font(cr, TICK_FONT, true);
    if (!isnan(mark) && mark <= a.y.hi) {
        set_color(cr, INK, 1);
        cairo_set_line_width(cr, 2);
        line(cr, bar.x - 3, map_y(&a, mark), bar.x + bar.w + 3, map_y(&a, mark));
        text_at(cr, bar.x + bar.w + 4, map_y(&a, mark), mark_label, 0, 0.5);
    }
    set_font(cr, LABEL_FONT, false);
    text_at(cr, bar.x - 4, box.y + box.h - 2, label, 0, 1);
}

static int render(cairo_surface_t *s, double scale, const char *path, bool png, PlotDraw draw, void *ctx,
                  MoeErr err) {
    cairo_t *cr = cairo_create(s);
    cairo_set_source_rgb(cr, 1, 1, 1);
    cairo_paint(cr);
    cairo_scale(cr, scale, scale);
    draw(cr, ctx);
    cairo_status_t st = cairo_status(cr);
    cairo_destroy(cr);
    if (!st && png) st = cairo_surface_write_to_png(s, path);
    cairo_surface_finish(s);
    if (!st) st = cairo_surface_status(s);
    cairo_surface_destroy(s);
    if (st) return moe_err(err, "%s: cannot write the picture (%s)", path, cairo_status_to_string(st));
    return 0;
}

int plot_write(const char *base, bool svg, double scale, int width, int height, PlotDraw draw, void *ctx,
               MoeErr err) {
    char path[4200];
    int w = (int)(width * scale + 0.5), h = (int)(height * scale + 0.5);
    snprintf(path, sizeof path, "%s.png", base);
    if (render(cairo_image_surface_create(CAIRO_FORMAT_RGB24, w, h), scale, path, true, draw, ctx, err)) return -1;
    if (!svg) return 0;
    snprintf(path, sizeof path, "%s.svg", base);
    return render(cairo_svg_surface_create(path, w, h), scale, path, false, draw, ctx, err);
}

// Drawing primitives of the pictures of a run (`moe plot`), on cairo: a figure written as PNG (and
// SVG), panels with framed axes at nice ticks (linear or log), lines with gaps where a value is
// missing, dots, a legend, and a heatmap with its colour bar. Sizes are in pixels of the PNG.
#pragma once
#include <cairo.h>
#include <stdbool.h>

#include "common/util.h"
#include "plot/ticks.h"

typedef struct {
    double r, g, b;
} PlotColor;

typedef struct {
    double x, y, w, h;
} PlotBox;

typedef struct {
    PlotColor color;
    double width;  // of the line (0: none)
    double alpha;  // 1: opaque
    bool dashed;
    double dot;    // radius of a dot at each point (0: none; a lone point always gets one)
} PlotStyle;

typedef struct {
    const char *title, *x_label, *y_label;
    PlotRange x, y;  // shown as they are (pad them first: plot_range_padded); x ticks at whole
                     // numbers (steps, tokens)
    bool log_y;
    bool integer_y;  // ticks at whole numbers only (expert indices)
} PlotAxesSpec;

typedef struct {
    cairo_t *cr;
    PlotBox area;    // the data area
    PlotRange x, y;  // its ranges (y in decades on a log axis)
    bool log_y;
} PlotAxes;

typedef struct {
    const char *name;
    PlotStyle style;
} PlotLegendEntry;

// Draws one figure (a callback: the same drawing goes to the PNG and the SVG surface).
typedef void (*PlotDraw)(cairo_t *cr, void *ctx);

// The i-th of ten distinct colours (for runs and series), cycling.
PlotColor plot_palette(size_t i);
// The figure's title, centred at the top of `box`.
void plot_title(cairo_t *cr, PlotBox box, const char *text);
// A panel in `box`: title, axis labels and tick labels inside it, a framed data area with a grid
// at the ticks. Returns the axes that the series are drawn on.
PlotAxes plot_axes(cairo_t *cr, PlotBox box, const PlotAxesSpec *spec);
// y against x; a NaN or (on a log axis) a value <= 0 breaks the line. Points closer than a pixel
// apart along x are drawn as their mean.
void plot_series(const PlotAxes *a, const double *x, const double *y, size_t n, const PlotStyle *s);
// A horizontal reference line at y.
void plot_hline(const PlotAxes *a, double y, PlotColor color);
// A note in the middle of the data area ("no validation records").
void plot_note(const PlotAxes *a, const char *text);
// A legend box in the data area's top right corner.
void plot_legend(const PlotAxes *a, const PlotLegendEntry *entries, size_t n);
// cells (rows, cols): row r spans y in [r - 0.5, r + 0.5], the columns split the x range evenly;
// values from 0 to vmax through the viridis colours (larger ones in the top colour), NaN in grey.
void plot_heatmap(const PlotAxes *a, const double *cells, size_t rows, size_t cols, double vmax);
// A vertical colour bar in `box` for values 0..vmax, ticked and labelled, with a marked value
// (`mark` with `mark_label`, e.g. the uniform share 1/E; NaN: none); with `beyond`, a triangle on
// top says that larger values exist (drawn in the top colour).
void plot_colorbar(cairo_t *cr, PlotBox box, double vmax, bool beyond, const char *label, double mark,
                   const char *mark_label);
// Draws a figure laid out in width x height pixels into `base`.png, `scale` times that size, and
// with `svg` also `base`.svg. -1 with a message naming the file when it cannot be written.
int plot_write(const char *base, bool svg, double scale, int width, int height, PlotDraw draw, void *ctx,
               MoeErr err);

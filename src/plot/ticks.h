// Axis arithmetic of the pictures of a run (`moe plot`): data ranges, "nice" tick values (1, 2 or
// 5 x 10^k apart; decades on a log axis) and their labels ("0.5", "250", "1.5k", "2M", "3e-4").
// No drawing here (plot.c draws), so the unit tests check it without cairo.
#pragma once
#include <stdbool.h>
#include <stddef.h>

typedef struct {
    double lo, hi; // empty while lo > hi
} PlotRange;

#define PLOT_MAX_TICKS 24
#define PLOT_LABEL_LEN 24

PlotRange plot_range_empty(void);
bool plot_range_is_empty(PlotRange r);
// Widens r to the finite values of v (with `positive`, only those > 0: what a log axis can show).
void plot_range_add(PlotRange *r, const double *v, size_t n, bool positive);
// A range of positive values spanning more than a decade: shown on a log axis.
bool plot_range_wants_log(PlotRange r);
// The range an axis shows: r widened by `pad` times its span on each side (on a log axis, of its
// span in decades). A range of one value becomes a small one around it, an empty one [0, 1] (on
// a log axis [1, 10]).
PlotRange plot_range_padded(PlotRange r, double pad, bool log);
// Tick values inside r, about `target` of them (at most PLOT_MAX_TICKS; on a linear axis at least
// two where a nice step allows), at least `min_step` apart on a linear axis (1: whole numbers); on a log axis powers of ten (every k-th decade when
// there are many, with 2 and 5 between them when there are only one or two). Returns the count.
size_t plot_ticks(PlotRange r, bool log, int target, double min_step, double *ticks);
// Labels of an axis's ticks, one style for the whole axis: plain decimals, SI suffixes for large
// values (k, M, G, T, P) or scientific notation for small ones, with the decimals the tick spacing
// needs (trailing zeros dropped).
void plot_tick_labels(const double *ticks, size_t n, bool log, char (*labels)[PLOT_LABEL_LEN]);

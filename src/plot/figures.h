// The pictures of one or several runs (`moe plot`): their losses against steps and tokens, their
// training signals, and per run the expert loads of each MoE layer over the steps.
#pragma once
#include <stdbool.h>
#include <stdio.h>

#include "plot/history.h"

typedef struct {
    const char *name;       // the run directory as given (legends and titles)
    const RunHistory *h;
} PlotRun;

#define FIGURE_WIDTH 1200   // pixels: the size the pictures are laid out at

typedef struct {
    const char *out_dir;    // must exist
    int width;              // of each picture in pixels (all of it scaled from FIGURE_WIDTH)
    bool svg;               // an .svg of each picture as well
} FigureOptions;

// Writes into out_dir:
//   loss.png      training cross-entropy (faint: each step; line: a running mean) and validation
//                 loss, against steps and against tokens; the y axis is logarithmic when the
//                 losses span more than a decade. With several runs, below: each later run's
//                 training cross-entropy against the first's at the same steps, in percent, as
//                 20-step means (an fp8 run against bf16 from the same start, say)
//   training.png  learning rate, gradient norm, tokens/s, max/mean expert load of the worst layer
//   fp8.png       with train.precision=fp8: per tensor class (weights, activations, gradients) the
//                 percentage of values its quantisation flushed to zero and saturated, each step
//                 (faint) and a running mean; runs without FP8 counters are left out, and with none
//                 the file is not written
//   experts.png   per MoE layer: each expert's share of the routed tokens over the steps (heatmap,
//                 1/E marked on its colour bar, whose colours reach the 99.5th percentile of the
//                 run's shares: a few early spikes take the top colour instead of darkening the
//                 rest) beside the layer's max/mean and min/mean load; for several runs one per
//                 run, experts-1.png, experts-2.png, ... in their order
// Several runs share loss.png and training.png, overlaid in distinct colours with a legend. Says
// each file written on `out`. -1 with a message naming the file when one cannot be written (or
// when moe was built without cairo).
int figures_write(const PlotRun *runs, size_t n, const FigureOptions *opt, FILE *out, MoeErr err);

// `moe plot RUN_DIR [RUN_DIR ...] [--out DIR] [--width PIXELS] [--svg]`: pictures of training runs from their
// metrics.jsonl (src/plot/figures.h says which); several runs are overlaid for comparison.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "io/fsutil.h"
#include "plot/figures.h"

static const CliSpec SPEC = {
    .command = "moe plot",
    .usage = "RUN_DIR [RUN_DIR ...] [--out DIR] [--width PIXELS] [--svg]",
    .summary = "Draws pictures of training runs (train.out directories) from their metrics.jsonl:\n"
               "  loss.png      training and validation loss against steps and against tokens\n"
               "  training.png  learning rate, gradient norm, tokens/s, worst expert load\n"
               "  fp8.png       (fp8 runs) the shares of values flushed to zero and saturated,\n"
               "                per tensor class\n"
               "  experts.png   per MoE layer, each expert's share of the routed tokens over\n"
               "                the steps, beside the layer's max/mean and min/mean load\n"
               "Several runs are overlaid in loss.png, training.png and fp8.png (one colour each),\n"
               "loss.png showing each later run's training loss against the first's in percent\n"
               "(20-step means), and get one experts-N.png each, in the order given.",
    .opts = (const CliOption[]){
        {"--out", "DIR", "where the pictures go (default: RUN_DIR/plots for one run, ./plots for several)"},
        {"--width", "PIXELS", "width of each picture, 400 to 4800 (default 1200); all of it scales"},
        {"--svg", NULL, "also write each picture as SVG"},
        {NULL}},
};

// "runs/a/" -> "runs/a": the name of a run in titles and legends.
static char *trim_slashes(char *path) {
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/') path[--n] = 0;
    return path;
}

// Logs written before step records held their token count: step x the tokens of a step, from the
// run's config.json.
static void fill_tokens(const char *dir, RunHistory *h) {
    bool missing = false;
    for (size_t i = 0; i < h->n; i++) missing |= isnan(h->v[HIST_TOKENS][i]);
    if (!missing) return;
    char path[4200];
    MoeErr err;
    Config cfg;
    config_defaults(&cfg);
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (config_load_file(&cfg, path, err)) {
        fprintf(stderr, "warning: %s: %s has steps without token counts; they are left out of the loss "
                "against tokens\n", err, dir);
        return;
    }
    history_fill_tokens(h, (double)cfg.train.micro_batches * cfg.train.micro_batch * cfg.train.seq_len);
}

static void read_run(const char *dir, RunHistory *h) {
    char path[4200];
    MoeErr err;
    if (!fs_is_dir(dir))
        moe_fatal("moe plot: %s is not a directory: pass run directories (a run's train.out, which holds "
                  "metrics.jsonl)", dir);
    snprintf(path, sizeof path, "%s/metrics.jsonl", dir);
    if (history_read(h, path, err)) moe_fatal("moe plot: %s", err);
    fill_tokens(dir, h);
}

int cmd_plot(int argc, char **argv, Comm *world) {
    const char *values[3] = {0};
    char out[4200];
    int n_pos;
    MoeErr err;
    char **pos = cli_parse_one_rank(&SPEC, argc, argv, values, &n_pos, world);
    if (!n_pos) return cli_misuse(&SPEC, pos);
    FigureOptions opt = {.out_dir = out, .svg = values[2] != NULL,
                         .width = values[1] ? (int)cli_number("--width", values[1], 400, 4800) : FIGURE_WIDTH};
    RunHistory *hist = moe_calloc((size_t)n_pos, sizeof *hist);
    PlotRun *runs = moe_calloc((size_t)n_pos, sizeof *runs);
    for (int i = 0; i < n_pos; i++) {
        read_run(trim_slashes(pos[i]), &hist[i]);
        runs[i] = (PlotRun){pos[i], &hist[i]};
    }
    if (values[0]) snprintf(out, sizeof out, "%s", values[0]);
    else if (n_pos == 1) snprintf(out, sizeof out, "%s/plots", pos[0]);
    else snprintf(out, sizeof out, "plots");
    if (fs_mkdir_p(out, err)) moe_fatal("moe plot: --out: %s", err);
    if (figures_write(runs, (size_t)n_pos, &opt, stdout, err)) moe_fatal("moe plot: %s", err);
    for (int i = 0; i < n_pos; i++) history_free(&hist[i]);
    free(hist);
    free(runs);
    free(pos);
    return 0;
}

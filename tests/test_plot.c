// Tests of what `moe plot` computes before drawing: axis ranges, nice ticks and their labels
// (src/plot/ticks.c), and metrics.jsonl read back (src/plot/history.c): each step once after a
// resume, validation records, expert shares, a line cut short, bad files, long runs thinned.
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "plot/history.h"
#include "plot/ticks.h"
#include "test.h"

static void check_ticks(PlotRange r, bool log, int target, double min_step, const double *want, size_t n) {
    double got[PLOT_MAX_TICKS];
    size_t m = plot_ticks(r, log, target, min_step, got);
    CHECK_MSG(m == n, "[%g, %g]%s: %zu ticks, want %zu", r.lo, r.hi, log ? " (log)" : "", m, n);
    if (m == n) test_check_arrays("ticks", got, want, n, 1e-12, 1e-15);
}

static void test_ticks(void) {
    check_ticks((PlotRange){0, 1}, false, 5, 0, (double[]){0, 0.2, 0.4, 0.6, 0.8, 1}, 6);
    check_ticks((PlotRange){3.7, 5.6}, false, 5, 0, (double[]){4, 4.5, 5, 5.5}, 4);
    check_ticks((PlotRange){-0.5, 3.5}, false, 10, 1, (double[]){0, 1, 2, 3}, 4);         // whole numbers
    check_ticks((PlotRange){-4, 404}, false, 2, 1, (double[]){0, 200, 400}, 3);           // a narrow axis: not 0 alone
    check_ticks((PlotRange){0.2, 0.8}, false, 2, 1, NULL, 0);                           // no whole number inside
    check_ticks((PlotRange){0.5, 2000}, true, 6, 0, (double[]){1, 10, 100, 1000}, 4);     // decades
    check_ticks((PlotRange){2, 80}, true, 6, 0, (double[]){2, 5, 10, 20, 50}, 5);         // 2 and 5 between
    check_ticks((PlotRange){1e-6, 1e6}, true, 5, 0, (double[]){1e-6, 1e-3, 1, 1e3, 1e6}, 5); // every 3rd
    double t[PLOT_MAX_TICKS];
    CHECK(plot_ticks((PlotRange){-1e308, 1e308}, false, 5, 0, t) <= PLOT_MAX_TICKS); // no overflow, no hang
    CHECK(plot_ticks((PlotRange){1e20, 1e20 + 1e5}, false, 5, 0, t) <= PLOT_MAX_TICKS);
}

static void check_labels(const double *ticks, size_t n, bool log, const char *const *want) {
    char got[PLOT_MAX_TICKS][PLOT_LABEL_LEN];
    plot_tick_labels(ticks, n, log, got);
    for (size_t i = 0; i < n; i++) CHECK_MSG(!strcmp(got[i], want[i]), "tick %g: '%s', want '%s'", ticks[i], got[i], want[i]);
}

static void test_tick_labels(void) {
    check_labels((double[]){0, 0.5, 1, 1.5}, 4, false, (const char *[]){"0", "0.5", "1", "1.5"});
    check_labels((double[]){0, 5000, 10000, 15000}, 4, false, (const char *[]){"0", "5k", "10k", "15k"});
    check_labels((double[]){8e5, 1e6, 1.2e6}, 3, false, (const char *[]){"800k", "1M", "1.2M"});
    check_labels((double[]){0, 5e-4, 1e-3, 1.5e-3}, 4, false, (const char *[]){"0", "5e-4", "1e-3", "1.5e-3"});
    check_labels((double[]){1e-6, 1e-3, 1, 1e3, 1e6}, 5, true, (const char *[]){"1e-6", "1e-3", "1", "1e3", "1e6"});
    check_labels((double[]){0.01, 0.1, 1, 10}, 4, true, (const char *[]){"0.01", "0.1", "1", "10"});
    check_labels((double[]){-2, 0, 2}, 3, false, (const char *[]){"-2", "0", "2"});
}

static void test_ranges(void) {
    PlotRange r = plot_range_empty();
    CHECK(plot_range_is_empty(r));
    PlotRange p = plot_range_padded(r, 0.05, false);
    CHECK(p.lo == 0 && p.hi == 1);
    plot_range_add(&r, (double[]){5, NAN, INFINITY}, 3, false);
    CHECK(r.lo == 5 && r.hi == 5);
    p = plot_range_padded(r, 0.05, false); // one value: a range around it
    CHECK_MSG(p.lo < 5 && p.hi > 5, "[%g, %g]", p.lo, p.hi);
    p = plot_range_padded(r, 0.05, true);
    CHECK_MSG(p.lo < 5 && p.hi > 5, "log: [%g, %g]", p.lo, p.hi);
    CHECK(plot_range_wants_log((PlotRange){0.1, 5}));
    CHECK(!plot_range_wants_log((PlotRange){1, 5}));
    CHECK(!plot_range_wants_log((PlotRange){-1, 100}));
    r = plot_range_empty();
    plot_range_add(&r, (double[]){-3, 0, 0.5, 40}, 4, true); // a log axis shows the positive ones
    CHECK(r.lo == 0.5 && r.hi == 40);
}

// ---------------------------------------------------------------- metrics.jsonl read back

static void write_log(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    MOE_CHECK(f && fputs(text, f) >= 0 && fclose(f) == 0, "cannot write %s", path);
}

// text written to a new temporary log (its name into path, a mkstemp template) and read back into
// h: the log removed, false and the test failed when it cannot be read.
static bool read_temp_log(RunHistory *h, char *path, const char *text) {
    close(mkstemp(path));
    write_log(path, text);
    MoeErr err;
    if (!history_read(h, path, err)) return true;
    TEST_FAIL("%s", err);
    unlink(path);
    return false;
}

#define STEP(s, ce, loads, imb) "{\"step\":" #s ",\"ce\":" #ce ",\"lr\":0.1,\"grad_norm\":1,\"tokens_per_sec\":100," \
    "\"moe_layers\":[{\"moe_layer\":0,\"load\":" loads ",\"imbalance\":" #imb ",\"min_over_mean\":0.5}]}\n"

// A log of a run resumed at step 1 after it had logged steps 2 and 3: the records of steps 2 and 3
// and the validation from step 2 on are replaced by the later ones; a last line cut short is left out.
static void test_history_resume(void) {
    char path[] = "/tmp/moe-metrics-XXXXXX";
    RunHistory h;
    if (!read_temp_log(&h, path, STEP(1, 5, "[1,3]", 1.5) STEP(2, 4, "[2,2]", 1.0) "{\"step\":2,\"val_loss\":4.5}\n"
                       STEP(3, 3, "[2,2]", 1.0) "{\"step\":3,\"val_loss\":9}\n"
                       STEP(2, 3.9, "[3,1]", 1.5) "{\"step\":2,\"val_loss\":4.4}\n" STEP(3, null, "[0,0]", null)
                       "{\"step\":3,\"val_loss\":null}\n{\"step\":4,\"ce\":2."))
        return;
    CHECK_MSG(h.n == 3 && h.n_val == 2 && h.n_moe == 1 && h.E == 2, "n %zu, n_val %zu, layers %d of %d", h.n,
              h.n_val, h.n_moe, h.E);
    if (h.n == 3 && h.n_val == 2) {
        test_check_arrays("steps", h.step, (double[]){1, 2, 3}, 3, 0, 0);
        test_check_arrays("ce", h.v[HIST_CE], (double[]){5, 3.9}, 2, 0, 0);
        CHECK(isnan(h.v[HIST_CE][2]) && isnan(h.v[HIST_IMBALANCE][2]) && isnan(h.v[HIST_TOKENS][0]));
        CHECK(h.v[HIST_IMBALANCE][1] == 1.5);
        CHECK(h.val_step[0] == 2 && h.val_loss[0] == 4.4 && h.val_step[1] == 3 && isnan(h.val_loss[1]));
        CHECK(h.n_rows == 3 && h.share[0] == 0.25f && h.share[1] == 0.75f && h.share[2] == 0.75f);
        CHECK(isnan(h.share[4]) && h.row_max[1] == 1.5f); // no slots routed: no shares
        history_fill_tokens(&h, 64);
        CHECK(history_tokens_at(&h, 2) == 128 && isnan(history_tokens_at(&h, 7)));
    }
    history_free(&h);
    unlink(path);
}

// got (n) equals want exactly, NaN exactly where want is NaN.
static void check_nan_arrays(const char *what, const double *got, const double *want, size_t n) {
    for (size_t i = 0; i < n; i++)
        CHECK_MSG(isnan(want[i]) ? isnan(got[i]) : got[i] == want[i], "%s [%zu]: %g, want %g", what, i, got[i], want[i]);
}

// An fp8 run's counters read as percentages per tensor class (NaN where a class's share is null);
// a record without them (a bf16 step) gives NaN.
static void test_history_fp8(void) {
    char path[] = "/tmp/moe-metrics-XXXXXX";
    RunHistory h;
    if (!read_temp_log(&h, path, "{\"step\":1,\"ce\":2,\"fp8\":{\"weights\":{\"values\":8,\"flushed\":0.25,"
                       "\"saturated\":0,\"nan\":0},\"activations\":{\"values\":4,\"flushed\":0.5,\"saturated\":0.125,"
                       "\"nan\":0},\"gradients\":{\"values\":0,\"flushed\":null,\"saturated\":null,\"nan\":null}}}\n"
                       "{\"step\":2,\"ce\":1.5}\n"))
        return;
    CHECK_MSG(h.n == 2, "%zu steps, not 2", h.n);
    if (h.n == 2) {
        const double want[2][2][3] = {{{25, 50, NAN}, {0, 12.5, NAN}}, // step 1: flushed, saturated per class
                                      {{NAN, NAN, NAN}, {NAN, NAN, NAN}}}; // step 2: no counters
        for (size_t i = 0; i < 2; i++)
            for (int k = 0; k < 2; k++) {
                double got[3];
                for (int c = 0; c < 3; c++) got[c] = h.v[(k ? HIST_FP8_SATURATED : HIST_FP8_FLUSHED) + c][i];
                check_nan_arrays(k ? "saturated (%)" : "flushed (%)", got, want[i][k], 3);
            }
    }
    history_free(&h);
    unlink(path);
}

// Means over windows of records (NaN left out) and a run's training loss against another's at the
// steps both have, in percent of the other's.
static void test_history_loss_gap(void) {
    double mean[5];
    history_window_mean((double[]){1, NAN, 3, 5, 7}, 5, 1, 1, mean);
    check_nan_arrays("centred means", mean, (double[]){1, NAN, 4, 5, 6}, 5);
    history_window_mean((double[]){1, NAN, 3, 5, 7}, 5, 2, 0, mean);
    check_nan_arrays("trailing means", mean, (double[]){1, NAN, 2, 4, 5}, 5);
    char ref_path[] = "/tmp/moe-metrics-XXXXXX", path[] = "/tmp/moe-metrics-XXXXXX";
    RunHistory ref, h;
    if (!read_temp_log(&ref, ref_path, "{\"step\":1,\"ce\":2}\n{\"step\":2,\"ce\":2}\n{\"step\":3,\"ce\":2}\n"
                                     "{\"step\":4,\"ce\":4}\n"))
        return;
    if (read_temp_log(&h, path, "{\"step\":2,\"ce\":3}\n{\"step\":3,\"ce\":1}\n{\"step\":4,\"ce\":2}\n"
                                "{\"step\":5,\"ce\":2}\n")) {
        double gap[4]; // h's 2-step means 3, 2, 1.5, 2 against ref's 2, 2, 3 and none
        history_loss_gap(&h, &ref, 2, gap);
        check_nan_arrays("gaps (%)", gap, (double[]){50, 0, -50, NAN}, 4);
        history_free(&h);
        unlink(path);
    }
    history_free(&ref);
    unlink(ref_path);
}

static void expect_error(const char *path, const char *text, const char *want) {
    RunHistory h;
    MoeErr err;
    if (text) write_log(path, text);
    int rc = history_read(&h, path, err);
    CHECK_MSG(rc && strstr(err, path) && strstr(err, want), "rc %d: '%s', want the path and '%s'", rc, rc ? err : "", want);
    if (!rc) history_free(&h);
}

static void test_history_errors(void) {
    char path[] = "/tmp/moe-metrics-XXXXXX";
    close(mkstemp(path));
    expect_error(path, "", "the file is empty");
    expect_error(path, "{\"step\":5,\"val_loss\":2}\n", "only validation records");
    expect_error(path, STEP(1, 5, "[1,3]", 1.5) "not json\n" STEP(2, 5, "[1,3]", 1.5), ":2: not a JSON record");
    expect_error(path, "{\"ce\":3}\n", ":1: the record has no integer \"step\"");
    expect_error(path, STEP(1, 5, "[1,3]", 1.5) STEP(2, 5, "[1,3,4]", 1.5), ":2: the record's \"moe_layers\" are 1 layers of 3");
    unlink(path);
    expect_error(path, NULL, "cannot open metrics log");
}

// A long run keeps expert shares for at most HIST_MAX_ROWS steps, evenly spread.
static void test_history_thinning(void) {
    char path[] = "/tmp/moe-metrics-XXXXXX";
    FILE *f = fdopen(mkstemp(path), "w");
    for (int s = 1; s <= 5000; s++) fprintf(f, STEP(%d, 2, "[1,3]", 1.5), s);
    fclose(f);
    RunHistory h;
    MoeErr err;
    if (history_read(&h, path, err)) TEST_FAIL("%s", err);
    else {
        CHECK_MSG(h.n == 5000 && h.stride == 4 && h.n_rows == 1250, "n %zu, stride %zu, rows %zu", h.n, h.stride, h.n_rows);
        for (size_t r = 0; r < h.n_rows; r++) CHECK_MSG(h.row[r] == 4 * r, "row %zu is record %zu", r, h.row[r]);
        history_free(&h);
    }
    unlink(path);
}

const TestCase plot_tests[] = {
    {"plot_ticks", test_ticks},
    {"plot_tick_labels", test_tick_labels},
    {"plot_ranges", test_ranges},
    {"plot_history_resume_and_validation", test_history_resume},
    {"plot_history_fp8", test_history_fp8},
    {"plot_history_loss_gap", test_history_loss_gap},
    {"plot_history_errors", test_history_errors},
    {"plot_history_thinning", test_history_thinning},
    {0},
};

// Tests of the shared helpers: suggestions, environment knobs, number and duration formatting,
// counter-based random numbers.
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "test.h"

static void test_suggest(void) {
    const char *keys[] = {"model.n_experts", "model.n_layers", "train.steps"};
    const char *s = moe_suggest("model.n_expertz", keys, 3);
    CHECK_MSG(s && !strcmp(s, "model.n_experts"), "suggested %s", s ? s : "nothing");
    CHECK_MSG(!moe_suggest("completely.different", keys, 3), "suggested something for a far name");
}

static void test_fmt_count(void) {
    char buf[32];
    CHECK_MSG(!strcmp(moe_fmt_count(buf, sizeof buf, 1115394), "1,115,394"), "got %s", buf);
    CHECK_MSG(!strcmp(moe_fmt_count(buf, sizeof buf, 999), "999"), "got %s", buf);
    CHECK_MSG(!strcmp(moe_fmt_count(buf, sizeof buf, 0), "0"), "got %s", buf);
    const double seconds[] = {0, 42.4, 185, 7620, 273600, -1, NAN};
    const char *want[] = {"0s", "42s", "3m05s", "2h07m", "3d04h", "?", "?"};
    for (size_t i = 0; i < sizeof seconds / sizeof seconds[0]; i++)
        CHECK_MSG(!strcmp(moe_fmt_duration(buf, sizeof buf, seconds[i]), want[i]), "%g s: got %s, want %s",
                  seconds[i], buf, want[i]);
}

static void test_rng_is_a_pure_function(void) {
    CHECK(rng_hash64(1, 2) == rng_hash64(1, 2));
    CHECK(rng_hash64(1, 2) != rng_hash64(2, 1));
    CHECK(rng_hash_str(7, "model.norm.weight") != rng_hash_str(7, "model.norm.weighs"));
    CHECK(rng_hash_str(7, "a") != rng_hash_str(8, "a"));
}

static void test_trunc_normal_moments(void) {
    size_t n = 200000;
    double sum = 0, sq = 0, mx = 0;
    for (size_t i = 0; i < n; i++) {
        double z = rng_trunc_normal(42, i, 3.0);
        sum += z, sq += z * z, mx = fabs(z) > mx ? fabs(z) : mx;
    }
    double mean = sum / n, var = sq / n - mean * mean;
    CHECK_CLOSE(mean, 0, 0, 0.01);
    CHECK_CLOSE(var, 0.9733, 0.02, 0); // variance of a standard normal truncated at 3 sigma
    CHECK_MSG(mx <= 3.0, "a draw of %g exceeds the truncation", mx);
}

// The normal's own log and cos (basic IEEE operations only, so a GPU computes the same bits) agree
// with the C library's to about an ulp, over random arguments and the ends of their ranges.
static void test_rng_log_cos_accuracy(void) {
    double worst_log = 0, worst_cos = 0;
    for (uint64_t i = 0; i < 200000 + 54; i++) {
        uint64_t k = i < 54 ? (uint64_t)1 << i : (rng_hash64(5, i) >> 11) + 1; // every power of 2 up to 2^53
        uint64_t j = i < 54 ? ((uint64_t)1 << 53) - 1 - i * 13 : rng_hash64(6, i) >> 11;
        double u1 = (double)k * 0x1.0p-53, want_log = log(u1), got_log = rng_log_unit(k);
        double err_log = want_log ? fabs(got_log - want_log) / fabs(want_log) : fabs(got_log);
        double err_cos = fabs(rng_cos_turn(j) - cos(2 * M_PI * (double)j * 0x1.0p-53));
        worst_log = err_log > worst_log ? err_log : worst_log, worst_cos = err_cos > worst_cos ? err_cos : worst_cos;
    }
    CHECK_MSG(worst_log < 5e-16, "log: worst relative error %g", worst_log);
    CHECK_MSG(worst_cos < 1e-15, "cos: worst error %g (the library's argument 2 pi u is rounded too)", worst_cos);
    for (uint64_t q = 0; q <= 4; q++) // the quarter turns exactly
        CHECK_MSG(rng_cos_turn(q << 51) == (double)(q % 2 ? 0 : q == 2 ? -1 : 1), "cos(%g pi) = %.17g", q * 0.5,
                  rng_cos_turn(q << 51));
}

static void test_uniform_range(void) {
    double lo = 1, hi = 0, sum = 0;
    for (uint64_t i = 0; i < 100000; i++) {
        double u = rng_uniform(3, i);
        lo = u < lo ? u : lo, hi = u > hi ? u : hi, sum += u;
    }
    CHECK(lo >= 0 && hi < 1);
    CHECK_CLOSE(sum / 100000, 0.5, 0, 0.01);
}

// An environment knob: its value where set to an integer in range (either bound included), the
// fallback where unset. (Bad values are fatal: tests/cli/test_mpi_comm.sh checks the message.)
static void test_env_int(void) {
    unsetenv("MOE_TEST_KNOB");
    CHECK(moe_env_int("MOE_TEST_KNOB", 7, 1, 16) == 7);
    setenv("MOE_TEST_KNOB", "16", 1);
    CHECK(moe_env_int("MOE_TEST_KNOB", 7, 1, 16) == 16);
    setenv("MOE_TEST_KNOB", "1", 1);
    CHECK(moe_env_int("MOE_TEST_KNOB", 7, 1, 16) == 1);
    setenv("MOE_TEST_KNOB", "-3", 1);
    CHECK(moe_env_int("MOE_TEST_KNOB", 7, -5, 16) == -3);
    unsetenv("MOE_TEST_KNOB");
}

const TestCase util_tests[] = {
    {"util_suggest", test_suggest},
    {"util_env_int", test_env_int},
    {"util_fmt_count_and_duration", test_fmt_count},
    {"util_rng_pure_function", test_rng_is_a_pure_function},
    {"util_trunc_normal_moments", test_trunc_normal_moments},
    {"util_rng_log_cos_accuracy", test_rng_log_cos_accuracy},
    {"util_uniform_range", test_uniform_range},
    {0},
};

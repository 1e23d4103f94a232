// Runs every unit test (built in double precision) and prints "N passed, N failed".
// An optional argument runs only the tests whose name contains it.
#include <stdio.h>
#include <string.h>

#include "test.h"

int test_failures;

#define TEST_SUITES(X) X(util_tests) X(safetensors_tests) X(data_tests) X(tokenizer_tests) X(config_tests) \
    X(gemm_tests) X(fp8_tests) X(ops_tests) X(gradcheck_tests) X(train_tests) X(pipeline_tests) X(plot_tests) X(launch_tests)

#define DECLARE(s) extern const TestCase s[];
TEST_SUITES(DECLARE)
#define LIST(s) s,
static const TestCase *suites[] = {TEST_SUITES(LIST)};

int test_check_arrays(const char *what, const double *got, const double *expected, size_t n,
                      double rtol, double atol) {
    size_t bad = 0, worst = 0;
    double worst_excess = -1;
    for (size_t i = 0; i < n; i++) {
        double tol = atol + rtol * fabs(expected[i]);
        double err = fabs(got[i] - expected[i]);
        if (!(err <= tol)) { // NaN counts as bad
            bad++;
            double excess = isnan(err) ? INFINITY : err - tol;
            if (excess > worst_excess) worst_excess = excess, worst = i;
        }
    }
    if (bad) {
        test_failures++;
        fprintf(stderr, "    %s: %zu of %zu elements differ; worst at [%zu]: got %.10g, expected %.10g "
                "(rtol %g, atol %g)\n", what, bad, n, worst, got[worst], expected[worst], rtol, atol);
    }
    return bad == 0;
}

int main(int argc, char **argv) {
    const char *filter = argc > 1 ? argv[1] : NULL;
    int passed = 0, failed = 0;
    for (size_t s = 0; s < sizeof suites / sizeof suites[0]; s++) {
        for (const TestCase *t = suites[s]; t->name; t++) {
            if (filter && !strstr(t->name, filter)) continue;
            test_failures = 0;
            printf("  %-50s ", t->name);
            fflush(stdout);
            t->fn();
            printf("%s\n", test_failures ? "FAIL" : "ok");
            fflush(stdout);
            if (test_failures) failed++; else passed++;
        }
    }
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0;
}

// Minimal test harness: each test is a function registered in tests/test_main.c; checks count
// failures and print the numbers that differ (expected, got, tolerance, index) without stopping.
#pragma once
#include <math.h>
#include <stdio.h>

typedef struct {
    const char *name;
    void (*fn)(void);
} TestCase;

extern int test_failures; // failed checks in the running test

#define TEST_FAIL(...)                                                                           \
    do {                                                                                         \
        test_failures++;                                                                         \
        fprintf(stderr, "    %s:%d: ", __FILE__, __LINE__);                                      \
        fprintf(stderr, __VA_ARGS__);                                                            \
        fputc('\n', stderr);                                                                     \
    } while (0)

#define CHECK(cond)                                                                              \
    do {                                                                                         \
        if (!(cond)) TEST_FAIL("check failed: %s", #cond);                                      \
    } while (0)

#define CHECK_MSG(cond, ...)                                                                     \
    do {                                                                                         \
        if (!(cond)) TEST_FAIL(__VA_ARGS__);                                                     \
    } while (0)

// |got - expected| <= atol + rtol * |expected|
#define CHECK_CLOSE(got, expected, rtol, atol)                                                   \
    do {                                                                                         \
        double g_ = (double)(got), e_ = (double)(expected);                                      \
        if (!(fabs(g_ - e_) <= (atol) + (rtol) * fabs(e_)))                                      \
            TEST_FAIL("%s = %.10g, expected %.10g (rtol %g, atol %g)", #got, g_, e_,            \
                      (double)(rtol), (double)(atol));                                           \
    } while (0)

// Element-wise comparison of two double arrays; reports the worst index.
int test_check_arrays(const char *what, const double *got, const double *expected, size_t n,
                      double rtol, double atol);

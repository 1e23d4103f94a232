// The FP8 recipe (ops/fp8.h) and its CPU emulation: E4M3 rounding checked exhaustively against the
// format's definition in double precision (every code, every midpoint, random values against a
// brute-force nearest code), saturation, subnormals and block scales; then the quantisation ops
// (layouts, zero blocks, outliers, values past 448) and the FP8 products against double-precision
// sums of the dequantised operands.
#include <stdlib.h>
#include <string.h>

#include "common/real.h"
#include "common/rng.h"
#include "ops/ops.h"
#include "test.h"

// ---------------------------------------------------------------- E4M3 in double precision

// The value of a code from the format's definition (sign, 4 exponent bits of bias 7, 3 mantissa
// bits; exponent 0 is subnormal; S.1111.111 is NaN).
static double e4m3_value(int c) {
    int e = (c >> 3) & 15, m = c & 7;
    double a = e == 15 && m == 7 ? NAN : e == 0 ? m * pow(2, -9) : (1 + m / 8.0) * pow(2, e - 7);
    return c & 0x80 ? -a : a;
}

// The code nearest to x by scanning every finite code (ties to the even code), saturating.
static int e4m3_nearest(double x) {
    int best = 0;
    double best_d = INFINITY;
    for (int c = 0; c < 0x7f; c++) {
        double d = fabs(fabs(x) - e4m3_value(c));
        if (d < best_d || (d == best_d && c % 2 == 0)) best = c, best_d = d;
    }
    return (x < 0 || (x == 0 && signbit(x)) ? 0x80 : 0) | best;
}

static void test_e4m3_every_code(void) {
    for (int c = 0; c < 256; c++) {
        double v = e4m3_value(c);
        float got = fp8_e4m3_decode((uint8_t)c);
        if (isnan(v)) {
            CHECK_MSG(isnan(got) && fp8_e4m3_encode(got) == FP8_E4M3_NAN, "code 0x%02x: NaN", c);
            continue;
        }
        CHECK_MSG(got == v && !signbit(got) == !signbit(v), "code 0x%02x decodes to %g, not %g", c, got, v);
        CHECK_MSG(fp8_e4m3_encode((float)v) == c, "%g encodes to 0x%02x, not 0x%02x", v,
                  fp8_e4m3_encode((float)v), c);
    }
    CHECK(fp8_e4m3_decode(0x7e) == FP8_E4M3_MAX && fp8_e4m3_decode(0x38) == 1 && fp8_e4m3_decode(0x01) == 0x1p-9);
}

// Midpoints between neighbouring codes round to the even one; a step either side rounds to the
// nearer one; random magnitudes over the whole range agree with the brute-force nearest code.
static void test_e4m3_ties_and_nearest(void) {
    for (int c = 0; c < 0x7e; c++)
        for (int sign = 0; sign < 2; sign++) {
            double lo = e4m3_value(c), hi = e4m3_value(c + 1), mid = (lo + hi) / 2, s = sign ? -1 : 1;
            int even = c % 2 == 0 ? c : c + 1, bit = sign ? 0x80 : 0;
            CHECK_MSG(fp8_e4m3_encode((float)(s * mid)) == (bit | even), "tie %g", s * mid);
            CHECK_MSG(fp8_e4m3_encode(nextafterf((float)(s * mid), 0)) == (bit | c), "below tie %g", s * mid);
            CHECK_MSG(fp8_e4m3_encode(nextafterf((float)(s * mid), (float)(s * INFINITY))) == (bit | (c + 1)),
                      "above tie %g", s * mid);
        }
    for (uint64_t i = 0; i < 20000; i++) {
        float x = (float)(ldexp(rng_uniform(7, 2 * i), (int)(rng_uniform(8, 2 * i) * 30) - 14));
        x = rng_uniform(9, i) < 0.5 ? -x : x;
        CHECK_MSG(fp8_e4m3_encode(x) == e4m3_nearest(x), "%.9g: 0x%02x, nearest 0x%02x", x, fp8_e4m3_encode(x),
                  e4m3_nearest(x));
    }
}

static void test_e4m3_saturation_and_nan(void) {
    float big[] = {448, 449, 464, 480, 1e4f, 3e38f, INFINITY};
    for (size_t i = 0; i < sizeof big / sizeof big[0]; i++) {
        CHECK_MSG(fp8_e4m3_encode(big[i]) == 0x7e, "%g saturates to 448", big[i]);
        CHECK_MSG(fp8_e4m3_encode(-big[i]) == 0xfe, "%g saturates to -448", -big[i]);
    }
    CHECK(fp8_e4m3_encode(NAN) == FP8_E4M3_NAN && isnan(fp8_e4m3_decode(0xff)));
    CHECK(fp8_e4m3_encode(447) == 0x7e && fp8_e4m3_encode(431) == 0x7d); // 432: tie of 416 (0x7d) and 448
}

// Subnormals are the multiples of 2^-9 below 2^-6, rounded to even; past 7.5 x 2^-9 they round up
// to the smallest normal.
static void test_e4m3_subnormals(void) {
    CHECK(fp8_e4m3_encode(0x1p-9f) == 0x01 && fp8_e4m3_encode(-0x1p-9f) == 0x81);
    CHECK(fp8_e4m3_encode(0x1p-10f) == 0x00);         // tie between 0 and 2^-9: even
    CHECK(fp8_e4m3_encode(0x1.0001p-10f) == 0x01);
    CHECK(fp8_e4m3_encode(3 * 0x1p-10f) == 0x02);     // tie between 1 and 2: even
    CHECK(fp8_e4m3_encode(7.5f * 0x1p-9f) == 0x08);   // tie between 7 and 2^-6: even (0x08)
    CHECK(fp8_e4m3_encode(1e-30f) == 0x00 && fp8_e4m3_encode(-1e-30f) == 0x80);
    CHECK(fp8_e4m3_decode(0x07) == 7 * 0x1p-9f && fp8_e4m3_decode(0x08) == 0x1p-6f);
}

static void test_block_scales(void) {
    CHECK(fp8_block_scale(0, FP8_SCALE_AMAX) == 1 && fp8_block_scale(0, FP8_SCALE_POW2) == 1);
    CHECK(fp8_block_scale(1e-44f, FP8_SCALE_AMAX) == 1); // amax / 448 underflows to 0
    CHECK(fp8_block_scale(448, FP8_SCALE_AMAX) == 1 && fp8_block_scale(896, FP8_SCALE_AMAX) == 2);
    CHECK(fp8_block_scale(500, FP8_SCALE_POW2) == 2 && fp8_block_scale(1792, FP8_SCALE_POW2) == 4);
    CHECK(fp8_block_scale(1, FP8_SCALE_POW2) == 0x1p-8f && fp8_block_scale(448, FP8_SCALE_POW2) == 1);
    // The largest magnitude of a block lands on +-448 (or just below with power-of-two scales).
    float amaxes[] = {1e-3f, 0.37f, 1, 3.3e3f, 1e30f};
    for (size_t i = 0; i < sizeof amaxes / sizeof amaxes[0]; i++) {
        float a = amaxes[i];
        CHECK_MSG(fp8_quantize(-a, fp8_block_scale(a, FP8_SCALE_AMAX)) == 0xfe, "amax %g", a);
        float s = fp8_block_scale(a, FP8_SCALE_POW2);
        double back = fp8_e4m3_decode(fp8_quantize(a, s)) * (double)s;
        CHECK_MSG(fabs(back - a) <= a / 16 && a / s <= 448 && a / s > 224, "pow2 amax %g: scale %g", a, s);
    }
}

const TestCase fp8_tests[] = {
    {"fp8_e4m3_every_code", test_e4m3_every_code},
    {"fp8_e4m3_ties_and_nearest", test_e4m3_ties_and_nearest},
    {"fp8_e4m3_saturation_and_nan", test_e4m3_saturation_and_nan},
    {"fp8_e4m3_subnormals", test_e4m3_subnormals},
    {"fp8_block_scales", test_block_scales},
    {NULL, NULL},
};

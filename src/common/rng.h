// Counter-based random numbers: each value is a pure function of (key, counter), so any rank or
// backend that needs the value for global element i of tensor "x" computes the same number without
// sharing state. Header-only and free of libc calls but sqrt and fma, so CUDA code can include it.
// Every double operation here is one IEEE-754 correctly rounded operation (+, -, *, /, sqrt, fma;
// products that meet an addition are written as fma, so no compiler contracts them differently):
// the CPU and a GPU compute bitwise the same values, which library log and cos would not promise.
#pragma once
#include <math.h>
#include <stdbool.h>
#include <stdint.h>

#ifdef __CUDACC__
#define RNG_FN static inline __host__ __device__
#else
#define RNG_FN static inline
#endif

// splitmix64 finaliser, applied to the key and again after mixing in the counter.
RNG_FN uint64_t rng_mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

RNG_FN uint64_t rng_hash64(uint64_t key, uint64_t counter) {
    return rng_mix64(rng_mix64(key + 0x9e3779b97f4a7c15ULL) ^ (counter * 0xd1b54a32d192ed03ULL));
}

// [0, 1) with 53 random bits
RNG_FN double rng_uniform(uint64_t key, uint64_t counter) {
    return (double)(rng_hash64(key, counter) >> 11) * 0x1.0p-53;
}

// c[0] + c[1] x + ... + c[9] x^9 by Estrin's scheme (short chains of dependent operations).
RNG_FN double rng_poly10(const double *c, double x) {
    double x2 = x * x, x4 = x2 * x2;
    double a0 = fma(c[1], x, c[0]), a1 = fma(c[3], x, c[2]), a2 = fma(c[5], x, c[4]), a3 = fma(c[7], x, c[6]);
    double a4 = fma(c[9], x, c[8]);
    return fma(a4, x4 * x4, fma(fma(a3, x2, a2), x4, fma(a1, x2, a0)));
}

// log(k 2^-53) for 1 <= k <= 2^53, to about 1e-16 relative: k 2^-53 = m 2^e with m in
// [sqrt(1/2), sqrt(2)) (exact, from the bits of k), log m = 2 atanh(s) with s = (m - 1) / (m + 1),
// |s| < 0.172, by its series to s^21.
RNG_FN double rng_log_unit(uint64_t k) {
    int e = -53;
    while (!(k >> 52)) k <<= 1, e--; // k in [2^52, 2^53): on average one shift for uniform k
    double m = (double)k * 0x1.0p-52; // [1, 2)
    e += 52;
    if (m > 0x1.6a09e667f3bcdp+0) m *= 0.5, e++; // sqrt(2)
    double s = (m - 1.0) / (m + 1.0), s2 = s * s;
    static const double C[10] = {0x1.5555555555555p-2, 0x1.999999999999ap-3, 0x1.2492492492492p-3,
                                 0x1.c71c71c71c71cp-4, 0x1.745d1745d1746p-4, 0x1.3b13b13b13b14p-4,
                                 0x1.1111111111111p-4, 0x1.e1e1e1e1e1e1ep-5, 0x1.af286bca1af28p-5,
                                 0x1.8618618618618p-5}; // 1 / (2k + 1), k = 1..10
    double log_m = fma(2.0 * s * s2, rng_poly10(C, s2), 2.0 * s);
    return fma((double)e, 0x1.62e42fefa39efp-1, fma((double)e, 0x1.abc9e3b39803fp-56, log_m)); // e ln 2 (hi + lo)
}

// cos(2 pi j 2^-53) for j < 2^53, to about 1e-16: j 2^-53 = q / 4 + f with |f| <= 1/8 (exact,
// integer arithmetic), then the Taylor series of cos or sin of 2 pi f (|2 pi f| <= pi/4) to
// degree 18 and 19.
RNG_FN double rng_cos_turn(uint64_t j) {
    uint64_t q = (j + ((uint64_t)1 << 50)) >> 51; // nearest quarter turn, 0..4
    double f = (double)(int64_t)(j - (q << 51)) * 0x1.0p-53, x = f * f;
    static const double COS[10] = {0x1.0000000000000p+0, -0x1.3bd3cc9be45dep+4, 0x1.03c1f081b5ac4p+6,
                                   -0x1.55d3c7e3cbffap+6, 0x1.e1f506891babbp+5, -0x1.a6d1f2a204a8cp+4,
                                   0x1.f9d38a3763cc3p+2, -0x1.b6e24f44b128fp+0, 0x1.20c62c2f2d7f5p-2,
                                   -0x1.2a0c591af8314p-5}; // (-1)^k (2 pi)^2k / (2k)!
    static const double SIN[10] = {0x1.921fb54442d18p+2, -0x1.4abbce625be53p+5, 0x1.466bc6775aae2p+6,
                                   -0x1.32d2cce62bd86p+6, 0x1.50783487ee782p+5, -0x1.e3074fde8871fp+3,
                                   0x1.e8f434d018d63p+1, -0x1.6fadb9f155744p-1, 0x1.aaec32af93359p-4,
                                   -0x1.8a404211f9547p-7}; // (-1)^k (2 pi)^(2k+1) / (2k+1)!
    bool odd = q & 1;
    double p = rng_poly10(odd ? SIN : COS, x);
    double v = odd ? f * p : p; // sin(2 pi f) or cos(2 pi f)
    return q == 1 || q == 2 ? -v : v; // cos(a + pi/2) = -sin a, cos(a + pi) = -cos a, cos(a + 3pi/2) = sin a
}

// Standard normal by Box-Muller on two decorrelated draws of the same counter.
RNG_FN double rng_normal(uint64_t key, uint64_t counter) {
    uint64_t k1 = (rng_hash64(key, 2 * counter) >> 11) + 1; // u1 = k1 2^-53 in (0, 1]
    uint64_t k2 = rng_hash64(key, 2 * counter + 1) >> 11;   // u2 = k2 2^-53 in [0, 1)
    return sqrt(-2.0 * rng_log_unit(k1)) * rng_cos_turn(k2);
}

// Normal truncated to |z| <= limit by redrawing with derived keys (about 0.3% redraws at 3).
RNG_FN double rng_trunc_normal(uint64_t key, uint64_t counter, double limit) {
    for (uint64_t attempt = 0;; attempt++) {
        double z = rng_normal(key + attempt * 0x632be59bd9b4e019ULL, counter);
        if (fabs(z) <= limit) return z;
    }
}

// Initial value of element `counter` of a tensor keyed by `key`: std times a standard normal
// truncated at 3, rounded to float (params_init_values, and every backend's init_params op).
RNG_FN float rng_init_value(uint64_t key, uint64_t counter, double std) {
    return (float)(std * rng_trunc_normal(key, counter, 3.0));
}

// Noise of random-routing mode for global token t, expert e of a layer (every backend and every
// layout draws the same value).
RNG_FN double rng_routing_noise(uint64_t step_seed, uint64_t layer, uint64_t t, uint64_t E,
                                uint64_t e) {
    return rng_uniform(rng_hash64(step_seed, layer), t * E + e);
}

// Sequential generator for host-side decisions (sampling); its whole state is one integer.
typedef struct {
    uint64_t state;
} Rng;

RNG_FN uint64_t rng_next(Rng *r) {
    r->state += 0x9e3779b97f4a7c15ULL;
    return rng_mix64(r->state);
}

RNG_FN double rng_next_uniform(Rng *r) { return (double)(rng_next(r) >> 11) * 0x1.0p-53; }

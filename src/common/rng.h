// Counter-based random numbers: each value is a pure function of (key, counter), so any rank or
// backend that needs the value for global element i of tensor "x" computes the same number without
// sharing state. Header-only and free of libc calls but sqrt/log/cos, so CUDA code can include it.
#pragma once
#include <math.h>
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

// Standard normal by Box-Muller on two decorrelated draws of the same counter.
RNG_FN double rng_normal(uint64_t key, uint64_t counter) {
    double u1 = (double)((rng_hash64(key, 2 * counter) >> 11) + 1) * 0x1.0p-53; // (0, 1]
    double u2 = rng_uniform(key, 2 * counter + 1);
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

// Normal truncated to |z| <= limit by redrawing with derived keys (about 0.3% redraws at 3).
RNG_FN double rng_trunc_normal(uint64_t key, uint64_t counter, double limit) {
    for (uint64_t attempt = 0;; attempt++) {
        double z = rng_normal(key + attempt * 0x632be59bd9b4e019ULL, counter);
        if (fabs(z) <= limit) return z;
    }
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

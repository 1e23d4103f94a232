// Filling backend buffers with reproducible random values from the host, for benchmarks (zeros
// would hide wrong indexing and can run faster than real data on tensor cores).
#include <stdlib.h>

#include "common/rng.h"
#include "common/util.h"
#include "ops.h"

void ops_fill_random(const Ops *o, void *act, size_t n, uint64_t seed, float scale) {
    size_t chunk = (size_t)1 << 24;
    float *host = moe_malloc(chunk * sizeof(float));
    void *stage = o->alloc(chunk * o->f32_size);
    for (size_t i0 = 0; i0 < n; i0 += chunk) {
        size_t m = n - i0 < chunk ? n - i0 : chunk;
        for (size_t i = 0; i < m; i++) host[i] = scale * (float)rng_normal(seed, i0 + i);
        o->upload_f32(stage, host, m);
        o->cast_f32_to_act((char *)act + i0 * o->act_size, stage, m);
    }
    o->sync();
    o->free(stage);
    free(host);
}

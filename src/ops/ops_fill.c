// Filling backend buffers with reproducible random values from the host, for benchmarks (zeros
// would hide wrong indexing and can run faster than real data on tensor cores). Up to 2^24 values
// are drawn; larger buffers repeat them.
#include <stdlib.h>

#include "common/rng.h"
#include "common/util.h"
#include "ops.h"

void ops_fill_random(const Ops *o, void *act, size_t n, uint64_t seed, float scale) {
    size_t chunk = n < ((size_t)1 << 24) ? n : (size_t)1 << 24; // drawn once, then repeated
    float *host = moe_malloc((chunk ? chunk : 1) * sizeof(float));
    void *stage = o->alloc((chunk ? chunk : 1) * o->f32_size);
    for (size_t i = 0; i < chunk; i++) host[i] = scale * (float)rng_normal(seed, i);
    o->upload_f32(stage, host, chunk);
    o->cast_f32_to_act(act, stage, chunk);
    for (size_t i0 = chunk; i0 < n; i0 += chunk)
        o->copy((char *)act + i0 * o->act_size, act, (n - i0 < chunk ? n - i0 : chunk) * o->act_size);
    o->sync();
    o->free(stage);
    free(host);
}

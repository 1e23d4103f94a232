// A pool of backend allocations freed together and counted: the model's memory plan (model.c) and
// its expert exchange (moe_exchange.c) allocate from one, so `moe inspect` sees every byte.
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "ops/ops.h"

typedef struct {
    const Ops *ops;
    void **p;     // (n) every allocation
    size_t n;
    size_t bytes; // their total size, plus memory allocated elsewhere and counted in (peer memory)
} MemPool;

void *pool_alloc(MemPool *pool, size_t bytes);
void pool_free(MemPool *pool); // frees every allocation

// Buffers of n elements of each kind (ops.h).
static inline void *pool_act(MemPool *pool, size_t n) { return pool_alloc(pool, n * pool->ops->act_size); }
static inline void *pool_f32(MemPool *pool, size_t n) { return pool_alloc(pool, n * pool->ops->f32_size); }
static inline int32_t *pool_i32(MemPool *pool, size_t n) { return pool_alloc(pool, n * sizeof(int32_t)); }

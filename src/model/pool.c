// Backend allocations freed together and counted (see pool.h).
#include "pool.h"

#include <stdlib.h>

#include "common/util.h"

void *pool_alloc(MemPool *pool, size_t bytes) {
    void *p = pool->ops->alloc(bytes);
    pool->p = moe_realloc(pool->p, (pool->n + 1) * sizeof(void *));
    pool->p[pool->n++] = p;
    pool->bytes += bytes;
    return p;
}

void pool_free(MemPool *pool) {
    for (size_t i = 0; i < pool->n; i++) pool->ops->free(pool->p[i]);
    free(pool->p);
    pool->p = NULL, pool->n = 0, pool->bytes = 0;
}

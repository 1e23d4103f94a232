// Parameter registry: registration in flat-buffer order, lookup, and layout-independent init.
#include "params.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

size_t params_add(ParamRegistry *r, const char *name, size_t rows, size_t cols, bool decay,
                  bool ones, int layer, int expert) {
    if (r->n == r->cap) {
        r->cap = r->cap ? 2 * r->cap : 64;
        r->p = moe_realloc(r->p, r->cap * sizeof(ParamInfo));
    }
    ParamInfo *p = &r->p[r->n++];
    memset(p, 0, sizeof *p);
    MOE_ASSERT(strlen(name) < PARAM_NAME_LEN);
    snprintf(p->name, sizeof p->name, "%s", name);
    p->ndim = cols ? 2 : 1;
    p->shape[0] = rows;
    p->shape[1] = cols;
    p->global_rows = rows;
    p->row_begin = 0;
    p->numel = cols ? rows * cols : rows;
    p->offset = r->total;
    p->decay = decay;
    p->ones = ones;
    p->layer = layer;
    p->expert = expert;
    r->total += p->numel;
    return p->offset;
}

void params_begin_region(ParamRegistry *r, ParamRegion region) {
    r->region_begin[region] = r->total;
}

void params_end_region(ParamRegistry *r, ParamRegion region, size_t multiple) {
    size_t size = r->total - r->region_begin[region];
    size = size_round_up(size, multiple);
    r->region_size[region] = size;
    r->total = r->region_begin[region] + size;
}

bool params_part(const ParamInfo *p, size_t lo, size_t hi, size_t *a, size_t *b) {
    *a = size_max(p->offset, lo);
    *b = size_min(p->offset + p->numel, hi);
    return *a < *b;
}

const ParamInfo *params_find(const ParamRegistry *r, const char *name) {
    for (size_t i = 0; i < r->n; i++)
        if (!strcmp(r->p[i].name, name)) return &r->p[i];
    return NULL;
}

void params_free(ParamRegistry *r) {
    free(r->p);
    memset(r, 0, sizeof *r);
}

uint64_t params_init_key(const ParamInfo *p, unsigned seed) { return rng_hash_str(seed, p->name); }

uint64_t params_init_counter(const ParamInfo *p) { return p->row_begin * (p->ndim == 2 ? p->shape[1] : 1); }

void params_init_values(const ParamInfo *p, unsigned seed, double std, float *out) {
    uint64_t key = params_init_key(p, seed), c0 = params_init_counter(p);
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < p->numel; i++) out[i] = p->ones ? 1.0f : rng_init_value(key, c0 + i, std);
}

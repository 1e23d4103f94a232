// The parameter registry: every parameter tensor of this process with its global name (Hugging
// Face OLMoE naming where one exists), global shape, and where it sits in this process's flat
// buffers. Checkpoints, initialisation and the optimizer work from this table only, so a layout
// that holds a subset of layers or experts registers just those and still reads and writes the
// same global tensors.
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define PARAM_NAME_LEN 96

// Dense tensors are replicated over a stage's data-parallel ranks, expert tensors over the ranks
// holding the same experts: each kind is one contiguous region of the flat buffers, so a region
// can be reduced, sharded and gathered over its group in single calls.
typedef enum { PARAM_DENSE, PARAM_EXPERT, PARAM_N_REGIONS } ParamRegion;

typedef struct {
    char name[PARAM_NAME_LEN];
    int ndim;
    size_t shape[2];      // what this process holds: rows shape[0] of the global tensor
    size_t global_rows;   // rows of the global tensor (its other dimension is held whole)
    size_t row_begin;     // first global row held here
    size_t numel;         // held elements
    size_t offset;   // first element in the flat buffers (params, grads, moments)
    bool decay;      // AdamW weight decay applies (not to norms and embeddings)
    bool ones;       // initialised to 1 (norm weights) rather than random
    int layer;       // -1: embedding, final norm, LM head
    int expert;      // global expert index; -1 when not an expert's tensor
} ParamInfo;

typedef struct {
    ParamInfo *p;
    size_t n, cap;
    size_t total;                             // elements in each flat buffer (with padding)
    size_t region_begin[PARAM_N_REGIONS];     // first element of each region
    size_t region_size[PARAM_N_REGIONS];      // elements, padded to a multiple of its group
} ParamRegistry;

// Appends a whole tensor at the end of the flat buffers; returns its offset. Tensors registered one
// after another are adjacent, which is how fused weights (q|k|v, gate|up) are laid out.
size_t params_add(ParamRegistry *r, const char *name, size_t rows, size_t cols, bool decay,
                  bool ones, int layer, int expert);
// Tensors added between params_begin_region and params_end_region form that region; the end pads
// it to a multiple of `multiple` elements (so it splits evenly into shards).
void params_begin_region(ParamRegistry *r, ParamRegion region);
void params_end_region(ParamRegistry *r, ParamRegion region, size_t multiple);
// The region a tensor belongs to.
static inline ParamRegion params_region(const ParamInfo *p) { return p->expert >= 0 ? PARAM_EXPERT : PARAM_DENSE; }
// The elements of p inside flat [lo, hi): [*a, *b); false when there are none.
bool params_part(const ParamInfo *p, size_t lo, size_t hi, size_t *a, size_t *b);
const ParamInfo *params_find(const ParamRegistry *r, const char *name);
void params_free(ParamRegistry *r);

// Initial value of every element, a pure function of (seed, name, global element index): any layout
// computes the same values for the same global tensor. Element i of the tensor is
// rng_init_value(params_init_key, i, std) (common/rng.h), or 1 for norm weights: what a backend's
// init_params op computes in place (model_init_weights).
void params_init_values(const ParamInfo *p, unsigned seed, double std, float *out);
uint64_t params_init_key(const ParamInfo *p, unsigned seed);
// The global element index of the first element held here.
uint64_t params_init_counter(const ParamInfo *p);

// A backend that allocates nothing and runs nothing: sizing a model on it measures the exact
// memory plan of a real backend with the same element sizes (used by `moe inspect`).
#include "ops.h"

static char placeholder[64]; // every allocation points here; nothing is ever read or written

static void *count_alloc(size_t bytes) { return placeholder; }
static void count_free(void *p) {}
static void count_zero(void *p, size_t bytes) {}
static void count_upload(void *dst, const void *src, size_t bytes) {}
static void count_upload_f32(void *dst, const float *src, size_t n) {}
static void count_init_params(void *dst, size_t n, uint64_t key, uint64_t c0, double std, bool ones) {}

static Ops make_counting(size_t act_size) {
    return (Ops){.name = "count", .sizing_only = true, .act_size = act_size, .f32_size = 4, .act_aliases_f32 = act_size == 4,
                 .logits_chunk = act_size == 4 ? (size_t)1 << 22 : (size_t)1 << 28,
                 .alloc = count_alloc, .free = count_free, .zero = count_zero,
                 .upload = count_upload, .upload_f32 = count_upload_f32, .init_params = count_init_params};
}

const Ops *ops_counting(bool bf16_activations) {
    static Ops fp32, bf16;
    fp32 = make_counting(4);
    bf16 = make_counting(2);
    return bf16_activations ? &bf16 : &fp32;
}

const Ops *ops_counting_like(const Ops *backend) {
    static Ops o;
    o = make_counting(backend->act_size);
    o.f32_size = backend->f32_size, o.act_aliases_f32 = backend->act_aliases_f32;
    o.logits_chunk = backend->logits_chunk;
    o.attention_workspace = backend->attention_workspace;
    return &o;
}

// Causal grouped-query attention through cuDNN's fused flash attention (the frontend's SDPA graph):
// on Hopper its engines use wgmma and TMA. Q, K and V are read in place from the packed qkv rows
// and dQ, dK, dV written in place into the packed gradient rows (strided tensors, no copies); the
// forward keeps each row's log-sum-exp (cuDNN's softmax "stats", natural log of the scaled scores,
// the same quantity as the CPU backend's lse). One graph per shape and direction is built on first
// use (before any step is recorded) and executed with the tensors' addresses afterwards, on the
// fastest of the engine configurations cuDNN's heuristics offer, timed then on scratch tensors of
// the shape; under train.deterministic the heuristics' first, in both directions, so that two runs
// (and two models of one process) execute the same plans.
#include <cudnn_frontend.h>

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "cuda_common.cuh"
#include "cuda_ops.h"

namespace fe = cudnn_frontend;

enum { UID_Q = 1, UID_K, UID_V, UID_O, UID_STATS, UID_DO, UID_DQ, UID_DK, UID_DV };

typedef struct {
    AttnDims d;
    bool backward, deterministic; // deterministic: the heuristics' first plan (and the backward's fixed-order one)
    std::shared_ptr<fe::graph::Graph> graph; // NULL: cuDNN cannot run this shape
    int64_t plan;                            // the engine configuration executed: an index among graph's plans
    int64_t workspace;
} SdpaPlan;

#define SDPA_CACHE 64 // shapes; past it the last entry is replaced (and a shape planned again when it returns)
static SdpaPlan sdpa_cache[SDPA_CACHE];
static int sdpa_cached;
static cudnnHandle_t sdpa_handle;

static bool same_dims(AttnDims a, AttnDims b) {
    return a.B == b.B && a.S == b.S && a.Hq == b.Hq && a.Hkv == b.Hkv && a.hd == b.hd;
}

// (B, heads, S, hd) view of `heads` heads from column `col` of rows of `row` elements.
static std::shared_ptr<fe::graph::Tensor_attributes> sdpa_tensor(fe::graph::Graph &g, const char *name, int uid,
                                                                 AttnDims d, size_t heads, size_t row) {
    int64_t B = (int64_t)d.B, S = (int64_t)d.S, H = (int64_t)heads, hd = (int64_t)d.hd, C = (int64_t)row;
    return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim({B, H, S, hd}).set_stride(
        {S * C, hd, C, 1}));
}

static void sdpa_set_output(std::shared_ptr<fe::graph::Tensor_attributes> t, int uid, AttnDims d, size_t heads,
                            size_t row) {
    int64_t B = (int64_t)d.B, S = (int64_t)d.S, H = (int64_t)heads, hd = (int64_t)d.hd, C = (int64_t)row;
    t->set_output(true).set_uid(uid).set_dim({B, H, S, hd}).set_stride({S * C, hd, C, 1});
}

static bool fe_ok(fe::error_t e, std::string *why) {
    if (!e.is_good()) *why = e.get_message();
    return e.is_good();
}

// The forward or backward graph of shape d, or NULL (with the reason printed once) when cuDNN has
// no engine for it.
static std::shared_ptr<fe::graph::Graph> sdpa_build(AttnDims d, bool backward, bool deterministic, int64_t *ws) {
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(fe::DataType_t::BFLOAT16)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    size_t C = (d.Hq + 2 * d.Hkv) * d.hd, Dq = d.Hq * d.hd;
    float scale = 1.0f / sqrtf((float)d.hd);
    auto q = sdpa_tensor(*g, "Q", UID_Q, d, d.Hq, C), k = sdpa_tensor(*g, "K", UID_K, d, d.Hkv, C);
    auto v = sdpa_tensor(*g, "V", UID_V, d, d.Hkv, C);
    if (!backward) {
        auto opts = fe::graph::SDPA_attributes().set_name("attention").set_generate_stats(true).set_causal_mask(true).set_attn_scale(scale);
        auto [o, stats] = g->sdpa(q, k, v, opts);
        sdpa_set_output(o, UID_O, d, d.Hq, Dq);
        stats->set_output(true).set_uid(UID_STATS).set_data_type(fe::DataType_t::FLOAT);
    } else {
        auto o = sdpa_tensor(*g, "O", UID_O, d, d.Hq, Dq), dO = sdpa_tensor(*g, "dO", UID_DO, d, d.Hq, Dq);
        int64_t B = (int64_t)d.B, H = (int64_t)d.Hq, S = (int64_t)d.S;
        auto stats = g->tensor(fe::graph::Tensor_attributes().set_name("stats").set_uid(UID_STATS).set_dim({B, H, S, 1}).set_stride(
            {H * S, S, 1, 1}).set_data_type(fe::DataType_t::FLOAT));
        auto opts = fe::graph::SDPA_backward_attributes().set_name("attention_backward").set_causal_mask(true).set_attn_scale(
            scale).set_deterministic_algorithm(deterministic);
        auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, dO, stats, opts);
        sdpa_set_output(dq, UID_DQ, d, d.Hq, C), sdpa_set_output(dk, UID_DK, d, d.Hkv, C);
        sdpa_set_output(dv, UID_DV, d, d.Hkv, C);
    }
    std::string why;
    bool ok = fe_ok(g->validate(), &why) && fe_ok(g->build_operation_graph(sdpa_handle), &why) &&
              fe_ok(g->create_execution_plans({fe::HeurMode_t::A}), &why) && fe_ok(g->check_support(sdpa_handle), &why) &&
              fe_ok(g->build_plans(sdpa_handle, fe::BuildPlanPolicy_t::ALL), &why) && fe_ok(g->get_workspace_size(*ws), &why);
    if (!ok) {
        fprintf(stderr, "note: cuDNN attention %s (B %zu, S %zu, heads %zu/%zu, hd %zu) not available: %s; using the "
                        "built-in kernel\n", backward ? "backward" : "forward", d.B, d.S, d.Hq, d.Hkv, d.hd, why.c_str());
        return nullptr;
    }
    return g;
}

// Plan i's time on the tensors of ptrs: the best of 3 runs after a warm-up, in ms (infinite when it fails).
static float sdpa_time_plan(fe::graph::Graph &g, std::unordered_map<int64_t, void *> &ptrs, void *ws, int64_t i) {
    cudaEvent_t t[2];
    CUDA_CHECK(cudaEventCreate(&t[0]));
    CUDA_CHECK(cudaEventCreate(&t[1]));
    float best = INFINITY;
    for (int run = 0; run < 4; run++) {
        CUDA_CHECK(cudaEventRecord(t[0], cuda_ctx.stream));
        bool ok = g.execute_plan_at_index(sdpa_handle, ptrs, ws, i).is_good();
        CUDA_CHECK(cudaEventRecord(t[1], cuda_ctx.stream));
        CUDA_CHECK(cudaEventSynchronize(t[1]));
        float ms;
        CUDA_CHECK(cudaEventElapsedTime(&ms, t[0], t[1]));
        if (!ok) break;
        if (run > 0 && ms < best) best = ms;
    }
    CUDA_CHECK(cudaEventDestroy(t[0]));
    CUDA_CHECK(cudaEventDestroy(t[1]));
    return best;
}

// Sets p->plan to the fastest of its graph's plans, timed on scratch tensors of its shape (filled
// with small values), and p->workspace to that plan's. Keeps plan 0 (the heuristics' first) under
// train.deterministic, with a single plan, or when the scratch does not fit in device memory.
static void sdpa_choose(SdpaPlan *p) {
    fe::graph::Graph &g = *p->graph;
    int64_t n = g.get_execution_plan_count(), ws = 0;
    p->plan = 0;
    if (p->deterministic || n < 2) return;
    for (int64_t i = 0; i < n; i++) {
        int64_t w = 0;
        if (g.get_workspace_size_plan_at_index(i, w).is_good() && w > ws) ws = w;
    }
    AttnDims d = p->d;
    size_t T = d.B * d.S, C = (d.Hq + 2 * d.Hkv) * d.hd, Dq = d.Hq * d.hd;
    size_t sizes[] = {T * C * 2, T * Dq * 2, d.B * d.Hq * d.S * 4, T * Dq * 2, T * C * 2, (size_t)ws}, total = 0;
    for (size_t b : sizes) total += (b + 255) / 256 * 256;
    char *buf;
    if (cudaMalloc(&buf, total) != cudaSuccess) {
        (void)cudaGetLastError();
        return;
    }
    CUDA_CHECK(cudaMemsetAsync(buf, 0x3c, total, cuda_ctx.stream)); // bf16 0.0115, fp32 0.0115: no overflow
    void *at[6];
    for (int i = 0, off = 0; i < 6; off += (int)((sizes[i] + 255) / 256 * 256), i++) at[i] = buf + off;
    bf16 *q = (bf16 *)at[0], *dq = (bf16 *)at[4];
    size_t k_col = d.Hq * d.hd, v_col = (d.Hq + d.Hkv) * d.hd;
    std::unordered_map<int64_t, void *> ptrs = {{UID_Q, q}, {UID_K, q + k_col}, {UID_V, q + v_col}, {UID_O, at[1]},
                                                {UID_STATS, at[2]}};
    if (p->backward) ptrs.insert({{UID_DO, at[3]}, {UID_DQ, dq}, {UID_DK, dq + k_col}, {UID_DV, dq + v_col}});
    CUDNN_CHECK(cudnnSetStream(sdpa_handle, cuda_ctx.stream));
    char times[160] = ""; // every plan's, in the heuristics' order
    float best = INFINITY;
    for (int64_t i = 0; i < n; i++) {
        float ms = sdpa_time_plan(g, ptrs, at[5], i);
        if (ms < best) best = ms, p->plan = i;
        size_t used = strlen(times);
        snprintf(times + used, sizeof times - used, "%s%.3f", i ? ", " : "", ms);
    }
    CUDA_CHECK(cudaFree(buf));
    int64_t w = 0;
    if (g.get_workspace_size_plan_at_index(p->plan, w).is_good()) p->workspace = w;
    fprintf(stderr, "note: cuDNN attention %s (B %zu, S %zu, heads %zu/%zu, hd %zu): plan %lld of %lld (ms: %s)\n",
            p->backward ? "backward" : "forward", d.B, d.S, d.Hq, d.Hkv, d.hd, (long long)p->plan, (long long)n, times);
}

static const SdpaPlan *sdpa_plan(AttnDims d, bool backward, bool deterministic) {
    for (int i = 0; i < sdpa_cached; i++) {
        const SdpaPlan *p = &sdpa_cache[i];
        if (same_dims(p->d, d) && p->backward == backward && p->deterministic == deterministic) return p;
    }
    if (!sdpa_handle) {
        CUDNN_CHECK(cudnnCreate(&sdpa_handle));
    }
    SdpaPlan *p = &sdpa_cache[sdpa_cached < SDPA_CACHE ? sdpa_cached++ : SDPA_CACHE - 1];
    p->d = d, p->backward = backward, p->deterministic = deterministic, p->workspace = 0;
    p->graph = sdpa_build(d, backward, deterministic, &p->workspace);
    if (p->graph) sdpa_choose(p);
    return p;
}

// Grow-only workspace, sized by the first call of each shape (before any step is recorded).
static void *sdpa_workspace(int64_t bytes) {
    static void *buf;
    static size_t have;
    return cuda_grow_scratch(&buf, &have, (size_t)bytes);
}

static bool sdpa_run(const SdpaPlan *p, std::unordered_map<int64_t, void *> &ptrs) {
    if (!p->graph) return false;
    CUDNN_CHECK(cudnnSetStream(sdpa_handle, cuda_ctx.stream));
    fe::error_t err = p->graph->execute_plan_at_index(sdpa_handle, ptrs, sdpa_workspace(p->workspace), p->plan);
    if (!err.is_good()) moe_fatal("cuDNN attention failed: %s", err.get_message().c_str());
    return true;
}

extern "C" bool cuda_attention_forward_cudnn(void *out, void *lse, const void *qkv, AttnDims d, bool deterministic) {
    const bf16 *q = (const bf16 *)qkv;
    std::unordered_map<int64_t, void *> ptrs = {{UID_Q, (void *)q},
                                                {UID_K, (void *)(q + d.Hq * d.hd)},
                                                {UID_V, (void *)(q + (d.Hq + d.Hkv) * d.hd)},
                                                {UID_O, out},
                                                {UID_STATS, lse}};
    return sdpa_run(sdpa_plan(d, false, deterministic), ptrs);
}

extern "C" bool cuda_attention_backward_cudnn(void *dqkv, const void *dout, const void *qkv, const void *out,
                                              const void *lse, AttnDims d, bool deterministic) {
    const bf16 *q = (const bf16 *)qkv;
    bf16 *dq = (bf16 *)dqkv;
    size_t k_col = d.Hq * d.hd, v_col = (d.Hq + d.Hkv) * d.hd;
    std::unordered_map<int64_t, void *> ptrs = {
        {UID_Q, (void *)q},       {UID_K, (void *)(q + k_col)}, {UID_V, (void *)(q + v_col)},
        {UID_O, (void *)out},     {UID_DO, (void *)dout},      {UID_STATS, (void *)lse},
        {UID_DQ, dq},             {UID_DK, dq + k_col},        {UID_DV, dq + v_col}};
    return sdpa_run(sdpa_plan(d, true, deterministic), ptrs);
}

extern "C" bool cuda_attention_workspace_cudnn(AttnDims d, bool deterministic, size_t *bytes) {
    const SdpaPlan *f = sdpa_plan(d, false, deterministic), *b = sdpa_plan(d, true, deterministic);
    *bytes = (size_t)(f->workspace > b->workspace ? f->workspace : b->workspace);
    return f->graph && b->graph;
}

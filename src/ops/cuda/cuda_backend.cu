// The CUDA backend: device memory (and pinned host memory for transfers queued with the work) and
// work on one main stream (plus a side stream for communication that overlaps it), graph capture
// and events, and the table of CUDA kernels behind the ops interface (act = bf16, f32 = float).
#include <stdlib.h>
#include <string.h>

#include "cuda_common.cuh"
#include "cuda_ops.h"

CudaContext cuda_ctx;

// MOE_KERNELS=builtin (every choice), or a comma list of attention=builtin|cudnn,
// grouped=builtin|cutlass, fp8_dense=cublas|cutlass, fp8_rows=256|128 (the tiles of the experts'
// FP8 forward and input gradient) and fp8_wgrad=256|128 (of their weight gradients): lets one build
// compare kernel variants. The CUTLASS grouped GEMM needs a Hopper GPU (compute capability 9.0);
// elsewhere the built-in kernel runs. The dense FP8 products run on cuBLASLt where it takes the
// shape, else on CUTLASS's kernel.
static void cuda_choose_kernels(int major) {
    const char *k = getenv("MOE_KERNELS");
    bool all = k && !strcmp(k, "builtin");
    cuda_ctx.builtin_attention = all || (k && strstr(k, "attention=builtin"));
    cuda_ctx.builtin_grouped = all || (k && strstr(k, "grouped=builtin")) || major != 9;
    cuda_ctx.fp8 = major == 9;
    cuda_ctx.cutlass_fp8_dense = k && strstr(k, "fp8_dense=cutlass");
    cuda_ctx.fp8_rows_128 = k && strstr(k, "fp8_rows=128");
    cuda_ctx.fp8_wgrad_128 = k && strstr(k, "fp8_wgrad=128");
}

// Device memory in use (every allocation of the process, libraries' and the context's included),
// and the most seen: sampled after each of the backend's allocations and each query.
static size_t peak_in_use;

static size_t cuda_memory_in_use(void) {
    size_t free_b = 0, total = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total));
    peak_in_use = total - free_b > peak_in_use ? total - free_b : peak_in_use;
    return total - free_b;
}

static size_t cuda_memory_peak(void) {
    cuda_memory_in_use();
    return peak_in_use;
}

void *cuda_grow_scratch(void **buf, size_t *have, size_t bytes) {
    if (bytes > *have) {
        if (*buf) CUDA_CHECK(cudaFree(*buf));
        CUDA_CHECK(cudaMalloc(buf, bytes));
        *have = bytes;
        cuda_memory_in_use();
    }
    return *buf;
}

void cuda_init(void) {
    if (cuda_ctx.main) return;
    int device = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&cuda_ctx.sm_count, cudaDevAttrMultiProcessorCount, device));
    int major = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    cuda_choose_kernels(major);
    CUDA_CHECK(cudaStreamCreateWithFlags(&cuda_ctx.main, cudaStreamNonBlocking));
    CUDA_CHECK(cudaStreamCreateWithFlags(&cuda_ctx.side, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&cuda_ctx.fork, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&cuda_ctx.join, cudaEventDisableTiming));
    cuda_ctx.stream = cuda_ctx.main;
    CUBLAS_CHECK(cublasLtCreate(&cuda_ctx.lt));
    cuda_ctx.workspace_bytes = (size_t)64 << 20;
    CUDA_CHECK(cudaMalloc(&cuda_ctx.workspace, cuda_ctx.workspace_bytes));
}

static void *cuda_alloc(size_t bytes) {
    void *p = NULL;
    cudaError_t err = cudaMalloc(&p, bytes ? bytes : 1);
    if (err != cudaSuccess) {
        size_t free_b = 0, total = 0;
        cudaMemGetInfo(&free_b, &total);
        moe_fatal("out of GPU memory allocating %.3f GiB (%.3f GiB free of %.3f GiB): lower "
                  "train.micro_batch or train.seq_len, or spread the model over more GPUs",
                  bytes / 1073741824.0, free_b / 1073741824.0, total / 1073741824.0);
    }
    cuda_memory_in_use();
    return p;
}

static void cuda_free(void *p) { CUDA_CHECK(cudaFree(p)); }
static void cuda_zero(void *p, size_t bytes) { CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, cuda_ctx.stream)); }

static void cuda_copy(void *dst, const void *src, size_t bytes) {
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cuda_ctx.stream));
}

// Host transfers wait for the stream: the host buffer may be reused as soon as they return.
static void cuda_upload(void *dst, const void *src, size_t bytes) {
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, cuda_ctx.stream));
    CUDA_CHECK(cudaStreamSynchronize(cuda_ctx.stream));
}

static void cuda_download(void *dst, const void *src, size_t bytes) {
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, cuda_ctx.stream));
    CUDA_CHECK(cudaStreamSynchronize(cuda_ctx.stream));
}

// Queued transfers: pinned host memory, so that the copies run in the stream's order without a wait.
static void *cuda_host_alloc(size_t bytes) {
    void *p = NULL;
    CUDA_CHECK(cudaMallocHost(&p, bytes ? bytes : 1));
    return p;
}

static void cuda_host_free(void *p) { CUDA_CHECK(cudaFreeHost(p)); }

static void cuda_upload_queued(void *dst, const void *src, size_t bytes) {
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, cuda_ctx.stream));
}

static void cuda_download_queued(void *dst, const void *src, size_t bytes) {
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, cuda_ctx.stream));
}

static void cuda_download_f32_queued(float *dst, const void *src, size_t n) {
    cuda_download_queued(dst, src, n * sizeof(float));
}

static void cuda_upload_f32(void *dst, const float *src, size_t n) { cuda_upload(dst, src, n * sizeof(float)); }
static void cuda_download_f32(float *dst, const void *src, size_t n) { cuda_download(dst, src, n * sizeof(float)); }

static void cuda_download_act(float *dst, const void *src, size_t n) {
    bf16 *tmp = (bf16 *)moe_malloc(n * sizeof(bf16));
    cuda_download(tmp, src, n * sizeof(bf16));
    for (size_t i = 0; i < n; i++) dst[i] = __bfloat162float(tmp[i]);
    free(tmp);
}

static void cuda_sync(void) { CUDA_CHECK(cudaStreamSynchronize(cuda_ctx.stream)); }

static size_t cuda_memory_available(void) {
    size_t free_b = 0, total = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total));
    return free_b;
}

static void cuda_capture_begin(void) {
    CUDA_CHECK(cudaStreamBeginCapture(cuda_ctx.stream, cudaStreamCaptureModeThreadLocal));
}

// A recorded step: the instantiated graph, and what it holds, counted before the graph is dropped.
typedef struct {
    cudaGraphExec_t exec;
    GraphCounts counts;
} CudaGraph;

static void cuda_count_nodes(cudaGraph_t graph, GraphCounts *c) {
    size_t n = 0;
    CUDA_CHECK(cudaGraphGetNodes(graph, NULL, &n));
    cudaGraphNode_t *nodes = (cudaGraphNode_t *)moe_malloc((n ? n : 1) * sizeof(cudaGraphNode_t));
    CUDA_CHECK(cudaGraphGetNodes(graph, nodes, &n));
    memset(c, 0, sizeof *c);
    c->nodes = n;
    for (size_t i = 0; i < n; i++) {
        cudaGraphNodeType type;
        CUDA_CHECK(cudaGraphNodeGetType(nodes[i], &type));
        if (type == cudaGraphNodeTypeKernel) c->kernels++;
        else if (type == cudaGraphNodeTypeMemcpy) c->memcpys++;
        else if (type == cudaGraphNodeTypeMemset) c->memsets++;
        else if (type == cudaGraphNodeTypeHost) c->hosts++;
        else if (type == cudaGraphNodeTypeEventRecord || type == cudaGraphNodeTypeWaitEvent) c->events++;
        else c->other++;
    }
    free(nodes);
}

static void *cuda_capture_end(void) {
    cudaGraph_t graph;
    CudaGraph *g = (CudaGraph *)moe_malloc(sizeof(CudaGraph));
    CUDA_CHECK(cudaStreamEndCapture(cuda_ctx.stream, &graph));
    cuda_count_nodes(graph, &g->counts);
    CUDA_CHECK(cudaGraphInstantiate(&g->exec, graph, 0));
    CUDA_CHECK(cudaGraphDestroy(graph));
    return g;
}

static void cuda_graph_free(void *graph) {
    CUDA_CHECK(cudaStreamSynchronize(cuda_ctx.stream));
    CUDA_CHECK(cudaGraphExecDestroy(((CudaGraph *)graph)->exec));
    free(graph);
}

static void cuda_graph_launch(void *graph) {
    CUDA_CHECK(cudaGraphLaunch(((CudaGraph *)graph)->exec, cuda_ctx.stream));
}

static void cuda_graph_count(const void *graph, GraphCounts *out) { *out = ((const CudaGraph *)graph)->counts; }

static void *cuda_event_create(void) {
    cudaEvent_t e;
    CUDA_CHECK(cudaEventCreate(&e));
    return e;
}

static void cuda_event_record(void *e) { CUDA_CHECK(cudaEventRecord((cudaEvent_t)e, cuda_ctx.stream)); }

static float cuda_event_elapsed_ms(void *a, void *b) {
    float ms = 0;
    CUDA_CHECK(cudaEventSynchronize((cudaEvent_t)b));
    CUDA_CHECK(cudaEventElapsedTime(&ms, (cudaEvent_t)a, (cudaEvent_t)b));
    return ms;
}

static void cuda_event_wait(void *e) { CUDA_CHECK(cudaEventSynchronize((cudaEvent_t)e)); }

static void cuda_event_free(void *e) { CUDA_CHECK(cudaEventDestroy((cudaEvent_t)e)); }

// The side stream forks from the main one and joins it through events (in a capture too, where a
// join without a fork would be an error).
static void cuda_side_begin(void) {
    CUDA_CHECK(cudaEventRecord(cuda_ctx.fork, cuda_ctx.main));
    CUDA_CHECK(cudaStreamWaitEvent(cuda_ctx.side, cuda_ctx.fork, 0));
    cuda_ctx.stream = cuda_ctx.side;
    cuda_ctx.side_pending = true;
}

static void cuda_side_end(void) { cuda_ctx.stream = cuda_ctx.main; }

static void cuda_side_join(void) {
    if (!cuda_ctx.side_pending) return;
    cuda_ctx.side_pending = false;
    CUDA_CHECK(cudaEventRecord(cuda_ctx.join, cuda_ctx.side));
    CUDA_CHECK(cudaStreamWaitEvent(cuda_ctx.main, cuda_ctx.join, 0));
}

// What the kernels can take: the MoE kernels' fixed arrays (cuda_common.cuh), element-wise
// kernels moving 8 bf16 (16 bytes) at a time, attention instantiated for these head widths
// (cuda_attention.cu).
static const OpsLimits CUDA_LIMITS = {.max_experts = CUDA_MAX_EXPERTS, .max_top_k = CUDA_MAX_TOP_K,
                                      .width_multiple = 8, .head_dims = {16, 32, 64, 128}};
static_assert(CUDA_MAX_EXPERTS <= GROUPED_MAX_E, "the CUTLASS grouped GEMM's tables hold every expert "
                                                 "of a layer (cuda_grouped_sm90.cu)");

extern "C" const OpsLimits *ops_cuda_limits(void) { return &CUDA_LIMITS; }

static void *cuda_stream(void) { return cuda_ctx.stream; }

static Ops make_cuda_ops(void) {
    Ops o;
    memset(&o, 0, sizeof o);
    o.name = "cuda";
    o.limits = &CUDA_LIMITS;
    o.act_size = sizeof(bf16), o.f32_size = sizeof(float), o.act_aliases_f32 = false;
    o.logits_chunk = (size_t)1 << 28;
    o.alloc = cuda_alloc, o.free = cuda_free, o.zero = cuda_zero, o.copy = cuda_copy;
    o.upload = cuda_upload, o.download = cuda_download;
    o.upload_f32 = cuda_upload_f32, o.download_f32 = cuda_download_f32, o.download_act = cuda_download_act;
    o.host_alloc = cuda_host_alloc, o.host_free = cuda_host_free;
    o.upload_queued = cuda_upload_queued, o.download_f32_queued = cuda_download_f32_queued;
    o.download_queued = cuda_download_queued;
    o.cast_f32_to_act = cuda_cast_f32_to_act, o.init_params = cuda_init_params, o.sync = cuda_sync, o.memory_in_use = cuda_memory_in_use;
    o.memory_available = cuda_memory_available, o.memory_peak = cuda_memory_peak;
    o.capture_begin = cuda_capture_begin, o.capture_end = cuda_capture_end, o.graph_launch = cuda_graph_launch;
    o.graph_free = cuda_graph_free, o.graph_count = cuda_graph_count;
    o.event_create = cuda_event_create, o.event_record = cuda_event_record;
    o.event_elapsed_ms = cuda_event_elapsed_ms, o.event_wait = cuda_event_wait, o.event_free = cuda_event_free;
    o.side_begin = cuda_side_begin, o.side_end = cuda_side_end, o.side_join = cuda_side_join;
    o.stream = cuda_stream;
    o.embedding_forward = cuda_embedding_forward, o.embedding_backward = cuda_embedding_backward;
    o.matmul_forward = cuda_matmul_forward, o.matmul_backward = cuda_matmul_backward;
    o.rmsnorm_forward = cuda_rmsnorm_forward, o.rmsnorm_backward = cuda_rmsnorm_backward;
    o.add_rmsnorm_forward = cuda_add_rmsnorm_forward;
    o.add = cuda_add;
    o.qkv_norm_rope_forward = cuda_qkv_norm_rope_forward;
    o.qkv_norm_rope_backward = cuda_qkv_norm_rope_backward;
    o.attention_forward = cuda_attention_forward, o.attention_backward = cuda_attention_backward;
    o.attention_workspace = cuda_attention_workspace, o.device_clocks = cuda_device_clocks;
    o.swiglu_forward = cuda_swiglu_forward, o.swiglu_backward = cuda_swiglu_backward;
    o.router_forward = cuda_router_forward, o.router_aux_loss = cuda_router_aux_loss;
    o.router_backward = cuda_router_backward;
    o.moe_dispatch_forward = cuda_moe_dispatch_forward, o.moe_dispatch_backward = cuda_moe_dispatch_backward;
    o.moe_combine_forward = cuda_moe_combine_forward, o.moe_combine_backward = cuda_moe_combine_backward;
    o.moe_slot_values = cuda_moe_slot_values, o.moe_row_tokens = cuda_moe_row_tokens;
    o.moe_regroup = cuda_moe_regroup, o.moe_exchange_plan = cuda_moe_exchange_plan;
    o.moe_push_rows = cuda_moe_push_rows;
    o.grouped_matmul_forward = cuda_grouped_matmul_forward;
    o.grouped_matmul_backward = cuda_grouped_matmul_backward;
    o.router_bias_update = cuda_router_bias_update;
    if (cuda_ctx.fp8) {
        o.fp8_quantize_rows = cuda_fp8_quantize_rows, o.fp8_quantize_cols = cuda_fp8_quantize_cols;
        o.swiglu_forward_fp8 = cuda_swiglu_forward_fp8, o.fp8_quantize_rows_cols = cuda_fp8_quantize_rows_cols;
        o.swiglu_backward_fp8 = cuda_swiglu_backward_fp8, o.rmsnorm_forward_fp8 = cuda_rmsnorm_forward_fp8;
        o.fp8_quantize_weights = cuda_fp8_quantize_weights, o.fp8_transpose_codes = cuda_fp8_transpose_codes;
        o.fp8_weights_amax = cuda_fp8_weights_amax, o.fp8_quantize_weights_part = cuda_fp8_quantize_weights_part;
        o.fp8_regroup_scales = cuda_fp8_regroup_scales, o.fp8_dequantize_rows = cuda_fp8_dequantize_rows;
        o.fp8_gather_rows = cuda_fp8_gather_rows;
        o.fp8_grouped_matmul = cuda_fp8_grouped_matmul, o.fp8_grouped_matmul_wgrad = cuda_fp8_grouped_matmul_wgrad;
        o.fp8_matmul = cuda_fp8_matmul;
    }
    o.cross_entropy = cuda_cross_entropy, o.sum_squares = cuda_sum_squares;
    o.adamw_update = cuda_adamw_update, o.adamw_update_fp8 = cuda_adamw_update_fp8;
    return o;
}

extern "C" const Ops *ops_cuda(int device, bool deterministic) {
    static Ops ops;
    cuda_ctx.deterministic = deterministic;
    if (!ops.name) {
        int n = 0;
        if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0)
            moe_fatal("train.device = cuda but no CUDA GPU is visible here");
        CUDA_CHECK(cudaSetDevice(device % n));
        cuda_init();
        cuda_clocks_open(device % n);
        ops = make_cuda_ops();
    }
    return &ops;
}

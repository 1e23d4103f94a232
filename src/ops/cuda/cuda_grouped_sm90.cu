// Expert GEMMs on Hopper through CUTLASS's sm90 grouped GEMM: TMA loads on mbarriers, wgmma on
// warp-specialised consumer warpgroups, a persistent grid that walks the (expert, tile) list. The
// per-expert problem sizes and pointers are written on the device from the row offsets by a small
// kernel before each product, so no count travels to the host and the launch can be recorded in a
// CUDA graph. Each expert gets its own TMA descriptors (CUTLASS rewrites them on the device), so a
// tile never reads or writes past its expert's rows.
#include "cuda_common.cuh"
#include "cuda_ops.h"

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

using namespace cute;

// One grouped product type: bf16 operands with the given layouts (CUTLASS's convention: A is
// (M, K), B is (K, N); RowMajor B means N contiguous), fp32 accumulation, output ElementD row-major,
// read back and added (beta = 1) when ACCUMULATE. 128 x 256 x 64 tiles on two consumer warpgroups
// (cooperative), clusters of 2 along M sharing the B tile through TMA multicast.
template <class LayoutA, class LayoutB, class ElementD, bool ACCUMULATE> struct GroupedSm90 {
    using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>; // (M, N, K) per expert
    using TileShape = Shape<_128, _256, _64>;
    using ClusterShape = Shape<_2, _1, _1>;
    using ElementC = cute::conditional_t<ACCUMULATE, ElementD, void>;
    static constexpr int ALIGN_AB = 8, ALIGN_D = 16 / sizeof(ElementD);
    using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
        cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, cutlass::layout::RowMajor *,
        ALIGN_D, ElementD, cutlass::layout::RowMajor *, ALIGN_D, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
        cutlass::epilogue::fusion::LinearCombination<ElementD, float>>::CollectiveOp;
    using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cutlass::bfloat16_t, LayoutA *, ALIGN_AB,
        cutlass::bfloat16_t, LayoutB *, ALIGN_AB, float, TileShape, ClusterShape,
        cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
        cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
    using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
    using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
    using StrideA = typename Kernel::InternalStrideA;
    using StrideB = typename Kernel::InternalStrideB;
    using StrideD = typename Kernel::InternalStrideD;
    using Out = ElementD;
    using SourcePtrs = ElementC const **; // C, the output read back when accumulating
    static constexpr bool accumulate = ACCUMULATE;

    // Per-expert arguments in device memory, written by grouped_sm90_prepare.
    struct Table {
        typename ProblemShape::UnderlyingProblemShape shape[GROUPED_MAX_E];
        const cutlass::bfloat16_t *a[GROUPED_MAX_E];
        const cutlass::bfloat16_t *b[GROUPED_MAX_E];
        ElementD *d[GROUPED_MAX_E];
        StrideA sa[GROUPED_MAX_E];
        StrideB sb[GROUPED_MAX_E];
        StrideD sd[GROUPED_MAX_E];
    };
};

// A packed stride of one of CUTLASS's (rows, cols, batch) stride types: the one dynamic mode gets
// the leading dimension `ld`, the others are compile-time 1 and 0.
template <class Stride> __device__ Stride packed_stride(int64_t ld) {
    Stride s{};
    if constexpr (!cute::is_static<decltype(get<0>(s))>::value) get<0>(s) = ld;
    else get<1>(s) = ld;
    return s;
}

// Which of the three products (cuda_ops.h): rows of expert e are [offsets[e], offsets[e + 1]).
//   FWD   out (rows, N) = x (rows, K) . w[e] (N, K)^T
//   DGRAD dx (rows, K) = dout (rows, N) . w[e] (N, K)
//   WGRAD dw[e] (N, K) += dout (rows, N)^T . x (rows, K)   (an expert without rows has no tiles)
// The persistent grid hands out tiles in table order, CTA i taking tiles i, i + grid, ... A weight
// gradient tile costs its expert's row count, so there the table lists the experts by falling
// row count (longest first: the tiles of the large experts spread over all CTAs instead of piling
// onto some when the loads are skewed); the other products' tiles cost the same, in expert order.
// One block: e's slot is the number of experts before it in that order.
template <class G, GroupedOp OP>
__global__ void grouped_sm90_prepare(typename G::Table *t, const bf16 *a, const bf16 *b, void *d,
                                     const int32_t *offsets, int E, int N, int K) {
    __shared__ int32_t rows_of[GROUPED_MAX_E];
    for (int e = threadIdx.x; e < E; e += blockDim.x) rows_of[e] = offsets[e + 1] - offsets[e];
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int64_t row0 = offsets[e], rows = rows_of[e];
        int slot = e;
        if (OP == GROUPED_WGRAD) {
            slot = 0;
            for (int j = 0; j < E; j++) slot += rows_of[j] > rows || (rows_of[j] == rows && j < e);
        }
        const cutlass::bfloat16_t *A = (const cutlass::bfloat16_t *)a, *B = (const cutlass::bfloat16_t *)b;
        typename G::Out *D = (typename G::Out *)d;
        int64_t lda = OP == GROUPED_FWD ? K : N, ldd = OP == GROUPED_FWD ? N : K;
        if (OP == GROUPED_FWD) t->shape[slot] = {(int)rows, N, K};
        else if (OP == GROUPED_DGRAD) t->shape[slot] = {(int)rows, K, N};
        else t->shape[slot] = {rows ? N : 0, K, (int)rows};
        t->a[slot] = A + row0 * lda;
        t->b[slot] = OP == GROUPED_WGRAD ? B + row0 * K : B + (int64_t)e * N * K;
        t->d[slot] = OP == GROUPED_WGRAD ? D + (int64_t)e * N * K : D + row0 * ldd;
        t->sa[slot] = packed_stride<typename G::StrideA>(lda);
        t->sb[slot] = packed_stride<typename G::StrideB>(K);
        t->sd[slot] = packed_stride<typename G::StrideD>(ldd);
    }
}

// Thread blocks of the persistent grid per SM: MOE_GROUPED_WAVES (default 1). CUTLASS hands each
// block a fixed share of the tiles, so when another kernel holds some SMs (row pushes beside the
// experts, parallel.exchange_chunks) the blocks that wait for them finish late; with more blocks
// than SMs the hardware fills SMs as they free up and the wait costs a fraction of a share. An
// experiment's knob (scripts/gpu_multi.sh chunks), read once.
static int grouped_waves(void) {
    static int waves;
    if (!waves) {
        const char *v = getenv("MOE_GROUPED_WAVES");
        waves = v && atoi(v) > 0 ? atoi(v) : 1;
    }
    return waves;
}

// Writes the table, then runs the product. The CUTLASS parameters point at the table (not at its
// contents), so they are made once per expert count and every later call (or graph replay) only
// launches; the table of each product type is rewritten in stream order before its use.
template <class G, GroupedOp OP>
static void grouped_sm90_run(const void *a, const void *b, void *d, const int32_t *offsets, int E, int N, int K) {
    static typename G::Table *table;
    static typename G::Gemm gemm;
    static void *workspace;
    static int ready_E;
    if (!table) CUDA_CHECK(cudaMalloc(&table, sizeof *table));
    grouped_sm90_prepare<G, OP><<<1, 256, 0, cuda_ctx.stream>>>(
        table, (const bf16 *)a, (const bf16 *)b, d, offsets, E, N, K);
    CUDA_LAUNCH_CHECK();
    if (ready_E != E) {
        cutlass::KernelHardwareInfo hw;
        CUDA_CHECK(cudaGetDevice(&hw.device_id));
        hw.sm_count = cuda_ctx.sm_count * grouped_waves();
        typename G::SourcePtrs c = nullptr;
        if constexpr (G::accumulate) c = (typename G::SourcePtrs)table->d;
        typename G::Gemm::Arguments args{
            cutlass::gemm::GemmUniversalMode::kGrouped,
            {E, table->shape, nullptr},
            {table->a, table->sa, table->b, table->sb},
            {{}, c, table->sd, table->d, table->sd},
            hw};
        args.epilogue.thread.alpha = 1.0f;
        args.epilogue.thread.beta = G::accumulate ? 1.0f : 0.0f;
        CUTLASS_CHECK(gemm.can_implement(args));
        if (workspace) CUDA_CHECK(cudaFree(workspace));
        CUDA_CHECK(cudaMalloc(&workspace, G::Gemm::get_workspace_size(args) + 1));
        CUTLASS_CHECK(gemm.initialize(args, workspace, cuda_ctx.stream));
        ready_E = E;
    }
    CUTLASS_CHECK(gemm.run(cuda_ctx.stream));
}

typedef cutlass::layout::RowMajor Row;
typedef cutlass::layout::ColumnMajor Col;

extern "C" void cuda_grouped_sm90(GroupedOp op, const void *a, const void *b, void *d, const int32_t *offsets,
                                  size_t E, size_t N, size_t K) {
    if (op == GROUPED_FWD)
        grouped_sm90_run<GroupedSm90<Row, Col, cutlass::bfloat16_t, false>, GROUPED_FWD>(a, b, d, offsets, (int)E, (int)N, (int)K);
    else if (op == GROUPED_DGRAD)
        grouped_sm90_run<GroupedSm90<Row, Row, cutlass::bfloat16_t, false>, GROUPED_DGRAD>(a, b, d, offsets, (int)E, (int)N, (int)K);
    else
        grouped_sm90_run<GroupedSm90<Col, Row, float, true>, GROUPED_WGRAD>(a, b, d, offsets, (int)E, (int)N, (int)K);
}

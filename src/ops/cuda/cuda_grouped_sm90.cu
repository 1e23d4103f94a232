// Expert GEMMs in bf16 on Hopper through CUTLASS's sm90 grouped GEMM: TMA loads on mbarriers, wgmma
// on warp-specialised consumer warpgroups, a persistent grid that walks the (expert, tile) list,
// per-expert problems written on the device from the row offsets (cuda_grouped_sm90.cuh).
#include "cuda_grouped_sm90.cuh"

using namespace cute;

// One grouped product type: bf16 operands with the given layouts (CUTLASS's convention: A is
// (M, K), B is (K, N); RowMajor B means N contiguous), fp32 accumulation, the output written by
// Epilogue (GroupedSm90RowsEpilogue: bf16 rows; GroupedSm90Epilogue: fp32 weight gradients). 128 x
// 256 x 64 tiles on two consumer warpgroups (cooperative), clusters of 2 along M sharing the B tile
// through TMA multicast.
using GroupedSm90Tile = Shape<_128, _256, _64>;
using GroupedSm90Cluster = Shape<_2, _1, _1>;
template <class LayoutA, class LayoutB, class Epilogue> struct GroupedSm90 {
    using TileShape = GroupedSm90Tile;
    using ClusterShape = GroupedSm90Cluster;
    using Epi = Epilogue;
    using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cutlass::bfloat16_t, LayoutA *, 8,
        cutlass::bfloat16_t, LayoutB *, 8, float, TileShape, ClusterShape,
        cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epi::Op::SharedStorage))>,
        cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
    using Kernel = cutlass::gemm::kernel::GemmUniversal<GroupedSm90Problem, Mainloop, typename Epi::Op>;
    using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
    using Table = GroupedSm90Table<Kernel>;
    static typename Mainloop::Arguments mainloop_arguments(Table *t) { return {t->a, t->sa, t->b, t->sb}; }
};

// Which of the products (cuda_ops.h): rows of expert e are [offsets[e], offsets[e + 1]).
//   FWD       out (rows, N) = x (rows, K) . w[e] (N, K)^T
//   DGRAD     dx (rows, K) = dout (rows, N) . w[e] (N, K)
//   WGRAD     dw[e] (N, K) += dout (rows, N)^T . x (rows, K)   (an expert without rows has no tiles)
//   WGRAD_SET dw[e] (N, K) = the same                          (its caller zeroes those: cuda_grouped_zero_empty)
template <class G, GroupedOp OP>
__global__ void grouped_sm90_prepare(typename G::Table *t, const bf16 *a, const bf16 *b, void *d,
                                     const int32_t *offsets, int E, int N, int K) {
    __shared__ int32_t rows_of[GROUPED_MAX_E];
    grouped_sm90_rows(rows_of, offsets, E);
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int64_t row0 = offsets[e];
        int rows = rows_of[e], slot = grouped_sm90_slot(rows_of, e, E, OP >= GROUPED_WGRAD);
        typename G::Table::ElementD *D = (typename G::Table::ElementD *)d;
        if (OP == GROUPED_FWD)
            grouped_sm90_set(t, slot, rows, N, K, a + row0 * K, K, b + (int64_t)e * N * K, K, D + row0 * N, N);
        else if (OP == GROUPED_DGRAD)
            grouped_sm90_set(t, slot, rows, K, N, a + row0 * N, N, b + (int64_t)e * N * K, K, D + row0 * K, K);
        else
            grouped_sm90_set(t, slot, rows ? N : 0, K, rows, a + row0 * N, N, b + row0 * K, K, D + (int64_t)e * N * K, K);
    }
}

template <class G, GroupedOp OP>
static void grouped_sm90_run(const void *a, const void *b, void *d, const int32_t *offsets, int E, int N, int K) {
    grouped_sm90_launch<G>(E, [&](typename G::Table *table) {
        grouped_sm90_prepare<G, OP><<<1, 256, 0, cuda_ctx.stream>>>(table, (const bf16 *)a, (const bf16 *)b, d,
                                                                    offsets, E, N, K);
    });
}

typedef cutlass::layout::RowMajor Row;
typedef cutlass::layout::ColumnMajor Col;
template <bool ACCUMULATE>
using GroupedSm90Wgrad = GroupedSm90<Col, Row, GroupedSm90Epilogue<GroupedSm90Tile, GroupedSm90Cluster, float, ACCUMULATE>>;

extern "C" void cuda_grouped_sm90(GroupedOp op, const void *a, const void *b, void *d, const int32_t *offsets,
                                  size_t E, size_t N, size_t K) {
    if (op == GROUPED_FWD)
        grouped_sm90_run<GroupedSm90<Row, Col, GroupedSm90RowsEpilogue>, GROUPED_FWD>(a, b, d, offsets, (int)E, (int)N, (int)K);
    else if (op == GROUPED_DGRAD)
        grouped_sm90_run<GroupedSm90<Row, Row, GroupedSm90RowsEpilogue>, GROUPED_DGRAD>(a, b, d, offsets, (int)E, (int)N, (int)K);
    else if (op == GROUPED_WGRAD)
        grouped_sm90_run<GroupedSm90Wgrad<true>, GROUPED_WGRAD>(a, b, d, offsets, (int)E, (int)N, (int)K);
    else
        grouped_sm90_run<GroupedSm90Wgrad<false>, GROUPED_WGRAD_SET>(a, b, d, offsets, (int)E, (int)N, (int)K);
}

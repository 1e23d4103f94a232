// Expert GEMMs in FP8 on Hopper (the DeepSeek-V3 recipe of ops/fp8.h) through CUTLASS's sm90
// grouped GEMM with blockwise scaling: E4M3 operands, both K-contiguous (the only layout Hopper's
// FP8 tensor cores read), fp32 scales loaded per tile beside the TMA loads, wgmma partial sums
// promoted to fp32 accumulators with their scales every 128 along K. Per-expert problems are
// written on the device from the row offsets (cuda_grouped_sm90.cuh).
#include "cuda_grouped_sm90.cuh"
#include "cuda_fp8_mainloop.cuh"

using namespace cute;

// One FP8 product type: out = a . b^T with a's scales per row and 128 along K, b's per
// GRANULARITY_N rows (128: weights, or token-major activations, in 128x128 blocks; 1: token-major
// activations in 1x128 blocks) and 128 along K;
// the scales of each expert are a packed block-major matrix (the row index fastest), as
// fp8_quantize_rows, _cols and _weights write them. Tiles of TileShape (128 x 128 x 128, or 128 x
// 256 x 128 for the rows products and the weight gradients with x in 128x128 blocks) on two
// consumer warpgroups, clusters of ClusterShape sharing a tile of a (clusters of 2 along N) or of b
// (along M) through TMA multicast; the output written from the registers by Epilogue (the rows
// products' bf16 by GroupedSm90RowsEpilogue, the weight gradients' fp32 by
// GroupedSm90StoreEpilogue<float, ...>). With b's scales in 128x128 blocks the consumers run the
// loop of cuda_fp8_mainloop.cuh, which promotes each batch beside the next one's (the same bits,
// 2-4% faster alone), a 64-column slice of the tile at a time on 128 x 256 tiles: the forward, the
// input gradient, and the weight gradient whose x is in 128x128 blocks (FP8_COLS_128X128, the
// experts' by default). The weight gradient with x in 1x128 blocks, whose promotions scale each
// element by a row and a column scale, keeps CUTLASS's: that loop with the two scales spilled
// registers and ran 7-21% slower (docs/PERF.md, 2026-12-01, fourteenth session), and a tile's batch
// split into two 64-column halves, each promoted beside the other's batch, gave the same bits 17%
// slower (2026-12-02, seventeenth session).
using Fp8TileShape = Shape<_128, _128, _128>;
using Fp8ClusterShape = Shape<_1, _2, _1>;
template <int GRANULARITY_N, class Epilogue, class TileShape_ = Fp8TileShape, class ClusterShape_ = Fp8ClusterShape>
struct GroupedSm90Fp8 {
    static constexpr int granularity_n = GRANULARITY_N;
    using TileShape = TileShape_;
    using ClusterShape = ClusterShape_;
    using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, GRANULARITY_N, FP8_BLOCK>;
    using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
    using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
    using Epi = Epilogue;
    using CutlassMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
        cutlass::float_e4m3_t, cute::tuple<cutlass::layout::RowMajor *, LayoutSFA *>, 16,
        cutlass::float_e4m3_t, cute::tuple<cutlass::layout::ColumnMajor *, LayoutSFB *>, 16, float, TileShape,
        ClusterShape,
        cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epi::Op::SharedStorage))>,
        cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8BlockScaledAccum>::CollectiveOp;
    static constexpr int tile_n = size<1>(TileShape{});
    static_assert(tile_n == 128 || (tile_n == 256 && GRANULARITY_N == FP8_BLOCK), "tiles 128 wide, or 256 in slices");
    using Mainloop = cute::conditional_t<GRANULARITY_N == FP8_BLOCK, Fp8PromotingMainloop<CutlassMainloop, tile_n == 128 ? 1 : 4>,
                                         CutlassMainloop>;
    using Kernel = cutlass::gemm::kernel::GemmUniversal<GroupedSm90Problem, Mainloop, typename Epi::Op>;
    using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
    struct Table : GroupedSm90Table<Kernel> {
        const float *sfa[GROUPED_MAX_E], *sfb[GROUPED_MAX_E];
        LayoutSFA lsfa[GROUPED_MAX_E];
        LayoutSFB lsfb[GROUPED_MAX_E];
    };
    static typename Mainloop::Arguments mainloop_arguments(Table *t) {
        return {t->a, t->sa, t->b, t->sb, t->sfa, t->lsfa, t->sfb, t->lsfb};
    }

    // Slot `slot` (after grouped_sm90_set): the scales of the problem (M, N, K) at sfa and sfb.
    __device__ static void set_scales(Table *t, int slot, int M, int N, int K, const float *sfa, const float *sfb) {
        t->sfa[slot] = sfa, t->sfb[slot] = sfb;
        t->lsfa[slot] = ScaleConfig::tile_atom_to_shape_SFA(make_shape(M, N, K, 1));
        t->lsfb[slot] = ScaleConfig::tile_atom_to_shape_SFB(make_shape(M, N, K, 1));
    }
};

// out (rows, N) bf16 = a (rows, K) . b[e] (N, K)^T for the rows of each expert (fp8_grouped_matmul).
// On 128 x 256 tiles (four 64-column slices, clusters of 2 along M sharing b's tile) by default;
// on 128 x 128 tiles with MOE_KERNELS fp8_rows=128.
using Fp8WideTileShape = Shape<_128, _256, _128>;
using Fp8WideClusterShape = Shape<_2, _1, _1>;
using Fp8Rows = GroupedSm90Fp8<FP8_BLOCK, GroupedSm90RowsEpilogue>;
using Fp8RowsWide = GroupedSm90Fp8<FP8_BLOCK, GroupedSm90RowsEpilogue, Fp8WideTileShape, Fp8WideClusterShape>;
// dw[e] (N, K) f32 (+)= dout_t (N, its columns) . x_t (K, its columns)^T (fp8_grouped_matmul_wgrad),
// x_t's scales per column (X_GRANULARITY 1: FP8_COLS_1X128) or per 128 columns (FP8_BLOCK:
// FP8_COLS_128X128) and 128 tokens. With x_t in 128x128 blocks on 128 x 256 tiles in four slices
// (clusters of 2 along M sharing x_t's tile) by default; on 128 x 128 with MOE_KERNELS fp8_wgrad=128.
template <int X_GRANULARITY, bool ACCUMULATE, class TileShape = Fp8TileShape, class ClusterShape = Fp8ClusterShape>
using Fp8Wgrad = GroupedSm90Fp8<X_GRANULARITY, GroupedSm90StoreEpilogue<float, ACCUMULATE>, TileShape, ClusterShape>;
template <bool ACCUMULATE> using Fp8WgradWide = Fp8Wgrad<FP8_BLOCK, ACCUMULATE, Fp8WideTileShape, Fp8WideClusterShape>;

template <class G>
__global__ void grouped_sm90_fp8_prepare_rows(typename G::Table *t, const uint8_t *a, const float *a_scales,
                                              const uint8_t *b, const float *b_scales, bf16 *out,
                                              const int32_t *offsets, int E, int N, int K) {
    __shared__ int32_t rows_of[GROUPED_MAX_E];
    grouped_sm90_rows(rows_of, offsets, E);
    int64_t Kb = (int64_t)fp8_blocks(K), Nb = (int64_t)fp8_blocks(N);
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int64_t row0 = offsets[e];
        int rows = rows_of[e];
        grouped_sm90_set(t, e, rows, N, K, a + row0 * K, K, b + (int64_t)e * N * K, K, out + row0 * N, N);
        G::set_scales(t, e, rows, N, K, a_scales + Kb * row0, b_scales + e * Kb * Nb);
    }
}

// Expert e's columns of the token-major copies start at p = fp8_expert_col(offsets[e], e); its
// scale blocks at p / 128 (rows of N scales for dout_t, of K or Kb for x_t). Slots by falling row
// count (grouped_sm90_slot).
template <class G>
__global__ void grouped_sm90_fp8_prepare_wgrad(typename G::Table *t, const uint8_t *dout_t, const float *dout_scales,
                                               const uint8_t *x_t, const float *x_scales, float *dw,
                                               const int32_t *offsets, int E, int N, int K, int64_t Rt) {
    __shared__ int32_t rows_of[GROUPED_MAX_E];
    grouped_sm90_rows(rows_of, offsets, E);
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int64_t p = (int64_t)fp8_expert_col((size_t)offsets[e], (size_t)e);
        int rows = rows_of[e], slot = grouped_sm90_slot(rows_of, e, E, true), M = rows ? N : 0;
        grouped_sm90_set(t, slot, M, K, rows, dout_t + p, Rt, x_t + p, Rt, dw + (int64_t)e * N * K, K);
        Fp8ColBlocks xb = G::granularity_n == FP8_BLOCK ? FP8_COLS_128X128 : FP8_COLS_1X128;
        G::set_scales(t, slot, M, K, rows, dout_scales + fp8_col_scale_at(p / FP8_BLOCK, 0, N, FP8_COLS_1X128),
                      x_scales + fp8_col_scale_at(p / FP8_BLOCK, 0, K, xb));
    }
}

// The rows product on the kernel G.
template <class G>
static void fp8_rows_run(void *out, const void *a, const void *a_scales, const void *b, const void *b_scales,
                         const int32_t *offsets, size_t E, size_t N, size_t K) {
    grouped_sm90_launch<G>((int)E, [&](typename G::Table *table) {
        grouped_sm90_fp8_prepare_rows<G><<<1, 256, 0, cuda_ctx.stream>>>(
            table, (const uint8_t *)a, (const float *)a_scales, (const uint8_t *)b, (const float *)b_scales,
            (bf16 *)out, offsets, (int)E, (int)N, (int)K);
    });
}

extern "C" void cuda_fp8_grouped_matmul(void *out, const void *a, const void *a_scales, const void *b,
                                        const void *b_scales, const int32_t *offsets, size_t E, size_t N, size_t K,
                                        size_t R) {
    auto run = cuda_ctx.fp8_rows_128 ? fp8_rows_run<Fp8Rows> : fp8_rows_run<Fp8RowsWide>;
    run(out, a, a_scales, b, b_scales, offsets, E, N, K);
}

// The weight gradient on the kernel G (with ACCUMULATE, dw added to; without, experts of no rows zeroed).
template <class G>
static void fp8_wgrad_run(void *dw, const void *dout_t, const void *dout_scales, const void *x_t, const void *x_scales,
                          const int32_t *offsets, size_t E, size_t N, size_t K, size_t R) {
    if (!G::Epi::accumulate) cuda_grouped_zero_empty((float *)dw, offsets, E, N * K);
    grouped_sm90_launch<G>((int)E, [&](typename G::Table *table) {
        grouped_sm90_fp8_prepare_wgrad<G><<<1, 256, 0, cuda_ctx.stream>>>(
            table, (const uint8_t *)dout_t, (const float *)dout_scales, (const uint8_t *)x_t, (const float *)x_scales,
            (float *)dw, offsets, (int)E, (int)N, (int)K, (int64_t)fp8_expert_cols(R, E));
    });
}

// The weight-gradient kernel for the input's blocks (128 x 128 on 128 x 256 tiles when wide) that adds dw to
// (ACCUMULATE) or writes it.
template <bool ACCUMULATE>
static decltype(&fp8_wgrad_run<Fp8Wgrad<1, ACCUMULATE>>) fp8_wgrad_pick(bool block, bool wide) {
    if (wide) return fp8_wgrad_run<Fp8WgradWide<ACCUMULATE>>;
    return block ? fp8_wgrad_run<Fp8Wgrad<FP8_BLOCK, ACCUMULATE>> : fp8_wgrad_run<Fp8Wgrad<1, ACCUMULATE>>;
}

// One group (offsets NULL, a dense layer's) runs on cuBLASLt where it can.
extern "C" void cuda_fp8_grouped_matmul_wgrad(void *dw, const void *dout_t, const void *dout_scales, const void *x_t,
                                              const void *x_scales, Fp8ColBlocks x_blocks, const int32_t *offsets,
                                              size_t E, size_t N, size_t K, size_t R, bool accumulate) {
    if (!offsets) {
        if (cuda_lt_fp8_wgrad((float *)dw, dout_t, dout_scales, x_t, x_scales, x_blocks, N, K, R, fp8_expert_cols(R, 1),
                              accumulate))
            return;
        offsets = cuda_fp8_one_group(R);
    }
    bool block = x_blocks == FP8_COLS_128X128, wide = block && !cuda_ctx.fp8_wgrad_128;
    auto run = accumulate ? fp8_wgrad_pick<true>(block, wide) : fp8_wgrad_pick<false>(block, wide);
    run(dw, dout_t, dout_scales, x_t, x_scales, offsets, E, N, K, R);
}

// Expert GEMMs in FP8 on Hopper (the DeepSeek-V3 recipe of ops/fp8.h) through CUTLASS's sm90
// grouped GEMM with blockwise scaling: E4M3 operands, both K-contiguous (the only layout Hopper's
// FP8 tensor cores read), fp32 scales loaded per tile beside the TMA loads, wgmma partial sums
// promoted to fp32 accumulators with their scales every 128 along K. Per-expert problems are
// written on the device from the row offsets (cuda_grouped_sm90.cuh).
#include "cuda_grouped_sm90.cuh"
#include "cuda_fp8_mainloop.cuh"

using namespace cute;

// One FP8 product type: out = a . b^T with a's scales per row and 128 along K, b's per
// GRANULARITY_N rows (128: weights, or token-major activations, in 128x128 blocks; FP8_WIDE, 64: the
// same blocks with each scale written twice, for tiles 192 wide; 1: token-major activations in
// 1x128 blocks) and 128 along K; the scales of each expert are a packed block-major matrix (the row
// index fastest), as fp8_quantize_rows, _cols and _weights write them. Tiles of TileShape on two
// consumer warpgroups, clusters of ClusterShape sharing a tile of a (clusters along N) or of b
// (along M) through TMA multicast; the output written by Epilogue (the rows products' bf16 by
// GroupedSm90RowsEpilogue, the weight gradients' fp32 by GroupedSm90StoreEpilogue). With b's scales in
// column blocks (the forward, the input gradient, and the weight gradient whose x is in 128x128
// blocks, FP8_COLS_128X128, the experts' by default) the consumers run the loop of
// cuda_fp8_mainloop.cuh that promotes each batch beside the next one (the same bits, 2-4% faster
// alone on 128 x 128 tiles), a 128-wide slice of the tile at a time (one), 96 (two on 192-wide
// tiles) or 64 (four on 256-wide ones). The weight gradient with x in 1x128 blocks, whose
// promotions scale each element by a row and a column scale, keeps CUTLASS's: that loop with the
// two scales spilled registers and ran 7-21% slower (docs/PERF.md, 2026-12-01, fourteenth session),
// and a tile's batch split into two 64-column halves, each promoted beside the other's batch, gave
// the same bits 17% slower (2026-12-02, seventeenth session).
#define FP8_WIDE (FP8_BLOCK / 2)
__host__ __device__ constexpr int64_t fp8_wide_blocks(int64_t n) { return (n + FP8_WIDE - 1) / FP8_WIDE; }
using Fp8ClusterAlongN = Shape<_1, _2, _1>;
using Fp8ClusterAlongM = Shape<_2, _1, _1>;
template <int GRANULARITY_N, class Epilogue, class TileShape_ = Shape<_128, _128, _128>,
          class ClusterShape_ = Fp8ClusterAlongN>
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
    // slices of the tile our loop promotes in turn: 128, 96 or 64 columns wide
    static constexpr int tile_n = size<1>(TileShape{}), slices = tile_n == 128 ? 1 : tile_n == 192 ? 2 : 4;
    static_assert(tile_n == 128 || tile_n == 192 || tile_n == 256, "tiles 128, 192 or 256 wide");
    static_assert(GRANULARITY_N == 1 || GRANULARITY_N == (tile_n == 192 ? FP8_WIDE : FP8_BLOCK),
                  "b's scale blocks tile the tile: 64 wide on 192-wide tiles, else 128");
    using Mainloop = cute::conditional_t<GRANULARITY_N == 1, CutlassMainloop, Fp8PromotingMainloop<CutlassMainloop, slices>>;
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

// The product types of tile T (Fp8Tile): b's scales in 128-wide blocks, 64-wide (widened) on
// 192-wide tiles; clusters along N on 128 x 128 tiles and the "n" choices, else along M.
template <Fp8Tile T, class Epilogue> struct Fp8Tiled {
    static constexpr int n = T == FP8_TILE_128 ? 128 : T == FP8_TILE_192 || T == FP8_TILE_192N ? 192 : 256;
    using Shape = cute::Shape<_128, Int<n>, _128>;
    using Cluster = cute::conditional_t<T == FP8_TILE_128 || T == FP8_TILE_192N || T == FP8_TILE_256N,
                                        Fp8ClusterAlongN, Fp8ClusterAlongM>;
    using Product = GroupedSm90Fp8<n == 192 ? FP8_WIDE : FP8_BLOCK, Epilogue, Shape, Cluster>;
};
// out (rows, N) bf16 = a (rows, K) . b[e] (N, K)^T for the rows of each expert (fp8_grouped_matmul).
// On 128 x 192 tiles a K step's main loop moves 120 KB of shared memory (a's tile read once a
// slice) for 1.5x the multiply-adds of a 128 x 128 one's 80 KB (docs/FP8.md).
template <Fp8Tile T> using Fp8Rows = typename Fp8Tiled<T, GroupedSm90RowsEpilogue>::Product;
// dw[e] (N, K) f32 (+)= dout_t (N, its columns) . x_t (K, its columns)^T (fp8_grouped_matmul_wgrad),
// x_t's scales per column (X_GRANULARITY 1: FP8_COLS_1X128, on 128 x 128 tiles) or per 128 columns
// and 128 tokens (FP8_COLS_128X128, on the tiles of T).
// Written from the registers, or through CUTLASS's TMA epilogue (TMA: MOE_KERNELS
// wgrad_epilogue=tma, on 128 x 128 tiles).
template <Fp8Tile T, bool ACCUMULATE, bool TMA = false>
using Fp8WgradBlocks = typename Fp8Tiled<
    T, cute::conditional_t<TMA, GroupedSm90Epilogue<typename Fp8Tiled<T, GroupedSm90RowsEpilogue>::Shape,
                                                    typename Fp8Tiled<T, GroupedSm90RowsEpilogue>::Cluster, float, ACCUMULATE>,
                           GroupedSm90StoreEpilogue<float, ACCUMULATE>>>::Product;
template <bool ACCUMULATE>
using Fp8WgradCols = GroupedSm90Fp8<1, GroupedSm90StoreEpilogue<float, ACCUMULATE>>;

// Scales (rows, Nb) in blocks 128 wide along N (Nb = fp8_blocks(N)) into wide (rows, Nw) in blocks
// 64 wide, Nw = fp8_wide_blocks(N), each scale written twice (a 192-wide tile straddles 128-wide
// blocks; its promotion finds each column's scale at column / 64), by the whole grid.
__device__ void fp8_widen_scales(float *wide, const float *scales, int64_t rows, int N) {
    int64_t Nb = fp8_blocks(N), Nw = fp8_wide_blocks(N), n = rows * Nw;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        wide[i] = scales[i / Nw * Nb + i % Nw / 2];
}

// Scratch for product G's b scales, (rows, N) widened, and the grid of the kernel that widens them
// and writes the table: one block where G's scales are used as they are.
struct Fp8Wide {
    float *at;
    int blocks;
};
template <class G> static Fp8Wide fp8_wide(size_t rows, size_t N) {
    static void *buf;
    static size_t have;
    if (G::granularity_n != FP8_WIDE) return {NULL, 1};
    size_t n = rows * fp8_wide_blocks(N);
    return {(float *)cuda_grow_scratch(&buf, &have, n * sizeof(float)),
            (int)std::min<size_t>(std::max<size_t>((n + 255) / 256, 1), (size_t)cuda_ctx.sm_count)};
}

// The table of product G (block 0), b's scales first widened into b_wide where G's blocks are
// FP8_WIDE (the whole grid: the product, queued next, reads them).
template <class G>
__global__ void grouped_sm90_fp8_prepare_rows(typename G::Table *t, const uint8_t *a, const float *a_scales,
                                              const uint8_t *b, const float *b_scales, float *b_wide, bf16 *out,
                                              const int32_t *offsets, int E, int N, int K) {
    int64_t Kb = (int64_t)fp8_blocks(K), Nb = (int64_t)fp8_blocks(N);
    if constexpr (G::granularity_n == FP8_WIDE) {
        fp8_widen_scales(b_wide, b_scales, E * Kb, N);
        b_scales = b_wide, Nb = fp8_wide_blocks(N);
    }
    if (blockIdx.x) return;
    __shared__ int32_t rows_of[GROUPED_MAX_E];
    grouped_sm90_rows(rows_of, offsets, E);
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int64_t row0 = offsets[e];
        int rows = rows_of[e];
        grouped_sm90_set(t, e, rows, N, K, a + row0 * K, K, b + (int64_t)e * N * K, K, out + row0 * N, N);
        G::set_scales(t, e, rows, N, K, a_scales + Kb * row0, b_scales + e * Kb * Nb);
    }
}

// Expert e's columns of the token-major copies start at p = fp8_expert_col(offsets[e], e); its
// scale blocks at p / 128 (rows of N scales for dout_t, of K, Kb or fp8_wide_blocks(K) for x_t, the
// latter widened into x_wide by the whole grid first). Slots by falling row count
// (grouped_sm90_slot).
template <class G>
__global__ void grouped_sm90_fp8_prepare_wgrad(typename G::Table *t, const uint8_t *dout_t, const float *dout_scales,
                                               const uint8_t *x_t, const float *x_scales, float *x_wide, float *dw,
                                               const int32_t *offsets, int E, int N, int K, int64_t Rt) {
    int64_t x_row = fp8_col_scales(K, G::granularity_n == 1 ? FP8_COLS_1X128 : FP8_COLS_128X128);
    if constexpr (G::granularity_n == FP8_WIDE) {
        fp8_widen_scales(x_wide, x_scales, Rt / FP8_BLOCK, K);
        x_scales = x_wide, x_row = fp8_wide_blocks(K);
    }
    if (blockIdx.x) return;
    __shared__ int32_t rows_of[GROUPED_MAX_E];
    grouped_sm90_rows(rows_of, offsets, E);
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int64_t p = (int64_t)fp8_expert_col((size_t)offsets[e], (size_t)e);
        int rows = rows_of[e], slot = grouped_sm90_slot(rows_of, e, E, true), M = rows ? N : 0;
        grouped_sm90_set(t, slot, M, K, rows, dout_t + p, Rt, x_t + p, Rt, dw + (int64_t)e * N * K, K);
        G::set_scales(t, slot, M, K, rows, dout_scales + fp8_col_scale_at(p / FP8_BLOCK, 0, N, FP8_COLS_1X128),
                      x_scales + p / FP8_BLOCK * x_row);
    }
}

// The rows product on the kernel G.
template <class G>
static void fp8_rows_run(void *out, const void *a, const void *a_scales, const void *b, const void *b_scales,
                         const int32_t *offsets, size_t E, size_t N, size_t K) {
    Fp8Wide wide = fp8_wide<G>(E * fp8_blocks(K), N);
    grouped_sm90_launch<G>((int)E, [&](typename G::Table *table) {
        grouped_sm90_fp8_prepare_rows<G><<<wide.blocks, 256, 0, cuda_ctx.stream>>>(
            table, (const uint8_t *)a, (const float *)a_scales, (const uint8_t *)b, (const float *)b_scales, wide.at,
            (bf16 *)out, offsets, (int)E, (int)N, (int)K);
    });
}

extern "C" void cuda_fp8_grouped_matmul(void *out, const void *a, const void *a_scales, const void *b,
                                        const void *b_scales, const int32_t *offsets, size_t E, size_t N, size_t K,
                                        size_t R) {
    static decltype(&fp8_rows_run<Fp8Rows<FP8_TILE_128>>) const runs[] = {
        fp8_rows_run<Fp8Rows<FP8_TILE_128>>, fp8_rows_run<Fp8Rows<FP8_TILE_192>>, fp8_rows_run<Fp8Rows<FP8_TILE_192N>>,
        fp8_rows_run<Fp8Rows<FP8_TILE_256>>, fp8_rows_run<Fp8Rows<FP8_TILE_256N>>};
    runs[cuda_ctx.fp8_rows](out, a, a_scales, b, b_scales, offsets, E, N, K);
}

// The weight gradient on the kernel G (with ACCUMULATE, dw added to; without, experts of no rows zeroed).
template <class G>
static void fp8_wgrad_run(void *dw, const void *dout_t, const void *dout_scales, const void *x_t, const void *x_scales,
                          const int32_t *offsets, size_t E, size_t N, size_t K, size_t R) {
    if (!G::Epi::accumulate) cuda_grouped_zero_empty((float *)dw, offsets, E, N * K);
    size_t Rt = fp8_expert_cols(R, E);
    Fp8Wide wide = fp8_wide<G>(Rt / FP8_BLOCK, K);
    grouped_sm90_launch<G>((int)E, [&](typename G::Table *table) {
        grouped_sm90_fp8_prepare_wgrad<G><<<wide.blocks, 256, 0, cuda_ctx.stream>>>(
            table, (const uint8_t *)dout_t, (const float *)dout_scales, (const uint8_t *)x_t, (const float *)x_scales,
            wide.at, (float *)dw, offsets, (int)E, (int)N, (int)K, (int64_t)Rt);
    });
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
    using Run = decltype(&fp8_wgrad_run<Fp8WgradCols<true>>);
    static Run const blocks[][2] = {
        {fp8_wgrad_run<Fp8WgradBlocks<FP8_TILE_128, false>>, fp8_wgrad_run<Fp8WgradBlocks<FP8_TILE_128, true>>},
        {fp8_wgrad_run<Fp8WgradBlocks<FP8_TILE_192, false>>, fp8_wgrad_run<Fp8WgradBlocks<FP8_TILE_192, true>>},
        {NULL, NULL},
        {fp8_wgrad_run<Fp8WgradBlocks<FP8_TILE_256, false>>, fp8_wgrad_run<Fp8WgradBlocks<FP8_TILE_256, true>>}};
    static Run const tma[2] = {fp8_wgrad_run<Fp8WgradBlocks<FP8_TILE_128, false, true>>,
                               fp8_wgrad_run<Fp8WgradBlocks<FP8_TILE_128, true, true>>};
    bool on_tma = cuda_ctx.wgrad_tma_epilogue && cuda_ctx.fp8_wgrad == FP8_TILE_128;
    auto run = x_blocks == FP8_COLS_128X128 ? (on_tma ? tma : blocks[cuda_ctx.fp8_wgrad])[accumulate]
               : accumulate                 ? fp8_wgrad_run<Fp8WgradCols<true>>
                                            : fp8_wgrad_run<Fp8WgradCols<false>>;
    run(dw, dout_t, dout_scales, x_t, x_scales, offsets, E, N, K, R);
}

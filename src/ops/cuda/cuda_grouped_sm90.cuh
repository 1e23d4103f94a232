// What the grouped products on CUTLASS's sm90 kernels share (bf16 in cuda_grouped_sm90.cu, FP8 in
// cuda_grouped_sm90_fp8.cu): the epilogues, the per-expert argument table in device memory that a
// small kernel fills from the row offsets before each product (no count travels to the host, so a
// launch can be recorded in a CUDA graph), the order of its slots, and the launch that makes the
// CUTLASS parameters once per expert count. Each expert gets its own TMA descriptors (CUTLASS
// rewrites them on the device), so a tile never reads or writes past its expert's rows.
#pragma once
#include <stdlib.h>
#include <string.h>

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

using GroupedSm90Problem = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>; // (M, N, K) per expert

// fp32 accumulators to ElementD row-major, the output read back and added (beta = 1) when
// ACCUMULATE, on the two consumer warpgroups of the cooperative kernels, through CUTLASS's TMA
// epilogue: the bf16 weight gradients' (fp32; FP8's are written by the store epilogue below).
template <class TileShape, class ClusterShape, class ElementD, bool ACCUMULATE> struct GroupedSm90Epilogue {
    using ElementC = cute::conditional_t<ACCUMULATE, ElementD, void>;
    static constexpr bool accumulate = ACCUMULATE;
    static constexpr int ALIGN_D = 16 / sizeof(ElementD);
    using Op = typename cutlass::epilogue::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
        cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, cutlass::layout::RowMajor *,
        ALIGN_D, ElementD, cutlass::layout::RowMajor *, ALIGN_D, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
        cutlass::epilogue::fusion::LinearCombination<ElementD, float>>::CollectiveOp;
};

// Lane q of each quad of lanes holds words w[j] = m[q][j] of a 4 x 4 matrix of words m; returns
// column q of it, (m[0][q], m[1][q], m[2][q], m[3][q]), by two exchanges of two words.
__device__ inline uint4 quad_transpose(const uint32_t w[4], int q) {
    bool b0 = q & 1, b1 = q >> 1;
    // Across lanes q ^ 2: lane q keeps the half of its row m[q] that holds column q and gets the
    // same half of row m[q ^ 2].
    uint32_t a0 = b1 ? w[2] : w[0], a1 = b1 ? w[3] : w[1];
    uint32_t y0 = __shfl_xor_sync(0xffffffffu, b1 ? w[0] : w[2], 2);
    uint32_t y1 = __shfl_xor_sync(0xffffffffu, b1 ? w[1] : w[3], 2);
    // Across lanes q ^ 1: the words of column q that lane q ^ 1 holds (rows q ^ 1 and q ^ 3).
    uint32_t r0 = __shfl_xor_sync(0xffffffffu, b0 ? a0 : a1, 1);
    uint32_t r1 = __shfl_xor_sync(0xffffffffu, b0 ? y0 : y1, 1);
    uint32_t own = b0 ? a1 : a0, other = b0 ? y1 : y0; // rows q and q ^ 2
    uint32_t u0 = b0 ? r0 : own, u1 = b0 ? own : r0, v0 = b0 ? r1 : other, v1 = b0 ? other : r1;
    return b1 ? make_uint4(v0, v1, u0, u1) : make_uint4(u0, u1, v0, v1);
}

// The epilogue that stores the fp32 accumulators straight from the consumer warpgroups' registers,
// with no shared memory and no barrier, so that a tile's stores drain while the next tile's main
// loop runs. CUTLASS's TMA epilogue writes each 128 x 32 subtile to shared memory, waits at a
// barrier, and waits for the store of the subtile two before; CUTLASS's own direct-store epilogue for
// grouped kernels stores one value at a time.
// - bf16 out (the rows products, forward and input gradient, bf16 and FP8): rounded to bf16 and
//   stored 16 bytes (8 columns of a row) a store after a transpose within each quad of lanes.
//   Measured (docs/PERF.md, 2026-12-03, twenty-sixth session): the FP8 rows products 1-5% faster
//   alone (2% over scale-E8's products) and 52.6 -> 49.9 ms a step on olmoe-L8 (+0.7% tokens/s),
//   bf16 +0.3% tokens/s; 4-byte stores of column pairs instead ran 25% slower, the TMA epilogue on
//   one 128 x 128 subtile 3% slower.
// - fp32 out, ACCUMULATE or not (the FP8 weight gradients): each lane's column pair stored as it
//   is, 8 bytes, a quad's four covering a row's 32-byte sector, after adding the pair read from the
//   output when accumulating (out = acc + out, as CUTLASS's epilogue computes with alpha 1 and beta
//   1: the same bits). With CUTLASS's TMA epilogue and no source, ptxas kept the main loop's
//   pipeline state in ordinary registers and moved each wgmma descriptor to uniform ones (265
//   instructions a warp a turn of two K tiles against 241), and the FP8 weight gradients ran 4-9%
//   slower than with this one (docs/PERF.md, 2026-12-05, thirty-seventh session). The bf16 weight
//   gradient keeps CUTLASS's: with this one its up+gate product ran 1-6% slower.
// The stores are streaming (`__stcs`, st.global.cs: first out of L2), so that the outputs, written
// once and read by a later kernel, do not push the operands' tiles that other thread blocks still
// read out of L2: on one machine of the pool the products ran 7-25% faster alone with them (bf16 and
// FP8) and olmoe-L8's step ~1.6% faster, on another at the same speed (twenty-seventh session).
// The base supplies the arguments, parameters and checks of CUTLASS's direct-store epilogue.
using GroupedSm90StoreStride = cutlass::detail::TagToStrideC_t<cutlass::layout::RowMajor *>;
template <class ElementD, bool ACCUMULATE>
using GroupedSm90StoreBase = cutlass::epilogue::collective::DefaultEpilogueArray<
    cute::conditional_t<ACCUMULATE, ElementD, void>, GroupedSm90StoreStride, GroupedSm90StoreStride,
    cutlass::epilogue::thread::LinearCombination<ElementD, 1, float, float,
                                                 ACCUMULATE ? cutlass::epilogue::thread::ScaleType::Default
                                                            : cutlass::epilogue::thread::ScaleType::OnlyAlphaScaling>,
    cutlass::epilogue::PtrArrayNoSmemWarpSpecialized>;
template <class ElementD, bool ACCUMULATE> struct GroupedSm90Store : GroupedSm90StoreBase<ElementD, ACCUMULATE> {
    using Base = GroupedSm90StoreBase<ElementD, ACCUMULATE>;
    using typename Base::Params;
    static_assert(std::is_same_v<ElementD, cutlass::bfloat16_t> ? !ACCUMULATE : std::is_same_v<ElementD, float>,
                  "bf16 out, or fp32 out accumulated or not");
    Params out; // the base's copy is private
    CUTLASS_HOST_DEVICE GroupedSm90Store(Params const &params) : Base(params), out(params) {}

    // The tile at blk_coord_mnkl of the problem (M, N) from this thread's accumulators.
    template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
              class TiledMma, class ResidueMNK>
    CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_MNK,
                                   BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout> const &accumulators,
                                   TiledMma tiled_mma, ResidueMNK, int thread_idx, char *) {
        using namespace cute;
        int M = get<0>(problem_shape_mnkl), N = get<1>(problem_shape_mnkl);
        auto m_coord = get<0>(blk_coord_mnkl), n_coord = get<1>(blk_coord_mnkl), l_coord = get<3>(blk_coord_mnkl);
        auto tile = [&](auto *ptr, auto stride) { // this thread's (MMA, MMA_M, MMA_N) of the tile at ptr
            Tensor m = make_tensor(make_gmem_ptr(ptr), make_shape(M, N, 1),
                                   cutlass::epilogue::collective::detail::get_epilogue_stride<
                                       cutlass::epilogue::PtrArrayNoSmemWarpSpecialized>(stride)); // (M, N, 1)
            Tensor g = local_tile(m, blk_shape_MNK, make_coord(_, _, _), Step<_1, _1, Underscore>{})(_, _, m_coord, n_coord, 0);
            return tiled_mma.get_thread_slice(thread_idx).partition_C(g);
        };
        Tensor tCgD = tile(out.ptr_D[l_coord], out.dD[l_coord]);
        Tensor tCcD = tiled_mma.get_thread_slice(thread_idx)
                          .partition_C(local_tile(make_identity_tensor(make_shape(M, N)), take<0, 2>(blk_shape_MNK),
                                                  make_coord(m_coord, n_coord))); // (row, column) of each value
        // A thread's values in the wgmma layout, (2 columns, 2 rows 8 apart, BLK_N / 8 groups of 8
        // columns): value i = c + 2 r + 4 g; lane q of a quad holds columns 2q and 2q + 1 of each
        // group of the quad's two rows (N is a multiple of 8: a group lies within or past it).
        static_assert(size<0>(FrgLayout{}) % 16 == 0, "the wgmma accumulator layout, groups of 4 x 8 columns");
        int q = threadIdx.x & 3;
        if constexpr (std::is_same_v<ElementD, float>) {
            auto tCgC = [&] { // the source read back when accumulating
                if constexpr (ACCUMULATE) return tile(out.ptr_C[l_coord], out.dC[l_coord]);
                else return tCgD;
            }();
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < size(accumulators); i += 2) {
                auto at = tCcD(i);
                if (get<0>(at) >= M || get<1>(at) >= N) continue;
                float2 v = make_float2(accumulators(i), accumulators(i + 1));
                if constexpr (ACCUMULATE) {
                    float2 c = __ldcs((float2 const *)&tCgC(i));
                    v.x += c.x, v.y += c.y;
                }
                __stcs((float2 *)&tCgD(i), v);
            }
        } else { // four groups at a time, lane q storing group 4 s + q of a row
            CUTLASS_PRAGMA_UNROLL
            for (int base = 0; base < size(accumulators); base += 16) {
                CUTLASS_PRAGMA_UNROLL
                for (int r = 0; r < 2; r++) {
                    uint32_t w[4];
                    CUTLASS_PRAGMA_UNROLL
                    for (int j = 0; j < 4; j++) {
                        __nv_bfloat162 v = __floats2bfloat162_rn(accumulators(base + 2 * r + 4 * j),
                                                                 accumulators(base + 2 * r + 4 * j + 1));
                        w[j] = *(uint32_t *)&v;
                    }
                    uint4 piece = quad_transpose(w, q);
                    int i = base + 2 * r + 4 * q; // this lane's value of the group it stores
                    auto at = tCcD(i);
                    if (get<0>(at) < M && get<1>(at) - 2 * q < N) __stcs((uint4 *)(&tCgD(i) - 2 * q), piece);
                }
            }
        }
    }
};
template <class ElementD, bool ACCUMULATE> struct GroupedSm90StoreEpilogue {
    static constexpr bool accumulate = ACCUMULATE;
    using ElementC = cute::conditional_t<ACCUMULATE, ElementD, void>;
    using Op = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<GroupedSm90Store<ElementD, ACCUMULATE>>;
};
using GroupedSm90RowsEpilogue = GroupedSm90StoreEpilogue<cutlass::bfloat16_t, false>;

// Per-expert arguments of a grouped kernel, in device memory (slot order: grouped_sm90_slot).
template <class Kernel> struct GroupedSm90Table {
    using ElementA = typename Kernel::CollectiveMainloop::ElementA;
    using ElementB = typename Kernel::CollectiveMainloop::ElementB;
    using ElementD = typename Kernel::CollectiveEpilogue::ElementD;
    typename GroupedSm90Problem::UnderlyingProblemShape shape[GROUPED_MAX_E];
    const ElementA *a[GROUPED_MAX_E];
    const ElementB *b[GROUPED_MAX_E];
    ElementD *d[GROUPED_MAX_E];
    typename Kernel::InternalStrideA sa[GROUPED_MAX_E];
    typename Kernel::InternalStrideB sb[GROUPED_MAX_E];
    typename Kernel::InternalStrideD sd[GROUPED_MAX_E];
};

// A packed stride of one of CUTLASS's (rows, cols, batch) stride types: the one dynamic mode gets
// the leading dimension `ld`, the others are compile-time 1 and 0.
template <class Stride> __device__ Stride packed_stride(int64_t ld) {
    Stride s{};
    if constexpr (!cute::is_static<decltype(cute::get<0>(s))>::value) cute::get<0>(s) = ld;
    else cute::get<1>(s) = ld;
    return s;
}

// Slot `slot` of a table: the problem (M, N, K) on a (leading dimension lda), b and d.
template <class Table>
__device__ void grouped_sm90_set(Table *t, int slot, int M, int N, int K, const void *a, int64_t lda, const void *b,
                                 int64_t ldb, void *d, int64_t ldd) {
    t->shape[slot] = {M, N, K};
    t->a[slot] = (const typename Table::ElementA *)a;
    t->b[slot] = (const typename Table::ElementB *)b;
    t->d[slot] = (typename Table::ElementD *)d;
    t->sa[slot] = packed_stride<cute::remove_reference_t<decltype(t->sa[0])>>(lda);
    t->sb[slot] = packed_stride<cute::remove_reference_t<decltype(t->sb[0])>>(ldb);
    t->sd[slot] = packed_stride<cute::remove_reference_t<decltype(t->sd[0])>>(ldd);
}

// Rows of each expert into shared memory rows_of (E) from offsets (E + 1), by the whole block.
__device__ inline void grouped_sm90_rows(int32_t *rows_of, const int32_t *offsets, int E) {
    for (int e = threadIdx.x; e < E; e += blockDim.x) rows_of[e] = offsets[e + 1] - offsets[e];
    __syncthreads();
}

// The persistent grid hands out tiles in table order, CTA i taking tiles i, i + grid, ... A weight
// gradient tile costs its expert's row count, so there (by_rows) the table lists the experts by
// falling row count (longest first: the tiles of the large experts spread over all CTAs instead of
// piling onto some when the loads are skewed); the other products' tiles cost the same, in expert
// order. e's slot is the number of experts before it in that order.
__device__ inline int grouped_sm90_slot(const int32_t *rows_of, int e, int E, bool by_rows) {
    if (!by_rows) return e;
    int slot = 0, rows = rows_of[e];
    for (int j = 0; j < E; j++) slot += rows_of[j] > rows || (rows_of[j] == rows && j < e);
    return slot;
}

// How the persistent grid runs, experiments' knobs read once (values outside those below are
// fatal). Waves: MOE_GROUPED_WAVES thread blocks per SM (default 1, at most 16). CUTLASS hands each
// block a fixed share of the tiles, so when another kernel holds some SMs (row pushes beside the
// experts, parallel.exchange_chunks) the blocks that wait for them finish late; with more blocks
// than SMs the hardware fills SMs as they free up and the wait costs a fraction of a share
// (scripts/gpu_multi.sh chunks). Tile order within an expert: MOE_GROUPED_RASTER n (default:
// consecutive tiles along N, so that a wave reads a few 128-row strips of a, each once from memory,
// and b, an expert's weights, from L2) or m (CUTLASS's default: along M, so that every strip of N
// tiles reads all of a again, from memory where a does not fit L2: a bf16 expert of 16,384 rows of
// 2,048 is 64 MiB); MOE_GROUPED_SWIZZLE 1 (default) to 8 (the order runs in strips 1, 2, 4 or 8
// tiles wide: CUTLASS rounds down to a power of two). Measured in docs/PERF.md (2026-12-02,
// seventeenth session).
struct GroupedSm90Knobs {
    int waves, swizzle;
    bool along_m;
};
static GroupedSm90Knobs grouped_knobs(void) {
    static GroupedSm90Knobs k;
    if (!k.waves) {
        const char *raster = getenv("MOE_GROUPED_RASTER");
        MOE_CHECK(!raster || !strcmp(raster, "m") || !strcmp(raster, "n"),
                  "MOE_GROUPED_RASTER = '%s' must be m (tiles along M) or n (along N, the default)", raster);
        k = {(int)moe_env_int("MOE_GROUPED_WAVES", 1, 1, 16), (int)moe_env_int("MOE_GROUPED_SWIZZLE", 1, 1, 8),
             raster && !strcmp(raster, "m")};
    }
    return k;
}

// The expert counts whose initialised CUTLASS state one product type keeps (a step alternates
// between a chunk of experts and a dense layer's one group; benches try more, one at a time).
#define GROUPED_SM90_COUNTS 4

// Writes the table (`prepare(table)` queues the kernel that does), then runs product G. The
// CUTLASS parameters point at the table (not at its contents), so they are made once per expert
// count (kept for the last GROUPED_SM90_COUNTS counts, as the calls of a step alternate between
// counts and nothing may be allocated while a step is being recorded) and every later call (or graph
// replay) only launches; the table of each product type is rewritten in stream order before its
// use. G provides Epi (its GroupedSm90Epilogue or GroupedSm90StoreEpilogue), Gemm, Table and
// mainloop_arguments(table).
template <class G, class Prepare> static void grouped_sm90_launch(int E, Prepare prepare) {
    static typename G::Table *table;
    static struct {
        int E;
        typename G::Gemm gemm;
        void *workspace;
    } ready[GROUPED_SM90_COUNTS];
    static int made; // states made so far: slot made % GROUPED_SM90_COUNTS is the next to (re)make
    if (!table) CUDA_CHECK(cudaMalloc(&table, sizeof *table));
    prepare(table);
    CUDA_LAUNCH_CHECK();
    int i = 0;
    while (i < GROUPED_SM90_COUNTS && !(i < made && ready[i].E == E)) i++;
    if (i == GROUPED_SM90_COUNTS) {
        i = made++ % GROUPED_SM90_COUNTS;
        if (ready[i].workspace) CUDA_CHECK(cudaFree(ready[i].workspace));
        cutlass::KernelHardwareInfo hw;
        CUDA_CHECK(cudaGetDevice(&hw.device_id));
        GroupedSm90Knobs knobs = grouped_knobs();
        hw.sm_count = cuda_ctx.sm_count * knobs.waves;
        using SourcePtrs = typename G::Epi::ElementC const **; // C, the output read back when accumulating
        SourcePtrs c = nullptr;
        if constexpr (G::Epi::accumulate) c = (SourcePtrs)table->d;
        typename G::Gemm::Arguments args{
            cutlass::gemm::GemmUniversalMode::kGrouped,
            {E, table->shape, nullptr},
            G::mainloop_arguments(table),
            {{}, c, table->sd, table->d, table->sd},
            hw};
        args.scheduler.max_swizzle_size = knobs.swizzle;
        args.scheduler.raster_order = knobs.along_m ? decltype(args.scheduler.raster_order)::AlongM
                                                    : decltype(args.scheduler.raster_order)::AlongN;
        args.epilogue.thread.alpha = 1.0f;
        args.epilogue.thread.beta = G::Epi::accumulate ? 1.0f : 0.0f;
        CUTLASS_CHECK(ready[i].gemm.can_implement(args));
        CUDA_CHECK(cudaMalloc(&ready[i].workspace, G::Gemm::get_workspace_size(args) + 1));
        CUTLASS_CHECK(ready[i].gemm.initialize(args, ready[i].workspace, cuda_ctx.stream));
        ready[i].E = E;
    }
    CUTLASS_CHECK(ready[i].gemm.run(cuda_ctx.stream));
}

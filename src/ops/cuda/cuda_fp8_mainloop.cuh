// The consumer side of the mainloop of the FP8 grouped forward and input-gradient products, with
// the promotions overlapped. CUTLASS's sm90 blockwise-scaled mainloop (the DeepSeek-V3 recipe: the
// fp32 partial sums of each 128-deep K tile scaled and added to the accumulators) waits for each K
// tile's wgmma batch to finish before it promotes it, so the tensor cores idle while the warpgroup
// multiplies and adds. Here each K tile's batch goes into one of two partial-sum fragments: the
// batch of tile k + 1 is issued before the partial sums of tile k are promoted (wgmma.wait_group 1,
// as FlashAttention-3 overlaps its softmax with the next product), so the promotion runs in the
// shadow of the next batch. The arithmetic and its order are CUTLASS's (each tile's partial sums
// from zero, promoted in K order with the same scale products), so the results are bit for bit
// those of CUTLASS's mainloop.
//
// Each tile's scales go from shared memory to registers before its batch is issued, as CUTLASS's
// loop loads them, not when the tile is promoted: with clusters of two CTAs only warps 0 and 2 of a
// warpgroup arrive on a stage's empty barrier (CUTLASS spreads a warpgroup's arrivals over the
// cluster), so once they have promoted and released a stage the producer may refill it while warp 1
// or 3 still has to read its scales. Read at the promotion, they made runs part now and then (after
// 22 to 69 steps of scale-E8 at one sequence a step); read before the batch, which needs every warp
// of the warpgroup to have issued it before any can wait it out, they cannot be overwritten.
//
// Everything else (parameters, TMA loads of the operands and scales, the pipeline) is CUTLASS's
// collective, from which this one derives; only `mma`, the consumer warpgroups' loop, is replaced.
// Registers: the accumulators and two partial-sum fragments, 3 x 64 fp32 a thread on 128 x 128 tiles
// of two consumer warpgroups, and each fragment's scales. The first two tiles are issued before the
// loop, so that no batch is in flight where control flow merges: written as one loop from the first
// tile, ptxas waited for each tile's first batch before issuing the second (its message C7517).
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>

template <class Base> struct Fp8OverlappedMainloop : Base {
    using typename Base::ElementBlockScale;
    using typename Base::MainloopPipeline;
    using typename Base::Params;
    using typename Base::PipelineState;
    using typename Base::SmemLayoutA;
    using typename Base::SmemLayoutB;
    using typename Base::SmemLayoutSFA;
    using typename Base::SmemLayoutSFB;
    using typename Base::TensorStorage;
    using typename Base::TiledMma;
    using typename Base::TileShape;
    static_assert(Base::ScaleMsPerTile > 1 && Base::ScaleNsPerTile == 1,
                  "a's scales per row (1x128 blocks) and one b scale a tile (128x128 blocks) expected");
    static constexpr int mmas_per_k_tile = cute::size<2>(TileShape{}) / cute::size<2>(typename TiledMma::AtomShape_MNK{});
    static_assert(Base::ScalePromotionInterval == mmas_per_k_tile,
                  "one scale block per K tile expected: the partial sums are promoted every tile");

    // Tile `k_tile_count` K tiles into accum (MMA, MMA_M, MMA_N), from zero. The last tile's stage
    // is left to Base::mma_tail to release, as CUTLASS's mainloop leaves it.
    template <class FrgTensorC>
    CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC &accum,
                            int k_tile_count, int thread_idx, TensorStorage &shared_tensors, Params const &) {
        using namespace cute;
        Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{}); // (BLK_M, BLK_K, PIPE)
        Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{}); // (BLK_N, BLK_K, PIPE)
        // The scales broadcast over the tile as (BLK_M, BLK_N, (BLK_K, PIPE)).
        using LA = SmemLayoutSFA;
        using LB = SmemLayoutSFB;
        auto sfa_shape = make_shape(shape<0>(LA{}), get<1>(TileShape{}), make_shape(shape<1>(LA{}), shape<2>(LA{})));
        auto sfa_stride = make_stride(stride<0>(LA{}), _0{}, make_stride(stride<1>(LA{}), stride<2>(LA{})));
        auto sfb_shape = make_shape(get<0>(TileShape{}), shape<0>(LB{}), make_shape(shape<1>(LB{}), shape<2>(LB{})));
        auto sfb_stride = make_stride(_0{}, stride<0>(LB{}), make_stride(stride<1>(LB{}), stride<2>(LB{})));
        Tensor sSFA = make_tensor(make_smem_ptr(shared_tensors.smem_SFA.data()), make_layout(sfa_shape, sfa_stride));
        Tensor sSFB = make_tensor(make_smem_ptr(shared_tensors.smem_SFB.data()), make_layout(sfb_shape, sfb_stride));
        constexpr int warpgroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
        Layout warpgroup_layout = make_layout(Int<warpgroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{});
        int warpgroup = __shfl_sync(0xffffffffu, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
        TiledMma tiled_mma;
        auto thread_mma = tiled_mma.get_slice(warpgroup_layout(warpgroup));
        Tensor tCsSFA = tiled_mma.get_slice(thread_idx).partition_C(sSFA); // (MMA, MMA_M, MMA_N, (MMA_K, PIPE))
        Tensor tCsSFB = tiled_mma.get_slice(thread_idx).partition_C(sSFB);
        Tensor tCrA = thread_mma.make_fragment_A(thread_mma.partition_A(sA)); // (MMA, MMA_M, MMA_K, PIPE)
        Tensor tCrB = thread_mma.make_fragment_B(thread_mma.partition_B(sB)); // (MMA, MMA_N, MMA_K, PIPE)
        Tensor part0 = make_fragment_like(accum), part1 = make_fragment_like(accum); // partial sums of a K tile
        // each partial sum's scales (their distinct values only), loaded before its batch is issued
        Tensor sfa0 = make_tensor_like<ElementBlockScale>(tCsSFA(_, _, _, _0{})), sfa1 = make_tensor_like(sfa0);
        Tensor sfb0 = make_tensor_like<ElementBlockScale>(tCsSFB(_, _, _, _0{})), sfb1 = make_tensor_like(sfb0);
        clear(accum);
        if (k_tile_count <= 0) return;
        PipelineState smem_pipe_release = smem_pipe_read;

        // Tile at smem_pipe_read into part: its stage waited for, its scales loaded into sfa, sfb (every
        // warp before the warpgroup's batch, which is issued and not waited for: a stage may be released
        // by another warp of the warpgroup once the batch is done, and then refilled), its batch issued.
        auto issue = [&](auto &part, auto &sfa, auto &sfb) {
            pipeline.consumer_wait(smem_pipe_read, pipeline.consumer_try_wait(smem_pipe_read));
            int stage = smem_pipe_read.index();
            copy(tCsSFA(_, _, _, make_coord(_0{}, stage)), sfa);
            copy(tCsSFB(_, _, _, make_coord(_0{}, stage)), sfb);
            warpgroup_fence_operand(part);
            warpgroup_arrive();
            tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
            CUTLASS_PRAGMA_UNROLL
            for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
                cute::gemm(tiled_mma, tCrA(_, _, k_block, stage), tCrB(_, _, k_block, stage), part);
                tiled_mma.accumulate_ = GMMA::ScaleOut::One;
            }
            warpgroup_commit_batch();
            warpgroup_fence_operand(part);
            ++smem_pipe_read;
        };
        // The finished tile at smem_pipe_release, in part: scaled and added to accum with the scales
        // issue loaded (as CUTLASS's: a's row scale times b's block scale, then one fma), then the
        // stage released unless it is the last one.
        auto promote = [&](auto &part, auto const &sfa, auto const &sfb, bool release) {
            warpgroup_fence_operand(part);
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < size(accum); ++i) accum(i) += part(i) * (sfa(i) * sfb(0));
            if (release) pipeline.consumer_release(smem_pipe_release);
            ++smem_pipe_release;
        };

        issue(part0, sfa0, sfb0);
        if (k_tile_count == 1) {
            warpgroup_wait<0>();
            promote(part0, sfa0, sfb0, false);
        } else {
            issue(part1, sfa1, sfb1);
            warpgroup_wait<1>();
            promote(part0, sfa0, sfb0, true);
            int k = 2;
            for (; k + 1 < k_tile_count; k += 2) {
                issue(part0, sfa0, sfb0);
                warpgroup_wait<1>();
                promote(part1, sfa1, sfb1, true);
                issue(part1, sfa1, sfb1);
                warpgroup_wait<1>();
                promote(part0, sfa0, sfb0, true);
            }
            if (k < k_tile_count) {
                issue(part0, sfa0, sfb0);
                warpgroup_wait<1>();
                promote(part1, sfa1, sfb1, true);
                warpgroup_wait<0>();
                promote(part0, sfa0, sfb0, false);
            } else {
                warpgroup_wait<0>();
                promote(part1, sfa1, sfb1, false);
            }
        }
        warpgroup_fence_operand(accum);
    }
};

// The consumer side of the mainloop of the FP8 grouped products whose b scales are one per
// 128-wide column block: the DeepSeek-V3 recipe's promotions (the fp32 partial sums of each
// 128-deep K tile scaled by a's row scale and b's block scale, and added to the accumulators),
// overlapped with the tensor cores' work. CUTLASS's sm90 blockwise-scaled mainloop waits for each K
// tile's wgmma batch to finish before it promotes it, so the tensor cores idle while the warpgroup
// multiplies and adds. Here each batch goes into one of two partial-sum fragments, and the next
// batch is issued before the last one's partial sums are promoted (wgmma.wait_group 1, as
// FlashAttention-3 overlaps its softmax with the next product), so each promotion runs in the
// shadow of a batch.
//
// SLICES 1 (128 x 128 tiles): a batch is a K tile's whole product, the fragments alternate by tile.
// SLICES 4 (128 x 256 tiles, by default): a batch is one 64-column slice of a K
// tile, the fragments alternate by slice, and each fragment is a slice wide, so that the
// accumulators and both fragments fit the registers (128 + 32 + 32 fp32 a thread, where a whole
// tile's two fragments would take 128 + 2 x 128); the price is a's tile read from shared memory
// once a slice. A slice's accumulators are a run of the whole tile's (a wgmma fragment holds its
// 8-column groups in turn), and each accumulator takes the scale of its own column block, which
// CUTLASS's loop does not allow (its static_assert in fp8_accumulation.hpp). Measured on scale-E8's
// experts, the six products 1.61x bf16's with the rows products and the weight gradients on 128 x
// 256 tiles against 1.53-1.54x on 128 x 128 (docs/PERF.md, thirty-eighth session), and 128 x 192
// tiles in two 96-column slices no faster (thirty-seventh session). Under
// every SLICES the arithmetic and its order are CUTLASS's (each K tile's partial sums from zero,
// promoted in K order with the same scale products), so the results are bit for bit those of
// CUTLASS's mainloop.
//
// Each tile's scales go from shared memory to registers before its (first) batch is issued, as
// CUTLASS's loop loads them, not when the tile is promoted: with clusters of two CTAs only warps 0
// and 2 of a warpgroup arrive on a stage's empty barrier (CUTLASS spreads a warpgroup's arrivals
// over the cluster), so once they have promoted and released a stage the producer may refill it
// while warp 1 or 3 still has to read its scales. Read at the promotion, they made runs part now and
// then (after 22 to 69 steps of scale-E8 at one sequence a step); read before the batch, which needs
// every warp of the warpgroup to have issued it before any can wait it out, they cannot be
// overwritten. A stage is released after the promotion of its last slice.
//
// Everything else (parameters, TMA loads of the operands and scales, the pipeline) is CUTLASS's
// collective, from which this one derives; only `mma`, the consumer warpgroups' loop, is replaced.
// The loop runs two tiles a turn, each with its own set of scales, after the first tile (and with
// SLICES 1 the second) issued before it: written as one loop from the first tile, ptxas waited for
// each tile's first batch before issuing the second (its message C7517), and with one tile a turn
// and the scales copied between the sets, it serialised the sliced loop's wgmmas (C7514). SLICES 1
// keeps a schedule of its own: the sliced one (the batches alternating between the fragments over
// the whole loop, one tile before it) gave the same bits but ran the 128 x 128 kernels 2% slower
// (docs/PERF.md, thirty-ninth session).
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>

template <class Base, int SLICES> struct Fp8PromotingMainloop : Base {
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
    static_assert(Base::ScaleMsPerTile > 1, "a's scales per row (1x128 blocks) expected");
    static_assert(SLICES == 1 || SLICES % 2 == 0, "a tile's last slice in the second fragment");
    static constexpr int mmas_per_k_tile = cute::size<2>(TileShape{}) / cute::size<2>(typename TiledMma::AtomShape_MNK{});
    static_assert(Base::ScalePromotionInterval == mmas_per_k_tile,
                  "one scale block per K tile expected: the partial sums are promoted every tile");
    static_assert(cute::size(TiledMma{}) == 2 * cutlass::NumThreadsPerWarpGroup, "two consumer warpgroups along M");
    // The wgmma of a slice: the tile's, SliceN columns wide.
    using SliceN = cute::Int<cute::size<1>(TileShape{}) / SLICES>;
    static_assert(SliceN::value % 8 == 0 && SliceN::value * SLICES == cute::size<1>(TileShape{}), "8-column slices");
    using SliceMma = decltype(cute::make_tiled_mma(
        cute::GMMA::ss_op_selector<typename Base::ElementA, typename Base::ElementB, float,
                                   cute::Shape<cute::_64, SliceN, decltype(cute::size<2>(TileShape{}))>, cute::GMMA::Major::K,
                                   cute::GMMA::Major::K>(),
        cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));

    // Tile `k_tile_count` K tiles into accum (MMA, MMA_M, MMA_N), from zero. The last tile's stage
    // is left to Base::mma_tail to release, as CUTLASS's mainloop leaves it.
    template <class FrgTensorC>
    CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC &accum,
                            int k_tile_count, int thread_idx, TensorStorage &shared_tensors, Params const &) {
        using namespace cute;
        Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{}); // (BLK_M, BLK_K, PIPE)
        Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{}); // (BLK_N, BLK_K, PIPE)
        Tensor sB_slices = logical_divide(sB, make_tile(SliceN{})); // ((SliceN, SLICES), BLK_K, PIPE)
        // The scales broadcast over the tile as (BLK_M, BLK_N, (BLK_K, PIPE)).
        using LA = SmemLayoutSFA;
        using LB = SmemLayoutSFB;
        auto sfa_shape = make_shape(shape<0>(LA{}), get<1>(TileShape{}), make_shape(shape<1>(LA{}), shape<2>(LA{})));
        auto sfa_stride = make_stride(stride<0>(LA{}), _0{}, make_stride(stride<1>(LA{}), stride<2>(LA{})));
        auto sfb_shape = make_shape(get<0>(TileShape{}), shape<0>(LB{}), make_shape(shape<1>(LB{}), shape<2>(LB{})));
        auto sfb_stride = make_stride(_0{}, stride<0>(LB{}), make_stride(stride<1>(LB{}), stride<2>(LB{})));
        Tensor sSFA = make_tensor(make_smem_ptr(shared_tensors.smem_SFA.data()), make_layout(sfa_shape, sfa_stride));
        Tensor sSFB = make_tensor(make_smem_ptr(shared_tensors.smem_SFB.data()), make_layout(sfb_shape, sfb_stride));
        Layout warpgroup_layout = make_layout(_2{}, Int<cutlass::NumThreadsPerWarpGroup>{});
        int warpgroup = __shfl_sync(0xffffffffu, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
        TiledMma tiled_mma;
        SliceMma slice_mma;
        auto thread_mma = slice_mma.get_slice(warpgroup_layout(warpgroup));
        // The scales of the whole tile's accumulators: the tile's MMA partitions accum.
        Tensor tCsSFA = tiled_mma.get_slice(thread_idx).partition_C(sSFA); // (MMA, MMA_M, MMA_N, (MMA_K, PIPE))
        Tensor tCsSFB = tiled_mma.get_slice(thread_idx).partition_C(sSFB);
        Tensor tCrA = thread_mma.make_fragment_A(thread_mma.partition_A(sA)); // (MMA, MMA_M, MMA_K, PIPE)
        // slice s's b operand: (MMA, MMA_N, MMA_K, PIPE)
        auto slice_b = [&](auto s) { return thread_mma.make_fragment_B(thread_mma.partition_B(sB_slices(make_coord(_, s), _, _))); };
        Tensor part0 = partition_fragment_C(slice_mma, make_shape(get<0>(TileShape{}), SliceN{})); // a batch's partial sums
        Tensor part1 = make_fragment_like(part0);
        using PartSize = decltype(size(part0));
        static_assert(PartSize::value * SLICES == decltype(size(accum))::value, "a slice's accumulators are a run of the tile's");
        // the scales of a tile's accumulators (their distinct values only), loaded before its first
        // batch is issued: two sets, the tiles alternating between them
        Tensor sfa0 = make_tensor_like<ElementBlockScale>(tCsSFA(_, _, _, _0{})), sfa1 = make_tensor_like(sfa0);
        Tensor sfb0 = make_tensor_like<ElementBlockScale>(tCsSFB(_, _, _, _0{})), sfb1 = make_tensor_like(sfb0);
        clear(accum);
        if (k_tile_count <= 0) return;
        PipelineState smem_pipe_release = smem_pipe_read;

        // Slice s (an integral constant) of the tile at smem_pipe_read into part. With s 0 the
        // tile's stage is waited for and its scales loaded into sfa, sfb (every warp before the
        // warpgroup's batch, which is issued and not waited for: a stage may be released by another
        // warp of the warpgroup once its last batch is done, and then refilled).
        auto issue = [&](auto &part, auto s, auto &sfa, auto &sfb) {
            if constexpr (s == 0) {
                pipeline.consumer_wait(smem_pipe_read, pipeline.consumer_try_wait(smem_pipe_read));
                copy(tCsSFA(_, _, _, make_coord(_0{}, smem_pipe_read.index())), sfa);
                copy(tCsSFB(_, _, _, make_coord(_0{}, smem_pipe_read.index())), sfb);
            }
            int stage = smem_pipe_read.index();
            Tensor tCrB = slice_b(s);
            warpgroup_fence_operand(part);
            warpgroup_arrive();
            slice_mma.accumulate_ = GMMA::ScaleOut::Zero;
            CUTLASS_PRAGMA_UNROLL
            for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
                cute::gemm(slice_mma, tCrA(_, _, k_block, stage), tCrB(_, _, k_block, stage), part);
                slice_mma.accumulate_ = GMMA::ScaleOut::One;
            }
            warpgroup_commit_batch();
            warpgroup_fence_operand(part);
            if constexpr (s == SLICES - 1) ++smem_pipe_read;
        };
        // The finished batch of slice s in part, of the tile at smem_pipe_release: scaled and added
        // to the slice's accumulators with the scales issue loaded (as CUTLASS's: a's row scale times
        // b's block scale, then one fma); after a tile's last slice its stage is released unless it is
        // the last one.
        auto promote = [&](auto &part, auto s, auto const &sfa, auto const &sfb, bool release) {
            constexpr int o = s * PartSize::value;
            warpgroup_fence_operand(part);
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < PartSize::value; ++i) accum(o + i) += part(i) * (sfa(o + i) * sfb(o + i));
            if constexpr (s == SLICES - 1) {
                if (release) pipeline.consumer_release(smem_pipe_release);
                ++smem_pipe_release;
            }
        };

        if constexpr (SLICES == 1) {
            issue(part0, _0{}, sfa0, sfb0);
            if (k_tile_count == 1) {
                warpgroup_wait<0>();
                promote(part0, _0{}, sfa0, sfb0, false);
            } else {
                issue(part1, _0{}, sfa1, sfb1);
                warpgroup_wait<1>();
                promote(part0, _0{}, sfa0, sfb0, true);
                int k = 2;
                for (; k + 1 < k_tile_count; k += 2) {
                    issue(part0, _0{}, sfa0, sfb0);
                    warpgroup_wait<1>();
                    promote(part1, _0{}, sfa1, sfb1, true);
                    issue(part1, _0{}, sfa1, sfb1);
                    warpgroup_wait<1>();
                    promote(part0, _0{}, sfa0, sfb0, true);
                }
                if (k < k_tile_count) {
                    issue(part0, _0{}, sfa0, sfb0);
                    warpgroup_wait<1>();
                    promote(part1, _0{}, sfa1, sfb1, true);
                    warpgroup_wait<0>();
                    promote(part0, _0{}, sfa0, sfb0, false);
                } else {
                    warpgroup_wait<0>();
                    promote(part1, _0{}, sfa1, sfb1, false);
                }
            }
        } else {
            // A tile with its scales in sfa, sfb: its first slice issued (and, after the first tile,
            // the last slice of the tile before promoted with that tile's, in sfa_before,
            // sfb_before), then each further slice issued and the slice before it promoted. The
            // tiles alternate between the two sets of scales, so that the loop runs two tiles a
            // turn (as with SLICES 1).
            auto tile = [&](auto first, auto &sfa, auto &sfb, auto const &sfa_before, auto const &sfb_before) {
                issue(part0, _0{}, sfa, sfb);
                if constexpr (!first) {
                    warpgroup_wait<1>();
                    promote(part1, Int<SLICES - 1>{}, sfa_before, sfb_before, true);
                }
                for_each(make_int_sequence<SLICES - 1>{}, [&](auto j) {
                    constexpr int s = j + 1;
                    if constexpr (s % 2) issue(part1, Int<s>{}, sfa, sfb);
                    else issue(part0, Int<s>{}, sfa, sfb);
                    warpgroup_wait<1>();
                    if constexpr (s % 2) promote(part0, Int<s - 1>{}, sfa, sfb, true);
                    else promote(part1, Int<s - 1>{}, sfa, sfb, true);
                });
            };
            tile(cute::true_type{}, sfa0, sfb0, sfa1, sfb1);
            int k = 1;
            for (; k + 1 < k_tile_count; k += 2) {
                tile(cute::false_type{}, sfa1, sfb1, sfa0, sfb0);
                tile(cute::false_type{}, sfa0, sfb0, sfa1, sfb1);
            }
            if (k < k_tile_count) {
                tile(cute::false_type{}, sfa1, sfb1, sfa0, sfb0);
                warpgroup_wait<0>();
                promote(part1, Int<SLICES - 1>{}, sfa1, sfb1, false);
            } else {
                warpgroup_wait<0>();
                promote(part1, Int<SLICES - 1>{}, sfa0, sfb0, false);
            }
        }
        warpgroup_fence_operand(accum);
    }
};

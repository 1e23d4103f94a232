// Matrix products on the GPU. Dense layers go through cuBLASLt (bf16 inputs, fp32 accumulation;
// weight gradients accumulate into fp32; in FP8 its block-scaled E4M3 kernels where it takes the
// shape). Experts go through a grouped GEMM that reads the per-expert row offsets in device
// memory, so no count ever travels to the host and one launch covers every expert: on Hopper
// CUTLASS's wgmma kernel (cuda_grouped_sm90.cu), elsewhere (or with MOE_KERNELS=grouped=builtin)
// the built-in one below: tensor cores (mma.sync, a 3-stage cp.async pipeline) over tiles that each
// block assigns itself from the offsets.
#include "cuda_common.cuh"
#include "cuda_mma.cuh"
#include "cuda_ops.h"

// ---------------------------------------------------------------- cuBLASLt

// A column-major product C (m, n) = op(A) op(B) + beta C: transposes, sizes, leading dimensions,
// the operands' type (bf16, or E4M3 with block scales of the modes a_scale and b_scale) and C's.
typedef struct {
    bool ta, tb;
    int m, n, k, lda, ldb, ldc;
    cudaDataType_t ab, c;
    int a_scale, b_scale; // cublasLtMatmulMatrixScale_t of E4M3 operands (unused with bf16)
} LtShape;

// A shape's descriptors and the algorithm the heuristic chose, cached (the query costs more than a
// small product); found false where cuBLASLt has none (FP8 shapes it does not take).
typedef struct {
    LtShape s;
    bool found;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, c;
    cublasLtMatmulAlgo_t algo;
} LtPlan;

#define LT_CACHE 128
static LtPlan lt_cache[LT_CACHE];
static int lt_cached;

static bool lt_same(const LtShape *x, const LtShape *y) {
    return x->ta == y->ta && x->tb == y->tb && x->m == y->m && x->n == y->n && x->k == y->k && x->lda == y->lda &&
           x->ldb == y->ldb && x->ldc == y->ldc && x->ab == y->ab && x->c == y->c && x->a_scale == y->a_scale &&
           x->b_scale == y->b_scale;
}

// Sets the FP8 operands' scale pointers of p's descriptor (cuBLASLt's heuristic wants them set too).
static void lt_set_scales(const LtPlan *p, const float *a_scales, const float *b_scales) {
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scales,
                                                sizeof a_scales));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scales,
                                                sizeof b_scales));
}

// p's descriptors and algorithm; an FP8 shape's heuristic runs with the scales of its first call.
static void lt_describe(LtPlan *p, const float *a_scales, const float *b_scales) {
    const LtShape *s = &p->s;
    cublasOperation_t opa = s->ta ? CUBLAS_OP_T : CUBLAS_OP_N, opb = s->tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb));
    if (s->ab == CUDA_R_8F_E4M3) {
        cublasLtMatmulMatrixScale_t am = (cublasLtMatmulMatrixScale_t)s->a_scale;
        cublasLtMatmulMatrixScale_t bm = (cublasLtMatmulMatrixScale_t)s->b_scale;
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &am, sizeof am));
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &bm, sizeof bm));
        lt_set_scales(p, a_scales, b_scales);
    }
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->a, s->ab, s->ta ? s->k : s->m, s->ta ? s->m : s->k, s->lda));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->b, s->ab, s->tb ? s->n : s->k, s->tb ? s->k : s->n, s->ldb));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->c, s->c, s->m, s->n, s->ldc));
    cublasLtMatmulPreference_t pref;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                      &cuda_ctx.workspace_bytes, sizeof(size_t)));
    cublasLtMatmulHeuristicResult_t result;
    int found = 0;
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(cuda_ctx.lt, p->op, p->a, p->b, p->c, p->c, pref, 1, &result,
                                                       &found);
    cublasLtMatmulPreferenceDestroy(pref);
    bool refused = st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE;
    if (!(s->ab == CUDA_R_8F_E4M3 && refused)) CUBLAS_CHECK(st); // an FP8 shape cuBLASLt refuses: not found
    p->found = st == CUBLAS_STATUS_SUCCESS && found;
    if (p->found) p->algo = result.algo;
}

static const LtPlan *lt_plan(const LtShape *s, const float *a_scales, const float *b_scales) {
    for (int i = 0; i < lt_cached; i++)
        if (lt_same(&lt_cache[i].s, s)) return &lt_cache[i];
    LtPlan *p = &lt_cache[lt_cached < LT_CACHE ? lt_cached++ : (lt_cached = 1) - 1]; // reuse when full
    if (p->op) {
        cublasLtMatmulDescDestroy(p->op), cublasLtMatrixLayoutDestroy(p->a);
        cublasLtMatrixLayoutDestroy(p->b), cublasLtMatrixLayoutDestroy(p->c);
    }
    *p = (LtPlan){.s = *s};
    lt_describe(p, a_scales, b_scales);
    return p;
}

// C = op(A) op(B) + beta C with a plan that has an algorithm (p->found), E4M3 operands with their
// block scales a_scales and b_scales.
static void lt_execute(const LtPlan *p, const void *A, const void *B, void *C, float beta, const float *a_scales,
                       const float *b_scales) {
    if (p->s.ab == CUDA_R_8F_E4M3) lt_set_scales(p, a_scales, b_scales);
    float alpha = 1.0f;
    CUBLAS_CHECK(cublasLtMatmul(cuda_ctx.lt, p->op, &alpha, A, p->a, B, p->b, &beta, C, p->c, C, p->c, &p->algo,
                                cuda_ctx.workspace, cuda_ctx.workspace_bytes, cuda_ctx.stream));
}

// The same for the shape s; false (nothing run) where cuBLASLt has no algorithm for an FP8 shape.
// Every bf16 shape has one.
static bool lt_run(const LtShape *s, const void *A, const void *B, void *C, float beta, const float *a_scales,
                   const float *b_scales) {
    const LtPlan *p = lt_plan(s, a_scales, b_scales);
    if (!p->found) {
        if (s->ab == CUDA_R_8F_E4M3) return false;
        moe_fatal("cuBLASLt has no algorithm for a %dx%dx%d product (transposes %d%d)", s->m, s->n, s->k, s->ta, s->tb);
    }
    lt_execute(p, A, B, C, beta, a_scales, b_scales);
    return true;
}

static void lt_matmul(bool ta, bool tb, int m, int n, int k, const void *A, int lda, const void *B, int ldb,
                      void *C, int ldc, cudaDataType_t ctype, float beta) {
    if (!m || !n) return;
    LtShape s = {ta, tb, m, n, k, lda, ldb, ldc, CUDA_R_16BF, ctype, 0, 0};
    lt_run(&s, A, B, C, beta, NULL, NULL);
}

// Row-major out (M, N) = x (M, K) w (N, K)^T is column-major out^T = w^T-as-stored x^T.
extern "C" void cuda_matmul_forward(void *out, const void *x, const void *w, size_t M, size_t N, size_t K, bool accumulate) {
    lt_matmul(true, false, (int)N, (int)M, (int)K, w, (int)K, x, (int)K, out, (int)N, CUDA_R_16BF, accumulate ? 1.0f : 0.0f);
}

extern "C" void cuda_matmul_backward(void *dx, void *dw, const void *dout, const void *x, const void *w,
                                     size_t M, size_t N, size_t K, bool accumulate_dx) {
    if (dx) // dx (M, K) = dout (M, N) w (N, K)
        lt_matmul(false, false, (int)K, (int)M, (int)N, w, (int)K, dout, (int)N, dx, (int)K, CUDA_R_16BF,
                  accumulate_dx ? 1.0f : 0.0f);
    // dw (N, K) += dout^T x, into fp32
    lt_matmul(false, true, (int)K, (int)N, (int)M, x, (int)K, dout, (int)N, dw, (int)K, CUDA_R_32F, 1.0f);
}

// ---------------------------------------------------------------- FP8 products through cuBLASLt

// The recipe's dense products (ops.h fp8_matmul, and fp8_grouped_matmul_wgrad of one group) through
// cuBLASLt's block-scaled FP8 kernels (Hopper, cuBLAS 12.9 on: VEC128_32F, a scale per row and 128
// along K; BLK128x128_32F, one per 128x128 block), 1.16-1.18x the rate of CUTLASS's grouped kernel
// on one group in a training step (docs/PERF.md, 2026-12-01, ninth session; alone 1.51-1.55x cuBLAS
// bf16 on scale-E8's projections). cuBLASLt reads activation scales in our layout ((Kb, rows), the
// row index fastest) but weight scales as (Nb, Kb rounded up to 4) with Kb fastest, so a weight's
// are copied into that order first (a few KB). Each returns false, running nothing, where cuBLASLt
// has no kernel for the shape (rows not a multiple of 4, for one) or an operand lacks the 256-byte
// alignment its kernels may assume; the caller then runs CUTLASS's. MOE_KERNELS=fp8_dense=cutlass
// keeps every product on CUTLASS's (cuda_choose_kernels).
#define LT_VEC128 CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
#define LT_BLK128 CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F

static bool lt_aligned(const void *p, size_t bytes) { return (uintptr_t)p % bytes == 0; }

// dst (Nb, ld) = the transpose of src (Kb, Nb): block (nb, kb)'s scale at dst[nb ld + kb].
__global__ void lt_weight_scales_kernel(float *dst, const float *src, int Kb, int Nb, int ld) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < Kb * Nb) dst[(i % Nb) * ld + i / Nb] = src[i];
}

// 128x128 block scales (Kb, Nb) (Kb blocks along the reduction, Nb fastest: the weights' and
// FP8_COLS_128X128's layout) as cuBLASLt reads them, (Nb, Kb rounded up to 4) with Kb fastest: room
// for them in the growing scratch *buf (lt_scales_room), then src's copied there (lt_block_scales).
static float *lt_scales_room(void **buf, size_t *have, size_t Kb, size_t Nb) {
    return (float *)cuda_grow_scratch(buf, have, Nb * ((Kb + 3) / 4 * 4) * sizeof(float));
}

static void lt_block_scales(float *dst, const void *src, size_t Kb, size_t Nb) {
    lt_weight_scales_kernel<<<cuda_blocks(Kb * Nb, 256), 256, 0, cuda_ctx.stream>>>(dst, (const float *)src, (int)Kb,
                                                                                   (int)Nb, (int)((Kb + 3) / 4 * 4));
    CUDA_LAUNCH_CHECK();
}

// out (M, N) bf16 = a (M, K) . b (N, K)^T: a's rows with scales (Kb, M), b weights with (Kb, Nb).
bool cuda_lt_fp8_matmul(void *out, const void *a, const void *a_scales, const void *b, const void *b_scales,
                        size_t M, size_t N, size_t K) {
    if (cuda_ctx.cutlass_fp8_dense || !M || !N || !lt_aligned(out, 256) || !lt_aligned(a, 256) ||
        !lt_aligned(b, 256) || !lt_aligned(a_scales, 16))
        return false;
    // column-major out^T (N, M) = b^T-as-stored (K, N)^T . a^T-as-stored (K, M)
    LtShape s = {true, false, (int)N, (int)M, (int)K, (int)K, (int)K, (int)N, CUDA_R_8F_E4M3, CUDA_R_16BF, LT_BLK128,
                 LT_VEC128};
    static void *buf;
    static size_t have;
    float *scales = lt_scales_room(&buf, &have, fp8_blocks(K), fp8_blocks(N));
    const LtPlan *p = lt_plan(&s, scales, (const float *)a_scales);
    if (!p->found) return false;
    lt_block_scales(scales, b_scales, fp8_blocks(K), fp8_blocks(N));
    lt_execute(p, b, a, out, 0.0f, scales, (const float *)a_scales);
    return true;
}

// dw (N, K) f32 = dout^T . x over R rows from their token-major copies (fp8_quantize_cols of one
// group), added to dw when accumulate: dout_t (N, Rt) with scales (Rt / 128, N), x_t (K, Rt) with
// (Rt / 128, fp8_col_scales(K, x_blocks)).
bool cuda_lt_fp8_wgrad(float *dw, const void *dout_t, const void *dout_scales, const void *x_t, const void *x_scales,
                       Fp8ColBlocks x_blocks, size_t N, size_t K, size_t R, size_t Rt, bool accumulate) {
    if (cuda_ctx.cutlass_fp8_dense || !lt_aligned(dw, 256) || !lt_aligned(dout_t, 256) || !lt_aligned(x_t, 256) ||
        !lt_aligned(dout_scales, 16) || !lt_aligned(x_scales, 16))
        return false;
    if (!R && !accumulate) CUDA_CHECK(cudaMemsetAsync(dw, 0, N * K * sizeof(float), cuda_ctx.stream));
    if (!R || !N || !K) return true; // nothing (more) to write
    // column-major dw^T (K, N) += x_t-as-stored (Rt, K)^T . dout_t-as-stored (Rt, N), over R's blocks
    bool block = x_blocks == FP8_COLS_128X128;
    LtShape s = {true, false, (int)K, (int)N, (int)(fp8_blocks(R) * FP8_BLOCK), (int)Rt, (int)Rt, (int)K,
                 CUDA_R_8F_E4M3, CUDA_R_32F, block ? LT_BLK128 : LT_VEC128, LT_VEC128};
    static void *buf;
    static size_t have;
    float *room = block ? lt_scales_room(&buf, &have, fp8_blocks(R), fp8_blocks(K)) : NULL;
    const float *xs = block ? room : (const float *)x_scales;
    const LtPlan *p = lt_plan(&s, xs, (const float *)dout_scales);
    if (!p->found) return false;
    if (block) lt_block_scales(room, x_scales, fp8_blocks(R), fp8_blocks(K));
    lt_execute(p, x_t, dout_t, dw, accumulate ? 1.0f : 0.0f, xs, (const float *)dout_scales);
    return true;
}

// ---------------------------------------------------------------- grouped GEMM

// C (m, n) (+)= sum_k A (m, k) B (k, n) for each expert, row-major storage:
//   A (m, k) = A[(row0 + m) lda + k], or A[(row0 + k) lda + m] when A_T
//   B (k, n) = B[e b_stride + k ldb + n], or B[e b_stride + n ldb + k] when B_T, with k offset by
//              row0 when the expert's rows run along k (weight gradients)
//   C (m, n) = C[e c_stride + (row0 + m) ldc + n] (row0 only when rows run along m)
// The expert's rows [offsets[e], offsets[e+1]) run along m (forward, input gradient) or along k
// (weight gradient). Dimensions contiguous in memory must be multiples of 8 (16-byte copies).
typedef struct {
    const bf16 *A, *B;
    void *C;
    size_t lda, ldb, ldc, b_stride, c_stride;
    const int32_t *offsets;
    int E, M, N, K;   // the dimension the experts' rows run along is read from offsets instead
    bool rows_along_k;
    bool accumulate;  // an fp32 C is added to (else written)
} GroupedArgs;

#define GB_M 128
#define GB_N 128
#define GB_K 64
#define GB_STAGES 3
#define GB_GROUP 8 // row tiles that walk all column tiles together (their A stays in L2)
#define GB_THREADS 256 // 8 warps, 2 along M x 4 along N, each 64 x 32
#define GB_PAD 8

// Shared tiles keep the global layout (so copies stay 16-byte vectors); ldmatrix reads them as A
// and B fragments, transposing where the layout asks for it.
template <bool A_T, bool B_T> struct GroupedTiles {
    static constexpr int A_ROWS = A_T ? GB_K : GB_M, A_LD = (A_T ? GB_M : GB_K) + GB_PAD;
    static constexpr int B_ROWS = B_T ? GB_N : GB_K, B_LD = (B_T ? GB_K : GB_N) + GB_PAD;
    bf16 a[GB_STAGES][A_ROWS][A_LD];
    bf16 b[GB_STAGES][B_ROWS][B_LD];
};

// Copies the k-slice [k0, k0 + GB_K) of this tile's A and B into stage s.
template <bool A_T, bool B_T>
__device__ void grouped_load(GroupedTiles<A_T, B_T> &t, int s, const GroupedArgs &g, const bf16 *B,
                             size_t row0, int m0, int n0, int k0, int Me, int Ke) {
    for (int c = threadIdx.x; c < GB_M * GB_K / 8; c += GB_THREADS) {
        int r = A_T ? c / (GB_M / 8) : c / (GB_K / 8), v = (A_T ? c % (GB_M / 8) : c % (GB_K / 8)) * 8;
        int m = A_T ? m0 + v : m0 + r, k = A_T ? k0 + r : k0 + v;
        bool ok = m < Me && k < Ke;
        size_t off = A_T ? (row0 + k) * g.lda + m : (row0 + m) * g.lda + k;
        cp_async16(&t.a[s][r][v], ok ? g.A + off : g.A, ok);
    }
    size_t krow0 = g.rows_along_k ? row0 : 0;
    for (int c = threadIdx.x; c < GB_N * GB_K / 8; c += GB_THREADS) {
        int r = B_T ? c / (GB_K / 8) : c / (GB_N / 8), v = (B_T ? c % (GB_K / 8) : c % (GB_N / 8)) * 8;
        int n = B_T ? n0 + r : n0 + v, k = B_T ? k0 + v : k0 + r;
        bool ok = n < g.N && k < Ke;
        size_t off = B_T ? (size_t)n * g.ldb + (krow0 + k) : (krow0 + k) * g.ldb + n;
        cp_async16(&t.b[s][r][v], ok ? B + off : B, ok);
    }
}

// Which (expert, first row) a block of the row-tiled grid covers; false past the last tile.
__device__ bool grouped_find_tile(const GroupedArgs &g, int tile, int *e_out, int *m0_out) {
    int seen = 0;
    for (int e = 0; e < g.E; e++) {
        int rows = g.offsets[e + 1] - g.offsets[e], tiles = (rows + GB_M - 1) / GB_M;
        if (tile < seen + tiles) {
            *e_out = e, *m0_out = (tile - seen) * GB_M;
            return true;
        }
        seen += tiles;
    }
    return false;
}

// Block order: GB_GROUP row tiles take every column tile before the next rows start, so the rows
// they read stay in L2 while the weights stream past (grouped rasterisation).
__device__ __forceinline__ void grouped_raster(int id, int tiles_m, int tiles_n, int *mt, int *nt) {
    int per_group = GB_GROUP * tiles_n, first = (id / per_group) * GB_GROUP;
    int size = tiles_m - first < GB_GROUP ? tiles_m - first : GB_GROUP;
    *mt = first + (id % per_group) % size;
    *nt = (id % per_group) / size;
}

// One GB_K slice of the warp's 64 x 32 product from stage s.
template <bool A_T, bool B_T>
__device__ __forceinline__ void grouped_slice(float acc[4][4][4], const GroupedTiles<A_T, B_T> &t, int s, int wm, int wn) {
    typedef GroupedTiles<A_T, B_T> Tl;
    for (int kk = 0; kk < GB_K; kk += 16) {
        uint32_t a[4][4], b[2][4];
        for (int i = 0; i < 4; i++) {
            if (A_T) ldsm_a_trans(a[i], &t.a[s][0][0], Tl::A_LD, wm + 16 * i, kk);
            else ldsm_a(a[i], &t.a[s][0][0], Tl::A_LD, wm + 16 * i, kk);
        }
        for (int jp = 0; jp < 2; jp++) {
            if (B_T) ldsm_b_nk(b[jp], &t.b[s][0][0], Tl::B_LD, wn + 16 * jp, kk);
            else ldsm_b_kn(b[jp], &t.b[s][0][0], Tl::B_LD, wn + 16 * jp, kk);
        }
        for (int i = 0; i < 4; i++)
            for (int jp = 0; jp < 2; jp++) {
                mma16816(acc[i][2 * jp], a[i], b[jp][0], b[jp][1]);
                mma16816(acc[i][2 * jp + 1], a[i], b[jp][2], b[jp][3]);
            }
    }
}

template <bool A_T, bool B_T, bool OUT_F32>
__global__ void __launch_bounds__(GB_THREADS) grouped_gemm_kernel(GroupedArgs g) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    GroupedTiles<A_T, B_T> &t = *reinterpret_cast<GroupedTiles<A_T, B_T> *>(smem_raw);
    int e, m0, n0, mt, nt, tiles_n = (g.N + GB_N - 1) / GB_N;
    int tiles_m = g.rows_along_k ? (g.M + GB_M - 1) / GB_M : (int)(gridDim.x / tiles_n);
    grouped_raster(blockIdx.x, tiles_m, tiles_n, &mt, &nt);
    n0 = nt * GB_N;
    if (g.rows_along_k) { // weight gradient: a fixed grid of (M, N) tiles per expert
        e = blockIdx.y, m0 = mt * GB_M;
    } else {
        __shared__ int tile_e, tile_m0;
        if (threadIdx.x == 0) {
            int te = 0, tm = 0;
            tile_e = grouped_find_tile(g, mt, &te, &tm) ? te : -1;
            tile_m0 = tm;
        }
        __syncthreads();
        if (tile_e < 0) return;
        e = tile_e, m0 = tile_m0;
    }
    size_t row0 = (size_t)g.offsets[e];
    int rows = g.offsets[e + 1] - g.offsets[e];
    int Me = g.rows_along_k ? g.M : rows, Ke = g.rows_along_k ? rows : g.K;
    if (Ke == 0) return; // a weight gradient with no rows adds nothing (or is zeroed before)
    const bf16 *B = g.B + (size_t)e * g.b_stride;
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31, gq = lane / 4, tq = lane % 4;
    int wm = (warp / 4) * 64, wn = (warp % 4) * 32;
    float acc[4][4][4];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;
    int n_k = (Ke + GB_K - 1) / GB_K;
    for (int st = 0; st < GB_STAGES - 1; st++) {
        if (st < n_k) grouped_load(t, st, g, B, row0, m0, n0, st * GB_K, Me, Ke);
        cp_async_commit();
    }
    for (int it = 0; it < n_k; it++) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(GB_STAGES - 2));
        __syncthreads(); // slice it is in; every warp is done with the stage refilled next
        int next = it + GB_STAGES - 1;
        if (next < n_k) grouped_load(t, next % GB_STAGES, g, B, row0, m0, n0, next * GB_K, Me, Ke);
        cp_async_commit();
        grouped_slice(acc, t, it % GB_STAGES, wm, wn);
    }
    size_t crow0 = g.rows_along_k ? 0 : row0;
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++)
            for (int r = 0; r < 2; r++) {
                int m = m0 + wm + 16 * i + gq + 8 * r, n = n0 + wn + 8 * j + 2 * tq;
                if (m >= Me || n >= g.N) continue;
                size_t idx = (size_t)e * g.c_stride + (crow0 + m) * g.ldc + n;
                if (OUT_F32) {
                    float2 *c = reinterpret_cast<float2 *>((float *)g.C + idx);
                    float2 v = g.accumulate ? *c : make_float2(0.0f, 0.0f);
                    v.x += acc[i][j][2 * r], v.y += acc[i][j][2 * r + 1];
                    *c = v;
                } else {
                    *reinterpret_cast<uint32_t *>((bf16 *)g.C + idx) = pack_bf16(acc[i][j][2 * r], acc[i][j][2 * r + 1]);
                }
            }
}

template <bool A_T, bool B_T, bool OUT_F32>
static void grouped_launch(const GroupedArgs &g, size_t max_rows) {
    size_t smem = sizeof(GroupedTiles<A_T, B_T>);
    static bool configured;
    if (!configured) {
        CUDA_CHECK(cudaFuncSetAttribute(grouped_gemm_kernel<A_T, B_T, OUT_F32>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        configured = true;
    }
    unsigned tiles_n = (unsigned)((g.N + GB_N - 1) / GB_N);
    unsigned tiles_m = g.rows_along_k ? (unsigned)((g.M + GB_M - 1) / GB_M) : (unsigned)((max_rows + GB_M - 1) / GB_M + g.E);
    dim3 grid(tiles_m * tiles_n, g.rows_along_k ? (unsigned)g.E : 1u);
    grouped_gemm_kernel<A_T, B_T, OUT_F32><<<grid, GB_THREADS, smem, cuda_ctx.stream>>>(g);
    CUDA_LAUNCH_CHECK();
}

// out (R, N) = x (R, K) w[e] (N, K)^T
extern "C" void cuda_grouped_matmul_forward(void *out, const void *x, const void *w, const int32_t *offsets,
                                            size_t E, size_t N, size_t K, size_t R) {
    if (!cuda_ctx.builtin_grouped) return cuda_grouped_sm90(GROUPED_FWD, x, w, out, offsets, E, N, K);
    GroupedArgs g = {(const bf16 *)x, (const bf16 *)w, out, K, K, N, N * K, 0, offsets, (int)E, 0, (int)N, (int)K, false,
                     false};
    grouped_launch<false, true, false>(g, R);
}

__global__ void grouped_zero_empty_kernel(float *dw, const int32_t *offsets, size_t nk) {
    size_t e = blockIdx.y;
    if (offsets[e + 1] != offsets[e]) return;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < nk; i += (size_t)gridDim.x * blockDim.x)
        dw[e * nk + i] = 0.0f;
}

void cuda_grouped_zero_empty(float *dw, const int32_t *offsets, size_t E, size_t nk) {
    if (!E || !nk) return;
    dim3 grid(cuda_blocks(nk, 256) < 32 ? cuda_blocks(nk, 256) : 32, (unsigned)E);
    grouped_zero_empty_kernel<<<grid, 256, 0, cuda_ctx.stream>>>(dw, offsets, nk);
    CUDA_LAUNCH_CHECK();
}

extern "C" void cuda_grouped_matmul_backward(void *dx, void *dw, const void *dout, const void *x, const void *w,
                                             const int32_t *offsets, size_t E, size_t N, size_t K, size_t R,
                                             bool accumulate_dw) {
    // Either product has no tiles for an expert without rows: a weight gradient written over gets zeros there.
    if (dw && !accumulate_dw) cuda_grouped_zero_empty((float *)dw, offsets, E, N * K);
    if (!cuda_ctx.builtin_grouped) {
        if (dx) cuda_grouped_sm90(GROUPED_DGRAD, dout, w, dx, offsets, E, N, K);
        if (dw) cuda_grouped_sm90(accumulate_dw ? GROUPED_WGRAD : GROUPED_WGRAD_SET, dout, x, dw, offsets, E, N, K);
        return;
    }
    // dx (R, K) = dout (R, N) w[e] (N, K)
    GroupedArgs gx = {(const bf16 *)dout, (const bf16 *)w, dx, N, K, K, N * K, 0, offsets, (int)E, 0, (int)K, (int)N, false,
                      false};
    if (dx) grouped_launch<false, false, false>(gx, R);
    // dw[e] (N, K) (+)= dout^T (N, rows) x (rows, K)
    GroupedArgs gw = {(const bf16 *)dout, (const bf16 *)x, dw, N, K, K, 0, N * K, offsets, (int)E, (int)N, (int)K, 0, true,
                      accumulate_dw};
    if (dw) grouped_launch<true, false, true>(gw, 0);
}

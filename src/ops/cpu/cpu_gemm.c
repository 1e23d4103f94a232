// The CPU matrix multiply (see cpu_gemm.h): operands are packed into contiguous panels, and a
// register-blocked micro-kernel (cpu_gemm.h's, written with GCC vector extensions) does the
// arithmetic. Threads split the output into tiles; K is never split.
#include "ops/cpu/cpu_gemm.h"

#include <stdlib.h>
#include <string.h>

#include "common/util.h"

// Register tile: MR rows by NR elements (cpu_gemm.h: two vectors of CPU_VEC_BYTES).
#define MR CPU_GEMM_MR
#define NR (2 * CPU_VEC_BYTES / sizeof(real))

// Cache blocking: a B micro-panel (kc x NR) stays in L1 while the MR-row panels of the tile's
// A block (mc x kc, in L2) stream past it. mc and nc shrink (down to *_MIN) for parallelism.
#define KC_MAX 256
#define MC_MAX (16 * MR)
#define NC_MAX (32 * NR)
#define MC_MIN (2 * MR)
#define NC_MIN (2 * NR)
#define MIN_TILES 16             // enough output tiles to keep several threads busy
#define SMALL_WORK (32 * 1024)   // M*N*K below this: packing costs more than it saves
#define PARALLEL_WORK (1 << 20)  // M*N*K below this: waking threads costs more than it saves
#define PACK_ALIGN 64
#define PREFETCH_STEPS 8 // how far ahead packing prefetches along K

// Pack buffers are allocated per call (per thread for A): cheap next to any product big enough
// to be packed, and nothing outlives the call.
static real *alloc_pack(size_t count) {
    size_t bytes = size_round_up(count * sizeof(real), PACK_ALIGN);
    real *p = aligned_alloc(PACK_ALIGN, bytes ? bytes : PACK_ALIGN);
    MOE_CHECK(p, "out of host memory allocating a %zu-byte gemm pack buffer", bytes);
    return p;
}

// Element (r, d) of a strided operand view, whichever way round it is stored.
typedef struct {
    const real *p;
    size_t rs, ds; // strides of a row and of a step along the summed (K) dimension
} View;

// out[r] = src[r * stride] for r < n, zero up to w. Inlined with a constant w (and stride 1 where
// it is), a full slice becomes a vector move or a gather.
static inline __attribute__((always_inline)) void
copy_slice(real *restrict out, const real *restrict src, size_t stride, size_t n, size_t w) {
    if (n == w && stride == 1)
        memcpy(out, src, w * sizeof(real)); // constant size: expanded inline, never a call
    else if (n == w)
        for (size_t r = 0; r < w; r++) out[r] = src[r * stride];
    else
        for (size_t r = 0; r < w; r++) out[r] = r < n ? src[r * stride] : 0;
}

// Copies rows x depth of `v`, from row r0 and depth d0, into panels of w rows: panel p holds
// depth steps of w values, rows past the end are zero. One depth step at a time across all
// panels: contiguous reads when rows are contiguous, and when they are not, each row is still
// read sequentially across the steps.
static inline __attribute__((always_inline)) void
pack_panels(View v, size_t r0, size_t d0, size_t rows, size_t depth, size_t w, real *restrict dst) {
    const real *src = v.p + r0 * v.rs + d0 * v.ds;
    size_t panels = size_ceil_div(rows, w);
    for (size_t d = 0; d < depth; d++, src += v.ds) {
        for (size_t p = 0; p < panels; p++) {
            real *out = dst + (p * depth + d) * w;
            size_t n = size_min(w, rows - p * w);
            if (v.rs == 1) {
                // Depth steps are often a page apart, beyond the hardware prefetcher's reach.
                if (d + PREFETCH_STEPS < depth) __builtin_prefetch(src + PREFETCH_STEPS * v.ds + p * w);
                copy_slice(out, src + p * w, 1, n, w);
            } else {
                copy_slice(out, src + p * w * v.rs, v.rs, n, w);
            }
        }
    }
}

CPU_GEMM_DEFINE_KERNEL(kernel_body, real)

// Full row panels of an untransposed A are read in place (rows contiguous along k): copying them
// would cost about as much as the multiply on K ~ 128 shapes. Everything else is read packed.
static void kernel_a_rows(size_t kc, const real *a, size_t rs, const real *b, real *tile) {
    kernel_body(kc, a, rs, 1, b, tile);
}

static void kernel_a_packed(size_t kc, const real *a, const real *b, real *tile) {
    kernel_body(kc, a, 1, MR, b, tile);
}

// c = alpha * tile + beta * c over mr x nr; beta == 0 never reads c. Inlined so the full-tile
// call site gets constant bounds and vectorizes without remainder loops.
static inline __attribute__((always_inline)) void
update_tile(real *restrict c, size_t ldc, size_t mr, size_t nr, real alpha, real beta,
            const real *restrict tile) {
    for (size_t i = 0; i < mr; i++, c += ldc, tile += NR) {
        if (beta == 0)
            for (size_t j = 0; j < nr; j++) c[j] = alpha * tile[j];
        else if (beta == 1)
            for (size_t j = 0; j < nr; j++) c[j] += alpha * tile[j];
        else
            for (size_t j = 0; j < nr; j++) c[j] = alpha * tile[j] + beta * c[j];
    }
}

static void store_tile(real *c, size_t ldc, size_t mr, size_t nr, real alpha, real beta,
                       const real *tile) {
    if (mr == MR && nr == NR)
        update_tile(c, ldc, MR, NR, alpha, beta, tile);
    else
        update_tile(c, ldc, mr, nr, alpha, beta, tile);
}

// Everything a thread needs to compute one output tile. The K blocking depends only on K, so
// every element sees the same partial sums in the same order whatever the thread count.
typedef struct {
    View a, b;            // op(A) as (M rows, K deep), op(B) as (N rows, K deep)
    size_t M, N, K;
    size_t kc;            // K block depth (the last block may be shorter)
    size_t mc, nc;        // output tile size
    size_t n_pad;         // N rounded up to NR: the width of one packed B block
    const real *b_packed; // all of op(B): K blocks of N/NR panels
    real alpha, beta;
    real *C;
    size_t ldc;
} GemmPlan;

// Packs the B panel holding columns j0..j0+NR for every K block (one unit of parallel work).
static void pack_b_panel(const GemmPlan *g, size_t j0, real *b_packed) {
    for (size_t p0 = 0; p0 < g->K; p0 += g->kc) {
        size_t kb = size_min(g->kc, g->K - p0);
        pack_panels(g->b, j0, p0, size_min(NR, g->N - j0), kb, NR, b_packed + p0 * g->n_pad + j0 * kb);
    }
}

// Packs rows i0..i0+mc of op(A) over K block p0..p0+kb into MR-row panels where the kernel
// cannot read them in place: all panels of a transposed A (whose k steps are lda apart, and a
// power-of-two lda would make them collide in L1), else only a partial last panel, which the
// kernel must not read past.
static void pack_a_block(const GemmPlan *g, size_t i0, size_t mc, size_t p0, size_t kb, real *dst) {
    size_t first = g->a.ds != 1 ? 0 : mc / MR * MR;
    if (first < mc) pack_panels(g->a, i0 + first, p0, mc - first, kb, MR, dst + first * kb);
}

// a_packed holds size_round_up(mc, MR) * kc values.
static void compute_tile(const GemmPlan *g, size_t i0, size_t j0, real *a_packed) {
    size_t mc = size_min(g->mc, g->M - i0), nc = size_min(g->nc, g->N - j0);
    real tile[MR * NR];
    for (size_t p0 = 0; p0 < g->K; p0 += g->kc) {
        size_t kb = size_min(g->kc, g->K - p0);
        real beta = p0 == 0 ? g->beta : 1; // later K blocks accumulate onto the first
        pack_a_block(g, i0, mc, p0, kb, a_packed);
        const real *b_block = g->b_packed + p0 * g->n_pad;
        // B micro-panel outer so it stays in L1 while the rows of A stream from L2.
        for (size_t jr = 0; jr < nc; jr += NR) {
            const real *b_panel = b_block + (j0 + jr) * kb;
            for (size_t ir = 0; ir < mc; ir += MR) {
                size_t mr = size_min(MR, mc - ir);
                if (g->a.ds == 1 && mr == MR)
                    kernel_a_rows(kb, g->a.p + (i0 + ir) * g->a.rs + p0, g->a.rs, b_panel, tile);
                else
                    kernel_a_packed(kb, a_packed + ir * kb, b_panel, tile);
                store_tile(g->C + (i0 + ir) * g->ldc + j0 + jr, g->ldc, mr, size_min(NR, nc - jr),
                           g->alpha, beta, tile);
            }
        }
    }
}

// Tile sizes depend only on the shape. Splitting M first is free (op(B) is packed once); splitting
// N repacks A once per column block.
static void choose_tiles(GemmPlan *g) {
    size_t nblocks = size_ceil_div(g->K, KC_MAX);
    g->kc = size_ceil_div(g->K, nblocks);
    g->mc = size_min(MC_MAX, size_round_up(g->M, MR));
    g->nc = size_min(NC_MAX, size_round_up(g->N, NR));
    while (size_ceil_div(g->M, g->mc) * size_ceil_div(g->N, g->nc) < MIN_TILES) {
        if (g->mc >= 2 * MC_MIN) g->mc = size_round_up(g->mc / 2, MR);
        else if (g->nc >= 2 * NC_MIN) g->nc = size_round_up(g->nc / 2, NR);
        else break;
    }
}

static void gemm_packed(GemmPlan *g) {
    choose_tiles(g);
    g->n_pad = size_round_up(g->N, NR);
    real *b_packed = alloc_pack(g->n_pad * g->K);
    g->b_packed = b_packed;
    size_t n_panels = g->n_pad / NR, m_tiles = size_ceil_div(g->M, g->mc);
    size_t n_tiles = m_tiles * size_ceil_div(g->N, g->nc);
#pragma omp parallel if (g->M * g->N * g->K >= PARALLEL_WORK)
    {
#pragma omp for schedule(static)
        for (size_t j = 0; j < n_panels; j++) pack_b_panel(g, j * NR, b_packed);
        real *a_packed = alloc_pack(size_round_up(g->mc, MR) * g->kc);
        // Consecutive tiles share a column block, so a thread's B panels stay warm in cache.
#pragma omp for schedule(dynamic, 1)
        for (size_t t = 0; t < n_tiles; t++)
            compute_tile(g, t % m_tiles * g->mc, t / m_tiles * g->nc, a_packed);
        free(a_packed);
    }
    free(b_packed);
}

// Small products: one dot product per element, single-threaded.
static void gemm_direct(const GemmPlan *g) {
    for (size_t i = 0; i < g->M; i++) {
        for (size_t j = 0; j < g->N; j++) {
            const real *a = g->a.p + i * g->a.rs, *b = g->b.p + j * g->b.rs;
            real sum = 0;
            for (size_t k = 0; k < g->K; k++) sum += a[k * g->a.ds] * b[k * g->b.ds];
            real *c = g->C + i * g->ldc + j;
            *c = g->beta == 0 ? g->alpha * sum : g->alpha * sum + g->beta * *c;
        }
    }
}

// C = beta * C, for K == 0 or alpha == 0 where no products contribute (BLAS convention: A and B
// are not read).
static void scale_c(real *C, size_t ldc, size_t M, size_t N, real beta) {
    for (size_t i = 0; i < M; i++, C += ldc) {
        if (beta == 0) memset(C, 0, N * sizeof(real));
        else if (beta != 1)
            for (size_t j = 0; j < N; j++) C[j] *= beta;
    }
}

void cpu_gemm(bool trans_a, bool trans_b, size_t M, size_t N, size_t K, real alpha,
              const real *A, size_t lda, const real *B, size_t ldb, real beta, real *C, size_t ldc) {
    if (M == 0 || N == 0) return;
    MOE_ASSERT(ldc >= N && lda >= (trans_a ? M : K) && ldb >= (trans_b ? K : N));
    if (K == 0 || alpha == 0) {
        scale_c(C, ldc, M, N, beta);
        return;
    }
    GemmPlan g = {
        .a = trans_a ? (View){A, 1, lda} : (View){A, lda, 1},
        .b = trans_b ? (View){B, ldb, 1} : (View){B, 1, ldb},
        .M = M, .N = N, .K = K, .alpha = alpha, .beta = beta, .C = C, .ldc = ldc,
    };
    if (M * N * K < SMALL_WORK) gemm_direct(&g);
    else gemm_packed(&g);
}

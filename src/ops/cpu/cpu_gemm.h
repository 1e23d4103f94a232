// The CPU matrix multiply every CPU op builds on: cache-blocked, packed, OpenMP-parallel over
// output tiles. Each output element is summed by one thread in a fixed order, so results do not
// depend on the number of threads.
#pragma once
#include <stdbool.h>
#include <stddef.h>

#include "common/real.h"

// The register tile of the CPU's products (cpu_gemm's and the FP8 emulation's): CPU_GEMM_MR rows by
// two vectors of CPU_VEC_BYTES. The accumulators (2 CPU_GEMM_MR vectors) plus the two loaded B
// vectors and one broadcast must fit in the register file: 32 zmm on AVX-512, 16 ymm on AVX2, 16
// xmm on SSE, 32 q on NEON.
#if defined(__AVX512F__)
#define CPU_VEC_BYTES 64
#define CPU_GEMM_MR 12
#elif defined(__AVX__)
#define CPU_VEC_BYTES 32
#define CPU_GEMM_MR 6
#elif defined(__ARM_NEON)
#define CPU_VEC_BYTES 16
#define CPU_GEMM_MR 12
#else
#define CPU_VEC_BYTES 16
#define CPU_GEMM_MR 6
#endif

// C = alpha * op(A) * op(B) + beta * C, all row-major.
// op(A) is (M, K): A is stored (M, K) with row stride lda, or (K, M) when trans_a.
// op(B) is (K, N): B is stored (K, N) with row stride ldb, or (N, K) when trans_b.
// C is (M, N) with row stride ldc. beta == 0 overwrites C without reading it (NaN-safe).
void cpu_gemm(bool trans_a, bool trans_b, size_t M, size_t N, size_t K, real alpha,
              const real *A, size_t lda, const real *B, size_t ldb, real beta, real *C, size_t ldc);

// Defines NAME(kc, a, rs, ds, b, tile), the micro-kernel of the CPU's products for elements of
// type T (cpu_gemm's real, the FP8 emulation's float): tile (CPU_GEMM_MR x 2 vectors of T, row
// major) = A rows (element (i, k) at a[i rs + k ds]) times a packed B panel (kc x the tile's
// width), summed over k in order from zero. Written with GCC vector extensions (no intrinsics, so
// it also builds on Arm); every lane does the same sequence of fused multiply-adds whatever the
// strides, so an output's value does not depend on which instantiation or thread computed it.
#define CPU_GEMM_DEFINE_KERNEL(NAME, T)                                                                       \
    static inline __attribute__((always_inline)) void NAME(size_t kc, const T *restrict a, size_t rs,         \
                                                           size_t ds, const T *restrict b, T *restrict tile) { \
        typedef T vec_t __attribute__((vector_size(CPU_VEC_BYTES)));                                          \
        /* the same vector for loads and stores through T pointers: any alignment, may alias T */             \
        typedef T vec_mem_t __attribute__((vector_size(CPU_VEC_BYTES), aligned(sizeof(T)), may_alias));       \
        enum { lanes = CPU_VEC_BYTES / sizeof(T), width = 2 * lanes };                                        \
        vec_t acc[CPU_GEMM_MR][2] = {{{0}}};                                                                  \
        for (size_t k = 0; k < kc; k++, a += ds, b += width) {                                                \
            vec_t bv[2] = {*(const vec_mem_t *)b, *(const vec_mem_t *)(b + lanes)};                           \
            _Pragma("GCC unroll 16") for (size_t i = 0; i < CPU_GEMM_MR; i++) {                               \
                acc[i][0] += a[i * rs] * bv[0];                                                               \
                acc[i][1] += a[i * rs] * bv[1];                                                               \
            }                                                                                                 \
        }                                                                                                     \
        _Pragma("GCC unroll 16") for (size_t i = 0; i < CPU_GEMM_MR; i++) {                                   \
            *(vec_mem_t *)(tile + i * width) = acc[i][0];                                                     \
            *(vec_mem_t *)(tile + i * width + lanes) = acc[i][1];                                             \
        }                                                                                                     \
    }

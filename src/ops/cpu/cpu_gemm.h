// The CPU matrix multiply every CPU op builds on: cache-blocked, packed, OpenMP-parallel over
// output tiles. Each output element is summed by one thread in a fixed order, so results do not
// depend on the number of threads.
#pragma once
#include <stdbool.h>
#include <stddef.h>

#include "common/real.h"

// C = alpha * op(A) * op(B) + beta * C, all row-major.
// op(A) is (M, K): A is stored (M, K) with row stride lda, or (K, M) when trans_a.
// op(B) is (K, N): B is stored (K, N) with row stride ldb, or (N, K) when trans_b.
// C is (M, N) with row stride ldc. beta == 0 overwrites C without reading it (NaN-safe).
void cpu_gemm(bool trans_a, bool trans_b, size_t M, size_t N, size_t K, real alpha,
              const real *A, size_t lda, const real *B, size_t ldb, real beta, real *C, size_t ldc);

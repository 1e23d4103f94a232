// Tensor-core building blocks shared by the attention and grouped-GEMM kernels: mma.m16n8k16 (bf16
// in, fp32 accumulate) on register fragments, ldmatrix loads from shared memory, and cp.async.
// Lane l holds, with g = l / 4 and t = l % 4:
//   A (16 x 16): rows g and g + 8, columns 2t, 2t + 1 and 2t + 8, 2t + 9
//   B (16 x 8):  rows (k) 2t, 2t + 1 and 2t + 8, 2t + 9 of column g
//   C (16 x 8):  rows g and g + 8, columns 2t, 2t + 1
#pragma once
#include "cuda_common.cuh"

__device__ __forceinline__ void mma16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldsm_x4(uint32_t r[4], const bf16 *p) {
    unsigned addr = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t r[4], const bf16 *p) {
    unsigned addr = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

__device__ __forceinline__ void cp_async16(void *smem, const void *gmem, bool valid) {
    unsigned addr = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }

// A fragment (16 x 16 at m0, k0) from a tile stored [m][k] (ldm elements per row).
__device__ __forceinline__ void ldsm_a(uint32_t a[4], const bf16 *tile, int ldm, int m0, int k0) {
    int l = threadIdx.x & 31, mi = l / 8;
    ldsm_x4(a, tile + (size_t)(m0 + (mi % 2) * 8 + l % 8) * ldm + k0 + (mi / 2) * 8);
}

// A fragment (16 x 16 at m0, k0) from a tile stored transposed, [k][m].
__device__ __forceinline__ void ldsm_a_trans(uint32_t a[4], const bf16 *tile, int ldm, int m0, int k0) {
    int l = threadIdx.x & 31, mi = l / 8;
    ldsm_x4_trans(a, tile + (size_t)(k0 + (mi / 2) * 8 + l % 8) * ldm + m0 + (mi % 2) * 8);
}

// B fragments of the two n8 blocks n0, n0 + 8 at k0 from a tile stored [n][k].
__device__ __forceinline__ void ldsm_b_nk(uint32_t b[4], const bf16 *tile, int ldm, int n0, int k0) {
    int l = threadIdx.x & 31, mi = l / 8;
    ldsm_x4(b, tile + (size_t)(n0 + (mi / 2) * 8 + l % 8) * ldm + k0 + (mi % 2) * 8);
}

// B fragments of the two n8 blocks n0, n0 + 8 at k0 from a tile stored [k][n].
__device__ __forceinline__ void ldsm_b_kn(uint32_t b[4], const bf16 *tile, int ldm, int n0, int k0) {
    int l = threadIdx.x & 31, mi = l / 8;
    ldsm_x4_trans(b, tile + (size_t)(k0 + (mi % 2) * 8 + l % 8) * ldm + n0 + (mi / 2) * 8);
}

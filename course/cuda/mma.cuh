// Tensor-core matrix products (mma.sync m16n8k16, bf16 in, float32 accumulate) and the
// ldmatrix loads that feed them: the wrappers stages 12 and 14 share. sm_80 and later.
//
// Fragment layouts (PTX ISA, "mma.m16n8k16"): lane = 4 g + t (g = lane / 4, t = lane % 4).
//   A (16 x 16, row-major), 4 registers of 2 bf16: (g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..),
//     (g+8, 2t+8..).
//   B (16 x 8, "col": 8 columns of 16), 2 registers: (k 2t..2t+1, n g), (k 2t+8.., n g).
//   C (16 x 8, float32), 4 floats: (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1).
// Rows of keys in shared memory (d contiguous dims each) are B of S = Q K^T as they are
// (n = key, k = dim): ldmatrix reads them. For O += P V the keys are the k index:
// ldmatrix.trans transposes 8 x 8 pieces on the way. And the C fragments of two neighbouring
// 8-key score tiles are, element for element, the A fragment of P for those 16 keys.
#pragma once
#include <cuda_bf16.h>
#include <cstdint>

#include "vec.cuh"  // pack_bf16: a fragment's registers from floats

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8 x 8 bf16 matrices from shared memory: lanes 8i .. 8i+7 give the addresses of the 8
// rows (16 bytes each) of matrix i; register i of lane 4g + t holds row g, columns 2t, 2t+1
// of matrix i (.trans: row 2t and 2t+1, column g -- the matrix transposed). The address is
// in the shared window (smem_addr): a kernel that steps through a swizzled row by flipping
// bits of one address keeps it as 32 bits (stage 14); the others pass a pointer.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const __nv_bfloat16* p) {
  ldmatrix_x4(r, smem_addr(p));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const __nv_bfloat16* p) {
  ldmatrix_x4_trans(r, smem_addr(p));
}

// c += a b on the tensor cores: a 16 x 16 (A fragment), b 16 x 8 (B fragment), c 16 x 8 float.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

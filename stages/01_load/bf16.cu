// Stage 01 kernel: float32 <-> bfloat16 conversion by bit manipulation.
//
// bf16 keeps float32's sign and 8-bit exponent and the top 7 of its 23 mantissa bits, so
// converting is "drop the low 16 bits" -- but rounded to nearest, ties to even:
//
//     bits  = float_as_uint(x)
//     lsb   = (bits >> 16) & 1          // the last bit we keep: makes ties go to even
//     bits += 0x7FFF + lsb              // carries into bit 16 when the dropped half > 0.5 ulp
//     bf16  = bits >> 16
//
// NaN must stay NaN (the carry could turn a NaN's payload into infinity), so NaN maps to the
// canonical quiet NaN 0x7FC0, as torch does. Infinities and subnormals need no special case.
// Reference: bf16.py (fp32_to_bf16_native). Run: nox -s grade -- 01
#include <cuda_runtime.h>
#include <cstdint>

#include "tvllm.h"

__device__ __forceinline__ uint16_t fp32_to_bf16_bits(float x) {
  // TODO stage 01: round-to-nearest-even on the bits, NaN to 0x7FC0 (about 4 lines)
  return 0;
}

__device__ __forceinline__ float bf16_bits_to_fp32(uint16_t b) {
  // TODO stage 01: widen: the bf16 bits are the float's top 16 bits (about 1 line)
  return 0.0f;
}

// Each thread converts 4 consecutive floats: one 16-byte load, one 8-byte store.
__global__ void fp32_to_bf16_kernel(const float* __restrict__ in, uint16_t* __restrict__ out,
                                    int64_t n) {
  // TODO stage 01: 4 elements per thread with a float4 load; a scalar tail (about 9 lines)
}

__global__ void bf16_to_fp32_kernel(const uint16_t* __restrict__ in, float* __restrict__ out,
                                    int64_t n) {
  // TODO stage 01: 4 elements per thread: an 8-byte load, a 16-byte store; a scalar tail (about 9 lines)
}

constexpr int kThreads = 256;

// in, out: n elements each, 16-byte aligned (fresh torch allocations are).
tvllm_status launch_fp32_to_bf16(const float* in, uint16_t* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return TVLLM_OK;
  // TODO stage 01: one thread per 4 elements, kThreads threads per block (about 3 lines)
  return "TODO stage 01: one thread per 4 elements, kThreads threads per block (about 3 lines)";
}

tvllm_status launch_bf16_to_fp32(const uint16_t* in, float* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return TVLLM_OK;
  // TODO stage 01: same grid as launch_fp32_to_bf16 (about 3 lines)
  return "TODO stage 01: same grid as launch_fp32_to_bf16 (about 3 lines)";
}

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
  // BEGIN SOLUTION: round-to-nearest-even on the bits, NaN to 0x7FC0 | return 0;
  uint32_t bits = __float_as_uint(x);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  uint32_t lsb = (bits >> 16) & 1u;
  return static_cast<uint16_t>((bits + 0x7FFFu + lsb) >> 16);
  // END SOLUTION
}

__device__ __forceinline__ float bf16_bits_to_fp32(uint16_t b) {
  // BEGIN SOLUTION: widen: the bf16 bits are the float's top 16 bits | return 0.0f;
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
  // END SOLUTION
}

// Each thread converts 4 consecutive floats: one 16-byte load, one 8-byte store.
__global__ void fp32_to_bf16_kernel(const float* __restrict__ in, uint16_t* __restrict__ out,
                                    int64_t n) {
  // BEGIN SOLUTION: 4 elements per thread with a float4 load; a scalar tail
  int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 4;
  if (i + 3 < n) {
    float4 v = *reinterpret_cast<const float4*>(in + i);
    ushort4 r = make_ushort4(fp32_to_bf16_bits(v.x), fp32_to_bf16_bits(v.y),
                             fp32_to_bf16_bits(v.z), fp32_to_bf16_bits(v.w));
    *reinterpret_cast<ushort4*>(out + i) = r;
  } else {
    for (; i < n; ++i) out[i] = fp32_to_bf16_bits(in[i]);
  }
  // END SOLUTION
}

__global__ void bf16_to_fp32_kernel(const uint16_t* __restrict__ in, float* __restrict__ out,
                                    int64_t n) {
  // BEGIN SOLUTION: 4 elements per thread: an 8-byte load, a 16-byte store; a scalar tail
  int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 4;
  if (i + 3 < n) {
    ushort4 v = *reinterpret_cast<const ushort4*>(in + i);
    *reinterpret_cast<float4*>(out + i) =
        make_float4(bf16_bits_to_fp32(v.x), bf16_bits_to_fp32(v.y), bf16_bits_to_fp32(v.z),
                    bf16_bits_to_fp32(v.w));
  } else {
    for (; i < n; ++i) out[i] = bf16_bits_to_fp32(in[i]);
  }
  // END SOLUTION
}

constexpr int kThreads = 256;

// in, out: n elements each, 16-byte aligned (fresh torch allocations are).
tvllm_status launch_fp32_to_bf16(const float* in, uint16_t* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return TVLLM_OK;
  // BEGIN SOLUTION: one thread per 4 elements, kThreads threads per block | return "{todo}";
  int64_t blocks = tvllm_ceil_div(n, 4 * kThreads);
  fp32_to_bf16_kernel<<<blocks, kThreads, 0, stream>>>(in, out, n);
  return TVLLM_OK;
  // END SOLUTION
}

tvllm_status launch_bf16_to_fp32(const uint16_t* in, float* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return TVLLM_OK;
  // BEGIN SOLUTION: same grid as launch_fp32_to_bf16 | return "{todo}";
  int64_t blocks = tvllm_ceil_div(n, 4 * kThreads);
  bf16_to_fp32_kernel<<<blocks, kThreads, 0, stream>>>(in, out, n);
  return TVLLM_OK;
  // END SOLUTION
}

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
// canonical quiet NaN 0x7FC0 (torch's own NaN bits differ between its CPU and CUDA paths; this
// project pins one). Infinities, subnormals and the overflow of the largest floats to infinity
// need no special case: the carry does the right thing.
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

// Each thread converts 4 consecutive elements. When both pointers are aligned (`vec`), that is
// one 16-byte float4 access on the fp32 side and one 8-byte access on the bf16 side: few, wide,
// coalesced memory transactions, which is all a memory-bound kernel can optimize. A view such
// as x[1:] is contiguous but not 16-byte aligned; it takes the scalar path (a misaligned
// vector access is a CUDA error, not a slowdown). The last thread may have fewer than 4.
__global__ void fp32_to_bf16_kernel(const float* __restrict__ in, uint16_t* __restrict__ out,
                                    int64_t n, bool vec) {
  // BEGIN SOLUTION: 4 elements per thread: a float4 load when vec, else (and at the end) scalars
  int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 4;
  if (vec && i + 4 <= n) {
    float4 v = *reinterpret_cast<const float4*>(in + i);
    *reinterpret_cast<ushort4*>(out + i) =
        make_ushort4(fp32_to_bf16_bits(v.x), fp32_to_bf16_bits(v.y), fp32_to_bf16_bits(v.z),
                     fp32_to_bf16_bits(v.w));
  } else {
    for (int64_t end = i + 4 < n ? i + 4 : n; i < end; ++i) out[i] = fp32_to_bf16_bits(in[i]);
  }
  // END SOLUTION
}

__global__ void bf16_to_fp32_kernel(const uint16_t* __restrict__ in, float* __restrict__ out,
                                    int64_t n, bool vec) {
  // BEGIN SOLUTION: 4 elements per thread: an 8-byte load, a 16-byte store when vec, else scalars
  int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 4;
  if (vec && i + 4 <= n) {
    ushort4 v = *reinterpret_cast<const ushort4*>(in + i);
    *reinterpret_cast<float4*>(out + i) =
        make_float4(bf16_bits_to_fp32(v.x), bf16_bits_to_fp32(v.y), bf16_bits_to_fp32(v.z),
                    bf16_bits_to_fp32(v.w));
  } else {
    for (int64_t end = i + 4 < n ? i + 4 : n; i < end; ++i) out[i] = bf16_bits_to_fp32(in[i]);
  }
  // END SOLUTION
}

constexpr int kThreads = 256;

// in, out: n contiguous elements each, on the device.
tvllm_status launch_fp32_to_bf16(const float* in, uint16_t* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return TVLLM_OK;
  // BEGIN SOLUTION: vec = in 16-, out 8-byte aligned; a thread per 4 elements | return "{todo}";
  bool vec = tvllm_aligned(in, 16) && tvllm_aligned(out, 8);
  int64_t blocks = tvllm_ceil_div(n, 4 * kThreads);
  fp32_to_bf16_kernel<<<blocks, kThreads, 0, stream>>>(in, out, n, vec);
  return TVLLM_OK;
  // END SOLUTION
}

tvllm_status launch_bf16_to_fp32(const uint16_t* in, float* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return TVLLM_OK;
  // BEGIN SOLUTION: the same grid; vec = in 8-, out 16-byte aligned | return "{todo}";
  bool vec = tvllm_aligned(in, 8) && tvllm_aligned(out, 16);
  int64_t blocks = tvllm_ceil_div(n, 4 * kThreads);
  bf16_to_fp32_kernel<<<blocks, kThreads, 0, stream>>>(in, out, n, vec);
  return TVLLM_OK;
  // END SOLUTION
}

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
  // TODO stage 01: round-to-nearest-even on the bits, NaN to 0x7FC0 (about 4 lines)
  return 0;
}

__device__ __forceinline__ float bf16_bits_to_fp32(uint16_t b) {
  // TODO stage 01: widen: the bf16 bits are the float's top 16 bits (about 1 line)
  return 0.0f;
}

// Each thread converts 4 consecutive elements. When both pointers are aligned (`vec`), that is
// one 16-byte float4 access on the fp32 side and one 8-byte access on the bf16 side: few, wide,
// coalesced memory transactions, which is all a memory-bound kernel can optimize. A view such
// as x[1:] is contiguous but not 16-byte aligned; it takes the scalar path (a misaligned
// vector access is a CUDA error, not a slowdown). The last thread may have fewer than 4.
__global__ void fp32_to_bf16_kernel(const float* __restrict__ in, uint16_t* __restrict__ out,
                                    int64_t n, bool vec) {
  // TODO stage 01: 4 elements per thread: a float4 load when vec, else (and at the end) scalars (about 9 lines)
}

__global__ void bf16_to_fp32_kernel(const uint16_t* __restrict__ in, float* __restrict__ out,
                                    int64_t n, bool vec) {
  // TODO stage 01: 4 elements per thread: an 8-byte load, a 16-byte store when vec, else scalars (about 9 lines)
}

constexpr int kThreads = 256;

// in, out: n contiguous elements each, on the device.
tvllm_status launch_fp32_to_bf16(const float* in, uint16_t* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return TVLLM_OK;
  // TODO stage 01: vec = in 16-, out 8-byte aligned; a thread per 4 elements (about 4 lines)
  return "TODO stage 01: vec = in 16-, out 8-byte aligned; a thread per 4 elements (about 4 lines)";
}

tvllm_status launch_bf16_to_fp32(const uint16_t* in, float* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return TVLLM_OK;
  // TODO stage 01: the same grid; vec = in 8-, out 16-byte aligned (about 4 lines)
  return "TODO stage 01: the same grid; vec = in 8-, out 16-byte aligned (about 4 lines)";
}

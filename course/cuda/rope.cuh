// Stage 05's rotation (rotate-half pairs x1 = x[i], x2 = x[i + d/2]) with Hugging Face's bf16
// roundings, for the kernels that rotate on the way to the cache: stage 13's rope_cache_write
// and stage 14's decode attention (its new token, and q in its fragments). transformers
// computes q * cos + rotate_half(q) * sin as separate bf16 tensor ops, so cos and sin are
// rounded to bf16, and each product and the sum too; __fmul_rn keeps nvcc from fusing a product
// into the sum (an FMA rounds once, transformers twice). Matching it bit for bit is what keeps
// the engine token-for-token equal to transformers.
#pragma once
#include <cuda_bf16.h>

#include "vec.cuh"

// Two pairs at once, in place: x1.x and x2.x at one angle (cos_v.x, sin_v.x), x1.y and x2.y at
// another: x1 <- x1 cos - x2 sin, x2 <- x2 cos + x1 sin (every value a bf16's). Each rounding
// takes the two pairs' values together, one F2FP instruction (vec.cuh's pack_bf16): rounding
// one value (__float2bfloat16_rn, F2F) issues at 16 a clock on an SM, an eighth of a multiply's
// rate, and a rotation rounds eight times (lesson 06, "The norm in the GEMV's prologue").
__device__ __forceinline__ void rotate_two(float2& x1, float2& x2, float2 cos_v, float2 sin_v) {
  const auto bf = [](float a, float b) { return unpack_bf16(pack_bf16(a, b)); };
  const float2 cs = bf(cos_v.x, cos_v.y), sn = bf(sin_v.x, sin_v.y);
  const float2 x1c = bf(__fmul_rn(x1.x, cs.x), __fmul_rn(x1.y, cs.y));
  const float2 x2s = bf(__fmul_rn(x2.x, sn.x), __fmul_rn(x2.y, sn.y));
  const float2 x2c = bf(__fmul_rn(x2.x, cs.x), __fmul_rn(x2.y, cs.y));
  const float2 x1s = bf(__fmul_rn(x1.x, sn.x), __fmul_rn(x1.y, sn.y));
  x1 = bf(x1c.x - x2s.x, x1c.y - x2s.y);
  x2 = bf(x2c.x + x1s.x, x2c.y + x1s.y);
}

// One pair, in place (the same arithmetic; the second half of each rounding is unused).
__device__ __forceinline__ void rotate_pair(float& x1, float& x2, float cos_v, float sin_v) {
  float2 a = make_float2(x1, x1), b = make_float2(x2, x2);
  rotate_two(a, b, make_float2(cos_v, cos_v), make_float2(sin_v, sin_v));
  x1 = a.x;
  x2 = b.x;
}

// Two of stage 05's pairs in two words of two bf16, in place: `first` holds dims i and i + 1,
// `second` dims i + d/2 and i + 1 + d/2; cos_v[0], sin_v[0] are pair i's angle's, cos_v[1],
// sin_v[1] pair i + 1's (stage 14 rotates q in its mma fragments this way).
__device__ __forceinline__ void rotate_packed(uint32_t& first, uint32_t& second,
                                              const float* cos_v, const float* sin_v) {
  float2 x1 = unpack_bf16(first), x2 = unpack_bf16(second);
  rotate_two(x1, x2, make_float2(cos_v[0], cos_v[1]), make_float2(sin_v[0], sin_v[1]));
  first = pack_bf16(x1.x, x1.y);
  second = pack_bf16(x2.x, x2.y);
}

// 8 pairs: lo holds x[i .. i + 7], hi x[i + d/2 .. i + d/2 + 7]; cos_v, sin_v their angles'.
__device__ __forceinline__ void rotate(Pack<__nv_bfloat16, 8>& lo, Pack<__nv_bfloat16, 8>& hi,
                                       const float* cos_v, const float* sin_v) {
#pragma unroll
  for (int k = 0; k < 4; ++k) rotate_packed(words(lo)[k], words(hi)[k], cos_v + 2 * k, sin_v + 2 * k);
}

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

// One pair, in place: x1 <- x1 cos - x2 sin, x2 <- x2 cos + x1 sin (every value a bf16's).
__device__ __forceinline__ void rotate_pair(float& x1, float& x2, float cos_v, float sin_v) {
  const auto bf = [](float x) { return to_float(from_float<__nv_bfloat16>(x)); };
  const float cs = bf(cos_v), sn = bf(sin_v);
  const float a = bf(__fmul_rn(x1, cs)) - bf(__fmul_rn(x2, sn));
  const float b = bf(__fmul_rn(x2, cs)) + bf(__fmul_rn(x1, sn));
  x1 = bf(a);
  x2 = bf(b);
}

// 8 pairs: lo holds x[i .. i + 7], hi x[i + d/2 .. i + d/2 + 7]; cos_v, sin_v their angles'.
__device__ __forceinline__ void rotate(Pack<__nv_bfloat16, 8>& lo, Pack<__nv_bfloat16, 8>& hi,
                                       const float* cos_v, const float* sin_v) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    float x1 = to_float(lo.v[j]), x2 = to_float(hi.v[j]);
    rotate_pair(x1, x2, cos_v[j], sin_v[j]);
    lo.v[j] = from_float<__nv_bfloat16>(x1);
    hi.v[j] = from_float<__nv_bfloat16>(x2);
  }
}

// Two of stage 05's pairs at once, in place: dims i and i + 1 (two bf16 in `first`) with
// dims i + d/2 and i + 1 + d/2 (in `second`); half = d/2; s_rope: the position's cos of
// pairs 0 .. half - 1, then their sin (stage 14 rotates q in its mma fragments this way).
__device__ __forceinline__ void rotate_packed(uint32_t& first, uint32_t& second,
                                              const float* s_rope, int i, int half) {
  const float2 x = unpack_bf16(first), y = unpack_bf16(second);
  float a1 = x.x, a2 = y.x, b1 = x.y, b2 = y.y;
  rotate_pair(a1, a2, s_rope[i], s_rope[half + i]);
  rotate_pair(b1, b2, s_rope[i + 1], s_rope[half + i + 1]);
  first = pack_bf16(a1, b1);
  second = pack_bf16(a2, b2);
}

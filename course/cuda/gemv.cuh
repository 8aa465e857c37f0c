// What stage 06's two GEMVs share: the products they take and the 16-byte pack they read.
//
// gemv_simple.cu (a warp per output) and gemv.cu (the fast one) both compute y = x @ weight^T
// for a decode step's few bf16 tokens, reading weight and x as packs of 8 bf16 (16 bytes, one
// load instruction). linear.py sends a product to a GEMV only where gemv_fits holds; each
// launcher checks it again and refuses with a sentence otherwise.
#pragma once
#include <cuda_bf16.h>
#include <cstdint>

#include "tvllm.h"
#include "vec.cuh"

constexpr int kGemvMaxTokens = 8;  // above this, cuBLAS (gemm.cu): x's reuse pays for tiles

using BF8 = Pack<__nv_bfloat16, 8>;

__device__ __forceinline__ BF8 as_bf8(const uint4& raw) { return reinterpret_cast<const BF8&>(raw); }

// Whether a GEMV takes this product: bf16, 1-8 tokens, rows of a whole number of 16-byte
// pieces (in % 8 == 0), 16-byte aligned x and weight, sizes that fit an int.
inline bool gemv_fits(bool bf16, int64_t tokens, int64_t in_features, int64_t out_features,
                      const void* x, const void* weight) {
  return bf16 && tokens >= 1 && tokens <= kGemvMaxTokens && in_features % 8 == 0 &&
         in_features < (int64_t{1} << 30) && out_features < (int64_t{1} << 30) &&
         tvllm_aligned(x, 16) && tvllm_aligned(weight, 16);
}

// Why a GEMV refuses a product that gemv_fits does not take (the launchers' one sentence).
constexpr const char* kGemvRefusal =
    "gemv: needs 1-8 tokens, in_features a multiple of 8 and 16-byte aligned x and weight";

// launch(y) with y as float* (y_f32: float32 logits) or as __nv_bfloat16*: a GEMV's two
// output types, one instance each.
template <typename Launch>
tvllm_status with_output_type(void* y, bool y_f32, Launch launch) {
  return y_f32 ? launch(static_cast<float*>(y)) : launch(static_cast<__nv_bfloat16*>(y));
}

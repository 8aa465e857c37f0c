// Stage 06 kernel, part 1: y = x @ weight^T for a few tokens (decode), a warp per output.
//
// At 1-8 tokens a Linear layer is a matrix-vector product: each weight is read once and used
// for 1-8 multiply-adds, so the kernel's time is the time to read the weight. This one reads
// it simply and in full-width loads:
//
//     warp w of the grid computes output column `row` = w of y, for every token;
//     lane l reads the row's 16-byte pieces l, l + 32, l + 64, ... (8 bf16 each: one load
//     instruction, and the 32 lanes read 512 contiguous bytes at once), and the same pieces
//     of every token's x; it multiplies and adds in float32, one sum per token;
//     the 32 lanes' sums are added by a butterfly of shuffles (__shfl_xor_sync 16, 8, 4, 2, 1:
//     afterwards every lane holds the total), and lane 0 writes y[t, row], rounded once.
//
// float32 accumulation and one rounding at the end, like cuBLAS with CUBLAS_COMPUTE_32F:
// the result equals linear_native within the bf16 tolerance. bf16 in; bf16 or float32 out
// (the logits). gemv.cu is the fast GEMV (part 2); linear.py runs it once it is written.
// Reference: linear.py (linear_native). Run: python3 -m grader 06
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdint>

#include "gemv.cuh"
#include "tvllm.h"
#include "vec.cuh"

namespace {

constexpr int kSimpleThreads = 256;  // 8 warps: 8 outputs a block
constexpr int kSimpleWarps = kSimpleThreads / 32;

// x: [tokens, in] bf16, weight: [out, in] bf16, y: [tokens, out] of OutT; in % 8 == 0, x and
// weight 16-byte aligned, 1 <= tokens <= kGemvMaxTokens. Warp w of the grid owns output w.
template <typename OutT>
__global__ void __launch_bounds__(kSimpleThreads)
gemv_simple_kernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ weight,
                   OutT* __restrict__ y, int tokens, int in_features, int out_features) {
  // TODO stage 06: this warp's output row (none past out_features: return, the whole warp); lane l takes pieces l, l + 32, ... of the row (uint4, in / 8 of them) and the same pieces of each token's x; float32 sums, one per token (acc[kGemvMaxTokens], t < tokens); butterfly them with __shfl_xor_sync; lane 0 writes y[t * out + row] with from_float<OutT> (about 24 lines)
}

template <typename OutT>
tvllm_status launch(const __nv_bfloat16* x, const __nv_bfloat16* weight, OutT* y, int tokens,
                    int in_features, int out_features, cudaStream_t stream) {
  // TODO stage 06: a warp per output: enough blocks of kSimpleThreads to cover out_features (round up); launch on `stream` and return TVLLM_OK (the binding checks the launch) (about 4 lines)
  return "TODO stage 06: a warp per output: enough blocks of kSimpleThreads to cover out_features (round up); launch on `stream` and return TVLLM_OK (the binding checks the launch) (about 4 lines)";
}

}  // namespace

// x: [tokens, in] bf16, weight: [out, in] bf16, y: [tokens, out] bf16 (y_f32 false) or float32;
// gemv_fits must hold (else a sentence says what it needs).
tvllm_status launch_gemv_simple(const void* x, const void* weight, void* y, bool y_f32,
                                int64_t tokens, int64_t in_features, int64_t out_features,
                                cudaStream_t stream) {
  if (!gemv_fits(true, tokens, in_features, out_features, x, weight)) return kGemvRefusal;
  if (out_features == 0) return TVLLM_OK;
  const auto* xb = static_cast<const __nv_bfloat16*>(x);
  const auto* wb = static_cast<const __nv_bfloat16*>(weight);
  const int t = static_cast<int>(tokens), k = static_cast<int>(in_features),
            n = static_cast<int>(out_features);
  return with_output_type(y, y_f32, [&](auto* out) { return launch(xb, wb, out, t, k, n, stream); });
}

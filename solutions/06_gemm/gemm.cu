// Stage 06 kernel: a Linear layer, y = x @ weight^T, through cuBLAS (cublasGemmEx).
//
// x is [tokens, in] and weight is [out, in] (torch's nn.Linear layout), both row-major; y is
// [tokens, out], row-major. cuBLAS is column-major: it reads a matrix stored with leading
// dimension ld as column after column. A row-major [r, c] buffer read that way is the
// column-major [c, r] matrix -- its transpose -- at no cost. So instead of y = x w^T we ask
// cuBLAS for its transpose, which has y's exact bytes:
//
//     y^T (out x tokens) = w (out x in) * x^T (in x tokens)
//
//     A = weight buffer, seen column-major [in, out] = w^T  -> transa = T gives w,  lda = in
//     B = x buffer,      seen column-major [in, tokens] = x^T -> transb = N,          ldb = in
//     C = y buffer,      seen column-major [out, tokens] = y^T                       ldc = out
//     m = out, n = tokens, k = in
//
// bf16 (or fp16) in and out, float32 accumulation (CUBLAS_COMPUTE_32F), one rounding at the
// end; float32 in and out works too. The handle is torch's (it carries torch's stream and
// workspace). Tensor cores do the work: about 790 TFLOP/s of bf16 on an H200.
// Reference: linear.py (linear_native). Run: nox -s grade -- 06
#include <climits>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "tvllm.h"

namespace {

// The row-major product as one column-major cublasGemmEx call (see the top of this file).
tvllm_status gemm_row_major(cublasHandle_t handle, cudaDataType_t dtype, cudaDataType_t y_dtype,
                            const void* x, const void* weight, void* y, int tokens,
                            int in_features, int out_features) {
  // BEGIN SOLUTION: y^T = op(A) B with A = weight (transposed), B = x; m, n, k and the three leading dimensions | return "{todo}";
  const float alpha = 1.0f, beta = 0.0f;  // float: the compute type's scalar type
  cublasStatus_t status = cublasGemmEx(
      handle, CUBLAS_OP_T, CUBLAS_OP_N,
      out_features, tokens, in_features,
      &alpha,
      weight, dtype, in_features,
      x, dtype, in_features,
      &beta,
      y, y_dtype, out_features,
      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  return status == CUBLAS_STATUS_SUCCESS ? TVLLM_OK : cublasGetStatusString(status);
  // END SOLUTION
}

}  // namespace

// x: [tokens, in] and weight: [out, in] of `dtype` (CUDA_R_16BF, CUDA_R_16F or CUDA_R_32F),
// y: [tokens, out] of `y_dtype` (dtype, or CUDA_R_32F: logits keep the float32 accumulator
// instead of rounding it to bf16), all contiguous. `handle` must be bound to `stream`;
// torch's at::cuda::getCurrentCUDABlasHandle() is bound to the current stream. (A decode
// step's few tokens go to a GEMV instead, gemv_simple.cu or gemv.cu: linear.py decides.)
tvllm_status launch_linear(cublasHandle_t handle, cudaStream_t stream, cudaDataType_t dtype,
                           cudaDataType_t y_dtype, const void* x, const void* weight, void* y,
                           int64_t tokens, int64_t in_features, int64_t out_features) {
  if (tokens == 0 || out_features == 0) return TVLLM_OK;
  if (in_features <= 0) return "in_features must be positive";
  if (tokens > INT_MAX || in_features > INT_MAX || out_features > INT_MAX)
    return "cuBLAS takes int sizes: tokens, in_features and out_features must be < 2^31";
  cudaStream_t bound = nullptr;
  if (cublasGetStream(handle, &bound) != CUBLAS_STATUS_SUCCESS || bound != stream)
    return "the cuBLAS handle is not bound to the launch stream";
  // Split-K algorithms add partial sums; by default cuBLAS may add them in the output type
  // (bf16), rounding many times. Keep them in float32 -- one rounding, like linear_native --
  // and put the handle back as torch left it.
  cublasMath_t saved;
  if (cublasGetMathMode(handle, &saved) != CUBLAS_STATUS_SUCCESS)
    return "cublasGetMathMode failed";
  if (cublasSetMathMode(handle, static_cast<cublasMath_t>(
                                    CUBLAS_DEFAULT_MATH |
                                    CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)) !=
      CUBLAS_STATUS_SUCCESS)
    return "cublasSetMathMode failed";
  tvllm_status status = gemm_row_major(handle, dtype, y_dtype, x, weight, y, static_cast<int>(tokens),
                                       static_cast<int>(in_features), static_cast<int>(out_features));
  if (cublasSetMathMode(handle, saved) != CUBLAS_STATUS_SUCCESS && status == TVLLM_OK)
    status = "cublasSetMathMode failed to restore the handle's math mode";
  return status;
}

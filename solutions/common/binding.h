// Helpers shared by every *_binding.cpp: input checks and launch checks, so each binding
// states what it accepts in a few lines and every CUDA error becomes a Python exception.
#pragma once
#include <cstring>

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "tvllm.h"

namespace tvllm {

// A CUDA tensor of the given dtype, contiguous, on the same device as `like` (if given).
inline void check_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype,
                         int64_t dim = -1) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got one on ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(dim < 0 || t.dim() == dim, name, " must have ", dim, " dimensions, got shape ",
              t.sizes());
}

inline void check_same_device(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.device() == b.device(), "tensors on different devices: ", a.device(), " and ",
              b.device());
}

inline cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// Raise NotImplementedError for a skeleton's TODO, RuntimeError for a refusal or CUDA error.
inline void check_launch(tvllm_status status, const char* op) {
  TORCH_CHECK_NOT_IMPLEMENTED(status == nullptr || std::strncmp(status, "TODO", 4) != 0, status);
  TORCH_CHECK(status == nullptr, op, ": ", status);
  cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA error: ", cudaGetErrorString(err));
}

}  // namespace tvllm

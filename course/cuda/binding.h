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

// Rows of heads for an attention kernel: [rows, n_heads, head_dim] bf16 on CUDA, each row's
// heads contiguous, rows 16-byte aligned (a multiple of 8 apart): a view of a fused QKV
// projection's output qualifies.
inline void check_head_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got one on ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 3, name, " must be [rows, heads, head_dim], got shape ", t.sizes());
  TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == t.size(2), name,
              ": each row's heads must be contiguous (strides [*, head_dim, 1]), got strides ",
              t.strides());
  TORCH_CHECK(t.stride(0) % 8 == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name,
              ": rows must be 16-byte aligned (row stride a multiple of 8, got ", t.stride(0), ")");
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

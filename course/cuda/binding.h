// Helpers shared by every *_binding.cpp: input checks and launch checks, so each binding
// states what it accepts in a few lines and every CUDA error becomes a Python exception, and
// the kept ticket counters of the kernels whose last block merges.
#pragma once
#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
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

// Tickets for a kernel whose last block to finish a piece of work merges it (stage 08's argmax
// over a row's pieces, stage 14's split-K partitions, stage 06's greedy pick, whose 64-bit key
// sits in words 2-3): `count` int32 counters that are 0 when a launch starts (the block that
// merges resets its own), so they are kept, not allocated per call: a memset per call would
// be one more node in a decode graph. One zeroed buffer per
// device, grown (never freed: a graph captured with an older one still writes to it) when a
// call needs more. Inside a CUDA-graph capture nothing may be allocated for later: a capture
// that needs more than the buffer holds gets zeros of its own from the graph's pool (the
// memset is captured too). One stream at a time per device: two such launches running at once
// would share counters.
inline int32_t* tickets(const at::Tensor& like, int64_t count) {
  static std::mutex mutex;
  static auto* kept = new std::map<int, std::vector<at::Tensor>>();  // outlives every graph
  std::lock_guard<std::mutex> lock(mutex);
  std::vector<at::Tensor>& buffers = (*kept)[like.device().index()];
  if (!buffers.empty() && buffers.back().numel() >= count)
    return buffers.back().data_ptr<int32_t>();
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream(), &capturing));
  const auto options = like.options().dtype(at::kInt);
  if (capturing != cudaStreamCaptureStatusNone) {
    static auto* captured = new std::vector<at::Tensor>();  // alive as long as the graph may be
    captured->push_back(at::zeros({count}, options));
    return captured->back().data_ptr<int32_t>();
  }
  buffers.push_back(at::zeros({std::max<int64_t>(count, 1 << 16)}, options));
  return buffers.back().data_ptr<int32_t>();
}

// The address a kernel uses for t's data: a CUDA tensor's own, or a pinned CPU tensor's when
// the device can address that memory (unified addressing: the same pointer). A kernel's stores
// there cross PCIe (stage 10's pinned_copy.cu).
inline void* device_address(const at::Tensor& t, const char* name) {
  if (t.is_cuda()) return t.data_ptr();
  TORCH_CHECK(t.is_pinned(), name, " must be a CUDA tensor or a pinned CPU tensor");
  cudaPointerAttributes attributes;
  const cudaError_t err = cudaPointerGetAttributes(&attributes, t.data_ptr());
  TORCH_CHECK(err == cudaSuccess && attributes.devicePointer != nullptr, name,
              ": the GPU cannot address this pinned memory (",
              err == cudaSuccess ? "no device pointer" : cudaGetErrorString(err), ")");
  return attributes.devicePointer;
}

// host (optional): [slots, >= rows] int64 pinned CPU memory, with host_slot [1] int64 on
// like's device (the two together or neither): the HostRows (tvllm.h) that a kernel also
// stores `rows` answers in, row host[host_slot[0]] (stage 08's argmax, stage 06's lm_head
// with the greedy pick).
inline HostRows host_rows(const std::optional<at::Tensor>& host,
                          const std::optional<at::Tensor>& host_slot, const at::Tensor& like,
                          int64_t rows) {
  TORCH_CHECK(host.has_value() == host_slot.has_value(), "host and host_slot come together");
  if (!host) return HostRows{nullptr, nullptr, 0, 0};
  TORCH_CHECK(!host->is_cuda() && host->scalar_type() == at::kLong && host->dim() == 2 &&
                  host->is_contiguous() && host->size(1) >= rows,
              "host must be a contiguous [slots, >= ", rows, "] int64 CPU tensor, got ",
              host->scalar_type(), " ", host->sizes());
  auto* host_rows = static_cast<int64_t*>(device_address(*host, "host"));
  check_tensor(*host_slot, "host_slot", at::kLong, 1);
  check_same_device(like, *host_slot);
  TORCH_CHECK(host_slot->size(0) == 1, "host_slot must be [1], got ", host_slot->sizes());
  return HostRows{host_rows, host_slot->data_ptr<int64_t>(), host->size(1), host->size(0)};
}

}  // namespace tvllm

// Helpers shared by every *_binding.cpp: input checks and launch checks, so each binding
// states what it accepts in a few lines and every CUDA error becomes a Python exception, and
// the kept ticket counters of the kernels whose last block merges.
#pragma once
#include <algorithm>
#include <cmath>
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

// For a kernel's 16-byte loads and stores.
inline void check_aligned(const at::Tensor& t, const char* name) {
  TORCH_CHECK(tvllm_aligned(t.data_ptr(), 16), name, " must be 16-byte aligned");
}

// Rows of heads for an attention kernel: [rows, n_heads, head_dim] bf16 on CUDA, each row's
// heads contiguous, rows 16-byte aligned (a multiple of 8 apart, unless there is one row): a
// view of a fused QKV projection's output qualifies.
inline void check_head_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got one on ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 3, name, " must be [rows, heads, head_dim], got shape ", t.sizes());
  TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == t.size(2), name,
              ": each row's heads must be contiguous (strides [*, head_dim, 1]), got strides ",
              t.strides());
  TORCH_CHECK((t.size(0) <= 1 || t.stride(0) % 8 == 0) && tvllm_aligned(t.data_ptr(), 16), name,
              ": rows must be 16-byte aligned (row stride a multiple of 8, got ", t.stride(0), ")");
}

inline void check_same_device(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.device() == b.device(), "tensors on different devices: ", a.device(), " and ",
              b.device());
}

// What every varlen prefill attention takes (stage 07's kernel and stage 12's): q [Tq, n_heads,
// d], k, v [Tk, n_kv, d] head rows; cu_seqlens_q, cu_seqlens_k [n_seqs + 1] int32; out q's shape,
// contiguous and aligned; n_heads a multiple of n_kv; max_seqlen_q in [0, Tq]; scale finite.
// The offsets themselves stay on the device (reading them would make the host wait).
inline void check_prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                    int64_t max_seqlen_q, double scale, const at::Tensor& out) {
  check_head_rows(q, "q");
  check_head_rows(k, "k");
  check_head_rows(v, "v");
  check_tensor(out, "out", at::kBFloat16, 3);
  check_tensor(cu_seqlens_q, "cu_seqlens_q", at::kInt, 1);
  check_tensor(cu_seqlens_k, "cu_seqlens_k", at::kInt, 1);
  for (const at::Tensor& t : {k, v, out, cu_seqlens_q, cu_seqlens_k}) check_same_device(q, t);
  TORCH_CHECK(k.sizes() == v.sizes(), "k and v must have one shape, got ", k.sizes(), " and ",
              v.sizes());
  TORCH_CHECK(k.size(2) == q.size(2), "q is ", q.sizes(), " so k and v must be [tokens, n_kv_heads, ",
              q.size(2), "], got ", k.sizes());
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "n_heads (", q.size(1),
              ") must be a multiple of n_kv_heads (", k.size(1), ")");
  TORCH_CHECK(out.sizes() == q.sizes(), "out must be ", q.sizes(), ", got ", out.sizes());
  check_aligned(out, "out");
  TORCH_CHECK(std::isfinite(scale), "scale must be finite, got ", scale);
  TORCH_CHECK(cu_seqlens_q.numel() >= 1 && cu_seqlens_k.numel() == cu_seqlens_q.numel(),
              "cu_seqlens_q and cu_seqlens_k must both be [n_seqs + 1], got ", cu_seqlens_q.numel(),
              " and ", cu_seqlens_k.numel(), " entries");
  TORCH_CHECK(max_seqlen_q >= 0 && max_seqlen_q <= q.size(0), "max_seqlen_q must be in [0, ",
              q.size(0), "], got ", max_seqlen_q);
  TORCH_CHECK(q.size(0) < (int64_t{1} << 31) && k.size(0) < (int64_t{1} << 31),
              "at most 2^31 - 1 tokens");
}

// What every decode attention takes (stage 09's contiguous cache and stage 14's paged one): q
// [batch, n_heads, d] head rows; k_cache, v_cache [*, *, n_kv, d] bf16 of one shape, contiguous
// (`layout` names their first two dimensions in messages); out q's shape; n_heads a multiple
// of n_kv; d a multiple of 8 up to 128; out and the caches 16-byte aligned; scale finite.
inline void check_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& out, double scale,
                                   const char* layout) {
  check_head_rows(q, "q");
  check_tensor(k_cache, "k_cache", at::kBFloat16, 4);
  check_tensor(v_cache, "v_cache", at::kBFloat16, 4);
  check_tensor(out, "out", at::kBFloat16, 3);
  for (const at::Tensor& t : {k_cache, v_cache, out}) check_same_device(q, t);
  const int64_t n_heads = q.size(1), head_dim = q.size(2), n_kv = k_cache.size(2);
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache must have one shape, got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  TORCH_CHECK(k_cache.size(3) == head_dim, "q is ", q.sizes(), " so the caches must be [", layout,
              ", n_kv_heads, ", head_dim, "], got ", k_cache.sizes());
  TORCH_CHECK(n_kv > 0 && n_heads % n_kv == 0, "n_heads (", n_heads,
              ") must be a multiple of n_kv_heads (", n_kv, ")");
  TORCH_CHECK(head_dim % 8 == 0 && head_dim > 0 && head_dim <= 128,
              "head_dim must be a multiple of 8, at most 128, got ", head_dim);
  TORCH_CHECK(out.sizes() == q.sizes(), "out must be ", q.sizes(), ", got ", out.sizes());
  check_aligned(out, "out");
  check_aligned(k_cache, "k_cache");
  check_aligned(v_cache, "v_cache");
  TORCH_CHECK(std::isfinite(scale), "scale must be finite, got ", scale);
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

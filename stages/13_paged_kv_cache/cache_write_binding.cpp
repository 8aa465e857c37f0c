// GIVEN FILE: generated from solutions/13_paged_kv_cache/cache_write_binding.cpp by `nox -s sync-stages`.
// Read it; do not edit it. It is not graded (the grader uses the reference
// copy), and any edit here is overwritten.
// torch.ops.tinyvllm.cache_write and rope_cache_write: checks (shapes, dtypes, strides,
// devices only), then cache_write.cu. They read no device memory on the host (the slot mapping
// and positions stay where they are), so a decode step that calls them can be captured in a
// CUDA graph.
#include "binding.h"

tvllm_status launch_cache_write(const void* k, const void* v, void* k_cache, void* v_cache,
                                const int64_t* slot_mapping, int64_t tokens, int64_t k_stride,
                                int64_t v_stride, int64_t row_elems, int64_t num_rows,
                                cudaStream_t stream);
tvllm_status launch_rope_cache_write(void* q, void* k, const void* v, void* k_cache,
                                     void* v_cache, const int64_t* slot_mapping,
                                     const int64_t* positions, const float* cos_sin,
                                     int64_t tokens, int64_t q_stride, int64_t k_stride,
                                     int64_t v_stride, int q_heads, int kv_heads, int head_dim,
                                     int64_t num_rows, int64_t max_positions,
                                     cudaStream_t stream);

namespace {

// The checks both ops share. k, v: [T, n_kv, d] bf16; k_cache, v_cache: [num_blocks,
// block_size, n_kv, d] bf16; slot_mapping: [T] int64 (flat cache rows; -1 = skip).
void check_write(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                 const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  // k and v may be views of a fused QKV tensor: heads contiguous inside a row, rows further apart
  tvllm::check_head_rows(k, "k");
  tvllm::check_head_rows(v, "v");
  tvllm::check_tensor(k_cache, "k_cache", at::kBFloat16, 4);
  tvllm::check_tensor(v_cache, "v_cache", at::kBFloat16, 4);
  tvllm::check_tensor(slot_mapping, "slot_mapping", at::kLong, 1);
  for (const at::Tensor& t : {v, k_cache, v_cache, slot_mapping}) tvllm::check_same_device(k, t);
  TORCH_CHECK(k.sizes() == v.sizes(), "k and v must have one shape, got ", k.sizes(), " and ",
              v.sizes());
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache must have one shape, got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  TORCH_CHECK(k_cache.size(2) == k.size(1) && k_cache.size(3) == k.size(2), "k is ", k.sizes(),
              " so the caches must be [num_blocks, block_size, ", k.size(1), ", ", k.size(2),
              "], got ", k_cache.sizes());
  TORCH_CHECK(k.size(2) % 8 == 0 && k.size(2) > 0, "head_dim must be a multiple of 8, got ",
              k.size(2));
  TORCH_CHECK(slot_mapping.size(0) == k.size(0), "slot_mapping must be [", k.size(0),
              "] (one slot per token of k), got ", slot_mapping.sizes());
  tvllm::check_aligned(k_cache, "k_cache");
  tvllm::check_aligned(v_cache, "v_cache");
}

// A row's stride, or the row's length when there is one row (any stride is fine then).
int64_t row_stride(const at::Tensor& t) {
  return t.size(0) > 1 ? t.stride(0) : t.size(1) * t.size(2);
}

void cache_write(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                 at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  check_write(k, v, k_cache, v_cache, slot_mapping);
  const int64_t row_elems = k.size(1) * k.size(2);

  c10::cuda::CUDAGuard guard(k.device());
  tvllm::check_launch(
      launch_cache_write(k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                         slot_mapping.data_ptr<int64_t>(), k.size(0), row_stride(k),
                         row_stride(v), row_elems, k_cache.size(0) * k_cache.size(1), tvllm::stream()),
      "cache_write");
}

// q: [T, n_heads, d] bf16 (rotated in place, like k); positions: [T] int64; cos_sin:
// [max_positions, d] float32; the rest as for cache_write.
void rope_cache_write(at::Tensor& q, at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                      const at::Tensor& cos_sin, at::Tensor& k_cache, at::Tensor& v_cache,
                      const at::Tensor& slot_mapping) {
  check_write(k, v, k_cache, v_cache, slot_mapping);
  tvllm::check_head_rows(q, "q");
  tvllm::check_tensor(positions, "positions", at::kLong, 1);
  tvllm::check_tensor(cos_sin, "cos_sin", at::kFloat, 2);
  for (const at::Tensor& t : {q, positions, cos_sin}) tvllm::check_same_device(k, t);
  const int64_t d = k.size(2);
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(2) == d, "q must be [", k.size(0), ", n_heads, ",
              d, "] (k is ", k.sizes(), "), got ", q.sizes());
  TORCH_CHECK(positions.size(0) == k.size(0), "positions must be [", k.size(0),
              "] (one per token), got ", positions.sizes());
  TORCH_CHECK(cos_sin.size(1) == d, "cos_sin must be [max_positions, ", d, "], got ",
              cos_sin.sizes());
  // head_dim (a multiple of 16, at most 256) is the launcher's to refuse: check_launch raises

  c10::cuda::CUDAGuard guard(k.device());
  tvllm::check_launch(
      launch_rope_cache_write(q.data_ptr(), k.data_ptr(), v.data_ptr(), k_cache.data_ptr(),
                              v_cache.data_ptr(), slot_mapping.data_ptr<int64_t>(),
                              positions.data_ptr<int64_t>(), cos_sin.data_ptr<float>(), k.size(0),
                              row_stride(q), row_stride(k), row_stride(v),
                              static_cast<int>(q.size(1)), static_cast<int>(k.size(1)),
                              static_cast<int>(d), k_cache.size(0) * k_cache.size(1),
                              cos_sin.size(0), tvllm::stream()),
      "rope_cache_write");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tinyvllm, m) {
  m.def("cache_write(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping) -> ()",
        &cache_write);
  m.def("rope_cache_write(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor positions, Tensor cos_sin, "
        "Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor slot_mapping) -> ()",
        &rope_cache_write);
}

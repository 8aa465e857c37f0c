// GIVEN FILE: generated from solutions/09_kv_cache/decode_attention_binding.cpp by `nox -s sync-stages`.
// Read it; do not edit it. It is not graded (the grader uses the reference
// copy), and any edit here is overwritten.
// torch.ops.tinyvllm.decode_attention: checks (shapes, dtypes, devices only), then
// decode_attention.cu. It reads no device memory on the host (no seq_slots or context_lens
// values), so a decode step that calls it can be captured in a CUDA graph.
#include "binding.h"

tvllm_status launch_decode_attention(const void* q, const void* k_cache, const void* v_cache,
                                     void* out, const int32_t* seq_slots,
                                     const int32_t* context_lens, int batch, int64_t q_stride,
                                     int n_heads, int n_kv_heads, int head_dim, int num_slots,
                                     int max_len, float scale, cudaStream_t stream);

namespace {

// q: [B, n_heads, d], k_cache, v_cache: [num_slots, max_len, n_kv, d], seq_slots and
// context_lens: [B] int32 -> out: [B, n_heads, d]
void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& seq_slots, const at::Tensor& context_lens, double scale,
                      at::Tensor& out) {
  // q may be a view of a fused QKV tensor: heads contiguous inside a row, rows further apart.
  tvllm::check_decode_attention(q, k_cache, v_cache, out, scale, "num_slots, max_len");
  tvllm::check_tensor(seq_slots, "seq_slots", at::kInt, 1);
  tvllm::check_tensor(context_lens, "context_lens", at::kInt, 1);
  tvllm::check_same_device(q, seq_slots);
  tvllm::check_same_device(q, context_lens);
  const int64_t batch = q.size(0), n_heads = q.size(1), head_dim = q.size(2);
  const int64_t n_kv = k_cache.size(2);
  TORCH_CHECK(seq_slots.size(0) == batch && context_lens.size(0) == batch,
              "seq_slots and context_lens must be [", batch, "] (one per sequence of q), got ",
              seq_slots.sizes(), " and ", context_lens.sizes());
  TORCH_CHECK(batch < (int64_t{1} << 31) && k_cache.size(0) < (int64_t{1} << 31) &&
                  k_cache.size(1) < (int64_t{1} << 31),
              "at most 2^31 - 1 sequences, cache slots and positions");

  c10::cuda::CUDAGuard guard(q.device());
  tvllm::check_launch(
      launch_decode_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                              seq_slots.data_ptr<int32_t>(), context_lens.data_ptr<int32_t>(),
                              static_cast<int>(batch), q.stride(0), static_cast<int>(n_heads),
                              static_cast<int>(n_kv), static_cast<int>(head_dim),
                              static_cast<int>(k_cache.size(0)), static_cast<int>(k_cache.size(1)),
                              static_cast<float>(scale), tvllm::stream()),
      "decode_attention");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tinyvllm, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor seq_slots, "
        "Tensor context_lens, float scale, Tensor(a!) out) -> ()",
        &decode_attention);
}

// torch.ops.tinyvllm.prefill_attention: checks (cu_seqlens on the host), then attention.cu.
#include <cmath>

#include "binding.h"

tvllm_status launch_prefill_attention(const void* q, const void* k, const void* v, void* out,
                                      const int32_t* cu_seqlens, int n_seqs, int max_seqlen,
                                      int64_t q_stride, int64_t k_stride, int64_t v_stride,
                                      int n_heads, int n_kv_heads, int head_dim, float scale,
                                      cudaStream_t stream);

namespace {

// [tokens, heads, head_dim] bf16 whose heads are contiguous inside a token's row; the rows
// may be further apart (a slice of a fused QKV tensor), 16-byte aligned for vector loads.
void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got one on ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 3, name, " must be [tokens, heads, head_dim], got shape ", t.sizes());
  TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == t.size(2), name,
              ": each token's heads must be contiguous (strides [*, head_dim, 1]), got strides ",
              t.strides());
  TORCH_CHECK(t.stride(0) % 8 == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name,
              ": rows must be 16-byte aligned (token stride a multiple of 8, got ", t.stride(0), ")");
}

// q: [T, n_heads, d], k, v: [T, n_kv, d], cu_seqlens: [B + 1] int32 -> out: [T, n_heads, d]
void prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& cu_seqlens, double scale, at::Tensor& out) {
  check_rows(q, "q");
  check_rows(k, "k");
  check_rows(v, "v");
  tvllm::check_tensor(out, "out", at::kBFloat16, 3);
  tvllm::check_tensor(cu_seqlens, "cu_seqlens", at::kInt, 1);
  for (const at::Tensor& t : {k, v, out, cu_seqlens}) tvllm::check_same_device(q, t);
  TORCH_CHECK(k.sizes() == v.sizes(), "k and v must have one shape, got ", k.sizes(), " and ",
              v.sizes());
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(2) == q.size(2), "q is ", q.sizes(),
              " so k and v must be [", q.size(0), ", n_kv_heads, ", q.size(2), "], got ", k.sizes());
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "n_heads (", q.size(1),
              ") must be a multiple of n_kv_heads (", k.size(1), ")");
  TORCH_CHECK(out.sizes() == q.sizes(), "out must be ", q.sizes(), ", got ", out.sizes());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0, "out must be 16-byte aligned");
  TORCH_CHECK(std::isfinite(scale), "scale must be finite, got ", scale);
  const int64_t tokens = q.size(0);
  TORCH_CHECK(tokens < (int64_t{1} << 31), "at most 2^31 - 1 tokens");

  // Prefill reads cu_seqlens on the host once: a bad offset would read other memory.
  TORCH_CHECK(cu_seqlens.numel() >= 1, "cu_seqlens must hold at least [0]");
  const at::Tensor host = cu_seqlens.cpu();
  const int32_t* cu = host.data_ptr<int32_t>();
  const int64_t n_seqs = cu_seqlens.numel() - 1;
  TORCH_CHECK(cu[0] == 0, "cu_seqlens must start at 0, got ", cu[0]);
  int max_seqlen = 0;
  for (int64_t b = 0; b < n_seqs; ++b) {
    TORCH_CHECK(cu[b + 1] >= cu[b], "cu_seqlens must not decrease, got cu_seqlens[", b, "] = ",
                cu[b], " > cu_seqlens[", b + 1, "] = ", cu[b + 1]);
    max_seqlen = std::max(max_seqlen, cu[b + 1] - cu[b]);
  }
  TORCH_CHECK(cu[n_seqs] == tokens, "cu_seqlens must end at the token count ", tokens, ", got ",
              cu[n_seqs]);

  c10::cuda::CUDAGuard guard(q.device());
  tvllm::check_launch(
      launch_prefill_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                               cu_seqlens.data_ptr<int32_t>(), static_cast<int>(n_seqs),
                               max_seqlen, q.stride(0), k.stride(0), v.stride(0),
                               static_cast<int>(q.size(1)), static_cast<int>(k.size(1)),
                               static_cast<int>(q.size(2)), static_cast<float>(scale),
                               tvllm::stream()),
      "prefill_attention");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tinyvllm, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, float scale, "
        "Tensor(a!) out) -> ()",
        &prefill_attention);
}

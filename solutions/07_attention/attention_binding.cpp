// torch.ops.tinyvllm.prefill_attention: checks, then attention.cu (no host reads: graph-safe).
#include "binding.h"

tvllm_status launch_prefill_attention(const void* q, const void* k, const void* v, void* out,
                                      const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k,
                                      int n_seqs, int max_seqlen,
                                      int64_t q_stride, int64_t k_stride, int64_t v_stride,
                                      int n_heads, int n_kv_heads, int head_dim, float scale,
                                      int64_t smem_limit, cudaStream_t stream);

namespace {

// q: [Tq, n_heads, d], k, v: [Tk, n_kv, d], cu_seqlens_q, cu_seqlens_k: [B + 1] int32
// -> out: [Tq, n_heads, d]. The offsets stay on the device: reading them here would make the
// CPU wait for the GPU once per layer (and could not be captured in a CUDA graph), so the
// caller validates them once on the host and passes the longest query run as max_seqlen_q.
// smem_limit: bytes of shared memory per block the kernel may use (it picks its tile by it), or
// -1 for what this GPU allows; a smaller limit runs a T4's tile on any GPU.
void prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                       int64_t max_seqlen_q, double scale, at::Tensor& out, int64_t smem_limit) {
  tvllm::check_prefill_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, scale, out);
  TORCH_CHECK(smem_limit >= -1, "smem_limit must be bytes (>= 0) or -1 for the GPU's limit, got ",
              smem_limit);

  c10::cuda::CUDAGuard guard(q.device());
  tvllm::check_launch(
      launch_prefill_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                               cu_seqlens_q.data_ptr<int32_t>(), cu_seqlens_k.data_ptr<int32_t>(),
                               static_cast<int>(cu_seqlens_q.numel() - 1),
                               static_cast<int>(max_seqlen_q), q.stride(0), k.stride(0), v.stride(0),
                               static_cast<int>(q.size(1)), static_cast<int>(k.size(1)),
                               static_cast<int>(q.size(2)), static_cast<float>(scale),
                               smem_limit, tvllm::stream()),
      "prefill_attention");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tinyvllm, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, "
        "Tensor cu_seqlens_k, int max_seqlen_q, float scale, Tensor(a!) out, "
        "int smem_limit=-1) -> ()",
        &prefill_attention);
}

// GIVEN FILE: generated from solutions/05_rope/rope_binding.cpp by `nox -s sync-stages`.
// Read it; do not edit it. It is not graded (the grader uses the reference
// copy), and any edit here is overwritten.
// torch.ops.tinyvllm.apply_rope: checks, then the launcher in rope.cu.
#include "binding.h"

tvllm_status launch_rope(void* q, void* k, const int64_t* positions, const float* cos_sin,
                         int* error, int64_t tokens, int64_t q_stride, int64_t k_stride,
                         int q_heads, int k_heads, int head_dim, int64_t max_positions, bool bf16,
                         cudaStream_t stream);

namespace {

// [tokens, heads, head_dim] with heads and elements contiguous; the token stride is free, so
// q and k can be views into a fused QKV output ([tokens, (nh + 2 nkv) * d] viewed per head).
void check_heads(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got one on ", t.device());
  TORCH_CHECK(t.dim() == 3, name, " must be [tokens, heads, head_dim], got shape ", t.sizes());
  TORCH_CHECK(t.size(1) <= 1 || t.stride(1) == t.size(2), name,
              ": its heads must be contiguous within a token (stride(1) == head_dim), got "
              "strides ", t.strides());
  TORCH_CHECK(t.size(2) <= 1 || t.stride(2) == 1, name,
              ": head elements must be contiguous (stride(2) == 1), got strides ", t.strides());
  TORCH_CHECK(t.size(0) <= 1 || t.stride(0) >= t.size(1) * t.size(2), name,
              ": token rows overlap (stride(0) < heads * head_dim), strides ", t.strides());
}

// q: [tokens, q_heads, d], k: [tokens, k_heads, d], bf16 or float32, rotated in place;
// positions: [tokens] int64; cos_sin: [max_positions, d] float32; error: [1] int32.
void apply_rope(at::Tensor& q, at::Tensor& k, const at::Tensor& positions,
                const at::Tensor& cos_sin, at::Tensor& error) {
  check_heads(q, "q");
  check_heads(k, "k");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat,
              "q must be bfloat16 or float32, got ", q.scalar_type());
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), "k is ", k.scalar_type(), " but q is ",
              q.scalar_type());
  tvllm::check_tensor(positions, "positions", at::kLong, 1);
  tvllm::check_tensor(cos_sin, "cos_sin", at::kFloat, 2);
  tvllm::check_tensor(error, "error", at::kInt, 1);
  tvllm::check_same_device(q, k);
  tvllm::check_same_device(q, positions);
  tvllm::check_same_device(q, cos_sin);
  tvllm::check_same_device(q, error);
  TORCH_CHECK(k.size(0) == q.size(0) && positions.size(0) == q.size(0),
              "q, k and positions must have one row per token: q ", q.sizes(), ", k ", k.sizes(),
              ", positions ", positions.sizes());
  TORCH_CHECK(k.size(2) == q.size(2), "q and k head_dim differ: ", q.size(2), " vs ", k.size(2));
  TORCH_CHECK(cos_sin.size(1) == q.size(2), "cos_sin rows have ", cos_sin.size(1),
              " columns but head_dim is ", q.size(2), " (cos_sin is [max_positions, head_dim])");
  TORCH_CHECK(error.numel() == 1, "error must hold one int32, got shape ", error.sizes());
  c10::cuda::CUDAGuard guard(q.device());
  tvllm::check_launch(
      launch_rope(q.data_ptr(), k.data_ptr(), positions.data_ptr<int64_t>(),
                  cos_sin.data_ptr<float>(), error.data_ptr<int>(), q.size(0), q.stride(0),
                  k.stride(0), static_cast<int>(q.size(1)), static_cast<int>(k.size(1)),
                  static_cast<int>(q.size(2)), cos_sin.size(0), q.scalar_type() == at::kBFloat16,
                  tvllm::stream()),
      "apply_rope");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tinyvllm, m) {
  m.def("apply_rope(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos_sin, "
        "Tensor(c!) error) -> ()",
        &apply_rope);
}

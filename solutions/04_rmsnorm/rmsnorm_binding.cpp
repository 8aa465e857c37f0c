// torch.ops.tinyvllm.rmsnorm / fused_add_rmsnorm: checks, then the launchers in rmsnorm.cu.
#include "binding.h"

tvllm_status launch_rmsnorm(void* out, const void* x, const void* weight, int64_t rows,
                            int64_t hidden, float eps, bool bf16, cudaStream_t stream);
tvllm_status launch_fused_add_rmsnorm(void* x, void* residual, const void* weight, int64_t rows,
                                      int64_t hidden, float eps, bool bf16, cudaStream_t stream);

namespace {

// x: [rows, hidden] bf16 or float32; weight: [hidden], x's dtype.
void check_x_weight(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "x must be bfloat16 or float32, got ", x.scalar_type());
  tvllm::check_tensor(x, "x", x.scalar_type(), 2);
  tvllm::check_tensor(weight, "weight", x.scalar_type(), 1);
  tvllm::check_same_device(x, weight);
  TORCH_CHECK(weight.size(0) == x.size(1), "weight has ", weight.size(0),
              " elements but rows of x have ", x.size(1));
}

// out: [rows, hidden], x's dtype.
void rmsnorm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  check_x_weight(x, weight);
  tvllm::check_tensor(out, "out", x.scalar_type(), 2);
  tvllm::check_same_device(x, out);
  TORCH_CHECK(out.sizes() == x.sizes(), "out shape ", out.sizes(), " != x shape ", x.sizes());
  c10::cuda::CUDAGuard guard(x.device());
  tvllm::check_launch(launch_rmsnorm(out.data_ptr(), x.data_ptr(), weight.data_ptr(), x.size(0),
                                     x.size(1), static_cast<float>(eps),
                                     x.scalar_type() == at::kBFloat16, tvllm::stream()),
                      "rmsnorm");
}

// In place: residual <- x + residual (rounded to the dtype), x <- rmsnorm(residual).
void fused_add_rmsnorm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                       double eps) {
  check_x_weight(x, weight);
  tvllm::check_tensor(residual, "residual", x.scalar_type(), 2);
  tvllm::check_same_device(x, residual);
  TORCH_CHECK(residual.sizes() == x.sizes(), "residual shape ", residual.sizes(),
              " != x shape ", x.sizes());
  const auto* xs = static_cast<const char*>(x.data_ptr());
  const auto* rs = static_cast<const char*>(residual.data_ptr());
  const int64_t bytes = x.numel() * x.element_size();
  TORCH_CHECK(bytes == 0 || xs + bytes <= rs || rs + bytes <= xs,
              "x and residual must be different buffers (they overlap)");
  c10::cuda::CUDAGuard guard(x.device());
  tvllm::check_launch(launch_fused_add_rmsnorm(x.data_ptr(), residual.data_ptr(),
                                               weight.data_ptr(), x.size(0), x.size(1),
                                               static_cast<float>(eps),
                                               x.scalar_type() == at::kBFloat16, tvllm::stream()),
                      "fused_add_rmsnorm");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tinyvllm, m) {
  m.def("rmsnorm(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()", &rmsnorm);
  m.def("fused_add_rmsnorm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()",
        &fused_add_rmsnorm);
}

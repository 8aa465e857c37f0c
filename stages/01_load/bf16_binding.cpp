// GIVEN FILE: generated from solutions/01_load/bf16_binding.cpp by `nox -s sync-stages`.
// Read it; do not edit it. It is not graded (the grader uses the reference
// copy), and any edit here is overwritten.
// torch.ops.tinyvllm.fp32_to_bf16 / bf16_to_fp32: checks, then the launchers in bf16.cu.
#include "binding.h"

tvllm_status launch_fp32_to_bf16(const float* in, uint16_t* out, int64_t n, cudaStream_t stream);
tvllm_status launch_bf16_to_fp32(const uint16_t* in, float* out, int64_t n, cudaStream_t stream);

namespace {

// x: [...] float32 -> out: same shape, bfloat16
void fp32_to_bf16(const at::Tensor& x, at::Tensor& out) {
  tvllm::check_tensor(x, "x", at::kFloat);
  tvllm::check_tensor(out, "out", at::kBFloat16);
  tvllm::check_same_device(x, out);
  TORCH_CHECK(x.sizes() == out.sizes(), "out shape ", out.sizes(), " != x shape ", x.sizes());
  c10::cuda::CUDAGuard guard(x.device());
  tvllm::check_launch(launch_fp32_to_bf16(x.data_ptr<float>(),
                                          reinterpret_cast<uint16_t*>(out.data_ptr()), x.numel(),
                                          tvllm::stream()),
                      "fp32_to_bf16");
}

// x: [...] bfloat16 -> out: same shape, float32
void bf16_to_fp32(const at::Tensor& x, at::Tensor& out) {
  tvllm::check_tensor(x, "x", at::kBFloat16);
  tvllm::check_tensor(out, "out", at::kFloat);
  tvllm::check_same_device(x, out);
  TORCH_CHECK(x.sizes() == out.sizes(), "out shape ", out.sizes(), " != x shape ", x.sizes());
  c10::cuda::CUDAGuard guard(x.device());
  tvllm::check_launch(launch_bf16_to_fp32(reinterpret_cast<const uint16_t*>(x.data_ptr()),
                                          out.data_ptr<float>(), x.numel(), tvllm::stream()),
                      "bf16_to_fp32");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tinyvllm, m) {
  m.def("fp32_to_bf16(Tensor x, Tensor(a!) out) -> ()", &fp32_to_bf16);
  m.def("bf16_to_fp32(Tensor x, Tensor(a!) out) -> ()", &bf16_to_fp32);
}

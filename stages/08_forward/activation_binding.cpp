// GIVEN FILE: generated from solutions/08_forward/activation_binding.cpp by `nox -s sync-stages`.
// Read it; do not edit it. It is not graded (the grader uses the reference
// copy), and any edit here is overwritten.
// torch.ops.tinyvllm.silu_mul: checks, then the launcher in activation.cu.
#include <cuda_bf16.h>

#include "binding.h"

tvllm_status launch_silu_mul(const __nv_bfloat16* x, __nv_bfloat16* out, int64_t rows,
                             int64_t inter, cudaStream_t stream);

namespace {

// x: [tokens, 2 * inter] bf16 (gate columns, then up columns) -> out: [tokens, inter] bf16
void silu_mul(const at::Tensor& x, at::Tensor& out) {
  tvllm::check_tensor(x, "x", at::kBFloat16, 2);
  tvllm::check_tensor(out, "out", at::kBFloat16, 2);
  tvllm::check_same_device(x, out);
  TORCH_CHECK(x.size(1) % 2 == 0, "x must be [tokens, 2 * intermediate] (gate, then up), got ",
              "an odd number of columns: ", x.sizes());
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == x.size(1) / 2, "out shape ",
              out.sizes(), " != [tokens, intermediate] = [", x.size(0), ", ", x.size(1) / 2, "]");
  c10::cuda::CUDAGuard guard(x.device());
  tvllm::check_launch(
      launch_silu_mul(reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()),
                      reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), x.size(0), x.size(1) / 2,
                      tvllm::stream()),
      "silu_mul");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tinyvllm, m) {
  m.def("silu_mul(Tensor x, Tensor(a!) out) -> ()", &silu_mul);
}

// torch.ops.tinyvllm.pinned_copy: checks, then the launcher in pinned_copy.cu.
#include "binding.h"

tvllm_status launch_pinned_copy(void* dst, const void* src, int64_t words, cudaStream_t stream);

namespace {

// dst[:] = src[:] for one CUDA and one pinned CPU tensor (or two CUDA tensors) of the same
// dtype and size, contiguous, whose bytes are a whole number of 8-byte words.
void pinned_copy(at::Tensor& dst, const at::Tensor& src) {
  TORCH_CHECK(dst.scalar_type() == src.scalar_type(), "dst is ", dst.scalar_type(),
              " and src ", src.scalar_type(), ": they must match");
  TORCH_CHECK(dst.numel() == src.numel(), "dst has ", dst.numel(), " elements and src ",
              src.numel(), ": they must match");
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous(), "dst and src must be contiguous");
  TORCH_CHECK(dst.is_cuda() || src.is_cuda(), "one of dst and src must be a CUDA tensor");
  if (dst.is_cuda() && src.is_cuda()) tvllm::check_same_device(dst, src);
  const int64_t bytes = dst.numel() * dst.element_size();
  TORCH_CHECK(bytes % 8 == 0, "the copy must be a whole number of 8-byte words, got ", bytes,
              " bytes");
  const at::Device device = dst.is_cuda() ? dst.device() : src.device();
  c10::cuda::CUDAGuard guard(device);
  tvllm::check_launch(launch_pinned_copy(tvllm::device_address(dst, "dst"),
                                         tvllm::device_address(src, "src"),
                                         bytes / 8, tvllm::stream()),
                      "pinned_copy");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tinyvllm, m) {
  m.def("pinned_copy(Tensor(a!) dst, Tensor src) -> ()", &pinned_copy);
}

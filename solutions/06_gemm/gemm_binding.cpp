// torch.ops.tinyvllm.linear: checks, then the launcher in gemm.cu on torch's cuBLAS handle.
// torch.ops.tinyvllm.gemv: checks, then a decode step's GEMV: gemv_simple.cu's or gemv.cu's.
// torch.ops.tinyvllm.linear_silu_mul: checks, then gemv.cu's GEMV with the SiLU-mul epilogue.
// torch.ops.tinyvllm.rmsnorm_linear: checks, then gemv.cu's one-token GEMV with stage 04's
// (fused add and) RMSNorm as its prologue; rmsnorm_linear_fits says where it runs.
#include <optional>

#include <ATen/cuda/CUDAContext.h>

#include "binding.h"

tvllm_status launch_linear(cublasHandle_t handle, cudaStream_t stream, cudaDataType_t dtype,
                           cudaDataType_t y_dtype, const void* x, const void* weight, void* y,
                           int64_t tokens, int64_t in_features, int64_t out_features);
tvllm_status launch_gemv(const void* x, const void* weight, void* y, bool y_f32, int64_t tokens,
                         int64_t in_features, int64_t out_features, cudaStream_t stream);
tvllm_status launch_gemv_simple(const void* x, const void* weight, void* y, bool y_f32,
                                int64_t tokens, int64_t in_features, int64_t out_features,
                                cudaStream_t stream);
tvllm_status launch_gemv_silu_mul(const void* x, const void* weight, void* y, int64_t tokens,
                                  int64_t in_features, int64_t inter, cudaStream_t stream);
bool gemv_norm_fits(int64_t in_features, int64_t out_features);
tvllm_status launch_gemv_norm(const void* x, const void* add, void* sum, const void* norm,
                              float eps, const void* weight, void* y, bool y_f32,
                              int64_t in_features, int64_t out_features, int64_t inter,
                              int64_t* pick, int32_t* counters, HostRows host,
                              cudaStream_t stream);

namespace {

cudaDataType_t cuda_dtype(at::ScalarType t) {
  if (t == at::kBFloat16) return CUDA_R_16BF;
  if (t == at::kHalf) return CUDA_R_16F;
  TORCH_CHECK(t == at::kFloat, "linear: x must be bfloat16, float16 or float32, got ", t);
  return CUDA_R_32F;
}

// Checks x: [tokens, in], weight: [out, in] of x's dtype and out: [tokens, out] of x's dtype
// or float32 (for logits: no rounding of the float32 accumulator); returns out's CUDA type.
at::ScalarType check_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out,
                            const char* op) {
  tvllm::check_tensor(x, "x", x.scalar_type(), 2);
  tvllm::check_tensor(weight, "weight", x.scalar_type(), 2);
  const at::ScalarType out_type = out.scalar_type() == at::kFloat ? at::kFloat : x.scalar_type();
  tvllm::check_tensor(out, "out", out_type, 2);
  tvllm::check_same_device(x, weight);
  tvllm::check_same_device(x, out);
  TORCH_CHECK(weight.size(1) == x.size(1), op, ": x has ", x.size(1),
              " features but weight is [out, in] = ", weight.sizes(), " (in must match)");
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == weight.size(0), op, ": out must be [",
              x.size(0), ", ", weight.size(0), "], got ", out.sizes());
  return out_type;
}

// x: [tokens, in], weight: [out, in] -> out: [tokens, out], through cuBLAS.
void linear(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out) {
  const cudaDataType_t dtype = cuda_dtype(x.scalar_type());
  const at::ScalarType out_type = check_linear(x, weight, out, "linear");
  c10::cuda::CUDAGuard guard(x.device());
  // torch binds its handle to the current stream (and its workspace) when handing it out.
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();
  tvllm::check_launch(launch_linear(handle, tvllm::stream(), dtype, cuda_dtype(out_type), x.data_ptr(),
                                    weight.data_ptr(), out.data_ptr(), x.size(0), x.size(1),
                                    weight.size(0)),
                      "linear");
}

// The same product for 1-8 bf16 tokens (in % 8 == 0, 16-byte aligned: else the launcher says
// so): simple = true gemv_simple.cu's kernel (part 1), false gemv.cu's (part 2).
void gemv(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, bool simple) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "gemv: x must be bfloat16, got ", x.scalar_type());
  const bool y_f32 = check_linear(x, weight, out, "gemv") == at::kFloat;
  c10::cuda::CUDAGuard guard(x.device());
  const auto launch = simple ? launch_gemv_simple : launch_gemv;
  tvllm::check_launch(launch(x.data_ptr(), weight.data_ptr(), out.data_ptr(), y_f32, x.size(0),
                             x.size(1), weight.size(0), tvllm::stream()),
                      "gemv");
}

// x: [tokens, in] bf16, weight: [2 inter, in] bf16 (gate rows, then up rows) -> out:
// [tokens, inter] bf16 = silu(x gate^T) * (x up^T), through the GEMV (1-8 tokens).
void linear_silu_mul(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out) {
  tvllm::check_tensor(x, "x", at::kBFloat16, 2);
  tvllm::check_tensor(weight, "weight", at::kBFloat16, 2);
  tvllm::check_tensor(out, "out", at::kBFloat16, 2);
  tvllm::check_same_device(x, weight);
  tvllm::check_same_device(x, out);
  TORCH_CHECK(weight.size(1) == x.size(1), "linear_silu_mul: x has ", x.size(1),
              " features but weight is [2 inter, in] = ", weight.sizes(), " (in must match)");
  TORCH_CHECK(weight.size(0) % 2 == 0, "linear_silu_mul: weight must stack gate and up rows "
              "([2 inter, in]), got an odd number of rows: ", weight.sizes());
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == weight.size(0) / 2,
              "linear_silu_mul: out must be [", x.size(0), ", ", weight.size(0) / 2, "], got ",
              out.sizes());
  // 1-8 tokens, in % 8 == 0, alignment: gemv_fits, in the launcher (check_launch raises)
  c10::cuda::CUDAGuard guard(x.device());
  tvllm::check_launch(launch_gemv_silu_mul(x.data_ptr(), weight.data_ptr(), out.data_ptr(),
                                           x.size(0), x.size(1), weight.size(0) / 2,
                                           tvllm::stream()),
                      "linear_silu_mul");
}

// x: [1, in] bf16; add: [1, in] bf16 or None; sum: [1, in] bf16 or None, its own buffer (gets
// x + add); norm: [in] bf16; weight: [out, in] bf16, [2 inter, in] when inter > 0 (gate rows,
// then up rows) -> out: [1, out], or [1, inter] = silu_mul of the pair. pick (optional, with
// float32 out of a plain projection: the logits): [1] int64 <- the index of out's largest
// value, the greedy token (also into host[host_slot[0], 0] when host is given: binding.h's
// host_rows). See gemv.cu.
void rmsnorm_linear(const at::Tensor& x, const std::optional<at::Tensor>& add,
                    const std::optional<at::Tensor>& sum, const at::Tensor& norm, double eps,
                    const at::Tensor& weight, at::Tensor& out, int64_t inter,
                    const std::optional<at::Tensor>& pick, const std::optional<at::Tensor>& host,
                    const std::optional<at::Tensor>& host_slot) {
  tvllm::check_tensor(x, "x", at::kBFloat16, 2);
  tvllm::check_tensor(norm, "norm", at::kBFloat16, 1);
  tvllm::check_tensor(weight, "weight", at::kBFloat16, 2);
  // out: bf16, or float32 for logits (the lm_head after the final norm); paired: bf16
  const bool out_f32 = out.scalar_type() == at::kFloat && inter == 0;
  tvllm::check_tensor(out, "out", out_f32 ? at::kFloat : at::kBFloat16, 2);
  tvllm::check_same_device(x, norm);
  tvllm::check_same_device(x, weight);
  tvllm::check_same_device(x, out);
  TORCH_CHECK(x.size(0) == 1, "rmsnorm_linear: one token, got x of shape ", x.sizes());
  TORCH_CHECK(norm.size(0) == x.size(1) && weight.size(1) == x.size(1),
              "rmsnorm_linear: x has ", x.size(1), " features; norm must be [", x.size(1),
              "] and weight [out, ", x.size(1), "], got ", norm.sizes(), " and ", weight.sizes());
  TORCH_CHECK(inter >= 0 && (inter == 0 || weight.size(0) == 2 * inter),
              "rmsnorm_linear: a paired weight must be [2 * inter, in], got ", weight.sizes());
  const int64_t outs = inter > 0 ? inter : weight.size(0);
  TORCH_CHECK(out.size(0) == 1 && out.size(1) == outs, "rmsnorm_linear: out must be [1, ", outs,
              "], got ", out.sizes());
  for (const auto* t : {&add, &sum}) {
    if (!t->has_value()) continue;
    tvllm::check_tensor(**t, t == &add ? "add" : "sum", at::kBFloat16, 2);
    tvllm::check_same_device(x, **t);
    TORCH_CHECK((*t)->sizes() == x.sizes(), "rmsnorm_linear: add and sum must be x's shape ",
                x.sizes(), ", got ", (*t)->sizes());
  }
  TORCH_CHECK(pick || !host, "rmsnorm_linear: host stores the pick; pass pick too");
  int32_t* counters = nullptr;
  if (pick) {
    TORCH_CHECK(out_f32, "rmsnorm_linear: the greedy pick takes float32 logits (out float32, "
                "inter 0), got out ", out.scalar_type(), " and inter ", inter);
    tvllm::check_tensor(*pick, "pick", at::kLong, 1);
    tvllm::check_same_device(x, *pick);
    TORCH_CHECK(pick->size(0) == 1, "rmsnorm_linear: pick must be [1], got ", pick->sizes());
  }
  const HostRows host_rows = tvllm::host_rows(host, host_slot, x, 1);
  c10::cuda::CUDAGuard guard(x.device());
  if (pick) counters = tvllm::tickets(x, 4);  // the pick's ticket, then its 64-bit key
  tvllm::check_launch(
      launch_gemv_norm(x.data_ptr(), add ? add->data_ptr() : nullptr,
                       sum ? sum->data_ptr() : nullptr, norm.data_ptr(), static_cast<float>(eps),
                       weight.data_ptr(), out.data_ptr(), out_f32, x.size(1), weight.size(0),
                       inter, pick ? pick->data_ptr<int64_t>() : nullptr, counters, host_rows,
                       tvllm::stream()),
      "rmsnorm_linear");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tinyvllm, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor(a!) out) -> ()", &linear);
  m.def("gemv(Tensor x, Tensor weight, Tensor(a!) out, bool simple) -> ()", &gemv);
  m.def("linear_silu_mul(Tensor x, Tensor weight, Tensor(a!) out) -> ()", &linear_silu_mul);
  m.def("rmsnorm_linear(Tensor x, Tensor? add, Tensor(a!)? sum, Tensor norm, float eps, "
        "Tensor weight, Tensor(b!) out, int inter, Tensor(c!)? pick=None, "
        "Tensor(d!)? host=None, Tensor? host_slot=None) -> ()", &rmsnorm_linear);
  m.def("rmsnorm_linear_fits(int in_features, int out_features) -> bool", &gemv_norm_fits);
}

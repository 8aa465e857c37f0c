// torch.ops.tinyvllm.argmax: checks, then the launchers in argmax.cu.
// A row cut into pieces takes its pieces' pairs from a workspace and the row's ticket counter
// from tvllm::tickets (binding.h), so the op can be captured in a CUDA graph.
#include <climits>
#include <optional>

#include <ATen/ops/empty.h>
#include <cuda_bf16.h>

#include "binding.h"

int argmax_most_pieces(int64_t rows);
tvllm_status launch_argmax_bf16(const __nv_bfloat16* logits, int64_t* out, int64_t rows,
                                int64_t vocab, void* partial, int32_t* tickets, HostRows host,
                                cudaStream_t stream);
tvllm_status launch_argmax_f32(const float* logits, int64_t* out, int64_t rows, int64_t vocab,
                               void* partial, int32_t* tickets, HostRows host,
                               cudaStream_t stream);

namespace {

// logits: [rows, vocab] bf16 or float32 -> out: [rows] int64, the index of each row's maximum;
// host (optional): [slots, >= rows] int64 pinned CPU memory, and host_slot [1] int64 on the
// device: the answers also go to host[host_slot[0], :rows] (nowhere when host_slot[0] is
// outside [0, slots): the kernel reads it when it runs, and cannot raise)
void argmax(const at::Tensor& logits, at::Tensor& out, const std::optional<at::Tensor>& host,
            const std::optional<at::Tensor>& host_slot) {
  const auto dtype = logits.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat,
              "logits must be bfloat16 or float32, got ", dtype);
  tvllm::check_tensor(logits, "logits", dtype, 2);
  tvllm::check_tensor(out, "out", at::kLong, 1);
  tvllm::check_same_device(logits, out);
  TORCH_CHECK(out.size(0) == logits.size(0), "out shape ", out.sizes(), " != [rows] = [",
              logits.size(0), "]");
  TORCH_CHECK(logits.size(0) <= INT_MAX, "at most ", INT_MAX, " rows (one block each), got ",
              logits.size(0));
  TORCH_CHECK(logits.size(0) == 0 || (logits.size(1) > 0 && logits.size(1) < INT_MAX / 2),
              "the vocabulary must have between 1 and ", INT_MAX / 2, " entries, got ",
              logits.size(1));
  const HostRows host_rows = tvllm::host_rows(host, host_slot, logits, logits.size(0));
  c10::cuda::CUDAGuard guard(logits.device());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const int64_t pieces = rows == 0 ? 1 : argmax_most_pieces(rows);
  at::Tensor partial;  // 8 bytes (value, index) a block
  void* pairs = nullptr;
  int32_t* tickets = nullptr;
  if (pieces > 1) {
    partial = at::empty({rows * pieces * 2}, logits.options().dtype(at::kInt));
    pairs = partial.data_ptr();
    tickets = tvllm::tickets(logits, rows);
  }
  const auto status =
      dtype == at::kBFloat16
          ? launch_argmax_bf16(reinterpret_cast<const __nv_bfloat16*>(logits.data_ptr()),
                               out.data_ptr<int64_t>(), rows, vocab, pairs, tickets,
                               host_rows, tvllm::stream())
          : launch_argmax_f32(logits.data_ptr<float>(), out.data_ptr<int64_t>(), rows, vocab,
                              pairs, tickets, host_rows, tvllm::stream());
  tvllm::check_launch(status, "argmax");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tinyvllm, m) {
  m.def("argmax(Tensor logits, Tensor(a!) out, Tensor(b!)? host=None, "
        "Tensor? host_slot=None) -> ()", &argmax);
}

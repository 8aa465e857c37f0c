// GIVEN FILE: generated from solutions/03_embedding/embedding_binding.cpp by `nox -s sync-stages`.
// Read it; do not edit it. It is not graded (the grader uses the reference
// copy), and any edit here is overwritten.
// torch.ops.tinyvllm.embedding: checks, then the launcher in embedding.cu.
#include "binding.h"

tvllm_status launch_embedding(const int64_t* ids, const void* table, void* out, int* error,
                              int64_t tokens, int64_t vocab, int64_t row_bytes,
                              cudaStream_t stream);

namespace {

// ids: [tokens] int64; table: [vocab, hidden] bf16 or float32; out: [tokens, hidden], table's
// dtype; error: [1] int32, set to 1 by the kernel when an id is outside [0, vocab).
void embedding(const at::Tensor& ids, const at::Tensor& table, at::Tensor& out,
               at::Tensor& error) {
  tvllm::check_tensor(ids, "ids", at::kLong, 1);
  TORCH_CHECK(table.scalar_type() == at::kBFloat16 || table.scalar_type() == at::kFloat,
              "table must be bfloat16 or float32, got ", table.scalar_type());
  tvllm::check_tensor(table, "table", table.scalar_type(), 2);
  tvllm::check_tensor(out, "out", table.scalar_type(), 2);
  tvllm::check_tensor(error, "error", at::kInt, 1);
  tvllm::check_same_device(ids, table);
  tvllm::check_same_device(ids, out);
  tvllm::check_same_device(ids, error);
  TORCH_CHECK(out.size(0) == ids.size(0) && out.size(1) == table.size(1), "out shape ",
              out.sizes(), " != [tokens, hidden] = [", ids.size(0), ", ", table.size(1), "]");
  TORCH_CHECK(error.numel() == 1, "error must hold one int32, got shape ", error.sizes());
  c10::cuda::CUDAGuard guard(ids.device());
  tvllm::check_launch(launch_embedding(ids.data_ptr<int64_t>(), table.data_ptr(), out.data_ptr(),
                                       error.data_ptr<int>(), ids.size(0), table.size(0),
                                       table.size(1) * table.element_size(), tvllm::stream()),
                      "embedding");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tinyvllm, m) {
  m.def("embedding(Tensor ids, Tensor table, Tensor(a!) out, Tensor(b!) error) -> ()", &embedding);
}

// GIVEN FILE: generated from solutions/14_paged_kernel/paged_attention_binding.cpp by `nox -s sync-stages`.
// Read it; do not edit it. It is not graded (the grader uses the reference
// copy), and any edit here is overwritten.
// torch.ops.tinyvllm.paged_decode_attention_simple: checks (shapes, dtypes, devices only),
// then paged_attention_simple.cu (part 1).
// torch.ops.tinyvllm.paged_decode_attention: the same checks, the split-K choice (host values
// only), its workspace and tickets, then paged_attention.cu (part 2). Neither reads device
// memory on the host (no block table or length values), so a decode step that calls one can
// be captured in a CUDA graph; the workspace then comes from the graph's private memory pool,
// the tickets from a buffer kept for the process (tvllm::tickets, binding.h).
// torch.ops.tinyvllm.paged_attention_partition_keys: that split-K choice alone (tests, benches).
#include <limits>

#include <ATen/ops/empty.h>

#include "binding.h"

tvllm_status launch_paged_decode_attention_simple(const void* q, const void* k_cache,
                                                  const void* v_cache, void* out,
                                                  const int32_t* block_tables,
                                                  const int32_t* context_lens, int batch,
                                                  int64_t q_stride, int n_heads, int n_kv_heads,
                                                  int head_dim, int num_blocks, int block_size,
                                                  int max_blocks, int max_keys, float scale,
                                                  cudaStream_t stream);
int paged_attention_partition_keys(int batch, int n_heads, int n_kv_heads, int64_t max_keys,
                                   int split);
tvllm_status launch_paged_decode_attention(const void* q, void* k_cache, void* v_cache,
                                           void* out, const int32_t* block_tables,
                                           const int32_t* context_lens, float* workspace,
                                           int32_t* tickets, const void* k_new, const void* v_new,
                                           int64_t new_stride, const int64_t* positions,
                                           const float* cos_sin, int64_t max_positions,
                                           int batch, int64_t q_stride, int n_heads,
                                           int n_kv_heads, int head_dim, int num_blocks,
                                           int block_size, int max_blocks, int max_keys,
                                           int partitions, int partition_keys,
                                           bool exact_partitions, float scale,
                                           cudaStream_t stream);

namespace {

// The checks both kernels' ops share: q: [B, n_heads, d]; k_cache, v_cache: [num_blocks,
// block_size, n_kv, d], block_size a power of two; block_tables: [B, max_blocks] int32;
// context_lens: [B] int32; out like q. Returns the longest context a row may have: the block
// table's capacity, or max_context (-1: that capacity) when smaller.
int64_t check_paged(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                    int64_t max_context, const at::Tensor& out) {
  tvllm::check_decode_attention(q, k_cache, v_cache, out, scale, "num_blocks, block_size");
  tvllm::check_tensor(block_tables, "block_tables", at::kInt, 2);
  tvllm::check_tensor(context_lens, "context_lens", at::kInt, 1);
  tvllm::check_same_device(q, block_tables);
  tvllm::check_same_device(q, context_lens);
  const int64_t batch = q.size(0), block_size = k_cache.size(1);
  TORCH_CHECK(block_size > 0 && (block_size & (block_size - 1)) == 0,
              "block_size (k_cache.size(1)) must be a power of two, got ", block_size);
  TORCH_CHECK(block_tables.size(0) == batch && context_lens.size(0) == batch,
              "block_tables must be [", batch, ", max_blocks] and context_lens [", batch,
              "] (one row per sequence of q), got ", block_tables.sizes(), " and ",
              context_lens.sizes());
  TORCH_CHECK(max_context >= -1, "max_context must be -1 (from the block table) or >= 0, got ",
              max_context);
  const int64_t capacity = block_tables.size(1) * block_size;
  const int64_t max_keys = max_context < 0 ? capacity : std::min(capacity, max_context);
  TORCH_CHECK(batch < (int64_t{1} << 31) && k_cache.size(0) < (int64_t{1} << 31) &&
                  block_tables.size(1) < (int64_t{1} << 31) && max_keys <= (int64_t{1} << 30),
              "at most 2^31 - 1 sequences and blocks, and contexts of at most 2^30 keys");
  return max_keys;
}

// Part 1: one block per (sequence, query head), no split-K (paged_attention_simple.cu).
void paged_decode_attention_simple(const at::Tensor& q, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& block_tables,
                                   const at::Tensor& context_lens, double scale,
                                   int64_t max_context, at::Tensor& out) {
  const int64_t max_keys =
      check_paged(q, k_cache, v_cache, block_tables, context_lens, scale, max_context, out);
  c10::cuda::CUDAGuard guard(q.device());
  tvllm::check_launch(
      launch_paged_decode_attention_simple(
          q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
          block_tables.data_ptr<int32_t>(), context_lens.data_ptr<int32_t>(),
          static_cast<int>(q.size(0)), q.stride(0), static_cast<int>(q.size(1)),
          static_cast<int>(k_cache.size(2)), static_cast<int>(q.size(2)),
          static_cast<int>(k_cache.size(0)), static_cast<int>(k_cache.size(1)),
          static_cast<int>(block_tables.size(1)), static_cast<int>(max_keys),
          static_cast<float>(scale), tvllm::stream()),
      "paged_decode_attention_simple");
}

// paged_attention_partition_keys' answer, or NotImplementedError for the skeleton's -1 (its
// rule not written yet: a TODO, never a partition size).
int64_t rule_written(int64_t keys) {
  TORCH_CHECK_NOT_IMPLEMENTED(keys >= 0, "TODO stage 14: paged_attention_partition_keys, the "
                              "split-K rule (paged_attention.cu), is not written yet");
  return keys;
}

// q: [B, n_heads, d]; k_cache, v_cache: [num_blocks, block_size, n_kv, d]; block_tables:
// [B, max_blocks] int32; context_lens: [B] int32 -> out: [B, n_heads, d].
// max_context: the longest context any sequence may have (-1: max_blocks * block_size); with
// the batch and the heads it fixes the split-K partitions. split: -1 let the kernel decide, 0
// never, 1 always. partition: 0 = the kernel's partition size; > 0 (a multiple of 16): split-K
// in partitions of that many keys (tests, measurements). k_new, v_new: [B, n_kv, d] bf16
// (views of the QKV rows), positions: [B] int64, cos_sin: [max_positions, d] float32, all or
// none: the new token is not in the cache yet and q not rotated; the kernel rotates q, and
// writes each sequence's new key (rotated) and value at its key context_lens[b] - 1.
void paged_decode_attention(const at::Tensor& q, at::Tensor& k_cache, at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens,
                            double scale, int64_t max_context, int64_t split, at::Tensor& out,
                            int64_t partition,
                            const std::optional<at::Tensor>& k_new,
                            const std::optional<at::Tensor>& v_new,
                            const std::optional<at::Tensor>& positions,
                            const std::optional<at::Tensor>& cos_sin) {
  const int64_t max_keys =
      check_paged(q, k_cache, v_cache, block_tables, context_lens, scale, max_context, out);
  const int64_t batch = q.size(0), n_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), n_kv = k_cache.size(2);
  TORCH_CHECK(split >= -1 && split <= 1, "split must be -1 (decide), 0 (never) or 1 (always), got ",
              split);
  TORCH_CHECK(partition >= 0 && partition % 16 == 0 && partition <= (int64_t{1} << 20),
              "partition must be 0 (the kernel's choice) or a multiple of 16 keys up to 2^20, got ",
              partition);
  TORCH_CHECK(partition == 0 || split != 0, "partition (", partition, " keys) forces split-K: "
              "it cannot go with split = 0 (never)");
  const bool rotates = k_new.has_value();
  TORCH_CHECK(rotates == v_new.has_value() && rotates == positions.has_value() &&
                  rotates == cos_sin.has_value(),
              "the new token's k_new, v_new, positions and cos_sin come together, or none");
  if (rotates) {
    for (const at::Tensor* t : {&*k_new, &*v_new}) {
      tvllm::check_head_rows(*t, "k_new and v_new");
      tvllm::check_same_device(q, *t);
      TORCH_CHECK(t->size(0) == batch && t->size(1) == n_kv && t->size(2) == head_dim,
                  "k_new and v_new must be [", batch, ", ", n_kv, ", ", head_dim, "], got ",
                  t->sizes());
    }
    TORCH_CHECK(k_new->stride(0) == v_new->stride(0), "k_new and v_new must have one row "
                "stride (views of one QKV row), got ", k_new->stride(0), " and ", v_new->stride(0));
    tvllm::check_tensor(*positions, "positions", at::kLong, 1);
    tvllm::check_tensor(*cos_sin, "cos_sin", at::kFloat, 2);
    tvllm::check_aligned(*cos_sin, "cos_sin");  // rows read 16 bytes at a time
    tvllm::check_same_device(q, *positions);
    tvllm::check_same_device(q, *cos_sin);
    TORCH_CHECK(positions->size(0) == batch && cos_sin->size(1) == head_dim,
                "positions must be [", batch, "] and cos_sin [max_positions, ", head_dim,
                "], got ", positions->sizes(), " and ", cos_sin->sizes());
  }
  c10::cuda::CUDAGuard guard(q.device());
  // keys per partition (0: the single pass); a partition count of 1 is the single pass too
  const int64_t keys = partition > 0 ? partition : paged_attention_partition_keys(
      static_cast<int>(batch), static_cast<int>(n_heads), static_cast<int>(n_kv), max_keys,
      static_cast<int>(split));
  rule_written(keys);
  const int64_t partitions = keys > 0 && max_keys > keys ? (max_keys + keys - 1) / keys : 1;
  TORCH_CHECK(partitions >= 1 && partitions <= 8192 && batch * partitions < (int64_t{1} << 31),
              "split-K: at most 8192 partitions (of 1024 keys: max_context up to 8M), got ",
              partitions, " partitions of ", keys, " keys");
  at::Tensor workspace;  // partial o (float) then (m, l) per (sequence, head, partition)
  int32_t* tickets = nullptr;
  if (partitions > 1) {
    workspace = at::empty({batch * n_heads * partitions * (head_dim + 2)},
                          q.options().dtype(at::kFloat));
    tickets = tvllm::tickets(q, batch * n_heads);  // at least one per block row
  }
  tvllm::check_launch(
      launch_paged_decode_attention(
          q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
          block_tables.data_ptr<int32_t>(), context_lens.data_ptr<int32_t>(),
          partitions > 1 ? workspace.data_ptr<float>() : nullptr, tickets,
          rotates ? k_new->data_ptr() : nullptr, rotates ? v_new->data_ptr() : nullptr,
          rotates ? k_new->stride(0) : 0, rotates ? positions->data_ptr<int64_t>() : nullptr,
          rotates ? cos_sin->data_ptr<float>() : nullptr, rotates ? cos_sin->size(0) : 0,
          static_cast<int>(batch),
          q.stride(0), static_cast<int>(n_heads), static_cast<int>(n_kv),
          static_cast<int>(head_dim), static_cast<int>(num_blocks), static_cast<int>(block_size),
          static_cast<int>(block_tables.size(1)), static_cast<int>(max_keys),
          static_cast<int>(partitions), static_cast<int>(keys), partition > 0,
          static_cast<float>(scale),
          tvllm::stream()),
      "paged_decode_attention");
}

// The split-K choice of a call with these sizes on the current device: keys per partition, 0
// for the single pass. max_keys: max_context (or the block table's capacity).
int64_t partition_keys(int64_t batch, int64_t n_heads, int64_t n_kv_heads, int64_t max_keys,
                       int64_t split) {
  TORCH_CHECK(batch >= 0 && batch < (int64_t{1} << 31) && n_kv_heads > 0 &&
                  n_heads % n_kv_heads == 0 && n_heads < (int64_t{1} << 31) && max_keys >= 0 &&
                  max_keys <= (int64_t{1} << 30) && split >= -1 && split <= 1,
              "paged_attention_partition_keys: batch, n_heads (a multiple of n_kv_heads > 0), "
              "max_keys (at most 2^30) and split (-1, 0, 1), got ", batch, ", ", n_heads, ", ",
              n_kv_heads, ", ", max_keys, ", ", split);
  return rule_written(paged_attention_partition_keys(
      static_cast<int>(batch), static_cast<int>(n_heads), static_cast<int>(n_kv_heads), max_keys,
      static_cast<int>(split)));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tinyvllm, m) {
  m.def("paged_decode_attention_simple(Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor context_lens, float scale, int max_context, "
        "Tensor(a!) out) -> ()",
        &paged_decode_attention_simple);
  m.def("paged_decode_attention(Tensor q, Tensor(b!) k_cache, Tensor(c!) v_cache, "
        "Tensor block_tables, Tensor context_lens, float scale, int max_context, int split, "
        "Tensor(a!) out, int partition=0, Tensor? k_new=None, Tensor? v_new=None, "
        "Tensor? positions=None, Tensor? cos_sin=None) -> ()",
        &paged_decode_attention);
  m.def("paged_attention_partition_keys(int batch, int n_heads, int n_kv_heads, int max_keys, "
        "int split=-1) -> int",
        &partition_keys);
}

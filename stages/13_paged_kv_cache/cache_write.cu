// Stage 13 kernel: write the new tokens' K and V into the paged cache (vLLM's reshape_and_cache).
//
//     k_cache.view(num_blocks * block_size, n_kv, d)[slot_mapping[t]] = k[t]     (and v alike)
//
// Every step writes the K and V of its new tokens before attention reads the cache. Each
// token's row goes to the flat cache row its sequence's block table gives it (built on the
// host: slot = block_table[p / block_size] * block_size + p % block_size), and a slot of -1
// means "write nowhere" (the padding rows of a CUDA-graph batch). A pure copy, memory-bound:
// one block per token, every thread moving 16 bytes (8 bf16) of K and 16 bytes of V per
// instruction, neighbouring threads on neighbouring addresses.
//
// k and v may be views of the fused qkv projection: inside a row the heads are contiguous
// (n_kv * d elements), rows are k_stride / v_stride elements apart (a multiple of 8, so every
// row starts 16-byte aligned). The kernel never reads a value back to the host (the slot
// mapping stays on the device), so a decode step that calls it can be captured in a CUDA
// graph. A slot at or past the end of the cache is skipped like -1 (a kernel cannot raise:
// validate slots on the host, where the step is planned).
//
// rope_cache_write: the same store with stage 05's rotation folded in. A decode step ran rope
// (q and k rotated in place) and then this copy: two kernels of a few microseconds on a few
// kilobytes, each waiting for the one before. Here one block per token rotates its q and k
// heads in place (the attention reads q; a prefill reads the new k), stores the rotated k and
// the v row at the token's slot: one kernel, q and k read once. Its step inputs -- the slot,
// the position and that position's cos/sin row (a constant table) -- are read before the PDL
// wait, so their latencies hide behind the QKV GEMV. A position outside the table makes that
// token's q and k NaN (nothing raises: check positions on the host, as the engine does).
// Reference: cache_write.py (cache_write_native, rope_cache_write_native). Run: nox -s grade -- 13
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdint>

#include "pdl.cuh"
#include "rope.cuh"
#include "tvllm.h"
#include "vec.cuh"

namespace {

// Block t copies the packs of token t's K and V rows to cache row slot_mapping[t].
// packs: 16-byte units per row (n_kv * d / 8); strides in 16-byte units too.
__global__ void cache_write_kernel(const uint4* __restrict__ k, const uint4* __restrict__ v,
                                   uint4* __restrict__ k_cache, uint4* __restrict__ v_cache,
                                   const int64_t* __restrict__ slot_mapping, int64_t k_stride,
                                   int64_t v_stride, int64_t packs, int64_t num_rows) {
  // Launched early in a decode step: the slot, a step input no kernel writes, before the wait
  // (its latency hides behind rope); k and v only after rope has finished (pdl.cuh).
  allow_next_kernel_to_start();
  const int64_t t = blockIdx.x;
  // TODO stage 13: read this token's slot; leave when it is negative or >= num_rows (padding: nothing to write) (about 2 lines)
  const int64_t slot = -1;
  wait_for_previous_kernel();
  // TODO stage 13: copy the row's packs of k and v to the slot's row, with a block-stride loop (about 10 lines)
}

using BF8 = Pack<__nv_bfloat16, 8>;
constexpr int kMaxHeadDim = 256;  // the cos/sin row a block keeps in shared memory

struct RopeWrite {
  __nv_bfloat16* q;                  // [tokens, q_heads, d], rows q_stride apart
  __nv_bfloat16* k;                  // [tokens, kv_heads, d], rows k_stride apart
  const uint4* v;                    // [tokens, kv_heads * d / 8] packs, rows v_stride apart
  uint4* k_cache;                    // [num_rows, kv_heads * d / 8] packs
  uint4* v_cache;
  const int64_t* slot_mapping;       // [tokens]
  const int64_t* positions;          // [tokens]
  const float* cos_sin;              // [max_positions, d]: cos | sin
  int64_t q_stride, k_stride, v_stride;  // elements for q, k; 16-byte packs for v
  int64_t num_rows, max_positions;
  int q_heads, kv_heads, head_dim;
};

// Block t: rotate token t's q and k heads in place, then k's rotated row and v's row to
// cache row slot_mapping[t] (none for -1). A thread takes 8 pairs of one head at a time.
__global__ void rope_cache_write_kernel(RopeWrite p) {
  __shared__ float s_cos_sin[kMaxHeadDim];
  allow_next_kernel_to_start();
  const int64_t t = blockIdx.x;
  const int d = p.head_dim, half = d / 2, chunks = half / 8;
  // TODO stage 13: before the wait: the slot, the position (bad: outside the table), its cos/sin row into s_cos_sin (zeros when bad) (about 4 lines)
  const int64_t slot = -1; const bool bad = true;
  wait_for_previous_kernel();  // q, k and v are the QKV GEMV's output
  __syncthreads();             // s_cos_sin is complete
  const bool store = slot >= 0 && slot < p.num_rows;
  const int64_t row_packs = static_cast<int64_t>(p.kv_heads) * d / 8;
  // TODO stage 13: per (head, chunk) of q's then k's heads: rotate the chunk's lo and hi packs (NaN when bad), write them back; k's also to the cache row when store; then v's packs to the cache row when store (about 26 lines)
}

}  // namespace

// k, v: [tokens, n_kv, head_dim] bf16, rows k_stride / v_stride elements apart (multiples of
// 8), heads contiguous; k_cache, v_cache: [num_rows, n_kv, head_dim] bf16, contiguous
// (num_rows = num_blocks * block_size); slot_mapping: [tokens] int64 on the device.
tvllm_status launch_cache_write(const void* k, const void* v, void* k_cache, void* v_cache,
                                const int64_t* slot_mapping, int64_t tokens, int64_t k_stride,
                                int64_t v_stride, int64_t row_elems, int64_t num_rows,
                                cudaStream_t stream) {
  if (tokens == 0) return TVLLM_OK;
  if (tokens > INT32_MAX) return "more than 2^31 - 1 tokens in one call";
  if (row_elems % 8 || k_stride % 8 || v_stride % 8)
    return "rows and row strides must be multiples of 8 elements (16 bytes)";
  // TODO stage 13: packs per row = row_elems / 8; threads: a multiple of 32 covering the packs, at most 128; one block per token (about 7 lines)
  return "TODO stage 13: packs per row = row_elems / 8; threads: a multiple of 32 covering the packs, at most 128; one block per token (about 7 lines)";
}

// q: [tokens, q_heads, head_dim], k, v: [tokens, kv_heads, head_dim] bf16, rows q_stride /
// k_stride / v_stride elements apart (multiples of 8), heads contiguous; positions: [tokens]
// int64; cos_sin: [max_positions, head_dim] float32; the caches and slot_mapping as for
// launch_cache_write. head_dim: a multiple of 16 (8 pairs a thread), at most 256.
tvllm_status launch_rope_cache_write(void* q, void* k, const void* v, void* k_cache,
                                     void* v_cache, const int64_t* slot_mapping,
                                     const int64_t* positions, const float* cos_sin,
                                     int64_t tokens, int64_t q_stride, int64_t k_stride,
                                     int64_t v_stride, int q_heads, int kv_heads, int head_dim,
                                     int64_t num_rows, int64_t max_positions,
                                     cudaStream_t stream) {
  if (tokens == 0) return TVLLM_OK;
  if (tokens > INT32_MAX) return "more than 2^31 - 1 tokens in one call";
  if (head_dim % 16 || head_dim > kMaxHeadDim)
    return "head_dim must be a multiple of 16, at most 256";
  if (q_stride % 8 || k_stride % 8 || v_stride % 8)
    return "row strides must be multiples of 8 elements (16 bytes)";
  const RopeWrite p{static_cast<__nv_bfloat16*>(q), static_cast<__nv_bfloat16*>(k),
                    static_cast<const uint4*>(v), static_cast<uint4*>(k_cache),
                    static_cast<uint4*>(v_cache), slot_mapping, positions, cos_sin,
                    q_stride, k_stride, v_stride / 8, num_rows, max_positions,
                    q_heads, kv_heads, head_dim};
  // TODO stage 13: threads: one per 8 pairs of a q or k head, a multiple of 32, at most 256; one block per token, launched early (launch_early) (about 5 lines)
  return "TODO stage 13: threads: one per 8 pairs of a q or k head, a multiple of 32, at most 256; one block per token, launched early (launch_early) (about 5 lines)";
}

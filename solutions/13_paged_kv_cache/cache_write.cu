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
// Reference: cache_write.py (cache_write_native). Run: nox -s grade -- 13
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdint>

#include "pdl.cuh"
#include "tvllm.h"

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
  // BEGIN SOLUTION: read this token's slot; leave when it is negative or >= num_rows (padding: nothing to write) | const int64_t slot = -1;
  const int64_t slot = slot_mapping[t];
  if (slot < 0 || slot >= num_rows) return;
  // END SOLUTION
  wait_for_previous_kernel();
  // BEGIN SOLUTION: copy the row's packs of k and v to the slot's row, with a block-stride loop
  const uint4* k_src = k + t * k_stride;
  const uint4* v_src = v + t * v_stride;
  uint4* k_dst = k_cache + slot * packs;
  uint4* v_dst = v_cache + slot * packs;
  for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
    const uint4 kx = k_src[i];
    const uint4 vx = v_src[i];
    k_dst[i] = kx;
    v_dst[i] = vx;
  }
  // END SOLUTION
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
  // BEGIN SOLUTION: packs per row = row_elems / 8; threads: a multiple of 32 covering the packs, at most 128; one block per token | return "{todo}";
  const int64_t packs = row_elems / 8;
  const int threads = static_cast<int>(std::min<int64_t>(128, tvllm_ceil_div(packs, 32) * 32));
  launch_early(cache_write_kernel, static_cast<unsigned>(tokens), threads, 0, stream,
               static_cast<const uint4*>(k), static_cast<const uint4*>(v),
               static_cast<uint4*>(k_cache), static_cast<uint4*>(v_cache), slot_mapping,
               k_stride / 8, v_stride / 8, packs, num_rows);
  return TVLLM_OK;
  // END SOLUTION
}

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
  // BEGIN SOLUTION: before the wait: the slot, the position (bad: outside the table), its cos/sin row into s_cos_sin (zeros when bad) | const int64_t slot = -1; const bool bad = true;
  const int64_t slot = p.slot_mapping[t], pos = p.positions[t];
  const bool bad = pos < 0 || pos >= p.max_positions;
  for (int i = threadIdx.x; i < d; i += blockDim.x)
    s_cos_sin[i] = bad ? 0.f : p.cos_sin[pos * d + i];
  // END SOLUTION
  wait_for_previous_kernel();  // q, k and v are the QKV GEMV's output
  __syncthreads();             // s_cos_sin is complete
  const bool store = slot >= 0 && slot < p.num_rows;
  const int64_t row_packs = static_cast<int64_t>(p.kv_heads) * d / 8;
  // BEGIN SOLUTION: per (head, chunk) of q's then k's heads: rotate the chunk's lo and hi packs (NaN when bad), write them back; k's also to the cache row when store; then v's packs to the cache row when store
  for (int c = threadIdx.x; c < (p.q_heads + p.kv_heads) * chunks; c += blockDim.x) {
    const int head = c / chunks, i = (c % chunks) * 8;
    const bool is_q = head < p.q_heads;
    const int kv = head - p.q_heads;
    __nv_bfloat16* x = is_q ? p.q + t * p.q_stride + static_cast<int64_t>(head) * d
                            : p.k + t * p.k_stride + static_cast<int64_t>(kv) * d;
    BF8 lo = *reinterpret_cast<const BF8*>(x + i), hi = *reinterpret_cast<const BF8*>(x + half + i);
    if (bad) {
#pragma unroll
      for (int j = 0; j < 8; ++j) lo.v[j] = hi.v[j] = __float2bfloat16(NAN);
    } else {
      rotate(lo, hi, s_cos_sin + i, s_cos_sin + half + i);
    }
    *reinterpret_cast<BF8*>(x + i) = lo;
    *reinterpret_cast<BF8*>(x + half + i) = hi;
    if (!is_q && store) {
      __nv_bfloat16* dst = reinterpret_cast<__nv_bfloat16*>(p.k_cache + slot * row_packs) +
                           static_cast<int64_t>(kv) * d;
      *reinterpret_cast<BF8*>(dst + i) = lo;
      *reinterpret_cast<BF8*>(dst + half + i) = hi;
    }
  }
  if (!store) return;
  const uint4* v_src = p.v + t * p.v_stride;
  uint4* v_dst = p.v_cache + slot * row_packs;
  for (int64_t i = threadIdx.x; i < row_packs; i += blockDim.x) v_dst[i] = v_src[i];
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
  // BEGIN SOLUTION: threads: one per 8 pairs of a q or k head, a multiple of 32, at most 256; one block per token, launched early (launch_early) | return "{todo}";
  // one thread per 8 pairs of a q or k head (160 at Llama-3.2-1B's 32 + 8 heads of 64)
  const int64_t items = static_cast<int64_t>(q_heads + kv_heads) * (head_dim / 16);
  const int threads = static_cast<int>(std::min<int64_t>(256, tvllm_ceil_div(items, 32) * 32));
  launch_early(rope_cache_write_kernel, static_cast<unsigned>(tokens), threads, 0, stream, p);
  return TVLLM_OK;
  // END SOLUTION
}

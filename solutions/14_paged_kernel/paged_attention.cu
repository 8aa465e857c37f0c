// Stage 14 kernel: decode attention over a PAGED KV cache, with split-K for long contexts.
//
//     out[b, h] = sum_j softmax_j(scale * q[b, h] . K_b[j]) V_b[j],   j < context_lens[b]
//     K_b[j] = k_cache[block_tables[b, j / block_size], j % block_size, g],  g = h / group
//
// Stage 09's kernel read one contiguous slot per sequence. Here a sequence's keys lie in
// blocks of block_size rows scattered over the pool, and its block table says which: key j is
// row j % block_size of physical block block_tables[b, j / block_size]. block_size is a power
// of two, so that is a shift and a mask.
//
// Same plan as stage 09: the kernel is memory-bound, so one thread block serves one (sequence,
// KV head) and computes every query head of its GQA group (K and V are read once, not once per
// query head); 8 lanes share a key at head_dim 64 (16 at 128), each with one 16-byte piece; an
// online softmax per lane group; lane groups merged with shuffles, warps through shared memory.
//
// What is new, for speed: a warp never waits for the memory of the keys it is about to use.
// Its loads go straight into shared memory with cp.async (16 bytes per lane, no registers held
// while in flight), kStages steps ahead: while a warp computes step i, steps i + 1 and i + 2
// are on their way. Each lane copies into and reads back only its own 16-byte slots, so no
// barrier is needed, only cp.async.wait_group. The block-table entries of a step are read one
// step before its copies are issued, so the copies never wait for the table either.
//
// Split-K (flash-decoding). One sequence gives only n_kv_heads blocks (8 for Llama-3.2-1B, on
// a GPU of 132 SMs). With `partitions` > 1 the grid gets one block per (sequence, KV head,
// partition of partition_keys keys); each writes its partial state (m, l, o / l) in float32
// and a second kernel merges a sequence's partitions. The partition size (512 keys down to 64
// when the grid would otherwise be small: paged_attention_partition_keys) and count come from
// batch, heads and max_context (the engine's max_model_len), not from the lengths on the
// device, so the grid is the same at every step and a CUDA graph can capture it: the blocks of
// partitions past a sequence's length exit at once, and the reduction reads only the
// partitions that hold keys.
//
// A context length of 0 is a padding row: zeros. A length past max_keys (the block table's
// capacity, or max_context) or a block number outside the pool is never read: that row is NaN
// (the kernel cannot raise, and the binding reads no device memory: CUDA-graph safe).
// Reference: paged_attention.py (paged_decode_attention_native). Run: nox -s grade -- 14
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cmath>
#include <cstdint>

#include "cp_async.cuh"
#include "pdl.cuh"
#include "tvllm.h"
#include "vec.cuh"

namespace {

constexpr int kMaxHeadDim = 128;
constexpr int kPartition = 512;      // keys per split-K partition, at most (large grids)
constexpr int kMinPartition = 64;    // ... at least: one step of 16 keys per warp (head_dim 64)
constexpr int kMaxPartitions = 8192; // the reduction keeps one weight per partition in smem
constexpr int kStages = 3;           // copies in flight per warp: kStages - 1 steps ahead
constexpr int kThreads = 128;        // 4 warps per block
constexpr int kReduceThreads = 256;
constexpr float kLog2e = 1.4426950408889634f;

using BF8 = Pack<__nv_bfloat16, 8>;  // 16 bytes: 8 dimensions of one head

struct Params {
  const __nv_bfloat16* q;        // [batch, n_heads, head_dim], rows q_stride apart
  const __nv_bfloat16* k;        // [num_blocks, block_size, n_kv_heads, head_dim], contiguous
  const __nv_bfloat16* v;        // same shape as k
  __nv_bfloat16* out;            // [batch, n_heads, head_dim], contiguous
  float* part_o;                 // split-K: [batch, n_heads, partitions, head_dim], o / l
  float* part_ml;                // split-K: [batch, n_heads, partitions, 2]: m (base 2), l
  const int32_t* block_tables;   // [batch, max_blocks]
  const int32_t* context_lens;   // [batch]: keys to attend (0 = padding row)
  int64_t q_stride;              // elements from one sequence's q row to the next
  int n_heads, n_kv_heads, head_dim;
  int group;                     // n_heads / n_kv_heads
  int head_chunks;               // blocks per KV head: ceil(group / kG)
  int num_blocks, block_size, block_shift, max_blocks;
  int max_keys;                  // longest context allowed: min(max_blocks * block_size, max_context)
  int partitions;                // 1: one pass, writes out; more: split-K partials
  int partition_keys;            // split-K: keys per partition (the last one may be shorter)
  float scale_log2;              // scale * log2(e)
};

// Groups of 5..8 query heads hold twice the registers per head: fewer keys per step, fewer
// blocks per SM.
__host__ __device__ constexpr int unroll(int kG) { return kG > 4 ? 2 : 4; }
__host__ __device__ constexpr int min_blocks(int kG) { return kG > 4 ? 2 : 4; }

// Lanes that share a key: its 16-byte pieces rounded up to a power of two (lanes past the
// head's end copy nothing).
__device__ __forceinline__ int lanes_per_key(int pieces) {
  int n = 1;
  while (n < pieces) n *= 2;
  return n;
}

// Query heads a block computes: the group for 1..4, 8 (padded) for 5..8, chunks of 8 above.
inline int heads_per_block(int group) { return group <= 4 ? group : 8; }

// cp.async (copy16, copies_commit, copies_wait): solutions/common/cp_async.cuh.

// 8 bf16 (16 bytes) -> 8 floats: a bf16 is the top half of a float32.
__device__ __forceinline__ void unpack8(const uint4& raw, float (&f)[8]) {
  const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    f[2 * e] = __uint_as_float(w[e] << 16);
    f[2 * e + 1] = __uint_as_float(w[e] & 0xffff0000u);
  }
}

// Sum over an aligned group of `width` lanes (a power of two); every lane gets the total.
__device__ __forceinline__ float lane_group_sum(float x, int width) {
  // BEGIN SOLUTION: a butterfly of xor shuffles, offsets width/2 .. 1 | return 0.f;
  for (int delta = width >> 1; delta >= 1; delta >>= 1) x += __shfl_xor_sync(0xffffffffu, x, delta);
  return x;
  // END SOLUTION
}

// The running softmax of one query head over the keys a lane group has seen (base 2):
// m = max score, l = sum 2^(s - m), o = sum 2^(s - m) v (this lane's 8 dimensions).
struct Running {
  float m, l, o[8];

  __device__ __forceinline__ void reset() {
    m = -INFINITY;
    l = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] = 0.f;
  }

  // Take in kU new scores s (base 2; -inf for keys past the context): grow m, rescale l and
  // o to it, and turn each score into its weight 2^(s - m), added to l. The caller then adds
  // weight * value to o (the values stay in shared memory until then).
  template <int kU>
  __device__ __forceinline__ void rescale(float (&s)[kU]) {
    // BEGIN SOLUTION: grow m; l and o times 2^(m_old - m_new); s[u] = 2^(s[u] - m_new) added to l (no NaN before the first key)
    float top = m;
#pragma unroll
    for (int u = 0; u < kU; ++u) top = fmaxf(top, s[u]);
    const float ref = top == -INFINITY ? 0.f : top;  // nothing seen yet: every weight is 0
    const float shrink = exp2f(m - ref);
    l *= shrink;
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] *= shrink;
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      s[u] = exp2f(s[u] - ref);
      l += s[u];
    }
    m = top;
    // END SOLUTION
  }

  // Fold in the state of other keys of the same head.
  __device__ __forceinline__ void merge(float m2, float l2, const float (&o2)[8]) {
    // BEGIN SOLUTION: both to the larger max, then add (a state with no key weighs 0)
    const float top = fmaxf(m, m2);
    const float ref = top == -INFINITY ? 0.f : top;
    const float wa = exp2f(m - ref), wb = exp2f(m2 - ref);
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] = fmaf(o[e], wa, o2[e] * wb);
    l = fmaf(l, wa, l2 * wb);
    m = top;
    // END SOLUTION
  }
};

// One block per (sequence [, partition], KV head [, chunk of its group]): blockIdx.x =
// b * partitions + partition, blockIdx.y = kv_head * head_chunks + chunk.
// kD: head_dim, or 0 to read it from p.head_dim (a multiple of 8 up to 128).
template <int kD, int kG>
__global__ void __launch_bounds__(kThreads, min_blocks(kG)) paged_attention_kernel(Params p) {
  allow_next_kernel_to_start();  // the o_proj GEMV that follows may start (pdl.cuh)
  wait_for_previous_kernel();    // launched early: the cache write must have finished
  constexpr int kU = unroll(kG);  // keys per lane per step
  constexpr int kWarps = kThreads / 32;
  const int d = kD ? kD : p.head_dim;
  const int chunks = d / 8;  // 16-byte pieces of one head's row
  const int lanes = kD ? kD / 8 : lanes_per_key(chunks);
  const int keys_per_step = 32 / lanes;  // keys one copy instruction of a warp covers
  const int step = kU * keys_per_step;   // keys per warp step (16 at head_dim 64)
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int key_in_step = lane / lanes, c = lane % lanes;
  const bool has_chunk = c < chunks;

  const int b = blockIdx.x / p.partitions, part = blockIdx.x % p.partitions;
  // BEGIN SOLUTION: the KV head, the first query head h0 and how many (n_here) this block computes | const int kv_head = 0, h0 = 0, n_here = 0;
  const int kv_head = blockIdx.y / p.head_chunks;
  const int first = (blockIdx.y % p.head_chunks) * kG;
  const int h0 = kv_head * p.group + first;
  const int n_here = min(kG, p.group - first);
  // END SOLUTION

  const int len = p.context_lens[b];
  const bool bad_len = len < 0 || len > p.max_keys;
  // BEGIN SOLUTION: this block's keys [k_begin, k_end): the whole context, or partition `part` of p.partition_keys keys, clipped to len | const int k_begin = 0, k_end = 0;
  const int k_begin = p.partitions > 1 ? part * p.partition_keys : 0;
  const int k_end = p.partitions > 1 ? min(len, k_begin + p.partition_keys) : len;
  // END SOLUTION

  if (p.partitions == 1 && (bad_len || len == 0)) {
    // A padding row gets zeros, a row that cannot be read NaN; the whole block leaves.
    __nv_bfloat16* row = p.out + (static_cast<int64_t>(b) * p.n_heads + h0) * d;
    const __nv_bfloat16 fill = __float2bfloat16(bad_len ? NAN : 0.f);
    for (int i = threadIdx.x; i < n_here * d; i += blockDim.x) row[i] = fill;
    return;
  }
  if (bad_len || k_begin >= k_end) return;  // split-K: the reduction writes this row

  // This lane's 8 dimensions of each query head, times scale * log2(e); zeros past the head.
  float q[kG][8];
  const __nv_bfloat16* q_row = p.q + b * p.q_stride + static_cast<int64_t>(h0) * d + c * 8;
#pragma unroll
  for (int i = 0; i < kG; ++i) {
    uint4 raw = make_uint4(0u, 0u, 0u, 0u);
    if (i < n_here && has_chunk) raw = *reinterpret_cast<const uint4*>(q_row + i * d);
    unpack8(raw, q[i]);
#pragma unroll
    for (int e = 0; e < 8; ++e) q[i][e] *= p.scale_log2;
  }
  Running st[kG];
#pragma unroll
  for (int i = 0; i < kG; ++i) st[i].reset();

  // Row r of physical block n, KV head kv_head, this lane's piece: (n * block_size + r) *
  // key_stride + head_off elements into k_cache (and v_cache).
  const int64_t key_stride = static_cast<int64_t>(p.n_kv_heads) * d;
  const int64_t head_off = static_cast<int64_t>(kv_head) * d + c * 8;
  const int32_t* table = p.block_tables + static_cast<int64_t>(b) * p.max_blocks;

  // Warp w takes steps w, w + kWarps, ... of the block's range; its i-th is step warp + i *
  // kWarps. my_steps is the same for all 32 lanes, so every lane reaches every shuffle.
  const int n_steps = (k_end - k_begin + step - 1) / step;
  const int my_steps = warp < n_steps ? (n_steps - warp + kWarps - 1) / kWarps : 0;
  auto key_of = [&](int i, int u) {
    return k_begin + (warp + i * kWarps) * step + u * keys_per_step + key_in_step;
  };

  // Each warp's ring of kStages slots; a slot holds, per key u of a step, 32 lanes' K pieces
  // then 32 lanes' V pieces (uint4 index (2u + 0/1) * 32 + lane): one lane, its own slots.
  extern __shared__ uint4 smem[];
  uint4* ring = smem + warp * (kStages * kU * 64);
  bool bad_block = false;  // a block number outside the pool: this row will be NaN

  // The physical block of each key this lane copies in its step i.
  auto lookup = [&](int i, int (&blk)[kU]) {
    // BEGIN SOLUTION: per u: key j = key_of(i, u); its table entry j >> block_shift, read only when i < my_steps and j < k_end (else 0)
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int j = key_of(i, u);
      blk[u] = i < my_steps && j < k_end ? __ldg(table + (j >> p.block_shift)) : 0;
    }
    // END SOLUTION
  };
  // Issue this lane's copies of its step i (K and V of kU keys) into slot i % kStages.
  auto fetch = [&](int i, const int (&blk)[kU]) {
    if (i >= my_steps) return;  // the same for the whole warp
    uint4* slot = ring + (i % kStages) * (kU * 64);
    // BEGIN SOLUTION: per u: the key's row inside its block (j & (block_size - 1)), the element offset, copy16 of K and V; keys past k_end and blocks outside the pool are not read (zeros) and the latter set bad_block
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int j = key_of(i, u);
      const bool wanted = j < k_end;
      const bool in_pool = static_cast<unsigned>(blk[u]) < static_cast<unsigned>(p.num_blocks);
      bad_block |= wanted && !in_pool;
      const bool ok = wanted && in_pool && has_chunk;
      const int64_t at = ok ? (static_cast<int64_t>(blk[u]) * p.block_size +
                               (j & (p.block_size - 1))) * key_stride + head_off
                            : 0;
      copy16(slot + (2 * u) * 32 + lane, p.k + at, ok);
      copy16(slot + (2 * u + 1) * 32 + lane, p.v + at, ok);
    }
    // END SOLUTION
  };

  // The pipeline: kStages - 1 steps in flight before the first is used; then per step: wait
  // for its copies, issue the step kStages - 1 ahead (into the slot used one step ago), read
  // the table for the step after that, and compute.
  int blk[kU];
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    lookup(i, blk);
    fetch(i, blk);
    copies_commit();
  }
  lookup(kStages - 1, blk);
  for (int i = 0; i < my_steps; ++i) {
    copies_wait<kStages - 2>();  // this lane's copies of step i have landed
    fetch(i + kStages - 1, blk);
    copies_commit();             // one group per step, empty or not: the count stays right
    lookup(i + kStages, blk);    // in flight during the compute; used by the next fetch
    const uint4* slot = ring + (i % kStages) * (kU * 64);
    // BEGIN SOLUTION: scores of the kU keys (K pieces from the slot, kG dot products summed over the lane group, -inf past k_end); st[h].rescale; then o += weight * V piece per key and head
    float s[kG][kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      float kf[8];
      unpack8(slot[(2 * u) * 32 + lane], kf);
      const bool live = key_of(i, u) < k_end;
#pragma unroll
      for (int h = 0; h < kG; ++h) {
        float part_dot = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) part_dot = fmaf(q[h][e], kf[e], part_dot);
        const float dot = lane_group_sum(part_dot, lanes);
        s[h][u] = live ? dot : -INFINITY;
      }
    }
#pragma unroll
    for (int h = 0; h < kG; ++h) st[h].rescale<kU>(s[h]);  // s becomes the weights
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      float vf[8];
      unpack8(slot[(2 * u + 1) * 32 + lane], vf);
#pragma unroll
      for (int h = 0; h < kG; ++h)
#pragma unroll
        for (int e = 0; e < 8; ++e) st[h].o[e] = fmaf(s[h][u], vf[e], st[h].o[e]);
    }
    // END SOLUTION
  }
  copies_wait<0>();

  // Lane groups of a warp saw different keys: merge them (partners hold the same piece c).
  // BEGIN SOLUTION: xor shuffles of m, l and o at offsets lanes, 2 * lanes, ..., 16; st[h].merge
  for (int delta = lanes; delta < 32; delta *= 2) {
#pragma unroll
    for (int h = 0; h < kG; ++h) {
      float o2[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) o2[e] = __shfl_xor_sync(0xffffffffu, st[h].o[e], delta);
      const float m2 = __shfl_xor_sync(0xffffffffu, st[h].m, delta);
      const float l2 = __shfl_xor_sync(0xffffffffu, st[h].l, delta);
      st[h].merge(m2, l2, o2);
    }
  }
  // END SOLUTION

  // Every warp is done with its ring (the barrier) before the rings become the warp-merge
  // area: o as [kWarps][kG][d] floats, then m and l as [kWarps][kG].
  bad_block = __syncthreads_or(bad_block);
  float* s_o = reinterpret_cast<float*>(smem);
  float* s_m = s_o + kWarps * kG * d;
  float* s_l = s_m + kWarps * kG;
  if (key_in_step == 0 && has_chunk) {
#pragma unroll
    for (int h = 0; h < kG; ++h) {
      float4* dst = reinterpret_cast<float4*>(s_o + (warp * kG + h) * d + c * 8);
      dst[0] = make_float4(st[h].o[0], st[h].o[1], st[h].o[2], st[h].o[3]);
      dst[1] = make_float4(st[h].o[4], st[h].o[5], st[h].o[6], st[h].o[7]);
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int h = 0; h < kG; ++h) {
      s_m[warp * kG + h] = st[h].m;
      s_l[warp * kG + h] = st[h].l;
    }
  }
  __syncthreads();

  // One thread per (head, 16-byte piece): merge the warps; then either the final row (one
  // pass) or this partition's partial state (split-K).
  for (int t = threadIdx.x; t < n_here * chunks; t += blockDim.x) {
    const int h = t / chunks, cc = t % chunks;
    Running acc;
    acc.reset();
    for (int w = 0; w < kWarps; ++w) {
      const float4* src = reinterpret_cast<const float4*>(s_o + (w * kG + h) * d + cc * 8);
      const float4 lo = src[0], hi = src[1];
      const float o2[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
      acc.merge(s_m[w * kG + h], s_l[w * kG + h], o2);
    }
    const float inv = acc.l > 0.f ? 1.f / acc.l : 0.f;
    const int64_t head_row = static_cast<int64_t>(b) * p.n_heads + h0 + h;
    if (p.partitions == 1) {
      BF8 result;
#pragma unroll
      for (int e = 0; e < 8; ++e)
        result.v[e] = __float2bfloat16_rn(bad_block ? NAN : acc.o[e] * inv);
      *reinterpret_cast<BF8*>(p.out + head_row * d + cc * 8) = result;
    } else {
      // BEGIN SOLUTION: write o / l (float, 8 values) to part_o[head_row, part, piece cc]; the first piece also writes m and l (l = NaN when bad_block) to part_ml
      const int64_t slot_row = head_row * p.partitions + part;
      float4* dst = reinterpret_cast<float4*>(p.part_o + slot_row * d + cc * 8);
      dst[0] = make_float4(acc.o[0] * inv, acc.o[1] * inv, acc.o[2] * inv, acc.o[3] * inv);
      dst[1] = make_float4(acc.o[4] * inv, acc.o[5] * inv, acc.o[6] * inv, acc.o[7] * inv);
      if (cc == 0) {
        p.part_ml[slot_row * 2] = acc.m;
        p.part_ml[slot_row * 2 + 1] = bad_block ? NAN : acc.l;
      }
      // END SOLUTION
    }
  }
}

struct ReduceParams {
  const float* part_o;          // [batch, n_heads, partitions, head_dim]
  const float* part_ml;         // [batch, n_heads, partitions, 2]
  __nv_bfloat16* out;           // [batch, n_heads, head_dim]
  const int32_t* context_lens;  // [batch]
  int n_heads, head_dim, partitions, partition_keys, max_keys;
};

// A block-wide max or sum (kMax): every thread gets the result. `red` holds 32 floats.
template <bool kMax>
__device__ float block_reduce(float x, float* red) {
  for (int delta = 16; delta >= 1; delta >>= 1) {
    const float y = __shfl_xor_sync(0xffffffffu, x, delta);
    x = kMax ? fmaxf(x, y) : x + y;
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  __syncthreads();  // red may still be read by a previous call
  if (lane == 0) red[warp] = x;
  __syncthreads();
  x = red[0];
  for (int w = 1; w < warps; ++w) x = kMax ? fmaxf(x, red[w]) : x + red[w];
  return x;
}

// Split-K, second kernel: one block per (sequence, query head) merges the partitions that
// hold keys (ceil(len / partition_keys) of them):
//     M = max_i m_i,  w_i = l_i * 2^(m_i - M),  out = sum_i w_i (o_i / l_i) / sum_i w_i
__global__ void __launch_bounds__(kReduceThreads) paged_attention_reduce_kernel(ReduceParams p) {
  allow_next_kernel_to_start();  // the o_proj GEMV that follows may start (pdl.cuh)
  wait_for_previous_kernel();    // launched early: the partitions must have been written
  const int b = blockIdx.x / p.n_heads;
  const int d = p.head_dim;
  __nv_bfloat16* out = p.out + static_cast<int64_t>(blockIdx.x) * d;
  const int len = p.context_lens[b];
  if (len <= 0 || len > p.max_keys) {  // padding row: zeros; unreadable: NaN
    for (int e = threadIdx.x; e < d; e += blockDim.x) out[e] = __float2bfloat16(len == 0 ? 0.f : NAN);
    return;
  }
  const int used = (len + p.partition_keys - 1) / p.partition_keys;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * p.partitions;
  const float* ml = p.part_ml + first * 2;
  const float* o = p.part_o + first * d;
  __shared__ float red[32];
  extern __shared__ float s_w[];  // [partitions] weights, then [rows][d] partial sums
  // BEGIN SOLUTION: M = block max of m_i over the used partitions; w_i = l_i * exp2(m_i - M) into s_w and their block sum `total` | const float total = 0.f;
  float top = -INFINITY;
  for (int i = threadIdx.x; i < used; i += blockDim.x) top = fmaxf(top, ml[2 * i]);
  top = block_reduce<true>(top, red);
  float total = 0.f;
  for (int i = threadIdx.x; i < used; i += blockDim.x) {
    const float w = ml[2 * i + 1] * exp2f(ml[2 * i] - top);
    s_w[i] = w;
    total += w;
  }
  total = block_reduce<false>(total, red);  // its barriers also publish s_w
  // END SOLUTION

  // Threads as [rows][d / 4]: each sums w_i * o_i over partitions r, r + rows, ... for 4
  // columns (16-byte loads); then one thread per column adds the rows up.
  const int cols = d / 4, rows = blockDim.x / cols;
  const int r = threadIdx.x / cols, c4 = threadIdx.x % cols;
  float* s_acc = s_w + p.partitions;
  if (r < rows) {
    // BEGIN SOLUTION: acc = sum of s_w[i] * o[i, 4 c4 .. 4 c4 + 3] over i = r, r + rows, ... < used; store it to s_acc[r, 4 c4 ..]
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int i = r; i < used; i += rows) {
      const float w = s_w[i];
      const float4 x = reinterpret_cast<const float4*>(o + static_cast<int64_t>(i) * d)[c4];
      acc = make_float4(fmaf(w, x.x, acc.x), fmaf(w, x.y, acc.y), fmaf(w, x.z, acc.z),
                        fmaf(w, x.w, acc.w));
    }
    float* dst = s_acc + r * d + c4 * 4;
    dst[0] = acc.x;
    dst[1] = acc.y;
    dst[2] = acc.z;
    dst[3] = acc.w;
    // END SOLUTION
  }
  __syncthreads();
  for (int e = threadIdx.x; e < d; e += blockDim.x) {
    float sum = 0.f;
    for (int rr = 0; rr < rows; ++rr) sum += s_acc[rr * d + e];
    out[e] = __float2bfloat16_rn(sum / total);
  }
}

template <int kD, int kG>
tvllm_status launch(const Params& p, int batch, cudaStream_t stream) {
  // BEGIN SOLUTION: grid (batch * partitions, n_kv_heads * head_chunks) of kThreads; dynamic smem = the larger of the rings and the warp-merge area; with partitions > 1 the reduce kernel, one block per (sequence, query head) | return "{todo}";
  const size_t rings = static_cast<size_t>(kThreads / 32) * kStages * unroll(kG) * 64 * sizeof(uint4);
  const size_t merge = static_cast<size_t>(kThreads / 32) * kG * (p.head_dim + 2) * sizeof(float);
  const dim3 grid(static_cast<unsigned>(static_cast<int64_t>(batch) * p.partitions),
                  static_cast<unsigned>(p.n_kv_heads * p.head_chunks));
  launch_early(paged_attention_kernel<kD, kG>, grid, kThreads, rings > merge ? rings : merge, stream, p);
  if (p.partitions > 1) {
    const ReduceParams r{p.part_o,  p.part_ml,    p.out,        p.context_lens,
                         p.n_heads, p.head_dim, p.partitions, p.partition_keys, p.max_keys};
    const int rows = kReduceThreads / (p.head_dim / 4);
    const size_t smem = (static_cast<size_t>(p.partitions) + static_cast<size_t>(rows) * p.head_dim) *
                        sizeof(float);
    launch_early(paged_attention_reduce_kernel,
                 static_cast<unsigned>(static_cast<int64_t>(batch) * p.n_heads), kReduceThreads,
                 smem, stream, r);
  }
  return TVLLM_OK;
  // END SOLUTION
}

template <int kD>
tvllm_status launch_dim(Params p, int batch, cudaStream_t stream) {
  const int kg = heads_per_block(p.group);
  p.head_chunks = static_cast<int>(tvllm_ceil_div(p.group, kg));
  using Launch = tvllm_status (*)(const Params&, int, cudaStream_t);
  const Launch by_group[] = {launch<kD, 8>, launch<kD, 1>, launch<kD, 2>, launch<kD, 3>,
                             launch<kD, 4>};
  return by_group[kg <= 4 ? kg : 0](p, batch, stream);
}

}  // namespace

// Split-K's partition size: how many keys one thread block of a partition takes, or 0 for the
// single pass. From host values only, so a CUDA graph captured for a batch size keeps its
// choice. split: -1 decide, 0 never, 1 always. max_keys: the longest context the call allows
// (the engine: max_model_len).
//
// The rule: the grid should have at least 2 blocks per SM. The single pass has `blocks`
// (batch x KV heads x head chunks); when that is fewer, split into partitions of 512 keys,
// and halve them (256, 128, 64) while the grid is still short of the target. Large grids keep
// 512 (smaller partitions there only add partials to write and merge); on 132 SMs a batch of
// one sequence (8 KV heads) gets 64-key partitions up to max_keys 4096 (64 partitions, 512
// blocks), 512-key ones from 16385.
int paged_attention_partition_keys(int batch, int n_heads, int n_kv_heads, int64_t max_keys,
                                   int split) {
  if (split == 0 || n_heads <= 0 || n_kv_heads <= 0 || n_heads % n_kv_heads != 0 ||
      max_keys <= kMinPartition)
    return 0;  // never split, or nothing to split: the single pass
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    cudaGetLastError();  // no device answer: the single pass, or the largest partitions
    return split > 0 && max_keys > kPartition ? kPartition : 0;
  }
  const int group = n_heads / n_kv_heads;
  const int64_t blocks = static_cast<int64_t>(batch) * n_kv_heads *
                         tvllm_ceil_div(group, heads_per_block(group));  // the single pass's grid
  const int64_t target = 2 * static_cast<int64_t>(sms);
  // BEGIN SOLUTION: decide (split < 0): the single pass (0) when blocks >= target; else keys = kPartition, halved while keys > kMinPartition and blocks * ceil(max_keys / keys) < target; 0 when that is one partition (or more than kMaxPartitions when deciding) | return 0;
  if (split < 0 && blocks >= target) return 0;
  int keys = kPartition;
  while (keys > kMinPartition && blocks * tvllm_ceil_div(max_keys, keys) < target) keys /= 2;
  const int64_t parts = tvllm_ceil_div(max_keys, keys);
  if (parts <= 1 || (split < 0 && parts > kMaxPartitions)) return 0;
  return keys;
  // END SOLUTION
}

// q: [batch, n_heads, head_dim] bf16, rows q_stride elements apart (a multiple of 8), 16-byte
// aligned (it may be a view of a fused QKV tensor). k_cache, v_cache: [num_blocks, block_size,
// n_kv_heads, head_dim] bf16, contiguous; block_size a power of two. block_tables: [batch,
// max_blocks] int32; context_lens: [batch] int32 (never read by the host). out: [batch,
// n_heads, head_dim] bf16. partitions > 1: split-K in partitions of partition_keys keys, with
// `workspace` holding batch * n_heads * partitions * (head_dim + 2) floats.
tvllm_status launch_paged_decode_attention(const void* q, const void* k_cache, const void* v_cache,
                                           void* out, const int32_t* block_tables,
                                           const int32_t* context_lens, float* workspace,
                                           int batch, int64_t q_stride, int n_heads,
                                           int n_kv_heads, int head_dim, int num_blocks,
                                           int block_size, int max_blocks, int max_keys,
                                           int partitions, int partition_keys, float scale,
                                           cudaStream_t stream) {
  if (batch == 0 || n_heads == 0) return TVLLM_OK;
  const bool grouped = n_kv_heads > 0 && n_heads % n_kv_heads == 0;
  const bool pieces = head_dim > 0 && head_dim % 8 == 0 && head_dim <= kMaxHeadDim &&
                      q_stride % 8 == 0;
  if (!grouped) return "grouped-query attention: n_heads must be a positive multiple of n_kv_heads";
  if (!pieces) return "head_dim (at most 128) and q's row stride must be multiples of 8 (16 bytes)";
  if (block_size <= 0 || (block_size & (block_size - 1)) != 0)
    return "block_size must be a power of two";
  if (num_blocks < 0 || max_blocks < 0 || max_keys < 0) return "sizes must not be negative";
  if (partitions < 1 || partitions > kMaxPartitions ||
      (partitions > 1 && (workspace == nullptr || partition_keys < 1 ||
                          static_cast<int64_t>(partitions) * partition_keys < max_keys)))
    return "split-K needs a workspace and ceil(max_context / partition_keys) partitions, at "
           "most 8192";
  const int group = n_heads / n_kv_heads;
  if (static_cast<int64_t>(n_kv_heads) * tvllm_ceil_div(group, heads_per_block(group)) > 65535)
    return "too many KV heads: at most 65535 blocks per sequence";
  int shift = 0;
  while ((1 << shift) < block_size) ++shift;
  const int64_t partials = static_cast<int64_t>(batch) * n_heads * partitions * head_dim;
  float* part_ml = workspace == nullptr ? nullptr : workspace + partials;
  const Params p{static_cast<const __nv_bfloat16*>(q), static_cast<const __nv_bfloat16*>(k_cache),
                 static_cast<const __nv_bfloat16*>(v_cache), static_cast<__nv_bfloat16*>(out),
                 workspace, part_ml, block_tables, context_lens, q_stride, n_heads, n_kv_heads,
                 head_dim, group, /*head_chunks=*/1, num_blocks, block_size, shift, max_blocks,
                 max_keys, partitions, partition_keys, scale * kLog2e};
  // 64 and 128 have kernels compiled for their size; other multiples of 8 the generic one
  const auto by_dim = head_dim == 64 ? launch_dim<64> : head_dim == 128 ? launch_dim<128>
                                                                         : launch_dim<0>;
  return by_dim(p, batch, stream);
}

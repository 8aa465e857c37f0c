// Stage 14, part 1: a simple paged decode-attention kernel (scalar float math).
//
//     out[b, h] = sum_j softmax_j(scale * q[b, h] . K_b[j]) V_b[j],   j < context_lens[b]
//     K_b[j] = k_cache[block_tables[b, j / block_size], j % block_size, h / group]
//
// A sequence's keys lie in blocks of block_size rows scattered over the pool; its block table
// says which: key j is row j % block_size of physical block block_tables[b, j / block_size].
//
// One thread block per (sequence, query head), kThreads threads = kWarps warps. Warp w takes
// keys w, w + kWarps, w + 2 kWarps, ... of the sequence, one at a time: each lane holds the
// head's dims lane, lane + 32, lane + 64, lane + 96 (those below head_dim) of q, multiplies
// them with the key's, and the warp adds the 32 partial products (warp_sum: every lane gets
// the score). Each warp keeps an ONLINE softmax state over its keys (add_key): the running
// max m, the running sum l = sum exp(s - m) and, per dim, o = sum exp(s - m) v; nothing is
// stored per key, so the context has no length limit. At the end the warps' states meet in
// shared memory and thread e merges dim e's (merge_state: the same merge as split-K's in
// part 2), then out = o / l.
//
// A context length of 0 is a padding row: zeros. A length past max_keys (the block table's
// capacity, or max_context) or a block number outside the pool is never read: that row is
// NaN (the kernel cannot raise, and the binding reads no device memory: CUDA-graph safe).
// Reference: paged_attention.py (paged_decode_attention_native). Run: nox -s grade -- 14
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cmath>
#include <cstdint>

#include "tvllm.h"
#include "vec.cuh"

namespace {

constexpr int kMaxHeadDim = 128;
constexpr int kThreads = 128;                 // 4 warps per block
constexpr int kWarps = kThreads / 32;
constexpr int kDimsPerLane = kMaxHeadDim / 32;  // lane's dims: lane + 32 i, i < kDimsPerLane

struct Params {
  const __nv_bfloat16* q;        // [batch, n_heads, head_dim], rows q_stride apart
  const __nv_bfloat16* k;        // [num_blocks, block_size, n_kv_heads, head_dim], contiguous
  const __nv_bfloat16* v;        // same shape as k
  __nv_bfloat16* out;            // [batch, n_heads, head_dim], contiguous
  const int32_t* block_tables;   // [batch, max_blocks]
  const int32_t* context_lens;   // [batch]: keys to attend (0 = padding row)
  int64_t q_stride;              // elements from one sequence's q row to the next
  int n_heads, n_kv_heads, head_dim;
  int num_blocks, block_size, max_blocks;
  int max_keys;                  // longest context allowed: min(max_blocks * block_size, max_context)
  float scale;
};

// One warp's softmax state over the keys it has seen: m = max score, l = sum exp(s - m), and
// for this lane's dims o[i] = sum exp(s - m) v[lane + 32 i]. No key yet: m = -inf, l = o = 0.
struct State {
  float m, l, o[kDimsPerLane];
};

// The sum of x over the warp's 32 lanes, in every lane (a butterfly of xor-shuffles).
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// Where key j of this sequence lives: the element offset of its row for KV head kv_head in
// k_cache (and v_cache), or -1 when its block number is outside the pool [0, num_blocks).
// table: the sequence's row of block_tables.
__device__ __forceinline__ int64_t key_offset(const Params& p, const int32_t* table, int j,
                                              int kv_head) {
  // BEGIN SOLUTION: the block (table column j / block_size), -1 if outside the pool; its row j % block_size; the offset of (block, row, kv_head, dim 0) in the [num_blocks, block_size, n_kv_heads, head_dim] cache | return -1;
  const int block = table[j / p.block_size];
  if (block < 0 || block >= p.num_blocks) return -1;
  const int64_t row = static_cast<int64_t>(block) * p.block_size + j % p.block_size;
  return (row * p.n_kv_heads + kv_head) * p.head_dim;
  // END SOLUTION
}

// Fold one key (its score s and this lane's dims v of its value) into the state: when s
// raises the max from m to m', the old l and o are worth exp(m - m') of what they were.
__device__ __forceinline__ void add_key(State& st, float s, const float (&v)[kDimsPerLane]) {
  // BEGIN SOLUTION: m_new = max(m, s); correction = exp(m - m_new) (0 for the first key: exp(-inf)); p = exp(s - m_new); l and o rescaled by the correction, then p and p * v added
  const float m_new = fmaxf(st.m, s);
  const float correction = expf(st.m - m_new);
  const float p = expf(s - m_new);
  st.l = st.l * correction + p;
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i) st.o[i] = st.o[i] * correction + p * v[i];
  st.m = m_new;
  // END SOLUTION
}

// Merge another state (m2, l2, o2) of the same head and dim -- other keys -- into (m, l, o).
// Either may have seen no key (m = -inf, l = o = 0): it must weigh nothing, and two of them
// must stay (-inf, 0, 0), never NaN (exp(-inf - -inf) is NaN). A NaN in l2 must reach l.
__device__ __forceinline__ void merge_state(float& m, float& l, float& o, float m2, float l2,
                                            float o2) {
  // BEGIN SOLUTION: both to the larger max (a finite reference when both are -inf), then add
  const float top = fmaxf(m, m2);
  const float ref = top == -INFINITY ? 0.f : top;
  const float a = expf(m - ref), b = expf(m2 - ref);
  l = l * a + l2 * b;
  o = o * a + o2 * b;
  m = top;
  // END SOLUTION
}

// One block per (sequence b = blockIdx.x, query head h = blockIdx.y); see the top.
__global__ void __launch_bounds__(kThreads) paged_attention_simple_kernel(Params p) {
  const int b = blockIdx.x, h = blockIdx.y;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int d = p.head_dim;
  const int len = p.context_lens[b];
  __nv_bfloat16* out = p.out + (static_cast<int64_t>(b) * p.n_heads + h) * d;

  // BEGIN SOLUTION: a padding row (len 0) is zeros, a length outside [0, max_keys] NaN: write the row and return (the whole block alike, before any barrier)
  if (len <= 0 || len > p.max_keys) {
    const float fill = len == 0 ? 0.f : NAN;
    for (int e = threadIdx.x; e < d; e += blockDim.x) out[e] = __float2bfloat16(fill);
    return;
  }
  // END SOLUTION

  // BEGIN SOLUTION: the KV head this query head reads (grouped-query attention) | const int kv_head = 0;
  const int kv_head = h / (p.n_heads / p.n_kv_heads);
  // END SOLUTION

  // This lane's dims of q, times the scale (0 past head_dim: those dims add nothing).
  const __nv_bfloat16* q = p.q + b * p.q_stride + static_cast<int64_t>(h) * d;
  float qd[kDimsPerLane];
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i)
    qd[i] = lane + 32 * i < d ? to_float(q[lane + 32 * i]) * p.scale : 0.f;

  State st;
  st.m = -INFINITY;
  st.l = 0.f;
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i) st.o[i] = 0.f;
  bool bad_block = false;  // a key whose block is outside the pool: the row will be NaN
  const int32_t* table = p.block_tables + static_cast<int64_t>(b) * p.max_blocks;

  // BEGIN SOLUTION: this warp's keys j = warp, warp + kWarps, ... below len: key_offset (a block outside the pool: set bad_block, read nothing), the lane's partial dot product, warp_sum, add_key with the lane's dims of V
  for (int j = warp; j < len; j += kWarps) {
    const int64_t at = key_offset(p, table, j, kv_head);
    if (at < 0) {  // the same for the whole warp: every lane skips the shuffle alike
      bad_block = true;
      continue;
    }
    float dot = 0.f, vd[kDimsPerLane];
#pragma unroll
    for (int i = 0; i < kDimsPerLane; ++i) {
      const int e = lane + 32 * i;
      dot += e < d ? qd[i] * to_float(p.k[at + e]) : 0.f;
      vd[i] = e < d ? to_float(p.v[at + e]) : 0.f;
    }
    add_key(st, warp_sum(dot), vd);
  }
  // END SOLUTION

  // The warps' states meet in shared memory; thread e then merges dim e's.
  __shared__ float s_m[kWarps], s_l[kWarps], s_o[kWarps][kMaxHeadDim];
  if (lane == 0) {
    s_m[warp] = st.m;
    s_l[warp] = st.l;
  }
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i)
    if (lane + 32 * i < d) s_o[warp][lane + 32 * i] = st.o[i];
  bad_block = __syncthreads_or(bad_block);

  for (int e = threadIdx.x; e < d; e += blockDim.x) {
    // BEGIN SOLUTION: merge_state the kWarps states of dim e into one (starting from no key); out[e] = o / l, NaN when bad_block
    float m = -INFINITY, l = 0.f, o = 0.f;
    for (int w = 0; w < kWarps; ++w) merge_state(m, l, o, s_m[w], s_l[w], s_o[w][e]);
    out[e] = __float2bfloat16(bad_block ? NAN : o / l);
    // END SOLUTION
  }
}

}  // namespace

// q: [batch, n_heads, head_dim] bf16, rows q_stride elements apart. k_cache, v_cache:
// [num_blocks, block_size, n_kv_heads, head_dim] bf16, contiguous. block_tables: [batch,
// max_blocks] int32; context_lens: [batch] int32 (never read by the host). out: [batch,
// n_heads, head_dim] bf16, contiguous. max_keys: the longest context a row may have.
tvllm_status launch_paged_decode_attention_simple(const void* q, const void* k_cache,
                                                  const void* v_cache, void* out,
                                                  const int32_t* block_tables,
                                                  const int32_t* context_lens, int batch,
                                                  int64_t q_stride, int n_heads, int n_kv_heads,
                                                  int head_dim, int num_blocks, int block_size,
                                                  int max_blocks, int max_keys, float scale,
                                                  cudaStream_t stream) {
  if (batch == 0 || n_heads == 0) return TVLLM_OK;
  if (n_kv_heads <= 0 || n_heads % n_kv_heads != 0)
    return "grouped-query attention: n_heads must be a positive multiple of n_kv_heads";
  if (head_dim <= 0 || head_dim > kMaxHeadDim) return "head_dim must be in [1, 128]";
  if (block_size <= 0 || num_blocks < 0 || max_blocks < 0 || max_keys < 0)
    return "block_size must be positive and the sizes not negative";
  if (n_heads > 65535) return "at most 65535 query heads (the grid's y)";
  const Params p{static_cast<const __nv_bfloat16*>(q), static_cast<const __nv_bfloat16*>(k_cache),
                 static_cast<const __nv_bfloat16*>(v_cache), static_cast<__nv_bfloat16*>(out),
                 block_tables, context_lens, q_stride, n_heads, n_kv_heads, head_dim,
                 num_blocks, block_size, max_blocks, max_keys, scale};
  // BEGIN SOLUTION: one block of kThreads per (sequence, query head): grid (batch, n_heads) | return "{todo}";
  paged_attention_simple_kernel<<<dim3(batch, n_heads), kThreads, 0, stream>>>(p);
  return TVLLM_OK;
  // END SOLUTION
}

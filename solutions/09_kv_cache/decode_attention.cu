// Stage 09 kernel: decode attention, one new query token per sequence against its KV cache.
//
//     out[b, h] = sum_j softmax_j(scale * q[b, h] . K[j]) V[j],   j < context_lens[b],
//     K = k_cache[seq_slots[b], :, g],  V = v_cache[seq_slots[b], :, g],  g = h / (n_heads / n_kv)
//
// Decoding reads the whole cache of every sequence once per token and does two multiply-adds
// per element read: it is memory-bound, and the only goal is to read K and V once, at full
// bandwidth. So one block serves one (sequence, KV head) and computes EVERY query head of that
// KV head's group (4 for Llama-3.2-1B, 3 for SmolLM2): K and V cross the memory bus once, not
// once per query head.
//
// Work split (head_dim 64): a key is 64 bf16 = 128 bytes = eight 16-byte chunks, so 8 lanes
// ("a lane group") share a key, each owning 8 dimensions; a warp reads 4 keys at once, and
// each lane issues the loads of kUnroll keys before it uses any (several loads in flight per
// lane hide the memory latency). Per key, a lane's 8-term dot product with q is summed over
// its lane group with shuffles; then each query head's score goes through an ONLINE softmax:
// every lane group keeps, per head, the running maximum m, the running sum l = sum exp(s - m)
// and the accumulator o = sum exp(s - m) v over the keys it has seen. When a larger score
// arrives, m grows to m' and the old l and o are multiplied by exp(m - m') first, so nothing
// is ever stored per key and the context has no length limit. At the end the 4 lane groups of
// a warp merge their (m, l, o) with shuffles, the warps merge theirs through shared memory,
// and out = o / l. The hot case (head_dim 64, 4 query heads a block: Llama-3.2-1B) sums its
// scores by reduce-scatter instead, and runs each head's softmax on 2 lanes of the 8, not on
// all of them (attend_step_scatter).
// head_dim 128 uses 16 lanes per key (2 keys per warp step); any other multiple of 8 up to
// 128 rounds its chunk count up to a power of two (lanes past the head's end load nothing).
// Math is float32; softmax runs in base 2 (scale * log2 e is folded into q; fast_exp2 is one
// instruction). Only the step that holds a context's end checks which keys exist: every
// other step reads and scores all of its keys with no test (the loop runs at the edge of
// the SM's instruction issue rate, so each instruction a key costs counts). A context length
// of 0 is a padding row: its output is zeros (its slot is not looked at). A slot outside
// [0, num_slots) or a length outside [0, max_len] is never read: that row's output is NaN
// (the kernel cannot raise, and the binding must not read device memory, so that a decode
// step can be captured in a CUDA graph).
// Reference: decode_attention.py (decode_attention_native). Run: nox -s grade -- 09
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cmath>
#include <cstdint>

#include "exp2.cuh"
#include "tvllm.h"
#include "vec.cuh"

namespace {

constexpr int kMaxHeadDim = 128;
constexpr float kLog2e = 1.4426950408889634f;

struct Params {
  const __nv_bfloat16* q;        // [batch, n_heads, head_dim], rows q_stride apart
  const __nv_bfloat16* k;        // [num_slots, max_len, n_kv_heads, head_dim], contiguous
  const __nv_bfloat16* v;        // same shape as k
  __nv_bfloat16* out;            // [batch, n_heads, head_dim], contiguous
  const int32_t* seq_slots;      // [batch]: the cache slot of each sequence
  const int32_t* context_lens;   // [batch]: keys to attend (0 = padding row)
  int64_t q_stride;              // elements from one sequence's q row to the next
  int n_heads, n_kv_heads, head_dim;
  int group;                     // n_heads / n_kv_heads: query heads per KV head
  int head_chunks;               // blocks per KV head: ceil(group / kG)
  int num_slots, max_len;
  float scale_log2;              // scale * log2(e)
};

// The most threads a block of this kernel may have. A block keeps per query head 8 q values,
// 8 accumulators, m and l in registers (18 per head), so 8-head groups need more registers
// per thread: fewer threads per block.
__host__ __device__ constexpr int max_threads(int kG) { return kG > 4 ? 256 : 512; }

// Keys whose loads each lane issues before it computes with any of them.
__host__ __device__ constexpr int unroll(int kG) { return kG > 4 ? 2 : 4; }

using BF8 = Pack<__nv_bfloat16, 8>;  // 16 bytes: 8 dimensions of one head

// The 16 bytes at src (8 bf16, one load) when `ok`, else zeros (src is then not touched).
// Kept as raw bits until used: 4 registers, where 8 separate bf16 would take 8.
__device__ __forceinline__ uint4 load_or_zero(const __nv_bfloat16* src, bool ok) {
  return ok ? *reinterpret_cast<const uint4*>(src) : make_uint4(0u, 0u, 0u, 0u);
}

__device__ __forceinline__ void widen8(const uint4& raw, float (&f)[8]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 two = unpack_bf16(w[e]);
    f[2 * e] = two.x;
    f[2 * e + 1] = two.y;
  }
}

// The sum of x over an aligned group of `lanes` lanes (a power of two, at most 32); every
// lane of the group gets the same value (a butterfly: each step adds the partner's partial).
__device__ __forceinline__ float group_sum(float x, int lanes) {
  // BEGIN SOLUTION: xor-shuffle butterfly over offsets lanes/2, lanes/4, ..., 1 | return 0.f;
#pragma unroll
  for (int off = lanes / 2; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
  // END SOLUTION
}

// One query head's online-softmax state (m, l, o) takes in kU new scores s[u] (already in
// base 2; -inf for keys past the context) and their value chunks vf[u] (zeros for those).
// An all -inf state (no key seen yet) must stay zeros, not become NaN: exp2(-inf - -inf).
template <int kU>
__device__ __forceinline__ void online_update(float& m, float& l, float (&o)[8],
                                              const float (&s)[kU], const float (&vf)[kU][8]) {
  // BEGIN SOLUTION: new max; rescale l and o by exp2(m - m_new); add p = exp2(s - m_new) and p * v
  float m_new = m;
#pragma unroll
  for (int u = 0; u < kU; ++u) m_new = fmaxf(m_new, s[u]);
  const float base = m_new == -INFINITY ? 0.f : m_new;  // no key yet: every p below is 0
  const float correction = fast_exp2(m - base);          // exp2(-inf) = 0 on the first key
  l *= correction;
#pragma unroll
  for (int e = 0; e < 8; ++e) o[e] *= correction;
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const float p = fast_exp2(s[u] - base);
    l += p;
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] = fmaf(p, vf[u][e], o[e]);
  }
  m = m_new;
  // END SOLUTION
}

// Merge another state (m2, l2, o2) of the same head -- other keys -- into (m, l, o).
__device__ __forceinline__ void merge_state(float& m, float& l, float (&o)[8], float m2,
                                            float l2, const float (&o2)[8]) {
  // BEGIN SOLUTION: both states rescaled to the larger max (an all -inf state weighs 0)
  const float m_new = fmaxf(m, m2);
  const float base = m_new == -INFINITY ? 0.f : m_new;
  const float a = fast_exp2(m - base), b = fast_exp2(m2 - base);
  l = l * a + l2 * b;
#pragma unroll
  for (int e = 0; e < 8; ++e) o[e] = o[e] * a + o2[e] * b;
  m = m_new;
  // END SOLUTION
}

// This lane's kU keys of a step, as raw bits: key u's 16 bytes of K at kj + u * row_step, of
// V at vj + the same. kTail: the step holds the context's end, and key u exists only when
// u * keys_per_step < left (left: keys from this lane's first key to the end); keys that do
// not exist, and lanes past the head's end (no chunk), load zeros and touch no memory.
template <int kU, bool kTail>
__device__ __forceinline__ void load_step(const __nv_bfloat16* kj, const __nv_bfloat16* vj,
                                          int64_t row_step, bool has_chunk, int left,
                                          int keys_per_step, uint4 (&kr)[kU], uint4 (&vr)[kU]) {
  // BEGIN SOLUTION: every load first (kU * 32 bytes in flight per lane), load_or_zero where the key exists
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const bool load = has_chunk && (!kTail || u * keys_per_step < left);
    kr[u] = load_or_zero(kj + u * row_step, load);
    vr[u] = load_or_zero(vj + u * row_step, load);
  }
  // END SOLUTION
}

// This lane's share of each score: part[i][u] = q[i] . (key u), over the lane's 8 dims.
template <int kU, int kG>
__device__ __forceinline__ void partial_scores(const uint4 (&kr)[kU], const float (&q)[kG][8],
                                               float (&part)[kG][kU]) {
  // BEGIN SOLUTION: widen8 each key, 8 FMAs per head
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    float kf[8];
    widen8(kr[u], kf);
#pragma unroll
    for (int i = 0; i < kG; ++i) {
      float dot = 0.f;
#pragma unroll
      for (int e = 0; e < 8; ++e) dot = fmaf(q[i][e], kf[e], dot);
      part[i][u] = dot;
    }
  }
  // END SOLUTION
}

// One warp step of this lane: its kU keys (load_step), their scores against the kG query
// heads, and each head's online_update. Keys that do not exist (kTail, as load_step) score
// -inf. Whole steps (kTail false) test nothing.
template <int kU, int kG, bool kTail>
__device__ __forceinline__ void attend_step(const __nv_bfloat16* kj, const __nv_bfloat16* vj,
                                            int64_t row_step, bool has_chunk, int left,
                                            int keys_per_step, int lanes,
                                            const float (&q)[kG][8], float (&m)[kG],
                                            float (&l)[kG], float (&o)[kG][8]) {
  // BEGIN SOLUTION: load_step, partial_scores, group_sum each score (-inf where the key does not exist), online_update per head
  uint4 kr[kU], vr[kU];
  load_step<kU, kTail>(kj, vj, row_step, has_chunk, left, keys_per_step, kr, vr);
  float s[kG][kU];
  partial_scores<kU, kG>(kr, q, s);
#pragma unroll
  for (int u = 0; u < kU; ++u)
#pragma unroll
    for (int i = 0; i < kG; ++i) {
      const float dot = group_sum(s[i][u], lanes);  // every lane of the group holds the score
      s[i][u] = !kTail || u * keys_per_step < left ? dot : -INFINITY;
    }
  float vf[kU][8];
#pragma unroll
  for (int u = 0; u < kU; ++u) widen8(vr[u], vf[u]);
#pragma unroll
  for (int i = 0; i < kG; ++i) online_update<kU>(m[i], l[i], o[i], s[i], vf);
  // END SOLUTION
}

// The hot case (head_dim 64: 8 lanes per key; a group of 4 query heads; 4 keys per lane)
// sums its scores by REDUCE-SCATTER, not by 16 all-reduces. attend_step has every lane of a
// group sum all 16 (head, key) scores: 16 x 3 shuffles and adds, then 16 exp2 and the softmax
// bookkeeping done 8 times over. Here each of the 3 butterfly levels halves what a lane keeps:
// it sends half its partial sums to its partner and adds the partner's other half to the half
// it keeps (14 shuffles in all), so that a lane ends with 2 whole scores: the lane with bits
// (b2 b1 b0) of its group holds head r = (b2 b1)'s scores of keys 2 * b0 and 2 * b0 + 1. Only
// that head's softmax runs on the lane (2 exp2), and the 16 probabilities are broadcast back
// (16 shuffles) for P * V, which every lane still does for its 8 dimensions of all 4 heads.
//
// No selects for the head levels: the lane's q slot i holds head i ^ r (see the kernel), so a
// lane always keeps its low slots (0 and 1 at level 1, 0 at level 2) and sends the high ones,
// and the partner's sent slot holds the same head as the kept one. The key level selects (b0
// picks the pair to keep): 4 FSEL a step.
//
// State per lane: m_own and l_own, the running max and (partial) sum of head r over the keys
// of the lane's pair, rescaled like o; the group's two lanes of head r share m_own (the max is
// taken over the 4 keys), so their l_own add up at the end (scatter_state).
//
// Optional, for speed: the kernel takes this path once kScatterWritten is true; until then
// attend_step serves every shape, the hot one too.
constexpr int kScatterHeads = 4, kScatterUnroll = 4, kScatterLanes = 8;
// BEGIN SOLUTION: true once attend_step_scatter and scatter_state are written (optional, for speed) | constexpr bool kScatterWritten = false;
constexpr bool kScatterWritten = true;
// END SOLUTION

template <bool kTail>
__device__ __forceinline__ void attend_step_scatter(const __nv_bfloat16* kj,
                                                    const __nv_bfloat16* vj, int64_t row_step,
                                                    int left, int c,
                                                    const float (&q)[kScatterHeads][8],
                                                    float& m_own, float& l_own,
                                                    float (&o)[kScatterHeads][8]) {
  // BEGIN SOLUTION: load_step and partial_scores (slot i: head i ^ r); reduce-scatter at xor 4 (keep slots 0, 1), 2 (keep slot 0), 1 (keep keys 2 b0, 2 b0 + 1); the tail's -inf; head r's max over the 4 keys, base, correction, 2 p's, l_own; then per head i the correction and p's from lanes 2i, 2i + 1 of the group (__shfl_sync, width 8) into o
  constexpr int kG = kScatterHeads, kU = kScatterUnroll, kKeysPerStep = 32 / kScatterLanes;
  uint4 kr[kU], vr[kU];
  load_step<kU, kTail>(kj, vj, row_step, true, left, kKeysPerStep, kr, vr);
  float s[kG][kU];  // this lane's 8-term part of each score: s[i][u] = q (head i ^ r) . k (key u)
  partial_scores<kU, kG>(kr, q, s);
  // Level 1 (partner c ^ 4: head bit 1 flipped). Slots 0, 1 hold heads r, r ^ 1; the partner
  // (r ^ 2) holds those two in its slots 2, 3 -- and wants our slots 2, 3.
  float s1[2][kU];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int u = 0; u < kU; ++u)
      s1[i][u] = s[i][u] + __shfl_xor_sync(0xffffffffu, s[i + 2][u], 4);
  // Level 2 (partner c ^ 2: head bit 0 flipped): keep head r (slot 0), send head r ^ 1.
  float s2[kU];
#pragma unroll
  for (int u = 0; u < kU; ++u) s2[u] = s1[0][u] + __shfl_xor_sync(0xffffffffu, s1[1][u], 2);
  // Level 3 (partner c ^ 1): lane b0 keeps keys 2 * b0, 2 * b0 + 1 and sends the other pair.
  const bool b0 = c & 1;
  float own[2];
#pragma unroll
  for (int t = 0; t < 2; ++t) {
    const float keep = b0 ? s2[t + 2] : s2[t], send = b0 ? s2[t] : s2[t + 2];
    own[t] = keep + __shfl_xor_sync(0xffffffffu, send, 1);
    if (kTail && (2 * b0 + t) * kKeysPerStep >= left) own[t] = -INFINITY;  // past the context
  }
  // Head r's online softmax: the max over the step's 4 keys (both lanes of the head), then as
  // online_update, on 2 scores. All -inf so far (no key yet): base 0, so p = correction = 0.
  float mx = fmaxf(own[0], own[1]);
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  const float m_new = fmaxf(m_own, mx);
  const float base = m_new == -INFINITY ? 0.f : m_new;
  const float correction = fast_exp2(m_own - base);
  const float p0 = fast_exp2(own[0] - base), p1 = fast_exp2(own[1] - base);
  l_own = fmaf(l_own, correction, p0 + p1);
  m_own = m_new;
  // Every lane rescales and accumulates o for all 4 heads: head i's correction and p's come
  // from lanes 2i (keys 0, 1) and 2i + 1 (keys 2, 3) of the group.
  float vf[kU][8];
#pragma unroll
  for (int u = 0; u < kU; ++u) widen8(vr[u], vf[u]);
#pragma unroll
  for (int i = 0; i < kG; ++i) {
    const float corr_i = __shfl_sync(0xffffffffu, correction, 2 * i, kScatterLanes);
#pragma unroll
    for (int e = 0; e < 8; ++e) o[i][e] *= corr_i;
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const float p = __shfl_sync(0xffffffffu, u % 2 ? p1 : p0, 2 * i + u / 2, kScatterLanes);
#pragma unroll
      for (int e = 0; e < 8; ++e) o[i][e] = fmaf(p, vf[u][e], o[i][e]);
    }
  }
  // END SOLUTION
}

// After attend_step_scatter's loop: every lane's (m, l) of all kScatterHeads heads, as
// attend_step leaves them (l over the lane group's keys), for the merges that follow.
__device__ __forceinline__ void scatter_state(float m_own, float l_own, float (&m)[kScatterHeads],
                                              float (&l)[kScatterHeads]) {
  // BEGIN SOLUTION: l_own plus the partner's (xor 1: the other key pair); head i's m and l from lane 2i of the group
  const float l_pair = l_own + __shfl_xor_sync(0xffffffffu, l_own, 1);  // both key pairs
#pragma unroll
  for (int i = 0; i < kScatterHeads; ++i) {
    m[i] = __shfl_sync(0xffffffffu, m_own, 2 * i, kScatterLanes);
    l[i] = __shfl_sync(0xffffffffu, l_pair, 2 * i, kScatterLanes);
  }
  // END SOLUTION
}

// kD: head_dim, or 0 to read it from p.head_dim (a multiple of 8 up to 128).
// kG: the query heads a block computes (the GQA group, or a chunk of at most kG of it).
template <int kD, int kG>
__global__ void __launch_bounds__(max_threads(kG)) decode_attention_kernel(Params p) {
  constexpr int kU = unroll(kG);
  // the hot case sums its scores by reduce-scatter (attend_step_scatter), once it is written
  constexpr bool kScatter = kScatterWritten && kD == 8 * kScatterLanes && kG == kScatterHeads &&
                            kU == kScatterUnroll;
  const int d = kD ? kD : p.head_dim;
  const int chunks = d / 8;  // 16-byte pieces of one head's row
  int lanes = kD ? kD / 8 : 1;  // lanes per key: chunks rounded up to a power of two
  if (!kD)
    while (lanes < chunks) lanes *= 2;
  const int keys_per_step = 32 / lanes;  // keys a warp reads with one load instruction
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int key_in_step = lane / lanes;  // which of those keys this lane reads
  const int c = lane % lanes;            // which 16-byte chunk of it
  const bool has_chunk = kD != 0 || c < chunks;  // with kD, every lane has one

  const int b = blockIdx.x;
  // BEGIN SOLUTION: this block's KV head, its first query head h0 and how many it computes (n_here) | const int kv_head = 0, h0 = 0, n_here = 0;
  const int kv_head = blockIdx.y / p.head_chunks;
  const int first = (blockIdx.y % p.head_chunks) * kG;  // within the group
  const int h0 = kv_head * p.group + first;             // query heads h0 .. h0 + n_here - 1
  const int n_here = min(kG, p.group - first);
  // END SOLUTION
  __nv_bfloat16* out = p.out + (static_cast<int64_t>(b) * p.n_heads + h0) * d;

  // A padding row (length 0; its slot is not looked at) gets zeros; a row whose slot or
  // length would read outside the cache gets NaN. The whole block leaves together.
  const int len = p.context_lens[b];
  const int slot = p.seq_slots[b];
  const bool bad = len != 0 && (slot < 0 || slot >= p.num_slots || len < 0 || len > p.max_len);
  if (bad || len == 0) {
    const __nv_bfloat16 fill = bad ? __float2bfloat16(NAN) : __float2bfloat16(0.f);
    for (int i = threadIdx.x; i < n_here * d; i += blockDim.x) out[i] = fill;
    return;
  }

  // This lane's 8 dimensions of each query head, pre-multiplied by scale * log2(e).
  float q[kG][8];
#pragma unroll
  for (int i = 0; i < kG; ++i) {
    // heads past the group and lanes past the head's end hold zeros
    // (the scatter path's lane c holds head i ^ r in slot i, r = c / 2: attend_step_scatter)
    const int h = kScatter ? i ^ (c >> 1) : i;
    const __nv_bfloat16* src = p.q + b * p.q_stride + static_cast<int64_t>(h0 + h) * d + c * 8;
    widen8(load_or_zero(src, h < n_here && has_chunk), q[i]);
#pragma unroll
    for (int e = 0; e < 8; ++e) q[i][e] *= p.scale_log2;
  }

  // This lane group's online-softmax state per head, over the keys it has seen.
  float m[kG], l[kG], o[kG][8];
#pragma unroll
  for (int i = 0; i < kG; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) o[i][e] = 0.f;
  }

  // Key j of this sequence and KV head is k_cache[slot, j, kv_head, :]: rows key_stride apart.
  const int64_t key_stride = static_cast<int64_t>(p.n_kv_heads) * d;
  const int64_t start = static_cast<int64_t>(slot) * p.max_len * key_stride +
                        static_cast<int64_t>(kv_head) * d + c * 8;
  const __nv_bfloat16* kp = p.k + start;
  const __nv_bfloat16* vp = p.v + start;

  // Warp w takes steps w, w + warps, ...; a step is kU * keys_per_step consecutive keys, and
  // this lane reads keys j0 + u * keys_per_step + key_in_step. The loop bound is the same for
  // every lane of a warp, so all 32 lanes reach each shuffle together. Every step before the
  // one that holds key len - 1 is whole; that one (at most one warp has it) is the tail.
  const int step = kU * keys_per_step;
  // BEGIN SOLUTION: pointers to this lane's first key, stepped by warps * step rows; attend_step on the whole steps, then <kTail = true> on the one holding the end (if this warp has it). Optional, for speed: when kScatter, attend_step_scatter in their place, then scatter_state
  const int64_t row_step = static_cast<int64_t>(keys_per_step) * key_stride;  // key u to u + 1
  const int64_t warp_step = static_cast<int64_t>(warps) * step * key_stride;  // to the next step
  int j0 = warp * step;
  const int64_t lane_first = static_cast<int64_t>(j0 + key_in_step) * key_stride;
  const __nv_bfloat16* kj = kp + lane_first;
  const __nv_bfloat16* vj = vp + lane_first;
  if constexpr (kScatter) {
    float m_own = -INFINITY, l_own = 0.f;  // head c / 2's, over this lane's key pair
    for (; j0 + step <= len; j0 += warps * step, kj += warp_step, vj += warp_step)
      attend_step_scatter<false>(kj, vj, row_step, 0, c, q, m_own, l_own, o);
    if (j0 < len)
      attend_step_scatter<true>(kj, vj, row_step, len - j0 - key_in_step, c, q, m_own, l_own, o);
    scatter_state(m_own, l_own, m, l);
  } else {
    for (; j0 + step <= len; j0 += warps * step, kj += warp_step, vj += warp_step)
      attend_step<kU, kG, false>(kj, vj, row_step, has_chunk, 0, keys_per_step, lanes, q, m, l, o);
    if (j0 < len)
      attend_step<kU, kG, true>(kj, vj, row_step, has_chunk, len - j0 - key_in_step,
                                keys_per_step, lanes, q, m, l, o);
  }
  // END SOLUTION

  // The lane groups of a warp saw different keys: merge them (partners share chunk c).
  // BEGIN SOLUTION: xor shuffles at offsets lanes, 2 * lanes, ..., 16 on m, l and o; merge_state
  for (int off = lanes; off < 32; off *= 2) {
#pragma unroll
    for (int i = 0; i < kG; ++i) {
      float o2[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) o2[e] = __shfl_xor_sync(0xffffffffu, o[i][e], off);
      const float m2 = __shfl_xor_sync(0xffffffffu, m[i], off);
      const float l2 = __shfl_xor_sync(0xffffffffu, l[i], off);
      merge_state(m[i], l[i], o[i], m2, l2, o2);
    }
  }
  // END SOLUTION

  // Then the warps, through shared memory: o as [warps][kG][d], then m and l as [warps][kG].
  extern __shared__ float4 smem4[];
  float* s_o = reinterpret_cast<float*>(smem4);
  float* s_m = s_o + warps * kG * d;
  float* s_l = s_m + warps * kG;
  if (key_in_step == 0 && has_chunk) {
    float4* dst = reinterpret_cast<float4*>(s_o + (warp * kG) * d + c * 8);
#pragma unroll
    for (int i = 0; i < kG; ++i) {
      dst[i * d / 4] = make_float4(o[i][0], o[i][1], o[i][2], o[i][3]);
      dst[i * d / 4 + 1] = make_float4(o[i][4], o[i][5], o[i][6], o[i][7]);
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < kG; ++i) {
      s_m[warp * kG + i] = m[i];
      s_l[warp * kG + i] = l[i];
    }
  }
  __syncthreads();

  // One thread per (head, 16-byte chunk) of the output: merge the warps, divide, round once.
  // BEGIN SOLUTION: merge the warps' states (merge_state), then out = o / l as 8 bf16 in one 16-byte store
  for (int t = threadIdx.x; t < n_here * chunks; t += blockDim.x) {
    const int i = t / chunks, cc = t % chunks;
    float mm = -INFINITY, ll = 0.f, oo[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int w = 0; w < warps; ++w) {
      const float4* src = reinterpret_cast<const float4*>(s_o + (w * kG + i) * d + cc * 8);
      const float4 lo = src[0], hi = src[1];
      const float o2[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
      merge_state(mm, ll, oo, s_m[w * kG + i], s_l[w * kG + i], o2);
    }
    const float inv = ll > 0.f ? 1.f / ll : 0.f;
    BF8 result;
#pragma unroll
    for (int e = 0; e < 8; ++e) result.v[e] = from_float<__nv_bfloat16>(oo[e] * inv);
    *reinterpret_cast<BF8*>(out + i * d + cc * 8) = result;
  }
  // END SOLUTION
}

template <int kD, int kG>
tvllm_status launch(const Params& p, int batch, cudaStream_t stream) {
  // BEGIN SOLUTION: grid (batch, n_kv_heads * head_chunks); warps per block; dynamic shared memory for the warp merge | return "{todo}";
  // Enough warps in all to fill the GPU: 4 per block when there are many blocks (batch 64 x
  // 8 KV heads), more when there are few (batch 1), up to what the registers allow.
  const int sms = tvllm_sm_count();
  if (sms <= 0) return "decode attention: could not ask the device how many SMs it has";
  const int64_t blocks = static_cast<int64_t>(batch) * p.n_kv_heads * p.head_chunks;
  int warps = 4;
  while (warps * 32 < max_threads(kG) && blocks * warps < int64_t{12} * sms) warps *= 2;
  const size_t smem = static_cast<size_t>(warps) * kG * (p.head_dim + 2) * sizeof(float);
  const dim3 grid(static_cast<unsigned>(batch), static_cast<unsigned>(p.n_kv_heads * p.head_chunks));
  decode_attention_kernel<kD, kG><<<grid, warps * 32, smem, stream>>>(p);
  return TVLLM_OK;
  // END SOLUTION
}

// Query heads per block: the group itself for the common sizes; 5..8 are padded to 8 (the
// extra heads compute on zeros and are not written); larger groups are split in chunks of 8.
template <int kD>
tvllm_status launch_group(Params p, int batch, cudaStream_t stream) {
  const int kg = p.group <= 4 ? p.group : 8;
  p.head_chunks = static_cast<int>(tvllm_ceil_div(p.group, kg));
  switch (kg) {
    case 1: return launch<kD, 1>(p, batch, stream);
    case 2: return launch<kD, 2>(p, batch, stream);
    case 3: return launch<kD, 3>(p, batch, stream);
    case 4: return launch<kD, 4>(p, batch, stream);
    default: return launch<kD, 8>(p, batch, stream);
  }
}

}  // namespace

// q: [batch, n_heads, head_dim] bf16, each row's heads contiguous, rows q_stride elements
// apart (a multiple of 8), 16-byte aligned (it may be a view of a fused QKV tensor).
// k_cache, v_cache: [num_slots, max_len, n_kv_heads, head_dim] bf16, contiguous.
// seq_slots, context_lens: [batch] int32 on the device (never read by the host: a decode step
// must be capturable in a CUDA graph). out: [batch, n_heads, head_dim] bf16, contiguous.
tvllm_status launch_decode_attention(const void* q, const void* k_cache, const void* v_cache,
                                     void* out, const int32_t* seq_slots,
                                     const int32_t* context_lens, int batch, int64_t q_stride,
                                     int n_heads, int n_kv_heads, int head_dim, int num_slots,
                                     int max_len, float scale, cudaStream_t stream) {
  if (batch == 0 || n_heads == 0) return TVLLM_OK;
  if (n_kv_heads <= 0 || n_heads % n_kv_heads != 0)
    return "n_heads must be a positive multiple of n_kv_heads (grouped-query attention)";
  if (head_dim <= 0 || head_dim % 8 != 0 || head_dim > kMaxHeadDim)
    return "head_dim must be a multiple of 8, at most 128 (64 and 128 have tuned kernels)";
  if (q_stride % 8 != 0) return "q's row stride must be a multiple of 8 elements (16 bytes)";
  if (num_slots < 0 || max_len < 0) return "the cache must have non-negative sizes";
  const int group = n_heads / n_kv_heads;
  if (static_cast<int64_t>(n_kv_heads) * tvllm_ceil_div(group, 8) > 65535)
    return "too many KV heads: at most 65535 blocks per sequence";
  const Params p{static_cast<const __nv_bfloat16*>(q), static_cast<const __nv_bfloat16*>(k_cache),
                 static_cast<const __nv_bfloat16*>(v_cache), static_cast<__nv_bfloat16*>(out),
                 seq_slots, context_lens, q_stride, n_heads, n_kv_heads, head_dim, group,
                 /*head_chunks=*/1, num_slots, max_len, scale * kLog2e};
  switch (head_dim) {
    case 64: return launch_group<64>(p, batch, stream);
    case 128: return launch_group<128>(p, batch, stream);
    default: return launch_group<0>(p, batch, stream);
  }
}

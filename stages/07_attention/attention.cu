// Stage 07 kernel: causal prefill attention over packed sequences, with grouped-query heads.
//
//     out[t, h] = sum_j softmax_j(scale * q[t, h] . k[j, g]) v[j, g],   g = h / (n_heads / n_kv)
//
// over the keys j of t's own sequence with j <= t (causal). Sequences are packed along the
// token axis: sequence b's queries are rows [cu_seqlens_q[b], cu_seqlens_q[b+1]) of q and its
// keys rows [cu_seqlens_k[b], cu_seqlens_k[b+1]) of k and v (vLLM's varlen layout). A sequence
// may have more keys than queries -- a prompt whose first tokens are already in the KV cache
// (chunked prefill, stage 11): its len_q queries are then its LAST len_q positions, so query
// i sits at key position i + (len_k - len_q), and the causal mask is aligned to the end.
//
// One block computes a tile of 64 query rows of one head of one sequence. It streams that
// sequence's keys through shared memory in tiles of 64, twice:
//   pass 1: scores -> each row's maximum m, so softmax can use exp(s - m) <= 1 (no overflow);
//   pass 2: scores again -> p = exp(s - m), the row sums l, and o += p V;
// then writes o / l. Recomputing the scores costs less than keeping them: 64 rows of 4096
// float scores are 1 MB, far more than shared memory. Stage 12 merges the passes (the online
// softmax) and moves the products to tensor cores.
// Math is float32 (bf16 in, widened in shared memory, bf16 out, rounded once). Softmax runs
// in base 2: exp(x) = exp2(x log2 e), and exp2f is one instruction, so log2 e is folded into
// the scale. 256 threads form a 16 x 16 grid: thread (ty, tx) owns rows ty + 16i and keys
// tx + 16j (i, j < 4) of a score tile; the 16 threads of a row are 16 lanes of one warp, so a
// row's max and sum take 4 shuffles.
// q, k, v may be views of a fused QKV tensor: any token (row) stride, heads contiguous.
// Reference: attention.py (attention_native). Run: nox -s grade -- 07
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cmath>
#include <cstdint>

#include "tvllm.h"

namespace {

constexpr int kBlockQ = 64;     // query rows per block
constexpr int kBlockK = 64;     // keys per shared-memory tile
constexpr int kThreads = 256;   // a 16 x 16 grid of threads
constexpr int kPad = 4;         // floats after each Q/K row: float4 reads of 8 rows hit 8 banks
constexpr int kPPitch = kBlockK + kPad;
constexpr int kMaxHeadDim = 128;
constexpr float kLog2e = 1.4426950408889634f;
static_assert(kBlockQ == kBlockK, "load_tile loads 64 rows for Q, K and V alike");

struct Params {
  const __nv_bfloat16* q;
  const __nv_bfloat16* k;
  const __nv_bfloat16* v;
  __nv_bfloat16* out;          // [tokens, n_heads, head_dim], contiguous
  const int32_t* cu_seqlens_q;   // [n_seqs + 1]
  const int32_t* cu_seqlens_k;   // [n_seqs + 1]
  int64_t q_stride, k_stride, v_stride;  // elements from one token's row to the next
  int n_heads, n_kv_heads, head_dim;
  float scale_log2;            // scale * log2(e)
};

// Shared memory in floats: Q and K tiles (row pitch d + kPad), the V tile (pitch d), and the
// probabilities P (pitch kPPitch). P takes K's place when that is large enough: K is dead
// once a tile's scores are in registers.
__host__ __device__ inline int qk_pitch(int d) { return d + kPad; }
__host__ __device__ inline bool p_reuses_k(int d) { return kBlockQ * kPPitch <= kBlockK * qk_pitch(d); }
__host__ __device__ inline int64_t smem_floats(int d) {
  return static_cast<int64_t>(kBlockQ + kBlockK) * qk_pitch(d) + kBlockK * d +
         (p_reuses_k(d) ? 0 : kBlockQ * kPPitch);
}

__device__ __forceinline__ float elem(const float4& v, int e) {
  return e == 0 ? v.x : e == 1 ? v.y : e == 2 ? v.z : v.w;
}

// Rows [row0, row0 + 64) of one head -- `src` points at row 0 of this sequence and head --
// from bf16 in global memory to float in shared memory. Rows at or past `len` are another
// sequence's (or nobody's): they become zeros, never garbage, because 0 * NaN is NaN.
__device__ __forceinline__ void load_tile(float* dst, int pitch, const __nv_bfloat16* src,
                                          int64_t stride, int row0, int len, int d) {
  // TODO stage 07: 16-byte loads (8 bf16) spread over the block, widened to float; zeros for rows >= len (about 18 lines)
}

// This thread's 4 x 4 scores of the tile: s[i][j] = (Q row ty+16i) . (K row tx+16j) * scale_log2.
__device__ __forceinline__ void tile_scores(const float* qs, const float* ks, int pitch, int d,
                                            int ty, int tx, float scale_log2, float (&s)[4][4]) {
  // TODO stage 07: dot products over the head dimension, 4 floats (one float4 read) at a time; then scale (about 25 lines)
}

// May query `qpos` attend to key `kpos`? Both count from the start of their sequence.
__device__ __forceinline__ bool visible(int qpos, int kpos, int len) {
  // TODO stage 07: causal, and the key must lie inside the sequence (about 1 line)
  return false;
}

// o += P V for one key tile. This thread's outputs: rows ty + 16i, head dims tx*4 + 64g .. +3
// (threads whose dims fall past d sit out). P is [64 rows][kPPitch], V is [64 keys][d].
template <int kGroups>
__device__ __forceinline__ void accumulate_pv(const float* ps, const float* vs, int d, int ty,
                                              int tx, float4 (&o)[4][kGroups]) {
  // TODO stage 07: per 4 keys: this thread's 4 rows of P as float4s, then one float4 of V per key and group (about 21 lines)
}

// Max (or sum) over the 16 threads that share a row: lanes 0-15 or 16-31 of a warp.
__device__ __forceinline__ float row_max(float x) {
#pragma unroll
  for (int off = 8; off > 0; off /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}
__device__ __forceinline__ float row_sum(float x) {
#pragma unroll
  for (int off = 8; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// kD: the head dimension, or 0 to read it from p.head_dim (any multiple of 8 up to 128).
// Fixed sizes let the compiler unroll the dot products; the generic one serves the rest.
template <int kD>
__global__ void __launch_bounds__(kThreads) prefill_attention_kernel(Params p) {
  constexpr int kGroups = ((kD ? kD : kMaxHeadDim) + 63) / 64;  // float4s of output per row
  const int d = kD ? kD : p.head_dim;
  const int pitch = qk_pitch(d);
  extern __shared__ float4 smem[];
  float* qs = reinterpret_cast<float*>(smem);
  float* ks = qs + kBlockQ * pitch;
  float* vs = ks + kBlockK * pitch;
  float* ps = p_reuses_k(d) ? ks : vs + kBlockK * d;

  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
  const int h = blockIdx.y, seq = blockIdx.z;
  // The last tiles of a sequence see the most keys: start them first so they don't trail.
  const int q0 = (gridDim.x - 1 - blockIdx.x) * kBlockQ;
  const int start = p.cu_seqlens_q[seq];
  const int len_q = p.cu_seqlens_q[seq + 1] - start;
  if (q0 >= len_q) return;  // this sequence is shorter than the longest one
  const int start_k = p.cu_seqlens_k[seq];
  const int len = p.cu_seqlens_k[seq + 1] - start_k;  // keys; query i is at key position i + shift
  const int shift = len - len_q;

  // TODO stage 07: the KV head that serves query head h (grouped-query attention) (about 1 line)
  const int kv_head = 0;
  const __nv_bfloat16* q = p.q + start * p.q_stride + static_cast<int64_t>(h) * d;
  const __nv_bfloat16* k = p.k + start_k * p.k_stride + static_cast<int64_t>(kv_head) * d;
  const __nv_bfloat16* v = p.v + start_k * p.v_stride + static_cast<int64_t>(kv_head) * d;
  // Keys this tile can see: none past its last row (causal) or past the sequence.
  const int kv_end = min(q0 + kBlockQ + shift, len);
  const int qpos0 = q0 + shift;  // the key position of this tile's first query row

  load_tile(qs, pitch, q, p.q_stride, q0, len_q, d);
  float s[4][4];

  // Pass 1: the largest visible score of each of this thread's 4 rows, over all key tiles.
  float m[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
  // TODO stage 07: per key tile: load K, sync, scores, max over visible keys, sync; then the max across the row's 16 threads (about 13 lines)

  // Pass 2: p = exp2(s - m), the row sums l and o = sum_j p_j v_j.
  float l[4] = {0.f, 0.f, 0.f, 0.f};
  float4 o[4][kGroups];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int g = 0; g < kGroups; ++g) o[i][g] = make_float4(0.f, 0.f, 0.f, 0.f);
  // TODO stage 07: per key tile: load K and V, scores, P to shared memory (0 where not visible), accumulate_pv; then the row sums (about 24 lines)

  // TODO stage 07: o / l rounded to bf16, for the rows inside the sequence (l == 0: write 0, not NaN) (about 15 lines)
}

template <int kD>
tvllm_status launch(const Params& p, int n_seqs, int max_seqlen, cudaStream_t stream) {
  // TODO stage 07: a block per (64-query tile, head, sequence); allow more than 48 KB of dynamic shared memory (about 11 lines)
  return "TODO stage 07: a block per (64-query tile, head, sequence); allow more than 48 KB of dynamic shared memory (about 11 lines)";
}

}  // namespace

// q: [tokens, n_heads, head_dim], k, v: [tokens, n_kv_heads, head_dim], bf16, heads
// contiguous inside a token's row, rows `*_stride` elements apart (a multiple of 8), 16-byte
// aligned. out: [tokens, n_heads, head_dim] bf16, contiguous. cu_seqlens_q, cu_seqlens_k:
// [n_seqs + 1] int32 on the device, rising from 0 to the query (key) rows, with at least as
// many keys as queries in each sequence; max_seqlen is the longest query run (the caller knows
// it on the host: the kernel never makes the CPU wait).
tvllm_status launch_prefill_attention(const void* q, const void* k, const void* v, void* out,
                                      const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k,
                                      int n_seqs, int max_seqlen,
                                      int64_t q_stride, int64_t k_stride, int64_t v_stride,
                                      int n_heads, int n_kv_heads, int head_dim, float scale,
                                      cudaStream_t stream) {
  if (n_seqs == 0 || max_seqlen == 0 || n_heads == 0) return TVLLM_OK;
  if (n_kv_heads <= 0 || n_heads % n_kv_heads != 0)
    return "n_heads must be a positive multiple of n_kv_heads (grouped-query attention)";
  if (head_dim <= 0 || head_dim % 8 != 0 || head_dim > kMaxHeadDim)
    return "head_dim must be a multiple of 8, at most 128 (64 and 128 have tuned kernels)";
  if (n_heads > 65535 || n_seqs > 65535) return "at most 65535 heads and 65535 sequences";
  const Params p{static_cast<const __nv_bfloat16*>(q), static_cast<const __nv_bfloat16*>(k),
                 static_cast<const __nv_bfloat16*>(v), static_cast<__nv_bfloat16*>(out),
                 cu_seqlens_q, cu_seqlens_k, q_stride, k_stride, v_stride, n_heads, n_kv_heads, head_dim,
                 scale * kLog2e};
  switch (head_dim) {
    case 64: return launch<64>(p, n_seqs, max_seqlen, stream);
    case 128: return launch<128>(p, n_seqs, max_seqlen, stream);
    default: return launch<0>(p, n_seqs, max_seqlen, stream);
  }
}

// Stage 12 kernel, part 1: causal prefill attention with the online softmax, in plain float math.
//
//     out[t, h] = sum_j softmax_j(scale * q[t, h] . k[j, g]) v[j, g],   g = h / (n_heads / n_kv)
//
// Stage 07's contract (packed sequences, grouped-query heads, more keys than queries after a
// cached prefix: query i sits at key position i + len_k - len_q) and stage 07's answer; what
// changes is the pass over the keys. A block takes kRows query rows of one head of one
// sequence, a warp per row; the block stages the keys and values in shared memory a tile of
// kBlockN = 64 keys at a time, and each row folds the tile into its running state:
//
//     m  the largest score seen so far (starts at -inf),
//     l  the sum of exp(score - m) over the keys seen,
//     o  the sum of exp(score - m) v over the keys seen (unnormalised, kD floats),
//
// rescaling l and o by exp(m_old - m_new) when a tile raises the max. After the last tile
// out = o / l. One pass over the keys, and no row of scores longer than a tile anywhere.
// Tiles wholly in the future of the block's last row are never loaded (causal).
//
// Inside a warp, for one tile: lane j scores keys j and j + 32 (a dot product over kD dims,
// q from shared memory, the same address for every lane: a broadcast), and owns dims j,
// j + 32, ... of o. Each lane takes p of key n from lane n % 32 with a shuffle.
// flash_attention.cu (part 2) does the same on the tensor cores.
// Reference: flash_attention.py (flash_attention_native, the same tiles in torch).
// Run: python3 -m grader 12
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cmath>
#include <cstdint>

#include "prefill.cuh"
#include "tvllm.h"
#include "vec.cuh"

namespace {

using bf16 = __nv_bfloat16;

constexpr int kRows = 16;               // query rows a block: a warp each
constexpr int kThreads = 32 * kRows;
constexpr int kBlockN = 64;             // keys per shared-memory tile: 2 per lane
constexpr int kPad = 8;                 // bf16 after each staged row: see stage_tile

struct SimpleParams {
  const bf16* q;
  const bf16* k;
  const bf16* v;
  bf16* out;                     // [tokens, n_heads, head_dim], contiguous
  const int32_t* cu_seqlens_q;   // [n_seqs + 1]
  const int32_t* cu_seqlens_k;   // [n_seqs + 1]
  int64_t q_stride, k_stride, v_stride;  // elements from one token's row to the next
  int n_heads, n_kv_heads;
  float scale;
};

// Given: keys (or values) [row0, row0 + kBlockN) of one KV head -- `src` points at key 0 of
// this sequence and head -- into dst [kBlockN][kD + kPad], 16 bytes per thread and step. Rows
// at or past `len` are zeros (another sequence's keys, or none; 0 * NaN would be NaN). The
// padding puts row r + 1 16 bytes further along the banks than row r, so 32 lanes reading
// one 16-byte piece of 32 different rows hit every bank equally (unpadded rows of 128 or 256
// bytes would all start in bank 0). The caller syncs before and after.
template <int kD>
__device__ __forceinline__ void stage_tile(bf16 (*dst)[kD + kPad], const bf16* src,
                                           int64_t stride, int row0, int len) {
  constexpr int kPieces = kD / 8;
  for (int i = threadIdx.x; i < kBlockN * kPieces; i += kThreads) {
    const int r = i / kPieces, c = i % kPieces;
    uint4 piece = make_uint4(0, 0, 0, 0);
    if (row0 + r < len)
      piece = *reinterpret_cast<const uint4*>(src + static_cast<int64_t>(row0 + r) * stride + 8 * c);
    *reinterpret_cast<uint4*>(&dst[r][8 * c]) = piece;
  }
}

// Given: the score of one key (a staged row of kD bf16) for a query row held as kD floats,
// already times scale (qs: every lane reads the same float at once, a broadcast).
template <int kD>
__device__ __forceinline__ float dot_row(const float* qs, const bf16* key) {
  float s = 0.f;
#pragma unroll 4
  for (int c = 0; c < kD / 8; ++c) {
    const Pack<bf16, 8> kv = *reinterpret_cast<const Pack<bf16, 8>*>(key + 8 * c);
#pragma unroll
    for (int e = 0; e < 8; ++e) s = fmaf(qs[8 * c + e], to_float(kv.v[e]), s);
  }
  return s;
}

// Given: the largest x, or the sum of x, over the 32 lanes of the warp, in every lane.
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// Grid (n_heads, n_seqs, ceil(max_seqlen / kRows)), kThreads threads: block (h, seq, z) takes
// query rows [z kRows, z kRows + kRows) of head h of sequence seq, warp w row z kRows + w.
template <int kD>
__global__ void __launch_bounds__(kThreads)
flash_attention_simple_kernel(SimpleParams p) {
  __shared__ __align__(16) bf16 ks[kBlockN][kD + kPad];
  __shared__ __align__(16) bf16 vs[kBlockN][kD + kPad];
  __shared__ float qs[kRows][kD];
  constexpr int kDims = kD / 32;  // dims of o per lane: lane, lane + 32, ...
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int h = blockIdx.x, seq = blockIdx.y, q0 = blockIdx.z * kRows;
  const int start = p.cu_seqlens_q[seq], len_q = p.cu_seqlens_q[seq + 1] - start;
  if (q0 >= len_q) return;  // the whole block: this sequence is shorter than the longest
  const int start_k = p.cu_seqlens_k[seq], len = p.cu_seqlens_k[seq + 1] - start_k;
  const int row = q0 + warp;                 // this warp's query row in the sequence
  const bool active = row < len_q;           // the last block's other rows are padding
  const int qpos = row + len - len_q;        // its key position: it sees keys 0 .. qpos
  const bf16* q = p.q + static_cast<int64_t>(start + row) * p.q_stride + static_cast<int64_t>(h) * kD;
  if (active)
    for (int d = lane; d < kD; d += 32) qs[warp][d] = __bfloat162float(q[d]) * p.scale;
  float o[kDims] = {};
  float m = -INFINITY, l = 0.f;  // l: this lane's share, summed over the warp at the end
  // TODO stage 12: the KV head of head h (GQA) and its first key of the sequence in k and v; the tiles this block needs (none wholly past its last row's position, none past len); per tile: stage K and V (__syncthreads around), then each active row: scores of keys lane and lane + 32 (dot_row), -inf where invisible (past qpos or len), the tile's max (warp_max) into m, alpha = exp(m_old - m_new) (0 while m_new is -inf), p = exp(s - m_new), l and o rescaled by alpha plus this tile's p and p v (p of key n from lane n % 32, __shfl_sync) (about 32 lines)
  // TODO stage 12: active rows only: l summed over the warp (warp_sum); out[start + row, h, d] = o / l for this lane's dims, rounded to bf16 (l == 0: 0, not NaN) (about 6 lines)
}

template <int kD>
tvllm_status launch(const SimpleParams& p, int n_seqs, int max_seqlen, cudaStream_t stream) {
  // TODO stage 12: a block of kThreads per (head, sequence, kRows-query tile), grid in that order (the kernel reads blockIdx so); launch on stream (about 3 lines)
  return "TODO stage 12: a block of kThreads per (head, sequence, kRows-query tile), grid in that order (the kernel reads blockIdx so); launch on stream (about 3 lines)";
}

}  // namespace

// flash_attention.cu's launch_flash_attention's contract (q, k, v, out, offsets, strides,
// heads, head_dim 64 or 128, scale > 0), with scalar float math (no sm_80 instruction; the
// stage's min_cc, which part 2 needs, still leaves both out of a T4's build).
tvllm_status launch_flash_attention_simple(const void* q, const void* k, const void* v, void* out,
                                           const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k,
                                           int n_seqs, int max_seqlen,
                                           int64_t q_stride, int64_t k_stride, int64_t v_stride,
                                           int n_heads, int n_kv_heads, int head_dim, float scale,
                                           cudaStream_t stream) {
  if (n_seqs == 0 || max_seqlen == 0 || n_heads == 0) return TVLLM_OK;
  if (const tvllm_status refused = prefill_refusal(n_heads, n_kv_heads, head_dim, scale))
    return refused;
  if (n_seqs > 65535 || tvllm_ceil_div(max_seqlen, kRows) > 65535)
    return "at most 65535 sequences and 1048560 queries in one";
  const SimpleParams p{static_cast<const bf16*>(q), static_cast<const bf16*>(k),
                       static_cast<const bf16*>(v), static_cast<bf16*>(out), cu_seqlens_q,
                       cu_seqlens_k, q_stride, k_stride, v_stride, n_heads, n_kv_heads, scale};
  return head_dim == 64 ? launch<64>(p, n_seqs, max_seqlen, stream)
                        : launch<128>(p, n_seqs, max_seqlen, stream);
}

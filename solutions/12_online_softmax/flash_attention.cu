// Stage 12 kernel, part 2: FlashAttention-2-style causal prefill attention on the tensor cores.
//
//     out[t, h] = sum_j softmax_j(scale * q[t, h] . k[j, g]) v[j, g],   g = h / (n_heads / n_kv)
//
// Same contract as stage 07 (attention.cu) and part 1 (flash_attention_simple.cu, the same
// online softmax in float math, a warp per query row): packed sequences (cu_seqlens_q, cu_seqlens_k),
// grouped-query heads, a sequence may bring more keys than queries (its queries are its LAST
// positions: query i sits at key position i + len_k - len_q), q/k/v may be views of a fused
// QKV tensor. What changes is how the work is done:
//
//   - ONE pass over the keys. Each row keeps a running max m, a running sum l and an
//     unnormalised output o (the online softmax); when a tile raises the max, l and o are
//     rescaled by exp2(m_old - m_new). Stage 07 computed every score twice.
//   - The products run on the tensor cores: mma.sync m16n8k16 (bf16 in, float32 accumulate)
//     for S = Q K^T and for O += P V. Stage 07 did scalar float32 FMAs.
//
// One block of 8 warps computes a tile of 128 query rows of one head of one sequence; warp w
// owns rows 16w .. 16w+15 and keeps everything about them in registers: its Q fragments, its
// 16 x 64 score tile, m, l and o. K and V tiles of 64 keys are staged in shared memory as
// bf16 with cp.async, double-buffered: tile j+1 is in flight while tile j is computed. The
// [T, T] score matrix never exists anywhere: a warp's scores live in registers for one tile.
// Short sequences (at most kShortTile = 1024 queries) take tiles of 64 rows and 4 warps
// instead: at 512 tokens a 128-row block visits 2 to 8 key tiles, so a grid of them ends in a
// ragged last wave; blocks of half the work, twice as many, fill the SMs more evenly.
//
// Fragment layouts (PTX ISA, "mma.m16n8k16"; the wrappers ldmatrix_x4, ldmatrix_x4_trans and
// mma_bf16 are in course/cuda/mma.cuh, shared with stage 14, pack_bf16 in vec.cuh):
// lane = 4 g + t (g = lane / 4, t = lane % 4).
//   A (16 x 16, row-major), 4 registers of 2 bf16: (g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..),
//     (g+8, 2t+8..).
//   B (16 x 8, "col": 8 columns of 16), 2 registers: (k 2t..2t+1, n g), (k 2t+8.., n g).
//   C (16 x 8, float32), 4 floats: (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1).
// K's rows in shared memory are keys of d contiguous dims: exactly B of S = Q K^T (n = key,
// k = dim), so ldmatrix reads it as is. V's rows are keys too, but for O += P V the keys are
// the k index: ldmatrix.trans transposes 8 x 8 pieces on the way. And the C fragments of two
// neighbouring 8-key score tiles are, element for element, the A fragment of P for those 16
// keys: P goes from the softmax to the second product without leaving registers.
//
// Softmax in base 2: exp(x) = exp2(x log2 e); the launcher folds log2 e into the scale, and the
// softmax applies it inside the exponent, p = exp2(s c - m c) with c = scale log2 e: one FFMA
// per score instead of a multiply and a subtract (the max of raw scores is the max of scaled
// ones because c > 0; prefill_attention sends a scale <= 0 to stage 07's kernel).
// Reference: flash_attention.py (flash_attention_native, the same tiles in torch).
// Run: nox -s grade -- 12
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cmath>
#include <cstdint>

#include "cp_async.cuh"
#include "exp2.cuh"
#include "mma.cuh"
#include "prefill.cuh"
#include "swizzle.cuh"
#include "tvllm.h"

namespace {

using bf16 = __nv_bfloat16;

// A block computes kM query rows (the kernels' template argument): 128, or 64 for sequences
// of at most kShortTile queries. Each warp owns 16 rows: 8 warps (256 threads) or 4.
constexpr int kShortTile = 1024;
constexpr int kBlockN = 64;             // keys per shared-memory tile
constexpr int kNTiles = kBlockN / 8;    // 8-key column tiles of a warp's 16 x 64 scores
constexpr float kLog2e = 1.4426950408889634f;

struct Params {
  const bf16* q;
  const bf16* k;
  const bf16* v;
  bf16* out;                     // [tokens, n_heads, head_dim], contiguous
  const int32_t* cu_seqlens_q;   // [n_seqs + 1]
  const int32_t* cu_seqlens_k;   // [n_seqs + 1]
  int64_t q_stride, k_stride, v_stride;  // elements from one token's row to the next
  int n_heads, n_kv_heads;
  float scale_log2;              // scale * log2(e), positive
};

// Shared memory, bf16: the Q tile [kM][d], then two K tiles and two V tiles [64][d], every
// row's 16-byte chunks swizzled (swizzle.cuh's swizzled: ldmatrix reads 8 rows of 16 bytes at
// once, and unswizzled rows of 128 or 256 bytes would put all 8 in the same 4 banks).
template <int kD, int kM>
struct Smem {
  static constexpr int kTileK = kBlockN * kD;                 // elements of one K or V tile
  static constexpr int kBytes = (kM * kD + 4 * kTileK) * 2;   // kM 128: 48 KB (d 64), 96 KB (d 128)
  static constexpr int kThreads = 2 * kM;                     // 32 per 16 rows
};

// ---------------------------------------------------------------- the tile loader (given)

// Rows [row0, row0 + kRows) of one head -- `src` points at row 0 of this sequence and head --
// into shared memory (swizzled) with 16-byte cp.async, spread over the block. Rows at or
// past `len` belong to another sequence or to nothing: they are filled with zeros (0 * NaN
// would be NaN). Asynchronous: commit, wait and __syncthreads before anyone reads the tile.
template <int kRows, int kD, int kThreads>
__device__ __forceinline__ void load_tile(bf16* dst, const bf16* src, int64_t stride, int row0,
                                          int len) {
  constexpr int kChunks = kD / 8;  // 16-byte pieces per row
  static_assert(kRows * kChunks % kThreads == 0 && kThreads % kChunks == 0,
                "every thread loads the same number of pieces, of the same columns");
  // Thread x copies piece x % kChunks of rows x / kChunks, + kRowStep, ...: one 64-bit multiply
  // per call, then a pointer step per piece (the loop's address arithmetic is per tile). The
  // rows are kRowStep apart, a multiple of 8: the piece's swizzled place is the same in each.
  constexpr int kRowStep = kThreads / kChunks;
  static_assert(kRowStep % 8 == 0, "a thread's rows share their swizzle");
  const int r0 = threadIdx.x / kChunks, col = (threadIdx.x % kChunks) * 8;
  bf16* to = dst + swizzled<kD>(r0, col / 8);
  const int64_t step = static_cast<int64_t>(kRowStep) * stride;
  const bf16* from = src + static_cast<int64_t>(row0 + r0) * stride + col;
#pragma unroll
  for (int i = 0; i < kRows * kChunks / kThreads; ++i, from += step) {
    const int r = r0 + i * kRowStep;
    const bool valid = row0 + r < len;
    copy16(reinterpret_cast<uint4*>(to + i * kRowStep * kD), valid ? from : src, valid);
  }
}

// ------------------------------------- the fragments (given: mma.sync's lane tables at work)

// S = Q K^T for this warp's 16 query rows and the 64 keys of the tile `ks` ([64][d], swizzled), not
// yet scaled (online_softmax does that). s[j] is the C fragment of keys 8j .. 8j + 7: this
// lane holds rows g and g + 8, keys 8j + 2t and 8j + 2t + 1. qf[kk] is the A fragment of Q's
// dims 16kk .. 16kk + 15.
template <int kD>
__device__ __forceinline__ void tile_scores(const uint32_t (&qf)[kD / 16][4], const bf16* ks,
                                            int lane, float (&s)[kNTiles][4]) {
#pragma unroll
  for (int j = 0; j < kNTiles; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
  // Lanes 0-7: keys 0-7, dims 0-7 (b0 of key tile j); 8-15: keys 0-7, dims 8-15 (its b1);
  // 16-23: keys 8-15, dims 0-7 (b0 of tile j + 1); 24-31: keys 8-15, dims 8-15.
  // Chunk 2kk + half of the row sits at chunk0 ^ 2kk (chunk0: that of chunk half), in every
  // 16th row alike: the address for (kk, j) is base with bits flipped, 8j rows further.
  const int row = (lane % 8) + 8 * (lane / 16), half = (lane / 8) % 2;
  const uint32_t base = smem_addr(ks + swizzled<kD>(row, half));
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk)
#pragma unroll
    for (int j = 0; j < kNTiles; j += 2) {
      uint32_t b[4];
      ldmatrix_x4(b, (base ^ (kk * 32)) + j * 8 * kD * 2);
      mma_bf16(s[j], qf[kk], b[0], b[1]);
      mma_bf16(s[j + 1], qf[kk], b[2], b[3]);
    }
}

// ------------------------------------------------------------------- the student's parts

// May the query at key position `qpos` see key position `kpos`? Both count from the start of
// the sequence's keys; `len` is the number of keys.
__device__ __forceinline__ bool visible(int qpos, int kpos, int len) {
  // BEGIN SOLUTION: causal (aligned to the end of the keys: qpos already is), and inside the sequence | return false;
  return kpos <= qpos && kpos < len;
  // END SOLUTION
}

// Scores a row may not see become -inf (exp2(-inf) = 0). qpos: the key position of row g
// (row g + 8 is qpos + 8); kpos0: the key position of the tile's first key.
__device__ __forceinline__ void mask_scores(float (&s)[kNTiles][4], int qpos, int kpos0, int len,
                                            int lane) {
  const int t = lane % 4;
#pragma unroll
  for (int j = 0; j < kNTiles; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (!visible(qpos + 8 * (e / 2), kpos0 + 8 * j + 2 * t + (e % 2), len)) s[j][e] = -INFINITY;
}

// The online softmax: fold one tile of scores (masked, not scaled) into the running state of
// this lane's two rows, r = 0 for row g, r = 1 for row g + 8; c = scale_log2 (positive):
//   m[r]  the row's running max of the raw scores (the same in the row's 4 lanes),
//   l[r]  this lane's share of the running sum (its 2 columns of each key tile; the 4 lanes
//         of a row are added up once, at the end),
//   o     the unnormalised output, C fragments of dims 8i .. 8i + 7 (o[i][2r], o[i][2r + 1]).
// On return s holds p = exp2(s c - m_new c) (one FFMA and one exp2 each), ready to become P.
template <int kD>
__device__ __forceinline__ void online_softmax(float (&s)[kNTiles][4], float scale_log2,
                                               float (&m)[2], float (&l)[2],
                                               float (&o)[kD / 8][4]) {
  // BEGIN SOLUTION: per row: the tile's max, reduced over the row's 4 lanes (shuffles 1 and 2); shift = m_new c; alpha = exp2(m_old c - shift); p = exp2(s c - shift) (fmaf); rescale l and o by alpha; l += sum p
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = m[r];
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    // Nothing visible yet: mx = -inf, and -inf - -inf would be NaN. Any finite base works then
    // (every p is exp2(-inf) = 0, and so is alpha).
    const float shift = (mx == -INFINITY ? 0.f : mx) * scale_log2;
    const float alpha = fast_exp2(fmaf(m[r], scale_log2, -shift));  // m[r] = -inf (first tile): 0
    m[r] = mx;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
      s[j][2 * r] = fast_exp2(fmaf(s[j][2 * r], scale_log2, -shift));
      s[j][2 * r + 1] = fast_exp2(fmaf(s[j][2 * r + 1], scale_log2, -shift));
      sum += s[j][2 * r] + s[j][2 * r + 1];
    }
    l[r] = l[r] * alpha + sum;
#pragma unroll
    for (int i = 0; i < kD / 8; ++i) {
      o[i][2 * r] *= alpha;
      o[i][2 * r + 1] *= alpha;
    }
  }
  // END SOLUTION
}

// o += P V for one tile: P (16 x 64, in s as float) becomes bf16 A fragments, 16 keys at a
// time; V (`vs`, [64 keys][d], swizzled) is read with ldmatrix.trans as B fragments of 8 dims.
template <int kD>
__device__ __forceinline__ void accumulate_pv(const float (&s)[kNTiles][4], const bf16* vs,
                                              int lane, float (&o)[kD / 8][4]) {
  // Lanes 0-7: keys 0-7, dims 0-7 (b0 of dim tile i); 8-15: keys 8-15, dims 0-7 (its b1);
  // 16-23: keys 0-7, dims 8-15 (b0 of dim tile i + 1); 24-31: keys 8-15, dims 8-15.
  const int row = (lane % 8) + 8 * ((lane / 8) % 2), half = lane / 16;
  const uint32_t base = smem_addr(vs + swizzled<kD>(row, half));  // chunk i + half: chunk0 ^ i
#pragma unroll
  for (int kk = 0; kk < kBlockN / 16; ++kk) {
    const uint32_t a[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]),
                           pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                           pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                           pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
    for (int i = 0; i < kD / 8; i += 2) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, (base ^ (i * 16)) + kk * 16 * kD * 2);
      mma_bf16(o[i], a, b[0], b[1]);
      mma_bf16(o[i + 1], a, b[2], b[3]);
    }
  }
}

// kM 128: 2 blocks per SM at d 64 (by registers), 1 at d 128; kM 64: 4 and 2 (by shared memory).
template <int kD, int kM>
__global__ void __launch_bounds__(Smem<kD, kM>::kThreads, (kD <= 64 ? 2 : 1) * (kM == 64 ? 2 : 1))
flash_attention_kernel(Params p) {
  constexpr int kThreads = Smem<kD, kM>::kThreads;
  extern __shared__ __align__(1024) uint4 smem[];  // aligned: the swizzle's XOR addressing
  bf16* qs = reinterpret_cast<bf16*>(smem);
  bf16* ks = qs + kM * kD;                    // K tiles: buffers 0 and 1
  bf16* vs = ks + 2 * Smem<kD, kM>::kTileK;   // V tiles: buffers 0 and 1

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // The grid runs x fastest: every (head, sequence) of the last tile row, which sees the most
  // keys, starts before any block of the tile row before it (longest first), so the grid's
  // last wave is made of the shortest blocks.
  const int h = blockIdx.x, seq = blockIdx.y;
  const int q0 = (gridDim.z - 1 - blockIdx.z) * kM;
  const int start = p.cu_seqlens_q[seq];
  const int len_q = p.cu_seqlens_q[seq + 1] - start;
  if (q0 >= len_q) return;  // this sequence is shorter than the longest one
  const int start_k = p.cu_seqlens_k[seq];
  const int len = p.cu_seqlens_k[seq + 1] - start_k;  // keys; query i is at key position i + shift
  const int shift = len - len_q;

  // BEGIN SOLUTION: the KV head of query head h (GQA), and how many key tiles this block visits (none wholly past its last row) | const int kv_head = 0, n_tiles = 0;
  const int kv_head = h / (p.n_heads / p.n_kv_heads);
  const int kv_end = min(q0 + kM + shift, len);  // keys past this are in every row's future
  const int n_tiles = (kv_end + kBlockN - 1) / kBlockN;
  // END SOLUTION
  const bf16* q = p.q + start * p.q_stride + static_cast<int64_t>(h) * kD;
  const bf16* k = p.k + start_k * p.k_stride + static_cast<int64_t>(kv_head) * kD;
  const bf16* v = p.v + start_k * p.v_stride + static_cast<int64_t>(kv_head) * kD;
  const int row0 = warp * 16;                            // this warp's first row in the tile
  const int first_pos = q0 + row0 + shift;               // key position of that row
  const int qpos = first_pos + lane / 4;                 // ... and of this lane's row g

  // Q and the first K/V tile, then Q into registers: A fragments, 16 dims each.
  load_tile<kM, kD, kThreads>(qs, q, p.q_stride, q0, len_q);
  load_tile<kBlockN, kD, kThreads>(ks, k, p.k_stride, 0, len);
  load_tile<kBlockN, kD, kThreads>(vs, v, p.v_stride, 0, len);
  copies_commit();
  copies_wait<0>();
  __syncthreads();
  uint32_t qf[kD / 16][4];
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk)  // chunk 2kk + lane / 16 of row row0 + lane % 16
    ldmatrix_x4(qf[kk], smem_addr(qs + swizzled<kD>(row0 + lane % 16, lane / 16)) ^ (kk * 32));

  float o[kD / 8][4];
#pragma unroll
  for (int i = 0; i < kD / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.f, 0.f};

  // BEGIN SOLUTION: per key tile j < n_tiles, in buffer j % 2 (tile 0 is loaded above): prefetch tile j + 1 into the other buffer (load_tile of K and V, copies_commit) and wait for tile j only (copies_wait<1>; at the last tile copies_wait<0>); __syncthreads; unless the tile lies wholly in the future of the warp's last row (a warp-uniform skip): tile_scores, mask_scores only where the tile crosses the warp's first row's diagonal or the end of the keys, online_softmax, accumulate_pv; __syncthreads before the next prefetch overwrites this buffer
  for (int j = 0; j < n_tiles; ++j) {
    const int buf = j % 2;
    if (j + 1 < n_tiles) {  // prefetch tile j + 1 into the other buffer while tile j computes
      load_tile<kBlockN, kD, kThreads>(ks + (1 - buf) * Smem<kD, kM>::kTileK, k, p.k_stride, (j + 1) * kBlockN, len);
      load_tile<kBlockN, kD, kThreads>(vs + (1 - buf) * Smem<kD, kM>::kTileK, v, p.v_stride, (j + 1) * kBlockN, len);
      copies_commit();
      copies_wait<1>();  // everything but the newest group (tile j + 1) has landed
    } else {
      copies_wait<0>();
    }
    __syncthreads();  // every thread's share of tile j is in shared memory

    const int n0 = j * kBlockN;
    // Warp-uniform: a tile wholly in the future of the warp's last row is skipped (causal).
    if (n0 <= first_pos + 15) {
      float s[kNTiles][4];
      tile_scores<kD>(qf, ks + buf * Smem<kD, kM>::kTileK, lane, s);
      // Only tiles that cross the diagonal of the warp's first row, or the end of the keys,
      // hold invisible keys.
      if (n0 + kBlockN - 1 > first_pos || n0 + kBlockN > len) mask_scores(s, qpos, n0, len, lane);
      online_softmax<kD>(s, p.scale_log2, m, l, o);
      accumulate_pv<kD>(s, vs + buf * Smem<kD, kM>::kTileK, lane, o);
    }
    __syncthreads();  // all warps are done with buffer `buf` before iteration j + 1 refills it
  }
  // END SOLUTION

  // BEGIN SOLUTION: per row: the sum over its 4 lanes; out = o / l rounded to bf16 for rows inside the sequence (l == 0: write 0, not NaN)
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = l[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    const int row = q0 + row0 + lane / 4 + 8 * r;
    if (row >= len_q) continue;  // padding rows of the last tile: another sequence's rows
    bf16* dst = p.out + (static_cast<int64_t>(start + row) * p.n_heads + h) * kD + 2 * (lane % 4);
#pragma unroll
    for (int i = 0; i < kD / 8; ++i)
      *reinterpret_cast<__nv_bfloat162*>(dst + 8 * i) =
          __floats2bfloat162_rn(o[i][2 * r] * inv, o[i][2 * r + 1] * inv);
  }
  // END SOLUTION
}

template <int kD, int kM>
tvllm_status launch(const Params& p, int n_seqs, int max_seqlen, cudaStream_t stream) {
  // Given: the shared memory above the 48 KB a kernel gets without asking
  constexpr int smem = Smem<kD, kM>::kBytes;
  cudaError_t err = cudaFuncSetAttribute(flash_attention_kernel<kD, kM>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear it: the message goes back through the return value
    return cudaGetErrorString(err);
  }
  dim3 grid;
  // BEGIN SOLUTION: the grid: a block per (head, sequence, kM-query tile), in that order (the kernel reads blockIdx so) | return "{todo}";
  grid = dim3(p.n_heads, n_seqs, static_cast<unsigned>(tvllm_ceil_div(max_seqlen, kM)));
  // END SOLUTION
  flash_attention_kernel<kD, kM><<<grid, Smem<kD, kM>::kThreads, smem, stream>>>(p);
  return TVLLM_OK;
}

}  // namespace

// q: [tokens, n_heads, head_dim], k, v: [tokens, n_kv_heads, head_dim], bf16, heads
// contiguous inside a token's row, rows `*_stride` elements apart (a multiple of 8), 16-byte
// aligned. out: [tokens, n_heads, head_dim] bf16, contiguous. cu_seqlens_q, cu_seqlens_k:
// [n_seqs + 1] int32 on the device, rising from 0, with at least as many keys as queries in
// each sequence; max_seqlen is the longest query run (known on the host: the kernel never
// makes the CPU wait). head_dim 64 or 128 (flash_attention.py sends the others to stage 07).
tvllm_status launch_flash_attention(const void* q, const void* k, const void* v, void* out,
                                    const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k,
                                    int n_seqs, int max_seqlen,
                                    int64_t q_stride, int64_t k_stride, int64_t v_stride,
                                    int n_heads, int n_kv_heads, int head_dim, float scale,
                                    cudaStream_t stream) {
  if (n_seqs == 0 || max_seqlen == 0 || n_heads == 0) return TVLLM_OK;
  if (const tvllm_status refused = prefill_refusal(n_heads, n_kv_heads, head_dim, scale))
    return refused;
  if (n_seqs > 65535 || tvllm_ceil_div(max_seqlen, 64) > 65535)
    return "at most 65535 sequences and 4194240 queries in one";
  const Params p{static_cast<const bf16*>(q), static_cast<const bf16*>(k),
                 static_cast<const bf16*>(v), static_cast<bf16*>(out),
                 cu_seqlens_q, cu_seqlens_k, q_stride, k_stride, v_stride, n_heads, n_kv_heads,
                 scale * kLog2e};
  // Short sequences in 64-row tiles (see kShortTile), longer ones in 128-row tiles.
  const auto by_tile = max_seqlen <= kShortTile
                           ? (head_dim == 64 ? launch<64, 64> : launch<128, 64>)
                           : (head_dim == 64 ? launch<64, 128> : launch<128, 128>);
  return by_tile(p, n_seqs, max_seqlen, stream);
}

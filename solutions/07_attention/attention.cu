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
// One block computes a tile of query rows of one head of one sequence. It streams that
// sequence's keys through shared memory in tiles of as many keys, twice:
//   pass 1: scores -> each row's maximum m, so softmax can use exp(s - m) <= 1 (no overflow);
//   pass 2: scores again -> p = exp(s - m), the row sums l, and o += p V;
// then writes o / l. Recomputing the scores costs less than keeping them: 64 rows of 4096
// float scores are 1 MB, far more than shared memory. Stage 12 merges the passes (the online
// softmax) and moves the products to tensor cores.
// The tile is 64 rows where its shared memory fits the GPU (about 98 KB at head_dim 128: an
// A100 or H100 allows 163 or 227 KB per block), else 32 rows (49 KB at 128, under a T4's 64 KB):
// kTile is a template parameter and the launcher picks it (launch_tile). Write the code below
// for any kTile: a thread owns kR = kTile / 16 rows and keys of a tile.
// Math is float32 (bf16 in, widened in shared memory, bf16 out, rounded once). Softmax runs
// in base 2: exp(x) = exp2(x log2 e), and exp2f is one instruction, so log2 e is folded into
// the scale. 256 threads form a 16 x 16 grid: thread (ty, tx) owns rows ty + 16i and keys
// tx + 16j (i, j < kR) of a score tile; the 16 threads of a row are 16 lanes of one warp, so a
// row's max and sum take 4 shuffles.
// q, k, v may be views of a fused QKV tensor: any token (row) stride, heads contiguous.
// Reference: attention.py (attention_native). Run: nox -s grade -- 07
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>

#include "tvllm.h"

namespace {

constexpr int kLargeTile = 64;  // query rows per block, and keys per shared-memory tile ...
constexpr int kSmallTile = 32;  // ... or these, where the large tile's shared memory won't fit
constexpr int kThreads = 256;   // a 16 x 16 grid of threads
constexpr int kPad = 4;         // floats after each Q/K row: float4 reads of 8 rows hit 8 banks
constexpr int kMaxHeadDim = 128;
constexpr float kLog2e = 1.4426950408889634f;

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

// Shared memory in floats for a tile of `tile` rows: Q and K tiles (row pitch d + kPad), the
// V tile (pitch d), and the probabilities P (pitch tile + kPad). P takes K's place when that
// is large enough: K is dead once a tile's scores are in registers.
__host__ __device__ constexpr int qk_pitch(int d) { return d + kPad; }
__host__ __device__ constexpr int p_pitch(int tile) { return tile + kPad; }
__host__ __device__ constexpr bool p_reuses_k(int tile, int d) {
  return p_pitch(tile) <= qk_pitch(d);
}
__host__ __device__ constexpr int64_t smem_floats(int tile, int d) {
  return int64_t{2} * tile * qk_pitch(d) + int64_t{tile} * d +
         (p_reuses_k(tile, d) ? 0 : int64_t{tile} * p_pitch(tile));
}
__host__ __device__ constexpr int64_t smem_bytes(int tile, int d) {
  return smem_floats(tile, d) * static_cast<int64_t>(sizeof(float));
}
// What the lesson promises: the large tile fits an sm_80 GPU (163 KB) at any head_dim, and
// the small one a T4 (64 KB).
static_assert(smem_bytes(kLargeTile, kMaxHeadDim) <= 163 * 1024, "64 rows must fit an A100");
static_assert(smem_bytes(kSmallTile, kMaxHeadDim) <= 64 * 1024, "32 rows must fit a T4");

__device__ __forceinline__ float elem(const float4& v, int e) {
  return e == 0 ? v.x : e == 1 ? v.y : e == 2 ? v.z : v.w;
}

// Rows [row0, row0 + kTile) of one head -- `src` points at row 0 of this sequence and head --
// from bf16 in global memory to float in shared memory. Rows at or past `len` are another
// sequence's (or nobody's): they become zeros, never garbage, because 0 * NaN is NaN.
template <int kTile>
__device__ __forceinline__ void load_tile(float* dst, int pitch, const __nv_bfloat16* src,
                                          int64_t stride, int row0, int len, int d) {
  // BEGIN SOLUTION: 16-byte loads (8 bf16) spread over the block, widened to float; zeros for rows >= len
  const int chunks = d / 8;  // 16-byte pieces per row
  for (int c = threadIdx.x; c < kTile * chunks; c += kThreads) {
    const int r = c / chunks, col = (c - r * chunks) * 8;
    float f[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (row0 + r < len) {
      const uint4 raw = *reinterpret_cast<const uint4*>(src + (row0 + r) * stride + col);
      const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 two = __bfloat1622float2(pairs[e]);
        f[2 * e] = two.x;
        f[2 * e + 1] = two.y;
      }
    }
    float4* row = reinterpret_cast<float4*>(dst + r * pitch + col);
    row[0] = make_float4(f[0], f[1], f[2], f[3]);
    row[1] = make_float4(f[4], f[5], f[6], f[7]);
  }
  // END SOLUTION
}

// This thread's kR x kR scores of the tile: s[i][j] = (Q row ty+16i) . (K row tx+16j) * scale_log2.
template <int kR>
__device__ __forceinline__ void tile_scores(const float* qs, const float* ks, int pitch, int d,
                                            int ty, int tx, float scale_log2, float (&s)[kR][kR]) {
  // BEGIN SOLUTION: dot products over the head dimension, 4 floats (one float4 read) at a time; then scale
#pragma unroll
  for (int i = 0; i < kR; ++i)
#pragma unroll
    for (int j = 0; j < kR; ++j) s[i][j] = 0.f;
#pragma unroll 4
  for (int c = 0; c < d; c += 4) {
    float4 a[kR], b[kR];
#pragma unroll
    for (int i = 0; i < kR; ++i) a[i] = *reinterpret_cast<const float4*>(qs + (ty + 16 * i) * pitch + c);
#pragma unroll
    for (int j = 0; j < kR; ++j) b[j] = *reinterpret_cast<const float4*>(ks + (tx + 16 * j) * pitch + c);
#pragma unroll
    for (int i = 0; i < kR; ++i)
#pragma unroll
      for (int j = 0; j < kR; ++j) {
        s[i][j] = fmaf(a[i].x, b[j].x, s[i][j]);
        s[i][j] = fmaf(a[i].y, b[j].y, s[i][j]);
        s[i][j] = fmaf(a[i].z, b[j].z, s[i][j]);
        s[i][j] = fmaf(a[i].w, b[j].w, s[i][j]);
      }
  }
#pragma unroll
  for (int i = 0; i < kR; ++i)
#pragma unroll
    for (int j = 0; j < kR; ++j) s[i][j] *= scale_log2;
  // END SOLUTION
}

// May query `qpos` attend to key `kpos`? Both count from the start of their sequence.
__device__ __forceinline__ bool visible(int qpos, int kpos, int len) {
  // BEGIN SOLUTION: causal, and the key must lie inside the sequence | return false;
  return kpos <= qpos && kpos < len;
  // END SOLUTION
}

// o += P V for one key tile. This thread's outputs: rows ty + 16i (i < kR), head dims
// tx*4 + 64g .. +3 (threads whose dims fall past d sit out). P is [kTile rows][p_pitch(kTile)],
// V is [kTile keys][d].
template <int kTile, int kGroups>
__device__ __forceinline__ void accumulate_pv(const float* ps, const float* vs, int d, int ty,
                                              int tx, float4 (&o)[kTile / 16][kGroups]) {
  constexpr int kR = kTile / 16, kPPitch = p_pitch(kTile);
  // BEGIN SOLUTION: per 4 keys: this thread's kR rows of P as float4s, then one float4 of V per key and group
  for (int j = 0; j < kTile; j += 4) {
    float4 pa[kR];
#pragma unroll
    for (int i = 0; i < kR; ++i) pa[i] = *reinterpret_cast<const float4*>(ps + (ty + 16 * i) * kPPitch + j);
#pragma unroll
    for (int e = 0; e < 4; ++e)
#pragma unroll
      for (int g = 0; g < kGroups; ++g) {
        const int c = tx * 4 + 64 * g;
        if (c >= d) continue;
        const float4 vb = *reinterpret_cast<const float4*>(vs + (j + e) * d + c);
#pragma unroll
        for (int i = 0; i < kR; ++i) {
          const float pv = elem(pa[i], e);
          o[i][g].x = fmaf(pv, vb.x, o[i][g].x);
          o[i][g].y = fmaf(pv, vb.y, o[i][g].y);
          o[i][g].z = fmaf(pv, vb.z, o[i][g].z);
          o[i][g].w = fmaf(pv, vb.w, o[i][g].w);
        }
      }
  }
  // END SOLUTION
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
// kTile: query rows per block and keys per tile, 64 or 32 (launch_tile picks it).
template <int kD, int kTile>
__global__ void __launch_bounds__(kThreads) prefill_attention_kernel(Params p) {
  constexpr int kGroups = ((kD ? kD : kMaxHeadDim) + 63) / 64;  // float4s of output per row
  constexpr int kR = kTile / 16;                                 // rows (keys) per thread
  constexpr int kPPitch = p_pitch(kTile);
  const int d = kD ? kD : p.head_dim;
  const int pitch = qk_pitch(d);
  extern __shared__ float4 smem[];
  float* qs = reinterpret_cast<float*>(smem);
  float* ks = qs + kTile * pitch;
  float* vs = ks + kTile * pitch;
  float* ps = p_reuses_k(kTile, d) ? ks : vs + kTile * d;

  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
  const int h = blockIdx.y, seq = blockIdx.z;
  // The last tiles of a sequence see the most keys: start them first so they don't trail.
  const int q0 = (gridDim.x - 1 - blockIdx.x) * kTile;
  const int start = p.cu_seqlens_q[seq];
  const int len_q = p.cu_seqlens_q[seq + 1] - start;
  if (q0 >= len_q) return;  // this sequence is shorter than the longest one
  const int start_k = p.cu_seqlens_k[seq];
  const int len = p.cu_seqlens_k[seq + 1] - start_k;  // keys; query i is at key position i + shift
  const int shift = len - len_q;

  // BEGIN SOLUTION: the KV head that serves query head h (grouped-query attention) | const int kv_head = 0;
  const int kv_head = h / (p.n_heads / p.n_kv_heads);
  // END SOLUTION
  const __nv_bfloat16* q = p.q + start * p.q_stride + static_cast<int64_t>(h) * d;
  const __nv_bfloat16* k = p.k + start_k * p.k_stride + static_cast<int64_t>(kv_head) * d;
  const __nv_bfloat16* v = p.v + start_k * p.v_stride + static_cast<int64_t>(kv_head) * d;
  // Keys this tile can see: none past its last row (causal) or past the sequence.
  const int kv_end = min(q0 + kTile + shift, len);
  const int qpos0 = q0 + shift;  // the key position of this tile's first query row

  load_tile<kTile>(qs, pitch, q, p.q_stride, q0, len_q, d);
  float s[kR][kR];

  // Pass 1: the largest visible score of each of this thread's kR rows, over all key tiles.
  float m[kR];
#pragma unroll
  for (int i = 0; i < kR; ++i) m[i] = -INFINITY;
  // BEGIN SOLUTION: per key tile: load K, sync, scores, max over visible keys, sync; then the max across the row's 16 threads
  for (int k0 = 0; k0 < kv_end; k0 += kTile) {
    load_tile<kTile>(ks, pitch, k, p.k_stride, k0, len, d);
    __syncthreads();  // the tile (and, the first time, Q) is in shared memory
    tile_scores(qs, ks, pitch, d, ty, tx, p.scale_log2, s);
#pragma unroll
    for (int i = 0; i < kR; ++i)
#pragma unroll
      for (int j = 0; j < kR; ++j)
        if (visible(qpos0 + ty + 16 * i, k0 + tx + 16 * j, len)) m[i] = fmaxf(m[i], s[i][j]);
    __syncthreads();  // everyone is done with this K tile before the next one overwrites it
  }
#pragma unroll
  for (int i = 0; i < kR; ++i) m[i] = row_max(m[i]);
  // END SOLUTION

  // Pass 2: p = exp2(s - m), the row sums l and o = sum_j p_j v_j.
  float l[kR];
  float4 o[kR][kGroups];
#pragma unroll
  for (int i = 0; i < kR; ++i) {
    l[i] = 0.f;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) o[i][g] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  // BEGIN SOLUTION: per key tile: load K and V, scores, P to shared memory (0 where not visible), accumulate_pv; then the row sums
  for (int k0 = 0; k0 < kv_end; k0 += kTile) {
    load_tile<kTile>(ks, pitch, k, p.k_stride, k0, len, d);
    load_tile<kTile>(vs, d, v, p.v_stride, k0, len, d);
    __syncthreads();
    tile_scores(qs, ks, pitch, d, ty, tx, p.scale_log2, s);
    __syncthreads();  // every score is in registers: P may overwrite K
#pragma unroll
    for (int i = 0; i < kR; ++i) {
      // A row that sees no key keeps m = -inf; exp2(s - (-inf)) would be inf, so use 0.
      const float base = m[i] == -INFINITY ? 0.f : m[i];
#pragma unroll
      for (int j = 0; j < kR; ++j) {
        const bool seen = visible(qpos0 + ty + 16 * i, k0 + tx + 16 * j, len);
        const float pr = seen ? exp2f(s[i][j] - base) : 0.f;
        l[i] += pr;
        ps[(ty + 16 * i) * kPPitch + tx + 16 * j] = pr;
      }
    }
    __syncthreads();  // the whole P tile is written
    accumulate_pv<kTile>(ps, vs, d, ty, tx, o);
    __syncthreads();  // P and V are read before the next tile overwrites them
  }
#pragma unroll
  for (int i = 0; i < kR; ++i) l[i] = row_sum(l[i]);
  // END SOLUTION

  // BEGIN SOLUTION: o / l rounded to bf16, for the rows inside the sequence (l == 0: write 0, not NaN)
#pragma unroll
  for (int i = 0; i < kR; ++i) {
    const int row = q0 + ty + 16 * i;
    if (row >= len_q) continue;
    const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
    __nv_bfloat16* dst = p.out + (static_cast<int64_t>(start + row) * p.n_heads + h) * d;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const int c = tx * 4 + 64 * g;
      if (c >= d) continue;
      __nv_bfloat162* pair = reinterpret_cast<__nv_bfloat162*>(dst + c);
      pair[0] = __floats2bfloat162_rn(o[i][g].x * inv, o[i][g].y * inv);
      pair[1] = __floats2bfloat162_rn(o[i][g].z * inv, o[i][g].w * inv);
    }
  }
  // END SOLUTION
}

// Launch with kTile-row tiles and `smem` bytes of dynamic shared memory (smem_bytes).
template <int kD, int kTile>
tvllm_status launch(const Params& p, int n_seqs, int max_seqlen, int64_t smem,
                    cudaStream_t stream) {
  // BEGIN SOLUTION: a block per (kTile-query tile, head, sequence); opt in to `smem` bytes of dynamic shared memory (over 48 KB needs it) | return "{todo}";
  cudaError_t err = cudaFuncSetAttribute(prefill_attention_kernel<kD, kTile>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear it: the message goes back through the return value
    return cudaGetErrorString(err);
  }
  const dim3 grid(static_cast<unsigned>(tvllm_ceil_div(max_seqlen, kTile)), p.n_heads, n_seqs);
  prefill_attention_kernel<kD, kTile><<<grid, kThreads, smem, stream>>>(p);
  return TVLLM_OK;
  // END SOLUTION
}

// The tile whose shared memory fits: 64 rows where the GPU's opt-in limit per block allows
// it, else 32 (a T4 at head_dim 128). smem_limit > 0 lowers the limit (tests use it to run the
// small tile on any GPU); -1 takes the device's.
template <int kD>
tvllm_status launch_tile(const Params& p, int n_seqs, int max_seqlen, int64_t smem_limit,
                         cudaStream_t stream) {
  int device = 0, optin = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear it: the message goes back through the return value
    return cudaGetErrorString(err);
  }
  const int64_t limit = smem_limit >= 0 ? std::min<int64_t>(smem_limit, optin) : optin;
  const int64_t large = smem_bytes(kLargeTile, p.head_dim);
  const int64_t small = smem_bytes(kSmallTile, p.head_dim);
  if (large <= limit) return launch<kD, kLargeTile>(p, n_seqs, max_seqlen, large, stream);
  if (small <= limit) return launch<kD, kSmallTile>(p, n_seqs, max_seqlen, small, stream);
  thread_local char message[320];  // read by the caller before this thread launches again
  char allowed[128];
  if (smem_limit >= 0 && smem_limit < optin)
    std::snprintf(allowed, sizeof allowed, "smem_limit allows %lld (the GPU: %d)",
                  static_cast<long long>(smem_limit), optin);
  else
    std::snprintf(allowed, sizeof allowed,
                  "this GPU allows %d (cudaDevAttrMaxSharedMemoryPerBlockOptin)", optin);
  std::snprintf(message, sizeof message,
                "head_dim %d needs %lld bytes of shared memory per block even with %d-row tiles "
                "(%lld with %d-row tiles), but %s",
                p.head_dim, static_cast<long long>(small), kSmallTile,
                static_cast<long long>(large), kLargeTile, allowed);
  return message;
}

}  // namespace

// q: [tokens, n_heads, head_dim], k, v: [tokens, n_kv_heads, head_dim], bf16, heads
// contiguous inside a token's row, rows `*_stride` elements apart (a multiple of 8), 16-byte
// aligned. out: [tokens, n_heads, head_dim] bf16, contiguous. cu_seqlens_q, cu_seqlens_k:
// [n_seqs + 1] int32 on the device, rising from 0 to the query (key) rows, with at least as
// many keys as queries in each sequence; max_seqlen is the longest query run (the caller knows
// it on the host: the kernel never makes the CPU wait). smem_limit: bytes of shared memory a
// block may use, or -1 for what the device allows (cudaDevAttrMaxSharedMemoryPerBlockOptin).
tvllm_status launch_prefill_attention(const void* q, const void* k, const void* v, void* out,
                                      const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k,
                                      int n_seqs, int max_seqlen,
                                      int64_t q_stride, int64_t k_stride, int64_t v_stride,
                                      int n_heads, int n_kv_heads, int head_dim, float scale,
                                      int64_t smem_limit, cudaStream_t stream) {
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
    case 64: return launch_tile<64>(p, n_seqs, max_seqlen, smem_limit, stream);
    case 128: return launch_tile<128>(p, n_seqs, max_seqlen, smem_limit, stream);
    default: return launch_tile<0>(p, n_seqs, max_seqlen, smem_limit, stream);
  }
}

// Stage 05 kernel: rotary position embedding (RoPE), applied in place to q and k.
//
// Each head vector x of length d is split into pairs (x[i], x[i + d/2]) -- the "rotate-half"
// (NeoX / Hugging Face) pairing -- and pair i is rotated by the angle pos * inv_freq[i]:
//
//     x[i]       <- x[i] * cos - x[i + d/2] * sin
//     x[i + d/2] <- x[i + d/2] * cos + x[i] * sin
//
// cos and sin come from one float32 table cos_sin[max_positions, d] (cos in the first d/2
// columns, sin in the last d/2; rope_tables.py builds it), indexed by each token's position,
// so prefill (positions 0..T-1) and decode (position n) run the same code.
//
// Rounding as HF does it, so bf16 results match bit for bit: HF casts cos and sin to the
// activations' dtype and computes q * cos + rotate_half(q) * sin as separate bf16 tensor ops,
// each product and the sum rounded to bf16. __fmul_rn keeps nvcc from fusing a product and
// the sum into one fma, which would round once instead of twice.
//
// One block handles one token: all its q heads and k heads. A thread takes N consecutive
// pairs of one head (16 bytes of each half: 8 bf16 or 4 floats). q and k may be views with
// a token stride (slices of a fused QKV output), so rows are addressed with their strides.
// A position outside the table is never read: that token's q and k become NaN and *error = 1.
// Reference: rope.py (apply_rope_native). Run: nox -s grade -- 05
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <algorithm>
#include <cstdint>

#include "pdl.cuh"
#include "tvllm.h"
#include "vec.cuh"

namespace {

// x rounded to T's precision, kept as a float.
template <typename T>
__device__ __forceinline__ float round_to(float x) { return to_float(from_float<T>(x)); }

// q: [tokens, q_heads, head_dim] with row stride q_stride (elements); k likewise.
template <typename T, int N>
__global__ void rope_kernel(T* __restrict__ q, T* __restrict__ k,
                            const int64_t* __restrict__ positions,
                            const float* __restrict__ cos_sin, int* __restrict__ error,
                            int64_t q_stride, int64_t k_stride, int q_heads, int k_heads,
                            int head_dim, int64_t max_positions) {
  using P = Pack<T, N>;
  using F = Pack<float, N>;
  // Launched early in a decode step: the position, a step input no kernel writes, before the
  // wait (its latency hides behind the QKV GEMV); q, k and the error flag only after the GEMV
  // has finished (pdl.cuh).
  allow_next_kernel_to_start();
  const int64_t t = blockIdx.x;
  // BEGIN SOLUTION: this token's position, and whether it is outside the table | const int64_t pos = 0; const bool bad = true;
  const int64_t pos = positions[t];
  const bool bad = pos < 0 || pos >= max_positions;
  // END SOLUTION
  wait_for_previous_kernel();
  // BEGIN SOLUTION: out of range: *error = 1 and NaN rows; loop over (head, chunk of N pairs); rotate with HF's roundings
  if (bad && threadIdx.x == 0) *error = 1;
  const int half = head_dim / 2;
  const int chunks = half / N;  // per head
  const float* cos_row = cos_sin + (bad ? 0 : pos) * head_dim;
  const float* sin_row = cos_row + half;
  for (int c = threadIdx.x; c < (q_heads + k_heads) * chunks; c += blockDim.x) {
    const int head = c / chunks;
    const int i = (c % chunks) * N;
    T* x = head < q_heads ? q + t * q_stride + static_cast<int64_t>(head) * head_dim
                          : k + t * k_stride + static_cast<int64_t>(head - q_heads) * head_dim;
    P* lo = reinterpret_cast<P*>(x + i);
    P* hi = reinterpret_cast<P*>(x + half + i);
    P a = *lo, b = *hi;
    if (bad) {
#pragma unroll
      for (int j = 0; j < N; ++j) a.v[j] = b.v[j] = from_float<T>(__int_as_float(0x7fc00000));
    } else {
      const F cos_v = *reinterpret_cast<const F*>(cos_row + i);
      const F sin_v = *reinterpret_cast<const F*>(sin_row + i);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const float cs = round_to<T>(cos_v.v[j]), sn = round_to<T>(sin_v.v[j]);
        const float x1 = to_float(a.v[j]), x2 = to_float(b.v[j]);
        a.v[j] = from_float<T>(round_to<T>(__fmul_rn(x1, cs)) - round_to<T>(__fmul_rn(x2, sn)));
        b.v[j] = from_float<T>(round_to<T>(__fmul_rn(x2, cs)) + round_to<T>(__fmul_rn(x1, sn)));
      }
    }
    *lo = a;
    *hi = b;
  }
  // END SOLUTION
}

template <typename T, int N>
tvllm_status launch_rows(T* q, T* k, const int64_t* positions, const float* cos_sin, int* error,
                         int64_t tokens, int64_t q_stride, int64_t k_stride, int q_heads,
                         int k_heads, int head_dim, int64_t max_positions, cudaStream_t stream) {
  // BEGIN SOLUTION: one block per token; threads: a multiple of 32 covering (q_heads + k_heads) * chunks, at most 256 | return "{todo}";
  const int64_t items = static_cast<int64_t>(q_heads + k_heads) * (head_dim / 2 / N);
  const int threads = static_cast<int>(std::min<int64_t>(256, tvllm_ceil_div(items, 32) * 32));
  launch_early(rope_kernel<T, N>, static_cast<unsigned>(tokens), threads, 0, stream, q, k,
               positions, cos_sin, error, q_stride, k_stride, q_heads, k_heads, head_dim,
               max_positions);
  return TVLLM_OK;
  // END SOLUTION
}

// 16-byte packs when every row, head and half-head starts on a 16-byte boundary.
template <typename T>
tvllm_status launch_typed(T* q, T* k, const int64_t* positions, const float* cos_sin, int* error,
                          int64_t tokens, int64_t q_stride, int64_t k_stride, int q_heads,
                          int k_heads, int head_dim, int64_t max_positions, cudaStream_t stream) {
  constexpr int kWide = 16 / sizeof(T);
  const bool wide = (head_dim / 2) % kWide == 0 && q_stride % kWide == 0 &&
                    k_stride % kWide == 0 && tvllm_aligned(q, 16) && tvllm_aligned(k, 16) &&
                    tvllm_aligned(cos_sin, kWide * sizeof(float));
  if (wide) {
    return launch_rows<T, kWide>(q, k, positions, cos_sin, error, tokens, q_stride, k_stride,
                                 q_heads, k_heads, head_dim, max_positions, stream);
  }
  return launch_rows<T, 1>(q, k, positions, cos_sin, error, tokens, q_stride, k_stride, q_heads,
                           k_heads, head_dim, max_positions, stream);
}

}  // namespace

// q: [tokens, q_heads, head_dim], rows q_stride elements apart, heads contiguous; k likewise;
// both bf16 (bf16 = true) or both float32. positions: [tokens] int64. cos_sin:
// [max_positions, head_dim] float32. error: one int, set to 1 for a position outside the table.
tvllm_status launch_rope(void* q, void* k, const int64_t* positions, const float* cos_sin,
                         int* error, int64_t tokens, int64_t q_stride, int64_t k_stride,
                         int q_heads, int k_heads, int head_dim, int64_t max_positions, bool bf16,
                         cudaStream_t stream) {
  if (tokens == 0 || q_heads + k_heads == 0) return TVLLM_OK;
  if (tokens > INT32_MAX) return "more than 2^31 - 1 tokens in one call";
  if (head_dim % 2 != 0) return "head_dim must be even (pairs (i, i + head_dim/2))";
  if (bf16) {
    using T = __nv_bfloat16;
    return launch_typed<T>(static_cast<T*>(q), static_cast<T*>(k), positions, cos_sin, error,
                           tokens, q_stride, k_stride, q_heads, k_heads, head_dim, max_positions,
                           stream);
  }
  return launch_typed<float>(static_cast<float*>(q), static_cast<float*>(k), positions, cos_sin,
                             error, tokens, q_stride, k_stride, q_heads, k_heads, head_dim,
                             max_positions, stream);
}

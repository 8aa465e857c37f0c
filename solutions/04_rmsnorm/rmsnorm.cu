// Stage 04 kernel: RMSNorm, and RMSNorm fused with the residual add that precedes it.
//
//     rmsnorm:            out[r] = weight * round(x[r] * rsqrt(mean(x[r]^2) + eps))
//     fused_add_rmsnorm:  s = round(x[r] + residual[r]);  residual[r] = s;  x[r] = rmsnorm(s)
//
// round() is the rounding to the tensor's dtype. HF's LlamaRMSNorm rounds the normalized row
// to bf16 BEFORE multiplying by the weight, and adds the residual in bf16; doing the same
// roundings in the same places is what makes our bf16 output equal to HF's.
//
// One block normalizes one row. Each thread loads up to kVecs "packs" of N elements (16 bytes:
// 8 bf16 or 4 floats, coalesced) and keeps them in registers, so the row is read from global
// memory once. The sum of squares is a block-wide reduction in float32: a shuffle tree inside
// each warp (__shfl_xor_sync, 5 steps for 32 lanes), one partial per warp in shared memory,
// then one more warp-level tree over those partials. Rows whose size or alignment does not
// allow 16-byte packs use packs of one element (N = 1): same kernel, narrower loads.
// Reference: rmsnorm.py (rmsnorm_native, fused_add_rmsnorm_native). Run: nox -s grade -- 04
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cstdint>

#include "pdl.cuh"
#include "tvllm.h"
#include "vec.cuh"

namespace {

// The sum of v over the 32 lanes of a warp, returned to every lane.
__device__ __forceinline__ float warp_sum(float v) {
  // BEGIN SOLUTION: butterfly: add the value of the lane `offset` away, offset 16, 8, 4, 2, 1 | return 0.0f;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
  // END SOLUTION
}

// The sum of v over the block, returned to every thread. blockDim.x is a multiple of 32
// (at most 1024: 32 warps). Call it once per kernel: the shared array is not re-synchronized.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float warp_sums[32];
  // BEGIN SOLUTION: warp sums -> shared memory (lane 0 of each warp) -> __syncthreads -> every warp sums the partials | return 0.0f;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  v = warp_sum(v);
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  // Every warp (not only warp 0) reduces the partials, so each thread gets the total without
  // a second trip through shared memory and a second barrier.
  v = lane < static_cast<int>(blockDim.x / 32) ? warp_sums[lane] : 0.0f;
  return warp_sum(v);
  // END SOLUTION
}

// Block r normalizes row r. kAdd: first residual[r] = round(x[r] + residual[r]), and that
// sum is what gets normalized. out may be x itself (the fused op writes over x): every
// element is read, then written, by the same thread, so out and x carry no __restrict__.
template <typename T, int N, int kVecs, bool kAdd>
__global__ void __launch_bounds__(1024)
rmsnorm_kernel(T* out, T* residual, const T* x, const T* __restrict__ weight, int64_t hidden,
               float eps) {
  using P = Pack<T, N>;
  const int64_t row_start = static_cast<int64_t>(blockIdx.x) * hidden;
  const int packs = static_cast<int>(hidden / N);
  // A decode step's next kernel (stage 06's GEMV) may start loading its weights now, and this
  // one may have started before the previous kernel ended: the weight, which no kernel of the
  // step writes, is read before the wait (its latency hides behind the previous kernel); x and
  // residual only after it (course/cuda/pdl.cuh).
  allow_next_kernel_to_start();
  P wv[kVecs];  // this thread's packs of the weight
  // BEGIN SOLUTION: wv[j] = weight pack p = threadIdx.x + j * blockDim.x, for p < packs
  const P* w = reinterpret_cast<const P*>(weight);
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int p = threadIdx.x + j * blockDim.x;
    if (p < packs) wv[j] = w[p];
  }
  // END SOLUTION
  wait_for_previous_kernel();
  // BEGIN SOLUTION: load (and add) this thread's packs into registers, block_sum the squares, scale by the weight in wv, store
  const P* x_row = reinterpret_cast<const P*>(x + row_start);
  P* out_row = reinterpret_cast<P*>(out + row_start);

  P h[kVecs];  // the row (after the add), kept in registers between the two passes
  float sum_sq = 0.0f;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int p = threadIdx.x + j * blockDim.x;
    if (p < packs) {
      h[j] = x_row[p];
      if constexpr (kAdd) {
        P* res_row = reinterpret_cast<P*>(residual + row_start);
        const P r = res_row[p];
#pragma unroll
        for (int k = 0; k < N; ++k) h[j].v[k] = from_float<T>(to_float(h[j].v[k]) + to_float(r.v[k]));
        res_row[p] = h[j];
      }
#pragma unroll
      for (int k = 0; k < N; ++k) sum_sq += to_float(h[j].v[k]) * to_float(h[j].v[k]);
    }
  }
  const float inv_rms = rsqrtf(block_sum(sum_sq) / static_cast<float>(hidden) + eps);
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int p = threadIdx.x + j * blockDim.x;
    if (p < packs) {
      P o;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const float normed = to_float(from_float<T>(to_float(h[j].v[k]) * inv_rms));
        o.v[k] = from_float<T>(to_float(wv[j].v[k]) * normed);
      }
      out_row[p] = o;
    }
  }
  // END SOLUTION
}

// Threads a block aims for: small blocks with several packs per thread keep more loads in
// flight per SM than big blocks with one pack per thread, and their reduction is shorter
// (hidden 2048 bf16 on an H200: 128 threads reach 98% of a plain copy's bandwidth, 256: 90%).
constexpr int kTargetThreads = 128;
constexpr int kMaxVecs = 8;

template <typename T, int N, bool kAdd>
tvllm_status launch_rows(T* out, T* residual, const T* x, const T* weight, int64_t rows,
                         int64_t hidden, float eps, cudaStream_t stream) {
  // BEGIN SOLUTION: kVecs = packs per thread (1, 2, 4 or 8), threads = a multiple of 32 covering the row; one block per row | return "{todo}";
  const int64_t packs = hidden / N;
  if (packs > int64_t{kMaxVecs} * 1024) {
    return "the row is too long to keep in registers: at most 8 * 1024 packs of 16 bytes, "
           "or 8192 elements when the rows are not 16-byte aligned";
  }
  const int64_t per_thread = tvllm_ceil_div(packs, kTargetThreads);
  const int vecs = per_thread <= 1 ? 1 : per_thread <= 2 ? 2 : per_thread <= 4 ? 4 : 8;
  const int threads = static_cast<int>(tvllm_ceil_div(tvllm_ceil_div(packs, vecs), 32) * 32);
  const unsigned blocks = static_cast<unsigned>(rows);
  switch (vecs) {
    case 1: launch_early(rmsnorm_kernel<T, N, 1, kAdd>, blocks, threads, 0, stream, out, residual, x, weight, hidden, eps); break;
    case 2: launch_early(rmsnorm_kernel<T, N, 2, kAdd>, blocks, threads, 0, stream, out, residual, x, weight, hidden, eps); break;
    case 4: launch_early(rmsnorm_kernel<T, N, 4, kAdd>, blocks, threads, 0, stream, out, residual, x, weight, hidden, eps); break;
    default: launch_early(rmsnorm_kernel<T, N, 8, kAdd>, blocks, threads, 0, stream, out, residual, x, weight, hidden, eps); break;
  }
  return TVLLM_OK;
  // END SOLUTION
}

// 16-byte packs when the row is a whole number of them and every pointer is 16-byte aligned.
template <typename T, bool kAdd>
tvllm_status launch_typed(T* out, T* residual, const T* x, const T* weight, int64_t rows,
                          int64_t hidden, float eps, cudaStream_t stream) {
  if (rows == 0) return TVLLM_OK;
  if (rows > INT32_MAX) return "more than 2^31 - 1 rows in one call";
  if (hidden <= 0) return "rows have no elements (hidden = 0)";
  constexpr int kWide = 16 / sizeof(T);
  const bool wide = hidden % kWide == 0 && tvllm_aligned(out, 16) && tvllm_aligned(x, 16) &&
                    tvllm_aligned(weight, 16) && (!kAdd || tvllm_aligned(residual, 16));
  if (wide) return launch_rows<T, kWide, kAdd>(out, residual, x, weight, rows, hidden, eps, stream);
  return launch_rows<T, 1, kAdd>(out, residual, x, weight, rows, hidden, eps, stream);
}

}  // namespace

// x, out: [rows, hidden]; weight: [hidden]; all bf16 (bf16 = true) or all float32.
tvllm_status launch_rmsnorm(void* out, const void* x, const void* weight, int64_t rows,
                            int64_t hidden, float eps, bool bf16, cudaStream_t stream) {
  if (bf16) {
    using T = __nv_bfloat16;
    return launch_typed<T, false>(static_cast<T*>(out), nullptr, static_cast<const T*>(x),
                                  static_cast<const T*>(weight), rows, hidden, eps, stream);
  }
  return launch_typed<float, false>(static_cast<float*>(out), nullptr,
                                    static_cast<const float*>(x),
                                    static_cast<const float*>(weight), rows, hidden, eps, stream);
}

// In place: residual <- round(x + residual), x <- rmsnorm(residual). Shapes as above.
tvllm_status launch_fused_add_rmsnorm(void* x, void* residual, const void* weight, int64_t rows,
                                      int64_t hidden, float eps, bool bf16,
                                      cudaStream_t stream) {
  if (bf16) {
    using T = __nv_bfloat16;
    return launch_typed<T, true>(static_cast<T*>(x), static_cast<T*>(residual),
                                 static_cast<const T*>(x), static_cast<const T*>(weight), rows,
                                 hidden, eps, stream);
  }
  return launch_typed<float, true>(static_cast<float*>(x), static_cast<float*>(residual),
                                   static_cast<const float*>(x),
                                   static_cast<const float*>(weight), rows, hidden, eps, stream);
}

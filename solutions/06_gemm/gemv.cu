// Stage 06 kernel, part 2: y = x @ weight^T for a few tokens (decode), as a GEMV.
//
// At 1-8 tokens a Linear layer is a matrix-vector product: every weight is read once and used
// for 1-8 multiply-adds. Its time is the time to stream the weight from memory (8 MB for a
// 2048 x 2048 projection of Llama-3.2-1B: 1.9 us at the H200's ~4.25 TB/s), nothing else. A
// tensor-core GEMM built for big tiles wastes most of its work and often splits the sum
// over blocks (split-K) to find parallelism; this kernel gives each output row to one warp:
//
//     warp w of block b owns row o = b * kWarps + w of weight [out, in]:
//       lane l reads the row in 16-byte pieces (8 bf16) l, l + 32, l + 64, ...,
//       kUnroll pieces in flight before it uses any (what hides the memory latency),
//       multiplies each with the same 8 columns of every token's x (x is tiny and stays
//       in L1), and keeps one float32 sum per token;
//     the 32 lanes add their sums with shuffles; lane 0 writes y[t, o] for every token t.
//
// Each weight byte is loaded once, by one lane, with a streaming load (it will not be read
// again this step, so it should not push x out of the caches). float32 accumulation, one
// rounding at the end, like cuBLAS with CUBLAS_COMPUTE_32F: the result equals linear_native
// within the bf16 tolerance. bf16 in; bf16 or float32 out (the logits).
//
// On an sm_90 GPU the launch may use programmatic dependent launch (PDL): the kernel may start
// while the previous kernel of the stream is still finishing. Weights do not depend on it, so
// each warp issues its first loads before `griddepcontrol.wait`, which returns once the
// previous kernel has finished and its writes are visible; only then are x read and y written
// (solutions/common/pdl.cuh; the kernels that run before a GEMV in a decode step, RMSNorm and
// SiLU-mul, call allow_next_kernel_to_start() first thing, so it can start that early).
// Reference: linear.py (linear_native). Run: nox -s grade -- 06
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdint>

#include "pdl.cuh"
#include "tvllm.h"
#include "vec.cuh"

constexpr int kGemvMaxTokens = 8;  // above this, cuBLAS (gemm.cu): x's reuse pays for tiles
constexpr int kThreads = 256;      // 8 warps: 8 output rows per block
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 8;         // 16-byte pieces in flight per lane: 4 KB per warp
constexpr int kRound = 32 * kUnroll;  // pieces of a row a warp reads per round (2048 columns)
// Blocks an SM holds at once (it caps the registers at 128 per thread): 16 warps x 4 KB in
// flight per SM, twice the ~30 KB that keep an H200's memory busy.
constexpr int kBlocksPerSM = 2;

using BF8 = Pack<__nv_bfloat16, 8>;

// One 16-byte piece: streamed (read once: evict first) or through the read-only cache (reused).
__device__ __forceinline__ BF8 load_streaming(const BF8* p) {
  const uint4 raw = __ldcs(reinterpret_cast<const uint4*>(p));
  return *reinterpret_cast<const BF8*>(&raw);
}
__device__ __forceinline__ BF8 load_cached(const BF8* p) {
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
  return *reinterpret_cast<const BF8*>(&raw);
}

// acc[t] += dot(w's 8 values, token t's 8 values of x at the same columns), t < tokens.
// x_piece: that piece of token 0's x in shared memory; token t's is kRound pieces further.
template <int kTokens>
__device__ __forceinline__ void fma_piece(float (&acc)[kTokens], const BF8& w,
                                          const BF8* x_piece, int tokens) {
  // BEGIN SOLUTION: widen w once; for each token t < tokens: read its x piece, 8 fmaf into acc[t]
  float wf[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) wf[e] = to_float(w.v[e]);
#pragma unroll
  for (int t = 0; t < kTokens; ++t) {
    if (t < tokens) {
      const BF8 xv = x_piece[t * kRound];
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[t] = fmaf(wf[e], to_float(xv.v[e]), acc[t]);
    }
  }
  // END SOLUTION
}

// This lane's pieces of one round of its row: lane, lane + 32, ... from `first` (none past
// the row's end, none for a warp past the last row).
__device__ __forceinline__ void load_round(BF8 (&ws)[kUnroll], const BF8* row, int first,
                                           int pieces, int lane, bool active) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int c = first + lane + u * 32;
    if (active && c < pieces) ws[u] = load_streaming(row + c);
  }
}

// x: [tokens, in] bf16, weight: [out, in] bf16, y: [tokens, out] of OutT; in % 8 == 0, x and
// weight 16-byte aligned, tokens <= kTokens. One warp per output row.
template <int kTokens, typename OutT>
__global__ void __launch_bounds__(kThreads, kBlocksPerSM)
gemv_kernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ weight,
            OutT* __restrict__ y, int tokens, int in_features, int out_features) {
  // This round's columns of every token's x, read once per block instead of once per warp
  // (from L2, a long wait that would sit between each weight piece and its use).
  __shared__ BF8 xs[kTokens * kRound];
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * kWarps + threadIdx.x / 32;
  // A warp past the last row loads and writes nothing, but still helps stage x and reaches
  // every __syncthreads.
  const bool active = row < out_features;
  const int pieces = in_features / 8;
  const BF8* w = reinterpret_cast<const BF8*>(weight) + static_cast<int64_t>(row) * pieces;
  const BF8* xp = reinterpret_cast<const BF8*>(x);
  float acc[kTokens];
#pragma unroll
  for (int t = 0; t < kTokens; ++t) acc[t] = 0.f;
  BF8 ws[kUnroll];
  // BEGIN SOLUTION: load_round 0 before wait_for_previous_kernel(); per round: stage x's columns of this round in xs (between two __syncthreads), fma_piece each piece, load_round the next one
  // The first round's weights are requested before the wait: they overlap the previous kernel.
  load_round(ws, w, 0, pieces, lane, active);
  wait_for_previous_kernel();
  for (int base = 0; base < pieces; base += kRound) {
    __syncthreads();  // every warp is done with the last round's xs
    for (int i = threadIdx.x; i < tokens * kRound; i += kThreads) {
      const int t = i / kRound, c = base + i % kRound;
      if (c < pieces) xs[i] = load_cached(xp + static_cast<int64_t>(t) * pieces + c);
    }
    __syncthreads();
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = lane + u * 32;
      if (active && base + c < pieces) fma_piece(acc, ws[u], xs + c, tokens);
    }
    load_round(ws, w, base + kRound, pieces, lane, active);
  }
  // END SOLUTION
  if (!active) return;  // whole warps: the shuffles below need all 32 lanes
#pragma unroll
  for (int t = 0; t < kTokens; ++t) {
    if (t < tokens) {
      float sum = acc[t];
      // BEGIN SOLUTION: butterfly sum over the 32 lanes (__shfl_xor_sync); lane 0 writes y[t, row]
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
      if (lane == 0) y[static_cast<int64_t>(t) * out_features + row] = from_float<OutT>(sum);
      // END SOLUTION
    }
  }
}

namespace {

// Whether this build of `kernel` waits in griddepcontrol.wait: only code compiled for sm_90 or
// later has it (a compute_75 build run on an H200 does not), and only then may it launch early.
template <typename Kernel>
bool has_pdl_wait(Kernel kernel) {
  cudaFuncAttributes attributes;
  return cudaFuncGetAttributes(&attributes, kernel) == cudaSuccess && attributes.ptxVersion >= 90;
}

template <int kTokens, typename OutT>
tvllm_status launch(const __nv_bfloat16* x, const __nv_bfloat16* weight, OutT* y, int tokens,
                    int in_features, int out_features, bool pdl, cudaStream_t stream) {
  // BEGIN SOLUTION: one warp per output row: ceil(out / kWarps) blocks of kThreads; cudaLaunchKernelEx, the PDL attribute when pdl and has_pdl_wait(the kernel) | return "{todo}";
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(tvllm_ceil_div(out_features, kWarps)));
  config.blockDim = dim3(kThreads);
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  static const bool kernel_waits = has_pdl_wait(gemv_kernel<kTokens, OutT>);
  config.attrs = attribute;
  config.numAttrs = pdl && kernel_waits ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(&config, gemv_kernel<kTokens, OutT>, x, weight, y,
                                             tokens, in_features, out_features);
  return err == cudaSuccess ? TVLLM_OK : cudaGetErrorString(err);
  // END SOLUTION
}

template <typename OutT>
tvllm_status launch_tokens(const __nv_bfloat16* x, const __nv_bfloat16* weight, OutT* y,
                           int tokens, int in_features, int out_features, bool pdl,
                           cudaStream_t stream) {
  // The smallest instance that holds `tokens`: acc[] lives in registers, so no larger.
  if (tokens == 1) return launch<1>(x, weight, y, tokens, in_features, out_features, pdl, stream);
  if (tokens == 2) return launch<2>(x, weight, y, tokens, in_features, out_features, pdl, stream);
  if (tokens <= 4) return launch<4>(x, weight, y, tokens, in_features, out_features, pdl, stream);
  return launch<8>(x, weight, y, tokens, in_features, out_features, pdl, stream);
}

}  // namespace

// Whether launch_gemv takes this product (else cuBLAS does): bf16, 1-8 tokens, rows of a
// whole number of 16-byte pieces, 16-byte aligned.
bool gemv_fits(bool bf16, int64_t tokens, int64_t in_features, int64_t out_features,
               const void* x, const void* weight) {
  return bf16 && tokens >= 1 && tokens <= kGemvMaxTokens && in_features % 8 == 0 &&
         in_features < (int64_t{1} << 30) && out_features < (int64_t{1} << 30) &&
         reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(weight) % 16 == 0;
}

// x: [tokens, in] bf16, weight: [out, in] bf16, y: [tokens, out] bf16 (y_f32 false) or float32;
// gemv_fits must hold. pdl: programmatic dependent launch where the kernel was built for it.
tvllm_status launch_gemv(const void* x, const void* weight, void* y, bool y_f32, int64_t tokens,
                         int64_t in_features, int64_t out_features, bool pdl,
                         cudaStream_t stream) {
  if (!gemv_fits(true, tokens, in_features, out_features, x, weight))
    return "gemv: needs 1-8 tokens, in_features a multiple of 8 and 16-byte aligned x and weight";
  const auto* xb = static_cast<const __nv_bfloat16*>(x);
  const auto* wb = static_cast<const __nv_bfloat16*>(weight);
  const int t = static_cast<int>(tokens), k = static_cast<int>(in_features),
            n = static_cast<int>(out_features);
  return y_f32 ? launch_tokens(xb, wb, static_cast<float*>(y), t, k, n, pdl, stream)
               : launch_tokens(xb, wb, static_cast<__nv_bfloat16*>(y), t, k, n, pdl, stream);
}

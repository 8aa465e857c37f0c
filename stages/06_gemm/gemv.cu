// Stage 06 kernel, part 2: y = x @ weight^T for a few tokens (decode), as a GEMV.
//
// At 1-8 tokens a Linear layer is a matrix-vector product: every weight is read once and used
// for 1-8 multiply-adds. Its time is the time to stream the weight from memory (8 MB for a
// 2048 x 2048 projection of Llama-3.2-1B: 1.9 us at the H200's ~4.25 TB/s), nothing else. To
// stream at that rate, ~64 KB must be requested and not yet delivered per SM at all times
// (bytes = bandwidth x latency); weights loaded into registers cap that at what the registers
// hold, so here they go to shared memory with cp.async (course/cuda/cp_async.cuh):
//
//     a warp owns rows gw, gw + W, gw + 2W, ... of weight [out, in] (gw: its number in the
//     grid, W: the warps in the grid, ~16 per SM: a persistent kernel, one wave);
//     a row is cut into units of 2048 columns (4 KB: 8 pieces of 16 bytes per lane);
//     each lane keeps its copies of the next kStages - 1 units in flight in a ring of
//     kStages slots while it computes with the current one (4 warps x 2 x 4 KB per block);
//     per unit, each piece times the same 8 columns of every token's x (tiny: it stays in
//     L1) into one float32 sum per token; at a row's last unit the 32 lanes add their sums
//     with shuffles and lane 0 writes y[t, row] for every token t.
//
// Each weight byte is read once, by one lane; a lane reads back only the slots it filled, so
// no barrier is needed. float32 accumulation, one rounding at the end, like cuBLAS with
// CUBLAS_COMPUTE_32F: the result equals linear_native within the bf16 tolerance. bf16 in;
// bf16 or float32 out (the logits).
//
// On an sm_90 GPU the launch may use programmatic dependent launch (PDL): the kernel may start
// while the previous kernel of the stream is still finishing. Weights do not depend on it, so
// each lane issues its first units' copies before `griddepcontrol.wait`, which returns once the
// previous kernel has finished and its writes are visible; only then are x read and y written
// (course/cuda/pdl.cuh; the kernels that run before a GEMV in a decode step, RMSNorm and
// SiLU-mul, call allow_next_kernel_to_start() first thing, so it can start that early).
// Reference: linear.py (linear_native). Run: nox -s grade -- 06
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdint>

#include "cp_async.cuh"
#include "pdl.cuh"
#include "tvllm.h"
#include "vec.cuh"

constexpr int kGemvMaxTokens = 8;  // above this, cuBLAS (gemm.cu): x's reuse pays for tiles
constexpr int kThreads = 128;      // 4 warps
constexpr int kWarps = kThreads / 32;
constexpr int kPieces = 8;            // 16-byte pieces per lane per unit
constexpr int kUnit = 32 * kPieces;   // pieces per unit: 256 (2048 columns, 4 KB)
constexpr int kStages = 3;            // ring slots per warp: 2 units in flight, 1 in use
// The ring: kWarps x kStages x 4 KB = 48 KB, the most a block may take without opting in; an
// H200 SM holds four such blocks (16 warps, 128 KB in flight), a T4's one.

using BF8 = Pack<__nv_bfloat16, 8>;

__device__ __forceinline__ BF8 as_bf8(const uint4& raw) { return reinterpret_cast<const BF8&>(raw); }

// acc[t] += dot(w's 8 values, token t's 8 values of x at the same columns), t < tokens.
// x_piece: that piece of token 0's x; token t's is `pieces` (in / 8) pieces further.
template <int kTokens>
__device__ __forceinline__ void fma_piece(float (&acc)[kTokens], const BF8& w,
                                          const uint4* __restrict__ x_piece, int pieces,
                                          int tokens) {
  // TODO stage 06: widen w once; for each token t < tokens: load its x piece (__ldg), 8 fmaf into acc[t] (about 11 lines)
}

// Which weights unit i of a warp is: its row and its first piece. A warp's units run through
// its rows in order, each row's units left to right.
struct Unit {
  int row, first;
};
__device__ __forceinline__ Unit unit_of(int i, int gw, int warps, int units_per_row) {
  return Unit{gw + (i / units_per_row) * warps, (i % units_per_row) * kUnit};
}

// This lane's copies of unit i (if the warp has one) into ring slot i % kStages, as one group:
// one group per unit, empty or not, so copies_wait counts units.
__device__ __forceinline__ void fetch(uint4* ring, const uint4* weight, int i, int units,
                                      int gw, int warps, int units_per_row, int pieces,
                                      int lane) {
  if (i < units) {
    const Unit u = unit_of(i, gw, warps, units_per_row);
    const uint4* src = weight + static_cast<int64_t>(u.row) * pieces;
    uint4* slot = ring + (i % kStages) * kUnit;
#pragma unroll
    for (int p = 0; p < kPieces; ++p) {
      const int c = u.first + p * 32 + lane;
      if (c < pieces) copy16(slot + p * 32 + lane, src + c, true);
    }
  }
  copies_commit();
}

// x: [tokens, in] bf16, weight: [out, in] bf16, y: [tokens, out] of OutT; in % 8 == 0, x and
// weight 16-byte aligned, tokens <= kTokens.
template <int kTokens, typename OutT>
__global__ void __launch_bounds__(kThreads)
gemv_kernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ weight,
            OutT* __restrict__ y, int tokens, int in_features, int out_features) {
  __shared__ uint4 rings[kWarps][kStages * kUnit];
  allow_next_kernel_to_start();  // the kernel after it may be scheduled (it waits for all of this)
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int gw = blockIdx.x * kWarps + warp, warps = gridDim.x * kWarps;
  const int pieces = in_features / 8;
  const int units_per_row = (pieces + kUnit - 1) / kUnit;
  const int rows = gw < out_features ? (out_features - gw + warps - 1) / warps : 0;
  const int units = rows * units_per_row;
  uint4* ring = rings[warp];
  const uint4* w = reinterpret_cast<const uint4*>(weight);
  const uint4* xp = reinterpret_cast<const uint4*>(x);
  float acc[kTokens];
#pragma unroll
  for (int t = 0; t < kTokens; ++t) acc[t] = 0.f;
  // TODO stage 06: fetch units 0 .. kStages - 2, then wait_for_previous_kernel(); per unit i: fetch i + kStages - 1, copies_wait<kStages - 1>, fma_piece each of this lane's pieces from the slot; at a row's last unit, butterfly sums and lane 0 writes y[t, row], acc back to 0 (about 27 lines)
}

namespace {

// Blocks of `kernel` that run at once on the whole GPU: the persistent grid's size.
template <typename Kernel>
int resident_blocks(Kernel kernel) {
  int device = 0, sms = 0, per_sm = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0) != cudaSuccess)
    return 0;
  return sms * per_sm;
}

template <int kTokens, typename OutT>
tvllm_status launch(const __nv_bfloat16* x, const __nv_bfloat16* weight, OutT* y, int tokens,
                    int in_features, int out_features, cudaStream_t stream) {
  // only code built for sm_90 or later has the wait, and TINYVLLM_PDL=0 says no (pdl.cuh)
  static const bool kernel_waits = may_launch_early(gemv_kernel<kTokens, OutT>);
  static const int resident = resident_blocks(gemv_kernel<kTokens, OutT>);
  if (resident <= 0) return "gemv: could not ask the device how many blocks fit";
  // TODO stage 06: one block per kWarps rows, at most `resident` blocks; cudaLaunchKernelEx, the PDL attribute when kernel_waits (about 13 lines)
  return "TODO stage 06: one block per kWarps rows, at most `resident` blocks; cudaLaunchKernelEx, the PDL attribute when kernel_waits (about 13 lines)";
}

template <typename OutT>
tvllm_status launch_tokens(const __nv_bfloat16* x, const __nv_bfloat16* weight, OutT* y,
                           int tokens, int in_features, int out_features,
                           cudaStream_t stream) {
  // The smallest instance that holds `tokens`: acc[] lives in registers, so no larger.
  if (tokens == 1) return launch<1>(x, weight, y, tokens, in_features, out_features, stream);
  if (tokens == 2) return launch<2>(x, weight, y, tokens, in_features, out_features, stream);
  if (tokens <= 4) return launch<4>(x, weight, y, tokens, in_features, out_features, stream);
  return launch<8>(x, weight, y, tokens, in_features, out_features, stream);
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
// gemv_fits must hold. Programmatic dependent launch where the kernel was built for it and
// TINYVLLM_PDL is not "0" (pdl.cuh's may_launch_early).
tvllm_status launch_gemv(const void* x, const void* weight, void* y, bool y_f32, int64_t tokens,
                         int64_t in_features, int64_t out_features, cudaStream_t stream) {
  if (!gemv_fits(true, tokens, in_features, out_features, x, weight))
    return "gemv: needs 1-8 tokens, in_features a multiple of 8 and 16-byte aligned x and weight";
  const auto* xb = static_cast<const __nv_bfloat16*>(x);
  const auto* wb = static_cast<const __nv_bfloat16*>(weight);
  const int t = static_cast<int>(tokens), k = static_cast<int>(in_features),
            n = static_cast<int>(out_features);
  return y_f32 ? launch_tokens(xb, wb, static_cast<float*>(y), t, k, n, stream)
               : launch_tokens(xb, wb, static_cast<__nv_bfloat16*>(y), t, k, n, stream);
}

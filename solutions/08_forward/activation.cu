// Stage 08 kernel: the SwiGLU activation of Llama's MLP, out = silu(gate) * up.
//
// The MLP's gate and up projections run as ONE matrix multiply with the fused weight
// cat(gate_proj, up_proj), so its output x is [tokens, 2 * inter]: columns [0, inter) are the
// gate, [inter, 2 * inter) the up projection. This kernel reads both halves and writes
//
//     out[t, j] = silu(x[t, j]) * x[t, inter + j],   silu(g) = g * sigmoid(g) = g / (1 + e^-g)
//
// It is memory-bound (a few flops per 6 bytes moved), so what matters is moving bytes well:
// each thread handles 8 consecutive outputs with 16-byte loads and stores (uint4-sized
// packs of 8 bf16), consecutive threads touch consecutive 16-byte chunks (coalesced). When
// `inter` is not a multiple of 8, or a pointer is not 16-byte aligned, the same kernel runs
// with packs of one element.
//
// Rounding, to match Hugging Face transformers in bf16: LlamaMLP computes
// act_fn(gate_proj(x)) * up_proj(x) as two bf16 tensor ops, so silu(gate) is rounded to bf16
// before the multiply, and the product is rounded again. We do the math in float32 and round
// at the same two places, which makes the kernel bit-identical to HF (up to expf's last bit).
// Reference: activation.py (silu_mul_native). Run: nox -s grade -- 08
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdint>

#include "pdl.cuh"
#include "tvllm.h"
#include "vec.cuh"

// One output element from its gate and up values (both bf16).
__device__ __forceinline__ __nv_bfloat16 silu_mul_one(__nv_bfloat16 gate, __nv_bfloat16 up) {
  // BEGIN SOLUTION: silu(gate) in float32, rounded to bf16 as HF; times up; rounded | return gate;
  float g = __bfloat162float(gate);
  float act = __bfloat162float(__float2bfloat16(g / (1.0f + expf(-g))));
  return __float2bfloat16(act * __bfloat162float(up));
  // END SOLUTION
}

// x: [rows, 2 * inter], out: [rows, inter], both contiguous; inter % kVec == 0.
// Thread i owns outputs [i * kVec, (i + 1) * kVec) of the flattened out.
template <int kVec>
__global__ void silu_mul_kernel(const __nv_bfloat16* __restrict__ x,
                                __nv_bfloat16* __restrict__ out, int64_t rows, int64_t inter) {
  // A decode step's next kernel (stage 06's GEMV) may start loading its weights now, and this
  // one may have started before the previous kernel ended: x only after the wait
  // (course/cuda/pdl.cuh).
  allow_next_kernel_to_start();
  wait_for_previous_kernel();
  // BEGIN SOLUTION: find this thread's row and column, load a pack of gate and of up, store
  const int64_t packs_per_row = inter / kVec;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * packs_per_row) return;
  const int64_t row = i / packs_per_row;
  const int64_t col = (i % packs_per_row) * kVec;
  const __nv_bfloat16* gate = x + row * 2 * inter + col;
  const Pack<__nv_bfloat16, kVec> g = *reinterpret_cast<const Pack<__nv_bfloat16, kVec>*>(gate);
  const Pack<__nv_bfloat16, kVec> u = *reinterpret_cast<const Pack<__nv_bfloat16, kVec>*>(gate + inter);
  Pack<__nv_bfloat16, kVec> r;
#pragma unroll
  for (int j = 0; j < kVec; ++j) r.v[j] = silu_mul_one(g.v[j], u.v[j]);
  *reinterpret_cast<Pack<__nv_bfloat16, kVec>*>(out + row * inter + col) = r;
  // END SOLUTION
}

constexpr int kThreads = 256;

// x: [rows, 2 * inter] bf16 (gate then up), out: [rows, inter] bf16, both contiguous.
tvllm_status launch_silu_mul(const __nv_bfloat16* x, __nv_bfloat16* out, int64_t rows,
                             int64_t inter, cudaStream_t stream) {
  if (rows == 0 || inter == 0) return TVLLM_OK;
  // BEGIN SOLUTION: packs of 8 if inter % 8 == 0 and 16-byte aligned, else of 1 | return "{todo}";
  const bool vec8 = inter % 8 == 0 && tvllm_aligned(x, 16) && tvllm_aligned(out, 16);
  const int64_t threads_needed = rows * inter / (vec8 ? 8 : 1);
  const int64_t blocks = tvllm_ceil_div(threads_needed, kThreads);
  if (vec8) {
    launch_early(silu_mul_kernel<8>, blocks, kThreads, 0, stream, x, out, rows, inter);
  } else {
    launch_early(silu_mul_kernel<1>, blocks, kThreads, 0, stream, x, out, rows, inter);
  }
  return TVLLM_OK;
  // END SOLUTION
}

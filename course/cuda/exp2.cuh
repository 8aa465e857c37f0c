// 2^x for the online softmax of stages 09, 12 and 14's kernels: scores in base 2 (scale * log2 e
// folded in), so every exponential is one of these.
//
// exp2f() compiles to the special-function unit's ex2 plus a range check and two multiplies
// that keep results below 2^-126 (float32 denormals) exact. A softmax weight that small is 0
// in bf16 anyway, so fast_exp2 asks for ex2.approx.ftz alone: one instruction (MUFU.EX2),
// exp2(-inf) = 0, relative error ~2^-22. Off the GPU (the CPU emulator) it is exp2f.
#pragma once
#include <cmath>

__host__ __device__ __forceinline__ float fast_exp2(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2f(x);
#endif
}

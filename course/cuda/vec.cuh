// Vector packs and float conversions shared by the memory-bound kernels (device code only).
//
// A Pack<T, N> is N consecutive elements aligned so that loading one is one instruction:
// 16 bytes when N * sizeof(T) == 16 (8 bf16 or 4 floats), the widest load a thread can
// issue. Kernels read and write through packs so a warp moves 512 contiguous bytes at once.
#pragma once
#include <cuda_bf16.h>

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

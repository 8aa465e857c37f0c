// Vector packs and float conversions shared by the memory-bound kernels (device code only).
//
// A Pack<T, N> is N consecutive elements aligned so that loading one is one instruction:
// 16 bytes when N * sizeof(T) == 16 (8 bf16 or 4 floats), the widest load a thread can
// issue. Kernels read and write through packs so a warp moves 512 contiguous bytes at once.
#pragma once
#include <cuda_bf16.h>
#include <cstdint>

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// One 32-bit word of two bf16 -> two floats (x: the low half). A bf16 is the top half of a
// float32, so each is one instruction, a shift or a mask (__bfloat162float of a half picked
// out of the word takes two).
__device__ __forceinline__ float2 unpack_bf16(uint32_t r) {
  return make_float2(__uint_as_float(r << 16), __uint_as_float(r & 0xffff0000u));
}

// A 16-byte pack (a uint4, a Pack of 8 bf16) as its four 32-bit words of two bf16 each, to
// convert two values at a time.
template <typename P>
__device__ __forceinline__ uint32_t* words(P& pack) {
  static_assert(sizeof(P) == 16, "words: a 16-byte pack");
  return reinterpret_cast<uint32_t*>(&pack);
}

// Two floats -> one register of two bf16, the first in the low half (the lower column).
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 two = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&two);
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

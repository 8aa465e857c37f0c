// cp.async: 16 bytes from global to shared memory without passing through registers.
//
// A thread issues copies, groups them (copies_commit), and later waits until at most N of its
// groups are still in flight (copies_wait<N>). Meanwhile it holds no registers for them, so a
// warp can keep many more bytes in flight than its registers could hold: what a memory-bound
// kernel needs to reach the memory's bandwidth (about 64 KB in flight per H200 SM).
// sm_80 and later; below that (a T4) the same calls copy synchronously: correct, not overlapped.
#pragma once
#include <cuda_runtime.h>

// With ok = false nothing is read and the 16 bytes are zero-filled. L2::128B: the L2 fetches the
// whole 128-byte line from memory at once (as CUTLASS asks), not sector by sector; stage 14's
// 64x1024 row took 41.3 us with it, 42.1-42.2 without, in one call (H200;
// 256B: 42.5).
__device__ __forceinline__ void copy16(uint4* dst, const void* src, bool ok) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(src),
               "r"(ok ? 16 : 0)
               : "memory");
#else
  *dst = ok ? *static_cast<const uint4*>(src) : make_uint4(0u, 0u, 0u, 0u);
#endif
}

__device__ __forceinline__ void copies_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Wait until at most `kPending` of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void copies_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

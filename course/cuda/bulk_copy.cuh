// Bulk copies (sm_90): one thread asks the SM's copy engine (the Tensor Memory Accelerator)
// for a whole contiguous block of global memory -- here 8-16 KB of weights -- into shared
// memory, with one instruction, and an mbarrier in shared memory counts the bytes as they land.
//
//     barrier_init(bar, 1)                    once, by one thread, before the block's barrier
//     barrier_expect_bytes(bar, n)            one thread: "this phase ends when n bytes land"
//     bulk_copy(dst, src, bytes, bar, pol)    that thread, one or more copies adding up to n
//                                             (pol: an L2 policy, evict_first_policy())
//     barrier_wait(bar, phase)                any thread: until phase `phase` (0, 1, 0, ...) ends
//
// Compared with cp.async (cp_async.cuh: 16 bytes per thread per instruction, a thousand
// instructions for 16 KB), the warps issue almost nothing: they only compute, and a kernel
// needs far fewer of them on an SM to keep the same bytes in flight (stage 06's lesson).
// The copies carry an L2 policy: data streamed once (a decode step's weights, 2 GB for
// Llama-3.2-1B against a 60 MB L2) is marked first to go, so that what a step reads again --
// the KV cache, the activations, the block tables -- stays in the L2 from one step to the next
// (stage 06's lesson, "Weights first out of the L2").
// Sizes and addresses are multiples of 16 bytes. Below sm_90 there is no such instruction: the
// host code must not launch a kernel that uses these there; in host code (the CPU emulator of
// tests/cuda_emulator) bulk_copy copies at once and the barrier calls do nothing.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

__device__ __forceinline__ void barrier_init(uint64_t* bar, unsigned arrivals) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(addr), "r"(arrivals) : "memory");
  // make the initialized barrier visible to the copy engine before any copy signals it
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

__device__ __forceinline__ void barrier_expect_bytes(uint64_t* bar, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(addr), "r"(bytes)
               : "memory");
#endif
}

// An L2 policy for bulk_copy: the lines it brings in are the first the L2 evicts.
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
#endif
  return policy;
}

__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes,
                                          uint64_t* bar, uint64_t policy) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1], %2, [%3], %4;"
      ::"r"(to), "l"(src), "r"(bytes), "r"(addr), "l"(policy) : "memory");
#else
  (void)bar;
  (void)policy;
  std::memcpy(dst, src, bytes);
#endif
}

__device__ __forceinline__ void barrier_wait(uint64_t* bar, unsigned phase) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile(
      "{\n .reg .pred done;\n WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT_%=;\n}" ::"r"(addr), "r"(phase) : "memory");
#endif
}

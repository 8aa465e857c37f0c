// Programmatic dependent launch (PDL, sm_90): letting the next kernel of a stream start early.
//
// A kernel launched with cudaLaunchAttributeProgrammaticStreamSerialization (stage 06's GEMV)
// may begin once every block of the kernel before it has called allow_next_kernel_to_start()
// (or exited), instead of when that kernel has finished. It must call
// wait_for_previous_kernel() before it reads anything the previous kernel writes (or writes
// anything it reads): that returns once the previous kernel has finished and its writes are
// visible. Before the wait, it may load what no kernel of the step writes, e.g. weights.
//
// Calling allow_next_kernel_to_start() at the top of a kernel is always safe: it only lets a
// PDL-launched successor be scheduled (its wait still waits for all of this kernel), and does
// nothing when the successor was launched normally. Below sm_90 both compile to nothing.
#pragma once

__device__ __forceinline__ void allow_next_kernel_to_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

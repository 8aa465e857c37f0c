// Programmatic dependent launch (PDL, sm_90): letting the next kernel of a stream start early.
//
// A kernel launched with cudaLaunchAttributeProgrammaticStreamSerialization (stage 06's GEMV)
// may begin once every block of the kernel before it has called allow_next_kernel_to_start()
// (or exited), instead of when that kernel has finished. It must call
// wait_for_previous_kernel() before it reads anything the previous kernel writes (or writes
// anything it reads): that returns once the previous kernel has finished and its writes are
// visible. Before the wait, it may load what no kernel of the step writes: the weights, and
// the step's inputs (token ids, positions, slot mapping, block tables, context lengths). Those
// are in place before the step's first kernel starts -- the embedding is launched with
// <<<...>>>, so it starts once everything before it in the stream has finished, and every
// kernel of the step starts after it -- while a kernel several places back in the step may
// still be running (each lets its successor start at its top), so nothing else is safe to read
// early, and nothing at all to write. Called alone (a test, a benchmark), such a kernel may
// follow the torch kernel that wrote its weight or its positions; torch's elementwise and
// random kernels do not call allow_next_kernel_to_start(), so it starts only once every block
// of that kernel has exited (the condition under which the GEMV has always loaded its weights
// early; the guarantee that those writes are visible is formally the wait's, which is why the
// engine's steps rely on the embedding's normal launch instead).
//
// Calling allow_next_kernel_to_start() at the top of a kernel is always safe: it only lets a
// PDL-launched successor be scheduled (its wait still waits for all of this kernel), and does
// nothing when the successor was launched normally. Below sm_90 both compile to nothing.
//
// The small kernels of a decode step (RMSNorm, rope, the cache write, paged attention and its
// reduction, SiLU-mul) call allow_next_kernel_to_start() at their top and are launched with
// launch_early() instead of <<<...>>>: at batch 1 a step is ~160 kernels of a few
// microseconds, and each boundary costs the next kernel's launch and start-up; with PDL that
// overlaps the previous kernel's end. What they may read early, they read before their wait
// (RMSNorm its weight, rope the position, the cache write the slot, paged attention the
// context length and the block table: each a memory latency off the step's critical path).
// (A kernel launched with <<<...>>> is still correct: it just starts later.)
#pragma once
#include <cuda_runtime.h>

#include "tvllm.h"

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

// Whether the code of `kernel` that runs on this device was built for sm_90 or later, so that
// its sm_90 instructions (the PDL wait, bulk copies) are in it: a compute_75 build run on an
// H200 has none. No answer: false.
template <typename Kernel>
bool built_for_sm90(Kernel kernel) {
  cudaFuncAttributes attributes;
  if (cudaFuncGetAttributes(&attributes, kernel) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attributes.ptxVersion >= 90;
}

// Whether `kernel` may be launched early: its code has the wait and TINYVLLM_PDL is not "0".
template <typename Kernel>
bool may_launch_early(Kernel kernel) {
  return !turned_off("TINYVLLM_PDL") && built_for_sm90(kernel);
}

// kernel<<<grid, block, smem, stream>>>(args...), as a programmatic dependent launch where
// may_launch_early says so. The error, like a <<<...>>> launch's, is also cudaGetLastError()'s.
template <typename... Params, typename... Args>
cudaError_t launch_early(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                         cudaStream_t stream, Args... args) {
  static const bool early = may_launch_early(kernel);  // one answer per build: one flag set
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = early ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
}

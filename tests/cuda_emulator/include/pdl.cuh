// emulator's pdl.cuh: no PDL; launch_early runs the grid on the CPU
#pragma once
#include "tvllm.h"  // turned_off
inline void allow_next_kernel_to_start() {}
inline void wait_for_previous_kernel() {}
template <typename Kernel> bool built_for_sm90(Kernel) { return false; }
template <typename Kernel> bool may_launch_early(Kernel) { return false; }
template <typename... Params, typename... Args>
cudaError_t launch_early(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                         cudaStream_t, Args... args) {
  return emu::launch(kernel, grid, block, smem, args...);
}

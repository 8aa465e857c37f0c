// The contract between a kernel file (.cu, no torch headers) and its binding (.cpp).
//
// Every kernel file exports plain C++ launchers that take raw device pointers, sizes and a
// stream. A launcher returns TVLLM_OK (nullptr) when it queued its kernel, or a message:
// "TODO stage NN: ..." from an unfinished skeleton, or why it refused its arguments.
// The binding turns that message into a Python exception and checks cudaGetLastError().
#pragma once
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <cuda_runtime.h>

typedef const char* tvllm_status;
#define TVLLM_OK nullptr

// Blocks needed to cover n items with `per_block` items each.
inline int64_t tvllm_ceil_div(int64_t n, int64_t per_block) { return (n + per_block - 1) / per_block; }

// Whether p is a multiple of `bytes` (a power of two): vector loads and stores of that width
// need it, so a launcher picks its wide path, or a binding refuses a tensor, by it.
inline bool tvllm_aligned(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Whether the environment variable `name` is "0": a speed-up turned off, to measure its gain
// (TINYVLLM_PDL, TINYVLLM_GEMV_TMA).
inline bool turned_off(const char* name) {
  const char* env = std::getenv(name);
  return env != nullptr && std::strcmp(env, "0") == 0;
}

// The current device's SMs; 0 when it does not answer (the error is cleared: the caller says
// what went wrong). Launchers size persistent grids and the split-K choice with it.
inline int tvllm_sm_count() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return sms;
}

// Rows of pinned host memory a kernel also stores its answers in (rows == nullptr: none):
// row *slot of rows [slots, stride], read by the kernel when it runs (a step input on the
// device), so a CUDA graph replays with another slot; a slot outside [0, slots) stores
// nothing (a kernel cannot raise). Stage 08's argmax and stage 06's lm_head GEMV store a
// decode step's tokens there (host_rows.cuh reads the slot; binding.h checks the tensors).
struct HostRows {
  int64_t* rows;
  const int64_t* slot;
  int64_t stride, slots;
};

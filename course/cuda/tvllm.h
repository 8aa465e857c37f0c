// The contract between a kernel file (.cu, no torch headers) and its binding (.cpp).
//
// Every kernel file exports plain C++ launchers that take raw device pointers, sizes and a
// stream. A launcher returns TVLLM_OK (nullptr) when it queued its kernel, or a message:
// "TODO stage NN: ..." from an unfinished skeleton, or why it refused its arguments.
// The binding turns that message into a Python exception and checks cudaGetLastError().
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

typedef const char* tvllm_status;
#define TVLLM_OK nullptr

// Blocks needed to cover n items with `per_block` items each.
inline int64_t tvllm_ceil_div(int64_t n, int64_t per_block) { return (n + per_block - 1) / per_block; }

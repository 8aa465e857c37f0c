// The row of pinned host memory a kernel stores its answers in (tvllm.h's HostRows), or
// nullptr: none asked for, or a slot outside the buffer. One read of the slot: a step input,
// so a kernel launched early may read it before its PDL wait (pdl.cuh).
#pragma once
#include "tvllm.h"

__device__ __forceinline__ int64_t* host_row(const HostRows& host) {
  const int64_t slot = host.rows == nullptr ? -1 : *host.slot;
  return slot >= 0 && slot < host.slots ? host.rows + slot * host.stride : nullptr;
}

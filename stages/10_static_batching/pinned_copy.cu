// GIVEN FILE: generated from solutions/10_static_batching/pinned_copy.cu by `nox -s sync-stages`.
// Read it; do not edit it. It is not graded (the grader uses the reference
// copy), and any edit here is overwritten.
// Stage 10, given code: a copy between pinned host memory and the GPU made by a kernel,
//
//     dst[i] = src[i],  i < words (8-byte words), one side pinned host memory, the other the GPU's
//
// not by the copy engine. Between two decode steps of one sequence the GPU had three copies to
// make (the step's tokens out, the next step's inputs in, the sampled ids into the graph's ids
// row), each a few KB at most. As cudaMemcpyAsync calls each is a copy-engine operation, and
// each hand-over between the compute engine and a copy engine left the GPU idle for 1.5-6 us
// (H200: from the argmax's end to the next step's first kernel 21 us,
// 2.6% of a token; 7 us with this kernel, the greedy ids no longer copied at all). A kernel
// reaches pinned host memory directly: with unified virtual addressing a pinned buffer's host
// pointer is also a device pointer, and its loads and stores cross PCIe like any memory
// access. It runs on the compute engine, right after the kernel before it.
//
// Each thread moves one 8-byte word (the buffers are int64 rows): up to 256 blocks of 256
// threads move 512 KB in one round, more than a step's inputs, so the copy pays one PCIe
// round trip, not one per word.
// Reference: dst.copy_(src). Used by pinned_copy.py.
#include <cuda_runtime.h>
#include <cstdint>

#include "tvllm.h"

namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 256;

__global__ void pinned_copy_kernel(uint64_t* __restrict__ dst, const uint64_t* __restrict__ src,
                                   int64_t words) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < words; i += stride)
    dst[i] = src[i];
}

}  // namespace

// dst, src: `words` 8-byte words, 8-byte aligned, each either device memory or pinned host
// memory that the device can address (the binding checks which).
tvllm_status launch_pinned_copy(void* dst, const void* src, int64_t words, cudaStream_t stream) {
  if (words <= 0) return TVLLM_OK;
  if (!tvllm_aligned(dst, 8) || !tvllm_aligned(src, 8))
    return "both buffers must be 8-byte aligned";
  const int64_t blocks = tvllm_ceil_div(words, kThreads);
  pinned_copy_kernel<<<static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks), kThreads,
                       0, stream>>>(static_cast<uint64_t*>(dst), static_cast<const uint64_t*>(src),
                                    words);
  return TVLLM_OK;
}

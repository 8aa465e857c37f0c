// Stage 08 kernel: argmax over the vocabulary, one row of logits per block (greedy decoding).
//
// For each row b of logits [rows, vocab], out[b] is the index of the largest logit -- the
// token greedy decoding picks. It is a parallel reduction, like RMSNorm's sum, but over
// (value, index) pairs with "better" in place of "+":
//
//   1. each thread scans a strided slice of the row (16-byte loads: 8 bf16 or 4 float32,
//      several issued before any is compared) and keeps its best pair;
//   2. each warp combines its 32 pairs with shuffles (5 steps, no shared memory);
//   3. each warp's lane 0 writes its pair to shared memory; warp 0 combines those.
//
// "Better" must be a total order so the answer does not depend on which thread saw what:
//   - a NaN beats every number (torch.argmax treats NaN as the maximum: a row with a NaN
//     returns the index of its first NaN);
//   - of two equal values (or two NaNs), the LOWER index wins (torch returns the first
//     maximum); -0.0 and +0.0 are equal;
//   - otherwise the larger value wins.
// A thread with nothing to scan holds (-inf, INT_MAX), which loses to every real element,
// so a row of -inf still returns 0.
// Reference: argmax.py (argmax_native, which is torch.argmax). Run: nox -s grade -- 08
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <climits>
#include <cstdint>

#include "tvllm.h"
#include "vec.cuh"

struct ArgBest {
  float value;
  int index;
};

// The better of two (value, index) pairs, by the order described above.
__device__ __forceinline__ ArgBest better(ArgBest a, ArgBest b) {
  // TODO stage 08: NaN beats numbers; larger wins; equal (or 2 NaNs): lower index (about 5 lines)
  return a;
}

// Every lane ends with the best pair of its warp (the order is total, so the butterfly's
// partners agree).
__device__ __forceinline__ ArgBest warp_argmax(ArgBest best) {
  // TODO stage 08: 5 butterfly steps of __shfl_xor_sync on value and index (about 7 lines)
  return best;
}

// Packs each thread loads before it compares any: one 16-byte load in flight per thread is
// too few to cover the memory latency (measured on an H200 at 4096 rows: 79% of a copy's
// bandwidth with one, 91% with four). Four packs of bf16 take 48 registers a thread, so
// blocks of 512 threads (not 1024) let two blocks share an SM.
constexpr int kUnroll = 4;
constexpr int kThreads = 512;  // a multiple of 32: every warp is full for the shuffles
constexpr int kWarps = kThreads / 32;

// The thread's own scan sees its indices in increasing order, so a later element wins only if
// it is strictly greater, or the first NaN: a cheaper test than better(), same answer. The
// starting pair (-inf, INT_MAX) means "nothing yet": the first element always replaces it.
__device__ __forceinline__ void scan(ArgBest& best, float v, int index) {
  if (best.index == INT_MAX || v > best.value || (isnan(v) && !isnan(best.value))) {
    best = ArgBest{v, index};
  }
}

// logits: [rows, vocab] contiguous, vocab % kVec == 0; out: [rows] int64. One block per row.
template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads)
argmax_kernel(const T* __restrict__ logits, int64_t* __restrict__ out, int vocab) {
  // TODO stage 08: packed strided scan (kUnroll loads, then the compares); warp_argmax; __shared__ ArgBest[kWarps]; warp 0 ends (about 28 lines)
}

template <typename T>
static tvllm_status launch_argmax(const T* logits, int64_t* out, int64_t rows, int64_t vocab,
                                  cudaStream_t stream) {
  if (rows == 0) return TVLLM_OK;
  if (vocab <= 0 || vocab >= INT_MAX - kThreads * 8 * kUnroll) return "vocab size out of range";
  // TODO stage 08: a block of kThreads per row; 16-byte packs if rows aligned (about 8 lines)
  return "TODO stage 08: a block of kThreads per row; 16-byte packs if rows aligned (about 8 lines)";
}

// logits: [rows, vocab] bf16 or float32, contiguous -> out: [rows] int64
tvllm_status launch_argmax_bf16(const __nv_bfloat16* logits, int64_t* out, int64_t rows,
                                int64_t vocab, cudaStream_t stream) {
  return launch_argmax(logits, out, rows, vocab, stream);
}

tvllm_status launch_argmax_f32(const float* logits, int64_t* out, int64_t rows, int64_t vocab,
                               cudaStream_t stream) {
  return launch_argmax(logits, out, rows, vocab, stream);
}

// Stage 08 kernel: argmax over the vocabulary (greedy decoding).
//
// For each row b of logits [rows, vocab], out[b] is the index of the largest logit -- the
// token greedy decoding picks. It is a parallel reduction, like RMSNorm's sum, but over
// (value, index) pairs with "better" in place of "+". A block reduces a piece of a row:
//
//   1. each thread scans a strided slice of the piece (16-byte loads: 8 bf16 or 4 float32,
//      several issued before any is compared) and keeps its best pair;
//   2. each warp combines its 32 pairs with shuffles (5 steps, no shared memory);
//   3. each warp's lane 0 writes its pair to shared memory; warp 0 combines those.
//
// With many rows a piece is a whole row. With few (a decode step of one sequence: one row
// of 128256) a row is cut into pieces so that every SM has work, and the last block of a
// row to finish combines the pieces' pairs (given: argmax_kernel).
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
#include <algorithm>
#include <climits>
#include <cstdint>

#include "host_rows.cuh"
#include "pdl.cuh"
#include "tvllm.h"
#include "vec.cuh"

struct ArgBest {
  float value;
  int index;
};

// Row r's answer: into out, and into the host row when there is one.
__device__ __forceinline__ void put_answer(int64_t* out, int64_t* answers, int r, int index) {
  out[r] = index;
  if (answers != nullptr) answers[r] = index;
}

// The better of two (value, index) pairs, by the order described above.
__device__ __forceinline__ ArgBest better(ArgBest a, ArgBest b) {
  // BEGIN SOLUTION: NaN beats numbers; larger wins; equal (or 2 NaNs): lower index | return a;
  const bool a_nan = isnan(a.value), b_nan = isnan(b.value);
  if (a_nan != b_nan) return a_nan ? a : b;
  if (a.value > b.value) return a;
  if (b.value > a.value) return b;
  return a.index <= b.index ? a : b;
  // END SOLUTION
}

// Every lane ends with the best pair of its warp (the order is total, so the butterfly's
// partners agree).
__device__ __forceinline__ ArgBest warp_argmax(ArgBest best) {
  // BEGIN SOLUTION: 5 butterfly steps of __shfl_xor_sync on value and index | return best;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    ArgBest other{__shfl_xor_sync(0xffffffffu, best.value, offset),
                  __shfl_xor_sync(0xffffffffu, best.index, offset)};
    best = better(best, other);
  }
  return best;
  // END SOLUTION
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

// The best pair of row[begin, end) (end - begin a multiple of kVec when kVec > 1), in thread
// 0 of the block; the other threads' return values are not meaningful.
template <typename T, int kVec>
__device__ __forceinline__ ArgBest block_argmax(const T* __restrict__ row, int begin, int end) {
  // BEGIN SOLUTION: packed strided scan of [begin, end) (kUnroll loads, then the compares); warp_argmax; __shared__ ArgBest[kWarps]; warp 0 combines | return ArgBest{-INFINITY, INT_MAX};
  using P = Pack<T, kVec>;
  constexpr int kStride = kThreads * kVec;  // elements between a thread's consecutive packs
  ArgBest best{-INFINITY, INT_MAX};
  for (int base = begin + threadIdx.x * kVec; base < end; base += kStride * kUnroll) {
    P p[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * kStride < end) p[u] = *reinterpret_cast<const P*>(row + base + u * kStride);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * kStride < end) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) scan(best, to_float(p[u].v[j]), base + u * kStride + j);
      }
    }
  }
  best = warp_argmax(best);
  __shared__ ArgBest warp_best[kWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_best[warp] = best;
  __syncthreads();
  if (warp == 0) {
    best = lane < kWarps ? warp_best[lane] : ArgBest{-INFINITY, INT_MAX};
    best = warp_argmax(best);
  }
  return best;
  // END SOLUTION
}

// logits: [rows, vocab] contiguous, vocab % kVec == 0; out: [rows] int64.
// Block i scans piece i % pieces of row i / pieces: elements [piece * span, piece * span + span)
// of it. With one piece a row the block writes its answer. With several, each block leaves its
// pair in partial[i] and takes a ticket from its row's counter; the block that draws the last
// ticket combines the row's pairs, writes the answer and sets the counter back to 0 (stage 14
// merges its split-K partitions the same way).
// Launched early (pdl.cuh) behind the lm_head: its blocks are in place when the logits are done,
// and the wait returns then, where a normal launch would only begin.
// Each answer also goes to `host` when it has rows: pinned host memory, so that a decode step's
// tokens reach the host with no copy after the step (stage 10; the slot is a step input, read
// before the wait).
template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads)
argmax_kernel(const T* __restrict__ logits, int64_t* __restrict__ out, int vocab, int pieces,
              int span, ArgBest* __restrict__ partial, int32_t* __restrict__ tickets,
              HostRows host) {
  allow_next_kernel_to_start();
  int64_t* const answers = host_row(host);  // tvllm.h's HostRows: where else the answers go
  wait_for_previous_kernel();
  const int r = blockIdx.x / pieces, piece = blockIdx.x % pieces;
  const int begin = piece * span;
  ArgBest best = block_argmax<T, kVec>(logits + static_cast<int64_t>(r) * vocab, begin,
                                       min(vocab, begin + span));
  if (pieces == 1) {
    if (threadIdx.x == 0) put_answer(out, answers, r, best.index);
    return;
  }
  __shared__ bool s_last;
  if (threadIdx.x == 0) {
    partial[blockIdx.x] = best;
    __threadfence();  // the pair is visible before the ticket that says it is there
    s_last = atomicAdd(tickets + r, 1) == pieces - 1;
    if (s_last) tickets[r] = 0;  // every block of the row has drawn: ready for the next launch
  }
  __syncthreads();
  if (!s_last || threadIdx.x >= 32) return;
  __threadfence();
  // Other blocks wrote these pairs: read them from the L2 (__ldcg), not this SM's L1.
  best = ArgBest{-INFINITY, INT_MAX};
  const ArgBest* row_pairs = partial + static_cast<int64_t>(r) * pieces;
  for (int i = threadIdx.x; i < pieces; i += 32) {
    best = better(best, ArgBest{__ldcg(&row_pairs[i].value), __ldcg(&row_pairs[i].index)});
  }
  best = warp_argmax(best);
  if (threadIdx.x == 0) put_answer(out, answers, r, best.index);
}

// How many blocks may share a row: enough for two per SM (a lone block streams a 128256-entry
// row at a few tens of GB/s: 15-16 us on an H200, 7-8 us in pieces). The binding sizes the
// pieces' workspace by it.
int argmax_most_pieces(int64_t rows) {
  return static_cast<int>(std::max<int64_t>(1, (2 * int64_t{tvllm_sm_count()} + rows - 1) / rows));
}

// The pieces of each row (at most argmax_most_pieces), each a whole number of passes of the
// block (a pass: kThreads packs of `pack` elements); *span: the elements of a piece.
static int argmax_pieces(int64_t rows, int64_t vocab, int pack, int* span) {
  const int64_t pass = int64_t{kThreads} * pack;
  const int64_t passes = (vocab + pass - 1) / pass;
  const int64_t most = std::min<int64_t>(argmax_most_pieces(rows), passes);
  const int64_t per_piece = (passes + most - 1) / most;
  *span = static_cast<int>(per_piece * pass);
  return static_cast<int>((passes + per_piece - 1) / per_piece);
}

template <typename T>
static tvllm_status launch_argmax(const T* logits, int64_t* out, int64_t rows, int64_t vocab,
                                  void* partial, int32_t* tickets, HostRows host,
                                  cudaStream_t stream) {
  if (rows == 0) return TVLLM_OK;
  if (vocab <= 0 || vocab >= INT_MAX / 2) return "vocab size out of range";
  // BEGIN SOLUTION: 16-byte packs if rows aligned; argmax_pieces(rows, vocab, pack width, &span); rows * pieces blocks of kThreads (<<<...>>>, or launch_early: pdl.cuh), host passed on | return "{todo}";
  constexpr int kVec = 16 / sizeof(T);
  const bool packed = vocab % kVec == 0 && tvllm_aligned(logits, 16);
  int span = 0;
  const int pieces = argmax_pieces(rows, vocab, packed ? kVec : 1, &span);
  if (pieces > 1 && (partial == nullptr || tickets == nullptr)) {
    return "a row in several pieces needs partial pairs and tickets";
  }
  auto* pairs = static_cast<ArgBest*>(partial);
  const dim3 grid(static_cast<unsigned>(rows * pieces));
  const cudaError_t err =
      packed ? launch_early(argmax_kernel<T, kVec>, grid, dim3(kThreads), 0, stream, logits, out,
                            static_cast<int>(vocab), pieces, span, pairs, tickets, host)
             : launch_early(argmax_kernel<T, 1>, grid, dim3(kThreads), 0, stream, logits, out,
                            static_cast<int>(vocab), pieces, span, pairs, tickets, host);
  return err == cudaSuccess ? TVLLM_OK : cudaGetErrorString(err);
  // END SOLUTION
}

// logits: [rows, vocab] bf16 or float32, contiguous -> out: [rows] int64
// partial: 8 bytes a block, tickets: [rows] int32, 0 (both unused when a row is one piece:
// argmax_pieces says). host: the answers also go to its row *host.slot, the first `rows`
// entries (tvllm.h's HostRows; host.rows == nullptr: nowhere).
tvllm_status launch_argmax_bf16(const __nv_bfloat16* logits, int64_t* out, int64_t rows,
                                int64_t vocab, void* partial, int32_t* tickets, HostRows host,
                                cudaStream_t stream) {
  return launch_argmax(logits, out, rows, vocab, partial, tickets, host, stream);
}

tvllm_status launch_argmax_f32(const float* logits, int64_t* out, int64_t rows, int64_t vocab,
                               void* partial, int32_t* tickets, HostRows host,
                               cudaStream_t stream) {
  return launch_argmax(logits, out, rows, vocab, partial, tickets, host, stream);
}

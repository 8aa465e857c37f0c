// Stage 03 kernel: the embedding lookup, out[t, :] = table[ids[t], :].
//
// A lookup is a row copy: no arithmetic, so the kernel never looks at the dtype, only at
// bytes. One block copies one token's row. Memory-bound copies are fast when every thread
// moves 16 bytes per instruction (uint4: 8 bf16 or 4 floats) and neighbouring threads touch
// neighbouring addresses (coalesced). The launcher picks the widest copy unit that divides the
// row size and both pointers' alignment: 16 bytes for hidden % 8 == 0 in bf16, smaller units
// otherwise (hidden 100 in bf16 is 200 bytes per row: 8-byte units).
//
// A GPU kernel cannot raise. An id outside [0, vocab) must not be read (that is a silent read
// of another buffer, or an illegal address), so the kernel fills that row with all-one bits
// (NaN in bf16 and float32, poison that cannot pass for an embedding) and sets *error = 1; the
// op (embedding.py) reads the flag after the launch and raises, naming the id.
// Reference: embedding.py (embedding_native). Run: nox -s grade -- 03
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdint>

#include "tvllm.h"

namespace {

// A copy unit with every bit set (uint4, uint2, unsigned int, ...: all are plain bit holders).
template <typename Unit>
__device__ __forceinline__ Unit all_ones() {
  Unit u;
  unsigned char* bytes = reinterpret_cast<unsigned char*>(&u);
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(Unit)); ++i) bytes[i] = 0xFF;
  return u;
}

// Block t copies row ids[t] of table into row t of out; both rows are `units` Units long.
template <typename Unit>
__global__ void embedding_kernel(const int64_t* __restrict__ ids, const Unit* __restrict__ table,
                                 Unit* __restrict__ out, int* __restrict__ error, int64_t vocab,
                                 int64_t units) {
  // TODO stage 03: look up this block's id; out of range: poison the row and flag it; else copy with a block-stride loop (about 11 lines)
}

template <typename Unit>
tvllm_status launch(const int64_t* ids, const void* table, void* out, int* error,
                    int64_t tokens, int64_t vocab, int64_t row_bytes, cudaStream_t stream) {
  const int64_t units = row_bytes / static_cast<int64_t>(sizeof(Unit));
  // At most 128 threads, a multiple of 32: hidden 2048 in bf16 (256 uint4s) gives each
  // thread two copies, whose loads the unrolled loop issues together -- more bytes in flight
  // per SM than one copy per thread in 256-thread blocks (measured on an H200: 98% vs 91%
  // of a same-bytes copy's speed).
  const int threads = static_cast<int>(std::min<int64_t>(128, tvllm_ceil_div(units, 32) * 32));
  embedding_kernel<Unit><<<static_cast<unsigned>(tokens), threads, 0, stream>>>(
      ids, static_cast<const Unit*>(table), static_cast<Unit*>(out), error, vocab, units);
  return TVLLM_OK;
}

}  // namespace

// ids: [tokens] int64; table: [vocab, row_bytes] bytes; out: [tokens, row_bytes] bytes;
// error: one int on the device, set to 1 if some id is outside [0, vocab), else left alone.
tvllm_status launch_embedding(const int64_t* ids, const void* table, void* out, int* error,
                              int64_t tokens, int64_t vocab, int64_t row_bytes,
                              cudaStream_t stream) {
  if (tokens == 0 || row_bytes == 0) return TVLLM_OK;
  if (tokens > INT32_MAX) return "more than 2^31 - 1 tokens in one call";
  // TODO stage 03: pick the widest unit (16, 8, 4, 2, 1 bytes) that divides the row size and both pointers (about 7 lines)
  return "TODO stage 03: pick the widest unit (16, 8, 4, 2, 1 bytes) that divides the row size and both pointers (about 7 lines)";
}

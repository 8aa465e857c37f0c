// Stage 14 kernel: decode attention over a PAGED KV cache, with split-K for long contexts.
//
//     out[b, h] = sum_j softmax_j(scale * q[b, h] . K_b[j]) V_b[j],   j < context_lens[b]
//     K_b[j] = k_cache[block_tables[b, j / block_size], j % block_size, g],  g = h / group
//
// Stage 09's kernel read one contiguous slot per sequence. Here a sequence's keys lie in
// blocks of block_size rows scattered over the pool, and its block table says which: key j is
// row j % block_size of physical block block_tables[b, j / block_size]. block_size is a power
// of two, so that is a shift and a mask.
//
// Same plan as stage 09 -- the kernel is memory-bound, so one thread block serves one
// (sequence, KV head) and computes every query head of its GQA group, and K and V are read
// once, not once per query head -- but the arithmetic moves to the tensor cores. Stage 09 has
// 8 lanes share a key, each with 8 of its dims: per key and query head 8 products, a 3-shuffle
// sum and an online-softmax update, and every K and V value converted to float. At 4 query
// heads that is ~40 instructions per key, nearly as many as the memory system leaves time
// for. Here the group's query heads are the rows of a 16 x 16 A operand of mma.sync (stage 12's
// tensor-core product; rows past the group are zeros): S = Q K^T for 16 keys is d/16 x 2
// mma, O += P V another d/16 x 2, the softmax runs on the score fragments, and no shuffle is
// needed per key: ~8 instructions per key. Most of the tensor core's rows compute zeros;
// it does not matter, the kernel waits on memory, not on arithmetic.
//
// A warp never waits for the memory of the keys it is about to use: each step (16 keys) goes
// straight into the warp's ring of kStages slots in shared memory with cp.async, kStages - 1
// steps ahead, each row's 16-byte chunks swizzled so that ldmatrix reads them without bank
// conflicts and each lane group's copy of a row is one aligned 128-byte write. ldmatrix reads
// rows that other lanes copied, so after each lane's cp.async.wait_group the warp meets at
// __syncwarp (and again before a slot is refilled). The block-table entries of a step are read
// one step before its copies are issued, so the copies never wait for the table either.
//
// Split-K (flash-decoding). One sequence gives only n_kv_heads blocks (8 for Llama-3.2-1B, on
// a GPU of 132 SMs). With `partitions` > 1 the grid gets one block per (sequence, KV head,
// partition of partition_keys keys); each writes its partial state (m, l, o / l) in float32,
// takes a ticket from its (sequence, KV head)'s counter, and the block that draws the last
// ticket merges the partitions (merge_partitions) and resets the counter: no second kernel.
// A sequence whose keys fit in one partition writes its rows directly. The partition size
// (1024 keys down to 64 when the grid would otherwise be small: paged_attention_partition_keys)
// and count come from batch, heads and max_context (the engine's max_model_len), not from the
// lengths on the device, so the grid is the same at every step and a CUDA graph can capture
// it: the blocks of partitions past a sequence's length exit at once, take no ticket, and the
// merge reads only the partitions that hold keys. A sequence of at most kWholeKeys keys is one
// partition: nothing to merge.
//
// The new token (optional, p.k_new): a decode step may hand this kernel the step's k and v
// rows before RoPE and the cache write, and q not rotated; the kernel rotates q in registers,
// and the warp whose keys include the new one rotates it and stores it and v in the cache
// before reading them back: stage 13's rope_cache_write then need not run before it.
//
// A context length of 0 is a padding row: zeros. A length past max_keys (the block table's
// capacity, or max_context) or a block number outside the pool is never read: that row is NaN
// (the kernel cannot raise, and the binding reads no device memory: CUDA-graph safe).
// Reference: paged_attention.py (paged_decode_attention_native). Run: nox -s grade -- 14
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cmath>
#include <cstdint>

#include "cp_async.cuh"
#include "exp2.cuh"
#include "mma.cuh"
#include "pdl.cuh"
#include "rope.cuh"
#include "swizzle.cuh"
#include "tvllm.h"
#include "vec.cuh"

namespace {

constexpr int kMaxHeadDim = 128;
constexpr int kPartition = 1024;     // keys per split-K partition, at most (large grids)
constexpr int kMinPartition = 64;    // ... at least: one step of 16 keys per warp
constexpr int kWholeKeys = 256;      // split-K: a sequence this short is one partition (see keys)
constexpr int kMaxPartitions = 8192; // bounds the workspace: 136 MB a sequence at 32 heads of 128
constexpr int kStepKeys = 16;        // keys per warp step: the k of P V's mma
constexpr int kRows = 16;            // query heads per block: the rows of an mma
constexpr int kThreads = 128;        // 4 warps per block
constexpr int kWarps = kThreads / 32;
constexpr int kMergeLoads = 8;      // partitions a thread of the merge loads at once
constexpr float kLog2e = 1.4426950408889634f;

using BF8 = Pack<__nv_bfloat16, 8>;  // 16 bytes: 8 dimensions of one head

struct Params {
  const __nv_bfloat16* q;        // [batch, n_heads, head_dim], rows q_stride apart
  __nv_bfloat16* k;              // [num_blocks, block_size, n_kv_heads, head_dim], contiguous
  __nv_bfloat16* v;              // same shape as k (both written only with p.k_new, below)
  __nv_bfloat16* out;            // [batch, n_heads, head_dim], contiguous
  float* part_o;                 // split-K: [batch, n_heads, partitions, head_dim], o / l
  float* part_ml;                // split-K: [batch, n_heads, partitions, 2]: m (base 2), l
  int32_t* tickets;              // split-K: [batch, gridDim.y], 0 before and after every launch
  const int32_t* block_tables;   // [batch, max_blocks]
  const int32_t* context_lens;   // [batch]: keys to attend (0 = padding row)
  int64_t q_stride;              // elements from one sequence's q row to the next
  int n_heads, n_kv_heads, head_dim;
  int group;                     // n_heads / n_kv_heads
  int head_chunks;               // blocks per KV head: ceil(group / kRows)
  int num_blocks, block_size, block_shift, max_blocks;
  int max_keys;                  // longest context allowed: min(max_blocks * block_size, max_context)
  int partitions;                // 1: one pass, writes out; more: split-K partials
  int partition_keys;            // split-K: keys per partition (the last one may be shorter)
  int whole_keys;                // split-K: a sequence of at most this many keys is one
                                 // partition (kWholeKeys; 0 when the call forces its size)
  float scale_log2;              // scale * log2(e)
  // The new token, when this kernel writes it ("The new token" in the lesson; k_new ==
  // nullptr: the cache write ran before, q is rotated). Its K and V, not yet rotated, [batch,
  // n_kv_heads, head_dim] with rows new_stride apart (views of the QKV projection); q is not
  // rotated either. Its position, and stage 05's table [max_positions, head_dim]: cos | sin.
  const __nv_bfloat16* k_new;
  const __nv_bfloat16* v_new;
  int64_t new_stride;
  const int64_t* positions;      // [batch]
  const float* cos_sin;
  int64_t max_positions;
};

// The softmax state of one query head over some of its keys (base 2): m = max score, l = sum
// 2^(s - m), o = sum 2^(s - m) v for N of its dims (8 for a warp's piece, 4 for a column of
// the split-K merge). The warps' states, and the partitions', are merged with it.
template <int N>
struct Running {
  float m, l, o[N];

  __device__ __forceinline__ void reset() {
    m = -INFINITY;
    l = 0.f;
#pragma unroll
    for (int e = 0; e < N; ++e) o[e] = 0.f;
  }

  // Fold in the state of other keys of the same head.
  __device__ __forceinline__ void merge(float m2, float l2, const float (&o2)[N]) {
    // TODO stage 14: both to the larger max, then add (a state with no key weighs 0) (about 7 lines)
  }
};

// Ring slots per warp: kStages - 1 steps in flight. 2 at head_dim 64, 1 at 128 (chosen when
// rows were padded: three 8.5 KB slots a warp were 102 KB a block, more than the 99 KB an RTX
// 30xx/40xx or an L4 allows; unpadded they would be 96 KB, not measured). At head_dim 64 a grid
// that is one full wave takes 1, one of fewer blocks than SMs 4 (launch_dim says why; "The
// ring" in the lesson's Going faster).
template <int kD>
constexpr int kDefaultStages = kD <= 64 ? 3 : 2;

// Ring slots a warp when the grid has fewer blocks than the GPU has SMs (a decode step of one
// or a few sequences): one more than a warp's steps of a whole short sequence (kWholeKeys
// keys, 4 steps a warp), so that all of them are in flight at once. 80 KB a block at head_dim
// 64 (every sm_80+ GPU allows 99 KB or more); used at head_dim 64 only (launch_dim).
constexpr int kFewBlocksStages = kWholeKeys / (kWarps * kStepKeys) + 1;

// Blocks an SM holds (the kernel's launch bound): at head_dim 64 what 48 KB of shared memory a
// block (kDefaultStages) allows, and the registers that bound leaves each thread.
template <int kD>
constexpr int kBlocksPerSm = kD == 64 ? 4 : 2;

// Shared memory of a block of head size kD with kStages ring slots a warp: during the keys,
// each warp's ring, a slot holding a step's 16 K rows then its 16 V rows of kD bf16, each
// row's chunks swizzled (swizzled); at the end, the warps' states: o as [kWarps][kRows][kD]
// floats, then m and l as [kWarps][kRows].
template <int kD, int kStages>
struct Smem {
  static constexpr int kSlot = 2 * kStepKeys * kD;  // bf16
  static constexpr size_t kRings = static_cast<size_t>(kWarps) * kStages * kSlot * 2;
  static constexpr size_t kMerge = static_cast<size_t>(kWarps) * kRows * (kD + 2) * 4;
  // 48 KB at (64, 3), 80 at (64, 5), 64 at (128, 2)
  static constexpr size_t kBytes = kRings > kMerge ? kRings : kMerge;
};

// S = Q K^T for one step: qf[kk], the A fragment of the query heads' dims 16kk .. 16kk + 15;
// ks, the step's 16 K rows (swizzled). s[j]: the C fragment of keys 8j .. 8j + 7 (this
// lane: rows g and g + 8, keys 8j + 2t and 8j + 2t + 1).
template <int kD>
__device__ __forceinline__ void step_scores(const uint32_t (&qf)[kD / 16][4],
                                            const __nv_bfloat16* ks, int lane,
                                            float (&s)[2][4]) {
#pragma unroll
  for (int j = 0; j < 2; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
  // Lanes 0-7: keys 0-7, dims 0-7 (b0 of key tile 0); 8-15: keys 0-7, dims 8-15 (its b1);
  // 16-23: keys 8-15, dims 0-7 (b0 of tile 1); 24-31: keys 8-15, dims 8-15.
  // Chunk 2kk + half of the row sits at (2kk + half) ^ (row % 8) = chunk0 ^ 2kk, chunk0 the
  // place of chunk half. Rows start at multiples of their size in shared memory (the ring is
  // 1024-byte aligned), so the address for kk is base with bits 5-7 flipped: one XOR.
  const int row = (lane % 8) + 8 * (lane / 16), half = (lane / 8) % 2;
  const uint32_t base = smem_addr(ks + swizzled<kD>(row, half));
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    uint32_t b[4];
    ldmatrix_x4(b, base ^ (kk * 32));
    mma_bf16(s[0], qf[kk], b[0], b[1]);
    mma_bf16(s[1], qf[kk], b[2], b[3]);
  }
}

// The online softmax of one step for this lane's rows r < kR (row g + 8r): s holds the step's
// scores, already times scale * log2(e) and -inf past the keys. m[r]: the row's running max
// (the same in its 4 lanes); l[r]: this lane's share of the running sum (its columns; the 4
// lanes are added once, at the end); o[i][2r], o[i][2r + 1]: the row's unnormalised output,
// dims 8i + 2t and 8i + 2t + 1. On return s holds p = 2^(s - m_new).
template <int kD, int kR>
__device__ __forceinline__ void step_softmax(float (&s)[2][4], float (&m)[kR], float (&l)[kR],
                                             float (&o)[kD / 8][4]) {
#pragma unroll
  for (int r = 0; r < kR; ++r) {
    float mx = fmaxf(m[r], fmaxf(fmaxf(s[0][2 * r], s[0][2 * r + 1]),
                                 fmaxf(s[1][2 * r], s[1][2 * r + 1])));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    // Nothing seen yet: mx = -inf, and -inf - -inf would be NaN; any finite base gives 0s.
    const float base = mx == -INFINITY ? 0.f : mx;
    const float alpha = fast_exp2(m[r] - base);
    m[r] = mx;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      s[j][2 * r] = fast_exp2(s[j][2 * r] - base);
      s[j][2 * r + 1] = fast_exp2(s[j][2 * r + 1] - base);
      sum += s[j][2 * r] + s[j][2 * r + 1];
    }
    l[r] = l[r] * alpha + sum;
#pragma unroll
    for (int i = 0; i < kD / 8; ++i) {
      o[i][2 * r] *= alpha;
      o[i][2 * r + 1] *= alpha;
    }
  }
}

// o += P V for one step: P (16 rows x 16 keys, in s) becomes one bf16 A fragment; vs, the
// step's 16 V rows, read with ldmatrix.trans as B fragments, 16 dims at a time.
template <int kD>
__device__ __forceinline__ void step_values(const float (&s)[2][4], const __nv_bfloat16* vs,
                                            int lane, float (&o)[kD / 8][4]) {
  const uint32_t a[4] = {pack_bf16(s[0][0], s[0][1]), pack_bf16(s[0][2], s[0][3]),
                         pack_bf16(s[1][0], s[1][1]), pack_bf16(s[1][2], s[1][3])};
  // Lanes 0-7: keys 0-7, dims 0-7 (b0 of dim tile i); 8-15: keys 8-15, dims 0-7 (its b1);
  // 16-23: keys 0-7, dims 8-15 (b0 of dim tile i + 1); 24-31: keys 8-15, dims 8-15.
  // As in step_scores: chunk i + half (i even) sits at chunk0 ^ i.
  const int row = (lane % 8) + 8 * ((lane / 8) % 2), half = lane / 16;
  const uint32_t base = smem_addr(vs + swizzled<kD>(row, half));
#pragma unroll
  for (int i = 0; i < kD / 8; i += 2) {
    uint32_t b[4];
    ldmatrix_x4_trans(b, base ^ (i * 16));
    mma_bf16(o[i], a, b[0], b[1]);
    mma_bf16(o[i + 1], a, b[2], b[3]);
  }
}

// Split-K's merge, run by the last block of a (sequence, KV head [, chunk]) to finish: its
// query heads h0 .. h0 + n_here - 1 of sequence b over the `used` partitions that hold keys
//     M = max_i m_i,  w_i = l_i * 2^(m_i - M),  out = sum_i w_i (o_i / l_i) / sum_i w_i
// Threads as [rows][units], a unit = one head's 4 columns: row r merges partitions r, r + rows,
// ... into its own Running<4> as it loads them -- m_i, l_i and 4 columns of o_i / l_i,
// kMergeLoads partitions' worth in one round of loads; partition i's state is (m_i, l_i,
// l_i * (o_i / l_i)) -- then one thread per column merges the rows' states. The partials were
// written by other blocks of this launch: they are read from L2 (__ldcg: this SM's L1 may
// hold nothing of them, but it must not serve them stale).
template <int kD>
__device__ void merge_partitions(const Params& p, int b, int h0, int n_here, int used,
                                 float* smem) {
  const int d = kD == 64 ? 64 : p.head_dim;
  const int cols = d / 4, units = n_here * cols;
  const int rows = max(1, kThreads / units);
  float* s_m = smem;                  // [rows][units]
  float* s_l = s_m + rows * units;    // [rows][units]
  float* s_acc = s_l + rows * units;  // [rows][units][4]
  for (int x = threadIdx.x; x < rows * units; x += kThreads) {
    const int r = x / units, u = x % units, c4 = u % cols;
    const int64_t first = (static_cast<int64_t>(b) * p.n_heads + h0 + u / cols) * p.partitions;
    const float* ml = p.part_ml + first * 2;
    const float* o = p.part_o + first * d;
    // TODO stage 14: a Running<4> acc, reset; per round, load m_i, l_i and o_i[4 c4 ..] (one float4) of partitions i = i0 + k rows < used, k < kMergeLoads, then fold each in: acc.merge(m_i, l_i, l_i * o_i) (the partial is o / l); store acc's m, l and o to s_m, s_l, s_acc at x (about 25 lines)
  }
  __syncthreads();
  // TODO stage 14: per (head, column e): M = max of s_m over the rows at its unit (row 0 holds partition 0: finite); out = sum_r s_acc[r, unit, e % 4] 2^(s_m - M) / sum_r s_l 2^(s_m - M) (about 13 lines)
}

// The new token's key and value, when the attention kernel writes them (p.k_new), at element
// `at` of the caches (at < 0: a block outside the pool, nothing is stored; the kernel's fetch
// marks the row NaN). The warp's lanes take stage 05's pairs (x[i], x[i + d/2]) of k, i = lane,
// lane + 32, ..., and v's 16-byte pieces, lane * 8 (d <= 256): any even head_dim d (a multiple
// of 8). v is read before k's stores: the compiler may not move a read past a store that could
// alias it, and each read is a trip to the L2 on the step's critical path.
__device__ __forceinline__ void write_new_token(const Params& p, int b, int kv_head, int lane,
                                                int d, bool bad_pos, const float* s_rope,
                                                int64_t at) {
  const int half = d / 2;
  const int64_t row = static_cast<int64_t>(b) * p.new_stride + static_cast<int64_t>(kv_head) * d;
  const bool v_lane = lane * 8 < d;
  const BF8 v = v_lane ? *reinterpret_cast<const BF8*>(p.v_new + row + lane * 8) : BF8{};
  for (int i = lane; i < half; i += 32) {
    float x1 = to_float(p.k_new[row + i]), x2 = to_float(p.k_new[row + half + i]);
    rotate_pair(x1, x2, s_rope[i], s_rope[half + i]);
    if (bad_pos) x1 = x2 = NAN;
    if (at >= 0) {
      p.k[at + i] = from_float<__nv_bfloat16>(x1);
      p.k[at + half + i] = from_float<__nv_bfloat16>(x2);
    }
  }
  if (v_lane && at >= 0) *reinterpret_cast<BF8*>(p.v + at + lane * 8) = v;
}

// q as given, rotated in its A fragments (p.k_new): this lane's dims c = 16kk + 2t (+1, +8,
// +9) of rows g and g + 8 (those that hold a head and lie within d); stage 05 pairs dim c with
// c + d/2 (or c - d/2). When d is the kernel's kD, that is the same place in the same lane's
// fragment kk + kD/32 (d/2 spans kD/32 fragments of 16 dims): each pair is rotated once, from
// registers. Otherwise it sits in another fragment, or another lane, so the partner's two
// values are read again from q (where this lane read its own). A position outside the table:
// NaN.
template <int kD>
__device__ __forceinline__ void rotate_q(uint32_t (&qf)[kD / 16][4],
                                         const __nv_bfloat16* q_rows, int n_here, int d,
                                         const float* s_rope, int g, int t, bool bad_pos) {
  const int half = d / 2;
  if (d == kD) {
#pragma unroll
    for (int kk = 0; kk < kD / 32; ++kk) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int row = g + (r % 2 ? 8 : 0), i = 16 * kk + 2 * t + (r >= 2 ? 8 : 0);
        if (row >= n_here) continue;  // zeros stay zeros
        uint32_t &lo = qf[kk][r], &hi = qf[kk + kD / 32][r];  // dims i, i + 1 and i + d/2, +1
        if (bad_pos) {
          lo = hi = 0x7fc07fc0u;  // two bf16 NaNs each
          continue;
        }
        rotate_packed(lo, hi, s_rope + i, s_rope + half + i);
      }
    }
    return;
  }
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int row = g + (r % 2 ? 8 : 0), col = 16 * kk + 2 * t + (r >= 2 ? 8 : 0);
      if (row >= n_here || col >= d) continue;  // zeros stay zeros
      if (bad_pos) {
        qf[kk][r] = 0x7fc07fc0u;  // two bf16 NaNs
        continue;
      }
      const bool first = col < half;
      const int i = first ? col : col - half;  // the pair's index: its angle
      const uint32_t other =
          *reinterpret_cast<const uint32_t*>(q_rows + row * d + (first ? col + half : i));
      uint32_t lo = first ? qf[kk][r] : other, hi = first ? other : qf[kk][r];
      rotate_packed(lo, hi, s_rope + i, s_rope + half + i);
      qf[kk][r] = first ? lo : hi;
    }
  }
}

// One block per (sequence [, partition], KV head [, chunk of 16 of its query heads]):
// blockIdx.x = b * partitions + partition, blockIdx.y = kv_head * head_chunks + chunk.
// kD: 64, or 128 for every other head_dim up to 128 (p.head_dim: its dims past head_dim are
// zeros in shared memory and in Q). kR: rows per lane holding query heads, 1 when a block has
// at most 8 (row g) and 2 above (rows g and g + 8). kWholeSteps: block_size >= kStepKeys.
// kStages: ring slots a warp (Smem; launch_dim picks them).
template <int kD, int kR, bool kWholeSteps, int kStages>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm<kD>) paged_attention_kernel(Params p) {
  // Launched early (pdl.cuh): the o_proj GEMV that follows may start now. The context length,
  // the block table and the position are step inputs that no kernel writes: they are read
  // before the wait below, behind the kernel before (the cache write, or the QKV GEMV when this
  // kernel writes the new token); the caches, q and the new k, v only after it.
  allow_next_kernel_to_start();
  constexpr int kCopies = kStepKeys * (kD / 8) / 32;  // 16-byte pieces of K (and V) per lane
  const int d = kD == 64 ? 64 : p.head_dim;
  const int pieces = d / 8;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, t = lane % 4;

  const int b = blockIdx.x / p.partitions, part = blockIdx.x % p.partitions;
  // TODO stage 14: the KV head, the first query head h0 and how many (n_here, at most kRows) this block computes (about 4 lines)
  const int kv_head = 0, h0 = 0, n_here = 0;

  const int len = p.context_lens[b];
  const bool bad_len = len < 0 || len > p.max_keys;
  // Split-K's partition size for this sequence: the call's, or the whole sequence when it is
  // short ("Short sequences are one partition" in the lesson: a merge costs more than the
  // parallelism saves). From the length on the device, so the grid stays the same.
  const int keys = len <= p.whole_keys ? max(p.partition_keys, p.whole_keys) : p.partition_keys;
  // TODO stage 14: this block's keys [k_begin, k_end): the whole context, or partition `part` of `keys` keys, clipped to len (about 2 lines)
  const int k_begin = 0, k_end = 0;

  // A padding row gets zeros, a row that cannot be read NaN, from the single pass or split-K's
  // partition 0 (no ticket: nothing to merge); a partition without keys has nothing to do.
  const bool fill = part == 0 && (bad_len || len == 0);
  if (!fill && (bad_len || k_begin >= k_end)) return;

  // Row r of physical block n, KV head kv_head: (n * block_size + r) * key_stride + head_off
  // elements into k_cache (and v_cache).
  const int64_t key_stride = static_cast<int64_t>(p.n_kv_heads) * d;
  const int64_t head_off = static_cast<int64_t>(kv_head) * d;
  const int32_t* table = p.block_tables + static_cast<int64_t>(b) * p.max_blocks;

  // Warp w takes steps w, w + kWarps, ... of the block's range; its i-th starts at key
  // first_key(i). my_steps is the same for all 32 lanes, so every lane reaches every
  // collective (shuffle, ldmatrix, mma).
  const int n_steps = fill ? 0 : (k_end - k_begin + kStepKeys - 1) / kStepKeys;
  const int my_steps = warp < n_steps ? (n_steps - warp + kWarps - 1) / kWarps : 0;
  auto first_key = [&](int i) { return k_begin + (warp + i * kWarps) * kStepKeys; };

  // A step's 16 rows x kD / 8 pieces of K (and as many of V), spread over the lanes: this
  // lane's x-th is piece `piece` of row row0 + x * kRowsPerCopy.
  constexpr int kRowsPerCopy = 32 / (kD / 8);
  const int row0 = lane / (kD / 8), piece = lane % (kD / 8);
  // The physical block of the key of each piece this lane copies in its step i.
  auto lookup = [&](int i, int (&blk)[kCopies]) {
    // TODO stage 14: per x: the key j = first_key(i) + its row; its table entry j >> block_shift, read only when i < my_steps and j < k_end (else 0). Optional, for speed: with kWholeSteps one read, the step's first key's, for every x (about 11 lines)
  };
  // The table entries of the first kStages steps, before the wait: ahead[i] for the steps the
  // pipeline issues up front, blk for the one after (then it rolls: see the pipeline).
  int ahead[kStages - 1][kCopies], blk[kCopies];
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) lookup(i, ahead[i]);
  lookup(kStages - 1, blk);

  // The new token (p.k_new): its position's cos | sin row goes to shared memory by cp.async
  // (a step input and a constant table: before the wait). A position outside the table makes
  // q and the new key NaN.
  __shared__ __align__(16) float s_rope[kD];
  const bool rotates = p.k_new != nullptr;
  bool bad_pos = false;
  if (rotates && !fill) {
    const int64_t pos = p.positions[b];
    bad_pos = pos < 0 || pos >= p.max_positions;
    if (threadIdx.x < d / 4)  // the row's d floats, 16 bytes a thread
      copy16(reinterpret_cast<uint4*>(s_rope) + threadIdx.x,
             p.cos_sin + (bad_pos ? 0 : pos * d) + threadIdx.x * 4, !bad_pos);
    copies_commit();
  }
  wait_for_previous_kernel();  // the kernel before has finished: q, k, v and the cache rows

  if (fill) {
    __nv_bfloat16* row = p.out + (static_cast<int64_t>(b) * p.n_heads + h0) * d;
    const __nv_bfloat16 value = __float2bfloat16(bad_len ? NAN : 0.f);
    for (int i = threadIdx.x; i < n_here * d; i += blockDim.x) row[i] = value;
    return;
  }

  // The query heads h0 .. h0 + n_here - 1 as A fragments, row = head, dims 16kk .. 16kk + 15;
  // rows past n_here and dims past d are zeros.
  uint32_t qf[kD / 16][4];
  const __nv_bfloat16* q_rows = p.q + b * p.q_stride + static_cast<int64_t>(h0) * d;
  auto q_pair = [&](int row, int col) -> uint32_t {
    return row < n_here && col < d ? *reinterpret_cast<const uint32_t*>(q_rows + row * d + col) : 0u;
  };
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    qf[kk][0] = q_pair(g, 16 * kk + 2 * t);
    qf[kk][1] = q_pair(g + 8, 16 * kk + 2 * t);
    qf[kk][2] = q_pair(g, 16 * kk + 2 * t + 8);
    qf[kk][3] = q_pair(g + 8, 16 * kk + 2 * t + 8);
  }
  if (rotates) {
    copies_wait<0>();  // this thread's piece of the cos | sin row ...
    __syncthreads();   // ... and every thread's
    // The warp whose steps hold key len - 1 rotates it and stores it, and v, to the cache
    // before it copies that step back (__syncwarp: other lanes copy what these lanes wrote).
    const int last = len - 1;
    if (last >= k_begin && last < k_end && ((last - k_begin) / kStepKeys) % kWarps == warp) {
      const int blk_new = __ldg(table + (last >> p.block_shift));
      write_new_token(p, b, kv_head, lane, d, bad_pos, s_rope,
                      static_cast<unsigned>(blk_new) < static_cast<unsigned>(p.num_blocks)
                          ? (static_cast<int64_t>(blk_new) * p.block_size +
                             (last & (p.block_size - 1))) * key_stride + head_off
                          : -1);
      __syncwarp();
    }
  }
  float o[kD / 8][4];
#pragma unroll
  for (int i = 0; i < kD / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m[kR], l[kR];
#pragma unroll
  for (int r = 0; r < kR; ++r) m[r] = -INFINITY, l[r] = 0.f;

  extern __shared__ __align__(1024) uint4 smem[];  // aligned: step_scores' XOR addressing
  __nv_bfloat16* ring =
      reinterpret_cast<__nv_bfloat16*>(smem) + warp * (kStages * Smem<kD, kStages>::kSlot);
  bool bad_block = false;  // a block number outside the pool: this row will be NaN

  // Issue this lane's copies of its step i into `slot`: K row r as row r of the slot, V row r
  // as row kStepKeys + r, swizzled: this lane's x-th piece at swz[x] (K) and kStepKeys * kD +
  // swz[x] (V).
  const bool my_piece = piece < pieces;
  const int64_t lane_off = row0 * key_stride + head_off + piece * 8;
  int swz[kCopies];  // this lane's x-th piece of K in a slot (V's: kStepKeys * kD further)
#pragma unroll
  for (int x = 0; x < kCopies; ++x) swz[x] = swizzled<kD>(row0 + x * kRowsPerCopy, piece);
  auto fetch = [&](int i, const int (&blk)[kCopies], int slot) {
    if (i >= my_steps) return;  // the same for the whole warp
    __nv_bfloat16* dst = ring + slot * Smem<kD, kStages>::kSlot;
    const int j0 = first_key(i);
    // TODO stage 14: per x: the key j0 + row0 + x * kRowsPerCopy, its row in its block (j & (block_size - 1)), the element offset, copy16 of K and V (to swz[x] and kStepKeys * kD + swz[x] in the slot); keys past k_end, pieces past d and blocks outside the pool are not read (zeros) and the last set bad_block. That loop serves every block size; optional, for speed: with kWholeSteps the step's one block and its first row's offset, each copy kRowsPerCopy rows further (about 30 lines)
  };

  // The pipeline: kStages - 1 steps in flight before the first is used; then per step: wait
  // for its copies (this lane's, then the warp's), issue the step kStages - 1 ahead (into the
  // slot used one step ago), read the table for the step after that, and compute.
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    fetch(i, ahead[i], i);
    copies_commit();
  }
  // The slots of step i (read) and of step i + kStages - 1 (write): i % kStages and the one
  // before it, rolled forward without a division.
  int read = 0, write = kStages - 1;
  if (rotates) rotate_q<kD>(qf, q_rows, n_here, d, s_rope, g, t, bad_pos);  // after the copies
  for (int i = 0; i < my_steps; ++i) {
    copies_wait<kStages - 2>();  // this lane's copies of step i have landed ...
    __syncwarp();                // ... and every lane's: ldmatrix reads them all
    fetch(i + kStages - 1, blk, write);
    copies_commit();             // one group per step, empty or not: the count stays right
    lookup(i + kStages, blk);    // in flight during the compute; used by the next fetch
    const __nv_bfloat16* ks = ring + read * Smem<kD, kStages>::kSlot;
    read = read + 1 == kStages ? 0 : read + 1;
    write = write + 1 == kStages ? 0 : write + 1;
    float s[2][4];
    step_scores<kD>(qf, ks, lane, s);
    // TODO stage 14: each score times p.scale_log2; in the step that holds k_end (the same for the whole warp), -inf for keys at or past it (key first_key(i) + 8j + 2t + e % 2) (about 7 lines)
    step_softmax<kD, kR>(s, m, l, o);
    // With one row per lane, rows g + 8 hold no query head: zeros, never -inf or NaN, into P.
    if (kR == 1) s[0][2] = s[0][3] = s[1][2] = s[1][3] = 0.f;
    step_values<kD>(s, ks + kStepKeys * kD, lane, o);
    __syncwarp();  // every lane is done reading slot i % kStages before it is refilled
  }
  copies_wait<0>();

  // Every warp is done with its ring (the barrier) before the rings become the merge area.
  bad_block = __syncthreads_or(bad_block);
  float* s_o = reinterpret_cast<float*>(smem);
  float* s_m = s_o + kWarps * kRows * kD;
  float* s_l = s_m + kWarps * kRows;
#pragma unroll
  for (int r = 0; r < kR; ++r) {
    const int head = g + 8 * r;
    float sum = l[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    if (head < n_here) {
#pragma unroll
      for (int i = 0; i < kD / 8; ++i) {
        float* dst = s_o + (warp * kRows + head) * kD + 8 * i + 2 * t;
        dst[0] = o[i][2 * r];
        dst[1] = o[i][2 * r + 1];
      }
      if (t == 0) {
        s_m[warp * kRows + head] = m[r];
        s_l[warp * kRows + head] = sum;
      }
    }
  }
  __syncthreads();

  // The partitions that hold keys: one in the single pass, and for a short sequence in
  // split-K, which then writes its rows directly (nothing to merge).
  const int used = p.partitions > 1 ? (len + keys - 1) / keys : 1;

  // One thread per (head, 16-byte piece): merge the warps; then either the final row or this
  // partition's partial state (split-K).
  for (int x = threadIdx.x; x < n_here * pieces; x += blockDim.x) {
    const int h = x / pieces, cc = x % pieces;
    Running<8> acc;
    acc.reset();
    for (int w = 0; w < kWarps; ++w) {
      const float4* src = reinterpret_cast<const float4*>(s_o + (w * kRows + h) * kD + cc * 8);
      const float4 lo = src[0], hi = src[1];
      const float o2[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
      acc.merge(s_m[w * kRows + h], s_l[w * kRows + h], o2);
    }
    const float inv = acc.l > 0.f ? 1.f / acc.l : 0.f;
    const int64_t head_row = static_cast<int64_t>(b) * p.n_heads + h0 + h;
    if (used == 1) {
      BF8 result;
#pragma unroll
      for (int e = 0; e < 8; ++e)
        result.v[e] = __float2bfloat16_rn(bad_block ? NAN : acc.o[e] * inv);
      *reinterpret_cast<BF8*>(p.out + head_row * d + cc * 8) = result;
    } else {
      // TODO stage 14: write o / l (float, 8 values) to part_o[head_row, part, piece cc]; the first piece also writes m and l (l = NaN when bad_block) to part_ml (about 8 lines)
    }
  }
  if (used == 1) return;

  // Split-K: the last of the `used` blocks of this (sequence, KV head [, chunk]) to get here
  // merges them all. Its partials must be visible to that block before its ticket is: the
  // fence orders every thread's writes before the barrier, and thread 0 takes the ticket after.
  __shared__ bool s_last;
  // TODO stage 14: __threadfence and __syncthreads; thread 0: atomicAdd 1 to the ticket of (b, blockIdx.y) (p.tickets[b * gridDim.y + blockIdx.y]); the block that drew used - 1 is the last: it resets the ticket to 0 (every other block of the launch has taken its own) and says so in s_last; __syncthreads; the others return; the last: __threadfence (it reads what the others wrote), then merge_partitions over shared memory (about 11 lines)
}

template <int kD, int kR, bool kWholeSteps, int kStages>
tvllm_status launch(const Params& p, int batch, cudaStream_t stream) {
  // More than the default 48 KB of dynamic shared memory needs an opt-in per kernel.
  constexpr size_t smem = Smem<kD, kStages>::kBytes;
  const cudaError_t opted = cudaFuncSetAttribute(
      paged_attention_kernel<kD, kR, kWholeSteps, kStages>,
      cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (opted != cudaSuccess) {
    cudaGetLastError();  // clear it: the message goes back through the return value
    return cudaGetErrorString(opted);
  }
  // TODO stage 14: the grid, as the kernel reads blockIdx: x = (sequence, partition), y = (KV head, chunk of kRows query heads); then launch_early(paged_attention_kernel<kD, kR, kWholeSteps, kStages>, grid, kThreads, smem, stream, p) (pdl.cuh) and return TVLLM_OK (about 5 lines)
  return "TODO stage 14: the grid, as the kernel reads blockIdx: x = (sequence, partition), y = (KV head, chunk of kRows query heads); then launch_early(paged_attention_kernel<kD, kR, kWholeSteps, kStages>, grid, kThreads, smem, stream, p) (pdl.cuh) and return TVLLM_OK (about 5 lines)";
}

// One or two rows of query heads per lane (at most 8 heads a block, or up to 16); blocks of
// at least kStepKeys rows hold whole steps (steps start at multiples of 16 keys): one table
// entry per step, and a lane's rows kRowsPerCopy rows apart in memory.
template <int kD, int kStages>
tvllm_status launch_rows(const Params& p, int batch, cudaStream_t stream) {
  if (p.block_size >= kStepKeys)
    return p.group > 8 ? launch<kD, 2, true, kStages>(p, batch, stream)
                       : launch<kD, 1, true, kStages>(p, batch, stream);
  return p.group > 8 ? launch<kD, 2, false, kStages>(p, batch, stream)
                     : launch<kD, 1, false, kStages>(p, batch, stream);
}

// One wave, one step in flight: at head_dim 64 an SM holds kBlocksPerSm (4) blocks of the
// 3-slot kernel; when the grid is between 3 and 4 blocks an SM, every SM streams
// with 12 to 16 warps from the first key to the last, and two steps in flight a warp ask the
// memory system for more than it serves well: one step a warp read batch 64 x 1024 3% faster
// on an H200, while grids of several waves (256 x 512) and of fewer blocks (split-K at batch
// 1) were 3-5% slower with it. Fewer blocks than SMs, every step in flight: a block has an SM
// to itself and its warps' steps are a chain of memory latencies, so each warp copies all of
// a short sequence's steps at once (kFewBlocksStages; "The ring" in the lesson).
template <int kD>
tvllm_status launch_dim(const Params& p, int batch, cudaStream_t stream) {
  if constexpr (kD == 64) {
    const int64_t sms = tvllm_sm_count();
    const int64_t blocks =
        static_cast<int64_t>(batch) * p.partitions * p.n_kv_heads * p.head_chunks;
    if (sms > 0 && (kBlocksPerSm<kD> - 1) * sms <= blocks && blocks <= kBlocksPerSm<kD> * sms)
      return launch_rows<kD, 2>(p, batch, stream);
    if (sms > 0 && blocks < sms) return launch_rows<kD, kFewBlocksStages>(p, batch, stream);
  }
  return launch_rows<kD, kDefaultStages<kD>>(p, batch, stream);
}

}  // namespace

// Split-K's partition size: how many keys one thread block of a partition takes, or 0 for the
// single pass. From host values only, so a CUDA graph captured for a batch size keeps its
// choice. split: -1 decide, 0 never, 1 always. max_keys: the longest context the call allows
// (the engine: max_model_len).
//
// The rule: the grid should have at least one block per SM. The single pass has `blocks`
// (batch x KV heads x head chunks); when that is fewer, split into partitions of 1024 keys,
// and halve them (512, 256, 128, 64) while the grid is still short of the target. Large
// partitions where they suffice: each one more is partials to write and, in the block that
// merges, to read ("Split-K and its rule" in the lesson). On 132 SMs a batch of one
// sequence (8 KV heads) gets 64-key partitions up to max_keys 2048 (32 partitions, 256
// blocks), 1024-key ones from 16385.
// What the rule returns before it is written (the skeleton): the binding raises it as a TODO,
// so that no test of the rule passes where it happens to expect the single pass.
constexpr int kRuleNotWritten = -1;
int paged_attention_partition_keys(int batch, int n_heads, int n_kv_heads, int64_t max_keys,
                                   int split) {
  if (split == 0 || n_heads <= 0 || n_kv_heads <= 0 || n_heads % n_kv_heads != 0 ||
      max_keys <= kMinPartition)
    return 0;  // never split, or nothing to split: the single pass
  const int sms = tvllm_sm_count();
  if (sms <= 0)  // no device answer: the single pass, or the largest partitions
    return split > 0 && max_keys > kPartition ? kPartition : 0;
  const int group = n_heads / n_kv_heads;
  const int64_t blocks = static_cast<int64_t>(batch) * n_kv_heads *
                         tvllm_ceil_div(group, kRows);  // the single pass's grid
  const int64_t target = sms;
  // TODO stage 14: decide (split < 0): the single pass (0) when blocks >= target; else keys = kPartition, halved while keys > kMinPartition and blocks * ceil(max_keys / keys) < target; 0 when that is one partition (or more than kMaxPartitions when deciding) (about 6 lines)
  return kRuleNotWritten;
}

// q: [batch, n_heads, head_dim] bf16, rows q_stride elements apart (a multiple of 8), 16-byte
// aligned (it may be a view of a fused QKV tensor). k_cache, v_cache: [num_blocks, block_size,
// n_kv_heads, head_dim] bf16, contiguous; block_size a power of two. block_tables: [batch,
// max_blocks] int32; context_lens: [batch] int32 (never read by the host). out: [batch,
// n_heads, head_dim] bf16. partitions > 1: split-K in partitions of partition_keys keys (a
// sequence of at most kWholeKeys keys in one, unless exact_partitions: a size the call forces),
// with `workspace` holding batch * n_heads * partitions * (head_dim + 2) floats and `tickets` at
// least batch * n_kv_heads * ceil(group / 16) int32 zeros (one per block row; the kernel
// leaves them zero, so they can be kept between calls, but never shared by two launches
// running at once). k_new == nullptr: the new tokens are in the cache and q is rotated;
// else k_new, v_new: [batch, n_kv_heads, head_dim] bf16 rows new_stride apart (a multiple
// of 8), positions: [batch] int64, cos_sin: [max_positions, head_dim] float32, head_dim 64 or
// 128: the kernel rotates q, and stores each sequence's new key (rotated) and value at its key
// context_lens[b] - 1 first.
tvllm_status launch_paged_decode_attention(const void* q, void* k_cache, void* v_cache,
                                           void* out, const int32_t* block_tables,
                                           const int32_t* context_lens, float* workspace,
                                           int32_t* tickets, const void* k_new, const void* v_new,
                                           int64_t new_stride, const int64_t* positions,
                                           const float* cos_sin, int64_t max_positions,
                                           int batch, int64_t q_stride, int n_heads,
                                           int n_kv_heads, int head_dim, int num_blocks,
                                           int block_size, int max_blocks, int max_keys,
                                           int partitions, int partition_keys,
                                           bool exact_partitions, float scale,
                                           cudaStream_t stream) {
  if (batch == 0 || n_heads == 0) return TVLLM_OK;
  const bool grouped = n_kv_heads > 0 && n_heads % n_kv_heads == 0;
  const bool pieces = head_dim > 0 && head_dim % 8 == 0 && head_dim <= kMaxHeadDim &&
                      q_stride % 8 == 0;
  if (!grouped) return "grouped-query attention: n_heads must be a positive multiple of n_kv_heads";
  if (!pieces) return "head_dim (at most 128) and q's row stride must be multiples of 8 (16 bytes)";
  if (block_size <= 0 || (block_size & (block_size - 1)) != 0)
    return "block_size must be a power of two";
  if (num_blocks < 0 || max_blocks < 0 || max_keys < 0) return "sizes must not be negative";
  if (partitions < 1 || partitions > kMaxPartitions ||
      (partitions > 1 && (workspace == nullptr || tickets == nullptr || partition_keys < 1 ||
                          static_cast<int64_t>(partitions) * partition_keys < max_keys)))
    return "split-K needs a workspace, tickets and ceil(max_context / partition_keys) "
           "partitions, at most 8192";
  if (k_new != nullptr &&
      (v_new == nullptr || positions == nullptr || cos_sin == nullptr || new_stride % 8 != 0))
    return "the new token's k, v, positions and cos/sin come together, rows a multiple of 8 "
           "apart";
  const int group = n_heads / n_kv_heads;
  if (static_cast<int64_t>(n_kv_heads) * tvllm_ceil_div(group, kRows) > 65535)
    return "too many KV heads: at most 65535 blocks per sequence";
  int shift = 0;
  while ((1 << shift) < block_size) ++shift;
  const int64_t partials = static_cast<int64_t>(batch) * n_heads * partitions * head_dim;
  float* part_ml = workspace == nullptr ? nullptr : workspace + partials;
  const Params p{static_cast<const __nv_bfloat16*>(q), static_cast<__nv_bfloat16*>(k_cache),
                 static_cast<__nv_bfloat16*>(v_cache), static_cast<__nv_bfloat16*>(out),
                 workspace, part_ml, tickets, block_tables, context_lens, q_stride, n_heads,
                 n_kv_heads, head_dim, group, static_cast<int>(tvllm_ceil_div(group, kRows)),
                 num_blocks, block_size, shift, max_blocks, max_keys, partitions,
                 partition_keys, exact_partitions ? 0 : kWholeKeys, scale * kLog2e,
                 static_cast<const __nv_bfloat16*>(k_new), static_cast<const __nv_bfloat16*>(v_new),
                 new_stride, positions, cos_sin, max_positions};
  // 64 has kernels compiled for its size; every other head_dim up to 128 runs the 128 ones,
  // its dims past head_dim zeros
  const auto by_dim = head_dim == 64 ? launch_dim<64> : launch_dim<128>;
  return by_dim(p, batch, stream);
}

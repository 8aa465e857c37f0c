// Stage 06 kernel, part 2: y = x @ weight^T for a few tokens (decode), as a GEMV.
//
// At 1-8 tokens a Linear layer is a matrix-vector product: every weight is read once and used
// for 1-8 multiply-adds. Its time is the time to stream the weight from memory (8 MB for a
// 2048 x 2048 projection of Llama-3.2-1B: 1.9 us at the H200's ~4.25 TB/s), nothing else. To
// stream at that rate, ~64 KB must be requested and not yet delivered per SM at all times
// (bytes = bandwidth x latency); weights loaded into registers cap that at what the registers
// hold, so here they go to shared memory with cp.async (course/cuda/cp_async.cuh):
//
//     a row is cut into units of 1024 columns (2 KB: 4 pieces of 16 bytes per lane);
//     a row of one unit belongs to one warp; the units of a longer row are shared by the
//     2 or 4 warps of a group in one block (2048 columns: 2 warps, one unit each; 8192: 4
//     warps, two units each), so that the grid reads neighbouring memory at any moment
//     (see Plan);
//     the warps (or groups) of the grid take rows in turn: ~32 warps per SM, one wave, a
//     persistent kernel;
//     each lane keeps its copies of the next kStages - 1 units in flight in a ring of
//     kStages slots while it computes with the current one (4 warps x 2 x 2 KB per block);
//     per unit, each piece times the same 8 columns of every token's x (tiny: it stays in
//     L1) into one float32 sum per token; at the warp's last unit of a row the 32 lanes add
//     their sums with shuffles; lane 0 writes y[t, row] for every token t, or, in a group,
//     the warps' sums meet in shared memory and the group's first warp adds and writes them.
//
// The MLP's gate_up projection can end in its activation here: with `pair` = I, output column
// j of y is silu(x . w[j]) * (x . w[j + I]) -- gate row j and up row j + I, the halves of the
// fused gate_up weight -- and y is [tokens, I]. A group then holds both rows (2 or 4 warps:
// the first half of the group on the gate row, the second on the up row), its first warp
// rounds both sums to bf16 as the GEMV's output would be and applies stage 08's silu_mul with
// HF's roundings (silu_mul_of below): the roundings of linear then silu_mul (bit-equal when
// a row is split between as many warps as the plain GEMV splits it, as at 576 and 2048
// columns), without the [tokens, 2I] round trip and, in a batch-1 decode step, without the
// SiLU-mul kernel.
//
// Each weight byte is read once, by one lane; a lane reads back only the slots it filled, so
// the ring needs no barrier (a group's sums do: one __syncthreads per row). float32
// accumulation, one rounding at the end, like cuBLAS with CUBLAS_COMPUTE_32F: the result
// equals linear_native within the bf16 tolerance. bf16 in; bf16 or float32 out (the logits).
//
// On an sm_90 GPU the launch may use programmatic dependent launch (PDL): the kernel may start
// while the previous kernel of the stream is still finishing. Weights do not depend on it, so
// each lane issues its first units' copies before `griddepcontrol.wait`, which returns once the
// previous kernel has finished and its writes are visible; only then are x read and y written
// (course/cuda/pdl.cuh; the kernels that run before a GEMV in a decode step, RMSNorm and
// SiLU-mul, call allow_next_kernel_to_start() first thing, so it can start that early).
// Reference: linear.py (linear_native). Run: nox -s grade -- 06
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdint>

#include "bulk_copy.cuh"
#include "cp_async.cuh"
#include "gemv.cuh"
#include "host_rows.cuh"
#include "pdl.cuh"
#include "tvllm.h"
#include "vec.cuh"

constexpr int kThreads = 128;      // 4 warps
constexpr int kWarps = kThreads / 32;
constexpr int kPieces = 4;            // 16-byte pieces per lane per unit
constexpr int kUnit = 32 * kPieces;   // pieces per unit: 128 (1024 columns, 2 KB)
constexpr int kStages = 3;            // ring slots per warp: 2 units in flight, 1 in use
// The rings: kWarps x kStages x 2 KB = 24 KB a block; an H200 SM holds eight such blocks (32
// warps, 128 KB in flight), a T4's two. After them, the partial sums of shared rows. (Units of
// 4 KB, 4 blocks and 16 warps per SM with the same bytes in flight, took 764 us for the 64
// GEMVs of a batch-1 decode step, back to back in a CUDA graph; 2 KB units 656 us, 3 ring
// slots of 4 KB 788 us: more warps, not more bytes, is what streams faster.)
constexpr size_t kRingBytes = static_cast<size_t>(kWarps) * kStages * kUnit * 16;
// Eight blocks per SM, what the rings' shared memory allows: said to the compiler as well, so
// it allocates registers for them (64 a thread at most: it takes 40-56 with the hint, 32-56
// without, and the hint alone made a batch-1 decode step 7 us faster on the H200).
constexpr int kMinBlocks = 8;

template <int kTokens>
constexpr size_t smem_bytes() { return kRingBytes + 2 * kWarps * kTokens * sizeof(float); }

// acc[t] += dot(w's 8 values, token t's 8 values of x at the same columns), t < tokens.
// x_piece: that piece of token 0's x; token t's is `pieces` (in / 8) pieces further.
template <int kTokens>
__device__ __forceinline__ void fma_piece(float (&acc)[kTokens], const BF8& w,
                                          const uint4* __restrict__ x_piece, int pieces,
                                          int tokens) {
  // TODO stage 06: widen w once; for each token t < tokens: load its x piece (__ldg), 8 fmaf into acc[t] (about 11 lines)
}

// Who reads which unit. A weight row has `per_row` units (ceil(in / 1024)); a group of
// `group` consecutive warps of one block computes each output -- `half` warps per weight row,
// 4, 2 or 1 of them, the most that divides per_row (with `pair`, at most 2 per row, since the
// group holds two rows) -- member m taking units m % half, m % half + half, ... (per_warp of
// them) of the output's gate row (m < half) or up row (m >= half; without `pair`, every member
// is on the one row). Group gid of the grid's `groups` takes outputs gid, gid + groups, ... So
// the warps of the grid read neighbouring memory at the same time: at 8192 columns, a block
// reads 8 KB of one row and the next block the same 8 KB of the next row. (With 4 KB units and
// a warp per row, the grid read 4 KB of every 16 KB at a time, and DRAM served that pattern at
// two thirds of the rate.)
struct Plan {
  int group, half, per_warp, groups, pair;
};

// The warps that compute one output from rows of `pieces` 16-byte pieces, one row or (paired)
// two (the launcher sizes the grid with it).
__host__ __device__ __forceinline__ int group_of(int pieces, bool paired) {
  // TODO stage 06: a row has ceil(pieces / kUnit) units; a plain row: 4 warps when its units divide by 4, else 2 when by 2, else 1 (each warp takes every group-th unit, so all take as many); paired: a warp pair per row when its units are even (4), else one warp per row (2) (about 3 lines)
  return paired ? 2 : 1;
}

__device__ __forceinline__ Plan plan_of(int pieces, int warps, int pair) {
  const int per_row = (pieces + kUnit - 1) / kUnit, group = group_of(pieces, pair > 0);
  const int half = pair > 0 ? group / 2 : group;
  return Plan{group, half, per_row / half, warps / group, pair};
}

// Rows of group gid: gid, gid + groups, ... below out_features.
__device__ __forceinline__ int rows_of(int gid, int groups, int out_features) {
  return gid < out_features ? (out_features - gid + groups - 1) / groups : 0;
}

// A warp's place in its group, worked out once: its first unit of a row (member % half) and
// how far its weight row lies from the output's (the up half: pair rows further). Divisions
// per unit would cost the GEMV its speed: it is as fast as its warps issue their copies.
struct Member {
  int lead, shift;
};
__device__ __forceinline__ Member member_of(int member, const Plan& plan) {
  return Member{member % plan.half, member / plan.half * plan.pair};
}

// Which weights unit i of a warp is: its output (y's column), its weight row and its first
// piece. A warp's units run through its outputs in order, in each its share of its row's units
// left to right.
struct Unit {
  int out, row, first;
};
__device__ __forceinline__ Unit unit_of(int i, const Plan& plan, int gid, const Member& m) {
  const int out = gid + (i / plan.per_warp) * plan.groups;
  return Unit{out, out + m.shift, (m.lead + (i % plan.per_warp) * plan.half) * kUnit};
}

// y of a paired output: the gate and up sums rounded to bf16 (what the GEMV would store), then
// stage 08's silu_mul_one -- silu(gate) in float32 rounded to bf16, times up, rounded -- so the
// fused GEMV rounds where linear followed by silu_mul does.
__device__ __forceinline__ float silu_mul_of(float gate_sum, float up_sum) {
  const float g = __bfloat162float(__float2bfloat16(gate_sum));
  const float act = __bfloat162float(__float2bfloat16(g / (1.0f + expf(-g))));
  return act * __bfloat162float(__float2bfloat16(up_sum));
}

// This lane's copies of unit i (if the warp has one) into ring slot i % kStages, as one group:
// one group per unit, empty or not, so copies_wait counts units.
__device__ __forceinline__ void fetch(uint4* ring, const uint4* weight, int i, int units,
                                      const Plan& plan, int gid, const Member& member,
                                      int pieces, int lane) {
  if (i < units) {
    const Unit u = unit_of(i, plan, gid, member);
    const uint4* src = weight + static_cast<int64_t>(u.row) * pieces;
    uint4* slot = ring + (i % kStages) * kUnit;
#pragma unroll
    for (int p = 0; p < kPieces; ++p) {
      const int c = u.first + p * 32 + lane;
      if (c < pieces) copy16(slot + p * 32 + lane, src + c, true);
    }
  }
  copies_commit();
}

// x: [tokens, in] bf16, weight: [out, in] bf16 (pair > 0: [out + pair, in], gate rows then up
// rows, pair == out), y: [tokens, out] of OutT (bf16 when paired); in % 8 == 0, x and weight
// 16-byte aligned, tokens <= kTokens. Dynamic shared memory: smem_bytes<kTokens>().
template <int kTokens, typename OutT>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
gemv_kernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ weight,
            OutT* __restrict__ y, int tokens, int in_features, int out_features, int pair) {
  extern __shared__ uint4 smem[];
  allow_next_kernel_to_start();  // the kernel after it may be scheduled (it waits for all of this)
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int pieces = in_features / 8;
  const Plan plan = plan_of(pieces, gridDim.x * kWarps, pair);
  const int gw = blockIdx.x * kWarps + warp;
  const int gid = gw / plan.group, member = gw % plan.group;
  const Member me = member_of(member, plan);
  const int units = rows_of(gid, plan.groups, out_features) * plan.per_warp;
  // Every warp of the block runs as many steps as its first group has units (the most), so
  // all of them reach each barrier; a warp past its own units computes nothing.
  const int steps = rows_of(blockIdx.x * kWarps / plan.group, plan.groups, out_features) * plan.per_warp;
  uint4* ring = smem + warp * (kStages * kUnit);
  // partial[slot][warp][t]: the warps' sums of a shared row; slot = (i / plan.per_warp) % 2,
  // the parity of the row's count among this warp's rows (not of its index: a group's rows
  // are `groups` apart, often an even number, so theirs would never alternate)
  float* partial = reinterpret_cast<float*>(smem + kWarps * (kStages * kUnit));
  const uint4* w = reinterpret_cast<const uint4*>(weight);
  const uint4* xp = reinterpret_cast<const uint4*>(x);
  float acc[kTokens];
#pragma unroll
  for (int t = 0; t < kTokens; ++t) acc[t] = 0.f;
  // TODO stage 06: fetch units 0 .. kStages - 2, then wait_for_previous_kernel(); per step i < steps: fetch i + kStages - 1, copies_wait<kStages - 1>, fma_piece each of this lane's pieces of unit i (if i < units); at the warp's last unit of an output, butterfly sums; a warp alone on its output: lane 0 writes y[t, out]; a group: lane 0 stores them to partial, __syncthreads(), then lane t of the group's first warp adds the group's partials of token t -- paired: the first half's (gate) and the second half's (up), then silu_mul_of -- and writes y[t, out]; acc back to 0 (about 43 lines)
}

// --- One token on Hopper: the weights by bulk copies (sm_90) ------------------------------
//
// gemv_kernel needs ~32 warps on every SM to keep its copies in flight: each 16 bytes is one
// cp.async of one lane. With bulk copies (bulk_copy.cuh) one thread asks for 32 KB at once, so
// two blocks of 8 warps per SM stream faster, each block reading one contiguous stretch of
// rows. A batch-1 decode step: 0.945 ms against gemv_kernel's 0.995 (H200).
//
//     block b of the grid owns the outputs [b * out / grid, (b + 1) * out / grid): its weight
//     rows are one contiguous stretch of memory (paired: the gate rows' stretch and the up
//     rows' stretch, as two halves of every stage);
//     thread 0 keeps kTmaStages stages of 32 KB of that stretch requested, each counted by
//     its stage's mbarrier; the first ones before the wait;
//     in a stage, warp w owns 256 consecutive pieces (4 KB, inside one row when in % 2048 ==
//     0): its lanes multiply them by x's pieces (x in shared memory), add with a butterfly,
//     and lane 0 adds the row's partial sum into the block's float32 sum of that row;
//     after every warp is done with a stage (one barrier), thread 0 requests the stage after
//     next into its slot; at the end the block writes its outputs (paired: silu_mul_of).
//
// One token only (x of 8 tokens would take 128 KB of shared memory at in = 8192), rows of a
// multiple of 2048 columns (in % 2048 == 0: Llama-3.2-1B's 2048 and 8192; SmolLM2's 576 and
// Llama-3.2-3B's 3072 go to gemv_kernel). Given code: read it; `launch` below chooses it
// (tma_fits).
//
// It may also take a decoder layer's RMSNorm (and the residual add before it) as a prologue
// (`Prologue`, launch_gemv_norm): x in shared memory is then stage 04's fused_add_rmsnorm of
// x and `add`, each block computing the row's sum of squares itself while its first weight
// stages are in flight, and the blocks together writing x + add (the new residual stream) to
// `sum`. That is one kernel fewer per projection that follows a norm: 32 of a Llama-3.2-1B
// decode step (the H200: a batch-1 token took 0.941 ms with the RMSNorm
// kernels, 0.873 ms with them left out, wrong but timed).
constexpr int kTmaThreads = 256;                          // 8 warps
constexpr int kTmaWarps = kTmaThreads / 32;
constexpr int kTmaStages = 2;                             // ring slots of 32 KB
constexpr int kTmaStagePieces = 2048;                     // 32 KB
constexpr int kTmaRun = kTmaStagePieces / kTmaWarps;      // 256 pieces: a warp's share of a stage
// Measured on the H200 (batch-1 decode, ms per token, compared within a
// call): 16 KB stages (runs of 128 pieces) 0.911 / 0.918, 32 KB 0.888-0.894, 8 KB 1.116; 3
// slots of 32 KB 0.889; 32 KB as two runs of 128 per warp (w and w + 8, which keeps rows of
// 1024 columns) 0.947 -- not profiled; each run's place and row then take divisions (one
// 64-bit) per run instead of one per stage, which the loop is sensitive to (see Plan).
constexpr int kTmaBlocksPerSm = 2;
// The compiler is told three blocks an SM (at most 80 registers a thread; it takes 79, no
// spills) though a launch gives each SM two: a third block then fits beside two of a GEMV
// whose blocks are small (a one-stage GEMV, below), where at 86 registers it never did.
constexpr int kTmaRegisterBlocks = 3;
constexpr int kTmaMaxIn = 16384;
constexpr int kTmaMaxSums = 4096;                         // rows x halves a block sums
// The stages' mbarriers (16 bytes), from byte 64 the prologue's warp sums (later the pick's
// warp keys); then the ring.
constexpr size_t kTmaHead = 128;
static_assert(kTmaStages * 8 <= 16 && kTmaWarps * 8 <= 64, "kTmaHead's layout");
// At least this much shared memory a block, so that no more than 2 of these blocks share an
// SM of 228 KB (all sm_90 GPUs): the next GEMV's blocks, launched early under PDL, find no
// room beside the running one's and wait until it leaves, while the step's small kernels
// still fit. Measured on the H200: with 50 KB blocks (two GEMVs side by
// side) batch 1 took 1.086 ms, with 37 KB (three) slower still, with 80 KB 0.945 ms --
// gemv_kernel 0.995 in the same calls. Side by side, the next GEMV's early requests took
// bandwidth from the running one: every GEMV of a step is on its critical path.
// The exception is a GEMV whose block fetches its whole stretch in one stage (o_proj at batch
// 1: 8 rows of 2048 columns): it keeps only what it needs (68 KB), so that one block of the
// next GEMV (gate_up) lands beside its two and requests its first stages while o_proj's blocks
// wait for the attention, the step's longest stretch of idle memory; gate_up's other block
// arrives when o_proj's leave. The SM then holds 216 KB: the launcher asks for the largest
// shared-memory carveout. Measured on the H200: batch 1 0.861-0.862
// ms against 0.870-0.871; the same with gate_up's start held until o_proj's wait returns
// 0.863-0.864: its requests during the attention cost nothing measurable.
constexpr size_t kTmaMinSmem = 80 * 1024;

// What gemv_kernel_tma does to x before the product: nothing (norm == nullptr), or
//     s = round(x + add) (add == nullptr: s = x),  x = round(norm * round(s * rsqrt(mean(s^2) + eps)))
// with stage 04's roundings; when `sum` is given, s is stored there (the whole row, each block
// its share of it; never in place of x or add: other blocks are still reading them).
struct Prologue {
  const __nv_bfloat16* add = nullptr;   // [in]: the residual stream before the add, or none
  __nv_bfloat16* sum = nullptr;         // [in]: where s goes, or nowhere
  const __nv_bfloat16* norm = nullptr;  // [in]: the RMSNorm's weight, or no prologue
  float eps = 0.f;
};
// What gemv_kernel_tma does after the product (the lm_head's greedy pick, launch_gemv_norm
// with `pick`): besides the float32 logits, the index of the largest goes to out[0] and to the
// host row, with no argmax kernel after the GEMV. Each block reduces its outputs to one 64-bit
// key (pick_key), puts it into the kept key with one atomicMax and draws a ticket; the block
// that draws the last ticket reads the winner, stores its index and sets key and ticket back
// to 0 for the next launch (binding.h's tvllm::tickets keeps them). A batch-1 decode step
// then ends with its lm_head: 0.768 -> 0.766 ms a token (the H200).
struct Pick {
  int64_t* out = nullptr;              // [1]: the index
  unsigned long long* key = nullptr;   // the best key so far, 0 between launches
  int32_t* ticket = nullptr;           // blocks done, 0 between launches
  HostRows host{nullptr, nullptr, 0, 0};
};

// The pick over `counters`: 4 int32, 0, 8-byte aligned -- the ticket, then the 64-bit key.
inline Pick pick_of(int64_t* out, int32_t* counters, const HostRows& host) {
  return Pick{out, reinterpret_cast<unsigned long long*>(counters + 2), counters, host};
}

// The greedy order of stage 08's better() -- a NaN above every number, then the larger value,
// then, between equal values, the lower index -- as one unsigned integer, so that a block's
// pick is a max and the grid's one atomicMax: the value's bits in the high word (a float's
// bits read as an unsigned integer sort like the float once the negative ones are flipped and
// the positive ones get the sign bit; -0.0 + 0.0 is +0.0, the zeros are equal; every NaN
// above +inf), the index counted down in the low word. Every element's key is above 0, which
// stands for "none yet" (-inf's high word is 0x007fffff).
__device__ __forceinline__ unsigned long long pick_key(float v, int index) {
  const unsigned bits = __float_as_uint(v + 0.f);
  const unsigned order = isnan(v) ? 0xffffffffu : bits >> 31 ? ~bits : bits | 0x80000000u;
  return static_cast<unsigned long long>(order) << 32 | (0xffffffffu - static_cast<unsigned>(index));
}

// The block's largest key (the kernel's `best` of each thread) into the grid's pick; thread
// 0 of the last block stores the winner's index, and reads the host slot only then (a step
// input: any time will do). keys: kTmaWarps of shared memory. Every thread calls it.
__device__ __forceinline__ void finish_pick(unsigned long long best, const Pick& pick,
                                            unsigned long long* keys) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const unsigned long long other = __shfl_xor_sync(0xffffffffu, best, offset);
    best = other > best ? other : best;
  }
  if (threadIdx.x % 32 == 0) keys[threadIdx.x / 32] = best;
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int w = 1; w < kTmaWarps; ++w) best = keys[w] > best ? keys[w] : best;
  atomicMax(pick.key, best);
  __threadfence();  // the key is in before the ticket that says so
  if (atomicAdd(pick.ticket, 1) != static_cast<int>(gridDim.x) - 1) return;
  __threadfence();
  const unsigned long long winner = atomicExch(pick.key, 0ull);
  *pick.ticket = 0;
  const int64_t index = 0xffffffffu - static_cast<unsigned>(winner);
  pick.out[0] = index;
  int64_t* const answers = host_row(pick.host);
  if (answers != nullptr) answers[0] = index;
}

// x into shared memory as the product uses it (Prologue); warp_sums: kTmaWarps floats of
// shared memory; w0: the norm weight's piece tid, read before the PDL wait (at hidden 2048,
// the only one: the second pass then waits for no load). s waits in xs between the two passes
// (registers would hold up to 8 packs a thread: 160 registers, one block per SM instead of
// two). Ends with a barrier: xs is complete.
// Every rounding to bf16 here converts two values at once (vec.cuh's pack_bf16, one F2FP
// instruction): a conversion of one value (__float2bfloat16_rn, F2F) issues at 16 a clock on
// an SM, and the 24 a thread of a 2048-column row cost a batch-1 token 12 us (the H200:
// 0.797 -> 0.785 ms; docs/benchmarks.md). Neither loop is unrolled: a
// thread has one piece at hidden 2048, and the unrolled copies only tripled the code a block
// runs once, cold (rolling them alone gave 4 of those 12 us).
__device__ __forceinline__ void stage_x(uint4* xs, const uint4* xg, int pieces, const Prologue& pro,
                                        const uint4& w0, float* warp_sums) {
  const int tid = threadIdx.x;
  if (pro.norm == nullptr) {
    for (int i = tid; i < pieces; i += kTmaThreads) xs[i] = xg[i];
    __syncthreads();
    return;
  }
  const uint4* add = reinterpret_cast<const uint4*>(pro.add);
  const int mine = static_cast<int>(static_cast<int64_t>(blockIdx.x) * pieces / gridDim.x);
  const int next = static_cast<int>(static_cast<int64_t>(blockIdx.x + 1) * pieces / gridDim.x);
  float sq = 0.f;
#pragma unroll 1
  for (int i = tid; i < pieces; i += kTmaThreads) {
    uint4 s = xg[i];
    if (add != nullptr) {
      uint4 r = add[i];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float2 a = unpack_bf16(words(s)[k]), b = unpack_bf16(words(r)[k]);
        words(s)[k] = pack_bf16(a.x + b.x, a.y + b.y);
      }
      if (pro.sum != nullptr && i >= mine && i < next) reinterpret_cast<uint4*>(pro.sum)[i] = s;
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 a = unpack_bf16(words(s)[k]);
      sq += a.x * a.x;
      sq += a.y * a.y;
    }
    xs[i] = s;
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, offset);
  if (tid % 32 == 0) warp_sums[tid / 32] = sq;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kTmaWarps; ++w) total += warp_sums[w];
  const float inv_rms = rsqrtf(total / static_cast<float>(pieces * 8) + pro.eps);
  const uint4* norm = reinterpret_cast<const uint4*>(pro.norm);
#pragma unroll 1
  for (int i = tid; i < pieces; i += kTmaThreads) {  // the same pieces as above: no barrier
    uint4 s = xs[i], w = i == tid ? w0 : norm[i], o;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 v = unpack_bf16(words(s)[k]), g = unpack_bf16(words(w)[k]);
      const float2 normed = unpack_bf16(pack_bf16(v.x * inv_rms, v.y * inv_rms));
      words(o)[k] = pack_bf16(g.x * normed.x, g.y * normed.y);
    }
    xs[i] = o;
  }
  __syncthreads();
}

// Shared memory: mbarriers and the prologue's warp sums, ring, x (in bf16), the float32 sums
// of `sums` rows.
__host__ __device__ constexpr size_t tma_smem_bytes(int in_features, int sums) {
  return kTmaHead + static_cast<size_t>(kTmaStages) * kTmaStagePieces * 16 +
         static_cast<size_t>(in_features) * 2 + static_cast<size_t>(sums) * sizeof(float);
}
// The most a launch asks for: the kernel's shared-memory opt-in.
constexpr size_t kTmaMaxSmem = tma_smem_bytes(kTmaMaxIn, kTmaMaxSums) > kTmaMinSmem
                                   ? tma_smem_bytes(kTmaMaxIn, kTmaMaxSums) : kTmaMinSmem;

// The rows gemv_kernel_tma takes: whole runs (in % 2048 == 0), x within its shared memory.
__host__ __device__ constexpr bool tma_shape(int in_features, int out_features) {
  return in_features % (kTmaRun * 8) == 0 && in_features <= kTmaMaxIn && out_features > 0;
}

// x: [1, in] bf16, weight: [out, in] bf16 (pair > 0: [2 out, in], gate rows then up rows),
// y: [1, out] of OutT; in % 2048 == 0, in <= kTmaMaxIn; dynamic shared memory
// tma_smem_bytes(in, ceil(out / grid) x (pair ? 2 : 1)).
// Two blocks an SM (kTmaMinSmem makes sure of no more), registers for three
// (kTmaRegisterBlocks). kPick: the greedy pick after the product (Pick; float32 y). An
// instance of its own: the epilogue's code in every GEMV's instance changed how the compiler
// laid out the kernel, and made a batch-1 token 10 us slower (the H200).
template <typename OutT, bool kPick = false>
__global__ void __launch_bounds__(kTmaThreads, kTmaRegisterBlocks)
gemv_kernel_tma(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ weight,
                OutT* __restrict__ y, int in_features, int out_features, int pair, Prologue pro,
                Pick pick) {
  extern __shared__ uint4 smem[];
  allow_next_kernel_to_start();
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  float* warp_sums = reinterpret_cast<float*>(smem + 4);
  uint4* ring = smem + kTmaHead / 16;
  uint4* xs = ring + kTmaStages * kTmaStagePieces;
  const int pieces = in_features / 8;
  float* sums = reinterpret_cast<float*>(xs + pieces);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int r0 = static_cast<int>(static_cast<int64_t>(blockIdx.x) * out_features / gridDim.x);
  const int rows = static_cast<int>(static_cast<int64_t>(blockIdx.x + 1) * out_features / gridDim.x) - r0;
  const int halves = pair > 0 ? 2 : 1;
  const int half = kTmaStagePieces / halves;              // pieces of each stretch per stage
  const int64_t stretch = static_cast<int64_t>(rows) * pieces;
  const int stages = static_cast<int>((stretch + half - 1) / half);
  const uint4* w = reinterpret_cast<const uint4*>(weight);
  const uint4* from[2] = {w + static_cast<int64_t>(r0) * pieces,
                          w + static_cast<int64_t>(r0 + pair) * pieces};
  // Stage k (if any) into slot k % kTmaStages: thread 0 only. The weights are read once a
  // step: first out of the L2 (bulk_copy.cuh).
  const uint64_t policy = evict_first_policy();
  auto request = [&](int k) {
    if (k >= stages) return;
    const int64_t offset = static_cast<int64_t>(k) * half;
    const int n = static_cast<int>(stretch - offset < half ? stretch - offset : half);
    uint64_t* bar = &full[k % kTmaStages];
    barrier_expect_bytes(bar, static_cast<unsigned>(n * 16 * halves));
    uint4* slot = ring + (k % kTmaStages) * kTmaStagePieces;
    for (int h = 0; h < halves; ++h)
      bulk_copy(slot + h * half, from[h] + offset, n * 16, bar, policy);
  };
  if (tid == 0)
    for (int s = 0; s < kTmaStages; ++s) barrier_init(&full[s], 1);
  for (int i = tid; i < rows * halves; i += kTmaThreads) sums[i] = 0.f;
  __syncthreads();  // the barriers are initialized before anyone waits on them
  if (tid == 0)
    for (int k = 0; k < kTmaStages; ++k) request(k);  // before the wait: weights only
  uint4 w0{};  // no kernel writes the norm's weight: read before the wait
  if (pro.norm != nullptr && tid < pieces) w0 = reinterpret_cast<const uint4*>(pro.norm)[tid];
  wait_for_previous_kernel();
  stage_x(xs, reinterpret_cast<const uint4*>(x), pieces, pro, w0, warp_sums);
  const int h = warp * kTmaRun / half, first = warp * kTmaRun % half;  // this warp's run
  for (int k = 0; k < stages; ++k) {
    barrier_wait(&full[k % kTmaStages], (k / kTmaStages) & 1);
    // a row holds a whole number of runs, so a run is all in one row or past the stretch
    const int64_t start = static_cast<int64_t>(k) * half + first;
    if (start < stretch) {
      const uint4* run = ring + (k % kTmaStages) * kTmaStagePieces + h * half + first;
      const int row = static_cast<int>(start / pieces), column = static_cast<int>(start % pieces);
      float sum = 0.f;
#pragma unroll
      for (int j = lane; j < kTmaRun; j += 32) {
        const BF8 wv = as_bf8(run[j]), xv = as_bf8(xs[column + j]);
#pragma unroll
        for (int e = 0; e < 8; ++e) sum = fmaf(to_float(wv.v[e]), to_float(xv.v[e]), sum);
      }
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
      if (lane == 0) atomicAdd(&sums[h * rows + row], sum);
    }
    __syncthreads();  // every warp is done with slot k % kTmaStages
    if (tid == 0) request(k + kTmaStages);
  }
  unsigned long long best = 0;  // the pick's: this thread's largest key
  for (int r = tid; r < rows; r += kTmaThreads) {
    const OutT out = from_float<OutT>(pair > 0 ? silu_mul_of(sums[r], sums[rows + r]) : sums[r]);
    y[r0 + r] = out;
    if constexpr (kPick) {
      const unsigned long long key = pick_key(to_float(out), r0 + r);
      best = key > best ? key : best;
    }
  }
  if constexpr (kPick) finish_pick(best, pick, reinterpret_cast<unsigned long long*>(warp_sums));
}

namespace {

// Blocks of `kernel` that run at once on the whole GPU, each with `smem` bytes of dynamic
// shared memory (allowed first, should the ring grow past the 48 KB a kernel gets without
// asking): the persistent grid's size; 0 when the device does not answer.
template <typename Kernel>
int resident_blocks(Kernel kernel, size_t smem) {
  const int sms = tvllm_sm_count();
  int per_sm = 0;
  if (sms <= 0 ||
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(smem)) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem) != cudaSuccess) {
    cudaGetLastError();  // clear it: the launcher says what went wrong
    return 0;
  }
  return sms * per_sm;
}

// The Hopper path for one token (gemv_kernel_tma): the kernel was built for sm_90 or later
// (pdl.cuh's built_for_sm90: bulk copies are in it), TINYVLLM_GEMV_TMA is not "0" (to measure
// the gain), and tma_shape holds.
template <typename OutT>
bool tma_fits(int in_features, int out_features) {
  static const bool available =
      built_for_sm90(gemv_kernel_tma<OutT>) && !turned_off("TINYVLLM_GEMV_TMA");
  return available && tma_shape(in_features, out_features);
}

// gemv_kernel_tma on kTmaBlocksPerSm blocks per SM (fewer when out is smaller), PDL where the
// kernel has the wait (pdl.cuh's launch_early). The caller checked tma_fits (or, in the CPU emulator, the shapes).
template <typename OutT, bool kPick = false>
tvllm_status launch_tma(const __nv_bfloat16* x, const __nv_bfloat16* weight, OutT* y,
                        int in_features, int out_features, int pair, cudaStream_t stream,
                        const Prologue& pro = Prologue{}, const Pick& pick = Pick{}) {
  static const int sms = tvllm_sm_count();
  if (sms <= 0) return "gemv: could not ask the device how many SMs it has";
  if (!tma_shape(in_features, out_features))
    return "gemv (bulk copies): needs in_features a multiple of 2048, at most 16384";
  const int blocks = out_features < kTmaBlocksPerSm * sms ? out_features : kTmaBlocksPerSm * sms;
  const int sums = static_cast<int>(tvllm_ceil_div(out_features, blocks)) * (pair > 0 ? 2 : 1);
  if (sums > kTmaMaxSums) return "gemv (bulk copies): too many rows per block";
  const size_t needed = tma_smem_bytes(in_features, sums);
  const bool one_stage = static_cast<int64_t>(sums) * (in_features / 8) <= kTmaStagePieces;
  const size_t smem = one_stage || needed > kTmaMinSmem ? needed : kTmaMinSmem;
  static const bool opted_in =
      cudaFuncSetAttribute(gemv_kernel_tma<OutT, kPick>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(kTmaMaxSmem)) == cudaSuccess &&
      cudaFuncSetAttribute(gemv_kernel_tma<OutT, kPick>, cudaFuncAttributePreferredSharedMemoryCarveout,
                           cudaSharedmemCarveoutMaxShared) == cudaSuccess;
  if (!opted_in) {
    cudaGetLastError();
    return "gemv (bulk copies): the device refused the kernel's shared memory";
  }
  const cudaError_t err = launch_early(gemv_kernel_tma<OutT, kPick>, dim3(blocks), dim3(kTmaThreads),
                                       smem, stream, x, weight, y, in_features, out_features,
                                       pair, pro, pick);
  return err == cudaSuccess ? TVLLM_OK : cudaGetErrorString(err);
}

template <int kTokens, typename OutT>
tvllm_status launch(const __nv_bfloat16* x, const __nv_bfloat16* weight, OutT* y, int tokens,
                    int in_features, int out_features, int pair, cudaStream_t stream) {
  constexpr size_t smem = smem_bytes<kTokens>();
  static const int resident = resident_blocks(gemv_kernel<kTokens, OutT>, smem);
  if (resident <= 0) return "gemv: could not ask the device how many blocks fit";
  // an output keeps group_of(its pieces) warps busy
  const int64_t warps = static_cast<int64_t>(out_features) * group_of(in_features / 8, pair > 0);
  unsigned blocks = 0;  // the grid
  // TODO stage 06: the grid: enough blocks of kWarps warps for those warps, but no more than `resident` (the blocks that run at once: a persistent grid, each warp loops over its rows) (about 2 lines)
  return "TODO stage 06: the grid: enough blocks of kWarps warps for those warps, but no more than `resident` (the blocks that run at once: a persistent grid, each warp loops over its rows) (about 2 lines)";
  // Given: on Hopper one token goes to the bulk-copy kernel below; the launch itself may start
  // early (programmatic dependent launch, pdl.cuh), which is why the kernel waits before x.
  if (kTokens == 1 && tma_fits<OutT>(in_features, out_features))
    return launch_tma(x, weight, y, in_features, out_features, pair, stream);
  const cudaError_t err = launch_early(gemv_kernel<kTokens, OutT>, dim3(blocks), dim3(kThreads),
                                       smem, stream, x, weight, y, tokens, in_features,
                                       out_features, pair);
  return err == cudaSuccess ? TVLLM_OK : cudaGetErrorString(err);
}

template <typename OutT>
tvllm_status launch_tokens(const __nv_bfloat16* x, const __nv_bfloat16* weight, OutT* y,
                           int tokens, int in_features, int out_features, int pair,
                           cudaStream_t stream) {
  // The smallest instance that holds `tokens`: acc[] lives in registers, so no larger.
  if (tokens == 1) return launch<1>(x, weight, y, tokens, in_features, out_features, pair, stream);
  if (tokens == 2) return launch<2>(x, weight, y, tokens, in_features, out_features, pair, stream);
  if (tokens <= 4) return launch<4>(x, weight, y, tokens, in_features, out_features, pair, stream);
  return launch<8>(x, weight, y, tokens, in_features, out_features, pair, stream);
}

}  // namespace

// x: [tokens, in] bf16, weight: [out, in] bf16, y: [tokens, out] bf16 (y_f32 false) or float32;
// gemv_fits must hold. Programmatic dependent launch where the kernel was built for it and
// TINYVLLM_PDL is not "0" (pdl.cuh's may_launch_early).
tvllm_status launch_gemv(const void* x, const void* weight, void* y, bool y_f32, int64_t tokens,
                         int64_t in_features, int64_t out_features, cudaStream_t stream) {
  if (!gemv_fits(true, tokens, in_features, out_features, x, weight)) return kGemvRefusal;
  if (out_features == 0) return TVLLM_OK;
  const auto* xb = static_cast<const __nv_bfloat16*>(x);
  const auto* wb = static_cast<const __nv_bfloat16*>(weight);
  const int t = static_cast<int>(tokens), k = static_cast<int>(in_features),
            n = static_cast<int>(out_features);
  return with_output_type(y, y_f32, [&](auto* out) {
    return launch_tokens(xb, wb, out, t, k, n, 0, stream);
  });
}

// y = silu(x @ gate^T) * (x @ up^T) for weight = [gate; up]: x [tokens, in] bf16, weight
// [2 inter, in] bf16, y [tokens, inter] bf16 (the MLP's gate_up projection and its
// activation in one pass); gemv_fits must hold for x and weight.
tvllm_status launch_gemv_silu_mul(const void* x, const void* weight, void* y, int64_t tokens,
                                  int64_t in_features, int64_t inter, cudaStream_t stream) {
  if (inter <= 0 || !gemv_fits(true, tokens, in_features, 2 * inter, x, weight))
    return "gemv silu_mul: needs 1-8 tokens, in_features a multiple of 8, an even number of "
           "weight rows and 16-byte aligned x and weight";
  const int n = static_cast<int>(inter);
  return launch_tokens(static_cast<const __nv_bfloat16*>(x),
                       static_cast<const __nv_bfloat16*>(weight), static_cast<__nv_bfloat16*>(y),
                       static_cast<int>(tokens), static_cast<int>(in_features), n, n, stream);
}

// Whether launch_gemv_norm runs here: gemv_kernel_tma takes one token of these sizes (sm_90
// code, TINYVLLM_GEMV_TMA not 0, in % 2048 == 0) and TINYVLLM_GEMV_NORM is not 0 (to measure
// the gain). Else the caller runs stage 04's norm, then linear (or linear_silu_mul).
bool gemv_norm_fits(int64_t in_features, int64_t out_features) {
  static const bool wanted = !turned_off("TINYVLLM_GEMV_NORM");
  return wanted && in_features < (int64_t{1} << 30) && out_features < (int64_t{1} << 30) &&
         tma_fits<__nv_bfloat16>(static_cast<int>(in_features), static_cast<int>(out_features));
}

// y = rmsnorm(x + add) @ weight^T for one bf16 token, the norm as gemv_kernel_tma's prologue;
// with inter > 0 the product is linear_silu_mul's (weight [2 inter, in], y [1, inter]).
// x, add, sum, norm: [1, in] bf16 (add may be null: no add; sum null: the sum not stored; a
// sum needs an add and is never x or add); weight [out, in] bf16 (out = 2 inter when paired); y [1, out or inter] bf16, or
// float32 when y_f32 (not paired: the logits of the lm_head after the model's final norm).
// pick (or nullptr): [1] int64, the index of y's largest value (Pick; float32 y only), also
// stored in host's row; counters: as pick_of takes them, left at 0. gemv_norm_fits(in, out)
// must hold.
tvllm_status launch_gemv_norm(const void* x, const void* add, void* sum, const void* norm,
                              float eps, const void* weight, void* y, bool y_f32,
                              int64_t in_features, int64_t out_features, int64_t inter,
                              int64_t* pick, int32_t* counters, HostRows host,
                              cudaStream_t stream) {
  if (!gemv_norm_fits(in_features, out_features) ||
      !gemv_fits(true, 1, in_features, out_features, x, weight))
    return "gemv with RMSNorm: needs the bulk-copy GEMV (an sm_90 build, one token, "
           "in_features a multiple of 2048) and 16-byte aligned x and weight";
  if ((inter > 0 && (out_features != 2 * inter || y_f32)) ||
      (sum != nullptr && (add == nullptr || sum == x || sum == add)))
    return "gemv with RMSNorm: a paired weight has 2 * inter rows and a bf16 y, and sum (stored "
           "only with an add) must be its own buffer";
  for (const void* p : {add, static_cast<const void*>(sum), norm})
    if (!tvllm_aligned(p, 16))
      return "gemv with RMSNorm: add, sum and the norm's weight must be 16-byte aligned";
  if (pick != nullptr &&
      (!y_f32 || inter > 0 || counters == nullptr || !tvllm_aligned(counters, 8)))
    return "gemv with RMSNorm: the greedy pick takes float32 logits of a plain projection and "
           "8-byte aligned counters";
  const Prologue pro{static_cast<const __nv_bfloat16*>(add), static_cast<__nv_bfloat16*>(sum),
                     static_cast<const __nv_bfloat16*>(norm), eps};
  const int n = static_cast<int>(inter > 0 ? inter : out_features);
  const auto* xb = static_cast<const __nv_bfloat16*>(x);
  const auto* wb = static_cast<const __nv_bfloat16*>(weight);
  const int k = static_cast<int>(in_features), pair = static_cast<int>(inter);
  if (pick != nullptr)
    return launch_tma<float, true>(xb, wb, static_cast<float*>(y), k, n, pair, stream, pro,
                                   pick_of(pick, counters, host));
  return y_f32 ? launch_tma(xb, wb, static_cast<float*>(y), k, n, pair, stream, pro)
               : launch_tma(xb, wb, static_cast<__nv_bfloat16*>(y), k, n, pair, stream, pro);
}

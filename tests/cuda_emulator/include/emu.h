// A CPU emulator for the course's CUDA kernels: the kernel source is compiled by g++ and run
// on the host, block after block, each thread a ucontext fiber. Warp collectives
// (__shfl_xor_sync, __shfl_sync, __syncwarp, ldmatrix, mma.sync) and block barrier are
// rendezvous points where the fibers of the warp (block) meet; the scheduler runs fibers
// round-robin.
//
// What it checks: the kernel's logic -- indexing, masks, fragment layouts, the split-K protocol,
// what every thread reads and writes -- against the native twins (tests/test_emulated_kernels.py).
// What it cannot: anything about concurrency or the memory model (blocks run one at a time,
// cp.async copies at once, there is no L1/L2), speed, or device limits (shared memory,
// registers). A warp collective that not every lane of the warp reaches (or that runs after
// one of its lanes returned) is reported as a deadlock instead of hanging.
//
// Included first (g++ -include emu.h); include/pdl.cuh and include/mma.cuh stand in for the
// course's headers of the same names. tests/cuda_emulator/__init__.py builds a kernel file.
#pragma once
#include <ucontext.h>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <functional>
#include <string>
#include <cuda_runtime.h>
#include <cuda_bf16.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

// CUDA's built-in variables, as globals: one fiber runs at a time, and the scheduler sets
// threadIdx before it switches to a fiber (variables, not macros: `config.blockDim` stays a
// member).
inline dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace emu {
struct Thread {
  ucontext_t ctx;
  std::vector<char> stack;
  dim3 tid;
  int lane, warp;
  bool done = false;
};
struct State {
  dim3 grid, block, bid;
  std::vector<Thread> threads;
  Thread* cur = nullptr;
  ucontext_t sched;
  std::vector<char> dyn_smem;
  // rendezvous: per warp its threads, how many returned, arrived and the barrier's generation
  std::vector<int> warp_size, warp_returned, warp_arrived, warp_gen;
  int block_live = 0, block_arrived = 0, block_gen = 0;
  int block_or = 0, block_or_result = 0;
  // exchange buffers per thread (64 bytes each)
  std::vector<std::array<uint64_t, 16>> xbuf;
  std::function<void()> body;
  std::string error;   // a deadlock: the launch stops, emu_error() returns it
};
inline State g;
inline void yield() { swapcontext(&g.cur->ctx, &g.sched); }
inline const char* error() { return g.error.empty() ? nullptr : g.error.c_str(); }
inline void clear_error() { g.error.clear(); }
// A collective of the whole warp (the kernels pass the full mask): every thread of the warp
// must still be running. One that has returned makes it undefined on a GPU: an error here.
inline void warp_barrier() {
  const int w = g.cur->warp;
  if (g.warp_returned[w] > 0) {
    g.error = "a full-warp collective (shuffle, __syncwarp, ldmatrix, mma) in warp " +
              std::to_string(w) + " after some of its threads returned (deadlock on a GPU)";
    for (;;) yield();  // the scheduler stops the block
  }
  const int gen = g.warp_gen[w];
  if (++g.warp_arrived[w] == g.warp_size[w]) {
    g.warp_arrived[w] = 0;
    ++g.warp_gen[w];
    return;
  }
  while (g.warp_gen[w] == gen) yield();
}
inline void block_barrier() {
  const int gen = g.block_gen;
  if (++g.block_arrived == g.block_live) {
    g.block_arrived = 0;
    ++g.block_gen;
    return;
  }
  while (g.block_gen == gen) yield();
}
inline Thread& lane_thread(int lane) { return g.threads[g.cur->warp * 32 + lane]; }
inline size_t idx(const Thread& t) { return &t - g.threads.data(); }

inline void trampoline() {
  g.body();
  g.cur->done = true;
  ++g.warp_returned[g.cur->warp];
  --g.block_live;
  if (g.warp_arrived[g.cur->warp] > 0)  // its warp waits in a collective it will never reach
    g.error = "a thread of warp " + std::to_string(g.cur->warp) + " returned while the rest "
              "of its warp waits in a full-warp collective (deadlock on a GPU)";
  // __syncthreads counts the threads still running (as on Volta and later)
  if (g.block_arrived > 0 && g.block_arrived >= g.block_live) {
    g.block_arrived = 0;
    ++g.block_gen;
  }
  swapcontext(&g.cur->ctx, &g.sched);
}

template <typename F>
void run_block(dim3 bid, F&& f) {
  g.bid = bid;
  blockIdx = bid;
  const int n = g.block.x * g.block.y * g.block.z;
  g.threads.clear();
  g.threads.resize(n);
  g.xbuf.assign(n, {});
  const int warps = (n + 31) / 32;
  g.warp_size.assign(warps, 32);
  g.warp_size[warps - 1] = n - 32 * (warps - 1);
  g.warp_returned.assign(warps, 0);
  g.warp_arrived.assign(warps, 0);
  g.warp_gen.assign(warps, 0);
  g.block_live = n;
  g.block_arrived = 0;
  g.body = f;
  for (int i = 0; i < n; ++i) {
    Thread& t = g.threads[i];
    t.tid = dim3(i % g.block.x, (i / g.block.x) % g.block.y, i / (g.block.x * g.block.y));
    t.lane = i % 32;
    t.warp = i / 32;
    t.stack.resize(1 << 18);
    getcontext(&t.ctx);
    t.ctx.uc_stack.ss_sp = t.stack.data();
    t.ctx.uc_stack.ss_size = t.stack.size();
    t.ctx.uc_link = nullptr;
    makecontext(&t.ctx, trampoline, 0);
  }
  // A pass over the fibers in which no barrier opened and no fiber ended is a deadlock.
  auto progress = [] {
    long sum = g.block_gen - g.block_live;
    for (int v : g.warp_gen) sum += v;
    return sum;
  };
  for (bool any = true; any;) {
    any = false;
    const long before = progress();
    for (auto& t : g.threads) {
      if (t.done) continue;
      any = true;
      g.cur = &t;
      threadIdx = t.tid;
      swapcontext(&g.sched, &t.ctx);
    }
    if (!g.error.empty()) return;
    if (any && progress() == before) {
      g.error = "deadlock in block (" + std::to_string(bid.x) + ", " + std::to_string(bid.y) +
                ", " + std::to_string(bid.z) + "): a warp collective or __syncthreads that not "
                "every live thread reaches";
      return;
    }
  }
}

template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, Args... args) {
  g.grid = grid;
  g.block = block;
  gridDim = grid;
  blockDim = block;
  g.dyn_smem.assign(smem + 16, 0x7f);  // garbage, like uninitialised shared memory
  for (unsigned z = 0; z < grid.z && g.error.empty(); ++z)
    for (unsigned y = 0; y < grid.y && g.error.empty(); ++y)
      for (unsigned x = 0; x < grid.x && g.error.empty(); ++x)
        run_block(dim3(x, y, z), [&] { kernel(static_cast<Params>(args)...); });
  return g.error.empty() ? cudaSuccess : cudaErrorLaunchFailure;
}

template <typename... A>
cudaError_t func_set_attribute(A...) { return cudaSuccess; }

// A small device: kernels that size their grid from it (persistent grids, split-K) get few
// blocks, so the emulated runs stay short and each block loops more.
constexpr int kSms = 4;
inline cudaError_t get_device(int* device) { *device = 0; return cudaSuccess; }
inline cudaError_t device_get_attribute(int* value, cudaDeviceAttr attr, int) {
  switch (attr) {
    case cudaDevAttrMultiProcessorCount: *value = kSms; return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = 227 * 1024; return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = 48 * 1024; return cudaSuccess;
    default: return cudaErrorInvalidValue;
  }
}
// tvllm.h's tvllm_sm_count(), whose calls in a kernel file are redirected here
inline int sm_count() { return kSms; }
template <typename Kernel>
cudaError_t occupancy(int* blocks, Kernel, int, size_t) { *blocks = 2; return cudaSuccess; }
template <typename Kernel>
cudaError_t func_get_attributes(cudaFuncAttributes* a, Kernel) {
  *a = cudaFuncAttributes{};
  a->ptxVersion = 80;  // no PDL wait in host code: launch normally
  return cudaSuccess;
}

template <typename... Params, typename... Args>
cudaError_t launch_ex(const cudaLaunchConfig_t* config, void (*kernel)(Params...), Args... args) {
  return launch(kernel, config->gridDim, config->blockDim, config->dynamicSmemBytes, args...);
}

template <typename... Params, typename... Args>
cudaError_t launch_stream(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t,
                          Args... args) {
  return launch(kernel, grid, block, smem, args...);
}

// Every lane of the warp puts v in, then reads what lane `from` put in (the shuffles below).
template <typename T>
T exchange(T v, int from) {
  static_assert(sizeof(T) <= 8, "");
  auto& mine = g.xbuf[idx(*g.cur)];
  std::memcpy(&mine[0], &v, sizeof(T));
  warp_barrier();
  T r;
  std::memcpy(&r, &g.xbuf[idx(lane_thread(from))][0], sizeof(T));
  warp_barrier();
  return r;
}
template <typename T>
T shfl_xor(T v, int delta) { return exchange(v, g.cur->lane ^ delta); }
// __shfl_sync: lane src of each aligned group of `width` lanes, to every lane of the group.
template <typename T>
T shfl(T v, int src, int width = 32) {
  return exchange(v, g.cur->lane / width * width + src % width);
}
inline void syncwarp() { warp_barrier(); }
inline int syncthreads_or(int p) {
  if (g.block_arrived == 0) g.block_or = 0;
  g.block_or |= p ? 1 : 0;
  const int gen = g.block_gen;
  if (++g.block_arrived == g.block_live) {
    g.block_or_result = g.block_or;
    g.block_arrived = 0;
    ++g.block_gen;
  } else {
    while (g.block_gen == gen) yield();
  }
  const int r = g.block_or_result;
  block_barrier();  // nobody starts the next OR before all read this one
  return r;
}

inline uint16_t bits(const __nv_bfloat16* p) { uint16_t b; std::memcpy(&b, p, 2); return b; }
inline float bf(uint16_t b) { uint32_t u = uint32_t(b) << 16; float f; std::memcpy(&f, &u, 4); return f; }

// ldmatrix .x4: lanes 8i..8i+7 give the row addresses of matrix i.
inline void ldmatrix_x4(uint32_t (&r)[4], const __nv_bfloat16* p, bool trans) {
  auto& mine = g.xbuf[idx(*g.cur)];
  std::memcpy(&mine[0], &p, sizeof(p));
  warp_barrier();
  const int lane = g.cur->lane, gq = lane / 4, t = lane % 4;
  auto row_ptr = [&](int i, int row) {
    const __nv_bfloat16* q;
    std::memcpy(&q, &g.xbuf[idx(lane_thread(8 * i + row))][0], sizeof(q));
    return q;
  };
  for (int i = 0; i < 4; ++i) {
    uint16_t lo, hi;
    if (!trans) {
      lo = bits(row_ptr(i, gq) + 2 * t);
      hi = bits(row_ptr(i, gq) + 2 * t + 1);
    } else {
      lo = bits(row_ptr(i, 2 * t) + gq);
      hi = bits(row_ptr(i, 2 * t + 1) + gq);
    }
    r[i] = uint32_t(lo) | (uint32_t(hi) << 16);
  }
  warp_barrier();
}

// mma.sync m16n8k16 row.col f32.bf16.bf16.f32
inline void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  auto& mine = g.xbuf[idx(*g.cur)];
  mine[0] = a[0]; mine[1] = a[1]; mine[2] = a[2]; mine[3] = a[3]; mine[4] = b0; mine[5] = b1;
  warp_barrier();
  auto A = [&](int row, int k) {
    const int ln = (row % 8) * 4 + (k % 8) / 2;
    const int reg = (row < 8 ? 0 : 1) + (k < 8 ? 0 : 2);
    const uint32_t w = uint32_t(g.xbuf[idx(lane_thread(ln))][reg]);
    return bf(uint16_t(k % 2 ? w >> 16 : w & 0xffff));
  };
  auto B = [&](int k, int n) {
    const int ln = n * 4 + (k % 8) / 2;
    const uint32_t w = uint32_t(g.xbuf[idx(lane_thread(ln))][k < 8 ? 4 : 5]);
    return bf(uint16_t(k % 2 ? w >> 16 : w & 0xffff));
  };
  const int lane = g.cur->lane, gq = lane / 4, t = lane % 4;
  float out[4];
  for (int e = 0; e < 4; ++e) {
    const int row = gq + 8 * (e / 2), col = 2 * t + (e % 2);
    float acc = c[e];
    for (int k = 0; k < 16; ++k) acc += A(row, k) * B(k, col);
    out[e] = acc;
  }
  warp_barrier();
  for (int e = 0; e < 4; ++e) c[e] = out[e];
}
}  // namespace emu

#define __shfl_xor_sync(mask, v, d) emu::shfl_xor(v, d)
#define __shfl_sync(mask, ...) emu::shfl(__VA_ARGS__)
#define __syncwarp(...) emu::syncwarp()
#define __syncthreads() emu::block_barrier()
#define __syncthreads_or(p) emu::syncthreads_or(p)
template <typename T> inline T __ldg(const T* p) { return *p; }
// one fiber runs at a time: a read-modify-write is atomic between switches
inline float atomicAdd(float* p, float v) { const float old = *p; *p = old + v; return old; }
inline int atomicAdd(int* p, int v) { const int old = *p; *p = old + v; return old; }
inline unsigned long long atomicMax(unsigned long long* p, unsigned long long v) {
  const unsigned long long old = *p; *p = v > old ? v : old; return old;
}
inline unsigned long long atomicExch(unsigned long long* p, unsigned long long v) {
  const unsigned long long old = *p; *p = v; return old;
}
// one memory for every thread, and it is always current: fences order nothing more
inline void __threadfence() {}
template <typename T> inline T __ldcg(const T* p) { return *p; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
using std::isnan;  // CUDA's is global
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline int64_t min(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t max(int64_t a, int64_t b) { return a > b ? a : b; }

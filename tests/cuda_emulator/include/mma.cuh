// emulator's mma.cuh: the same wrappers, run by emu.h's warp collectives
#pragma once
#include "vec.cuh"  // pack_bf16, as the real mma.cuh
// A shared address is an offset into the block's dynamic shared memory (where every
// kernel's ldmatrix reads), so that bits flipped in it flip the same bits of the offset.
inline uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(static_cast<const char*>(p) - emu::g.dyn_smem.data());
}
inline const __nv_bfloat16* smem_at(uint32_t addr) {
  return reinterpret_cast<const __nv_bfloat16*>(emu::g.dyn_smem.data() + addr);
}
inline void ldmatrix_x4(uint32_t (&r)[4], const __nv_bfloat16* p) { emu::ldmatrix_x4(r, p, false); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const __nv_bfloat16* p) { emu::ldmatrix_x4(r, p, true); }
inline void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) { emu::ldmatrix_x4(r, smem_at(addr), false); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) { emu::ldmatrix_x4(r, smem_at(addr), true); }
inline void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) { emu::mma(c, a, b0, b1); }

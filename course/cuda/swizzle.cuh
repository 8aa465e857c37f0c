// Swizzled rows in shared memory: tiles whose rows are read 8 at a time by ldmatrix (stages 12
// and 14).
//
// ldmatrix reads one 16-byte chunk of 8 consecutive rows at once. In rows of 128 or 256 bytes
// (head_dim 64 or 128, bf16), unswizzled, those 8 chunks sit in the same 4 banks: an 8-way
// conflict. Padding each row by 16 bytes spreads them but puts every row off the 128-byte
// grid, so a lane group's 128-byte copy of a row lands across two 128-byte segments.
// Swizzled, chunk c of row r is stored at chunk position c ^ (r % 8) of its row: the 8 rows'
// chunks fall in 8 different bank groups and each row stays whole and aligned.
//
// In a tile that starts at a multiple of 1024 bytes, chunk c ^ x of a row is at the address
// of chunk c with bits flipped, smem_addr(...) ^ (16 * x): a loop over a row's chunks costs
// one XOR per step, not the row and chunk arithmetic again.
#pragma once

// Where chunk c (dims 8c .. 8c + 7) of row r of a tile with rows of kD bf16 lives, in bf16
// from the tile's start.
template <int kD>
__host__ __device__ __forceinline__ int swizzled(int r, int c) {
  return r * kD + 8 * (c ^ (r & 7));
}

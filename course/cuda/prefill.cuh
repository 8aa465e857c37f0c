// The launch contract stage 12's two prefill attention kernels share (flash_attention_simple.cu
// and flash_attention.cu): what either refuses, in the same words.
#pragma once
#include "tvllm.h"

// Why a prefill kernel refuses these heads, head_dim or scale, or TVLLM_OK. prefill_attention
// (flash_attention.py) sends other head sizes and scales to stage 07's kernel.
inline tvllm_status prefill_refusal(int n_heads, int n_kv_heads, int head_dim, float scale) {
  if (n_kv_heads <= 0 || n_heads % n_kv_heads != 0)
    return "n_heads must be a positive multiple of n_kv_heads (grouped-query attention)";
  if (head_dim != 64 && head_dim != 128)
    return "head_dim must be 64 or 128 (prefill_attention sends other sizes to stage 07's kernel)";
  if (!(scale > 0.f))
    return "scale must be positive (prefill_attention sends other scales to stage 07's kernel)";
  return TVLLM_OK;
}

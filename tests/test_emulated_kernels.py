"""The reference kernels of stages 12 and 14 run on the CPU in tools/cuda_emulator, against
their native twins: their logic (indexing, masks, fragment layouts, split-K) is checked on
every CI run, not only on a GPU. Emulated, not graded: nothing here says anything about speed
or about the GPU's memory model (tools/cuda_emulator/include/emu.h says what is emulated)."""
from __future__ import annotations

import ctypes
import math
import shutil
from pathlib import Path

import pytest
import torch

from course import parts
from course.build import ToolchainMissing

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")

PAGED_SHIM = """
extern "C" const char* emu_paged(const void* q, const void* k, const void* v, void* out,
                                 const int32_t* tables, const int32_t* lens, float* ws, int batch,
                                 int64_t q_stride, int n_heads, int n_kv, int d, int num_blocks,
                                 int block_size, int max_blocks, int max_keys, int partitions,
                                 int partition_keys, float scale) {
  emu::clear_error();
  const char* status = launch_paged_decode_attention(
      q, k, v, out, tables, lens, ws, batch, q_stride, n_heads, n_kv, d, num_blocks, block_size,
      max_blocks, max_keys, partitions, partition_keys, scale, nullptr);
  return emu::error() ? emu::error() : status;
}
"""

FLASH_SHIM = """
extern "C" const char* emu_flash(const void* q, const void* k, const void* v, void* out,
                                 const int32_t* cq, const int32_t* ck, int n_seqs, int max_seqlen,
                                 int64_t qs, int64_t ks, int64_t vs, int n_heads, int n_kv, int d,
                                 float scale) {
  emu::clear_error();
  const char* status = launch_flash_attention(q, k, v, out, cq, ck, n_seqs, max_seqlen, qs, ks,
                                              vs, n_heads, n_kv, d, scale, nullptr);
  return emu::error() ? emu::error() : status;
}
"""


def _library(path: str, shim: str) -> ctypes.CDLL:
    from tools import cuda_emulator
    try:
        return cuda_emulator.build(ROOT / path, shim)
    except ToolchainMissing as e:
        pytest.skip(f"no CUDA headers to build against: {e}")


@pytest.fixture(scope="module")
def paged_lib():
    lib = _library("solutions/14_paged_kernel/paged_attention.cu", PAGED_SHIM)
    lib.emu_paged.restype = ctypes.c_char_p
    lib.emu_paged.argtypes = ([ctypes.c_void_p] * 7 + [ctypes.c_int, ctypes.c_int64]
                              + [ctypes.c_int] * 9 + [ctypes.c_float])
    return lib


# (batch, n_heads, n_kv, head_dim, lengths, options): Llama-3.2-1B's heads, SmolLM2's (3),
# plain multi-head, groups of 6 to 24 (one or two blocks per KV head), head_dims from 8 to 128,
# block sizes 1 to 64, split-K, padding rows, a bad block and a length past the table (NaN
# rows), q as a view of a fused QKV row.
PAGED_CASES = {
    "llama-short": (2, 32, 8, 64, [1, 37], {}),
    "block-edges": (3, 32, 8, 64, [15, 16, 17], {}),
    "padding-row": (2, 32, 8, 64, [100, 0], {}),
    "split-k": (1, 32, 8, 64, [300], {"partition_keys": 64}),
    "smollm2-group-3": (2, 9, 3, 64, [33, 70], {}),
    "multi-head": (1, 8, 8, 64, [50], {}),
    "group-12": (1, 12, 1, 64, [40], {}),
    "group-16": (1, 32, 2, 64, [40], {}),
    "group-24-split": (1, 48, 2, 64, [50], {"partition_keys": 64}),
    "d128-split": (2, 16, 4, 128, [29, 130], {"partition_keys": 64}),
    "d8": (2, 4, 1, 8, [45, 3], {}),
    "d32-split": (2, 4, 2, 32, [45, 70], {"partition_keys": 64}),
    "d96": (1, 8, 2, 96, [77], {}),
    "d120": (1, 6, 3, 120, [33], {}),
    "block-1": (1, 4, 1, 64, [37], {"block_size": 1}),
    "block-4": (1, 4, 1, 64, [45], {"block_size": 4}),
    "block-64": (2, 4, 1, 64, [100, 130], {"block_size": 64}),
    "bad-block": (3, 32, 8, 64, [40, 50, 60], {"bad": 1}),
    "bad-block-split": (3, 32, 8, 64, [40, 50, 60], {"bad": 2, "partition_keys": 64}),
    "too-long": (2, 32, 8, 64, [40, 50], {"too_long": 0}),
    "fused-qkv": (2, 9, 3, 64, [40, 50], {"extra_stride": 2 * 3 * 64}),
}


@pytest.mark.parametrize("case", PAGED_CASES)
def test_paged_attention_kernel_in_the_emulator(paged_lib, case):
    batch, n_heads, n_kv, d, lens, opt = PAGED_CASES[case]
    block_size, partition_keys = opt.get("block_size", 16), opt.get("partition_keys", 0)
    g = torch.Generator().manual_seed(sum(map(ord, case)))
    max_blocks = max(math.ceil(n / block_size) for n in lens) + 1
    num_blocks = batch * max_blocks + 3
    k = torch.randn(num_blocks, block_size, n_kv, d, generator=g).bfloat16()
    v = torch.randn(num_blocks, block_size, n_kv, d, generator=g).bfloat16()
    stride = n_heads * d + opt.get("extra_stride", 0)
    q_rows = torch.randn(batch, stride, generator=g).bfloat16()
    q = q_rows[:, : n_heads * d].view(batch, n_heads, d)
    tables = torch.randperm(num_blocks, generator=g)[: batch * max_blocks].view(
        batch, max_blocks).to(torch.int32).contiguous()
    lens_t = torch.tensor(lens, dtype=torch.int32)
    run_tables, run_lens = tables.clone(), lens_t.clone()
    nan_rows = []
    if "bad" in opt:
        run_tables[opt["bad"], 0] = num_blocks + 5
        nan_rows.append(opt["bad"])
    if "too_long" in opt:
        run_lens[opt["too_long"]] = max_blocks * block_size + 1
        nan_rows.append(opt["too_long"])
    out = torch.full((batch, n_heads, d), 7.0).bfloat16()
    max_keys = max_blocks * block_size
    partitions = math.ceil(max_keys / partition_keys) if partition_keys else 1
    workspace = torch.full((max(1, batch * n_heads * partitions * (d + 2)),), float("nan"))
    scale = d ** -0.5
    error = paged_lib.emu_paged(
        q_rows.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), run_tables.data_ptr(),
        run_lens.data_ptr(), workspace.data_ptr(), batch, stride, n_heads, n_kv, d, num_blocks,
        block_size, max_blocks, max_keys, partitions, partition_keys, scale)
    assert error is None, f"the launcher or the emulator said: {error.decode()}"
    for r in nan_rows:
        assert out[r].float().isnan().all(), f"row {r} reads an unreadable block or length: NaN"
    keep = [r for r in range(batch) if r not in nan_rows]
    native = parts.reference("14", "paged_attention").paged_decode_attention_native
    expected = native(q.contiguous(), k, v, tables, lens_t, scale)
    # P is rounded to bf16 before P V (as on the tensor cores): a bf16 step of O(1) outputs
    torch.testing.assert_close(out[keep].float(), expected[keep].float(), atol=1.6e-2, rtol=1.6e-2)


@pytest.fixture(scope="module")
def flash_lib():
    lib = _library("solutions/12_online_softmax/flash_attention.cu", FLASH_SHIM)
    lib.emu_flash.restype = ctypes.c_char_p
    lib.emu_flash.argtypes = ([ctypes.c_void_p] * 6 + [ctypes.c_int] * 2 + [ctypes.c_int64] * 3
                              + [ctypes.c_int] * 3 + [ctypes.c_float])
    return lib


@pytest.mark.parametrize("lens_q,lens_k,n_heads,n_kv,d", [
    ([5, 70], [5, 70], 4, 2, 64), ([3, 20], [40, 20], 2, 1, 128), ([130], [130], 2, 2, 64)],
    ids=["packed", "more-keys-than-queries", "two-tiles"])
def test_flash_attention_kernel_in_the_emulator(flash_lib, lens_q, lens_k, n_heads, n_kv, d):
    g = torch.Generator().manual_seed(d + len(lens_q))
    q = torch.randn(sum(lens_q), n_heads, d, generator=g).bfloat16()
    k = torch.randn(sum(lens_k), n_kv, d, generator=g).bfloat16()
    v = torch.randn(sum(lens_k), n_kv, d, generator=g).bfloat16()
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    out = torch.zeros_like(q)
    error = flash_lib.emu_flash(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                cu_q.data_ptr(), cu_k.data_ptr(), len(lens_q), max(lens_q),
                                n_heads * d, n_kv * d, n_kv * d, n_heads, n_kv, d, d ** -0.5)
    assert error is None, f"the launcher or the emulator said: {error.decode()}"
    native = parts.reference("12", "flash_attention").flash_attention_native
    expected = native(q, k, v, cu_q, d ** -0.5, cu_seqlens_k=cu_k)
    torch.testing.assert_close(out.float(), expected.float(), atol=1.6e-2, rtol=1.6e-2)

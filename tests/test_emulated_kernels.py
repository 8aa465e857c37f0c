"""Reference kernels run on the CPU in tools/cuda_emulator, against their native twins or torch:
stage 06's GEMV, stage 09's decode attention, stage 12's flash attention and stage 14's paged
attention. Their logic (indexing, masks, pipelines, fragment layouts, split-K) is checked on
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


def _shim_function(path: str, shim: str, name: str, argtypes: list):
    """The shim's extern "C" function `name` of the kernel file `path`, built for the
    emulator; it returns None or the launcher's (or the emulator's) message."""
    from tools import cuda_emulator
    try:
        lib = cuda_emulator.build(ROOT / path, shim)
    except ToolchainMissing as e:
        pytest.skip(f"no CUDA headers to build against: {e}")
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = ctypes.c_char_p, argtypes
    return fn


@pytest.fixture(scope="module")
def emu_paged():
    return _shim_function("solutions/14_paged_kernel/paged_attention.cu", PAGED_SHIM, "emu_paged",
                          [ctypes.c_void_p] * 7 + [ctypes.c_int, ctypes.c_int64]
                          + [ctypes.c_int] * 9 + [ctypes.c_float])


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
def test_paged_attention_kernel_in_the_emulator(emu_paged, case):
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
    error = emu_paged(
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
def emu_flash():
    return _shim_function("solutions/12_online_softmax/flash_attention.cu", FLASH_SHIM,
                          "emu_flash", [ctypes.c_void_p] * 6 + [ctypes.c_int] * 2
                          + [ctypes.c_int64] * 3 + [ctypes.c_int] * 3 + [ctypes.c_float])


@pytest.mark.parametrize("lens_q,lens_k,n_heads,n_kv,d", [
    ([5, 70], [5, 70], 4, 2, 64), ([3, 20], [40, 20], 2, 1, 128), ([130], [130], 2, 2, 64)],
    ids=["packed", "more-keys-than-queries", "two-tiles"])
def test_flash_attention_kernel_in_the_emulator(emu_flash, lens_q, lens_k, n_heads, n_kv, d):
    g = torch.Generator().manual_seed(d + len(lens_q))
    q = torch.randn(sum(lens_q), n_heads, d, generator=g).bfloat16()
    k = torch.randn(sum(lens_k), n_kv, d, generator=g).bfloat16()
    v = torch.randn(sum(lens_k), n_kv, d, generator=g).bfloat16()
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    out = torch.zeros_like(q)
    error = emu_flash(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), cu_q.data_ptr(),
                      cu_k.data_ptr(), len(lens_q), max(lens_q), n_heads * d, n_kv * d, n_kv * d,
                      n_heads, n_kv, d, d ** -0.5)
    assert error is None, f"the launcher or the emulator said: {error.decode()}"
    native = parts.reference("12", "flash_attention").flash_attention_native
    expected = native(q, k, v, cu_q, d ** -0.5, cu_seqlens_k=cu_k)
    torch.testing.assert_close(out.float(), expected.float(), atol=1.6e-2, rtol=1.6e-2)


GEMV_SHIM = """
extern "C" const char* emu_gemv(const void* x, const void* w, void* y, int f32, int64_t tokens,
                                int64_t in_features, int64_t out_features) {
  emu::clear_error();
  const char* status = launch_gemv(x, w, y, f32 != 0, tokens, in_features, out_features,
                                   nullptr, 0, nullptr);
  return emu::error() ? emu::error() : status;
}
"""


@pytest.fixture(scope="module")
def emu_gemv():
    return _shim_function("solutions/06_gemm/gemv.cu", GEMV_SHIM, "emu_gemv",
                          [ctypes.c_void_p] * 3 + [ctypes.c_int] + [ctypes.c_int64] * 3)


# (in, out, tokens, float32 out): one 2048-column unit per row, rows of several units (8192)
# and of a partly empty one (4104), rows shorter than a unit, fewer rows than warps, and more
# rows than the emulated device's 64 warps (each warp loops over its rows).
@pytest.mark.parametrize("in_features,out_features,tokens,f32", [
    (2048, 96, 1, False), (8192, 70, 2, False), (4104, 37, 3, False), (576, 150, 8, False),
    (72, 13, 5, False), (2048, 200, 1, True)])
def test_gemv_kernel_in_the_emulator(emu_gemv, in_features, out_features, tokens, f32):
    g = torch.Generator().manual_seed(in_features + out_features + tokens)
    x = torch.randn(tokens, in_features, generator=g).bfloat16()
    w = (torch.randn(out_features, in_features, generator=g) * in_features ** -0.5).bfloat16()
    y = torch.full((tokens, out_features), 7.0, dtype=torch.float32 if f32 else torch.bfloat16)
    error = emu_gemv(x.data_ptr(), w.data_ptr(), y.data_ptr(), int(f32), tokens, in_features,
                     out_features)
    assert error is None, f"the launcher or the emulator said: {error.decode()}"
    expected = x.float() @ w.float().t()
    tol = 1e-4 if f32 else 1.6e-2
    torch.testing.assert_close(y.float(), expected, atol=tol, rtol=tol)


DECODE_SHIM = """
extern "C" const char* emu_decode(const void* q, const void* k, const void* v, void* out,
                                  const int32_t* slots, const int32_t* lens, int batch,
                                  int64_t q_stride, int n_heads, int n_kv, int d, int num_slots,
                                  int max_len, float scale) {
  emu::clear_error();
  const char* status = launch_decode_attention(q, k, v, out, slots, lens, batch, q_stride,
                                               n_heads, n_kv, d, num_slots, max_len, scale,
                                               nullptr);
  return emu::error() ? emu::error() : status;
}
"""


@pytest.fixture(scope="module")
def emu_decode():
    return _shim_function("solutions/09_kv_cache/decode_attention.cu", DECODE_SHIM, "emu_decode",
                          [ctypes.c_void_p] * 6 + [ctypes.c_int, ctypes.c_int64]
                          + [ctypes.c_int] * 5 + [ctypes.c_float])


@pytest.mark.parametrize("batch,n_heads,n_kv,d,lens", [
    (2, 32, 8, 64, [1, 70]), (3, 9, 3, 64, [16, 17, 0]), (1, 16, 2, 128, [130]),
    (2, 12, 1, 32, [40, 5]), (1, 6, 6, 96, [33])],
    ids=["llama", "smollm2-padding", "d128-group8", "group12-d32", "multi-head-d96"])
def test_decode_attention_kernel_in_the_emulator(emu_decode, batch, n_heads, n_kv, d, lens):
    g = torch.Generator().manual_seed(batch * 1000 + d + n_heads)
    num_slots, max_len = batch + 2, max(lens) + 5
    k = torch.randn(num_slots, max_len, n_kv, d, generator=g).bfloat16()
    v = torch.randn(num_slots, max_len, n_kv, d, generator=g).bfloat16()
    q = torch.randn(batch, n_heads, d, generator=g).bfloat16()
    slots = torch.randperm(num_slots, generator=g)[:batch].to(torch.int32)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    out = torch.full((batch, n_heads, d), 7.0).bfloat16()
    error = emu_decode(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                       slots.data_ptr(), lens_t.data_ptr(), batch, n_heads * d, n_heads, n_kv, d,
                       num_slots, max_len, d ** -0.5)
    assert error is None, f"the launcher or the emulator said: {error.decode()}"
    native = parts.reference("09", "decode_attention").decode_attention_native
    expected = native(q, k, v, slots, lens_t, d ** -0.5)
    torch.testing.assert_close(out.float(), expected.float(), atol=1.6e-2, rtol=1.6e-2)

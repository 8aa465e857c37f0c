"""Reference kernels run on the CPU in tests/cuda_emulator, against their native twins or torch:
the small kernels of a decode step (stages 04, 05, 08, 13; stage 08's argmax cut into
pieces), stage 06's GEMV, stage 07's and stage 12's prefill attention, and stage 09's and
stage 14's decode attention. Their logic (indexing, masks, pipelines, fragment layouts,
split-K) is checked on every CI run, not only on a GPU. Emulated, not graded: nothing here says anything about speed
or about the GPU's memory model (tests/cuda_emulator/include/emu.h says what is emulated)."""
from __future__ import annotations

import ctypes
import math
import shutil

import pytest
import torch

from course import parts
from course.build import ToolchainMissing
from course.testing import attention_mistakes, checks, diagnose, gemv_mistakes

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")

# Every shim function clears the emulator's error, calls the launcher and returns the
# emulator's message (a deadlock) or the launcher's (None: launched).
CALL = """
#define EMU_CALL(call) do { emu::clear_error(); const char* s = call; \\
                            return emu::error() ? emu::error() : s; } while (0)
"""

PAGED_SHIM = CALL + """
extern "C" const char* emu_paged(const void* q, void* k, void* v, void* out,
                                 const int32_t* tables, const int32_t* lens, float* ws,
                                 int32_t* tickets, const void* k_new, const void* v_new,
                                 int64_t new_stride, const int64_t* positions,
                                 const float* cos_sin, int64_t max_positions, int batch,
                                 int64_t q_stride, int n_heads, int n_kv, int d, int num_blocks,
                                 int block_size, int max_blocks, int max_keys, int partitions,
                                 int partition_keys, bool exact, float scale) {
  EMU_CALL(launch_paged_decode_attention(
      q, k, v, out, tables, lens, ws, tickets, k_new, v_new, new_stride, positions, cos_sin,
      max_positions, batch, q_stride, n_heads, n_kv, d, num_blocks, block_size,
      max_blocks, max_keys, partitions, partition_keys, exact, scale, nullptr));
}
extern "C" int emu_partition_keys(int batch, int n_heads, int n_kv, int64_t max_keys, int split) {
  return paged_attention_partition_keys(batch, n_heads, n_kv, max_keys, split);
}
"""

PAGED_SIMPLE_SHIM = CALL + """
extern "C" const char* emu_paged_simple(const void* q, const void* k, const void* v, void* out,
                                        const int32_t* tables, const int32_t* lens, int batch,
                                        int64_t q_stride, int n_heads, int n_kv, int d,
                                        int num_blocks, int block_size, int max_blocks,
                                        int max_keys, float scale) {
  EMU_CALL(launch_paged_decode_attention_simple(q, k, v, out, tables, lens, batch, q_stride,
                                                n_heads, n_kv, d, num_blocks, block_size,
                                                max_blocks, max_keys, scale, nullptr));
}
"""

FLASH_SHIM = CALL + """
extern "C" const char* emu_flash(const void* q, const void* k, const void* v, void* out,
                                 const int32_t* cq, const int32_t* ck, int n_seqs, int max_seqlen,
                                 int64_t qs, int64_t ks, int64_t vs, int n_heads, int n_kv, int d,
                                 float scale) {
  EMU_CALL(launch_flash_attention(q, k, v, out, cq, ck, n_seqs, max_seqlen, qs, ks, vs, n_heads,
                                  n_kv, d, scale, nullptr));
}
"""

FLASH_SIMPLE_SHIM = CALL + """
extern "C" const char* emu_flash_simple(const void* q, const void* k, const void* v, void* out,
                                        const int32_t* cq, const int32_t* ck, int n_seqs,
                                        int max_seqlen, int64_t qs, int64_t ks, int64_t vs,
                                        int n_heads, int n_kv, int d, float scale) {
  EMU_CALL(launch_flash_attention_simple(q, k, v, out, cq, ck, n_seqs, max_seqlen, qs, ks, vs,
                                         n_heads, n_kv, d, scale, nullptr));
}
"""


def _shim_function(stage: str, filename: str, shim: str, name: str, argtypes: list,
                   restype=ctypes.c_char_p):
    """The shim's extern "C" function `name` of stage `stage`'s kernel file, built for the
    emulator: the reference's, or the student's when TINYVLLM_STUDENT names the stage (the
    parts resolver; `python3 -m grader emulate NN`). A launch returns None or the launcher's
    (or the emulator's) message."""
    from tests import cuda_emulator
    try:
        lib = cuda_emulator.build(parts.path(stage, filename), shim)
    except ToolchainMissing as e:
        pytest.skip(f"no CUDA headers to build against: {e}")
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = restype, argtypes
    return fn


def _ok(error: bytes | None) -> None:
    if error is None:
        return
    message = error.decode()
    if message.startswith("TODO stage"):   # a skeleton's launcher: the grader reads TODO, as on a GPU
        raise NotImplementedError(message)
    pytest.fail(f"the launcher or the emulator said: {message}", pytrace=False)


def _close(got: torch.Tensor, expected: torch.Tensor, what: str, *, atol: float, rtol: float,
           **shape) -> None:
    """got against expected at (atol, rtol); a failure names the kernel, the case's shape and
    the first wrong elements (course/testing/checks.py), not only that they differ."""
    checks.assert_close(got.float(), expected.float(), what=f"{what} [{diagnose.shape(**shape)}]",
                        dtype=torch.float32, atol=atol, rtol=rtol)


def _packed(lens_q: list[int], lens_k: list[int], n_heads: int, n_kv: int, d: int, seed: int):
    """q [Tq, n_heads, d], k, v [Tk, n_kv, d] bf16 and the int32 cu_seqlens of both."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), n_heads, d, generator=g).bfloat16()
    k = torch.randn(sum(lens_k), n_kv, d, generator=g).bfloat16()
    v = torch.randn(sum(lens_k), n_kv, d, generator=g).bfloat16()
    cu = [torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
          for n in (lens_q, lens_k)]
    return q, k, v, cu[0], cu[1]


@pytest.fixture(scope="module")
def emu_paged():
    return _shim_function("14", "paged_attention.cu", PAGED_SHIM, "emu_paged",
                          [ctypes.c_void_p] * 10 + [ctypes.c_int64, ctypes.c_void_p,
                                                    ctypes.c_void_p, ctypes.c_int64,
                                                    ctypes.c_int, ctypes.c_int64]
                          + [ctypes.c_int] * 9 + [ctypes.c_bool, ctypes.c_float])


# (batch, n_heads, n_kv, head_dim, lengths, options): Llama-3.2-1B's heads, SmolLM2's (3),
# plain multi-head, groups of 6 to 24 (one or two blocks per KV head), head_dims from 8 to 128,
# block sizes 1 to 64, split-K (a sequence in one partition, partitions merged in several rounds
# of loads, sequences of at most kWholeKeys = 256 keys whole when the size is not forced), the new token written and rotated by the kernel (stage 05's rope on q and on the
# new key, stored at key len - 1; with two blocks per KV head; a position outside the table),
# padding rows, a bad block and a length past the table (NaN
# rows), q as a view of a fused QKV row.
PAGED_CASES = {
    "llama-short": (2, 32, 8, 64, [1, 37], {}),
    "block-edges": (3, 32, 8, 64, [15, 16, 17], {}),
    "padding-row": (2, 32, 8, 64, [100, 0], {}),
    "split-k": (1, 32, 8, 64, [300], {"partition_keys": 64}),
    "split-k-one-partition": (3, 32, 8, 64, [40, 300, 64], {"partition_keys": 64}),
    "split-k-many": (1, 32, 8, 64, [1000], {"partition_keys": 16}),
    "split-k-many-d128-group-24": (1, 48, 2, 128, [500], {"partition_keys": 16}),
    "split-k-whole-short": (4, 32, 8, 64, [256, 257, 1, 600], {"partition_keys": 64,
                                                                "whole": True}),
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
    # the bad block in the first of a row's 4 partitions: its NaN l must survive the merge
    "bad-block-merged": (2, 8, 2, 64, [40, 200], {"bad": 1, "partition_keys": 64}),
    "too-long": (2, 32, 8, 64, [40, 50], {"too_long": 0}),
    "fused-qkv": (2, 9, 3, 64, [40, 50], {"extra_stride": 2 * 3 * 64}),
    "new-token": (3, 32, 8, 64, [37, 1, 0], {"new": True}),
    "new-token-split": (2, 32, 8, 64, [300, 17], {"new": True, "partition_keys": 64}),
    # the new key in a step the pipeline's prologue copies (37 here, 50 in the d128 case) or in
    # one copied inside its loop (200 here, 100 there): stored, then copied back, either way
    "new-token-late-step": (2, 32, 8, 64, [200, 37], {"new": True}),
    "new-token-d128-group-24": (2, 48, 2, 128, [50, 100], {"new": True}),
    "new-token-bad-position": (2, 32, 8, 64, [40, 50], {"new": True, "bad_position": 1}),
    # grids of fewer blocks than the emulator's 4 SMs take the deeper ring (kFewBlocksStages):
    # a warp's 4 steps all copied up front, the new key's among them (stored first); and a ring
    # that wraps around many times
    "few-blocks-new-token": (1, 8, 2, 64, [250], {"new": True}),
    "few-blocks-long": (1, 12, 3, 64, [700], {}),
    # rows shorter than a block's 4 warps (some see no key; in the fast kernel every row here)
    "few-keys": (3, 8, 2, 64, [1, 3, 5], {}),
    # head dims the kernel is not built for: the 128 build, stage 05's pairs d/2 apart (in
    # another fragment at 96, in another lane at 40 and 120)
    "new-token-d96": (2, 8, 2, 96, [77, 16], {"new": True}),
    "new-token-d40": (1, 6, 3, 40, [33], {"new": True}),
    "new-token-d120-split": (2, 6, 3, 120, [200, 33], {"new": True, "partition_keys": 64}),
}


@pytest.fixture(scope="module")
def stage14():
    """Stage 14's GPU test module: its lesson's rule and its failure diagnosis (check_paged)."""
    import importlib.util

    from course import manifest
    path = manifest.find("14").tests_dir() / "test_paged_attention.py"
    spec = importlib.util.spec_from_file_location("_stage14_tests", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class PagedCase:
    """One PAGED_CASES entry's inputs: q (maybe a view of QKV rows), a shuffled pool, block
    tables with a spare column, and the rows that must be NaN (a bad block, a length past the
    table, a position outside the rope table)."""

    def __init__(self, case: str):
        batch, n_heads, n_kv, d, lens, opt = PAGED_CASES[case]
        self.batch, self.n_heads, self.n_kv, self.d, self.lens = batch, n_heads, n_kv, d, lens
        self.opt = opt
        self.block_size = bs = opt.get("block_size", 16)
        g = torch.Generator().manual_seed(sum(map(ord, case)))
        self.max_blocks = max(math.ceil(n / bs) for n in lens) + 1
        self.num_blocks = batch * self.max_blocks + 3
        self.k = torch.randn(self.num_blocks, bs, n_kv, d, generator=g).bfloat16()
        self.v = torch.randn(self.num_blocks, bs, n_kv, d, generator=g).bfloat16()
        self.new = opt.get("new", False)
        self.stride = n_heads * d + opt.get("extra_stride", 0) + (2 * n_kv * d if self.new else 0)
        self.q_rows = torch.randn(batch, self.stride, generator=g).bfloat16()
        self.q = self.q_rows[:, : n_heads * d].view(batch, n_heads, d)
        self.new_token, self.max_positions = None, 4096
        if self.new:   # k and v as the QKV projection's views; q and k not yet rotated
            at = n_heads * d
            k_new, v_new = (self.q_rows[:, at + i * n_kv * d: at + (i + 1) * n_kv * d]
                            .view(batch, n_kv, d) for i in range(2))
            angles = torch.rand(self.max_positions, d // 2, generator=g) * 100
            positions = (torch.tensor(lens) - 1).clamp(min=0) * 7
            if "bad_position" in opt:
                positions[opt["bad_position"]] = self.max_positions
            self.new_token = (k_new, v_new, positions,
                              torch.cat([angles.cos(), angles.sin()], 1))
        self.tables = torch.randperm(self.num_blocks, generator=g)[: batch * self.max_blocks] \
            .view(batch, self.max_blocks).to(torch.int32).contiguous()
        self.lens_t = torch.tensor(lens, dtype=torch.int32)
        self.run_tables, self.run_lens = self.tables.clone(), self.lens_t.clone()
        self.nan_rows = []
        if "bad" in opt:
            self.run_tables[opt["bad"], 0] = self.num_blocks + 5
            self.nan_rows.append(opt["bad"])
        if "too_long" in opt:
            self.run_lens[opt["too_long"]] = self.max_blocks * bs + 1
            self.nan_rows.append(opt["too_long"])
        if "bad_position" in opt:
            self.nan_rows.append(opt["bad_position"])
        self.keep = [r for r in range(batch) if r not in self.nan_rows]
        self.out = torch.full((batch, n_heads, d), 7.0).bfloat16()
        self.max_keys = self.max_blocks * bs
        self.scale = d ** -0.5

    def check(self, stage14, kernel: str, expected: torch.Tensor, partition: int) -> None:
        """NaN rows NaN, the others as `expected`; a failure names the shape and the mistake."""
        for r in self.nan_rows:
            if not self.out[r].float().isnan().all():
                raise AssertionError(
                    f"{kernel} kernel: row {r} reads a block outside the pool, a length past "
                    "the block table or a position outside the rope table, so it must be NaN. "
                    + stage14.NAN_ROWS_HINT)
        keep = self.keep
        # P is rounded to bf16 before P V (as on the tensor cores): a bf16 step of O(1) outputs
        stage14.check_paged(
            self.out[keep].float(), expected[keep].float(), self.q[keep], self.k, self.v,
            self.tables[keep].tolist(), [self.lens[r] for r in keep], self.scale,
            kernel=kernel, partition=partition, what=f"the {kernel} kernel in the emulator",
            whole_keys=256 if self.opt.get("whole") else 0, poison=7.0, atol=1.6e-2,
            rtol=1.6e-2)


@pytest.mark.parametrize("case", PAGED_CASES)
def test_paged_attention_kernel_in_the_emulator(emu_paged, stage14, case):
    c = PagedCase(case)
    partition_keys = c.opt.get("partition_keys", 0)
    partitions = math.ceil(c.max_keys / partition_keys) if partition_keys else 1
    workspace = torch.full((max(1, c.batch * c.n_heads * partitions * (c.d + 2)),),
                           float("nan"))
    tickets = torch.zeros(c.batch * c.n_heads, dtype=torch.int32)
    k_before, v_before = c.k.clone(), c.v.clone()
    new, new_token = c.new, c.new_token
    error = emu_paged(
        c.q_rows.data_ptr(), c.k.data_ptr(), c.v.data_ptr(), c.out.data_ptr(),
        c.run_tables.data_ptr(), c.run_lens.data_ptr(), workspace.data_ptr(), tickets.data_ptr(),
        *(t.data_ptr() for t in new_token[:2]) if new else (None, None), c.stride if new else 0,
        *(t.data_ptr() for t in new_token[2:]) if new else (None, None), c.max_positions,
        c.batch, c.stride, c.n_heads, c.n_kv, c.d, c.num_blocks, c.block_size, c.max_blocks,
        c.max_keys, partitions, partition_keys, not c.opt.get("whole", False), c.scale)
    _ok(error)
    assert not tickets.any(), ("split-K's tickets must be 0 again after the launch (the block "
                               "that merges resets its counter), or the next launch miscounts")
    native = parts.reference("14", "paged_attention").paged_decode_attention_native
    if new:   # the twin writes the new tokens of the rows it keeps into copies of the caches
        k_want, v_want = k_before.clone(), v_before.clone()
        kept = torch.tensor(c.keep)
        expected = torch.zeros_like(c.q)
        expected[kept] = native(c.q[kept].contiguous(), k_want, v_want, c.tables[kept],
                                c.lens_t[kept], c.scale,
                                new_token=tuple(t[kept] for t in new_token[:3])
                                + (new_token[3],))
        if "bad_position" in c.opt:   # rope_cache_write stores a NaN key there, and the value
            r = c.opt["bad_position"]
            n = c.lens[r]
            slot = (c.tables[r, (n - 1) // c.block_size], (n - 1) % c.block_size)
            k_want[slot] = float("nan")
            v_want[slot] = new_token[1][r]
        for got, want in ((c.k, k_want), (c.v, v_want)):
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=(
                "the new token's key (rotated with stage 05's roundings) and value must be "
                "stored at its sequence's key len - 1, bit for bit as rope_cache_write stores "
                "them, and nothing else in the caches may change"))
        # the mistakes are computed on the caches as the kernel left them (the new keys in)
        c.check(stage14, "fast", expected, partition_keys if partitions > 1 else 0)
        return
    expected = native(c.q.contiguous(), c.k, c.v, c.tables, c.lens_t, c.scale)
    c.check(stage14, "fast", expected, partition_keys if partitions > 1 else 0)


# Part 1's kernel (no split-K, no new token) on the cases that do not need either, and rows
# shorter than its 4 warps (warps that see no key).
SIMPLE_CASES = ["llama-short", "block-edges", "padding-row", "smollm2-group-3", "multi-head",
                "group-12", "d8", "d96", "d120", "block-1", "block-4", "block-64", "bad-block",
                "too-long", "fused-qkv", "few-keys", "few-blocks-long"]


@pytest.fixture(scope="module")
def emu_paged_simple():
    return _shim_function("14", "paged_attention_simple.cu", PAGED_SIMPLE_SHIM,
                          "emu_paged_simple", [ctypes.c_void_p] * 6 + [ctypes.c_int,
                                                                       ctypes.c_int64]
                          + [ctypes.c_int] * 7 + [ctypes.c_float])


@pytest.mark.parametrize("case", SIMPLE_CASES)
def test_paged_attention_kernel_simple_in_the_emulator(emu_paged_simple, stage14, case):
    c = PagedCase(case)
    error = emu_paged_simple(
        c.q_rows.data_ptr(), c.k.data_ptr(), c.v.data_ptr(), c.out.data_ptr(),
        c.run_tables.data_ptr(), c.run_lens.data_ptr(), c.batch, c.stride, c.n_heads, c.n_kv,
        c.d, c.num_blocks, c.block_size, c.max_blocks, c.max_keys, c.scale)
    _ok(error)
    native = parts.reference("14", "paged_attention").paged_decode_attention_native
    c.check(stage14, "simple", native(c.q.contiguous(), c.k, c.v, c.tables, c.lens_t, c.scale),
            0)


@pytest.fixture(scope="module")
def emu_partition_keys():
    return _shim_function("14", "paged_attention.cu", PAGED_SHIM, "emu_partition_keys",
                          [ctypes.c_int] * 3 + [ctypes.c_int64, ctypes.c_int], ctypes.c_int)


def test_partition_rule_in_the_emulator(emu_partition_keys, stage14):
    """paged_attention_partition_keys on the emulator's 4-SM device (one block per SM: a grid
    of 4) against the lesson's rule as stage 14's GPU test writes it: batch 1 and 2, groups of
    4, 12 (one block per KV head) and 24 (two), split decided / forced / refused."""
    for batch in (1, 2, 8):
        for n_heads, n_kv in ((32, 8), (12, 1), (24, 1), (4, 1)):
            for max_keys in (40, 64, 65, 300, 4096, 40000):
                for split, flag in ((None, -1), (True, 1), (False, 0)):
                    got = emu_partition_keys(batch, n_heads, n_kv, max_keys, flag)
                    if got == -1:   # the skeleton's answer (kRuleNotWritten), as the binding says
                        raise NotImplementedError("TODO stage 14: paged_attention_partition_keys,"
                                                  " the split-K rule, is not written yet")
                    expected = stage14.expected_partition_keys(batch, n_heads, n_kv,
                                                               max_keys, 4, split)
                    assert got == expected, (
                        f"batch {batch}, {n_heads} / {n_kv} heads, max_keys {max_keys}, "
                        f"split={split} on 4 SMs: paged_attention_partition_keys gave {got}, "
                        f"the lesson's rule {expected} (0 = the single pass)")


@pytest.fixture(scope="module")
def emu_flash():
    return _shim_function("12", "flash_attention.cu", FLASH_SHIM,
                          "emu_flash", FLASH_ARGTYPES)


@pytest.fixture(scope="module")
def emu_flash_simple():
    return _shim_function("12", "flash_attention_simple.cu", FLASH_SIMPLE_SHIM,
                          "emu_flash_simple", FLASH_ARGTYPES)


FLASH_ARGTYPES = ([ctypes.c_void_p] * 6 + [ctypes.c_int] * 2 + [ctypes.c_int64] * 3
                  + [ctypes.c_int] * 3 + [ctypes.c_float])


def _run_flash(launcher, lens_q, lens_k, n_heads, n_kv, d, *, what: str, tile_rows: int):
    """One packed batch through an emulated stage-12 kernel, checked against the float32
    reference with the known mistakes' patterns (course/testing/attention_mistakes.py)."""
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, n_heads, n_kv, d, seed=d + len(lens_q))
    out = torch.full_like(q, float("nan"))
    _ok(launcher(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), cu_q.data_ptr(),
                 cu_k.data_ptr(), len(lens_q), max(lens_q), n_heads * d, n_kv * d, n_kv * d,
                 n_heads, n_kv, d, d ** -0.5))
    attention_mistakes.assert_attention(out, q, k, v, lens_q, lens_k, d ** -0.5, what=what,
                                        tile_rows=tile_rows)


# (query lengths, key lengths, heads, KV heads, head_dim): packed sequences with partial query
# and key tiles, more keys than queries (a cached prefix), grouped-query heads, head_dim 128,
# a block whose rows' keys end in the next key tile than its first row's (24 queries after 56
# cached keys), and a sequence of several query tiles (130 rows: 9 blocks of 16, 3 key tiles).
@pytest.mark.parametrize("lens_q,lens_k,n_heads,n_kv,d", [
    ([5, 37], [5, 37], 4, 2, 64), ([3, 24], [70, 80], 2, 1, 128), ([130], [130], 2, 2, 64)],
    ids=["packed", "more-keys-than-queries", "many-tiles"])
def test_flash_attention_simple_kernel_in_the_emulator(emu_flash_simple, lens_q, lens_k, n_heads,
                                                       n_kv, d):
    _run_flash(emu_flash_simple, lens_q, lens_k, n_heads, n_kv, d,
               what="flash_attention_simple in the emulator", tile_rows=16)


@pytest.mark.parametrize("lens_q,lens_k,n_heads,n_kv,d", [
    ([5, 70], [5, 70], 4, 2, 64), ([3, 20], [40, 20], 2, 1, 128), ([130], [130], 2, 2, 64),
    ([1030, 3], [1030, 3], 1, 1, 64)],
    ids=["packed", "more-keys-than-queries", "two-tiles", "128-row-tiles"])
def test_flash_attention_kernel_in_the_emulator(emu_flash, lens_q, lens_k, n_heads, n_kv, d):
    """Sequences of at most 1024 queries run in 64-row tiles, longer ones in 128-row tiles
    (the last case)."""
    _run_flash(emu_flash, lens_q, lens_k, n_heads, n_kv, d, what="flash_attention in the emulator",
               tile_rows=64 if max(lens_q) <= 1024 else 128)


GEMV_SIMPLE_SHIM = CALL + """
extern "C" const char* emu_gemv_simple(const void* x, const void* w, void* y, int f32,
                                       int64_t tokens, int64_t in_features, int64_t out_features) {
  EMU_CALL(launch_gemv_simple(x, w, y, f32 != 0, tokens, in_features, out_features, nullptr));
}
"""

GEMV_SHIM = CALL + """
extern "C" const char* emu_gemv(const void* x, const void* w, void* y, int f32, int64_t tokens,
                                int64_t in_features, int64_t out_features) {
  EMU_CALL(launch_gemv(x, w, y, f32 != 0, tokens, in_features, out_features, nullptr));
}
extern "C" const char* emu_gemv_silu_mul(const void* x, const void* w, void* y, int64_t tokens,
                                         int64_t in_features, int64_t inter) {
  EMU_CALL(launch_gemv_silu_mul(x, w, y, tokens, in_features, inter, nullptr));
}
// the Hopper path directly (the emulated device says sm_80, so launch_gemv never takes it)
extern "C" const char* emu_gemv_tma(const void* x, const void* w, void* y, int f32,
                                    int in_features, int out_features, int pair) {
  const auto* xb = static_cast<const __nv_bfloat16*>(x);
  const auto* wb = static_cast<const __nv_bfloat16*>(w);
  if (f32) EMU_CALL(launch_tma(xb, wb, static_cast<float*>(y), in_features, out_features, pair, nullptr));
  EMU_CALL(launch_tma(xb, wb, static_cast<__nv_bfloat16*>(y), in_features, out_features, pair, nullptr));
}
// the lm_head's greedy pick (launch_gemv_norm with pick; the product without the norm)
extern "C" const char* emu_gemv_tma_pick(const void* x, const void* w, float* y, int in_features,
                                         int out_features, int64_t* pick, int32_t* counters,
                                         int64_t* host, const int64_t* slot, int64_t stride,
                                         int64_t slots) {
  EMU_CALL((launch_tma<float, true>(static_cast<const __nv_bfloat16*>(x),
                                    static_cast<const __nv_bfloat16*>(w), y, in_features,
                                    out_features, 0, nullptr, Prologue{},
                                    pick_of(pick, counters, HostRows{host, slot, stride, slots}))));
}
// ... with the RMSNorm prologue (launch_gemv_norm's kernel)
extern "C" const char* emu_gemv_tma_norm(const void* x, const void* add, void* sum,
                                         const void* norm, float eps, const void* w, void* y,
                                         int f32, int in_features, int out_features, int pair) {
  const Prologue pro{static_cast<const __nv_bfloat16*>(add), static_cast<__nv_bfloat16*>(sum),
                     static_cast<const __nv_bfloat16*>(norm), eps};
  const auto* xb = static_cast<const __nv_bfloat16*>(x);
  const auto* wb = static_cast<const __nv_bfloat16*>(w);
  if (f32) EMU_CALL(launch_tma(xb, wb, static_cast<float*>(y), in_features, out_features, pair, nullptr, pro));
  EMU_CALL(launch_tma(xb, wb, static_cast<__nv_bfloat16*>(y), in_features, out_features, pair, nullptr, pro));
}
"""


@pytest.fixture(scope="module")
def emu_gemv_simple():
    return _shim_function("06", "gemv_simple.cu", GEMV_SIMPLE_SHIM, "emu_gemv_simple",
                          [ctypes.c_void_p] * 3 + [ctypes.c_int] + [ctypes.c_int64] * 3)


# (in, out, tokens, float32 out): part 1, a warp per output: rows of a whole number of 32-piece
# sweeps (2048) and with a partial last sweep (576, 72: fewer pieces than lanes), outputs that
# do not fill the last block of 8 warps (45, 13), every token count's sums, float32 logits.
@pytest.mark.parametrize("in_features,out_features,tokens,f32", [
    (2048, 45, 1, False), (576, 40, 3, False), (72, 13, 8, False), (2056, 17, 2, True)])
def test_gemv_simple_kernel_in_the_emulator(emu_gemv_simple, in_features, out_features, tokens,
                                            f32):
    x, w, y = _gemv_operands(in_features, out_features, tokens, f32)
    _ok(emu_gemv_simple(x.data_ptr(), w.data_ptr(), y.data_ptr(), int(f32), tokens,
                        in_features, out_features))
    gemv_mistakes.assert_gemv(y, x, w, what="gemv_simple in the emulator", warps_per_block=8,
                              hint=gemv_mistakes.SIMPLE_HINT)


def _gemv_operands(in_features: int, out_features: int, tokens: int, f32: bool):
    """x [tokens, in], w [out, in] (scaled by 1/sqrt(in): O(1) outputs) bf16 and y filled
    with NaN (an output never written stays NaN), float32 or bf16."""
    g = torch.Generator().manual_seed(in_features + out_features + tokens)
    x = torch.randn(tokens, in_features, generator=g).bfloat16()
    w = (torch.randn(out_features, in_features, generator=g) * in_features ** -0.5).bfloat16()
    y = torch.full((tokens, out_features), float("nan"),
                   dtype=torch.float32 if f32 else torch.bfloat16)
    return x, w, y


@pytest.fixture(scope="module")
def emu_gemv():
    return _shim_function("06", "gemv.cu", GEMV_SHIM, "emu_gemv",
                          [ctypes.c_void_p] * 3 + [ctypes.c_int] + [ctypes.c_int64] * 3)


# (in, out, tokens, float32 out), units of 1024 columns: rows of 2 units (2048: groups of 2
# warps, whose rows per group differ inside a block at out 45), of 8 (8192: two units per warp
# of a group of 4), of 4 (4096: one unit per warp of a group of 4), of 16, and of 5 with a
# partly empty one (4104: one warp per row); rows of one unit (576) and shorter than a unit;
# fewer rows than warps, and more rows than the emulated device's warps (each warp, or group,
# loops over its rows).
@pytest.mark.parametrize("in_features,out_features,tokens,f32", [
    (2048, 96, 1, False), (2048, 45, 1, False), (8192, 70, 2, False), (4096, 45, 1, False),
    (16384, 9, 4, True), (4104, 37, 3, False), (576, 150, 8, False), (72, 13, 5, False),
    (2048, 200, 1, True)])
def test_gemv_kernel_in_the_emulator(emu_gemv, in_features, out_features, tokens, f32):
    x, w, y = _gemv_operands(in_features, out_features, tokens, f32)
    error = emu_gemv(x.data_ptr(), w.data_ptr(), y.data_ptr(), int(f32), tokens, in_features,
                     out_features)
    _ok(error)
    gemv_mistakes.assert_gemv(y, x, w, what="gemv (fast) in the emulator",
                              unit=gemv_mistakes.FAST_UNIT, hint=gemv_mistakes.FAST_HINT)


# (in, inter, tokens): rows of 2 units (2048: groups of 4, two warps per row), 1 (576: groups
# of 2), 4 (4096: two units per warp), 5 with a partly empty one (4104: groups of 2)
@pytest.mark.parametrize("in_features,inter,tokens", [
    (2048, 48, 1), (576, 75, 3), (4096, 20, 2), (4104, 9, 1)])
def test_gemv_kernel_with_silu_mul_in_the_emulator(in_features, inter, tokens):
    """The gate_up GEMV with the activation in its epilogue: each output pairs gate row j with
    up row j + inter; against linear_native then stage 08's silu_mul twin."""
    fused = _shim_function("06", "gemv.cu", GEMV_SHIM, "emu_gemv_silu_mul",
                           [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3)
    g = torch.Generator().manual_seed(in_features + inter + tokens)
    x = torch.randn(tokens, in_features, generator=g).bfloat16()
    w = (torch.randn(2 * inter, in_features, generator=g) * in_features ** -0.5).bfloat16()
    y = torch.full((tokens, inter), 7.0, dtype=torch.bfloat16)
    _ok(fused(x.data_ptr(), w.data_ptr(), y.data_ptr(), tokens, in_features, inter))
    plain = parts.reference("06", "linear").linear_native(x, w)
    expected = parts.reference("08", "activation").silu_mul_native(plain)
    _close(y, expected, "gemv_kernel with silu_mul", atol=1.6e-2, rtol=1.6e-2, tokens=tokens,
           weight=f"{2 * inter} x {in_features}")


# (in, out, pair, float32 out): one-token GEMV by bulk copies (gemv_kernel_tma, sm_90): rows
# of 2048 columns (eight per 32 KB stage; 45 rows: blocks of 5 and 6 rows on the emulated 8
# blocks, one stage, partly full), of 8192 (two rows a stage, four warps on each), of 4096
# paired (gate and up halves of every stage, 2 rows each), float32 logits; fewer rows than
# blocks (out = 5).
@pytest.mark.parametrize("in_features,out_features,pair,f32", [
    (2048, 45, False, False), (8192, 37, False, False), (4096, 30, True, False),
    (2048, 100, True, False), (2048, 200, False, True), (4096, 5, False, False)])
def test_gemv_tma_kernel_in_the_emulator(in_features, out_features, pair, f32):
    tma = _shim_function("06", "gemv.cu", GEMV_SHIM, "emu_gemv_tma",
                         [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4)
    g = torch.Generator().manual_seed(in_features + out_features)
    x = torch.randn(1, in_features, generator=g).bfloat16()
    rows = 2 * out_features if pair else out_features
    w = (torch.randn(rows, in_features, generator=g) * in_features ** -0.5).bfloat16()
    y = torch.full((1, out_features), 7.0, dtype=torch.float32 if f32 else torch.bfloat16)
    _ok(tma(x.data_ptr(), w.data_ptr(), y.data_ptr(), int(f32), in_features, out_features,
            out_features if pair else 0))
    plain = parts.reference("06", "linear").linear_native(x, w)
    if pair:
        expected = parts.reference("08", "activation").silu_mul_native(plain).float()
    else:
        expected = x.float() @ w.float().t()
    tol = 1e-4 if f32 else 1.6e-2
    _close(y, expected, "gemv_kernel_tma", atol=tol, rtol=tol, weight=f"{rows} x {in_features}",
           pair=pair, float32_out=f32)


# (in, out, what is planted): the lm_head's greedy pick in the GEMV's epilogue, over the
# emulated 8 blocks: the largest logit in the last block, a tie for it in two blocks (the lower
# index must win), a NaN (it beats every number), every logit -inf (index 0), and two rows in
# different blocks whose logits are exactly 0.0, the largest (the lower index).
@pytest.mark.parametrize("in_features,out_features,plant", [
    (2048, 200, "last"), (2048, 45, "tie"), (4096, 37, "nan"), (2048, 50, "-inf"),
    (2048, 30, "zeros")])
def test_gemv_tma_kernel_with_greedy_pick_in_the_emulator(in_features, out_features, plant):
    """The index of the largest logit, in pick[0] and in the host row at the slot: that of
    torch.argmax over the logits the kernel wrote (which must equal the product). Run three
    times: the last block must leave the ticket and the key at 0; the third run names a slot
    outside the host buffer, and nothing may be stored there."""
    lib = _shim_function("06", "gemv.cu", GEMV_SHIM, "emu_gemv_tma_pick",
                         [ctypes.c_void_p] * 3 + [ctypes.c_int] * 2 + [ctypes.c_void_p] * 4
                         + [ctypes.c_int64] * 2)
    g = torch.Generator().manual_seed(in_features + out_features)
    x = torch.randn(1, in_features, generator=g).bfloat16()
    w = (torch.randn(out_features, in_features, generator=g) * in_features ** -0.5).bfloat16()
    if plant == "last":
        w[out_features - 3] = x * 0.5
    elif plant == "tie":   # rows 4 and 40 lie in different blocks (about 5-6 rows a block)
        w[4] = w[40] = x * 0.5
    elif plant == "nan":
        w[30, 7] = w[33, 9] = float("nan")
    elif plant == "-inf":
        w[:] = 0
        w[:, 0] = float("-inf")
        x[0, 0] = 1.0
    elif plant == "zeros":
        w = -w.abs()           # every logit at most 0 ...
        x = x.abs()
        w[3] = w[20] = 0       # ... and rows 3 and 20 exactly 0.0: the largest
    counters = torch.zeros(4, dtype=torch.int32)
    host = torch.full((3, 2), -1, dtype=torch.int64)
    for run, slot in enumerate((1, 2, 7)):
        y = torch.full((1, out_features), 7.0)
        pick = torch.full((1,), -1, dtype=torch.int64)
        slot_t = torch.tensor([slot], dtype=torch.int64)
        before = host.clone()
        _ok(lib(x.data_ptr(), w.data_ptr(), y.data_ptr(), in_features, out_features,
                pick.data_ptr(), counters.data_ptr(), host.data_ptr(), slot_t.data_ptr(),
                host.shape[1], host.shape[0]))
        expected_y = x.float() @ w.float().t()
        _close(y, expected_y, f"gemv_kernel_tma's logits (run {run})", atol=1e-4, rtol=1e-4,
               weight=f"{out_features} x {in_features}", planted=plant)
        expected = int(torch.argmax(y[0]))
        assert int(pick[0]) == expected, (
            f"run {run + 1} ({plant}): the pick is {int(pick[0])}, torch.argmax of the "
            f"kernel's own logits is {expected} (ties: the lower index; a NaN beats every number)")
        assert counters.tolist() == [0, 0, 0, 0], (
            f"run {run + 1}: the ticket and the key must be back to 0, got {counters.tolist()}")
        after = before.clone()
        if slot < host.shape[0]:
            after[slot, 0] = expected
        assert torch.equal(host, after), (
            f"run {run + 1}: the host buffer should be {after.tolist()} (slot {slot}: its first "
            f"entry only, nothing outside the buffer), got {host.tolist()}")


# (in, out, pair, add, f32): the one-token GEMV with a decoder layer's RMSNorm as its
# prologue -- after the residual add (the new stream stored, each block its share: 45 rows on
# the emulated 8 blocks), paired (gate_up with SiLU-mul), without the add (layer 0), 8192
# columns (four pieces of x per thread), float32 out (the model's final norm and lm_head).
@pytest.mark.parametrize("in_features,out_features,pair,add,f32", [
    (2048, 45, False, True, False), (2048, 40, True, True, False),
    (8192, 20, False, False, False), (4096, 30, True, False, False),
    (2048, 45, False, True, True)])
def test_gemv_tma_kernel_with_rmsnorm_in_the_emulator(in_features, out_features, pair, add,
                                                      f32):
    """Against stage 04's twin (fused_add_rmsnorm_native, or rmsnorm_native without the add)
    followed by linear_native (and silu_mul_native when paired; float32 out: linear_native's
    float32 product, no bf16 rounding)."""
    fused = _shim_function("06", "gemv.cu", GEMV_SHIM, "emu_gemv_tma_norm",
                           [ctypes.c_void_p] * 4 + [ctypes.c_float] + [ctypes.c_void_p] * 2
                           + [ctypes.c_int] * 4)
    g = torch.Generator().manual_seed(in_features + out_features + 1)
    x = torch.randn(1, in_features, generator=g).bfloat16()
    residual = torch.randn(1, in_features, generator=g).bfloat16()
    norm = (1 + 0.1 * torch.randn(in_features, generator=g)).bfloat16()
    rows = 2 * out_features if pair else out_features
    w = (torch.randn(rows, in_features, generator=g) * in_features ** -0.5).bfloat16()
    y = torch.full((1, out_features), 7.0, dtype=torch.float32 if f32 else torch.bfloat16)
    stream = torch.full((1, in_features), 7.0, dtype=torch.bfloat16)
    eps = 1e-5
    _ok(fused(x.data_ptr(), residual.data_ptr() if add else None,
              stream.data_ptr() if add else None, norm.data_ptr(), eps, w.data_ptr(),
              y.data_ptr(), int(f32), in_features, out_features, out_features if pair else 0))
    rms = parts.reference("04", "rmsnorm")
    if add:
        normed, new_stream = rms.fused_add_rmsnorm_native(x, residual, norm, eps)
        assert torch.equal(stream, new_stream), "the stream x + add must be stored, every element"
    else:
        normed = rms.rmsnorm_native(x, norm, eps)
    plain = parts.reference("06", "linear").linear_native(
        normed, w, out_dtype=torch.float32 if f32 else None)
    expected = parts.reference("08", "activation").silu_mul_native(plain) if pair else plain
    if f32:  # float32 sums in another order, of the same bf16 inputs
        _close(y, expected, "gemv_kernel_tma with the RMSNorm prologue", atol=1e-4, rtol=1e-4,
               weight=f"{out_features} x {in_features}", pair=pair, add=add)
    else:
        _close(y, expected, "gemv_kernel_tma with the RMSNorm prologue", atol=1.6e-2,
               rtol=1.6e-2, weight=f"{out_features} x {in_features}", pair=pair, add=add)


DECODE_SHIM = CALL + """
extern "C" const char* emu_decode(const void* q, const void* k, const void* v, void* out,
                                  const int32_t* slots, const int32_t* lens, int batch,
                                  int64_t q_stride, int n_heads, int n_kv, int d, int num_slots,
                                  int max_len, float scale) {
  EMU_CALL(launch_decode_attention(q, k, v, out, slots, lens, batch, q_stride, n_heads, n_kv,
                                   d, num_slots, max_len, scale, nullptr));
}
"""


@pytest.fixture(scope="module")
def emu_decode():
    return _shim_function("09", "decode_attention.cu", DECODE_SHIM, "emu_decode",
                          [ctypes.c_void_p] * 6 + [ctypes.c_int, ctypes.c_int64]
                          + [ctypes.c_int] * 5 + [ctypes.c_float])


@pytest.mark.parametrize("batch,n_heads,n_kv,d,lens", [
    (2, 32, 8, 64, [1, 70]), (7, 32, 8, 64, [1, 15, 16, 17, 64, 100, 1000]),
    (5, 8, 2, 64, [2, 3, 4, 5, 31]), (3, 9, 3, 64, [16, 17, 0]), (1, 16, 2, 128, [130]),
    (2, 12, 1, 32, [40, 5]), (1, 6, 6, 96, [33]), (2, 16, 8, 64, [23, 64]),
    (2, 8, 2, 16, [50, 3])],
    ids=["llama", "llama-every-tail", "group4-short", "smollm2-padding", "d128-group8",
         "group12-d32", "multi-head-d96", "group2", "d16-two-lanes"])
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
    _ok(error)
    native = parts.reference("09", "decode_attention").decode_attention_native
    expected = native(q, k, v, slots, lens_t, d ** -0.5)
    _close(out, expected, "decode_attention", atol=1.6e-2, rtol=1.6e-2, batch=batch,
           lengths=lens, heads=f"{n_heads}/{n_kv}", head_dim=d)


RMSNORM_SHIM = CALL + """
extern "C" const char* emu_rmsnorm(void* out, const void* x, const void* w, int64_t rows,
                                   int64_t hidden, float eps) {
  EMU_CALL(launch_rmsnorm(out, x, w, rows, hidden, eps, true, nullptr));
}
extern "C" const char* emu_fused(void* x, void* residual, const void* w, int64_t rows,
                                 int64_t hidden, float eps) {
  EMU_CALL(launch_fused_add_rmsnorm(x, residual, w, rows, hidden, eps, true, nullptr));
}
"""


@pytest.mark.parametrize("rows,hidden", [(3, 2048), (2, 576), (1, 100)])
def test_rmsnorm_kernels_in_the_emulator(rows, hidden):
    args = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float]
    rmsnorm = _shim_function("04", "rmsnorm.cu", RMSNORM_SHIM, "emu_rmsnorm", args)
    fused = _shim_function("04", "rmsnorm.cu", RMSNORM_SHIM, "emu_fused", args)
    g = torch.Generator().manual_seed(rows * hidden)
    x, r = (torch.randn(rows, hidden, generator=g).bfloat16() for _ in range(2))
    w = torch.randn(hidden, generator=g).bfloat16()
    twin = parts.reference("04", "rmsnorm")
    out = torch.empty_like(x)
    _ok(rmsnorm(out.data_ptr(), x.data_ptr(), w.data_ptr(), rows, hidden, 1e-5))
    _close(out, twin.rmsnorm_native(x, w, 1e-5), "rmsnorm", atol=1.6e-2, rtol=1.6e-2,
           rows=rows, hidden=hidden)
    expected, expected_residual = twin.fused_add_rmsnorm_native(x, r, w, 1e-5)
    _ok(fused(x.data_ptr(), r.data_ptr(), w.data_ptr(), rows, hidden, 1e-5))
    _close(r, expected_residual, "fused_add_rmsnorm's residual", atol=1e-5, rtol=1.6e-2,
           rows=rows, hidden=hidden)
    _close(x, expected, "fused_add_rmsnorm", atol=1.6e-2, rtol=1.6e-2, rows=rows, hidden=hidden)


ROPE_SHIM = CALL + """
extern "C" const char* emu_rope(void* q, void* k, const int64_t* positions, const float* cos_sin,
                                int* error, int64_t tokens, int64_t q_stride, int64_t k_stride,
                                int q_heads, int k_heads, int head_dim, int64_t max_positions) {
  EMU_CALL(launch_rope(q, k, positions, cos_sin, error, tokens, q_stride, k_stride, q_heads,
                       k_heads, head_dim, max_positions, true, nullptr));
}
"""


@pytest.mark.parametrize("tokens,q_heads,k_heads,d", [(3, 32, 8, 64), (2, 9, 3, 64), (1, 4, 2, 36)])
def test_rope_kernel_in_the_emulator(tokens, q_heads, k_heads, d):
    rope = _shim_function("05", "rope.cu", ROPE_SHIM, "emu_rope",
                          [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 3
                          + [ctypes.c_int64])
    g = torch.Generator().manual_seed(tokens * d + q_heads)
    # q and k as views of one fused row, as the model passes them
    qkv = torch.randn(tokens, (q_heads + 2 * k_heads) * d, generator=g).bfloat16()
    q = qkv[:, : q_heads * d].view(tokens, q_heads, d)
    k = qkv[:, q_heads * d: (q_heads + k_heads) * d].view(tokens, k_heads, d)
    cos_sin = parts.reference("05", "rope_tables").cos_sin_cache(d, 10000.0, None, 64)
    positions = torch.randint(0, 64, (tokens,), generator=g)
    expected_q, expected_k = q.clone(), k.clone()
    parts.reference("05", "rope").apply_rope_native(expected_q, expected_k, positions, cos_sin)
    error = torch.zeros(1, dtype=torch.int32)
    _ok(rope(q.data_ptr(), k.data_ptr(), positions.data_ptr(), cos_sin.data_ptr(),
             error.data_ptr(), tokens, qkv.shape[1], qkv.shape[1], q_heads, k_heads, d, 64))
    assert error.item() == 0, "positions inside the table raised the error flag"
    for got, want, what in ((q, expected_q, "rope's q"), (k, expected_k, "rope's k")):
        _close(got, want, what, atol=1.6e-2, rtol=1.6e-2, tokens=tokens,
               heads=f"{q_heads}/{k_heads}", head_dim=d)


SILU_SHIM = CALL + """
extern "C" const char* emu_silu_mul(const void* x, void* out, int64_t rows, int64_t inter) {
  EMU_CALL(launch_silu_mul(static_cast<const __nv_bfloat16*>(x),
                           static_cast<__nv_bfloat16*>(out), rows, inter, nullptr));
}
"""


@pytest.mark.parametrize("rows,inter", [(2, 8192), (3, 100)])
def test_silu_mul_kernel_in_the_emulator(rows, inter):
    silu_mul = _shim_function("08", "activation.cu", SILU_SHIM, "emu_silu_mul",
                              [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2)
    x = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(inter)).bfloat16()
    out = torch.empty(rows, inter).bfloat16()
    _ok(silu_mul(x.data_ptr(), out.data_ptr(), rows, inter))
    expected = parts.reference("08", "activation").silu_mul_native(x)
    _close(out, expected, "silu_mul", atol=1.6e-2, rtol=1.6e-2, rows=rows, inter=inter)


ARGMAX_SHIM = CALL + """
extern "C" const char* emu_argmax(const void* logits, int64_t* out, int64_t rows, int64_t vocab,
                                  int f32, void* partial, int32_t* tickets, int64_t* host,
                                  const int64_t* slot, int64_t stride, int64_t slots) {
  const HostRows rows_of_host{host, slot, stride, slots};
  if (f32) EMU_CALL(launch_argmax_f32(static_cast<const float*>(logits), out, rows, vocab,
                                      partial, tickets, rows_of_host, nullptr));
  EMU_CALL(launch_argmax_bf16(static_cast<const __nv_bfloat16*>(logits), out, rows, vocab,
                              partial, tickets, rows_of_host, nullptr));
}
extern "C" int emu_argmax_most_pieces(int64_t rows) { return argmax_most_pieces(rows); }
"""


@pytest.mark.parametrize("rows,vocab,f32", [(1, 128256, True), (1, 128256, False),
                                            (3, 49152, True), (2, 1001, True), (9, 100, False)])
def test_argmax_kernel_in_the_emulator(rows, vocab, f32):
    """A row cut into pieces (the emulator's device has 4 SMs: up to 8 pieces a row), each
    block's pair merged by the row's last block: the row's maximum planted in the last piece,
    a tie for it in a later piece (the lower index must win), a NaN row (its first NaN wins),
    a row of -inf (index 0). Run three times: the last block must leave its ticket at 0. The
    second run also writes the answers to a host row (the slot read from device memory): that
    row only, each answer at its row's place; the third names a slot outside the buffer, and
    nothing may be stored."""
    lib = _shim_function("08", "argmax.cu", ARGMAX_SHIM, "emu_argmax",
                         [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int]
                         + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2)
    most = _shim_function("08", "argmax.cu", ARGMAX_SHIM, "emu_argmax_most_pieces",
                          [ctypes.c_int64], restype=ctypes.c_int)(rows)
    g = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[0, vocab - 7] = 50.0
    if rows > 1:
        logits[1, vocab // 3] = logits[1, vocab - 2] = 60.0
    if rows > 2:
        logits[2, vocab // 2] = logits[2, vocab // 5] = float("nan")
        logits[-1] = float("-inf")
    logits = logits if f32 else logits.bfloat16()
    partial = torch.empty(rows * most * 2, dtype=torch.int32)
    tickets = torch.zeros(rows, dtype=torch.int32)
    expected = torch.argmax(logits, dim=-1)
    host = torch.full((3, rows + 1), -1, dtype=torch.int64)
    slot = torch.tensor([1])
    # no host row; slot 1 of 3; slot 2 said to be past the buffer's 2 slots (nothing stored)
    for run in range(3):
        out = torch.full((rows,), -1, dtype=torch.int64)
        slot[0] = 1 if run < 2 else 2
        _ok(lib(logits.data_ptr(), out.data_ptr(), rows, vocab, int(f32), partial.data_ptr(),
                tickets.data_ptr(), host.data_ptr() if run else None, slot.data_ptr(),
                rows + 1, 3 if run < 2 else 2))
        assert out.tolist() == expected.tolist(), (
            f"argmax [{rows}, {vocab}]: got {out.tolist()}, torch.argmax {expected.tolist()}: "
            "each piece's pair must reach the row's last block, and equal values go to the "
            "lower index")
        assert tickets.tolist() == [0] * rows, "the row's last block must reset its ticket to 0"
    assert host[1, :rows].tolist() == expected.tolist(), (
        f"the host row (slot 1) holds {host[1, :rows].tolist()}, the answers are "
        f"{expected.tolist()}")
    assert (host[[0, 2]] == -1).all() and host[1, rows] == -1, (
        "only slot 1's first rows change; a slot outside the buffer's slots stores nothing")


def test_argmax_launcher_refuses_pieces_without_a_workspace():
    """A row that needs several pieces cannot be merged without the pairs' workspace and the
    tickets: the launcher says so instead of launching (the binding always passes both)."""
    lib = _shim_function("08", "argmax.cu", ARGMAX_SHIM, "emu_argmax",
                         [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int]
                         + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2)
    logits = torch.zeros(1, 128256)
    out = torch.full((1,), -1, dtype=torch.int64)
    message = lib(logits.data_ptr(), out.data_ptr(), 1, 128256, 1, None, None, None, None, 0, 0)
    assert message is not None and b"needs partial pairs and tickets" in message, message
    assert out.item() == -1, "nothing was launched"


CACHE_SHIM = CALL + """
extern "C" const char* emu_cache_write(const void* k, const void* v, void* k_cache,
                                       void* v_cache, const int64_t* slots, int64_t tokens,
                                       int64_t k_stride, int64_t v_stride, int64_t row_elems,
                                       int64_t num_rows) {
  EMU_CALL(launch_cache_write(k, v, k_cache, v_cache, slots, tokens, k_stride, v_stride,
                              row_elems, num_rows, nullptr));
}
"""


def test_cache_write_kernel_in_the_emulator():
    """Tokens to shuffled rows of the pool, a padding slot (-1) skipped, k and v as views of a
    fused QKV row."""
    write = _shim_function("13", "cache_write.cu", CACHE_SHIM,
                           "emu_cache_write", [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 5)
    g = torch.Generator().manual_seed(13)
    tokens, n_kv, d, blocks, block_size = 5, 2, 64, 4, 4
    qkv = torch.randn(tokens, 3 * n_kv * d, generator=g).bfloat16()
    k, v = qkv[:, n_kv * d: 2 * n_kv * d].view(tokens, n_kv, d), qkv[:, 2 * n_kv * d:].view(tokens, n_kv, d)
    slots = torch.tensor([7, 0, -1, 15, 3])
    k_cache, v_cache = (torch.randn(blocks, block_size, n_kv, d, generator=g).bfloat16()
                        for _ in range(2))
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    parts.reference("13", "cache_write").cache_write_native(k, v, expected_k, expected_v, slots)
    _ok(write(k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
              slots.data_ptr(), tokens, qkv.shape[1], qkv.shape[1], n_kv * d, blocks * block_size))
    for got, want, what in ((k_cache, expected_k, "k_cache"), (v_cache, expected_v, "v_cache")):
        checks.assert_equal(got, want, what=f"cache_write's {what} [tokens {tokens}, slots "
                                            f"{slots.tolist()}, kv heads {n_kv}, head dim {d}]")


ROPE_CACHE_SHIM = CALL + """
extern "C" const char* emu_rope_cache_write(void* q, void* k, const void* v, void* k_cache,
                                            void* v_cache, const int64_t* slots,
                                            const int64_t* positions, const float* cos_sin,
                                            int64_t tokens, int64_t stride, int q_heads,
                                            int kv_heads, int d, int64_t num_rows,
                                            int64_t max_positions) {
  EMU_CALL(launch_rope_cache_write(q, k, v, k_cache, v_cache, slots, positions, cos_sin, tokens,
                                   stride, stride, stride, q_heads, kv_heads, d, num_rows,
                                   max_positions, nullptr));
}
"""


@pytest.mark.parametrize("q_heads,kv_heads,d", [(32, 8, 64), (4, 1, 128)])
def test_rope_cache_write_kernel_in_the_emulator(q_heads, kv_heads, d):
    """q and k rotated in place and the rotated k with v stored at the slots, a padding slot
    (-1) storing nothing, against stage 05's rope twin followed by the cache-write twin."""
    fused = _shim_function("13", "cache_write.cu", ROPE_CACHE_SHIM, "emu_rope_cache_write",
                           [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 3
                           + [ctypes.c_int64] * 2)
    g = torch.Generator().manual_seed(q_heads * d)
    tokens, blocks, block_size, max_positions = 4, 4, 4, 64
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * d, generator=g).bfloat16()
    q = qkv[:, : q_heads * d].view(tokens, q_heads, d)
    k = qkv[:, q_heads * d: (q_heads + kv_heads) * d].view(tokens, kv_heads, d)
    v = qkv[:, (q_heads + kv_heads) * d:].view(tokens, kv_heads, d)
    cos_sin = parts.reference("05", "rope_tables").cos_sin_cache(d, 500000.0, None, max_positions)
    positions = torch.tensor([0, 13, 63, 5])
    slots = torch.tensor([9, -1, 0, 15])
    k_cache, v_cache = (torch.randn(blocks, block_size, kv_heads, d, generator=g).bfloat16()
                        for _ in range(2))
    want_q, want_k, want_v = q.clone(), k.clone(), v.clone()
    want_k_cache, want_v_cache = k_cache.clone(), v_cache.clone()
    parts.reference("13", "cache_write").rope_cache_write_native(
        want_q, want_k, want_v, positions, cos_sin, want_k_cache, want_v_cache, slots)
    _ok(fused(q.data_ptr(), k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
              slots.data_ptr(), positions.data_ptr(), cos_sin.data_ptr(), tokens, qkv.shape[1],
              q_heads, kv_heads, d, blocks * block_size, max_positions))
    # the rotation rounds as HF does (stage 05): bit-equal to the twin
    for got, want, what in ((q, want_q, "q"), (k, want_k, "k"), (k_cache, want_k_cache, "k_cache"),
                            (v_cache, want_v_cache, "v_cache")):
        checks.assert_equal(got, want, what=f"rope_cache_write's {what} [heads "
                                            f"{q_heads}/{kv_heads}, head dim {d}]")


PREFILL_SHIM = CALL + """
extern "C" const char* emu_prefill(const void* q, const void* k, const void* v, void* out,
                                   const int32_t* cq, const int32_t* ck, int n_seqs,
                                   int max_seqlen, int64_t qs, int64_t ks, int64_t vs,
                                   int n_heads, int n_kv, int d, float scale, int64_t smem_limit) {
  EMU_CALL(launch_prefill_attention(q, k, v, out, cq, ck, n_seqs, max_seqlen, qs, ks, vs,
                                    n_heads, n_kv, d, scale, smem_limit, nullptr));
}
"""


@pytest.mark.parametrize("lens_q,lens_k,n_heads,n_kv,d,smem_limit", [
    ([5, 40], [5, 40], 4, 2, 64, -1), ([3, 20], [30, 20], 2, 1, 128, -1),
    ([70], [70], 2, 1, 128, 64 * 1024)],
    ids=["packed", "more-keys-than-queries", "t4-tiles"])
def test_prefill_attention_kernel_in_the_emulator(lens_q, lens_k, n_heads, n_kv, d, smem_limit):
    """Stage 07's kernel (shared-memory tiles, two passes over the scores); with a T4's 64 KB
    per block, its 32-row tiles at head_dim 128."""
    prefill = _shim_function("07", "attention.cu", PREFILL_SHIM, "emu_prefill",
                             [ctypes.c_void_p] * 6 + [ctypes.c_int] * 2 + [ctypes.c_int64] * 3
                             + [ctypes.c_int] * 3 + [ctypes.c_float, ctypes.c_int64])
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, n_heads, n_kv, d, seed=d + 7)
    out = torch.zeros_like(q)
    _ok(prefill(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), cu_q.data_ptr(),
                cu_k.data_ptr(), len(lens_q), max(lens_q), n_heads * d, n_kv * d, n_kv * d,
                n_heads, n_kv, d, d ** -0.5, smem_limit))
    expected = parts.reference("07", "attention").attention_native(q, k, v, cu_q, d ** -0.5,
                                                                   cu_seqlens_k=cu_k)
    _close(out, expected, "stage 07's prefill attention", atol=1.6e-2, rtol=1.6e-2,
           query_lengths=lens_q, key_lengths=lens_k, heads=f"{n_heads}/{n_kv}", head_dim=d,
           shared_memory_limit=smem_limit)


TOY_KERNEL = """
#include <cuda_runtime.h>
#include "pdl.cuh"
// out[i] = the sum of the 32 values of i's warp, by a butterfly; `diverge` leaves lanes 16-31
// out of the shuffles, which no GPU allows.
__global__ void warp_sum(const float* x, float* out, int diverge) {
  float v = x[threadIdx.x];
  if (!diverge || threadIdx.x % 32 < 16)
    for (int d = 16; d > 0; d /= 2) v += __shfl_xor_sync(0xffffffffu, v, d);
  out[threadIdx.x] = v;
}
const char* launch_warp_sum(const float* x, float* out, int diverge) {
  launch_early(warp_sum, dim3(1), dim3(64), 0, nullptr, x, out, diverge);
  return nullptr;
}
"""


def test_the_emulator_shuffles_and_reports_a_deadlock(tmp_path):
    """The emulator itself: a butterfly of shuffles sums each warp, and a shuffle that half
    the warp skips is reported as a deadlock instead of hanging."""
    (tmp_path / "toy").mkdir()
    kernel = tmp_path / "toy" / "warp_sum.cu"
    kernel.write_text(TOY_KERNEL)
    shim = CALL + """
    extern "C" const char* emu_warp_sum(const float* x, float* out, int diverge) {
      EMU_CALL(launch_warp_sum(x, out, diverge));
    }"""
    from tests import cuda_emulator
    try:
        fn = getattr(cuda_emulator.build(kernel, shim), "emu_warp_sum")
    except ToolchainMissing as e:
        pytest.skip(f"no CUDA headers to build against: {e}")
    fn.restype, fn.argtypes = ctypes.c_char_p, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    x, out = torch.arange(64, dtype=torch.float32), torch.zeros(64)
    _ok(fn(x.data_ptr(), out.data_ptr(), 0))
    expected = torch.cat([x[:32].sum().expand(32), x[32:].sum().expand(32)])
    torch.testing.assert_close(out, expected)
    error = fn(x.data_ptr(), out.data_ptr(), 1)
    assert error is not None and b"deadlock" in error, f"a divergent shuffle gave {error!r}"


def test_a_compile_error_names_the_kernel_file_and_its_line(tmp_path):
    """`grader emulate NN` on a kernel with a typo: g++'s message must point at the student's
    file and line, not at line N+1 of a generated copy in the build cache. Stage 12's file has
    an inline-PTX helper whose body the emulator replaces (by one line) and a launch it
    rewrites: the line numbers after them must hold too."""
    from course import manifest
    text = (manifest.find("12").solution_dir() / "flash_attention.cu").read_text()
    kernel = tmp_path / "12_online_softmax" / "flash_attention.cu"
    kernel.parent.mkdir()
    kernel.write_text(text + "this is not C++;\n")
    line = text.count("\n") + 1
    from tests import cuda_emulator
    with pytest.raises(RuntimeError) as e:
        try:
            cuda_emulator.build(kernel, FLASH_SHIM)
        except ToolchainMissing as missing:
            pytest.skip(f"no CUDA headers to build against: {missing}")
    assert f"{kernel}:{line}:" in str(e.value), \
        f"the error should name {kernel}:{line}:\n{str(e.value)[-1500:]}"

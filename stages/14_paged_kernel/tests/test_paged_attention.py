"""Stage 14: the paged decode-attention kernels, one query token per sequence over a paged cache.

Two kernels, the stage's two parts: "simple" (paged_attention_simple.cu, part 1: most of the
points) and "fast" (paged_attention.cu, part 2: tensor cores and split-K). A test of both is
parametrized by `kernel`; the split-K tests are the fast kernel's alone.

Every case compares the kernel with two references computed from the same bf16 inputs:
torch.nn.functional.scaled_dot_product_attention in float32, one sequence at a time on the
keys gathered through its block table (an oracle that shares no code with this course), and
the native twin paged_decode_attention_native.

The pool is NaN everywhere except the rows the sequences own; physical blocks are shuffled
(a kernel that ignores the block table reads the wrong rows); the last block of a sequence is
usually partly filled (its rows past the context are NaN); block-table entries past a
sequence's last block point at NaN blocks. So a kernel that reads one key too many, or a
block it should not, returns NaN. A failure names the case's shape, the wrong (sequence,
head) rows, and the usual mistake whose output matches (known_mistakes, suspect_rows: block
j instead of j // block_size, KV head by modulo, values read from K, the last block's bound,
k_end, split-K partitions merged without their weights, a warp with no key turned NaN).
"""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from course import parts
from course.testing import checks, diagnose

# (n_heads, n_kv_heads, head_dim): Llama-3.2-1B (group 4), SmolLM2-135M (3), TinyLlama (8),
# plain multi-head (1), and groups 1 and 4 at head_dim 128.
HEADS = [(32, 8, 64), (9, 3, 64), (32, 4, 64), (4, 4, 128), (16, 4, 128)]
LENGTHS = [1, 15, 16, 17, 1000, 4097]
PARTITION = 1024  # keys per split-K partition in paged_attention.cu, at most
MIN_PARTITION = 64  # ... and at least
WHOLE_KEYS = 256  # ... and a sequence this short is one partition (unless the call forces one)
ROWS = 16  # query heads per block: the rows of an mma (a larger group takes several blocks)
WARPS = 4  # warps per block, in both kernels
STEP_KEYS = 16  # keys of a warp's step in the fast kernel (one a step in the simple one)
# Part 1 carries most of the stage's points: each of its test cases weighs this much, each of
# part 2's 1 (grader/pytest_plugin.py: a test's share of the points is its weight's).
SIMPLE_WEIGHT = 4
KERNELS = [pytest.param("simple", marks=pytest.mark.points(SIMPLE_WEIGHT)), "fast"]
# the split options a test tries on each kernel (the simple kernel has no split-K: one call)
SPLIT_OR_NOT = {"simple": (None,), "fast": (False, True)}
SPLITS = {"simple": ((None, None),), "fast": ((False, None), (True, None), (True, 64))}
NAN_ROWS_HINT = ("The kernel cannot raise: it checks every block number (0 <= block < "
                 "num_blocks) and the length (<= max_keys) and writes NaN instead of reading. "
                 "In split-K the NaN travels as the partition's l: a merge that returns early "
                 "when a max is -inf (if (m2 == -INFINITY) return;) drops a NaN l; fold every "
                 "state in (a state with no key weighs exp(-inf) = 0 by itself)")


def paged_op():
    return parts.load("14", "paged_attention")


def op(kernel: str) -> Callable:
    """The op of one kernel: paged_decode_attention_simple or paged_decode_attention_fast."""
    return getattr(paged_op(), f"paged_decode_attention_{kernel}")


class Paged:
    """q, a paged pool and the block tables for a batch of context lengths (see the top)."""

    def __init__(self, gen: torch.Generator, lens: list[int], n_heads: int, n_kv: int, d: int,
                 *, block_size: int = 16, spare_blocks: int = 5, extra_columns: int = 2,
                 num_blocks: int | None = None, max_blocks: int | None = None,
                 fused: bool = False, q_scale: float = 1.0):
        self.lens, self.block_size = list(lens), block_size
        batch = len(lens)
        need = [-(-n // block_size) for n in lens]
        num_blocks = num_blocks or sum(need) + spare_blocks
        max_blocks = max_blocks or max(need + [1]) + extra_columns
        assert num_blocks > sum(need) and max_blocks >= max(need + [1])
        if fused:
            qkv = checks.randn((batch, (n_heads + 2 * n_kv) * d), torch.bfloat16, "cuda", gen,
                               scale=q_scale)
            self.q = qkv[:, :n_heads * d].view(batch, n_heads, d)
            at = n_heads * d   # the new tokens' k and v: the rest of each QKV row
            self.k_new, self.v_new = (qkv[:, at + i * n_kv * d: at + (i + 1) * n_kv * d]
                                      .view(batch, n_kv, d) for i in range(2))
        else:
            self.q = checks.randn((batch, n_heads, d), torch.bfloat16, "cuda", gen, scale=q_scale)
        shape = (num_blocks, block_size, n_kv, d)
        self.k = checks.poison(torch.empty(shape, dtype=torch.bfloat16, device="cuda"))
        self.v = checks.poison(torch.empty(shape, dtype=torch.bfloat16, device="cuda"))
        perm = torch.randperm(num_blocks, generator=gen, device="cuda").tolist()
        owned, spare = perm[:sum(need)], perm[sum(need):]
        self.tables: list[list[int]] = []
        for b, n in enumerate(lens):
            blocks, owned = owned[:need[b]], owned[need[b]:]
            # columns past the last block name NaN blocks: reading them shows
            self.tables.append(blocks + [spare[(b + i) % len(spare)]
                                         for i in range(max_blocks - need[b])])
            for i, blk in enumerate(blocks):
                rows = min(block_size, n - i * block_size)
                self.k[blk, :rows] = checks.randn((rows, n_kv, d), torch.bfloat16, "cuda", gen)
                self.v[blk, :rows] = checks.randn((rows, n_kv, d), torch.bfloat16, "cuda", gen)
        self.block_tables = torch.tensor(self.tables, dtype=torch.int32, device="cuda")
        self.context_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")

    def args(self):
        return self.q, self.k, self.v, self.block_tables, self.context_lens

    def rows(self, b: int, index=lambda j, bs: j // bs) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(blocks, rows) of sequence b's keys, with `index` mapping key j to its table column
        (right: j // block_size); None when that mapping leaves the table."""
        n, bs = self.lens[b], self.block_size
        cols = [index(j, bs) for j in range(n)]
        if any(c >= len(self.tables[b]) for c in cols):
            return None
        blocks = torch.tensor([self.tables[b][c] for c in cols], device="cuda", dtype=torch.long)
        return blocks, torch.arange(n, device="cuda") % bs


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           tables: list[list[int]], lens: list[int], scale: float, *,
           keys: Callable[[int], int] = lambda n: n,
           column: Callable[[int, int], int] = lambda j, bs: j // bs,
           kv_of_head: list[int] | None = None, values: str = "v", merge: str = "exact",
           partition: int = PARTITION) -> torch.Tensor | None:
    """Attention per sequence over the keys gathered through its block table, in float32 ->
    [B, n_heads, d]; rows of length 0 are zeros. With the defaults the right answer
    (torch.nn.functional.scaled_dot_product_attention: no code of this course); a changed
    argument gives the output of a known mistake: keys(n), how many keys a row of length n
    reads; column(j, block_size), key j's table column; kv_of_head, each query head's KV head;
    values="k", P V read from k_cache; merge="plain" / "no_rescale", split-K partitions of
    `partition` keys merged without the weights l_i exp(m_i - M). None when that mistake
    would read outside the block table or the pool."""
    n_heads, n_kv = q.shape[1], k_cache.shape[2]
    num_blocks, bs = k_cache.shape[:2]
    group = n_heads // n_kv
    heads = torch.tensor(kv_of_head or [h // group for h in range(n_heads)], device=q.device)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, n in enumerate(lens):
        n = keys(n)
        if n <= 0:
            continue
        cols = [column(j, bs) for j in range(n)]
        if max(cols) >= len(tables[b]) or any(not 0 <= tables[b][c] < num_blocks for c in cols):
            return None
        blocks = torch.tensor([tables[b][c] for c in cols], device=q.device)
        rows = torch.arange(n, device=q.device) % bs
        ks = k_cache[blocks, rows].index_select(1, heads).float().transpose(0, 1)  # [H, n, d]
        vs = (k_cache if values == "k" else v_cache)[blocks, rows]
        vs = vs.index_select(1, heads).float().transpose(0, 1)
        qs = q[b].float()[:, None, :]                                              # [H, 1, d]
        if merge == "exact":
            out[b] = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)[:, 0, :]
            continue
        partial, sums = [], []
        for start in range(0, n, partition):
            s = (qs @ ks[:, start:start + partition].transpose(1, 2))[:, 0] * scale  # [H, p]
            e = torch.exp(s - s.max(dim=1, keepdim=True).values)
            partial.append((e[:, None, :] @ vs[:, start:start + partition])[:, 0]
                           / e.sum(1, keepdim=True))
            sums.append(e.sum(1, keepdim=True))
        o, l = torch.stack(partial), torch.stack(sums)           # [P, H, d], [P, H, 1]
        out[b] = o.mean(0) if merge == "plain" else (o * l).sum(0) / l.sum(0)
    return out


def sdpa_oracle(pg: Paged, scale: float) -> torch.Tensor:
    """The right answer for pg (attend with its defaults) -> [B, n_heads, d] float32."""
    return attend(pg.q, pg.k, pg.v, pg.tables, pg.lens, scale)


def known_mistakes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   tables: list[list[int]], lens: list[int], scale: float, kernel: str,
                   partition: int, whole_keys: int = WHOLE_KEYS,
                   poison: float = float("nan")) -> list[diagnose.Variant]:
    """The outputs of the usual mistakes, each with the message that names it (partition:
    the call's keys per split-K partition, 0 for the single pass; whole_keys: the fast
    kernel's whole-sequence bound, 0 when the call forces its partition size; poison: what
    the output held before the launch)."""
    n_heads, n_kv = q.shape[1], k_cache.shape[2]
    bs = k_cache.shape[1]

    def mistake(cause: str, scale: float = scale, **change) -> diagnose.Variant:
        return diagnose.Variant(attend(q, k_cache, v_cache, tables, lens, scale, **change),
                                cause)
    found = [
        mistake("key j lives in table column j // block_size (row j % block_size of that "
                "block), not in column j: this output matches block_tables[b, j]",
                column=lambda j, bs: j),
        mistake("the KV head must be h // (n_heads // n_kv_heads): neighbouring query heads "
                "share a KV head (this output matches h % n_kv_heads)",
                kv_of_head=[h % n_kv for h in range(n_heads)]),
        mistake("scores right but values wrong: P V must read v_cache at the rows whose keys "
                "were scored (this output matches V read from k_cache)", values="k"),
        mistake("the scores must be multiplied by scale (this output matches scale = 1)",
                scale=1.0),
        mistake("only the last, partly filled block is wrong: its keys below context_lens[b] "
                "were left out (the bound on the last block is the length, not whole blocks)",
                keys=lambda n: n - n % bs if n > bs else n),
        mistake("only the last, partly filled block is wrong: it was read whole; keys at or "
                "past context_lens[b] (k_end) must be left out (their scores -inf)",
                keys=lambda n: -(-n // bs) * bs),
    ]
    if kernel == "fast" and not partition:
        # k_end = min(len, k_begin + keys) in the single pass too: `keys` is then the whole
        # bound (a short sequence) or 0, and a longer row is never written
        unwritten = attend(q, k_cache, v_cache, tables, lens, scale)
        unwritten[torch.tensor([n > whole_keys for n in lens])] = poison
        found.append(diagnose.Variant(
            unwritten, "k_end: " + (f"the rows of sequences longer than {whole_keys} keys"
                                    if whole_keys else "these rows") + " were never "
            "written. In the single pass (partitions == 1) a block takes the whole context, "
            "k_end = len; `keys` is split-K's partition size, so k_end = min(len, k_begin + "
            "keys) written for every call empties these rows"))
    if partition:
        found += [
            mistake(f"k_end is not clipped to the length: the last split-K partition read keys "
                    f"past context_lens[b]; partition i holds keys [i * {partition}, "
                    f"min(len, (i + 1) * {partition}))",
                    keys=lambda n: -(-n // partition) * partition),
            mistake("split-K's merge must rescale each partition to the common maximum: w_i = "
                    "l_i * exp(m_i - max_i m_i) (this output matches weights l_i without the "
                    "exp)", merge="no_rescale", partition=partition),
            mistake("split-K's merge must weight each partition's o_i / l_i by w_i = l_i * "
                    "exp(m_i - M), M the largest m_i (this output matches a plain average of "
                    "the partitions)", merge="plain", partition=partition),
        ]
    return found


def suspect_rows(lens: list[int], n_heads: int, kernel: str,
                 partition: int) -> list[diagnose.Suspect]:
    """Sets of rows ([B, n_heads]) that one known mistake spoils and the others do not."""
    def rows(pick: Callable[[int], bool]) -> torch.Tensor:
        return torch.tensor([[pick(n)] * n_heads for n in lens], dtype=torch.bool)
    first_keys = WARPS * (1 if kernel == "simple" else STEP_KEYS)
    found = [diagnose.Suspect(
        rows(lambda n: 0 < n < first_keys), f"sequences of fewer than {first_keys} keys",
        f"some of the {WARPS} warps saw no key (m = -inf, l = 0, o = 0); merging such a state "
        "must weigh it 0, and two of them must not give exp(-inf - -inf) = NaN: take a finite "
        "reference max when both maxima are -inf")]
    if kernel == "fast" and partition:
        found.append(diagnose.Suspect(
            rows(lambda n: n > partition), f"sequences longer than one partition ({partition} "
            "keys)", "split-K: partition i holds keys [i * keys, min(len, (i + 1) * keys)); the "
            "merge folds in the ceil(len / keys) partitions that hold keys, each weighted by "
            "l_i * exp(m_i - M)"))
    elif kernel == "fast":
        found.append(diagnose.Suspect(
            rows(lambda n: n > WHOLE_KEYS), f"sequences longer than {WHOLE_KEYS} keys in the "
            "single pass", "k_end: in the single pass (partitions == 1) a block takes the "
            "whole context, k_end = len. `keys` is split-K's partition size (a sequence of at "
            f"most {WHOLE_KEYS} keys is one partition), so k_end = min(len, k_begin + keys) "
            "written for every call cuts these rows short, or leaves them unwritten"))
    return found


def check_paged(got: torch.Tensor, expected: torch.Tensor, q: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, tables: list[list[int]],
                lens: list[int], scale: float, *, kernel: str, partition: int, what: str,
                whole_keys: int = WHOLE_KEYS, poison: float = float("nan"),
                atol: float | None = None, rtol: float | None = None) -> None:
    """diagnose.assert_close of got [B, n_heads, d] against expected (bf16's tolerance unless
    given), with the case's shape and, when they differ, the known mistake (known_mistakes,
    suspect_rows) it looks like. Runs on any device (the emulator's checks use it too)."""
    dtype = torch.bfloat16
    wrong = diagnose.wrong_rows(got, expected, 1, dtype=dtype, atol=atol, rtol=rtol).any()
    batch, n_heads, d = q.shape
    diagnose.assert_close(
        got, expected, what=what, dtype=dtype, atol=atol, rtol=rtol,
        row_names=("sequence", "head"),
        shape=diagnose.shape(kernel=kernel, batch=batch, lengths=lens if batch <= 16 else
                             f"{min(lens)}..{max(lens)}", heads=f"{n_heads}/{k_cache.shape[2]}",
                             head_dim=d, block_size=k_cache.shape[1],
                             partition=f"{partition} keys" if partition else "none (single pass)"),
        variants=known_mistakes(q, k_cache, v_cache, tables, lens, scale, kernel, partition,
                                whole_keys, poison) if wrong else (),
        suspects=suspect_rows(lens, n_heads, kernel, partition) if wrong else (),
        hint="compare with paged_decode_attention_native in paged_attention.py: per sequence, "
             "gather its keys through the block table, then per head softmax(scale * q K^T) V; "
             "in the online softmax, when the running max grows from m to m', l and o must "
             "both be multiplied by exp(m - m') before the new keys are added")


def run_and_check(pg: Paged, scale: float, what: str, kernel: str = "fast",
                  **options) -> torch.Tensor:
    """Launch `kernel` ("simple" or "fast") into a poisoned buffer; compare with SDPA and the
    twin (naming the likely mistake); inputs untouched."""
    inputs = dict(zip(("q", "k_cache", "v_cache", "block_tables", "context_lens"), pg.args()))
    before = {name: t.clone() for name, t in inputs.items()}
    out = checks.poison(torch.empty(pg.q.shape, dtype=pg.q.dtype, device="cuda"))
    got = op(kernel)(*pg.args(), scale, out=out, **options)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr(), "paged_decode_attention(..., out=buf) must return buf"
    partition = 0 if kernel == "simple" else partition_of(
        pg, options.get("max_context"), options.get("split"), options.get("partition"))
    case = dict(kernel=kernel, partition=partition)
    check_paged(got, sdpa_oracle(pg, scale), pg.q, pg.k, pg.v, pg.tables, pg.lens, scale,
                what=f"{what} vs scaled_dot_product_attention", **case)
    twin = parts.reference("14", "paged_attention").paged_decode_attention_native(
        *pg.args(), scale)
    check_paged(got, twin, pg.q, pg.k, pg.v, pg.tables, pg.lens, scale,
                what=f"{what} vs paged_decode_attention_native", **case)
    for name, t in inputs.items():  # inputs are read-only
        checks.assert_unmodified(before[name], t, name)
    return got


def max_keys_of(pg: Paged, max_context: int | None = None) -> int:
    """The longest context a call allows: the block table's capacity, or max_context."""
    keys = pg.block_tables.shape[1] * pg.block_size
    return keys if max_context is None else min(keys, max_context)


def partition_of(pg: Paged, max_context: int | None = None, split: bool | None = None,
                 partition: int | None = None) -> int:
    """Keys per split-K partition of a call with these options (0: the single pass)."""
    keys = max_keys_of(pg, max_context)
    size = partition or paged_op().partition_keys(pg.q.shape[0], pg.q.shape[1], pg.k.shape[2],
                                                  keys, split)
    return size if keys > size else 0


def poison_workspace(pg: Paged, max_context: int | None = None, split: bool | None = None,
                     partition: int | None = None, kernel: str = "fast") -> None:
    """Leave NaN in the memory the caching allocator will most likely hand to split-K's
    workspace (torch.empty of the same size, allocated by the op): a reduction that reads a
    partition nobody wrote then reads NaN. The simple kernel has none: nothing to do (and its
    tests must not ask the fast kernel's rule, which may still be a TODO)."""
    if kernel == "simple":
        return
    batch, n_heads, d = pg.q.shape
    keys = max_keys_of(pg, max_context)
    size = partition_of(pg, max_context, split, partition)
    partitions = -(-keys // size) if size else 1
    junk = torch.full((batch * n_heads * partitions * (d + 2),), float("nan"), device="cuda")
    del junk


def expected_partition_keys(batch: int, n_heads: int, n_kv: int, max_keys: int, sms: int,
                            split: bool | None = None) -> int:
    """The lesson's rule: keys per split-K partition, 0 for the single pass. The single pass
    has batch x n_kv x ceil(group / 16) blocks; below one per SM, split into partitions of
    1024 keys, halved (down to 64) while the grid is still short of one block per SM."""
    group = n_heads // n_kv
    blocks = batch * n_kv * -(-group // ROWS)
    target = sms
    if split is False or max_keys <= MIN_PARTITION or (split is None and blocks >= target):
        return 0
    keys = PARTITION
    while keys > MIN_PARTITION and blocks * -(-max_keys // keys) < target:
        keys //= 2
    parts = -(-max_keys // keys)
    return 0 if parts <= 1 or (split is None and parts > 8192) else keys


@pytest.mark.gpu
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("n_heads,n_kv,d", HEADS, ids=lambda v: str(v))
@pytest.mark.parametrize("kernel", KERNELS)
def test_one_sequence(seed, kernel, n, n_heads, n_kv, d):
    """One sequence, shuffled blocks: 1 key, a block minus one, one block, one key into the
    next, and long contexts whose last block is partly filled."""
    pg = Paged(checks.generator("cuda", seed), [n], n_heads, n_kv, d)
    poison_workspace(pg, kernel=kernel)
    run_and_check(pg, d ** -0.5, f"context {n}, heads {n_heads}/{n_kv}, head_dim {d}", kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("n_heads,n_kv,d", [(32, 8, 64), (9, 3, 64), (8, 1, 128)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("kernel", KERNELS)
def test_batch_of_mixed_lengths(seed, kernel, block_size, n_heads, n_kv, d):
    """64 sequences of different lengths in one pool (a real decode batch)."""
    gen = checks.generator("cuda", seed)
    lens = [1, 15, 16, 17, 1000, 2049] + torch.randint(1, 1500, (58,), generator=gen,
                                                       device="cuda").tolist()
    pg = Paged(gen, lens, n_heads, n_kv, d, block_size=block_size)
    run_and_check(pg, d ** -0.5, f"batch of 64, block_size {block_size}, heads {n_heads}/{n_kv}",
                  kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_batch_of_256(seed, kernel):
    """256 sequences (many blocks: the single pass), Llama-3.2-1B heads."""
    gen = checks.generator("cuda", seed)
    lens = torch.randint(1, 700, (256,), generator=gen, device="cuda").tolist()
    pg = Paged(gen, lens, 32, 8, 64)
    run_and_check(pg, 0.125, "batch of 256", kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("n_heads,n_kv,d", [(32, 8, 64), (12, 4, 128), (16, 2, 64)],
                         ids=lambda v: str(v))
def test_split_on_and_off_agree(seed, n_heads, n_kv, d):
    """Split-K (partitions of the kernel's size: 1024, 512 or 256 keys here, merged by the
    last block to finish; sequences of at most 256 keys whole) and the single pass give the
    same result; lengths around 512- and 1024-key edges."""
    gen = checks.generator("cuda", seed)
    pg = Paged(gen, [1, 511, 512, 513, 1025, 1536, 3000, 4097], n_heads, n_kv, d)
    poison_workspace(pg)
    split = run_and_check(pg, d ** -0.5, "split-K", split=True)
    single = run_and_check(pg, d ** -0.5, "single pass", split=False)
    auto = run_and_check(pg, d ** -0.5, "split chosen by the kernel")
    checks.assert_close(split, single, what="split-K vs single pass", dtype=torch.bfloat16)
    checks.assert_close(auto, single, what="auto vs single pass", dtype=torch.bfloat16)


@pytest.mark.gpu
def test_split_with_empty_partitions(seed):
    """max_context (the engine's max_model_len) fixes the partition count: most partitions
    of short sequences hold no key; they must be skipped, and the reduction must not read
    them (their workspace holds NaN here)."""
    gen = checks.generator("cuda", seed)
    pg = Paged(gen, [1, 600, 0, 2000], 32, 8, 64, extra_columns=600)
    assert pg.block_tables.shape[1] * 16 >= 8192
    poison_workspace(pg, 8192)
    run_and_check(pg, 0.125, "split-K with max_context 8192", split=True, max_context=8192)
    poison_workspace(pg)
    run_and_check(pg, 0.125, "split-K, max_context from the block table", split=True)


@pytest.mark.gpu
@pytest.mark.parametrize("partition", [64, 128, 256])
@pytest.mark.parametrize("n_heads,n_kv,d", [(32, 8, 64), (12, 4, 128), (16, 2, 64)],
                         ids=lambda v: str(v))
def test_small_partitions(seed, partition, n_heads, n_kv, d):
    """Split-K in partitions of 64, 128 and 256 keys (what the rule picks for small batches):
    contexts that end exactly at a partition's end, one key before and after it, contexts
    shorter than one partition, padding rows, and partitions past every context
    (max_context 2048); the same result as the single pass."""
    gen = checks.generator("cuda", seed)
    lens = [0, 1, 63, 64, 65, 127, 128, 129, 255, 256, 257, 300, 0, 1000]
    pg = Paged(gen, lens, n_heads, n_kv, d, extra_columns=70)
    assert pg.block_tables.shape[1] * 16 >= 2048
    poison_workspace(pg, 2048, partition=partition)
    what = f"split-K in partitions of {partition} keys"
    split = run_and_check(pg, d ** -0.5, what, partition=partition, max_context=2048)
    single = run_and_check(pg, d ** -0.5, "single pass", split=False, max_context=2048)
    checks.assert_close(split, single, what=f"{what} vs the single pass", dtype=torch.bfloat16,
                        hint=f"with partitions of {partition} keys, partition i holds keys "
                             f"[i * {partition}, min(len, (i + 1) * {partition})), and the "
                             "merge takes ceil(len / partition_keys) of them: use `keys` "
                             "(here the call's p.partition_keys), not the constant kPartition")
    padding = [0, 12]
    checks.assert_equal(split[padding], torch.zeros_like(split[padding]),
                        what=f"padding rows ({what})")


@pytest.mark.gpu
@pytest.mark.parametrize("batch,max_context", [(1, 288), (1, 512), (1, 2048), (1, 32768),
                                               (2, 4096), (16, 1024), (32, 2048), (64, 1024),
                                               (256, 512)])
@pytest.mark.parametrize("n_heads,n_kv", [(32, 8), (24, 2), (48, 2)], ids=lambda v: str(v))
def test_partition_rule(batch, max_context, n_heads, n_kv):
    """The partition size follows the lesson's rule on this GPU: the single pass from one
    block per SM; below, 1024 keys halved while the grid has fewer than one block per SM, never
    below 64. A split=True call uses the same sizes. Heads: Llama-3.2-1B's (group 4), and
    groups of 12 (one block per KV head) and 24 (two blocks: 16 query heads a block)."""
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    rule = paged_op().partition_keys
    blocks = batch * n_kv * -(-(n_heads // n_kv) // ROWS)
    for split in (None, True, False):
        got = rule(batch, n_heads, n_kv, max_context, split)
        expected = expected_partition_keys(batch, n_heads, n_kv, max_context, sms, split)
        assert got == expected, (
            f"batch {batch}, {n_heads} / {n_kv} heads, max_context {max_context}, "
            f"split={split}, {sms} SMs: paged_attention_partition_keys gave {got}, the rule "
            f"{expected} (0 = the single pass). The single pass has {blocks} blocks (batch x KV "
            "heads x ceil(group / 16)). The rule: "
            "split=False: 0; deciding (split=None) with blocks >= SMs: 0; otherwise start at "
            "1024 keys and halve while keys > 64 and blocks x ceil(max_context / keys) < SMs; "
            "one partition holding every key is the single pass: 0")


@pytest.mark.gpu
@pytest.mark.parametrize("max_context", [288, 512, 2048])
def test_batch_of_one_chooses_small_partitions(seed, max_context):
    """A decode step of one sequence (the chat case): the kernel chooses its own partitions
    (64 keys on a GPU of 132 SMs) from max_context, and takes a context of at most 256 keys
    whole; contexts shorter than max_context, at it, at a partition boundary and at 256 / 257;
    the result matches SDPA and the single pass."""
    gen = checks.generator("cuda", seed)
    for n in sorted({1, 64, 100, 256, 257, 288, max_context - 1, max_context}):
        if n > max_context:
            continue
        pg = Paged(gen, [n], 32, 8, 64, extra_columns=max_context // 16 + 1)
        poison_workspace(pg, max_context)
        what = f"batch 1, context {n}, max_context {max_context} (the kernel's partitions)"
        auto = run_and_check(pg, 0.125, what, max_context=max_context)
        single = run_and_check(pg, 0.125, "single pass", split=False, max_context=max_context)
        checks.assert_close(auto, single, what=f"{what} vs the single pass",
                            dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_padding_rows_give_zeros(seed, kernel):
    """context_lens 0 marks a padding row: its output is exactly 0, whatever its table says."""
    pg = Paged(checks.generator("cuda", seed), [5, 0, 300, 0, 1], 8, 2, 64)
    pg.block_tables[3] = -7  # a padding row's table is never looked at
    pg.tables[3] = [-7] * len(pg.tables[3])
    padding = [1, 3]
    for split, partition in SPLITS[kernel]:
        poison_workspace(pg, split=split, partition=partition, kernel=kernel)
        got = run_and_check(pg, 0.125, f"padding rows (split={split}, partition={partition})",
                            kernel, split=split, partition=partition)[padding]
        checks.assert_equal(got, torch.zeros_like(got), what=f"padding rows 1, 3 (split={split})",
                            hint="context_lens 0: the whole row is written with zeros (not left "
                                 "as it was, not 0/0 = NaN), in the single pass and by the "
                                 "split-K reduction")


@pytest.mark.gpu
@pytest.mark.parametrize("n_heads,n_kv,d", [(9, 3, 64), (32, 8, 128)], ids=lambda v: str(v))
@pytest.mark.parametrize("kernel", KERNELS)
def test_q_is_a_view_of_fused_qkv(seed, kernel, n_heads, n_kv, d):
    """q sliced out of one fused QKV projection: its rows are (H + 2 KV) * d elements apart."""
    pg = Paged(checks.generator("cuda", seed), [7, 129, 1, 64, 1100], n_heads, n_kv, d,
               fused=True)
    assert not pg.q.is_contiguous()
    for split in SPLIT_OR_NOT[kernel]:
        run_and_check(pg, d ** -0.5, f"q as a view of a fused qkv tensor (split={split})",
                      kernel, split=split)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [8, 32, 96, 120])
@pytest.mark.parametrize("kernel", KERNELS)
def test_other_head_dims(seed, kernel, d):
    """The generic path: any head_dim that is a multiple of 8, up to 128 (tiny test models)."""
    pg = Paged(checks.generator("cuda", seed), [5, 130, 1, 1000], 6, 2, d)
    for split in SPLIT_OR_NOT[kernel]:
        run_and_check(pg, d ** -0.5, f"head_dim {d} (split={split})", kernel, split=split)


@pytest.mark.gpu
@pytest.mark.parametrize("n_heads,n_kv", [(10, 2), (12, 2), (16, 1), (24, 2)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("kernel", KERNELS)
def test_other_group_sizes(seed, kernel, n_heads, n_kv):
    """Groups of 5, 6, 16 (multi-query) and 12 query heads per KV head."""
    pg = Paged(checks.generator("cuda", seed), [3, 257, 1, 700], n_heads, n_kv, 64)
    for split in SPLIT_OR_NOT[kernel]:
        run_and_check(pg, 0.125, f"heads {n_heads}/{n_kv} (split={split})", kernel, split=split)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [1, 8, 64])
@pytest.mark.parametrize("kernel", KERNELS)
def test_other_block_sizes(seed, kernel, block_size):
    """Any power of two: blocks smaller than a warp's step of keys, and larger ones."""
    pg = Paged(checks.generator("cuda", seed), [1, 63, 64, 65, 900], 8, 2, 64,
               block_size=block_size)
    for split in SPLIT_OR_NOT[kernel]:
        run_and_check(pg, 0.125, f"block_size {block_size} (split={split})", kernel,
                      split=split)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [40, 3000])
@pytest.mark.parametrize("kernel", KERNELS)
def test_growing_scores(seed, kernel, n):
    """Scores that rise key after key: the running max grows at every step, and split-K's
    later partitions have larger maxima than the earlier ones."""
    gen = checks.generator("cuda", seed)
    pg = Paged(gen, [n, n], 8, 2, 64)
    ramp = torch.linspace(0.0, 3.0, n, device="cuda")[:, None, None]
    for b in range(2):
        direction = pg.q[b, :4].float().mean(0) if b == 0 else pg.q[b, 4:].float().mean(0)
        keys = (ramp * direction).to(torch.bfloat16).expand(n, 2, 64)
        blocks, rows = pg.rows(b)
        pg.k[blocks, rows] = keys
    for split in SPLIT_OR_NOT[kernel]:
        try:
            run_and_check(pg, 0.125, f"rising scores, {n} keys (split={split})", kernel,
                          split=split)
        except AssertionError as e:
            raise AssertionError(
                f"{e}\n  when the scores keep rising: did you forget to rescale the "
                "accumulator (and the sum l) when the max grows? o and l must be multiplied "
                "by exp(m_old - m_new); and split-K's partitions by exp(m_i - max m)") from None


@pytest.mark.gpu
@pytest.mark.parametrize("q_scale", [8.0, 40.0])
@pytest.mark.parametrize("kernel", KERNELS)
def test_large_scores_stay_finite(seed, kernel, q_scale):
    """Scores in the hundreds: exp(s) overflows float32 unless the running max is subtracted."""
    pg = Paged(checks.generator("cuda", seed), [200, 1000, 1], 8, 2, 64, q_scale=q_scale)
    for split in SPLIT_OR_NOT[kernel]:
        got = run_and_check(pg, 64 ** -0.5, f"queries scaled by {q_scale} (split={split})",
                            kernel, split=split)
        checks.assert_finite(got, "paged attention output with large scores")


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_bad_block_or_length_is_nan_not_a_crash(seed, kernel):
    """The kernel cannot raise: a block number outside the pool or a length past the table's
    capacity (or past max_context) reads nothing and gives NaN for that row only."""
    pg = Paged(checks.generator("cuda", seed), [5, 40, 12, 3, 700], 4, 2, 64)
    num_blocks = pg.k.shape[0]
    pg.block_tables[1, 1] = num_blocks        # the second block of sequence 1
    pg.block_tables[4, 0] = -1
    pg.context_lens[2] = pg.block_tables.shape[1] * 16 + 1
    good = [0, 3]
    for split in SPLIT_OR_NOT[kernel]:
        out = checks.poison(torch.empty(pg.q.shape, dtype=pg.q.dtype, device="cuda"))
        op(kernel)(*pg.args(), 0.125, out=out, split=split)
        torch.cuda.synchronize()
        if not out[[1, 2, 4]].isnan().all():
            raise AssertionError(
                f"{kernel} kernel, split={split}: rows with a block outside the pool (sequences "
                "1, 4) or a length past the block table (sequence 2) must be NaN. "
                + NAN_ROWS_HINT)
        sub = Paged.__new__(Paged)
        sub.q, sub.k, sub.v, sub.block_size = pg.q[good], pg.k, pg.v, 16
        sub.lens, sub.tables = [pg.lens[b] for b in good], [pg.tables[b] for b in good]
        checks.assert_close(out[good], sdpa_oracle(sub, 0.125),
                            what=f"the valid rows beside invalid ones (split={split})",
                            dtype=torch.bfloat16)
    out = checks.poison(torch.empty(pg.q.shape, dtype=pg.q.dtype, device="cuda"))
    op(kernel)(*pg.args(), 0.125, out=out, max_context=600, split=True)
    torch.cuda.synchronize()
    assert out[4].isnan().all(), "a length past max_context must give a NaN row"


@pytest.mark.gpu
@pytest.mark.parametrize("batch,split", [(1, None), (4, None), (4, False), (64, None)],
                         ids=["1-auto", "4-auto", "4-single", "64-auto"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_captured_in_a_cuda_graph(seed, kernel, batch, split):
    """A decode step runs inside a CUDA graph: the op must not read block_tables or
    context_lens on the host (nor size anything from them), and a replay must see the
    values written into them since, including a much longer context (more partitions;
    at batch 1, partitions of 64 keys), replay after replay (split-K's tickets start every
    launch at 0)."""
    gen = checks.generator("cuda", seed)
    if batch == 1:
        lens, new_lens = [300], [2500]
    else:
        lens, new_lens = [30, 300, 3, 1] * (batch // 4), [31, 2500, 4, 0] * (batch // 4)
    shape = dict(num_blocks=max(1, batch // 4) * 190 + 20, max_blocks=170)  # room for both
    pg = Paged(gen, lens, 32, 8, 64, **shape)
    decode = op(kernel)
    out = torch.empty(pg.q.shape, dtype=pg.q.dtype, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture (builds, loads the library)
        decode(*pg.args(), 0.125, out=out, split=split)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode(*pg.args(), 0.125, out=out, split=split)
    # The next step: new queries, new lengths (one much longer), other blocks, written into
    # the very tensors the graph reads.
    fresh = Paged(gen, new_lens, 32, 8, 64, **shape)
    for mine, theirs in zip(pg.args(), fresh.args()):
        mine.copy_(theirs)
    for replay in range(3):
        checks.poison(out)
        graph.replay()
        torch.cuda.synchronize()
        check_paged(out, sdpa_oracle(fresh, 0.125), fresh.q, fresh.k, fresh.v, fresh.tables,
                    fresh.lens, 0.125, kernel=kernel, partition=0,
                    what=f"graph replay {replay + 1} with new block tables and lengths")
        fresh = Paged(gen, lens if replay % 2 == 0 else new_lens, 32, 8, 64, **shape)
        for mine, theirs in zip(pg.args(), fresh.args()):
            mine.copy_(theirs)


NEW_TOKEN_HEADS = [(32, 8, 64), (9, 3, 64), (16, 4, 128), (48, 2, 64), (12, 4, 96), (6, 3, 40)]
# The fast kernel writes the new token itself, with every split choice and any head_dim; the
# simple one lets stage 13's rope_cache_write store it first, and that kernel takes head_dims
# that are multiples of 16 (as the engine's paged cache does without stage 14).
NEW_TOKEN_CASES = [pytest.param("fast", split, heads, id=f"fast-{name}-{heads}")
                   for split, name in ((None, "auto"), (True, "split"), (False, "single"))
                   for heads in NEW_TOKEN_HEADS] + [
    pytest.param("simple", None, heads, marks=pytest.mark.points(SIMPLE_WEIGHT),
                 id=f"simple-{heads}") for heads in NEW_TOKEN_HEADS if heads[2] % 16 == 0]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,split,heads", NEW_TOKEN_CASES)
def test_the_new_token_written_by_the_kernel(seed, kernel, split, heads):
    """new_token=(k, v, positions, cos_sin): the kernel rotates q and the new key (stage 05's
    RoPE with its roundings) and stores key and value at key len - 1 itself. The same caches
    and the same rows, bit for bit, as stage 13's rope_cache_write followed by the kernel
    without new_token; q, k and v untouched; a padding row stores nothing. (head_dim 96 and
    40: the kernel built for 128, stage 05's pairs in another fragment, or another lane. Stage
    13's kernel takes multiples of 16 only, so the reference is its twin, which stage 13's
    tests hold bit-equal to it.) The simple kernel's op runs rope_cache_write first: the same
    caches and output."""
    n_heads, n_kv, d = heads
    gen = checks.generator("cuda", seed)
    lens = [1, 16, 17, 300, 0, 1000]
    pg = Paged(gen, lens, n_heads, n_kv, d, fused=True)
    positions = (torch.tensor(lens, device="cuda") - 1).clamp(min=0) * 3
    rope = parts.load("05", "rope_tables")
    cos_sin = rope.cos_sin_cache(d, 500000.0, None, 4096, device="cuda")
    given = [t.clone() for t in (pg.q, pg.k_new, pg.v_new)]
    # the reference: rope_cache_write's twin on copies, then the kernel over the written caches
    q_ref, k_ref = pg.q.clone(), pg.k_new.clone()
    k_cache, v_cache = pg.k.clone(), pg.v.clone()
    bs = pg.block_size
    slots = torch.tensor([-1 if n == 0 else pg.tables[b][(n - 1) // bs] * bs + (n - 1) % bs
                          for b, n in enumerate(lens)], dtype=torch.int64, device="cuda")
    parts.load("13", "cache_write").rope_cache_write_native(q_ref, k_ref, pg.v_new, positions,
                                                            cos_sin, k_cache, v_cache, slots)
    decode = op(kernel)
    want = decode(q_ref, k_cache, v_cache, pg.block_tables, pg.context_lens, d ** -0.5,
                  split=split)
    got = decode(*pg.args(), d ** -0.5, split=split,
                 new_token=(pg.k_new, pg.v_new, positions, cos_sin))
    for mine, theirs, what in ((pg.k, k_cache, "k_cache"), (pg.v, v_cache, "v_cache"),
                               (got, want, "the output")):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0, equal_nan=True, msg=lambda m: (
            f"{what} with new_token differs from rope_cache_write then the kernel: {m}"))
    for t, before, name in zip((pg.q, pg.k_new, pg.v_new), given, ("q", "k", "v")):
        assert torch.equal(t, before), f"new_token: {name} itself must not change"


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_rejects_bad_input(seed, kernel):
    pg = Paged(checks.generator("cuda", seed), [3, 5], 4, 2, 64)
    run_and_check(pg, 0.125, "a valid call", kernel)
    q, k, v, tables, lens = pg.args()
    out = torch.empty(q.shape, dtype=q.dtype, device="cuda")

    def call(q=q, k=k, v=v, tables=tables, lens=lens, out=out, split=-1, *more):
        """The raw op's arguments: the simple kernel's take no split (nor what follows it)."""
        if kernel == "simple":
            return parts.kernels().paged_decode_attention_simple, (q, k, v, tables, lens, 0.1,
                                                                   -1, out)
        return parts.kernels().paged_decode_attention, (q, k, v, tables, lens, 0.1, -1, split,
                                                        out, *more)
    k24 = torch.zeros((k.shape[0], 24, 2, 64), dtype=k.dtype, device="cuda")
    bad = {
        "multiple of n_kv_heads": call(q[:, :3].contiguous(), out=out[:, :3].contiguous()),
        "bfloat16": call(q.float()),
        "block_tables": call(tables=tables.long()),
        "context_lens": call(lens=lens[:1]),
        "power of two": call(k=k24, v=k24),
        "k_cache must be contiguous": call(k=k.transpose(1, 2), v=v.transpose(1, 2)),
        "one shape": call(v=v[:, :8].contiguous()),
        "out must be": call(out=out[:1]),
    }
    if kernel == "fast":
        # split-K's options, and the new token (new_token=): k, v, positions and cos_sin,
        # together, of the right shapes
        kn = torch.zeros((2, 2, 64), dtype=q.dtype, device="cuda")
        pos = torch.zeros(2, dtype=torch.int64, device="cuda")
        cos_sin = torch.zeros((16, 64), dtype=torch.float32, device="cuda")
        bad.update({
            "split must be": call(split=2),
            "multiple of 16": call(q, k, v, tables, lens, out, -1, 24),
            "cannot go with split = 0": call(q, k, v, tables, lens, out, 0, 64),
            "come together, or none": call(q, k, v, tables, lens, out, -1, 0, kn, kn, None,
                                           None),
            "k_new and v_new must be": call(q, k, v, tables, lens, out, -1, 0, kn[:, :1],
                                            kn[:, :1], pos, cos_sin),
            "positions must be": call(q, k, v, tables, lens, out, -1, 0, kn, kn, pos[:1],
                                      cos_sin),
        })
    for needle, (fn, args) in bad.items():
        with pytest.raises(RuntimeError) as info:
            fn(*args)
        assert needle in str(info.value), (
            f"bad input should be refused with a message about {needle!r}, got: {info.value}")


@pytest.mark.gpu
def test_the_op_the_engine_calls(seed):
    """paged_decode_attention, what the engine calls: the fast kernel, or the simple one while
    the fast one is still a TODO (one line on stderr); a decode step's call, with max_context
    and the new token, gives the right rows and stores the new key and value."""
    gen = checks.generator("cuda", seed)
    lens = [5, 300, 0, 1000]
    pg = Paged(gen, lens, 32, 8, 64, fused=True)
    positions = (torch.tensor(lens, device="cuda") - 1).clamp(min=0)
    cos_sin = parts.load("05", "rope_tables").cos_sin_cache(64, 500000.0, None, 4096,
                                                            device="cuda")
    q_ref, k_ref, k_cache, v_cache = pg.q.clone(), pg.k_new.clone(), pg.k.clone(), pg.v.clone()
    slots = torch.tensor([-1 if n == 0 else pg.tables[b][(n - 1) // 16] * 16 + (n - 1) % 16
                          for b, n in enumerate(lens)], dtype=torch.int64, device="cuda")
    parts.load("13", "cache_write").rope_cache_write_native(q_ref, k_ref, pg.v_new, positions,
                                                            cos_sin, k_cache, v_cache, slots)
    got = paged_op().paged_decode_attention(
        *pg.args(), 0.125, max_context=2048, new_token=(pg.k_new, pg.v_new, positions, cos_sin))
    torch.cuda.synchronize()
    check_paged(got, attend(q_ref, k_cache, v_cache, pg.tables, lens, 0.125), q_ref, k_cache,
                v_cache, pg.tables, lens, 0.125, kernel="fast", partition=0,
                what="paged_decode_attention (the engine's op) with the new token")
    for mine, theirs, what in ((pg.k, k_cache, "k_cache"), (pg.v, v_cache, "v_cache")):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0, equal_nan=True, msg=lambda m: (
            f"{what} after the engine's op with new_token differs from rope_cache_write's: {m}"))

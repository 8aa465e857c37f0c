"""Stage 10: decode steps from fixed buffers, recorded once as CUDA graphs and replayed.

A decode step of a small model is a few hundred kernel launches of a few microseconds each;
at batch 1 the CPU issuing them, not the GPU running them, sets the pace. A CUDA graph records
the launches of one step once and replays them all with one call. What a replay does is
frozen at capture, so:

- every tensor the step reads lives at a fixed address, allocated before capture: each step
  copies its inputs INTO those buffers (`inputs` below) instead of making new tensors;
- nothing in the step may read a GPU value on the host (no .item(), no data-dependent Python
  branches): the model's forward was written that way (stages 07-09);
- shapes are frozen too, so there is one graph per batch size. Batches are padded up to the
  next captured size (1, 2, 4, 8, 16, 32, 48, ...): padding rows write their K/V to the
  cache's pad_slot and attend over nothing (context length 0);
- each graph is run once before capture (a warm-up: cuBLAS and the kernels initialise
  themselves lazily, which must not happen inside a capture), and all graphs share one
  memory pool, captured largest first, so the smaller ones reuse the largest one's memory.

- a graph replays kernels only, so the step's integer inputs are written in the dtypes the
  kernels read (token ids, positions and slots int64; context lengths and block tables
  int32): a cast inside the step would be one more kernel in every replay.

What the step does with its hidden states can be recorded too: `head` (the engine passes the
logits and the greedy argmax, so that a decode step of one sequence is one graph launch, not
a graph and then the lm_head's and the argmax's launches; padding rows get logits and tokens
of their own, ignored). A head is handed the final RMSNorm's inputs, not its output
(`forward(..., final_norm=False)`): `LlamaModel.stream_logits` runs the norm and the lm_head
as one op, at batch 1 one kernel. The head is handed the graph's own ids row as well: the
engine's argmax writes each row's token there, so the next step finds its input ids in place
and nothing copies them. And a token slot, a step input like the others (`run`'s
token_slot): the engine's argmax also stores the tokens in that row of a pinned host buffer,
so that they reach the host with no copy kernel after the graph.
Between two steps the host's inputs go over by a kernel (pinned_copy.py), not by the copy
engine: at batch 1 each copy-engine operation between two graphs left the GPU idle for
microseconds (pinned_copy.cu).
On a CPU (or with use_graphs=False) the same buffers run the forward eagerly.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from course import parts

_kv = parts.load("09", "kv_cache")
copy_pinned = parts.load("10", "pinned_copy").copy_pinned
AttentionMetadata = parts.load("08", "attention_metadata").AttentionMetadata
if TYPE_CHECKING:   # a stage folder is no package: parts.load names its types
    KVCache, StepPlan = _kv.KVCache, _kv.StepPlan
    LlamaModel = parts.load("08", "model").LlamaModel

# ids, positions, slot_mapping: one int64 row each of `inputs`
ROWS = 3


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_batch (and max_batch itself)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch]
    sizes += list(range(16, max_batch, 16))
    return sizes + [max_batch]


class DecodeGraphs:
    """Runs decode steps (one new token per sequence) for up to `max_batch` sequences.

    model: a stage-08 LlamaModel whose attention is stage 09's KVCacheAttention; cache: its
    KVCache. use_graphs: None means "on CUDA"; graphs are captured in __init__. max_blocks:
    the longest block table (1 for stage 09's cache: a sequence's block is its slot).
    head: None, or a function of the final RMSNorm's inputs (h, residual), [size, H] each
    (forward with final_norm=False; LlamaModel.stream_logits makes logits of them), the
    graph's ids row [size] int64 (where it may write the next step's ids) and the token slot
    [1] int64 (the number `run` was given as token_slot, on the device) returning one tensor
    with a row per sequence, recorded in the graph after the forward; `run` then returns its
    rows.
    """

    def __init__(self, model: LlamaModel, cache: KVCache, max_batch: int,
                 use_graphs: bool | None = None, max_blocks: int = 1,
                 head: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model, self.cache, self.max_batch, self.head = model, cache, max_batch, head
        device = model.device
        self.use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; this model is on " + str(device))
        self.sizes = graph_batch_sizes(max_batch)
        # A pinned host buffer and a device buffer: a step's inputs cross in one copy.
        # The first ROWS x max_batch int64 entries are `inputs`, then the token slot (one
        # int64); after them (from a 16-byte boundary), as int32, the block tables [max_batch,
        # max_blocks] and the context lengths.
        size = self._int32_start() + ((1 + max_blocks) * max_batch + 1) // 2
        self.device_buffer = torch.zeros(size, dtype=torch.int64, device=device)
        self.inputs, self.token_slot, self.context_lens, self.tables = self._views(
            self.device_buffer, max_blocks)
        # Two host buffers, used in turn: an engine that prepares the next step while the GPU
        # runs this one must not overwrite what this step's copy has not read yet.
        self._host_buffers = []
        for _ in range(2):
            host = torch.zeros(size, dtype=torch.int64, pin_memory=device.type == "cuda")
            # What each row of host_tables holds: the table written there, (length, last).
            self._host_buffers.append((
                host, *(view.numpy() for view in self._views(host, max_blocks)),
                [[]] * max_batch, [None] * max_batch))
        self._turn = 0
        self._use_host_buffer(0)
        self.cu_seqlens = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.rows = torch.arange(max_batch, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if self.use_graphs:
            self.capture()

    def _int32_start(self) -> int:
        return -(-(ROWS * self.max_batch + 1) // 2) * 2

    def _views(self, buffer: torch.Tensor, max_blocks: int) -> tuple[torch.Tensor, ...]:
        """inputs [ROWS, max_batch] int64, the token slot [1] int64, context_lens [max_batch]
        int32 and block tables [max_batch, max_blocks] int32: views of one int64 buffer."""
        n = self.max_batch
        int32s = buffer[self._int32_start():].view(torch.int32)
        return (buffer[: ROWS * n].view(ROWS, n), buffer[ROWS * n: ROWS * n + 1],
                int32s[n * max_blocks: n * max_blocks + n],
                int32s[: n * max_blocks].view(n, max_blocks))

    def _use_host_buffer(self, turn: int) -> None:
        self._turn = turn
        (self.host, self.host_rows, self.host_slot, self.host_lens, self.host_tables,
         self._written, self._written_len) = self._host_buffers[turn]

    def padded_size(self, batch: int) -> int:
        """The smallest captured batch size that holds `batch` sequences."""
        for size in self.sizes:
            if size >= batch:
                return size
        raise ValueError(f"a decode batch of {batch} sequences is larger than max_batch "
                         f"{self.max_batch}")

    def _step(self, size: int) -> torch.Tensor:
        """The forward of the first `size` rows of `inputs` -> hidden [size, H], or the head's
        output of it. Everything it launches is what a graph of this size records."""
        ids, positions, slots = self.inputs[0, :size], self.inputs[1, :size], self.inputs[2, :size]
        tables = self.tables[:size]
        meta = AttentionMetadata(
            cu_seqlens_q=self.cu_seqlens[: size + 1], cu_seqlens_k=self.cu_seqlens[: size + 1],
            max_seqlen_q=1, max_seqlen_k=self.cache.max_len, last_rows=self.rows[:size],
            kv_cache=self.cache, slot_mapping=slots, seq_slots=tables[:, 0].contiguous(),
            block_tables=tables, context_lens=self.context_lens[:size], decode=True)
        if self.head is None:
            return self.model.forward(ids, positions, meta)
        return self.head(self.model.forward(ids, positions, meta, final_norm=False), ids,
                         self.token_slot)

    def capture(self) -> None:
        """Record one graph per batch size, largest first, in one shared memory pool."""
        self._fill([], [], [], [], [], self.max_batch)  # padding everywhere: harmless to run
        self._send(ids_in_place=False)
        pool = None
        # TODO stage 10: for each size, largest first: warm up with _step(size) and synchronize; capture _step(size) with torch.cuda.graph(graph, pool=pool); keep the graph and its output; share the first graph's pool (about 9 lines)
        raise NotImplementedError("TODO stage 10: for each size, largest first: warm up with _step(size) and synchronize; capture _step(size) with torch.cuda.graph(graph, pool=pool); keep the graph and its output; share the first graph's pool (about 9 lines)")

    def _write_tables(self, block_tables: list[list[int]], size: int) -> None:
        """Block tables into the host buffer, rows past len(block_tables) up to `size` made
        padding. A row is rewritten only when its table changed since the last step (a new
        block every block_size tokens, or another sequence in that row): at 256 sequences
        rewriting every table every step costs more host time than the whole graph replay.
        "Changed" means another list, or another length or last block: an allocator changes a
        table by appending to it or by replacing it, never by editing blocks in place."""
        pad, written, written_len = self.cache.pad_slot, self._written, self._written_len
        for i, table in enumerate(block_tables):
            if written[i] is not table or written_len[i] != (len(table), table[-1]):
                self.host_tables[i, : len(table)] = table
                written[i], written_len[i] = table, (len(table), table[-1])
        for i in range(len(block_tables), size):
            if written[i] is not None:
                self.host_tables[i, 0] = pad
                written[i], written_len[i] = None, None

    def _fill(self, ids: list[int], positions: list[int], slot_mapping: list[int],
              context_lens: list[int], block_tables: list[list[int]], size: int) -> None:
        """Write a step's inputs into the host buffer and pad rows up to `size` (`_send` then
        copies the buffer to the device)."""
        n = len(ids)
        self._write_tables(block_tables, size)
        # TODO stage 10: the three rows of host_rows[:, :n] and host_lens[:n]; padding rows n..size (id 0, position 0, slot_mapping = the pad slot's first row, pad_slot * block_size, context 0) (about 6 lines)
        raise NotImplementedError("TODO stage 10: the three rows of host_rows[:, :n] and host_lens[:n]; padding rows n..size (id 0, position 0, slot_mapping = the pad slot's first row, pad_slot * block_size, context 0) (about 6 lines)")

    def _send(self, ids_in_place: bool) -> None:
        """The host buffer to the device buffer, queued (a kernel: pinned_copy.py). With
        ids_in_place the ids row (the buffer's first max_batch entries) is left as it is: the
        step before wrote this step's ids there."""
        first = self.max_batch if ids_in_place else 0
        copy_pinned(self.device_buffer[first:], self.host[first:])

    def run(self, ids: list[int], plan: StepPlan, ids_device: torch.Tensor | None = None,
            token_slot: int = 0) -> torch.Tensor:
        """One decode step: ids [B] (each sequence's newest token), plan: its stage-09 StepPlan
        (plan.decode must be true). ids_device: [B] int64 on the device, the ids instead of
        `ids` when the host does not know them yet (the previous step's samples, still on the
        GPU); when they are the graph's own ids row (the head of the step before wrote them
        there) nothing copies them. token_slot: a number the head finds in its third argument
        (the engine's argmax: the row of pinned memory it stores the tokens in). Returns hidden
        [B, H] (or the head's first B rows), a view valid until the next run."""
        if not plan.decode or len(ids) != len(plan.positions):
            raise ValueError("DecodeGraphs runs decode steps only: one new token per sequence")
        size = self.padded_size(len(ids))
        self._use_host_buffer(1 - self._turn)
        self._fill(ids, plan.positions, plan.slot_mapping, plan.context_lens,
                   plan.block_tables, size)
        self.host_slot[0] = token_slot
        in_place = (ids_device is not None and ids_device.is_contiguous()
                    and ids_device.data_ptr() == self.inputs.data_ptr())
        self._send(in_place)
        if ids_device is not None and not in_place:   # after _send: it lands on top of `ids`
            self.inputs[0, : len(ids)].copy_(ids_device)
        # TODO stage 10: replay the graph of this size and return its output's first B rows; without graphs, run _step(size) eagerly (about 4 lines)
        raise NotImplementedError("TODO stage 10: replay the graph of this size and return its output's first B rows; without graphs, run _step(size) eagerly (about 4 lines)")

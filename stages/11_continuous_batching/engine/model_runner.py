# GIVEN FILE: generated from solutions/engine/model_runner.py by `nox -s sync-stages`.
# Read it; do not edit it. Nothing runs this copy (the engine runs the
# original), and any edit here is overwritten.
"""Runs one scheduled step on the model: inputs in, one sampled token per sequence out.

    ModelRunner(model, config)     a KV cache sized from memory, the cache attention backend,
                                   the scheduler's cache allocator, decode CUDA graphs for
                                   every padded batch size
    runner.launch(seqs) -> tokens  the step's sequences (num_scheduled set by the scheduler) in,
                                   one sampled token each out (SampledTokens: on the device
                                   at once, on the host when the step is done), not waited for

The cache is paged (stage 13: a pool of blocks, a BlockManager with prefix caching, paged
attention) once stage 13 is available, else stage 09's contiguous cache with one slot of
max_model_len positions per sequence (stage 11's SlotAllocator); `EngineConfig.paged` picks.

Prefill steps run the model eagerly on the packed prompts (stage 09's StepPlan); decode steps
go through stage 10's DecodeGraphs (a graph replay on CUDA), whose graphs record the logits and
each row's argmax after the forward: a greedy decode step is one graph launch, and a batch
with random rows samples from the graph's logits. Logits are computed for each
sequence's last token only, and sampled on the device (sampler.py); the one copy back to the
host per step is the sampled token ids, and `launch` does not wait for it: the engine can
prepare and queue the next decode step first (llm_engine.py). That copy is queued right
behind the step and waited for through its own CUDA event (SampledTokens), never with a
stream-wide synchronisation: by the time the host reads a step's tokens, the engine has
queued the next step behind it, and `.tolist()` on the device tensor would wait for that one
too, leaving the GPU idle while the host prepares the step after. The copy is a kernel that
stores into pinned memory (stage 10's pinned_copy.py), not a copy-engine operation, and a
greedy decode step needs none: its graph's argmax writes the tokens straight into the next
step's ids row and into the pinned slot the step was given (TokenMailbox.reserve).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from course import manifest, parts
from solutions.engine import sampler

_kv = parts.load("09", "kv_cache")
DecodeGraphs = parts.load("10", "decode_graphs").DecodeGraphs
copy_pinned = parts.load("10", "pinned_copy").copy_pinned
SlotAllocator = parts.load("11", "scheduler").SlotAllocator
if TYPE_CHECKING:   # a stage folder is no package: parts.load names its types
    LlamaModel = parts.load("08", "model").LlamaModel

GiB = 1 << 30
# The head sizes the engine's CUDA kernels take: stage 13's rotating cache write works on 8
# pairs a thread; stages 07, 09 and 14 keep a head of at most 128 values in registers.
CUDA_HEAD_DIM_STEP, CUDA_MAX_HEAD_DIM = 16, 128


def check_head_dim(head_dim: int, device: torch.device) -> None:
    """ValueError, in one line, for a head size the CUDA kernels lack (the CPU takes any):
    called before the weights load, so a model that cannot run is refused at once."""
    if device.type == "cuda" and (head_dim % CUDA_HEAD_DIM_STEP or head_dim > CUDA_MAX_HEAD_DIM):
        raise ValueError(f"head_dim {head_dim} is not supported on CUDA (the engine's attention "
                         f"kernels take multiples of {CUDA_HEAD_DIM_STEP} up to "
                         f"{CUDA_MAX_HEAD_DIM})")


class SampledTokens:
    """A step's sampled token ids, [B] int64: `device` at once (a decode step queued next reads
    its input ids from there; a greedy decode step's are its graph's ids row, valid until the
    next decode step), `tolist()` once the step is done.

    The tokens are copied into `host` ([>= B] int64, a TokenMailbox slot: pinned memory on
    CUDA), on CUDA queued behind the sampling with an event recorded after it; tolist() waits
    for that event only. On the H200, reading the device tensor with .tolist() instead
    cost ~1 ms of idle GPU per step at batch 256 (engine step 3967 us, graph replay 2725 us):
    it waited for the step queued after this one as well. stored=True: a kernel queued before
    (a greedy decode graph's argmax) has stored them in `host` itself; nothing is copied.
    """

    def __init__(self, device_tokens: torch.Tensor, host: torch.Tensor, stored: bool = False):
        self.device = device_tokens
        self._done = None
        self.read = False
        # a copy also on a CPU: the tokens may be a buffer that the next step writes again
        n = device_tokens.shape[0]
        self._host = host[:n] if stored else copy_pinned(host[:n], device_tokens)
        if device_tokens.is_cuda:
            self._done = torch.cuda.Event()
            self._done.record()

    def tolist(self) -> list[int]:
        if self._done is not None:
            self._done.synchronize()
        self.read = True
        return self._host.tolist()

    def keep_own_copy(self) -> None:
        """Wait for the copy and hold the tokens apart from the mailbox slot (reused now)."""
        if self._done is not None:
            self._done.synchronize()
        self._host = self._host.clone()


class TokenMailbox:
    """Pinned host buffers for the steps' tokens, handed out in turn: a kernel writes a step's
    tokens into one (pinned_copy.py, or a decode graph's argmax itself), and the host reads
    them once the step is done. The engine reads each step's tokens before it queues the step
    after next, so two slots are enough; should a caller queue a third step first, the unread
    tokens of the slot it reuses are waited for and kept apart (SampledTokens.keep_own_copy),
    so no write lands on them.

    slots: [2, rows] int64, one slot a row (what the argmax's `host` takes)."""

    def __init__(self, rows: int, pinned: bool):
        self.slots = torch.empty((2, rows), dtype=torch.int64, pin_memory=pinned)
        self._handed: list[SampledTokens | None] = [None, None]
        self._next = 0

    def reserve(self) -> int:
        """The next slot, free to be written from now on (its unread tokens kept apart)."""
        slot = self._next
        before = self._handed[slot]
        if before is not None and not before.read:
            before.keep_own_copy()
        self._handed[slot] = None
        return slot

    def take(self, device_tokens: torch.Tensor, stored_in: int | None = None) -> SampledTokens:
        """SampledTokens of device_tokens, copied into the next slot; or, stored_in: the slot
        (from reserve) where a kernel queued before stores them."""
        slot = self.reserve() if stored_in is None else stored_in
        tokens = SampledTokens(device_tokens, self.slots[slot], stored=stored_in is not None)
        self._handed[slot], self._next = tokens, 1 - slot
        return tokens


@dataclass
class EngineConfig:
    """How the engine sizes itself.

    max_model_len: positions per sequence, prompt + output (default: the model's, at most
        DEFAULT_MAX_MODEL_LEN: each running sequence reserves a whole context of cache).
    max_num_seqs: sequences per step (the largest decode batch and CUDA graph).
    max_num_batched_tokens: tokens per step (prefill chunks are cut to fit); with
        chunked_prefill False a step takes whole prompts, so at least max_model_len
        (step_tokens).
    gpu_memory_utilization: paged, the share of the GPU's total memory that the weights,
        a prefill step's activations (measured by a warm-up step) and the KV cache may take
        together; contiguous, the share of the memory free after loading the weights (less
        an estimate of the activations). kv_cache_gib: the cache size on a CPU.
    use_cuda_graphs: replay decode steps from CUDA graphs (CUDA only).
    paged: a paged KV cache (stage 13) or one contiguous slot per sequence (stage 09); None:
        paged when stage 13 is available. block_size: positions per block;
        enable_prefix_caching: share the blocks of common prompt prefixes (paged only).
    """
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    chunked_prefill: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_gib: float = 1.0
    use_cuda_graphs: bool = True
    paged: bool | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True

    DEFAULT_MAX_MODEL_LEN = 4096

    def __post_init__(self) -> None:
        # Checked here, in one sentence each: a wrong kind or a 0 would otherwise surface as
        # a torch error about a tensor's size, or as a cache that "holds no sequence".
        def whole(name: str, value: object, least: int = 1) -> None:
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"EngineConfig.{name} must be an integer >= {least}, got "
                                 f"{value!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            whole(name, getattr(self, name))
        if self.max_model_len is not None:
            whole("max_model_len", self.max_model_len)
        for name in ("gpu_memory_utilization", "kv_cache_gib"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) \
                    or not math.isfinite(value) or value <= 0:
                raise ValueError(f"EngineConfig.{name} must be a finite number > 0, got "
                                 f"{value!r}")
        if self.gpu_memory_utilization > 1:
            raise ValueError(f"EngineConfig.gpu_memory_utilization must be at most 1 (a share "
                             f"of the GPU's memory), got {self.gpu_memory_utilization}")
        for name in ("chunked_prefill", "use_cuda_graphs", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineConfig.{name} must be True or False, got "
                                 f"{getattr(self, name)!r}")
        if self.paged is not None and not isinstance(self.paged, bool):
            raise ValueError(f"EngineConfig.paged must be True, False or None, got "
                             f"{self.paged!r}")

    def model_len(self, model: LlamaModel) -> int:
        if self.max_model_len is None:
            return min(model.max_positions, self.DEFAULT_MAX_MODEL_LEN)
        if not 1 <= self.max_model_len <= model.max_positions:
            raise ValueError(f"max_model_len must be in 1..{model.max_positions} (the model's "
                             f"positions), got {self.max_model_len}")
        return self.max_model_len

    def step_tokens(self, max_len: int) -> int:
        """Tokens a step may hold: max_num_batched_tokens, or without chunked prefill at
        least max_len (a whole prompt goes in one step). The scheduler's budget and the
        warm-up that sizes the cache both use it, so no step outgrows the memory measured."""
        return max(self.max_num_batched_tokens, 0 if self.chunked_prefill else max_len)

    def use_paging(self) -> bool:
        if self.paged is None:
            return manifest.find("13").ready
        return self.paged


def kv_cache_slots(model: LlamaModel, config: EngineConfig, max_len: int) -> int:
    """How many sequences of max_len tokens the cache memory holds (at most max_num_seqs)."""
    per_seq = max_len * _kv.KVCache.bytes_per_token(model.config, model.dtype)
    if model.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(model.device)
        # Keep room for a prefill step's activations: a few [tokens, intermediate] buffers.
        c = model.config
        activations = 8 * config.step_tokens(max_len) * max(c.intermediate_size * 2,
                                                              c.vocab_size // 4) * 2
        budget = free * config.gpu_memory_utilization - activations
    else:
        budget = config.kv_cache_gib * GiB
    slots = min(config.max_num_seqs, int(budget // per_seq))
    if slots < 1:
        advice = ("" if model.device.type == "cuda" else
                  ", or raise the CPU cache size (EngineConfig.kv_cache_gib)")
        raise ValueError(f"the KV cache memory ({max(budget, 0) / GiB:.3g} GiB) does not hold "
                         f"one sequence of {max_len} positions ({per_seq / GiB:.3g} GiB): "
                         f"lower max_model_len{advice}")
    return slots


class ModelRunner:
    """model: a stage-08 LlamaModel; config: the engine's sizes. After construction:
    cache, allocator (the scheduler's), max_len, max_num_seqs (the largest batch the cache
    can run), decoder (stage 10's DecodeGraphs)."""

    def __init__(self, model: LlamaModel, config: EngineConfig):
        check_head_dim(model.config.head_dim, model.device)
        self.model, self.config = model, config
        # (ids of its SamplingParams, the SamplingParams, their SamplingTensors): see
        # _sampling_tensors
        self._greedy_batch: tuple = (None, None, None)
        self.max_len = config.model_len(model)
        self.paged = config.use_paging()
        use_graphs = config.use_cuda_graphs and model.device.type == "cuda"
        if self.paged:
            paged = parts.load("13", "paged_cache")
            if config.block_size < 1:
                raise ValueError(f"block_size must be at least 1, got {config.block_size}")
            self.block_size = config.block_size
            self.max_blocks = -(-self.max_len // self.block_size)
            model.attention = paged.PagedAttention()   # before the warm-up step that sizes the pool
            self.num_blocks = paged.kv_cache_blocks(
                model, self.block_size, self.max_len, config.max_num_seqs,
                config.step_tokens(self.max_len), config.gpu_memory_utilization,
                config.kv_cache_gib)
            self.cache = paged.PagedKVCache.for_model(model, self.num_blocks, self.block_size,
                                                      self.max_len)
            self.allocator = parts.load("13", "block_manager").BlockManager(
                self.num_blocks, self.block_size, config.enable_prefix_caching)
            # every running sequence holds at least one block (block 0 is the pad block)
            self.max_num_seqs = min(config.max_num_seqs, self.num_blocks - 1)
        else:
            self.num_slots = kv_cache_slots(model, config, self.max_len)
            self.max_num_seqs = self.num_slots
            self.cache = _kv.KVCache.for_model(model, self.num_slots, self.max_len)
            self.allocator = SlotAllocator(self.num_slots)   # the scheduler's source of cache
            model.attention = _kv.KVCacheAttention()
        # before the graphs: their argmax stores the greedy tokens in its slots
        self._mailbox = TokenMailbox(self.max_num_seqs, pinned=model.device.type == "cuda")
        self.decoder = DecodeGraphs(model, self.cache, max_batch=self.max_num_seqs,
                                    use_graphs=use_graphs,
                                    max_blocks=self.max_blocks if self.paged else 1,
                                    head=self._logits_and_greedy)

    def _logits_and_greedy(self, stream: tuple[torch.Tensor, torch.Tensor],
                           next_ids: torch.Tensor, token_slot: torch.Tensor) -> torch.Tensor:
        """What a decode graph records after the forward: the final norm's inputs (h,
        residual) [B, H] -> logits [B, V] float32, and each row's argmax into next_ids [B], the
        graph's ids row, and into the mailbox's slot token_slot (all that a greedy batch needs:
        the next step's ids are then in place, and the host's tokens with no copy). At batch 1
        on an sm_90 GPU the lm_head's kernel picks them itself (stream_logits' pick)."""
        return self.model.stream_logits(*stream, pick=next_ids, host=self._mailbox.slots,
                                        host_slot=token_slot)

    def describe(self) -> str:
        graphs = (f", CUDA graphs for {len(self.decoder.sizes)} batch sizes"
                  if self.decoder.use_graphs else "")
        if self.paged:
            caching = "prefix caching" if self.config.enable_prefix_caching else "no prefix caching"
            return (f"KV cache: {self.num_blocks - 1} blocks x {self.block_size} positions "
                    f"({(self.num_blocks - 1) * self.block_size} tokens, "
                    f"{self.cache.nbytes / GiB:.2f} GiB), {caching}, up to "
                    f"{self.max_num_seqs} sequences of {self.max_len} positions{graphs}")
        per_token = _kv.KVCache.bytes_per_token(self.model.config, self.model.dtype)
        size = per_token * self.max_len * (self.num_slots + 1)
        return (f"KV cache: {self.num_slots} sequences x {self.max_len} positions "
                f"({size / GiB:.2f} GiB){graphs}")

    @torch.no_grad()
    def launch(self, seqs: list, previous: tuple[list, SampledTokens] | None = None
               ) -> SampledTokens:
        """Queue the step on the GPU and return its sampled tokens without waiting for them.
        previous: (the sequences, the tokens) of a decode step still in flight whose samples
        are these sequences' newest tokens: a decode step takes its input ids from those
        tokens on the device, while the host holds a placeholder."""
        steps = [_kv.SeqStep(s.block_table, s.num_cached, s.num_scheduled) for s in seqs]
        plan = _kv.StepPlan.build(steps, self.cache)
        model = self.model
        st = self._sampling_tensors(seqs)
        if plan.decode:
            ids_device = None
            if previous is not None:
                before, sampled = previous[0], previous[1].device
                if len(before) >= len(seqs) and all(a is b for a, b in zip(seqs, before)):
                    ids_device = sampled[: len(seqs)]    # the same rows, maybe fewer at the end
                else:
                    row = {id(s): i for i, s in enumerate(before)}
                    index = [row[id(s)] for s in seqs]
                    ids_device = sampled[_kv.to_device(index, torch.int64, model.device)]
            slot = self._mailbox.reserve()
            # a step of one new token each: decodes, or one-token chunks of prompts (a small
            # token budget, or a prompt cached but for its last blocks), whose token is not
            # the newest: each sequence's first uncached token
            logits = self.decoder.run([s.token_ids[s.num_cached] for s in seqs], plan, ids_device,
                                      token_slot=slot)
            if st.all_greedy:   # the graph's argmax; the next decode step overwrites it
                return self._mailbox.take(self.decoder.inputs[0, : len(seqs)], stored_in=slot)
        else:
            positions, meta = plan.metadata(self.cache, model.device)
            ids = [t for s in seqs for t in s.token_ids[s.num_cached: s.num_cached + s.num_scheduled]]
            hidden = model.forward(_kv.to_device(ids, torch.int64, model.device), positions, meta)
            logits = model.compute_logits(hidden, meta.last_rows)
        tokens = sampler.sample(logits, st.temperature, st.top_k, st.top_p, st.seeds, st.steps,
                                needs_filter=st.needs_filter, all_greedy=st.all_greedy)
        return self._mailbox.take(tokens)

    def _sampling_tensors(self, seqs: list) -> sampler.SamplingTensors:
        """The sampler's rows for these sequences. A batch whose every request is greedy needs
        none; most decode steps run the same requests as the step before, so the last
        all-greedy batch is remembered by the identity of its SamplingParams objects (kept
        alive here, so no other object can take one of their ids) and not checked again."""
        params = [s.params for s in seqs]
        key = tuple(map(id, params))
        if key == self._greedy_batch[0]:
            return self._greedy_batch[2]
        generated = [len(s.token_ids) - len(s.prompt_ids) for s in seqs]
        st = sampler.SamplingTensors.from_params(params, generated, self.model.device)
        if st.all_greedy:
            self._greedy_batch = (key, params, st)
        return st

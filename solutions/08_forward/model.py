"""Stage 08: the whole forward pass of a Llama-family decoder, assembled from the ops of
stages 03-08.

    ids -> embedding -> [ decoder layer ] x L -> final RMSNorm -> lm_head -> logits
                         |
                         |  x = RMSNorm(h)              (residual stream h kept aside)
                         |  h = h + Attention(x)        (qkv proj, RoPE, causal GQA, o proj)
                         |  x = RMSNorm(h)
                         |  h = h + MLP(x)              (gate_up proj, silu * up, down proj)

Mistral is this model under another name. Qwen2 and Qwen3 change one step of the attention,
between the qkv projection and RoPE (`family_qkv_`, given): Qwen2 adds a bias to q, k and v;
Qwen3 RMS-normalizes every q and k head over its head_dim features (stage 04's rmsnorm over
[tokens * heads, head_dim] rows), which keeps the attention logits in range whatever the
projections grow to. Qwen3 also sets head_dim apart from hidden / heads (Qwen3-0.6B: hidden
1024, 16 heads of 128), which the shapes below never assume anyway.

Every piece of math is a call to an op of an earlier stage, loaded through the parts
resolver, so grading stage NN runs the student's kernel of stage NN inside this forward:

    embedding (03), rmsnorm / fused_add_rmsnorm (04), cos_sin_cache / apply_rope_ (05),
    linear (06), prefill_attention (07), silu_mul (in linear_silu_mul) / argmax (08).

A block's output is added to the stream where the next block starts: each block begins with
`add_rmsnorm_linear` (norm_linear.py, given), the residual add, the norm and the block's
first projection in one op, which at one token on an sm_90 GPU is one kernel.

Several sequences can run in one call, packed one after another into the token dimension
(the layout vLLM calls "varlen"). Attention is the only op that needs to know where each
sequence starts; `AttentionMetadata` (attention_metadata.py) tells it, and an attention
*backend* does the work: `PrefillAttention` (stage 07's kernel over the new tokens) here,
stage 09's KV-cache backend later. The same forward serves both, so the model is written once.

`forward` returns hidden states; `compute_logits` turns only the rows that predict a token
into logits. Splitting them lets a serving engine record `forward` in a CUDA graph (stage 10)
and keep the logits, whose rows vary, outside it. Nothing inside `forward` reads a GPU value
on the host: token ids and positions are checked once, by `check_inputs`, when they enter.

There is no KV cache yet: `generate_greedy` recomputes the whole sequence for every new
token (stage 09 fixes that).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from course import ops, parts

_meta = parts.load("08", "attention_metadata")
AttentionMetadata, PrefillAttention = _meta.AttentionMetadata, _meta.PrefillAttention
packed_inputs = _meta.packed_inputs
embedding = ops.get("embedding")
fused_add_rmsnorm = ops.get("fused_add_rmsnorm")
cos_sin_cache, apply_rope_ = ops.get("cos_sin_cache"), ops.get("apply_rope_")
linear = ops.get("linear")
add_rmsnorm_linear = ops.get("add_rmsnorm_linear")
argmax = ops.get("argmax")
rmsnorm = ops.get("rmsnorm")
ids_error = parts.load("03", "embedding").out_of_range_error
positions_error = parts.load("05", "rope").out_of_range_error
if TYPE_CHECKING:   # a stage folder is no package: parts.load names its types
    AttentionBackend = _meta.AttentionBackend
    ModelConfig = parts.load("01", "config").ModelConfig

# The rope table holds one row per position; Llama 3.x claims 131072 positions (32 MiB of
# float32 at head_dim 64), some configs claim millions. Beyond this the table is not built.
MAX_POSITIONS_CAP = 131072


@dataclass
class LayerWeights:
    """One decoder layer's weights, cast to the model's dtype and device."""
    input_norm: torch.Tensor   # [H]
    qkv: torch.Tensor          # [(nh + 2 * nkv) * d, H]: q_proj, k_proj, v_proj rows stacked
    o: torch.Tensor            # [H, nh * d]
    post_norm: torch.Tensor    # [H]
    gate_up: torch.Tensor      # [2 * I, H]: gate_proj rows, then up_proj rows
    down: torch.Tensor         # [H, I]
    qkv_bias: torch.Tensor | None = None   # [(nh + 2 * nkv) * d]: q, k, v biases (Qwen2)
    q_norm: torch.Tensor | None = None     # [d]: RMSNorm weight of every q head (Qwen3)
    k_norm: torch.Tensor | None = None     # [d]: of every k head


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on a GPU (what the kernels take), float32 on a CPU (exact comparisons with HF)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class LlamaModel:
    """A Llama-family decoder (Llama 3.x, SmolLM2, TinyLlama, Mistral, Qwen2 / Qwen2.5,
    Qwen3) built from the stage ops; the family's switches are in the config (config.py).

    config: the ModelConfig of stage 01 (load_config); weights: tensors by their Hugging Face
    names (load_weights of stage 01, or a transformers model's state_dict()); device and
    dtype: where and in what the weights live and the forward runs (default: bf16 on CUDA,
    float32 on CPU). max_positions: the longest sequence the rope table covers (default:
    the config's max_position_embeddings, capped at MAX_POSITIONS_CAP). attention: the
    attention backend (default: PrefillAttention, no cache); see attention_metadata.py.
    """

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                 max_positions: int | None = None, attention: AttentionBackend | None = None):
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype or default_dtype(self.device)
        if self.device.type == "cuda" and self.dtype != torch.bfloat16:
            raise ValueError(f"on CUDA the model runs in bfloat16 (the kernels' dtype), not "
                             f"{self.dtype}")
        self.head_dim = config.head_dim
        self.scale = config.head_dim ** -0.5
        self.max_positions = min(max_positions or config.max_position_embeddings,
                                 config.max_position_embeddings, MAX_POSITIONS_CAP)

        V, H = config.vocab_size, config.hidden_size
        self.embed_tokens = self._weight(weights, "model.embed_tokens.weight", (V, H))
        self.layers = [self._layer(weights, i) for i in range(config.num_hidden_layers)]
        self.final_norm = self._weight(weights, "model.norm.weight", (H,))
        if config.tie_word_embeddings:
            # Tied: one matrix reads tokens in and scores them out; keep one copy of it.
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = self._weight(weights, "lm_head.weight", (V, H))
        self.cos_sin = cos_sin_cache(config.head_dim, config.rope_theta, config.rope_scaling,
                                     self.max_positions, self.device)   # [P, d] float32
        self.attention = attention or PrefillAttention()

    def _weight(self, weights: dict[str, torch.Tensor], name: str,
                shape: tuple[int, ...]) -> torch.Tensor:
        """The checkpoint tensor `name`, checked against `shape`, cast to dtype on device."""
        if name not in weights:
            raise ValueError(f"the checkpoint has no tensor {name!r} (expected shape {shape})")
        w = weights[name]
        if tuple(w.shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(w.shape)}, but config.json "
                             f"implies {shape}")
        return w.detach().to(device=self.device, dtype=self.dtype).contiguous()

    def _layer(self, weights: dict[str, torch.Tensor], i: int) -> LayerWeights:
        c = self.config
        H, I, d = c.hidden_size, c.intermediate_size, c.head_dim
        nh, nkv = c.num_attention_heads, c.num_key_value_heads
        p = f"model.layers.{i}."
        def w(name, shape):
            return self._weight(weights, p + name, shape)
        q = w("self_attn.q_proj.weight", (nh * d, H))
        k = w("self_attn.k_proj.weight", (nkv * d, H))
        v = w("self_attn.v_proj.weight", (nkv * d, H))
        gate = w("mlp.gate_proj.weight", (I, H))
        up = w("mlp.up_proj.weight", (I, H))
        # Fused once, here, so every forward runs one GEMM where it would run three (q, k,
        # v) or two (gate, up): x is read once and each GEMM is big enough to fill the GPU.
        # BEGIN SOLUTION: torch.cat q, k, v rows into qkv and gate, up rows into gate_up
        qkv = torch.cat([q, k, v], dim=0)
        gate_up = torch.cat([gate, up], dim=0)
        # END SOLUTION
        family = {}
        if c.qkv_bias:
            family["qkv_bias"] = torch.cat([w("self_attn.q_proj.bias", (nh * d,)),
                                            w("self_attn.k_proj.bias", (nkv * d,)),
                                            w("self_attn.v_proj.bias", (nkv * d,))])
        if c.qk_norm:
            family["q_norm"] = w("self_attn.q_norm.weight", (d,))
            family["k_norm"] = w("self_attn.k_norm.weight", (d,))
        return LayerWeights(
            input_norm=w("input_layernorm.weight", (H,)),
            qkv=qkv,
            o=w("self_attn.o_proj.weight", (H, nh * d)),
            post_norm=w("post_attention_layernorm.weight", (H,)),
            gate_up=gate_up,
            down=w("mlp.down_proj.weight", (H, I)),
            **family,
        )

    def check_inputs(self, ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Raise IndexError for a token id outside the vocabulary or a position outside the
        rope table. It reads the tensors on the host: call it once where inputs enter (the
        engine does when a request is admitted), never inside a step."""
        for error in (ids_error(ids, self.config.vocab_size),
                      positions_error(positions, self.cos_sin.shape[0])):
            if error is not None:
                raise error

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                return_hidden: bool = False, final_norm: bool = True
                ) -> (torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]
                      | tuple[torch.Tensor, torch.Tensor]):
        """The final hidden states of the step's tokens, after the last RMSNorm.

        ids: [T] int64 new token ids of B sequences packed back to back; positions: [T] int64,
        each token's position in its own sequence; meta: where each sequence starts, and the
        KV cache if any (attention_metadata.py), all on the model's device. The inputs must
        have passed check_inputs: nothing here waits for the GPU.
        Returns [T, H] in the model's dtype, and with return_hidden=True also the residual
        stream after each layer: a list of L tensors [T, H] (what HF's decoder layers output).
        With final_norm=False the last RMSNorm is left to the caller, and forward returns its
        inputs (h, residual), [T, H] each: stream_logits takes them (a decode step's logits).
        """
        if return_hidden and not final_norm:
            raise ValueError("forward: return_hidden needs the final norm (final_norm=True)")
        hidden = []
        h = embedding(ids, self.embed_tokens, check=False)          # [T, H]
        residual = None             # layer 0: the stream starts as the embeddings
        for i, layer in enumerate(self.layers):
            h, residual = self.attention_block(i, layer, h, residual, positions, meta)
            if return_hidden and i > 0:     # the stream after layer i - 1
                hidden.append(residual.clone())
            h, residual = self.mlp_block(layer, h, residual)
        if not final_norm:
            return h, residual
        x, residual = fused_add_rmsnorm(h, residual, self.final_norm, self.config.rms_norm_eps)
        if return_hidden:
            hidden.append(residual.clone())
            return x, hidden
        return x

    __call__ = forward

    def attention_block(self, index: int, layer: LayerWeights, h: torch.Tensor,
                        residual: torch.Tensor | None, positions: torch.Tensor,
                        meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """h: [T, H], the last block's output (at layer 0 the embeddings, residual None);
        residual: [T, H], the stream before it -> (the attention's output projection [T, H],
        the stream h + residual [T, H]).

        index: the layer's number (the backend keeps one KV cache per layer)."""
        c = self.config
        T, d = h.shape[0], self.head_dim
        nh, nkv = c.num_attention_heads, c.num_key_value_heads
        # BEGIN SOLUTION: add_rmsnorm_linear with input_norm and qkv; self.family_qkv_(layer, qkv); q, k, v views; self.rope_attention(index, q, k, v, positions, meta); o linear
        qkv, residual = add_rmsnorm_linear(h, residual, layer.input_norm, c.rms_norm_eps,
                                           layer.qkv)                # [T, (nh + 2 nkv) d]
        self.family_qkv_(layer, qkv)
        q = qkv[:, : nh * d].view(T, nh, d)
        k = qkv[:, nh * d: (nh + nkv) * d].view(T, nkv, d)
        v = qkv[:, (nh + nkv) * d:].view(T, nkv, d)
        attn = self.rope_attention(index, q, k, v, positions, meta)  # [T, nh, d]
        return linear(attn.reshape(T, nh * d), layer.o), residual  # [T, H]
        # END SOLUTION

    def family_qkv_(self, layer: LayerWeights, qkv: torch.Tensor) -> None:
        """In place on the qkv projection [T, (nh + 2 nkv) d], what the family adds before RoPE:
        Qwen2's q, k and v bias; Qwen3's RMSNorm of every q and k head (v is left as it is).
        Llama and Mistral have neither."""
        if layer.qkv_bias is not None:
            qkv.add_(layer.qkv_bias)        # one broadcast add over the three projections
        if layer.q_norm is None:
            return
        c, T, d = self.config, qkv.shape[0], self.head_dim
        nh, nkv = c.num_attention_heads, c.num_key_value_heads
        for start, heads, weight in ((0, nh, layer.q_norm), (nh * d, nkv, layer.k_norm)):
            part = qkv[:, start: start + heads * d]              # [T, heads * d], a view
            # each head is a row of d features; the rmsnorm kernel takes packed rows, so the
            # heads are copied out and the normalized ones back (q, k, v stay one buffer,
            # which stage 14's decode kernel reads k and v from)
            part.copy_(rmsnorm(part.reshape(T * heads, d), weight, c.rms_norm_eps)
                       .view(T, heads * d))

    def rope_attention(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """RoPE on q and k, then the backend's attention: q [T, nh, d], k, v [T, nkv, d]
        (views of the qkv projection) -> [T, nh, d].

        A backend whose `applies_rope` is true (stage 13's paged cache) takes the rotation
        with `rope=(positions, cos_sin)` and does it in the kernel that stores k and v: one
        kernel of a decode step instead of two. The others get q and k rotated here."""
        if getattr(self.attention, "applies_rope", False):
            return self.attention(index, q, k, v, meta, self.scale,
                                  rope=(positions, self.cos_sin))
        apply_rope_(q, k, positions, self.cos_sin, check=False)  # check_inputs did it
        return self.attention(index, q, k, v, meta, self.scale)

    def mlp_block(self, layer: LayerWeights, h: torch.Tensor, residual: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """h: [T, H], the attention's output; residual: [T, H], the stream before it ->
        (down_proj(silu(gate_proj(x)) * up_proj(x)) [T, H] for x = rmsnorm(h + residual),
        the stream h + residual [T, H])."""
        # BEGIN SOLUTION: add_rmsnorm_linear with post_norm and gate_up, silu_mul=True (its linear_silu_mul runs your silu_mul); one linear with down
        act, residual = add_rmsnorm_linear(h, residual, layer.post_norm,
                                           self.config.rms_norm_eps, layer.gate_up,
                                           silu_mul=True)            # [T, I]
        return linear(act, layer.down), residual                    # [T, H]
        # END SOLUTION

    def compute_logits(self, hidden: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """Logits of the chosen rows: hidden [T, H] (forward's output), rows [R] int64 on the
        device (usually meta.last_rows), or None for every row -> [R, V] float32 (R = T).

        Only each sequence's last token predicts the next one, so only those rows go through
        lm_head: an [R, H] x [H, V] product instead of [T, H] x [H, V]. In a decode step every
        row is a sequence's last token; rows=None then skips the copy that selecting them would
        be (one kernel fewer per step).
        """
        # BEGIN SOLUTION: index_select the rows unless rows is None; lm_head linear with out_dtype=torch.float32
        # float32 logits: at logit 25 a bf16 step is 0.125, wider than the gap between a
        # trained model's top two tokens can be (SmolLM2's first answer token: 0.08).
        # One token goes to stage 06's GEMV, as every projection does: on Hopper it streams
        # Llama-3.2-1B's 525 MB at the copy bandwidth, as cuBLAS does, and marks them first out
        # of the L2, where cuBLAS's stream would flush the KV cache from it every step.
        x = hidden if rows is None else hidden.index_select(0, rows)
        return linear(x, self.lm_head, out_dtype=torch.float32)
        # END SOLUTION


    def stream_logits(self, h: torch.Tensor, residual: torch.Tensor | None,
                      pick: torch.Tensor | None = None, host: torch.Tensor | None = None,
                      host_slot: torch.Tensor | None = None) -> torch.Tensor:
        """Every row's logits [T, V] float32 from forward(..., final_norm=False)'s (h,
        residual): compute_logits(forward(...), None) with the final RMSNorm and the lm_head as
        one op (norm_linear.py: for one token on an sm_90 GPU one kernel, the norm in the
        GEMV's prologue; a decode step of one sequence then has no RMSNorm kernel after its
        layers). pick, host, host_slot (optional): each row's greedy token too, as
        argmax(logits, pick, host, host_slot) -- for one token in the same kernel's epilogue,
        so that the step has no argmax kernel either."""
        logits, _ = add_rmsnorm_linear(h, residual, self.final_norm, self.config.rms_norm_eps,
                                       self.lm_head, out_dtype=torch.float32, pick=pick,
                                       host=host, host_slot=host_slot)
        return logits


def check_prompt(model: LlamaModel, prompt_ids: list[int], max_new_tokens: int) -> None:
    """ValueError for an empty prompt or one whose reply would run past the model's
    positions, IndexError for a token id outside the vocabulary: checked once, up front."""
    if len(prompt_ids) == 0:
        raise ValueError("the prompt is empty: greedy decoding needs at least one token")
    if len(prompt_ids) + max_new_tokens - 1 > model.max_positions:
        raise ValueError(f"{len(prompt_ids)} prompt tokens + {max_new_tokens} new ones exceed "
                         f"the model's {model.max_positions} positions")
    model.check_inputs(torch.tensor(prompt_ids, dtype=torch.int64),
                       torch.zeros(1, dtype=torch.int64))


def generate_greedy(model: LlamaModel, prompt_ids: list[int], max_new_tokens: int,
                    eos_ids: Iterable[int] = ()) -> list[int]:
    """Greedy decoding without a KV cache: up to max_new_tokens new token ids.

    Each step runs the whole sequence so far through the model and appends the argmax of
    the last token's logits; it stops after emitting a token in eos_ids (which is returned,
    as transformers' generate returns it). Step n costs a forward over prompt + n tokens,
    so n steps cost O(n^2) token-forwards (and attention O(n^3)): stage 09's KV cache
    makes each step one token.
    """
    check_prompt(model, prompt_ids, max_new_tokens)
    eos = set(eos_ids)
    # BEGIN SOLUTION: packed_inputs of [ids], forward, compute_logits of meta.last_rows, argmax; stop after an eos
    ids = list(prompt_ids)
    out: list[int] = []
    for _ in range(max_new_tokens):
        tokens, positions, meta = packed_inputs([ids], model.device)
        logits = model.compute_logits(model.forward(tokens, positions, meta), meta.last_rows)
        token = int(argmax(logits)[0])
        out.append(token)
        if token in eos:
            break
        ids.append(token)
    return out
    # END SOLUTION

"""Compare our forward pass and greedy decoding with transformers' on the same weights (tests only).

Three measures, each with a message that says where things went apart:

- `rel_error`: the relative Frobenius error ||got - expected|| / ||expected||, one number per
  tensor. A bf16 forward pass rounds every op's output to 8 significant bits; two correct
  implementations that round at slightly different places drift apart by ~1e-3..1e-2 after
  dozens of layers, far less than a real bug (a wrong head mapping or a missing residual
  is an error of order 1).
- `hf_forward`: transformers' logits and every decoder layer's output (the residual stream
  after each layer), captured with forward hooks.
- `assert_greedy_agrees`: greedy tokens must be equal, except where the two implementations
  may legitimately pick differently: at a NEAR-TIE, where transformers' own logits put our
  token within `tie_tolerance` of its choice. After such a step the two continuations
  differ, so the comparison stops there; any other divergence fails.
- `assert_bf16_forward_close`: on the GPU, every layer's output and the logits within
  `bf16_tolerance` of transformers' bf16 forward, its own error against float32 measured.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:   # transformers loads with a test's model; parts.load names a stage's types
    from transformers import LlamaForCausalLM

    from course import parts
    LlamaModel = parts.load("08", "model").LlamaModel


def rel_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """||got - expected||_F / ||expected||_F, computed in float64 (inf if shapes differ)."""
    if got.shape != expected.shape:
        return float("inf")
    g, e = got.detach().double().cpu(), expected.detach().double().cpu()
    if not torch.isfinite(g).all():
        return float("inf")
    return float((g - e).norm() / e.norm().clamp_min(1e-30))


def assert_rel_close(got: torch.Tensor, expected: torch.Tensor, tol: float, what: str,
                     hint: str = "") -> float:
    """Fail unless rel_error(got, expected) <= tol; return the error."""
    err = rel_error(got, expected)
    if err <= tol:
        return err
    lines = [f"{what}: relative error {err:.3g} > tolerance {tol:g}"]
    if got.shape != expected.shape:
        lines.append(f"  expected shape {tuple(expected.shape)}, got {tuple(got.shape)}")
    else:
        g, e = got.detach().double().cpu(), expected.detach().double().cpu()
        bad = ~torch.isfinite(g)
        if bad.any():
            lines.append(f"  {int(bad.sum())} NaN/Inf values, first at "
                         f"{tuple(int(i) for i in bad.nonzero()[0])}")
        else:
            diff = (g - e).abs()
            ix = tuple(int(i) for i in (diff == diff.max()).nonzero()[0])
            lines.append(f"  largest difference at {ix}: expected {e[ix].item():.6g}, "
                         f"got {g[ix].item():.6g}")
    if hint:
        lines.append(f"  likely cause: {hint}")
    raise AssertionError("\n".join(lines))


@torch.no_grad()
def our_logits(model: LlamaModel, prompts: Sequence[Sequence[int]], return_hidden: bool = False
               ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
    """Our model's logits of each prompt's last token, the prompts packed in one forward.

    model: a LlamaModel (stage 08); prompts: lists of token ids. Returns [B, V] float32, and
    with return_hidden=True also the residual stream after each layer ([T, H] each).
    """
    from course import parts
    ids, positions, meta = parts.load("08", "attention_metadata").packed_inputs(prompts,
                                                                                model.device)
    model.check_inputs(ids, positions)
    out = model.forward(ids, positions, meta, return_hidden=return_hidden)
    hidden, layers = out if return_hidden else (out, None)
    logits = model.compute_logits(hidden, meta.last_rows)
    return (logits, layers) if return_hidden else logits


@torch.no_grad()
def hf_forward(model: LlamaForCausalLM, ids: Sequence[int] | torch.Tensor
               ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """transformers' (logits [T, V] float32, [layer output [T, H] for each decoder layer]).

    ids: one sequence (list or 1-D tensor of token ids), positions 0..T-1.
    """
    device = next(model.parameters()).device
    ids = torch.as_tensor(ids, dtype=torch.int64, device=device).reshape(1, -1)
    outputs: list[torch.Tensor] = []

    def hook(_module, _args, out):
        outputs.append((out[0] if isinstance(out, tuple) else out)[0].detach())

    handles = [layer.register_forward_hook(hook) for layer in model.model.layers]
    try:
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
    finally:
        for h in handles:
            h.remove()
    return logits, outputs


@torch.no_grad()
def hf_greedy(model: LlamaForCausalLM, prompt_ids: Sequence[int] | torch.Tensor,
              max_new_tokens: int, eos_ids: Iterable[int] = ()
              ) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' generate(do_sample=False): (new token ids, the logits [V] of each step)."""
    device = next(model.parameters()).device
    ids = torch.as_tensor(prompt_ids, dtype=torch.int64, device=device).reshape(1, -1)
    eos = list(eos_ids)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                         max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                         temperature=None, top_p=None, top_k=None,
                         eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0,
                         output_logits=True, return_dict_in_generate=True)
    new = out.sequences[0, ids.shape[1]:].tolist()
    return new, [step[0].float() for step in out.logits]


def tie_tolerance(logits: torch.Tensor, rel_tol: float) -> float:
    """How far apart two logits may be and still swap places under a relative error rel_tol.

    ||ours - theirs|| <= rel_tol * ||theirs|| allows a per-logit error of rel_tol * rms(logits)
    typically; the difference of two logits moves by up to about 4 times that.
    """
    return 4.0 * rel_tol * float(logits.double().pow(2).mean().sqrt())


def assert_greedy_agrees(ours: list[int], theirs: list[int], their_logits: list[torch.Tensor],
                         rel_tol: float, what: str = "greedy tokens") -> str:
    """Fail unless `ours` equals transformers' tokens `theirs` up to a proven near-tie.

    their_logits[i] are transformers' logits at step i. A divergence at step i is a near-tie
    when their_logits[i][theirs[i]] - their_logits[i][ours[i]] <= tie_tolerance(their_logits[i],
    rel_tol): by transformers' own numbers our token was as good as its choice, within the
    error rel_tol allows. Returns a one-line report of what was compared.
    """
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a == b:
            continue
        logits = their_logits[i]
        gap = float(logits[b] - logits[a])
        top2 = logits.topk(2).values
        tol = tie_tolerance(logits, rel_tol)
        head = (f"{what}: first difference at step {i}: transformers picked {b}, we picked "
                f"{a}; by transformers' logits {b} leads {a} by {gap:.4g} (its top-2 gap is "
                f"{float(top2[0] - top2[1]):.4g}), tie tolerance {tol:.4g}")
        if gap <= tol:
            return f"{head}: a near-tie, so the continuations may differ; {i} steps equal"
        raise AssertionError(
            f"{head}: NOT a near-tie.\n  ours:   {ours}\n  theirs: {theirs}\n"
            "  likely cause: the logits differ by more than rounding (check the per-layer "
            "comparison), or the token picked is not the argmax of the last token's logits")
    if len(ours) != len(theirs):
        raise AssertionError(f"{what}: the same first {min(len(ours), len(theirs))} tokens, "
                             f"but we generated {len(ours)} and transformers {len(theirs)}.\n"
                             f"  ours:   {ours}\n  theirs: {theirs}\n  likely cause: stopping "
                             "(stop after emitting an end-of-sequence id, or at max tokens)")
    return f"{what}: all {len(ours)} tokens equal"


BF16_TOL = 2e-2


def bf16_tolerance(noise: float) -> float:
    """The error allowed between two bf16 forwards: each is about `noise` (transformers' bf16
    error against its float32 forward of the same weights) from the float32 result, so they
    are within 2 * noise of each other (the triangle inequality); never below BF16_TOL."""
    return max(BF16_TOL, 2 * noise)


def assert_bf16_forward_close(name: str, ours: LlamaModel, hf: LlamaForCausalLM,
                              hf32: LlamaForCausalLM, ids: Sequence[int], hint: str = "") -> str:
    """Our bf16 model's residual stream after every layer and last-token logits against
    transformers' bf16 `hf`, each within bf16_tolerance of the noise measured against `hf32`
    (the same weights in float32). Returns a one-line report: per layer, our error / noise."""
    logits, hidden = our_logits(ours, [ids], return_hidden=True)
    hf_logits, hf_hidden = hf_forward(hf, ids)
    f32_logits, f32_hidden = hf_forward(hf32, ids)
    assert len(hidden) == len(hf_hidden) == ours.config.num_hidden_layers
    report = []
    for i, (a, b, truth) in enumerate(zip(hidden, hf_hidden, f32_hidden)):
        noise = rel_error(b, truth)
        err = assert_rel_close(a, b, bf16_tolerance(noise),
                               f"{name}: residual stream after layer {i}",
                               hint=f"transformers' own bf16 error here is {noise:.2e}, ours vs "
                                    f"float32 is {rel_error(a, truth):.2e}{hint}")
        report.append(f"{i}:{err:.1e}/{noise:.1e}")
    noise = rel_error(hf_logits[-1:], f32_logits[-1:])
    err = assert_rel_close(logits, hf_logits[-1:], bf16_tolerance(noise), f"{name}: logits")
    return (f"{name}: layer: ours-vs-transformers / transformers-bf16-vs-fp32: "
            f"{' '.join(report)}; logits {err:.1e}/{noise:.1e}")

"""The known mistakes of stage 12's prefill kernels, as course.testing.diagnose patterns.

out: [Tq, n_heads, head_dim] is checked as rows of (token, head), so a failure names the
tokens and heads that are wrong, the case's shape, and -- when the output is what a known
mistake computes (the causal mask one key off, no mask, the diagonal at the start of the
keys, the wrong KV head, the rescaling by exp(m_old - m_new) left out, the values read from
k) or the wrong rows are the ones such a mistake spoils (rows past the first query tile, the
last partial tile, the sequences after the first) -- that mistake:

    attention_mistakes.assert_attention(out, q, k, v, lens_q, lens_k, scale,
                                        what="flash_attention_simple", tile_rows=16)
"""
from __future__ import annotations

import math

import torch

from course.testing import diagnose

BLOCK_KEYS = 64  # the kernels' key tile
# A mask one key off also differs from its plain computation at the rows whose extra key
# lies in a tile the kernel never loads: a few rows of a long sequence.
EDGE_ROWS = 0.05


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens_q: list[int],
              lens_k: list[int], scale: float, *, diagonal: float = 0.0, aligned_end: bool = True,
              kv_of_head=None, rescale: str = "both", unmasked_rows: int = 0) -> torch.Tensor:
    """Causal attention of packed sequences in float32 (CPU), with a mistake's knobs:
    diagonal (a query sees keys up to its position + diagonal; inf: no mask), aligned_end
    (False: query i at key position i), kv_of_head (h -> its KV head), rescale ("both", or
    which of "l", "o", "none" the online softmax rescales, over 64-key tiles), unmasked_rows
    (> 0: no mask, but a block of that many rows loads only the key tiles its last row needs).
    Returns [Tq, n_heads, head_dim] float32."""
    q, k, v = (t.detach().float().cpu() for t in (q, k, v))
    n_heads, n_kv = q.shape[1], k.shape[1]
    kv = kv_of_head or (lambda h: h // (n_heads // n_kv))
    heads = torch.tensor([kv(h) for h in range(n_heads)])
    out = torch.zeros(q.shape)
    sq = sk = 0
    for lq, lk in zip(lens_q, lens_k):
        qs = q[sq:sq + lq].transpose(0, 1) * scale                  # [H, lq, d]
        ks = k[sk:sk + lk][:, heads].transpose(0, 1)                  # [H, lk, d]
        vs = v[sk:sk + lk][:, heads].transpose(0, 1)
        qpos = torch.arange(lq) + (lk - lq if aligned_end else 0)
        hidden = torch.arange(lk)[None, :] > qpos[:, None] + diagonal
        if unmasked_rows:
            last = (torch.arange(lq) // unmasked_rows + 1) * unmasked_rows - 1 + (lk - lq)
            tiles_end = (last.clamp(max=lk - 1) // BLOCK_KEYS + 1) * BLOCK_KEYS
            hidden = torch.arange(lk)[None, :] >= tiles_end[:, None]
        m = torch.full((n_heads, lq, 1), -math.inf)
        l = torch.zeros(n_heads, lq, 1)
        o = torch.zeros(qs.shape)
        for k0 in range(0, lk, BLOCK_KEYS):
            s = (qs @ ks[:, k0:k0 + BLOCK_KEYS].transpose(1, 2)).masked_fill(
                hidden[:, k0:k0 + BLOCK_KEYS], -math.inf)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            base = m_new.masked_fill(m_new == -math.inf, 0.0)
            alpha = torch.exp(m - base)
            p = torch.exp(s - base)
            l = (alpha * l if rescale in ("both", "l") else l) + p.sum(-1, keepdim=True)
            o = (alpha * o if rescale in ("both", "o") else o) + p @ vs[:, k0:k0 + BLOCK_KEYS]
            m = m_new
        out[sq:sq + lq] = torch.where(l > 0, o / l, 0.0).transpose(0, 1)
        sq, sk = sq + lq, sk + lk
    return out


def variants(q, k, v, lens_q, lens_k, scale, tile_rows: int) -> list[diagnose.Variant]:
    """What the usual mistakes write (float32, [Tq, n_heads, head_dim]); tile_rows: the
    query rows of the kernel's block."""
    def run(**mistake) -> torch.Tensor:
        return attention(q, k, v, lens_q, lens_k, scale, **mistake)

    n_heads, n_kv = q.shape[1], k.shape[1]
    found = [
        diagnose.Variant(run(diagonal=1), "the causal mask is one key off: each row sees one "
                         "key too many (a query at position p sees keys 0 .. p: kpos <= qpos)",
                         slack=EDGE_ROWS),
        diagnose.Variant(run(diagonal=-1), "the causal mask is one key off: each row sees one "
                         "key too few, not its own (a query at position p sees keys 0 .. p: "
                         "kpos <= qpos, not <)", slack=EDGE_ROWS),
        diagnose.Variant(run(diagonal=math.inf), "no causal mask: every row sees every key of "
                         "its sequence, its future too"),
        diagnose.Variant(run(unmasked_rows=tile_rows), "no causal mask: every row sees every "
                         "key of the tiles its block loads, its future too"),
        diagnose.Variant(run(rescale="none"), "the running state is not rescaled: when a tile "
                         "raises the max m, l and o must be multiplied by exp(m_old - m_new)"),
        diagnose.Variant(run(rescale="l"), "o is not rescaled: when a tile raises the max m, o "
                         "(not only l) must be multiplied by exp(m_old - m_new)"),
        diagnose.Variant(run(rescale="o"), "l is not rescaled: when a tile raises the max m, l "
                         "(not only o) must be multiplied by exp(m_old - m_new)"),
        diagnose.Variant(attention(q, k, k, lens_q, lens_k, scale), "the scores are right but "
                         "the values are not: p was multiplied by k's rows, not v's"),
        diagnose.Variant(attention(q, k, v, lens_q, lens_k, 1.0), "the scores were not scaled: "
                         "s = scale * q . k (scale = 1 / sqrt(head_dim))"),
    ]
    if any(a != b for a, b in zip(lens_q, lens_k)):
        found.append(diagnose.Variant(run(aligned_end=False), "the causal diagonal starts at "
                     "the first key: with more keys than queries (a cached prefix), query i sits "
                     "at key position i + len_k - len_q"))
    if 1 < n_kv < n_heads:
        found.append(diagnose.Variant(run(kv_of_head=lambda h: h % n_kv), "the wrong KV head: "
                     "query head h reads KV head h / (n_heads / n_kv_heads), not h % n_kv_heads"))
    return found


def suspects(lens_q: list[int], lens_k: list[int], n_heads: int,
             tile_rows: int) -> list[diagnose.Suspect]:
    """(token, head) row sets a known mistake spoils, and no others."""
    later_tiles, last_partial, later_seqs, past_first = (
        torch.zeros(sum(lens_q), n_heads, dtype=torch.bool) for _ in range(4))
    start = 0
    for i, (n, n_k) in enumerate(zip(lens_q, lens_k)):
        # rows whose last key lies in a later key tile than their block's first row's
        pos = torch.arange(n) + (n_k - n)
        first = pos - torch.arange(n) % tile_rows
        past_first[start:start + n] = (pos // BLOCK_KEYS > first // BLOCK_KEYS)[:, None]
        later_tiles[start + tile_rows:start + n] = True
        if n % tile_rows and n > tile_rows:
            last_partial[start + n // tile_rows * tile_rows:start + n] = True
        if i > 0:
            later_seqs[start:start + n] = True
        start += n
    found = []
    if past_first.any():
        found.append(diagnose.Suspect(
            past_first, "the rows whose keys reach into a later key tile than their block's "
                        "first row's",
            "a block needs the key tiles up to its LAST row's position (first row + rows - 1 "
            "+ len_k - len_q), not its first row's"))
    if later_tiles.any():
        found.append(diagnose.Suspect(
            later_tiles, f"rows past each sequence's first tile of {tile_rows} queries",
            "a block's first query row is blockIdx.z * rows per block; its key position adds "
            "len_k - len_q; a block needs the key tiles up to its LAST row's position"))
    if last_partial.any():
        found.append(diagnose.Suspect(
            last_partial, "the rows of the last, partial query tile",
            "rows past the sequence's end are padding: skip them (row < len_q), and stop the "
            "key tiles at the last real row's position, not the tile's"))
    if later_seqs.any():
        found.append(diagnose.Suspect(
            later_seqs, "the sequences after the first",
            "sequence s's queries start at cu_seqlens_q[s] and its keys at cu_seqlens_k[s] "
            "(two offsets: a sequence may have more keys than queries)"))
    return found


QUARTER_SUM = ("the output is about 4x too large: a lane's l sums only its own 2 columns of each "
               "key tile; add the row's 4 lanes together (__shfl_xor_sync 1 and 2) before dividing")


def _about_four_times(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether got is typically 3-5 times expected (one lane's share of l: not exactly 4x)."""
    e = expected.float()
    ratio = (got.float().abs() / e.abs().clamp_min(1e-3))[e.abs() > 0.05]
    return bool(ratio.numel()) and 3.0 < float(ratio.nanmedian()) < 5.0


def assert_attention(out: torch.Tensor, q, k, v, lens_q: list[int], lens_k: list[int],
                     scale: float, *, what: str, tile_rows: int, hint: str = "") -> None:
    """out: [Tq, n_heads, head_dim] bf16 against the float32 reference, rounded to bf16; a
    failure names the shape, the wrong (token, head) rows and the mistake their pattern
    points to (else `hint`)."""
    expected = attention(q, k, v, lens_q, lens_k, scale).to(out.dtype)
    if not diagnose.wrong_rows(out.cpu(), expected, 2).any():
        return  # right: the mistakes' outputs are computed only for a wrong one
    n_heads, n_kv, d = q.shape[1], k.shape[1], q.shape[2]
    diagnose.assert_close(
        out.cpu(), expected, what=what, row_names=("token", "head"),
        hint=QUARTER_SUM if _about_four_times(out.cpu(), expected) else hint,
        shape=diagnose.shape(batch=len(lens_q), query_lengths=lens_q, key_lengths=lens_k,
                             heads=f"{n_heads}/{n_kv}", head_dim=d, rows_per_block=tile_rows),
        variants=[diagnose.Variant(None if m.output is None else m.output.to(out.dtype), m.cause,
                                   m.slack)
                  for m in variants(q, k, v, lens_q, lens_k, scale, tile_rows)],
        suspects=suspects(lens_q, lens_k, n_heads, tile_rows))

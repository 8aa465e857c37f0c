"""Which stage provides which op: the one table the engine, the model and the benchmarks use.

    from course import ops
    rmsnorm = ops.get("rmsnorm")      # stage 04's rmsnorm, the student's or the reference's

Each op lives in a module of a stage (`solutions/NN_name/<module>.py`, mirrored by the
student's copy); `get` loads it through the parts resolver, so grading stage NN runs the
student's op of stage NN wherever the engine calls it. A later stage may provide a faster
op under the same name (stage 12's tiled prefill attention replaces stage 07's): the first
provider in the list whose stage is ready wins.
"""
from __future__ import annotations

from collections.abc import Callable

from course import manifest, parts

# op name -> (stage id, module), or a list of them, the preferred first
OPS: dict[str, tuple[str, str] | list[tuple[str, str]]] = {
    "embedding": ("03", "embedding"),
    "rmsnorm": ("04", "rmsnorm"),
    "fused_add_rmsnorm": ("04", "rmsnorm"),
    "cos_sin_cache": ("05", "rope_tables"),
    "apply_rope_": ("05", "rope"),
    "linear": ("06", "linear"),
    "prefill_attention": [("12", "flash_attention"), ("07", "attention")],
    "silu_mul": ("08", "activation"),
    "argmax": ("08", "argmax"),
    "decode_attention": ("09", "decode_attention"),
    "cache_write": ("13", "cache_write"),
    "paged_decode_attention": ("14", "paged_attention"),
}


def provider(name: str) -> tuple[str, str]:
    """(stage id, module) that provides op `name`: the first ready one of its providers."""
    if name not in OPS:
        raise KeyError(f"no op named {name!r}; the ops are: {', '.join(sorted(OPS))}")
    choices = OPS[name] if isinstance(OPS[name], list) else [OPS[name]]
    for stage_id, module in choices:
        if manifest.find(stage_id).ready:
            return stage_id, module
    raise KeyError(f"op {name!r} comes from stage {choices[-1][0]}, which is not available yet")


def get(name: str) -> Callable:
    """The op `name`, from the student's or the reference's module as the selection says."""
    stage_id, module = provider(name)
    return getattr(parts.load(stage_id, module), name)

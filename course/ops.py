"""Which stage provides which op: the one table the engine, the model and the benchmarks use.

    from course import ops
    rmsnorm = ops.get("rmsnorm")      # stage 04's rmsnorm, the student's or the reference's

Each op lives in a module of a stage (`solutions/NN_name/<module>.py`, mirrored by the
student's copy); `get` loads it through the parts resolver, so grading stage NN runs the
student's op of stage NN wherever the engine calls it.
"""
from __future__ import annotations

from collections.abc import Callable

from course import parts

# op name -> (stage id, module)
OPS: dict[str, tuple[str, str]] = {
    "embedding": ("03", "embedding"),
    "rmsnorm": ("04", "rmsnorm"),
    "fused_add_rmsnorm": ("04", "rmsnorm"),
    "cos_sin_cache": ("05", "rope_tables"),
    "apply_rope_": ("05", "rope"),
    "linear": ("06", "linear"),
    "prefill_attention": ("07", "attention"),
    "silu_mul": ("08", "activation"),
    "argmax": ("08", "argmax"),
    "decode_attention": ("09", "decode_attention"),
}


def stage_of(name: str) -> str:
    """The id of the stage whose op `name` is."""
    if name not in OPS:
        raise KeyError(f"no op named {name!r}; the ops are: {', '.join(sorted(OPS))}")
    return OPS[name][0]


def get(name: str) -> Callable:
    """The op `name`, from the student's or the reference's module as the selection says."""
    stage_id = stage_of(name)
    return getattr(parts.load(stage_id, OPS[name][1]), name)

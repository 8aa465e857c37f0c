"""Which stage provides which op: the one table the engine, the model and the benchmarks use.

    from course import ops
    rmsnorm = ops.get("rmsnorm")      # stage 04's rmsnorm, the student's or the reference's

Each op lives in a module of a stage (`solutions/NN_name/<module>.py`, mirrored by the
student's copy); `get` loads it through the parts resolver, so grading stage NN runs the
student's op of stage NN wherever the engine calls it. A later stage may provide a faster
op under the same name (stage 12's tiled prefill attention replaces stage 07's): the first
provider in the list whose stage is ready, and whose kernels the library was built for, wins.
A stage whose min_cc is above the build target (a T4, sm_75: no stage 12 or 14) is passed over
with one line on stderr, e.g.

    prefill_attention: stage 12 needs compute capability 8.0; the kernels are built for 7.5, so stage 07's is used
"""
from __future__ import annotations

import sys
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
    "linear_silu_mul": ("08", "activation"),
    "add_rmsnorm_linear": ("08", "norm_linear"),
    "argmax": ("08", "argmax"),
    "decode_attention": ("09", "decode_attention"),
    "cache_write": ("13", "cache_write"),
    "rope_cache_write": ("13", "cache_write"),
    "paged_decode_attention": ("14", "paged_attention"),
}

# what the callers do when no stage provides an op here (said in the one line)
WITHOUT = {
    "paged_decode_attention": "the paged cache gathers its blocks for stage 09's decode_attention "
                              "(solutions/13_paged_kv_cache/paged_cache.py)",
}


_said: set[str] = set()


def build_target() -> tuple[int, int] | None:
    """The compute capability the kernels are built for (course/build.py), None without torch."""
    try:
        from course import build
        return build.target_capability()
    except ImportError:
        return None


def not_built_here(stage: manifest.Stage) -> str | None:
    """Why the kernel library holds none of this stage's kernels ("stage 12 needs compute
    capability 8.0; the kernels are built for 7.5"), or None when it holds them."""
    target = build_target() if stage.min_cc else None
    if target is None or stage.runs_on(target):
        return None
    return (f"stage {stage.id} needs compute capability {stage.min_cc}; the kernels are built "
            f"for {target[0]}.{target[1]}")


def provider(name: str) -> tuple[str, str]:
    """(stage id, module) that provides op `name`: the first of its providers whose stage is
    ready and whose kernels are built here (see the top)."""
    if name not in OPS:
        raise KeyError(f"no op named {name!r}; the ops are: {', '.join(sorted(OPS))}")
    choices = OPS[name] if isinstance(OPS[name], list) else [OPS[name]]
    passed_over = ""
    for stage_id, module in choices:
        stage = manifest.find(stage_id)
        if not stage.ready:
            continue
        why = not_built_here(stage)
        if why:
            passed_over = passed_over or f"{name}: {why}"
            continue
        if passed_over:
            _say(f"{passed_over}, so stage {stage_id}'s is used")
        return stage_id, module
    if passed_over:
        _say(f"{passed_over}, so {WITHOUT.get(name, 'no stage provides it here')}")
        raise KeyError(f"{passed_over}, and no other stage provides it")
    raise KeyError(f"op {name!r} comes from stage {choices[-1][0]}, which is not available yet")


def _say(line: str) -> None:
    """Once per process: the engine asks for its ops again for every model it builds."""
    if line not in _said:
        _said.add(line)
        print(line, file=sys.stderr, flush=True)


def get(name: str) -> Callable:
    """The op `name`, from the student's or the reference's module as the selection says."""
    stage_id, module = provider(name)
    return getattr(parts.load(stage_id, module), name)


class FirstWritten:
    """A two-part stage's kernel: the fast one once the student has written it, else the simple.

    Stages 06, 12 and 14 ask for a simple, correct kernel first and a fast one second; the
    engine runs the fastest one present. A kernel whose launcher is still a skeleton raises
    NotImplementedError("TODO stage NN: ...") before it launches anything, so the first call
    finds out, says so in one line on stderr, and every later call goes straight to the simple
    kernel (no try at every step, and the engine's warm-up makes that first call before any
    CUDA graph is captured).

        decode = FirstWritten("paged attention", fast_kernel, simple_kernel)
        decode(q, k_cache, ...)   # fast_kernel(...), or simple_kernel(...) while fast is TODO
    """

    def __init__(self, what: str, *kernels: Callable) -> None:
        if not kernels:
            raise ValueError(f"{what}: no kernel to call")
        self.what = what
        self._kernels = list(kernels)

    def __call__(self, *args, **kwargs):
        while True:
            try:
                return self._kernels[0](*args, **kwargs)
            except NotImplementedError as todo:
                if len(self._kernels) == 1 or "TODO" not in str(todo):
                    raise
                self._kernels.pop(0)
                _say(f"{self.what}: {todo}; the simpler kernel of the stage runs instead")

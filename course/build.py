"""Build the CUDA kernels into one shared library and load it as `torch.ops.tinyvllm`.

Why not `cpp_extension.load`: it names the module in every compile command, so any change
rebuilds every object. Here each source compiles to its own object, cached under a hash of
its bytes, the shared headers and the flags, so editing one kernel recompiles that kernel
only and relinks (a second). Student and reference copies hash differently and never mix.
The kernel files (.cu) include no torch headers, which keeps their compile short; the
torch-facing bindings (*_binding.cpp) change rarely and are compiled once per machine.
`torch.utils.cpp_extension` supplies the include and library paths of the torch in use.

Architectures: "80" (or "8.0", "sm_80") builds machine code for sm_80; "compute_75" builds PTX
only, which the driver compiles for the GPU at load (how an sm_90 machine runs the build a T4
would get). A stage whose `min_cc` is above the lowest target is left out of the library
(parts.kernel_sources), and course/ops.py then takes the op from another stage.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from course.manifest import ROOT

if TYPE_CHECKING:   # torch loads when a build needs it
    from torch._ops import _OpNamespace

HEADERS = ROOT / "course" / "cuda"
ARCHS_ENV = "TINYVLLM_CUDA_ARCHS"
CACHE_ENV = "TINYVLLM_CACHE"
DEFAULT_ARCHS = ("80", "90")


class BuildError(RuntimeError):
    """A kernel did not compile or link; the message is the compiler's, cut to the errors."""


class ToolchainMissing(BuildError):
    """No CUDA toolkit, or a CPU-only torch: nothing could be compiled on this machine."""


def cache_dir() -> Path:
    base = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "tiny-vllm"
    return Path(base) / "build"


@lru_cache(maxsize=1)
def cuda_home() -> Path:
    """The CUDA toolkit: $CUDA_HOME, else the real directory behind `nvcc` on PATH."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent.parent)
        # A wrapper script (`exec /usr/local/cuda-13.0/bin/nvcc "$@"`) hides the toolkit.
        text = Path(nvcc).read_bytes()[:4096]
        if b"exec " in text:
            candidates += [Path(m.decode()).parent.parent for m in re.findall(rb"exec\s+(\S+nvcc)", text)]
    candidates += ["/usr/local/cuda", *sorted(Path("/usr/local").glob("cuda-*"), reverse=True)]
    for c in candidates:
        if c and (Path(c) / "bin" / "nvcc").is_file() and _find_lib(Path(c), "libcudart.so"):
            return Path(c)
    raise ToolchainMissing("no CUDA toolkit found (looked for bin/nvcc beside lib/libcudart.so): "
                     "install the CUDA toolkit or set CUDA_HOME to its directory")


def _find_lib(home: Path, name: str) -> Path | None:
    for sub in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"):
        hits = sorted((home / sub).glob(name + "*")) if (home / sub).is_dir() else []
        if hits:
            return hits[0]
    return None


@lru_cache(maxsize=1)
def _torch_paths() -> tuple[list[Path], list[Path]]:
    """Include and library directories: torch's, the toolkit's and torch's nvidia wheels'."""
    import torch
    if torch.version.cuda is None:
        raise ToolchainMissing(f"torch {torch.__version__} is a CPU-only build; building kernels needs "
                         "a CUDA build of torch (pip install torch==2.14.1)")
    os.environ.setdefault("CUDA_HOME", str(cuda_home()))
    # Without a GPU it warns "No CUDA runtime is found" on import: expected here, not news.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    from torch.utils import cpp_extension
    includes = [Path(p) for p in cpp_extension.include_paths(device_type="cuda")]
    libs = [Path(p) for p in cpp_extension.library_paths(device_type="cuda")]
    # cublas_v2.h and libcublas.so.* come with torch's nvidia pip packages, not the toolkit.
    nvidia = Path(torch.__file__).parent.parent / "nvidia"
    includes += sorted(nvidia.glob("*/include"))
    libs += sorted(nvidia.glob("*/lib"))
    return includes, libs


def archs() -> list[str]:
    """Compute capabilities to build for: $TINYVLLM_CUDA_ARCHS, else the local GPU, else 80 and 90."""
    env = os.environ.get(ARCHS_ENV)
    if env:
        return [normalize_arch(a) for a in re.split(r"[;, ]+", env) if a.strip()]
    import torch
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return [f"{major}{minor}"]
    return list(DEFAULT_ARCHS)


def normalize_arch(text: str) -> str:
    """'8.0', 'sm_80' and '80' -> '80' (machine code); 'compute_75' stays (PTX only)."""
    m = re.fullmatch(r"(compute_|sm_)?(\d{1,2})\.?(\d)([af]?)", text.strip().lower())
    if not m:
        raise BuildError(f"{text!r} is not a CUDA architecture ({ARCHS_ENV}): write e.g. 80, 8.0, "
                         "sm_80, or compute_75 for PTX that the driver compiles at load")
    ptx, major, minor, suffix = m.groups()
    return f"{'compute_' if ptx == 'compute_' else ''}{major}{minor}{suffix}"


def arch_capability(arch: str) -> tuple[int, int]:
    """'75' and 'compute_75' -> (7, 5); '90a' -> (9, 0); '120' -> (12, 0)."""
    digits = re.match(r"\d+", normalize_arch(arch).removeprefix("compute_")).group()
    return int(digits[:-1]), int(digits[-1])


def target_capability(arch_list: list[str] | None = None) -> tuple[int, int]:
    """The lowest capability built for: every kernel in the library must run there."""
    return min(arch_capability(a) for a in (arch_list or archs()))


def gencode(arch: str) -> str:
    """nvcc's flag for one architecture: SASS for '80', PTX only for 'compute_75'."""
    arch = normalize_arch(arch)
    if arch.startswith("compute_"):
        return f"-gencode=arch={arch},code={arch}"
    return f"-gencode=arch=compute_{arch},code=sm_{arch}"


def _compile_command(src: Path, obj: Path, arch_list: list[str]) -> list[str]:
    includes, _ = _torch_paths()
    if src.suffix == ".cu":
        # Kernels see the toolkit, the cublas headers and course/cuda, never torch.
        cmd = [str(cuda_home() / "bin" / "nvcc"), "-c", str(src), "-o", str(obj), "-std=c++17",
               "-O3", "-lineinfo", "-Xcompiler", "-fPIC", "--expt-relaxed-constexpr",
               "-I", str(HEADERS), *(f"-I{p}" for p in includes if "torch" not in p.parts)]
        cmd += [gencode(a) for a in arch_list]
        return cmd
    import torch
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return ["c++", "-c", str(src), "-o", str(obj), "-std=c++20", "-O2", "-fPIC",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-I", str(HEADERS), *(f"-I{p}" for p in includes)]


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(hashlib.sha256(p).digest())
    return h.hexdigest()[:20]


@lru_cache(maxsize=1)
def _header_bytes() -> bytes:
    return b"".join(p.read_bytes() for p in sorted(HEADERS.glob("*")) if p.is_file())


def compile_object(src: Path, arch_list: list[str]) -> Path:
    """Compile one source to a cached object; raise BuildError with the compiler's errors."""
    import torch
    if not src.is_file():
        raise BuildError(f"{src} is missing: every kernel source of every stage is needed to build")
    probe = _compile_command(src, Path("OBJ"), arch_list)
    key = _digest(src.read_bytes(), _header_bytes(), " ".join(probe).encode(),
                  torch.__version__.encode())
    obj = cache_dir() / "obj" / f"{src.stem}-{key}.o"
    if obj.exists():
        return obj
    obj.parent.mkdir(parents=True, exist_ok=True)
    tmp = obj.with_suffix(f".{os.getpid()}.tmp.o")
    proc = subprocess.run(_compile_command(src, tmp, arch_list), capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise BuildError(f"{src} did not compile:\n{compiler_errors(proc.stdout + proc.stderr)}")
    tmp.replace(obj)
    return obj


def compiler_errors(log: str, limit: int = 25) -> str:
    """The error lines of a compiler log (with a line of context each), not the whole log."""
    lines = log.splitlines()
    rows: dict[int, None] = {}      # line numbers in order, each once (contexts overlap)
    for i, line in enumerate(lines):
        if re.search(r"\berror\b", line, re.IGNORECASE):
            rows.update(dict.fromkeys(range(i, min(i + 3, len(lines)))))
    keep = [lines[i] for i in rows] or lines[-limit:]
    cut = f"\n... ({len(keep) - limit} more lines)" if len(keep) > limit else ""
    return "\n".join(keep[:limit]) + cut


def link(objects: list[Path]) -> Path:
    """Link objects into a cached shared library; rpaths make it load without LD_LIBRARY_PATH."""
    key = _digest(*(o.name.encode() for o in objects))
    lib = cache_dir() / "lib" / f"tinyvllm_kernels-{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    _, libdirs = _torch_paths()
    cublas = next((hit for d in libdirs for hit in sorted(d.glob("libcublas.so*"))), None)
    if cublas is None:
        raise BuildError("libcublas.so was not found beside torch or the CUDA toolkit")
    cudart = next((hit for d in libdirs for hit in sorted(d.glob("libcudart.so*"))), None)
    tmp = lib.with_suffix(f".{os.getpid()}.tmp.so")
    cmd = ["c++", "-shared", "-o", str(tmp), *map(str, objects), str(cublas), str(cudart),
           *(f"-L{d}" for d in libdirs), *(f"-Wl,-rpath,{d}" for d in libdirs),
           "-lc10", "-ltorch_cpu", "-lc10_cuda", "-ltorch_cuda"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"linking the kernels failed:\n{compiler_errors(proc.stdout + proc.stderr)}")
    tmp.replace(lib)
    return lib


def build(sources: list[Path], arch_list: list[str] | None = None) -> Path:
    """Compile every source (in parallel, cached) and link; return the shared library."""
    arch_list = [normalize_arch(a) for a in arch_list] if arch_list else archs()
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        futures = [pool.submit(compile_object, s, arch_list) for s in sources]
        errors, objects = [], []
        for f in futures:
            try:
                objects.append(f.result())
            except BuildError as e:
                errors.append(str(e))
    if errors:
        raise BuildError("\n\n".join(errors))
    return link(objects)


_loaded: Path | None = None


def load_kernels(sources: list[Path]) -> _OpNamespace:
    """Build (or reuse) the library for these sources and return `torch.ops.tinyvllm`."""
    global _loaded
    import torch
    lib = build(sources)
    if _loaded is None:
        torch.ops.load_library(str(lib))
        _loaded = lib
    elif _loaded != lib:
        raise BuildError("another build of the kernels is already loaded in this process; "
                         "the grader runs each selection in its own process")
    return torch.ops.tinyvllm

"""Run a kernel file of the course on the CPU: a developer's check of kernel logic without a GPU.

    lib = cuda_emulator.build(Path("solutions/14_paged_kernel/paged_attention.cu"), SHIM)
    lib.emu_paged(...)          # SHIM: extern "C" functions that call the file's launcher

The .cu file is compiled by g++ with include/emu.h first (threads as fibers, warp collectives
as rendezvous: see its header for what is and is not emulated). Inline PTX lives only in
course/cuda's headers: include/mma.cuh stands in for the tensor-core wrappers, include/pdl.cuh
for the launches, and the others take their plain C++ path off the GPU (no __CUDA_ARCH__).
The shim calls
`emu::clear_error()` first and returns `emu::error()` when a launch deadlocked. Used by
tests/test_emulated_kernels.py (in CI, on the reference kernels) and by `python3 -m grader
emulate NN` (on a student's); needs g++ and the CUDA headers (course.build finds them).
"""
from __future__ import annotations

import ctypes
import hashlib
import re
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent

def preprocess(src: str) -> str:
    """The kernel file as host C++: dynamic shared memory from the emulator, <<<...>>>
    launches through it. EDG (nvcc) accepts `x.f<N>(...)` on an array element of a dependent
    type where g++ needs `x.template f<N>(...)`."""
    src = re.sub(r"extern __shared__ (?:__align__\(\d+\) )?(\w+) (\w+)\[\];",
                 r"\1* \2 = reinterpret_cast<\1*>(emu::g.dyn_smem.data());", src)
    src = re.sub(r"([\w:]+(?:<[^<>;]*>)?)<<<(.*?)>>>\((.*?)\);",
                 r"emu::launch_stream(\1, \2, \3);", src, flags=re.S)
    for cuda, emu in (("cudaFuncSetAttribute(", "func_set_attribute("),
                      ("cudaGetDevice(", "get_device("),
                      ("cudaDeviceGetAttribute(", "device_get_attribute("),
                      ("tvllm_sm_count(", "sm_count("),
                      ("cudaOccupancyMaxActiveBlocksPerMultiprocessor(", "occupancy("),
                      ("cudaFuncGetAttributes(", "func_get_attributes("),
                      ("cudaLaunchKernelEx(", "launch_ex(")):
        src = src.replace(cuda, "emu::" + emu)
    return re.sub(r"\.rescale<", ".template rescale<", src)


def build(kernel: Path, shim: str, common: Path | None = None) -> ctypes.CDLL:
    """Compile `kernel` (a .cu of solutions/ or a student's stage folder) with `shim` appended
    into a shared library, cached by content under course.build's cache directory; load it.
    common: the shared headers (default: course/cuda)."""
    from course import build as course_build
    common = common or course_build.HEADERS
    # #line: g++'s errors name the kernel file and its own line numbers (preprocess keeps
    # them), not the generated file in the cache; then the shim's, under their own name.
    name = str(kernel).replace("\\", "\\\\").replace('"', '\\"')
    text = (f'#include "emu.h"\n#line 1 "{name}"\n' + preprocess(kernel.read_text())
            + '\n#line 1 "emulator shim"\n' + shim)
    headers = b"".join(p.read_bytes() for p in sorted((HERE / "include").glob("*")))
    headers += b"".join(p.read_bytes() for p in sorted(common.glob("*")))
    key = hashlib.sha256(text.encode() + headers).hexdigest()[:20]
    out = course_build.cache_dir() / "emulator" / f"{kernel.stem}-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        cpp = out.with_suffix(".cpp")
        cpp.write_text(text)
        home = course_build.cuda_home()
        includes, _ = course_build._torch_paths()
        cudart = course_build._find_lib(home, "libcudart.so")
        cmd = ["g++", "-std=c++17", "-O1", "-fPIC", "-shared", "-w",
               "-I", str(HERE / "include"), "-I", str(common),
               *(f"-I{p}" for p in includes if "torch" not in p.parts),
               str(cpp), "-o", str(out.with_suffix(".tmp.so")),
               f"-L{cudart.parent}", "-lcudart", f"-Wl,-rpath,{cudart.parent}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{kernel} did not build for the emulator:\n{proc.stderr[-4000:]}")
        out.with_suffix(".tmp.so").replace(out)
    return ctypes.CDLL(str(out))

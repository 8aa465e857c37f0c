"""`python3 -m grader emulate NN`: run your stage-NN kernel on the CPU, in the course's emulator.

No grade: the emulator (tests/cuda_emulator) runs a kernel's logic -- its indexing, masks,
shuffles, shared memory, tensor-core fragments -- on the host, thread by thread, and compares
what it writes with the native twin on a few shapes (tests/test_emulated_kernels.py). What it
cannot tell: speed, races between blocks, the GPU's memory model. A shuffle that not every lane
of the warp reaches is reported as a deadlock. On a GPU, `python3 -m grader NN` is the grade.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

from course import manifest
from grader import arguments

ROOT = manifest.ROOT
# stage id -> the tests of tests/test_emulated_kernels.py that run its kernels
TESTS = {
    "04": "rmsnorm_kernels", "05": "rope_kernel", "06": "gemv_kernel",
    "07": "prefill_attention_kernel", "08": "silu_mul_kernel",
    "09": "decode_attention_kernel", "12": "flash_attention_kernel",
    "13": "cache_write_kernel", "14": "paged_attention_kernel",
}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python3 -m grader emulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", help="stage id, e.g. 14")
    p.add_argument("--solution", action="store_true", help="the reference kernel instead of yours")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="stop after S seconds (a kernel that loops forever; default 600)")
    args = p.parse_args(argv)
    arguments.positive_seconds(p, timeout=args.timeout)
    stage = manifest.find_ready(args.stage)
    if stage.id not in TESTS:
        with_kernels = ", ".join(sorted(TESTS))
        print(f"error: stage {stage.id} has no kernel the emulator runs (stages {with_kernels})",
              file=sys.stderr)
        return 2
    env = dict(os.environ)
    env.pop("TINYVLLM_STUDENT", None)
    if not args.solution:
        env["TINYVLLM_STUDENT"] = stage.id
    whose = "the reference" if args.solution else "your"
    print(f"stage {stage.id}: {whose} kernel on the CPU, in the emulator (logic only, not a "
          "grade)", flush=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "--tb=short", "-p", "no:cacheprovider",
           "-p", "no:faulthandler",
           "tests/test_emulated_kernels.py", "-k", TESTS[stage.id]]
    try:
        code = subprocess.run(cmd, cwd=ROOT, env=env, timeout=args.timeout).returncode
    except subprocess.TimeoutExpired:
        print(f"stage {stage.id}: still running after {args.timeout:g} s, stopped (a loop that "
              "never ends?)", file=sys.stderr)
        return 1
    if code < 0:   # the emulated kernel wrote where it must not, and took the host process down
        print(f"stage {stage.id}: the kernel crashed the emulator (signal {-code}): most likely "
              "a read or write out of bounds", file=sys.stderr)
    return 0 if code == 0 else 1

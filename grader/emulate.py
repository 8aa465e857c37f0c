"""`python3 -m grader emulate NN`: run your stage-NN kernel on the CPU, in the course's emulator.

No grade: the emulator (tests/cuda_emulator) runs a kernel's logic -- its indexing, masks,
shuffles, shared memory, tensor-core fragments -- on the host, thread by thread, and compares
what it writes with the native twin on a few shapes (tests/test_emulated_kernels.py). What it
cannot tell: speed, races between blocks, the GPU's memory model. A shuffle that not every lane
of the warp reaches is reported as a deadlock. On a GPU, `python3 -m grader NN` is the grade.
The tests run like a stage's (grader/runner.py): each under a timeout, and a kernel that
crashes the emulator costs its own test only.
"""
from __future__ import annotations

import argparse

from course import manifest
from grader import arguments, report, runner

TEST_FILE = manifest.ROOT / "tests" / "test_emulated_kernels.py"
# stage id -> the tests of TEST_FILE that run its kernels
TESTS = {
    "04": "rmsnorm_kernels", "05": "rope_kernel", "06": "gemv_simple_kernel or gemv_kernel",
    "07": "prefill_attention_kernel", "08": "silu_mul_kernel",
    "09": "decode_attention_kernel",
    "12": "flash_attention_simple_kernel or flash_attention_kernel",
    "13": "cache_write_kernel", "14": "paged_attention_kernel or partition_rule",
}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python3 -m grader emulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", help="stage id, e.g. 14")
    p.add_argument("--solution", action="store_true", help="the reference kernel instead of yours")
    arguments.add_student_root(p)
    arguments.add_test_timeout(p, runner.DEFAULT_TEST_TIMEOUT)
    args = p.parse_args(argv)
    arguments.positive_seconds(p, timeout=args.timeout)
    arguments.existing_dirs(p, student_root=args.student_root)
    stage = manifest.find_ready(args.stage)
    if stage.id not in TESTS:
        p.error(f"stage {stage.id} has no kernel the emulator runs (stages "
                f"{', '.join(sorted(TESTS))})")
    if not args.solution:
        arguments.student_stage_dir(p, args.student_root, stage.dir)
    student_ids = [] if args.solution else [stage.id]
    result = runner.StageResult(stage, runner.selection_label(student_ids, args.student_root))
    print("\n".join(report.header(stage, result.selection)
                    + ["  on the CPU, in the emulator: logic only, not a grade"]), flush=True)
    result.tests, result.errors = runner.run_tests(
        [TEST_FILE], student_ids, args.student_root, args.timeout,
        pytest_args=("-k", TESTS[stage.id]), listener=report.LivePrinter())
    passed = result.counts().get("passed", 0)
    print("\n".join(report.failure_details(result)))
    print(f"\nEmulated: {passed} of {len(result.tests)} checks passed (not a grade; "
          f"`python3 -m grader {stage.id}` on a GPU is)")
    return 0 if result.full_marks else 1

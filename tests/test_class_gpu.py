"""Class grading's GPU side, as far as a machine without a GPU can check it.

- the watch over a student's GPU tests (grader/classroom/gpu.py), on CPU tests that hang,
  crash the process and raise a sticky CUDA error: each ends as timeout or crashed and the
  rest run in a fresh process; the student's time limit ends what is left;
- the rules for a kernel's #include lines;
- the GPU class of tests/hostile/gpu_class.py: its expectations table (a record that keeps
  them and one that does not), and a class run without a CUDA device, where every GPU test
  is "not graded" (never passed) and the problems and builds are still as expected.
  `python3 -m grader verify` runs the whole class on a GPU.
"""
from __future__ import annotations

import os
import time

import pytest

from course import manifest
from grader import environment
from grader.classroom import collect, gpu, grade, sandbox, submission
from tests.hostile import gpu_class

FULL = os.environ.get("TINYVLLM_FULL_CORPUS") == "1"

WATCHED = '''
import os, signal, time

def test_a_first():
    assert True

def test_b_hangs():
    time.sleep(3600)

def test_c_after_the_hang():
    assert True

def test_d_segfaults():
    os.kill(os.getpid(), signal.SIGSEGV)

def test_e_sticky():
    raise RuntimeError("CUDA error: an illegal memory access was encountered")

def test_f_fails():
    assert 1 == 2

def test_g_last():
    assert True
'''


def test_the_watch_restarts_after_hangs_crashes_and_sticky_errors(tmp_path):
    tests = tmp_path / "hidden"
    tests.mkdir()
    (tests / "test_watched.py").write_text(WATCHED)
    cases, problem = collect.collect([tests])
    assert len(cases) == 7, problem
    shared, student = tmp_path / "shared", tmp_path / "student"
    shared.mkdir()
    student.mkdir()
    stage = manifest.find("02")
    settings = grade.Settings(extra_tests=tests, test_timeout=4, student_timeout=120)
    view = gpu.course_view(stage, tmp_path)
    env = grade._sandbox_env(manifest.ROOT, shared)
    start = time.time()
    got = gpu.run_tests(stage, cases, student, shared, view, env, settings,
                        marker="not gpu", paths=[tests])
    outcome = {name.split("::")[-1]: r.outcome for name, r in got.items()}
    assert outcome == {"test_a_first": "passed", "test_b_hangs": "timeout",
                       "test_c_after_the_hang": "passed", "test_d_segfaults": "crashed",
                       "test_e_sticky": "crashed", "test_f_fails": "failed",
                       "test_g_last": "passed"}, got
    assert time.time() - start < 90


def test_the_student_time_limit_ends_what_is_left(tmp_path):
    tests = tmp_path / "hidden"
    tests.mkdir()
    (tests / "test_watched.py").write_text(WATCHED)
    cases, _ = collect.collect([tests])
    shared = tmp_path / "shared"
    shared.mkdir()
    stage = manifest.find("02")
    settings = grade.Settings(extra_tests=tests, test_timeout=60, student_timeout=8)
    start = time.time()
    got = gpu.run_tests(stage, cases, tmp_path, shared, gpu.course_view(stage, tmp_path),
                        grade._sandbox_env(manifest.ROOT, shared), settings,
                        marker="not gpu", paths=[tests])
    outcome = {name.split("::")[-1]: r.outcome for name, r in got.items()}
    assert outcome["test_a_first"] == "passed"
    assert {outcome[n] for n in outcome if n != "test_a_first"} == {"timeout"}, got
    assert "--student-timeout" in got[cases[-1].name].message
    assert time.time() - start < 40


@pytest.mark.skipif(not sandbox.bwrap_path(), reason="needs bubblewrap (the sandbox)")
def test_the_view_has_no_reference_kernel_of_the_graded_stage(tmp_path):
    stage = manifest.find("03")
    view = gpu.course_view(stage, tmp_path)
    assert (view / "solutions" / stage.dir / "embedding.cu").read_text() == gpu.STUB
    assert (view / "solutions" / "04_rmsnorm" / "rmsnorm.cu").read_bytes() == \
        (manifest.ROOT / "solutions" / "04_rmsnorm" / "rmsnorm.cu").read_bytes()
    assert not (view / ".git").exists()
    grade.remove(view)


def test_without_a_sandbox_the_view_is_the_course_itself(tmp_path, monkeypatch):
    """Nothing can be hidden without bubblewrap: the documented fallback (docs/instructors.md,
    "Without bubblewrap") grades GPU tests on the course as it is."""
    monkeypatch.setattr(sandbox, "bwrap_path", lambda: None)
    assert gpu.course_view(manifest.find("03"), tmp_path) == manifest.ROOT


@pytest.mark.parametrize("source, why", [
    (b'#include "/work/x/solutions/03_embedding/embedding.cu"\n', "outside"),
    (b"  #  include </dev/zero>\n", "outside"),
    (b'#include "../../classmate/03_embedding/embedding.cu"\n', "outside"),
    (b'#define P "x.cu"\n#include P\n', "computed"),
    (b'%:include "/x"\n', "outside"),
    (b'#inc\\\nlude "/x"\n', "outside"),
    (b'const char* s = "/*";\n#include "/x"\n// */\n', "outside"),
    (b'#if __has_include("/x")\n#endif\n', "outside"),
    (b'asm(".incbin \\"/x\\"");\n', "incbin"),
    (b'#embed "x"\n', "embed"),
])
def test_a_kernel_may_not_include_files_outside_the_course(source, why):
    assert why in submission.foreign_include(source)


def test_honest_includes_are_allowed():
    for folder in ("solutions", "stages"):
        for path in (manifest.ROOT / folder).glob("*/*.c*"):
            assert submission.foreign_include(path.read_bytes()) == "", path
    assert submission.foreign_include(b'#include <cub/cub.cuh>  // cub\n'
                                      b'#include "vec.cuh" /* packs */\n') == ""


def _record(outcomes: dict[str, str], score: float, build: str = "ok",
            problems: list[str] | None = None) -> dict:
    return {"score": score, "build": build, "problems": problems or [],
            "tests": [{"name": n, "outcome": o, "message": "", "points": 1.0}
                      for n, o in outcomes.items()]}


def test_the_expectations_table():
    names = [f"t.py::test_embedding_matches_torch[{x}]" for x in
             ("1-576-bf16", "1031-576-bf16", "1031-576-fp32")]
    sticky = {n: "passed" for n in names}
    sticky[names[1]] = "crashed"
    assert gpu_class.compare("h_sticky_fault", _record(sticky, 66.7), True, True) == []
    assert gpu_class.compare("h_sticky_fault", _record(sticky, 100.0), True, True)
    sticky[names[1]] = "passed"   # a crash that went unnoticed
    assert gpu_class.compare("h_sticky_fault", _record(sticky, 100.0), True, True)
    ref = _record({n: "failed" for n in names}, 0.0, "FAILED\nno kernel source",
                  ["03_embedding/embedding.cu: #include ...: a path outside the course's "
                   "headers: rejected"])
    assert gpu_class.compare("h_include_solution", ref, True, True) == []
    ref["problems"] = []
    assert gpu_class.compare("h_include_solution", ref, True, True)
    # the include bomb: killed at the compile timeout or stopped at the depth limit, never ok
    for build in ("FAILED\nthe compiler did not finish within 180 s (an include bomb?): killed",
                  "FAILED\nembedding.cu:1:24: error: #include nested depth 200 exceeds maximum"):
        bomb = _record({n: "failed" for n in names}, 0.0, build)
        assert gpu_class.compare("h_include_bomb", bomb, True, True) == [], build
    bomb["build"] = "ok"
    assert gpu_class.compare("h_include_bomb", bomb, True, True)
    # without a CUDA device: every GPU test not graded, nobody above 0
    cpu = _record({n: "not_graded" for n in names}, 0.0, "ok")
    assert gpu_class.compare(gpu_class.HONEST, cpu, False, True) == []
    cpu["tests"][0]["outcome"] = "passed"
    assert gpu_class.compare(gpu_class.HONEST, cpu, False, True)


@pytest.mark.skipif(environment.has_cuda(), reason="on a GPU machine `grader verify` grades this class")
def test_the_gpu_class_without_a_gpu(tmp_path):
    lines: list[str] = []

    class Sink:
        def write(self, text):
            lines.append(text)

        def flush(self):
            pass
    names = list(gpu_class.CLASS) if FULL else gpu_class.CPU_SUBSET
    ok, table = gpu_class.check(tmp_path / "out", names, Sink(),
                                {"--compile-timeout": "10"})
    assert ok is None, "\n".join(table) + "".join(lines)[-3000:]   # not graded, never passed
    assert "not graded: no CUDA device" in table[-1]
    assert (tmp_path / "out" / "gpu_class.json").exists()


@pytest.mark.skipif(environment.has_cuda(), reason="on a GPU machine `grader verify` grades this class")
def test_one_student_of_the_gpu_class(tmp_path):
    """--only with one student: `grader class --json` writes a list of one record (it
    once wrote a lone record bare, and the checker crashed reading it)."""
    with open(os.devnull, "w") as sink:
        ok, table = gpu_class.check(None, ["h_include_solution"], sink,
                                    {"--compile-timeout": "10"})
    assert ok is None, "\n".join(table)
    assert table[2].startswith("| h_include_solution |") and table[2].endswith(" ok |"), table

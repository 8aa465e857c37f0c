"""A hostile class: each case builds one submission that tries to cheat, crash, hang or spoil.

Cheats are written on top of the untouched SKELETON, so a cheat that works shows as a score
above zero; a case that should not even run its parts says so. Every case is graded beside
an honest student (the reference parts, must keep 100 on the CPU stages) and an untouched
skeleton (must keep 0). `BUILD` maps a case name to (stage id, builder, expectation); the
builder gets the student folder to fill and a Context (paths the cheat may aim at).
"""
from __future__ import annotations

import os
import py_compile
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from course import manifest

# `sleep 4242.<pid>`: a background process that must not outlive grading. This run's own
# number, so that a check for it never counts another run's leftovers (a run without the
# sandbox, where the process does get out: docs/instructors.md).
SLEEP_MARK = f"4242.{os.getpid()}"


def marked_sleeps(mark: str) -> list[int]:
    """The pids of the `sleep MARK` processes running now."""
    wanted = b"sleep\0" + mark.encode() + b"\0"
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if (proc / "cmdline").read_bytes() == wanted:
                found.append(int(proc.name))
        except OSError:
            pass    # gone already
    return found


@dataclass
class Context:
    root: Path           # the course repository (its conftest.py, solutions, tests)
    extra_tests: Path    # the instructor's hidden tests
    classmate: Path      # the honest student's folder


def _copy(dest: Path, stage_id: str, source: str) -> Path:
    stage = manifest.find(stage_id)
    folder = dest / stage.dir
    folder.mkdir(parents=True, exist_ok=True)
    src = stage.solution_dir() if source == "solution" else stage.skeleton_dir()
    for part in stage.parts:
        if (folder / part).exists():   # a combined case: keep what an earlier cheat wrote
            continue
        shutil.copy(src / part, folder / part)
        os.chmod(folder / part, 0o644)
    return folder


def honest(dest: Path, ctx: Context, stage_id: str = "02") -> None:
    _copy(dest, stage_id, "solution")


def skeleton(dest: Path, ctx: Context, stage_id: str = "02") -> None:
    _copy(dest, stage_id, "skeleton")


def on_import(code: str, part: str = "stopping.py", stage_id: str = "02"):
    """A skeleton whose `part` runs `code` when it is imported."""
    def build(dest: Path, ctx: Context) -> None:
        folder = _copy(dest, stage_id, "skeleton")
        text = code.format(root=ctx.root, extra=ctx.extra_tests, classmate=ctx.classmate,
                           mark=SLEEP_MARK)
        with open(folder / part, "a") as f:
            f.write("\n# --- the cheat ---\n" + text + "\n")
    return build


def combined(*builders: Callable[[Path, Context], None]):
    """Several cheats in one submission (one class member instead of several: CI time)."""
    def build(dest: Path, ctx: Context) -> None:
        for b in builders:
            b(dest, ctx)
    return build


def _symlink_part(dest: Path, ctx: Context) -> None:
    folder = _copy(dest, "02", "skeleton")
    (folder / "stopping.py").unlink()
    (folder / "stopping.py").symlink_to(manifest.find("02").solution_dir() / "stopping.py")


def _symlink_stage(dest: Path, ctx: Context) -> None:
    dest.mkdir(parents=True)
    (dest / "02_tokenize").symlink_to(manifest.find("02").solution_dir())


def _symlink_student(dest: Path, ctx: Context) -> None:
    dest.symlink_to(ctx.classmate)


def _plain_file(dest: Path, ctx: Context) -> None:
    dest.write_text("I did stage 02, trust me\n")


def _pyc(dest: Path, ctx: Context) -> None:
    """The reference's bytecode (unchecked hash) beside the skeleton's source."""
    folder = _copy(dest, "02", "skeleton")
    for part in manifest.find("02").parts:
        target = folder / "__pycache__" / (part[:-3] + ".cpython-311.pyc")
        target.parent.mkdir(exist_ok=True)
        py_compile.compile(str(manifest.find("02").solution_dir() / part), str(target),
                           invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)


def _not_utf8(dest: Path, ctx: Context) -> None:
    folder = _copy(dest, "02", "skeleton")
    (folder / "stopping.py").write_bytes(b"\xff\xfe\x00 not python \x81\x82\n" * 100)


def _fifo_include(dest: Path, ctx: Context) -> None:
    folder = _copy(dest, "01", "skeleton")
    os.mkfifo(folder / "pipe.h")
    text = (folder / "bf16.cu").read_text()
    (folder / "bf16.cu").write_text('#include "pipe.h"\n' + text)


CHEATS = {
    # student code that patches the judging machinery in its own process
    "patch_checks": on_import(
        "import sys\n"
        "try:\n"
        "    import course.testing.checks as c\n"
        "    c.assert_close = c.assert_equal = lambda *a, **k: None\n"
        "except Exception: pass\n"
        "import torch.testing; torch.testing.assert_close = lambda *a, **k: None\n"
        "try:\n"
        "    import _pytest.reports as r\n"
        "    r.TestReport.passed = property(lambda self: True)\n"
        "    r.TestReport.outcome = 'passed'\n"
        "except Exception: pass\n"
        "try:\n"
        "    import grader.pytest_plugin as p\n"
        "    p._write = lambda record: None\n"
        "except Exception: pass\n"
        "class StopChecker:\n"
        "    def __init__(self, *a, **k): pass\n"
        "    def __eq__(self, other): return True\n"
        "    def check(self, *a): return None\n"
        "    def safe_text(self, text, finished=False): return text\n"
        "    def truncate(self, text): return text\n"),
    "call_reference": on_import(
        "from course import parts\n"
        "globals().update({{k: v for k, v in vars(parts.reference('02', 'stopping')).items()\n"
        "                  if not k.startswith('__')}})\n"),
    "exec_solution": on_import(
        "exec(open('{root}/solutions/02_tokenize/stopping.py').read())\n"),
    "exec_classmate": on_import(
        "exec(open('{classmate}/02_tokenize/stopping.py').read())\n"),
    "env_vars": on_import(
        "import os\n"
        "os.environ['TINYVLLM_STUDENT'] = ''\n"
        "os.environ['TINYVLLM_STUDENT_ROOT'] = '{root}/solutions'\n"),
    "write_results": on_import(
        "import glob, json, os\n"
        "for k, v in os.environ.items():\n"
        "    if 'RESULT' in k:\n"
        "        open(v, 'a').write(json.dumps({{'event': 'end', 'test': 'x', 'outcome': "
        "'passed', 'points': 400}}) + '\\nnot json\\n')\n"
        "for f in glob.glob('/tmp/**/results*.jsonl', recursive=True):\n"
        "    open(f, 'a').write('{{\"event\": \"finished\"}}\\n')\n"),
    "pytest_exit": on_import("import pytest\npytest.exit('bye', returncode=0)\n"),
    "keyboard_interrupt": on_import("raise KeyboardInterrupt\n"),
    "os_exit": on_import("import os\nos._exit(0)\n"),
    "system_exit_class": on_import(
        "class StopChecker:\n"
        "    def __init__(self, *a, **k):\n"
        "        raise SystemExit(0)\n"),
    "spoil_course": on_import(
        "for path in ('{root}/conftest.py', '{root}/stages/02_tokenize/tests/conftest.py',\n"
        "             '{extra}/02_tokenize/test_hidden.py'):\n"
        "    try:\n"
        "        open(path, 'a').write('\\nimport pytest\\n@pytest.fixture(autouse=True)\\n'\n"
        "                              'def _skip(): pytest.skip(\"spoiled\")\\n')\n"
        "    except OSError: pass\n"),
    "spoil_classmate": on_import(
        "try:\n"
        "    open('{classmate}/02_tokenize/stopping.py', 'w').write('raise SystemExit\\n')\n"
        "except OSError: pass\n"),
    "background_process": on_import(
        "import subprocess\n"
        "subprocess.Popen(['sleep', '{mark}'], start_new_session=True)\n"),
    "huge_and_control": on_import(
        "class StopChecker:\n"
        "    def __init__(self, *a, **k):\n"
        "        raise ValueError('\\x00\\x1b[31m\\x07\\x0c bad ' + 'x' * 500_000)\n"),
    "huge_return": on_import(
        "def apply_chat_template(*a, **k):\n"
        "    return 'y' * 3_000_000\n", part="chat_template.py"),
    "busy_loop": on_import(
        "class StopChecker:\n"
        "    def __init__(self, *a, **k):\n"
        "        while True: pass\n"),
    "symlink_part": combined(_symlink_part, _pyc),
    "symlink_stage": _symlink_stage,
    "symlink_student": _symlink_student,
    "plain_file": _plain_file,
    "pyc_beside_skeleton": _pyc,
    "not_utf8": _not_utf8,
}

# GPU-only kinds: compile-only here (the kernel is graded on a CUDA machine)
COMPILE_ONLY = {"fifo_include": _fifo_include}

# What only a sandbox can stop (reading or writing outside the workspace, escaping processes):
# without bubblewrap these are known to get through (docs/instructors.md), so not run there.
SANDBOX_ONLY = {"exec_solution", "exec_classmate", "spoil_course", "spoil_classmate",
                "background_process"}

# One student doing a cheat of each family at once, part by part
CHEATS["kitchen_sink"] = combined(
    CHEATS["patch_checks"],                                       # stopping.py
    on_import("from course import parts\nparts.reference('02', 'detokenizer')\n",
              part="detokenizer.py"),
    on_import("import subprocess\nsubprocess.Popen(['sleep', '{mark}'], "
              "start_new_session=True)\n" + "raise ValueError('\\x00\\x1b[31m' + 'z' * 500_000)\n",
              part="chat_template.py"))

# A quick, representative slice for CI; the rest: nox -s class-corpus
CI_SUBSET = ["kitchen_sink", "write_results", "os_exit", "spoil_course", "symlink_part",
             "plain_file"]

Builder = Callable[[Path, Context], None]

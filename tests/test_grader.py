"""The grader itself: manifest, resolver, skeleton generation, runner outcomes, reports, CLI."""
from __future__ import annotations

import argparse
import dataclasses

import json
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from course import manifest, parts
from grader import report, runner, sync

ROOT = manifest.ROOT


def grader_cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "grader", *args], cwd=cwd, capture_output=True,
                          text=True)


def test_manifest_lists_fourteen_stages_in_order():
    ids = [s.id for s in manifest.stages()]
    assert ids == [f"{i:02d}" for i in range(1, 15)]
    assert [s.dir for s in manifest.stages()][0] == "01_load"
    assert manifest.stages()[-1].dir == "14_paged_kernel"
    for s in manifest.stages():
        assert (ROOT / "stages" / s.dir / "README.md").is_file(), f"{s.dir} has no lesson"
        assert set(s.needs) < {x.id for x in manifest.stages() if x.number < s.number} | {""}


@pytest.mark.parametrize("text", ["7", "07", "07_attention"])
def test_stage_ids_are_normalized(text):
    assert manifest.find(text).dir == "07_attention"


def test_unknown_stage_lists_valid_ones():
    proc = grader_cli("42")
    assert proc.returncode == 2
    assert "there is no stage '42'" in proc.stderr and "01 (01_load)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_planned_stage_says_not_available(monkeypatch):
    """A stage the manifest lists as planned (once the course grows past its last ready
    stage) is refused with a sentence, not graded."""
    stages = manifest.stages()
    planned = dataclasses.replace(stages[-1], id="99", dir="99_future", status="planned")
    monkeypatch.setattr(manifest, "stages", lambda: (*stages, planned))
    with pytest.raises(manifest.StageNotAvailable,
                       match=r"stage 99 \(99_future\) is not available yet"):
        manifest.find_ready("99")


def test_resolver_picks_student_part_only_for_selected_stage(monkeypatch, tmp_path):
    monkeypatch.setenv(parts.STUDENT_ENV, "01")
    monkeypatch.setenv(parts.STUDENT_ROOT_ENV, str(tmp_path))
    assert parts.path("01", "bf16.cu") == tmp_path / "01_load" / "bf16.cu"
    assert parts.path("01", "bf16_binding.cpp") == ROOT / "solutions/01_load/bf16_binding.cpp"
    assert parts.path("03", "embedding.cu") == ROOT / "solutions/03_embedding/embedding.cu"
    monkeypatch.setenv(parts.STUDENT_ENV, "")
    assert parts.path("01", "bf16.cu") == ROOT / "solutions/01_load/bf16.cu"


@pytest.mark.parametrize("value", ["99", "abc", "03,7x"])
def test_resolver_refuses_a_student_stage_that_does_not_exist(monkeypatch, value):
    """A typo in TINYVLLM_STUDENT is an error naming the variable, not a silent run of the
    reference parts."""
    monkeypatch.setenv(parts.STUDENT_ENV, value)
    with pytest.raises(manifest.UnknownStage, match="TINYVLLM_STUDENT=.*there is no stage"):
        parts.path("03", "embedding.cu")


SOLUTION = textwrap.dedent('''\
    def area(w, h):
        """Area of a rectangle."""
        # BEGIN SOLUTION: multiply the sides
        result = w * h
        return result
        # END SOLUTION
    ''')


def test_sync_replaces_python_regions_with_todo():
    out = sync.skeleton_text(SOLUTION, "05", "area.py")
    assert "w * h" not in out
    assert "# TODO stage 05: multiply the sides (about 2 lines)" in out
    assert 'raise NotImplementedError("TODO stage 05: multiply the sides (about 2 lines)")' in out
    ns: dict = {}
    exec(out, ns)
    with pytest.raises(NotImplementedError, match="TODO stage 05"):
        ns["area"](2, 3)


def test_sync_cuda_stub_and_unbalanced_markers():
    cu = ("int f() {\n  // BEGIN SOLUTION: launch it | return \"{todo}\";\n  go();\n"
          "  // END SOLUTION\n}\n")
    out = sync.skeleton_text(cu, "04", "k.cu")
    assert 'return "TODO stage 04: launch it (about 1 line)";' in out and "go();" not in out
    with pytest.raises(sync.MarkerError, match="never closed"):
        sync.skeleton_text("# BEGIN SOLUTION\nx = 1\n", "01", "a.py")
    with pytest.raises(sync.MarkerError, match="without BEGIN"):
        sync.skeleton_text("x = 1\n# END SOLUTION\n", "01", "a.py")


def test_a_bar_in_a_python_hint_is_part_of_the_hint():
    """Python regions have no stubs: "a | b" was split as a stub, and the skeleton held the
    line `b, then check`, which does not parse."""
    out = sync.skeleton_text("def f():\n    # BEGIN SOLUTION: join with a | b, then check\n"
                             "    return 1\n    # END SOLUTION\n", "02", "s.py")
    assert "TODO stage 02: join with a | b, then check (about 1 line)" in out
    ns: dict = {}
    exec(out, ns)
    with pytest.raises(NotImplementedError, match=r"a \| b, then check"):
        ns["f"]()


def test_every_skeleton_is_in_sync():
    assert not sync.missing_solutions()
    stale = sync.out_of_sync()
    assert not stale, f"run `nox -s sync-stages`: {stale}"


@pytest.fixture
def fake_course(monkeypatch, tmp_path):
    """A course of one stage, 01_fake, under tmp_path: write its solution parts, then sync."""
    def make(parts: dict[str, str], listed: tuple[str, ...] = ()) -> Path:
        stage = dataclasses.replace(manifest.find("01"), dir="01_fake",
                                    parts=tuple(parts) + listed, reading=())
        monkeypatch.setattr(manifest, "ROOT", tmp_path)
        monkeypatch.setattr(manifest, "stages", lambda: (stage,))
        monkeypatch.setattr(sync, "README", tmp_path / "README.md")
        (tmp_path / "solutions" / "01_fake").mkdir(parents=True)
        for name, text in parts.items():
            (tmp_path / "solutions" / "01_fake" / name).write_text(text)
        return tmp_path / "stages" / "01_fake"
    return make


GOOD_PART = "def f():\n    # BEGIN SOLUTION: one\n    return 1\n    # END SOLUTION\n"


def test_sync_writes_then_checks_a_fake_course(fake_course, capsys):
    """The control for the refusals below: the same fake course, well formed, syncs."""
    stages = fake_course({"a.py": GOOD_PART})
    assert sync.main(["--check"]) == 1
    assert sync.main([]) == 0
    assert "TODO stage 01: one" in (stages / "a.py").read_text()
    assert sync.main(["--check"]) == 0


@pytest.mark.parametrize("text,message", [
    ("x = 1\n# BEGIN SOLUTION: one\ny = 2\n# BEGIN SOLUTION: two\nz = 3\n# END SOLUTION\n",
     "solutions/01_fake/b.py:4: BEGIN SOLUTION inside another region (opened at line 2)"),
    ("x = 1\n# BEGIN SOLUTION: one\ny = 2\n",
     "solutions/01_fake/b.py:2: BEGIN SOLUTION is never closed"),
    ("def f(:\n    # BEGIN SOLUTION\n    return 1\n    # END SOLUTION\n",
     "solutions/01_fake/b.py:1: "),
    ("def f():\n    # BEGIN SOLUTON: one\n    return 1\n    # END SOLUTON\n",
     "solutions/01_fake/b.py:2: '# BEGIN SOLUTON: one' looks like a marker"),
    ("def f():\n    # begin solution: one\n    return 1\n    # end solution\n",
     "solutions/01_fake/b.py:2: '# begin solution: one' looks like a marker"),
    ("def f():\n    # BEGIN SOLUTION: one\n    return 1\n    # end solution\n",
     "solutions/01_fake/b.py:4: '# end solution' looks like a marker"),
    ("class A:\n    def f(self):\n# BEGIN SOLUTION: one\n        return 1\n"
     "# END SOLUTION\n", "solutions/01_fake/b.py: its skeleton would not parse"),
], ids=["end-deleted", "never-closed", "does-not-parse", "misspelled", "lowercase",
        "lowercase-end", "marker-indent"])
@pytest.mark.parametrize("argv", [[], ["--check"]], ids=["sync", "check"])
def test_sync_refuses_a_broken_solution_in_one_line(fake_course, capsys, text, message, argv):
    """Unbalanced markers were a MarkerError traceback; Python that does not parse became a
    skeleton that hid the mistake behind a TODO. Now: file:line, exit 2, nothing written."""
    stages = fake_course({"a.py": GOOD_PART, "b.py": text})
    assert sync.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert not stages.exists()


@pytest.mark.parametrize("argv", [[], ["--check"]], ids=["sync", "check"])
def test_sync_says_how_to_fix_a_missing_solution(fake_course, capsys, argv):
    """A listed part without a solution was 'missing solution' and exit 0, and --check then
    said to run sync, which cannot create it."""
    stages = fake_course({"a.py": GOOD_PART}, listed=("gone.py",))
    assert sync.main(argv) == 2
    out, err = capsys.readouterr()
    assert err == ("error: missing solution: solutions/01_fake/gone.py is listed in "
                   "stages.toml: create it, or remove it from stages.toml\n")
    assert "run `nox -s sync-stages`" not in out
    assert not stages.exists()


SMOKE = textwrap.dedent('''\
    import os, signal, time, pytest
    def test_pass(): pass
    def test_todo(): raise NotImplementedError("TODO stage 01: write it (about 3 lines)")
    @pytest.mark.gpu
    def test_gpu(): pass
    def test_crash(): os.kill(os.getpid(), signal.SIGSEGV)
    def test_hang(): time.sleep(60)
    def test_fail(): assert 1 == 2, "expected 1 to be 2"
    @pytest.mark.points(3)
    def test_after_the_crash_and_the_hang(): pass
    ''')


@pytest.fixture
def smoke_tests(tmp_path):
    (tmp_path / "test_smoke.py").write_text(SMOKE)
    return tmp_path


def test_runner_survives_crashes_and_hangs(smoke_tests):
    import torch
    tests, errors = runner.run_tests([smoke_tests], [], test_timeout=5)
    outcome = {t.name.split("::")[-1]: t.outcome for t in tests}
    assert errors == []
    assert outcome == {
        "test_pass": "passed", "test_todo": "todo",
        "test_gpu": "passed" if torch.cuda.is_available() else "not_graded",
        "test_crash": "crashed", "test_hang": "timeout", "test_fail": "failed",
        "test_after_the_crash_and_the_hang": "passed",
    }
    crash = next(t for t in tests if t.name.endswith("test_crash"))
    assert "SIGSEGV" in crash.message


def test_score_counts_not_graded_as_zero(smoke_tests):
    stage = manifest.find("01")
    result = runner.StageResult(stage, "x", [
        runner.TestResult("a", "passed", points=1), runner.TestResult("b", "not_graded", points=1),
        runner.TestResult("c", "passed", points=2)])
    assert result.score == 75 and not result.full_marks
    text = report.render(result)
    assert "Score: 75/100" in text and "not graded: no CUDA device" in text


def test_reports_json_junit_csv(tmp_path):
    stage = manifest.find("02")
    result = runner.StageResult(stage, "x", [
        runner.TestResult("stages/02/tests/test_a.py::test_ok", "passed"),
        runner.TestResult("stages/02/tests/test_a.py::test_todo", "todo", "TODO stage 02: x"),
        runner.TestResult("stages/02/tests/test_a.py::test_gpu", "not_graded", "no CUDA"),
        runner.TestResult("stages/02/tests/test_a.py::test_gone", "missing", "no result")])
    report.write_json(tmp_path / "r.json", [report.as_dict(result)])
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["score"] == pytest.approx(25) and data["counts"]["todo"] == 1
    report.write_junit(tmp_path / "r.xml", [("alice", result)])
    suite = ET.parse(tmp_path / "r.xml").getroot().find("testsuite")
    assert suite.get("name") == "alice stage 02"
    assert suite.get("failures") == "2" and suite.get("skipped") == "1", (
        "TODO and missing (a class test that never reported) are failures")
    report.write_csv(tmp_path / "r.csv", [{"student": "alice", "stage_02": "33.3"}])
    assert (tmp_path / "r.csv").read_text().splitlines()[1] == "alice,33.3"


def test_junit_keeps_students_and_test_files_apart(tmp_path):
    """Every test case was classed "stage02" and named without its folder, so a CI viewer
    (keyed on classname and name) merged two students' tests, and a hidden test with a
    course test of the same file name; a stage's error was an <error> right under
    <testsuite>, which the common JUnit schema does not allow."""
    stage = manifest.find("02")
    names = ["stages/02_tokenize/tests/test_h.py::test_x", "02_tokenize/test_h.py::test_x"]
    alice = runner.StageResult(stage, "x", [runner.TestResult(n, "passed") for n in names])
    bob = runner.StageResult(stage, "x", [runner.TestResult(n, "missing", "no result")
                                          for n in names],
                             errors=["could not collect test_h.py:\nSyntaxError"])
    report.write_junit(tmp_path / "class.xml", [("alice", alice), ("bob.smith", bob)])
    report.write_junit(tmp_path / "local.xml", [("", alice)])
    suites = ET.parse(tmp_path / "class.xml").getroot().findall("testsuite")
    keys = [(c.get("classname"), c.get("name")) for s in suites for c in s.iter("testcase")]
    assert len(set(keys)) == len(keys) == 5, keys
    assert keys[:2] == [("alice.stage02", n) for n in names], keys
    assert keys[2] == ("bob_smith.stage02", "(submission)"), "dots would read as packages"
    assert [child.tag for child in suites[1]] == ["properties"] + ["testcase"] * 3
    error = suites[1].find("testcase").find("error")
    assert error.get("message") == "could not collect test_h.py:" and "SyntaxError" in error.text
    assert (suites[1].get("tests"), suites[1].get("errors")) == ("3", "1")
    local = ET.parse(tmp_path / "local.xml").getroot().find("testsuite")
    assert local.get("name") == "stage 02"
    assert {c.get("classname") for c in local.iter("testcase")} == {"stage02"}


DEV_FULL = pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")


def test_a_report_is_replaced_whole_or_not_at_all(tmp_path):
    """Path.write_text truncated the old report first: a failed write left it empty or half."""
    path = tmp_path / "r.json"
    path.write_text("the last good report")
    path.chmod(0o640)
    with pytest.raises(UnicodeEncodeError):
        report.write_text(path, "half\ud800")   # fails while writing, as a full disk would
    assert path.read_text() == "the last good report"
    assert [f.name for f in tmp_path.iterdir()] == ["r.json"], "the temporary file must go"
    report.write_text(path, "new")
    assert path.read_text() == "new" and path.stat().st_mode & 0o777 == 0o640


@DEV_FULL
def test_an_unwritable_report_does_not_cost_the_other(tmp_path):
    """--json /dev/full was an OSError traceback (exit 1) and the JUnit report was never
    written. Now: one line naming the file, the other report written, exit 2."""
    junit = tmp_path / "j.xml"
    proc = grader_cli("02", "--solution", "--json", "/dev/full", "--junit", str(junit))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: cannot write /dev/full: No space left on device"], proc.stderr
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite.find("properties/property[@name='score']").get("value") == "100"


@DEV_FULL
def test_class_reports_are_written_each_on_its_own(tmp_path, capsys):
    from grader.classroom import cli
    args = argparse.Namespace(csv=Path("/dev/full"), json=tmp_path / "g.json",
                              junit=tmp_path / "g.xml", similarity=tmp_path / "s.json")
    assert cli.write_reports(args, [], [], {}) is False
    assert capsys.readouterr().err == "error: cannot write /dev/full: No space left on device\n"
    assert json.loads((tmp_path / "g.json").read_text()) == []
    assert json.loads((tmp_path / "s.json").read_text()) == []
    assert ET.parse(tmp_path / "g.xml").getroot().tag == "testsuites"


def test_grade_cli_skeleton_scores_zero_and_json(tmp_path):
    proc = grader_cli("02", "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 1
    assert "Score: 0/100" in proc.stdout and "TODO stage 02" in proc.stdout
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["score"] == 0 and set(data["counts"]) == {"todo"}


def test_compile_error_is_shown_with_file_and_line(tmp_path):
    """A student's kernel that does not compile: the compiler's error lines, not its whole log."""
    stage = manifest.find("04")
    broken = tmp_path / stage.dir / "rmsnorm.cu"
    broken.parent.mkdir()
    source = (stage.solution_dir() / "rmsnorm.cu").read_text()
    broken.write_text(source.replace("#include \"vec.cuh\"", "#include \"vec.cuh\"\nint oops = ;", 1))
    result = runner.run_stage(stage, [stage.id], tmp_path)
    assert result.build.startswith("FAILED"), result.build
    line = 1 + source.splitlines().index('#include "vec.cuh"') + 1
    assert f"{broken}({line}): error" in result.build
    assert len(result.build.splitlines()) < 30
    assert result.score == 0 and not result.full_marks


def test_missing_toolchain_is_not_reported_as_a_compile_failure(monkeypatch):
    from course import build

    def no_toolkit(sources, archs=None):
        raise build.ToolchainMissing("no CUDA toolkit found")
    monkeypatch.setattr(build, "build", no_toolkit)
    status = runner.build_kernels(manifest.find("04"), ["04"], None)
    assert status == "not built here (no CUDA toolkit found)"


@pytest.mark.parametrize("args,message", [
    (["01", "--timeout", "-5"], "--timeout must be a positive number of seconds"),
    (["01", "--student-root", "/nonexistent/stages"], "is not a directory"),
    (["01", "--json", "README.md/r.json"], f"cannot be written: {ROOT / 'README.md'} is a file"),
    (["reset", "01", "--student-root", "/nonexistent/stages"], "is not a directory"),
    (["class", ".", "--csv", "README.md/g.csv"], "--csv README.md/g.csv cannot be written"),
    (["class", ".", "--student-timeout", "0"], "--student-timeout must be a positive number"),
    (["04", "--student-root", str(ROOT)], "has no 04_rmsnorm/ folder"),
    (["emulate", "04", "--student-root", str(ROOT)], f"did you mean {ROOT / 'stages'}?"),
    (["next", "--student-root", str(ROOT)], "has no 01_load/ folder"),
    (["04_attention"], "there is no stage '04_attention': stage 04 is 04_rmsnorm"),
    (["verify", "--out", "README.md"], "--out README.md cannot be a folder"),
    (["verify", "--timeout", "-1"], "--timeout must be a positive number of seconds"),
    (["verify", "--no-compute75", "--only-compute75"], "not allowed with"),
    (["compile-check", "--archs", "abc"], "'abc' is not a CUDA architecture"),
    (["compile-check", "--archs", "", "--also", ""], "name no architecture"),
], ids=["timeout", "student-root", "json", "reset-root", "class-csv", "class-timeout",
        "root-above-stages", "emulate-root-above-stages", "next-root-above-stages",
        "id-and-name-disagree", "verify-out",
        "verify-timeout", "verify-t4-flags", "compile-check-arch", "compile-check-nothing"])
def test_bad_arguments_are_refused_before_any_grading(tmp_path, args, message):
    """A usage error at once, exit 2, nothing graded or created (a mistyped reset root used
    to be created and 'reset'; a class's unwritable report path failed after grading all)."""
    r = grader_cli(*args)
    assert r.returncode == 2, f"grader {' '.join(args)}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert message in r.stderr, f"grader {' '.join(args)} said:\n{r.stderr}"
    assert not Path("/nonexistent").exists(), "a refused command must create nothing"


def test_verify_without_a_gpu_says_so_and_checks_nothing(monkeypatch, capsys):
    """`grader verify` is the GPU suite: on a machine without one it used to build, grade every
    stage and run the benchmarks for many minutes, to end in a pile of 'not graded' problems."""
    from grader import capability, verify
    monkeypatch.setattr(capability, "device_capability", lambda: None)
    monkeypatch.setattr(verify, "environment", lambda: pytest.fail("verify went on without a GPU"))
    assert verify.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no CUDA device" in err and "nothing was checked" in err


def test_a_skipped_test_says_why_in_the_table():
    """`grader emulate` on a machine without g++: each check is skipped, and the table must say
    why (it read 'skipped (counts zero)' and nothing else)."""
    t = runner.TestResult("tests/test_emulated_kernels.py::test_x[1]", "skipped", "needs g++")
    assert "needs g++" in report.test_lines(t, 40)[0]


def test_a_stage_name_that_is_not_the_stages_own_is_refused():
    """'04_attention' names two stages: it used to grade (or reset) 04, rmsnorm, unsaid."""
    with pytest.raises(manifest.UnknownStage, match="stage 04 is 04_rmsnorm"):
        manifest.find("04_attention")
    with pytest.raises(manifest.UnknownStage, match="stage 07 is 07_attention"):
        manifest.find("07_atention")
    assert manifest.find("07_attention/").id == "07", "a shell-completed folder name is fine"


def test_emulate_runs_the_students_kernel_or_the_reference_on_the_cpu():
    """`grader emulate NN`: the reference passes, the skeleton reads TODO with its message (the
    student's file is the one built), a stage without kernels is a usage error."""
    ref = grader_cli("emulate", "04", "--solution")
    assert ref.returncode == 0, f"the reference RMSNorm in the emulator:\n{ref.stdout}\n{ref.stderr}"
    assert "not a grade" in ref.stdout
    mine = grader_cli("emulate", "04")
    assert mine.returncode == 1 and "TODO stage 04" in mine.stdout, \
        f"the skeleton must fail with its TODO:\n{mine.stdout[-2000:]}"
    assert "  TODO  TODO stage 04" in mine.stdout and " FAILED " not in mine.stdout, \
        f"an unwritten launcher reads TODO, as on a GPU, not FAILED:\n{mine.stdout[-2000:]}"
    none = grader_cli("emulate", "02")
    assert none.returncode == 2 and "has no kernel the emulator runs" in none.stderr


@pytest.mark.parametrize("argv,code,needle", [
    (["--help"], 0, "write nothing"),
    (["--chek"], 2, "unrecognized arguments: --chek"),
], ids=["help", "typo"])
def test_sync_takes_only_its_own_arguments(argv, code, needle, monkeypatch, capsys):
    """`grader.sync --help` and a mistyped `--check` used to regenerate stages/ and README."""
    def must_not_run():
        raise AssertionError("sync generated files for an argument it does not take")
    monkeypatch.setattr(sync, "expected_files", must_not_run)
    assert sync.main(argv) == code
    out, err = capsys.readouterr()
    assert needle in out + err



def test_the_help_lists_every_exit_status_and_both_hidden_folders(capsys):
    """`--help` listed 0, 1 and 2, not the class command's 3; the class help said
    `DIR/NN_name/ (or DIR/NN/)` while both folders are added."""
    from grader import __main__ as grader_cli
    assert grader_cli.main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "3 the course's tests changed while a student was graded" in text
    assert "130" in text
    for argv in (["class", "--help"], ["02", "--help"]):
        with pytest.raises(SystemExit):
            grader_cli.main(argv)
        text = " ".join(capsys.readouterr().out.split())
        assert "DIR/NN_name/ and DIR/NN/, each one that exists, are added" in text, argv

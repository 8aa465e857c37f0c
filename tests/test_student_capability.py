"""A stage whose kernels need sm_80 (stages.toml's min_cc) says so in one line on an older GPU, and
its GPU tests are not graded there (never passed). Runs on the CPU with a faked capability."""
from __future__ import annotations

import os
import textwrap

import pytest

from course import manifest
from grader import capability, pytest_setup, report, runner
from grader.__main__ import main


def test_the_manifest_names_the_sm80_stages():
    need = {s.id: s.min_cc for s in manifest.stages() if s.min_cc}
    assert need == {"12": "8.0", "14": "8.0"}
    assert manifest.find("07").min_cc is None


@pytest.mark.parametrize("cc, expected", [
    ((7, 5), "stage 12 needs compute capability 8.0; this GPU is 7.5"),
    ((7, 0), "stage 12 needs compute capability 8.0; this GPU is 7.0"),
    ((8, 0), None), ((8, 6), None), ((9, 0), None), ((10, 0), None)])
def test_the_line_for_each_capability(cc, expected):
    assert capability.too_old(manifest.find("12"), cc) == expected


def test_no_line_without_min_cc_or_without_a_gpu(monkeypatch):
    assert capability.too_old(manifest.find("07"), (7, 5)) is None
    monkeypatch.setattr(capability, "device_capability", lambda: None)
    assert capability.too_old(manifest.find("12")) is None


def test_grade_prints_it_and_runs_the_tests_not_graded(monkeypatch, capsys):
    seen = {}

    def fake_run_stage(stage, *args, **kwargs):
        seen[stage.id] = os.environ.get(capability.NOT_GRADED_ENV)
        return runner.StageResult(stage, "reference")
    monkeypatch.setattr(capability, "device_capability", lambda: (7, 5))
    monkeypatch.setattr(runner, "run_stage", fake_run_stage)
    monkeypatch.delenv(capability.NOT_GRADED_ENV, raising=False)
    main(["12", "--solution"])
    main(["07", "--solution"])
    out = capsys.readouterr().out
    assert "stage 12 needs compute capability 8.0; this GPU is 7.5" in out
    assert "stage 07 needs" not in out
    assert seen == {"12": "stage 12 needs compute capability 8.0; this GPU is 7.5", "07": None}
    assert capability.NOT_GRADED_ENV not in os.environ     # not left behind for the next stage
    assert main(["14", "--bench"]) == 0
    assert "stage 14 needs compute capability 8.0; this GPU is 7.5" in capsys.readouterr().out


def test_gpu_tests_read_not_graded_never_passed(tmp_path, monkeypatch):
    """The child's setup (grader/pytest_setup.py) on a GPU below min_cc: gpu tests are skipped
    'not graded: ...', which the runner scores zero and the table shows with the reason."""
    (tmp_path / "test_k.py").write_text(textwrap.dedent('''\
        import pytest

        @pytest.mark.gpu
        def test_kernel():
            pass

        def test_python():
            pass
    '''))
    monkeypatch.setattr(pytest_setup.environment, "has_cuda", lambda: True)
    reason = capability.too_old(manifest.find("12"), (7, 5))
    results = {}

    class Keep:
        def pytest_runtest_logreport(self, report):
            if report.when == "call" or report.skipped:
                results[report.nodeid.split("::")[-1]] = (report.outcome, report.longrepr)
    with capability.gpu_tests_not_graded(reason):
        assert os.environ[capability.NOT_GRADED_ENV] == reason
        pytest.main([str(tmp_path), "-q", "-p", "no:cacheprovider", "-p", "grader.pytest_setup"],
                    plugins=[Keep()])
    assert results["test_python"][0] == "passed"
    outcome, longrepr = results["test_kernel"]
    assert outcome == "skipped" and longrepr[2] == f"Skipped: not graded: {reason}"
    assert f"not graded: {reason}".startswith(runner.NOT_GRADED)
    t = runner.TestResult("stages/12_online_softmax/tests/test_k.py::test_kernel", "not_graded",
                          f"not graded: {reason}")
    line = report.test_lines(t, 30)[0]
    assert line.endswith("not graded: stage 12 needs compute capability 8.0; this GPU is 7.5")


def test_the_colab_notebook_is_a_notebook_that_grades():
    import json
    nb = json.loads((manifest.ROOT / "notebooks" / "colab_grade.ipynb").read_text())
    assert nb["nbformat"] == 4 and nb["cells"]
    code = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    assert "git clone" in code and "constraints.txt" in code and "python3 -m grader" in code
    for c in nb["cells"]:
        assert c["cell_type"] in ("code", "markdown") and isinstance(c["source"], list)
        if c["cell_type"] == "code":
            assert c["outputs"] == [] and c["execution_count"] is None

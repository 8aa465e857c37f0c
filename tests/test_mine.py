"""A learner runs the engine on their own parts: `--mine`, parts.select_mine(), and a script
that loads a part without asking hears that it got the reference."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from course import manifest, parts
from course.testing import fixtures

ROOT = Path(__file__).resolve().parent.parent


def student_root_with(tmp_path: Path, *stage_ids: str) -> Path:
    """A student's stages/ where the given stages are finished (the reference's part files)
    and every other stage is missing."""
    root = tmp_path / "stages"
    for stage_id in stage_ids:
        stage = manifest.find(stage_id)
        (root / stage.dir).mkdir(parents=True)
        for part in stage.parts:
            shutil.copy(stage.solution_dir() / part, root / stage.dir / part)
    return root


def run(args: list[str], root: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TINYVLLM_STUDENT")}
    env |= {"TINYVLLM_STUDENT_ROOT": str(root), "PYTHONPATH": str(ROOT),
            "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def test_finished_stages_are_those_without_a_todo_stub(tmp_path):
    root = student_root_with(tmp_path, "01", "02")
    assert parts.finished_stages(root) == ["01", "02"]
    config = root / "01_load" / "config.py"
    config.write_text(config.read_text() + '\n# TODO stage 01: a comment left behind is fine\n')
    assert parts.finished_stages(root) == ["01", "02"], "a TODO comment is not a stub"
    config.write_text(config.read_text() + 'raise NotImplementedError("TODO stage 01: x")\n')
    assert parts.finished_stages(root) == ["02"], "a TODO stub means the stage is not done"
    assert parts.finished_stages(ROOT / "stages") == [], "the skeletons are all unfinished"
    assert parts.describe_selection(["01", "02", "03", "07"]) \
        == "your parts: 01-03, 07; the reference: 04-06, 08-14"


def test_mine_runs_the_learners_parts_and_says_whose(tmp_path):
    model = tmp_path / "model"
    fixtures.save_tiny_llama(model, "gqa_tied")
    args = ["-m", "solutions.engine", "--mine", "--model", str(model), "--device", "cpu",
            "--json", "--max-tokens", "4"]
    root = student_root_with(tmp_path, "01")
    from tests.test_engine_cli import write_word_tokenizer
    write_word_tokenizer(model)
    mine = run(args, root)
    assert mine.returncode == 0, mine.stderr
    assert "your parts: 01; the reference: 02-14" in mine.stderr
    reference = run(args[:2] + args[3:], root)
    assert reference.returncode == 0 and mine.stdout == reference.stdout, \
        "a learner's finished stage equal to the reference must answer the same"

    # proof that their file, not the reference, ran: a finished part that fails its own way
    config = root / "01_load" / "config.py"
    config.write_text(config.read_text() + '\nraise ValueError("the learner\'s own config.py ran")\n')
    broken = run(args, root)
    assert broken.returncode == 2 and "the learner's own config.py ran" in broken.stderr, \
        broken.stderr
    served = run(["-m", "solutions.engine", "serve", "--mine", "--port", "0", "--model",
                  str(model), "--device", "cpu"], root)
    assert served.returncode == 2 and "the learner's own config.py ran" in served.stderr, \
        f"serve --mine must load the learner's parts too:\n{served.stderr}"


def test_a_script_that_loads_a_part_without_asking_is_told(tmp_path):
    root = student_root_with(tmp_path, "11")
    told = run(["-c", "from course import parts; parts.load('11', 'scheduler')"], root)
    assert told.returncode == 0, told.stderr
    assert "stage 11's scheduler.py is the reference's" in told.stderr
    assert "parts.select_mine()" in told.stderr

    asked = run(["-c", "from course import parts; print(parts.select_mine()); "
                       "print(parts.path('11', 'scheduler.py'))"], root)
    assert asked.returncode == 0, asked.stderr
    chosen, path = asked.stdout.splitlines()
    assert chosen == "['11']" and Path(path) == root / "11_continuous_batching" / "scheduler.py"
    assert "reference" not in asked.stderr


def test_select_mine_after_a_part_is_loaded_is_refused(tmp_path):
    late = run(["-c", "from course import parts; parts.load('02', 'stopping'); "
                      "parts.select_mine()"], student_root_with(tmp_path, "02"))
    assert late.returncode != 0 and "must come before any part is loaded" in late.stderr


def test_fast_parts_are_among_the_parts():
    for stage in manifest.stages():
        assert set(stage.fast_parts) <= set(stage.parts)

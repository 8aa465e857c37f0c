"""The pieces of class grading that need no class run: text, wire, submissions, similarity,
sandbox, compile timeout (grader/classroom/)."""
from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from course import manifest
from grader.classroom import cli, grade, protocol, sandbox, similarity, submission
from grader.classroom.text import clean
from tests.hostile import cases


def test_clean_is_xml_safe_and_capped():
    text = clean("\x00\x1b[31mred\x07\x0c" + "é" * 10_000, limit=1000)
    assert len(text.encode()) <= 1000 and "\x00" not in text and "\x1b" not in text
    ET.fromstring(f"<a>{text.replace('&', '&amp;').replace('<', '&lt;')}</a>")
    assert clean(b"\xff ok") == "\ufffd ok"


def test_replies_cannot_carry_code():
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))
    with pytest.raises(protocol.ProtocolError, match="only plain data"):
        protocol.safe_loads(pickle.dumps(Evil()), lambda pid: None)
    with pytest.raises(protocol.ProtocolError, match="unreadable"):
        protocol.safe_loads(b"\x80\x05garbage", lambda pid: None)
    assert protocol.safe_loads(pickle.dumps({"a": [1, 2.0, (b"x", None)], "s": {3}}),
                               lambda pid: None) == {"a": [1, 2.0, (b"x", None)], "s": {3}}


def test_a_huge_frame_is_refused(tmp_path):
    r, w = os.pipe()
    os.write(w, protocol.HEADER.pack(protocol.MAX_FRAME + 1))
    with pytest.raises(protocol.ProtocolError, match="over the"):
        protocol.read_frame(r)


def _ctx(tmp_path: Path) -> cases.Context:
    return cases.Context(manifest.ROOT, tmp_path / "extra", tmp_path / "subs" / "honest")


def _connection():
    """A judge's connection with no worker process: frames are read by a Worker here."""
    from grader.classroom import judge, snapshot
    conn = judge.Connection.__new__(judge.Connection)
    conn.gen, conn.kept, conn.lent, conn.extra_tests = 1, set(), {}, []
    conn.synced, conn.synced_digest, conn.test_modules = {}, {}, {}
    conn.snapshots, conn.mirrors = snapshot.Snapshots(), {}
    return conn


def _receive(worker, frame: bytes):
    """What the worker reads from one judge frame (the request), as its main loop would."""
    from grader.classroom import harness
    tag, states, body = pickle.loads(frame)
    worker.pending.update(states)
    message = harness._Requests(body, worker).load()
    for rid in list(worker.pending):
        worker.replica(rid)
    return message


def test_a_reference_object_crosses_to_the_worker_once():
    """What a test passes of a reference module that holds more than plain data (a
    Tokenizer: 7 MB, 2 s to unpickle) is sent once per worker and reused; changed, it is sent
    again (named by its bytes)."""
    from grader.classroom import harness
    from course import parts
    conn = _connection()
    stop = parts.reference("02", "stopping").StopChecker({2}, ["###"], max_tokens=5)
    stop.handle = object()              # not plain data: copied, never kept in step
    first, again = (conn._dumps(("call", 0, (stop,), {})) for _ in range(2))
    assert len(again) < len(first) - 40, "the second request carried the object again"
    worker = harness.Worker()
    a = _receive(worker, first)[2][0]
    b = _receive(worker, again)[2][0]
    assert a is b and a.check(2, "hi") == "eos"
    stop.max_tokens = 1
    changed = _receive(worker, conn._dumps(("call", 0, (stop,), {})))[2][0]
    assert changed is not a and changed.max_tokens == 1 and a.max_tokens == 5
    conn.kept.clear()                                   # a restarted worker holds nothing
    assert len(conn._dumps(("call", 0, (stop,), {}))) > len(again)


def test_an_object_of_plain_data_is_kept_in_step_both_ways():
    """Stage 11's Sequence given to a student's BlockManager: what the student's code does to
    it is what the test sees after the call (its lists kept themselves), and what the test
    changes reaches the worker's copy, which stays one object."""
    from grader.classroom import harness
    from course import parts
    conn, worker = _connection(), harness.Worker()
    seq = parts.reference("11", "sequence").Sequence(0, [1, 2, 3])
    table = seq.block_table
    mine = _receive(worker, conn._dumps(("call", 0, (seq,), {})))[2][0]
    assert mine is not seq and mine.token_ids == [1, 2, 3]
    mine.block_table.append(7)                          # the student's code at work
    mine.num_cached = 3
    mine.status = type(mine.status).RUNNING
    reply = pickle.loads(worker.reply(None))
    assert set(reply["synced"]) == {id(seq), id(seq.params)}, (
        "the object the call was given goes back, with the kept objects it holds")
    conn._apply(reply["synced"], reply["classes"], reply["storages"], {})
    assert seq.block_table == [7] and seq.block_table is table and seq.num_cached == 3
    assert seq.status is type(seq.status).RUNNING, "an enum member comes back as the judge's own"
    worker.touched.clear()
    seq.token_ids.append(9)                              # the test at work
    again = _receive(worker, conn._dumps(("call", 0, (seq,), {})))[2][0]
    assert again is mine and mine.token_ids == [1, 2, 3, 9] and mine.block_table == [7]
    unchanged = conn._dumps(("call", 0, (seq,), {}))
    assert not pickle.loads(unchanged)[1], "an object the worker already has is not sent again"


def test_dtypes_sizes_and_devices_come_back_as_torch_values():
    """A student's model.device reached the test as a handle, and torch.zeros(..., device=it)
    failed for every student; a device string that is not one is refused."""
    from grader.classroom import harness
    conn, worker = _connection(), harness.Worker()
    conn.mirrors = {}
    values = (torch.device("cpu"), torch.bfloat16, torch.Size([2, 3]))
    assert conn._decode(pickle.loads(worker.reply(values))) == values
    with pytest.raises(protocol.ProtocolError):
        conn._object(("device", "cpu; import os"), {}, {}, {})


def test_a_kept_object_cannot_shadow_its_methods():
    """The student's code may change a kept object's data, not replace what its class defines
    (the test would then call student code thinking it is the reference's)."""
    from grader.classroom import harness, protocol
    from course import parts
    conn, worker = _connection(), harness.Worker()
    seq = parts.reference("11", "sequence").Sequence(0, [1, 2, 3])
    mine = _receive(worker, conn._dumps(("call", 0, (seq,), {})))[2][0]
    vars(mine)["complete_step"] = 1
    reply = pickle.loads(worker.reply(None))
    with pytest.raises(protocol.ProtocolError, match="complete_step"):
        conn._apply(reply["synced"], reply["classes"], reply["storages"], {})


def test_a_students_syntax_error_keeps_its_message():
    """A part that does not parse reads 'SyntaxError: invalid syntax (x.py, line 3)' in the
    reports, not 'SyntaxError: None' (its str() is its msg, which a mirror must carry)."""
    from grader.classroom import harness
    conn, worker = _connection(), harness.Worker()
    conn.mirrors = {}
    try:
        compile("def broken(:", "scheduler.py", "exec")
    except SyntaxError as e:
        reply = pickle.loads(worker.reply(error=e))
    with pytest.raises(SyntaxError) as raised:
        conn._decode(reply)
    assert str(raised.value).startswith("invalid syntax") and "scheduler.py" in str(raised.value)


def test_submission_validation(tmp_path):
    subs, ctx, stage = tmp_path / "subs", _ctx(tmp_path), manifest.find("02")
    cases.honest(subs / "honest", ctx)
    for name in ("symlink_part", "symlink_stage", "symlink_student", "plain_file",
                 "pyc_beside_skeleton", "not_utf8"):
        cases.CHEATS[name](subs / name, ctx)
    found = {s.name: s for s in submission.students(subs)}
    assert "plain file" in found["plain_file"].invalid
    assert "symbolic link" in found["symlink_student"].invalid
    assert not found["honest"].invalid
    assert sorted(submission.read_parts(found["honest"], stage).files) == sorted(stage.parts)
    part = submission.read_parts(found["symlink_part"], stage)
    assert "stopping.py" not in part.files and "symbolic link" in " ".join(part.problems)
    assert not submission.read_parts(found["symlink_stage"], stage).files
    pyc = submission.read_parts(found["pyc_beside_skeleton"], stage)
    assert "bytecode" in " ".join(pyc.problems) and set(pyc.files) == set(stage.parts)
    assert submission.read_parts(found["not_utf8"], stage).files["stopping.py"][:2] == b"\xff\xfe"


def test_the_worker_never_sees_the_graded_reference(tmp_path):
    stage = manifest.find("02")
    root = submission.write_worker_root(tmp_path / "course", stage)
    assert not any((root / "solutions" / stage.dir / p).exists() for p in stage.parts)
    assert (root / "solutions" / stage.dir / "tokenizer.py").exists()   # not a part
    assert (root / "solutions" / "01_load" / "safetensors.py").exists()
    assert not (root / "stages").exists() and not (root / "conftest.py").exists()
    with pytest.raises(PermissionError if os.geteuid() else OSError):
        if os.geteuid() == 0:
            raise PermissionError   # root ignores file modes; the sandbox binds it read-only
        (root / "stages.toml").write_text("x")
    grade.remove(tmp_path / "course")
    assert not (tmp_path / "course").exists()


def test_a_judged_collection_error_is_reported(tmp_path, monkeypatch):
    """A test file that does not collect under the student's parts (its import fails) used to
    leave only its tests 'missing': run_tests' collection errors were dropped. They are the
    result's errors (the JSON's "errors", a JUnit <error>), cleaned like any student text."""
    from grader import runner
    from grader.classroom.collect import Case
    stage = manifest.find("02")
    cases.honest(tmp_path / "subs" / "alice", _ctx(tmp_path))
    student = submission.students(tmp_path / "subs")[0]
    error = ("could not collect stages/02_tokenize/tests/test_stopping.py:\n"
             "ImportError: cannot import name 'StopChecker'\x1b")
    monkeypatch.setattr(runner, "run_tests", lambda *args, **kwargs: ([], [error]))
    case = Case("stages/02_tokenize/tests/test_stopping.py::test_eos", 1.0, False)
    result, _ = grade.grade_stage(student, stage, [case], grade.Settings(), tmp_path)
    assert result.errors == [clean(error)], result.errors
    assert [t.outcome for t in result.tests] == ["missing"]


def test_similarity_sees_through_renaming():
    stage = manifest.find("02")
    ref = (stage.solution_dir() / "stopping.py").read_text()
    renamed = ref.replace("text", "s").replace("stop_strings", "pats") + "\n# mine\n"
    files = {"copy": {"stopping.py": renamed.encode()},
             "skel": {"stopping.py": (stage.skeleton_dir() / "stopping.py").read_bytes()}}
    pairs = similarity.report(stage, files)
    assert [(p.a, p.b) for p in pairs] == [("copy", "reference")] and pairs[0].share >= similarity.THRESHOLD


def test_progress_survives_a_torn_line(tmp_path):
    path = tmp_path / "p.jsonl"
    cli.append(path, {"student": "a", "stage": "02", "score": 1})
    with open(path, "a") as f:
        f.write('{"student": "b", "sta')
    assert list(cli.load_progress(path)) == [("a", "02")]


@pytest.mark.skipif(not sandbox.bwrap_path(), reason="bubblewrap cannot run here")
def test_sandbox_hides_the_course_and_the_network(tmp_path):
    code, out = sandbox.run(
        [sys.executable, "-c",
         "import os, socket\n"
         f"print('course', os.listdir({str(manifest.ROOT)!r}))\n"
         "try:\n    socket.create_connection(('1.1.1.1', 53), timeout=2); print('net yes')\n"
         "except OSError: print('net no')\n"
         "open('/etc/hostname-x', 'w')\n"],
        sandbox.Mounts(hidden=[manifest.ROOT]), tmp_path, {"PATH": os.environ["PATH"]}, 60)
    assert "net no" in out and "Read-only file system" in out, out
    listed = out.split("course", 1)[1].split("\n", 1)[0]
    assert "solutions" not in listed and "conftest.py" not in listed, out


def test_only_tests_are_lent_whatever_folder_holds_the_course(tmp_path):
    """The judge lends test objects to the worker and keeps course objects in step. Every
    folder a report went to counted as hidden tests: with a report in a folder above the
    course (/tmp/grades.csv, the course in /tmp/tiny-vllm) the course's own Sequence was lent,
    and honest stage 11 and 13 submissions lost most of their marks."""
    from grader.classroom import judge
    root = manifest.ROOT
    lender = type("Lender", (), {"extra_tests": [root.parent, tmp_path, root / "hidden"]})()

    def is_test(path: Path) -> bool:
        return judge.Connection._is_test_file(lender, path)
    assert not is_test(root / "solutions" / "11_continuous_batching" / "sequence.py")
    assert not is_test(root / "stages" / "11_continuous_batching" / "scheduler.py")
    assert is_test(root / "stages" / "11_continuous_batching" / "tests" / "test_scheduler.py")
    assert is_test(root / "conftest.py")
    assert is_test(tmp_path / "11_continuous_batching" / "test_hidden.py")
    assert is_test(root / "hidden" / "11_continuous_batching" / "test_hidden.py")
    assert is_test(root.parent / "11_continuous_batching" / "test_hidden.py")


def test_the_sandbox_starts_the_interpreter_through_a_symlinked_folder(tmp_path, monkeypatch):
    """A course or venv reached through a symlink under a hidden folder: the worker's python
    could not start, and every student scored 0 as if their code had crashed."""
    real = Path(sys.executable)
    link = tmp_path / "venv-link"
    link.symlink_to(real.parent.resolve(), target_is_directory=True)
    (tmp_path / "cwd").mkdir()
    monkeypatch.setattr(sys, "executable", str(link / real.name))
    assert sandbox.interpreter() == real.parent.resolve() / real.name
    code, out = sandbox.run([sys.executable, "-c", "print('started')"],
                            sandbox.Mounts(hidden=[tmp_path]), tmp_path / "cwd",
                            {"PATH": os.environ["PATH"]}, 60)
    assert code == 0 and "started" in out, out


def test_sandbox_timeout_ends_every_process(tmp_path):
    start = time.time()
    code, _ = sandbox.run(["sh", "-c", "sleep 4243.5 & sleep 4243.5"], sandbox.Mounts(),
                          tmp_path, {"PATH": os.environ["PATH"]}, 2)
    assert code is None and time.time() - start < 30
    for _ in range(100):   # a PID namespace is torn down asynchronously (busy machine: slower)
        ps = subprocess.run(["ps", "-eo", "stat,args"], capture_output=True, text=True).stdout
        alive = [ln for ln in ps.splitlines() if "sleep 4243.5" in ln and not ln.startswith("Z")]
        if not alive:
            break
        time.sleep(0.1)
    assert not alive, alive


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no CUDA toolkit")
def test_a_fifo_include_is_a_compile_failure_not_a_hang(tmp_path):
    """Only the part files are copied: the FIFO beside bf16.cu never reaches the compiler
    (and a compiler that hangs anyway is killed at the compile timeout)."""
    ctx, stage = _ctx(tmp_path), manifest.find("01")
    cases.COMPILE_ONLY["fifo_include"](tmp_path / "subs" / "fifo", ctx)
    student = submission.Student("fifo", tmp_path / "subs" / "fifo")
    found = submission.read_parts(student, stage)
    assert "special file" in " ".join(found.problems)
    ws = tmp_path / "ws"
    root = submission.write_student(ws / "student", stage, found.files)
    course = submission.write_worker_root(ws / "course", stage)
    (ws / "shared").mkdir()
    start = time.time()
    status = grade.compile_parts(stage, root, course, ws / "shared",
                                 grade.Settings(compile_timeout=120))
    assert status.startswith("FAILED") and "pipe.h" in status, status
    assert time.time() - start < 150
    grade.remove(ws)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no CUDA toolkit")
def test_a_stage_above_the_gpu_is_compiled_for_the_capability_it_needs(tmp_path, monkeypatch):
    """Stage 14 (cp.async: sm_80) graded on a T4 class machine: the student's kernel is
    compiled for 8.0, so it builds and its compile errors still show (an sm_75 build of the
    reference fails in ptxas)."""
    from course import build
    monkeypatch.setenv(build.ARCHS_ENV, "75")
    stage = manifest.find("14")
    ws = tmp_path / "ws"
    files = {p: (stage.solution_dir() / p).read_bytes() for p in stage.parts}
    root = submission.write_student(ws / "student", stage, files)
    course = submission.write_worker_root(ws / "course", stage)
    (ws / "shared").mkdir()
    status = grade.compile_parts(stage, root, course, ws / "shared",
                                 grade.Settings(compile_timeout=300))
    assert status == "ok", status
    grade.remove(ws)


def test_address_space_limit_only_without_a_gpu(monkeypatch):
    """CUDA maps the GPU's memory into the process: under RLIMIT_AS no CUDA process starts
    (seen on the H200 as "can't start new thread"), so none is set where a GPU is."""
    import functools
    import resource
    probe = [sys.executable, "-c",
             "import resource; print(resource.getrlimit(resource.RLIMIT_AS)[0])"]

    def child_limit(limits) -> int:
        out = subprocess.run(probe, capture_output=True, text=True, check=True,
                             preexec_fn=functools.partial(sandbox._limit, limits)).stdout
        return int(out)
    assert child_limit(sandbox.Limits(memory_bytes=8 << 30)) == 8 << 30
    assert child_limit(sandbox.Limits(memory_bytes=None)) == resource.getrlimit(
        resource.RLIMIT_AS)[0]
    monkeypatch.setattr(sandbox.Path, "glob",
                        lambda self, pattern: iter([Path("/dev/nvidia0")]))
    assert sandbox.Limits().memory_bytes is None
    monkeypatch.undo()
    assert sandbox.Limits().memory_bytes == (16 << 30 if not list(Path("/dev").glob(
        "nvidia[0-9]*")) else None)


@pytest.mark.parametrize("argv,needle", [
    ([], "holds no student folders: nothing to grade"),
    (["--stages", ""], "--stages '' names no stage"),
], ids=["no-students", "no-stages"])
def test_a_class_with_nothing_to_grade_is_an_error(tmp_path, capsys, argv, needle):
    """An empty SUBMISSIONS folder (a mistyped path) used to print the sandbox line and exit 0,
    having graded no one; '--stages ""' graded every stage. Both are usage errors, exit 2,
    and no progress file is written."""
    from grader import __main__ as grader_cli
    subs = tmp_path / "subs"
    subs.mkdir()
    assert grader_cli.main(["class", str(subs), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err, err
    assert not (tmp_path / "subs-progress.jsonl").exists()


def test_a_grade_made_against_changed_tests_is_not_kept(tmp_path, monkeypatch, capsys):
    """The tests changed while a student was graded (possible without a sandbox): the run
    stops with status 3 before that grade reaches the progress file, so --resume grades the
    student again once the course is restored."""
    from grader import __main__ as grader_cli
    from grader import runner
    hidden = tmp_path / "hidden" / "02_tokenize"
    hidden.mkdir(parents=True)
    (hidden / "test_hidden.py").write_text("def test_sum():\n    assert 1 + 1 == 2\n")
    cases.honest(tmp_path / "subs" / "alice", _ctx(tmp_path))

    def spoiling_student(student, stage, *args):
        (hidden / "test_hidden.py").write_text("def test_sum():\n    pass\n")
        return runner.StageResult(stage, "x", []), []
    monkeypatch.setattr(grade, "grade_stage", spoiling_student)
    progress = tmp_path / "progress.jsonl"
    assert grader_cli.main(["class", str(tmp_path / "subs"), "--stages", "02", "--extra-tests",
                            str(tmp_path / "hidden"), "--progress", str(progress)]) == 3
    assert "changed while alice was graded (stage 02, not kept)" in capsys.readouterr().err
    assert not cli.load_progress(progress), "the grade made against changed tests was kept"



def _fake_bwrap(folder: Path, works: bool) -> str:
    """A `bwrap` that passes the sandbox's probe or fails it."""
    folder.mkdir(parents=True)
    exe = folder / "bwrap"
    exe.write_text(f"#!/bin/sh\nexit {0 if works else 1}\n")
    exe.chmod(0o755)
    return str(exe)


@pytest.mark.parametrize("path_works", [True, False], ids=["path-works", "path-fails"])
def test_tinyvllm_bwrap_comes_first_and_each_bwrap_is_tried(tmp_path, monkeypatch, path_works):
    """TINYVLLM_BWRAP was ignored when a bwrap was on PATH, and a PATH bwrap that failed its
    probe meant no sandbox, the others untried."""
    on_path = _fake_bwrap(tmp_path / "bin", path_works)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    chosen = _fake_bwrap(tmp_path / "chosen", True)
    broken = _fake_bwrap(tmp_path / "broken", False)
    sandbox.bwrap_path.cache_clear()
    try:
        monkeypatch.setenv(sandbox.BWRAP_ENV, chosen)
        assert sandbox.candidates()[:2] == [chosen, on_path]
        assert sandbox.bwrap_path() == chosen, "the variable comes first"
        sandbox.bwrap_path.cache_clear()
        monkeypatch.setenv(sandbox.BWRAP_ENV, broken)
        assert sandbox.bwrap_path() == (on_path if path_works else next(
            (c for c in sandbox.candidates()[2:] if sandbox._works(c)), None)), \
            "a bwrap that fails its probe: the next one is tried"
    finally:
        monkeypatch.undo()
        sandbox.bwrap_path.cache_clear()


def test_a_zips_macosx_folder_is_not_a_student(tmp_path):
    """A zip made on a Mac unpacks a __MACOSX/ folder beside the students': it was graded as
    one (0 for every stage)."""
    for name in ("__MACOSX", ".DS_Store", "alice"):
        (tmp_path / name).mkdir()
    assert [s.name for s in submission.students(tmp_path)] == ["alice"]


def test_a_collection_error_is_shown_from_its_start(tmp_path):
    """The last 3,000 characters of pytest's output began mid-line, inside the list of the
    tests that did collect, with the import error at the very end."""
    from grader.classroom import collect
    listed = "".join(f"stages/02_tokenize/tests/test_x.py::test_{i}\n" for i in range(200))
    errors = ("=" * 30 + " ERRORS " + "=" * 30 + "\n_ ERROR collecting test_broken.py _\n"
              "E   ModuleNotFoundError: No module named 'nonexistent'\n")
    shown = collect._errors(listed + errors)
    assert shown.startswith("=" * 30 + " ERRORS") and "ModuleNotFoundError" in shown, shown
    shown = collect._errors(listed)
    assert shown.startswith("stages/") and len(shown) <= 3000, shown[:80]


def test_the_graders_own_reports_are_not_students(tmp_path, monkeypatch):
    """`grader class . --csv grades.csv` run inside SUBMISSIONS: the next run graded
    grades.csv (and the progress file) as students with 0 for every stage."""
    (tmp_path / "alice").mkdir()
    for name in ("grades.csv", "grades.json", "notes.txt"):
        (tmp_path / name).write_text("x")
    monkeypatch.chdir(tmp_path)
    got = submission.students(tmp_path, (Path("grades.csv"), tmp_path / "grades.json"))
    assert [(s.name, bool(s.invalid)) for s in got] == [("alice", False), ("notes.txt", True)]


def test_a_student_named_reference_is_refused(tmp_path, capsys):
    """The similarity report names the course's solution 'reference': a student of that name
    could not be told from it."""
    from grader import __main__ as grader_cli
    for name in ("alice", "reference"):
        (tmp_path / "subs" / name).mkdir(parents=True)
    assert grader_cli.main(["class", str(tmp_path / "subs"), "--stages", "02"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "named 'reference'" in err and "rename" in err, err
    assert not (tmp_path / "subs-progress.jsonl").exists()


def test_plain_attributes_come_with_the_reply_and_go_when_student_code_runs():
    """Reading two attributes of each of 70 waiting sequences every step was 100,000 round
    trips for stage 11's soak test. The plain attributes of the student objects a reply names
    come with it, and later reads are answered from them until student code may have run;
    a property is always asked."""
    from grader.classroom import harness
    from course import parts
    conn, worker = _connection(), harness.Worker()
    Sequence = parts.reference("11", "sequence").Sequence
    queue = [Sequence(i, [1, 2, 3]) for i in range(70)]
    asked = []
    conn.request = lambda gen, op, hid, *args: asked.append((op, args)) or 0

    def reply(value, pure: bool):
        worker.pure = pure
        return conn._decode(pickle.loads(worker.reply(value)))
    got = reply(queue, pure=True)          # the list read from a plain attribute
    assert [s.seq_id for s in got] == list(range(70))
    assert all(s.block_table == [] and s.num_cached == 0 for s in got) and not asked
    got[0].block_table.append(5)           # a value is decoded afresh on every read
    assert got[0].block_table == []
    assert got[0].num_tokens == 0 and asked == [("getattr", ("num_tokens",))], \
        "a property runs student code: asked, never snapshotted"
    queue[1].num_cached = 3                # the student's code at work during a call
    reply(None, pure=False)
    asked.clear()
    got[1].num_cached
    assert asked == [("getattr", ("num_cached",))], "after student code ran, reads are asked"


def test_a_snapshot_names_no_tensor_and_nothing_the_worker_could_not_say():
    """Tensors are never snapshotted (a model's weights would cross on every reply), and a
    snapshot that names anything but plain data and handles is an invalid reply."""
    from grader.classroom import harness, judge
    conn, worker = _connection(), harness.Worker()
    conn.proc, conn.deaths = None, 0

    class Holder:
        def __init__(self):
            self.weight, self.size = torch.ones(1000), 7
    worker.pure = True
    envelope = pickle.loads(worker.reply(Holder()))
    (snap,) = envelope["snapshots"].values()
    assert set(snap) == {"size"}
    snap["size"] = pickle.dumps(torch.ones(2))       # a forged snapshot: refused when read
    held = conn._decode(envelope)
    with pytest.raises(judge.WorkerFailed, match="invalid reply"):
        held.size


def test_the_judge_holds_a_bounded_amount_of_snapshots(monkeypatch):
    """Replies that say no student code ran add their snapshots to those held; a worker that
    says so of every reply must not fill the judge's memory (it is outside the sandbox's
    limits): past MAX_HELD the old ones go."""
    from grader.classroom import snapshot
    monkeypatch.setattr(snapshot, "MAX_HELD", 100)
    held = snapshot.Snapshots()
    for hid in (1, 2):
        held.take({"snapshots": {hid: {"x": b"y" * 60}}, "pure": True, "callback": None})
    assert list(held.by_handle) == [2] and held.held == 60
    with pytest.raises(protocol.ProtocolError, match="wrong shape"):
        held.take({"snapshots": {3: {"x": "not bytes"}}, "pure": True, "callback": None})

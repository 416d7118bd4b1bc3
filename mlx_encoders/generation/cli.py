"""`python -m mlx_encoders generate --model PATH "prompt"`: stream a continuation to the terminal.

The prompt comes from the argument, or from stdin when there is none. stdout gets the prompt and then the
continuation as it arrives; stderr gets the token counts and speeds.
"""

import argparse
import sys
import time
import warnings

from ..errors import OptionError
from ..records import stdin_lines
from .config import PRESETS
from .loop import generation_config, streams

OPTIONS = {  # flag -> (type, help); each is a GenerationConfig field of the same name
    "max_new_tokens": (int, "tokens to generate (default 100)"),
    "min_new_tokens": (int, "no end of text before this many new tokens"),
    "temperature": (float, "sampling temperature"),
    "top_k": (int, "sample from the k most likely tokens (0: all)"),
    "top_p": (float, "sample from the smallest set of tokens whose mass reaches p"),
    "repetition_penalty": (float, "penalise tokens already present (> 1: less repetition)"),
    "seed": (int, "random seed, for reproducible sampling"),
}


def add_parser(tasks) -> None:
    p = tasks.add_parser("generate", help="continue a prompt with a causal language model (GPT-2), streamed")
    p.add_argument("prompt", nargs="?", help="the text to continue (default: all of stdin)")
    p.add_argument("--model", "-m", required=True, help="checkpoint folder or Hugging Face hub id")
    p.add_argument(
        "--preset",
        choices=PRESETS,
        help="decoding strategy (default: the model's generation_config.json, else greedy, which ignores "
        "--temperature, --top-k, --top-p, --seed: it warns)",
    )
    for name, (kind, text) in OPTIONS.items():
        p.add_argument("--" + name.replace("_", "-"), type=kind, help=text)
    p.add_argument("--stop", action="append", help="end the text before this string (repeatable)")
    p.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), help="cast the weights (default: as stored)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from .. import load

    if args.prompt is None and sys.stdin.isatty():
        raise ValueError("no prompt: give it as an argument or pipe it in")
    prompt = args.prompt
    if prompt is None:  # all of stdin, without a byte-order mark or Windows line ends, as the other commands read it
        prompt = "".join(stdin_lines()).removeprefix("\ufeff").replace("\r\n", "\n")
    overrides = {name: getattr(args, name) for name in OPTIONS if getattr(args, name) is not None}
    try:  # the options alone, refused before the model loads (exit status 2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            generation_config(args.preset, {"max_new_tokens": 100, **overrides, "stop": args.stop})
    except (TypeError, ValueError) as e:
        raise OptionError(str(e)) from None
    model, tokenizer = load(args.model, dtype=args.dtype, task="causal-lm")
    config = generation_config(args.preset, {"max_new_tokens": 100, **overrides, "stop": args.stop}, model)
    (stream,), steps = streams(model, tokenizer, [prompt], config)
    print(prompt, end="", flush=True)
    start, count, first = time.perf_counter(), 0, None
    for chosen in steps:
        count += 1
        first = first or time.perf_counter()
        print(stream.add(int(chosen[0])), end="", flush=True)
        if stream.done:
            break
    stream.done = True
    print(stream.flush(), flush=True)
    end = time.perf_counter()
    rate = f", {(count - 1) / (end - first):.1f} tokens/s" if count > 1 else ""
    took = (first or end) - start
    summary = f"{stream.prompt_length} prompt tokens, first token in {took:.2f} s; {count} generated{rate}"
    print(f"[{summary}]", file=sys.stderr)
    return 0

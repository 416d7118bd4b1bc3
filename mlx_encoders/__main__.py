"""`python -m mlx_encoders TASK --model PATH [TEXT ...]` (or `mlx-encoders TASK ...`): fill-mask, classify, tokens,
answer, embed.

Texts come from the arguments, or one per line from stdin when there are none. Results print as tables,
or as JSON with `--json`: a list with one {"input", "result"} entry per text, one entry per line (`--indent N`
spreads it out), where "result" is what the Python API returns for that text (`mlx_encoders.pipeline(...)`,
`SentenceEncoder.encode`).
"""

import argparse
import json
import math
import sys

import mlx.core as mx
import numpy as np

from .checkpoint.build import DTYPES
from .errors import add_debug_option, non_negative, positive, run_command
from .pipelines.token_classification import STRATEGIES
from .records import stdin_texts
from .train import cli as train_cli
from .train import retrieval_cli


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlx-encoders", description="Run BERT-family encoders on MLX.")
    tasks = p.add_subparsers(dest="task", required=True, metavar="TASK")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("texts", nargs="*", metavar="TEXT", help="input texts (default: one per line from stdin)")
    common.add_argument("--model", "-m", required=True, help="checkpoint folder or Hugging Face hub id")
    common.add_argument("--json", action="store_true", help="print JSON, one line per text, instead of a table")
    common.add_argument("--indent", type=int, metavar="N", help="with --json: indent N spaces per level instead")
    common.add_argument("--batch-size", type=positive, default=32, help="texts per forward pass (default 32)")
    common.add_argument("--dtype", choices=DTYPES, help="cast the weights (default: as stored)")

    fill = tasks.add_parser("fill-mask", parents=[common], help="predict the masked token(s)")
    fill.add_argument("--top-k", type=positive, default=5, help="predictions per mask (default 5)")
    # one comma-separated value (repeatable): with nargs="+" the texts after it were taken as targets
    fill.add_argument("--targets", type=comma_list, action="extend", metavar="T1,T2",
                      help="only score these tokens, comma-separated: --targets paris,london (repeatable; a "
                           "leading space picks a BPE model's word-start token)")  # fmt: skip

    classify = tasks.add_parser("classify", parents=[common], help="text classification, pairs and reranking")
    classify.add_argument(
        "--top-k", type=label_count, help="labels per text (0 or -1: all; default 1); with --rerank, the texts shown"
    )
    classify.add_argument("--query", help="score each TEXT as the pair (QUERY, TEXT), as a cross-encoder does")
    classify.add_argument("--rerank", action="store_true", help="with --query: print the texts best first")
    classify.add_argument("--function", choices=("softmax", "sigmoid", "none"), help="score function")

    tokens = tasks.add_parser("tokens", parents=[common], help="token classification: named entities, tags")
    tokens.add_argument("--aggregation", choices=STRATEGIES, default="simple",
                        help="group tokens into entities (default simple; none: one row per token)")  # fmt: skip
    tokens.add_argument("--stride", type=non_negative,
                        help="split long texts into windows overlapping by this many tokens")  # fmt: skip

    answer = tasks.add_parser("answer", parents=[common], help="extractive question answering over each context")
    answer.add_argument("--question", "-q", required=True, help="the question to answer from each context")
    answer.add_argument("--context", "-c", action="append", help="a context (repeatable), before any TEXT")
    answer.add_argument("--top-k", type=positive, default=1, help="answers per context (default 1)")
    answer.add_argument("--max-answer-len", type=positive, default=15, help="longest answer in tokens (default 15)")
    answer.add_argument("--allow-no-answer", action="store_true", help="answer '' when no span scores higher")

    embed = tasks.add_parser("embed", parents=[common], help="sentence embeddings (SentenceEncoder)")
    embed.add_argument("--normalize", action="store_true", help="L2-normalize the embeddings")

    # Commands with their own options and output set `run` (a function of the parsed arguments -> exit status).
    train_cli.add_parser(tasks)
    retrieval_cli.add_parsers(tasks)
    from .generation import cli as generation_cli  # streams its own output: mlx_encoders/generation/cli.py

    generation_cli.add_parser(tasks)
    from .index import cli as index_cli  # build and search: mlx_encoders/index/cli.py

    index_cli.add_parser(tasks)

    from . import launch  # N ranks on this machine: mlx_encoders/launch.py

    launch.add_parser(tasks)
    from .serve import cli as serve_cli  # the HTTP server: mlx_encoders/serve/ (imports Starlette only when run)

    serve_cli.add_parser(tasks)
    add_debug_option(p)
    return p


def label_count(text: str) -> int:
    """--top-k of classify: a count of labels, or 0 or -1 for all of them (transformers' top_k=None)."""
    try:
        count = int(text)
    except ValueError:
        count = -2
    if count < -1:
        raise argparse.ArgumentTypeError(f"must be a number of labels (1 or more), or 0 or -1 for all; got {text!r}")
    return count


def read_texts(args: argparse.Namespace) -> list[str]:
    if getattr(args, "context", None) or args.texts:
        return (getattr(args, "context", None) or []) + args.texts
    return stdin_texts()


def table(header: list[str], rows: list[list]) -> str:
    """Columns padded to their widest cell; floats to 4 decimals; numbers right-aligned."""
    cells = [[f"{v:.4f}" if isinstance(v, float) else str(v) for v in row] for row in rows]
    widths = [max(len(c) for c in column) for column in zip(header, *cells, strict=True)]
    numeric = [all(isinstance(row[i], (int, float)) for row in rows) for i in range(len(header))]

    def line(values):
        cells = (v.rjust(w) if n else v.ljust(w) for v, w, n in zip(values, widths, numeric, strict=True))
        return "  ".join(cells).rstrip()

    return "\n".join([line(header), *(line(r) for r in cells)])


def fill_mask(args, texts: list[str]):
    from .pipelines import pipeline

    fill = pipeline("fill-mask", model=args.model, batch_size=args.batch_size, dtype=args.dtype)
    results = fill(texts, top_k=args.top_k, targets=args.targets)
    results = [results] if len(texts) == 1 else results

    def show(text, result):
        masks = result if result and isinstance(result[0], list) else [result]
        parts = [text]
        for m, predictions in enumerate(masks, start=1):
            rows = [[i, p["token_str"], p["score"], p["sequence"]] for i, p in enumerate(predictions, start=1)]
            title = [f"mask {m} of {len(masks)}"] if len(masks) > 1 else []
            parts += [*title, table(["rank", "token", "score", "sequence"], rows)]
        return "\n".join(parts)

    return results, show


def classify(args, texts: list[str]):
    from .pipelines import pipeline

    if args.rerank:
        ranked = rerank(args, texts)
        rows = [[i, r["score"], r["corpus_id"], r["text"]] for i, r in enumerate(ranked, start=1)]
        return ranked, table(["rank", "score", "input", "text"], rows)
    clf = pipeline("text-classification", model=args.model, batch_size=args.batch_size, dtype=args.dtype)
    inputs = [{"text": args.query, "text_pair": t} for t in texts] if args.query is not None else texts
    top_k = 1 if args.top_k is None else args.top_k if args.top_k > 0 else None
    results = clf(inputs, top_k=top_k, function_to_apply=args.function)

    def show(text, labels):
        return table(["label", "score", "text"], [[r["label"], r["score"], text] for r in labels])

    return results, show


def rerank(args, texts: list[str]) -> list[dict]:
    """The texts best first as `CrossEncoder.rank` scores them: the activation saved with a cross-encoder folder (or
    --function's), a Qwen3-Reranker's yes/no logits; a head of several labels by its last label, as the
    text-classification pipeline's `rerank` does."""
    from .embeddings.cross_encoder import CrossEncoder
    from .pipelines import pipeline

    top_k = args.top_k if args.top_k and args.top_k > 0 else None
    encoder = CrossEncoder(args.model, dtype=args.dtype)
    if encoder.num_labels != 1:
        clf = pipeline("text-classification", model=(encoder.model, encoder.tokenizer), batch_size=args.batch_size)
        return clf.rerank(args.query, texts, top_k=top_k, function_to_apply=args.function)
    functions = {"sigmoid": mx.sigmoid, "softmax": lambda x: mx.softmax(x, axis=-1), "none": lambda x: x}
    activation = functions.get(args.function)
    return encoder.rank(
        args.query, texts, top_k, return_documents=True, batch_size=args.batch_size, activation_fn=activation
    )


def tokens(args, texts: list[str]):
    from .pipelines import pipeline

    ner = pipeline("token-classification", model=args.model, batch_size=args.batch_size, dtype=args.dtype)
    results = ner(texts, aggregation_strategy=args.aggregation, stride=args.stride)
    grouped = args.aggregation != "none"

    def show(text, entities):
        header = ["entity", "score", "word", "start", "end"]
        rows = [[e["entity_group" if grouped else "entity"], float(e["score"]), e["word"], e["start"], e["end"]]
                for e in entities]  # fmt: skip
        return "\n".join([text, table(header, rows) if rows else "(no entities)"])

    return results, show


def answer(args, texts: list[str]):
    from .pipelines import pipeline

    qa = pipeline("question-answering", model=args.model, batch_size=args.batch_size, dtype=args.dtype)
    results = qa(
        question=[args.question] * len(texts), context=texts, top_k=args.top_k, max_answer_len=args.max_answer_len,
        handle_impossible_answer=args.allow_no_answer,
    )  # fmt: skip
    results = [results] if len(texts) == 1 else results

    def show(context, answers):
        answers = answers if isinstance(answers, list) else [answers]
        rows = [[i, a["answer"], float(a["score"]), a["start"], a["end"]] for i, a in enumerate(answers, start=1)]
        return "\n".join([context, table(["rank", "answer", "score", "start", "end"], rows)])

    return results, show


def embed(args, texts: list[str]):
    from .embeddings.sentence import SentenceEncoder

    encoder = SentenceEncoder(args.model, dtype=args.dtype)
    vectors = encoder.encode(texts, batch_size=args.batch_size, normalize_embeddings=args.normalize)
    results = [v.tolist() for v in vectors]
    rows = [[len(v), float(np.linalg.norm(v)), " ".join(f"{x:+.4f}" for x in v[:4]) + " ...", t]
            for v, t in zip(vectors, texts, strict=True)]  # fmt: skip
    return results, table(["dim", "norm", "first values", "text"], rows)


TASKS = {"fill-mask": fill_mask, "classify": classify, "tokens": tokens, "answer": answer, "embed": embed}


def comma_list(value: str) -> list[str]:
    """Targets as typed, spaces included: a leading space picks a BPE model's word-start token, as transformers'
    targets=[" list"] does."""
    items = value.split(",")
    if not all(item.strip() for item in items):
        raise argparse.ArgumentTypeError(f"empty target in {value!r}; give tokens separated by commas: paris,london")
    return items


def to_json(records: list, indent: int | None = None) -> str:
    """A JSON list with one record per line (a 384-number vector stays on its line), or indented throughout.
    NaN and infinity, which JSON lacks, become null, with one warning on stderr."""
    replaced = [0]
    records = finite(records, replaced)
    if replaced[0]:
        print(f"mlx-encoders: warning: {replaced[0]} NaN or infinite number(s) written as null", file=sys.stderr)
    if indent is not None or not records:
        return json.dumps(records, indent=indent, ensure_ascii=False, allow_nan=False)
    return "[\n" + ",\n".join(json.dumps(r, ensure_ascii=False, allow_nan=False) for r in records) + "\n]"


def finite(value, replaced: list[int]):
    """`value` with numpy scalars and arrays as Python numbers and lists (token classification's scores are numpy
    floats, as in transformers), and each non-finite float as None, counted in `replaced[0]`."""
    if isinstance(value, dict):
        return {k: finite(v, replaced) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v, replaced) for v in value]
    if isinstance(value, (np.ndarray, np.generic)):
        return finite(value.tolist(), replaced)
    if isinstance(value, float) and not math.isfinite(value):
        replaced[0] += 1
        return None
    return value


def print_results(args: argparse.Namespace, texts: list[str], results, show) -> None:
    if args.json:
        if args.task == "classify" and args.rerank:
            print(to_json(results, args.indent))
        else:
            entries = [{"input": t, "result": r} for t, r in zip(texts, results, strict=True)]
            print(to_json(entries, args.indent))
    elif isinstance(show, str):
        print(show)
    else:
        print("\n\n".join(show(t, r) for t, r in zip(texts, results, strict=True)))


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if getattr(args, "indent", None) is not None and (not getattr(args, "json", True) or args.indent < 0):
        p.error("--indent N (N >= 0) spreads out --json output; give it with --json")
    if getattr(args, "rerank", False) and args.query is None:
        p.error("--rerank needs --query (the text the others are ranked against)")
    if args.task == "tokens" and args.stride is not None and args.aggregation == "none":
        p.error("--stride needs an --aggregation other than none, to merge the windows")
    return run_command(f"mlx-encoders {args.task}", lambda: run(args), args.debug)


def run(args: argparse.Namespace) -> int:
    if hasattr(args, "run"):  # generate, index, evaluate, ...: they print as they go
        return args.run(args)
    texts = read_texts(args)
    results, show = TASKS[args.task](args, texts)
    print_results(args, texts, results, show)
    sys.stdout.flush()  # a closed pipe fails here, within run_command, not at exit
    return 0


if __name__ == "__main__":
    sys.exit(main())

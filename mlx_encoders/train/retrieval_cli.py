"""`mlx-encoders evaluate {retrieval,rerank} ...` and `mlx-encoders mine ...`: the retrieval evaluators and
hard-negative mining from the command line (`train/evaluators.py`, `train/hard_negatives.py`)."""

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

from ..checkpoint.atomic import user_mode
from ..errors import positive
from ..records import jsonl_records, text_lines, writable_file

SIMILARITY_NAMES = ("cosine", "dot", "euclidean", "manhattan")


def int_list(text: str) -> list[int]:
    try:
        values = [int(k) for k in text.split(",")]
    except ValueError:
        values = [0]
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers such as 1,3,10, got {text!r}")
    return values


def write_atomically(path: Path, text: str) -> None:
    """`text` into `path` through a temporary file in the same folder: never a half-written file; the file gets the
    mode a new file gets (umask), and an error names `path`."""
    writable_file(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, user_mode() & 0o666)  # mkstemp's files are private (0600)
        os.replace(tmp, path)
    except OSError as e:
        os.unlink(tmp)
        raise OSError(e.errno, f"could not write {path}: {e.strerror or e}") from e
    except BaseException:
        os.unlink(tmp)
        raise


def extra_documents(path: Path) -> list[str]:
    """The texts of `mine --corpus`: the documents `index build` reads from a folder or a .jsonl, .csv or .parquet
    file, else the file's lines (a .txt file, a pipe)."""
    if not path.is_dir() and path.suffix.lower() not in (".jsonl", ".csv", ".parquet"):
        return [record.value for record in text_lines(path)]
    from ..index.documents import read_corpus

    return [text for _, text in read_corpus(path)]


def add_parsers(commands: argparse._SubParsersAction) -> None:
    evaluate = commands.add_parser(
        "evaluate",
        help="retrieval (NDCG@10, MRR@10, MAP@100, ...) or reranking metrics of a model",
        description="Metrics as sentence-transformers' InformationRetrievalEvaluator / CrossEncoderRerankingEvaluator.",
    )
    kinds = evaluate.add_subparsers(dest="kind", required=True, metavar="KIND")
    retrieval = kinds.add_parser(
        "retrieval",
        help="embedding model on queries, a corpus and relevance judgements (BEIR's JSONL files)",
        description='queries/corpus: JSONL lines {"_id": ..., "text": ...} (corpus lines may have a "title"); qrels: '
        'JSONL lines {"query-id": ..., "corpus-id": ..., "score": ...} or BEIR\'s qrels TSV; a score <= 0 is '
        "not relevant.",
    )
    retrieval.add_argument("--model", "-m", required=True, help="sentence-transformers folder or hub id")
    retrieval.add_argument("--queries", required=True, help="queries JSONL")
    retrieval.add_argument("--corpus", required=True, help="corpus JSONL")
    retrieval.add_argument("--qrels", required=True, help="relevance judgements: JSONL or TSV")
    retrieval.add_argument("--score-functions", nargs="+", choices=SIMILARITY_NAMES, help="default: the model's")
    retrieval.add_argument("--query-prompt", help="text put before each query (default: the model's query prompt)")
    retrieval.add_argument("--corpus-prompt", help="text put before each document")
    retrieval.add_argument("--truncate-dim", type=positive, help="keep the first N dimensions (Matryoshka)")
    for name, default in (("accuracy", "1,3,5,10"), ("precision-recall", "1,3,5,10"), ("mrr", "10"),
                          ("ndcg", "10"), ("map", "100")):  # fmt: skip
        retrieval.add_argument(f"--{name}-at-k", type=int_list, default=int_list(default), help=f"default {default}")
    rerank = kinds.add_parser(
        "rerank",
        help="cross-encoder on queries with positive and negative documents",
        description='samples: JSONL lines {"query": ..., "positive": [...], "negative": [...]}, or with "documents": '
        "[...] (a first-stage ranking, best first) in place of negatives.",
    )
    rerank.add_argument("--model", "-m", required=True, help="cross-encoder folder or hub id")
    rerank.add_argument("--samples", required=True, help="samples JSONL")
    rerank.add_argument("--at-k", type=positive, default=10, help="MRR@k and NDCG@k (default 10)")
    for p in (retrieval, rerank):
        p.add_argument("--batch-size", type=positive, default=32, help="texts per forward pass (default 32)")
        p.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    evaluate.set_defaults(run=run_evaluate)
    add_mine_parser(commands)


def add_mine_parser(commands: argparse._SubParsersAction) -> None:
    from .hard_negatives import FORMATS, STRATEGIES

    mine = commands.add_parser(
        "mine",
        help="mine hard negatives for (anchor, positive) rows with an embedding model",
        description="As sentence-transformers' mine_hard_negatives; writes JSONL rows in the chosen format.",
    )
    mine.add_argument("--model", "-m", required=True, help="sentence-transformers folder or hub id")
    mine.add_argument("--data", required=True, help="JSONL, CSV or TSV rows with an anchor and a positive column")
    mine.add_argument("--output", "-o", required=True, help="JSONL file to write")
    mine.add_argument("--anchor-column", help="default: the first column")
    mine.add_argument("--positive-column", help="default: the second column")
    mine.add_argument(
        "--corpus", help="extra candidate documents: a .txt file, one a line, or a corpus as `index build` reads it "
        "(a folder, or a .jsonl, .csv or .parquet file: its texts)",
    )  # fmt: skip
    mine.add_argument("--cross-encoder", help="rescore the candidates with this cross-encoder before filtering")
    mine.add_argument("--num-negatives", type=int, default=3, help="default 3")
    mine.add_argument("--range-min", type=int, default=0, help="skip the best N candidates (default 0)")
    mine.add_argument("--range-max", type=int, help="consider the best N candidates (default: as theirs)")
    mine.add_argument("--absolute-margin", type=float, help="drop candidates scoring above positive - margin")
    mine.add_argument("--relative-margin", type=float, help="drop candidates above positive - |positive| x margin")
    mine.add_argument("--max-score", type=float, help="drop candidates scoring above this")
    mine.add_argument("--min-score", type=float, help="drop candidates scoring below this")
    mine.add_argument("--sampling", choices=STRATEGIES, default="top", help="top (default) or random")
    mine.add_argument("--seed", type=int, help="for --sampling random")
    mine.add_argument("--format", choices=FORMATS, default="triplet", help="output rows (default triplet)")
    mine.add_argument("--scores", action="store_true", help="add the scores to each row")
    mine.add_argument("--batch-size", type=positive, default=32, help="texts per forward pass (default 32)")
    mine.set_defaults(run=run_mine)


def run_mine(args: argparse.Namespace) -> int:
    from ..embeddings.cross_encoder import CrossEncoder
    from ..embeddings.sentence import SentenceEncoder
    from .config import check_options_in
    from .hard_negatives import check_options, mine_hard_negatives

    numbers = ("range_min", "range_max", "max_score", "min_score", "absolute_margin", "relative_margin",
               "num_negatives", "batch_size")  # fmt: skip
    check_options_in({name: getattr(args, name) for name in numbers})  # before the models load
    if args.range_max is not None:
        check_options(args.range_min, args.range_max, args.num_negatives, args.sampling, args.format)
    output = writable_file(Path(args.output))
    corpus = extra_documents(Path(args.corpus)) if args.corpus else None
    rows = mine_hard_negatives(
        args.data, SentenceEncoder(args.model), anchor_column_name=args.anchor_column,
        positive_column_name=args.positive_column, corpus=corpus,
        cross_encoder=CrossEncoder(args.cross_encoder) if args.cross_encoder else None,
        range_min=args.range_min, range_max=args.range_max, max_score=args.max_score, min_score=args.min_score,
        absolute_margin=args.absolute_margin, relative_margin=args.relative_margin, num_negatives=args.num_negatives,
        sampling_strategy=args.sampling, output_format=args.format, output_scores=args.scores,
        batch_size=args.batch_size, seed=args.seed,
    )  # fmt: skip
    write_atomically(output, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    print(f"{len(rows)} rows written to {args.output}", file=sys.stderr)
    return 0


def run_evaluate(args: argparse.Namespace) -> int:
    from .evaluators import InformationRetrievalEvaluator, RerankingEvaluator, read_jsonl, read_retrieval_files

    if args.kind == "retrieval":
        from ..embeddings.sentence import SentenceEncoder

        queries, corpus, relevant = read_retrieval_files(args.queries, args.corpus, args.qrels)
        evaluator = InformationRetrievalEvaluator(
            queries, corpus, relevant, accuracy_at_k=args.accuracy_at_k, mrr_at_k=args.mrr_at_k,
            precision_recall_at_k=args.precision_recall_at_k, ndcg_at_k=args.ndcg_at_k, map_at_k=args.map_at_k,
            score_functions=args.score_functions, batch_size=args.batch_size, query_prompt=args.query_prompt,
            corpus_prompt=args.corpus_prompt, truncate_dim=args.truncate_dim,
        )  # fmt: skip
        metrics = evaluator(SentenceEncoder(args.model))
    else:
        from ..embeddings.cross_encoder import CrossEncoder

        samples = read_jsonl(args.samples, ("query", "positive"))
        try:
            evaluator = RerankingEvaluator(samples, at_k=args.at_k, batch_size=args.batch_size)
        except ValueError as e:  # "reranking sample i" is the file's i-th row: named by its line
            wheres = [record.where for record in jsonl_records(args.samples)]
            found = re.match(r"reranking sample (\d+)", str(e))
            where = wheres[int(found[1])] if found and int(found[1]) < len(wheres) else str(args.samples)
            raise ValueError(f"{where}: {str(e).removeprefix(found[0] + ': ') if found else e}") from e
        metrics = evaluator(CrossEncoder(args.model))
    if args.json:
        print(json.dumps(metrics))
    else:
        for name, value in metrics.items():
            print(f"{name:>24}  {value:.4f}")
    sys.stdout.flush()
    return 0

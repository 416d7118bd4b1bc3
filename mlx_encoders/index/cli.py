"""`mlx-encoders index build --corpus PATH --index DIR --model M [--sparse-model S]`,
`mlx-encoders index search --index DIR "query" [-k K] [--mode dense|sparse|hybrid] [--json]` and
`mlx-encoders index export --index DIR --output FILE.parquet [--precision float32|int8|binary]`."""

import argparse
import sys

from ..errors import positive
from ..records import stdin_texts
from .ann import RECALL
from .build import CHUNK, build
from .export import export
from .search import ANN_THRESHOLD, FUSIONS, MODES, PRECISIONS, RRF_K, Index


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a recall in (0, 1], as 0.95; got {text!r}")
    return value


def part(text: str) -> tuple[int, int]:
    """`i/n`: part i of n, from 1."""
    try:
        shard = tuple(int(n) for n in text.split("/"))
    except ValueError:
        shard = ()
    if len(shard) != 2 or not 1 <= shard[0] <= shard[1]:
        raise argparse.ArgumentTypeError(f"must be a part i/n of the corpus with 1 <= i <= n (as 1/4), got {text!r}")
    return shard


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("index", help="build and search a vector index of a corpus (SQLite, HNSW)")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    make = actions.add_parser("build", help="embed a corpus into an index folder (only new or changed texts)")
    corpus_help = "a folder of .txt/.md/.jsonl/.csv/.parquet files, or one such file (.parquet needs pyarrow)"
    make.add_argument("--corpus", required=True, help=corpus_help)
    make.add_argument("--index", required=True, help="the index folder (created, or updated)")
    make.add_argument("--model", "-m", help="sentence-transformers model folder or hub id (dense vectors)")
    make.add_argument("--sparse-model", help="SparseEncoder (SPLADE) folder or hub id: an inverted index too")
    make.add_argument("--batch-size", type=positive, default=32, help="texts per forward pass (default 32)")
    make.add_argument("--chunk", type=positive, default=CHUNK, help=f"texts per commit (default {CHUNK})")
    make.add_argument("--recall", type=fraction, default=RECALL,
                      help=f"the recall@10 the HNSW graph is built for, if one is (default {RECALL})")  # fmt: skip
    make.add_argument("--precision", choices=PRECISIONS, default="float32",
                      help="vectors the HNSW graph holds, if one is built: int8 or binary take a quarter or a 32nd of "
                      "float32's memory, their candidates re-scored from float32 vectors on disk")  # fmt: skip
    make.add_argument("--shard", type=part, metavar="I/N",
                      help="embed only part I of N into shards/part-I-of-N.sqlite (no mlx.launch); a build of the "
                      "folder holding every part's file in shards/ merges them")  # fmt: skip
    make.add_argument("--quiet", action="store_true", help="print nothing (no progress, no summary)")
    find = actions.add_parser("search", help="the top-k documents for each query")
    find.add_argument("queries", nargs="*", metavar="QUERY", help="queries (default: one per line from stdin)")
    find.add_argument("--index", required=True, help="the index folder")
    find.add_argument("--model", "-m", help="model for the queries (default: the index's)")
    find.add_argument("--sparse-model", help="sparse model for the queries (default: the index's)")
    find.add_argument("--mode", choices=MODES, help="dense (default if the index has a dense model), sparse, hybrid")
    find.add_argument("--fusion", choices=FUSIONS, default="rrf", help="how hybrid fuses the rankings (default rrf)")
    find.add_argument("--rrf-k", type=float, default=RRF_K, help=f"reciprocal-rank fusion's k (default {RRF_K})")
    find.add_argument("--alpha", type=float, default=0.5, help="dense share of a weighted fusion (default 0.5)")
    find.add_argument("--depth", type=positive, default=100, help="hybrid: fuse each mode's best N (default 100)")
    find.add_argument("-k", "--top-k", type=positive, default=10, help="results per query (default 10)")
    find.add_argument("--json", action="store_true", help="print a JSON list of {query, hits}, one query per line")
    find.add_argument("--indent", type=int, metavar="N", help="with --json: indent N spaces per level instead")
    find.add_argument("--precision", choices=PRECISIONS, default="float32",
                      help="rank candidates on these vectors (the graph built with this --precision)")  # fmt: skip
    find.add_argument("--recall", type=fraction, default=RECALL,
                      help=f"recall@10 to reach: sets the graph's search expansion (default {RECALL})")  # fmt: skip
    graph = find.add_mutually_exclusive_group()
    graph.add_argument("--ann", action="store_true", default=None, help="use the HNSW graph at any size")
    graph.add_argument("--exact", dest="ann", action="store_false", help=f"never (default: from {ANN_THRESHOLD})")
    out = actions.add_parser("export", help="write the index as one Parquet file, for another vector engine")
    out.add_argument("--index", required=True, help="the index folder")
    out.add_argument("--output", "-o", required=True, help="the .parquet file (written whole or not at all)")
    out.add_argument("--precision", choices=PRECISIONS, default="float32",
                     help="dense vectors as float32 (default), int8 codes or packed sign bits (binary)")  # fmt: skip
    out.add_argument("--quiet", action="store_true", help="print nothing (no progress, no summary)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.action == "build":
        counts = build(
            args.corpus,
            args.index,
            args.model,
            sparse_model=args.sparse_model,
            batch_size=args.batch_size,
            chunk=args.chunk,
            recall=args.recall,
            precision=args.precision,
            shard=args.shard,
            quiet=args.quiet,
        )
        if args.shard and not args.quiet:
            print(f"{counts['path']}: part {counts['part']}, {counts['texts']} texts ({counts['added']} added)")
        elif counts and not args.quiet:
            print(
                f"{args.index}: {counts['documents']} documents, {counts['texts']} texts "
                f"({counts['added']} added, {counts['dropped']} dropped)"
            )
        return 0
    if args.action == "export":
        counts = export(args.index, args.output, precision=args.precision, quiet=args.quiet)
        if not args.quiet:
            print(f"{counts['path']}: {counts['documents']} documents, {counts['texts']} texts ({args.precision})")
        return 0
    queries = args.queries or stdin_texts()
    index = Index(args.index, args.model, sparse_model=args.sparse_model, ann=args.ann, precision=args.precision,
                  recall=args.recall)  # fmt: skip
    if (args.mode or ("dense" if index.dense else "sparse")) != "sparse":
        print(f"mlx-encoders index: {index.describe()}", file=sys.stderr)
    options = {"mode": args.mode, "fusion": args.fusion, "rrf_k": args.rrf_k, "alpha": args.alpha, "depth": args.depth}
    results = [(query, index.search(query, args.top_k, **options)) for query in queries]
    if args.json:
        from ..__main__ import to_json  # the JSON layout of every command

        print(to_json([{"query": q, "hits": [vars(h) for h in hits]} for q, hits in results], args.indent))
        return 0
    for query, hits in results:
        print(f"> {query}")
        for rank, hit in enumerate(hits, 1):
            shown = hit.text if len(hit.text) <= 200 else hit.text[:197] + "..."
            print(f"{rank:2d}. {hit.score:.3f}  {hit.id}\n    {shown}")
    return 0

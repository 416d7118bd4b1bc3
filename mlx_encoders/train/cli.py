"""`python -m mlx_encoders train {mlm,classify,tokens,clm,rtd,embed,rerank,sparse,multivector} --data FILE
(--model PATH_OR_ID | --config FILE --tokenizer DIR) [options]`: `fine_tune` from the command line. The flags are
the options' table (`options.OPTIONS`), the names with dashes; the defaults are theirs."""

import argparse
import json
import sys
from pathlib import Path

from .checkpointing import checkpoints
from .config import OptionError
from .losses.contrastive import LOSSES, CachedMultipleNegativesRankingLoss, MatryoshkaLoss
from .options import OPTIONS, add_flags, reads_flag, words
from .tasks import TASK_NAMES, TASKS


def add_parser(commands: argparse._SubParsersAction) -> None:
    train = commands.add_parser(
        "train",
        help=f"train or fine-tune: {', '.join(TASK_NAMES)}",
        description="Train a model on a JSONL, CSV/TSV or text file; the trained model is saved to OUTPUT/model. "
        "`train TASK --help` lists the options of TASK.",
    )
    kinds = train.add_subparsers(dest="kind", required=True, metavar="TASK")
    for kind, task in TASKS.items():
        description = f"Train {kind}: {task.help}. The trained model is saved to OUTPUT/model."
        p = kinds.add_parser(kind, help=task.help, description=description)
        p.add_argument("--data", required=True, help="training data: .jsonl, .csv, .tsv or .txt")
        p.add_argument("--output", "-o", required=True, help="output folder: checkpoints, metrics.jsonl, model/")
        add_flags(p)
        p.add_argument("--json", action="store_true", help="print the final metrics as JSON")
        p.set_defaults(run=run)
        hide_unread(p, kind)


def hide_unread(p: argparse.ArgumentParser, kind: str) -> None:
    """Leave out of `train KIND --help` the options KIND does not read; they still parse, so that `run` refuses
    them with the reason rather than argparse with 'unrecognized arguments'."""
    for action in p._actions:
        if action.dest in OPTIONS and not reads_flag(OPTIONS[action.dest], TASK_NAMES[kind]):
            action.help = argparse.SUPPRESS


def run(args: argparse.Namespace) -> int:
    from ..distributed import is_main
    from .fine_tune import fine_tune

    # every task gets every option: fine_tune refuses those it would ignore (`options.READ_BY`)
    options = {o.name: getattr(args, o.name) for o in OPTIONS.values() if o.api and o.flag}
    try:
        for o in OPTIONS.values():  # the flags that build a loss, which fine_tune never sees
            if not o.api and getattr(args, o.name) is not None and TASK_NAMES[args.kind] not in o.tasks:
                owners = words(tuple(kind for kind, task in TASKS.items() if task.name in o.tasks))
                raise OptionError(f"{o.dashed} is an option of train {owners}, not of {args.kind}")
        if args.kind == "embed":
            options["loss"] = embed_loss(args)
        elif args.kind in ("sparse", "multivector"):
            if args.loss is not None:
                raise OptionError(f"--loss names an embed or rerank loss; {args.kind} trains with its own")
            options["loss"] = retrieval_loss(args)
        trained = fine_tune(args.kind, args.data, args.output, **options)
    except KeyboardInterrupt:
        saved = checkpoints(Path(args.output))
        then = (
            f"continue with --resume {saved[-1]} (the last one saved; --save-every N saves more often)"
            if saved
            else "no checkpoint was saved yet: run the same command again with --overwrite"
        )
        print(f"\nmlx-encoders train: interrupted; {then}", file=sys.stderr)
        return 130
    if not is_main():  # under mlx.launch, rank 0 alone reports
        return 0
    if args.json:
        print(json.dumps({"model": str(trained.path), "metrics": trained.metrics}, indent=2))
    else:
        for name, value in trained.metrics.items():
            print(f"{name:>18}  {value:.4f}" if isinstance(value, float) else f"{name:>18}  {value}")
        print(f"model saved to {trained.path}")
    return 0


def embed_loss(args: argparse.Namespace):
    """The loss the embed options name: a name of `LOSSES`, built with --mini-batch-size and wrapped in
    Matryoshka with --matryoshka-dims; an option that would be ignored or does not fit is an `OptionError`."""
    loss = args.loss
    if args.mini_batch_size is not None and loss != "cached-mnrl":
        raise OptionError("--mini-batch-size is an option of --loss cached-mnrl; add that loss or drop the option")
    weights, dims = args.matryoshka_weights, args.matryoshka_dims
    if weights is not None and dims is None:
        raise OptionError("--matryoshka-weights needs --matryoshka-dims (one weight per dim); alone it is unused")
    if weights is not None and len(weights) != len(dims):
        raise OptionError(
            f"--matryoshka-weights gives {len(weights)} weight(s) for {len(dims)} --matryoshka-dims; give one per dim"
        )
    try:  # the losses' own checks (a mini-batch size or a dim < 1)
        if args.mini_batch_size is not None:
            loss = CachedMultipleNegativesRankingLoss(mini_batch_size=args.mini_batch_size)
        if dims is not None:
            inner = LOSSES[loss]() if isinstance(loss, str) else loss  # None: the data's default
            loss = MatryoshkaLoss(inner, dims, weights)
    except ValueError as e:
        raise OptionError(str(e)) from None
    return loss


def retrieval_loss(args: argparse.Namespace):
    """SpladeLoss with the regularizer weights given (the others default), or None for the task's default (`run`
    has refused the weights for any task but sparse)."""
    if (args.document_regularizer_weight, args.query_regularizer_weight) == (None, None):
        return None
    from .losses.sparse import SpladeLoss

    weights = {}
    if args.document_regularizer_weight is not None:
        weights["document_regularizer_weight"] = args.document_regularizer_weight
    if args.query_regularizer_weight is not None:
        weights["query_regularizer_weight"] = args.query_regularizer_weight or None
    return SpladeLoss(**weights)  # it checks them (`config.RANGES`)

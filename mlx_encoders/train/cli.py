"""`python -m mlx_encoders train {mlm,classify,tokens,clm,rtd,embed,rerank,sparse,multivector} --data FILE
(--model PATH_OR_ID | --config FILE --tokenizer DIR) [options]`: `fine_tune` from the command line. Option names
are `fine_tune`'s and `TrainingConfig`'s with dashes; the defaults are theirs."""

import argparse
import json
import sys

from .config import OptionError
from .contrastive import LOSSES, CachedMultipleNegativesRankingLoss, MatryoshkaLoss
from .embedding import SAMPLERS
from .fine_tune import TASK_NAMES
from .options import PRETRAINING, READ_BY
from .rerank import LOSSES as RERANK_LOSSES

TASK_HELP = {
    "mlm": "masked language modelling (BERT's pretraining with --next-sentence)",
    "classify": "text or text-pair classification, multi-label classification, regression",
    "tokens": "token classification: named entities, tags",
    "clm": "causal language modelling (GPT-2)",
    "rtd": "ELECTRA's replaced-token detection: a generator and a discriminator",
    "embed": "sentence embeddings with a contrastive loss (a sentence-transformers model)",
    "rerank": "a cross-encoder that scores (query, document) pairs",
    "sparse": "sparse (SPLADE) embeddings",
    "multivector": "multi-vector (ColBERT) embeddings",
}


def add_parser(commands: argparse._SubParsersAction) -> None:
    train = commands.add_parser(
        "train",
        help=f"train or fine-tune: {', '.join(TASK_NAMES)}",
        description="Train a model on a JSONL, CSV/TSV or text file; the trained model is saved to OUTPUT/model. "
        "`train TASK --help` lists the options of TASK.",
    )
    kinds = train.add_subparsers(dest="kind", required=True, metavar="TASK")
    for kind in TASK_NAMES:
        description = f"Train {kind}: {TASK_HELP[kind]}. The trained model is saved to OUTPUT/model."
        p = kinds.add_parser(kind, help=TASK_HELP[kind], description=description)
        add_options(p)
        hide_unread(p, kind)


def hide_unread(p: argparse.ArgumentParser, kind: str) -> None:
    """Leave out of `train KIND --help` the options KIND does not read; they still parse, so that `run` refuses
    them with the reason rather than argparse with 'unrecognized arguments'."""
    task = TASK_NAMES[kind]
    for action in p._actions:
        if action.dest in FLAG_KINDS:
            read = FLAG_KINDS[action.dest] == kind
        elif action.dest == "loss":  # sparse and multivector train with their own loss (`run`)
            read = kind in ("embed", "rerank")
        elif action.dest == "next_sentence":  # it picks mlm's pretraining head (`fine_tune.task_name`)
            read = kind == "mlm"
        else:
            tasks = READ_BY.get(action.dest, (task,))
            read = task in tasks or (kind == "mlm" and PRETRAINING in tasks)
        if not read:
            action.help = argparse.SUPPRESS


def add_options(p: argparse.ArgumentParser) -> None:
    source = p.add_argument_group("model")
    source.add_argument("--model", "-m", help="checkpoint folder or hub id to start from")
    source.add_argument(
        "--config",
        help="for mlm/clm/rtd from scratch: a JSON file of sizes (config.json keys) or a preset (bert-base, ...)",
    )
    source.add_argument("--tokenizer", help="folder holding tokenizer.json (default: the model's)")
    source.add_argument("--lora-rank", type=int, help="train rank-r LoRA adapters over the frozen model")
    source.add_argument("--lora-alpha", type=float, help="LoRA scale numerator (default 2 x rank)")
    source.add_argument("--lora-targets", nargs="+", help="linears to adapt (default: the attention projections)")
    data = p.add_argument_group("data")
    data.add_argument("--data", required=True, help="training data: .jsonl, .csv, .tsv or .txt")
    data.add_argument("--eval-data", help="evaluation data, same format")
    data.add_argument("--output", "-o", required=True, help="output folder: checkpoints, metrics.jsonl, model/")
    data.add_argument("--text-column", help='text column (default "text"; "tokens" for tokens)')
    data.add_argument("--text-pair-column", help="second text column, for classify on text pairs")
    data.add_argument("--label-column", help='label column (default "label"; "ner_tags" for tokens)')
    data.add_argument(
        "--columns",
        nargs="+",
        metavar="NAME=COLUMN",
        help="embed, rerank, sparse, multivector: the columns to read, in order, each COLUMN or NAME=COLUMN (read as "
        "NAME), e.g. anchor=question positive=answer (default: anchor/positive/negative... by name, else by position)",
    )
    data.add_argument(
        "--problem-type",
        choices=("single_label_classification", "multi_label_classification", "regression"),
        help="classify: default from the first label (a list: multi-label; a fraction: regression)",
    )
    data.add_argument("--max-length", type=int, help="tokens per example (default: the model's limit)")
    data.add_argument("--label-all-tokens", action="store_true", help="tokens: label every sub-token of a word")
    data.add_argument("--whole-word-mask", action="store_true", help="mlm: mask whole words")
    data.add_argument("--next-sentence", action="store_true", help="mlm: BERT pretraining with next-sentence pairs")
    rtd = p.add_argument_group("rtd (ELECTRA's replaced-token detection; --model/--config: the discriminator)")
    rtd.add_argument("--generator", help="masked-LM checkpoint to start the generator from (default: a new one)")
    rtd.add_argument("--generator-size", type=float, default=0.25, help="a new generator's share of the width")
    rtd.add_argument("--discriminator-weight", type=float, default=50.0, help="the discriminator loss's weight")
    embed = p.add_argument_group("embed")
    embed.add_argument(
        "--loss",
        choices=list(dict.fromkeys([*LOSSES, *RERANK_LOSSES])),
        help="embed: default mnrl (anchor/positive rows), cosent (scored pairs); rerank: bce, listnet (default for "
        "rows of several documents), lambda or mnrl",
    )
    embed.add_argument("--mini-batch-size", type=int, help="embed, cached-mnrl: rows per GradCache pass (default 32)")
    embed.add_argument("--matryoshka-dims", type=int, nargs="+", help="embed: train the loss at these widths too")
    embed.add_argument("--matryoshka-weights", type=float, nargs="+", help="embed: one weight per dim (default 1)")
    embed.add_argument("--query-prompt", help="embed: text put before each anchor / sentence1")
    embed.add_argument("--document-prompt", help="embed: text put before each positive and negative / sentence2")
    embed.add_argument("--batch-sampler", choices=SAMPLERS, help="embed: default no_duplicates for mnrl losses")
    sparse = p.add_argument_group("sparse (SPLADE) and multivector (ColBERT): the embed data, prompts and sampler")
    sparse.add_argument("--document-regularizer-weight", type=float, help="sparse: FLOPS weight of documents (3e-5)")
    sparse.add_argument("--query-regularizer-weight", type=float, help="sparse: FLOPS weight of queries (5e-5; 0: off)")
    loop = p.add_argument_group("training")
    loop.add_argument("--epochs", type=int, default=3, help="default 3")
    loop.add_argument("--max-steps", type=int, help="optimizer steps, instead of epochs")
    loop.add_argument("--batch-size", type=int, default=8, help="examples per micro-batch, over all ranks (default 8)")
    loop.add_argument("--lr", type=float, default=5e-5, help="peak learning rate (default 5e-5)")
    loop.add_argument("--schedule", choices=("linear", "cosine", "constant"), default="linear", help="after warmup")
    loop.add_argument("--warmup-ratio", type=float, default=0.0, help="share of steps warming up (default 0)")
    loop.add_argument("--warmup-steps", type=int, default=0, help="warmup steps; > 0 replaces --warmup-ratio")
    loop.add_argument("--weight-decay", type=float, default=0.0, help="AdamW decay (default 0)")
    loop.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    loop.add_argument("--max-grad-norm", type=float, default=1.0, help="clip the global norm; <= 0: off (default 1)")
    loop.add_argument("--seed", type=int, default=42, help="default 42")
    loop.add_argument("--eval-every", type=int, help="evaluate every N steps (always at each epoch end)")
    loop.add_argument("--save-every", type=int, help="checkpoint every N steps (and at the end)")
    loop.add_argument("--keep-last", type=int, default=2, help="checkpoints kept, besides the best (default 2)")
    loop.add_argument(
        "--no-final-checkpoint", dest="final_checkpoint", action="store_false",
        help="no checkpoint at the end (model/ holds the weights; a checkpoint adds 2x their size of optimizer state)",
    )  # fmt: skip
    loop.add_argument("--metric-for-best", help="eval metric choosing the best checkpoint, e.g. eval_loss")
    loop.add_argument("--group-by-length", action="store_true", help="batch examples of similar lengths together")
    loop.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="compute dtype")
    loop.add_argument(
        "--gradient-checkpointing", action="store_true", help="recompute activations in the backward pass: less memory"
    )
    loop.add_argument("--resume", help="a checkpoint-STEP folder of this run to continue")
    loop.add_argument("--overwrite", action="store_true", help="clear another run's files from OUTPUT first")
    loop.add_argument("--json", action="store_true", help="print the final metrics as JSON")
    p.set_defaults(run=run)


TRAINING_OPTIONS = (
    "epochs", "max_steps", "batch_size", "lr", "schedule", "warmup_ratio", "warmup_steps", "weight_decay", "grad_accum",
    "max_grad_norm", "seed", "eval_every", "save_every", "keep_last", "final_checkpoint", "metric_for_best",
    "group_by_length", "dtype", "gradient_checkpointing", "overwrite",
)  # fmt: skip
CALL_OPTIONS = (
    "model", "config", "tokenizer", "lora_rank", "lora_alpha", "lora_targets", "text_column", "text_pair_column",
    "label_column", "problem_type", "max_length", "label_all_tokens", "whole_word_mask", "next_sentence",
    "generator", "generator_size", "discriminator_weight", "columns",
)  # fmt: skip

FLAG_KINDS = {"mini_batch_size": "embed", "matryoshka_dims": "embed", "matryoshka_weights": "embed",
              "document_regularizer_weight": "sparse", "query_regularizer_weight": "sparse"}  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from ..distributed import is_main
    from .fine_tune import fine_tune

    options = {name: getattr(args, name) for name in TRAINING_OPTIONS + CALL_OPTIONS}
    # every task gets the embed options: fine_tune refuses those it would ignore (`options.READ_BY`)
    options |= dict(query_prompt=args.query_prompt, document_prompt=args.document_prompt, loss=args.loss)
    options["batch_sampler"] = args.batch_sampler
    try:
        for name, kind in FLAG_KINDS.items():  # the flags that build a loss, which fine_tune never sees
            if getattr(args, name) is not None and args.kind != kind:
                raise OptionError(f"--{name.replace('_', '-')} is an option of train {kind}, not of {args.kind}")
        if args.kind == "embed":
            options["loss"] = embed_loss(args)
        elif args.kind in ("sparse", "multivector"):
            if args.loss is not None:
                raise OptionError(f"--loss names an embed or rerank loss; {args.kind} trains with its own")
            options["loss"] = retrieval_loss(args)
        trained = fine_tune(args.kind, args.data, args.output, eval_data=args.eval_data, resume=args.resume, **options)
    except KeyboardInterrupt:
        print(
            f"\nmlx-encoders train: interrupted; continue with --resume {args.output}/checkpoint-STEP (the last "
            "one saved; --save-every N saves more often)",
            file=sys.stderr,
        )
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
            inner = LOSSES[loss or "mnrl"]() if loss is None or isinstance(loss, str) else loss
            loss = MatryoshkaLoss(inner, dims, weights)
    except ValueError as e:
        raise OptionError(str(e)) from None
    return loss


def retrieval_loss(args: argparse.Namespace):
    """SpladeLoss with the regularizer weights given (the others default), or None for the task's default (`run`
    has refused the weights for any task but sparse)."""
    if (args.document_regularizer_weight, args.query_regularizer_weight) == (None, None):
        return None
    from .sparse_losses import SpladeLoss

    weights = {}
    if args.document_regularizer_weight is not None:
        weights["document_regularizer_weight"] = args.document_regularizer_weight
    if args.query_regularizer_weight is not None:
        weights["query_regularizer_weight"] = args.query_regularizer_weight or None
    return SpladeLoss(**weights)  # it checks them (`config.RANGES`)

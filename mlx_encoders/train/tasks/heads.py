"""What the tasks that train a model's head share (`train_head`): the model from a checkpoint (with the task's head,
a fresh one initialised as transformers does when the checkpoint lacks it) or new from a config of sizes, the
tokenizer, LoRA adapters, `trainer.train`, and the result saved to `output_dir/model` with `mlx_encoders.save`, so
transformers and every mlx_encoders front end read it. Each task's module (`classification`, `tokens`, `masked_lm`,
`causal_lm`, `rtd`, `rerank`) gives its data reader and what differs.
"""

from collections.abc import Callable, Mapping
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ... import distributed
from ...checkpoint.build import initialize, load_model
from ...checkpoint.files import Checkpoint, read_json_object
from ...checkpoint.tokenizer import tokenizer_for
from ...checkpoint.write import save
from ...models import TASKS, model_class, model_module, preset_config, presets
from ...models.base import BaseArgs
from ...models.layers import drawing_from
from ...tokenizer import Tokenizer
from ..checkpointing import ADAPTERS_FOLDER, MODEL_FOLDER
from ..config import OptionError, Trained
from ..data import REGRESSION_HINT, DataError, Examples, NamedInData
from ..evaluation import check_metric_for_best
from ..lora import apply_lora, fuse, save_adapters
from ..masking import Masker
from ..options import Data
from ..trainer import train
from . import CLM


def train_head(
    task: str,
    data: Data,
    run: SimpleNamespace,
    read: Callable[[Data, Tokenizer, Mapping | None, int], Examples],
    *,
    pairs: bool = False,
    masker: Callable[[Tokenizer], Masker] | None = None,
    build: Callable[[Checkpoint | None, Tokenizer, Examples], nn.Module] | None = None,
    objective: Callable[[Examples, Tokenizer], object] | None = None,
    own_metrics: bool = False,
    save_model: Callable[[nn.Module, Path, Tokenizer], tuple[Path, nn.Module]] | None = None,
    check_checkpoint: Callable[[Checkpoint], None] | None = None,
) -> Trained:
    """Train a model with a `task` head (or, with `build`, the model it makes) on `data`: from `run.model` or a new
    one of `run.config`'s sizes, the examples read by `read(data, tokenizer, label2id, seed)`, optionally with LoRA
    adapters and a `masker` or `objective`; save it to `output_dir/model` (with the adapters beside it). `pairs`:
    the texts are pairs (two sets of special tokens); `own_metrics`: the model or objective names its metrics,
    which `trainer.train` checks; `save_model(model, path, tokenizer) -> (path, model to return)` saves a model
    `mlx_encoders.save` does not (every rank calls it); `check_checkpoint` refuses a checkpoint before it loads."""
    options, model, config, lora_rank = run.training, run.model, run.config, run.lora_rank
    checkpoint = check_source(task, model, config, run.tokenizer)
    if check_checkpoint is not None and checkpoint is not None:
        check_checkpoint(checkpoint)
    tok = load_tokenizer(checkpoint, config, run.tokenizer)
    check_max_length(run.max_length, task, tok, pairs=pairs)
    examples = read(data, tok, run.label2id, options.seed)
    kept = head_labels(checkpoint, task, examples) if run.label2id is None else None
    if kept is not None:  # the checkpoint's head knows every label of the data: read them as its ids (run_ner.py)
        examples = read(data, tok, kept, options.seed)
    evaluation = None
    if run.eval_data is not None:
        try:
            evaluation = read(run.eval_data, tok, examples.label2id or None, options.seed + 1)
        except DataError as e:  # "item 4 of the data" would point at the training data's item
            raise DataError(f"eval_data: {e}") from None
    if not own_metrics:
        check_metric_for_best(options, evaluation)  # the metrics these labels give, before the model loads
    with drawing_from([mx.random.key(options.seed)]):  # new weights from the seed; MLX's global key untouched
        if build is not None:
            net = build(checkpoint, tok, examples)
        elif checkpoint is None:
            net = from_config(dict(read_config(config)), task, tok)
        else:
            net = load_head(checkpoint, task, examples)
        check_positions(run.max_length, net)
        if lora_rank:
            apply_lora(net, rank=lora_rank, alpha=run.lora_alpha or 2 * lora_rank, targets=run.lora_targets)
    loss = objective(examples, tok) if objective is not None else None
    masked = masker(tok) if masker is not None else None
    metrics = train(net, tok, examples, evaluation, options, masked, resume_from=run.resume, objective=loss)
    main = distributed.is_main()  # under mlx.launch, rank 0 alone writes
    if lora_rank:
        if main:
            save_adapters(net, options.output_dir / ADAPTERS_FOLDER)
        net = fuse(net)
    path = options.output_dir / MODEL_FOLDER
    if save_model is not None:
        path, net = save_model(net, path, tok)
    elif main:
        path = save(net, path, tok, dtype="float32", overwrite=True)  # the trained weights as trained
    net.eval()
    return Trained(net, tok, metrics, Path(path))


def check_max_length(max_length: int | None, task: str, tokenizer: Tokenizer, pairs: bool) -> None:
    """`max_length` leaves room for a token of text besides the special ones, and causal LM for two (one predicting
    the next): a shorter window trains on nothing."""
    if max_length is None:
        return
    minimum = max(tokenizer.num_special_tokens_to_add(pairs) + 1, 2 if task == CLM else 1)
    if max_length < minimum:
        raise OptionError(
            f"max_length must be at least {minimum} for {task} with this tokenizer (its special tokens take "
            f"{tokenizer.num_special_tokens_to_add(pairs)}), got {max_length}"
        )


def check_positions(max_length: int | None, net: nn.Module) -> None:
    """`max_length` fits the model's position table: a longer window would fail at the first batch that holds a
    text that long, perhaps hours into the run."""
    limit = getattr(getattr(net, "args", None), "max_tokens", None)
    if max_length is not None and limit and max_length > limit:
        raise OptionError(
            f"max_length {max_length} is longer than the model's {limit} positions (its position table); pass "
            f"max_length={limit} or less (--max-length), or leave it unset for the model's limit"
        )


def check_source(task: str, model, config, tokenizer) -> Checkpoint | None:
    """The checkpoint to start from, or None to train from `config`; exactly one of the two must be given."""
    if (model is None) == (config is None):
        raise ValueError(
            "Give model= (a checkpoint folder or hub id to fine-tune) or config= (sizes, to train from scratch), "
            f"not {'both' if model is not None else 'neither'}"
        )
    if config is not None:  # for mlm, clm and rtd alone (`options.READ_BY`)
        if tokenizer is None:
            raise ValueError("Training from scratch needs tokenizer=: the folder holding the tokenizer.json to use")
        return None
    return Checkpoint.open(model)


def read_config(config: str | Path | Mapping) -> Mapping:
    if isinstance(config, Mapping):
        return config
    if isinstance(config, str) and config in presets() and not Path(config).is_file():
        return preset_config(config)  # its sizes; the vocabulary (vocab_size) is the tokenizer's
    if not Path(config).exists():
        raise FileNotFoundError(
            f"config {str(config)!r} is neither a JSON file of sizes nor a preset; presets: {', '.join(presets())}"
        )
    return read_json_object(Path(config), required=True)


def load_tokenizer(checkpoint: Checkpoint | None, config, tokenizer: str | Path | None) -> Tokenizer:
    """The tokenizer of `tokenizer` (a folder), else of the checkpoint, fitted to the model it will train."""
    if checkpoint is not None:
        return tokenizer_for(checkpoint.args, tokenizer if tokenizer is not None else checkpoint)
    settings = {"model_type": "bert", **read_config(config)}
    # without a vocab_size the new model takes the tokenizer's (`from_config`), so there is nothing to check yet
    return tokenizer_for(scratch_args(settings), tokenizer, check_vocab="vocab_size" in settings)


def head_labels(checkpoint: Checkpoint | None, task: str, examples: Examples) -> dict[str, int] | None:
    """The label2id of the checkpoint's `task` head where it names every label of the data but differs from the one
    read from it: its classes in another order than sorted names (published NER heads), or data of some of them."""
    if checkpoint is None or checkpoint.task != task or task not in ("sequence-classification", "token-classification"):
        return None
    stored = {str(name): int(i) for name, i in (checkpoint.config.get("label2id") or {}).items()}
    read = examples.label2id
    if not stored or not read or stored == read or getattr(examples, "problem_type", None) == "regression":
        return None
    if isinstance(read, NamedInData):
        return stored if set(read) <= set(stored) else None
    # ids: the head's own ids where they name its every class, or where its classes are unnamed (LABEL_i); ids of
    # some of a named head's classes (0 and 1 of an NLI head's three) are more likely another task's
    unnamed = all(name == f"LABEL_{i}" for name, i in stored.items())
    return stored if len(read) == len(stored) or unnamed and max(read.values()) < len(stored) else None


def load_head(checkpoint: Checkpoint, task: str, examples: Examples) -> nn.Module:
    """The checkpoint's model with the `task` head, in float32 (the weights training updates). A classification
    head is kept when it has the data's labels (`head_labels`), and made with them for a checkpoint without one; a
    head of other labels is refused."""
    if task not in ("sequence-classification", "token-classification"):
        return load_model(checkpoint, dtype="float32", task=task)
    labels = dict(label2id=examples.label2id)
    if task == "sequence-classification":
        labels["problem_type"] = examples.problem_type
    stored = checkpoint.config.get("label2id")
    if checkpoint.task == task:
        if stored != examples.label2id:
            raise ValueError(
                f"{checkpoint.path} already has a {task} head with the labels {stored}, but the data has "
                f"{examples.label2id}; train a new head from the encoder alone, saved without this one: model, "
                'tokenizer = mlx_encoders.load(path, task="encoder"); mlx_encoders.save(model, "encoder-only", '
                f"tokenizer){REGRESSION_HINT if len(stored or {}) == 1 else ''}"
            )
        # the data's problem type replaces the config's, as run_classification.py sets it
        kept = {"problem_type": labels["problem_type"]} if "problem_type" in labels else {}
        return load_model(checkpoint, dtype="float32", task=task, **kept)
    return load_model(checkpoint, dtype="float32", task=task, **labels)


def from_config(config: dict, task: str, tokenizer: Tokenizer) -> nn.Module:
    """A new model of `config`'s sizes, every weight initialised as transformers does (normal(0,
    initializer_range), zero biases, LayerNorm 1/0, a zero padding embedding); `vocab_size`, `pad_token_id`
    and, for causal LM, `eos_token_id` and `bos_token_id` default to the tokenizer's."""
    config.setdefault("model_type", "bert")
    config.setdefault("vocab_size", tokenizer.max_id + 1)
    config.setdefault("pad_token_id", tokenizer.pad_token_id)
    if task == CLM:  # a decoder's start and end tokens: the tokenizer's (GPT-2's 50256 may not exist)
        eos = tokenizer.token_id(tokenizer.eos_token)
        config.setdefault("eos_token_id", eos)
        config.setdefault("bos_token_id", tokenizer.token_id(tokenizer.bos_token) or eos)
    args = scratch_args(config)
    module = model_module(args.model_type)
    if task not in TASKS or task not in module.MODELS:
        raise ValueError(f"{config['model_type']} has no {task} head to train from scratch")
    model = model_class(args.model_type, task)(args)
    initialize(model, [k for k, _ in tree_flatten(model.parameters())], module, mx.float32)
    zero_padding_rows(model)
    model.train()
    return model


def scratch_args(config: Mapping) -> BaseArgs:
    try:
        return model_module(config["model_type"]).ModelArgs.from_dict(dict(config))
    except ValueError as e:
        raise ValueError(f"config= for training from scratch: {e}") from e


def zero_padding_rows(model: nn.Module) -> None:
    """transformers zeroes the `padding_idx` row of the tables it builds with one: the word embeddings, and
    RoBERTa's positions (which count from the padding id)."""
    for _, module in model.named_modules():
        row = getattr(module, "padding_idx", None)
        tables = ["word_embeddings", "tok_embeddings", "embed_tokens"]
        tables += ["position_embeddings"] if getattr(module, "positions_skip_padding", False) else []
        for name in tables:
            table = getattr(module, name, None) if row is not None else None
            if isinstance(table, nn.Embedding) and row < table.weight.shape[0]:
                table.weight[row] = 0.0

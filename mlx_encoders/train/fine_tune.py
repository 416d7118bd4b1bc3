"""`fine_tune`: one call from a checkpoint (or a config of sizes, for training from scratch) and a data file to a
trained model folder, for masked-LM, sequence classification, token classification and causal LM; the command
`python -m mlx_encoders train` is a thin shell over it (`train/cli.py`).

It reads the data (labels decide the head), loads the model with that head (a fresh one, initialised as
transformers does, when the checkpoint lacks it), optionally adds LoRA adapters, runs `trainer.train`, and saves
the result to `output_dir/model` with `mlx_encoders.save`, so transformers and every mlx_encoders front end read it.
"""

from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from safetensors import safe_open

from .. import distributed
from ..checkpoint.build import initialize, load_model
from ..checkpoint.files import Checkpoint, read_json_object
from ..checkpoint.tokenizer import tokenizer_for
from ..checkpoint.write import save
from ..models import TASKS, model_class, model_module, preset_config, presets
from ..models.base import BaseArgs
from ..models.layers import drawing_from
from ..tokenizer import Tokenizer
from .config import OptionError, Trained
from .data import (
    Examples,
    causal_lm_data,
    masked_lm_data,
    pretraining_data,
    sequence_classification_data,
    token_classification_data,
)
from .lora import apply_lora, fuse, save_adapters
from .masking import Masker
from .options import RETRIEVAL, TASK_NAMES, Data, check_task_options, read_options, signature
from .rerank import TASK as RERANK_TASK
from .rerank import RerankObjective, choose_loss, load_reranker, rerank_data
from .rtd import TASK as RTD_TASK
from .rtd import ReplacedTokenDetection, generator_args, rtd_masker, start_at_base_rate
from .trainer import ADAPTERS_FOLDER, MODEL_FOLDER, check_metric_for_best, train

# (text column, label column) each task reads by default: the Hugging Face datasets' usual names.
COLUMNS = {"token-classification": ("tokens", "ner_tags")}


@distributed.warnings_on_main_rank()  # under mlx.launch every rank would print the same warnings
def fine_tune(task: str, data: Data, output_dir: str | Path, **options) -> Trained:
    """Train `model` (a folder or hub id) on `data` for `task` ("mlm", "classify", "tokens", "clm", "rtd", or the
    long names "masked-lm", "sequence-classification", "token-classification", "causal-lm"); write checkpoints,
    metrics.jsonl, curves.png and the trained model (`output_dir/model`) to `output_dir`.

    - From scratch (mlm, clm, rtd): `config=` a config.json-like dict or file of sizes (`model_type` default "bert",
      `vocab_size` default the tokenizer's) or a preset name ("bert-base", "gpt2-small": `models.presets()`), and
      `tokenizer=` the folder holding tokenizer.json; no `model=`.
    - Data: a .jsonl/.csv/.tsv/.txt file or an iterable of dicts; columns `text_column` (default "text", or
      "tokens" for token classification), `text_pair_column` for pairs, `label_column` (default "label", or
      "ner_tags"). Classification labels by name or id; `problem_type` (default: read from the first label: a
      list is multi-label, a fraction regression) and `label2id` as transformers names them.
    - `whole_word_mask`, `next_sentence` (BERT's pretraining head: masked-LM plus next-sentence prediction on
      the documents of a .txt file), `label_all_tokens` (label every sub-token of a word) and `max_length`.
    - rtd (ELECTRA's replaced-token detection, `train/rtd.py`): `model=` (or `config=`, model_type "electra")
      is the discriminator; `generator=` a masked-LM checkpoint, else a new one `generator_size` (1/4) as wide;
      `discriminator_weight` (50) scales its loss. Saved as `output_dir/model/discriminator` (`Trained.path`,
      `Trained.model`) and `output_dir/model/generator`.
    - `lora_rank` trains LoRA adapters (alpha default 2 x rank; targets default the attention projections) over
      the frozen base, quantized or not (QLoRA); they are saved alone to `output_dir/adapters` and fused into
      the saved model.
    - Every numeric option is checked against its range first (`config.RANGES`; `OptionError`, a ValueError
      naming it), and an option the task would ignore is refused (`options.READ_BY`).
    - `resume`: a checkpoint-STEP folder of an earlier run of the same call, continued exactly.
    - "embed" ("sentence-embedding") trains a sentence-embedding model (`fine_tune_embed`): rows of anchor, positive
      (negative or negative_1..n) or sentence1, sentence2, score; `loss` a name ("mnrl", "symmetric-mnrl",
      "cached-mnrl", "cosent", "cosine") or a loss of `train.contrastive`; `query_prompt` / `document_prompt`;
      `batch_sampler` "no_duplicates" (the default for in-batch-negative losses) or "batch_sampler".
    - "rerank" trains a cross-encoder (`train/rerank.py`: rows of query, document, label or query, positive,
      negatives) with `loss` "bce", "listnet", "lambda" or "mnrl" (default: listnet when rows hold several
      documents); its eval metrics add eval_map, eval_mrr@10 and eval_ndcg@10.
    - `columns` (embed, rerank, sparse, multivector) reads the data's columns under other names, for the data and
      the eval data: {"anchor": "question", "positive": "answer"} (or ["question", "answer"] to keep their names);
      the columns left out are dropped. Without it, rows whose columns have none of the task's names are read by
      position, as sentence-transformers reads them (first the anchor or query, then the positive, then negatives;
      a "label"/"score" column is the label).
    - "sparse" trains a SPLADE model (`fine_tune_retrieval`; a SparseEncoder folder or a masked-LM checkpoint) with
      `loss` a `sparse_losses.SpladeLoss` (default weights documents 3e-5, queries 5e-5); "multivector" a ColBERT
      model (a MultiVectorEncoder folder or an encoder) with `multi_vector_losses.MaxSimRankingLoss`. Both read
      the embed task's columns (the first the queries) and options.
    - `training`: the fields of `TrainingConfig` (epochs, max_steps, batch_size, lr, warmup_ratio, warmup_steps,
      weight_decay, grad_accum, max_grad_norm, schedule, seed, eval_every, save_every, keep_last, final_checkpoint,
      metric_for_best, group_by_length, dtype, gradient_checkpointing).
    """
    run = read_options("fine_tune", output_dir, options)
    task = task_name(task, run.next_sentence)
    check_task_options(task, {k: v for k, v in vars(run).items() if k != "training"})  # before model and data load
    if task in RETRIEVAL:
        from .fine_tune_embed import fine_tune_embedding
        from .fine_tune_retrieval import fine_tune_multivector, fine_tune_sparse

        tasks = {"sparse-embedding": fine_tune_sparse, "multi-vector-embedding": fine_tune_multivector}
        return tasks.get(task, fine_tune_embedding)(data, run)
    if task == RTD_TASK and run.lora_rank:
        raise OptionError(
            "rtd trains every weight of the generator and the discriminator: drop lora_rank (--lora-rank)"
        )
    options, model, config, lora_rank = run.training, run.model, run.config, run.lora_rank
    checkpoint = check_source(task, model, config, run.tokenizer)
    if task == "pretraining" and checkpoint is not None:
        check_next_sentence_head(checkpoint)
    tok = load_tokenizer(checkpoint, config, run.tokenizer)
    pairs = run.text_pair_column is not None or task in ("pretraining", RERANK_TASK)
    check_max_length(run.max_length, task, tok, pairs=pairs)
    read = reader(task, tok, run)
    examples = read(data, run.label2id, options.seed)
    evaluation = read(run.eval_data, examples.label2id or None, options.seed + 1) if run.eval_data is not None else None
    if task not in (RTD_TASK, RERANK_TASK):  # their metrics are their model's or objective's: train() checks them
        check_metric_for_best(options, evaluation)  # the metrics these labels give, before the model loads
    with drawing_from([mx.random.key(options.seed)]):  # new weights from the seed; MLX's global key untouched
        if task == RTD_TASK:
            net = rtd_pair(checkpoint, config, tok, run.generator, run.generator_size, run.discriminator_weight)
        elif checkpoint is None:
            net = from_config(dict(read_config(config)), task, tok)
        else:
            net = load_head(checkpoint, task, examples)
        if lora_rank:
            apply_lora(net, rank=lora_rank, alpha=run.lora_alpha or 2 * lora_rank, targets=run.lora_targets)
    whole_word = run.whole_word_mask
    masker = Masker.from_tokenizer(tok, whole_word=whole_word) if task in ("masked-lm", "pretraining") else None
    masker = rtd_masker(tok, whole_word) if task == RTD_TASK else masker
    objective = RerankObjective(choose_loss(run.loss, examples), tok) if task == RERANK_TASK else None
    metrics = train(net, tok, examples, evaluation, options, masker, resume_from=run.resume, objective=objective)
    main = distributed.is_main()  # under mlx.launch, rank 0 alone writes
    if lora_rank:
        if main:
            save_adapters(net, options.output_dir / ADAPTERS_FOLDER)
        net = fuse(net)
    path = options.output_dir / MODEL_FOLDER
    if task == RTD_TASK:  # the discriminator is the model to fine-tune; the generator is saved beside it
        path, net = net.save(path, tok, overwrite=True), net.discriminator
    elif main:
        path = save(net, path, tok, overwrite=True)
    net.eval()
    return Trained(net, tok, metrics, Path(path))


fine_tune.__signature__ = signature(fine_tune)  # every option of the table, for help() and editors


def task_name(task: str, next_sentence: bool) -> str:
    name = TASK_NAMES.get(task, task)
    if name not in TASK_NAMES.values():
        choices = ", ".join([*TASK_NAMES, *TASK_NAMES.values()])
        raise ValueError(f"Unknown training task {task!r}; choose one of {choices}")
    if next_sentence and name != "masked-lm":
        raise OptionError("next_sentence=True trains BERT's pretraining head, which only the mlm task has")
    return "pretraining" if next_sentence else name


def check_max_length(max_length: int | None, task: str, tokenizer: Tokenizer, pairs: bool) -> None:
    """`max_length` leaves room for a token of text besides the special ones, and causal LM for two (one predicting
    the next): a shorter window trains on nothing."""
    if max_length is None:
        return
    minimum = max(tokenizer.num_special_tokens_to_add(pairs) + 1, 2 if task == "causal-lm" else 1)
    if max_length < minimum:
        raise OptionError(
            f"max_length must be at least {minimum} for {task} with this tokenizer (its special tokens take "
            f"{tokenizer.num_special_tokens_to_add(pairs)}), got {max_length}"
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


def check_next_sentence_head(checkpoint: Checkpoint) -> None:
    """`next_sentence` continues a checkpoint's next-sentence head (and pooler); fine_tune creates neither."""
    names = set()
    for file in checkpoint.weight_files():
        try:
            with safe_open(str(file), framework="numpy") as tensors:  # the header only: no tensor is read
                names.update(tensors.keys())
        except Exception:  # a damaged file: loading it names the file and what is wrong
            return
    missing = [part for part in ("seq_relationship.weight", "pooler.dense.weight") if not any(n.endswith(part)
               for n in names)]  # fmt: skip
    if missing:
        raise OptionError(
            f"next_sentence (--next-sentence) trains BERT's pretraining heads, but {checkpoint.path} has no "
            f"next-sentence head (no {' or '.join(missing)} tensor); start from a BERT pretraining checkpoint "
            "(BertForPreTraining's weights, as bert-base-uncased has), or from scratch with config= (--config) and "
            "tokenizer=, or drop next_sentence to train masked-LM alone"
        )


def read_config(config: str | Path | Mapping) -> Mapping:
    if isinstance(config, Mapping):
        return config
    if isinstance(config, str) and config in presets() and not Path(config).is_file():
        return preset_config(config)  # its sizes; the vocabulary (vocab_size) is the tokenizer's
    return read_json_object(Path(config), required=True)


def load_tokenizer(checkpoint: Checkpoint | None, config, tokenizer: str | Path | None) -> Tokenizer:
    """The tokenizer of `tokenizer` (a folder), else of the checkpoint, fitted to the model it will train."""
    if checkpoint is not None:
        return tokenizer_for(checkpoint.args, tokenizer if tokenizer is not None else checkpoint)
    settings = {"model_type": "bert", **read_config(config)}
    # without a vocab_size the new model takes the tokenizer's (`from_config`), so there is nothing to check yet
    return tokenizer_for(scratch_args(settings), tokenizer, check_vocab="vocab_size" in settings)


def reader(task: str, tokenizer: Tokenizer, run: SimpleNamespace):
    """`read(data, label2id, seed) -> Examples` for `task`, with the columns and options of `run`."""
    default_text, default_label = COLUMNS.get(task, ("text", "label"))
    text, label = run.text_column or default_text, run.label_column or default_label
    max_length = run.max_length

    def read(data, label2id, seed) -> Examples:
        if task == RERANK_TASK:
            return rerank_data(data, tokenizer, max_length, run.columns)
        if task == "sequence-classification":
            return sequence_classification_data(
                data, tokenizer, text_column=text, text_pair_column=run.text_pair_column, label_column=label,
                problem_type=run.problem_type, label2id=label2id, max_length=max_length,
            )  # fmt: skip
        if task == "token-classification":
            return token_classification_data(
                data, tokenizer, text_column=text, label_column=label, label2id=label2id,
                label_all_tokens=run.label_all_tokens, max_length=max_length,
            )  # fmt: skip
        if task == "pretraining":
            rng = np.random.default_rng(seed)
            return pretraining_data(data, tokenizer, rng, text_column=text, max_length=max_length)
        lm_data = causal_lm_data if task == "causal-lm" else masked_lm_data
        return lm_data(data, tokenizer, text_column=text, max_length=max_length)

    return read


def load_head(checkpoint: Checkpoint, task: str, examples: Examples) -> nn.Module:
    """The checkpoint's model with the `task` head, in float32 (the weights training updates). A classification
    head is kept when it has the data's labels, else created fresh with them."""
    if task == RERANK_TASK:
        return load_reranker(checkpoint)
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
                f"{examples.label2id}; pass label2id={stored!r} if the data's labels are among them, or start "
                "from a checkpoint without this head"
            )
        return load_model(checkpoint, dtype="float32", task=task)
    return load_model(checkpoint, dtype="float32", task=task, **labels)


def from_config(config: dict, task: str, tokenizer: Tokenizer) -> nn.Module:
    """A new model of `config`'s sizes, every weight initialised as transformers does (normal(0,
    initializer_range), zero biases, LayerNorm 1/0, a zero padding embedding); `vocab_size`, `pad_token_id`
    and, for causal LM, `eos_token_id` and `bos_token_id` default to the tokenizer's."""
    config.setdefault("model_type", "bert")
    config.setdefault("vocab_size", tokenizer.max_id + 1)
    config.setdefault("pad_token_id", tokenizer.pad_token_id)
    if task == "causal-lm":  # a decoder's start and end tokens: the tokenizer's (GPT-2's 50256 may not exist)
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


def rtd_pair(
    checkpoint: Checkpoint | None,
    config: str | Path | Mapping | None,
    tokenizer: Tokenizer,
    generator: str | Path | None,
    size: float,
    weight: float,
) -> ReplacedTokenDetection:
    """The discriminator (from `checkpoint` or new, of `config`'s sizes) and the generator (from its checkpoint, or
    new at `size` x the discriminator's width), sharing the discriminator's embeddings."""
    if checkpoint is None:
        settings = {"model_type": "electra", **read_config(config)}
        if settings["model_type"] != "electra":
            raise ValueError(f"rtd trains ELECTRA models; config= has model_type {settings['model_type']!r}")
        discriminator = from_config(settings, "pretraining", tokenizer)
        start_at_base_rate(discriminator, rtd_masker(tokenizer))
    else:
        discriminator = load_model(checkpoint, dtype="float32", task="pretraining")
    if generator is not None:
        part = load_model(generator, dtype="float32", task="masked-lm")
    else:
        part = from_config(generator_args(discriminator.args, size).to_config(), "masked-lm", tokenizer)
    return ReplacedTokenDetection(discriminator, part, weight)


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

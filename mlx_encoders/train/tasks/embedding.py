"""`fine_tune("embed", ...)`: a sentence-transformers folder (or a plain encoder checkpoint, given mean pooling as
`SentenceTransformer` gives it) trained with an embedding loss through `trainer.train`, saved as a complete
sentence-transformers folder that `SentenceTransformer(folder)` and `SentenceEncoder(folder)` load."""

from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn

from ... import distributed
from ...checkpoint.build import load_model
from ...checkpoint.files import Checkpoint, resolve
from ...checkpoint.tokenizer import tokenizer_for
from ...embeddings.folder import apply_sentence_config
from ...models.layers import drawing_from
from ...tokenizer import Tokenizer, token_limit
from ..checkpointing import ADAPTERS_FOLDER, MODEL_FOLDER
from ..config import OptionError, Trained
from ..embedding import (
    DenseModel,
    DenseObjective,
    EmbeddingObjective,
    TextExamples,
    embedding_data,
    make_loss,
    read_setup,
    save_sentence_transformer,
)
from ..lora import apply_lora, fuse, save_adapters
from ..options import Data
from ..trainer import train
from .heads import check_max_length


def train_task(data: Data, run: SimpleNamespace) -> Trained:
    """See `fine_tune`: the embed task's part; `run` holds the options (`options.read_options`)."""
    options, model, query_prompt, document_prompt = run.training, run.model, run.query_prompt, run.document_prompt
    if model is None:
        raise ValueError(
            "fine_tune('embed') starts from model=: a sentence-transformers folder or an encoder checkpoint"
        )
    if run.task_adapter is not None and run.lora_rank:
        raise OptionError(
            f"task_adapter={run.task_adapter!r} trains an adapter the model has, lora_rank adds a new one; give one"
        )
    setup = read_setup(resolve(model))
    checkpoint = Checkpoint.open(setup.transformer)
    query = setup.prompts.get("query", "") if query_prompt is None else query_prompt
    document = setup.prompts.get("document", "") if document_prompt is None else document_prompt
    if not setup.include_prompt and (query or document):
        raise ValueError(
            f"{setup.transformer}: the pooling leaves prompts out (include_prompt false), which training with "
            "prompts does not support; train without query_prompt/document_prompt or with include_prompt true"
        )
    setup.prompts = {**setup.prompts, "query": query, "document": document}
    tok, limit, examples, evaluation = text_examples(
        checkpoint, run.tokenizer, setup.sentence_config, run.max_length, data, run.eval_data, query, document,
        columns=run.columns,
    )  # fmt: skip
    loss = make_loss(run.loss, scored=examples.labels[0] is not None)
    in_batch = getattr(loss, "in_batch_negatives", False)
    sampler = run.batch_sampler or ("no_duplicates" if in_batch else "batch_sampler")
    similarity = setup.similarity_fn_name or "cosine"
    kind = DenseObjective if setup.dense else EmbeddingObjective
    objective = kind(loss, tok, setup.pooling, setup.normalize, sampler, similarity_fn_name=similarity)
    net = load_model(checkpoint, dtype="float32", task="encoder")
    encoder, net = net, DenseModel(net, setup.dense) if setup.dense else net
    if run.task_adapter is not None:
        train_task_adapter(net, encoder, run.task_adapter, setup.transformer)
    if hasattr(loss, "check_width"):
        loss.check_width(net.dense[-1].weight.shape[0] if setup.dense else net.args.output_size * len(setup.pooling))
    net, metrics = train_objective(net, tok, objective, examples, evaluation, run)
    if run.task_adapter is not None:
        encoder.train_adapter(None)  # the trained A and B stay in the adapter, written with the others
    path = options.output_dir / MODEL_FOLDER
    if distributed.is_main():  # under mlx.launch, rank 0 alone writes
        save_sentence_transformer(net, path, tok, setup, limit)
    net.eval()
    return Trained(net, tok, metrics, Path(path))


def train_task_adapter(net: nn.Module, encoder: nn.Module, task: str, folder: Path) -> None:
    """Leave only the task adapter `task` of `encoder` trainable in `net` (a Dense stack included)."""
    if not hasattr(encoder, "train_adapter"):
        raise ValueError(
            f"{folder}: a {encoder.args.model_type} model has no task adapters; task_adapter is for models that "
            "select one per call (jina-embeddings-v3, its adapter subfolders)"
        )
    net.freeze()
    encoder.train_adapter(task)  # names the model's adapters when it has no `task`


def text_examples(
    checkpoint: Checkpoint,
    tokenizer: str | Path | None,
    sentence_config: Mapping,
    max_length: int | None,
    data,
    eval_data,
    query_prompt: str,
    document_prompt: str,
    query_max_length: int | None = None,
    columns: Mapping[str, str] | Sequence[str] | None = None,
) -> tuple[Tokenizer, int, TextExamples, TextExamples | None]:
    """(tokenizer, token limit, training examples, evaluation examples or None) of a retrieval-style task: the
    tokenizer of the checkpoint (lowercasing as `do_lower_case` says), the limit `max_length` or the folder's
    `max_seq_length` or the tokenizer's, within the model's positions; `query_max_length` for the first column;
    `columns` the data's columns to read (`data.select_columns`)."""
    tok = tokenizer_for(checkpoint.args, tokenizer if tokenizer is not None else checkpoint)
    check_max_length(max_length, "sentence-embedding", tok, pairs=False)  # a text of special tokens alone
    apply_sentence_config(tok, sentence_config)
    limit = token_limit(tok, checkpoint.args.max_tokens, max_length, sentence_config.get("max_seq_length"))
    read = dict(query_prompt=query_prompt, document_prompt=document_prompt, max_length=limit,
                query_max_length=query_max_length, columns=columns)  # fmt: skip
    examples = embedding_data(data, tok, **read)
    evaluation = embedding_data(eval_data, tok, **read) if eval_data is not None else None
    return tok, limit, examples, evaluation


def train_objective(
    net: nn.Module,
    tok: Tokenizer,
    objective: EmbeddingObjective,
    examples: TextExamples,
    evaluation: TextExamples | None,
    run: SimpleNamespace,
) -> tuple[nn.Module, dict]:
    """Check the data against the objective, add LoRA adapters, train through `trainer.train`, save the adapters
    and fuse them; returns (the trained model, the final metrics)."""
    options, lora_rank = run.training, run.lora_rank
    for part in (examples, evaluation):
        if part is not None:
            objective.check(part)
    if lora_rank:  # LoRA's new weights from the seed; MLX's global key untouched
        with drawing_from([mx.random.key(options.seed)]):
            apply_lora(net, rank=lora_rank, alpha=run.lora_alpha or 2 * lora_rank, targets=run.lora_targets)
    if getattr(net, "pooler", None) is not None:  # unused by pooling: torch's AdamW neither steps nor decays it
        net.pooler.freeze()
    metrics = train(net, tok, examples, evaluation, options, resume_from=run.resume, objective=objective)
    if lora_rank:
        if distributed.is_main():
            save_adapters(net, options.output_dir / ADAPTERS_FOLDER)
        net = fuse(net)
    return net, metrics

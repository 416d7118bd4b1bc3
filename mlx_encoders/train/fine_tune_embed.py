"""`fine_tune("embed", ...)`: a sentence-transformers folder (or a plain encoder checkpoint, given mean pooling as
`SentenceTransformer` gives it) trained with an embedding loss through `trainer.train`, saved as a complete
sentence-transformers folder that `SentenceTransformer(folder)` and `SentenceEncoder(folder)` load."""

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from .. import distributed
from ..checkpoint.build import load_model
from ..checkpoint.files import Checkpoint, resolve
from ..checkpoint.tokenizer import tokenizer_for
from ..embeddings.folder import apply_sentence_config
from ..models.layers import drawing_from
from ..tokenizer import Tokenizer, token_limit
from .config import Trained, TrainingConfig
from .embedding import (
    DenseModel,
    EmbeddingObjective,
    TextExamples,
    embedding_data,
    make_loss,
    read_setup,
    save_sentence_transformer,
)
from .fine_tune import check_max_length, training_config
from .lora import apply_lora, fuse, save_adapters
from .trainer import ADAPTERS_FOLDER, MODEL_FOLDER, train


def fine_tune_embedding(
    data: str | Path | Iterable[Mapping],
    output_dir: str | Path,
    *,
    model: str | Path,
    tokenizer: str | Path | None = None,
    eval_data: str | Path | Iterable[Mapping] | None = None,
    max_length: int | None = None,
    lora_rank: int | None = None,
    lora_alpha: float | None = None,
    lora_targets: list[str] | None = None,
    resume: str | Path | None = None,
    loss=None,
    query_prompt: str | None = None,
    document_prompt: str | None = None,
    batch_sampler: str | None = None,
    columns: Mapping[str, str] | Sequence[str] | None = None,
    **training,
) -> Trained:
    """See `fine_tune`: the embed task's part."""
    options = training_config(output_dir, training)
    if model is None:
        raise ValueError(
            "fine_tune('embed') starts from model=: a sentence-transformers folder or an encoder checkpoint"
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
        checkpoint, tokenizer, setup.sentence_config, max_length, data, eval_data, query, document, columns=columns
    )
    loss = make_loss(loss, scored=examples.labels[0] is not None)
    in_batch = getattr(loss, "in_batch_negatives", False)
    sampler = batch_sampler or ("no_duplicates" if in_batch else "batch_sampler")
    similarity = setup.similarity_fn_name or "cosine"
    objective = EmbeddingObjective(loss, tok, setup.pooling, setup.normalize, sampler, similarity_fn_name=similarity)
    net = load_model(checkpoint, dtype="float32", task="encoder")
    net = DenseModel(net, setup.dense) if setup.dense else net
    if hasattr(loss, "check_width"):
        loss.check_width(net.dense[-1].weight.shape[0] if setup.dense else net.args.output_size * len(setup.pooling))
    net, metrics = train_objective(net, tok, objective, examples, evaluation, options, lora_rank, lora_alpha,
                                   lora_targets, resume)  # fmt: skip
    path = options.output_dir / MODEL_FOLDER
    if distributed.is_main():  # under mlx.launch, rank 0 alone writes
        save_sentence_transformer(net, path, tok, setup, limit)
    net.eval()
    return Trained(net, tok, metrics, Path(path))


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
    options: TrainingConfig,
    lora_rank: int | None,
    lora_alpha: float | None,
    lora_targets: list[str] | None,
    resume: str | Path | None,
) -> tuple[nn.Module, dict]:
    """Check the data against the objective, add LoRA adapters, train through `trainer.train`, save the adapters
    and fuse them; returns (the trained model, the final metrics)."""
    for part in (examples, evaluation):
        if part is not None:
            objective.check(part)
    if lora_rank:  # LoRA's new weights from the seed; MLX's global key untouched
        with drawing_from([mx.random.key(options.seed)]):
            apply_lora(net, rank=lora_rank, alpha=lora_alpha or 2 * lora_rank, targets=lora_targets)
    if getattr(net, "pooler", None) is not None:  # unused by pooling: torch's AdamW neither steps nor decays it
        net.pooler.freeze()
    metrics = train(net, tok, examples, evaluation, options, resume_from=resume, objective=objective)
    if lora_rank:
        if distributed.is_main():
            save_adapters(net, options.output_dir / ADAPTERS_FOLDER)
        net = fuse(net)
    return net, metrics

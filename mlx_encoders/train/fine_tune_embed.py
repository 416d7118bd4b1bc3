"""`fine_tune("embed", ...)`: a sentence-transformers folder (or a plain encoder checkpoint, given mean pooling as
`SentenceTransformer` gives it) trained with an embedding loss through `trainer.train`, saved as a complete
sentence-transformers folder that `SentenceTransformer(folder)` and `SentenceEncoder(folder)` load."""

from collections.abc import Iterable, Mapping
from pathlib import Path

import mlx.core as mx

from ..checkpoint.build import load_model
from ..checkpoint.files import Checkpoint, resolve
from ..checkpoint.tokenizer import tokenizer_for
from ..models.layers import drawing_from
from ..sentence import lowercase
from .embedding import EmbeddingObjective, embedding_data, make_loss, read_setup, save_sentence_transformer
from .fine_tune import Trained, check_call_options, training_config
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
    **training,
) -> Trained:
    """See `fine_tune`: the embed task's part."""
    options = training_config(output_dir, training)
    check_call_options(max_length, lora_rank, lora_alpha)
    if model is None:
        raise ValueError(
            "fine_tune('embed') starts from model=: a sentence-transformers folder or an encoder checkpoint"
        )
    setup = read_setup(resolve(model))
    checkpoint = Checkpoint.open(setup.transformer)
    tok = tokenizer_for(checkpoint.args, tokenizer if tokenizer is not None else checkpoint)
    if setup.sentence_config.get("do_lower_case"):
        lowercase(tok)
    limit = max_length or setup.sentence_config.get("max_seq_length") or tok.model_max_length
    limit = min(limit, checkpoint.args.max_tokens or limit)
    query = setup.prompts.get("query", "") if query_prompt is None else query_prompt
    document = setup.prompts.get("document", "") if document_prompt is None else document_prompt
    if not setup.include_prompt and (query or document):
        raise ValueError(
            f"{setup.transformer}: the pooling leaves prompts out (include_prompt false), which training with "
            "prompts does not support; train without query_prompt/document_prompt or with include_prompt true"
        )
    setup.prompts = {**setup.prompts, "query": query, "document": document}
    examples = embedding_data(data, tok, query_prompt=query, document_prompt=document, max_length=limit)
    evaluation = None
    if eval_data is not None:
        evaluation = embedding_data(eval_data, tok, query_prompt=query, document_prompt=document, max_length=limit)
    loss = make_loss(loss, scored=examples.labels[0] is not None)
    in_batch = getattr(loss, "in_batch_negatives", False)
    sampler = batch_sampler or ("no_duplicates" if in_batch else "batch_sampler")
    similarity = setup.similarity_fn_name or "cosine"
    objective = EmbeddingObjective(loss, tok, setup.pooling, setup.normalize, sampler, similarity_fn_name=similarity)
    for part in (examples, evaluation):
        if part is not None:
            objective.check(part)
    net = load_model(checkpoint, dtype="float32", task="encoder")
    if hasattr(loss, "check_width"):
        loss.check_width(net.args.hidden_size * len(setup.pooling))
    if lora_rank:  # LoRA's new weights from the seed; MLX's global key untouched
        with drawing_from([mx.random.key(options.seed)]):
            apply_lora(net, rank=lora_rank, alpha=lora_alpha or 2 * lora_rank, targets=lora_targets)
    if getattr(net, "pooler", None) is not None:  # unused by pooling: torch's AdamW neither steps nor decays it
        net.pooler.freeze()
    metrics = train(net, tok, examples, evaluation, options, resume_from=resume, objective=objective)
    if lora_rank:
        save_adapters(net, options.output_dir / ADAPTERS_FOLDER)
        net = fuse(net)
    path = save_sentence_transformer(net, options.output_dir / MODEL_FOLDER, tok, setup, limit)
    net.eval()
    return Trained(net, tok, metrics, Path(path))

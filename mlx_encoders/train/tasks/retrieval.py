"""`fine_tune("sparse", ...)` (SPLADE: `SpladeLoss`, MNRL on sparse dot scores plus FLOPS) and
`fine_tune("multivector", ...)` (ColBERT: MaxSim MNRL), on the embed task's objective and `trainer.train`.

Each starts from a sentence-transformers folder (`SparseEncoder`: a fill-mask Transformer then SpladePooling;
`MultiVectorEncoder`: Transformer, token Dense, MultiVectorMask, Normalize) or from a plain checkpoint, built as
sentence-transformers 6 builds one: a masked-LM gets SpladePooling("max"); an encoder gets a new bias-free
Dense to 128 dimensions, a MultiVectorMask without skiplist and Normalize. The trained model is saved as a complete
folder of the same modules, which sentence-transformers and `mlx_encoders.SparseEncoder` / `MultiVectorEncoder`
load. The first data column is the query side, the others the documents (positives, then hard negatives).
"""

import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ... import distributed
from ...checkpoint.atomic import atomic_folder
from ...checkpoint.build import load_model
from ...checkpoint.files import Checkpoint, read_safetensors, resolve
from ...checkpoint.write import model_config, write_checkpoint
from ...embeddings import folder as st_folder
from ...embeddings.folder import (
    DENSE_ACTIVATIONS,
    TRANSFORMERS,
    MultiVectorMask,
    read_folder,
    read_splade_pooling,
)
from ...embeddings.multi_vector import MultiVectorEncoder
from ...embeddings.sparse import splade_pool
from ...embeddings.vectors import normalize
from ...tokenizer import Tokenizer
from ..checkpointing import MODEL_FOLDER
from ..config import OptionError, Trained
from ..embedding import EmbeddingObjective, TextExamples
from ..losses.multi_vector import MaxSimRankingLoss
from ..losses.sparse import SpladeLoss
from ..objective import OwnFormat
from ..options import Data
from .embedding import text_examples, train_objective

COLBERT_DIMENSION = 128  # sentence-transformers' projection for a plain encoder
PROJECTIONS_FILE = "projections.safetensors"  # a multivector training checkpoint's Dense weights


@dataclass
class RetrievalSetup:
    """A sentence-transformers folder's parts: its root, its transformer's folder, its modules (the trained folder
    keeps their order and paths), config_sentence_transformers.json and the transformer's sentence_bert_config."""

    root: Path
    transformer: Path
    modules: list[tuple[str, str]]  # (type or kind, path relative to the root; "" for the root) in modules.json order
    settings: dict
    sentence_config: dict

    @property
    def prompts(self) -> dict:
        return dict(self.settings.get("prompts") or {})


def read_retrieval_setup(path: Path, model_type: str, allowed: tuple[str, ...]) -> RetrievalSetup:
    """The setup of a sentence-transformers folder of `allowed` module kinds (no modules.json: a plain
    checkpoint, its modules left to the caller)."""
    folder = read_folder(path)
    folder.check_kinds(allowed, f"{model_type} training")
    modules = [(m.type, str(m.folder.relative_to(path)) if m.folder != path else "") for m in folder.modules]
    settings = dict(folder.settings)
    settings.setdefault("model_type", model_type)
    return RetrievalSetup(path, folder.transformer, modules, settings, folder.sentence_config)


def prompts_of(setup: RetrievalSetup, query_prompt: str | None, document_prompt: str | None) -> tuple[str, str]:
    """The query and document prompts: the given ones, else the folder's (as the embed task reads them)."""
    prompts = setup.prompts
    query = prompts.get("query", "") if query_prompt is None else query_prompt
    document = prompts.get("document", "") if document_prompt is None else document_prompt
    setup.settings["prompts"] = {**prompts, "query": query, "document": document}
    return query, document


def save_retrieval_folder(
    folder: Path,
    write_transformer,
    tokenizer: Tokenizer,
    setup: RetrievalSetup,
    files: Mapping[str, object],
    max_seq_length: int | None,
) -> Path:
    """`folder` as sentence-transformers saves it: the source's modules.json and module folders, the trained
    transformer (`write_transformer(path)`) with the tokenizer and sentence_bert_config.json at its path, the
    prompts in config_sentence_transformers.json, and `files` (relative path -> a JSON value, or a dict of
    arrays for a .safetensors file) written over them. Written whole or not at all."""
    transformer = next(rel for kind, rel in setup.modules if kind.rsplit(".", 1)[-1] in TRANSFORMERS)
    sentence_config = dict(setup.sentence_config)
    if max_seq_length is not None:
        sentence_config["max_seq_length"] = max_seq_length
    with atomic_folder(folder, replace=True, whole=True) as tmp:
        for _, rel in setup.modules:
            if rel and rel != transformer and (setup.root / rel).is_dir():
                shutil.copytree(setup.root / rel, tmp / rel)
        st_folder.write_folder(tmp, setup.modules, setup.settings, sentence_config, transformer)
        write_transformer(tmp / transformer)
        tokenizer.save(tmp / transformer)
        for rel, value in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            if rel.endswith(".safetensors"):
                mx.save_safetensors(str(tmp / rel), dict(value))
            else:
                st_folder.write_json(tmp / rel, value)
    return folder


def writer(model: nn.Module):
    return lambda target: write_checkpoint(model, model_config(model), target)


# ----- sparse (SPLADE) -----


@dataclass
class SparseObjective(EmbeddingObjective):
    """The embed objective with SPLADE's pass: masked-LM logits -> log(1 + relu) -> max or sum over tokens."""

    strategy: str = "max"
    activation: str = "relu"
    ranks_texts: ClassVar[bool] = False  # retrieval metrics are the dense models' (cosine or dot)
    other_data: ClassVar[str] = "sparse training takes anchor, positive (negative...) rows, without scores"

    def embed(self, model: nn.Module, features: dict[str, mx.array], column: int) -> mx.array:
        return splade_pool(model, features, self.strategy, self.activation)


def train_sparse(data: Data, run: SimpleNamespace) -> Trained:
    """See `fine_tune`: the sparse task's part. `loss` a `losses.sparse.SpladeLoss` (its weights), default
    `SpladeLoss()`."""
    options, model = run.training, run.model
    if model is None:
        raise ValueError("fine_tune('sparse') starts from model=: a SparseEncoder folder or a masked-LM checkpoint")
    loss = SpladeLoss() if run.loss is None else run.loss
    if not isinstance(loss, SpladeLoss):
        raise TypeError(f"fine_tune('sparse') trains with loss=SpladeLoss(...) (train.losses.sparse), got {loss!r}")
    path = resolve(model)
    setup = read_retrieval_setup(path, "SparseEncoder", ("Transformer", "MLMTransformer", "SpladePooling"))
    checkpoint = Checkpoint.open(setup.transformer)
    if not setup.modules:  # a plain checkpoint: sentence-transformers' SparseEncoder gives a masked-LM max pooling
        if checkpoint.task != "masked-lm":
            raise ValueError(
                f"{path}: a {checkpoint.task} checkpoint; fine_tune('sparse') starts from a masked-LM checkpoint "
                "(its head gives the vocabulary weights) or a SparseEncoder folder"
            )
        setup.modules = [("Transformer", ""), ("SpladePooling", "1_SpladePooling")]
        setup.sentence_config = {"transformer_task": "fill-mask", **setup.sentence_config}
    pooling_folder = next((rel for kind, rel in setup.modules if kind.endswith("SpladePooling")), None)
    if pooling_folder is None:
        raise ValueError(f"{path / 'modules.json'}: no SpladePooling module after the transformer")
    pooling = read_splade_pooling(path / pooling_folder)  # defaults where the folder is new
    query, document = prompts_of(setup, run.query_prompt, run.document_prompt)
    tok, _, examples, evaluation = text_examples(
        checkpoint, run.tokenizer, setup.sentence_config, run.max_length, data, run.eval_data, query, document,
        columns=run.columns,
    )  # fmt: skip
    sampler = run.batch_sampler or "no_duplicates"
    strategy, activation = pooling.strategy, pooling.activation
    objective = SparseObjective(loss, tok, batch_sampler=sampler, strategy=strategy, activation=activation)
    net = load_model(checkpoint, dtype="float32", task="masked-lm")
    net, metrics = train_objective(net, tok, objective, examples, evaluation, run)
    setup.settings.setdefault("similarity_fn_name", "dot")
    files = {f"{pooling_folder}/config.json": pooling.config()}
    saved = options.output_dir / MODEL_FOLDER
    if distributed.is_main():  # under mlx.launch, rank 0 alone writes
        save_retrieval_folder(saved, writer(net), tok, setup, files, run.max_length)
    net.eval()
    return Trained(net, tok, metrics, Path(saved))


# ----- multi-vector (ColBERT) -----


class MultiVectorModel(nn.Module):
    """An encoder with its token projections (bias-free or not, identity activation) and Normalize: the weights
    `fine_tune("multivector")` trains. Calling it gives (B, L, D) float32 token embeddings."""

    def __init__(self, encoder: nn.Module, projections: list[nn.Linear], normalized: bool):
        super().__init__()
        self.encoder = encoder
        self.projections = projections
        self.normalized = normalized

    def __call__(self, input_ids: mx.array, attention_mask: mx.array, token_type_ids=None) -> mx.array:
        x = self.encoder(input_ids, attention_mask, token_type_ids).last_hidden_state.astype(mx.float32)
        for linear in self.projections:
            x = linear(x)
        return normalize(x) if self.normalized else x

    def gradient_checkpointing_enable(self) -> None:
        self.encoder.gradient_checkpointing_enable()

    def write_checkpoint(self, folder: Path) -> None:
        """A training checkpoint: the encoder's checkpoint plus `projections.safetensors`."""
        write_checkpoint(self.encoder, model_config(self.encoder), folder)
        mx.save_safetensors(str(Path(folder) / PROJECTIONS_FILE), dict(tree_flatten(self.projections)))

    def read_checkpoint(self, folder: Path) -> None:
        encoder = load_model(folder, task="encoder")
        projections = read_safetensors(Path(folder) / PROJECTIONS_FILE)
        current = dict(tree_flatten(self.parameters()))
        saved = {f"encoder.{k}": v for k, v in tree_flatten(encoder.parameters())}
        saved |= {f"projections.{k}": v for k, v in projections.items()}
        if saved.keys() != current.keys() or any(saved[k].shape != v.shape for k, v in current.items()):
            raise ValueError(f"{folder} does not hold this model's weights; resume with the run that wrote it")
        self.load_weights(list(saved.items()))


class SentenceTransformerSource(MultiVectorEncoder):
    """A SentenceTransformer folder's transformer alone (its pooling and Normalize dropped), as sentence-transformers'
    MultiVectorEncoder reads one before adding the token modules."""

    def __init__(self, path: Path):
        super().__init__(path, dtype="float32", similarity_fn_name="maxsim")

    def read_folder(self):
        folder = read_folder(self.path)
        folder.modules = [m for m in folder.modules if m.kind == "Transformer"]
        return folder


def converted(path: Path, setup: RetrievalSetup) -> MultiVectorEncoder:
    """A SentenceTransformer folder (Transformer, Pooling, Normalize) started from as sentence-transformers 6
    converts one: its transformer, then the token modules a plain encoder gets; `setup` becomes a plain one's."""
    if any(kind.endswith(".Dense") for kind, _ in setup.modules):
        raise ValueError(
            f"{path / 'modules.json'}: a SentenceTransformer folder with a Dense module; start from its transformer "
            "(or a MultiVectorEncoder folder) instead"
        )
    prompts = setup.prompts
    setup.modules, setup.settings = [], {"model_type": "MultiVectorEncoder", "similarity_fn_name": "maxsim"}
    setup.settings["prompts"] = prompts
    return SentenceTransformerSource(path)


@dataclass
class MultiVectorObjective(OwnFormat, EmbeddingObjective):
    """The embed objective with ColBERT's pass: the first column tokenized as queries (query length, query
    expansion), the others as documents (skiplist), each giving (token embeddings, scored-token mask); its
    checkpoints hold the projections beside the encoder (`MultiVectorModel`)."""

    encoder: MultiVectorEncoder | None = None
    ranks_texts: ClassVar[bool] = False  # one matrix per text: the row metrics rank single vectors
    other_data: ClassVar[str] = "multi-vector training takes anchor, positive (negative...) rows, without scores"
    groups_by_length: ClassVar[bool] = False  # token matrices as wide as the batch's (queries expanded to a length)

    def collate(self, examples: TextExamples, indices, rng: np.random.Generator | None = None) -> dict:
        columns = []
        for c, column in enumerate(examples.columns):
            batch, scored = self.encoder.batch([column[i] for i in indices], "query" if c == 0 else "document")
            columns.append({**{k: np.array(v) for k, v in batch.items()}, "scored": scored.astype(np.float32)})
        return {"columns": columns, "labels": None}

    def embed(self, model: nn.Module, features: dict[str, mx.array], column: int) -> tuple[mx.array, mx.array]:
        x = model(features["input_ids"], features["attention_mask"], features.get("token_type_ids"))
        return x, features["scored"]

    def embed_column(self, model: nn.Module, features: dict[str, mx.array], column: int, size: int):
        return self.embed(model, features, column)


def train_multivector(data: Data, run: SimpleNamespace) -> Trained:
    """See `fine_tune`: the multivector task's part. `loss` a `losses.multi_vector.MaxSimRankingLoss` (its
    scale), default scale 1 as sentence-transformers'."""
    options, model, max_length = run.training, run.model, run.max_length
    if model is None:
        raise ValueError("fine_tune('multivector') starts from model=: a MultiVectorEncoder folder or an encoder")
    if run.lora_rank:
        raise OptionError("fine_tune('multivector') trains the whole model and its projection; drop lora_rank")
    loss = MaxSimRankingLoss() if run.loss is None else run.loss
    if not isinstance(loss, MaxSimRankingLoss):
        raise TypeError(f"fine_tune('multivector') trains with loss=MaxSimRankingLoss(...), got {loss!r}")
    path = resolve(model)
    kinds = ("Transformer", "Dense", "MultiVectorMask", "Normalize", "Pooling")
    setup = read_retrieval_setup(path, "MultiVectorEncoder", kinds)
    if any(kind.endswith(".Pooling") for kind, _ in setup.modules):
        encoder = converted(path, setup)
    else:
        encoder = MultiVectorEncoder(path, dtype="float32")
    if any(d.use_residual or d.activation is not DENSE_ACTIVATIONS["Identity"] for d in encoder.dense):
        raise ValueError(f"{path}: only Dense projections with the identity activation and no residual are trained")
    files: dict[str, object] = {}
    if not setup.modules:  # a plain encoder, as sentence-transformers 6 builds it: a new projection to 128
        width = encoder.model.args.hidden_size
        projection = nn.Linear(width, COLBERT_DIMENSION, bias=False)
        bound = width**-0.5  # nn.Linear's own initialisation, drawn from the seed (it draws from MLX's global key)
        projection.weight = mx.random.uniform(-bound, bound, projection.weight.shape, key=mx.random.key(options.seed))
        encoder.dense, encoder.normalize = [], True
        projections = [projection]
        setup.modules = [("Transformer", ""), ("Dense", "1_Dense"), ("MultiVectorMask", "2_MultiVectorMask"),
                         ("Normalize", "3_Normalize")]  # fmt: skip
        setup.sentence_config = {"transformer_task": "feature-extraction", **setup.sentence_config}
        files["1_Dense/config.json"] = {
            "in_features": width, "out_features": COLBERT_DIMENSION, "bias": False,
            "activation_function": "torch.nn.modules.linear.Identity", "module_input_name": "token_embeddings",
            "module_output_name": "token_embeddings",
        }  # fmt: skip
        files["2_MultiVectorMask/config.json"] = MultiVectorMask().config()
        files["3_Normalize/config.json"] = {
            "module_input_name": "token_embeddings", "module_output_name": "token_embeddings"
        }  # fmt: skip
    else:
        projections = [d.linear for d in encoder.dense]
    if max_length is not None:
        encoder.max_seq_length = max_length
    query, document = prompts_of(setup, run.query_prompt, run.document_prompt)
    tok, _, examples, evaluation = text_examples(
        Checkpoint.open(setup.transformer), run.tokenizer, setup.sentence_config, encoder.max_length("document"),
        data, run.eval_data, query, document, query_max_length=encoder.max_length("query"), columns=run.columns,
    )  # fmt: skip
    encoder.tokenizer = tok  # padding, expansion and skiplist ids from the tokenizer the texts were cut with
    encoder.skip_ids = encoder.resolve_skiplist()
    objective = MultiVectorObjective(loss, tok, batch_sampler=run.batch_sampler or "no_duplicates", encoder=encoder)
    net = MultiVectorModel(encoder.model, projections, encoder.normalize)
    net, metrics = train_objective(net, tok, objective, examples, evaluation, run)
    dense_folders = [rel for kind, rel in setup.modules if kind.rsplit(".", 1)[-1] == "Dense"]
    for rel, linear in zip(dense_folders, net.projections, strict=True):
        files[f"{rel}/model.safetensors"] = {f"linear.{k}": v for k, v in tree_flatten(linear.parameters())}
    setup.settings.setdefault("similarity_fn_name", "maxsim")
    saved = options.output_dir / MODEL_FOLDER
    if distributed.is_main():  # under mlx.launch, rank 0 alone writes
        save_retrieval_folder(saved, writer(net.encoder), tok, setup, files, max_length)
    net.eval()
    return Trained(net, tok, metrics, Path(saved))

"""Training sentence-embedding models, as sentence-transformers' trainer does: text-column data (anchor, positive,
negatives; or sentence1, sentence2, score), the `no_duplicates` batch sampler (`base/sampler.py`,
`NoDuplicatesBatchSampler`), the model pass Transformer -> Pooling -> Dense... -> Normalize, GradCache for the
cached loss (`base/losses/gradcache.py`), and the sentence-transformers folder written at the end. The losses
themselves are in `losses/contrastive.py`; the loop is `trainer.train`, given an `EmbeddingObjective`.
"""

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map
from tokenizers import Encoding

from .. import distributed
from ..checkpoint.atomic import atomic_folder
from ..checkpoint.build import load_model
from ..checkpoint.files import Checkpoint, read_safetensors
from ..checkpoint.write import model_config, write_checkpoint
from ..embeddings import folder as st_folder
from ..embeddings.folder import Pooling, read_dense, read_folder
from ..embeddings.pooling import pool
from ..embeddings.sentence import MODULES as DENSE_MODULES
from ..embeddings.sentence import natural_pooling
from ..models.base import HeadModel
from ..models.inputs import checked_inputs, unchecked_inputs
from ..models.layers import one_lookup
from ..tokenizer import Tokenizer
from .data import (
    LABEL_COLUMNS,
    PICKED_COLUMNS,
    DataError,
    Examples,
    by_position,
    is_fraction,
    read_rows,
    regression_target,
    select_columns,
)
from .evaluators import retrieval_metric_names, row_retrieval_metrics
from .losses.contrastive import (
    LOSSES,
    CachedMultipleNegativesRankingLoss,
    CoSENTLoss,
    MatryoshkaLoss,
    MultipleNegativesRankingLoss,
    l2_normalize,
)
from .objective import Objective, OwnFormat
from .tasks import EMBED as TASK

SAMPLERS = ("no_duplicates", "batch_sampler")  # sentence-transformers' BatchSamplers values
MINI_BATCH_WIDTHS = 8  # GradCache's mini-batch widths are multiples of this: a compiled pass has few shapes to trace
# Rows of a training batch embedded together (`length_groups`): few enough for little padding; each group adds its
# own layers to the compiled step, which is traced again for each batch's widths, so not too few.
LENGTH_GROUP = 16
NEGATIVE = re.compile(r"negative_(\d+)")
DENSE_FILE = "dense.safetensors"  # a training checkpoint's Dense weights


# ----- the model's sentence-transformers setup -----


@dataclass
class SentenceSetup:
    """What a sentence-transformers folder adds to its transformer: where the transformer is, pooling, Normalize,
    prompts, similarity and tokenizer settings. A plain checkpoint gets mean pooling, or a causal LM's last token,
    as `SentenceTransformer` gives them."""

    transformer: Path
    pooling: tuple[str, ...] = ("mean",)
    include_prompt: bool = True
    normalize: bool = False
    prompts: dict = field(default_factory=dict)
    similarity_fn_name: str | None = None
    sentence_config: dict = field(default_factory=dict)
    dense: list[Path] = field(default_factory=list)  # the Dense modules' folders, in order (EmbeddingGemma's)
    default_prompt_name: str | None = None
    truncate_dim: int | None = None


def read_setup(path: Path) -> SentenceSetup:
    """The setup of the folder at `path` (modules.json, 1_Pooling, 2_Dense..., config_sentence_transformers.json,
    sentence_bert_config.json); other module kinds are refused."""
    folder = read_folder(path)
    folder.check_kinds(DENSE_MODULES, "fine_tune('embed')", "; start from the folder without it")
    setup = SentenceSetup(folder.transformer)
    pooling = next((m.read() for m in folder.modules if m.kind == "Pooling"), None)
    if pooling is not None:
        setup.pooling, setup.include_prompt = pooling.modes, pooling.include_prompt
    elif not folder.modules and natural_pooling(Checkpoint.open(path).args) == ("lasttoken",):
        setup.pooling = ("lasttoken",)
    _, setup.normalize = folder.projection("sentence_embedding", "fine_tune('embed')")
    setup.dense = [m.folder for m in folder.modules if m.kind == "Dense"]
    setup.prompts = dict(folder.settings.get("prompts") or {})
    setup.similarity_fn_name = folder.settings.get("similarity_fn_name")
    setup.default_prompt_name = folder.settings.get("default_prompt_name")
    setup.truncate_dim = folder.settings.get("truncate_dim")
    setup.sentence_config = folder.sentence_config
    return setup


class DenseModel(HeadModel):
    """A transformer and the Dense modules that follow its pooling: what fine_tune('embed') trains from a folder
    that has them. sentence-transformers trains them in full, with LoRA on the transformer too: a head here.
    Calling it runs the transformer; `project` runs the Dense modules on pooled embeddings."""

    prefix = "model"

    def __init__(self, model: nn.Module, folders: list[Path]):
        nn.Module.__init__(self)
        self.args = model.args
        self.model = model
        denses = [read_dense(folder) for folder in folders]
        for folder, dense in zip(folders, denses, strict=True):
            if dense.use_residual:
                raise ValueError(f"{folder / 'config.json'}: a Dense module with use_residual cannot be trained here")
        self.dense = [dense.linear for dense in denses]
        self.configs = [dense.config for dense in denses]
        self.activations = [dense.activation for dense in denses]  # not parameters: a plain list of functions

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None):
        return self.model(input_ids, attention_mask, token_type_ids)

    def project(self, x: mx.array) -> mx.array:
        for linear, activation in zip(self.dense, self.activations, strict=True):
            x = activation(linear(x))
        return x

    def write_checkpoint(self, folder: Path) -> None:
        """A training checkpoint: the transformer's checkpoint plus `dense.safetensors`."""
        write_checkpoint(self.model, model_config(self.model), folder)
        mx.save_safetensors(str(Path(folder) / DENSE_FILE), dict(tree_flatten(self.dense)))

    def read_checkpoint(self, folder: Path) -> None:
        saved = {f"model.{k}": v for k, v in tree_flatten(load_model(folder, task="encoder").parameters())}
        saved |= {f"dense.{k}": v for k, v in read_safetensors(Path(folder) / DENSE_FILE).items()}
        current = dict(tree_flatten(self.parameters()))
        if saved.keys() != current.keys() or any(saved[k].shape != v.shape for k, v in current.items()):
            raise ValueError(f"{folder} does not hold this model's weights; resume with the run that wrote it")
        self.load_weights(list(saved.items()))


def save_sentence_transformer(
    model: nn.Module, folder: Path, tokenizer: Tokenizer, setup: SentenceSetup, max_seq_length: int
) -> Path:
    """`folder` as `SentenceTransformer.save` writes it: the transformer at the root (config, weights, tokenizer,
    sentence_bert_config.json), modules.json, 1_Pooling/config.json, a `DenseModel`'s Dense modules, Normalize when
    used, and config_sentence_transformers.json with the prompts and the similarity function. Written whole or not
    at all."""
    dense = list(zip(model.dense, model.configs, strict=True)) if isinstance(model, DenseModel) else []
    model = model.model if isinstance(model, DenseModel) else model
    modules = [("Transformer", ""), ("Pooling", "1_Pooling")]
    modules += [("Dense", f"{i}_Dense") for i in range(2, 2 + len(dense))]
    modules += [("Normalize", f"{2 + len(dense)}_Normalize")] if setup.normalize else []
    sentence_config = {**setup.sentence_config, "max_seq_length": max_seq_length}
    sentence_config.setdefault("do_lower_case", False)
    settings = {
        "model_type": "SentenceTransformer",
        "prompts": {"query": "", "document": "", **setup.prompts},
        "default_prompt_name": setup.default_prompt_name,
        "similarity_fn_name": setup.similarity_fn_name or "cosine",
    }
    if setup.truncate_dim is not None:
        settings["truncate_dim"] = setup.truncate_dim
    pooling = st_folder.pooling_config(Pooling(setup.pooling, setup.include_prompt), model.args.output_size)
    with atomic_folder(folder, replace=True, whole=True) as tmp:
        write_checkpoint(model, model_config(model), tmp)
        tokenizer.save(tmp)
        st_folder.write_folder(tmp, modules, settings, sentence_config)
        st_folder.write_module_config(tmp, "1_Pooling", pooling)
        for (_, rel), (linear, config) in zip(modules[2 : 2 + len(dense)], dense, strict=True):
            st_folder.write_dense(tmp / rel, linear, config)
        if setup.normalize:
            st_folder.write_module_config(tmp, modules[-1][1], {})
    return folder


# ----- data -----


@dataclass
class TextExamples(Examples):
    """Examples of several text columns: `columns[c][i]` is example i's encoding in column c (its prompt
    prepended), `texts[i]` its raw texts (what `no_duplicates` compares); `encodings` is the first column, whose
    lengths `group_by_length` reads; `labels` the scores (None each without)."""

    columns: list[list[Encoding]] = field(default_factory=list)
    texts: list[tuple[str, ...]] = field(default_factory=list)
    column_names: list[str] = field(default_factory=list)


def text_columns(row) -> tuple[list[str], str | None]:
    """(text columns, score column) of a row: anchor, positive, then negative and negative_1..n in order; or
    sentence1, sentence2; else (other names, an anchor without a positive, or more columns beside them) every
    column but a label one, by position, as sentence-transformers reads them (`data.by_position`). A label column
    (`data.LABEL_COLUMNS`, the first present) is the score of two texts, whatever their names."""
    values = row.values
    label = next((c for c in LABEL_COLUMNS if c in values), None)
    if "anchor" in values and "positive" in values:
        numbered = sorted((int(m[1]), name) for name in values if (m := NEGATIVE.fullmatch(name)))
        negatives = ["negative"] * ("negative" in values) + [name for _, name in numbered]
        named = {"anchor", "positive", *negatives, *LABEL_COLUMNS}
        if all(name in named for name in values):
            return ["anchor", "positive", *negatives], None if negatives else label
        # another column (hard_negative, neg, ...): sentence-transformers passes it to the loss by position
    elif "sentence1" in values and "sentence2" in values:
        other = [name for name in values if name not in ("sentence1", "sentence2", *LABEL_COLUMNS)]
        if not any(is_fraction(values[name]) for name in other):  # other columns (idx, genre) are not read
            return ["sentence1", "sentence2"], label
        # a score under another name ("Score", "similarity"): refused by position, not left out
    layout = (
        "embedding data has the columns anchor, positive (and optionally negative or negative_1..negative_n), or "
        "sentence1, sentence2 and score"
    )
    texts, label = by_position(row, layout, "anchor=query positive=answer")
    return texts, label if len(texts) == 2 else None


def embedding_data(
    data: str | Path | Iterable[Mapping],
    tokenizer: Tokenizer,
    *,
    query_prompt: str = "",
    document_prompt: str = "",
    max_length: int | None = None,
    query_max_length: int | None = None,
    columns: Mapping[str, str] | Sequence[str] | None = None,
) -> TextExamples:
    """The rows of `data` as text columns, each tokenized with its prompt in front (`query_prompt` before the
    first column, `document_prompt` before the others), as sentence-transformers' data collator prepends them;
    the first column cut at `query_max_length` when given, the others (and it, by default) at `max_length`.
    `columns` picks and renames the data's columns first (`data.select_columns`)."""
    rows = select_columns(read_rows(data, "anchor"), columns)
    names, score = text_columns(rows[0])
    for row in rows[1:]:
        found, _ = text_columns(row)
        if set(found) != set(names):  # in another key order they are read by name, in the first row's order
            raise DataError(
                f"{row.where}: columns {', '.join(found)}, but the first row ({rows[0].where}) has "
                f"{', '.join(names)}; give every row the same text columns"
            )
    texts = [tuple(row.text(c, PICKED_COLUMNS) for c in names) for row in rows]
    scores = (
        [regression_target(row.get(score, PICKED_COLUMNS), row, score) for row in rows] if score else [None] * len(rows)
    )
    prompts = [query_prompt] + [document_prompt] * (len(names) - 1)
    limits = [query_max_length or max_length] + [max_length] * (len(names) - 1)
    columns = [
        tokenizer.encode_batch([prompt + t[c] for t in texts], max_length=limit)
        for c, (prompt, limit) in enumerate(zip(prompts, limits, strict=True))
    ]
    return TextExamples(TASK, columns[0], scores, {}, rows, columns=columns, texts=texts, column_names=names)


def no_duplicates(order: np.ndarray, texts: list[tuple[str, ...]], batch_size: int) -> list[np.ndarray]:
    """sentence-transformers' `NoDuplicatesBatchSampler` (drop_last=False) over `order`: each batch takes the next
    examples in order that share no text (in any column) with it, deferring the others to later batches."""
    remaining, batches = list(order), []
    while remaining:
        batch, seen, deferred = [], set(), []
        for position, index in enumerate(remaining):
            if len(batch) == batch_size:
                deferred += remaining[position:]
                break
            values = set(texts[index])
            if values & seen:
                deferred.append(index)
                continue
            batch.append(index)
            seen |= values
        batches.append(np.array(batch, dtype=order.dtype))
        remaining = deferred
    return batches


# ----- the objective -----


def make_loss(loss, scored: bool):
    """A loss instance from a name of `contrastive.LOSSES` or an instance; default MNRL, CoSENT for scored pairs
    (a `MatryoshkaLoss` of None too)."""
    if loss is None:
        return CoSENTLoss() if scored else MultipleNegativesRankingLoss()
    if isinstance(loss, MatryoshkaLoss) and loss.loss is None:
        return MatryoshkaLoss(make_loss(None, scored), loss.dims, loss.weights)
    if isinstance(loss, str):
        if loss not in LOSSES:
            raise ValueError(f"Unknown embedding loss {loss!r}; choose one of {', '.join(LOSSES)} or pass a loss")
        return LOSSES[loss]()
    if not callable(loss):
        raise TypeError(f"loss= must be a loss name or a loss from mlx_encoders.train.losses.contrastive, got {loss!r}")
    return loss


@dataclass
class EmbeddingObjective(Objective):
    """What `trainer.train` needs to train a sentence-embedding model: batches of text columns, the embedding
    pass, the loss and its gradients (by GradCache for the cached loss) and the evaluation loss."""

    loss: Callable
    tokenizer: Tokenizer
    pooling: tuple[str, ...] = ("mean",)
    normalize: bool = False
    batch_sampler: str = "no_duplicates"
    prompt_tokens: tuple[int, ...] = ()  # per column, the prompt's tokens pooling leaves out (include_prompt=False)
    similarity_fn_name: str = "cosine"  # the retrieval metrics' score function
    ranks_texts: ClassVar[bool] = True  # one vector per text: eval rows give retrieval metrics
    groups_by_length: ClassVar[bool] = True  # a row's embedding is its own, whatever its padding (`length_groups`)

    def __post_init__(self):
        if self.batch_sampler not in SAMPLERS:
            raise ValueError(f"batch_sampler must be one of {', '.join(SAMPLERS)}, got {self.batch_sampler!r}")

    @property
    def cached(self) -> bool:
        return isinstance(getattr(self.loss, "loss", self.loss), CachedMultipleNegativesRankingLoss)

    def check(self, examples: TextExamples) -> None:
        """The data has what the loss reads: scores for CoSENT/cosine, anchor-positive rows for the others."""
        scored = examples.labels[0] is not None
        if getattr(self.loss, "needs_scores", False) != scored:
            wanted = "sentence1, sentence2, score" if not scored else "anchor, positive (negative...)"
            raise ValueError(
                f"{examples.rows[0].source}: {type(self.loss).__name__} trains on rows of {wanted}, but the data has "
                f"{', '.join(examples.column_names)}{' and scores' if scored else ''}; {self.other_data}"
            )

    other_data: ClassVar[str] = "choose a loss for this data (cosent or cosine for scored pairs)"

    def no_signal(self, examples: TextExamples, indices) -> str | None:
        """Why the batch of `indices` gives the loss no gradient, from the loss's `no_signal` (the batch's token
        ids: texts cut to the same tokens are the same text); None when it can learn, or the loss does not say."""
        check = getattr(self.loss, "no_signal", None)  # a loss of the user's may not say
        if check is None:
            return None
        columns = [[tuple(column[i].ids) for i in indices] for column in examples.columns]
        return check(columns, [examples.labels[i] for i in indices])

    def batcher(self, examples: TextExamples, batch_size: int) -> Callable[[np.ndarray], list[np.ndarray]] | None:
        if self.batch_sampler != "no_duplicates":
            return None
        return lambda order: no_duplicates(order, examples.texts, batch_size)

    def collate(self, examples: TextExamples, indices, rng: np.random.Generator | None = None) -> dict:
        """{"columns": one padded numpy batch per text column, "labels": the scores or None}."""
        columns = [self.tokenizer.pad([column[i] for i in indices], return_tensors="np") for column in examples.columns]
        scores = [examples.labels[i] for i in indices]
        labels = None if scores[0] is None else np.array(scores, dtype=np.float32)
        return {"columns": columns, "labels": labels}

    def part(self, batch: dict, world: distributed.World) -> dict:
        """This rank's rows of a collated global batch under `mlx.launch` (`distributed.gathered_part`); the scores
        stay global, as the loss is computed on every rank over every rank's embeddings."""
        mine, order = distributed.gathered_part(batch["columns"][0]["input_ids"].shape[0], world)
        columns = [{k: v[mine] for k, v in f.items()} for f in batch["columns"]]
        return {"columns": columns, "labels": batch["labels"], "order": order}

    def embed(self, model: nn.Module, features: dict[str, mx.array], column: int) -> mx.array:
        """(B, D) float32 sentence embeddings: the transformer, the pooling (without the prompt's tokens when the
        pooling excludes it), the Dense modules of a `DenseModel`, Normalize."""
        mask = features["attention_mask"]
        hidden = model(features["input_ids"], mask, features.get("token_type_ids")).last_hidden_state
        skipped = self.prompt_tokens[column] if self.prompt_tokens else 0
        if skipped:  # the prompt's tokens follow each row's first real one (left padding puts pads before them)
            first = mx.argmax(mask, axis=1, keepdims=True)
            pooled_mask = mask * (mx.arange(mask.shape[1]) >= first + skipped)
        else:
            pooled_mask = mask
        x = pool(hidden.astype(mx.float32), pooled_mask, self.pooling, mask)
        x = model.project(x) if isinstance(model, DenseModel) else x
        return l2_normalize(x) if self.normalize else x

    def length_groups(self, features: dict[str, np.ndarray], size: int | None = None, multiple: int = 1) -> dict:
        """A padded numpy batch as MLX arrays: its rows longest first in groups of `size` (`LENGTH_GROUP`), each cut
        to its own longest row rounded up to a `multiple` (padded further where the batch is narrower), and
        "restore", the order that puts their embeddings back. Padding to the batch's longest (a few long documents)
        would spend most of the pass on padding; a row's embedding depends on neither. A left-padded batch (a
        decoder's) keeps each row's last columns and pads on the left."""
        if not self.groups_by_length:
            return {"groups": [{k: mx.array(v) for k, v in features.items()}]}
        size = size or LENGTH_GROUP
        lengths = features["attention_mask"].sum(axis=1)
        left = left_padded(features["attention_mask"])
        wider = -(-int(lengths.max()) // multiple) * multiple - features["input_ids"].shape[1]
        if wider > 0:  # pad id where the model reads ids, 0 in the mask and token types
            pads, side = {"input_ids": self.tokenizer.pad_token_id}, (wider, 0) if left else (0, wider)
            features = {k: np.pad(v, ((0, 0), side), constant_values=pads.get(k, 0)) for k, v in features.items()}
        order = np.argsort(-lengths, kind="stable")
        groups = []
        for start in range(0, len(order), size):
            rows = order[start : start + size]
            width = -(-int(lengths[rows].max()) // multiple) * multiple
            columns = slice(features["input_ids"].shape[1] - width, None) if left else slice(0, width)
            groups.append({k: mx.array(v[rows, columns]) for k, v in features.items()})
        return {"groups": groups, "restore": mx.array(np.argsort(order))}

    def embed_groups(self, model: nn.Module, column: dict, c: int) -> mx.array:
        """Column `c`'s embeddings, in its rows' order, from its `length_groups`."""
        parts = [self.embed(model, features, c) for features in column["groups"]]
        return mx.concatenate(parts)[column["restore"]] if "restore" in column else parts[0]

    def inputs(self, batch: dict) -> dict:
        """The MLX arrays of a collated batch that `inputs_loss` reads: each column's `length_groups` and the
        scores when there are any (all a compiled step takes)."""
        inputs = {"columns": [self.length_groups(f) for f in batch["columns"]]}
        return inputs if batch["labels"] is None else inputs | {"labels": mx.array(batch["labels"])}

    def inputs_loss(self, model: nn.Module, inputs: dict, order: np.ndarray | None = None) -> mx.array:
        """The loss of a batch's `inputs`, in MLX operations only; with `order`, over every rank's embeddings. The
        length groups of every column look their tokens up at once (`one_lookup`): one gradient of the word table."""
        with one_lookup([f["input_ids"] for column in inputs["columns"] for f in column["groups"]]):
            columns = enumerate(inputs["columns"])
            embeddings = [gathered(self.embed_groups(model, col, c), order) for c, col in columns]
        return self.loss(embeddings, inputs.get("labels"))

    def batch_loss(self, model: nn.Module, batch: dict) -> mx.array:
        """The loss of a batch; of a rank's `part`, the global batch's loss over every rank's embeddings (in-batch
        negatives span the global batch), divided by the world size: this rank's share of the summed gradients."""
        order = batch.get("order")
        loss = self.inputs_loss(model, self.inputs(batch), order)
        return loss if order is None else loss / distributed.world().size

    @property
    def compilable(self) -> bool:
        """Whether the trainer may compile the step (`inputs_loss` of `inputs`); GradCache compiles its own passes
        (`value_and_grad`'s `trace`)."""
        return not self.cached

    def value_and_grad(
        self, model: nn.Module, make: Callable, random: list[mx.array], trace: Callable | None = None
    ) -> Callable:
        """`batch -> (loss, gradients)`; `make(loss_fn)` is the trainer's `value_and_grad` for a loss of one
        argument (it casts to the compute dtype); `random` the dropout key, replayed in GradCache's second pass;
        `trace(fn)`, when the trainer gives it (float32 steps), compiles `fn` over the model's state and the key:
        GradCache's mini-batch passes then run compiled, one trace per mini-batch shape."""
        if not self.cached:
            return make(lambda batch: self.batch_loss(model, batch))
        surrogate = lambda part: (self.embed(model, part[0], part[1]) * part[2]).sum()  # noqa: E731
        if trace is None:
            passes = (lambda part: self.embed(model, *part), make(surrogate))
        else:
            passes = (trace(lambda part: self.embed(model, *part)), trace(nn.value_and_grad(model, surrogate)))
            passes = tuple(unchecked(fn) for fn in passes)
        return lambda batch: self.cached_value_and_grad(model, passes, random, batch, checked=trace is not None)

    def cached_value_and_grad(
        self, model, passes: tuple[Callable, Callable], random: list[mx.array], batch: dict, checked: bool = False
    ) -> tuple[mx.array, dict]:
        """GradCache: every mini-batch's embeddings without a graph (the dropout key saved before each), the loss
        and its gradient with respect to all embeddings, then each mini-batch's pass again under its saved key,
        back-propagated from its rows of that gradient (the surrogate sum(embedding * gradient)). Mini-batches are
        rows of similar length (`length_groups`), as little padding as the plain step has. `passes` are the
        embedding pass and the surrogate's value and gradients; `checked`: they skip the model's input checks
        (compiled), which then run here first on each column (`checked_inputs`)."""
        embed, surrogate = passes
        size = self.loss.mini_batch_size
        columns = [self.length_groups(f, size, MINI_BATCH_WIDTHS) for f in batch["columns"]]
        if not self.groups_by_length:
            columns = [{"groups": mini_batches(column["groups"][0], size)} for column in columns]
        if checked:
            checked_inputs(model, [{k: mx.array(v) for k, v in f.items()} for f in batch["columns"]])
        labels = None if batch["labels"] is None else mx.array(batch["labels"])
        parts = [(c, f) for c, column in enumerate(columns) for f in column["groups"]]
        keys, pieces = [], [[] for _ in columns]
        for c, f in parts:
            keys.append(random[0])
            pieces[c].append(embed((f, c)))
            mx.eval(pieces[c][-1], random[0])
        after = random[0]
        embeddings = [unsorted(mx.concatenate(p), column) for p, column in zip(pieces, columns, strict=True)]
        order = batch.get("order")
        if order is None:
            loss, d_embeddings = mx.value_and_grad(lambda e: self.loss(e, labels))(embeddings)
            mx.eval(loss, d_embeddings)
        else:  # every rank's embeddings; this rank back-propagates its own rows' gradient of the global loss
            world, rows = distributed.world(), embeddings[0].shape[0]
            with distributed.collective(world, "the gather of a step's embeddings"):
                everyone = [distributed.all_gather(e, world) for e in embeddings]
                loss, d_all = mx.value_and_grad(lambda e: self.loss([x[mx.array(order)] for x in e], labels))(everyone)
                mx.eval(loss, d_all)
            loss, d_embeddings = loss / world.size, [d[world.rank * rows : (world.rank + 1) * rows] for d in d_all]
        d_embeddings = [sorted_rows(d, column) for d, column in zip(d_embeddings, columns, strict=True)]
        grads, offsets = None, [0] * len(columns)
        for (c, f), key in zip(parts, keys, strict=True):
            rows = f["input_ids"].shape[0]
            random[0] = key
            _, g = surrogate((f, c, d_embeddings[c][offsets[c] : offsets[c] + rows]))
            offsets[c] += rows
            grads = g if grads is None else tree_map(mx.add, grads, g)
            mx.eval(grads)
        random[0] = after
        return loss, grads

    def metric_names(self, examples: TextExamples) -> list[str]:
        """What `evaluate` reports: the loss, and for anchor-positive rows retrieval metrics (eval_cosine_ndcg@10)."""
        names = ["eval_loss"]
        if self.ranks_texts and retrieval_rows(examples):
            names += [f"eval_{name}" for name in retrieval_metric_names([self.similarity_fn_name])]
        return names

    def embed_column(self, model: nn.Module, features: dict[str, mx.array], column: int, size: int):
        """A column's embeddings, in mini-batches of `size` rows (no gradients are taken)."""
        return mx.concatenate([self.embed(model, part, column) for part in mini_batches(features, size)])

    def evaluate(self, model: nn.Module, examples: TextExamples, batch_size: int) -> dict[str, float]:
        """The mean loss over batches of `batch_size`, weighted by their sizes, in eval mode: consecutive rows, or
        the training's sampler's batches over them in order (`no_duplicates`: no row meets a text of its own as
        another's negative, as sentence-transformers batches its evaluation); for anchor-positive rows also
        sentence-transformers' retrieval metrics (`evaluators.row_retrieval_metrics`): each anchor ranks every
        positive and negative of the evaluation data."""
        model.eval()
        total, found = 0.0, [[] for _ in examples.columns]
        size = getattr(self.loss, "mini_batch_size", batch_size)

        def scored(indices: np.ndarray) -> tuple[float, list]:  # (a batch's summed loss, its columns' vectors)
            columns, labels = arrays(self.collate(examples, indices))
            embeddings = [self.embed_column(model, f, c, size) for c, f in enumerate(columns)]
            vectors = [np.array(e) for e in embeddings] if self.ranks_texts else []
            return self.loss(embeddings, labels).item() * len(indices), vectors

        order = np.arange(len(examples))
        batcher = self.batcher(examples, batch_size)
        batches = batcher(order) if batcher else [order[s : s + batch_size] for s in range(0, len(order), batch_size)]
        for loss, vectors in distributed.shared_map(scored, batches):  # each rank scores its share of the batches
            total += loss
            for column, array in zip(found, vectors, strict=False):  # no vectors where texts are not ranked
                column.append(array)
        metrics = {"eval_loss": total / len(examples) if len(examples) else math.nan}
        if self.ranks_texts and retrieval_rows(examples):
            rows = np.argsort(np.concatenate(batches), kind="stable")  # the vectors back in the examples' order
            vectors = [np.concatenate(column)[rows] for column in found]
            retrieval = row_retrieval_metrics(examples.texts, vectors, self.similarity_fn_name)
            metrics |= {f"eval_{name}": value for name, value in retrieval.items()}
        return metrics


def unchecked(fn: Callable) -> Callable:
    """`fn` (a compiled pass) run without the model's host-side input checks (`unchecked_inputs`)."""

    def run(*args):
        with unchecked_inputs():
            return fn(*args)

    return run


def unsorted(x: mx.array, column: dict) -> mx.array:
    """Rows embedded in a column's `length_groups` order, back in the batch's order."""
    return x[column["restore"]] if "restore" in column else x


def sorted_rows(x: mx.array, column: dict) -> mx.array:
    """Rows in the batch's order, in the column's `length_groups` order (the inverse of `unsorted`)."""
    return x[mx.argsort(column["restore"])] if "restore" in column else x


def retrieval_rows(examples: TextExamples) -> bool:
    """Anchor-positive rows (not scored pairs), of which retrieval metrics can be computed."""
    return len(examples) > 0 and examples.labels[0] is None and len(examples.columns) >= 2


def gathered(x: mx.array | tuple[mx.array, ...], order: np.ndarray | None) -> mx.array | tuple[mx.array, ...]:
    """A column's embeddings (or each array of a multi-vector column) over the global batch (`gather_rows`)."""
    if isinstance(x, tuple):
        return tuple(distributed.gather_rows(a, order) for a in x)
    return distributed.gather_rows(x, order)


def arrays(batch: dict) -> tuple[list[dict[str, mx.array]], mx.array | None]:
    columns = [{k: mx.array(v) for k, v in f.items()} for f in batch["columns"]]
    return columns, None if batch["labels"] is None else mx.array(batch["labels"])


def left_padded(mask) -> bool:
    """Whether a padded batch's pads come first (a row starts with one): a decoder tokenizer's left padding."""
    return bool((np.asarray(mask)[:, 0] == 0).any())


def mini_batches(features: dict[str, mx.array], size: int) -> list[dict[str, mx.array]]:
    """Rows of a padded batch in groups of `size`, each cut to its own longest row (its last columns when the
    batch is padded on the left)."""
    n, total = features["input_ids"].shape
    lengths = np.array(features["attention_mask"].sum(axis=1))
    left = left_padded(features["attention_mask"])
    out = []
    for start in range(0, n, size):
        width = int(lengths[start : start + size].max())
        columns = slice(total - width, None) if left else slice(0, width)
        out.append({k: v[start : start + size, columns] for k, v in features.items()})
    return out


def batch_tokens(batch: dict) -> int:
    """The real tokens of a collated batch, of any task."""
    if "columns" in batch:
        return sum(int(f["attention_mask"].sum()) for f in batch["columns"])
    return int(batch["attention_mask"].sum())


@dataclass
class DenseObjective(OwnFormat, EmbeddingObjective):
    """The embed objective of a `DenseModel`: its checkpoints hold the Dense modules beside the transformer."""

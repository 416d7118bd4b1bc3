"""Learned sparse embeddings (SPLADE) with sentence-transformers' semantics: `SparseEncoder(path).encode(texts)`.

Reads the folders `sentence_transformers.SparseEncoder` saves (sparse_encoder/ of sentence-transformers 6): a
fill-mask `Transformer` (or the older `MLMTransformer`) then `SpladePooling` (log(1 + relu(masked-LM logits)),
log1p once more for "log1p_relu", then max or sum over the text's tokens), or a `Router` whose routes are such a
pair or a `SparseStaticEmbedding` (a stored weight for each vocabulary id the text holds: the inference-free
query side of SPLADE-doc models), or a dense model (Transformer, Pooling, Dense, Normalize) then a
`SparseAutoEncoder` (CSR: the k largest latents of a linear encoder of the sentence embedding, relu'd).
Outputs are `SparseVectors`, a COO matrix that needs no scipy.
"""

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..checkpoint import Checkpoint, load_model, load_tokenizer
from ..checkpoint import resolve as resolve_path
from ..engine.batching import run_batches
from ..engine.threads import on_own_thread
from ..tokenizer import NO_LIMIT, Tokenizer, check_count, token_limit
from .base import DEFAULT_PROMPTS, Embedder, given_inputs, text_inputs, warn_truncated
from .folder import (
    SPLADE_ACTIVATIONS,
    SPLADE_STRATEGIES,
    TRANSFORMERS,
    Module,
    SpladePooling,
    apply_sentence_config,
    module,
    read_folder,
    read_sentence_config,
    role_lengths,
)
from .sentence import MODULES as DENSE_MODULES
from .sentence import SentenceEncoder
from .vectors import SIMILARITIES, to_numpy

POOLING_STRATEGIES, ACTIVATIONS = SPLADE_STRATEGIES, SPLADE_ACTIVATIONS  # SpladePooling's, for training


@dataclass
class SparseVectors:
    """Sparse embeddings in scipy's COO layout: entry k is `data[k]` at (`row[k]`, `col[k]`) of a `shape` matrix.

    A (V,) `shape` is one vector (its `row` all 0), as `encode` gives for a single str. `vectors[i]` is row i's
    (token ids, weights), `toarray()` the dense float32 array.
    """

    row: np.ndarray
    col: np.ndarray
    data: np.ndarray
    shape: tuple[int, ...]

    @classmethod
    def from_rows(cls, rows: list[tuple[np.ndarray, np.ndarray]], dimension: int) -> "SparseVectors":
        counts = [len(ids) for ids, _ in rows]
        row = np.repeat(np.arange(len(rows), dtype=np.int64), counts)
        col = np.concatenate([ids for ids, _ in rows]).astype(np.int64) if rows else np.zeros(0, np.int64)
        data = np.concatenate([v for _, v in rows]).astype(np.float32) if rows else np.zeros(0, np.float32)
        return cls(row, col, data, (len(rows), dimension))

    @property
    def nnz(self) -> int:
        return len(self.data)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        if len(self.shape) == 1:
            raise TypeError("A single sparse vector has no rows; use .col and .data")
        if isinstance(i, slice) or not hasattr(i, "__index__"):
            raise TypeError(f"index rows with an int (got {type(i).__name__}); .rows() gives every row's entries")
        keep = self.row == range(len(self))[i]
        return self.col[keep], self.data[keep]

    def rows(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """(token ids, weights) of every row (one for a single vector), without densifying."""
        count = self.shape[0] if len(self.shape) == 2 else 1
        if not count:
            return []
        order = np.argsort(self.row, kind="stable")
        bounds = np.cumsum(np.bincount(self.row, minlength=count))[:-1]
        return list(zip(np.split(self.col[order], bounds), np.split(self.data[order], bounds), strict=True))

    def toarray(self) -> np.ndarray:
        out = np.zeros((self.shape[0] if len(self.shape) == 2 else 1, self.shape[-1]), np.float32)
        out[self.row, self.col] = self.data
        return out.reshape(self.shape)


def keep_largest(values: np.ndarray, limit: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(ids, values) of the non-zero entries of a dense (V,) row, only the `limit` largest in magnitude when set
    (sentence-transformers' select_max_active_dims)."""
    if limit is not None and limit < np.count_nonzero(values):
        top = np.argpartition(-np.abs(values), limit - 1)[:limit]
        kept = np.zeros_like(values)
        kept[top] = values[top]
        values = kept
    ids = np.flatnonzero(values)
    return ids, values[ids]


def sparse_dot(a: SparseVectors, b: SparseVectors) -> np.ndarray:
    """(N, M) float32 dot products of sparse rows, touching only b's stored entries once per row of a."""
    count = b.shape[0] if len(b.shape) == 2 else 1
    query = np.zeros(b.shape[-1], np.float64)
    out = np.zeros((len(a.rows()), count), np.float32)
    for i, (ids, values) in enumerate(a.rows()):
        query[ids] = values
        out[i] = np.bincount(b.row, weights=b.data * query[b.col], minlength=count)
        query[ids] = 0
    return out


def joined(x):
    """A list of SparseVectors (one a text: `encode(convert_to_tensor=False)`) as one SparseVectors of their rows."""
    if isinstance(x, list | tuple) and x and all(isinstance(v, SparseVectors) for v in x):
        return SparseVectors.from_rows([row for v in x for row in v.rows()], x[0].shape[-1])
    return x


def dense_rows(x) -> np.ndarray:
    """float32 (N, V) numpy of SparseVectors, an mx.array, a numpy array or a list of rows; (V,) counts as one."""
    if isinstance(x, SparseVectors):
        x = x.toarray()
    x = to_numpy(x).astype(np.float32, copy=False)
    return x[None] if x.ndim == 1 else x


def splade_pool(model, batch: dict[str, mx.array], strategy: str = "max", activation: str = "relu") -> mx.array:
    """(B, V) float32: log(1 + relu(masked-LM logits)) of the real tokens (log1p twice for "log1p_relu"), max or
    sum over them; differentiable, for encoding and training alike."""
    out = model.encode(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"))
    logits = model.predict_tokens(out.last_hidden_state).astype(mx.float32)  # (B, L, V)
    x = mx.log1p(mx.maximum(logits * batch["attention_mask"][..., None], 0))  # padding gives 0, below any max
    if activation == "log1p_relu":
        x = mx.log1p(x)
    return x.max(axis=1) if strategy == "max" else x.sum(axis=1)


class Route:
    """What a route shares: texts cut to its `max_seq_length` (None: no limit), or to the Transformer's
    query_length / document_length for a query's or a document's (sentence-transformers 6), one warning for those
    cut, then its `run_encodings`: per tokenized text (e.g. a server's batch of many requests) its (ids, weights)."""

    max_seq_length: int | None = None
    role_lengths: dict[str, int] = {}

    def limit(self, role: str | None = None) -> int | None:
        return self.role_lengths.get(role) or self.max_seq_length

    def tokenize(self, texts: list[str], role: str | None = None) -> list:
        return self.tokenizer.encode_batch(texts, truncation=True, max_length=self.limit(role))

    def encode(self, texts: list[str], batch_size: int, show_progress, limit: int | None, role=None) -> list:
        encodings = self.tokenize(texts, role)
        if (cut := self.limit(role)) is not None:
            warn_truncated(encodings, cut, stacklevel=3)  # route.encode, encode, its caller
        return self.run_encodings(encodings, batch_size, show_progress, limit)


class SpladeRoute(Route):
    """A masked-LM `Transformer` then `SpladePooling`: (B, L) ids -> (B, V) pooled log-saturated logits."""

    def __init__(self, transformer: Module, pooling: Module | SpladePooling, dtype):
        checkpoint = Checkpoint.open(transformer.folder)
        self.model = load_model(checkpoint, dtype=dtype, task="masked-lm")
        self.tokenizer = load_tokenizer(self.model, checkpoint)
        config = read_sentence_config(transformer.folder)
        task = config.get("transformer_task", "fill-mask")
        if task != "fill-mask":
            raise ValueError(
                f"{transformer.folder / 'sentence_bert_config.json'}: transformer_task {task!r} before SpladePooling; "
                "SparseEncoder runs SPLADE models, whose Transformer is a fill-mask (masked-LM) one"
            )
        self.max_seq_length = token_limit(self.tokenizer, self.model.args.max_tokens, config.get("max_seq_length"))
        self.role_lengths = role_lengths(config, self.tokenizer, self.model.args.max_tokens)
        apply_sentence_config(self.tokenizer, config)
        splade = pooling if isinstance(pooling, SpladePooling) else pooling.read()
        self.strategy, self.activation = splade.strategy, splade.activation
        self.dimension = self.model.args.vocab_size

    def pooled(self, batch: dict[str, mx.array]) -> mx.array:
        """(B, V) float32 SPLADE vectors of a padded batch (`splade_pool`)."""
        return splade_pool(self.model, batch, self.strategy, self.activation)

    def run_encodings(self, encodings: list, batch_size: int, show_progress, limit: int | None) -> list:
        rows = [None] * len(encodings)

        def forward(indices: np.ndarray) -> list[mx.array]:
            return [self.pooled(self.tokenizer.pad([encodings[i] for i in indices]))]

        def collect(indices: np.ndarray, arrays: list[mx.array]) -> None:
            for values, i in zip(np.array(arrays[0]), indices, strict=True):
                rows[i] = keep_largest(values, limit)

        lengths = [len(e.ids) for e in encodings]
        run_batches(self.model, lengths, forward, collect, batch_size, show_progress=show_progress)
        return rows


class StaticRoute(Route):
    """sentence-transformers' `SparseStaticEmbedding`: each vocabulary id in the text (no special tokens) gets its
    stored weight; no model runs. Texts are cut at its tokenizer's model_max_length, as sentence-transformers cuts
    them (none when the tokenizer sets no limit)."""

    def __init__(self, static: Module):
        self.tokenizer = Tokenizer.from_pretrained(static.folder)
        self.weight = static.read()
        self.dimension = len(self.weight)
        limit = self.tokenizer.model_max_length
        self.max_seq_length = limit if limit < NO_LIMIT else None

    def tokenize(self, texts: list[str], role: str | None = None) -> list:
        return self.tokenizer.encode_batch(texts, max_length=self.max_seq_length, add_special_tokens=False)

    def run_encodings(self, encodings: list, batch_size: int, show_progress, limit: int | None) -> list:
        rows = []
        for e in encodings:
            values = np.zeros(self.dimension, np.float32)
            ids = np.unique(np.asarray(e.ids, np.int64))
            values[ids] = self.weight[ids]
            rows.append(keep_largest(values, limit))
        return rows


def top_k_relu(values: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, values) of relu of the k largest (signed) entries of a (D,) row: sentence-transformers' top_k."""
    top = np.argpartition(-values, k - 1)[:k] if k < len(values) else np.arange(len(values))
    kept = np.zeros_like(values)
    kept[top] = np.maximum(values[top], 0)
    ids = np.flatnonzero(kept)
    return ids, kept[ids]


class AutoEncoderRoute(Route):
    """A dense model's sentence embedding through sentence-transformers' `SparseAutoEncoder` (CSR models):
    `(x - pre_bias) W^T + latent_bias` (x standardized first with `normalize`), its k largest entries relu'd."""

    def __init__(self, source: Path, modules: list[Module], auto_encoder: Module, dtype):
        self.encoder = SentenceEncoder(source, dtype, modules=modules)
        if not self.encoder.include_prompt:
            raise ValueError(
                f"{source}: a Pooling with include_prompt=false before a SparseAutoEncoder is not supported; "
                "set include_prompt to true in its config.json or encode with SentenceEncoder"
            )
        self.model, self.tokenizer = self.encoder.model, self.encoder.tokenizer
        self.max_seq_length, self.role_lengths = self.encoder.max_seq_length, self.encoder.role_lengths
        weights = auto_encoder.read()
        if weights.input_dim != self.encoder.dimension:
            raise ValueError(
                f"{weights.source}: input_dim {weights.input_dim} differs from the {self.encoder.dimension} "
                f"dimensions of the sentence embedding of {source}"
            )
        self.weight, self.pre_bias, self.latent_bias = weights.weight, weights.pre_bias, weights.latent_bias
        self.k, self.normalize, self.dimension = weights.k, weights.normalize, weights.weight.shape[0]

    def latents(self, x: mx.array) -> mx.array:
        """(B, hidden_dim) latents before top-k of (B, input_dim) sentence embeddings."""
        if self.normalize:  # the module's own LN: unbiased std, eps added to it
            x = x - x.mean(axis=-1, keepdims=True)
            x = x / (mx.sqrt((x * x).sum(axis=-1, keepdims=True) / (x.shape[-1] - 1)) + 1e-5)
        return (x - self.pre_bias) @ self.weight.T + self.latent_bias

    def run_encodings(self, encodings: list, batch_size: int, show_progress, limit: int | None) -> list:
        """Per tokenized text its (latent ids, weights): the `limit` (else k) largest latents, relu'd."""
        vectors, _ = self.encoder.run_encodings(encodings, batch_size, show_progress)
        k = self.k if limit is None else limit
        rows = []
        for start in range(0, len(vectors), batch_size):
            latents = np.array(self.latents(mx.array(vectors[start : start + batch_size])))
            rows.extend(top_k_relu(row, k) for row in latents)
        return rows


def build_route(modules: list[Module], source: Path, dtype) -> Route:
    """A route from its modules: [SparseStaticEmbedding], [Transformer/MLMTransformer, SpladePooling] or
    [Transformer, Pooling, Dense*, Normalize?, SparseAutoEncoder]."""
    names = [m.kind for m in modules]
    if names == ["SparseStaticEmbedding"]:
        return StaticRoute(modules[0])
    if len(names) == 2 and names[0] in TRANSFORMERS and names[1] == "SpladePooling":
        return SpladeRoute(modules[0], modules[1], dtype)
    if len(names) >= 2 and names[0] == "Transformer" and names[-1] == "SparseAutoEncoder":
        if set(DENSE_MODULES) >= set(names[:-1]):
            folder = source if source.is_dir() else source.parent  # a Router's routes name their router_config.json
            return AutoEncoderRoute(folder, modules[:-1], modules[-1], dtype)
    raise ValueError(
        f"{source}: modules {names} are not supported; SparseEncoder runs a (MLM)Transformer then SpladePooling, "
        "a SparseStaticEmbedding, a dense model (Transformer, Pooling, Dense, Normalize) then a SparseAutoEncoder, "
        "or a Router of these"
    )


def is_pair(x) -> bool:
    """A (token ids, weights) pair of one sparse vector (`SparseVectors[i]`), not two dense rows."""
    return (
        isinstance(x, tuple) and len(x) == 2 and all(isinstance(part, np.ndarray) and part.ndim == 1 for part in x)
        and x[0].dtype.kind in "iu" and x[1].dtype.kind == "f" and len(x[0]) == len(x[1])
    )  # fmt: skip


class SparseEncoder(Embedder):
    """Texts -> sparse vocabulary-sized embeddings, like `sentence_transformers.SparseEncoder(path).encode(texts)`.

    `path_or_repo`: a local folder or hub id of a sentence-transformers sparse model. `dtype` casts the model's
    weights; `prompts`, `default_prompt_name`, `similarity_fn_name` ("dot" unless the folder says otherwise) and
    `max_active_dims` (keep only that many largest weights per text) override config_sentence_transformers.json.
    """

    DEFAULT_SIMILARITY = "dot"

    @on_own_thread
    def __init__(
        self,
        path_or_repo: str | Path,
        dtype=None,
        revision: str | None = None,
        *,
        prompts: dict[str, str] | None = None,
        default_prompt_name: str | None = None,
        similarity_fn_name: str | None = None,
        max_active_dims: int | None = None,
    ):
        self.path = resolve_path(path_or_repo, revision)
        folder = read_folder(self.path)
        if folder.kinds == ["Router"]:
            router = folder.modules[0].read()
            file = folder.modules[0].folder / "router_config.json"
            self.routes = {name: build_route(modules, file, dtype) for name, modules in router.routes.items()}
            self.default_route, self.route_mappings = router.default, router.mappings
        elif not folder.modules and Checkpoint.open(self.path).task == "masked-lm":
            # a bare masked-LM checkpoint (early SPLADE repositories): max-pooled SPLADE, as sentence-transformers
            # builds it for one
            route = SpladeRoute(module("MLMTransformer", self.path), SpladePooling(), dtype)
            self.routes, self.default_route, self.route_mappings = {"": route}, "", {}
        else:
            modules = folder.modules or [module("Transformer", self.path)]
            self.routes, self.default_route, self.route_mappings = {"": build_route(modules, self.path, dtype)}, "", {}
        self.read_prompts(folder, DEFAULT_PROMPTS, prompts, default_prompt_name)
        self.similarity_fn_name = similarity_fn_name or folder.similarity_fn_name(SIMILARITIES, self.DEFAULT_SIMILARITY)
        saved = folder.settings.get("max_active_dims")
        self.max_active_dims = max_active_dims if max_active_dims is not None else saved
        if self.max_active_dims is None and isinstance(self.routes.get(""), AutoEncoderRoute):
            self.max_active_dims = self.routes[""].k  # as sentence-transformers takes a top-level module's k
        if self.max_active_dims is not None:
            check_count("max_active_dims", self.max_active_dims, 1)
        self.tokenizer = self.route(None).tokenizer

    def route(self, task: str | None) -> Route:
        """The route a `task` ("query", "document", None) takes, looked up as sentence-transformers' Router does."""
        for key in ((task, "text"), (task, None), (None, "text"), (None, None)):
            if key in self.route_mappings:
                return self.routes[self.route_mappings[key]]
        if task in self.routes:
            return self.routes[task]
        if len(self.routes) > 1 and task is not None:
            raise ValueError(f"{self.path}: no route for task {task!r}; routes: {', '.join(self.routes)}")
        if self.default_route not in self.routes:
            raise ValueError(f"{self.path}: no default route; pass task= ('query' or 'document')")
        return self.routes[self.default_route]

    def get_embedding_dimension(self) -> int:
        """The width of the sparse vectors: the vocabulary size."""
        return self.route(None).dimension

    get_sentence_embedding_dimension = get_embedding_dimension  # sentence-transformers' older name

    @staticmethod
    def sparsity(embeddings) -> dict[str, float]:
        """sentence-transformers' `sparsity`: the mean count of non-zero weights per vector (`active_dims`) and
        1 - that / the width (`sparsity_ratio`), of SparseVectors, a list of them, or dense rows."""
        embeddings = joined(embeddings)
        if isinstance(embeddings, SparseVectors):
            count = 1 if len(embeddings.shape) == 1 else max(1, len(embeddings))
            width = embeddings.shape[-1]
            active = float(np.count_nonzero(embeddings.data)) / count
        else:
            rows = dense_rows(embeddings)
            active, width = float(np.count_nonzero(rows, axis=1).mean()) if len(rows) else 0.0, rows.shape[-1]
        return {"active_dims": active, "sparsity_ratio": 1 - active / width if width else 1.0}

    @property
    def max_seq_length(self) -> int | None:
        """The tokens a text keeps: the routes' limit (the largest, where a Router's differ), as sentence-transformers'
        property; None where no route has one."""
        if getattr(self, "set_max_seq_length", None) is not None:  # what was set reads back, as theirs
            return self.set_max_seq_length
        limits = {r.max_seq_length for r in self.routes.values() if r.max_seq_length is not None}
        return max(limits) if limits else None

    @max_seq_length.setter
    def max_seq_length(self, value: int) -> None:
        """Cut texts at `value` tokens on every route that runs a model, as sentence-transformers' setter."""
        check_count("SparseEncoder.max_seq_length", value, 1)
        for route in self.routes.values():
            positions = getattr(getattr(route, "model", None), "args", None)
            if positions is not None and positions.max_tokens and value > positions.max_tokens:
                raise ValueError(
                    f"SparseEncoder.max_seq_length ({value}) is more than the {positions.max_tokens} tokens the model "
                    f"in {self.path} takes"
                )
        self.set_max_seq_length = value
        for route in self.routes.values():
            # sentence-transformers' static (inference-free) module cuts at its tokenizer's limit whatever is set
            if route.max_seq_length is not None and not isinstance(route, StaticRoute):
                route.max_seq_length = value
                if isinstance(route, AutoEncoderRoute):
                    route.encoder.max_seq_length = value

    def max_length(self, task: str | None = None) -> int | None:
        """The tokens a text of `task` keeps (its route's query_length / document_length, else `max_seq_length`);
        None for a route without a model."""
        return self.route(task).limit(task)

    def tokenize(self, texts: list[str], prompt: str = "", task: str | None = None) -> list:
        """`texts` as the route of `task` reads them, `prompt` (see `input_prompt`) before each, cut to
        `max_length(task)` (`overflowing` non-empty where cut): the inputs of `run_encodings`."""
        return self.route(task).tokenize([prompt + t for t in texts], task)

    def run_encodings(
        self, encodings: list, task: str | None = None, batch_size: int = 32, max_active_dims: int | None = None
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per tokenized text (`tokenize`'s, e.g. a server's batch of many requests) its (ids, weights), as `encode`
        computes them: the `max_active_dims` (default the model's) largest."""
        limit = self.max_active_dims if max_active_dims is None else max_active_dims
        return self.route(task).run_encodings(encodings, batch_size, False, limit)

    @on_own_thread
    def encode(
        self,
        inputs: str | list[str] | None = None,
        prompt_name: str | None = None,
        prompt: str | None = None,
        batch_size: int = 32,
        show_progress_bar: bool | None = None,
        convert_to_tensor: bool = True,
        convert_to_sparse_tensor: bool = True,
        save_to_cpu: bool = False,
        *,  # sentence-transformers' order up to here; its next is `device`
        max_active_dims: int | None = None,
        task: str | None = None,
        sentences: str | list[str] | None = None,
    ):
        """Sparse embeddings of `sentences`: `SparseVectors` (N, V), or (V,) for a single str; a dense float32
        numpy array instead with `convert_to_sparse_tensor=False`; with `convert_to_tensor=False` a list of one
        (V,) vector per text, as sentence-transformers gives. `prompt` or the named prompt is prepended;
        `max_active_dims` keeps that many largest weights per text; `task` picks a Router's route. `save_to_cpu`
        changes nothing: the vectors are in host memory already."""
        texts, single = text_inputs(given_inputs(inputs, sentences), batch_size)
        limit = self.max_active_dims if max_active_dims is None else max_active_dims
        if limit is not None:
            check_count("encode() max_active_dims", limit, 1)
        prefix = self.input_prompt(prompt_name, prompt)
        route = self.route(task)
        rows = route.encode([prefix + t for t in texts], batch_size, show_progress_bar, limit, task) if texts else []
        vectors = SparseVectors.from_rows(rows, route.dimension)
        if single or not convert_to_tensor:
            each = [SparseVectors.from_rows([row], route.dimension) for row in rows]
            each = [SparseVectors(v.row, v.col, v.data, (route.dimension,)) for v in each]
            if not convert_to_sparse_tensor:
                each = [v.toarray() for v in each]
            return each[0] if single else each
        return vectors if convert_to_sparse_tensor else vectors.toarray()

    def similarity(self, embeddings1, embeddings2) -> mx.array:
        """(N, M) float32 scores of every row of `embeddings1` with every row of `embeddings2` (SparseVectors, a list
        of them as `encode(convert_to_tensor=False)` gives, or dense arrays), by `similarity_fn_name`."""
        embeddings1, embeddings2 = joined(embeddings1), joined(embeddings2)
        if self.similarity_fn_name == "dot" and isinstance(embeddings1, SparseVectors):
            if isinstance(embeddings2, SparseVectors):  # a corpus's vocabulary-wide dense copy would not fit
                return mx.array(sparse_dot(embeddings1, embeddings2))
        return super().similarity(dense_rows(embeddings1), dense_rows(embeddings2))

    def similarity_pairwise(self, embeddings1, embeddings2) -> mx.array:
        """(N,) float32 scores of row i with row i, by `similarity_fn_name`."""
        return super().similarity_pairwise(dense_rows(joined(embeddings1)), dense_rows(joined(embeddings2)))

    def decode(self, embeddings, top_k: int | None = None) -> list:
        """(token, weight) pairs by descending weight, the `top_k` first when set: a list for one vector (a (V,)
        input, or the (token ids, weights) pair of `SparseVectors[i]`), a list of such lists for (N, V)."""
        if top_k is not None:
            check_count("decode() top_k", top_k, 1)
        if is_pair(embeddings):
            single, rows = True, [(np.asarray(embeddings[0]), np.asarray(embeddings[1]))]
        elif isinstance(embeddings, SparseVectors):
            single, rows = len(embeddings.shape) == 1, embeddings.rows()
        else:
            single = np.ndim(embeddings) == 1
            rows = [(np.flatnonzero(row), row[np.flatnonzero(row)]) for row in dense_rows(embeddings)]
        out = []
        for ids, values in rows:
            keep = np.argsort(-values, kind="stable")[:top_k]
            out.append(list(zip(self.tokenizer.convert_ids_to_tokens(ids[keep]), values[keep].tolist(), strict=True)))
        return out[0] if single else out

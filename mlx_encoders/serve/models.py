"""The models a server holds, by what their folder is: a sentence-embedding model (`SentenceEncoder`), a sparse
one (`SparseEncoder`, SPLADE), a multi-vector one (`MultiVectorEncoder`, ColBERT) or a sequence-classification
model (`CrossEncoder`: reranking, and classification as the text-classification pipeline labels it); their
tokenization and limits, and what a model worker computes for a batch."""

import functools
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from tokenizers import Encoding

from ..checkpoint import resolve
from ..embeddings.base import resolve_prompt, task_prompt_name
from ..embeddings.cross_encoder import CrossEncoder
from ..embeddings.folder import folder_kind
from ..embeddings.multi_vector import MultiVectorEncoder
from ..embeddings.sentence import SentenceEncoder, task_adapter
from ..embeddings.sparse import SparseEncoder
from ..pipelines.fill_mask import softmax
from ..pipelines.text_classification import TextClassificationPipeline, sigmoid
from .errors import ApiError

EMBED, RERANK, CLASSIFY = "embeddings", "rerank", "classify"
SPARSE, MULTI_VECTOR = "sparse embeddings", "multi-vector embeddings"
TASKS = ("query", "document")
FOREIGN_IDS = (
    "token ids must be the model's own, special tokens included (its tokenizer's input_ids); a client that "
    "tokenizes with tiktoken must send texts instead (LangChain's OpenAIEmbeddings: check_embedding_ctx_length=False)"
)
FUNCTIONS = {"softmax": softmax, "sigmoid": sigmoid, "none": lambda x: x}


@dataclass
class TokenIds:
    """Token ids a client sent (the model's whole input, special tokens included), in place of an Encoding."""

    ids: list[int]
    type_ids: list[int]


def default_name(source: str | Path) -> str:
    """A folder's name, or the hub id as given."""
    path = Path(source)
    return path.name if path.is_dir() else str(source)


@dataclass
class Tagged:
    """A tokenized input and what its batch must know beyond its tokens: a multi-vector text's task, a sparse
    text's Router route (query or document side), a dense text's count of prompt tokens that pooling skips and
    its task adapter (jina-embeddings-v3's). A worker runs inputs of different tags apart."""

    item: Encoding | TokenIds
    tag: object
    tokens: np.ndarray | None = None  # a token-vectors item's (L, H) token vectors, set by the worker

    @property
    def ids(self) -> list[int]:
        return self.item.ids

    @property
    def type_ids(self) -> list[int]:
        return self.item.type_ids


@dataclass(frozen=True)
class DenseTag:
    """What a dense model's inputs share to be run together: the prompt tokens pooling skips, the task adapter
    (jina-embeddings-v3's; None for the other models), whether their token vectors are wanted too (TEI's
    /embed_all)."""

    skipped: int
    adapter: str | None = None
    token_vectors: bool = False


def by_tag(items: list, default, run) -> list:
    """`run(inputs, tag)` over each group of `items` of one tag; the results back in the items' order."""
    tags = [item.tag if isinstance(item, Tagged) else default for item in items]
    out = [None] * len(items)
    for tag in dict.fromkeys(tags):
        rows = [i for i, t in enumerate(tags) if t == tag]
        inputs = [items[i].item if isinstance(items[i], Tagged) else items[i] for i in rows]
        for i, result in zip(rows, run(inputs, tag), strict=True):
            out[i] = result
    return out


def objects(rows: list) -> np.ndarray:
    """A (N,) object array of `rows` (matrices, (ids, values) pairs): one row per input for the batcher."""
    out = np.empty(len(rows), object)
    for i, row in enumerate(rows):
        out[i] = row
    return out


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """vectors.normalize in numpy, for the event loop's thread (MLX evaluation stays on the model worker)."""
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


class ServedModel:
    """One served model under `name`: its `kind` (dense, sparse, multi-vector, cross-encoder, classifier), what it
    can do (`capabilities`), tokenization that refuses (or, with `truncate`, cuts) over-long inputs, and
    `compute`, run by its worker on a batch of many requests' inputs."""

    def __init__(self, name: str, source: str | Path, dtype: str | None = None, batch_size: int = 32):
        self.name = name
        self.source = str(source)
        self.batch_size = batch_size
        path = resolve(source)
        self.encoder = self.cross = self.classifier = self.sparse = self.multi = None
        self.kind = folder_kind(path)
        self.prefix, self.skipped = "", 0
        if self.kind == "cross-encoder":
            self.cross = CrossEncoder(path, dtype=dtype)
            self.model, self.tokenizer = self.cross.model, self.cross.tokenizer
            self.max_length = self.cross.max_seq_length
            if self.cross.logit_score is not None:  # its one logit is a relevance score, not a class's
                self.capabilities = (RERANK,)
            else:
                self.classifier = TextClassificationPipeline(self.model, self.tokenizer)
                self.capabilities = (RERANK, CLASSIFY) if self.cross.num_labels == 1 else (CLASSIFY,)
            self.kind = "cross-encoder" if self.cross.num_labels == 1 else "classifier"
        elif self.kind == "sparse":
            self.sparse = SparseEncoder(path, dtype=dtype)
            self.route = self.sparse.route(None)  # what `encode` runs without a task
            self.tokenizer, self.max_length = self.route.tokenizer, self.route.max_seq_length
            self.model = getattr(self.route, "model", None)
            self.capabilities = (SPARSE,)
            self.prefix = self.prompt(None)
        elif self.kind == "multi-vector":
            self.multi = MultiVectorEncoder(path, dtype=dtype)
            self.model, self.tokenizer = self.multi.model, self.multi.tokenizer
            self.max_length = self.multi.max_seq_length
            self.capabilities = (MULTI_VECTOR,)
            self.prefix = self.prompt(None)
        else:
            self.encoder = SentenceEncoder(path, dtype=dtype)
            self.model, self.tokenizer = self.encoder.model, self.encoder.tokenizer
            self.encoder.check_max_seq_length()
            self.max_length = self.encoder.max_seq_length
            self.capabilities = (EMBED,)
            self.prefix = self.prompt(None)
            self.skipped = self.prompt_tokens(self.prefix)
            self.dense_tag = DenseTag(self.skipped, self.adapter(None, None))
        # Dense projections load lazily on this thread's stream, which the worker's thread cannot evaluate
        dense = getattr(self.encoder or self.multi, "dense", [])
        mx.eval([(d.linear.parameters(), d.residual.parameters() if d.residual else []) for d in dense])

    def prompt(self, task: str | None) -> str:
        """The prompt `encode` (task None), `encode_query` or `encode_document` prepends."""
        encoder = self.encoder or self.sparse or self.multi
        name = task_prompt_name(encoder.prompts, task)
        return resolve_prompt(encoder.prompts, encoder.default_prompt_name, name, None, "serve")

    def named_prompt(self, name: str) -> str:
        """The prompt `name` of the model's prompts; 400 naming them when it has none of that name."""
        prompts = (self.encoder or self.sparse or self.multi).prompts
        if name not in prompts:
            known = ", ".join(repr(n) for n in prompts) or "none"
            raise ApiError(400, f"model {self.name!r} has no prompt {name!r}; its prompts: {known}", "prompt_name")
        return prompts[name]

    def sparse_route(self, task: str | None):
        """The route of a sparse model's Router that `encode(task=)` takes (the only route of a plain folder)."""
        try:
            return self.sparse.route(task)
        except ValueError as e:
            raise ApiError(400, f"model {self.name!r}: {e}", "input_type") from None

    def adapter(self, task: str | None, prompt_name: str | None) -> str | None:
        """A dense model's task adapter for `encode` (task None), `encode_query` or `encode_document`, or a named
        prompt: as SentenceEncoder picks it (jina-embeddings-v3's; None for the other models)."""
        name = self.encoder.default_prompt_name if prompt_name is None else prompt_name
        return task_adapter(self.encoder.model, None, name, task)

    def prompt_tokens(self, prefix: str) -> int:
        """Tokens of a dense model's prompt that pooling leaves out (none when it includes the prompt)."""
        return 0 if self.encoder.include_prompt else self.encoder.prompt_length(prefix)

    def describe(self) -> str:
        if self.encoder is not None:
            size = f"{self.dimension} dimensions"
        elif self.sparse is not None:
            size = f"{self.sparse.get_embedding_dimension()} sparse dimensions"
        elif self.multi is not None:
            size = f"{self.multi.get_embedding_dimension()} dimensions a token"
        else:
            size = f"{self.cross.num_labels} label{'s' if self.cross.num_labels > 1 else ''}"
        can = ", ".join(self.capabilities)
        limit = f"up to {self.max_length} tokens" if self.max_length else "no length limit"
        return f"{self.name}: {self.kind} model, {can} ({size}, {limit}) from {self.source}"

    @property
    def dimension(self) -> int:
        return self.encoder.get_embedding_dimension()

    def compute(self, items: list) -> np.ndarray:
        """On the model worker: (N, D) embeddings (before truncate_dim); per input its (token ids, weights) (sparse)
        or its (n, D) token matrix (multi-vector), as an object array; or (N, 2 x labels) logits then activated
        scores (the activation is an MLX function, so it runs here too)."""
        if self.encoder is not None:
            rows = by_tag(items, self.dense_tag, self.dense_rows)
            for item, row in zip(items, rows, strict=True):
                if isinstance(row, tuple):  # its batch's rows stay one (N, D) array whoever else shares it
                    item.tokens = row[1]
            return np.stack([row[0] if isinstance(row, tuple) else row for row in rows])
        if self.sparse is not None:
            limit = self.sparse.max_active_dims
            return objects(
                by_tag(items, self.route, lambda x, route: route.run_encodings(x, self.batch_size, False, limit))
            )
        if self.multi is not None:
            run = self.multi.run_encodings
            return objects(by_tag(items, None, lambda x, task: run(x, task, self.batch_size, False)))
        logits = self.cross.encoding_logits(items, self.batch_size)
        scores = np.array(self.cross.activation_fn(mx.array(logits)).astype(mx.float32))
        return np.concatenate([logits, scores], axis=1)

    def dense_rows(self, encodings: list, tag: DenseTag) -> list:
        """A dense model's (N, D) vectors of one tag's inputs, computed with its task adapter; per input (vector,
        (L, H) token vectors) when the tag wants token vectors."""
        model = self.encoder.model
        with model.adapter(tag.adapter, self.encoder.merge_adapters) if tag.adapter else nullcontext():
            if tag.token_vectors:
                vectors, tokens = self.encoder.run_encodings(encodings, self.batch_size, False, tag.skipped, True)
                return list(zip(vectors, tokens, strict=True))
            return self.encoder.run_encodings(encodings, self.batch_size, False, tag.skipped)[0]

    def tokenize(
        self, texts: list[str], truncate: bool, pairs: list[str] | None = None, param: str = "input",
        task: str | None = None, prompt_name: str | None = None, max_length: int | None = None,
        direction: str = "right", token_vectors: bool = False,
    ) -> list:  # fmt: skip
        """Encodings as `encode` / `predict` make them (prompt, truncation to the model's length; `task` "query" or
        "document": as `encode_query` / `encode_document`, a sparse Router's route for the task included;
        `prompt_name`: that prompt instead, as their `prompt_name=`); an input longer than that is an error unless
        `truncate`, cut at its end or, `direction` "left", at its start (dense and cross-encoder models; these also
        take a shorter `max_length`). A dense model's items with `token_vectors` receive their token vectors from the
        worker (`Tagged.tokens`)."""
        prefix = self.prefix if task is None else self.prompt(task)
        if prompt_name is not None:
            prefix = self.named_prompt(prompt_name)
        texts = [prefix + t for t in texts]
        limit = self.max_length if pairs is not None or self.classifier is None else self.classifier.max_length
        if max_length is not None:
            limit = max_length if limit is None else min(limit, max_length)
        route = self.sparse_route(task) if self.sparse is not None else None
        if direction != "right" and (route is not None or self.multi is not None):
            raise ApiError(
                400, f"model {self.name!r} is a {self.kind} model: it truncates at the end of a text only; send "
                '"truncation_direction": "right", or shorter texts', "truncation_direction",
            )  # fmt: skip
        try:
            if route is not None:
                encodings, limit = route.tokenize(texts), route.max_seq_length
            elif self.multi is not None:
                encodings, limit = self.multi.tokenize(texts, task), self.multi.max_length(task)
            elif self.cross is not None and pairs is not None:  # as `predict` reads pairs (a chat template's too)
                encodings = self.cross.tokenize(list(zip(texts, pairs, strict=True)))
            else:
                encodings = self.tokenizer.encode_batch(
                    texts, pairs, truncation=True, max_length=limit, direction=direction
                )
        except (TypeError, ValueError) as e:
            raise ApiError(400, str(e), param) from None
        if not truncate and limit is not None:
            for i, e in enumerate(encodings):
                if e.overflowing:
                    raise ApiError(
                        400,
                        f"{param}[{i}] is longer than the {limit} tokens model {self.name!r} takes; shorten it, send "
                        '"truncate": true, or start the server with --auto-truncate',
                        param, "input_too_long",
                    )  # fmt: skip
        if self.multi is not None and task is not None:
            return [Tagged(e, task) for e in encodings]
        if route is not None and route is not self.route:
            return [Tagged(e, route) for e in encodings]
        if self.encoder is not None:
            skipped = self.prompt_tokens(prefix) if task is not None or prompt_name is not None else self.skipped
            tag = DenseTag(skipped, self.adapter(task, prompt_name), token_vectors)
            if tag != self.dense_tag:
                return [Tagged(e, tag) for e in encodings]
        return encodings

    @functools.cached_property
    def special_ends(self) -> tuple[list[int], list[int]]:
        """The ids the tokenizer puts before and after every input ([CLS] and [SEP] for BERT)."""
        encoding = self.tokenizer.encode_batch(["a"], truncation=False)[0]
        words = [i for i, special in enumerate(encoding.special_tokens_mask) if not special]
        if not words:
            return [], []
        return encoding.ids[: words[0]], encoding.ids[words[-1] + 1 :]

    def token_ids(self, lists: list[list[int]], truncate: bool) -> list[TokenIds]:
        """Token ids as inputs: each id within the model's vocabulary, each list within its length and framed by
        the special tokens the model's tokenizer puts around every input (ids from another tokenizer, such as
        tiktoken's, are refused rather than embedded as nonsense)."""
        if self.skipped:
            raise ApiError(400, f"model {self.name!r} leaves its prompt out of pooling; send texts, not token ids")
        vocab = self.model.args.vocab_size
        start, end = self.special_ends
        out = []
        for i, ids in enumerate(lists):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ApiError(
                    400, f"input[{i}] holds token id {bad}, outside model {self.name!r}'s 0..{vocab - 1}; "
                    f"{FOREIGN_IDS}", "input", "invalid_token_ids",
                )  # fmt: skip
            if len(ids) < len(start) + len(end) or ids[: len(start)] != start or ids[len(ids) - len(end) :] != end:
                raise ApiError(
                    400, f"input[{i}] is not model {self.name!r}'s token ids: its tokenizer starts every input with "
                    f"{start} {self.tokenizer.convert_ids_to_tokens(start)} and ends it with {end} "
                    f"{self.tokenizer.convert_ids_to_tokens(end)}, these start {ids[:3]} and end {ids[-3:]}; "
                    f"{FOREIGN_IDS}", "input", "invalid_token_ids",
                )  # fmt: skip
            if len(ids) > self.max_length:
                if not truncate:
                    raise ApiError(
                        400,
                        f"input[{i}] has {len(ids)} tokens, more than the {self.max_length} model {self.name!r} "
                        'takes; shorten it, send "truncate": true, or start the server with --auto-truncate',
                        "input", "input_too_long",
                    )  # fmt: skip
                ids = ids[: self.max_length - len(end)] + end  # as the tokenizer cuts: its end tokens kept
            out.append(TokenIds(list(ids), [0] * len(ids)))
        return out

    def embeddings(self, vectors: np.ndarray, dimensions: int | None, normalize: bool = False) -> np.ndarray:
        """`encode`'s post-processing: the model's truncate_dim, then `dimensions` (Matryoshka; re-normalised when
        the model normalises), then `normalize`."""
        vectors = vectors[:, : self.encoder.truncate_dim]
        if dimensions is not None:
            vectors = vectors[:, :dimensions]
            normalize = normalize or self.encoder.normalize
        return l2_normalize(vectors) if normalize else vectors

    def scores(self, out: np.ndarray, raw: bool = False) -> np.ndarray:
        """Rerank scores (N,) from `compute`'s rows: `CrossEncoder.predict`'s, or the logits with `raw`."""
        labels = self.cross.num_labels
        return out[:, 0] if raw else out[:, labels]

    def labels(
        self, out: np.ndarray, top_k: int | None, raw: bool = False, function: str | None = None
    ) -> list[list[dict]]:
        """Per input, {"label", "score"} best first as the text-classification pipeline gives them (`function`
        of the logits, its `function_to_apply`, else its default; the logits themselves with `raw`)."""
        logits = out[:, : self.cross.num_labels]
        function = "none" if raw else function or self.classifier.default_function()
        scores = FUNCTIONS[function](logits)
        return [self.classifier.labels(row, top_k, legacy=False) for row in scores]

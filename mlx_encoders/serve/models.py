"""The models a server holds: each is an encoder (`SentenceEncoder`, `SparseEncoder`, `MultiVectorEncoder`,
`CrossEncoder`, the last with the text-classification pipeline over the same model for its labels), and a
`ServedModel` adapts it to the batcher: the encoder tokenizes a request on the model's tokenizer thread, its
`run_encodings` (`encoding_logits`) computes a batch of many requests' inputs on the worker, and its own
post-processing shapes the answer."""

import functools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from tokenizers import Encoding

from ..embeddings.auto import load_encoder
from ..embeddings.cross_encoder import CrossEncoder
from ..embeddings.multi_vector import MultiVectorEncoder
from ..embeddings.sentence import SentenceEncoder
from ..embeddings.sparse import SparseEncoder
from ..pipelines.text_classification import TextClassificationPipeline
from .batcher import Passes
from .errors import ApiError

EMBED, RERANK, CLASSIFY = "embeddings", "rerank", "classify"
SPARSE, MULTI_VECTOR = "sparse embeddings", "multi-vector embeddings"
# What a folder of each `folder_kind` may serve before it is loaded (a cross-encoder's head decides between two).
CAPABILITIES = {
    "dense": (EMBED,), "sparse": (SPARSE,), "multi-vector": (MULTI_VECTOR,), "cross-encoder": (RERANK, CLASSIFY),
}  # fmt: skip
TASKS = ("query", "document")
FOREIGN_IDS = (
    "token ids must be the model's own, special tokens included (its tokenizer's input_ids); a client that "
    "tokenizes with tiktoken must send texts instead (LangChain's OpenAIEmbeddings: check_embedding_ctx_length=False)"
)


@dataclass
class TokenIds:
    """Token ids a client sent (the model's whole input, special tokens included), in place of an Encoding."""

    ids: list[int]
    type_ids: list[int]


def too_long_advice(send: str = '"truncate": true') -> str:
    """How an over-long input could be cut, `send` naming the request's field that asks for it."""
    return f"shorten it, send {send}, or start the server with --auto-truncate"


TOO_LONG_HINT = too_long_advice()


def default_name(source: str | Path) -> str:
    """A folder's name, or the hub id as given."""
    path = Path(source)
    return path.name if path.is_dir() else str(source)


@dataclass
class Tagged:
    """A tokenized input and what its batch must know beyond its tokens: a multi-vector or sparse text's task (its
    query or document side), a dense text's `DenseTag`. A worker runs inputs of different tags apart."""

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
    """What a dense model's inputs share to be run together (`SentenceEncoder.run_encodings`' options): the prompt
    tokens pooling skips, the task adapter (jina-embeddings-v3's; None for the other models), whether their token
    vectors are wanted too (TEI's /embed_all), whether the model's Normalize module applies (TEI's "normalize")."""

    skipped: int
    adapter: str | None = None
    token_vectors: bool = False
    normalized: bool = True


def tag_of(item, default):
    return item.tag if isinstance(item, Tagged) else default


def untagged(items: list) -> list:
    """The tokenized inputs of `items`, their tags left out."""
    return [item.item if isinstance(item, Tagged) else item for item in items]


def by_tag(items: list, default, run) -> list:
    """`run(inputs, tag)` over each group of `items` of one tag; the results back in the items' order."""
    tags = [tag_of(item, default) for item in items]
    out = [None] * len(items)
    for tag in dict.fromkeys(tags):
        rows = [i for i, t in enumerate(tags) if t == tag]
        inputs = untagged([items[i] for i in rows])
        for i, result in zip(rows, run(inputs, tag), strict=True):
            out[i] = result
    return out


def objects(rows: list) -> np.ndarray:
    """A (N,) object array of `rows` (matrices, (ids, values) pairs): one row per input for the batcher."""
    out = np.empty(len(rows), object)
    for i, row in enumerate(rows):
        out[i] = row
    return out


def arrays_of(root) -> list[mx.array]:
    """Every MLX array `root` holds, through modules, containers and this package's own objects."""
    found, seen, todo = [], set(), [root]
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, mx.array):
            found.append(x)
            continue
        if isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
        if isinstance(x, nn.Module) or type(x).__module__.startswith("mlx_encoders"):
            todo.extend(getattr(x, "__dict__", {}).values())
    return found


@dataclass(frozen=True)
class WeightFacts:
    parameters: int
    bytes: int
    dtype: str  # of the float weights: "float32", "float16" or "bfloat16"
    bits: int | None  # of most quantized weights (a 4-bit model keeps small tables at 8); None when none is
    mode: str | None = None  # theirs: "affine", "mxfp4", "nvfp4", "mxfp8"


class ServedModel:
    """One served model under `name`: its encoder, its `kind` (dense, sparse, multi-vector, cross-encoder,
    classifier), what it can do (`capabilities`), tokenization that refuses (or, with `truncate`, cuts) over-long
    inputs, and `compute`, run by its worker on a batch of many requests' inputs."""

    def __init__(self, name: str, source: str | Path, dtype: str | None = None, batch_size: int = 32):
        self.name = name
        self.source = str(source)
        self.batch_size = batch_size
        encoder = load_encoder(source, dtype)
        self.encoder = encoder if isinstance(encoder, SentenceEncoder) else None
        self.sparse = encoder if isinstance(encoder, SparseEncoder) else None
        self.multi = encoder if isinstance(encoder, MultiVectorEncoder) else None
        self.cross = encoder if isinstance(encoder, CrossEncoder) else None
        self.classifier = None
        self.embedder = self.encoder or self.sparse or self.multi or self.cross  # the encoder, with its prompts
        if self.cross is not None:
            self.model, self.tokenizer = self.cross.model, self.cross.tokenizer
            self.max_length = self.cross.max_seq_length
            if self.cross.logit_score is not None:  # its one logit is a relevance score, not a class's
                self.capabilities = (RERANK,)
            else:
                self.classifier = TextClassificationPipeline(self.model, self.tokenizer)
                self.capabilities = (RERANK, CLASSIFY) if self.cross.num_labels == 1 else (CLASSIFY,)
            self.kind = "cross-encoder" if self.cross.num_labels == 1 else "classifier"
        elif self.sparse is not None:
            route = self.sparse.route(None)  # what `encode` runs without a task
            self.model, self.tokenizer = getattr(route, "model", None), route.tokenizer
            self.max_length = self.sparse.max_length()
            self.capabilities, self.kind = (SPARSE,), "sparse"
        elif self.multi is not None:
            self.model, self.tokenizer = self.multi.model, self.multi.tokenizer
            self.max_length = self.multi.max_seq_length
            self.capabilities, self.kind = (MULTI_VECTOR,), "multi-vector"
        else:
            self.model, self.tokenizer = self.encoder.model, self.encoder.tokenizer
            self.encoder.check_max_seq_length()
            self.max_length = self.encoder.max_seq_length
            self.capabilities, self.kind = (EMBED,), "dense"
        self.prefix = self.prompt(None)
        if self.encoder is not None:
            self.skipped = self.encoder.pooled_prompt_tokens(self.prefix)
            self.dense_tag = DenseTag(self.skipped, self.encoder.adapter_for())
        else:
            self.skipped = 0
        # weights read lazily (Dense projections, task adapters, a CSR auto-encoder) are bound to this thread's
        # stream, which the worker's thread cannot evaluate: read every one now
        mx.eval(arrays_of(encoder))

    def prompt(self, task: str | None) -> str:
        """The prompt `encode` (task None), `encode_query` or `encode_document` prepends (a cross-encoder's
        `predict` its default prompt)."""
        return "" if self.embedder is None else self.embedder.input_prompt(role=task)

    def prompt_called(self, name: str) -> str | None:
        """The name of the model's prompt called `name` in any case (EmbeddingGemma's "Classification"), or None."""
        prompts = {} if self.embedder is None else self.embedder.prompts
        if name in prompts:  # the exact name first, as a prompt_name looks it up
            return name
        return next((given for given in prompts if given.lower() == name.lower()), None)

    def named_prompt(self, name: str) -> str:
        """The prompt `name` of the model's prompts; 400 naming them when it has none of that name."""
        prompts = {} if self.embedder is None else self.embedder.prompts
        if name not in prompts:
            known = ", ".join(repr(n) for n in prompts) or "none"
            raise ApiError(400, f"model {self.name!r} has no prompt {name!r}; its prompts: {known}", "prompt_name")
        return self.embedder.input_prompt(prompt_name=name)

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

    @functools.cached_property
    def weights(self) -> WeightFacts:
        """What the model's weights are: a quantized layer's packed codes counted as the weights they hold, its
        scales and biases left out; the float dtype of the other weights (float32 for an inference-free sparse
        model's weight table)."""
        if self.model is None:
            return WeightFacts(0, 0, "float32", None)
        count, size, floats, bits = 0, 0, Counter(), Counter()
        for _, module in self.model.named_modules():
            own = dict(module.items())
            quantized = getattr(module, "bits", None) if "scales" in own else None
            for name, value in own.items():
                if not isinstance(value, mx.array):
                    continue
                size += value.nbytes
                if quantized and name in ("scales", "biases"):
                    continue
                if quantized and name == "weight":
                    count += value.size * 32 // quantized
                    bits[(quantized, getattr(module, "mode", "affine"))] += value.size * 32 // quantized
                else:
                    count += value.size
                    if mx.issubdtype(value.dtype, mx.floating):
                        floats[str(value.dtype).removeprefix("mlx.core.")] += value.size
        dtype = floats.most_common(1)[0][0] if floats else "float32"
        most = bits.most_common(1)[0][0] if bits else (None, None)
        return WeightFacts(count, size, dtype, *most)

    def compute(self, items: list) -> np.ndarray:
        """On the model worker: (N, D) embeddings (before truncate_dim); per input its (token ids, weights) (sparse)
        or its (n, D) token matrix (multi-vector), as an object array; or (N, 2 x labels) logits then activated
        scores (`CrossEncoder.activate`, an MLX function, so it runs here too)."""
        if self.encoder is not None:
            rows = by_tag(items, self.dense_tag, self.dense_rows)
            for item, row in zip(items, rows, strict=True):
                if isinstance(row, tuple):  # its batch's rows stay one (N, D) array whoever else shares it
                    item.tokens = row[1]
            return np.stack([row[0] if isinstance(row, tuple) else row for row in rows])
        if self.sparse is not None:
            return objects(by_tag(items, None, lambda x, task: self.sparse.run_encodings(x, task, self.batch_size)))
        if self.multi is not None:
            return objects(by_tag(items, None, lambda x, task: self.multi.run_encodings(x, task, self.batch_size)))
        logits = self.cross.encoding_logits(items, self.batch_size)
        scores = np.array(self.cross.activate(mx.array(logits)).astype(mx.float32))
        return np.concatenate([logits, scores], axis=1)

    def passes(self) -> Passes | None:
        """How the worker runs this model's inputs a pass at a time (`batcher.Passes`): a dense model's without
        task adapters (those run in batches of one adapter, `compute`); None for the other kinds."""
        if self.encoder is None or getattr(self.model, "adapters", None):
            return None
        encoder = self.encoder

        def key(item) -> DenseTag:
            return tag_of(item, self.dense_tag)

        def forward(items: list) -> list[mx.array]:
            tag = key(items[0])
            return encoder.encodings_pass(untagged(items), tag.skipped, tag.token_vectors, tag.normalized)

        def rows(items: list, arrays: list[mx.array]) -> np.ndarray:
            vectors, tokens = encoder.pass_rows(untagged(items), arrays)
            for item, matrix in zip(items, tokens, strict=True) if tokens else ():
                item.tokens = matrix
            return vectors

        sizes = []  # pass_size asked on the worker's thread, whose lanes it counts

        def rows_for(length: int) -> int:
            sizes[:] = sizes or [encoder.pass_size(self.batch_size)]
            return sizes[0](length)

        return Passes(forward, rows, rows_for, encoder.continuous, key, encoder.row_cost())

    def dense_rows(self, encodings: list, tag: DenseTag) -> list:
        """A dense model's (N, D) vectors of one tag's inputs; per input (vector, (L, H) token vectors) when the tag
        wants token vectors."""
        vectors, tokens = self.encoder.run_encodings(
            encodings, self.batch_size, False, tag.skipped, tag.token_vectors, tag.adapter, tag.normalized
        )
        return list(zip(vectors, tokens, strict=True)) if tag.token_vectors else vectors

    def tokenize(
        self, texts: list[str], truncate: bool, pairs: list[str] | None = None, param: str = "input",
        task: str | None = None, prompt_name: str | None = None, max_length: int | None = None,
        direction: str | None = None, token_vectors: bool = False, limit_field: str = "max_length",
        hint: str = TOO_LONG_HINT, names: Callable[[int], str] | None = None,
    ) -> list:  # fmt: skip
        """The encoder's encodings of `texts` (`pairs`: of (text, pair) pairs, as `predict` reads them), with the
        prompt `encode` prepends (`task` "query" or "document": `encode_query`'s / `encode_document`'s, a sparse
        Router's route for the task included; `prompt_name`: that prompt instead, as their `prompt_name=`); an
        input longer than the model takes is an error unless `truncate`, cut at `direction`'s end ("left",
        "right"; None: the tokenizer's `truncation_side`; dense and classifier models, which also take a shorter
        `max_length`, the request's field `limit_field`); `hint` ends the error: how this route cuts inputs, and
        `names(i)` names the i-th input in it where the request's field is not a list `param`. A
        dense model's items with `token_vectors` receive their token vectors from the worker (`Tagged.tokens`)."""
        prefix = self.prefix if task is None else self.prompt(task)
        if prompt_name is not None:
            prefix = self.named_prompt(prompt_name)
        if direction == "left" and (self.sparse is not None or self.multi is not None):
            raise ApiError(
                400, f"model {self.name!r} is a {self.kind} model: it truncates at the end of a text only; send "
                '"truncation_direction": "right", or shorter texts', "truncation_direction",
            )  # fmt: skip
        if self.sparse is not None:
            try:
                self.sparse.route(task)
            except ValueError as e:
                raise ApiError(400, f"model {self.name!r}: {e}", "input_type") from None
        special = self.tokenizer.num_special_tokens_to_add(pairs is not None)
        if max_length is not None and max_length < special:
            raise ApiError(
                400, f'"{limit_field}" is {max_length}, fewer than the {special} special tokens model {self.name!r} '
                f"puts around every input; send at least {special}", limit_field,
            )  # fmt: skip
        try:
            encodings, limit = self.encodings(texts, pairs, task, prefix, max_length, direction)
        except (TypeError, ValueError) as e:
            raise ApiError(400, str(e), param) from None
        if not truncate and limit is not None:
            by = f'"{limit_field}" allows' if limit == max_length else f"model {self.name!r} takes"
            for i, e in enumerate(encodings):
                if e.overflowing:
                    raise ApiError(
                        400,
                        f"{names(i) if names else f'{param}[{i}]'} is longer than the {limit} tokens {by}; {hint}",
                        param,
                        "input_too_long",
                    )
        if (self.multi is not None or self.sparse is not None) and task is not None:
            return [Tagged(e, task) for e in encodings]
        if self.encoder is not None:
            skipped = self.skipped if prefix == self.prefix else self.encoder.pooled_prompt_tokens(prefix)
            tag = DenseTag(skipped, self.encoder.adapter_for(prompt_name, None, None, task), token_vectors)
            if tag != self.dense_tag:
                return [Tagged(e, tag) for e in encodings]
        return encodings

    def encodings(
        self, texts: list[str], pairs: list[str] | None, task: str | None, prefix: str, max_length: int | None,
        direction: str | None,
    ) -> tuple[list, int | None]:  # fmt: skip
        """(the encoder's encodings of the inputs, the tokens it keeps of each)."""
        if self.sparse is not None:
            return self.sparse.tokenize(texts, prefix, task), self.sparse.max_length(task)
        if self.multi is not None:
            return self.multi.tokenize(texts, task, prefix), self.multi.max_length(task)
        if pairs is not None:  # as `predict` reads pairs (a chat template's too)
            return self.cross.tokenize(list(zip(texts, pairs, strict=True)), prefix, direction), self.max_length
        limit = self.max_length if self.classifier is None else self.classifier.max_length
        limit = self.encoder.role_limit(task) if self.encoder is not None else limit
        limit = limit if max_length is None else min(limit, max_length)
        if self.encoder is not None:
            return self.encoder.tokenize(texts, prefix, limit, direction, role=task), limit
        texts = [prefix + t for t in texts] if prefix else texts
        return self.classifier.encode(texts, max_length=limit, direction=direction), limit

    @functools.cached_property
    def special_ends(self) -> tuple[list[int], list[int]]:
        """The ids the tokenizer puts before and after every input ([CLS] and [SEP] for BERT)."""
        encoding = self.tokenizer.encode_batch(["a"], truncation=False)[0]
        words = [i for i, special in enumerate(encoding.special_tokens_mask) if not special]
        if not words:
            return [], []
        return encoding.ids[: words[0]], encoding.ids[words[-1] + 1 :]

    def token_ids(self, lists: list[list[int]], truncate: bool, hint: str = TOO_LONG_HINT) -> list[TokenIds]:
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
                        f"takes; {hint}",
                        "input", "input_too_long",
                    )  # fmt: skip
                ids = ids[: self.max_length - len(end)] + end  # as the tokenizer cuts: its end tokens kept
            out.append(TokenIds(list(ids), [0] * len(ids)))
        return out

    def unnormalized(self, items: list) -> list:
        """Dense `items` whose vectors leave out the model's Normalize module (TEI's "normalize": false, which TEI
        honours whatever the model's folder holds)."""
        tags = [replace(tag_of(item, self.dense_tag), normalized=False) for item in items]
        return [Tagged(inputs, tag) for inputs, tag in zip(untagged(items), tags, strict=True)]

    def embeddings(
        self, vectors: np.ndarray, dimensions: int | None, normalize: bool = False, raw: bool = False
    ) -> np.ndarray:
        """`encode`'s post-processing (`SentenceEncoder.postprocess`): `dimensions`, else the model's truncate_dim
        (Matryoshka; re-normalised when the model normalises, unless `raw`: vectors run without its Normalize
        module), then `normalize`."""
        normalize = normalize or (dimensions is not None and self.encoder.normalize and not raw)
        return self.encoder.postprocess(vectors, dimensions, normalize)

    def scores(self, out: np.ndarray, raw: bool = False) -> np.ndarray:
        """Rerank scores (N,) from `compute`'s rows: `CrossEncoder.predict`'s, or the logits with `raw`."""
        labels = self.cross.num_labels
        return out[:, 0] if raw else out[:, labels]

    def labels(
        self, out: np.ndarray, top_k: int | None, raw: bool = False, function: str | None = None
    ) -> list[list[dict]]:
        """Per input, {"label", "score"} best first as the text-classification pipeline gives them (`function`
        of the logits, its `function_to_apply`, else its default; the logits themselves with `raw`)."""
        scores = self.classifier.activate(out[:, : self.cross.num_labels], "none" if raw else function)
        return [self.classifier.labels(row, top_k, legacy=False) for row in scores]

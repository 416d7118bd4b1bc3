"""The models a server holds: a sentence-embedding model (`SentenceEncoder`) or a sequence-classification model
(`CrossEncoder`: reranking, and classification as the text-classification pipeline labels it), their
tokenization and limits, and what a model worker computes for a batch."""

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from tokenizers import Encoding

from ..checkpoint import Checkpoint, read_modules, resolve
from ..cross_encoder import CrossEncoder
from ..pipelines.fill_mask import softmax
from ..pipelines.text_classification import TextClassificationPipeline, sigmoid
from ..sentence import SentenceEncoder, resolve_prompt
from .errors import ApiError

EMBED, RERANK, CLASSIFY = "embeddings", "rerank", "classify"
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


def is_cross_encoder(path: Path) -> bool:
    """A sequence-classification checkpoint (not a sentence-transformers folder of modules)."""
    return not read_modules(path) and Checkpoint.open(path).task == "sequence-classification"


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """vectors.normalize in numpy, for the event loop's thread (MLX evaluation stays on the model worker)."""
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


class ServedModel:
    """One served model under `name`: what it can do (`capabilities`), tokenization that refuses (or, with
    `truncate`, cuts) over-long inputs, and `compute`, run by its worker on a batch of many requests' inputs."""

    def __init__(self, name: str, source: str | Path, dtype: str | None = None, batch_size: int = 32):
        self.name = name
        self.source = str(source)
        self.batch_size = batch_size
        path = resolve(source)
        self.encoder = self.cross = self.classifier = None
        if is_cross_encoder(path):
            self.cross = CrossEncoder(path, dtype=dtype)
            self.model, self.tokenizer = self.cross.model, self.cross.tokenizer
            self.classifier = TextClassificationPipeline(self.model, self.tokenizer)
            self.max_length = self.cross.max_seq_length
            self.capabilities = (RERANK, CLASSIFY) if self.cross.num_labels == 1 else (CLASSIFY,)
            self.prefix, self.skipped = "", 0
        else:
            self.encoder = SentenceEncoder(path, dtype=dtype)
            self.model, self.tokenizer = self.encoder.model, self.encoder.tokenizer
            self.encoder.check_max_seq_length()
            self.max_length = self.encoder.max_seq_length
            self.capabilities = (EMBED,)
            self.prefix = resolve_prompt(self.encoder.prompts, self.encoder.default_prompt_name, None, None, "serve")
            self.skipped = 0 if self.encoder.include_prompt else self.encoder.prompt_length(self.prefix)

    def describe(self) -> str:
        if self.encoder is not None:
            size = f"{self.dimension} dimensions"
        else:
            size = f"{self.cross.num_labels} label{'s' if self.cross.num_labels > 1 else ''}"
        can = ", ".join(self.capabilities)
        return f"{self.name}: {can} ({size}, up to {self.max_length} tokens) from {self.source}"

    @property
    def dimension(self) -> int:
        return self.encoder.get_embedding_dimension()

    def compute(self, items: list) -> np.ndarray:
        """On the model worker: (N, D) embeddings (before truncate_dim), or (N, 2 x labels) logits then activated
        scores (the activation is an MLX function, so it runs here too)."""
        if self.encoder is not None:
            return self.encoder.run_encodings(items, self.batch_size, False, self.skipped)[0]
        logits = self.cross.encoding_logits(items, self.batch_size)
        scores = np.array(self.cross.activation_fn(mx.array(logits)).astype(mx.float32))
        return np.concatenate([logits, scores], axis=1)

    def tokenize(
        self, texts: list[str], truncate: bool, pairs: list[str] | None = None, param: str = "input"
    ) -> list[Encoding]:
        """Encodings as `encode` / `predict` make them (prompt, truncation to the model's length); an input longer
        than that is an error unless `truncate`."""
        limit = self.max_length if pairs is not None or self.classifier is None else self.classifier.max_length
        try:
            encodings = self.tokenizer.encode_batch(
                [self.prefix + t for t in texts], pairs, truncation=True, max_length=limit
            )
        except (TypeError, ValueError) as e:
            raise ApiError(400, str(e), param) from None
        if not truncate:
            for i, e in enumerate(encodings):
                if e.overflowing:
                    raise ApiError(
                        400,
                        f"{param}[{i}] is longer than the {limit} tokens model {self.name!r} takes; shorten it, send "
                        '"truncate": true, or start the server with --auto-truncate',
                        param, "input_too_long",
                    )  # fmt: skip
        return encodings

    def token_ids(self, lists: list[list[int]], truncate: bool) -> list[TokenIds]:
        """Token ids as inputs: each id within the model's vocabulary, each list within its length."""
        if self.skipped:
            raise ApiError(400, f"model {self.name!r} leaves its prompt out of pooling; send texts, not token ids")
        vocab = self.model.args.vocab_size
        out = []
        for i, ids in enumerate(lists):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ApiError(400, f"input[{i}] holds token id {bad}, outside model {self.name!r}'s 0..{vocab - 1}")
            if len(ids) > self.max_length:
                if not truncate:
                    raise ApiError(
                        400,
                        f"input[{i}] has {len(ids)} tokens, more than the {self.max_length} model {self.name!r} "
                        'takes; shorten it, send "truncate": true, or start the server with --auto-truncate',
                        "input", "input_too_long",
                    )  # fmt: skip
                ids = ids[: self.max_length]
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

    def labels(self, out: np.ndarray, top_k: int | None, raw: bool = False) -> list[list[dict]]:
        """Per input, {"label", "score"} best first as the text-classification pipeline gives them (its default
        function of the logits; the logits themselves with `raw`)."""
        logits = out[:, : self.cross.num_labels]
        scores = logits if raw else FUNCTIONS[self.classifier.default_function()](logits)
        return [self.classifier.labels(row, top_k, legacy=False) for row in scores]

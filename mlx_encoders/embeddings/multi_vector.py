"""Late-interaction (ColBERT) embeddings with sentence-transformers' semantics: `MultiVectorEncoder(path)`.

Reads the folders `sentence_transformers.MultiVectorEncoder` (multi_vector_encoder/ of sentence-transformers 6)
saves: a `Transformer` whose sentence_bert_config.json holds `query_length`, `document_length` and
`query_expansion` (ColBERT's query padding with [MASK] tokens the encoder does not attend to, yet which are
scored), token-level `Dense` projections, a `MultiVectorMask` (which tokens are scored: the real ones, the
expansion ones of queries, minus the `skiplist_words` of documents) and `Normalize`. Markers such as "[Q] " are
the query / document prompts. `similarity` is MaxSim: sum over query tokens of the best document token's dot.
"""

import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..checkpoint import Checkpoint, load_model, load_tokenizer
from ..checkpoint import resolve as resolve_path
from ..engine.threads import on_own_thread
from ..tokenizer import token_limit
from .base import DEFAULT_PROMPTS, Embedder, given_inputs, project, text_inputs, warn_truncated
from .folder import MultiVectorMask, apply_sentence_config, read_folder
from .vectors import normalize, to_numpy

MODULES = ("Transformer", "Dense", "MultiVectorMask", "Normalize")
CHUNK_ELEMENTS = 2**24  # MaxSim scores (queries x query tokens x documents x document tokens) per chunk of documents


def padded(matrices: list) -> tuple[mx.array, mx.array]:
    """A list of (n_i, D) matrices -> (N, L, D) float32 zero-padded and the (N, L) 1/0 mask of real rows; L is 1
    at least, so a max over the rows of matrices without any has one masked row to take."""
    matrices = [to_numpy(m).astype(np.float32, copy=False) for m in matrices]
    width = max(max((len(m) for m in matrices), default=0), 1)
    dim = matrices[0].shape[1] if matrices else 0
    out = np.zeros((len(matrices), width, dim), np.float32)
    mask = np.zeros((len(matrices), width), np.float32)
    for i, m in enumerate(matrices):
        out[i, : len(m)], mask[i, : len(m)] = m, 1
    return mx.array(out), mx.array(mask)


def as_list(x) -> list:
    """A (n, D) matrix is one text, a (N, L, D) array or a list are several."""
    if isinstance(x, (np.ndarray, mx.array)) and x.ndim == 2:
        return [x]
    return list(x)


EMPTY_DOCUMENT_SCORE = -1e9  # sentence-transformers' score of a document without tokens


def maxsim_scores(queries: mx.array, query_mask: mx.array, documents: mx.array, document_mask: mx.array) -> mx.array:
    """(N, M) MaxSim of (N, Lq, D) queries and (M, Ld, D) documents, their (N, Lq) / (M, Ld) masks marking the
    scored tokens: differentiable, for scoring and training alike."""
    scores = mx.einsum("nqd,mtd->nmqt", queries, documents)  # (N, M, Lq, Ld)
    best = mx.where(document_mask[None, :, None, :] > 0, scores, -mx.inf).max(axis=-1)  # (N, M, Lq)
    total = mx.where(query_mask[:, None, :] > 0, best, 0).sum(axis=-1)
    # a document with no scored token ranks below every other, finite (-inf breaks fusion and JSON), as in s-t
    return mx.where((document_mask > 0).any(axis=-1)[None], total, EMPTY_DOCUMENT_SCORE)


def maxsim(queries, documents, length_normalize: bool = False) -> mx.array:
    """(N, M) float32: sum over each query's tokens of the largest dot with a token of the document (divided by
    the query's token count with `length_normalize`), as sentence_transformers.util.maxsim."""
    q, q_mask = padded(as_list(queries))
    docs = as_list(documents)
    if not len(q) or not docs:
        return mx.zeros((len(q), len(docs)), mx.float32)
    if any(len(d) == 0 for d in docs):
        warnings.warn(
            f"A document without token vectors (every token masked, e.g. by a skiplist) scores "
            f"{EMPTY_DOCUMENT_SCORE:.0e}, below every other document",
            UserWarning,
            stacklevel=2,
        )
    step = max(1, CHUNK_ELEMENTS // max(q.shape[0] * q.shape[1] * max(len(d) for d in docs), 1))
    out = mx.concatenate(
        [maxsim_scores(q, q_mask, *padded(docs[start : start + step])) for start in range(0, len(docs), step)], axis=1
    )
    return out / mx.maximum(q_mask.sum(axis=1, keepdims=True), 1) if length_normalize else out


def meanmaxsim(queries, documents) -> mx.array:
    return maxsim(queries, documents, length_normalize=True)


def pairwise(score):
    """Query i with document i by `score`, one pair at a time: (N,) float32."""

    def scores(embeddings1, embeddings2) -> mx.array:
        queries, documents = as_list(embeddings1), as_list(embeddings2)
        if len(queries) != len(documents):
            raise ValueError(
                f"similarity_pairwise needs as many queries as documents: {len(queries)}, {len(documents)}"
            )
        out = [score([q], [d])[0, 0] for q, d in zip(queries, documents, strict=True)]
        return mx.stack(out) if out else mx.zeros((0,), mx.float32)

    return scores


# similarity_fn_name -> (every query with every document, query i with document i)
SIMILARITIES = {"maxsim": (maxsim, pairwise(maxsim)), "meanmaxsim": (meanmaxsim, pairwise(meanmaxsim))}


class MultiVectorEncoder(Embedder):
    """Texts -> one (tokens, D) matrix each, like `sentence_transformers.MultiVectorEncoder(path).encode(texts)`.

    `path_or_repo`: a local folder or hub id of a sentence-transformers multi-vector model. `dtype` casts the
    encoder's weights; `prompts`, `default_prompt_name` and `similarity_fn_name` ("maxsim" or "meanmaxsim")
    override config_sentence_transformers.json. `similarity` is MaxSim (or MeanMaxSim) of every query matrix with
    every document matrix; a single (n, D) matrix counts as one.
    """

    SIMILARITIES = SIMILARITIES
    DEFAULT_SIMILARITY = "maxsim"

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
    ):
        self.path = resolve_path(path_or_repo, revision)
        folder = self.read_folder()
        folder.check_kinds(MODULES, "MultiVectorEncoder")
        checkpoint = Checkpoint.open(folder.transformer)
        self.model = load_model(checkpoint, dtype=dtype, task="encoder")
        self.tokenizer = load_tokenizer(self.model, checkpoint)
        self.dense, self.normalize = folder.projection("token_embeddings", "MultiVectorEncoder")
        mask = next((m for m in folder.modules if m.kind == "MultiVectorMask"), None)
        self.mask: MultiVectorMask = mask.read() if mask is not None else MultiVectorMask()
        self.read_transformer_config(folder.sentence_config, folder.transformer)
        # the mask module is what scores the expansion tokens: without one only the attended tokens are scored
        self.scores_expansion = mask is not None
        if self.query_expansion is not None and mask is None:
            warnings.warn(
                f"{self.path}: its Transformer expands queries but no MultiVectorMask module follows it, so the "
                "expansion tokens are not scored (as sentence-transformers scores them); add a MultiVectorMask "
                "module after the Transformer to score them",
                UserWarning,
                stacklevel=2,
            )
        self.read_prompts(folder, DEFAULT_PROMPTS, prompts, default_prompt_name)
        self.similarity_fn_name = similarity_fn_name or folder.similarity_fn_name(SIMILARITIES, self.DEFAULT_SIMILARITY)
        self.skip_ids = self.resolve_skiplist()
        self.dimension = self.dense[-1].linear.weight.shape[0] if self.dense else self.model.args.hidden_size

    def read_folder(self):
        """The folder's modules and settings (a subclass may keep only some of its modules)."""
        return read_folder(self.path)

    def read_transformer_config(self, config: dict, transformer: Path) -> None:
        self.max_seq_length = token_limit(self.tokenizer, self.model.args.max_tokens, config.get("max_seq_length"))
        self.query_length: int | None = config.get("query_length")
        self.document_length: int | None = config.get("document_length")
        self.query_expansion: dict | None = config.get("query_expansion")
        expansion = self.query_expansion
        if expansion is not None and (
            expansion.get("strategy") not in ("fixed", "min") or not isinstance(expansion.get("length"), int)
        ):
            raise ValueError(
                f"{transformer / 'sentence_bert_config.json'}: query_expansion needs strategy 'fixed' or 'min' and "
                f"an int length, got {expansion!r}"
            )
        apply_sentence_config(self.tokenizer, config)

    def resolve_skiplist(self) -> np.ndarray:
        """Token ids of the skiplist words that are single vocabulary tokens (others would only match [UNK])."""
        ids = [self.tokenizer.token_id(word) for word in self.mask.skiplist_words]
        return np.array([i for i in ids if i is not None], np.int64)

    def expansion_id(self) -> int:
        """The expansion token's id: the configured token, else [MASK], else the end-of-text token (decoders)."""
        token = self.query_expansion.get("token")
        if token is not None:
            found = self.tokenizer.token_id(token)
        else:
            found = self.tokenizer.mask_token_id
            found = found if found is not None else self.tokenizer.token_id(self.tokenizer.eos_token)
        if found is None:
            raise ValueError(f"{self.path}: query expansion token {token!r} is not in the tokenizer's vocabulary")
        return found

    def max_length(self, task: str | None) -> int:
        expansion = self.query_expansion if task == "query" else None
        length = {"query": self.query_length, "document": self.document_length}.get(task) or self.max_seq_length
        if expansion is None:
            return length
        return expansion["length"] if expansion["strategy"] == "fixed" else max(length, expansion["length"])

    def batch(self, encodings: list, task: str | None) -> tuple[dict[str, mx.array], np.ndarray]:
        """One padded batch and its (B, L) mask of the scored tokens."""
        expansion = self.query_expansion if task == "query" else None
        floor = expansion["length"] if expansion else 0
        width = max(floor, max(len(e.ids) for e in encodings))
        batch = self.tokenizer.pad(encodings, width, return_tensors="np")
        scored = batch["attention_mask"].astype(bool)
        if expansion:  # pad positions below the floor become expansion tokens: scored, attended only if configured
            added = ~scored & (np.arange(width) < floor)
            batch["input_ids"][added] = self.expansion_id()
            if expansion.get("attend"):
                batch["attention_mask"][added] = 1
            scored |= added if self.scores_expansion else batch["attention_mask"].astype(bool)
        if (task or "document") in self.mask.skiplist_tasks and len(self.skip_ids):
            scored &= ~np.isin(batch["input_ids"], self.skip_ids)
        if task != "query" and self.mask.keep_only_token_ids:
            scored &= np.isin(batch["input_ids"], self.mask.keep_only_token_ids)
        return {name: mx.array(value) for name, value in batch.items()}, scored

    def embed(self, batch: dict[str, mx.array]) -> mx.array:
        """(B, L, D) float32 token embeddings: encoder, Dense projections, Normalize."""
        out = self.model(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"))
        return project(out.last_hidden_state.astype(mx.float32), self.dense, self.normalize)

    @on_own_thread
    def encode(
        self,
        inputs: str | list[str] | None = None,
        prompt_name: str | None = None,
        prompt: str | None = None,
        batch_size: int = 32,
        show_progress_bar: bool | None = None,
        *,  # PyLate's order up to here; its next are output_value and precision
        convert_to_numpy: bool = False,
        normalize_embeddings: bool = False,
        task: str | None = None,
        sentences: str | list[str] | None = None,
    ):
        """Per text its (n_i, D) float32 matrix of scored tokens (padding and skipped tokens removed): a list of
        mx.arrays, numpy arrays with `convert_to_numpy`; one matrix for a single str. `task` ("query",
        "document" or None) picks the length limit, query expansion and skiplist."""
        texts, single = text_inputs(given_inputs(inputs, sentences), batch_size)
        prefix = self.input_prompt(prompt_name, prompt)
        out = self.run([prefix + t for t in texts], task, batch_size, show_progress_bar) if texts else []
        if normalize_embeddings:
            out = [np.array(normalize(mx.array(m))) for m in out]
        out = out if convert_to_numpy else [mx.array(m) for m in out]
        return out[0] if single else out

    def tokenize(self, texts: list[str], task: str | None = None, prompt: str = "") -> list:
        """`texts` as the model reads them for `task`, `prompt` (see `input_prompt`) before each, cut to
        `max_length(task)` (`overflowing` non-empty where cut): the inputs of `run_encodings`."""
        self.check_max_seq_length()
        texts = [prompt + t for t in texts] if prompt else texts
        return self.tokenizer.encode_batch(texts, truncation=True, max_length=self.max_length(task))

    def run(self, texts: list[str], task: str | None, batch_size: int, show_progress) -> list[np.ndarray]:
        self.check_max_seq_length()
        limit = self.max_length(task)
        encodings = self.tokenize(texts, task)
        expansion = self.query_expansion if task == "query" else None
        if not (expansion and expansion["strategy"] == "fixed"):
            warn_truncated(encodings, limit, stacklevel=3, name=None)  # run, encode, its caller
        elif any(len(e.ids) >= limit for e in encodings):
            warnings.warn(
                f"Some queries fill the query_expansion length of {limit} tokens: any text past it was cut",
                UserWarning,
                stacklevel=3,
            )
        return self.run_encodings(encodings, task, batch_size, show_progress)

    def run_encodings(
        self, encodings: list, task: str | None = None, batch_size: int = 32, show_progress: bool | None = False
    ) -> list[np.ndarray]:
        """Per tokenized text (e.g. a server's batch of many requests) its (n_i, D) float32 scored-token matrix."""
        expansion = self.query_expansion if task == "query" else None
        out: list = [None] * len(encodings)

        def forward(rows: np.ndarray) -> list[mx.array]:
            batch, scored = self.batch([encodings[i] for i in rows], task)
            return [self.embed(batch), mx.array(scored)]

        def collect(rows: np.ndarray, arrays: list[mx.array]) -> None:
            for matrix, keep, i in zip(np.array(arrays[0]), np.array(arrays[1]), rows, strict=True):
                out[i] = matrix[keep]

        lengths = [max(len(e.ids), expansion["length"] if expansion else 0) for e in encodings]
        self.batches(lengths, forward, collect, batch_size, show_progress)
        return out

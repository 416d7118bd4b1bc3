"""Hard-negative mining as sentence-transformers' `mine_hard_negatives` does it (reference:
`sentence_transformers/util/hard_negatives.py`, sentence-transformers 6, exact search without FAISS).

Every distinct anchor is embedded as a query and every distinct positive (plus an optional extra corpus) as a
document, normalized; for each anchor the `range_max + most positives` best documents are candidates. Its own
positives are dropped, then candidates within a margin of its weakest positive (`absolute_margin`: score + margin >
positive; `relative_margin`: score > positive - |positive| x margin) and outside [`min_score`, `max_score`]; an
optional cross-encoder rescoring replaces the scores first. Of the best `range_max` left, ranks from `range_min` on
are the pool: the first `num_negatives` ("top") or a random sample of them ("random"), best first.
"""

import hashlib
import os
import random
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
from mlx.utils import tree_flatten

from ..errors import OptionError
from .config import check_options_in
from .data import read_rows

FORMATS = ("triplet", "n-tuple", "labeled-pair", "labeled-list")
SCORE_BLOCK = 1 << 24  # similarity scores held at once (64 MiB of float32)
STRATEGIES = ("top", "random")


def column_names(rows: list[dict], anchor_column: str | None, positive_column: str | None) -> tuple[str, str]:
    """The anchor and positive columns: the ones named, else the data's first two (as theirs); a name the data lacks
    is refused (theirs falls back to the first columns: a misspelt name mined other columns)."""
    columns = list(rows[0])
    for role, name in (("anchor", anchor_column), ("positive", positive_column)):
        if name is not None and name not in columns:
            known = ", ".join(columns)
            raise OptionError(f"the {role} column {name!r} is not a column of the data; its columns: {known}")
    anchor = anchor_column if anchor_column is not None else columns[0]
    if positive_column is not None:
        return anchor, positive_column
    if len(columns) < 2:
        raise ValueError(f"Mining needs an anchor and a positive column; the data has only {columns}")
    return anchor, columns[1]


def check_options(range_min: int, range_max: int, num_negatives: int, sampling_strategy: str, output_format: str):
    if output_format not in FORMATS:
        raise OptionError(f"output_format must be one of {', '.join(FORMATS)}, got {output_format!r}")
    if sampling_strategy not in STRATEGIES:
        raise OptionError(f"sampling_strategy must be one of {', '.join(STRATEGIES)}, got {sampling_strategy!r}")
    if range_min >= range_max:
        raise OptionError(f"range_min must be smaller than range_max, got range_min={range_min}, range_max={range_max}")
    if num_negatives > range_max - range_min:
        raise OptionError(
            f"Cannot mine {num_negatives} negatives per query: only {range_max - range_min} candidates remain after "
            f"skipping the first range_min={range_min} of range_max={range_max}; lower num_negatives or range_min, "
            "or raise range_max"
        )


def best_first(scores: np.ndarray, k: int) -> np.ndarray:
    """(Q, k) column indices of each row's k highest scores, highest first (equal scores by position)."""
    if k >= scores.shape[1]:
        return np.argsort(-scores, axis=1, kind="stable")[:, :k]
    kth = -np.partition(-scores, k - 1, axis=1)[:, k - 1]
    out = np.empty((len(scores), k), dtype=np.int64)
    for r, row in enumerate(scores):  # only the k best (and any tied with the k-th) are sorted
        candidates = np.flatnonzero(row >= kth[r])
        out[r] = candidates[np.argsort(-row[candidates], kind="stable")[:k]]
    return out


def nearest(model, queries, corpus, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores, indices), each (Q, k): every query's k most similar documents by the model's similarity, best
    first, computed SCORE_BLOCK scores at a time (theirs: `faiss_batch_size` queries at a time)."""
    rows = max(1, SCORE_BLOCK // max(1, len(corpus)))
    scores, indices = [], []
    for start in range(0, len(queries), rows):
        block = np.array(model.similarity(queries[start : start + rows], corpus))
        found = best_first(block, k)
        scores.append(np.take_along_axis(block, found, axis=1))
        indices.append(found)
    return np.concatenate(scores), np.concatenate(indices)


def mine_hard_negatives(
    data: str | Path | Iterable[Mapping],
    model,
    anchor_column_name: str | None = None,
    positive_column_name: str | None = None,
    corpus: list[str] | None = None,
    cross_encoder=None,
    range_min: int = 0,
    range_max: int | None = None,
    max_score: float | None = None,
    min_score: float | None = None,
    absolute_margin: float | None = None,
    relative_margin: float | None = None,
    num_negatives: int = 3,
    sampling_strategy: str = "top",
    query_prompt_name: str | None = None,
    query_prompt: str | None = None,
    corpus_prompt_name: str | None = None,
    corpus_prompt: str | None = None,
    include_positives: bool = False,
    output_format: str = "triplet",
    output_scores: bool = False,
    batch_size: int = 32,
    faiss_batch_size: int = 16384,
    use_faiss: bool = False,
    use_multi_process: bool | list[str] = False,
    verbose: bool = True,
    cache_folder: str | Path | None = None,
    as_triplets: bool | None = None,
    margin: float | None = None,
    *,
    seed: int | None = None,
) -> list[dict]:
    """Rows of `data` (a JSONL/CSV/TSV file or an iterable of dicts: anchor and positive columns) with mined
    negatives, as sentence-transformers' `mine_hard_negatives(dataset, model, ...)` returns them (as a list of
    dicts), `model` a `SentenceEncoder` and `cross_encoder` a `CrossEncoder`.

    `output_format`: "triplet" (anchor, positive, negative: one row per negative), "n-tuple" (negative_1 ...
    negative_n; rows short of negatives dropped), "labeled-pair" (anchor, text, label 1/0) or "labeled-list"
    (anchor, [positive, negatives...], labels). `output_scores` adds the scores. `range_max` defaults as theirs:
    range_min + num_negatives (x 10 with a margin or max_score) + the most positives of an anchor. "random"
    sampling draws with `random.Random(seed)` (Python's global generator when `seed` is None, as theirs).

    The rest of their options: `verbose` False hides the progress bars; `cache_folder` keeps the embeddings there
    (`.npy` files named by a hash of the model's folder and weight files, the prompts and the texts) and reads them
    back on a later call; `as_triplets` and `margin` are their old names of `output_format` ("triplet" or
    "n-tuple") and `absolute_margin`. The search is exact, in this process: `use_faiss`, `faiss_batch_size` and
    `use_multi_process` change nothing (the results are theirs with `use_faiss=False`)."""
    if as_triplets is not None:
        output_format = "triplet" if as_triplets else "n-tuple"
    if margin is not None:
        absolute_margin = margin
    numbers = dict(range_min=range_min, range_max=range_max, max_score=max_score, min_score=min_score,
                   absolute_margin=absolute_margin, relative_margin=relative_margin, num_negatives=num_negatives,
                   batch_size=batch_size)  # fmt: skip
    check_options_in(numbers)  # before the data is read (`config.RANGES`)
    read = read_rows(data)
    rows = [dict(row.values) for row in read]
    anchor_column, positive_column = column_names(rows, anchor_column_name, positive_column_name)
    if include_positives:
        output_format = "n-tuple"  # theirs: keeps the ranking order, positives included
    all_queries = [row.text(anchor_column) for row in read]
    positives = [row.text(positive_column) for row in read]
    max_positives = max(Counter(all_queries).values())
    if range_max is None:
        filtered = absolute_margin is not None or relative_margin is not None or max_score is not None
        filtered = filtered or (cross_encoder is not None and min_score is not None)
        range_max = range_min + num_negatives * (10 if filtered else 1) + max_positives
    check_options(range_min, range_max, num_negatives, sampling_strategy, output_format)

    corpus = list(dict.fromkeys((corpus if corpus is not None else positives) + positives))
    corpus_index = {text: i for i, text in enumerate(corpus)}
    queries = list(dict.fromkeys(all_queries))
    query_index = {q: i for i, q in enumerate(queries)}
    options = dict(batch_size=batch_size, normalize_embeddings=True, show_progress_bar=None if verbose else False)
    kept = EmbeddingCache(cache_folder, model)
    corpus_embeddings = kept.get("corpus", corpus_prompt_name, corpus_prompt, corpus, model.encode_document, options)
    query_embeddings = kept.get("query", query_prompt_name, query_prompt, queries, model.encode_query, options)

    width = range_max + max_positives
    scores, indices = nearest(model, query_embeddings, corpus_embeddings, min(width, len(corpus)))
    if indices.shape[1] < width:  # a corpus smaller than the window: empty slots score -inf
        missing = width - indices.shape[1]
        scores = np.pad(scores, ((0, 0), (0, missing)), constant_values=-np.inf)
        indices = np.pad(indices, ((0, 0), (0, missing)), constant_values=-1)

    positive_ids = [[] for _ in queries]
    for query, positive in zip(all_queries, positives, strict=True):
        if corpus_index[positive] not in positive_ids[query_index[query]]:
            positive_ids[query_index[query]].append(corpus_index[positive])
    pairs = [(q, p) for q in range(len(queries)) for p in positive_ids[q]]  # (anchor, positive) in output order
    positive_scores = np.array(
        model.similarity_pairwise(query_embeddings[[q for q, _ in pairs]], corpus_embeddings[[p for _, p in pairs]])
    )
    if cross_encoder is not None and any(
        v is not None for v in (absolute_margin, relative_margin, max_score, min_score)
    ):
        for q, candidates in enumerate(indices):
            scores[q] = cross_encoder.predict([(queries[q], corpus[i]) for i in candidates], batch_size=batch_size)
        positive_scores = np.asarray(
            cross_encoder.predict([(queries[q], corpus[p]) for q, p in pairs], batch_size=batch_size)
        )

    scores[indices == -1] = -np.inf
    if not include_positives:
        scores[np.array([np.isin(indices[q], positive_ids[q]) for q in range(len(queries))])] = -np.inf
    if absolute_margin is not None or relative_margin is not None:
        counts = np.cumsum([0] + [len(p) for p in positive_ids])
        weakest = np.array([positive_scores[a:b].min() for a, b in zip(counts[:-1], counts[1:], strict=True)])
        if absolute_margin is not None:
            scores[scores + absolute_margin > weakest[:, None]] = -np.inf
        if relative_margin is not None:
            scores[scores > (weakest - np.abs(weakest) * relative_margin)[:, None]] = -np.inf
    if max_score is not None:
        scores[scores > max_score] = -np.inf
    if min_score is not None:
        scores[scores < min_score] = -np.inf

    order = best_first(scores, range_max)[:, range_min:]
    negative_scores, indices = np.take_along_axis(scores, order, 1), np.take_along_axis(indices, order, 1)
    if sampling_strategy == "top":
        negative_scores, indices = negative_scores[:, :num_negatives], indices[:, :num_negatives]
    else:
        draw = random.Random(seed).sample if seed is not None else random.sample
        options_left = np.maximum(indices.shape[1] - np.isinf(negative_scores).sum(1), num_negatives)
        picked = np.array([draw(range(int(n)), k=num_negatives) for n in options_left])
        negative_scores, indices = (
            np.take_along_axis(negative_scores, picked, 1),
            np.take_along_axis(indices, picked, 1),
        )
        resorted = np.argsort(-negative_scores, axis=1, kind="stable")
        negative_scores, indices = (
            np.take_along_axis(negative_scores, resorted, 1),
            np.take_along_axis(indices, resorted, 1),
        )

    mined = Mined(queries, corpus, pairs, positive_scores, indices, negative_scores, anchor_column, positive_column)
    return getattr(mined, output_format.replace("-", "_"))(output_scores)


# The encoder's settings that change its embeddings beside its files (given when it was made, or set after).
EMBEDDING_SETTINGS = ("truncate_dim", "max_seq_length", "pooling", "include_prompt", "prompts", "normalize")


class EmbeddingCache:
    """Embeddings kept in `folder` between calls (none without a folder, or for a model that has no folder of its
    own to name it by): one `.npy` file per (kind, model folder, the sizes and times of its weight and settings
    files, the encoder's `EMBEDDING_SETTINGS` and weights' dtype, prompt name, prompt, texts)."""

    def __init__(self, folder: str | Path | None, model):
        path = getattr(model, "path", None)
        self.folder = Path(folder) if folder and path is not None else None
        if self.folder is not None:
            files = sorted(p for p in Path(path).rglob("*") if p.suffix in (".safetensors", ".json") and p.is_file())
            stamps = [(str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
            settings = [(name, getattr(model, name, None)) for name in EMBEDDING_SETTINGS]
            dtypes = sorted({str(v.dtype) for _, v in tree_flatten(model.model.parameters())})
            self.model = (str(Path(path).resolve()), stamps, settings, dtypes)

    def get(self, kind: str, prompt_name, prompt, texts: list[str], encode, options: dict) -> np.ndarray:
        if self.folder is None:
            return encode(texts, prompt_name, prompt, **options)
        key = hashlib.sha256(repr((self.model, prompt_name, prompt, texts)).encode()).hexdigest()
        file = self.folder / f"{kind}_embeddings_{key}.npy"
        if file.is_file():
            return np.load(file)
        embeddings = np.asarray(encode(texts, prompt_name, prompt, **options))
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = file.with_name(f".{file.name}.{os.getpid()}.partial")
        with open(partial, "wb") as out:  # whole or not at all: a later call reads only complete files
            np.save(out, embeddings)
        os.replace(partial, file)
        return embeddings


class Mined:
    """The mined negatives of each (anchor, positive) pair, written out in one of the four formats."""

    def __init__(self, queries, corpus, pairs, positive_scores, indices, negative_scores, anchor, positive):
        self.queries, self.corpus, self.pairs = queries, corpus, pairs
        self.positive_scores, self.indices, self.negative_scores = positive_scores, indices, negative_scores
        self.anchor, self.positive = anchor, positive

    def kept(self, q: int) -> list[tuple[int, float]]:
        return [
            (int(i), float(s)) for i, s in zip(self.indices[q], self.negative_scores[q], strict=True) if s > -np.inf
        ]

    def triplet(self, scores: bool) -> list[dict]:
        out = []
        for (q, p), positive_score in zip(self.pairs, self.positive_scores, strict=True):
            for i, score in self.kept(q):
                row = {self.anchor: self.queries[q], self.positive: self.corpus[p], "negative": self.corpus[i]}
                out.append(row | ({"scores": [float(positive_score), score]} if scores else {}))
        return out

    def n_tuple(self, scores: bool) -> list[dict]:
        out = []
        for (q, p), positive_score in zip(self.pairs, self.positive_scores, strict=True):
            kept = self.kept(q)
            if len(kept) < self.indices.shape[1]:
                continue
            row = {self.anchor: self.queries[q], self.positive: self.corpus[p]}
            row |= {f"negative_{n}": self.corpus[i] for n, (i, _) in enumerate(kept, 1)}
            out.append(row | ({"scores": [float(positive_score)] + [s for _, s in kept]} if scores else {}))
        return out

    def labeled_pair(self, scores: bool) -> list[dict]:
        out, key = [], "score" if scores else "label"
        positive_scores = iter(self.positive_scores)
        for q in range(len(self.queries)):
            for p in [p for query, p in self.pairs if query == q]:
                value = float(next(positive_scores)) if scores else 1
                out.append({self.anchor: self.queries[q], self.positive: self.corpus[p], key: value})
            for i, score in self.kept(q):
                out.append({self.anchor: self.queries[q], self.positive: self.corpus[i], key: score if scores else 0})
        return out

    def labeled_list(self, scores: bool) -> list[dict]:
        out = []
        for (q, p), positive_score in zip(self.pairs, self.positive_scores, strict=True):
            kept = self.kept(q)
            if not kept:
                continue
            row = {self.anchor: self.queries[q], self.positive: [self.corpus[p]] + [self.corpus[i] for i, _ in kept]}
            if scores:
                out.append(row | {"scores": [float(positive_score)] + [s for _, s in kept]})
            else:
                out.append(row | {"labels": [1] + [0] * len(kept)})
        return out

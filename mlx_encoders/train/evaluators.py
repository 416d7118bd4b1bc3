"""Retrieval and reranking evaluation with sentence-transformers' definitions (reference:
`sentence_transformer/evaluation/information_retrieval.py` and `cross_encoder/evaluation/reranking.py` of
sentence-transformers 6, whose reranking metrics are scikit-learn's `ndcg_score` and `average_precision_score`).

`InformationRetrievalEvaluator(queries, corpus, relevant_docs)(encoder)` ranks the whole corpus for each query, best
score first and ties by corpus id, and reports accuracy/precision/recall@k, MRR@k, NDCG@k (binary gains) and MAP@k
under sentence-transformers' names ("cosine_ndcg@10"). `RerankingEvaluator(samples)(cross_encoder)` scores each
query's positives and negatives and reports MAP, MRR@k and NDCG@k ("ndcg@10"). Both also take a model being trained
(`SentenceEncoder`/`CrossEncoder` wrap it), and both compute from given scores alone (`metrics`).
"""

from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..embeddings.vectors import SIMILARITIES, check_similarity_name
from ..records import jsonl_records, read_text

SCORE_BLOCK = 1 << 24  # scores held at once (64 MiB of float32) while ranking a corpus
DEFAULT_AT_K = {
    "accuracy": (1, 3, 5, 10),
    "precision_recall": (1, 3, 5, 10),
    "mrr": (10,),
    "ndcg": (10,),
    "map": (100,),
}


def prefixed(metrics: dict[str, float], name: str) -> dict[str, float]:
    """sentence-transformers' `prefix_name_to_metrics`: "name_metric" when the evaluator has a name."""
    return {f"{name}_{key}": value for key, value in metrics.items()} if name else metrics


def one_or_many(texts) -> list:
    """Texts (or ids) as a list: one str is one (list() would take its characters)."""
    return [] if texts is None else [texts] if isinstance(texts, str) else list(texts)


def check_ks(name: str, ks: Sequence[int]) -> tuple[int, ...]:
    """The distinct `ks` in their order: a k given twice is one metric (summed twice, it would read double)."""
    ks = tuple(ks)
    if not ks or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in ks):
        raise ValueError(f"{name} must be a non-empty list of integers >= 1, got {list(ks)!r}")
    return tuple(dict.fromkeys(ks))


def id_order(ids: Sequence) -> list[int]:
    """The places of `ids` in ascending id order, which breaks ties between equal scores; ids of kinds that do not
    compare (1 and "2") are ordered by kind first (sentence-transformers compares them only when scores tie, and
    fails there)."""
    places = range(len(ids))
    try:
        return sorted(places, key=ids.__getitem__)
    except TypeError:
        return sorted(places, key=lambda i: (type(ids[i]).__name__, ids[i]))


# ----- retrieval -----


def top_hits(scores: np.ndarray, id_ranks: np.ndarray, k: int) -> np.ndarray:
    """The indices of one query's `k` best documents: highest score first, equal scores by ascending corpus id
    (`id_ranks[j]` is document j's place among the sorted ids), as sentence-transformers orders its hits."""
    k = min(k, len(scores))
    kth = np.partition(scores, len(scores) - k)[len(scores) - k]
    candidates = np.flatnonzero(scores >= kth)  # every document tied with the k-th too
    order = np.lexsort((id_ranks[candidates], -scores[candidates]))
    return candidates[order[:k]]


def dcg(relevances: Sequence[int], k: int) -> float:
    return sum(r / np.log2(i + 2) for i, r in enumerate(relevances[:k]))


def score_rows(function: str, queries: mx.array, corpus: mx.array) -> Iterator[np.ndarray]:
    """Each query's (C,) scores against the corpus, computed SCORE_BLOCK scores at a time: the (Q, C) matrix of a
    large corpus need not fit in memory."""
    similarity = SIMILARITIES[check_similarity_name(function)][0]
    rows = max(1, SCORE_BLOCK // max(1, corpus.shape[0]))
    for start in range(0, queries.shape[0], rows):
        yield from np.array(similarity(queries[start : start + rows], corpus))


def retrieval_metrics(
    scores: Iterable[np.ndarray],
    query_ids: Sequence[str],
    corpus_ids: Sequence[str],
    relevant_docs: Mapping[str, Iterable[str]],
    at_k: Mapping[str, Sequence[int]] = DEFAULT_AT_K,
) -> dict[str, float]:
    """sentence-transformers' `compute_metrics` from `scores`, each query's (C,) scores against the documents (rows
    of a (Q, C) array, or an iterator of them): {"accuracy@1": ..., "precision@1": ..., "recall@1": ...,
    "mrr@10": ..., "ndcg@10": ..., "map@100": ...}. Every query needs a relevant document and the corpus one
    document at least: a ValueError naming the query otherwise (their means would divide by zero)."""
    if not query_ids:
        raise ValueError("no queries to score: query_ids is empty")
    if not corpus_ids:
        raise ValueError("no documents to rank: corpus_ids is empty")
    for qid in query_ids:
        if not relevant_docs.get(qid):
            raise ValueError(
                f"query {qid!r} has no relevant document in relevant_docs: give it one, or leave the query out"
            )
    id_ranks = np.empty(len(corpus_ids), dtype=np.int64)
    id_ranks[id_order(corpus_ids)] = np.arange(len(corpus_ids))
    depth = max(max(ks) for ks in at_k.values())
    sums: dict[str, float] = {}

    def add(name: str, value: float) -> None:
        sums[name] = sums.get(name, 0.0) + value

    for row, qid in zip(scores, query_ids, strict=True):
        relevant = set(relevant_docs[qid])
        hits = [corpus_ids[j] in relevant for j in top_hits(row, id_ranks, depth)]
        for k in at_k["accuracy"]:
            add(f"accuracy@{k}", float(any(hits[:k])))
        for k in at_k["precision_recall"]:
            add(f"precision@{k}", sum(hits[:k]) / k)
            add(f"recall@{k}", sum(hits[:k]) / len(relevant))
        for k in at_k["mrr"]:
            add(f"mrr@{k}", next((1 / (rank + 1) for rank, hit in enumerate(hits[:k]) if hit), 0.0))
        for k in at_k["ndcg"]:
            add(f"ndcg@{k}", dcg([int(h) for h in hits], k) / dcg([1] * len(relevant), k))
        for k in at_k["map"]:
            precisions = [sum(hits[: rank + 1]) / (rank + 1) for rank, hit in enumerate(hits[:k]) if hit]
            add(f"map@{k}", sum(precisions) / min(k, len(relevant)))
    return {name: sums[name] / len(query_ids) for name in metric_list(at_k)}


def retrieval_metric_names(
    score_functions: Sequence[str] = ("cosine",), at_k: Mapping[str, Sequence[int]] = DEFAULT_AT_K, name: str = ""
) -> list[str]:
    """The names `InformationRetrievalEvaluator.metrics` reports: "<function>_<metric>@<k>", "<name>_..."."""
    names = [f"{function}_{metric}" for function in sorted(score_functions) for metric in metric_list(at_k)]
    return list(prefixed(dict.fromkeys(names, 0), name))


def metric_list(at_k: Mapping[str, Sequence[int]]) -> list[str]:
    """The metric names of `at_k`, in sentence-transformers' order."""
    names = [f"accuracy@{k}" for k in at_k["accuracy"]]
    names += [f"{m}@{k}" for m in ("precision", "recall") for k in at_k["precision_recall"]]
    return names + [f"{m}@{k}" for m in ("ndcg", "mrr", "map") for k in at_k[m]]


class InformationRetrievalEvaluator:
    """sentence-transformers' `InformationRetrievalEvaluator` over a `SentenceEncoder`.

    `queries` and `corpus` map ids to texts, `relevant_docs` query ids to the ids of their relevant documents;
    queries without any are left out. `score_functions` ("cosine", "dot", "euclidean", "manhattan"; default: the
    model's `similarity_fn_name`) each give one set of metrics, named "<function>_<metric>@<k>" (with `name`,
    "<name>_..."); `primary_metric` is the NDCG@max(k) of `main_score_function`, else of the best function, as
    theirs. Prompts and `truncate_dim` apply as in `encode_query` / `encode_document`. `corpus_chunk_size` and
    `write_csv` are taken for sentence-transformers' calls: the scores are ranked in blocks of a fixed size, and the
    metrics are returned, not written."""

    def __init__(
        self,
        queries: Mapping[str, str],
        corpus: Mapping[str, str],
        relevant_docs: Mapping[str, Iterable[str]],
        *,
        mrr_at_k: Sequence[int] = DEFAULT_AT_K["mrr"],
        ndcg_at_k: Sequence[int] = DEFAULT_AT_K["ndcg"],
        accuracy_at_k: Sequence[int] = DEFAULT_AT_K["accuracy"],
        precision_recall_at_k: Sequence[int] = DEFAULT_AT_K["precision_recall"],
        map_at_k: Sequence[int] = DEFAULT_AT_K["map"],
        score_functions: Sequence[str] | None = None,
        batch_size: int = 32,
        name: str = "",
        query_prompt: str | None = None,
        query_prompt_name: str | None = None,
        corpus_prompt: str | None = None,
        corpus_prompt_name: str | None = None,
        truncate_dim: int | None = None,
        show_progress_bar: bool = False,
        main_score_function: str | None = None,
        corpus_chunk_size: int = 50_000,
        write_csv: bool = True,
    ):
        self.relevant_docs = {qid: set(one_or_many(docs)) for qid, docs in relevant_docs.items()}  # a str: one id
        self.query_ids = [qid for qid in queries if self.relevant_docs.get(qid)]
        if not self.query_ids:
            raise ValueError("No query has a relevant document: relevant_docs must map query ids to corpus ids")
        if not corpus:
            raise ValueError("The corpus is empty: give it the documents to rank (corpus ids to texts)")
        self.queries = [queries[qid] for qid in self.query_ids]
        self.corpus_ids = list(corpus)
        self.corpus = [corpus[cid] for cid in self.corpus_ids]
        self.at_k = {
            "accuracy": check_ks("accuracy_at_k", accuracy_at_k),
            "precision_recall": check_ks("precision_recall_at_k", precision_recall_at_k),
            "mrr": check_ks("mrr_at_k", mrr_at_k),
            "ndcg": check_ks("ndcg_at_k", ndcg_at_k),
            "map": check_ks("map_at_k", map_at_k),
        }
        self.score_functions = [check_similarity_name(f) for f in score_functions] if score_functions else None
        self.main_score_function = check_similarity_name(main_score_function) if main_score_function else None
        if self.main_score_function and self.score_functions and self.main_score_function not in self.score_functions:
            raise ValueError(
                f"main_score_function {self.main_score_function!r} is not one of score_functions "
                f"{self.score_functions}: add it there, or leave main_score_function out"
            )
        self.batch_size, self.name, self.truncate_dim = batch_size, name, truncate_dim
        self.query_prompt, self.query_prompt_name = query_prompt, query_prompt_name
        self.corpus_prompt, self.corpus_prompt_name = corpus_prompt, corpus_prompt_name
        self.show_progress_bar = show_progress_bar
        self.primary_metric: str | None = None

    def metric_names(self, score_functions: Sequence[str] | None = None) -> list[str]:
        """The names `metrics` reports (a trainer prefixes "eval_", for `metric_for_best` to pick one)."""
        return retrieval_metric_names(self.functions(score_functions), self.at_k, self.name)

    def functions(self, given: Sequence[str] | None) -> list[str]:
        """The similarity functions scored: `given`, else the evaluator's, else cosine; with `main_score_function`."""
        functions = list(given or self.score_functions or ["cosine"])
        main = self.main_score_function
        return functions + [main] if main and main not in functions else functions

    def __call__(self, model) -> dict[str, float]:
        """The metrics of `model` (a `SentenceEncoder`) on this evaluator's queries and corpus."""
        options = dict(batch_size=self.batch_size, show_progress_bar=self.show_progress_bar,
                       truncate_dim=self.truncate_dim)  # fmt: skip
        queries = model.encode_query(self.queries, self.query_prompt_name, self.query_prompt, **options)
        corpus = model.encode_document(self.corpus, self.corpus_prompt_name, self.corpus_prompt, **options)
        return self.metrics(queries, corpus, self.score_functions or [model.similarity_fn_name])

    def metrics(self, query_embeddings, corpus_embeddings, score_functions: Sequence[str] | None = None) -> dict:
        """The metrics of given embeddings ((Q, D) in this evaluator's query order, (C, D) in corpus order), by
        `score_functions` (default: the evaluator's, else cosine)."""
        query_embeddings, corpus_embeddings = mx.array(query_embeddings), mx.array(corpus_embeddings)
        for name, given, ids in (
            ("query", query_embeddings, self.query_ids),
            ("corpus", corpus_embeddings, self.corpus_ids),
        ):
            if given.ndim != 2 or len(given) != len(ids):
                raise ValueError(
                    f"{name}_embeddings must be ({len(ids)}, D), one row per {name} id in this evaluator's order; "
                    f"got shape {tuple(given.shape)}"
                )
        results = {}
        for function in sorted(self.functions(score_functions)):
            scores = score_rows(function, query_embeddings, corpus_embeddings)
            found = retrieval_metrics(scores, self.query_ids, self.corpus_ids, self.relevant_docs, self.at_k)
            results[function] = found
        ndcg = f"ndcg@{max(self.at_k['ndcg'])}"
        best = self.main_score_function or max(results, key=lambda function: results[function][ndcg])
        self.primary_metric = prefixed({f"{best}_{ndcg}": 0}, self.name).popitem()[0]
        flat = {f"{function}_{metric}": value for function, found in results.items() for metric, value in found.items()}
        return prefixed(flat, self.name)


def row_retrieval_metrics(
    texts: Sequence[tuple[str, ...]], embeddings: Sequence[np.ndarray], score_function: str = "cosine"
) -> dict[str, float]:
    """The retrieval metrics of (anchor, positive, negatives...) rows and their (N, D) embeddings per column: each
    distinct anchor a query, each distinct positive or negative a document (ids in order of first appearance),
    an anchor's positives its relevant documents; named as `InformationRetrievalEvaluator.metrics`."""
    if not texts or len(texts[0]) < 2:
        raise ValueError("retrieval metrics need anchor-positive rows; the evaluation data has none")
    query_ids: dict[str, str] = {}
    doc_ids: dict[str, str] = {}
    relevant: dict[str, set[str]] = {}
    query_rows, doc_places = [], []
    for i, row in enumerate(texts):
        if row[0] not in query_ids:
            query_ids[row[0]] = f"q{len(query_ids):09d}"
            query_rows.append(i)
        for column, text in enumerate(row[1:], 1):
            if text not in doc_ids:
                doc_ids[text] = f"d{len(doc_ids):09d}"
                doc_places.append((column, i))
        relevant.setdefault(query_ids[row[0]], set()).add(doc_ids[row[1]])
    queries = {qid: text for text, qid in query_ids.items()}
    evaluator = InformationRetrievalEvaluator(queries, {did: text for text, did in doc_ids.items()}, relevant)
    documents = np.stack([embeddings[column][i] for column, i in doc_places])
    return evaluator.metrics(np.asarray(embeddings[0])[query_rows], documents, [score_function])


# ----- reranking -----


def tie_averaged_ndcg(relevant: np.ndarray, scores: np.ndarray, k: int) -> float:
    """scikit-learn's `ndcg_score([relevant], [scores], k=k)`: tied scores share the mean gain of their group."""
    discount = 1 / np.log2(np.arange(len(scores)) + 2)
    discount[k:] = 0
    cumulative = np.cumsum(discount)
    _, group, counts = np.unique(-scores, return_inverse=True, return_counts=True)
    gains = np.zeros(len(counts))
    np.add.at(gains, group, relevant)
    ends = np.cumsum(counts) - 1
    dcg_value = float((gains / counts * np.diff(cumulative[ends], prepend=0.0)).sum())
    ideal = float(np.sort(relevant)[::-1][:k] @ discount[: min(k, len(relevant))])
    return dcg_value / ideal if ideal else 0.0


def average_precision(relevant: np.ndarray, scores: np.ndarray) -> float:
    """scikit-learn's `average_precision_score` (binary): precision at each distinct score threshold, weighted by
    the recall gained there."""
    order = np.argsort(scores, kind="mergesort")[::-1]
    scores, relevant = scores[order], relevant[order]
    ends = np.r_[np.flatnonzero(np.diff(scores)), len(scores) - 1]
    true_positives = np.cumsum(relevant)[ends]
    precision = true_positives / (ends + 1)
    recall = true_positives / true_positives[-1]
    return float(np.sum(np.diff(recall, prepend=0.0) * precision))


def reranking_metrics(relevant: np.ndarray, scores: np.ndarray, at_k: int) -> tuple[float, float, float]:
    """(MRR@k, NDCG@k, AP) of one query's documents, as `CrossEncoderRerankingEvaluator.compute_metrics`."""
    if not relevant.any():
        return 0.0, 0.0, 0.0
    ranking = np.argsort(scores)[::-1]  # numpy's default sort, as theirs: the same order among ties
    mrr = next((1 / (rank + 1) for rank, i in enumerate(ranking[:at_k]) if relevant[i]), 0.0)
    return mrr, tie_averaged_ndcg(relevant, scores, at_k), average_precision(relevant, scores)


class RerankingEvaluator:
    """sentence-transformers' `CrossEncoderRerankingEvaluator` over a `CrossEncoder`.

    `samples`: dicts with "query", "positive" (a text or a list) and either "negative" (a list) or "documents" (a
    first-stage ranking, best first). Each query's documents are scored as pairs; the metrics are the means over
    queries of MAP ("map"), MRR@k ("mrr@10") and NDCG@k ("ndcg@10", the `primary_metric`), "<name>_..." with a
    `name`. With "documents", positives missing from them are scored too (`always_rerank_positives`, else they
    count as missed), and "base_map", "base_mrr@k", "base_ndcg@k" rate the first-stage order. `samples` may be a
    dict of them (its values are read), `prompt_name` and `show_progress_bar` go to `predict`; `write_csv` is taken
    for sentence-transformers' calls (the metrics are returned, not written) and `mrr_at_k` is its old name of
    `at_k`."""

    def __init__(
        self,
        samples: Sequence[Mapping] | Mapping[str, Mapping],
        at_k: int = 10,
        always_rerank_positives: bool = True,
        name: str = "",
        prompt_name: str | None = None,
        batch_size: int = 64,
        show_progress_bar: bool = False,
        write_csv: bool = True,
        mrr_at_k: int | None = None,
    ):
        at_k = at_k if mrr_at_k is None else mrr_at_k
        samples = list(samples.values()) if isinstance(samples, Mapping) else samples
        if isinstance(at_k, bool) or not isinstance(at_k, int) or at_k < 1:
            raise ValueError(f"at_k must be an integer >= 1, got {at_k!r}")
        if not samples:
            raise ValueError("RerankingEvaluator needs samples: none were given (the metrics are means over them)")
        self.at_k, self.name, self.batch_size = at_k, name, batch_size
        self.prompt_name, self.show_progress_bar = prompt_name, show_progress_bar
        self.samples = [self.read(i, sample, always_rerank_positives) for i, sample in enumerate(samples)]
        self.primary_metric = prefixed({f"ndcg@{at_k}": 0}, name).popitem()[0]

    def read(self, i: int, sample: Mapping, always_rerank_positives: bool) -> tuple:
        """(query, documents to score, their relevance, the first-stage metrics or None)."""
        if "query" not in sample or "positive" not in sample or ("negative" in sample) == ("documents" in sample):
            found = ", ".join(map(repr, sample))
            raise ValueError(
                f"reranking sample {i} needs 'query', 'positive' and one of 'negative' or 'documents' (found {found})"
            )
        for key in ("query", "positive", "negative", "documents"):
            value = sample.get(key)
            texts = [value] if isinstance(value, str) else value if isinstance(value, list | tuple) else None
            wrong = texts is None or not all(isinstance(t, str) for t in texts)
            wrong = wrong or key == "query" and not isinstance(value, str)
            if wrong and (key in sample or key in ("query", "positive")):
                kind = "a text" if key == "query" else "a text or a list of texts"
                raise ValueError(f"reranking sample {i}: {key!r} must be {kind}, got {value!r:.60}")
        positive, negative = (one_or_many(sample.get(key)) for key in ("positive", "negative"))
        if "negative" in sample:
            return sample["query"], positive + negative, [1] * len(positive) + [0] * len(negative), None
        if isinstance(sample["documents"], str):
            raise ValueError(
                f"reranking sample {i}: 'documents' is the first stage's ranked list of texts, got one str; give a "
                "list, or the text as 'negative'"
            )
        documents = list(sample["documents"])
        retrieved = [int(d in positive) for d in documents]
        base = (0.0, 0.0, 0.0)
        if sum(retrieved):  # the positives the first stage missed rank below everything it returned
            relevant = retrieved + [1] * (len(positive) - sum(retrieved))
            base = reranking_metrics(np.array(relevant), np.arange(len(relevant), 0, -1), self.at_k)
        if always_rerank_positives:
            documents = positive + [d for d in documents if d not in positive]
            retrieved = [1] * len(positive) + [0] * (len(documents) - len(positive))
        return sample["query"], documents, retrieved, base

    def __call__(self, model) -> dict[str, float]:
        """The metrics of `model` (a `CrossEncoder`) on the samples."""
        pairs = [(query, doc) for query, docs, relevant, _ in self.samples if any(relevant) for doc in docs]
        options = dict(prompt_name=self.prompt_name, batch_size=self.batch_size)
        options |= dict(show_progress_bar=self.show_progress_bar)
        scores = np.asarray(model.predict(pairs, **options)) if pairs else np.zeros(0)
        return self.metrics(scores)

    def metrics(self, scores: np.ndarray) -> dict[str, float]:
        """The metrics of given scores: one per (query, document) pair of the samples with a relevant document, in
        order (each sample's positives first, then its negatives or other documents)."""
        scores = np.asarray(scores).reshape(-1) if np.ndim(scores) == 2 and np.shape(scores)[1] == 1 else scores
        pairs = sum(len(documents) for _, documents, relevant, _ in self.samples if any(relevant))
        if np.ndim(scores) != 1 or len(scores) != pairs:
            raise ValueError(
                f"scores must hold {pairs} values, one per (query, document) pair of the samples with a relevant "
                f"document, in order; got shape {np.shape(scores)}"
            )
        found, offset = [], 0
        for _, documents, relevant, _ in self.samples:
            if not any(relevant):
                found.append((0.0, 0.0, 0.0))
                continue
            found.append(reranking_metrics(np.array(relevant), scores[offset : offset + len(documents)], self.at_k))
            offset += len(documents)
        k = self.at_k
        mrr, ndcg, ap = np.mean(found, axis=0)
        metrics = {"map": float(ap), f"mrr@{k}": float(mrr), f"ndcg@{k}": float(ndcg)}
        bases = [base for *_, base in self.samples if base is not None]
        if bases:
            mrr, ndcg, ap = np.mean(bases, axis=0)
            metrics |= {"base_map": float(ap), f"base_mrr@{k}": float(mrr), f"base_ndcg@{k}": float(ndcg)}
        return prefixed(metrics, self.name)


# ----- files -----


def read_jsonl(path: str | Path, keys: Sequence[str], kinds: dict[str, tuple[type, ...]] | None = None) -> list[dict]:
    """The objects of a JSONL file (read by `records`' rules), each checked to hold `keys`, and each value `kinds`
    names, where present, to be of those types (a ValueError naming the file and line)."""
    rows = []
    for record in jsonl_records(path):
        if not isinstance(record.value, dict) or any(key not in record.value for key in keys):
            raise ValueError(f"{record.where}: each line must be an object with {', '.join(keys)}")
        for key, types in (kinds or {}).items():
            value = record.value.get(key)
            if key in record.value and not of_kind(value, types):
                expected = "a number" if int in types else "a str"
                raise ValueError(f"{record.where}: {key!r} must be {expected}, got {value!r:.40}")
        rows.append(record.value)
    if not rows:
        raise ValueError(f"{path} holds no rows")
    return rows


def of_kind(value, types: tuple[type, ...]) -> bool:
    """`value` is of `types` (a bool is no number); where numbers are wanted, a str that reads as one is one too (a
    converted TSV's score)."""
    if isinstance(value, bool) or not isinstance(value, types):
        return False
    if isinstance(value, str) and int in types:
        try:
            float(value)
        except ValueError:
            return False
    return True


def read_retrieval_files(
    queries: str | Path, corpus: str | Path, qrels: str | Path
) -> tuple[dict[str, str], dict[str, str], dict[str, set[str]]]:
    """(queries, corpus, relevant_docs) from BEIR's JSONL layout: queries and corpus lines `{"_id": ..., "text":
    ...}` (a corpus "title" is prepended to the text, as BEIR's loaders join them); qrels lines `{"query-id": ...,
    "corpus-id": ..., "score": ...}`, a score <= 0 meaning not relevant (BEIR's qrels TSV with a header also reads)."""
    query_texts = {str(r["_id"]): r["text"] for r in read_jsonl(queries, ("_id", "text"), {"text": (str,)})}
    docs = {}
    for r in read_jsonl(corpus, ("_id", "text"), {"text": (str,), "title": (str, type(None))}):
        docs[str(r["_id"])] = f"{r['title']} {r['text']}".strip() if r.get("title") else r["text"]
    relevant: dict[str, set[str]] = {}
    for r in read_qrels(Path(qrels)):
        if float(r.get("score", 1)) <= 0:  # checked as it was read; a row marking a document not relevant
            continue
        if r["corpus-id"] not in docs:
            raise ValueError(f"{qrels}: corpus id {r['corpus-id']!r} (query {r['query-id']!r}) is not in {corpus}")
        relevant.setdefault(r["query-id"], set()).add(r["corpus-id"])
    if not any(qid in query_texts for qid in relevant):
        raise ValueError(
            f"{qrels}: no query of {queries} has a relevant document (a qrels row with a score > 0); check that the "
            "qrels' query ids are the queries' _id values"
        )
    return query_texts, docs, relevant


def read_qrels(path: Path) -> list[dict]:
    if path.suffix.lower() != ".tsv":
        rows = read_jsonl(path, ("query-id", "corpus-id"), {"score": (int, float, str)})
        return [{**r, "query-id": str(r["query-id"]), "corpus-id": str(r["corpus-id"])} for r in rows]
    lines = read_text(path).split("\n")
    if lines[0].split("\t")[:2] != ["query-id", "corpus-id"]:
        raise ValueError(f"{path}: a qrels TSV starts with the header query-id<TAB>corpus-id<TAB>score")
    rows = []
    for number, line in enumerate(lines[1:], 2):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) < 2:
            raise ValueError(f"{path}:{number}: expected query-id<TAB>corpus-id<TAB>score")
        score = fields[2] if len(fields) > 2 else 1
        if not of_kind(score, (int, float, str)):
            raise ValueError(f"{path}:{number}: the score {score!r:.40} is not a number")
        rows.append({"query-id": fields[0], "corpus-id": fields[1], "score": score})
    return rows

"""Embedding losses over sentence embeddings, as sentence-transformers defines them (reference:
`sentence_transformers/sentence_transformer/losses/`: `multiple_negatives_ranking.py`,
`cached_multiple_negatives_ranking.py`, `matryoshka.py`, `cosent.py`, `cosine_similarity.py`).

Each loss is called as `loss(embeddings, labels)`: `embeddings` holds one (B, D) array per text column (anchor,
positive, negatives...; or sentence1, sentence2), `labels` the (B,) scores of scored pairs (None otherwise). The
model pass that makes the embeddings lives in `train/embedding.py`, so a loss is plain MLX math that GradCache
(`CachedMultipleNegativesRankingLoss`) can differentiate with respect to the embeddings alone.
"""

from collections.abc import Sequence

import mlx.core as mx

from ...embeddings.vectors import normalize as l2_normalize  # differentiable: the losses use it too
from ..config import check_option

LOSS_SIMILARITIES = ("cosine", "dot")  # what a contrastive loss scores pairs with
DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
PARTITION_MODES = ("joint", "per_direction")


def similarity_matrix(a: mx.array, b: mx.array, name: str) -> mx.array:
    """(N, D) x (M, D) -> (N, M): sentence-transformers' `cos_sim` or `dot_score`."""
    if name == "cosine":
        a, b = l2_normalize(a), l2_normalize(b)
    return a @ b.T


def check_similarity(name: str) -> str:
    if name not in LOSS_SIMILARITIES:
        raise ValueError(f"similarity must be one of {', '.join(LOSS_SIMILARITIES)}, got {name!r}")
    return name


Texts = list[list[tuple[int, ...]]]  # a batch's token ids, per column: what `no_signal` compares
IN_BATCH_ADVICE = (
    "give it batches of two rows or more with different positives (more rows of data, batch_size (--batch-size) "
    ">= 2; the no_duplicates batch_sampler puts rows that share a text in different batches), add hard negatives "
    "(a negative column), or train scored pairs (sentence1, sentence2, score) with loss cosent or cosine"
)


def in_batch_no_signal(columns: Texts, directions: Sequence[str] = ("query_to_doc",)) -> str | None:
    """Why a batch gives an in-batch-negatives loss no gradient, or None: when its documents are all one text (one
    row without hard negatives, or rows of the same positive) every candidate scores as the positive does, so the
    loss is a constant, unless a direction also compares different queries with each other or with the document."""
    if len(columns) < 2:  # the loss itself says what is missing
        return None
    queries, documents = columns[0], {text for column in columns[1:] for text in column}
    if len(documents) > 1:
        return None
    compares_queries = not set(directions) <= {"query_to_doc", "doc_to_query"} or len(set(queries)) > 1
    if len(queries) > 1 and compares_queries and set(directions) != {"query_to_doc"}:
        return None
    if len(queries) == 1 and len(columns) == 2:
        why = "each batch holds one row, whose positive is its anchor's only candidate"
    else:
        why = "the documents of each batch are all the same text, so no candidate ranks below the positive"
    return f"{why}; {IN_BATCH_ADVICE}"


class MultipleNegativesRankingLoss:
    """InfoNCE with in-batch negatives: for each anchor, its positive against every positive and hard negative
    of the batch (the full B x B(1 + n) matrix), scores times `scale`. `directions` and `partition_mode` as
    sentence-transformers names them: ("query_to_doc", "doc_to_query") with "per_direction" is the symmetric
    loss (`symmetric=True`), all four with "joint" GTE's."""

    needs_scores = False
    in_batch_negatives = True

    def __init__(
        self,
        scale: float = 20.0,
        similarity: str = "cosine",
        directions: Sequence[str] = ("query_to_doc",),
        partition_mode: str = "joint",
        symmetric: bool = False,
    ):
        if symmetric:
            directions, partition_mode = ("query_to_doc", "doc_to_query"), "per_direction"
        check_option("scale", scale, type(self).__name__)
        if "query_to_doc" not in directions or not set(directions) <= set(DIRECTIONS):
            raise ValueError(f"directions must include 'query_to_doc' and be among {', '.join(DIRECTIONS)}")
        if len(set(directions)) != len(directions):
            raise ValueError(f"directions must each be given once, got {list(directions)}")
        if partition_mode not in PARTITION_MODES:
            raise ValueError(f"partition_mode must be one of {', '.join(PARTITION_MODES)}, got {partition_mode!r}")
        if partition_mode == "per_direction" and {"query_to_query", "doc_to_doc"} & set(directions):
            raise ValueError("partition_mode='per_direction' takes only the query_to_doc and doc_to_query directions")
        self.scale, self.similarity = scale, check_similarity(similarity)
        self.directions, self.partition_mode = tuple(directions), partition_mode

    def __call__(self, embeddings: list[mx.array], labels: mx.array | None = None) -> mx.array:
        if len(embeddings) < 2:
            raise ValueError(f"{type(self).__name__} needs an anchor and a positive column, got {len(embeddings)}")
        queries, docs = embeddings[0], embeddings[1:]
        B = queries.shape[0]
        docs_all = mx.concatenate(docs, axis=0)  # (B(1 + n), D): positives, then each negative column
        rows = mx.arange(B)
        own = rows[:, None] == rows[None, :]  # (B, B)
        sims = {"query_to_doc": similarity_matrix(queries, docs_all, self.similarity)}
        if "query_to_query" in self.directions:
            sims["query_to_query"] = mx.where(own, -mx.inf, similarity_matrix(queries, queries, self.similarity))
        if "doc_to_query" in self.directions:
            # made as (docs, queries), not transposed: mx.compile failed on the transposed matrix beside query_to_query
            sims["doc_to_query"] = similarity_matrix(docs[0], queries, self.similarity)
        if "doc_to_doc" in self.directions:
            same_query = mx.concatenate([own] * len(docs), axis=1)  # a query's own positive and negatives
            sims["doc_to_doc"] = mx.where(same_query, -mx.inf, similarity_matrix(docs[0], docs_all, self.similarity))
        sims = {k: v * self.scale for k, v in sims.items()}
        positive = sims["query_to_doc"][rows, rows]
        if self.partition_mode == "joint":
            log_z = mx.logsumexp(mx.concatenate(list(sims.values()), axis=1), axis=1)
        else:
            log_z = sum(mx.logsumexp(s, axis=1) for s in sims.values()) / len(sims)
        return -(positive - log_z).mean()

    def no_signal(self, columns: Texts, labels: list | None = None) -> str | None:
        """Why a batch of these texts gives this loss no gradient (`in_batch_no_signal`), or None."""
        return in_batch_no_signal(columns, self.directions)


class CachedMultipleNegativesRankingLoss(MultipleNegativesRankingLoss):
    """`MultipleNegativesRankingLoss` computed by GradCache: the embeddings of the whole batch are computed in
    mini-batches of `mini_batch_size` without keeping activations, the loss and its gradient with respect to them
    once, then each mini-batch's pass is run again and back-propagated from those gradients. The same loss and
    gradients as the plain loss, in the memory of one mini-batch's activations (`embedding.cached_value_and_grad`)."""

    def __init__(self, scale: float = 20.0, similarity: str = "cosine", mini_batch_size: int = 32, **options):
        super().__init__(scale, similarity, **options)
        check_option("mini_batch_size", mini_batch_size, type(self).__name__)
        self.mini_batch_size = mini_batch_size


class MatryoshkaLoss:
    """`loss` at each of `dims` (largest first), on the first d dimensions of every embedding, re-normalized as
    sentence-transformers' `shrink` does; the sum weighted by `weights` (default all 1). `loss` None: the data's
    default loss, chosen by `fine_tune("embed")` (MNRL, or CoSENT for scored pairs)."""

    def __init__(self, loss, dims: Sequence[int], weights: Sequence[float] | None = None):
        check_option("matryoshka_dims", dims, "MatryoshkaLoss")
        weights = [1.0] * len(dims) if weights is None else weights
        check_option("matryoshka_weights", weights, "MatryoshkaLoss")
        if len(weights) != len(dims):
            raise ValueError(f"MatryoshkaLoss needs one weight per dimension; got dims {dims} and weights {weights}")
        pairs = sorted(zip(dims, weights, strict=True), key=lambda p: p[0], reverse=True)
        self.loss, self.dims, self.weights = loss, [d for d, _ in pairs], [w for _, w in pairs]

    def __getattr__(self, name):  # what the trainer asks of the wrapped loss (mini_batch_size, needs_scores, ...)
        if name == "loss":
            raise AttributeError(name)
        return getattr(self.loss, name)

    def check_width(self, width: int) -> None:
        if self.dims[0] > width:
            raise ValueError(f"Matryoshka dims {self.dims} exceed the model's embedding width {width}")

    def __call__(self, embeddings: list[mx.array], labels: mx.array | None = None) -> mx.array:
        total = mx.array(0.0)
        for dim, weight in zip(self.dims, self.weights, strict=True):
            total = total + weight * self.loss([l2_normalize(e[:, :dim]) for e in embeddings], labels)
        return total


class CoSENTLoss:
    """CoSENT on scored pairs: log(1 + sum over pairs (i, j) with score_i > score_j of exp(s_j - s_i)), where s is
    `scale` times the pairs' cosine similarity."""

    needs_scores = True
    in_batch_negatives = False

    def __init__(self, scale: float = 20.0, similarity: str = "cosine"):
        check_option("scale", scale, type(self).__name__)
        self.scale, self.similarity = scale, check_similarity(similarity)

    def __call__(self, embeddings: list[mx.array], labels: mx.array) -> mx.array:
        a, b = embeddings[0], embeddings[1]
        if self.similarity == "cosine":
            a, b = l2_normalize(a), l2_normalize(b)
        scores = (a * b).sum(axis=-1) * self.scale
        labels = labels.reshape(-1)
        higher = labels[:, None] > labels[None, :]  # (i, j): pair i should score above pair j
        diffs = mx.where(higher, scores[None, :] - scores[:, None], -mx.inf).reshape(-1)
        return mx.logsumexp(mx.concatenate([mx.zeros(1), diffs]))

    def no_signal(self, columns: Texts, labels: list) -> str | None:
        """Why a batch gives CoSENT no gradient, or None: it compares pairs of different scores, so a batch needs two
        scores and two different pairs of texts (then some differently scored pairs differ in their texts too)."""
        if len(set(labels)) > 1 and len(set(zip(columns[0], columns[1], strict=True))) > 1:
            return None
        if len(labels) == 1:
            why = "each batch holds one pair, which CoSENT has no other pair to rank against"
        elif len(set(labels)) == 1:
            why = "the pairs of each batch all have the same score, and CoSENT learns from pairs scored differently"
        else:
            why = "the pairs of each batch are all the same two texts, whose similarities cannot differ"
        return (
            f"{why}; give it batches of two pairs or more with different scores (more rows of data, batch_size "
            "(--batch-size) >= 2), or train with loss cosine, which fits each pair's score alone"
        )


class CosineSimilarityLoss:
    """Mean squared error between the pairs' cosine similarity and their scores."""

    needs_scores = True
    in_batch_negatives = False

    def __call__(self, embeddings: list[mx.array], labels: mx.array) -> mx.array:
        cosine = (l2_normalize(embeddings[0]) * l2_normalize(embeddings[1])).sum(axis=-1)
        return ((cosine - labels.reshape(-1).astype(mx.float32)) ** 2).mean()


LOSSES = {
    "mnrl": MultipleNegativesRankingLoss,
    "symmetric-mnrl": lambda: MultipleNegativesRankingLoss(symmetric=True),
    "cached-mnrl": CachedMultipleNegativesRankingLoss,
    "cosent": CoSENTLoss,
    "cosine": CosineSimilarityLoss,
}

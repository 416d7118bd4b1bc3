"""SPLADE's training loss, as sentence-transformers' sparse_encoder/losses computes it from embeddings.

`splade_loss` is `SpladeLoss` (splade.py) with its default regulariser, `FlopsLoss` (flops.py), around
`SparseMultipleNegativesRankingLoss` (sparse_multiple_negatives_ranking.py: `MultipleNegativesRankingLoss` with dot
scores, scale 1, the query-to-document direction). Each takes the embeddings of a batch's columns, the query
column first, then the positive documents, then any hard negatives; all are differentiable MLX functions.
"""

from dataclasses import dataclass

import mlx.core as mx

from ..config import check_option
from .contrastive import Texts, in_batch_no_signal


def multiple_negatives_ranking(embeddings: list[mx.array], scale: float = 1.0) -> mx.array:
    """Cross-entropy of each query's scaled dot scores against every document of the batch, its own positive
    (row i of the second column) the target: -(s_ii - logsumexp_j s_ij), the mean over queries."""
    if len(embeddings) < 2:
        raise ValueError(f"multiple_negatives_ranking takes a query column and document columns; got {len(embeddings)}")
    queries, documents = embeddings[0], mx.concatenate(embeddings[1:], axis=0)
    scores = scale * (queries @ documents.T)  # (B, B * (1 + negatives))
    positives = scores[mx.arange(queries.shape[0]), mx.arange(queries.shape[0])]
    return -(positives - mx.logsumexp(scores, axis=1)).mean()


def flops(embeddings: mx.array, threshold: int | None = None) -> mx.array:
    """The FLOPS regulariser: the sum over dimensions of the squared mean activation. With `threshold`, rows with
    at most that many non-zero weights count as zeros (FLOPS with l0 masking)."""
    if threshold is not None:
        active = (embeddings != 0).sum(axis=1)
        embeddings = embeddings * (active > threshold).astype(embeddings.dtype)[:, None]
    return (embeddings.mean(axis=0) ** 2).sum()


def splade_loss(
    embeddings: list[mx.array],
    document_regularizer_weight: float,
    query_regularizer_weight: float | None = None,
    *,
    scale: float = 1.0,
    document_regularizer_threshold: int | None = None,
    query_regularizer_threshold: int | None = None,
    use_document_regularizer_only: bool = False,
) -> dict[str, mx.array]:
    """{"base_loss", "document_regularizer_loss", and with `query_regularizer_weight` "query_regularizer_loss"}: the
    parts `SpladeLoss` returns, to be summed. Documents are every column after the first (every column with
    `use_document_regularizer_only`, which then ignores the query weight)."""
    losses = {"base_loss": multiple_negatives_ranking(embeddings, scale)}
    documents = mx.concatenate(embeddings if use_document_regularizer_only else embeddings[1:], axis=0)
    losses["document_regularizer_loss"] = flops(documents, document_regularizer_threshold) * document_regularizer_weight
    if query_regularizer_weight is not None and not use_document_regularizer_only:
        losses["query_regularizer_loss"] = flops(embeddings[0], query_regularizer_threshold) * query_regularizer_weight
    return losses


@dataclass
class SpladeLoss:
    """`splade_loss` summed, as a loss of the embedding objective: `loss(column embeddings, labels)`. The
    weights default to sentence-transformers' documented SPLADE recipe (documents 3e-5, queries 5e-5)."""

    document_regularizer_weight: float = 3e-5
    query_regularizer_weight: float | None = 5e-5
    scale: float = 1.0
    document_regularizer_threshold: int | None = None
    query_regularizer_threshold: int | None = None
    use_document_regularizer_only: bool = False
    in_batch_negatives = True  # the no_duplicates sampler by default

    def __post_init__(self):
        for name in ("document_regularizer_weight", "query_regularizer_weight", "scale",
                     "document_regularizer_threshold", "query_regularizer_threshold"):  # fmt: skip
            check_option(name, getattr(self, name), "SpladeLoss")

    def __call__(self, embeddings: list[mx.array], labels=None) -> mx.array:
        parts = splade_loss(
            embeddings, self.document_regularizer_weight, self.query_regularizer_weight, scale=self.scale,
            document_regularizer_threshold=self.document_regularizer_threshold,
            query_regularizer_threshold=self.query_regularizer_threshold,
            use_document_regularizer_only=self.use_document_regularizer_only,
        )  # fmt: skip
        return sum(parts.values())

    def no_signal(self, columns: Texts, labels=None) -> str | None:
        """Why a batch gives the ranking part no gradient (`contrastive.in_batch_no_signal`), or None: the FLOPS
        regularizers alone would only push every weight of the vocabulary down."""
        return in_batch_no_signal(columns)

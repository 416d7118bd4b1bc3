"""ColBERT's training loss, as sentence-transformers' `MultiVectorMultipleNegativesRankingLoss`
(multi_vector_encoder/losses/multiple_negatives_ranking.py) computes it: cross-entropy of each query's scaled
MaxSim scores against every document of the batch, its own positive the target.
"""

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ...embeddings.multi_vector import maxsim_scores
from ..config import check_option
from .contrastive import Texts, in_batch_no_signal


def multi_vector_ranking(
    queries: tuple[mx.array, mx.array], documents: list[tuple[mx.array, mx.array]], scale: float = 1.0
) -> mx.array:
    """`queries`: (B, Lq, D) token embeddings and their (B, Lq) scored-token mask; `documents`: such a pair per
    column, the positives first, then any hard negatives (each (B, Ld_c, D), (B, Ld_c)). The mean over queries of
    -log softmax(scale * MaxSim) at the query's positive."""
    if not documents:
        raise ValueError("multi_vector_ranking needs at least the positive documents' column")
    scores = mx.concatenate([maxsim_scores(*queries, *column) for column in documents], axis=1)  # (B, B * columns)
    return nn.losses.cross_entropy(scale * scores, mx.arange(scores.shape[0]), reduction="mean")


@dataclass
class MaxSimRankingLoss:
    """`multi_vector_ranking` as a loss of the embedding objective: `loss(columns, labels)`, each column a
    ((B, L, D) token embeddings, (B, L) scored-token mask) pair, the queries first."""

    scale: float = 1.0
    in_batch_negatives = True  # the no_duplicates sampler by default

    def __post_init__(self):
        check_option("scale", self.scale, "MaxSimRankingLoss")

    def __call__(self, columns: list[tuple[mx.array, mx.array]], labels=None) -> mx.array:
        return multi_vector_ranking(columns[0], columns[1:], self.scale)

    def no_signal(self, columns: Texts, labels=None) -> str | None:
        """Why a batch gives this loss no gradient (`contrastive.in_batch_no_signal`), or None."""
        return in_batch_no_signal(columns)

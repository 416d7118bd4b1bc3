"""Cross-encoder (reranker) losses over (B, N) pair logits, as sentence-transformers' cross-encoder losses define
them (reference: `sentence_transformers/cross_encoder/losses/`: `binary_cross_entropy.py`, `list_net.py`,
`lambda_loss.py`, `multiple_negatives_ranking.py`); `kept` marks each row's real documents. `rerank.RerankObjective`
picks one by name (`LOSSES`)."""

import math

import mlx.core as mx
import mlx.nn as nn


def bce_loss(logits: mx.array, labels: mx.array, kept: mx.array) -> mx.array:
    """torch's BCEWithLogitsLoss over the kept pairs (mean), in float32."""
    losses = nn.losses.binary_cross_entropy(logits, labels, with_logits=True, reduction="none")
    return mx.where(kept, losses, 0).sum() / kept.sum()


def listnet_loss(logits: mx.array, labels: mx.array, kept: mx.array) -> mx.array:
    """sentence-transformers' ListNetLoss over (B, N) logits: missing documents score -1e16 and carry no label."""
    logits = mx.where(kept, logits, -1e16)
    targets = mx.softmax(mx.where(kept, labels, -mx.inf), axis=-1)
    log_p = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return -(mx.where(kept, targets * log_p, 0)).sum(axis=-1).mean()


def lambda_loss(logits: mx.array, labels: mx.array, kept: mx.array, mu: float = 10.0) -> mx.array:
    """sentence-transformers' LambdaLoss with its default NDCGLoss2++ weighting (mu x NDCGLoss2 + LambdaRank),
    sigma 1, k None, binary logarithms, over (B, N) logits whose missing documents score -1e16."""
    n = logits.shape[1]
    logits = mx.where(kept, logits, -1e16)
    labels = mx.where(kept, labels, -mx.inf)
    order = mx.stop_gradient(mx.argsort(-logits, axis=1))
    scores = mx.take_along_axis(logits, order, axis=1)
    true = mx.take_along_axis(labels, order, axis=1)
    ideal = -mx.sort(-labels, axis=1)
    diffs = true[:, :, None] - true[:, None, :]
    pairs = mx.isfinite(diffs) & (diffs > 0)
    true, ideal = mx.maximum(true, 0.0), mx.maximum(ideal, 0.0)
    discount = mx.log2(1.0 + mx.arange(1, n + 1, dtype=mx.float32))[None, :]  # (1, N)
    max_dcg = mx.maximum(((2.0**ideal - 1) / discount).sum(axis=-1), 1e-10)
    gain = (2.0**true - 1) / max_dcg[:, None]
    gain_gaps = mx.abs(gain[:, :, None] - gain[:, None, :])
    positions = mx.arange(1, n + 1)
    delta = mx.abs(positions[:, None] - positions[None, :])  # (N, N)
    inverse = 1 / discount[0]
    ndcg2 = mx.abs(inverse[(delta - 1) % n] - inverse[delta])  # the diagonal (delta 0) wraps, then is zeroed
    ndcg2 = mx.where(mx.eye(n, dtype=mx.bool_), 0.0, ndcg2)
    lambda_rank = mx.abs(inverse[None, :, None] - inverse[None, None, :]) * gain_gaps
    weights = mu * ndcg2[None] * gain_gaps + lambda_rank
    gaps = mx.clip(scores[:, :, None] - scores[:, None, :], -1e8, 1e8)
    losses = weights * nn.log_sigmoid(gaps) / math.log(2)
    return -mx.where(pairs, losses, 0).sum() / mx.maximum(pairs.sum(), 1)


def mnrl_loss(logits: mx.array, labels: mx.array, kept: mx.array, scale: float = 10.0) -> mx.array:
    """sentence-transformers' cross-encoder MultipleNegativesRankingLoss: cross-entropy of sigmoid(logits) x scale
    over each query's (B, M) candidates, the target marked 1 in `labels`."""
    scores = mx.sigmoid(logits) * scale
    return -(labels * (scores - mx.logsumexp(scores, axis=-1, keepdims=True))).sum(axis=-1).mean()


LOSSES = {"bce": bce_loss, "listnet": listnet_loss, "lambda": lambda_loss, "mnrl": mnrl_loss}

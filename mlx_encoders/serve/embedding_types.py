"""Typed embeddings over HTTP: float, int8, uint8, binary and ubinary vectors, as `encode(precision=...)` gives them
(sentence-transformers' `quantize_embeddings`), and their base64 form."""

import base64

import numpy as np

from ..embeddings.vectors import quantize_embeddings
from .errors import ApiError

TYPES = ("float", "int8", "uint8", "binary", "ubinary")


def typed(vectors: np.ndarray, kind: str, param: str) -> np.ndarray:
    """`vectors` (N, D) float as `kind`: int8 and uint8 in 256 buckets between each dimension's minimum and maximum
    over this request's vectors, as `encode(texts, precision=...)` computes them (so a request needs 2 inputs or
    more); binary and ubinary the packed sign bits, (N, ceil(D / 8))."""
    if kind == "float":
        return vectors.astype(np.float32)
    if kind.endswith("int8"):
        if len(vectors) < 2:
            raise ApiError(
                400, f'{kind} embeddings are bucketed between the minimum and maximum of each dimension over the '
                "request's own embeddings, as encode(precision=...) does: send 2 inputs or more, or ask for float, "
                "binary or ubinary", param,
            )  # fmt: skip
        ranges = np.vstack((vectors.min(axis=0), vectors.max(axis=0)))
        return quantize_embeddings(vectors, kind, ranges)
    return quantize_embeddings(vectors, kind)


def base64_of(vector: np.ndarray) -> str:
    """The vector's little-endian bytes (float32, or the int8 / uint8 codes), base64-encoded."""
    kind = "<f4" if vector.dtype.kind == "f" else vector.dtype
    return base64.b64encode(vector.astype(kind).tobytes()).decode()

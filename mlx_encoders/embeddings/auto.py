"""`load_encoder`: the encoder a folder holds (dense, sparse, multi-vector or cross-encoder, as `folder.folder_kind`
reads what sentence-transformers saved with it), built for that kind."""

from pathlib import Path

from ..checkpoint import resolve
from .cross_encoder import CrossEncoder
from .folder import folder_kind
from .multi_vector import MultiVectorEncoder
from .sentence import SentenceEncoder
from .sparse import SparseEncoder

ENCODERS = {
    "dense": SentenceEncoder, "sparse": SparseEncoder, "multi-vector": MultiVectorEncoder,
    "cross-encoder": CrossEncoder,
}  # fmt: skip


def load_encoder(
    path_or_repo: str | Path, dtype=None, revision: str | None = None
) -> SentenceEncoder | SparseEncoder | MultiVectorEncoder | CrossEncoder:
    """The encoder of the folder or hub id's kind (`folder.folder_kind`), built with `dtype`."""
    path = resolve(path_or_repo, revision)
    return ENCODERS[folder_kind(path)](path, dtype=dtype)

"""A search index over a corpus: build it (`build`, sharded over ranks under `mlx.launch`), search it (`search`,
`Index`), hand it to another engine (`export`: Parquet). SQLite is the system of record; an HNSW graph (usearch)
speeds up large indexes."""

from .build import build
from .documents import CorpusError, read_corpus
from .export import export
from .lock import IndexBusy
from .search import Hit, Index, StaleIndex, search
from .store import DamagedStore, StoreError

__all__ = [
    "build", "search", "export", "Index", "Hit", "read_corpus", "CorpusError", "StoreError", "DamagedStore",
    "StaleIndex", "IndexBusy",
]  # fmt: skip

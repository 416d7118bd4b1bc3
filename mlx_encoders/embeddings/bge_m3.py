"""BGE-M3: dense, sparse (lexical) and ColBERT outputs of one XLM-R pass, and their combined score.

Matches its authors' package, FlagEmbedding (inference/embedder/encoder_only/m3.py `M3Embedder.encode`,
`compute_lexical_matching_score`, `colbert_score`, and finetune/embedder/encoder_only/m3/modeling.py): the dense
vector is the normalised [CLS] state; a token's lexical weight is relu(sparse_linear(state)), each token id keeping
its largest weight, the cls/eos/pad/unk ids dropped; the ColBERT vectors are colbert_linear of the states after
[CLS] (the final </s> included), normalised. The two heads ship as torch pickles (sparse_linear.pt,
colbert_linear.pt): `python -m convert` writes them as safetensors, the only form read here.
"""

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..checkpoint import Checkpoint, load_model, load_tokenizer, read_safetensors
from ..checkpoint import resolve as resolve_path
from ..checkpoint.foreign import BGE_M3_HEADS as HEADS
from ..engine.threads import on_own_thread
from ..tokenizer import check_count
from .base import Encoder, text_inputs
from .vectors import normalize

UNUSED_TOKENS = ("cls_token", "eos_token", "pad_token", "unk_token")  # never lexical matches


def load_head(folder: Path, name: str) -> nn.Linear:
    file = folder / f"{name}.safetensors"
    if not file.exists():
        hint = f"; it has {name}.pt, a torch pickle, which is not read" if (folder / f"{name}.pt").exists() else ""
        raise FileNotFoundError(
            f"No {name}.safetensors in {folder}{hint}. Convert the BGE-M3 folder once with torch installed: "
            f"`python -m convert --hf-path {folder} --mlx-path <new folder>` (torch.load(weights_only=True))."
        )
    weights = read_safetensors(file)
    mx.eval(weights)  # loaded now: a lazy array belongs to this thread's stream, and others cannot run it
    if set(weights) != {"weight", "bias"} or weights["weight"].ndim != 2:
        raise ValueError(f"{file} must hold a Linear's 'weight' (out, in) and 'bias'; found {sorted(weights)}")
    out_features, in_features = weights["weight"].shape
    linear = nn.Linear(in_features, out_features)
    linear.load_weights(list(weights.items()))
    return linear


def lexical_matching_score(weights1: dict, weights2: dict) -> float:
    """Sum over the token ids both hold of the product of their weights."""
    return float(sum(w * weights2[token] for token, w in weights1.items() if token in weights2))


def colbert_score(query: np.ndarray, document: np.ndarray) -> float:
    """Mean over the query's vectors of their largest dot with a document vector."""
    return float((np.asarray(query) @ np.asarray(document).T).max(axis=1).sum() / len(query))


class BGEM3(Encoder):
    """BGE-M3's three retrieval outputs, like FlagEmbedding's `BGEM3FlagModel(path).encode(...)`.

    `path_or_repo`: a BGE-M3 folder (an XLM-R checkpoint with sparse_linear.safetensors and
    colbert_linear.safetensors beside it) or hub id; `dtype` casts the encoder's weights. Texts are cut at
    `passage_max_length` tokens and `compute_scores`' queries at `query_max_length` unless a call says otherwise,
    FlagEmbedding's defaults (the model reads up to 8,192).
    """

    @on_own_thread
    def __init__(
        self,
        path_or_repo: str | Path,
        dtype=None,
        revision: str | None = None,
        query_max_length: int = 512,
        passage_max_length: int = 512,
    ):
        check_count("BGEM3 query_max_length", query_max_length, 2)
        check_count("BGEM3 passage_max_length", passage_max_length, 2)
        self.query_max_length, self.passage_max_length = query_max_length, passage_max_length
        self.path = resolve_path(path_or_repo, revision)
        checkpoint = Checkpoint.open(self.path)
        self.model = load_model(checkpoint, dtype=dtype, task="encoder")
        self.tokenizer = load_tokenizer(self.model, checkpoint)
        self.sparse_linear, self.colbert_linear = (load_head(self.path, name) for name in HEADS)
        hidden = self.model.args.hidden_size
        for name, head in zip(HEADS, (self.sparse_linear, self.colbert_linear), strict=True):
            if head.weight.shape[1] != hidden:
                raise ValueError(f"{self.path / name}.safetensors takes {head.weight.shape[1]} inputs, not {hidden}")
        ids = (self.tokenizer.token_id(getattr(self.tokenizer, name)) for name in UNUSED_TOKENS)
        self.unused_ids = {i for i in ids if i is not None}

    def heads(self, batch: dict[str, mx.array]) -> list[mx.array]:
        """(B, H) dense vectors, (B, L) token weights, (B, L - 1, C) ColBERT vectors of one padded batch."""
        out = self.model(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"))
        hidden = out.last_hidden_state.astype(mx.float32)
        dense = normalize(hidden[:, 0])
        weights = nn.relu(self.sparse_linear(hidden))[..., 0]
        colbert = self.colbert_linear(hidden[:, 1:]) * batch["attention_mask"][:, 1:, None]
        return [dense, weights, normalize(colbert)]

    @on_own_thread
    def encode(
        self,
        sentences: str | list[str],
        batch_size: int = 32,
        max_length: int | None = None,
        return_dense: bool = True,
        return_sparse: bool = True,
        return_colbert_vecs: bool = False,
    ) -> dict:
        """{"dense_vecs": (N, H) float32, "lexical_weights": per text {str(token id): weight},
        "colbert_vecs": per text (tokens - 1, C) float32}, each None unless asked for; a single str gives one
        text's values. Texts are truncated to `max_length` tokens (`passage_max_length` by default, and the model's
        positions)."""
        texts, single = text_inputs(sentences, batch_size)
        max_length = self.passage_max_length if max_length is None else max_length
        check_count("encode() max_length", max_length, 2)
        dense, lexical, colbert = self.run(texts, batch_size, max_length)
        out = {
            "dense_vecs": dense if return_dense else None,
            "lexical_weights": lexical if return_sparse else None,
            "colbert_vecs": colbert if return_colbert_vecs else None,
        }
        return {k: v[0] if single and v is not None else v for k, v in out.items()}

    def run(self, texts: list[str], batch_size: int, max_length: int) -> tuple[np.ndarray, list, list]:
        dense = np.zeros((len(texts), self.model.args.hidden_size), np.float32)
        lexical: list = [None] * len(texts)
        colbert: list = [None] * len(texts)
        if not texts:
            return dense, lexical, colbert
        limit = min(max_length, self.tokenizer.model_max_length)
        encodings = self.tokenizer.encode_batch(texts, truncation=True, max_length=limit)

        def forward(rows: np.ndarray) -> list[mx.array]:
            return self.heads(self.tokenizer.pad([encodings[i] for i in rows]))

        def collect(rows: np.ndarray, arrays: list[mx.array]) -> None:
            vectors, weights, tokens = (np.array(a) for a in arrays)
            for row, i in enumerate(rows):
                ids = encodings[i].ids
                dense[i] = vectors[row]
                lexical[i] = self.lexical_weights(weights[row, : len(ids)], ids)
                colbert[i] = tokens[row, : len(ids) - 1]

        lengths = [len(e.ids) for e in encodings]
        self.batches(lengths, forward, collect, batch_size)
        return dense, lexical, colbert

    def lexical_weights(self, weights: np.ndarray, ids: list[int]) -> dict[str, float]:
        """{str(token id): its largest positive weight} over the text's tokens, special tokens left out."""
        out: dict[str, float] = {}
        for w, token in zip(weights.tolist(), ids, strict=True):
            if token not in self.unused_ids and w > 0 and w > out.get(str(token), 0.0):
                out[str(token)] = w
        return out

    def convert_id_to_token(self, lexical_weights: dict | list[dict]) -> dict | list[dict]:
        """Lexical weights keyed by each token decoded alone instead of its id; as FlagEmbedding's, one text's
        weights (a dict, or a list of one) give a dict."""
        items = [lexical_weights] if isinstance(lexical_weights, dict) else lexical_weights
        decode = self.tokenizer.backend.decode
        out = [{decode([int(k)], skip_special_tokens=False): w for k, w in item.items()} for item in items]
        return out[0] if len(out) == 1 else out

    compute_lexical_matching_score = staticmethod(lexical_matching_score)
    colbert_score = staticmethod(colbert_score)

    def compute_scores(
        self,
        queries: list[str],
        documents: list[str],
        weights_for_different_modes: tuple = (1.0, 1.0, 1.0),
        max_query_length: int | None = None,
        max_passage_length: int | None = None,
    ) -> dict[str, np.ndarray]:
        """(N, M) scores of every query with every document (one str: one row or column): "dense", "sparse",
        "colbert", and the weighted means "sparse+dense" and "colbert+sparse+dense" (weights for dense, sparse,
        colbert, as FlagEmbedding's), the queries cut at `max_query_length` tokens (`query_max_length`), the
        documents at `max_passage_length`."""
        if len(weights_for_different_modes) != 3:
            raise ValueError(f"weights_for_different_modes takes 3 weights, got {weights_for_different_modes!r}")
        wd, ws, wc = weights_for_different_modes
        queries, documents = ([t] if isinstance(t, str) else t for t in (queries, documents))  # one text: a row
        query_length = self.query_max_length if max_query_length is None else max_query_length
        q = self.encode(queries, max_length=query_length, return_colbert_vecs=True)
        d = self.encode(documents, max_length=max_passage_length, return_colbert_vecs=True)
        dense = q["dense_vecs"] @ d["dense_vecs"].T
        sparse = np.array([[lexical_matching_score(a, b) for b in d["lexical_weights"]] for a in q["lexical_weights"]])
        colbert = np.array([[colbert_score(a, b) for b in d["colbert_vecs"]] for a in q["colbert_vecs"]])
        return {
            "dense": dense,
            "sparse": sparse.reshape(dense.shape),
            "colbert": colbert.reshape(dense.shape),
            "sparse+dense": (ws * sparse.reshape(dense.shape) + wd * dense) / (ws + wd),
            "colbert+sparse+dense": (wc * colbert.reshape(dense.shape) + ws * sparse.reshape(dense.shape) + wd * dense)
            / (wd + ws + wc),
        }

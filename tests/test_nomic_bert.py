"""Nomic BERT (nomic-embed-text) beyond the registry's tests, which already hold every architecture to transformers
(outputs and gradients of every head, dropout, save -> transformers, quantized kernels, LoRA targets):
nomic-ai's own checkpoint layout, mixed-length batches against one-by-one runs, the sentence-transformers folder
as nomic-ai lays it out (mean pooling, Normalize, `search_query: ` / `search_document: ` prompts, Matryoshka
`truncate_dim`), 8- and 4-bit conversion, the server, the index and embedding training with LoRA.

tests/test_gte.py runs the same checks on GTE through the helpers here.
"""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import make_checkpoint
from safetensors.numpy import load_file
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import Normalize, Transformer
from sentence_transformers.sentence_transformer.modules import Pooling
from test_parity import assert_close, our_outputs, reference_outputs
from tolerance import assert_float32_close, encoder_terms

import mlx_encoders
from mlx_encoders import SentenceEncoder
from mlx_encoders.corpus import stdlib_docstrings

TEXTS = [
    "A cat sat on the mat.",
    "",
    "The quick brown fox jumps over the lazy dog, then runs far away into the forest near the river bank.",
    "x",
    "Rotary positions make the same word differ by where it stands " * 2,
]
# nomic-embed-text-v1.5's config_sentence_transformers.json prompts
NOMIC_PROMPTS = {
    "query": "search_query: ",
    "document": "search_document: ",
    "classification": "classification: ",
    "clustering": "clustering: ",
}
MIN_COSINE = 0.99999


def assert_same_embeddings(ours: np.ndarray, theirs: np.ndarray) -> None:
    """Row by row cosine >= MIN_COSINE, and equal up to float32 rounding."""
    assert ours.shape == theirs.shape and ours.dtype == np.float32
    cosines = (ours * theirs).sum(-1) / (np.linalg.norm(ours, axis=-1) * np.linalg.norm(theirs, axis=-1))
    assert cosines.min() >= MIN_COSINE, cosines
    np.testing.assert_allclose(ours, theirs, atol=1e-5)


def st_folder(folder: Path, checkpoint: Path, pooling: str, normalize: bool, **kwargs) -> Path:
    """A sentence-transformers folder over `checkpoint`, saved by sentence-transformers itself."""
    width = json.loads((checkpoint / "config.json").read_text())["hidden_size"]
    modules = [Transformer(str(checkpoint), max_seq_length=128), Pooling(width, pooling_mode=pooling)]
    modules += [Normalize()] if normalize else []
    SentenceTransformer(modules=modules, device="cpu", **kwargs).save(str(folder))
    return folder


def check_sentence_transformers(folder: Path, truncate_dim: int) -> None:
    """encode, encode_query, encode_document and a named prompt, whole and cut to `truncate_dim`, equal
    sentence-transformers'."""
    for dim in (None, truncate_dim):
        theirs = SentenceTransformer(str(folder), device="cpu", truncate_dim=dim)
        ours = SentenceEncoder(folder, truncate_dim=dim)
        assert not np.allclose(ours.encode_query(TEXTS), ours.encode(TEXTS), atol=1e-3), "the query prompt is used"
        for method, kwargs in [("encode", {}), ("encode_query", {}), ("encode_document", {})] + [
            ("encode", {"prompt_name": name}) for name in ours.prompts if name not in ("query", "document")
        ]:
            expected = getattr(theirs, method)(TEXTS, batch_size=2, convert_to_numpy=True, **kwargs)
            got = getattr(ours, method)(TEXTS, batch_size=2, **kwargs)
            assert got.shape[1] == (dim or ours.dimension)
            assert_same_embeddings(got, expected)


def check_batch_equals_one_by_one(folder: Path) -> None:
    """Right-padded batches of mixed lengths give each text its own (unpadded) outputs."""
    model, tokenizer = mlx_encoders.load(folder)
    batch = tokenizer(TEXTS, padding=True)
    mask = np.array(batch["attention_mask"])
    assert mask[:, 0].all() and not mask[:, -1].all(), "right padding: every row starts with a real token"
    out = our_outputs(model(**batch))
    terms = encoder_terms(folder, TEXTS)
    for i, text in enumerate(TEXTS):
        single = our_outputs(model(**tokenizer([text])))
        n = int(mask[i].sum())
        for name, value in single.items():
            batched = out[name][i, :n] if value.ndim == 3 else out[name][i]
            assert_float32_close(batched, value[0], terms, err_msg=f"{name} of text {i}")


def check_conversion(folder: Path, bits: int, min_cosine: float, mean_cosine: float) -> None:
    """The folder converted to `bits` (GPTQ on 32 docstrings) loads and embeds close to the float model. At 4 bits the
    tiny random models lose much more than real ones (whose figures are the benchmarks'): the mean is held
    tighter than the worst text."""
    calibration = stdlib_docstrings(32)
    out = mlx_encoders.convert(folder, folder.parent / f"{bits}bit", bits=bits, group_size=32, calibration=calibration)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == bits
    quantized = SentenceEncoder(out).encode(TEXTS)
    expected = SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_numpy=True)
    cosines = (quantized * expected).sum(-1) / (np.linalg.norm(quantized, axis=-1) * np.linalg.norm(expected, axis=-1))
    assert cosines.min() >= min_cosine and cosines.mean() >= mean_cosine, cosines


def check_serve_and_index(folder: Path, tmp_path: Path) -> None:
    """/v1/embeddings answers sentence-transformers' vectors; `index build` stores them."""
    import urllib.request

    from test_serve import in_process

    from mlx_encoders import serve
    from mlx_encoders.index import build

    texts = [t for t in TEXTS if t]
    oracle = SentenceTransformer(str(folder), device="cpu")
    expected = oracle.encode(texts, convert_to_numpy=True)
    with in_process(serve.app({"tiny": str(folder)})) as url:
        body = json.dumps({"model": "tiny", "input": texts}).encode()
        request = urllib.request.Request(f"{url}/v1/embeddings", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            data = json.loads(response.read())["data"]
    assert_same_embeddings(np.array([d["embedding"] for d in data], np.float32), expected)

    docs = [(f"doc{i}", text) for i, text in enumerate(texts)]
    counts = build(docs, tmp_path / "index", SentenceEncoder(folder), quiet=True)
    assert counts["documents"] == counts["added"] == len(texts)
    index = mlx_encoders.index.Index(tmp_path / "index")
    # every document's score equals the oracle's query-document cosine (a tiny random model may tie texts, so no
    # rank is asserted)
    query, documents = (oracle.encode_query([texts[2]]), oracle.encode_document(texts))
    query, documents = (x / np.linalg.norm(x, axis=1, keepdims=True) for x in (query, documents))
    scores = {hit.id: hit.score for hit in index.search(texts[2], k=len(texts))}
    np.testing.assert_allclose([scores[doc_id] for doc_id, _ in docs], documents @ query[0], atol=1e-4)


def check_lora_embedding_training(folder: Path, tmp_path: Path, targets: set[str]) -> None:
    """`fine_tune("embed", ...)` with LoRA (MNRL, the default loss) adapts `targets` and writes a folder
    sentence-transformers reads with equal embeddings."""
    from test_contrastive import TRIPLETS

    from mlx_encoders.train import fine_tune

    trained = fine_tune(
        "embed", TRIPLETS, tmp_path / "run", model=folder, lora_rank=2, max_steps=2, batch_size=3, lr=1e-3
    )
    adapters = tmp_path / "run" / "adapters"
    assert set(json.loads((adapters / "adapter_config.json").read_text())["targets"]) == targets
    adapted = {key.split(".")[-2] for key in mx.load(str(adapters / "adapters.safetensors"))}
    assert adapted == targets, adapted
    texts = ["how do cats sleep", "a much longer text about python, the programming language"]
    expected = SentenceTransformer(str(trained.path), device="cpu").encode(texts, convert_to_numpy=True)
    assert_same_embeddings(SentenceEncoder(trained.path).encode(texts), expected)
    before = SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_numpy=True)
    assert not np.allclose(before, expected, atol=1e-5), "training changed nothing"


# --- nomic-ai's own layout ---

ORIGINAL_CONFIG = {
    "hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
    "intermediate_size": "n_inner", "max_position_embeddings": "n_positions", "layer_norm_eps": "layer_norm_epsilon",
}  # fmt: skip


def with_original_config(folder: Path, target: Path, rope: bool = True) -> Path:
    """A copy of a transformers NomicBert folder whose config.json uses the names of nomic-ai's published ones
    (`rope`: its rope_parameters as rotary_emb_base; else dropped)."""
    shutil.copytree(folder, target)
    config = json.loads((target / "config.json").read_text())
    for new, old in ORIGINAL_CONFIG.items():
        config[old] = config.pop(new)
    theta = config.pop("rope_parameters")["rope_theta"]
    if rope:
        config["rotary_emb_base"] = theta
    config.update(activation_function="swiglu", prenorm=False, rotary_emb_fraction=1.0, qkv_proj_bias=False)
    config.update(mlp_fc1_bias=False, mlp_fc2_bias=False, rotary_emb_interleaved=False)
    del config["hidden_act"], config["head_dim"]
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_nomic_ai_layout_matches_transformers_and_saves_in_transformers_names(checkpoint, tmp_path):
    """transformers writes nomic-ai's keys (`encoder.layers.{i}.attn.Wqkv`, ...: every registry test reads them);
    nomic-ai's config names are read too. `save` writes transformers' own names, which transformers reads."""
    folder = checkpoint("nomic_bert")
    assert any(k.endswith("attn.Wqkv.weight") for k in load_file(folder / "model.safetensors"))
    original = with_original_config(folder, tmp_path / "original")
    model, tokenizer = mlx_encoders.load(original)
    batch = tokenizer(TEXTS, padding=True)
    real = np.array(batch["attention_mask"]).astype(bool)
    assert_close(our_outputs(model(**batch)), reference_outputs(folder, "encoder", batch), real, "encoder")
    saved = mlx_encoders.save(model, tmp_path / "saved", tokenizer)
    config = json.loads((saved / "config.json").read_text())
    assert config["hidden_size"] == 32 and "n_embd" not in config and config["rope_theta"] == 50.0
    assert_close(our_outputs(model(**batch)), reference_outputs(saved, "encoder", batch), real, "encoder")


@pytest.mark.parametrize(
    "edit, message",
    [
        (dict(prenorm=True), "'prenorm' is True; transformers' NomicBert .* computes only False"),
        (dict(rotary_emb_fraction=0.5), "'rotary_emb_fraction' is 0.5"),
        (dict(moe_every_n_layers=2), "mixture-of-experts"),
        (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope type 'yarn' is not supported"),
        (dict(rope_parameters={"rope_type": "dynamic"}), "the dynamic rope type needs a 'factor' >= 1, got None"),
    ],
)
def test_layouts_transformers_cannot_compute_fail_naming_the_key(checkpoint, tmp_path, edit, message):
    folder = shutil.copytree(checkpoint("nomic_bert"), tmp_path / "ckpt")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(ValueError, match=message):
        mlx_encoders.load_model(folder)


def check_dynamic_rope(folder: Path, task: str) -> None:
    """Inputs within and past max_position_embeddings (where the dynamic rope's base grows with the length) equal
    a freshly loaded transformers model's (its dynamic rope keeps the longest length seen: one model per input)."""
    model = mlx_encoders.load_model(folder)
    trained = model.args.max_position_embeddings
    assert model.args.max_tokens is None
    rng = np.random.default_rng(0)
    for length in (trained // 2, trained, 3 * trained):
        batch = {"input_ids": mx.array(rng.integers(5, 300, (2, length))), "attention_mask": mx.ones((2, length))}
        batch["attention_mask"][1, length // 2 :] = 0
        real = np.array(batch["attention_mask"]).astype(bool)
        assert_close(our_outputs(model(**batch)), reference_outputs(folder, task, batch), real, task)


DYNAMIC = dict(max_position_embeddings=16, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 50.0})


@pytest.mark.parametrize("task", ["encoder", "masked-lm"])
def test_dynamic_rope_matches_transformers_within_and_past_the_trained_length(checkpoint, task):
    check_dynamic_rope(checkpoint("nomic_bert", task, **DYNAMIC), task)


def test_transformers_4_rope_spelling_is_read_as_transformers_5_reads_it(checkpoint, tmp_path):
    """A top-level `rope_theta` and `rope_scaling` (no `rope_parameters`): the dynamic rope all the same."""
    folder = shutil.copytree(checkpoint("nomic_bert", **DYNAMIC), tmp_path / "legacy")
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update(rope_theta=rope["rope_theta"], rope_scaling={"rope_type": "dynamic", "factor": rope["factor"]})
    (folder / "config.json").write_text(json.dumps(config))
    check_dynamic_rope(folder, "encoder")


def test_nomic_ai_rotary_scaling_factor_is_the_dynamic_rope(checkpoint, tmp_path):
    """nomic-ai's `rotary_scaling_factor` scales from `max_trained_positions` (its `n_positions` is the token limit)."""
    folder = checkpoint("nomic_bert", **DYNAMIC)
    original = with_original_config(folder, tmp_path / "original", rope=False)
    config = json.loads((original / "config.json").read_text())
    config.update(rotary_scaling_factor=2.0, max_trained_positions=16, n_positions=128, rotary_emb_base=50.0)
    (original / "config.json").write_text(json.dumps(config))
    model = mlx_encoders.load_model(original)
    assert model.args.rope == mlx_encoders.load_model(folder).args.rope
    assert model.args.max_position_embeddings == 16 and model.args.max_tokens is None


@pytest.mark.parametrize("task", ["encoder", "masked-lm"])
def test_mixed_length_batch_equals_one_by_one(checkpoint, task):
    check_batch_equals_one_by_one(checkpoint("nomic_bert", task))


def test_long_input_runs_past_the_trained_length(checkpoint):
    """Rotary positions have no table: 4x max_position_embeddings embeds (blockwise attention, finite)."""
    model = mlx_encoders.load_model(checkpoint("nomic_bert"))
    ids = mx.array(np.random.default_rng(0).integers(1000, 2000, (1, 4 * model.args.max_position_embeddings)))
    assert np.isfinite(np.array(model(ids).last_hidden_state)).all()


# --- the sentence-transformers folder, conversion, serving, index, training ---


@pytest.fixture(scope="module")
def nomic_folder(tmp_path_factory) -> Path:
    """nomic-embed-text-v1.5's modules: mean pooling, Normalize, its four task prompts, no default prompt."""
    root = tmp_path_factory.mktemp("nomic")
    ckpt = make_checkpoint(root / "ckpt", "nomic_bert", hidden_size=64, intermediate_size=64)
    return st_folder(root / "st", ckpt, "mean", normalize=True, prompts=NOMIC_PROMPTS)


def test_sentence_transformers_folder_with_prompts_and_truncate_dim(nomic_folder):
    assert SentenceEncoder(nomic_folder).prompts["query"] == "search_query: "
    check_sentence_transformers(nomic_folder, truncate_dim=16)


@pytest.mark.parametrize("bits, min_cosine, mean_cosine", [(8, 0.999, 0.9995), (4, 0.85, 0.95)])
def test_converted_folder_embeds_close_to_float(nomic_folder, bits, min_cosine, mean_cosine):
    check_conversion(nomic_folder, bits, min_cosine, mean_cosine)


def test_serve_and_index(nomic_folder, tmp_path):
    check_serve_and_index(nomic_folder, tmp_path)


def test_lora_embedding_training(nomic_folder, tmp_path):
    check_lora_embedding_training(nomic_folder, tmp_path, {"q_proj", "k_proj", "v_proj"})


def test_dynamic_rope_batch_runs_whole_as_sentence_transformers_pads_it(checkpoint, tmp_path):
    """Past the trained length the rotary base follows the padded length: a batch is not sliced (a short text's
    slice would get another base), so each text's embedding equals sentence-transformers' over the same batch."""
    folder = st_folder(tmp_path / "st", checkpoint("nomic_bert", "encoder", **DYNAMIC), "mean", normalize=True)
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64, "do_lower_case": False}))
    rng = np.random.default_rng(1)
    words = "alpha beta gamma delta pooling vector sentence token window river forest".split()
    texts = ["x", "Short."] + [" ".join(rng.choice(words, int(rng.integers(1, 60)))) for _ in range(11)]
    encoder = mlx_encoders.SentenceEncoder(folder)
    encoder.slice_bytes = 4096  # slices of a few rows each, were they sliced
    expected = SentenceTransformer(str(folder), device="cpu").encode(texts, batch_size=32, convert_to_numpy=True)
    assert_same_embeddings(encoder.encode(texts, batch_size=32), expected)

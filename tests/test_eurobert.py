"""EuroBERT (`eurobert`) against transformers and sentence-transformers, beyond the registry-wide tests (parity and
gradients of every head in test_parity.py and test_gradients.py, save in test_checkpoint.py, convert in
test_convert.py): each classifier pooling, both config spellings, the attention layouts, padded batches against
texts alone, the blockwise path of long inputs, an embedding folder built by sentence-transformers (prompts,
truncate_dim), 8- and 4-bit GPTQ, the server, the index and LoRA embedding training."""

import json

import mlx.core as mx
import numpy as np
import pytest
import test_contrastive
from checkpoints import AUTO_CLASSES, CONFIG_CLASSES, CONFIGS
from mlx.utils import tree_flatten
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import Normalize, Transformer
from sentence_transformers.sentence_transformer.modules import Pooling
from test_contrastive import TRIPLETS
from test_convert import inputs, oracle, ours, text_cosines
from test_gradients import check_gradients
from test_parity import TEXTS, assert_close, check_parity, our_outputs, reference_outputs, rewrite_config
from test_serve import call, in_process
from tolerance import assert_float32_close, encoder_terms
from transformers import AutoConfig

import mlx_encoders
from mlx_encoders import SentenceEncoder
from mlx_encoders.__main__ import main as cli
from mlx_encoders.engine import attention
from mlx_encoders.models.eurobert import POOLINGS
from mlx_encoders.train import fine_tune
from mlx_encoders.train.tasks.heads import from_config

FAMILY = "eurobert"
CLASSIFY = "sequence-classification"
PROMPTS = {"query": "query: ", "document": "document: "}
QUERIES = ["how do cats sleep", "", "capital of france"]
# Parameters whose gradients the embedding losses are checked on: the table, attention, MLP and norms.
EUROBERT_PARAMETERS = (
    "embed_tokens.weight",
    "layers.0.self_attn.k_proj.weight",
    "layers.1.mlp.gate_proj.bias",
    "layers.2.post_attention_layernorm.weight",
    "norm.weight",
)
DOCUMENTS = ["cats sleep curled up in warm places", "paris is the capital of france", "x" * 40]


@pytest.mark.parametrize("pooling", POOLINGS)
def test_each_classifier_pooling_matches_transformers(checkpoint, pooling):
    check_parity(checkpoint(FAMILY, CLASSIFY, classifier_pooling=pooling), CLASSIFY)


@pytest.mark.parametrize("pooling", ["bos", "mean"])  # "late", the default, runs in test_gradients.py
def test_each_classifier_pooling_trains_as_transformers(checkpoint, pooling):
    check_gradients(checkpoint(FAMILY, CLASSIFY, classifier_pooling=pooling), CLASSIFY)


def test_remote_code_clf_pooling_is_read_when_classifier_pooling_is_absent(checkpoint, tmp_path):
    """Hub configs of the authors' remote code name the pooling `clf_pooling`; transformers 5 reads only
    `classifier_pooling` (it would pool "late"), but the weights were trained with the pooling the key names."""
    folder = checkpoint(FAMILY, CLASSIFY, classifier_pooling="mean")

    def remote_code(config):
        del config["classifier_pooling"]
        config["clf_pooling"] = "mean"

    legacy = rewrite_config(folder, tmp_path, remote_code)
    assert AutoConfig.from_pretrained(legacy).classifier_pooling == "late"
    model, tokenizer = mlx_encoders.load(legacy)
    batch = tokenizer(TEXTS, padding=True)
    real = np.array(batch["attention_mask"]).astype(bool)
    assert_close(our_outputs(model(**batch)), reference_outputs(folder, CLASSIFY, batch), real, CLASSIFY)
    saved = mlx_encoders.save(model, tmp_path / "saved")
    assert json.loads((saved / "config.json").read_text())["clf_pooling"] == "mean"  # written back as read


@pytest.mark.parametrize("task", ["encoder", "masked-lm"])
def test_hub_config_spelling_matches_transformers(checkpoint, tmp_path, task):
    """The published config.json: `rope_theta` and `rope_scaling: null` rather than transformers 5's
    `rope_parameters`, the remote code's keys, and `torch_dtype`."""

    def hub(config):
        for key in ("rope_parameters", "classifier_pooling", "dtype"):
            del config[key]
        config.update(rope_theta=500.0, rope_scaling=None, clf_pooling="late", hidden_dropout=0.0, use_cache=False)
        config.update(bos_token="<|begin_of_text|>", mask_token="<|mask|>", torch_dtype="float32")

    folder = rewrite_config(checkpoint(FAMILY, task), tmp_path, hub)
    check_parity(folder, task)


@pytest.mark.parametrize(
    "overrides",
    [dict(num_key_value_heads=4), dict(num_key_value_heads=1, head_dim=16), dict(tie_word_embeddings=True)],
    ids=["multi-head", "multi-query-wide-heads", "tied"],
)
def test_attention_layouts_and_tied_decoder_match_transformers(checkpoint, tmp_path, overrides):
    folder = checkpoint(FAMILY, "masked-lm", **overrides)
    check_parity(folder, "masked-lm")
    model, tokenizer = mlx_encoders.load(folder)
    saved = mlx_encoders.save(model, tmp_path / "saved", tokenizer)
    _, info = AUTO_CLASSES["masked-lm"].from_pretrained(saved, output_loading_info=True)
    assert not any(info.values()), info  # transformers finds every weight it needs, and nothing else


@pytest.mark.parametrize("task", ["encoder", CLASSIFY, "token-classification"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_equals_each_text_alone(checkpoint, task, side):
    """Positions are arange(L) whatever the padding, and RoPE scores depend on distances only: a left-padded text
    gets its outputs alone too."""
    folder = checkpoint(FAMILY, task)
    model, tokenizer = mlx_encoders.load(folder)
    alone = [tokenizer([text]) for text in TEXTS]
    width = max(a["input_ids"].shape[1] for a in alone)
    ids = np.full((len(TEXTS), width), tokenizer.pad_token_id, np.int32)
    mask = np.zeros_like(ids)
    for row, a in enumerate(alone):
        n = a["input_ids"].shape[1]
        span = slice(width - n, width) if side == "left" else slice(0, n)
        ids[row, span], mask[row, span] = np.array(a["input_ids"][0]), 1
    batched = model(mx.array(ids), mx.array(mask))
    terms = encoder_terms(folder, TEXTS)
    for row, a in enumerate(alone):
        expected = model(**a)
        if task == CLASSIFY:
            assert_float32_close(batched.logits[row], expected.logits[0], terms)
            continue
        out = batched.logits if task != "encoder" else batched.last_hidden_state
        single = expected.logits if task != "encoder" else expected.last_hidden_state
        assert_float32_close(np.array(out[row])[mask[row].astype(bool)], single[0], terms)


def test_long_inputs_attend_by_query_blocks_as_transformers(checkpoint, monkeypatch):
    """Past BLOCKWISE_FROM query rows (a group's queries stacked: 2 x 128 here) attention runs by query blocks
    in O(L) memory; thresholds lowered so the tiny model takes that path, forward and backward."""
    monkeypatch.setattr(attention, "BLOCKWISE_FROM", 64)
    monkeypatch.setattr(attention, "QUERY_BLOCK", 32)
    calls = []
    blocks = attention.attention_by_blocks
    monkeypatch.setattr(attention, "attention_by_blocks", lambda *a, **k: calls.append(1) or blocks(*a, **k))
    folder = checkpoint(FAMILY, CLASSIFY)
    check_parity(folder, CLASSIFY)
    assert calls, "the blockwise path did not run"
    check_gradients(folder, CLASSIFY)


@pytest.mark.parametrize(
    "edit, message",
    [
        (dict(num_key_value_heads=3), "'num_key_value_heads' \\(3\\) must divide num_attention_heads \\(4\\)"),
        (dict(classifier_pooling="cls"), "'classifier_pooling' must be one of bos, mean, late, got 'cls'"),
        (dict(classifier_pooling=None, clf_pooling="cls"), "'clf_pooling' must be one of bos, mean, late, got 'cls'"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10.0}), "rope_type 'yarn' is not supported"),
        (dict(head_dim=0), "'head_dim' must be a positive integer"),
    ],
)
def test_config_values_that_cannot_work_fail_at_load_naming_the_key(checkpoint, tmp_path, edit, message):
    folder = rewrite_config(checkpoint(FAMILY), tmp_path, lambda config: config.update(edit))  # None: null
    with pytest.raises(ValueError, match=f"config.json: .*{message}"):
        mlx_encoders.load(folder)


@pytest.fixture(scope="module")
def embedding_folder(checkpoint, tmp_path_factory):
    """EuroBERT as an embedder: its masked-LM checkpoint (as published) under sentence-transformers' Transformer,
    mean pooling and Normalize, with query and document prompts, saved by sentence-transformers itself."""
    folder = tmp_path_factory.mktemp("eurobert-st") / "st"
    transformer = Transformer(str(checkpoint(FAMILY, "masked-lm")))
    modules = [transformer, Pooling(transformer.get_embedding_dimension(), pooling_mode="mean"), Normalize()]
    SentenceTransformer(modules=modules, device="cpu", prompts=PROMPTS).save(str(folder))
    return folder


def assert_same_embeddings(ours_: np.ndarray, theirs: np.ndarray) -> None:
    assert ours_.shape == theirs.shape and ours_.dtype == np.float32
    cosines = (ours_ * theirs).sum(-1) / (np.linalg.norm(ours_, axis=-1) * np.linalg.norm(theirs, axis=-1))
    assert cosines.min() >= 0.99999, cosines
    np.testing.assert_allclose(ours_, theirs, atol=1e-5)


@pytest.mark.parametrize("truncate_dim", [None, 16])
def test_embedding_folder_equals_sentence_transformers(embedding_folder, truncate_dim):
    reference = SentenceTransformer(str(embedding_folder), device="cpu", truncate_dim=truncate_dim)
    encoder = SentenceEncoder(embedding_folder, truncate_dim=truncate_dim)
    texts = QUERIES + DOCUMENTS + TEXTS  # the last one past max_seq_length: cut as sentence-transformers cuts it
    with pytest.warns(UserWarning, match="1 of 10 texts are longer than max_seq_length=128 tokens"):
        got = encoder.encode(texts, batch_size=4)
    assert_same_embeddings(got, reference.encode(texts, batch_size=4))
    assert_same_embeddings(encoder.encode_query(QUERIES), reference.encode_query(QUERIES))
    assert_same_embeddings(encoder.encode_document(DOCUMENTS), reference.encode_document(DOCUMENTS))
    assert not np.allclose(encoder.encode_query(QUERIES), encoder.encode(QUERIES))  # the prompt is there
    width = truncate_dim or 32
    assert encoder.get_embedding_dimension() == reference.get_embedding_dimension() == width
    per_call = encoder.encode(QUERIES, truncate_dim=8)
    assert_same_embeddings(per_call, reference.encode(QUERIES, truncate_dim=8))


@pytest.mark.parametrize("bits", [8, 4])
def test_gptq_conversion_loads_and_runs(tmp_path, bits):
    from checkpoints import make_checkpoint

    source = make_checkpoint(tmp_path / "hf", FAMILY, "masked-lm", hidden_size=64, intermediate_size=128,
                             initializer_range=0.05)  # fmt: skip
    calibration = QUERIES + DOCUMENTS + TEXTS  # GPTQ's Hessians from these texts' inputs to each Linear
    out = mlx_encoders.convert(source, tmp_path / "mlx", bits=bits, group_size=32, calibration=calibration)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == bits and "GPTQ" in (out / "README.md").read_text()
    model = mlx_encoders.load_model(out)
    assert type(model.lm_head).__name__ == "QuantizedLinear"  # the vocabulary projection, the largest matrix
    ids, mask = inputs(config["vocab_size"])
    assert text_cosines(ours(out, ids, mask), oracle(source, "masked-lm", ids, mask), mask).min() > 0.99


def test_server_and_index_embed_with_eurobert(embedding_folder, tmp_path, capsys):
    from mlx_encoders import serve

    expected = SentenceTransformer(str(embedding_folder), device="cpu").encode(DOCUMENTS)
    with in_process(serve.app({"eurobert": embedding_folder})) as url:
        status, answer, _ = call(url, "/v1/embeddings", {"model": "eurobert", "input": DOCUMENTS})
    assert status == 200, answer
    assert_same_embeddings(np.array([d["embedding"] for d in answer["data"]], np.float32), expected)

    corpus, index = tmp_path / "corpus", tmp_path / "index"
    corpus.mkdir()
    (corpus / "docs.jsonl").write_text(
        "".join(json.dumps({"id": str(i), "text": d}) + "\n" for i, d in enumerate(DOCUMENTS))
    )
    assert (
        cli(["index", "build", "--corpus", str(corpus), "--index", str(index), "--model", str(embedding_folder)]) == 0
    )
    capsys.readouterr()
    query = "where do cats sleep"
    assert cli(["index", "search", "--index", str(index), query, "-k", "3", "--json"]) == 0
    [found] = json.loads(capsys.readouterr().out)
    # queries take the folder's query prompt, documents its document prompt, as sentence-transformers' encoders
    reference = SentenceTransformer(str(embedding_folder), device="cpu")
    scores = reference.encode_document(DOCUMENTS) @ reference.encode_query(query)
    assert [hit["id"] for hit in found["hits"]] == [str(i) for i in np.argsort(-scores)]
    np.testing.assert_allclose([hit["score"] for hit in found["hits"]], np.sort(scores)[::-1], atol=1e-5)


@pytest.mark.parametrize("case", ["mnrl-cosine", "cached-mnrl", "matryoshka-mnrl"])
def test_ranking_losses_and_gradients_equal_sentence_transformers(embedding_folder, monkeypatch, case):
    monkeypatch.setattr(test_contrastive, "PARAMETERS", EUROBERT_PARAMETERS)
    ours_, theirs = test_contrastive.LOSS_CASES[case]
    value, grads = test_contrastive.our_loss_and_grads(embedding_folder, ours_(), TRIPLETS, normalize=True)
    expected, expected_grads = test_contrastive.st_loss_and_grads(
        embedding_folder, theirs, TRIPLETS, test_contrastive.TRIPLET_COLUMNS
    )
    assert value == pytest.approx(expected, rel=1e-5)
    for name in EUROBERT_PARAMETERS:
        test_contrastive.assert_close(grads[name], expected_grads[name])


def test_lora_embedding_training_with_mnrl(embedding_folder, tmp_path):
    trained = fine_tune("embed", TRIPLETS, tmp_path / "out", model=embedding_folder, loss="mnrl", max_steps=2,
                        batch_size=3, lr=1e-2, lora_rank=2)  # fmt: skip
    adapted = {p.name for p in (tmp_path / "out" / "adapters").iterdir()}
    assert {"adapters.safetensors", "adapter_config.json"} <= adapted
    targets = json.loads((tmp_path / "out" / "adapters" / "adapter_config.json").read_text())["targets"]
    assert sorted(targets) == ["k_proj", "q_proj", "v_proj"]
    texts = ["how do cats sleep", "a much longer text about python, the programming language"]
    expected = SentenceTransformer(str(trained.path), device="cpu").encode(texts)
    assert_same_embeddings(SentenceEncoder(trained.path).encode(texts), expected)
    before = SentenceTransformer(str(embedding_folder), device="cpu").encode(texts)
    assert not np.allclose(before, expected, atol=1e-4)  # the fused adapters moved the embeddings


def test_a_new_model_is_initialised_as_transformers_initialises_it(checkpoint):
    """Training from scratch: RMSNorm weights 1, the padding row 0, the rest normal(0, initializer_range)."""
    tokenizer = mlx_encoders.load_tokenizer(mlx_encoders.load_model(checkpoint(FAMILY)), checkpoint(FAMILY))
    sizes = {**CONFIGS[FAMILY], "model_type": FAMILY, "vocab_size": tokenizer.max_id + 1, "hidden_size": 256}
    ours_ = dict(tree_flatten(from_config(dict(sizes), "masked-lm", tokenizer).parameters()))
    del sizes["model_type"]
    theirs = dict(AUTO_CLASSES["masked-lm"].from_config(CONFIG_CLASSES[FAMILY](**sizes)).named_parameters())
    assert ours_.keys() == theirs.keys()
    pad = sizes["pad_token_id"]
    for name, value in ours_.items():
        a, b = np.array(value), theirs[name].detach().numpy()
        if name.endswith("norm.weight") or name.endswith("bias"):
            np.testing.assert_array_equal(a, b, err_msg=name)  # ones, zeros
        else:
            assert abs(a.std() / b.std() - 1) < 0.1, (name, a.std(), b.std())
    assert not np.array(ours_["model.embed_tokens.weight"])[pad].any()
    assert not theirs["model.embed_tokens.weight"][pad].any()


@pytest.mark.parametrize("num_labels", [1, 3])
def test_cross_encoder_equals_sentence_transformers(checkpoint, num_labels):
    """Pairs through the classifier ("late" pooling): sentence-transformers' CrossEncoder scores, sigmoid or not."""
    from sentence_transformers import CrossEncoder as TorchCrossEncoder

    folder = checkpoint(FAMILY, CLASSIFY, num_labels=num_labels)
    pairs = list(zip(QUERIES, DOCUMENTS, strict=True))
    expected = TorchCrossEncoder(str(folder), device="cpu").predict(pairs)
    got = mlx_encoders.CrossEncoder(folder).predict(pairs)
    np.testing.assert_allclose(got, expected, atol=1e-5)

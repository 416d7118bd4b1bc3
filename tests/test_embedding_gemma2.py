"""EmbeddingGemma 2, text only, against transformers and sentence-transformers.

Tiny seeded checkpoints (tests/checkpoints.py) of the text model alone (`embedding_gemma2_text`) and of the
multimodal model without its towers (`embedding_gemma2`): global layers with their own head size, per-layer
inputs, a window of radius 4 and an output projection past the hidden size. Images, audio and video are refused.
"""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
import torch
from checkpoints import load_reference
from safetensors.numpy import load_file, save_file
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import Normalize, Transformer
from sentence_transformers.sentence_transformer.modules import Pooling
from test_gemma3_text import LONG, cosines
from test_gradients import our_gradients, reference_gradients
from test_numerics import force_branch
from test_parity import as_torch, check_parity, our_outputs, rewrite_config
from tolerance import assert_float32_close

import mlx_encoders
from mlx_encoders import SentenceEncoder
from mlx_encoders.conversion import convert
from mlx_encoders.quantization import dequantize_model

MODEL_TYPES = ["embedding_gemma2_text", "embedding_gemma2"]
TEXTS = ["", "word", "The quick brown fox jumps over the lazy dog.", LONG]
PROMPTS = {"query": "task: search result | query: ", "document": "title: none | text: "}
WIDTH = 40  # embedding_dim


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_matches_transformers(checkpoint, model_type):
    check_parity(checkpoint(model_type), "encoder")


def test_config_without_per_layer_config(checkpoint, tmp_path):
    """`global_head_dim` / `num_global_key_value_heads` and `sliding_window_pattern`, as transformers reads them
    when config.json has no `per_layer_config` or `layer_types` (the last layer is global whatever they say)."""

    def legacy(config):
        del config["per_layer_config"], config["layer_types"]
        config.update(global_head_dim=24, num_global_key_value_heads=1, sliding_window_pattern=5)

    folder = rewrite_config(checkpoint("embedding_gemma2_text"), tmp_path, legacy)
    check_parity(folder, "encoder")
    assert mlx_encoders.load_model(folder).args.attention_types[-1] == "full_attention"


def test_config_errors_name_the_key():
    from mlx_encoders.models.embedding_gemma2 import ModelArgs

    with pytest.raises(ValueError, match="'per_layer_config': layer 1 sets intermediate_size; only head_dim"):
        ModelArgs.from_dict({"num_hidden_layers": 2, "per_layer_config": {"1": {"intermediate_size": 8}}})
    with pytest.raises(ValueError, match="layer 0: num_attention_heads \\(4\\) must be a multiple of its"):
        ModelArgs.from_dict({"num_hidden_layers": 2, "per_layer_config": {"0": {"num_key_value_heads": 3}}})
    with pytest.raises(ValueError, match="rope_type 'yarn' is not supported"):
        ModelArgs.from_dict({"rope_parameters": {"sliding_attention": {"rope_type": "yarn"}}})
    with pytest.raises(ValueError, match="'text_config' must be an object"):
        ModelArgs.from_dict({"model_type": "embedding_gemma2", "text_config": [1]})


@pytest.mark.parametrize("model_type,branch", [("embedding_gemma2_text", "cpu"), ("embedding_gemma2", "gpu")])
def test_gradients_match_transformers(checkpoint, monkeypatch, model_type, branch):
    """Loss and every parameter's gradient (the stored `layer_scalar` is a buffer: not trained, as in
    transformers), over a batch whose long text takes the banded sliding attention. The scores are unscaled products
    of normed queries and keys, which magnify float32 rounding (torch's own float32 layer is 1e-5 off its float64
    one here), hence 1e-4 on the loss too."""
    force_branch(monkeypatch, branch)
    folder = checkpoint(model_type)
    model, tokenizer = mlx_encoders.load(folder)
    batch = dict(tokenizer(TEXTS, padding=True))
    real = np.array(batch["attention_mask"], np.float32)[..., None]
    projection = np.random.default_rng(0).standard_normal((*real.shape[:2], WIDTH)).astype(np.float32)
    labels = {"projection": projection * real}  # a fixed random projection of the (B, L, embedding_dim) outputs
    expected_loss, expected, _ = reference_gradients(folder, "encoder", batch, labels)
    loss, grads = our_gradients(model, batch, labels)
    assert abs(loss - expected_loss) <= 1e-4 * abs(expected_loss), (loss, expected_loss)
    assert set(grads) == set(expected)
    scale = max(float(np.abs(g).max()) for g in expected.values())
    for name, g in grads.items():
        err = float(np.abs(g - expected[name]).max())
        assert err <= 1e-4 * scale, f"{name}: max abs error {err:.3g} > 1e-4 x largest gradient {scale:.3g}"


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_padded_batch_equals_one_by_one(checkpoint, model_type):
    model, tokenizer = mlx_encoders.load(checkpoint(model_type))
    batch = tokenizer(TEXTS, padding=True)
    together = our_outputs(model(**batch))["last_hidden_state"]
    for i, text in enumerate(TEXTS):
        alone = our_outputs(model(**tokenizer([text])))["last_hidden_state"][0]
        assert_float32_close(together[i, : len(alone)], alone, terms=4 * 128, err_msg=f"text {i}")


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_save_reloads_in_transformers(checkpoint, tmp_path, model_type):
    """transformers reads what `save` writes (the multimodal layout nested under text_config, without towers)."""
    folder = checkpoint(model_type)
    model, tokenizer = mlx_encoders.load(folder)
    mlx_encoders.save(model, tmp_path / "saved", tokenizer)
    batch = as_torch(tokenizer(TEXTS, padding=True))
    with torch.no_grad():
        before, after = (load_reference(f, "encoder")(**batch).last_hidden_state for f in (folder, tmp_path / "saved"))
    np.testing.assert_array_equal(after.numpy(), before.numpy())
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["model_type"] == model_type and saved.get("vision_config") is None


def test_multimodal_inputs_and_towers(checkpoint, tmp_path):
    """The towers' weights are left out; images, audio and video, and their placeholder tokens, are refused."""
    folder = shutil.copytree(checkpoint("embedding_gemma2"), tmp_path / "with-towers")
    weights = load_file(folder / "model.safetensors")
    weights["vision_tower.encoder.weight"] = np.ones((2, 2), np.float32)
    weights["embed_audio.embedding_projection.weight"] = np.ones((2, 2), np.float32)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    model, tokenizer = mlx_encoders.load(folder)
    batch = tokenizer(["a text"])
    with torch.no_grad():
        expected = load_reference(checkpoint("embedding_gemma2"), "encoder")(**as_torch(batch)).last_hidden_state
    np.testing.assert_allclose(np.array(model(**batch).last_hidden_state), expected.numpy(), atol=1e-4)
    for name in ("pixel_values", "pixel_values_videos", "input_features"):
        with pytest.raises(ValueError, match=f"{name}: EmbeddingGemma 2 runs on text only here; images, audio"):
            model(**batch, **{name: mx.zeros((1, 3))})
    ids = mx.array([[2, model.args.image_token_id, 1]])
    with pytest.raises(ValueError, match="input_ids holds 258880, the image placeholder token"):
        model(ids)


@pytest.fixture(scope="module")
def st_folder(checkpoint, tmp_path_factory):
    """sentence-transformers over the text model, as EmbeddingGemma 2 is meant to be wrapped: mean pooling and
    Normalize (its projection is inside the model), with prompts."""
    folder = tmp_path_factory.mktemp("embeddinggemma2")
    modules = [Transformer(str(checkpoint("embedding_gemma2_text"))), Pooling(WIDTH, pooling_mode="mean"), Normalize()]
    SentenceTransformer(modules=modules, device="cpu", prompts=PROMPTS).save(str(folder))
    return folder


def test_sentence_transformers_folder(st_folder, one_torch_thread):
    st, ours = SentenceTransformer(str(st_folder), device="cpu"), SentenceEncoder(st_folder)
    assert ours.get_embedding_dimension() == WIDTH
    texts = [*TEXTS, "a cat", "x " * 40]
    for method, kwargs in [("encode", {}), ("encode_query", {}), ("encode_document", {"truncate_dim": 16})]:
        expected = getattr(st, method)(texts, batch_size=3, convert_to_numpy=True, **kwargs)
        got = getattr(ours, method)(texts, batch_size=3, **kwargs)
        assert got.shape == expected.shape == (len(texts), kwargs.get("truncate_dim", WIDTH)), method
        assert cosines(got, expected).min() >= 0.99999, (method, kwargs)
        np.testing.assert_allclose(got, expected, atol=1e-5, err_msg=f"{method} {kwargs}")


@pytest.mark.parametrize("bits,min_cosine", [(8, 0.99), (4, 0.75)])
def test_convert_quantized_loads_and_runs(st_folder, tmp_path, bits, min_cosine):
    """`convert` at 8 and 4 bits: the quantized model computes what its dequantized weights give in float32, and
    stays near the float model (the random model's unscaled, peaked attention magnifies the weights' rounding)."""
    out = tmp_path / f"q{bits}"
    convert(st_folder, out, bits=bits, group_size=32, calibration=[LONG, *PROMPTS.values()])
    quantized = SentenceEncoder(out)
    assert "scales" in dict(quantized.model.layers[2].self_attn.k_proj.items())  # a global layer's own width
    texts = TEXTS[1:] + ["quantized embeddings of a Gemma model"]
    got = quantized.encode(texts)
    dequantize_model(quantized.model)
    assert cosines(got, quantized.encode(texts)).min() >= 0.99999
    assert cosines(got, SentenceEncoder(st_folder).encode(texts)).min() >= min_cosine


def test_serve_index_and_lora_fine_tune(st_folder, tmp_path):
    from test_contrastive import TRIPLETS
    from test_serve import call, in_process

    from mlx_encoders import serve
    from mlx_encoders.index import build, search
    from mlx_encoders.train import fine_tune

    texts = TEXTS[1:3]
    with in_process(serve.app({"eg2": st_folder})) as url:
        status, answer, _ = call(url, "/v1/embeddings", {"model": "eg2", "input": texts})
    assert status == 200, answer
    assert_float32_close([d["embedding"] for d in answer["data"]], SentenceEncoder(st_folder).encode(texts), 4 * 128)

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    documents = ["Cats purr when content.", "Ferns grow in the shade."]
    (corpus / "notes.txt").write_text("\n\n".join(documents) + "\n")
    encoder = SentenceEncoder(st_folder)
    assert build(corpus, tmp_path / "index", encoder, quiet=True)["added"] == 2
    oracle = SentenceTransformer(str(st_folder), device="cpu")
    scores = oracle.encode_document(documents) @ oracle.encode_query("Where do ferns grow?")
    hits = search(tmp_path / "index", "Where do ferns grow?", k=2, model=encoder)
    np.testing.assert_allclose([h.score for h in hits], np.sort(scores)[::-1], atol=1e-5)

    trained = fine_tune("embed", TRIPLETS, tmp_path / "out", model=st_folder, max_steps=2, batch_size=3,
                        lora_rank=2, lr=1e-2)  # fmt: skip
    adapted = json.loads((tmp_path / "out" / "adapters" / "adapter_config.json").read_text())["targets"]
    assert adapted == ["q_proj", "k_proj", "v_proj"]
    probe = ["how do cats sleep", "python"]
    expected = SentenceTransformer(str(trained.path), device="cpu").encode(probe, convert_to_numpy=True)
    np.testing.assert_allclose(SentenceEncoder(trained.path).encode(probe), expected, atol=1e-5)
    assert not np.allclose(encoder.encode(probe), expected, atol=1e-4)


def test_multimodal_checkpoint_in_a_sentence_transformers_folder(checkpoint, st_folder, tmp_path):
    """The multimodal checkpoint with Pooling and Normalize modules embeds as the same text model saved alone
    (both are built from one seed): its sentence-transformers oracle is the text model's folder."""
    folder = shutil.copytree(checkpoint("embedding_gemma2"), tmp_path / "multimodal")
    for name in ("modules.json", "config_sentence_transformers.json", "1_Pooling", "2_Normalize"):
        copy = shutil.copytree if (st_folder / name).is_dir() else shutil.copy
        copy(st_folder / name, folder / name)
    texts = [*TEXTS, "a cat"]
    ours = SentenceEncoder(folder)
    assert type(ours.model).__name__ == "EmbeddingGemma2Model"
    expected = SentenceTransformer(str(st_folder), device="cpu").encode_query(texts, convert_to_numpy=True)
    np.testing.assert_allclose(ours.encode_query(texts), expected, atol=1e-5)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_gradient_checkpointing_keeps_gradients(checkpoint, model_type):
    """Each layer run through mx.checkpoint (its per-layer input and its masks passed in) gives the same gradients."""
    model, tokenizer = mlx_encoders.load(checkpoint(model_type))
    batch = dict(tokenizer(TEXTS, padding=True))
    projection = np.random.default_rng(1).standard_normal((*batch["input_ids"].shape, WIDTH)).astype(np.float32)
    labels = {"projection": projection * np.array(batch["attention_mask"], np.float32)[..., None]}
    loss, grads = our_gradients(model, batch, labels)
    model.gradient_checkpointing_enable()
    checkpointed_loss, checkpointed = our_gradients(model, batch, labels)
    assert checkpointed_loss == loss
    for name, g in grads.items():
        np.testing.assert_allclose(checkpointed[name], g, rtol=1e-6, atol=1e-6 * float(np.abs(g).max()), err_msg=name)


def test_long_input_takes_the_blockwise_and_banded_paths_and_matches_transformers(checkpoint):
    """Past BLOCKWISE_FROM tokens the global layers attend a block of queries at a time and the sliding ones their
    band only (EmbeddingGemma 2 reads long documents); the result is transformers'."""
    from mlx_encoders.engine.attention import BLOCKWISE_FROM

    folder = checkpoint("embedding_gemma2_text")
    model = mlx_encoders.load_model(folder)
    ids = np.random.default_rng(0).integers(5, model.args.vocab_size, (1, BLOCKWISE_FROM + 100))
    with torch.no_grad():
        expected = load_reference(folder, "encoder")(input_ids=torch.tensor(ids)).last_hidden_state.numpy()
    got = np.array(model(mx.array(ids)).last_hidden_state)
    assert np.abs(got - expected).max() <= 1e-4 * np.abs(expected).max()


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_left_padded_batch_equals_transformers_and_one_by_one(checkpoint, model_type):
    from test_gemma3_text import assert_shifted_close, left_padded

    folder = checkpoint(model_type)
    model, tokenizer = mlx_encoders.load(folder)
    batch = left_padded(tokenizer, TEXTS)
    real = np.array(batch["attention_mask"]).astype(bool)
    with torch.no_grad():
        expected = load_reference(folder, "encoder")(**as_torch(batch)).last_hidden_state.numpy()
    ours = np.array(model(**batch).last_hidden_state)
    assert_float32_close(ours[real], expected[real], terms=4 * 128)
    for i, text in enumerate(TEXTS):
        alone = np.array(model(**tokenizer([text])).last_hidden_state)[0]
        assert_shifted_close(ours[i][real[i]], alone, f"text {i}")

"""Gemma 3's text model (EmbeddingGemma-300m's architecture) against transformers and sentence-transformers.

A tiny seeded checkpoint (tests/checkpoints.py: grouped-query, bidirectional, a window of 8 that 128-token texts
span many times over) gives transformers' outputs and gradients for the encoder and its classification head, with
causal attention too; a sentence-transformers folder laid out as EmbeddingGemma's (mean pooling, Dense up and down,
Normalize, its task prompts, Gemma's left padding) gives `SentenceTransformer.encode`'s embeddings.
"""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
import torch
from checkpoints import load_reference
from mlx.utils import tree_flatten
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import Dense, Normalize, Transformer
from sentence_transformers.sentence_transformer.modules import Pooling
from test_gradients import make_labels, our_gradients, reference_gradients
from test_numerics import force_branch
from test_parity import as_torch, check_parity, our_outputs, rewrite_config
from tolerance import assert_float32_close

import mlx_encoders
from mlx_encoders import SentenceEncoder
from mlx_encoders.conversion import convert
from mlx_encoders.models import model_module

TASKS = list(model_module("gemma3_text").MODELS)
CAUSAL = dict(use_bidirectional_attention=False)
LONG = " ".join(["Gemma reads the whole text at once, both ways, in windows of a few tokens."] * 12)
TEXTS = ["", "word", "The quick brown fox jumps over the lazy dog.", LONG]
# EmbeddingGemma's task prompts (config_sentence_transformers.json of google/embeddinggemma-300m), a few of them.
PROMPTS = {
    "query": "task: search result | query: ",
    "document": "title: none | text: ",
    "Retrieval-query": "task: search result | query: ",
    "Retrieval-document": "title: none | text: ",
    "STS": "task: sentence similarity | query: ",
    "Clustering": "task: clustering | query: ",
}


@pytest.mark.parametrize("attention", [{}, CAUSAL], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("task", TASKS)
def test_matches_transformers(checkpoint, task, attention):
    check_parity(checkpoint("gemma3_text", task, **attention), task)


def test_a_bidirectional_window_of_one_saved_as_zero_matches_transformers(checkpoint):
    """transformers writes a bidirectional window of 1 (each token attends to itself alone) as "sliding_window": 0."""
    folder = checkpoint("gemma3_text", "encoder", sliding_window=1)
    assert json.loads((folder / "config.json").read_text())["sliding_window"] == 0
    check_parity(folder, "encoder")
    with pytest.raises(ValueError, match="'sliding_window' must be an integer of at least 1: .* got 0"):
        model_module("gemma3_text").ModelArgs.from_dict({"sliding_window": 0, **CAUSAL})


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_rms_norm_in_half_precision_rounds_as_transformers(dtype):
    """1 + weight is taken in float32 and the product rounded once: rounded to half precision first, the norm's
    error was twice transformers'."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm as Reference

    from mlx_encoders.models.gemma3_text import Gemma3RMSNorm

    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 768)).astype(np.float32)
    weight = (rng.standard_normal(768) * 0.05).astype(np.float32)
    exact = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * (1 + weight.astype(np.float64))
    reference = Reference(768, eps=1e-6)
    reference.weight.data = torch.tensor(weight).to(getattr(torch, dtype))
    with torch.no_grad():
        theirs = reference(torch.tensor(x).to(getattr(torch, dtype))).float().numpy()
    ours = Gemma3RMSNorm(768, 1e-6)
    ours.weight = mx.array(weight).astype(getattr(mx, dtype))
    got = np.array(ours(mx.array(x).astype(getattr(mx, dtype))).astype(mx.float32))
    assert ours(mx.array(x).astype(getattr(mx, dtype))).dtype == getattr(mx, dtype)
    assert np.abs(got - exact).max() <= 1.05 * np.abs(theirs - exact).max()


def test_hub_config_spelling(checkpoint, tmp_path):
    """EmbeddingGemma's config.json on the Hub: `rope_theta`, `rope_local_base_freq` and `sliding_window_pattern`
    (every n-th layer global) instead of `layer_types` and `rope_parameters`."""

    def legacy(config):
        del config["layer_types"], config["rope_parameters"]
        config.update(sliding_window_pattern=2, rope_theta=1000.0, rope_local_base_freq=50.0)

    check_parity(rewrite_config(checkpoint("gemma3_text"), tmp_path, legacy), "encoder")


def test_linear_rope_scaling_on_the_global_layers(checkpoint):
    rope = {
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
    }
    check_parity(checkpoint("gemma3_text", rope_parameters=rope), "encoder")


def test_a_legacy_rope_scaling_beside_rope_parameters_wins_as_in_transformers(checkpoint, tmp_path):
    """A `rope_scaling` added to a transformers 5 config (as model cards say to) updates the global layers' entry."""
    folder = shutil.copytree(checkpoint("gemma3_text"), tmp_path / "scaled")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}))
    assert (
        model_module("gemma3_text")
        .ModelArgs.from_dict(json.loads((folder / "config.json").read_text()))
        .rope["full_attention"][1]
        == 0.25
    )
    check_parity(folder, "encoder")


def test_config_errors_name_the_key():
    args = model_module("gemma3_text").ModelArgs
    with pytest.raises(ValueError, match="'attn_logit_softcapping' is 50.0: soft-capped"):
        args.from_dict({"attn_logit_softcapping": 50.0})
    with pytest.raises(ValueError, match="'num_attention_heads' \\(8\\) must be a multiple of 'num_key_value_heads'"):
        args.from_dict({"num_key_value_heads": 3})
    with pytest.raises(ValueError, match="rope_type 'yarn' is not supported"):
        args.from_dict({"rope_parameters": {"full_attention": {"rope_type": "yarn"}}})
    with pytest.raises(ValueError, match="'layer_types' must list one of"):
        args.from_dict({"num_hidden_layers": 2, "layer_types": ["full_attention"]})


# Gemma 2's configs cap the causal-LM logits at 30; this tiny model's logits are a few units, so a smaller cap
# puts them on tanh's curve.
SOFTCAP = 2.0


def test_causal_lm_final_logit_softcapping(checkpoint):
    """Gemma3ForCausalLM's logits capped by cap * tanh(logits / cap), as transformers; the cap changes them."""
    folder = checkpoint("gemma3_text", "causal-lm", final_logit_softcapping=SOFTCAP, **CAUSAL)
    check_parity(folder, "causal-lm")
    model, tokenizer = mlx_encoders.load(folder)
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.args.final_logit_softcapping == SOFTCAP
    batch = tokenizer(TEXTS, padding=True)
    capped = np.array(model(**batch).logits)
    model.args.final_logit_softcapping = None
    uncapped = np.array(model(**batch).logits)
    assert np.abs(capped).max() <= SOFTCAP < np.abs(uncapped).max()
    np.testing.assert_allclose(capped, SOFTCAP * np.tanh(uncapped / SOFTCAP), rtol=1e-5, atol=1e-7)


# Both attention kernels (engine.attention's written-out form, and MLX's fused one) on each head and attention.
GRADIENT_CASES = [
    ("encoder", {}, "cpu"), ("encoder", CAUSAL, "gpu"),
    ("sequence-classification", {}, "gpu"), ("sequence-classification", CAUSAL, "cpu"),
    ("causal-lm", CAUSAL, "gpu"), ("causal-lm", {**CAUSAL, "final_logit_softcapping": SOFTCAP}, "cpu"),
]  # fmt: skip


@pytest.mark.parametrize("task,attention,branch", GRADIENT_CASES)
def test_gradients_match_transformers(checkpoint, monkeypatch, task, attention, branch):
    """Loss and every parameter's gradient, over a batch whose long text takes the banded sliding attention."""
    force_branch(monkeypatch, branch)
    folder = checkpoint("gemma3_text", task, **attention)
    model, tokenizer = mlx_encoders.load(folder)
    batch = dict(tokenizer(TEXTS, padding=True))
    assert batch["input_ids"].shape[1] > 3 * (model.args.sliding_window // 2)  # the banded form runs
    labels = make_labels(task, model.args, batch)
    expected_loss, expected, _ = reference_gradients(folder, task, batch, labels)
    loss, grads = our_gradients(model, batch, labels)
    assert abs(loss - expected_loss) <= 1e-5 * abs(expected_loss), (loss, expected_loss)
    assert set(grads) == set(expected) - {"lm_head.weight"}
    scale = max(float(np.abs(g).max()) for g in expected.values())
    for name, g in grads.items():
        err = float(np.abs(g - expected[name]).max())
        assert err <= 1e-4 * scale, f"{name}: max abs error {err:.3g} > 1e-4 x largest gradient {scale:.3g}"


@pytest.mark.parametrize("task", TASKS)
def test_padded_batch_equals_one_by_one(checkpoint, task):
    model, tokenizer = mlx_encoders.load(checkpoint("gemma3_text", task))
    batch = tokenizer(TEXTS, padding=True)
    together = our_outputs(model(**batch))
    for i, text in enumerate(TEXTS):
        alone = our_outputs(model(**tokenizer([text])))
        n = int(batch["attention_mask"][i].sum())
        for name, value in alone.items():
            mine = together[name][i, :n] if value.ndim == 3 else together[name][i]  # per token: its real ones
            assert_float32_close(mine, value[0], terms=4 * 128, err_msg=f"text {i}, {name}")


@pytest.mark.parametrize("task", TASKS)
def test_save_reloads_in_transformers(checkpoint, tmp_path, task):
    """transformers reads what `save` writes into the model it was loaded from: identical outputs."""
    folder = checkpoint("gemma3_text", task)
    model, tokenizer = mlx_encoders.load(folder)
    mlx_encoders.save(model, tmp_path / "saved", tokenizer)
    batch = as_torch(tokenizer(TEXTS, padding=True))
    with torch.no_grad():
        before, after = (load_reference(f, task)(**batch) for f in (folder, tmp_path / "saved"))
    name = "logits" if task != "encoder" else "last_hidden_state"
    np.testing.assert_array_equal(after[name].numpy(), before[name].numpy())
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["sliding_window"] == model.args.sliding_window


@pytest.fixture(scope="module")
def embeddinggemma(checkpoint, tmp_path_factory):
    """A sentence-transformers folder as google/embeddinggemma-300m lays it out, saved by sentence-transformers:
    mean pooling, Dense 32 -> 64 -> 32 without bias or activation, Normalize, its prompts, cosine similarity."""
    folder = tmp_path_factory.mktemp("embeddinggemma")
    modules = [
        Transformer(str(checkpoint("gemma3_text"))),
        Pooling(32, pooling_mode="mean"),
        Dense(32, 64, bias=False, activation_function=torch.nn.Identity()),
        Dense(64, 32, bias=False, activation_function=torch.nn.Identity()),
        Normalize(),
    ]
    st = SentenceTransformer(modules=modules, device="cpu", prompts=PROMPTS, similarity_fn_name="cosine")
    st.save(str(folder))
    return folder


def cosines(a, b):
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def test_embeddinggemma_folder_matches_sentence_transformers(embeddinggemma, one_torch_thread):
    modules = [m["type"].rsplit(".", 1)[-1] for m in json.loads((embeddinggemma / "modules.json").read_text())]
    assert modules == ["Transformer", "Pooling", "Dense", "Dense", "Normalize"]
    st, ours = SentenceTransformer(str(embeddinggemma), device="cpu"), SentenceEncoder(embeddinggemma)
    assert st.tokenizer.padding_side == "left"  # Gemma's: sentence-transformers pads on the left, we on the right
    texts = [*TEXTS, "a cat", "Embeddings of queries and documents", "x " * 40]
    calls = [
        ("encode", {}), ("encode_query", {}), ("encode_document", {}), ("encode", {"prompt_name": "STS"}),
        ("encode_query", {"truncate_dim": 16}), ("encode_document", {"prompt_name": "Retrieval-document"}),
    ]  # fmt: skip
    for method, kwargs in calls:
        expected = getattr(st, method)(texts, batch_size=3, convert_to_numpy=True, **kwargs)
        got = getattr(ours, method)(texts, batch_size=3, **kwargs)
        assert got.shape == expected.shape == (len(texts), kwargs.get("truncate_dim", 32)), method
        assert cosines(got, expected).min() >= 0.99999, (method, kwargs)
        np.testing.assert_allclose(got, expected, atol=1e-5, err_msg=f"{method} {kwargs}")
    assert ours.encode_query("a") @ ours.encode_query("a") == pytest.approx(1.0, abs=1e-6)  # Normalize ran


@pytest.mark.parametrize("bits,min_cosine", [(8, 0.9995), (4, 0.9)])
def test_convert_quantized_loads_and_runs(embeddinggemma, tmp_path, bits, min_cosine):
    """`convert` (GPTQ) at 8 and 4 bits, in groups of 32 (the tiny widths), keeps the sentence-transformers
    folder, and embeddings near the float ones (a random 32-wide model loses more than real ones do)."""
    out = tmp_path / f"q{bits}"
    convert(embeddinggemma, out, bits=bits, group_size=32, calibration=[LONG, *PROMPTS.values()])
    quantized = SentenceEncoder(out)
    assert "scales" in dict(quantized.model.layers[0].self_attn.q_proj.items())
    texts = TEXTS[1:] + ["quantized embeddings of a Gemma model"]
    floats = SentenceEncoder(embeddinggemma).encode(texts)
    assert cosines(quantized.encode(texts), floats).min() >= min_cosine


def test_serve_and_index_use_the_folder(embeddinggemma, tmp_path):
    from test_serve import call, in_process

    from mlx_encoders import serve
    from mlx_encoders.index import build, search

    texts = TEXTS[1:]  # the server refuses empty strings
    expected = SentenceEncoder(embeddinggemma).encode(texts)
    with in_process(serve.app({"gemma": embeddinggemma})) as url:
        status, answer, _ = call(url, "/v1/embeddings", {"model": "gemma", "input": texts, "truncate": True})
    assert status == 200, answer
    assert_float32_close([d["embedding"] for d in answer["data"]], expected, terms=4 * 128)

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    documents = ["Cats purr when content.", "Ferns grow in the shade."]
    (corpus / "notes.txt").write_text("\n\n".join(documents) + "\n")
    encoder = SentenceEncoder(embeddinggemma)
    assert build(corpus, tmp_path / "index", encoder, quiet=True)["added"] == 2
    # documents embedded with EmbeddingGemma's document prompt, the query with its query prompt
    oracle = SentenceTransformer(str(embeddinggemma), device="cpu")
    scores = oracle.encode_document(documents) @ oracle.encode_query("Where do ferns grow?")
    hits = search(tmp_path / "index", "Where do ferns grow?", k=2, model=encoder)
    assert [h.text for h in hits] == [documents[i] for i in np.argsort(-scores)]
    np.testing.assert_allclose([h.score for h in hits], np.sort(scores)[::-1], atol=1e-5)


def test_mnrl_loss_and_gradients_through_the_dense_modules_equal_sentence_transformers(embeddinggemma):
    """fine_tune('embed')'s pass over EmbeddingGemma's folder: mean pooling, both Dense modules (trained in full, as
    sentence-transformers trains them) and Normalize; MNRL's loss and gradients equal sentence-transformers'."""
    from sentence_transformers.sentence_transformer import losses as st_losses
    from test_contrastive import TRIPLET_COLUMNS, TRIPLETS, st_features

    from mlx_encoders.checkpoint import load_model, tokenizer_for
    from mlx_encoders.train import compiling
    from mlx_encoders.train.embedding import DenseModel, EmbeddingObjective, embedding_data
    from mlx_encoders.train.losses.contrastive import MultipleNegativesRankingLoss

    st = SentenceTransformer(str(embeddinggemma), device="cpu").eval()
    expected = st_losses.MultipleNegativesRankingLoss(st)(st_features(st, TRIPLETS, TRIPLET_COLUMNS), None)
    expected.backward()
    params = {f"model.{k}": p for k, p in st[0].auto_model.named_parameters()}
    params |= {f"dense.{i}.weight": st[2 + i].linear.weight for i in range(2)}

    net = DenseModel(
        load_model(embeddinggemma, task="encoder"), [embeddinggemma / "2_Dense", embeddinggemma / "3_Dense"]
    )
    tokenizer = tokenizer_for(net.args, embeddinggemma)
    objective = EmbeddingObjective(MultipleNegativesRankingLoss(), tokenizer, ("mean",), True, "batch_sampler")
    batch = objective.collate(embedding_data(TRIPLETS, tokenizer), range(len(TRIPLETS)))
    step = objective.value_and_grad(net, lambda fn: compiling.value_and_grad(net, mx.float32, fn), [mx.random.key(0)])
    value, grads = step(batch)
    assert value.item() == pytest.approx(expected.item(), rel=1e-5)
    grads = dict(tree_flatten(grads))
    assert set(grads) == set(params)
    for name, g in grads.items():
        reference = params[name].grad.numpy()
        err = float(np.abs(np.array(g) - reference).max())
        assert err <= 1e-4 * float(np.abs(reference).max()), name


def test_fine_tune_with_lora_trains_the_published_layout(embeddinggemma, tmp_path):
    """MNRL with LoRA on the q/k/v projections and the Dense modules trained in full, into a folder of the same
    layout that sentence-transformers reads."""
    from test_contrastive import TRIPLETS

    from mlx_encoders.train import fine_tune

    trained = fine_tune("embed", TRIPLETS, tmp_path / "out", model=embeddinggemma, max_steps=2, batch_size=3,
                        lora_rank=2, lr=1e-2)  # fmt: skip
    adapted = json.loads((tmp_path / "out" / "adapters" / "adapter_config.json").read_text())["targets"]
    assert adapted == ["q_proj", "k_proj", "v_proj"]
    modules = [m["type"].rsplit(".", 1)[-1] for m in json.loads((trained.path / "modules.json").read_text())]
    assert modules == ["Transformer", "Pooling", "Dense", "Dense", "Normalize"]
    assert json.loads((trained.path / "config_sentence_transformers.json").read_text())["prompts"]["STS"]
    texts = ["how do cats sleep", "python"]
    st = SentenceTransformer(str(trained.path), device="cpu")
    expected = st.encode_query(texts, convert_to_numpy=True)
    np.testing.assert_allclose(SentenceEncoder(trained.path).encode_query(texts), expected, atol=1e-5)
    start = SentenceTransformer(str(embeddinggemma), device="cpu")
    assert not np.allclose(st[3].linear.weight.detach().numpy(), start[3].linear.weight.detach().numpy())
    # adapters/ holds the transformer's adapters (and the Dense modules, which model/ holds): onto the base transformer
    from mlx_encoders.train.lora import load_adapters

    base = mlx_encoders.load_model(embeddinggemma)
    with pytest.warns(UserWarning, match=r"also holds the trained Dense modules \(dense.0.weight"):
        load_adapters(base, tmp_path / "out" / "adapters")
    ids = mx.array([[2, 10, 11, 12, 1]])
    expected = np.array(mlx_encoders.load_model(trained.path)(ids).last_hidden_state)
    np.testing.assert_allclose(
        np.array(base(ids).last_hidden_state), expected, rtol=0, atol=1e-5 * np.abs(expected).max()
    )


@pytest.mark.parametrize("task", TASKS)
def test_gradient_checkpointing_keeps_gradients(checkpoint, task):
    """Each layer run through mx.checkpoint (its masks passed in) gives the same gradients."""
    model, tokenizer = mlx_encoders.load(checkpoint("gemma3_text", task))
    batch = dict(tokenizer(TEXTS, padding=True))
    labels = make_labels(task, model.args, batch)
    loss, grads = our_gradients(model, batch, labels)
    model.gradient_checkpointing_enable()
    checkpointed_loss, checkpointed = our_gradients(model, batch, labels)
    assert checkpointed_loss == loss
    for name, g in grads.items():
        np.testing.assert_allclose(checkpointed[name], g, rtol=1e-6, atol=1e-6 * float(np.abs(g).max()), err_msg=name)


def assert_shifted_close(actual, desired, what: str) -> None:
    """Equal within 1e-4 of the largest |desired|: left padding moves a text's positions, and RoPE's float32 angles
    round differently at other positions (more than sums taken in another order do)."""
    err = float(np.abs(np.asarray(actual) - np.asarray(desired)).max())
    assert err <= 1e-4 * float(np.abs(desired).max()), f"{what}: max abs error {err:.3g}"


def left_padded(tokenizer, texts: list[str]) -> dict[str, mx.array]:
    """The batch as Gemma's tokenizer pads it for transformers: padding first, positions still counted from 0."""
    rows = [tokenizer([text])["input_ids"][0].tolist() for text in texts]
    width = max(len(r) for r in rows)
    ids = [[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows]
    mask = [[0] * (width - len(r)) + [1] * len(r) for r in rows]
    return {"input_ids": mx.array(ids), "attention_mask": mx.array(mask)}


@pytest.mark.parametrize("attention", [{}, CAUSAL], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("task", TASKS)
def test_left_padded_batch_equals_transformers_and_one_by_one(checkpoint, task, attention):
    folder = checkpoint("gemma3_text", task, **attention)
    model, tokenizer = mlx_encoders.load(folder)
    batch = left_padded(tokenizer, TEXTS)
    with torch.no_grad():
        theirs = load_reference(folder, task)(**as_torch(batch))
    ours = our_outputs(model(**batch))
    name = "last_hidden_state" if task == "encoder" else "logits"
    real = np.array(batch["attention_mask"]).astype(bool)
    expected = theirs[name].numpy()
    per_token = task in ("encoder", "causal-lm")
    got, expected = (ours[name][real], expected[real]) if per_token else (ours[name], expected)
    assert_float32_close(got, expected, terms=4 * 128)
    for i, text in enumerate(TEXTS):
        alone = our_outputs(model(**tokenizer([text])))[name][0]
        mine = ours[name][i][real[i]] if per_token else ours[name][i]
        assert_shifted_close(mine, alone, f"text {i}")


def test_generation_refuses_the_causal_lm_head(checkpoint):
    """generation's loop needs a key/value cache, which only GPT-2 has here: the error says so."""
    model, tokenizer = mlx_encoders.load(checkpoint("gemma3_text", "causal-lm", **CAUSAL))
    refusal = "Gemma3ForCausalLM has a causal-LM head but no key/value cache, .* its next-token logits$"
    with pytest.raises(ValueError, match=refusal):  # and no Qwen3-Reranker hint for a Gemma model
        mlx_encoders.generation.generate(model, tokenizer, "word", max_new_tokens=2)
    with pytest.raises(ValueError, match=refusal):  # when the pipeline is built, not at its first call
        mlx_encoders.pipeline("text-generation", model=model, tokenizer=tokenizer)
    # and the pipelines' refusal does not send it to text generation
    with pytest.raises(ValueError, match="supports next-token logits only, no text generation. Use"):
        mlx_encoders.pipeline("text-classification", model=model, tokenizer=tokenizer)

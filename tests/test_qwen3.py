"""Qwen3 as its authors publish it: Qwen3-Embedding (a decoder used as an encoder: last-token pooling over left-padded
batches, an `<|endoftext|>` the tokenizer appends, the `Instruct: ...\\nQuery:` prompt, Matryoshka truncate_dim)
against sentence-transformers, and Qwen3-Reranker (the yes/no logits of the causal-LM head) against its
`CrossEncoder` with `LogitScore`. Every head's parity with transformers is in the registry-wide tests
(test_parity, test_gradients, test_numerics); the config spellings and save -> transformers are here."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import sentence_transformers as st
import torch
import transformers
from checkpoints import load_reference, qwen3_tokenizer
from sentence_transformers import CrossEncoder, SentenceTransformer
from sentence_transformers.base.modules import Normalize, Transformer
from sentence_transformers.cross_encoder.modules import LogitScore
from sentence_transformers.sentence_transformer.modules import Pooling
from test_banded_attention import assert_linear_memory
from test_gradients import check_gradients
from test_numerics import force_branch
from test_parity import as_torch, assert_close, check_parity
from tolerance import assert_float32_close, encoder_terms

import mlx_encoders
from mlx_encoders import SentenceEncoder, pipeline
from mlx_encoders.__main__ import main
from mlx_encoders.conversion import convert
from mlx_encoders.engine import attention as kernels
from mlx_encoders.index import Index, build
from mlx_encoders.models import qwen3
from mlx_encoders.models.base import padding_mask
from mlx_encoders.serve.models import ServedModel
from mlx_encoders.train import fine_tune, task_loss
from mlx_encoders.train.data import collate, token_classification_data

pytestmark = pytest.mark.usefixtures("one_torch_thread")

QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
# Lengths from the end-of-text token alone to past max_seq_length, so batches mix padding and one text is cut.
TEXTS = [
    "A cat sat on the mat.",
    "",
    "Short.",
    "The quick brown fox jumps over the lazy dog, then runs far away into the forest near the river bank.",
    "x",
    "Pooling turns token vectors into one sentence vector " * 8,
    "MLX runs on Apple silicon and, through its CPU backend, on Linux too.",
]


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def published_embedding_folder(folder: Path, checkpoint: Path) -> Path:
    """Qwen3-Embedding's layout: saved by sentence-transformers, then written as the published folders are (the
    module types of sentence-transformers 3, the pooling as booleans, a max_seq_length, the causal-LM architecture
    name over the bare model's weights)."""
    transformer = Transformer(str(checkpoint))
    modules = [transformer, Pooling(transformer.get_embedding_dimension(), "lasttoken"), Normalize()]
    prompts = {"query": QUERY_PROMPT, "document": ""}
    SentenceTransformer(modules=modules, device="cpu", prompts=prompts).save(str(folder))
    names = ["Transformer", "Pooling", "Normalize"]
    listed = json.loads((folder / "modules.json").read_text())
    for module, name in zip(listed, names, strict=True):
        module["type"] = f"sentence_transformers.models.{name}"
    (folder / "modules.json").write_text(json.dumps(listed, indent=2))
    pooling = {"word_embedding_dimension": transformer.get_embedding_dimension(), "pooling_mode_lasttoken": True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({**pooling, "include_prompt": True}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 48, "do_lower_case": False}))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForCausalLM"]}))
    return folder


@pytest.fixture(scope="module")
def embedding_folder(checkpoint, tmp_path_factory) -> Path:
    return published_embedding_folder(tmp_path_factory.mktemp("qwen3-embedding"), checkpoint("qwen3"))


@pytest.mark.parametrize(
    "call, kwargs",
    [
        ("encode", {}),
        ("encode_query", {}),
        ("encode_document", {}),
        ("encode_query", dict(truncate_dim=16)),
        ("encode", dict(prompt="Instruct: Find code\nQuery:", normalize_embeddings=True)),
    ],
)
def test_sentence_encoder_matches_sentence_transformers(embedding_folder, call, kwargs):
    reference = SentenceTransformer(str(embedding_folder), device="cpu")
    assert reference.tokenizer.padding_side == "left"
    theirs = getattr(reference, call)(TEXTS, batch_size=3, convert_to_numpy=True, **kwargs)
    encoder = SentenceEncoder(embedding_folder)
    assert encoder.pooling == ("lasttoken",) and encoder.tokenizer.padding_side == "left"
    ours = getattr(encoder, call)(TEXTS, batch_size=3, **kwargs)
    assert ours.shape == theirs.shape == (len(TEXTS), kwargs.get("truncate_dim", 64))
    assert cosines(ours, theirs).min() >= 0.99999
    assert_float32_close(ours, theirs, encoder_terms(embedding_folder, TEXTS))


def test_a_chat_model_is_read_through_its_chat_template_as_sentence_transformers_6_reads_it(checkpoint, tmp_path):
    """A plain checkpoint with a chat template, and the folder sentence-transformers 6 saves of it (its
    modality_config lists "message"): each text a user message, a prompt a system message before it."""
    plain = shutil.copytree(checkpoint("qwen3", "causal-lm"), tmp_path / "plain")
    (plain / "chat_template.jinja").write_text(CHAT_ONLY)
    reference = SentenceTransformer(str(plain), device="cpu")
    reference.save(str(tmp_path / "st"))
    assert "message" in json.loads((tmp_path / "st" / "sentence_bert_config.json").read_text())["modality_config"]
    for folder in (plain, tmp_path / "st"):
        ours, theirs = SentenceEncoder(folder), SentenceTransformer(str(folder), device="cpu")
        for kwargs in ({}, {"prompt": "Represent the question"}):
            expected = theirs.encode(TEXTS, batch_size=3, **kwargs)
            assert_float32_close(ours.encode(TEXTS, batch_size=3, **kwargs), expected, encoder_terms(folder, TEXTS))


def test_a_chat_template_reading_the_task_gets_the_calls_role_as_sentence_transformers_6_gives_it(checkpoint, tmp_path):
    plain = shutil.copytree(checkpoint("qwen3", "causal-lm"), tmp_path / "plain")
    (plain / "chat_template.jinja").write_text("{% if task == 'query' %}Find: {% endif %}" + CHAT_ONLY)
    ours, theirs = SentenceEncoder(plain), SentenceTransformer(str(plain), device="cpu")
    for call in ("encode", "encode_query", "encode_document"):
        expected = getattr(theirs, call)(TEXTS, batch_size=3)
        assert_float32_close(getattr(ours, call)(TEXTS, batch_size=3), expected, encoder_terms(plain, TEXTS))
    assert not np.allclose(ours.encode_query(TEXTS[:1]), ours.encode_document(TEXTS[:1]))  # the task reached it


def test_prompt_and_end_of_text_reach_the_model(embedding_folder):
    """The query prompt changes the embedding, and every text ends with `<|endoftext|>` (the token pooled)."""
    encoder = SentenceEncoder(embedding_folder)
    assert all(e.ids[-1] == 0 for e in encoder.tokenize(TEXTS))  # truncation keeps the appended token
    queries, plain = encoder.encode_query(TEXTS[:2]), encoder.encode(TEXTS[:2])
    assert cosines(queries, plain).max() < 0.999


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batches_equal_one_by_one(embedding_folder, side):
    """Last-token embeddings of a mixed-length batch, on either padding side, equal each text alone."""
    encoder = SentenceEncoder(embedding_folder)
    encoder.tokenizer.padding_side = side
    batch = encoder.tokenizer.pad(encoder.tokenize(TEXTS[:3]))
    mask = np.array(batch["attention_mask"])
    assert (mask[:, 0 if side == "left" else -1] == 0).any()  # padded on that side
    together = encoder.encode(TEXTS, batch_size=len(TEXTS))
    alone = np.stack([encoder.encode([t], batch_size=1)[0] for t in TEXTS])
    assert_float32_close(together, alone, encoder_terms(embedding_folder, TEXTS))


def test_token_embeddings_are_each_text_s_own_tokens(embedding_folder):
    encoder = SentenceEncoder(embedding_folder)
    tokens = encoder.encode(TEXTS[:3], output_value="token_embeddings", batch_size=3)
    alone = [encoder.encode([t], output_value="token_embeddings")[0] for t in TEXTS[:3]]
    for ours, single in zip(tokens, alone, strict=True):
        assert ours.shape == single.shape
        assert_float32_close(np.array(ours), np.array(single), encoder_terms(embedding_folder, TEXTS))


def rewrite_config(folder: Path, tmp_path: Path, edit) -> Path:
    target = shutil.copytree(folder, tmp_path / "ckpt")
    config = json.loads((target / "config.json").read_text())
    edit(config)
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_transformers_4_rope_spelling(checkpoint, tmp_path):
    """Published config.json files predate transformers 5: `rope_theta` and `rope_scaling`, no `layer_types`."""

    def legacy(config):
        theta = config.pop("rope_parameters")["rope_theta"]
        del config["layer_types"]
        config.update(rope_theta=theta, rope_scaling=None)

    check_parity(rewrite_config(checkpoint("qwen3", "causal-lm"), tmp_path, legacy), "causal-lm")


@pytest.mark.parametrize(
    "overrides",
    [
        dict(tie_word_embeddings=True),  # Qwen3-Embedding/Reranker-0.6B and 4B
        dict(use_sliding_window=True, sliding_window=5, max_window_layers=1),
        dict(num_key_value_heads=4, attention_bias=False, hidden_act="gelu"),
    ],
    ids=["tied", "sliding-window", "no-grouping"],
)
def test_config_variants_match_transformers(checkpoint, overrides):
    check_parity(checkpoint("qwen3", "causal-lm", **overrides), "causal-lm")


@pytest.mark.parametrize(
    "edit, message",
    [
        (dict(num_key_value_heads=3), "'num_key_value_heads' \\(3\\) must divide num_attention_heads \\(4\\)"),
        (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope_type 'yarn' is not supported"),
        (dict(layer_types=["full_attention"]), "must list one of full_attention, sliding_attention for each of the 3"),
    ],
)
def test_configs_that_cannot_work_are_refused(checkpoint, tmp_path, edit, message):
    folder = rewrite_config(checkpoint("qwen3", "causal-lm"), tmp_path, lambda config: config.update(edit))
    with pytest.raises(ValueError, match=f"config.json: .*{message}"):
        mlx_encoders.load_model(folder)


def test_sequence_classifier_without_pad_token_reads_the_attention_mask(checkpoint, tmp_path):
    """transformers classifies one text at a time when config.json has no pad_token_id; a padded batch here (the
    pipeline's default) gives each text that answer, and a batch without a mask is refused by name."""
    folder = rewrite_config(
        checkpoint("qwen3", "sequence-classification"), tmp_path, lambda config: config.update(pad_token_id=None)
    )
    texts = TEXTS[:4]
    reference = load_reference(folder, "sequence-classification")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        expected = [reference(**tokenizer([t], return_tensors="pt")).logits[0].numpy() for t in texts]
    ours = pipeline("text-classification", model=folder, batch_size=4, top_k=None)
    got = ours(texts)
    scores = [{"LABEL_" + str(i): v for i, v in enumerate(np.exp(e) / np.exp(e).sum())} for e in expected]
    for row, want in zip(got, scores, strict=True):
        assert {r["label"]: r["score"] for r in row} == pytest.approx(want, rel=1e-4, abs=1e-6)
    model, tok = mlx_encoders.load(folder)
    batch = tok(texts, padding=True)
    del batch["attention_mask"]
    with pytest.raises(ValueError, match="no pad_token_id and no attention_mask was given"):
        model(**batch)


@pytest.mark.parametrize("task", ["causal-lm", "sequence-classification"])
def test_save_reloads_in_transformers(checkpoint, tmp_path, task):
    """transformers reads the saved folder back to the very logits of the original checkpoint."""
    source = checkpoint("qwen3", task, tie_word_embeddings=task == "causal-lm")
    model, tokenizer = mlx_encoders.load(source)
    folder = mlx_encoders.save(model, tmp_path / "saved", tokenizer)
    batch = tokenizer(TEXTS[:4], padding=True)
    with torch.no_grad():
        original, saved = (load_reference(f, task)(**as_torch(batch)).logits.numpy() for f in (source, folder))
    np.testing.assert_array_equal(saved, original)
    real = np.array(batch["attention_mask"]).astype(bool)
    assert_close({"logits": np.array(model(**batch).logits)}, {"logits": saved}, real, task)
    assert json.loads((folder / "config.json").read_text())["architectures"] == [
        {"causal-lm": "Qwen3ForCausalLM", "sequence-classification": "Qwen3ForSequenceClassification"}[task]
    ]


def test_presets_are_the_published_shapes():
    args = mlx_encoders.models.model_module("qwen3").ModelArgs.preset("0.6b")
    assert (args.hidden_size, args.num_hidden_layers, args.kv_heads, args.head_dim, args.theta) == (
        1024, 28, 8, 128, 1e6,
    )  # fmt: skip


# Qwen3-Reranker's input: its judging system turn, the instruction (a prompt, as a system message, or the default),
# the query and the document, then the assistant's empty thinking block; the answer token comes next.
RERANKER_TEMPLATE = """\
{%- set instruct = namespace(text="Given a web search query, retrieve relevant passages that answer the query") -%}
{%- for message in messages if message.role == "system" -%}
{%- set instruct.text = message.content -%}
{%- endfor -%}
<|im_start|>system
Judge whether the Document meets the requirements based on the Query and the Instruct provided. \
Note that the answer can only be "yes" or "no".<|im_end|>
<|im_start|>user
<Instruct>: {{ instruct.text }}
{% for message in messages if message.role == "query" %}<Query>: {{ message.content }}
{% endfor %}{% for message in messages if message.role == "document" %}<Document>: {{ message.content }}\
{% endfor %}<|im_end|>
<|im_start|>assistant
<think>

</think>

"""
PAIRS = [
    ("What is a cat?", "A cat is a small domesticated carnivorous mammal."),
    ("What is a cat?", "The stock market fell today."),
    ("", "An empty query."),
    ("Which planet is red?", "Mars, known for its reddish appearance, is often referred to as the Red Planet. " * 6),
]


@pytest.fixture(scope="module")
def reranker_checkpoint(checkpoint, tmp_path_factory) -> Path:
    """Qwen3-Reranker's transformers folder: a causal LM with tied embeddings, its tokenizer and chat template."""
    folder = shutil.copytree(
        checkpoint("qwen3", "causal-lm", tie_word_embeddings=True, max_position_embeddings=512),
        tmp_path_factory.mktemp("qwen3-reranker") / "hf",
    )
    qwen3_tokenizer(folder, embedding=False, max_length=512)
    (folder / "chat_template.jinja").write_text(RERANKER_TEMPLATE)
    return folder


@pytest.fixture(scope="module")
def reranker_folder(reranker_checkpoint, tmp_path_factory) -> Path:
    """The sentence-transformers folder: the Transformer (text generation, chat messages) and its LogitScore."""
    transformer = Transformer(str(reranker_checkpoint), transformer_task="text-generation")
    yes, no = transformer.tokenizer.convert_tokens_to_ids(["yes", "no"])
    prompts = {"web_search": "Given a web search query, retrieve relevant passages that answer the query",
               "code": "Given a question, find the code that answers it"}  # fmt: skip
    folder = tmp_path_factory.mktemp("qwen3-reranker") / "st"
    CrossEncoder(modules=[transformer, LogitScore(yes, no)], prompts=prompts, device="cpu").save(str(folder))
    return folder


def check_reranker(folder: Path, **kwargs):
    reference = st.CrossEncoder(str(folder), device="cpu", **kwargs)
    ours = mlx_encoders.CrossEncoder(folder, max_length=kwargs.get("max_length"))
    assert ours.num_labels == reference.num_labels == 1
    for options in ({}, dict(prompt_name="code"), dict(prompt="Find recipes"), dict(activation_fn=lambda x: x)):
        if "prompt_name" in options and "code" not in ours.prompts:
            continue
        theirs_options = {**options, "activation_fn": torch.nn.Identity()} if "activation_fn" in options else options
        theirs = reference.predict(PAIRS, batch_size=3, **theirs_options)
        mine = ours.predict(PAIRS, batch_size=3, **options)
        np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=1e-5 * np.abs(theirs).max(), err_msg=str(options))
    ranked = ours.rank(PAIRS[0][0], [d for _, d in PAIRS], return_documents=True)
    assert ranked == sorted(ranked, key=lambda r: -r["score"]) and len(ranked) == len(PAIRS)


def test_reranker_matches_sentence_transformers(reranker_folder):
    ours = mlx_encoders.CrossEncoder(reranker_folder)
    assert ours.chat_template is not None and ours.logit_score.false_token_id is not None
    check_reranker(reranker_folder)


def test_command_line_reranks_with_the_yes_no_logits(reranker_folder, capsys):
    query, documents = PAIRS[0][0], [d for _, d in PAIRS]
    expected = st.CrossEncoder(str(reranker_folder), device="cpu").rank(query, documents)
    assert main(["classify", "-m", str(reranker_folder), "--query", query, "--rerank", "--json", *documents]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [r["corpus_id"] for r in got] == [r["corpus_id"] for r in expected]
    want = [float(r["score"]) for r in expected]
    assert [r["score"] for r in got] == pytest.approx(want, rel=1e-4, abs=1e-5 * max(map(abs, want)))


def test_a_converted_reranker_keeps_its_chat_template(reranker_folder, tmp_path):
    """convert copies chat_template.jinja with the tokenizer's files: the scores, which are read after the
    template's assistant prefix, stay the source's."""
    converted = mlx_encoders.convert(reranker_folder, tmp_path / "converted")
    assert (converted / "chat_template.jinja").read_text() == (reranker_folder / "chat_template.jinja").read_text()
    expected = mlx_encoders.CrossEncoder(reranker_folder).predict(PAIRS)
    np.testing.assert_allclose(mlx_encoders.CrossEncoder(converted).predict(PAIRS), expected, rtol=1e-5, atol=1e-6)


def test_reranker_without_modules_json_scores_yes_against_no(reranker_checkpoint):
    """A bare Qwen3ForCausalLM folder: sentence-transformers scores it with the logits of "yes" and "no"."""
    check_reranker(reranker_checkpoint)


@pytest.mark.parametrize("ids", [{"true_token_id": 9999}, {"false_token_id": -9999}, {"false_token_id": "3"}])
def test_logit_score_ids_outside_the_vocabulary_are_refused(reranker_folder, tmp_path, ids):
    folder = shutil.copytree(reranker_folder, tmp_path / "st")
    config = folder / "1_LogitScore" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **ids}))
    with pytest.raises(ValueError, match=f"LogitScore module's {next(iter(ids))} must be a token id of the model's"):
        mlx_encoders.CrossEncoder(folder)


CHAT_ONLY = (  # a chat model's own template: system, user and assistant messages, nothing of a query or document
    "{% for m in messages %}{% if m.role in ['system', 'user', 'assistant'] %}<|im_start|>{{ m.role }}\n"
    "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
)


def test_a_chat_template_that_drops_the_pair_is_refused_as_sentence_transformers_refuses_it(
    reranker_checkpoint, tmp_path
):
    folder = shutil.copytree(reranker_checkpoint, tmp_path / "chat")
    (folder / "chat_template.jinja").write_text(CHAT_ONLY)
    with pytest.raises(ValueError, match=r"cannot carry a 'query'/'document' pair"):
        st.CrossEncoder(str(folder), device="cpu").predict(PAIRS[:1])
    with pytest.raises(
        ValueError, match=r"chat_template.jinja cannot carry a \(query, document\) pair \(the 'query' and"
    ):
        mlx_encoders.CrossEncoder(folder)


def test_a_chat_template_reranker_cut_at_the_left_matches_sentence_transformers(reranker_folder, tmp_path):
    folder = shutil.copytree(reranker_folder, tmp_path / "left")
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "truncation_side": "left"}))
    theirs = st.CrossEncoder(str(folder), device="cpu", max_length=40).predict(PAIRS)
    ours = mlx_encoders.CrossEncoder(folder, max_length=40).predict(PAIRS)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)


def test_truncated_pair_keeps_the_template_s_tail(reranker_folder):
    """Cut at max_length, a pair still ends with the assistant prefix the answer follows (sentence-transformers')."""
    ours = mlx_encoders.CrossEncoder(reranker_folder, max_length=200)
    tokens = ours.tokenize([PAIRS[-1]])[0]
    assert len(tokens.ids) == 200 and tokens.overflowing
    tail = ours.tokenizer.decode(tokens.ids[-30:], skip_special_tokens=False)
    assert tail.endswith("<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n"), tail
    check_reranker(reranker_folder, max_length=200)


def test_served_models_embed_and_rerank_as_sentence_transformers(embedding_folder, reranker_folder):
    """What `mlx-encoders serve` runs for /v1/embeddings and /v1/rerank: the served model's tokenization and batch."""
    embedder = ServedModel("qwen3-embedding", embedding_folder)
    assert embedder.kind == "dense" and embedder.prefix == ""
    vectors = embedder.embeddings(embedder.compute(embedder.tokenize(TEXTS, True)), dimensions=16)
    theirs = SentenceTransformer(str(embedding_folder), device="cpu").encode(
        TEXTS, truncate_dim=16, normalize_embeddings=True
    )
    assert cosines(vectors, theirs).min() >= 0.99999

    reranker = ServedModel("qwen3-reranker", reranker_folder)
    assert reranker.kind == "cross-encoder" and reranker.capabilities == ("rerank",)
    queries, documents = zip(*PAIRS, strict=True)
    scores = reranker.scores(reranker.compute(reranker.tokenize(list(queries), True, list(documents))))
    expected = st.CrossEncoder(str(reranker_folder), device="cpu").predict(PAIRS)
    np.testing.assert_allclose(scores, expected, rtol=1e-4, atol=1e-6)


def test_tei_routes_serve_the_logit_score_reranker(reranker_folder):
    """TEI's /info and /rerank (and Infinity's body on /rerank) answer for a reranker without a classification head;
    /predict, which it cannot serve, is TEI's 424."""
    from starlette.testclient import TestClient

    from mlx_encoders import serve

    queries, documents = zip(*PAIRS, strict=True)
    expected = st.CrossEncoder(str(reranker_folder), device="cpu").predict([(queries[0], d) for d in documents])
    with TestClient(serve.app({"qwen3-reranker": reranker_folder})) as client:
        info = client.get("/info").json()
        assert info["model_type"] == {"reranker": {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}}
        tei = client.post("/rerank", json={"query": queries[0], "texts": list(documents)}).json()
        np.testing.assert_allclose([r["score"] for r in sorted(tei, key=lambda r: r["index"])], expected, rtol=1e-4)
        body = {"query": queries[0], "documents": list(documents)}
        infinity = client.post("/rerank", json=body).json()["results"]
        assert [r["index"] for r in infinity] == [r["index"] for r in tei]
        answer = client.post("/predict", json={"inputs": "a text"})
        assert answer.status_code == 424 and answer.json()["error_type"] == "Backend", answer.text


def test_index_ranks_as_sentence_transformers_with_the_query_prompt(embedding_folder, tmp_path):
    corpus = [(f"doc{i}", text) for i, text in enumerate(TEXTS) if text]
    counts = build(corpus, tmp_path / "index", SentenceEncoder(embedding_folder), quiet=True)
    assert counts["documents"] == len(corpus)
    reference = SentenceTransformer(str(embedding_folder), device="cpu")
    query = "Which animal sat on the mat?"
    scores = reference.encode_document([t for _, t in corpus]) @ reference.encode_query(query)
    hits = Index(tmp_path / "index").search(query, k=len(corpus))
    assert [h.id for h in hits] == [corpus[i][0] for i in np.argsort(-scores, kind="stable")]
    np.testing.assert_allclose([h.score for h in hits], np.sort(scores)[::-1], atol=1e-5)


@pytest.mark.parametrize("bits, least", [(8, 0.999), (4, 0.9)])  # tiny random weights of std 0.2
def test_converted_embedder_loads_and_embeds(embedding_folder, tmp_path, bits, least):
    """convert's 8- and 4-bit folders keep the sentence-transformers modules and embed close to the float model."""
    out = convert(embedding_folder, tmp_path / f"q{bits}", bits=bits, group_size=32, calibration=False)
    quantized = SentenceEncoder(out)
    assert quantized.pooling == ("lasttoken",) and quantized.tokenizer.padding_side == "left"
    assert isinstance(quantized.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    theirs = SentenceTransformer(str(embedding_folder), device="cpu").encode(TEXTS)
    assert cosines(quantized.encode(TEXTS), theirs).min() >= least


def test_lora_fine_tune_with_mnrl_writes_a_folder_sentence_transformers_reads(embedding_folder, tmp_path):
    triplets = [
        {"anchor": "how do cats sleep", "positive": "Cats sleep curled up.", "negative": "Stocks fell today."},
        {"anchor": "python lists", "positive": "A list holds items in order.", "negative": "Snakes shed skin."},
        {"anchor": "red planet", "positive": "Mars looks red.", "negative": "The mat was blue."},
    ]
    trained = fine_tune("embed", triplets, tmp_path, model=embedding_folder, loss="mnrl", max_steps=1, batch_size=3,
                        lora_rank=2, lr=1e-2)  # fmt: skip
    assert (tmp_path / "adapters").is_dir()
    texts = ["how do cats sleep", "a much longer text about python, the programming language"]
    reference = SentenceTransformer(str(trained.path), device="cpu")
    assert reference.tokenizer.padding_side == "left"
    for kind in ("query", "document"):
        expected = getattr(reference, f"encode_{kind}")(texts)
        np.testing.assert_allclose(getattr(SentenceEncoder(trained.path), f"encode_{kind}")(texts), expected, atol=1e-5)
    start = SentenceTransformer(str(embedding_folder), device="cpu").encode(texts)
    assert not np.allclose(start, reference.encode(texts), atol=1e-4)


def test_causal_attention_by_blocks_matches_torch_with_padding_on_either_side():
    """17 queries in blocks of 5 (the last one partial), each block over the keys up to its end: outputs and the
    gradients of q, k and v equal torch's causal attention, left- and right-padded rows alike. The left-padded
    row's first queries see padding alone: they weigh their block's keys alike, transformers all keys, so they are
    left out (no output compared, no gradient taken from them)."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((3, 2, 17, 8)).astype(np.float32) * 3 for _ in range(3))
    keep = np.ones((3, 17), np.int32)
    keep[1, :6] = 0  # left padding: its first queries see no real key
    keep[2, 9:] = 0
    mask = np.array(padding_mask(mx.array(keep), mx.float32))
    future = np.array(kernels.future_keys(0, 17, mx.float32))
    cotangent = rng.standard_normal(q.shape).astype(np.float32)
    cotangent[1, :, :6] = 0  # queries that see no real key
    tensors = [torch.from_numpy(t).double().requires_grad_(True) for t in (q, k, v, mask)]
    expected = torch.nn.functional.scaled_dot_product_attention(
        *tensors[:3], attn_mask=torch.minimum(tensors[3], torch.from_numpy(future).double())
    )
    (expected * torch.from_numpy(cotangent).double()).sum().backward()

    def loss(*arrays):
        out = kernels.attention_by_blocks(*arrays, scale=8**-0.5, block=5, causal=True)
        return (out * mx.array(cotangent)).sum(), out

    (_, got), grads = mx.value_and_grad(loss, argnums=(0, 1, 2))(*(mx.array(t) for t in (q, k, v, mask)))
    seen = cotangent != 0
    np.testing.assert_allclose(np.array(got)[seen], expected.detach().numpy()[seen], atol=1e-5, rtol=0)
    for name, grad, tensor in zip(("q", "k", "v"), grads, tensors, strict=False):
        exact = tensor.grad.numpy()
        np.testing.assert_allclose(np.array(grad), exact, atol=1e-5 * np.abs(exact).max(), rtol=0, err_msg=name)


@pytest.mark.parametrize("task", ["encoder", "sequence-classification"])
def test_long_inputs_by_blocks_match_transformers_forward_and_gradients(checkpoint, monkeypatch, task):
    """From 4 queries on, in blocks of 3: every layer by blocks, on left-padded batches."""
    force_branch(monkeypatch, "cpu")
    monkeypatch.setattr(kernels, "BLOCKWISE_FROM", 4)
    monkeypatch.setattr(kernels, "QUERY_BLOCK", 3)
    calls = []
    blocks = kernels.attention_by_blocks
    monkeypatch.setattr(kernels, "attention_by_blocks", lambda *a, **kw: calls.append(kw["causal"]) or blocks(*a, **kw))
    check_parity(checkpoint("qwen3", task), task)
    check_gradients(checkpoint("qwen3", task), task)
    assert calls and all(calls)


def test_memory_grows_linearly_with_length(monkeypatch):
    """A causal layer by blocks holds one block's scores at a time, in its forward pass and in its gradients:
    the peak memory grows as L (all (L, L) scores, or the (L, L) causal mask, would grow it as L^2)."""
    monkeypatch.setattr(kernels, "BLOCKWISE_FROM", 256)
    monkeypatch.setattr(kernels, "QUERY_BLOCK", 128)
    args = qwen3.ModelArgs(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16,
    )  # fmt: skip
    model = qwen3.Qwen3Model(args)
    mx.eval(model.parameters())
    gradients = nn.value_and_grad(model, lambda ids: model(ids, attention_mask=ids).last_hidden_state.sum())
    for run in (lambda ids: model(ids, attention_mask=ids).last_hidden_state, gradients):
        assert_linear_memory(run, 512)


def test_token_labels_sit_on_their_tokens_in_left_padded_batches(checkpoint):
    """Token-classification training batches: each row's labels end where its tokens do, and the loss is
    transformers' on the same batch."""
    folder = checkpoint("qwen3", "token-classification")
    model, tokenizer = mlx_encoders.load(folder)
    words = [
        {"tokens": ["Hugging", "Face", "is", "in", "Brooklyn"], "ner_tags": ["B-ORG", "I-ORG", "O", "O", "B-LOC"]},
        {"tokens": ["Obama", "."], "ner_tags": ["B-PER", "O"]},
    ]
    examples = token_classification_data(words, tokenizer)  # five labels, as the checkpoint's head
    batch = collate(examples, [0, 1], tokenizer)
    short = examples.labels[1]
    assert batch["attention_mask"][1, 0] == 0 and batch["labels"][1, -len(short) :].tolist() == short
    assert (batch["labels"][batch["attention_mask"] == 0] == -100).all()
    labels = batch.pop("labels")
    inputs = {k: mx.array(v) for k, v in batch.items()}
    loss = task_loss(model, model(**inputs), mx.array(labels)).item()
    with torch.no_grad():
        expected = load_reference(folder, "token-classification")(
            **as_torch(batch), labels=torch.tensor(labels).long()
        ).loss
    assert abs(loss - expected.item()) <= 1e-5 * abs(expected.item())


@pytest.mark.parametrize(
    "model_type, task, pooling, config",
    [("qwen3", "causal-lm", "lasttoken", {}), ("qwen3", "encoder", "mean", {}),
     ("gemma3_text", "causal-lm", "lasttoken", {"use_bidirectional_attention": False})],
)  # fmt: skip
def test_plain_checkpoint_pools_as_sentence_transformers_chooses(checkpoint, model_type, task, pooling, config):
    """No modules.json: the last token of a `...ForCausalLM` checkpoint (sentence-transformers' rule, whatever the
    family), the mean of a bare model's."""
    folder = checkpoint(model_type, task, **config)
    with pytest.warns(UserWarning, match=f"using {pooling} pooling"):
        encoder = SentenceEncoder(folder)
    theirs = SentenceTransformer(str(folder), device="cpu").encode(TEXTS, batch_size=3)
    assert cosines(encoder.encode(TEXTS, batch_size=3), theirs).min() >= 0.99999


def test_a_chat_template_compiles_in_a_process_that_never_imported_transformers():
    """Loop controls are jinja2's `ext` submodule, which `import jinja2` alone does not load (transformers loads it
    for the other tests of this process)."""
    code = (
        "import sys; from mlx_encoders.chat_template import compile_template; "
        "t = compile_template('{% for x in xs %}{% if x > 1 %}{% break %}{% endif %}{{ x }}{% endfor %}'); "
        "print(t.render(xs=[0, 1, 2, 3])); assert 'transformers' not in sys.modules"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "01", done.stderr


@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text", "gpt2"])
def test_is_causal_false_is_refused_naming_the_key(checkpoint, tmp_path, model_type):
    """transformers 5 runs these decoders with bidirectional masks when config.json says is_causal false."""
    folder = shutil.copytree(checkpoint(model_type), tmp_path / model_type)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "is_causal": False}))
    with pytest.raises(ValueError, match=f"config key 'is_causal' is false: transformers then runs {model_type} with"):
        mlx_encoders.load_model(folder)


@pytest.mark.parametrize("loss", ["mnrl", "cached-mnrl"])
def test_left_padded_rows_train_in_length_groups_with_sentence_transformers_loss(embedding_folder, tmp_path, loss,
                                                                                monkeypatch):  # fmt: skip
    """Qwen3-Embedding pads on the left: a length group (or a cached loss's mini-batch) keeps each row's last
    columns, so the first step's loss is sentence-transformers' MNRL over the same batch."""
    from mlx_encoders.train import embedding

    monkeypatch.setattr(embedding, "LENGTH_GROUP", 2)
    rows = [{"anchor": f"query {i} " + "word " * (i % 4), "positive": f"doc {i} " + "thing " * (2 * (i % 3))}
            for i in range(6)]  # fmt: skip
    from mlx_encoders.train.losses.contrastive import CachedMultipleNegativesRankingLoss

    chosen = CachedMultipleNegativesRankingLoss(mini_batch_size=2) if loss == "cached-mnrl" else loss
    fine_tune("embed", rows, tmp_path, model=embedding_folder, loss=chosen, max_steps=1, batch_size=6, lr=1e-9,
              final_checkpoint=False, batch_sampler="batch_sampler")  # fmt: skip
    ours = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    reference = SentenceTransformer(str(embedding_folder), device="cpu").eval()
    anchors = [reference.prompts["query"] + r["anchor"] for r in rows]
    positives = [reference.prompts.get("document", "") + r["positive"] for r in rows]
    with torch.no_grad():
        features = [reference.preprocess(anchors), reference.preprocess(positives)]
        expected = float(st.sentence_transformer.losses.MultipleNegativesRankingLoss(reference)(features, None))
    assert [value for value in ours if value is not None][0] == pytest.approx(expected, rel=1e-5)


def test_embed_training_from_a_plain_causal_lm_pools_its_last_token(checkpoint, tmp_path):
    """A plain Qwen3ForCausalLM checkpoint embeds with its last token in sentence-transformers (and SentenceEncoder):
    fine_tune('embed') trains and saves that pooling, not mean pooling."""
    rows = [{"anchor": "how do cats sleep", "positive": "Cats sleep curled up."},
            {"anchor": "python lists", "positive": "A list holds items in order."}]  # fmt: skip
    plain = checkpoint("qwen3", "causal-lm")
    trained = fine_tune("embed", rows, tmp_path, model=plain, loss="mnrl", max_steps=1, batch_size=2, lr=1e-9)
    pooling = json.loads((trained.path / "1_Pooling" / "config.json").read_text())
    assert pooling["pooling_mode"] == "lasttoken"
    texts = ["a cat", "the much longer sentence here"]
    before = SentenceTransformer(str(plain), device="cpu").encode(texts)
    np.testing.assert_allclose(SentenceTransformer(str(trained.path), device="cpu").encode(texts), before, atol=1e-4)


def test_text_generation_pipeline_is_refused_with_the_reranker_s_route(checkpoint):
    """Qwen3's causal-LM head gives next-token logits (a reranker's yes/no) but no cache to generate with."""
    with pytest.raises(ValueError, match="no key/value cache.*a Qwen3-Reranker folder scores pairs through"):
        pipeline("text-generation", model=checkpoint("qwen3", "causal-lm"))

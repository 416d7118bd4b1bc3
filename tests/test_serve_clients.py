"""`mlx-encoders serve` called by the clients of other servers, each configured as its docs say for a self-hosted
server: the `cohere` SDK (v1 `Client` and v2 `ClientV2`), the `ollama` client, Infinity's unprefixed routes,
LangChain's `OpenAIEmbeddings` and LlamaIndex's `OpenAIEmbedding`. Vectors are checked against
sentence-transformers (real all-MiniLM-L6-v2) and typed ones against its `quantize_embeddings`, rerank scores
against sentence-transformers' CrossEncoder or transformers' model, labels against transformers' pipeline."""

import asyncio
import base64
import gc
import json
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from checkpoints import MINILM
from test_serve import DOCS, TEXTS, call, cosine, in_process
from tolerance import assert_float32_close, encoder_terms

from mlx_encoders.serve.protocols.cohere import INPUT_TYPES

LONG = " ".join(["word"] * 300)  # longer than MiniLM's 256 tokens


@pytest.fixture(scope="module")
def folders(checkpoint):
    return {
        "rerank": checkpoint("bert", "sequence-classification", num_labels=1),
        "classify": checkpoint("bert", "sequence-classification"),
    }


@pytest.fixture(scope="module")
def server(folders):
    """An in-process server of MiniLM, a one-label cross-encoder and a 3-label classifier."""
    from mlx_encoders import serve

    app = serve.app({"minilm": MINILM, "rerank": folders["rerank"], "classify": folders["classify"]})
    with in_process(app) as url:
        yield url


@pytest.fixture(scope="module")
def sentence_transformer(one_torch_thread):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(MINILM), device="cpu")


@pytest.fixture(scope="module")
def cross_encoder(folders, one_torch_thread):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(folders["rerank"]), device="cpu")


def terms(texts) -> int:
    return encoder_terms(MINILM, texts)


def assert_quantized_equal(got, vectors: np.ndarray, precision: str) -> None:
    """`got` equals sentence-transformers' `quantize_embeddings(vectors, precision)` but where float rounding may
    move a value across a bucket's edge (int8, uint8: one bucket) or across 0 (binary: a sign bit)."""
    from sentence_transformers.quantization import quantize_embeddings

    expected = quantize_embeddings(vectors, precision)
    got = np.array(got)
    assert got.shape == expected.shape and got.min() >= np.iinfo(expected.dtype).min
    assert got.max() <= np.iinfo(expected.dtype).max
    if precision.endswith("int8"):
        low, high = vectors.min(axis=0), vectors.max(axis=0)
        position = (vectors - low) / ((high - low) / 255)
        clear = np.abs(position - np.round(position)) > 1e-3  # away from a bucket's edge
        np.testing.assert_array_equal(got[clear], expected[clear])
        assert np.abs(got - expected.astype(np.int64)).max() <= 1
        return
    shift = 128 if precision == "binary" else 0
    bits = np.unpackbits((got + shift).astype(np.uint8), axis=1)[:, : vectors.shape[1]]
    clear = np.abs(vectors) > 1e-5  # a sign that rounding cannot flip
    np.testing.assert_array_equal(bits[clear], (vectors > 0)[clear])


# ---- Cohere


def test_cohere_v2_embed_gives_every_embedding_type_as_sentence_transformers(server, sentence_transformer):
    import cohere

    client = cohere.ClientV2(base_url=server, api_key="unused")
    kinds = ["float", "int8", "uint8", "binary", "ubinary", "base64"]
    answer = client.embed(model="minilm", texts=TEXTS, input_type="search_document", embedding_types=kinds)
    expected = sentence_transformer.encode(TEXTS)
    got = np.array(answer.embeddings.float_, np.float32)
    assert cosine(got, expected).min() >= 0.99999
    assert_float32_close(got, expected, terms(TEXTS))
    for precision in ("int8", "uint8", "binary", "ubinary"):
        assert_quantized_equal(getattr(answer.embeddings, precision), expected, precision)
    decoded = [np.frombuffer(base64.b64decode(b), "<f4") for b in answer.embeddings.base64]
    np.testing.assert_array_equal(decoded, got)
    assert answer.texts == TEXTS and answer.id
    tokens = sum(len(ids) for ids in sentence_transformer.tokenizer(TEXTS)["input_ids"])
    assert answer.meta.billed_units.input_tokens == tokens and answer.meta.api_version.version == "2"


def test_cohere_v2_embed_truncates_as_asked_and_cuts_dimensions(server, sentence_transformer):
    import cohere

    client = cohere.ClientV2(base_url=server, api_key="unused")
    texts = ["a first text of several words", LONG]
    default = client.embed(model="minilm", texts=texts, input_type="search_query")  # floats by type, as Cohere
    expected = sentence_transformer.encode(texts)  # cuts the end, as Cohere's default END
    assert cosine(np.array(default.embeddings.float_), expected).min() >= 0.99999

    sentence_transformer.max_seq_length = 5
    try:
        end = sentence_transformer.encode(texts)
        sentence_transformer.tokenizer.truncation_side = "left"
        start = sentence_transformer.encode(texts)
    finally:
        sentence_transformer.max_seq_length = 256
        sentence_transformer.tokenizer.truncation_side = "right"
    for truncate, oracle in (("END", end), ("START", start)):
        answer = client.embed(
            model="minilm", texts=texts, input_type="classification", embedding_types=["float"], truncate=truncate,
            max_tokens=5,
        )  # fmt: skip
        assert cosine(np.array(answer.embeddings.float_), oracle).min() >= 0.99999, truncate
    assert cosine(start, end).min() < 0.99  # the two ends differ: the test tells them apart

    short = client.embed(model="minilm", texts=TEXTS, input_type="clustering", embedding_types=["float"],
                         output_dimension=64)  # fmt: skip
    oracle = sentence_transformer.encode(TEXTS, truncate_dim=64, normalize_embeddings=True)
    assert cosine(np.array(short.embeddings.float_), oracle).min() >= 0.99999
    np.testing.assert_allclose(np.linalg.norm(short.embeddings.float_, axis=1), 1, atol=1e-6)


@pytest.mark.parametrize(
    "body, status, message",
    [
        ({"model": "minilm", "texts": [LONG], "input_type": "search_query", "truncate": "NONE"}, 400, "256 tokens"),
        ({"model": "minilm", "texts": ["a"]}, 400, '"input_type" is required'),
        ({"texts": ["a"], "input_type": "search_query"}, 400, '"model" is required'),
        ({"model": "embed-v4.0", "texts": ["a"], "input_type": "search_query"}, 404, "served models: minilm"),
        ({"model": "minilm", "texts": ["a"], "input_type": "image"}, 400, '"input_type" must be one of'),
        ({"model": "minilm", "images": ["data:,"], "input_type": "image"}, 400, '"images" is not served'),
        ({"model": "minilm", "texts": ["a"], "input_type": "search_query", "embedding_types": ["int4"]}, 400,
         '"embedding_types" must be'),
        ({"model": "minilm", "texts": ["one"], "input_type": "search_query", "embedding_types": ["int8"]}, 400,
         "send 2 inputs or more"),
        ({"model": "minilm", "texts": ["a"], "input_type": "search_query", "output_dimension": 1000}, 400, "384"),
        ({"model": "rerank", "texts": ["a"], "input_type": "search_query"}, 400, "cross-encoder model"),
    ],
)  # fmt: skip
def test_cohere_v2_embed_errors_are_cohere_shaped(server, body, status, message):
    import cohere

    got, answer, _ = call(server, "/v2/embed", body)
    assert got == status and set(answer) == {"id", "message"} and message in answer["message"], answer
    if status == 400 and {"model", "input_type"} <= set(body):  # the SDK raises its error with the body
        with pytest.raises(cohere.BadRequestError) as error:
            cohere.ClientV2(base_url=server, api_key="unused").embed(**body)
        assert message in error.value.body["message"]


def test_cohere_v1_client_embeds_and_reranks(server, sentence_transformer, cross_encoder):
    import cohere

    client = cohere.Client(base_url=server, api_key="unused")
    floats = client.embed(model="minilm", texts=TEXTS)
    assert floats.response_type == "embeddings_floats" and floats.texts == TEXTS
    assert cosine(np.array(floats.embeddings), sentence_transformer.encode(TEXTS)).min() >= 0.99999
    typed = client.embed(model="minilm", texts=TEXTS, input_type="search_query", embedding_types=["ubinary"])
    assert typed.response_type == "embeddings_by_type"
    assert_quantized_equal(typed.embeddings.ubinary, sentence_transformer.encode(TEXTS), "ubinary")

    query = "Where is Paris?"
    oracle = cross_encoder.predict([(query, d) for d in DOCS])
    best = np.argsort(-oracle, kind="stable")[:2]
    ranked = client.rerank(model="rerank", query=query, documents=DOCS, top_n=2, return_documents=True)
    assert [r.index for r in ranked.results] == best.tolist() and ranked.id
    assert [r.document.text for r in ranked.results] == [DOCS[i] for i in best]
    pairs = [(query, d) for d in DOCS]
    assert_float32_close([r.relevance_score for r in ranked.results], oracle[best], encoder_terms(MINILM, pairs))
    with pytest.raises(cohere.BadRequestError) as error:
        client.rerank(model="rerank", query=query, documents=DOCS, max_chunks_per_doc=2)
    assert '"max_chunks_per_doc" is not served' in error.value.body["message"]


def test_cohere_v2_rerank_equals_the_cross_encoder_and_cuts_documents(server, folders, cross_encoder):
    import cohere
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    client = cohere.ClientV2(base_url=server, api_key="unused")
    query = "Where is Paris?"
    pairs = [(query, d) for d in DOCS]
    oracle = cross_encoder.predict(pairs)
    answer = client.rerank(model="rerank", query=query, documents=DOCS, top_n=3)
    best = np.argsort(-oracle, kind="stable")[:3]
    assert [r.index for r in answer.results] == best.tolist() and answer.id
    assert_float32_close([r.relevance_score for r in answer.results], oracle[best], encoder_terms(MINILM, pairs))
    assert answer.meta.api_version.version == "2"

    # max_tokens_per_doc: each document's first 2 tokens, paired with the query, through transformers' model
    tokenizer = AutoTokenizer.from_pretrained(folders["rerank"])
    model = AutoModelForSequenceClassification.from_pretrained(folders["rerank"]).eval()
    first = tokenizer([query])["input_ids"][0]
    rows = [first + tokenizer(d, add_special_tokens=False)["input_ids"][:2] + [tokenizer.sep_token_id] for d in DOCS]
    with torch.no_grad():
        ids = torch.tensor(rows)
        types = torch.tensor([[0] * len(first) + [1] * (len(r) - len(first)) for r in rows])
        cut = torch.sigmoid(model(input_ids=ids, token_type_ids=types).logits[:, 0]).numpy()
    answer = client.rerank(model="rerank", query=query, documents=DOCS, max_tokens_per_doc=2)
    got = np.empty(len(DOCS))
    got[[r.index for r in answer.results]] = [r.relevance_score for r in answer.results]
    np.testing.assert_allclose(got, cut, atol=1e-5)
    assert np.abs(cut - oracle).max() > 1e-3  # cutting changed the scores: the test tells them apart

    for body, message in (({"query": "q", "documents": ["d"]}, '"model" is required'),
                          ({"model": "rerank", "query": "q", "documents": ["d"], "relevant_spans": {"enabled": True}},
                           '"relevant_spans" is not served')):  # fmt: skip
        status, error, _ = call(server, "/v2/rerank", body)
        assert status == 400 and set(error) == {"id", "message"} and message in error["message"], error


# ---- Ollama


def test_ollama_client_embeds_as_sentence_transformers(server, sentence_transformer):
    import ollama

    client = ollama.Client(host=server)
    answer = client.embed(model="minilm:latest", input=TEXTS)  # Ollama's tag, or the name alone
    expected = sentence_transformer.encode(TEXTS, normalize_embeddings=True)
    assert answer.model == "minilm:latest" and cosine(np.array(answer.embeddings), expected).min() >= 0.99999
    assert_float32_close(answer.embeddings, expected, terms(TEXTS))
    assert answer.prompt_eval_count == sum(len(ids) for ids in sentence_transformer.tokenizer(TEXTS)["input_ids"])
    one = client.embed(model="minilm", input=TEXTS[0], dimensions=64, keep_alive="5m", options={"temperature": 0})
    oracle = sentence_transformer.encode(TEXTS[:1], truncate_dim=64, normalize_embeddings=True)
    assert cosine(np.array(one.embeddings), oracle).min() >= 0.99999
    np.testing.assert_allclose(np.linalg.norm(one.embeddings, axis=1), 1, atol=1e-6)
    assert client.embed(model="minilm", input=[]).embeddings == []  # how Ollama's clients load a model

    legacy = client.embeddings(model="minilm", prompt=TEXTS[1])
    assert cosine(np.array([legacy.embedding]), sentence_transformer.encode(TEXTS[1:2])).min() >= 0.99999

    # Ollama cuts over-long inputs unless told not to; num_ctx is the tokens an input may have
    long = client.embed(model="minilm", input=[LONG]).embeddings
    assert cosine(np.array(long), sentence_transformer.encode([LONG])).min() >= 0.99999
    short = client.embed(model="minilm", input=[LONG, TEXTS[1]], options={"num_ctx": 5}).embeddings
    sentence_transformer.max_seq_length = 5
    try:
        oracle = sentence_transformer.encode([LONG, TEXTS[1]])
    finally:
        sentence_transformer.max_seq_length = 256
    assert cosine(np.array(short), oracle).min() >= 0.99999

    for kwargs, message in (
        ({"input": [LONG], "truncate": False}, "longer than the 256 tokens"),
        ({"input": ["a"], "options": {"num_ctx": 5, "bogus": 1}}, "'bogus' not known"),
        ({"input": ["a"], "keep_alive": "5 minutes"}, '"keep_alive" must be'),
        ({"input": ["a"], "dimensions": 1000}, "384"),
    ):
        with pytest.raises(ollama.ResponseError) as error:
            client.embed(model="minilm", **kwargs)
        assert error.value.status_code == 400 and message in error.value.error, error.value.error
    with pytest.raises(ollama.ResponseError) as error:
        client.embed(model="nomic-embed-text", input="a")
    assert error.value.status_code == 404 and "served models: minilm" in error.value.error


def test_ollama_client_lists_shows_and_reports_the_served_models(server):
    import ollama

    client = ollama.Client(host=server)
    listed = {m.model: m for m in client.list().models}
    assert set(listed) == {"minilm:latest", "rerank:latest", "classify:latest"}
    assert listed["minilm:latest"].details.family == "bert" and listed["minilm:latest"].size > 0
    shown = client.show("minilm:latest")
    assert shown.capabilities == ["embedding"] and shown.modelinfo["bert.embedding_length"] == 384
    assert shown.modelinfo["bert.context_length"] == 256
    assert client.show("rerank").capabilities == []
    assert {m.model for m in client.ps().models} == set(listed)
    status, answer, _ = call(server, "/api/version")
    assert status == 200 and answer["version"]
    status, answer, _ = call(server, "/api/show", {"model": "llama3"})
    assert status == 404 and set(answer) == {"error"}


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/v1/embeddings", {"model": "minilm", "input": "a", "normalize": False}, "normalize"),
        ("/v1/embeddings", {"model": "minilm", "input": "a", "dimension": 8}, "dimension"),
        ("/embeddings", {"model": "minilm", "input": "a", "prompt_name": "query"}, "prompt_name"),
        ("/v1/classify", {"model": "classify", "input": "a", "raw_scores": True}, "raw_scores"),
        ("/v2/embed", {"model": "minilm", "texts": ["a"], "input_type": "search_query", "dimensions": 8}, "dimensions"),
        ("/v1/embed", {"model": "minilm", "texts": ["a"], "truncation": "START"}, "truncation"),
        ("/v2/rerank", {"model": "rerank", "query": "q", "documents": ["d"], "truncate": False}, "truncate"),
        ("/v1/rerank", {"model": "rerank", "query": "q", "documents": ["d"], "max_tokens_per_doc": 2},
         "max_tokens_per_doc"),
        ("/api/embed", {"model": "minilm", "input": "a", "normalize": False}, "normalize"),
        ("/api/embeddings", {"model": "minilm", "prompt": "a", "dimensions": 8}, "dimensions"),
        ("/classify", {"model": "classify", "input": "a", "top_k": 1}, "top_k"),
    ],
)  # fmt: skip
def test_a_field_the_route_does_not_take_is_refused_by_name(server, path, body, field):
    """A field that would change the answer elsewhere (another protocol's, or a misspelling) is a 400 naming it in
    the route's protocol's error body, never silently ignored."""
    status, answer, _ = call(server, path, body)
    assert status == 400 and f"unknown field '{field}'" in json.dumps(answer), answer


def test_each_protocol_at_its_edges(server):
    import urllib.request

    with urllib.request.urlopen(urllib.request.Request(server + "/", method="HEAD")) as response:
        assert response.status == 200 and response.read() == b""  # as GET /: Ollama's CLI checks a server so
    status, answer, headers = call(server, "/v1/embeddings")
    assert status == 405 and headers["Allow"] == "POST" and "takes POST, not GET" in answer["error"]["message"]
    status, answer, _ = call(server, "/api/generate", {"model": "minilm", "prompt": "a"})
    assert status == 404 and isinstance(answer["error"], str)  # Ollama's body under /api/
    status, answer, _ = call(server, "/api/show", {"name": "minilm"})  # Ollama's older spelling of "model"
    assert status == 200 and answer["capabilities"] == ["embedding"]

    # a limit that leaves no room for the special tokens is refused by its own name, not ignored
    status, answer, _ = call(server, "/api/embed", {"model": "minilm", "input": "a b c", "options": {"num_ctx": 1}})
    assert status == 400 and '"options.num_ctx" is 1, fewer than the 2 special tokens' in answer["error"]
    body = {"model": "minilm", "texts": ["a b c d"], "input_type": "clustering", "max_tokens": 1}
    status, answer, _ = call(server, "/v2/embed", body)
    assert status == 400 and '"max_tokens" is 1' in answer["message"]
    # an over-long input's error names the limit that applies and what this request can send
    status, answer, _ = call(server, "/v2/embed", {**body, "max_tokens": 3, "truncate": "NONE"})
    assert status == 400 and 'the 3 tokens "max_tokens" allows' in answer["message"], answer
    assert answer["message"].endswith('send "truncate": "END" or "START"')
    status, answer, _ = call(server, "/v1/embeddings", {"model": "minilm", "input": LONG, "truncate": False})
    assert status == 400 and answer["error"]["message"].endswith('shorten it, or send "truncate": true')

    raw = b'{"model": "rerank", "query": "\\ud800", "documents": ["a"]}'  # half a UTF-16 pair, in the query
    status, answer, _ = call(server, "/v1/rerank", raw=raw)
    assert status == 400 and answer["error"]["param"] == "query", answer
    assert answer["error"]["message"].startswith('"query" is not valid Unicode')
    status, answer, _ = call(server, "/v1/embeddings", raw=b'{"input": "a", "dimensions": ' + b"1" * 5000 + b"}")
    assert status == 400 and "an integer of more than 4300 digits" in answer["error"]["message"], answer


# ---- Infinity


def test_infinity_routes_answer_in_infinity_shapes(server, folders, sentence_transformer, cross_encoder):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    status, answer, _ = call(server, "/embeddings", {"model": "minilm", "input": TEXTS})
    assert status == 200, answer
    got = np.array([d["embedding"] for d in answer["data"]])
    assert cosine(got, sentence_transformer.encode(TEXTS)).min() >= 0.99999

    query = "Where is Paris?"
    pairs = [(query, d) for d in DOCS]
    oracle = cross_encoder.predict(pairs)
    body = {"model": "rerank", "query": query, "documents": DOCS, "return_documents": True, "top_n": 3}
    status, answer, _ = call(server, "/rerank", body)  # Infinity's body on TEI's path: told apart by "documents"
    assert status == 200 and answer["object"] == "rerank", answer
    best = np.argsort(-oracle, kind="stable")[:3]
    assert [r["index"] for r in answer["results"]] == best.tolist()
    assert [r["document"] for r in answer["results"]] == [DOCS[i] for i in best]
    assert_float32_close([r["relevance_score"] for r in answer["results"]], oracle[best], encoder_terms(MINILM, pairs))
    tokenizer = AutoTokenizer.from_pretrained(folders["rerank"])
    model = AutoModelForSequenceClassification.from_pretrained(folders["rerank"]).eval()
    with torch.no_grad():
        logits = model(**tokenizer([query] * len(DOCS), DOCS, padding=True, return_tensors="pt")).logits[:, 0].numpy()
    status, raw, _ = call(server, "/rerank", {"model": "rerank", "query": query, "documents": DOCS, "raw_scores": True})
    assert status == 200, raw
    order = np.argsort(-logits, kind="stable")
    assert [r["index"] for r in raw["results"]] == order.tolist() and raw["results"][0]["document"] is None
    np.testing.assert_allclose([r["relevance_score"] for r in raw["results"]], logits[order], atol=1e-5)
    status, tei, _ = call(server, "/rerank", {"model": "rerank", "query": query, "texts": DOCS})  # TEI's still
    assert status == 200 and [r["index"] for r in tei] == np.argsort(-oracle, kind="stable").tolist()

    classes = pipeline("text-classification", model=str(folders["classify"]), top_k=None, device="cpu")
    status, answer, _ = call(server, "/classify", {"model": "classify", "input": TEXTS})
    assert status == 200 and answer["object"] == "classify", answer
    sums = encoder_terms(folders["classify"], TEXTS)
    for expected, got in zip(classes(TEXTS), answer["data"], strict=True):
        assert [x["label"] for x in got] == [x["label"] for x in expected]
        assert_float32_close([x["score"] for x in got], [x["score"] for x in expected], sums)
    status, raw, _ = call(server, "/classify", {"model": "classify", "input": TEXTS[:1], "raw_scores": True})
    labels = AutoModelForSequenceClassification.from_pretrained(folders["classify"]).eval()
    with torch.no_grad():
        row = labels(**AutoTokenizer.from_pretrained(folders["classify"])(TEXTS[:1], return_tensors="pt")).logits[0]
    names = labels.config.id2label
    np.testing.assert_allclose([x["score"] for x in raw["data"][0]], np.sort(row.numpy())[::-1], atol=1e-5)
    assert [x["label"] for x in raw["data"][0]] == [names[int(i)] for i in np.argsort(-row.numpy(), kind="stable")]

    status, listed, _ = call(server, "/models")
    assert status == 200 and {m["id"]: m["capabilities"] for m in listed["data"]} == {
        "minilm": ["embed"], "rerank": ["classify", "rerank"], "classify": ["classify"]}  # fmt: skip
    assert all(m["owned_by"] == "infinity" and m["stats"] == {} for m in listed["data"])  # its ModelInfo's
    # Infinity's client sends "dimensions": 0 for every dimension; OpenAI's route keeps refusing it
    status, answer, _ = call(server, "/embeddings", {"model": "minilm", "input": TEXTS, "dimensions": 0})
    full = np.array([d["embedding"] for d in answer["data"]])
    assert status == 200 and cosine(full, sentence_transformer.encode(TEXTS)).min() >= 0.99999
    status, answer, _ = call(server, "/v1/embeddings", {"model": "minilm", "input": TEXTS, "dimensions": 0})
    assert status == 400 and answer["error"]["param"] == "dimensions", answer
    status, error, _ = call(server, "/classify", {"model": "minilm", "input": ["a"]})
    assert status == 400 and "'minilm' is a dense model" in error["error"]["message"], error


# ---- OpenAI clients: typed embeddings, token ids, LangChain, LlamaIndex


def test_openai_output_dtype_gives_typed_embeddings(server, sentence_transformer):
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    expected = sentence_transformer.encode(TEXTS)
    for precision in ("int8", "uint8", "binary", "ubinary"):
        answer = client.embeddings.create(
            model="minilm", input=TEXTS, encoding_format="float", extra_body={"output_dtype": precision}
        )
        assert_quantized_equal([d.embedding for d in answer.data], expected, precision)
    with pytest.raises(BadRequestError, match='send "encoding_format": "float"'):
        client.embeddings.create(model="minilm", input=TEXTS, extra_body={"output_dtype": "int8"})  # base64
    with pytest.raises(BadRequestError, match='"output_dtype" must be one of'):
        client.embeddings.create(model="minilm", input=TEXTS, extra_body={"output_dtype": "int4"})


def test_token_ids_that_are_not_the_models_own_get_a_400(server, sentence_transformer):
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    # tiktoken's ids of "hello world", what LangChain's OpenAIEmbeddings sends unless told otherwise
    with pytest.raises(BadRequestError, match="check_embedding_ctx_length=False") as error:
        client.embeddings.create(model="minilm", input=[[15339, 1917]])
    assert error.value.body["code"] == "invalid_token_ids" and "[CLS]" in error.value.body["message"]
    with pytest.raises(BadRequestError, match="outside model 'minilm'"):
        client.embeddings.create(model="minilm", input=[[101, 30522, 102]])
    ids = sentence_transformer.tokenizer(TEXTS[:1])["input_ids"]
    assert len(client.embeddings.create(model="minilm", input=ids).data) == 1
    long = sentence_transformer.tokenizer([LONG], truncation=False)["input_ids"]  # 302 ids: cut, [SEP] kept
    cut = client.embeddings.create(model="minilm", input=long, extra_body={"truncate": True}, encoding_format="float")
    assert cosine(np.array([cut.data[0].embedding]), sentence_transformer.encode([LONG])).min() >= 0.99999


def test_langchain_openai_embeddings_as_its_docs_configure_a_self_hosted_server(server, sentence_transformer):
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(model="minilm", base_url=server + "/v1", api_key="unused",
                                  check_embedding_ctx_length=False)  # fmt: skip
    documents = embeddings.embed_documents(TEXTS)
    query = embeddings.embed_query(TEXTS[0])
    expected = sentence_transformer.encode(TEXTS)
    assert cosine(np.array(documents), expected).min() >= 0.99999
    assert_float32_close(documents, expected, terms(TEXTS))
    assert_float32_close(query, expected[0], terms(TEXTS))


def test_llama_index_openai_embedding_as_its_docs_configure_a_self_hosted_server(server, sentence_transformer):
    from llama_index.embeddings.openai import OpenAIEmbedding

    embedding = OpenAIEmbedding(model_name="minilm", api_base=server + "/v1", api_key="unused")
    documents = embedding.get_text_embedding_batch(TEXTS)
    query = embedding.get_query_embedding(TEXTS[1])
    expected = sentence_transformer.encode(TEXTS)
    assert_float32_close(documents, expected, terms(TEXTS))
    assert_float32_close(query, expected[1], terms(TEXTS))


# ---- models loaded on request (--models-dir)


def wait_until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_models_dir_lists_past_folders_it_cannot_read(tmp_path, folders, monkeypatch):
    """A weight file that is a dangling link (a hub cache whose blob was removed) and a folder the server may not
    read are listed or skipped, never a 500 for the whole listing."""
    from mlx_encoders import serve
    from mlx_encoders.serve import lazy

    (tmp_path / "gone").mkdir()
    (tmp_path / "gone" / "config.json").write_text('{"model_type": "bert"}')
    (tmp_path / "gone" / "model.safetensors").symlink_to(tmp_path / "removed-blob")
    (tmp_path / "locked").mkdir()
    (tmp_path / "locked" / "config.json").write_text('{"model_type": "bert"}')
    readable = lazy.is_model_folder

    def is_model_folder(path):
        if path.name == "locked":  # root reads any file: the permission error is simulated
            raise PermissionError(13, "Permission denied", str(path / "config.json"))
        return readable(path)

    monkeypatch.setattr(lazy, "is_model_folder", is_model_folder)
    app = serve.app({"rerank": folders["rerank"]}, models_dir=tmp_path, model_keep_alive=-1)
    with in_process(app) as url:
        status, tags, _ = call(url, "/api/tags")
        assert status == 200 and {m["name"] for m in tags["models"]} == {"rerank:latest", "gone:latest"}, tags
        status, listed, _ = call(url, "/v1/models")
        assert status == 200 and [m["id"] for m in listed["data"]] == ["rerank", "gone"], listed


def test_models_dir_loads_on_first_request_and_unloads_after_keep_alive(tmp_path, folders, sentence_transformer):
    import ollama

    from mlx_encoders import serve

    (tmp_path / "minilm").symlink_to(MINILM)
    (tmp_path / "broken").mkdir()  # a damaged model: listed, its requests fail, the others' do not
    (tmp_path / "broken" / "config.json").write_text("{not json")
    (tmp_path / "notes").mkdir()  # no config.json: not a model
    app = serve.app({"rerank": folders["rerank"]}, models_dir=tmp_path, model_keep_alive=-1)
    served = app.state.server.models
    with in_process(app) as url:
        client = ollama.Client(host=url)
        assert {m.model for m in client.list().models} == {"rerank:latest", "minilm:latest", "broken:latest"}
        assert [m["id"] for m in call(url, "/v1/models")[1]["data"]] == ["rerank", "broken", "minilm"]
        assert set(served) == {"rerank"} and {m.model for m in client.ps().models} == {"rerank:latest"}

        answer = client.embed(model="minilm:latest", input=TEXTS, keep_alive="1s")  # loaded for this request
        assert cosine(np.array(answer.embeddings), sentence_transformer.encode(TEXTS)).min() >= 0.99999
        assert set(served) == {"rerank", "minilm"}
        loaded = weakref.ref(served["minilm"])
        assert wait_until(lambda: "minilm" not in served)  # idle for its keep_alive: unloaded
        gc.collect()
        assert loaded() is None  # nothing holds it (or its weights) any more
        assert {m.model for m in client.ps().models} == {"rerank:latest"}

        status, answer, _ = call(url, "/v1/embeddings", {"model": "minilm", "input": TEXTS})  # any route loads it
        assert status == 200 and cosine(np.array([d["embedding"] for d in answer["data"]]),
                                        sentence_transformer.encode(TEXTS)).min() >= 0.99999  # fmt: skip
        time.sleep(1.0)
        assert "minilm" in served  # --model-keep-alive -1: kept
        client.embed(model="minilm", input=["a"], keep_alive="9999999999h")  # past any date: Ollama's "forever"
        assert {m.model: m.expires_at.year for m in client.ps().models}["minilm:latest"] == 2262
        client.embed(model="minilm", input=[], keep_alive=0)  # Ollama's way to unload a model
        assert wait_until(lambda: "minilm" not in served)
        status, answer, _ = call(url, "/v1/rerank", {"model": "rerank", "query": "q", "documents": ["d"]})
        time.sleep(0.5)
        assert status == 200 and "rerank" in served  # a --model model is never unloaded

        with pytest.raises(ollama.ResponseError) as error:
            client.embed(model="broken", input=["a"])
        assert error.value.status_code == 500 and "failed to load" in error.value.error
        for name in ("absent", "notes"):
            with pytest.raises(ollama.ResponseError) as error:
                client.embed(model=name, input=["a"])
            assert error.value.status_code == 404 and "loaded on request: broken, minilm" in error.value.error
        status, answer, _ = call(url, "/api/embed", {"model": "minilm", "input": ["a"], "keep_alive": 10**400})
        assert status == 200 and answer["embeddings"]  # past a float's range: forever
        for keep_alive in ("²", "5²"):  # digits beyond ASCII's are no duration
            with pytest.raises(ollama.ResponseError) as error:
                client.embed(model="minilm", input=["a"], keep_alive=keep_alive)
            assert error.value.status_code == 400 and '"keep_alive" must be' in error.value.error


def test_models_dir_models_not_loaded_count_when_the_request_names_none(tmp_path, folders, sentence_transformer):
    """Leaving "model" out picks the one model able to answer among the folder's too, loaded or not: which one
    happens to be loaded must not choose a client's embedding space."""
    from mlx_encoders import serve

    (tmp_path / "minilm").symlink_to(MINILM)
    (tmp_path / "other").symlink_to(MINILM)
    app = serve.app({"rerank": folders["rerank"]}, models_dir=tmp_path, model_keep_alive=-1)
    with in_process(app) as url:
        for _ in range(2):  # before and after minilm is loaded: "other" could answer too
            status, answer, _ = call(url, "/v1/embeddings", {"input": "cat"})
            assert status == 400 and "not loaded yet (loaded on request): " in answer["error"]["message"], answer
            assert call(url, "/v1/embeddings", {"model": "minilm", "input": "cat"})[0] == 200
        status, answer, _ = call(url, "/v1/embeddings", {"model": "rerank", "input": "cat"})
        assert status == 400 and answer["error"]["message"].endswith("not loaded yet (loaded on request): other")
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "minilm").symlink_to(MINILM)
    for route in ("/embed", "/v1/embeddings"):  # the folder's one model: loaded for it (TEI's route too)
        with in_process(serve.app(models_dir=alone, model_keep_alive=-1)) as url:
            status, answer, _ = call(url, route, {"input": TEXTS} if route == "/v1/embeddings" else {"inputs": TEXTS})
            assert status == 200, answer
            got = np.array([d["embedding"] for d in answer["data"]] if route == "/v1/embeddings" else answer)
            assert cosine(got, sentence_transformer.encode(TEXTS)).min() >= 0.99999
    others = tmp_path / "others"
    others.mkdir()
    (others / "rerank").symlink_to(folders["rerank"])
    mixed = serve.app({"minilm": MINILM}, models_dir=others, model_keep_alive=-1)
    with in_process(mixed) as url:
        # a folder model of another kind is no candidate for embeddings: the --model one answers, unnamed
        for route, body in (("/embed", {"inputs": TEXTS}), ("/v1/embeddings", {"input": TEXTS})):
            status, answer, _ = call(url, route, body)
            assert status == 200, (route, answer)
        assert "rerank" not in mixed.state.server.models


def test_models_dir_holds_a_model_named_while_it_warms_up_and_reuses_worker_threads(tmp_path, checkpoint, monkeypatch):
    """A request that names a --models-dir model while its first (warm-up) pass runs holds it like any other: the
    model is not unloaded under it when the request that loaded it ends. Models loaded and unloaded again and again
    (Ollama's keep_alive 0) reuse the workers' threads rather than add some each time."""
    from mlx_encoders import serve
    from mlx_encoders.serve.models import ServedModel
    from mlx_encoders.serve.server import Server

    compute, tokenize = ServedModel.compute, Server.tokenize

    def slow_warm_up(self, items):  # a large model's first pass
        if self.tokenizer.decode(items[0].ids, skip_special_tokens=True) == "warm up":
            time.sleep(1.0)
        return compute(self, items)

    async def slow_tokenize(self, model, function, *args, **kwargs):  # a long request's tokenization
        if "late arrival" in args[0]:
            await asyncio.sleep(1.0)
        return await tokenize(self, model, function, *args, **kwargs)

    monkeypatch.setattr(ServedModel, "compute", slow_warm_up)
    monkeypatch.setattr(Server, "tokenize", slow_tokenize)
    (tmp_path / "tiny").symlink_to(checkpoint("bert", "encoder"))
    app = serve.app(models_dir=tmp_path, model_keep_alive=0)
    served = app.state.server.models
    with in_process(app) as url, ThreadPoolExecutor(2) as pool:
        preload = pool.submit(call, url, "/api/embed", {"model": "tiny", "keep_alive": 0})  # loads it, then ends
        time.sleep(0.3)  # the warm-up runs
        late = pool.submit(call, url, "/api/embed", {"model": "tiny", "input": ["late arrival"]})
        assert preload.result(timeout=60)[0] == 200
        status, answer, _ = late.result(timeout=60)
        assert status == 200 and len(answer["embeddings"]) == 1, answer
        assert wait_until(lambda: "tiny" not in served)
        monkeypatch.setattr(ServedModel, "compute", compute)

        def workers() -> int:
            return sum(t.name.startswith("mlx-encoders serve") and t.name != "mlx-encoders serve loader"
                       for t in threading.enumerate())  # fmt: skip

        before = workers()
        for _ in range(4):
            assert call(url, "/api/embed", {"model": "tiny", "input": ["a"], "keep_alive": 0})[0] == 200
            assert wait_until(lambda: "tiny" not in served)
        assert workers() <= max(before, 2), [t.name for t in threading.enumerate()]
        assert call(url, "/api/embed", {"model": "x" * 300, "input": "a"})[0] == 404  # no such folder, too long for one


# ---- random bodies on these routes

KINDS = ["float", "int8", "uint8", "binary", "ubinary"]


def client_bodies():
    """Per route of this module: valid bodies, the same with one field of any JSON value, random objects of the
    routes' fields, and random bytes (as test_serve_safety draws them for the other routes)."""
    from hypothesis import strategies as st
    from test_serve_safety import FLAG, JSON, NUMBERS, SOME_TEXTS, WORDS

    cohere_types = st.sampled_from(list(INPUT_TYPES))
    valid = {
        "/v2/embed": ({"model": st.just("minilm"), "texts": SOME_TEXTS, "input_type": cohere_types}, {
            "embedding_types": st.lists(st.sampled_from([*KINDS, "base64"]), min_size=1, max_size=3),
            "truncate": st.sampled_from(["NONE", "START", "END"]), "max_tokens": st.integers(1, 300),
            "output_dimension": st.integers(1, 384)}),
        "/v1/embed": ({"texts": SOME_TEXTS}, {"model": st.just("minilm"), "input_type": cohere_types}),
        "/v2/rerank": ({"model": st.just("rerank"), "query": WORDS, "documents": SOME_TEXTS}, {
            "top_n": st.integers(1, 5), "max_tokens_per_doc": st.integers(1, 5000)}),
        "/api/embed": ({"model": st.sampled_from(["minilm", "minilm:latest"]), "input": SOME_TEXTS | WORDS}, {
            "truncate": FLAG, "dimensions": st.integers(1, 384), "keep_alive": st.sampled_from(["5m", 0, -1, "1h2s"]),
            "options": st.fixed_dictionaries({}, optional={"num_ctx": st.integers(1, 600), "seed": NUMBERS})}),
        "/api/embeddings": ({"model": st.just("minilm"), "prompt": WORDS}, {}),
        "/api/show": ({"model": st.sampled_from(["minilm", "rerank:latest"])}, {}),
        "/rerank": ({"model": st.just("rerank"), "query": WORDS, "documents": SOME_TEXTS}, {
            "raw_scores": FLAG, "top_n": st.integers(1, 5), "return_documents": FLAG}),
        "/classify": ({"model": st.just("classify"), "input": SOME_TEXTS}, {"raw_scores": FLAG}),
        "/embeddings": ({"model": st.just("minilm"), "input": SOME_TEXTS}, {
            "output_dtype": st.sampled_from(KINDS), "encoding_format": st.sampled_from(["float", "base64"])}),
    }  # fmt: skip
    fields = sorted({key for required, optional in valid.values() for key in (*required, *optional)})

    def bodies(path):
        required, optional = valid[path]
        good = st.fixed_dictionaries(required, optional=optional)
        changed = st.tuples(good, st.sampled_from(fields), JSON | NUMBERS).map(lambda v: {**v[0], v[1]: v[2]})
        junk = st.fixed_dictionaries({}, optional=dict.fromkeys(fields, JSON))
        return (good | changed | junk).map(json.dumps).map(str.encode) | st.binary(max_size=64)

    return st.one_of([st.tuples(st.just(path), bodies(path)) for path in valid])


def test_random_bodies_on_these_routes_get_an_answer_below_500(server, record_property):
    from hypothesis import HealthCheck, given, settings

    statuses, start = {}, time.monotonic()

    @settings(max_examples=150, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(client_bodies())
    def case(request):
        if time.monotonic() - start > 60:
            return
        path, body = request
        status, got, _ = call(server, path, raw=body)
        assert 200 <= status < 300 or 400 <= status < 500, (path, body, status, got)
        assert isinstance(got, (dict, list)), (path, body, got)
        statuses[status] = statuses.get(status, 0) + 1

    case()
    parts = ", ".join(f"{status}: {count}" for status, count in sorted(statuses.items()))
    record_property("summary", f"serve clients' random bodies: {sum(statuses.values())} cases ({parts})")
    assert sum(statuses.values()) >= 100 and statuses.get(200, 0) >= 20 and statuses.get(400, 0) >= 20

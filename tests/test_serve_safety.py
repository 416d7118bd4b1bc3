"""`mlx-encoders serve` against clients that misbehave: a body that stalls or trickles, headers that never end,
connections left idle, SIGTERM while they are open, random JSON bodies, empty texts, and a long tokenization
beside /health. Servers bind 127.0.0.1 on a free port; every wait is bounded."""

import dataclasses
import http.client
import json
import logging
import os
import select
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from urllib.parse import urlsplit

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_serve import TEXTS, call, in_process, launch, metric_values, stop, url_of
from tolerance import assert_float32_close, encoder_terms

READ_TIMEOUT_S = 3  # the module server's, from MLX_ENCODERS_READ_TIMEOUT
KEEP_ALIVE_S = 1
SHUTDOWN_S = 1.5
SLACK_S = 8  # start-up of the process's exit, and a loaded machine
FUZZ_CASES = 200
FUZZ_BUDGET_S = 60


@pytest.fixture(scope="module")
def folders(checkpoint, tmp_path_factory):
    """The tiny seeded models (an encoder, a one-label cross-encoder, a 3-label classifier) and an index of the
    encoder."""
    from mlx_encoders.index import build

    tiny = checkpoint("bert", "encoder")
    index = tmp_path_factory.mktemp("serve-safety") / "notes"
    corpus = [("cats", "Cats purr when content."), ("rain", "Rain falls."), ("zip", "A zip file bundles files.")]
    with pytest.warns(UserWarning, match="pooling"):
        build(corpus, index, str(tiny), quiet=True)
    return {
        "tiny": tiny,
        "rerank": checkpoint("bert", "sequence-classification", num_labels=1),
        "classify": checkpoint("bert", "sequence-classification"),
        "notes": index,
    }


def models(folders) -> list[str]:
    return [arg for name in ("tiny", "rerank", "classify") for arg in ("--model", f"{name}={folders[name]}")]


@pytest.fixture(scope="module")
def server(folders):
    """One server of the three models and the index, its read timeout from the environment, its idle timeout
    from the command line."""
    args = [*models(folders), "--index", f"notes={folders['notes']}", "--keep-alive-timeout", str(KEEP_ALIVE_S)]
    args += ["--max-inputs", "64"]
    process = launch(args, env={**os.environ, "MLX_ENCODERS_READ_TIMEOUT": str(READ_TIMEOUT_S)})
    url = url_of(process)
    yield url
    assert stop(process) == 0


def connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def head(path: str, length: int) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def answer(sock: socket.socket) -> tuple[int, dict, str]:
    """(status, headers, body) of the next answer on `sock`."""
    response = http.client.HTTPResponse(sock)
    response.begin()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read().decode()


def closed(sock: socket.socket, within: float) -> bool:
    """Whether the server closes `sock` within `within` seconds (EOF or reset)."""
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def stall(url: str, path: str, body: bytes) -> socket.socket:
    """A connection that sent the headers and half of `body`, then nothing more."""
    sock = connect(url)
    sock.sendall(head(path, len(body)) + body[: len(body) // 2])
    return sock


def in_flight_at_least(url: str, count: int, seconds: float = 10) -> float:
    deadline = time.monotonic() + seconds
    while (found := metric_values(url)["mlx_encoders_requests_in_flight"]) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return found


def test_a_request_whose_client_leaves_is_not_computed_further(folders, monkeypatch):
    """A client that closes its connection while its request waits on the model: what the batcher has not run of
    it is dropped (499 in the metrics), so it does not hold the model, and every later request, for the rest."""
    from mlx_encoders import serve
    from mlx_encoders.serve.models import ServedModel

    passes = ServedModel.passes

    def slow(self):  # 0.2 s a pass: the request below takes 14 passes, about 3 s
        found = passes(self)

        def rows(items, arrays):
            time.sleep(0.2)
            return found.rows(items, arrays)

        return dataclasses.replace(found, rows=rows)

    monkeypatch.setattr(ServedModel, "passes", slow)
    with pytest.warns(UserWarning, match="pooling"):
        app = serve.app({"tiny": folders["tiny"]}, max_batch_tokens=16)
    lines = []  # the access log's lines, as uvicorn formats them
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    access = logging.getLogger("uvicorn.access")
    with in_process(app) as url:
        access.addHandler(handler)  # after uvicorn's logging set-up, which replaces the logger's handlers
        level = access.level
        access.setLevel(logging.INFO)  # as `serve --log-level info` sets it (the test server logs warnings only)
        body = json.dumps({"model": "tiny", "input": [f"text {i}" for i in range(40)]}).encode()  # 3 a batch
        sock = connect(url)
        sock.sendall(head("/v1/embeddings", len(body)) + body)
        time.sleep(0.6)
        sock.close()
        deadline = time.monotonic() + 10
        gone = 'mlx_encoders_requests_total{route="/v1/embeddings",status="499"}'
        while gone not in (found := metric_values(url)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert found.get(gone) == 1, found
        access.removeHandler(handler)
        access.setLevel(level)
        assert any(line.endswith('"POST /v1/embeddings HTTP/1.1" 499') for line in lines), lines
        time.sleep(0.5)  # a batch that was running when the client left ends
        computed = metric_values(url)['mlx_encoders_inputs_total{model="tiny"}']
        assert computed < 30, computed  # of 40: the passes run and those drawn when the client left (4 at most)
        assert call(url, "/v1/embeddings", {"model": "tiny", "input": "next"})[0] == 200


def test_a_stalled_body_gets_408_and_a_trickled_one_within_the_timeout_is_served(server):
    body = json.dumps({"model": "tiny", "input": TEXTS}).encode()
    fast = call(server, "/v1/embeddings", json.loads(body))
    assert fast[0] == 200

    def trickled() -> tuple[int, dict, str]:
        sock = connect(server)
        sock.sendall(head("/v1/embeddings", len(body)))
        pieces = [body[i : i + 8] for i in range(0, len(body), 8)]
        for piece in pieces:  # the whole body over about a third of the read timeout
            sock.sendall(piece)
            time.sleep(READ_TIMEOUT_S / 3 / len(pieces))
        return answer(sock)

    def stalled(path: str, body: dict) -> tuple[float, tuple, bool]:
        start = time.monotonic()
        sock = stall(server, path, json.dumps(body).encode())
        got = answer(sock)
        return time.monotonic() - start, got, closed(sock, 5)

    with ThreadPoolExecutor(3) as pool:
        slow = pool.submit(trickled)
        openai = pool.submit(stalled, "/v1/embeddings", {"model": "tiny", "input": "a"})
        tei = pool.submit(stalled, "/embed", {"model": "tiny", "inputs": "a"})
        status, _, text = slow.result()
        assert status == 200 and json.loads(text)["data"] == fast[1]["data"]
        for future, shape in ((openai, "openai"), (tei, "tei")):
            seconds, (status, headers, text), was_closed = future.result()
            assert status == 408 and headers["connection"] == "close" and was_closed
            assert READ_TIMEOUT_S - 0.5 < seconds < READ_TIMEOUT_S + SLACK_S
            error = json.loads(text)
            if shape == "openai":
                assert error["error"]["code"] == "read_timeout" and "--read-timeout of 3 s" in error["error"]["message"]
            else:
                assert error["error_type"] == "Validation" and "--read-timeout" in error["error"]
    assert call(server, "/health")[0] == 200


def test_headers_that_never_end_get_408_and_a_silent_connection_is_closed_when_idle(server):
    start = time.monotonic()
    unfinished, silent = connect(server), connect(server)
    unfinished.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
    assert closed(silent, KEEP_ALIVE_S + SLACK_S)  # uvicorn alone keeps a connection that never spoke forever
    status, headers, text = answer(unfinished)
    assert status == 408 and headers["connection"] == "close" and "--read-timeout" in text
    assert READ_TIMEOUT_S - 0.5 < time.monotonic() - start < READ_TIMEOUT_S + SLACK_S
    assert closed(unfinished, 5)
    kept = connect(server)  # an answered keep-alive connection closes once idle too
    kept.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert answer(kept)[0] == 200 and closed(kept, KEEP_ALIVE_S + SLACK_S)


def test_a_body_answered_unread_cannot_hold_its_connection_by_trickling(server):
    """A request answered without reading its body (404 here; 401, 413 alike) while the client sends a byte every
    so often: the connection closes soon after the read timeout, not as long as the bytes keep coming."""
    sock = connect(server)
    sock.sendall(head("/no-such-route", 10_000))
    start = time.monotonic()
    status, _, _ = answer(sock)
    assert status == 404
    sock.settimeout(1.0)
    ended = False
    while not ended and time.monotonic() - start < READ_TIMEOUT_S + KEEP_ALIVE_S + 4 * SLACK_S:
        try:
            sock.sendall(b" ")
            ended = sock.recv(1) == b""
        except TimeoutError:
            continue
        except OSError:  # reset, or a broken pipe
            ended = True
        time.sleep(0.3)
    assert ended and time.monotonic() - start < READ_TIMEOUT_S + 3 * SLACK_S


def test_sigterm_with_a_client_stalled_mid_body_exits_by_the_deadline_and_answers_the_requests_in_flight(folders):
    """The stalled client's connection is aborted `--shutdown-timeout` after SIGTERM; the four requests that
    arrived whole (held in the worker's 1.5 s batch window) are answered."""
    args = ["--model", f"tiny={folders['tiny']}", "--max-wait-ms", "1500", "--max-batch-tokens", "100000"]
    process = launch([*args, "--shutdown-timeout", str(SHUTDOWN_S)])
    url = url_of(process)
    body = {"model": "tiny", "input": TEXTS}
    stalled = stall(url, "/v1/embeddings", json.dumps(body).encode())
    try:
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(call, url, "/v1/embeddings", body) for _ in range(4)]
            in_flight = in_flight_at_least(url, 1 + 4 + 1)  # the stalled one, the four, this scrape
            start = time.monotonic()
            process.send_signal(signal.SIGTERM)
            answers = [f.result() for f in futures]
        assert process.wait(timeout=SHUTDOWN_S + 1.5 + SLACK_S) == 0
        assert time.monotonic() - start < SHUTDOWN_S + 1.5 + SLACK_S
        assert in_flight >= 6
        assert [status for status, _, _ in answers] == [200] * 4
        assert all(len(a["data"]) == len(TEXTS) for _, a, _ in answers)
        assert closed(stalled, 5)
    finally:
        stalled.close()
        if process.poll() is None:
            process.kill()


def test_sigterm_with_200_idle_connections_and_an_unread_answer_exits_by_the_deadline(folders):
    """200 keep-alive connections idle after an answer, and a client that never reads its large answer (which
    holds its connection open until the deadline aborts it)."""
    args = ["--model", f"tiny={folders['tiny']}", "--keep-alive-timeout", "600", "--max-inputs", "64"]
    process = launch([*args, "--shutdown-timeout", str(SHUTDOWN_S)])
    url = url_of(process)
    connections, opened = [], []
    try:
        for _ in range(200):
            sock = connect(url)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert answer(sock)[0] == 200
            connections.append(sock)
        unread = connect(url)
        opened.append(unread)
        unread.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        body = json.dumps({"model": "tiny", "inputs": ["word " * 4000] * 64}).encode()  # answered in megabytes
        unread.sendall(head("/tokenize", len(body)) + body)
        readable, _, _ = select.select([unread], [], [], 60)  # the answer's first bytes: it is being sent
        assert readable, "no answer to /tokenize began within 60 s"
        assert unread.recv(12, socket.MSG_PEEK) == b"HTTP/1.1 200"  # peeked: the answer stays unread
        start = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=SHUTDOWN_S + SLACK_S) == 0
        assert time.monotonic() - start < SHUTDOWN_S + SLACK_S
        assert all(closed(sock, 5) for sock in connections)
    finally:
        for sock in connections + opened:
            sock.close()
        if process.poll() is None:
            process.kill()


EMPTY = [
    ("/v1/embeddings", {"model": "tiny", "input": ""}),
    ("/v1/classify", {"model": "classify", "input": ["fine", ""]}),
    ("/predict", {"model": "classify", "inputs": ""}),
    ("/predict", {"model": "classify", "inputs": ["fine", ""]}),
    ("/predict", {"model": "classify", "inputs": [["fine", "pair"], ["fine", ""]]}),
    ("/embed", {"model": "tiny", "inputs": [""]}),
    ("/tokenize", {"model": "tiny", "inputs": ""}),
    ("/v1/rerank", {"model": "rerank", "query": "", "documents": ["d"]}),
    ("/v1/rerank", {"model": "rerank", "query": "q", "documents": ["d", {"text": ""}]}),
    ("/rerank", {"model": "rerank", "query": "q", "texts": [""]}),
    ("/v1/search", {"index": "notes", "query": ""}),
]


@pytest.mark.parametrize("path, body", EMPTY)
def test_every_route_refuses_an_empty_text_alike(server, path, body):
    status, got, _ = call(server, path, body)
    assert status == 400, got
    if path.startswith("/v1/"):
        assert got["error"]["code"] == "empty_input" and "is an empty string" in got["error"]["message"]
    else:  # TEI's 400 is an empty input
        assert got["error_type"] == "Empty" and "is an empty string" in got["error"]


# ---- random bodies

ANY = st.text(st.characters(exclude_categories=()), max_size=30)  # surrogates and control characters included
WORDS = st.text(st.sampled_from("ab cé🙂.,"), min_size=1, max_size=30)
TEXT = WORDS | ANY | st.sampled_from(["", " ", "\ud800", "word " * 300])
NUMBERS = st.integers(-3, 12) | st.integers(-(2**70), 2**70) | st.floats() | st.sampled_from([10**12, 2**63])
JSON = st.recursive(
    st.none() | st.booleans() | NUMBERS | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)
SOME_TEXTS = st.lists(WORDS, min_size=1, max_size=4)
IDS = st.lists(st.lists(st.integers(-2, 2000), max_size=6), max_size=3)
FLAG = st.booleans()
# per route: a valid body (its required fields) and its optional fields, each drawn within its documented range
VALID = {
    "/v1/embeddings": ({"model": st.just("tiny"), "input": SOME_TEXTS | WORDS | IDS}, {
        "encoding_format": st.sampled_from(["float", "base64"]), "dimensions": st.integers(1, 40),
        "input_type": st.sampled_from(["query", "document"]), "truncate": FLAG}),
    "/v1/rerank": ({"model": st.just("rerank"), "query": WORDS, "documents": SOME_TEXTS}, {
        "top_n": st.integers(1, 5), "return_documents": FLAG, "truncate": FLAG}),
    "/v1/classify": ({"model": st.just("classify"), "input": SOME_TEXTS | WORDS}, {"top_k": st.integers(1, 4)}),
    "/v1/search": ({"index": st.just("notes"), "query": WORDS}, {
        "top_k": st.integers(1, 10**12), "mode": st.sampled_from(["dense", "sparse", "hybrid"]),
        "fusion": st.sampled_from(["rrf", "weighted"]), "rrf_k": st.floats(0, 100), "alpha": st.floats(0, 1),
        "depth": st.integers(1, 10**12), "precision": st.sampled_from(["float32", "int8", "binary"])}),
    "/embed": ({"inputs": SOME_TEXTS | WORDS}, {"normalize": FLAG, "truncate": FLAG, "dimensions": st.integers(1, 40)}),
    "/embed_sparse": ({"inputs": SOME_TEXTS}, {"input_type": st.sampled_from(["query", "document"])}),
    "/rerank": ({"model": st.just("rerank"), "query": WORDS, "texts": SOME_TEXTS}, {
        "raw_scores": FLAG, "return_text": FLAG}),
    "/predict": ({"model": st.just("classify"), "inputs": SOME_TEXTS | WORDS | st.lists(st.lists(WORDS, min_size=2,
        max_size=2), min_size=1, max_size=3)}, {"raw_scores": FLAG}),
    "/tokenize": ({"model": st.just("tiny"), "inputs": SOME_TEXTS | WORDS}, {"add_special_tokens": FLAG}),
}  # fmt: skip
FIELDS = sorted({key for required, optional in VALID.values() for key in (*required, *optional)})


def bodies(path: str) -> st.SearchStrategy[bytes]:
    """`path`'s valid bodies, the same with one field (of any route) drawn from any JSON value, random JSON
    objects of the routes' fields, and random bytes."""
    required, optional = VALID[path]
    valid = st.fixed_dictionaries(required, optional=optional)
    changed = st.tuples(valid, st.sampled_from(FIELDS), JSON | NUMBERS).map(lambda v: {**v[0], v[1]: v[2]})
    junk = st.fixed_dictionaries({}, optional=dict.fromkeys(FIELDS, JSON))
    return (valid | changed | junk).map(json.dumps).map(str.encode) | st.binary(max_size=64)


REQUESTS = st.one_of([st.tuples(st.just(path), bodies(path)) for path in VALID])


def test_random_bodies_get_an_answer_below_500(server, record_property):
    """Drawn bodies on every POST route (valid ones, valid ones with a field of any JSON value, NaN and huge
    integers included, random objects and random bytes): each is answered 2xx or 4xx with a JSON body."""
    statuses, start = {}, time.monotonic()

    @settings(max_examples=FUZZ_CASES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(REQUESTS)
    def case(request):
        if time.monotonic() - start > FUZZ_BUDGET_S:
            return
        path, body = request
        status, got, _ = call(server, path, raw=body)
        assert 200 <= status < 300 or 400 <= status < 500, (path, body, status, got)
        assert isinstance(got, (dict, list)), (path, body, got)
        statuses[status] = statuses.get(status, 0) + 1

    case()
    parts = ", ".join(f"{status}: {count}" for status, count in sorted(statuses.items()))
    record_property("summary", f"serve random bodies: {sum(statuses.values())} cases ({parts})")
    assert sum(statuses.values()) >= 100 and statuses.get(200, 0) >= 20 and statuses.get(400, 0) >= 20


# ---- tokenization off the event loop


def test_health_answers_while_a_large_request_is_tokenized(folders):
    """The model's tokenization made to take 3 s (a stand-in for a request of many long texts; a few short texts
    are tokenized on the loop, quicker than a thread): /health and a request to another model answer meanwhile, as
    they could not if tokenization held the event loop."""
    from mlx_encoders import serve
    from mlx_encoders.serve.server import QUICK_TEXTS

    with pytest.warns(UserWarning, match="pooling"):
        app = serve.app({"tiny": folders["tiny"], "classify": folders["classify"]}, read_timeout=10)
    tiny = app.state.server.models["tiny"]
    tokenize, started = tiny.tokenize, threading.Event()

    def slow(*args, **kwargs):
        started.set()
        time.sleep(3)
        return tokenize(*args, **kwargs)

    tiny.tokenize = slow
    with in_process(app) as url, ThreadPoolExecutor(1) as pool:
        many = TEXTS * (QUICK_TEXTS // len(TEXTS) + 1)
        large = pool.submit(call, url, "/v1/embeddings", {"model": "tiny", "input": many})
        assert started.wait(10)
        begin = time.monotonic()
        assert call(url, "/health")[0] == 200
        assert call(url, "/v1/classify", {"model": "classify", "input": TEXTS})[0] == 200
        assert time.monotonic() - begin < 2 and not large.done()
        status, got, _ = large.result()
        assert status == 200 and len(got["data"]) == len(many)


# ---- the options


@pytest.mark.parametrize(
    "flag, env, message",
    [
        ("0", None, "argument --read-timeout: must be a number of seconds above 0, got '0'"),
        ("inf", None, "argument --read-timeout: must be a number of seconds above 0, got 'inf'"),
        (None, "abc", "$MLX_ENCODERS_READ_TIMEOUT must be a number of seconds above 0, got 'abc'"),
        (None, "-1", "$MLX_ENCODERS_READ_TIMEOUT must be a number of seconds above 0, got '-1'"),
    ],
)
def test_a_timeout_must_be_seconds_above_0(monkeypatch, capsys, flag, env, message):
    from mlx_encoders.__main__ import parser
    from mlx_encoders.serve import cli
    from mlx_encoders.serve.server import Options

    monkeypatch.delenv("MLX_ENCODERS_READ_TIMEOUT", raising=False)
    if env is not None:
        monkeypatch.setenv("MLX_ENCODERS_READ_TIMEOUT", env)
        with pytest.raises(ValueError) as error:
            cli.setting(parser().parse_args(["serve"]), "--read-timeout")
        assert str(error.value) == message
    else:
        with pytest.raises(SystemExit):
            parser().parse_args(["serve", "--read-timeout", flag])
        assert capsys.readouterr().err.strip().endswith(message)
    with pytest.raises(ValueError, match="read_timeout must be a number of seconds above 0"):
        Options(read_timeout=0)


def test_a_timeout_comes_from_its_flag_then_its_variable_then_the_default(monkeypatch):
    from mlx_encoders.__main__ import parser
    from mlx_encoders.serve import cli

    monkeypatch.delenv("MLX_ENCODERS_SHUTDOWN_TIMEOUT", raising=False)
    assert cli.setting(parser().parse_args(["serve"]), "--shutdown-timeout") == 5.0
    monkeypatch.setenv("MLX_ENCODERS_SHUTDOWN_TIMEOUT", "2.5")
    assert cli.setting(parser().parse_args(["serve"]), "--shutdown-timeout") == 2.5
    assert cli.setting(parser().parse_args(["serve", "--shutdown-timeout", "7"]), "--shutdown-timeout") == 7.0


# ---- large answers and small requests


def test_a_large_answer_is_rendered_in_send_sized_pieces_equal_to_json():
    """A large answer is written in pieces of about SEND_BYTES (never one joined copy), which together are JSON of
    the same values (its float32 vectors read back exactly); a small one is one piece."""
    from mlx_encoders.serve.server import SEND_BYTES, render

    rng = np.random.default_rng(0)
    answer = {"data": [{"index": i, "embedding": rng.standard_normal((64, 384)).astype(np.float32)} for i in range(40)]}
    pieces = render(answer)
    read = json.loads(b"".join(pieces))
    assert [row["index"] for row in read["data"]] == list(range(40))
    for row, sent in zip(read["data"], answer["data"], strict=True):
        assert np.array_equal(np.array(row["embedding"], dtype=np.float32), sent["embedding"])
    assert len(pieces) > 10 and max(map(len, pieces)) < 2 * SEND_BYTES
    assert render({"ok": True}) == [b'{"ok":true}']


def test_float32_vectors_are_written_with_the_digits_that_read_back_exactly():
    """float32 values (the vectors of every route) are written with 9 significant digits: each reads back as a float
    (never an int, even 0 or 1) equal to the float32 sent, at the ends of float32's range too; fewer bytes than
    the standard library's float64 digits; a non-finite value is refused as json.dumps refuses it."""
    from mlx_encoders.serve.server import render

    info = np.finfo(np.float32)
    edges = [0.0, -0.0, 1.0, -1.0, 0.1, 1 / 3, info.max, -info.max, info.tiny, info.smallest_subnormal, 123456792.0]
    rng = np.random.default_rng(1)
    vector = np.concatenate([np.array(edges, np.float32), rng.standard_normal(2000).astype(np.float32)])
    vector = np.concatenate(
        [vector, (rng.standard_normal(500) * 10.0 ** rng.integers(-30, 30, 500)).astype(np.float32)]
    )
    for answer in ({"embedding": vector}, {"embeddings": vector[None, :]}, [vector]):
        text = b"".join(render(answer))
        read = json.loads(text)
        values = (
            read["embedding"] if "embedding" in read else read["embeddings"][0] if "embeddings" in read else read[0]
        )
        assert all(type(v) is float for v in values)
        back = np.array(values, dtype=np.float32)
        assert np.array_equal(back.view(np.uint32), vector.view(np.uint32))  # -0.0 included
        assert len(text) < 0.75 * len(json.dumps(vector.tolist(), separators=(",", ":")))
    with pytest.raises(ValueError, match="not JSON compliant"):
        render({"embedding": np.array([0.5, np.nan], np.float32)})


def test_rendering_many_small_values_pauses_for_the_event_loop_by_time_not_per_value(monkeypatch):
    """/tokenize's answer is a list of a dict per token: a pause (a sleep's system call, tens of microseconds of
    timer slack) after each would make rendering 4,000 tokens take a tenth of a second; pauses come at most once
    per PAUSE_EVERY_S, and at least once in a render that lasts longer."""
    from mlx_encoders.serve import server

    sleeps = []
    monkeypatch.setattr(server, "time", SimpleNamespace(monotonic=time.monotonic, sleep=sleeps.append))
    tokens = [[{"id": i, "text": "word", "special": False, "start": 5 * i, "stop": 5 * i + 4} for i in range(20000)]]
    start = time.monotonic()
    pieces = server.render(tokens)
    elapsed = time.monotonic() - start
    assert json.loads(b"".join(pieces)) == tokens
    assert len(sleeps) <= elapsed / server.PAUSE_EVERY_S + 1, (len(sleeps), elapsed)
    assert elapsed < 2 * server.PAUSE_EVERY_S or sleeps


def test_a_few_short_texts_are_tokenized_on_the_event_loop_and_many_on_the_tokenizer_thread(folders):
    """No thread hop for a request of a few short texts; more than QUICK_TEXTS go to the model's tokenizer thread.
    The vectors are the same either way."""
    from mlx_encoders import serve
    from mlx_encoders.serve.server import QUICK_TEXTS

    app = serve.app({"tiny": folders["tiny"]})
    tiny = app.state.server.models["tiny"]
    tokenize, threads = tiny.tokenize, []

    def recorded(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return tokenize(*args, **kwargs)

    tiny.tokenize = recorded
    many = TEXTS * (QUICK_TEXTS // len(TEXTS) + 1)
    with in_process(app) as url:
        few = call(url, "/v1/embeddings", {"model": "tiny", "input": TEXTS[:2]})
        lots = call(url, "/v1/embeddings", {"model": "tiny", "input": many})
    assert few[0] == lots[0] == 200
    assert "tokenize" not in threads[0] and "mlx-encoders tokenize tiny" in threads[1], threads
    got = [[row["embedding"] for row in answer[1]["data"][:2]] for answer in (few, lots)]
    assert_float32_close(got[0], got[1], encoder_terms(folders["tiny"], many))

"""Retrieval on `mlx-encoders serve`: TEI's /embed_sparse for a SPLADE folder and an inference-free Router (query
and document sides), /v1/embeddings for a ColBERT folder (each embedding a list of token vectors) and /v1/search
over `--index NAME=DIR` (dense, sparse and hybrid indexes, every mode), on one launched server. Answers are checked
against sentence-transformers or the in-process `SparseEncoder.encode`, `MultiVectorEncoder.encode` and
`Index.search` of the same folders (themselves checked against sentence-transformers in test_sparse,
test_multi_vector, test_index, test_index_sparse)."""

import json
import re
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoints import make_checkpoint
from test_index import rebuild, st_model, unit_vectors, write_corpus, write_vectors
from test_index_sparse import MAX_ACTIVE_DIMS, PROMPTS
from test_multi_vector import save_colbert
from test_serve import START_TIMEOUT_S, call, launch, stop
from test_sparse import MAX_SEQ_LENGTH, save_splade
from tolerance import assert_float32_close, encoder_terms

from mlx_encoders import MultiVectorEncoder, SentenceEncoder, SparseEncoder
from mlx_encoders.embeddings.folder import folder_kind as kind_of
from mlx_encoders.index import Index, ann, build
from mlx_encoders.index.search import PRECISIONS
from mlx_encoders.serve.models import ServedModel
from mlx_encoders.serve.search import ServedIndex, open_at_start, open_index

TEXTS = ["A cat sat on the mat.", "Sparse vectors explain their matches, token by token.", "x", "Ferns like shade."]
LONG = "The quick brown fox jumps over the lazy dog, then runs far away into the forest near the river bank. " * 2
QUERIES = ["a question about files", "Ferns grow in the shade.", "what barks?"]


def save_router(folder: Path, mlm: Path) -> Path:
    """An inference-free SPLADE Router as test_sparse saves it: stored idf-like query weights (some zero), a SPLADE
    document side."""
    from sentence_transformers import SparseEncoder as STSparseEncoder
    from sentence_transformers.base.modules import Router, Transformer
    from sentence_transformers.sparse_encoder.modules import SparseStaticEmbedding, SpladePooling

    document = Transformer(str(mlm), transformer_task="fill-mask", max_seq_length=MAX_SEQ_LENGTH)
    static = SparseStaticEmbedding(tokenizer=document.tokenizer, frozen=False)
    with torch.no_grad():
        static.weight.copy_(torch.rand(static.weight.shape, generator=torch.Generator().manual_seed(1)))
        static.weight[static.weight < 0.2] = 0
    router = Router.for_query_document(query_modules=[static], document_modules=[document, SpladePooling("max")])
    STSparseEncoder(modules=[router], device="cpu", max_active_dims=MAX_ACTIVE_DIMS).save(str(folder))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    """A SPLADE (with query and document prompts), an inference-free Router and a ColBERT folder (as test_sparse
    and test_multi_vector save them), two dense models and an index built with each; a hybrid index (dense + a
    SPLADE kept to 100 weights a text, as a trained one) and a sparse-only index of the Router."""
    root = tmp_path_factory.mktemp("retrieval")
    colbert = {"strategy": "fixed", "length": 12}
    mlm = make_checkpoint(root / "mlm", "bert", "masked-lm")
    found = {
        "splade": save_splade(root / "splade", mlm, prompts=PROMPTS),
        "splade-k": save_splade(root / "splade-k", mlm, prompts=PROMPTS, max_active_dims=MAX_ACTIVE_DIMS),
        "router": save_router(root / "router", mlm),
        "colbert": save_colbert(root / "colbert", make_checkpoint(root / "encoder", "bert"), colbert),
        "dense": st_model(root / "dense"),
        "other": st_model(root / "other", seed=1),
    }
    corpus = write_corpus(root / "corpus")
    for name in ("dense", "other"):
        build(corpus, root / f"index-{name}", SentenceEncoder(found[name]), quiet=True)
        found[f"index-{name}"] = root / f"index-{name}"
    build(corpus, root / "index-hybrid", SentenceEncoder(found["dense"]), sparse_model=found["splade-k"], quiet=True)
    build(corpus, root / "index-free", None, sparse_model=found["router"], quiet=True)
    found["index-hybrid"], found["index-free"] = root / "index-hybrid", root / "index-free"
    return found


@pytest.fixture(scope="module")
def server(folders):
    """One server: the SPLADE, Router, ColBERT and dense models, and four indexes: "notes" built with the served
    dense model (shared), "more" built with a model not given by --model (loaded for it), "hybrid" (the served dense
    model and a SPLADE loaded for it) and "free" (sparse only, the served Router). Yields (url, start lines)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    args = [f"--model={name}={folders[name]}" for name in ("splade", "router", "colbert", "dense")]
    for name, folder in (("notes", "dense"), ("more", "other"), ("hybrid", "hybrid"), ("free", "free")):
        args += ["--index", f"{name}={folders[f'index-{folder}']}"]
    process = launch(args, port)
    lines, deadline = [], time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and (line := process.stdout.readline()):
        lines.append(line)
        if "listening on" in line:
            break
    else:
        process.kill()
        raise AssertionError(f"the server did not start: {lines}")
    assert re.search(r"listening on (http://\S+)", lines[-1]).group(1) == f"http://127.0.0.1:{port}"
    yield f"http://127.0.0.1:{port}", lines
    assert stop(process) == 0


def post(url: str, path: str, body: dict):
    status, answer, _ = call(url, path, body)
    assert status == 200, answer
    return answer


def sparse_dense(answer: list) -> np.ndarray:
    """TEI's sparse answer as a dense (N, V) array (V: the tiny BERT's vocabulary)."""
    out = np.zeros((len(answer), 30522), np.float32)
    for row, entries in enumerate(answer):
        ids = [e["index"] for e in entries]
        assert ids == sorted(ids) and all(e["value"] != 0 for e in entries)  # non-zero weights, by token id
        out[row, ids] = [e["value"] for e in entries]
    return out


def assert_sparse_equal(answer: list, expected: np.ndarray) -> None:
    # a weight's rounding follows its batch-mates (vocabulary-wide logits): compared densely, so that one weight
    # rounding to zero in one batch and not in the other stays a rounding difference
    np.testing.assert_allclose(sparse_dense(answer), expected, atol=1e-5, rtol=1e-5)


def matrices(answer: dict) -> list[np.ndarray]:
    assert [d["index"] for d in answer["data"]] == list(range(len(answer["data"])))
    return [np.array(d["embedding"], np.float32) for d in answer["data"]]


def assert_matrices_equal(got: list, expected: list, terms: int) -> None:
    assert len(got) == len(expected)
    for mine, theirs in zip(got, expected, strict=True):
        assert mine.ndim == 2 and mine.shape == theirs.shape
        assert_float32_close(mine, theirs, terms)


def test_each_folder_is_served_as_its_kind(folders, server, checkpoint):
    kinds = [kind_of(folders[n]) for n in ("splade", "router", "colbert", "dense")]
    assert kinds == ["sparse", "sparse", "multi-vector", "dense"]
    assert kind_of(checkpoint("bert", "sequence-classification", num_labels=1)) == "cross-encoder"
    _, lines = server
    described = {line.split()[3].rstrip(":"): line for line in lines if line.startswith("mlx-encoders serve: model")}
    assert "sparse model" in described["splade"] and "multi-vector model" in described["colbert"]
    assert "dense model" in described["dense"] and "dense model" in described["st"]  # "more"'s model, loaded for it
    assert "sparse model" in described["router"] and "sparse model" in described["splade-k"]  # loaded for "hybrid"
    indexes = [line for line in lines if line.startswith("mlx-encoders serve: index")]
    assert "notes:" in indexes[0] and "by model dense (dense)" in indexes[0] and "by model st" in indexes[1]
    assert "by model dense and sparse model splade-k (dense, sparse, hybrid)" in indexes[2]
    assert "by sparse model router (sparse)" in indexes[3]


def token_vector_folder(folder: Path, encoder: Path, transformer_config: dict | None = None) -> Path:
    """A Transformer -> Normalize folder, no Pooling: one vector per token, as a hand-made ColBERT folder is."""
    shutil.copytree(encoder, folder)
    entries = [("", "Transformer"), ("1_Normalize", "Normalize")]
    modules = [
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.base.modules.{kind.lower()}.{kind}"}
        for i, (path, kind) in enumerate(entries)
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    if transformer_config is not None:
        (folder / "sentence_bert_config.json").write_text(json.dumps(transformer_config))
    return folder


def test_a_folder_of_token_vectors_is_served_multi_vector_when_it_says_so_and_refused_otherwise(tmp_path, checkpoint):
    """No Pooling module: with ColBERT's query expansion in its Transformer config the folder is a multi-vector model;
    with no sign of its kind it is refused at start-up, naming modules.json and what to add, never served as a
    mean-pooled dense model."""
    encoder = checkpoint("bert")
    expansion = {"query_expansion": {"strategy": "fixed", "length": 12}}
    colbert = token_vector_folder(tmp_path / "expansion", encoder, expansion)
    assert kind_of(colbert) == "multi-vector"
    served = ServedModel("colbert", colbert)
    assert served.kind == "multi-vector" and isinstance(served.multi, MultiVectorEncoder)

    bare = token_vector_folder(tmp_path / "bare", encoder)
    message = f"{bare / 'modules.json'} lists a Transformer and no Pooling module"
    for refuse in (kind_of, lambda path: ServedModel("bare", path)):
        with pytest.raises(ValueError, match=re.escape(message)) as refused:
            refuse(bare)
        assert "add a MultiVectorMask module" in str(refused.value) and "add a Pooling module" in str(refused.value)
    started = subprocess.run(
        [sys.executable, "-m", "mlx_encoders", "serve", "--model", str(bare), "--port", "0"],
        capture_output=True, text=True, timeout=START_TIMEOUT_S,
    )  # fmt: skip
    assert started.returncode == 1 and "listening" not in started.stdout
    assert started.stderr.startswith("mlx-encoders serve: error: ") and message in started.stderr


def test_embed_sparse_equals_sparse_encoder(folders, server):
    url, _ = server
    encoder = SparseEncoder(folders["splade"])
    assert_sparse_equal(
        post(url, "/embed_sparse", {"model": "splade", "inputs": TEXTS}), encoder.encode(TEXTS).toarray()
    )
    assert_sparse_equal(
        post(url, "/embed_sparse", {"model": "splade", "inputs": TEXTS[0]}), encoder.encode(TEXTS[:1]).toarray()
    )

    body = {"model": "splade", "inputs": [TEXTS[0], LONG]}
    status, answer, _ = call(url, "/embed_sparse", {**body, "truncate": False})
    assert status == 422 and f"inputs[1] is longer than the {MAX_SEQ_LENGTH} tokens" in answer["error"]
    with pytest.warns(UserWarning, match="truncated"):
        expected = encoder.encode([TEXTS[0], LONG])
    answer = post(url, "/embed_sparse", body)  # cut by default, as TEI's --auto-truncate
    assert_sparse_equal(answer, expected.toarray())


def test_embed_sparse_input_type_and_prompt_name_equal_sentence_transformers(folders, server):
    from sentence_transformers import SparseEncoder as STSparseEncoder

    url, _ = server
    for name in ("splade-k", "router"):  # prompts "query: " / "passage: "; a Router's query and document routes
        st = STSparseEncoder(str(folders[name]), device="cpu")
        cases = [
            ({"input_type": "query"}, st.encode_query(TEXTS)),
            ({"input_type": "document"}, st.encode_document(TEXTS)),
            ({}, st.encode(TEXTS)),  # the Router's default route: documents, as sentence-transformers' encode
        ]
        if name == "splade-k":
            cases += [
                ({"prompt_name": "document"}, st.encode(TEXTS, prompt_name="document")),  # TEI's field: prompt only
                ({"input_type": "query", "prompt_name": "document"}, st.encode_query(TEXTS, prompt_name="document")),
            ]
        for fields, expected in cases:
            answer = post(url, "/embed_sparse", {"model": name, "inputs": TEXTS, **fields})
            assert_sparse_equal(answer, expected.to_dense().numpy())
    status, answer, _ = call(url, "/embed_sparse", {"model": "splade", "inputs": "a", "input_type": "passage"})
    assert status == 422 and '"input_type" must be "query" or "document"' in answer["error"]
    status, answer, _ = call(url, "/embed_sparse", {"model": "splade", "inputs": "a", "prompt_name": "nope"})
    assert status == 422 and "has no prompt 'nope'; its prompts: 'query', 'document'" in answer["error"]


def test_multi_vector_embeddings_equal_multi_vector_encoder(folders, server):
    url, _ = server
    encoder = MultiVectorEncoder(folders["colbert"])
    texts = [*TEXTS, LONG]
    terms = encoder_terms(folders["colbert"], texts)
    body = {"model": "colbert", "input": texts, "truncate": True}
    expected = encoder.encode(texts, convert_to_numpy=True)  # no task: up to max_seq_length, 128
    answer = post(url, "/v1/embeddings", body)
    assert_matrices_equal(matrices(answer), expected, terms)
    assert answer["usage"]["prompt_tokens"] > 0
    status, answer, _ = call(url, "/v1/embeddings", {**body, "input_type": "query", "truncate": False})
    assert status == 400 and "input[0] is longer than the 12 tokens" in answer["error"]["message"]  # fixed expansion
    queries = post(url, "/v1/embeddings", {**body, "input_type": "query"})
    with pytest.warns(UserWarning, match="fill the query_expansion length of 12"):
        expected = encoder.encode_query(texts, convert_to_numpy=True)
    assert_matrices_equal(matrices(queries), expected, terms)
    with pytest.warns(UserWarning):
        expected = encoder.encode_document(texts, convert_to_numpy=True)
    assert_matrices_equal(matrices(post(url, "/v1/embeddings", {**body, "input_type": "document"})), expected, terms)


def test_dense_input_types_equal_encode_query_and_encode_document(folders, server):
    url, _ = server
    encoder = SentenceEncoder(folders["dense"])
    for kind, expected in (("query", encoder.encode_query(TEXTS)), ("document", encoder.encode_document(TEXTS))):
        answer = post(url, "/v1/embeddings", {"model": "dense", "input": TEXTS, "input_type": kind})
        assert_float32_close([d["embedding"] for d in answer["data"]], expected, encoder_terms(folders["dense"], TEXTS))


def test_the_openai_sdk_reads_multi_vectors_as_floats_and_is_refused_base64(folders, server):
    import openai

    url, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    answer = client.embeddings.create(model="colbert", input=TEXTS[:2], encoding_format="float")
    expected = MultiVectorEncoder(folders["colbert"]).encode(TEXTS[:2], convert_to_numpy=True)
    got = [np.array(d.embedding, np.float32) for d in answer.data]
    assert_matrices_equal(got, expected, encoder_terms(folders["colbert"], TEXTS[:2]))
    with pytest.raises(openai.BadRequestError, match='each embedding is a list of token vectors.*"float"'):
        client.embeddings.create(model="colbert", input=TEXTS[:2])  # the SDK asks for base64 unless told


def test_search_equals_index_search_in_process(folders, server):
    url, _ = server
    for name, model in (("notes", "dense"), ("more", "other")):
        encoder = SentenceEncoder(folders[model])
        for precision in ("float32", "int8", "binary"):
            index = Index(folders[f"index-{model}"], encoder, precision=precision)
            for query in QUERIES:
                body = {"index": name, "query": query, "top_k": 3, "precision": precision}
                answer = post(url, "/v1/search", body)
                expected = index.search(query, 3)
                assert answer["index"] == name and answer["model"] == ("dense" if model == "dense" else "st")
                assert [(h["id"], h["text"]) for h in answer["hits"]] == [(h.id, h.text) for h in expected]
                np.testing.assert_allclose([h["score"] for h in answer["hits"]], [h.score for h in expected], atol=1e-5)
    top = post(url, "/v1/search", {"index": "notes", "query": "Ferns grow in the shade."})
    assert len(top["hits"]) == 8 and top["hits"][0]["id"] == "fern"  # top_k 10 by default; 8 documents
    for field in ("top_k", "depth"):  # past the index's bound: a 400 naming the field
        status, answer, _ = call(url, "/v1/search", {"index": "notes", "query": "Ferns", field: 20_000})
        assert status == 400 and answer["error"]["param"] == field, answer


def test_every_search_mode_equals_index_search_in_process(folders, server):
    url, _ = server
    dense, splade = SentenceEncoder(folders["dense"]), SparseEncoder(folders["splade-k"])
    weighted = {"mode": "hybrid", "fusion": "weighted", "alpha": 0.3}
    cases = [  # (index, its in-process Index, request options, the mode they give, models named in the answer)
        ("hybrid", Index(folders["index-hybrid"], dense, sparse_model=splade), [
            ({}, "dense", ("dense",)), ({"mode": "sparse"}, "sparse", ("splade-k",)),
            ({"mode": "hybrid"}, "hybrid", ("dense", "splade-k")),
            ({"mode": "hybrid", "rrf_k": 10, "depth": 3}, "hybrid", ("dense", "splade-k")),
            (weighted, "hybrid", ("dense", "splade-k")),
        ]),
        ("free", Index(folders["index-free"], sparse_model=SparseEncoder(folders["router"])), [
            ({}, "sparse", ("router",)),  # a sparse-only index: sparse by default; inference-free queries
        ]),
    ]  # fmt: skip
    for name, index, requests in cases:
        for options, mode, names in requests:
            for query in QUERIES[:2]:
                answer = post(url, "/v1/search", {"index": name, "query": query, "top_k": 4, **options})
                expected = index.search(query, 4, **options)
                assert answer["mode"] == mode and (answer["model"], answer.get("sparse_model")) == (*names, None)[:2]
                assert [(h["id"], h["text"]) for h in answer["hits"]] == [(h.id, h.text) for h in expected]
                got = [h["score"] for h in answer["hits"]]
                np.testing.assert_allclose(got, [h.score for h in expected], rtol=1e-5, atol=1e-5)
                assert answer["usage"]["prompt_tokens"] > 0


def test_concurrent_mixed_requests_equal_the_sequential_answers(server, folders):
    url, _ = server
    requests = [
        ("/embed_sparse", {"model": "splade", "inputs": TEXTS[i:]}) for i in range(4)
    ] + [
        ("/v1/embeddings", {"model": "colbert", "input": TEXTS[i:], "input_type": kind, "truncate": True})
        for i in range(4) for kind in ("query", "document")
    ] + [
        ("/v1/search", {"index": "notes", "query": q, "top_k": 4}) for q in QUERIES
    ] + [
        ("/v1/search", {"index": "hybrid", "query": q, "top_k": 4, "mode": "hybrid"}) for q in QUERIES
    ]  # fmt: skip
    sequential = [post(url, path, body) for path, body in requests]
    with ThreadPoolExecutor(8) as pool:
        concurrent = list(pool.map(lambda r: post(url, *r), requests * 2))
    terms = encoder_terms(folders["colbert"], ["[unused0] " + text for text in TEXTS])  # with a side's prompt
    for got, expected in zip(concurrent, sequential * 2, strict=True):
        if isinstance(expected, list):
            assert_sparse_equal(got, sparse_dense(expected))
        elif "hits" in expected:
            assert [h["id"] for h in got["hits"]] == [h["id"] for h in expected["hits"]]
        else:
            assert_matrices_equal(matrices(got), matrices(expected), terms)


@pytest.mark.parametrize(
    "path, body, status, message",
    [
        ("/v1/search", {"index": "nope", "query": "q"}, 404, "index 'nope' is not served; served indexes: notes, more"),
        ("/v1/search", {"query": "q"}, 400, '"index" must name a served index (notes, more, hybrid, free)'),
        (
            "/v1/search",
            {"index": "notes", "query": "q", "mode": "sparse"},
            400,
            "index 'notes' cannot answer a 'sparse' search; its modes: dense",
        ),
        ("/v1/search", {"index": "free", "query": "q", "mode": "hybrid"}, 400, "its modes: sparse"),
        ("/v1/search", {"index": "hybrid", "query": "q", "mode": "bm25"}, 400, "its modes: dense, sparse, hybrid"),
        (
            "/v1/search",
            {"index": "hybrid", "query": "q", "fusion": "max"},
            400,
            '"fusion" must be one of rrf, weighted',
        ),
        ("/v1/search", {"index": "hybrid", "query": "q", "alpha": 1.5}, 400, '"alpha" must be within [0, 1], got 1.5'),
        ("/v1/search", {"index": "hybrid", "query": "q", "rrf_k": "60"}, 400, '"rrf_k" must be a number'),
        ("/v1/search", {"index": "hybrid", "query": "q", "rrf_k": -1}, 400, '"rrf_k" must be at least 0'),
        ("/v1/search", {"index": "hybrid", "query": "q", "rrf_k": 10**400}, 400, '"rrf_k" must be a finite number'),
        ("/v1/search", {"index": "hybrid", "query": "q", "depth": 0}, 400, '"depth" must be at least 1'),
        ("/v1/search", {"index": "notes"}, 400, '"query" is required'),
        ("/v1/search", {"index": "notes", "query": "q", "top_k": 0}, 400, '"top_k" must be at least 1'),
        ("/v1/search", {"index": "notes", "query": "q", "precision": "int4"}, 400, "precision must be one of"),
        ("/v1/embeddings", {"model": "splade", "input": "a"}, 400, "'splade' is a sparse model: it serves sparse"),
        ("/v1/embeddings", {"model": "colbert", "input": "a", "dimensions": 8}, 400, '"dimensions" does not apply'),
        ("/v1/embeddings", {"model": "colbert", "input": [[101, 102]], "encoding_format": "float"}, 400, "not token"),
        ("/v1/embeddings", {"model": "dense", "input": "a", "input_type": "question"}, 400, '"input_type" must be'),
        ("/v1/rerank", {"model": "colbert", "query": "q", "documents": ["d"]}, 400, "is a multi-vector model"),
    ],
)
def test_requests_a_model_or_index_cannot_serve_get_openai_shaped_errors(server, path, body, status, message):
    url, _ = server
    got, answer, _ = call(url, path, body)
    assert got == status and message in answer["error"]["message"], answer


def test_tei_routes_name_the_kind_of_a_model_that_cannot_serve_them(server):
    url, _ = server
    status, answer, _ = call(url, "/embed_sparse", {"model": "dense", "inputs": "a"})
    assert status == 424 and "'dense' is a dense model" in answer["error"]  # TEI's status: the model cannot
    assert "models that do: splade" in answer["error"]
    status, answer, _ = call(url, "/embed", {"model": "splade", "inputs": "a"})
    assert status == 424 and "'splade' is a sparse model" in answer["error"] and answer["error_type"] == "Backend"


def test_an_index_shares_the_model_of_its_folder_loads_it_else_and_refuses_another(folders):
    dense = ServedModel("dense", folders["dense"])
    models = [dense]
    assert open_index("notes", folders["index-dense"], models, None, 8).model is dense and models == [dense]
    more = open_index("more", folders["index-other"], models, None, 8)
    assert models == [dense, more.model] and more.model.name == "st" and more.model.kind == "dense"
    with pytest.raises(ValueError, match=r"--index notes=.*index-other: the index was built with the model .*other"):
        ServedIndex("notes", folders["index-other"], Index(folders["index-other"]), dense)
    with pytest.raises(ValueError, match=r"--index gone=.*nope: .*does not exist; build the index first"):
        open_index("gone", folders["dense"] / "nope", models, None, 8)

    hybrid = open_index("hybrid", folders["index-hybrid"], models, None, 8)  # its SPLADE is not served: loaded
    assert hybrid.model is dense and models[-1] is hybrid.sparse and hybrid.sparse.name == "splade-k"
    router = ServedModel("router", folders["router"])
    free = open_index("free", folders["index-free"], [router], None, 8)
    assert (free.model, free.sparse, free.modes) == (None, router, ("sparse",))  # the served Router, shared
    with pytest.raises(ValueError, match=r"--index free=.*: the index was built with the sparse model .*router"):
        ServedIndex("free", folders["index-free"], Index(folders["index-free"]), None, hybrid.sparse)


def unwritable(folder, *args):
    raise PermissionError(13, "Permission denied", str(folder))


def test_a_served_index_builds_its_graph_at_start_up_only_and_searches_exactly_where_it_cannot(
    tmp_path, monkeypatch, capsys
):
    """At start-up the graph is built where missing (else, on a folder that cannot be written, the index is searched
    exactly); a precision first asked for in a request never builds one. Every answer equals exact search."""
    folder, vectors = tmp_path / "index", unit_vectors(40, 8, seed=0)
    write_vectors(folder, vectors)
    monkeypatch.setitem(Index.__init__.__kwdefaults__, "ann_threshold", 1)  # a graph is wanted, as at 50,000
    exact = [(h.id, h.score) for h in Index(folder, ann=False).search(vectors[7], 3)]
    with monkeypatch.context() as patch:
        patch.setattr(ann, "build", unwritable)
        cannot = open_at_start(folder)
    assert cannot.graph is None and "searching it exactly" in capsys.readouterr().err
    served = ServedIndex("v", folder, open_at_start(folder), None)
    assert (folder / "ann-float32.usearch").exists()  # searched through it where its calibration finds it faster
    monkeypatch.setattr(ann, "build", unwritable)  # from here on, a graph built would fail the request
    for precision in PRECISIONS:
        hits = served.search(precision, vectors[7], 3)
        assert [h.id for h in hits] == [i for i, _ in exact]
        np.testing.assert_allclose([h.score for h in hits], [s for _, s in exact], atol=1e-6)
    assert sorted(p.name for p in folder.glob("ann-*")) == ["ann-float32.json", "ann-float32.usearch"]


def test_a_served_index_rebuilt_meanwhile_is_opened_again(tmp_path):
    """The first search after a rebuild opens the index again and answers from the new build alone, as a new
    `Index` does (a rebuild that reuses a dropped text's row number would otherwise answer the new text)."""
    folder, vectors = tmp_path / "index", unit_vectors(7, 8, seed=0)
    write_vectors(folder, vectors[:6])
    served = ServedIndex("v", folder, Index(folder), None)
    before = served.opened["float32"]
    assert served.search("float32", vectors[5], 1)[0].id == "5"
    rebuild(folder, {str(i): vectors[i] for i in range(5)})
    rebuild(folder, {**{str(i): vectors[i] for i in range(5)}, "new": vectors[6]})
    expected = [(h.id, h.score) for h in Index(folder).search(vectors[5], 3)]
    assert [(h.id, h.score) for h in served.search("float32", vectors[5], 3)] == expected
    assert served.opened["float32"] is not before


def test_a_router_folder_in_the_models_dir_is_listed_and_served(folders, tmp_path):
    """A sentence-transformers Router folder has modules.json and no top-level config.json (its transformer lies in
    a module folder): --models-dir lists and loads it as `serve --model` does."""
    from test_serve import in_process

    from mlx_encoders import serve

    (tmp_path / "router").symlink_to(folders["router"])
    (tmp_path / "notes").mkdir()  # neither file: not a model
    with in_process(serve.app(models_dir=tmp_path)) as url:
        assert [m["name"] for m in call(url, "/api/tags")[1]["models"]] == ["router:latest"]
        status, answer, _ = call(url, "/embed_sparse", {"model": "router", "inputs": ["a cat"]})
    expected = SparseEncoder(folders["router"]).encode(["a cat"]).rows()[0]
    assert status == 200 and sorted(w["index"] for w in answer[0]) == sorted(expected[0].tolist())

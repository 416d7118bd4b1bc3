"""`mlx_encoders.index.export` / `mlx-encoders index export`: the Parquet file holds the store's documents, texts,
vectors and sparse weights (read back with pyarrow), int8 and binary vectors as sentence-transformers quantizes
them, and a damaged store is an error that leaves no file."""

import importlib
import json
import shutil
import sqlite3
import struct
import sys
from contextlib import closing
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from sentence_transformers import SentenceTransformer
from sentence_transformers.quantization import quantize_embeddings as st_quantize
from test_index import model, unit_vectors, write_corpus  # noqa: F401 (model: a fixture)
from test_index_safety import flip, sparse_rows, write_index

from mlx_encoders import SentenceEncoder
from mlx_encoders.__main__ import main as cli
from mlx_encoders.index import DamagedStore, build, export, read_corpus
from mlx_encoders.index.store import text_key

TEXTS = [f"Text number {i} of the export, with a few more words." for i in range(300)]
SHARED = 10  # documents 300-309 repeat the texts of documents 0-9


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, np.ndarray, list]:
    """(folder, vectors, sparse rows) of an index of 300 texts (dense 16-d, sparse) and 310 documents."""
    folder = tmp_path_factory.mktemp("written") / "index"
    vectors, sparse = unit_vectors(300, 16, seed=3), sparse_rows(300, seed=4)
    write_index(folder, TEXTS, vectors, sparse, shared=SHARED)
    with closing(sqlite3.connect(folder / "index.sqlite")) as con:
        con.execute("VACUUM")  # each value once in the file, for `flip`
    return folder, vectors, sparse


def text_of(document: int) -> int:
    return document % 300


def vector_column(table) -> np.ndarray:
    return np.asarray(table["vector"].combine_chunks().flatten()).reshape(table.num_rows, -1)


def test_export_holds_every_document_its_vector_and_sparse_weights(written, tmp_path, monkeypatch):
    folder, vectors, sparse = written
    module = importlib.import_module("mlx_encoders.index.export")  # `mlx_encoders.index.export` is the function
    monkeypatch.setattr(module, "BATCH", 7)  # several row groups, shared texts across them
    counts = export(folder, tmp_path / "docs.parquet", quiet=True)
    assert counts == {"documents": 310, "texts": 300, "bytes": (tmp_path / "docs.parquet").stat().st_size,
                      "path": str(tmp_path / "docs.parquet")}  # fmt: skip
    table = pq.read_table(tmp_path / "docs.parquet")
    assert table.column_names == ["id", "text", "vector", "sparse_indices", "sparse_values"]
    assert pq.ParquetFile(tmp_path / "docs.parquet").num_row_groups == 45  # 310 documents, 7 a group
    documents = range(300 + SHARED)
    assert table["id"].to_pylist() == [f"doc-{i}" for i in documents]
    assert table["text"].to_pylist() == [TEXTS[text_of(i)] for i in documents]
    assert str(table.schema.field("vector").type) == "fixed_size_list<element: float>[16]"
    np.testing.assert_array_equal(vector_column(table), vectors[[text_of(i) for i in documents]])
    assert table["sparse_indices"].to_pylist() == [sparse[text_of(i)][0].tolist() for i in documents]
    assert table["sparse_values"].to_pylist() == [sparse[text_of(i)][1].tolist() for i in documents]
    about = json.loads(table.schema.metadata[b"mlx_encoders"])
    assert {k: about[k] for k in ("model", "dimension", "similarity", "normalized", "precision", "documents")} == {
        "model": "random", "dimension": 16, "similarity": "cosine", "normalized": True, "precision": "float32",
        "documents": 310,
    }  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.parquet"]  # no temporary file left


@pytest.mark.parametrize("precision, oracle", [("int8", "int8"), ("binary", "ubinary")])
def test_quantized_vectors_are_sentence_transformers_quantization(written, tmp_path, precision, oracle):
    """int8 codes with the ranges of the whole index, binary as packed uint8 sign bits (sentence-transformers'
    ubinary; its "binary" is the same bytes shifted by -128 into int8)."""
    folder, vectors, _ = written
    export(folder, tmp_path / "docs.parquet", precision=precision, quiet=True)
    table = pq.read_table(tmp_path / "docs.parquet")
    expected = st_quantize(vectors, oracle)
    kind = {"int8": "int8", "binary": "uint8"}[precision]
    assert str(table.schema.field("vector").type) == f"fixed_size_list<element: {kind}>[{expected.shape[1]}]"
    np.testing.assert_array_equal(vector_column(table), expected[[text_of(i) for i in range(300 + SHARED)]])
    about = json.loads(table.schema.metadata[b"mlx_encoders"])
    assert about["precision"] == precision
    if precision == "int8":  # what a query needs to be quantized as the documents were
        np.testing.assert_array_equal(np.array(about["int8_ranges"], np.float32), [vectors.min(0), vectors.max(0)])


def test_a_built_index_exports_its_corpus_and_the_models_vectors(tmp_path, model):  # noqa: F811 (a fixture)
    corpus, index = write_corpus(tmp_path / "corpus"), tmp_path / "index"
    (corpus / "again.txt").write_text("Cacti store water.\n")  # a second document of one text
    build(corpus, index, model, quiet=True)
    export(index, tmp_path / "docs.parquet", quiet=True)
    table = pq.read_table(tmp_path / "docs.parquet")
    docs = read_corpus(corpus)
    assert list(zip(table["id"].to_pylist(), table["text"].to_pylist(), strict=True)) == docs
    assert table.column_names == ["id", "text", "vector"]  # no sparse model, no sparse columns
    texts = [text for _, text in docs]
    expected = SentenceTransformer(str(model), device="cpu").encode(texts, normalize_embeddings=True)
    np.testing.assert_allclose(vector_column(table), expected, atol=1e-5)

    export(index, tmp_path / "int8.parquet", precision="int8", quiet=True)
    codes = vector_column(pq.read_table(tmp_path / "int8.parquet")).astype(int)
    with pytest.warns(UserWarning, match="based on 9 embeddings"):  # few rows: ranges of little use, as its test
        encoded = SentenceEncoder(model).encode(texts, precision="int8", normalize_embeddings=True).astype(int)
    assert np.abs(codes - encoded).max() <= 1  # the same buckets, up to a float32 rounding at an edge


def damage_cases(vectors: np.ndarray, sparse: list) -> list[tuple[str, bytes | str, int]]:
    """(what, the bytes it is found by or SQL that removes it, which byte): damage SQLite's own check passes."""
    text = TEXTS[42]
    return [
        ("vector", vectors[42].astype("<f4").tobytes(), 5),
        ("text", text.encode(), 0),
        ("document id", b"doc-42" + text_key(text)[:8].encode(), 4),
        ("sparse weight", struct.pack(">d", float(sparse[42][1][2])), 6),
        ("lost document", "DELETE FROM documents WHERE id = 'doc-305'", 0),  # a lookup a damaged page sent astray
        ("lost posting", f"DELETE FROM postings WHERE term = {int(sparse[42][0][2])} AND row = 43", 0),
        ("unreadable weight", f"UPDATE postings SET weight = '' WHERE term = {int(sparse[42][0][2])} AND row = 43", 0),
    ]


def test_a_damaged_store_is_an_error_and_no_file(written, tmp_path):
    folder, vectors, sparse = written
    for name, found, at in damage_cases(vectors, sparse):
        index = tmp_path / name
        shutil.copytree(folder, index)
        if isinstance(found, str):
            with closing(sqlite3.connect(index / "index.sqlite", isolation_level=None)) as con:
                con.execute(found)
        else:
            flip(index / "index.sqlite", found, at)
        output = tmp_path / f"{name}.parquet"
        output.write_bytes(b"the previous export")
        with pytest.raises(DamagedStore, match=f"^The index store {index / 'index.sqlite'} is damaged"):
            export(index, output, quiet=True)
        assert output.read_bytes() == b"the previous export", name  # kept as it was
        assert not list(tmp_path.glob(f".{name}.parquet.*")), name  # no temporary file left


def sqlite_integer(value: int) -> tuple[int, bytes]:
    """(serial type, bytes) of an integer in an SQLite record: 0 and 1 in the type alone, else big-endian."""
    if value in (0, 1):
        return 8 + value, b""
    size = next(n for n in (1, 2, 3, 4) if value < 1 << (8 * n - 1))
    return {1: 1, 2: 2, 3: 3, 4: 4}[size], value.to_bytes(size, "big")


def test_a_posting_the_row_index_lists_twice_is_the_damaged_error(written, tmp_path):
    """One entry of the postings' row index pointed at another posting of the same text: one posting read twice,
    one lost, the total as the build counted it; export must not write that vector."""
    folder, _, _ = written
    shutil.copytree(folder, tmp_path / "index")
    store = tmp_path / "index" / "index.sqlite"
    with closing(sqlite3.connect(store)) as con:
        rows = con.execute("SELECT row, min(term), max(term) FROM postings GROUP BY row").fetchall()

    def record(row: int, term: int) -> bytes:  # an entry of the postings_row index: (row, term)
        (row_type, row_bytes), (term_type, term_bytes) = sqlite_integer(row), sqlite_integer(term)
        return bytes([3, row_type, term_type]) + row_bytes + term_bytes

    data = bytearray(store.read_bytes())
    row, first, last = next(r for r in rows if r[1] != r[2] and data.count(record(r[0], r[1])) == 1)
    at = data.index(record(row, first))
    data[at : at + len(record(row, first))] = record(row, last)
    store.write_bytes(bytes(data))
    with pytest.raises(DamagedStore, match="a text's term is posted twice in the inverted index"):
        export(tmp_path / "index", tmp_path / "out.parquet", quiet=True)
    assert not (tmp_path / "out.parquet").exists()


def test_an_output_that_cannot_be_written_is_named_before_any_work(written, tmp_path):
    folder, _, _ = written
    with pytest.raises(ValueError, match=f"{tmp_path / 'missing'} is not a folder; create it first"):
        export(folder, tmp_path / "missing" / "out.parquet", quiet=True)
    with pytest.raises(ValueError, match=f"{tmp_path} is a folder; give the path of the file to write"):
        export(folder, tmp_path, quiet=True)


def test_an_export_removes_what_killed_exports_to_its_file_left(written, tmp_path):
    import os
    import socket
    import subprocess

    folder, _, _ = written
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()  # a process that no longer runs, as an export killed by SIGKILL
    output = tmp_path / "out.parquet"
    host = socket.gethostname()
    killed, running = (
        tmp_path / f".out.parquet.{host}.{ended.pid}.tmp",
        tmp_path / f".out.parquet.{host}.{os.getppid()}.tmp",
    )
    other, elsewhere = (
        tmp_path / f".other.parquet.{host}.{ended.pid}.tmp",
        tmp_path / f".out.parquet.mac2.{ended.pid}.tmp",
    )
    for path in (killed, running, other, elsewhere):
        path.write_bytes(b"half a file")
    export(folder, output, quiet=True)
    assert pq.read_table(output).num_rows == 300 + SHARED and not killed.exists()
    # a running export's file, another output's, and one of another host (whose process cannot be seen) stay
    assert running.exists() and other.exists() and elsewhere.exists()


def test_command_line_export(written, tmp_path, capsys, monkeypatch):
    folder, vectors, _ = written
    output = tmp_path / "docs.parquet"
    assert cli(["index", "export", "--index", str(folder), "--output", str(output), "--precision", "binary"]) == 0
    out, err = capsys.readouterr()
    assert out == f"{output}: 310 documents, 300 texts (binary)\n"
    assert f"exported 310 documents (300 texts) of {folder} to {output}" in err
    assert pq.read_schema(output).field("vector").type.list_size == 2  # 16 bits in 2 bytes

    with pytest.raises(SystemExit) as e:
        cli(["index", "export", "--index", str(folder), "--output", str(output), "--precision", "float16"])
    assert e.value.code == 2
    for module in ("pyarrow", "pyarrow.parquet"):  # as if the parquet extra were not installed
        monkeypatch.setitem(sys.modules, module, None)
    assert cli(["index", "export", "--index", str(folder), "--output", str(tmp_path / "x.parquet")]) == 1
    assert "pip install pyarrow" in capsys.readouterr().err
    assert not (tmp_path / "x.parquet").exists()

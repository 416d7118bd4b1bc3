"""The standard-library corpus: its walk is kept in the user's cache folder and read from there."""

import json

import pytest

from mlx_encoders import corpus

WALK = [("a", "x" * 50), ("b", "x" * 50 + "y"), ("c", "another docstring of more than forty characters")]


@pytest.fixture
def walks(monkeypatch, tmp_path):
    """A fake walk, counted, with an empty cache folder; the real walk is restored for later tests."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(corpus, "_walk", lambda: calls.append(1) or list(WALK))
    corpus._documents.cache_clear()
    yield calls
    corpus._documents.cache_clear()


def test_the_walk_is_written_once_and_read_after(walks, tmp_path):
    file = corpus.cache_file()
    assert file.parent == tmp_path / "mlx-encoders" and not file.exists()
    assert corpus.stdlib_documents() == WALK and len(walks) == 1
    assert json.loads(file.read_text()) == [list(pair) for pair in WALK]
    assert [p.name for p in file.parent.iterdir()] == [file.name]  # no partial file left behind
    corpus._documents.cache_clear()
    assert corpus.stdlib_documents() == WALK and len(walks) == 1  # read, not walked


@pytest.mark.parametrize("content", ["not json", "[]", '[["a"]]', '[["a", 1]]', '{"a": "b"}'])
def test_a_broken_cache_file_is_walked_again_and_replaced(walks, content):
    file = corpus.cache_file()
    file.parent.mkdir(parents=True)
    file.write_text(content)
    assert corpus.stdlib_documents() == WALK and len(walks) == 1
    assert json.loads(file.read_text()) == [list(pair) for pair in WALK]


def test_an_unwritable_cache_folder_only_costs_the_walk(walks, monkeypatch, tmp_path):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a-file"))  # the folder cannot be made
    assert corpus.stdlib_documents() == WALK and len(walks) == 1


def test_cut_texts_are_deduplicated_and_counted_after_the_cut(walks):
    assert corpus.stdlib_documents(max_chars=50) == [("a", "x" * 50), ("c", WALK[2][1][:50])]
    assert corpus.stdlib_documents(1, max_chars=50) == [("a", "x" * 50)]
    assert corpus.stdlib_docstrings(2) == [WALK[0][1], WALK[1][1]]


def test_the_cache_file_is_named_after_the_python_build(monkeypatch):
    name = corpus.cache_file().name
    monkeypatch.setattr(corpus.sys, "version", "another build")
    assert corpus.cache_file().name != name

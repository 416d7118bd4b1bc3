"""embeddings/folder.py, the one reader and writer of sentence-transformers folders: each module kind names the
class sentence-transformers loads for it, and a folder written here loads in sentence-transformers as written."""

import importlib
import json

import pytest
from checkpoints import make_checkpoint
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import Dense, Transformer
from sentence_transformers.sentence_transformer.modules import Pooling as TheirPooling
from tolerance import assert_float32_close, encoder_terms

from mlx_encoders import SentenceEncoder
from mlx_encoders.embeddings.folder import (
    KINDS,
    Pooling,
    pooling_config,
    read_folder,
    write_folder,
    write_module_config,
)

TEXTS = ["A cat sat on the mat.", "Folders are read in one place.", "x"]


def test_each_kind_is_the_sentence_transformers_class_of_that_name():
    for kind, entry in KINDS.items():
        where, name = entry.type.rsplit(".", 1)
        assert name == kind
        assert getattr(importlib.import_module(where), name).__name__ == kind, entry.type


def test_a_folder_written_here_loads_in_sentence_transformers_as_written(tmp_path):
    folder = make_checkpoint(tmp_path / "model", "bert")
    width = json.loads((folder / "config.json").read_text())["hidden_size"]
    modules = [("Transformer", ""), ("Pooling", "1_Pooling"), ("Normalize", "2_Normalize")]
    settings = {"prompts": {"query": "q: "}, "default_prompt_name": None, "similarity_fn_name": "dot"}
    write_folder(folder, modules, settings, {"max_seq_length": 12, "do_lower_case": False})
    write_module_config(folder, "1_Pooling", pooling_config(Pooling(("cls",)), width))
    write_module_config(folder, "2_Normalize", {})

    theirs = SentenceTransformer(str(folder), device="cpu")
    assert [type(m).__name__ for m in theirs] == ["Transformer", "Pooling", "Normalize"]
    assert (theirs[1].pooling_mode, theirs[1].pooling_output_dimension) == ("cls", width)
    assert (theirs.max_seq_length, theirs.prompts["query"], theirs.similarity_fn_name) == (12, "q: ", "dot")

    assert read_folder(folder).kinds == ["Transformer", "Pooling", "Normalize"]
    ours = SentenceEncoder(folder)
    assert (ours.max_seq_length, ours.prompts["query"], ours.similarity_fn_name) == (12, "q: ", "dot")
    expected = theirs.encode(TEXTS, prompt_name="query")
    assert_float32_close(ours.encode_query(TEXTS), expected, encoder_terms(folder, TEXTS))


def test_a_folder_with_dense_modules_encodes_first_from_another_thread(tmp_path):
    """The Dense weights are loaded with the model: an array left lazy belongs to the loading thread's stream."""
    from concurrent.futures import ThreadPoolExecutor

    folder = make_checkpoint(tmp_path / "model", "bert")
    width = json.loads((folder / "config.json").read_text())["hidden_size"]
    modules = [Transformer(str(folder)), TheirPooling(width), Dense(width, 16)]
    SentenceTransformer(modules=modules, device="cpu").save(str(tmp_path / "st"))
    encoder = SentenceEncoder(tmp_path / "st")
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(encoder.encode, TEXTS).result(timeout=300)
    assert_float32_close(
        first, SentenceTransformer(str(tmp_path / "st"), device="cpu").encode(TEXTS), encoder_terms(folder, TEXTS)
    )


def test_a_dense_module_that_takes_another_width_than_the_pooling_gives_is_named(tmp_path):
    folder = make_checkpoint(tmp_path / "model", "bert")
    width = json.loads((folder / "config.json").read_text())["hidden_size"]
    dense = Dense(2 * width, 16)  # the pooling gives `width`
    modules = [Transformer(str(folder)), TheirPooling(width), dense]
    SentenceTransformer(modules=modules, device="cpu").save(str(tmp_path / "st"))
    with pytest.raises(ValueError, match=f"2_Dense/config.json: this Dense module takes {2 * width} features, but"):
        SentenceEncoder(tmp_path / "st")


def test_a_pooling_of_several_modes_written_here_has_the_width_sentence_transformers_reads(tmp_path):
    folder = make_checkpoint(tmp_path / "model", "bert")
    width = json.loads((folder / "config.json").read_text())["hidden_size"]
    write_folder(folder, [("Transformer", ""), ("Pooling", "1_Pooling")], {}, {"max_seq_length": 12})
    write_module_config(folder, "1_Pooling", pooling_config(Pooling(("cls", "mean")), width))
    theirs = SentenceTransformer(str(folder), device="cpu")
    assert theirs.get_embedding_dimension() == theirs.encode(TEXTS).shape[1] == 2 * width
    assert SentenceEncoder(folder).get_embedding_dimension() == 2 * width

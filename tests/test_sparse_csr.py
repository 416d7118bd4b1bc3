"""SparseEncoder on CSR models (a dense model then sentence-transformers' `SparseAutoEncoder`) against
sentence-transformers' SparseEncoder (torch CPU): folders saved by sentence-transformers itself from a tiny seeded
BERT, with mean pooling, with Dense and Normalize between pooling and the autoencoder, with and without the
autoencoder's input standardization, prompts and `max_active_dims`.
"""

from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoints import make_checkpoint
from sentence_transformers import SparseEncoder as STSparseEncoder
from sentence_transformers.base.modules import Transformer
from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling
from sentence_transformers.sparse_encoder.modules import SparseAutoEncoder
from test_index import IDS, write_corpus
from test_serve import on_worker_thread

from mlx_encoders import SparseEncoder, SparseVectors
from mlx_encoders.index import Index, build, read_corpus
from mlx_encoders.serve.models import ServedModel

TEXTS = [
    "A cat sat on the mat.",
    "",
    "The quick brown fox jumps over the lazy dog, then runs far away into the forest near the river bank. " * 2,
    "Sparse vectors explain their matches, token by token.",
    "x",
]
HIDDEN = 96  # the autoencoder's width: the sparse vectors' dimension


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("bert"), "bert")


def save_csr(folder: Path, checkpoint: Path, normalize: bool, dense: bool = False, **kwargs) -> Path:
    transformer = Transformer(str(checkpoint), max_seq_length=24)
    modules = [transformer, Pooling(transformer.get_embedding_dimension(), "mean")]
    if dense:
        modules += [Dense(modules[-1].get_embedding_dimension(), 24, activation_function=torch.nn.Tanh()), Normalize()]
    sae = SparseAutoEncoder(modules[-2 if dense else -1].get_embedding_dimension(), HIDDEN, k=12, normalize=normalize)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # zeros at initialization: random biases so that a missed subtraction shows
        sae.pre_bias.copy_(0.1 * torch.randn(sae.pre_bias.shape, generator=generator))
        sae.latent_bias.copy_(0.1 * torch.randn(sae.latent_bias.shape, generator=generator))
    STSparseEncoder(modules=[*modules, sae], device="cpu", **kwargs).save(str(folder))
    return folder


def dense(x) -> np.ndarray:
    return x.to_dense().numpy() if isinstance(x, torch.Tensor) else x.toarray()


@pytest.mark.parametrize("normalize, with_dense", [(False, False), (True, False), (True, True)])
def test_csr_matches_sentence_transformers(tmp_path, bert, normalize, with_dense):
    folder = save_csr(tmp_path / "st", bert, normalize, with_dense)
    st, encoder = STSparseEncoder(str(folder), device="cpu"), SparseEncoder(folder)
    assert encoder.max_active_dims == st.max_active_dims == 12
    assert encoder.get_embedding_dimension() == st.get_embedding_dimension() == HIDDEN
    expected = dense(st.encode(TEXTS, batch_size=2))
    with pytest.warns(UserWarning, match="1 of 5 texts are longer than max_seq_length=24"):
        got = encoder.encode(TEXTS, batch_size=2)
    assert isinstance(got, SparseVectors) and got.shape == (len(TEXTS), HIDDEN)
    np.testing.assert_array_equal(np.count_nonzero(got.toarray(), axis=1), np.count_nonzero(expected, axis=1))
    np.testing.assert_allclose(got.toarray(), expected, atol=1e-5, rtol=1e-5)
    assert 0 < got.nnz <= 12 * len(TEXTS)
    for limit in (3, 40):  # fewer than k, and more: the autoencoder's own top-k takes the limit
        np.testing.assert_allclose(
            encoder.encode(TEXTS, max_active_dims=limit).toarray(),
            dense(st.encode(TEXTS, max_active_dims=limit)),
            atol=1e-5,
            rtol=1e-5,
        )


def test_csr_prompts_and_similarity_match(tmp_path, bert):
    prompts = {"query": "query: ", "document": "passage: "}
    folder = save_csr(tmp_path / "st", bert, normalize=True, prompts=prompts, max_active_dims=8)
    st, encoder = STSparseEncoder(str(folder), device="cpu"), SparseEncoder(folder)
    texts = TEXTS[:2] + TEXTS[3:]
    queries, docs = encoder.encode_query(texts), encoder.encode_document(texts)
    np.testing.assert_allclose(queries.toarray(), dense(st.encode_query(texts)), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(docs.toarray(), dense(st.encode_document(texts)), atol=1e-5, rtol=1e-5)
    assert np.all(np.count_nonzero(docs.toarray(), axis=1) <= 8)
    np.testing.assert_allclose(
        encoder.similarity(queries, docs), st.similarity(st.encode_query(texts), st.encode_document(texts)), rtol=1e-5
    )
    single = encoder.encode(texts[0], convert_to_sparse_tensor=False)
    np.testing.assert_allclose(single, st.encode(texts[0]).to_dense().numpy(), atol=1e-5, rtol=1e-5)


def test_csr_without_autoencoder_weights_is_refused_by_file(tmp_path, bert):
    folder = save_csr(tmp_path / "st", bert, normalize=False)
    (folder / "2_SparseAutoEncoder" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="No model.safetensors in .*2_SparseAutoEncoder"):
        SparseEncoder(folder)


def test_csr_is_served_and_indexed(tmp_path, bert):
    folder = save_csr(tmp_path / "st", bert, normalize=True)
    st = STSparseEncoder(str(folder), device="cpu")
    served = ServedModel("csr", folder)
    assert served.kind == "sparse"
    texts = TEXTS[:2] + TEXTS[3:]
    rows = on_worker_thread(lambda: served.compute(served.tokenize(texts, truncate=False)))  # as the server runs it
    for (ids, values), expected in zip(rows, dense(st.encode(texts)), strict=True):
        np.testing.assert_array_equal(ids, np.flatnonzero(expected))
        np.testing.assert_allclose(values, expected[ids], atol=1e-5, rtol=1e-5)

    corpus, index = write_corpus(tmp_path / "corpus"), tmp_path / "index"
    assert build(corpus, index, None, sparse_model=folder, quiet=True)["added"] == len(IDS)
    docs = [text for _, text in read_corpus(corpus)]  # in IDS order
    query = "a question about files"
    expected = st.similarity(st.encode_query([query]), st.encode_document(docs)).numpy()[0]
    assert (expected > 0).sum() >= 3  # a random autoencoder still shares latents with several texts
    hits = Index(index).search(query, k=3)
    assert len(hits) == 3 and hits[0].score == pytest.approx(expected.max(), rel=1e-5)
    np.testing.assert_allclose([h.score for h in hits], [expected[IDS.index(h.id)] for h in hits], rtol=1e-5)

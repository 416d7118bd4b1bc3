"""SparseEncoder (SPLADE) against sentence-transformers' SparseEncoder (torch CPU), the reference it mirrors.

Tiny seeded BERT and DistilBERT masked-LMs (tests/checkpoints.py) wrapped in sentence-transformers' sparse modules
and saved by sentence-transformers itself: max and sum pooling, relu and log1p_relu, prompts, max_active_dims,
texts past the length limit in padded batches, and the inference-free Router (SparseStaticEmbedding queries).
"""

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoints import make_checkpoint
from sentence_transformers import SparseEncoder as STSparseEncoder
from sentence_transformers.base.modules import Router, Transformer
from sentence_transformers.sparse_encoder.modules import SparseStaticEmbedding, SpladePooling
from tolerance import assert_float32_close

from mlx_encoders import SparseEncoder, SparseVectors
from mlx_encoders.embeddings.sparse import sparse_dot

TEXTS = [
    "A cat sat on the mat.",
    "",
    "The quick brown fox jumps over the lazy dog, then runs far away into the forest near the river bank. " * 2,
    "Sparse vectors explain their matches, token by token.",
    "x",
    "A cat sat on the mat.",
]
MAX_SEQ_LENGTH = 24  # TEXTS[2] is longer: it is truncated to exactly the limit


@pytest.fixture(scope="module")
def mlm(tmp_path_factory) -> dict[str, Path]:
    return {t: make_checkpoint(tmp_path_factory.mktemp(t), t, "masked-lm") for t in ("bert", "distilbert")}


def save_splade(folder: Path, checkpoint: Path, strategy="max", activation="relu", **kwargs) -> Path:
    transformer = Transformer(str(checkpoint), transformer_task="fill-mask", max_seq_length=MAX_SEQ_LENGTH)
    pooling = SpladePooling(pooling_strategy=strategy, activation_function=activation)
    STSparseEncoder(modules=[transformer, pooling], device="cpu", **kwargs).save(str(folder))
    return folder


def dense(x) -> np.ndarray:
    return x.to_dense().numpy() if isinstance(x, torch.Tensor) else x.toarray()


@pytest.mark.parametrize(
    "model_type, strategy, activation",
    [("bert", "max", "relu"), ("distilbert", "max", "relu"), ("bert", "sum", "log1p_relu")],
)
def test_splade_matches_sentence_transformers(tmp_path, mlm, model_type, strategy, activation):
    folder = save_splade(tmp_path / "st", mlm[model_type], strategy, activation)
    expected = STSparseEncoder(str(folder), device="cpu").encode(TEXTS, batch_size=4)
    encoder = SparseEncoder(folder)
    with pytest.warns(UserWarning, match="1 of 6 texts are longer than max_seq_length=24"):
        got = encoder.encode(TEXTS, batch_size=4)
    assert isinstance(got, SparseVectors) and got.shape == (len(TEXTS), 30522)
    np.testing.assert_allclose(got.toarray(), dense(expected), atol=1e-5, rtol=1e-5)
    assert got.nnz == np.count_nonzero(got.toarray()) > 0
    ids, values = got[3]
    np.testing.assert_array_equal(ids, np.flatnonzero(dense(expected)[3]))
    np.testing.assert_allclose(values, dense(expected)[3][ids], atol=1e-5, rtol=1e-5)


def test_max_seq_length_is_read_and_set_as_sentence_transformers(tmp_path, mlm):
    folder = save_splade(tmp_path / "st", mlm["bert"])
    theirs, ours = STSparseEncoder(str(folder), device="cpu"), SparseEncoder(folder)
    assert ours.max_seq_length == theirs.max_seq_length == MAX_SEQ_LENGTH
    theirs.max_seq_length = ours.max_seq_length = 8
    with pytest.warns(UserWarning, match="longer than max_seq_length=8"):
        got = ours.encode(TEXTS)
    np.testing.assert_allclose(got.toarray(), dense(theirs.encode(TEXTS)), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"SparseEncoder.max_seq_length \(4096\) is more than the"):
        ours.max_seq_length = 4096


def test_query_and_document_lengths_cut_as_sentence_transformers(tmp_path, mlm):
    """sentence-transformers 6's Transformer cuts a query at query_length and a document at document_length."""
    transformer = Transformer(str(mlm["bert"]), transformer_task="fill-mask", max_seq_length=MAX_SEQ_LENGTH,
                              query_length=6, document_length=10)  # fmt: skip
    STSparseEncoder(modules=[transformer, SpladePooling("max")], device="cpu").save(str(tmp_path / "st"))
    theirs, ours = STSparseEncoder(str(tmp_path / "st"), device="cpu"), SparseEncoder(tmp_path / "st")
    assert (ours.max_length("query"), ours.max_length("document"), ours.max_length()) == (6, 10, MAX_SEQ_LENGTH)
    for method in ("encode_query", "encode_document", "encode"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the texts cut
            got = getattr(ours, method)(TEXTS).toarray()
        np.testing.assert_allclose(got, dense(getattr(theirs, method)(TEXTS)), atol=1e-5, rtol=1e-5, err_msg=method)


def test_prompts_max_active_dims_similarity_and_decode_match(tmp_path, mlm):
    prompts = {"query": "query: ", "document": "passage: "}
    folder = save_splade(tmp_path / "st", mlm["bert"], prompts=prompts)
    st, encoder = STSparseEncoder(str(folder), device="cpu"), SparseEncoder(folder)
    texts = TEXTS[:2] + TEXTS[3:]
    for method in ("encode_query", "encode_document"):
        expected = getattr(st, method)(texts, max_active_dims=7)
        got = getattr(encoder, method)(texts, max_active_dims=7)
        np.testing.assert_allclose(got.toarray(), dense(expected), atol=1e-5, rtol=1e-5)
        assert np.all(np.count_nonzero(got.toarray(), axis=1) == 7)
    queries, docs = st.encode_query(texts), st.encode_document(texts)
    ours_q, ours_d = encoder.encode_query(texts), encoder.encode_document(texts)
    np.testing.assert_allclose(encoder.similarity(ours_q, ours_d), st.similarity(queries, docs), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(
        encoder.similarity_pairwise(ours_q, ours_d), st.similarity_pairwise(queries, docs), rtol=1e-5, atol=1e-4
    )
    for i, (theirs, mine) in enumerate(zip(st.decode(queries, top_k=5), encoder.decode(ours_q, top_k=5), strict=True)):
        assert [t for t, _ in mine] == [t for t, _ in theirs]
        np.testing.assert_allclose([w for _, w in mine], [w for _, w in theirs], atol=1e-5, rtol=1e-5)
        assert encoder.decode(ours_q[i], top_k=5) == mine  # one vector's (token ids, weights) pair
    single = encoder.encode(texts[0])
    assert single.shape == (30522,) and single.toarray().shape == (30522,)
    mine, theirs = dict(encoder.decode(single)), dict(st.decode(st.encode(texts[0])))  # near-ties may swap order
    assert mine.keys() == theirs.keys() and len(mine) > 10
    np.testing.assert_allclose([mine[t] for t in theirs], list(theirs.values()), atol=1e-5, rtol=1e-5)


def test_max_active_dims_from_the_folder_and_dense_output(tmp_path, mlm):
    folder = save_splade(tmp_path / "st", mlm["distilbert"], max_active_dims=3)
    expected = STSparseEncoder(str(folder), device="cpu").encode(TEXTS[:2], convert_to_sparse_tensor=False)
    got = SparseEncoder(folder).encode(TEXTS[:2], convert_to_sparse_tensor=False)
    assert isinstance(got, np.ndarray) and got.shape == (2, 30522)
    np.testing.assert_allclose(got, expected.numpy(), atol=1e-5, rtol=1e-5)
    assert SparseEncoder(folder).encode([]).shape == (0, 30522)


def test_inference_free_router_matches_sentence_transformers(tmp_path, mlm):
    document = Transformer(str(mlm["bert"]), transformer_task="fill-mask", max_seq_length=MAX_SEQ_LENGTH)
    static = SparseStaticEmbedding(tokenizer=document.tokenizer, frozen=False)
    with torch.no_grad():  # idf-like weights, some zero, so presence alone would not pass
        static.weight.copy_(torch.rand(static.weight.shape, generator=torch.Generator().manual_seed(1)))
        static.weight[static.weight < 0.2] = 0
    router = Router.for_query_document(query_modules=[static], document_modules=[document, SpladePooling("max")])
    folder = tmp_path / "st"
    STSparseEncoder(modules=[router], device="cpu", similarity_fn_name="dot").save(str(folder))
    st, encoder = STSparseEncoder(str(folder), device="cpu"), SparseEncoder(folder)
    texts = TEXTS[:2] + TEXTS[3:]
    queries, docs = encoder.encode_query(texts), encoder.encode_document(texts)
    np.testing.assert_allclose(queries.toarray(), dense(st.encode_query(texts)), atol=1e-6)
    np.testing.assert_allclose(docs.toarray(), dense(st.encode_document(texts)), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(encoder.encode(texts).toarray(), dense(st.encode(texts)), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(
        encoder.similarity(queries, docs), st.similarity(st.encode_query(texts), st.encode_document(texts)), rtol=1e-5
    )
    limit = document.tokenizer.model_max_length  # sentence-transformers cuts a static route's text there too
    words = sorted(w for w in document.tokenizer.get_vocab() if w.isalpha() and len(w) > 3)[: limit + 50]
    with pytest.warns(UserWarning, match=f"longer than max_seq_length={limit} tokens"):
        cut = encoder.encode_query([" ".join(words)])
    np.testing.assert_allclose(cut.toarray(), dense(st.encode_query([" ".join(words)])), atol=1e-6)
    # setting the limit cuts the documents' model route; the static query route keeps cutting at its tokenizer's
    st.max_seq_length = encoder.max_seq_length = 8
    assert encoder.max_seq_length == st.max_seq_length == 8  # reads back what was set
    with pytest.warns(UserWarning):
        np.testing.assert_allclose(encoder.encode_query([" ".join(words)]).toarray(),
                                   dense(st.encode_query([" ".join(words)])), atol=1e-6)  # fmt: skip
        np.testing.assert_allclose(encoder.encode_document(texts).toarray(), dense(st.encode_document(texts)),
                                   atol=1e-5, rtol=1e-5)  # fmt: skip


def test_sparse_vectors_layout():
    vectors = SparseVectors.from_rows([(np.array([4, 1]), np.array([0.5, 2.0])), (np.zeros(0), np.zeros(0))], 6)
    assert vectors.shape == (2, 6) and vectors.nnz == 2 and len(vectors) == 2
    np.testing.assert_array_equal(vectors.toarray(), [[0, 2.0, 0, 0, 0.5, 0], [0] * 6])
    ids, values = vectors[-1]
    assert len(ids) == len(values) == 0
    with pytest.raises(TypeError, match=r"index rows with an int \(got slice\); .rows\(\) gives every row's"):
        vectors[0:2]
    assert [len(ids) for ids, _ in vectors.rows()] == [2, 0] and SparseVectors.from_rows([], 6).rows() == []
    rng = np.random.default_rng(0)
    dense = np.where(rng.random((7, 50)) < 0.2, rng.random((7, 50)), 0).astype(np.float32)
    many = SparseVectors.from_rows([(np.flatnonzero(r), r[np.flatnonzero(r)]) for r in dense], 50)
    np.testing.assert_array_equal(many.toarray(), dense)
    np.testing.assert_allclose(sparse_dot(many, many), dense @ dense.T, rtol=1e-6)


def test_splade_loss_value_and_gradients_match_sentence_transformers(tmp_path, mlm):
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss, SpladeLoss

    from mlx_encoders.train.losses.sparse import splade_loss

    columns = [TEXTS[:3] + TEXTS[4:5], TEXTS[1:5], TEXTS[2:6]]  # queries, positives, hard negatives
    weights = dict(document_regularizer_weight=3e-6, query_regularizer_weight=5e-6, document_regularizer_threshold=40)
    folder = save_splade(tmp_path / "st", mlm["bert"], strategy="sum")  # max pooling's near-ties route gradients apart
    st = STSparseEncoder(str(folder), device="cpu").train()  # SpladePooling's eval mode works in place
    for module in st.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0  # deterministic, like our eval-mode forward
    loss = SpladeLoss(st, SparseMultipleNegativesRankingLoss(st, scale=1e-5), **weights)
    expected = loss([st.preprocess(column) for column in columns], None)
    sum(expected.values()).backward()

    route = SparseEncoder(folder).route(None)
    route.model.eval()

    def total(_model) -> tuple[mx.array, dict]:
        batches = [route.tokenizer.encode_batch(c, truncation=True, max_length=route.max_seq_length) for c in columns]
        parts = splade_loss([route.pooled(route.tokenizer.pad(b)) for b in batches], scale=1e-5, **weights)
        return sum(parts.values()), parts

    (value, parts), grads = nn.value_and_grad(route.model, total)(route.model)
    assert parts.keys() == expected.keys()
    for name, part in parts.items():
        # sums over 30522 dimensions of sum-pooled weights in the thousands: float32 rounding reaches 1e-5
        np.testing.assert_allclose(part.item(), expected[name].item(), rtol=3e-5)
    assert parts["document_regularizer_loss"].item() > 0 and parts["query_regularizer_loss"].item() > 0
    torch_params = dict(st[0].auto_model.named_parameters())
    grads = dict(tree_flatten(grads))
    for name in ("cls.predictions.transform.dense.weight", "bert.encoder.layer.1.attention.self.query.weight"):
        reference = torch_params[name].grad.numpy()
        np.testing.assert_allclose(np.array(grads[name]), reference, atol=1e-5 * np.abs(reference).max(), rtol=1e-4)


def test_flops_threshold_and_ranking_loss_match_sentence_transformers():
    import mlx.core as mx
    from sentence_transformers.sparse_encoder.losses import FlopsLoss, SparseMultipleNegativesRankingLoss

    from mlx_encoders.train.losses.sparse import flops, multiple_negatives_ranking

    rng = np.random.default_rng(0)
    columns = [np.maximum(rng.normal(size=(5, 40)), 0).astype(np.float32) for _ in range(3)]
    columns[1][:2, 5:] = 0  # two rows with 5 active dimensions: under the threshold, they drop out of FLOPS
    tensors = [torch.tensor(c, requires_grad=True) for c in columns]
    model = None  # the losses' compute_loss_from_embeddings reads no model
    expected = FlopsLoss(model, threshold=6).compute_loss_from_embeddings(tensors[1])
    expected = expected + SparseMultipleNegativesRankingLoss(model, scale=2.0).compute_loss_from_embeddings(
        tensors, None
    )
    expected.backward()

    def total(*arrays):
        return flops(arrays[1], threshold=6) + multiple_negatives_ranking(list(arrays), scale=2.0)

    value, grads = mx.value_and_grad(total, argnums=(0, 1, 2))(*(mx.array(c) for c in columns))
    terms = 2 * (40 + 15)  # forward and backward: sums over the 40 dimensions and over up to 15 rows
    assert_float32_close(value.item(), expected.item(), terms)
    for ours, theirs in zip(grads, tensors, strict=True):
        assert_float32_close(np.array(ours), theirs.grad.numpy(), terms)
    assert np.abs(np.array(grads[1])[:2]).max() > 0  # ranking still reaches the rows FLOPS left out


def test_unsupported_modules_are_refused_by_name(tmp_path):
    import json

    modules = [  # a dense model: no sparse module at the end
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.base.modules.pooling.Pooling"},
    ]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match=r"\['Transformer', 'Pooling'\] are not supported"):
        SparseEncoder(tmp_path)


def test_a_bare_masked_lm_checkpoint_is_max_pooled_splade_as_sentence_transformers_builds_it(mlm):
    """Early SPLADE repositories hold the masked-LM checkpoint alone (no modules.json)."""
    expected = STSparseEncoder(str(mlm["bert"]), device="cpu").encode(TEXTS[:3], batch_size=4)
    got = SparseEncoder(mlm["bert"]).encode(TEXTS[:3], batch_size=4)
    np.testing.assert_allclose(got.toarray(), dense(expected), atol=1e-5, rtol=1e-5)


def test_bfloat16_arrays_score_and_decode_as_their_float32_values(tmp_path, mlm):
    import mlx.core as mx

    encoder = SparseEncoder(save_splade(tmp_path / "st", mlm["bert"]))
    vectors = encoder.encode(TEXTS[:3], convert_to_sparse_tensor=False)
    half = mx.array(vectors).astype(mx.bfloat16)
    widened = np.array(half.astype(mx.float32))
    np.testing.assert_array_equal(
        np.array(encoder.similarity(half, half)), np.array(encoder.similarity(widened, widened))
    )
    np.testing.assert_array_equal(
        np.array(encoder.similarity_pairwise(half, half)), np.array(encoder.similarity_pairwise(widened, widened))
    )
    assert encoder.decode(half, top_k=3) == encoder.decode(widened, top_k=3)


def test_convert_to_tensor_and_save_to_cpu_as_sentence_transformers_takes_them(tmp_path, mlm):
    folder = save_splade(tmp_path / "st", mlm["bert"])
    theirs, ours = STSparseEncoder(str(folder), device="cpu"), SparseEncoder(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the long text cut
        expected = theirs.encode(TEXTS, convert_to_tensor=False, save_to_cpu=True)
        got = ours.encode(TEXTS, convert_to_tensor=False, save_to_cpu=True)
        dense = ours.encode(TEXTS, convert_to_tensor=False, convert_to_sparse_tensor=False)
    assert isinstance(got, list) and len(got) == len(expected) == len(TEXTS)
    for mine, row, theirs_row in zip(got, dense, expected, strict=True):
        assert mine.shape == row.shape == tuple(theirs_row.shape)
        np.testing.assert_allclose(mine.toarray(), dense_numpy(theirs_row), atol=1e-5, rtol=1e-5)
        np.testing.assert_array_equal(row, mine.toarray())
    single = ours.encode(TEXTS[0], convert_to_sparse_tensor=False)
    assert single.shape == (30522,)
    np.testing.assert_array_equal(single, ours.encode(TEXTS[0]).toarray())
    positional = ours.encode(TEXTS, None, None, 32, False, False)  # sentence-transformers' convert_to_tensor
    assert isinstance(positional, list) and len(positional) == len(theirs.encode(TEXTS, None, None, 32, False, False))
    assert ours.get_sentence_embedding_dimension() == theirs.get_sentence_embedding_dimension() == 30522
    stats, one = theirs.sparsity(theirs.encode(TEXTS)), theirs.sparsity(theirs.encode(TEXTS[0]))
    for given, want in ((got, stats), (ours.encode(TEXTS), stats), (dense, stats), (ours.encode(TEXTS[0]), one)):
        found = ours.sparsity(given)
        assert found.keys() == want.keys() and found == pytest.approx(want, rel=1e-6)
    # that list scores as sentence-transformers scores its own (it failed: "A single sparse vector has no rows")
    for name in ("similarity", "similarity_pairwise"):
        want = dense_numpy(getattr(theirs, name)(expected, expected))
        np.testing.assert_allclose(np.array(getattr(ours, name)(got, got)), want, rtol=1e-4)


def dense_numpy(x) -> np.ndarray:
    return x.to_dense().numpy()

"""MultiVectorEncoder (ColBERT) against sentence-transformers' MultiVectorEncoder, and MUVERA against fastembed's
algorithm.

Tiny seeded BERT and DistilBERT encoders (tests/checkpoints.py) with a token-level Dense projection,
MultiVectorMask (punctuation skiplist) and Normalize, saved by sentence-transformers itself, with query/document
markers, query expansion ("fixed" and "min", attended or not) and documents past their length limit.
"""

import json
import string
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoints import make_checkpoint
from sentence_transformers import MultiVectorEncoder as STMultiVectorEncoder
from sentence_transformers.base.modules import Dense, Normalize, Transformer
from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

from mlx_encoders import MultiVectorEncoder, Muvera

QUERIES = ["what is a cat?", "", "where does the quick brown fox run to, and why? " * 3, "x"]
DOCUMENTS = [
    "A cat sat on the mat.",
    "",
    "The quick brown fox jumps over the lazy dog, then runs far away into the forest near the river bank. " * 2,
    "Late interaction scores every query token against every document token!",
    "x",
]


@pytest.fixture(scope="module")
def encoders(tmp_path_factory) -> dict[str, Path]:
    return {t: make_checkpoint(tmp_path_factory.mktemp(t), t) for t in ("bert", "distilbert")}


def save_colbert(folder: Path, checkpoint: Path, expansion=None, **transformer_kwargs) -> Path:
    transformer = Transformer(str(checkpoint), query_expansion=expansion, document_length=24, **transformer_kwargs)
    torch.manual_seed(0)
    dense = Dense(32, 16, bias=False, activation_function=torch.nn.Identity(), module_input_name="token_embeddings")
    modules = [transformer, dense, MultiVectorMask(skiplist_words=list(string.punctuation))]
    modules.append(Normalize(module_input_name="token_embeddings"))
    prompts = {"query": "[unused0] ", "document": "[unused1] "}
    STMultiVectorEncoder(modules=modules, device="cpu", prompts=prompts).save(str(folder))
    return folder


def assert_matrices_close(got: list, expected: list) -> None:
    assert len(got) == len(expected)
    for mine, theirs in zip(got, expected, strict=True):
        theirs = theirs.numpy() if isinstance(theirs, torch.Tensor) else theirs
        assert mine.shape == theirs.shape
        np.testing.assert_allclose(mine, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "model_type, expansion",
    [
        ("bert", {"strategy": "fixed", "length": 12}),
        ("distilbert", {"strategy": "min", "length": 10, "attend": True}),
    ],
)
def test_colbert_matches_sentence_transformers(tmp_path, encoders, model_type, expansion):
    folder = save_colbert(tmp_path / "st", encoders[model_type], expansion, query_length=20)
    st, encoder = STMultiVectorEncoder(str(folder), device="cpu"), MultiVectorEncoder(folder)
    expected_q = st.encode_query(QUERIES, batch_size=3, convert_to_numpy=True)
    expected_d = st.encode_document(DOCUMENTS, batch_size=3, convert_to_numpy=True)
    with pytest.warns(UserWarning):  # a query fills the expansion width or passes query_length
        queries = encoder.encode_query(QUERIES, batch_size=3, convert_to_numpy=True)
    with pytest.warns(UserWarning, match="1 of 5 texts are longer than 24 tokens"):
        documents = encoder.encode_document(DOCUMENTS, batch_size=3, convert_to_numpy=True)
    assert_matrices_close(queries, expected_q)
    assert_matrices_close(documents, expected_d)
    if expansion and expansion["strategy"] == "fixed":
        assert all(len(q) == 12 for q in queries)
    assert len(documents[0]) < len(st.tokenizer(["[unused1] " + DOCUMENTS[0]])["input_ids"][0])  # "." skipped
    np.testing.assert_allclose(
        encoder.similarity(queries, documents), st.similarity(expected_q, expected_d), atol=1e-4, rtol=1e-5
    )
    np.testing.assert_allclose(
        encoder.similarity_pairwise(queries, documents[:4]),
        st.similarity_pairwise(expected_q, expected_d[:4]),
        atol=1e-4,
        rtol=1e-5,
    )
    assert_matrices_close(encoder.encode(DOCUMENTS[3:], convert_to_numpy=True), st.encode(DOCUMENTS[3:]))


def test_a_dense_similarity_name_in_the_settings_falls_back_to_maxsim(tmp_path, encoders):
    """sentence-transformers ignores a legacy "cosine" or "dot" saved with a multi-vector model."""
    folder = save_colbert(tmp_path / "st", encoders["bert"])
    settings = folder / "config_sentence_transformers.json"
    settings.write_text(json.dumps({**json.loads(settings.read_text()), "similarity_fn_name": "cosine"}))
    assert STMultiVectorEncoder(str(folder), device="cpu").similarity_fn_name == "maxsim"
    assert MultiVectorEncoder(folder).similarity_fn_name == "maxsim"


def test_single_text_mx_output_and_meanmaxsim(tmp_path, encoders):
    folder = save_colbert(tmp_path / "st", encoders["bert"], {"strategy": "fixed", "length": 12})
    st = STMultiVectorEncoder(str(folder), device="cpu", similarity_fn_name="meanmaxsim")
    encoder = MultiVectorEncoder(folder, similarity_fn_name="meanmaxsim")
    query = encoder.encode_query(QUERIES[0])
    assert query.shape == (12, 16) and np.allclose(np.linalg.norm(np.array(query), axis=1), 1, atol=1e-5)
    documents = encoder.encode_document(DOCUMENTS[:2])
    expected = st.similarity(st.encode_query(QUERIES[0]), st.encode_document(DOCUMENTS[:2]))
    np.testing.assert_allclose(encoder.similarity(query, documents), expected, atol=1e-5, rtol=1e-5)
    assert encoder.encode([]) == []
    encoder.max_seq_length = 0  # refused, as SentenceEncoder and CrossEncoder refuse it (it was read as no limit)
    with pytest.raises(ValueError, match="max_seq_length must be an int >= 1, got 0"):
        encoder.encode_document(DOCUMENTS[:1])


def fastembed_fde(vectors, dim, k_sim, dim_proj, r_reps, seed, fill_empty_clusters, normalize_by_count):
    """A direct transcription of fastembed's Muvera.process (fastembed/postprocess/muvera.py), loops and all."""
    generator = np.random.default_rng(seed)
    simhash = [generator.normal(size=(dim, k_sim)) for _ in range(r_reps)]
    projections = generator.choice([-1, 1], size=(r_reps, dim, dim_proj))
    partitions = 2**k_sim
    ids = np.arange(partitions)
    xor = np.bitwise_xor(ids[:, None], ids[None, :])
    hamming = np.array([[bin(x).count("1") for x in row] for row in xor])
    out = []
    for r in range(r_reps):
        centers = np.zeros((partitions, dim))
        members = {c: [] for c in ids}
        cluster_ids = (vectors @ simhash[r] > 0) @ (1 << np.arange(k_sim))
        for c, (i, v) in zip(cluster_ids, enumerate(vectors), strict=True):
            centers[c] += v
            members[c].append(i)
        counts = np.bincount(cluster_ids, minlength=partitions)
        empty = counts == 0
        if normalize_by_count:
            centers[~empty] /= counts[~empty][:, None]
        if fill_empty_clusters:
            nearest = np.argmin(np.where(empty[None, :], 65, hamming), axis=1)
            fill = np.array([vectors[members[c][0]] for c in nearest[empty]]).reshape(-1, dim)
            centers[empty] = fill
        if dim_proj < dim:
            centers = (1 / np.sqrt(dim_proj)) * (centers @ projections[r])
        out.append(centers.flatten())
    return np.concatenate(out)


@pytest.mark.parametrize("k_sim, dim_proj", [(3, 8), (4, 16)])
def test_muvera_equals_fastembed_algorithm(k_sim, dim_proj):
    rng = np.random.default_rng(7)
    muvera = Muvera(16, k_sim=k_sim, dim_proj=dim_proj, r_reps=5, random_seed=3)
    for n in (1, 3, 40):  # one vector leaves most buckets empty
        vectors = rng.normal(size=(n, 16)).astype(np.float32)
        document = fastembed_fde(vectors, 16, k_sim, dim_proj, 5, 3, True, True)
        query = fastembed_fde(vectors, 16, k_sim, dim_proj, 5, 3, False, False)
        np.testing.assert_array_equal(muvera.process_document(vectors), document)
        np.testing.assert_array_equal(muvera.process_query(vectors), query)
        assert document.shape == (muvera.embedding_size,)


def test_muvera_dot_products_rank_like_maxsim():
    """Queries made of noisy copies of one document's tokens: the best MaxSim document must be among the FDE dot
    product's top 10 of 100 (as MUVERA retrieves candidates to rerank), and FDE scores follow MaxSim scores; FDEs
    of documents from another seed (mismatched hyperplanes) do neither."""
    rng = np.random.default_rng(0)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    documents = [unit(rng.normal(size=(20, 32))) for _ in range(100)]
    queries = [unit(documents[i][rng.choice(20, 8, replace=False)] + 0.3 * rng.normal(size=(8, 32))) for i in range(40)]
    exact = np.array([[(q @ d.T).max(axis=1).sum() for d in documents] for q in queries])
    best = exact.argmax(axis=1)
    muvera, other = Muvera(32, k_sim=4, dim_proj=16, random_seed=1), Muvera(32, k_sim=4, dim_proj=16, random_seed=2)
    fde_queries = np.stack([muvera.process_query(q) for q in queries])
    for model, recall, correlation in ((muvera, 0.8, 0.4), (other, None, None)):
        approx = fde_queries @ np.stack([model.process_document(d) for d in documents]).T
        hits = np.mean([best[i] in np.argsort(-approx[i])[:10] for i in range(40)])
        r = np.mean([np.corrcoef(exact[i], approx[i])[0, 1] for i in range(40)])
        if recall is None:
            assert hits < 0.3 and r < 0.2
        else:
            assert hits >= recall and r > correlation


def test_unsupported_modules_are_refused_by_name(tmp_path, encoders):
    folder = save_colbert(tmp_path / "st", encoders["bert"])
    text = (
        (folder / "modules.json").read_text().replace("multi_vector_mask.MultiVectorMask", "token_pooling.Hierarchical")
    )
    (folder / "modules.json").write_text(text)
    with pytest.raises(ValueError, match="module 'sentence_transformers.multi_vector_encoder.modules.token_pooling"):
        MultiVectorEncoder(folder)


def test_maxsim_ranking_loss_value_and_gradients_match_sentence_transformers(tmp_path, encoders):
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from sentence_transformers.multi_vector_encoder.losses import MultiVectorMultipleNegativesRankingLoss

    from mlx_encoders.train.losses.multi_vector import multi_vector_ranking

    columns = [("query", QUERIES), ("document", DOCUMENTS[:4]), ("document", DOCUMENTS[1:])]  # + hard negatives
    folder = save_colbert(tmp_path / "st", encoders["bert"], {"strategy": "fixed", "length": 12})
    st = STMultiVectorEncoder(str(folder), device="cpu").train()
    for module in st.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0  # deterministic, like our forward
    features = [{**st.preprocess(t, prompt=st.prompts[task], task=task), "task": task} for task, t in columns]
    expected = MultiVectorMultipleNegativesRankingLoss(st, scale=3.0)(features)
    expected.backward()

    encoder = MultiVectorEncoder(folder)
    encoder.model.eval()
    inputs = []
    for task, texts in columns:
        prompt = encoder.prompts[task]
        encodings = encoder.tokenizer.encode_batch([prompt + t for t in texts], max_length=encoder.max_length(task))
        batch, scored = encoder.batch(encodings, task)
        inputs.append((batch, mx.array(scored)))

    def loss(_model):
        embedded = [(encoder.embed(batch), scored) for batch, scored in inputs]
        return multi_vector_ranking(embedded[0], embedded[1:], scale=3.0)

    value, grads = nn.value_and_grad(encoder.model, loss)(encoder.model)
    np.testing.assert_allclose(value.item(), expected.item(), rtol=1e-5)
    grads = dict(tree_flatten(grads))
    torch_params = dict(st[0].auto_model.named_parameters())
    for name in ("encoder.layer.1.attention.self.query.weight", "embeddings.word_embeddings.weight"):
        reference = torch_params[name].grad.numpy()
        np.testing.assert_allclose(np.array(grads[name]), reference, atol=1e-5 * np.abs(reference).max(), rtol=1e-4)


def test_colbert_folders_in_pylate_or_stanford_layout_are_refused_with_the_way_to_convert_them(tmp_path, encoders):
    """Their markers, expansion and projection live where sentence-transformers 6 converts them while loading: read
    as plain folders they gave raw, unprojected token states, silently."""
    import shutil

    from mlx_encoders.embeddings.auto import load_encoder

    pylate = save_colbert(tmp_path / "pylate", encoders["bert"])
    settings = {"model_type": "ColBERT", "query_prefix": "[unused0]", "document_prefix": "[unused1]",
                "query_length": 32, "do_query_expansion": True}  # fmt: skip
    (pylate / "config_sentence_transformers.json").write_text(json.dumps(settings))
    stanford = shutil.copytree(encoders["bert"], tmp_path / "stanford")
    config = json.loads((stanford / "config.json").read_text())
    (stanford / "config.json").write_text(json.dumps({**config, "architectures": ["HF_ColBERT"]}))
    for folder, layout in ((pylate, "PyLate"), (stanford, "Stanford")):
        for load in (MultiVectorEncoder, load_encoder):
            with pytest.raises(ValueError, match=f"in {layout}'s layout.*MultiVectorEncoder\\(path\\).save"):
                load(folder)


def test_without_a_mask_module_expansion_tokens_are_not_scored_as_sentence_transformers(tmp_path, encoders):
    transformer = Transformer(str(encoders["bert"]), query_expansion={"strategy": "fixed", "length": 12})
    folder = tmp_path / "no-mask"
    STMultiVectorEncoder(modules=[transformer, Normalize(module_input_name="token_embeddings")], device="cpu").save(
        str(folder)
    )
    expected = STMultiVectorEncoder(str(folder), device="cpu").encode_query(["what is a cat?"])
    with pytest.warns(UserWarning, match="expansion tokens are not scored"):
        encoder = MultiVectorEncoder(folder)
    assert_matrices_close(encoder.encode_query(["what is a cat?"]), expected)


@pytest.mark.parametrize("length_normalize", [False, True])
def test_a_document_without_tokens_scores_as_sentence_transformers_scores_it(length_normalize):
    """Every token masked (a skiplist) leaves a document no vectors: a finite -1e9 (before normalizing), with a
    warning, where a max over nothing gave -inf (NaN in a weighted fusion, not JSON)."""
    from sentence_transformers import util

    from mlx_encoders.embeddings.multi_vector import maxsim

    rng = np.random.default_rng(0)
    queries = [rng.normal(size=(3, 4)).astype(np.float32), np.zeros((0, 4), np.float32)]
    documents = [np.zeros((0, 4), np.float32), rng.normal(size=(2, 4)).astype(np.float32)]
    expected = util.maxsim([torch.tensor(q) for q in queries], [torch.tensor(d) for d in documents],
                           length_normalize=length_normalize).numpy()  # fmt: skip
    with pytest.warns(UserWarning, match="A document without token vectors .* scores -1e\\+09"):
        got = np.array(maxsim(queries, documents, length_normalize=length_normalize))
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    with pytest.warns(UserWarning, match="without token vectors"):
        np.testing.assert_array_equal(np.array(maxsim(queries[:1], documents[:1])), [[-1e9]])  # no token at all

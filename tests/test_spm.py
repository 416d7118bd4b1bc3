"""Checkpoints that ship only a SentencePiece model (no tokenizer.json), as DeBERTa-v3 and some ALBERT and XLM-R
repositories do: the tokenizer built from the `.model` file equals transformers' tokenizer for the same folder.

The `.model` files are trained here with `sentencepiece` (a test-only dependency) on standard-library docstrings,
laid out as each architecture's real ones are (ALBERT: <pad> <unk> [CLS] [SEP]; XLM-R: sentencepiece's own
<unk> <s> </s>, shifted by transformers into fairseq's order; DeBERTa-v3: [PAD] [CLS] [SEP] [UNK], [MASK] added).
"""

import io
import json
import shutil

import numpy as np
import pytest
import sentencepiece
from tokenizers import AddedToken
from transformers import AutoTokenizer

import mlx_encoders
from mlx_encoders import Tokenizer, spm
from mlx_encoders.corpus import stdlib_docstrings

TEXTS = stdlib_docstrings(500)
PAIRS = list(zip(TEXTS[:100], TEXTS[100:200], strict=True))
MAX_LENGTH = 128
FILES = {"albert": "spiece.model", "xlm-roberta": "sentencepiece.bpe.model", "deberta-v2": "spm.model"}
TRAINING = {
    "albert": dict(model_type="unigram", pad_id=0, unk_id=1, bos_id=2, eos_id=3, bos_piece="[CLS]", eos_piece="[SEP]",
                   control_symbols=["<ctl>"], user_defined_symbols=["[MASK]", "<sym>"]),
    "xlm-roberta": dict(model_type="unigram"),
    "xlm-roberta-bpe": dict(model_type="bpe"),
    "deberta-v2": dict(model_type="unigram", pad_id=0, bos_id=1, eos_id=2, unk_id=3, pad_piece="[PAD]",
                       bos_piece="[CLS]", eos_piece="[SEP]", unk_piece="[UNK]", user_defined_symbols=["<sym>"]),
}  # fmt: skip
# (architecture, trained model, tokenizer_config.json): the options each tokenizer class reads, on and off.
CASES = [
    ("albert", "albert", {}),
    ("albert", "albert", {"do_lower_case": False, "keep_accents": True}),
    ("xlm-roberta", "xlm-roberta", {}),
    ("xlm-roberta", "xlm-roberta-bpe", {}),
    ("xlm-roberta", "albert", {"tokenizer_class": "XLMRobertaTokenizerFast"}),  # named there, no config.json
    ("deberta-v2", "deberta-v2", {}),
    ("deberta-v2", "deberta-v2", {"do_lower_case": True, "split_by_punct": True, "add_prefix_space": False}),
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """`trained(name)` -> the bytes of a SentencePiece model trained on the docstrings, built once."""
    built = {}

    def train(name: str) -> bytes:
        if name not in built:
            out = io.BytesIO()
            sentencepiece.SentencePieceTrainer.train(
                sentence_iterator=iter(TEXTS), model_writer=out, vocab_size=1000, minloglevel=2, **TRAINING[name]
            )
            built[name] = out.getvalue()
        return built[name]

    return train


@pytest.fixture
def folder(tmp_path, trained):
    """`folder(architecture, model, config)` -> a tokenizer folder with only the `.model` file and small JSONs."""

    def make(architecture: str, model: str, config: dict):
        (tmp_path / FILES[architecture]).write_bytes(trained(model))
        if "tokenizer_class" not in config:
            (tmp_path / "config.json").write_text(json.dumps({"model_type": architecture}))
        if config:
            (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
        return tmp_path

    return make


@pytest.mark.parametrize(("architecture", "model", "config"), CASES)
def test_ids_equal_transformers(folder, architecture, model, config):
    path = folder(architecture, model, config)
    ours, theirs = Tokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    options = dict(padding=True, truncation=True, max_length=MAX_LENGTH)
    for texts, pairs in [(TEXTS, None), ([a for a, _ in PAIRS], [b for _, b in PAIRS])]:
        got = ours(texts, text_pair=pairs, return_tensors="np", max_length=MAX_LENGTH)
        expected = theirs(texts, text_pair=pairs, return_token_type_ids=True, **options)
        assert got["input_ids"].shape[1] == MAX_LENGTH  # long docstrings were cut at the limit
        for name in ("input_ids", "attention_mask", "token_type_ids"):
            np.testing.assert_array_equal(got[name], np.array(expected[name]), err_msg=name)
    assert (ours.mask_token, ours.mask_token_id, ours.pad_token_id, ours.cls_token, ours.unk_token) == (
        theirs.mask_token, theirs.mask_token_id, theirs.pad_token_id, theirs.cls_token, theirs.unk_token)  # fmt: skip
    ids = theirs(TEXTS[:20])["input_ids"]
    assert [ours.decode(i) for i in ids] == theirs.batch_decode(ids, skip_special_tokens=True)
    assert ours.convert_ids_to_tokens(ids[0]) == theirs.convert_ids_to_tokens(ids[0])


def test_special_and_user_defined_pieces_match_in_raw_text(folder):
    """spm's control and user-defined pieces (and the mask token) are matched before normalization, as there."""
    path = folder("albert", "albert", {})
    ours, theirs = Tokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    text = "a <sym> b <ctl> c [MASK] d<unk> ``quoted'' Café"
    assert ours([text], return_tensors="np")["input_ids"][0].tolist() == theirs(text)["input_ids"]
    assert "<sym>" in ours.convert_ids_to_tokens(theirs(text)["input_ids"])


@pytest.mark.parametrize("architecture", ["albert", "xlm-roberta", "deberta-v2"])
@pytest.mark.parametrize("stored", ["added_tokens_decoder", "added_tokens.json"])
def test_tokens_added_after_training_keep_their_ids(folder, architecture, stored):
    """Tokens added with `add_tokens` (tokenizer_config.json's added_tokens_decoder, or transformers 4's
    added_tokens.json) are matched whole at their ids, as transformers' tokenizer for the folder does."""
    path = folder(architecture, architecture, {})
    base = AutoTokenizer.from_pretrained(path)
    # as transformers saves them: every token past the model's pieces (a mask token the model file lacks), then ours
    beyond = {i: t for i, t in base.added_tokens_decoder.items() if i >= base.vocab_size}
    beyond |= {len(base): AddedToken("<ent>", normalized=True), len(base) + 1: AddedToken("<ent2>", normalized=True)}
    added = {"<ent>": len(base), "<ent2>": len(base) + 1}
    if stored == "added_tokens.json":
        (path / "added_tokens.json").write_text(json.dumps({t.content: i for i, t in beyond.items()}))
    else:
        decoder = {str(i): {"content": t.content, **{k: getattr(t, k) for k in spm.FLAGS}} for i, t in beyond.items()}
        (path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder}))
    ours, theirs = Tokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    text = "the <ent> entity and <ent2> here, <ent>x"
    expected = theirs(text)["input_ids"]
    assert set(added.values()) <= set(expected)  # the oracle keeps them whole
    assert ours([text], return_tensors="np")["input_ids"][0].tolist() == expected


def test_load_a_checkpoint_that_ships_only_the_sentencepiece_model(checkpoint, tmp_path, trained):
    folder = shutil.copytree(checkpoint("albert", "masked-lm", vocab_size=1000), tmp_path / "albert")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    (folder / "spiece.model").write_bytes(trained("albert"))
    model, tokenizer = mlx_encoders.load(folder)
    expected = AutoTokenizer.from_pretrained(folder)(TEXTS[:8], padding=True, truncation=True, max_length=128)
    np.testing.assert_array_equal(tokenizer(TEXTS[:8], return_tensors="np")["input_ids"], expected["input_ids"])
    assert model(tokenizer(TEXTS[:2])["input_ids"]).logits.shape[-1] == 1000


def test_a_folder_without_any_tokenizer_file_says_what_it_reads(tmp_path):
    (tmp_path / "vocab.txt").write_text("[PAD]\n[UNK]\n")
    with pytest.raises(FileNotFoundError, match=r"No tokenizer.json in .*, nor a SentencePiece model \(spiece.model"):
        Tokenizer.from_pretrained(tmp_path)


def test_unknown_convention_and_corrupt_models_are_named(folder, trained):
    path = folder("albert", "albert", {})
    (path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(ValueError, match=r"spiece.model is a SentencePiece model.*model_type \('t5'\)"):
        Tokenizer.from_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": "albert"}))
    for damaged in (b"not a sentencepiece model", trained("albert")[:5000]):
        (path / "spiece.model").write_bytes(damaged)
        with pytest.raises(ValueError, match=r"spiece.model is not a valid SentencePiece model"):
            Tokenizer.from_pretrained(path)


@pytest.mark.parametrize("architecture", ["albert", "xlm-roberta", "deberta-v2"])
@pytest.mark.parametrize("key", ["extra_special_tokens", "additional_special_tokens"])
def test_extra_special_tokens_are_matched_whole(folder, architecture, key):
    """The special tokens tokenizer_config.json lists beyond the named ones (transformers 5's extra_special_tokens,
    4's additional_special_tokens) are matched whole at transformers' ids, and skipped when decoding."""
    path = folder(architecture, architecture, {key: ["<x>", "<y>"]})
    ours, theirs = Tokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    text = "the <x> entity and <y>here, <x>x"
    expected = theirs(text)["input_ids"]
    assert theirs.convert_tokens_to_ids("<x>") in expected  # the oracle keeps it whole
    assert ours([text], return_tensors="np")["input_ids"][0].tolist() == expected
    assert ours.decode(expected) == theirs.decode(expected, skip_special_tokens=True)

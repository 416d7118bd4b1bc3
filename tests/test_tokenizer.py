"""The tokenizer equals transformers' tokenizer on the same folder, for every architecture's family."""

import json
import pickle
import subprocess
import sys

import numpy as np
import pytest
from transformers import AutoTokenizer

import mlx_encoders
from mlx_encoders.models import MODEL_TYPES
from mlx_encoders.tokenizer import Tokenizer

TEXTS = ["Hello, world!", "", "Tokenizers split words like unbelievably into pieces.", "word " * 300]
PAIRS = ["What is it?", "a question", "Who?", "second " * 200]


def both(checkpoint, model_type):
    folder = checkpoint(model_type)
    _, ours = mlx_encoders.load(folder)
    return ours, AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("pairs", [None, PAIRS], ids=["single", "pairs"])
def test_ids_equal_transformers(checkpoint, model_type, pairs):
    ours, theirs = both(checkpoint, model_type)
    batch = ours(TEXTS, text_pair=pairs, padding=True, truncation=True)
    expected = theirs(TEXTS, text_pair=pairs, padding=True, truncation=True, max_length=ours.model_max_length)
    assert batch["input_ids"].shape[1] == ours.model_max_length  # the long texts were cut at the limit
    for name in ("input_ids", "attention_mask"):
        np.testing.assert_array_equal(np.array(batch[name]), np.array(expected[name]), err_msg=name)
    if "token_type_ids" in batch and "token_type_ids" in expected:
        np.testing.assert_array_equal(np.array(batch["token_type_ids"]), np.array(expected["token_type_ids"]))


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_returns_only_the_inputs_the_architecture_reads(checkpoint, model_type):
    ours, _ = both(checkpoint, model_type)
    uses_types = model_type in ("bert", "albert", "electra", "nomic_bert")
    assert ("token_type_ids" in ours(["a text"])) == uses_types


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_special_tokens_and_decode_equal_transformers(checkpoint, model_type):
    ours, theirs = both(checkpoint, model_type)
    assert (ours.mask_token, ours.mask_token_id) == (theirs.mask_token, theirs.mask_token_id)
    assert ours.pad_token_id == theirs.pad_token_id
    ids = theirs("Decode this text, please: it's fine.")["input_ids"]
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)
    assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)


def test_padding_to_max_length_and_numpy_output(checkpoint):
    ours, _ = both(checkpoint, "bert")
    batch = ours(["short"], padding="max_length", max_length=16, return_tensors="np")
    assert batch["input_ids"].shape == (1, 16) and isinstance(batch["input_ids"], np.ndarray)
    assert batch["attention_mask"].sum() == 3
    with pytest.raises(ValueError, match=r"input 1 has 8 tokens, more than padding='max_length' pads to \(4\); pass "):
        ours(["one", "one two three four five six"], padding="max_length", max_length=4, truncation=False)


def test_limit_follows_the_position_table(checkpoint):
    ours, _ = both(checkpoint, "roberta")
    assert ours.model_max_length == 128  # 130 positions minus pad_token_id + 1


def test_bad_inputs_are_named(checkpoint):
    ours, _ = both(checkpoint, "bert")
    with pytest.raises(TypeError, match="must be str.*got int"):
        ours(["fine", 3])
    with pytest.raises(ValueError, match="2 texts but 1 text pairs"):
        ours(["a", "b"], text_pair=["c"])


@pytest.mark.parametrize("value", ["abc", -1, True, [512]])
def test_a_model_max_length_that_is_no_number_names_the_file_and_key(checkpoint, tmp_path, value):
    import json
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(checkpoint("bert"), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": value}))
    with pytest.raises(ValueError, match=r"tokenizer_config.json: model_max_length must be a positive number"):
        mlx_encoders.load(folder)


def test_a_max_length_below_the_special_tokens_is_refused(checkpoint):
    """`tokenizers` leaves every input whole when the limit cannot hold the special tokens: refused instead."""
    ours, theirs = both(checkpoint, "bert")
    assert [len(ids) for ids in ours(["a b c"], max_length=2, return_tensors="np")["input_ids"]] == [2]
    assert (
        ours(["a b c"], max_length=2)["input_ids"].tolist()
        == theirs(["a b c"], max_length=2, truncation=True)["input_ids"]
    )
    with pytest.raises(ValueError, match="max_length 1 leaves no room: the tokenizer adds 2 special tokens"):
        ours(["a b c"], max_length=1)
    with pytest.raises(ValueError, match="max_length 2 leaves no room: the tokenizer adds 3 special tokens"):
        ours(["a b c"], text_pair=["d"], max_length=2)
    assert len(ours.encode_batch(["a b c"], max_length=1, add_special_tokens=False)[0].ids) == 1


def test_tokenizer_json_truncation_and_padding_say_the_sides_a_config_leaves_unsaid(checkpoint, tmp_path):
    import shutil

    from tokenizers import Tokenizer as Backend

    folder = shutil.copytree(checkpoint("bert"), tmp_path / "bert")
    backend = Backend.from_file(str(folder / "tokenizer.json"))
    backend.enable_truncation(6, direction="left")
    backend.enable_padding(direction="left", pad_token="[PAD]")
    backend.save(str(folder / "tokenizer.json"))
    texts = ["alpha beta gamma delta epsilon zeta eta", "hi"]
    expected = AutoTokenizer.from_pretrained(folder)(texts, padding=True, truncation=True, max_length=6)["input_ids"]
    assert mlx_encoders.load(folder)[1](texts, max_length=6)["input_ids"].tolist() == expected


def test_threads_tokenizing_at_other_lengths_do_not_cut_each_others_texts(checkpoint):
    """The backend's truncation is state of its own: one thread's limit (or none) must not reach another's texts."""
    import threading

    ours, _ = both(checkpoint, "bert")
    text, failures = " ".join(["word"] * 100), []

    def work(limit: int | None) -> None:
        for _ in range(150):
            found = {len(e.ids) for e in ours.encode_batch([text] * 8, truncation=limit is not None, max_length=limit)}
            if found != {limit or 102}:
                failures.append((limit, found))

    started = [threading.Thread(target=work, args=(limit,)) for limit in (None, 16, 40, 64)]
    for t in started:
        t.start()
    for t in started:
        t.join(timeout=120)
    assert not failures, failures[:5]


@pytest.mark.parametrize(
    "model_type, options",
    [
        ("bert", {"do_lower_case": False}),
        ("bert", {"strip_accents": False}),
        ("bert", {"do_lower_case": True, "strip_accents": True, "tokenize_chinese_chars": False}),
        ("mpnet", {"do_lower_case": False}),
        ("roberta", {"add_prefix_space": True}),
        ("roberta", {"trim_offsets": False}),
        ("bert", {"split_special_tokens": True}),
        ("bert", {"extra_special_tokens": ["<NEWTOK>"]}),
        ("bert", {"additional_special_tokens": ["[unused0]"]}),  # in the vocabulary: made special
        ("bert", {"tokenizer_class": "TokenizersBackend", "do_lower_case": False}),  # tokenizer.json as it is
        ("roberta", {"tokenizer_class": "TokenizersBackend"}),
        ("xlm-roberta", {}),  # the SentencePiece classes' own normalizer and pre-tokenizer: no trailing "▁"
        ("xlm-roberta", {"add_prefix_space": False}),
        ("albert", {"keep_accents": True, "do_lower_case": False}),
        ("deberta-v2", {"do_lower_case": True, "split_by_punct": True}),
    ],
)
def test_tokenizer_config_options_apply_over_tokenizer_json_as_transformers_applies_them(
    checkpoint, tmp_path, model_type, options
):
    import json
    import shutil

    folder = shutil.copytree(checkpoint(model_type), tmp_path / model_type)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, **options}))
    text = "Héllo World, it's café 中文 ok [MASK] <mask> <NEWTOK> [unused0]  "
    theirs = AutoTokenizer.from_pretrained(folder)(text, return_offsets_mapping=True)
    expected = theirs["input_ids"]
    ours = Tokenizer.from_pretrained(folder, model_type=model_type)  # as the model's loading gives its type
    assert ours(text)["input_ids"].tolist()[0] == expected  # an added token has no embedding: the tokenizer alone
    assert ours.encode_batch([text])[0].offsets == [tuple(o) for o in theirs["offset_mapping"]]  # spans: NER, QA
    assert pickle.loads(pickle.dumps(ours))(text)["input_ids"].tolist()[0] == expected  # split_special_tokens too


def test_named_special_tokens_a_file_leaves_unflagged_are_special_as_transformers_registers_them(checkpoint, tmp_path):
    import json
    import shutil

    folder = shutil.copytree(checkpoint("bert"), tmp_path / "bert")
    state = json.loads((folder / "tokenizer.json").read_text())
    for token in state["added_tokens"]:  # as transformers 4 saved tokenizers whose specials were user pieces
        token["special"] = token["content"] not in ("[CLS]", "[SEP]", "[PAD]")
    (folder / "tokenizer.json").write_text(json.dumps(state))
    theirs, ours = AutoTokenizer.from_pretrained(folder), Tokenizer.from_pretrained(folder)
    ids = theirs(["hello world", "hi"], padding=True)["input_ids"]
    assert [ours.decode(row, skip_special_tokens=True) for row in ids] == theirs.batch_decode(ids, True)


def test_a_gte_or_jina_folder_naming_no_tokenizer_class_gets_xlm_robertas(checkpoint, tmp_path):
    import json
    import shutil

    for model_type in ("gte", "jina_embeddings_v3"):
        folder = shutil.copytree(checkpoint("xlm-roberta"), tmp_path / model_type)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config.pop("tokenizer_class", None)
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        model_config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**model_config, "model_type": model_type}))
        state = json.loads((folder / "tokenizer.json").read_text())  # the layout transformers 4 wrote
        spaces = {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "}
        state["normalizer"] = {"type": "Sequence", "normalizers": [n for n in (state["normalizer"], spaces) if n]}
        state["pre_tokenizer"] = {
            "type": "Metaspace",
            "replacement": "\u2581",
            "prepend_scheme": "always",
            "split": True,
        }
        (folder / "tokenizer.json").write_text(json.dumps(state))
        texts = ["Hello world  ", "  ", "a\n b"]
        expected = AutoTokenizer.from_pretrained(folder)(texts)["input_ids"]
        assert [e.ids for e in Tokenizer.from_pretrained(folder).encode_batch(texts)] == expected


def test_decode_batch_equals_decode_of_each_list(checkpoint):
    """What the server's /decode runs (the tokenizers library's batch decode lets other threads run meanwhile)."""
    ours = Tokenizer.from_pretrained(checkpoint("roberta"))
    lists = [ours.encode_batch([text])[0].ids for text in ("Hello , world !", "it's a test .", "")]
    for skip in (True, False):
        assert ours.decode_batch(lists, skip) == [ours.decode(ids, skip) for ids in lists]


@pytest.mark.parametrize("model_type", ["bert", "roberta", "xlm-roberta"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_long_pairs_cut_as_transformers_cuts_them(checkpoint, model_type, side):
    """Pairs of long texts are clipped before longest-first truncation (whose windows of both texts grow with the
    product of their lengths): the ids stay transformers', from either side, through words with no space."""
    ours, theirs = both(checkpoint, model_type)
    ours.truncation_side = theirs.truncation_side = side
    words = "Reranking élan naïve 東京タワー unbelievably, x" * 30
    paragraphs = "A first paragraph.\n\nThen  two spaces,\n\n\nand lines. " * 40  # lone whitespace tokens
    review = "Customer review: the product broke after a day, N" + "o" * 60  # a long word at the cut
    first = [words, "Who? " * 80, "y" * 9000, paragraphs, "这是一个很长的中文文档没有空格" * 60, review, "k" * 87]
    second = [words[::-1], "Long doc. " * 120, "tiny", paragraphs[::-1], "東京" * 700, "is it negative?", "short"]
    for limit in (14, 24):
        batch = ours(first, text_pair=second, padding=True, truncation=True, max_length=limit)
        expected = theirs(first, text_pair=second, padding=True, truncation=True, max_length=limit)
        np.testing.assert_array_equal(np.array(batch["input_ids"]), np.array(expected["input_ids"]))


def test_a_pair_of_huge_texts_takes_memory_in_proportion_to_them(checkpoint, tmp_path):
    """Two 100,000-character texts as one pair (a rerank request of 200 KB) took gigabytes in truncation."""
    script = tmp_path / "pair.py"
    script.write_text(
        "import resource, sys\n"
        "import mlx_encoders\n"
        "_, tokenizer = mlx_encoders.load(sys.argv[1])\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "for text in ('word ' * 20_000, '这是一个很长的中文文档没有空格' * 7_000):  # spaced, and without a space\n"
        "    ids = tokenizer([text], text_pair=[text], truncation=True, max_length=128)['input_ids']\n"
        "    assert len(ids[0]) == 128\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)\n"
    )
    done = subprocess.run([sys.executable, str(script), str(checkpoint("roberta"))], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) < 300  # MB


def test_a_pair_cut_from_the_left_across_blank_lines_returns_transformers_ids(checkpoint, tmp_path):
    """Byte-level BPE gives a blank line a token of its own: the clip's count did not grow, and the pair never
    returned (held in a subprocess, which a hang cannot stop the suite with)."""
    folder = checkpoint("roberta")
    first = ("lazy jumps the over dog\n\nfox lazy over fox then words jumps jumps fox fox english  fox words\n\n"
             "the text\n\nmore lazy\n\nlazy \ndog of more\n\ndog dog more quick of of\n\nenglish\n\nenglish quick "
             "and fox  lazy fox dog words then more the and over the jumps  text\n\nfox more ")  # fmt: skip
    second = ("dog lazy  jumps  words brown english then some the words and text quick\n\nsome  english \ndog quick  "
              "and some fox of  and brown dog over\n\n")  # fmt: skip
    theirs = AutoTokenizer.from_pretrained(folder)
    theirs.truncation_side = "left"
    expected = theirs([first], text_pair=[second], truncation=True, max_length=14)["input_ids"][0]
    script = tmp_path / "pair.py"
    script.write_text(
        "import json, sys\n"
        "from mlx_encoders.tokenizer import Tokenizer\n"
        "first, second = json.loads(sys.argv[2])\n"
        "ids = Tokenizer.from_pretrained(sys.argv[1]).encode_batch([first], [second], True, 14, direction='left')\n"
        "print(json.dumps(ids[0].ids))\n"
    )
    done = subprocess.run([sys.executable, str(script), str(folder), json.dumps([first, second])],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == list(expected)

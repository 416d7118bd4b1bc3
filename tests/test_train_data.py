"""Training data: readers, labels, token-label alignment (against transformers' fast tokenizer), dynamic masking and
next-sentence pairs."""

import copy
import json
import re

import mlx.core as mx
import numpy as np
import pytest
import transformers

import mlx_encoders
from mlx_encoders.train import fine_tune
from mlx_encoders.train.data import (
    DataError,
    causal_lm_data,
    collate,
    masked_lm_data,
    pretraining_data,
    read_documents,
    read_rows,
    sequence_classification_data,
    token_classification_data,
    with_prefix_space,
)
from mlx_encoders.train.losses import task_loss
from mlx_encoders.train.masking import Masker, next_sentence_pairs, replacement_ids
from mlx_encoders.train.tasks.masked_lm import masking

ROWS = [
    {"text": "a fine film", "label": "pos"},
    {"text": "dull and long", "label": "neg"},
    {"text": "it was ok", "label": "neutral"},
]
WORDS = [
    {"tokens": ["Hugging", "Face", "is", "in", "Brooklyn"], "ner_tags": ["B-ORG", "I-ORG", "O", "O", "B-LOC"]},
    {"tokens": ["unbelievably", "Zyxwvut", "said", "Obama", "."], "ner_tags": ["O", "B-PER", "O", "B-PER", "O"]},
]


@pytest.fixture(scope="module")
def bert(checkpoint):
    return checkpoint("bert", "token-classification")


@pytest.fixture(scope="module")
def tokenizer(bert):
    return mlx_encoders.load(bert)[1]


def write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# ----- readers -----


def test_jsonl_rows_keep_their_file_lines(tmp_path):
    path = write(tmp_path, "train.jsonl", "\n".join(json.dumps(r) for r in ROWS[:2]) + "\n\n" + json.dumps(ROWS[2]))
    rows = read_rows(path)
    assert [r.values for r in rows] == ROWS
    assert [r.line for r in rows] == [1, 2, 4]  # the blank line is skipped but still counted


def test_csv_and_tsv_rows(tmp_path):
    csv_path = write(tmp_path, "train.csv", 'text,label\n"a fine,\nfilm",pos\ndull,neg\n')
    rows = read_rows(csv_path)
    assert [r.values for r in rows] == [{"text": "a fine,\nfilm", "label": "pos"}, {"text": "dull", "label": "neg"}]
    assert [r.line for r in rows] == [2, 4]  # a quoted field over two lines: the row starts on line 2
    tsv_rows = read_rows(write(tmp_path, "train.tsv", "text\tlabel\na, b\t1\n"))
    assert tsv_rows[0].values == {"text": "a, b", "label": "1"}


def test_text_rows_and_documents(tmp_path):
    path = write(tmp_path, "corpus.txt", "first sentence.\nsecond one.\n\n\nother document.\n")
    assert [(r.values["text"], r.line) for r in read_rows(path)] == [
        ("first sentence.", 1),
        ("second one.", 2),
        ("other document.", 5),
    ]
    documents = read_documents(path)
    assert [[r.values["text"] for r in d] for d in documents] == [
        ["first sentence.", "second one."],
        ["other document."],
    ]


def test_iterable_of_dicts_such_as_a_datasets_dataset():
    rows = read_rows(r for r in ROWS)  # a datasets.Dataset iterates the same way: one dict per row
    assert [r.values for r in rows] == ROWS and [r.line for r in rows] == [1, 2, 3]
    assert rows[1].where == "item 2 of the data"


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("bad.jsonl", '{"text": "a"}\n{"text": oops}\n', "bad.jsonl:2: not a JSON value"),
        ("list.jsonl", '{"text": "a"}\n["a", 1]\n', "list.jsonl:2: a JSON list, not an object"),
        ("short.csv", "text,label\na,pos\nb\n", "short.csv:3: 1 fields where the header (line 1) has 2"),
        ("empty.jsonl", "\n\n", "empty.jsonl holds no rows"),
        ("header.csv", "text,label\n", "header.csv holds no rows"),
        ("data.parquet", "x", "unknown file type '.parquet'"),
    ],
)
def test_malformed_files_name_file_and_line(tmp_path, name, text, message):
    with pytest.raises(DataError, match=re.escape(message)):
        read_rows(write(tmp_path, name, text))


def test_undecodable_and_missing_files(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"fine\ncaf\xe9\n")
    with pytest.raises(DataError, match=r"latin1.txt:2: not UTF-8"):
        read_rows(path)
    with pytest.raises(DataError, match="no such file"):
        read_rows(tmp_path / "missing.jsonl")
    with pytest.raises(DataError, match="the data holds no rows"):
        read_rows([])
    with pytest.raises(DataError, match="item 2 of the data: a str, not a dict"):
        read_rows([{"text": "a"}, "b"])


@pytest.mark.parametrize(
    "rows, options, message",
    [
        ([{"text": "a", "label": "x"}, {"txt": "b", "label": "y"}], {}, r"item 2 .*no value in column 'text'"),
        ([{"text": "a", "label": "x"}, {"text": 3, "label": "y"}], {}, r"item 2 .*must hold a text, found int"),
        ([{"text": "a"}], {}, r"item 1 .*no value in column 'label'"),
        ([{"text": "a", "label": "x"}, {"text": "b", "label": 1.5}], {}, r"item 2 .*label name or id, found float"),
        ([{"text": "a", "label": 1.5}], {"problem_type": "single_label_classification"}, r"item 1 .*found float"),
        ([{"text": "a", "label": " "}], {}, r"item 1 .*empty label in column 'label'"),
        ([{"text": "a", "label": "pos"}, {"text": "b", "label": 1}], {}, r"item 2 .*label id 1 among label names"),
        ([{"text": "a", "label": "meh"}], {"label2id": {"neg": 0, "pos": 1}}, r"item 1 .*unknown label 'meh'"),
        ([{"text": "a", "label": 2}], {"label2id": {"neg": 0, "pos": 1}}, r"item 1 .*label id 2 is not one of"),
        ([{"text": "a", "label": "n/a"}], {"problem_type": "regression"}, r"item 1 .*must hold a number"),
        ([{"text": "a", "label": "pos"}], {"problem_type": "multi_label_classification"}, r"item 1 .*must hold a list"),
    ],
)
def test_bad_rows_and_labels_are_named(tokenizer, rows, options, message):
    with pytest.raises(DataError, match=message):
        sequence_classification_data(rows, tokenizer, **options)


def test_bad_row_in_a_file_names_the_file_line(tmp_path, tokenizer):
    path = write(tmp_path, "train.jsonl", '{"text": "a", "label": "pos"}\n\n{"text": "b", "label": "bad"}\n')
    with pytest.raises(DataError, match=r"train.jsonl:3: unknown label 'bad'"):
        sequence_classification_data(path, tokenizer, label2id={"neg": 0, "pos": 1})


# ----- labels -----


def test_labels_by_name_build_a_sorted_label2id(tokenizer):
    examples = sequence_classification_data(ROWS, tokenizer)
    assert examples.label2id == {"neg": 0, "neutral": 1, "pos": 2}
    assert examples.labels == [2, 0, 1]
    assert examples.encodings[0].ids == tokenizer.encode_batch(["a fine film"])[0].ids


def test_labels_by_id_and_given_label2id(tmp_path, tokenizer):
    by_id = sequence_classification_data([{"text": "a", "label": 2}, {"text": "b", "label": 0}], tokenizer)
    assert by_id.labels == [2, 0] and by_id.label2id == {"LABEL_0": 0, "LABEL_1": 1, "LABEL_2": 2}
    given = {"pos": 0, "neg": 1, "neutral": 2}
    assert sequence_classification_data(ROWS, tokenizer, label2id=given).labels == [0, 1, 2]
    csv_path = write(tmp_path, "ids.csv", "text,label\na,10\nb,2\n")  # CSV cells are text: digits are ids
    assert sequence_classification_data(csv_path, tokenizer).labels == [10, 2]
    # an id far beyond the data's classes is a typo that would build a million-way head: < 10x the distinct ids
    typo = write(tmp_path, "typo.csv", "text,label\na,0\nb,1000000\nc,1\n")
    with pytest.raises(DataError, match=r"typo.csv:3: label id 1000000 is far beyond the 3 distinct ids"):
        sequence_classification_data(typo, tokenizer)
    given = {f"LABEL_{i}": i for i in range(1000001)}  # with label2id, the classes are known
    assert sequence_classification_data(typo, tokenizer, label2id=given).labels == [0, 1000000, 1]
    one = write(tmp_path, "one.csv", "text,label\na,pos\nb,pos\n")  # one class: nothing to learn
    with pytest.raises(DataError, match=r"one.csv: every label is 'pos'; a classifier needs two classes at least"):
        sequence_classification_data(one, tokenizer)
    assert sequence_classification_data(one, tokenizer, label2id={"neg": 0, "pos": 1}).labels == [1, 1]


def test_numbers_read_as_classes_point_to_regression(tmp_path, tokenizer):
    """The problem type comes from the first label: an integer there makes the labels classes, and a fraction
    further down says the labels were numbers to predict."""
    hint = r"if the labels are numbers to predict, pass problem_type='regression' \(--problem-type regression\)"
    with pytest.raises(DataError, match=r"item 2 of the data: .* found float 3.5; " + hint):
        sequence_classification_data([{"text": "a", "label": 3}, {"text": "b", "label": 3.5}], tokenizer)
    scores = write(tmp_path, "scores.csv", "text,label\na,3\nb,3.5\n")
    with pytest.raises(DataError, match=r"scores.csv:2: label id 3 among label names \(3.5\); .*" + hint):
        sequence_classification_data(scores, tokenizer)
    assert sequence_classification_data(scores, tokenizer, problem_type="regression").labels == [3.0, 3.5]


@pytest.mark.parametrize(
    "vectors", [[[1, 0, 1, 0], [0, 0, 0, 1], [0, 0, 1, 0]], [[1, 0], [0, 1]], [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]]
)
def test_multi_hot_label_vectors_are_read_as_vectors(tokenizer, vectors):
    """transformers' multi-label targets are 0/1 vectors: rows that all are such vectors of one length are read so
    (as label ids, every target was [1, 1]); lists of names may repeat a name, as run_classification.py reads them."""
    rows = [{"text": f"t{i}", "label": v} for i, v in enumerate(vectors)]
    read = sequence_classification_data(rows, tokenizer, problem_type="multi_label_classification")
    assert read.labels == [[float(x) for x in v] for v in vectors]
    assert read.label2id == {f"LABEL_{i}": i for i in range(len(vectors[0]))}
    assert read.label_vectors
    as_numpy = [{**row, "label": np.array(row["label"])} for row in rows]  # a Dataset in numpy format gives these
    assert sequence_classification_data(as_numpy, tokenizer, problem_type="multi_label_classification").labels == (
        read.labels
    )
    named = [{"text": "a", "label": ["sports", "news", "sports"]}, {"text": "b", "label": ["tech"]}]
    read = sequence_classification_data(named, tokenizer, problem_type="multi_label_classification")
    assert read.labels == [[1.0, 1.0, 0.0], [0.0, 0.0, 1.0]] and not read.label_vectors


def test_a_row_that_breaks_the_multi_hot_vectors_is_named_and_eval_data_is_read_as_the_training_data(tokenizer):
    rows = [
        {"text": "a", "label": [1, 0, 1, 0]},
        {"text": "b", "label": [0, 0, 0, 1]},
        {"text": "c", "label": [0, 1, 1]},
    ]
    with pytest.raises(DataError, match=r"item 3 of the data: column 'label' holds \[0, 1, 1\], not a 0/1 vector of 4"):
        sequence_classification_data(rows, tokenizer, problem_type="multi_label_classification")
    rows = [{"text": t, "label": v} for t, v in zip("abcd", ([1, 0], [1, 0, 1], [0, 1, 1], [1, 1, 0]), strict=True)]
    with pytest.raises(DataError, match=r"item 1 of the data: column 'label' holds \[1, 0\], not a 0/1 vector of 3"):
        sequence_classification_data(rows, tokenizer, problem_type="multi_label_classification")  # the odd row
    repeated = [{"text": t, "label": v} for t, v in zip("abc", ([3], [2, 2], [0, 1]), strict=True)]  # ids, as run_
    read = sequence_classification_data(repeated, tokenizer, problem_type="multi_label_classification")  # classif.
    assert read.labels == [[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]]
    inferred = sequence_classification_data([{"text": "a", "label": np.array([1, 0, 1])}, {"text": "b",
                                            "label": np.array([0, 1, 0])}], tokenizer)  # fmt: skip
    assert inferred.problem_type == "multi_label_classification" and inferred.label_vectors
    ids = {f"LABEL_{i}": i for i in range(4)}  # training data of label ids: an eval row [0, 1] names two of them
    read = sequence_classification_data([{"text": "g", "label": [0, 1]}], tokenizer, label2id=ids,
                                        problem_type="multi_label_classification", label_vectors=False)  # fmt: skip
    assert read.labels == [[1.0, 1.0, 0.0, 0.0]]


def test_pairs_multi_label_and_regression(tmp_path, tokenizer):
    rows = [
        {"q": "who?", "a": "me", "tags": ["x", "z"], "score": 0.5},
        {"q": "why?", "a": "so", "tags": [], "score": 2},
    ]
    pairs = sequence_classification_data(
        rows, tokenizer, text_column="q", text_pair_column="a", label_column="score", problem_type="regression"
    )
    assert pairs.labels == [0.5, 2.0]
    assert pairs.encodings[0].ids == tokenizer.encode_batch(["who?"], ["me"])[0].ids
    multi = sequence_classification_data(
        rows, tokenizer, text_column="q", label_column="tags", problem_type="multi_label_classification"
    )
    assert multi.label2id == {"x": 0, "z": 1} and multi.labels == [[1.0, 1.0], [0.0, 0.0]]
    csv_path = write(tmp_path, "multi.csv", 'text,label\na,"[""x"", ""y""]"\n')
    assert sequence_classification_data(csv_path, tokenizer, problem_type="multi_label_classification").labels == [
        [1.0, 1.0]
    ]
    batch = collate(multi, [0, 1], tokenizer)
    assert batch["labels"].dtype == np.float32 and batch["labels"].shape == (2, 2)


def test_a_batch_goes_through_the_model_and_its_loss(checkpoint):
    model, tok = mlx_encoders.load(checkpoint("bert", "sequence-classification"))
    examples = sequence_classification_data(ROWS, tok)
    batch = {k: mx.array(v) for k, v in collate(examples, [0, 1, 2], tok).items()}
    labels = batch.pop("labels")
    loss = task_loss(model, model(**batch), labels)
    assert batch["input_ids"].shape[0] == 3 and np.isfinite(loss.item())


# ----- token classification -----


@pytest.mark.parametrize("label_all_tokens", [False, True])
def test_token_labels_align_as_transformers_tutorial(bert, tokenizer, label_all_tokens):
    examples = token_classification_data(WORDS, tokenizer, label_all_tokens=label_all_tokens)
    label2id = examples.label2id
    assert label2id == {"B-LOC": 0, "B-ORG": 1, "B-PER": 2, "I-ORG": 3, "O": 4}
    reference = transformers.AutoTokenizer.from_pretrained(bert)
    encoded = reference([r["tokens"] for r in WORDS], is_split_into_words=True, truncation=True)
    # run_ner.py's b_to_i_label: a B- tag's later sub-tokens take its I- tag, where the labels have one
    b_to_i = {
        name: name.replace("B-", "I-", 1) if name.replace("B-", "I-", 1) in label2id else name for name in label2id
    }
    for i, row in enumerate(WORDS):
        word_ids, previous, expected = encoded.word_ids(i), None, []
        for word in word_ids:  # run_ner.py's tokenize_and_align_labels
            if word is None:
                expected.append(-100)
            elif word != previous:
                expected.append(label2id[row["ner_tags"][word]])
            else:
                expected.append(label2id[b_to_i[row["ner_tags"][word]]] if label_all_tokens else -100)
            previous = word
        assert examples.encodings[i].ids == encoded["input_ids"][i]
        assert examples.labels[i] == expected
    assert any(e.count(-100) > 2 for e in examples.labels) != label_all_tokens  # some word is split
    batch = collate(examples, [0, 1], tokenizer)
    pad = batch["attention_mask"] == 0
    assert pad.any() and (batch["labels"][pad] == -100).all()


def test_token_rows_truncated_on_the_tokenizers_side(bert, tmp_path):
    """tokenizer_config.json's truncation_side="left" keeps each row's end, as run_ner.py's tokenizer call does."""
    import json
    import shutil

    folder = shutil.copytree(bert, tmp_path / "left")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "truncation_side": "left"}))
    examples = token_classification_data(WORDS, mlx_encoders.load(folder)[1], max_length=6)
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    encoded = reference([r["tokens"] for r in WORDS], is_split_into_words=True, truncation=True, max_length=6)
    assert [e.ids for e in examples.encodings] == encoded["input_ids"]


def test_token_label_ids_csv_and_errors(tmp_path, tokenizer):
    by_id = token_classification_data([{"tokens": ["a", "b"], "ner_tags": [1, 0]}], tokenizer)
    assert by_id.labels[0] == [-100, 1, 0, -100]
    path = write(tmp_path, "ner.csv", 'tokens,ner_tags\n"[""Paris""]","[""B-LOC""]"\n"[""a"", ""b""]","[""O""]"\n')
    with pytest.raises(DataError, match=r"ner.csv:3: 2 words but 1 tags"):
        token_classification_data(path, tokenizer)
    with pytest.raises(DataError, match=r"item 1 .*'tokens' must hold a list"):
        token_classification_data([{"tokens": "a b", "ner_tags": ["O", "O"]}], tokenizer)
    with pytest.raises(DataError, match=r"item 1 .*unknown label 'B-XYZ'"):
        token_classification_data([{"tokens": ["a"], "ner_tags": ["B-XYZ"]}], tokenizer, label2id={"O": 0})
    # rows with no token to label: a batch of them alone would have a loss of 0 / 0
    first = {"tokens": ["a", "b"], "ner_tags": ["O", "B-X"]}
    with pytest.raises(DataError, match=r"item 2 .*'tokens' holds no words, so no token to label; remove the row"):
        token_classification_data([first, {"tokens": [], "ner_tags": []}], tokenizer)
    with pytest.raises(DataError, match=r"item 2 .*no word of the row gives a token to label \(its words \['\\u200b'"):
        token_classification_data([first, {"tokens": ["\u200b"], "ner_tags": ["O"]}], tokenizer)
    # one class: nothing to learn (a softmax over one class has a loss of 0), unless label2id names the others
    with pytest.raises(DataError, match=r"the data: every label is 'O'; a classifier needs two classes at least"):
        token_classification_data([{"tokens": ["a", "b"], "ner_tags": ["O", "O"]}], tokenizer)
    assert token_classification_data([{"tokens": ["a"], "ner_tags": ["O"]}], tokenizer, label2id={"O": 0, "B-X": 1})


# ----- masking -----


def synthetic_batch(tokenizer, rows: int = 320, width: int = 420, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(ids, special mask): [CLS] words [SEP] [PAD]..., about 100k real tokens."""
    rng = np.random.default_rng(seed)
    ids = rng.choice(replacement_ids(tokenizer), size=(rows, width))
    lengths = rng.integers(width // 2, width + 1, size=rows)
    special = np.arange(width)[None, :] >= lengths[:, None] - 1
    ids[special] = tokenizer.pad_token_id
    ids[np.arange(rows), lengths - 1] = tokenizer.token_id("[SEP]")
    ids[:, 0] = tokenizer.token_id("[CLS]")
    special[:, 0] = True
    return ids, special


def test_masking_statistics(tokenizer):
    ids, special = synthetic_batch(tokenizer)
    real = ~special
    assert real.sum() > 100_000
    inputs, labels = Masker.from_tokenizer(tokenizer)(ids, special, np.random.default_rng(0))
    selected = labels != -100
    assert abs(selected.sum() / real.sum() - 0.15) < 0.005
    assert not (selected & special).any()
    assert (labels[selected] == ids[selected]).all()
    masked = selected & (inputs == tokenizer.mask_token_id)
    kept = selected & (inputs == ids)
    randomized = selected & ~masked & ~kept  # a random draw equal to the original counts as kept: rare
    n = selected.sum()
    assert abs(masked.sum() / n - 0.8) < 0.01
    assert abs(kept.sum() / n - 0.1) < 0.01 and abs(randomized.sum() / n - 0.1) < 0.01
    assert (inputs[~selected] == ids[~selected]).all()
    assert np.isin(inputs[randomized], replacement_ids(tokenizer)).all()
    specials = [tokenizer.token_id(t) for t in ("[CLS]", "[SEP]", "[PAD]", "[MASK]", "[UNK]")]
    assert not np.isin(replacement_ids(tokenizer), specials).any()


def test_masks_are_seeded_resumable_and_fresh_per_batch(tokenizer):
    ids, special = synthetic_batch(tokenizer, rows=8, width=64)
    masker = Masker.from_tokenizer(tokenizer)
    rng = np.random.default_rng(7)
    first = masker(ids, special, rng)
    state = rng.bit_generator.state  # saved with a checkpoint, it resumes the same sequence of masks
    second = masker(ids, special, rng)
    again = np.random.default_rng(7)
    assert all((a == b).all() for a, b in zip(first, masker(ids, special, again), strict=True))
    assert not (first[1] == second[1]).all()  # the same batch built again gets other masks
    resumed = np.random.default_rng()
    resumed.bit_generator.state = state
    assert all((a == b).all() for a, b in zip(second, masker(ids, special, resumed), strict=True))


def test_whole_word_masking_selects_whole_words(tokenizer):
    texts = ["unbelievably tokenization of antidisestablishmentarianism words"] * 400
    examples = masked_lm_data([{"text": t} for t in texts], tokenizer)
    masker = Masker.from_tokenizer(tokenizer, whole_word=True)
    batch = collate(examples, range(len(examples)), tokenizer, masker, np.random.default_rng(0))
    selected = batch["labels"] != -100
    words = examples.encodings[0].word_ids
    assert len(set(words)) < len(words) - 1  # some words have several sub-tokens
    for column in range(len(words)):
        same_word = [c for c, w in enumerate(words) if w is not None and w == words[column]]
        if same_word:
            assert (selected[:, same_word] == selected[:, [column]]).all()
        else:
            assert not selected[:, column].any()
    word_rate = selected[:, [words.index(w) for w in set(words) - {None}]].mean()
    assert abs(word_rate - 0.15) < 0.02
    # as transformers' collator: every token of a selected word becomes the mask token; words by offset gaps
    masker = Masker.from_tokenizer(tokenizer, **masking(True))
    examples = masked_lm_data([{"text": "don't tokenize, unbelievably"}] * 200, tokenizer)
    batch = collate(examples, range(len(examples)), tokenizer, masker, np.random.default_rng(1))
    selected = batch["labels"] != -100
    assert (batch["input_ids"][selected] == tokenizer.mask_token_id).all()
    offsets = examples.encodings[0].offsets
    joined = [c for c in range(1, len(offsets) - 1) if offsets[c][0] == offsets[c - 1][1] and c > 1]
    assert joined and all((selected[:, c] == selected[:, c - 1]).all() for c in joined)  # "don", "'", "t": one word


def test_masked_lm_masks_the_real_tokens_of_left_padded_rows(tokenizer):
    """A tokenizer that pads on the left: the masks fall on each row's tokens, not on its padding's positions."""
    left = copy.copy(tokenizer)
    left.padding_side = "left"
    examples = masked_lm_data([{"text": "hi"}, {"text": "a much longer text than the first one is"}], left)
    masker = Masker.from_tokenizer(left)
    rng, picked = np.random.default_rng(0), 0
    for _ in range(200):
        batch = collate(examples, [0, 1], left, masker, rng)
        real = batch["attention_mask"] == 1
        assert (batch["labels"][~real] == -100).all()
        picked += int((batch["labels"][0] != -100).sum())
    assert 20 < picked  # "hi", one token of the short row: about 15% of 200 draws


def test_masked_lm_documents_become_windows(tmp_path, tokenizer):
    long = " ".join(f"word{i}" for i in range(200))
    path = write(tmp_path, "corpus.txt", f"{long}\nstill the first document.\n\nsecond document.\n")
    examples = masked_lm_data(path, tokenizer, max_length=32)
    assert len(examples) > 2 and all(len(e.ids) <= 32 for e in examples.encodings)
    assert examples.rows[0].line == 1 and examples.rows[-1].line == 4
    tokens = [t for e in examples.encodings for t in e.tokens if t not in ("[CLS]", "[SEP]")]
    assert tokens == tokenizer.encode_batch(
        [long + "\nstill the first document.", "second document."], truncation=False
    )[0].tokens[1:-1] + ["second", "document", "."]
    with pytest.raises(ValueError, match="need a masker and a generator"):
        collate(examples, [0], tokenizer)


def test_documents_that_give_no_loss_are_refused_naming_the_line(tmp_path, tokenizer, checkpoint):
    # these would crash mid-run with an empty loss ("[logsumexp] Received empty array"), not where the data is
    only_special = write(tmp_path, "corpus.jsonl", '{"text": "a fine film"}\n{"text": " "}\n')
    with pytest.raises(DataError, match=r"corpus.jsonl:2: the document has no token to mask"):
        masked_lm_data(only_special, tokenizer)
    gpt2 = mlx_encoders.load(checkpoint("gpt2", "causal-lm"))[1]
    one_token = write(tmp_path, "story.jsonl", '{"text": "a fine film"}\n{"text": "a"}\n')
    with pytest.raises(DataError, match=r"story.jsonl:2: the document has 1 token\(s\), so nothing to predict"):
        causal_lm_data(one_token, gpt2)
    # a long document's last window of one token only loses a token that had nothing to predict it from
    windows = causal_lm_data([{"text": " ".join(["a"] * 9)}], gpt2, max_length=4)
    assert [len(e.ids) for e in windows.encodings] == [4, 4]


def test_causal_lm_windows_hold_special_tokens_only_at_the_documents_ends(tokenizer):
    """run_clm's group_texts: the end-of-text token a tokenizer appends follows a document's real end only, never
    a window cut mid-text (it would be trained as a label there)."""
    text = "the cat sat on the mat and looked at the bird for a long while"
    windows = causal_lm_data([{"text": text}], tokenizer, max_length=5)
    assert len(windows) > 2 and all(len(e.ids) <= 5 for e in windows.encodings)
    whole = tokenizer.encode_batch([text], truncation=False)[0]
    assert [t for e in windows.encodings for t in e.tokens] == whole.tokens


# ----- next-sentence prediction -----


def test_next_sentence_pairs_are_half_real_half_random():
    documents = [[(d, s) for s in range(6)] for d in range(2000)]
    pairs = next_sentence_pairs(documents, np.random.default_rng(0))
    assert len(pairs) == 10_000
    labels = np.array([label for *_, label in pairs])
    assert abs(labels.mean() - 0.5) < 0.02
    for (doc, sentence), (other_doc, other_sentence), label in pairs:
        if label == 0:
            assert other_doc == doc and other_sentence == sentence + 1
        else:
            assert other_doc != doc
    with pytest.raises(ValueError, match="at least 2 documents"):
        next_sentence_pairs(documents[:1], np.random.default_rng(0))


def test_pretraining_batch_has_masks_and_next_sentence_labels(tmp_path, checkpoint):
    model, tok = mlx_encoders.load(checkpoint("bert", "pretraining"))
    path = write(tmp_path, "docs.txt", "The cat sat.\nIt purred.\nThen it slept.\n\nStocks fell.\nBonds rose.\n")
    examples = pretraining_data(path, tok, np.random.default_rng(3))
    assert len(examples) == 3 and [r.line for r in examples.rows] == [1, 2, 5]
    batch = collate(examples, range(3), tok, Masker.from_tokenizer(tok), np.random.default_rng(0))
    assert batch["next_sentence_label"].tolist() == examples.labels
    assert (batch["token_type_ids"][batch["attention_mask"] == 1] == 1).any()
    inputs = {k: mx.array(v) for k, v in batch.items()}
    labels, nsp = inputs.pop("labels"), inputs.pop("next_sentence_label")
    loss = task_loss(model, model(**inputs), labels, next_sentence_label=nsp)
    assert loss.shape == ()
    with pytest.raises(DataError, match="no document has two sentences"):
        pretraining_data(write(tmp_path, "one.txt", "a.\n\nb.\n"), tok, np.random.default_rng(0))


@pytest.mark.parametrize("model_type", ["roberta", "deberta"])
def test_words_of_byte_level_tokenizers_read_as_transformers_token_classification_example(
    checkpoint, tmp_path, model_type
):
    """run_ner.py loads RoBERTa's, DeBERTa's and GPT-2's tokenizers with add_prefix_space=True: each word after a
    space, as running text tokenizes it (without, "parser" became "p", "arser" in training and "Ġparser" when
    used), and the trained model's saved tokenizer reads words so; other tokenizers are left as they are."""
    folder = checkpoint(model_type, "token-classification")
    tokenizer = with_prefix_space(mlx_encoders.load_tokenizer(mlx_encoders.load_model(folder)), model_type)
    examples = token_classification_data(WORDS, tokenizer)
    reference = transformers.AutoTokenizer.from_pretrained(folder, add_prefix_space=True)
    encoded = reference([r["tokens"] for r in WORDS], is_split_into_words=True, truncation=True)
    for i in range(len(WORDS)):
        assert examples.encodings[i].ids == encoded["input_ids"][i]
        assert examples.encodings[i].word_ids == encoded.word_ids(i)
    bert = mlx_encoders.load_tokenizer(mlx_encoders.load_model(checkpoint("bert")))
    assert with_prefix_space(bert, "bert") is bert and "add_prefix_space" not in bert.config
    trained = fine_tune("tokens", WORDS, tmp_path / "run", model=checkpoint(model_type), max_steps=1, batch_size=2)
    saved = transformers.AutoTokenizer.from_pretrained(trained.path)
    assert saved([r["tokens"] for r in WORDS], is_split_into_words=True)["input_ids"] == encoded["input_ids"]


def test_a_datasets_class_label_names_the_classes(tokenizer):
    """A `datasets.Dataset` whose label column is a ClassLabel (or a sequence of them) gives its names, every class
    included, as transformers' examples read them (they were LABEL_i, up to the largest id a row held)."""
    import datasets

    tags = datasets.Sequence(datasets.ClassLabel(names=["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]))
    features = datasets.Features({"tokens": datasets.Sequence(datasets.Value("string")), "ner_tags": tags})
    words = datasets.Dataset.from_dict({"tokens": [["Johanson", "visited", "Oslo"]], "ner_tags": [[1, 0, 3]]}, features)
    assert token_classification_data(words, tokenizer).label2id == {
        "O": 0,
        "B-PER": 1,
        "I-PER": 2,
        "B-LOC": 3,
        "I-LOC": 4,
    }
    labels = datasets.ClassLabel(names=["neg", "neutral", "pos"])
    features = datasets.Features({"text": datasets.Value("string"), "label": labels})
    texts = datasets.Dataset.from_dict({"text": ["bad", "good"], "label": [0, 2]}, features)
    read = sequence_classification_data(texts, tokenizer)
    assert read.label2id == {"neg": 0, "neutral": 1, "pos": 2} and read.labels == [0, 2]

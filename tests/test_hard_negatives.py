"""`mine_hard_negatives` against sentence-transformers' on the same model (all-MiniLM-L6-v2) and data: the same
negatives, in the same order, with the same scores, for every output format and filter; the `mine` command."""

import json
import random

import pytest
from checkpoints import MINILM, make_checkpoint
from datasets import Dataset
from sentence_transformers import CrossEncoder as TorchCrossEncoder
from sentence_transformers import SentenceTransformer
from sentence_transformers.util import mine_hard_negatives as their_mine

from mlx_encoders import CrossEncoder, SentenceEncoder
from mlx_encoders.__main__ import main
from mlx_encoders.train import hard_negatives
from mlx_encoders.train.hard_negatives import mine_hard_negatives

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOPICS = {
    "cats": "Cats are small carnivorous mammals often kept as pets.",
    "dogs": "Dogs were domesticated from wolves thousands of years ago.",
    "Paris": "Paris is the capital and largest city of France.",
    "Berlin": "Berlin is the capital of Germany and its largest city.",
    "Python": "Python is a high-level programming language that emphasises readability.",
    "Rust": "Rust is a systems programming language focused on memory safety.",
    "rain": "Rain is liquid water falling from clouds in drops.",
    "snow": "Snow is precipitation of ice crystals that fall from clouds.",
    "the moon": "The Moon is Earth's only natural satellite.",
    "Mars": "Mars is the fourth planet from the Sun, a dusty cold desert world.",
    "coffee": "Coffee is a drink brewed from roasted coffee beans.",
    "tea": "Tea is an aromatic beverage made by pouring hot water over cured leaves.",
    "the piano": "The piano is a keyboard instrument whose strings are struck by hammers.",
    "the violin": "The violin is a wooden string instrument played with a bow.",
}
ROWS = [{"query": f"What is {topic}?", "answer": text} for topic, text in TOPICS.items()]
ROWS.append({"query": "What is Paris?", "answer": "Paris is home to the Louvre, the world's most visited museum."})
EXTRA = ["Lyon is a city in France.", "Wolves live in packs.", "Java is a programming language.", "Hail is ice."]


@pytest.fixture(scope="module")
def models():
    return SentenceEncoder(MINILM), SentenceTransformer(str(MINILM), device="cpu")


def theirs_as_rows(dataset) -> list[dict]:
    return [dict(row) for row in dataset.to_list()]


def assert_same_rows(ours: list[dict], theirs: list[dict]) -> None:
    assert len(ours) == len(theirs) > 0
    for a, b in zip(ours, theirs, strict=True):
        assert list(a) == list(b)
        for key in b:
            if key in ("scores", "score"):
                assert a[key] == pytest.approx(b[key], abs=2e-5)
            else:
                assert a[key] == b[key], key


CASES = [
    {},
    {"num_negatives": 2, "range_min": 1, "output_format": "n-tuple", "output_scores": True},
    {"relative_margin": 0.05, "output_format": "labeled-pair"},
    {"absolute_margin": 0.1, "max_score": 0.45, "output_format": "labeled-list", "output_scores": True},
    {"min_score": 0.05, "range_max": 8, "num_negatives": 4, "output_scores": True, "corpus": EXTRA},
    {"num_negatives": 5, "range_max": 40, "output_format": "n-tuple"},  # corpus smaller than the window
    {"include_positives": True, "num_negatives": 2},
]


@pytest.mark.parametrize("options", CASES, ids=lambda o: ",".join(o) or "default")
def test_mined_negatives_equal_sentence_transformers(monkeypatch, models, options):
    ours_model, their_model = models
    if "corpus" in options:  # and a score block of 3 queries, which changes nothing in the results
        monkeypatch.setattr(hard_negatives, "SCORE_BLOCK", 3 * (len(ROWS) + len(EXTRA)))
    theirs = their_mine(Dataset.from_list(ROWS), their_model, batch_size=4, verbose=False, **options)
    ours = mine_hard_negatives(ROWS, ours_model, batch_size=4, **options)
    assert_same_rows(ours, theirs_as_rows(theirs))


def test_random_sampling_equals_sentence_transformers_with_the_same_seed(models):
    ours_model, their_model = models
    random.seed(7)
    options = dict(sampling_strategy="random", range_max=9, num_negatives=3, output_scores=True)
    theirs = their_mine(Dataset.from_list(ROWS), their_model, verbose=False, **options)
    assert_same_rows(mine_hard_negatives(ROWS, ours_model, seed=7, **options), theirs_as_rows(theirs))


def test_cross_encoder_rescoring_equals_sentence_transformers(tmp_path, models):
    ours_model, their_model = models
    checkpoint = make_checkpoint(tmp_path, "bert", "sequence-classification", num_labels=1)
    options = dict(max_score=0.9, num_negatives=2, output_format="n-tuple", output_scores=True)
    theirs = their_mine(
        Dataset.from_list(ROWS), their_model, cross_encoder=TorchCrossEncoder(str(checkpoint)), verbose=False, **options
    )
    ours = mine_hard_negatives(ROWS, ours_model, cross_encoder=CrossEncoder(checkpoint), **options)
    assert_same_rows(ours, theirs_as_rows(theirs))


def test_mine_command_writes_jsonl(tmp_path, models, capsys):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "mined.jsonl"
    args = ["mine", "--model", str(MINILM), "--data", str(data), "--output", str(out), "--num-negatives", "2",
            "--relative-margin", "0.05", "--format", "n-tuple"]  # fmt: skip
    assert main(args) == 0
    written = [json.loads(line) for line in out.read_text().splitlines()]
    theirs = their_mine(
        Dataset.from_list(ROWS),
        models[1],
        num_negatives=2,
        relative_margin=0.05,
        output_format="n-tuple",
        verbose=False,
    )
    assert written == theirs_as_rows(theirs)
    assert main([*args[:-2], "--format", "n-tuple", "--range-min", "9", "--range-max", "10"]) == 2  # an option
    assert "Cannot mine 2 negatives" in capsys.readouterr().err
    assert oct(out.stat().st_mode & 0o777) != oct(0o600)  # a new file's mode, not the temporary file's
    # a misspelt column, an output folder that does not exist, a folder as the output: named before any work
    assert main([*args, "--anchor-column", "questoin"]) == 2
    assert f"the anchor column 'questoin' is not a column of the data; its columns: {', '.join(ROWS[0])}" in (
        capsys.readouterr().err
    )
    for output, message in (
        (tmp_path / "none" / "x.jsonl", "is not a folder; create it first"),
        (tmp_path, "is a folder"),
    ):
        assert main([*args[:6], str(output), *args[7:]]) == 1
        assert message in capsys.readouterr().err


def test_bad_options_are_named(models):
    with pytest.raises(ValueError, match="output_format must be one of"):
        mine_hard_negatives(ROWS, models[0], output_format="pairs")
    with pytest.raises(ValueError, match="range_min must be smaller than range_max"):
        mine_hard_negatives(ROWS, models[0], range_min=5, range_max=5)


def test_sentence_transformers_keyword_names_and_old_options_are_taken(tmp_path, models):
    ours_model, their_model = models
    rows = [{"q": row["query"], "a": row["answer"], "extra": 1} for row in ROWS]
    options = dict(anchor_column_name="q", positive_column_name="a", as_triplets=False, margin=0.05, num_negatives=2)
    options |= dict(use_faiss=False, faiss_batch_size=128, use_multi_process=False, verbose=False)
    theirs = their_mine(Dataset.from_list(rows), their_model, **options)
    ours = mine_hard_negatives(rows, ours_model, **options)
    assert_same_rows(ours, theirs_as_rows(theirs))
    assert "negative_2" in ours[0]  # as_triplets=False: n-tuples


def test_cache_folder_keeps_the_embeddings_and_reads_them_back(tmp_path, models, monkeypatch):
    ours_model, their_model = models
    theirs = their_mine(Dataset.from_list(ROWS), their_model, verbose=False, num_negatives=2)
    first = mine_hard_negatives(ROWS, ours_model, num_negatives=2, cache_folder=tmp_path / "cache")
    assert_same_rows(first, theirs_as_rows(theirs))
    assert sorted(p.name.split("_")[0] for p in (tmp_path / "cache").iterdir()) == ["corpus", "query"]

    def refuse(*args, **kwargs):
        raise AssertionError("encoded again: the cached embeddings were not read")

    monkeypatch.setattr(ours_model, "encode_query", refuse)
    monkeypatch.setattr(ours_model, "encode_document", refuse)
    assert mine_hard_negatives(ROWS, ours_model, num_negatives=2, cache_folder=tmp_path / "cache") == first
    with pytest.raises(AssertionError, match="encoded again"):  # other prompts are other embeddings
        mine_hard_negatives(ROWS, ours_model, num_negatives=2, cache_folder=tmp_path / "cache", query_prompt="q: ")
    monkeypatch.setattr(ours_model, "truncate_dim", 16)  # another setting: other embeddings
    with pytest.raises(AssertionError, match="encoded again"):
        mine_hard_negatives(ROWS, ours_model, num_negatives=2, cache_folder=tmp_path / "cache")

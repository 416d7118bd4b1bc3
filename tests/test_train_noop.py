"""Training that would not learn is refused or stopped, never saved as if it trained: a run none of whose batches
gives the loss a gradient (one row for in-batch negatives, rows sharing an anchor under `no_duplicates`, CoSENT with
one pair or equal scores, a listwise reranking loss with one document per query) is an option error before any
work (exit 2); a step with exactly zero gradients on a batch that should teach the loss something, before any step
moved the weights, stops the run (exit 1). Batches that cannot teach anything within a run that learns (a one-row
tail, a batch of equal scores) are taken as zero steps, as sentence-transformers takes them."""

import itertools
import json
import re
import warnings
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten

from mlx_encoders.__main__ import main
from mlx_encoders.checkpoint.build import load_model
from mlx_encoders.train import cli, fine_tune, trainer
from mlx_encoders.train.data import DataError
from mlx_encoders.train.losses.contrastive import CoSENTLoss, MatryoshkaLoss, MultipleNegativesRankingLoss
from mlx_encoders.train.losses.sparse import SpladeLoss
from mlx_encoders.train.trainer import NoSignal, OptionError, TrainingConfig, ZeroGradient

ONE_ROW = [{"anchor": "how do cats sleep", "positive": "curled up in warm places"}]
SHARED_ANCHOR = [{"anchor": "tea", "positive": f"a cup of hot tea number {i}"} for i in range(16)]
TRIPLETS = [
    {"anchor": "how do cats sleep", "positive": "curled up in warm places"},
    {"anchor": "what is python", "positive": "a programming language"},
    {"anchor": "capital of france", "positive": "paris is the capital"},
]
PAIRS = [
    {"sentence1": "a man plays guitar", "sentence2": "a person plays music", "score": 0.5},
    {"sentence1": "a cat sleeps", "sentence2": "the market fell", "score": 0.5},
    {"sentence1": "kids play football", "sentence2": "children play soccer", "score": 0.9},
    {"sentence1": "a bird flies", "sentence2": "a plane lands", "score": 0.1},
]
ONE_DOCUMENT = [{"query": "where do cats sleep", "document": "on warm windowsills", "label": 1}]
EQUAL_LABELS = [{"query": "where do cats sleep", "documents": ["on windowsills", "in boxes"], "labels": [1, 1]}]


@pytest.fixture(scope="module")
def sources(checkpoint):
    return {
        "embed": checkpoint("bert"),
        "rerank": checkpoint("bert", "sequence-classification", num_labels=1),
        "sparse": checkpoint("bert", "masked-lm"),
        "multivector": checkpoint("bert"),
    }


def changed(trained, source, task: str = "encoder") -> bool:
    """Whether training moved any weight of the model it started from."""
    before = dict(tree_flatten(load_model(source, dtype="float32", task=task).parameters()))
    after = dict(tree_flatten(trained.model.parameters()))
    return any(not mx.array_equal(after[name], value).item() for name, value in before.items() if name in after)


@pytest.mark.parametrize(
    "task, rows, options, message",
    [
        ("embed", ONE_ROW, {}, r"each batch holds one row, whose positive is its anchor's only candidate"),
        ("embed", ONE_ROW, {"loss": "cached-mnrl"}, r"1 row, batch_size=8, batch_sampler=no_duplicates"),
        ("embed", ONE_ROW, {"loss": "symmetric-mnrl"}, r"its anchor's only candidate"),
        ("embed", ONE_ROW, {"loss": MatryoshkaLoss(MultipleNegativesRankingLoss(), [32, 16])}, r"only candidate"),
        ("embed", TRIPLETS, {"batch_size": 1}, r"3 rows, batch_size=1"),
        ("embed", SHARED_ANCHOR, {}, r"16 rows, batch_size=8, batch_sampler=no_duplicates, 32 steps\)"),
        ("embed", PAIRS[:1], {}, r"each batch holds one pair, which CoSENT has no other pair to rank against"),
        ("embed", PAIRS[:2], {}, r"the pairs of each batch all have the same score"),
        ("embed", PAIRS, {"batch_size": 1, "loss": "cosent"}, r"CoSENT has no other pair"),
        ("rerank", ONE_DOCUMENT, {"loss": "lambda"}, r"LambdaLoss learns from pairs .* no query of a batch has two"),
        ("rerank", ONE_DOCUMENT, {"loss": "listnet"}, r"every query of a batch has one document"),
        ("rerank", EQUAL_LABELS, {"loss": "lambda"}, r"equal labels"),
        ("sparse", ONE_ROW, {}, r"its anchor's only candidate"),
        ("sparse", ONE_ROW, {"loss": SpladeLoss(query_regularizer_weight=None)}, r"only candidate"),
        ("multivector", ONE_ROW, {}, r"its anchor's only candidate"),
    ],
)  # fmt: skip
def test_a_run_no_batch_of_which_gives_a_gradient_is_refused_before_any_work(
    sources, tmp_path, task, rows, options, message
):
    with pytest.raises(NoSignal, match=message) as refused:
        fine_tune(task, rows, tmp_path / "run", model=sources[task], epochs=2, **options)
    assert "Training would leave the weights as they are" in str(refused.value)
    assert not (tmp_path / "run").exists()


def test_the_same_rows_train_when_their_batches_can_teach_the_loss(sources, tmp_path):
    """Rows sharing an anchor learn when they share a batch (the plain sampler), and CoSENT learns from scores that
    differ: the refusals above are about the batches, not the data."""
    plain = fine_tune("embed", SHARED_ANCHOR, tmp_path / "a", model=sources["embed"], batch_sampler="batch_sampler",
                      max_steps=1, lr=1e-3)  # fmt: skip
    scored = fine_tune("embed", PAIRS, tmp_path / "b", model=sources["embed"], max_steps=1, lr=1e-3)
    listwise = fine_tune("rerank", EQUAL_LABELS + [{**EQUAL_LABELS[0], "labels": [1, 0]}], tmp_path / "c",
                         model=sources["rerank"], loss="lambda", max_steps=1, lr=1e-3)  # fmt: skip
    assert changed(plain, sources["embed"]) and changed(scored, sources["embed"])
    assert changed(listwise, sources["rerank"], "sequence-classification")


def test_the_command_exits_2_on_a_run_that_would_not_learn(sources, tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps(ONE_ROW[0]) + "\n")
    argv = ["train", "embed", "-m", str(sources["embed"]), "--data", str(data), "-o", str(tmp_path / "out")]
    assert main(argv + ["--max-steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "error: Training would leave the weights as they are" in err and "batch_size (--batch-size)" in err
    assert not (tmp_path / "out").exists()


def constant_loss(embeddings, labels=None):
    """A loss of the user's that does not depend on the model: its gradients are exactly zero."""
    return 0.0 * embeddings[0].sum() + 1.0


def test_exactly_zero_gradients_before_any_step_moved_the_weights_stop_the_run(sources, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ZeroGradient, match=r"at step 1 the gradients of all \d+ trainable parameters are exactly zero"):
        fine_tune("embed", TRIPLETS, out, model=sources["embed"], loss=constant_loss, max_steps=3, save_every=1)
    assert not (out / "model").exists() and not list(out.glob("checkpoint-*"))
    assert not (out / "metrics.jsonl").exists()  # no step was taken


def test_the_command_exits_1_when_the_gradients_are_zero(sources, tmp_path, capsys, monkeypatch):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in TRIPLETS))
    monkeypatch.setattr(cli, "embed_loss", lambda args: constant_loss)
    argv = ["train", "embed", "-m", str(sources["embed"]), "--data", str(data), "-o", str(tmp_path / "out")]
    assert main(argv + ["--max-steps", "1"]) == 1
    assert "error: Training is not learning: at step 1" in capsys.readouterr().err
    assert not (tmp_path / "out" / "model").exists()


def test_one_row_tail_batches_are_zero_steps_of_a_run_that_learns(sources, tmp_path):
    trained = fine_tune("embed", TRIPLETS, tmp_path, model=sources["embed"], batch_size=2, epochs=2, lr=1e-3,
                        batch_sampler="batch_sampler")  # fmt: skip
    norms = [json.loads(line)["grad_norm"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(norms) == 4 and norms[1] == norms[3] == 0.0 and norms[0] > 0 and norms[2] > 0
    assert changed(trained, sources["embed"])


def test_a_first_batch_of_equal_scores_is_a_zero_step_not_an_error(sources, tmp_path):
    """CoSENT's first batch holds the two pairs of score 0.5 (a seed drawn so): exactly zero gradients on a batch
    the loss cannot learn from, before any step moved the weights; the run goes on and learns from the next."""
    seed = next(
        s for s in range(200)
        if sorted(trainer.epoch_steps(len(PAIRS), TrainingConfig("o", batch_size=2, seed=s), 0)[0][0]) == [0, 1]
    )  # fmt: skip
    trained = fine_tune("embed", PAIRS, tmp_path, model=sources["embed"], batch_size=2, epochs=1, seed=seed, lr=1e-3)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["grad_norm"] for r in records][0] == 0.0 and records[1]["grad_norm"] > 0
    assert changed(trained, sources["embed"])
    assert np.isfinite(records[1]["loss"])


# ----- a property-based campaign over degenerate training sets -----

ANCHORS = st.sampled_from(["tea", "tea", "coffee"])  # duplicated anchors are likely
DOCUMENTS = st.sampled_from(["hot tea", "a cup of tea", "black coffee", "hot tea"])
SCORES = st.sampled_from([0.0, 0.5, 0.5, 1.0])  # equal scores are likely
EMBED_LOSSES = {
    "pairs": st.sampled_from([None, "mnrl", "cached-mnrl", "symmetric-mnrl", "matryoshka", constant_loss]),
    "triplets": st.sampled_from([None, "mnrl", "cached-mnrl"]),
    "scored": st.sampled_from([None, "cosent", "cosine", "matryoshka"]),
}


@st.composite
def embed_draw(draw) -> tuple[list[dict], dict]:
    """1-4 rows of anchor-positive pairs, triplets or scored pairs, with a loss for them and batching options."""
    layout, n = draw(st.sampled_from(sorted(EMBED_LOSSES))), draw(st.integers(1, 4))
    rows = []
    for _ in range(n):
        if layout == "scored":
            rows.append({"sentence1": draw(ANCHORS), "sentence2": draw(DOCUMENTS), "score": draw(SCORES)})
        else:
            rows.append({"anchor": draw(ANCHORS), "positive": draw(DOCUMENTS)})
            rows[-1] |= {"negative": draw(DOCUMENTS)} if layout == "triplets" else {}
    loss = draw(EMBED_LOSSES[layout])
    if loss == "matryoshka":
        inner = CoSENTLoss() if layout == "scored" else MultipleNegativesRankingLoss()
        loss = MatryoshkaLoss(inner, [32, 16])
    options = {"loss": loss, "batch_sampler": draw(st.sampled_from([None, "batch_sampler", "no_duplicates"]))}
    return rows, options


@st.composite
def rerank_draw(draw) -> tuple[list[dict], dict]:
    """1-4 rows of one query with a document and a label, a list of documents (empty ones too) with labels, or a
    positive with negatives; one of the reranking losses."""
    layout, n = draw(st.sampled_from(["pointwise", "listwise", "negatives"])), draw(st.integers(1, 4))
    negatives = draw(st.integers(0, 2))  # one count for all rows, as mnrl wants
    rows = []
    for _ in range(n):
        query = draw(ANCHORS)
        if layout == "pointwise":
            rows.append({"query": query, "document": draw(DOCUMENTS), "label": draw(SCORES)})
        elif layout == "listwise":
            documents = draw(st.lists(DOCUMENTS, max_size=3))
            labels = [draw(SCORES) for _ in documents]
            rows.append({"query": query, "documents": documents, "labels": labels})
        else:
            rows.append({"query": query, "positive": draw(DOCUMENTS)})
            rows[-1] |= {f"negative_{i}": draw(DOCUMENTS) for i in range(1, negatives + 1)}
    return rows, {"loss": draw(st.sampled_from([None, "bce", "listnet", "lambda", "mnrl"]))}


def test_degenerate_training_sets_train_or_are_refused_never_a_silent_no_op(sources, tmp_path, record_property):
    """Every draw trains (its weights change) or is refused with a clear error (`NoSignal` or another option
    error, a data error naming the row, before anything is written; `ZeroGradient`, with no model saved): never a
    run that ends with the weights it started from, never another exception."""
    counts, serial = Counter(), itertools.count()
    tasks = {"embed": "encoder", "rerank": "sequence-classification"}

    @settings(max_examples=50, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(data=st.data(), task=st.sampled_from(sorted(tasks)))
    def run(data, task):
        rows, options = data.draw(embed_draw() if task == "embed" else rerank_draw())
        options |= {"batch_size": data.draw(st.integers(1, 4)), "max_steps": data.draw(st.integers(1, 2))}
        out = tmp_path / f"run{next(serial)}"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trained = fine_tune(task, rows, out, model=sources[task], lr=1e-3, **options)
        except (OptionError, DataError) as e:
            assert not out.exists(), f"refused after writing to {out}: {e}"
            assert isinstance(e, OptionError) or re.search(r"item \d+ of the data", str(e)), e
            counts[f"{task}: refused ({type(e).__name__})"] += 1
            return
        except ZeroGradient:
            assert not (out / "model").exists()
            counts[f"{task}: stopped (ZeroGradient)"] += 1
            return
        assert changed(trained, sources[task], tasks[task]), f"exit 0 with unchanged weights: {rows} {options}"
        counts[f"{task}: trained"] += 1

    run()
    parts = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    record_property("summary", f"degenerate training sets: {sum(counts.values())} cases ({parts})")
    assert all(counts[f"{task}: {outcome}"] for task in tasks for outcome in ("trained", "refused (NoSignal)"))

"""Evaluation scores against their references: entity precision/recall/F1 against seqeval itself, macro-F1
against scikit-learn (both test-only oracles)."""

import numpy as np
import pytest
import seqeval.metrics as seqeval
import sklearn.metrics as sklearn_metrics

from mlx_encoders.train.metrics import entity_scores, is_chunk_scheme, macro_f1

SCHEMES = {
    "IOB2": ["O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-MISC", "I-MISC"],
    "IOBES": ["O", "B-PER", "I-PER", "E-PER", "S-PER", "B-ORG", "I-ORG", "E-ORG", "S-ORG"],
}


def random_sentences(rng, tags: list[str], n: int) -> list[list[str]]:
    """Random tag sequences, ill-formed ones included (I- after O, type changes mid-entity), as models predict."""
    return [list(rng.choice(tags, size=int(rng.integers(1, 12)))) for _ in range(n)]


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("seed", range(5))
def test_entity_scores_equal_seqeval(scheme, seed):
    rng = np.random.default_rng(seed)
    true = random_sentences(rng, SCHEMES[scheme], 40)
    # predictions: the truth with a third of the tags redrawn, so that some entities match and some do not
    predicted = [[t if rng.random() > 0.33 else str(rng.choice(SCHEMES[scheme])) for t in s] for s in true]
    ours = entity_scores(true, predicted)
    assert ours["precision"] == pytest.approx(seqeval.precision_score(true, predicted), abs=1e-12)
    assert ours["recall"] == pytest.approx(seqeval.recall_score(true, predicted), abs=1e-12)
    assert ours["f1"] == pytest.approx(seqeval.f1_score(true, predicted), abs=1e-12)


def test_entity_scores_without_entities_are_zero_as_seqeval():
    true, predicted = [["O", "O"]], [["O", "B-PER"]]
    assert entity_scores(true, predicted) == {"precision": 0.0, "recall": 0.0, "f1": 0.0}
    assert seqeval.recall_score(true, predicted) == seqeval.f1_score(true, predicted) == 0.0
    with pytest.raises(ValueError, match="Sentence 0: 2 true tags but 1 predicted"):
        entity_scores([["O", "O"]], [["O"]])


def test_chunk_schemes_are_recognised():
    assert is_chunk_scheme(SCHEMES["IOB2"]) and is_chunk_scheme(SCHEMES["IOBES"])
    assert not is_chunk_scheme(["O", "PER", "LOC"]) and not is_chunk_scheme(["NOUN", "VERB"])
    assert not is_chunk_scheme(["O"])


@pytest.mark.parametrize("seed", range(5))
def test_macro_f1_equals_scikit_learn(seed):
    rng = np.random.default_rng(seed)
    labels, predictions = rng.integers(0, 5, 60), rng.integers(0, 6, 60)
    expected = sklearn_metrics.f1_score(labels, predictions, average="macro")
    assert macro_f1(predictions, labels) == pytest.approx(expected, abs=1e-12)

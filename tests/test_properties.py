"""A property-based campaign (hypothesis): random strings (any code point: control characters, lone
surrogates, huge texts), random id tensors (in and out of range), random masks and token types, random
argument values, through `SentenceEncoder.encode`, the pipelines and the model entry. Never a crash, never
NaN, and every refusal is one of the documented error types.

The cases are derandomized (`CASES` per property, the same inputs on every run), so the docs can say what ran.
The model-entry property runs in a subprocess: a crash there (an out-of-range id used to segfault) fails
the test instead of killing the run.
"""

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mlx_encoders

CASES = 150
CAMPAIGN = settings(
    max_examples=CASES, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)
DOCUMENTED = (ValueError, TypeError)

ANY_CHARACTER = st.characters(exclude_categories=())  # surrogates and control characters included
TEXTS = st.one_of(
    st.text(ANY_CHARACTER, max_size=200),
    st.text(st.sampled_from("ab ,.\t\n\x00\ud800é🙂"), max_size=50),
    st.integers(500, 5000).map(lambda n: "word " * n),  # far past the position limit
)
NOT_TEXT = st.one_of(st.none(), st.integers(), st.floats(), st.binary(max_size=8), st.lists(st.integers(), max_size=2))


def finite(x) -> bool:
    return bool(np.isfinite(np.asarray(x, dtype=np.float64)).all())


@pytest.fixture(scope="module")
def encoder(checkpoint):
    return mlx_encoders.SentenceEncoder(checkpoint("bert"), pooling="mean")


@CAMPAIGN
@given(
    texts=st.lists(st.one_of(TEXTS, NOT_TEXT), max_size=6) | TEXTS | NOT_TEXT | st.dictionaries(TEXTS, TEXTS),
    batch_size=st.integers(-2, 9),
)
def test_encode_never_crashes_or_gives_nan(encoder, texts, batch_size):
    try:
        vectors = encoder.encode(texts, batch_size=batch_size)
    except DOCUMENTED:
        return
    assert vectors.dtype == np.float32 and finite(vectors)
    assert vectors.shape[-1] == encoder.dimension


@pytest.fixture(scope="module")
def fill_mask(checkpoint):
    return mlx_encoders.pipeline("fill-mask", model=checkpoint("bert", "masked-lm"))


@CAMPAIGN
@given(before=TEXTS, after=TEXTS, top_k=st.integers(-3, 40))
def test_fill_mask_never_crashes_or_gives_nan(fill_mask, before, after, top_k):
    try:
        results = fill_mask(f"{before} [MASK] {after}", top_k=top_k)
    except DOCUMENTED:
        return
    scores = [r["score"] for r in (results if results and isinstance(results[0], dict) else sum(results, []))]
    assert finite(scores) and all(0 <= s <= 1 for s in scores)


@pytest.fixture(scope="module")
def classifier(checkpoint):
    return mlx_encoders.pipeline("text-classification", model=checkpoint("roberta", "sequence-classification"))


@CAMPAIGN
@given(text=TEXTS, pair=st.none() | TEXTS, top_k=st.none() | st.integers(-2, 5))
def test_text_classification_never_crashes_or_gives_nan(classifier, text, pair, top_k):
    inputs = text if pair is None else {"text": text, "text_pair": pair}
    try:
        results = classifier(inputs, top_k=top_k)
    except DOCUMENTED:
        return
    results = results if isinstance(results, list) else [results]
    assert finite([r["score"] for r in results])


@pytest.fixture(scope="module")
def question_answering(checkpoint):
    return mlx_encoders.pipeline("question-answering", model=checkpoint("bert", "question-answering"))


@CAMPAIGN
@given(
    question=TEXTS,
    context=TEXTS,
    doc_stride=st.integers(-2, 200),
    max_seq_len=st.integers(-1, 10**6),
    max_answer_len=st.integers(-1, 30),
    top_k=st.integers(-1, 4),
)
def test_question_answering_never_crashes_or_gives_nan(question_answering, question, context, **options):
    try:
        answers = question_answering(question=question, context=context, **options)
    except DOCUMENTED:
        return
    answers = answers if isinstance(answers, list) else [answers]
    assert finite([a["score"] for a in answers])
    assert all(a["start"] <= a["end"] and context[a["start"] : a["end"]] == a["answer"] for a in answers)


MODEL_ENTRY = """
import sys

import mlx.core as mx
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mlx_encoders

model = mlx_encoders.load_model(sys.argv[1])
vocab, types = model.args.vocab_size, getattr(model.args, "type_vocab_size", 2)
ran = []


@settings(max_examples=int(sys.argv[2]), deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(shape=st.tuples(st.integers(1, 3), st.integers(1, 160)), data=st.data())
def entry(shape, data):
    ids = np.array(data.draw(st.lists(st.integers(-3, vocab + 40), min_size=shape[0] * shape[1],
                                      max_size=shape[0] * shape[1]))).reshape(shape)
    mask = np.array(data.draw(st.lists(st.integers(0, 1), min_size=ids.size, max_size=ids.size))).reshape(shape)
    token_types = np.array(data.draw(st.lists(st.integers(-1, types + 1), min_size=ids.size, max_size=ids.size)))
    ran.append(1)
    try:
        out = model(mx.array(ids), attention_mask=mx.array(mask), token_type_ids=mx.array(token_types.reshape(shape)))
    except (ValueError, IndexError):
        return
    assert np.isfinite(np.array(out.last_hidden_state)).all()


entry()
print(len(ran), "cases")
"""


@pytest.mark.parametrize("model_type", ["bert", "distilbert", "modernbert"])
def test_model_entry_never_crashes_or_gives_nan(checkpoint, model_type):
    folder = checkpoint(model_type, "encoder")
    code = textwrap.dedent(MODEL_ENTRY)
    result = subprocess.run([sys.executable, "-c", code, str(folder), str(CASES)], capture_output=True, text=True)
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-2000:]}"
    assert f"{CASES} cases" in result.stdout

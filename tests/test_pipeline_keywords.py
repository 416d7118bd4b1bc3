"""transformers' pipeline keywords, against transformers' own pipelines on the same tiny checkpoints: call-time
`batch_size`, tokenizer keywords, `return_all_scores`, `is_split_into_words`, `stride` without aggregation,
construction-time defaults, and the `pipeline()` factory's `tokenizer=`, `device=` and `dtype=`.

Results are compared field for field, Python types included: our scores are python floats where transformers
has floats or numpy floats, indices and offsets python ints.
"""

import mlx.core as mx
import numpy as np
import pytest
import transformers
from checkpoints import load_reference
from test_pipelines import assert_same

import mlx_encoders
from mlx_encoders import pipeline
from mlx_encoders.engine.runtime import lane_count
from mlx_encoders.pipelines import PIPELINES

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LABELS = {0: "negative", 1: "neutral", 2: "positive"}
BIO = {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC", 4: "I-LOC"}
HEADS = {
    "text-classification": dict(id2label=LABELS, label2id={v: k for k, v in LABELS.items()}),
    "token-classification": dict(id2label=BIO, label2id={v: k for k, v in BIO.items()}),
    "fill-mask": {},
    "feature-extraction": {},
}
TEXTS = ["I loved this film.", "Terrible service, never again!", "It was fine I guess", "ok", "A fifth one."]
LONG = "This goes on and on, and on. " * 40
WORDS = ["Angela", "Merkel", "met", "Emmanuel", "Macron", "in", "Strasbourg", "yesterday."]


same = assert_same  # the pipeline tests' comparison: nesting, keys, values and transformers' own types


@pytest.fixture(scope="module")
def folders(checkpoint):
    """`folders(task, model_type)` -> a seeded checkpoint with the head the task needs."""

    def get(task: str, model_type: str = "bert"):
        head = "masked-lm" if task == "feature-extraction" else PIPELINES[task].head
        return checkpoint(model_type, head, initializer_range=0.5, seed=1, **HEADS[task])

    return get


def reference(task: str, folder, ours, **kwargs):
    """transformers' pipeline on the same folder, its tokenizer limited to our model's positions (MiniLM's says
    512, the tiny models have 128) and giving the inputs our model reads."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokenizer.model_max_length = ours.tokenizer.model_max_length
    tokenizer.model_input_names = list(ours.tokenizer.model_input_names)
    model = load_reference(folder, PIPELINES[task].head)  # feature extraction: AutoModel, the bare encoder
    return transformers.pipeline(task, model=model, tokenizer=tokenizer, **kwargs)


@pytest.fixture(scope="module")
def pipes(folders):
    """`pipes(task, model_type)` -> (ours, transformers') pipelines, built once."""
    built = {}

    def get(task: str, model_type: str = "bert"):
        if (task, model_type) not in built:
            ours = pipeline(task, model=folders(task, model_type))
            built[task, model_type] = ours, reference(task, folders(task, model_type), ours)
        return built[task, model_type]

    return get


# ------------------------------------------------------------------------------------------------ batch_size


def test_call_time_batch_size(pipes, monkeypatch):
    ours, ref = pipes("fill-mask")
    texts = [f"Text {i} has a [MASK] in it." for i in range(5)]
    shapes = []
    run = ours.run
    monkeypatch.setattr(ours, "run", lambda batch: shapes.append(batch["input_ids"].shape[0]) or run(batch))
    same(ours(texts, batch_size=2, top_k=2), ref(texts, batch_size=2, top_k=2))
    assert shapes == [2, 2, 1]
    shapes.clear()
    ours(texts)
    # one batch (the pipeline's own batch_size, 8, again): one pass, or on the CPU shared out over its lanes (`balance`)
    assert sum(shapes) == 5 and len(shapes) <= lane_count(), shapes
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got 0"):
        ours(texts, batch_size=0)


# ------------------------------------------------------------------------------------ tokenizer keywords


def test_text_classification_truncation_and_max_length(pipes):
    ours, ref = pipes("text-classification")
    for options in (
        dict(truncation=True, max_length=10),
        dict(max_length=7),  # transformers 5 truncates at max_length without truncation=True
        dict(tokenizer_kwargs={"truncation": True, "max_length": 12}),
        dict(truncation="only_first", max_length=9, padding=True),
    ):
        same(ours(LONG, top_k=None, **options), ref(LONG, top_k=None, **options))
    pair = {"text": "Short question?", "text_pair": LONG}
    same(ours(pair, truncation="only_second", max_length=20), ref(pair, truncation="only_second", max_length=20))
    assert ours(LONG, max_length=10) != ours(LONG)  # it did cut the text
    with pytest.raises(ValueError, match=r"Item 0 has \d+ tokens, more than the model's 128; pass truncation=True"):
        ours(LONG, truncation=False)  # transformers fails inside the model here
    with pytest.raises(ValueError, match=r"more than the model's 128; pass a max_length of at most 128$"):
        ours(LONG, truncation=True, max_length=1000)  # already truncating: the length is what to change
    with pytest.raises(TypeError, match="tokenizer_kwargs takes truncation, max_length, padding; got 'stride'"):
        ours(LONG, tokenizer_kwargs={"stride": 3})


def test_fill_mask_tokenizer_kwargs(pipes):
    ours, ref = pipes("fill-mask")
    text = "Paris is the [MASK] of France. " + LONG
    options = dict(tokenizer_kwargs={"truncation": True, "max_length": 12}, top_k=3)
    same(ours(text, **options), ref(text, **options))
    with pytest.raises(ValueError, match=r"No mask_token .*\(after truncation to 4 tokens\)"):
        ours("One two three four [MASK].", tokenizer_kwargs={"max_length": 4})
    for theirs in (ours, ref):  # transformers' fill-mask takes tokenizer keywords only inside tokenizer_kwargs
        with pytest.raises(TypeError, match="truncation"):
            theirs(text, truncation=True)


def test_feature_extraction_tokenize_kwargs(pipes):
    ours, ref = pipes("feature-extraction")
    options = dict(tokenize_kwargs={"truncation": True, "max_length": 9})
    got, expected = ours([LONG, "short"], **options), ref([LONG, "short"], **options)
    assert [np.shape(g) for g in got] == [np.shape(e) for e in expected] == [(1, 9, 32), (1, 3, 32)]
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, atol=1e-4, rtol=1e-4)
    for theirs in (ours, ref):
        with pytest.raises(ValueError, match="truncation parameter defined twice"):
            theirs(LONG, truncation=True, tokenize_kwargs={"truncation": True})
    with pytest.raises(ValueError, match="padding='max_length' is not supported here"):  # transformers pads the states
        ours("short", tokenize_kwargs={"padding": "max_length", "max_length": 20})


# ------------------------------------------------------------------------------------ return_all_scores


def test_return_all_scores_is_transformers_4_legacy_form(pipes):
    """transformers 4 mapped return_all_scores=True to every label in the model's order (a list per input, and a
    list around a single string) and False to the best label; transformers 5 ignores it, so the expected values
    are transformers' own scores (top_k=None) in that order."""
    ours, ref = pipes("text-classification")
    label_order = list(LABELS.values())

    def in_label_order(scores):
        return sorted(scores, key=lambda s: label_order.index(s["label"]))

    same(ours(TEXTS[0], return_all_scores=True), [in_label_order(ref(TEXTS[0], top_k=None))])
    same(ours(TEXTS, return_all_scores=True), [in_label_order(r) for r in ref(TEXTS, top_k=None)])
    same(ours(TEXTS[0], return_all_scores=False), ref(TEXTS[0]))
    same(ours(TEXTS, return_all_scores=True, top_k=2), ref(TEXTS, top_k=2))  # top_k wins


# ---------------------------------------------------------------------------------- token classification


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_is_split_into_words(pipes, model_type):
    ours, ref = pipes("token-classification", model_type)
    for strategy in ("none", "simple", "first"):
        options = dict(is_split_into_words=True, aggregation_strategy=strategy, ignore_labels=[])
        same(ours(WORDS, **options), ref(WORDS, **options))  # one pre-split text: a list of one list, as there
        same(ours([WORDS, WORDS[:3]], **options), ref([WORDS, WORDS[:3]], **options))
    options = dict(is_split_into_words=True, delimiter="_", aggregation_strategy="simple", ignore_labels=[])
    same(ours(WORDS, **options), ref(WORDS, **options))
    with pytest.raises(TypeError, match="is_split_into_words=True, the input must be a list of str words"):
        ours("Angela Merkel", is_split_into_words=True)


def test_stride_without_aggregation_strategy(pipes):
    """transformers refuses stride with aggregation_strategy="none" passed in the same call, but takes it with the
    strategy left out (per-token entities from every window, overlaps merged)."""
    ours, ref = pipes("token-classification")
    long = " ".join(["Angela went to Berlin."] * 60)
    expected = ref(long, stride=16, ignore_labels=[])
    same(ours(long, stride=16, ignore_labels=[]), expected)
    assert expected[-1]["end"] > len(long) // 2  # from beyond the first window
    for theirs in (ours, ref):
        with pytest.raises(ValueError, match="stride"):
            theirs(long, stride=16, aggregation_strategy="none")
    words = long.split()
    options = dict(is_split_into_words=True, stride=16, aggregation_strategy="first", ignore_labels=[])
    same(ours(words, **options), ref(words, **options))


# ------------------------------------------------------------------------------- construction and factory


@pytest.mark.parametrize(
    ("task", "defaults", "calls"),
    [
        ("text-classification", dict(top_k=2), [dict(), dict(top_k=1), dict(top_k=None, function_to_apply="none")]),
        ("text-classification", dict(function_to_apply="sigmoid"),
         [dict(), dict(top_k=None), dict(function_to_apply=None, top_k=None)]),  # None: the default holds
        ("fill-mask", dict(top_k=2), [dict(), dict(top_k=4), dict(top_k=None)]),
        ("token-classification", dict(aggregation_strategy="simple", ignore_labels=[]),
         [dict(), dict(ignore_labels=["O"]), dict(aggregation_strategy=None)]),
        ("token-classification", dict(aggregation_strategy="none"), [dict(stride=16)]),  # separate sets: allowed
    ],
)  # fmt: skip
def test_construction_keywords_are_call_defaults(folders, task, defaults, calls):
    folder = folders(task)
    ours = pipeline(task, model=folder, **defaults)
    ref = reference(task, folder, ours, **defaults)
    inputs = {"fill-mask": "Paris is the [MASK] of France.", "token-classification": " ".join(WORDS * 30)}
    for text in (inputs.get(task, TEXTS[0]), [inputs.get(task, TEXTS[0]), "Another one [MASK] here."]):
        for options in calls:
            same(ours(text, **options), ref(text, **options))


def test_factory_tokenizer_device_and_dtype(folders):
    folder = folders("fill-mask")
    text = "Paris is the [MASK] of France."
    expected = pipeline("fill-mask", model=folder)(text)
    model, tokenizer = mlx_encoders.load(folder)
    for options in (dict(model=model), dict(model=model, tokenizer=tokenizer), dict(model=model, tokenizer=folder)):
        same(pipeline("fill-mask", **options)(text), expected)
    for device in ("cpu", -1, mx.cpu):
        fill = pipeline("fill-mask", model=(model, tokenizer), device=device)
        assert fill.device == mx.cpu
        same(fill(text), expected)
    same(pipeline("fill-mask", model=folder, dtype="auto")(text), expected)
    for device in (0, "gpu", "cuda:0", "mps"):
        if mx.is_available(mx.gpu):
            assert pipeline("fill-mask", model=(model, tokenizer), device=device).device == mx.gpu
        else:
            with pytest.raises(ValueError, match="asks for the GPU, which this MLX build lacks; pass device='cpu'"):
                pipeline("fill-mask", model=(model, tokenizer), device=device)
    with pytest.raises(ValueError, match="Unknown device 'tpu': pass 'cpu' or -1"):
        pipeline("fill-mask", model=(model, tokenizer), device="tpu")
    with pytest.raises(TypeError, match="unexpected keyword argument 'top_p'; it takes inputs, top_k, targets"):
        pipeline("fill-mask", model=(model, tokenizer), top_p=0.5)
    with pytest.raises(TypeError, match="unexpected keyword argument 'aggregation_strategy'"):
        pipeline("fill-mask", model=(model, tokenizer))(text, aggregation_strategy="simple")

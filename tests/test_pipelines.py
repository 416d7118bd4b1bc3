"""Task pipelines against transformers' own pipelines on the same tiny checkpoints.

For every architecture with the head a task needs: identical top-k tokens, labels, entity spans and answer
spans, scores within 1e-4. transformers 5 dropped `QuestionAnsweringPipeline`; its oracle here is the
transformers model and tokenizer with transformers' own span decoding (`select_starts_ends`, kept in
pipelines/document_question_answering.py), assembled exactly as the 4.x pipeline did.
"""

import json
import shutil

import numpy as np
import pytest
import torch
import transformers
from checkpoints import language_model_task, load_reference
from transformers.pipelines.document_question_answering import select_starts_ends

import mlx_encoders
from mlx_encoders import MODEL_TYPES, pipeline
from mlx_encoders.models import model_module
from mlx_encoders.pipelines import PIPELINES
from mlx_encoders.tokenizer import Tokenizer

SCORE_TOL = 1e-4
# Large weights, so the random models rank candidates far apart (no near-ties to flip). ALBERT's shared layers
# collapse at that scale into nearly the same output for every token, so it gets a smaller one; the seeds
# chosen avoid a top-5 near-tie (DistilBERT) and a tagger that gives every word one label (BERT, ALBERT,
# ELECTRA and DeBERTa-v2, which at 0.8 also saturate enough for float32 rounding to move their class scores
# past the tolerance; GTE's, EuroBERT's and jina-embeddings-v3's features likewise). RoBERTa's and XLM-R's
# taggers at 0.8 round 4-5x further from a float64 run than at 0.5, too close to the tolerance.
INIT = {
    "albert": dict(initializer_range=0.1, seed=1),
    "bert": dict(initializer_range=0.5, seed=1),
    "distilbert": dict(initializer_range=0.8, seed=1),
    "electra": dict(initializer_range=0.5, seed=1),
    "deberta-v2": dict(initializer_range=0.5),
    "roberta": dict(initializer_range=0.5),
    "xlm-roberta": dict(initializer_range=0.5),
    "gte": dict(initializer_range=0.5),
    "eurobert": dict(initializer_range=0.5),
    "jina_embeddings_v3": dict(initializer_range=0.5),
}
DEFAULT_INIT = dict(initializer_range=0.8)
BIO = {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC", 4: "I-LOC"}
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
OVERRIDES = {
    "token-classification": dict(id2label=BIO, label2id={v: k for k, v in BIO.items()}),
    "sequence-classification": dict(id2label=LABELS, label2id={v: k for k, v in LABELS.items()}),
}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The reference models are tiny: torch's thread pool only adds contention (100x slower on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def with_head(head: str) -> list[str]:
    """Every registered architecture that has `head`: a new architecture cannot skip these tests."""
    return [t for t in MODEL_TYPES if head in model_module(t).MODELS]


@pytest.fixture(scope="module")
def pipes(checkpoint):
    """`pipes(task, model_type)` -> (ours, transformers') pipelines on one seeded checkpoint, built once."""
    built = {}

    def get(task: str, model_type: str, **overrides):
        key = (task, model_type, repr(sorted(overrides.items())))
        if key not in built:
            head = PIPELINES[task].head
            stored = language_model_task(model_type) if head == "encoder" else head
            folder = checkpoint(
                model_type, stored, **{**INIT.get(model_type, DEFAULT_INIT), **OVERRIDES.get(stored, {}), **overrides}
            )
            ours = pipeline(task, model=folder, batch_size=3)
            built[key] = (ours, folder, reference(task, folder, head, ours))
        return built[key]

    return get


def reference(task: str, folder, head: str, ours):
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    # Feed transformers the same inputs: our tokenizer stops at the position table, and ALBERT (trained with
    # segment ids) gets token_type_ids, which transformers 5's ALBERT tokenizer leaves out.
    tokenizer.model_max_length = ours.tokenizer.model_max_length
    tokenizer.model_input_names = list(ours.tokenizer.model_input_names)
    if task == "question-answering":
        return tokenizer, load_reference(folder, head)
    return transformers.pipeline(task, model=load_reference(folder, head), tokenizer=tokenizer)


def assert_same(ours, ref, path="result", tol=SCORE_TOL):
    """Same nesting, keys, strings and ints; floats within `tol` (relative beyond 1) and of transformers' own type
    (python floats; numpy float32 for token classification's scores)."""
    if isinstance(ref, dict):
        assert isinstance(ours, dict) and list(ours) == list(ref), f"{path}: keys {list(ours)} != {list(ref)}"
        for key in ref:
            assert_same(ours[key], ref[key], f"{path}[{key!r}]", tol)
    elif isinstance(ref, list):
        assert isinstance(ours, list) and len(ours) == len(ref), f"{path}: {ours!r} != {ref!r}"
        for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
            assert_same(a, b, f"{path}[{i}]", tol)
    elif isinstance(ref, (float, np.floating)):
        assert type(ours) is type(ref), f"{path}: {type(ours).__name__}, transformers {type(ref).__name__}"
        assert abs(ours - float(ref)) <= tol * max(1.0, abs(float(ref))), f"{path}: {ours} != {ref}"  # raw logits
    else:
        assert type(ours) is type(int(ref) if isinstance(ref, np.integer) else ref), f"{path}: {ours!r} vs {ref!r}"
        assert ours == ref, f"{path}: {ours!r} != {ref!r}"


# ---------------------------------------------------------------------------------------------- fill-mask


@pytest.mark.parametrize("model_type", with_head("masked-lm"))
def test_fill_mask(pipes, model_type):
    ours, _, ref = pipes("fill-mask", model_type)
    mask = ours.tokenizer.mask_token
    one, two = f"The capital of France is {mask}.", f"A {mask} walks into a {mask} today."
    assert_same(ours(one), ref(one))
    assert_same(ours(two, top_k=3), ref(two, top_k=3))  # one list per mask
    texts = [one, two, f"{mask} is short.", f"Many words come before the {mask} in this longer one."]
    assert_same(ours(texts, top_k=2), ref(texts, top_k=2))  # batched, padded, against one by one
    targets = [ours.tokenizer.convert_ids_to_tokens([i])[0] for i in (40, 41, 42, 43)]
    assert_same(ours(one, targets=targets, top_k=3), ref(one, targets=targets, top_k=3))


@pytest.mark.parametrize("model_type, config", [("bert", {"do_lower_case": True, "model_max_length": 512}),
                                                 ("roberta", None)])  # fmt: skip
def test_special_tokens_named_in_tokenizer_json_alone(pipes, tmp_path, model_type, config):
    """bert-base-uncased's files name no special token (roberta-base has no tokenizer_config.json): transformers
    takes them from its tokenizer class; here from the tokenizer's own special tokens, the same ones."""
    _, folder, ref = pipes("fill-mask", model_type)
    bare = shutil.copytree(folder, tmp_path / "bare")
    (bare / "special_tokens_map.json").unlink(missing_ok=True)
    if config is None:
        (bare / "tokenizer_config.json").unlink()
    else:
        (bare / "tokenizer_config.json").write_text(json.dumps(config))
    ours = pipeline("fill-mask", model=bare)
    expected = transformers.AutoTokenizer.from_pretrained(bare)
    assert [getattr(ours.tokenizer, n) for n in ("mask_token", "cls_token", "sep_token", "pad_token", "unk_token")] == [
        getattr(expected, n) for n in ("mask_token", "cls_token", "sep_token", "pad_token", "unk_token")
    ]
    text = f"The capital of France is {expected.mask_token}."
    assert_same(ours(text, top_k=3), ref(text, top_k=3))


def test_a_tokenizer_of_another_class_or_an_explicit_null_keeps_its_roles(pipes, tmp_path):
    """The defaults are the BERT and RoBERTa families' alone: a Llama-style class, or a role set to null, keeps None."""
    _, folder, _ = pipes("fill-mask", "roberta")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    for name, edit in [("llama", {"tokenizer_class": "LlamaTokenizer"}), ("null", {"pad_token": None})]:
        target = shutil.copytree(folder, tmp_path / name)
        (target / "special_tokens_map.json").unlink(missing_ok=True)
        kept = {k: v for k, v in config.items() if not k.endswith("_token") and k != "tokenizer_class"}
        (target / "tokenizer_config.json").write_text(json.dumps({**kept, **edit}))
        expected = transformers.AutoTokenizer.from_pretrained(target)
        ours = Tokenizer.from_pretrained(target)
        assert [getattr(ours, n) for n in ("cls_token", "sep_token", "pad_token", "mask_token")] == [
            getattr(expected, n) for n in ("cls_token", "sep_token", "pad_token", "mask_token")
        ], name


@pytest.mark.parametrize("model_type", ["roberta", "modernbert"])
def test_a_bpe_tokenizer_skips_the_clean_up_as_transformers_does(pipes, tmp_path, model_type):
    """transformers 5 ignores clean_up_tokenization_spaces for BPE models, whose text it would corrupt."""
    _, folder, ref = pipes("fill-mask", model_type)
    folder = shutil.copytree(folder, tmp_path / "ckpt")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "clean_up_tokenization_spaces": True}))
    ours, ref = pipeline("fill-mask", model=folder), transformers.pipeline("fill-mask", model=ref.model,
                                                                          tokenizer=str(folder))  # fmt: skip
    text = f"Well , it is {ours.tokenizer.mask_token} , isn't it ? Yes ."  # spaces the clean-up would take out
    assert_same(ours(text, top_k=2), ref(text, top_k=2))


def test_fill_mask_errors_and_truncation(pipes):
    ours, _, ref = pipes("fill-mask", "bert")
    with pytest.raises(ValueError, match=r"No mask_token \(\[MASK\]\) found"):
        ours("There is no mask here.")
    with pytest.raises(ValueError, match="No mask_token"):
        ours("")
    with pytest.raises(ValueError, match="at least one"):
        ours([])
    long = "Paris is [MASK]. " + "word " * 300
    limit = ours.tokenizer.model_max_length
    assert_same(ours(long), ref(long, tokenizer_kwargs={"truncation": True, "max_length": limit}))
    with pytest.raises(ValueError, match=f"after truncation to {limit} tokens"):
        ours("word " * 300 + "[MASK].")


def test_fill_mask_reads_the_masked_lm_half_of_a_head_not_implemented_here(checkpoint, tmp_path):
    """ALBERT's pretraining checkpoint (its masked-LM and sentence-order heads) fills masks as transformers'
    pipeline fills them, from its masked-LM half; a checkpoint without that half is refused naming its head."""
    folder = checkpoint("albert", "pretraining", **INIT["albert"])
    ours = pipeline("fill-mask", model=folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokenizer.model_input_names = list(ours.tokenizer.model_input_names)
    ref = transformers.pipeline("fill-mask", model=str(folder), tokenizer=tokenizer)
    assert type(ref.model).__name__ == "AlbertForMaskedLM"
    texts = [f"The capital of France is {ours.tokenizer.mask_token}.", f"A {ours.tokenizer.mask_token} walks in."]
    assert_same(ours(texts, top_k=3), ref(texts, top_k=3))

    bare = tmp_path / "bare"
    shutil.copytree(checkpoint("bert", "encoder"), bare)
    config = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**config, "architectures": ["BertForMultipleChoice"]}))
    with pytest.raises(ValueError, match=r"Unsupported architecture 'BertForMultipleChoice'"):
        pipeline("fill-mask", model=bare)


def test_batches_go_through_the_model_together(pipes, monkeypatch):
    ours, _, _ = pipes("fill-mask", "bert")
    calls = []
    run = ours.run
    monkeypatch.setattr(ours, "run", lambda batch: calls.append(batch["input_ids"].shape) or run(batch))
    ours([f"Text {i} has a [MASK]." for i in range(7)])
    assert [shape[0] for shape in calls] == [3, 3, 1]  # batch_size=3


# ------------------------------------------------------------------------------------ text classification

TEXTS = ["I loved this film.", "Terrible service, never again!", "It was fine I guess", "ok"]


@pytest.mark.parametrize("model_type", with_head("sequence-classification"))
def test_text_classification(pipes, model_type):
    ours, _, ref = pipes("text-classification", model_type)
    assert_same(ours(TEXTS[0]), ref(TEXTS[0]))  # legacy: [best] for one string
    assert_same(ours(TEXTS), ref(TEXTS))
    assert_same(ours(TEXTS[0], top_k=2), ref(TEXTS[0], top_k=2))
    assert_same(ours(TEXTS, top_k=None), ref(TEXTS, top_k=None))
    assert_same(ours(TEXTS[1], function_to_apply="sigmoid"), ref(TEXTS[1], function_to_apply="sigmoid"))
    assert_same(ours(TEXTS[1], function_to_apply="none", top_k=3), ref(TEXTS[1], function_to_apply="none", top_k=3))
    pairs = [{"text": "Who wrote it?", "text_pair": t} for t in TEXTS]
    assert_same(ours(pairs[0]), ref(pairs[0]))
    assert_same(ours(pairs, top_k=None), ref(pairs, top_k=None))


@pytest.mark.parametrize("model_type", ["bert", "xlm-roberta"])
def test_rerank(pipes, model_type):
    """A one-logit cross-encoder: sigmoid scores, documents best first, equal to transformers' pair scores."""
    ours, _, ref = pipes("text-classification", model_type, num_labels=1, id2label={0: "LABEL_0"})
    query = "Which city is the capital of France?"
    ranked = ours.rerank(query, TEXTS)
    scores = [r["score"] for r in ref([{"text": query, "text_pair": t} for t in TEXTS])]
    expected = sorted(range(len(TEXTS)), key=lambda i: -scores[i])
    assert [r["corpus_id"] for r in ranked] == expected
    assert [r["text"] for r in ranked] == [TEXTS[i] for i in expected]
    np.testing.assert_allclose([r["score"] for r in ranked], [scores[i] for i in expected], atol=SCORE_TOL)
    assert [r["corpus_id"] for r in ours.rerank(query, TEXTS, top_k=2)] == expected[:2]


def test_text_classification_takes_a_generator_or_tuple_as_a_list(pipes):
    ours, _, ref = pipes("text-classification", "bert")
    texts = ["A cat sat on the mat.", "Stocks fell sharply today.", "x"]
    assert_same(ours(t for t in texts), ref(texts))
    assert_same(ours(tuple(texts), top_k=2), ref(texts, top_k=2))


def test_multi_label_problem_type_defaults_to_sigmoid(pipes):
    ours, _, ref = pipes("text-classification", "roberta", problem_type="multi_label_classification")
    got = ours(TEXTS, top_k=None)
    assert_same(got, ref(TEXTS, top_k=None))
    assert abs(sum(s["score"] for s in got[0]) - 1) > 0.05  # independent sigmoids, not a softmax


def test_text_classification_bad_and_long_inputs(pipes):
    ours, _, ref = pipes("text-classification", "roberta")
    with pytest.raises(ValueError, match="at least one"):
        ours([])
    # each input tokenized alone, as transformers' pipeline does: singles among pairs, an empty text_pair for none
    mixed = ["a text", {"text": "a", "text_pair": "pair"}, {"text": "a question", "text_pair": ""}, "more"]
    assert_same(ours(mixed, top_k=None), ref(mixed, top_k=None))
    assert_same(ours(mixed[2]), ref(mixed[2]))
    assert_same(ours([mixed[2]] * 2), ref([mixed[2]] * 2))
    assert_same(ours(""), ref(""))
    long = "This goes on and on. " * 100  # truncated to the model's 128 positions, as transformers' truncation
    assert_same(ours(long, top_k=None), ref(long, top_k=None, truncation=True))


# --------------------------------------------------------------------------------- token classification

NER_TEXTS = [
    "Angela Merkel met Emmanuel Macron in Strasbourg yesterday.",
    "Hugging Face Inc. is a company based in New York City; its headquarters are in DUMBO.",
    "Unbelievably, transformers' tokenizers split words like antidisestablishmentarianism \u2603 \U0001d518.",
]


@pytest.mark.parametrize("strategy", ["none", "simple", "first", "average", "max"])
@pytest.mark.parametrize("model_type", with_head("token-classification"))
def test_token_classification(pipes, model_type, strategy):
    ours, _, ref = pipes("token-classification", model_type)
    assert_same(ours(NER_TEXTS, aggregation_strategy=strategy), ref(NER_TEXTS, aggregation_strategy=strategy))
    expected = ref(NER_TEXTS, aggregation_strategy=strategy, ignore_labels=[])  # "O" kept: every token/word
    assert_same(ours(NER_TEXTS, aggregation_strategy=strategy, ignore_labels=[]), expected)
    assert max(map(len, expected)) > 1, "the random model should split some text into several entities"
    if strategy == "none":
        tags = {e["entity"] for entities in expected for e in entities}
        assert len(tags) > 1, f"the random model should predict several labels, got {tags}"


@pytest.mark.parametrize("model_type", ["bert", "roberta", "albert"])
def test_token_classification_long_text_with_stride(pipes, model_type):
    """With `stride`, a text longer than the model runs in overlapping windows whose entities are merged."""
    ours, _, ref = pipes("token-classification", model_type)
    long = " ".join(NER_TEXTS * 6)
    assert len(ours.tokenizer.encode_batch([long], truncation=False)[0].ids) > ours.tokenizer.model_max_length
    for strategy in ("simple", "first"):
        expected = ref(long, aggregation_strategy=strategy, stride=32)
        assert_same(ours(long, aggregation_strategy=strategy, stride=32), expected)
        assert expected[-1]["end"] > len(long) // 2  # entities come from beyond the first window too


def test_token_classification_options_and_edges(pipes):
    ours, _, ref = pipes("token-classification", "bert")
    text = NER_TEXTS[1]
    assert_same(ours(text, ignore_labels=[]), ref(text, ignore_labels=[]))
    assert_same(ours(text, aggregation_strategy="simple", ignore_labels=["PER"]),
                ref(text, aggregation_strategy="simple", ignore_labels=["PER"]))  # fmt: skip
    assert_same(ours(""), ref(""))
    long = " ".join(["Angela went to Berlin."] * 60)  # truncated to the model's length, as transformers does
    got = ours(long, ignore_labels=[])
    assert_same(got, ref(long, ignore_labels=[]))
    assert len(got) == ours.tokenizer.model_max_length - 2
    with pytest.raises(ValueError, match="aggregation_strategy"):
        ours(text, aggregation_strategy="longest")
    with pytest.raises(ValueError, match="stride needs an aggregation_strategy"):
        ours(long, stride=16, aggregation_strategy="none")  # left out, "none" is the default and stride is taken
    with pytest.raises(ValueError, match="non-empty list"):
        ours([])


# ------------------------------------------------------------------------------------ question answering

CONTEXT = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named after "
    "the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889."
)
QUESTIONS = ["Who designed the Eiffel Tower?", "When was it built?", "Where is the tower?"]


def reference_answers(ref, question, context, top_k=1, max_answer_len=15, max_seq_len=None, doc_stride=None,
                      handle_impossible_answer=False):  # fmt: skip
    """transformers 4.x `QuestionAnsweringPipeline` (fast tokenizer, question first), on transformers' tokenizer,
    model and span decoding."""
    tokenizer, model = ref
    max_seq_len = max_seq_len or min(tokenizer.model_max_length, 384)
    doc_stride = min(max_seq_len // 2, 128) if doc_stride is None else doc_stride
    enc = tokenizer(question, context, truncation="only_second", max_length=max_seq_len, stride=doc_stride,
                    return_overflowing_tokens=True, return_offsets_mapping=True)  # fmt: skip
    names = tokenizer.model_input_names
    min_null_score, answers = 1000000, []
    for span in range(len(enc["input_ids"])):
        p_mask = [tok != 1 for tok in enc.sequence_ids(span)]
        for i, token in enumerate(enc["input_ids"][span]):
            p_mask[i] = p_mask[i] and token != tokenizer.cls_token_id
        inputs = {k: torch.tensor([enc[k][span]]) for k in names if k in enc}
        with torch.no_grad():
            out = model(**inputs)
        starts, ends, scores, min_null_score = select_starts_ends(
            out.start_logits.numpy(), out.end_logits.numpy(), p_mask, inputs["attention_mask"].numpy(),
            min_null_score, top_k, handle_impossible_answer, max_answer_len,
        )  # fmt: skip
        encoding = enc[span]
        for s, e, score in zip(starts, ends, scores, strict=True):
            try:
                first = encoding.word_to_chars(encoding.token_to_word(s), sequence_index=1)[0]
                last = encoding.word_to_chars(encoding.token_to_word(e), sequence_index=1)[1]
            except Exception:
                first, last = encoding.offsets[s][0], encoding.offsets[e][1]
            answers.append({"score": score.item(), "start": first, "end": last, "answer": context[first:last]})
    if handle_impossible_answer:
        answers.append({"score": min_null_score, "start": 0, "end": 0, "answer": ""})
    answers = sorted(answers, key=lambda x: x["score"], reverse=True)[:top_k]
    return answers[0] if len(answers) == 1 else answers


@pytest.mark.parametrize("model_type", with_head("question-answering"))
def test_question_answering(pipes, model_type):
    ours, _, ref = pipes("question-answering", model_type)
    assert_same(ours(question=QUESTIONS[0], context=CONTEXT), reference_answers(ref, QUESTIONS[0], CONTEXT))
    got = ours(question=QUESTIONS[1], context=CONTEXT, top_k=4, max_answer_len=3)
    assert_same(got, reference_answers(ref, QUESTIONS[1], CONTEXT, top_k=4, max_answer_len=3))
    got = ours({"question": QUESTIONS[2], "context": CONTEXT}, top_k=2, handle_impossible_answer=True)
    assert_same(got, reference_answers(ref, QUESTIONS[2], CONTEXT, top_k=2, handle_impossible_answer=True))
    batched = ours(question=QUESTIONS, context=CONTEXT, top_k=2)
    assert_same(batched, [reference_answers(ref, q, CONTEXT, top_k=2) for q in QUESTIONS])


@pytest.mark.parametrize("model_type", ["bert", "roberta", "albert"])
def test_question_answering_long_context_windows(pipes, model_type):
    """A context far longer than max_seq_len: windows overlapping by doc_stride, answers from all of them."""
    ours, _, ref = pipes("question-answering", model_type)
    context = " ".join([CONTEXT] * 2)
    windows = ours.tokenizer.encode_windows(QUESTIONS[0], context, 64, 16)
    assert len(windows) > 1
    options = dict(top_k=5, max_seq_len=64, doc_stride=16)
    got = ours(question=QUESTIONS[0], context=context, **options)
    assert_same(got, reference_answers(ref, QUESTIONS[0], context, **options))


def test_question_answering_bad_inputs(pipes):
    ours, _, _ = pipes("question-answering", "bert")
    with pytest.raises(ValueError, match="`question` cannot be empty"):
        ours(question="", context=CONTEXT)
    with pytest.raises(ValueError, match="`context` cannot be empty"):
        ours(question="Why?", context="")
    with pytest.raises(ValueError, match="2 questions but 3 contexts"):
        ours(question=QUESTIONS[:2], context=[CONTEXT] * 3)
    with pytest.raises(ValueError, match="doc_stride"):
        ours(question="Why?", context=CONTEXT, max_seq_len=32, doc_stride=40)


# ----------------------------------------------------------------------------------- feature extraction


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_feature_extraction(pipes, model_type):
    ours, folder, ref = pipes("feature-extraction", model_type)
    texts = ["A short one.", "A somewhat longer sentence, padded beside the short one in a batch."]
    got, expected = ours(texts), ref(texts)
    assert [np.shape(g) for g in got] == [np.shape(e) for e in expected]
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, atol=1e-4, rtol=1e-4)
    single = ours(texts[0])
    assert isinstance(single, list) and isinstance(single[0][0][0], float)
    assert ours(texts[0], return_tensors=True).shape == (1, *np.shape(expected[0])[1:])
    with_mlm_head = pipeline("feature-extraction", model=mlx_encoders.load(folder))  # runs the encoder alone
    np.testing.assert_allclose(with_mlm_head(texts[1])[0], expected[1][0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("architecture", ["RobertaForMultipleChoice", "RobertaForCausalLM"])
def test_feature_extraction_runs_the_encoder_of_a_head_not_implemented_here(checkpoint, tmp_path, architecture):
    """transformers' feature-extraction loads the bare encoder of any checkpoint; so does ours (it refused the
    folder for naming a head it does not implement)."""
    folder = shutil.copytree(checkpoint("roberta", "masked-lm"), tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": [architecture]}))
    text = "A somewhat longer sentence for the encoder."
    reference = transformers.pipeline("feature-extraction", model=transformers.AutoModel.from_pretrained(folder),
                                      tokenizer=transformers.AutoTokenizer.from_pretrained(folder))  # fmt: skip
    np.testing.assert_allclose(
        pipeline("feature-extraction", model=folder)(text), reference(text), atol=1e-4, rtol=1e-4
    )


# ----------------------------------------------------------------------------------- loading and heads


def test_checkpoint_without_the_head_says_which_it_has(checkpoint):
    folder = checkpoint("bert", "sequence-classification", **DEFAULT_INIT, **OVERRIDES["sequence-classification"])
    with pytest.raises(
        ValueError, match=r"needs a masked-lm head.*sequence-classification head.*'text-classification'"
    ):
        pipeline("fill-mask", model=folder)
    encoder = checkpoint("bert", "encoder")
    with pytest.raises(ValueError, match=r"needs a question-answering head.*encoder head.*'feature-extraction'"):
        pipeline("question-answering", model=encoder)
    loaded = mlx_encoders.load(folder)
    with pytest.raises(ValueError, match=r"needs a token-classification head.*'text-classification'"):
        pipeline("token-classification", model=loaded)
    assert pipeline("sentiment-analysis", model=loaded)("fine")[0]["label"] in LABELS.values()
    with pytest.raises(ValueError, match="Unknown task 'summarization'"):
        pipeline("summarization", model=folder)


@pytest.mark.parametrize(("task", "model_type"), [("fill-mask", "bert"), ("text-classification", "roberta")])
def test_quantized_checkpoint(pipes, tmp_path, task, model_type):
    """An 8-bit checkpoint from `convert` against transformers on its dequantized weights: the same results."""
    from mlx_encoders import convert

    _, folder, _ = pipes(task, model_type)
    quantized = pipeline(task, model=convert(folder, tmp_path / "q8", bits=8, group_size=32))
    assert quantized.model.config["quantization"]["bits"] == 8
    head = PIPELINES[task].head
    ref = reference(task, convert(tmp_path / "q8", tmp_path / "float", dequantize=True), head, quantized)
    text = ["Paris is the [MASK] of France.", "A [MASK] walks into a [MASK]."] if task == "fill-mask" else TEXTS
    # convert stores float16 scales, so quantized embedding rows are looked up in float16; this tiny model,
    # initialised with a large range, amplifies that rounding: same tokens and labels, scores within 2e-2
    assert_same(quantized(text, top_k=3), ref(text, top_k=3), tol=2e-2)

"""What training and conversion refuse or flag before any work: options a task would ignore, `metric_for_best`
before the data and model load, an optimizer state of another run on resume, special tokens typed in masked-LM
text, pretraining pairs with nothing to mask, regression targets that would overflow; in conversion, recipe
patterns that match no module (warned before the weights load) and recipe settings a mode refuses (naming the
recipe)."""

import importlib
import json
import math
import warnings

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import MINILM

import mlx_encoders
from mlx_encoders import conversion
from mlx_encoders.__main__ import main
from mlx_encoders.tokenizer import Tokenizer
from mlx_encoders.train import fine_tune
from mlx_encoders.train.config import RANGES, LabelIds, Names, Number, Numbers
from mlx_encoders.train.data import (
    DataError,
    causal_lm_data,
    collate,
    masked_lm_data,
    pretraining_data,
    sequence_classification_data,
)
from mlx_encoders.train.hard_negatives import mine_hard_negatives
from mlx_encoders.train.losses.contrastive import (
    CachedMultipleNegativesRankingLoss,
    CoSENTLoss,
    MatryoshkaLoss,
    MultipleNegativesRankingLoss,
)
from mlx_encoders.train.losses.multi_vector import MaxSimRankingLoss
from mlx_encoders.train.losses.sparse import SpladeLoss
from mlx_encoders.train.masking import Masker
from mlx_encoders.train.options import add_flags
from mlx_encoders.train.trainer import OptionError, TrainingConfig, train

fine_tune_module = importlib.import_module("mlx_encoders.train.tasks.heads")  # where the head tasks load models
ROWS = [{"text": t, "label": label} for t, label in [("a fine film", "pos"), ("dull", "neg"), ("ok", "pos")]]
TAGGED = [{"tokens": ["Anna", "lives", "in", "Rome"], "ner_tags": ["B-PER", "O", "O", "B-LOC"]}]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_pretrained(MINILM)


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    "task, rows, option, value, message",
    [
        ("classify", ROWS, "whole_word_mask", True, r"whole_word_mask \(--whole-word-mask\) is for masked-lm, "
         r"pretraining and replaced-token-detection; sequence-classification would ignore it"),
        ("mlm", ROWS, "label_all_tokens", True, r"label_all_tokens \(--label-all-tokens\) is for token-classification"),
        ("tokens", TAGGED, "text_pair_column", "pair", r"text_pair_column .* token-classification would ignore it"),
        ("mlm", ROWS, "problem_type", "regression", r"problem_type .* masked-lm would ignore it"),
        ("clm", ROWS, "label2id", {"a": 0}, r"label2id .* causal-lm would ignore it"),
        ("clm", ROWS, "label_column", "label", r"label_column .* causal-lm would ignore it"),
        ("clm", ROWS, "next_sentence", True, r"next_sentence=True trains BERT's pretraining head"),
        ("classify", ROWS, "lora_alpha", 16.0, r"lora_alpha=16.0 needs lora_rank \(--lora-rank\)"),
        ("classify", ROWS, "lora_targets", ["query"], r"lora_targets=\['query'\] needs lora_rank"),
        ("classify", ROWS, "eval_every", 1, r"eval_every=1 needs evaluation data \(eval_data / --eval-data\)"),
        ("classify", ROWS, "problem_type", "ordinal", r"problem_type must be one of regression, .*, got 'ordinal'"),
    ],
)  # fmt: skip
def test_an_option_the_task_would_ignore_is_refused_before_any_work(
    checkpoint, tmp_path, task, rows, option, value, message
):
    source = checkpoint("gpt2", "causal-lm") if task == "clm" else checkpoint("bert")
    with pytest.raises(OptionError, match=message):
        fine_tune(task, rows, tmp_path / "run", model=source, **{option: value})
    assert not (tmp_path / "run").exists()


PAIRS = [{"anchor": "tea", "positive": "hot tea"}]


@pytest.mark.parametrize(
    "task, option, value, message",
    [
        ("embed", "generator", "gen", r"generator \(--generator\) is for replaced-token-detection; sentence-embedding"),
        ("rerank", "whole_word_mask", True, r"whole_word_mask .* rerank would ignore it"),
        ("sparse", "label_column", "label", r"label_column .* sparse-embedding would ignore it"),
        ("multivector", "text_column", "text", r"text_column .* multi-vector-embedding would ignore it"),
        ("embed", "lora_alpha", 8.0, r"lora_alpha=8.0 needs lora_rank"),
        ("embed", "config", {"hidden_size": 32}, r"config \(--config\) is for masked-lm, .*; sentence-embedding"),
        ("mlm", "loss", "mnrl", r"loss \(--loss\) is for sentence-embedding, .* and rerank; masked-lm would ignore"),
        ("mlm", "query_prompt", "query: ", r"query_prompt .* masked-lm would ignore it"),
        ("rerank", "document_prompt", "doc: ", r"document_prompt .* rerank would ignore it"),
        ("classify", "batch_sampler", "batch_sampler", r"batch_sampler .* sequence-classification would ignore it"),
        ("clm", "generator_size", 0.5, r"generator_size .* causal-lm would ignore it"),
        ("classify", "label2id", {"a": 0}, r"label2id means nothing with problem_type='regression'"),
        ("rtd", "lora_rank", 2, r"rtd trains every weight of the generator and the discriminator: drop lora_rank"),
        ("multivector", "lora_rank", 2, r"trains the whole model and its projection; drop lora_rank"),
    ],
)  # fmt: skip
def test_every_task_refuses_an_option_it_would_ignore_before_anything_is_read(tmp_path, task, option, value, message):
    missing = tmp_path / "missing"  # neither the model nor the data exists: the option fails first
    extra = {"problem_type": "regression"} if option == "label2id" else {}
    with pytest.raises(OptionError, match=message):
        fine_tune(task, missing, tmp_path / "run", model=missing, **{option: value}, **extra)
    assert not (tmp_path / "run").exists()


def test_label2id_with_regression_targets_read_from_the_data_is_refused(tokenizer):
    rows = [{"text": "a", "label": 0.5}, {"text": "b", "label": 1.5}]
    with pytest.raises(DataError, match=r"item 1 of the data: the labels are regression targets .* label2id="):
        sequence_classification_data(rows, tokenizer, label2id={"good": 0, "bad": 1})


@pytest.mark.parametrize(
    "kind, flags, message",
    [
        ("mlm", ["--query-prompt", "q: "], "query_prompt (--query-prompt) is for"),
        ("classify", ["--matryoshka-dims", "8"], "--matryoshka-dims is an option of train embed, not of classify"),
        ("embed", ["--document-regularizer-weight", "0.1"], "--document-regularizer-weight is an option of train "
         "sparse"),
        ("sparse", ["--loss", "mnrl"], "--loss names an embed or rerank loss; sparse trains with its own"),
        ("embed", ["--matryoshka-weights", "1", "0.5"], "--matryoshka-weights needs --matryoshka-dims"),
        ("embed", ["--matryoshka-dims", "32", "16", "--matryoshka-weights", "1"], "gives 1 weight(s) for 2 "
         "--matryoshka-dims"),
        ("embed", ["--mini-batch-size", "4"], "--mini-batch-size is an option of --loss cached-mnrl"),
        ("embed", ["--loss", "cached-mnrl", "--mini-batch-size", "0"], "mini_batch_size must be an integer >= 1"),
        ("embed", ["--matryoshka-dims", "0"], "matryoshka_dims must each be an integer >= 1"),
    ],
)  # fmt: skip
def test_the_command_exits_2_on_a_flag_the_task_ignores(tmp_path, capsys, kind, flags, message):
    args = ["train", kind, "-m", str(tmp_path / "missing"), "--data", str(tmp_path / "missing.jsonl")]
    assert main([*args, "-o", str(tmp_path / "run"), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_the_command_exits_2_on_an_ignored_option(checkpoint, tmp_path, capsys):
    data = jsonl(tmp_path / "train.jsonl", ROWS)
    args = ["train", "classify", "-m", str(checkpoint("bert")), "--data", str(data), "-o", str(tmp_path / "run")]
    assert main([*args, "--whole-word-mask"]) == 2
    assert "mlx-encoders train: error: whole_word_mask (--whole-word-mask) is for" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("option, value", [("eval_every", 1), ("metric_for_best", "eval_loss")])
def test_train_refuses_an_evaluation_option_without_evaluation_examples(tmp_path, tokenizer, option, value):
    # train() itself, as fine_tune does: the run would never evaluate, so the option would vanish
    examples = sequence_classification_data(ROWS, tokenizer)
    config = TrainingConfig(tmp_path / "run", max_steps=1, **{option: value})
    with pytest.raises(OptionError, match=rf"{option}={value!r} needs evaluation data \(eval_data / --eval-data\)"):
        train(None, tokenizer, examples, None, config)
    assert not (tmp_path / "run").exists()


def test_an_option_another_replaces_warns(checkpoint, tmp_path):
    with pytest.warns(UserWarning, match=r"warmup_ratio \(--warmup-ratio\) is ignored: warmup_steps"):
        fine_tune("classify", ROWS, tmp_path / "run", model=checkpoint("bert"), max_steps=1, warmup_ratio=0.5,
                  warmup_steps=1)  # fmt: skip


def test_metric_for_best_is_checked_before_the_data_and_the_model_load(tmp_path, checkpoint, monkeypatch):
    missing = tmp_path / "missing.jsonl"  # neither the data nor the model exists: the option fails first
    with pytest.raises(OptionError, match=r"metric_for_best='eval_bogus' is not a metric sequence-classification"):
        fine_tune("classify", missing, tmp_path / "run", model=tmp_path / "no-model", eval_data=missing,
                  metric_for_best="eval_bogus")  # fmt: skip
    with pytest.raises(OptionError, match=r"'eval_perplexity' is not a metric token-classification reports"):
        fine_tune("tokens", missing, tmp_path / "run", model=tmp_path / "no-model", eval_data=missing,
                  metric_for_best="eval_perplexity")  # fmt: skip

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the option was checked")

    # multi-label data reports no F1: known once the data is read, still before the model loads
    monkeypatch.setattr(fine_tune_module, "load_head", no_model)
    rows = [{"text": "a fine film", "label": ["pos"]}, {"text": "dull", "label": ["neg", "pos"]}]
    with pytest.raises(OptionError, match=r"metric_for_best='eval_f1' is not a metric sequence-classification "
                       r"reports; choose one of eval_loss$"):  # fmt: skip
        fine_tune("classify", rows, tmp_path / "run", model=checkpoint("bert"), eval_data=rows,
                  metric_for_best="eval_f1")  # fmt: skip
    assert not (tmp_path / "run").exists()


def test_resume_refuses_an_optimizer_state_of_another_run(checkpoint, tmp_path):
    options = dict(model=checkpoint("bert"), max_steps=1, batch_size=2, lr=1e-3)
    fine_tune("classify", ROWS, tmp_path / "plain", **options)
    state = tmp_path / "plain/checkpoint-1/optimizer.safetensors"
    # weight decay splits the parameters into two groups: the state of one group cannot resume the other's
    with pytest.raises(ValueError, match=r"plain/checkpoint-1/optimizer.safetensors: no tensor 'states\.0\.bert\..*"
                       r"belongs to another run"):  # fmt: skip
        fine_tune("classify", ROWS, tmp_path / "a", weight_decay=0.01, resume=state.parent, **options)
    # a hand-edited tensor of another shape would broadcast silently into every later step
    tensors = mx.load(str(state))
    tensors["classifier.bias.m"] = mx.zeros((1,))
    mx.save_safetensors(str(state), tensors)
    with pytest.raises(ValueError, match=r"optimizer.safetensors: tensor 'classifier.bias.m' has shape \(1,\), but "
                       r"this run's parameter has \(2,\)"):  # fmt: skip
        fine_tune("classify", ROWS, tmp_path / "b", resume=state.parent, **options)
    del tensors["classifier.bias.m"], tensors["classifier.bias.v"]
    tensors["classifier.extra.m"] = mx.zeros((2,))
    mx.save_safetensors(str(state), tensors)
    with pytest.raises(ValueError, match=r"optimizer.safetensors: no tensor 'classifier.bias.m'"):
        fine_tune("classify", ROWS, tmp_path / "c", resume=state.parent, **options)
    del tensors["classifier.extra.m"]
    tensors["classifier.bias.m"] = tensors["classifier.bias.v"] = mx.zeros((2,))
    tensors["classifier.extra.m"] = mx.zeros((2,))
    mx.save_safetensors(str(state), tensors)
    with pytest.raises(ValueError, match=r"tensor 'classifier.extra.m' is no trainable parameter's state in this run"):
        fine_tune("classify", ROWS, tmp_path / "d", resume=state.parent, **options)


def test_special_tokens_typed_in_masked_lm_text_are_flagged_naming_the_lines(tmp_path, tokenizer):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a plain line\n\nthe [MASK] sat\n\nplain again\n\n[CLS] tea and [SEP] cake\n")
    with pytest.warns(UserWarning, match=r"corpus.txt:3: \[MASK\] typed in the text \(and in 1 more: lines 7\) "
                      r"becomes the special token itself"):  # fmt: skip
        masked_lm_data(corpus, tokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an unknown character is no typed special token
        masked_lm_data([{"text": "tea \u2603 and cake"}], tokenizer)
    # a text of typed special tokens only has nothing to mask, as transformers' collator sees it
    with pytest.raises(DataError, match=r"item 2 of the data: the document has no token to mask"):
        masked_lm_data([{"text": "tea"}, {"text": "[MASK] [SEP]"}], tokenizer)


@pytest.mark.parametrize("whole_word", [False, True])
def test_masking_never_selects_a_special_token_typed_in_the_text(tokenizer, whole_word):
    from transformers import AutoTokenizer

    texts = ["the [MASK] sat on [CLS] a mat", "[SEP] tea and [UNK] cake [PAD]", "plain words only"]
    with pytest.warns(UserWarning, match=r"item 1 of the data: \[CLS\], \[MASK\] typed in the text \(and in 1 more"):
        examples = masked_lm_data([{"text": t} for t in texts], tokenizer)
    reference = AutoTokenizer.from_pretrained(MINILM)
    masker = Masker.from_tokenizer(tokenizer, probability=1.0, mask_fraction=1.0, random_fraction=0.0,
                                   whole_word=whole_word)  # fmt: skip
    batch = collate(examples, range(len(texts)), tokenizer, masker, np.random.default_rng(0))
    for row, text in enumerate(texts):
        ids = reference(text)["input_ids"]  # the collator's mask, as it computes it without one given
        special = np.array(reference.get_special_tokens_mask(ids, already_has_special_tokens=True), dtype=bool)
        assert batch["input_ids"].shape[1] >= len(ids) and examples.encodings[row].ids == ids
        # every token is selected (probability 1) except exactly those the collator's special mask excludes
        np.testing.assert_array_equal(batch["labels"][row, : len(ids)] == -100, special)


def test_special_tokens_typed_in_causal_lm_text_are_flagged_naming_the_lines(checkpoint, tmp_path):
    tokenizer = Tokenizer.from_pretrained(checkpoint("gpt2", "causal-lm"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a plain line\n\nthe end<|endoftext|>and more\n")
    with pytest.warns(UserWarning, match=r"corpus.txt:3: <\|endoftext\|> typed in the text becomes the special "
                      r"token itself, which causal-LM training then learns to predict inside text"):  # fmt: skip
        causal_lm_data(corpus, tokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        causal_lm_data([{"text": "tea \u2603 and cake"}], tokenizer)


@pytest.mark.parametrize("head", ["encoder", "masked-lm"])
def test_next_sentence_from_a_checkpoint_without_that_head_is_refused_before_the_data_is_read(
    checkpoint, tmp_path, head
):
    missing = tmp_path / "missing.txt"  # the data is not read: the option fails first
    with pytest.raises(OptionError, match=r"next_sentence \(--next-sentence\) trains BERT's pretraining heads, but .* "
                       r"has no next-sentence head .*; start from a BERT pretraining checkpoint"):  # fmt: skip
        fine_tune("mlm", missing, tmp_path / "run", model=checkpoint("bert", head), next_sentence=True)
    assert not (tmp_path / "run").exists()


def test_pretraining_pairs_are_checked_as_masked_lm_text(tmp_path, tokenizer):
    rng = __import__("numpy").random.default_rng(0)
    nothing = tmp_path / "nothing.txt"
    nothing.write_text("[SEP]\n[CLS]\n\n[MASK]\n[SEP]\n")
    with pytest.raises(DataError, match=r"nothing.txt:1: the document has no token to mask"):
        pretraining_data(nothing, tokenizer, rng)
    typed = tmp_path / "typed.txt"
    typed.write_text("tea and [MASK]\ncake\n\nmore tea\nand cake\n")
    with pytest.warns(UserWarning, match=r"typed.txt:1: \[MASK\] typed in the text"):
        pretraining_data(typed, tokenizer, rng)
    one = tmp_path / "one.txt"
    one.write_text("tea\ncake\n")
    with pytest.raises(DataError, match=r"one.txt: next-sentence pairs need at least 2 documents, found 1"):
        pretraining_data(one, tokenizer, rng)


@pytest.mark.parametrize("target", [float("inf"), float("-inf"), 1e30, "1e400"])
def test_regression_targets_that_would_overflow_are_refused_naming_the_item(tokenizer, target):
    rows = [{"text": "a", "label": 0.5}, {"text": "b", "label": target}]
    with pytest.raises(DataError, match=r"item 2 of the data: regression target .* is not a finite number within "
                       r"\+-1e\+12"):  # fmt: skip
        sequence_classification_data(rows, tokenizer, problem_type="regression")


def test_convert_warns_of_an_unmatched_recipe_pattern_before_the_weights_load(checkpoint, tmp_path, monkeypatch):
    def no_load(*args, **kwargs):
        raise RuntimeError("weights loaded")

    monkeypatch.setattr(conversion, "load_model", no_load)
    recipe = {"encoder.layers.*": 4, "*": 8}  # our BERT's paths are bert.encoder.layer.N...
    with pytest.warns(UserWarning, match=r"Recipe pattern 'encoder\.layers\.\*' matches no Linear or Embedding"):
        with pytest.raises(RuntimeError, match="weights loaded"):
            mlx_encoders.convert(checkpoint("bert"), tmp_path / "mlx", recipe=recipe, calibration=False)


@pytest.mark.parametrize(
    "recipe, message",
    [
        ("mixed_4_8", r"recipe 'mixed_4_8': mxfp4 quantization supports bits \[4\], not 8"),
        ({"*.query": 8}, r"Recipe entry '\*\.query': mxfp4 quantization supports bits \[4\], not 8"),
        ({"*": {"bits": 4, "group_size": 7}}, r"Recipe entry '\*': mxfp4 quantization supports group sizes"),
    ],
)
def test_a_recipe_setting_the_mode_refuses_names_the_recipe(checkpoint, tmp_path, recipe, message):
    # the bits come from the recipe, not --bits: the error says where
    with pytest.raises(ValueError, match=message):
        mlx_encoders.convert(checkpoint("bert"), tmp_path / "mlx", mode="mxfp4", recipe=recipe)
    assert not (tmp_path / "mlx").exists()


# ----- every numeric and list option's range, in the one table (config.RANGES) -----


def refused_values(spec) -> list:
    """Values `spec` (an entry of config.RANGES) must refuse: NaN, infinities, below or above its bounds (negative
    where it starts at 0), a fraction or a bool for an integer, a text; for lists also empty ones, a value twice,
    all zeros."""
    if isinstance(spec, Number):
        values = [math.nan, math.inf, -math.inf, "1"]
        values += [spec.low - 1] if math.isfinite(spec.low) else []
        values += [spec.low] if spec.low_open else []
        values += [spec.high + 0.5] if math.isfinite(spec.high) else []
        values += [max(spec.low, 0) + 1.5, True] if spec.integer else []
        return values + ([] if spec.optional else [None])
    if isinstance(spec, Numbers):
        good = max(spec.each.low, 0) + 1
        values = [[], [math.nan], [good, math.inf], "1", [good, *refused_values(spec.each)[4:5]]]
        values += [[good, good]] if spec.distinct else []
        return values + ([[0, 0]] if spec.some else [])
    if isinstance(spec, Names):
        return [[], "query", ["query", "query"], [""], [1]]
    assert isinstance(spec, LabelIds), spec
    return [{}, {"a": 0, "b": 0}, {"a": 1}, {"a": 0, "b": 2}, {"a": -1}, {"a": "0"}, {"a": True}]


def through_fine_tune(task: str, **extra):
    def call(tmp_path, name, value):  # neither the model nor the data exists: the option fails first
        missing = tmp_path / "missing"
        fine_tune(task, missing, tmp_path / "run", model=missing, **{**extra, name: value})

    return call


def through_loss(make):
    return lambda tmp_path, name, value: make(name, value)


def through_mining(tmp_path, name, value):
    mine_hard_negatives(tmp_path / "missing.jsonl", None, **{name: value})


LOSSES_WITH_SCALE = [MultipleNegativesRankingLoss, CachedMultipleNegativesRankingLoss, CoSENTLoss, SpladeLoss,
                     MaxSimRankingLoss]  # fmt: skip
TRAINING_FIELDS = [name for name in TrainingConfig.__dataclass_fields__ if name in RANGES]
# each option of the table: the library calls that take it
LIBRARY = {name: [through_fine_tune("classify")] for name in TRAINING_FIELDS} | {
    "batch_size": [through_fine_tune("embed"), through_mining],
    "max_length": [through_fine_tune("classify"), through_fine_tune("rerank")],
    "lora_rank": [through_fine_tune("embed")],
    "lora_alpha": [through_fine_tune("classify", lora_rank=2)],
    "lora_targets": [through_fine_tune("classify", lora_rank=2)],
    "label2id": [through_fine_tune("tokens")],
    "generator_size": [through_fine_tune("rtd")],
    "discriminator_weight": [through_fine_tune("rtd")],
    "scale": [through_loss(lambda name, v, loss=loss: loss(scale=v)) for loss in LOSSES_WITH_SCALE],
    "mini_batch_size": [through_loss(lambda name, v: CachedMultipleNegativesRankingLoss(mini_batch_size=v))],
    "matryoshka_dims": [through_loss(lambda name, v: MatryoshkaLoss(MultipleNegativesRankingLoss(), v))],
    "matryoshka_weights": [through_loss(lambda name, v: MatryoshkaLoss(MultipleNegativesRankingLoss(), [32, 16], v))],
} | {name: [through_loss(lambda name, v: SpladeLoss(**{name: v}))] for name in RANGES if "regularizer" in name} | {
    name: [through_mining]
    for name in ("num_negatives", "range_min", "range_max", "absolute_margin", "relative_margin", "max_score",
                 "min_score")
}  # fmt: skip
# the command's flags for them: `train TASK` or `mine`, with the arguments that make the flag read
COMMAND = {name: ("classify", []) for name in TRAINING_FIELDS + ["max_length", "lora_rank"]} | {
    "lora_alpha": ("classify", ["--lora-rank", "2"]),
    "generator_size": ("rtd", []),
    "discriminator_weight": ("rtd", []),
    "mini_batch_size": ("embed", ["--loss", "cached-mnrl"]),
    "document_regularizer_weight": ("sparse", []),
    "query_regularizer_weight": ("sparse", []),
} | {name: ("mine", []) for name in LIBRARY if through_mining in LIBRARY[name]}  # fmt: skip


def test_the_range_table_covers_every_option_the_library_and_the_command_take():
    assert set(LIBRARY) == set(RANGES), "give each option of config.RANGES the calls that take it"
    flags = {a.dest for a in parser_actions(add_flags)}
    assert set(RANGES) & flags - {"lora_targets", "matryoshka_dims", "matryoshka_weights"} <= set(COMMAND)


def parser_actions(add) -> list:
    import argparse

    parser = argparse.ArgumentParser()
    add(parser)
    return parser._actions


@pytest.mark.parametrize("name", sorted(RANGES))
def test_an_option_out_of_its_range_is_refused_by_the_library_naming_it(tmp_path, name):
    for call in LIBRARY[name]:
        for value in refused_values(RANGES[name]):
            with pytest.raises(OptionError, match=rf"\b{name}\b") as refused:
                call(tmp_path, name, value)
            assert not (tmp_path / "run").exists(), f"{name}={value!r}: refused after writing"
            assert "missing" not in str(refused.value), f"{name}={value!r}: the data or model was read first"


@pytest.mark.parametrize("name", sorted(COMMAND))
def test_an_option_out_of_its_range_exits_2_on_the_command_line_naming_it(tmp_path, capsys, name):
    kind, extra = COMMAND[name]
    flag, missing = f"--{name.replace('_', '-')}", str(tmp_path / "missing")
    argv = ["mine", "-m", missing, "--data", missing] if kind == "mine" else ["train", kind, "-m", missing]
    argv += ["-o", str(tmp_path / "run")] + ([] if kind == "mine" else ["--data", missing]) + extra
    typed = [v for v in refused_values(RANGES[name]) if isinstance(v, float | int) and not isinstance(v, bool)]
    for value in typed:
        capsys.readouterr()
        try:
            status = main([*argv, flag, str(value)])
        except SystemExit as stop:  # argparse: not an integer
            status = stop.code
        err = capsys.readouterr().err
        assert status == 2, f"{flag} {value}: exit {status}: {err[-400:]}"
        line = next(x for x in err.splitlines() if "error:" in x)
        assert flag in line or name in line, line
        assert not (tmp_path / "run").exists()

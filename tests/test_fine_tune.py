"""`fine_tune` and `python -m mlx_encoders train`: from a data file to a model folder that transformers and our own
pipelines read, for each task; the options of the loop (length-grouped batches, bfloat16 compute, LoRA) and the
errors a user meets first."""

import errno
import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import seqeval.metrics as seqeval
import torch
import transformers
from checkpoints import MINILM, make_checkpoint
from mlx.utils import tree_flatten

import mlx_encoders
from mlx_encoders.__main__ import main
from mlx_encoders.train import TrainingConfig, fine_tune, train, trainer
from mlx_encoders.train.data import (
    DataError,
    causal_lm_data,
    collate,
    masked_lm_data,
    sequence_classification_data,
)
from mlx_encoders.train.losses import split_batch, task_loss
from mlx_encoders.train.masking import Masker
from mlx_encoders.train.tasks import heads
from mlx_encoders.train.tasks.heads import from_config
from mlx_encoders.train.trainer import OptionError, epoch_steps, length_grouped

TEXTS = [
    "a fine film", "dull and long", "it was ok", "the best thing this year", "I walked out", "fine, not great",
    "a quiet, lovely story", "the plot makes no sense", "worth a second look", "too loud by half",
]  # fmt: skip
LABELS = ["pos", "neg", "neutral", "pos", "neg", "neutral", "pos", "neg", "pos", "neg"]
SENTENCES = [
    (["Anna", "lives", "in", "Berlin"], ["B-PER", "O", "O", "B-LOC"]),
    (["Mr", "John", "Smith", "visited", "New", "York"], ["O", "B-PER", "I-PER", "O", "B-LOC", "I-LOC"]),
    (["The", "river", "Thames", "is", "long"], ["O", "O", "B-LOC", "O", "O"]),
    (["Maria", "and", "Paul", "met"], ["B-PER", "O", "B-PER", "O"]),
    (["Rome", "is", "old"], ["B-LOC", "O", "O"]),
    (["We", "saw", "Lisa", "Ray", "in", "Paris"], ["O", "O", "B-PER", "I-PER", "O", "B-LOC"]),
]
DOCUMENTS = (
    "The cat sat on the mat.\nIt looked at the bird.\nThen it slept all day.\n\n"
    "Stocks fell in the morning.\nBonds rose after lunch.\nThe market closed flat.\n\n"
    "The river runs to the sea.\nBoats sail on the river.\n"
)
SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
             max_position_embeddings=64)  # fmt: skip


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def classification_file(tmp_path, name="train.jsonl", rows=None):
    rows = rows or [{"text": t, "label": label} for t, label in zip(TEXTS, LABELS, strict=True)]
    return write_jsonl(tmp_path / name, rows)


def test_eval_label_ids_against_training_label_names_are_refused(checkpoint, tmp_path):
    """Training names its labels (their ids are the sorted names'): ids in the evaluation data would be read in an
    order the user never chose, and the metrics would be wrong; with label2id= they mean what it says."""
    data = classification_file(tmp_path)
    ids = {"neg": 0, "neutral": 1, "pos": 2}
    eval_rows = [{"text": t, "label": ids[label]} for t, label in zip(TEXTS, LABELS, strict=True)]
    eval_file = write_jsonl(tmp_path / "eval.jsonl", eval_rows)
    with pytest.raises(DataError, match=r"eval_data: .*eval.jsonl:1: label id 2, where the training data names"):
        fine_tune("classify", data, tmp_path / "run", model=checkpoint("bert"), eval_data=eval_file, max_steps=1)
    trained = fine_tune(
        "classify", data, tmp_path / "run2", model=checkpoint("bert"), eval_data=eval_file, max_steps=1,
        label2id=ids,
    )  # fmt: skip
    assert trained.model.args.id2label == {i: name for name, i in ids.items()}


def test_cli_classify_fine_tunes_an_encoder_into_a_head_transformers_reads(checkpoint, tmp_path, capsys):
    train_file = classification_file(tmp_path)
    eval_file = tmp_path / "eval.csv"
    eval_file.write_text(
        "text,label\n" + "".join(f'"{t}",{label}\n' for t, label in zip(TEXTS[:6], LABELS[:6], strict=True))
    )
    out = tmp_path / "run"
    status = main([
        "train", "classify", "--model", str(checkpoint("bert")), "--data", str(train_file), "--eval-data",
        str(eval_file), "--output", str(out), "--epochs", "2", "--batch-size", "4", "--lr", "1e-3", "--json",
    ])  # fmt: skip
    assert status == 0
    captured = capsys.readouterr()
    printed = json.loads(captured.out)
    assert captured.err.count("Compiling the training step (first step only)...") == 1  # else a silent first step
    assert printed["model"] == str(out / "model")
    assert {"eval_loss", "eval_accuracy", "eval_f1", "step", "epoch"} <= set(printed["metrics"])
    assert (out / "metrics.jsonl").is_file() and (out / "curves.png").stat().st_size > 1000
    assert [p.name for p in sorted(out.glob("checkpoint-*"))] == ["checkpoint-6"]  # 3 steps an epoch

    config = json.loads((out / "model" / "config.json").read_text())
    assert config["architectures"] == ["BertForSequenceClassification"]
    assert config["label2id"] == {"neg": 0, "neutral": 1, "pos": 2}
    ours, tokenizer = mlx_encoders.load(out / "model")
    reference = transformers.AutoModelForSequenceClassification.from_pretrained(out / "model").eval()
    batch = tokenizer(TEXTS[:4], padding=True, return_tensors="np")
    with torch.no_grad():
        expected = reference(**{k: torch.tensor(v) for k, v in batch.items()}).logits.numpy()
    got = np.array(ours(**{k: mx.array(v) for k, v in batch.items()}).logits)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    labels = mlx_encoders.pipeline("text-classification", model=out / "model")(TEXTS[:2])
    assert {r["label"] for r in labels} <= {"neg", "neutral", "pos"}


def test_cli_interrupted_says_how_to_go_on_with_or_without_a_checkpoint(checkpoint, tmp_path, capsys, monkeypatch):
    out, saved = tmp_path / "run", []

    def interrupted(kind, data, output, **options):  # a run stopped by Ctrl-C after its checkpoints so far
        Path(output).mkdir(exist_ok=True)
        (Path(output) / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
        for step in saved:
            (Path(output) / f"checkpoint-{step}").mkdir(exist_ok=True)
        raise KeyboardInterrupt

    monkeypatch.setattr(sys.modules["mlx_encoders.train.fine_tune"], "fine_tune", interrupted)
    command = ["train", "classify", "--model", str(checkpoint("bert")), "--data", str(classification_file(tmp_path)),
               "--output", str(out)]  # fmt: skip
    assert main(command) == 130
    assert "no checkpoint was saved yet: run the same command again with --overwrite" in capsys.readouterr().err
    saved[:] = [2, 10]
    assert main([*command, "--overwrite"]) == 130
    assert f"continue with --resume {out / 'checkpoint-10'} (the last one saved" in capsys.readouterr().err


def test_a_full_disk_at_the_final_save_says_to_resume_from_the_last_checkpoint(checkpoint, tmp_path, monkeypatch):
    def full(model, path, *args, **kwargs):
        raise OSError(errno.ENOSPC, f"disk full while writing {path}; nothing was written. Free space on that disk "
                      "(or write elsewhere) and run again")  # fmt: skip

    monkeypatch.setattr(heads, "save", full)
    out = tmp_path / "run"
    with pytest.raises(OSError, match=r"once space is freed, resume from .*checkpoint-3 \(resume=, --resume\)"):
        fine_tune("classify", classification_file(tmp_path), out, model=checkpoint("bert"), max_steps=3, batch_size=4)
    monkeypatch.undo()
    fine_tune("classify", classification_file(tmp_path), out, model=checkpoint("bert"), max_steps=3, batch_size=4,
              resume=out / "checkpoint-3")  # fmt: skip
    assert (out / "model" / "model.safetensors").is_file()


def test_masked_lm_from_scratch_answers_fill_mask(tmp_path):
    data, held_out = tmp_path / "docs.txt", tmp_path / "held_out.txt"
    data.write_text(DOCUMENTS)
    held_out.write_text("The bird sat on the river.\n\nThe market rose.\n")
    trained = fine_tune(
        "mlm", data, tmp_path / "run", config=SIZES, tokenizer=MINILM, eval_data=held_out, epochs=2,
        batch_size=2, lr=1e-3, max_length=32,
    )  # fmt: skip
    assert {"eval_loss", "eval_accuracy", "eval_perplexity"} <= set(trained.metrics)
    assert trained.metrics["eval_perplexity"] == pytest.approx(np.exp(trained.metrics["eval_loss"]))
    config = json.loads((trained.path / "config.json").read_text())
    assert config["architectures"] == ["BertForMaskedLM"] and config["vocab_size"] == 30522
    # initialised as transformers does: normal(0, 0.02) weights, the padding row zero
    table = np.array(from_config(dict(SIZES), "masked-lm", trained.tokenizer).bert.embeddings.word_embeddings.weight)
    assert not table[0].any() and table[1:].std() == pytest.approx(0.02, rel=0.02)
    predictions = mlx_encoders.pipeline("fill-mask", model=trained.path)("The cat [MASK] on the mat.")
    assert len(predictions) == 5 and all(p["sequence"].startswith("the cat") for p in predictions)
    reference = transformers.AutoModelForMaskedLM.from_pretrained(trained.path).eval()
    ids = trained.tokenizer(["The cat sat."], return_tensors="np")
    with torch.no_grad():
        expected = reference(**{k: torch.tensor(v) for k, v in ids.items()}).logits.numpy()
    got = np.array(trained.model(**{k: mx.array(v) for k, v in ids.items()}).logits)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_bert_pretraining_trains_masked_lm_and_next_sentence(checkpoint, tmp_path):
    data = tmp_path / "docs.txt"
    data.write_text(DOCUMENTS)
    trained = fine_tune(
        "mlm", data, tmp_path / "run", model=checkpoint("bert", "pretraining"), next_sentence=True, max_steps=2,
        batch_size=3,
    )  # fmt: skip
    assert trained.metrics["step"] == 2 and np.isfinite(trained.metrics["loss"])
    config = json.loads((trained.path / "config.json").read_text())
    assert config["architectures"] == ["BertForPreTraining"]


def test_token_classification_reports_entity_scores_as_seqeval(checkpoint, tmp_path):
    rows = [{"tokens": words, "ner_tags": tags} for words, tags in SENTENCES]
    data = write_jsonl(tmp_path / "ner.jsonl", rows)
    trained = fine_tune(
        "tokens", data, tmp_path / "run", model=checkpoint("distilbert"), eval_data=data, epochs=3, batch_size=2,
        lr=5e-3,
    )  # fmt: skip
    metrics = trained.metrics
    # the oracle: seqeval on the word-level predictions of the trained model (each word's first sub-token)
    id2label = trained.model.args.id2label
    true, predicted = [], []
    for words, tags in SENTENCES:
        encoding = trained.tokenizer.backend.encode(words, is_pretokenized=True)
        logits = trained.model(mx.array([encoding.ids])).logits[0]
        firsts = [i for i, w in enumerate(encoding.word_ids) if w is not None and w != encoding.word_ids[i - 1]]
        true.append(tags)
        predicted.append([id2label[int(logits[i].argmax())] for i in firsts])
    assert metrics["eval_precision"] == pytest.approx(seqeval.precision_score(true, predicted), abs=1e-6)
    assert metrics["eval_recall"] == pytest.approx(seqeval.recall_score(true, predicted), abs=1e-6)
    assert metrics["eval_f1"] == pytest.approx(seqeval.f1_score(true, predicted), abs=1e-6)
    config = json.loads((trained.path / "config.json").read_text())
    assert config["architectures"] == ["DistilBertForTokenClassification"]
    assert set(config["label2id"]) == {"B-LOC", "B-PER", "I-LOC", "I-PER", "O"}


@pytest.mark.parametrize(
    "labels, problem_type",
    [([["pos"], ["neg", "pos"]] * 5, "multi_label_classification"), ([0.5, 1.25] * 5, "regression")],
)
def test_problem_type_follows_the_labels(checkpoint, tmp_path, labels, problem_type):
    data = classification_file(tmp_path, rows=[{"text": t, "label": v} for t, v in zip(TEXTS, labels, strict=True)])
    trained = fine_tune("classify", data, tmp_path / "run", model=checkpoint("roberta"), max_steps=2)
    config = json.loads((trained.path / "config.json").read_text())
    assert config["problem_type"] == problem_type
    assert len(config["id2label"]) == (2 if problem_type != "regression" else 1)
    if problem_type == "multi_label_classification":  # a kept head of other problem type: the data's, as run_glue
        config["problem_type"] = "single_label_classification"
        (trained.path / "config.json").write_text(json.dumps(config))
        again = fine_tune("classify", data, tmp_path / "again", model=trained.path, max_steps=1)
        assert json.loads((again.path / "config.json").read_text())["problem_type"] == problem_type


def test_lora_saves_adapters_alone_and_the_fused_model(checkpoint, tmp_path):
    data = classification_file(tmp_path)
    trained = fine_tune(
        "classify", data, tmp_path / "run", model=checkpoint("bert", "masked-lm"), lora_rank=4, max_steps=3, lr=1e-2
    )
    adapters = tmp_path / "run" / "adapters"
    assert (adapters / "adapters.safetensors").is_file() and (adapters / "adapter_config.json").is_file()
    assert (adapters / "adapters.safetensors").stat().st_size < (trained.path / "model.safetensors").stat().st_size
    reloaded, tokenizer = mlx_encoders.load(trained.path)
    batch = {k: mx.array(v) for k, v in tokenizer(TEXTS[:3], padding=True, return_tensors="np").items()}
    np.testing.assert_allclose(np.array(reloaded(**batch).logits), np.array(trained.model(**batch).logits), atol=1e-6)


def test_lora_run_resumes_from_its_adapter_checkpoint(checkpoint, tmp_path):
    data = classification_file(tmp_path)
    options = dict(model=checkpoint("bert", "masked-lm"), lora_rank=4, max_steps=4, save_every=2, keep_last=None)
    whole = fine_tune("classify", data, tmp_path / "whole", lr=1e-2, **options)
    saved = tmp_path / "whole" / "checkpoint-2"
    assert (saved / "adapters.safetensors").is_file() and not (saved / "model.safetensors").exists()
    copy = shutil.copytree(saved, tmp_path / "resumed" / "checkpoint-2")
    resumed = fine_tune("classify", data, tmp_path / "resumed", lr=1e-2, resume=copy, **options)
    expected = dict(tree_flatten(whole.model.parameters()))
    for name, value in tree_flatten(resumed.model.parameters()):
        np.testing.assert_allclose(np.array(value), np.array(expected[name]), atol=1e-6, err_msg=name)
    with pytest.raises(ValueError, match="holds LoRA adapters, but the model to resume has no adapters"):
        fine_tune("classify", data, tmp_path / "x", model=checkpoint("bert", "masked-lm"), resume=saved, max_steps=4)


def test_errors_name_the_problem(checkpoint, tmp_path, capsys):
    data = classification_file(tmp_path)
    bad_eval = classification_file(
        tmp_path, "eval.jsonl", [{"text": "x", "label": "pos"}, {"text": "y", "label": "??"}]
    )
    with pytest.raises(DataError, match=r"eval.jsonl:2: unknown label '\?\?'"):
        fine_tune("classify", data, tmp_path / "a", model=checkpoint("bert"), eval_data=bad_eval)
    with pytest.raises(ValueError, match="not both"):
        fine_tune("mlm", data, tmp_path / "b", model=checkpoint("bert"), config=SIZES, tokenizer=MINILM)
    with pytest.raises(ValueError, match="needs tokenizer="):
        fine_tune("mlm", data, tmp_path / "c", config=SIZES)
    with pytest.raises(ValueError, match="Unknown training task 'ner'"):
        fine_tune("ner", data, tmp_path / "d", model=checkpoint("bert"))
    with pytest.raises(TypeError, match="unknown options learning_rate"):
        fine_tune("classify", data, tmp_path / "e", model=checkpoint("bert"), learning_rate=1e-3)
    missing = tmp_path / "missing.jsonl"
    assert main(["train", "classify", "-m", str(checkpoint("bert")), "--data", str(missing), "-o", "f"]) == 1
    assert f"mlx-encoders train: error: {missing}: no such file" in capsys.readouterr().err


def test_fine_tune_refuses_a_tokenizer_with_ids_past_the_model_vocabulary(tmp_path):
    # all-MiniLM-L6-v2's tokenizer has 30522 tokens; a table of 1000 embeddings would be indexed past its end
    small = make_checkpoint(tmp_path / "small", "bert", "masked-lm", vocab_size=1000)
    data = classification_file(tmp_path)
    with pytest.raises(ValueError, match=r"has 30522 tokens .*vocab_size of 1000 embeddings"):
        fine_tune("classify", data, tmp_path / "a", model=small, max_steps=1)
    with pytest.raises(ValueError, match=r"has 30522 tokens .*vocab_size of 1000 embeddings"):
        fine_tune("mlm", data, tmp_path / "b", config={**SIZES, "vocab_size": 1000}, tokenizer=MINILM, max_steps=1)


def test_length_grouped_order_equals_transformers(monkeypatch):
    from transformers.trainer_pt_utils import get_length_grouped_indices

    rng = np.random.default_rng(0)
    for n, batch_size in [(10, 2), (37, 4), (500, 8)]:
        lengths = rng.integers(1, 100, n)
        order = rng.permutation(n)
        monkeypatch.setattr(torch, "randperm", lambda *_args, **_kw: torch.tensor(order))  # noqa: B023
        expected = get_length_grouped_indices(lengths.tolist(), batch_size)
        assert length_grouped(order, lengths, batch_size).tolist() == expected


def test_length_grouped_steps_with_accumulation_follow_the_trainers_order(tmp_path, monkeypatch):
    """The Trainer groups mega-batches of batch_size x gradient_accumulation_steps examples."""
    from transformers.trainer_pt_utils import get_length_grouped_indices

    lengths = np.random.default_rng(2).integers(1, 100, 500)
    config = TrainingConfig(tmp_path, batch_size=8, grad_accum=4, group_by_length=True, seed=5)
    order = np.random.default_rng([5, 0]).permutation(500)
    monkeypatch.setattr(torch, "randperm", lambda *_args, **_kw: torch.tensor(order))
    expected = get_length_grouped_indices(lengths.tolist(), 8 * 4)
    steps = epoch_steps(500, config, 0, lengths)
    assert np.concatenate([b for step in steps for b in step]).tolist() == expected


def test_length_grouped_batches_hold_similar_lengths(tmp_path):
    lengths = np.random.default_rng(1).integers(1, 200, 400)
    config = TrainingConfig(tmp_path, batch_size=8, group_by_length=True)
    steps = epoch_steps(len(lengths), config, 0, lengths)
    batches = [b for step in steps for b in step]
    assert sorted(np.concatenate(batches).tolist()) == list(range(400))
    assert lengths[batches[0][0]] == lengths.max()
    spread = np.mean([np.ptp(lengths[b]) for b in batches])
    shuffled = np.mean([np.ptp(lengths[b]) for step in epoch_steps(400, TrainingConfig(tmp_path, 8), 0) for b in step])
    assert spread < shuffled / 4


def test_bfloat16_compute_trains_float32_weights(checkpoint, tmp_path):
    losses = {}
    for dtype in ("float32", "bfloat16"):
        model, tokenizer = mlx_encoders.load(checkpoint("bert", "sequence-classification"))
        examples = sequence_classification_data(
            [{"text": t, "label": v} for t, v in zip(TEXTS, LABELS, strict=True)], tokenizer
        )
        config = TrainingConfig(tmp_path / dtype, max_steps=3, batch_size=4, lr=1e-3, dtype=dtype)
        train(model, tokenizer, examples, config=config)
        records = [json.loads(line) for line in (tmp_path / dtype / "metrics.jsonl").read_text().splitlines()]
        losses[dtype] = np.array([r["loss"] for r in records])
        assert {v.dtype for _, v in tree_flatten(model.parameters())} == {mx.float32}
    np.testing.assert_allclose(losses["bfloat16"], losses["float32"], rtol=3e-2)
    assert not np.array_equal(losses["bfloat16"], losses["float32"])  # the passes did run in bfloat16


@pytest.mark.parametrize("whole_word", [False, True])
def test_every_masked_lm_batch_has_a_masked_token(checkpoint, whole_word):
    model, tokenizer = mlx_encoders.load(checkpoint("bert", "masked-lm"))
    examples = masked_lm_data([{"text": w} for w in ("cat", "dog", "sun", "sea")], tokenizer)
    masker = Masker.from_tokenizer(tokenizer, probability=0.01, whole_word=whole_word)
    rng = np.random.default_rng(0)
    for _ in range(20):
        batch = collate(examples, [0, 1], tokenizer, masker, rng)
        selected = batch["labels"] != -100
        assert selected.sum() >= 1
        assert not (selected & (batch["attention_mask"] == 0)).any() and not selected[:, 0].any()  # pads, [CLS]


def test_causal_lm_loss_and_gradients_equal_transformers_on_padded_batches(checkpoint):
    folder = checkpoint("gpt2", "causal-lm")
    model, tokenizer = mlx_encoders.load(folder)
    examples = causal_lm_data(
        [{"text": t} for t in ("def f(x): return x", "a b", "Return the sum of a and b.")], tokenizer
    )
    batch = collate(examples, range(3), tokenizer)
    assert (batch["labels"][batch["attention_mask"] == 0] == -100).all()
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    expected = reference(**{k: torch.tensor(v).long() for k, v in batch.items()}).loss
    expected.backward()
    inputs, labels = split_batch(batch)
    loss, grads = nn.value_and_grad(model, lambda: task_loss(model, model(**inputs), **labels))()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    got = dict(tree_flatten(grads))["transformer.h.0.mlp.c_fc.weight"]
    want = reference.transformer.h[0].mlp.c_fc.weight.grad.T.numpy()  # Conv1D stores (in, out)
    np.testing.assert_allclose(np.array(got), want, atol=1e-5 * np.abs(want).max())


def test_clm_fine_tune_saves_a_model_transformers_generates_with(checkpoint, tmp_path):
    data = write_jsonl(tmp_path / "code.jsonl", [{"text": t} for t in TEXTS])
    trained = fine_tune(
        "clm", data, tmp_path / "run", model=checkpoint("gpt2", "causal-lm"), eval_data=data, max_steps=3, lr=1e-3
    )
    assert {"eval_loss", "eval_accuracy", "eval_perplexity"} <= set(trained.metrics)
    reference = transformers.AutoModelForCausalLM.from_pretrained(trained.path).eval()
    ids = trained.tokenizer(["a fine"], return_tensors="np")["input_ids"]
    with torch.no_grad():
        expected = reference(torch.tensor(ids).long()).logits.numpy()
    np.testing.assert_allclose(np.array(trained.model(mx.array(ids)).logits), expected, rtol=1e-4, atol=1e-4)


def test_qlora_on_a_quantized_encoder_with_per_module_settings(checkpoint, tmp_path):
    """convert keeps position tables at 8 bits under 4-bit; a new head (another key prefix) must still find them."""
    from mlx_encoders.quantization import quantize_model

    model, tokenizer = mlx_encoders.load(checkpoint("bert", hidden_size=64, intermediate_size=128))
    quantize_model(model, bits=4, group_size=32)
    folder = mlx_encoders.save(model, tmp_path / "q4", tokenizer)
    overrides = {
        k
        for k, v in json.loads((folder / "config.json").read_text())["quantization"].items()
        if v is not False and isinstance(v, dict)
    }
    assert overrides, "the recipe keeps some module at other settings"
    trained = fine_tune(
        "classify", classification_file(tmp_path), tmp_path / "run", model=folder, lora_rank=4, max_steps=2
    )
    assert {m.bits for _, m in trained.model.named_modules() if hasattr(m, "bits")} == {4, 8}


def test_gradient_checkpointing_with_qlora_changes_memory_not_results(checkpoint, tmp_path):
    """QLoRA's memory option: each layer's activations recomputed in the backward pass, through the quantized
    CPU path's own vjp; the trained adapters equal those of a run without it, dropout on (a checkpointed layer
    draws the masks an unchecked one draws, in the forward pass and again in its recomputation)."""
    from mlx_encoders.quantization import quantize_model

    model, tokenizer = mlx_encoders.load(checkpoint("bert", hidden_size=64, intermediate_size=128))
    assert model.args.hidden_dropout_prob > 0
    quantize_model(model, bits=8, group_size=32)
    folder = mlx_encoders.save(model, tmp_path / "q8", tokenizer)
    data = classification_file(tmp_path)
    runs = [
        fine_tune(
            "classify",
            data,
            tmp_path / f"run{on}",
            model=folder,
            lora_rank=4,
            max_steps=3,
            lr=1e-2,
            gradient_checkpointing=on,
        )  # fmt: skip
        for on in (False, True)
    ]
    expected = dict(tree_flatten(runs[0].model.trainable_parameters()))
    found = dict(tree_flatten(runs[1].model.trainable_parameters()))
    assert expected.keys() == found.keys() and expected
    for name, value in found.items():
        np.testing.assert_allclose(np.array(value), np.array(expected[name]), atol=1e-6, err_msg=name)


def test_options_out_of_range_stop_the_call_before_any_work(checkpoint, tmp_path, capsys):
    data, eval_data = classification_file(tmp_path), classification_file(tmp_path, "eval.jsonl")
    model, out = checkpoint("bert"), tmp_path / "run"
    with pytest.raises(OptionError, match="lr must be a finite number"):
        fine_tune("classify", data, out, model=model, lr=float("nan"))
    with pytest.raises(OptionError, match="lora_rank must be an integer >= 1 or None, got 0"):
        fine_tune("classify", data, out, model=model, lora_rank=0)
    with pytest.raises(OptionError, match="max_length must be an integer >= 1 or None, got 0"):
        fine_tune("classify", data, out, model=model, max_length=0)
    # BERT's [CLS] and [SEP] take 2 tokens: a window of 2 holds no text
    with pytest.raises(OptionError, match=r"max_length must be at least 3 for sequence-classification"):
        fine_tune("classify", data, out, model=model, max_length=2)
    # past the 128-position table: it would fail at the first batch holding a text that long
    with pytest.raises(OptionError, match=r"max_length 129 is longer than the model's 128 positions .* max_length=128"):
        fine_tune("classify", data, out, model=model, max_length=129)
    with pytest.raises(OptionError, match=r"output_dir .*train.jsonl is a file, not a folder"):
        fine_tune("classify", data, data, model=model)
    with pytest.raises(OptionError, match="metric_for_best='eval_perplexity' is not a metric sequence-classification "
                       "reports; choose one of eval_loss, eval_accuracy, eval_f1"):  # fmt: skip
        fine_tune("classify", data, out, model=model, eval_data=eval_data, metric_for_best="eval_perplexity")
    with pytest.raises(OptionError, match="metric_for_best='eval_loss' needs evaluation data"):
        fine_tune("classify", data, out, model=model, metric_for_best="eval_loss")
    assert not out.exists()
    status = main(["train", "classify", "-m", str(model), "--data", str(data), "-o", str(out), "--warmup-ratio", "2"])
    assert status == 2
    error = capsys.readouterr().err
    assert "mlx-encoders train: error: warmup_ratio must be a finite number in [0, 1], got 2.0" in error
    status = main(["train", "classify", "-m", str(model), "--data", str(data), "-o", str(out), "--lr", "inf"])
    assert status == 2 and not out.exists()


def test_metric_for_best_names_a_reported_metric(checkpoint, tmp_path):
    data = classification_file(tmp_path)
    options = dict(model=checkpoint("bert"), eval_data=data, max_steps=2, save_every=1, keep_last=1, lr=1e-3)
    trained = fine_tune("classify", data, tmp_path / "run", metric_for_best="eval_f1", eval_every=1, **options)
    assert set(trained.metrics) - {"step", "epoch"} == {"eval_loss", "eval_accuracy", "eval_f1"}


def test_a_diverging_run_stops_at_the_step_and_keeps_the_last_good_checkpoint(checkpoint, tmp_path, monkeypatch):
    data, out = classification_file(tmp_path), tmp_path / "run"
    accumulate, calls = trainer.accumulate_gradients, []

    def nan_at_step_3(loss_and_grad, batches):
        loss, grads = accumulate(loss_and_grad, batches)
        calls.append(None)
        return (loss * mx.nan if len(calls) == 3 else loss), grads

    monkeypatch.setattr(trainer, "accumulate_gradients", nan_at_step_3)
    options = dict(model=checkpoint("bert"), max_steps=4, save_every=2, batch_size=4, lr=1e-3)
    with pytest.raises(trainer.Diverged, match=r"diverged at step 3: loss nan.*last good checkpoint is .*checkpoint-2"):
        fine_tune("classify", data, out, **options)
    assert not (out / "model").exists() and [p.name for p in trainer.checkpoints(out)] == ["checkpoint-2"]
    weights = mx.load(str(out / "checkpoint-2" / "model.safetensors"))
    assert all(np.isfinite(np.array(w)).all() for w in weights.values())
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_cli_stops_a_run_whose_huge_lr_overflows_the_weights(checkpoint, tmp_path, capsys):
    out = tmp_path / "run"
    status = main(["train", "classify", "-m", str(checkpoint("bert")), "--data", str(classification_file(tmp_path)),
                   "-o", str(out), "--max-steps", "3", "--batch-size", "4", "--lr", "1e30"])  # fmt: skip
    assert status == 1
    assert "mlx-encoders train: error: Training diverged at step" in capsys.readouterr().err
    assert not (out / "model").exists()


def test_an_output_holding_another_run_is_refused_unless_resumed_or_overwritten(checkpoint, tmp_path, capsys):
    data, out = classification_file(tmp_path), tmp_path / "run"
    options = dict(model=checkpoint("bert"), max_steps=2, batch_size=4, lr=1e-3)
    fine_tune("classify", data, out, **options)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"run already holds another run's files \(checkpoint-2, metrics.jsonl"):
        fine_tune("classify", data, out, **options)
    cli = ["train", "classify", "-m", str(checkpoint("bert")), "--data", str(data), "-o", str(out), "--max-steps", "1"]
    assert main(cli) == 1 and "--overwrite" in capsys.readouterr().err
    fine_tune("classify", data, out, resume=out / "checkpoint-2", **{**options, "max_steps": 3})  # its own checkpoint
    assert main([*cli, "--overwrite"]) == 0
    # the old run's checkpoints and log are gone, the user's file stays
    assert [p.name for p in trainer.checkpoints(out)] == ["checkpoint-1"] and (out / "notes.txt").read_text() == "mine"
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]


@pytest.mark.parametrize("name", ["overwrite", "final_checkpoint", "group_by_length", "label_all_tokens"])
def test_a_switch_takes_true_or_false_only(tmp_path, name):
    """A string "false" is truthy: taken as given, it would do what it does not say (overwrite: delete a run)."""
    with pytest.raises(OptionError, match=rf"^{name} must be True or False, got 'false'$"):
        fine_tune("classify", [{"text": "a", "label": "x"}], tmp_path / "out", model=MINILM, **{name: "false"})
    assert not (tmp_path / "out").exists()


def test_a_resume_under_other_settings_or_past_the_runs_end_is_refused(checkpoint, tmp_path):
    data, out = classification_file(tmp_path), tmp_path / "run"
    options = dict(model=checkpoint("bert"), max_steps=2, batch_size=4, lr=1e-3)
    fine_tune("classify", data, out, **options)
    with pytest.raises(ValueError, match=r"checkpoint-2/trainer_state.json was written by a run with other settings "
                                         r"\(batch_size 4 -> 5\)"):  # fmt: skip
        fine_tune("classify", data, out, resume=out / "checkpoint-2", **{**options, "batch_size": 5})
    with pytest.raises(ValueError, match=r"other settings \(max_length None -> 8\)"):  # the task's options too
        fine_tune("classify", data, out, resume=out / "checkpoint-2", **{**options, "max_length": 8})
    with pytest.raises(ValueError, match=r"other settings \(max_grad_norm 1.0 -> 0.01\)"):
        fine_tune("classify", data, out, resume=out / "checkpoint-2", **{**options, "max_grad_norm": 0.01})
    fine_tune("classify", data, out, resume=out / "checkpoint-2", save_every=1, **{**options, "max_steps": 3})
    kept, log = [c.name for c in trainer.checkpoints(out)], (out / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match=r"checkpoint-2 is at step 2, past this run's 1 steps"):
        fine_tune("classify", data, out, resume=out / "checkpoint-2", save_every=1, **{**options, "max_steps": 1})
    assert [c.name for c in trainer.checkpoints(out)] == kept and (out / "metrics.jsonl").read_text() == log


def test_options_given_as_numpy_numbers_are_recorded_as_json(checkpoint, tmp_path):
    data = classification_file(tmp_path)
    options = dict(max_steps=1, batch_size=np.int64(4), lr=np.float32(1e-3), seed=np.int64(3), group_by_length=np.True_)
    fine_tune("classify", data, tmp_path / "run", model=checkpoint("bert"), **options)
    state = json.loads((tmp_path / "run" / "checkpoint-1" / "trainer_state.json").read_text())
    assert state["run"]["batch_size"] == 4 and state["run"]["group_by_length"] is True


def test_eval_data_is_read_as_the_training_datas_kind_and_its_errors_say_so(checkpoint, tmp_path):
    """Regression targets in training; evaluation targets that look like label ids (all 0, or 0 and 1) stay
    regression targets: the metrics are a regression's, not accuracy over one label."""
    rows = [{"text": t, "label": i / 10} for i, t in enumerate(TEXTS)]
    evaluation = [{"text": t, "label": i % 2} for i, t in enumerate(TEXTS[:4])]
    trained = fine_tune(
        "classify", rows, tmp_path / "out", model=MINILM, max_steps=1, batch_size=4, eval_data=evaluation
    )
    assert "eval_loss" in trained.metrics and "eval_accuracy" not in trained.metrics
    labelled = [{"text": t, "label": label} for t, label in zip(TEXTS, LABELS, strict=True)]
    bad = labelled[:3] + [{"text": "x", "label": "unknown"}]
    with pytest.raises(ValueError, match=r"^eval_data: item 4 of the data: unknown label 'unknown'"):
        fine_tune("classify", labelled, tmp_path / "bad", model=MINILM, max_steps=1, eval_data=bad)


def test_only_an_evaluated_checkpoint_can_be_the_best(checkpoint, tmp_path):
    """A checkpoint saved between evaluations carries the last evaluation's metrics, not its own: it never ranks."""
    data, out = classification_file(tmp_path), tmp_path / "run"
    fine_tune(
        "classify", data, out, model=checkpoint("bert"), max_steps=5, batch_size=2, lr=1e-3, eval_data=data,
        eval_every=3, save_every=2, keep_last=1, metric_for_best="eval_loss", final_checkpoint=False,
    )  # fmt: skip
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["metrics"]["step"] == 3 and state["best_checkpoint"] is None


def test_a_second_run_into_a_folder_a_run_is_writing_is_refused(checkpoint, tmp_path, monkeypatch):
    """The output's lock, held for the whole run: a run started while another writes the folder (before that one
    has written any file the check for another run's files would see) stops at once."""
    from mlx_encoders.checkpoint.lock import FolderBusy, FolderLock
    from mlx_encoders.train.tasks import heads as trainer_tasks

    data, out = classification_file(tmp_path), tmp_path / "run"
    out.mkdir()
    with FolderLock(out, trainer.RUN_LOCK, "a run", "", "run", "test"):  # another run, just started
        with pytest.raises(FolderBusy, match=rf"^Another run is writing the training output {out}: pid \d+ .*"
                                             r"Two runs into one folder would mix their checkpoints"):  # fmt: skip
            fine_tune("classify", data, out, model=checkpoint("bert"), max_steps=1, batch_size=4)
    assert sorted(p.name for p in out.iterdir()) == []  # nothing written, and the lock file gone with its holder

    real_save, held = trainer_tasks.save, []

    def save(*args, **kwargs):  # the final model's save: the run still holds the folder
        with pytest.raises(FolderBusy):
            FolderLock(out, trainer.RUN_LOCK, "a run", "", "run", "test").__enter__()
        held.append(True)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(trainer_tasks, "save", save)
    fine_tune("classify", data, out, model=checkpoint("bert"), max_steps=1, batch_size=4)
    assert held == [True] and not (out / trainer.RUN_LOCK).exists() and (out / "model").is_dir()
    with pytest.raises(ValueError):  # refused before its first file: no folder left
        fine_tune("classify", tmp_path / "absent.jsonl", tmp_path / "new", model=checkpoint("bert"), max_steps=1)
    assert not (tmp_path / "new").exists()


def test_keep_last_holds_after_a_resume_from_the_newest_checkpoint(checkpoint, tmp_path):
    """A run stopped after saving its newest checkpoint but before removing its oldest, resumed from the newest:
    the resumed run keeps `keep_last` from its start, though it saves nothing more."""
    data, out = classification_file(tmp_path), tmp_path / "run"
    options = dict(model=checkpoint("bert"), batch_size=2, lr=1e-3, schedule="constant", save_every=1)
    fine_tune("classify", data, out, max_steps=3, keep_last=None, **options)  # three checkpoints, as if stopped
    fine_tune("classify", data, out, max_steps=3, keep_last=2, resume=out / "checkpoint-3", **options)
    assert [p.name for p in trainer.checkpoints(out)] == ["checkpoint-2", "checkpoint-3"]


def test_rotation_keeps_the_checkpoint_just_saved_when_resuming_before_later_ones(checkpoint, tmp_path):
    data, out = classification_file(tmp_path), tmp_path / "run"
    options = dict(model=checkpoint("bert"), batch_size=2, lr=1e-3, schedule="constant")
    fine_tune("classify", data, out, max_steps=4, save_every=2, keep_last=None, **options)
    fine_tune("classify", data, out, max_steps=3, save_every=1, keep_last=1, resume=out / "checkpoint-2", **options)
    # checkpoint-4 was the stopped run's later state: the resumed run's checkpoint-3 is the newest and stays
    assert [p.name for p in trainer.checkpoints(out)] == ["checkpoint-3"]


def test_no_final_checkpoint_leaves_the_model_and_the_earlier_checkpoints(checkpoint, tmp_path, capsys):
    data, out = classification_file(tmp_path), tmp_path / "run"
    args = ["train", "classify", "-m", str(checkpoint("bert")), "--data", str(data), "--batch-size", "4",
            "--max-steps", "3", "--no-final-checkpoint"]  # fmt: skip
    assert main([*args, "-o", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["curves.png", "metrics.jsonl", "model"]
    assert main([*args, "-o", str(tmp_path / "saved"), "--save-every", "2"]) == 0
    assert [p.name for p in trainer.checkpoints(tmp_path / "saved")] == ["checkpoint-2"]
    np.testing.assert_array_equal(weights_of(out / "model"), weights_of(tmp_path / "saved" / "model"))


def weights_of(folder) -> np.ndarray:
    return np.concatenate([np.array(v).ravel() for _, v in sorted(mx.load(str(folder / "model.safetensors")).items())])


def test_resume_refuses_a_checkpoint_of_another_size_or_other_labels(checkpoint, tmp_path):
    data = classification_file(tmp_path)  # 3 labels
    options = dict(max_steps=1, batch_size=4, lr=1e-3)
    fine_tune("classify", data, tmp_path / "wide", model=checkpoint("bert", hidden_size=48, intermediate_size=64),
              **options)  # fmt: skip
    with pytest.raises(ValueError, match=r"wide/checkpoint-1/model.safetensors: .* has shape \(\d+, 48\), but this "
                       r"run's model has \(\d+, 32\)"):  # fmt: skip
        fine_tune("classify", data, tmp_path / "a", model=checkpoint("bert"), resume=tmp_path / "wide/checkpoint-1",
                  **options)  # fmt: skip
    fine_tune("classify", data, tmp_path / "three", model=checkpoint("bert"), **options)
    two = classification_file(tmp_path, "two.jsonl", [{"text": t, "label": "pos" if t < "m" else "neg"} for t in TEXTS])
    with pytest.raises(ValueError, match=r"three/checkpoint-1/config.json: labels \[.*\] in the checkpoint, "
                       r"\['neg', 'pos'\] in this run"):  # fmt: skip
        fine_tune("classify", two, tmp_path / "b", model=checkpoint("bert"), resume=tmp_path / "three/checkpoint-1",
                  **options)  # fmt: skip
    # as many labels under other names: the head would be saved with them, each class mislabelled
    names = dict(zip(sorted(set(LABELS)), ("x", "y", "z"), strict=True))
    rows = [{"text": t, "label": names[label]} for t, label in zip(TEXTS, LABELS, strict=True)]
    renamed = classification_file(tmp_path, "renamed.jsonl", rows)
    with pytest.raises(ValueError, match=r"labels \[.*\] in the checkpoint, \['x', 'y', 'z'\] in this run"):
        fine_tune("classify", renamed, tmp_path / "d", model=checkpoint("bert"),
                  resume=tmp_path / "three/checkpoint-1", **options)  # fmt: skip
    lora = dict(model=checkpoint("bert", "masked-lm"), **options)
    fine_tune("classify", data, tmp_path / "rank4", lora_rank=4, **lora)
    with pytest.raises(ValueError, match=r"rank4/checkpoint-1/adapter_config.json: LoRA alpha is 8, but this run's is"):
        fine_tune("classify", data, tmp_path / "c", lora_rank=4, lora_alpha=4, resume=tmp_path / "rank4/checkpoint-1",
                  **lora)  # fmt: skip


def test_a_lock_whose_record_cannot_be_written_is_released(tmp_path, monkeypatch):
    """A full disk while the lock records its holder: the error names the lock file, and the lock is free again
    (it stayed held for the rest of the process, refusing every later run as busy)."""
    from mlx_encoders.checkpoint import lock

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(lock.os, "pwrite", full)
    with pytest.raises(OSError, match=f"could not write the lock file {tmp_path / 'run.lock'}: No space left"):
        lock.FolderLock(tmp_path, "run.lock", "a run", "", "run", "test").__enter__()
    assert not (tmp_path / "run.lock").exists()  # no run's file: the advice to pass overwrite would be wrong
    monkeypatch.undo()
    with lock.FolderLock(tmp_path, "run.lock", "a run", "", "run", "test", quiet=True):
        pass


def test_full_disks_are_recognised_by_every_library_s_error(tmp_path):
    from mlx_encoders.checkpoint.atomic import disk_full, write_failed

    assert disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"), tmp_path)
    assert disk_full(Exception("No space left on device (os error 28)"), tmp_path)  # the tokenizers library's
    assert not disk_full(RuntimeError("[write] Unable to write 480 bytes to file."), tmp_path)  # space left here
    assert write_failed(RuntimeError("[write] Unable to write 480 bytes to file.")) and write_failed(
        OSError(errno.EFBIG, "File too large")
    )  # a file size limit: no "free space" advice
    assert not disk_full(RuntimeError("[load] something else"), tmp_path)


def test_a_failed_plot_leaves_no_partial_file(tmp_path, monkeypatch):
    import matplotlib.figure

    from mlx_encoders.train import plot

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.5}\n')

    def full(self, path, **kwargs):
        Path(path).write_bytes(b"\x89PNG half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full)
    with pytest.raises(OSError, match=f"could not write {tmp_path / plot.CURVES_FILE}: No space left"):
        plot.plot_metrics(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_a_full_disk_before_any_checkpoint_says_to_run_again_with_overwrite(checkpoint, tmp_path, monkeypatch):
    """The run's log is written already: running again as the error said was refused for the run's files."""

    def full(model, tokenizer, optimizer, state, target, *args):
        raise OSError(errno.ENOSPC, f"disk full while writing {target}; nothing was written. Free space on that "
                      "disk (or write elsewhere) and run again")  # fmt: skip

    monkeypatch.setattr(trainer, "save_checkpoint", full)
    out, data = tmp_path / "run", classification_file(tmp_path)
    with pytest.raises(OSError, match=r"no checkpoint was saved: once space is freed, run again with overwrite=True"):
        fine_tune("classify", data, out, model=checkpoint("bert"), max_steps=2, batch_size=4, save_every=1)
    monkeypatch.undo()
    fine_tune("classify", data, out, model=checkpoint("bert"), max_steps=2, batch_size=4, overwrite=True)


def test_a_full_disk_while_the_tokenizer_is_written_is_one_line_naming_the_folder(checkpoint, tmp_path, monkeypatch):
    """The tokenizers library's bare Exception for a full disk: the folder's write says so (it named the hidden
    temporary folder's tokenizer.json, with no errno, and the run's advice was lost)."""
    import mlx_encoders

    model, tokenizer = mlx_encoders.load(checkpoint("bert"))

    class Full:
        def save(self, path, *args):
            raise Exception("No space left on device (os error 28)")  # noqa: TRY002  as the library raises it

    monkeypatch.setattr(tokenizer, "backend", Full())
    with pytest.raises(OSError, match=f"disk full while writing {tmp_path / 'saved'}; nothing was written") as error:
        mlx_encoders.save(model, tmp_path / "saved", tokenizer)
    assert error.value.errno == errno.ENOSPC and sorted(p.name for p in tmp_path.iterdir()) == []


NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def test_a_head_whose_labels_are_the_data_s_in_its_own_order_is_kept_as_run_glue_keeps_it(checkpoint, tmp_path):
    """A published head's label2id is rarely sorted (a sentiment head {positive: 0, negative: 1}, CoNLL's NER order):
    the data's names are read as the head's ids (transformers' run_glue.py / run_ner.py), and a head with more
    classes than the data uses is kept too."""
    order = {"positive": 0, "negative": 1}
    folder = checkpoint("bert", "sequence-classification", num_labels=2, label2id=order,
                        id2label={i: n for n, i in order.items()}, **NO_DROPOUT)  # fmt: skip
    rows = [{"text": "a great film", "label": "positive"}, {"text": "an awful film", "label": "negative"}]
    fine_tune("classify", rows, tmp_path / "cls", model=folder, epochs=1, batch_size=2, cores=1)
    first = json.loads((tmp_path / "cls" / "metrics.jsonl").read_text().splitlines()[0])
    reference = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():  # the loss before the first update, the labels by the head's own ids
        inputs = tokenizer([r["text"] for r in rows], padding=True, return_tensors="pt")
        expected = reference(**inputs, labels=torch.tensor([order[r["label"]] for r in rows])).loss.item()
    assert first["loss"] == pytest.approx(expected, rel=1e-5)
    saved = json.loads((tmp_path / "cls" / "model" / "config.json").read_text())
    assert saved["label2id"] == order

    conll = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
    ner = checkpoint("bert", "token-classification", num_labels=5, label2id={n: i for i, n in enumerate(conll)},
                     id2label=dict(enumerate(conll)))  # fmt: skip
    tagged = [{"tokens": ["Ada", "visited", "Paris"], "ner_tags": ["B-PER", "O", "B-LOC"]}]
    fine_tune("tokens", tagged * 2, tmp_path / "ner", model=ner, epochs=1, batch_size=2, cores=1)
    assert json.loads((tmp_path / "ner" / "model" / "config.json").read_text())["id2label"] == {
        str(i): n for i, n in enumerate(conll)
    }
    three = checkpoint("bert", "sequence-classification", num_labels=3)  # data of two of its three classes
    fine_tune("classify", [{"text": t, "label": i % 2} for i, t in enumerate(["a", "b", "c", "d"])], tmp_path / "ids",
              model=three, epochs=1, batch_size=2, cores=1)  # fmt: skip
    assert len(json.loads((tmp_path / "ids" / "model" / "config.json").read_text())["id2label"]) == 3
    nli = ["contradiction", "neutral", "entailment"]  # ids of two of a named head's three: another task's data
    named = checkpoint("bert", "sequence-classification", num_labels=3, label2id={n: i for i, n in enumerate(nli)},
                       id2label=dict(enumerate(nli)))  # fmt: skip
    with pytest.raises(ValueError, match="already has a sequence-classification head with the labels"):
        rows = [{"text": t, "label": i % 2} for i, t in enumerate("abcd")]
        fine_tune("classify", rows, tmp_path / "nli", model=named, epochs=1, batch_size=2, cores=1)

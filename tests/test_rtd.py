"""ELECTRA replaced-token-detection pretraining (`fine_tune("rtd", ...)`, train/rtd.py) against a torch reference of
the same objective: transformers' ElectraForMaskedLM generator and ElectraForPreTraining discriminator sharing one
embedding module, the generator's MLM loss + 50 x the discriminator's loss, on the same weights, masks and samples."""

import json
import subprocess
import sys
import warnings
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
import transformers
from checkpoints import MINILM
from mlx.utils import tree_flatten, tree_map

import mlx_encoders
from mlx_encoders.__main__ import main
from mlx_encoders.models.electra import ElectraForMaskedLM, ElectraForPreTraining, ModelArgs
from mlx_encoders.tokenizer import Tokenizer
from mlx_encoders.train import fine_tune
from mlx_encoders.train.rtd import ReplacedTokenDetection, generator_args
from mlx_encoders.train.trainer import OptionError

ROOT = Path(__file__).parent.parent
SIZES = dict(
    embedding_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
    max_position_embeddings=64, type_vocab_size=2, layer_norm_eps=1e-7, hidden_act="gelu_new",
)  # fmt: skip
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
TEXTS = [
    "The cat sat on the mat and looked at the bird.", "Stocks fell in the morning, bonds rose after lunch.",
    "The river runs to the sea.", "Boats sail on the river.", "It rains.", "A tiny encoder learns to spot fakes.",
    "Every token of the input gets a label.", "The generator fills the masks with plausible words.",
]  # fmt: skip


def torch_pair(vocab: int, seed: int = 0, share: bool = True):
    """transformers' discriminator and generator (1/4 as wide, heads as wide), the generator's embeddings (and
    its tied output layer) the discriminator's, as ELECTRA shares them (unless not `share`)."""
    torch.manual_seed(seed)
    config = transformers.ElectraConfig(vocab_size=vocab, **SIZES, **NO_DROPOUT)
    discriminator = transformers.ElectraForPreTraining(config)
    small = dict(hidden_size=8, num_attention_heads=1, intermediate_size=32)  # generator_args' sizes at 1/4
    generator = transformers.ElectraForMaskedLM(transformers.ElectraConfig(**{**config.to_dict(), **small}))
    if share:
        generator.electra.embeddings = discriminator.electra.embeddings
        generator.generator_lm_head.weight = discriminator.electra.embeddings.word_embeddings.weight
    return discriminator.eval(), generator.eval()


def test_generator_sizes_follow_electra():
    # google/electra-base-generator (1/3 of base) and google/electra-small-generator's published configs
    base = generator_args(ModelArgs.preset("base"), 1 / 3)
    assert (base.hidden_size, base.num_attention_heads, base.intermediate_size, base.embedding_size) == (
        256, 4, 1024, 768)  # fmt: skip
    small = generator_args(ModelArgs.preset("small"), 1.0)
    assert (small.hidden_size, small.num_attention_heads, small.intermediate_size) == (256, 4, 1024)
    tiny = generator_args(ModelArgs.from_dict({**SIZES, **NO_DROPOUT}), 0.25)
    assert (tiny.hidden_size, tiny.num_attention_heads, tiny.intermediate_size) == (8, 1, 32)
    # widths that are not a whole number of the discriminator's heads: ELECTRA rounds the width, not the heads
    eighth = generator_args(ModelArgs.preset("base"), 1 / 8)
    assert (eighth.hidden_size, eighth.num_attention_heads, eighth.intermediate_size) == (96, 1, 384)
    odd = generator_args(ModelArgs.from_dict({**SIZES, "hidden_size": 800, "num_attention_heads": 8}), 0.25)
    assert (odd.hidden_size, odd.num_attention_heads, odd.intermediate_size) == (200, 2, 800)
    with pytest.raises(ValueError, match="generator_size must be a fraction in \\(0, 1\\]"):
        generator_args(tiny, 1.5)


@pytest.mark.parametrize("share", [True, False], ids=["shared-embeddings", "own-embeddings"])
def test_one_step_equals_the_torch_reference(tmp_path, share):
    vocab, B, L = 50, 3, 12
    discriminator, generator = torch_pair(vocab, share=share)
    discriminator.save_pretrained(tmp_path / "d")
    generator.save_pretrained(tmp_path / "g")
    pair = ReplacedTokenDetection(
        mlx_encoders.load_model(tmp_path / "d", task="pretraining"),
        mlx_encoders.load_model(tmp_path / "g", task="masked-lm"),
        share_embeddings=share,
    )
    rng = np.random.default_rng(0)
    original = rng.integers(5, vocab, (B, L))
    attention = np.ones((B, L), dtype=np.int64)
    attention[1, 8:], attention[2, 5:] = 0, 0  # padding: no loss there
    types = (np.arange(L) >= 6).astype(np.int64)[None].repeat(B, 0)
    selected = (rng.random((B, L)) < 0.3) & (attention == 1)
    masked_ids = np.where(selected & (rng.random((B, L)) < 0.85), 4, original)  # [MASK] = 4
    sampled = rng.integers(5, vocab, int(selected.sum()))
    sampled[::3] = original[selected][::3]  # a sample equal to the original is not "replaced"
    corrupted = original.copy()
    corrupted[selected] = sampled
    replaced = (corrupted != original).astype(np.int64)
    assert replaced.sum() < selected.sum()

    T = {k: torch.from_numpy(v) for k, v in dict(ids=masked_ids, att=attention, types=types).items()}
    generated = generator(T["ids"], T["att"], T["types"], labels=torch.from_numpy(np.where(selected, original, -100)))
    judged = discriminator(torch.from_numpy(corrupted), T["att"], T["types"], labels=torch.from_numpy(replaced))
    (generated.loss + 50 * judged.loss).backward()
    expected = {f"discriminator.{n}": p.grad.numpy() for n, p in discriminator.named_parameters()}
    kept = [(n, p) for n, p in generator.named_parameters() if ".embeddings." not in n or not share]
    expected |= {f"generator.{n}": p.grad.numpy() for n, p in kept}

    inputs = {
        "input_ids": mx.array(masked_ids),
        "attention_mask": mx.array(attention),
        "token_type_ids": mx.array(types),
    }
    labels = {
        "original": mx.array(original),
        "masked": mx.array(np.flatnonzero(selected)),
        "sampled": mx.array(sampled),
    }
    terms = pair.losses(inputs, labels)
    assert terms["generator_loss"].item() == pytest.approx(generated.loss.item(), abs=1e-5)
    assert terms["discriminator_loss"].item() == pytest.approx(judged.loss.item(), abs=1e-5)
    np.testing.assert_array_equal(np.array(terms["replaced"]), replaced)
    loss, grads = nn.value_and_grad(pair, lambda: pair.batch_loss(inputs, labels))()
    assert loss.item() == pytest.approx((generated.loss + 50 * judged.loss).item(), abs=1e-5)
    grads = {k: np.array(v) for k, v in tree_flatten(grads)}
    assert grads.keys() == expected.keys()  # shared: one embedding module, under the discriminator
    for name, want in expected.items():
        assert np.abs(grads[name] - want).max() <= 1e-5 * max(1.0, np.abs(want).max()), name
    if not share:
        assert "generator.electra.embeddings.word_embeddings.weight" in grads
        return
    # the shared table's gradient holds both parts' shares: the discriminator's alone differs
    alone = transformers.ElectraForPreTraining.from_pretrained(tmp_path / "d").eval()
    (50 * alone(torch.from_numpy(corrupted), T["att"], T["types"], labels=torch.from_numpy(replaced)).loss).backward()
    own = alone.electra.embeddings.word_embeddings.weight.grad.numpy()
    assert np.abs(grads["discriminator.electra.embeddings.word_embeddings.weight"] - own).max() > 1e-3


def write_texts(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_cli_pretrains_a_pair_transformers_loads_and_resumes_exactly(tmp_path, capsys):
    data, held_out = write_texts(tmp_path / "train.jsonl", TEXTS), write_texts(tmp_path / "eval.jsonl", TEXTS[:3])
    (tmp_path / "sizes.json").write_text(json.dumps(SIZES))
    argv = ["train", "rtd", "--config", str(tmp_path / "sizes.json"), "--tokenizer", str(MINILM), "--data", str(data),
            "--eval-data", str(held_out), "--max-steps", "3", "--batch-size", "4", "--lr", "1e-3", "--max-length",
            "24", "--save-every", "1", "--keep-last", "3", "--json"]  # fmt: skip
    assert main([*argv, "--output", str(tmp_path / "run")]) == 0
    printed = json.loads(capsys.readouterr().out)
    run = tmp_path / "run"
    assert printed["model"] == str(run / "model" / "discriminator")
    metrics = printed["metrics"]
    for name in ("eval_generator_accuracy", "eval_discriminator_accuracy", "eval_precision", "eval_recall"):
        assert 0 <= metrics[name] <= 1
    assert 0 < metrics["eval_replacement_rate"] < 0.2  # at most the 15% masked, less the right samples
    assert metrics["eval_loss"] == pytest.approx(
        metrics["eval_generator_loss"] + 50 * metrics["eval_discriminator_loss"], rel=1e-5
    )

    batch = mlx_encoders.load(run / "model" / "discriminator")[1](TEXTS[:2], padding=True, return_tensors="np")
    as_torch = {k: torch.tensor(v) for k, v in batch.items()}
    for folder, cls, task in (
        ("discriminator", transformers.ElectraForPreTraining, "pretraining"),
        ("generator", transformers.ElectraForMaskedLM, "masked-lm"),
    ):
        reference = cls.from_pretrained(run / "model" / folder).eval()
        ours = mlx_encoders.load_model(run / "model" / folder, task=task)
        with torch.no_grad():
            expected = reference(**as_torch).logits.numpy()
        np.testing.assert_allclose(np.array(ours(**{k: mx.array(v) for k, v in batch.items()}).logits), expected,
                                   rtol=1e-4, atol=1e-4)  # fmt: skip
    tables = [np.array(mlx_encoders.load_model(run / "model" / f).electra.embeddings.word_embeddings.weight)
              for f in ("discriminator", "generator")]  # fmt: skip
    np.testing.assert_array_equal(*tables)  # one shared table
    assert (
        tables[1].shape[1] == 16 and json.loads((run / "model/generator/config.json").read_text())["hidden_size"] == 8
    )

    # resumed from step 1, the run takes the same steps: the same masks, samples and weights
    assert main([*argv, "--output", str(tmp_path / "resumed"), "--max-steps", "1"]) == 0
    capsys.readouterr()
    for part in ("discriminator", "generator"):  # a checkpoint's parts load as the final ones, tokenizer and all
        assert mlx_encoders.load(tmp_path / "resumed" / "checkpoint-1" / part)[1](TEXTS[:2])["input_ids"] is not None
    assert main([*argv, "--output", str(tmp_path / "resumed"), "--resume", str(tmp_path / "resumed/checkpoint-1")]) == 0
    for part in ("discriminator", "generator"):
        a, b = (
            dict(tree_flatten(mlx_encoders.load_model(r / "model" / part).parameters()))
            for r in (run, tmp_path / "resumed")
        )
        for key in a:
            np.testing.assert_array_equal(np.array(a[key]), np.array(b[key]), err_msg=f"{part} {key}")


def test_the_discriminator_fine_tunes_and_lora_is_refused(tmp_path):
    data = write_texts(tmp_path / "train.jsonl", TEXTS)
    trained = fine_tune("rtd", data, tmp_path / "run", config={**SIZES}, tokenizer=MINILM, max_steps=1, batch_size=4,
                        max_length=24)  # fmt: skip
    assert isinstance(trained.model, ElectraForPreTraining)
    rows = [{"text": t, "label": i % 2} for i, t in enumerate(TEXTS)]
    labelled = tmp_path / "labelled.jsonl"
    labelled.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.warns(UserWarning, match="ElectraForSequenceClassification were not in the checkpoint"):
        classifier = fine_tune("classify", labelled, tmp_path / "cls", model=trained.path, max_steps=1, batch_size=4)
    config = json.loads((classifier.path / "config.json").read_text())
    assert config["architectures"] == ["ElectraForSequenceClassification"]
    tagged = tmp_path / "tags.jsonl"
    tagged.write_text(json.dumps({"tokens": ["Anna", "is", "in", "Rome"], "ner_tags": ["B-PER", "O", "O", "B-LOC"]}))
    with pytest.warns(UserWarning, match="ElectraForTokenClassification were not in the checkpoint"):
        tagger = fine_tune("tokens", tagged, tmp_path / "tags", model=trained.path, max_steps=1)
    assert tagger.model.args.id2label == {0: "B-LOC", 1: "B-PER", 2: "O"}
    # from both checkpoints: the discriminator's embeddings are the pair's
    again = fine_tune("rtd", data, tmp_path / "again", model=trained.path, generator=trained.path.parent / "generator",
                      max_steps=1, batch_size=4, max_length=24)  # fmt: skip
    assert again.path == tmp_path / "again/model/discriminator"
    with pytest.raises(ValueError, match="rtd trains every weight .* drop lora_rank"):
        fine_tune("rtd", data, tmp_path / "lora", config=SIZES, tokenizer=MINILM, lora_rank=2)
    with pytest.raises(ValueError, match="rtd trains ELECTRA models; config= has model_type 'bert'"):
        fine_tune("rtd", data, tmp_path / "bert", config={**SIZES, "model_type": "bert"}, tokenizer=MINILM)
    with pytest.raises(OptionError, match="generator_size must be a finite number in \\(0, 1\\]"):
        fine_tune("rtd", data, tmp_path / "size", config=SIZES, tokenizer=MINILM, generator_size=0)
    with pytest.raises(OptionError, match="'eval_perplexity' is not a metric .* eval_generator_accuracy"):
        fine_tune("rtd", data, tmp_path / "best", config=SIZES, tokenizer=MINILM, eval_data=data,
                  metric_for_best="eval_perplexity")  # fmt: skip
    with pytest.raises(ValueError, match=r"generator \(--generator\) is for replaced-token-detection; masked-lm would"):
        fine_tune("mlm", data, tmp_path / "mlm", config=SIZES, tokenizer=MINILM, generator=trained.path)


def test_a_failed_save_leaves_the_previous_pair_whole(tmp_path, monkeypatch):
    args = ModelArgs.from_dict({**SIZES, **NO_DROPOUT})
    pair = ReplacedTokenDetection(ElectraForPreTraining(args), ElectraForMaskedLM(generator_args(args, 0.25)))
    tokenizer = Tokenizer.from_pretrained(MINILM)
    folder = tmp_path / "model"
    pair.save(folder, tokenizer)
    files = lambda: {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}  # noqa: E731
    before = files()
    pair.update(tree_map(lambda p: p + 1 if mx.issubdtype(p.dtype, mx.floating) else p, pair.parameters()))
    write = Tokenizer.save

    def failing(self, target):  # the generator's files fail, after the discriminator's were written
        if "generator" in Path(target).name:
            raise OSError("the disk went away")
        write(self, target)

    monkeypatch.setattr(Tokenizer, "save", failing)
    with pytest.raises(OSError, match="the disk went away"):
        pair.save(folder, tokenizer, overwrite=True)
    assert files() == before  # not a new discriminator beside the old generator
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # and nothing half-written beside it
    monkeypatch.setattr(Tokenizer, "save", write)
    assert pair.save(folder, tokenizer, overwrite=True) == folder / "discriminator"
    saved = dict(tree_flatten(mlx_encoders.load_model(folder / "discriminator", task="pretraining").parameters()))
    for name, value in tree_flatten(pair.discriminator.parameters()):
        np.testing.assert_array_equal(np.array(saved[name]), np.array(value), err_msg=name)


def test_a_generator_that_cannot_share_the_embeddings_is_refused():
    args = ModelArgs.from_dict(SIZES)
    other = ModelArgs.from_dict({**SIZES, "embedding_size": 8})
    with pytest.raises(ValueError, match="cannot share the discriminator's embeddings: embedding_size 8 vs 16"):
        ReplacedTokenDetection(ElectraForPreTraining(args), ElectraForMaskedLM(other))
    with pytest.raises(ValueError, match="an ElectraForPreTraining discriminator with an ElectraForMaskedLM"):
        ReplacedTokenDetection(ElectraForMaskedLM(args), ElectraForMaskedLM(args))


def test_example_runs_at_a_tiny_size(tmp_path):
    command = [sys.executable, str(ROOT / "examples" / "train_rtd.py"), "--texts", "60", "--max-steps", "2",
               "--tiny", "--output", str(tmp_path / "run")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "discriminator accuracy" in done.stdout and (tmp_path / "run/model/generator/config.json").is_file()


def test_a_new_discriminator_starts_at_the_base_rate_and_a_loaded_one_keeps_its_bias(tmp_path):
    """From config, the discriminator's output bias is the log-odds of the masked share (15%): learning that base
    rate through the hidden states makes a short run's top-layer tokens alike. A checkpoint's own bias is kept."""
    from safetensors.numpy import load_file, save_file

    data = write_texts(tmp_path / "train.jsonl", TEXTS)
    run = dict(max_steps=1, batch_size=4, max_length=24, lr=1e-12, warmup_steps=0)
    trained = fine_tune("rtd", data, tmp_path / "run", config=SIZES, tokenizer=MINILM, **run)
    key = "discriminator_predictions.dense_prediction.bias"
    weights = load_file(trained.path / "model.safetensors")
    assert weights[key].item() == pytest.approx(np.log(0.15 / 0.85), abs=1e-6)
    weights[key] = np.full_like(weights[key], 0.25)
    save_file(weights, trained.path / "model.safetensors")
    again = fine_tune("rtd", data, tmp_path / "again", model=trained.path, **run)
    assert load_file(again.path / "model.safetensors")[key].item() == pytest.approx(0.25, abs=1e-6)


def test_a_discriminator_that_flags_nothing_at_the_end_is_warned_about(tmp_path):
    """A run whose last evaluation flags no replaced token (here: one step at lr 1e-12, the bias at the base rate)
    finishes, with a warning that names the cause and the remedy; a run without an eval set says nothing."""
    data = write_texts(tmp_path / "train.jsonl", TEXTS)
    run = dict(max_steps=1, batch_size=4, max_length=24, lr=1e-12, warmup_steps=0)
    with pytest.warns(
        UserWarning, match=r"flags none of the eval set's replaced tokens \(recall 0.*train longer$"
    ) as w:
        trained = fine_tune("rtd", data, tmp_path / "run", config=SIZES, tokenizer=MINILM, eval_data=data, **run)
    assert w[0].filename == __file__  # the caller's line
    assert trained.metrics["eval_recall"] == 0.0 and trained.metrics["eval_replacement_rate"] > 0
    from mlx_encoders.train.tasks.rtd import warn_if_nothing_flagged

    with pytest.warns(UserWarning, match=r"train longer, or with a lower learning rate than lr=0.01 \(ELECTRA-Sm"):
        warn_if_nothing_flagged(trained.metrics, 1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        fine_tune("rtd", data, tmp_path / "quiet", config=SIZES, tokenizer=MINILM, **run)


def test_the_generators_eval_loss_is_its_mean_over_masked_tokens():
    """As the masked-LM's eval_loss: each batch's mean weighted by its masked tokens (by its real tokens, it was
    7% off on rows of unlike lengths), the discriminator's by its real tokens, eval_loss their weighted sum."""
    from mlx_encoders.engine.ops import drawing_from
    from mlx_encoders.train.data import collate, masked_lm_data
    from mlx_encoders.train.rtd import rtd_masker

    mx.random.seed(0)
    tokenizer = Tokenizer.from_pretrained(MINILM)
    pair = ReplacedTokenDetection(ElectraForPreTraining(ModelArgs.from_dict({**SIZES, "vocab_size": 30522})),
                                  ElectraForMaskedLM(generator_args(ModelArgs.from_dict({**SIZES, "vocab_size": 30522}),
                                                                    0.5)))  # fmt: skip
    bias = np.zeros(30522, np.float32)
    bias[tokenizer.token_id("the")] = 8.0  # a loss that depends on the token, so that the weighting shows
    pair.generator.generator_lm_head.bias = mx.array(bias)
    texts = [{"text": "the cat"}, {"text": "the " * 60}, {"text": "a dog runs"}, {"text": "the the the the the"}]
    examples, masker = masked_lm_data(texts, tokenizer, text_column="text", max_length=64), rtd_masker(tokenizer)
    found = pair.evaluate(tokenizer, examples, 1, 42, masker)
    rng, sums = np.random.default_rng(42), np.zeros(4)  # generator x masked, masked, discriminator x real, real
    with drawing_from([mx.random.key(42)]):
        for i in range(len(texts)):
            inputs, labels = pair.loss_arrays(collate(examples, [i], tokenizer, masker, rng))
            out = pair.losses(inputs, labels)
            masked, real = labels["masked"].size, int(np.array(out["real"]).sum())
            sums += [out["generator_loss"].item() * masked, masked, out["discriminator_loss"].item() * real, real]
    assert found["eval_generator_loss"] == pytest.approx(sums[0] / sums[1], rel=1e-6)
    assert found["eval_discriminator_loss"] == pytest.approx(sums[2] / sums[3], rel=1e-6)
    assert found["eval_loss"] == pytest.approx(sums[0] / sums[1] + 50 * sums[2] / sums[3], rel=1e-6)


def test_train_called_on_a_pair_trains_electra_loss(tmp_path):
    """`trainer.train` without `objective=` on a pair uses the pair's own loss and metrics, not a head's."""
    from mlx_encoders.train.config import TrainingConfig
    from mlx_encoders.train.data import masked_lm_data
    from mlx_encoders.train.tasks.rtd import rtd_pair
    from mlx_encoders.train.trainer import train

    tokenizer = Tokenizer.from_pretrained(MINILM)
    pair = rtd_pair(None, SIZES, tokenizer, None, 0.25, 50.0)
    examples = masked_lm_data([{"text": t} for t in TEXTS], tokenizer, text_column="text", max_length=24)
    config = TrainingConfig(tmp_path / "run", max_steps=1, batch_size=4)
    metrics = train(pair, tokenizer, examples, examples, config)
    assert metrics["eval_loss"] == pytest.approx(
        metrics["eval_generator_loss"] + 50 * metrics["eval_discriminator_loss"], rel=1e-5
    )


def test_without_shared_embeddings_each_part_trains_and_saves_its_own(tmp_path):
    """The paper's ablation (`--no-share-embeddings`): the generator keeps its own tables, which train and are
    saved with it, and both parts still load in transformers."""
    trained = fine_tune("rtd", [{"text": t} for t in TEXTS], tmp_path / "run", config=SIZES, tokenizer=MINILM,
                        max_steps=2, batch_size=4, lr=1e-2, share_embeddings=False)  # fmt: skip
    folders = [tmp_path / "run" / "model" / part for part in ("discriminator", "generator")]
    tables = [np.array(mlx_encoders.load_model(f).electra.embeddings.word_embeddings.weight) for f in folders]
    assert np.abs(tables[0] - tables[1]).max() > 1e-3
    reference = transformers.ElectraForMaskedLM.from_pretrained(folders[1])
    np.testing.assert_allclose(reference.electra.embeddings.word_embeddings.weight.detach().numpy(), tables[1])
    assert trained.path == folders[0]

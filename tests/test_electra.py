"""ELECTRA against transformers: embeddings projected to the hidden width or not, the discriminator and the
generator, forward and gradients (fp32, 1e-4 of the output's or the largest gradient's scale)."""

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import CONFIGS, load_reference
from mlx.utils import tree_flatten
from test_gradients import check_gradients
from test_parity import check_parity

import mlx_encoders
from mlx_encoders.train import task_loss

HIDDEN = CONFIGS["electra"]["hidden_size"]
WIDTHS = [pytest.param(16, id="projected"), pytest.param(HIDDEN, id="unprojected")]  # embedding_size


@pytest.mark.parametrize("embedding_size", WIDTHS)
@pytest.mark.parametrize("task", ["encoder", "pretraining", "masked-lm"])
def test_forward_and_gradients_match_transformers(checkpoint, task, embedding_size):
    folder = checkpoint("electra", task, embedding_size=embedding_size)
    keys = load_reference(folder, task).state_dict()
    projected = any(k.endswith("embeddings_project.weight") for k in keys)
    assert projected == (embedding_size != HIDDEN)  # transformers projects only when the widths differ
    model = mlx_encoders.load_model(folder)
    electra = model if task == "encoder" else model.electra
    assert ("embeddings_project" in electra) == projected
    assert electra.embeddings.word_embeddings.weight.shape[1] == embedding_size
    check_parity(folder, task)
    check_gradients(folder, task)


def test_discriminator_gives_one_logit_per_token(checkpoint):
    model, tokenizer = mlx_encoders.load(checkpoint("electra", "pretraining"))
    batch = tokenizer(["The chef cooked the meal.", "A longer text, padded beside the first."], padding=True)
    logits = model(**batch).logits
    assert logits.shape == batch["input_ids"].shape  # (B, L): replaced or original, for each token
    assert model.config["architectures"] == ["ElectraForPreTraining"]


def test_discriminator_loss_skips_ignored_tokens(checkpoint):
    """transformers averages the discriminator's BCE over the attention mask's tokens; labels of -100 do it here."""
    model, tokenizer = mlx_encoders.load(checkpoint("electra", "pretraining"))
    batch = tokenizer(["A text.", "A longer text, padded beside the first."], padding=True)
    out = model(**batch)
    real = np.array(batch["attention_mask"]).astype(bool)
    labels = np.where(real, np.arange(real.size).reshape(real.shape) % 2, -100)
    logits = np.array(out.logits, np.float64)[real]
    targets = labels[real]
    expected = np.mean(np.maximum(logits, 0) - logits * targets + np.log1p(np.exp(-np.abs(logits))))
    assert abs(task_loss(model, out, labels=mx.array(labels)).item() - expected) <= 1e-5 * expected


def test_untied_generator_head_loads_its_own_weight(checkpoint):
    folder = checkpoint("electra", "masked-lm", tie_word_embeddings=False)
    model = mlx_encoders.load_model(folder)
    weights = dict(tree_flatten(model.parameters()))
    assert "generator_lm_head.weight" in weights
    assert not np.array_equal(weights["generator_lm_head.weight"], weights["electra.embeddings.word_embeddings.weight"])
    check_parity(folder, "masked-lm")


def test_generator_predict_tokens_gives_the_logits(checkpoint):
    """The trainer's masked-LM loss scores only masked positions through `predict_tokens`."""
    model, tokenizer = mlx_encoders.load(checkpoint("electra", "masked-lm"))
    out = model(**tokenizer(["Predict [MASK] tokens here."]))
    np.testing.assert_array_equal(np.array(model.predict_tokens(out.last_hidden_state)), np.array(out.logits))


def test_fill_mask_refuses_the_discriminator_naming_the_generator(checkpoint):
    """BERT's pretraining checkpoint fills masks with its masked-LM half; ELECTRA's (the discriminator) has none."""
    folder = checkpoint("electra", "pretraining")
    message = (
        r"The 'fill-mask' pipeline needs a head that predicts words, but ElectraForPreTraining from .+ is a "
        r"discriminator: it predicts which tokens were replaced, not words\. Use the generator checkpoint "
        r"\(ElectraForMaskedLM\) for fill-mask\."
    )
    for model in (folder, mlx_encoders.load(folder)):
        with pytest.raises(ValueError, match=message):
            mlx_encoders.pipeline("fill-mask", model=model)
    with pytest.raises(ValueError, match=r"ElectraForPreTraining \(a pretraining head\), which supports the 'feat"):
        mlx_encoders.pipeline("text-classification", model=folder)
    assert len(mlx_encoders.pipeline("feature-extraction", model=folder)("A text.")[0]) == 5  # its encoder embeds
    assert len(mlx_encoders.pipeline("fill-mask", model=checkpoint("electra", "masked-lm"))("A [MASK].")) == 5
    assert len(mlx_encoders.pipeline("fill-mask", model=checkpoint("bert", "pretraining"))("A [MASK].")) == 5

"""Every model trains: its loss and gradients equal transformers' for every architecture x head (the fast attention
kernel on each encoder and one head), its dropout sits where transformers puts it, and gradient checkpointing saves
memory, not accuracy."""

import functools

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
from checkpoints import language_model_task, load_reference
from mlx.utils import tree_flatten
from test_numerics import force_branch
from test_parity import as_torch, assert_close, our_outputs
from tolerance import assert_float32_close

import mlx_encoders
from mlx_encoders.engine.attention import attention
from mlx_encoders.engine.ops import exp_nonpositive, gelu, gelu_tanh, silu
from mlx_encoders.models import MODEL_TYPES, layers, model_module
from mlx_encoders.models.base import padding_mask
from mlx_encoders.models.bert import BertForMaskedLM, ModelArgs
from mlx_encoders.train import task_loss

CASES = [(mt, task) for mt in MODEL_TYPES for task in model_module(mt).MODELS]
# The "gpu" branch changes only the encoder's attention kernel, which every head shares: it runs on each
# architecture's encoder plus one head (pretraining where there is one, else rotating), so every head meets it.
_HEADS = {
    mt: [task for task in model_module(mt).MODELS if task not in ("encoder", "pretraining")] for mt in MODEL_TYPES
}
GPU_CASES = [
    (mt, task)
    for i, mt in enumerate(MODEL_TYPES)
    for task in (
        "encoder",
        "pretraining" if "pretraining" in model_module(mt).MODELS else _HEADS[mt][i % len(_HEADS[mt])],
    )
]
BRANCH_CASES = [(mt, t, "cpu") for mt, t in CASES] + [(mt, t, "gpu") for mt, t in GPU_CASES]
# Sequence classification's other problem types, from the config or inferred as transformers does: a single
# label is regression, float labels are multi-label.
MULTI_LABEL = "multi_label_classification"
PROBLEMS = [
    ("bert", dict(num_labels=1), "regression"),
    ("distilbert", dict(num_labels=1), "regression"),
    ("roberta", dict(problem_type=MULTI_LABEL), MULTI_LABEL),
    ("modernbert", {}, MULTI_LABEL),
    ("deberta-v2", {}, MULTI_LABEL),  # DeBERTa reads these float labels as class probabilities (soft cross-entropy)
    ("deberta", dict(num_labels=1), "regression"),
]
TEXTS = ["", "word", "The quick brown fox jumps over the lazy dog."]
BRANCHES = ["cpu", "gpu"]  # engine.attention's written-out attention, and mx.fast.scaled_dot_product_attention


def make_labels(task: str, args, batch: dict, problem: str | None = None) -> dict[str, np.ndarray]:
    """Seeded labels for `task` in transformers' keywords; padding tokens are ignored (-100)."""
    rng = np.random.default_rng(0)
    real = np.array(batch["attention_mask"]).astype(bool)
    B, L = real.shape
    if task == "encoder":  # a fixed random projection of the outputs (see encoder_loss)
        return {"projection": rng.standard_normal((B, L, args.hidden_size)).astype(np.float32) * real[..., None]}
    if task == "sequence-classification":
        if args.num_labels == 1:
            return {"labels": rng.standard_normal(B).astype(np.float32)}
        if problem == MULTI_LABEL:
            return {"labels": rng.integers(0, 2, (B, args.num_labels)).astype(np.float32)}
        return {"labels": rng.integers(0, args.num_labels, B)}
    if task == "question-answering":  # the last answer lies outside the input: clamped to L, then ignored
        return {"start_positions": np.array([0, 2, L + 3]), "end_positions": np.array([1, 3, L + 5])}
    if task == "pretraining" and args.model_type == "electra":  # the discriminator: 1 = replaced token
        return {"labels": np.where(real, rng.integers(0, 2, (B, L)), -100)}
    labels = rng.integers(0, args.num_labels if task == "token-classification" else args.vocab_size, (B, L))
    if task != "token-classification":  # masked LM: a third of the real tokens are predicted
        real &= rng.random((B, L)) < 0.35
        real[0, 0] = True
    labels = {"labels": np.where(real, labels, -100)}
    if task == "pretraining":
        labels["next_sentence_label"] = rng.integers(0, 2, B)
    return labels


def encoder_loss(hidden: mx.array | torch.Tensor, pooled, projection: np.ndarray):
    """sum(hidden * projection) (+ the pooled row's share): a scalar that reaches every output of an encoder."""
    loss = (hidden * projection).sum()
    return loss if pooled is None else loss + (pooled * projection[:, 0]).sum()


def reference_gradients(folder, task: str, batch: dict, labels: dict) -> tuple[float, dict, list[set[str]]]:
    """transformers' loss (its own, from `labels`), the gradient under each parameter name, and the names of each
    parameter (tied weights have several)."""
    ref = load_reference(folder, task)
    inputs = as_torch(batch)
    if task == "encoder":
        out = ref(**inputs)
        pooled = out.get("pooler_output")
        if pooled is None and ref.config.model_type == "modernbert":  # ours: the CLS token after the final norm
            pooled = out.last_hidden_state[:, 0]
        loss = encoder_loss(out.last_hidden_state, pooled, torch.from_numpy(labels["projection"]))
    else:
        loss = ref(**inputs, **{k: torch.from_numpy(v) for k, v in labels.items()}).loss
    loss.backward()
    names = {}
    for name, p in ref.named_parameters(remove_duplicate=False):
        names.setdefault(p, set()).add(name)
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).numpy() for p, ns in names.items() for n in ns}
    return loss.item(), grads, list(names.values())


@functools.cache
def case(folder, task: str, problem: str | None = None):
    """(model, batch, labels, transformers' loss, gradients and parameter names), built once per checkpoint."""
    model, tokenizer = mlx_encoders.load(folder)
    batch = dict(tokenizer(TEXTS, padding=True))
    labels = make_labels(task, model.args, batch, problem)
    return model, batch, labels, *reference_gradients(folder, task, batch, labels)


def our_gradients(model, batch: dict, labels: dict) -> tuple[float, dict[str, np.ndarray]]:
    def loss_fn():
        out = model(**batch)
        if "projection" in labels:
            return encoder_loss(out.last_hidden_state, out.pooler_output, mx.array(labels["projection"]))
        return task_loss(model, out, **{k: mx.array(v) for k, v in labels.items()})

    loss, grads = nn.value_and_grad(model, loss_fn)()
    grads = dict(tree_flatten(grads))
    module = model_module(model.args.model_type)
    if hasattr(module, "checkpoint_weights"):  # in the checkpoint's layouts, as transformers' (DeBERTa's Conv1d)
        grads = module.checkpoint_weights(grads)
    return loss.item(), {k: np.array(v) for k, v in grads.items()}


def check_gradients(folder, task: str, problem: str | None = None):
    model, batch, labels, expected_loss, expected, parameters = case(folder, task, problem)
    loss, grads = our_gradients(model, batch, labels)
    assert abs(loss - expected_loss) <= 1e-5 * abs(expected_loss), (loss, expected_loss)
    assert set(grads) <= set(expected), f"not in transformers' model: {sorted(set(grads) - set(expected))}"
    missing = [names for names in parameters if not names & set(grads)]
    assert not missing, f"transformers' parameters missing here: {missing}"
    scale = max(float(np.abs(g).max()) for g in expected.values())
    for name, g in grads.items():
        err = float(np.abs(g - expected[name]).max())
        assert err <= 1e-4 * scale, f"{name}: max abs error {err:.3g} > 1e-4 x largest gradient {scale:.3g}"


@pytest.mark.parametrize("model_type,task,branch", BRANCH_CASES)
def test_gradients_match_transformers(checkpoint, monkeypatch, model_type, task, branch):
    force_branch(monkeypatch, branch)
    check_gradients(checkpoint(model_type, task), task)


@pytest.mark.parametrize("branch", BRANCHES)
@pytest.mark.parametrize("model_type,config,problem", PROBLEMS)
def test_sequence_classification_problem_types(checkpoint, monkeypatch, model_type, config, problem, branch):
    force_branch(monkeypatch, branch)
    check_gradients(checkpoint(model_type, "sequence-classification", **config), "sequence-classification", problem)


# Each kind of dropout at its own probability, so one in a wrong place, or missing, changes the output.
DROPOUT = {
    "bert": dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.2, classifier_dropout=0.3),
    "distilbert": dict(dropout=0.1, attention_dropout=0.2, seq_classif_dropout=0.3, qa_dropout=0.4),
    "albert": dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.2, classifier_dropout_prob=0.3),
    "modernbert": dict(embedding_dropout=0.1, attention_dropout=0.2, mlp_dropout=0.25, classifier_dropout=0.3),
    "mpnet": dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.2),  # no classifier dropout of its own
    "deberta-v2": dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.2, pooler_dropout=0.25, cls_dropout=0.3),
}
DROPOUT["eurobert"] = dict(attention_dropout=0.2)  # its only dropout
DROPOUT["qwen3"] = dict(attention_dropout=0.2, classifier_dropout=0.3)  # no hidden dropout in Qwen3
DROPOUT["deberta"] = DROPOUT["deberta-v2"]
DROPOUT["roberta"] = DROPOUT["xlm-roberta"] = DROPOUT["electra"] = DROPOUT["jina_embeddings_v3"] = DROPOUT["bert"]
DROPOUT["nomic_bert"] = DROPOUT["gte"] = DROPOUT["bert"]
# BERT's classifiers fall back to hidden_dropout_prob without classifier_dropout.
DROPOUT_CASES = [pytest.param(mt, task, DROPOUT[mt], id=f"{mt}-{task}") for mt, task in CASES] + [
    pytest.param(
        "bert", "sequence-classification", dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.2),
        id="bert-sequence-classification-without-classifier_dropout",
    )
]  # fmt: skip


def scale_instead_of_dropping(monkeypatch):
    """Dropout with probability p becomes a multiplication by 1 - p in training, in torch and in MLX alike."""
    monkeypatch.setattr(
        torch.nn.functional, "dropout", lambda x, p=0.5, training=True, inplace=False: x * (1 - p) if training else x
    )
    monkeypatch.setattr(layers.Dropout, "__call__", lambda self, x: x * self._p_1 if self.training else x)


@pytest.mark.parametrize("model_type,task,config", DROPOUT_CASES)
def test_dropout_sits_where_transformers_puts_it(checkpoint, monkeypatch, model_type, task, config):
    scale_instead_of_dropping(monkeypatch)
    folder = checkpoint(model_type, task, **config)
    model, tokenizer = mlx_encoders.load(folder)
    batch = tokenizer(TEXTS, padding=True)
    ref = load_reference(folder, task).train()
    with torch.no_grad():
        theirs = {k: v.numpy() for k, v in ref(**as_torch(batch)).items() if isinstance(v, torch.Tensor)}
    real = np.array(batch["attention_mask"]).astype(bool)
    eval_outputs = our_outputs(model(**batch))
    assert_close(our_outputs(model.train()(**batch)), theirs, real, task)
    with pytest.raises(AssertionError):  # the check can see dropout: eval mode differs
        assert_close(eval_outputs, theirs, real, task)


def test_dropout_is_random_in_training_and_off_in_eval(checkpoint):
    model, tokenizer = mlx_encoders.load(checkpoint("bert", "masked-lm", **DROPOUT["bert"]))
    batch = tokenizer(TEXTS, padding=True)
    evaluated = np.array(model(**batch).logits)
    first, second = (np.array(model.train()(**batch).logits) for _ in range(2))
    assert not np.allclose(first, second) and not np.allclose(first, evaluated)
    np.testing.assert_array_equal(np.array(model.eval()(**batch).logits), evaluated)

    embeddings = model.bert.embeddings
    kept = np.array(embeddings(batch["input_ids"]))
    dropped = np.array(embeddings.train()(batch["input_ids"]))
    zeroed = dropped == 0
    assert abs(zeroed.mean() - 0.1) < 0.03  # hidden_dropout_prob
    np.testing.assert_allclose(dropped[~zeroed], kept[~zeroed] / 0.9, rtol=1e-6)


@pytest.mark.parametrize("branch", BRANCHES)
def test_attention_dropout_drops_probabilities(monkeypatch, branch):
    """With v the identity, attention returns its (dropped-out) probabilities."""
    force_branch(monkeypatch, branch)
    q, k = (mx.random.normal((2, 3, 64, 8), key=mx.random.key(i)) for i in range(2))
    v = mx.broadcast_to(mx.eye(64), (2, 3, 64, 64))
    mask = padding_mask(mx.ones((2, 64), mx.int32), mx.float32)
    probabilities = np.array(attention(q, k, v, mask))
    np.testing.assert_allclose(probabilities.sum(axis=-1), 1, rtol=1e-6)
    dropout = layers.Dropout(0.3)
    first, second = (np.array(attention(q, k, v, mask, dropout)) for _ in range(2))
    assert not np.array_equal(first, second)
    zeroed = first == 0
    assert abs(zeroed.mean() - 0.3) < 0.02
    np.testing.assert_allclose(first[~zeroed], probabilities[~zeroed] / 0.7, rtol=1e-5)
    # eval mode, or p = 0, is the attention without dropout, bit for bit
    np.testing.assert_array_equal(np.array(attention(q, k, v, mask, dropout.eval())), probabilities)
    np.testing.assert_array_equal(np.array(attention(q, k, v, mask, layers.Dropout(0.0))), probabilities)


@pytest.mark.parametrize("model_type,task", CASES)
def test_every_model_switches_gradient_checkpointing(checkpoint, model_type, task):
    model = case(checkpoint(model_type, task), task)[0]
    runners = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]  # the encoder's layer loop
    assert len(runners) == 1
    model.gradient_checkpointing_enable()
    assert runners[0].gradient_checkpointing
    model.gradient_checkpointing_disable()
    assert not runners[0].gradient_checkpointing


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_gradient_checkpointing_keeps_gradients(checkpoint, model_type):
    task = language_model_task(model_type)
    model, batch, labels, *_ = case(checkpoint(model_type, task), task)
    loss, grads = our_gradients(model, batch, labels)
    model.gradient_checkpointing_enable()
    try:
        checkpointed_loss, checkpointed = our_gradients(model, batch, labels)
    finally:
        model.gradient_checkpointing_disable()
    assert checkpointed_loss == loss
    for name, g in grads.items():
        # A tensor every layer reads (DeBERTa's relative embeddings) sums its layers' gradients in another order.
        atol = max(1e-9, 1e-6 * float(np.abs(g).max()))
        np.testing.assert_allclose(checkpointed[name], g, rtol=1e-6, atol=atol, err_msg=name)


@pytest.mark.parametrize("model_type", ["bert", "albert"])  # ALBERT: layer groups shared across layers
def test_checkpointed_layers_recompute_the_forward_dropout_masks(checkpoint, monkeypatch, model_type):
    """The backward pass reruns each layer: its dropout must draw the very masks of the forward pass."""
    model, tokenizer = mlx_encoders.load(checkpoint(model_type, "masked-lm", **DROPOUT[model_type]))
    batch = dict(tokenizer(TEXTS, padding=True))
    labels = make_labels("masked-lm", model.args, batch)
    model.train()
    model.gradient_checkpointing_enable()
    drawn = []
    random_words = layers.random_words

    def recorded(*args, **kwargs):
        drawn.append(random_words(*args, **kwargs))
        return drawn[-1]

    monkeypatch.setattr(layers, "random_words", recorded)
    model(**batch)
    forward = len(drawn)
    our_gradients(model, batch, labels)
    masks = [np.array(m) for m in drawn[forward:]]
    first, recomputed = masks[:forward], masks[forward:]
    assert 0 < len(recomputed) < forward  # the embeddings' dropout runs once
    for mask in recomputed:
        assert any(m.shape == mask.shape and np.array_equal(m, mask) for m in first)


def test_gradient_checkpointing_lowers_peak_memory():
    """A training step's memory above the model's own, at hidden size 256, 6 layers and 8 x 128 tokens."""
    args = ModelArgs(
        vocab_size=1000, hidden_size=256, num_hidden_layers=6, num_attention_heads=4, intermediate_size=512
    )
    model = BertForMaskedLM(args)
    assert model.args.model_type == "bert"  # a model built in code knows its architecture
    model.eval()
    ids = mx.random.randint(0, args.vocab_size, (8, 128), key=mx.random.key(0))
    mx.eval(model.parameters(), ids)
    step = nn.value_and_grad(model, lambda: task_loss(model, model(ids), labels=ids))

    def step_memory() -> int:
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        mx.eval(step())
        return mx.get_peak_memory() - before

    plain = step_memory()
    model.gradient_checkpointing_enable()
    assert step_memory() < 0.75 * plain


def test_exp_nonpositive_gradient_is_exp():
    x = np.linspace(-87, 0, 100_001, dtype=np.float32)
    weights = np.random.default_rng(0).standard_normal(x.shape).astype(np.float32)
    got = np.array(mx.grad(lambda t: (exp_nonpositive(t) * mx.array(weights)).sum())(mx.array(x)))
    exact = weights * np.exp(x.astype(np.float64))
    np.testing.assert_allclose(got, exact, rtol=3e-7, atol=1e-40)  # atol: products below float32's normal range
    reference = np.array(mx.grad(lambda t: (mx.exp(t) * mx.array(weights)).sum())(mx.array(x)))
    np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-40)


def test_gelu_gradient_is_the_exact_gelus():
    x = np.concatenate([np.linspace(-12, 12, 2_000_001, dtype=np.float32), np.float32([-1e30, -50, 50, 1e30])])
    exact = torch.from_numpy(x).double().requires_grad_()
    torch.nn.functional.gelu(exact).sum().backward()
    got = np.array(mx.grad(lambda t: gelu(t).sum())(mx.array(x)))
    assert np.abs(got - exact.grad.numpy()).max() <= 4e-7  # torch's float32 GELU: 2.8e-7
    half = mx.grad(lambda t: gelu(t).astype(mx.float32).sum())(mx.array(x[::1000]).astype(mx.float16))
    assert half.dtype == mx.float16
    np.testing.assert_allclose(np.array(half.astype(mx.float32)), exact.grad.numpy()[::1000], rtol=2e-3, atol=1e-3)


@pytest.mark.parametrize(
    "ours, theirs",
    [(silu, torch.nn.functional.silu), (gelu_tanh, lambda t: torch.nn.functional.gelu(t, approximate="tanh"))],
    ids=["silu", "gelu_tanh"],
)
def test_sigmoid_gated_activation_gradients_match_torch(ours, theirs):
    x = np.concatenate([np.linspace(-30, 30, 2_000_001, dtype=np.float32), np.float32([-1e30, -50, 50, 1e30])])
    exact = torch.from_numpy(x).double().requires_grad_()
    theirs(exact).sum().backward()
    got = np.array(mx.grad(lambda t: ours(t).sum())(mx.array(x)))
    assert np.abs(got - exact.grad.numpy()).max() <= 4e-6


@pytest.mark.parametrize("branch", BRANCHES)
def test_attention_gradients_match_torch(monkeypatch, branch):
    force_branch(monkeypatch, branch)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 3, 9, 8)).astype(np.float32) for _ in range(3))
    cotangent = rng.standard_normal((2, 3, 9, 8)).astype(np.float32)
    keep = np.ones((2, 9), np.int32)
    keep[1, 4:] = 0
    mask = padding_mask(mx.array(keep), mx.float32)
    got = mx.grad(lambda *t: (attention(*t, mask) * mx.array(cotangent)).sum(), argnums=(0, 1, 2))(
        *(mx.array(t) for t in (q, k, v))
    )
    tensors = [torch.from_numpy(t).double().requires_grad_() for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(
        *tensors, attn_mask=torch.from_numpy(np.array(mask)).double()
    )
    (out * torch.from_numpy(cotangent)).sum().backward()
    terms = 2 * (8 + 2 * 9)  # forward and backward: over the head's 8 dimensions, the softmax and values over 9 keys
    for ours, theirs in zip(got, tensors, strict=True):
        assert_float32_close(np.array(ours), theirs.grad.numpy(), terms)


@pytest.mark.parametrize(
    "model_type", ["albert", "bert", "roberta", "xlm-roberta", "mpnet", "nomic_bert", "jina_embeddings_v3"]
)
def test_an_untied_masked_lm_heads_gradients_match_transformers(checkpoint, model_type):
    """The decoder untied from the word embeddings trains its own weight and bias, as transformers' does."""
    check_gradients(checkpoint(model_type, "masked-lm", tie_word_embeddings=False), "masked-lm")

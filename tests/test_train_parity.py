"""Step-for-step parity of the real training loop, `mlx_encoders.train.train`, with a torch reference loop
(issue 11, "Correctness"): transformers' Trainer inner loop written out by hand on the same saved checkpoint.

Both sides start from the same transformers checkpoint with every dropout probability 0, and see the same batches:
the reference rebuilds the trainer's order from `epoch_steps` and its masking generator from the seed, and feeds
the arrays our `collate` and `Masker` produce to torch. The reference is transformers' `Trainer` recipe: AdamW over
`Trainer.get_decay_parameter_names` (no decay on biases and norms), `get_linear_schedule_with_warmup` with
ceil(warmup_ratio * steps) warmup steps, each micro-batch's loss divided by the step's number of micro-batches
(`Trainer.training_step` for a loss not already scaled for accumulation), `torch.nn.utils.clip_grad_norm_`.
Checked at each of 20 optimizer steps: the learning rate, the loss within 1e-4 relative, the gradient norm;
at the end, every weight tensor within 1e-4 of its largest magnitude (max |ours - torch| <= 1e-4 * max |torch|;
key biases aside, see `compared`), after training moved the weights by far more than that.
"""

import json
import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from checkpoints import load_reference
from mlx.utils import tree_flatten

import mlx_encoders
from mlx_encoders.train.data import (
    Examples,
    collate,
    masked_lm_data,
    sequence_classification_data,
    token_classification_data,
)
from mlx_encoders.train.lora import apply_lora
from mlx_encoders.train.masking import Masker
from mlx_encoders.train.trainer import TrainingConfig, epoch_steps, train

STEPS, TOLERANCE = 20, 1e-4
# The gradient norm sums ~10^6 squares in float32 (MLX's sum drifts ~1e-5 from the float64 value on BERT's
# embeddings, torch's less), so it agrees less closely than the loss; a wrong clip would differ by far more.
NORM_TOLERANCE = 1e-3
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Short one.",
    "A tiny encoder learns to fill in the blanks, one masked word at a time.",
    "Gradients add up over two micro-batches before each step.",
    "Weight decay skips biases and norm weights.",
    "Hello world",
    "Warmup first, then the learning rate falls in a straight line to zero at the very last step.",
    "Every dropout is off, so both frameworks compute the same function.",
    "Padding differs from one batch to the next.",
    "Clipping scales the whole gradient when its norm is too large.",
    "Masks come from the same generator on both sides.",
    "It rains.",
    "The river ran past the old mill and under the stone bridge into town.",
    "Numbers like 42 and 2024 split into pieces.",
    "Adam keeps two moments per weight.",
    "Yes",
    "An odd count of examples leaves a short last batch in every epoch.",
    "Twenty optimizer steps are enough to see any drift between the two loops.",
]  # fmt: skip
CLASSES = ["neg", "neutral", "pos"]  # checkpoints.NUM_LABELS: 3 sequence classes, 5 token tags
TAGS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]

# Every dropout probability of each architecture's config set to 0, and small models: 2 layers of width 32.
NO_DROPOUT = {
    "bert": dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0),
    "roberta": dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0),
    "distilbert": dict(dropout=0.0, attention_dropout=0.0, qa_dropout=0.0, seq_classif_dropout=0.0),
    "albert": dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0),
    "modernbert": dict(embedding_dropout=0.0, attention_dropout=0.0, mlp_dropout=0.0, classifier_dropout=0.0),
    "deberta-v2": dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pooler_dropout=0.0, cls_dropout=0.0),
}
SIZES = {
    "bert": dict(num_hidden_layers=2),
    "roberta": dict(num_hidden_layers=2),
    "distilbert": dict(n_layers=2),
    "albert": dict(num_hidden_layers=2, num_hidden_groups=1, inner_group_num=1),  # one layer, shared by both
    "modernbert": dict(num_hidden_layers=2),  # a global then a local (sliding-window) attention layer
    "deberta-v2": dict(num_hidden_layers=2),
}


@dataclass(frozen=True)
class Case:
    model_type: str
    task: str
    lora: bool = False
    max_grad_norm: float = 3.0  # what some steps' gradient norms exceed and others' do not, so both branches run

    def __str__(self) -> str:
        return f"{self.model_type}-{self.task}" + ("-lora" if self.lora else "")


CASES = [
    Case("bert", "masked-lm"),
    Case("roberta", "sequence-classification"),
    Case("distilbert", "token-classification"),
    Case("modernbert", "masked-lm"),
    Case("albert", "sequence-classification"),
    Case("deberta-v2", "masked-lm"),
    Case("bert", "sequence-classification", lora=True, max_grad_norm=1.5),
]
LORA_RANK, LORA_ALPHA = 4, 8.0


def config(folder, max_grad_norm: float) -> TrainingConfig:
    """Batches of 4 (the last of each epoch of 18 examples holds 2), 2 micro-batches a step (the last step of
    each epoch has 1), 2 warmup steps, decay on, clipping on."""
    return TrainingConfig(folder, max_steps=STEPS, batch_size=4, grad_accum=2, lr=2e-3, warmup_ratio=0.1,
                          weight_decay=0.01, max_grad_norm=max_grad_norm, seed=3)  # fmt: skip


def examples(task: str, tokenizer) -> Examples:
    if task == "masked-lm":
        return masked_lm_data([{"text": t} for t in TEXTS], tokenizer)
    if task == "sequence-classification":
        rows = [{"text": t, "label": CLASSES[i % 3]} for i, t in enumerate(TEXTS)]
        return sequence_classification_data(rows, tokenizer)
    words = [t.split() for t in TEXTS]
    rows = [{"tokens": w, "ner_tags": [TAGS[(i + j) % 5] for j in range(len(w))]} for i, w in enumerate(words)]
    return token_classification_data(rows, tokenizer, label2id={t: i for i, t in enumerate(TAGS)})


def trainer_batches(data: Examples, tokenizer, config: TrainingConfig, masker: Masker | None) -> list[list[dict]]:
    """The micro-batches of each of the trainer's steps: its epochs' orders, masked in turn by a generator seeded
    as the trainer seeds its own."""
    rng, steps, epoch = np.random.default_rng(config.seed), [], 0
    while len(steps) < config.max_steps:
        for indices in epoch_steps(len(data), config, epoch):
            steps.append([collate(data, i, tokenizer, masker, rng) for i in indices])
        epoch += 1
    return steps[: config.max_steps]


# ----- the torch side -----


class TorchLoRA(torch.nn.Module):
    """`linear(x) + (alpha / r) (x A^T) B^T`, LoRA written out on a transformers linear, with given A and B; its
    parameter names (`linear.weight`, `lora_a`, `lora_b`) are those of our LoRALinear."""

    def __init__(self, linear: torch.nn.Linear, a: np.ndarray, b: np.ndarray, scale: float):
        super().__init__()
        self.linear, self.scale = linear, scale
        self.lora_a, self.lora_b = torch.nn.Parameter(torch.tensor(a)), torch.nn.Parameter(torch.tensor(b))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.scale * (x @ self.lora_a.T) @ self.lora_b.T


def add_lora(model: torch.nn.Module, initial: dict[str, np.ndarray]) -> list[str]:
    """Adapt the encoder's attention projections (query, key, value) with the A and B values in `initial`, freeze
    the encoder but the adapters; the head (everything outside `bert.`) trains. Returns the adapted paths."""
    paths = [p for p, m in model.named_modules() if p.startswith("bert.") and p.endswith((".query", ".key", ".value"))]
    for path in paths:
        parent, name = path.rsplit(".", 1)
        linear = getattr(model.get_submodule(parent), name)
        adapted = TorchLoRA(linear, initial[f"{path}.lora_a"], initial[f"{path}.lora_b"], LORA_ALPHA / LORA_RANK)
        setattr(model.get_submodule(parent), name, adapted)
    for name, p in model.named_parameters():
        p.requires_grad = "lora_" in name or not name.startswith("bert.")
    return paths


def torch_inputs(batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v.astype(np.int64)) for k, v in batch.items()}


def torch_training(model: torch.nn.Module, steps: list[list[dict]], config: TrainingConfig) -> list[dict]:
    """transformers' Trainer inner loop, written out; returns each step's loss, learning rate and gradient norm
    (before clipping), as our metrics.jsonl records them."""
    model.train()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    groups = [
        {"params": [p for n, p in trainable if n in decay], "weight_decay": config.weight_decay},
        {"params": [p for n, p in trainable if n not in decay], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.999), eps=1e-8)
    warmup = math.ceil(config.warmup_ratio * config.max_steps)  # TrainingArguments.get_warmup_steps
    schedule = transformers.get_linear_schedule_with_warmup(optimizer, warmup, config.max_steps)
    records = []
    for batches in steps:
        total = 0.0
        for batch in batches:
            loss = model(**torch_inputs(batch)).loss / len(batches)  # Trainer: / current_gradient_accumulation_steps
            loss.backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        records.append({"loss": total, "lr": lr, "grad_norm": norm.item()})
    return records


# ----- the test -----


def relative_difference(found, expected) -> np.ndarray:
    found, expected = np.asarray(found, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    return np.abs(found - expected) / np.abs(expected)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One torch thread: on models this small, and a shared machine, two threads are several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def compared(name: str, value: np.ndarray) -> np.ndarray:
    """The entries of a weight that the final check compares: all but the key biases. A bias added to every key adds
    the same score to each key a query sees, which softmax cancels, so its gradient is zero but for rounding; Adam
    divides that noise by its own size into lr-sized steps of random sign, different in each framework. Those
    entries change no output (the losses show it)."""
    if name.endswith(("key.bias", "k_lin.bias")):
        return value[:0]
    if name.endswith("Wqkv.bias"):  # ModernBERT's fused projection: the query, key and value rows in turn
        third = len(value) // 3
        return np.concatenate([value[:third], value[2 * third :]])
    return value


@pytest.mark.parametrize("case", CASES, ids=str)
def test_training_matches_torch_step_for_step(checkpoint, tmp_path, case):
    folder = checkpoint(case.model_type, case.task, **NO_DROPOUT[case.model_type], **SIZES[case.model_type])
    model, tokenizer = mlx_encoders.load(folder)
    assert all(v.dtype == mx.float32 for _, v in tree_flatten(model.parameters()))
    reference = load_reference(folder, case.task)
    if case.lora:
        mx.random.seed(0)
        adapted = apply_lora(model, LORA_RANK, LORA_ALPHA)
        initial = {k: np.array(v) for k, v in tree_flatten(model.parameters()) if "lora_" in k}
        assert sorted(add_lora(reference, initial)) == sorted(adapted)
    data = examples(case.task, tokenizer)
    masker = Masker.from_tokenizer(tokenizer) if case.task == "masked-lm" else None  # train()'s default masker
    settings = config(tmp_path, case.max_grad_norm)
    before = {n: p.detach().numpy().copy() for n, p in reference.named_parameters()}
    expected = torch_training(reference, trainer_batches(data, tokenizer, settings, masker), settings)

    train(model, tokenizer, data, config=settings)

    found = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in found] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([r["lr"] for r in found], [r["lr"] for r in expected], rtol=1e-6, atol=0)
    for key, tolerance in (("loss", TOLERANCE), ("grad_norm", NORM_TOLERANCE)):
        ours, theirs = [r[key] for r in found], [r[key] for r in expected]
        assert np.isfinite(theirs).all()
        worst = relative_difference(ours, theirs)
        assert worst.max() <= tolerance, f"{key} differs by {worst.max():.2e} relative at step {worst.argmax() + 1}"
    norms = np.array([r["grad_norm"] for r in expected])
    assert (norms > settings.max_grad_norm).any() and (norms < settings.max_grad_norm).any()  # clipped, and not

    ours = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    theirs = {n: p.detach().numpy() for n, p in reference.named_parameters()}
    assert ours.keys() == theirs.keys()
    moved = max(np.abs(theirs[n] - before[n]).max() / np.abs(theirs[n]).max() for n in theirs)
    assert moved > 100 * TOLERANCE  # training changed the weights far beyond the tolerance
    for name, value in theirs.items():
        difference = np.abs(compared(name, ours[name]) - compared(name, value)).max(initial=0) / np.abs(value).max()
        assert difference <= TOLERANCE, f"{name}: max |ours - torch| is {difference:.2e} of max |torch|"

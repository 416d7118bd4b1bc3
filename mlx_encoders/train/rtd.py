"""ELECTRA's replaced-token detection (Clark et al. 2020; google-research/electra `run_pretraining.py`).

A small masked-LM generator fills the masked positions with tokens sampled from its softmax (no gradient flows
through the sampling); the discriminator (`ElectraForPreTraining`) reads the result and scores every real token
as replaced or original, a sample equal to the original counting as original. The loss is the generator's
masked-LM loss + `discriminator_weight` (50) x the discriminator's BCE over real tokens. The two share one
embedding module (word, position and token-type tables and their LayerNorm, as ELECTRA's shared
`embedding_scope` does), held by the discriminator; the generator's `embeddings_project` maps it to its width.
Masking is ELECTRA's: 15% of the real tokens, 85% of those become [MASK], the rest stay (`rtd_masker`).
"""

import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..checkpoint.atomic import atomic_folder
from ..checkpoint.build import load_model
from ..checkpoint.write import model_config, write_checkpoint
from ..engine.ops import drawing_from, next_key
from ..models.base import padding_mask
from ..models.electra import ElectraForMaskedLM, ElectraForPreTraining, ModelArgs
from ..tokenizer import Tokenizer
from .data import Examples, collate
from .losses import IGNORE_INDEX, cross_entropy, replaced_token_loss
from .masking import Masker
from .objective import HeadObjective, OwnFormat
from .tasks import RTD as TASK

DISCRIMINATOR_FOLDER, GENERATOR_FOLDER = "discriminator", "generator"
GENERATOR_SIZE, DISCRIMINATOR_WEIGHT = 0.25, 50.0  # ELECTRA's defaults: a generator 1/4 as wide, lambda 50
METRICS = (
    "eval_loss", "eval_generator_loss", "eval_discriminator_loss", "eval_generator_accuracy",
    "eval_discriminator_accuracy", "eval_precision", "eval_recall", "eval_replacement_rate",
)  # fmt: skip


def rtd_masker(tokenizer: Tokenizer, whole_word: bool = False) -> Masker:
    """ELECTRA's masking (`pretrain_helpers.mask`): 15% of the real tokens (or words), 85% of them [MASK], no
    random tokens (the generator's samples are the replacements)."""
    return Masker.from_tokenizer(tokenizer, whole_word=whole_word, mask_fraction=0.85, random_fraction=0.0)


def generator_args(discriminator: ModelArgs, size: float) -> ModelArgs:
    """ELECTRA's `get_generator_config`: the discriminator's config with a hidden width of round(`size` x its
    own), a feed-forward 4 x that, and hidden // 64 heads (at least one; fewer where they would not divide the
    width); the embeddings, shared, keep their width."""
    if not 0 < size <= 1:
        raise ValueError(f"generator_size must be a fraction in (0, 1] of the discriminator's width, got {size!r}")
    hidden = max(1, round(discriminator.hidden_size * size))
    heads = next(n for n in range(max(1, hidden // 64), 0, -1) if hidden % n == 0)
    sizes = dict(hidden_size=hidden, num_attention_heads=heads, intermediate_size=4 * hidden)
    return ModelArgs.from_dict({**discriminator.to_config(), **sizes})


def start_at_base_rate(discriminator: nn.Module, masker: Masker) -> None:
    """A new discriminator's output bias at the log-odds of a real token being replaced at the start (the masking
    probability: an untrained generator's samples almost never equal the original), as RetinaNet starts its
    classifier at the prior. From a zero bias the first steps learn that base rate through the hidden states,
    pushing one shared direction into every token's; in short runs the top layer's tokens then end almost alike
    (benchmarks/RESULTS.md, ELECTRA pretraining against masked-LM)."""
    p = masker.probability
    head = discriminator.discriminator_predictions.dense_prediction
    head.bias = mx.full(head.bias.shape, math.log(p / (1 - p)))


def check_pair(discriminator: nn.Module, generator: nn.Module) -> None:
    """The generator can read the discriminator's embeddings and predict its vocabulary."""
    if not (isinstance(discriminator, ElectraForPreTraining) and isinstance(generator, ElectraForMaskedLM)):
        raise ValueError(
            "Replaced-token detection trains an ElectraForPreTraining discriminator with an ElectraForMaskedLM "
            f"generator, got {type(discriminator).__name__} and {type(generator).__name__}"
        )
    keys = ("vocab_size", "embedding_size", "max_position_embeddings", "type_vocab_size")
    differ = [k for k in keys if getattr(discriminator.args, k) != getattr(generator.args, k)]
    if differ:
        found = ", ".join(f"{k} {getattr(generator.args, k)} vs {getattr(discriminator.args, k)}" for k in differ)
        raise ValueError(
            f"The generator cannot share the discriminator's embeddings: {found} (generator vs discriminator); "
            "give a generator of the same vocabulary, embedding width and position table"
        )


class ReplacedTokenDetection(nn.Module):
    """The discriminator and the generator trained together (`trainer.train` runs it through the methods below:
    `loss_arrays`, `batch_loss`, `evaluate`, `metric_names`, `write_checkpoint`, `read_checkpoint`). The generator
    given gives up its embeddings: it reads the discriminator's."""

    task = TASK  # what `trainer.train` names it in errors

    def __init__(
        self,
        discriminator: nn.Module,
        generator: nn.Module,
        discriminator_weight: float = DISCRIMINATOR_WEIGHT,
        share_embeddings: bool = True,
    ):
        check_pair(discriminator, generator)
        super().__init__()
        self.discriminator, self.generator = discriminator, generator
        self.share_embeddings = share_embeddings
        if share_embeddings:
            del generator.electra["embeddings"]  # held once, by the discriminator: one gradient from both parts
        self.discriminator_weight = discriminator_weight

    @property
    def embeddings(self) -> nn.Module:
        return self.discriminator.electra.embeddings

    @property
    def generator_embeddings(self) -> nn.Module:
        return self.embeddings if self.share_embeddings else self.generator.electra.embeddings

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None):
        return self.discriminator(input_ids, attention_mask, token_type_ids)  # what the trainer checks inputs on

    def gradient_checkpointing_enable(self) -> None:
        self.discriminator.gradient_checkpointing_enable()
        self.generator.gradient_checkpointing_enable()

    def generator_logits(self, input_ids, attention_mask, token_type_ids, masked: mx.array) -> mx.array:
        """(M, V) vocabulary logits at the `masked` flat positions (ElectraForMaskedLM over the shared embeddings)."""
        electra, embeddings = self.generator.electra, self.generator_embeddings
        x = embeddings(input_ids, token_type_ids)
        if "embeddings_project" in electra:
            x = electra.embeddings_project(x)
        hidden = electra.encoder(x, padding_mask(attention_mask, x.dtype))
        hidden = hidden.reshape(-1, hidden.shape[-1])[masked]
        head = self.generator.generator_predictions(hidden)
        return self.generator.generator_lm_head(head, embeddings.word_embeddings)

    def losses(self, inputs: dict[str, mx.array], labels: dict[str, mx.array]) -> dict[str, mx.array]:
        """The losses and what the metrics count: `labels` holds `original` (B, L) ids, `masked` (the flat masked
        positions) and optionally `sampled` (the generator's tokens there, drawn here when absent)."""
        original, masked, types = labels["original"], labels["masked"], inputs.get("token_type_ids")
        logits = self.generator_logits(inputs["input_ids"], inputs["attention_mask"], types, masked)
        targets = original.reshape(-1)[masked]
        sampled = labels.get("sampled")
        if sampled is None:
            sampled = mx.random.categorical(logits.astype(mx.float32), key=next_key())
        corrupted = original.reshape(-1)
        corrupted[masked] = mx.stop_gradient(sampled).astype(corrupted.dtype)
        corrupted = corrupted.reshape(original.shape)
        replaced = (corrupted != original).astype(mx.int32)
        real = inputs["attention_mask"].astype(mx.bool_)
        scores = self.discriminator(corrupted, inputs["attention_mask"], types).logits
        generator_loss = cross_entropy(logits, targets)
        discriminator_loss = replaced_token_loss(scores, mx.where(real, replaced, IGNORE_INDEX))
        return {
            "loss": generator_loss + self.discriminator_weight * discriminator_loss,
            "generator_loss": generator_loss,
            "discriminator_loss": discriminator_loss,
            "generator_right": (logits.argmax(-1) == targets).sum(),
            "replaced": replaced,
            "flagged": scores > 0,  # sigmoid > 1/2
            "real": real,
        }

    # ----- what `RTDObjective` calls -----

    def loss_arrays(self, batch: dict[str, np.ndarray]) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
        """(inputs, labels) of a masked batch: the generator's (masked) inputs; the original ids and the masked
        (flat) positions."""
        selected = batch["labels"] != IGNORE_INDEX
        original = np.where(selected, batch["labels"], batch["input_ids"])
        inputs = {k: mx.array(v) for k, v in batch.items() if k != "labels"}
        labels = {"original": mx.array(original), "masked": mx.array(np.flatnonzero(selected.reshape(-1)))}
        return inputs, labels

    def batch_loss(self, inputs: dict[str, mx.array], labels: dict[str, mx.array]) -> mx.array:
        return self.losses(inputs, labels)["loss"]

    def evaluate(
        self, tokenizer: Tokenizer, examples: Examples, batch_size: int, seed: int, masker: Masker
    ) -> dict[str, float]:
        """The mean losses: the generator's over the masked tokens (as the masked-LM's eval_loss), the
        discriminator's over real tokens, and their weighted sum; the generator's accuracy on the masked tokens; the
        discriminator's accuracy on real tokens, its precision and recall on the replaced ones (0 when it flags none,
        or none was replaced); the share of real tokens replaced. Masks and samples come from `seed`, the same at
        every evaluation."""
        self.eval()
        rng = np.random.default_rng(seed)
        sums = dict.fromkeys(("generator_loss", "discriminator_loss"), 0.0)
        counts = dict.fromkeys(("real", "masked", "generator_right", "right", "replaced", "flagged", "caught"), 0)
        with drawing_from([mx.random.key(seed)]):
            for start in range(0, len(examples), batch_size):
                batch = collate(examples, range(start, min(start + batch_size, len(examples))), tokenizer, masker, rng)
                inputs, labels = self.loss_arrays(batch)
                out = self.losses(inputs, labels)
                real = np.array(out["real"])
                replaced, flagged = np.array(out["replaced"]).astype(bool)[real], np.array(out["flagged"])[real]
                sums["generator_loss"] += out["generator_loss"].item() * labels["masked"].size
                sums["discriminator_loss"] += out["discriminator_loss"].item() * int(real.sum())
                counts["real"] += int(real.sum())
                counts["masked"] += labels["masked"].size
                counts["generator_right"] += out["generator_right"].item()
                counts["right"] += int((replaced == flagged).sum())
                counts["replaced"] += int(replaced.sum())
                counts["flagged"] += int(flagged.sum())
                counts["caught"] += int((replaced & flagged).sum())
        n = counts["real"]
        generator, discriminator = ratio(sums["generator_loss"], counts["masked"]), ratio(sums["discriminator_loss"], n)
        return {
            "eval_loss": generator + self.discriminator_weight * discriminator,
            "eval_generator_loss": generator,
            "eval_discriminator_loss": discriminator,
            "eval_generator_accuracy": ratio(counts["generator_right"], counts["masked"]),
            "eval_discriminator_accuracy": ratio(counts["right"], n),
            "eval_precision": ratio(counts["caught"], counts["flagged"], 0.0),
            "eval_recall": ratio(counts["caught"], counts["replaced"], 0.0),
            "eval_replacement_rate": ratio(counts["replaced"], n),
        }

    @staticmethod
    def metric_names() -> list[str]:
        return list(METRICS)

    @contextmanager
    def parts(self) -> Iterator[tuple[nn.Module, nn.Module]]:
        """(discriminator, generator), the generator holding the shared embeddings for the time of the block, as a
        checkpoint of it holds them."""
        if not self.share_embeddings:
            yield self.discriminator, self.generator
            return
        self.generator.electra.embeddings = self.embeddings
        try:
            yield self.discriminator, self.generator
        finally:
            del self.generator.electra["embeddings"]

    def write_checkpoint(self, folder: Path, tokenizer: Tokenizer | None = None) -> None:
        """`discriminator/` and `generator/` in `folder`: checkpoints that transformers' ElectraForPreTraining and
        ElectraForMaskedLM (and every mlx_encoders front end) load."""
        with self.parts() as models:
            for name, model in zip((DISCRIMINATOR_FOLDER, GENERATOR_FOLDER), models, strict=True):
                write_checkpoint(model, model_config(model), Path(folder) / name)
                if tokenizer is not None:
                    tokenizer.save(Path(folder) / name)

    def read_checkpoint(self, folder: Path) -> None:
        """The weights of `folder`'s `discriminator/` and `generator/`, each checked against this pair's."""
        with self.parts() as models:
            loaded = {}
            for name, model in zip((DISCRIMINATOR_FOLDER, GENERATOR_FOLDER), models, strict=True):
                saved = dict(tree_flatten(load_model(Path(folder) / name, task=task_name(model)).parameters()))
                current = dict(tree_flatten(model.parameters()))
                for key, value in current.items():
                    if key not in saved or saved[key].shape != value.shape:
                        found = "missing" if key not in saved else f"of shape {tuple(saved[key].shape)}"
                        raise ValueError(
                            f"{Path(folder) / name}: {key} is {found}, but this run's {name} has "
                            f"{tuple(value.shape)}; resume with the sizes of the run that wrote it"
                        )
                loaded[name] = tree_unflatten(list(saved.items()))
            self.discriminator.update(loaded[DISCRIMINATOR_FOLDER])
            self.generator.update(loaded[GENERATOR_FOLDER])  # its embeddings equal the discriminator's: both saved

    def save(self, folder: str | Path, tokenizer: Tokenizer, overwrite: bool = False) -> Path:
        """`folder/discriminator` and `folder/generator`, each a checkpoint with the tokenizer, written atomically
        as a pair (as `trainer.save_checkpoint` writes checkpoints): on any error the previous pair (if any) stays
        whole, never a new discriminator beside an old generator. Returns the discriminator's folder."""
        parts = (DISCRIMINATOR_FOLDER, GENERATOR_FOLDER)
        with atomic_folder(Path(folder), overwrite, whole=False, parts=parts) as tmp:
            self.write_checkpoint(tmp, tokenizer)
        return Path(folder) / DISCRIMINATOR_FOLDER


def task_name(model: nn.Module) -> str:
    return "pretraining" if isinstance(model, ElectraForPreTraining) else "masked-lm"


def ratio(part: int, whole: int, undefined: float = math.nan) -> float:
    """part / whole; precision and recall of no predictions count 0, as scikit-learn's do."""
    return part / whole if whole else undefined


class RTDObjective(OwnFormat, HeadObjective):
    """ELECTRA's objective for `trainer.train`: the pair's own loss arrays, loss (generator plus weighted
    discriminator), evaluation and checkpoints (`ReplacedTokenDetection`); one process only."""

    distributed = False

    def task(self, examples: Examples) -> str:
        return TASK

    def loss_arrays(self, model: ReplacedTokenDetection, batch: dict[str, np.ndarray]) -> tuple[dict, dict]:
        return model.loss_arrays(batch)

    def batch_loss(self, model: ReplacedTokenDetection, inputs: dict, labels: dict) -> mx.array:
        return model.batch_loss(inputs, labels)

    def evaluate(self, model: ReplacedTokenDetection, examples: Examples, batch_size: int) -> dict[str, float]:
        return model.evaluate(self.tokenizer, examples, batch_size, self.config.seed, self.masker)

    def write_weights(self, model: ReplacedTokenDetection, folder: Path) -> None:
        """Each part with the tokenizer: a checkpoint's discriminator/ loads and fine-tunes as the final one does."""
        model.write_checkpoint(folder, self.tokenizer)

    def metric_names(self, examples: Examples) -> list[str]:
        return list(METRICS)

"""`fine_tune("rtd")`: ELECTRA's replaced-token detection (`train/rtd.py`): the discriminator (`model=` or new from
`config=`) and a generator (`generator=`, else a new one `generator_size` as wide) trained together; saved as
`output_dir/model/discriminator` and `output_dir/model/generator`."""

import warnings
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace

from ...checkpoint.build import load_model
from ...checkpoint.files import Checkpoint
from ...errors import outside_stacklevel
from ...tokenizer import Tokenizer
from ..config import OptionError, Trained
from ..data import masked_lm_data
from ..options import Data
from ..rtd import ReplacedTokenDetection, RTDObjective, generator_args, rtd_masker, start_at_base_rate
from . import RTD as TASK
from .heads import from_config, read_config, train_head

SMALL_LR = 5e-4  # ELECTRA-Small's learning rate: above it, a lower rate is advised


def train_task(data: Data, run: SimpleNamespace) -> Trained:
    if run.lora_rank:
        raise OptionError(
            "rtd trains every weight of the generator and the discriminator: drop lora_rank (--lora-rank)"
        )

    def read(data, tokenizer, label2id, seed):
        return masked_lm_data(data, tokenizer, text_column=run.text_column or "text", max_length=run.max_length)

    def build(checkpoint, tokenizer, examples):
        return rtd_pair(
            checkpoint, run.config, tokenizer, run.generator, run.generator_size, run.discriminator_weight,
            run.share_embeddings,
        )  # fmt: skip

    def save_pair(model, path, tokenizer):  # the discriminator is the model to fine-tune; the generator beside it
        return model.save(path, tokenizer, overwrite=True), model.discriminator

    def objective(examples, tokenizer):
        return RTDObjective(tokenizer, run.training, TASK, rtd_masker(tokenizer, run.whole_word_mask))

    trained = train_head(
        TASK, data, run, read, build=build, objective=objective, own_metrics=True, save_model=save_pair
    )
    warn_if_nothing_flagged(trained.metrics, run.training.lr)
    return trained


def warn_if_nothing_flagged(metrics: Mapping[str, float], lr: float) -> None:
    """The last evaluation's discriminator scores no replaced token above 1/2: the run ends without error, yet its
    encoder learned little (at lr 1e-3 the 4-layer example's top-layer tokens end alike); say so."""
    if metrics.get("eval_recall") == 0.0 and metrics.get("eval_replacement_rate", 0.0) > 0:
        lower = f", or with a lower learning rate than lr={lr:g} (ELECTRA-Small's: 5e-4)" if lr > SMALL_LR else ""
        warnings.warn(
            f"rtd: the discriminator flags none of the eval set's replaced tokens (recall 0, accuracy "
            f"{metrics['eval_discriminator_accuracy']:.3f}: the share left original), so the encoder it gives learned "
            f"little; train longer{lower}",
            UserWarning,
            stacklevel=outside_stacklevel(),
        )


def rtd_pair(
    checkpoint: Checkpoint | None,
    config: str | Path | Mapping | None,
    tokenizer: Tokenizer,
    generator: str | Path | None,
    size: float,
    weight: float,
    share: bool = True,
) -> ReplacedTokenDetection:
    """The discriminator (from `checkpoint` or new, of `config`'s sizes) and the generator (from its checkpoint, or
    new at `size` x the discriminator's width), sharing the discriminator's embeddings (unless not `share`)."""
    if checkpoint is None:
        settings = {"model_type": "electra", **read_config(config)}
        if settings["model_type"] != "electra":
            raise ValueError(f"rtd trains ELECTRA models; config= has model_type {settings['model_type']!r}")
        discriminator = from_config(settings, "pretraining", tokenizer)
        start_at_base_rate(discriminator, rtd_masker(tokenizer))
    else:
        discriminator = load_model(checkpoint, dtype="float32", task="pretraining")
    if generator is not None:
        part = load_model(generator, dtype="float32", task="masked-lm")
    else:
        part = from_config(generator_args(discriminator.args, size).to_config(), "masked-lm", tokenizer)
    return ReplacedTokenDetection(discriminator, part, weight, share)

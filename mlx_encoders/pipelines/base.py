"""Shared machinery of the task pipelines: loading the right head, call options, padding encodings and batching.

Mirrors the parts of transformers' `Pipeline` (pipelines/base.py) that change results: inputs are
tokenized one by one, then run through the model with right padding by the engine's batching runner (results do
not depend on the batching beyond float rounding); keywords given
at construction are the defaults of every call, and a call's own keywords (and `batch_size`) override them.
"""

import inspect
from collections.abc import Iterator, Sequence
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from tokenizers import Encoding

from ..checkpoint import Checkpoint, resolve
from ..engine.batching import run_batches
from ..engine.threads import on_own_thread
from ..models import architecture_name, model_class, model_module
from ..tokenizer import Tokenizer, check_count, text_list, token_limit

# The pipeline task each stored head serves (a bare encoder, like a discriminator, feature extraction: `served_task`).
HEAD_TASKS = {
    "encoder": "feature-extraction",
    "masked-lm": "fill-mask",
    "pretraining": "fill-mask",
    "sequence-classification": "text-classification",
    "token-classification": "token-classification",
    "question-answering": "question-answering",
    "causal-lm": "text-generation",
}
# The command-line subcommand of a task, where one exists (`python -m mlx_encoders --help`).
COMMANDS = {
    "feature-extraction": "embed", "fill-mask": "fill-mask", "text-classification": "classify",
    "token-classification": "tokens", "question-answering": "answer", "text-generation": "generate",
}  # fmt: skip
# transformers' tokenizer keywords with a meaning for one text at a time; padding only changes batching, which
# the pipelines do themselves, so it is taken and changes nothing (as in transformers' results).
TOKENIZER_KEYWORDS = ("truncation", "max_length", "padding")
TRUNCATIONS = (True, False, "longest_first", "only_first", "only_second", "do_not_truncate")


def batches(items: Sequence, batch_size: int) -> Iterator[Sequence]:
    check_count("batch_size", batch_size, 1)
    for start in range(0, len(items), batch_size):
        yield items[start : start + batch_size]


def to_numpy(x: mx.array) -> np.ndarray:
    """Float outputs as float32 numpy (transformers' pipelines also upcast half precision first)."""
    return np.array(x.astype(mx.float32)) if mx.issubdtype(x.dtype, mx.floating) else np.array(x)


class Pipeline:
    """A model with the head a task needs, its tokenizer, `batch_size` for lists of inputs, the MLX device it
    runs on, and default keywords for every call (`pipeline("fill-mask", model=..., top_k=3)`)."""

    task = ""
    head = ""  # the models/ task name of the head this pipeline runs

    def __init__(
        self, model: nn.Module, tokenizer: Tokenizer, batch_size: int = 8, device: mx.Device | None = None, **defaults
    ):
        self.check(model)
        check_count("batch_size", batch_size, 1)
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.device = device or mx.default_device()
        self.defaults = self.options(defaults)

    @on_own_thread
    def __call__(self, *args, batch_size: int | None = None, **options):
        """Run the task on the inputs (see `predict` for its keywords); keywords not given here take the values
        given at construction, and `batch_size` (inputs per forward pass) the pipeline's."""
        batch_size = self.batch_size if batch_size is None else batch_size
        check_count("batch_size", batch_size, 1)
        # a keyword given as None is not given (transformers' `_sanitize_parameters`): the pipeline's default holds
        given = {k: v for k, v in options.items() if v is not None or k in self.none_is_a_value}
        options = {**self.defaults, **self.options(given)}
        with mx.stream(self.device):
            return self.predict(*args, batch_size=batch_size, **options)

    none_is_a_value: tuple[str, ...] = ()  # keywords whose None means something (text classification's top_k)

    def predict(self, inputs, *, batch_size: int):
        raise NotImplementedError

    def options(self, given: dict) -> dict:
        """`given` keywords, checked against those `predict` takes (a TypeError naming them all otherwise)."""
        parameters = inspect.signature(self.predict).parameters.values()
        if any(p.kind is p.VAR_KEYWORD for p in parameters):  # e.g. text generation's GenerationConfig fields
            return given
        names = [p.name for p in parameters if p.name != "batch_size"]
        unknown = [name for name in given if name not in names]
        if unknown:
            raise TypeError(
                f"The {self.task!r} pipeline got an unexpected keyword argument {unknown[0]!r}; it takes "
                f"{', '.join(names)} and batch_size"
            )
        return given

    def check(self, model: nn.Module) -> None:
        check_head(model, self.task, self.head)

    @property
    def max_length(self) -> int:
        """The longest window the model takes: the tokenizer's limit, capped by the position table."""
        return token_limit(self.tokenizer, self.model.args.max_tokens)

    @property
    def id2label(self) -> dict[int, str]:
        return self.model.args.id2label

    def run(self, batch: dict[str, mx.array]):
        return self.model(
            batch["input_ids"], attention_mask=batch["attention_mask"], token_type_ids=batch.get("token_type_ids")
        )

    def forward(
        self, encodings: Sequence[Encoding], batch_size: int | None = None, fields: Sequence[str] = ("logits",),
        per_token: bool = True,
    ) -> list[list[np.ndarray]]:  # fmt: skip
        """Run encodings through the model (`run_batches`); per encoding, in input order, the numpy value of each
        ModelOutput field in `fields`, cut back to the encoding's own length when `per_token`."""
        results: list[list[np.ndarray]] = [[] for _ in encodings]

        def forward(rows: np.ndarray) -> list[mx.array]:
            out = self.run(self.tokenizer.pad([encodings[i] for i in rows]))
            return [getattr(out, name) for name in fields]

        def collect(rows: np.ndarray, arrays: list[mx.array]) -> None:
            values = [to_numpy(a) for a in arrays]
            for row, i in enumerate(rows):
                if per_token:  # the row's own tokens, on either padding side
                    results[i] = [v[row, self.tokenizer.real_tokens(len(encodings[i].ids), v.shape[1])] for v in values]
                else:
                    results[i] = [v[row] for v in values]

        self.run_batches(encodings, forward, collect, batch_size)
        return results

    def run_batches(self, encodings: Sequence[Encoding], forward, collect, batch_size: int | None = None) -> None:
        """`collect(rows, forward(rows))` over `encodings` through the engine's batching runner (longest first,
        cache-sized slices on every core of the CPU), `batch_size` (default the pipeline's) at a time."""
        batch_size = batch_size or self.batch_size
        check_count("batch_size", batch_size, 1)
        run_batches(self.model, [len(e.ids) for e in encodings], forward, collect, batch_size)

    def texts(self, inputs) -> list[str]:
        """A str or a list of str as a non-empty list; a TypeError naming the first item that is not a str."""
        texts = text_list(inputs, f"The {self.task!r} pipeline")
        if not texts:
            raise ValueError(f"{self.task} needs at least one input: a text or a non-empty list of texts")
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(
                    f"The {self.task!r} pipeline takes strings; item {i} is {type(text).__name__}: {text!r:.60}"
                )
        return texts

    def encode(
        self, texts: Sequence, text_pairs: Sequence | None = None, truncation: bool | str = True,
        max_length: int | None = None, is_split_into_words: bool = False, direction: str | None = None,
    ) -> list[Encoding]:  # fmt: skip
        """Encodings truncated to `max_length` (default the model's length) at the tokenizer's `truncation_side`,
        or at `direction`'s end ("left", "right"); without truncation, one longer than the position table fails."""
        if truncation not in TRUNCATIONS:
            raise ValueError(f"Unknown truncation {truncation!r}; choose one of {TRUNCATIONS}")
        if max_length is not None:
            check_count("max_length", max_length, 1)
        truncation = truncation if truncation != "do_not_truncate" else False
        length = max_length or self.max_length
        encodings = self.tokenizer.encode_batch(
            texts, text_pairs, truncation, length, is_split_into_words=is_split_into_words, direction=direction
        )
        limit = self.model.args.max_tokens
        for i, (text, e) in enumerate(zip(texts, encodings, strict=True)):
            if not e.ids:
                raise ValueError(f"Input {text!r} produced no tokens; pass a non-empty text")
            if limit and len(e.ids) > limit:
                asks = "a max_length of at most" if truncation and max_length and max_length > limit else None
                raise ValueError(
                    f"Item {i} has {len(e.ids)} tokens, more than the model's {limit}; "
                    + (f"pass {asks} {limit}" if asks else "pass truncation=True")
                    + (
                        f" and a max_length of at most {limit}"
                        if not asks and max_length and max_length > limit
                        else ""
                    )
                )
        return encodings


def tokenizer_options(options: dict | None, name: str = "tokenizer_kwargs") -> dict:
    """transformers' `tokenizer_kwargs` as `encode` keywords; a TypeError for one without a meaning here."""
    options = dict(options or {})
    unknown = [key for key in options if key not in TOKENIZER_KEYWORDS]
    if unknown:
        raise TypeError(f"{name} takes {', '.join(TOKENIZER_KEYWORDS)}; got {unknown[0]!r}")
    options.pop("padding", None)
    return options


def article(word: str) -> str:
    return f"{'an' if word[0] in 'aeiou' else 'a'} {word}"


def served_task(head: str, cls: type) -> str:
    """The pipeline task a `head` of class `cls` serves; a discriminator (ELECTRA's pretraining head), which
    predicts no words, only feature extraction, as a bare encoder."""
    return HEAD_TASKS["encoder"] if getattr(cls, "discriminator", False) else HEAD_TASKS.get(head, "?")


def supported(head: str, cls: type) -> str:
    """The pipeline task a head serves, and its command-line subcommand: "the 'feature-extraction' task
    (`mlx-encoders embed` on the command line)"."""
    if head == "causal-lm" and not hasattr(cls, "make_cache"):  # next-token logits without generation (Qwen3)
        reranker = " (`CrossEncoder` scores a Qwen3-Reranker folder with them)" if "Qwen3" in cls.__name__ else ""
        return f"next-token logits only, no text generation{reranker}"
    task = served_task(head, cls)
    command = f" (`mlx-encoders {COMMANDS[task]}` on the command line)" if task in COMMANDS else ""
    return f"the {task!r} task{command}"


def check_not_discriminator(task: str, head: str, cls: type, model_type: str, path: Path | None) -> None:
    """A task that needs a masked-LM head fails on a discriminator, which a pretraining checkpoint may be (ELECTRA's),
    naming the generator to use instead."""
    if head == "masked-lm" and getattr(cls, "discriminator", False):
        source = f" from {path}" if path else ""
        raise ValueError(
            f"The {task!r} pipeline needs a head that predicts words, but {cls.__name__}{source} is a discriminator: "
            f"it predicts which tokens were replaced, not words. Use the generator checkpoint "
            f"({architecture_name(model_type, head)}) for {task}."
        )


def check_head(model: nn.Module, task: str, head: str) -> None:
    """Fail with the head the model has and the task it serves when it lacks the one `task` needs."""
    module = model_module(model.args.model_type)
    path = getattr(model, "path", None)
    check_not_discriminator(task, head, type(model), model.args.model_type, path)
    if isinstance(model, module.MODELS.get(head, ())):
        return
    have = next((name for name, cls in module.MODELS.items() if type(model) is cls), type(model).__name__)
    source = f" from {path}" if path else ""
    raise ValueError(
        f"The {task!r} pipeline needs {article(head)} head, but {type(model).__name__}{source} has {article(have)} "
        f"head, which supports {supported(have, type(model))}. Use a checkpoint fine-tuned for {task}."
    )


def load_for(
    task: str, head: str, model, accepted: Sequence[str], dtype: str | None = None,
    tokenizer: Tokenizer | str | Path | None = None, revision: str | None = None,
) -> tuple[nn.Module, Tokenizer]:  # fmt: skip
    """(model, tokenizer) from a path / hub id (loading the `head` the task needs), a loaded model, or a loaded
    (model, tokenizer) pair; `tokenizer` (a Tokenizer, or a folder / hub id holding one) replaces the model's own."""
    from .. import load_model, load_tokenizer

    own = None
    if isinstance(model, (tuple, list)):
        model, own = model
    elif not isinstance(model, nn.Module):
        checkpoint = Checkpoint.open(model, revision)
        # the bare encoder of any checkpoint, whatever head it names (one not implemented here too)
        try:
            have = head if head == "encoder" else checkpoint.task
        except ValueError as unknown:  # a head not implemented here (AlbertForPreTraining) may hold the task's
            return head_of_unknown(checkpoint, head, dtype, tokenizer, revision, unknown)
        stored = model_class(checkpoint.model_type, have)
        check_not_discriminator(task, head, stored, checkpoint.model_type, checkpoint.path)
        if have not in accepted:
            architecture = (checkpoint.config.get("architectures") or ["a bare encoder"])[0]
            raise ValueError(
                f"The {task!r} pipeline needs {article(head)} head, but {checkpoint.path} holds {architecture} "
                f"({article(have)} head), which supports {supported(have, stored)}. Use a checkpoint fine-tuned for "
                f"{task}."
            )
        model = load_model(checkpoint, dtype=dtype, task=head)
        own = load_tokenizer(model, checkpoint) if tokenizer is None else None
    return model, chosen_tokenizer(model, own, tokenizer, revision)


def chosen_tokenizer(model: nn.Module, own: Tokenizer | None, tokenizer, revision: str | None) -> Tokenizer:
    """`tokenizer` (a Tokenizer, or a folder / hub id holding one) where given, else the model's `own`."""
    from .. import load_tokenizer

    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    if tokenizer is not None:
        return load_tokenizer(model, resolve(tokenizer, revision))
    return own or load_tokenizer(model)


def head_of_unknown(checkpoint: Checkpoint, head: str, dtype, tokenizer, revision, unknown: ValueError):
    """The `head` a task needs from a checkpoint whose named head is not implemented here, as transformers'
    pipelines load their Auto class from any checkpoint: refused with `unknown` where its weights are not stored."""
    from .. import load_model, load_tokenizer

    try:
        model = load_model(checkpoint, dtype=dtype, task=head)
    except ValueError as missing:
        raise unknown from missing
    own = load_tokenizer(model, checkpoint) if tokenizer is None else None
    return model, chosen_tokenizer(model, own, tokenizer, revision)

"""Pieces shared by every encoder: config base class, outputs, masks, attention and common heads.

The math follows Hugging Face transformers (`modeling_bert.py` and friends); see
`shared/ARCHITECTURES.md` for the per-architecture facts each model file relies on.
"""

import dataclasses
import inspect
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn

from ..engine.quantized import QuantizedLinear
from .layers import Dropout, Linear, attention, drawing_from, drawing_state, gelu, gelu_tanh, silu

# Keys whose value must be a positive count (each architecture uses its own subset).
POSITIVE_KEYS = (
    "vocab_size", "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers", "dim", "n_heads",
    "hidden_dim", "n_layers", "embedding_size", "num_hidden_groups", "inner_group_num", "max_position_embeddings",
    "local_attention", "global_attn_every_n_layers",
)  # fmt: skip
# config.json's `problem_type` values, as transformers names them; `infer_problem_type` picks one when it is unset.
PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")
ACTIVATION_KEYS = ("hidden_act", "activation", "hidden_activation", "classifier_activation")
# config.json's dtype notes (transformers 5 `dtype`, 4.x `torch_dtype`): loading reads the stored tensors' own.
DTYPE_KEYS, DTYPE_NAMES = ("dtype", "torch_dtype"), ("float32", "float16", "bfloat16", "float64")


def fits(value: Any, hint: Any) -> bool:
    """Whether a JSON value has the annotated type (an int counts as a float; a bool is not a number)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(fits(value, h) for h in typing.get_args(hint))
    hint = typing.get_origin(hint) or hint
    if hint is type(None):
        return value is None
    if isinstance(value, bool):
        return hint is bool
    if hint is float:
        return isinstance(value, (int, float))
    return isinstance(value, hint)


def label_ids(mapping: dict, name: str) -> dict[int, str]:
    """`id2label` with integer ids 0..N-1 (config.json stores them as strings)."""
    try:
        id2label = {int(i): str(label) for i, label in mapping.items()}
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must map integer label ids to names, got {mapping!r}") from e
    if sorted(id2label) != list(range(len(id2label))):
        raise ValueError(f"{name}: label ids must be 0..{len(id2label) - 1}, got {sorted(id2label)}")
    return id2label


def infer_problem_type(configured: str | None, num_labels: int, integer_labels: bool) -> str:
    """The config's `problem_type`, else the one transformers' `ForSequenceClassification` infers from the labels:
    regression for a single label, single-label classification for integer labels, multi-label for float ones."""
    if configured is not None:
        return configured
    if num_labels == 1:
        return "regression"
    return "single_label_classification" if integer_labels else "multi_label_classification"


def type_name(hint: Any) -> str:
    return str(hint).replace("typing.", "") if typing.get_origin(hint) else hint.__name__


@dataclass
class BaseArgs:
    """Fields every config.json may carry; subclasses add the architecture's own names.

    `from_dict` checks each known key's type and keeps the unknown ones in `extra`, so `to_config` writes
    back every key it read. Values that cannot work fail here, at load, naming the key.
    """

    model_type: str = ""
    id2label: dict[int, str] | None = None
    problem_type: str | None = None
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    signed_keys: ClassVar[tuple[str, ...]] = ()  # integer keys where a negative value means "unset" (DeBERTa's -1)
    # Published sizes by name ("base", ...) as config.json keys; a subclass does not inherit its parent's.
    presets: ClassVar[dict[str, dict[str, Any]]] = {}
    # Decoders whose transformers masks follow config.json's `is_causal` (false: bidirectional, sliding windows too)
    causal_masks: ClassVar[bool] = False
    # Whether the heads split the width: False where the projections are heads x head size, the head size
    # `head_dim` or, without it, hidden_size // heads (Nomic BERT, GTE, jina-v3), so any width is a valid model.
    heads_split_width: ClassVar[bool] = True
    # Whether a text's outputs depend on how far its batch is padded (dynamic-NTK rope: the base follows the length)
    padded_length_matters: ClassVar[bool] = False

    @classmethod
    def preset(cls, name: str) -> "BaseArgs":
        """The args of a published size of this architecture: `bert.ModelArgs.preset("base")` is bert-base."""
        presets = cls.__dict__.get("presets", {})
        if name not in presets:
            raise ValueError(
                f"{cls.__module__.rsplit('.', 1)[-1]} has no preset {name!r}; presets: {', '.join(presets) or 'none'}"
            )
        return cls.from_dict({"model_type": cls.model_type, **presets[name]})

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "BaseArgs":
        hints = typing.get_type_hints(cls)
        known = {}
        for f in dataclasses.fields(cls):
            value = config.get(f.name)
            if value is None:  # absent, or JSON null: transformers' default
                continue
            if not fits(value, hints[f.name]):
                raise ValueError(
                    f"config key {f.name!r} must be {type_name(hints[f.name])}, got {type(value).__name__} {value!r}"
                )
            known[f.name] = value
        for key in DTYPE_KEYS:
            if config.get(key) is not None and config[key] not in DTYPE_NAMES:
                raise ValueError(f"config key {key!r} must be one of {', '.join(DTYPE_NAMES)}, got {config[key]!r}")
        if cls.causal_masks and config.get("is_causal") is False:
            raise ValueError(
                f"config key 'is_causal' is false: transformers then runs {cls.model_type} with bidirectional "
                "attention masks, which this package does not; it runs the model's own (causal or sliding) attention"
            )
        if "id2label" not in known and isinstance(config.get("num_labels"), int):  # transformers reads it too
            known["id2label"] = {i: f"LABEL_{i}" for i in range(config["num_labels"])}
        args = cls(**known)
        derived = {"num_labels", "_num_labels", "label2id"}  # written back from id2label
        args.extra = {k: v for k, v in config.items() if k not in known and k not in args.field_names() | derived}
        return args

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def __post_init__(self):
        self.extra: dict[str, Any] = {}  # config.json keys this class does not read, kept for writing back
        # config.json stores id2label with string keys; a missing map means transformers' default of 2 labels.
        self.id2label = label_ids(self.id2label or {0: "LABEL_0", 1: "LABEL_1"}, "config key 'id2label'")
        self.check()

    def check(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in POSITIVE_KEYS and value is not None and value <= 0:
                raise ValueError(f"config key {f.name!r} must be a positive integer, got {value}")
            signed = f.name in self.signed_keys
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0 and not signed:
                raise ValueError(f"config key {f.name!r} must not be negative, got {value}")
            if "dropout" in f.name and value is not None and value >= 1:
                raise ValueError(f"config key {f.name!r} is a probability below 1, got {value}")
            if f.name in ACTIVATION_KEYS and value not in ACTIVATIONS:
                raise ValueError(
                    f"config key {f.name!r}: unsupported activation {value!r}; supported: {', '.join(ACTIVATIONS)}"
                )
        # A family that reads an explicit head_dim sizes its projections heads x head_dim, whatever the width.
        split = self.heads_split_width and getattr(self, "head_dim", None) is None
        if split and self.hidden_size % self.attention_heads:
            raise ValueError(
                f"the hidden size {self.hidden_size} is not divisible by the number of attention heads "
                f"{self.attention_heads}"
            )
        if self.problem_type is not None and self.problem_type not in PROBLEM_TYPES:
            raise ValueError(
                f"config key 'problem_type' must be one of {', '.join(PROBLEM_TYPES)}, got {self.problem_type!r}"
            )

    def to_config(self) -> dict[str, Any]:
        """config.json as transformers writes it: every key read (`extra`) and every field, labels both ways."""
        config = {**self.extra, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}
        config["id2label"] = {str(i): label for i, label in self.id2label.items()}
        config["label2id"] = {label: i for i, label in self.id2label.items()}
        return {k: v for k, v in config.items() if v is not None}

    @property
    def num_labels(self) -> int:
        return len(self.id2label)

    def activation_elements(self, length: int) -> int:
        """Elements per sequence of a layer's largest activation at `length` tokens: the attention scores
        (heads x length x length) or the feed-forward's inner layer (length x width)."""
        return length * max(self.attention_heads * length, self.ffn_width)

    @property
    def attention_heads(self) -> int:
        return self.num_attention_heads  # the BERT-family name; DistilBERT's args override this

    @property
    def ffn_width(self) -> int:
        return self.intermediate_size  # the feed-forward's inner width; DistilBERT and ModernBERT override this

    @property
    def output_size(self) -> int:
        """The width of the encoder's last_hidden_state (EmbeddingGemma 2 projects it past hidden_size)."""
        return self.hidden_size

    @property
    def max_tokens(self) -> int | None:
        """The longest input the position table allows (None: no table)."""
        return getattr(self, "max_position_embeddings", None)


@dataclass
class ModelOutput:
    """The fields of transformers' output classes that inference uses; None where not applicable."""

    last_hidden_state: mx.array | None = None
    pooler_output: mx.array | None = None
    logits: mx.array | None = None
    start_logits: mx.array | None = None
    end_logits: mx.array | None = None
    seq_relationship_logits: mx.array | None = None


class Model:
    """Mixed into every model class, bare encoders and heads alike."""

    @property
    def config(self) -> dict[str, Any]:
        """config.json for this model, loaded or built in code: every config key and `architectures`."""
        from . import architecture_name, task_of_model  # the registry imports the model files

        return {
            **self.args.to_config(),
            "architectures": [architecture_name(self.args.model_type, task_of_model(self))],
        }

    def gradient_checkpointing_enable(self) -> None:
        """Keep only each layer's input for the backward pass, which recomputes the layer's activations:
        less memory for about a third more compute (transformers' method of the same name)."""
        self._set_gradient_checkpointing(True)

    def gradient_checkpointing_disable(self) -> None:
        self._set_gradient_checkpointing(False)

    def _set_gradient_checkpointing(self, on: bool) -> None:
        for module in self.modules():
            if hasattr(module, "gradient_checkpointing"):  # the modules that run the layers, as in transformers
                module.gradient_checkpointing = on


def run_layer(layer: nn.Module, *args, checkpoint: bool):
    """`layer(*args)`; with `checkpoint`, through mx.checkpoint (nn.utils.checkpoint passes the layer's trainable
    parameters in explicitly: mx.checkpoint differentiates its arguments only). The recomputation must draw the
    forward pass's dropout masks again. Inside `drawing_from` (training) the layer draws from the key the run
    stands at and the run's key moves past its draws, so the masks are those of a run without checkpointing;
    outside, each call draws from a random key of its own."""
    if not checkpoint:
        return layer(*args)
    state = drawing_state()
    start = state[0] if state is not None else mx.random.randint(0, 2**31 - 1, (2,), dtype=mx.uint32)
    after = []

    def keyed(*args):
        keys = [start]
        with drawing_from(keys):
            out = layer(*args)
        after.append(keys[0])  # the forward pass's; the recomputation appends the same key again
        return out

    out = nn.utils.checkpoint(layer, keyed)(*args)
    if state is not None:
        state[0] = after[0]
    return out


ACTIVATIONS = {
    "gelu": gelu,
    "gelu_python": gelu,
    "gelu_new": gelu_tanh,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_fast": gelu_tanh,
    "quick_gelu": nn.gelu_fast_approx,
    "relu": nn.relu,
    "silu": silu,
    "swish": silu,
    "tanh": mx.tanh,
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"Unsupported activation {name!r}; supported: {', '.join(sorted(ACTIVATIONS))}")
    return ACTIVATIONS[name]


def embed(table: nn.Module, ids: mx.array, padding_idx: int) -> mx.array:
    """table(ids), no gradient reaching row `padding_idx`: torch's nn.Embedding(padding_idx=...), as transformers'
    embeddings are, so training leaves the padding vector as it is."""
    x = table(ids)
    return mx.where((ids == padding_idx)[..., None], mx.stop_gradient(x), x)


def mask_value(dtype: mx.Dtype) -> float:
    # Half the most negative finite value: adding a score can never overflow to -inf, so a row whose keys
    # are all masked stays finite instead of NaN (its weights are uniform in float32; such rows are padding).
    return float(mx.finfo(dtype).min) / 2


def padding_mask(attention_mask: mx.array | None, dtype: mx.Dtype) -> mx.array | None:
    """(B, L) 1/0 key mask -> additive (B, 1, 1, L) mask in `dtype`; queries are never masked."""
    if attention_mask is None:
        return None
    keep = attention_mask.astype(mx.bool_)[:, None, None, :]
    return mx.where(keep, mx.array(0, dtype), mx.array(mask_value(dtype), dtype))


def causal_mask(
    attention_mask: mx.array | None, length: int, offset: int, dtype: mx.Dtype, window: int | None = None
) -> mx.array | None:
    """Additive (B or 1, 1, L, offset + L) mask: query i sees key j <= offset + i whose attention_mask is 1 (and, with
    a sliding `window`, only the keys with offset + i - j < window). Either padding side: keys are masked by value."""
    if length == 1 and window is None:  # a single new query sees every cached key: only padding is masked
        return padding_mask(attention_mask, dtype)
    queries, keys = mx.arange(offset, offset + length)[:, None], mx.arange(offset + length)[None]
    keep = keys <= queries  # (L, T)
    if window is not None:
        keep = keep & (queries - keys < window)
    keep = keep[None, None]
    if attention_mask is not None:
        keep = keep & attention_mask.astype(mx.bool_)[:, None, None, :]
    return mx.where(keep, mx.array(0, dtype), mx.array(mask_value(dtype), dtype))


def split_heads(x: mx.array, num_heads: int) -> mx.array:
    B, L, _ = x.shape
    return x.reshape(B, L, num_heads, -1).transpose(0, 2, 1, 3)  # (B, nh, L, hd)


def merge_heads(x: mx.array) -> mx.array:
    B, _, L, _ = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, L, -1)  # (B, L, nh * hd)


def multi_head_attention(q, k, v, num_heads: int, mask: mx.array | None, dropout: nn.Dropout) -> mx.array:
    q, k, v = (split_heads(t, num_heads) for t in (q, k, v))
    return merge_heads(attention(q, k, v, mask, dropout))


def masked_mean(x: mx.array, attention_mask: mx.array | None) -> mx.array:
    """Mean over real tokens of (B, L, H) -> (B, H)."""
    if attention_mask is None:
        return x.mean(axis=1)
    m = attention_mask.astype(x.dtype)[..., None]
    return (x * m).sum(axis=1) / mx.maximum(m.sum(axis=1), 1e-9)


def last_non_padding(
    input_ids: mx.array, pad_token_id: int | None, attention_mask: mx.array | None, family: str
) -> mx.array:
    """(B,) index of each row's rightmost token that is not `pad_token_id`, as transformers' sequence classifier
    finds it (0 for a row of padding alone). Without a pad token, the rightmost position the attention mask keeps:
    transformers takes one text at a time there, and this is its answer for each text of a padded batch."""
    B, L = input_ids.shape
    if pad_token_id is None:
        if attention_mask is None:
            if B != 1:
                raise ValueError(
                    f"{family} classifies on the last token that is not padding, but config.json has "
                    "no pad_token_id and no attention_mask was given: pass the tokenizer's attention_mask, or set "
                    "pad_token_id in config.json"
                )
            return mx.array([L - 1])
        keep = attention_mask.astype(mx.bool_)
    else:
        keep = input_ids != pad_token_id
    return mx.argmax(mx.arange(L)[None] * keep, axis=1)


def takes_pooler(cls) -> bool:
    return "add_pooling_layer" in inspect.signature(cls.__init__).parameters


class HeadModel(Model, nn.Module):
    """A task head over an encoder stored under the checkpoint's prefix (`bert`, `roberta`, ...).

    Subclasses set `prefix` and `encoder_class`; `encoder` reaches the encoder whatever its name.
    """

    prefix: str = ""
    encoder_class: type = nn.Module
    pooled: bool = False  # does the head read pooler_output?
    # Checkpoint keys that transformers ignores on load (tied copies of the word embeddings).
    ignored_keys: tuple[str, ...] = ()
    # A replaced-token detector (ELECTRA's pretraining head): it predicts which tokens were replaced, not words,
    # so it cannot fill masks as BERT's pretraining head (masked-LM plus next-sentence) does.
    discriminator: ClassVar[bool] = False

    def __init__(self, args):
        super().__init__()
        self.args = args
        kwargs = {"add_pooling_layer": self.pooled} if takes_pooler(self.encoder_class) else {}
        self[self.prefix] = self.encoder_class(args, **kwargs)

    @property
    def encoder(self) -> nn.Module:
        return self[self.prefix]

    def encode(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        return self.encoder(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)


class MaskedLM(HeadModel):
    """Vocabulary logits of every token through `predict_tokens`: the module at `head` (a dotted path under the
    checkpoint's keys) maps hidden states and the encoder's word embeddings (tied, unless the head holds its own
    decoder) to logits."""

    head: ClassVar[str] = "lm_head"

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        out = self.encode(input_ids, attention_mask, token_type_ids)
        out.logits = self.predict_tokens(out.last_hidden_state)
        return out

    def predict_tokens(self, hidden: mx.array) -> mx.array:
        """Vocabulary logits of (..., H) hidden states (training scores only the masked positions)."""
        module = self
        for name in self.head.split("."):
            module = module[name]
        return module(hidden, self.encoder.embeddings.word_embeddings)


class PooledClassification(HeadModel):
    """`dropout` (args.sequence_classifier_dropout), then `classifier` on pooler_output (BERT, ALBERT)."""

    pooled = True

    def __init__(self, args):
        super().__init__(args)
        self.dropout = Dropout(args.sequence_classifier_dropout)
        self.classifier = Linear(args.hidden_size, args.num_labels)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        out = self.encode(input_ids, attention_mask, token_type_ids)
        out.logits = self.classifier(self.dropout(out.pooler_output))
        return out


class HiddenStateClassification(HeadModel):
    """`classifier_class(args)` on the last hidden state (RoBERTa's and ELECTRA's heads read its first token)."""

    classifier_class: type = nn.Module

    def __init__(self, args):
        super().__init__(args)
        self.classifier = self.classifier_class(args)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        out = self.encode(input_ids, attention_mask, token_type_ids)
        out.logits = self.classifier(out.last_hidden_state)
        return out


class TokenClassification(HeadModel):
    """`dropout` (args.token_classifier_dropout), then `classifier` on every token's hidden state."""

    def __init__(self, args):
        super().__init__(args)
        self.dropout = Dropout(args.token_classifier_dropout)
        self.classifier = Linear(args.hidden_size, args.num_labels)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        out = self.encode(input_ids, attention_mask, token_type_ids)
        out.logits = self.classifier(self.dropout(out.last_hidden_state))
        return out


def span_logits(out: ModelOutput, logits: mx.array) -> ModelOutput:
    """Split (B, L, 2) span logits into start and end, as transformers' QA models do."""
    out.logits = logits
    out.start_logits, out.end_logits = logits[..., 0], logits[..., 1]
    return out


class QuestionAnswering(HeadModel):
    """`dropout` (args.qa_dropout), then `qa_outputs` (H -> 2) on every token: start and end logits."""

    def __init__(self, args):
        super().__init__(args)
        self.dropout = Dropout(args.qa_dropout)
        self.qa_outputs = Linear(args.hidden_size, 2)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        out = self.encode(input_ids, attention_mask, token_type_ids)
        return span_logits(out, self.qa_outputs(self.dropout(out.last_hidden_state)))


class TiedDecoder(nn.Module):
    """Vocabulary projection whose weight is the word-embedding matrix unless the config unties it."""

    def __init__(self, dims: int, vocab_size: int, tied: bool, bias: bool = True):
        super().__init__()
        if not tied:
            self.weight = mx.zeros((vocab_size, dims))
        if bias:
            self.bias = mx.zeros((vocab_size,))

    def __call__(self, x: mx.array, word_embeddings: nn.Module) -> mx.array:
        x = x @ self.weight.T if "weight" in self else word_embeddings.as_linear(x)
        return x + self.bias if "bias" in self else x

    def to_quantized(self, group_size=None, bits=None, mode: str = "affine", quantize_input: bool = False):
        """An untied head quantized as a linear of its own weight (mlx-lm's `lm_head.weight/.scales/.biases`); a
        tied one is the word table's, quantized with it."""
        if "weight" not in self or quantize_input:
            raise ValueError("a tied decoder has no weight of its own: its word embeddings are quantized instead")
        return QuantizedDecoder.from_linear(self, group_size, bits, mode)


class QuantizedDecoder(QuantizedLinear):
    """An untied `TiedDecoder` quantized: the same keys, called as the decoder is."""

    def __call__(self, x: mx.array, word_embeddings: nn.Module | None = None) -> mx.array:
        return super().__call__(x)


class CausalLM(HeadModel):
    """A decoder's next-token logits through `lm_head` (the word embeddings `model.embed_tokens` when
    `tie_word_embeddings`); families set `encoder_class` and may transform the logits in `predict_tokens`."""

    prefix = "model"
    ignored_keys = ("lm_head.weight",)  # a tied copy, when a file stores one

    def __init__(self, args):
        super().__init__(args)
        self.lm_head = TiedDecoder(args.hidden_size, args.vocab_size, args.tie_word_embeddings, bias=False)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        out = self.encode(input_ids, attention_mask)
        out.logits = self.predict_tokens(out.last_hidden_state)
        return out

    def predict_tokens(self, hidden: mx.array) -> mx.array:
        """Vocabulary logits of (..., H) hidden states."""
        return self.lm_head(hidden, self.model.embed_tokens)

"""Pieces shared by every encoder: config base class, outputs, masks, attention and common heads.

The math follows Hugging Face transformers (`modeling_bert.py` and friends); see
`shared/ARCHITECTURES.md` for the per-architecture facts each model file relies on.
"""

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..kernels import attention, gelu


@dataclass
class BaseArgs:
    """Fields every config.json may carry; subclasses add the architecture's own names."""

    model_type: str = ""
    architectures: list[str] | None = None
    id2label: dict[int, str] | None = None
    problem_type: str | None = None
    tie_word_embeddings: bool = True

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "BaseArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in names})

    def __post_init__(self):
        # config.json stores id2label with string keys; a missing map means transformers' default of 2 labels.
        labels = self.id2label or {0: "LABEL_0", 1: "LABEL_1"}
        self.id2label = {int(k): v for k, v in labels.items()}

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


ACTIVATIONS = {
    "gelu": gelu,
    "gelu_python": gelu,
    "gelu_new": nn.gelu_approx,
    "gelu_pytorch_tanh": nn.gelu_approx,
    "gelu_fast": nn.gelu_approx,
    "quick_gelu": nn.gelu_fast_approx,
    "relu": nn.relu,
    "silu": nn.silu,
    "swish": nn.silu,
    "tanh": mx.tanh,
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"Unsupported activation {name!r}; supported: {', '.join(sorted(ACTIVATIONS))}")
    return ACTIVATIONS[name]


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


def split_heads(x: mx.array, num_heads: int) -> mx.array:
    B, L, _ = x.shape
    return x.reshape(B, L, num_heads, -1).transpose(0, 2, 1, 3)  # (B, nh, L, hd)


def merge_heads(x: mx.array) -> mx.array:
    B, _, L, _ = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, L, -1)  # (B, L, nh * hd)


def multi_head_attention(q, k, v, num_heads: int, mask: mx.array | None) -> mx.array:
    q, k, v = (split_heads(t, num_heads) for t in (q, k, v))
    return merge_heads(attention(q, k, v, mask))


def masked_mean(x: mx.array, attention_mask: mx.array | None) -> mx.array:
    """Mean over real tokens of (B, L, H) -> (B, H)."""
    if attention_mask is None:
        return x.mean(axis=1)
    m = attention_mask.astype(x.dtype)[..., None]
    return (x * m).sum(axis=1) / mx.maximum(m.sum(axis=1), 1e-9)


def takes_pooler(cls) -> bool:
    return "add_pooling_layer" in inspect.signature(cls.__init__).parameters


class HeadModel(nn.Module):
    """A task head over an encoder stored under the checkpoint's prefix (`bert`, `roberta`, ...).

    Subclasses set `prefix` and `encoder_class`; `encoder` reaches the encoder whatever its name.
    """

    prefix: str = ""
    encoder_class: type = nn.Module
    pooled: bool = False  # does the head read pooler_output?
    # Checkpoint keys that transformers ignores on load (tied copies of the word embeddings).
    ignored_keys: tuple[str, ...] = ()

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


class PooledClassification(HeadModel):
    """`classifier` on pooler_output (BERT, ALBERT)."""

    pooled = True

    def __init__(self, args):
        super().__init__(args)
        self.classifier = nn.Linear(args.hidden_size, args.num_labels)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        out = self.encode(input_ids, attention_mask, token_type_ids)
        out.logits = self.classifier(out.pooler_output)
        return out


class TokenClassification(HeadModel):
    """`classifier` on every token's hidden state."""

    def __init__(self, args):
        super().__init__(args)
        self.classifier = nn.Linear(args.hidden_size, args.num_labels)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        out = self.encode(input_ids, attention_mask, token_type_ids)
        out.logits = self.classifier(out.last_hidden_state)
        return out


def span_logits(out: ModelOutput, logits: mx.array) -> ModelOutput:
    """Split (B, L, 2) span logits into start and end, as transformers' QA models do."""
    out.logits = logits
    out.start_logits, out.end_logits = logits[..., 0], logits[..., 1]
    return out


class QuestionAnswering(HeadModel):
    """`qa_outputs` (H -> 2) on every token: start and end logits."""

    def __init__(self, args):
        super().__init__(args)
        self.qa_outputs = nn.Linear(args.hidden_size, 2)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        out = self.encode(input_ids, attention_mask, token_type_ids)
        return span_logits(out, self.qa_outputs(out.last_hidden_state))


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

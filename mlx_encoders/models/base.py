"""Pieces shared by every encoder: config base class, outputs, masks, attention and common heads.

The math follows Hugging Face transformers (`modeling_bert.py` and friends); see
`shared/ARCHITECTURES.md` for the per-architecture facts each model file relies on.
"""

import dataclasses
import inspect
import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn


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
        heads = getattr(self, "num_attention_heads", None) or getattr(self, "n_heads", 1)
        width = getattr(self, "intermediate_size", None) or getattr(self, "hidden_dim", 0)
        return length * max(heads * length, width)

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


# erf as a rational function on [-4, 4] (Eigen's / XLA's float32 erf, within ~2 ulp; |erf| rounds to 1 beyond 4).
ERF_NUMERATOR = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
                 -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)  # fmt: skip
ERF_DENOMINATOR = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
                   -1.42647390514189e-02)  # fmt: skip


def polyval(coefficients: tuple[float, ...], x: mx.array) -> mx.array:
    """Horner's rule, highest power first."""
    acc = coefficients[0]
    for c in coefficients[1:]:
        acc = acc * x + c
    return acc


@mx.compile
def gelu(x: mx.array) -> mx.array:
    """Exact (erf) GELU, as torch's nn.GELU(). A few multiply-adds fused by mx.compile replace mx.erf, which
    is several times slower on MLX's CPU backend; the result matches torch's float32 GELU to rounding.
    Half-precision inputs are computed in float32 (the small coefficients underflow in float16), as torch does."""
    x32 = x.astype(mx.float32)
    z = mx.minimum(mx.maximum(x32 * (1 / math.sqrt(2)), -4.0), 4.0)
    z2 = z * z
    erf = z * polyval(ERF_NUMERATOR, z2) / polyval(ERF_DENOMINATOR, z2)
    return (x32 * (1 + erf) / 2).astype(x.dtype)


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
    # are all masked stays finite (uniform weights) instead of NaN.
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


# exp(x) = 2^n * exp(r), n = round(x / ln 2), r = x - n ln 2 in [-ln2/2, ln2/2] (Cody-Waite: ln 2 in two parts);
# exp(r) = 1 + r + r^2 P(r), Cephes' float32 expf polynomial (within 1 ulp of exp).
LOG2E = 1.4426950408889634
LN2_HIGH, LN2_LOW = 0.693359375, -2.12194440e-4
EXP_POLYNOMIAL = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
                  5.0000001201e-1)  # fmt: skip
ROUNDING = 12582912.0  # 1.5 * 2^23: adding it rounds a float32 of magnitude < 2^22 to an integer, in its low bits
LOG_SMALLEST_NORMAL = -87.33654  # ln(2^-126)


@mx.compile
def exp_reduce(x: mx.array) -> tuple[mx.array, mx.array]:
    """(x / ln 2 + ROUNDING, whose low bits hold n; r)."""
    shifted = x * LOG2E + ROUNDING
    n = shifted - ROUNDING
    return shifted, (x - n * LN2_HIGH) - n * LN2_LOW


@mx.compile
def exp_small(r: mx.array) -> mx.array:
    """exp(r) for |r| <= ln2 / 2, the polynomial in Estrin's form (short dependency chains)."""
    c0, c1, c2, c3, c4, c5 = EXP_POLYNOMIAL
    r2 = r * r
    p = (c5 + c4 * r) + r2 * (c3 + c2 * r) + (r2 * r2) * (c1 + c0 * r)
    return p * r2 + r + 1


@mx.compile
def exponent_bits(shifted_bits: mx.array) -> mx.array:
    """The float32 bit pattern of 2^n, from the bits of x / ln 2 + ROUNDING (n + 127 in the exponent field)."""
    return (shifted_bits + 127) << 23


def exp_nonpositive(x: mx.array) -> mx.array:
    """exp of float32 x <= 0, within 1 ulp for x >= ln(2^-126); smaller x give 2^-126 (about 1.2e-38).

    MLX's CPU backend computes mx.exp one element at a time, about 10 ns each (and within ~60 ulp); these
    multiply-adds and integer shifts vectorise. The four steps stay separate kernels because mx.compile
    cannot fuse through a bit-cast (`view`) and fuses only short chains.
    """
    shifted, r = exp_reduce(mx.maximum(x, LOG_SMALLEST_NORMAL))
    return exp_small(r) * exponent_bits(shifted.view(mx.int32)).view(mx.float32)


def attention(q: mx.array, k: mx.array, v: mx.array, mask: mx.array | None) -> mx.array:
    """softmax(q k^T / sqrt(hd) + mask) v on (B, nh, L, hd) tensors; the softmax runs in float32.

    Written out rather than through mx.fast.scaled_dot_product_attention, whose softmax exp dominates an
    encoder's time on MLX's CPU backend: see exp_nonpositive. Normalising after the product with v divides
    (B, nh, L, hd) values instead of (B, nh, L, L).
    """
    scores = ((q * (q.shape[-1] ** -0.5)) @ k.swapaxes(-1, -2)).astype(mx.float32)
    if mask is not None:
        scores = scores + mask
    weights = exp_nonpositive(scores - scores.max(axis=-1, keepdims=True))
    return (weights.astype(v.dtype) @ v) / weights.sum(axis=-1, keepdims=True).astype(v.dtype)


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

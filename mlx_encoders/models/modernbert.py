"""ModernBERT, matching transformers' `modeling_modernbert.py`.

Pre-LN layers with RoPE (`layers.rope`, rotate-half form), global attention every few layers and
sliding-window attention (|i - j| <= local_attention // 2) in between, and a GeGLU MLP. Long inputs compute
the sliding layers' band only (`banded_attention`: O(L w) time and memory instead of an L x L mask), and the
global layers a block of queries at a time (`layers.blockwise_attention`: O(L) memory). The encoder's
`pooler_output` is the CLS token's final hidden state (transformers' ModernBertModel returns no pooler output).
"""

import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import mlx.core as mx
import mlx.nn as nn

from .base import (
    BaseArgs,
    HeadModel,
    Model,
    ModelOutput,
    TiedDecoder,
    activation,
    attention,
    embed,
    mask_value,
    masked_mean,
    merge_heads,
    padding_mask,
    run_layer,
    span_logits,
    split_heads,
)
from .inputs import check_inputs
from .layers import Dropout, Embedding, LayerNorm, Linear, blockwise_attention, rope

ATTENTION = ("full_attention", "sliding_attention")


@dataclass
class ModelArgs(BaseArgs):
    model_type: str = "modernbert"
    vocab_size: int = 50368
    hidden_size: int = 768
    intermediate_size: int = 1152
    num_hidden_layers: int = 22
    num_attention_heads: int = 12
    hidden_activation: str = "gelu"
    max_position_embeddings: int = 8192
    norm_eps: float = 1e-5
    norm_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    decoder_bias: bool = True
    classifier_bias: bool = False
    classifier_activation: str = "gelu"
    classifier_pooling: str = "cls"
    local_attention: int = 128
    pad_token_id: int = 50283
    embedding_dropout: float = 0.0
    attention_dropout: float = 0.0
    mlp_dropout: float = 0.0
    classifier_dropout: float = 0.0
    # Two spellings in the wild: transformers-5 `layer_types`/`rope_parameters`, or the legacy keys below.
    layer_types: list[str] | None = None
    rope_parameters: dict | None = None
    rope_scaling: dict | None = None  # the older spelling: merged into both layer kinds' rope_parameters
    global_attn_every_n_layers: int | None = None  # None: 3, 160000 and 10000, the original defaults
    global_rope_theta: float | None = None
    local_rope_theta: float | None = None
    initializer_cutoff_factor: float = 2.0
    # answerdotai/ModernBERT-{base,large}; the other keys' defaults are theirs.
    presets: ClassVar[dict] = {
        "base": dict(hidden_size=768, intermediate_size=1152, num_hidden_layers=22, num_attention_heads=12),
        "large": dict(hidden_size=1024, intermediate_size=2624, num_hidden_layers=28, num_attention_heads=16),
    }

    @property
    def ffn_width(self) -> int:
        return 2 * self.intermediate_size  # Wi's output: the GeGLU's input and gate

    def __post_init__(self):
        super().__post_init__()
        # Derived values live outside the fields, so config.json is written back in the spelling it was read in.
        n = self.global_attn_every_n_layers or 3
        self.attention_types = self.layer_types or [
            "full_attention" if i % n == 0 else "sliding_attention" for i in range(self.num_hidden_layers)
        ]
        if len(self.attention_types) != self.num_hidden_layers or not set(self.attention_types) <= set(ATTENTION):
            raise ValueError(
                f"config key 'layer_types' must list one of {', '.join(ATTENTION)} for each of the "
                f"{self.num_hidden_layers} layers, got {self.layer_types!r}"
            )
        if self.classifier_pooling not in ("cls", "mean"):
            raise ValueError(
                f"config key 'classifier_pooling' must be 'cls' or 'mean', got {self.classifier_pooling!r}"
            )
        rope = self.rope_parameters or {}
        legacy = {
            "full_attention": self.global_rope_theta or 160000.0,
            "sliding_attention": self.local_rope_theta or 10000.0,
        }
        self.rope_theta, self.rope_scale = {}, {}
        for kind, theta in legacy.items():
            # as transformers merges them: each kind's own (else the default type), then rope_scaling over it; a
            # legacy "type" counts only where no "rope_type" is (transformers ignores {"type": "linear"} there)
            params = {**(rope.get(kind) or {"rope_type": "default"}), **(self.rope_scaling or {})}
            rope_type = params.get("rope_type", params.get("type", "default"))
            if rope_type not in ("default", "linear"):
                raise ValueError(f"ModernBERT rope_type {rope_type!r} is not supported (only 'default' and 'linear')")
            self.rope_theta[kind] = float(params.get("rope_theta", theta))
            self.rope_scale[kind] = 1.0 / float(params.get("factor", 1.0)) if rope_type == "linear" else 1.0


class ModernBertEmbeddings(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.tok_embeddings = Embedding(args.vocab_size, args.hidden_size)
        self.norm = LayerNorm(args.hidden_size, eps=args.norm_eps, bias=args.norm_bias)
        self.drop = Dropout(args.embedding_dropout)
        self.padding_idx = args.pad_token_id

    def __call__(self, input_ids):
        x = embed(self.tok_embeddings, input_ids, self.padding_idx)
        return self.drop(self.norm(x.astype(self.norm.weight.dtype)))  # see BertEmbeddings


class ModernBertAttention(nn.Module):
    def __init__(self, args: ModelArgs, layer_type: str):
        super().__init__()
        self.num_heads = args.num_attention_heads
        self.head_dim = args.hidden_size // args.num_attention_heads
        self.theta, self.scale = args.rope_theta[layer_type], args.rope_scale[layer_type]
        self.Wqkv = Linear(args.hidden_size, 3 * args.hidden_size, bias=args.attention_bias)
        self.Wo = Linear(args.hidden_size, args.hidden_size, bias=args.attention_bias)
        # transformers applies attention_dropout twice: to the probabilities and after Wo
        self.attention_dropout = Dropout(args.attention_dropout)
        self.out_drop = Dropout(args.attention_dropout)

    def __call__(self, x, mask):
        q, k, v = (split_heads(t, self.num_heads) for t in mx.split(self.Wqkv(x), 3, axis=-1))
        q, k = (rope(t, self.theta, self.scale) for t in (q, k))
        attend = banded_attention if isinstance(mask, Band) else blockwise_attention  # O(L w), O(L) memory
        out = attend(q, k, v, mask, self.attention_dropout)
        return self.out_drop(self.Wo(merge_heads(out)))


class ModernBertMLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.Wi = Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.Wo = Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)
        self.act = activation(args.hidden_activation)
        self.drop = Dropout(args.mlp_dropout)

    def __call__(self, x):
        a, gate = mx.split(self.Wi(x), 2, axis=-1)
        return self.Wo(self.drop(self.act(a) * gate))


class ModernBertEncoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, index: int):
        super().__init__()
        self.sliding = args.attention_types[index] == "sliding_attention"
        if index > 0:  # layer 0 reads the already-normalised embeddings
            self.attn_norm = LayerNorm(args.hidden_size, eps=args.norm_eps, bias=args.norm_bias)
        self.attn = ModernBertAttention(args, args.attention_types[index])
        self.mlp_norm = LayerNorm(args.hidden_size, eps=args.norm_eps, bias=args.norm_bias)
        self.mlp = ModernBertMLP(args)

    def __call__(self, x, masks):
        h = self.attn_norm(x) if "attn_norm" in self else x
        x = x + self.attn(h, masks[self.sliding])
        return x + self.mlp(self.mlp_norm(x))


class Band(NamedTuple):
    """A sliding layer's mask in banded form: the (B, L) keys to keep (None: all) and the half window."""

    keep: mx.array | None
    half_window: int


def banded_attention(q, k, v, band: Band, dropout: nn.Dropout) -> mx.array:
    """Attention of (B, nh, L, hd) q, k, v over keys with |i - j| <= h (h = band.half_window) and kept.

    The queries are cut into chunks of h; chunk t sees the keys of chunks t - 1, t and t + 1 (3h keys, the
    sequence padded with h masked keys at each end), which hold its whole window. Each chunk is one row of the
    batch passed to `attention`, so scores take (L / h) x h x 3h = 3 L h entries instead of L^2.
    """
    B, nh, L, hd = q.shape
    h = band.half_window
    chunks = -(-L // h)
    keep = mx.ones((B, L), mx.bool_) if band.keep is None else band.keep.astype(mx.bool_)
    keep = mx.pad(keep, [(0, 0), (h, chunks * h - L + h)])  # (B, (chunks + 2) h), False at both ends

    def windows(t):  # (B, nh, L, hd) -> (B chunks, nh, 3h, hd): each chunk's keys or values
        t = mx.pad(t, [(0, 0), (0, 0), (h, chunks * h - L + h), (0, 0)]).reshape(B, nh, chunks + 2, h, hd)
        t = mx.concatenate([t[:, :, :-2], t[:, :, 1:-1], t[:, :, 2:]], axis=3)  # (B, nh, chunks, 3h, hd)
        return t.transpose(0, 2, 1, 3, 4).reshape(B * chunks, nh, 3 * h, hd)

    queries = mx.pad(q, [(0, 0), (0, 0), (0, chunks * h - L), (0, 0)]).reshape(B, nh, chunks, h, hd)
    queries = queries.transpose(0, 2, 1, 3, 4).reshape(B * chunks, nh, h, hd)
    keys = keep.reshape(B, chunks + 2, h)
    keys = mx.concatenate([keys[:, :-2], keys[:, 1:-1], keys[:, 2:]], axis=2)  # (B, chunks, 3h)
    offset = mx.arange(3 * h)[None] - h - mx.arange(h)[:, None]  # key minus query position, (h, 3h)
    visible = (mx.abs(offset) <= h) & keys[:, :, None, :]  # (B, chunks, h, 3h)
    mask = mx.where(visible, mx.array(0, q.dtype), mx.array(mask_value(q.dtype), q.dtype))
    out = attention(queries, windows(k), windows(v), mask.reshape(B * chunks, 1, h, 3 * h), dropout)
    out = out.reshape(B, chunks, nh, h, hd).transpose(0, 2, 1, 3, 4).reshape(B, nh, chunks * h, hd)[:, :, :L]
    blind = ~visible.any(axis=-1).reshape(B, 1, chunks * h, 1)[:, :, :L]
    return mx.where(blind, uniform_attention(q, k, v), out)


@mx.custom_function
def uniform_attention(q, k, v):
    """The output of a query whose every key is masked: transformers' finite mask weighs all L keys alike, so
    the mean of v, with the gradients of that softmax (its scores still depend on q and k; see the vjp).
    Only such (padding) queries use it; their positions hold the only nonzero cotangents."""
    return mx.broadcast_to(v.mean(axis=2, keepdims=True), v.shape)


@uniform_attention.vjp
def uniform_attention_vjp(primals, cotangent, output):
    """With p = 1/L and s_ij = q_i.k_j / sqrt(hd): ds_ij = g_i.(v_j - mean v) / L, summed in (hd, hd) products."""
    q, k, v = primals
    L, scale = v.shape[2], q.shape[-1] ** -0.5
    g = cotangent
    v_mean, k_mean = v.mean(axis=2, keepdims=True), k.mean(axis=2, keepdims=True)
    dq = (scale / L) * (g @ (v.swapaxes(-1, -2) @ k)) - scale * (g * v_mean).sum(-1, keepdims=True) * k_mean
    dk = (scale / L) * ((v - v_mean) @ (g.swapaxes(-1, -2) @ q))
    dv = mx.broadcast_to(g.sum(axis=2, keepdims=True) / L, v.shape)
    return dq, dk, dv


def attention_masks(attention_mask, L: int, half_window: int, dtype) -> tuple[mx.array, mx.array | Band]:
    """Additive (global, sliding) masks: (B, 1, 1, L) over padded keys, and (B|1, 1, L, L) adding the window;
    the sliding one as a `Band` when the band is cheaper than the full L x L scores (L > 3 half windows)."""
    if 0 < 3 * half_window < L:
        return padding_mask(attention_mask, dtype), Band(attention_mask, half_window)
    idx = mx.arange(L)
    keep = mx.abs(idx[:, None] - idx[None]) <= half_window  # (L, L)
    if attention_mask is not None:
        keys = attention_mask.astype(mx.bool_)[:, None, None, :]  # (B, 1, 1, L)
        keep = keep & keys
    else:
        keys = mx.ones((1, 1, 1, L), dtype=mx.bool_)
    zero, neg = mx.array(0, dtype), mx.array(mask_value(dtype), dtype)
    return mx.where(keys, zero, neg), mx.where(keep, zero, neg)


class ModernBertModel(Model, nn.Module):
    gradient_checkpointing = False

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embeddings = ModernBertEmbeddings(args)
        self.layers = [ModernBertEncoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.final_norm = LayerNorm(args.hidden_size, eps=args.norm_eps, bias=args.norm_bias)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        check_inputs(self.args, input_ids, attention_mask, token_type_ids)  # RoPE: no position table to outgrow
        x = self.embeddings(input_ids)
        masks = attention_masks(attention_mask, x.shape[1], self.args.local_attention // 2, x.dtype)
        for layer in self.layers:
            x = run_layer(layer, x, masks, checkpoint=self.gradient_checkpointing)
        x = self.final_norm(x)
        # No pooler layer: the CLS token after the final norm, the embedding the "cls" pooling reads.
        return ModelOutput(last_hidden_state=x, pooler_output=x[:, 0])


class ModernBertPredictionHead(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.dense = Linear(args.hidden_size, args.hidden_size, bias=args.classifier_bias)
        self.act = activation(args.classifier_activation)
        self.norm = LayerNorm(args.hidden_size, eps=args.norm_eps, bias=args.norm_bias)

    def __call__(self, x):
        return self.norm(self.act(self.dense(x)))


class ModernBertHead(HeadModel):
    prefix = "model"
    encoder_class = ModernBertModel

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.head = ModernBertPredictionHead(args)


class ModernBertForMaskedLM(ModernBertHead):
    ignored_keys = ("decoder.weight",)

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.decoder = TiedDecoder(args.hidden_size, args.vocab_size, args.tie_word_embeddings, args.decoder_bias)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        out = self.encode(input_ids, attention_mask)
        out.logits = self.predict_tokens(out.last_hidden_state)
        return out

    def predict_tokens(self, hidden: mx.array) -> mx.array:
        """Vocabulary logits of (..., H) hidden states (training scores only the masked positions)."""
        return self.decoder(self.head(hidden), self.model.embeddings.tok_embeddings)


class ModernBertClassifier(ModernBertHead):
    """The prediction head, dropout, then `classifier`: transformers' sequence and token heads alike."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.drop = Dropout(args.classifier_dropout)
        self.classifier = Linear(args.hidden_size, args.num_labels)

    def classify(self, x: mx.array) -> mx.array:
        return self.classifier(self.drop(self.head(x)))


class ModernBertForSequenceClassification(ModernBertClassifier):
    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        out = self.encode(input_ids, attention_mask)
        x = out.last_hidden_state
        out.logits = self.classify(x[:, 0] if self.args.classifier_pooling == "cls" else masked_mean(x, attention_mask))
        return out


class ModernBertForTokenClassification(ModernBertClassifier):
    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        out = self.encode(input_ids, attention_mask)
        out.logits = self.classify(out.last_hidden_state)
        return out


class ModernBertForQuestionAnswering(ModernBertForTokenClassification):
    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        out = super().__call__(input_ids, attention_mask)
        return span_logits(out, out.logits)


def init_std(path: str, args: ModelArgs) -> tuple[float, float]:
    """(std, bound) of a new module's truncated-normal weights, by role, as transformers'
    `ModernBertPreTrainedModel._init_weights`: outputs shrink with depth, the classifier gets 1/sqrt(H)."""
    std = args.initializer_range
    name = path.rsplit(".", 1)[-1]
    if name == "classifier":
        std = args.hidden_size**-0.5
    elif name in ("Wo", "decoder") or path.endswith("head.dense"):
        std = std / math.sqrt(2.0 * args.num_hidden_layers)
    return std, args.initializer_cutoff_factor * std


MODELS = {
    "encoder": ModernBertModel,
    "masked-lm": ModernBertForMaskedLM,
    "sequence-classification": ModernBertForSequenceClassification,
    "token-classification": ModernBertForTokenClassification,
    "question-answering": ModernBertForQuestionAnswering,
}
TOKEN_TYPES = False

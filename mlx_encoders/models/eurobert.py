"""EuroBERT, matching transformers' `modeling_eurobert.py`.

A Llama-shaped encoder with bidirectional attention: RMSNorm before attention and MLP, RoPE (`layers.rope`,
rotate-half form) on positions `arange(L)`, grouped-query attention, a SwiGLU MLP `down(silu(gate(x)) * up(x))`,
and a final RMSNorm. There is no pooler. The masked-LM head is one Linear (`lm_head`, untied unless the config
ties it); the sequence classifier is `classifier(gelu(dense(.)))` with `classifier_pooling` "bos" (first token),
"mean" (over real tokens), or "late" (per-token logits, then their mean over real tokens).
"""

from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import mlx.nn as nn

from .base import (
    BaseArgs,
    HeadModel,
    Model,
    ModelOutput,
    TiedDecoder,
    activation,
    embed,
    masked_mean,
    merge_heads,
    padding_mask,
    run_layer,
    split_heads,
)
from .inputs import check_inputs
from .layers import Dropout, Embedding, GatedMLP, Linear, gelu, grouped_attention, rope

POOLINGS = ("bos", "mean", "late")


@dataclass
class ModelArgs(BaseArgs):
    model_type: str = "eurobert"
    vocab_size: int = 128256
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_key_value_heads: int | None = None  # None: one per attention head
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    hidden_act: str = "silu"
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    attention_dropout: float = 0.0
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    pad_token_id: int | None = 128001
    bos_token_id: int | None = 128000
    eos_token_id: int | list[int] | None = 128001
    mask_token_id: int | None = 128002
    classifier_pooling: str | None = None  # None: the remote code's `clf_pooling`, else "late"
    clf_pooling: str | None = None
    # Two spellings: transformers-5 `rope_parameters`, or the hub's legacy `rope_theta` / `rope_scaling`.
    rope_parameters: dict | None = None
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    # EuroBERT/EuroBERT-{210m,610m,2.1B}; the other keys' defaults are theirs.
    presets: ClassVar[dict] = {
        "210m": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                     num_key_value_heads=12, rope_theta=250000.0),
        "610m": dict(hidden_size=1152, intermediate_size=4096, num_hidden_layers=26, num_attention_heads=18,
                     num_key_value_heads=6, rope_theta=250000.0),
        "2.1b": dict(hidden_size=2304, intermediate_size=6144, num_hidden_layers=32, num_attention_heads=18,
                     num_key_value_heads=6, rope_theta=250000.0),
    }  # fmt: skip

    def __post_init__(self):
        super().__post_init__()
        # Derived values live outside the fields, so config.json is written back in the spelling it was read in.
        self.kv_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_width = self.head_dim or self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.kv_heads:
            raise ValueError(
                f"config key 'num_key_value_heads' ({self.kv_heads}) must divide num_attention_heads "
                f"({self.num_attention_heads}): each key/value head serves a whole group of query heads"
            )
        # transformers 5 reads `classifier_pooling` only; the authors' remote code (older hub configs) `clf_pooling`.
        key = "classifier_pooling" if self.classifier_pooling or not self.clf_pooling else "clf_pooling"
        self.pooling = getattr(self, key) or "late"
        if self.pooling not in POOLINGS:
            raise ValueError(f"config key {key!r} must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")
        rope = self.rope_scaling or self.rope_parameters or {}  # transformers: a config's rope_scaling wins
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise ValueError(f"EuroBERT rope_type {kind!r} is not supported (only 'default', plain RoPE)")
        self.theta = float(rope.get("rope_theta") or self.rope_theta or 10000.0)

    def check(self) -> None:
        super().check()
        for name in ("num_key_value_heads", "head_dim"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"config key {name!r} must be a positive integer, got {value}")


class EuroBertAttention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_heads, self.kv_heads, self.head_dim = args.num_attention_heads, args.kv_heads, args.head_width
        self.theta = args.theta
        bias = args.attention_bias
        self.q_proj = Linear(args.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(args.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(args.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, args.hidden_size, bias=bias)
        self.attention_dropout = Dropout(args.attention_dropout)

    def __call__(self, x, mask):
        B, L, _ = x.shape
        q = split_heads(self.q_proj(x), self.num_heads)  # (B, nh, L, hd)
        k, v = (split_heads(t, self.kv_heads) for t in (self.k_proj(x), self.v_proj(x)))  # (B, nkv, L, hd)
        q, k = rope(q, self.theta), rope(k, self.theta)
        return self.o_proj(merge_heads(grouped_attention(q, k, v, mask, self.attention_dropout)))


class EuroBertDecoderLayer(nn.Module):
    """transformers' name for the layer; its attention is bidirectional."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.self_attn = EuroBertAttention(args)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, activation(args.hidden_act), args.mlp_bias)

    def __call__(self, x, mask):
        x = x + self.self_attn(self.input_layernorm(x), mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class EuroBertModel(Model, nn.Module):
    gradient_checkpointing = False

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.padding_idx = args.pad_token_id
        self.layers = [EuroBertDecoderLayer(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        check_inputs(self.args, input_ids, attention_mask, token_type_ids)  # RoPE: no position table to outgrow
        x = embed(self.embed_tokens, input_ids, -1 if self.padding_idx is None else self.padding_idx)
        x = x.astype(self.norm.weight.dtype)  # a quantized table dequantizes to its scales' dtype
        mask = padding_mask(attention_mask, x.dtype)
        for layer in self.layers:
            x = run_layer(layer, x, mask, checkpoint=self.gradient_checkpointing)
        return ModelOutput(last_hidden_state=self.norm(x))


class EuroBertHead(HeadModel):
    prefix = "model"
    encoder_class = EuroBertModel


class EuroBertForMaskedLM(EuroBertHead):
    ignored_keys = ("lm_head.weight",)  # read only when tied, as a copy of the word embeddings

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        if args.tie_word_embeddings:  # the embedding matrix, and a bias of its own when mlp_bias
            self.lm_head = TiedDecoder(args.hidden_size, args.vocab_size, True, args.mlp_bias)
        else:  # a Linear, which quantizes
            self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=args.mlp_bias)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        out = self.encode(input_ids, attention_mask)
        out.logits = self.predict_tokens(out.last_hidden_state)
        return out

    def predict_tokens(self, hidden: mx.array) -> mx.array:
        """Vocabulary logits of (..., H) hidden states (training scores only the masked positions)."""
        if isinstance(self.lm_head, TiedDecoder):
            return self.lm_head(hidden, self.model.embed_tokens)
        return self.lm_head(hidden)


class EuroBertForSequenceClassification(EuroBertHead):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.dense = Linear(args.hidden_size, args.hidden_size)
        self.classifier = Linear(args.hidden_size, args.num_labels)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        out = self.encode(input_ids, attention_mask)
        x = out.last_hidden_state
        if self.args.pooling == "late":  # every token's logits, then their mean over the real tokens
            out.logits = masked_mean(self.classify(x), attention_mask)
        else:
            out.logits = self.classify(x[:, 0] if self.args.pooling == "bos" else masked_mean(x, attention_mask))
        return out

    def classify(self, x: mx.array) -> mx.array:
        return self.classifier(gelu(self.dense(x)))


class EuroBertForTokenClassification(EuroBertHead):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.classifier = Linear(args.hidden_size, args.num_labels)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        out = self.encode(input_ids, attention_mask)
        out.logits = self.classifier(out.last_hidden_state)
        return out


def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Drop RoPE's inverse-frequency buffers, which some exports keep (RoPE is computed, not stored)."""
    return {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}


MODELS = {
    "encoder": EuroBertModel,
    "masked-lm": EuroBertForMaskedLM,
    "sequence-classification": EuroBertForSequenceClassification,
    "token-classification": EuroBertForTokenClassification,
}
TOKEN_TYPES = False

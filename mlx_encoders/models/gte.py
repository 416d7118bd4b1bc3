"""GTE (gte-multilingual-base, gte-base-en-v1.5, snowflake-arctic-embed-m-v2.0), matching transformers'
`modeling_gte.py`.

Nomic BERT's encoder (post-LN, rotary, gated feed-forward; models/nomic_bert.py) with biases on the attention
projections and on `down_proj`, dropout on the gated product, and token types only when type_vocab_size > 0
(gte-base-en-v1.5 has none). The masked-LM head is RoBERTa's (`lm_head`, exact gelu). `sanitize` reads the keys
Alibaba's checkpoints hold, which transformers writes too (`encoder.layer.{i}.attention.qkv_proj`,
`mlp.up_gate_proj`, ...; Alibaba's under `new.`); their config.json must say model_type "gte" (theirs says "new").
"""

from dataclasses import dataclass
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn

from .base import BaseArgs, HeadModel, MaskedLM, PooledClassification, TiedDecoder, TokenClassification
from .layers import LayerNorm, Linear, gelu
from .nomic_bert import (
    NomicBertAttention,
    NomicBertLayer,
    NomicBertMLP,
    NomicBertModel,
    RotaryArgs,
    renamed,
    rope_settings,
)


@dataclass
class ModelArgs(RotaryArgs, BaseArgs):
    heads_split_width: ClassVar[bool] = False
    model_type: str = "gte"
    vocab_size: int = 250048
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.0
    max_position_embeddings: int = 8192
    type_vocab_size: int = 1
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 1
    classifier_dropout: float | None = None
    rope_parameters: dict | None = None
    # Alibaba's own spelling, read by transformers too: `rope_theta`, and `rope_scaling` (whose "ntk" type fails).
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    head_dim: int | None = None  # transformers' attention reads it, hidden_size // heads when absent
    default_theta: ClassVar[float] = 160000.0
    # gte-multilingual-base (8192 tokens, its XLM-R vocabulary); the other keys' defaults are theirs.
    presets: ClassVar[dict] = {"multilingual-base": {}}

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "ModelArgs":
        if config.get("logn_attention_scale"):
            raise ValueError("config key 'logn_attention_scale' is true: transformers' GTE has no log-n attention")
        return super().from_dict(config)

    def __post_init__(self):
        super().__post_init__()
        self.head_size = self.head_dim or self.hidden_size // self.num_attention_heads
        key = "rope_scaling" if self.rope_scaling else "rope_parameters"
        rope = self.rope_scaling or self.rope_parameters  # transformers: a config's rope_scaling wins
        self.rope = rope_settings(rope, self.rope_theta, self.default_theta, self.max_position_embeddings, key)


class GteAttention(NomicBertAttention):
    bias = True


class GteMLP(NomicBertMLP):
    down_bias = True

    def __init__(self, args: ModelArgs):
        super().__init__(args, dropout=args.hidden_dropout_prob)


class GteLayer(NomicBertLayer):
    attention_class = GteAttention
    mlp_class = GteMLP


class GteModel(NomicBertModel):
    layer_class = GteLayer


class GteLMHead(nn.Module):
    """`decoder(layer_norm(gelu(dense(x))))`: exact gelu whatever hidden_act says; the decoder's weight is the
    word-embedding matrix unless the config unties it, its bias its own."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.dense = Linear(args.hidden_size, args.hidden_size)
        self.layer_norm = LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.decoder = TiedDecoder(args.hidden_size, args.vocab_size, args.tie_word_embeddings)

    def __call__(self, x, word_embeddings):
        return self.decoder(self.layer_norm(gelu(self.dense(x))), word_embeddings)


class GteHead(HeadModel):
    prefix = "gte"
    encoder_class = GteModel


class GteForMaskedLM(GteHead, MaskedLM):
    ignored_keys = ("lm_head.decoder.weight",)  # the tied copy of the word embeddings

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.lm_head = GteLMHead(args)


class GteForSequenceClassification(GteHead, PooledClassification):
    pass


class GteForTokenClassification(GteHead, TokenClassification):
    pass


# Alibaba's key names -> transformers' (the fused qkv_proj and up_gate_proj are split in `sanitize`).
RENAMES = (
    ("encoder.layer.", "layers."), (".attention.o_proj.", ".self_attn.o_proj."),
    (".attn_ln.", ".post_attention_layernorm."), (".mlp_ln.", ".post_mlp_layernorm."),
    ("lm_head.norm.", "lm_head.layer_norm."),
)  # fmt: skip
FUSED = {".attention.qkv_proj.": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         ".mlp.up_gate_proj.": ("mlp.up_proj", "mlp.gate_proj")}  # fmt: skip


def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """transformers' keys from Alibaba's: renamed, the fused projections cut into equal row blocks in the order
    above, rotary buffers dropped."""
    out = {}
    for key, value in weights.items():
        if key.endswith("inv_freq"):
            continue
        key = renamed(key, ("new.", "gte."), RENAMES)
        fused = next((part for part in FUSED if part in "." + key), None)
        if fused is None:
            out[key] = value
            continue
        stem, param = ("." + key).split(fused)
        for name, block in zip(FUSED[fused], mx.split(value, len(FUSED[fused]), axis=0), strict=True):
            out[f"{stem[1:]}.{name}.{param}".lstrip(".")] = block
    return out


MODELS = {
    "encoder": GteModel,
    "masked-lm": GteForMaskedLM,
    "sequence-classification": GteForSequenceClassification,
    "token-classification": GteForTokenClassification,
}


def token_types(args: ModelArgs) -> bool:
    """Token types are read where the config gives a second one (the released checkpoints have one or none)."""
    return args.type_vocab_size > 1


TOKEN_TYPES = token_types

"""Gemma 3's text model (`gemma3_text`), matching transformers' `modeling_gemma3.py`: EmbeddingGemma-300m and the
Gemma 3 text decoders.

Pre- and post-norm blocks of RMSNorm with (1 + weight), q/k norms, grouped-query attention scaled by
`query_pre_attn_scalar`, rotate-half RoPE (`layers.rope`) with one base for the sliding layers and one for the
global ones, a GeGLU MLP, and embeddings scaled by sqrt(hidden_size) in the model's dtype. With
`use_bidirectional_attention` (EmbeddingGemma) every token sees every other, and a sliding layer the keys with
|i - j| <= sliding_window // 2 (transformers halves the window for it); otherwise attention is causal, a sliding
layer seeing the `sliding_window` latest keys.
"""

from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import mlx.nn as nn

from .base import (
    BaseArgs,
    CausalLM,
    HeadModel,
    Model,
    ModelOutput,
    activation,
    embed,
    last_non_padding,
    mask_value,
    merge_heads,
    run_layer,
)
from .inputs import check_inputs
from .layers import Dropout, Embedding, GatedMLP, Linear, blockwise_attention, grouped_attention, rope
from .modernbert import ATTENTION, Band, attention_masks, banded_attention

ROPE_TYPES = ("default", "linear")  # linear: positions divided by `factor` (Gemma 3's 4B-27B global layers)


@dataclass
class ModelArgs(BaseArgs):
    model_type: str = "gemma3_text"
    causal_masks: ClassVar[bool] = True
    vocab_size: int = 262208
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 26
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-6
    pad_token_id: int | None = 0
    attention_bias: bool = False
    attention_dropout: float = 0.0
    query_pre_attn_scalar: float = 256
    sliding_window: int | None = 4096
    use_bidirectional_attention: bool = False
    # transformers-5 `layer_types` / `rope_parameters`, or the Hub's older `sliding_window_pattern` (every n-th
    # layer global), `rope_theta` (global) and `rope_local_base_freq` (sliding).
    layer_types: list[str] | None = None
    sliding_window_pattern: int | None = None
    rope_parameters: dict | None = None
    rope_theta: float | None = None
    rope_local_base_freq: float | None = None
    rope_scaling: dict | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None  # the causal-LM head's logits: cap * tanh(logits / cap)
    # google/embeddinggemma-300m; the other keys' defaults are Gemma 3's.
    presets: ClassVar[dict] = {
        "embeddinggemma-300m": dict(
            vocab_size=262144, hidden_size=768, intermediate_size=1152, num_hidden_layers=24, num_attention_heads=3,
            num_key_value_heads=1, max_position_embeddings=2048, sliding_window=512,
            use_bidirectional_attention=True, rope_theta=1000000.0, rope_local_base_freq=10000.0,
        ),
    }  # fmt: skip

    @property
    def ffn_width(self) -> int:
        return 2 * self.intermediate_size  # gate and up projections

    def __post_init__(self):
        super().__post_init__()
        n = self.sliding_window_pattern or 6
        self.attention_types = self.layer_types or [
            "sliding_attention" if (i + 1) % n else "full_attention" for i in range(self.num_hidden_layers)
        ]
        if len(self.attention_types) != self.num_hidden_layers or not set(self.attention_types) <= set(ATTENTION):
            raise ValueError(
                f"config key 'layer_types' must list one of {', '.join(ATTENTION)} for each of the "
                f"{self.num_hidden_layers} layers, got {self.layer_types!r}"
            )
        # transformers saves a bidirectional window w as (w // 2 + 1 - 1) * 2: a window of 1 (each token alone) as 0
        least = 0 if self.use_bidirectional_attention else 1
        if "sliding_attention" in self.attention_types and (self.sliding_window or 0) < least:
            raise ValueError(
                f"config key 'sliding_window' must be an integer of at least {least}: the config has sliding layers, "
                f"got {self.sliding_window!r}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config key 'num_attention_heads' ({self.num_attention_heads}) must be a multiple of "
                f"'num_key_value_heads' ({self.num_key_value_heads}): each key/value head serves a group of heads"
            )
        if self.attn_logit_softcapping is not None:
            raise ValueError(
                f"config key 'attn_logit_softcapping' is {self.attn_logit_softcapping}: soft-capped attention "
                "scores (Gemma 2) are not supported; Gemma 3 sets it to null"
            )
        self.rope = {kind: self.rope_base(kind) for kind in ATTENTION}  # (base, position scale) per layer kind

    def rope_base(self, kind: str) -> tuple[float, float]:
        legacy = {"full_attention": (self.rope_theta, 1e6), "sliding_attention": (self.rope_local_base_freq, 1e4)}
        stored, default = legacy[kind]
        params = (self.rope_parameters or {}).get(kind) or {}
        if kind == "full_attention" and self.rope_scaling:  # the older spelling of the global layers' scaling: it
            params = {**params, **self.rope_scaling}  # updates rope_parameters' entry, as transformers merges them
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"config key 'rope_parameters': {kind} rope_type {rope_type!r} is not supported; "
                f"supported: {', '.join(ROPE_TYPES)}"
            )
        factor = float(params.get("factor", 1.0)) if rope_type == "linear" else 1.0
        return float(params.get("rope_theta", stored or default)), 1.0 / factor

    @property
    def max_tokens(self) -> int:
        return self.max_position_embeddings


class Gemma3RMSNorm(nn.Module):
    """x / rms(x) * (1 + weight): the weight is stored centred on 0."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        if self.weight.dtype == mx.float32:
            return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)
        # 1 + weight in float32 and one rounding of the product, as transformers computes it in half precision
        return mx.fast.rms_norm(x, 1.0 + self.weight.astype(mx.float32), self.eps).astype(x.dtype)


class Gemma3Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_type: str):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            args.num_attention_heads, args.num_key_value_heads, args.head_dim
        )  # fmt: skip
        width = self.num_heads * self.head_dim
        self.q_proj = Linear(args.hidden_size, width, bias=args.attention_bias)
        self.k_proj = Linear(args.hidden_size, self.num_kv_heads * self.head_dim, bias=args.attention_bias)
        self.v_proj = Linear(args.hidden_size, self.num_kv_heads * self.head_dim, bias=args.attention_bias)
        self.o_proj = Linear(width, args.hidden_size, bias=args.attention_bias)
        self.q_norm = Gemma3RMSNorm(self.head_dim, args.rms_norm_eps)
        self.k_norm = Gemma3RMSNorm(self.head_dim, args.rms_norm_eps)
        self.theta, self.position_scale = args.rope[layer_type]
        # The attention kernels scale scores by head_dim ** -0.5: the queries carry the rest of Gemma's scale.
        self.query_factor = args.query_pre_attn_scalar**-0.5 * self.head_dim**0.5
        self.dropout = Dropout(args.attention_dropout)

    def __call__(self, x: mx.array, mask) -> mx.array:
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.num_heads, -1)).transpose(0, 2, 1, 3)  # (B, nh, L, hd)
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.num_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.num_kv_heads, -1).transpose(0, 2, 1, 3)  # (B, nkv, L, hd)
        q, k = (rope(t, self.theta, self.position_scale) for t in (q, k))
        if self.query_factor != 1:
            q = q * self.query_factor
        attend = banded_attention if isinstance(mask, Band) else blockwise_attention  # O(L w), O(L) memory
        return self.o_proj(merge_heads(grouped_attention(q, k, v, mask, self.dropout, attend=attend)))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, index: int):
        super().__init__()
        self.sliding = args.attention_types[index] == "sliding_attention"
        self.self_attn = Gemma3Attention(args, args.attention_types[index])
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, activation(args.hidden_activation))
        self.input_layernorm = Gemma3RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = Gemma3RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.pre_feedforward_layernorm = Gemma3RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_feedforward_layernorm = Gemma3RMSNorm(args.hidden_size, args.rms_norm_eps)

    def __call__(self, x: mx.array, masks) -> mx.array:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), masks[self.sliding]))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


def causal_masks(attention_mask: mx.array | None, L: int, window: int | None, dtype) -> tuple[mx.array, mx.array]:
    """Additive (B|1, 1, L, L) (global, sliding) causal masks: key j <= i, and i - j < window on sliding layers."""
    distance = mx.arange(L)[:, None] - mx.arange(L)[None]  # query minus key
    keys = mx.ones((1, 1, 1, L), mx.bool_) if attention_mask is None else attention_mask.astype(mx.bool_)[:, None, None]
    full = (distance >= 0) & keys
    sliding = full & (distance < (window or L))
    zero, neg = mx.array(0, dtype), mx.array(mask_value(dtype), dtype)
    return mx.where(full, zero, neg), mx.where(sliding, zero, neg)


class Gemma3TextModel(Model, nn.Module):
    gradient_checkpointing = False

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.layers = [Gemma3DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = Gemma3RMSNorm(args.hidden_size, args.rms_norm_eps)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        check_inputs(self.args, input_ids, attention_mask, token_type_ids)  # RoPE: no position table to outgrow
        dtype = self.norm.weight.dtype  # quantized tables return their scales' dtype
        pad = self.args.pad_token_id
        x = (self.embed_tokens(input_ids) if pad is None else embed(self.embed_tokens, input_ids, pad)).astype(dtype)
        x = x * mx.array(self.args.hidden_size**0.5, dtype)  # transformers rounds the scale to the model's dtype
        L = x.shape[1]
        if self.args.use_bidirectional_attention:  # without sliding layers the window is unused: the whole text
            window = self.args.sliding_window
            masks = attention_masks(attention_mask, L, L if window is None else window // 2, dtype)
        else:
            masks = causal_masks(attention_mask, L, self.args.sliding_window, dtype)
        for layer in self.layers:
            x = run_layer(layer, x, masks, checkpoint=self.gradient_checkpointing)
        return ModelOutput(last_hidden_state=self.norm(x))


class Gemma3TextForSequenceClassification(HeadModel):
    """`score` on the last token that is not `pad_token_id` (transformers' GenericForSequenceClassification)."""

    prefix = "model"
    encoder_class = Gemma3TextModel

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.score = Linear(args.hidden_size, args.num_labels, bias=False)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        out = self.encode(input_ids, attention_mask)
        B = input_ids.shape[0]
        last = last_non_padding(input_ids, self.args.pad_token_id, attention_mask, "Gemma 3")
        out.logits = self.score(out.last_hidden_state[mx.arange(B), last])
        return out


class Gemma3ForCausalLM(CausalLM):
    """Next-token logits, soft-capped to (-cap, cap) by cap * tanh(logits / cap) when the config sets
    `final_logit_softcapping`."""

    encoder_class = Gemma3TextModel

    def predict_tokens(self, hidden: mx.array) -> mx.array:
        logits = super().predict_tokens(hidden)
        cap = self.args.final_logit_softcapping
        return logits if cap is None else mx.tanh(logits / cap) * cap


def init_std(path: str, args: ModelArgs) -> tuple[float, None]:
    return args.initializer_range, None  # transformers' _init_weights: normal(0, initializer_range) for linears


MODELS = {
    "encoder": Gemma3TextModel,
    "sequence-classification": Gemma3TextForSequenceClassification,
    "causal-lm": Gemma3ForCausalLM,
}
TOKEN_TYPES = False

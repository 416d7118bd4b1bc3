"""EmbeddingGemma 2, text only, matching transformers' `modeling_embedding_gemma2.py`.

A bidirectional Gemma encoder: RMSNorm (x * weight) before and after attention and the MLP, q/k norms and a
scale-free v norm, grouped-query attention with no score scaling, rotate-half RoPE with one base per layer kind,
and global layers with their own head size and key/value heads (`per_layer_config`). Sliding layers see the keys
with |i - j| <= `sliding_window` (a radius). Projection-only per-layer inputs (PLE): the scaled token embeddings
are projected to one `hidden_size_per_layer_input`-wide vector per layer, which gates a third residual block in
that layer. The final hidden states are projected to `embedding_dim` (`embedding_projection`), so
`last_hidden_state` is (B, L, embedding_dim), which sentence-transformers mean-pools and normalizes.

Two checkpoint layouts: the text backbone alone (`embedding_gemma2_text`, `EmbeddingGemma2TextModel`) and the
published multimodal model (`embedding_gemma2`, `EmbeddingGemma2Model`: the backbone under `language_model.` and
config.json's `text_config`). Images, audio and video are out of scope: their towers' weights are not read, and
inputs that carry them are refused, naming the input.
"""

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .base import BaseArgs, HeadModel, Model, ModelOutput, activation, embed, merge_heads, run_layer
from .inputs import check_inputs, checking_off
from .layers import Dropout, Embedding, GatedMLP, Linear, blockwise_attention, grouped_attention, rope
from .modernbert import ATTENTION, Band, attention_masks, banded_attention

COMPOSITE = "embedding_gemma2"
TOWERS = ("vision_tower.", "embed_vision.", "audio_tower.", "embed_audio.")  # weights of the modalities not run
PLACEHOLDERS = {"image_token_id": "image", "video_token_id": "video", "audio_token_id": "audio"}
MODALITY_INPUTS = ("pixel_values", "pixel_values_videos", "input_features")
PER_LAYER_KEYS = ("head_dim", "num_key_value_heads")


@dataclass
class ModelArgs(BaseArgs):
    model_type: str = "embedding_gemma2_text"
    vocab_size: int = 262144
    hidden_size: int = 512
    intermediate_size: int = 2048
    num_hidden_layers: int = 24
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 256
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 262144
    rms_norm_eps: float = 1e-6
    pad_token_id: int | None = 0
    attention_bias: bool = False
    attention_dropout: float = 0.0
    sliding_window: int = 512
    hidden_size_per_layer_input: int = 512
    embedding_dim: int = 768
    layer_types: list[str] | None = None
    rope_parameters: dict | None = None
    # transformers writes `per_layer_config` ({layer index: {head_dim, num_key_value_heads}}); a config without it
    # gives every global layer `global_head_dim` (512) and `num_global_key_value_heads` (1), as transformers does.
    per_layer_config: dict | None = None
    sliding_window_pattern: int | None = None
    global_head_dim: int | None = None
    num_global_key_value_heads: int | None = None
    # The multimodal config's placeholder ids: input_ids holding them would need a tower.
    image_token_id: int | None = None
    video_token_id: int | None = None
    audio_token_id: int | None = None

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "ModelArgs":
        """A text backbone's config.json as it is; a multimodal one's `text_config`, with its own keys on top
        (kept apart, so `to_config` writes the same nesting back)."""
        if "text_config" not in config:
            return super().from_dict(config)
        text = config["text_config"] or {}
        if not isinstance(text, dict):
            raise ValueError(f"config key 'text_config' must be an object, got {type(text).__name__}")
        outer = {k: v for k, v in config.items() if k != "text_config"}
        args = super().from_dict({**text, **outer})
        args.text_keys = set(text) - set(outer)
        return args

    def to_config(self) -> dict[str, Any]:
        config = super().to_config()
        if self.model_type != COMPOSITE:
            return config
        text_fields = self.field_names() - {"model_type", *PLACEHOLDERS} - set(BaseArgs.__dataclass_fields__)
        inner = {k: config.pop(k) for k in list(config) if k in self.text_keys | text_fields}
        # the towers are not kept: transformers builds the text model alone from this config
        return {**config, "vision_config": None, "audio_config": None,
                "text_config": {**inner, "model_type": "embedding_gemma2_text"}}  # fmt: skip

    @property
    def ffn_width(self) -> int:
        return 2 * self.intermediate_size

    @property
    def max_tokens(self) -> int:
        return self.max_position_embeddings

    @property
    def output_size(self) -> int:
        return self.embedding_dim  # the projected last_hidden_state

    def __post_init__(self):
        super().__post_init__()
        self.text_keys: set[str] = set()
        n = self.sliding_window_pattern or 6
        pattern = ["sliding_attention" if (i + 1) % n else "full_attention" for i in range(self.num_hidden_layers)]
        types = list(self.layer_types or pattern)
        if len(types) != self.num_hidden_layers or not set(types) <= set(ATTENTION):
            raise ValueError(
                f"config key 'layer_types' must list one of {', '.join(ATTENTION)} for each of the "
                f"{self.num_hidden_layers} layers, got {self.layer_types!r}"
            )
        types[-1] = "full_attention"  # transformers forces it (with a warning): the last layer sees every token
        self.attention_types = types
        self.layer_shapes = [self.layer_shape(i) for i in range(self.num_hidden_layers)]
        self.rope_theta = {kind: self.rope_base(kind) for kind in set(types)}

    def layer_shape(self, index: int) -> tuple[int, int]:
        """(head_dim, num_key_value_heads) of layer `index`."""
        if self.per_layer_config is None:
            if self.attention_types[index] == "full_attention":
                return self.global_head_dim or 512, self.num_global_key_value_heads or 1
            return self.head_dim, self.num_key_value_heads
        own = self.per_layer_config.get(str(index)) or self.per_layer_config.get(index) or {}
        unknown = set(own) - set(PER_LAYER_KEYS)
        if unknown:
            raise ValueError(
                f"config key 'per_layer_config': layer {index} sets {', '.join(sorted(unknown))}; only "
                f"{', '.join(PER_LAYER_KEYS)} may differ between layers here"
            )
        head_dim, kv_heads = (
            own.get("head_dim", self.head_dim),
            own.get("num_key_value_heads", self.num_key_value_heads),
        )
        if self.num_attention_heads % kv_heads:
            raise ValueError(
                f"layer {index}: num_attention_heads ({self.num_attention_heads}) must be a multiple of its "
                f"num_key_value_heads ({kv_heads}): each key/value head serves a group of heads"
            )
        return head_dim, kv_heads

    def rope_base(self, kind: str) -> float:
        default = {"full_attention": 1e6, "sliding_attention": 1e4}[kind]
        params = (self.rope_parameters or {}).get(kind) or {}
        if params.get("rope_type", "default") != "default":
            raise ValueError(
                f"config key 'rope_parameters': {kind} rope_type {params['rope_type']!r} is not supported "
                "(only 'default')"
            )
        return float(params.get("rope_theta", default))


class EmbeddingGemma2RMSNorm(nn.Module):
    """x / rms(x) * weight; without `scale`, no weight (the value norm)."""

    def __init__(self, dims: int, eps: float, scale: bool = True):
        super().__init__()
        if scale:
            self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self.get("weight"), self.eps)


class EmbeddingGemma2Attention(nn.Module):
    def __init__(self, args: ModelArgs, index: int):
        super().__init__()
        self.head_dim, self.num_kv_heads = args.layer_shapes[index]
        self.num_heads = args.num_attention_heads
        width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = Linear(args.hidden_size, width, bias=args.attention_bias)
        self.k_proj = Linear(args.hidden_size, kv_width, bias=args.attention_bias)
        self.v_proj = Linear(args.hidden_size, kv_width, bias=args.attention_bias)
        self.o_proj = Linear(width, args.hidden_size, bias=args.attention_bias)
        self.q_norm = EmbeddingGemma2RMSNorm(self.head_dim, args.rms_norm_eps)
        self.k_norm = EmbeddingGemma2RMSNorm(self.head_dim, args.rms_norm_eps)
        self.v_norm = EmbeddingGemma2RMSNorm(self.head_dim, args.rms_norm_eps, scale=False)
        self.theta = args.rope_theta[args.attention_types[index]]
        self.dropout = Dropout(args.attention_dropout)

    def __call__(self, x: mx.array, mask) -> mx.array:
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.num_heads, -1)).transpose(0, 2, 1, 3)  # (B, nh, L, hd)
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.num_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_norm(self.v_proj(x).reshape(B, L, self.num_kv_heads, -1)).transpose(0, 2, 1, 3)
        q, k = rope(q, self.theta), rope(k, self.theta)
        q = q * self.head_dim**0.5  # scores are unscaled q.k; the attention kernels divide by sqrt(head_dim)
        attend = banded_attention if isinstance(mask, Band) else blockwise_attention  # O(L w), O(L) memory
        return self.o_proj(merge_heads(grouped_attention(q, k, v, mask, self.dropout, attend=attend)))


class EmbeddingGemma2TextPLE(nn.Module):
    """The per-layer inputs: the embeddings projected to (B, L, layers, hidden_size_per_layer_input), normed."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.shape = (args.num_hidden_layers, args.hidden_size_per_layer_input)
        self.per_layer_model_projection = Linear(args.hidden_size, self.shape[0] * self.shape[1], bias=False)
        self.scale = args.hidden_size**-0.5
        self.per_layer_projection_norm = EmbeddingGemma2RMSNorm(self.shape[1], args.rms_norm_eps)

    def __call__(self, embeddings: mx.array) -> mx.array:
        x = self.per_layer_model_projection(embeddings) * self.scale
        return self.per_layer_projection_norm(x.reshape(*embeddings.shape[:-1], *self.shape))


class EmbeddingGemma2TextPLEBlock(nn.Module):
    """The third residual block: the hidden state, narrowed and activated, gated by this layer's input."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.per_layer_input_gate = Linear(args.hidden_size, args.hidden_size_per_layer_input, bias=False)
        self.per_layer_projection = Linear(args.hidden_size_per_layer_input, args.hidden_size, bias=False)
        self.post_per_layer_input_norm = EmbeddingGemma2RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.act = activation(args.hidden_activation)

    def __call__(self, x: mx.array, per_layer_input: mx.array) -> mx.array:
        gated = self.act(self.per_layer_input_gate(x)) * per_layer_input
        return x + self.post_per_layer_input_norm(self.per_layer_projection(gated))


class EmbeddingGemma2EncoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, index: int):
        super().__init__()
        self.sliding = args.attention_types[index] == "sliding_attention"
        self.self_attn = EmbeddingGemma2Attention(args, index)
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, activation(args.hidden_activation))
        self.input_layernorm = EmbeddingGemma2RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = EmbeddingGemma2RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.pre_feedforward_layernorm = EmbeddingGemma2RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_feedforward_layernorm = EmbeddingGemma2RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.ple_block = EmbeddingGemma2TextPLEBlock(args)
        self.layer_scalar = mx.ones((1,))
        self.freeze(keys=["layer_scalar"], recurse=False)  # a stored buffer in transformers, never trained

    def __call__(self, x: mx.array, per_layer_input: mx.array, masks) -> mx.array:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), masks[self.sliding]))
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return self.ple_block(x, per_layer_input) * self.layer_scalar


class EmbeddingGemma2TextModel(Model, nn.Module):
    gradient_checkpointing = False

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.layers = [EmbeddingGemma2EncoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = EmbeddingGemma2RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.ple = EmbeddingGemma2TextPLE(args)
        self.embedding_projection = Linear(args.hidden_size, args.embedding_dim, bias=False)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        check_inputs(self.args, input_ids, attention_mask, token_type_ids)  # RoPE: no position table to outgrow
        dtype = self.norm.weight.dtype  # quantized tables return their scales' dtype
        pad = self.args.pad_token_id
        x = (self.embed_tokens(input_ids) if pad is None else embed(self.embed_tokens, input_ids, pad)).astype(dtype)
        x = x * mx.array(self.args.hidden_size**0.5, dtype)  # transformers rounds the scale to the model's dtype
        per_layer_inputs = self.ple(x)  # (B, L, layers, hidden_size_per_layer_input)
        masks = attention_masks(attention_mask, x.shape[1], self.args.sliding_window, dtype)
        for i, layer in enumerate(self.layers):
            x = run_layer(layer, x, per_layer_inputs[:, :, i], masks, checkpoint=self.gradient_checkpointing)
        return ModelOutput(last_hidden_state=self.embedding_projection(self.norm(x)))


class EmbeddingGemma2Model(HeadModel):
    """The multimodal checkpoint's model on text: its backbone under `language_model`."""

    prefix = "language_model"
    encoder_class = EmbeddingGemma2TextModel

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None, **modalities) -> ModelOutput:
        given = [name for name in modalities if modalities[name] is not None]
        if given:
            known = [name for name in given if name in MODALITY_INPUTS]
            raise ValueError(
                f"{', '.join(known or given)}: EmbeddingGemma 2 runs on text only here; images, audio and video "
                "(pixel_values, pixel_values_videos, input_features) are not supported. Embed the text alone."
                if known
                else f"unexpected inputs {', '.join(given)}; EmbeddingGemma 2 takes input_ids and attention_mask"
            )
        self.refuse_placeholders(input_ids)
        return self.encode(input_ids, attention_mask)

    def refuse_placeholders(self, input_ids: mx.array) -> None:
        """Ids that stand for an image, a video or an audio clip would need its tower: refused, naming it."""
        ids = {getattr(self.args, key): kind for key, kind in PLACEHOLDERS.items() if getattr(self.args, key)}
        if not ids or checking_off() or not isinstance(input_ids, mx.array):
            return
        found = np.isin(np.asarray(input_ids), list(ids))
        if found.any():
            token = int(np.asarray(input_ids)[found][0])
            raise ValueError(
                f"input_ids holds {token}, the {ids[token]} placeholder token: EmbeddingGemma 2 runs on text only "
                "here, and images, audio and video are not supported. Remove the placeholder from the text."
            )


def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Leave out the image and audio towers' weights: only the text model runs."""
    return {k: v for k, v in weights.items() if not k.startswith(TOWERS)}


def init_std(path: str, args: ModelArgs) -> tuple[float, None]:
    return args.initializer_range, None  # transformers' _init_weights: normal(0, initializer_range) for linears


MODELS = {"encoder": EmbeddingGemma2Model}
TOKEN_TYPES = False

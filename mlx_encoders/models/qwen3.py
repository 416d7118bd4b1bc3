"""Qwen3, matching transformers' `modeling_qwen3.py`: a decoder used as an encoder (Qwen3-Embedding) and scored
through its language-model head (Qwen3-Reranker).

Pre-norm causal blocks with RMSNorm, grouped-query attention whose queries and keys are RMS-normalised per head
before rotary embeddings (rotate-half form, `layers.rope`), and a SwiGLU MLP. Positions are `arange(L)` whatever
the padding, as transformers' forward: rotary scores depend only on the distance between tokens, so a
left-padded row equals the same text alone. No key/value cache: these models encode, they do not generate.
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
    causal_mask,
    embed,
    last_non_padding,
    merge_heads,
    padding_mask,
    run_layer,
    span_logits,
    split_heads,
)
from .inputs import check_inputs
from .layers import Dropout, Embedding, GatedMLP, Linear, attention, grouped_attention, rope

LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class ModelArgs(BaseArgs):
    model_type: str = "qwen3"
    causal_masks: ClassVar[bool] = True
    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None: one key/value head per query head
    head_dim: int = 128  # not hidden_size / heads: transformers' default is 128 whatever the width
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None  # transformers 5; older files say rope_theta / rope_scaling
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    attention_bias: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    max_window_layers: int = 28
    layer_types: list[str] | None = None
    attention_dropout: float = 0.0
    classifier_dropout: float | None = None  # token classification: 0.1 when unset, as transformers
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # Qwen3-Embedding-{0.6B,4B,8B} (and the rerankers of the same sizes); the other keys' defaults are theirs.
    presets: ClassVar[dict] = {
        name: dict(
            vocab_size=151669, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            hidden_size=hidden, intermediate_size=inner, num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=8, tie_word_embeddings=tied,
        )
        for name, hidden, inner, layers, heads, tied in (
            ("0.6b", 1024, 3072, 28, 16, True), ("4b", 2560, 9728, 36, 32, True), ("8b", 4096, 12288, 36, 32, False),
        )
    }  # fmt: skip

    def __post_init__(self):
        super().__post_init__()
        heads, kv = self.num_attention_heads, self.num_key_value_heads or self.num_attention_heads
        if kv <= 0 or heads % kv:
            raise ValueError(
                f"config key 'num_key_value_heads' ({kv}) must divide num_attention_heads ({heads}): each key/value "
                "head serves the same number of query heads"
            )
        self.kv_heads = kv
        rope = self.rope_scaling or self.rope_parameters or {}  # transformers: a config's rope_scaling wins
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(
                f"Qwen3 rope_type {rope.get('rope_type', rope.get('type'))!r} is not supported (only 'default'); "
                "the published Qwen3-Embedding and Qwen3-Reranker checkpoints use 'default'"
            )
        self.theta = float(rope.get("rope_theta", self.rope_theta or 10000.0))
        self.window = self.sliding_window if self.use_sliding_window else None  # transformers ignores it otherwise
        self.attention_types = self.layer_types or [
            "sliding_attention" if self.window is not None and i >= self.max_window_layers else "full_attention"
            for i in range(self.num_hidden_layers)
        ]
        if len(self.attention_types) != self.num_hidden_layers or not set(self.attention_types) <= set(LAYER_TYPES):
            raise ValueError(
                f"config key 'layer_types' must list one of {', '.join(LAYER_TYPES)} for each of the "
                f"{self.num_hidden_layers} layers, got {self.layer_types!r}"
            )

    @property
    def causal(self) -> bool:
        """Each token sees only itself and the tokens before it: the sentence embedding is the last token's."""
        return True


class Qwen3Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.theta = (
            args.num_attention_heads, args.kv_heads, args.head_dim, args.theta
        )  # fmt: skip
        inner, kv_inner = self.heads * args.head_dim, self.kv_heads * args.head_dim
        self.q_proj = Linear(args.hidden_size, inner, bias=args.attention_bias)
        self.k_proj = Linear(args.hidden_size, kv_inner, bias=args.attention_bias)
        self.v_proj = Linear(args.hidden_size, kv_inner, bias=args.attention_bias)
        self.o_proj = Linear(inner, args.hidden_size, bias=args.attention_bias)
        self.q_norm = nn.RMSNorm(args.head_dim, eps=args.rms_norm_eps)  # per head, before the rotation
        self.k_norm = nn.RMSNorm(args.head_dim, eps=args.rms_norm_eps)
        self.dropout = Dropout(args.attention_dropout)

    def __call__(self, x: mx.array, mask: mx.array | None, sliding: bool) -> mx.array:
        """`mask`: the (B, 1, 1, L) padding mask, to which full-attention layers add causality themselves (by
        blocks of queries on long inputs: O(L) memory); a sliding layer's whole (B, 1, L, L) mask."""
        q = self.q_norm(split_heads(self.q_proj(x), self.heads))  # (B, nh, L, hd)
        k = self.k_norm(split_heads(self.k_proj(x), self.kv_heads))  # (B, nkv, L, hd)
        v = split_heads(self.v_proj(x), self.kv_heads)
        q, k = rope(q, self.theta), rope(k, self.theta)
        if sliding:
            return self.o_proj(merge_heads(grouped_attention(q, k, v, mask, self.dropout, attend=attention)))
        return self.o_proj(merge_heads(grouped_attention(q, k, v, mask, self.dropout, causal=True)))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, index: int):
        super().__init__()
        # without use_sliding_window, transformers gives "sliding_attention" layers the causal mask alone
        self.sliding = args.attention_types[index] == "sliding_attention" and args.window is not None
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.self_attn = Qwen3Attention(args)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, activation(args.hidden_act))

    def __call__(self, x: mx.array, masks: tuple[mx.array, mx.array]) -> mx.array:
        x = x + self.self_attn(self.input_layernorm(x), masks[self.sliding], self.sliding)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(Model, nn.Module):
    gradient_checkpointing = False

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.layers = [Qwen3DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        check_inputs(self.args, input_ids, attention_mask, token_type_ids)  # RoPE: no position table to outgrow
        pad = self.args.pad_token_id  # transformers' nn.Embedding(padding_idx=pad): no gradient to that row
        x = self.embed_tokens(input_ids) if pad is None else embed(self.embed_tokens, input_ids, pad)
        x = x.astype(self.norm.weight.dtype)  # quantized tables return their scales' dtype
        window = self.args.window
        masks = (
            padding_mask(attention_mask, x.dtype),
            causal_mask(attention_mask, x.shape[1], 0, x.dtype, window) if window else None,
        )
        for layer in self.layers:
            x = run_layer(layer, x, masks, checkpoint=self.gradient_checkpointing)
        return ModelOutput(last_hidden_state=self.norm(x))


class Qwen3Head(HeadModel):
    prefix = "model"
    encoder_class = Qwen3Model


class Qwen3ForCausalLM(CausalLM):
    """Next-token logits: the reranker's scores are the logits of "yes" and "no" after the last token."""

    encoder_class = Qwen3Model


class Qwen3ForSequenceClassification(Qwen3Head):
    """`score` (no bias) on the hidden state of each row's last token that is not `pad_token_id`."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.score = Linear(args.hidden_size, args.num_labels, bias=False)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        out = self.encode(input_ids, attention_mask)
        last = last_non_padding(input_ids, self.args.pad_token_id, attention_mask, "Qwen3")
        pooled = mx.take_along_axis(out.last_hidden_state, last[:, None, None], axis=1)[:, 0]
        out.logits = self.score(pooled)
        return out


class Qwen3ForTokenClassification(Qwen3Head):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.dropout = Dropout(0.1 if args.classifier_dropout is None else args.classifier_dropout)
        self.score = Linear(args.hidden_size, args.num_labels)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        out = self.encode(input_ids, attention_mask)
        out.logits = self.score(self.dropout(out.last_hidden_state))
        return out


class Qwen3ForQuestionAnswering(Qwen3Head):
    prefix = "transformer"  # transformers keeps this older name for Qwen3's span head

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.qa_outputs = Linear(args.hidden_size, 2)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        out = self.encode(input_ids, attention_mask)
        return span_logits(out, self.qa_outputs(out.last_hidden_state))


MODELS = {
    "encoder": Qwen3Model,
    "causal-lm": Qwen3ForCausalLM,
    "sequence-classification": Qwen3ForSequenceClassification,
    "token-classification": Qwen3ForTokenClassification,
    "question-answering": Qwen3ForQuestionAnswering,
}
TOKEN_TYPES = False

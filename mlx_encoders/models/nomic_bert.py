"""Nomic BERT (nomic-embed-text-v1 / v1.5), matching transformers' `modeling_nomic_bert.py`.

A post-LN BERT without a position table: rotary positions (`layers.rope`, rotate-half form) on queries and keys,
bias-free projections and a SwiGLU feed-forward `down(act(gate(x)) * up(x))`. Attribute names are transformers'
module names; `sanitize` renames the keys nomic-ai's checkpoints hold, which transformers writes too
(`encoder.layers.{i}.attn.Wqkv`, `mlp.fc11`, ...), and `ModelArgs.from_dict` reads nomic-ai's config names
(`n_embd`, `rotary_emb_base`, ...). The rotary base is fixed, or grows past the trained length with transformers'
"dynamic" rope type (nomic-ai's `rotary_scaling_factor`).
"""

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import mlx.core as mx
import mlx.nn as nn

from .base import (
    BaseArgs,
    HeadModel,
    MaskedLM,
    Model,
    ModelOutput,
    PooledClassification,
    TokenClassification,
    activation,
    embed,
    merge_heads,
    padding_mask,
    run_layer,
    split_heads,
)
from .bert import (
    BertLMPredictionHead,
    BertOnlyMLMHead,
    BertPooler,
    BertPredictionHeadTransform,
    untied_decoder_bias,
)
from .inputs import check_inputs
from .layers import Dropout, Embedding, LayerNorm, Linear, blockwise_attention, rope

# nomic-ai's config names -> transformers'; the other keys of those files must hold the values below.
ORIGINAL_NAMES = {
    "n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
    "n_inner": "intermediate_size", "n_positions": "max_position_embeddings", "layer_norm_epsilon": "layer_norm_eps",
    "rotary_emb_base": "rope_theta", "resid_pdrop": "hidden_dropout_prob", "attn_pdrop": "attention_probs_dropout_prob",
}  # fmt: skip
ORIGINAL_LAYOUT = {
    "activation_function": ("swiglu",), "prenorm": (False,), "rotary_emb_fraction": (1.0,),
    "rotary_emb_interleaved": (False,), "qkv_proj_bias": (False,), "mlp_fc1_bias": (False,), "mlp_fc2_bias": (False,),
    "use_rms_norm": (False,), "parallel_block": (False,), "causal": (False,),
}  # fmt: skip


def original_config(config: dict[str, Any]) -> dict[str, Any]:
    """config.json in transformers' names, from the names nomic-ai's own files use (those keys dropped); a layout
    transformers' NomicBert cannot compute (pre-LN, partial or interleaved rotary, biases, MoE layers) fails."""
    for key, allowed in ORIGINAL_LAYOUT.items():
        if key in config and config[key] not in allowed:
            raise ValueError(
                f"config key {key!r} is {config[key]!r}; transformers' NomicBert (and mlx_encoders) computes only "
                f"{allowed[0]!r}"
            )
    if config.get("moe_every_n_layers"):
        raise ValueError("config key 'moe_every_n_layers': mixture-of-experts Nomic BERT layers are not supported")
    native = {new: config[old] for old, new in ORIGINAL_NAMES.items() if old in config and new not in config}
    if config.get("rotary_scaling_factor") is not None:  # nomic-ai's dynamic NTK rope, from max_trained_positions
        native["rope_parameters"] = {"rope_type": "dynamic", "factor": config["rotary_scaling_factor"]}
        native["max_position_embeddings"] = config.get("max_trained_positions", 2048)
    dropped = {*ORIGINAL_NAMES, *ORIGINAL_LAYOUT, "rotary_scaling_factor", "max_trained_positions"}
    return {**{k: v for k, v in config.items() if k not in dropped}, **native}


class Rope(NamedTuple):
    """Rotary settings: the base, and for transformers' "dynamic" (NTK) rope type its `factor` and the length
    trained at, past which the base grows with the input's length (as for a freshly loaded transformers model)."""

    base: float
    factor: float | None = None
    trained: int = 0

    def base_for(self, length: int, dim: int) -> float:
        if self.factor is None or length <= self.trained:
            return self.base
        return self.base * (self.factor * length / self.trained - (self.factor - 1)) ** (dim / (dim - 2))


def rope_settings(rope: dict | None, theta: float | None, default: float, trained: int, key: str) -> Rope:
    """The `Rope` of transformers' `rope_parameters` (or a legacy top-level `rope_theta`): the default rope type,
    or "dynamic" with its `factor`."""
    rope = rope or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "dynamic"):
        raise ValueError(f"config key {key!r}: rope type {kind!r} is not supported (only 'default' and 'dynamic')")
    base = float(rope.get("rope_theta", theta if theta is not None else default))
    if kind == "default":
        return Rope(base)
    if not isinstance(rope.get("factor"), (int, float)) or rope["factor"] < 1:
        raise ValueError(f"config key {key!r}: the dynamic rope type needs a 'factor' >= 1, got {rope.get('factor')!r}")
    return Rope(base, float(rope["factor"]), trained)


class RotaryArgs:
    """What Nomic BERT's and GTE's args derive alike from their config keys."""

    @property
    def sequence_classifier_dropout(self) -> float:
        """transformers' classifier heads fall back to hidden_dropout_prob when classifier_dropout is None."""
        return self.hidden_dropout_prob if self.classifier_dropout is None else self.classifier_dropout

    @property
    def token_classifier_dropout(self) -> float:
        return self.sequence_classifier_dropout

    @property
    def ffn_width(self) -> int:
        return 2 * self.intermediate_size  # the gate and the up projection, both held at once

    @property
    def padded_length_matters(self) -> bool:
        return self.rope.factor is not None

    @property
    def max_tokens(self) -> int | None:
        """No position table: max_position_embeddings is the trained length, a limit unless the dynamic rope
        type is there to run past it."""
        return None if self.rope.factor is not None else self.max_position_embeddings


@dataclass
class ModelArgs(RotaryArgs, BaseArgs):
    heads_split_width: ClassVar[bool] = False
    model_type: str = "nomic_bert"
    vocab_size: int = 30528
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "silu"
    hidden_dropout_prob: float = 0.0
    attention_probs_dropout_prob: float = 0.0
    max_position_embeddings: int = 2048
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    classifier_dropout: float | None = None
    head_dim: int | None = None
    rope_parameters: dict | None = None
    # transformers 4's spellings, which transformers 5 reads into rope_parameters
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    default_theta: ClassVar[float] = 1000.0
    # nomic-embed-text-v1 and v1.5 (8192 tokens; the other keys' defaults are theirs).
    presets: ClassVar[dict] = {"v1.5": dict(max_position_embeddings=8192)}

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "ModelArgs":
        return super().from_dict(original_config(config))

    def __post_init__(self):
        super().__post_init__()
        self.head_size = self.head_dim or self.hidden_size // self.num_attention_heads
        key = "rope_scaling" if self.rope_scaling else "rope_parameters"
        rope = self.rope_scaling or self.rope_parameters  # transformers: a config's rope_scaling wins
        self.rope = rope_settings(rope, self.rope_theta, self.default_theta, self.max_position_embeddings, key)


class NomicBertEmbeddings(nn.Module):
    """Word and token-type embeddings, LayerNorm: no position table."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.word_embeddings = Embedding(args.vocab_size, args.hidden_size)
        if args.type_vocab_size > 0:
            self.token_type_embeddings = Embedding(args.type_vocab_size, args.hidden_size)
        self.LayerNorm = LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.dropout = Dropout(args.hidden_dropout_prob)
        self.padding_idx = args.pad_token_id

    def __call__(self, input_ids, token_type_ids=None) -> mx.array:
        dtype = self.LayerNorm.weight.dtype  # quantized tables return their scales' dtype: see BertEmbeddings
        x = embed(self.word_embeddings, input_ids, self.padding_idx).astype(dtype)
        if "token_type_embeddings" in self:
            if token_type_ids is None:
                token_type_ids = mx.zeros_like(input_ids)
            x = x + self.token_type_embeddings(token_type_ids).astype(dtype)
        return self.dropout(self.LayerNorm(x))


class NomicBertAttention(nn.Module):
    bias = False  # GTE's projections carry biases

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_heads, self.head_dim, self.rope = args.num_attention_heads, args.head_size, args.rope
        width = args.num_attention_heads * args.head_size
        self.q_proj = Linear(args.hidden_size, width, bias=self.bias)
        self.k_proj = Linear(args.hidden_size, width, bias=self.bias)
        self.v_proj = Linear(args.hidden_size, width, bias=self.bias)
        self.o_proj = Linear(width, args.hidden_size, bias=self.bias)
        self.dropout = Dropout(args.attention_probs_dropout_prob)

    def __call__(self, x, mask):
        q, k, v = (split_heads(p(x), self.num_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        base = self.rope.base_for(x.shape[1], self.head_dim)
        q, k = (rope(t, base) for t in (q, k))
        return self.o_proj(merge_heads(blockwise_attention(q, k, v, mask, self.dropout)))  # O(L) memory when long


class NomicBertMLP(nn.Module):
    """SwiGLU: `down_proj(act(gate_proj(x)) * up_proj(x))`, dropout (GTE's) on the gated product."""

    down_bias = False

    def __init__(self, args: ModelArgs, dropout: float = 0.0):
        super().__init__()
        self.gate_proj = Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = Linear(args.intermediate_size, args.hidden_size, bias=self.down_bias)
        self.act = activation(args.hidden_act)
        self.dropout = Dropout(dropout)

    def __call__(self, x):
        return self.down_proj(self.dropout(self.act(self.gate_proj(x)) * self.up_proj(x)))


class NomicBertLayer(nn.Module):
    """Post-LN: `x = LN(x + attn(x))`, then `x = LN(x + mlp(x))`."""

    attention_class: type = NomicBertAttention
    mlp_class: type = NomicBertMLP

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = self.attention_class(args)
        self.mlp = self.mlp_class(args)
        self.post_attention_layernorm = LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.post_mlp_layernorm = LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.post_attention_dropout = Dropout(args.hidden_dropout_prob)
        self.post_mlp_dropout = Dropout(args.hidden_dropout_prob)

    def __call__(self, x, mask):
        x = self.post_attention_layernorm(x + self.post_attention_dropout(self.self_attn(x, mask)))
        return self.post_mlp_layernorm(x + self.post_mlp_dropout(self.mlp(x)))


class NomicBertModel(Model, nn.Module):
    """The encoder; `pooler` (tanh(dense(x[:, 0]))) only where the checkpoint has one (the classification head)."""

    gradient_checkpointing = False
    embeddings_class: type = NomicBertEmbeddings
    layer_class: type = NomicBertLayer

    def __init__(self, args: ModelArgs, add_pooling_layer: bool = False):
        super().__init__()
        self.args = args
        self.embeddings = self.embeddings_class(args)
        self.layers = [self.layer_class(args) for _ in range(args.num_hidden_layers)]
        if add_pooling_layer:
            self.pooler = BertPooler(args)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        check_inputs(self.args, input_ids, attention_mask, token_type_ids)  # rotary: no position table to outgrow
        x = self.embeddings(input_ids, token_type_ids)
        mask = padding_mask(attention_mask, x.dtype)
        for layer in self.layers:
            x = run_layer(layer, x, mask, checkpoint=self.gradient_checkpointing)
        pooled = self.pooler(x) if "pooler" in self else None
        return ModelOutput(last_hidden_state=x, pooler_output=pooled)


class NomicBertPredictionHeadTransform(BertPredictionHeadTransform):
    norm_key = "layer_norm"


class NomicBertLMPredictionHead(BertLMPredictionHead):
    transform_class = NomicBertPredictionHeadTransform


class NomicBertOnlyMLMHead(BertOnlyMLMHead):
    predictions_class = NomicBertLMPredictionHead


class NomicBertHead(HeadModel):
    prefix = "nomic_bert"
    encoder_class = NomicBertModel


class NomicBertForMaskedLM(NomicBertHead, MaskedLM):
    head = "cls.predictions"
    ignored_keys = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias")  # tied copies

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.cls = NomicBertOnlyMLMHead(args)


class NomicBertForSequenceClassification(NomicBertHead, PooledClassification):
    pass


class NomicBertForTokenClassification(NomicBertHead, TokenClassification):
    pass


# nomic-ai's key names -> transformers' (the fused Wqkv is split in `sanitize`).
RENAMES = (
    ("encoder.layers.", "layers."), ("emb_ln.", "embeddings.LayerNorm."), (".attn.out_proj.", ".self_attn.o_proj."),
    (".mlp.fc11.", ".mlp.up_proj."), (".mlp.fc12.", ".mlp.gate_proj."), (".mlp.fc2.", ".mlp.down_proj."),
    (".norm1.", ".post_attention_layernorm."), (".norm2.", ".post_mlp_layernorm."),
)  # fmt: skip


def renamed(key: str, prefixes: tuple[str, str], renames: tuple[tuple[str, str], ...]) -> str:
    """`key` with its base-model prefix `prefixes[0]` read as `prefixes[1]` and each (old, new) part replaced."""
    old_prefix, new_prefix = prefixes
    key = "." + (new_prefix + key[len(old_prefix) :] if key.startswith(old_prefix) else key)
    for old, new in renames:
        key = key.replace(old, new)
    return key[1:]


def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """transformers' keys from nomic-ai's: renamed, and `attn.Wqkv` cut into q, k and v (3 equal row blocks)."""
    out = {}
    for key, value in weights.items():
        key = renamed(key, ("bert.", "nomic_bert."), RENAMES)
        if key.endswith(".attn.Wqkv.weight"):
            stem = key[: -len("attn.Wqkv.weight")]
            for name, part in zip("qkv", mx.split(value, 3, axis=0), strict=True):
                out[f"{stem}self_attn.{name}_proj.weight"] = part
        else:
            out[key] = value
    return untied_decoder_bias(out, "cls.predictions")


MODELS = {
    "encoder": NomicBertModel,
    "masked-lm": NomicBertForMaskedLM,
    "sequence-classification": NomicBertForSequenceClassification,
    "token-classification": NomicBertForTokenClassification,
}
TOKEN_TYPES = True

"""GPT-2, matching transformers' `modeling_gpt2.py`: pre-LN causal blocks and a key/value cache for generation.

Attribute names are the checkpoint's keys. The checkpoint stores its Conv1D weights as [in, out]: `sanitize`
turns them into nn.Linear's [out, in] on load and `checkpoint_weights` turns them back for writing, so
transformers reads what `save` writes. Positions default to `offset + arange(L)`, as transformers' forward;
`generate` passes the left-padding-aware positions transformers' `generate` computes (`cumsum(mask) - 1`).
"""

from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import mlx.nn as nn

from . import inputs
from .base import (
    ACTIVATIONS,
    BaseArgs,
    HeadModel,
    Model,
    ModelOutput,
    activation,
    causal_mask,
    last_non_padding,
    merge_heads,
    run_layer,
    split_heads,
)
from .cache import KVCache
from .inputs import check_inputs, outside
from .layers import Dropout, Embedding, LayerNorm, Linear, attention, linear

# Conv1D modules: their weights are stored [in, out] in transformers checkpoints.
CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
DROPOUTS = ("resid_pdrop", "embd_pdrop", "attn_pdrop")


@dataclass
class ModelArgs(BaseArgs):
    model_type: str = "gpt2"
    causal_masks: ClassVar[bool] = True
    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None
    activation_function: str = "gelu_new"
    resid_pdrop: float = 0.1
    embd_pdrop: float = 0.1
    attn_pdrop: float = 0.1
    layer_norm_epsilon: float = 1e-5
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    reorder_and_upcast_attn: bool = False
    add_cross_attention: bool = False
    bos_token_id: int | None = 50256
    eos_token_id: int | list[int] | None = 50256
    pad_token_id: int | None = None
    # OpenAI's four sizes; "tiny" (2 layers, 128 wide, 2 heads: BERT-tiny's shape) is for tests and quick runs.
    presets: ClassVar[dict] = {
        name: dict(n_layer=layers, n_embd=width, n_head=heads)
        for name, layers, width, heads in (
            ("tiny", 2, 128, 2), ("small", 12, 768, 12), ("medium", 24, 1024, 16), ("large", 36, 1280, 20),
            ("xl", 48, 1600, 25),
        )
    }  # fmt: skip

    def check(self) -> None:
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"config key {name!r} must be a positive integer, got {value}")
        if self.activation_function not in ACTIVATIONS:
            raise ValueError(
                f"config key 'activation_function': unsupported activation {self.activation_function!r}; "
                f"supported: {', '.join(ACTIVATIONS)}"
            )
        for name in DROPOUTS:
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"config key {name!r} is a probability below 1, got {getattr(self, name)}")
        if self.add_cross_attention:
            raise ValueError(
                "config key 'add_cross_attention' is true: GPT-2 as the decoder of an encoder-decoder model "
                "(cross-attention layers) is not supported; only the plain causal language model is"
            )
        super().check()

    @property
    def hidden_size(self) -> int:
        return self.n_embd

    @property
    def attention_heads(self) -> int:
        return self.n_head

    @property
    def ffn_width(self) -> int:
        return 4 * self.n_embd if self.n_inner is None else self.n_inner

    @property
    def max_tokens(self) -> int:
        return self.n_positions


class GPT2Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.n_head = args.n_head
        self.c_attn = Linear(args.n_embd, 3 * args.n_embd)
        self.c_proj = Linear(args.n_embd, args.n_embd)
        self.attn_dropout = Dropout(args.attn_pdrop)
        self.resid_dropout = Dropout(args.resid_pdrop)
        head_dim = args.n_embd // args.n_head
        scale = head_dim**-0.5 if args.scale_attn_weights else 1.0
        if args.scale_attn_by_inverse_layer_idx:
            scale /= layer_idx + 1
        self.query_factor = scale * head_dim**0.5  # `attention` scales by head_dim**-0.5: the queries take the rest
        self.upcast = args.reorder_and_upcast_attn  # scores in float32 whatever the dtype (they already are on CPU)

    def __call__(self, x: mx.array, mask: mx.array | None, cache: KVCache | None = None) -> mx.array:
        q, k, v = (split_heads(t, self.n_head) for t in mx.split(self.c_attn(x), 3, axis=-1))  # (B, nh, L, hd)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)  # (B, nh, offset + L, hd)
        if self.query_factor != 1:
            q = q * self.query_factor
        if self.upcast:
            q, k, v = (t.astype(mx.float32) for t in (q, k, v))
        h = attention(q, k, v, mask, self.attn_dropout).astype(x.dtype)
        return self.resid_dropout(self.c_proj(merge_heads(h)))


class GPT2MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.c_fc = Linear(args.n_embd, args.ffn_width)
        self.c_proj = Linear(args.ffn_width, args.n_embd)
        self.act = activation(args.activation_function)
        self.dropout = Dropout(args.resid_pdrop)

    def __call__(self, x: mx.array) -> mx.array:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class GPT2Block(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.ln_1 = LayerNorm(args.n_embd, eps=args.layer_norm_epsilon)
        self.attn = GPT2Attention(args, layer_idx)
        self.ln_2 = LayerNorm(args.n_embd, eps=args.layer_norm_epsilon)
        self.mlp = GPT2MLP(args)

    def __call__(self, x: mx.array, mask: mx.array | None, cache: KVCache | None = None) -> mx.array:
        x = x + self.attn(self.ln_1(x), mask, cache)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(Model, nn.Module):
    gradient_checkpointing = False

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.wte = Embedding(args.vocab_size, args.n_embd)
        self.wpe = Embedding(args.n_positions, args.n_embd)
        self.drop = Dropout(args.embd_pdrop)
        self.h = [GPT2Block(args, i) for i in range(args.n_layer)]
        self.ln_f = LayerNorm(args.n_embd, eps=args.layer_norm_epsilon)

    def __call__(
        self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, cache=None
    ) -> ModelOutput:
        """`attention_mask` covers the cached tokens and the new ones, (B, offset + L), as in transformers."""
        offset = cache[0].offset if cache else 0
        self.check(input_ids, attention_mask, token_type_ids, position_ids, offset)
        L = input_ids.shape[1]
        if position_ids is None:
            position_ids = mx.arange(offset, offset + L)[None]
        dtype = self.ln_f.weight.dtype  # quantized tables return their scales' dtype
        x = self.wte(input_ids).astype(dtype) + self.wpe(position_ids).astype(dtype)
        if token_type_ids is not None:  # transformers embeds GPT-2's token types with the word table
            x = x + self.wte(token_type_ids).astype(dtype)
        x = self.drop(x)
        mask = causal_mask(attention_mask, L, offset, x.dtype)
        for i, block in enumerate(self.h):
            if cache is None:
                x = run_layer(block, x, mask, checkpoint=self.gradient_checkpointing)
            else:
                x = block(x, mask, cache[i])
        return ModelOutput(last_hidden_state=self.ln_f(x))

    def check(self, input_ids, attention_mask, token_type_ids, position_ids, offset: int) -> None:
        """check_inputs' checks, plus a mask spanning the cached and new tokens, and positions within the table."""
        check_inputs(self.args, input_ids, None, token_type_ids)
        expected = (input_ids.shape[0], offset + input_ids.shape[1])
        if attention_mask is not None and tuple(attention_mask.shape) != expected:
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)}, but {offset} cached and {input_ids.shape[1]} "
                f"new tokens need {expected}: one column per cached and per new token"
            )
        n = self.args.n_positions
        if position_ids is None and offset + input_ids.shape[1] > n:
            raise ValueError(
                f"input of {offset + input_ids.shape[1]} tokens is longer than the {n} positions of the model's "
                f"position table (n_positions={n}); truncate it, e.g. tokenizer(..., truncation=True, max_length={n})"
            )
        bad = outside(position_ids, n) if position_ids is not None and not inputs.checking_off() else None
        if bad is not None:
            raise ValueError(f"position_ids holds {bad}, outside the model's {n} positions (n_positions={n})")
        if token_type_ids is not None and outside(token_type_ids, self.args.vocab_size) is not None:
            raise ValueError(f"token_type_ids index GPT-2's word table: they must be below {self.args.vocab_size}")


class GPT2Head(HeadModel):
    prefix = "transformer"
    encoder_class = GPT2Model


class GPT2LMHeadModel(GPT2Head):
    """Next-token logits; the head is the word-embedding matrix unless `tie_word_embeddings` is false."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        if not args.tie_word_embeddings:
            self.lm_head = Linear(args.n_embd, args.vocab_size, bias=False)

    @property
    def ignored_keys(self) -> tuple[str, ...]:
        return () if "lm_head" in self else ("lm_head.weight",)  # a stored copy of the tied matrix

    def __call__(
        self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, cache=None, logits_to_keep=0
    ) -> ModelOutput:
        """`logits_to_keep` > 0 computes the logits of the last that many positions only (transformers' name)."""
        out = self.transformer(input_ids, attention_mask, token_type_ids, position_ids, cache)
        x = out.last_hidden_state[:, -logits_to_keep:] if logits_to_keep else out.last_hidden_state
        if "lm_head" in self:
            out.logits = self.lm_head(x)
        else:
            wte = self.transformer.wte
            out.logits = wte.as_linear(x) if isinstance(wte, nn.QuantizedEmbedding) else linear(x, wte.weight)
        return out

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in range(self.args.n_layer)]


class GPT2ForSequenceClassification(GPT2Head):
    """`score` on the last token that is not `pad_token_id` (transformers' rule, for left or right padding)."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.score = Linear(args.n_embd, args.num_labels, bias=False)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None) -> ModelOutput:
        out = self.transformer(input_ids, attention_mask, token_type_ids, position_ids)
        B = input_ids.shape[0]
        last = last_non_padding(input_ids, self.args.pad_token_id, attention_mask, "GPT-2")
        out.logits = self.score(out.last_hidden_state[mx.arange(B), last])
        return out


def is_conv1d(key: str, weights: dict) -> bool:
    """A Conv1D weight stored [in, out]: a quantized one (its `.scales` beside it) is stored in MLX's layout."""
    return key.endswith(tuple(f"{name}.weight" for name in CONV1D)) and key[: -len("weight")] + "scales" not in weights


def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Conv1D weights [in, out] -> nn.Linear's [out, in] as transposed views of the stored buffers (no copy at load:
    `x @ weight.T` multiplies by the [in, out] buffer as it is). Drop the causal-mask buffers (`attn.bias`,
    `attn.masked_bias`). mlx-lm's folders keep the blocks under `model.` with every weight [out, in] already."""
    if any(key.startswith("model.h.") for key in weights):
        return {"transformer." + key.removeprefix("model."): value for key, value in weights.items()}
    return {
        key: value.T if is_conv1d(key, weights) else value
        for key, value in weights.items()
        if key.split(".")[-2:] not in (["attn", "bias"], ["attn", "masked_bias"])
    }


def checkpoint_weights(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """The inverse of `sanitize` for writing: float Conv1D weights back to transformers' [in, out]."""
    return {key: value.T if is_conv1d(key, weights) else value for key, value in weights.items()}


def init_std(path: str, args: ModelArgs) -> tuple[float, None]:
    """transformers' `_init_weights`: residual output projections shrink with depth (GPT-2 paper)."""
    if path.endswith("c_proj"):
        return args.initializer_range / (2 * args.n_layer) ** 0.5, None
    return args.initializer_range, None


MODELS = {
    "encoder": GPT2Model,
    "causal-lm": GPT2LMHeadModel,
    "sequence-classification": GPT2ForSequenceClassification,
}
TOKEN_TYPES = False

"""DeBERTa-v2 and v3, matching transformers' `modeling_deberta_v2.py`.

Disentangled attention: besides the content scores q k^T, each query reads the keys' relative positions (c2p:
q . k_pos[i - j]) and each key the queries' (p2c: k . q_pos[j - i]), from one table of relative-position embeddings
that every layer shares; distances past position_buckets // 2 are log-bucketed. Those terms reach
`layers.attention` as an additive bias, everything scaled by 1 / sqrt(head_dim * (1 + number of terms)). The mask
is query x key (a padded query attends uniformly to every key) and the embeddings are zeroed on padding, as there.
Longer than most model files: disentangled attention (relative buckets, shared terms) is DeBERTa's own.
"""

import json
from collections.abc import Iterable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .base import (
    BaseArgs,
    HeadModel,
    Model,
    ModelOutput,
    QuestionAnswering,
    TiedDecoder,
    TokenClassification,
    activation,
    attention,
    embed,
    mask_value,
    merge_heads,
    run_layer,
    split_heads,
)
from .bert import BertIntermediate, BertResidual
from .inputs import check_inputs
from .layers import Dropout, Embedding, LayerNorm, Linear

TERMS = ("c2p", "p2c")


@dataclass
class DebertaArgs(BaseArgs):
    """The config.json names DeBERTa v1 and v2 share; `ModelArgs` below adds v2's."""

    vocab_size: int = 128100
    hidden_size: int = 1536
    num_hidden_layers: int = 24
    num_attention_heads: int = 24
    intermediate_size: int = 6144
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 0
    layer_norm_eps: float = 1e-7
    pad_token_id: int = 0
    embedding_size: int | None = None  # None: hidden_size
    position_biased_input: bool = True
    relative_attention: bool = False
    max_relative_positions: int = -1  # below 1: max_position_embeddings
    pos_att_type: list[str] | str | None = None  # ["p2c", "c2p"] or the older "p2c|c2p"
    pooler_dropout: float = 0.0
    pooler_hidden_act: str = "gelu"
    cls_dropout: float | None = None
    legacy: bool = True  # the masked-LM head's layout: `cls.predictions` (True) or `lm_predictions.lm_head`

    signed_keys = ("max_relative_positions", "position_buckets")

    @property
    def max_tokens(self) -> int | None:
        """No limit without a position table (DeBERTa-v3: relative positions alone), as transformers runs it."""
        return self.max_position_embeddings if self.position_biased_input else None

    def __post_init__(self):
        super().__post_init__()
        # Derived values live outside the fields, so config.json is written back as it was read.
        terms = self.pos_att_type or []
        self.terms = [t.strip() for t in terms.lower().split("|")] if isinstance(terms, str) else list(terms)
        if not set(self.terms) <= set(TERMS):
            raise ValueError(f"config key 'pos_att_type' may list 'c2p' and 'p2c' only, got {self.pos_att_type!r}")
        self.embedding_width = self.embedding_size or self.hidden_size
        limit = self.max_relative_positions
        self.max_relative = limit if limit >= 1 else self.max_position_embeddings
        self.span = self.position_buckets if self.position_buckets > 0 else self.max_relative  # rel_embeddings: 2 span
        for key in ("pooler_hidden_act", "conv_act"):
            activation(getattr(self, key))  # fails naming an unsupported activation

    @property
    def sequence_classifier_dropout(self) -> float:
        return self.hidden_dropout_prob if self.cls_dropout is None else self.cls_dropout

    @property
    def token_classifier_dropout(self) -> float:
        return self.hidden_dropout_prob

    @property
    def qa_dropout(self) -> float:
        return 0.0  # transformers' DeBERTa question answering head has no dropout


@dataclass
class ModelArgs(DebertaArgs):
    model_type: str = "deberta-v2"
    position_buckets: int = -1
    share_att_key: bool = False
    norm_rel_ebd: str = "none"
    conv_kernel_size: int = 0
    conv_groups: int = 1
    conv_act: str = "tanh"


class DebertaV2Embeddings(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        E = args.embedding_width
        self.word_embeddings = Embedding(args.vocab_size, E)
        if args.position_biased_input:
            self.position_embeddings = Embedding(args.max_position_embeddings, E)
        if args.type_vocab_size > 0:
            self.token_type_embeddings = Embedding(args.type_vocab_size, E)
        if E != args.hidden_size:
            self.embed_proj = Linear(E, args.hidden_size, bias=False)
        self.LayerNorm = LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.dropout = Dropout(args.hidden_dropout_prob)
        self.padding_idx = args.pad_token_id

    def __call__(self, input_ids, token_type_ids=None, attention_mask=None) -> mx.array:
        dtype = self.LayerNorm.weight.dtype  # see BertEmbeddings
        x = embed(self.word_embeddings, input_ids, self.padding_idx).astype(dtype)
        if "position_embeddings" in self:
            x = x + self.position_embeddings(mx.arange(input_ids.shape[1])[None]).astype(dtype)
        if "token_type_embeddings" in self:
            types = mx.zeros_like(input_ids) if token_type_ids is None else token_type_ids
            x = x + self.token_type_embeddings(types).astype(dtype)
        if "embed_proj" in self:
            x = self.embed_proj(x)
        x = self.LayerNorm(x)
        if attention_mask is not None:
            x = x * attention_mask[..., None].astype(x.dtype)
        return self.dropout(x)


def relative_positions(length: int, buckets: int, max_position: int) -> mx.array:
    """(L, L) distances query - key, log-bucketed past buckets // 2 (transformers' `make_log_bucket_position`)."""
    ids = mx.arange(length)
    rel = ids[:, None] - ids[None]
    if buckets <= 0:
        return rel
    mid = buckets // 2
    far = mx.where((rel < mid) & (rel > -mid), mid - 1, mx.abs(rel))
    log_ratio = mx.log(far / mid) / mx.log(mx.array((max_position - 1) / mid, mx.float32))
    log_pos = mx.ceil(log_ratio * (mid - 1)) + mid
    return mx.where(far <= mid, rel, log_pos * mx.sign(rel)).astype(mx.int32)


class DisentangledSelfAttention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        H = args.hidden_size
        self.num_heads = args.num_attention_heads
        self.c2p, self.p2c = "c2p" in args.terms, "p2c" in args.terms
        self.scale = (H // self.num_heads * (1 + self.c2p + self.p2c)) ** -0.5
        self.query_proj = Linear(H, H)
        self.key_proj = Linear(H, H)
        self.value_proj = Linear(H, H)
        self.share_att_key = args.share_att_key
        if args.relative_attention:
            self.pos_dropout = Dropout(args.hidden_dropout_prob)
            if not args.share_att_key and self.c2p:
                self.pos_key_proj = Linear(H, H)
            if not args.share_att_key and self.p2c:
                self.pos_query_proj = Linear(H, H)
        self.dropout = Dropout(args.attention_probs_dropout_prob)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        return tuple(split_heads(f(x), self.num_heads) for f in (self.query_proj, self.key_proj, self.value_proj))

    def position_projections(self, rel: mx.array) -> tuple[mx.array | None, mx.array | None]:
        """(keys, queries) of the relative-position embeddings, each (1, nh, 2 span, hd) or None if unused."""
        shared = self.share_att_key
        key = (self.key_proj if shared else self.pos_key_proj) if self.c2p else None
        query = (self.query_proj if shared else self.pos_query_proj) if self.p2c else None
        return tuple(None if f is None else split_heads(f(rel[None]), self.num_heads) for f in (key, query))

    def __call__(self, x, masks, rel, positions):
        mask, queries = masks
        q, k, v = self.project(x)  # (B, nh, L, hd)
        if queries is not None:  # no gradient through a padded query's scores: transformers masks them with masked_fill
            q = q * queries
        bias = None
        if "pos_dropout" in self:
            bias = self.relative_scores(q, k, self.pos_dropout(rel), positions) * self.scale
            bias = bias if queries is None else bias * queries
        return merge_heads(attention(q, k, v, mask, self.dropout, scale=self.scale, bias=bias))

    def relative_scores(self, q, k, rel, positions) -> mx.array:
        """c2p[i, j] = q_i . k_pos[i - j] and p2c[i, j] = k_j . q_pos[j - i], both (B, nh, L, L), unscaled."""
        span = rel.shape[0] // 2
        positions = mx.stop_gradient(positions)  # integer indices (mx.checkpoint differentiates every argument)
        pos_key, pos_query = self.position_projections(rel)
        score = 0
        if pos_key is not None:
            index = mx.clip(positions + span, 0, 2 * span - 1)
            score = score + mx.take_along_axis(q @ pos_key.swapaxes(-1, -2), index[None, None], axis=-1)
        if pos_query is not None:
            index = mx.clip(-positions + span, 0, 2 * span - 1)
            p2c = mx.take_along_axis(k @ pos_query.swapaxes(-1, -2), index[None, None], axis=-1)
            score = score + p2c.swapaxes(-1, -2)
        return score


class DebertaV2Attention(nn.Module):
    attention_class = DisentangledSelfAttention

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self = self.attention_class(args)
        self.output = BertResidual(args.hidden_size, args)

    def __call__(self, x, masks, rel, positions):
        return self.output(self.self(x, masks, rel, positions), x)


class DebertaV2Layer(nn.Module):
    attention_class = DebertaV2Attention

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = self.attention_class(args)
        self.intermediate = BertIntermediate(args)
        self.output = BertResidual(args.intermediate_size, args)

    def __call__(self, x, masks, rel, positions):
        x = self.attention(x, masks, rel, positions)
        return self.output(self.intermediate(x), x)


class ConvLayer(nn.Module):
    """The v2 xlarge models' convolution over the embeddings, added to the first layer's output."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        k, H = args.conv_kernel_size, args.hidden_size
        self.conv = nn.Conv1d(H, H, k, padding=(k - 1) // 2, groups=args.conv_groups)
        self.LayerNorm = LayerNorm(H, eps=args.layer_norm_eps)
        self.dropout = Dropout(args.hidden_dropout_prob)
        self.act = activation(args.conv_act)

    def __call__(self, x, residual, keep):
        out = self.act(self.dropout(self.conv(x)))  # (B, L, H): MLX convolves channels-last
        return self.LayerNorm(residual + out) * keep  # transformers also zeroes padding before act: no effect


def pair_masks(attention_mask: mx.array | None, dtype: mx.Dtype) -> tuple[mx.array | None, mx.array | None]:
    """(B, L) 1/0 mask -> (additive (B, 1, L, L) mask of the query x key pairs of real tokens, (B, 1, L, 1) 1/0
    mask of the real queries)."""
    if attention_mask is None:
        return None, None
    keep = attention_mask.astype(mx.bool_)
    both = keep[:, None, :, None] & keep[:, None, None, :]
    return mx.where(both, mx.array(0, dtype), mx.array(mask_value(dtype), dtype)), keep[:, None, :, None].astype(dtype)


class DebertaV2Encoder(nn.Module):
    gradient_checkpointing = False
    layer_class = DebertaV2Layer

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.layer = [self.layer_class(args) for _ in range(args.num_hidden_layers)]
        if args.relative_attention:
            self.rel_embeddings = Embedding(2 * args.span, args.hidden_size)
        if "layer_norm" in [x.strip() for x in args.norm_rel_ebd.lower().split("|")]:
            self.LayerNorm = LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        if args.conv_kernel_size > 0:
            self.conv = ConvLayer(args)

    def relative_embeddings(self, dtype: mx.Dtype) -> mx.array | None:
        if "rel_embeddings" not in self:
            return None
        rel = self.rel_embeddings(mx.arange(2 * self.args.span)).astype(dtype)  # the table, quantized or not
        return self.LayerNorm(rel) if "LayerNorm" in self else rel

    def __call__(self, x, attention_mask):
        masks, rel = pair_masks(attention_mask, x.dtype), self.relative_embeddings(x.dtype)
        positions = relative_positions(x.shape[1], self.args.position_buckets, self.args.max_relative)
        h = x
        for i, layer in enumerate(self.layer):
            h = run_layer(layer, h, masks, rel, positions, checkpoint=self.gradient_checkpointing)
            if i == 0 and "conv" in self:
                keep = mx.ones(x.shape[:2]) if attention_mask is None else attention_mask
                h = self.conv(x, h, keep[..., None].astype(x.dtype))
        return h


class DebertaV2Model(Model, nn.Module):
    embeddings_class, encoder_class = DebertaV2Embeddings, DebertaV2Encoder

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embeddings = self.embeddings_class(args)
        self.encoder = self.encoder_class(args)

    @property
    def ignored_keys(self) -> tuple[str, ...]:
        """A stored position table the config does not use, which transformers ignores too."""
        key = "embeddings.position_embeddings.weight"
        return () if self.args.position_biased_input else (key, "deberta." + key)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        check_inputs(self.args, input_ids, attention_mask, token_type_ids, self.args.max_tokens)
        x = self.embeddings(input_ids, token_type_ids, attention_mask)
        return ModelOutput(last_hidden_state=self.encoder(x, attention_mask))


class DebertaV2Head(HeadModel):
    prefix = "deberta"
    encoder_class = DebertaV2Model

    @property
    def ignored_keys(self) -> tuple[str, ...]:
        return self.encoder.ignored_keys


class PredictionTransform(nn.Module):
    """dense (hidden -> width), the hidden activation, LayerNorm."""

    def __init__(self, args: ModelArgs, width: int):
        super().__init__()
        self.dense = Linear(args.hidden_size, width)
        self.act = activation(args.hidden_act)
        self.LayerNorm = LayerNorm(width, eps=args.layer_norm_eps)

    def __call__(self, x):
        return self.LayerNorm(self.act(self.dense(x)))


class LegacyLMPredictionHead(nn.Module):
    """`cls.predictions`: transform to embedding_size, then the word embeddings plus `bias` (tied), or a `decoder`
    of its own with its own bias (untied; `bias` is then unused, as in transformers)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        tied = args.tie_word_embeddings
        self.transform = PredictionTransform(args, args.embedding_width)
        self.decoder = TiedDecoder(args.embedding_width, args.vocab_size, tied, bias=not tied)
        self.bias = mx.zeros((args.vocab_size,))

    def __call__(self, x, word_embeddings):
        x = self.decoder(self.transform(x), word_embeddings)
        return x if "weight" in self.decoder else x + self.bias


class LMPredictionHead(PredictionTransform):
    """`lm_predictions.lm_head`: the transform at hidden width, then the word embeddings (always) plus `bias`."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, args.hidden_size)
        self.bias = mx.zeros((args.vocab_size,))

    def __call__(self, x, word_embeddings):
        return word_embeddings.as_linear(super().__call__(x)) + self.bias


def holding(name: str, child: nn.Module) -> nn.Module:
    """A module whose one child is `name` (the checkpoints' `cls.predictions`, `lm_predictions.lm_head`)."""
    outer = nn.Module()
    outer[name] = child
    return outer


class DebertaV2ForMaskedLM(DebertaV2Head):
    """config.json's `legacy` (the default) picks the head transformers builds: `cls.predictions` or
    `lm_predictions.lm_head`; where it says none, loading takes the one the weights hold."""

    layouts = {True: "cls.predictions.", False: "lm_predictions.lm_head."}  # `legacy` -> the head's keys

    @classmethod
    def layout_from_weights(cls, config: dict, keys: Iterable[str]) -> dict:
        """config.json with the `legacy` the weights hold where it says none: the hub's v3 checkpoints hold
        `lm_predictions.lm_head` and say none, and transformers then builds a new `cls.predictions` head."""
        held = {legacy for k in keys for legacy, prefix in cls.layouts.items() if k.startswith(prefix)}
        said = config.get("legacy")  # null, like no key, says none; ModelArgs rejects a value of another type
        if len(held) != 1 or not isinstance(said, bool | None) or said in held:
            return config  # no head stored (a new one is made), or the one config.json asks for
        stored = held.pop()
        if said is None:
            return {**config, "legacy": stored}
        raise ValueError(
            f"config key 'legacy' is {json.dumps(said)}, which asks for the `{cls.layouts[said][:-1]}` masked-LM "
            f'head, but the weights hold `{cls.layouts[stored][:-1]}`; set "legacy": {json.dumps(stored)} in '
            "config.json to load it"
        )

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        if args.legacy:
            self.cls = holding("predictions", LegacyLMPredictionHead(args))
        else:
            self.lm_predictions = holding("lm_head", LMPredictionHead(args))

    @property
    def ignored_keys(self) -> tuple[str, ...]:
        tied = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias") if "cls" in self else ()
        return super().ignored_keys + (tied if self.args.tie_word_embeddings else ())

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        out = self.encode(input_ids, attention_mask, token_type_ids)
        out.logits = self.predict_tokens(out.last_hidden_state)
        return out

    def predict_tokens(self, hidden: mx.array) -> mx.array:
        """Vocabulary logits of (..., H) hidden states (training scores only the masked positions)."""
        head = self.cls.predictions if "cls" in self else self.lm_predictions.lm_head
        return head(hidden, self.encoder.embeddings.word_embeddings)


class ContextPooler(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.dense = Linear(args.hidden_size, args.hidden_size)
        self.dropout = Dropout(args.pooler_dropout)
        self.act = activation(args.pooler_hidden_act)

    def __call__(self, x):
        return self.act(self.dense(self.dropout(x[:, 0])))


class DebertaV2ForSequenceClassification(DebertaV2Head):
    """`pooler` (ContextPooler: dense and pooler_hidden_act on the first token), `dropout`, `classifier`."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.pooler = ContextPooler(args)
        self.dropout = Dropout(args.sequence_classifier_dropout)
        self.classifier = Linear(args.hidden_size, args.num_labels)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        out = self.encode(input_ids, attention_mask, token_type_ids)
        out.logits = self.classifier(self.dropout(self.pooler(out.last_hidden_state)))
        return out


class DebertaV2ForTokenClassification(DebertaV2Head, TokenClassification):
    pass


class DebertaV2ForQuestionAnswering(DebertaV2Head, QuestionAnswering):
    pass


def checkpoint_weights(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """The convolution's weight as transformers stores it, (out, in, k), not MLX's (out, k, in); `sanitize` too."""
    return {k: v.swapaxes(1, 2) if k.endswith("encoder.conv.conv.weight") else v for k, v in weights.items()}


def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """The convolution's weight in MLX's layout; v3's replaced-token-detection head (`mask_predictions.*`), which
    transformers ignores, dropped."""
    return checkpoint_weights({k: v for k, v in weights.items() if not k.startswith("mask_predictions.")})


MODELS = {
    "encoder": DebertaV2Model,
    "masked-lm": DebertaV2ForMaskedLM,
    "sequence-classification": DebertaV2ForSequenceClassification,
    "token-classification": DebertaV2ForTokenClassification,
    "question-answering": DebertaV2ForQuestionAnswering,
}


def token_types(args: ModelArgs) -> bool:
    """Token types are read where the config gives them a table (0 in the released checkpoints), as transformers'
    DeBERTa tokenizers always return them."""
    return args.type_vocab_size > 0


TOKEN_TYPES = token_types

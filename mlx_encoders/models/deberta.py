"""DeBERTa (v1), matching transformers' `modeling_deberta.py`: DeBERTa-v2's model (deberta_v2.py) with v1's
attention projections, and none of v2's position buckets, shared attention keys, normalised relative
embeddings or convolution.

v1 projects q, k and v with one `in_proj` (no bias) laid out head by head, then adds `q_bias` and `v_bias`; the
relative-position keys come from `pos_proj` (no bias), the queries from `pos_q_proj`. Its table of
2 x max_relative_positions embeddings, sliced to the input's span, gives the scores v2 gives without buckets.
"""

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from . import deberta_v2 as v2
from .base import split_heads
from .layers import Dropout, Linear


@dataclass
class ModelArgs(v2.DebertaArgs):
    model_type: str = "deberta"
    vocab_size: int = 50265
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    talking_head: bool = False

    # v2's additions, fixed: transformers' DeBERTa reads none of them (not fields, so config.json keeps its own)
    position_buckets, share_att_key, norm_rel_ebd, conv_kernel_size, conv_act = -1, False, "none", 0, "tanh"

    def __post_init__(self):
        super().__post_init__()
        if self.talking_head:
            raise ValueError("config key 'talking_head': DeBERTa's talking-head attention is not supported")


class DebertaSelfAttention(v2.DisentangledSelfAttention):
    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)
        H = args.hidden_size
        self.num_heads = args.num_attention_heads
        self.c2p, self.p2c = "c2p" in args.terms, "p2c" in args.terms
        self.scale = (H // self.num_heads * (1 + len(args.terms))) ** -0.5
        self.in_proj = Linear(H, 3 * H, bias=False)
        self.q_bias = mx.zeros((H,))
        self.v_bias = mx.zeros((H,))
        if args.relative_attention:
            self.pos_dropout = Dropout(args.hidden_dropout_prob)
            if self.c2p:
                self.pos_proj = Linear(H, H, bias=False)
            if self.p2c:
                self.pos_q_proj = Linear(H, H)
        self.dropout = Dropout(args.attention_probs_dropout_prob)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        q, k, v = mx.split(split_heads(self.in_proj(x), self.num_heads), 3, axis=-1)  # (B, nh, L, hd) each
        q_bias, v_bias = (b.reshape(self.num_heads, 1, -1) for b in (self.q_bias, self.v_bias))
        return q + q_bias, k, v + v_bias

    def position_projections(self, rel: mx.array) -> tuple[mx.array | None, mx.array | None]:
        key = self.pos_proj if self.c2p else None
        query = self.pos_q_proj if self.p2c else None
        return tuple(None if f is None else split_heads(f(rel[None]), self.num_heads) for f in (key, query))


class DebertaAttention(v2.DebertaV2Attention):
    attention_class = DebertaSelfAttention


class DebertaLayer(v2.DebertaV2Layer):
    attention_class = DebertaAttention


class DebertaEncoder(v2.DebertaV2Encoder):
    layer_class = DebertaLayer


class DebertaModel(v2.DebertaV2Model):
    encoder_class = DebertaEncoder


class DebertaForMaskedLM(v2.DebertaV2ForMaskedLM):
    encoder_class = DebertaModel


class DebertaForSequenceClassification(v2.DebertaV2ForSequenceClassification):
    encoder_class = DebertaModel


class DebertaForTokenClassification(v2.DebertaV2ForTokenClassification):
    encoder_class = DebertaModel


class DebertaForQuestionAnswering(v2.DebertaV2ForQuestionAnswering):
    encoder_class = DebertaModel


MODELS = {
    "encoder": DebertaModel,
    "masked-lm": DebertaForMaskedLM,
    "sequence-classification": DebertaForSequenceClassification,
    "token-classification": DebertaForTokenClassification,
    "question-answering": DebertaForQuestionAnswering,
}
TOKEN_TYPES = v2.token_types

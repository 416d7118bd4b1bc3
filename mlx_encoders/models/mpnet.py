"""MPNet, matching transformers' `modeling_mpnet.py`.

RoBERTa's positions (counted from padding_idx 1) without token types, and BERT's layers whose attention adds
one bucketed relative-position bias (T5's bidirectional buckets), computed once and shared by every layer.
The masked-LM and classification heads are RoBERTa's.
"""

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .base import (
    BaseArgs,
    HeadModel,
    HiddenStateClassification,
    MaskedLM,
    Model,
    ModelOutput,
    QuestionAnswering,
    TokenClassification,
    merge_heads,
    padding_mask,
    run_layer,
    split_heads,
)
from .bert import BertIntermediate, BertPooler, BertResidual, untied_decoder_bias
from .inputs import check_inputs
from .layers import Dropout, Embedding, LayerNorm, Linear, attention
from .roberta import RobertaClassificationHead, RobertaEmbeddings, RobertaLMHead

# transformers' MPNet hard-codes these, whatever config.json says: padding_idx 1 for the positions, and
# relative positions in 32 buckets up to a distance of 128 (relative_attention_num_buckets only sizes the table).
PADDING_IDX = 1
NUM_BUCKETS, MAX_DISTANCE = 32, 128


@dataclass
class ModelArgs(BaseArgs):
    model_type: str = "mpnet"
    vocab_size: int = 30527
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    layer_norm_eps: float = 1e-12
    relative_attention_num_buckets: int = 32
    pad_token_id: int = 1
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1

    def check(self) -> None:
        super().check()
        if self.relative_attention_num_buckets < NUM_BUCKETS:
            raise ValueError(
                f"config key 'relative_attention_num_buckets' must be at least {NUM_BUCKETS}, got "
                f"{self.relative_attention_num_buckets}: MPNet always sorts relative positions into {NUM_BUCKETS} "
                "buckets (as transformers does), so a smaller bias table cannot hold them"
            )

    @property
    def sequence_classifier_dropout(self) -> float:
        return self.hidden_dropout_prob  # MPNet's classifiers have no dropout key of their own

    @property
    def token_classifier_dropout(self) -> float:
        return self.hidden_dropout_prob

    @property
    def qa_dropout(self) -> float:
        return 0.0  # transformers' MPNetForQuestionAnswering has no dropout

    @property
    def max_tokens(self) -> int:
        return self.max_position_embeddings - PADDING_IDX - 1  # positions start after padding_idx


class MPNetEmbeddings(RobertaEmbeddings):
    """RoBERTa's embeddings without token types."""

    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)
        self.word_embeddings = Embedding(args.vocab_size, args.hidden_size)
        self.position_embeddings = Embedding(args.max_position_embeddings, args.hidden_size)
        self.LayerNorm = LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.dropout = Dropout(args.hidden_dropout_prob)
        self.padding_idx = PADDING_IDX


class MPNetSelfAttention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        H = args.hidden_size
        self.num_heads = args.num_attention_heads
        self.q = Linear(H, H)
        self.k = Linear(H, H)
        self.v = Linear(H, H)
        self.o = Linear(H, H)
        self.dropout = Dropout(args.attention_probs_dropout_prob)

    def __call__(self, x, mask, position_bias):
        q, k, v = (split_heads(t, self.num_heads) for t in (self.q(x), self.k(x), self.v(x)))
        return self.o(merge_heads(attention(q, k, v, mask, self.dropout, bias=position_bias)))


class MPNetAttention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attn = MPNetSelfAttention(args)
        self.LayerNorm = LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.dropout = Dropout(args.hidden_dropout_prob)

    def __call__(self, x, mask, position_bias):
        return self.LayerNorm(self.dropout(self.attn(x, mask, position_bias)) + x)


class MPNetLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = MPNetAttention(args)
        self.intermediate = BertIntermediate(args)
        self.output = BertResidual(args.intermediate_size, args)

    def __call__(self, x, mask, position_bias):
        x = self.attention(x, mask, position_bias)
        return self.output(self.intermediate(x), x)


def relative_position_buckets(length: int) -> mx.array:
    """(L, L) bucket of key j seen from query i (transformers' `relative_position_bucket`): keys ahead in the upper
    half; distances below 8 exactly, then logarithmically up to MAX_DISTANCE, beyond which they share the last."""
    half = NUM_BUCKETS // 2
    exact = half // 2
    positions = mx.arange(length)
    relative = positions[None, :] - positions[:, None]  # key - query
    distance = mx.abs(relative)
    scaled = mx.log(mx.maximum(distance, 1).astype(mx.float32) / exact) / math.log(MAX_DISTANCE / exact)
    far = mx.minimum(exact + (scaled * (half - exact)).astype(mx.int32), half - 1)
    return (relative > 0) * half + mx.where(distance < exact, distance, far)


class MPNetEncoder(nn.Module):
    gradient_checkpointing = False

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.layer = [MPNetLayer(args) for _ in range(args.num_hidden_layers)]
        self.relative_attention_bias = Embedding(args.relative_attention_num_buckets, args.num_attention_heads)

    def __call__(self, x, mask):
        buckets = relative_position_buckets(x.shape[1])
        position_bias = self.relative_attention_bias(buckets).transpose(2, 0, 1)[None].astype(x.dtype)  # (1, nh, L, L)
        for layer in self.layer:
            x = run_layer(layer, x, mask, position_bias, checkpoint=self.gradient_checkpointing)
        return x


class MPNetModel(Model, nn.Module):
    def __init__(self, args: ModelArgs, add_pooling_layer: bool = True):
        super().__init__()
        self.args = args
        self.embeddings = MPNetEmbeddings(args)
        self.encoder = MPNetEncoder(args)
        if add_pooling_layer:
            self.pooler = BertPooler(args)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        check_inputs(self.args, input_ids, attention_mask, token_type_ids, self.args.max_tokens, PADDING_IDX)
        x = self.embeddings(input_ids)
        x = self.encoder(x, padding_mask(attention_mask, x.dtype))
        pooled = self.pooler(x) if "pooler" in self else None
        return ModelOutput(last_hidden_state=x, pooler_output=pooled)


class MPNetHead(HeadModel):
    prefix = "mpnet"
    encoder_class = MPNetModel


class MPNetForMaskedLM(MPNetHead, MaskedLM):
    ignored_keys = ("lm_head.decoder.weight", "lm_head.decoder.bias")

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.lm_head = RobertaLMHead(args)


class MPNetForSequenceClassification(MPNetHead, HiddenStateClassification):
    classifier_class = RobertaClassificationHead


class MPNetForTokenClassification(MPNetHead, TokenClassification):
    pass


class MPNetForQuestionAnswering(MPNetHead, QuestionAnswering):
    pass


MODELS = {
    "encoder": MPNetModel,
    "masked-lm": MPNetForMaskedLM,
    "sequence-classification": MPNetForSequenceClassification,
    "token-classification": MPNetForTokenClassification,
    "question-answering": MPNetForQuestionAnswering,
}
TOKEN_TYPES = False


def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    return untied_decoder_bias(weights, "lm_head")

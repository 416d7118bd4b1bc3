"""ALBERT, matching transformers' `modeling_albert.py`.

Embeddings of width `embedding_size` are projected to `hidden_size`; layer i runs every inner layer of
the shared group `int(i / (num_hidden_layers / num_hidden_groups))`.
"""

from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import mlx.nn as nn

from .base import (
    BaseArgs,
    HeadModel,
    MaskedLM,
    Model,
    ModelOutput,
    PooledClassification,
    QuestionAnswering,
    TokenClassification,
    activation,
    multi_head_attention,
    padding_mask,
    run_layer,
)
from .bert import BertEmbeddings, untied_decoder_bias
from .inputs import check_inputs
from .layers import Dropout, Embedding, LayerNorm, Linear


@dataclass
class ModelArgs(BaseArgs):
    model_type: str = "albert"
    vocab_size: int = 30000
    embedding_size: int = 128
    hidden_size: int = 4096
    num_hidden_layers: int = 12
    num_hidden_groups: int = 1
    num_attention_heads: int = 64
    intermediate_size: int = 16384
    inner_group_num: int = 1
    hidden_act: str = "gelu_new"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    hidden_dropout_prob: float = 0.0
    attention_probs_dropout_prob: float = 0.0
    classifier_dropout_prob: float | None = 0.1
    # Google's ALBERT v2 sizes (albert-*-v2 on the hub): one shared layer group, embeddings 128 wide.
    presets: ClassVar[dict] = {
        name: dict(num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads,
                   intermediate_size=4 * width)
        for name, layers, width, heads in (
            ("base-v2", 12, 768, 12), ("large-v2", 24, 1024, 16), ("xlarge-v2", 24, 2048, 16),
            ("xxlarge-v2", 12, 4096, 64),
        )
    }  # fmt: skip

    @property
    def sequence_classifier_dropout(self) -> float:
        return self.classifier_dropout_prob

    @property
    def token_classifier_dropout(self) -> float:
        """transformers' token classifier falls back to hidden_dropout_prob when classifier_dropout_prob is None."""
        return self.hidden_dropout_prob if self.classifier_dropout_prob is None else self.classifier_dropout_prob

    @property
    def qa_dropout(self) -> float:
        return 0.0  # transformers' AlbertForQuestionAnswering has no dropout


class AlbertEmbeddings(BertEmbeddings):
    """BERT's embeddings at width `embedding_size`."""

    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)
        E = args.embedding_size
        self.word_embeddings = Embedding(args.vocab_size, E)
        self.position_embeddings = Embedding(args.max_position_embeddings, E)
        self.token_type_embeddings = Embedding(args.type_vocab_size, E)
        self.LayerNorm = LayerNorm(E, eps=args.layer_norm_eps)
        self.dropout = Dropout(args.hidden_dropout_prob)
        self.padding_idx = args.pad_token_id


class AlbertAttention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        H = args.hidden_size
        self.num_heads = args.num_attention_heads
        self.query = Linear(H, H)
        self.key = Linear(H, H)
        self.value = Linear(H, H)
        self.dense = Linear(H, H)
        self.LayerNorm = LayerNorm(H, eps=args.layer_norm_eps)
        self.attention_dropout = Dropout(args.attention_probs_dropout_prob)
        self.output_dropout = Dropout(args.hidden_dropout_prob)

    def __call__(self, x, mask):
        q, k, v = self.query(x), self.key(x), self.value(x)
        h = multi_head_attention(q, k, v, self.num_heads, mask, self.attention_dropout)
        return self.LayerNorm(x + self.output_dropout(self.dense(h)))


class AlbertLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = AlbertAttention(args)
        self.ffn = Linear(args.hidden_size, args.intermediate_size)
        self.ffn_output = Linear(args.intermediate_size, args.hidden_size)
        self.full_layer_layer_norm = LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.act = activation(args.hidden_act)

    def __call__(self, x, mask):
        x = self.attention(x, mask)
        return self.full_layer_layer_norm(self.ffn_output(self.act(self.ffn(x))) + x)


class AlbertLayerGroup(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.albert_layers = [AlbertLayer(args) for _ in range(args.inner_group_num)]

    def __call__(self, x, mask):
        for layer in self.albert_layers:
            x = layer(x, mask)
        return x


class AlbertTransformer(nn.Module):
    gradient_checkpointing = False

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_hidden_layers = args.num_hidden_layers
        self.num_hidden_groups = args.num_hidden_groups
        self.embedding_hidden_mapping_in = Linear(args.embedding_size, args.hidden_size)
        self.albert_layer_groups = [AlbertLayerGroup(args) for _ in range(args.num_hidden_groups)]

    def __call__(self, x, mask):
        x = self.embedding_hidden_mapping_in(x)
        for i in range(self.num_hidden_layers):
            group = int(i / (self.num_hidden_layers / self.num_hidden_groups))
            x = run_layer(self.albert_layer_groups[group], x, mask, checkpoint=self.gradient_checkpointing)
        return x


class AlbertModel(Model, nn.Module):
    def __init__(self, args: ModelArgs, add_pooling_layer: bool = True):
        super().__init__()
        self.args = args
        self.embeddings = AlbertEmbeddings(args)
        self.encoder = AlbertTransformer(args)
        if add_pooling_layer:
            self.pooler = Linear(args.hidden_size, args.hidden_size)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        check_inputs(self.args, input_ids, attention_mask, token_type_ids, self.args.max_tokens)
        x = self.embeddings(input_ids, token_type_ids)
        x = self.encoder(x, padding_mask(attention_mask, x.dtype))
        pooled = mx.tanh(self.pooler(x[:, 0])) if "pooler" in self else None
        return ModelOutput(last_hidden_state=x, pooler_output=pooled)


class AlbertMLMHead(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.dense = Linear(args.hidden_size, args.embedding_size)
        self.act = activation(args.hidden_act)
        self.LayerNorm = LayerNorm(args.embedding_size, eps=args.layer_norm_eps)
        if not args.tie_word_embeddings:  # an own decoder with its own bias, as BERT's (`untied_decoder_bias`)
            self.decoder = Linear(args.embedding_size, args.vocab_size)
        self.bias = mx.zeros((args.vocab_size,))

    def __call__(self, x, word_embeddings):
        x = self.LayerNorm(self.act(self.dense(x)))
        return self.decoder(x) if "decoder" in self else word_embeddings.as_linear(x) + self.bias


class AlbertHead(HeadModel):
    prefix = "albert"
    encoder_class = AlbertModel


class AlbertForMaskedLM(AlbertHead, MaskedLM):
    head = "predictions"
    ignored_keys = ("predictions.decoder.weight", "predictions.decoder.bias")

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.predictions = AlbertMLMHead(args)


class AlbertForSequenceClassification(AlbertHead, PooledClassification):
    pass


class AlbertForTokenClassification(AlbertHead, TokenClassification):
    pass


class AlbertForQuestionAnswering(AlbertHead, QuestionAnswering):
    pass


MODELS = {
    "encoder": AlbertModel,
    "masked-lm": AlbertForMaskedLM,
    "sequence-classification": AlbertForSequenceClassification,
    "token-classification": AlbertForTokenClassification,
    "question-answering": AlbertForQuestionAnswering,
}
TOKEN_TYPES = True


def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    return untied_decoder_bias(weights, "predictions")

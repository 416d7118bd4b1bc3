"""BERT, matching transformers' `modeling_bert.py`. Attribute names are the checkpoint's keys."""

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
    embed,
    multi_head_attention,
    padding_mask,
    run_layer,
)
from .inputs import check_inputs
from .layers import Dropout, Embedding, LayerNorm, Linear


@dataclass
class ModelArgs(BaseArgs):
    model_type: str = "bert"
    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    classifier_dropout: float | None = None
    # google-research/bert: base and large, and the smaller models of Turc et al. 2019 (heads = width / 64).
    presets: ClassVar[dict] = {
        name: dict(num_hidden_layers=layers, hidden_size=width, num_attention_heads=width // 64,
                   intermediate_size=4 * width)
        for name, layers, width in (
            ("tiny", 2, 128), ("mini", 4, 256), ("small", 4, 512), ("medium", 8, 512), ("base", 12, 768),
            ("large", 24, 1024),
        )
    }  # fmt: skip

    @classmethod
    def from_dict(cls, config: dict) -> "ModelArgs":
        # transformers' BERT, RoBERTa and ELECTRA read these (a causal mask, cross-attention layers); run without
        # them, such a checkpoint would give other outputs with no error
        for key, use in (("is_decoder", "a causal decoder"), ("add_cross_attention", "cross-attention layers")):
            if config.get(key) is True:
                raise ValueError(
                    f"config key {key!r} is true: {config.get('model_type', cls.model_type)} as {use} is not "
                    "supported; this package runs it as a bidirectional encoder"
                )
        return super().from_dict(config)

    @property
    def sequence_classifier_dropout(self) -> float:
        """transformers' classifier heads fall back to hidden_dropout_prob when classifier_dropout is None."""
        return self.hidden_dropout_prob if self.classifier_dropout is None else self.classifier_dropout

    @property
    def token_classifier_dropout(self) -> float:
        return self.sequence_classifier_dropout

    @property
    def qa_dropout(self) -> float:
        return 0.0  # transformers' BERT and RoBERTa question answering heads have no dropout


class BertEmbeddings(nn.Module):
    positions_skip_padding = False  # position i is the i-th token's, padding or not

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.word_embeddings = Embedding(args.vocab_size, args.hidden_size)
        self.position_embeddings = Embedding(args.max_position_embeddings, args.hidden_size)
        if args.type_vocab_size > 0:
            self.token_type_embeddings = Embedding(args.type_vocab_size, args.hidden_size)
        self.LayerNorm = LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.dropout = Dropout(args.hidden_dropout_prob)
        self.padding_idx = args.pad_token_id

    def embed_positions(self, input_ids: mx.array) -> mx.array:
        return self.position_embeddings(mx.arange(input_ids.shape[1])[None])

    def __call__(self, input_ids, token_type_ids=None) -> mx.array:
        # Quantized tables return their scales' dtype (often float16): sum in the model's own float dtype.
        dtype = self.LayerNorm.weight.dtype
        x = embed(self.word_embeddings, input_ids, self.padding_idx).astype(dtype)
        x = x + self.embed_positions(input_ids).astype(dtype)
        if "token_type_embeddings" in self:
            if token_type_ids is None:
                token_type_ids = mx.zeros_like(input_ids)
            x = x + self.token_type_embeddings(token_type_ids).astype(dtype)
        return self.dropout(self.LayerNorm(x))


class BertSelfAttention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_heads = args.num_attention_heads
        self.query = Linear(args.hidden_size, args.hidden_size)
        self.key = Linear(args.hidden_size, args.hidden_size)
        self.value = Linear(args.hidden_size, args.hidden_size)
        self.dropout = Dropout(args.attention_probs_dropout_prob)

    def __call__(self, x, mask):
        return multi_head_attention(self.query(x), self.key(x), self.value(x), self.num_heads, mask, self.dropout)


class BertResidual(nn.Module):
    """dense and dropout, then LayerNorm over the residual sum (`attention.output` and `output` in the checkpoint)."""

    def __init__(self, in_dims: int, args: ModelArgs):
        super().__init__()
        self.dense = Linear(in_dims, args.hidden_size)
        self.LayerNorm = LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.dropout = Dropout(args.hidden_dropout_prob)

    def __call__(self, h, residual):
        return self.LayerNorm(self.dropout(self.dense(h)) + residual)


class BertAttention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self = BertSelfAttention(args)
        self.output = BertResidual(args.hidden_size, args)

    def __call__(self, x, mask):
        return self.output(self.self(x, mask), x)


class BertIntermediate(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.dense = Linear(args.hidden_size, args.intermediate_size)
        self.act = activation(args.hidden_act)

    def __call__(self, x):
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = BertAttention(args)
        self.intermediate = BertIntermediate(args)
        self.output = BertResidual(args.intermediate_size, args)

    def __call__(self, x, mask):
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    gradient_checkpointing = False

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.layer = [BertLayer(args) for _ in range(args.num_hidden_layers)]

    def __call__(self, x, mask):
        for layer in self.layer:
            x = run_layer(layer, x, mask, checkpoint=self.gradient_checkpointing)
        return x


class BertPooler(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.dense = Linear(args.hidden_size, args.hidden_size)

    def __call__(self, x):
        return mx.tanh(self.dense(x[:, 0]))


class BertModel(Model, nn.Module):
    embeddings_class = BertEmbeddings

    def __init__(self, args: ModelArgs, add_pooling_layer: bool = True):
        super().__init__()
        self.args = args
        self.embeddings = self.embeddings_class(args)
        self.encoder = BertEncoder(args)
        if add_pooling_layer:
            self.pooler = BertPooler(args)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        pad = self.args.pad_token_id if self.embeddings.positions_skip_padding else None
        check_inputs(self.args, input_ids, attention_mask, token_type_ids, self.args.max_tokens, pad)
        x = self.embeddings(input_ids, token_type_ids)
        x = self.encoder(x, padding_mask(attention_mask, x.dtype))
        pooled = self.pooler(x) if "pooler" in self else None
        return ModelOutput(last_hidden_state=x, pooler_output=pooled)


class BertPredictionHeadTransform(nn.Module):
    norm_key = "LayerNorm"  # the layer norm's checkpoint key (Nomic BERT's: layer_norm)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.dense = Linear(args.hidden_size, args.hidden_size)
        self.act = activation(args.hidden_act)
        self[self.norm_key] = LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def __call__(self, x):
        return self[self.norm_key](self.act(self.dense(x)))


class BertLMPredictionHead(nn.Module):
    """transform, then the word-embedding matrix plus `bias` (tied), or an own `decoder` with a bias of its own:
    transformers unties the decoder's bias from `bias` with its weight (`bias` is then kept but unused)."""

    transform_class = BertPredictionHeadTransform

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.transform = self.transform_class(args)
        if not args.tie_word_embeddings:
            self.decoder = Linear(args.hidden_size, args.vocab_size)
        self.bias = mx.zeros((args.vocab_size,))

    def __call__(self, x, word_embeddings):
        x = self.transform(x)
        return self.decoder(x) if "decoder" in self else word_embeddings.as_linear(x) + self.bias


def untied_decoder_bias(weights: dict[str, mx.array], head: str) -> dict[str, mx.array]:
    """An untied decoder (its weight stored) with no bias of its own stored: the head's `bias` is its bias, as it
    was one tensor in transformers 4, whose files keep one of the two."""
    decoder = f"{head}.decoder"
    if f"{decoder}.weight" in weights and f"{decoder}.bias" not in weights and f"{head}.bias" in weights:
        weights = {**weights, f"{decoder}.bias": weights[f"{head}.bias"]}
    return weights


def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    return untied_decoder_bias(weights, "cls.predictions")


class BertOnlyMLMHead(nn.Module):
    predictions_class = BertLMPredictionHead

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.predictions = self.predictions_class(args)


class BertPreTrainingHeads(BertOnlyMLMHead):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.seq_relationship = Linear(args.hidden_size, 2)


class BertHead(HeadModel):
    prefix = "bert"
    encoder_class = BertModel


class BertForMaskedLM(BertHead, MaskedLM):
    head = "cls.predictions"
    ignored_keys = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias")

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.cls = BertOnlyMLMHead(args)


class BertForPreTraining(BertForMaskedLM):
    """MLM logits in `logits`, next-sentence logits in `seq_relationship_logits`."""

    pooled = True

    def __init__(self, args: ModelArgs):
        HeadModel.__init__(self, args)
        self.cls = BertPreTrainingHeads(args)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        out = super().__call__(input_ids, attention_mask, token_type_ids)
        out.seq_relationship_logits = self.cls.seq_relationship(out.pooler_output)
        return out


class BertForSequenceClassification(BertHead, PooledClassification):
    pass


class BertForTokenClassification(BertHead, TokenClassification):
    pass


class BertForQuestionAnswering(BertHead, QuestionAnswering):
    pass


MODELS = {
    "encoder": BertModel,
    "masked-lm": BertForMaskedLM,
    "sequence-classification": BertForSequenceClassification,
    "token-classification": BertForTokenClassification,
    "question-answering": BertForQuestionAnswering,
    "pretraining": BertForPreTraining,
}
TOKEN_TYPES = True

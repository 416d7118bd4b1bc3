"""ELECTRA, matching transformers' `modeling_electra.py`.

BERT's encoder under `electra.`, without a pooler, behind embeddings of width `embedding_size` (ALBERT's), which
`embeddings_project` maps to `hidden_size` when the two differ. The discriminator (`ElectraForPreTraining`) scores
each token as replaced or original; the generator (`ElectraForMaskedLM`) predicts masked tokens at width
`embedding_size` through the tied word embeddings.
"""

from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import mlx.nn as nn

from .albert import AlbertEmbeddings
from .base import (
    HeadModel,
    HiddenStateClassification,
    ModelOutput,
    QuestionAnswering,
    TiedDecoder,
    TokenClassification,
    activation,
    padding_mask,
)
from .bert import BertModel
from .bert import ModelArgs as BertArgs
from .inputs import check_inputs
from .layers import Dropout, LayerNorm, Linear, gelu


@dataclass
class ModelArgs(BertArgs):
    model_type: str = "electra"
    embedding_size: int = 128
    hidden_size: int = 256
    num_attention_heads: int = 4
    intermediate_size: int = 1024
    # google/electra-{small,base,large}-discriminator.
    presets: ClassVar[dict] = {
        name: dict(num_hidden_layers=layers, embedding_size=embedding, hidden_size=width,
                   num_attention_heads=heads, intermediate_size=4 * width)
        for name, layers, embedding, width, heads in (
            ("small", 12, 128, 256, 4), ("base", 12, 768, 768, 12), ("large", 24, 1024, 1024, 16),
        )
    }  # fmt: skip


class ElectraEmbeddings(AlbertEmbeddings):
    """BERT's embeddings at width `embedding_size` (ALBERT's)."""


class ElectraModel(BertModel):
    embeddings_class = ElectraEmbeddings

    def __init__(self, args: ModelArgs):
        super().__init__(args, add_pooling_layer=False)
        if args.embedding_size != args.hidden_size:
            self.embeddings_project = Linear(args.embedding_size, args.hidden_size)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        check_inputs(self.args, input_ids, attention_mask, token_type_ids, self.args.max_tokens)
        x = self.embeddings(input_ids, token_type_ids)
        if "embeddings_project" in self:
            x = self.embeddings_project(x)
        x = self.encoder(x, padding_mask(attention_mask, x.dtype))
        return ModelOutput(last_hidden_state=x)


class ElectraDiscriminatorPredictions(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.dense = Linear(args.hidden_size, args.hidden_size)
        self.act = activation(args.hidden_act)
        self.dense_prediction = Linear(args.hidden_size, 1)

    def __call__(self, x):
        return self.dense_prediction(self.act(self.dense(x))).squeeze(-1)  # (B, L)


class ElectraGeneratorPredictions(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.dense = Linear(args.hidden_size, args.embedding_size)
        self.LayerNorm = LayerNorm(args.embedding_size, eps=args.layer_norm_eps)

    def __call__(self, x):
        return self.LayerNorm(gelu(self.dense(x)))  # exact gelu whatever hidden_act says


class ElectraClassificationHead(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.dense = Linear(args.hidden_size, args.hidden_size)
        self.dropout = Dropout(args.sequence_classifier_dropout)  # before dense and before out_proj
        self.out_proj = Linear(args.hidden_size, args.num_labels)

    def __call__(self, x):
        x = gelu(self.dense(self.dropout(x[:, 0])))  # gelu where BERT and RoBERTa use tanh
        return self.out_proj(self.dropout(x))


class ElectraHead(HeadModel):
    prefix = "electra"
    encoder_class = ElectraModel


class ElectraForPreTraining(ElectraHead):
    """The discriminator: one logit per token, (B, L) in `logits`, for "this token was replaced"."""

    discriminator = True

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.discriminator_predictions = ElectraDiscriminatorPredictions(args)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        out = self.encode(input_ids, attention_mask, token_type_ids)
        out.logits = self.discriminator_predictions(out.last_hidden_state)
        return out


class ElectraForMaskedLM(ElectraHead):
    """The generator."""

    ignored_keys = ("generator_lm_head.weight",)  # a tied copy of the word embeddings

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.generator_predictions = ElectraGeneratorPredictions(args)
        self.generator_lm_head = TiedDecoder(args.embedding_size, args.vocab_size, args.tie_word_embeddings)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        out = self.encode(input_ids, attention_mask, token_type_ids)
        out.logits = self.predict_tokens(out.last_hidden_state)
        return out

    def predict_tokens(self, hidden: mx.array) -> mx.array:
        """Vocabulary logits of (..., H) hidden states (training scores only the masked positions)."""
        return self.generator_lm_head(self.generator_predictions(hidden), self.electra.embeddings.word_embeddings)


class ElectraForSequenceClassification(ElectraHead, HiddenStateClassification):
    classifier_class = ElectraClassificationHead


class ElectraForTokenClassification(ElectraHead, TokenClassification):
    pass


class ElectraForQuestionAnswering(ElectraHead, QuestionAnswering):
    pass


MODELS = {
    "encoder": ElectraModel,
    "masked-lm": ElectraForMaskedLM,
    "sequence-classification": ElectraForSequenceClassification,
    "token-classification": ElectraForTokenClassification,
    "question-answering": ElectraForQuestionAnswering,
    "pretraining": ElectraForPreTraining,
}
TOKEN_TYPES = True

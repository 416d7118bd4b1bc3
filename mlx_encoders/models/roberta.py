"""RoBERTa and XLM-RoBERTa (same math), matching transformers' `modeling_roberta.py`.

The encoder is BERT's; positions count real tokens from `pad_token_id + 1`, and the MLM and
classification heads have their own layouts.
"""

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .base import (
    HeadModel,
    HiddenStateClassification,
    MaskedLM,
    QuestionAnswering,
    TokenClassification,
    embed,
)
from .bert import BertEmbeddings, BertModel, untied_decoder_bias
from .bert import ModelArgs as BertArgs
from .layers import Dropout, LayerNorm, Linear, gelu


@dataclass
class ModelArgs(BertArgs):
    model_type: str = "roberta"  # xlm-roberta configs name their own
    layer_norm_eps: float = 1e-5
    pad_token_id: int = 1
    type_vocab_size: int = 1
    max_position_embeddings: int = 514

    def check(self) -> None:
        super().check()
        if isinstance(self.pad_token_id, int) and self.max_tokens < 1:  # positions start after the pad id
            raise ValueError(
                f"config keys 'pad_token_id' ({self.pad_token_id}) and 'max_position_embeddings' "
                f"({self.max_position_embeddings}) leave no position for a token: the positions start after the pad "
                "id, so the table needs at least pad_token_id + 2 rows"
            )

    @property
    def max_tokens(self) -> int:
        return self.max_position_embeddings - self.pad_token_id - 1  # positions start after pad_token_id


class RobertaEmbeddings(BertEmbeddings):
    positions_skip_padding = True

    def embed_positions(self, input_ids: mx.array) -> mx.array:
        real = (input_ids != self.padding_idx).astype(mx.int32)
        positions = mx.cumsum(real, axis=1) * real + self.padding_idx  # real tokens: pad+1, pad+2, ...; padding: pad
        return embed(self.position_embeddings, positions, self.padding_idx)


class RobertaModel(BertModel):
    embeddings_class = RobertaEmbeddings


class RobertaLMHead(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.dense = Linear(args.hidden_size, args.hidden_size)
        self.layer_norm = LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        if not args.tie_word_embeddings:  # with a bias of its own, as BertLMPredictionHead's
            self.decoder = Linear(args.hidden_size, args.vocab_size)
        self.bias = mx.zeros((args.vocab_size,))

    def __call__(self, x, word_embeddings):
        x = self.layer_norm(gelu(self.dense(x)))  # exact gelu whatever hidden_act says
        return self.decoder(x) if "decoder" in self else word_embeddings.as_linear(x) + self.bias


class RobertaClassificationHead(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.dense = Linear(args.hidden_size, args.hidden_size)
        self.dropout = Dropout(args.sequence_classifier_dropout)  # before dense and before out_proj
        self.out_proj = Linear(args.hidden_size, args.num_labels)

    def __call__(self, x):
        x = mx.tanh(self.dense(self.dropout(x[:, 0])))
        return self.out_proj(self.dropout(x))


class RobertaHead(HeadModel):
    prefix = "roberta"
    encoder_class = RobertaModel


def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    return untied_decoder_bias(weights, "lm_head")


class RobertaForMaskedLM(RobertaHead, MaskedLM):
    ignored_keys = ("lm_head.decoder.weight", "lm_head.decoder.bias")

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.lm_head = RobertaLMHead(args)


class RobertaForSequenceClassification(RobertaHead, HiddenStateClassification):
    classifier_class = RobertaClassificationHead


class RobertaForTokenClassification(RobertaHead, TokenClassification):
    pass


class RobertaForQuestionAnswering(RobertaHead, QuestionAnswering):
    pass


MODELS = {
    "encoder": RobertaModel,
    "masked-lm": RobertaForMaskedLM,
    "sequence-classification": RobertaForSequenceClassification,
    "token-classification": RobertaForTokenClassification,
    "question-answering": RobertaForQuestionAnswering,
}
TOKEN_TYPES = False

"""DistilBERT, matching transformers' `modeling_distilbert.py` (no token types, every LayerNorm eps 1e-12)."""

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
    embed,
    multi_head_attention,
    padding_mask,
    run_layer,
)
from .inputs import check_inputs
from .layers import Dropout, Embedding, LayerNorm, Linear

EPS = 1e-12


@dataclass
class ModelArgs(BaseArgs):
    model_type: str = "distilbert"
    vocab_size: int = 30522
    dim: int = 768
    n_layers: int = 6
    n_heads: int = 12
    hidden_dim: int = 3072
    activation: str = "gelu"
    max_position_embeddings: int = 512
    pad_token_id: int = 0
    dropout: float = 0.1
    attention_dropout: float = 0.1
    seq_classif_dropout: float = 0.2
    qa_dropout: float = 0.1

    @property
    def token_classifier_dropout(self) -> float:
        return self.dropout  # transformers' DistilBertForTokenClassification

    @property
    def hidden_size(self) -> int:
        return self.dim

    @property
    def attention_heads(self) -> int:
        return self.n_heads

    @property
    def ffn_width(self) -> int:
        return self.hidden_dim


class Embeddings(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.word_embeddings = Embedding(args.vocab_size, args.dim)
        self.position_embeddings = Embedding(args.max_position_embeddings, args.dim)
        self.LayerNorm = LayerNorm(args.dim, eps=EPS)
        self.dropout = Dropout(args.dropout)
        self.padding_idx = args.pad_token_id

    def __call__(self, input_ids):
        positions = mx.arange(input_ids.shape[1])[None]
        dtype = self.LayerNorm.weight.dtype  # quantized tables return their scales' dtype
        x = embed(self.word_embeddings, input_ids, self.padding_idx).astype(dtype)
        x = x + self.position_embeddings(positions).astype(dtype)
        return self.dropout(self.LayerNorm(x))


class MultiHeadSelfAttention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.q_lin = Linear(args.dim, args.dim)
        self.k_lin = Linear(args.dim, args.dim)
        self.v_lin = Linear(args.dim, args.dim)
        self.out_lin = Linear(args.dim, args.dim)
        self.dropout = Dropout(args.attention_dropout)

    def __call__(self, x, mask):
        h = multi_head_attention(self.q_lin(x), self.k_lin(x), self.v_lin(x), self.n_heads, mask, self.dropout)
        return self.out_lin(h)


class FFN(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.lin1 = Linear(args.dim, args.hidden_dim)
        self.lin2 = Linear(args.hidden_dim, args.dim)
        self.act = activation(args.activation)
        self.dropout = Dropout(args.dropout)

    def __call__(self, x):
        return self.dropout(self.lin2(self.act(self.lin1(x))))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = MultiHeadSelfAttention(args)
        self.sa_layer_norm = LayerNorm(args.dim, eps=EPS)
        self.ffn = FFN(args)
        self.output_layer_norm = LayerNorm(args.dim, eps=EPS)

    def __call__(self, x, mask):
        x = self.sa_layer_norm(self.attention(x, mask) + x)
        return self.output_layer_norm(self.ffn(x) + x)


class Transformer(nn.Module):
    gradient_checkpointing = False

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.layer = [TransformerBlock(args) for _ in range(args.n_layers)]

    def __call__(self, x, mask):
        for layer in self.layer:
            x = run_layer(layer, x, mask, checkpoint=self.gradient_checkpointing)
        return x


class DistilBertModel(Model, nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embeddings = Embeddings(args)
        self.transformer = Transformer(args)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        check_inputs(self.args, input_ids, attention_mask, token_type_ids, self.args.max_tokens)
        x = self.embeddings(input_ids)
        return ModelOutput(last_hidden_state=self.transformer(x, padding_mask(attention_mask, x.dtype)))


class DistilBertHead(HeadModel):
    prefix = "distilbert"
    encoder_class = DistilBertModel


class DistilBertForMaskedLM(DistilBertHead):
    ignored_keys = ("vocab_projector.weight",)

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.act = activation(args.activation)
        self.vocab_transform = Linear(args.dim, args.dim)
        self.vocab_layer_norm = LayerNorm(args.dim, eps=EPS)
        self.vocab_projector = TiedDecoder(args.dim, args.vocab_size, args.tie_word_embeddings)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        out = self.encode(input_ids, attention_mask)
        out.logits = self.predict_tokens(out.last_hidden_state)
        return out

    def predict_tokens(self, hidden: mx.array) -> mx.array:
        """Vocabulary logits of (..., H) hidden states (training scores only the masked positions)."""
        x = self.vocab_layer_norm(self.act(self.vocab_transform(hidden)))
        return self.vocab_projector(x, self.distilbert.embeddings.word_embeddings)


class DistilBertForSequenceClassification(DistilBertHead):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.pre_classifier = Linear(args.dim, args.dim)
        self.dropout = Dropout(args.seq_classif_dropout)
        self.classifier = Linear(args.dim, args.num_labels)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        out = self.encode(input_ids, attention_mask)
        pooled = nn.relu(self.pre_classifier(out.last_hidden_state[:, 0]))
        out.logits = self.classifier(self.dropout(pooled))
        return out


class DistilBertForTokenClassification(DistilBertHead, TokenClassification):
    pass


class DistilBertForQuestionAnswering(DistilBertHead, QuestionAnswering):
    pass


MODELS = {
    "encoder": DistilBertModel,
    "masked-lm": DistilBertForMaskedLM,
    "sequence-classification": DistilBertForSequenceClassification,
    "token-classification": DistilBertForTokenClassification,
    "question-answering": DistilBertForQuestionAnswering,
}
TOKEN_TYPES = False

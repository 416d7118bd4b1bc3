"""EmbeddingGemma 2's text backbone saved alone (`embedding_gemma2_text`, transformers' `EmbeddingGemma2TextModel`):
the model of embedding_gemma2.py, its keys at the root."""

from .embedding_gemma2 import EmbeddingGemma2TextModel, ModelArgs, init_std

__all__ = ["MODELS", "ModelArgs", "TOKEN_TYPES", "init_std"]

MODELS = {"encoder": EmbeddingGemma2TextModel}
TOKEN_TYPES = False

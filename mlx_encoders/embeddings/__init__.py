"""Sentence embeddings, reranking, sparse and multi-vector retrieval over the encoders in `models/`."""

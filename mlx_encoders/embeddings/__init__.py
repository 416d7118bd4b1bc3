"""Sentence embeddings, reranking, sparse and multi-vector retrieval over the encoders in `models/`.

folder.py reads and writes sentence-transformers folders; base.py is what every encoder shares (input checks,
prompts, similarity, batching); each encoder module adds its own pass and outputs.
"""

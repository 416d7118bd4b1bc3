"""Training: `fine_tune` (one call from a checkpoint and a data file to a trained model folder; the command
`python -m mlx_encoders train` in `cli`), the loop (`trainer.train`) and the building blocks it uses.

- `options`: every option, declared once (`fine_tune`'s keywords, the command's flags, which tasks read them).
- `tasks`: the task table, and one module per task (`tasks/classification.py`, ..., `tasks/retrieval.py`).

- `losses`: the task losses, as transformers' heads compute them (`task_loss`), and the embedding losses:
  `losses.contrastive`, `losses.sparse` (SPLADE), `losses.multi_vector` (ColBERT); the reranking losses
  `losses.rerank`.
- `data`: JSONL / CSV / text / iterable-of-dicts readers with errors naming file and line, labels by name or
  id, word labels aligned to sub-tokens, and `collate` into padded batches.
- `masking`: dynamic masked-LM masking (15%, 80/10/10, optional whole words) and next-sentence pairs, seeded.
- `optim`: AdamW with transformers' decay groups, its warmup schedules, clipping and gradient accumulation.
- `rtd`: ELECTRA's replaced-token detection: a generator and a discriminator pretrained together.
- `lora`: LoRA and QLoRA adapters: apply, save alone, load, fuse (exactly, or rounded again for a quantized base).
- `losses.contrastive`: sentence-transformers' embedding losses (MNRL and its cached, symmetric and Matryoshka forms,
  CoSENT, cosine similarity); `embedding`: their data, the `no_duplicates` sampler, GradCache and the
  sentence-transformers folder that `fine_tune("embed")` (`tasks/embedding.py`) writes.
- `rerank`: cross-encoder (reranker) rows and batches (BCE, ListNet, LambdaLoss or MNRL), reranking evaluation.
- `evaluators`: retrieval and reranking metrics as sentence-transformers' evaluators; `hard_negatives`: mining.
- `trainer`: the loop (seeded epochs, accumulation, evaluation), asking its task through `objective.Objective`;
  `checkpointing`: metrics.jsonl, atomic checkpoints, exact resume; `compiling`: the step's compiled forms.
- `config`: `TrainingConfig` and its checks, `OptionError` (a refused option), `Trained` (`fine_tune`'s result).
- `metrics`: macro-F1, and entity precision/recall/F1 of BIO tags as seqeval counts them; `plot`: curves.png.
"""

from .evaluators import InformationRetrievalEvaluator, RerankingEvaluator
from .fine_tune import Trained, fine_tune
from .hard_negatives import mine_hard_negatives
from .losses import task_loss
from .trainer import TrainingConfig, train

__all__ = [
    "InformationRetrievalEvaluator",
    "RerankingEvaluator",
    "Trained",
    "TrainingConfig",
    "fine_tune",
    "mine_hard_negatives",
    "task_loss",
    "train",
]

"""The training tasks, in one table: the command's short name, the task's name, what it trains and the module of
`train/tasks/` whose `train_task(data, run)` (or the function named) trains it; `fine_tune` looks tasks up here,
and imports a task's module when it runs. A new task is one row here and its module."""

import importlib
from dataclasses import dataclass

CLASSIFY, TOKENS, MLM, PRETRAINING, CLM = (
    "sequence-classification", "token-classification", "masked-lm", "pretraining", "causal-lm",
)  # fmt: skip
EMBED, SPARSE, MULTIVECTOR = "sentence-embedding", "sparse-embedding", "multi-vector-embedding"
RTD, RERANK = "replaced-token-detection", "rerank"
RETRIEVAL = (EMBED, SPARSE, MULTIVECTOR)  # they read the embed task's columns by name, and its options


@dataclass(frozen=True)
class Task:
    name: str
    help: str
    module: str
    function: str = "train_task"

    def trainer(self):
        """The module's `function(data, run) -> Trained`; `run` holds the options (`options.read_options`)."""
        return getattr(importlib.import_module(f"{__name__}.{self.module}"), self.function)


TASKS = {
    "mlm": Task(MLM, "masked language modelling (BERT's pretraining with --next-sentence)", "masked_lm"),
    "classify": Task(CLASSIFY, "text or text-pair classification, multi-label classification, regression",
                     "classification"),
    "tokens": Task(TOKENS, "token classification: named entities, tags", "tokens"),
    "clm": Task(CLM, "causal language modelling (GPT-2)", "causal_lm"),
    "rtd": Task(RTD, "ELECTRA's replaced-token detection: a generator and a discriminator", "rtd"),
    "embed": Task(EMBED, "sentence embeddings with a contrastive loss (a sentence-transformers model)", "embedding"),
    "rerank": Task(RERANK, "a cross-encoder that scores (query, document) pairs", "rerank"),
    "sparse": Task(SPARSE, "sparse (SPLADE) embeddings", "retrieval", "train_sparse"),
    "multivector": Task(MULTIVECTOR, "multi-vector (ColBERT) embeddings", "retrieval", "train_multivector"),
}  # fmt: skip
TASK_NAMES = {short: task.name for short, task in TASKS.items()}
# "pretraining" is mlm with next_sentence: it trains as mlm does, with the pretraining head
BY_NAME = {task.name: task for task in TASKS.values()} | {PRETRAINING: TASKS["mlm"]}

"""`fine_tune`: one call from a checkpoint (or a config of sizes, for training from scratch) and a data file to a
trained model folder, for every task of the table (`train/tasks`); the command `python -m mlx_encoders train` is a
thin shell over it (`train/cli.py`). Its options are the table's (`train/options.py`): it checks them all against
the task before any work, then hands them to the task's module.
"""

import errno
from pathlib import Path

from .. import distributed
from .checkpointing import checkpoints
from .config import OptionError, Trained
from .options import Data, check_task_options, read_options, signature
from .tasks import BY_NAME, MLM, TASK_NAMES
from .trainer import output_lock


@distributed.warnings_on_main_rank()  # under mlx.launch every rank would print the same warnings
def fine_tune(task: str, data: Data, output_dir: str | Path, **options) -> Trained:
    """Train `model` (a folder or hub id) on `data` for `task` ("mlm", "classify", "tokens", "clm", "rtd", or the
    long names "masked-lm", "sequence-classification", "token-classification", "causal-lm"); write checkpoints,
    metrics.jsonl, curves.png and the trained model (`output_dir/model`) to `output_dir`.

    - From scratch (mlm, clm, rtd): `config=` a config.json-like dict or file of sizes (`model_type` default "bert",
      `vocab_size` default the tokenizer's) or a preset name ("bert-base", "gpt2-small": `models.presets()`), and
      `tokenizer=` the folder holding tokenizer.json; no `model=`.
    - Data: a .jsonl/.csv/.tsv/.txt file or an iterable of dicts; columns `text_column` (default "text", or
      "tokens" for token classification), `text_pair_column` for pairs, `label_column` (default "label", or
      "ner_tags"). Classification labels by name or id; `problem_type` (default: read from the first label: a
      list is multi-label, a fraction regression) and `label2id` as transformers names them.
    - `whole_word_mask`, `next_sentence` (BERT's pretraining head: masked-LM plus next-sentence prediction on
      the documents of a .txt file), `label_all_tokens` (label every sub-token of a word) and `max_length`.
    - rtd (ELECTRA's replaced-token detection, `train/rtd.py`): `model=` (or `config=`, model_type "electra")
      is the discriminator; `generator=` a masked-LM checkpoint, else a new one `generator_size` (1/4) as wide;
      `discriminator_weight` (50) scales its loss. Saved as `output_dir/model/discriminator` (`Trained.path`,
      `Trained.model`) and `output_dir/model/generator`.
    - `lora_rank` trains LoRA adapters (alpha default 2 x rank; targets default the attention projections) over
      the frozen base, quantized or not (QLoRA); they are saved alone to `output_dir/adapters` and fused into
      the saved model.
    - Every numeric option is checked against its range first (`config.RANGES`; `OptionError`, a ValueError
      naming it), and an option the task would ignore is refused (`options.READ_BY`).
    - `resume`: a checkpoint-STEP folder of an earlier run of the same call, continued exactly.
    - "embed" ("sentence-embedding") trains a sentence-embedding model (`train/tasks/embedding.py`): rows of
      anchor, positive (negative or negative_1..n) or sentence1, sentence2, score; `loss` a name ("mnrl",
      "symmetric-mnrl", "cached-mnrl", "cosent", "cosine") or a loss of `train.losses.contrastive`; `query_prompt` /
      `document_prompt`;
      `batch_sampler` "no_duplicates" (the default for in-batch-negative losses) or "batch_sampler".
    - "rerank" trains a cross-encoder (`train/rerank.py`: rows of query, document, label or query, positive,
      negatives) with `loss` "bce", "listnet", "lambda" or "mnrl" (default: listnet when rows hold several
      documents); its eval metrics add eval_map, eval_mrr@10 and eval_ndcg@10.
    - `columns` (embed, rerank, sparse, multivector) reads the data's columns under other names, for the data and
      the eval data: {"anchor": "question", "positive": "answer"} (or ["question", "answer"] to keep their names);
      the columns left out are dropped. Without it, rows whose columns have none of the task's names are read by
      position, as sentence-transformers reads them (first the anchor or query, then the positive, then negatives;
      a "label"/"score" column is the label).
    - "sparse" trains a SPLADE model (`train/tasks/retrieval.py`; a SparseEncoder folder or a masked-LM checkpoint) with
      `loss` a `losses.sparse.SpladeLoss` (default weights documents 3e-5, queries 5e-5); "multivector" a ColBERT
      model (a MultiVectorEncoder folder or an encoder) with `losses.multi_vector.MaxSimRankingLoss`. Both read
      the embed task's columns (the first the queries) and options.
    - `training`: the fields of `TrainingConfig` (epochs, max_steps, batch_size, lr, warmup_ratio, warmup_steps,
      weight_decay, grad_accum, max_grad_norm, schedule, seed, eval_every, save_every, keep_last, final_checkpoint,
      metric_for_best, group_by_length, dtype, gradient_checkpointing).
    """
    run = read_options("fine_tune", output_dir, options)
    task = task_name(task, run.next_sentence)
    check_task_options(task, {k: v for k, v in vars(run).items() if k != "training"})  # before model and data load
    try:
        with output_lock(run.training.output_dir):
            return BY_NAME[task].trainer()(data, run)
    except OSError as error:
        advised = with_resume_advice(error, run.training.output_dir)
        if advised is error:
            raise
        raise advised from error


def with_resume_advice(error: OSError, output_dir: Path) -> OSError:
    """A full disk after a checkpoint was saved (the final model's folder, the log): the way on is to resume from
    that checkpoint, since running again would be refused for the run's files already there."""
    saved = checkpoints(output_dir)
    if error.errno not in (errno.ENOSPC, errno.EDQUOT) or "--resume" in str(error):
        return error
    if not saved:  # the run's log is there already: running again needs leave to replace it
        run_files = [p for p in output_dir.iterdir() if not p.name.startswith(".")] if output_dir.is_dir() else []
        if not run_files or "overwrite" in str(error):  # (a lock file is no run's file)
            return error
        return OSError(
            error.errno, f"{error.strerror or error}; no checkpoint was saved: once space is freed, run again with "
            "overwrite=True (--overwrite), which replaces this run's files"
        )  # fmt: skip
    return OSError(
        error.errno, f"{error.strerror or error}; the run's checkpoints are kept: once space is freed, resume from "
        f"{saved[-1]} (resume=, --resume) to finish it, rather than start over (which needs overwrite=True)"
    )  # fmt: skip


fine_tune.__signature__ = signature(fine_tune)  # every option of the table, for help() and editors


def task_name(task: str, next_sentence: bool) -> str:
    name = TASK_NAMES.get(task, task)
    if name not in TASK_NAMES.values():
        choices = ", ".join([*TASK_NAMES, *TASK_NAMES.values()])
        raise ValueError(f"Unknown training task {task!r}; choose one of {choices}")
    if next_sentence and name != MLM:
        raise OptionError("next_sentence=True trains BERT's pretraining head, which only the mlm task has")
    return "pretraining" if next_sentence else name

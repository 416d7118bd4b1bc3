"""Data-parallel training under `mlx.launch --backend ring -n 2` on loopback: two ranks on the same global batches
end with the weights one process reaches, resume across world sizes, refuse a batch size the world does not
divide, give in-batch negatives gathered from every rank the gradient of one process's loss (torch is the oracle),
and stop with an error naming a rank that died. Each launch runs tests/distributed_worker.py; runs are judged by
the files each rank wrote (mlx.launch can exit 0 when a rank failed)."""

import json
import os
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from checkpoints import make_checkpoint
from mlx.utils import tree_flatten
from safetensors.numpy import load_file

from mlx_encoders import distributed
from mlx_encoders.train import checkpointing, fine_tune
from mlx_encoders.train.lora import ADAPTERS_FILE
from mlx_encoders.train.losses import contrastive
from mlx_encoders.train.trainer import OptionError

WORKER = Path(__file__).with_name("distributed_worker.py")
# Two lengths (10 and 11 tokens): few batch shapes to compile, and rows padded for the other rank's longer ones.
TEXTS = [
    "a fine film", "dull and long", "I walked out", "a good story", "a dull film", "a sad film", "a fine story",
    "a long story", "a bad film", "it was long",
]  # fmt: skip
LABELS = ["pos", "neg", "neg", "pos", "neg", "neutral", "pos", "neutral", "neg", "neutral"]
# ModernBERT without attention biases: a key bias has no true gradient (softmax ignores a shift shared by all keys),
# so Adam turns its float-noise gradient into lr-sized steps that no two summation orders share. Dropout is 0.
SIZES = dict(num_hidden_layers=2, attention_bias=False)


EVALUATED = ("classify_eval", "mlm_eval", "embed_eval", "rerank_eval")  # runs that evaluate at every step
CONTRASTIVE = (
    "embed",
    "cached",
    "cosent",
    "rerank",
    "sparse",
    "multivector",
)  # runs of a task's own objective (not compiled)
UNCOMPILED = (*CONTRASTIVE, "embed_eval", "rerank_eval")


def contrastive_runs(root: Path, model: str, mlm_model: str) -> dict[str, dict]:
    """fine_tune options of MNRL with hard negatives, CachedMNRL (mini-batches of 1), CoSENT, a BCE reranker,
    SPLADE and ColBERT (their default losses), by name (`CONTRASTIVE`)."""
    texts = [t.split() for t in TEXTS]
    rows = [{"anchor": " ".join(t), "positive": " ".join(t[::-1]), "negative": " ".join(t[1:])} for t in texts]
    rows.append({"anchor": "a fine film", "positive": "fine", "negative": "film"})  # a repeated anchor
    data = root / "pairs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = dict(task="embed", data=str(data), model=model, max_steps=10, batch_size=4, lr=1e-3, seed=7)
    embed = dict(common, loss={"class": "MultipleNegativesRankingLoss"})
    cached = dict(common, loss={"class": "CachedMultipleNegativesRankingLoss", "mini_batch_size": 1}, seed=8)
    pairs = [(row["anchor"], row["positive"] if i % 2 else row["negative"], 0.9 if i % 2 else 0.2)
             for i, row in enumerate(rows)]  # fmt: skip
    scored = root / "scored.jsonl"  # 11 pairs: batches of 4, 4 and 3
    scored.write_text("".join(json.dumps(dict(zip(("sentence1", "sentence2", "score"), p, strict=True))) + "\n"
                              for p in pairs))  # fmt: skip
    cosent = dict(common, data=str(scored), loss={"class": "CoSENTLoss"}, seed=12)
    reranker = str(make_checkpoint(root / "reranker", "modernbert", "sequence-classification", num_labels=1, **SIZES))
    lists = [
        {
            "query": t,
            "documents": [TEXTS[(i + k + 1) % len(TEXTS)] for k in range(i % 3 + 1)],
            "labels": [1, 0, 0.5][: i % 3 + 1],
        }
        for i, t in enumerate(TEXTS)
    ]  # one to three documents a query: batches of 5 to 9 pairs
    (root / "lists.jsonl").write_text("".join(json.dumps(row) + "\n" for row in lists))
    rerank = dict(task="rerank", data=str(root / "lists.jsonl"), model=reranker, loss="bce", max_steps=10,
                  batch_size=4, lr=1e-3, seed=3)  # fmt: skip
    # SPLADE's dot products of wide vectors make an ill-conditioned loss (it swings between 0.3 and 22 from batch
    # to batch): a lower rate, and a seed whose weights have no near-zero gradient that Adam magnifies past 1e-5
    sparse = dict(common, task="sparse", model=mlm_model, seed=14, lr=1e-4)
    multivector = dict(common, task="multivector", seed=11, lr=5e-4)
    return dict(zip(CONTRASTIVE, (embed, cached, cosent, rerank, sparse, multivector), strict=True))


def worker_loss(loss):
    """A `loss` option as distributed_worker.py reads it: {"class": NAME, **options} is that contrastive loss."""
    if not isinstance(loss, dict):
        return loss
    options = dict(loss)
    return getattr(contrastive, options.pop("class"))(**options)


def free_ports(count: int) -> int:
    """The first of `count` consecutive free loopback ports (the ring backend listens on one per rank)."""
    for _ in range(100):
        first = random.randint(20000, 60000)
        try:
            sockets = []
            for port in range(first, first + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no free loopback ports")


def rank_env() -> dict:
    # one BLAS thread per rank: two ranks share this machine's cores
    path = os.pathsep.join([str(WORKER.parents[1]), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "OPENBLAS_NUM_THREADS": "1"}


def statuses_in(folder: Path) -> dict[int, dict]:
    statuses = {}
    for path in folder.glob("status-*.json"):
        status = json.loads(path.read_text())
        statuses[status["rank"]] = status
    return statuses


def launch(folder: Path, spec: dict, ranks: int = 2, timeout: float = 150) -> tuple[subprocess.CompletedProcess, dict]:
    """Run the worker on `ranks` ranks with `mlx.launch` and `spec`; (the launcher's result, each rank's status)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "spec.json").write_text(json.dumps(spec))
    command = [
        Path(sys.executable).with_name("mlx.launch"), "--backend", "ring", "-n", str(ranks),
        "--starting-port", str(free_ports(ranks)), sys.executable, WORKER, folder / "spec.json",
    ]  # fmt: skip
    result = subprocess.run(
        [str(c) for c in command], capture_output=True, text=True, timeout=timeout, env=rank_env(), cwd=folder
    )
    return result, statuses_in(folder)


def start_ranks(
    folder: Path, spec: dict, ranks: int = 2, timeout: float = 90, env: dict | None = None
) -> tuple[list, dict]:
    """The ranks started as mlx.launch starts them (MLX_RANK, MLX_HOSTFILE), without its stopping the others when
    one fails; (each rank's (exit status, stderr), each rank's status)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "spec.json").write_text(json.dumps(spec))
    first = free_ports(ranks)
    (folder / "hosts.json").write_text(json.dumps([[f"127.0.0.1:{first + r}"] for r in range(ranks)]))
    logs = [folder / f"stderr-{r}.txt" for r in range(ranks)]
    processes = []
    for r, log in enumerate(logs):
        with open(log, "w") as stderr:  # a file, not a pipe: a full pipe would block the rank
            variables = {**rank_env(), **(env or {}), "MLX_RANK": str(r), "MLX_HOSTFILE": str(folder / "hosts.json")}
            command = [sys.executable, WORKER, folder / "spec.json"]
            processes.append(subprocess.Popen(command, stderr=stderr, env=variables))
    try:
        codes = [p.wait(timeout=timeout) for p in processes]
    finally:
        for p in processes:
            p.kill()
    return [(code, log.read_text()) for code, log in zip(codes, logs, strict=True)], statuses_in(folder)


def weights(folder: Path) -> dict[str, np.ndarray]:
    """A saved model's (or LoRA adapters') tensors."""
    file = folder / "model.safetensors" if (folder / "model.safetensors").is_file() else folder / ADAPTERS_FILE
    return {k: np.array(v) for k, v in mx.load(str(file)).items()}


def assert_same_weights(found: Path, expected: Path) -> None:
    """Nearly every weight within 1e-5 of one process's; a few within 1e-4. A gradient summed in another order (the
    ranks' halves, another BLAS blocking) differs in its last bits, and where its terms cancel, Adam's m / sqrt(v)
    turns that into a visible share of an lr-sized step; a wrong exchange moves most weights by whole steps."""
    found, expected = weights(found), weights(expected)
    assert found.keys() == expected.keys()
    for name in expected:
        difference = np.abs(found[name].astype(np.float64) - expected[name])
        assert (difference <= 1e-5).mean() >= 0.999 and difference.max() <= 1e-4, (name, difference.max())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process's runs (the reference), then one launch of two ranks doing the same and more."""
    root = tmp_path_factory.mktemp("distributed")
    model = str(make_checkpoint(root / "encoder", "modernbert", **SIZES))
    mlm_model = str(make_checkpoint(root / "mlm", "modernbert", "masked-lm", **SIZES))
    noisy = str(make_checkpoint(root / "dropout", "modernbert", **SIZES, mlp_dropout=0.2, attention_dropout=0.2))
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t, "label": x}) + "\n" for t, x in zip(TEXTS, LABELS, strict=True)))
    # 10 examples in batches of 4: each epoch ends on a batch of 2, one row per rank
    classify = dict(task="classify", data=str(data), model=model, max_steps=10, batch_size=4, lr=1e-3, seed=3)
    other = root / "other.jsonl"  # another copy: the same rows and labels, two of the labels swapped
    swapped = [LABELS[1], LABELS[0], *LABELS[2:]] if LABELS[0] != LABELS[1] else list(reversed(LABELS))
    other.write_text("".join(json.dumps({"text": t, "label": x}) + "\n" for t, x in zip(TEXTS, swapped, strict=True)))
    mlm = dict(task="mlm", data=str(data), model=mlm_model, max_steps=10, batch_size=4, grad_accum=2, lr=1e-3, seed=5)
    contrastive = contrastive_runs(root, model, mlm_model)
    evaluated = {  # 2 steps, each evaluated: 3 evaluation batches of 4 rows
        name: dict(options, eval_data=options["data"], max_steps=2, eval_every=1)
        for name, options in zip(EVALUATED, (classify, mlm, contrastive["embed"], contrastive["rerank"]), strict=True)
    }
    one = root / "one"
    for name, options in (contrastive | evaluated).items():
        fine_tune(output_dir=one / name, **{**options, "loss": worker_loss(options.get("loss"))})
    fine_tune(output_dir=one / "classify", save_every=5, **classify)
    fine_tune(output_dir=one / "mlm", **mlm)
    fine_tune(output_dir=one / "lora", lora_rank=4, **classify)
    rng = np.random.default_rng(0)
    np.savez(root / "mnrl.npz", anchors=rng.normal(size=(8, 6)), positives=rng.normal(size=(8, 6)),
             weights=rng.normal(size=(6, 5)))  # fmt: skip
    table = [np.zeros((1000, 8), np.float32) for _ in range(2)]
    for rank, rows in enumerate(([3, 10, 500], [10, 999])):  # row 10 changed on both ranks
        table[rank][rows] = rng.normal(size=(len(rows), 8))
    arrays = {f"table-{r}": table[r] for r in range(2)}
    arrays |= {f"{name}-{r}": rng.normal(size=shape).astype(np.float32)
               for name, shape in (("dense", (4, 5)), ("full", (40, 8))) for r in range(2)}  # fmt: skip
    np.savez(root / "sums.npz", **arrays)
    two = root / "two"
    spec = {
        "fine_tune": {
            "classify": dict(output_dir=str(two / "classify"), save_every=5, **classify),
            "mlm": dict(output_dir=str(two / "mlm"), **mlm),
            "lora": dict(output_dir=str(two / "lora"), lora_rank=4, **classify),
            "resumed": dict(output_dir=str(two / "resumed"), resume=str(one / "classify" / "checkpoint-5"), **classify),
            "odd_batch": dict(output_dir=str(two / "odd"), **{**classify, "batch_size": 5}),
            "taken": dict(output_dir=str(two / "classify"), **classify),  # holds the first run's files
            "other_data": dict(
                output_dir=str(two / "other"),
                data_by_rank=[str(data), str(other)],
                **{k: v for k, v in classify.items() if k != "data"},
            ),  # fmt: skip
            "dropout": dict(output_dir=str(two / "dropout"), save_every=5, **{**classify, "model": noisy}),
            "dropout_resumed": dict(
                output_dir=str(two / "dropout_resumed"),
                resume=str(two / "dropout" / "checkpoint-5"),
                **{**classify, "model": noisy},
            ),  # fmt: skip
            **{
                name: dict(output_dir=str(two / name), **options) for name, options in (contrastive | evaluated).items()
            },
        },  # fmt: skip
        "gather": str(root / "mnrl.npz"),
        "sums": str(root / "sums.npz"),
    }
    result, statuses = launch(two, spec)
    return root, classify, result, statuses


def test_two_ranks_train_a_classifier_as_one_process_does(runs):
    root, _, result, statuses = runs
    assert sorted(statuses) == [0, 1], result.stderr
    assert all(s["fine_tune"]["classify"] == "ok" for s in statuses.values()), statuses
    assert_same_weights(root / "two" / "classify" / "model", root / "one" / "classify" / "model")
    # the word-embedding table's gradient travelled as the rows the batch changed, a masked-LM's tied one whole
    for name in ("classify", "mlm"):
        weights = load_file(root / "two" / name / "model" / "model.safetensors")
        total, table = sum(w.size for w in weights.values()), max(w.size for w in weights.values() if w.ndim == 2)
        sent = [s["last_sum"][name] for s in statuses.values()]
        assert all(n < total - table // 2 if name == "classify" else n > total for n in sent), (name, total, sent)
    records = [json.loads(line) for line in (root / "two" / "classify" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 11))  # one writer: no record twice
    one = [json.loads(line) for line in (root / "one" / "classify" / "metrics.jsonl").read_text().splitlines()]
    np.testing.assert_allclose([r["loss"] for r in records], [r["loss"] for r in one], atol=1e-5)
    # progress is printed by rank 0 alone (each fine_tune call of a compiled step compiles it once)
    assert result.stderr.count("Compiling the training step") == sum(
        outcome == "ok" for name, outcome in statuses[0]["fine_tune"].items() if name not in UNCOMPILED
    )


def test_an_embedding_tables_gradient_sends_the_rows_some_rank_changed(runs):
    """all_sum of a 1000-row table that the ranks changed in 4 rows sends those rows alone (after one exchange of
    which rows each rank changed), a table changed in every row whole, and sums every array exactly as adding the
    ranks' arrays does; ranks started with a ring hostfile sum over their own sockets (`ring`)."""
    root, _, result, statuses = runs
    assert sorted(statuses) == [0, 1], result.stderr
    assert [statuses[r]["exchange"] for r in range(2)] == ["sockets", "sockets"]
    arrays = np.load(root / "sums.npz")
    for rank in range(2):
        got = np.load(root / "two" / f"sums-{rank}.npz")
        for name in ("table", "dense", "full"):
            np.testing.assert_array_equal(got[name], arrays[f"{name}-0"] + arrays[f"{name}-1"])
        assert list(got["sizes"]) == [1000 + 40, 4 * 8 + 4 * 5 + 40 * 8]


def test_two_ranks_train_mnrl_with_hard_negatives_as_one_process_does(runs):
    """Each rank embeds its rows; the loss takes every rank's embeddings (in-batch negatives over the global
    batch), so 10 steps on 2 ranks end where one process at the global batch does. The no_duplicates sampler
    defers a repeated text, leaving a batch of 3 (one rank pads its part) and batches of 2. CoSENT, which ranks
    every pair of the batch against every other, gathers too."""
    root, _, result, statuses = runs
    for name in ("embed", "cached", "cosent"):
        assert all(s["fine_tune"][name] == "ok" for s in statuses.values()), (statuses, result.stderr[-3000:])
        assert_same_weights(root / "two" / name / "model", root / "one" / name / "model")
        assert_same_steps(root, name)


def assert_same_steps(root: Path, name: str) -> None:
    """The two runs logged the same losses and gradient norms at every step (Adam alone would hide a gradient
    scaled by the world size)."""
    one, two = ([json.loads(line) for line in (root / run / name / "metrics.jsonl").read_text().splitlines()]
                for run in ("one", "two"))  # fmt: skip
    assert [r["step"] for r in two] == list(range(1, 11)) and abs(one[-1]["loss"] - one[0]["loss"]) > 1e-3
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in two], [r[key] for r in one], rtol=1e-5, err_msg=key)


def test_two_ranks_train_a_reranker_as_one_process_does(runs):
    """Each rank scores its pairs (a batch of 5 to 9: one rank pads its part) and the loss takes every rank's
    logits: BCE's mean over the global batch's pairs. (Listwise losses see only score differences within a query,
    so the classifier bias has no true gradient, and Adam would turn its float noise into lr-sized steps; the seed
    is one whose weights have no near-zero gradient that Adam amplifies past 1e-5 either, see `SIZES`.)"""
    root, _, result, statuses = runs
    assert all(s["fine_tune"]["rerank"] == "ok" for s in statuses.values()), (statuses, result.stderr[-3000:])
    assert_same_weights(root / "two" / "rerank" / "model", root / "one" / "rerank" / "model")
    assert_same_steps(root, "rerank")


def test_two_ranks_train_sparse_and_multivector_models_as_one_process_does(runs):
    """SPLADE (its FLOPS regulariser takes the global batch's mean) and ColBERT (MaxSim against every rank's
    documents) gather their embeddings as the embed task does."""
    root, _, result, statuses = runs
    for name in ("sparse", "multivector"):
        assert all(s["fine_tune"][name] == "ok" for s in statuses.values()), (statuses, result.stderr[-3000:])
        assert_same_weights(root / "two" / name / "model", root / "one" / name / "model")
        assert_same_steps(root, name)


def test_two_ranks_share_the_evaluation_and_report_one_process_metrics(runs):
    """Each rank scores every other evaluation batch (rank 0 two of three, rank 1 one) and every rank gets all the
    batches' results, so both return the same metrics (the best checkpoint is chosen from them) and rank 0 logs
    one process's: masked-LM masks drawn alike, retrieval metrics over every rank's embeddings."""
    root, _, result, statuses = runs
    for name in EVALUATED:
        assert all(s["fine_tune"][name] == "ok" for s in statuses.values()), (statuses, result.stderr[-3000:])
        assert statuses[0]["returned"][name] == statuses[1]["returned"][name]
        assert [statuses[rank]["scored"][name] for rank in (0, 1)] == [4, 2]  # 2 evaluations of 3 batches
        one, two = ([json.loads(line) for line in (root / run / name / "metrics.jsonl").read_text().splitlines()
                     if "eval_loss" in line] for run in ("one", "two"))  # fmt: skip
        assert [r["step"] for r in two] == [1, 2] and [sorted(r) for r in two] == [sorted(r) for r in one]
        for found, expected in zip(two, one, strict=True):
            np.testing.assert_allclose([found[k] for k in sorted(found)], [expected[k] for k in sorted(found)],
                                       rtol=1e-5, err_msg=name)  # fmt: skip


def test_rtd_is_refused_on_several_ranks_naming_it(tmp_path, monkeypatch):
    from test_rtd import MINILM, write_texts
    from test_rtd import SIZES as RTD_SIZES
    from test_rtd import TEXTS as RTD_TEXTS

    monkeypatch.setattr(distributed, "world", lambda: distributed.World(None, 2, 0))
    data = write_texts(tmp_path / "train.jsonl", RTD_TEXTS)
    with pytest.raises(OptionError, match="replaced-token-detection training runs in one process only"):
        fine_tune("rtd", data, tmp_path / "run", config=RTD_SIZES, tokenizer=MINILM, max_steps=1, batch_size=4)
    assert not (tmp_path / "run").exists()


def test_two_ranks_train_a_masked_lm_as_one_process_does(runs):
    """Masks are drawn from the global batch (every rank collates it), so both runs mask the same tokens."""
    root, _, result, statuses = runs
    assert all(s["fine_tune"]["mlm"] == "ok" for s in statuses.values()), result.stderr
    assert_same_weights(root / "two" / "mlm" / "model", root / "one" / "mlm" / "model")


def test_two_ranks_train_lora_adapters_as_one_process_does(runs):
    root, _, result, statuses = runs
    assert all(s["fine_tune"]["lora"] == "ok" for s in statuses.values()), result.stderr
    assert_same_weights(root / "two" / "lora" / "model", root / "one" / "lora" / "model")
    assert_same_weights(root / "two" / "lora" / "adapters", root / "one" / "lora" / "adapters")


def test_resume_on_another_world_size(runs, tmp_path):
    root, classify, _, statuses = runs
    # a one-process checkpoint resumed on two ranks
    assert statuses[0]["fine_tune"]["resumed"] == "ok"
    assert_same_weights(root / "two" / "resumed" / "model", root / "one" / "classify" / "model")
    # a two-rank checkpoint resumed in one process
    fine_tune(output_dir=tmp_path / "back", resume=root / "two" / "classify" / "checkpoint-5", **classify)
    assert_same_weights(tmp_path / "back" / "model", root / "one" / "classify" / "model")


def test_a_run_with_dropout_resumes_exactly_on_as_many_ranks(runs):
    """Each rank draws its own dropout masks from a key split off the shared one, which every rank advances alike
    and the checkpoint keeps."""
    root, _, result, statuses = runs
    assert statuses[0]["fine_tune"]["dropout_resumed"] == "ok", result.stderr
    assert_same_weights(root / "two" / "dropout_resumed" / "model", root / "two" / "dropout" / "model")
    # the same start as the classifier (one seed), dropout aside: dropout changed the steps
    noisy, plain = weights(root / "two" / "dropout" / "model"), weights(root / "two" / "classify" / "model")
    assert max(np.abs(noisy[k] - plain[k]).max() for k in plain) > 1e-3


def test_a_batch_size_the_world_does_not_divide_is_refused(runs):
    _, _, _, statuses = runs
    for status in statuses.values():
        error = status["fine_tune"]["odd_batch"]
        assert error.startswith("OptionError") and "batch_size 5" in error and "world size 2" in error, error
    assert not (runs[0] / "two" / "odd").exists()


def test_an_output_folder_holding_another_run_is_refused_by_every_rank(runs):
    _, _, _, statuses = runs
    for status in statuses.values():
        assert status["fine_tune"]["taken"].startswith("FileExistsError"), status["fine_tune"]["taken"]


def test_ranks_whose_data_differ_are_refused_by_every_rank_naming_it(runs):
    """Rank 1 reads another copy of the data (two labels swapped): each rank stops before the first step, naming
    the data, where they summed gradients of other data without a word."""
    _, _, _, statuses = runs
    for rank, status in statuses.items():
        error = status["fine_tune"]["other_data"]
        assert error.startswith(f"ValueError: rank {rank}: the ranks differ at the start of training (the training "
                                "data: rank 0 "), error  # fmt: skip
        assert "the model's parameters" not in error
    assert not (runs[0] / "two" / "other").exists()


def test_gathered_embeddings_get_every_ranks_gradient(runs):
    """2 ranks x 4 anchors against all 8 positives: the gradient of one process's loss on 8 (torch), with our
    gather; MLX's own all_gather drops the other rank's share of it."""
    root, _, _, _ = runs
    data = np.load(root / "mnrl.npz")
    w = torch.tensor(data["weights"], dtype=torch.float32, requires_grad=True)
    a = torch.nn.functional.normalize(torch.tanh(torch.tensor(data["anchors"], dtype=torch.float32) @ w), dim=-1)
    p = torch.nn.functional.normalize(torch.tanh(torch.tensor(data["positives"], dtype=torch.float32) @ w), dim=-1)
    torch.nn.functional.cross_entropy(20 * a @ p.T, torch.arange(8)).backward()
    for rank in (0, 1):
        grads = np.load(root / "two" / f"gradients-{rank}.npz")
        np.testing.assert_allclose(grads["ours"], w.grad.numpy(), atol=1e-5)
        assert np.abs(grads["mlx"] - w.grad.numpy()).max() > 1e-3


def test_a_killed_rank_stops_the_other_with_an_error_naming_it(runs, tmp_path):
    """`mlx-encoders train` on two ranks; rank 1 dies (SIGKILL) before step 5: rank 0 exits 1 naming it, and the
    checkpoint of step 4 is complete. The ring backend mostly reports the lost connection; when its wait hangs
    instead, the collective's timer ends the rank (mlx.launch itself would also stop rank 0, naming rank 1)."""
    root, _, _, _ = runs
    out = tmp_path / "run" / "out"
    cli = ["train", "classify", "--model", str(root / "encoder"), "--data", str(root / "train.jsonl"), "--output",
           str(out), "--max-steps", "40", "--batch-size", "4", "--save-every", "2", "--seed", "1"]  # fmt: skip
    spec = {"cli": cli, "kill_rank": 1, "kill_at_step": 5}
    (code_0, log_0), (code_1, log_1) = start_ranks(tmp_path / "run", spec, env={distributed.TIMEOUT_ENV: "15"})[0]
    assert code_1 == -9 and code_0 == 1, log_0[-2000:]
    assert "newly initialized" in log_0 and "Warning" not in log_1, log_1[-2000:]  # the new head's: rank 0 alone
    lost = "mlx-encoders train: error: rank 0: lost rank 1 during step 5"
    assert lost in log_0 or "rank 0: no answer from rank 1 for 15 s during step 5" in log_0, log_0[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "checkpoint-4", "metrics.jsonl"]
    assert checkpointing.read_state(out / "checkpoint-4" / checkpointing.STATE_FILE).step == 4
    fine_tune("classify", root / "train.jsonl", tmp_path / "resumed", model=root / "encoder", max_steps=6,
              batch_size=4, seed=1, resume=out / "checkpoint-4")  # fmt: skip


def test_a_rank_that_fails_before_training_stops_the_other_with_an_error_naming_it(runs, tmp_path):
    """Rank 1 cannot read its data (a file missing on its machine) and exits before the start-of-training check:
    rank 0 says it lost rank 1 (MLX's gather could hand back zeros for the lost rank, which failed to unpickle)."""
    root, _, _, _ = runs
    shutil.copy(root / "train.jsonl", tmp_path / "data-0.jsonl")  # data-1.jsonl is missing
    cli = ["train", "classify", "--model", str(root / "encoder"), "--data", str(tmp_path / "data-{RANK}.jsonl"),
           "--output", str(tmp_path / "out"), "--max-steps", "2", "--batch-size", "4"]  # fmt: skip
    (code_0, log_0), (code_1, log_1) = start_ranks(tmp_path / "run", {"cli": cli}, env={distributed.TIMEOUT_ENV: "15"})[
        0
    ]
    assert code_1 == 1 and "data-1.jsonl: no such file" in log_1, log_1[-2000:]
    assert code_0 == 1 and "Traceback" not in log_0, log_0[-2000:]
    lost = "mlx-encoders train: error: rank 0: lost rank 1 during the start of training"
    assert lost in log_0 or "rank 0: no answer from rank 1 for 15 s" in log_0, log_0[-2000:]


def test_a_stalled_collective_ends_the_rank_naming_its_peers():
    """A rank that stops answering without closing its connection (a hung or lost machine) cannot be noticed by
    the backend: the timer ends the waiting rank."""
    code = (
        "import time\nfrom mlx_encoders import distributed\n"
        "world = distributed.World(None, 4, 2)\n"
        "with distributed.collective(world, 'step 7', seconds=0.2):\n    time.sleep(5)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert "rank 2: no answer from rank 1 or rank 3" in result.stderr and "during step 7" in result.stderr


def test_gradients_travel_as_one_buffer_per_dtype(monkeypatch):
    """A step's gradients, whatever their number, make one collective per dtype (each collective has a latency);
    the sums come back in the tree's shapes and order. A world of one sums nothing, so the values return as given."""
    calls = []
    real = mx.distributed.all_sum
    monkeypatch.setattr(mx.distributed, "all_sum", lambda x, **kw: calls.append(x.shape) or real(x, **kw))
    rng = np.random.default_rng(0)
    tree = {"layers": [{"w": mx.array(rng.normal(size=(3, 4)).astype(np.float32)), "b": mx.zeros(4)}
                       for _ in range(20)], "scale": mx.ones(2, dtype=mx.float16), "loss": mx.array(1.5)}  # fmt: skip
    summed = distributed.all_sum(tree, distributed.World(None, 2, 0), "a test")
    assert sorted(calls) == [(2,), (20 * 16 + 1,)]
    for (name, a), (_, b) in zip(tree_flatten(tree), tree_flatten(summed), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype and mx.array_equal(a, b).item(), name


def test_weighted_sum_applies_each_weight_once_and_keeps_dtypes():
    """Σ w_i tree_i: one part stays as given (its weight pending, applied where `all_sum` copies the arrays into its
    buffer), more parts fold into one sum; both equal numpy's products and sums, in the arrays' own dtypes."""
    rng = np.random.default_rng(0)
    parts = [{"w": rng.normal(size=(3, 4)).astype(np.float32), "h": rng.normal(size=5).astype(np.float16)}
             for _ in range(3)]  # fmt: skip
    weights = [0.25, 0.5, 0.125]
    total = distributed.WeightedSum()
    assert total.tree is None and total.result() is None
    first = {k: mx.array(v) for k, v in parts[0].items()}
    total.add(first, weights[0])
    assert total.tree is first and total.weight == weights[0]  # no pass over the arrays yet
    summed = distributed.all_sum(total.tree, distributed.World(None, 2, 0), "a test", weight=total.weight)
    for k, v in parts[0].items():
        np.testing.assert_allclose(np.array(summed[k]), v * np.asarray(weights[0], v.dtype), rtol=1e-3)
        assert summed[k].dtype == first[k].dtype
    alone = total.result()  # one part: its weight applied here
    for k, v in parts[0].items():
        np.testing.assert_allclose(np.array(alone[k]), v * np.asarray(weights[0], v.dtype), rtol=1e-3)
        assert alone[k].dtype == first[k].dtype
    assert total.tree is None  # the sum let go of its parts
    total.add(first, weights[0])
    for part, weight in zip(parts[1:], weights[1:], strict=True):
        total.add({k: mx.array(v) for k, v in part.items()}, weight)
    assert total.weight == 1.0
    result = total.result()
    for k in parts[0]:
        expected = sum(p[k].astype(np.float64) * w for p, w in zip(parts, weights, strict=True))
        np.testing.assert_allclose(np.array(result[k]), expected, rtol=1e-6 if k == "w" else 2e-3, atol=1e-7)
        assert result[k].dtype == first[k].dtype


@pytest.mark.parametrize("micro_batches", [1, 2, 3])
def test_ranks_step_gradients_sum_to_the_whole_batchs(micro_batches):
    """Each rank's `step_gradients` (a world of two without a group: all_sum hands back this rank's part) of a
    squared-error loss averaged over each micro-batch's kept rows; the two ranks' parts add up to numpy's gradient
    of the step's loss (the mean over micro-batches of each one's mean), including micro-batches where one rank
    keeps no row. The loss travels as float32 whatever its dtype."""
    rng = np.random.default_rng(micro_batches)
    w = rng.normal(size=3).astype(np.float32)
    batches = []
    for i in range(micro_batches):
        keep = (rng.random(6) < 0.7).astype(np.float32)
        if i == 0:
            keep[1::2] = 0  # rank 1's rows (1, 3, 5) keep nothing in the first micro-batch
        keep[0] = 1
        batches.append({"x": rng.normal(size=(6, 3)).astype(np.float32), "y": rng.normal(size=6).astype(np.float32),
                        "keep": keep})  # fmt: skip

    def count(batch):
        return int(batch["keep"].sum())

    def loss_and_grad(batch):
        x, y, keep = (mx.array(batch[k]) for k in ("x", "y", "keep"))

        def loss(params):
            return (((x @ params["w"] - y) ** 2) * keep).sum() / keep.sum()

        value, grads = mx.value_and_grad(loss)({"w": mx.array(w)})
        return value.astype(mx.float16), grads

    worlds = [distributed.World(None, 2, rank) for rank in range(2)]
    parts = [distributed.step_gradients(loss_and_grad, batches, count, {"w": mx.array(w)}, world, "a test")
             for world in worlds]  # fmt: skip
    expected_loss, expected_grad = 0.0, np.zeros(3)
    for b in batches:
        x, y, keep = (b[k].astype(np.float64) for k in ("x", "y", "keep"))
        error = x @ w - y
        expected_loss += (error**2 * keep).sum() / keep.sum() / micro_batches
        expected_grad += 2 * (x * (error * keep)[:, None]).sum(0) / keep.sum() / micro_batches
    for loss, _ in parts:
        assert loss.dtype == mx.float32
    grad = sum(np.array(g["w"], np.float64) for _, g in parts)
    np.testing.assert_allclose(grad, expected_grad, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(sum(float(loss) for loss, _ in parts), expected_loss, rtol=2e-3)  # float16 parts


def test_check_batch_size_names_both_numbers():
    world = distributed.World(None, 4, 0)
    assert distributed.check_batch_size(8, world) is None
    assert "batch_size 6 is not divisible by the world size 4" in distributed.check_batch_size(6, world)


def test_bert_pretraining_is_refused_on_several_ranks(checkpoint, tmp_path, monkeypatch):
    """Its loss adds a mean over rows (next sentence) to a mean over masked tokens: no one weight per rank's part
    gives the global loss, so it trains in one process (and its step stays whole there too)."""
    from test_fine_tune import DOCUMENTS

    monkeypatch.setattr(distributed, "world", lambda: distributed.World(None, 2, 0))
    data = tmp_path / "docs.txt"
    data.write_text(DOCUMENTS)
    with pytest.raises(OptionError, match="training runs in one process only"):
        fine_tune("mlm", data, tmp_path / "run", model=checkpoint("bert", "pretraining"), next_sentence=True,
                  max_steps=1, batch_size=4)  # fmt: skip
    assert not (tmp_path / "run").exists()

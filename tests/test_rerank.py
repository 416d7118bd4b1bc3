"""Reranker training: the losses equal sentence-transformers' cross-encoder losses (value and gradients) on the same
weights and batch; `fine_tune("rerank")` trains, evaluates with the reranking metrics and saves a folder that
sentence-transformers' CrossEncoder reads with the scores ours gives; the `train rerank` command."""

import json
import shutil

import mlx.nn as nn
import numpy as np
import pytest
import torch
from checkpoints import make_checkpoint
from mlx.utils import tree_flatten
from sentence_transformers import CrossEncoder as TorchCrossEncoder
from sentence_transformers.cross_encoder.data_collator import CrossEncoderDataCollator
from sentence_transformers.cross_encoder.losses import (
    BinaryCrossEntropyLoss,
    LambdaLoss,
    ListNetLoss,
    MultipleNegativesRankingLoss,
)

from mlx_encoders import CrossEncoder
from mlx_encoders.__main__ import main
from mlx_encoders.checkpoint import Checkpoint
from mlx_encoders.checkpoint.tokenizer import tokenizer_for
from mlx_encoders.train import fine_tune
from mlx_encoders.train.data import DataError
from mlx_encoders.train.rerank import RerankObjective, load_reranker, rerank_data

pytestmark = pytest.mark.usefixtures("one_torch_thread")

POINTWISE = [
    {"query": "where do cats sleep", "document": "Cats sleep on warm windowsills.", "label": 1},
    {"query": "where do cats sleep", "document": "The stock market fell sharply today.", "label": 0},
    {"query": "capital of France", "document": "Paris is the capital of France.", "label": 1.0},
    {"query": "capital of France", "document": "Berlin is a city in Germany.", "label": 0.25},  # graded
    {"query": "how to brew tea", "document": "Pour hot water over the leaves and wait.", "label": 0.75},
]
LISTWISE = [
    {"query": "where do cats sleep", "positive": "Cats sleep on warm windowsills.",
     "negative_1": "Dogs bark at night.", "negative_2": "The stock market fell."},
    {"query": "capital of France", "positive": "Paris is the capital of France.",
     "negative_1": "Berlin is in Germany.", "negative_2": "Rome has many old churches."},
    {"query": "how to brew tea", "documents": ["Steep the leaves.", "Grind the beans.", "Boil the water first."],
     "labels": [1, 0, 0.5]},
    {"query": "a short list", "documents": ["only one here", "and a second"], "labels": [0, 1]},
]  # fmt: skip
TRIPLETS = LISTWISE[:2] + [
    {"query": "how to brew tea", "positive": "Steep the leaves in hot water.", "negative_1": "Grind the beans.",
     "negative_2": "Tea grows on hills."},
]  # fmt: skip


@pytest.fixture(scope="module")
def reranker_folder(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("reranker"), "bert", "sequence-classification", num_labels=1)


def our_loss_and_grads(folder, rows, loss: str):
    checkpoint = Checkpoint.open(folder)
    model, tokenizer = load_reranker(checkpoint), tokenizer_for(checkpoint.args, checkpoint)
    model.eval()  # no dropout: the same function as theirs in eval mode
    examples = rerank_data(rows, tokenizer)
    objective = RerankObjective(loss, tokenizer)
    inputs, labels = objective.split(objective.collate(examples, np.arange(len(rows))))
    value, grads = nn.value_and_grad(model, lambda: objective.loss(model, inputs, labels))()
    return value.item(), {k: np.array(v) for k, v in tree_flatten(grads)}


def their_loss_and_grads(folder, rows, loss: str):
    model = TorchCrossEncoder(str(folder), device="cpu")
    model.model.eval()
    if loss == "bce":
        inputs = [[r["query"] for r in rows], [r["document"] for r in rows]]
        value = BinaryCrossEntropyLoss(model)(inputs, torch.tensor([float(r["label"]) for r in rows]))
    elif loss == "mnrl":
        columns = [[r[c] for r in rows] for c in ("query", "positive", "negative_1", "negative_2")]
        value = MultipleNegativesRankingLoss(model, num_negatives=None)(columns, None)
    else:
        docs = [r.get("documents") or [r["positive"], r["negative_1"], r["negative_2"]] for r in rows]
        labels = [torch.tensor(r.get("labels") or [1, 0, 0], dtype=torch.float32) for r in rows]
        loss_class = ListNetLoss if loss == "listnet" else LambdaLoss
        value = loss_class(model)([[r["query"] for r in rows], docs], labels)
    value.backward()
    return value.item(), {n: p.grad.numpy() for n, p in model.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "loss,rows", [("bce", POINTWISE), ("listnet", LISTWISE), ("lambda", LISTWISE), ("mnrl", TRIPLETS)]
)
def test_losses_and_gradients_equal_sentence_transformers(reranker_folder, loss, rows):
    value, grads = our_loss_and_grads(reranker_folder, rows, loss)
    expected, expected_grads = their_loss_and_grads(reranker_folder, rows, loss)
    assert value == pytest.approx(expected, rel=1e-5)
    assert set(grads) == set(expected_grads)
    scale = max(float(np.abs(g).max()) for g in expected_grads.values())  # some gradients are roundoff (key biases)
    for name, g in grads.items():
        np.testing.assert_allclose(g, expected_grads[name], rtol=1e-5, atol=1e-5 * scale, err_msg=name)


def their_collated_loss_and_grads(folder, rows, loss_class, **options):
    """sentence-transformers' loss on `rows` through its cross-encoder data collator and trainer, which take the
    columns by position (a "label"/"labels" column as the labels)."""
    model = TorchCrossEncoder(str(folder), device="cpu")
    model.model.eval()
    inputs = CrossEncoderDataCollator(preprocess_fn=None)(rows)
    labels = inputs.pop("label", None)
    value = loss_class(model, **options)(list(inputs.values()), labels)
    value.backward()
    return value.item(), {n: p.grad.numpy() for n, p in model.model.named_parameters() if p.grad is not None}


RENAMED = {  # rows whose columns are named otherwise, read by position as sentence-transformers reads them
    "bce": ([{"question": r["query"], "passage": r["document"], "label": r["label"]} for r in POINTWISE],
            BinaryCrossEntropyLoss, {}),
    "listnet": ([{"question": r["query"], "docs": r["documents"], "labels": r["labels"]} for r in LISTWISE[2:]],
                ListNetLoss, {}),
    "mnrl": ([{"q": r["query"], "a": r["positive"], "n1": r["negative_1"], "n2": r["negative_2"]} for r in TRIPLETS],
             MultipleNegativesRankingLoss, {"num_negatives": None}),
    # their names, with any of sentence-transformers' label columns
    "bce-score": ([{"query": r["query"], "document": r["document"], "score": r["label"]} for r in POINTWISE],
                  BinaryCrossEntropyLoss, {}),
    "listnet-scores": ([{"query": r["query"], "documents": r["documents"], "scores": r["labels"]}
                        for r in LISTWISE[2:]], ListNetLoss, {}),
    # `mine`'s labeled-pair and labeled-list rows (as sentence-transformers' mine_hard_negatives writes them)
    "bce-mined": ([{"query": r["query"], "positive": r["document"], "label": r["label"]} for r in POINTWISE],
                  BinaryCrossEntropyLoss, {}),
    "listnet-mined": ([{"query": r["query"], "positive": r["documents"], "labels": r["labels"]}
                       for r in LISTWISE[2:]], ListNetLoss, {}),
}  # fmt: skip


@pytest.mark.parametrize("loss", list(RENAMED))
def test_rows_of_other_column_names_are_read_by_position_as_sentence_transformers_reads_them(reranker_folder, loss):
    rows, loss_class, options = RENAMED[loss]
    value, grads = our_loss_and_grads(reranker_folder, rows, loss.split("-")[0])
    expected, expected_grads = their_collated_loss_and_grads(reranker_folder, rows, loss_class, **options)
    assert value == pytest.approx(expected, rel=1e-5)
    assert set(grads) == set(expected_grads)
    scale = max(float(np.abs(g).max()) for g in expected_grads.values())
    for name, g in grads.items():
        np.testing.assert_allclose(g, expected_grads[name], rtol=1e-5, atol=1e-5 * scale, err_msg=name)


def test_columns_pick_and_rename_reranking_columns(reranker_folder):
    tokenizer = tokenizer_for(Checkpoint.open(reranker_folder).args, Checkpoint.open(reranker_folder))
    rows = [{"id": str(i), **r} for i, r in enumerate(TRIPLETS)]
    with pytest.raises(DataError, match=r"item 1 of the data: .*\('id' looks like ids, not texts\)\. .*--columns"):
        rerank_data([{"id": "1", "q": "a", "d": "b"}], tokenizer)
    examples = rerank_data(
        rows, tokenizer, columns={"query": "query", "positive": "positive", "negative": "negative_2"}
    )
    assert examples.documents == [[r["positive"], r["negative_2"]] for r in TRIPLETS]
    assert examples.labels == [[1.0, 0.0]] * len(TRIPLETS)
    # columns read by position: a row listing the first row's columns in another key order is read by name
    mixed = rerank_data([{"question": "q1", "answer": "a1"}, {"answer": "a2", "question": "q2"}], tokenizer)
    assert mixed.queries == ["q1", "q2"] and mixed.documents == [["a1"], ["a2"]]


@pytest.mark.parametrize("loss", ["bce", "lambda", "mnrl"])  # listnet: test_rerank_with_lora_resumes_exactly
def test_fine_tune_rerank_saves_a_folder_sentence_transformers_reads(tmp_path, reranker_folder, loss):
    rows = TRIPLETS + LISTWISE[:1] if loss == "mnrl" else LISTWISE
    trained = fine_tune(
        "rerank", rows, tmp_path / "run", model=reranker_folder, eval_data=rows, loss=loss,
        epochs=2, batch_size=2, lr=1e-3, metric_for_best="eval_ndcg@10",
    )  # fmt: skip
    assert set(trained.metrics) >= {"eval_loss", "eval_map", "eval_mrr@10", "eval_ndcg@10"}
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    pairs = [(r["query"], d) for r in LISTWISE[2:] for d in r["documents"]]
    ours = CrossEncoder(trained.path).predict(pairs)
    theirs = TorchCrossEncoder(str(trained.path), device="cpu").predict(pairs)
    np.testing.assert_allclose(ours, theirs, atol=1e-5)
    before = CrossEncoder(reranker_folder).predict(pairs)
    assert np.abs(ours - before).max() > 1e-3  # it trained


def test_train_rerank_command(tmp_path, reranker_folder, capsys):
    data = tmp_path / "train.tsv"  # labels as text cells
    data.write_text(
        "query\tdocument\tlabel\n" + "".join(f"{r['query']}\t{r['document']}\t{r['label']}\n" for r in POINTWISE)
    )
    args = ["train", "rerank", "--model", str(reranker_folder), "--data", str(data), "--output", str(tmp_path / "o"),
            "--eval-data", str(data), "--max-steps", "2", "--batch-size", "4", "--json"]  # fmt: skip
    assert main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["metrics"]["eval_map"] > 0
    assert TorchCrossEncoder(printed["model"], device="cpu").num_labels == 1


def test_bad_rows_and_heads_are_named(tmp_path, reranker_folder, checkpoint):
    tokenizer = tokenizer_for(Checkpoint.open(reranker_folder).args, Checkpoint.open(reranker_folder))
    with pytest.raises(DataError, match="item 1 of the data: labels must be numbers in"):
        rerank_data([{"query": "q", "document": "d", "label": 3}], tokenizer)
    with pytest.raises(DataError, match=r"item 1 of the data: a reranking row has .* this row has 'query' \(fewer"):
        rerank_data([{"query": "q"}], tokenizer)
    with pytest.raises(ValueError, match="classification head of 3 labels"):
        fine_tune("rerank", POINTWISE, tmp_path, model=checkpoint("bert", "sequence-classification"))
    with pytest.raises(DataError, match="loss 'mnrl' takes"):
        fine_tune("rerank", LISTWISE, tmp_path / "y", model=reranker_folder, loss="mnrl")
    with pytest.raises(ValueError, match="loss must be one of"):
        fine_tune("rerank", POINTWISE, tmp_path / "x", model=reranker_folder, loss="hinge")


def test_rerank_with_lora_resumes_exactly(tmp_path, reranker_folder):
    options = dict(model=reranker_folder, eval_data=LISTWISE, loss="listnet", max_steps=3, batch_size=2, lr=1e-3,
                   save_every=1, keep_last=3, lora_rank=2)  # fmt: skip
    whole = fine_tune("rerank", LISTWISE, tmp_path / "whole", **options)
    fine_tune("rerank", LISTWISE, tmp_path / "cut", **options)
    resumed = fine_tune("rerank", LISTWISE, tmp_path / "cut", resume=tmp_path / "cut" / "checkpoint-1", **options)
    assert resumed.metrics == pytest.approx(whole.metrics, rel=1e-6)
    assert (tmp_path / "whole" / "adapters").is_dir()
    pairs = [(r["query"], d) for r in LISTWISE[2:] for d in r["documents"]]
    np.testing.assert_allclose(
        CrossEncoder(whole.path).predict(pairs),
        TorchCrossEncoder(str(whole.path), device="cpu").predict(pairs),
        atol=1e-5,
    )


def test_training_matches_a_torch_loop_with_sentence_transformers_loss_step_for_step(tmp_path):
    """6 AdamW steps (batches of 2 rows in the trainer's seeded order, constant lr, no clipping, dropout off) of
    `fine_tune("rerank", loss="lambda")` against the same steps of sentence-transformers' LambdaLoss in torch."""
    from mlx_encoders.train.trainer import TrainingConfig, epoch_steps

    folder = make_checkpoint(
        tmp_path / "start", "bert", "sequence-classification", num_labels=1, num_hidden_layers=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0,
    )  # fmt: skip
    rows = LISTWISE + TRIPLETS
    options = dict(max_steps=6, batch_size=2, lr=3e-3, schedule="constant", max_grad_norm=None, seed=5)
    trained = fine_tune("rerank", rows, tmp_path / "run", model=folder, loss="lambda", **options)
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]

    theirs = TorchCrossEncoder(str(folder), device="cpu")
    theirs.model.train()
    loss_fn = LambdaLoss(theirs)
    optimizer = torch.optim.AdamW(theirs.model.parameters(), lr=3e-3, weight_decay=0.0)
    config = TrainingConfig(tmp_path / "unused", **options)
    order = [b for epoch in range(3) for step in epoch_steps(len(rows), config, epoch) for b in step][:6]
    for step, batch in enumerate(order):
        chosen = [rows[i] for i in batch]
        docs = [r.get("documents") or [r["positive"], r["negative_1"], r["negative_2"]] for r in chosen]
        labels = [torch.tensor(r.get("labels") or [1, 0, 0], dtype=torch.float32) for r in chosen]
        optimizer.zero_grad()
        value = loss_fn([[r["query"] for r in chosen], docs], labels)
        value.backward()
        optimizer.step()
        assert losses[step] == pytest.approx(value.item(), rel=1e-4), step
    ours = {k: np.array(v) for k, v in tree_flatten(trained.model.parameters())}
    start = {n: p.detach().numpy() for n, p in TorchCrossEncoder(str(folder), device="cpu").model.named_parameters()}
    moved = 0.0
    for name, p in theirs.model.named_parameters():
        # No gradient but roundoff, which Adam scales up to full steps: key biases (softmax ignores a shift) and the
        # classifier bias (a ranking loss only sees differences of scores).
        if name.endswith("attention.self.key.bias") or name == "classifier.bias":
            continue
        expected = p.detach().numpy()
        np.testing.assert_allclose(ours[name], expected, rtol=0, atol=1e-4 * np.abs(expected).max(), err_msg=name)
        moved = max(moved, float(np.abs(expected - start[name]).max()))
    assert moved > 1e-3  # training moved the weights far more than the tolerance


def test_evaluation_counts_a_query_positive_once_over_its_triplet_rows(reranker_folder):
    """`mine`'s triplet rows repeat a query's positive beside each negative: the metrics rank its distinct documents,
    as CrossEncoderRerankingEvaluator ranks the query's positive among its negatives."""
    from sentence_transformers.cross_encoder.evaluation import CrossEncoderRerankingEvaluator

    theirs = TorchCrossEncoder(str(reranker_folder), device="cpu")
    query = "where do cats sleep"
    docs = ["Cats sleep on warm windowsills.", "Dogs bark at night.", "The stock market fell.", "Tea is brewed hot."]
    order = np.argsort(-theirs.predict([(query, d) for d in docs]))
    positive, negatives = docs[order[1]], [docs[i] for i in order[[0, 2, 3]]]  # the positive ranks second
    rows = [{"query": query, "positive": positive, "negative": n} for n in negatives]
    checkpoint = Checkpoint.open(reranker_folder)
    tokenizer = tokenizer_for(checkpoint.args, checkpoint)
    ours = RerankObjective("bce", tokenizer).evaluate(load_reranker(checkpoint), rerank_data(rows, tokenizer), 8)
    expected = CrossEncoderRerankingEvaluator(
        [{"query": query, "positive": [positive], "negative": negatives}], write_csv=False
    )(theirs)
    for name in ("map", "mrr@10", "ndcg@10"):
        assert ours[f"eval_{name}"] == pytest.approx(expected[name], rel=1e-6), name


def test_a_sentence_transformers_cross_encoders_settings_and_the_trained_length_are_kept(tmp_path, reranker_folder):
    """Trained from a folder sentence-transformers 6 saved (its activation, prompts), the output keeps them and
    the training's max_length, as CrossEncoder.save keeps them; a LogitScore reranker (whose scores are its language
    model head's logits) is refused rather than given a new random head."""
    source = tmp_path / "source"
    TorchCrossEncoder(
        str(reranker_folder), device="cpu", activation_fn=torch.nn.Identity(), prompts={"web": "web: "},
        default_prompt_name="web",
    ).save(str(source))  # fmt: skip
    trained = fine_tune("rerank", POINTWISE, tmp_path / "run", model=source, max_length=16, max_steps=1, lr=1e-9)
    theirs = TorchCrossEncoder(str(trained.path), device="cpu")
    assert isinstance(theirs.activation_fn, torch.nn.Identity) and theirs.prompts == {"web": "web: "}
    assert theirs.default_prompt_name == "web" and theirs.max_length == 16
    assert CrossEncoder(trained.path).max_seq_length == 16
    scored = tmp_path / "logit-score"
    shutil.copytree(reranker_folder, scored)
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.base.modules.transformer.Transformer"},
               {"idx": 1, "name": "1", "path": "1_LogitScore",
                "type": "sentence_transformers.cross_encoder.modules.logit_score.LogitScore"}]  # fmt: skip
    (scored / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="LogitScore module"):
        fine_tune("rerank", POINTWISE, tmp_path / "refused", model=scored)


def test_mined_triplets_with_their_scores_read_as_positive_and_negatives(reranker_folder):
    """`mine(output_scores=True)` adds each row's similarity scores: a positive with negatives stays 1 and 0s."""
    tokenizer = tokenizer_for(Checkpoint.open(reranker_folder).args, Checkpoint.open(reranker_folder))
    rows = [
        {"query": "q", "positive": "p", "negative": "n", "scores": [0.9, 0.2]},
        {"query": "q2", "positive": "p2", "negative_1": "n1", "negative_2": "n2", "scores": [0.9, 0.2, 0.1]},
    ]
    examples = rerank_data(rows, tokenizer)
    assert examples.documents == [["p", "n"], ["p2", "n1", "n2"]] and examples.labels == [[1.0, 0.0], [1.0, 0.0, 0.0]]


def test_predict_tensors_computed_on_a_worker_thread_are_read_on_the_caller_s(reranker_folder):
    """convert_to_tensor and convert_to_numpy=False hand back computed arrays: a lazy one belongs to the stream of
    the thread that made it, and reading it on another thread (an app's) raised."""
    from concurrent.futures import ThreadPoolExecutor

    encoder = CrossEncoder(reranker_folder)
    pairs = [("a query", "a document"), ("a query", "another one"), ("q", "d")]
    expected = encoder.predict(pairs)
    with ThreadPoolExecutor(1) as pool:
        tensor = pool.submit(encoder.predict, pairs, convert_to_tensor=True).result()
        listed = pool.submit(encoder.predict, pairs, convert_to_numpy=False).result()
    np.testing.assert_allclose(np.array(tensor), expected, rtol=1e-6)
    np.testing.assert_allclose([float(x) for x in listed], expected, rtol=1e-6)

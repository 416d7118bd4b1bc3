"""Embedding losses and the embed task against sentence-transformers (torch CPU), on the same weights and batches.

A tiny seeded BERT (tests/checkpoints.py) wrapped into a sentence-transformers folder by sentence-transformers
itself; each loss's value and the gradients of named parameters are compared with sentence-transformers' loss
on the same batch, 20 AdamW steps with a torch loop running its loss, and the trained folder with
`SentenceTransformer`.
"""

import json
import math
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
from checkpoints import make_checkpoint
from mlx.utils import tree_flatten
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import Normalize, Transformer
from sentence_transformers.base.sampler import NoDuplicatesBatchSampler
from sentence_transformers.base.trainer import BaseTrainer
from sentence_transformers.sentence_transformer import losses as st_losses
from sentence_transformers.sentence_transformer.data_collator import SentenceTransformerDataCollator
from sentence_transformers.sentence_transformer.modules import Pooling
from sentence_transformers.util import dot_score

from mlx_encoders import SentenceEncoder
from mlx_encoders.__main__ import main
from mlx_encoders.checkpoint.build import load_model
from mlx_encoders.checkpoint.tokenizer import tokenizer_for
from mlx_encoders.engine.ops import drawing_from
from mlx_encoders.train import compiling, embedding, fine_tune
from mlx_encoders.train.data import DataError
from mlx_encoders.train.embedding import EmbeddingObjective, embedding_data, no_duplicates
from mlx_encoders.train.losses.contrastive import (
    CachedMultipleNegativesRankingLoss,
    CoSENTLoss,
    CosineSimilarityLoss,
    MatryoshkaLoss,
    MultipleNegativesRankingLoss,
)
from mlx_encoders.train.tasks import embedding as embed_task

PARAMETERS = (
    "embeddings.word_embeddings.weight",
    "encoder.layer.0.attention.self.query.weight",
    "encoder.layer.0.intermediate.dense.bias",
    "encoder.layer.1.output.LayerNorm.weight",
)
TRIPLETS = [
    dict(anchor="how do cats sleep", positive="cats sleep curled up in warm places", negative="dogs bark at night"),
    dict(anchor="what is python", positive="python is a programming language", negative="a python is a snake"),
    dict(anchor="capital of france", positive="paris is the capital of france", negative="berlin is in germany"),
    dict(anchor="boil an egg", positive="put the egg in boiling water for ten minutes", negative="fry the bacon"),
    dict(anchor="rainy weather", positive="it rains a lot in autumn", negative="the desert is dry and hot"),
    dict(anchor="learn guitar", positive="practice chords every day on the guitar", negative="pianos have keys"),
]
PAIRS = [
    dict(sentence1="a man plays guitar", sentence2="a person plays an instrument", score=0.8),
    dict(sentence1="a cat sleeps", sentence2="the stock market fell", score=0.0),
    dict(sentence1="kids play football", sentence2="children are playing soccer", score=0.95),
    dict(sentence1="a woman cooks", sentence2="someone is cooking food", score=0.7),
    dict(sentence1="the sun is bright", sentence2="the sun is bright", score=1.0),
    dict(sentence1="a bird flies", sentence2="a plane lands", score=0.3),
]


def save_st(folder: Path, checkpoint: Path, *modules, **kwargs) -> Path:
    """A sentence-transformers model over `checkpoint`, saved to `folder` by sentence-transformers itself."""
    SentenceTransformer(modules=[Transformer(str(checkpoint)), *modules], device="cpu", **kwargs).save(str(folder))
    return folder


@pytest.fixture(scope="module")
def st_folder(tmp_path_factory, one_torch_thread) -> Path:
    """Mean pooling, no dropout (so training steps compare exactly)."""
    root = tmp_path_factory.mktemp("embed")
    no_dropout = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    bert = make_checkpoint(root / "bert", "bert", num_hidden_layers=2, **no_dropout)
    return save_st(root / "st", bert, Pooling(32))


@pytest.fixture(scope="module")
def st_normalized(tmp_path_factory, st_folder) -> Path:
    """CLS + mean pooling with Normalize: the modules an embed model may have besides the transformer."""
    return save_st(tmp_path_factory.mktemp("embed-n") / "st", st_folder, Pooling(32, ("cls", "mean")), Normalize())


def st_features(model: SentenceTransformer, rows: list[dict], columns: list[str]) -> list[dict]:
    return [model.preprocess([row[c] for row in rows]) for c in columns]


def st_loss_and_grads(folder: Path, make_loss, rows: list[dict], columns: list[str], labels=None):
    """sentence-transformers' loss on `rows` and the gradients of PARAMETERS, in eval mode (no dropout)."""
    model = SentenceTransformer(str(folder), device="cpu").eval()
    loss = make_loss(model)
    value = loss(st_features(model, rows, columns), None if labels is None else torch.tensor(labels))
    value.backward()
    params = dict(model[0].auto_model.named_parameters())
    return value.item(), {name: params[name].grad.numpy() for name in PARAMETERS}


def our_loss_and_grads(
    folder: Path, loss, rows: list[dict], normalize=False, pooling=("mean",), compiled=False, training=False
):
    """Our loss and gradients of PARAMETERS through the trainer's path: eager, or with `compiled` the trainer's
    `trace` (mx.compile over the model's state and the dropout key); dropout on with `training`."""
    model = load_model(folder, dtype="float32", task="encoder")
    model.train(training)
    tokenizer = tokenizer_for(model.args, folder)
    examples = embedding_data(rows, tokenizer)
    objective = EmbeddingObjective(loss, tokenizer, pooling, normalize, "batch_sampler")
    batch = objective.collate(examples, range(len(rows)))
    make = lambda fn: compiling.value_and_grad(model, mx.float32, fn)  # noqa: E731
    random = [mx.random.key(0)]
    trace = (
        (lambda fn: mx.compile(fn, inputs=[model.state, random], outputs=[model.state, random])) if compiled else None
    )
    with drawing_from(random):  # as the trainer's steps draw dropout
        value, grads = objective.value_and_grad(model, make, random, trace)(batch)
    grads = dict(tree_flatten(grads))
    return value.item(), {name: np.array(grads[name]) for name in PARAMETERS}


def assert_close(ours, reference, rtol=1e-5):
    """Equal within `rtol` of the reference's largest magnitude (tiny entries of a gradient differ by rounding)."""
    ours, reference = np.asarray(ours), np.asarray(reference)
    scale = max(np.abs(reference).max(), 1e-12)
    assert np.abs(ours - reference).max() <= rtol * scale, np.abs(ours - reference).max() / scale


TRIPLET_COLUMNS = ["anchor", "positive", "negative"]
ALL_DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")  # GTE's loss
LOSS_CASES = {
    "mnrl-cosine": (lambda: MultipleNegativesRankingLoss(), lambda m: st_losses.MultipleNegativesRankingLoss(m)),
    "mnrl-dot": (
        lambda: MultipleNegativesRankingLoss(scale=1.0, similarity="dot"),
        lambda m: st_losses.MultipleNegativesRankingLoss(m, scale=1.0, similarity_fct=dot_score),
    ),
    "mnrl-symmetric": (
        lambda: MultipleNegativesRankingLoss(symmetric=True),
        lambda m: st_losses.MultipleNegativesRankingLoss(
            m, directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"
        ),
    ),
    "mnrl-gte": (
        lambda: MultipleNegativesRankingLoss(directions=ALL_DIRECTIONS),
        lambda m: st_losses.MultipleNegativesRankingLoss(m, directions=ALL_DIRECTIONS),
    ),
    "cached-mnrl": (
        lambda: CachedMultipleNegativesRankingLoss(mini_batch_size=4),
        lambda m: st_losses.CachedMultipleNegativesRankingLoss(m, mini_batch_size=4),
    ),
    "matryoshka-mnrl": (
        lambda: MatryoshkaLoss(MultipleNegativesRankingLoss(), [8, 32, 16], [0.5, 1.0, 2.0]),
        lambda m: st_losses.MatryoshkaLoss(m, st_losses.MultipleNegativesRankingLoss(m), [8, 32, 16], [0.5, 1.0, 2.0]),
    ),
}


@pytest.mark.parametrize("case", list(LOSS_CASES))
def test_ranking_losses_and_gradients_equal_sentence_transformers(st_folder, case):
    ours, theirs = LOSS_CASES[case]
    value, grads = our_loss_and_grads(st_folder, ours(), TRIPLETS)
    expected, expected_grads = st_loss_and_grads(st_folder, theirs, TRIPLETS, TRIPLET_COLUMNS)
    assert value == pytest.approx(expected, rel=1e-5)
    for name in PARAMETERS:
        assert_close(grads[name], expected_grads[name])


def test_rows_embedded_in_length_groups_give_sentence_transformers_loss_and_gradients(st_folder, monkeypatch):
    # groups of 2 rows of different widths, run longest first: the batch's loss and gradients all the same
    monkeypatch.setattr(embedding, "LENGTH_GROUP", 2)
    make_ours, make_theirs = LOSS_CASES["mnrl-cosine"]
    expected, expected_grads = st_loss_and_grads(st_folder, make_theirs, TRIPLETS, TRIPLET_COLUMNS)
    value, grads = our_loss_and_grads(st_folder, make_ours(), TRIPLETS)
    assert value == pytest.approx(expected, rel=1e-5)
    for name in PARAMETERS:
        assert_close(grads[name], expected_grads[name])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_length_groups_look_their_tokens_up_once_per_table(st_folder, monkeypatch, compiled):
    # every group of every column in one lookup of the word table: one gradient of the table a step, not one a group;
    # compiled as the trainer's float32 step is (`retraced_value_and_grad`), where the lookup happens in its trace
    monkeypatch.setattr(embedding, "LENGTH_GROUP", 2)
    looked_up = []
    lookup = nn.Embedding.__call__

    def counted(table, ids):
        looked_up.append((table.weight.shape[0], ids.size))
        return lookup(table, ids)

    monkeypatch.setattr(nn.Embedding, "__call__", counted)
    model = load_model(st_folder, dtype="float32", task="encoder")
    model.train(False)
    tokenizer = tokenizer_for(model.args, st_folder)
    objective = EmbeddingObjective(MultipleNegativesRankingLoss(), tokenizer, ("mean",), False, "batch_sampler")
    batch = objective.collate(embedding_data(TRIPLETS, tokenizer), range(len(TRIPLETS)))
    groups = [f for column in objective.inputs(batch)["columns"] for f in column["groups"]]
    random = [mx.random.key(0)]
    if compiled:
        step = compiling.retraced_value_and_grad(model, random, objective)
    else:
        step = objective.value_and_grad(model, lambda fn: compiling.value_and_grad(model, mx.float32, fn), random, None)
    looked_up.clear()
    with drawing_from(random):
        value, _ = step(batch)
    words = [size for rows, size in looked_up if rows == model.args.vocab_size]
    sizes = [f["input_ids"].size for f in groups]
    checks = sizes if compiled else []  # a compiled step's input checks build (never run) a forward graph a group
    assert len(groups) == 9 and words == [*checks, sum(sizes)], looked_up
    expected, _ = st_loss_and_grads(st_folder, LOSS_CASES["mnrl-cosine"][1], TRIPLETS, TRIPLET_COLUMNS)
    assert value.item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (CoSENTLoss, lambda m: st_losses.CoSENTLoss(m)),
        (CosineSimilarityLoss, lambda m: st_losses.CosineSimilarityLoss(m)),
    ],
)
def test_scored_pair_losses_and_gradients_equal_sentence_transformers(st_folder, ours, theirs):
    value, grads = our_loss_and_grads(st_folder, ours(), PAIRS)
    scores = [row["score"] for row in PAIRS]
    expected, expected_grads = st_loss_and_grads(st_folder, theirs, PAIRS, ["sentence1", "sentence2"], scores)
    assert value == pytest.approx(expected, rel=1e-5)
    for name in PARAMETERS:
        assert_close(grads[name], expected_grads[name])


def test_normalize_and_concatenated_pooling_follow_the_folder(st_normalized):
    value, grads = our_loss_and_grads(
        st_normalized, MultipleNegativesRankingLoss(scale=1.0, similarity="dot"), TRIPLETS, True, ("cls", "mean")
    )
    theirs = lambda m: st_losses.MultipleNegativesRankingLoss(m, scale=1.0, similarity_fct=dot_score)  # noqa: E731
    expected, expected_grads = st_loss_and_grads(st_normalized, theirs, TRIPLETS, TRIPLET_COLUMNS)
    assert value == pytest.approx(expected, rel=1e-5)
    for name in PARAMETERS:
        assert_close(grads[name], expected_grads[name])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("mini_batch_size", [1, 4])
def test_cached_mnrl_gives_the_loss_and_gradients_of_mnrl(st_folder, mini_batch_size, compiled):
    plain = MatryoshkaLoss(MultipleNegativesRankingLoss(), [32, 8])
    plain, plain_grads = our_loss_and_grads(st_folder, plain, TRIPLETS)
    cached = MatryoshkaLoss(CachedMultipleNegativesRankingLoss(mini_batch_size=mini_batch_size), [32, 8])
    value, grads = our_loss_and_grads(st_folder, cached, TRIPLETS, compiled=compiled)
    assert value == pytest.approx(plain, rel=1e-6)
    for name in PARAMETERS:  # mini-batches are padded to their own longest row: float rounding differs
        assert_close(grads[name], plain_grads[name])


def test_cached_mnrl_replays_dropout_the_same_compiled_or_eager(tmp_path):
    """With dropout on, GradCache's second pass must redraw each mini-batch's masks: compiled passes (one trace per
    mini-batch shape) give the eager passes' loss and gradients."""
    folder = save_st(tmp_path / "st", make_checkpoint(tmp_path / "bert", "bert", num_hidden_layers=2), Pooling(32))
    cached = CachedMultipleNegativesRankingLoss(mini_batch_size=2)
    eager, eager_grads = our_loss_and_grads(folder, cached, TRIPLETS, training=True)
    plain, _ = our_loss_and_grads(folder, cached, TRIPLETS)
    value, grads = our_loss_and_grads(folder, cached, TRIPLETS, compiled=True, training=True)
    assert eager != pytest.approx(plain, rel=1e-4)  # dropout changed something
    assert value == pytest.approx(eager, rel=1e-5)
    for name in PARAMETERS:
        assert_close(grads[name], eager_grads[name])


def test_matryoshka_is_the_weighted_sum_over_truncated_normalized_embeddings():
    embeddings = [mx.random.normal((5, 12), key=mx.random.key(i)) for i in range(3)]
    inner = MultipleNegativesRankingLoss()
    total = MatryoshkaLoss(inner, [4, 12], [2.0, 0.5])(embeddings)
    expected = sum(
        w * inner([e[:, :d] / np.linalg.norm(np.array(e[:, :d]), axis=1, keepdims=True) for e in embeddings])
        for d, w in [(4, 2.0), (12, 0.5)]
    )
    assert total.item() == pytest.approx(expected.item(), rel=1e-6)


def test_no_duplicates_batches_equal_sentence_transformers_sampler_and_never_repeat(monkeypatch):
    datasets = pytest.importorskip("datasets")
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(12)]  # few distinct texts: many would-be duplicates in a batch
    rows = [dict(anchor=str(rng.choice(words)), positive=str(rng.choice(words))) for _ in range(60)]
    order = rng.permutation(len(rows))
    texts = [(r["anchor"], r["positive"]) for r in rows]
    ours = no_duplicates(order, texts, 5)
    monkeypatch.setattr(torch, "randperm", lambda n, **_: torch.tensor(order, dtype=torch.int32))
    sampler = NoDuplicatesBatchSampler(datasets.Dataset.from_list(rows), batch_size=5, drop_last=False)
    assert [list(b) for b in ours] == list(sampler)
    assert sorted(i for b in ours for i in b) == list(range(len(rows)))
    for batch in ours:
        seen = [t for i in batch for t in set(texts[i])]
        assert len(seen) == len(set(seen))


def torch_steps(
    params, loss_of_batch, rows: list[dict], seed: int, steps: int, lr: float, warmup: int, batch_size: int = 4
) -> list[float]:
    """The losses of a torch loop over `params` as `fine_tune` (max_grad_norm 1) runs the steps of a retrieval task:
    `loss_of_batch(rows)` on the trainer's no_duplicates batches, in the same order (each epoch's drawn from
    `seed`), AdamW with linear warmup and decay, gradients clipped at 1."""
    texts = [tuple(r.values()) for r in rows]
    orders = [np.random.default_rng([seed, epoch]).permutation(len(rows)) for epoch in range(steps)]
    batches = [b for order in orders for b in no_duplicates(order, texts, batch_size)][:steps]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, eps=1e-8)

    def factor(step: int) -> float:
        return step / warmup if step < warmup else max(0.0, (steps - step) / (steps - warmup))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    losses = []
    for batch in batches:
        value = loss_of_batch([rows[i] for i in batch])
        value.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(value.item())
    return losses


def torch_mnrl_steps(model, params, rows: list[dict], seed: int, steps: int, lr: float, warmup: int) -> list[float]:
    """`torch_steps` with sentence-transformers' MNRL over `model` on anchor/positive/negative rows, batches of 4."""
    loss = st_losses.MultipleNegativesRankingLoss(model)
    return torch_steps(params, lambda part: loss(st_features(model, part, TRIPLET_COLUMNS), None), rows, seed, steps,
                       lr, warmup)  # fmt: skip


def test_twenty_adamw_steps_equal_a_torch_loop_with_sentence_transformers_loss(st_folder, tmp_path):
    rows = TRIPLETS * 3 + [dict(anchor=r["negative"], positive=r["anchor"], negative=r["positive"]) for r in TRIPLETS]
    trained = fine_tune(
        "embed", rows, tmp_path / "out", model=st_folder, loss="mnrl", batch_size=4, max_steps=20, lr=2e-4,
        warmup_steps=3, max_grad_norm=1.0, seed=3,
    )  # fmt: skip
    losses = [json.loads(line)["loss"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    model = SentenceTransformer(str(st_folder), device="cpu").train()
    params = [p for name, p in model[0].auto_model.named_parameters() if not name.startswith("pooler")]
    expected = torch_mnrl_steps(model, params, rows, seed=3, steps=20, lr=2e-4, warmup=3)
    np.testing.assert_allclose(losses, expected, rtol=2e-5)
    weights = dict(tree_flatten(trained.model.parameters()))
    for name, p in model[0].auto_model.named_parameters():
        if name in PARAMETERS:
            assert_close(np.array(weights[name]), p.detach().numpy(), rtol=2e-5)


def test_trained_folder_loads_in_sentence_transformers_with_equal_embeddings(st_normalized, tmp_path):
    trained = fine_tune(
        "embed", PAIRS, tmp_path / "out", model=st_normalized, loss="cosent", max_steps=2, batch_size=3,
        query_prompt="query: ", document_prompt="doc: ",
    )  # fmt: skip
    folder = trained.path
    assert (folder / "2_Normalize").is_dir() and (folder / "1_Pooling" / "config.json").is_file()
    settings = json.loads((folder / "config_sentence_transformers.json").read_text())
    assert settings["prompts"] == {"query": "query: ", "document": "doc: "}
    texts = ["a cat on a mat", "the stock market", "x", "a much longer sentence about birds flying south in autumn"]
    model = SentenceTransformer(str(folder), device="cpu")
    for kind in ("query", "document"):
        expected = getattr(model, f"encode_{kind}")(texts, convert_to_numpy=True)
        ours = getattr(SentenceEncoder(folder), f"encode_{kind}")(texts)
        np.testing.assert_allclose(ours, expected, atol=1e-5)
    # the trained weights: not the starting ones
    start = SentenceTransformer(str(st_normalized), device="cpu").encode(texts, convert_to_numpy=True)
    assert not np.allclose(start, model.encode(texts, convert_to_numpy=True), atol=1e-4)


def test_trained_folder_keeps_its_default_prompt_and_truncate_dim(st_folder, tmp_path):
    prompts = {"query": "query: ", "document": "doc: ", "sts": "sts: "}
    source = save_st(
        tmp_path / "source", st_folder, Pooling(32), Normalize(), prompts=prompts, default_prompt_name="sts",
        truncate_dim=8,
    )  # fmt: skip
    trained = fine_tune("embed", PAIRS, tmp_path / "out", model=source, loss="cosent", max_steps=1, batch_size=3)
    model = SentenceTransformer(str(trained.path), device="cpu")
    assert (model.default_prompt_name, model.truncate_dim, model.prompts["sts"]) == ("sts", 8, "sts: ")
    texts = ["a cat on a mat", "the stock market", "x"]
    expected = model.encode(texts, convert_to_numpy=True)
    assert expected.shape == (3, 8)
    np.testing.assert_allclose(SentenceEncoder(trained.path).encode(texts), expected, atol=1e-5)


def test_plain_masked_lm_checkpoint_trains_with_mean_pooling_and_lora(tmp_path):
    mlm = make_checkpoint(tmp_path / "mlm", "bert", "masked-lm", num_hidden_layers=2)
    trained = fine_tune(
        "embed", TRIPLETS, tmp_path / "out", model=mlm, max_steps=2, batch_size=3, lora_rank=2, eval_data=TRIPLETS
    )
    assert (tmp_path / "out" / "adapters").is_dir()
    assert math.isfinite(trained.metrics["eval_loss"])
    assert json.loads((trained.path / "1_Pooling" / "config.json").read_text())["pooling_mode"] == "mean"
    texts = ["how do cats sleep", "python"]
    expected = SentenceTransformer(str(trained.path), device="cpu").encode(texts, convert_to_numpy=True)
    np.testing.assert_allclose(SentenceEncoder(trained.path).encode(texts), expected, atol=1e-5)


def test_resumed_embed_run_equals_an_uninterrupted_one(st_folder, tmp_path):
    options = dict(model=st_folder, loss="cached-mnrl", batch_size=4, max_steps=4, save_every=2, lr=1e-4)
    whole = fine_tune("embed", TRIPLETS * 2, tmp_path, **options)
    resumed = fine_tune("embed", TRIPLETS * 2, tmp_path, resume=tmp_path / "checkpoint-2", **options)
    resumed_weights = dict(tree_flatten(resumed.model.parameters()))
    for name, weight in tree_flatten(whole.model.parameters()):
        np.testing.assert_array_equal(np.array(weight), np.array(resumed_weights[name]), err_msg=name)


def test_deferred_rows_are_all_trained_on_and_each_epoch_ends_where_its_batches_do(st_folder, tmp_path, monkeypatch):
    # one anchor in every row: a no_duplicates batch holds one row, so an epoch of 4 rows is 4 steps, not ceil(4 / 2)
    rows = [dict(anchor="how do cats sleep", positive=r["positive"], negative=r["negative"]) for r in TRIPLETS[:4]]
    taken, collate = [], EmbeddingObjective.collate

    def recording(self, examples, indices, rng=None):
        if len(examples) == len(rows):  # the training rows, not the 2 evaluation rows
            taken.append([int(i) for i in indices])
        return collate(self, examples, indices, rng)

    monkeypatch.setattr(EmbeddingObjective, "collate", recording)
    options = dict(model=st_folder, batch_size=2, epochs=2, lr=1e-4, eval_data=TRIPLETS[4:], save_every=5)
    whole = fine_tune("embed", rows, tmp_path, **options)
    assert sorted(taken[:4]) == sorted(taken[4:]) == [[0], [1], [2], [3]]  # every row, once in each epoch
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["epoch"]) for r in records if "eval_loss" in r] == [(4, 1.0), (8, 2.0)]
    # transformers' linear schedule (no warmup) over the 8 steps that ran
    lrs = [r["lr"] for r in records if "lr" in r]
    np.testing.assert_allclose(lrs, [1e-4 * (8 - s) / 8 for s in range(8)], rtol=1e-6)
    # resumed in the second epoch, the run takes that epoch's 3 remaining steps and ends with the same weights
    first, taken[:] = taken[:], []
    resumed = fine_tune("embed", rows, tmp_path, resume=tmp_path / "checkpoint-5", **options)
    assert taken == first[5:]
    resumed_weights = dict(tree_flatten(resumed.model.parameters()))
    for name, weight in tree_flatten(whole.model.parameters()):
        np.testing.assert_array_equal(np.array(weight), np.array(resumed_weights[name]), err_msg=name)


def test_bad_rows_name_the_file_and_line(st_folder, tmp_path):
    tokenizer = tokenizer_for(load_model(st_folder, task="encoder").args, st_folder)
    data = tmp_path / "train.jsonl"
    data.write_text('{"anchor": "a", "positive": "b"}\n\n{"anchor": "c"}\n')
    with pytest.raises(DataError, match=r"train\.jsonl:3: .* this row has 'anchor' \(fewer than two text"):
        embedding_data(data, tokenizer)
    data = tmp_path / "pairs.csv"
    data.write_text("sentence1,sentence2,score\na,b,0.5\nc,d,high\n")
    with pytest.raises(DataError, match=r"pairs\.csv:3: column 'score' must hold a number"):
        embedding_data(data, tokenizer)
    with pytest.raises(DataError, match=r"item 1 of the data: .* this row has 'text' \(fewer than two text"):
        embedding_data([{"text": "a"}], tokenizer)
    with pytest.raises(DataError, match=r"item 2 .*no value in column 'positive' .* the right column with columns="):
        embedding_data([{"anchor": "a", "positive": "b"}, {"anchor": "c", "positive": ""}], tokenizer)
    # the same columns in another key order are read by name, in the first row's order (as `datasets` reads them)
    mixed = embedding_data([{"question": "q1", "answer": "a1"}, {"answer": "a2", "question": "q2"}], tokenizer)
    assert mixed.column_names == ["question", "answer"] and mixed.texts == [("q1", "a1"), ("q2", "a2")]
    with pytest.raises(ValueError, match="CoSENTLoss trains on rows of sentence1, sentence2, score"):
        fine_tune("embed", TRIPLETS, tmp_path / "o", model=st_folder, loss="cosent")
    with pytest.raises(ValueError, match=r"text_column \(--text-column\) is for .*; sentence-embedding would ignore"):
        fine_tune("embed", TRIPLETS, tmp_path / "o", model=st_folder, text_column="anchor")
    with pytest.raises(ValueError, match=r"loss \(--loss\) is for .*; sequence-classification would ignore it"):
        fine_tune("classify", [{"text": "a", "label": 0}], tmp_path / "o", model=st_folder, loss="mnrl")


def test_cli_train_embed_writes_a_sentence_transformers_folder(st_folder, tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in TRIPLETS))
    out = tmp_path / "out"
    argv = ["train", "embed", "-m", str(st_folder), "--data", str(data), "-o", str(out), "--max-steps", "2"]
    argv += ["--loss", "cached-mnrl", "--mini-batch-size", "2", "--matryoshka-dims", "32", "16", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["model"] == str(out / "model")
    texts = ["rainy weather"]
    expected = SentenceTransformer(str(out / "model"), device="cpu").encode(texts, convert_to_numpy=True)
    np.testing.assert_allclose(SentenceEncoder(out / "model").encode(texts), expected, atol=1e-5)


def test_a_run_with_a_loss_object_resumes_under_an_equal_one_and_refuses_another(st_folder, tmp_path):
    options = dict(model=st_folder, batch_size=3, max_steps=2, save_every=1)
    fine_tune("embed", TRIPLETS, tmp_path, loss=MatryoshkaLoss(MultipleNegativesRankingLoss(), [32, 16]), **options)
    resumed = dict(resume=tmp_path / "checkpoint-1", **options)
    fine_tune("embed", TRIPLETS, tmp_path, loss=MatryoshkaLoss(MultipleNegativesRankingLoss(), [32, 16]), **resumed)
    with pytest.raises(ValueError, match="written by a run with other settings \\(loss "):
        fine_tune("embed", TRIPLETS, tmp_path, loss=MatryoshkaLoss(MultipleNegativesRankingLoss(), [32, 8]), **resumed)


def test_matryoshka_dims_without_a_loss_wrap_the_datas_default_loss(st_folder, tmp_path, monkeypatch):
    """Scored pairs train with CoSENT at each dim, anchor/positive rows with MNRL, as without the dims."""
    used, chosen = [], embedding.make_loss
    monkeypatch.setattr(embed_task, "make_loss", lambda loss, scored: used.append(chosen(loss, scored)) or used[-1])
    for rows in (PAIRS, TRIPLETS):
        data = tmp_path / f"{len(used)}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        argv = ["train", "embed", "-m", str(st_folder), "--data", str(data), "-o", str(tmp_path / f"o{len(used)}")]
        assert main([*argv, "--max-steps", "1", "--matryoshka-dims", "32", "16"]) == 0
    assert [(type(loss.loss).__name__, loss.dims) for loss in used] == [
        ("CoSENTLoss", [32, 16]), ("MultipleNegativesRankingLoss", [32, 16])]  # fmt: skip


@pytest.mark.parametrize(
    "dims, weights, message",
    [
        (["32", "16"], ["nan", "1"], "matryoshka_weights must each be a finite number in [0, inf)"),
        (["32", "16"], ["-1", "0"], "matryoshka_weights must each be a finite number in [0, inf)"),
        (["32", "16"], ["0", "0"], "matryoshka_weights must not all be 0"),
        (["16", "16"], None, "matryoshka_dims must differ from each other"),
    ],
)
def test_cli_matryoshka_options_out_of_range_are_option_errors(st_folder, tmp_path, capsys, dims, weights, message):
    """Exit 2 before training starts (never a run that diverges on NaN weights, or one dim trained twice)."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in TRIPLETS))
    argv = ["train", "embed", "-m", str(st_folder), "--data", str(data), "-o", str(tmp_path / "out")]
    argv += ["--matryoshka-dims", *dims] + (["--matryoshka-weights", *weights] if weights else [])
    assert main(argv) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_bfloat16_accumulation_and_checkpointing_train_from_a_dataset(st_folder, tmp_path):
    datasets = pytest.importorskip("datasets")
    trained = fine_tune(
        "embed", datasets.Dataset.from_list(TRIPLETS), tmp_path, model=st_folder, loss="cached-mnrl", max_steps=1,
        batch_size=3, grad_accum=2, dtype="bfloat16", gradient_checkpointing=True,
    )  # fmt: skip
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert math.isfinite(record["loss"]) and record["grad_norm"] > 0
    assert all(p.dtype == mx.float32 for _, p in tree_flatten(trained.model.parameters()))


@pytest.mark.parametrize("model_type", ["distilbert", "modernbert"])
def test_other_architectures_train_into_folders_sentence_transformers_reads(
    checkpoint, tmp_path, model_type, one_torch_thread
):
    trained = fine_tune("embed", TRIPLETS, tmp_path, model=checkpoint(model_type), max_steps=1, batch_size=6, lr=1e-3)
    texts = ["how do cats sleep", "a much longer text about python, the programming language"]
    expected = SentenceTransformer(str(trained.path), device="cpu").encode(texts, convert_to_numpy=True)
    np.testing.assert_allclose(SentenceEncoder(trained.path).encode(texts), expected, atol=1e-5)


def test_cached_mnrl_with_dropout_equals_mnrl_with_the_same_masks(tmp_path, monkeypatch):
    """One mini-batch per column, as wide as the plain step's group: GradCache's first pass draws the plain step's
    dropout masks, and its second pass must draw them again for the gradients to be the plain step's."""
    monkeypatch.setattr(embedding, "MINI_BATCH_WIDTHS", 1)
    folder = save_st(tmp_path / "st", make_checkpoint(tmp_path / "bert", "bert", num_hidden_layers=2), Pooling(32))
    plain, plain_grads = our_loss_and_grads(folder, MultipleNegativesRankingLoss(), TRIPLETS, training=True)
    cached = CachedMultipleNegativesRankingLoss(mini_batch_size=embedding.LENGTH_GROUP)
    value, grads = our_loss_and_grads(folder, cached, TRIPLETS, training=True)
    assert value == pytest.approx(plain, rel=1e-6)
    for name in PARAMETERS:
        assert_close(grads[name], plain_grads[name])


MINED = [  # `mlx-encoders mine --format n-tuple` rows: the pairs' own column names, then negative_1..n
    {"query": r["anchor"], "answer": r["positive"], "negative_1": r["negative"], "negative_2": o["positive"]}
    for r, o in zip(TRIPLETS, TRIPLETS[1:] + TRIPLETS[:1], strict=True)
]


def st_collated_loss_and_grads(folder: Path, make_loss, rows: list[dict]):
    """sentence-transformers' loss on `rows` through its own data collator and trainer's feature split, which take
    the columns by position (a "label"/"score" column as the labels)."""
    model = SentenceTransformer(str(folder), device="cpu").eval()
    features, labels = BaseTrainer.collect_features(None, SentenceTransformerDataCollator(model.preprocess)(rows))
    value = make_loss(model)(features, labels)
    value.backward()
    params = dict(model[0].auto_model.named_parameters())
    return value.item(), {name: params[name].grad.numpy() for name in PARAMETERS}


@pytest.mark.parametrize(
    "rows, ours, theirs",
    [
        (MINED, MultipleNegativesRankingLoss, st_losses.MultipleNegativesRankingLoss),
        ([{"text_a": r["sentence1"], "text_b": r["sentence2"], "label": r["score"]} for r in PAIRS], CoSENTLoss,
         st_losses.CoSENTLoss),
        # a label column (any of label, labels, score, scores) scores two texts whatever their names
        ([{"anchor": r["sentence1"], "positive": r["sentence2"], "score": r["score"]} for r in PAIRS], CoSENTLoss,
         st_losses.CoSENTLoss),
        ([{"sentence1": r["sentence1"], "sentence2": r["sentence2"], "labels": r["score"]} for r in PAIRS],
         CoSENTLoss, st_losses.CoSENTLoss),
        # anchor and positive with a negative of another name: a third column all the same (it was dropped)
        ([{"anchor": r["query"], "positive": r["answer"], "hard_negative": r["negative_1"]} for r in MINED],
         MultipleNegativesRankingLoss, st_losses.MultipleNegativesRankingLoss),
    ],
    ids=["mined-n-tuple", "scored-pairs", "anchor-positive-score", "sentence-pairs-labels", "other-negative-name"],
)  # fmt: skip
def test_rows_of_other_column_names_are_read_by_position_as_sentence_transformers_reads_them(
    st_folder, rows, ours, theirs
):
    value, grads = our_loss_and_grads(st_folder, ours(), rows)
    expected, expected_grads = st_collated_loss_and_grads(st_folder, theirs, rows)
    assert value == pytest.approx(expected, rel=1e-5)
    for name in PARAMETERS:
        assert_close(grads[name], expected_grads[name])


def test_columns_pick_and_rename_the_data_columns(st_folder, tmp_path):
    tokenizer = tokenizer_for(load_model(st_folder, task="encoder").args, st_folder)
    renamed = embedding_data(MINED, tokenizer, columns={"anchor": "query", "positive": "answer"})
    kept = embedding_data(MINED, tokenizer, columns=["query", "negative_2", "answer"])
    assert renamed.column_names == ["anchor", "positive"]
    assert renamed.texts == [(r["query"], r["answer"]) for r in MINED]
    assert kept.texts == [(r["query"], r["negative_2"], r["answer"]) for r in MINED]
    data = tmp_path / "mined.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in MINED))
    with pytest.raises(DataError, match=r"mined\.jsonl:1: no column 'question', which columns= .*'query'"):
        embedding_data(data, tokenizer, columns={"anchor": "question"})
    with pytest.raises(ValueError, match="columns must name each column once"):
        embedding_data(data, tokenizer, columns=["query", "query=answer"])
    one = embedding_data(data, tokenizer, columns=["query", "anchor=answer"])  # no positive: by position
    assert one.column_names == ["query", "anchor"]


def test_a_row_index_or_a_score_of_another_name_is_refused_not_read_as_a_text(st_folder, tmp_path):
    """pandas' to_csv writes its row index as a first, unnamed column, and a score named "Score" or "similarity" is
    no text: read by position, the row number became the anchor and the score a hard negative (sentence-transformers
    refuses both columns as numbers)."""
    tokenizer = tokenizer_for(load_model(st_folder, task="encoder").args, st_folder)
    (tmp_path / "indexed.csv").write_text(",anchor,positive,negative\n0,What is a cat?,A small feline.,A fish.\n")
    with pytest.raises(
        DataError, match="'' looks like a row index \\(pandas writes one unless to_csv\\(index=False\\)\\)"
    ):
        embedding_data(tmp_path / "indexed.csv", tokenizer)
    for header, row in (("sentence1,sentence2,Score", "A cat.,A plane.,0.0"), ("anchor,positive,Score", "a,b,0.5")):
        (tmp_path / "scored.csv").write_text(f"{header}\n{row}\n")
        with pytest.raises(DataError, match="'Score' holds a number .*, not a text; a score column is named label"):
            embedding_data(tmp_path / "scored.csv", tokenizer)
    with pytest.raises(DataError, match="'similarity' holds a number"):
        embedding_data([{"sentence1": "A cat.", "sentence2": "A dog.", "similarity": 0.9}], tokenizer)
    # a column beside them that holds no number (GLUE's idx, a genre) is left out, and the score kept
    rows = [{"sentence1": "A cat.", "sentence2": "A dog.", "score": 0.8, "genre": "main", "idx": 3}]
    kept = embedding_data(rows * 2, tokenizer)
    assert kept.column_names == ["sentence1", "sentence2"] and list(kept.labels) == pytest.approx([0.8, 0.8])


def test_mine_reads_the_texts_of_a_corpus_file_as_index_build_reads_it(st_folder, tmp_path):
    from mlx_encoders.train.retrieval_cli import extra_documents

    (tmp_path / "corpus.jsonl").write_text('{"_id": "d0", "text": "Cats purr."}\n{"id": "d1", "text": "Dogs bark."}\n')
    assert extra_documents(tmp_path / "corpus.jsonl") == ["Cats purr.", "Dogs bark."]
    (tmp_path / "extra.txt").write_text("One line.\n\nAnother line.\n")
    assert extra_documents(tmp_path / "extra.txt") == ["One line.", "Another line."]
    (tmp_path / "extra.lst").write_text("A list.\n")  # any other file, a pipe too: its lines
    assert extra_documents(tmp_path / "extra.lst") == ["A list."]


def test_mined_file_trains_embed_from_the_command_line(st_folder, tmp_path, capsys):
    pairs, mined, out = tmp_path / "pairs.jsonl", tmp_path / "mined.jsonl", tmp_path / "out"
    pairs.write_text("".join(json.dumps({"query": r["anchor"], "answer": r["positive"]}) + "\n" for r in TRIPLETS))
    mine = ["mine", "-m", str(st_folder), "--data", str(pairs), "-o", str(mined), "--num-negatives", "2"]
    assert main([*mine, "--format", "n-tuple"]) == 0
    assert list(json.loads(mined.read_text().splitlines()[0])) == ["query", "answer", "negative_1", "negative_2"]
    train = ["train", "embed", "-m", str(st_folder), "--data", str(mined), "--max-steps", "1", "--json"]
    assert main([*train, "-o", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == str(out / "model")
    SentenceTransformer(str(out / "model"), device="cpu")  # a complete folder
    assert main([*train, "-o", str(tmp_path / "two"), "--columns", "anchor=query", "positive=answer"]) == 0
    capsys.readouterr()
    labeled = tmp_path / "labeled.jsonl"
    labeled.write_text('{"query_id": "q1", "text": "cats sleep a lot", "label": 1}\n')
    assert main([*train[:5], str(labeled), *train[6:], "-o", str(tmp_path / "three")]) == 1
    error = capsys.readouterr().err
    assert f"{labeled}:1:" in error and "'query_id', 'text', 'label'" in error and "--columns" in error


@pytest.mark.parametrize(
    "directions", [("query_to_doc", "query_to_query", "doc_to_query"), ALL_DIRECTIONS], ids=["three", "gte"]
)
def test_mnrl_over_query_and_document_directions_trains_in_the_compiled_step(st_folder, tmp_path, directions):
    """GTE's directions through fine_tune's compiled step (mx.compile failed on a transposed doc_to_query matrix)."""
    loss = MultipleNegativesRankingLoss(directions=directions)
    trained = fine_tune("embed", TRIPLETS, tmp_path, model=st_folder, loss=loss, max_steps=2, batch_size=2, lr=1e-3)
    losses = [json.loads(line).get("loss") for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert trained.path.is_dir() and all(np.isfinite(v) for v in losses if v is not None)


def test_eval_loss_batches_as_the_sampler_does(st_folder):
    """Two evaluation rows sharing a positive never meet in a no_duplicates batch (sentence-transformers batches
    its evaluation with the run's sampler); consecutive rows made that positive a negative of itself."""
    shared = "cats sleep curled up in warm places"
    rows = [{"anchor": "how do cats sleep", "positive": shared}, {"anchor": "where do cats nap", "positive": shared},
            {"anchor": "capital of france", "positive": "paris is the capital of france"},
            {"anchor": "boil an egg", "positive": "put the egg in boiling water for ten minutes"}]  # fmt: skip
    model = load_model(st_folder, dtype="float32", task="encoder")
    tokenizer = tokenizer_for(model.args, st_folder)
    objective = EmbeddingObjective(MultipleNegativesRankingLoss(), tokenizer, ("mean",), False, "no_duplicates")
    got = objective.evaluate(model, embedding_data(rows, tokenizer), 4)["eval_loss"]
    batches = [[0, 2, 3], [1]]  # no_duplicates over the rows in order
    assert [b.tolist() for b in no_duplicates(np.arange(4), [(r["anchor"], r["positive"]) for r in rows], 4)] == batches
    loss = st_losses.MultipleNegativesRankingLoss
    theirs = [st_collated_loss_and_grads(st_folder, loss, [rows[i] for i in b])[0] for b in batches]
    assert got == pytest.approx((3 * theirs[0] + theirs[1]) / 4, rel=1e-5)  # weighted by the batches' sizes

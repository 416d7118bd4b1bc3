"""`fine_tune("sparse")` (SPLADE) and `fine_tune("multivector")` (ColBERT) against torch loops running
sentence-transformers' `SpladeLoss` and `MultiVectorMultipleNegativesRankingLoss` on the same batches, and the
trained folders against sentence-transformers' `SparseEncoder` / `MultiVectorEncoder`.

Tiny seeded BERTs (tests/checkpoints.py) without dropout, so training steps compare exactly; sentence-transformers
saves the starting folders itself.
"""

import json
import string
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoints import make_checkpoint
from mlx.utils import tree_flatten
from sentence_transformers import MultiVectorEncoder as STMultiVectorEncoder
from sentence_transformers import SentenceTransformer
from sentence_transformers import SparseEncoder as STSparseEncoder
from sentence_transformers.base.modules import Dense, Normalize, Transformer
from sentence_transformers.multi_vector_encoder.losses import MultiVectorMultipleNegativesRankingLoss
from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask
from sentence_transformers.sentence_transformer.modules import Pooling
from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss
from sentence_transformers.sparse_encoder.losses import SpladeLoss as STSpladeLoss
from sentence_transformers.sparse_encoder.modules import SpladePooling
from test_contrastive import torch_steps

from mlx_encoders import MultiVectorEncoder, SparseEncoder
from mlx_encoders.__main__ import main
from mlx_encoders.train import fine_tune
from mlx_encoders.train.losses.multi_vector import MaxSimRankingLoss
from mlx_encoders.train.losses.sparse import SpladeLoss

NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_hidden_layers=2)
TRIPLETS = [
    dict(anchor="how do cats sleep", positive="cats sleep curled up in warm places", negative="dogs bark at night"),
    dict(anchor="what is python?", positive="python is a programming language", negative="a python is a snake"),
    dict(anchor="capital of france", positive="paris is the capital of france", negative="berlin is in germany"),
    dict(anchor="boil an egg", positive="put the egg in boiling water, ten minutes", negative="fry the bacon"),
    dict(anchor="rainy weather", positive="it rains a lot in autumn", negative="the desert is dry and hot"),
    dict(anchor="learn guitar", positive="practice chords every day on the guitar!", negative="pianos have keys"),
]
COLUMNS = ["anchor", "positive", "negative"]
ROWS = TRIPLETS + [dict(anchor=r["negative"], positive=r["anchor"], negative=r["positive"]) for r in TRIPLETS]
STEPS, LR, WARMUP, SEED, BATCH = 5, 3e-4, 2, 3, 4
TEXTS = ["a cat on a mat", "the stock market, falling!", "x", "a much longer sentence about birds flying south"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, one_torch_thread) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("retrieval")
    return {
        "mlm": make_checkpoint(root / "mlm", "bert", "masked-lm", **NO_DROPOUT),
        "encoder": make_checkpoint(root / "encoder", "bert", **NO_DROPOUT),
    }


def torch_loop(params, loss_of_batch, rows: list[dict]) -> list[float]:
    """This file's steps (`torch_steps`): AdamW with linear warmup and decay and gradient clipping; the losses."""
    return torch_steps(params, loss_of_batch, rows, SEED, STEPS, LR, WARMUP, BATCH)


def logged_losses(output_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def test_sparse_steps_equal_a_torch_loop_with_sentence_transformers_splade_loss(checkpoints, tmp_path):
    folder = tmp_path / "st"
    transformer = Transformer(str(checkpoints["mlm"]), transformer_task="fill-mask")
    # sum pooling: max pooling's near-ties route gradients to different tokens in float32
    STSparseEncoder(modules=[transformer, SpladePooling("sum")], device="cpu").save(str(folder))
    weights = dict(document_regularizer_weight=3e-6, query_regularizer_weight=5e-6)
    trained = fine_tune(
        "sparse", ROWS, tmp_path / "out", model=folder, loss=SpladeLoss(scale=1e-5, **weights), batch_size=BATCH,
        max_steps=STEPS, lr=LR, warmup_steps=WARMUP, seed=SEED,
    )  # fmt: skip
    st = STSparseEncoder(str(folder), device="cpu").train()
    loss = STSpladeLoss(st, SparseMultipleNegativesRankingLoss(st, scale=1e-5), **weights)
    params = list(st.parameters())

    def value(rows):
        return sum(loss([st.preprocess([r[c] for r in rows]) for c in COLUMNS], None).values())

    expected = torch_loop(params, value, ROWS)
    np.testing.assert_allclose(logged_losses(tmp_path / "out"), expected, rtol=5e-5)
    ours = dict(tree_flatten(trained.model.parameters()))
    theirs = dict(st[0].auto_model.named_parameters())
    for name in ("bert.encoder.layer.1.attention.self.query.weight", "cls.predictions.transform.dense.weight"):
        reference = theirs[name].detach().numpy()
        np.testing.assert_allclose(np.array(ours[name]), reference, atol=2e-5 * np.abs(reference).max(), rtol=1e-4)


def test_sparse_from_a_masked_lm_saves_a_folder_sentence_transformers_loads_equal(checkpoints, tmp_path):
    trained = fine_tune(
        "sparse", TRIPLETS, tmp_path / "out", model=checkpoints["mlm"], max_steps=2, batch_size=3, lr=1e-3,
        query_prompt="query: ", eval_data=TRIPLETS[:3],
    )  # fmt: skip
    assert np.isfinite(trained.metrics["eval_loss"])
    pooling = json.loads((trained.path / "1_SpladePooling" / "config.json").read_text())
    assert pooling["pooling_strategy"] == "max"
    st, ours = STSparseEncoder(str(trained.path), device="cpu"), SparseEncoder(trained.path)
    for kind in ("query", "document"):
        expected = getattr(st, f"encode_{kind}")(TEXTS, convert_to_tensor=True).to_dense().numpy()
        got = getattr(ours, f"encode_{kind}")(TEXTS).toarray()
        np.testing.assert_allclose(got, expected, atol=1e-5)
    start = STSparseEncoder(str(checkpoints["mlm"]), device="cpu").encode(TEXTS, convert_to_tensor=True)
    assert not np.allclose(start.to_dense().numpy(), expected, atol=1e-3)


def save_colbert(folder: Path, checkpoint: Path) -> Path:
    transformer = Transformer(str(checkpoint), query_expansion={"strategy": "fixed", "length": 10}, document_length=12)
    torch.manual_seed(0)
    dense = Dense(32, 16, bias=False, activation_function=torch.nn.Identity(), module_input_name="token_embeddings")
    modules = [transformer, dense, MultiVectorMask(skiplist_words=list(string.punctuation))]
    modules.append(Normalize(module_input_name="token_embeddings"))
    prompts = {"query": "[unused0] ", "document": "[unused1] "}
    STMultiVectorEncoder(modules=modules, device="cpu", prompts=prompts).save(str(folder))
    return folder


def test_multivector_steps_equal_a_torch_loop_with_sentence_transformers_maxsim_loss(checkpoints, tmp_path):
    folder = save_colbert(tmp_path / "st", checkpoints["encoder"])
    trained = fine_tune(
        "multivector", ROWS, tmp_path / "out", model=folder, loss=MaxSimRankingLoss(scale=2.0), batch_size=BATCH,
        max_steps=STEPS, lr=LR, warmup_steps=WARMUP, seed=SEED,
    )  # fmt: skip
    st = STMultiVectorEncoder(str(folder), device="cpu").train()
    loss = MultiVectorMultipleNegativesRankingLoss(st, scale=2.0)

    def value(rows):
        tasks = ["query", "document", "document"]
        texts = [[st.prompts[t] + r[c] for r in rows] for t, c in zip(tasks, COLUMNS, strict=True)]
        return loss([{**st.preprocess(x, task=t), "task": t} for t, x in zip(tasks, texts, strict=True)])

    expected = torch_loop(list(st.parameters()), value, ROWS)
    np.testing.assert_allclose(logged_losses(tmp_path / "out"), expected, rtol=5e-5)
    ours = dict(tree_flatten(trained.model.parameters()))
    reference = st[1].linear.weight.detach().numpy()
    np.testing.assert_allclose(np.array(ours["projections.0.weight"]), reference, atol=2e-5 * np.abs(reference).max())
    theirs = dict(st[0].auto_model.named_parameters())
    reference = theirs["encoder.layer.1.attention.self.query.weight"].detach().numpy()
    got = np.array(ours["encoder.encoder.layer.1.attention.self.query.weight"])
    np.testing.assert_allclose(got, reference, atol=2e-5 * np.abs(reference).max(), rtol=1e-4)
    # the saved folder: sentence-transformers reads it with our outputs
    assert_multivector_folder_matches(trained.path)


def assert_multivector_folder_matches(folder: Path) -> None:
    st, ours = STMultiVectorEncoder(str(folder), device="cpu"), MultiVectorEncoder(folder)
    for kind in ("query", "document"):
        expected = getattr(st, f"encode_{kind}")(TEXTS)
        got = getattr(ours, f"encode_{kind}")(TEXTS, convert_to_numpy=True)
        assert len(got) == len(expected)
        for mine, theirs in zip(got, expected, strict=True):
            np.testing.assert_allclose(mine, theirs.float().numpy(), atol=1e-5)


def test_multivector_from_an_encoder_adds_sentence_transformers_projection_and_resumes(checkpoints, tmp_path):
    options = dict(model=checkpoints["encoder"], max_steps=2, save_every=1, batch_size=3, lr=1e-3)
    trained = fine_tune("multivector", TRIPLETS, tmp_path / "out", eval_data=TRIPLETS[:3], **options)
    assert np.isfinite(trained.metrics["eval_loss"])
    resumed = fine_tune("multivector", TRIPLETS, tmp_path / "out", resume=tmp_path / "out" / "checkpoint-1", **options)
    resumed_weights = dict(tree_flatten(resumed.model.parameters()))
    for name, weight in tree_flatten(trained.model.parameters()):  # the projection too: restored, not redrawn
        np.testing.assert_array_equal(np.array(weight), np.array(resumed_weights[name]), err_msg=name)
    dense = json.loads((trained.path / "1_Dense" / "config.json").read_text())
    assert (dense["in_features"], dense["out_features"], dense["bias"]) == (32, 128, False)
    modules = [m["type"].rsplit(".", 1)[-1] for m in json.loads((trained.path / "modules.json").read_text())]
    assert modules == ["Transformer", "Dense", "MultiVectorMask", "Normalize"]
    assert_multivector_folder_matches(trained.path)


def test_multivector_from_a_sentence_transformer_drops_its_pooling(checkpoints, tmp_path):
    folder = tmp_path / "st"
    SentenceTransformer(modules=[Transformer(str(checkpoints["encoder"])), Pooling(32), Normalize()]).save(str(folder))
    trained = fine_tune("multivector", TRIPLETS, tmp_path / "out", model=folder, max_steps=1, batch_size=3)
    modules = [m["type"].rsplit(".", 1)[-1] for m in json.loads((trained.path / "modules.json").read_text())]
    assert modules == ["Transformer", "Dense", "MultiVectorMask", "Normalize"]
    settings = json.loads((trained.path / "config_sentence_transformers.json").read_text())
    assert settings["similarity_fn_name"] == "maxsim"
    assert_multivector_folder_matches(trained.path)


def test_cli_trains_sparse_and_multivector(checkpoints, tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in TRIPLETS))
    for kind, model in (("sparse", "mlm"), ("multivector", "encoder")):
        out = tmp_path / kind
        argv = ["train", kind, "-m", str(checkpoints[model]), "--data", str(data), "-o", str(out), "--max-steps", "1"]
        argv += ["--json", "--query-prompt", "q: "]
        if kind == "sparse":
            argv += ["--document-regularizer-weight", "1e-4", "--query-regularizer-weight", "0", "--lora-rank", "2"]
        assert main(argv) == 0
        assert (out / "adapters").is_dir() == (kind == "sparse")
        assert json.loads(capsys.readouterr().out)["model"] == str(out / "model")
        settings = json.loads((out / "model" / "config_sentence_transformers.json").read_text())
        assert settings["prompts"]["query"] == "q: "
    expected = STSparseEncoder(str(tmp_path / "sparse" / "model"), device="cpu").encode(TEXTS, convert_to_tensor=True)
    got = SparseEncoder(tmp_path / "sparse" / "model").encode(TEXTS).toarray()  # LoRA fused into the saved model
    np.testing.assert_allclose(got, expected.to_dense().numpy(), atol=1e-5)
    with pytest.raises(TypeError, match="SpladeLoss"):
        fine_tune("sparse", TRIPLETS, tmp_path / "bad", model=checkpoints["mlm"], loss="mnrl")
    with pytest.raises(ValueError, match="masked-LM"):
        fine_tune("sparse", TRIPLETS, tmp_path / "bad", model=checkpoints["encoder"])


@pytest.mark.parametrize("task, model", [("sparse", "mlm"), ("multivector", "encoder")])
def test_scored_pairs_are_refused_with_advice_the_task_can_follow(checkpoints, tmp_path, task, model):
    """Sparse and multi-vector training take no CoSENT or cosine loss, which the advice named."""
    data = tmp_path / "scored.jsonl"
    data.write_text("".join(json.dumps({"sentence1": a, "sentence2": b, "score": 0.5}) + "\n"
                            for a, b in zip(TEXTS, TEXTS[1:], strict=False)))  # fmt: skip
    name = "sparse" if task == "sparse" else "multi-vector"
    with pytest.raises(ValueError, match=f"scored.jsonl: .*; {name} training takes anchor, positive"):
        fine_tune(task, data, tmp_path / "run", model=checkpoints[model])

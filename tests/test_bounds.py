"""No crash, no silent wrong answer: inputs the embedding tables cannot take fail at the model's entry, naming the
value and its limit, for every architecture and for quantized tables; non-finite weights warn at load.

MLX does not range-check indices: an id past a table reads stray memory or kills the process (SIGSEGV). Such
inputs run in a fresh interpreter, so a crash fails the test instead of ending the run.
"""

import json
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from mlx_encoders.checkpoint.build import load_model
from mlx_encoders.models import MODEL_TYPES

ROOT = Path(__file__).parent.parent
FAR = 2_000_000_000  # far past any table: this one used to crash the process
QUANTIZABLE = dict(hidden_size=64, intermediate_size=128)  # widths that groups of 32 divide
# Feeds one model every out-of-range input, printing [case, error message or None when it ran] to stderr as each
# finishes: the far-off id comes last, so a crash there still leaves the other cases' results.
BAD_INPUTS = """
import json, sys
import mlx_encoders
import mlx.core as mx
import mlx.nn as nn
from mlx_encoders.checkpoint.build import load_model

model = load_model(sys.argv[1], task="encoder")
if sys.argv[2] == "quantized":
    nn.quantize(model, group_size=32, bits=8)
    assert isinstance(model.embeddings.word_embeddings, nn.QuantizedEmbedding)
args = model.args
cases = {
    "id == vocab_size": dict(input_ids=mx.array([[2, args.vocab_size, 3]])),
    "negative id": dict(input_ids=mx.array([[2, -1, 3]])),
}
if args.max_tokens:  # relative positions alone (DeBERTa-v3) take any length
    cases["too long"] = dict(input_ids=mx.full((1, args.max_tokens + 1), 5))
if getattr(args, "type_vocab_size", 0):
    cases["token type"] = dict(input_ids=mx.array([[2, 5, 3]]), token_type_ids=mx.array([[0, 0, args.type_vocab_size]]))
cases["id far beyond"] = dict(input_ids=mx.array([[2, int(sys.argv[3]), 3]]))
for case, inputs in cases.items():
    try:
        mx.eval(model(**inputs).last_hidden_state)
        message = None
    except ValueError as e:
        message = str(e)
    print(json.dumps([case, message]), file=sys.stderr, flush=True)
"""


@pytest.fixture(scope="module")
def bad_input(checkpoint):
    """`bad_input(model_type, case, quantized=False)` -> the error message the model gave for that input; each
    model runs its cases in one fresh interpreter, which must exit normally."""
    runs = {}

    def run(model_type: str, case: str, quantized: bool = False) -> str:
        if (model_type, quantized) not in runs:
            folder = checkpoint(model_type, "encoder", **(QUANTIZABLE if quantized else {}))
            command = [sys.executable, "-c", BAD_INPUTS, str(folder), "quantized" if quantized else "float", str(FAR)]
            runs[model_type, quantized] = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
        done = runs[model_type, quantized]
        results = dict(json.loads(line) for line in done.stderr.splitlines() if line.startswith('["'))
        assert case in results, (
            f"the model's process exited with {done.returncode} on this input:\n{done.stderr[-2000:]}"
        )
        assert results[case] is not None, f"{case} ran without an error"
        return results[case]

    return run


ID_CASES = ["id == vocab_size", "id far beyond", "negative id"]
# RoPE models (ModernBERT, Nomic BERT, GTE, EuroBERT, Qwen3, jina-embeddings-v3) and DeBERTa-v3 (the deberta-v2 test
# config, relative positions only) have no position table.
ROPE = ("modernbert", "nomic_bert", "gte", "eurobert", "qwen3", "jina_embeddings_v3")
WITH_TABLE = [mt for mt in MODEL_TYPES if mt not in (*ROPE, "deberta-v2")]
WITH_TYPES = ["bert", "roberta", "xlm-roberta", "albert", "electra"]  # DistilBERT, ModernBERT, MPNet read none


def config_of(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def bad_id(case: str, vocab: int) -> int:
    return {"id == vocab_size": vocab, "id far beyond": FAR, "negative id": -1}[case]


@pytest.mark.parametrize("case", ID_CASES)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_token_id_outside_the_vocabulary_fails(bad_input, checkpoint, model_type, case):
    vocab = config_of(checkpoint(model_type, "encoder"))["vocab_size"]
    message = bad_input(model_type, case)
    assert f"token id {bad_id(case, vocab)}," in message and f"vocab_size={vocab}" in message


@pytest.mark.parametrize("case", ID_CASES)
def test_token_id_outside_a_quantized_vocabulary_fails(bad_input, checkpoint, case):
    vocab = config_of(checkpoint("bert", "encoder", **QUANTIZABLE))["vocab_size"]
    message = bad_input("bert", case, quantized=True)
    assert f"token id {bad_id(case, vocab)}," in message and f"vocab_size={vocab}" in message


@pytest.mark.parametrize("model_type", WITH_TABLE)
def test_input_longer_than_the_position_table_fails(bad_input, checkpoint, model_type):
    config = config_of(checkpoint(model_type, "encoder"))
    # RoBERTa's and MPNet's positions start after pad_token_id: the table holds fewer than max_position_embeddings.
    after_padding = "roberta" in model_type or model_type == "mpnet"
    limit = config["max_position_embeddings"] - (config["pad_token_id"] + 1 if after_padding else 0)
    message = bad_input(model_type, "too long")
    assert f"input of {limit + 1} tokens" in message and f"the {limit} positions" in message


@pytest.mark.parametrize("model_type", WITH_TYPES)
def test_token_type_outside_type_vocab_size_fails(bad_input, checkpoint, model_type):
    types = config_of(checkpoint(model_type, "encoder"))["type_vocab_size"]
    message = bad_input(model_type, "token type")
    assert f"token type {types}, but the model has type_vocab_size={types}" in message


def test_text_pair_on_a_model_without_segments_says_to_drop_token_types(bad_input):
    assert "pass token_type_ids=None" in bad_input("roberta", "token type")


@pytest.fixture(scope="module")
def encoders(checkpoint):
    return {mt: load_model(checkpoint(mt, "encoder"), task="encoder") for mt in MODEL_TYPES}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("name", ["attention_mask", "token_type_ids"])
def test_mask_or_token_types_of_another_shape_fail(encoders, model_type, name):
    ids = mx.array([[2, 5, 3], [2, 6, 3]])
    with pytest.raises(ValueError, match=re.escape(f"{name} has shape (2, 1) but input_ids has shape (2, 3)")):
        encoders[model_type](ids, **{name: mx.zeros((2, 1), mx.int32)})  # it would broadcast silently


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_input_ids_must_be_a_2d_integer_mx_array(encoders, model_type):
    model = encoders[model_type]
    with pytest.raises(ValueError, match=re.escape("input_ids must be 2-D (batch, length), got shape (3,)")):
        model(mx.array([2, 5, 3]))
    with pytest.raises(ValueError, match="input_ids must hold integers, got float32"):
        model(mx.array([[2.0, 5.0, 3.0]]))
    with pytest.raises(TypeError, match="input_ids must be an mx.array, got ndarray"):
        model(np.array([[2, 5, 3]]))


def test_roberta_counts_positions_of_real_tokens_only(encoders):
    """Padding past the table is fine (its position is pad_token_id's); too many real tokens are not."""
    model = encoders["roberta"]
    limit, pad = model.args.max_tokens, model.args.pad_token_id
    padded = mx.concatenate([mx.full((1, limit), 5), mx.full((1, 4), pad)], axis=1)
    assert model(padded).last_hidden_state.shape[1] == limit + 4
    with pytest.raises(ValueError, match=f"input of {limit + 1} tokens besides padding"):
        model(mx.concatenate([padded[:, :-1], mx.full((1, 1), 5)], axis=1))


@pytest.mark.parametrize("model_type", ["modernbert", "nomic_bert", "gte"])
def test_rotary_models_have_no_position_limit(encoders, model_type):
    model = encoders[model_type]
    ids = mx.full((1, model.args.max_position_embeddings + 8), 5)
    assert np.isfinite(np.array(model(ids).last_hidden_state)).all()


def test_ids_checked_inside_value_and_grad(encoders):
    """The check reads concrete ids, so training's gradients (taken for the parameters) pass through it."""
    model = encoders["bert"]

    def loss(model, ids):
        return model(ids).last_hidden_state.sum()

    value, _ = nn.value_and_grad(model, loss)(model, mx.array([[2, 5, 3]]))
    assert np.isfinite(value.item())
    with pytest.raises(ValueError, match="token id -1,"):
        nn.value_and_grad(model, loss)(model, mx.array([[2, -1, 3]]))


def copy_with(folder: Path, tmp_path: Path, key: str, value: float) -> Path:
    """A copy of the checkpoint with `value` written into the first element of tensor `key`."""
    folder = shutil.copytree(folder, tmp_path / "ckpt")
    weights = load_file(folder / "model.safetensors")
    weights[key].reshape(-1)[0] = value
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_nan_weight_warns_at_load_naming_the_tensor(checkpoint, tmp_path):
    folder = copy_with(checkpoint("bert", "encoder"), tmp_path, "embeddings.word_embeddings.weight", np.nan)
    with pytest.warns(UserWarning, match=r"NaN or inf values in 1 tensors: embeddings\.word_embeddings\.weight\."):
        load_model(folder)


def test_overflow_in_a_float16_cast_warns(checkpoint, tmp_path):
    folder = copy_with(checkpoint("bert", "encoder"), tmp_path, "encoder.layer.0.output.dense.weight", 1e6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # finite in float32: no warning
        load_model(folder)
    with pytest.warns(UserWarning, match=r"encoder\.layer\.0\.output\.dense\.weight.*load it in float32"):
        load_model(folder, dtype="float16")

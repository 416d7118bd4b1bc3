"""The checkpoint layer: `save` for transformers and back, new heads, models built in code, and every
refusal of a broken folder (each names the file or key at fault)."""

import json
import os
import shutil
import stat
import warnings
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
import transformers
from checkpoints import AUTO_CLASSES
from mlx.utils import tree_flatten
from safetensors.numpy import load_file, save_file
from test_parity import CASES, as_torch, assert_close, our_outputs, reference_outputs

import mlx_encoders
from mlx_encoders.checkpoint import save
from mlx_encoders.models import bert, model_module, task_of_architecture

TEXTS = ["hello there", "a second, longer text for the batch", ""]


def copy(folder, tmp_path):
    return shutil.copytree(folder, tmp_path / "ckpt")


def edit_weights(folder, edit):
    weights = load_file(folder / "model.safetensors")
    edit(weights)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def edit_config(folder, edit):
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


def main_output(out) -> np.ndarray:
    return np.array(out.logits if out.logits is not None else out.last_hidden_state)


def torch_output(model, batch) -> np.ndarray:
    with torch.no_grad():
        return model(**as_torch(batch)).logits.numpy()


def sentence_modules(pooling_path: str) -> list[dict]:
    """modules.json of a Transformer in the folder itself and a Pooling module at `pooling_path`."""
    kinds = ("Transformer", "Pooling")
    return [
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
        for i, (kind, path) in enumerate(zip(kinds, ("", pooling_path), strict=True))
    ]


def params(model) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}


# --- save: transformers reads what mlx_encoders writes, and mlx_encoders reads it back identically ---


@pytest.mark.parametrize("model_type,task", CASES)
def test_saved_checkpoint_loads_in_transformers_with_equal_logits(checkpoint, tmp_path, model_type, task):
    model, tokenizer = mlx_encoders.load(checkpoint(model_type, task))
    folder = save(model, tmp_path / "saved", tokenizer)

    reference, info = AUTO_CLASSES[task].from_pretrained(folder, attn_implementation="eager", output_loading_info=True)
    assert not any(info.values()), f"transformers reports {info}"  # nothing missing, unexpected or re-initialised
    assert type(reference).__name__ == json.loads((folder / "config.json").read_text())["architectures"][0]
    batch = tokenizer(TEXTS)
    real = np.array(batch["attention_mask"]).astype(bool)
    assert_close(our_outputs(model(**batch)), reference_outputs(folder, task, batch), real, task, atol=1e-5)

    again, tokenizer_again = mlx_encoders.load(folder)
    assert type(again) is type(model)
    assert params(again).keys() == params(model).keys()
    for key, value in params(model).items():
        np.testing.assert_array_equal(params(again)[key], value, err_msg=key)
    assert tokenizer_again(TEXTS)["input_ids"].tolist() == batch["input_ids"].tolist()


def test_saved_tokenizer_loads_in_transformers_with_equal_ids(checkpoint, tmp_path):
    source = checkpoint("roberta", "masked-lm")
    model, tokenizer = mlx_encoders.load(source)
    folder = save(model, tmp_path / "saved", tokenizer)
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    expected = theirs(TEXTS, padding=True)
    ours = tokenizer(TEXTS, padding=True)
    assert ours["input_ids"].tolist() == expected["input_ids"]
    assert ours["attention_mask"].tolist() == expected["attention_mask"]
    assert theirs.mask_token == tokenizer.mask_token and theirs.pad_token == tokenizer.pad_token


def test_save_shards_past_the_limit_with_an_index(checkpoint, tmp_path):
    model, tokenizer = mlx_encoders.load(checkpoint("bert", "masked-lm"))
    folder = save(model, tmp_path / "sharded", tokenizer, shard_size=50_000)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(folder.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == {s.name for s in shards}
    batch = tokenizer(TEXTS)
    expected = main_output(model(**batch))
    np.testing.assert_array_equal(main_output(mlx_encoders.load_model(folder)(**batch)), expected)
    reference = transformers.AutoModelForMaskedLM.from_pretrained(folder, attn_implementation="eager").eval()
    real = np.array(batch["attention_mask"]).astype(bool)
    np.testing.assert_allclose(torch_output(reference, batch)[real], expected[real], atol=1e-4)


def test_save_is_atomic_and_never_replaces_without_overwrite(checkpoint, tmp_path, monkeypatch):
    model, tokenizer = mlx_encoders.load(checkpoint("distilbert", "masked-lm"))
    folder = save(model, tmp_path / "out", tokenizer)
    before = sorted(p.name for p in folder.iterdir())
    with pytest.raises(FileExistsError, match="out already exists; pass overwrite=True"):
        save(model, folder)

    def broken(folder):
        raise OSError("disk full")

    monkeypatch.setattr(tokenizer, "save", broken)  # fails after the weights are written
    with pytest.raises(OSError, match="disk full"):
        save(model, folder, tokenizer, overwrite=True)
    assert sorted(p.name for p in folder.iterdir()) == before  # the old checkpoint is intact
    with pytest.raises(OSError, match="disk full"):
        save(model, tmp_path / "fresh", tokenizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing half-written is left behind
    tokenizer_files = {name: (folder / name).read_bytes() for name in before if "token" in name or "vocab" in name}
    save(model, folder, overwrite=True)  # no tokenizer: the folder keeps its own, which loading needs
    assert tokenizer_files and {name: (folder / name).read_bytes() for name in tokenizer_files} == tokenizer_files
    _, loaded_tokenizer = mlx_encoders.load(folder)
    assert loaded_tokenizer(TEXTS)["input_ids"].tolist() == tokenizer(TEXTS)["input_ids"].tolist()


def test_saving_through_a_link_writes_where_it_points(checkpoint, tmp_path):
    model, tokenizer = mlx_encoders.load(checkpoint("bert"))
    real = save(model, tmp_path / "disk" / "ckpt", tokenizer)
    (tmp_path / "current").symlink_to(real)
    mlx_encoders.save(mlx_encoders.load(real, dtype="float16")[0], tmp_path / "current", overwrite=True)
    assert (tmp_path / "current").is_symlink() and (tmp_path / "current").resolve() == real.resolve()
    assert {v.dtype for v in mx.load(str(real / "model.safetensors")).values()} == {mx.float16}


def test_a_roberta_config_whose_pad_id_leaves_no_position_is_refused(checkpoint, tmp_path):
    folder = shutil.copytree(checkpoint("roberta"), tmp_path / "roberta")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "pad_token_id": 200, "max_position_embeddings": 130}))
    with pytest.raises(
        ValueError, match=r"config.json: config keys 'pad_token_id' \(200\) and 'max_position_embeddings'"
    ):
        mlx_encoders.load(folder)


def test_quantized_model_saves_in_the_layout_convert_writes(checkpoint, tmp_path):
    source = checkpoint("bert", "masked-lm", hidden_size=64, intermediate_size=128, num_attention_heads=4)
    model, tokenizer = mlx_encoders.load(source)
    special = "cls.predictions.transform.dense"
    override = {"group_size": 32, "bits": 8}
    nn.quantize(model, 64, 4, class_predicate=lambda p, m: override if p == special else hasattr(m, "to_quantized"))
    folder = save(model, tmp_path / "q", tokenizer)
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization"] == config["quantization_config"]
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 64
    assert config["quantization"][special] == {"group_size": 32, "bits": 8, "mode": "affine"}
    stored = load_file(folder / "model.safetensors")
    assert stored["bert.encoder.layer.0.output.dense.weight"].dtype == np.uint32
    assert "bert.encoder.layer.0.output.dense.scales" in stored
    batch = tokenizer(TEXTS)
    loaded = mlx_encoders.load_model(folder)
    assert dict(loaded.named_modules())[special].bits == 8
    np.testing.assert_array_equal(main_output(loaded(**batch)), main_output(model(**batch)))


def test_model_built_in_code_is_first_class(checkpoint, tmp_path):
    """No loader attributes: a tokenizer from a path, a pipeline, and save -> transformers all work."""
    args = bert.ModelArgs(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=64, id2label={0: "no", 1: "yes", 2: "maybe"},
    )  # fmt: skip
    mx.random.seed(0)
    model = bert.BertForSequenceClassification(args)
    model.eval()
    tokenizer = mlx_encoders.load_tokenizer(model, checkpoint("bert"))
    with pytest.raises(ValueError, match="not loaded from a folder; pass the tokenizer's folder"):
        mlx_encoders.load_tokenizer(model)
    results = mlx_encoders.pipeline("text-classification", model=(model, tokenizer))(["a text", "another"])
    assert {r["label"] for r in results} <= {"no", "yes", "maybe"}
    folder = save(model, tmp_path / "in-code", tokenizer)
    reference = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    assert reference.config.id2label == {0: "no", 1: "yes", 2: "maybe"}
    batch = tokenizer(TEXTS)
    np.testing.assert_allclose(torch_output(reference, batch), main_output(model(**batch)), atol=1e-5)
    assert mlx_encoders.load(folder)[0].config["id2label"] == {"0": "no", "1": "yes", "2": "maybe"}


# --- new heads on request, initialised as transformers initialises them ---

HEAD_CASES = [(mt, "masked-lm", task) for mt in ("bert", "roberta", "distilbert", "albert", "modernbert", "mpnet",
                                                   "electra", "nomic_bert", "gte", "eurobert")
              for task in ("sequence-classification", "token-classification")]  # fmt: skip


@pytest.mark.parametrize("model_type,source_task,task", HEAD_CASES)
def test_new_head_is_initialised_as_transformers_does(checkpoint, model_type, source_task, task):
    source = checkpoint(model_type, source_task, initializer_range=0.05)
    labels = {i: f"tag{i}" for i in range(48)}  # a wide head: enough values for its statistics
    mx.random.seed(0)
    with pytest.warns(UserWarning, match="newly initialized") as caught:
        model = mlx_encoders.load_model(source, task=task, id2label=labels)
    assert len([w for w in caught if "newly initialized" in str(w.message)]) == 1
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference, info = AUTO_CLASSES[task].from_pretrained(source, id2label=labels, output_loading_info=True)
    new = sorted(info["missing_keys"])
    message = str(caught[0].message)
    assert all(key in message for key in new), (new, message)
    ours = params(model)
    theirs = dict(reference.named_parameters())
    for key in new:
        a, b = ours[key], theirs[key].detach().numpy()
        assert a.shape == b.shape, key
        if key.endswith("bias"):
            assert not a.any() and not b.any(), key
        elif "norm" in key.lower():
            np.testing.assert_array_equal(a, b)
        else:  # same distribution: mean 0, the same standard deviation and the same truncation
            assert abs(a.mean()) < 0.2 * b.std() and abs(a.std() / b.std() - 1) < 0.15, (key, a.std(), b.std())
            assert np.abs(a).max() <= np.abs(b).max() * 1.25 + 1e-6 or model_type != "modernbert", key
    assert model.args.id2label == labels and model.args.num_labels == 48
    assert model(**mlx_encoders.load_tokenizer(model)(TEXTS)).logits.shape[-1] == 48


def test_new_head_labels_problem_type_are_saved(checkpoint, tmp_path):
    source = checkpoint("bert", "masked-lm")
    with pytest.warns(UserWarning, match=r"newly initialized: bert.pooler.dense.bias, bert.pooler.dense.weight, "):
        model, tokenizer = mlx_encoders.load(
            source,
            task="sequence-classification",
            label2id={"neg": 0, "pos": 1},
            problem_type="multi_label_classification",
        )
    folder = save(model, tmp_path / "new-head", tokenizer)
    config = json.loads((folder / "config.json").read_text())
    assert config["id2label"] == {"0": "neg", "1": "pos"} and config["label2id"] == {"neg": 0, "pos": 1}
    assert config["problem_type"] == "multi_label_classification"
    assert config["architectures"] == ["BertForSequenceClassification"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the saved head is complete: no new tensors now
        again = mlx_encoders.load_model(folder)
    assert again.args.problem_type == "multi_label_classification"


@pytest.mark.parametrize("stored", ["encoder", "masked-lm", "token-classification"])
def test_label_keywords_alone_ask_for_a_classifier_unless_the_head_has_labels(checkpoint, stored):
    """Without task=, labels on a checkpoint whose head has none create a sequence classifier (they were ignored);
    a token classifier keeps its head."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the new head's tensors are named in a warning
        folder = checkpoint("bert", stored)
        labels = {i: f"L{i}" for i in range(mlx_encoders.load_model(folder).args.num_labels)}  # the head's count
        model = mlx_encoders.load_model(folder, id2label=labels)
    expected = "BertForTokenClassification" if stored == "token-classification" else "BertForSequenceClassification"
    assert type(model).__name__ == expected and model.args.id2label == labels


@pytest.mark.parametrize(
    "model_type,named",
    [("bert", "BertForMaskedLM"), ("qwen3", "Qwen3ForCausalLM"), ("bert", "BertForTokenClassification")],
)
def test_label_keywords_on_a_bare_encoder_under_a_head_name_ask_for_a_classifier(checkpoint, tmp_path, model_type,
                                                                                   named):  # fmt: skip
    """Qwen3-Embedding's layout: config.json names the causal LM, the weights are the bare model's. Labels create
    a classifier, as transformers' AutoModelForSequenceClassification does (the bare encoder came back, silently)."""
    folder = copy(checkpoint(model_type), tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": [named]}))
    stored = "token-classification" if named.endswith("TokenClassification") else "sequence-classification"
    reference = AUTO_CLASSES[stored].from_pretrained(folder, num_labels=2)
    with pytest.warns(UserWarning, match="newly initialized"):
        model = mlx_encoders.load_model(folder, num_labels=2)
    assert type(model).__name__ == type(reference).__name__
    assert type(mlx_encoders.load_model(folder)).__name__ == f"{named.split('For')[0]}Model"


def test_new_head_needs_the_label_keywords(checkpoint):
    with pytest.raises(ValueError, match="missing from the checkpoint: classifier.bias.*pass num_labels="):
        mlx_encoders.load_model(checkpoint("distilbert", "masked-lm"), task="sequence-classification")
    with pytest.raises(ValueError, match="num_labels=3 but 2 labels were named"):
        mlx_encoders.load_model(
            checkpoint("bert"), task="token-classification", num_labels=3, id2label={0: "a", 1: "b"}
        )
    with pytest.raises(ValueError, match="num_labels must be a positive integer"):
        mlx_encoders.load_model(checkpoint("bert"), task="token-classification", num_labels=0)
    with pytest.raises(ValueError, match="problem_type.*must be one of regression"):
        mlx_encoders.load_model(checkpoint("bert"), task="sequence-classification", problem_type="ranking")


def test_new_head_never_replaces_encoder_weights(checkpoint, tmp_path):
    folder = copy(checkpoint("bert", "masked-lm"), tmp_path)
    edit_weights(folder, lambda w: w.pop("bert.encoder.layer.0.output.dense.weight"))
    with pytest.raises(ValueError, match="missing from the checkpoint: bert.encoder.layer.0.output.dense.weight"):
        mlx_encoders.load_model(folder, task="sequence-classification", num_labels=2)


def test_existing_head_keeps_its_weights_with_matching_labels(checkpoint):
    source = checkpoint("roberta", "sequence-classification")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = mlx_encoders.load_model(source, id2label={0: "a", 1: "b", 2: "c"})
    np.testing.assert_array_equal(
        params(model)["classifier.out_proj.weight"],
        params(mlx_encoders.load_model(source))["classifier.out_proj.weight"],
    )
    with pytest.raises(ValueError, match=r"classifier.out_proj.weight is \(3, 32\) in the file but \(5, 32\)"):
        mlx_encoders.load_model(source, num_labels=5)


# --- strict where a broken folder would otherwise load silently ---


def test_unknown_architecture_names_itself(checkpoint, tmp_path):
    with pytest.raises(ValueError, match="Unsupported architecture 'GPT2DoubleHeadsModel'"):
        task_of_architecture("GPT2DoubleHeadsModel")
    folder = copy(checkpoint("bert"), tmp_path)
    edit_config(folder, lambda c: c.update(architectures=["BertLMHeadModel"]))
    with pytest.raises(ValueError, match=r"config.json: Unsupported architecture 'BertLMHeadModel'.*task='encoder'"):
        mlx_encoders.load_model(folder)
    assert type(mlx_encoders.load_model(folder, task="encoder")).__name__ == "BertModel"
    assert task_of_architecture("XLMRobertaForTokenClassification") == "token-classification"


def test_integer_tensors_where_floats_belong_are_refused(checkpoint, tmp_path):
    folder = copy(checkpoint("bert"), tmp_path)
    key = "encoder.layer.0.attention.self.query.weight"
    edit_weights(folder, lambda w: w.update({key: w[key].astype(np.int64)}))
    with pytest.raises(ValueError, match=f"not float where the model needs float weights.*{key} \\(int64\\)"):
        mlx_encoders.load_model(folder)


def test_several_safetensors_without_an_index_are_refused(checkpoint, tmp_path):
    folder = copy(checkpoint("bert"), tmp_path)
    (folder / "model.safetensors").rename(folder / "weights-a.safetensors")
    shutil.copy(folder / "weights-a.safetensors", folder / "weights-b.safetensors")
    with pytest.raises(
        ValueError, match="several safetensors files \\(weights-a.safetensors, weights-b.safetensors\\)"
    ):
        mlx_encoders.load_model(folder)
    (folder / "weights-b.safetensors").unlink()
    assert mlx_encoders.load_model(folder) is not None  # one file, whatever its name


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd"])
def test_index_paths_leaving_the_folder_are_refused(checkpoint, tmp_path, name):
    folder = copy(checkpoint("bert"), tmp_path)
    (folder / "model.safetensors").rename(folder / "shard.safetensors")
    index = {"metadata": {}, "weight_map": {"embeddings.word_embeddings.weight": name}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="model.safetensors.index.json lists .*not a relative path inside"):
        mlx_encoders.load_model(folder)


def test_an_index_is_read_as_transformers_reads_it(checkpoint, tmp_path):
    """model.safetensors first (transformers' save_pretrained leaves an old index beside a new single file); an
    index's entry that names no file is refused naming the key."""
    from transformers import AutoModel

    folder = copy(checkpoint("bert"), tmp_path)
    stale = {"metadata": {}, "weight_map": {"embeddings.word_embeddings.weight": "model-00001-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(stale))
    AutoModel.from_pretrained(folder)  # transformers reads model.safetensors
    assert mlx_encoders.load_model(folder) is not None
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"pooler.dense.weight": None}}))
    with pytest.raises(
        ValueError, match=r"index.json: weight_map\['pooler.dense.weight'\] must be a shard's file name"
    ):
        mlx_encoders.load_model(folder)


def test_a_shard_without_a_key_its_index_lists_is_named(checkpoint, tmp_path):
    """transformers leaves the key at random; the error names the shard, not a head to add with num_labels."""
    model, tokenizer = mlx_encoders.load(checkpoint("bert", "sequence-classification"))
    folder = save(model, tmp_path / "sharded", tokenizer, shard_size=50_000)
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    shard = folder / weight_map["classifier.weight"]
    weights = load_file(shard)
    del weights["classifier.weight"]
    save_file(weights, shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{shard.name} lacks classifier.weight, which model.safetensors.index.json"):
        mlx_encoders.load_model(folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    with pytest.raises(ValueError, match="index.json has no 'weight_map' object naming the shards"):
        mlx_encoders.load_model(folder)


def test_a_missing_untied_decoder_suggests_tying_not_a_classifier(checkpoint, tmp_path):
    """Following the num_labels hint built a sequence classifier out of a masked-LM checkpoint."""
    folder = copy(checkpoint("bert", "masked-lm", tie_word_embeddings=False), tmp_path)
    edit_weights(folder, lambda w: w.pop("cls.predictions.decoder.weight"))
    with pytest.raises(ValueError, match=r"decoder.weight \| config.json has tie_word_embeddings false") as error:
        mlx_encoders.load_model(folder)
    assert "num_labels" not in str(error.value)


def test_a_hub_download_fetches_chat_templates_and_bge_m3_heads():
    from huggingface_hub.utils import filter_repo_objects

    from mlx_encoders.checkpoint.files import HUB_PATTERNS

    files = ["chat_template.jinja", "1_Pooling/config.json", "sparse_linear.pt", "colbert_linear.pt",
             "pytorch_model.bin", "model.safetensors", "onnx/model.onnx"]  # fmt: skip
    assert sorted(filter_repo_objects(files, allow_patterns=HUB_PATTERNS)) == [
        "1_Pooling/config.json", "chat_template.jinja", "colbert_linear.pt", "model.safetensors", "sparse_linear.pt"
    ]  # fmt: skip


def test_modules_json_paths_leaving_the_folder_are_refused(checkpoint, tmp_path):
    folder = copy(checkpoint("bert"), tmp_path)
    (folder / "modules.json").write_text(json.dumps(sentence_modules("../../elsewhere")))
    with pytest.raises(ValueError, match="modules.json lists '../../elsewhere'"):
        mlx_encoders.SentenceEncoder(folder)


BROKEN_JSON = {
    "config.json": lambda: mlx_encoders.load_model,
    "model.safetensors.index.json": lambda: mlx_encoders.load_model,
    "tokenizer_config.json": lambda: mlx_encoders.load,
    "special_tokens_map.json": lambda: mlx_encoders.load,
    "modules.json": lambda: mlx_encoders.SentenceEncoder,
    "1_Pooling/config.json": lambda: mlx_encoders.SentenceEncoder,
    "sentence_bert_config.json": lambda: mlx_encoders.SentenceEncoder,
}


@pytest.mark.parametrize("name", BROKEN_JSON)
@pytest.mark.filterwarnings("ignore:.*has no sentence-transformers pooling config")
def test_json_that_does_not_parse_names_its_file(checkpoint, tmp_path, name):
    folder = copy(checkpoint("bert"), tmp_path)
    if name == "1_Pooling/config.json":
        (folder / "modules.json").write_text(json.dumps(sentence_modules("1_Pooling")))
        (folder / "1_Pooling").mkdir()
    if name == "model.safetensors.index.json":  # read only without model.safetensors, as transformers reads it
        (folder / "model.safetensors").rename(folder / "shard.safetensors")
    (folder / name).write_text('{"truncated": ')
    with pytest.raises(ValueError, match=f"{name} is not valid JSON"):
        BROKEN_JSON[name]()(folder)


@pytest.mark.parametrize("damage", ["empty", "truncated"])
def test_damaged_safetensors_names_its_file(checkpoint, tmp_path, damage):
    folder = copy(checkpoint("bert"), tmp_path)
    file = folder / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(b"" if damage == "empty" else data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors file"):
        mlx_encoders.load_model(folder)


@pytest.mark.parametrize("damage", ["overlapping", "wrong size", "trailing bytes", "offsets of text"])
def test_a_damaged_safetensors_header_is_refused_as_the_safetensors_library_refuses_it(checkpoint, tmp_path, damage):
    """MLX's reader does not check the offsets: two tensors over the same bytes loaded as wrong weights, silently."""
    import struct

    from safetensors import SafetensorError, safe_open

    folder = copy(checkpoint("bert"), tmp_path)
    file = folder / "model.safetensors"
    data = file.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header, body = json.loads(data[8 : 8 + size]), data[8 + size :]
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    first, second = (header[n] for n in names[:2])
    if damage == "overlapping":
        second["data_offsets"] = list(first["data_offsets"])
    elif damage == "wrong size":
        first["shape"] = [first["shape"][0] + 1, *first["shape"][1:]]
    elif damage == "trailing bytes":
        body += b"\0" * 8
    else:
        second["data_offsets"] = ["ab", second["data_offsets"][1]]
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    file.write_bytes(struct.pack("<Q", len(encoded)) + encoded + body)
    with pytest.raises(SafetensorError), safe_open(str(file), "np") as f:  # the oracle refuses it
        f.get_tensor(names[1])
    with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors file .*re-download"):
        mlx_encoders.load_model(folder)


def test_a_weight_file_that_is_a_pipe_is_refused_not_waited_on(checkpoint, tmp_path):
    """Opening a FIFO blocks until a writer comes: the load names the file instead (run apart: the old hang)."""
    import subprocess
    import sys

    folder = copy(checkpoint("bert"), tmp_path)
    (folder / "model.safetensors").unlink()
    os.mkfifo(folder / "model.safetensors")
    code = f"import mlx_encoders; mlx_encoders.load_model({str(folder)!r})"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr
    assert "model.safetensors is not a readable safetensors file (not a regular file)" in run.stderr, run.stderr


def test_corrupt_tokenizer_json_names_itself(checkpoint, tmp_path):
    folder = copy(checkpoint("bert"), tmp_path)
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nonsense"}}')
    with pytest.raises(ValueError, match="tokenizer.json is not a valid tokenizer file"):
        mlx_encoders.load(folder)


@pytest.mark.parametrize(
    "edit,message",
    [
        ({"hidden_size": "abc"}, "config key 'hidden_size' must be int, got str 'abc'"),
        ({"hidden_size": 30}, "the hidden size 30 is not divisible by the number of attention heads 4"),
        ({"num_hidden_layers": -1}, "config key 'num_hidden_layers' must be a positive integer, got -1"),
        ({"layer_norm_eps": -1e-5}, "config key 'layer_norm_eps' must not be negative"),
        ({"tie_word_embeddings": "yes"}, "config key 'tie_word_embeddings' must be bool, got str"),
        ({"id2label": ["a", "b"]}, "config key 'id2label' must be dict"),
        ({"id2label": {"0": "a", "2": "b"}}, r"config key 'id2label': label ids must be 0..1, got \[0, 2\]"),
        ({"hidden_act": "swoosh"}, "config key 'hidden_act': unsupported activation 'swoosh'"),
        ({"torch_dtype": "int8"}, "config key 'torch_dtype' must be one of float32, float16, bfloat16"),
        ({"architectures": "BertModel"}, "config key 'architectures' must be a list of class names"),
        ({"is_decoder": True}, "config key 'is_decoder' is true: bert as a causal decoder is not supported"),
        ({"add_cross_attention": True}, "config key 'add_cross_attention' is true: bert as cross-attention"),
    ],
)
def test_config_values_that_cannot_work_fail_at_load_naming_the_key(checkpoint, tmp_path, edit, message):
    folder = copy(checkpoint("bert"), tmp_path)
    edit_config(folder, lambda c: c.update(edit))
    with pytest.raises(ValueError, match=f"config.json: {message}"):
        mlx_encoders.load_model(folder)


def test_unsupported_dtype_is_refused(checkpoint):
    with pytest.raises(ValueError, match="Unsupported dtype 'int8'; choose one of: float32, float16, bfloat16"):
        mlx_encoders.load_model(checkpoint("bert"), dtype="int8")


def test_sanitize_hook_fixes_keys_before_they_are_fitted(checkpoint, tmp_path, monkeypatch):
    """An architecture's `sanitize(weights)` (GPT-2's transposed Conv1D, say) runs before fitting."""
    folder = copy(checkpoint("bert"), tmp_path)
    key = "encoder.layer.0.attention.self.query.weight"
    expected = params(mlx_encoders.load_model(folder))[key]
    edit_weights(folder, lambda w: w.update({key.replace("weight", "w_t"): w.pop(key).T.copy()}))
    with pytest.raises(ValueError, match="missing from the checkpoint"):
        mlx_encoders.load_model(folder)

    def sanitize(weights):
        weights[key] = weights.pop(key.replace("weight", "w_t")).T
        return weights

    monkeypatch.setattr(model_module("bert"), "sanitize", sanitize, raising=False)
    np.testing.assert_array_equal(params(mlx_encoders.load_model(folder))[key], expected)


def test_each_front_end_resolves_and_reads_config_once(checkpoint, hub_cache, monkeypatch):
    import huggingface_hub

    from mlx_encoders import jsonfile
    from mlx_encoders.checkpoint import files

    hub_cache("some-org/tiny", checkpoint("bert", "sequence-classification"))
    calls = []
    download, read = huggingface_hub.snapshot_download, jsonfile.read_json
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: calls.append("hub") or download(*a, **k))
    counted = lambda file, *a: calls.append(file.name) or read(file, *a)  # noqa: E731
    for module in (jsonfile, files):  # the reader, and the checkpoint layer's name for it
        monkeypatch.setattr(module, "read_json", counted)
    front_ends = {
        "load": mlx_encoders.load,
        "pipeline": lambda source: mlx_encoders.pipeline("text-classification", model=source),
        "SentenceEncoder": lambda source: mlx_encoders.SentenceEncoder(source, pooling="mean"),
    }
    for name, front_end in front_ends.items():
        calls.clear()
        front_end("some-org/tiny")
        assert calls.count("hub") == 1 and calls.count("config.json") == 1, (name, calls)


def test_save_replaces_only_checkpoint_files(checkpoint, tmp_path, monkeypatch):
    """overwrite=True deletes the old folder: never one with files save() does not write, or no checkpoint."""
    model = mlx_encoders.load_model(checkpoint("bert"))
    folder = save(model, tmp_path / "out")
    (folder / "my-lora").mkdir()  # a PEFT adapter of the user's, not one of the model's task adapters
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (folder / "my-lora" / name).write_text("{}")
    with pytest.raises(FileExistsError, match=r"holds files that save\(\) does not write \(my-lora/\)"):
        save(model, folder, overwrite=True)
    shutil.rmtree(folder / "my-lora")
    (folder / "modules.json").write_text("[]")
    (folder / "1_Pooling").mkdir()
    with pytest.raises(FileExistsError, match=r"holds files that save\(\) does not write \(1_Pooling/, modules.json\)"):
        save(model, folder, overwrite=True)
    assert (folder / "modules.json").exists()
    project = tmp_path / "project"
    project.mkdir()  # an empty folder (a TemporaryDirectory) holds nothing to lose: written without overwrite
    assert (save(model, project) / "config.json").is_file()
    shutil.rmtree(project)
    project.mkdir()  # the working directory: refused (replaced, it would leave the process in a deleted folder)
    monkeypatch.chdir(project)
    for target in (".", project):
        with pytest.raises(FileExistsError, match="is the working directory, which cannot be replaced"):
            save(model, target, overwrite=True)
    assert Path.cwd() == project and not any(project.iterdir())
    monkeypatch.chdir(tmp_path)
    shutil.rmtree(project)
    project.mkdir()
    (project / "notes.txt").write_text("mine")
    for overwrite in (False, True):  # refused for what it holds, whatever the option: overwrite is not suggested
        with pytest.raises(FileExistsError, match=r"is not a checkpoint folder \(no config.json\); refusing"):
            save(model, project, overwrite=overwrite)
    assert (project / "notes.txt").read_text() == "mine"
    for overwrite in (False, True):  # a file: no option replaces it, and the first error says so
        with pytest.raises(FileExistsError, match=r"notes.txt is a file, not a folder; write the checkpoint"):
            save(model, project / "notes.txt", overwrite=overwrite)
    assert (project / "notes.txt").read_text() == "mine"
    with pytest.raises(FileExistsError, match=r"cannot write .*notes.txt/runs/model: .*project/notes.txt is a file,"):
        save(model, project / "notes.txt" / "runs" / "model")  # the file in the way is named, not a folder under it


def test_save_with_its_tokenizer_keeps_the_chat_template_file(checkpoint, tmp_path):
    """transformers 5 keeps a chat template in chat_template.jinja: a reranker whose pairs go through it scored
    otherwise once saved without it."""
    source = copy(checkpoint("qwen3", "causal-lm"), tmp_path)
    reference = transformers.AutoTokenizer.from_pretrained(source)
    reference.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>{% endfor %}"
    )
    reference.save_pretrained(source)
    assert (source / "chat_template.jinja").is_file()
    model, tokenizer = mlx_encoders.load(source)
    saved = save(model, tmp_path / "saved", tokenizer)
    messages = [{"role": "user", "content": "hi"}]
    expected = reference.apply_chat_template(messages, tokenize=False)
    assert transformers.AutoTokenizer.from_pretrained(saved).apply_chat_template(messages, tokenize=False) == expected


def test_saved_folder_gets_the_users_permissions(checkpoint, tmp_path):
    umask = os.umask(0o022)
    try:
        folder = save(mlx_encoders.load_model(checkpoint("bert")), tmp_path / "out")
    finally:
        os.umask(umask)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755  # not mkdtemp's private 0700


def test_bfloat16_model_saves_for_transformers(checkpoint, tmp_path):
    model, tokenizer = mlx_encoders.load(checkpoint("roberta", "sequence-classification"), dtype="bfloat16")
    folder = save(model, tmp_path / "bf16", tokenizer)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    reference = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    assert reference.dtype == torch.bfloat16
    batch = tokenizer(TEXTS)
    model.set_dtype(mx.float32)  # the same bfloat16 weights, compared in float32 on both sides
    np.testing.assert_allclose(np.array(model(**batch).logits), torch_output(reference.float(), batch), atol=1e-5)


def test_modernbert_config_is_written_back_in_its_own_spelling(checkpoint, tmp_path):
    """transformers-5 `rope_parameters` in: no contradicting legacy keys out."""
    model = mlx_encoders.load_model(checkpoint("modernbert", "masked-lm"))
    config = json.loads((save(model, tmp_path / "out") / "config.json").read_text())
    assert config["rope_parameters"]["full_attention"]["rope_theta"] == 1000.0
    assert not {"global_rope_theta", "local_rope_theta"} & set(config)  # the source has rope_parameters only
    assert transformers.AutoConfig.from_pretrained(tmp_path / "out").layer_types == model.args.attention_types


def test_task_never_drops_undeclared_encoder_layers(checkpoint, tmp_path):
    """A config that declares fewer layers than stored is broken whatever head is asked for; the stored
    head (and the pooler) may be dropped, an encoder layer may not."""
    folder = copy(checkpoint("bert", "masked-lm"), tmp_path)
    edit_config(folder, lambda c: c.update(num_hidden_layers=2))
    for kwargs in ({}, {"task": "encoder"}, {"task": "sequence-classification", "num_labels": 2}):
        with pytest.raises(ValueError, match="not used by .*bert.encoder.layer.2.attention"):
            mlx_encoders.load_model(folder, **kwargs)
    pooled = checkpoint("bert", "sequence-classification")
    assert type(mlx_encoders.load_model(pooled, task="masked-lm", num_labels=3)).__name__ == "BertForMaskedLM"


@pytest.mark.parametrize(
    "edit,message",
    [
        ({"layer_types": ["full_attention"]}, "config key 'layer_types' must list one of full_attention"),
        ({"classifier_pooling": "max"}, "config key 'classifier_pooling' must be 'cls' or 'mean', got 'max'"),
    ],
)
def test_modernbert_config_values_that_cannot_work(checkpoint, tmp_path, edit, message):
    folder = copy(checkpoint("modernbert"), tmp_path)
    edit_config(folder, lambda c: c.update(edit))
    with pytest.raises(ValueError, match=f"config.json: {message}"):
        mlx_encoders.load_model(folder)


def test_num_labels_alone_in_config_is_read_as_transformers_reads_it(checkpoint, tmp_path):
    folder = copy(checkpoint("bert", "sequence-classification"), tmp_path)
    edit_config(folder, lambda c: [c.pop("id2label"), c.pop("label2id"), c.update(num_labels=3)])
    assert mlx_encoders.load_model(folder).args.id2label == {0: "LABEL_0", 1: "LABEL_1", 2: "LABEL_2"}


def test_label_keywords_that_contradict_are_refused(checkpoint):
    source, task = checkpoint("bert"), "token-classification"
    with pytest.raises(ValueError, match="label2id gives several labels the same id"):
        mlx_encoders.load_model(source, task=task, label2id={"a": 0, "b": 0})
    with pytest.raises(ValueError, match="id2label .* and label2id .* disagree"):
        mlx_encoders.load_model(source, task=task, id2label={0: "a", 1: "b"}, label2id={"b": 0, "a": 1})
    with pytest.raises(ValueError, match="id2label must map integer label ids to names"):
        mlx_encoders.load_model(source, task=task, id2label={"first": "a"})

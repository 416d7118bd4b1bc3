"""Model-size presets: each one's parameter count equals transformers' model of the same config (built on torch's
meta device, which allocates nothing) and the published size; ours is built lazily, so no weights are allocated."""

import re
from pathlib import Path

import mlx.core as mx
import pytest
import torch
from checkpoints import AUTO_CLASSES, CONFIG_CLASSES
from mlx.utils import tree_flatten

from mlx_encoders.models import model_class, model_module, preset_config, presets

# Published sizes, in millions of parameters: the google-research/bert README and Turc et al. 2019 (BERT), OpenAI's
# GPT-2 release as counted on the hub, the albert-*-v2 model cards (rounded down), the ELECTRA paper's
# discriminators, ModernBERT's, nomic-embed-text-v1.5's, gte-multilingual-base's, EuroBERT's and Qwen3-Embedding's
# model cards, EmbeddingGemma's (308M with its two Dense layers, 4.7M of them).
PUBLISHED = {
    "bert-tiny": 4.4, "bert-mini": 11.3, "bert-small": 29.1, "bert-medium": 41.7, "bert-base": 110, "bert-large": 340,
    "gpt2-small": 124, "gpt2-medium": 355, "gpt2-large": 774, "gpt2-xl": 1558,
    "albert-base-v2": 11, "albert-large-v2": 17, "albert-xlarge-v2": 58, "albert-xxlarge-v2": 223,
    "electra-small": 14, "electra-base": 110, "electra-large": 335,
    "modernbert-base": 149, "modernbert-large": 395,
    "nomic_bert-v1.5": 137, "gte-multilingual-base": 305,
    "eurobert-210m": 210, "eurobert-610m": 610, "eurobert-2.1b": 2100, "gemma3_text-embeddinggemma-300m": 303,
    "qwen3-0.6b": 600, "qwen3-4b": 4000, "qwen3-8b": 8000,
}  # fmt: skip


def task_of(model_type: str) -> str:
    return "pretraining" if model_type == "electra" else "encoder"  # ELECTRA's published sizes: the discriminators


def test_every_preset_is_listed():
    assert set(presets()) == set(PUBLISHED) | {"gpt2-tiny"}


@pytest.mark.parametrize("name", list(presets()))
def test_parameter_count_matches_transformers_and_the_published_size(name):
    model_type, preset = presets()[name]
    args = model_module(model_type).ModelArgs.preset(preset)
    before = mx.get_active_memory()
    model = model_class(model_type, task_of(model_type))(args)
    ours = sum(p.size for _, p in tree_flatten(model.parameters()))
    assert mx.get_active_memory() - before < 2**20, "building the model allocated its weights"
    config = CONFIG_CLASSES[model_type](**args.to_config())
    with torch.device("meta"):
        reference = AUTO_CLASSES[task_of(model_type)].from_config(config)
    assert ours == sum(p.numel() for p in reference.parameters())
    if name in PUBLISHED:
        assert ours == pytest.approx(PUBLISHED[name] * 1e6, rel=0.07)  # the published figures are rounded to 2-3 digits


def test_docs_list_every_preset():
    """docs/training.md's table of model sizes names every preset `--config` takes, and no other."""
    page = (Path(__file__).parents[1] / "docs" / "training.md").read_text()
    table = page[page.index("| architecture | presets |") :].split("\n\n")[0]
    assert set(re.findall(r"`([^`]+)`", table)) == set(presets())


def test_preset_config_and_unknown_names():
    assert preset_config("bert-base")["num_hidden_layers"] == 12
    assert preset_config("gpt2-tiny") == {"model_type": "gpt2", "n_layer": 2, "n_embd": 128, "n_head": 2}
    with pytest.raises(ValueError, match="Unknown model preset 'bert-huge'; presets: bert-tiny"):
        preset_config("bert-huge")
    with pytest.raises(ValueError, match="roberta has no preset 'base'; presets: none"):
        model_module("roberta").ModelArgs.preset("base")


def test_cli_trains_from_scratch_at_a_preset_size(tmp_path):
    import transformers
    from checkpoints import MINILM

    from mlx_encoders.__main__ import main

    data = tmp_path / "docs.txt"
    data.write_text("The cat sat on the mat.\nIt looked at the bird.\n\nStocks fell in the morning.\n")
    out = tmp_path / "run"
    argv = ["train", "mlm", "--config", "bert-tiny", "--tokenizer", str(MINILM), "--data", str(data), "--output",
            str(out), "--max-steps", "1", "--max-length", "16"]  # fmt: skip
    assert main(argv) == 0
    reference = transformers.AutoModelForMaskedLM.from_pretrained(out / "model")
    config = reference.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (2, 128, 2)
    assert config.intermediate_size == 512 and config.vocab_size == 30522  # the tokenizer's vocabulary


def test_a_mistyped_preset_is_named_with_the_presets(tmp_path, capsys):
    from checkpoints import MINILM

    from mlx_encoders.__main__ import main

    data = tmp_path / "docs.txt"
    data.write_text("The cat sat on the mat.\n")
    argv = ["train", "mlm", "--config", "bert-tnny", "--tokenizer", str(MINILM), "--data", str(data), "--output",
            str(tmp_path / "run"), "--max-steps", "1"]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "'bert-tnny' is neither a JSON file of sizes nor a preset; presets: " in err and "bert-tiny" in err

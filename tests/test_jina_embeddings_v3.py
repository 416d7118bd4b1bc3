"""jina-embeddings-v3's task adapters against transformers with PEFT (`load_adapter` + `set_adapter`, as
transformers' own jina tests select them) and sentence-transformers: a tiny seeded checkpoint (tests/checkpoints.py)
with one PEFT LoRA adapter per task in a subfolder, as jinaai/jina-embeddings-v3-hf publishes them, adapting every
projection, the pooler and both embedding tables. The encoder and heads without adapters are covered by the registry
tests (test_parity, test_gradients, test_sentence, ...)."""

import copy
import json
import re
import shutil

import mlx.nn as nn
import numpy as np
import pytest
import torch
from checkpoints import load_reference, make_checkpoint
from mlx.utils import tree_flatten
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors import safe_open
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import Normalize, Transformer
from sentence_transformers.sentence_transformer.modules import Pooling
from test_contrastive import TRIPLETS, torch_mnrl_steps
from test_convert import MIN_COSINE, text_cosines
from test_gradients import encoder_loss, our_gradients
from test_index import IDS, write_corpus
from test_parity import as_torch, assert_close, check_parity
from test_serve import on_worker_thread

import mlx_encoders
from mlx_encoders import SentenceEncoder
from mlx_encoders.errors import OptionError
from mlx_encoders.index import Index, build, read_corpus
from mlx_encoders.serve.models import ServedModel
from mlx_encoders.train import fine_tune

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2", "dense", "word_embeddings", "token_type_embeddings"]
# Per task: PEFT options; rank_pattern and use_rslora change the scale, so a wrong one shows (and saving an rslora
# adapter with two ranks writes an alpha_pattern).
TASKS = {
    "retrieval_query": dict(r=4, lora_alpha=8),
    "retrieval_passage": dict(r=4, lora_alpha=8, rank_pattern={"fc1": 2}),
    "separation": dict(r=2, lora_alpha=4, use_rslora=True, rank_pattern={"o_proj": 3}),
    "classification": dict(r=4, lora_alpha=2),
    "text_matching": dict(r=3, lora_alpha=6),
}
TEXTS = ["", "word", "The quick brown fox jumps over the lazy dog.", " ".join(["A longer text to pad others."] * 6)]
# jina-embeddings-v3's config_sentence_transformers.json prompts (named by task)
PROMPTS = {
    "retrieval.query": "Represent the query for retrieving evidence documents: ",
    "retrieval.passage": "Represent the document for retrieval: ",
    "separation": "",
    "classification": "",
    "text-matching": "",
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The base checkpoint with one PEFT adapter per task subfolder, its B random (PEFT starts B at zero)."""
    folder = make_checkpoint(tmp_path_factory.mktemp("jina"), "jina_embeddings_v3")
    base = load_reference(folder, "encoder")
    for seed, (task, options) in enumerate(TASKS.items()):
        torch.manual_seed(seed)
        config = LoraConfig(target_modules=TARGETS, init_lora_weights=False, **options)
        get_peft_model(copy.deepcopy(base), config).save_pretrained(folder / task)
    return folder


def select_adapter(model, task: str) -> None:
    """transformers' `set_adapter` (which asks for peft >= 0.22): each PEFT layer's own `set_adapter`."""
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    assert layers
    for layer in layers:
        layer.set_adapter(task)


def reference(folder, task: str | None):
    """transformers' model of `folder` with the PEFT adapter of `task` loaded and selected (None: the base)."""
    model = load_reference(folder, "encoder")
    if task is not None:
        model.load_adapter(str(folder), adapter_name=task, adapter_kwargs={"subfolder": task})
        select_adapter(model, task)
    return model.eval()


def torch_outputs(model, batch: dict) -> dict:
    with torch.no_grad():
        out = model(**as_torch(batch))
    return {k: v.numpy() for k, v in out.items() if isinstance(v, torch.Tensor)}


def our_outputs(model, batch: dict) -> dict:
    out = model(**batch)
    return {k: np.array(v) for k in ("last_hidden_state", "pooler_output") if (v := getattr(out, k)) is not None}


@pytest.mark.parametrize("merge", [False, True])
def test_every_adapter_equals_transformers_with_peft(folder, merge):
    model, tokenizer = mlx_encoders.load(folder)
    assert sorted(model.adapters) == sorted(TASKS)
    batch = tokenizer(TEXTS, padding=True)
    real = np.array(batch["attention_mask"]).astype(bool)
    base = torch_outputs(reference(folder, None), batch)
    assert_close(our_outputs(model, batch), base, real, "encoder")
    for task in TASKS:
        expected = torch_outputs(reference(folder, task), batch)
        # the adapter moves the output well past the tolerance, so a skipped or mis-scaled one fails
        assert np.abs(expected["last_hidden_state"] - base["last_hidden_state"])[real].max() > 0.05
        model.set_adapter(task.replace("_", "."), merge=merge)  # jina's spelling: retrieval.query
        assert model.active_adapter == task
        assert_close(our_outputs(model, batch), expected, real, "encoder")
    model.set_adapter(None)
    assert_close(our_outputs(model, batch), base, real, "encoder")  # merged weights restored exactly


def test_mixed_lengths_equal_one_by_one_with_an_adapter(folder):
    model, tokenizer = mlx_encoders.load(folder)
    with model.adapter("retrieval.passage"):
        batch = tokenizer(TEXTS, padding=True)
        together = np.array(model(**batch).last_hidden_state)
        for i, text in enumerate(TEXTS):
            alone = np.array(model(**tokenizer([text])).last_hidden_state)[0]
            np.testing.assert_allclose(together[i, : len(alone)], alone, atol=1e-5, rtol=1e-5)
    assert model.active_adapter is None


def test_gradients_with_an_adapter_equal_transformers(folder):
    """The base weights' gradients through an active (unmerged) adapter, as PEFT's frozen-adapter forward gives."""
    model, tokenizer = mlx_encoders.load(folder)
    model.set_adapter("text-matching")
    batch = tokenizer(TEXTS[1:3], padding=True)
    rng = np.random.default_rng(0)
    real = np.array(batch["attention_mask"]).astype(np.float32)[..., None]
    projection = rng.standard_normal((*real.shape[:2], model.args.hidden_size)).astype(np.float32) * real

    ref = reference(folder, "text_matching")
    base = {n.replace(".base_layer", ""): p for n, p in ref.named_parameters() if "lora_" not in n}
    for p in base.values():
        p.requires_grad_(True)
    out = ref(**as_torch(batch))
    expected = encoder_loss(out.last_hidden_state, out.pooler_output, torch.from_numpy(projection))
    expected.backward()
    loss, grads = our_gradients(model, batch, {"projection": projection})
    # a sum of terms that cancel: its rounding follows the terms' magnitudes, not the small total
    terms = encoder_loss(out.last_hidden_state.abs(), out.pooler_output.abs(), torch.from_numpy(np.abs(projection)))
    assert abs(loss - expected.item()) <= 1e-5 * max(abs(expected.item()), terms.item())
    assert set(grads) == set(base)
    scale = max(float(p.grad.abs().max()) for p in base.values())
    for name, g in grads.items():
        err = float(np.abs(g - base[name].grad.numpy()).max())
        assert err <= 1e-4 * scale, f"{name}: max abs error {err:.3g} > 1e-4 x largest gradient {scale:.3g}"


def test_a_merged_adapter_saves_as_transformers_merge_and_unload(folder, tmp_path):
    model, tokenizer = mlx_encoders.load(folder)
    model.set_adapter("classification", merge=True)
    mlx_encoders.save(model, tmp_path / "merged", tokenizer)
    batch = tokenizer(TEXTS, padding=True)
    real = np.array(batch["attention_mask"]).astype(bool)
    merged = PeftModel.from_pretrained(load_reference(folder, "encoder"), folder / "classification").merge_and_unload()
    expected = torch_outputs(merged, batch)
    assert_close(torch_outputs(load_reference(tmp_path / "merged", "encoder"), batch), expected, real, "encoder")
    assert not any(p.name == "classification" for p in (tmp_path / "merged").iterdir())  # a plain checkpoint


@pytest.fixture(scope="module")
def st_folder(folder, tmp_path_factory):
    """jina's published layout: the checkpoint (with its adapter subfolders) at the root, mean pooling, Normalize,
    a prompt per task."""
    modules = [Transformer(str(folder), max_seq_length=64), Pooling(32, pooling_mode="mean"), Normalize()]
    st_folder = tmp_path_factory.mktemp("jina-st")
    SentenceTransformer(modules=modules, device="cpu", prompts=PROMPTS).save(str(st_folder))
    for task in TASKS:
        shutil.copytree(folder / task, st_folder / task)
    return st_folder


def test_save_writes_the_adapters_back_as_peft_folders(folder, tmp_path):
    """Each adapter (a rank_pattern one and an rslora one among them) reloads in transformers + PEFT and here."""
    model, tokenizer = mlx_encoders.load(folder)
    model.set_adapter("separation")  # an unmerged active adapter leaves the base weights as they are
    mlx_encoders.save(model, tmp_path / "saved", tokenizer)
    batch = tokenizer(TEXTS, padding=True)
    real = np.array(batch["attention_mask"]).astype(bool)
    reloaded, _ = mlx_encoders.load(tmp_path / "saved")
    assert sorted(reloaded.adapters) == sorted(TASKS)
    for task in ("retrieval_passage", "separation"):
        expected = torch_outputs(reference(folder, task), batch)
        assert_close(torch_outputs(reference(tmp_path / "saved", task), batch), expected, real, "encoder")
        reloaded.set_adapter(task)
        assert_close(our_outputs(reloaded, batch), expected, real, "encoder")
    mlx_encoders.save(reloaded, tmp_path / "saved", tokenizer, overwrite=True)  # its adapter folders are save's own
    assert sorted(mlx_encoders.load_model(tmp_path / "saved").adapters) == sorted(TASKS)
    (tmp_path / "saved" / "separation" / "notes.txt").write_text("mine")  # a folder with more is not
    with pytest.raises(FileExistsError, match=r"holds files that save\(\) does not write \(separation/\)"):
        mlx_encoders.save(reloaded, tmp_path / "saved", tokenizer, overwrite=True)


def test_sentence_encoder_selects_the_adapter_by_task_or_prompt_name(st_folder):
    """sentence-transformers with the adapter set is the oracle."""
    assert json.loads((st_folder / "config_sentence_transformers.json").read_text())["prompts"] == {
        **PROMPTS,
        "query": "",
        "document": "",
    }
    st = SentenceTransformer(str(st_folder), device="cpu")
    for task in TASKS:
        st.load_adapter(str(st_folder), adapter_name=task, adapter_kwargs={"subfolder": task})
    encoder = SentenceEncoder(st_folder)
    texts = TEXTS[1:]

    def expected(task: str, **kwargs):
        select_adapter(st, task)
        return st.encode(texts, convert_to_numpy=True, **kwargs)

    for task, prompt_name in (("retrieval_query", "retrieval.query"), ("text_matching", "text-matching")):
        theirs = expected(task, prompt_name=prompt_name)
        np.testing.assert_allclose(encoder.encode(texts, prompt_name=prompt_name), theirs, atol=1e-5)
        np.testing.assert_allclose(encoder.encode(texts, prompt_name=prompt_name, task=task), theirs, atol=1e-5)
    # the role's adapter with its task's prompt, as jina's own `encode(task=...)` prepends its task instruction
    query = expected("retrieval_query", prompt_name="retrieval.query")
    np.testing.assert_allclose(encoder.encode_query(texts), query, atol=1e-5)
    np.testing.assert_allclose(
        encoder.encode_document(texts, truncate_dim=16),
        expected("retrieval_passage", prompt_name="retrieval.passage", truncate_dim=16),
        atol=1e-5,
    )
    np.testing.assert_allclose(encoder.encode_query(texts, prompt_name="query"), expected("retrieval_query"), atol=1e-5)
    # a task the call names: its adapter with its own prompt, not the role's instruction
    matching = expected("text_matching", prompt_name="text-matching")
    np.testing.assert_allclose(encoder.encode_query(texts, task="text-matching"), matching, atol=1e-5)
    encoder.merge_adapters = True
    np.testing.assert_allclose(encoder.encode(texts, task="separation"), expected("separation"), atol=1e-5)
    assert encoder.model.active_adapter is None  # each call's adapter is for that call only
    with pytest.raises(ValueError, match="No task adapter 'summarization'.*retrieval_query"):
        encoder.encode(texts, task="summarization")


def test_threads_selecting_other_adapters_get_each_its_own(st_folder):
    """The active adapter is the model's state: calls from threads, each with its adapter (the first from a
    thread that did not load the model), equal the same calls alone, and leave none active."""
    from concurrent.futures import ThreadPoolExecutor

    encoder, texts = SentenceEncoder(st_folder), TEXTS[1:]
    calls = {"query": encoder.encode_query, "document": encoder.encode_document, "plain": encoder.encode}
    with ThreadPoolExecutor(3) as pool:
        together = [pool.submit(call, texts) for _ in range(3) for call in calls.values()]
        together = [f.result(timeout=300) for f in together]
    alone = [call(texts) for _ in range(3) for call in calls.values()]
    for got, expected in zip(together, alone, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert encoder.model.active_adapter is None


def test_an_adapter_block_on_an_application_thread_encodes_there(st_folder):
    """`with model.adapter(task): encode(...)` holds the adapter lock, which encode takes too: on an application's
    thread, encode stays on it rather than wait for itself on a thread the package keeps."""
    import threading

    encoder, got = SentenceEncoder(st_folder), []

    def in_block():
        with encoder.model.adapter("retrieval.query"):
            return encoder.encode(TEXTS[1:2])

    thread = threading.Thread(target=lambda: got.append(in_block()), daemon=True)  # a daemon: a wait cannot hang
    thread.start()
    thread.join(timeout=120)
    assert got, "encode in an adapter block on another thread waited for itself"
    np.testing.assert_allclose(got[0], in_block(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bits", [8, 4])
def test_converted_folder_keeps_its_adapters(folder, tmp_path, bits):
    """convert quantizes the base and copies the adapter subfolders, which then run over the quantized weights."""
    out = mlx_encoders.convert(folder, tmp_path / "q", bits=bits, group_size=32, calibration=False)
    model, tokenizer = mlx_encoders.load(out)
    assert any(isinstance(m, nn.QuantizedLinear) for m in model.modules())
    batch = tokenizer(TEXTS, padding=True)
    real = np.array(batch["attention_mask"]).astype(bool)
    model.set_adapter("retrieval.query")
    got = np.array(model(**batch).last_hidden_state) * real[..., None]
    expected = torch_outputs(reference(folder, "retrieval_query"), batch)["last_hidden_state"] * real[..., None]
    assert text_cosines(got, expected, real).min() > MIN_COSINE[bits]
    with pytest.raises(ValueError, match="quantized or wrapped; set_adapter\\(merge=False\\)"):
        model.set_adapter("retrieval.query", merge=True)


def test_served_and_indexed_with_the_query_and_document_adapters(st_folder, tmp_path):
    """The server's query and document inputs take encode_query's and encode_document's adapters, as does the
    index: its stored vectors are encode_document's, its query encode_query's."""
    encoder = SentenceEncoder(st_folder)
    served = ServedModel("jina", st_folder)
    texts = TEXTS[1:]
    for task, expected in (
        (None, encoder.encode(texts)),
        ("query", encoder.encode_query(texts)),
        ("document", encoder.encode_document(texts)),
    ):
        got = on_worker_thread(lambda task=task: served.compute(served.tokenize(texts, truncate=True, task=task)))
        np.testing.assert_allclose(got, expected, atol=1e-5)
    assert not np.allclose(encoder.encode_query(texts), encoder.encode(texts), atol=1e-3)

    corpus, index = write_corpus(tmp_path / "corpus"), tmp_path / "index"
    assert build(corpus, index, str(st_folder), quiet=True)["added"] == len(IDS)
    docs = encoder.encode_document([text for _, text in read_corpus(corpus)])
    scores = docs @ encoder.encode_query("Cats purr when they are content.")
    hits = Index(index).search("Cats purr when they are content.", k=3)
    np.testing.assert_allclose([h.score for h in hits], np.sort(scores)[::-1][:3], atol=1e-5)


def test_embedding_training_with_lora_runs_and_saves_a_sentence_transformers_folder(st_folder, tmp_path):
    triplets = [
        dict(anchor="how do cats sleep", positive="cats sleep curled up", negative="dogs bark at night"),
        dict(anchor="what is python", positive="python is a programming language", negative="a python is a snake"),
        dict(anchor="capital of france", positive="paris is the capital of france", negative="berlin is in germany"),
    ]
    trained = fine_tune(
        "embed", triplets * 2, tmp_path / "out", model=st_folder, loss="mnrl", max_steps=2, batch_size=3, lora_rank=2
    )
    assert (tmp_path / "out" / "adapters").is_dir()
    texts = ["how do cats sleep", "python"]
    expected = SentenceTransformer(str(trained.path), device="cpu").encode(texts, convert_to_numpy=True)
    np.testing.assert_allclose(SentenceEncoder(trained.path).encode(texts), expected, atol=1e-5)
    assert not np.allclose(SentenceEncoder(st_folder).encode(texts), expected, atol=1e-4)  # it trained
    # the task adapters travel with the trained weights into the folder saved
    source = mlx_encoders.load(st_folder)[0].adapter_tensors()
    kept = mlx_encoders.load(trained.path)[0].adapter_tensors()
    assert sorted(kept) == sorted(source) == sorted(TASKS)
    for task, low_ranks in source.items():
        for path, (a, b, scale, table) in low_ranks.items():
            a2, b2, scale2, table2 = kept[task][path]
            assert (scale, table) == (scale2, table2), (task, path)
            np.testing.assert_array_equal(np.array(a), np.array(a2))
            np.testing.assert_array_equal(np.array(b), np.array(b2))
    st = SentenceTransformer(str(trained.path), device="cpu")
    st.load_adapter(str(trained.path), adapter_name="retrieval_query", adapter_kwargs={"subfolder": "retrieval_query"})
    select_adapter(st, "retrieval_query")
    theirs = st.encode(texts, convert_to_numpy=True)
    np.testing.assert_allclose(SentenceEncoder(trained.path).encode(texts, task="retrieval_query"), theirs, atol=1e-5)


@pytest.mark.parametrize("head", ["masked-lm", "sequence-classification", "question-answering"])
def test_save_reloads_in_transformers_with_identical_logits(checkpoint, tmp_path, head):
    source = checkpoint("jina_embeddings_v3", head)
    model, tokenizer = mlx_encoders.load(source)
    mlx_encoders.save(model, tmp_path / "saved", tokenizer)
    batch = tokenizer(TEXTS, padding=True)
    expected, got = (torch_outputs(load_reference(f, head), batch) for f in (source, tmp_path / "saved"))
    assert expected.keys() == got.keys()
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


def legacy_rope(source, target, **spelling):
    """A copy of `source` whose config.json spells its rope as transformers 4 did (no `rope_parameters`)."""
    folder = shutil.copytree(source, target)
    config = json.loads((folder / "config.json").read_text())
    del config["rope_parameters"]
    (folder / "config.json").write_text(json.dumps({**config, **spelling}))
    return folder


def test_transformers_4_rope_theta_and_a_head_dim_match_transformers(checkpoint, tmp_path):
    """A top-level `rope_theta` is the rotary base, as transformers 5 reads it; `head_dim` sets the heads' width."""
    check_parity(legacy_rope(checkpoint("jina_embeddings_v3"), tmp_path / "legacy", rope_theta=7.0), "encoder")
    check_parity(checkpoint("jina_embeddings_v3", head_dim=16), "encoder")  # hidden 32 over 4 heads would be 8


def test_a_scaled_rope_is_refused_naming_its_key(checkpoint, tmp_path):
    folder = legacy_rope(
        checkpoint("jina_embeddings_v3"), tmp_path / "ckpt", rope_scaling={"type": "linear", "factor": 2}
    )
    with pytest.raises(ValueError, match="config key 'rope_scaling': jina_embeddings_v3 rope type 'linear' is not"):
        mlx_encoders.load_model(folder)


# jinaai/jina-embeddings-v3's own layout (its remote code, xlm-roberta-flash-implementation): our names -> its names,
# every key under `roberta.`, q/k/v stacked as `mixer.Wqkv`, and each Linear's and Embedding's weight a torch
# parametrization holding the task LoRAs.
REMOTE_NAMES = (
    ("embeddings.LayerNorm.", "emb_ln."),
    ("layers.", "encoder.layers."),
    ("self_attn.o_proj.", "mixer.out_proj."),
    ("post_attention_layernorm.", "norm1."),
    ("post_mlp_layernorm.", "norm2."),
)
REMOTE_TASKS = list(PROMPTS)  # config.json's lora_adaptations, in jina's order
REMOTE_RANK, REMOTE_ALPHA = 4, 2.0


def remote_layout(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A saved jina_embeddings_v3 checkpoint's keys as the remote code names them (no parametrizations yet):
    transformers saves the original names but for the `roberta.` of the remote code's XLMRobertaLoRA wrapper."""
    out = {}
    for key, value in weights.items():
        for ours, theirs in REMOTE_NAMES:
            key = key.replace(ours, theirs) if theirs not in key else key
        out[f"roberta.{key}"] = value
    assert any(".mixer.Wqkv." in key for key in out), "transformers saves q, k and v stacked"
    return out


def transformers_names(remote: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """The inverse of `remote_layout`, for transformers' model."""
    out = {}
    for key, value in remote.items():
        key = key.removeprefix("roberta.")
        for ours, theirs in REMOTE_NAMES:
            key = key.replace(theirs, ours)
        if ".mixer.Wqkv." in key:
            for p, part in zip(("q_proj", "k_proj", "v_proj"), np.split(value, 3), strict=True):
                out[key.replace("mixer.Wqkv", f"self_attn.{p}")] = torch.from_numpy(np.ascontiguousarray(part))
        else:
            out[key] = torch.from_numpy(value)
    return out


@pytest.fixture(scope="module")
def remote(checkpoint, tmp_path_factory):
    """The tiny checkpoint saved as jina's remote code saves it (keys and config.json), with seeded task LoRAs on
    every Linear and Embedding; and, per task, the weights that remote code computes with (W + scale B A for a
    Linear, W + scale A B for a table) in transformers' names."""
    from safetensors.numpy import load_file, save_file

    base = checkpoint("jina_embeddings_v3")
    config = json.loads((base / "config.json").read_text())
    plain = remote_layout(load_file(base / "model.safetensors"))
    rng, scale, n = np.random.default_rng(0), REMOTE_ALPHA / REMOTE_RANK, len(REMOTE_TASKS)
    stored, merged = {}, {task: {} for task in REMOTE_TASKS}
    for key, value in plain.items():
        module = key.removesuffix(".weight")
        if value.ndim != 2:
            stored[key] = value
            for task in REMOTE_TASKS:
                merged[task][key] = value
            continue
        rows, cols = value.shape
        table = module.endswith("_embeddings")  # (vocab, H): A (vocab, r), B (r, H); a Linear's A (r, in), B (out, r)
        a_shape, b_shape = (
            ((rows, REMOTE_RANK), (REMOTE_RANK, cols)) if table else ((REMOTE_RANK, cols), (rows, REMOTE_RANK))
        )
        a = (0.3 * rng.standard_normal((n, *a_shape))).astype(np.float32)
        b = (0.3 * rng.standard_normal((n, *b_shape))).astype(np.float32)
        stored[f"{module}.parametrizations.weight.original"] = value
        stored[f"{module}.parametrizations.weight.0.lora_A"], stored[f"{module}.parametrizations.weight.0.lora_B"] = (
            a,
            b,
        )
        for t, task in enumerate(REMOTE_TASKS):
            merged[task][key] = value + scale * (a[t] @ b[t] if table else b[t] @ a[t])
    folder = tmp_path_factory.mktemp("jina-remote")
    for file in base.iterdir():
        if file.name not in ("config.json", "model.safetensors"):
            shutil.copy(file, folder / file.name)
    save_file(stored, folder / "model.safetensors", metadata={"format": "pt"})
    rope = config.pop("rope_parameters")
    config.update(
        model_type="xlm-roberta", architectures=["XLMRobertaModel"], position_embedding_type="rotary",
        rotary_emb_base=rope["rope_theta"], lora_adaptations=REMOTE_TASKS, task_instructions=PROMPTS,
        lora_rank=REMOTE_RANK, lora_alpha=REMOTE_ALPHA, lora_dropout_p=0.0, lora_main_params_trainable=False,
        load_trained_adapters=True, use_flash_attn=True, emb_pooler=None, matryoshka_dimensions=[8, 16, 32],
        auto_map={"AutoModel": "jinaai/xlm-roberta-flash-implementation--modeling_lora.XLMRobertaLoRA"},
    )  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return folder, base, {task: transformers_names(w) for task, w in merged.items()}


def test_remote_code_layout_loads_with_its_task_adapters(remote):
    """Without a task: our load of the transformers-layout folder; with one: transformers holding the weights jina's
    remote code adapts that task's forward pass with."""
    folder, base, merged = remote
    model, tokenizer = mlx_encoders.load(folder)
    assert type(model).__name__ == "JinaEmbeddingsV3Model" and model.args.rope_theta == 500.0
    assert model.adapters == [task.replace(".", "_").replace("-", "_") for task in REMOTE_TASKS]
    batch = tokenizer(TEXTS, padding=True)
    real = np.array(batch["attention_mask"]).astype(bool)
    plain = our_outputs(mlx_encoders.load(base)[0], batch)
    for name, value in our_outputs(model, batch).items():
        np.testing.assert_array_equal(value, plain[name], err_msg=name)
    reference = load_reference(base, "encoder")
    for task in REMOTE_TASKS:
        reference.load_state_dict(merged[task])
        expected = torch_outputs(reference, batch)
        # each task moves the output well past the tolerance, so a skipped or mis-scaled LoRA fails
        assert np.abs(expected["last_hidden_state"] - plain["last_hidden_state"])[real].max() > 0.05
        for merge in (False, True):
            with model.adapter(task, merge=merge):
                assert_close(our_outputs(model, batch), expected, real, "encoder")


def test_remote_code_layout_errors_name_the_key(remote, tmp_path):
    folder, _, _ = remote
    shutil.copytree(folder, tmp_path / "no-tasks")
    config = json.loads((folder / "config.json").read_text())
    del config["lora_adaptations"]
    (tmp_path / "no-tasks" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="config.json has no 'lora_adaptations' list"):
        mlx_encoders.load(tmp_path / "no-tasks")


@pytest.fixture(scope="module")
def published(remote, tmp_path_factory):
    """jinaai/jina-embeddings-v3 as its authors publish it for sentence-transformers: the remote-code checkpoint at
    the root read by their own module type (`custom_st.Transformer`, with a `task` keyword), mean pooling,
    Normalize, and a prompt per task (named as the tasks are)."""
    folder, _, merged = remote
    published = tmp_path_factory.mktemp("jina-published")
    shutil.copytree(folder, published, dirs_exist_ok=True)
    modules = [
        {"idx": 0, "name": "transformer", "path": "", "type": "custom_st.Transformer", "kwargs": ["task"]},
        {"idx": 1, "name": "pooler", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "normalizer", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (published / "modules.json").write_text(json.dumps(modules))
    (published / "custom_st.py").write_text("class Transformer:  # their remote code: never run here\n    pass\n")
    (published / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 8194, "do_lower_case": False, "model_args": {"trust_remote_code": True}})
    )
    (published / "1_Pooling").mkdir()
    (published / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False})
    )
    (published / "2_Normalize").mkdir()
    (published / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": PROMPTS, "default_prompt_name": None, "similarity_fn_name": "cosine"})
    )
    return published, merged


def mean_normalized(reference, tokenizer, texts: list[str]) -> np.ndarray:
    """What their modules compute after the Transformer: the mean over real tokens (prompt included), L2-normalized."""
    batch = tokenizer(texts, padding=True)
    hidden = torch_outputs(reference, batch)["last_hidden_state"]
    mask = np.array(batch["attention_mask"], dtype=np.float32)[..., None]
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    return pooled / np.linalg.norm(pooled, axis=-1, keepdims=True)


def test_published_sentence_transformers_folder_selects_the_task_adapter(published, remote):
    """Their custom_st.Transformer with `task` = transformers holding that task's adapted weights, then their
    pooling, normalization and the task's prompt; without a task, the base model (as custom_st does without one)."""
    folder, merged = published
    _, base, _ = remote
    encoder = SentenceEncoder(folder)
    _, tokenizer = mlx_encoders.load(base)
    reference = load_reference(base, "encoder")
    texts = [*TEXTS[1:3], "A longer text to pad others, " * 2]  # within the tiny model's 130 positions
    np.testing.assert_allclose(encoder.encode(texts), mean_normalized(reference, tokenizer, texts), atol=1e-5)
    for task in ("retrieval.query", "retrieval.passage", "text-matching"):
        reference.load_state_dict(merged[task])
        expected = mean_normalized(reference, tokenizer, [PROMPTS[task] + t for t in texts])
        np.testing.assert_allclose(encoder.encode(texts, task=task, prompt_name=task), expected, atol=1e-5)
        if task == "retrieval.query":
            np.testing.assert_allclose(encoder.encode_query(texts), expected, atol=1e-5)
        if task == "retrieval.passage":
            np.testing.assert_allclose(encoder.encode_document(texts), expected, atol=1e-5)
    with pytest.raises(ValueError, match="No task adapter 'summarization'"):
        encoder.encode(texts, task="summarization")


def peft_adapter(folder, task: str) -> dict[str, np.ndarray]:
    """The tensors of the PEFT adapter folder `folder / task`, by name."""
    with safe_open(str(folder / task / "adapter_model.safetensors"), "np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_training_a_task_adapter_equals_a_torch_loop_training_that_peft_adapter(st_folder, tmp_path):
    """`task_adapter` trains one adapter's A and B over the frozen base, as sentence-transformers with PEFT's adapter
    loaded trainable and selected: the same losses for 8 AdamW steps, the same A and B written back; the base and the
    other adapters are untouched. Without dropout, whose masks torch draws otherwise."""
    st_folder = shutil.copytree(st_folder, tmp_path / "st")
    config = json.loads((st_folder / "config.json").read_text())
    config.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (st_folder / "config.json").write_text(json.dumps(config))
    rows = TRIPLETS * 2
    steps, options = 8, dict(loss="mnrl", batch_size=4, lr=1e-3, warmup_steps=2, max_grad_norm=1.0, seed=5)
    trained = fine_tune(
        "embed", rows, tmp_path / "out", model=st_folder, task_adapter="retrieval.passage", max_steps=steps, **options
    )
    losses = [json.loads(line)["loss"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    model = SentenceTransformer(str(st_folder), device="cpu").train()
    model.load_adapter(
        str(st_folder), adapter_name="retrieval_passage", adapter_kwargs={"subfolder": "retrieval_passage"},
        is_trainable=True,
    )  # fmt: skip
    select_adapter(model, "retrieval_passage")
    named = dict(model[0].auto_model.named_parameters())
    for name, p in named.items():
        p.requires_grad_("lora_" in name and ".retrieval_passage" in name)
    params = [p for p in named.values() if p.requires_grad]
    assert len(params) == len(peft_adapter(st_folder, "retrieval_passage"))
    expected = torch_mnrl_steps(model, params, rows, seed=5, steps=steps, lr=1e-3, warmup=2)
    np.testing.assert_allclose(losses, expected, rtol=2e-5)

    saved, theirs = peft_adapter(trained.path, "retrieval_passage"), peft_adapter(st_folder, "retrieval_passage")
    assert saved.keys() == theirs.keys()
    for key in saved:  # PEFT's "...lora_A.weight" is "...lora_A.retrieval_passage.weight" once loaded by name
        name = key.removeprefix("base_model.model.").replace(".weight", ".retrieval_passage.weight")
        name = re.sub(r"(lora_embedding_[AB])$", r"\1.retrieval_passage", name)
        trained_value = named[name].detach().numpy()
        assert np.allclose(trained_value, theirs[key]) == key.startswith("base_model.model.pooler."), key  # unused
        np.testing.assert_allclose(saved[key], trained_value, rtol=2e-4, atol=2e-5 * np.abs(trained_value).max())
    for task in set(TASKS) - {"retrieval_passage"}:
        for key, value in peft_adapter(trained.path, task).items():
            np.testing.assert_array_equal(value, peft_adapter(st_folder, task)[key])
    base = dict(tree_flatten(mlx_encoders.load(st_folder)[0].parameters()))
    for name, value in tree_flatten(mlx_encoders.load(trained.path)[0].parameters()):
        np.testing.assert_array_equal(np.array(value), np.array(base[name]), err_msg=name)
    # the trained folder encodes as sentence-transformers with the trained adapter (torch's, from the loop above)
    model.eval()
    texts = ["how do cats sleep", "python"]
    np.testing.assert_allclose(
        SentenceEncoder(trained.path).encode_document(texts, prompt_name="document"),
        model.encode(texts, convert_to_numpy=True),
        atol=1e-5,
    )


def test_task_adapter_run_resumes_exactly_and_refuses_what_it_cannot_train(st_folder, folder, tmp_path):
    options = dict(model=st_folder, loss="mnrl", batch_size=3, max_steps=4, save_every=2, task_adapter="separation")
    whole = peft_adapter(fine_tune("embed", TRIPLETS, tmp_path / "a", **options).path, "separation")
    assert (tmp_path / "a" / "checkpoint-2" / "separation" / "adapter_config.json").is_file()
    assert not (tmp_path / "a" / "checkpoint-2" / "model.safetensors").exists()  # the frozen base is not copied
    resumed = fine_tune("embed", TRIPLETS, tmp_path / "a", resume=tmp_path / "a" / "checkpoint-2", **options)
    assert whole.keys() == peft_adapter(resumed.path, "separation").keys()
    for name, value in peft_adapter(resumed.path, "separation").items():
        np.testing.assert_array_equal(value, whole[name], err_msg=name)
    with pytest.raises(ValueError, match="holds no text_matching/adapter_config.json"):
        fine_tune("embed", TRIPLETS, tmp_path / "a", resume=tmp_path / "a" / "checkpoint-2",
                  **{**options, "task_adapter": "text-matching"})  # fmt: skip
    with pytest.raises(ValueError, match="No task adapter 'summarization'.*retrieval_query"):
        fine_tune("embed", TRIPLETS, tmp_path / "b", **{**options, "task_adapter": "summarization"})
    with pytest.raises(OptionError, match="lora_rank adds a new one"):
        fine_tune("embed", TRIPLETS, tmp_path / "c", lora_rank=2, **options)
    with pytest.raises(OptionError, match="task_adapter .*is for sentence-embedding"):
        fine_tune("classify", [dict(text="a", label=0)], tmp_path / "d", model=folder, task_adapter="separation")
    bert = make_checkpoint(tmp_path / "bert", "bert", num_hidden_layers=1)
    with pytest.raises(ValueError, match="a bert model has no task adapters"):
        fine_tune("embed", TRIPLETS, tmp_path / "e", **{**options, "model": bert})


def test_converted_remote_code_layout_keeps_its_task_adapters(published, tmp_path):
    """The authors' layout keeps the task LoRAs inside model.safetensors: convert writes them as PEFT folders, so
    encode_query still runs the query adapter (it ran the bare model, silently)."""
    from mlx_encoders import SentenceEncoder

    folder, _ = published
    source = SentenceEncoder(folder)
    out = mlx_encoders.convert(folder, tmp_path / "float", dtype="float32")
    converted = SentenceEncoder(out)
    assert sorted(converted.model.adapters) == sorted(source.model.adapters)
    np.testing.assert_allclose(converted.encode_query(TEXTS), source.encode_query(TEXTS), atol=1e-6)

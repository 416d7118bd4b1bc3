"""Registry: config.json `model_type` -> model module, and task names -> head classes.

`MODEL_TYPES` are the encoders, decoders used as encoders among them (Qwen3: causal attention, no generation);
`DECODER_TYPES` the generative causal language models (GPT-2, task "causal-lm", with a key/value cache);
`EMBEDDER_TYPES` the decoder-shaped text embedders (Gemma 3, EmbeddingGemma 2). "encoder" is the task name of every
bare model, encoder or decoder.

Each module exposes `ModelArgs` (a dataclass of config.json names), `MODELS` (task -> class) and
`TOKEN_TYPES` (whether the architecture reads token_type_ids: a bool, or a function of the args); optionally
`sanitize(weights)`, which fixes the keys or layouts of a checkpoint's tensors before they are fitted to the model,
and `init_std(path, args)`, the standard deviation (and truncation) transformers initialises a new module with. A
head class may define `layout_from_weights(config, keys) -> config`, for a layout config.json may leave unsaid
(DeBERTa's `legacy`).
"""

import importlib
from types import ModuleType

MODEL_TYPES = {
    "bert": "bert",
    "roberta": "roberta",
    "xlm-roberta": "roberta",
    "distilbert": "distilbert",
    "albert": "albert",
    "modernbert": "modernbert",
    "mpnet": "mpnet",
    "electra": "electra",
    "deberta-v2": "deberta_v2",
    "deberta": "deberta",
    "nomic_bert": "nomic_bert",
    "gte": "gte",
    "eurobert": "eurobert",
    "qwen3": "qwen3",  # a decoder used as an encoder (Qwen3-Embedding); its causal-LM head scores Qwen3-Reranker
    "jina_embeddings_v3": "jina_embeddings_v3",
}
# Causal language models, kept apart so the encoder tests, which parametrize over MODEL_TYPES, stay encoder-only
# (tests/test_gpt2.py is GPT-2's parity test).
DECODER_TYPES = {"gpt2": "gpt2"}
# Decoder-shaped embedders (RoPE, RMSNorm, grouped-query attention), whose transformers heads are not BERT's set:
# kept apart for the same reason; tests/test_<model_type>.py is each one's parity test.
EMBEDDER_TYPES = {
    "gemma3_text": "gemma3_text",
    "embedding_gemma2": "embedding_gemma2",
    "embedding_gemma2_text": "embedding_gemma2_text",
}
ALL_TYPES = {**MODEL_TYPES, **DECODER_TYPES, **EMBEDDER_TYPES}

# transformers class names are <prefix><suffix>: the prefix names the architecture, the suffix the head.
ARCHITECTURE_PREFIXES = {
    "bert": "Bert",
    "roberta": "Roberta",
    "xlm-roberta": "XLMRoberta",
    "distilbert": "DistilBert",
    "albert": "Albert",
    "modernbert": "ModernBert",
    "mpnet": "MPNet",
    "electra": "Electra",
    "deberta-v2": "DebertaV2",
    "deberta": "Deberta",
    "nomic_bert": "NomicBert",
    "gte": "Gte",
    "eurobert": "EuroBert",
    "jina_embeddings_v3": "JinaEmbeddingsV3",
    "gpt2": "GPT2",
    "qwen3": "Qwen3",
    "gemma3_text": "Gemma3Text",
    "embedding_gemma2": "EmbeddingGemma2",
    "embedding_gemma2_text": "EmbeddingGemma2Text",
}
ARCHITECTURE_SUFFIXES = {
    "Model": "encoder",
    "ForMaskedLM": "masked-lm",
    "ForSequenceClassification": "sequence-classification",
    "ForTokenClassification": "token-classification",
    "ForQuestionAnswering": "question-answering",
    "ForPreTraining": "pretraining",
    "ForCausalLM": "causal-lm",
    "LMHeadModel": "causal-lm",
}
# Heads whose transformers name is not the first suffix of their task.
OLD_SUFFIXES = {("gpt2", "causal-lm"): "LMHeadModel"}
# Heads whose transformers name does not start with their architecture's prefix.
OTHER_NAMES = {("gemma3_text", "causal-lm"): "Gemma3ForCausalLM"}
TASKS = tuple(dict.fromkeys(ARCHITECTURE_SUFFIXES.values()))


def native_config(config: dict) -> dict:
    """config.json in the names of the module that runs it: jina-embeddings-v3's remote-code config (model_type
    xlm-roberta with rotary positions) becomes a jina_embeddings_v3 one; any other comes back as it is."""
    jina = importlib.import_module(f"{__name__}.jina_embeddings_v3")
    return jina.from_remote_config(config) if jina.is_remote_config(config) else config


# Model types of remote-code folders that a supported module reads once config.json names it.
RENAMED_TYPES = {"new": "gte"}  # Alibaba's gte-multilingual and gte-*-en-v1.5


def model_module(model_type: str) -> ModuleType:
    if model_type not in ALL_TYPES:
        hint = (
            f' (a remote-code folder of that kind loads as {RENAMED_TYPES[model_type]!r}: set "model_type": '
            f'"{RENAMED_TYPES[model_type]}" in its config.json)'
            if model_type in RENAMED_TYPES
            else ""
        )
        raise ValueError(
            f"Unsupported model_type {model_type!r} in config.json{hint}; supported: {', '.join(ALL_TYPES)}"
        )
    return importlib.import_module(f"{__name__}.{ALL_TYPES[model_type]}")


def reads_token_types(args) -> bool:
    """Whether a model of `args` reads token_type_ids (its module's `TOKEN_TYPES`, which may depend on the config)."""
    flag = model_module(args.model_type).TOKEN_TYPES
    return flag(args) if callable(flag) else flag


def task_of_architecture(architecture: str) -> str:
    """'BertForMaskedLM' -> 'masked-lm'. A name that is not a known prefix + a head that architecture has fails,
    naming it ('BertLMHeadModel': BERT has no causal-LM head here; 'GPT2DoubleHeadsModel': no such head)."""
    for (_, task), name in OTHER_NAMES.items():
        if architecture == name:
            return task
    for model_type, prefix in ARCHITECTURE_PREFIXES.items():
        for suffix, task in ARCHITECTURE_SUFFIXES.items():
            if architecture == prefix + suffix and task in model_module(model_type).MODELS:
                return task
    known = ", ".join(architecture_name("bert", task) for task in model_module("bert").MODELS)
    raise ValueError(
        f"Unsupported architecture {architecture!r} in config.json: not one of the heads mlx_encoders implements "
        f"(for BERT: {known}; likewise for {', '.join(p for p in ARCHITECTURE_PREFIXES.values() if p != 'Bert')}). "
        "Pass task='encoder' (or another task) to load its encoder or another head."
    )


def architecture_name(model_type: str, task: str) -> str:
    """The transformers class name of a head: ('xlm-roberta', 'masked-lm') -> 'XLMRobertaForMaskedLM'."""
    if (model_type, task) in OTHER_NAMES:
        return OTHER_NAMES[model_type, task]
    suffix = OLD_SUFFIXES.get((model_type, task)) or next(s for s, t in ARCHITECTURE_SUFFIXES.items() if t == task)
    return ARCHITECTURE_PREFIXES[model_type] + suffix


def task_of_model(model) -> str:
    """The task name of a model instance's class ('encoder' for BertModel, ...)."""
    module = model_module(model.args.model_type)
    for exact in (True, False):
        for task, cls in module.MODELS.items():
            if type(model) is cls if exact else isinstance(model, cls):
                return task
    raise ValueError(f"{type(model).__name__} is not a {model.args.model_type} model class of mlx_encoders")


def model_class(model_type: str, task: str) -> type:
    module = model_module(model_type)
    if task not in module.MODELS:
        raise ValueError(f"{model_type} has no {task!r} model; available tasks: {', '.join(module.MODELS)}")
    return module.MODELS[task]


def presets() -> dict[str, tuple[str, str]]:
    """Every published size by its `<model_type>-<preset>` name ('bert-base', 'gpt2-xl', 'albert-large-v2', ...):
    (model_type, the preset's name in that architecture's `ModelArgs.presets`)."""
    return {
        f"{t}-{name}": (t, name) for t in ALL_TYPES for name in model_module(t).ModelArgs.__dict__.get("presets", {})
    }


def preset_config(name: str) -> dict:
    """config.json keys of a published size, by its `presets()` name."""
    if name not in presets():
        raise ValueError(f"Unknown model preset {name!r}; presets: {', '.join(presets())}")
    model_type, preset = presets()[name]
    return {"model_type": model_type, **model_module(model_type).ModelArgs.presets[preset]}

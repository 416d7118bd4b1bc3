"""Registry: config.json `model_type` -> model module, and task names -> head classes.

Each module exposes `ModelArgs` (a dataclass of config.json names), `MODELS` (task -> class) and
`TOKEN_TYPES` (whether the architecture reads token_type_ids).
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
}

# transformers class-name suffix -> task name; the prefix names the architecture.
ARCHITECTURE_SUFFIXES = {
    "Model": "encoder",
    "ForMaskedLM": "masked-lm",
    "ForSequenceClassification": "sequence-classification",
    "ForTokenClassification": "token-classification",
    "ForQuestionAnswering": "question-answering",
    "ForPreTraining": "pretraining",
}
TASKS = tuple(ARCHITECTURE_SUFFIXES.values())


def model_module(model_type: str) -> ModuleType:
    if model_type not in MODEL_TYPES:
        raise ValueError(f"Unsupported model_type {model_type!r} in config.json; supported: {', '.join(MODEL_TYPES)}")
    return importlib.import_module(f"{__name__}.{MODEL_TYPES[model_type]}")


def task_of_architecture(architecture: str) -> str:
    """'BertForMaskedLM' -> 'masked-lm'; the longest matching suffix wins ('Model' matches last)."""
    for suffix, task in sorted(ARCHITECTURE_SUFFIXES.items(), key=lambda item: -len(item[0])):
        if architecture.endswith(suffix):
            return task
    raise ValueError(
        f"Unsupported architecture {architecture!r}; supported heads end in: {', '.join(ARCHITECTURE_SUFFIXES)}"
    )


def model_class(model_type: str, task: str) -> type:
    module = model_module(model_type)
    if task not in module.MODELS:
        raise ValueError(f"{model_type} has no {task!r} model; available tasks: {', '.join(module.MODELS)}")
    return module.MODELS[task]

"""sentence-transformers folders, read and written here alone: modules.json and each module kind's files,
config_sentence_transformers.json (model type, prompts, default prompt name, similarity function, ...) and the
Transformer's sentence_bert_config.json (max_seq_length, do_lower_case, ...).

Follows the layout sentence-transformers 6 saves and loads (base/model.py, base/modules/, and each model kind's
modules/). A module kind is the last part of its modules.json type ("...modules.dense.Dense" -> "Dense");
`KINDS` holds, per kind, the type written for it and the reader of its files: adding a kind is one entry there.
"""

import ast
import json
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from tokenizers import normalizers

from ..chat_template import ChatTemplate, read_chat_template
from ..checkpoint import Checkpoint, inside, read_json_object, read_safetensors
from ..checkpoint import read_modules as read_module_entries
from ..checkpoint.files import COLBERT_LAYOUT, MODULES_FILE, SENTENCE_CONFIG_FILE, SETTINGS_FILE
from ..tokenizer import token_limit
from .pooling import parse_modes

ROUTER_FILE = "router_config.json"
ST = "sentence_transformers."
TRANSFORMERS = ("Transformer", "MLMTransformer")  # MLMTransformer: sentence-transformers 5's fill-mask one
# torch activation class (as sentence-transformers saves it in a Dense config.json) -> MLX function
DENSE_ACTIVATIONS = {
    "Identity": lambda x: x,
    "Tanh": mx.tanh,
    "GELU": nn.gelu,
    "ReLU": nn.relu,
    "SiLU": nn.silu,
    "Sigmoid": mx.sigmoid,
    # torch's defaults (a saved activation is its class alone): LeakyReLU's slope 0.01, ELU's alpha 1
    "LeakyReLU": nn.leaky_relu,
    "ELU": nn.elu,
    "Softplus": nn.softplus,
    "Mish": nn.mish,
    "Softmax": lambda x: mx.softmax(x, axis=-1),  # torch's implicit dimension for (N, C): the last
}
IDENTITY = "torch.nn.modules.linear.Identity"
TANH = "torch.nn.modules.activation.Tanh"  # sentence-transformers' Dense default, when its config names none
# Old Pooling configs store one boolean per mode; when several are on, their concatenation follows this order.
LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
SPLADE_STRATEGIES = ("max", "sum")
SPLADE_ACTIVATIONS = ("relu", "log1p_relu")


def write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


# ----- each module kind's files -----


@dataclass
class Dense:
    """sentence-transformers' `Dense`: activation(x W^T + b), plus x (or x R^T) when `use_residual`."""

    linear: nn.Linear
    activation: Callable
    residual: nn.Linear | None = None
    use_residual: bool = False
    config: dict = field(default_factory=dict)

    def __call__(self, x: mx.array) -> mx.array:
        out = self.activation(self.linear(x))
        if self.use_residual:
            out = out + (self.residual(x) if self.residual is not None else x)
        return out


def dense_activation(path: str | None, source: Path) -> Callable:
    """The MLX function of a torch activation saved as a dotted path (`Identity` for None)."""
    name = (path or IDENTITY).rsplit(".", 1)[-1]
    if name not in DENSE_ACTIVATIONS:
        raise ValueError(
            f"{source}: activation function {path!r} is not supported; supported torch activations: "
            f"{', '.join(DENSE_ACTIVATIONS)}"
        )
    return DENSE_ACTIVATIONS[name]


def read_dense(folder: Path) -> Dense:
    if not (folder / "config.json").exists():
        raise FileNotFoundError(
            f"modules.json lists a Dense module at {folder}, but it has no config.json (converters such as "
            "mlx-embeddings leave such folders out). Copy the folder from the original sentence-transformers model: "
            "without its projection the embeddings would be wrong."
        )
    source = folder / "config.json"
    config = read_json_object(source)
    activation = dense_activation(config.get("activation_function", TANH), source)
    sizes = [config.get(key) for key in ("in_features", "out_features")]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes):
        raise ValueError(f"{source}: a Dense module's config needs in_features and out_features (positive integers)")
    file = folder / "model.safetensors"
    if not file.exists():
        raise FileNotFoundError(
            f"No model.safetensors in {folder} (pickle weights are not read). Re-save the model with "
            "sentence-transformers >= 3 (`SentenceTransformer(path).save(path)`), which writes safetensors."
        )
    # sentence-transformers loads a Dense into a float32 torch Linear whatever dtype its file holds
    weights = {k: v.astype(mx.float32) for k, v in read_safetensors(file).items()}
    mx.eval(weights)  # loaded now: an array left lazy belongs to this thread's stream, and others cannot run it
    bias = config.get("bias", True)
    expected = {"linear.weight": (sizes[1], sizes[0])} | ({"linear.bias": (sizes[1],)} if bias else {})
    expected |= {"residual.weight": (sizes[1], sizes[0])} if "residual.weight" in weights else {}
    found = {k: tuple(v.shape) for k, v in weights.items()}
    if found != expected:
        raise ValueError(
            f"{file}: the Dense weights {found} do not match {source} (in_features {sizes[0]}, out_features "
            f"{sizes[1]}, bias {bias}): {expected}. The folder's files belong to different models; copy the module "
            "from the original sentence-transformers model"
        )
    linear = nn.Linear(*sizes, bias=bias)
    residual = None
    if "residual.weight" in weights:
        residual = nn.Linear(*sizes, bias=False)
        residual.load_weights([("weight", weights.pop("residual.weight"))])
    linear.load_weights([(k.removeprefix("linear."), v) for k, v in weights.items()])
    return Dense(linear, activation, residual, bool(config.get("use_residual", False)), config)


def write_dense(folder: Path, linear: nn.Linear, config: dict) -> None:
    """A Dense module's folder: its config.json and model.safetensors (keys `linear.*`, as torch saves them)."""
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "config.json", config)
    weights = {f"linear.{k}": v for k, v in tree_flatten(linear.parameters())}
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "pt"})


@dataclass(frozen=True)
class Pooling:
    """A Pooling module's modes and whether it pools the prompt's tokens."""

    modes: tuple[str, ...]
    include_prompt: bool = True


def read_pooling(folder: Path) -> Pooling | None:
    """A `1_Pooling/config.json`, new or old style; None when the folder lacks it (mlx-embeddings leaves it out)."""
    file = folder / "config.json"
    if not file.exists():
        return None
    config = read_json_object(file)
    if "pooling_mode" in config:
        modes = config["pooling_mode"]
    else:
        modes = [mode for key, mode in LEGACY_POOLING_KEYS.items() if config.get(key)] or ["mean"]
    try:
        return Pooling(parse_modes(modes), bool(config.get("include_prompt", True)))
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from e


def pooling_config(pooling: Pooling, width: int) -> dict:
    """A Pooling module's config.json for token vectors of `width` (sentence-transformers multiplies it by the
    modes' count itself)."""
    modes = pooling.modes[0] if len(pooling.modes) == 1 else list(pooling.modes)
    return {"embedding_dimension": width, "include_prompt": pooling.include_prompt,
            "pooling_mode": modes}  # fmt: skip


@dataclass(frozen=True)
class SpladePooling:
    """log(1 + relu(masked-LM logits)), log1p once more for "log1p_relu", then max or sum over the tokens."""

    strategy: str = "max"
    activation: str = "relu"

    def config(self) -> dict:
        return {"pooling_strategy": self.strategy, "activation_function": self.activation, "embedding_dimension": None}


def read_splade_pooling(folder: Path) -> SpladePooling:
    config = read_json_object(folder / "config.json")
    pooling = SpladePooling(config.get("pooling_strategy", "max"), config.get("activation_function", "relu"))
    if pooling.strategy not in SPLADE_STRATEGIES or pooling.activation not in SPLADE_ACTIVATIONS:
        raise ValueError(
            f"{folder / 'config.json'}: pooling_strategy must be one of {SPLADE_STRATEGIES} and "
            f"activation_function one of {SPLADE_ACTIVATIONS}; got {pooling.strategy!r}, {pooling.activation!r}"
        )
    return pooling


def read_static_embedding(folder: Path) -> np.ndarray:
    """A `SparseStaticEmbedding`'s (vocab_size,) float32 weights."""
    file = folder / "model.safetensors"
    if not file.exists():
        raise FileNotFoundError(f"No model.safetensors in {folder}: SparseStaticEmbedding needs its weights")
    weights = read_safetensors(file)
    mx.eval(weights)  # as read_dense
    if "weight" not in weights or weights["weight"].ndim != 1:
        raise ValueError(f"{file} must hold a (vocab_size,) tensor 'weight'; found {sorted(weights)}")
    return np.array(weights["weight"].astype(mx.float32))


@dataclass
class AutoEncoder:
    """A `SparseAutoEncoder`'s float32 weights: (hidden_dim, input_dim) `weight`, `pre_bias`, `latent_bias`."""

    weight: mx.array
    pre_bias: mx.array
    latent_bias: mx.array
    k: int
    normalize: bool
    source: Path

    @property
    def input_dim(self) -> int:
        return self.weight.shape[1]


def read_auto_encoder(folder: Path) -> AutoEncoder:
    config = read_json_object(folder / "config.json", required=True)
    file = folder / "model.safetensors"
    if not file.exists():
        raise FileNotFoundError(f"No model.safetensors in {folder}: SparseAutoEncoder needs its weights")
    weights = read_safetensors(file)
    mx.eval(weights)  # as read_dense
    key = "encoder.weight" if "encoder.weight" in weights else "decoder.linear.weight"  # tied: saved as either
    weight = weights.get(key)
    shape = (config.get("hidden_dim"), config.get("input_dim"))
    if weight is None or tuple(weight.shape) != shape or "pre_bias" not in weights or "latent_bias" not in weights:
        raise ValueError(
            f"{file} must hold 'encoder.weight' (or 'decoder.linear.weight') of shape {shape} (hidden_dim, "
            f"input_dim of {folder / 'config.json'}), 'pre_bias' and 'latent_bias'; found "
            f"{ {k: tuple(v.shape) for k, v in weights.items()} }"
        )
    weight, pre_bias, latent_bias = (weights[k].astype(mx.float32) for k in (key, "pre_bias", "latent_bias"))
    return AutoEncoder(weight, pre_bias, latent_bias, int(config.get("k", 8)), bool(config.get("normalize")),
                       folder / "config.json")  # fmt: skip


@dataclass(frozen=True)
class MultiVectorMask:
    """Which tokens a multi-vector model scores: minus the skiplist words for the `skiplist_tasks`, only
    `keep_only_token_ids` (when set) outside queries."""

    skiplist_words: tuple[str, ...] = ()
    skiplist_tasks: tuple[str, ...] = ("document",)
    keep_only_token_ids: tuple[int, ...] | None = None

    def config(self) -> dict:
        return {"skiplist_words": list(self.skiplist_words), "skiplist_tasks": list(self.skiplist_tasks),
                "keep_only_token_ids": self.keep_only_token_ids}  # fmt: skip


def read_multi_vector_mask(folder: Path) -> MultiVectorMask:
    config = read_json_object(folder / "config.json")
    tasks = config.get("skiplist_tasks") or ["document"]
    keep = config.get("keep_only_token_ids")
    return MultiVectorMask(
        tuple(config.get("skiplist_words") or ()),
        (tasks,) if isinstance(tasks, str) else tuple(tasks),
        None if keep is None else tuple(keep),
    )


def read_logit_score(folder: Path) -> dict:
    """A `LogitScore`'s config: true_token_id and false_token_id (the tokens "yes" and "no" when absent)."""
    config = read_json_object(folder / "config.json", required=True)
    if config.get("module_input_name", "causal_logits") != "causal_logits":
        raise ValueError(
            f"{folder / 'config.json'}: LogitScore reads {config['module_input_name']!r}; only the causal "
            "LM's logits ('causal_logits') are supported"
        )
    return config


@dataclass
class Router:
    """A `Router`: route name -> its modules, the default route, and {(task, modality): route name}."""

    routes: dict[str, list["Module"]]
    default: str | None
    mappings: dict


def read_router(folder: Path) -> Router:
    file = folder / ROUTER_FILE
    config = read_json_object(file, required=True)
    types, structure = config.get("types") or {}, config.get("structure") or {}
    routes = {
        name: [module(str(types.get(n, "")), inside(folder, n, file)) for n in names]
        for name, names in structure.items()
    }
    parameters = config.get("parameters") or {}
    mappings = {ast.literal_eval(key): route for key, route in (parameters.get("route_mappings") or {}).items()}
    default = parameters.get("default_route")
    if default is None and parameters.get("allow_empty_key", True) and routes:
        default = next(iter(routes))
    return Router(routes, default, mappings)


@dataclass(frozen=True)
class Kind:
    """A module kind: the type sentence-transformers 6 writes for it, the reader of its folder's files, and the
    model it makes of a folder that lists it (`folder_kind`), if only one model has it."""

    type: str
    read: Callable[[Path], object] = lambda folder: None
    model: str | None = None


SPARSE_PACKAGE = ST + "sparse_encoder.modules."
KINDS = {
    "Transformer": Kind(ST + "base.modules.transformer.Transformer"),
    "MLMTransformer": Kind(SPARSE_PACKAGE + "mlm_transformer.MLMTransformer", model="sparse"),
    "Pooling": Kind(ST + "sentence_transformer.modules.pooling.Pooling", read_pooling),
    "Dense": Kind(ST + "base.modules.dense.Dense", read_dense),
    "Normalize": Kind(ST + "base.modules.normalize.Normalize"),
    "Router": Kind(ST + "base.modules.router.Router", read_router),
    "SpladePooling": Kind(SPARSE_PACKAGE + "splade_pooling.SpladePooling", read_splade_pooling, "sparse"),
    "SparseStaticEmbedding": Kind(
        SPARSE_PACKAGE + "sparse_static_embedding.SparseStaticEmbedding", read_static_embedding, "sparse"
    ),
    "SparseAutoEncoder": Kind(SPARSE_PACKAGE + "sparse_auto_encoder.SparseAutoEncoder", read_auto_encoder, "sparse"),
    "MultiVectorMask": Kind(
        ST + "multi_vector_encoder.modules.multi_vector_mask.MultiVectorMask", read_multi_vector_mask, "multi-vector"
    ),
    "LogitScore": Kind(ST + "cross_encoder.modules.logit_score.LogitScore", read_logit_score, "cross-encoder"),
}


# ----- modules.json and the folder's settings -----


@dataclass(frozen=True)
class Module:
    """One modules.json entry: its `kind` (the type's last part), its folder, and the type as written."""

    kind: str
    folder: Path
    type: str

    def read(self):
        """What the module's own files hold (`KINDS[kind].read`); None for a kind without files to read."""
        known = KINDS.get(self.kind)
        return known.read(self.folder) if known is not None else None


def module(module_type: str, folder: Path) -> Module:
    return Module(module_type.rsplit(".", 1)[-1], folder, module_type)


def module_type(kind: str) -> str:
    """The type sentence-transformers writes in modules.json for `kind`, or `kind` itself when already a type."""
    return KINDS[kind].type if kind in KINDS else kind


@dataclass
class SentenceFolder:
    """A sentence-transformers folder (or a plain checkpoint: no modules): its modules, the Transformer's folder,
    config_sentence_transformers.json (`settings`) and the Transformer's sentence_bert_config.json."""

    path: Path
    modules: list[Module]

    @property
    def kinds(self) -> list[str]:
        return [m.kind for m in self.modules]

    @property
    def transformer(self) -> Path:
        """The Transformer module's folder; the root for a plain checkpoint."""
        return next((m.folder for m in self.modules if m.kind in TRANSFORMERS), self.path)

    @cached_property
    def settings(self) -> dict:
        file = self.path / SETTINGS_FILE
        settings = dict(read_json_object(file))
        prompts = settings.get("prompts")
        if prompts is not None and (
            not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values())
        ):
            raise ValueError(
                f'{file}: prompts must map names to strings, e.g. {{"query": "query: "}}; got {prompts!r:.60}'
            )
        for key in ("default_prompt_name", "similarity_fn_name"):
            if settings.get(key) is not None and not isinstance(settings[key], str):
                raise ValueError(f"{file}: {key} must be a string (or null), got {settings[key]!r:.40}")
        return settings

    @cached_property
    def sentence_config(self) -> dict:
        return read_sentence_config(self.transformer)

    def projection(self, on: str, runner: str, width: int | None = None) -> tuple[list[Dense], bool]:
        """The Dense modules over `on` (the pooled "sentence_embedding", or the "token_embeddings") in order, and
        whether a Normalize ends them: how every encoder and fine_tune run a folder's projection. A Dense or
        Normalize over another output, a Normalize before a Dense, or a Dense that takes other than the `width`
        it is given (when known), would run wrongly here: refused, naming it."""
        dense, normalized = [], False
        for m in self.modules:
            if m.kind not in ("Dense", "Normalize"):
                continue
            config = read_json_object(m.folder / "config.json") if (m.folder / "config.json").exists() else {}
            reads = config.get("module_input_name") or on
            writes = config.get("module_output_name") or reads
            if (reads, writes) != (on, on):
                hint = " (a multi-vector model: load it with MultiVectorEncoder)" if reads == "token_embeddings" else ""
                raise ValueError(
                    f"{m.folder / 'config.json'}: this {m.kind} module reads {reads!r} and writes {writes!r}; "
                    f"{runner} runs Dense and Normalize modules over {on!r} alone{hint}"
                )
            if normalized:
                raise ValueError(
                    f"{self.path / MODULES_FILE}: Normalize comes before the {m.kind} module {m.folder.name}; {runner} "
                    "runs the Dense modules first and Normalize last, as sentence-transformers' own folders order them"
                )
            normalized = m.kind == "Normalize"
            if m.kind == "Dense":
                layer = m.read()
                takes = layer.config.get("in_features")
                if width is not None and isinstance(takes, int) and takes != width:
                    raise ValueError(
                        f"{m.folder / 'config.json'}: this Dense module takes {takes} features, but the module before "
                        f"it gives {width} ({on}); the folder's modules do not fit together"
                    )
                width = layer.config.get("out_features") if width is not None else None
                dense.append(layer)
        return dense, normalized

    def check_kinds(self, allowed: tuple[str, ...], runner: str, hint: str = "") -> None:
        """Refuse a module of a kind outside `allowed`, naming the file, the module and what `runner` runs."""
        for m in self.modules:
            if m.kind not in allowed:
                raise ValueError(
                    f"{self.path / MODULES_FILE}: module {m.type!r} ({m.folder.name}) is not supported; {runner} "
                    f"runs {', '.join(allowed)} modules{hint}"
                )

    def prompts(
        self, defaults: tuple[str, ...], given: dict | None, default_prompt_name: str | None
    ) -> tuple[dict[str, str], str | None]:
        """(prompts, default_prompt_name) as sentence-transformers resolves them: the empty `defaults`, then the
        folder's config_sentence_transformers.json, then the arguments, each later one winning."""
        merged = {**dict.fromkeys(defaults, ""), **(self.settings.get("prompts") or {}), **(given or {})}
        default_prompt_name = default_prompt_name or self.settings.get("default_prompt_name")
        if default_prompt_name is not None and default_prompt_name not in merged:
            raise ValueError(
                f"Default prompt name {default_prompt_name!r} (from {self.path / SETTINGS_FILE} or "
                f"default_prompt_name=) is not among the prompts: {', '.join(sorted(merged)) or 'none'}"
            )
        return merged, default_prompt_name

    def similarity_fn_name(self, known, default: str) -> str:
        """The saved similarity function when it is one of `known`, else `default` (a name we do not compute, such
        as a multi-vector "maxsim" saved with a dense model, is ignored, as sentence-transformers does)."""
        saved = self.settings.get("similarity_fn_name")
        return saved if saved in known else default


def read_sentence_config(transformer: Path) -> dict:
    """A Transformer module's sentence_bert_config.json ({} without it), its token limits checked."""
    file = transformer / SENTENCE_CONFIG_FILE
    config = dict(read_json_object(file))
    for key in ("max_seq_length", "query_length", "document_length"):
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{file}: {key} must be a whole number of tokens >= 1 (or null), got {value!r:.40}")
    return config


# ColBERT layouts sentence-transformers 6 converts as it loads them (PyLate's settings here, Stanford's inline
# projection in the checkpoint layer)
PYLATE_KEYS = ("query_prefix", "document_prefix", "query_length", "do_query_expansion", "skiplist_words")


def read_folder(path: Path) -> SentenceFolder:
    """The folder at `path` as sentence-transformers reads it (modules.json, no module for a plain checkpoint); a
    ColBERT folder in PyLate's or Stanford's layout is refused: read as a plain one, its vectors would be wrong."""
    folder = SentenceFolder(path, [module(kind, folder) for kind, folder in read_module_entries(path)])
    settings = folder.settings if (path / SETTINGS_FILE).is_file() else {}
    if settings.get("model_type") == "ColBERT" or any(k in settings for k in PYLATE_KEYS):
        raise ValueError(f"{path / SETTINGS_FILE} (PyLate's settings): {COLBERT_LAYOUT.format(layout='PyLate')}")
    return folder


def lowercase(tokenizer) -> None:
    """Put a Lowercase normalizer in front, as sentence-transformers does for do_lower_case=True."""
    current = tokenizer.backend.normalizer
    parts = list(current) if isinstance(current, normalizers.Sequence) else [current]
    if any(isinstance(n, normalizers.Lowercase) for n in parts):
        return
    tokenizer.backend.normalizer = normalizers.Sequence([normalizers.Lowercase()] + ([current] if current else []))


def role_lengths(sentence_config: dict, tokenizer, max_tokens: int | None) -> dict[str, int]:
    """sentence-transformers 6's Transformer: a query's or a document's own token limit (query_length,
    document_length), in place of max_seq_length, within the model's positions."""
    return {
        role: token_limit(tokenizer, max_tokens, length)
        for role in ("query", "document")
        if (length := sentence_config.get(f"{role}_length"))
    }


def apply_sentence_config(tokenizer, sentence_config: dict) -> None:
    """What sentence_bert_config.json asks of the tokenizer: lowercasing with do_lower_case. Its processing_kwargs
    (sentence-transformers 6's tokenizer and chat-template options) are not applied: a warning names them."""
    if sentence_config.get("do_lower_case"):
        lowercase(tokenizer)
    if extra := {k: v for k, v in (sentence_config.get("processing_kwargs") or {}).items() if v}:
        warnings.warn(
            f"sentence_bert_config.json's processing_kwargs {json.dumps(extra)[:200]} are not applied here: "
            "the inputs are tokenized without them, so embeddings and scores may differ from sentence-transformers'",
            UserWarning,
            stacklevel=3,
        )


def message_template(folder: SentenceFolder, tokenizer) -> ChatTemplate | None:
    """The chat template inputs go through as messages, or None, as sentence-transformers decides: a saved
    Transformer takes messages when its sentence_bert_config.json `modality_config` lists "message" (one saved
    before there was a modality_config takes text); a plain checkpoint does when its tokenizer has a chat
    template."""
    if folder.modules and "message" not in (folder.sentence_config.get("modality_config") or {}):
        return None
    template = read_chat_template(folder.transformer)
    return None if template is None else ChatTemplate(template, tokenizer)


def folder_kind(path: Path) -> str:
    """What the folder holds: "cross-encoder" (a sequence-classification checkpoint, or a LogitScore module),
    "sparse" or "multi-vector" (as modules.json, config_sentence_transformers.json or the Transformer's query
    expansion say), else "dense". A Transformer without a Pooling module gives token vectors, not a text's vector:
    unless the folder says it is multi-vector, it is refused rather than taken as a mean-pooled dense model."""
    folder = read_folder(path)
    if not folder.modules:
        return "cross-encoder" if Checkpoint.open(path).task == "sequence-classification" else "dense"
    kinds = set(folder.kinds)
    for m in folder.modules:  # a Router's routes are listed in its own config
        if m.kind == "Router":
            kinds |= {route.kind for routes in m.read().routes.values() for route in routes}
    models = {KINDS[k].model for k in kinds if k in KINDS}
    if "cross-encoder" in models:  # a causal LM scoring pairs with its LM head (Qwen3-Reranker)
        return "cross-encoder"
    model_type = folder.settings.get("model_type")
    tasks = {read_sentence_config(m.folder).get("transformer_task") for m in folder.modules if m.kind == "Transformer"}
    if model_type == "CrossEncoder" or "sequence-classification" in tasks:  # a CrossEncoder saved by s-t 6
        return "cross-encoder"
    if "sparse" in models or model_type == "SparseEncoder":
        return "sparse"
    # sentence-transformers sets query_expansion only on a multi-vector model's Transformer
    expansion = any(
        read_sentence_config(m.folder).get("query_expansion") for m in folder.modules if m.kind == "Transformer"
    )
    if "multi-vector" in models or model_type == "MultiVectorEncoder" or expansion:
        return "multi-vector"
    if "Transformer" in kinds and "Pooling" not in kinds:
        raise ValueError(
            f"{path / MODULES_FILE} lists a Transformer and no Pooling module, so the model gives one vector per "
            "token, not one per text. To serve it as a multi-vector (ColBERT) model, add a MultiVectorMask module "
            f'after the Transformer (or "model_type": "MultiVectorEncoder" to {SETTINGS_FILE}); '
            "to serve it as a dense model, add a Pooling module (a folder with its config.json, e.g. 1_Pooling)"
        )
    return "dense"


# ----- writing -----


def write_folder(
    folder: Path, modules: list[tuple[str, str]], settings: dict, sentence_config: dict, transformer: str = ""
) -> None:
    """modules.json of (kind or type, path relative to `folder`; "" for the root) in order, the settings in
    config_sentence_transformers.json and the Transformer's sentence_bert_config.json at `transformer`. The
    modules' own files are the caller's (`write_dense`, `write_json` of a config)."""
    entries = [
        {"idx": i, "name": str(i), "path": rel, "type": module_type(kind)} for i, (kind, rel) in enumerate(modules)
    ]
    write_json(folder / MODULES_FILE, entries)
    write_json(folder / SETTINGS_FILE, settings)
    (folder / transformer).mkdir(parents=True, exist_ok=True)
    write_json(folder / transformer / SENTENCE_CONFIG_FILE, sentence_config)


def copy_cross_encoder_files(source: Path, target: Path) -> None:
    """Beside a cross-encoder saved from `source` into `target`: a sentence-transformers CrossEncoder folder's own
    files (its module list; its settings: activation, prompts; the Transformer's config), when its model is one
    Transformer at the root, as sentence-transformers 6 saves a classifier's."""
    entries = read_module_entries(source)
    if [(kind.rsplit(".", 1)[-1], path) for kind, path in entries] != [("Transformer", source)]:
        return
    for name in (MODULES_FILE, SETTINGS_FILE, SENTENCE_CONFIG_FILE):
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)


def write_module_config(folder: Path, rel: str, config: dict) -> None:
    """A module's config.json at `rel` inside `folder`."""
    (folder / rel).mkdir(parents=True, exist_ok=True)
    write_json(folder / rel / "config.json", config)

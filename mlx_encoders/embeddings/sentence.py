"""Sentence embeddings with sentence-transformers' semantics: `SentenceEncoder(path).encode(texts)`.

Reads a sentence-transformers folder the way `sentence_transformers.SentenceTransformer` does: `modules.json`
(Transformer -> Pooling -> Dense* -> Normalize), `sentence_bert_config.json` (max_seq_length, do_lower_case),
`config_sentence_transformers.json` (prompts, default_prompt_name, similarity_fn_name, truncate_dim),
`1_Pooling/config.json` and `2_Dense/`. A plain transformers checkpoint, or a folder whose modules.json lists a
Pooling folder that is not there (as mlx-embeddings' converter leaves them), gets the architecture's natural
pooling (a decoder's last token, ModernBERT's `classifier_pooling`, mean for the others). Texts are sorted by
token length into batches, so padding is minimal, and returned in input order.

`encode` and its keywords follow `SentenceTransformer.encode` of sentence-transformers 6
(sentence_transformer/model.py); an mx.array stands where it returns a torch tensor.
"""

import numbers
import re
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from tokenizers import Encoding, normalizers

from .. import load_tokenizer
from ..checkpoint import Checkpoint, load_model, read_json_object, read_modules, read_safetensors, resolve
from ..engine.batching import CPU_SLICE_BYTES, run_batches
from ..engine.quantized import least_group_tokens
from ..engine.runtime import on_cpu
from ..tokenizer import check_count, text_list
from .pooling import parse_modes, pool, read_pooling_config
from .vectors import SIMILARITIES, check_precision, check_similarity_name, normalize, quantize_embeddings

# torch activation class (as sentence-transformers saves it in 2_Dense/config.json) -> MLX function
DENSE_ACTIVATIONS = {
    "Identity": lambda x: x,
    "Tanh": mx.tanh,
    "GELU": nn.gelu,
    "ReLU": nn.relu,
    "SiLU": nn.silu,
    "Sigmoid": mx.sigmoid,
}
OUTPUT_VALUES = ("sentence_embedding", "token_embeddings", None)
DEFAULT_PROMPTS = ("query", "document")  # sentence-transformers defines both, empty unless a folder sets them
DOCUMENT_PROMPTS = ("document", "passage", "corpus")  # encode_document takes the first one defined


def task_prompt_name(prompts: dict[str, str], task: str | None) -> str | None:
    """The prompt `encode_query` (task "query": "query") or `encode_document` (the first of DOCUMENT_PROMPTS) picks
    when none is given, if the model has it; None for plain `encode`."""
    if task == "query":
        return "query" if "query" in prompts else None
    if task == "document":
        return next((name for name in DOCUMENT_PROMPTS if name in prompts), None)
    return None


def task_adapter(model, task: str | None, prompt_name: str | None, role: str | None) -> str | None:
    """The task adapter (jina-embeddings-v3's) a call computes with: `task`, else the prompt name when an adapter
    has that name, else the one for the role ("query", "document") the model names; None for the base model."""
    names = getattr(model, "adapters", None)
    if task is not None:
        if names is None:
            raise ValueError(f"task={task!r}: the {model.args.model_type} model has no task adapters")
        return model.adapter_name(task)
    if not names:
        return None
    if prompt_name is not None and re.sub(r"[.\-]", "_", prompt_name) in names:
        return model.adapter_name(prompt_name)
    return next((model.adapter_name(n) for r, n in model.role_adapters.items() if r == role and n in names), None)


class TaskEncoding:
    """`encode_query` / `encode_document` for encoders whose `encode` takes `task=` (sparse, multi-vector), and the
    prompt every encoder's `encode` prepends (`input_prompt`)."""

    def input_prompt(self, prompt_name: str | None = None, prompt: str | None = None, role: str | None = None) -> str:
        """The prompt `encode` prepends to each text: `prompt`, else the one named `prompt_name`, else (`role`
        "query" or "document") the one `encode_query` or `encode_document` picks, else the default prompt, else ""."""
        if role is not None and prompt_name is None and prompt is None:
            prompt_name = task_prompt_name(self.prompts, role)
        return resolve_prompt(self.prompts, self.default_prompt_name, prompt_name, prompt, "encode()")

    def encode_query(self, sentences: str | list[str], prompt_name: str | None = None, prompt: str | None = None, **kw):
        """`encode` with task "query" and the "query" prompt unless one is given."""
        if prompt_name is None and prompt is None:
            prompt_name = task_prompt_name(self.prompts, "query")
        return self.encode(sentences, prompt_name, prompt, task="query", **kw)

    def encode_document(
        self, sentences: str | list[str], prompt_name: str | None = None, prompt: str | None = None, **kw
    ):
        """`encode` with task "document" and the first of the "document", "passage", "corpus" prompts."""
        if prompt_name is None and prompt is None:
            prompt_name = task_prompt_name(self.prompts, "document")
        return self.encode(sentences, prompt_name, prompt, task="document", **kw)


@dataclass
class Dense:
    """sentence-transformers' `Dense`: activation(x W^T + b), plus x (or x R^T) when `use_residual`."""

    linear: nn.Linear
    activation: object
    residual: nn.Linear | None = None
    use_residual: bool = False

    def __call__(self, x: mx.array) -> mx.array:
        out = self.activation(self.linear(x))
        if self.use_residual:
            out = out + (self.residual(x) if self.residual is not None else x)
        return out


def load_dense(folder: Path) -> Dense:
    if not (folder / "config.json").exists():
        raise FileNotFoundError(
            f"modules.json lists a Dense module at {folder}, but it has no config.json (converters such as "
            "mlx-embeddings leave such folders out). Copy the folder from the original sentence-transformers model: "
            "without its projection the embeddings would be wrong."
        )
    config = read_json_object(folder / "config.json")
    name = (config.get("activation_function") or "torch.nn.modules.linear.Identity").rsplit(".", 1)[-1]
    if name not in DENSE_ACTIVATIONS:
        raise ValueError(
            f"{folder / 'config.json'}: activation_function {config['activation_function']!r} is not supported; "
            f"supported torch activations: {', '.join(DENSE_ACTIVATIONS)}"
        )
    file = folder / "model.safetensors"
    if not file.exists():
        raise FileNotFoundError(
            f"No model.safetensors in {folder} (pickle weights are not read). Re-save the model with "
            "sentence-transformers >= 3 (`SentenceTransformer(path).save(path)`), which writes safetensors."
        )
    weights = read_safetensors(file)
    linear = nn.Linear(config["in_features"], config["out_features"], bias=config.get("bias", True))
    residual = None
    if "residual.weight" in weights:
        residual = nn.Linear(config["in_features"], config["out_features"], bias=False)
        residual.load_weights([("weight", weights.pop("residual.weight"))])
    linear.load_weights([(k.removeprefix("linear."), v) for k, v in weights.items()])
    return Dense(linear, DENSE_ACTIVATIONS[name], residual, bool(config.get("use_residual", False)))


def module_kind(module_type: str, file: Path) -> str:
    kind = module_type.rsplit(".", 1)[-1]
    if kind not in ("Transformer", "Pooling", "Dense", "Normalize"):
        raise ValueError(
            f"{file}: module {module_type!r} is not supported; SentenceEncoder runs "
            "Transformer, Pooling, Dense and Normalize modules"
        )
    return kind


def natural_pooling(args) -> tuple[str, ...]:
    architecture = (args.extra.get("architectures") or [""])[0]
    # sentence-transformers' rule: a causal LM's last token is the only one that has seen the whole text
    if getattr(args, "causal", False) and str(architecture).endswith("ForCausalLM"):
        return ("lasttoken",)
    if args.model_type == "modernbert":
        return parse_modes(args.classifier_pooling)
    return ("mean",)


def lowercase(tokenizer) -> None:
    """Put a Lowercase normalizer in front, as sentence-transformers does for do_lower_case=True."""
    current = tokenizer.backend.normalizer
    parts = list(current) if isinstance(current, normalizers.Sequence) else [current]
    if any(isinstance(n, normalizers.Lowercase) for n in parts):
        return
    tokenizer.backend.normalizer = normalizers.Sequence([normalizers.Lowercase()] + ([current] if current else []))


def merge_prompts(
    defaults: tuple[str, ...], saved: dict, prompts: dict | None, default_prompt_name: str | None, source: Path
) -> tuple[dict[str, str], str | None]:
    """(prompts, default_prompt_name) as sentence-transformers resolves them: the empty `defaults`, then the
    folder's config_sentence_transformers.json (`saved`), then the arguments, each later one winning."""
    merged = {**dict.fromkeys(defaults, ""), **(saved.get("prompts") or {}), **(prompts or {})}
    default_prompt_name = default_prompt_name or saved.get("default_prompt_name")
    if default_prompt_name is not None and default_prompt_name not in merged:
        raise ValueError(
            f"Default prompt name {default_prompt_name!r} (from {source} or default_prompt_name=) is not among the "
            f"prompts: {', '.join(sorted(merged)) or 'none'}"
        )
    return merged, default_prompt_name


def resolve_prompt(
    prompts: dict[str, str], default_prompt_name: str | None, prompt_name: str | None, prompt: str | None, caller: str
) -> str:
    """`prompt` itself, else the prompt named `prompt_name`, else the default prompt, else ""."""
    if prompt is not None:
        if not isinstance(prompt, str):
            raise TypeError(f"{caller} prompt must be a str, got {type(prompt).__name__}: {prompt!r:.60}")
        if prompt_name is not None:
            warnings.warn(
                "Provide either a `prompt`, a `prompt_name`, or neither, but not both; ignoring the `prompt_name`",
                UserWarning,
                stacklevel=3,
            )
        return prompt
    prompt_name = default_prompt_name if prompt_name is None else prompt_name
    if prompt_name is None:
        return ""
    if prompt_name not in prompts:
        raise ValueError(
            f"Prompt name {prompt_name!r} is not in the prompts (config_sentence_transformers.json or prompts=); "
            f"available prompts: {', '.join(sorted(prompts)) or 'none'}"
        )
    return prompts[prompt_name]


class SentenceEncoder(TaskEncoding):
    """Texts -> embeddings, like `sentence_transformers.SentenceTransformer(path).encode(texts)`.

    `path_or_repo`: a local folder (float or quantized, e.g. from `python -m convert` or mlx-embeddings) or a
    hub id, read from the huggingface_hub cache. `dtype` casts the weights ("float16", ...); `pooling` ("mean",
    "cls", "max", "mean_sqrt_len_tokens", "weightedmean", "lasttoken", or a list / "cls+mean" to concatenate)
    replaces the stored or natural pooling. `prompts`, `default_prompt_name`, `similarity_fn_name` and
    `truncate_dim` override those of config_sentence_transformers.json, as sentence-transformers' arguments do.
    `modules` (type, folder) replaces modules.json's list (a sparse model's dense part, without its last module).
    """

    def __init__(
        self,
        path_or_repo: str | Path,
        dtype=None,
        pooling=None,
        revision: str | None = None,
        *,
        prompts: dict[str, str] | None = None,
        default_prompt_name: str | None = None,
        similarity_fn_name: str | None = None,
        truncate_dim: int | None = None,
        modules: list[tuple[str, Path]] | None = None,
    ):
        self.path = resolve(path_or_repo, revision)
        self.dense: list[Dense] = []
        self.normalize = False
        self.include_prompt = True
        modules = read_modules(self.path) if modules is None else modules
        kinds = [(module_kind(kind, self.path / "modules.json"), folder) for kind, folder in modules]
        transformer = Checkpoint.open(next((folder for kind, folder in kinds if kind == "Transformer"), self.path))
        self.model = load_model(transformer, dtype=dtype, task="encoder")
        self.tokenizer = load_tokenizer(self.model, transformer)
        self.pooling = self.read_modules(kinds, pooling)
        self.read_sentence_config(transformer)
        self.read_model_config(prompts, default_prompt_name, similarity_fn_name, truncate_dim)
        width = len(self.pooling) * self.model.args.output_size
        self.dimension = self.dense[-1].linear.weight.shape[0] if self.dense else width
        self.merge_adapters = False  # task adapters: added at each adapted module (True: merged into the weights)
        # None: each batch in one forward pass. Chosen for the default device at construction; see slices().
        self.slice_bytes: int | None = CPU_SLICE_BYTES if on_cpu() else None
        self._slice_tokens: int | None = None  # see the slice_tokens property

    @property
    def slice_tokens(self) -> int:
        """The least tokens the forward passes that share one dequantizing of the weights hold on the CPU, all
        together (see `slice_rows`, `slice_groups`): for a model with quantized Linears `quantized.least_group_tokens`
        (256 at 8 bits, 1024 at fewer), looked at on each use so that a model quantized in memory counts; 0 for a
        float model or on a GPU. Settable."""
        if self._slice_tokens is not None:
            return self._slice_tokens
        return least_group_tokens(self.model) if on_cpu() else 0

    @slice_tokens.setter
    def slice_tokens(self, tokens: int) -> None:
        self._slice_tokens = tokens

    def read_modules(self, kinds: list[tuple[str, Path]], pooling) -> tuple[str, ...]:
        modes, where = None, "modules.json, 1_Pooling/config.json"
        for kind, folder in kinds:
            if kind == "Pooling" and not (folder / "config.json").exists():  # mlx-embeddings leaves it out
                where = f"{folder.relative_to(self.path)}/config.json, listed in modules.json, is missing"
            elif kind == "Pooling":
                modes, self.include_prompt = read_pooling_config(folder)
            elif kind == "Dense":
                self.dense.append(load_dense(folder))
            elif kind == "Normalize":
                self.normalize = True
        if pooling is not None:
            return parse_modes(pooling)
        if modes is None:
            modes = natural_pooling(self.model.args)
            warnings.warn(
                f"{self.path} has no sentence-transformers pooling config ({where}); "
                f"using {'+'.join(modes)} pooling. Pass SentenceEncoder(..., pooling=...) to choose another.",
                UserWarning,
                stacklevel=3,
            )
        return modes

    def read_sentence_config(self, transformer: Checkpoint) -> None:
        config = read_json_object(transformer.path / "sentence_bert_config.json")
        limit = self.model.args.max_tokens
        self.max_seq_length = config.get("max_seq_length") or self.tokenizer.model_max_length
        self.max_seq_length = min(self.max_seq_length, limit) if limit else self.max_seq_length
        if config.get("do_lower_case"):
            lowercase(self.tokenizer)

    def read_model_config(self, prompts, default_prompt_name, similarity_fn_name, truncate_dim) -> None:
        file = self.path / "config_sentence_transformers.json"
        config = read_json_object(file)
        self.prompts, self.default_prompt_name = merge_prompts(
            DEFAULT_PROMPTS, config, prompts, default_prompt_name, file
        )
        saved = config.get("similarity_fn_name")  # a name we do not compute (e.g. "maxsim") is ignored, as there
        self.similarity_fn_name = similarity_fn_name or (saved if saved in SIMILARITIES else "cosine")
        self.truncate_dim: int | None = config.get("truncate_dim") if truncate_dim is None else truncate_dim
        if self.truncate_dim is not None:
            check_count("truncate_dim", self.truncate_dim, 1)

    @property
    def similarity_fn_name(self) -> str:
        """How `similarity` scores: "cosine", "dot", "euclidean" or "manhattan" (negative distances)."""
        return self._similarity_fn_name

    @similarity_fn_name.setter
    def similarity_fn_name(self, name: str) -> None:
        self._similarity_fn_name = check_similarity_name(name)

    def get_embedding_dimension(self) -> int:
        """The width of `encode`'s vectors: `dimension`, cut to `truncate_dim` when that is set."""
        return self.dimension if self.truncate_dim is None else min(self.dimension, self.truncate_dim)

    get_sentence_embedding_dimension = get_embedding_dimension  # sentence-transformers' older name

    def prompt_length(self, prompt: str) -> int:
        """Tokens of the prompt, its trailing special token ([SEP]) aside: those pooling skips when
        include_prompt is false."""
        if not prompt:
            return 0
        encoding = self.tokenizer.encode_batch([prompt], truncation=False)[0]
        return len(encoding.ids) - (1 if encoding.special_tokens_mask[-1] else 0)

    def tokenize(
        self, texts: list[str], prompt: str = "", max_length: int | None = None, direction: str = "right"
    ) -> list[Encoding]:
        """`texts` as the model reads them, `prompt` before each (see `input_prompt`), cut to `max_seq_length`
        tokens (or a shorter `max_length`) at their end, or at their start with `direction` "left"; an
        encoding's `overflowing` is non-empty where it was cut. The inputs of `run_encodings`."""
        limit = self.max_seq_length if max_length is None else min(self.max_seq_length, max_length)
        texts = [prompt + t for t in texts] if prompt else texts
        return self.tokenizer.encode_batch(texts, truncation=True, max_length=limit, direction=direction)

    def pooled_prompt_tokens(self, prompt: str) -> int:
        """The tokens of `prompt` that pooling leaves out: none when the model's Pooling includes the prompt."""
        return 0 if self.include_prompt else self.prompt_length(prompt)

    def adapter_for(
        self, prompt_name: str | None = None, prompt: str | None = None, task: str | None = None,
        role: str | None = None,
    ) -> str | None:  # fmt: skip
        """The task adapter `encode` computes with (see its `task` and `role`); None for a model without them."""
        name = prompt_name if prompt_name is not None or prompt is not None else self.default_prompt_name
        return task_adapter(self.model, task, name, role)

    def postprocess(
        self, vectors: np.ndarray, truncate_dim: int | None = None, normalize_embeddings: bool = False,
        precision: str = "float32",
    ) -> np.ndarray:  # fmt: skip
        """`encode`'s steps after the model on `run_encodings`' (N, D) vectors: `truncate_dim` (default the model's),
        then `normalize_embeddings`, then `precision` (`quantize_embeddings` over these rows)."""
        vectors = vectors[:, : self.truncate_dim if truncate_dim is None else truncate_dim]
        if normalize_embeddings:
            vectors = np.array(normalize(mx.array(vectors)))
        return quantize_embeddings(vectors, precision)

    def embed(self, batch: dict[str, mx.array], skipped: int, tokens: bool = False) -> list[mx.array]:
        """One padded batch -> [(B, D) float32 sentence embeddings], plus the (B, L, H) token embeddings with
        `tokens` (lazy). Pooling leaves out the first `skipped` real tokens (an excluded prompt)."""
        out = self.model(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"))
        hidden = out.last_hidden_state.astype(mx.float32)
        mask = batch["attention_mask"]
        pooled_mask = mask if not skipped else mask * (mx.cumsum(mask, axis=1) > skipped)  # either padding side
        x = pool(hidden, pooled_mask, self.pooling, mask)
        for dense in self.dense:
            x = dense(x.astype(dense.linear.weight.dtype)).astype(mx.float32)
        if self.normalize:
            x = normalize(x)
        return [x, hidden] if tokens else [x]

    def encode(
        self,
        sentences: str | list[str],
        prompt_name: str | None = None,
        prompt: str | None = None,
        batch_size: int = 32,
        show_progress_bar: bool | None = None,
        output_value: str | None = "sentence_embedding",
        precision: str = "float32",
        convert_to_numpy: bool = True,
        convert_to_tensor: bool = False,
        normalize_embeddings: bool = False,
        truncate_dim: int | None = None,
        task: str | None = None,
        role: str | None = None,
    ):
        """Embeddings of `sentences`, as sentence-transformers' `encode` returns them: float32 (N, D) numpy by
        default, a single str giving (D,); `convert_to_tensor` one mx.array, `convert_to_numpy=False` a list of
        (D,) mx.arrays. An empty list gives (0, D).

        Each item must be a str (TypeError naming the index otherwise); an empty string is encoded as the special
        tokens alone ([CLS] [SEP]). `prompt`, or the named prompt (`prompt_name`, else `default_prompt_name`), is
        prepended to every text. Texts longer than `max_seq_length` tokens are truncated, with one warning.
        The model's own modules (Normalize included) run first, then `truncate_dim` (Matryoshka: keep the first
        dimensions), then `normalize_embeddings`, then `precision` ("int8", "uint8", "binary", "ubinary":
        `quantize_embeddings` over the whole result). `output_value="token_embeddings"` gives per text the (L, H)
        token embeddings of its own L tokens; `None` gives per text a dict of the model's inputs and outputs.
        A model with task adapters (jina-embeddings-v3) computes with the adapter `task` names ("retrieval.query",
        "text-matching", ...), else the one the prompt name names, else (`role`, as encode_query / encode_document
        set it) its query or document adapter, else none; `merge_adapters` merges it into the weights.
        """
        single = isinstance(sentences, str)
        texts = text_list(sentences, "encode()")
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"encode() takes strings; item {i} is {type(text).__name__}: {text!r:.60}")
        check_count("encode() batch_size", batch_size, 1)
        if output_value not in OUTPUT_VALUES:
            raise ValueError(f"output_value must be one of {OUTPUT_VALUES}, got {output_value!r}")
        precision = check_precision(precision or "float32")
        if output_value is None and precision != "float32":
            raise ValueError("precision applies to output_value 'sentence_embedding' or 'token_embeddings', not None")
        truncate_dim = self.truncate_dim if truncate_dim is None else truncate_dim
        if truncate_dim is not None:
            check_count("encode() truncate_dim", truncate_dim, 1)
        self.check_max_seq_length()
        prefix = self.input_prompt(prompt_name, prompt)
        tokens = output_value != "sentence_embedding"
        adapter = self.adapter_for(prompt_name, prompt, task, role)
        encodings, vectors, token_vectors = self.run(
            texts, batch_size, show_progress_bar, self.pooled_prompt_tokens(prefix), tokens, prefix, adapter
        )
        if output_value == "token_embeddings":
            out = quantize_embeddings(token_vectors, precision) if precision != "float32" else token_vectors
            out = [mx.array(m) if m.dtype == np.float32 else m for m in out]  # quantized ones stay numpy, as theirs
        elif output_value is None:
            prompt_tokens = self.prompt_length(prefix) if prefix else None
            out = [
                self.features(*item, prompt_tokens)
                for item in zip(encodings, token_vectors, vectors[:, :truncate_dim], strict=True)
            ]
        else:
            out = self.postprocess(vectors, truncate_dim, normalize_embeddings, precision)
            if convert_to_tensor:
                out = mx.array(out)
            elif not convert_to_numpy:
                out = [mx.array(row) for row in out]
        return out[0] if single else out

    def encode_query(
        self, sentences: str | list[str], prompt_name: str | None = None, prompt: str | None = None, **kwargs
    ):
        """`encode` with the "query" prompt unless one is given (sentence-transformers defines it, empty, for every
        model, so the default prompt never applies here)."""
        if prompt_name is None and prompt is None:
            prompt_name = task_prompt_name(self.prompts, "query")
        return self.encode(sentences, prompt_name, prompt, **{"role": "query", **kwargs})

    def encode_document(
        self, sentences: str | list[str], prompt_name: str | None = None, prompt: str | None = None, **kwargs
    ):
        """`encode` with the first of the "document", "passage" and "corpus" prompts unless one is given."""
        if prompt_name is None and prompt is None:
            prompt_name = task_prompt_name(self.prompts, "document")
        return self.encode(sentences, prompt_name, prompt, **{"role": "document", **kwargs})

    def features(self, encoding: Encoding, tokens: np.ndarray, vector: np.ndarray, prompt_length: int | None) -> dict:
        """What `output_value=None` gives for one text: its inputs and outputs, keyed as sentence-transformers'."""
        ids = {
            "input_ids": encoding.ids,
            "token_type_ids": encoding.type_ids,
            "attention_mask": encoding.attention_mask,
        }
        item = {k: mx.array(v, mx.int64) for k, v in ids.items() if k in self.tokenizer.model_input_names}
        item["modality"] = "text"
        if prompt_length is not None:
            item["prompt_length"] = prompt_length
        item["token_embeddings"] = mx.array(tokens)
        item["sentence_embedding"] = mx.array(vector)
        return item

    def similarity(self, embeddings1, embeddings2) -> mx.array:
        """(N, M) float32 scores of every row of `embeddings1` with every row of `embeddings2`, by
        `similarity_fn_name`; a (D,) vector counts as one row, so it gives (1, M)."""
        return SIMILARITIES[self.similarity_fn_name][0](embeddings1, embeddings2)

    def similarity_pairwise(self, embeddings1, embeddings2) -> mx.array:
        """(N,) float32 scores of row i with row i, by `similarity_fn_name`."""
        return SIMILARITIES[self.similarity_fn_name][1](embeddings1, embeddings2)

    def check_max_seq_length(self) -> None:
        """`max_seq_length` may be set by hand; windows longer than the position table would read past it."""
        limit, length = self.model.args.max_tokens, self.max_seq_length
        if isinstance(length, bool) or not isinstance(length, numbers.Integral) or length < 1:
            raise ValueError(f"encoder.max_seq_length must be an int >= 1, got {length!r}")
        if limit and length > limit:
            raise ValueError(
                f"encoder.max_seq_length ({length}) is more than the {limit} tokens the model in {self.path} takes; "
                f"set it to at most {limit}"
            )

    def run(
        self, texts: list[str], batch_size: int, show_progress: bool | None, skipped: int, tokens: bool,
        prompt: str = "", adapter: str | None = None,
    ) -> tuple[list[Encoding], np.ndarray, list[np.ndarray]]:  # fmt: skip
        """(encodings, (N, D) float32 sentence embeddings, per text its (L, H) token embeddings when `tokens`)."""
        encodings = self.tokenize(texts, prompt) if texts else []
        truncated = sum(1 for e in encodings if e.overflowing)
        if truncated:
            warnings.warn(
                f"{truncated} of {len(texts)} texts are longer than max_seq_length={self.max_seq_length} tokens "
                "and were truncated",
                UserWarning,
                stacklevel=3,  # the caller of encode()
            )
        return encodings, *self.run_encodings(encodings, batch_size, show_progress, skipped, tokens, adapter)

    def run_encodings(
        self, encodings: list[Encoding], batch_size: int = 32, show_progress: bool | None = False, skipped: int = 0,
        tokens: bool = False, adapter: str | None = None,
    ) -> tuple[np.ndarray, list[np.ndarray]]:  # fmt: skip
        """`run` of tokenized texts (`tokenize`'s, or anything with `ids` and `type_ids`: a server's batch of many
        requests): ((N, D) float32 sentence embeddings before truncate_dim, per text its (L, H) token embeddings
        when `tokens`). Pooling leaves out each text's first `skipped` tokens (`pooled_prompt_tokens`); the model
        computes with the task adapter `adapter` (`adapter_for`)."""
        out = np.zeros((len(encodings), self.dimension), np.float32)
        token_vectors = [None] * len(encodings) if tokens else []
        if not encodings:
            return out, token_vectors

        def collect(rows: np.ndarray, arrays: list[mx.array]) -> None:
            out[rows] = np.array(arrays[0])
            if tokens:
                hidden = np.array(arrays[1])
                for row, i in enumerate(rows):
                    token_vectors[i] = hidden[row, self.tokenizer.real_tokens(len(encodings[i].ids), hidden.shape[1])]

        def forward(rows: np.ndarray) -> list[mx.array]:
            return self.embed(self.tokenizer.pad([encodings[i] for i in rows]), skipped, tokens)

        lengths = [len(e.ids) for e in encodings]
        with self.model.adapter(adapter, self.merge_adapters) if adapter else nullcontext():
            run_batches(
                self.model, lengths, forward, collect, batch_size, show_progress=show_progress,
                slice_bytes=self.slice_bytes, least_tokens=self.slice_tokens,
            )  # fmt: skip
        return out, token_vectors

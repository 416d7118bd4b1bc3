"""Sentence embeddings with sentence-transformers' semantics: `SentenceEncoder(path).encode(texts)`.

Reads a sentence-transformers folder the way `sentence_transformers.SentenceTransformer` does: `modules.json`
(Transformer -> Pooling -> Dense* -> Normalize), `sentence_bert_config.json` (max_seq_length, do_lower_case),
`config_sentence_transformers.json` (prompts, default_prompt_name), `1_Pooling/config.json` and `2_Dense/`.
A plain transformers checkpoint gets the architecture's natural pooling (ModernBERT's `classifier_pooling`,
mean for the others). Texts are sorted by token length into batches, so padding is minimal, and returned
in input order.
"""

import numbers
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from tokenizers import Encoding, normalizers

from . import load_tokenizer
from .checkpoint import Checkpoint, load_model, read_json_object, read_modules, read_safetensors, resolve
from .pooling import parse_modes, pool, read_pooling_config
from .tokenizer import check_count, text_list

# torch activation class (as sentence-transformers saves it in 2_Dense/config.json) -> MLX function
DENSE_ACTIVATIONS = {
    "Identity": lambda x: x,
    "Tanh": mx.tanh,
    "GELU": nn.gelu,
    "ReLU": nn.relu,
    "SiLU": nn.silu,
    "Sigmoid": mx.sigmoid,
}
PROGRESS_MIN_BATCHES = 8  # show_progress_bar=None shows a bar from this many batches on, when stderr is a TTY
# On the CPU, a batch runs in slices whose largest activation (float32) stays within about one core's L2 cache.
CPU_SLICE_BYTES = 3 * 2**19


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


def similarity(a, b) -> np.ndarray:
    """Cosine similarity of every row of `a` with every row of `b`: (N, D) x (M, D) -> (N, M) float32.
    A single vector (D,) on either side drops that axis."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    na = a / np.maximum(np.linalg.norm(a, axis=-1, keepdims=True), 1e-12)
    nb = b / np.maximum(np.linalg.norm(b, axis=-1, keepdims=True), 1e-12)
    return na @ nb.T


class SentenceEncoder:
    """Texts -> embeddings, like `sentence_transformers.SentenceTransformer(path).encode(texts)`.

    `path_or_repo`: a local folder (float or quantized, e.g. from `python -m convert`) or a hub id, read
    from the huggingface_hub cache. `dtype` casts the weights ("float16", ...); `pooling` ("mean", "cls",
    "max", "mean_sqrt_len_tokens", "weightedmean", "lasttoken", or a list / "cls+mean" to concatenate)
    replaces the stored or natural pooling.
    """

    def __init__(self, path_or_repo: str | Path, dtype=None, pooling=None, revision: str | None = None):
        self.path = resolve(path_or_repo, revision)
        self.dense: list[Dense] = []
        self.normalize = False
        self.include_prompt = True
        kinds = [(module_kind(kind, self.path / "modules.json"), folder) for kind, folder in read_modules(self.path)]
        transformer = Checkpoint.open(next((folder for kind, folder in kinds if kind == "Transformer"), self.path))
        self.model = load_model(transformer, dtype=dtype, task="encoder")
        self.tokenizer = load_tokenizer(self.model, transformer)
        self.pooling = self.read_modules(kinds, pooling)
        self.read_sentence_config(transformer)
        width = len(self.pooling) * self.model.args.hidden_size
        self.dimension = self.dense[-1].linear.weight.shape[0] if self.dense else width
        # None: each batch in one forward pass. Chosen for the default device at construction; see slices().
        self.slice_bytes: int | None = CPU_SLICE_BYTES if mx.default_device() == mx.cpu else None

    def read_modules(self, kinds: list[tuple[str, Path]], pooling) -> tuple[str, ...]:
        modes = None
        for kind, folder in kinds:
            if kind == "Pooling":
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
                f"{self.path} has no sentence-transformers pooling config (modules.json, 1_Pooling/config.json); "
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
        st_config = read_json_object(self.path / "config_sentence_transformers.json")
        self.prompts: dict[str, str] = st_config.get("prompts") or {}
        self.default_prompt_name: str | None = st_config.get("default_prompt_name")

    def choose_prompt(self, prompt_name: str | None, prompt: str | None) -> str:
        if prompt is not None:
            if not isinstance(prompt, str):
                raise TypeError(f"encode() prompt must be a str, got {type(prompt).__name__}: {prompt!r:.60}")
            return prompt
        prompt_name = prompt_name or self.default_prompt_name
        if prompt_name is None:
            return ""
        if prompt_name not in self.prompts:
            raise ValueError(
                f"Prompt name {prompt_name!r} is not in {self.path / 'config_sentence_transformers.json'}; "
                f"available prompts: {', '.join(self.prompts) or 'none'}"
            )
        return self.prompts[prompt_name]

    def prompt_length(self, prompt: str) -> int:
        """Tokens of the prompt that pooling skips when include_prompt is false (its trailing [SEP] is not)."""
        if not prompt or self.include_prompt:
            return 0
        encoding = self.tokenizer.encode_batch([prompt], truncation=False)[0]
        return len(encoding.ids) - (1 if encoding.special_tokens_mask[-1] else 0)

    def tokenize(self, texts: list[str]) -> list[Encoding]:
        encodings = self.tokenizer.encode_batch(texts, truncation=True, max_length=self.max_seq_length)
        truncated = sum(1 for e in encodings if e.overflowing)
        if truncated:
            warnings.warn(
                f"{truncated} of {len(texts)} texts are longer than max_seq_length={self.max_seq_length} tokens "
                "and were truncated",
                UserWarning,
                stacklevel=4,  # the caller of encode()
            )
        return encodings

    def embed(self, batch: dict[str, mx.array], prompt_length: int, normalize: bool) -> mx.array:
        """One padded batch -> (B, D) float32 embeddings (lazy)."""
        out = self.model(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"))
        mask = batch["attention_mask"]
        pooled_mask = mask if not prompt_length else mask * (mx.arange(mask.shape[1]) >= prompt_length)
        x = pool(out.last_hidden_state.astype(mx.float32), pooled_mask, self.pooling, mask)
        for dense in self.dense:
            x = dense(x.astype(dense.linear.weight.dtype)).astype(mx.float32)
        if self.normalize or normalize:
            x = x / mx.maximum(mx.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
        return x

    def encode(
        self,
        texts: str | list[str],
        batch_size: int = 32,
        normalize_embeddings: bool = False,
        show_progress_bar: bool | None = None,
        prompt_name: str | None = None,
        prompt: str | None = None,
        convert_to_numpy: bool = True,
    ) -> np.ndarray | mx.array:
        """Embeddings of `texts` as float32 (N, D) (numpy, or mx.array with convert_to_numpy=False);
        a single str gives (D,), an empty list (0, D).

        Each item must be a str (TypeError naming the index otherwise). An empty string is encoded like
        sentence-transformers encodes it: as the special tokens alone ([CLS] [SEP]). `prompt`, or the named
        prompt from config_sentence_transformers.json (`prompt_name`, else its default_prompt_name), is
        prepended to every text. Texts longer than `max_seq_length` tokens are truncated, with one warning.
        """
        single = isinstance(texts, str)
        texts = text_list(texts, "encode()")
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"encode() takes strings; item {i} is {type(text).__name__}: {text!r:.60}")
        check_count("encode() batch_size", batch_size, 1)
        self.check_max_seq_length()
        prefix = self.choose_prompt(prompt_name, prompt)
        vectors = self.run(
            [prefix + t for t in texts], batch_size, normalize_embeddings, show_progress_bar, self.prompt_length(prefix)
        )
        vectors = vectors[0] if single else vectors
        return vectors if convert_to_numpy else mx.array(vectors)

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

    def run(self, texts: list[str], batch_size: int, normalize: bool, progress: bool | None, prompt_length: int):
        out = np.zeros((len(texts), self.dimension), np.float32)
        if not texts:
            return out
        encodings = self.tokenize(texts)
        order = np.argsort([-len(e.ids) for e in encodings], kind="stable")  # longest first: memory peaks early
        starts = range(0, len(texts), batch_size)
        if progress is None:
            progress = len(starts) >= PROGRESS_MIN_BATCHES and sys.stderr.isatty()
        pending = None
        for start in self.progress(starts, progress):
            batch = order[start : start + batch_size]
            for rows in self.slices(batch, [len(encodings[i]) for i in batch]):
                vectors = self.embed(self.tokenizer.pad([encodings[i] for i in rows]), prompt_length, normalize)
                mx.async_eval(vectors)  # the next slice is padded while this one computes
                if pending is not None:
                    out[pending[0]] = np.array(pending[1])
                pending = (rows, vectors)
        out[pending[0]] = np.array(pending[1])
        return out

    def slices(self, rows: np.ndarray, lengths: list[int]) -> Iterator[np.ndarray]:
        """Split a batch (`lengths`: token counts of `rows`) into the row groups that run as one forward pass.

        With `slice_bytes` set (the default on the CPU), each group is as large as keeps a layer's largest
        activation (float32) within that many bytes, so every op works on data in cache; see README,
        Performance. Embeddings do not depend on the grouping, beyond float rounding. A GPU runs the whole
        batch in one pass.
        """
        if self.slice_bytes is None:
            yield rows
            return
        start = 0
        while start < len(rows):
            longest = max(lengths[start:])  # lengths[start] when sorted, as run() sorts them
            per_row = 4 * self.model.args.activation_elements(longest)
            count = max(1, self.slice_bytes // max(per_row, 1))
            yield rows[start : start + count]
            start += count

    @staticmethod
    def progress(starts: range, show: bool):
        if not show:
            return starts
        from tqdm.auto import tqdm

        return tqdm(starts, desc="Batches", unit="batch")

    similarity = staticmethod(similarity)

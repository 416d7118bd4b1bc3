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

import warnings
from contextlib import nullcontext
from pathlib import Path

import mlx.core as mx
import numpy as np
from tokenizers import Encoding

from .. import load_tokenizer
from ..checkpoint import Checkpoint, load_model, resolve
from ..engine.threads import on_own_thread
from ..models.jina_embeddings_v3 import adapter_key
from ..tokenizer import check_count, token_limit
from .base import DEFAULT_PROMPTS, Embedder, given_inputs, project, text_inputs, warn_truncated
from .folder import apply_sentence_config, message_template, read_folder, role_lengths
from .pooling import parse_modes, pool
from .vectors import SIMILARITIES, check_precision, normalize, quantize_embeddings

MODULES = ("Transformer", "Pooling", "Dense", "Normalize")
OUTPUT_VALUES = ("sentence_embedding", "token_embeddings", None)


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
    if prompt_name is not None and adapter_key(prompt_name) in names:
        return model.adapter_name(prompt_name)
    return next((model.adapter_name(n) for r, n in model.role_adapters.items() if r == role and n in names), None)


def natural_pooling(args) -> tuple[str, ...]:
    architecture = (args.extra.get("architectures") or [""])[0]
    # sentence-transformers' rule: a causal LM's last token is the only one that has seen the whole text (it reads
    # the architecture's name and the config's is_causal, not the attention the model runs)
    is_causal = args.extra.get("is_causal", getattr(args, "is_causal", True))
    if str(architecture).endswith("ForCausalLM") and is_causal is not False:
        return ("lasttoken",)
    if args.model_type == "modernbert":
        return parse_modes(args.classifier_pooling)
    return ("mean",)


class SentenceEncoder(Embedder):
    """Texts -> embeddings, like `sentence_transformers.SentenceTransformer(path).encode(texts)`.

    `path_or_repo`: a local folder (float or quantized, e.g. from `python -m convert` or mlx-embeddings) or a
    hub id, read from the huggingface_hub cache. `dtype` casts the weights ("float16", ...); `pooling` ("mean",
    "cls", "max", "mean_sqrt_len_tokens", "weightedmean", "lasttoken", or a list / "cls+mean" to concatenate)
    replaces the stored or natural pooling. `prompts`, `default_prompt_name`, `similarity_fn_name` and
    `truncate_dim` override those of config_sentence_transformers.json, as sentence-transformers' arguments do.
    `modules` (folder.Module list) replaces modules.json's (a sparse model's dense part, without its last module).
    """

    ROLE = "role"  # encode's `task` names a task adapter: encode_query / encode_document pass the role

    @on_own_thread
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
        modules: list | None = None,
    ):
        self.path = resolve(path_or_repo, revision)
        folder = read_folder(self.path)
        folder.modules = folder.modules if modules is None else modules
        folder.check_kinds(MODULES, "SentenceEncoder")
        transformer = Checkpoint.open(folder.transformer)
        self.model = load_model(transformer, dtype=dtype, task="encoder")
        self.tokenizer = load_tokenizer(self.model, transformer)
        self.pooling, self.include_prompt = self.read_pooling(folder, pooling)
        pooled = len(self.pooling) * self.model.args.output_size
        self.dense, self.normalize = folder.projection("sentence_embedding", "SentenceEncoder", pooled)
        self.max_seq_length = token_limit(
            self.tokenizer, self.model.args.max_tokens, folder.sentence_config.get("max_seq_length")
        )
        apply_sentence_config(self.tokenizer, folder.sentence_config)
        self.role_lengths = role_lengths(folder.sentence_config, self.tokenizer, self.model.args.max_tokens)
        self.chat_template = message_template(folder, self.tokenizer)  # texts read as user messages
        self.read_prompts(folder, DEFAULT_PROMPTS, prompts, default_prompt_name)
        self.similarity_fn_name = similarity_fn_name or folder.similarity_fn_name(SIMILARITIES, self.DEFAULT_SIMILARITY)
        self.truncate_dim: int | None = folder.settings.get("truncate_dim") if truncate_dim is None else truncate_dim
        if self.truncate_dim is not None:
            check_count("truncate_dim", self.truncate_dim, 1)
        width = len(self.pooling) * self.model.args.output_size
        self.dimension = self.dense[-1].linear.weight.shape[0] if self.dense else width
        self.merge_adapters = False  # task adapters: added at each adapted module (True: merged into the weights)

    def read_pooling(self, folder, pooling) -> tuple[tuple[str, ...], bool]:
        """(pooling modes, include_prompt): the Pooling module's, replaced by `pooling` when given; a folder without
        one (or whose Pooling folder lacks its config.json, as mlx-embeddings leaves it) gets the natural one."""
        found = next((m for m in folder.modules if m.kind == "Pooling"), None)
        saved = found.read() if found is not None else None
        include_prompt = saved.include_prompt if saved is not None else True
        if pooling is not None:
            return parse_modes(pooling), include_prompt
        if saved is not None:
            return saved.modes, include_prompt
        where = "modules.json, 1_Pooling/config.json"
        if found is not None:
            where = f"{found.folder.relative_to(self.path)}/config.json, listed in modules.json, is missing"
        modes = natural_pooling(self.model.args)
        warnings.warn(
            f"{self.path} has no sentence-transformers pooling config ({where}); "
            f"using {'+'.join(modes)} pooling. Pass SentenceEncoder(..., pooling=...) to choose another.",
            UserWarning,
            stacklevel=3,
        )
        return modes, include_prompt

    def get_embedding_dimension(self) -> int:
        """The width of `encode`'s vectors: `dimension`, cut to `truncate_dim` when that is set."""
        return self.dimension if self.truncate_dim is None else min(self.dimension, self.truncate_dim)

    get_sentence_embedding_dimension = get_embedding_dimension  # sentence-transformers' older name

    def prompt_length(self, prompt: str) -> int:
        """Tokens of the prompt, its trailing special token ([SEP]) aside: those pooling skips when
        include_prompt is false. Counted within `max_seq_length`, as sentence-transformers counts them: a prompt
        longer than the window leaves its last token (the [SEP]) to pool, never nothing."""
        if not prompt:
            return 0
        encoding = self.tokenizer.encode_batch([prompt], truncation=True, max_length=self.max_seq_length)[0]
        return len(encoding.ids) - (1 if encoding.special_tokens_mask[-1] else 0)

    def tokenize(
        self, texts: list[str], prompt: str = "", max_length: int | None = None, direction: str | None = None,
        role: str | None = None,
    ) -> list[Encoding]:  # fmt: skip
        """`texts` as the model reads them, `prompt` before each (see `input_prompt`), cut to `max_seq_length`
        tokens (or a shorter `max_length`) at the tokenizer's `truncation_side` or `direction`'s end; an
        encoding's `overflowing` is non-empty where it was cut. The inputs of `run_encodings`."""
        limit = self.role_limit(role) if max_length is None else min(self.role_limit(role), max_length)
        if self.chat_template is not None:  # a user message each, the prompt a system message before it
            system = [{"role": "system", "content": prompt}] if prompt else []
            conversations = [[*system, {"role": "user", "content": t}] for t in texts]
            return self.chat_template.encode(conversations, limit, direction, task=role)
        texts = [prompt + t for t in texts] if prompt else texts
        return self.tokenizer.encode_batch(texts, truncation=True, max_length=limit, direction=direction)

    def role_limit(self, role: str | None) -> int:
        """The tokens a text keeps: its role's query_length / document_length where the folder sets them, else
        `max_seq_length`."""
        return self.role_lengths.get(role) or self.max_seq_length

    def pooled_prompt_tokens(self, prompt: str) -> int:
        """The tokens of `prompt` that pooling leaves out: none when the model's Pooling includes the prompt."""
        # a prompt read as a system message is pooled with the text, as sentence-transformers pools it
        return 0 if self.include_prompt or self.chat_template is not None else self.prompt_length(prompt)

    def role_prompt_name(self, role: str, task: str | None = None) -> str | None:
        """The role's prompt; where it is empty or missing and the role takes a task adapter, the prompt named after
        that task (jina's published folder: "retrieval.query"), as its authors pair each adapter with its prompt; a
        `task` named by the call: that task's prompt, when the model has one."""
        name = super().role_prompt_name(role)
        if task is None and name is not None and self.prompts[name]:
            return name
        adapter = task_adapter(self.model, task, None, role)
        return next((p for p in self.prompts if adapter and adapter_key(p) == adapter), name)

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

    def embed(
        self, batch: dict[str, mx.array], skipped: int, tokens: bool = False, normalized: bool = True
    ) -> list[mx.array]:
        """One padded batch -> [(B, D) float32 sentence embeddings], plus the (B, L, H) token embeddings with
        `tokens` (lazy). Pooling leaves out the first `skipped` real tokens (an excluded prompt); `normalized`
        False leaves out the model's Normalize module."""
        out = self.model(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"))
        hidden = out.last_hidden_state.astype(mx.float32)
        mask = batch["attention_mask"]
        pooled_mask = mask if not skipped else mask * (mx.cumsum(mask, axis=1) > skipped)  # either padding side
        x = project(pool(hidden, pooled_mask, self.pooling, mask), self.dense, self.normalize and normalized)
        return [x, hidden] if tokens else [x]

    @on_own_thread
    def encode(
        self,
        inputs: str | list[str] | None = None,
        prompt_name: str | None = None,
        prompt: str | None = None,
        batch_size: int = 32,
        show_progress_bar: bool | None = None,
        output_value: str | None = "sentence_embedding",
        precision: str = "float32",
        convert_to_numpy: bool = True,
        convert_to_tensor: bool = False,
        *,  # sentence-transformers' next is `device`: a positional argument past here would mean another setting
        normalize_embeddings: bool = False,
        truncate_dim: int | None = None,
        task: str | None = None,
        role: str | None = None,
        sentences: str | list[str] | None = None,
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
        texts, single = text_inputs(given_inputs(inputs, sentences), batch_size)
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
            texts, batch_size, show_progress_bar, self.pooled_prompt_tokens(prefix), tokens, prefix, adapter, role
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

    def features(self, encoding: Encoding, tokens: np.ndarray, vector: np.ndarray, prompt_length: int | None) -> dict:
        """What `output_value=None` gives for one text: its inputs and outputs, keyed as sentence-transformers'."""
        ids = {
            "input_ids": encoding.ids,
            "token_type_ids": encoding.type_ids,
            "attention_mask": encoding.attention_mask,
        }
        item = {k: mx.array(v, mx.int64) for k, v in ids.items() if k in self.tokenizer.model_input_names}
        item["modality"] = "text" if self.chat_template is None else "message"
        if prompt_length is not None:
            item["prompt_length"] = prompt_length
        item["token_embeddings"] = mx.array(tokens)
        item["sentence_embedding"] = mx.array(vector)
        return item

    def run(
        self, texts: list[str], batch_size: int, show_progress: bool | None, skipped: int, tokens: bool,
        prompt: str = "", adapter: str | None = None, role: str | None = None,
    ) -> tuple[list[Encoding], np.ndarray, list[np.ndarray]]:  # fmt: skip
        """(encodings, (N, D) float32 sentence embeddings, per text its (L, H) token embeddings when `tokens`)."""
        encodings = self.tokenize(texts, prompt, role=role) if texts else []
        warn_truncated(encodings, self.max_seq_length, stacklevel=3)  # run, encode, its caller
        return encodings, *self.run_encodings(encodings, batch_size, show_progress, skipped, tokens, adapter)

    def encodings_pass(
        self, encodings: list[Encoding], skipped: int = 0, tokens: bool = False, normalized: bool = True
    ) -> list[mx.array]:
        """One forward pass of tokenized texts, lazy: `embed` of them padded into one batch."""
        return self.embed(self.tokenizer.pad(encodings), skipped, tokens, normalized)

    def pass_rows(self, encodings: list[Encoding], arrays: list[mx.array]) -> tuple[np.ndarray, list[np.ndarray]]:
        """`encodings_pass`' evaluated `arrays` -> ((B, D) float32 vectors, per text its (L, H) token vectors when
        the pass computed them, else [])."""
        if len(arrays) == 1:
            return np.array(arrays[0]), []
        hidden = np.array(arrays[1])
        real = [self.tokenizer.real_tokens(len(e.ids), hidden.shape[1]) for e in encodings]
        return np.array(arrays[0]), [matrix[keep] for matrix, keep in zip(hidden, real, strict=True)]

    def run_encodings(
        self, encodings: list[Encoding], batch_size: int = 32, show_progress: bool | None = False, skipped: int = 0,
        tokens: bool = False, adapter: str | None = None, normalized: bool = True,
    ) -> tuple[np.ndarray, list[np.ndarray]]:  # fmt: skip
        """`run` of tokenized texts (`tokenize`'s, or anything with `ids` and `type_ids`: a server's batch of many
        requests): ((N, D) float32 sentence embeddings before truncate_dim, per text its (L, H) token embeddings
        when `tokens`). Pooling leaves out each text's first `skipped` tokens (`pooled_prompt_tokens`); the model
        computes with the task adapter `adapter` (`adapter_for`); `normalized` False leaves out its Normalize
        module."""
        out = np.zeros((len(encodings), self.dimension), np.float32)
        token_vectors = [None] * len(encodings) if tokens else []
        if not encodings:
            return out, token_vectors

        def collect(rows: np.ndarray, arrays: list[mx.array]) -> None:
            out[rows], found = self.pass_rows([encodings[i] for i in rows], arrays)
            for i, matrix in zip(rows, found, strict=True) if tokens else ():
                token_vectors[i] = matrix

        def forward(rows: np.ndarray) -> list[mx.array]:
            return self.encodings_pass([encodings[i] for i in rows], skipped, tokens, normalized)

        lengths = [len(e.ids) for e in encodings]
        # a model of task adapters runs each call in its block (None: the active one), so threads never mix them
        with self.model.adapter(adapter, self.merge_adapters) if hasattr(self.model, "adapter") else nullcontext():
            self.batches(lengths, forward, collect, batch_size, show_progress)
        return out, token_vectors

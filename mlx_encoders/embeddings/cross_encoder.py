"""Scores of text pairs with sentence-transformers' semantics: `CrossEncoder(path).predict(pairs)` and `.rank()`.

Matches `sentence_transformers.CrossEncoder` (cross_encoder/model.py of sentence-transformers 6) over a
sequence-classification checkpoint: each (query, document) pair is tokenized as one input (longest-first
truncation to `max_seq_length`) and its logits go through the activation: the one given, else the one saved
with the model (config_sentence_transformers.json or config.json `sentence_transformers.activation_fn`), else
sigmoid for one label and identity for more. `apply_softmax` then softmaxes multi-label scores. Pairs are sorted
by token length into batches and returned in input order; an mx.array stands where it returns a torch tensor.

A causal language model scores as sentence-transformers' `LogitScore` module does (Qwen3-Reranker): its one logit
is the LM head's logit of the "true" token after the pair's last token, minus that of the "false" token. When the
folder's Transformer takes chat messages, each pair is the conversation [query, document] (a prompt: a system
message before them) through the tokenizer's chat template (chat_template.py).
"""

import functools
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from .. import load_tokenizer
from ..chat_template import chat_template_file
from ..checkpoint import Checkpoint, load_model
from ..engine.threads import on_own_thread
from ..tokenizer import Tokenizer, check_count, text_list, token_limit
from .base import Encoder, evaluated, given_inputs
from .folder import (
    DENSE_ACTIVATIONS,
    MODULES_FILE,
    SETTINGS_FILE,
    SentenceFolder,
    apply_sentence_config,
    dense_activation,
    message_template,
    read_folder,
)
from .pooling import last_token


def saved_activation(path: str, source: Path) -> Callable | None:
    """The MLX function of a torch activation saved as a dotted path; None (the default, with a warning) for
    one outside torch, as sentence-transformers without trust_remote_code."""
    if not path.startswith("torch."):
        warnings.warn(
            f"{source}: activation function {path!r} is not a torch activation; using the default activation",
            UserWarning,
            stacklevel=4,
        )
        return None
    try:
        return dense_activation(path, source)
    except ValueError as e:
        raise ValueError(f"{e}. Pass CrossEncoder(..., activation_fn=...) an MLX function instead.") from None


def mlx_activation(fn: Callable | None) -> Callable | None:
    """`fn`, or the MLX function of a torch activation (`torch.nn.Sigmoid()`, as sentence-transformers' docs pass
    one, or `torch.sigmoid`), which torch would refuse to apply to an mx.array."""
    inner = fn.func if isinstance(fn, functools.partial) else fn
    owner = inner if inspect.isroutine(inner) else type(inner)  # a function, or a module's class
    module = getattr(owner, "__module__", None) or ""
    if fn is None or not (module == "torch" or module.startswith("torch.")):
        return fn
    name = getattr(owner, "__name__", "")
    known = {key.lower(): key for key in DENSE_ACTIVATIONS}
    # torch's own settings only (a module's repr names them; Softmax over the last axis of (N, labels) logits)
    mapped = name.lower() in known and inner is fn
    if mapped and not inspect.isroutine(fn):
        mapped = repr(fn) in (repr(type(fn)()), "Softmax(dim=-1)", "Softmax(dim=1)")
    if not mapped:
        raise TypeError(
            f"activation_fn {fn!r} is a torch function, which cannot score MLX arrays: pass an MLX one (mx.sigmoid, "
            f"...) or one of torch's {', '.join(DENSE_ACTIVATIONS)} with its default settings"
        )
    return DENSE_ACTIVATIONS[known[name.lower()]]


def pair_list(inputs) -> tuple[list[tuple[str, str]], bool]:
    """(pairs, whether `inputs` was one pair): a pair is a list or tuple of two str, as sentence-transformers
    takes one when its first item is not itself a list or tuple (a numpy array of strings: its rows)."""
    if isinstance(inputs, np.ndarray):
        inputs = inputs.tolist()
    single = isinstance(inputs, (list, tuple)) and len(inputs) > 0 and not isinstance(inputs[0], (list, tuple))
    items = [inputs] if single else text_list(inputs, "predict()")
    for i, pair in enumerate(items):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2 or not all(isinstance(t, str) for t in pair):
            raise TypeError(f"predict() takes (str, str) pairs; item {i} is {type(pair).__name__}: {pair!r:.60}")
    return [tuple(pair) for pair in items], single


@dataclass
class LogitScore:
    """sentence-transformers' `LogitScore`: (B, vocab) next-token logits -> (B, 1) scores, the true token's logit
    minus the false token's (the true token's alone without one)."""

    true_token_id: int
    false_token_id: int | None = None

    def __call__(self, logits: mx.array) -> mx.array:
        scores = logits[:, self.true_token_id]
        return (scores if self.false_token_id is None else scores - logits[:, self.false_token_id])[:, None]


MODULES = ("Transformer", "LogitScore")  # a classifier's folder lists its Transformer alone


def read_logit_score(folder: SentenceFolder, task: str) -> dict | None:
    """The LogitScore config of a folder whose modules.json lists one, {} for a causal LM (`task`) without
    modules.json (sentence-transformers scores it with "yes" and "no"), None for a sequence classifier."""
    found = next((m for m in folder.modules if m.kind == "LogitScore"), None)
    if found is not None:
        return found.read()
    if not folder.modules and task == "causal-lm":
        return {}
    return None


def logit_score(config: dict, tokenizer: Tokenizer, source: Path, vocab_size: int) -> LogitScore:
    """The LogitScore of `config`, its tokens "yes" and "no" when it names none (sentence-transformers' default);
    an id outside the LM head's `vocab_size` logits (negative ones count from the end, as torch's) is refused."""
    if "true_token_id" in config:
        ids = {"true_token_id": config["true_token_id"], "false_token_id": config.get("false_token_id")}
        for name, value in ids.items():
            if (value is not None or name == "true_token_id") and (
                isinstance(value, bool) or not isinstance(value, int) or not -vocab_size <= value < vocab_size
            ):
                raise ValueError(
                    f"{source}: the LogitScore module's {name} must be a token id of the model's {vocab_size} "
                    f"(its LogitScore config.json), got {value!r}"
                )
        return LogitScore(*(None if v is None else v % vocab_size for v in ids.values()))
    true, false = (tokenizer.token_id(t) for t in ("yes", "no"))
    if true is None or false is None:
        raise ValueError(
            f"{source} holds a causal language model to score with the logits of the tokens 'yes' and 'no', but its "
            "tokenizer lacks them; add a LogitScore module (modules.json, 1_LogitScore/config.json with "
            "true_token_id and false_token_id) naming the tokens to use"
        )
    return LogitScore(true, false)


NEW_HEAD_HINT = "; pass num_labels= to start a new head on its transformer"
EMBEDDER_HINT = (
    ": this folder embeds texts (SentenceEncoder; `mlx-encoders embed`), compared by their similarity. Scoring "
    "pairs needs a cross-encoder checkpoint, or a new head on its transformer (num_labels=) trained first"
)


class CrossEncoder(Encoder):
    """(query, document) pairs -> scores, like `sentence_transformers.CrossEncoder(path)`.

    `path_or_repo`: a folder or hub id of a sequence-classification checkpoint (float or quantized). `dtype`
    casts the weights; `num_labels` sets the labels of the head, creating one (untrained, with a warning) on a
    checkpoint without it; `max_length` caps the tokens of a pair (default: sentence_bert_config.json, else the
    tokenizer's limit, within the model's positions); `activation_fn` (an MLX function of the logits) replaces
    the saved or default activation; `prompts` and `default_prompt_name` as in config_sentence_transformers.json.
    """

    @on_own_thread
    def __init__(
        self,
        path_or_repo: str | Path,
        dtype=None,
        revision: str | None = None,
        *,
        num_labels: int | None = None,
        max_length: int | None = None,
        activation_fn: Callable | None = None,
        prompts: dict[str, str] | None = None,
        default_prompt_name: str | None = None,
    ):
        checkpoint = Checkpoint.open(path_or_repo, revision)
        self.path = checkpoint.path
        folder = read_folder(self.path)
        others = [m for m in folder.modules if m.kind not in MODULES]
        if others:  # only a new head on the transformer runs: the folder's own modules after it do not
            if num_labels is None:
                hint = EMBEDDER_HINT if "Pooling" in folder.kinds else NEW_HEAD_HINT
                folder.check_kinds(MODULES, "CrossEncoder", hint)
            names = ", ".join(f"{m.kind} ({m.folder.name})" for m in others)
            warnings.warn(
                f"{self.path / MODULES_FILE}: {names} not run; CrossEncoder scores with a classification head on the "
                "transformer",
                UserWarning,
                stacklevel=2,
            )
        score = read_logit_score(folder, checkpoint.task)
        if score is not None and num_labels not in (None, 1):
            raise ValueError(
                f"{self.path} scores with the logits of its LM head: one label, not num_labels={num_labels}"
            )
        task = "sequence-classification" if score is None else "causal-lm"
        self.model = load_model(
            checkpoint, dtype=dtype, task=task, num_labels=None if score is not None else num_labels
        )
        self.tokenizer = load_tokenizer(self.model, checkpoint)
        apply_sentence_config(self.tokenizer, folder.sentence_config)
        self.logit_score = (
            None if score is None else logit_score(score, self.tokenizer, self.path, self.model.args.vocab_size)
        )
        self.chat_template = message_template(folder, self.tokenizer)
        if self.chat_template is not None and (failure := self.chat_template.pair_roles_failure()):
            raise ValueError(
                f"The chat template of {chat_template_file(self.path)} cannot carry a (query, document) pair "
                f"({failure}): a pair is read as a 'query' and a 'document' message. Give the model a template that "
                "renders both roles (a chat_template.jinja beside it), e.g.\n"
                '    <Query>: {{ messages | selectattr("role", "eq", "query") | map(attribute="content") | first }}\n'
                '    <Document>: {{ messages | selectattr("role", "eq", "document") | map(attribute="content") '
                "| first }}"
            )
        self.read_prompts(folder, (), prompts, default_prompt_name)
        default = self.default_activation(folder.settings, checkpoint.config)
        self.activation_fn = mlx_activation(activation_fn) or default
        saved_length = folder.sentence_config.get("max_seq_length")
        self.max_seq_length = token_limit(self.tokenizer, self.model.args.max_tokens, max_length, saved_length)

    @property
    def num_labels(self) -> int:
        return 1 if self.logit_score is not None else self.model.args.num_labels

    @property
    def max_length(self) -> int:
        """sentence-transformers' CrossEncoder name of `max_seq_length` (the tokens a pair keeps); settable."""
        return self.max_seq_length

    @max_length.setter
    def max_length(self, value: int) -> None:
        self.max_seq_length = value

    def default_activation(self, st_config: dict, config: dict) -> Callable:
        saved = [
            (st_config.get("activation_fn"), self.path / SETTINGS_FILE),
            ((config.get("sentence_transformers") or {}).get("activation_fn"), self.path / "config.json"),
            (config.get("sbert_ce_default_activation_function"), self.path / "config.json"),  # before v4
        ]
        for path, source in saved:
            if path and (function := saved_activation(path, source)) is not None:
                return function
        return mx.sigmoid if self.num_labels == 1 else DENSE_ACTIVATIONS["Identity"]

    @on_own_thread
    def predict(
        self,
        inputs=None,
        prompt_name: str | None = None,
        prompt: str | None = None,
        batch_size: int = 32,
        show_progress_bar: bool | None = None,
        activation_fn: Callable | None = None,
        apply_softmax: bool = False,
        convert_to_numpy: bool = True,
        convert_to_tensor: bool = False,
        *,
        sentences=None,
    ):
        """Scores of a (query, document) pair or a list of them: float32 numpy (N,) for one label, (N, labels)
        for more (a single pair gives one row); `convert_to_tensor` one mx.array, `convert_to_numpy=False` a list
        of mx.arrays. The logits go through `activation_fn` (default: the model's), then softmax with
        `apply_softmax` when there are several labels. The prompt is prepended to each pair's first text.
        """
        pairs, single = pair_list(given_inputs(inputs, sentences, "predict()"))
        check_count("predict() batch_size", batch_size, 1)
        prefix = self.input_prompt(prompt_name, prompt, caller="predict()")
        scores = self.activate(self.logits(pairs, prefix, batch_size, show_progress_bar), activation_fn, apply_softmax)
        if self.num_labels == 1:
            scores = scores.squeeze(-1)
        if convert_to_tensor:
            out = evaluated(scores)
        elif convert_to_numpy:
            out = np.array(scores.astype(mx.float32))
        else:
            out = evaluated(list(scores))
        return out[0] if single else out

    def activate(
        self, logits: mx.array, activation_fn: Callable | None = None, apply_softmax: bool = False
    ) -> mx.array:
        """`predict`'s scores of (N, num_labels) logits (`encoding_logits`'): `activation_fn` (default the model's),
        then a softmax with `apply_softmax` when there are several labels; still (N, num_labels)."""
        scores = (mlx_activation(activation_fn) or self.activation_fn)(logits)
        return mx.softmax(scores, axis=-1) if apply_softmax and self.num_labels > 1 else scores

    def logits(
        self, pairs: list[tuple[str, str]], prompt: str, batch_size: int, show_progress: bool | None
    ) -> mx.array:
        """(N, num_labels) float32 logits in input order, batches of similar token lengths."""
        if not pairs:
            return mx.zeros((0, self.num_labels))
        return mx.array(self.encoding_logits(self.tokenize(pairs, prompt), batch_size, show_progress))

    def tokenize(self, pairs: list[tuple[str, str]], prompt: str = "", direction: str | None = None) -> list:
        """Each pair as the model reads it (the inputs of `encoding_logits`), cut to `max_seq_length` (`overflowing`
        non-empty where cut), longest text first, at the tokenizer's `truncation_side` or `direction`'s end:
        through the chat template as a [system prompt,] query, document conversation (cut at the right, it keeps
        the template's tail), else as a text pair, the prompt before the query."""
        self.check_max_seq_length()
        if not pairs:
            return []
        if self.chat_template is None:
            firsts, seconds = zip(*pairs, strict=True)
            firsts = [prompt + a for a in firsts]
            return self.tokenizer.encode_batch(
                firsts, list(seconds), max_length=self.max_seq_length, direction=direction
            )
        system = [{"role": "system", "content": prompt}] if prompt else []
        conversations = [
            system + [{"role": "query", "content": q}, {"role": "document", "content": d}] for q, d in pairs
        ]
        return self.chat_template.encode(conversations, self.max_seq_length, direction)

    def encoding_logits(self, encodings: list, batch_size: int, show_progress: bool | None = False) -> np.ndarray:
        """(N, num_labels) float32 logits of tokenized pairs (anything with `ids` and `type_ids`, e.g. a server's
        batch of many requests), in input order."""
        out = np.zeros((len(encodings), self.num_labels), np.float32)

        def forward(rows: np.ndarray) -> list[mx.array]:
            batch = self.tokenizer.pad([encodings[i] for i in rows])
            if self.logit_score is not None:  # the LM head on each row's last token only: the next token's logits
                hidden = self.model.encode(batch["input_ids"], batch["attention_mask"]).last_hidden_state
                last = last_token(hidden, batch["attention_mask"].astype(hidden.dtype))
                return [self.logit_score(self.model.predict_tokens(last).astype(mx.float32))]
            result = self.model(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"))
            return [result.logits.astype(mx.float32)]

        def collect(rows: np.ndarray, arrays: list[mx.array]) -> None:
            out[rows] = np.array(arrays[0])

        self.batches([len(e.ids) for e in encodings], forward, collect, batch_size, show_progress)
        return out

    def rank(
        self,
        query: str,
        documents: list[str],
        top_k: int | None = None,
        return_documents: bool = False,
        prompt_name: str | None = None,
        prompt: str | None = None,
        batch_size: int = 32,
        show_progress_bar: bool | None = None,
        activation_fn: Callable | None = None,
    ) -> list[dict]:
        """`documents` by score against `query`, best first: [{"corpus_id": int, "score": float}, ...] (plus
        "text" with `return_documents`), the first `top_k` of them (all with None). One-label models only."""
        if self.num_labels != 1:
            raise ValueError(
                "CrossEncoder.rank() only works for models with num_labels=1. "
                "Consider using CrossEncoder.predict() with input pairs instead."
            )
        documents = text_list(documents, "rank()")  # one str: one document, not its characters
        pairs = [[query, document] for document in documents]
        scores = self.predict(
            pairs, prompt_name, prompt, batch_size, show_progress_bar, activation_fn, convert_to_tensor=True
        ).tolist()
        results = []
        for i, score in enumerate(scores):
            results.append({"corpus_id": i, "score": score, **({"text": documents[i]} if return_documents else {})})
        return sorted(results, key=lambda r: r["score"], reverse=True)[:top_k]

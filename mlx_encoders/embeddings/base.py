"""What every encoder shares: its inputs checked, prompts (the folder's, the arguments', `encode_query` and
`encode_document`), the token limit, similarity by name, and batches through `engine.batching`. Each encoder
(sentence.py, sparse.py, multi_vector.py, cross_encoder.py, bge_m3.py) adds only its own pass and output.

Prompts follow sentence-transformers 6 (base/model.py: `encode_query`, `encode_document`, prompt resolution).
"""

import numbers
import warnings
from collections.abc import Callable, Sequence

import mlx.core as mx
import numpy as np

from ..engine import runtime
from ..engine.batching import (
    default_least_tokens,
    default_slice_bytes,
    pass_rows,
    row_cost,
    run_batches,
    run_continuous,
)
from ..tokenizer import check_count, text_list
from .folder import Dense, SentenceFolder
from .vectors import SIMILARITIES, check_similarity_name, normalize


def evaluated(x):
    """`x` (an array, or a list of them) computed: a lazy array belongs to the stream, and so the thread, that made
    it, and a caller may read a result on another thread (an app's thread pool)."""
    mx.eval(x)
    return x


DEFAULT_PROMPTS = ("query", "document")  # sentence-transformers defines both, empty unless a folder sets them
DOCUMENT_PROMPTS = ("document", "passage", "corpus")  # encode_document takes the first one defined


def given_inputs(inputs, sentences, caller: str = "encode()"):
    """The texts a call was given: `inputs` (sentence-transformers 6's name), or `sentences` (its older one)."""
    if sentences is not None and inputs is not None:
        raise TypeError(f"{caller} got both inputs and sentences (its older name): pass one")
    return inputs if sentences is None else sentences  # None is refused with the other non-texts


def text_inputs(sentences, batch_size: int | None = None, caller: str = "encode()") -> tuple[list[str], bool]:
    """(texts, whether `sentences` was a single str): each item must be a str (a TypeError names the index);
    `batch_size`, when given, an int >= 1."""
    single = isinstance(sentences, str)
    texts = text_list(sentences, caller)
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"{caller} takes strings; item {i} is {type(text).__name__}: {text!r:.60}")
    if batch_size is not None:
        check_count(f"{caller} batch_size", batch_size, 1)
    return texts, single


def task_prompt_name(prompts: dict[str, str], task: str | None) -> str | None:
    """The prompt `encode_query` (task "query": "query") or `encode_document` (the first of DOCUMENT_PROMPTS) picks
    when none is given, if the model has it; None for plain `encode`."""
    if task == "query":
        return "query" if "query" in prompts else None
    if task == "document":
        return next((name for name in DOCUMENT_PROMPTS if name in prompts), None)
    return None


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


def project(x: mx.array, dense: list[Dense], normalized: bool) -> mx.array:
    """The Dense modules in turn (float32, as sentence-transformers runs them), then Normalize when the model has it
    (`SentenceFolder.projection`)."""
    for module in dense:
        x = module(x.astype(mx.float32))
    return normalize(x) if normalized else x


def warn_truncated(encodings: Sequence, limit: int, stacklevel: int, name: str | None = "max_seq_length") -> None:
    """One warning for the texts cut to `limit` tokens (`overflowing` set), `stacklevel` frames above the caller
    (itself 1): at the caller of `encode()`. `name` names the limit, None for a limit with no setting of its own."""
    truncated = sum(1 for e in encodings if e.overflowing)
    if truncated:
        warnings.warn(
            f"{truncated} of {len(encodings)} texts are longer than {f'{name}={limit}' if name else limit} tokens "
            "and were truncated",
            UserWarning,
            stacklevel=stacklevel + 1,
        )


class Encoder:
    """The shared part of every encoder. A subclass sets `path`, `model` (whose batches `batches` runs) and
    `max_seq_length`, and calls `read_prompts` if it takes prompts. `slice_bytes` and `slice_tokens` are the CPU
    slicing of `engine.batching`, settable."""

    prompts: dict[str, str] = {}
    default_prompt_name: str | None = None
    _slice_bytes: int | None = -1  # run_batches' "the engine's default"
    _slice_tokens: int | None = None

    def read_prompts(
        self, folder: SentenceFolder, defaults: tuple[str, ...], prompts: dict | None, default_prompt_name: str | None
    ) -> None:
        self.prompts, self.default_prompt_name = folder.prompts(defaults, prompts, default_prompt_name)

    def input_prompt(
        self, prompt_name: str | None = None, prompt: str | None = None, role: str | None = None,
        caller: str = "encode()",
    ) -> str:  # fmt: skip
        """The prompt a call prepends to each text: `prompt`, else the one named `prompt_name`, else (`role` "query"
        or "document") the one `encode_query` or `encode_document` picks, else the default prompt, else ""."""
        if role is not None and prompt_name is None and prompt is None:
            prompt_name = self.role_prompt_name(role)
        return resolve_prompt(self.prompts, self.default_prompt_name, prompt_name, prompt, caller)

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

    @property
    def slice_bytes(self) -> int | None:
        """The most bytes a slice's largest activation takes on the CPU (`engine.batching`; None: each batch in one
        forward pass). The engine's default for the default device unless set."""
        return default_slice_bytes() if self._slice_bytes == -1 else self._slice_bytes

    @slice_bytes.setter
    def slice_bytes(self, value: int | None) -> None:
        self._slice_bytes = value

    @property
    def slice_tokens(self) -> int:
        """The least tokens the forward passes that share one dequantizing of the weights hold on the CPU, all
        together: `engine.batching.default_least_tokens` of the model, looked at on each use so that a model
        quantized in memory counts; 0 for a float model or on a GPU. Settable."""
        return default_least_tokens(self.model) if self._slice_tokens is None else self._slice_tokens

    @slice_tokens.setter
    def slice_tokens(self, tokens: int) -> None:
        self._slice_tokens = tokens

    def batches(
        self,
        lengths: Sequence[int],
        forward: Callable[[np.ndarray], list[mx.array]],
        collect: Callable[[np.ndarray, list[mx.array]], None],
        batch_size: int,
        show_progress: bool | None = False,
    ) -> None:
        """`engine.batching.run_batches` over items of token counts `lengths`, with this encoder's slicing."""
        run_batches(
            self.model, lengths, forward, collect, batch_size, show_progress=show_progress,
            slice_bytes=self.slice_bytes, least_tokens=self.slice_tokens,
        )  # fmt: skip

    def pass_size(self, batch_size: int) -> Callable[[int], int]:
        """length -> the items one forward pass of `batches` holds whose longest has `length` tokens."""
        return pass_rows(self.model, batch_size, self.slice_bytes, self.slice_tokens)

    def row_cost(self) -> Callable[[int], float]:
        """length -> a row's share of a forward pass's time, padded to `length` (`engine.batching.row_cost`): what
        a server weighs the passes it runs side by side with."""
        return row_cost(self.model.args)

    def continuous(
        self,
        next_rows: Callable[[list | None], object],
        forward: Callable[[object], list[mx.array]],
        collect: Callable[[object, list[mx.array]], None],
    ) -> None:
        """`engine.batching.run_continuous`: forward passes drawn one at a time by `next_rows(drawn)` (sized by
        `pass_size`, this encoder's slicing; `drawn`: the group's passes so far, as there) until it returns None, as
        a server's queue draws them."""
        run_continuous(next_rows, forward, collect)


class Embedder(Encoder):
    """An encoder of texts into embeddings: `encode(inputs, prompt_name, prompt, ...)` defined by the subclass,
    which sets `dimension` and `similarity_fn_name`.

    `SIMILARITIES` maps the similarity names it computes to (every row with every row, row i with row i);
    `ROLE` is the keyword `encode_query` / `encode_document` pass to `encode` ("task", or "role" where a task means
    something else).
    """

    SIMILARITIES: dict[str, tuple[Callable, Callable]] = SIMILARITIES
    DEFAULT_SIMILARITY = "cosine"  # what `similarity_fn_name = None` sets, as sentence-transformers' default
    ROLE = "task"

    def role_prompt_name(self, role: str, task: str | None = None) -> str | None:
        """The prompt `encode_query` (role "query") or `encode_document` ("document") picks when none is given
        (`task`: an encoder's task adapter, where `ROLE` is not "task")."""
        return task_prompt_name(self.prompts, role)

    def given_task(self, kwargs: dict) -> str | None:
        """The task adapter a call names, for encoders whose `task` is one (their role is passed apart)."""
        return kwargs.get("task") if self.ROLE != "task" else None

    def encode_query(
        self,
        inputs: str | list[str] | None = None,
        prompt_name: str | None = None,
        prompt: str | None = None,
        *args,  # encode's next positional parameters
        **kwargs,
    ):
        """`encode` for queries: the "query" prompt unless one is given (sentence-transformers defines it, empty,
        for every model, so the default prompt never applies here)."""
        if prompt_name is None and prompt is None:
            prompt_name = self.role_prompt_name("query", self.given_task(kwargs))
        return self.encode(inputs, prompt_name, prompt, *args, **{self.ROLE: "query", **kwargs})

    def encode_document(
        self,
        inputs: str | list[str] | None = None,
        prompt_name: str | None = None,
        prompt: str | None = None,
        *args,  # encode's next positional parameters
        **kwargs,
    ):
        """`encode` for documents: the first of the "document", "passage" and "corpus" prompts unless one is given."""
        if prompt_name is None and prompt is None:
            prompt_name = self.role_prompt_name("document", self.given_task(kwargs))
        return self.encode(inputs, prompt_name, prompt, *args, **{self.ROLE: "document", **kwargs})

    @property
    def similarity_fn_name(self) -> str:
        """How `similarity` scores: one of the names in the encoder's `SIMILARITIES`."""
        return self._similarity_fn_name

    @similarity_fn_name.setter
    def similarity_fn_name(self, name) -> None:
        """A name, sentence-transformers' `SimilarityFunction`, or None: the encoder's default."""
        name = self.DEFAULT_SIMILARITY if name is None else name
        self._similarity_fn_name = check_similarity_name(name, self.SIMILARITIES)

    def similarity(self, embeddings1, embeddings2) -> mx.array:
        """(N, M) float32 scores of every row of `embeddings1` with every row of `embeddings2`, by
        `similarity_fn_name`; a single vector (or matrix, for a multi-vector model) counts as one row."""
        runtime.claim_mlx()  # a child forked after MLX ran: a clear error, never a hang
        return evaluated(self.SIMILARITIES[self.similarity_fn_name][0](embeddings1, embeddings2))

    def similarity_pairwise(self, embeddings1, embeddings2) -> mx.array:
        """(N,) float32 scores of row i with row i, by `similarity_fn_name`."""
        runtime.claim_mlx()
        return evaluated(self.SIMILARITIES[self.similarity_fn_name][1](embeddings1, embeddings2))

    def get_embedding_dimension(self) -> int:
        """The width of `encode`'s vectors."""
        return self.dimension

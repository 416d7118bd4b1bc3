"""Conversations through a checkpoint's chat template, as transformers' `apply_chat_template` renders and tokenizes
them and sentence-transformers 6 feeds them to a causal-LM reranker (base/modules/transformer.py).

The template is `chat_template.jinja` (transformers 5) or tokenizer_config.json's `chat_template` (earlier), rendered
in transformers' sandboxed Jinja environment (trim_blocks, lstrip_blocks, loop controls, its `tojson` and
`raise_exception`) with the special tokens as variables, then tokenized without special tokens. A render cut at
`max_length` gets the template's fixed tail (the assistant prefix a reranker reads its answer after) written back
over its last tokens, as sentence-transformers does: the tail is the longest token suffix two renders with
different fillers share.
"""

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from .checkpoint.files import read_json_object
from .tokenizer import SPECIAL, Tokenizer

# Fillers of the two renders whose common token suffix is the template's tail (sentence-transformers' own).
FILLERS = ("0", "1 2 3 4")
# A pair, then one varying only the query, one only the document: a role whose change leaves the render as it was
# never reaches the model (sentence-transformers' PAIR_ROLE_PROBES)
PAIR_PROBES = (("alpha", "bravo"), ("charlie", "bravo"), ("alpha", "foxtrot"))


@dataclass
class Tokens:
    """A tokenized render: what batching and padding read of a `tokenizers.Encoding` (ids, type ids), and the
    tokens truncation cut off (`overflowing`: non-empty when it was cut)."""

    ids: list[int]
    type_ids: list[int]
    overflowing: list = field(default_factory=list)

    @property
    def attention_mask(self) -> list[int]:
        return [1] * len(self.ids)


def chat_template_file(folder: Path) -> Path:
    """The file `read_chat_template` reads the template from."""
    file = folder / "chat_template.jinja"
    return file if file.is_file() else folder / "tokenizer_config.json"


def read_chat_template(folder: Path) -> str | None:
    """The folder's chat template: chat_template.jinja, else tokenizer_config.json's (its "default" when it names
    several); None without one."""
    file = folder / "chat_template.jinja"
    if file.is_file():
        return file.read_text(encoding="utf-8")
    template = read_json_object(folder / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        template = next(
            (t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None
        )
    return template if isinstance(template, str) else None


def template_variables(source: str) -> set[str]:
    """The variables a template reads that it does not set itself."""
    import jinja2.ext
    import jinja2.meta

    return jinja2.meta.find_undeclared_variables(jinja2.Environment(extensions=[jinja2.ext.loopcontrols]).parse(source))


def compile_template(source: str):
    """The template in transformers' environment: sandboxed, blocks trimmed, its filters and globals."""
    try:
        import jinja2
        import jinja2.ext  # loopcontrols: a submodule `import jinja2` alone does not load
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
        raise ImportError("Rendering a chat template needs jinja2: pip install 'jinja2>=3.1.6'") from e

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return env.from_string(source)


class ChatTemplate:
    """A tokenizer's chat template: `encode(conversations, max_length)` -> one `Tokens` per conversation."""

    def __init__(self, source: str, tokenizer: Tokenizer):
        self.template = compile_template(source)
        self.tokenizer = tokenizer
        # transformers passes the special tokens as template variables (`bos_token`, `eos_token`, ...)
        self.variables = {name: getattr(tokenizer, name) for name in SPECIAL if getattr(tokenizer, name) is not None}
        self.tails: dict[str, list[int]] = {}
        # sentence-transformers passes the call's task ("query", "document") to a template that reads one
        self.declares_task = "task" in template_variables(source)

    def pair_roles_failure(self) -> str | None:
        """Why the template cannot carry a (query, document) pair as messages of those roles, or None when it can
        (a template that knows system, user and assistant alone renders neither)."""
        try:
            base, *varied = (
                self.render([{"role": "query", "content": q}, {"role": "document", "content": d}])
                for q, d in PAIR_PROBES
            )
        except Exception as e:  # any error of the template's own code is the answer
            return f"it raised {type(e).__name__}: {e}"
        dropped = [role for role, render in zip(("query", "document"), varied, strict=True) if render == base]
        return f"the {' and '.join(map(repr, dropped))} content does not reach the rendered prompt" if dropped else None

    def render(self, messages: list[dict], task: str | None = None) -> str:
        given = {"task": task} if task is not None and self.declares_task else {}
        return self.template.render(messages=messages, tools=None, documents=None, add_generation_prompt=False,
                                    **self.variables, **given)  # fmt: skip

    def encode(
        self, conversations: list[list[dict]], max_length: int, direction: str | None = None, task: str | None = None
    ) -> list[Tokens]:
        """Each conversation rendered (with `task`, for a template that reads one) and tokenized, cut to
        `max_length` at `direction`'s end (default the tokenizer's truncation_side): cut at the left, a render
        keeps its tail as it is."""
        texts = [self.render(messages, task) for messages in conversations]
        direction = direction or self.tokenizer.truncation_side
        encodings = self.tokenizer.encode_batch(
            texts, truncation=True, max_length=max_length, add_special_tokens=False, direction=direction
        )
        out = []
        for messages, e in zip(conversations, encodings, strict=True):
            ids = list(e.ids)
            if direction == "right" and len(ids) >= max_length:  # possibly cut: the tail goes back over the last
                tail = self.tail(messages, task)[-len(ids) :]
                ids[len(ids) - len(tail) :] = tail
            out.append(Tokens(ids, [0] * len(ids), list(e.overflowing)))
        return out

    def tail(self, messages: list[dict], task: str | None = None) -> list[int]:
        """The token suffix every render of this conversation's shape ends with (system messages kept as they
        are); [] when the two renders never differ."""
        skeletons = [
            [m if m.get("role") == "system" else {**m, "content": filler} for m in messages] for filler in FILLERS
        ]
        key = json.dumps([task, skeletons[0]], sort_keys=True)
        if key not in self.tails:
            first, second = (
                e.ids
                for e in self.tokenizer.encode_batch(
                    [self.render(s, task) for s in skeletons], truncation=False, add_special_tokens=False
                )
            )
            count = 0
            for a, b in zip(reversed(first), reversed(second), strict=False):  # the renders differ in length
                if a != b:
                    break
                count += 1
            self.tails[key] = list(first[len(first) - count :]) if 0 < count < min(len(first), len(second)) else []
        return self.tails[key]

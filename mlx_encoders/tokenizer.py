"""A small wrapper over `tokenizers.Tokenizer` that behaves like transformers' fast tokenizers.

It reads `tokenizer.json` (which reproduces transformers' ids exactly), or builds the same tokenizer from a
SentencePiece model when a checkpoint ships only that (see spm.py), takes the special tokens from
`tokenizer_config.json` / `special_tokens_map.json`, and returns mx.array batches.
"""

import base64
import json
import numbers
import re
import threading
from collections.abc import Iterable, Iterator, Mapping, Set
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np
from tokenizers import AddedToken, Encoding, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as FastTokenizer

from . import spm
from .jsonfile import read_json_object

SPECIAL = ("cls_token", "sep_token", "pad_token", "mask_token", "unk_token", "bos_token", "eos_token")
# A role's token when the config names none: BERT's spelling, then RoBERTa's (transformers' class defaults)
DEFAULT_SPECIAL = {"cls_token": ("[CLS]", "<s>"), "sep_token": ("[SEP]", "</s>"), "pad_token": ("[PAD]", "<pad>"),
                   "mask_token": ("[MASK]", "<mask>"), "unk_token": ("[UNK]", "<unk>")}  # fmt: skip
# The tokenizer classes whose defaults these are (a config may name its class; bert-base-uncased names none)
DEFAULTING_CLASSES = r"Bert|Roberta|Electra|MPNet|Deberta|Albert|Camembert|Longformer|Bart|XLM"
# The tokenizer classes that build their normalizer from tokenizer_config.json (do_lower_case, default true;
# strip_accents; tokenize_chinese_chars, default true) over tokenizer.json's, and their model types (a config may
# name no class); and those that set their ByteLevel pre-tokenizer's add_prefix_space from it
WORDPIECE_CLASSES = {"bert": "Bert", "distilbert": "DistilBert", "electra": "Electra", "mpnet": "MPNet",
                     "nomic_bert": "Bert"}  # fmt: skip
BYTE_LEVEL_CLASSES = {
    "roberta": "Roberta",
    "gpt2": "GPT2",
    "longformer": "Longformer",
    "bart": "Bart",
    "deberta": "Deberta",
}
# the byte-level classes that transformers 5 reads as RobertaTokenizer, which rebuilds its post-processor too
ROBERTA_PROCESSING_CLASSES = ("Roberta", "Longformer", "Bart")
# model types whose tokenizer transformers reads from tokenizer.json as it is, whatever class a config names
AS_SAVED_MODEL_TYPES = ("modernbert",)
# transformers uses 1e30 as "no limit" in tokenizer_config.json
NO_LIMIT = int(1e29)
USIZE_MAX = 2**32 - 1
# transformers' clean_up_tokenization: spaces that WordPiece decoding leaves before punctuation.
CLEANUPS = [(" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
            (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")]  # fmt: skip


def _content(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def check_count(name: str, value, minimum: int) -> None:
    """A TypeError unless `value` is an int, a ValueError unless it is >= `minimum`; both name the argument."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= {minimum}, got {type(value).__name__}: {value!r:.40}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")


def token_limit(tokenizer: "Tokenizer", max_tokens: int | None, *preferred: int | None) -> int:
    """The longest input a front end cuts to: the first of `preferred` that is set (an argument, a saved
    max_seq_length), else the tokenizer's model_max_length; at most `max_tokens` (the model's position table)."""
    limit = next((n for n in preferred if n), tokenizer.model_max_length)
    return min(limit, max_tokens) if max_tokens else limit


def text_list(texts, caller: str) -> list:
    """`texts` (a str, or a list or other ordered iterable of inputs) as a list; a TypeError for anything else."""
    if isinstance(texts, str):
        return [texts]
    if isinstance(texts, Mapping):
        hint = " (its keys would be taken as the texts); pass list(texts.values()) to use its values"
    elif isinstance(texts, Set):
        hint = " (a set has no order, so results could not be matched to inputs); pass a list"
    elif isinstance(texts, (bytes, bytearray)) or not isinstance(texts, Iterable):
        hint = ""
    else:
        return list(texts)
    raise TypeError(f"{caller} takes a str or a list of str, got {type(texts).__name__}{hint}")


def check_texts(texts: list, words: bool = False) -> None:
    """Fail on an item `tokenizers` cannot take, naming its index (tokenizers' own message names neither).
    With `words`, each item is a list of str words (pre-split text)."""
    for i, item in enumerate(texts):
        if words and not isinstance(item, (list, tuple)):
            raise TypeError(f"Pre-split inputs must be lists of str words, got {type(item).__name__} for item {i}")
        parts = item if words or (isinstance(item, tuple) and len(item) == 2) else (item,)
        for part in parts:
            if not isinstance(part, str):
                raise TypeError(
                    f"Tokenizer inputs must be str (or (str, str) pairs), got {type(part).__name__} for item {i}: "
                    f"{part!r:.60}"
                )
            check_unicode(part, i)


def check_unicode(text: str, index: int) -> None:
    """A lone surrogate (half of a UTF-16 pair) cannot be encoded as UTF-8, which `tokenizers` needs."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"Item {index} is not valid Unicode: it holds a lone surrogate {text[e.start]!r} at character "
            f"{e.start} (often from a JSON \\ud800 escape or bytes decoded with errors='surrogateescape'). "
            "Replace it first, e.g. text.encode('utf-8', 'replace').decode('utf-8')"
        ) from None


def precompiled_charsmap(normalizer: dict) -> bytes:
    """The SentencePiece character map of a tokenizer.json normalizer (a Precompiled one, alone or in a
    Sequence); b"" without one."""
    if normalizer.get("type") == "Precompiled":
        return base64.b64decode(normalizer.get("precompiled_charsmap") or "")
    return next((m for n in normalizer.get("normalizers") or [] if (m := precompiled_charsmap(n or {}))), b"")


def side(config: dict, key: str) -> str:
    """tokenizer_config.json's `key` ("left" or "right"; "right" when unset)."""
    value = config.get(key) or "right"
    if value not in ("left", "right"):
        raise ValueError(f"tokenizer_config.json: {key} must be 'left' or 'right', got {value!r}")
    return value


TEMPLATE_FILE = "chat_template.jinja"
# A pair with a text longer than this many characters a token is clipped before it is cut (`clipped_pair`).
CLIP_CHARACTERS = 4
# Tokens a clip keeps past those truncation can keep: the text's new edge, whose tokens may differ, stays outside.
CLIP_MARGIN = 8
# Tokens a clip moves its cut by at most to reach the edge of the word it falls in (a word without end is cut inside).
CLIP_WORD_REACH = 128


def clip(text: str, encoding: Encoding, count: int, direction: str) -> str:
    """`text` cut to its first `count` tokens (its last, for `direction` "left") and the rest of the word the cut
    falls in. Tokenized again, its tokens are the whole text's: a word split anew from a cut inside it could split
    otherwise (WordPiece's greedy pieces start from the word's first letter)."""
    offsets, words = encoding.offsets, encoding.word_ids
    if count >= len(offsets):
        return text
    if direction == "left":
        start = len(offsets) - count
        first = start
        while first > 0 and words[first - 1] == words[start] and start - first < CLIP_WORD_REACH:
            first -= 1
        return text[offsets[first][0] :]
    end = count - 1
    last = end
    while last + 1 < len(offsets) and words[last + 1] == words[end] and last - end < CLIP_WORD_REACH:
        last += 1
    return text[: offsets[last][1]]


def clipped_pair(backend: FastTokenizer, pair: tuple[str, str], limit: int, direction: str) -> tuple[str, str]:
    """The pair with each long text clipped to CLIP_MARGIN tokens more than `limit`: all that longest-first
    truncation to `limit` keeps of it, and more, so the cut still shows. That truncation gives the longer text the
    odd token, so the clipped texts keep which one is longer; the pair comes back whole where a few tries do not
    get there."""
    encodings = [backend.encode(text, add_special_tokens=False) for text in pair]
    full = [len(e.ids) for e in encodings]
    keep = limit + CLIP_MARGIN
    if max(full) <= keep:
        return pair
    first_longer = full[0] > full[1]
    want = [min(n, keep) for n in full]
    if first_longer and want[0] <= want[1]:
        want[0] = want[1] + 1
    if not first_longer and want[0] > want[1]:
        want[1] = want[0]
    for _ in range(4):
        texts = [clip(pair[i], encodings[i], want[i], direction) for i in (0, 1)]
        counts = [len(backend.encode(t, add_special_tokens=False).ids) if w < n else n
                  for t, w, n in zip(texts, want, full, strict=True)]  # fmt: skip
        enough = all(c > limit or c == n for c, n in zip(counts, full, strict=True))
        if enough and (counts[0] > counts[1]) == first_longer:
            return texts[0], texts[1]
        grow = 0 if first_longer else 1  # the side that must be longer grows past the other
        want[grow] = min(full[grow], want[grow] + abs(counts[0] - counts[1]) + 1)
    return pair


class Tokenizer:
    """Callable like a transformers tokenizer: `tok(texts, text_pair=None, padding=True, truncation=True)`."""

    def __init__(self, backend: FastTokenizer, config: dict, model_max_length: int, token_types: bool = True):
        self.backend = backend
        # the backend's truncation setting is state of its own: a thread's would cut another thread's texts
        self.truncation_lock = threading.Lock()
        self.model_max_length = model_max_length
        self.model_input_names = ["input_ids", "attention_mask"] + (["token_type_ids"] if token_types else [])
        self.config = dict(config)  # tokenizer_config.json and special_tokens_map.json, written back by save()
        self.template_file: str | None = None  # chat_template.jinja's text (transformers 5), written back by save()
        # transformers 5 skips the clean-up for BPE models, whose text it corrupts (it was made for WordPiece)
        bpe = type(backend.model).__name__ == "BPE" and not config.get(
            "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
        )
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False)) and not bpe
        # Decoders used as encoders (Qwen3-Embedding) pad on the left, so every row ends with a real token.
        self.padding_side = side(config, "padding_side")
        # the end an over-long text is cut at when a call names none, as transformers' tokenizers read it
        self.truncation_side = side(config, "truncation_side")
        for name in SPECIAL:
            setattr(self, name, _content(config.get(name)))
        self.default_special_tokens()
        self.register_named_special_tokens()
        self.backend.no_padding()
        self.backend.no_truncation()
        # transformers' split_special_tokens: a special token typed in a text is read as text
        self.backend.encode_special_tokens = bool(config.get("split_special_tokens", False))

    def register_named_special_tokens(self) -> None:
        """The named special tokens a file keeps in its vocabulary alone, and the extra ones (added, at new ids where
        the vocabulary lacks them), or either listed as added but not special, made special (their flags kept), as
        transformers registers them: kept whole when typed in a text, left out by decode's skip_special_tokens."""
        added = {t.content: t for t in self.backend.get_added_tokens_decoder().values()}
        vocabulary = self.backend.get_vocab(with_added_tokens=False)
        extra = spm.extra_special_tokens(self.config)
        register = []
        for token in dict.fromkeys(t for t in [getattr(self, name) for name in SPECIAL] + extra if t):
            found = added.get(token)
            if found is None and (token in vocabulary or token in extra):
                register.append(AddedToken(token, special=True, normalized=False))
            elif found is not None and not found.special:
                flags = {k: getattr(found, k) for k in spm.FLAGS if k != "special"}
                register.append(AddedToken(token, special=True, **flags))
        self.backend.add_special_tokens(register)

    def default_special_tokens(self) -> None:
        """The roles the config files leave unnamed (bert-base-uncased's name none), filled as the BERT and RoBERTa
        families' tokenizer classes default them: from the tokenizer's own special tokens, in WordPiece's or BPE's
        spelling. A role the config names (null included), or a tokenizer of another class, keeps its value."""
        kind = self.config.get("tokenizer_class")
        if kind is not None and not re.search(DEFAULTING_CLASSES, str(kind)):
            return
        special = {t.content for t in self.backend.get_added_tokens_decoder().values() if t.special}
        for name, spellings in DEFAULT_SPECIAL.items():
            if name not in self.config:
                setattr(self, name, next((s for s in spellings if s in special), None))

    def apply_class_options(self, model_type: str | None) -> None:
        """tokenizer_config.json's options that transformers' tokenizer classes apply over tokenizer.json: a
        WordPiece class's lowercasing, accent stripping and Chinese characters, a byte-level class's
        add_prefix_space (their defaults when unset), and a SentencePiece class's (ALBERT, XLM-R, DeBERTa-v2)
        whole normalizer and pre-tokenizer, which transformers 5 builds from the class and these options as it
        builds them from the SentencePiece model (`spm`), the file's character map kept."""
        if model_type in AS_SAVED_MODEL_TYPES:
            return
        given = str(self.config.get("tokenizer_class") or "")
        named = re.fullmatch(r"(\w+?)Tokenizer(Fast)?", given)
        kind = named[1] if named else (given or None)  # TokenizersBackend: tokenizer.json as it is
        state = json.loads(self.backend.to_str())
        normalizer, pre_tokenizer = state.get("normalizer") or {}, state.get("pre_tokenizer") or {}
        if (kind or WORDPIECE_CLASSES.get(model_type)) in WORDPIECE_CLASSES.values():
            if normalizer.get("type") == "BertNormalizer":
                self.backend.normalizer = normalizers.BertNormalizer(
                    clean_text=normalizer.get("clean_text", True),
                    handle_chinese_chars=bool(self.config.get("tokenize_chinese_chars", True)),
                    strip_accents=self.config.get("strip_accents"),
                    lowercase=bool(self.config.get("do_lower_case", True)),
                )
        convention = spm.CLASSES.get(f"{kind}Tokenizer") if kind else spm.MODEL_TYPES.get(model_type)
        if convention is not None and (state.get("model") or {}).get("type") == "Unigram":
            steps = spm.normalizer(convention, self.config, precompiled_charsmap(normalizer))
            self.backend.normalizer = steps if steps is not None else normalizers.Sequence([])
            prefix = self.config.get("add_prefix_space", True)
            scheme = "always" if prefix else ("first" if convention == "deberta-v2" else "never")
            self.backend.pre_tokenizer = spm.pre_tokenizer(convention, self.config, scheme)
            self.backend.decoder = decoders.Metaspace(replacement=spm.METASPACE, prepend_scheme=scheme)
        kind_or_type = kind or BYTE_LEVEL_CLASSES.get(model_type)
        if kind_or_type in BYTE_LEVEL_CLASSES.values():
            if pre_tokenizer.get("type") == "ByteLevel":  # the class's default: no prefix space
                self.backend.pre_tokenizer = pre_tokenizers.ByteLevel(
                    add_prefix_space=bool(self.config.get("add_prefix_space", False)),
                    trim_offsets=pre_tokenizer.get("trim_offsets", True),
                    use_regex=pre_tokenizer.get("use_regex", True),
                )
            processor = state.get("post_processor") or {}
            if kind_or_type in ROBERTA_PROCESSING_CLASSES and processor.get("type") == "RobertaProcessing":
                # RobertaTokenizer rebuilds its template with the config's options: they move the offsets alone
                self.backend.post_processor = processors.RobertaProcessing(
                    tuple(processor["sep"]),
                    tuple(processor["cls"]),
                    trim_offsets=bool(self.config.get("trim_offsets", True)),
                    add_prefix_space=bool(self.config.get("add_prefix_space", False)),
                )

    @classmethod
    def from_pretrained(
        cls, path: str | Path, max_positions: int | None = None, token_types: bool = True, model_type: str | None = None
    ):
        """The tokenizer of folder `path` (`model_type`: the model's, else config.json's where it is needed)."""
        tokenizer = cls.read(Path(path), max_positions, token_types, model_type)
        template = Path(path) / TEMPLATE_FILE
        tokenizer.template_file = template.read_text(encoding="utf-8") if template.is_file() else None
        return tokenizer

    @classmethod
    def read(cls, path: Path, max_positions: int | None, token_types: bool, model_type: str | None):
        """`from_pretrained`'s tokenizer, from tokenizer.json or a SentencePiece model."""
        config = {
            **read_json_object(path / "special_tokens_map.json"),
            **read_json_object(path / "tokenizer_config.json"),
        }
        given = config.get("model_max_length") or NO_LIMIT
        if isinstance(given, bool) or not isinstance(given, (int, float)) or not given > 0:
            raise ValueError(
                f"{path / 'tokenizer_config.json'}: model_max_length must be a positive number, got {given!r:.40}; "
                "fix it or remove the key (the model's position table is then the limit)"
            )
        limit = int(min(given, NO_LIMIT))
        if max_positions:
            limit = min(limit, max_positions)
        file = path / "tokenizer.json"
        if file.exists():
            try:
                backend = FastTokenizer.from_file(str(file))
            except Exception as e:  # tokenizers raises a bare Exception for unreadable files
                raise ValueError(f"{file} is not a valid tokenizer file ({e}); re-download or re-save it") from e
            # tokenizer.json's own truncation and padding say the sides and the pad token a config leaves unsaid
            truncation, padding = backend.truncation or {}, backend.padding or {}
            found = {"truncation_side": truncation.get("direction"), "padding_side": padding.get("direction"),
                     "pad_token": padding.get("pad_token")}  # fmt: skip
            config = {**{k: v for k, v in found.items() if v}, **config}
            tokenizer = cls(backend, config, limit, token_types)
            if model_type is None and not config.get("tokenizer_class"):
                model_type = read_json_object(path / "config.json").get("model_type")
            tokenizer.apply_class_options(model_type)
            return tokenizer
        model = spm.find_model(path)
        if model is None:
            raise FileNotFoundError(
                f"No tokenizer.json in {path}, nor a SentencePiece model ({', '.join(spm.FILES)}). mlx_encoders "
                "reads these only (not vocab.txt / vocab.json alone); create tokenizer.json with "
                "`transformers.AutoTokenizer.from_pretrained(folder).save_pretrained(folder)` (for a Hugging Face "
                "cache snapshot, into a copy made with `cp -rL`: the cache's files are shared links), or load the "
                "model alone with `mlx_encoders.load_model`."
            )
        model_type = model_type or read_json_object(path / "config.json").get("model_type")
        kind = spm.convention(config.get("tokenizer_class"), model_type, model)
        backend, specials = spm.build(model, kind, config)
        return cls(backend, {**config, **specials}, limit, token_types)

    def save(self, folder: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json, which transformers' AutoTokenizer reads, and the chat
        template file the tokenizer was loaded with."""
        folder = Path(folder)
        try:
            self.backend.save(str(folder / "tokenizer.json"))
        except Exception as e:  # the tokenizers library raises a bare Exception, a full disk's "(os error 28)" too
            message = f"could not write {folder / 'tokenizer.json'}: {e}"
            found = re.search(r"\(os error (\d+)\)", str(e))
            raise (OSError(int(found[1]), message) if found else OSError(message)) from e
        config = {**self.config, "model_max_length": self.model_max_length}
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        if self.template_file is not None:
            (folder / TEMPLATE_FILE).write_text(self.template_file, encoding="utf-8")

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def mask_token_id(self) -> int | None:
        return self.token_id(self.mask_token)

    @property
    def pad_token_id(self) -> int:
        pad = self.token_id(self.pad_token)
        return 0 if pad is None else pad

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def max_id(self) -> int:
        """The largest id the tokenizer can produce: the model's ids are 0..n-1, added tokens may lie beyond."""
        return max([self.backend.get_vocab_size(with_added_tokens=False) - 1, *self.backend.get_added_tokens_decoder()])

    def num_special_tokens_to_add(self, pair: bool = False) -> int:
        """Special tokens the post-processor adds to one text (or to a pair), as transformers' method."""
        return self.backend.num_special_tokens_to_add(pair)

    def encode_batch(
        self, text, text_pair=None, truncation: bool | str = True, max_length: int | None = None,
        add_special_tokens: bool = True, stride: int = 0, is_split_into_words: bool = False,
        direction: str | None = None,
    ) -> list[Encoding]:  # fmt: skip
        """Raw `tokenizers` encodings (ids, offsets, word ids) for a list of texts or pairs (or, with
        `is_split_into_words`, of lists of words). `truncation`: True (longest first), False, or a strategy
        ("longest_first", "only_first", "only_second"); `direction` "left" cuts a text's start instead of its end
        (transformers' `truncation_side`; None: tokenizer_config.json's, else the end)."""
        texts = text_list(text, "The tokenizer")
        if text_pair is not None:
            pairs = text_list(text_pair, "The tokenizer's text_pair")
            if len(pairs) != len(texts):
                raise ValueError(f"Got {len(texts)} texts but {len(pairs)} text pairs")
            texts = list(zip(texts, pairs, strict=True))
        check_texts(texts, words=is_split_into_words)
        if truncation:  # tokenizers takes a machine-size length: a larger "no limit" becomes the largest it takes
            strategy = "longest_first" if truncation is True else truncation
            limit = min(max_length or self.model_max_length, USIZE_MAX)
            added = self.backend.num_special_tokens_to_add(text_pair is not None) if add_special_tokens else 0
            if limit < added:  # tokenizers would leave every input whole
                raise ValueError(
                    f"max_length {limit} leaves no room: the tokenizer adds {added} special tokens to every input; "
                    f"use a max_length of at least {added}"
                )  # fmt: skip
        direction = direction or self.truncation_side
        options = dict(max_length=limit, stride=stride, strategy=strategy, direction=direction) if truncation else None
        # a pair cut longest-first makes a window for every two windows of its texts: long texts go in clipped
        clip = text_pair is not None and truncation and strategy == "longest_first" and not stride
        with self.truncating(options) as backend:
            if clip and any(len(t) > CLIP_CHARACTERS * limit for pair in texts for t in pair):
                backend.no_truncation()
                texts = [clipped_pair(backend, pair, limit, direction) for pair in texts]
                backend.enable_truncation(**options)
            return backend.encode_batch(
                texts, is_pretokenized=is_split_into_words, add_special_tokens=add_special_tokens
            )

    @contextmanager
    def truncating(self, options: dict | None) -> Iterator[FastTokenizer]:
        """The backend, truncating with `options` (`enable_truncation`'s; None: not truncating) for the block, one
        thread at a time."""
        with self.truncation_lock:
            if options is not None:
                self.backend.enable_truncation(**options)
            try:
                yield self.backend
            finally:
                self.backend.no_truncation()

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "truncation_lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, truncation_lock=threading.Lock())
        # the tokenizers library does not keep this setting in its own state
        self.backend.encode_special_tokens = bool(self.config.get("split_special_tokens", False))

    def encode_windows(self, text: str, text_pair: str, max_length: int, stride: int) -> list[Encoding]:
        """A pair whose second text is split into windows of at most `max_length` tokens that overlap by
        `stride` tokens, as transformers' `truncation="only_second", return_overflowing_tokens=True`."""
        with self.truncating(dict(max_length=max_length, stride=stride, strategy="only_second")) as backend:
            first = backend.encode(text, text_pair)
        return [first, *first.overflowing]

    def __call__(
        self, text, text_pair=None, padding: bool | str = True, truncation: bool = True,
        max_length: int | None = None, return_tensors: str = "mlx",
    ) -> dict:  # fmt: skip
        """Token ids, attention mask (and token types where the model uses them), padded to the longest text
        (`padding=True`) or to `max_length` (`padding="max_length"`); `return_tensors="np"` gives numpy."""
        encodings = self.encode_batch(text, text_pair, truncation, max_length)
        if padding == "max_length":
            width = max_length or self.model_max_length
            longest = max(range(len(encodings)), key=lambda i: len(encodings[i].ids), default=None)
            if longest is not None and len(encodings[longest].ids) > width:
                raise ValueError(
                    f"input {longest} has {len(encodings[longest].ids)} tokens, more than padding='max_length' pads "
                    f"to ({width}); pass truncation=True to cut it, or a larger max_length"
                )
            return self.pad(encodings, width, return_tensors)
        if not padding and len({len(e.ids) for e in encodings}) > 1:
            raise ValueError("Texts have different lengths; pass padding=True to batch them")
        return self.pad(encodings, return_tensors=return_tensors)

    def pad(self, encodings: list[Encoding], width: int | None = None, return_tensors: str = "mlx") -> dict:
        """Pad raw encodings into one batch of the model's inputs (to the longest, or to `width`), on
        `padding_side`: each row's tokens are `batch[name][row, real_tokens(len(ids), width)]`."""
        width = width or max((len(e.ids) for e in encodings), default=0)
        batch = {name: np.zeros((len(encodings), width), dtype=np.int32) for name in self.model_input_names}
        batch["input_ids"][:] = self.pad_token_id
        for row, e in enumerate(encodings):
            real = self.real_tokens(len(e.ids), width)
            batch["input_ids"][row, real] = e.ids
            batch["attention_mask"][row, real] = 1
            if "token_type_ids" in batch:
                batch["token_type_ids"][row, real] = e.type_ids
        if return_tensors == "np":
            return batch
        return {name: mx.array(value) for name, value in batch.items()}

    def real_tokens(self, length: int, width: int) -> slice:
        """The columns of a padded row of `width` that hold its `length` tokens, on `padding_side`."""
        return slice(width - length, width) if self.padding_side == "left" else slice(0, length)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return self.cleaned(self.backend.decode(ids, skip_special_tokens=skip_special_tokens))

    def decode_batch(self, lists: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        """`decode` of each list; the tokenizers library lets other threads run meanwhile (its one-list decode
        holds Python's lock throughout)."""
        return [self.cleaned(t) for t in self.backend.decode_batch(lists, skip_special_tokens=skip_special_tokens)]

    def cleaned(self, text: str) -> str:
        if self.clean_up_tokenization_spaces:
            for old, new in CLEANUPS:
                text = text.replace(old, new)
        return text

    def convert_ids_to_tokens(self, ids) -> list[str]:
        return [self.backend.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens) -> list[int | None]:
        return [self.backend.token_to_id(t) for t in tokens]

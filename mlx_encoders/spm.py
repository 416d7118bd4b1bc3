"""Tokenizers for checkpoints that ship only a SentencePiece model (`spiece.model`, `sentencepiece.bpe.model`,
`spm.model`, no tokenizer.json), equal to the ones transformers 5 builds from the same file.

transformers reads the pieces, scores, unknown id and precompiled charsmap with `SentencePieceExtractor`
(convert_slow_tokenizer.py), reorders the vocabulary with the converter's `convert_from_spm` (XLM-RoBERTa's
fairseq layout), and assembles normalizer, pre-tokenizer, Unigram model and post-processor in the model's
tokenizer class (models/{albert,xlm_roberta,deberta_v2}/tokenization_*.py). This module does the same, reading
the `.model` protobuf with a small wire-format reader so that neither protobuf nor sentencepiece is needed.
"""

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import Unigram

from .jsonfile import read_json_object

FILES = ("spiece.model", "sentencepiece.bpe.model", "spm.model")
SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Each convention's special tokens in transformers' order (the order in which missing ones get new ids).
DEFAULTS = {
    "albert": ("[CLS]", "[SEP]", "<unk>", "[SEP]", "<pad>", "[CLS]", "[MASK]"),
    "xlm-roberta": ("<s>", "</s>", "<unk>", "</s>", "<pad>", "<s>", "<mask>"),
    "deberta-v2": ("[CLS]", "[SEP]", "[UNK]", "[SEP]", "[PAD]", "[CLS]", "[MASK]"),
}
# tokenizer_config.json "tokenizer_class" (without "Fast") or config.json "model_type" -> convention.
CLASSES = {"AlbertTokenizer": "albert", "XLMRobertaTokenizer": "xlm-roberta", "DebertaV2Tokenizer": "deberta-v2"}
# model types whose tokenizer class transformers picks when the config names none
MODEL_TYPES = {"albert": "albert", "xlm-roberta": "xlm-roberta", "deberta-v2": "deberta-v2", "gte": "xlm-roberta",
               "jina_embeddings_v3": "xlm-roberta"}  # fmt: skip
CONTROL, USER_DEFINED = 3, 4  # sentencepiece's SentencePiece.Type values that become added tokens
METASPACE = "\u2581"
FLAGS = (
    "single_word",
    "lstrip",
    "rstrip",
    "normalized",
    "special",
)  # an added token's, as tokenizer_config.json has them


@dataclass
class SentencePieceModel:
    """The fields of sentencepiece's ModelProto (sentencepiece_model.proto) that transformers uses."""

    pieces: list[tuple[str, float, int]]  # (piece, score, type)
    unk_id: int
    precompiled_charsmap: bytes


def find_model(folder: Path) -> Path | None:
    return next((folder / name for name in FILES if (folder / name).is_file()), None)


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of one protobuf message: varints as int, everything else as raw bytes."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 2:
            size, pos = _varint(data, pos)
            value, pos = data[pos : pos + size], pos + size
        elif wire in (1, 5):  # fixed64, fixed32
            size = 8 if wire == 1 else 4
            value, pos = data[pos : pos + size], pos + size
        else:
            raise ValueError(f"unsupported protobuf wire type {wire} for field {number}")
        if pos > len(data):
            raise ValueError("the data ends inside a field")
        yield number, value


def _int32(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value  # negative int32s are 10-byte varints


def read_model(file: Path) -> SentencePieceModel:
    """Pieces (1), trainer_spec.unk_id (2.40) and normalizer_spec.precompiled_charsmap (3.2) of a `.model` file."""
    pieces, unk_id, charsmap, trainer = [], 0, b"", False
    try:
        for number, value in _fields(file.read_bytes()):
            if number == 1:
                piece, score, type_ = "", 0.0, 1  # proto defaults: an empty piece, score 0, type NORMAL
                for field, item in _fields(value):
                    if field == 1:
                        piece = item.decode("utf-8")
                    elif field == 2:
                        score = struct.unpack("<f", item)[0]
                    elif field == 3:
                        type_ = item
                pieces.append((piece, score, type_))
            elif number == 2:
                trainer = True
                unk_id = next((_int32(v) for f, v in _fields(value) if f == 40), unk_id)
            elif number == 3:
                charsmap = next((v for f, v in _fields(value) if f == 2), charsmap)
    except (ValueError, IndexError, TypeError, struct.error, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not a valid SentencePiece model ({e}); re-download it") from e
    if not pieces or not trainer:
        raise ValueError(f"{file} is not a valid SentencePiece model (it lacks pieces or trainer_spec); re-download it")
    return SentencePieceModel(pieces, unk_id, charsmap)


def convention(tokenizer_class: str | None, model_type: str | None, file: Path) -> str:
    """Which transformers tokenizer class builds this file: named in tokenizer_config.json, else by config.json."""
    name = (tokenizer_class or "").removesuffix("Fast")
    if name in CLASSES:
        return CLASSES[name]
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    raise ValueError(
        f"{file} is a SentencePiece model, but neither tokenizer_config.json's tokenizer_class ({tokenizer_class!r}) "
        f"nor config.json's model_type ({model_type!r}) says how to build it. mlx_encoders builds the tokenizers of "
        f"{', '.join(CLASSES)} ({', '.join(DEFAULTS)}); for another, save a tokenizer.json with transformers: "
        "`AutoTokenizer.from_pretrained(folder).save_pretrained(folder)`"
    )


def special_tokens(kind: str, config: dict) -> dict[str, str]:
    """The convention's special tokens, overridden by tokenizer_config.json / special_tokens_map.json."""
    tokens = {}
    for name, default in zip(SPECIAL, DEFAULTS[kind], strict=True):
        value = config.get(name, default)
        tokens[name] = value.get("content") if isinstance(value, dict) else value
    return tokens


def vocabulary(kind: str, model: SentencePieceModel, specials: dict) -> tuple[list[tuple[str, float]], int]:
    """(pieces with scores, unknown id) as transformers gives them to the Unigram model."""
    vocab = [(piece, score) for piece, score, _ in model.pieces]
    if kind == "xlm-roberta":  # fairseq's layout: four specials first, spm's first three dropped, <mask> last
        firsts = [(specials[name], 0.0) for name in ("bos_token", "pad_token", "eos_token", "unk_token")]
        return [*firsts, *vocab[3:], (specials["mask_token"], 0.0)], 3
    if kind == "deberta-v2" and (specials["unk_token"], 0.0) in vocab:
        return vocab, vocab.index((specials["unk_token"], 0.0))
    # transformers' ALBERT class fixes unk_id=1, where ALBERT's own files keep <unk>; the file's own id agrees
    # there and stays right for a file trained with sentencepiece's default layout (<unk> first).
    return vocab, model.unk_id


def normalizer(kind: str, config: dict, charsmap: bytes):
    precompiled = [normalizers.Precompiled(charsmap)] if charsmap else []
    if kind == "xlm-roberta":
        return precompiled[0] if precompiled else None
    if kind == "deberta-v2":  # transformers leaves the charsmap out here
        lower = [normalizers.Lowercase()] if config.get("do_lower_case", False) else []
        spaces = normalizers.Replace(Regex(r"\s{2,}|[\n\r\t]"), " ")
        return normalizers.Sequence([*lower, spaces, normalizers.NFC(), normalizers.Strip(left=False, right=True)])
    steps = [normalizers.Replace("``", '"'), normalizers.Replace("''", '"')]
    if not config.get("keep_accents", False):
        steps += [normalizers.NFKD(), normalizers.StripAccents()]
    if config.get("do_lower_case", True):
        steps.append(normalizers.Lowercase())
    return normalizers.Sequence(steps + precompiled)


def pre_tokenizer(kind: str, config: dict, scheme: str):
    metaspace = pre_tokenizers.Metaspace(replacement=METASPACE, prepend_scheme=scheme)
    if kind == "deberta-v2":
        punctuation = [pre_tokenizers.Punctuation(behavior="isolated")] if config.get("split_by_punct") else []
        return pre_tokenizers.Sequence([*punctuation, metaspace])
    return pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), metaspace])


def post_processor(kind: str, backend: Tokenizer, specials: dict):
    names = ("bos_token", "eos_token") if kind == "xlm-roberta" else ("cls_token", "sep_token")
    cls, sep = specials[names[0]], specials[names[1]]
    ids = [(cls, backend.token_to_id(cls) or 0), (sep, backend.token_to_id(sep) or 0)]
    if kind == "xlm-roberta":
        single, pair = [cls, "$A", sep], [cls, "$A", sep, sep, "$B", sep]
    else:
        single, pair = f"{cls}:0 $A:0 {sep}:0", f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1"
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=ids)


def added_tokens(folder: Path, config: dict, named: set[str]) -> list[AddedToken]:
    """The tokens added to the model's vocabulary after training, in the order of their ids: tokenizer_config.json's
    `added_tokens_decoder`, else transformers 4's added_tokens.json (special where the files name them: `named`)."""
    entries = config.get("added_tokens_decoder")
    if entries is not None:
        where = f"{folder / 'tokenizer_config.json'}: added_tokens_decoder"
        if not isinstance(entries, dict):
            raise ValueError(f"{where} must be an object of id -> token, got {type(entries).__name__}")
        tokens = []
        for key, entry in entries.items():
            if not str(key).isdigit() or not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
                raise ValueError(f"{where}: entry {key!r} must be a token id with an object holding its 'content'")
            flags = {k: bool(entry[k]) for k in FLAGS if k in entry}
            tokens.append((int(key), AddedToken(entry["content"], **flags)))
        return [token for _, token in sorted(tokens, key=lambda pair: pair[0])]
    file = folder / "added_tokens.json"
    ids = read_json_object(file)  # {} when there is none
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids.values()):
        raise ValueError(f"{file} must be an object of token -> id")
    return [
        AddedToken(token, special=token in named, normalized=token not in named)
        for token, _ in sorted(ids.items(), key=lambda pair: pair[1])
    ]


def extra_special_tokens(config: dict) -> list[str]:
    """The special tokens tokenizer_config.json lists beyond the named ones: transformers 5's `extra_special_tokens`
    (a list, or a dict of names), transformers 4's `additional_special_tokens`."""
    listed = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    listed = list(listed.values()) if isinstance(listed, dict) else listed
    tokens = [t.get("content") if isinstance(t, dict) else t for t in listed] if isinstance(listed, list) else []
    return [t for t in tokens if isinstance(t, str) and t]


def build(file: Path, kind: str, config: dict) -> tuple[Tokenizer, dict[str, str]]:
    """The tokenizer transformers builds for `file` under convention `kind` ("albert", "xlm-roberta",
    "deberta-v2") with tokenizer_config.json's options in `config`; also its special tokens by name."""
    model = read_model(file)
    specials = special_tokens(kind, config)
    vocab, unk_id = vocabulary(kind, model, specials)
    backend = Tokenizer(Unigram(vocab, unk_id=unk_id, byte_fallback=False))
    steps = normalizer(kind, config, model.precompiled_charsmap)
    if steps is not None:
        backend.normalizer = steps
    prefix = config.get("add_prefix_space", True)
    scheme = "always" if prefix else ("first" if kind == "deberta-v2" else "never")
    backend.pre_tokenizer = pre_tokenizer(kind, config, scheme)
    backend.decoder = decoders.Metaspace(replacement=METASPACE, prepend_scheme=scheme)
    # As transformers: the tokens added after training by id, then the named special tokens (a missing one gets the
    # next id), then spm's control and user-defined pieces (which have theirs).
    named = list(dict.fromkeys(specials.values()))
    said = {specials[name] for name in SPECIAL if config.get(name) is not None}  # named by the files, not by default
    added = added_tokens(file.parent, config, said)
    added += [AddedToken(t, special=True, normalized=False) for t in named if t not in {a.content for a in added}]
    added += [AddedToken(t, special=True, normalized=False) for t in extra_special_tokens(config)
              if t not in {a.content for a in added}]  # fmt: skip
    added += [
        AddedToken(piece, special=type_ == CONTROL or piece in named, normalized=False)
        for piece, _, type_ in model.pieces
        if type_ in (CONTROL, USER_DEFINED) and piece not in named
    ]
    backend.add_tokens(added)
    backend.post_processor = post_processor(kind, backend, specials)
    return backend, specials

"""Extractive question answering, matching transformers' `QuestionAnsweringPipeline` (transformers 4.x
pipelines/question_answering.py; its span decoding lives on in pipelines/document_question_answering.py as
`select_starts_ends` / `decode_spans`): the same windows, scores and {"score", "start", "end", "answer"}.

A context longer than `max_seq_len` tokens (with the question) is split into windows that overlap by
`doc_stride` tokens; answers from every window compete and the best `top_k` are returned. `max_seq_len` is
capped at the model's positions (longer windows would read past the position table).
"""

import numpy as np
from tokenizers import Encoding

from ..tokenizer import check_count, check_texts
from .base import Pipeline

# Logit given to tokens that cannot be in the answer (question, special and padding tokens).
EXCLUDED = -10000.0


def decode_spans(start: np.ndarray, end: np.ndarray, top_k: int, max_answer_len: int, allowed: np.ndarray):
    """The `top_k` (start, end) spans by start * end probability with start <= end < start + max_answer_len,
    then dropping those that touch a disallowed token (so fewer than `top_k` may come back)."""
    outer = np.matmul(start[:, :, None], end[:, None, :])  # (1, L, L)
    candidates = np.tril(np.triu(outer), max_answer_len - 1)
    flat = candidates.flatten()
    if top_k == 1:
        order = [np.argmax(flat)]
    elif len(flat) <= top_k:
        order = np.argsort(-flat)
    else:
        idx = np.argpartition(-flat, top_k)[0:top_k]
        order = idx[np.argsort(-flat[idx])]
    starts, ends = np.unravel_index(order, candidates.shape)[1:]
    keep = np.isin(starts, allowed.nonzero()) & np.isin(ends, allowed.nonzero())
    starts, ends = starts[keep], ends[keep]
    return starts, ends, candidates[0, starts, ends]


def select_starts_ends(start, end, p_mask, min_null_score: float, top_k: int, impossible: bool, max_answer_len: int):
    """Normalize one window's logits over its context tokens, then decode its best spans."""
    allowed = np.abs(np.array(p_mask) - 1)
    excluded = allowed == 0
    start = np.where(excluded, EXCLUDED, start)[None]
    end = np.where(excluded, EXCLUDED, end)[None]
    start = np.exp(start - start.max(axis=-1, keepdims=True))
    start = start / start.sum()
    end = np.exp(end - end.max(axis=-1, keepdims=True))
    end = end / end.sum()
    if impossible:
        min_null_score = min(min_null_score, (start[0, 0] * end[0, 0]).item())
    start[0, 0] = end[0, 0] = 0.0  # the first (CLS) token scores the null answer only
    starts, ends, scores = decode_spans(start, end, top_k, max_answer_len, allowed)
    return starts, ends, scores, min_null_score


def char_span(encoding: Encoding, s: int, e: int, align_to_words: bool) -> tuple[int, int]:
    """Character span of tokens s..e in the context, widened to whole words when `align_to_words`."""
    if align_to_words:
        try:
            first, last = encoding.token_to_word(s), encoding.token_to_word(e)
            return encoding.word_to_chars(first, sequence_index=1)[0], encoding.word_to_chars(last, 1)[1]
        except Exception:  # some tokenizers have no words (or the token has none): keep to offsets
            pass
    return encoding.offsets[s][0], encoding.offsets[e][1]


class QuestionAnsweringPipeline(Pipeline):
    task = "question-answering"
    head = "question-answering"

    def predict(
        self, question: str | list[str] | dict | list[dict] | None = None, context: str | list[str] | None = None,
        top_k: int = 1, doc_stride: int | None = None, max_answer_len: int = 15, max_seq_len: int | None = None,
        handle_impossible_answer: bool = False, align_to_words: bool = True, *, batch_size: int,
    ):  # fmt: skip
        """Best answer spans of `context` for `question`: {"score", "start", "end", "answer"}, or a list of
        the `top_k` best; lists of questions and contexts (or {"question", "context"} dicts) give one per pair."""
        examples = parse_examples(question, context)
        check_count("top_k", top_k, 1)
        check_count("max_answer_len", max_answer_len, 1)
        windows = self.windows(examples, self.window_length(max_seq_len), doc_stride)
        flat = [w for example in windows for w in example]
        logits = iter(self.forward(flat, batch_size, fields=("start_logits", "end_logits")))
        options = dict(top_k=top_k, impossible=handle_impossible_answer, max_answer_len=max_answer_len)
        results = [
            self.answers(context, example, [next(logits) for _ in example], align_to_words, **options)
            for (_, context), example in zip(examples, windows, strict=True)
        ]
        return results[0] if len(results) == 1 else results

    def window_length(self, max_seq_len: int | None) -> int:
        """`max_seq_len` (default min(model length, 384)), capped at the model's positions."""
        if max_seq_len is None:
            return min(self.max_length, 384)
        check_count("max_seq_len", max_seq_len, 1)
        return min(max_seq_len, self.max_length)

    def windows(self, examples: list[tuple[str, str]], max_seq_len: int, doc_stride: int | None) -> list:
        """Each example's windows: the question, then at most `max_seq_len` tokens in all, the context's
        overlapping by `doc_stride` tokens."""
        if doc_stride is not None:
            check_count("doc_stride", doc_stride, 0)
        check_texts(examples)
        questions = self.tokenizer.encode_batch([q for q, _ in examples], add_special_tokens=False, truncation=False)
        return [
            self.tokenizer.encode_windows(q, c, max_seq_len, self.stride(i, len(e.ids), max_seq_len, doc_stride))
            for i, ((q, c), e) in enumerate(zip(examples, questions, strict=True))
        ]

    def stride(self, index: int, question_tokens: int, max_seq_len: int, doc_stride: int | None) -> int:
        """`doc_stride`, checked against the context tokens a window of question `index` holds; by default
        min(max_seq_len // 2, 128), less where a long question leaves less room."""
        taken = question_tokens + self.tokenizer.num_special_tokens_to_add(pair=True)
        room = max_seq_len - taken  # context tokens per window
        window = f"a window of {max_seq_len} tokens (max_seq_len, at most the model's {self.max_length})"
        if room < 1:
            raise ValueError(
                f"Question {index} takes {taken} tokens with the special tokens, which leaves no room for the context "
                f"in {window}; shorten the question or raise max_seq_len"
            )
        if doc_stride is None:
            return min(max_seq_len // 2, 128, room - 1)
        if doc_stride >= room:
            raise ValueError(
                f"doc_stride ({doc_stride}) must be less than the {room} context tokens of question {index} in "
                f"{window} less its {taken} question and special tokens"
            )
        return doc_stride

    def p_mask(self, encoding: Encoding) -> list[int]:
        """1 where a token cannot be in the answer: all but the context, except the CLS token (null answer)."""
        cls = self.tokenizer.token_id(self.tokenizer.cls_token)
        return [int(seq != 1 and token != cls) for seq, token in zip(encoding.sequence_ids, encoding.ids, strict=True)]

    def answers(self, context: str, windows: list[Encoding], logits: list, align_to_words: bool, top_k: int,
                impossible: bool, max_answer_len: int):  # fmt: skip
        min_null_score = 1000000.0  # large and positive
        answers = []
        for encoding, (start, end) in zip(windows, logits, strict=True):
            starts, ends, scores, min_null_score = select_starts_ends(
                start, end, self.p_mask(encoding), min_null_score, top_k, impossible, max_answer_len
            )
            for s, e, score in zip(starts, ends, scores, strict=True):
                first, last = char_span(encoding, int(s), int(e), align_to_words)
                answers.append({"score": float(score), "start": first, "end": last, "answer": context[first:last]})
        if impossible:
            answers.append({"score": float(min_null_score), "start": 0, "end": 0, "answer": ""})
        answers = sorted(answers, key=lambda a: a["score"], reverse=True)[:top_k]
        return answers[0] if len(answers) == 1 else answers


def parse_examples(question, context) -> list[tuple[str, str]]:
    """(question, context) pairs from strings, equal-length lists, or {"question", "context"} dicts."""
    if isinstance(question, dict):
        question = [question]
    if isinstance(question, list) and question and isinstance(question[0], dict):
        if not all(isinstance(q, dict) and {"question", "context"} <= q.keys() for q in question):
            raise ValueError('question-answering dicts need both "question" and "context" keys')
        question, context = [q["question"] for q in question], [q["context"] for q in question]
    questions = [question] if isinstance(question, str) else question
    contexts = [context] if isinstance(context, str) else context
    if not questions or not contexts:
        raise ValueError("question-answering needs a question and a context")
    if len(questions) == 1 and len(contexts) > 1:  # one question over several contexts
        questions = questions * len(contexts)
    if len(contexts) == 1 and len(questions) > 1:  # several questions about one context
        contexts = contexts * len(questions)
    if len(questions) != len(contexts):
        raise ValueError(f"Got {len(questions)} questions but {len(contexts)} contexts")
    for name, values in (("question", questions), ("context", contexts)):
        for i, value in enumerate(values):
            if not isinstance(value, str):
                raise TypeError(f"`{name}` must be a string; item {i} is {type(value).__name__}: {value!r:.60}")
            if not value:
                raise ValueError(f"`{name}` cannot be empty (item {i})")
    return list(zip(questions, contexts, strict=True))

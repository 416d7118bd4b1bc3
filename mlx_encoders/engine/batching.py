"""The one batching runner of every front end (SentenceEncoder, CrossEncoder, the pipelines; any caller with
tokenized inputs): `run_batches(model, lengths, forward, collect, batch_size)`.

Inputs run longest first, `batch_size` at a time. On the CPU each batch runs in slices whose largest activation
stays within about one core's L2 cache, and the slices run in groups on every core at once (one MLX stream per
core, one pass on each, one async_eval per group, the next group built while one computes); a quantized model's
passes in a group share one dequantizing of each weight, made on the lanes in turn. A group's passes run in step,
so its rows are shared out between them to make the heaviest as light as can be (`balance`), up to a pass a lane
where each holds enough tokens; a call of one pass in all (one text, a few short ones) runs it on the default
stream, its products on every core. Off the CPU each batch is one pass.
Outputs do not depend on the slicing beyond float rounding (tests/test_sentence.py).

`run_continuous` runs passes drawn one at a time by its caller (a server's queue) the same way, each drawn when a
lane frees up, with `pass_rows` telling how many rows a pass of a given length holds.
"""

import functools
import itertools
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import nullcontext
from typing import TypeVar

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .attention import blocks_of_scores
from .quantized import least_group_tokens, shared_dequantized
from .runtime import claim_mlx, forward_lanes, lane_count, on_cpu, warm_heap

PROGRESS_MIN_BATCHES = 8  # show_progress_bar=None shows a bar from this many batches on, when stderr is a TTY
# On the CPU, a batch runs in slices whose largest activation (float32) stays within about one core's L2 cache;
# a group of a quantized model's slices holds at least quantized.least_group_tokens(model) tokens.
CPU_SLICE_BYTES = 3 * 2**19
Rows = TypeVar("Rows")  # what picks a forward pass's rows: index arrays here
# A call's only pass is shared out over the lanes where each of theirs holds a quarter of the model's width in
# (padded) tokens, and this many at least: all-MiniLM-L6-v2 broke even at about 40, wider models later.
LEAST_SHARED_TOKENS = 64


def progress(starts: range, show: bool | None):
    """`starts` behind a tqdm bar when `show`; None shows one from PROGRESS_MIN_BATCHES on, when stderr is a TTY."""
    if show is None:
        show = len(starts) >= PROGRESS_MIN_BATCHES and sys.stderr.isatty()
    if not show:
        return starts
    from tqdm.auto import tqdm

    return tqdm(starts, desc="Batches", unit="batch")


def batch_slices(
    rows: np.ndarray, lengths: list[int], args, slice_bytes: int | None, least_tokens: int = 0
) -> Iterator[np.ndarray]:
    """`rows` (token counts `lengths`, longest first) in slices of as many rows as `slice_rows` allows at each
    slice's longest length; all of them at once when `slice_bytes` is None."""
    if slice_bytes is None:
        yield rows
        return
    start = 0
    while start < len(rows):
        longest = max(lengths[start:])  # lengths[start] when sorted longest first
        count = slice_rows(args, longest, slice_bytes, least_tokens)
        yield rows[start : start + count]
        start += count


def grouped_slices(
    order: np.ndarray,
    lengths: list[int],
    batch_size: int,
    size: int,
    show_progress: bool | None,
    slices: Callable[[np.ndarray, list[int]], Iterable[np.ndarray]],
) -> Iterator[list[np.ndarray]]:
    """`slices(batch, its lengths)` of each batch of `batch_size` rows of `order` (`lengths`: each row's tokens), in
    groups of `size` (a group may take slices of two batches, the last one may be short); the progress bar counts
    batches."""
    group = []
    for start in progress(range(0, len(order), batch_size), show_progress):
        batch = order[start : start + batch_size]
        for rows in slices(batch, [lengths[i] for i in batch]):
            group.append(rows)
            if len(group) == size:
                yield group
                group = []
    if group:
        yield group


def balance(
    group: list[np.ndarray], size: int, lengths: Sequence[int], cap: Callable[[int], int], least_tokens: int = 0
) -> list[np.ndarray]:
    """A group's rows (its slices' in order, longest first) as at most `size` passes of consecutive rows whose
    heaviest (rows x longest length: padded tokens) is as light as can be, each holding at most `cap(its longest
    length)` rows. A group's passes run in step (see `run_continuous`), so its time is its heaviest pass's: a
    batch's remainder beside a full slice, or a group short of a pass a lane, leaves cores waiting. More passes
    than the group had must each hold at least `least_tokens` padded tokens (below that a pass's fixed costs, the
    BLAS packing every weight again and the lanes' start, outweigh the work it takes off the others); failing
    that, fewer passes are tried, down to the group's own count."""
    rows = np.concatenate(group)
    counts = [max(lengths[i], 1) for i in rows]

    def starts(limit: int, most_passes: int) -> list[int] | None:
        """The first row of each pass, each as long as `limit` and `cap` allow; None past `most_passes`."""
        found, start = [], 0
        while start < len(rows):
            most = min(cap(counts[start]), limit // counts[start], len(rows) - start)
            if most < 1 or len(found) == most_passes:
                return None
            found.append(start)
            start += most
        return found

    edges = list(itertools.accumulate((len(g) for g in group), initial=0))
    as_sliced = max((b - a) * counts[a] for a, b in itertools.pairwise(edges))
    if starts(as_sliced, len(group)) is None:  # slices past `cap` (made by another rule): left as they are
        return group
    for most_passes in range(max(size, len(group)), len(group) - 1, -1):
        low, high = 1, as_sliced  # the group as sliced fits
        while low < high:
            middle = (low + high) // 2
            low, high = (low, middle) if starts(middle, most_passes) is not None else (middle + 1, high)
        cuts = [*starts(low, most_passes), len(rows)]
        lightest = min((b - a) * counts[a] for a, b in itertools.pairwise(cuts))
        if len(cuts) - 1 <= len(group) or lightest >= least_tokens:
            return [rows[a:b] for a, b in itertools.pairwise(cuts)]
    return group


def run_in_lanes(
    groups: Callable[[int], Iterable[list[Rows]]],
    forward: Callable[[Rows], list[mx.array]],
    collect: Callable[[Rows, list[mx.array]], None],
) -> None:
    """`collect(rows, forward(rows))` for the slices of every group of `groups(size)` (groups of `size` slices), the
    passes of a group on the CPU's lanes (`runtime.forward_lanes`), one on each, evaluated at once, sharing one
    dequantizing of a quantized model's weights, whose copies the lanes make in turn (two passes on a lane
    interleave their work and leave its cache; copies made on one lane leave the others waiting). A group is built
    while the one before it computes. Off the CPU, one pass a group on the default stream. A call of one pass in
    all (one text, a few short ones) runs it on the default stream, its products on every core: lanes would leave
    all but one idle. `forward` returns lazy arrays; `collect` reads them. The passes' attention may run large
    scores in blocks (`blocks_of_scores`)."""
    with blocks_of_scores():  # forward passes only: attention may take large scores in blocks
        pending: list[tuple[Rows, list[mx.array]]] = []
        warm_heap()
        count = lane_count()
        planned = iter(groups(count))
        ahead = [group for group in (next(planned, None), next(planned, None)) if group is not None]
        one_pass = len(ahead) == 1 and len(ahead[0]) == 1
        streams = nullcontext((mx.default_stream(mx.default_device()),)) if one_pass else forward_lanes()
        with streams as lanes, shared_dequantized(lanes) as float_weights:
            for group in itertools.chain(ahead, planned):
                dispatched = []
                for lane, rows in zip(itertools.cycle(lanes), group):
                    with mx.stream(lane):
                        dispatched.append((rows, forward(rows)))
                float_weights.next_group()
                # one eval: its ops interleave over lanes
                mx.async_eval([a for _, arrays in dispatched for a in arrays])
                for rows, arrays in pending:
                    collect(rows, arrays)
                pending = dispatched
            for rows, arrays in pending:
                collect(rows, arrays)


def slice_rows(args, length: int, slice_bytes: int, slice_tokens: int = 0) -> int:
    """Rows of `length` tokens per forward pass: as many as keep a layer's largest activation (float32, see
    `activation_elements`) within `slice_bytes`, yet at least one, and at least `slice_tokens` tokens in all.
    A quantized model needs the latter: on the CPU each pass dequantizes every weight (quantized.py), a fixed
    cost that passes of a few hundred tokens repeat too often."""
    per_row = 4 * args.activation_elements(length)
    return max(1, slice_bytes // max(per_row, 1), -(-slice_tokens // max(length, 1)))


def row_cost(args) -> Callable[[int], float]:
    """length -> the time a row padded to `length` tokens takes in a forward pass, in tokens' worth of the work that
    grows with tokens (products, norms, activations): `length` plus its attention scores (`length` per token, every
    head) at 1 / hidden_size of a token each, as measured on the CPU lanes (all-MiniLM-L6-v2): a pass of one row
    of 256 tokens takes longer than one of 12 rows of 21, which its tokens alone would call alike."""
    per_score = 1 / args.hidden_size
    return lambda length: length * (1 + length * per_score)


def least_pass_tokens(args) -> int:
    """The least tokens of a sliced pass (where its batch has them): half the model's width. The BLAS packs each
    weight once per product, a cost a wide model's L2-sized slices (a hundred-odd tokens) repeat too often; a narrow
    model does too little work per byte of activation for its slices to leave the cache."""
    return args.hidden_size // 2


def default_slice_bytes() -> int | None:
    """The device policy for slicing: CPU_SLICE_BYTES on the CPU, None (whole batches) elsewhere."""
    return CPU_SLICE_BYTES if on_cpu() else None


def default_least_tokens(model: nn.Module) -> int:
    """The least tokens a group of passes holds: `least_group_tokens(model)` on the CPU (a quantized model's passes
    share one dequantizing), 0 elsewhere."""
    return least_group_tokens(model) if on_cpu() else 0


def pass_floor(args, least_tokens: int, group: int, sliced: bool) -> int:
    """The least tokens one of a group of `group` passes holds: its share of `least_tokens` (passes that share a
    dequantizing), and `least_pass_tokens` where batches are sliced."""
    share = -(-least_tokens // group)
    return max(share, least_pass_tokens(args)) if sliced else share


def pass_rows(
    model: nn.Module, batch_size: int, slice_bytes: int | None = -1, least_tokens: int | None = None
) -> Callable[[int], int]:
    """length -> the rows `run_batches(model, ..., batch_size, slice_bytes=, least_tokens=)` slices a batch into
    where the longest row has `length` tokens, the most a pass of them holds (defaults as there): what
    `run_continuous`'s caller draws."""
    slice_bytes = default_slice_bytes() if slice_bytes == -1 else slice_bytes
    least_tokens = default_least_tokens(model) if least_tokens is None else least_tokens
    if slice_bytes is None:
        return lambda length: batch_size
    per_slice = pass_floor(model.args, least_tokens, lane_count(), True)  # a group: a pass a lane
    return lambda length: min(batch_size, slice_rows(model.args, length, slice_bytes, per_slice))


def drawn_groups(next_rows: Callable[[list[Rows] | None], Rows | None], size: int) -> Iterator[list[Rows]]:
    """Groups of up to `size` passes `next_rows(drawn)` draws (`drawn`: None for a group's first pass, then the
    rows of the group's passes drawn so far), until it draws nothing."""
    while True:
        group = []
        while len(group) < size and (rows := next_rows(list(group) if group else None)) is not None:
            group.append(rows)
        if not group:
            return
        yield group


def run_continuous(
    next_rows: Callable[[list[Rows] | None], Rows | None],
    forward: Callable[[Rows], list[mx.array]],
    collect: Callable[[Rows, list[mx.array]], None],
) -> None:
    """`collect(rows, forward(rows))` for the passes `next_rows(drawn)` draws (sized by `pass_rows`), until it
    returns None, through `run_in_lanes`: a group's passes are drawn when the group before the last one is
    collected, so what arrives meanwhile (a server's requests) joins them. One pass in all runs on every core.
    `drawn` is None for a group's first pass, then the rows of its passes drawn so far: a group's passes run in
    step (MLX hands their work to the lanes in graph order, a few tasks ahead), so a lighter pass leaves its core
    idle until the heaviest ends, and the drawer should match them."""
    claim_mlx()
    run_in_lanes(functools.partial(drawn_groups, next_rows), forward, collect)


def run_batches(
    model: nn.Module,
    lengths: Sequence[int],
    forward: Callable[[np.ndarray], list[mx.array]],
    collect: Callable[[np.ndarray, list[mx.array]], None],
    batch_size: int,
    *,
    show_progress: bool | None = False,
    slice_bytes: int | None = -1,
    least_tokens: int | None = None,
) -> None:
    """`collect(rows, forward(rows))` for every forward pass over the items whose token counts are `lengths`: rows
    are index arrays into them, `forward` returns lazy arrays whose first axis follows `rows`, `collect` reads
    them once evaluated. `slice_bytes` (default CPU_SLICE_BYTES on the CPU, None elsewhere: whole batches) caps a
    slice's largest activation; `least_tokens` (default `least_group_tokens(model)` on the CPU) is the least
    tokens a group of passes holds, and a sliced pass holds `least_pass_tokens` at least (before a group's rows are
    shared out between its passes, `balance`). `show_progress` as
    sentence-transformers' show_progress_bar, counting batches."""
    claim_mlx()
    if not len(lengths):
        return
    slice_bytes = default_slice_bytes() if slice_bytes == -1 else slice_bytes
    if model.args.padded_length_matters:  # every text padded to its batch's longest, as transformers pads it
        slice_bytes = None
    least_tokens = default_least_tokens(model) if least_tokens is None else least_tokens
    lengths = list(lengths)
    order = np.argsort([-n for n in lengths], kind="stable")  # longest first: memory peaks early

    def groups(size: int) -> Iterator[list[np.ndarray]]:
        per_slice = pass_floor(model.args, least_tokens, size, slice_bytes is not None)

        def slices(rows: np.ndarray, counts: list[int]) -> Iterator[np.ndarray]:
            return batch_slices(rows, counts, model.args, slice_bytes, per_slice)

        if slice_bytes is None:  # whole batches, as asked
            yield from grouped_slices(order, lengths, batch_size, size, show_progress, slices)
            return
        # After other groups a short last one's idle lanes are lost whatever its size; a call's only group of one
        # pass runs on the default stream with every BLAS thread, which small passes on the lanes do not beat.
        alone = max(least_pass_tokens(model.args) // 2, LEAST_SHARED_TOKENS)
        cap = lambda length: min(batch_size, slice_rows(model.args, length, slice_bytes, per_slice))  # noqa: E731
        for k, group in enumerate(grouped_slices(order, lengths, batch_size, size, show_progress, slices)):
            yield balance(group, size, lengths, cap, alone if k == 0 else 0)

    run_in_lanes(groups, forward, collect)

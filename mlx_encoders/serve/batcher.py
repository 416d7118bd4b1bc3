"""The request batcher: one worker thread per model owns its MLX evaluation; requests wait in a bounded queue.

A dense model's inputs run continuously (`Passes`, `engine.batching.run_continuous`): each forward pass is drawn
from the queue when a CPU lane frees up, the longest waiting input of the oldest request with the inputs nearest
its length, and beside it, in step on the other lanes, the passes that do the most work in its time (about as few
padding tokens and idle lanes as one sorted call over them all), so a stream of single-text requests runs about as
fast as one `encode` of all of them, and no request waits behind later ones for more than a group of passes.
Other models' requests are packed, first come first served, into batches of at most `max_batch_tokens` tokens
(a large request is split over several batches and put back together in order), each run through the encoders'
own runner (`SentenceEncoder.run_encodings`, `CrossEncoder.encoding_logits` -> engine.batching.run_batches),
which sorts it by length. A row's result does not depend on its batch-mates beyond float rounding.
"""

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

log = logging.getLogger("mlx_encoders.serve")


class Threads:
    """The batchers' worker threads. A thread that ran MLX work must not end before the process (MLX aborts at
    exit: "terminate called without an active exception"), so a stopped batcher's thread waits here for the next
    batcher instead: models loaded and unloaded again and again (--models-dir, Ollama's keep_alive) reuse threads,
    and their CPU streams, rather than add some each time."""

    def __init__(self):
        self.lock = threading.Lock()
        self.spare: list[queue.SimpleQueue] = []  # the inboxes of threads waiting for a batcher

    def run(self, work: Callable[[], None], name: str) -> None:
        """`work()` on a spare thread, else on a new one, named `name` meanwhile."""
        with self.lock:
            inbox = self.spare.pop() if self.spare else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self.serve, args=(inbox,), name=name, daemon=True).start()
        inbox.put((work, name))

    def serve(self, inbox: queue.SimpleQueue) -> None:
        stream = mx.new_stream(mx.default_device())  # an MLX stream serves only the thread that made it
        while True:
            work, name = inbox.get()
            threading.current_thread().name = name
            try:
                with mx.stream(stream):  # every op of the work, the encoders' own beyond their batched passes
                    work()
            except BaseException:  # noqa: BLE001  the thread lives on (see above); the fault is logged
                log.exception("%s failed", name)
            finally:
                del work  # a spare thread holds nothing of the batcher it served
                threading.current_thread().name = "mlx-encoders serve (spare)"
                with self.lock:
                    self.spare.append(inbox)


THREADS = Threads()


class QueueFull(Exception):
    """The model's queue holds `max_queue` requests: the caller answers 429 with Retry-After."""


class Job:
    """One request's tokenized inputs, the rows computed so far and the future its handler waits on."""

    def __init__(self, items: Sequence):
        self.items = items
        self.future: Future = Future()
        self.out: np.ndarray | None = None  # allocated from the first rows computed: their dtype and shape
        self.taken = 0  # items handed to batches (or drawn into passes)
        self.done = 0  # items computed
        self.submitted = time.monotonic()

    def finish(self, indices: Sequence[int], rows: np.ndarray, held: list | None = None) -> None:
        """Items `indices` computed: `rows`, in their order. The answer, once whole, goes to `held` when given."""
        if self.future.done():  # an earlier piece failed, or the handler was cancelled
            return
        if self.out is None:
            self.out = np.empty((len(self.items), *rows.shape[1:]), rows.dtype)
        self.out[indices] = rows
        self.done += len(rows)
        if self.done == len(self.items):
            held.append(self) if held is not None else self.settle(result=self.out)

    def settle(self, result=None, error: BaseException | None = None) -> None:
        try:  # the waiting handler may have been cancelled (client gone): nothing to tell it
            self.future.set_exception(error) if error is not None else self.future.set_result(result)
        except InvalidStateError:
            pass


@dataclass(frozen=True)
class Passes:
    """How a model's inputs run a forward pass at a time (see the module's docstring): `forward(items)` the lazy
    arrays of one pass, `rows(items, arrays)` its items' result rows once evaluated, `rows_for(length)` the items
    a pass holds whose longest has `length` tokens (`engine.batching.pass_rows`), `run(next_rows, forward,
    collect)` the engine's runner (`run_continuous` on the model), `key(item)` what the items of one pass share,
    `row_cost(length)` a row's time in a pass of that width (`engine.batching.row_cost`; default: its tokens)."""

    forward: Callable[[list], list]
    rows: Callable[[list, list], np.ndarray]
    rows_for: Callable[[int], int]
    run: Callable[[Callable, Callable, Callable], None]
    key: Callable[[object], object] = lambda item: None
    row_cost: Callable[[int], float] = float


DRAW_WINDOW = 256  # the waiting inputs, oldest first, a pass is drawn from: a draw sorts them by length


def beside(
    lengths: Sequence[int],
    cost: float,
    real: int,
    row_cost: Callable[[int], float],
    rows_for: Callable[[int], int],
    max_tokens: int,
) -> list[int]:
    """The rows (indices into `lengths`) of a pass that runs in step beside passes that take `cost` (the slowest's
    rows x `row_cost(its longest)`) for `real` real tokens: those that make all their real tokens over the slowest
    pass's time largest, within `rows_for(their longest)` rows. For a width, the longest rows not longer than it
    are best, and past the count that fills `cost` one more row is the most that can gain, so those two counts are
    tried at each width: the best there is wherever `max_tokens` does not bind. Each is cut to `max_tokens` real
    tokens by dropping its shortest rows; a row over it runs alone, only when every row is. Among equal lengths the
    earlier row (the older input) goes first."""
    order = sorted(range(len(lengths)), key=lambda k: -lengths[k])
    sums = [0]
    for k in order:
        sums.append(sums[-1] + lengths[k])
    alone_over = bool(lengths) and min(lengths) > max_tokens  # every row over the budget: the shortest runs alone
    best, chosen = -1.0, order[-1:]
    for start, k in enumerate(order):
        width = lengths[k]
        if (start and width == lengths[order[start - 1]]) or (width > max_tokens and not alone_over):
            continue  # the same width from a shorter set of rows, or a row that the budget leaves out
        each = max(row_cost(width), 1e-9)
        most = max(1, min(rows_for(width), len(order) - start))
        fill = max(1, min(int(cost // each), most))
        for count in (fill, min(fill + 1, most)):
            while count > 1 and sums[start + count] - sums[start] > max_tokens:
                count -= 1
            work = (real + sums[start + count] - sums[start]) / max(cost, count * each, 1e-9)
            if work > best:
                best, chosen = work, order[start : start + count]
    return chosen


class Batcher:
    """`submit(items)` -> Future of `compute(items)` (an (N, ...) array, row i for item i; an object array for
    outputs of varying size), computed on this batcher's worker thread together with other requests' items."""

    def __init__(
        self, name: str, compute: Callable[[list], np.ndarray], *, max_batch_tokens: int, max_wait_ms: float,
        max_queue: int, on_batch: Callable[[int, int], None] | None = None,
        on_wait: Callable[[float], None] | None = None, passes: Passes | None = None,
    ):  # fmt: skip
        """`passes`: run the inputs continuously, else in batches of `compute`, which also reruns each request of
        a pass that failed on its own (so that only a faulty request fails)."""
        self.name = name
        self.compute = compute
        self.passes = passes
        self.waiting: list[tuple[Job, int, int, object]] = []  # with passes: (job, item, tokens, key), oldest first
        self.drawn: dict[int, Job] = {}  # with passes: the requests with inputs in passes not yet collected, by id
        self.held: list[Job] | None = None  # with passes: requests answered once the run ends (see draw)
        self.max_batch_tokens = max_batch_tokens
        self.max_wait = max_wait_ms / 1000
        self.max_queue = max_queue
        self.on_batch = on_batch
        self.on_wait = on_wait  # given the seconds each request waited for its first batch
        self.jobs: deque[Job] = deque()
        self.queued_tokens = 0
        self.stopping = False
        self.condition = threading.Condition()
        self.drained = threading.Event()
        THREADS.run(self.work, f"mlx-encoders serve {name}")

    def depth(self) -> int:
        return len(self.jobs)

    def submit(self, items: Sequence) -> Future:
        job = Job(items)
        with self.condition:
            if self.stopping:
                raise RuntimeError(f"model {self.name!r} is shutting down")
            if len(self.jobs) >= self.max_queue:
                raise QueueFull(f"model {self.name!r} has {self.max_queue} requests waiting (--max-queue)")
            if not items:  # nothing to compute, and take() drops a job that gives no piece: settled now
                job.settle(result=np.empty((0,), np.float32))
                return job.future
            self.jobs.append(job)
            self.queued_tokens += sum(len(item.ids) for item in items)
            if self.passes is not None:
                self.waiting += [(job, i, len(item.ids), self.passes.key(item)) for i, item in enumerate(items)]
            self.condition.notify()
        return job.future

    def stop(self) -> None:
        """Finish what is queued; the worker then parks."""
        with self.condition:
            self.stopping = True
            self.condition.notify()
        self.drained.wait()

    def work(self) -> None:
        try:
            self.run_passes() if self.passes is not None else self.run_batches()
        finally:
            self.release_held()
            with self.condition:  # a worker that ended on a fault of its own leaves no request waiting
                self.stopping = True
                left, self.jobs, self.waiting = list(self.jobs), deque(), []
            for job in left:
                job.settle(error=RuntimeError(f"model {self.name!r} stopped serving"))
            # A stopped batcher lets its model go (an unloaded one's memory) before `stop` returns to its caller.
            self.compute = self.on_batch = self.on_wait = self.passes = None
            self.drained.set()

    def run_passes(self) -> None:
        """Draw and run passes while inputs wait; a failure reruns each request it touched on its own."""
        while True:
            with self.condition:
                self.wait_to_fill()
                if not self.waiting:
                    if self.stopping:
                        return
                    continue
            self.drawn, self.held, failed = {}, None, None
            try:
                self.passes.run(self.draw, self.forward, self.collect)
            except BaseException as error:  # noqa: BLE001  a fault fails no request but its own
                log.warning("a pass of %s failed (%s): its requests run again one by one", self.name, error)
                failed = list(self.drawn.values())
                if not failed:  # the draw itself failed: the oldest request runs on its own, so the queue moves on
                    with self.condition:
                        failed = [self.waiting[0][0]] if self.waiting else []
            self.release_held()
            for job in failed or ():  # outside the handler: the failed run's arrays are let go first
                self.rerun(job)

    def forward(self, rows: list[tuple[Job, int]]) -> list:
        return self.passes.forward([job.items[i] for job, i in rows])

    def collect(self, rows: list[tuple[Job, int]], arrays: list) -> None:
        items = [job.items[i] for job, i in rows]
        out = self.passes.rows(items, arrays)
        if self.on_batch is not None:
            self.on_batch(len(items), sum(len(item.ids) for item in items))
        for job in {id(job): job for job, _ in rows}.values():
            picks = [k for k, (other, _) in enumerate(rows) if other is job]
            job.finish([rows[k][1] for k in picks], out[picks], self.held)
            if job.done == len(job.items):
                self.drawn.pop(id(job), None)

    def release_held(self) -> None:
        held, self.held = self.held or [], None
        for job in held:
            job.settle(result=job.out)

    def rerun(self, job: Job) -> None:
        """`job` alone as a batch of `compute` (`run`), its inputs taken out of the queue: its result or its own
        error."""
        with self.condition:
            self.take_out(job)
        if job.future.done():
            return
        job.done, job.out = 0, None  # rows of passes that ran are computed again with the rest
        try:
            self.run([(job, 0, len(job.items))])
        except BaseException as error:  # noqa: BLE001  its own fault, whatever it is, fails this request only
            job.settle(error=error)

    def take_out(self, *jobs: Job) -> None:
        """Every waiting input of `jobs` out of the queue, in one pass over it (holding the condition)."""
        gone = {id(job) for job in jobs}
        self.queued_tokens -= sum(entry[2] for entry in self.waiting if id(entry[0]) in gone)
        self.waiting = [entry for entry in self.waiting if id(entry[0]) not in gone]
        self.jobs = deque(job for job in self.jobs if id(job) not in gone)
        for job in jobs:
            job.taken = len(job.items)

    def draw(self, drawn: list[list[tuple[Job, int]]] | None = None) -> list[tuple[Job, int]] | None:
        """The next pass: the longest waiting input of the oldest live request and, among the DRAW_WINDOW oldest
        inputs of its key, those nearest its length, as many as `passes.rows_for` their longest and
        `max_batch_tokens` allow; None when nothing waits. A group's passes run in step (`run_continuous`), so its
        later passes (`drawn`: the rows of its passes so far) take, of the inputs of the first's key, those that do
        the most work in the slowest one's time (`beside`)."""
        with self.condition:
            while dead := {id(e[0]): e[0] for e in self.waiting[:DRAW_WINDOW] if e[0].future.done()}:
                self.take_out(*dead.values())  # their clients are gone, or an earlier pass failed them: never run
            if not self.waiting:
                # the run ends once its last passes are collected: their answers wait for its lanes to be let go,
                # as a handler's own MLX work beside that release held the event loop for 100 ms and more
                self.held = [] if self.held is None else self.held
                return None
            head = self.waiting[:DRAW_WINDOW]
            like = self.like(drawn)
            window = [(p, e) for p, e in enumerate(head) if e[3] == like[0]] if like is not None else []
            if window:  # a group's later pass: the most work its lane can do in the slowest pass's time
                _, cost, real = like
                lengths = [e[2] for _, e in window]
                picks = beside(lengths, cost, real, self.passes.row_cost, self.passes.rows_for, self.max_batch_tokens)
                chosen = [window[k] for k in picks]
            else:  # a group's first pass, or none of its first's key waits
                oldest, _, _, key = head[0]
                window = [(p, e) for p, e in enumerate(head) if e[3] == key]
                anchor = max(e[2] for _, e in window if e[0] is oldest)  # its longest first, as run_batches' slices
                window.sort(key=lambda pair: (abs(pair[1][2] - anchor), pair[0]))
                chosen, longest, tokens = [], 0, 0
                for position, entry in window:
                    wider = max(longest, entry[2])
                    full = len(chosen) + 1 > self.passes.rows_for(wider)
                    if chosen and (full or tokens + entry[2] > self.max_batch_tokens):
                        break
                    chosen.append((position, entry))
                    longest, tokens = wider, tokens + entry[2]
            picked = {position for position, _ in chosen}
            self.waiting[:DRAW_WINDOW] = [entry for position, entry in enumerate(head) if position not in picked]
            rows, starting = [], []  # starting: the requests whose first input this pass holds
            for _, (job, i, tokens, _) in sorted(chosen):
                if job.taken == 0:
                    starting.append(job)
                job.taken += 1
                self.queued_tokens -= tokens
                self.drawn[id(job)] = job
                if job.taken == len(job.items):
                    self.jobs.remove(job)
                rows.append((job, i))
        self.release_held()  # more came: the run goes on, and what it held is answered now
        if self.on_wait is not None:
            now = time.monotonic()
            for job in starting:
                try:
                    self.on_wait(now - job.submitted)
                except Exception:  # a metrics hook's fault fails no request
                    log.exception("the queue-time hook of %s failed", self.name)
        return rows

    def like(self, drawn: list[list[tuple[Job, int]]] | None) -> tuple[object, float, int] | None:
        """(the first pass's key, the slowest pass's time as `beside` weighs it, their real tokens) of a group's
        passes drawn so far, or None for none."""
        if not drawn:
            return None
        slowest, real = 0.0, 0
        for rows in drawn:
            lengths = [len(job.items[i].ids) for job, i in rows]
            slowest, real = max(slowest, len(lengths) * self.passes.row_cost(max(lengths))), real + sum(lengths)
        job, i = drawn[0][0]
        return self.passes.key(job.items[i]), slowest, real

    def run_batches(self) -> None:
        while (pieces := self.take()) is not None:
            try:
                if self.on_wait is not None:
                    now = time.monotonic()
                    for job, start, _ in pieces:
                        if start == 0:  # the request's first batch
                            self.on_wait(now - job.submitted)
                self.run(pieces)  # nothing when every waiting request was cancelled
            except BaseException as error:  # noqa: BLE001  a fault fails this batch's requests, never the worker
                for job, _, _ in pieces:
                    job.settle(error=error)

    def wait_to_fill(self) -> None:
        """Holding the condition: until a request waits, then up to max_wait for `max_batch_tokens` tokens to wait
        (the worker was idle; passes drawn while others run take what came meanwhile)."""
        while not self.jobs and not self.stopping:
            self.condition.wait()
        deadline = time.monotonic() + self.max_wait
        while self.queued_tokens < self.max_batch_tokens and not self.stopping:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.condition.wait(left)

    def take(self) -> list[tuple[Job, int, int]] | None:
        """The next batch as (job, start, stop) pieces, waiting up to max_wait for the budget to fill; None once
        stopping with nothing queued."""
        with self.condition:
            self.wait_to_fill()
            pieces, tokens = [], 0
            while self.jobs:
                job = self.jobs[0]
                if job.future.cancelled():  # its client is gone: its items neither run nor fill this batch's budget
                    self.queued_tokens -= sum(len(item.ids) for item in job.items[job.taken :])
                    self.jobs.popleft()
                    continue
                start = stop = job.taken
                while stop < len(job.items):
                    size = len(job.items[stop].ids)
                    if tokens + size > self.max_batch_tokens and (pieces or stop > start):
                        break  # a single over-budget item still runs, alone
                    tokens += size
                    stop += 1
                if stop > start:
                    pieces.append((job, start, stop))
                self.queued_tokens -= sum(len(item.ids) for item in job.items[start:stop])
                job.taken = stop
                if stop < len(job.items):
                    break  # the budget is full: the rest of this job leads the next batch
                self.jobs.popleft()
            return pieces if pieces or not self.stopping else None

    def run(self, pieces: list[tuple[Job, int, int]]) -> None:
        if not pieces:
            return
        items = [item for job, start, stop in pieces for item in job.items[start:stop]]
        try:
            out = self.compute(items)
            if len(out) != len(items):  # settling would leave the rest of a request waiting forever
                raise RuntimeError(f"model {self.name!r} returned {len(out)} rows for {len(items)} inputs")
        except Exception as error:  # noqa: BLE001  a failure fails its own requests only: retry them one by one
            if len(pieces) == 1:
                pieces[0][0].settle(error=error)
                return
            for piece in pieces:
                self.run([piece])
            return
        try:
            if self.on_batch is not None:
                self.on_batch(len(items), sum(len(item.ids) for item in items))
            offset = 0
            for job, start, stop in pieces:
                job.finish(range(start, stop), out[offset : offset + stop - start])
                offset += stop - start
        except Exception as error:  # noqa: BLE001  rows of another shape than a request's first ones, a hook
            for job, _, _ in pieces:
                job.settle(error=error)

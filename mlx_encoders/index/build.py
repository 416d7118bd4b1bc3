"""Build or update an index: embed the texts the store lacks, a chunk at a time, each chunk committed on its own,
then swap in the new documents in one transaction.

Under `mlx.launch` (an `mx.distributed` world of more than one process) every rank reads the whole corpus, takes
every world-size-th chunk of the texts to embed, and commits them into its own shard (`shards/rank-<r>.sqlite`);
rank 0 then merges the shards into the store. Chunks are cut the same way for any world size, so the vectors
equal a one-process build's. A killed run resumes: texts already in the store or in any shard are not embedded
again, and shards left by a run of another world size are merged too. Rank 0 holds the folder's build lock
(`lock.py`) from start to end, so a second build into the same folder is refused at once. A sparse model
(`sparse_model`, a `SparseEncoder` folder) is embedded in the same chunks and committed with the dense vectors, into
postings.

Without `mlx.launch`, `shard=(i, n)` embeds the i-th of n parts (from 1) alone, into `shards/part-<i>-of-<n>.sqlite`:
the chunks rank i - 1 of n would take. n such runs on any machines, their part files copied into one folder's
`shards/`, merge (an ordinary build of that folder) into the index a one-process build gives.
"""

import os
import re
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from .. import distributed
from ..checkpoint import folder_digest
from ..distributed import World, timeout, warnings_on_main_rank, world
from ..embeddings.sentence import SentenceEncoder
from ..embeddings.sparse import SparseEncoder
from ..errors import OptionError
from . import ann as ann_index
from .documents import read_corpus
from .lock import BuildLock
from .search import ANN_THRESHOLD, check_graph_options
from .store import Store, StoreError, shard_keys, text_key

CHUNK = 256  # texts per committed transaction: a kill loses at most this much work per rank
# the other ranks wait this long (or the collective timeout, if longer) for rank 0's store check and its merge with
# the HNSW graph of a large index: work of one rank that can outlast the stall timeout without anything hanging
RANK0_TIMEOUT = 24 * 3600.0


def agree(ranks: World, error: BaseException | None, step: str, seconds: float | None = None) -> None:
    distributed.agree(ranks, error, f"index build: {step}", seconds)


def identity(encoder: SentenceEncoder | None, model: str, sparse: SparseEncoder | None, sparse_model: str):
    """The meta of an index of these models; "" (and dimension 0) for a model it has not."""
    return {
        "model": model if encoder else "",
        "model_fingerprint": folder_digest(encoder.path) if encoder else "",
        "dimension": str(encoder.dimension if encoder else 0),
        "dtype": "<f4",
        "pooling": "+".join(encoder.pooling) if encoder else "",
        "sparse_model": sparse_model if sparse else "",
        "sparse_model_fingerprint": folder_digest(sparse.path) if sparse else "",
        "sparse_dimension": str(sparse.get_embedding_dimension() if sparse else 0),
    }


def open_model(model, kind: type):
    """(encoder or None, its name: a local folder's absolute path, so the index finds it from any directory, or
    the hub id) of a folder, hub id or encoder of class `kind`."""
    if model is None:
        return None, ""
    encoder = model if isinstance(model, kind) else kind(model)
    name = str(model.path) if isinstance(model, kind) else str(model)
    return encoder, str(Path(name).resolve()) if Path(name).is_dir() else name


def log(message: str, quiet: bool) -> None:
    if not quiet:
        print(f"mlx-encoders index: {message}", file=sys.stderr, flush=True)


def embed_chunks(target: Store, encoder: SentenceEncoder | None, sparse: SparseEncoder | None,
                 chunks: list[list[tuple[str, str]]], batch_size: int, quiet: bool) -> None:  # fmt: skip
    """Embed and stage each chunk, behind one bar of texts embedded (the encoders' own bars would draw one per
    chunk); no bar when `quiet` or when stderr is not a terminal, as for `SentenceEncoder.encode`."""
    start, done = time.perf_counter(), 0
    total = sum(len(chunk) for chunk in chunks)
    with tqdm(total=total, desc="embedding", unit="text", leave=False, disable=quiet or not sys.stderr.isatty()) as bar:
        for chunk in chunks:
            keys, texts = [k for k, _ in chunk], [t for _, t in chunk]
            if encoder is not None:
                vectors = encoder.encode_document(
                    texts, batch_size=batch_size, normalize_embeddings=True, show_progress_bar=False
                )
            else:
                vectors = np.zeros((len(texts), 0), np.float32)
            if sparse is not None:
                terms = sparse.encode_document(texts, batch_size=batch_size, show_progress_bar=False).rows()
            else:
                terms = None
            target.stage(keys, texts, vectors, terms)
            done += len(chunk)
            bar.update(len(chunk))
    if done:
        seconds = time.perf_counter() - start
        log(f"embedded {done} texts in {seconds:.1f} s ({done / seconds:.1f} texts/s)", quiet)


@warnings_on_main_rank()  # under mlx.launch every rank would print the same warnings
def build(
    corpus,
    index: str | Path,
    model: str | SentenceEncoder | None,
    *,
    sparse_model: str | SparseEncoder | None = None,
    batch_size: int = 32,
    chunk: int = CHUNK,
    ann: bool | None = None,
    ann_threshold: int = ANN_THRESHOLD,
    precision: str = "float32",
    recall: float = ann_index.RECALL,
    shard: tuple[int, int] | None = None,
    quiet: bool = False,
) -> dict[str, int]:
    """Build or update the index in folder `index` from `corpus` (a path, or (id, text) pairs) with `model` (a
    folder, hub id or SentenceEncoder) and/or `sparse_model` (a SparseEncoder or its folder: an inverted index of
    its vectors), committing every `chunk` texts. The HNSW graph of `precision` is built (for `recall`, and
    calibrated: `ann.py`) too when `ann` is True, or None and the index holds `ann_threshold` texts or more (else
    at the first search that needs it). Returns counts (on rank 0; {} on the others): documents, texts, added, dropped.
    `shard=(i, n)` embeds part i of n into a shard file only (see the module's docstring) and returns its counts:
    part, texts, added, path."""
    ranks, folder = world(), Path(index)
    rank, size = ranks.rank, ranks.size
    if model is None and sparse_model is None:
        raise ValueError("index build needs a model (--model), a sparse model (--sparse-model) or both")
    check_graph_options(precision, recall)
    for name, value, least in (("batch_size", batch_size, 1), ("chunk", chunk, 1), ("ann_threshold", ann_threshold, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise OptionError(f"{name} must be an integer of {least} or more, got {value!r}")
    if shard is not None:
        check_part(shard, size)
    if blocking := next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None):
        where = "" if blocking == folder else f" (in {blocking}, a file)"
        raise OptionError(f"index {folder}{where} cannot be a folder: {blocking} is a file; name another folder")
    encoder, name = open_model(model, SentenceEncoder)
    sparse, sparse_name = open_model(sparse_model, SparseEncoder)
    docs = read_corpus(corpus)
    meta = identity(encoder, name, sparse, sparse_name)
    name = " and ".join(n for n in (name, sparse_name) if n)
    store_file, shard_folder = folder / "index.sqlite", folder / "shards"
    if shard is not None:
        return build_part(docs, folder, shard, encoder, sparse, meta, name, batch_size, chunk, quiet)

    rank0_wait = max(timeout(), RANK0_TIMEOUT)  # a malformed setting refused before any file is made
    with ExitStack() as held:  # rank 0's build lock, released when the build ends, whichever way
        error = None
        try:  # rank 0 locks the folder, creates the store and checks it before any rank reads it
            if rank == 0:
                folder.mkdir(parents=True, exist_ok=True)
                held.enter_context(BuildLock(folder, quiet))
                for lock, part in part_locks(shard_folder):  # no part is merged (or removed) while its build writes it
                    advice = "Merge once every part's build has ended (or stop that build)."
                    held.enter_context(
                        BuildLock(shard_folder, quiet, lock, f"part {part} of the index {folder}", advice)
                    )
                with Store(store_file, create=True) as store:
                    store.upgrade()
                    store.check()
                    store.check_identity(meta, name)
                    if "model_fingerprint" not in store.meta:
                        store.set_meta(meta)
        except Exception as e:
            error = e
        agree(ranks, error, "opening the index", rank0_wait)

        keys = [text_key(text) for _, text in docs]
        error = None
        try:  # a host that does not see the folder fails here, and the others learn of it
            with Store(store_file) as store:
                known = store.keys()
            known |= read_shards(shard_folder, meta, name, set(keys), quiet or rank != 0)
        except Exception as e:
            error = e
        agree(ranks, error, "reading the shards")

        chunks = cut(docs, keys, known, chunk)
        if rank == 0:
            log(
                f"{len(docs)} documents, {len(set(keys))} distinct texts: {sum(map(len, chunks))} to embed over "
                f"{size} rank(s)",
                quiet,
            )
        error = None
        try:
            if size > 1:
                target = open_shard(shard_folder / f"rank-{rank}.sqlite", meta)
            else:
                target = Store(store_file)
            with target:
                embed_chunks(target, encoder, sparse, chunks[rank::size], batch_size, quiet or rank != 0)
        except Exception as e:
            error = e
        agree(ranks, error, "embedding")

        error, counts = None, {}
        try:
            if rank == 0:
                graph = (ann, ann_threshold, precision, recall)
                counts = finish(folder, docs, keys, meta, name, graph, quiet)
        except Exception as e:
            error = e
        agree(ranks, error, "merging", rank0_wait)
    if rank == 0:  # the locks let go: no empty folder left behind
        try:
            shard_folder.rmdir()
        except OSError:  # absent, or holding what another build writes
            pass
    return counts


def cut(docs, keys: list[str], known: set[str], chunk: int) -> list[list[tuple[str, str]]]:
    """The (key, text) chunks to embed: the distinct texts not `known`, by key, `chunk` at a time. A rank or part
    takes every world-size-th of them, so any split embeds each text in the batch a one-process build would."""
    texts = dict(zip(keys, (t for _, t in docs), strict=True))
    pending = sorted(key for key in texts if key not in known)
    return [[(k, texts[k]) for k in pending[i : i + chunk]] for i in range(0, len(pending), chunk)]


def check_part(shard: tuple[int, int], size: int) -> None:
    part, parts = shard
    if not 1 <= part <= parts:
        raise OptionError(f"shard must be a part i of n parts with 1 <= i <= n, got {part}/{parts}")
    if size > 1:
        raise OptionError(
            "index build --shard embeds one part of the corpus in one process; under mlx.launch the ranks share "
            "the corpus by themselves: run it without --shard, or each part without mlx.launch"
        )


PART_FILE = re.compile(r"part-(\d+)-of-(\d+)\.(sqlite|lock)")  # part_path's files and their locks


def part_path(folder: Path, part: int, parts: int) -> Path:
    return folder / "shards" / f"part-{part}-of-{parts}.sqlite"


def part_locks(shard_folder: Path) -> list[tuple[str, str]]:
    """(lock name, "i/n") of each `--shard` part in `shard_folder`: one per part file, or per part being built."""
    found = (PART_FILE.fullmatch(p.name) for p in shard_folder.iterdir()) if shard_folder.is_dir() else ()
    return sorted({(f"part-{m[1]}-of-{m[2]}.lock", f"{m[1]}/{m[2]}") for m in found if m})


def build_part(docs, folder: Path, shard: tuple[int, int], encoder, sparse, meta: dict[str, str], name: str,
               batch_size: int, chunk: int, quiet: bool) -> dict:  # fmt: skip
    """Embed part i of n into its shard file: the chunks rank i - 1 of n would take of the texts the folder's
    store (if any: a copy of the index being extended) lacks. Texts the part file already holds (a run that
    stopped) are not embedded again."""
    part, parts = shard
    keys, store_file = [text_key(text) for _, text in docs], folder / "index.sqlite"
    known = set()
    if store_file.exists():
        with Store(store_file) as store:
            store.check_identity(meta, name)
            known = store.keys()
    mine = [pair for piece in cut(docs, keys, known, chunk)[part - 1 :: parts] for pair in piece]
    path = part_path(folder, part, parts)
    path.parent.mkdir(parents=True, exist_ok=True)
    with BuildLock(path.parent, quiet, path.with_suffix(".lock").name, f"part {part}/{parts} of the index {folder}",
                   "Two builds of one part would embed its texts twice: wait for that build to end (or stop "
                   "it)."):  # fmt: skip
        # no merge runs now (one starting later finds this part's lock): it would merge the part half done
        with BuildLock(folder, True, advice="A part is built while no build of the whole index runs: build it "
                       "once that build has ended."):  # fmt: skip
            pass
        return part_into(path, shard, mine, keys, encoder, sparse, meta, name, batch_size, chunk, quiet)


def part_into(path: Path, shard: tuple[int, int], mine: list, keys: list, encoder, sparse, meta: dict[str, str],
              name: str, batch_size: int, chunk: int, quiet: bool) -> dict:  # fmt: skip
    """`build_part`'s work under its part's lock: the texts of `mine` that `path` lacks, embedded into it."""
    part, parts = shard
    done = shard_keys(path, meta, name) if path.exists() else set()
    todo = [pair for pair in mine if pair[0] not in done]
    log(f"part {part} of {parts}: {len(mine)} of {len(set(keys))} distinct texts, {len(todo)} to embed", quiet)
    with open_shard(path, {**meta, "part": f"{part}/{parts}"}) as target:
        if target.meta.get("part") != f"{part}/{parts}":
            raise StoreError(f"{path} holds part {target.meta.get('part')}, not {part}/{parts}: delete it")
        embed_chunks(target, encoder, sparse, [todo[i : i + chunk] for i in range(0, len(todo), chunk)], batch_size,
                     quiet)  # fmt: skip
    return {"part": f"{part}/{parts}", "texts": len(mine), "added": len(todo), "path": str(path)}


def read_shards(shard_folder: Path, meta: dict[str, str], name: str, keys: set[str], quiet: bool) -> set[str]:
    """The keys of every shard in `shard_folder` (ranks' and parts'), each checked (`shard_keys`); a part of
    another corpus (texts this corpus lacks) is an error naming it, and missing parts of a split a line."""
    known, found = set(), {}
    for path in sorted(shard_folder.glob("*.sqlite")):
        held = shard_keys(path, meta, name)
        known |= held
        if path.name.startswith("part-"):
            if stray := held - keys:
                with Store(path) as shard:
                    text = shard.con.execute("SELECT text FROM staged WHERE key = ?", (min(stray),)).fetchone()[0]
                raise StoreError(
                    f"{path} holds {len(stray)} texts that are not in this corpus (such as {text!r}): it was embedded "
                    "from another corpus. Build with the corpus its parts were embedded from, or delete the file."
                )
            part, parts = (int(n) for n in path.stem.split("-")[1::2])
            found.setdefault(parts, set()).add(part)
    for parts, present in found.items():
        if missing := sorted(set(range(1, parts + 1)) - present):
            log(f"parts {missing} of {parts} are not in {shard_folder}: their texts are embedded here", quiet)
    return known


def open_shard(path: Path, meta: dict[str, str]) -> Store:
    """A rank's shard, created whole under another name and then renamed: a rank killed while creating it leaves no
    shard without its schema or identity, which the next run would have to refuse."""
    if not path.exists():
        path.parent.mkdir(exist_ok=True)
        fresh = path.with_name(path.name + ".new")
        for leftover in (fresh, fresh.with_name(fresh.name + "-wal"), fresh.with_name(fresh.name + "-shm")):
            leftover.unlink(missing_ok=True)
        with Store(fresh, create=True) as shard:
            shard.set_meta(meta)
        os.replace(fresh, path)  # the last connection closed has checkpointed its write-ahead log into the file
    return Store(path)


def finish(folder: Path, docs, keys: list[str], meta: dict[str, str], name: str, graph: tuple,
           quiet: bool) -> dict[str, int]:  # fmt: skip
    """Rank 0: merge the shards and swap in the new documents in one transaction, then remove the merged shards
    and refresh the approximate index (`graph`: ann, ann_threshold, precision, recall as `build` takes them)."""
    ann, ann_threshold, precision, recall = graph
    shards = sorted((folder / "shards").glob("*.sqlite"))
    for shard in shards:  # checked again: a rank of this run may have written it
        shard_keys(shard, meta, name)
    with Store(folder / "index.sqlite") as store:
        for shard in shards:
            store.merge(shard)
        indexed, wanted = store.keys(staged=False), set(keys)
        store.commit_index([(doc_id, key) for (doc_id, _), key in zip(docs, keys, strict=True)])
        count, generation, store_id = store.count(), store.meta["generation"], store.meta.get("store_id")
        wanted_graph = meta["model_fingerprint"] != "" and (ann if ann is not None else count >= ann_threshold)
        if wanted_graph:
            rows, vectors = store.vectors()
    for shard in shards:  # merged: its rows are in the store now
        for path in (shard, shard.with_name(shard.name + "-wal"), shard.with_name(shard.name + "-shm")):
            path.unlink(missing_ok=True)
    for unfinished in (folder / "shards").glob("*.sqlite.new*"):  # a run killed while creating its shard
        unfinished.unlink(missing_ok=True)
    if wanted_graph:
        ann_index.build(folder, rows, vectors, precision, generation, recall, store_id=store_id)
    log(f"index {folder}: {len(docs)} documents, {count} texts", quiet)
    return {"documents": len(docs), "texts": count, "added": len(wanted - indexed), "dropped": len(indexed - wanted)}

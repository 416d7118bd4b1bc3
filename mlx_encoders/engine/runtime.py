"""What MLX's CPU backend runs on, and every change the engine makes to the process, in one place
(docs/performance.md). `MLX_ENCODERS_CPU_TUNING=0` turns every one of them off.

- **BLAS, at import.** MLX's Linux CPU wheel bundles the reference (netlib) BLAS, 10-50x slower than OpenBLAS for an
  encoder's products. `give_mlx_fast_blas` loads an OpenBLAS (`MLX_ENCODERS_BLAS`'s, else pip's scipy-openblas32,
  else the system's) with local symbol scope and writes the addresses of its `cblas_*gemm` into libmlx's own table
  of imported functions (its GOT), once the libmlx file read is verified to be the image mapped: only MLX's calls
  reach it, and no other library in the process (torch, numpy) binds to it.
- **MLX's evaluation order, at import** (`widen_evaluation`): on the CPU with several cores, MLX_BFS_MAX_WIDTH is set
  to 40 (unless the environment sets it) so that an evaluation of a group's passes alternates between their lanes.
- **MLX's compiled kernels, from the package's first computation** (`native_kernels`): the C++ kernels `mx.compile`
  fuses are built for AVX2 where the processor has it, through a small C helper (`kernel_flags.py`) given
  libmlx's popen slot.
- **One-row products, when decoding first needs them** (`one_row_products`): a small C helper (`gemv.py`) sends
  them to the BLAS's sgemv.
- **A search graph's memory** (`huge_pages`): the anonymous mappings a graph library made are backed with 2 MB
  transparent huge pages (Linux, `madvise` mode), as a graph walk touches a new page at almost every step.
- **While `encode`, `predict`, the pipelines or training run**: MLX's OpenBLAS runs each product on its caller's
  thread (`one_blas_thread`), restored after; `warm_heap` frees one large buffer before the first inference pass,
  which raises glibc's mmap threshold through glibc's own adjustment; a training run lets MLX's cache follow its
  peak memory (`keep_freed_memory`), then sets the limit back.
- **From the first training step split over the cores**: a worker thread per extra core, kept and parked
  (`threads.py`).
"""

import ctypes
import ctypes.util
import functools
import importlib.util
import mmap
import os
import platform
import struct
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx

from . import gemv, kernel_flags

# The BLAS entry points MLX's matrix products call (cblas_sgemm for float32, the others for float64/complex).
GEMMS = ("cblas_sgemm", "cblas_dgemm", "cblas_cgemm")
# ELF relocation types of an imported function's slot: x86-64 and AArch64 (JUMP_SLOT, then GLOB_DAT)
SLOT_RELOCATIONS = {62: (7, 6), 183: (1026, 1025)}  # e_machine -> types


def on_cpu() -> bool:
    return mx.default_device() == mx.cpu


HALF_PRECISION = (mx.float16, mx.bfloat16)


def compute_dtype(stored: mx.Dtype) -> mx.Dtype:
    """The dtype a model whose weights are stored in `stored` computes in by default: float32 for half precision on
    the CPU, whose backend computes half precision tens of times slower; the stored dtype elsewhere."""
    return mx.float32 if stored in HALF_PRECISION and on_cpu() else stored


def tuning_enabled() -> bool:
    """Whether the engine may change anything in the process: MLX's BLAS, the compiled one-row helper, BLAS threads,
    the allocator. `MLX_ENCODERS_CPU_TUNING=0` leaves the process exactly as MLX and Python made it."""
    return os.environ.get("MLX_ENCODERS_CPU_TUNING", "1") != "0"


class Mapping(NamedTuple):
    start: int
    end: int
    perms: str
    offset: int
    path: str


def _mappings() -> list[Mapping]:
    """This process's memory mappings (Linux), paths whole ("... (deleted)" when the file was replaced)."""
    maps = Path("/proc/self/maps")
    rows = []
    for line in maps.read_text().splitlines() if maps.exists() else []:
        fields = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in fields[0].split("-"))
        rows.append(Mapping(start, end, fields[1], int(fields[2], 16), fields[5] if len(fields) == 6 else ""))
    return rows


def _mlx_library() -> str | None:
    """The path of the libmlx shared object mapped into this process (Linux), as /proc/self/maps names it."""
    return next((m.path for m in _mappings() if Path(m.path).name.startswith("libmlx.so")), None)


def _load_base(library: str) -> int | None:
    """The address libmlx is loaded at (its link map's l_addr, which ELF offsets are relative to)."""
    try:
        handle = ctypes.CDLL(library, mode=os.RTLD_NOLOAD)._handle
        link_map = ctypes.c_void_p()
        dlinfo = ctypes.CDLL(None).dlinfo
        dlinfo.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        if dlinfo(handle, 2, ctypes.byref(link_map)) != 0 or not link_map.value:  # 2: RTLD_DI_LINKMAP
            return None
        return ctypes.c_size_t.from_address(link_map.value).value  # l_addr, the struct's first field
    except (OSError, AttributeError):
        return None


def import_slots(data, names: Sequence[str]) -> dict[str, list[int]]:
    """{name: slot offsets} of the imported functions `names` in an ELF64 little-endian shared object's bytes (bytes or
    an mmap): the places the dynamic linker writes each one's address (relative to the object's load address)."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return {}
    machine = struct.unpack_from("<H", data, 0x12)[0]
    if machine not in SLOT_RELOCATIONS:
        return {}
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if shoff == 0 or shnum == 0 or shoff + shnum * shentsize > len(data):  # section headers stripped
        return {}
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]

    def string(table_offset: int, at: int) -> str:
        start = table_offset + at
        return data[start : data.find(b"\0", start)].decode()

    by_name = {string(sections[shstrndx][4], s[0]): s for s in sections}
    dynsym, dynstr = by_name.get(".dynsym"), by_name.get(".dynstr")
    if dynsym is None or dynstr is None:
        return {}
    wanted, slots = set(names), {}
    for section in (by_name.get(".rela.plt"), by_name.get(".rela.dyn")):
        if section is None:
            continue
        offset, size = section[4], section[5]
        for at in range(offset, offset + size, 24):
            r_offset, r_info, _ = struct.unpack_from("<QQq", data, at)
            if r_info & 0xFFFFFFFF not in SLOT_RELOCATIONS[machine]:
                continue
            name = string(dynstr[4], struct.unpack_from("<I", data, dynsym[4] + (r_info >> 32) * 24)[0])
            if name in wanted:
                slots.setdefault(name, []).append(r_offset)
    return slots


def identity_spans(data) -> list[tuple[int, int, int]]:
    """(file offset, virtual address, size) of what identifies an ELF64 image: its header with the program headers,
    and every note segment (the GNU build id among them)."""
    phoff = struct.unpack_from("<Q", data, 0x20)[0]
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    spans = [(0, 0, phoff + phentsize * phnum)]
    for i in range(phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz, _, _ = struct.unpack_from("<IIQQQQQQ", data, phoff + i * phentsize)
        if p_type == 4:  # PT_NOTE
            spans.append((p_offset, p_vaddr, p_filesz))
    return spans


def image_matches_file(library: str, base: int, data, slots: dict[str, list[int]]) -> str | None:
    """Why the file read is not the image mapped at `base`, or None when it is: the mapping's file was replaced
    (a reinstall while this process runs), the mapped headers or build id differ from the file's, or a slot does
    not hold a code address now."""
    mappings = _mappings()
    if library.endswith(" (deleted)"):
        return "its file was replaced while this process runs"
    own = [m for m in mappings if m.path == library and m.perms.endswith("p")]  # not this function's own mmap
    if not any(m.offset == 0 and m.start == base for m in own):
        return "its first mapping is not at its load address"
    for offset, vaddr, size in identity_spans(data):
        address = base + vaddr
        if not any(m.start <= address and address + size <= m.end and "r" in m.perms for m in own):
            return "its headers are not mapped"
        if ctypes.string_at(address, size) != bytes(data[offset : offset + size]):
            return "the file's headers or build id differ from the mapped image's"
    for offsets in slots.values():
        for offset in offsets:
            slot = base + offset
            if not any(m.start <= slot < m.end for m in own):
                return "an import slot lies outside its mappings"
            target = ctypes.c_void_p.from_address(slot).value or 0
            if not any(m.start <= target < m.end and "x" in m.perms for m in mappings):
                return "an import slot does not hold a code address"
    return None


def _write_slots(values: dict[int, int]) -> bool:
    """Write function addresses into their slots ({address: value}), making a read-only page (RELRO) writable for
    the write; False, and nothing written, when a page cannot be made writable."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    mappings = _mappings()
    locked = {
        address & ~(mmap.PAGESIZE - 1)
        for address in values
        if not any(m.start <= address < m.end and "w" in m.perms for m in mappings)
    }
    opened = []
    for page in sorted(locked):
        if libc.mprotect(page, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE) != 0:
            for done in opened:
                libc.mprotect(done, mmap.PAGESIZE, mmap.PROT_READ)
            return False
        opened.append(page)
    for address, value in values.items():
        ctypes.c_void_p.from_address(address).value = value
    for page in opened:
        libc.mprotect(page, mmap.PAGESIZE, mmap.PROT_READ)
    return True


class Blas:
    """A BLAS loaded with local symbol scope, and the prefix its symbols carry (scipy-openblas32's are `scipy_`):
    `blas.cblas_sgemm`, `blas.openblas_set_num_threads` name the library's own, whatever its prefix."""

    def __init__(self, path: str):
        self.path = path
        self.library = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
        self.prefix = next((p for p in ("", "scipy_") if hasattr(self.library, p + "cblas_sgemm")), None)
        if self.prefix is None:
            raise OSError(f"{path} has no cblas_sgemm: not a BLAS")

    def __getattr__(self, name: str):
        return getattr(self.library, self.prefix + name)

    def address(self, name: str) -> int | None:
        return ctypes.cast(getattr(self, name), ctypes.c_void_p).value if hasattr(self, name) else None

    def __repr__(self) -> str:
        return f"Blas({self.path!r})"


def pip_openblas() -> str | None:
    """The OpenBLAS of the scipy-openblas32 wheel (a dependency on Linux), found without importing numpy or it."""
    spec = importlib.util.find_spec("scipy_openblas32")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(next(iter(spec.submodule_search_locations)), "lib").glob("libscipy_openblas*.so*"))
    return str(found[0]) if found else None


def _candidates() -> list[str]:
    """MLX_ENCODERS_BLAS's library ("0": none), else pip's OpenBLAS, else the system's (apt's libopenblas)."""
    chosen = os.environ.get("MLX_ENCODERS_BLAS")
    if chosen:
        return [] if chosen == "0" else [chosen]
    return [path for path in (pip_openblas(), ctypes.util.find_library("openblas")) if path]


class Binding(NamedTuple):
    """The fast BLAS MLX's products were given, and where in libmlx its functions' addresses were written."""

    blas: Blas
    slots: dict[str, list[int]]  # name -> absolute slot addresses (the gemms', and popen's for `native_kernels`)


BLAS_THREAD_TIMEOUT = "4"  # OpenBLAS's least: its idle threads spin 2^4 cycles, then sleep until the next product


def load_blas(path: str) -> Blas:
    """The BLAS at `path`, its idle threads sleeping at once (OPENBLAS_THREAD_TIMEOUT, read as it loads, unless the
    environment gives it a value): OpenBLAS's spin for 2^28 cycles after each product, CPU taken from MLX's stream
    threads, a server's event loop and other processes, for no gain in wall time. The environment is left as it
    was, so numpy's BLAS and child processes keep their own setting."""
    given = os.environ.get("OPENBLAS_THREAD_TIMEOUT")
    if not given:  # unset, or empty (which OpenBLAS reads as its default)
        os.environ["OPENBLAS_THREAD_TIMEOUT"] = BLAS_THREAD_TIMEOUT
    try:
        return Blas(path)
    finally:
        if given is None:
            del os.environ["OPENBLAS_THREAD_TIMEOUT"]
        elif not given:
            os.environ["OPENBLAS_THREAD_TIMEOUT"] = given


def give_mlx_fast_blas() -> Binding | None:
    """Point libmlx's BLAS imports at a fast BLAS loaded with local scope; the binding, or None (not Linux, tuning
    off, none installed, or an MLX image this cannot verify: MLX then keeps its own, with one warning, and the import
    goes on)."""
    library = _mlx_library() if sys.platform.startswith("linux") and tuning_enabled() else None
    if library is None:
        return None
    for path in _candidates():
        try:
            blas = load_blas(path)
        except OSError:
            continue
        try:
            return _point_mlx_at(library, blas)
        except Exception as e:  # an ELF or a process this cannot read must not stop the import
            warnings.warn(f"mlx_encoders could not give MLX {path} ({e!r}); MLX keeps its own BLAS", stacklevel=3)
            return None
    return None


def _point_mlx_at(library: str, blas: Blas) -> Binding | None:
    base = None if library.endswith(" (deleted)") else _load_base(library)
    if base is None:
        return _decline(library, "its file was replaced while this process runs, or its load address is unknown")
    with open(library, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        slots = {n: s for n, s in import_slots(data, (*GEMMS, "popen")).items() if n == "popen" or hasattr(blas, n)}
        why = "its BLAS imports are not listed (a stripped build)" if "cblas_sgemm" not in slots else None
        why = why or image_matches_file(library, base, data, slots)
    if why:
        return _decline(library, why)
    absolute = {n: [base + offset for offset in offsets] for n, offsets in slots.items()}
    gemms = {n: addresses for n, addresses in absolute.items() if n in GEMMS}
    if not _write_slots({slot: blas.address(n) for n, addresses in gemms.items() for slot in addresses}):
        return None
    return Binding(blas, absolute)


def _decline(library: str, why: str) -> None:
    DECLINED.append(why)
    warnings.warn(f"mlx_encoders leaves MLX's BLAS as it is: {library}: {why}", UserWarning, stacklevel=5)


DECLINED: list[str] = []  # why MLX was left with its own BLAS, when the image could not be verified


def one_row_products() -> bool:
    """Send MLX's one-row (and one-column) float32 products to the BLAS's sgemv, which streams a weight once where
    sgemm packs it first: a decoding step's products. Builds the small C helper (`gemv.py`) on first need; without a
    compiler, or with tuning off, MLX keeps the BLAS's sgemm. Returns whether the products go through sgemv."""
    if BINDING is None or not tuning_enabled():
        return False
    with _forwarding_lock:
        if not gemv.FORWARDING:
            address = gemv.forwarding_sgemm(BINDING.blas)
            if address is None or not _write_slots({slot: address for slot in BINDING.slots["cblas_sgemm"]}):
                return False
    return True


_forwarding_lock = threading.Lock()


def global_blas() -> bool:
    """Whether a BLAS is in the global symbol scope (LD_PRELOAD, or loaded globally by other code before MLX), where
    MLX's imports bind to it unless they were given one here."""
    return hasattr(ctypes.CDLL(None), "cblas_sgemm")


def warn_if_slow_blas() -> None:
    if not sys.platform.startswith("linux") or not on_cpu() or BLAS is not None or global_blas():
        return
    chosen = os.environ.get("MLX_ENCODERS_BLAS")
    if chosen == "0" or not tuning_enabled() or DECLINED:  # said already
        return
    fix = (
        f"MLX_ENCODERS_BLAS={chosen} could not be loaded as a BLAS: correct the path, or unset it to use the "
        "package's own OpenBLAS"
        if chosen
        else "Reinstall the package (`pip install -e .` brings scipy-openblas32) or point MLX_ENCODERS_BLAS at a "
        "libopenblas.so"
    )
    warnings.warn(
        "MLX's matrix products run on the reference BLAS bundled with its Linux wheel, 10-50x slower on the CPU. "
        f"{fix}; MLX_ENCODERS_BLAS=0 silences this warning.",
        UserWarning,
        stacklevel=3,
    )


def warn_if_usearch_first(usearch_first: bool) -> None:
    """usearch's Linux extension carries its own static C++ runtime: loaded before MLX, it breaks the C++ source
    MLX writes for compiled CPU kernels (a compiler error naming /tmp/mlx/.../tmp_*.cpp at the first mx.compile)."""
    if usearch_first and sys.platform.startswith("linux"):
        warnings.warn(
            "usearch was imported before MLX: MLX's compiled CPU kernels will then fail to build (a C++ compiler "
            "error naming /tmp/mlx/.../tmp_*.cpp). Import mlx_encoders (or mlx) before usearch.",
            UserWarning,
            stacklevel=3,
        )


class ForkedAfterMLX(RuntimeError):
    """MLX ran in a parent process that forked this one: its CPU workers did not survive the fork."""


_mlx_process: list[int] = []  # the process in which the package first ran MLX computations


def claim_mlx() -> None:
    """Called before the package's computations: in a child forked after MLX ran in its parent, MLX's first
    computation would wait forever on workers the fork did not copy, so this raises a clear error instead. The first
    call has MLX build its compiled kernels for this processor (`native_kernels`)."""
    if not _mlx_process:
        _mlx_process.append(os.getpid())
        native_kernels()
    elif _mlx_process[0] != os.getpid():
        raise ForkedAfterMLX(
            f"this process (pid {os.getpid()}) was forked from one that had already run MLX (pid {_mlx_process[0]}), "
            "whose CPU workers do not survive a fork, so MLX would wait forever. Start worker processes with the "
            "'spawn' or 'forkserver' start method (multiprocessing.get_context('spawn')), or create them before "
            "the parent first uses mlx_encoders."
        )


# The flags for MLX's kernel builds on x86-64 (`native_kernels`), the first set g++ accepts: AVX2, FMA and F16C, which
# MLX's own builds with AVX2 pass too, rather than -march=native: MLX reuses a kernel it finds built (named by version
# and kernel only), and a cache carried to an older processor (a container image) must not hold instructions it
# lacks. No multiply-add is contracted (the baseline x86-64 has no FMA), so each element is rounded exactly as
# before. Without errno (which no kernel reads) and with more alias checks, g++ also vectorizes square roots and
# kernels of many arrays (AdamW's update); a compiler that refuses those two still gets the AVX2 set.
NATIVE_FLAGS = {
    "x86_64": (
        "-mavx2 -mfma -mf16c -ffp-contract=off -fno-math-errno --param=vect-max-version-for-alias-checks=64",
        "-mavx2 -mfma -mf16c -ffp-contract=off",
    )
}
NATIVE_CPU_FEATURES = {"x86_64": {"avx2", "fma", "f16c"}}  # /proc/cpuinfo's names for what NATIVE_FLAGS need


def native_kernels() -> bool:
    """Have MLX build the element-wise kernels `mx.compile` fuses for AVX2 (where its Linux wheel builds for SSE2)
    on a processor that has it: GELU's fused kernel runs about 1.3x as fast, a fine-tuning step 3% faster
    (benchmarks/RESULTS.md). Gives libmlx's popen slot the forwarding popen of `kernel_flags.py`, which adds
    the first of NATIVE_FLAGS that g++ accepts to MLX's kernel build command alone; the slot is the one found, and
    checked, with the BLAS's slots, so only where the engine gave MLX its BLAS. Kernels MLX built before (its cache
    under the temporary folder) stay as they are. Returns whether MLX's builds get the flags; nothing with tuning
    off, off x86-64 Linux, on a processor without the features, or without a compiler."""
    machine = platform.machine()
    candidates = NATIVE_FLAGS.get(machine)
    if BINDING is None or "popen" not in BINDING.slots or candidates is None or not tuning_enabled():
        return False
    with _forwarding_lock:
        if not kernel_flags.FORWARDING:
            flags = accepted_flags(candidates) if NATIVE_CPU_FEATURES[machine] <= cpu_features() else None
            address = kernel_flags.forwarding_popen(flags) if flags is not None else None
            if address is None or not _write_slots({slot: address for slot in BINDING.slots["popen"]}):
                kernel_flags.FORWARDING.clear()  # not given to MLX: a later call tries again
                return False
    return True


def cpu_features() -> set[str]:
    """The processor's feature flags as Linux lists them (/proc/cpuinfo); empty where it cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), set())


def accepted_flags(candidates: Sequence[str]) -> str | None:
    """The first of `candidates` (sets of compiler flags) that g++ accepts, or None."""
    return next((flags for flags in candidates if _compiler_accepts(flags)), None)


def _compiler_accepts(flags: str) -> bool:
    """Whether the g++ MLX calls compiles an empty C++ source with `flags`."""
    try:
        done = subprocess.run(
            ["g++", *flags.split(), "-x", "c++", "-fsyntax-only", "-"], input="", capture_output=True, timeout=30
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


class Outermost:
    """A process-wide setting for nested or concurrent blocks (`with setting:`): the first block to open calls
    `enter`, the last to close calls `leave`, whatever the order the threads leave in."""

    def __init__(self, enter: Callable[[], None], leave: Callable[[], None]):
        self.enter, self.leave = enter, leave
        self.lock, self.open = threading.Lock(), 0

    def __enter__(self) -> None:
        with self.lock:
            if self.open == 0:
                self.enter()
            self.open += 1

    def __exit__(self, *exception) -> None:
        with self.lock:
            self.open -= 1
            if self.open == 0:
                self.leave()


@contextmanager
def one_blas_thread() -> Iterator[bool]:
    """Inside, MLX's BLAS runs each product on the calling thread alone, so that passes on several CPU streams at once
    each keep one core; yields whether that holds. It holds for the OpenBLAS given to MLX (its thread count set to
    1, restored after; other libraries' BLAS are untouched) and for the reference BLAS, which never starts threads;
    not with tuning off, on other platforms, or for a BLAS another program put in the global scope."""
    holds = one_blas_thread_holds()
    if not holds or BLAS is None:  # nothing to set: the reference BLAS never starts threads
        yield holds
        return
    with _one_openblas_thread(BLAS):
        yield True


def one_blas_thread_holds() -> bool:
    """Whether `one_blas_thread` can hold MLX's BLAS to one thread a call, asked without setting anything."""
    if not sys.platform.startswith("linux") or not tuning_enabled():
        return False
    if BLAS is None:
        return not global_blas()
    return hasattr(BLAS, "openblas_set_num_threads")  # not when MLX_ENCODERS_BLAS named another library


@functools.cache
def _one_openblas_thread(library: Blas) -> Outermost:
    threads = []

    def enter() -> None:
        threads[:] = [library.openblas_get_num_threads()]
        library.openblas_set_num_threads(1)

    return Outermost(enter, lambda: library.openblas_set_num_threads(threads[0]))


# Element-wise work over many independent arrays (an optimizer's per-parameter updates): MLX's CPU backend runs
# each stream's ops on one thread, so spreading the arrays over a few CPU streams puts every core to work.
MAX_CPU_STREAMS = 8


_thread_streams = threading.local()


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity where the platform has one (`taskset`, a container's
    cpuset, `mlx-encoders launch` giving each rank its share), else every core."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_streams() -> tuple[mx.Stream, ...]:
    """One CPU stream per usable core (at most MAX_CPU_STREAMS), made once per thread: an MLX stream belongs to the
    thread that made it (a server's model worker runs beside the main thread)."""
    if not hasattr(_thread_streams, "lanes"):
        _thread_streams.lanes = tuple(mx.new_stream(mx.cpu) for _ in range(min(MAX_CPU_STREAMS, usable_cores())))
    return _thread_streams.lanes


def lane_count() -> int:
    """How many streams `forward_lanes` gives, asked without setting anything."""
    if not on_cpu() or len(cpu_streams()) < 2 or not one_blas_thread_holds():
        return 1
    return len(cpu_streams())


@contextmanager
def forward_lanes() -> Iterator[tuple[mx.Stream, ...]]:
    """Streams for independent forward passes that run at once, one per core on the CPU: MLX runs each stream's
    elementwise ops on one thread, and a multithreaded BLAS splits only the products (its threads wait
    between them), so one pass at a time leaves a core idle for a third or more of an encoder's time. Inside,
    the BLAS runs each product on its calling stream's thread (`one_blas_thread`). Off the CPU, with
    one core, or with a BLAS that cannot be held to one thread: the default stream alone. The lanes are idle
    when the block ends, whether it raised or not."""
    if lane_count() < 2:
        yield (mx.default_stream(mx.default_device()),)
        return
    with one_blas_thread():
        lanes = cpu_streams()
        try:
            yield lanes
        finally:
            for lane in lanes:  # before the BLAS gets its threads back
                mx.synchronize(lane)


def spread_over_streams(arrays: Sequence[mx.array]) -> dict[int, mx.Stream] | None:
    """{id(array): stream} sharing `arrays` out over `cpu_streams()`, largest first onto the least loaded, so each
    stream gets about the same number of elements; None off the CPU or with one core, where the default stream
    serves (a GPU runs each kernel on all of its cores)."""
    if not on_cpu() or len(cpu_streams()) < 2:
        return None
    loads = dict.fromkeys(cpu_streams(), 0)
    chosen = {}
    for x in sorted(arrays, key=lambda a: -a.size):
        stream = min(loads, key=loads.get)
        loads[stream] += x.size
        chosen[id(x)] = stream
    return chosen


# glibc raises its mmap threshold to the size of each mapped buffer freed, up to this (64-bit).
GLIBC_MMAP_THRESHOLD_MAX = 32 * 2**20


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, or None (macOS, other C libraries)."""
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallopt"):
        return None
    libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


@functools.cache
def _heap_warmed() -> None:
    libc = _libc()
    buffer = libc.malloc(GLIBC_MMAP_THRESHOLD_MAX - 2**16)  # mapped, being above glibc's starting threshold
    libc.free(buffer)


def warm_heap() -> None:
    """Have glibc serve buffers of up to 32 MB from its heap, through its own adjustment: one buffer just under that
    size is mapped and freed, which raises its mmap threshold (for the rest of the process) as any program freeing
    a large buffer does; no mallopt. Otherwise every buffer above the starting 128 KB is mapped afresh and faults
    its pages in, once per 4 KB, and each unmapping interrupts the other threads (MLX caches 32 MB by default).
    Once per process; nothing with tuning off or without glibc."""
    if tuning_enabled() and _libc() is not None:
        _heap_warmed()


@contextmanager
def keep_freed_memory() -> Iterator[None]:
    """Inside, MLX keeps the buffers it frees for reuse, up to the largest working set seen (`mx.get_peak_memory`,
    raised by `cache_working_set` after each step): training allocates the same large buffers (activations,
    gradients, optimizer state) at every step, and a buffer given back to the system has its pages faulted in
    again at the next step. On leaving, MLX's previous cache limit is set again and its cache emptied, so nothing
    outlives the block. The outermost of nested or concurrent blocks does both; nothing with tuning off."""
    if not tuning_enabled():
        yield
        return
    with _keeping():
        yield


def cache_working_set() -> None:
    """Inside `keep_freed_memory`, let MLX's cache hold as much as the largest working set so far: a step's
    buffers are reused at the next, and steps of varying shapes cannot grow the cache past that."""
    keeping = _keeping()
    with keeping.lock:
        if keeping.open:
            mx.set_cache_limit(max(keeping.previous[-1], mx.get_peak_memory()))


@functools.cache
def _keeping() -> Outermost:
    def keep() -> None:
        previous = mx.set_cache_limit(mx.get_peak_memory())  # reads the caller's limit as it sets one
        keeping.previous.append(previous)
        mx.set_cache_limit(max(previous, mx.get_peak_memory()))

    def hand_back() -> None:
        mx.set_cache_limit(keeping.previous.pop())
        mx.clear_cache()

    keeping = Outermost(keep, hand_back)
    keeping.previous = []
    return keeping


HUGE_PAGE = 2 << 20  # a transparent huge page on x86-64 and on AArch64 with 4 KB base pages
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # Linux's madvise advice values (MADV_COLLAPSE: Linux 6.1 and later)


def anonymous_mappings() -> set[tuple[int, int]]:
    """(start, end) of this process's writable anonymous mappings (Linux; empty elsewhere): a `huge_pages` baseline."""
    return {(m.start, m.end) for m in _mappings() if m.perms.startswith("rw") and not m.path}


@contextmanager
def huge_pages() -> Iterator[None]:
    """Back the writable anonymous mappings made inside the block (a graph library's nodes and vectors) with 2 MB
    transparent huge pages: MADV_HUGEPAGE for the pages touched later, MADV_COLLAPSE for those already there. A walk
    over a graph of hundreds of MB touches a new 4 KB page at almost every step, each a TLB miss that 2 MB pages
    mostly spare, in building as in searching (docs/performance.md). Advice the kernel refuses (an older kernel,
    huge pages off) changes nothing; nothing off Linux or with tuning off."""
    if not sys.platform.startswith("linux") or not tuning_enabled():
        yield
        return
    before = anonymous_mappings()
    try:
        yield
    finally:
        madvise = _madvise()
        for start, end in anonymous_mappings() - before:
            start, end = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
            if madvise is None or end - start < HUGE_PAGE:
                continue
            madvise(start, end - start, MADV_HUGEPAGE)
            for at in range(start, end, HUGE_PAGE):  # range by range: one refused range stops no other
                madvise(at, HUGE_PAGE, MADV_COLLAPSE)


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


BINDING: Binding | None = give_mlx_fast_blas()  # the fast BLAS given to MLX at import, if any


# MLX orders an evaluation's ops breadth first while at most MLX_BFS_MAX_WIDTH (20 by default) are pending, then goes
# depth first. A group's passes evaluated together run at once on their lanes only while that order alternates
# between them; a decoder layer's branches (rotary halves, q/k norms, masks) alone fill 20, and then one lane's pass
# is ordered ahead of the other's and the lanes take turns (a Qwen3-0.6B-shaped group ran on one core at a time).
# Wider costs memory where the order saves it: gradient checkpointing's recomputed layers run side by side
# (benchmarks/RESULTS.md, "With the lanes' passes ordered to alternate").
LANES_BFS_WIDTH = 40
# Names the value this package set, so that a child process (it inherits the environment) can tell it from the
# user's own and decide for itself (tuning off, one core).
BFS_WIDTH_SET = "MLX_ENCODERS_SET_BFS_WIDTH"


def widen_evaluation() -> str | None:
    """Set MLX_BFS_MAX_WIDTH to LANES_BFS_WIDTH where the process starts on the CPU with several usable cores and the
    environment gives no value of its own; the value set, or None. A value a parent process's import set
    (BFS_WIDTH_SET) is taken back first. MLX reads it at its first evaluation, so it counts from an import of the
    package before any MLX computation (set it in the environment otherwise). It changes the order MLX runs
    independent ops in, never a result."""
    inherited = os.environ.pop(BFS_WIDTH_SET, None)
    if inherited is not None and os.environ.get("MLX_BFS_MAX_WIDTH") == inherited:
        del os.environ["MLX_BFS_MAX_WIDTH"]
    if not tuning_enabled() or "MLX_BFS_MAX_WIDTH" in os.environ or not on_cpu() or usable_cores() < 2:
        return None
    os.environ["MLX_BFS_MAX_WIDTH"] = os.environ[BFS_WIDTH_SET] = value = str(LANES_BFS_WIDTH)
    return value


BFS_WIDTH: str | None = widen_evaluation()
BLAS: Blas | None = BINDING.blas if BINDING else None

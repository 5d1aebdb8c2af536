"""The worker side of the tiled runtime: the L1 tile cache, peer fetch (L2), panel prefetch, and
the execution of one :class:`~paperline.kernels.blas.plan.TileTask` (BLASX Sec. 4).

Each worker process keeps one :class:`WorkerState` per run: an LRU cache of operand tiles on its
device bounded in bytes (the memory budget), a one-thread prefetcher that loads panel ``p+1``
while panel ``p`` is multiplied, reused scratch buffers for panel products, and counters of what
moved where. On CPU a tile of a ``.npy`` operand is a read-only view of the file's memory map
(the cache then bounds how many such views a worker keeps; the page cache holds the bytes). A
tile missing from the cache comes from a peer worker that holds it when the driver says one does
and peer fetch pays (:attr:`RunContext.peer_fetch`), else from its source (host memory, a
memory-mapped file, S3).
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

from paperline.kernels.blas.namespace import Namespace, namespace
from paperline.kernels.blas.plan import TileRef, TileTask, zero_diagonal_error
from paperline.kernels.blas.sources import TileSource, read_npy_header
from paperline.kernels.errors import InputError

TileKey = tuple[str, int, int]  # (source key, tile row, tile col)
Sink = Callable[[tuple[int, int], np.ndarray], None]  # (output tile index, host tile) -> None


@dataclass
class RunContext:
    """What every tile task of one run shares (small, pickled into each task).

    Attributes:
        run_id: identifies the run (worker state is per run).
        sources: operand name -> source; ``"x"`` is the output being written (TRSM reads it).
        tile: tile edge.
        device: ``"cpu"`` or ``"cuda"``.
        memory_budget: bytes of operand tiles a worker may cache (L1).
        check_finite: refuse NaN/inf in any tile read.
        peer_fetch: which source kinds a missing tile is fetched from a peer instead of
            (``{"s3", "generated", "output"}`` on CPU; every kind on GPU).
        output_path: a ``.npy`` file the worker writes its output tiles into (None: tiles are
            returned to the driver).
    """

    run_id: str
    sources: dict[str, TileSource]
    tile: int
    device: str = "cpu"
    memory_budget: int = 1 << 30
    check_finite: bool = True
    peer_fetch: frozenset[str] = frozenset({"s3", "generated", "output"})
    output_path: str | None = None
    prefetch: bool = True

    def key(self, ref: TileRef) -> TileKey:
        """The cache/directory key of the stored tile ``ref`` reads: ``(source key, i, j)``."""
        return (self.sources[ref.operand].key, ref.i, ref.j)

    def tile_bytes(self, ref: TileRef) -> int:
        """Bytes of the stored tile ``ref`` reads (edge tiles are smaller), in its source's dtype."""
        src = self.sources[ref.operand]
        rows = min(self.tile, src.shape[0] - ref.i * self.tile)
        cols = min(self.tile, src.shape[1] - ref.j * self.tile)
        return rows * cols * src.dtype.itemsize


class TileCache:
    """An LRU map of tiles bounded by their total size in bytes (BLASX's L1 tile cache).

    Thread-safe. ``added``/``evicted`` collect the keys stored and dropped since the last :meth:`drain`, so the
    driver's directory of who holds what stays close to the truth.
    """

    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        self.size = 0
        self._items: OrderedDict[TileKey, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.evicted: list[TileKey] = []
        self.added: list[TileKey] = []

    def get(self, key: TileKey) -> Any | None:
        """The cached tile (now most recently used), or None."""
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
            return None

    def peek(self, key: TileKey) -> Any | None:
        """The cached tile, or None, without touching its LRU position."""
        with self._lock:
            return self._items.get(key)

    def put(self, key: TileKey, tile: Any) -> None:
        """Cache ``tile`` (a NumPy or CuPy array), evicting least recently used tiles until its
        ``nbytes`` fit the capacity (bytes). A tile larger than the whole capacity is not kept.
        """
        nbytes = int(tile.nbytes)
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return
            if nbytes > self.capacity:
                return  # larger than the whole budget: used once, never kept (and nothing evicted)
            while self._items and self.size + nbytes > self.capacity:
                old_key, old = self._items.popitem(last=False)
                self.size -= int(old.nbytes)
                self.evicted.append(old_key)
            self._items[key] = tile
            self.size += nbytes
            self.added.append(key)

    def drain(self) -> tuple[list[TileKey], list[TileKey]]:
        """(keys added, keys evicted) since the last call."""
        with self._lock:
            added, evicted = self.added, self.evicted
            self.added, self.evicted = [], []
        return added, evicted

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._items


@dataclass
class Counters:
    """Per-worker transfer and cache counters of one run (bytes, or counts); summed into ``RunResult.counters``."""

    hits: int = 0
    misses: int = 0
    bytes_source: int = 0  # read from the operand's source (host memory, file, generator)
    bytes_s3: int = 0  # fetched from S3 by the tile reads (whole bands, some reads served by a kept band)
    bytes_host_to_device: int = 0  # copied host -> device (GPU only)
    bytes_peer: int = 0  # fetched from another worker
    peer_misses: int = 0  # the peer no longer held it

    def as_dict(self) -> dict[str, int]:
        """The counters by name."""
        return dict(self.__dict__)


class OutputFile:
    """Writes tiles into a C-ordered ``.npy`` file with ``pwrite``, one call per tile row.

    Through a shared writable memory map every 4 KiB page of a new tile faults (measured: 33-47
    ms per 32 MiB tile against 18-20 ms with ``pwrite``), and ``pwrite`` needs no mapping.

    Raises:
        OSError: the file cannot be opened or a write comes up short (a full disk).
        ValueError: the file is not a C-ordered 2-D ``.npy`` file (at construction).
    """

    def __init__(self, path: str):
        with open(path, "rb") as f:
            shape, fortran, dtype, self.offset = read_npy_header(f)
        if fortran or len(shape) != 2:
            raise ValueError(f"{path}: expected a C-ordered 2-D .npy file")
        self.path, self.shape, self.dtype = path, shape, dtype
        self.fd = os.open(path, os.O_WRONLY)

    def write(self, r0: int, c0: int, tile: np.ndarray) -> None:
        """Store ``tile`` at rows ``r0:``, columns ``c0:`` of the matrix."""
        tile = np.ascontiguousarray(tile, dtype=self.dtype)
        rows, cols = tile.shape
        item, n = self.dtype.itemsize, self.shape[1]
        if c0 == 0 and cols == n:
            self._write_all(tile, self.offset + r0 * n * item)
            return
        for r in range(rows):
            self._write_all(tile[r], self.offset + ((r0 + r) * n + c0) * item)

    def _write_all(self, data: np.ndarray, offset: int) -> None:
        view = memoryview(data).cast("B")
        while view:
            written = os.pwrite(self.fd, view, offset)
            if written <= 0:
                raise OSError(f"{self.path}: short write at byte {offset}")
            view, offset = view[written:], offset + written

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass
class WorkerState:
    """One run's state in one worker process: its tile cache, prefetch threads, counters, output file."""

    ctx: RunContext
    ns: Namespace
    cache: TileCache
    prefetcher: ThreadPoolExecutor
    counters: Counters = field(default_factory=Counters)
    lock: threading.Lock = field(default_factory=threading.Lock)
    output: OutputFile | None = None
    free: dict[tuple, list] = field(default_factory=dict)
    active: int = 0  # tasks of this run executing in this process now
    retired: bool = False  # released or evicted: closed when its last task ends
    drain: ThreadPoolExecutor | None = None  # GPU: output tiles' device-to-host copies (see execute's sink)

    def close(self) -> None:
        """Stop the prefetch threads and wait for queued device-to-host copies."""
        self.prefetcher.shutdown(wait=False)
        if self.drain is not None:
            self.drain.shutdown(wait=True)  # a queued copy still reads a pooled buffer
        if self.output is not None:
            self.output.close()

    def take(self, shape: tuple[int, int], dtype: np.dtype) -> Any:
        """A scratch tile buffer (reused across tasks: a fresh 32 MiB buffer costs 40-60 ms of page
        faults here, a tenth of the product it holds)."""
        with self.lock:
            stack = self.free.get((shape, np.dtype(dtype)))
            if stack:
                return stack.pop()
        return self.ns.xp.empty(shape, dtype)

    def give(self, buffer: Any) -> None:
        """Return a buffer from :meth:`take` (at most :data:`FREE_BUFFERS` kept per shape)."""
        with self.lock:
            stack = self.free.setdefault((buffer.shape, buffer.dtype), [])
            if len(stack) < FREE_BUFFERS:
                stack.append(buffer)


_STATES: dict[str, WorkerState] = {}
_STATES_LOCK = threading.Lock()


FREE_BUFFERS = 2  # scratch buffers a run keeps per tile shape and process (product, accumulator)
MAX_RUN_STATES = 8  # runs a process keeps tile caches for (a run's finish releases its own)


def _retire(state: WorkerState) -> None:
    """Close ``state`` now if no task of its run is executing, else when the last one ends (its
    prefetcher and output file stay valid for the tasks still using them). Under ``_STATES_LOCK``."""
    state.retired = True
    if state.active == 0:
        state.close()


def worker_state(ctx: RunContext) -> WorkerState:
    """This process's state for ``ctx.run_id`` (created on first use), counted as in use by one
    more task until :func:`task_done`.

    Concurrent runs each keep their own state; beyond :data:`MAX_RUN_STATES` (runs whose driver
    died before releasing them) the oldest state no task is using is dropped.
    """
    with _STATES_LOCK:
        state = _STATES.get(ctx.run_id)
        if state is None:
            idle = [k for k, s in _STATES.items() if s.active == 0]
            while len(_STATES) >= MAX_RUN_STATES and idle:
                _retire(_STATES.pop(idle.pop(0)))
            state = WorkerState(ctx, namespace(ctx.device), TileCache(ctx.memory_budget),
                                ThreadPoolExecutor(max_workers=1, thread_name_prefix="paperline-prefetch"))
            _STATES[ctx.run_id] = state
        state.active += 1
        return state


def task_done(state: WorkerState) -> None:
    """A task that called :func:`worker_state` has ended (closes a retired state it was the last user of)."""
    with _STATES_LOCK:
        state.active -= 1
        if state.retired and state.active == 0:
            state.close()


def _drain(state: WorkerState, acc: Any, done: Any, out: tuple[int, int], sink: Sink, give: Any) -> None:
    """The drain thread's half of :func:`execute` with a sink: wait for ``done`` on a stream of this
    thread's own, copy ``acc`` into pinned host memory, pass it to ``sink``, return a pooled
    buffer only now that nothing reads it."""
    if state.ns.device == "cpu":  # no copy to wait for: the sink copies the tile out of the buffer
        sink(out, acc)
        if give is not None:
            state.give(give)
        return
    import cupyx  # noqa: PLC0415

    xp = state.ns.xp
    stream = getattr(_DRAIN, "stream", None)
    if stream is None:
        stream = _DRAIN.stream = xp.cuda.Stream(non_blocking=True)
    stream.wait_event(done)
    pinned = cupyx.empty_pinned(acc.shape, acc.dtype)
    acc.get(stream=stream, out=pinned)
    stream.synchronize()
    if give is not None:
        state.give(give)
    sink(out, pinned)


_DRAIN = threading.local()


def release_run(run_id: str | None = None) -> None:
    """Drop the cached tiles of ``run_id`` (every run when None) in this process."""
    with _STATES_LOCK:
        for key in [k for k in _STATES if run_id is None or k == run_id]:
            _retire(_STATES.pop(key))


def peer_tile(run_id: str, key: TileKey) -> np.ndarray | None:
    """A tile this process holds for ``run_id`` as a host array, or None (what a peer asks for)."""
    state = _STATES.get(run_id)
    if state is None:
        return None
    tile = state.cache.peek(tuple(key))
    return None if tile is None else state.ns.to_host(tile)


PeerFetch = Callable[[str, str, TileKey], "np.ndarray | None"]


def _apply(ns: Namespace, raw: Any, ref: TileRef) -> Any:
    xp, m = ns.xp, ref.mask
    if m in ("U", "L"):
        out = xp.triu(raw) if m == "U" else xp.tril(raw)
    elif m in ("Uu", "Lu"):
        out = xp.triu(raw, 1) if m == "Uu" else xp.tril(raw, -1)
        xp.fill_diagonal(out, 1)
    elif m == "symU":
        out = xp.triu(raw) + xp.triu(raw, 1).T
    elif m == "symL":
        out = xp.tril(raw) + xp.tril(raw, -1).T
    else:
        out = raw
    return out.T if ref.trans else out


def _kind(ctx: RunContext, operand: str) -> str:
    return "output" if operand == "x" else ctx.sources[operand].kind


_STORED_PART = {"U": ("triu", 0), "symU": ("triu", 0), "L": ("tril", 0), "symL": ("tril", 0),
                "Uu": ("triu", 1), "Lu": ("tril", -1)}


def check_finite_tile(host: np.ndarray, ref: TileRef, tile: int, where: str | None = None) -> None:
    """Refuse NaN/inf in the part of a stored tile that ``ref`` reads (a diagonal tile's other
    triangle, and a unit diagonal, are never read), naming the entry's index in the operand.

    Args:
        where: the operand's file path or S3 URI, named as the value seen (None: an in-memory
            array, whose entry is the value seen).

    Raises:
        InputError: naming the operand, its file or URI, and the first non-finite entry
            ``operand[row,col] = value``.
    """
    part = host
    if ref.mask in _STORED_PART:
        fn, k = _STORED_PART[ref.mask]
        part = getattr(np, fn)(host, k)
    if np.isfinite(part).all():
        return
    r, c = np.argwhere(~np.isfinite(part))[0]
    entry = f"{ref.operand}[{ref.i * tile + r},{ref.j * tile + c}] = {host[r, c]}"
    if where is None:
        raise InputError(ref.operand, entry, "non-finite value (check_finite is on)")
    raise InputError(ref.operand, where, f"non-finite value {entry} (check_finite is on)")


def load_raw(state: WorkerState, ref: TileRef, peers: dict[TileKey, str], peer_fetch: PeerFetch | None,
             check: bool = False) -> Any:
    """The stored tile of ``ref`` on this worker's device: L1 cache, else a peer (L2), else its
    source. With ``check`` (and ``check_finite``) a tile is checked once, when it enters the cache.

    Raises:
        InputError: a non-finite value in the part of the tile ``ref`` reads.
    """
    ctx, ns = state.ctx, state.ns
    key = ctx.key(ref)
    tile = state.cache.get(key)
    if tile is not None:
        with state.lock:
            state.counters.hits += 1
        return tile
    host = None
    moved = {"misses": 1}
    if peer_fetch is not None and key in peers and (ctx.device != "cpu" or _kind(ctx, ref.operand) in ctx.peer_fetch):
        host = peer_fetch(ctx.run_id, peers[key], key)
        if host is None:
            moved["peer_misses"] = 1
        else:
            moved["bytes_peer"] = host.nbytes
    if host is None:
        src = ctx.sources[ref.operand]
        t = ctx.tile
        rows, cols = slice(ref.i * t, (ref.i + 1) * t), slice(ref.j * t, (ref.j + 1) * t)
        if hasattr(src, "read_fetched"):  # (a source that says what it fetched: S3's band reads)
            host, fetched = src.read_fetched(rows, cols)
        else:
            host = src.read(rows, cols)
            fetched = host.nbytes
        moved["bytes_source"] = moved.get("bytes_source", 0) + host.nbytes
        if src.kind == "s3":
            moved["bytes_s3"] = fetched
    if check and ctx.check_finite:
        # a file's path or an S3 URI; None for in-memory and generated operands and the staged output
        check_finite_tile(host, ref, ctx.tile, getattr(ctx.sources[ref.operand], "where", None))
    tile = ns.to_device(host)
    if ns.device != "cpu":
        moved["bytes_host_to_device"] = host.nbytes
    with state.lock:
        for k, v in moved.items():
            setattr(state.counters, k, getattr(state.counters, k) + v)
    state.cache.put(key, tile)
    return tile


def load(state: WorkerState, ref: TileRef, peers: dict[TileKey, str], peer_fetch: PeerFetch | None,
         check: bool) -> Any:
    """``ref``'s tile as the task uses it (mask and transpose applied).

    Raises:
        InputError: the tile holds a non-finite value where it is read (with ``check_finite``).
    """
    return _apply(state.ns, load_raw(state, ref, peers, peer_fetch, check), ref)


def execute(ctx: RunContext, task: TileTask, peers: dict[TileKey, str] | None = None, peer_fetch: PeerFetch | None = None,
            worker: str = "local", sink: Sink | None = None) -> dict[str, Any]:
    """Compute one output tile on this process's device.

    Panels are multiplied in order while the next panel's tiles load on the prefetch thread.

    With ``sink`` (an in-process caller that owns the output array; useful on CUDA) the tile's
    device-to-host copy is not waited for: a drain thread copies it into a pinned buffer on its own
    stream, after the tile's last kernel, and hands it to ``sink(out_index, host)``, while this
    thread goes on to queue the next task's products. The result's ``"tile"`` is then None and
    ``"pending"`` a Future that completes when ``sink`` has returned (BLASX overlaps its
    write-back with computation the same way).

    Returns:
        ``{"index", "out", "worker", "start", "end", "tile"`` (host array, or None when written
        to ``ctx.output_path``) ``, "added", "evicted"`` (cache keys, for the driver's directory)
        ``, "counters"}``.

    Raises:
        InputError: a non-finite value (``check_finite``), a zero on a TRSM diagonal.
    """
    start = time.time()
    state = worker_state(ctx)
    try:
        return _execute(state, ctx, task, peers, peer_fetch, worker, start, sink)
    finally:
        task_done(state)


def _execute(state: WorkerState, ctx: RunContext, task: TileTask, peers: dict[TileKey, str] | None,
             peer_fetch: PeerFetch | None, worker: str, start: float, sink: Sink | None = None) -> dict[str, Any]:
    # NaN/inf operands (check_finite off) are the verification's to report, not NumPy's warnings
    # printed per tile product on the terminal (a trial)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        return _execute_tile(state, ctx, task, peers, peer_fetch, worker, start, sink)


def _execute_tile(state: WorkerState, ctx: RunContext, task: TileTask, peers: dict[TileKey, str] | None,
                  peer_fetch: PeerFetch | None, worker: str, start: float, sink: Sink | None = None) -> dict[str, Any]:
    ns, xp = state.ns, state.ns.xp
    peers = peers or {}
    before = state.counters.as_dict()

    def fetch(pair: tuple[TileRef, TileRef]) -> tuple[Any, Any]:
        return (load(state, pair[0], peers, peer_fetch, True),
                load(state, pair[1], peers, peer_fetch, True))

    acc = product = pooled = None
    wait_s = multiply_s = 0.0

    def load_panel(q: int) -> Future | None:
        if q >= len(task.terms):
            return None
        if ctx.prefetch:
            return state.prefetcher.submit(fetch, task.terms[q])
        done: Future = Future()
        done.set_result(fetch(task.terms[q]))
        return done

    pending = load_panel(0)
    for q in range(len(task.terms)):
        t0 = time.perf_counter()
        left, right = pending.result()
        t1 = time.perf_counter()
        pending = load_panel(q + 1)
        shape = (left.shape[0], right.shape[1])
        if acc is None:  # the accumulator is a reused buffer when the tile leaves through a copy
            if ctx.output_path is not None or ns.device != "cpu" or sink is not None:
                acc = pooled = state.take(shape, left.dtype)
            else:  # the tile itself travels to the driver
                acc = xp.empty(shape, left.dtype)
            xp.matmul(left, right, out=acc)
        else:  # one reused product buffer: no allocation (and page faults) per panel or task
            product = state.take(shape, left.dtype) if product is None else product
            xp.matmul(left, right, out=product)
            acc += product
        if ns.device != "cpu":
            # The panel's tiles may leave the cache (the prefetcher evicts) and their memory be
            # reused by the next copy, which runs on another stream: they stay referenced here
            # until their product is done. The next panel's copy overlaps this wait.
            ns.synchronize()
        wait_s += t1 - t0
        multiply_s += time.perf_counter() - t1
    out_rows, out_cols = ctx.sources["x"].shape
    rows = min(ctx.tile, out_rows - task.out[0] * ctx.tile)
    cols = min(ctx.tile, out_cols - task.out[1] * ctx.tile)
    dtype = next(iter(ctx.sources.values())).dtype
    if acc is None:
        acc = xp.zeros((rows, cols), dtype)
    elif task.alpha != 1.0:
        acc *= dtype.type(task.alpha)
    c0 = None
    if task.c0 is not None and (task.beta != 0.0 or task.keep or task.copy):
        check = task.beta != 0.0 and not task.copy
        if check and task.keep:  # C is read in the computed triangle only (its other one is returned as it is)
            load_raw(state, replace(task.c0, mask=task.keep), peers, peer_fetch, True)  # checked and cached
            check = False
        c0 = load(state, task.c0, peers, peer_fetch, check=check)
    if task.copy:
        acc = xp.array(c0) if c0 is not None else xp.zeros((rows, cols), dtype)
    elif c0 is not None and task.beta != 0.0:
        acc += dtype.type(task.beta) * c0
    if task.solve is not None:
        diag = load(state, task.solve, peers, peer_fetch, True)
        zeros = xp.flatnonzero(xp.diagonal(diag) == 0)
        if zeros.size:
            raise zero_diagonal_error(task.solve.i * ctx.tile + int(zeros[0]), getattr(ctx.sources["a"], "where", None))
        if task.side == "L":
            acc = ns.solve_triangular(diag, acc, lower=task.solve_lower, trans=False)
        else:
            acc = ns.solve_triangular(diag, acc.T, lower=task.solve_lower, trans=True).T
        acc = xp.ascontiguousarray(acc.astype(dtype, copy=False))
        # Later tasks of this run read this output tile: keep it where it was made.
        state.cache.put((ctx.sources["x"].key, task.out[0], task.out[1]), acc)
    if task.keep and not task.copy:
        mask = xp.triu(xp.ones((rows, cols), bool)) if task.keep == "U" else xp.tril(xp.ones((rows, cols), bool))
        acc = xp.where(mask, acc, c0 if c0 is not None else dtype.type(0))
    extra: dict[str, Any] = {}
    host = None
    if sink is not None and ctx.output_path is None:
        acc = xp.ascontiguousarray(acc)
        done = None
        if ns.device != "cpu":
            done = xp.cuda.Event(disable_timing=True)
            done.record()  # after acc's last kernel on this thread's stream
        if state.drain is None:
            state.drain = ThreadPoolExecutor(max_workers=1, thread_name_prefix="paperline-drain")
        give = acc if (pooled is not None and acc is pooled) else None  # returned by the drain thread
        extra["pending"] = state.drain.submit(_drain, state, acc, done, task.out, sink, give)
    else:
        ns.synchronize()
        host = ns.to_host(acc)
        if ctx.output_path is not None:
            with state.lock:
                if state.output is None:
                    state.output = OutputFile(ctx.output_path)
            state.output.write(task.out[0] * ctx.tile, task.out[1] * ctx.tile, host)
            host = None
        if pooled is not None and acc is pooled:  # written out or copied to host (not replaced on the way)
            state.give(acc)
    if product is not None:
        state.give(product)  # with a sink its last use is queued on this stream: reuse is stream-ordered
    added, evicted = state.cache.drain()
    after = state.counters.as_dict()
    return {"index": task.index, "out": task.out, "worker": worker, "start": start, "end": time.time(),
            "tile": host, **extra, "added": added, "evicted": evicted, "wait_s": wait_s,
            "multiply_s": multiply_s, "counters": {k: after[k] - before[k] for k in after}}

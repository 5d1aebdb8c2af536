"""The driver of the tiled runtime: dynamic, locality-aware scheduling of tile tasks over workers
(BLASX, Wang et al. 2016, Sec. 4), in one process or on a Dask cluster.

The driver keeps every worker ``depth`` tasks deep. Whenever a worker has a free slot it gets, of
the tasks whose dependencies are done, the one whose operand tiles it already holds the most bytes
of (ties: plan order), so a tile of C goes where its A and B tiles are and no task is bound to a
worker in advance (no static round-robin as in cuBLAS-XT). Each finished task reports the tiles its
worker's L1 cache gained and lost; from that directory the driver tells a worker which peer holds a
tile it lacks (L2 peer fetch). Output tiles are returned to the driver or written by the workers
straight into a staged ``.npy`` file that becomes visible (renamed) only on :meth:`RunResult.commit`.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from paperline.kernels.blas.namespace import copy_parallel
from paperline.kernels.blas.plan import Problem, TileTask, check_plan_size, plan_tasks
from paperline.kernels.blas.sources import ArraySource, NpySource, TileSource
from paperline.kernels.blas.worker import RunContext, TileKey, execute, peer_tile, release_run
from paperline.kernels.errors import InputError, scheduler_workers

PEER_FETCH_TIMEOUT_S = 10.0  # a peer fetch taking longer falls back to the tile's source
WORKING_SET_TILES = 6  # two panels' tiles being multiplied, two prefetched, the accumulator, C0


class OutputSource:
    """The result as a source of tiles (TRSM reads output tiles computed earlier).

    Workers read finished tiles from the staged ``.npy`` file, or from the peer that made them.
    """

    kind = "output"

    def __init__(self, shape: tuple[int, int], dtype: np.dtype, run_id: str, path: str | None):
        self.shape, self.dtype, self.path = shape, np.dtype(dtype), path
        self.key = f"output:{run_id}"
        self._map: np.ndarray | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_map": None}

    def read(self, rows: slice, cols: slice) -> np.ndarray:
        """The result's ``rows`` x ``cols`` block from the staged ``.npy`` file (memory-mapped), a
        C-ordered copy of the result's dtype.

        Raises:
            RuntimeError: no file yet (``path`` None): the tile was never computed or shipped, a
                planning bug rather than bad input.
        """
        if self.path is None:
            raise RuntimeError("output tile requested before it was computed or shipped")
        if self._map is None:
            self._map = np.load(self.path, mmap_mode="r")
        return np.ascontiguousarray(self._map[rows, cols])


@dataclass
class RunResult:
    """What one run did.

    Attributes:
        problem: the problem.
        output: the result in memory (None when written to a file).
        staged_path: the file the workers wrote (invisible until :meth:`commit`).
        final_path: where :meth:`commit` moves it.
        seconds: wall time from the first dispatch to the last tile.
        records: one dict per task: ``index``, ``out``, ``worker``, ``start``, ``end`` (epoch s),
            ``wait_s`` (waiting for operand tiles the prefetch had not loaded yet) and
            ``multiply_s`` (in the panel products).
        counters: totals over workers: ``hits``, ``misses``, ``bytes_source``, ``bytes_s3``,
            ``bytes_host_to_device``, ``bytes_peer``, ``peer_misses``.
        workers: the workers used.
    """

    problem: Problem
    output: np.ndarray | None
    staged_path: str | None
    final_path: str | None
    seconds: float
    records: list[dict[str, Any]]
    counters: dict[str, int]
    workers: list[str]
    committed: bool = False

    @property
    def gflops(self) -> float:
        """Achieved GFLOP/s (the routine's reference flop count over :attr:`seconds`)."""
        return self.problem.flops / max(self.seconds, 1e-12) / 1e9

    @property
    def cache_hit_rate(self) -> float:
        """Tile cache hits over lookups (hits + misses), in [0, 1]; 0.0 when nothing was looked up."""
        total = self.counters.get("hits", 0) + self.counters.get("misses", 0)
        return self.counters.get("hits", 0) / total if total else 0.0

    def busy_fraction(self) -> dict[str, float]:
        """Per worker: the share of the run's wall time it spent in tile tasks."""
        busy: dict[str, float] = defaultdict(float)
        for r in self.records:
            busy[r["worker"]] += r["end"] - r["start"]
        return {w: busy[w] / max(self.seconds, 1e-12) for w in self.workers}

    def result_source(self) -> TileSource:
        """The result as a tile source (for verification), before or after commit."""
        if self.output is not None:
            return ArraySource(self.output, "result")
        return NpySource(self.final_path if self.committed else self.staged_path, "result")

    def commit(self) -> str | None:
        """Make the written file visible at :attr:`final_path` (an atomic rename)."""
        if self.staged_path is not None and not self.committed:
            os.replace(self.staged_path, self.final_path)
            self.committed = True
        return self.final_path

    def abort(self) -> None:
        """Delete the staged file (nothing was visible)."""
        if self.staged_path is not None and not self.committed:
            Path(self.staged_path).unlink(missing_ok=True)


class LocalityScheduler:
    """Dynamic scheduling with locality-aware placement (BLASX Sec. 4.2), as pure bookkeeping."""

    def __init__(self, tasks: list[TileTask], ctx: RunContext, window: int = 512):
        self.tasks, self.ctx, self.window = tasks, ctx, window
        self.waiting = {t.index: set(t.deps) for t in tasks if t.deps}
        self.dependents: dict[int, list[int]] = defaultdict(list)
        for t in tasks:
            for d in t.deps:
                self.dependents[d].append(t.index)
        self.ready: list[int] = [t.index for t in tasks if not t.deps]
        self.directory: dict[TileKey, set[str]] = defaultdict(set)
        self.done = 0
        self._keys = {t.index: [(ctx.key(r), ctx.tile_bytes(r)) for r in t.refs()] for t in tasks}

    def pick(self, worker: str) -> TileTask | None:
        """The ready task that ``worker`` holds the most operand bytes of (None: nothing ready)."""
        if not self.ready:
            return None
        best, best_score = 0, -1
        for pos, idx in enumerate(self.ready[: self.window]):
            score = sum(b for key, b in self._keys[idx] if worker in self.directory.get(key, ()))
            if score > best_score:
                best, best_score = pos, score
        return self.tasks[self.ready.pop(best)]

    def peers(self, task: TileTask, worker: str) -> dict[TileKey, str]:
        """For each tile of ``task`` that ``worker`` lacks, a worker the directory says holds it."""
        out = {}
        for key, _ in self._keys[task.index]:
            holders = self.directory.get(key)
            if holders and worker not in holders:
                out[key] = min(holders)
        return out

    def complete(self, result: dict[str, Any]) -> None:
        """Absorb a finished task's result (:func:`~paperline.kernels.blas.worker.execute`'s dict):
        update the tile directory with the tiles its worker ``added``/``evicted`` and make ready the
        tasks that waited only on it (TRSM's dependencies).
        """
        w = result["worker"]
        for key in result["added"]:
            self.directory[tuple(key)].add(w)
        for key in result["evicted"]:
            self.directory[tuple(key)].discard(w)
        self.done += 1
        for d in self.dependents.get(result["index"], ()):
            pending = self.waiting[d]
            pending.discard(result["index"])
            if not pending:
                del self.waiting[d]
                self.ready.append(d)
        self.ready.sort()


def _spill_in_memory(problem: Problem, directory: str) -> Problem:
    """Problem whose in-memory operands are written to ``.npy`` files (Dask workers cannot share memory)."""
    import dataclasses  # noqa: PLC0415

    changes = {}
    for name, src in problem.operands().items():
        if isinstance(src, ArraySource):
            path = os.path.join(directory, f"{name}.npy")
            np.save(path, src.array)
            changes[name] = NpySource(path, name, spilled=True)
    return dataclasses.replace(problem, **changes) if changes else problem


class LocalRuntime:
    """Run tile tasks one after another in this process (one worker, its own cache).

    On CUDA with the result gathered in memory, a task's output tile is copied back to the host
    while the next task's products run (:func:`~paperline.kernels.blas.worker.execute`'s sink):
    the driver keeps two tasks in flight and absorbs a task once its copy has landed.

    Args:
        device: ``"cpu"`` or ``"cuda"``.
        overlap: copy output tiles back while the next task runs (default: on CUDA only; on CPU
            there is nothing to overlap, and it is there for the tests of the pipeline's logic).
    """

    def __init__(self, device: str = "cpu", overlap: bool | None = None):
        self.device = device
        self.synchronous = not (device != "cpu" if overlap is None else overlap)
        self.depth = 1 if self.synchronous else 2
        self._inflight: deque[dict[str, Any]] = deque()
        self._output: np.ndarray | None = None
        self._tile = 0

    def workers(self) -> list[str]:
        """The one worker's name, ``["local"]``."""
        return ["local"]

    def start(self, ctx: RunContext) -> None:
        """Begin a run (forgets tasks left in flight by an earlier one)."""
        self._inflight.clear()

    def attach_output(self, output: np.ndarray | None, tile: int) -> None:
        """The driver's in-memory result (None when tiles go to a file): output tiles land in it."""
        self._output, self._tile = output, tile

    def _sink(self, out: tuple[int, int], host: np.ndarray) -> None:
        i, j, t = out[0], out[1], self._tile
        copy_parallel(self._output[i * t:i * t + host.shape[0], j * t:j * t + host.shape[1]], host)

    def submit(self, worker: str, ctx: RunContext, task: TileTask, peers: dict) -> Any:
        """Run ``task`` here: its result dict when synchronous, else None (queued for
        :meth:`wait_any`, its output tile's copy back to the host still in flight).

        Raises:
            InputError: the task met bad input (e.g. a NaN tile with ``check_finite``).
        """
        sink = None if self.synchronous or self._output is None else self._sink
        res = execute(ctx, task, peers, peer_fetch=None, worker=worker, sink=sink)
        if self.synchronous:
            return res
        self._inflight.append(res)
        return None

    def wait_any(self) -> dict[str, Any]:
        """The oldest queued task's result, once its output tile's copy has landed.

        Raises:
            RuntimeError: nothing in flight (the plan deadlocked: a planning bug, not bad input).
        """
        if not self._inflight:
            raise RuntimeError("tile plan deadlocked: no task ready")  # a planning bug, never bad input
        res = self._inflight.popleft()
        pending = res.pop("pending", None)
        if pending is not None:
            pending.result()
        return res

    def cancel(self) -> None:
        """Drop the queued tasks after their copies finish (their buffers are then released)."""
        while self._inflight:  # let queued copies finish before the buffers are released
            pending = self._inflight.popleft().get("pending")
            if pending is not None:
                try:
                    pending.result()
                except Exception:  # noqa: BLE001 - the run already failed
                    pass

    def finish(self, ctx: RunContext) -> None:
        """Release the run's worker state (its tile cache)."""
        release_run(ctx.run_id)


def _execute_on_dask_worker(ctx: RunContext, task: TileTask, peers: dict) -> dict[str, Any]:
    from distributed import get_worker  # noqa: PLC0415

    worker = get_worker()  # here: the prefetch thread is not a Dask worker thread

    def peer_fetch(run_id: str, address: str, key: TileKey) -> np.ndarray | None:
        return _dask_peer_fetch(worker, run_id, address, key)

    try:
        return execute(ctx, task, peers, peer_fetch=peer_fetch, worker=worker.address)
    except InputError as exc:  # bad input is an answer, not a worker failure: no error log on the worker
        return {"input_error": exc}


def _dask_peer_fetch(worker: Any, run_id: str, address: str, key: TileKey) -> np.ndarray | None:
    """Ask the worker at ``address`` for a tile over Dask's comms (None if it no longer holds it)."""
    from distributed.utils import sync  # noqa: PLC0415

    async def call() -> Any:
        return await worker.rpc(address).paperline_peer_tile(run_id=run_id, key=list(key))

    try:  # a dead peer's port refuses connections, which Dask's connect retries for 30 s
        reply = sync(worker.loop, call, callback_timeout=PEER_FETCH_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - the peer left, failed or is too slow: fall back to the source
        return None
    return None if reply is None else reply.get("tile")


def _install_peer_handler(dask_worker: Any) -> None:
    from distributed.protocol import to_serialize  # noqa: PLC0415

    def handler(run_id: str, key: list) -> dict[str, Any] | None:
        tile = peer_tile(run_id, (key[0], int(key[1]), int(key[2])))
        return None if tile is None else {"tile": to_serialize(tile)}

    dask_worker.handlers["paperline_peer_tile"] = handler


def _release_on_worker(run_id: str) -> None:
    release_run(run_id)


class DaskRuntime:
    """Run tile tasks on a Dask cluster: one task slot per worker thread, ``depth`` tasks queued per
    worker so that the next task's transfers overlap the current one's compute.

    Args:
        client: a ``distributed.Client``.
        workers: worker addresses to use (default: all).
        depth: tasks in flight per worker.
        device: ``"cpu"`` or ``"cuda"`` (each dask-cuda worker owns one GPU).

    Raises:
        RuntimeError: the cluster has no workers (at construction).
        ClusterLost: the client lost its scheduler.
    """

    synchronous = False

    def __init__(self, client: Any, workers: list[str] | None = None, depth: int = 2, device: str = "cpu"):
        self.client, self.depth, self.device = client, depth, device
        known = scheduler_workers(client)
        if not known:
            raise RuntimeError("the Dask cluster has no workers")
        self._workers = sorted(workers) if workers else known
        self._ac = None
        self._lock = threading.Lock()

    liveness_s = 2.0  # how often a waiting driver checks that the run's workers are still there

    def workers(self) -> list[str]:
        """The addresses of the workers the run uses."""
        return list(self._workers)

    def start(self, ctx: RunContext) -> None:
        """Begin a run: check the workers are alive and install the peer-fetch handler on them.

        Raises:
            RuntimeError: this runtime is already driving a run, or one of its workers left the
                cluster.
        """
        from distributed import as_completed  # noqa: PLC0415

        with self._lock:
            if self._ac is not None:
                raise RuntimeError("this DaskRuntime is driving another run: use one DaskRuntime per concurrent run")
            self._ac = as_completed(loop=self.client.loop)
        try:
            self._check_workers()
            self.client.run(_install_peer_handler, workers=self._workers)
        except BaseException:
            self._ac = None
            raise

    def submit(self, worker: str, ctx: RunContext, task: TileTask, peers: dict) -> Any:
        """Queue ``task`` on ``worker`` (only there); returns None, the result comes from
        :meth:`wait_any`."""
        fut = self.client.submit(_execute_on_dask_worker, ctx, task, peers, workers=[worker],
                                 allow_other_workers=False, pure=False, key=f"paperline-tile-{ctx.run_id}-{task.index}")
        self._ac.add(fut)
        return None

    def wait_any(self) -> dict[str, Any]:
        """The next finished task's result.

        Raises:
            InputError: the task met bad input.
            RuntimeError: one of the run's workers left the cluster (crashed, restarted or was
                retired): its tasks are bound to it and would wait forever.
        """
        check_at = time.monotonic() + self.liveness_s
        while not self._ac.has_ready():
            with self._ac.thread_condition:  # notified as soon as a future completes
                self._ac.thread_condition.wait(timeout=0.1)
            if not self._ac.has_ready() and time.monotonic() >= check_at:
                self._check_workers()
                check_at = time.monotonic() + self.liveness_s
        future = next(self._ac)
        while True:  # a finished task's result lives on its worker: if that worker died, it is lost
            try:
                result = future.result(timeout=self.liveness_s)
                break
            except TimeoutError:
                self._check_workers()
        if "input_error" in result:
            raise result["input_error"]
        return result

    def _alive(self) -> set[str]:
        return set(scheduler_workers(self.client))

    def _check_workers(self) -> None:
        lost = sorted(set(self._workers) - self._alive())
        if lost:
            raise RuntimeError(f"worker(s) {', '.join(lost)} left the Dask cluster during the run (crashed or "
                               "restarted); tile tasks are bound to their worker, so the run is abandoned")

    def cancel(self) -> None:
        """Cancel the run's queued and running tasks."""
        if self._ac is not None:
            futures = list(self._ac.futures)
            self._ac.clear()
            self.client.cancel(futures)

    def finish(self, ctx: RunContext) -> None:
        """End the run: release its state (tile caches) on the workers still alive."""
        self._ac = None
        alive = self._alive()
        present = [w for w in self._workers if w in alive]  # a call to a lost worker never returns
        if present:
            self.client.run(_release_on_worker, ctx.run_id, workers=present)


def check_memory_budget(problem: Problem, memory_budget: int) -> None:
    """Refuse a per-worker budget smaller than one tile task's working set.

    Raises:
        InputError: naming ``memory_budget``, the tile and the bytes needed.
    """
    t = min(problem.tile, max(max(s.shape) for s in problem.operands().values()))  # no tile exceeds the matrices
    tile_bytes = t * t * problem.dtype.itemsize
    if memory_budget < WORKING_SET_TILES * tile_bytes:
        raise InputError("memory_budget", memory_budget,
                         f"below the working set of one tile task ({WORKING_SET_TILES} tiles of {t}x{t} "
                         f"{problem.dtype} = {WORKING_SET_TILES * tile_bytes} bytes); lower the tile size or raise the budget")


def check_result_fits(problem: Problem) -> None:
    """Refuse an in-memory result larger than this machine's available memory (it failed with
    NumPy's MemoryError after the planning; ``output=`` writes a file tile by tile instead).

    Raises:
        InputError: naming the shape, its size and the memory available.
    """
    import psutil  # noqa: PLC0415

    (m, n) = problem.out_shape
    nbytes = m * n * problem.dtype.itemsize
    available = psutil.virtual_memory().available
    if nbytes > available:
        raise InputError("output", None, f"the {m}x{n} {problem.dtype} result, {nbytes / 2**30:,.1f} GiB, held in "
                                         f"memory exceeds the {available / 2**30:,.1f} GiB available; name a .npy "
                                         "file to write it to tile by tile, or lower the sizes")


def missing_output_directory(path: Path) -> str | None:
    """Why ``path``'s directory cannot take the file, or None when it is a directory: the output's
    error. A regular file where a directory of the path should be is named as such (``afile/x.npy``
    said "its directory does not exist", and ``afile`` was right there: a trial)."""
    parent = path.parent
    if parent.is_dir():
        return None
    existing = parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        return f"{existing} is a file, not a directory"
    return "its directory does not exist"


def run(problem: Problem, runtime: LocalRuntime | DaskRuntime | None = None, *, output: str | None = None,
        memory_budget: int = 1 << 30, check_finite: bool = True, peer_fetch: frozenset[str] | None = None,
        prefetch: bool = True, spill_dir: str | None = None) -> RunResult:
    """Execute ``problem``'s tile plan on ``runtime``.

    Args:
        problem: from :func:`~paperline.kernels.blas.plan.make_problem`.
        runtime: :class:`LocalRuntime` (default) or :class:`DaskRuntime`.
        output: a ``.npy`` path the result is written to tile by tile (staged; call
            :meth:`RunResult.commit`). None: the result is assembled in memory.
        memory_budget: bytes of tiles each worker may cache (the L1 size). Operands larger than
            this are streamed (out of core).
        check_finite: refuse NaN/inf in the operand tiles read.
        peer_fetch: source kinds whose missing tiles are fetched from peers (default: S3,
            generated and output tiles on CPU, every kind on GPU).
        prefetch: load panel ``p+1`` on a second thread while panel ``p`` is multiplied (on a
            CPU-only machine a ``.npy`` tile is a view of the page cache, with nothing to copy;
            it pays on GPUs, with S3 and with generated operands).
        spill_dir: where in-memory operands are written for a Dask runtime (default: a temp dir).

    Returns:
        A :class:`RunResult`.

    Raises:
        InputError: a plan too fine to schedule (:func:`~paperline.kernels.blas.plan.check_plan_size`);
            an in-memory result larger than the memory available; a memory budget below the
            working set of one task; an ``output`` that is a
            directory, in a missing directory, or an operand's own file; bad operand values
            found while computing (non-finite, zero TRSM diagonal). Nothing is left at ``output``.
    """
    runtime = runtime or LocalRuntime()
    check_plan_size(problem)
    check_memory_budget(problem, memory_budget)
    if output is None:
        check_result_fits(problem)
    t = problem.tile
    run_id = uuid.uuid4().hex[:12]
    tmp = None
    staged = final = None
    spill = isinstance(runtime, DaskRuntime) and any(isinstance(s, ArraySource) for s in problem.operands().values())
    if output is not None:
        final = str(Path(output).resolve())
        if Path(final).is_dir():
            raise InputError("output", output, "is a directory; name a .npy file")
        missing = missing_output_directory(Path(final))
        if missing:
            raise InputError("output", output, missing)
        for name, source in problem.operands().items():
            if isinstance(source, NpySource) and Path(source.path).exists() and Path(final).exists() \
                    and os.path.samefile(source.path, final):
                raise InputError("output", output, f"is operand {name}: writing it would destroy the input")
        sweep_leftovers(Path(final).parent, f".{Path(final).name}.partial-")
        staged = str(Path(final).with_name(f".{Path(final).name}.partial-{owner_tag()}-{run_id}.npy"))
    if spill or (output is None and problem.routine == "trsm"):
        # TRSM reads finished output tiles back: an in-memory result is staged in a scratch file.
        sweep_leftovers(Path(spill_dir or tempfile.gettempdir()), "paperline-blas-")
        tmp = tempfile.mkdtemp(prefix=f"paperline-blas-{owner_tag()}-", dir=spill_dir)
        if staged is None and problem.routine == "trsm":
            staged = os.path.join(tmp, "x.npy")
    try:
        if staged is not None:
            stage_npy(staged, problem.dtype, problem.out_shape)
        if spill:
            problem = _spill_in_memory(problem, tmp)
        sources: dict[str, TileSource] = dict(problem.operands())
        sources["x"] = OutputSource(problem.out_shape, problem.dtype, run_id, staged)
        device = getattr(runtime, "device", "cpu")
        if peer_fetch is None:
            peer_fetch = frozenset({"s3", "generated", "output", "file", "memory"}) if device != "cpu" \
                else frozenset({"s3", "generated", "output"})
        ctx = RunContext(run_id, sources, t, device, int(memory_budget), check_finite, frozenset(peer_fetch), staged,
                         prefetch)
        result = _drive(problem, ctx, runtime)
        if output is None and staged is not None:  # the scratch file of an in-memory TRSM
            result.output, staged = np.array(np.load(staged)), None
    except BaseException:
        if staged is not None and output is not None:
            Path(staged).unlink(missing_ok=True)
        raise
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    result.staged_path, result.final_path = staged, final
    return result


def _fallocate(fd: int, nbytes: int) -> bool:
    """Reserve ``nbytes`` of disk for ``fd`` with Linux ``fallocate(2)`` (mode 0). False where the
    call or the filesystem does not support it (glibc's ``posix_fallocate`` would emulate it by
    writing a byte per block, too slow for a huge output on a network filesystem).

    Raises:
        OSError: ``ENOSPC`` (the disk is too small) or another error than "not supported".
    """
    import ctypes  # noqa: PLC0415
    import errno  # noqa: PLC0415

    try:
        fallocate = ctypes.CDLL(None, use_errno=True).fallocate
    except (AttributeError, OSError):  # not Linux / glibc
        return False
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if fallocate(fd, 0, 0, nbytes) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(err, os.strerror(err))


def owner_tag() -> str:
    """``<pid>@<host>`` of this process, put in the names of the partial outputs and scratch
    directories it creates, so that :func:`sweep_leftovers` knows one left by a dead process."""
    import socket  # noqa: PLC0415

    return f"{os.getpid()}@{socket.gethostname()}"


_OWNED = re.compile(r"(\d+)@(.+)-[^-]*$")


def sweep_leftovers(directory: Path, prefix: str, before_delete: Callable[[Path], bool] | None = None) -> list[str]:
    """Delete the entries of ``directory`` named ``prefix`` + :func:`owner_tag` + ``-...`` whose
    owner, a process of this host, is gone: what a run killed outright (``kill -9``, a lost
    machine) left, which its cleanup never got to (a trial: a 302 MB hidden partial output beside
    the output, 129 MB of scratch, still there after later runs). An entry of a live process, of
    another host, or without the tag is kept; a PID reused since keeps its entry too.

    Args:
        before_delete: Called with each dead owner's entry before it is deleted (e.g. to abort
            the S3 upload it records); False keeps the entry for a later sweep.

    Returns:
        The paths deleted.
    """
    import socket  # noqa: PLC0415

    host, deleted = socket.gethostname(), []
    try:
        entries = [e for e in directory.iterdir() if e.name.startswith(prefix)]
    except OSError:
        return deleted
    for entry in entries:
        found = _OWNED.match(entry.name[len(prefix):])
        if found is None or found.group(2) != host or _alive(int(found.group(1))):
            continue
        if before_delete is not None and not before_delete(entry):
            continue
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            deleted.append(str(entry))
        except OSError:
            continue  # another sweeper got it, or not ours to delete
    return deleted


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def stage_npy(path: str, dtype: np.dtype, shape: tuple[int, int]) -> None:
    """Create the ``.npy`` file the workers write a run's output tiles into, with its disk reserved.

    Reserving the blocks up front (``fallocate``) refuses an output that cannot fit before any
    tile is computed, instead of failing a write hours into a run, and makes the tiles' writes
    cheaper (ext4, 2048-tiles of an 8192 x 8192 result: 11.0 ms per float32 tile against 13.4 ms
    into a sparse file; 15.6 against 20.4 ms in float64).

    Raises:
        OSError: naming ``path`` and the bytes needed when the filesystem has not that much room
            (the file is removed).
    """
    import errno  # noqa: PLC0415

    np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape).flush()
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDWR)
    try:
        disk = os.fstatvfs(fd)
        if size > disk.f_bavail * disk.f_frsize:  # before fallocate: a failing one can leave the disk full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # until the file goes (it failed a test beside it)
        _fallocate(fd, size)
    except OSError as exc:
        Path(path).unlink(missing_ok=True)
        raise OSError(exc.errno, f"output {path}: cannot reserve {size} bytes for the result "
                                 f"({shape[0]} x {shape[1]} {np.dtype(dtype)}): {exc.strerror}") from None
    finally:
        os.close(fd)


def _drive(problem: Problem, ctx: RunContext, runtime: Any) -> RunResult:
    tasks = plan_tasks(problem)
    sched = LocalityScheduler(tasks, ctx)
    workers = runtime.workers()
    inflight = dict.fromkeys(workers, 0)
    output = None if ctx.output_path is not None else np.empty(problem.out_shape, problem.dtype)
    records: list[dict[str, Any]] = []
    counters: dict[str, int] = defaultdict(int)
    t = ctx.tile

    def absorb(res: dict[str, Any]) -> None:
        sched.complete(res)
        inflight[res["worker"]] -= 1
        i, j = res["out"]
        if res["tile"] is not None:
            block = output[i * t:i * t + res["tile"].shape[0], j * t:j * t + res["tile"].shape[1]]
            if ctx.device == "cpu":  # the cores are the workers'
                block[...] = res["tile"]
            else:  # the host's cores are idle while the GPUs multiply
                copy_parallel(block, res["tile"])
        records.append({k: res[k] for k in ("index", "out", "worker", "start", "end", "wait_s", "multiply_s")})
        for k, v in res["counters"].items():
            counters[k] += v

    runtime.start(ctx)
    if hasattr(runtime, "attach_output"):
        runtime.attach_output(output, t)
    start = time.perf_counter()  # a duration: the wall clock may be stepped meanwhile
    try:
        while sched.done < len(tasks):
            progressed = False
            for w in workers:
                while inflight[w] < runtime.depth:
                    task = sched.pick(w)
                    if task is None:
                        break
                    inflight[w] += 1
                    progressed = True
                    res = runtime.submit(w, ctx, task, sched.peers(task, w))
                    if runtime.synchronous:
                        absorb(res)
            if not runtime.synchronous and sched.done < len(tasks):
                absorb(runtime.wait_any())
            elif runtime.synchronous and not progressed:
                raise RuntimeError("tile plan deadlocked: no task ready")  # a planning bug, never bad input
    except BaseException:
        runtime.cancel()
        raise
    finally:
        seconds = time.perf_counter() - start
        try:
            runtime.finish(ctx)
        except Exception:  # noqa: BLE001 - releasing caches is best effort
            pass
    return RunResult(problem, output, ctx.output_path, None, seconds, records, dict(counters), workers)


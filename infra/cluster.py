"""The Dask cluster a flow runs its tasks on.

One function, :func:`task_runner`, picks it: an existing scheduler when an address is configured (that
is how paperline outgrows one machine: dask-jobqueue, dask-kubernetes, any Dask scheduler), else
``dask_cuda.LocalCUDACluster`` (one worker per GPU) when a GPU is usable, else a ``LocalCluster`` of
single-threaded worker processes, one per core. Local clusters bind loopback only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import signal
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from paperline.infra.device import resolve_device
from paperline.infra.errors import PaperlineError, ServiceError, redact_url
from paperline.infra.settings import Settings
from paperline.infra.worker_exit import STOP_SIGNALS

if TYPE_CHECKING:
    from prefect_dask import DaskTaskRunner


# Dask's nanny sets MALLOC_TRIM_THRESHOLD_=65536 in its workers so that freed memory goes back to
# the OS at once. Setting any glibc malloc threshold freezes glibc's *dynamic* mmap threshold, and
# for numerics that allocate large short-lived arrays that is costly:
# - P²T²F local update (half of kinetic, 4096-entry batches): 0.30-1.08 s per pass in a worker
#   against 0.17 s in a plain process (every temporary over 128 KiB became an mmap/munmap pair);
# - tiled GEMM, 2048 x 2048 float64 tiles: 24 GFLOP/s per worker against 49 in a plain process,
#   even with the thresholds raised to 32/64 MiB (a 32 MiB tile sits right at such a threshold).
# So local workers get no malloc variable at all: glibc's defaults, as in a plain process (freed
# memory is returned to the OS less eagerly). glibc reads them at process start, so this is the
# nanny's *pre-spawn* environment (a Nanny's ``env=`` is applied too late).
DROPPED_WORKER_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def configure_local_workers() -> None:
    """Remove :data:`DROPPED_WORKER_ENV` from ``distributed.nanny.pre-spawn-environ`` for the local
    clusters this process starts (idempotent)."""
    import dask  # noqa: PLC0415
    import distributed  # noqa: F401, PLC0415 - loads its defaults first: imported later, it would merge them back

    current = dict(dask.config.get("distributed.nanny.pre-spawn-environ", default={}) or {})
    kept = {k: v for k, v in current.items() if k not in DROPPED_WORKER_ENV}
    dask.config.set({"distributed.nanny.pre-spawn-environ": kept})


# Imported by every local worker as it starts (Dask's worker ``preload``), while the flow process
# is still setting up its run, instead of on the worker's first task: Prefect's task engine and
# paperline's task package (which installs the task log filter); and the hooks that let a worker
# closed on request skip the interpreter's teardown (infra/worker_exit.py). The first, imported
# first and set up first, keeps the cyclic collector off through the others' imports and then
# freezes what they loaded (infra/worker_heap.py). The last watches the stack's servers, so that
# tasks fail at once on a dead one (infra/worker_watch.py).
WORKER_PRELOAD = ["paperline.infra.worker_heap", "prefect.task_engine", "paperline.tasks",
                  "paperline.infra.worker_exit", "paperline.infra.worker_watch"]


DASK_LOGGERS = ("distributed", "distributed.scheduler", "distributed.core", "distributed.nanny",
                "distributed.worker", "distributed.http.proxy")


def quiet_dask_logs() -> None:
    """Dask's loggers at WARNING, here and (through the environment, unless set) in the worker
    processes started later: a local cluster's start and close are 90 lines of INFO otherwise
    (nanny, preload, scheduler), for a 512-cube GEMM called from Python (a trial)."""
    import logging  # noqa: PLC0415

    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")  # inherited by worker processes
    for name in DASK_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)




@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Block :data:`STOP_SIGNALS` in the calling thread while a local cluster starts.

    A terminal sends them to every process of its process group, worker processes included: a
    Ctrl-C in the seconds a worker was still importing or registering printed two tracebacks per
    worker (``CancelledError``, then ``AssertionError: Queue ... not closed``; two user trials).
    The thread that starts the cluster, and the event-loop thread it creates, spawn the worker
    processes; a blocked signal mask is inherited through fork and exec, so a worker receives
    neither signal until its preload (``infra/worker_exit.py``) has installed its handlers and
    unblocked them. In this process they stay pending while blocked and arrive when the calling
    thread unblocks them: a Ctrl-C is delayed by the cluster's start, never lost.
    """
    if not hasattr(signal, "pthread_sigmask"):  # pragma: no cover - not POSIX
        yield
        return
    wanted = {getattr(signal, name) for name in STOP_SIGNALS if hasattr(signal, name)}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, wanted)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def start_local_cluster(cluster_class: str, **kwargs: Any) -> Any:
    """Start ``cluster_class`` (a dotted path: ``distributed.LocalCluster`` or
    ``dask_cuda.LocalCUDACluster``) with ``kwargs``, leaving this process's environment as it was.

    Dask's nanny writes ``distributed.nanny.pre-spawn-environ`` (``OMP_NUM_THREADS=1``,
    ``MKL_NUM_THREADS=1``, ``OPENBLAS_NUM_THREADS=1``) into the *starting* process's
    ``os.environ`` before it spawns a worker, and leaves it there. In a flow process every native
    library loaded afterwards then ran on one thread: SciPy's OpenBLAS (the GEMM flow's peer for
    SYMM..TRSM ran on 1 of 2 cores, inflating paperline's ratio to it ~1.9x for SYRK), torch's OpenMP, and
    any subprocess. The workers keep their single-threaded settings (they were spawned with
    them); a worker the nanny restarts later sets them again.

    Unless ``kwargs`` name a ``security``, the cluster speaks TLS with certificates made for it
    alone (``distributed.security.Security.temporary()``, held in memory; clients made from the
    cluster object get them): a plain ``tcp://`` scheduler on 127.0.0.1 took clients from every
    local user, who could run code as this one through it (``Client.run``) and read the stack's
    logins from the workers' environment (a trial). Made here, not passed in ``kwargs``, so that
    the key is in no pickled task runner.
    """
    import importlib  # noqa: PLC0415

    import dask  # noqa: PLC0415
    from distributed.security import Security  # noqa: PLC0415

    kwargs.setdefault("security", Security.temporary())

    keys = set(dask.config.get("distributed.nanny.pre-spawn-environ", default={}) or {})
    before = {k: os.environ.get(k) for k in keys}
    module, _, name = cluster_class.rpartition(".")
    try:
        with stop_signals_blocked():
            return getattr(importlib.import_module(module), name)(**kwargs)
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _local_cpu_kwargs(settings: Settings) -> dict[str, Any]:
    return {
        "preload": list(WORKER_PRELOAD),
        "n_workers": settings.n_workers or os.cpu_count() or 1,
        "threads_per_worker": 1,
        "processes": True,
        "host": "127.0.0.1",
        "dashboard_address": "127.0.0.1:0",
    }


def _local_cuda_kwargs(settings: Settings) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "preload": list(WORKER_PRELOAD),
        "threads_per_worker": 1,
        "host": "127.0.0.1",
        "dashboard_address": "127.0.0.1:0",
    }
    if settings.n_workers:
        kwargs["n_workers"] = settings.n_workers
    return kwargs


def _local_cluster_spec(settings: Settings) -> tuple[str, dict[str, Any]]:
    """The local cluster :func:`task_runner` starts: its class's dotted path and keyword arguments.

    Raises:
        InputError: ``device`` is ``"cuda"`` but no CUDA device is usable.
    """
    if resolve_device(settings.device) == "cuda":
        return "dask_cuda.LocalCUDACluster", _local_cuda_kwargs(settings)
    return "distributed.LocalCluster", _local_cpu_kwargs(settings)


def task_runner(settings: Settings, *, configure: bool = True, started: BackgroundCluster | None = None,
                ) -> DaskTaskRunner:
    """The Prefect task runner for a flow run, built from the settings.

    Args:
        settings: Uses ``dask_scheduler_address``, ``device`` and ``n_workers``.
        configure: apply :func:`configure_local_workers` now (the flows also do it when they
            start, before their cluster exists, so importing a flow changes no Dask config).
        started: the local cluster already starting for this run: the runner takes it over as
            if it had started it (its client waits for all its workers, and it closes it).

    Returns:
        A ``prefect_dask.DaskTaskRunner``; the cluster itself starts when the flow run starts.

    Raises:
        InputError: ``device`` is ``"cuda"`` but no CUDA device is usable.
    """
    from prefect_dask import DaskTaskRunner  # noqa: PLC0415 - keep imports of this module light

    if started is not None:  # by token: the runner is pickled with the flow into every task's context
        return DaskTaskRunner(cluster_class=background_cluster, cluster_kwargs={"token": started.token})
    if settings.dask_scheduler_address:
        return DaskTaskRunner(address=settings.dask_scheduler_address)
    if configure:
        configure_local_workers()
    cluster_class, kwargs = _local_cluster_spec(settings)
    return DaskTaskRunner(cluster_class=start_local_cluster, cluster_kwargs={"cluster_class": cluster_class, **kwargs})


_BACKGROUND: dict[str, BackgroundCluster] = {}  # token -> the clusters this process is starting


def background_cluster(token: str) -> Any:
    """The cluster of this process's :class:`BackgroundCluster` with ``token`` (waits until it is
    up): the ``cluster_class`` of a runner from ``task_runner(settings, started=...)``.

    Raises:
        RuntimeError: no such cluster in this process (closed, or another process).
    """
    started = _BACKGROUND.get(token)
    if started is None:
        raise RuntimeError(f"no background Dask cluster {token} in this process (closed?)")
    return started.cluster()


class BackgroundCluster:
    """The local cluster :func:`task_runner` would start, started now on a background thread, so
    that its worker processes spawn and import (Dask, Prefect's task engine) while the caller does
    something else: ``paperline run`` imports the pipeline, checks the stack and creates the flow
    run meanwhile, which takes the cluster's start (1.3 s on 2 cores) off a run's critical path.

    Hand it to the flow's runner with ``task_runner(settings, started=...)``, which closes it with
    the flow run; the caller still closes it (:meth:`close`, idempotent, or ``with``) in case the
    run never starts. Start it only after the environment its workers inherit is final (the
    stack's ``PREFECT_API_URL`` and so on, :func:`paperline.infra.stack.activate`).

    Raises:
        InputError: from the constructor, ``device`` is ``"cuda"`` but no CUDA device is usable.
        Exception: from :meth:`cluster`, whatever starting the cluster raised.
    """

    def __init__(self, settings: Settings) -> None:
        configure_local_workers()
        self._spec = _local_cluster_spec(settings)
        self._cluster: Any = None
        self._error: BaseException | None = None
        self._closed = False
        self.token = uuid.uuid4().hex
        _BACKGROUND[self.token] = self
        self._thread = threading.Thread(target=self._start, name="paperline-cluster-start", daemon=True)
        self._thread.start()

    def _start(self) -> None:
        cluster_class, kwargs = self._spec
        try:
            self._cluster = start_local_cluster(cluster_class, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread by cluster()
            self._error = exc

    def cluster(self, **_: Any) -> Any:
        """The cluster, once it is up (waits for it); a ``cluster_class`` for ``DaskTaskRunner``.

        Raises:
            RuntimeError: the cluster was closed. Exception: whatever starting it raised.
        """
        self._thread.join()
        if self._error is not None:
            raise self._error
        if self._closed:
            raise RuntimeError("the background Dask cluster was closed")
        return self._cluster

    def close(self) -> None:
        """Stop the cluster's workers and scheduler (waits for a start in progress; idempotent)."""
        self._thread.join()
        if self._cluster is not None and not self._closed:
            self._cluster.close()
        self._closed = True
        _BACKGROUND.pop(self.token, None)

    def __enter__(self) -> BackgroundCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def default_task_runner() -> DaskTaskRunner | None:
    """The task runner a flow is declared with, for runs that do not come through ``paperline run``
    (served or deployed runs load the flow from its module): :func:`task_runner` of the settings in
    the environment, or None (Prefect's default) when they cannot be resolved at import."""
    from paperline.infra.settings import get_settings  # noqa: PLC0415

    try:
        return task_runner(get_settings(), configure=False)
    except Exception:  # noqa: BLE001 - never break importing a flow module; runs then use threads
        return None


def planned_worker_count(settings: Settings) -> int | None:
    """How many workers the cluster :func:`task_runner` starts will have, known before it starts:
    the local CPU cluster's (``n_workers`` or one per core) or a CUDA cluster's configured
    ``n_workers``; None for an existing scheduler or one worker per GPU (known once connected)."""
    if settings.dask_scheduler_address:
        return None
    if resolve_device(settings.device) == "cuda":
        return settings.n_workers
    return settings.n_workers or os.cpu_count() or 1


def planned_worker_memory(settings: Settings) -> int | None:
    """Bytes of host memory each worker of the local CPU cluster :func:`task_runner` starts may use:
    Dask's default ``memory_limit="auto"``, the machine's memory (``distributed.system.MEMORY_LIMIT``:
    RAM, or a lower cgroup or rlimit) over its workers. None for a CUDA cluster (tiles live in GPU
    memory) or an existing scheduler (known once connected)."""
    n = planned_worker_count(settings)
    if n is None or resolve_device(settings.device) == "cuda":
        return None
    from distributed.system import MEMORY_LIMIT  # noqa: PLC0415 - keep imports of this module light

    return MEMORY_LIMIT // n


def default_port_note(address: str) -> str:
    """``" (port 8786, Dask's default: the address names none)"`` for a ``tcp://``/``tls://``
    scheduler address without a port, else ``""``: Dask connects to 8786 then, which went unsaid
    (an infra trial)."""
    from urllib.parse import urlsplit  # noqa: PLC0415

    try:
        parts = urlsplit(address if "://" in address else f"tcp://{address}")
        port = parts.port
    except ValueError:
        return ""
    return " (port 8786, Dask's default: the address names none)" if parts.scheme in ("tcp", "tls") and port is None else ""


def describe_cluster(settings: Settings) -> str:
    """One line saying which cluster :func:`task_runner` will use (for the CLI).

    Raises:
        InputError: ``device`` is ``"cuda"`` but no CUDA device is usable.
    """
    if settings.dask_scheduler_address:
        return f"existing Dask scheduler at {settings.dask_scheduler_address}{default_port_note(settings.dask_scheduler_address)}"
    if resolve_device(settings.device) == "cuda":
        n = f"{settings.n_workers} workers" if settings.n_workers else "one worker per GPU"
        return f"local CUDA cluster (dask_cuda.LocalCUDACluster, {n}, 127.0.0.1)"
    n = settings.n_workers or os.cpu_count() or 1
    return f"local CPU cluster ({n} single-threaded worker process{'es' if n != 1 else ''}, 127.0.0.1)"


def require_scheduler(settings: Settings, timeout_s: float = 5.0, notes: list[str] | None = None) -> int | None:
    """Connect to the configured Dask scheduler (``dask_scheduler_address``) as the run's client
    will (Dask's own comms, with the TLS settings of Dask's config) and count its workers; a no-op
    for a local cluster.

    Without it a dead address failed inside the run after Dask's two 30 s connect timeouts
    (65 s, with a flow run and an MLflow run already made); a ``tls://`` address to a plain
    scheduler, or an ``http://`` one, passed a bare socket check and failed in the run with Dask's
    ``TypeError``/``ValueError`` naming no setting (a trial).

    Args:
        notes: when given, what is amiss in the workers' set-up is appended to it, one line each
            (:func:`worker_setup_notes`: BLAS threads oversubscribing a host's CPUs, Dask's
            ``MALLOC_TRIM_THRESHOLD_``), for the caller to print; the run is not refused for them.

    Returns:
        The scheduler's worker count now (0: tasks wait until a worker joins), or None for a
        local cluster.

    Raises:
        ServiceError: naming the scheduler's address, what the connection said, and the setting;
            or (:class:`WorkersError`) naming the workers that cannot import paperline.
    """
    import asyncio  # noqa: PLC0415
    import socket  # noqa: PLC0415
    from urllib.parse import urlsplit  # noqa: PLC0415

    address = settings.dask_scheduler_address
    if not address:
        return None

    missing: list[str] = []

    async def workers(client: Any) -> int:
        threads = await client.scheduler.ncores()  # {worker address: threads}, asked now
        if not threads:
            return 0
        # one call per worker: one that cannot load paperline fails it (each run's first task failed:
        # a trial), one that does not answer (stopped, stuck) is named, not taken for a dead scheduler
        seen = await _run_on_each(client, _worker_setup, timeout_s=timeout_s)
        shown = await _worker_names(client)
        missing.extend(shown.get(w, w) for w, v in sorted(seen.items()) if _cannot_import(v))
        if notes is not None and not missing:
            setups = {w: {**v, "nthreads": threads.get(w, 1), "name": shown.get(w, w)} for w, v in seen.items()
                      if isinstance(v, dict)}
            notes.extend(worker_setup_notes(setups))
            # another checkout: its code digest differs, or (older) it lacks the check's own function
            other = [f"{shown.get(w, w)}: {v.get('package')}" if isinstance(v, dict) else
                     f"{shown.get(w, w)}: {type(v).__name__}: {str(v)[:100]}" for w, v in sorted(seen.items())
                     if (isinstance(v, dict) and v.get("code") != code_digest()) or isinstance(v, BaseException)]
            if other:
                notes.append(f"{len(other)} of the {len(threads)} Dask worker(s) run other paperline code than this "
                             f"process ({_listed(other)}; here: {os.path.dirname(os.path.dirname(__file__))}): "
                             "install the same paperline there, or results may differ from this checkout's")
            silent = [shown.get(w, w) for w, v in sorted(seen.items()) if v is NO_ANSWER]
            if silent:
                notes.append(f"{len(silent)} of the {len(threads)} Dask worker(s) did not answer within "
                             f"{timeout_s:g} s ({_listed(silent)}): stopped, stuck or busy; tasks sent to them wait "
                             "until they answer")
        return len(threads)

    parts = urlsplit(address if "://" in address else f"tcp://{address}")
    if parts.scheme in ("tcp", "tls"):  # a refused port at once (Dask's connect retries it until its timeout)
        try:
            with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 8786), timeout=timeout_s):
                pass
        except (OSError, ValueError) as exc:
            raise ServiceError("dask scheduler", f"cannot connect{default_port_note(address)} ({exc}); check "
                                                 "PAPERLINE_DASK_SCHEDULER_ADDRESS "
                                                 "(start the scheduler, or unset it for a local cluster)",
                               url=address) from None
    try:
        count = asyncio.run(asyncio.wait_for(_with_client(address, timeout_s, workers), 2 * timeout_s + 5))
    except Exception as exc:  # noqa: BLE001 - OSError, TimeoutError, TLS TypeError, unknown scheme ValueError, ...
        why = str(exc).splitlines()[0] if str(exc) and str(exc) != type(exc).__name__ else (
            f"no answer within {timeout_s:g} s" if isinstance(exc, TimeoutError) else type(exc).__name__)
        # the port took the connection but did not answer as a scheduler: the dashboard's port gave
        # "TimeoutError: TimeoutError", an HTTP proxy "MemoryError: Unable to allocate 3.07 EiB" (a trial)
        other = ("; something accepts connections there but did not answer as a Dask scheduler (the dashboard's "
                 "port, or another server?)" if isinstance(exc, (TimeoutError, MemoryError)) else "")
        if isinstance(exc, TypeError) and "ssl_context" in str(exc):  # Dask's words for tls:// without them (a trial)
            other = ("; a tls:// address needs Dask's TLS settings for its client, and none are set: "
                     "distributed.comm.tls.ca-file, .client.cert and .client.key (DASK_DISTRIBUTED__COMM__TLS__CA_FILE, "
                     "..._CLIENT__CERT, ..._CLIENT__KEY)")
        raise ServiceError("dask scheduler", f"cannot connect ({type(exc).__name__}: {why}){other}; check "
                                             "PAPERLINE_DASK_SCHEDULER_ADDRESS (tcp://host:port, or tls:// with Dask's "
                                             "TLS settings)", url=address) from None
    if missing:  # a run failed with "ModuleNotFoundError" or "Error during deserialization of the task graph"
        shown = _listed(missing)
        # (the scheduler is fine: "dask scheduler is not available" sent users to it, an infra trial)
        raise WorkersError(f"{len(missing)} of the {count} Dask worker(s) of the scheduler at {redact_url(address)} "
                           f"cannot import paperline ({shown}): install paperline in the workers' environment (the "
                           "same constraints.txt), or start them from this one")
    return count


class WorkersError(ServiceError):
    """A configured scheduler's workers cannot run paperline's tasks (the scheduler itself is up):
    the message is said as given, not as "dask scheduler is not available"."""

    def __init__(self, message: str):
        self.service = "dask workers"
        PaperlineError.__init__(self, message)


async def _worker_names(client: Any) -> dict[str, str]:
    """Each worker of ``client``'s scheduler as said in messages: ``name at address``, or its
    address when it has no name of its own."""
    info = await client.scheduler.identity(n_workers=-1)  # (the client's own copy lists up to 5)
    names = {w: str(d.get("name", w)) for w, d in info.get("workers", {}).items()}
    return {w: w if name == w else f"{name} at {w}" for w, name in names.items()}


def _listed(names: list[str], most: int = 3) -> str:
    """Up to ``most`` of ``names``, "; "-separated, and how many more."""
    return "; ".join(names[:most]) + (f"; and {len(names) - most} more" if len(names) > most else "")


NO_ANSWER = object()  # what :func:`_run_on_each` gives for a worker that did not answer in time


def _cannot_import(answer: Any) -> bool:
    """Whether a worker's answer to a check is its failure to import paperline at all (an
    ``AttributeError`` or other ``ImportError`` is an older paperline, without the check's function:
    said as other code, not as no paperline; a review)."""
    return isinstance(answer, ModuleNotFoundError) and "paperline" in str(answer) or (
        isinstance(answer, BaseException) and not isinstance(answer, (AttributeError, ImportError)))


async def _run_on_each(client: Any, fn: Callable[..., Any], *args: Any, timeout_s: float) -> dict[str, Any]:
    """``Client.run(fn, *args)`` on every worker, each on its own and within ``timeout_s``: by
    worker address, its result, the exception it raised or met loading ``fn`` (``on_error=
    "return"``), or :data:`NO_ANSWER`. One stopped worker timed all of a run's check out, which
    then said the scheduler was no scheduler (an infra trial)."""
    import asyncio  # noqa: PLC0415

    addresses = list(await client.scheduler.ncores())

    async def one(worker: str) -> Any:
        try:
            got = await asyncio.wait_for(client.run(fn, *args, workers=[worker], on_error="return"), timeout_s)
        except (asyncio.TimeoutError, OSError):
            return NO_ANSWER
        answer = got.get(worker, NO_ANSWER)
        # a connection that broke is handed back as a value (on_error="return"): no answer, not an error of fn's
        return NO_ANSWER if isinstance(answer, OSError) else answer

    return dict(zip(addresses, await asyncio.gather(*(one(w) for w in addresses))))


def _worker_setup() -> dict[str, Any]:
    """Run on each worker of a configured scheduler (``Client.run``; sent by reference, so a worker
    without paperline fails to load it): its host's usable CPUs, the threads its BLAS uses per call
    (threadpoolctl, NumPy's BLAS loaded; 1 if unknown), and whether Dask's
    ``MALLOC_TRIM_THRESHOLD_`` is in its environment."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        cpus = os.cpu_count() or 1
    try:
        import numpy  # noqa: F401, PLC0415 - its BLAS, loaded for threadpoolctl to see
        from threadpoolctl import threadpool_info  # noqa: PLC0415

        blas = max((int(p.get("num_threads") or 1) for p in threadpool_info() if p.get("user_api") == "blas"),
                   default=1)
    except Exception:  # noqa: BLE001 - a set-up note is not worth failing the check for
        blas = 1
    import paperline  # noqa: PLC0415

    return {"cpus": cpus, "blas_threads": blas, "malloc_trim": "MALLOC_TRIM_THRESHOLD_" in os.environ,
            "code": code_digest(), "package": os.path.dirname(paperline.__file__)}


CODE_DIRS = ("flows", "tasks", "kernels", "infra", "deployments")  # what runs on workers (not tests, benchmarks)


@functools.cache
def code_digest() -> str:
    """SHA-256 (16 hex digits) of paperline's own code in this process: the ``.py`` files of
    :data:`CODE_DIRS` and the package's ``__init__.py``, by path relative to the package. A worker
    that imported another checkout passed every check (an infra trial)."""
    import hashlib  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    import paperline  # noqa: PLC0415

    root = Path(paperline.__file__).parent
    digest = hashlib.sha256()
    for path in sorted([root / "__init__.py", *(p for d in CODE_DIRS for p in (root / d).rglob("*.py"))]):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def worker_setup_notes(setups: dict[str, dict[str, Any]]) -> list[str]:
    """What is amiss in a configured cluster's workers, one line per host and problem, from
    :func:`_worker_setup`'s answers (with each worker's ``nthreads`` and ``name``) by address.

    - BLAS oversubscription: on one host, workers whose BLAS calls use several threads while
      their tasks' threads times those exceed its CPUs (``dask worker --no-nanny`` leaves OpenBLAS
      a thread per core in every task: 2 workers x 16 BLAS threads on 16 CPUs run 32).
    - More task threads than CPUs on a host, each BLAS call single-threaded: tasks share CPUs,
      and timings (GFLOP/s, the regression check) come out lower than the CPUs allow.
    - ``MALLOC_TRIM_THRESHOLD_`` set (Dask's nanny default): NumPy-heavy tasks ran 2-3x slower
      (an external-cluster trial: a tensor fit 101.8 s against 52.7 s).
    """
    from urllib.parse import urlsplit  # noqa: PLC0415

    hosts: dict[str, list[dict[str, Any]]] = {}
    for address, setup in setups.items():
        try:
            host = urlsplit(address).hostname or address
        except ValueError:
            host = address
        hosts.setdefault(host, []).append({"name": address, **setup})
    notes = []
    for host, found in sorted(hosts.items()):
        found.sort(key=lambda f: str(f["name"]))
        cpus = max(int(f["cpus"]) for f in found)
        threads = sum(int(f["nthreads"]) for f in found)
        running = sum(int(f["nthreads"]) * int(f["blas_threads"]) for f in found)
        wide = [f for f in found if int(f["blas_threads"]) > 1]
        if running > cpus and wide:
            most = max(int(f["blas_threads"]) for f in wide)
            notes.append(f"Dask workers on {host}: BLAS calls use up to {most} threads each in {len(wide)} of its "
                         f"{len(found)} worker(s) ({_listed([str(f['name']) for f in wide])}), {running} threads on "
                         f"{cpus} CPU(s) in all: start them with one BLAS thread per task (a nanny sets "
                         "OMP_NUM_THREADS=1; without one, set OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 "
                         "MKL_NUM_THREADS=1 in their environment)")
        elif threads > cpus:
            notes.append(f"Dask workers on {host}: {len(found)} worker(s) run {threads} task threads on {cpus} CPU(s) "
                         f"({_listed([str(f['name']) for f in found])}): tasks share CPUs, and timings come out lower "
                         f"than the CPUs allow; start at most {cpus} single-threaded workers there (dask worker "
                         f"--nworkers {cpus} --nthreads 1)")
        trimmed = [str(f["name"]) for f in found if f["malloc_trim"]]
        if trimmed:
            notes.append(f"Dask workers on {host}: {len(trimmed)} of {len(found)} run with Dask's "
                         f"MALLOC_TRIM_THRESHOLD_ ({_listed(trimmed)}; NumPy-heavy tasks ran 2-3x slower with it): "
                         "start them with --preload-nanny paperline.infra.nanny_env")
    return notes


async def _with_client(address: str, timeout_s: float, body: Any) -> Any:
    """``await body(client)`` with an asynchronous Dask client of the scheduler at ``address``,
    closed after (also when connecting failed: collected unclosed, it printed "coroutine ... never
    awaited")."""
    import asyncio  # noqa: PLC0415

    from distributed import Client  # noqa: PLC0415

    client = Client(address, asynchronous=True, timeout=timeout_s, set_as_default=False)

    async def connect() -> None:
        await client

    try:
        # (Dask's own timeout let a port that accepts and never answers hold the connect for the
        # caller's whole deadline, 15 s of a 5-s check: a trial)
        await asyncio.wait_for(connect(), timeout_s + 1)
        return await body(client)
    finally:
        with contextlib.suppress(Exception):
            await client.close()


SHARE = "share it with them at the same path (NFS, a cluster file system)"


@dataclasses.dataclass(frozen=True)
class WorkerPath:
    """A local path a run's Dask workers read or write as the flow's process names it.

    Attributes:
        argument: the parameter or setting that names it (``a``, ``output``, ``PAPERLINE_STATE_DIR``).
        value: that parameter's value as given.
        path: the path: a file the workers read, or (``writes``) a directory they write in.
        writes: True for a directory the workers write in, False for a file they read.
        instead: what to do other than sharing it (``"give an s3:// URI"``).
        how: how to make the workers see it (default :data:`SHARE`).
    """

    argument: str
    value: str
    path: str
    writes: bool = False
    instead: str = ""
    how: str = SHARE


SAMPLE_BYTES = 64 << 10  # a file's first and last bytes compared (with its size) by require_shared_paths
SAMPLED_FILES = 32  # files compared by content; beyond, by size (a video folder of thousands, on every worker)


def _sample_digest(path: str) -> str:
    """SHA-256 of a file's first and last :data:`SAMPLE_BYTES` (the whole of a smaller file)."""
    import hashlib  # noqa: PLC0415

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(SAMPLE_BYTES))
        size = os.fstat(f.fileno()).st_size
        if size > SAMPLE_BYTES:
            f.seek(max(SAMPLE_BYTES, size - SAMPLE_BYTES))
            digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


SHARED_CHECK_FILES = 256  # files asked of each worker at most (spread over the list): its event loop runs the check
SHARED_CHECK_TTL_S = 120.0  # the same paths checked again this soon in one process are not asked again
_CHECKED: dict[tuple[Any, ...], float] = {}  # (address, needs) -> when they passed (`run` checks, then its flow)


def require_shared_paths(settings: Settings, needs: list[WorkerPath], timeout_s: float = 10.0) -> None:
    """Check that the workers of a configured Dask scheduler see the local paths a run gives them
    (a no-op for the local cluster, whose workers share this machine's files).

    Workers read and write local paths as they are named here. On other machines a run failed at
    its first task (gemm: ``FileNotFoundError: .../gemm/operands/<digest>.npy``) or, worse, read a
    file of the same name that is not this one (an infra trial: a `B.npy` of the same size and
    time, only Freivalds' check caught it). So each regular file is compared by size and, for the
    first :data:`SAMPLED_FILES`, by the digest of its first and last :data:`SAMPLE_BYTES` (at most
    :data:`SHARED_CHECK_FILES` files, spread over the list); and each directory the workers write
    in gets a marker file with a random token, written here, that every worker must read back (a
    directory of the same name on another machine is empty) and may write in; the markers are
    removed after. A worker that does not answer within ``timeout_s`` is left out (`run` and
    `status` name it), and so is one that joins later. Paths that passed are not asked again in
    this process for :data:`SHARED_CHECK_TTL_S` (`paperline run` checks before the flow run, its
    flow again).

    Args:
        needs: the paths (:class:`WorkerPath`); anything but a regular file here (missing, a
            directory, a FIFO, unreadable: a video source the run records as rejected) is left to
            the run.

    Raises:
        InputError: naming the first need some worker does not see, the workers (up to 3) and what
            each saw, and what to do instead.
        ServiceError: the scheduler cannot be reached.
    """
    import asyncio  # noqa: PLC0415
    import stat  # noqa: PLC0415
    import time  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from paperline.infra.errors import InputError  # noqa: PLC0415

    address = settings.dask_scheduler_address
    if not address or not needs:
        return
    files = [i for i, n in enumerate(needs) if not n.writes]
    if len(files) > SHARED_CHECK_FILES:  # spread over the list: the first and last included
        step = (len(files) - 1) / (SHARED_CHECK_FILES - 1)
        kept = {files[round(i * step)] for i in range(SHARED_CHECK_FILES)}
        needs = [n for i, n in enumerate(needs) if n.writes or i in kept]
    key = (address, tuple(needs))
    if time.monotonic() - _CHECKED.get(key, -math.inf) < SHARED_CHECK_TTL_S:
        return
    token = uuid.uuid4().hex
    markers: list[Path] = []
    asked: list[WorkerPath] = []
    expected: list[tuple[str, str, Any]] = []  # (kind, path, what it must be), one per need in `asked`
    try:
        for need in needs:
            if need.writes:
                marker = Path(need.path) / f".paperline-shared-{token}"
                Path(need.path).mkdir(parents=True, exist_ok=True)
                marker.write_text(token)
                markers.append(marker)
                expected.append(("dir", str(marker), token))
            else:
                try:  # (a FIFO's open blocked for good, a link to a directory raised: a review)
                    st = os.stat(need.path)
                    if not stat.S_ISREG(st.st_mode):
                        continue
                    sampled = sum(kind == "file" and want[1] is not None for kind, _, want in expected)
                    digest = _sample_digest(need.path) if sampled < SAMPLED_FILES else None
                except OSError:
                    continue
                expected.append(("file", need.path, (st.st_size, digest)))
            asked.append(need)
        if not asked:
            return

        async def ask(client: Any) -> tuple[dict[str, Any], dict[str, str]]:
            return await _run_on_each(client, _sees, expected, timeout_s=timeout_s), await _worker_names(client)

        try:  # in a thread of its own (a flow's function may run where an event loop is running), a daemon:
            # a Ctrl-C meanwhile is not held up by it
            seen, names = _in_daemon_thread(lambda: asyncio.run(asyncio.wait_for(
                _with_client(address, timeout_s, ask), 2 * timeout_s + 10)))
        except Exception as exc:  # noqa: BLE001 - as require_scheduler: any failure to ask is the scheduler's
            raise ServiceError("dask scheduler", f"cannot ask its workers whether they see this run's local paths "
                                                 f"({type(exc).__name__}: {str(exc)[:200]}); check "
                                                 "PAPERLINE_DASK_SCHEDULER_ADDRESS", url=address) from None
    finally:
        for marker in markers:
            marker.unlink(missing_ok=True)
    problems: dict[int, list[tuple[str, str]]] = {}  # index in `asked`: [(worker, what it saw)]
    # a worker that did not answer, or could not run the check (no or other paperline: `run` says so), is left out
    answered = [w for w, answer in seen.items() if isinstance(answer, dict)]
    for worker in sorted(answered):
        for i, why in seen[worker].items():
            problems.setdefault(int(i), []).append((names.get(worker, worker), why))
    if not problems:
        _CHECKED[key] = time.monotonic()
        return
    first = min(problems)
    need, who = asked[first], problems[first]
    listed = _listed([f"{worker} ({why})" for worker, why in who])
    verb = "cannot write in" if need.writes else "do not see"
    others = len(problems) - 1
    more = f" ({others} more of this run's paths likewise)" if others else ""
    instead = f", or {need.instead}" if need.instead else ""
    how = ("let the workers' user write in it" if all(why == NOT_WRITABLE for _, why in who)
           else f"workers use local paths as this machine names them; {need.how}")
    raise InputError(need.argument, need.value,
                     f"{len(who)} of the {len(answered)} Dask worker(s) of the scheduler at {redact_url(address)} "
                     f"{verb} {need.path} ({listed}){more}: {how}{instead}")


def _in_daemon_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` in a daemon thread, its result or exception handed back; the caller's wait can be
    interrupted (Ctrl-C), and the thread does not hold the process's exit up."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=target, name="paperline-shared-paths", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


NOT_WRITABLE = "not writable there"


def _sees(expected: list[tuple[str, str, Any]]) -> dict[int, str]:
    """Run on each worker (``Client.run``) by :func:`require_shared_paths`: what this worker sees
    of each expected path, as ``{index: what is wrong}`` (empty: every path as expected)."""
    import stat  # noqa: PLC0415

    wrong: dict[int, str] = {}
    for i, (kind, path, want) in enumerate(expected):
        try:
            if kind == "file":
                size, digest = want
                st = os.stat(path)
                seen = st.st_size
                if not stat.S_ISREG(st.st_mode):  # (a FIFO's open would block this worker's event loop)
                    wrong[i] = "not a regular file there"
                elif seen != size:
                    wrong[i] = f"another file of that name: {seen} bytes, not {size}"
                elif digest is not None and _sample_digest(path) != digest:
                    wrong[i] = "another file of that name: the same size, other contents"
            else:
                with open(path) as f:
                    if f.read() != want:
                        wrong[i] = "another directory of that name"
                        continue
                if not os.access(os.path.dirname(path), os.W_OK):
                    wrong[i] = NOT_WRITABLE
        except FileNotFoundError:
            wrong[i] = "no such file" if kind == "file" else "another directory of that name, or none"
        except OSError as exc:
            wrong[i] = f"{type(exc).__name__}: {exc.strerror or exc}"
    return wrong

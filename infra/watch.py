"""A run's watch on the local stack's server processes.

With the stack's servers killed under a `paperline run` (``kill -9``, a crash, the OOM killer),
the run went on failing call by call: each client retried its dead server (MLflow ~30 s a call,
boto3 and Prefect seconds each), and the command ended 76 s later with ~20 lines of retry
warnings; a Ctrl-C meanwhile took 71 s to exit (trials). A process that is gone is a fact, not a
network hiccup: :class:`ServerWatch` checks the recorded servers' processes (PID and start time)
once a second and, when one has been gone for :data:`GRACE_S` without being restarted (`paperline
up` records the new process), stops the run. From the first check that finds it gone, clients
of this process fail at once on that service (:func:`down_reason`) instead of retrying it.

Servers stopped by `paperline down` under a run (it deletes ``stack.json``) count as gone the same
way, said as stopped: such a run took 84 s to end, on retries (a trial). An `up` within the grace
(records anew; nothing counts while `up` or `down` holds the stack's lock) lets the run go on.

A pipeline flow run outside `paperline run` (a deployment's run under `paperline serve` or a
Prefect worker, a script's call after ``connect()``) gets :func:`flow_run_watch`, and each local
Dask worker process a watch of its own (:mod:`paperline.infra.worker_watch`): the same marks,
without the stop, so they fail at once on a dead server instead of retrying it (a served nas run
went on ~100 s after its stack was killed, its tasks on the workers retrying S3 commits).
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from paperline.infra.errors import PaperlineError

if TYPE_CHECKING:
    from paperline.infra.settings import Settings

GRACE_S = 10.0  # how long a recorded server may be gone (an `up` restarting it) before the run is stopped
POLL_S = 1.0  # seconds between checks of the recorded processes

_DOWN: dict[str, str] = {}  # service -> why, while a watch in this process has found its server dead
_ACTIVE: list[ServerWatch] = []  # the watches watching in this process now


class ServersDied(PaperlineError):
    """A run was stopped because servers of its stack died or were stopped under it (:class:`ServerWatch`)."""


def down_reason(service: str) -> str | None:
    """Why ``service`` (``"s3"``, ``"prefect"``, ``"mlflow"``) is known to be down in this
    process (its recorded server died under a run a :class:`ServerWatch` watches), else None.
    Clients check it to fail at once rather than retry a server that is gone."""
    return _DOWN.get(service)


class ServerWatch:
    """Watch the servers ``stack.json`` records while a run goes on (a context manager).

    A background thread reads the recorded servers every ``poll_s`` seconds
    (:func:`paperline.infra.stack.dead_servers`) and marks those gone as down for this process
    (:func:`down_reason`; unmarked when `paperline up` has recorded a new process, and nothing is
    marked while an `up` or `down` holds the stack's lock); a server `paperline down` stopped
    (no longer recorded, its process from the watch's start gone) counts too, marked
    ``stopped``. When any has been gone for ``grace_s`` seconds (the same PID throughout), it keeps them in :attr:`dead` and calls ``on_dead(dead)``
    once, from the thread; then it stops watching. Entering the context clears marks an earlier
    watch left; leaving it unmarks what it marked.

    Args:
        settings: Uses ``state_dir``.
        on_dead: Called with ``{service: record}`` (record keys ``pid``, ``log_path``, ``url``).
        services: The services to watch: the stack's managed ones (a configured endpoint can
            shadow a stale local record of the same service).
        grace_s: Seconds a server may be gone before ``on_dead`` is called.
        poll_s: Seconds between checks.
        active: False: a watch that watches nothing (its thread is not started).
        on_gone: Called (from the thread) each time servers are found gone after none was.
        during: When, in the marks' words (``"during the run"``, ``"while serving"``).
        on_back: Called (from the thread) with ``{service: when it was first found gone (UTC)}``
            for servers found gone that an `up` has since restarted, however short the outage.
    """

    def __init__(self, settings: Settings, on_dead: Callable[[dict[str, dict[str, Any]]], None],
                 services: tuple[str, ...] = ("s3", "prefect", "mlflow"), grace_s: float = GRACE_S,
                 poll_s: float = POLL_S, active: bool = True, on_gone: Callable[[], None] | None = None,
                 during: str = "during the run",
                 on_back: Callable[[dict[str, datetime.datetime]], None] | None = None):
        self.settings = settings
        self.on_dead = on_dead
        self.services = tuple(services)
        self.grace_s = grace_s
        self.poll_s = poll_s
        self.active = active
        self.on_gone = on_gone
        self.during = during
        self.on_back = on_back
        self._gone_since: dict[str, datetime.datetime] = {}  # service -> when first found gone (for on_back)
        self.dead: dict[str, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()  # marking and on_dead, against the exit
        self._marked: set[str] = set()  # the services this watch marked down (:func:`down_reason`)
        self._thread: threading.Thread | None = None
        self._earlier: dict[str, dict[str, Any]] = {}  # the records when the watch began

    def gone_now(self) -> dict[str, dict[str, Any]]:
        """The watched servers gone at this moment (grace or not): what a run that failed on its
        own before the grace ran out can name as the cause."""
        from paperline.infra.stack import dead_servers  # noqa: PLC0415

        try:
            return dead_servers(self.settings, self.services, self._earlier)
        except Exception:  # noqa: BLE001 - only a detail of an error being reported
            return {}

    def _back(self, gone: dict[str, dict[str, Any]]) -> None:
        """Call ``on_back`` for the services found gone before and recorded with a live server
        now (an `up` restarted them; the marks were cleared while it held the stack's lock)."""
        now = datetime.datetime.now(datetime.timezone.utc)
        back = {name: began for name, began in self._gone_since.items() if name not in gone}
        self._gone_since = {name: self._gone_since.get(name, now) for name in gone}
        if back:
            self.on_back(back)  # type: ignore[misc]

    def _mark(self, gone: dict[str, dict[str, Any]]) -> bool:
        """Mark ``gone`` down and unmark the rest; False once the watch has ended."""
        with self._lock:
            if self._stop.is_set():
                return False
            for name in self._marked - set(gone):
                _DOWN.pop(name, None)
            for name, rec in gone.items():
                _DOWN[name] = (f"its server (pid {rec['pid']}) was stopped {self.during} (`paperline down`)"
                               if rec.get("stopped") else f"its server (pid {rec['pid']}) died {self.during}"
                               ) + "; `paperline up` starts it again"
            first = bool(gone) and not self._marked
            self._marked = set(gone)
        if first and self.on_gone is not None:
            self.on_gone()
        return True

    def _watch(self) -> None:
        from paperline.infra.stack import dead_servers, recorded_servers, stack_lock_busy  # noqa: PLC0415

        since: dict[tuple[str, int], float] = {}  # (service, pid) -> when first seen gone
        while not self._stop.wait(self.poll_s):
            try:
                # the latest records: a serve watching across a kill, an `up` and then a `down` named
                # the server killed first as the one `down` stopped (a trial)
                records = recorded_servers(self.settings)  # (read once a poll)
                self._earlier = records or self._earlier
                busy = stack_lock_busy(self.settings)  # (dead_servers gives {} then; a `down` may end in between)
                gone = dead_servers(self.settings, self.services, self._earlier, records)
                if self.on_back is not None and not busy and not stack_lock_busy(self.settings):
                    self._back(gone)
            except Exception:  # noqa: BLE001 - a watch that cannot read the state leaves the run alone
                continue
            now = time.monotonic()
            since = {key: since.get(key, now) for key in ((n, int(r["pid"])) for n, r in gone.items())}
            # clients fail at once from now on (a Ctrl-C meanwhile exited after their retries: 71 s)
            if not self._mark(gone):
                return
            if since and now - min(since.values()) >= self.grace_s:
                with self._lock:  # never after the watched block ended: its interrupt would land past it
                    if self._stop.is_set():
                        return
                    self.dead = gone
                    self.on_dead(gone)
                return

    def __enter__(self) -> ServerWatch:
        from paperline.infra.stack import recorded_servers  # noqa: PLC0415

        for name in self.services:  # an earlier watch's marks (its exit interrupted): not this run's
            _DOWN.pop(name, None)
        if not self.active or not self.services:  # (every endpoint configured: nothing of ours to watch)
            return self
        self._earlier = recorded_servers(self.settings)  # `down` deletes stack.json: then these say what ran
        self._thread = threading.Thread(target=self._watch, name="paperline-server-watch", daemon=True)
        self._thread.start()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            with self._lock:
                self._stop.set()
            if self._thread is not None:
                self._thread.join(timeout=self.poll_s + 5.0)
        finally:  # (the watch's own interrupt can land in here)
            self._stop.set()
            for name in self._marked:
                _DOWN.pop(name, None)
            with contextlib.suppress(ValueError):
                _ACTIVE.remove(self)


def marking_watch(settings: Settings | None = None, during: str = "during the run",
                  on_back: Callable[[dict[str, datetime.datetime]], None] | None = None) -> ServerWatch:
    """A :class:`ServerWatch` on the local stack's managed services
    (:func:`paperline.infra.stack.managed_services`) that marks the dead ones down for this
    process, and unmarks them when `paperline up` records new servers, but never stops anything:
    this process fails at once at its next call to a dead server, and goes on computing until then.

    Args:
        settings: Uses ``state_dir`` and the configured endpoints; default
            :func:`paperline.infra.settings.get_settings`.
        during: When, in the marks' words (:class:`ServerWatch`).
        on_back: As :class:`ServerWatch`'s.
    """
    from paperline.infra.settings import get_settings  # noqa: PLC0415
    from paperline.infra.stack import managed_services  # noqa: PLC0415

    settings = settings or get_settings()
    return ServerWatch(settings, lambda dead: None, services=managed_services(settings), grace_s=math.inf,
                       on_gone=check_result_writes, during=during, on_back=on_back)


@contextlib.contextmanager
def flow_run_watch(settings: Settings | None = None) -> Iterator[None]:
    """A :func:`marking_watch` while a pipeline flow runs, unless a watch in this process already
    watches (`paperline run`'s, which also stops the run; a Dask worker's, from its preload
    :mod:`paperline.infra.worker_watch`). In a process started for one deployment run
    (``PREFECT__FLOW_RUN_ID`` set by Prefect's runner or worker) the watch runs on to the
    process's end."""
    watch = None
    if not _ACTIVE:
        with contextlib.suppress(Exception):  # (settings it cannot read: the run reports them itself)
            watch = marking_watch(settings)
    if watch is None:
        yield
    elif os.environ.get("PREFECT__FLOW_RUN_ID"):
        # a process that Prefect's runner or worker started for this one run: watched to its end, as
        # the engine's last calls (the result's write, the final state) come after the function
        # returns, and retried a dead server ~8 s (a trial)
        watch.__enter__()
        quiet_outage_tracebacks()
        yield
    else:
        with watch:
            yield


def outage_error(exc: BaseException | None) -> bool:
    """``exc`` is a :func:`paperline.infra.errors.connection_failure` (a failed connection, or an
    error raised *from* one; not one raised while handling one, which may be a bug in the
    handling) while a watch in this process knows a server of the stack is gone
    (:func:`down_reason`): the server's death, already said, not a fault of its own."""
    from paperline.infra.errors import connection_failure  # noqa: PLC0415

    return bool(_DOWN) and connection_failure(exc) is not None


def _outage_one_line(record: Any) -> bool:
    """A log record whose exception is an :func:`outage_error`, or a warning of a closed
    websocket (Prefect's observers switching to polling as the server goes, before the watch
    has seen it gone), keeps its message and the exception's line, without the traceback."""
    if record.exc_info and (outage_error(exc := record.exc_info[1])
                            or (record.levelno <= 30 and type(exc).__name__.startswith("ConnectionClosed"))):
        record.exc_info = None
        record.exc_text = _error_line(exc)
    return True


def _error_line(exc: BaseException) -> str:
    kind = type(exc)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    return f"{name}: {exc}"


def quiet_outage_tracebacks() -> None:
    """In a deployment run's own process (started by `paperline serve`'s runner or a Prefect
    worker, whose output is their terminal's): Prefect's console records, and the uncaught error
    the process ends on, show a connection error to a server the watch knows is gone as its one
    line (which names the dead server: :mod:`paperline.infra.prefect_patches`), not its traceback.
    A served run whose Prefect server was killed printed the same ``ConnectError`` three times
    with its traceback, about 200 lines (a trial); the CLI's own filters are not in that process.
    Prefect's ``Finished in state Running()`` of a run cancelled or interrupted is left off too
    (:func:`paperline.infra.errors.no_unfinished_finish`, as `paperline run` does).
    (Its suspension observer polls on through the outage:
    :func:`paperline.infra.prefect_patches.install_suspension_check_through_outages`.) Idempotent;
    nothing with ``PAPERLINE_DEBUG`` set."""
    import logging  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from paperline.infra.errors import DEBUG_ENV, no_unfinished_finish  # noqa: PLC0415

    if os.environ.get(DEBUG_ENV):
        return
    handlers = [h for name in (None, "prefect", "prefect._internal") for h in logging.getLogger(name).handlers]
    for handler in handlers:
        if type(handler).__name__ == "PrefectConsoleHandler" and _outage_one_line not in handler.filters:
            handler.addFilter(_outage_one_line)
            handler.addFilter(no_unfinished_finish)  # (a cancelled run's "Finished in state Running()")
    previous = sys.excepthook
    if getattr(previous, "_paperline_outage", False):
        return

    def hook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        if outage_error(exc):
            print(_error_line(exc), file=sys.stderr)
        else:
            previous(kind, exc, tb)

    hook._paperline_outage = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def check_result_writes() -> None:
    """Prefect's result writes to S3 fail at once while it is marked down (a write to a dead S3
    took ~7 s of retries): installed on the first server found gone."""
    from paperline.infra import prefect_patches  # noqa: PLC0415

    with contextlib.suppress(Exception):  # (only how fast the run's end fails)
        prefect_patches.install_result_write_check()

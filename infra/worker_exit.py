"""Clean close of local Dask worker processes (a Dask worker ``preload``): a fast exit, and no
tracebacks on the user's terminal for the connections the close itself cuts.

**Fast exit.** A worker process that has run pipeline tasks holds Prefect, pydantic, boto3 and the
pipeline's numerics; when its nanny stops it, the interpreter's teardown of all those objects took
about 0.9 s on this 2-core machine, and a flow run's cluster waits for it: 1.0 s of a cached
``paperline run tensor-factorization``'s 10-11 s, against 0.05 s with this module.
How: as the worker starts, :func:`dask_setup` registers :func:`_exit_after_clean_close` with
``atexit``. Handlers registered later (Prefect's log and event drains, created at the first task)
run first, as ``atexit`` runs in reverse order; then, if :func:`dask_teardown` saw the worker
close cleanly, logging is flushed and the process ends with ``os._exit(0)``, skipping the
teardown. A worker that dies any other way exits as usual, with its own exit code.

**Quiet close.** Local workers write to the terminal of the process that started them
(``paperline run``). A worker closing on request cuts its own connections (``Worker.close`` closes
its RPC pool), and a heartbeat to the scheduler in flight at that moment fails with a
``CommClosedError``, which ``distributed.worker`` logs at ERROR with the tcp read's traceback
("Failed to communicate with scheduler during heartbeat."). It is expected, harmless, and read
by a user as a crash, so :class:`ClosingCommErrorFilter` drops such records: only while the worker
is closing, and only those carrying an ``OSError`` (comm errors are ``OSError``). The same
failure while the worker runs is still logged in full. A failed task's record is cut to one line,
or dropped for an error paperline raised on purpose, which its caller says
(:class:`TaskFailureOneLine`), and a task's record of a server that went away is one line
(:class:`ServerGoneOneLine`).
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import sys
from typing import Any

_CLOSED_CLEANLY = {"value": False}

# The loggers a closing worker's comm errors come from (the heartbeat's is distributed.worker).
QUIET_ON_CLOSE_LOGGERS = ("distributed.worker",)


class _WhileClosingFilter(logging.Filter):
    """Drops the records :meth:`drops` names while ``worker`` is closing or closed.

    Args:
        worker: a ``distributed.Worker`` (anything with a ``status`` attribute).
    """

    def __init__(self, worker: Any) -> None:
        super().__init__()
        self.worker = worker

    def drops(self, record: logging.LogRecord) -> bool:
        """Whether ``record`` is one to drop while the worker closes."""
        raise NotImplementedError

    def filter(self, record: logging.LogRecord) -> bool:
        """False (drop) for a record :meth:`drops` names while the worker is closing or closed;
        True otherwise."""
        return not (self.drops(record) and _closing(self.worker))


class ClosingCommErrorFilter(_WhileClosingFilter):
    """Drops records carrying an ``OSError`` logged while ``worker`` is closing or closed."""

    def drops(self, record: logging.LogRecord) -> bool:
        """A record carrying an ``OSError``."""
        return isinstance(record.exc_info[1] if record.exc_info else None, OSError)


def _closing(worker: Any) -> bool:
    from distributed.core import Status  # noqa: PLC0415 - loaded in any worker already

    return getattr(worker, "status", None) in (Status.closing, Status.closed)


class CancelledOnCloseFilter(_WhileClosingFilter):
    """Drops ``distributed.worker.state_machine``'s "Async instruction for <Task ...> ended with
    CancelledError" while ``worker`` is closing or closed: the tasks a closing worker was running
    are cancelled (training ranks, when Ctrl-C closed the run's cluster), which Dask logs as a
    warning with the asyncio task's repr, one long line per task, after the run's own
    "interrupted: ..." line (a trial). Other records pass."""

    def drops(self, record: logging.LogRecord) -> bool:
        """An "Async instruction for ... ended with CancelledError" record."""
        message = str(record.msg)
        return message.startswith("Async instruction for") and message.endswith("ended with CancelledError")


class TaskFailureOneLine(logging.Filter):
    """Shortens ``distributed.worker``'s "Compute Failed" record (key, state, the task's repr, the
    exception and its whole traceback as one escaped string) to one line: the task's key and the
    exception. The failure still reaches its caller with its traceback (Prefect's task log, the
    CLI's error line, or a training rank's restart message), so the worker's copy printed on the
    terminal was a second, unreadable report of the same error (a compressed-training resume
    printed one per killed rank)."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Rewrite a "Compute Failed" record (with at least 4 arguments) as
        ``task <key> failed on this worker: <exception>``, or drop it (False) when the exception
        is one paperline raises on purpose (an ``InputError``, a :class:`PaperlineError`, raised
        in paperline's code: its traceback's last frame is paperline's): its caller says it in one
        line (a diverged training's two ranks each printed it again: a trial). Kept with
        ``PAPERLINE_DEBUG``. True for every other record."""
        if isinstance(record.msg, str) and record.msg.startswith("Compute Failed") and len(record.args or ()) >= 4:
            key, exception = record.args[0], record.args[3]  # (the exception's repr: Dask's exception_text)
            if _raised_on_purpose(str(exception), str(record.args[4]) if len(record.args) > 4 else ""):
                return False
            record.msg, record.args = "task %s failed on this worker: %s", (key, exception)
        return True


def _raised_on_purpose(exception: str, traceback: str) -> bool:
    """Whether Dask's text of a task's exception (``Name(...)``) and traceback are an error paperline
    raised on purpose: the class named is one of :func:`_expected_error_names` and the traceback's
    last frame is in paperline's package (another library's ``ServiceError`` is not); never with
    ``PAPERLINE_DEBUG`` set."""
    import re  # noqa: PLC0415

    import paperline  # noqa: PLC0415
    from paperline.infra.errors import DEBUG_ENV  # noqa: PLC0415

    if os.environ.get(DEBUG_ENV) or not exception.startswith(tuple(f"{n}(" for n in _expected_error_names())):
        return False
    frames = re.findall(r'File "([^"]+)"', traceback)
    home = os.path.dirname(os.path.abspath(paperline.__file__)) + os.sep  # (a checkout's root, or site-packages/paperline)
    return bool(frames) and frames[-1].startswith(home) and "site-packages" not in frames[-1][len(home):]


def _expected_error_names() -> set[str]:
    """The class names of the errors paperline raises on purpose, as loaded in this process: the
    kernels' ``InputError``, :class:`PaperlineError` and their subclasses (``TrainingDiverged``)."""
    from paperline.infra.errors import PaperlineError  # noqa: PLC0415
    from paperline.kernels.errors import InputError  # noqa: PLC0415

    seen: set[type] = set()  # (by class: paperline.infra.errors has an InputError of its own)
    todo: list[type] = [InputError, PaperlineError]
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen.add(cls)
            todo.extend(cls.__subclasses__())
    return {cls.__name__ for cls in seen}


# where a task's records come from in a worker (the task-run logger, which Prefect's transactions use)
SERVER_GONE_LOGGERS = ("prefect.task_runs", "prefect.transactions")


class ServerGoneOneLine(logging.Filter):
    """Cuts a record whose exception says a server is unreachable to one line: its message and the
    exception's own. With the stack stopped under a run (`paperline down`), every task finishing in
    a worker logged Prefect's "An error was encountered while committing transaction" with botocore's
    three chained tracebacks (40 lines each; a trial's nas run printed 327 lines before its
    one-line error). Other exceptions keep their tracebacks."""

    def filter(self, record: logging.LogRecord) -> bool:
        """When the record's exception is a failed connection or was raised from one
        (:func:`paperline.infra.errors.connection_failure`), fold it into the message
        (``<message>: <Type>: <exception>``) and drop the traceback; always True."""
        from paperline.infra.errors import connection_failure  # noqa: PLC0415

        top = record.exc_info[1] if record.exc_info else None
        if connection_failure(top) is not None:
            record.msg = f"{record.getMessage()}: {type(top).__name__}: {top}"
            record.args, record.exc_info, record.exc_text = (), None, None
        return True


_SAID: dict[str, float] = {}  # short_event_failure's kinds of line: when each was last let through
QUIET_REPEATS_S = 600.0  # a kind said less than this long ago is not said again


def short_event_failure(record: logging.LogRecord) -> bool:
    """One short line, at most every :data:`QUIET_REPEATS_S` seconds per process, for the events
    Prefect's events worker could not send or its client's "Unable to connect to 'ws://...'"
    (whichever comes first: one outage brought both): with the server gone each failed event printed the whole event (2,000 characters;
    a trial), and the pair came every few seconds from the flow's process and each worker until
    the run gave up (a minute). Installed by `paperline run` and `serve` and by each worker
    (:func:`dask_setup`)."""
    args = record.args if isinstance(record.args, tuple) else ()
    # one kind for the pair: both came for one outage, the two lines saying the same (a trial)
    if "failed to process item" in str(record.msg) and any(type(a).__name__ == "Event" for a in args):
        record.msg, record.args = "Prefect's events worker could not send an event to the server (the next ones " \
                                  f"for {QUIET_REPEATS_S / 60:g} minutes are not shown)", ()
    elif not (record.name == "prefect.events.clients" and str(record.msg).startswith("Unable to connect to")):
        return True
    kind = "events"
    import time  # noqa: PLC0415

    now = time.monotonic()
    if now - _SAID.get(kind, -math.inf) < QUIET_REPEATS_S:
        return False
    _SAID[kind] = now
    return True


def no_profiler_race(record: logging.LogRecord) -> bool:
    """Drop tornado's ``Exception in callback <bound method Worker.trigger_profile ...>`` carrying
    an ``AttributeError`` raised in ``distributed/profile.py``: Dask's worker profiler walks other
    threads' frames while they change and sometimes finds a code object or builtin where a frame
    was (dask/distributed#1451, #8163, fixed for some shapes only). Harmless (the next sample goes
    on), and a trial read the traceback on its terminal as the run failing. Any other callback
    error is kept."""
    exc = record.exc_info[1] if record.exc_info else None
    if not isinstance(exc, AttributeError):
        return True
    try:
        text = record.getMessage()
    except (TypeError, ValueError):
        return True
    if "trigger_profile" not in text:
        return True
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is None or not tb.tb_frame.f_code.co_filename.replace("\\", "/").endswith("distributed/profile.py")


def _exit_after_clean_close() -> None:
    if not _CLOSED_CLEANLY["value"]:
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# A terminal's Ctrl-C, its closing, and a stop sent to the whole process group (`timeout`, a
# supervisor): the process that owns a local cluster stops it; its workers leave them to it.
STOP_SIGNALS = ("SIGINT", "SIGHUP", "SIGTERM")


def _ignore_interrupt(signum: int, frame: Any) -> None:
    """Handler of :data:`STOP_SIGNALS` in a worker process under a nanny: nothing (see :func:`dask_setup`)."""


def dask_setup(worker: Any) -> None:
    """Dask preload hook: arm the exit handler (before any task registers its own), install
    :class:`ClosingCommErrorFilter` on :data:`QUIET_ON_CLOSE_LOGGERS`, :class:`TaskFailureOneLine`,
    :class:`ServerGoneOneLine` on :data:`SERVER_GONE_LOGGERS` and :class:`CancelledOnCloseFilter`,
    and leave :data:`STOP_SIGNALS` to the process that owns the cluster.

    A terminal's Ctrl-C reaches every process of its process group, local worker processes
    included: each printed a ``KeyboardInterrupt`` traceback (two per worker, on top of the run's
    own one-line report) while the flow process was already closing the cluster (fresh-user trial).
    A worker process under a nanny is stopped by it, or when the nanny's process is gone (its stop
    queue closes), so there SIGINT is caught and dropped: a Python handler, not ``SIG_IGN``, so the
    processes a task starts get the default again when they exec. So are SIGHUP, which a closed
    terminal sends to the same process group, and SIGTERM sent to the group (`paperline run`
    stops on both as on Ctrl-C). The nanny stops its worker with SIGKILL when asking fails.
    """
    import signal  # noqa: PLC0415
    import threading  # noqa: PLC0415

    atexit.register(_exit_after_clean_close)
    # only under a nanny (a `dask worker --no-nanny` process is the user's to interrupt), and only
    # from the main thread (the one place signal handlers can be set)
    # (a closed terminal's SIGHUP killed workers mid-task, and the nanny restarted them with
    # tracebacks; SIGTERM to the process group, from `timeout` or a supervisor, likewise, with
    # "Restarting worker" beside the run's "interrupted: ...": trials)
    stops = [getattr(signal, name) for name in STOP_SIGNALS if hasattr(signal, name)]
    if getattr(worker, "nanny", None) and threading.current_thread() is threading.main_thread():
        for sig in stops:
            signal.signal(sig, _ignore_interrupt)
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "pthread_sigmask"):
        # spawned with them blocked (infra.cluster.stop_signals_blocked), so that a Ctrl-C while
        # the worker was still starting did not end it with tracebacks: delivered from here on
        signal.pthread_sigmask(signal.SIG_UNBLOCK, set(stops))
    for name in QUIET_ON_CLOSE_LOGGERS:
        logging.getLogger(name).addFilter(ClosingCommErrorFilter(worker))
    logging.getLogger("distributed.worker").addFilter(TaskFailureOneLine())
    for name in SERVER_GONE_LOGGERS:
        logging.getLogger(name).addFilter(ServerGoneOneLine())
    for name in ("prefect._internal.concurrency", "prefect.events.clients"):
        logging.getLogger(name).addFilter(short_event_failure)
    logging.getLogger("distributed.worker.state_machine").addFilter(CancelledOnCloseFilter(worker))
    logging.getLogger("tornado.application").addFilter(no_profiler_race)


def dask_teardown(worker: Any) -> None:
    """Dask preload hook, called as the worker closes on request (its nanny or the cluster)."""
    _CLOSED_CLEANLY["value"] = True

"""Ctrl-C that is not lost where Python cannot raise it.

Python raises KeyboardInterrupt wherever the main thread is when SIGINT arrives. In a finalizer
(``__del__``, e.g. asyncio's transports), a weakref callback or a ``gc.callbacks`` function (Dask's
scheduler, which `paperline run` hosts in its own process, installs one that times every full
collection) the exception cannot propagate: Python prints "Exception ignored in: ...", the run
goes on, and the user's Ctrl-C is lost (a fresh-user trial: 3 of 14 early Ctrl-Cs; the
interrupted gc callback then failed an assertion). :func:`install` wraps ``sys.unraisablehook``
so that a KeyboardInterrupt that ends there is delivered to the main thread again, 50 ms later.

:func:`hangup_as_interrupt` makes SIGHUP (the terminal closed) and SIGTERM (``kill``) stop a run
as Ctrl-C does: they killed `paperline run` at once (exit 129, 143), its flow run left Running
until the heartbeat automation crashed it and its MLflow run RUNNING (trials).
"""

from __future__ import annotations

import _thread
import signal
import sys
import threading
from typing import Any

RETRY_S = 0.05  # when an interrupt swallowed as "unraisable" is delivered again
_RECEIVED = {"count": 0}  # stop signals the main thread's handler has turned into KeyboardInterrupt
_HANDLED: set[str] = set()  # the signals hangup_as_interrupt gave _counted_interrupt ("SIGHUP", "SIGTERM")


def _redeliver(unraisable: Any, previous: Any) -> None:
    if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
        threading.Timer(RETRY_S, _thread.interrupt_main).start()  # its SIGINT handler runs anew
        return  # not printed: the interrupt is not lost, the traceback would only alarm
    previous(unraisable)


def _counted_interrupt(signum: int, frame: Any) -> None:
    """The handler :func:`install` puts in place of Python's for SIGINT (and
    :func:`hangup_as_interrupt` for SIGHUP and SIGTERM): count it, then raise KeyboardInterrupt
    as Python's does."""
    _RECEIVED["count"] += 1
    signal.default_int_handler(signum, frame)


def interrupts_received() -> int:
    """How many stop signals (SIGINT, and SIGHUP and SIGTERM where :func:`hangup_as_interrupt`
    took them) this process has turned into KeyboardInterrupt since :func:`install`."""
    return _RECEIVED["count"]


def raise_if_interrupted() -> None:
    """Raise KeyboardInterrupt if a stop signal arrived since the last :func:`install`: for a
    command that handles none (`paperline run`), reaching this means its KeyboardInterrupt was lost.

    A Ctrl-C landing while the main thread ran a descriptor's ``__set_name__`` (a class being
    created, e.g. pydantic models as Prefect's modules are imported) is re-raised by Python as a
    ``RuntimeError``, and Prefect logs and drops any exception of its plugin start-up, which
    imports many: the run went on to the end (exit 0, a CI run; the error's traceback was printed).
    """
    if _RECEIVED["count"]:
        raise KeyboardInterrupt


def install() -> bool:
    """Deliver again each KeyboardInterrupt that Python could only report as unraisable, and count
    the SIGINTs turned into one (:func:`raise_if_interrupted`), where SIGINT has Python's handler
    (not ignored) and this is the main thread. Idempotent.

    Returns:
        Whether it was installed now (False: already in place).
    """
    _RECEIVED["count"] = 0  # (a command calls this as it starts: in-process tests run several)
    if threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _counted_interrupt)
    hook = sys.unraisablehook
    if getattr(hook, "_paperline_redeliver", False):
        return False

    def redeliver(unraisable: Any) -> None:
        _redeliver(unraisable, hook)

    redeliver._paperline_redeliver = True  # type: ignore[attr-defined]
    sys.unraisablehook = redeliver
    return True


def hangup_as_interrupt() -> bool:
    """Raise KeyboardInterrupt on SIGHUP and SIGTERM, as on SIGINT, for each of them that is not
    ignored (``nohup``) or handled already. Call it from the main thread.

    SIGTERM (``kill PID``, a supervisor stopping the run) killed `paperline run` at once, its flow
    run left Running until the heartbeat automation crashed it, its MLflow run RUNNING, and
    multiprocessing's resource tracker warned of leaked semaphores (a trial); now it stops as
    Ctrl-C does (exit 130, saying what the same command does next).

    Returns:
        Whether a handler was installed.
    """
    stops = [getattr(signal, name) for name in ("SIGHUP", "SIGTERM")
             if hasattr(signal, name) and signal.getsignal(getattr(signal, name)) is signal.SIG_DFL]
    if not stops:
        return False
    # multiprocessing's resource tracker (a process Dask's worker processes share) is in the same
    # process group: killed by the SIGHUP, it was restarted and printed a KeyError traceback for each
    # semaphore the closing workers released. Started now with them ignored, it keeps ignoring them.
    from multiprocessing import resource_tracker  # noqa: PLC0415

    for sig in stops:
        signal.signal(sig, signal.SIG_IGN)
    try:
        resource_tracker.ensure_running()
    finally:
        for sig in stops:
            signal.signal(sig, _counted_interrupt)
            _HANDLED.add(signal.Signals(sig).name)
    return True


def sigterm_is_interrupt() -> bool:
    """Whether :func:`hangup_as_interrupt` made SIGTERM stop this process as Ctrl-C does (so its
    command says ``interrupted: ...``); False where SIGTERM was ignored or handled already."""
    return "SIGTERM" in _HANDLED


def release_leaked_import_lock() -> int:
    """Release the global import lock if this thread holds it outside any import, and return how
    many levels were released (0: it held none).

    CPython takes that lock in importlib's module-lock bookkeeping, a weakref callback among them,
    before the ``try`` that releases it: a Ctrl-C landing right there leaves it held (the callback's
    error is unraisable; :func:`install` delivers the interrupt again). Every other thread's next
    import then waits for good: a `paperline run` interrupted as it started hung, its main thread
    waiting for the local cluster's start, whose event loop waited on an import (a stress test of
    early Ctrl-Cs). Call it only where this thread is inside no import statement (a command's
    clean-up after KeyboardInterrupt).
    """
    import _imp  # noqa: PLC0415

    released = 0
    while True:
        try:
            _imp.release_lock()
        except RuntimeError:  # "not holding the import lock": none (left) held by this thread
            return released
        released += 1


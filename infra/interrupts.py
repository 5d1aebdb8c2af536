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


def _redeliver(unraisable: Any, previous: Any) -> None:
    if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
        threading.Timer(RETRY_S, _thread.interrupt_main).start()  # its SIGINT handler runs anew
        return  # not printed: the interrupt is not lost, the traceback would only alarm
    previous(unraisable)


def install() -> bool:
    """Deliver again each KeyboardInterrupt that Python could only report as unraisable.
    Idempotent.

    Returns:
        Whether it was installed now (False: already in place).
    """
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
            signal.signal(sig, signal.default_int_handler)
    return True

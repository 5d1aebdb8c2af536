"""Ctrl-C that is not lost where Python cannot raise it.

Python raises KeyboardInterrupt wherever the main thread is when SIGINT arrives. In a finalizer
(``__del__``, e.g. asyncio's transports), a weakref callback or a ``gc.callbacks`` function (Dask's
scheduler, which `paperline run` hosts in its own process, installs one that times every full
collection) the exception cannot propagate: Python prints "Exception ignored in: ...", the run
goes on, and the user's Ctrl-C is lost (a fresh-user trial: 3 of 14 early Ctrl-Cs; the
interrupted gc callback then failed an assertion). :func:`install` wraps ``sys.unraisablehook``
so that a KeyboardInterrupt that ends there is delivered to the main thread again, 50 ms later.

:func:`hangup_as_interrupt` makes SIGHUP (the terminal closed) stop a run as Ctrl-C does: it
killed `paperline run` at once (exit 129), its flow run left Running until the heartbeat
automation crashed it and its MLflow run RUNNING (a trial).
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
    """Raise KeyboardInterrupt on SIGHUP, as on SIGINT, unless SIGHUP is ignored (``nohup``) or
    handled already. Call it from the main thread.

    Returns:
        Whether the handler was installed.
    """
    if not hasattr(signal, "SIGHUP") or signal.getsignal(signal.SIGHUP) is not signal.SIG_DFL:
        return False
    # multiprocessing's resource tracker (a process Dask's worker processes share) is in the same
    # process group: killed by the SIGHUP, it was restarted and printed a KeyError traceback for each
    # semaphore the closing workers released. Started now with SIGHUP ignored, it keeps ignoring it.
    from multiprocessing import resource_tracker  # noqa: PLC0415

    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        resource_tracker.ensure_running()
    finally:
        signal.signal(signal.SIGHUP, signal.default_int_handler)
    return True

"""Ctrl-C that is not lost where Python cannot raise it.

Python raises KeyboardInterrupt wherever the main thread is when SIGINT arrives. In a finalizer
(``__del__``, e.g. asyncio's transports), a weakref callback or a ``gc.callbacks`` function (Dask's
scheduler, which `paperline run` hosts in its own process, installs one that times every full
collection) the exception cannot propagate: Python prints "Exception ignored in: ...", the run
goes on, and the user's Ctrl-C is lost (a fresh-user trial: 3 of 14 early Ctrl-Cs; the
interrupted gc callback then failed an assertion). :func:`install` wraps ``sys.unraisablehook``
so that a KeyboardInterrupt that ends there is delivered to the main thread again, 50 ms later.
"""

from __future__ import annotations

import _thread
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

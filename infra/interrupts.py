"""Ctrl-C that is not lost inside a garbage-collector callback.

Python raises KeyboardInterrupt wherever the main thread is when SIGINT arrives. Inside a
``gc.callbacks`` function (Dask's scheduler, which `paperline run` hosts in its own process,
installs one that times every full collection) the exception cannot propagate: Python prints
"Exception ignored in: ... _gc_callback", the run goes on, and the user's Ctrl-C is lost (a
fresh-user trial: 3 of 14 early Ctrl-Cs, and the interrupted callback's state then failed an
assertion). :func:`install` puts a SIGINT handler in place that, when the signal lands inside such
a callback, delivers it again 50 ms later, outside it.
"""

from __future__ import annotations

import _thread
import gc
import signal
import threading
from types import FrameType

RETRY_S = 0.05  # when an interrupt that landed inside a gc callback is delivered again


def in_gc_callback(frame: FrameType | None) -> bool:
    """Whether ``frame`` or one of its callers runs a function of ``gc.callbacks``."""
    codes = {getattr(getattr(cb, "__func__", cb), "__code__", None) for cb in list(gc.callbacks)}
    codes.discard(None)
    while frame is not None:
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


def on_sigint(signum: int, frame: FrameType | None) -> None:
    """SIGINT handler: KeyboardInterrupt, as Python's own, except inside a gc callback, where the
    interrupt is delivered again shortly (``_thread.interrupt_main`` calls this handler anew)."""
    if in_gc_callback(frame):
        threading.Timer(RETRY_S, _thread.interrupt_main).start()
        return
    raise KeyboardInterrupt


def install() -> bool:
    """Use :func:`on_sigint` for SIGINT where Python's default handler is in place (not where a
    shell or a caller chose another, e.g. ignored for a background job). Main thread only.

    Returns:
        Whether it was installed.
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return False
    signal.signal(signal.SIGINT, on_sigint)
    return True

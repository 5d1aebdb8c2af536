"""An evaluation's time limit, kept by the evaluation itself (:func:`check_deadline`), set by
:func:`paperline.kernels.search.campaign.evaluate_point`."""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator


class EvaluationTimeout(Exception):  # noqa: N818 - (a recorded outcome, like the others)
    """An evaluation ran past its time limit (raised by :func:`check_deadline`)."""


_DEADLINE: contextvars.ContextVar[tuple[float, float] | None] = contextvars.ContextVar("evaluation_deadline",
                                                                                       default=None)


def check_deadline() -> None:
    """Raise :class:`EvaluationTimeout` when the evaluation running in this context is past the
    ``timeout_s`` :func:`evaluate_point` was given; a long evaluation calls it between its steps
    (live NAS: every training batch). Outside an evaluation with a limit it does nothing.

    Prefect's own task time limit, an exception sent into the worker's thread, was lost when it
    landed in another callback on that thread (Dask's GC diagnostics): a timed-out training ran on
    for seconds and the next batch's evaluations timed out queued behind it (a trial).
    """
    deadline = _DEADLINE.get()
    if deadline is not None and time.monotonic() > deadline[0]:
        raise EvaluationTimeout(f"timed out: not done {deadline[1]:g} s after it started on its worker")


@contextlib.contextmanager
def time_limit(timeout_s: float | None) -> Iterator[None]:
    """The block is an evaluation with ``timeout_s`` seconds from now (None: no limit), which
    :func:`check_deadline` enforces."""
    token = _DEADLINE.set(None if timeout_s is None else (time.monotonic() + timeout_s, timeout_s))
    try:
        yield
    finally:
        _DEADLINE.reset(token)

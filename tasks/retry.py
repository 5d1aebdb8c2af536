"""Retry and time-limit policy shared by the pipelines' tasks: retry what may be transient (an S3
hiccup, a lost worker), never bad input, a failed check or a task that ran out of its time limit,
which would fail the same way again.

Every task sets Prefect's ``timeout_seconds``. On a Dask worker thread Prefect enforces it by
raising ``TaskRunTimeoutError`` inside the thread (``WatcherThreadCancelScope``): that lands at the
next Python bytecode, so it stops our tasks' Python loops (tiles, epochs, frames, batches) but not
one long C call in progress. Prefect warns about that limit at the start of every such task run;
:func:`quiet_thread_timeout_warning` drops that one warning (it would repeat per task run).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from paperline.kernels.errors import InputError

HOUR = 3600.0


def retry_unless(*permanent: type[BaseException]) -> Callable[[Any, Any, Any], bool]:
    """A Prefect ``retry_condition_fn`` that retries unless the task raised one of ``permanent`` or
    ran out of its time limit (``TaskRunTimeoutError``)."""
    from prefect.task_engine import TaskRunTimeoutError  # noqa: PLC0415

    def condition(task: Any, task_run: Any, state: Any) -> bool:
        try:
            state.result()
        except (*permanent, TaskRunTimeoutError):
            return False
        except Exception:  # noqa: BLE001 - anything else may be transient
            return True
        return False

    condition.__name__ = "retry_unless_" + "_".join(t.__name__ for t in permanent)
    return condition


retry_unless_bad_input = retry_unless(InputError)


class _DropThreadTimeoutWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.WARNING and str(record.msg).startswith("Timeout of")
                    and "worker thread" in str(record.msg))


def quiet_thread_timeout_warning() -> None:
    """Drop Prefect's per-task-run warning that a timeout on a worker thread cannot interrupt a
    blocking call (documented above and in the README); idempotent."""
    logger = logging.getLogger("prefect.task_runs")
    if not any(isinstance(f, _DropThreadTimeoutWarning) for f in logger.filters):
        logger.addFilter(_DropThreadTimeoutWarning())

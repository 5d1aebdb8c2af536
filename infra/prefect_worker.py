"""The Prefect worker process of `paperline worker`: Prefect's own ``prefect worker start``, with
its log saying a run queued for its deployment's concurrency slot as waiting, not aborted.

Prefect's worker logs ``Aborted submission of flow run '<id>': Server returned a non-pending
state 'SCHEDULED'`` for a run that waits behind its deployment's one concurrency slot (prefect.yaml
gives every deployment a limit of one); the run starts when the run before it ends. `paperline
serve` says so through a filter on its own console (``flows/cli.py``), but the worker is a child
process (``python -m prefect worker start``) whose terminal kept Prefect's words (a review). Run as
``python -m paperline.infra.prefect_worker worker start ...``: it puts :func:`queued_not_aborted`
on the worker's flow-run logger, so that the terminal and the run's log in the Prefect UI both get
the rewritten line, then hands the arguments to Prefect's CLI.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import sys
from typing import Any

QUEUED = ("flow run '{}' waits Scheduled for its deployment's concurrency slot (one run at a time): it starts when "
          "the run before it ends")
_ABORTED_SCHEDULED = re.compile(r"Aborted submission of flow run '([^']+)': Server returned a non-pending state "
                                r"'SCHEDULED'")
WORKER_LOGGER = "prefect.flow_runs.worker"  # the logger of Prefect's BaseWorker.get_flow_run_logger


def queued_not_aborted(record: logging.LogRecord) -> bool:
    """Rewrite Prefect's ``Aborted submission of flow run '<id>': Server returned a non-pending
    state 'SCHEDULED'`` (the runner's form, ``%s`` arguments, and the worker's, formatted) as
    :data:`QUEUED`; other aborts (a cancelled run, say) keep Prefect's words. Keeps every record."""
    if not str(record.msg).startswith("Aborted submission of flow run"):
        return True
    try:
        text = record.getMessage()
    except (TypeError, ValueError):  # arguments that do not fit the message: Prefect's record as it is
        return True
    match = _ABORTED_SCHEDULED.fullmatch(text)
    if match:
        record.msg, record.args = QUEUED.format(match.group(1)), ()
    return True


def short_service_report(*args: object, **kwargs: object) -> None:
    """A ``print`` for Prefect's ``critical_service_loop`` (its ``printer``): a report of a
    traceback (one of its "Examples of recent errors") is printed as its exception's last line,
    indented; blank lines are dropped, and others printed as they are.

    Its polls failing for three in a row (the stack stopped under the worker, `paperline down`),
    the loop printed every distinct error's whole traceback with ``print``, past the logging
    filters of :func:`install` (a trial)."""
    text = " ".join(str(a) for a in args)
    if "Traceback (most recent call last)" in text:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        # the exception's own line: the last one naming a type (httpx's HTTPStatusError ends on a
        # "For more information check: <url>" line of its message, a review)
        named = [line for line in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b", line)]
        text = "  " + (named[-1] if named else lines[-1])
    if text.strip():
        print(text.strip("\n"), **kwargs)  # type: ignore[call-overload]


def _short_service_reports(loop: Any) -> Any:
    """``critical_service_loop`` printing through :func:`short_service_report` unless given a printer."""

    @functools.wraps(loop)
    async def wrapped(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("printer", short_service_report)
        return await loop(*args, **kwargs)

    wrapped._paperline_short = True  # type: ignore[attr-defined]
    return wrapped


def install() -> None:
    """Put :func:`queued_not_aborted` on the worker's flow-run logger, and on Prefect's console
    handlers the one-line filters of a stack that went away (once each).

    With the stack stopped under a run (`paperline down`), the worker's terminal took about 220
    lines: the state proposer's and the cancellation observer's connection tracebacks and the
    events worker's whole ``Event(...)`` reprs, where `paperline serve` said one line (a trial).
    Here a record whose exception is a failed connection is cut to its message and the
    exception's own line (:class:`paperline.infra.worker_exit.ServerGoneOneLine`), the events
    worker's failures to one line every ten minutes (:func:`~paperline.infra.worker_exit.short_event_failure`),
    and the worker's polling loops' reports of failed polls to their exceptions' lines
    (:func:`short_service_report`).
    """
    logger = logging.getLogger(WORKER_LOGGER)
    if queued_not_aborted not in logger.filters:
        logger.addFilter(queued_not_aborted)
    from prefect.logging.configuration import setup_logging  # noqa: PLC0415
    from prefect.logging.handlers import PrefectConsoleHandler  # noqa: PLC0415

    from paperline.infra.errors import DEBUG_ENV  # noqa: PLC0415
    from paperline.infra.worker_exit import ServerGoneOneLine, short_event_failure  # noqa: PLC0415

    setup_logging()  # Prefect's console handlers, kept by its CLI's own (incremental) setup
    if os.environ.get(DEBUG_ENV):  # `paperline --debug worker`: every traceback kept
        return
    from prefect.workers import base  # noqa: PLC0415

    if not getattr(base.critical_service_loop, "_paperline_short", False):  # (looked up as the worker starts)
        base.critical_service_loop = _short_service_reports(base.critical_service_loop)
    for handler in logging.getLogger().handlers:
        if not isinstance(handler, PrefectConsoleHandler):
            continue
        if not any(isinstance(f, ServerGoneOneLine) for f in handler.filters):
            handler.addFilter(ServerGoneOneLine())
        if short_event_failure not in handler.filters:
            handler.addFilter(short_event_failure)


def main(argv: list[str]) -> None:
    """Prefect's CLI with ``argv`` (e.g. ``["worker", "start", "--pool", ...]``), after :func:`install`."""
    install()
    from prefect.cli import app  # noqa: PLC0415 (Prefect's CLI: imported for the run, after the filter)

    sys.argv = ["prefect", *argv]
    app()


if __name__ == "__main__":
    main(sys.argv[1:])

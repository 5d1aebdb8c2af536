"""Errors paperline reports to users as one clear line (the CLI prints them without a traceback)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Callable
from typing import Any

from paperline.kernels.errors import InputError as KernelInputError


class PaperlineError(Exception):
    """Base of every error paperline raises on purpose; its message is meant for the user."""


class InputError(PaperlineError, KernelInputError):
    """Bad user input: the message names the argument and the value seen.

    The same class as the kernels' :class:`paperline.kernels.errors.InputError` (a subclass), so
    one ``except`` catches bad input wherever it was found.
    """


def input_error_from(exc: Any, argument: Callable[[tuple[Any, ...]], str]) -> InputError:
    """The first error of a pydantic ``ValidationError`` ``exc`` as one line: ``argument`` names
    the setting or parameter from the error's location tuple; the value seen and pydantic's
    message (without the ``Value error, `` prefix a validator's ValueError gets) follow."""
    err = exc.errors()[0]
    value = err.get("input")
    if isinstance(value, str):  # a URL's password is not shown
        value = redact_text(value)
    # (pydantic's "List should have at least 1 item after validation, not 0": "after validation"
    # meant nothing to a user, a trial)
    problem = err["msg"].removeprefix("Value error, ").replace(" item after validation,", " item,").replace(
        " items after validation,", " items,")
    if err.get("type") == "dict_type":  # "abc" or [1] for a JSON object: say what one looks like
        problem += ': give a JSON object, e.g. {"name": value}'
    elif err.get("type") == "model_type":  # it named the model's class ("... instance of CampaignParameters": a trial)
        problem = 'Input should be a JSON object of its fields, e.g. {"name": value}'
    return InputError(argument(tuple(err["loc"])), value, problem)


def name_problem(name: str, kind: str, placeholder: str = "") -> str | None:
    """Why ``name`` cannot name a ``kind`` (a campaign, a dataset: it becomes part of S3 keys, MLflow
    run names and file names), in words, or None when it can: letters, digits, ``.``, ``_`` and
    ``-``, starting with a letter or a digit. ``placeholder`` (e.g. ``{date}``) is allowed
    anywhere as a whole and is not checked. A bare regex was said to users before (trials)."""
    rest = name.replace(placeholder, "") if placeholder else name
    starts = name.startswith(placeholder) if placeholder else False
    if re.fullmatch(r"[A-Za-z0-9._-]*", rest) and (starts or re.match(r"[A-Za-z0-9]", name)) and name:
        return None
    bad = sorted(set(re.sub(r"[A-Za-z0-9._-]", "", rest)))
    first = f"a letter, a digit or {placeholder}" if placeholder else "a letter or a digit"
    why = f"characters {''.join(bad)!r} are not allowed" if bad else f"it must start with {first}"
    return f"{why}: a {kind} name is letters, digits, '.', '_' and '-'"


def first_few(names: list[str], shown: int) -> str:
    """The first ``shown`` of ``names``, comma-separated, then ``and N more`` (a message naming
    ~190 metrics was 12 KB on one line: a trial)."""
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def redact_url(url: str) -> str:
    """``url`` without the password of its user info (``http://alice@host:5000``; a user part
    alone, which may be a token, left out too), for anything shown or logged: a tracking URI may
    carry basic-auth credentials."""
    from urllib.parse import urlsplit, urlunsplit  # noqa: PLC0415

    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    if "@" not in parts.netloc:
        try:
            parts.port
        except ValueError:  # "http://bob:pa/ss@host": a password with a '/', '?' or '#' ends the netloc early
            if "@" in url:
                return f"{parts.scheme}://{parts.netloc.split(':', 1)[0]}@{url.rsplit('@', 1)[1]}"
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    # the user name stays (a browser asks for its password: the link still opens); a bare user
    # part may be a token, and goes
    user = f"{parts.username}@" if parts.password is not None and parts.username else ""
    return urlunsplit(parts._replace(netloc=f"{user}{host}"))


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>]+")


def redact_text(text: str) -> str:
    """``text`` with :func:`redact_url` applied to every URL in it: a client library's message
    (botocore's "Could not connect to the endpoint URL: ...") quotes the URL it was given,
    credentials and all."""
    return _URL.sub(lambda m: redact_url(m.group(0)), text) if "@" in text else text


class ServiceError(PaperlineError):
    """A service of the stack (S3, Prefect, MLflow, Dask) is down or failed to start.

    The message names the service, its URL (a password in it left out: :func:`redact_url`) and,
    for a local server, where its log is.
    """

    def __init__(self, service: str, detail: str, *, url: str | None = None, log: str | None = None):
        self.service = service
        parts = [f"{service} is not available"]
        if url:
            parts.append(f"at {redact_url(url)}")
        msg = " ".join(parts) + f": {redact_text(detail)}"
        if log:
            msg += f" (log: {log})"
        super().__init__(msg)


# Where Prefect logs a run's failure with its traceback: the flow- and task-run loggers and the
# engine's own ("Encountered exception during execution", "Engine execution exited with
# unexpected exception", "... interrupted by base exception").
RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs", "prefect.engine")
DEBUG_ENV = "PAPERLINE_DEBUG"  # set (by `paperline --debug`, inherited by its subprocesses): tracebacks kept


class ExpectedErrorOneLine(logging.Filter):
    """Drops the traceback of a record whose exception is one paperline raises on purpose
    (:class:`PaperlineError`, the kernels' ``InputError``) or an interrupt (Ctrl-C): the record's
    message already holds the error's one line.

    A deployment run refused for its input (a TRSM given ``beta``) printed the reason and then two
    of Prefect's full tracebacks into the `paperline serve` log, and a Ctrl-C one more (fresh-user
    trials); the run's state message was already that one line. Any other exception keeps its
    traceback.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        """Drop the traceback (``exc_info``, ``exc_text``) of a record whose exception is a
        :class:`PaperlineError`, the kernels' ``InputError`` or a ``KeyboardInterrupt``, and mark
        the record (attribute :data:`EXPECTED`, for a console that says the error itself); drop
        the engine's "Engine execution exited with unexpected exception" of such an error
        whole (a trial read it beside a refused parameter: the run's own lines said it). True
        for every other record."""
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, (PaperlineError, KernelInputError, KeyboardInterrupt)):
            if record.msg == "Engine execution exited with unexpected exception":
                return False
            record.exc_info = None
            record.exc_text = None
            setattr(record, EXPECTED, True)
        return True


EXPECTED = "paperline_expected_error"  # set on a record ExpectedErrorOneLine cut to one line


def quiet_expected_tracebacks(loggers: tuple[str, ...] = RUN_LOGGERS) -> None:
    """Install :class:`ExpectedErrorOneLine` on ``loggers`` (idempotent); nothing when
    ``PAPERLINE_DEBUG`` is set."""
    if os.environ.get(DEBUG_ENV):
        return
    for name in loggers:
        logger = logging.getLogger(name)
        if not any(isinstance(f, ExpectedErrorOneLine) for f in logger.filters):
            logger.addFilter(ExpectedErrorOneLine())


# The exceptions that say a server is not there, by name (S3 through botocore and urllib3, whose
# classes a worker need not import to be told): any ``ConnectionError``, ``httpx``'s transport
# errors and a closed websocket are too (:func:`connection_failure`).
UNREACHABLE = ("EndpointConnectionError", "ConnectError", "ConnectTimeout", "ConnectionRefusedError",
               "NewConnectionError", "ConnectionResetError")


def connection_failure(exc: BaseException | None) -> BaseException | None:
    """The failed connection ``exc`` is, or was raised from: the first of ``exc`` and its
    ``__cause__`` chain (``raise ... from``) that is a ``ConnectionError``, an ``httpx``
    transport error, a closed websocket or named in :data:`UNREACHABLE`; None when none is.

    Not an exception raised while one was being handled (``__context__`` only): that may be a
    bug in the handling, whose traceback is wanted. The one test of "a server went away" for the
    records cut to one line in a run's process (:func:`paperline.infra.watch.outage_error`) and in
    a worker (:class:`paperline.infra.worker_exit.ServerGoneOneLine`).
    """
    kinds: tuple[type[BaseException], ...] = (ConnectionError,)
    with contextlib.suppress(ImportError):
        import httpx  # noqa: PLC0415

        kinds += (httpx.TransportError,)
    with contextlib.suppress(ImportError):
        from websockets.exceptions import ConnectionClosed  # noqa: PLC0415

        kinds += (ConnectionClosed,)
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kinds) or type(exc).__name__ in UNREACHABLE:
            return exc
        seen.add(id(exc))
        exc = exc.__cause__
    return None


def no_unfinished_finish(record: Any) -> bool:
    """A logging filter: drop Prefect's ``Finished in state Running()`` (an ERROR record its engine
    logs when an interrupt or a cancellation ends a task or flow mid-run, as Ctrl-C does): the
    run's own lines say what ended it, and a run "finished" while running read as a fault (trials:
    `paperline run`'s Ctrl-C, a served run cancelled from the CLI). Everything else passes."""
    return not (record.name.startswith("prefect") and record.getMessage() == "Finished in state Running()")

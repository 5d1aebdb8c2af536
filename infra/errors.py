"""Errors paperline reports to users as one clear line (the CLI prints them without a traceback)."""

from __future__ import annotations

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
    return InputError(argument(tuple(err["loc"])), err.get("input"), err["msg"].removeprefix("Value error, "))


class ServiceError(PaperlineError):
    """A service of the stack (S3, Prefect, MLflow, Dask) is down or failed to start.

    The message names the service, its URL and, for a local server, where its log is.
    """

    def __init__(self, service: str, detail: str, *, url: str | None = None, log: str | None = None):
        self.service = service
        parts = [f"{service} is not available"]
        if url:
            parts.append(f"at {url}")
        msg = " ".join(parts) + f": {detail}"
        if log:
            msg += f" (log: {log})"
        super().__init__(msg)

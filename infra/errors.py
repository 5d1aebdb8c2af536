"""Errors paperline reports to users as one clear line (the CLI prints them without a traceback)."""

from __future__ import annotations


class PaperlineError(Exception):
    """Base of every error paperline raises on purpose; its message is meant for the user."""


class InputError(PaperlineError, ValueError):
    """Bad user input: the message names the argument and the value seen."""

    def __init__(self, argument: str, value: object, problem: str):
        self.argument = argument
        self.value = value
        shown = repr(value)
        if len(shown) > 120:
            shown = shown[:117] + "..."
        super().__init__(f"{argument}={shown}: {problem}")


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

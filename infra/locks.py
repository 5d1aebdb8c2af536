"""Locks between processes of this machine.

:func:`held_by_this_process` takes an advisory ``fcntl.flock`` on a file, which the kernel releases
when the holding process ends, however it ends (even ``kill -9``): nothing stale is left to clean
up, and a crashed holder's work can be resumed at once. The file records the holder (its PID, and
what it is when the caller says) for messages. POSIX only.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


class Held(Exception):
    """The lock is held by another process (or by another open of it in this one).

    Attributes:
        path: The lock file.
        holder: The holder as it wrote itself (``"<who> (process <pid>)"``, or its PID alone), or
            ``"?"``.
    """

    def __init__(self, path: Path, holder: str):
        super().__init__(f"{path} is held by process {holder}")
        self.path, self.holder = path, holder


@contextlib.contextmanager
def held_by_this_process(path: Path, who: str | None = None) -> Iterator[None]:
    """Hold the lock file ``path`` (created with its folder if missing) for the ``with`` block,
    recording this process as ``"<who> (process <pid>)"`` (``who``: e.g. a flow run, in words),
    or by its PID alone.

    Raises:
        Held: another process holds it (never waits).
        OSError: the file cannot be created or opened.
    """
    import fcntl  # noqa: PLC0415 - POSIX

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:  # (closing the file releases the lock)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            raise Held(path, f.read().strip() or "?") from None
        f.seek(0)
        f.truncate()
        f.write(f"{who} (process {os.getpid()})" if who else str(os.getpid()))  # ("a+": at 0 after the truncate)
        f.flush()
        yield


def run_owner(pipeline: str) -> str:
    """This run in words, as a lock or lease names its holder: ``<pipeline> flow run <name> (<id>)``,
    or ``a <pipeline> run outside Prefect``."""
    from prefect.runtime import flow_run  # noqa: PLC0415 - this module stays light for its other callers

    return f"{pipeline} flow run {flow_run.name} ({flow_run.id})" if flow_run.id else f"a {pipeline} run outside Prefect"

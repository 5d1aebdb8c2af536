"""Dask worker preload (``WORKER_PRELOAD``, ``infra/cluster.py``): each local worker process
watches the stack's servers for as long as it runs (:func:`paperline.infra.watch.marking_watch`).

A task on a worker calls S3 (shards, tiles, Prefect's result commits) and MLflow itself; with the
stack's servers killed under a run, each such call retried its dead server for seconds (boto3's
retries, ~10 s a result commit), and a served nas run went on ~40 s after the kill on tasks
failing one by one (a trial). Marked down, the calls fail at once. The run's own process has its
own watch (`paperline run`'s, or :func:`paperline.infra.watch.flow_run_watch`).
"""

from __future__ import annotations

import contextlib
from typing import Any

_WATCH: dict[str, Any] = {}


def dask_setup(worker: Any) -> None:
    """Dask preload hook: start the worker's watch. A watch that cannot start (settings the
    process cannot read) leaves the worker alone: the tasks report such settings themselves."""
    from paperline.infra.watch import marking_watch  # noqa: PLC0415

    with contextlib.suppress(Exception):
        _WATCH["watch"] = marking_watch().__enter__()


def dask_teardown(worker: Any) -> None:
    """Dask preload hook, called as the worker closes: stop the watch."""
    watch = _WATCH.pop("watch", None)
    if watch is not None:
        watch.__exit__(None, None, None)

"""Executors that run a kernel's independent sub-problems as Dask tasks on the cluster's workers."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from paperline.kernels.tensor.p2t2f import SerialExecutor


class DaskExecutor:
    """Run sub-problems on Dask workers, each pinned to the worker that holds its data.

    ``place`` scatters sub-problem ``p`` once to worker ``p mod W`` (so its entries never travel
    again); ``map`` submits one task per sub-problem to that same worker and gathers the (small)
    results. Satisfies :class:`paperline.kernels.tensor.p2t2f.Executor`.

    Args:
        client: a ``distributed.Client`` (inside a Prefect task: ``prefect_dask.get_dask_client()``).
    """

    def __init__(self, client: Any):
        self.client = client
        self.workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
        if not self.workers:
            from paperline.infra.errors import ServiceError

            raise ServiceError("dask", "the cluster has no workers", url=str(client.scheduler.address))
        self._assigned: dict[str, str] = {}

    def place(self, items: Sequence[Any]) -> list[Any]:
        handles = []
        for p, item in enumerate(items):
            worker = self.workers[p % len(self.workers)]
            fut = self.client.scatter(item, workers=[worker], hash=False)
            self._assigned[fut.key] = worker
            handles.append(fut)
        return handles

    def map(self, fn: Callable[..., Any], handles: Sequence[Any], args: Sequence[tuple]) -> list[Any]:
        futures = [
            self.client.submit(fn, h, *a, workers=[self._assigned[h.key]], allow_other_workers=False, pure=False)
            for h, a in zip(handles, args)
        ]
        return self.client.gather(futures)


@contextmanager
def cluster_executor() -> Iterator[DaskExecutor | SerialExecutor]:
    """The executor for sub-problems launched from inside a task.

    On a Dask worker (a task of a flow on the ``DaskTaskRunner``) this is a :class:`DaskExecutor`
    over ``distributed.worker_client()``, which *secedes* the calling task's thread while it waits,
    so that the sub-problems can use every worker thread, this one's included (a plain client
    would hold the thread and deadlock a cluster of single-threaded workers). Anywhere else it is
    the in-process :class:`SerialExecutor`.
    """
    from distributed import get_worker, worker_client

    try:
        get_worker()
    except ValueError:
        yield SerialExecutor()
        return
    with worker_client() as client:
        yield DaskExecutor(client)

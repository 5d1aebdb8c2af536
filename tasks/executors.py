"""Executors that run a kernel's independent sub-problems as Dask tasks on the cluster's workers."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from paperline.kernels.errors import scheduler_workers
from paperline.kernels.tensor.p2t2f import SerialExecutor


class DaskExecutor:
    """Run sub-problems on Dask workers, each pinned to the worker that holds its data.

    ``place`` scatters sub-problem ``p`` once to worker ``p mod W`` (so its entries never travel
    again); ``map`` submits one task per sub-problem to that same worker and gathers the (small)
    results. Satisfies :class:`paperline.kernels.tensor.p2t2f.Executor`.

    Args:
        client: a ``distributed.Client`` (inside a Prefect task: ``prefect_dask.get_dask_client()``).

    Raises:
        ServiceError: the cluster has no workers (after :func:`wait_for_cluster`).
        TimeoutError: a local cluster's workers did not all start in time (:func:`wait_for_cluster`).
        ClusterLost: the client lost its scheduler.
    """

    def __init__(self, client: Any):
        self.client = client
        wait_for_cluster(client)
        self.workers = scheduler_workers(client)
        if not self.workers:
            from paperline.infra.errors import ServiceError

            raise ServiceError("dask", "the cluster has no workers", url=str(client.scheduler.address))
        self._assigned: dict[str, str] = {}

    def place(self, items: Sequence[Any]) -> list[Any]:
        """Scatter item ``p`` to worker ``p mod W``; returns its future (the handle)."""
        handles = []
        for p, item in enumerate(items):
            worker = self.workers[p % len(self.workers)]
            fut = self.client.scatter(item, workers=[worker], hash=False)
            self._assigned[fut.key] = worker
            handles.append(fut)
        return handles

    def map(self, fn: Callable[..., Any], handles: Sequence[Any], args: Sequence[tuple]) -> list[Any]:
        """``fn(handle_i, *args_i)`` on the worker holding ``handle_i`` (only there), gathered in order;
        the first task's exception is raised here."""
        futures = [
            self.client.submit(fn, h, *a, workers=[self._assigned[h.key]], allow_other_workers=False, pure=False)
            for h, a in zip(handles, args)
        ]
        return self.client.gather(futures)


def wait_for_cluster(client: Any, timeout_s: float = 120.0) -> None:
    """Wait until every worker the client's own cluster asked for has registered.

    A flow's ``LocalCluster``/``LocalCUDACluster`` may still be starting workers when the first
    task runs; work placed then would use only the workers up so far. A client of an external
    scheduler (no cluster object) waits, without a time limit, until it has one worker, as its
    tasks would (``paperline run`` warned that it has none): the GEMM flow failed at once with
    "the Dask cluster has no workers", and was retried to fail again (a trial).

    Raises:
        TimeoutError: a local cluster's workers did not all start within ``timeout_s`` seconds.
    """
    spec = getattr(getattr(client, "cluster", None), "worker_spec", None)
    if spec:
        client.wait_for_workers(len(spec), timeout=timeout_s)
    elif not scheduler_workers(client):
        print(f"waiting for a worker to join the Dask scheduler at {client.scheduler.address} "
              "(`dask worker ADDRESS`, or your cluster's scaling)")
        client.wait_for_workers(1)


def flow_dask_client() -> Any | None:
    """The Dask client of the running flow's ``DaskTaskRunner`` (started on first use), else the
    process's default Dask client, else None.

    ``prefect_dask`` creates its cluster and client lazily, at the first ``.submit``: a flow whose
    first step drives the cluster itself must ask the runner, not ``distributed.get_client()``.
    """
    from distributed import get_client
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    runner = getattr(ctx, "task_runner", None) if ctx is not None else None
    if runner is not None and hasattr(runner, "client") and hasattr(runner, "cluster_kwargs"):
        return runner.client
    try:
        return get_client()
    except ValueError:
        return None


@contextmanager
def cluster_executor() -> Iterator[DaskExecutor | SerialExecutor]:
    """The executor for sub-problems launched by a task.

    In the flow's process with a ``DaskTaskRunner`` (the task called directly from the flow) this
    is a :class:`DaskExecutor` over the runner's client: the sub-problems run on every worker and
    no worker thread waits on them. (Launching them from a task running *on* a worker would need
    ``worker_client()``, whose secede breaks Prefect's result caching of that task: measured with
    prefect 3.9.1, such tasks are never Cached.) Anywhere else it is the in-process
    :class:`SerialExecutor`.
    """
    client = flow_dask_client()
    if client is None:
        yield SerialExecutor()
        return
    yield DaskExecutor(client)

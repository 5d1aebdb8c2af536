"""Tasks of the ``compressed-training`` pipeline: data-parallel ranks on the Dask workers, one rank
per worker, joined by a TCP rendezvous the task sets up; per-rank checkpoints in S3; restart of
every rank from the last common checkpoint when a rank or its worker dies.

The training task runs in the flow's process and drives the flow's Dask client (the pattern of
:mod:`paperline.tasks.executors`): it pins rank ``r`` to worker ``r`` and waits for all of them.
Its result is cached on the configuration and the kernels' sources, so re-running a finished flow
with the same code trains nothing again.
"""

from __future__ import annotations

import re
import time
from typing import Any

from prefect import task
from prefect.cache_policies import INPUTS, TASK_SOURCE

from paperline.infra.storage import ObjectStore
from paperline.kernels.errors import InputError, scheduler_workers
from paperline.kernels.train.ddp import TrainConfig, train_rank
from paperline.tasks.retry import HOUR
from paperline.tasks.versions import sources_sha256

_CKPT = re.compile(r"/rank-(\d+)/epoch-(\d+)\.pt$")


def kernel_version() -> str:
    """SHA-256 of the training and communication kernels' sources: part of the training task's
    cache key and of the checkpoint prefix, so changed code never reuses either."""
    return sources_sha256("paperline.kernels.comm", "paperline.kernels.train")


def checkpoint_uri(prefix: str, rank: int, epoch: int) -> str:
    """The object URI of ``rank``'s checkpoint after ``epoch``: ``<prefix>/rank-<rank>/epoch-<epoch:04d>.pt``."""
    return f"{prefix}/rank-{rank}/epoch-{epoch:04d}.pt"


def latest_common_epoch(store: ObjectStore, prefix: str, world_size: int) -> int | None:
    """The last epoch every rank has a checkpoint of under ``prefix`` (None: start from scratch)."""
    have: dict[int, set[int]] = {r: set() for r in range(world_size)}
    for uri in store.list(prefix + "/"):
        m = _CKPT.search(uri)
        if m and int(m.group(1)) in have:
            have[int(m.group(1))].add(int(m.group(2)))
    common = set.intersection(*have.values()) if have else set()
    return max(common) if common else None


def _free_port() -> tuple[str, int]:
    """Runs on a worker: its host (as the scheduler knows it) and a free TCP port there. Rank 0
    listens on that host and port only (:func:`paperline.kernels.train.ddp.process_group`): on a
    local cluster, 127.0.0.1."""
    import socket  # noqa: PLC0415

    from distributed import get_worker  # noqa: PLC0415

    host = get_worker().address.split("://", 1)[-1].rsplit(":", 1)[0]
    with socket.socket() as s:
        s.bind((host, 0))
        return host, s.getsockname()[1]


def _rank_main(rank: int, world_size: int, init_method: str, cfg: dict[str, Any], store: ObjectStore, prefix: str,
               resume_epoch: int | None, device: str, timeout_s: float, exit_at_step: int | None,
               collectives_sizes: list[int] | None = None) -> dict[str, Any]:
    """One rank on its worker: resume from its checkpoint, train, checkpoint every epoch to S3.

    The checkpoint is read from the bucket, so it is loaded with ``weights_only=True``
    (:func:`paperline.kernels.train.ddp.load_checkpoint`): one planted there that would run code is
    refused with an InputError naming its URI, which stops the task (no restart loads it again).
    """
    uri = checkpoint_uri(prefix, rank, resume_epoch) if resume_epoch is not None else None
    resume = store.get_bytes(uri) if uri is not None else None

    def save(epoch: int, data: bytes) -> None:
        store.put_bytes_to(data, checkpoint_uri(prefix, rank, epoch))

    return train_rank(rank, world_size, init_method, TrainConfig(**cfg), device=device, resume_bytes=resume,
                      save_checkpoint=save, timeout_s=timeout_s, threads=1 if device == "cpu" else None,
                      exit_at_step=exit_at_step, collectives_sizes=collectives_sizes,
                      resume_source=uri or "resume_bytes")


def _wait_first_error(futures: list[Any], poll_s: float = 0.2) -> BaseException | None:
    """Wait until every future finished (None) or one failed (its exception). Polls the futures'
    status (``distributed.wait`` needs a default client, which a flow's runner does not set)."""
    while True:
        states = [f.status for f in futures]
        for f, st in zip(futures, states):
            if st in ("error", "lost", "cancelled"):
                try:
                    return f.exception(timeout=10) or RuntimeError(f"rank future {st}")
                except Exception as exc:  # noqa: BLE001 - a cancelled/lost future may not hold one
                    return exc
        if all(st == "finished" for st in states):
            return None
        time.sleep(poll_s)


class RankFailed(RuntimeError):
    """A rank (or its worker) died or failed; every rank is restarted from the last checkpoint."""


# (said the local cluster's setting alone, also for a scheduler of the user's own: a trial)
ONE_RANK_PER_WORKER = ("one rank runs per worker: lower world_size, or give the cluster more workers "
                       "(PAPERLINE_N_WORKERS for the local cluster, default one per core; more `dask worker` "
                       "processes for a scheduler of your own)")
WORKER_RETURN_S = 60.0  # how long a restart waits for the workers a failure took (a nanny restarts one in ~1 s)


def rank_workers(client: Any, world_size: int, label: str, *, restart: bool,
                 wait_s: float = WORKER_RETURN_S) -> list[str]:
    """The addresses of the ``world_size`` Dask workers the ranks run on (one each, the first by
    address).

    On a restart after a failure, too few workers means the failure took one: the restart waits up
    to ``wait_s`` seconds for it to come back (a killed worker's nanny starts a new one within a
    second; the restart checked at once, refused itself as "world_size=2: larger than the number of
    Dask workers (1)", bad input, and the run failed: a trial).

    Raises:
        InputError: on the first attempt, more ranks than workers.
        RankFailed: on a restart, still too few workers after ``wait_s`` seconds.
    """
    workers = scheduler_workers(client)
    if world_size <= len(workers):
        return workers[:world_size]
    if not restart:
        raise InputError("world_size", world_size, f"larger than the number of Dask workers ({len(workers)}); "
                                                   + ONE_RANK_PER_WORKER)
    print(f"{label}: {len(workers)} of the {world_size} Dask workers the ranks need are left after the failure; "
          f"waiting up to {wait_s:.0f} s for the lost one(s) to come back")
    try:
        client.wait_for_workers(world_size, timeout=wait_s)
    except TimeoutError:
        now = len(scheduler_workers(client))
        raise RankFailed(f"{label}: a rank's Dask worker was lost and did not come back within {wait_s:.0f} s "
                         f"({now} of the {world_size} workers the ranks need): start another worker and run the "
                         "same command again, which resumes from the last checkpoint") from None
    return scheduler_workers(client)[:world_size]


@task(name="compressed-train", cache_policy=(INPUTS - "store" - "max_restarts" - "timeout_s") + TASK_SOURCE,
      persist_result=True, task_run_name="train-{label}", timeout_seconds=24 * HOUR)
def train_ranks(cfg: dict[str, Any], world_size: int, store: ObjectStore, prefix: str, device: str, label: str,
                timeout_s: float = 120.0, max_restarts: int = 2, crash_rank_at_step: int | None = None,
                collectives_sizes: list[int] | None = None, code_version: str = "") -> dict[str, Any]:
    """Train ``world_size`` ranks of one configuration to the end on the flow's Dask workers.

    Args:
        cfg: :class:`TrainConfig` fields.
        world_size: Ranks (one per worker).
        store: Object store for the checkpoints.
        prefix: ``s3://`` prefix of this configuration's checkpoints (``rank-<r>/epoch-<e>.pt``).
        device: ``cpu`` (gloo) or ``cuda`` (NCCL).
        label: Names the task run.
        timeout_s: Collective timeout of the ranks (how long a survivor waits for a dead peer).
        max_restarts: Restarts of all ranks after a failure before giving up.
        crash_rank_at_step: Drill: the last rank exits at this global step, in the first attempt only.
        collectives_sizes: Message sizes (bytes) of a Linear Pipelining vs backend allreduce sweep
            the ranks run after training (in ``ranks[r]["collectives"]``).
        code_version: :func:`kernel_version` (only part of the cache key).

    Returns:
        ``{"ranks": [train_rank results], "restarts", "resumed_from": [epoch or None per attempt],
        "failures": [messages], "flow_run": {"id", "name"}}``: the flow run that trained, which a
        result served from the task cache keeps.

    Raises:
        InputError: no Dask cluster (the flow runs without a ``DaskTaskRunner``), more ranks than
            workers, or bad configuration.
        RankFailed: still failing after ``max_restarts`` restarts, or a lost worker did not come
            back within :data:`WORKER_RETURN_S` seconds.
    """
    from paperline.tasks.executors import flow_dask_client, wait_for_cluster  # noqa: PLC0415

    client = flow_dask_client()
    if client is None:
        raise InputError("world_size", world_size, "no Dask cluster: the ranks run on the flow's Dask workers")
    failures: list[str] = []
    resumed: list[int | None] = []
    for attempt in range(max_restarts + 1):
        wait_for_cluster(client)
        chosen = rank_workers(client, world_size, label, restart=attempt > 0)
        host, port = client.submit(_free_port, workers=[chosen[0]], allow_other_workers=False, pure=False).result()
        resume_epoch = latest_common_epoch(store, prefix, world_size)
        resumed.append(resume_epoch)
        futures = [client.submit(_rank_main, r, world_size, f"tcp://{host}:{port}", cfg, store, prefix, resume_epoch,
                                 device, timeout_s,
                                 crash_rank_at_step if attempt == 0 and r == world_size - 1 else None,
                                 collectives_sizes,
                                 workers=[w], allow_other_workers=False, pure=False, retries=0,
                                 key=f"rank-{r}-{label}-{attempt}-{time.time_ns()}")
                   for r, w in enumerate(chosen)]
        error = _wait_first_error(futures)
        if error is None:
            from prefect.runtime import flow_run  # noqa: PLC0415

            # the flow run that trained: a later run served this result from the task cache tells
            # it apart from its own (`flow_run` below is None outside a flow run)
            return {"ranks": [f.result() for f in futures], "restarts": attempt, "resumed_from": resumed,
                    "failures": failures, "flow_run": {"id": str(flow_run.id or ""), "name": flow_run.name or ""}}
        for f in futures:
            f.cancel()
        if isinstance(error, InputError):
            raise error
        # with the drill armed, the first error seen is often a survivor's (gloo's "Connection reset
        # by peer"), which read as a real fault (a trial)
        drill = (f", with the crash drill armed (rank {world_size - 1} exits at global step {crash_rank_at_step})"
                 if attempt == 0 and crash_rank_at_step is not None else "")
        failures.append(f"attempt {attempt}{drill}: {type(error).__name__}: {error}"[:500])
        print(f"{label}: a rank failed ({failures[-1]}); restarting all {world_size} ranks from the last checkpoint")
    raise RankFailed(f"{label}: ranks failed {max_restarts + 1} times: " + " | ".join(failures))


def comparison_plots(runs: list[dict[str, Any]], directory: Any) -> list[Any]:
    """``accuracy_vs_bytes.png`` (test accuracy against cumulative payload bytes per rank) and
    ``accuracy_vs_time.png`` (against wall seconds), one line per compressor. ``runs``:
    ``{"name", "epochs": [epoch records]}``. Returns the paths written."""
    from pathlib import Path  # noqa: PLC0415

    from paperline.tasks.reporting import _plt  # noqa: PLC0415

    plt = _plt()
    out = []
    for fname, xlabel, xfn in (
        ("accuracy_vs_bytes.png", "bytes sent per rank (cumulative, MB)",
         lambda eps: [sum(e["bytes_sent_per_step"] * (e["steps"] - e["skipped_steps"]) for e in eps[: i + 1]) / 1e6
                      for i in range(len(eps))]),
        ("accuracy_vs_time.png", "wall seconds", lambda eps: [e["wall_s"] for e in eps]),
    ):
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        for r in runs:
            ax.plot(xfn(r["epochs"]), [e["test_accuracy_pct"] for e in r["epochs"]], marker="o", label=r["name"])
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy (%)")
        if "bytes" in fname:
            ax.set_xscale("log")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = Path(directory) / fname
        fig.savefig(path, dpi=90)
        plt.close(fig)
        out.append(path)
    return out


def bandwidth_plot(rows: list[dict[str, Any]], path: Any) -> Any:
    """``collectives_bandwidth.png``: algorithm and bus bandwidth (GB/s) against message size for
    the backend's allreduce and Linear Pipelining's, from
    :func:`paperline.kernels.comm.collectives.allreduce_sweep` rows."""
    from paperline.tasks.reporting import _plt  # noqa: PLC0415

    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    sizes = [r["bytes"] for r in rows]
    for impl, label in (("backend", "backend allreduce"), ("lp", "Linear Pipelining")):
        ax.plot(sizes, [r[impl]["algbw_bytes_per_s"] / 1e9 for r in rows], marker="o", label=f"{label} (algbw)")
        ax.plot(sizes, [r[impl]["busbw_bytes_per_s"] / 1e9 for r in rows], linestyle="--", label=f"{label} (busbw)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("GB/s")
    ax.set_title(f"allreduce, P = {rows[0]['world_size'] if rows else '?'}")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path

"""Tasks of the ``nas`` pipeline: cached evaluations on the workers, checkpoints in S3, MLflow
child runs and the campaign report.

An evaluation's cache key is (problem, problem options, point, seed) plus the task's source, so a
resumed campaign, or a second campaign proposing the same architecture, reuses the result instead
of training or looking it up again (an evaluation that timed out is not cached: it may pass
another time). The checkpoint holds the whole campaign state (JSON, one PUT
per batch, so a reader sees the previous or the new checkpoint, never half of one).
"""

from __future__ import annotations

import io
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from prefect import task
from prefect.cache_policies import INPUTS, TASK_SOURCE

from paperline.infra.storage import ObjectStore
from paperline.infra.tracking import Tracker
from paperline.kernels.errors import InputError
from paperline.kernels.search.campaign import Campaign, Evaluation, evaluate_point
from paperline.kernels.search.deadline import EvaluationTimeout
from paperline.kernels.search.problems import make_problem
from paperline.tasks import reporting
from paperline.tasks.retry import HOUR, retry_unless


@task(name="nas-evaluate", cache_policy=(INPUTS - "index" - "timeout_s") + TASK_SOURCE, persist_result=True,
      retries=1, retry_condition_fn=retry_unless(InputError, EvaluationTimeout), task_run_name="evaluate-{index}",
      timeout_seconds=HOUR)
def evaluate(problem: str, problem_options: dict[str, Any], x: list[float], seed: int, index: int,
             timeout_s: float | None = None) -> dict[str, Any]:
    """Evaluate one candidate on the worker (see :func:`evaluate_point`: failures are recorded,
    not raised), stopping past ``timeout_s`` seconds from its start here.

    A timeout is raised (:class:`EvaluationTimeout`, not retried), so that no result is cached
    for it: one busy moment would otherwise be kept for good, reused by a campaign started over
    or another proposing the point (a review). ``index`` only names the task run and
    ``timeout_s`` bounds it: neither is part of the cache key (a result is reused whatever the
    limit it finished within)."""
    return evaluate_point(make_problem(problem, **problem_options), x, seed, timeout_s=timeout_s, raise_timeout=True)


def load_checkpoint(store: ObjectStore, uri: str) -> dict[str, Any] | None:
    """The campaign checkpoint at ``uri``, or None when there is none.

    Raises:
        ValueError: the object is not JSON, or its JSON is not an object (a ``null`` one read as
            "no checkpoint", and the campaign started over, replacing it: a trial).
    """
    if not store.exists(uri):
        return None
    state = json.loads(store.get_bytes(uri))
    if not isinstance(state, dict):
        raise ValueError(f"its JSON is {type(state).__name__ if state is not None else 'null'}, not an object")
    return state


def save_checkpoint(store: ObjectStore, uri: str, state: dict[str, Any]) -> None:
    """Replace the checkpoint at ``uri`` with ``state`` (one PUT)."""
    store.put_bytes_to(json.dumps(state, allow_nan=False).encode(), uri)


def log_evaluations(tracker: Tracker, experiment: str, parent_run_id: str, campaign: Campaign,
                    new: list[Evaluation], tags: dict[str, str]) -> None:
    """One MLflow child run per evaluation (params: the candidate; metrics: its objective values
    and seconds; tags: batch, index, status and error), plus the parent's curves at step =
    number of samples."""
    names = [o.name for o in campaign.problem.objectives]
    for e in new:
        run_id = tracker.start_run(experiment, run_name=f"evaluation-{e.index:04d}", parent_run_id=parent_run_id,
                                   tags={**tags, "paperline.evaluation_index": str(e.index),
                                         "paperline.batch": str(e.batch),
                                         "paperline.status": "ok" if e.ok else "failed",
                                         **({"paperline.error": e.error} if e.error else {})},
                                   params={**e.params, "x": json.dumps(e.x)})
        metrics = {"evaluation_s": e.seconds}
        if e.values is not None:
            metrics.update(dict(zip(names, e.values)))
        tracker.log_metrics(run_id, metrics)
        tracker.end_run(run_id, "FINISHED" if e.ok else "FAILED")
    steps = []
    # hypervolume, or the best value so far in the objective's own units and sign
    trace = campaign.score_trace() if campaign.problem.n_objectives > 1 else campaign.best_trace()
    for e in new:
        value = float(trace[e.index])
        if np.isfinite(value):
            key = "hypervolume" if campaign.problem.n_objectives > 1 else f"best.{names[0]}"
            steps.append((e.index + 1, {key: value}))
    if campaign.suggest_seconds:
        steps.append((len(campaign.suggest_seconds), {"suggest_s": campaign.suggest_seconds[-1]}))
    steps.append((campaign.n_done, {"failed_evaluations": float(sum(not e.ok for e in campaign.evaluations))}))
    tracker.log_metric_steps(parent_run_id, steps)


def evaluations_table(campaign: Campaign) -> list[dict[str, Any]]:
    """One row per evaluation: index, batch, status, error, seconds, the candidate's parameters,
    its objective values (user units) and whether it is on the Pareto front."""
    names = [o.name for o in campaign.problem.objectives]
    front = {e.index for e in campaign.pareto_front()}
    rows = []
    for e in campaign.evaluations:
        row: dict[str, Any] = {"index": e.index, "batch": e.batch, "status": "ok" if e.ok else "failed",
                               "error": e.error, "seconds": e.seconds, "pareto": e.index in front}
        row.update({f"param.{k}": str(v) for k, v in e.params.items()})
        row.update({n: (None if e.values is None else e.values[i]) for i, n in enumerate(names)})
        rows.append(row)
    return rows


def render_report(campaign: Campaign, title: str) -> dict[str, bytes]:
    """The campaign's artifacts: ``pareto_front.png`` (multi-objective), ``hypervolume.png`` or
    ``best_so_far.png``, ``partition_tree.json`` and ``partition_tree.png`` (optimizers with a tree),
    ``evaluations.parquet``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    names = [o.name for o in campaign.problem.objectives]
    out: dict[str, bytes] = {}
    tree = campaign.optimizer.tree()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        ok = [e for e in campaign.evaluations if e.ok]
        if campaign.problem.n_objectives > 1:
            values = np.array([e.values for e in ok]) if ok else np.zeros((0, len(names)))
            front = np.array([e.values for e in campaign.pareto_front()]) if ok else np.zeros((0, len(names)))
            reporting.pareto_plot(values, front, names, title, d / "pareto_front.png")
            reporting.trace_plot(campaign.hypervolume_trace(), "hypervolume", title, d / "hypervolume.png")
        else:
            reporting.trace_plot(campaign.best_trace(), f"best {names[0]}", title, d / "best_so_far.png")
        if tree is not None:  # optimizers with a tree: the partition-based ones and AlphaX
            reporting.tree_plot(tree, f"{title}: {campaign.optimizer.name} tree", d / "partition_tree.png")
        for p in d.iterdir():
            out[p.name] = p.read_bytes()
    if tree is not None:
        out["partition_tree.json"] = json.dumps(tree, indent=1, default=float).encode()
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(evaluations_table(campaign)), buf)
    out["evaluations.parquet"] = buf.getvalue()
    return out

"""Every pipeline task has a retry policy that retries what may be transient but never bad input,
a failed verification or a timeout, and a time limit, which Prefect enforces on a Dask worker
thread too (between Python steps)."""

import importlib
import logging

import pytest
from prefect import Task
from prefect.task_engine import TaskRunTimeoutError

from paperline.kernels.errors import InputError
from paperline.tasks.gemm import VerificationError
from paperline.tasks.retry import retry_unless, retry_unless_bad_input

MODULES = ["paperline.tasks.gemm", "paperline.tasks.nas", "paperline.tasks.tensor", "paperline.tasks.video",
           "paperline.tasks.training"]
OWN_RESTARTS = {"compressed-train"}  # restarts its ranks from their checkpoints itself


def all_tasks():
    return [(m, name, obj) for m in MODULES for name, obj in vars(importlib.import_module(m)).items()
            if isinstance(obj, Task)]


def test_every_task_retries_once_and_has_a_time_limit():
    found = all_tasks()
    assert len(found) >= 15  # 5 gemm, 1 nas, 5 tensor, 3 video, 1 training (and any new one)
    for module, name, t in found:
        assert t.retries >= 1 or t.name in OWN_RESTARTS, (module, name)
        assert t.timeout_seconds and t.timeout_seconds > 0, (module, name)


@pytest.mark.stack
def test_a_task_past_its_time_limit_on_a_dask_worker_is_stopped_and_not_retried(stack, tmp_path):
    """The limit interrupts the task's loop on the worker thread (it does not run on unseen), the
    run ends TimedOut without a retry, and Prefect's per-run warning about worker threads is dropped."""
    import time

    from prefect import flow, task
    from prefect_dask import DaskTaskRunner

    import paperline.tasks  # noqa: F401 - installs the warning filter
    from paperline.tasks.retry import retry_unless_bad_input

    beats = tmp_path / "beats"

    @task(timeout_seconds=1.5, retries=1, retry_condition_fn=retry_unless_bad_input)
    def slow() -> None:
        for _ in range(300):  # 30 s unless stopped
            with open(beats, "a") as f:
                f.write("x")
            time.sleep(0.1)

    @flow(task_runner=DaskTaskRunner(cluster_kwargs={"n_workers": 1, "threads_per_worker": 1, "processes": False}))
    def one() -> tuple[str, str]:
        fut = slow.submit()
        fut.wait()
        return fut.state.name, fut.state.message

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("prefect.task_runs")
    logger.addHandler(handler)
    try:
        name, message = one()
    finally:
        logger.removeHandler(handler)
    assert name == "TimedOut" and "exceeded timeout of 1.5 second(s)" in message, (name, message)
    assert any("exceeded timeout" in m for m in seen) and not any("worker thread" in m for m in seen), seen
    written = beats.read_text()
    time.sleep(1.0)
    assert beats.read_text() == written, "the task went on after its time limit"
    assert 5 <= len(written) <= 40  # ~15 beats in 1.5 s, one attempt only (no retry)


class _State:
    def __init__(self, exc):
        self.exc = exc

    def result(self):
        if self.exc is not None:
            raise self.exc
        return 1


@pytest.mark.parametrize(("exc", "retry"), [(ConnectionError("S3 reset"), True), (TimeoutError(), True),
                                            (InputError("x", 1, "bad"), False), (None, False),
                                            (TaskRunTimeoutError("past its limit"), False)])
def test_retry_unless_bad_input(exc, retry):
    assert retry_unless_bad_input(None, None, _State(exc)) is retry


def test_a_failed_verification_is_not_retried():
    condition = retry_unless(InputError, VerificationError)
    assert condition(None, None, _State(VerificationError("residual too large"))) is False
    assert condition(None, None, _State(OSError("disk hiccup"))) is True

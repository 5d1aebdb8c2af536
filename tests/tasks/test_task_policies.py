"""Every pipeline task has a retry policy that retries what may be transient but never bad input
or a failed verification. (No task sets Prefect's timeout_seconds: it cannot interrupt a task on a
Dask worker thread; the nas flow keeps its evaluations' time limit itself, tests/flows/test_nas.py.)"""

import importlib

import pytest
from prefect import Task

from paperline.kernels.errors import InputError
from paperline.tasks.gemm import VerificationError
from paperline.tasks.retry import retry_unless, retry_unless_bad_input

MODULES = ["paperline.tasks.gemm", "paperline.tasks.nas", "paperline.tasks.tensor"]


def all_tasks():
    return [(m, name, obj) for m in MODULES for name, obj in vars(importlib.import_module(m)).items()
            if isinstance(obj, Task)]


def test_every_task_retries_once():
    found = all_tasks()
    assert len(found) >= 11  # 5 gemm, 1 nas, 5 tensor (and any new one)
    for module, name, t in found:
        assert t.retries >= 1, (module, name)
        assert t.timeout_seconds is None, (module, name)  # it would only warn on a Dask worker thread


class _State:
    def __init__(self, exc):
        self.exc = exc

    def result(self):
        if self.exc is not None:
            raise self.exc
        return 1


@pytest.mark.parametrize(("exc", "retry"), [(ConnectionError("S3 reset"), True), (TimeoutError(), True),
                                            (InputError("x", 1, "bad"), False), (None, False)])
def test_retry_unless_bad_input(exc, retry):
    assert retry_unless_bad_input(None, None, _State(exc)) is retry


def test_a_failed_verification_is_not_retried():
    condition = retry_unless(InputError, VerificationError)
    assert condition(None, None, _State(VerificationError("residual too large"))) is False
    assert condition(None, None, _State(OSError("disk hiccup"))) is True

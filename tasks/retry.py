"""Retry policy shared by the pipelines' tasks: retry what may be transient (an S3 hiccup, a
lost worker), never bad input or a failed check, which would fail the same way again."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paperline.kernels.errors import InputError


def retry_unless(*permanent: type[BaseException]) -> Callable[[Any, Any, Any], bool]:
    """A Prefect ``retry_condition_fn`` that retries unless the task raised one of ``permanent``."""

    def condition(task: Any, task_run: Any, state: Any) -> bool:
        try:
            state.result()
        except permanent:
            return False
        except Exception:  # noqa: BLE001 - anything else may be transient
            return True
        return False

    condition.__name__ = "retry_unless_" + "_".join(t.__name__ for t in permanent)
    return condition


retry_unless_bad_input = retry_unless(InputError)

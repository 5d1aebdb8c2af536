"""Prefect's ``@flow`` for paperline's pipelines: called from Python before the process points at
the stack, a pipeline flow is refused at once.

Without ``PREFECT_API_URL`` Prefect starts a temporary server of its own for the run (about 14 s
here, plus its failed telemetry call), and the flow was refused only once it ran there, naming
:func:`paperline.infra.stack.connect` after a page of Prefect's logs (a trial). The check here
runs before Prefect does anything. A flow called inside another flow run, or a deployment's run
(Prefect's runner sets the URL), is unaffected.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefect import Flow

from paperline.infra.errors import PaperlineError


class PipelineFlow(Flow):
    """A Prefect :class:`~prefect.Flow` whose call is refused while ``PREFECT_API_URL`` is unset.

    Raises:
        PaperlineError: when called with no Prefect API URL set (env, profile or
            :func:`paperline.infra.stack.connect`) outside a flow run, naming ``connect()``.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from prefect.context import FlowRunContext  # noqa: PLC0415
        from prefect.settings import PREFECT_API_URL  # noqa: PLC0415

        if PREFECT_API_URL.value() is None and FlowRunContext.get() is None:
            raise PaperlineError(f"flow {self.name!r}: PREFECT_API_URL is not set, so Prefect would run it on a "
                                 "temporary server of its own (its run and cached results gone when the process "
                                 "ends); from Python, call paperline.infra.stack.connect() before the flow (in a "
                                 "shell: eval \"$(paperline env)\")")
        return super().__call__(*args, **kwargs)


def pipeline_flow(**options: Any) -> Callable[[Callable[..., Any]], PipelineFlow]:
    """``@pipeline_flow(name=..., ...)``: Prefect's ``@flow(...)`` (same options), making a
    :class:`PipelineFlow`."""
    def decorate(fn: Callable[..., Any]) -> PipelineFlow:
        return PipelineFlow(fn=fn, **options)

    return decorate

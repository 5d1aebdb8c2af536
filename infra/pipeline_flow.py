"""Prefect's ``@flow`` for paperline's pipelines: called from Python before the process points at
the stack, a pipeline flow is refused at once.

Without ``PREFECT_API_URL`` Prefect starts a temporary server of its own for the run (about 14 s
here, plus its failed telemetry call), and the flow was refused only once it ran there, naming
:func:`paperline.infra.stack.connect` after a page of Prefect's logs (a trial). The check here
runs before Prefect does anything. A flow called inside another flow run, or a deployment's run
(Prefect's runner sets the URL), is unaffected.

Each run of the flow's function is watched (:func:`paperline.infra.watch.flow_run_watch`): a
deployment's run whose stack servers die fails at once on the dead server instead of retrying it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

from prefect import Flow

from paperline.infra.errors import PaperlineError


class PipelineFlow(Flow):
    """A Prefect :class:`~prefect.Flow` whose call is refused while ``PREFECT_API_URL`` is unset.

    Its ``fn`` runs under :func:`paperline.infra.watch.flow_run_watch` (Prefect's engine calls
    ``fn``, in `paperline run`, a deployment's run and a script alike; ``with_options`` copies it).

    Raises:
        PaperlineError: when called with no Prefect API URL set (env, profile or
            :func:`paperline.infra.stack.connect`) outside a flow run, naming ``connect()``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # (Prefect's version hash and source come from the function itself)
        self.fn = _watched(self.fn)
        # the serve/worker log's one line for a refused run and Prefect's patches, which the
        # built-in flows get by importing their tasks: a package's flow (README, "Your own
        # pipeline") logged two tracebacks for an InputError (a trial)
        import paperline.tasks  # noqa: F401, PLC0415

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from prefect.context import FlowRunContext  # noqa: PLC0415
        from prefect.settings import PREFECT_API_URL  # noqa: PLC0415

        if PREFECT_API_URL.value() is None and FlowRunContext.get() is None:
            raise PaperlineError(f"flow {self.name!r}: PREFECT_API_URL is not set, so Prefect would run it on a "
                                 "temporary server of its own (its run and cached results gone when the process "
                                 "ends); from Python, call paperline.infra.stack.connect() before the flow (in a "
                                 "shell: eval \"$(paperline env)\")")
        return super().__call__(*args, **kwargs)

    def validate_parameters(self, parameters: dict[str, Any]) -> dict[str, Any]:
        """Prefect's validation, after building each parameter whose annotation is a pydantic
        model (a pipeline's ``params``) from the JSON object a deployment's run receives.

        A value its model's validators refuse (``memory_budget="lots"``, ``a="s3:/x.npy"``) passes
        Prefect's JSON schema when the run is created, and then failed as it started with
        Prefect's raw list of pydantic errors, a ``ParameterTypeError`` traceback in the serve or
        worker log, and a state message that did not name the value (a trial).

        A model instance (a flow called from Python) is checked again too, its fields as they are
        now: one changed after it was built (``params.m = True``, ``model_copy(update=...)``,
        ``model_construct``) ran unchecked (a trial's GEMM of one row); the instance checked is
        passed on with the fields it was given and its private state.

        Raises:
            InputError: naming the field and the value seen, as the CLI's ``--set`` does (one
                line in the logs: an expected error).
        """
        import inspect  # noqa: PLC0415
        import typing  # noqa: PLC0415

        from pydantic import BaseModel, ValidationError  # noqa: PLC0415

        from paperline.infra.errors import input_error_from  # noqa: PLC0415

        signature = inspect.signature(self.fn)
        built = dict(parameters)
        for name, value in parameters.items():
            if not isinstance(value, dict | BaseModel) or name not in signature.parameters:
                continue
            annotation = signature.parameters[name].annotation
            models = [a for a in (typing.get_args(annotation) or (annotation,))
                      if isinstance(a, type) and issubclass(a, BaseModel)]
            if len(models) != 1 or (isinstance(value, BaseModel) and not isinstance(value, models[0])):
                continue
            try:
                if isinstance(value, dict):
                    built[name] = models[0].model_validate(value)
                else:  # its fields as they are now, through its own class's validators
                    checked = type(value).model_validate({**{f: getattr(value, f) for f in type(value).model_fields
                                                              if hasattr(value, f)}, **(value.model_extra or {})})
                    checked.__pydantic_fields_set__ = set(value.model_fields_set)
                    if value.__pydantic_private__ is not None:
                        checked.__pydantic_private__ = dict(value.__pydantic_private__)
                    built[name] = checked
            except ValidationError as exc:
                raise input_error_from(exc, lambda loc: ".".join(map(str, loc)) or name) from None
        return super().validate_parameters(built)


def pipeline_flow(**options: Any) -> Callable[[Callable[..., Any]], PipelineFlow]:
    """``@pipeline_flow(name=..., ...)``: Prefect's ``@flow(...)`` (same options), making a
    :class:`PipelineFlow`."""
    def decorate(fn: Callable[..., Any]) -> PipelineFlow:
        return PipelineFlow(fn=fn, **options)

    return decorate


def _watched(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run under :func:`paperline.infra.watch.flow_run_watch`."""
    if getattr(fn, "_paperline_watched", False):
        return fn

    def run(*args: Any, **kwargs: Any) -> Any:
        from paperline.infra.watch import flow_run_watch  # noqa: PLC0415

        with flow_run_watch():
            result = fn(*args, **kwargs)
        log_summary(fn.__name__.replace("_", "-"), result)
        return result

    run._paperline_watched = True  # type: ignore[attr-defined]
    return wrapped_like(fn, run)


def log_summary(name: str, summary: Any) -> None:
    """In a deployment's run (its own process, started by `paperline serve` or a Prefect worker),
    log the flow's summary (:func:`paperline.infra.summary.summary_text`) to the flow run, where
    the Prefect UI and the serve or worker terminal show it: a deployment run that resumed from
    checkpoints, or whose results came from the task cache, said so nowhere (a trial). `paperline
    run` prints the same summary itself, so nothing is logged there."""
    import os  # noqa: PLC0415

    from paperline.infra.flow_runs import FLOW_RUN_ENV  # noqa: PLC0415

    if not os.environ.get(FLOW_RUN_ENV) or not isinstance(summary, dict):
        return
    from prefect.logging import get_run_logger  # noqa: PLC0415

    from paperline.infra.summary import summary_text  # noqa: PLC0415

    try:
        logger = get_run_logger()
    except Exception:  # noqa: BLE001 - (no run context: a flow called from a script in that process)
        return
    try:
        text = summary_text(name, summary)
    except Exception as exc:  # noqa: BLE001 - the run's work is done and tracked: saying it must not fail it
        logger.warning("%s summary could not be shown (%s: %s); it is in the flow run's result and MLflow",
                       name, type(exc).__name__, exc)
        return
    if text:
        logger.info("%s summary:\n%s", name, text)


def wrapped_like(fn: Callable[..., Any], wrapper: Callable[..., Any]) -> Callable[..., Any]:
    """``wrapper`` (which calls ``fn``, a flow's function) dressed as ``fn`` for Prefect: name,
    docstring, ``__wrapped__`` and the signature and annotations evaluated in ``fn``'s module.
    The flows' annotations are text (``from __future__ import annotations``), and Prefect's
    parameter validation read them in the wrapper's module: a deployment's run failed with
    "`NasModel` is not fully defined" (a trial; `paperline run`'s ``GemmParameters`` likewise)."""
    import inspect  # noqa: PLC0415
    import typing  # noqa: PLC0415

    functools.update_wrapper(wrapper, fn)
    with contextlib.suppress(NameError, TypeError):
        wrapper.__signature__ = inspect.signature(fn, eval_str=True)  # type: ignore[attr-defined]
        wrapper.__annotations__ = typing.get_type_hints(fn)
    return wrapper

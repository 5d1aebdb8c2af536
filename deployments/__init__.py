"""The deployments of paperline's pipelines.

Two sets, with the same parameters and schedules (``flows/pipelines.py``: each pipeline's
``cron`` and ``deployment_params``; ``tests/test_layout.py`` checks they agree):

- ``<flow>/local``, one per pipeline, built here by :func:`local_deployments` and served by
  ``paperline serve`` from its own process (no work pool; one machine);
- ``<flow>/<flow>``, one per pipeline in ``prefect.yaml``, for ``prefect deploy --all`` against
  the stack, executed by ``paperline worker --pool cpu|gpu`` (work pools ``paperline-cpu`` and
  ``paperline-gpu``, made by ``paperline up``).
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def local_deployments(data_bucket: str, existing: dict[str, Any] | None = None,
                      say: Callable[[str], None] | None = None, paused: Collection[str] = ()) -> list[Any]:
    """The ``<flow>/local`` deployment of every pipeline, as `paperline serve` serves them.

    Args:
        data_bucket: the stack's data bucket, for the parameters that name S3 locations.
        existing: the ``"<flow>/local"`` deployments that exist on the Prefect server already
            (Prefect ``DeploymentResponse``), by name: each is registered again with its schedules
            as they are there (a schedule paused, edited, added or removed in the Prefect UI
            outlives a restart of serve) and its parameters where they are valid for the
            pipeline (:func:`served_parameters`); the others get the pipeline's own (UTC cron,
            slug ``<pipeline>-schedule``; ``deployment_params``).
        say: called with a line for each deployment whose parameters are not the pipeline's
            own: kept from the server, or replaced as no longer valid.
        paused: the ``"<flow>/local"`` deployments to register paused, as a user left them in the
            Prefect UI (:func:`paused_by_user`); the others are served unpaused.

    Returns:
        One Prefect ``RunnerDeployment`` per pipeline that loads (``serve`` names those that
        do not), in name order: the flow run by module path,
        one run at a time (``concurrency_limit=1``), tagged ``paperline`` and the pipeline's name.
    """
    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.deployments.runner import EntrypointType
    from prefect.schedules import Cron

    from paperline.flows.pipelines import loadable_pipelines

    deployments = []
    for spec in loadable_pipelines()[0]:  # (a package's pipeline that cannot be loaded is left out)
        name, full = spec.name, f"{spec.flow.name}/local"
        there = (existing or {}).get(full)
        if there is not None:
            # sent back as they are, each with its slug (or none): Prefect replaces a deployment's
            # schedules with those sent, and none sent ([]) deleted them all
            schedules = [DeploymentScheduleCreate(schedule=s.schedule, active=s.active, slug=s.slug,
                                                  parameters=s.parameters, max_scheduled_runs=s.max_scheduled_runs)
                         for s in there.schedules]
            parameters, note = served_parameters(spec, there.parameters, data_bucket)
            if note and say:
                say(f"{full}: {note}")
        else:
            schedules = [Cron(spec.cron, timezone="UTC", slug=f"{name}-schedule")] if spec.cron else []
            parameters = spec.deployment_params(data_bucket)
        deployments.append(spec.flow.to_deployment(  # "<flow>/local": apart from prefect.yaml's work-pool ones
            name="local", description=spec.description or None, tags=["paperline", name],
            schedules=schedules or None, parameters=parameters, paused=True if full in paused else None,
            concurrency_limit=1, entrypoint_type=EntrypointType.MODULE_PATH))
    return deployments


def served_parameters(spec: Any, there: dict[str, Any] | None, data_bucket: str) -> tuple[dict[str, Any], str | None]:
    """The parameters a served deployment gets: ``there``, those it has on the Prefect server (the
    Prefect UI's "Edit" sets them; a restart of serve put the pipeline's own back, unsaid), where
    they are ``{"params": {...}}`` valid for the pipeline's model, else the pipeline's own
    (``spec.deployment_params``: a paperline whose model changed since).

    Returns:
        The parameters, and a line saying which fields differ from the pipeline's own (kept) or why
        they were replaced; None when they are the pipeline's own.
    """
    from paperline.flows.pipelines import deployment_values, validation_problem  # noqa: PLC0415

    own = spec.deployment_params(data_bucket)
    there = there or {}
    if there == own:
        return own, None
    values = deployment_values(there)
    if values is None:
        return own, f"its parameters on the Prefect server are not {{\"params\": {{...}}}}; the pipeline's own are served"
    problem = validation_problem(spec.parameters, values)
    if problem is not None:
        return own, (f"its parameters on the Prefect server are not valid for this pipeline ({problem}); "
                     "the pipeline's own are served")
    kept = spec.parameters.model_validate(values)
    mine = spec.parameters.model_validate(own.get("params", {}))
    changed = [f"{k}={getattr(kept, k)!r}" for k in type(kept).model_fields if getattr(kept, k) != getattr(mine, k)]
    if not changed:
        return there, None
    return there, f"parameters as set on the Prefect server, not the pipeline's own: {', '.join(changed)}"


SERVED_PAUSES = "serve-paused.json"  # in the state directory: see paused_by_user


@dataclass(frozen=True)
class ServePauses:
    """The record `paperline serve` keeps in its state directory (:func:`record_serve_pauses`), as
    :func:`read_serve_pauses` found it: read once per command, for :func:`paused_by_user` and
    :func:`polled_by_stopped_serve` (each read the file again, once per deployment).

    Attributes:
        path: the record's file.
        paused_by_serve: the deployment ids (text) serve paused as it last stopped, or serves
            unpaused now; None where there is no record or it is unreadable.
        stopped_at: when serve last stopped polling (aware), or None (a serving one's record, none).
        problem: why the record is unreadable (``"ValueError: ..."``), or None.
    """

    path: Path
    paused_by_serve: frozenset[str] | None = None
    stopped_at: datetime.datetime | None = None
    problem: str | None = None


def read_serve_pauses(state_dir: Path) -> ServePauses:
    """Read ``state_dir``'s :data:`SERVED_PAUSES` record; a missing one is an empty
    :class:`ServePauses`, an unreadable one (not JSON, no ``paused_by_serve`` list, a bad
    ``stopped_at``) one with ``problem`` set. Never raises for the file's content or absence."""
    path = Path(state_dir) / SERVED_PAUSES
    try:
        record = json.loads(path.read_text())
        ids = frozenset(str(i) for i in record["paused_by_serve"])
        stopped = record.get("stopped_at")
        stopped_at = None if stopped is None else datetime.datetime.fromisoformat(stopped)
        if stopped_at is not None and stopped_at.tzinfo is None:
            raise ValueError(f"stopped_at {stopped!r} has no time zone")
    except FileNotFoundError:
        return ServePauses(path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return ServePauses(path, problem=f"{type(exc).__name__}: {exc}")
    return ServePauses(path, ids, stopped_at)


def paused_by_user(record: ServePauses, existing: dict[str, Any], say: Callable[[str], None] | None = None) -> list[str]:
    """The deployments among ``existing`` (Prefect ``DeploymentResponse`` by ``"<flow>/local"``)
    that a user paused (the deployment's own toggle in the Prefect UI), which the next `paperline
    serve` keeps paused: Prefect's runner unpaused every deployment it served, and pauses every
    one as it stops, so a user's pause was undone by a restart of serve (a trial).

    Told apart by the record serve keeps (``record``, :func:`read_serve_pauses`): the ids
    of the deployments serve itself paused as it last stopped, or meant to serve unpaused where it
    never stopped (killed outright: its deployments stay unpaused, and a user's pause made during
    that serve is undone). A deployment paused and not in the record is the user's. With no record
    (a first serve, or one of a paperline before this record) or an unreadable one, none is;
    ``say`` is called with a line naming an unreadable one.

    Returns:
        Their names, sorted.
    """
    if record.paused_by_serve is None:
        if record.problem is not None and say is not None and any(d.paused for d in existing.values()):
            say(f"{record.path} is unreadable ({record.problem}): every paused deployment is served unpaused, "
                "one paused in the Prefect UI too")
        return []
    return sorted(name for name, d in existing.items() if d.paused and str(d.id) not in record.paused_by_serve)


def record_serve_pauses(state_dir: Path, ids: Iterable[str], add: bool = False,
                        stopped_at: datetime.datetime | None = None) -> None:
    """Write (or, with ``add``, extend) the record :func:`paused_by_user` reads: the ids of
    deployments serve paused (or serves unpaused now), replaced atomically (a reader never sees
    half of it); with ``stopped_at`` (aware), the time serve stopped polling, which
    :func:`polled_by_stopped_serve` uses (a record written without it is a serving one's).
    Errors propagate (``OSError``)."""
    path = Path(state_dir) / SERVED_PAUSES
    ids = {str(i) for i in ids}
    if add:
        ids |= read_serve_pauses(state_dir).paused_by_serve or set()
    record: dict[str, Any] = {"paused_by_serve": sorted(ids)}
    if stopped_at is not None:
        record["stopped_at"] = stopped_at.isoformat()
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        part.write_text(json.dumps(record) + "\n")
        os.replace(part, path)
    except OSError:
        part.unlink(missing_ok=True)  # (left beside the record: a trial)
        raise


STOP_CLOCK_SLACK_S = 2.0  # a poll stamped this much after serve's own stop time is still taken for its own


def polled_by_stopped_serve(record: ServePauses, last_polled: datetime.datetime | None) -> bool:
    """Whether a deployment's ``last_polled`` (the Prefect server's time) is no later than the
    stop of this state directory's last `paperline serve` (``record.stopped_at``): that serve's own
    poll, not another process's. Resumed in the Prefect UI right after serve stopped, a deployment
    read as served elsewhere for 30 s: `serve` refused to start and `status` said a serving
    process had it (a trial)."""
    if last_polled is None or record.stopped_at is None:
        return False
    return (last_polled - record.stopped_at).total_seconds() <= STOP_CLOCK_SLACK_S

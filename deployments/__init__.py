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

from typing import Any


def local_deployments(data_bucket: str, existing: dict[str, list[Any]] | None = None) -> list[Any]:
    """The ``<flow>/local`` deployment of every pipeline, as `paperline serve` serves them.

    Args:
        data_bucket: the stack's data bucket, for the parameters that name S3 locations.
        existing: the schedules (Prefect ``DeploymentSchedule``) of the ``"<flow>/local"``
            deployments that exist on the Prefect server already, by name: each is registered
            again as it is there (a schedule paused, edited, added or removed in the Prefect UI
            outlives a restart of serve); the others get the pipeline's (UTC cron, slug
            ``<pipeline>-schedule``).

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
        name = spec.name
        if f"{spec.flow.name}/local" in (existing or {}):
            # sent back as they are, each with its slug (or none): Prefect replaces a deployment's
            # schedules with those sent, and none sent ([]) deleted them all
            schedules = [DeploymentScheduleCreate(schedule=s.schedule, active=s.active, slug=s.slug,
                                                  parameters=s.parameters, max_scheduled_runs=s.max_scheduled_runs)
                         for s in existing[f"{spec.flow.name}/local"]]
        else:
            schedules = [Cron(spec.cron, timezone="UTC", slug=f"{name}-schedule")] if spec.cron else []
        deployments.append(spec.flow.to_deployment(  # "<flow>/local": apart from prefect.yaml's work-pool ones
            name="local", description=spec.description or None, tags=["paperline", name],
            schedules=schedules or None, parameters=spec.deployment_params(data_bucket),
            concurrency_limit=1, entrypoint_type=EntrypointType.MODULE_PATH))
    return deployments

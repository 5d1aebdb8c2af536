"""paperline: systems papers as Prefect flows on Dask, tracked in MLflow, with artifacts in S3.

The repository root is the ``paperline`` package (see ``pyproject.toml``):
``paperline.kernels`` (pure numerics), ``paperline.tasks`` (cached Prefect tasks),
``paperline.flows`` (flows and the CLI), ``paperline.infra`` (settings, local stack, cluster,
storage, tracking) and ``paperline.deployments``.
"""

__version__ = "0.1.0"

import os as _os

# MLflow's telemetry is on unless MLFLOW_DISABLE_TELEMETRY or DO_NOT_TRACK is "true" (the "1" set
# for Prefect does not count): it sends usage data off the machine, and when its background fetch
# fails it removes an environment variable (_MLFLOW_TELEMETRY_SESSION_ID) while an MLflow request
# may be iterating os.environ (urllib's proxy lookup), which then fails with that KeyError: a flow
# run failed so, "log-batch failed with exception '_MLFLOW_TELEMETRY_SESSION_ID'" (1 in 13 cached
# video re-runs, 2026-12-04). Set before anything imports mlflow; children inherit it.
_os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

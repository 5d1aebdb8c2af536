"""paperline: systems papers as Prefect flows on Dask, tracked in MLflow, with artifacts in S3.

The repository root is the ``paperline`` package (see ``pyproject.toml``):
``paperline.kernels`` (pure numerics), ``paperline.tasks`` (cached Prefect tasks),
``paperline.flows`` (flows and the CLI), ``paperline.infra`` (settings, local stack, cluster,
storage, tracking) and ``paperline.deployments``.
"""

__version__ = "0.1.0"

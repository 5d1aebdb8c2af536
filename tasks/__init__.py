"""Prefect tasks of the pipelines (imported on the Dask workers when a task arrives)."""

from paperline.infra import prefect_patches
from paperline.infra.errors import quiet_expected_tracebacks
from paperline.tasks.retry import quiet_thread_timeout_warning

quiet_thread_timeout_warning()
quiet_expected_tracebacks()  # a run refused for its input is one line in the serve/worker log too
prefect_patches.install()  # in the flow's process and on every worker (a worker preload)

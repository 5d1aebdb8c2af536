"""Prefect tasks of the pipelines (imported on the Dask workers when a task arrives)."""

from paperline.tasks.retry import quiet_thread_timeout_warning

quiet_thread_timeout_warning()

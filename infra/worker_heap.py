"""Dask worker preload, first in ``WORKER_PRELOAD`` (``infra/cluster.py``): the worker's start-up
imports made with the cyclic collector off, and frozen (``infra/heap.py``) once they are done.

Dask imports every preload module as the worker is built, then calls their ``dask_setup`` hooks
in order as it starts; this module's import turns automatic collection off, so the preloads after
it (Prefect's task engine, paperline's tasks) import without full collections walking the growing
heap, and its :func:`dask_setup` freezes that heap and turns collection back on before the worker
takes a task. Measured with the flow process's change (2026-12-05): see ``infra/heap.py``.
"""

from __future__ import annotations

from typing import Any

from paperline.infra import heap

_PAUSED = heap.paused_for_startup()
_PAUSED.__enter__()  # (left by dask_setup; a worker that fails before it exits anyway)


def dask_setup(worker: Any) -> None:
    """Dask preload hook: freeze the heap the preloads built and turn collection back on."""
    heap.freeze_startup()
    _PAUSED.__exit__(None, None, None)

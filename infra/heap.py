"""The garbage collector's cost in a `paperline run` and a Dask worker: start-up heap frozen.

A `paperline run` imports Prefect, pydantic, MLflow, boto3, Dask and the pipeline's numerics:
a heap of millions of objects that live as long as the process. CPython's cyclic collector
walks all of them on each full (generation-2) collection, and the allocations of start-up and
of each task (pydantic models, JSON: botocore's 1.2 MB ``endpoints.json`` for each new boto3
session) set off such collections over and over. Measured on this 2-core machine (gc callbacks
timing each collection's thread CPU, a cached ``paperline run tensor-factorization`` on two
datasets, 2026-12-05): the flow's process spent 1.0 s of CPU in the collector, seven full
collections, and its Dask worker 0.4 s in four; with this module 0.14 s each, and the run's user
CPU went from 9.2-9.5 s to 7.9 s.

:func:`paused_for_startup` turns automatic collection off while the command starts (imports,
the stack check, the cluster's start: allocations that are almost all long-lived, and the
process ends through ``os._exit``, so nothing is left to collect at exit); :func:`freeze_startup`
then moves every object alive at that point to the collector's permanent generation
(``gc.freeze``, CPython 3.7+, O(1)), where later collections do not walk it, and turns collection
back on. Reference counting still frees a frozen object whose count drops to zero; what a freeze
keeps for good is only cyclic garbage already made by then, so a process freezes once, after
start-up and before any pipeline work. Workers freeze once, after their preload's imports
(``infra/worker_exit.py``'s ``dask_setup``).

Processes that host other code (pytest, a notebook calling the flows) are left alone: only the
console script's ``main`` and the worker preload call these. (A process Prefect's runner starts for
one deployment run spent 0.2 s in its collector on a cached tensor-factorization run, frozen or
not: measured 2026-12-06, and left unfrozen.)
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

_STATE = {"frozen": False, "resume": False}


@contextlib.contextmanager
def paused_for_startup() -> Iterator[None]:
    """Automatic collection off inside the block, until :func:`freeze_startup` turns it back on;
    on again on the way out, error or not. Collection someone else had turned off stays off."""
    was_enabled = gc.isenabled()
    _STATE["resume"] = was_enabled
    gc.disable()
    try:
        yield
    finally:
        _STATE["resume"] = False
        if was_enabled:
            gc.enable()


def frozen() -> bool:
    """Whether :func:`freeze_startup` has frozen this process's heap."""
    return bool(_STATE["frozen"])


def freeze_startup() -> bool:
    """Freeze the heap alive now (``gc.freeze``), once per process, and turn automatic collection
    back on if :func:`paused_for_startup` turned it off.

    Returns:
        True if this call froze the heap, False if an earlier one had.
    """
    first = not _STATE["frozen"]
    if first:
        gc.freeze()
        _STATE["frozen"] = True
    if _STATE["resume"]:
        gc.enable()
    return first

"""Dask nanny preload for workers you start yourself: ``dask worker ADDRESS --preload-nanny
paperline.infra.nanny_env`` (or ``dask cuda worker``), as ``infra/compose.yaml``'s workers do.

Dask's nanny starts each worker with ``MALLOC_TRIM_THRESHOLD_=65536`` (its default
``distributed.nanny.pre-spawn-environ``), which freezes glibc's mmap threshold: the NumPy-heavy
tensor fits ran 2-3x slower (``infra/cluster.py``, :data:`~paperline.infra.cluster.DROPPED_WORKER_ENV`).
Setting ``DASK_DISTRIBUTED__NANNY__PRE_SPAWN_ENVIRON`` does not remove it: Dask merges the
variable into its defaults (an external-cluster trial measured 101.8 s against 52.7 s for one
fit). A nanny imports its preloads before it reads that setting, so this module's import removes
those entries, as ``paperline run`` does for its local clusters; ``*_NUM_THREADS=1`` stays the
caller's to set (the same variable does add entries).
"""

from __future__ import annotations

from paperline.infra.cluster import configure_local_workers

configure_local_workers()

"""Local Dask workers start with glibc's default malloc behaviour (see infra/cluster.py): no
malloc threshold variable, in particular not the nanny's MALLOC_TRIM_THRESHOLD_."""

import dask
from distributed import Client, LocalCluster

from paperline.infra.cluster import DROPPED_WORKER_ENV, configure_local_workers


def test_local_workers_start_without_malloc_thresholds():
    with dask.config.set({}):  # keep the global config change local to this test
        assert "MALLOC_TRIM_THRESHOLD_" in dask.config.get("distributed.nanny.pre-spawn-environ")
        configure_local_workers()
        with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None) as c, \
                Client(c) as client:
            keys = DROPPED_WORKER_ENV  # a lambda pickles by value (this module is not importable on workers)
            env = client.run(lambda: {k: __import__("os").environ.get(k) for k in keys})
    assert list(env.values()) == [dict.fromkeys(DROPPED_WORKER_ENV)]

"""Local Dask workers get the malloc settings that keep numpy temporaries cheap (see infra/cluster.py)."""

import dask
from distributed import Client, LocalCluster

from paperline.infra.cluster import WORKER_ENV, configure_local_workers


def test_local_workers_start_with_the_mmap_threshold():
    with dask.config.set({}):  # keep the global config change local to this test
        configure_local_workers()
        with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None) as c, \
                Client(c) as client:
            env = client.run(lambda: {k: __import__("os").environ.get(k) for k in WORKER_ENV})
    assert list(env.values()) == [WORKER_ENV]

"""Which Dask workers compressed training's ranks run on, on a first attempt and on a restart
after a failure took a worker (tasks/training.py's ``rank_workers``), on a real in-process cluster."""

import threading
import time

import pytest
from distributed import Client, LocalCluster

from paperline.kernels.errors import InputError
from paperline.tasks.training import RankFailed, rank_workers


def test_a_restart_waits_for_a_lost_worker_and_a_first_attempt_does_not(capsys):
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        client.wait_for_workers(1)
        with pytest.raises(InputError, match=r"world_size=2: larger than the number of Dask workers \(1\)"):
            rank_workers(client, 2, "none", restart=False)
        started = time.monotonic()
        with pytest.raises(RankFailed, match=r"^none: a rank's Dask worker was lost and did not come back within 1 s "
                                             r"\(1 of the 2 workers the ranks need\)"):
            rank_workers(client, 2, "none", restart=True, wait_s=1.0)
        assert time.monotonic() - started < 30
        # the restart checked at once and refused itself while the nanny's new worker was starting (a trial)
        threading.Timer(1.0, cluster.scale, args=(2,)).start()
        chosen = rank_workers(client, 2, "none", restart=True, wait_s=60.0)
        assert len(chosen) == 2 and chosen == sorted(client.scheduler_info(n_workers=-1)["workers"])
    assert "1 of the 2 Dask workers the ranks need are left after the failure; waiting up to 60 s" in \
        capsys.readouterr().out


def test_a_lost_scheduler_is_named_not_a_key_error():
    """The scheduler killed during a gemm run: the run failed with `error: KeyError: 'workers'` (a
    trial). A client that lost its scheduler gets no 'workers' from Dask: the error names it."""
    from paperline.kernels.errors import ClusterLost, scheduler_workers

    cluster = LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None)
    client = Client(cluster)
    try:
        address = cluster.scheduler_address
        assert scheduler_workers(client) == sorted(client.scheduler_info(n_workers=-1)["workers"])
        cluster.close()  # the scheduler gone under a live client
        deadline = time.monotonic() + 30
        while "workers" in client.scheduler_info(n_workers=-1) and time.monotonic() < deadline:
            time.sleep(0.2)
        with pytest.raises(ClusterLost, match=rf"^the Dask scheduler at {address} went away during the run"):
            scheduler_workers(client)
    finally:
        client.close()
        cluster.close()


def test_a_live_cluster_never_reads_as_one_without_workers():
    """``client.scheduler_info()`` returns the client's cached identity, which its periodic refresh
    overwrites with one that lists no workers: the two raced, and a gemm run under load failed at
    its start with "worker(s) ... left the Dask cluster" (a CI run). The refresh every 2 ms here."""
    import dask

    from paperline.kernels.errors import scheduler_workers

    with dask.config.set({"distributed.client.scheduler-info-interval": "2ms"}), \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        client.wait_for_workers(2)
        reads = [len(scheduler_workers(client)) for _ in range(3000)]
    assert reads.count(2) == len(reads), f"{len(reads) - reads.count(2)} of {len(reads)} reads saw fewer workers"

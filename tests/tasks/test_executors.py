"""The Dask executor gives bit-identical P²T²F results to the serial one."""

import numpy as np
import pytest
from distributed import Client, LocalCluster

from paperline.kernels.tensor.coo import random_split
from paperline.kernels.tensor.p2t2f import p2t2f
from paperline.tasks.executors import DaskExecutor, cluster_executor
from paperline.kernels.tensor.p2t2f import SerialExecutor


def test_cluster_executor_is_serial_without_a_client():
    # Runs before the module's client exists (pytest keeps file order).
    with cluster_executor() as ex:
        assert isinstance(ex, SerialExecutor)


@pytest.fixture(scope="module")
def client():
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as c:
        yield c


def test_dask_executor_matches_serial_exactly(client, low_rank_tensor):
    tensor, _ = low_rank_tensor(shape=(12, 8, 10))
    split = random_split(tensor, seed=1)
    serial = p2t2f(split.train, 2, n_parts=3, n_epochs=4, batch_size=128, seed=3)
    executor = DaskExecutor(client)
    dask = p2t2f(split.train, 2, n_parts=3, n_epochs=4, batch_size=128, seed=3, executor=executor)
    for a, b in zip(serial.factors.factors, dask.factors.factors):
        np.testing.assert_array_equal(a, b)
    # Each sub-tensor was placed once and pinned to a worker; both workers got work.
    assert len(set(executor._assigned.values())) == 2


def test_cluster_executor_uses_the_default_client(client):
    with cluster_executor() as ex:
        assert isinstance(ex, DaskExecutor) and ex.client is client


def test_a_scheduler_without_workers_is_waited_on_until_one_joins(capsys):
    """An external scheduler with no worker yet: the GEMM flow failed at once ("the Dask cluster
    has no workers", then its retry the same) although `paperline run` had said its tasks would
    wait for one (a trial). The run waits, as its tasks would, and goes on when a worker joins."""
    import threading


    from paperline.kernels.blas.runtime import DaskRuntime
    from paperline.tasks.executors import wait_for_cluster

    with LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as cluster, \
            Client(cluster.scheduler_address) as c:  # by address: an external scheduler, no cluster object
        done = threading.Event()
        waiter = threading.Thread(target=lambda: (wait_for_cluster(c), done.set()), daemon=True)
        waiter.start()
        assert not done.wait(1.5)  # still waiting: no worker
        assert f"waiting for a worker to join the Dask scheduler at {cluster.scheduler_address}" in capsys.readouterr().out
        cluster.scale(1)
        assert done.wait(60)
        assert len(DaskRuntime(c).workers()) == 1

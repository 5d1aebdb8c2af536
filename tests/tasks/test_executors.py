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

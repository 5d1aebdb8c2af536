"""Peer fetch (BLASX's L2): a tile a worker lacks comes from the worker that holds it, over Dask's
comms, and a peer that no longer holds it falls back to the source."""

import uuid

import numpy as np
import pytest
from distributed import Client, LocalCluster

from paperline.kernels.blas import RandomSource, make_problem, plan_tasks
from paperline.kernels.blas.runtime import DaskRuntime, OutputSource, _execute_on_dask_worker
from paperline.kernels.blas.sources import read_all
from paperline.kernels.blas.worker import RunContext

T = 32


@pytest.fixture(scope="module")
def runtime():
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster) as client:
        yield client, DaskRuntime(client)


def _setup(rt):
    a = RandomSource((2 * T, 2 * T), np.float64, seed=3, stream=0)
    b = RandomSource((2 * T, 2 * T), np.float64, seed=3, stream=1)
    problem = make_problem("gemm", a, b, tile=T)
    run_id = uuid.uuid4().hex[:12]
    ctx = RunContext(run_id, {"a": a, "b": b, "x": OutputSource(problem.out_shape, problem.dtype, run_id, None)}, T)
    rt.start(ctx)
    return problem, plan_tasks(problem), ctx, read_all(a) @ read_all(b)


def test_a_missing_tile_comes_from_the_peer_that_holds_it(runtime):
    client, rt = runtime
    w0, w1 = rt.workers()
    _, tasks, ctx, ref = _setup(rt)
    first = client.submit(_execute_on_dask_worker, ctx, tasks[0], {}, workers=[w0], pure=False).result()
    held = {tuple(k) for k in first["added"]}
    assert held == {(ctx.sources["a"].key, 0, 0), (ctx.sources["a"].key, 0, 1),
                    (ctx.sources["b"].key, 0, 0), (ctx.sources["b"].key, 1, 0)}
    # Output tile (0, 1) needs A(0, 0) and A(0, 1), which worker 0 holds, and B(:, 1), which nobody holds.
    peers = {k: w0 for k in held}
    second = client.submit(_execute_on_dask_worker, ctx, tasks[1], peers, workers=[w1], pure=False).result()
    assert second["worker"] == w1
    assert second["counters"]["bytes_peer"] == 2 * T * T * 8
    assert second["counters"]["bytes_source"] == 2 * T * T * 8
    assert second["counters"]["peer_misses"] == 0
    np.testing.assert_allclose(second["tile"], ref[:T, T:], rtol=1e-13)
    rt.finish(ctx)


def test_a_peer_that_no_longer_holds_the_tile_falls_back_to_the_source(runtime):
    client, rt = runtime
    w0, w1 = rt.workers()
    _, tasks, ctx, ref = _setup(rt)
    # Worker 0 holds nothing of this run: every peer request misses.
    peers = {(ctx.sources["a"].key, 0, q): w0 for q in range(2)}
    res = client.submit(_execute_on_dask_worker, ctx, tasks[0], peers, workers=[w1], pure=False).result()
    assert res["counters"]["peer_misses"] == 2 and res["counters"]["bytes_peer"] == 0
    assert res["counters"]["bytes_source"] == 4 * T * T * 8
    np.testing.assert_allclose(res["tile"], ref[:T, :T], rtol=1e-13)
    rt.finish(ctx)

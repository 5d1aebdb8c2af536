from __future__ import annotations

import pytest

from paperline.infra.cluster import describe_cluster, task_runner
from paperline.infra.device import gpu_usable, resolve_device
from paperline.infra.errors import InputError
from paperline.infra.settings import Settings

cpu_only = pytest.mark.skipif(gpu_usable(), reason="this machine has a usable GPU")


@cpu_only
def test_cpu_machine_resolves_to_cpu():
    assert resolve_device("auto") == "cpu"
    assert resolve_device("cpu") == "cpu"
    with pytest.raises(InputError, match="no usable CUDA device"):
        resolve_device("cuda")


def test_unknown_device_rejected():
    with pytest.raises(InputError):
        resolve_device("tpu")


@cpu_only
def test_task_runner_local_cpu_cluster(tmp_path):
    s = Settings(state_dir=tmp_path, device="auto", n_workers=2, dask_scheduler_address=None)
    runner = task_runner(s)
    assert runner.cluster_kwargs["cluster_class"] == "distributed.LocalCluster"  # via start_local_cluster
    assert runner.cluster_kwargs["n_workers"] == 2
    assert runner.cluster_kwargs["threads_per_worker"] == 1
    assert runner.cluster_kwargs["host"] == "127.0.0.1"
    assert runner.cluster_kwargs["dashboard_address"].startswith("127.0.0.1:")
    assert "2 single-threaded" in describe_cluster(s)


def test_task_runner_existing_scheduler(tmp_path):
    s = Settings(state_dir=tmp_path, dask_scheduler_address="tcp://10.0.0.5:8786")
    assert task_runner(s).address == "tcp://10.0.0.5:8786"
    assert "tcp://10.0.0.5:8786" in describe_cluster(s)


@pytest.mark.gpu
def test_gpu_is_usable():
    assert gpu_usable()
    assert resolve_device("auto") == "cuda"
    assert resolve_device("cuda") == "cuda"


def test_array_device_needs_cupy_for_cuda(monkeypatch):
    """A usable GPU without CuPy: ``auto`` computes on the CPU, ``cuda`` says what to install."""
    import importlib.util

    import paperline.infra.device as device

    monkeypatch.setattr(device, "gpu_usable", lambda: True)
    has_cupy = importlib.util.find_spec("cupy") is not None
    assert device.array_device("cpu") == "cpu"
    assert device.array_device("auto") == ("cuda" if has_cupy else "cpu")
    if has_cupy:
        assert device.array_device("cuda") == "cuda"
    else:
        with pytest.raises(InputError, match="CuPy is not installed"):
            device.array_device("cuda")

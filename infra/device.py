"""Which compute device paperline runs on.

GPU packages (torch, cupy) import fine on machines without a CUDA driver and fail only when used, so
"installed" is not "usable": :func:`gpu_usable` asks the runtime. Nothing here imports a GPU package at
module import time.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys

from typing import Literal

from paperline.infra.errors import InputError

Device = Literal["cpu", "cuda"]


def _nvidia_driver_present() -> bool:
    """Whether the NVIDIA kernel driver is visible (a cheap necessary condition for CUDA on Linux)."""
    return os.path.exists("/proc/driver/nvidia") or bool(glob.glob("/dev/nvidia[0-9]*"))


def gpu_usable() -> bool:
    """Whether a CUDA device is actually usable from this process.

    Tries ``torch.cuda.is_available()`` first, then ``cupy.cuda.runtime.getDeviceCount() > 0``. Missing
    packages, a missing driver or any runtime error count as "not usable".

    On Linux, a machine without the NVIDIA driver (no ``/proc/driver/nvidia`` and no
    ``/dev/nvidia*``) answers False without importing torch or cupy (which takes seconds).

    Returns:
        True only if at least one CUDA device can be used.
    """
    if sys.platform.startswith("linux") and not _nvidia_driver_present():
        return False
    try:
        import torch  # noqa: PLC0415 - GPU packages are imported lazily on purpose

        if torch.cuda.is_available():
            return True
    except Exception:  # noqa: BLE001 - any failure means "not usable"
        pass
    try:
        import cupy  # noqa: PLC0415

        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:  # noqa: BLE001
        return False


def resolve_device(setting: str) -> Device:
    """Turn the ``device`` setting into the device to use.

    Args:
        setting: ``"auto"`` (CUDA when usable, else CPU), ``"cpu"`` or ``"cuda"``.

    Returns:
        ``"cpu"`` or ``"cuda"``.

    Raises:
        InputError: ``setting`` is ``"cuda"`` but no CUDA device is usable, or ``setting`` is not one
            of the three values.
    """
    if setting == "cpu":
        return "cpu"
    if setting == "auto":
        return "cuda" if gpu_usable() else "cpu"
    if setting == "cuda":
        if gpu_usable():
            return "cuda"
        raise InputError(
            "device",
            setting,
            "no usable CUDA device; use device=auto or device=cpu (PAPERLINE_DEVICE), "
            "or install the GPU extra (make install-gpu) on a machine with an NVIDIA driver",
        )
    raise InputError("device", setting, "must be one of auto, cpu, cuda")


def array_device(setting: str) -> Device:
    """The device for kernels that compute on CuPy arrays (tiled BLAS, tensor factorization).

    :func:`resolve_device`, except that a usable GPU without CuPy installed (the GPU extra) gives
    ``"cpu"`` under ``"auto"`` and a clear error under ``"cuda"``, rather than an ImportError deep
    inside a kernel.

    Raises:
        InputError: as :func:`resolve_device`, or ``"cuda"`` asked for without CuPy installed.
    """
    device = resolve_device(setting)
    if device == "cuda" and importlib.util.find_spec("cupy") is None:
        if setting == "auto":
            return "cpu"
        raise InputError("device", setting, "CuPy is not installed: install the GPU extra (make install-gpu), "
                                            "or use device=cpu (PAPERLINE_DEVICE)")
    return device


def gpu_free_bytes() -> list[int] | None:
    """Free memory of each CUDA device this process may use, in bytes, in the order of
    ``CUDA_VISIBLE_DEVICES`` (the devices a ``LocalCUDACluster`` gives its workers, one each), read
    through NVML (``pynvml``, installed with dask-cuda): unlike ``torch.cuda.mem_get_info`` it makes
    no CUDA context, which would hold about 0.5 GiB of each GPU in this process for the whole run.

    Returns:
        One count per device (``list[int]``), or None where it cannot be told: no NVIDIA driver,
        ``pynvml`` not installed, NVML failing, or ``CUDA_VISIBLE_DEVICES`` naming devices by UUID
        or MIG instance rather than by index.
    """
    if not _nvidia_driver_present():
        return None
    try:
        import pynvml  # noqa: PLC0415 - the GPU extra's (dask-cuda's dependency)
    except ImportError:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        indices = None if visible is None else [int(i) for i in visible.split(",") if i.strip()]
    except ValueError:  # GPU-<uuid>, MIG-<uuid>
        return None
    try:
        pynvml.nvmlInit()
        try:
            if indices is None:
                indices = list(range(pynvml.nvmlDeviceGetCount()))
            return [int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).free) for i in indices]
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - pynvml.NVMLError and its kin: not known, not checked
        return None

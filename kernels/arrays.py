"""Kernels follow their inputs: which array module (NumPy or CuPy) an array lives in, and moves
between host and device.

CuPy is imported only when an input already is a CuPy array or ``"cuda"`` is asked for, so CPU
machines never need it. Functions written against the module returned by :func:`array_module`
run unchanged on either; what differs is where new arrays are created (``xp.zeros``, not
``np.zeros``) and that host and device arrays never mix in one expression (CuPy refuses).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

DEVICES = ("cpu", "cuda")


def is_device_array(a: Any) -> bool:
    """Whether ``a`` is a CuPy array (checked by type, without importing CuPy)."""
    return type(a).__module__.partition(".")[0] == "cupy"


def array_module(*arrays: Any) -> ModuleType:
    """``cupy`` if any argument is a CuPy array, else ``numpy``.

    Raises:
        ImportError: never for NumPy inputs; CuPy is imported only when a CuPy array was given.
    """
    if any(is_device_array(a) for a in arrays):
        import cupy  # noqa: PLC0415 - GPU packages are imported lazily on purpose

        return cupy
    return np


def device_of(a: Any) -> str:
    """``"cuda"`` for a CuPy array, ``"cpu"`` otherwise."""
    return "cuda" if is_device_array(a) else "cpu"


def to_host(a: Any) -> np.ndarray:
    """A NumPy array with ``a``'s values (a copy from the device for CuPy; no copy for NumPy)."""
    return a.get() if is_device_array(a) else np.asarray(a)


def to_device(a: Any, device: str) -> Any:
    """``a`` on ``device`` (``"cpu"``: NumPy; ``"cuda"``: CuPy, on the current CUDA device).

    Raises:
        ValueError: an unknown device name.
    """
    if device == "cpu":
        return to_host(a)
    if device == "cuda":
        import cupy  # noqa: PLC0415

        return cupy.asarray(a)
    raise ValueError(f"device: unknown device {device!r}; choose one of {list(DEVICES)}")

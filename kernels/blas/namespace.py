"""One tile code path for NumPy (CPU) and CuPy (GPU): the array namespace a worker computes in.

CuPy is imported only when ``device="cuda"`` is asked for, so CPU machines never need it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Namespace:
    """The array module of a device plus the few operations that differ between NumPy and CuPy.

    Attributes:
        device: ``"cpu"`` or ``"cuda"``.
        xp: ``numpy`` or ``cupy``.
    """

    device: str
    xp: Any

    def to_device(self, host: np.ndarray) -> Any:
        """Copy a host array (possibly a strided view of a memory map) to the device (a no-op on CPU)."""
        return host if self.device == "cpu" else self.xp.asarray(np.ascontiguousarray(host))

    def to_host(self, array: Any) -> np.ndarray:
        """Copy a device array to host memory (a no-op on CPU)."""
        return array if self.device == "cpu" else self.xp.asnumpy(array)

    def solve_triangular(self, a: Any, b: Any, *, lower: bool, trans: bool) -> Any:
        """Solve ``op(a) x = b`` for triangular ``a`` (``op`` is transpose when ``trans``)."""
        if self.device == "cpu":
            from scipy.linalg import solve_triangular  # noqa: PLC0415
        else:
            from cupyx.scipy.linalg import solve_triangular  # noqa: PLC0415
        return solve_triangular(a, b, lower=lower, trans="T" if trans else "N", check_finite=False)

    def synchronize(self) -> None:
        """Wait for queued device work (so timings are honest); a no-op on CPU."""
        if self.device != "cpu":
            self.xp.cuda.get_current_stream().synchronize()


def namespace(device: str) -> Namespace:
    """The namespace for ``device`` (``"cpu"`` or ``"cuda"``).

    Raises:
        ValueError: another device name. ImportError: ``"cuda"`` without CuPy installed.
    """
    if device == "cpu":
        return Namespace("cpu", np)
    if device == "cuda":
        import cupy  # noqa: PLC0415

        return Namespace("cuda", cupy)
    raise ValueError(f"device={device!r}: expected 'cpu' or 'cuda'")

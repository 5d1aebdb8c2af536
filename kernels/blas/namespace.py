"""One tile code path for NumPy (CPU) and CuPy (GPU): the array namespace a worker computes in.

CuPy is imported only when ``device="cuda"`` is asked for, so CPU machines never need it.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
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
        """Copy a host array (possibly a strided view of a memory map) to the device (a no-op on CPU).

        On CUDA the bytes go through a pinned staging buffer (filled by :func:`copy_parallel`, so
        a strided tile is gathered once, by several cores) and a DMA on a non-blocking stream of
        the calling thread's own, finished when this returns: a prefetch thread's copies overlap
        the products queued on the computing thread's stream (BLASX Sec. 4.3) instead of waiting
        behind them, and run at the bus's rate rather than through the driver's pageable path.
        """
        if self.device == "cpu":
            return host
        import cupyx  # noqa: PLC0415

        stream = getattr(_COPY_STREAMS, "stream", None)
        if stream is None:
            stream = _COPY_STREAMS.stream = self.xp.cuda.Stream(non_blocking=True)
        pinned = cupyx.empty_pinned(host.shape, host.dtype)
        copy_parallel(pinned, host)
        with stream:
            out = self.xp.empty(host.shape, host.dtype)
            out.set(pinned, stream=stream)
        stream.synchronize()
        return out

    def to_host(self, array: Any) -> np.ndarray:
        """Copy a device array to host memory (a no-op on CPU); on CUDA through a pinned buffer."""
        if self.device == "cpu":
            return array
        import cupyx  # noqa: PLC0415

        array = self.xp.ascontiguousarray(array)
        pinned = cupyx.empty_pinned(array.shape, array.dtype)
        array.get(out=pinned)  # waits for the work queued on the current stream, then copies
        host = np.empty(array.shape, array.dtype)
        copy_parallel(host, pinned)
        return host

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


_COPY_STREAMS = threading.local()  # per thread: the CUDA stream its host-to-device copies run on
_COPY_POOL: ThreadPoolExecutor | None = None
_COPY_POOL_LOCK = threading.Lock()
COPY_THREADS = max(1, min(8, os.cpu_count() or 1))
PARALLEL_COPY_BYTES = 16 << 20  # below this one thread copies (a task switch costs more than it saves)


def copy_parallel(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` for 2-D arrays of one shape, in row blocks on :data:`COPY_THREADS` threads.

    A single-threaded ``np.copyto`` of a large tile runs at one core's memory bandwidth (a 256 MiB
    tile took ~40 ms); NumPy releases the GIL while it copies, so row blocks copy in parallel.
    ``src`` may be strided (a tile of a larger matrix or memory map).

    Raises:
        ValueError: shapes differ.
    """
    if dst.shape != src.shape:
        raise ValueError(f"copy_parallel: shapes differ, {dst.shape} and {src.shape}")
    rows = dst.shape[0]
    if COPY_THREADS == 1 or src.nbytes < PARALLEL_COPY_BYTES or rows < 2:
        np.copyto(dst, src)
        return
    global _COPY_POOL
    with _COPY_POOL_LOCK:
        if _COPY_POOL is None:
            _COPY_POOL = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="paperline-copy")
    step = -(-rows // COPY_THREADS)
    for f in [_COPY_POOL.submit(np.copyto, dst[r:r + step], src[r:r + step]) for r in range(0, rows, step)]:
        f.result()


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

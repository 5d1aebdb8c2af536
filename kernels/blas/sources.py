"""Where operand tiles come from: in-memory arrays, memory-mapped ``.npy`` files, seeded random
matrices, or anything else with the :class:`TileSource` shape (the S3 source lives in
``paperline.tasks.gemm`` so that kernels never import boto3).

A source is small and picklable: it travels to Dask workers inside each tile task and opens its
data lazily in the process that reads it. Reads return host (NumPy) arrays; the worker copies them
to the device.
"""

from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from paperline.kernels.errors import InputError

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


@runtime_checkable
class TileSource(Protocol):
    """A 2-D float32/float64 matrix readable by rectangle.

    Attributes:
        shape: ``(rows, cols)``.
        dtype: ``float32`` or ``float64``.
        key: identifies the content (cache keys and peer fetch use it).
        kind: ``"memory"``, ``"file"``, ``"generated"`` or ``"s3"`` (S3 reads are what peer fetch saves).

    A file or S3 source also has ``where``, the path or URI that an error about its values names.
    """

    shape: tuple[int, int]
    dtype: np.dtype
    key: str
    kind: str

    def read(self, rows: slice, cols: slice) -> np.ndarray:
        """The host array ``M[rows, cols]``: a copy, or a read-only view into a memory map (BLAS
        reads it in place; a Fortran-ordered file gives column-contiguous views). Callers never
        write to it."""
        ...


def read_npy_header(f: Any) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """``(shape, fortran_order, dtype, data offset)`` of the ``.npy`` stream ``f`` at its start.

    Raises:
        ValueError, OSError, SyntaxError, EOFError: not a ``.npy`` header (NumPy's own errors; a
            file without NumPy's magic string is said so without its first bytes, which NumPy
            quotes and a trial's credentials file gave away).
    """
    start = f.tell()
    prefix = f.read(len(np.lib.format.MAGIC_PREFIX))
    if prefix != np.lib.format.MAGIC_PREFIX:
        raise ValueError("it does not begin with NumPy's magic string (\\x93NUMPY)")
    f.seek(start)
    version = np.lib.format.read_magic(f)
    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, fortran, dtype = read_header(f)
    return shape, bool(fortran), np.dtype(dtype), f.tell()


def check_matrix_header(argument: str, where: str, shape: tuple[int, ...], dtype: np.dtype) -> tuple[int, int]:
    """Refuse anything but a non-empty 2-D float32/float64 matrix (a negative dimension as an
    invalid header). Returns the shape as a pair.

    Raises:
        InputError: naming ``argument`` and ``where`` (the path or URI).
    """
    if len(shape) != 2:
        raise InputError(argument, where, f"expected a 2-D matrix, found shape {tuple(shape)}")
    if np.dtype(dtype).newbyteorder("=") not in FLOAT_DTYPES:
        raise InputError(argument, where, f"expected float32 or float64, found dtype {np.dtype(dtype)}")
    # NumPy's header parser takes any integers: a negative one is a corrupt or hand-made header,
    # not an empty matrix (it was reported as one: a trial)
    if min(shape) < 0:
        raise InputError(argument, where, f"the header's shape {tuple(shape)} is invalid (a negative dimension)")
    if min(shape) < 1:
        raise InputError(argument, where, f"an empty matrix (shape {tuple(shape)})")
    return int(shape[0]), int(shape[1])


def check_npy_size(argument: str, where: str, size: int, need: int) -> None:
    """Refuse a ``.npy`` file (or S3 object) of ``size`` bytes whose header promises ``need``
    (its offset plus the matrix's bytes): shorter, it is truncated; longer, something follows
    the array (a second ``numpy.save`` into the same file, or damage), which was multiplied
    as if absent (a trial).

    Raises:
        InputError: naming ``argument`` and ``where`` (the path or URI).
    """
    if size < need:
        raise InputError(argument, where, f"truncated: {size} bytes, the header promises {need}")
    if size > need:
        raise InputError(argument, where, f"{size - need} bytes follow the array its header describes ({size} "
                                          f"bytes, the header promises {need}): another array saved after it, or a "
                                          "damaged file; save the operand alone with numpy.save")


class ArraySource:
    """An in-memory NumPy matrix (for calls from Python; a Dask runtime spills it to a ``.npy`` first).

    Raises:
        InputError: not a 2-D float32/float64 array.
    """

    kind = "memory"

    def __init__(self, array: Any, argument: str = "a"):
        array = np.asarray(array)
        self.shape = check_matrix_header(argument, f"array of shape {array.shape}", array.shape, array.dtype)
        self.dtype = array.dtype
        self.array = array
        self.key = f"array:{uuid.uuid4().hex}"

    def read(self, rows: slice, cols: slice) -> np.ndarray:
        """``M[rows, cols]`` as a read-only view (no copy: BLAS packs strided panels itself, and on
        GPU the view is gathered straight into the pinned staging buffer)."""
        view = self.array[rows, cols].view()
        view.flags.writeable = False
        return view


class NpySource:
    """A ``.npy`` file read through a memory map, tile by tile (operands larger than memory).

    Args:
        path: the file (``~`` expanded; relative to the current directory).
        argument: the operand's name for error messages.
        spilled: the file holds a caller's in-memory array, written for the Dask workers: a
            non-finite entry is then named by its index alone, not by this file.

    Attributes:
        where: the path as given, named by errors about the file's values (None when ``spilled``).

    Raises:
        InputError: missing file, not a ``.npy`` file, not a 2-D float matrix, or truncated (fewer
            bytes than its header promises).
    """

    kind = "file"

    def __init__(self, path: str | os.PathLike[str], argument: str = "a", spilled: bool = False):
        # ~ expanded, as for the flow's output (a=~/a.npy was "no such file": the CWD's "~" looked for)
        self.path = str(Path(path).expanduser().resolve())
        self.where = None if spilled else str(path)  # as given, as the errors above name it
        if os.path.isdir(self.path):
            raise InputError(argument, str(path), "is a directory; name a .npy file")
        if not os.path.isfile(self.path):
            raise InputError(argument, str(path), "no such file")
        try:
            with open(self.path, "rb") as f:
                shape, fortran, dtype, offset = read_npy_header(f)
        except (ValueError, OSError, SyntaxError) as exc:
            raise InputError(argument, str(path), f"not a .npy file ({exc})") from None
        self.shape = check_matrix_header(argument, str(path), shape, dtype)
        self.file_dtype = np.dtype(dtype)
        self.dtype = self.file_dtype.newbyteorder("=")  # big-endian files are converted as tiles are read
        stat = os.stat(self.path)
        need = offset + self.shape[0] * self.shape[1] * self.file_dtype.itemsize
        check_npy_size(argument, str(path), stat.st_size, need)
        self.fortran_order = bool(fortran)
        # The inode too: a file replaced by rename keeps path, size and (cp -p, rsync -a) mtime.
        self.key = f"file:{self.path}:{stat.st_dev}:{stat.st_ino}:{stat.st_mtime_ns}:{stat.st_size}"
        self._map: np.ndarray | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_map": None}

    def memmap(self) -> np.ndarray:
        """The file's memory map, shared by every copy of this source in the process.

        A source travels pickled inside each tile task; re-mapping the file per task would fault
        every page in again (measured: 60-80 ms per first touch of a 32 MiB tile against 6-8 ms
        once mapped), so the maps live in a per-process table keyed by :attr:`key`.
        """
        if self._map is None:
            self._map = _shared_map(self.key, self.path)
        return self._map

    def read(self, rows: slice, cols: slice) -> np.ndarray:
        """``M[rows, cols]`` as a read-only view into the file's memory map: BLAS packs its panels
        from the page cache itself, so a copy into a fresh tile would only add a pass over memory
        and its page faults (measured: 15-30 ms per pair of 32 MiB tiles, on the core a
        neighbouring worker multiplies on). A big-endian file's tiles are converted (copied)."""
        view = self.memmap()[rows, cols].view(np.ndarray)
        return view if self.file_dtype == self.dtype else np.ascontiguousarray(view, dtype=self.dtype)


_MAPS: dict[str, np.ndarray] = {}
_MAPS_LOCK = threading.Lock()
MAX_SHARED_MAPS = 32


def _shared_map(key: str, path: str) -> np.ndarray:
    with _MAPS_LOCK:
        m = _MAPS.get(key)
        if m is None:
            while len(_MAPS) >= MAX_SHARED_MAPS:
                _MAPS.pop(next(iter(_MAPS)))
            m = _MAPS[key] = np.load(path, mmap_mode="r")
        return m


class RandomSource:
    """A seeded standard-normal matrix generated block by block where it is read.

    Entry ``(r, c)`` depends only on ``(seed, stream, r, c)``, not on the tile size that reads it:
    blocks of ``block`` x ``block`` entries are drawn from ``numpy.random.default_rng([seed, stream,
    block row, block col])``. ``diagonal_shift`` is added to the diagonal (a well-conditioned
    triangular matrix for TRSM takes about ``n``).

    Args:
        shape: ``(rows, cols)``.
        dtype: float32 or float64.
        seed: the seed.
        stream: distinguishes the operands of one problem (0 for A, 1 for B, 2 for C).
        diagonal_shift: added to every diagonal entry.
        block: the generation block edge (entries).
        argument: the operand's name for error messages.

    Raises:
        InputError: ``shape`` not two whole numbers >= 1 (named ``argument``), ``block`` not a
            whole number >= 1, or ``dtype`` not float32/float64.
    """

    kind = "generated"

    def __init__(self, shape: tuple[int, int], dtype: Any = np.float64, seed: int = 0, stream: int = 0,
                 diagonal_shift: float = 0.0, block: int = 256, argument: str = "a"):
        try:  # (a shape of another type raised TypeError)
            ok = len(shape) == 2 and all(int(x) == x >= 1 for x in shape)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise InputError(argument, shape, "expected (rows, cols) with both whole numbers at least 1")
        if not isinstance(block, (int, np.integer)) or isinstance(block, bool) or block < 1:
            raise InputError("block", block, "expected a whole number of entries >= 1")  # 0 divided by zero
        self.shape = (int(shape[0]), int(shape[1]))
        self.dtype = np.dtype(dtype)
        if self.dtype not in FLOAT_DTYPES:
            raise InputError("dtype", str(self.dtype), "expected float32 or float64")
        self.seed, self.stream, self.diagonal_shift, self.block = int(seed), int(stream), float(diagonal_shift), int(block)
        self.key = f"random:{self.seed}:{self.stream}:{self.shape}:{self.dtype}:{self.diagonal_shift}:{self.block}"

    def _block(self, bi: int, bj: int) -> np.ndarray:
        b = self.block
        rows = min(b, self.shape[0] - bi * b)
        cols = min(b, self.shape[1] - bj * b)
        out = np.random.default_rng([self.seed, self.stream, bi, bj]).standard_normal((rows, cols), dtype=self.dtype)
        if self.diagonal_shift and bi == bj:
            idx = np.arange(min(rows, cols))
            out[idx, idx] += self.dtype.type(self.diagonal_shift)
        return out

    def read(self, rows: slice, cols: slice) -> np.ndarray:
        """``M[rows, cols]`` (step-1 slices), a new C-ordered array of :attr:`dtype`."""
        r0, r1, _ = rows.indices(self.shape[0])
        c0, c1, _ = cols.indices(self.shape[1])
        out = np.empty((r1 - r0, c1 - c0), self.dtype)
        b = self.block
        for bi in range(r0 // b, (r1 - 1) // b + 1 if r1 > r0 else r0 // b):
            for bj in range(c0 // b, (c1 - 1) // b + 1 if c1 > c0 else c0 // b):
                blk = self._block(bi, bj)
                br0, bc0 = bi * b, bj * b
                lo_r, hi_r = max(r0, br0), min(r1, br0 + blk.shape[0])
                lo_c, hi_c = max(c0, bc0), min(c1, bc0 + blk.shape[1])
                out[lo_r - r0:hi_r - r0, lo_c - c0:hi_c - c0] = blk[lo_r - br0:hi_r - br0, lo_c - bc0:hi_c - bc0]
        return out


def as_source(operand: Any, argument: str) -> TileSource:
    """A :class:`TileSource` for an array, a path to a ``.npy`` file, or a source (returned as is).

    Raises:
        InputError: anything else, or what the source's constructor refuses.
    """
    if operand is None:
        raise InputError(argument, None, "operand missing")
    if isinstance(operand, (str, os.PathLike)):
        return NpySource(operand, argument)
    if isinstance(operand, TileSource) and not isinstance(operand, np.ndarray):
        return operand
    if hasattr(operand, "__array__") or isinstance(operand, (list, tuple)):
        return ArraySource(operand, argument)
    raise InputError(argument, type(operand).__name__, "expected an array, a .npy path or a TileSource")


def read_all(source: TileSource, band: int = 1024) -> np.ndarray:
    """The whole matrix in memory (for references and small results)."""
    out = np.empty(source.shape, source.dtype)
    for r in range(0, source.shape[0], band):
        out[r:r + band] = source.read(slice(r, r + band), slice(0, source.shape[1]))
    return out

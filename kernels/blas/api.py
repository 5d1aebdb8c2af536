"""``scipy.linalg.blas``-style entry points: validate, plan, run, return the result in memory.

Each takes the arguments of its scipy counterpart (``trans_a``/``trans_b``/``side``/``uplo``/``diag``
as BLAS letters) plus ``tile``, ``runtime``, ``memory_budget`` and ``check_finite``; operands
may be arrays, ``.npy`` paths or tile sources. They raise
:class:`~paperline.kernels.errors.InputError` on bad input (below, "Errors").

Semantics are the reference BLAS ones, as ``scipy.linalg.blas.{s,d}gemm`` etc. document them, with
the result returned rather than written over an operand: ``op(X)`` is ``X`` for ``"N"`` and ``X^T``
for ``"T"`` (``"C"`` is ``"T"`` for real matrices). The matrices are cut into ``tile`` x ``tile``
tiles and every output tile is one task over the k-panels (BLASX: Wang et al., "BLASX: A High
Performance Level-3 BLAS Library for Heterogeneous Multi-GPU Computing", ICS 2016, Sec. 3), run by
:func:`.runtime.run` with the paper's runtime (Sec. 4: dynamic, locality-aware scheduling, a
per-worker LRU tile cache of ``memory_budget`` bytes, peer fetch, prefetch).

Common arguments of every function here:

- operands: 2-D float32 or float64 NumPy arrays (all of one dtype; C order or not), paths to
  ``.npy`` files, or :class:`~paperline.kernels.blas.sources.TileSource` s. ``numpy.ma`` masked
  arrays and empty matrices are refused.
- ``alpha``, ``beta``: finite real scalars (strings and bools are refused).
- ``tile``: elements per tile side, an integer >= 1 (edge tiles are smaller; a tile larger than
  the matrices is clipped to them).
- ``runtime``: None (a :class:`~paperline.kernels.blas.runtime.LocalRuntime` on the CPU), a
  ``LocalRuntime`` or a :class:`~paperline.kernels.blas.runtime.DaskRuntime`.
- ``memory_budget``: bytes of tiles each worker may cache (its L1 tile cache), an int, e.g.
  ``1 << 30``; at least the working set of one tile task (6 tiles of ``tile`` x ``tile`` entries).
  Operands larger than it are streamed (out of core).
- ``check_finite``: True or False; True refuses NaN/inf in the operand tiles read.

Errors: every function raises :class:`~paperline.kernels.errors.InputError`, naming the argument
and the value seen, for bad operands (not a 2-D float32/float64 matrix, a masked array, an empty
matrix, mixed dtypes, shapes that do not conform, an operand or flag the routine does not read), a
bad flag, a non-finite or non-numeric ``alpha``/``beta``, ``tile`` below 1, ``memory_budget`` not
an int or below one task's working set, a ``runtime`` of another type, a non-bool
``check_finite``, a NaN/inf entry read with ``check_finite`` on (the error names the operand
and the entry), a plan too fine to schedule (more than 100,000 output tiles or 10,000,000 tile
products: raise ``tile``), or a result larger than the memory available (these functions return
it in memory; :func:`.runtime.run` with ``output=`` writes a ``.npy`` file tile by tile). The two
size checks come before any planning or allocation.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from paperline.kernels.blas.plan import make_problem
from paperline.kernels.blas.runtime import DaskRuntime, LocalRuntime, run
from paperline.kernels.errors import Described, InputError, check_int

__all__ = ["gemm", "symm", "syrk", "syr2k", "trmm", "trsm"]


def _check_call(runtime: Any, memory_budget: Any, check_finite: Any) -> tuple[Any, int, bool]:
    """The runtime options as :func:`.runtime.run` takes them, or InputError."""
    if runtime is not None and not isinstance(runtime, (LocalRuntime, DaskRuntime)):
        raise InputError("runtime", runtime if isinstance(runtime, str) else Described(type(runtime).__name__),
                         "expected None (a LocalRuntime on the CPU), a LocalRuntime or a DaskRuntime")
    memory_budget = check_int("memory_budget", memory_budget, 1, unit="bytes, e.g. 1 << 30")  # run() checks one task fits
    if isinstance(check_finite, np.bool_):
        check_finite = bool(check_finite)
    if not isinstance(check_finite, bool):
        raise InputError("check_finite", check_finite, "must be True or False")
    return runtime, memory_budget, check_finite


def _call(routine: str, runtime: Any, memory_budget: Any, check_finite: Any, **kw: Any) -> np.ndarray:
    runtime, memory_budget, check_finite = _check_call(runtime, memory_budget, check_finite)
    problem = make_problem(routine, **kw)
    return run(problem, runtime, memory_budget=memory_budget, check_finite=check_finite).output


def gemm(alpha: float, a: Any, b: Any, beta: float = 0.0, c: Any = None, trans_a: str = "N", trans_b: str = "N", *,
         tile: int = 1024, runtime: Any = None, memory_budget: int = 1 << 30, check_finite: bool = True) -> np.ndarray:
    """General matrix-matrix multiply, ``alpha op(a) op(b) + beta c``.

    The reference BLAS ``xGEMM`` (``scipy.linalg.blas.dgemm``/``sgemm``), tiled as in BLASX
    (Wang et al., ICS 2016, Sec. 3; see the module docstring for the common arguments).

    Args:
        alpha: scale of the product.
        a: ``op(a)`` is ``m x k``: ``a`` is ``m x k`` (trans_a ``"N"``) or ``k x m`` (``"T"``).
        b: ``op(b)`` is ``k x n``: ``b`` is ``k x n`` (trans_b ``"N"``) or ``n x k`` (``"T"``).
        beta: scale of ``c``.
        c: ``m x n``, or None (zeros; a nonzero ``beta`` then adds nothing, as in scipy).
        trans_a, trans_b: ``"N"``, ``"T"`` or ``"C"`` (= ``"T"``), or 0/1/2.
        tile: elements per tile side. runtime, memory_budget (bytes per worker), check_finite: see
            the module docstring.

    Returns:
        The ``m x n`` result, a new array of the operands' dtype (float32 or float64).

    Raises:
        InputError: any bad argument the module docstring lists under "Errors".
    """
    return _call("gemm", runtime, memory_budget, check_finite, a=a, b=b, c=c, alpha=alpha, beta=beta,
                 trans_a=trans_a, trans_b=trans_b, tile=tile)


def symm(alpha: float, a: Any, b: Any, beta: float = 0.0, c: Any = None, side: str = "L", uplo: str = "U", *,
         tile: int = 1024, runtime: Any = None, memory_budget: int = 1 << 30, check_finite: bool = True) -> np.ndarray:
    """Symmetric matrix-matrix multiply: ``alpha a b + beta c`` (side ``"L"``) or ``alpha b a + beta c``
    (side ``"R"``), ``a`` symmetric.

    The reference BLAS ``xSYMM`` (``scipy.linalg.blas.dsymm``/``ssymm``), tiled as in BLASX
    (Wang et al., ICS 2016, Sec. 3). Only the ``uplo`` triangle of ``a`` is read; the other is
    taken as its mirror.

    Args:
        alpha: scale of the product.
        a: square, ``m x m`` (side ``"L"``) or ``n x n`` (side ``"R"``).
        b: ``m x n``.
        beta: scale of ``c``.
        c: ``m x n``, or None (zeros).
        side: ``"L"`` or ``"R"`` (or 0/1). uplo: ``"U"`` or ``"L"`` (or 0/1), the triangle of ``a`` read.
        tile: elements per tile side. runtime, memory_budget (bytes per worker), check_finite: see
            the module docstring.

    Returns:
        The ``m x n`` result, a new array of the operands' dtype (float32 or float64).

    Raises:
        InputError: any bad argument the module docstring lists under "Errors".
    """
    return _call("symm", runtime, memory_budget, check_finite, a=a, b=b, c=c, alpha=alpha, beta=beta, side=side,
                 uplo=uplo, tile=tile)


def syrk(alpha: float, a: Any, beta: float = 0.0, c: Any = None, trans: str = "N", uplo: str = "U", *,
         tile: int = 1024, runtime: Any = None, memory_budget: int = 1 << 30, check_finite: bool = True) -> np.ndarray:
    """Symmetric rank-k update, ``alpha op(a) op(a)^T + beta c`` on the ``uplo`` triangle.

    The reference BLAS ``xSYRK`` (``scipy.linalg.blas.dsyrk``/``ssyrk``), tiled as in BLASX
    (Wang et al., ICS 2016, Sec. 3). Only the ``uplo`` triangle (diagonal included) is computed;
    the other triangle of the result is ``c``'s, unchanged (zeros without ``c``), as scipy returns it.

    Args:
        alpha: scale of the product.
        a: ``op(a)`` is ``n x k``: ``a`` is ``n x k`` (trans ``"N"``) or ``k x n`` (``"T"``).
        beta: scale of ``c``.
        c: ``n x n``, or None (zeros).
        trans: ``"N"``, ``"T"`` or ``"C"`` (= ``"T"``), or 0/1/2. uplo: ``"U"`` or ``"L"`` (or 0/1).
        tile: elements per tile side. runtime, memory_budget (bytes per worker), check_finite: see
            the module docstring.

    Returns:
        The ``n x n`` result, a new array of the operands' dtype (float32 or float64).

    Raises:
        InputError: any bad argument the module docstring lists under "Errors".
    """
    return _call("syrk", runtime, memory_budget, check_finite, a=a, c=c, alpha=alpha, beta=beta, trans_a=trans,
                 uplo=uplo, tile=tile)


def syr2k(alpha: float, a: Any, b: Any, beta: float = 0.0, c: Any = None, trans: str = "N", uplo: str = "U", *,
          tile: int = 1024, runtime: Any = None, memory_budget: int = 1 << 30, check_finite: bool = True) -> np.ndarray:
    """Symmetric rank-2k update, ``alpha (op(a) op(b)^T + op(b) op(a)^T) + beta c`` on the ``uplo`` triangle.

    The reference BLAS ``xSYR2K`` (``scipy.linalg.blas.dsyr2k``/``ssyr2k``), tiled as in BLASX
    (Wang et al., ICS 2016, Sec. 3). The other triangle of the result is ``c``'s, unchanged
    (zeros without ``c``).

    Args:
        alpha: scale of the products.
        a, b: of one shape; ``op(a)``, ``op(b)`` are ``n x k``: ``n x k`` (trans ``"N"``) or
            ``k x n`` (``"T"``).
        beta: scale of ``c``.
        c: ``n x n``, or None (zeros).
        trans: ``"N"``, ``"T"`` or ``"C"`` (= ``"T"``), or 0/1/2. uplo: ``"U"`` or ``"L"`` (or 0/1).
        tile: elements per tile side. runtime, memory_budget (bytes per worker), check_finite: see
            the module docstring.

    Returns:
        The ``n x n`` result, a new array of the operands' dtype (float32 or float64).

    Raises:
        InputError: any bad argument the module docstring lists under "Errors".
    """
    return _call("syr2k", runtime, memory_budget, check_finite, a=a, b=b, c=c, alpha=alpha, beta=beta,
                 trans_a=trans, uplo=uplo, tile=tile)


def trmm(alpha: float, a: Any, b: Any, side: str = "L", uplo: str = "U", trans_a: str = "N", diag: str = "N", *,
         tile: int = 1024, runtime: Any = None, memory_budget: int = 1 << 30, check_finite: bool = True) -> np.ndarray:
    """Triangular matrix-matrix multiply: ``alpha op(a) b`` (side ``"L"``) or ``alpha b op(a)`` (side ``"R"``).

    The reference BLAS ``xTRMM`` (``scipy.linalg.blas.dtrmm``/``strmm``), tiled as in BLASX
    (Wang et al., ICS 2016, Sec. 3), returning the product instead of overwriting ``b``. Only the
    ``uplo`` triangle of ``a`` is read (and not its diagonal when ``diag`` is ``"U"``).

    Args:
        alpha: scale of the product.
        a: square triangular, ``m x m`` (side ``"L"``) or ``n x n`` (side ``"R"``).
        b: ``m x n``.
        side: ``"L"`` or ``"R"`` (or 0/1). uplo: ``"U"`` or ``"L"`` (or 0/1).
        trans_a: ``"N"``, ``"T"`` or ``"C"`` (= ``"T"``), or 0/1/2.
        diag: ``"N"`` (the stored diagonal) or ``"U"`` (a unit diagonal), or 0/1.
        tile: elements per tile side. runtime, memory_budget (bytes per worker), check_finite: see
            the module docstring.

    Returns:
        The ``m x n`` result, a new array of the operands' dtype (float32 or float64).

    Raises:
        InputError: any bad argument the module docstring lists under "Errors".
    """
    return _call("trmm", runtime, memory_budget, check_finite, a=a, b=b, alpha=alpha, side=side, uplo=uplo,
                 trans_a=trans_a, diag=diag, tile=tile)


def trsm(alpha: float, a: Any, b: Any, side: str = "L", uplo: str = "U", trans_a: str = "N", diag: str = "N", *,
         tile: int = 1024, runtime: Any = None, memory_budget: int = 1 << 30, check_finite: bool = True) -> np.ndarray:
    """Triangular solve with many right-hand sides: ``X`` with ``op(a) X = alpha b`` (side ``"L"``)
    or ``X op(a) = alpha b`` (side ``"R"``).

    The reference BLAS ``xTRSM`` (``scipy.linalg.blas.dtrsm``/``strsm``), as BLASX's tiled block
    substitution (Wang et al., ICS 2016, Sec. 3: each tile of ``X`` depends on the tiles solved
    before it), returning ``X`` instead of overwriting ``b``. Only the ``uplo`` triangle of ``a`` is
    read (not its diagonal when ``diag`` is ``"U"``).

    Args:
        alpha: scale of ``b``.
        a: square triangular, ``m x m`` (side ``"L"``) or ``n x n`` (side ``"R"``); with diag
            ``"N"`` its diagonal must have no zero.
        b: ``m x n`` right-hand sides.
        side: ``"L"`` or ``"R"`` (or 0/1). uplo: ``"U"`` or ``"L"`` (or 0/1).
        trans_a: ``"N"``, ``"T"`` or ``"C"`` (= ``"T"``), or 0/1/2.
        diag: ``"N"`` (the stored diagonal) or ``"U"`` (a unit diagonal), or 0/1.
        tile: elements per tile side. runtime, memory_budget (bytes per worker), check_finite: see
            the module docstring.

    Returns:
        The ``m x n`` solution ``X``, a new array of the operands' dtype (float32 or float64).

    Raises:
        InputError: any bad argument the module docstring lists under "Errors"; a zero on
            ``a``'s diagonal with diag ``"N"`` (singular), named by its index.
    """
    return _call("trsm", runtime, memory_budget, check_finite, a=a, b=b, alpha=alpha, side=side, uplo=uplo,
                 trans_a=trans_a, diag=diag, tile=tile)

"""``scipy.linalg.blas``-style entry points: validate, plan, run, return the result in memory.

Each takes the arguments of its scipy counterpart (``trans_a``/``trans_b``/``side``/``uplo``/``diag``
as BLAS letters) plus ``tile``, ``runtime``, ``memory_budget`` and ``check_finite``; operands
may be arrays, ``.npy`` paths or tile sources. They raise
:class:`~paperline.kernels.errors.InputError` on bad input (see :func:`.plan.make_problem` and
:func:`.runtime.run`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from paperline.kernels.blas.plan import make_problem
from paperline.kernels.blas.runtime import run


def _call(routine: str, runtime: Any, memory_budget: int, check_finite: bool, **kw: Any) -> np.ndarray:
    problem = make_problem(routine, **kw)
    return run(problem, runtime, memory_budget=memory_budget, check_finite=check_finite).output


def gemm(alpha: float, a: Any, b: Any, beta: float = 0.0, c: Any = None, trans_a: str = "N", trans_b: str = "N", *,
         tile: int = 1024, runtime: Any = None, memory_budget: int = 1 << 30, check_finite: bool = True) -> np.ndarray:
    """``alpha op(a) op(b) + beta c`` (m x n), float32/float64 like the operands."""
    return _call("gemm", runtime, memory_budget, check_finite, a=a, b=b, c=c, alpha=alpha, beta=beta,
                 trans_a=trans_a, trans_b=trans_b, tile=tile)


def symm(alpha: float, a: Any, b: Any, beta: float = 0.0, c: Any = None, side: str = "L", uplo: str = "U", *,
         tile: int = 1024, runtime: Any = None, memory_budget: int = 1 << 30, check_finite: bool = True) -> np.ndarray:
    """``alpha a b + beta c`` (side L) or ``alpha b a + beta c`` (side R), ``a`` symmetric from its ``uplo`` triangle."""
    return _call("symm", runtime, memory_budget, check_finite, a=a, b=b, c=c, alpha=alpha, beta=beta, side=side,
                 uplo=uplo, tile=tile)


def syrk(alpha: float, a: Any, beta: float = 0.0, c: Any = None, trans: str = "N", uplo: str = "U", *,
         tile: int = 1024, runtime: Any = None, memory_budget: int = 1 << 30, check_finite: bool = True) -> np.ndarray:
    """``alpha op(a) op(a)^T + beta c`` on the ``uplo`` triangle; the other triangle of ``c`` (or zeros) unchanged."""
    return _call("syrk", runtime, memory_budget, check_finite, a=a, c=c, alpha=alpha, beta=beta, trans_a=trans,
                 uplo=uplo, tile=tile)


def syr2k(alpha: float, a: Any, b: Any, beta: float = 0.0, c: Any = None, trans: str = "N", uplo: str = "U", *,
          tile: int = 1024, runtime: Any = None, memory_budget: int = 1 << 30, check_finite: bool = True) -> np.ndarray:
    """``alpha (op(a) op(b)^T + op(b) op(a)^T) + beta c`` on the ``uplo`` triangle."""
    return _call("syr2k", runtime, memory_budget, check_finite, a=a, b=b, c=c, alpha=alpha, beta=beta,
                 trans_a=trans, uplo=uplo, tile=tile)


def trmm(alpha: float, a: Any, b: Any, side: str = "L", uplo: str = "U", trans_a: str = "N", diag: str = "N", *,
         tile: int = 1024, runtime: Any = None, memory_budget: int = 1 << 30, check_finite: bool = True) -> np.ndarray:
    """``alpha op(a) b`` (side L) or ``alpha b op(a)`` (side R), ``a`` triangular."""
    return _call("trmm", runtime, memory_budget, check_finite, a=a, b=b, alpha=alpha, side=side, uplo=uplo,
                 trans_a=trans_a, diag=diag, tile=tile)


def trsm(alpha: float, a: Any, b: Any, side: str = "L", uplo: str = "U", trans_a: str = "N", diag: str = "N", *,
         tile: int = 1024, runtime: Any = None, memory_budget: int = 1 << 30, check_finite: bool = True) -> np.ndarray:
    """``X`` with ``op(a) X = alpha b`` (side L) or ``X op(a) = alpha b`` (side R), ``a`` triangular."""
    return _call("trsm", runtime, memory_budget, check_finite, a=a, b=b, alpha=alpha, side=side, uplo=uplo,
                 trans_a=trans_a, diag=diag, tile=tile)

"""Freivalds' check of a level-3 BLAS result without recomputing it.

For a random vector ``x`` the result ``C`` must satisfy ``C x = alpha op(A) (op(B) x) + beta C0 x``
(and the analogue for each routine), which costs a few matrix-vector products: O(n^2) reads
instead of O(n^3) flops (Freivalds 1977). Everything is evaluated in float64, streaming the
operands band by band, so it works for results that do not fit in memory.

The residual is taken row by row, relative to the same products in absolute values:
``r = max_i |C x - rhs|_i / (|C||x| + |alpha||op(A)|(|op(B)||x|) + |beta||C0||x|)_i``. A row's
``r`` is at most the largest componentwise error ``|fl(C) - C|_ij / (|A||B|)_ij`` of its entries,
so the tolerance is a bound on that error (:func:`tolerance`):

- float64: the worst case ``2 (k + 2) eps`` (the componentwise bound ``|fl(AB) - AB| <= gamma_k
  |A||B|``, Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., Sec. 3.5), which
  never rejects a correct result and still catches any tile error above about ``1e-12`` of its
  rows' magnitude (a wrong, zeroed or shifted tile).
- float32: the worst case (``1e-3`` at k = 4096, 0.24 at k = 10^6) let results with a whole
  k-panel or output tile missing pass (a trial). Rounding errors of a correct product grow like
  ``sqrt(k) u``, not ``k u``: Higham and Mary, "A New Approach to Probabilistic Rounding Error
  Analysis", SIAM J. Sci. Comput. 41(5), 2019, Thm. 3.1: ``|fl(AB) - AB| <= lambda sqrt(k) u
  |A||B|`` (``u = eps / 2``, to first order) with probability at least ``1 - 2 k exp(-lambda^2 / 2)``
  per entry, for rounding errors that are independent with mean zero. With ``lambda = 12``
  (:data:`LAMBDA`) and a union over every entry, a correct product of up to ``m n k = 1e18``
  fails with probability below ``1e-12``; the tolerance is ``6 sqrt(k + 2) eps``. Correct results
  measured over 100x below it (see :data:`LAMBDA`); it catches an output tile missing one of four
  k-panels (4096^3, tile 1024: residual 9.9x the tolerance) or never written (8192^3, tile 2048:
  7.1x). What it does not guarantee: inputs whose rounding errors are strongly
  correlated over long sums (the assumption above); matrices of one repeated value, the case
  measured nearest to it, still sat 25x below.

The float64 evaluation of the check adds at most about ``(k + n) 1.1e-16`` to ``r``, far below
either tolerance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from paperline.kernels.blas.plan import Problem
from paperline.kernels.blas.sources import TileSource

BAND_BYTES = 64 << 20

# lambda of Higham and Mary's probabilistic bound (module docstring): the float32 tolerance is
# lambda sqrt(n) u = 6 sqrt(n) eps over n = k + 2 rounded terms (2k + 2 for SYR2K). Chosen after
# measuring residual / (sqrt(n) eps) of correct results of the tiled run (every routine and flag,
# alpha 1.5, beta 0.5 with C, m x n = 37 x 23, k = 101, 1023, 4099, 16381 for GEMM/SYRK/SYR2K and
# 101..4099 for SYMM/TRMM/TRSM, tiles 128-1024, three projections each, OpenBLAS, 936 cases):
# float32 worst 0.048 with standard normal inputs, 0.057 with all-positive uniform [0, 1) ones
# (SYMM, k = 101: the final rounding of C dominates at small k), 0.24 with every entry 0.1 (GEMM,
# k = 4099). Against 6 that is 105x below the tolerance for random data and 25x for the constant
# matrices. float64's worst residual sat at 0.0031 of its worst-case tolerance.
LAMBDA = 12.0


@dataclass(frozen=True)
class Verification:
    """The outcome of :func:`freivalds`.

    Attributes:
        residual: the largest row-wise relative residual ``r`` (dimensionless).
        tolerance: the bound ``r`` must stay under.
        passed: ``residual <= tolerance`` (and finite).
    """

    residual: float
    tolerance: float
    passed: bool


def _mask(block: np.ndarray, r0: int, mask: str) -> np.ndarray:
    if not mask:
        return block
    rows = np.arange(r0, r0 + block.shape[0])[:, None]
    cols = np.arange(block.shape[1])[None, :]
    upper = mask[0] == "U"
    keep = cols >= rows if upper else cols <= rows
    if mask.endswith("u"):
        keep &= cols != rows
    out = np.where(keep, block, 0.0)
    return out + _unit(block.shape, r0) if mask.endswith("u") else out


def matvec(source: TileSource, x: np.ndarray, xa: np.ndarray, *, trans: bool = False, mask: str = "",
           symmetric: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``(M' x, |M'| xa)`` in float64 for ``M' = op(mask(M))``, reading ``M`` in row bands.

    Args:
        source: the stored matrix M.
        x, xa: float64 vectors (``xa`` non-negative).
        trans: ``op`` is the transpose.
        mask: ``""``, ``"U"``/``"L"`` (triangle), ``"Uu"``/``"Lu"`` (triangle, unit diagonal).
        symmetric: M' is the symmetric matrix whose ``mask`` triangle (``"U"``/``"L"``) is stored.
    """
    rows, cols = source.shape
    band = max(1, BAND_BYTES // max(1, cols * 8))
    out_len = cols if trans else rows
    if symmetric:
        out_len = rows
    y, ya = np.zeros(out_len), np.zeros(out_len)
    # An inf read with check_finite off makes inf - inf = NaN in the products: the residual is then
    # not finite and the check fails, which is the report; NumPy's RuntimeWarning on top of it was
    # noise on the run's output (a trial; the README promises none).
    with np.errstate(invalid="ignore", over="ignore"):
        _accumulate(source, x, xa, y, ya, band, trans, mask, symmetric)
    return y, ya


def _accumulate(source: TileSource, x: np.ndarray, xa: np.ndarray, y: np.ndarray, ya: np.ndarray, band: int,
                trans: bool, mask: str, symmetric: bool) -> None:
    """:func:`matvec`'s loop over row bands, adding into ``y`` and ``ya``."""
    rows, cols = source.shape
    for r0 in range(0, rows, band):
        r1 = min(rows, r0 + band)
        block = source.read(slice(r0, r1), slice(0, cols)).astype(np.float64)
        if symmetric:
            tri = _mask(block, r0, mask)
            strict = _mask(block, r0, mask + "u") - _unit(block.shape, r0)  # the triangle without its diagonal
            y[r0:r1] += tri @ x
            ya[r0:r1] += np.abs(tri) @ xa
            y += strict.T @ x[r0:r1]
            ya += np.abs(strict).T @ xa[r0:r1]
            continue
        block = _mask(block, r0, mask)
        if trans:
            y += block.T @ x[r0:r1]
            ya += np.abs(block).T @ xa[r0:r1]
        else:
            y[r0:r1] = block @ x
            ya[r0:r1] = np.abs(block) @ xa


def _unit(shape: tuple[int, int], r0: int) -> np.ndarray:
    out = np.zeros(shape)
    idx = np.arange(r0, min(r0 + shape[0], shape[1]))
    out[idx - r0, idx] = 1.0
    return out


def tolerance(problem: Problem) -> float:
    """The largest row residual :func:`freivalds` accepts for ``problem`` (dimensionless; see the
    module docstring for the derivation and the measurements).

    Returns:
        float64: ``2 (k + 2) eps`` (worst case); float32: ``LAMBDA / 2 * sqrt(n) * eps`` with
        ``n = k + 2`` rounded terms per entry (``2 k + 2`` for SYR2K), ``k`` = ``problem.inner``
        and ``eps`` = 2^-23 (Higham and Mary 2019, Thm. 3.1, with ``u = eps / 2``).
    """
    eps = float(np.finfo(problem.dtype).eps)
    if problem.dtype == np.float64:
        return 2.0 * (problem.inner + 2) * eps
    terms = (2 if problem.routine == "syr2k" else 1) * problem.inner + 2  # + alpha's product, + beta C0
    return LAMBDA * math.sqrt(terms) * eps / 2.0


def freivalds(problem: Problem, result: TileSource, seed: int = 0) -> Verification:
    """Check ``result`` against ``problem`` with one random projection (see the module docstring).

    Args:
        problem: the problem solved.
        result: the result matrix (``problem.out_shape``).
        seed: the seed of ``x``.

    Returns:
        A :class:`Verification`.
    """
    p = problem
    n = p.out_shape[1]
    x = np.random.default_rng(seed).standard_normal(n)
    xa = np.abs(x)
    with np.errstate(invalid="ignore", over="ignore"):  # an inf operand: see matvec
        return _freivalds(p, result, x, xa)


def _freivalds(p: Problem, result: TileSource, x: np.ndarray, xa: np.ndarray) -> Verification:
    A, B, C = p.a, p.b, p.c
    alpha, beta = p.alpha, p.beta
    uplo = "L" if p.lower else "U"
    tri = uplo + ("u" if p.unit_diagonal else "")

    def scaled(s: float, pair: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        return s * pair[0], abs(s) * pair[1]

    def plus(*pairs: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        return sum(q[0] for q in pairs), sum(q[1] for q in pairs)

    def c0_term(symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
        if C is None or beta == 0.0:
            return np.zeros(p.out_shape[0]), np.zeros(p.out_shape[0])
        return scaled(beta, matvec(C, x, xa, mask=uplo if symmetric else "", symmetric=symmetric))

    r = p.routine
    if r == "gemm":
        v = matvec(B, x, xa, trans=p.trans_b)
        rhs = plus(scaled(alpha, matvec(A, *v, trans=p.trans_a)), c0_term(False))
        lhs = matvec(result, x, xa)
    elif r == "symm":
        if p.side == "L":
            v = matvec(B, x, xa)
            prod = matvec(A, *v, mask=uplo, symmetric=True)
        else:
            v = matvec(A, x, xa, mask=uplo, symmetric=True)
            prod = matvec(B, *v)
        rhs = plus(scaled(alpha, prod), c0_term(False))
        lhs = matvec(result, x, xa)
    elif r in ("syrk", "syr2k"):
        ta = p.trans_a
        if r == "syrk":
            prod = matvec(A, *matvec(A, x, xa, trans=not ta), trans=ta)
        else:
            prod = plus(matvec(A, *matvec(B, x, xa, trans=not ta), trans=ta),
                        matvec(B, *matvec(A, x, xa, trans=not ta), trans=ta))
        rhs = plus(scaled(alpha, prod), c0_term(True))
        lhs = matvec(result, x, xa, mask=uplo, symmetric=True)
    elif r == "trmm":
        if p.side == "L":
            prod = matvec(A, *matvec(B, x, xa), mask=tri, trans=p.trans_a)
        else:
            prod = matvec(B, *matvec(A, x, xa, mask=tri, trans=p.trans_a))
        rhs = scaled(alpha, prod)
        lhs = matvec(result, x, xa)
    else:  # trsm: op(A) X = alpha B  or  X op(A) = alpha B
        if p.side == "L":
            lhs = matvec(A, *matvec(result, x, xa), mask=tri, trans=p.trans_a)
        else:
            lhs = matvec(result, *matvec(A, x, xa, mask=tri, trans=p.trans_a))
        rhs = scaled(alpha, matvec(B, x, xa))
    if r in ("syrk", "syr2k") and not _other_triangle_unchanged(result, C, p.lower):
        return Verification(float("inf"), tolerance(p), False)
    diff = np.abs(lhs[0] - rhs[0])
    scale = lhs[1] + rhs[1]
    with np.errstate(divide="ignore", invalid="ignore"):
        rows = np.where(scale > 0, diff / np.where(scale > 0, scale, 1.0), np.where(diff == 0, 0.0, np.inf))
    residual = float(rows.max()) if rows.size else 0.0
    bound = tolerance(p)
    return Verification(residual, bound, bool(np.isfinite(residual) and residual <= bound))


def _other_triangle_unchanged(result: TileSource, c: TileSource | None, lower: bool) -> bool:
    """SYRK/SYR2K leave the triangle opposite ``uplo`` as it was in C (zeros without C)."""
    rows, cols = result.shape
    band = max(1, BAND_BYTES // max(1, cols * 8))
    for r0 in range(0, rows, band):
        r1 = min(rows, r0 + band)
        got = result.read(slice(r0, r1), slice(0, cols))
        want = c.read(slice(r0, r1), slice(0, cols)) if c is not None else np.zeros_like(got)
        rr = np.arange(r0, r1)[:, None]
        cc = np.arange(cols)[None, :]
        other = cc > rr if lower else cc < rr
        if not np.array_equal(got[other], want[other], equal_nan=True):  # a NaN C had there stays
            return False
    return True

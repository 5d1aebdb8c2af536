"""Freivalds' verification (kernels/blas/verify.py) at the sizes where its tolerance matters: a
float32 result missing one k-panel of one tile, or one tile never written, is rejected (the
worst-case bound 2 (k + 2) eps let both pass: a trial), while correct results of every routine
and dtype pass with a wide margin, all-positive inputs at a large k included; and the check
fails over operands holding inf without NumPy's warnings.

The basic cases (correct results pass, one corrupted tile is caught, SYRK's other triangle) are
in test_blas.py.
"""

from __future__ import annotations

import itertools
import warnings
import numpy as np
import pytest

from paperline.kernels.blas.plan import make_problem
from paperline.kernels.blas.runtime import run
from paperline.kernels.blas.sources import ArraySource
from paperline.kernels.blas.verify import freivalds, matvec, tolerance


def _operands(m, n, k, seed=0):
    r = np.random.default_rng(seed)
    return r.standard_normal((m, k), dtype=np.float32), r.standard_normal((k, n), dtype=np.float32)


@pytest.mark.parametrize("m, n, damage", [(128, 512, "panel"), (128, 2048, "never written")])
def test_float32_result_missing_a_k_panel_or_a_tile_is_rejected(m, n, damage):
    # k = 4096, tile 128: the worst-case tolerance is 9.8e-4 and these residuals are ~4e-4-5e-4
    k, t = 4096, 128
    a, b = _operands(m, n, k)
    c = a @ b
    problem = make_problem("gemm", a, b, tile=t)
    ok = freivalds(problem, ArraySource(c))
    assert ok.passed and ok.residual < ok.tolerance / 1000, ok
    wrong = c.copy()
    if damage == "panel":
        wrong[:t, :t] -= a[:t, :t] @ b[:t, :t]  # output tile (0, 0) without its first k-panel
    else:
        wrong[:t, :t] = 0.0
    v = freivalds(problem, ArraySource(wrong))
    assert v.residual < 2 * (k + 2) * np.finfo(np.float32).eps  # what the old bound let through
    assert not v.passed and v.residual > 5 * v.tolerance, v


def test_the_float32_tolerance_grows_like_sqrt_k_and_float64s_stays_the_worst_case():
    def problem(dtype, routine, k):
        a = np.ones((3, k), dtype)
        return make_problem(routine, a, a if routine == "syr2k" else None, trans_a="N", tile=64) \
            if routine != "gemm" else make_problem("gemm", a, a.T, tile=64)

    eps32, eps64 = float(np.finfo(np.float32).eps), float(np.finfo(np.float64).eps)
    assert tolerance(problem(np.float32, "gemm", 4094)) == pytest.approx(6 * 64 * eps32)
    assert tolerance(problem(np.float32, "syr2k", 2047)) == pytest.approx(6 * 64 * eps32)  # 2k + 2 terms
    assert tolerance(problem(np.float64, "gemm", 4094)) == pytest.approx(2 * 4096 * eps64)


def _draw(r, shape, dtype, dist):
    return (r.random(shape) if dist == "positive" else r.standard_normal(shape)).astype(dtype)


def _correct_cases():
    """Every routine and flag on odd sizes, k large where it is cheap (small m, n)."""
    m, n = 37, 23
    for ta, tb in itertools.product("NT", "NT"):
        k = 16381
        yield "gemm", dict(trans_a=ta, trans_b=tb), dict(a=(k, m) if ta == "T" else (m, k),
                                                         b=(n, k) if tb == "T" else (k, n), c=(m, n))
    for routine, trans, uplo in itertools.product(("syrk", "syr2k"), "NT", "UL"):
        k = 16381
        shape = (k, n) if trans == "T" else (n, k)
        yield routine, dict(trans_a=trans, uplo=uplo), dict(a=shape, b=shape if routine == "syr2k" else None, c=(n, n))
    for side, uplo in itertools.product("LR", "UL"):
        k = 1025
        yield "symm", dict(side=side, uplo=uplo), dict(a=(k, k), b=(k, n) if side == "L" else (m, k),
                                                       c=(k, n) if side == "L" else (m, k))
    for routine, side, uplo, trans, diag in itertools.product(("trmm", "trsm"), "LR", "UL", "NT", "NU"):
        k = 1025
        yield routine, dict(side=side, uplo=uplo, trans_a=trans, diag=diag), dict(
            a=(k, k), b=(k, n) if side == "L" else (m, k))


@pytest.mark.parametrize("dist", ["normal", "positive"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["fp32", "fp64"])
def test_correct_results_of_every_routine_pass_with_a_tenfold_margin(dtype, dist):
    """All-positive inputs (uniform [0, 1)) are the case where rounding errors do not cancel in the
    sums; the measured worst float32 residual is ~0.06 sqrt(k) eps against 6 sqrt(k) eps."""
    worst = 0.0
    for i, (routine, flags, shapes) in enumerate(_correct_cases()):
        r = np.random.default_rng(i)
        ops = {name: _draw(r, shape, dtype, dist) for name, shape in shapes.items() if shape is not None}
        if routine == "trsm":  # well conditioned, as the flow's generated A (n added to its diagonal)
            k = ops["a"].shape[0]
            if flags["diag"] == "U":
                ops["a"] /= k
            ops["a"][np.arange(k), np.arange(k)] += k
        problem = make_problem(routine, ops["a"], ops.get("b"), ops.get("c"), alpha=1.5,
                               beta=-0.5 if "c" in ops else 0.0, tile=1024 if routine in ("gemm", "syrk", "syr2k") else 256,
                               **flags)
        result = run(problem).output
        for seed in (0, 1):
            v = freivalds(problem, ArraySource(result, "result"), seed=seed)
            assert v.passed, (problem.describe(), v)
            worst = max(worst, v.residual / v.tolerance)
    assert worst < 0.1, worst



def test_matvec_over_an_inf_operand_warns_nothing():
    """An inf in an operand (check_finite off) gives inf - inf = NaN in the products: the check
    fails without NumPy's RuntimeWarning on the run's output (README: "without NumPy's warnings")."""
    a = np.random.default_rng(0).standard_normal((300, 200))
    a[9] = np.where(np.arange(200) % 2, np.inf, -np.inf)  # as a result read back after an inf in A
    x = np.random.default_rng(1).standard_normal(200)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y, _ = matvec(ArraySource(a), x, np.abs(x))
        for trans, mask, symmetric in ((True, "", False), (False, "U", True), (False, "Lu", False)):
            square = ArraySource(a[:200])
            matvec(square, x, np.abs(x), trans=trans, mask=mask, symmetric=symmetric)
    assert not np.isfinite(y).all()


@pytest.mark.parametrize("routine", ["gemm", "syr2k"])
def test_freivalds_over_an_inf_operand_fails_without_warnings(routine):
    a = np.random.default_rng(0).standard_normal((40, 30))
    b = np.random.default_rng(1).standard_normal((40, 30) if routine == "syr2k" else (30, 20))
    a[3, 4] = np.inf
    problem = make_problem(routine, a, b, tile=16)
    with np.errstate(all="ignore"):
        result = run(problem, check_finite=False).output
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        v = freivalds(problem, ArraySource(result, "result"))
    assert not v.passed

"""Tiled level-3 BLAS (kernels/blas): every routine and flag against scipy.linalg.blas on sizes that
do not divide the tile, Freivalds' verification (passes on correct results, catches one bad tile),
the validation of bad input, the seeded random source and the L1 tile cache.

The runtime side (out-of-core runs, cache counters, staged output files, peer fetch, Dask) is in
test_blas_runtime.py.
"""

from __future__ import annotations

import functools
import io
import itertools

import numpy as np
import pytest
import scipy.linalg.blas as sblas

from paperline.kernels.blas import api
from paperline.kernels.blas.plan import make_problem, n_tiles
from paperline.kernels.blas.runtime import run
from paperline.kernels.blas.sources import ArraySource, RandomSource, read_all
from paperline.kernels.blas.verify import freivalds, tolerance
from paperline.kernels.blas.worker import TileCache
from paperline.kernels.errors import Described, InputError

M, N, K, TILE = 1000, 777, 513, 256  # the example: no dimension is a multiple of the tile
ALPHA, BETA = 1.5, -0.75
TOL = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-4}
DTYPES = [pytest.param(np.float32, id="fp32"), pytest.param(np.float64, id="fp64")]


def rand(shape, dtype, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def triangular_operand(n, dtype, seed):
    """A full n x n matrix (both triangles hold values; a routine may read only its uplo one) whose
    either triangle is well conditioned, with its stored or a unit diagonal: off-diagonals ~ 1/sqrt(n),
    diagonal ~ 2."""
    return (rand((n, n), np.float64, seed) / np.sqrt(n) + 2.0 * np.eye(n)).astype(dtype)


def scipy_blas(name, dtype):
    return getattr(sblas, ("d" if np.dtype(dtype) == np.float64 else "s") + name)


def assert_matches(got, ref, dtype, what=""):
    """``got`` has ``ref``'s shape and the operands' dtype, and max|got - ref| / max|ref| <= TOL."""
    assert got.shape == ref.shape, what
    assert got.dtype == np.dtype(dtype), what
    err = float(np.max(np.abs(got.astype(np.float64) - ref)) / np.max(np.abs(ref)))
    assert err <= TOL[np.dtype(dtype)], f"{what}: relative max-abs error {err:.3g}"


def assert_verified(problem, result):
    v = freivalds(problem, ArraySource(result, "result"))
    assert v.passed, f"{problem.describe()}: Freivalds residual {v.residual:.3g} > tolerance {v.tolerance:.3g}"


# --- 1. every routine and flag against scipy.linalg.blas, tile 256 on 1000 x 777 (k 513) ----------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trans_a, trans_b", list(itertools.product("NT", "NT")))
def test_gemm_matches_scipy(dtype, trans_a, trans_b):
    a = rand((M, K) if trans_a == "N" else (K, M), dtype, 1)
    b = rand((K, N) if trans_b == "N" else (N, K), dtype, 2)
    c = rand((M, N), dtype, 3)
    got = api.gemm(ALPHA, a, b, BETA, c, trans_a, trans_b, tile=TILE)
    ref = scipy_blas("gemm", dtype)(ALPHA, a, b, BETA, c, trans_a == "T", trans_b == "T")
    assert_matches(got, ref, dtype)
    assert_verified(make_problem("gemm", a, b, c, alpha=ALPHA, beta=BETA, trans_a=trans_a, trans_b=trans_b,
                                 tile=TILE), got)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("side, uplo", list(itertools.product("LR", "UL")))
def test_symm_matches_scipy(dtype, side, uplo):
    # a is not symmetric: only its uplo triangle may be read (as in the reference BLAS)
    a = rand((M, M) if side == "L" else (N, N), dtype, 4)
    b, c = rand((M, N), dtype, 5), rand((M, N), dtype, 6)
    got = api.symm(ALPHA, a, b, BETA, c, side, uplo, tile=TILE)
    ref = scipy_blas("symm", dtype)(ALPHA, a, b, BETA, c, side == "R", uplo == "L")
    assert_matches(got, ref, dtype)
    assert_verified(make_problem("symm", a, b, c, alpha=ALPHA, beta=BETA, side=side, uplo=uplo, tile=TILE), got)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_c", [False, True], ids=["no_c", "c"])
@pytest.mark.parametrize("trans, uplo", list(itertools.product("NT", "UL")))
@pytest.mark.parametrize("routine", ["syrk", "syr2k"])
def test_syrk_syr2k_match_scipy(routine, trans, uplo, with_c, dtype):
    # op(a) is N x K; the result N x N. Only the uplo triangle is computed, the other is c's (zeros
    # without c): scipy returns the same, so the full matrices are compared.
    shape = (N, K) if trans == "N" else (K, N)
    ops = (rand(shape, dtype, 7),) if routine == "syrk" else (rand(shape, dtype, 7), rand(shape, dtype, 8))
    c = rand((N, N), dtype, 9) if with_c else None
    ref_fn = scipy_blas(routine, dtype)
    if with_c:
        got = getattr(api, routine)(ALPHA, *ops, BETA, c, trans, uplo, tile=TILE)
        ref = ref_fn(ALPHA, *ops, BETA, c, trans == "T", uplo == "L")
    else:
        got = getattr(api, routine)(ALPHA, *ops, trans=trans, uplo=uplo, tile=TILE)
        ref = ref_fn(ALPHA, *ops, trans=trans == "T", lower=uplo == "L")
    assert_matches(got, ref, dtype)
    other = np.tril(np.ones((N, N), bool), -1) if uplo == "U" else np.triu(np.ones((N, N), bool), 1)
    np.testing.assert_array_equal(got[other], c[other] if with_c else 0.0)  # bit for bit
    b = ops[1] if routine == "syr2k" else None
    assert_verified(make_problem(routine, ops[0], b, c, alpha=ALPHA, beta=BETA if with_c else 0.0, trans_a=trans,
                                 uplo=uplo, tile=TILE), got)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("side, uplo, trans_a, diag", list(itertools.product("LR", "UL", "NT", "NU")))
@pytest.mark.parametrize("routine", ["trmm", "trsm"])
def test_trmm_trsm_match_scipy(routine, side, uplo, trans_a, diag, dtype):
    # a holds values in both triangles and a diagonal of about 2: reading the wrong triangle or
    # ignoring diag="U" would be far off the reference.
    a = triangular_operand(M if side == "L" else N, dtype, 10)
    b = rand((M, N), dtype, 11)
    got = getattr(api, routine)(ALPHA, a, b, side, uplo, trans_a, diag, tile=TILE)
    ref = scipy_blas(routine, dtype)(ALPHA, a, b, side == "R", uplo == "L", trans_a == "T", diag == "U")
    assert_matches(got, ref, dtype)
    assert_verified(make_problem(routine, a, b, alpha=ALPHA, side=side, uplo=uplo, trans_a=trans_a, diag=diag,
                                 tile=TILE), got)


@pytest.mark.parametrize("tile", [1, 3, 8])
@pytest.mark.parametrize("routine", ["gemm", "symm", "syrk", "syr2k", "trmm", "trsm"])
def test_tiny_sizes_every_flag_any_tile(routine, tile):
    """7 x 5 (k 4) with tile 1 (every entry a tile), 3 (edge tiles everywhere) and 8 (one tile)."""
    m, n, k = 7, 5, 4
    for dtype in (np.float32, np.float64):
        ref_fn = scipy_blas(routine, dtype)
        if routine == "gemm":
            for ta, tb in itertools.product("NT", "NT"):
                a = rand((m, k) if ta == "N" else (k, m), dtype, 1)
                b = rand((k, n) if tb == "N" else (n, k), dtype, 2)
                c = rand((m, n), dtype, 3)
                assert_matches(api.gemm(ALPHA, a, b, BETA, c, ta, tb, tile=tile),
                               ref_fn(ALPHA, a, b, BETA, c, ta == "T", tb == "T"), dtype, f"{ta}{tb}")
        elif routine == "symm":
            for side, uplo in itertools.product("LR", "UL"):
                a = rand((m, m) if side == "L" else (n, n), dtype, 4)
                b, c = rand((m, n), dtype, 5), rand((m, n), dtype, 6)
                assert_matches(api.symm(ALPHA, a, b, BETA, c, side, uplo, tile=tile),
                               ref_fn(ALPHA, a, b, BETA, c, side == "R", uplo == "L"), dtype, f"{side}{uplo}")
        elif routine in ("syrk", "syr2k"):
            for trans, uplo in itertools.product("NT", "UL"):
                shape = (n, k) if trans == "N" else (k, n)
                ops = [rand(shape, dtype, 7)] + ([rand(shape, dtype, 8)] if routine == "syr2k" else [])
                c = rand((n, n), dtype, 9)
                assert_matches(getattr(api, routine)(ALPHA, *ops, BETA, c, trans, uplo, tile=tile),
                               ref_fn(ALPHA, *ops, BETA, c, trans == "T", uplo == "L"), dtype, f"{trans}{uplo}")
        else:
            for side, uplo, ta, diag in itertools.product("LR", "UL", "NT", "NU"):
                a = triangular_operand(m if side == "L" else n, dtype, 10)
                b = rand((m, n), dtype, 11)
                assert_matches(getattr(api, routine)(ALPHA, a, b, side, uplo, ta, diag, tile=tile),
                               ref_fn(ALPHA, a, b, side == "R", uplo == "L", ta == "T", diag == "U"), dtype,
                               f"{side}{uplo}{ta}{diag}")


def test_beta_zero_never_reads_c():
    """BLAS semantics: with beta = 0, C is not read (a NaN there neither fails check_finite nor leaks)."""
    a, b = rand((M, K), np.float64, 1), rand((K, N), np.float64, 2)
    c = np.full((M, N), np.nan)
    got = api.gemm(ALPHA, a, b, 0.0, c, tile=TILE)
    assert_matches(got, ALPHA * (a @ b), np.float64)


def test_unreferenced_triangle_is_never_read():
    """A NaN outside the uplo triangle of a is not an error (check_finite on) and does not leak."""
    a = triangular_operand(M, np.float64, 10)
    a[700, 20] = a[5, 3] = np.nan  # strictly lower: one in an off-diagonal tile, one in a diagonal tile
    b = rand((M, N), np.float64, 11)
    clean = np.triu(a)
    for routine in ("trmm", "trsm"):
        got = getattr(api, routine)(ALPHA, a, b, "L", "U", "N", "N", tile=TILE)
        assert_matches(got, scipy_blas(routine, np.float64)(ALPHA, clean, b), np.float64, routine)
    got = api.symm(ALPHA, a, b, 0.0, None, "L", "U", tile=TILE)
    assert_matches(got, scipy_blas("symm", np.float64)(ALPHA, clean, b), np.float64, "symm")


# --- 4. Freivalds ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _solved(routine, dtype, uplo="U"):
    """(problem, correct result) of one call per routine, 1000 x 777 (k 513), tile 256 (cached: copy
    the result before changing it)."""
    if routine == "gemm":
        p = make_problem("gemm", rand((M, K), dtype, 1), rand((K, N), dtype, 2), rand((M, N), dtype, 3),
                         alpha=ALPHA, beta=BETA, tile=TILE)
    elif routine == "symm":
        p = make_problem("symm", rand((N, N), dtype, 4), rand((M, N), dtype, 5), rand((M, N), dtype, 6),
                         alpha=ALPHA, beta=BETA, side="R", uplo=uplo, tile=TILE)
    elif routine in ("syrk", "syr2k"):
        b = rand((K, N), dtype, 8) if routine == "syr2k" else None
        p = make_problem(routine, rand((K, N), dtype, 7), b, rand((N, N), dtype, 9), alpha=ALPHA, beta=BETA,
                         trans_a="T", uplo=uplo, tile=TILE)
    else:
        p = make_problem(routine, triangular_operand(M, dtype, 10), rand((M, N), dtype, 11), alpha=ALPHA,
                         side="L", uplo=uplo, trans_a="T", tile=TILE)
    x = run(p).output
    x.flags.writeable = False
    return p, x


ALL_ROUTINES = ["gemm", "symm", "syrk", "syr2k", "trmm", "trsm"]


def _corrupt(x, how):
    """One tile of the result made wrong (in the uplo="U" triangle for SYRK/SYR2K)."""
    bad = x.copy()
    if how == "plus1":  # interior tile (1, 2), + 1.0
        bad[TILE:2 * TILE, 2 * TILE:3 * TILE] += 1.0
    elif how == "zero":  # interior tile (1, 2) zeroed
        bad[TILE:2 * TILE, 2 * TILE:3 * TILE] = 0.0
    else:  # "zero_edge": the 256 x 9 edge tile (0, 3) zeroed
        bad[:TILE, 3 * TILE:] = 0.0
    return bad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("routine", ALL_ROUTINES)
def test_freivalds_passes_correct_results(routine, dtype):
    p, x = _solved(routine, dtype)
    v = freivalds(p, ArraySource(x, "result"))
    assert v.passed and v.residual <= v.tolerance, v
    assert v.tolerance == pytest.approx(tolerance(p))  # test_blas_verify.py: its values
    # another projection (seed) passes too; a result from other operands does not
    assert freivalds(p, ArraySource(x, "result"), seed=7).passed
    _, y = _solved("gemm" if routine != "gemm" else "symm", dtype)
    if y.shape == x.shape:
        assert not freivalds(p, ArraySource(y, "result")).passed


@pytest.mark.parametrize("dtype, how", [(np.float64, "plus1"), (np.float64, "zero_edge"), (np.float32, "zero")],
                         ids=["fp64-plus1", "fp64-zero_edge", "fp32-zero"])
@pytest.mark.parametrize("routine", ALL_ROUTINES)
def test_freivalds_catches_one_bad_tile(routine, dtype, how):
    p, x = _solved(routine, dtype)
    assert freivalds(p, ArraySource(x, "result")).passed
    v = freivalds(p, ArraySource(_corrupt(x, how), "result"))
    assert not v.passed and v.residual > 2 * v.tolerance, v


@pytest.mark.parametrize("uplo", ["U", "L"])
@pytest.mark.parametrize("routine", ["syrk", "syr2k"])
def test_freivalds_requires_the_other_triangle_unchanged(routine, uplo):
    p, x = _solved(routine, np.float64, uplo)
    assert freivalds(p, ArraySource(x, "result")).passed
    bad = x.copy()
    i, j = (3, 700) if uplo == "L" else (700, 3)  # outside the computed triangle
    bad[i, j] += 1e-3
    v = freivalds(p, ArraySource(bad, "result"))
    assert not v.passed and v.residual == float("inf")
    # the same change inside the triangle is caught by the projection instead
    bad = x.copy()
    bad[j, i] += 1.0
    v = freivalds(p, ArraySource(bad, "result"))
    assert not v.passed and np.isfinite(v.residual) and v.residual > v.tolerance


@pytest.mark.parametrize("routine", ["syrk", "syr2k"])
def test_a_nan_in_the_triangle_of_c_that_is_not_read_verifies(routine):
    """SYRK/SYR2K return C's other triangle unchanged, NaN included (reference BLAS does): the
    result is correct and passes verification; a NaN *changed* there does not."""
    a = rand((N, K), np.float64, 7)
    b = rand((N, K), np.float64, 8) if routine == "syr2k" else None
    c = rand((N, N), np.float64, 9)
    c[10, 200] = np.nan  # strictly upper; uplo L
    p = make_problem(routine, a, b, c, alpha=ALPHA, beta=BETA, uplo="L", tile=TILE)
    x = run(p).output
    assert np.isnan(x[10, 200]) and np.isfinite(np.tril(x)).all()
    assert freivalds(p, ArraySource(x, "result")).passed
    x[10, 200] = 0.0
    assert not freivalds(p, ArraySource(x, "result")).passed


def test_freivalds_other_triangle_without_c_must_be_zero():
    a = rand((N, K), np.float64, 7)
    p = make_problem("syrk", a, alpha=ALPHA, uplo="L", tile=TILE)
    x = run(p).output
    assert freivalds(p, ArraySource(x, "result")).passed
    x[0, N - 1] = 1e-9
    assert not freivalds(p, ArraySource(x, "result")).passed


# --- 5. bad input ---------------------------------------------------------------------------------


def assert_input_error(excinfo, argument, value):
    """The error names ``argument`` and the value seen: the message starts ``argument=repr(value):``."""
    err = excinfo.value
    assert type(err) is InputError
    assert err.argument == argument
    assert err.value == value
    assert str(err).startswith(f"{argument}={value!r}: "), str(err)


def test_nonconforming_shapes_are_refused():
    f64 = np.float64
    with pytest.raises(InputError, match="op\\(b\\) has 512 rows, op\\(a\\) has 513 columns") as e:
        make_problem("gemm", rand((M, K), f64, 1), rand((K - 1, N), f64, 2), tile=TILE)
    assert_input_error(e, "b", (K - 1, N))
    with pytest.raises(InputError, match="expected \\(1000, 777\\)") as e:
        api.gemm(1.0, rand((M, K), f64, 1), rand((K, N), f64, 2), 1.0, rand((N, M), f64, 3), tile=TILE)
    assert_input_error(e, "c", (N, M))
    with pytest.raises(InputError) as e:  # trans_a="T": op(a) is 513 x 1000, so k = 1000 != 513
        api.gemm(1.0, rand((M, K), f64, 1), rand((K, N), f64, 2), trans_a="T", tile=TILE)
    assert_input_error(e, "b", (K, N))
    with pytest.raises(InputError, match="SYMM needs a square a") as e:
        api.symm(1.0, rand((M, M - 1), f64, 1), rand((M, N), f64, 2), tile=TILE)
    assert_input_error(e, "a", (M, M - 1))
    with pytest.raises(InputError, match="on side R") as e:
        api.symm(1.0, rand((M, M), f64, 1), rand((M, N), f64, 2), side="R", tile=TILE)
    assert_input_error(e, "b", (M, N))
    with pytest.raises(InputError, match="SYR2K needs a and b of one shape") as e:
        api.syr2k(1.0, rand((N, K), f64, 1), rand((K, N), f64, 2), tile=TILE)
    assert_input_error(e, "b", (K, N))
    with pytest.raises(InputError) as e:
        api.syrk(1.0, rand((N, K), f64, 1), 1.0, rand((K, K), f64, 2), tile=TILE)
    assert_input_error(e, "c", (K, K))
    with pytest.raises(InputError, match="does not conform with a \\(1000, 1000\\) on side L") as e:
        api.trsm(1.0, triangular_operand(M, f64, 1), rand((N, M), f64, 2), tile=TILE)
    assert_input_error(e, "b", (N, M))
    with pytest.raises(InputError) as e:
        api.trmm(1.0, rand((M, N), f64, 1), rand((M, N), f64, 2), tile=TILE)
    assert_input_error(e, "a", (M, N))


def test_mixed_dtypes_are_refused():
    with pytest.raises(InputError, match="dtype differs from a \\(float64\\)") as e:
        api.gemm(1.0, rand((M, K), np.float64, 1), rand((K, N), np.float32, 2), tile=TILE)
    assert_input_error(e, "b", "float32")
    with pytest.raises(InputError, match="dtype differs from a \\(float32\\)") as e:
        api.gemm(1.0, rand((M, K), np.float32, 1), rand((K, N), np.float32, 2), 1.0, rand((M, N), np.float64, 3),
                 tile=TILE)
    assert_input_error(e, "c", "float64")
    # byte order is not a dtype: a big-endian float64 beside a native one was refused (a trial)
    a, b, c = rand((7, 5), np.float64, 1), rand((5, 3), np.float64, 2), rand((7, 3), np.float64, 3)
    want = sblas.dgemm(1.5, a, b, 0.5, c)
    for ops in ((a.astype(">f8"), b, c), (a, b.astype(">f8"), c.astype(">f8"))):
        got = api.gemm(1.5, *ops[:2], 0.5, ops[2], tile=2)
        np.testing.assert_allclose(got, want, rtol=1e-12)
        assert got.dtype == np.float64 and got.dtype.isnative  # as scipy's (a big-endian a gave a big-endian result)


def test_a_scalar_beyond_float64_is_refused_naming_it():
    a, b = rand((5, 4), np.float64, 1), rand((4, 3), np.float64, 2)
    with pytest.raises(InputError, match=r"^alpha=<100000000000...\(401 digits\)>: must be finite \(it is beyond float64\)"):
        api.gemm(10**400, a, b)  # was a bare OverflowError
    with pytest.raises(InputError, match="^beta=.*must be finite"):
        api.gemm(1.0, a, b, -(10**400))


def test_shape_and_dtype_errors_name_the_operands_file(tmp_path):
    """A file operand's shape or dtype error names the file (it named the shape or dtype alone, so
    the user could not tell which of their files was wrong: a fresh-user trial)."""
    paths = {}
    for name, array in (("a", np.ones((40, 30))), ("b", np.ones((31, 20))), ("b32", np.ones((30, 20), np.float32)),
                        ("sq", np.ones((40, 39))), ("c", np.ones((41, 20)))):
        paths[name] = str(tmp_path / f"{name}.npy")
        np.save(paths[name], array)
    with pytest.raises(InputError, match="^b='.*b.npy': shape \\(31, 20\\) does not conform: op\\(b\\) has 31 rows") as e:
        make_problem("gemm", paths["a"], paths["b"])
    assert_input_error(e, "b", paths["b"])
    with pytest.raises(InputError, match="dtype float32 differs from a \\(float64\\)") as e:
        make_problem("gemm", paths["a"], paths["b32"])
    assert_input_error(e, "b", paths["b32"])
    with pytest.raises(InputError, match="shape \\(41, 20\\) does not conform: expected \\(40, 20\\)") as e:
        make_problem("gemm", paths["a"], np.ones((30, 20)), paths["c"])
    assert_input_error(e, "c", paths["c"])
    with pytest.raises(InputError, match="shape \\(40, 39\\): SYMM needs a square a") as e:
        make_problem("symm", paths["sq"], np.ones((40, 20)))
    assert_input_error(e, "a", paths["sq"])
    with pytest.raises(InputError, match="shape \\(31, 20\\) does not conform with a \\(30, 30\\) on side L") as e:
        make_problem("symm", np.ones((30, 30)), paths["b"])
    assert_input_error(e, "b", paths["b"])


@pytest.mark.parametrize("tile", [0, -1, 1.5, "256", True, None])
def test_bad_tile_sizes_are_refused(tile):
    with pytest.raises(InputError, match="positive integer") as e:
        make_problem("gemm", rand((5, 4), np.float64, 1), rand((4, 3), np.float64, 2), tile=tile)
    assert_input_error(e, "tile", tile)


def test_bad_flags_and_scalars_are_refused():
    a, b = rand((5, 4), np.float64, 1), rand((4, 3), np.float64, 2)
    for kw, argument, value in [({"trans_a": "X"}, "trans_a", "X"), ({"trans_b": 3}, "trans_b", 3),
                                ({"side": "M"}, "side", "M"), ({"uplo": "A"}, "uplo", "A"),
                                ({"diag": "Z"}, "diag", "Z"), ({"alpha": float("nan")}, "alpha", float("nan")),
                                ({"beta": "x"}, "beta", "x")]:
        with pytest.raises(InputError) as e:
            make_problem("gemm", a, b, **kw)
        assert e.value.argument == argument
        assert str(e.value).startswith(f"{argument}={value!r}: ")
    with pytest.raises(InputError) as e:
        make_problem("gemv", a, b)
    assert_input_error(e, "routine", "gemv")


@pytest.mark.parametrize("routine", ["trsm", "TRSM", "Trsm"])
def test_routine_and_flags_take_either_case(routine):
    """BLAS users type GEMM as often as gemm: routine=GEMM was refused by the flow while side=r was
    refused for the other case (a trial); the Problem keeps them normalised."""
    a = rand((N, N), np.float64, 1) + N * np.eye(N)
    b = rand((M, N), np.float64, 2)
    lower = make_problem(routine.lower(), a, b, side="R", uplo="L", trans_a="T", diag="U", tile=TILE)
    mixed = make_problem(routine, a, b, side="r", uplo="l", trans_a="t", diag="u", tile=TILE)
    assert mixed.routine == "trsm" and mixed.describe() == lower.describe()
    assert (mixed.side, mixed.lower, mixed.trans_a, mixed.unit_diagonal) == ("R", True, True, True)
    with pytest.raises(InputError) as e:  # an unknown one is named as given
        make_problem("GEMV", a, b)
    assert_input_error(e, "routine", "GEMV")


@pytest.mark.parametrize("operand, trans_a", [("a", "N"), ("a", "T"), ("b", "N"), ("c", "N")])
def test_non_finite_operand_names_argument_and_index(operand, trans_a):
    ops = {"a": rand((M, K) if trans_a == "N" else (K, M), np.float64, 1), "b": rand((K, N), np.float64, 2),
           "c": rand((M, N), np.float64, 3)}
    # row 700 of the result (a, c) or column 700 (b); a tile off the diagonal
    r, col = (300, 700) if (operand == "a" and trans_a == "T") or operand == "b" else (700, 300)
    ops[operand][r, col] = np.nan if operand != "b" else -np.inf
    bad = "nan" if operand != "b" else "-inf"
    with pytest.raises(InputError, match="non-finite value \\(check_finite is on\\)") as e:
        api.gemm(ALPHA, ops["a"], ops["b"], BETA, ops["c"], trans_a, tile=TILE)
    assert_input_error(e, operand, f"{operand}[{r},{col}] = {bad}")
    # check_finite=False: no error, the value propagates (IEEE)
    got = api.gemm(ALPHA, ops["a"], ops["b"], BETA, ops["c"], trans_a, tile=TILE, check_finite=False)
    assert not np.isfinite(got).all()
    assert np.isfinite(got[:256]).all() if operand != "b" else np.isfinite(got[:, :256]).all()


def test_non_finite_in_symmetric_tile_named_by_its_stored_index():
    a, b = rand((M, M), np.float64, 1), rand((M, N), np.float64, 2)
    a[20, 600] = np.nan  # stored in the upper triangle; also read mirrored as a[600, 20]
    with pytest.raises(InputError) as e:
        api.symm(1.0, a, b, uplo="U", tile=TILE)
    assert_input_error(e, "a", "a[20,600] = nan")


def test_non_finite_in_a_diagonal_symmetric_tile_named_by_its_stored_index():
    a, b = rand((300, 300), np.float64, 1), rand((300, 50), np.float64, 2)
    a[20, 10] = np.nan  # stored (lower) triangle of the diagonal tile (0, 0)
    with pytest.raises(InputError) as e:
        api.symm(1.0, a, b, uplo="L", tile=128)
    assert_input_error(e, "a", "a[20,10] = nan")


def test_trsm_zero_diagonal_in_memory_is_caught_at_make_problem(tmp_path):
    a = triangular_operand(M, np.float64, 1)
    a[600, 600] = 0.0
    b = rand((M, N), np.float64, 2)
    with pytest.raises(InputError, match="nonzero diagonal") as e:
        make_problem("trsm", a, b, uplo="L", tile=TILE)
    assert_input_error(e, "a", "a[600,600] = 0")
    np.save(tmp_path / "a.npy", a)  # a file operand too: named as the value seen, the entry in the reason
    with pytest.raises(InputError, match="TRSM needs a nonzero diagonal, found a\\[600,600\\] = 0") as e:
        make_problem("trsm", str(tmp_path / "a.npy"), b, uplo="L", tile=TILE)
    assert_input_error(e, "a", str(tmp_path / "a.npy"))
    # a unit diagonal is not read: no error, and the result is the unit-diagonal solve
    got = api.trsm(1.0, a, b, uplo="L", diag="U", tile=TILE)
    assert_matches(got, sblas.dtrsm(1.0, a, b, lower=1, diag=1), np.float64)


class GeneratedArray:
    """A TileSource of kind "generated" (like RandomSource): make_problem cannot afford to scan it."""

    kind = "generated"

    def __init__(self, array):
        self.array, self.shape, self.dtype = array, array.shape, array.dtype
        self.key = f"test-generated:{id(array)}"
        self.reads = 0

    def read(self, rows, cols):
        self.reads += 1
        return np.ascontiguousarray(self.array[rows, cols])


@pytest.mark.parametrize("side, trans_a", [("L", "N"), ("R", "T")])
def test_trsm_zero_diagonal_found_by_the_worker(side, trans_a):
    a = triangular_operand(M if side == "L" else N, np.float64, 1)
    a[600, 600] = 0.0
    src = GeneratedArray(a)
    p = make_problem("trsm", src, rand((M, N), np.float64, 2), side=side, uplo="L", trans_a=trans_a, tile=TILE)
    assert src.reads == 0  # not scanned up front
    with pytest.raises(InputError, match="nonzero diagonal") as e:
        run(p)
    assert_input_error(e, "a", "a[600,600] = 0")
    src.where = "s3://bucket/A.npy"  # an S3 operand (checked by the worker too) is named by its URI
    with pytest.raises(InputError, match="TRSM needs a nonzero diagonal, found a\\[600,600\\] = 0") as e:
        run(make_problem("trsm", src, rand((M, N), np.float64, 2), side=side, uplo="L", trans_a=trans_a, tile=TILE))
    assert_input_error(e, "a", "s3://bucket/A.npy")


def test_generated_source_runs_like_an_array():
    """The custom source above is accepted as is and gives the in-memory result (so the worker-side
    error really is the zero, not the source)."""
    a = triangular_operand(M, np.float64, 1)
    b = rand((M, N), np.float64, 2)
    got = api.trsm(ALPHA, GeneratedArray(a), b, uplo="L", tile=TILE)
    assert_matches(got, sblas.dtrsm(ALPHA, a, b, lower=1), np.float64)


def test_an_operand_path_under_the_home_directory_is_expanded(tmp_path, monkeypatch):
    """a=~/a.npy was refused as "no such file" (the current directory's "~" was looked for),
    though a ~ output was expanded."""
    monkeypatch.setenv("HOME", str(tmp_path))
    a, b = rand((M, K), np.float64, 1), rand((K, N), np.float64, 2)
    np.save(tmp_path / "a.npy", a)
    assert_matches(api.gemm(1.0, "~/a.npy", b, tile=TILE), sblas.dgemm(1.0, a, b), np.float64)


def test_bad_operand_files_are_refused(tmp_path):
    b = rand((K, N), np.float64, 2)
    missing = str(tmp_path / "missing.npy")
    with pytest.raises(InputError, match="no such file") as e:
        api.gemm(1.0, missing, b, tile=TILE)
    assert_input_error(e, "a", missing)

    good = tmp_path / "a.npy"
    np.save(good, rand((M, K), np.float64, 1))
    truncated = tmp_path / "truncated.npy"
    truncated.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(InputError, match="truncated") as e:
        api.gemm(1.0, str(truncated), b, tile=TILE)
    assert_input_error(e, "a", str(truncated))
    with pytest.raises(InputError, match="truncated") as e:  # the argument is the operand's own name
        api.gemm(1.0, b.T.copy(), str(truncated), trans_a="T", trans_b="T", tile=TILE)
    assert_input_error(e, "b", str(truncated))
    # a second array saved into the same file (or bytes appended): the first was multiplied, unsaid (a trial)
    two = tmp_path / "two.npy"
    with open(two, "wb") as f:
        np.save(f, rand((M, K), np.float64, 1))
        np.save(f, rand((2, 2), np.float64, 1))
    with pytest.raises(InputError, match=r"\d+ bytes follow the array its header describes .*: another array saved "
                                         r"after it, or a damaged file; save the operand alone with numpy.save") as e:
        api.gemm(1.0, str(two), b, tile=TILE)
    assert_input_error(e, "a", str(two))

    text = tmp_path / "notes.npy"
    text.write_text("not a numpy file at all\n" * 10)
    with pytest.raises(InputError, match="not a .npy file") as e:
        api.gemm(1.0, str(text), b, tile=TILE)
    assert_input_error(e, "a", str(text))
    # without the file's first bytes, which NumPy's message quoted (a trial's credentials file: `got b'{"acce'`)
    assert "magic string (\\x93NUMPY)" in str(e.value) and "not a n" not in str(e.value), e.value
    header_only = tmp_path / "header_only.npy"
    header_only.write_bytes(good.read_bytes()[:20])  # magic, cut inside the header
    with pytest.raises(InputError, match="not a .npy file") as e:
        api.gemm(1.0, str(header_only), b, tile=TILE)
    assert_input_error(e, "a", str(header_only))

    cube = tmp_path / "cube.npy"
    np.save(cube, np.zeros((4, 5, 6)))
    with pytest.raises(InputError, match="expected a 2-D matrix, found shape \\(4, 5, 6\\)") as e:
        api.gemm(1.0, str(cube), b, tile=TILE)
    assert_input_error(e, "a", str(cube))

    ints = tmp_path / "ints.npy"
    np.save(ints, np.ones((M, K), np.int64))
    with pytest.raises(InputError, match="expected float32 or float64, found dtype int64") as e:
        api.gemm(1.0, str(ints), b, tile=TILE)
    assert_input_error(e, "a", str(ints))


def test_a_negative_dimension_in_a_npy_header_is_an_invalid_header_not_an_empty_matrix(tmp_path):
    """NumPy's header parser takes (-3, 5); it was reported as "an empty matrix" (a trial)."""
    buf = io.BytesIO()
    np.save(buf, np.zeros((3, 5)))
    bad = tmp_path / "negative.npy"
    bad.write_bytes(buf.getvalue().replace(b"(3, 5)", b"(-3, 5)"))
    with pytest.raises(InputError, match=r"the header's shape \(-3, 5\) is invalid \(a negative dimension\)$") as e:
        api.gemm(1.0, str(bad), np.ones((5, 2)), tile=TILE)
    assert_input_error(e, "a", str(bad))


def test_bad_in_memory_operands_are_refused():
    with pytest.raises(InputError, match="found dtype int64") as e:
        api.gemm(1.0, np.ones((4, 3), np.int64), np.ones((3, 2)))
    assert e.value.argument == "a"
    with pytest.raises(InputError, match="expected a 2-D matrix") as e:
        api.gemm(1.0, np.ones((4, 3)), np.ones(3))
    assert e.value.argument == "b"
    with pytest.raises(InputError, match="operand missing") as e:
        api.gemm(1.0, np.ones((4, 3)), None)
    assert_input_error(e, "b", None)
    with pytest.raises(InputError, match="expected an array") as e:
        api.gemm(1.0, np.ones((4, 3)), {"not": "an array"})
    assert_input_error(e, "b", "dict")


@pytest.mark.parametrize("budget", ["1GiB", None, 1.5e9, True, 0, -1, np.float64(1 << 30)])
def test_memory_budget_must_be_an_int_number_of_bytes(budget):
    a, b = rand((5, 4), np.float64, 1), rand((4, 3), np.float64, 2)
    with pytest.raises(InputError, match=r"must be (an integer|>= 1) \(bytes, e.g. 1 << 30\)") as e:
        api.gemm(1.0, a, b, memory_budget=budget)
    assert_input_error(e, "memory_budget", budget)


def test_memory_budget_takes_numpy_integers():
    a, b = rand((5, 4), np.float64, 1), rand((4, 3), np.float64, 2)
    np.testing.assert_array_equal(api.gemm(1.0, a, b, memory_budget=np.int64(1 << 20)), api.gemm(1.0, a, b))


@pytest.mark.parametrize("runtime, shown", [("dask", "dask"), ("local", "local"), (object(), Described("object"))])
def test_runtime_must_be_a_runtime(runtime, shown):
    a, b = rand((5, 4), np.float64, 1), rand((4, 3), np.float64, 2)
    with pytest.raises(InputError, match="expected None \\(a LocalRuntime on the CPU\\), a LocalRuntime or a "
                                         "DaskRuntime") as e:
        api.symm(1.0, rand((5, 5), np.float64, 3), a[:, :3], runtime=runtime)
    assert_input_error(e, "runtime", shown)
    from paperline.kernels.blas.runtime import LocalRuntime

    np.testing.assert_array_equal(api.gemm(1.0, a, b, runtime=LocalRuntime()), api.gemm(1.0, a, b))


@pytest.mark.parametrize("check_finite", ["no", "False", 0, 1, None])
def test_check_finite_must_be_a_bool(check_finite):
    a, b = rand((5, 4), np.float64, 1), rand((4, 3), np.float64, 2)
    with pytest.raises(InputError, match="must be True or False") as e:
        api.gemm(1.0, a, b, check_finite=check_finite)
    assert_input_error(e, "check_finite", check_finite)
    a[0, 0] = np.nan  # np.bool_ is a bool: False lets the NaN through
    assert np.isnan(api.gemm(1.0, a, b, check_finite=np.False_)[0]).all()


@pytest.mark.parametrize("routine, kw, argument, value", [
    ("trsm", {"c": "sq"}, "c", Described("ndarray of shape (6, 6)")),
    ("trmm", {"c": "sq"}, "c", Described("ndarray of shape (6, 6)")),
    ("trsm", {"beta": 0.5}, "beta", 0.5),
    ("syrk", {"b": "sq"}, "b", Described("ndarray of shape (6, 6)")),
    ("syrk", {"b": "path"}, "b", "path"),
    ("symm", {"trans_b": "T"}, "trans_b", "T"),
    ("trmm", {"trans_b": "T"}, "trans_b", "T"),
    ("trsm", {"trans_b": 1}, "trans_b", 1),
    ("syrk", {"trans_b": "C"}, "trans_b", "C"),
    ("syr2k", {"trans_b": "t"}, "trans_b", "t"),
    ("symm", {"trans_a": "T"}, "trans_a", "T"),
    ("gemm", {"side": "R"}, "side", "R"),
    ("gemm", {"uplo": "L"}, "uplo", "L"),
    ("syrk", {"diag": "U"}, "diag", "U"),
    ("symm", {"diag": "U"}, "diag", "U"),
])
def test_an_operand_or_flag_the_routine_does_not_read_is_refused(tmp_path, routine, kw, argument, value):
    """Worded as the gemm flow words it (flows/gemm.py, GemmParameters.check_used)."""
    sq = rand((6, 6), np.float64, 1) + 6 * np.eye(6)
    path = str(tmp_path / "b.npy")
    np.save(path, sq)
    if value == "path":
        value = path
    kw = {k: {"sq": sq, "path": path}.get(v, v) if isinstance(v, str) else v for k, v in kw.items()}
    b = None if routine == "syrk" else sq
    with pytest.raises(InputError, match=f"{routine.upper()} does not use it \\(it takes .*\\); leave it out") as e:
        make_problem(routine, sq, kw.pop("b", b), **kw)
    assert_input_error(e, argument, value)


def test_flags_the_routine_reads_and_defaults_given_explicitly_are_accepted():
    sq, b = rand((6, 6), np.float64, 1) + 6 * np.eye(6), rand((6, 4), np.float64, 2)
    make_problem("trsm", sq, b, c=None, beta=0.0, trans_b="N", trans_a="T", side="L", uplo="L", diag="U")
    make_problem("syrk", b, None, rand((6, 6), np.float64, 3), beta=2.0, trans_b="n", trans_a="N", uplo="L")
    make_problem("gemm", b.T, sq, trans_b=0, side="L", uplo="U", diag="N")
    # a beta without c: accepted, as scipy.linalg.blas does (c defaults to zeros)
    np.testing.assert_allclose(api.gemm(1.0, sq, b, beta=3.0), sq @ b, rtol=1e-12)
    np.testing.assert_allclose(api.gemm(1.0, sq, b, beta=3.0), sblas.dgemm(1.0, sq, b, beta=3.0), rtol=1e-12)


@pytest.mark.parametrize("operand", ["a", "b", "c"])
def test_masked_arrays_are_refused(operand):
    ops = {"a": rand((5, 4), np.float64, 1), "b": rand((4, 3), np.float64, 2), "c": rand((5, 3), np.float64, 3)}
    ops[operand] = np.ma.masked_array(ops[operand], mask=np.zeros(ops[operand].shape, bool))
    shape = ops[operand].shape
    with pytest.raises(InputError, match="mask would be dropped silently") as e:
        api.gemm(1.0, ops["a"], ops["b"], 0.5, ops["c"])
    assert_input_error(e, operand, Described(f"MaskedArray of shape {shape}"))


@pytest.mark.parametrize("value", ["2", b"2", True, np.bool_(False)])
def test_non_numeric_scalars_are_refused(value):
    a, b = rand((5, 4), np.float64, 1), rand((4, 3), np.float64, 2)
    for argument in ("alpha", "beta"):
        with pytest.raises(InputError, match="expected a real number") as e:
            make_problem("gemm", a, b, **{argument: value})
        assert e.value.argument == argument
    np.testing.assert_array_equal(api.gemm(np.float32(2), a, b), api.gemm(2.0, a, b))


@pytest.mark.parametrize("shapes, argument", [(((0, 4), (4, 3)), "a"), (((5, 4), (4, 0)), "b"),
                                              (((5, 0), (0, 3)), "a")])
def test_empty_operands_are_refused(shapes, argument):
    (sa, sb) = shapes
    with pytest.raises(InputError, match="an empty matrix") as e:
        api.gemm(1.0, np.zeros(sa), np.zeros(sb))
    assert e.value.argument == argument


def test_api_docstrings_state_shapes_dtypes_units_raises_and_source():
    for f in (api.gemm, api.symm, api.syrk, api.syr2k, api.trmm, api.trsm):
        doc = f.__doc__
        for needle in ("Args:", "Returns:", "Raises:", "InputError", "float32", "float64", "tile", "bytes",
                       "BLASX", "Sec. 3", f"scipy.linalg.blas.d{f.__name__}", " x "):
            assert needle in doc, (f.__name__, needle)


# --- 7. RandomSource ------------------------------------------------------------------------------


def test_random_source_does_not_depend_on_how_it_is_read():
    src = RandomSource((M, N), np.float64, seed=5, stream=1, block=128)
    whole = read_all(src)
    assert whole.shape == (M, N) and whole.dtype == np.float64
    np.testing.assert_array_equal(read_all(src, band=7), whole)
    np.testing.assert_array_equal(read_all(src, band=M), whole)
    for rows, cols in [(slice(37, 530), slice(250, 700)), (slice(999, 1000), slice(0, 1)),
                       (slice(0, 128), slice(128, 256)), (slice(100, 900), slice(776, 777))]:
        np.testing.assert_array_equal(src.read(rows, cols), whole[rows, cols])
    # every generation block is its own draw (no two blocks alike, e.g. (0, 1) and (1, 0))
    firsts = {float(whole[i, j]) for i in range(0, M, 128) for j in range(0, N, 128)}
    assert len(firsts) == n_tiles(M, 128) * n_tiles(N, 128)
    # tiled runs read it in 100- and 256-tiles: the same matrix either way
    b = RandomSource((N, K), np.float64, seed=5, stream=2, block=128)
    r100 = run(make_problem("gemm", src, b, tile=100)).output
    r256 = run(make_problem("gemm", src, b, tile=256)).output
    ref = whole @ read_all(b)
    np.testing.assert_allclose(r100, ref, rtol=1e-12, atol=1e-12 * np.abs(ref).max())
    np.testing.assert_allclose(r256, ref, rtol=1e-12, atol=1e-12 * np.abs(ref).max())


def test_random_source_seed_stream_and_diagonal_shift():
    base = read_all(RandomSource((300, 200), np.float32, seed=1, stream=0, block=64))
    assert base.dtype == np.float32
    np.testing.assert_array_equal(read_all(RandomSource((300, 200), np.float32, seed=1, stream=0, block=64)), base)
    assert not np.array_equal(read_all(RandomSource((300, 200), np.float32, seed=1, stream=1, block=64)), base)
    assert not np.array_equal(read_all(RandomSource((300, 200), np.float32, seed=2, stream=0, block=64)), base)
    shifted = read_all(RandomSource((300, 200), np.float32, seed=1, stream=0, block=64, diagonal_shift=100.0))
    np.testing.assert_allclose(shifted - base, 100.0 * np.eye(300, 200), atol=1e-4)
    assert np.abs(base).max() < 10 and 0.9 < base.std() < 1.1  # standard normal
    with pytest.raises(InputError):
        RandomSource((0, 5))
    with pytest.raises(InputError) as e:
        RandomSource((5, 5), np.int32)
    assert e.value.argument == "dtype"


# --- 3. the L1 tile cache (LRU bounded in bytes) --------------------------------------------------


def _tile(v, edge=4):
    return np.full((edge, edge), float(v))  # 4 x 4 float64: 128 bytes


def test_tile_cache_is_lru_bounded_in_bytes():
    cache = TileCache(3 * 128)
    k = [("src", 0, j) for j in range(6)]
    for j in range(3):
        cache.put(k[j], _tile(j))
    assert cache.size == 384 and all(key in cache for key in k[:3])
    assert cache.drain() == (k[:3], [])
    assert cache.drain() == ([], [])
    assert cache.get(k[0])[0, 0] == 0.0  # k0 becomes the most recently used; k1 the least
    cache.put(k[3], _tile(3))
    assert cache.size <= cache.capacity
    assert k[1] not in cache and all(key in cache for key in (k[0], k[2], k[3]))
    assert cache.drain() == ([k[3]], [k[1]])
    assert cache.get(k[1]) is None
    cache.put(k[3], _tile(99))  # already held: refreshed, not stored twice (order now k2, k0, k3)
    assert cache.size == 384 and cache.get(k[3])[0, 0] == 3.0 and cache.drain() == ([], [])
    assert cache.peek(k[2])[0, 0] == 2.0  # peek does not refresh: k2 is still the least recently used
    cache.put(k[4], _tile(4))
    assert k[2] not in cache and cache.drain() == ([k[4]], [k[2]])
    # a 2-tile-sized put evicts the two least recently used (k0, then k3)
    cache.put(k[5], np.zeros((8, 4)))
    assert cache.size == 256 + 128 <= cache.capacity
    assert cache.drain() == ([k[5]], [k[0], k[3]])
    assert k[4] in cache and k[5] in cache


def test_tile_cache_counts_bytes_of_mixed_tile_sizes():
    cache = TileCache(300)
    cache.put(("a", 0, 0), _tile(0))  # 128
    cache.put(("a", 0, 1), _tile(1))  # 128
    cache.put(("a", 0, 2), _tile(2, edge=2))  # 32 (an edge tile): 288 fits
    assert cache.drain() == ([("a", 0, 0), ("a", 0, 1), ("a", 0, 2)], [])
    cache.put(("a", 1, 0), _tile(3))  # 288 + 128 > 300: only the oldest goes
    assert cache.size == 288 and cache.drain() == ([("a", 1, 0)], [("a", 0, 0)])
    cache.put(("big", 0, 0), np.zeros((10, 10)))  # 800 bytes > capacity: used once, never kept
    assert ("big", 0, 0) not in cache and cache.size <= cache.capacity
    assert ("big", 0, 0) not in cache.drain()[0]


@pytest.mark.parametrize("routine", ["gemm", "symm", "syrk", "syr2k", "trmm", "trsm"])
def test_overlapped_write_back_equals_the_synchronous_run(routine):
    """The CUDA runtime's pipeline (two tasks in flight, each output tile handed to the driver's
    array by the drain thread) run on the CPU: bit-identical to one task at a time, TRSM's
    dependencies on earlier output tiles included, and a pooled accumulator is reused only after
    the drain has copied it out."""
    from paperline.kernels.blas.plan import make_problem
    from paperline.kernels.blas.runtime import LocalRuntime, run

    dtype = np.float64
    m, n, k = 45, 38, 29
    side_n = m
    args = {"gemm": (rand((m, k), dtype, 1), rand((k, n), dtype, 2), rand((m, n), dtype, 3)),
            "symm": (rand((m, m), dtype, 4), rand((m, n), dtype, 5), rand((m, n), dtype, 6)),
            "syrk": (rand((n, k), dtype, 7), None, rand((n, n), dtype, 9)),
            "syr2k": (rand((n, k), dtype, 7), rand((n, k), dtype, 8), rand((n, n), dtype, 9)),
            "trmm": (triangular_operand(side_n, dtype, 10), rand((m, n), dtype, 11), None),
            "trsm": (triangular_operand(side_n, dtype, 10), rand((m, n), dtype, 11), None)}[routine]
    problem = make_problem(routine, *args, alpha=ALPHA, beta=BETA if args[2] is not None else 0.0, tile=8)
    sunk = []

    class Counting(LocalRuntime):
        def _sink(self, out, host):
            sunk.append(out)
            super()._sink(out, host)

    plain = run(problem, LocalRuntime("cpu"))
    overlapped = run(problem, Counting("cpu", overlap=True))
    assert overlapped.output.tobytes() == plain.output.tobytes()
    # Every tile came back through the drain thread -- except TRSM's, which later tasks read back, so
    # they go to a staged .npy file (written by the task itself) even when the result is in memory.
    assert len(sunk) == (0 if routine == "trsm" else len(plain.records)) and len(plain.records) > 1
    assert sorted(r["index"] for r in overlapped.records) == sorted(r["index"] for r in plain.records)


def test_describe_names_the_problem_and_says_when_the_tile_covers_each_matrix():
    a, b = rand((300, 130), np.float64, 1), rand((130, 200), np.float64, 2)
    assert make_problem("gemm", a, b, tile=64).describe() == "GEMM 300x200 (k=130) float64 tile=64 trans_a=N trans_b=N"
    assert make_problem("gemm", a, b, tile=1024).describe() == \
        "GEMM 300x200 (k=130) float64 tile=1024 (each matrix one tile) trans_a=N trans_b=N"


def test_huge_problems_are_refused_before_planning_or_allocating(tmp_path):
    """A 10**6-square gemm from Python planned for minutes and gigabytes (the flow refused it, the
    kernel API did not: a trial); an in-memory result beyond the machine's memory failed with
    NumPy's MemoryError after planning. Both are refused at once, naming what to change."""
    import time

    big = (10**6, 10**6)
    t0 = time.perf_counter()
    with pytest.raises(InputError, match=r"^tile=1024: 954,529 tile tasks, 932,574,833 panel products .* \(limits 100,000 / 10,000,000\)"):
        api.gemm(1.0, RandomSource(big, "float64", 1), RandomSource(big, "float64", 2), tile=1024)
    tall, wide = RandomSource((10**6, 4096), "float64", 1), RandomSource((4096, 10**6), "float64", 2)
    with pytest.raises(InputError, match=r"^output=None: the 1000000x1000000 float64 result, 7,450.6 GiB, held in "
                                         r"memory exceeds the .* GiB available; name a .npy file"):
        api.gemm(1.0, tall, wide, tile=4096)
    assert time.perf_counter() - t0 < 30  # refused, not planned (a generous bound on a loaded host)
    # written tile by tile to a file, the same problem is not refused for memory (only for disk,
    # which the flow checks): the plan is within the limits
    problem = make_problem("gemm", a=tall, b=wide, tile=4096)
    from paperline.kernels.blas.plan import check_plan_size

    check_plan_size(problem)


@pytest.mark.parametrize(("kwargs", "said"), [
    ({"shape": (0, 3)}, r"a=\(0, 3\): expected \(rows, cols\) with both whole numbers at least 1"),
    ({"shape": "3x3"}, r"a='3x3': expected \(rows, cols\)"),  # was a TypeError
    ({"shape": (2.5, 3)}, r"a=\(2.5, 3\): expected \(rows, cols\)"),
    ({"shape": (3, 3), "block": 0}, r"block=0: expected a whole number of entries >= 1"),  # was ZeroDivisionError on read
    ({"shape": (3, 3), "block": True}, r"block=True"),
])
def test_a_random_source_refuses_a_bad_shape_or_block(kwargs, said):
    with pytest.raises(InputError, match=said):
        RandomSource(**kwargs)

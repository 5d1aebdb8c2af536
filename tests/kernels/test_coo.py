"""COO tensors, validation at the boundary, and the two split kinds."""

import importlib

import numpy as np
import pytest

from paperline.kernels.errors import InputError
from paperline.kernels.tensor.coo import COOTensor, make_split, random_split, temporal_split


def small(shape=(4, 3, 10), seed=0):
    rng = np.random.default_rng(seed)
    return COOTensor.from_dense(rng.normal(size=shape))


def test_from_dense_keeps_only_observed_entries():
    dense = np.arange(24, dtype=float).reshape(2, 3, 4)
    dense[0, 1, 2] = np.nan
    mask = np.ones_like(dense, dtype=bool)
    mask[1, 2, 3] = False
    t = COOTensor.from_dense(dense, mask)
    assert t.nnz == 22 and t.shape == (2, 3, 4)
    np.testing.assert_array_equal(t.values, dense[~np.isnan(dense) & mask])
    back = t.to_dense()
    assert np.isnan(back[0, 1, 2]) and np.isnan(back[1, 2, 3])


@pytest.mark.parametrize("bad, argument", [
    (np.nan, "values"), (np.inf, "values"), (-np.inf, "values"),
])
def test_non_finite_values_are_refused(bad, argument):
    values = np.ones(5)
    values[2] = bad
    coords = np.zeros((5, 3), dtype=int)
    with pytest.raises(InputError, match=f"^{argument}=.*must be finite"):
        COOTensor(coords, values, (2, 2, 2))


def test_empty_tensor_and_empty_mask_are_refused():
    with pytest.raises(InputError, match="empty tensor"):
        COOTensor(np.zeros((0, 3), dtype=int), np.zeros(0), (2, 2, 2))
    with pytest.raises(InputError, match="^mask=.*no observed entries"):
        COOTensor.from_dense(np.ones((2, 2, 2)), np.zeros((2, 2, 2), dtype=bool))
    # all NaN without a mask: the array is to blame (it named mask=, which was not passed)
    with pytest.raises(InputError, match=r"^dense=<array of shape \(2, 2, 2\)>: every entry is NaN: no observed"):
        COOTensor.from_dense(np.full((2, 2, 2), np.nan))
    with pytest.raises(InputError, match=r"^dense=.*every entry the mask selects is NaN"):
        COOTensor.from_dense(np.full((2, 2, 2), np.nan), np.ones((2, 2, 2), dtype=bool))
    # a float mask counted 0.5 (or any rating) as "observed" (a helper's review)
    with pytest.raises(InputError, match=r"^mask=<array of dtype float64>: must be a bool array"):
        COOTensor.from_dense(np.ones((2, 2, 2)), np.full((2, 2, 2), 0.5))


def test_shape_and_coordinate_checks():
    with pytest.raises(InputError, match="^shape="):
        COOTensor(np.zeros((1, 2), dtype=int), np.ones(1), (3, 3))
    with pytest.raises(InputError, match=r"^coords\[:, 1\]="):
        COOTensor(np.array([[0, 5, 0]]), np.ones(1), (2, 2, 2))


def test_random_split_is_a_seeded_partition():
    t = small()
    a, b = random_split(t, seed=7), random_split(t, seed=7)
    np.testing.assert_array_equal(a.test.coords, b.test.coords)
    keys = [set(map(tuple, s.coords)) for s in (a.train, a.validation, a.test)]
    assert sum(map(len, keys)) == t.nnz and len(set.union(*keys)) == t.nnz
    assert a.validation.nnz == round(0.1 * t.nnz)


def test_temporal_split_holds_out_the_last_slices():
    t = small(shape=(4, 3, 20))
    s = temporal_split(t, horizon=2)
    assert s.train.coords[:, -1].max() == 15
    assert set(s.validation.coords[:, -1]) == {16, 17}
    assert set(s.test.coords[:, -1]) == {18, 19}
    with pytest.raises(InputError, match="^horizon="):
        temporal_split(small(shape=(2, 2, 3)), horizon=1)
    with pytest.raises(InputError, match="^split='weird'"):
        make_split(t, "weird")


def test_a_host_tensor_stays_on_the_host():
    from paperline.kernels.arrays import array_module

    t = small()
    assert t.device == "cpu" and t.to("cpu") is t
    assert array_module(t.values, t.coords) is np
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        t.to("tpu")


def test_values_whose_squares_overflow_are_refused():
    """1e307 passed the finite check and every fit came back with test RMSE nan, exit status 0."""
    coords = np.array([[0, 0, 0], [1, 1, 1], [0, 1, 1], [1, 0, 0]])
    with pytest.raises(InputError, match=r"^values=<largest \|value\| 1e\+307 of 4>: too large for float64 "):
        COOTensor(coords, np.array([1.0, 1e307, 2.0, 3.0]), (2, 2, 2))
    ok = COOTensor(coords, np.array([1.0, 1e149, 2.0, 3.0]), (2, 2, 2))  # 1e149 x sqrt(4) = 2e149: fits
    assert ok.nnz == 4


def test_the_tensor_owns_its_entries():
    """It kept the caller's arrays: writing into them afterwards changed a validated tensor
    (an out-of-range coordinate, a NaN), and ``tt.values[1] = inf`` worked on the frozen class."""
    c = np.array([[0, 0, 0], [1, 1, 1]])
    v = np.array([1.0, 2.0])
    tt = COOTensor(c, v, (2, 2, 2))
    c[0, 0] = 99
    v[0] = np.nan
    np.testing.assert_array_equal(tt.coords, [[0, 0, 0], [1, 1, 1]])
    np.testing.assert_array_equal(tt.values, [1.0, 2.0])
    with pytest.raises(ValueError, match="read-only"):
        tt.values[1] = np.inf
    with pytest.raises(ValueError, match="read-only"):
        tt.coords[0, 0] = 5
    for derived in (COOTensor.from_dense(np.ones((2, 2, 2))), tt.subset(np.array([1])), tt.to("cpu"),
                    random_split(small(), seed=0).test, temporal_split(small(shape=(4, 3, 20))).train):
        assert not derived.values.flags.writeable and not derived.coords.flags.writeable
    # an array the tensor already owns read-only is shared, not copied again
    assert COOTensor(tt.coords, tt.values, tt.shape).values is tt.values
    import pickle

    back = pickle.loads(pickle.dumps(tt))
    assert not back.values.flags.writeable and not back.coords.flags.writeable
    np.testing.assert_array_equal(back.values, tt.values)


def test_float_coordinates_are_refused_not_truncated():
    with pytest.raises(InputError, match=r"^coords=<array of dtype float64>: coordinates must be integers"):
        COOTensor(np.array([[0, 0, 0.7]]), np.ones(1), (2, 2, 2))  # was taken as (0, 0, 0)
    with pytest.raises(InputError, match=r"^coords=<array of dtype bool>"):
        COOTensor(np.array([[True, False, True]]), np.ones(1), (2, 2, 2))
    ok = COOTensor(np.array([[0, 1, 1]], dtype=np.uint8), np.ones(1), (2, 2, 2))
    assert ok.coords.dtype == np.int64


def test_duplicate_coordinates_are_refused():
    coords = np.array([[0, 0, 1], [1, 1, 1], [0, 1, 0], [1, 1, 1]])
    with pytest.raises(InputError, match=r"^coords=<1 repeated of 4>: a coordinate appears more than once "
                                         r"\(first: \(1, 1, 1\) at rows 1 and 3\)"):
        COOTensor(coords, np.arange(4.0), (2, 2, 2))
    # a nominal shape whose cell count overflows int64 takes the lexicographic path
    huge = (2**31, 2**31, 2**31)
    with pytest.raises(InputError, match=r"first: \(1, 1, 1\) at rows 1 and 3"):
        COOTensor(coords, np.arange(4.0), huge)
    assert COOTensor(coords[:3], np.arange(3.0), huge).nnz == 3


@pytest.mark.parametrize("shape", [(2.7, 2, 2), (2.0, 2, 2), (True, 2, 2), ("2", 2, 2)])
def test_non_integer_shape_entries_are_refused(shape):
    with pytest.raises(InputError, match=r"^shape=.*entries must be integers"):  # (2.7, 2, 2) became (2, 2, 2)
        COOTensor(np.array([[0, 0, 1]]), np.ones(1), shape)
    assert COOTensor(np.array([[0, 0, 1]]), np.ones(1), (np.int64(2), 2, 2)).shape == (2, 2, 2)


def test_complex_and_non_numeric_values_are_refused():
    coords = np.array([[0, 0, 1]])
    with pytest.raises(InputError, match=r"^values=<array of dtype complex128>: complex values are not supported"):
        COOTensor(coords, np.array([1.0 + 2.0j]), (2, 2, 2))  # became 1.0 with only a ComplexWarning
    with pytest.raises(InputError, match=r"^dense=<array of dtype complex128>: complex values are not supported"):
        COOTensor.from_dense(np.ones((2, 2, 2)) * (1 + 1j))
    with pytest.raises(InputError, match=r"^values=<array of dtype <U1>: must be real numbers"):  # raw ValueError
        COOTensor(coords, np.array(["a"]), (2, 2, 2))
    with pytest.raises(InputError, match=r"^values=<array of dtype object>: must be real numbers"):
        COOTensor(coords, np.array([{"a": 1}], dtype=object), (2, 2, 2))
    assert COOTensor(coords, [3], (2, 2, 2)).values.dtype == np.float64


def test_bool_values_are_refused_not_read_as_ratings():
    """True/False became 1.0/0.0 observations (an object array also took "1.5" and True)."""
    coords = np.array([[0, 0, 1], [1, 1, 1]])
    for values in (np.array([True, False]), [True, False]):
        with pytest.raises(InputError, match=r"^values=<array of dtype bool>: must be real numbers, not booleans: "
                                             r"if 1\.0/0\.0 is meant, convert explicitly"):
            COOTensor(coords, values, (2, 2, 2))
    with pytest.raises(InputError, match=r"^dense=<array of dtype bool>: must be real numbers, not booleans"):
        COOTensor.from_dense(np.ones((2, 2, 2), dtype=bool))
    with pytest.raises(InputError, match=r"^values=<array of dtype object>: must be real numbers \(element 1 is True, "
                                         r"a bool\)"):
        COOTensor(coords, np.array([2.5, True], dtype=object), (2, 2, 2))
    # a list mixing them: NumPy makes [2.5, True] a float array before any dtype shows it
    for values in ([2.5, True], (3, np.False_)):
        with pytest.raises(InputError, match=rf"^values=<a {type(values).__name__} of 2>: must be real numbers, not "
                                             r"booleans \(element 1 is (True|np.False_|False)\)"):
            COOTensor(coords, values, (2, 2, 2))
    assert COOTensor(coords, [2.5, 1], (2, 2, 2)).values.tolist() == [2.5, 1.0]
    with pytest.raises(InputError, match=r"^values=<array of dtype object>: must be real numbers \(element 0 is "
                                         r"'1\.5', a str\)"):
        COOTensor(coords, np.array(["1.5", 2.0], dtype=object), (2, 2, 2))
    with pytest.raises(InputError, match=r"^values=<array of dtype datetime64\[D\]>: must be real numbers"):
        COOTensor(coords, np.array(["2020-01-01", "2020-01-02"], dtype="datetime64[D]"), (2, 2, 2))
    # numbers stay numbers: integer arrays (counts, integer ratings) and object arrays of them become float64
    from decimal import Decimal

    for values in (np.array([3, 4], dtype=np.uint8), [3, 4], np.array([3, Decimal("4")], dtype=object)):
        ok = COOTensor(coords, values, (2, 2, 2))
        assert ok.values.dtype == np.float64 and ok.values.tolist() == [3.0, 4.0]


@pytest.mark.parametrize("seed, problem", [
    (-1, "must be >= 0"),  # was NumPy's "expected non-negative integer", naming no argument
    (1.5, "must be an integer"), (1.0, "must be an integer"), ("1", "must be an integer"),
    (True, "must be an integer"), (None, "must be an integer"),  # None was a fresh, unreproducible split
])
def test_random_split_seed_must_be_a_non_negative_integer(seed, problem):
    t = small()
    expected = rf"^seed={seed!r}: {problem}$".replace(".", r"\.")
    with pytest.raises(InputError, match=expected):
        random_split(t, seed=seed)
    for kind in ("random", "temporal"):  # the temporal split ignores the seed; a bad one is still refused
        with pytest.raises(InputError, match=expected):
            make_split(t, kind, seed=seed)
    np.testing.assert_array_equal(random_split(t, seed=np.int64(3)).test.coords, random_split(t, seed=3).test.coords)


@pytest.mark.parametrize("kwargs, message", [
    (dict(validation_fraction="0.1"), r"^validation_fraction='0\.1': must be a real number$"),  # raw TypeError
    (dict(test_fraction=None), r"^test_fraction=None: must be a real number$"),  # raw TypeError
    (dict(validation_fraction=True), r"^validation_fraction=True: must be a real number$"),
    (dict(validation_fraction=float("nan")), r"^validation_fraction=nan: must be a finite number > 0 and < 1$"),
    (dict(test_fraction=-0.1), r"^test_fraction=-0\.1: must be a finite number > 0 and < 1$"),
    (dict(test_fraction=1.0), r"^test_fraction=1\.0: must be a finite number > 0 and < 1$"),
    (dict(validation_fraction=0.5, test_fraction=0.5), r"^validation_fraction \+ test_fraction=1\.0: must be < 1"),
])
def test_random_split_fractions_are_checked_by_name(kwargs, message):
    with pytest.raises(InputError, match=message):
        random_split(small(), **kwargs)
    assert random_split(small(), validation_fraction=np.float32(0.2)).validation.nnz == round(0.2 * 120)


def test_values_must_be_one_dimensional():
    with pytest.raises(InputError, match=r"^values=<array of shape \(1, 1\)>: must be 1-D: one value per row of "
                                         r"coords"):  # was "empty tensor: no observed entries"
        COOTensor(np.array([[0, 0, 1]]), np.ones((1, 1)), (2, 2, 2))


@pytest.mark.parametrize("horizon", [2.5, 2.0, True, "2"])
def test_temporal_split_horizon_must_be_an_integer(horizon):
    with pytest.raises(InputError, match=rf"^horizon={horizon!r}: must be an integer number of time slices".replace(
            ".", r"\.")):  # 2.5 became 2
        temporal_split(small(shape=(4, 3, 20)), horizon=horizon)
    with pytest.raises(InputError, match=r"^horizon=0: must be >= 1"):
        temporal_split(small(shape=(4, 3, 20)), horizon=0)
    assert temporal_split(small(shape=(4, 3, 20)), horizon=np.int64(2)).test.coords[:, -1].min() == 18


def test_check_int_wording():
    from paperline.kernels.errors import check_int

    with pytest.raises(InputError, match=r"^n=0: must be >= 1$"):  # it read "must be in >= 1"
        check_int("n", 0, 1)
    with pytest.raises(InputError, match=r"^n=9: must be in \[1, 5\]$"):
        check_int("n", 9, 1, 5)


def test_the_package_re_exports_its_public_names():
    import paperline.kernels.tensor as tensor
    from paperline.kernels.tensor.coo import COOTensor as direct
    from paperline.kernels.tensor.pttf import als

    assert tensor.COOTensor is direct and tensor.als is als
    # not P²T²F's function: it would hide the module of its name (a dotted patch or import of
    # paperline.kernels.tensor.p2t2f would get the function)
    module = importlib.import_module("paperline.kernels.tensor.p2t2f")
    assert tensor.p2t2f is module and "p2t2f" not in tensor.__all__
    for name in tensor.__all__:
        assert getattr(tensor, name) is not None

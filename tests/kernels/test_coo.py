"""COO tensors, validation at the boundary, and the two split kinds."""

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
    with pytest.raises(InputError, match=r"^values='largest \|value\| 1e\+307 of 4': too large for float64 "):
        COOTensor(coords, np.array([1.0, 1e307, 2.0, 3.0]), (2, 2, 2))
    ok = COOTensor(coords, np.array([1.0, 1e149, 2.0, 3.0]), (2, 2, 2))  # 1e149 x sqrt(4) = 2e149: fits
    assert ok.nnz == 4

"""PTTF model, objective, gradients and the serial ALS reference."""

import numpy as np
import pytest
import torch

from paperline.kernels.errors import InputError
from paperline.kernels.tensor.coo import COOTensor, random_split
from paperline.kernels.tensor.pttf import (
    als,
    rmse,
    balance_scales,
    gradient,
    init_factors,
    objective,
    predict,
    solve_time_system,
)

def torch_objective(factors, tensor, lam, lam_t):
    fs = [torch.tensor(f, requires_grad=True) for f in factors]
    c = torch.tensor(tensor.coords)
    prod = fs[0][c[:, 0]]
    for m in range(1, len(fs)):
        prod = prod * fs[m][c[:, m]]
    resid = prod.sum(1) - torch.tensor(tensor.values)
    t = fs[-1]
    loss = 0.5 * (resid**2).sum() + 0.5 * lam * sum((f**2).sum() for f in fs[:-1]) \
        + 0.5 * lam * (t[0] ** 2).sum() + 0.5 * lam_t * ((t[1:] - t[:-1]) ** 2).sum()
    loss.backward()
    return float(loss.detach()), [f.grad.numpy() for f in fs]


def test_objective_and_gradient_match_torch_autograd(low_rank_tensor):
    tensor, _ = low_rank_tensor(shape=(6, 5, 7), rank=2)
    factors = init_factors(tensor.shape, 2, seed=1)
    ref_loss, ref_grads = torch_objective(factors, tensor, 0.5, 2.0)
    assert objective(factors, tensor, 0.5, 2.0) == pytest.approx(ref_loss, rel=1e-12)
    for g, ref in zip(gradient(factors, tensor, 0.5, 2.0), ref_grads):
        np.testing.assert_allclose(g, ref, rtol=1e-10, atol=1e-10)


def test_gradient_matches_finite_differences_on_4way():
    rng = np.random.default_rng(3)
    tensor = COOTensor.from_dense(rng.normal(size=(4, 3, 3, 5)), rng.random((4, 3, 3, 5)) < 0.6)
    factors = init_factors(tensor.shape, 2, seed=2)
    grads = gradient(factors, tensor, 0.3, 1.5)
    eps = 1e-6
    for m, i, r in [(0, 1, 0), (2, 2, 1), (3, 0, 1), (3, 4, 0)]:
        up = [f.copy() for f in factors]
        dn = [f.copy() for f in factors]
        up[m][i, r] += eps
        dn[m][i, r] -= eps
        fd = (objective(up, tensor, 0.3, 1.5) - objective(dn, tensor, 0.3, 1.5)) / (2 * eps)
        assert grads[m][i, r] == pytest.approx(fd, rel=1e-6, abs=1e-6)


def test_time_system_matches_dense_solve():
    rng = np.random.default_rng(0)
    k, r = 6, 3
    a = rng.normal(size=(k, r, r))
    gram = a @ a.transpose(0, 2, 1)
    rhs = rng.normal(size=(k, r))
    got = solve_time_system(gram, rhs, 0.7, 2.0)
    # Dense reference: block diag + lam_t D^T D (x) I + lam e1 e1^T (x) I.
    d = np.diff(np.eye(k), axis=0)
    e1 = np.zeros((k, k))
    e1[0, 0] = 1
    big = np.zeros((k * r, k * r))
    for i in range(k):
        big[i * r:(i + 1) * r, i * r:(i + 1) * r] = gram[i]
    big += np.kron(2.0 * d.T @ d + 0.7 * e1, np.eye(r))
    np.testing.assert_allclose(got.reshape(-1), np.linalg.solve(big, rhs.reshape(-1)), rtol=1e-9)


def test_balance_scales_keeps_predictions_and_never_increases_objective(low_rank_tensor):
    tensor, _ = low_rank_tensor(shape=(8, 6, 10), rank=2)
    rng = np.random.default_rng(5)
    factors = [f * s for f, s in zip(init_factors(tensor.shape, 2, seed=0), (5.0, 0.2, 1.0))]
    factors = [f + 0.1 * rng.normal(size=f.shape) for f in factors]
    before_pred = predict(factors, tensor.coords)
    before = objective(factors, tensor, 1.0, 3.0)
    balance_scales(factors, 1.0, 3.0)
    np.testing.assert_allclose(predict(factors, tensor.coords), before_pred, rtol=1e-12)
    assert objective(factors, tensor, 1.0, 3.0) < before


def test_als_recovers_held_out_entries_to_noise_level(low_rank_tensor):
    tensor, _ = low_rank_tensor()
    split = random_split(tensor, seed=0)
    result = als(split.train, 3, lam=1.0, lam_t=1.0, n_epochs=40, validation=split.validation)
    objs = result.history.objective
    assert all(b <= a * (1 + 1e-9) for a, b in zip(objs, objs[1:])), "ALS must be monotone"
    assert result.history.validation_rmse[-1] < 1.2 * low_rank_tensor.noise
    test_rmse = np.sqrt(np.mean((result.factors.predict(split.test.coords) - split.test.values) ** 2))
    assert test_rmse < 1.2 * low_rank_tensor.noise


@pytest.mark.parametrize("kwargs, argument", [
    ({"rank": 0}, "rank"), ({"rank": -2}, "rank"), ({"lam": 0.0}, "lam"),
    ({"lam_t": float("nan")}, "lam_t"), ({"n_epochs": 0}, "n_epochs"),
])
def test_als_rejects_bad_hyperparameters(low_rank_tensor, kwargs, argument):
    tensor, _ = low_rank_tensor(shape=(5, 4, 6))
    args = {"rank": 2, **kwargs}
    with pytest.raises(InputError, match=f"^{argument}="):
        als(tensor, **args)


@pytest.mark.parametrize("kwargs, message", [
    ({"rank": True}, r"^rank=True: CP rank must be a positive integer"),
    ({"lam": "1"}, r"^lam='1': must be a real number"),
    ({"seed": None}, r"^seed=None: must be an integer >= 0"),
    ({"seed": -1}, r"^seed=-1: must be an integer >= 0"),
    ({"tol": -1.0}, r"^tol=-1.0: must be a finite number >= 0"),
    ({"tol": float("nan")}, r"^tol=nan: must be a finite number >= 0"),
])
def test_als_names_bad_types_and_seeds(low_rank_tensor, kwargs, message):
    tensor, _ = low_rank_tensor(shape=(5, 4, 6))
    with pytest.raises(InputError, match=message):
        als(tensor, **{"rank": 2, "n_epochs": 1, **kwargs})


def test_als_checks_its_initial_factors(low_rank_tensor):
    tensor, _ = low_rank_tensor(shape=(5, 4, 6))
    good = init_factors(tensor.shape, 2, seed=0)
    ref = als(tensor, 2, n_epochs=2, seed=0)
    fit = als(tensor, 2, n_epochs=2, init=good)  # the same start as seed 0: the same fit
    for a, b in zip(fit.factors.factors, ref.factors.factors):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(InputError, match=r"^init\[1\]=<array of shape \(3, 2\)>: expected \(4, 2\)"):  # was IndexError
        als(tensor, 2, init=[good[0], good[1][:3], good[2]])
    with pytest.raises(InputError, match=r"^init\[0\]=<array of shape \(5, 3\)>: expected \(5, 2\)"):
        als(tensor, 2, init=[np.ones((5, 3)), good[1], good[2]])
    with pytest.raises(InputError, match=r"^init=<list>: need a list of 3 factors"):
        als(tensor, 2, init=good[:2])
    with pytest.raises(InputError, match=r"^init\[2\]=.*must be finite"):
        als(tensor, 2, init=[good[0], good[1], np.full((6, 2), np.nan)])


def test_rmse_and_objective_refuse_a_tensor_of_another_shape(low_rank_tensor):
    tensor, _ = low_rank_tensor(shape=(5, 4, 6))
    factors = init_factors(tensor.shape, 2, seed=0)
    other = COOTensor.from_dense(np.ones((3, 3, 3)))  # indices in range: it used to score unrelated data
    with pytest.raises(InputError, match=r"^tensor=<COOTensor of shape \(3, 3, 3\)>: does not match the factors' "
                                         r"shape \(5, 4, 6\)"):
        rmse(factors, other)
    with pytest.raises(InputError, match=r"^tensor=<COOTensor of shape \(3, 3, 3\)>"):
        objective(factors, other, 1.0, 1.0)
    with pytest.raises(InputError, match=r"^tensor=<COOTensor of shape \(3, 3, 3\)>"):
        gradient(factors, other, 1.0, 1.0)


def test_predict_refuses_coordinates_outside_the_factors():
    """A negative index wrapped around to the last rows: 799 plausible wrong values, no error (a
    trial); float or out-of-range indices failed in NumPy's indexing."""
    from paperline.kernels.tensor.pttf import CPFactors, predict

    rng = np.random.default_rng(0)
    factors = [rng.normal(size=(i, 2)) for i in (4, 3, 5)]
    coords = np.array([[0, 0, 0], [3, 2, 4]])
    want = np.einsum("nr,nr,nr->n", factors[0][coords[:, 0]], factors[1][coords[:, 1]], factors[2][coords[:, 2]])
    np.testing.assert_allclose(predict(factors, coords), want)
    np.testing.assert_allclose(CPFactors(factors).predict(coords), want)
    for bad, match in ((-coords - 1, r"^coords\[:, 0\]=\(-4, -1\): indices must lie in 0..3"),
                       (coords + [0, 1, 0], r"^coords\[:, 1\]=\(1, 3\): indices must lie in 0..2"),
                       (coords.astype(float), "expected an integer nnz x 3 array"),
                       (coords[:, :2], "expected an integer nnz x 3 array")):
        with pytest.raises(InputError, match=match):
            predict(factors, bad)
    with pytest.raises(InputError, match="^factors=.*one rank R"):
        predict([factors[0], factors[1][:, :1], factors[2]], coords)

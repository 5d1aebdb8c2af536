"""The TensorLy baseline on the same synthetic problem."""

import numpy as np
import pytest

from paperline.kernels.errors import InputError
from paperline.kernels.tensor.baselines import tensorly_cp
from paperline.kernels.tensor.coo import random_split, temporal_split
from paperline.kernels.tensor.pttf import als, rmse


def test_tensorly_cp_recovers_random_held_out_entries(low_rank_tensor):
    tensor, _ = low_rank_tensor()
    split = random_split(tensor, seed=0)
    factors, history = tensorly_cp(split.train, rank=3, n_iter_max=200, validation=split.validation)
    assert len(history) >= 2 and np.isfinite(history[-1]["validation_rmse"])
    # epoch 0 is the random initialization, then one record per ALS iteration
    assert [h["epoch"] for h in history] == list(range(len(history))) and len(history) <= 201
    assert rmse(factors, split.test) < 1.25 * low_rank_tensor.noise


def test_tensorly_cp_history_counts_iterations(low_rank_tensor):
    tensor, _ = low_rank_tensor()
    _, history = tensorly_cp(tensor, rank=3, n_iter_max=7, tol=1e-300)
    assert [h["epoch"] for h in history] == list(range(8))
    with pytest.raises(InputError, match="tol"):
        tensorly_cp(tensor, rank=3, tol=0.0)


def test_temporal_prior_extrapolates_where_plain_cp_cannot(low_rank_tensor):
    # The paper's point: without the smoothness prior, time slices with no observations are
    # unconstrained; PTTF carries the last trend forward.
    tensor, _ = low_rank_tensor(observed=0.5)
    split = temporal_split(tensor)
    factors, _ = tensorly_cp(split.train, rank=3, n_iter_max=100)
    pttf = als(split.train, 3, lam=1.0, lam_t=10.0, n_epochs=40)
    assert rmse(pttf.factors.factors, split.test) < 0.5 * rmse(factors, split.test)


@pytest.mark.parametrize("kwargs, message", [
    ({"n_iter_max": 0}, r"^n_iter_max=0: must be an integer >= 1"),
    ({"n_iter_max": -1}, r"^n_iter_max=-1: must be an integer >= 1"),
    ({"n_iter_max": 10.0}, r"^n_iter_max=10.0: must be an integer >= 1"),
    ({"l2_reg": -1}, r"^l2_reg=-1: must be a finite number >= 0"),
    ({"l2_reg": float("nan")}, r"^l2_reg=nan: must be a finite number >= 0"),
    ({"rank": True}, r"^rank=True: CP rank must be a positive integer"),
    ({"seed": None}, r"^seed=None: must be an integer >= 0"),
    ({"tol": float("inf")}, r"^tol=inf: must be a finite number > 0"),
])
def test_tensorly_cp_checks_its_arguments(low_rank_tensor, kwargs, message):
    tensor, _ = low_rank_tensor(shape=(5, 4, 6))
    with pytest.raises(InputError, match=message):
        tensorly_cp(tensor, **{"rank": 2, **kwargs})


def test_tensorly_cp_refuses_a_validation_tensor_of_another_shape(low_rank_tensor):
    from paperline.kernels.tensor.coo import COOTensor

    tensor, _ = low_rank_tensor(shape=(5, 4, 6))
    with pytest.raises(InputError, match=r"^validation=<COOTensor of shape \(3, 3, 3\)>: must have the training "
                                         r"tensor's shape \(5, 4, 6\)"):
        tensorly_cp(tensor, rank=2, validation=COOTensor.from_dense(np.ones((3, 3, 3))))
    with pytest.raises(InputError, match=r"^tensor=<numpy.ndarray of shape \(5, 4, 6\)>"):
        tensorly_cp(np.ones((5, 4, 6)), rank=2)


def test_tensorly_cp_says_why_its_als_met_a_singular_matrix(low_rank_tensor):
    """Entries that do not determine the model (here all 0) failed a run as "LinAlgError: Singular
    matrix", retried as if the next try could differ (a trial): an InputError saying why and what to do."""
    from paperline.kernels.tensor.coo import COOTensor

    tensor, _ = low_rank_tensor(shape=(5, 4, 6))
    zeros = COOTensor(tensor.coords, np.zeros_like(tensor.values), tensor.shape)
    with pytest.raises(InputError, match=r"^tensor=<\d+ entries of shape \(5, 4, 6\)>: TensorLy's CP-ALS met a "
                                         r"singular matrix: the entries do not determine a rank-2 CP model .*"
                                         r"baseline=false\)$"):
        tensorly_cp(zeros, rank=2, n_iter_max=5)

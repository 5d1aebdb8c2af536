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

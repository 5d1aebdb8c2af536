"""P²T²F: the split, the consensus step, and convergence against the serial ALS reference."""

import numpy as np
import pytest

from paperline.kernels.errors import InputError
from paperline.kernels.tensor.coo import COOTensor, random_split
from paperline.kernels.tensor.p2t2f import SerialExecutor, consensus_update, LocalState, p2t2f, split_tensor
from paperline.kernels.tensor.pttf import als, gradient, objective



@pytest.fixture(scope="module")
def problem(low_rank_tensor):
    tensor, _ = low_rank_tensor()
    split = random_split(tensor, seed=0)
    reference = als(split.train, 3, lam=1.0, lam_t=1.0, n_epochs=100, validation=split.validation)
    return split, reference


def test_split_partitions_entries_by_first_mode_blocks(low_rank_tensor):
    tensor, _ = low_rank_tensor(shape=(10, 4, 6), observed=0.8)
    parts = split_tensor(tensor, 3)
    assert sum(p.nnz for p in parts) == tensor.nnz
    owned = np.concatenate([p.rows for p in parts])
    np.testing.assert_array_equal(owned, np.arange(10))  # disjoint, contiguous, covering
    for p in parts:
        glob = p.coords.copy()
        glob[:, 0] = p.rows[p.coords[:, 0]]
        assert set(map(tuple, glob)) <= set(map(tuple, tensor.coords))
        np.testing.assert_array_equal(p.row_counts[0], np.bincount(p.coords[:, 0], minlength=p.rows.size))


def test_p_larger_than_the_split_mode_is_refused(low_rank_tensor):
    tensor, _ = low_rank_tensor(shape=(3, 4, 6))  # split along mode 1, the largest non-time mode
    with pytest.raises(InputError, match=r"^n_parts=5: P larger than the number of slices along the split mode \(4\)"):
        p2t2f(tensor, 2, n_parts=5)
    with pytest.raises(InputError, match=r"^n_parts=4: P larger than the number of slices along the split mode \(3\)"):
        p2t2f(tensor, 2, n_parts=4, split_mode=0)
    with pytest.raises(InputError, match=r"^split_mode=2: must be a non-time mode, 0..1"):
        p2t2f(tensor, 2, split_mode=2)
    with pytest.raises(InputError, match="^n_parts=0: P, the number of sub-tensors"):
        split_tensor(tensor, 0)


def test_consensus_is_the_weighted_average_plus_prior():
    rng = np.random.default_rng(0)
    ws = [[rng.normal(size=(5, 2)), rng.normal(size=(4, 2))] for _ in range(2)]
    duals = [[rng.normal(size=(5, 2)), rng.normal(size=(4, 2))] for _ in range(2)]
    counts = [[rng.integers(1, 9, size=5).astype(float), rng.integers(1, 9, size=4).astype(float)] for _ in range(2)]
    states = [LocalState(np.zeros((1, 2)), w, d, 0) for w, d in zip(ws, duals)]
    z = consensus_update(states, counts, lam=0.5, lam_t=3.0, rho=2.0)
    # Reference: minimize lam/2||Z||^2 + sum_p rho n^p/2 ||W^p + L^p - Z||^2 row by row (mode 0),
    # and without the prior for the time mode (its priors live in the sub-problems).
    num0 = sum(2.0 * c[0][:, None] * (w[0] + d[0]) for w, d, c in zip(ws, duals, counts))
    den0 = sum(2.0 * c[0] for c in counts)[:, None]
    np.testing.assert_allclose(z[0], num0 / (den0 + 0.5), rtol=1e-12)
    num1 = sum(2.0 * c[1][:, None] * (w[1] + d[1]) for w, d, c in zip(ws, duals, counts))
    den1 = sum(2.0 * c[1] for c in counts)[:, None]
    np.testing.assert_allclose(z[1], num1 / den1, rtol=1e-12)


@pytest.mark.parametrize("n_parts", [2, 4])
def test_admm_reaches_the_serial_objective(problem, n_parts):
    split, reference = problem
    result = p2t2f(split.train, 3, n_parts=n_parts, lam=1.0, lam_t=1.0, n_epochs=200, lr_decay=0.05,
                   batch_size=1024, validation=split.validation, closing_sweeps=0)  # the rounds alone
    h = result.history
    assert h.objective[-1] <= 1.01 * reference.history.objective[-1]
    # Consensus: the local copies agree with Z to within 1% of Z's norm (P sub-problems).
    z_norm = np.sqrt(sum(np.sum(f**2) for f in result.factors.factors[1:]))
    assert h.primal_residual[-1] < 0.01 * np.sqrt(n_parts) * z_norm
    test_rmse = np.sqrt(np.mean((result.factors.predict(split.test.coords) - split.test.values) ** 2))
    assert test_rmse < 1.25 * 0.1


def test_runs_are_reproducible_and_executor_independent(problem):
    split, _ = problem

    class ReversedExecutor(SerialExecutor):
        """Runs sub-problems in the opposite order: results must not depend on scheduling."""

        def map(self, fn, handles, args):
            return list(reversed([fn(h, *a) for h, a in reversed(list(zip(handles, args)))]))

    a = p2t2f(split.train, 3, n_parts=3, n_epochs=3, batch_size=256, seed=4)
    b = p2t2f(split.train, 3, n_parts=3, n_epochs=3, batch_size=256, seed=4, executor=ReversedExecutor())
    for fa, fb in zip(a.factors.factors, b.factors.factors):
        np.testing.assert_array_equal(fa, fb)


@pytest.mark.parametrize("kwargs, argument", [({"rho": 0.0}, "rho"), ({"lr": -1.0}, "lr"),
                                              ({"batch_size": 0}, "batch_size"), ({"rank": 0}, "rank")])
def test_bad_hyperparameters(problem, kwargs, argument):
    split, _ = problem
    args = {"rank": 3, **kwargs}
    with pytest.raises(InputError, match=f"^{argument}="):
        p2t2f(split.train, **args)


def test_objective_from_the_workers_matches_the_driver(problem):
    # Epoch t's objective comes from the sub-problems of round t+1; a run stopped at epoch t
    # computes it on the driver instead, after the closing exact solve of the private rows, which
    # cannot increase Eq. (4). Same trajectory before that.
    split, _ = problem
    long = p2t2f(split.train, 3, n_parts=2, n_epochs=3, batch_size=256, seed=2).history.objective
    for t in (1, 2):
        fit = p2t2f(split.train, 3, n_parts=2, n_epochs=t, batch_size=256, seed=2)
        short = fit.history.objective
        np.testing.assert_allclose(short[:-1], long[:t - 1], rtol=1e-12)
        assert short[-1] == pytest.approx(objective(fit.factors.factors, split.train, 1.0, 10.0), rel=1e-12)
        assert short[-1] < long[t - 1]


def test_the_closing_step_solves_the_private_rows_exactly_at_the_consensus(problem):
    split, _ = problem
    fit = p2t2f(split.train, 3, n_parts=2, n_epochs=4, batch_size=256, seed=1, split_mode=0)
    factors = fit.factors.factors
    # U is at the optimum of Eq. (4) given the returned shared factors: its gradient vanishes
    grads = gradient(factors, split.train, 1.0, 10.0)
    assert np.abs(grads[0]).max() < 1e-8 * max(1.0, np.abs(grads[1]).max())
    moved = [factors[0] * 1.01] + list(factors[1:])
    assert objective(moved, split.train, 1.0, 10.0) > fit.history.objective[-1]


def test_the_largest_mode_is_split_and_the_factors_come_back_in_order(low_rank_tensor):
    """Splitting mode 1 of a (3, 8, 6) tensor is the same fit as splitting mode 0 of its (8, 3, 6)
    transpose; the factors return in the tensor's own order."""
    from paperline.kernels.tensor.coo import COOTensor
    from paperline.kernels.tensor.p2t2f import default_split_mode
    from paperline.kernels.tensor.pttf import predict

    tensor, _ = low_rank_tensor(shape=(3, 8, 6))
    assert default_split_mode(tensor.shape) == 1 and default_split_mode((64, 12, 10, 60)) == 0
    fit = p2t2f(tensor, 2, n_parts=4, n_epochs=3, batch_size=64, seed=1)
    assert [f.shape for f in fit.factors.factors] == [(3, 2), (8, 2), (6, 2)]
    swapped = COOTensor(tensor.coords[:, [1, 0, 2]], tensor.values, (8, 3, 6))
    ref = p2t2f(swapped, 2, n_parts=4, n_epochs=3, batch_size=64, seed=1, split_mode=0)
    for mine, theirs in zip(fit.factors.factors, [ref.factors.factors[i] for i in (1, 0, 2)]):
        np.testing.assert_array_equal(mine, theirs)
    np.testing.assert_array_equal(fit.history.objective, ref.history.objective)
    np.testing.assert_allclose(predict(fit.factors.factors, tensor.coords),
                               predict(ref.factors.factors, swapped.coords), rtol=1e-12)


def test_the_parts_normal_equations_sum_to_the_whole_tensors(problem):
    from paperline.kernels.tensor.p2t2f import shared_normal_equations
    from paperline.kernels.tensor.pttf import _other_modes, _row_normal_equations, init_factors

    split, _ = problem
    tensor = split.train
    factors = init_factors(tensor.shape, 3, seed=5)
    parts = split_tensor(tensor, 3)
    for j in range(len(factors) - 1):
        stats = [shared_normal_equations(sub, factors[0][sub.rows], factors[1:], j) for sub in parts]
        h = _other_modes(factors, tensor.coords, j + 1)
        gram, rhs = _row_normal_equations(tensor.coords[:, j + 1], h, tensor.values, factors[j + 1].shape[0])
        np.testing.assert_allclose(sum(g for g, _ in stats), gram, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(sum(b for _, b in stats), rhs, rtol=1e-10, atol=1e-12)


def test_closing_sweeps_never_increase_the_objective_and_reach_the_serial_optimum(problem):
    split, reference = problem
    kw = dict(lam=1.0, lam_t=1.0, n_parts=2, n_epochs=3, batch_size=256, seed=3)
    objectives = [p2t2f(split.train, 3, closing_sweeps=k, **kw).history.objective[-1] for k in (0, 1, 4, 100)]
    assert all(b <= a * (1 + 1e-12) for a, b in zip(objectives, objectives[1:])), objectives
    assert objectives[-1] < objectives[0]
    assert objectives[-1] <= 1.001 * reference.history.objective[-1]
    with pytest.raises(InputError, match="^closing_sweeps="):
        p2t2f(split.train, 3, closing_sweeps=-1)


# --- input validation at the boundary (a user trial of the API) -------------------------------


@pytest.fixture(scope="module")
def small_train(low_rank_tensor):
    tensor, _ = low_rank_tensor(shape=(20, 15, 30))
    return tensor


@pytest.mark.parametrize("kwargs, message", [
    ({"rho_growth": 0}, r"^rho_growth=0: must be a finite number >= 1"),  # was ZeroDivisionError
    ({"rho_growth": float("nan")}, r"^rho_growth=nan: must be a finite number >= 1"),  # was all-NaN factors
    ({"rho_growth": 0.5}, r"^rho_growth=0.5: must be a finite number >= 1"),
    ({"rho_max": -1}, r"^rho_max=-1: must be a finite number > 0"),  # was LinAlgError
    ({"rho_max": float("inf")}, r"^rho_max=inf: must be a finite number > 0"),
    ({"local_passes": 0}, r"^local_passes=0: must be an integer >= 1"),  # was "need at least one array"
    ({"local_passes": -3}, r"^local_passes=-3: must be an integer >= 1"),
    ({"local_passes": 1.5}, r"^local_passes=1.5: must be an integer >= 1"),
    ({"lr_decay": -5}, r"^lr_decay=-5: must be a finite number >= 0"),  # negative step sizes
    ({"lr_decay": float("inf")}, r"^lr_decay=inf: must be a finite number >= 0"),
    ({"rho_balance": -1.0}, r"^rho_balance=-1.0: must be a finite number >= 0"),
    ({"rank": True}, r"^rank=True: CP rank must be a positive integer"),  # was TypeError
    ({"rank": 2.0}, r"^rank=2.0: CP rank must be a positive integer"),
    ({"lam": "1"}, r"^lam='1': must be a real number"),  # was TypeError from isfinite
    ({"lam_t": None}, r"^lam_t=None: must be a real number"),
    ({"rho": float("nan")}, r"^rho=nan: must be a finite number > 0"),
    ({"lr": "fast"}, r"^lr='fast': must be a real number"),
    ({"seed": None}, r"^seed=None: must be an integer >= 0"),  # was TypeError
    ({"seed": -1}, r"^seed=-1: must be an integer >= 0"),  # was NumPy's ValueError
    ({"seed": 1.0}, r"^seed=1.0: must be an integer >= 0"),
    ({"n_epochs": True}, r"^n_epochs=True: must be a positive integer"),
    ({"batch_size": 64.0}, r"^batch_size=64.0: must be a positive integer"),
    ({"closing_sweeps": 1.5}, r"^closing_sweeps=1.5: must be an integer >= 0"),
    ({"n_parts": True}, r"^n_parts=True: P, the number of sub-tensors, must be a positive integer"),
    ({"n_parts": 2.0}, r"^n_parts=2.0: P, the number of sub-tensors"),
    ({"split_mode": True}, r"^split_mode=True: must be a non-time mode"),
])
def test_every_hyperparameter_is_checked_and_named(small_train, kwargs, message):
    with pytest.raises(InputError, match=message):
        p2t2f(small_train, **{"rank": 2, "n_epochs": 1, **kwargs})


def test_numpy_integers_and_floats_are_accepted_and_fit_alike(small_train):
    kw = dict(n_epochs=2, batch_size=256, closing_sweeps=1)
    a = p2t2f(small_train, 2, seed=3, n_parts=2, local_passes=1, lam=1.0, **kw)
    b = p2t2f(small_train, np.int64(2), seed=np.int64(3), n_parts=np.int32(2), local_passes=np.int64(1),
              lam=np.float32(1.0), **kw)
    for fa, fb in zip(a.factors.factors, b.factors.factors):
        np.testing.assert_array_equal(fa, fb)


def test_a_dense_array_is_refused_with_a_pointer_to_from_dense():
    dense = np.ones((20, 15, 30))
    with pytest.raises(InputError, match=r"^tensor=<numpy.ndarray of shape \(20, 15, 30\)>: must be a COOTensor.*"
                                         r"COOTensor.from_dense"):  # was AttributeError
        p2t2f(dense, 2)
    with pytest.raises(InputError, match=r"^tensor=<numpy.ndarray"):
        als(dense, 2)


def test_a_validation_tensor_of_another_shape_is_refused(small_train):
    from paperline.kernels.tensor.coo import COOTensor

    small = COOTensor.from_dense(np.ones((3, 3, 3)))  # returned RMSEs for unrelated data
    with pytest.raises(InputError, match=r"^validation=<COOTensor of shape \(3, 3, 3\)>: must have the training "
                                         r"tensor's shape \(20, 15, 30\)"):
        p2t2f(small_train, 2, validation=small)
    big = COOTensor.from_dense(np.ones((50, 50, 50)))  # was IndexError in pttf
    with pytest.raises(InputError, match=r"^validation=<COOTensor of shape \(50, 50, 50\)>"):
        p2t2f(small_train, 2, validation=big)
    with pytest.raises(InputError, match=r"^validation=<COOTensor of shape \(50, 50, 50\)>"):
        als(small_train, 2, validation=big)
    with pytest.raises(InputError, match=r"^validation=<numpy.ndarray"):
        p2t2f(small_train, 2, validation=np.ones((20, 15, 30)))


def test_the_fit_leaves_its_tensors_unchanged(small_train):
    coords, values = small_train.coords.copy(), small_train.values.copy()
    p2t2f(small_train, 2, n_parts=3, n_epochs=2, batch_size=128, closing_sweeps=1, validation=small_train)
    np.testing.assert_array_equal(small_train.coords, coords)
    np.testing.assert_array_equal(small_train.values, values)


@pytest.mark.parametrize("rank", [32, 64])
def test_working_set_bytes_predicts_a_fits_peak_memory(rank):
    """The up-front check of rank and batch_size (rank 512 ran the workers out of memory for
    minutes on a 30 x 20 x 25 tensor: a trial) rests on this estimate: within 25% of the peak
    that tracemalloc measures for one epoch of a fit (NumPy reports its buffers to it)."""
    import tracemalloc

    from paperline.kernels.tensor.p2t2f import working_set_bytes

    rng = np.random.default_rng(0)
    shape = (3000, 20, 25)
    flat = rng.choice(int(np.prod(shape)), 30000, replace=False)
    tensor = COOTensor(np.stack(np.unravel_index(flat, shape), axis=1), rng.standard_normal(flat.size), shape)
    tracemalloc.start()
    try:
        p2t2f(tensor, rank, n_parts=2, n_epochs=1, closing_sweeps=1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    predicted = sum(working_set_bytes(shape, rank, 4096, n_parts=2).values())
    assert 0.75 * peak <= predicted <= 1.25 * peak, (predicted / 2**20, peak / 2**20)


@pytest.mark.parametrize("fit", [als, p2t2f])
def test_fits_beyond_the_memory_available_are_refused_before_allocating(fit):
    """als(X, 100000) died in NumPy's "Unable to allocate 894 GiB", and a tensor of 10**11 rows
    at rank 2 likewise (a trial of the library: the flow refused both, the kernels did not)."""
    import psutil

    coords = np.array([[i, j, k] for i in range(5) for j in range(4) for k in range(3)])
    x = COOTensor(coords, np.random.default_rng(0).normal(size=len(coords)), (5, 4, 3))
    before = psutil.Process().memory_info().rss
    with pytest.raises(InputError, match=r"^rank=100000: the factors and the fit's scratch would take [\d,.]+ GiB, "
                                         r"[\d,.]+ GiB available; lower the rank"):
        fit(x, 100000)
    tall = COOTensor(np.array([[0, 0, 0], [1, 1, 1]]), np.array([1.0, 2.0]), (10**11, 4, 3))
    with pytest.raises(InputError, match=r"^tensor=<shape \(100000000000, 4, 3\)>: its factors would take 745.1 GiB "
                                         r"even at rank 1"):
        fit(tall, 2)
    assert psutil.Process().memory_info().rss - before < 2**30  # nothing big was allocated on the way
    assert np.isfinite(fit(x, 2, n_epochs=2).history.objective[-1])  # a fit that fits runs

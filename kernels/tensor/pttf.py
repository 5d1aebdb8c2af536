"""Probabilistic Temporal Tensor Factorization (PTTF): the model, its MAP objective and a serial
ALS reference solver.

Model (see [Li2017p2t2f]_, Sec. 2, after Xiong et al.'s BPTF): a rank-``R`` CP factorization of
an N-way tensor ``Y`` whose last mode is time, with factor matrices ``A_1 .. A_{N-1}`` and time
factors ``T = A_N`` (``I_N x R``)::

    y_e ~ N(<a_{1,i1}, ..., a_{N-1,i(N-1)}, t_k>, sigma^2)         for observed e = (i1, ..., k)  (1)
    a_{m,i} ~ N(0, sigma_A^2 I),  t_1 ~ N(0, sigma_A^2 I)                                         (2)
    t_k ~ N(t_{k-1}, sigma_T^2 I)                                  (temporal smoothness)          (3)

Maximizing the posterior is minimizing the MAP objective, with ``lam = sigma^2 / sigma_A^2`` and
``lam_t = sigma^2 / sigma_T^2``::

    L(A) = 1/2 sum_{e in Omega} (y_e - yhat_e)^2 + lam/2 sum_{m<N} ||A_m||_F^2
           + lam/2 ||t_1||^2 + lam_t/2 sum_{k>=2} ||t_k - t_{k-1}||^2                              (4)

Only observed entries ``Omega`` enter (4): the tensor is held in COO form and never densified.
Every function computes where its inputs live (NumPy on the host, CuPy on a GPU): the factors
follow the tensor's arrays, and only the small ``(I_N R)``-sized banded time system is solved on
the host (SciPy's banded Cholesky; CuPy has none).

.. [Li2017p2t2f] G. Li, Z. Xu, L. Wang, J. Ye, I. King, M. Lyu. "Simple and Efficient
   Parallelization for Probabilistic Temporal Tensor Factorization." IJCNN 2017.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from paperline.kernels.arrays import array_module, to_host
from paperline.kernels.errors import Described, InputError, check_number
from paperline.kernels.tensor.coo import COOTensor


@dataclass
class CPFactors:
    """CP factors of an N-way tensor, time last.

    Attributes:
        factors: list of N float64 arrays; ``factors[m]`` is ``I_m x R`` (NumPy or CuPy, as the
            tensor they were fitted to).
    """

    factors: list[np.ndarray]

    @property
    def rank(self) -> int:
        """``R``, the CP rank (columns of each factor)."""
        return int(self.factors[0].shape[1])

    @property
    def shape(self) -> tuple[int, ...]:
        """``(I_1, ..., I_N)``, the tensor shape the factors model."""
        return tuple(int(f.shape[0]) for f in self.factors)

    def predict(self, coords: np.ndarray) -> np.ndarray:
        """Model values ``yhat`` (Eq. 1 mean) at ``nnz x N`` int coordinates -> ``nnz`` float64."""
        return predict(self.factors, coords)

    def copy(self) -> "CPFactors":
        """A deep copy (each factor copied, on its own device)."""
        return CPFactors([f.copy() for f in self.factors])

    def to_host(self) -> list[np.ndarray]:
        """The factors as NumPy arrays (copied from the GPU when they live there)."""
        return [to_host(f) for f in self.factors]


@dataclass
class FitHistory:
    """Per-epoch trace of a fit. Times are wall seconds since the fit started.

    ``primal_residual``/``dual_residual`` are the consensus residuals of P²T²F (NaN for ALS).
    """

    epoch: list[int] = field(default_factory=list)
    objective: list[float] = field(default_factory=list)
    train_rmse: list[float] = field(default_factory=list)
    validation_rmse: list[float] = field(default_factory=list)
    primal_residual: list[float] = field(default_factory=list)
    dual_residual: list[float] = field(default_factory=list)
    wall_seconds: list[float] = field(default_factory=list)

    def append(self, **row: float) -> None:
        """Append one epoch's values, by field name (e.g. ``epoch=3, objective=0.5``)."""
        for k, v in row.items():
            getattr(self, k).append(v)

    def rows(self) -> list[dict[str, float]]:
        """The trace as one dict per epoch."""
        keys = ["epoch", "objective", "train_rmse", "validation_rmse", "primal_residual",
                "dual_residual", "wall_seconds"]
        return [dict(zip(keys, vals)) for vals in zip(*(getattr(self, k) for k in keys))]


@dataclass
class FitResult:
    """A fitted PTTF model and its trace."""

    factors: CPFactors
    history: FitHistory


EpochCallback = Callable[[dict[str, float]], None]


def predict(factors: list[np.ndarray], coords: np.ndarray) -> np.ndarray:
    """CP model values at coordinates (Eq. 1's mean).

    Args:
        factors: N arrays ``I_m x R`` of one rank R.
        coords: ``nnz x N`` integer indices, ``0 <= coords[:, m] < I_m``.

    Returns:
        ``nnz`` float64: ``sum_r prod_m factors[m][coords[:, m], r]``.

    Raises:
        InputError: factors of different ranks or not 2-D; ``coords`` not an integer
            ``nnz x N`` array, or an index outside its mode (a negative one wrapped around to
            the last rows, a silent wrong value: a trial).
    """
    xp = array_module(coords)
    coords = xp.asarray(coords)
    if not factors or any(getattr(f, "ndim", 0) != 2 for f in factors) or len({f.shape[1] for f in factors}) != 1:
        raise InputError("factors", [getattr(f, "shape", type(f).__name__) for f in factors] if factors else factors,
                         "expected N 2-D arrays I_m x R of one rank R")
    if coords.dtype.kind not in "iu" or coords.ndim != 2 or coords.shape[1] != len(factors):
        raise InputError("coords", Described(f"array of dtype {coords.dtype} and shape {coords.shape}"),
                         f"expected an integer nnz x {len(factors)} array")
    if coords.shape[0]:
        lo, hi = to_host(coords.min(axis=0)), to_host(coords.max(axis=0))
        for m, f in enumerate(factors):
            if lo[m] < 0 or hi[m] >= f.shape[0]:
                raise InputError(f"coords[:, {m}]", (int(lo[m]), int(hi[m])),
                                 f"indices must lie in 0..{f.shape[0] - 1} (the factor's rows)")
    return _predict(factors, coords)


def _predict(factors: list[np.ndarray], coords: np.ndarray) -> np.ndarray:
    """:func:`predict` without the checks (coordinates already checked, e.g. a COOTensor's)."""
    prod = factors[0][coords[:, 0]].copy()
    for m in range(1, len(factors)):
        prod *= factors[m][coords[:, m]]
    return prod.sum(axis=1)


def rmse(factors: list[np.ndarray], tensor: COOTensor) -> float:
    """Root-mean-square error of the model on a tensor's observed entries (data units).

    Raises:
        InputError: ``tensor``'s nominal shape differs from the factors' (``I_m`` rows each).
    """
    _check_factors_fit(factors, tensor)
    xp = array_module(tensor.values)
    return float(xp.sqrt(xp.mean((_predict(factors, tensor.coords) - tensor.values) ** 2)))


def temporal_penalty(t: np.ndarray) -> float:
    """``sum_{k>=2} ||t_k - t_{k-1}||^2`` for ``K x R`` time factors (Eq. 3, 4)."""
    return float(((t[1:] - t[:-1]) ** 2).sum())


def prior_penalty(factors: list[np.ndarray], lam: float, lam_t: float) -> float:
    """The prior terms of Eq. (4): ``lam/2 (sum_{m<N} ||A_m||^2 + ||t_1||^2) + lam_t/2 sum ||t_k - t_{k-1}||^2``."""
    reg = sum(float((f**2).sum()) for f in factors[:-1]) + float((factors[-1][0] ** 2).sum())
    return 0.5 * lam * reg + 0.5 * lam_t * temporal_penalty(factors[-1])


def objective(factors: list[np.ndarray], tensor: COOTensor, lam: float, lam_t: float) -> float:
    """The MAP objective L(A) of Eq. (4) (sum over observed entries, not a mean).

    Raises:
        InputError: ``tensor``'s nominal shape differs from the factors'.
    """
    _check_factors_fit(factors, tensor)
    resid = predict(factors, tensor.coords) - tensor.values
    return 0.5 * float(resid @ resid) + prior_penalty(factors, lam, lam_t)


def gradient(factors: list[np.ndarray], tensor: COOTensor, lam: float, lam_t: float) -> list[np.ndarray]:
    """Gradient of Eq. (4) with respect to each factor matrix (``I_m x R`` each).

    ``dL/dA_m[i] = sum_{e: i_m(e)=i} (yhat_e - y_e) h_{e,m} + lam A_m[i]`` with
    ``h_{e,m} = *_{m' != m} A_{m'}[i_{m'}(e)]`` (Hadamard product of the other modes' rows, an
    MTTKRP over the observed entries), plus the temporal terms for the time factors.

    Raises:
        InputError: ``tensor``'s nominal shape differs from the factors'.
    """
    _check_factors_fit(factors, tensor)
    resid = predict(factors, tensor.coords) - tensor.values
    grads = []
    n_modes = len(factors)
    for m in range(n_modes):
        h = _other_modes(factors, tensor.coords, m)
        g = _scatter_rows(tensor.coords[:, m], resid[:, None] * h, factors[m].shape[0])
        if m < n_modes - 1:
            g += lam * factors[m]
        else:
            t = factors[m]
            g[0] += lam * t[0]
            d = t[1:] - t[:-1]
            g[1:] += lam_t * d
            g[:-1] -= lam_t * d
        grads.append(g)
    return grads


def _other_modes(factors: list[np.ndarray], coords: np.ndarray, skip: int) -> np.ndarray:
    """``nnz x R`` Hadamard product of all modes' rows but ``skip`` (the Khatri-Rao row)."""
    h = None
    for m, f in enumerate(factors):
        if m == skip:
            continue
        rows = f[coords[:, m]]
        h = rows.copy() if h is None else h * rows
    return h


def _scatter_rows(index: np.ndarray, values: np.ndarray, n_rows: int) -> np.ndarray:
    """Sum rows of ``values`` (``n x R``) into ``n_rows x R`` by ``index`` (one bincount per column)."""
    xp = array_module(values)
    return xp.stack([xp.bincount(index, weights=values[:, r], minlength=n_rows)
                     for r in range(values.shape[1])], axis=1)


def check_count(argument: str, value: object, low: int, problem: str | None = None) -> int:
    """``value`` as a Python int ``>= low`` (NumPy integers accepted, bools and floats refused).

    Raises:
        InputError: naming ``argument``; ``problem`` (default ``must be an integer >= low``).
    """
    problem = problem or f"must be an integer >= {low}"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < low:
        raise InputError(argument, value, problem)
    return int(value)


def check_seed(value: object, argument: str = "seed") -> int:
    """A seed: an integer >= 0. None is refused: the fits are reproducible by design.

    Raises:
        InputError: naming ``argument``.
    """
    return check_count(argument, value, 0, "must be an integer >= 0 (None is refused: a seed makes the fit "
                                           "reproducible)")


def check_tensor(value: object, argument: str = "tensor") -> COOTensor:
    """``value`` if it is a :class:`COOTensor`.

    Raises:
        InputError: anything else (a dense array: build one with ``COOTensor.from_dense``).
    """
    if not isinstance(value, COOTensor):
        shown = f"{type(value).__module__}.{type(value).__qualname__}"
        if hasattr(value, "shape"):
            shown += f" of shape {tuple(value.shape)}"
        raise InputError(argument, Described(shown), "must be a COOTensor of the observed entries (a dense array: "
                                          "COOTensor.from_dense(array, mask))")
    return value


def check_held_out(value: object, shape: tuple[int, ...], argument: str = "validation") -> COOTensor | None:
    """A held-out tensor (None allowed) of the training tensor's nominal ``shape``: its coordinates
    index the same rows, so another shape would score unrelated data (or fail on an index).

    Raises:
        InputError: not a COOTensor, or a different shape.
    """
    if value is None:
        return None
    check_tensor(value, argument)
    if tuple(value.shape) != tuple(shape):
        raise InputError(argument, Described(f"COOTensor of shape {value.shape}"),
                         f"must have the training tensor's shape {tuple(shape)}")
    return value


def _check_factors_fit(factors: list[np.ndarray], tensor: COOTensor, argument: str = "tensor") -> None:
    """Raise InputError when ``tensor`` is not a COOTensor or its nominal shape differs from the
    factors' row counts."""
    check_tensor(tensor, argument)
    shape = tuple(int(f.shape[0]) for f in factors)
    if tuple(tensor.shape) != shape:
        raise InputError(argument, Described(f"COOTensor of shape {tensor.shape}"),
                         f"does not match the factors' shape {shape}")


def validate_hyperparameters(*, rank: int, lam: float, lam_t: float, n_epochs: int) -> None:
    """Raise InputError naming the first bad hyperparameter (``rank``, ``n_epochs``: integers >= 1;
    ``lam`` finite > 0; ``lam_t`` finite >= 0)."""
    check_count("rank", rank, 1, "CP rank must be a positive integer")
    for name, v in (("lam", lam), ("lam_t", lam_t)):
        check_number(name, v, low=0.0)
    if lam <= 0:
        raise InputError("lam", lam, "must be > 0 (it keeps rows without observations bounded)")
    check_count("n_epochs", n_epochs, 1, "must be a positive integer")


def check_fit_fits_memory(shape: tuple[int, ...], rank: int, working_bytes: int, like: Any = None) -> None:
    """Refuse a fit whose factors (``sum(shape) x R`` float64) and ``working_bytes`` of scratch
    exceed the memory available on this host (``psutil``), before anything is allocated:
    ``als(X, 100000)`` failed in NumPy with "Unable to allocate 894 GiB" (a trial). Arrays of
    another module (CuPy) live on the device: not checked here.

    Raises:
        InputError: naming ``rank`` (or ``tensor``'s shape, when even rank 1 does not fit).
    """
    if array_module(like) is not np:
        return
    import psutil  # noqa: PLC0415

    available = psutil.virtual_memory().available
    factors = 8 * sum(int(i) for i in shape) * int(rank)
    need = factors + int(working_bytes)
    if need <= available:
        return
    gib = 2**30
    if 8 * sum(int(i) for i in shape) > available:
        raise InputError("tensor", Described(f"shape {tuple(shape)}"), f"its factors would take {8 * sum(shape) / gib:,.1f} GiB "
                                                             f"even at rank 1, {available / gib:,.1f} GiB available")
    raise InputError("rank", rank, f"the factors and the fit's scratch would take {need / gib:,.1f} GiB, "
                                   f"{available / gib:,.1f} GiB available; lower the rank")


def init_factors(shape: tuple[int, ...], rank: int, seed: int, scale: float | None = None,
                 like: Any = None) -> list[np.ndarray]:
    """Seeded Gaussian initial factors, scaled so that ``yhat`` has unit variance at start.

    Each entry is ``N(0, s^2)`` with ``s = R^(-1/(2N))``: ``Var(yhat) = R s^(2N) = 1``. Time
    factors start constant over time (one shared random row), as the smoothness prior (3) favours.
    The draws are NumPy's, so a seed gives the same start on every device; ``like`` (an array)
    puts the factors in its array module (CuPy for a GPU tensor).
    """
    rng = np.random.default_rng(seed)
    n = len(shape)
    s = rank ** (-1.0 / (2 * n)) if scale is None else scale
    factors = [rng.normal(0.0, s, size=(i, rank)) for i in shape[:-1]]
    factors.append(np.repeat(rng.normal(0.0, s, size=(1, rank)), shape[-1], axis=0))
    xp = array_module(like)
    return factors if xp is np else [xp.asarray(f) for f in factors]


def als(tensor: COOTensor, rank: int, *, lam: float = 1.0, lam_t: float = 10.0, n_epochs: int = 30,
        seed: int = 0, validation: COOTensor | None = None, init: list[np.ndarray] | None = None,
        callback: EpochCallback | None = None, tol: float = 0.0) -> FitResult:
    """Serial reference: block-coordinate (alternating) exact minimization of Eq. (4).

    Each epoch solves, for every non-time mode ``m`` and row ``i``, the ``R x R`` ridge system
    ``(sum_e h h^T + lam I) a_i = sum_e y_e h`` exactly; the time factors are coupled by the
    smoothness prior (3), so they are solved jointly as one block-tridiagonal ``(I_N R) x (I_N R)``
    sparse system, followed by :func:`balance_scales`. No step increases (4).

    Args:
        tensor: training entries (COO).
        rank: CP rank ``R`` (an integer > 0).
        lam, lam_t: prior precisions of Eq. (4) (finite; ``lam`` > 0, ``lam_t`` >= 0).
        n_epochs: sweeps over all modes (an integer > 0).
        seed: seed of :func:`init_factors` (an integer >= 0; None is refused).
        validation: optional held-out entries for ``validation_rmse``, of ``tensor``'s shape.
        init: optional initial factors (copied): N finite real arrays ``I_m x R``, in the
            tensor's array module.
        callback: called after every epoch with that epoch's row of the history.
        tol: stop when the relative objective decrease falls below ``tol`` (finite, >= 0; 0:
            run all epochs).

    Returns:
        :class:`FitResult` with factors and per-epoch history.

    Raises:
        InputError: bad hyperparameters, ``tensor`` not a COOTensor, a ``validation`` tensor of
            another shape, ``init`` factors of the wrong number, shape or dtype, or a fit that
            would not fit in the memory available (:func:`check_fit_fits_memory`).
    """
    check_tensor(tensor)
    validate_hyperparameters(rank=rank, lam=lam, lam_t=lam_t, n_epochs=n_epochs)
    seed = check_seed(seed)
    check_number("tol", tol, low=0.0)
    check_held_out(validation, tensor.shape)
    # the per-row R x R Gram matrices of the largest mode, with the solve's copy
    check_fit_fits_memory(tensor.shape, rank, 2 * 8 * max(tensor.shape) * rank * rank, like=tensor.values)
    xp = array_module(tensor.values)
    factors = (_check_init(init, tensor, rank) if init is not None
               else init_factors(tensor.shape, rank, seed, like=tensor.values))
    history = FitHistory()
    start = time.perf_counter()
    prev = np.inf
    n_modes = tensor.ndim
    for epoch in range(1, n_epochs + 1):
        for m in range(n_modes):
            if m < n_modes - 1:
                factors[m] = ridge_rows(factors, tensor.coords, tensor.values, m, lam)
            else:
                h = _other_modes(factors, tensor.coords, m)
                gram, rhs = _row_normal_equations(tensor.coords[:, m], h, tensor.values, factors[m].shape[0])
                factors[m] = solve_time_system(gram, rhs, lam, lam_t)
        balance_scales(factors, lam, lam_t)
        obj = objective(factors, tensor, lam, lam_t)
        row = dict(epoch=epoch, objective=obj, train_rmse=rmse(factors, tensor),
                   validation_rmse=rmse(factors, validation) if validation is not None else float("nan"),
                   primal_residual=float("nan"), dual_residual=float("nan"),
                   wall_seconds=time.perf_counter() - start)
        history.append(**row)
        if callback is not None:
            callback(row)
        if tol > 0 and prev - obj <= tol * abs(prev):
            break
        prev = obj
    return FitResult(CPFactors(factors), history)


def _check_init(init: object, tensor: COOTensor, rank: int) -> list[np.ndarray]:
    """Copies of initial factors for ``tensor`` at ``rank`` as float64 arrays, or InputError."""
    xp = array_module(tensor.values)
    expected = [(s, rank) for s in tensor.shape]
    if isinstance(init, (str, bytes)) or not hasattr(init, "__len__") or len(init) != len(expected):
        raise InputError("init", Described(f"{type(init).__name__}"), f"need a list of {len(expected)} factors of shapes "
                                                            f"{expected}")
    factors = []
    for m, (f, want) in enumerate(zip(init, expected)):
        arr = xp.asarray(f)
        if arr.dtype.kind not in "biuf":
            raise InputError(f"init[{m}]", Described(f"array of dtype {arr.dtype}"), "factors must be real numbers")
        if tuple(arr.shape) != want:
            raise InputError(f"init[{m}]", Described(f"array of shape {tuple(arr.shape)}"),
                             f"expected {want} (I_{m + 1} x rank) for a tensor of shape {tensor.shape}")
        arr = xp.array(arr, dtype=xp.float64)
        if not bool(xp.isfinite(arr).all()):
            raise InputError(f"init[{m}]", Described(f"array of shape {want}"), "factors must be finite")
        factors.append(arr)
    return factors


def ridge_rows(factors: list[np.ndarray], coords: np.ndarray, values: np.ndarray, mode: int,
               lam: float) -> np.ndarray:
    """The exact block update of a non-time mode (the ALS step for Eq. 4): every row ``i`` of
    ``factors[mode]`` solves ``(sum_e h h^T + lam I) a_i = sum_e y_e h`` over the entries ``e`` in
    that row, ``h`` the Hadamard product of the other modes' rows. A row without entries gets 0,
    the prior mean.

    Args:
        factors: the current factors (``factors[mode]`` only gives the row count).
        coords: ``nnz x N`` int coordinates; values: ``nnz`` float64.
        mode: the mode to solve.
        lam: its prior precision.

    Returns:
        ``I_mode x R`` float64 rows.
    """
    h = _other_modes(factors, coords, mode)
    gram, rhs = _row_normal_equations(coords[:, mode], h, values, factors[mode].shape[0])
    return solve_ridge_rows(gram, rhs, lam)


def solve_ridge_rows(gram: np.ndarray, rhs: np.ndarray, lam: float) -> np.ndarray:
    """Rows ``a_i = (G_i + lam I)^-1 b_i`` from per-row normal equations (``I x R x R``, ``I x R``)."""
    xp = array_module(gram)
    return xp.linalg.solve(gram + lam * xp.eye(gram.shape[-1]), rhs[..., None])[..., 0]


def balance_scales(factors: list[np.ndarray], lam: float, lam_t: float) -> np.ndarray:
    """Rescale each CP component across modes to minimize the priors of Eq. (4), in place.

    Scaling column r of mode m by ``c_m`` with ``prod_m c_m = 1`` leaves every ``yhat`` unchanged;
    the prior terms ``sum_m c_m^2 q_m`` (``q_m`` the column's prior energy) are smallest when all
    ``c_m^2 q_m`` are equal (AM-GM), i.e. ``c_m = (prod q)^(1/2N) / sqrt(q_m)``. So this step
    never increases (4); it removes the scale drift that makes plain ALS crawl.

    Returns:
        ``N x R`` scales applied (``c[m, r]`` multiplies column r of mode m).
    """
    n = len(factors)
    xp = array_module(factors[0])
    t = factors[-1]
    q = xp.stack([0.5 * lam * (f**2).sum(axis=0) for f in factors[:-1]]
                 + [0.5 * lam * t[0] ** 2 + 0.5 * lam_t * ((t[1:] - t[:-1]) ** 2).sum(axis=0)])
    c = xp.ones_like(q)
    ok = (q > 1e-300).all(axis=0)
    if bool(ok.any()):
        geo = xp.exp(xp.log(q[:, ok]).mean(axis=0))
        c[:, ok] = xp.sqrt(geo / q[:, ok])
    for m in range(n):
        factors[m] *= c[m]
    return c


def _row_normal_equations(index: np.ndarray, h: np.ndarray, y: np.ndarray, n_rows: int):
    """Per-row Gram ``n_rows x R x R`` (``sum h h^T``) and right-hand side ``n_rows x R`` (``sum y h``)."""
    r = h.shape[1]
    xp = array_module(h)
    gram = xp.empty((n_rows, r, r))
    for a in range(r):
        for b in range(a, r):
            col = xp.bincount(index, weights=h[:, a] * h[:, b], minlength=n_rows)
            gram[:, a, b] = col
            gram[:, b, a] = col
    rhs = _scatter_rows(index, y[:, None] * h, n_rows)
    return gram, rhs


def solve_time_system(gram: np.ndarray, rhs: np.ndarray, lam: float, lam_t: float) -> np.ndarray:
    """Jointly minimize Eq. (4) over ``T`` (``K x R``) given per-slice Grams ``K x R x R``.

    The stationarity conditions form the block-tridiagonal system
    ``(G_k + lam_t c_k I + lam [k=1] I) t_k - lam_t (t_{k-1} + t_{k+1}) = b_k`` with ``c_k`` the
    number of temporal neighbours of slice k. It is positive definite for ``lam > 0``.

    Solved on the host (SciPy's banded Cholesky, ``O(K R^3)``) whatever the inputs' device; the
    result is returned in the inputs' array module.
    """
    import scipy.linalg  # noqa: PLC0415 - here, not at import: importing the kernels stays light

    xp = array_module(gram, rhs)
    gram, rhs = to_host(gram), to_host(rhs)
    k, r = rhs.shape
    eye = np.eye(r)
    neighbours = np.full(k, 2.0)
    neighbours[[0, -1]] = 1.0 if k > 1 else 0.0
    diag = gram + (lam_t * neighbours)[:, None, None] * eye
    diag[0] += lam * eye
    # Symmetric banded storage (upper form, bandwidth R) of the (K R) x (K R) matrix: entry (i, j)
    # with j >= i goes to ab[R + i - j, j]. Within-block entries have j - i < R; the temporal
    # coupling -lam_t sits exactly R above the diagonal.
    n = k * r
    ab = np.zeros((r + 1, n))
    rows, cols = np.triu_indices(r)
    for t in range(k):
        ab[r + rows - cols, t * r + cols] = diag[t, rows, cols]
    if k > 1:
        ab[0, r:] = -lam_t
    sol = scipy.linalg.solveh_banded(ab, rhs.reshape(-1), lower=False, check_finite=False)
    return xp.asarray(sol.reshape(k, r))

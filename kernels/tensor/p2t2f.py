"""P²T²F: parallel PTTF by data splitting and stochastic consensus ADMM ([Li2017p2t2f]_).

Split (Sec. 3.1). The observed entries are partitioned along one non-time mode (by default the
largest; below it is moved first and called the first mode) into ``P`` sub-tensors ``Y^p``
holding disjoint blocks of first-mode indices. The first-mode factor rows
``U_p`` are then *private* to sub-problem ``p``, while the other modes' factors (including the
time factors ``T``) are shared: each sub-problem keeps local copies ``W^p = (A_2^p .. A_N^p)``
constrained to agree with a global consensus ``Z``. Given ``Z`` the sub-problems are independent.

Consensus ADMM (Sec. 3.2), scaled form with per-row penalties ``rho n_i^p`` (``n_i^p`` is the
number of entries of sub-problem p touching row i, at least 1 for time rows, so that a penalty
matches that row's data weight)::

    (U_p, W^p) <- argmin f_p(U_p, W^p) + sum_i rho n_i^p / 2 ||W^p_i - Z_i + Lambda^p_i||^2      (5)
    Z          <- argmin g(Z) + sum_p sum_i rho n_i^p / 2 ||W^p_i - Z_i + Lambda^p_i||^2        (6)
    Lambda^p   <- Lambda^p + W^p - Z                                                             (7)

``f_p`` is the data term of Eq. (4) on ``Y^p``, the prior on ``U_p`` and a 1/P share of the time
priors (the smoothness (3) couples time rows, so each sub-problem solves its time rows jointly);
``g`` holds the Gaussian prior of the other shared modes. Step (6) is then a closed-form weighted
average per row.

Stochastic step (Sec. 3.3). (5) is solved inexactly by one pass over shuffled mini-batches of
``Y^p`` (a stochastic proximal variant of Ouyang et al. 2013's stochastic ADMM). For each mode in
turn (Gauss-Seidel) and each row i touched by the batch, with ``G_i = mean h h^T`` and
``b_i = mean y h`` over the batch entries of row i (``h`` the Hadamard product of the other modes'
rows) and ``kappa_i = tr(G_i) / R``::

    W_i <- (G_i + (kappa_i/lr + rho) I)^-1 (b_i + kappa_i/lr W_i + rho (Z_i - Lambda_i))        (8)
    U_i <- (G_i + (kappa_i/lr + lam/n_i) I)^-1 (b_i + kappa_i/lr U_i)                            (9)

and the time rows solve the block-tridiagonal analogue of (8) with the smoothness prior (8t).
The proximal term ``kappa_i/lr`` damps each step towards the previous value (``lr`` is unit-free);
``lr`` decays and ``rho`` grows over the rounds so the noisy mini-batch steps settle.

Closing step. The last round's ``U_p`` were fitted against the local copies ``W^p``, not the
final consensus ``Z`` the model predicts with, and by damped stochastic steps. After the last
round each sub-problem therefore solves its private rows exactly at ``Z`` (the ridge system
``(sum_e h h^T + lam I) U_i = sum_e y_e h`` over its entries, in parallel; a block-coordinate step
that cannot increase Eq. 4). Measured on the bundled datasets' random splits: held-out RMSE
kinetic 0.0528 -> 0.0518, produc 0.1751 -> 0.1743, flights 0.1607 -> 0.1576.

Then ``closing_sweeps`` sweeps of exact block coordinate descent on Eq. (4) (ALS) finish what the
stochastic rounds leave: the private rows as above, then each shared mode in turn, exactly. The
normal equations of a shared row are sums over its entries, which the split partitions, so each
sub-problem computes its part in parallel (:func:`shared_normal_equations`) and the driver adds
the P parts and solves (ridge rows; the block-tridiagonal time system), then rebalances scales.
No step can increase Eq. (4). The consensus rounds get the shared factors close; the sweeps make
them exact (measured at rank 6 after 40 rounds, held-out RMSE with 0 / 30 sweeps: flights random
0.1576 / 0.1414, TensorLy 0.1433; kinetic random 0.0518 / 0.0469; produc temporal 0.332 / 0.289;
flights temporal 0.276 / 0.279).

Sub-problems run through an *executor* (serial here; Dask tasks on the cluster's workers in
``paperline.tasks``), so this module stays free of any runtime.

Device. Everything computes where the tensor's arrays live: a CuPy tensor gives CuPy
sub-tensors, states and consensus (on a Dask-CUDA cluster each worker receives its sub-tensor on
its own GPU); the seeds give the same draws on either device.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from paperline.kernels.arrays import array_module, to_host
from paperline.kernels.errors import InputError, check_number
from paperline.kernels.tensor.coo import COOTensor
from paperline.kernels.tensor.pttf import (
    _other_modes,
    _predict,
    _row_normal_equations,
    check_fit_fits_memory,
    ridge_rows,
    solve_ridge_rows,
    solve_time_system,
    CPFactors,
    EpochCallback,
    balance_scales,
    FitHistory,
    FitResult,
    init_factors,
    objective,
    prior_penalty,
    rmse,
    check_count,
    check_held_out,
    check_seed,
    check_tensor,
    validate_hyperparameters,
)


@dataclass(frozen=True, eq=False)
class SubTensor:
    """Sub-problem ``p`` of the split: a block of first-mode rows and their observed entries.

    Attributes:
        index: which sub-problem (0..P-1).
        rows: ``I_p`` int64 global first-mode indices owned by this block.
        coords: ``nnz_p x N`` int64 coordinates with the first mode re-indexed into ``rows``.
        values: ``nnz_p`` float64.
        row_counts: list of N int64 arrays; ``row_counts[m][i]`` = entries touching row i of
            mode m (mode 0 local rows, other modes global rows).
    """

    index: int
    rows: np.ndarray
    coords: np.ndarray
    values: np.ndarray
    row_counts: list[np.ndarray]

    @property
    def nnz(self) -> int:
        """Number of observed entries in the sub-tensor."""
        return int(self.values.size)


@dataclass
class LocalState:
    """State of one sub-problem between ADMM rounds (picklable; NumPy or CuPy arrays).

    Attributes:
        u: ``I_p x R`` private first-mode factor rows.
        w: local copies of the shared factors, ``I_m x R`` for m = 1..N-1.
        dual: scaled duals ``Lambda^p``, same shapes as ``w``.
        seed: seed of this sub-problem's mini-batch shuffles (combined with the round number).
    """

    u: np.ndarray
    w: list[np.ndarray]
    dual: list[np.ndarray]
    seed: int


@dataclass(frozen=True)
class LocalResult:
    """What a sub-problem returns after one round.

    Attributes:
        state: its new state.
        sum_squared_error: squared residuals seen during the pass (before each batch's update).
        n_entries: entries visited by the pass.
        seconds: wall seconds of the round.
        consensus_sse: squared residuals of its entries at the round's *input* point
            ``(U_p, Z)``, i.e. the data term of Eq. (4) at the previous round's consensus,
            computed here so the driver does not predict every entry serially.
    """

    state: LocalState
    sum_squared_error: float
    n_entries: int
    seconds: float
    consensus_sse: float


class Executor(Protocol):
    """Runs the sub-problems of every round. ``place`` once, then ``map`` every round.

    ``place(items)`` returns handles (e.g. Dask futures pinned to workers) to the sub-tensors;
    ``map(fn, handles, args)`` calls ``fn(handle_i, *args_i)`` for every i and returns results in
    order. Implementations must run the calls in parallel to obtain the P²T²F speed-up.
    """

    def place(self, items: Sequence[Any]) -> list[Any]:
        """Put each sub-problem ``items[p]`` (a :class:`SubTensor`) where it will be solved,
        once; returns one handle per item, in order (the item itself, or e.g. a Dask future pinned
        to a worker)."""
        ...

    def map(self, fn: Callable[..., Any], handles: Sequence[Any], args: Sequence[tuple]) -> list[Any]:
        """``fn(handles[i], *args[i])`` for every ``i``, in parallel where the implementation
        can; returns the results in the order of ``handles``. A call's exception is raised here."""
        ...


class SerialExecutor:
    """Runs the sub-problems one after another in this process (the reference; tests)."""

    def place(self, items: Sequence[Any]) -> list[Any]:
        """The items themselves (nothing to move)."""
        return list(items)

    def map(self, fn, handles, args):
        """``[fn(h, *a) for h, a in zip(handles, args)]``, serially."""
        return [fn(h, *a) for h, a in zip(handles, args)]


def split_tensor(tensor: COOTensor, n_parts: int) -> list[SubTensor]:
    """Partition the observed entries into ``P`` sub-tensors of contiguous first-mode row blocks,
    balanced by entry count (Sec. 3.1).

    Raises:
        InputError: ``n_parts`` (P) not an integer >= 1, or larger than the number of slices along
            the first mode (the split mode, moved first by :func:`p2t2f`). Named ``n_parts``.
    """
    n0 = tensor.shape[0]
    n_parts = check_count("n_parts", n_parts, 1, "P, the number of sub-tensors, must be a positive integer")
    if n_parts > n0:
        raise InputError("n_parts", n_parts, f"P larger than the number of slices along the split mode ({n0})")
    xp = array_module(tensor.values)
    first = to_host(tensor.coords[:, 0])  # the cut points are computed on the host
    per_row = np.bincount(first, minlength=n0)
    cum = np.cumsum(per_row)
    targets = cum[-1] * np.arange(1, n_parts) / n_parts
    cuts = np.searchsorted(cum, targets, side="left") + 1
    cuts = np.clip(cuts, np.arange(1, n_parts), n0 - n_parts + np.arange(1, n_parts))
    cuts = np.maximum.accumulate(np.concatenate([[0], cuts, [n0]]))
    for p in range(1, n_parts + 1):  # strictly increasing: every block owns >= 1 row
        cuts[p] = max(cuts[p], cuts[p - 1] + 1)
    cuts[-1] = n0
    owner = np.searchsorted(cuts[1:], np.arange(n0), side="right")
    entry_owner = owner[first]
    parts = []
    for p in range(n_parts):
        rows = xp.arange(int(cuts[p]), int(cuts[p + 1]), dtype=xp.int64)
        sel = xp.asarray(np.flatnonzero(entry_owner == p))
        coords = tensor.coords[sel].copy()
        coords[:, 0] -= int(cuts[p])
        counts = [xp.bincount(coords[:, 0], minlength=rows.size)]
        counts += [xp.bincount(coords[:, m], minlength=tensor.shape[m]) for m in range(1, tensor.ndim)]
        parts.append(SubTensor(p, rows, coords, tensor.values[sel].copy(), counts))
    return parts


def _segment_sums(index: np.ndarray, values: np.ndarray, n_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sum the rows of ``values`` (``B x C``) that share an ``index`` in ``[0, n_rows)``, with one
    ``bincount`` over the flattened ``(index, column)`` pairs.

    Returns:
        ``(rows, counts, sums)``: the touched indices (sorted), how many entries each has, and
        the ``len(rows) x C`` sums.
    """
    xp = array_module(values)
    n_cols = values.shape[1]
    flat = (index[:, None] * n_cols + xp.arange(n_cols)).ravel()
    sums = xp.bincount(flat, weights=values.ravel(), minlength=n_rows * n_cols).reshape(n_rows, n_cols)
    counts = xp.bincount(index, minlength=n_rows)
    rows = xp.flatnonzero(counts)
    return rows, counts[rows], sums[rows]


def time_penalty_rows(sub: SubTensor) -> np.ndarray:
    """Per-row consensus weights of the time factors: ``max(n_k^p, 1)`` entries, so that slices
    without local data (e.g. the held-out future) still take part in the consensus."""
    return array_module(sub.values).maximum(sub.row_counts[-1], 1).astype(np.float64)


def working_set_bytes(shape: Sequence[int], rank: int, batch_size: int, n_parts: int = 1) -> dict[str, int]:
    """Peak bytes of one worker's P²T²F fit beyond its data, by term, for the up-front check of
    ``rank`` and ``batch_size`` (rank 512 was accepted, and a 30 x 20 x 25 tensor ran the
    workers out of memory for minutes: a fresh-user trial).

    Args:
        shape: the tensor's shape ``(I_1, ..., I_N)``, ``I_N`` the time slices.
        rank: CP rank R. batch_size: entries per mini-batch B. n_parts: P, the sub-problems
            the split mode (:func:`default_split_mode`) is divided into.

    Returns:
        ``{"batch_statistics": ..., "row_grams": ...}`` in bytes: the mini-batch statistics of
        :func:`local_update` (``B x (R(R+1)/2 + R)`` float64, about three copies at once: measured
        2.9 with tracemalloc at R = 64 and 96), and the per-row Gram matrices of the largest mode
        (``I x R x R``, the update and the closing ALS sweeps: twice, with the solve's copy; the
        split mode's ``I / P`` rows per sub-problem).
    """
    pairs = rank * (rank + 1) // 2
    split = default_split_mode(shape)
    rows = max(-(-int(i) // max(int(n_parts), 1)) if m == split else int(i) for m, i in enumerate(shape))
    return {"batch_statistics": 3 * 8 * int(batch_size) * (pairs + rank),
            "row_grams": 2 * 8 * rows * rank * rank}


def local_update(sub: SubTensor, state: LocalState, consensus: list[np.ndarray], round_: int,
                 lr: float, rho: float, lam: float, lam_t: float, n_parts: int, batch_size: int,
                 local_passes: int = 1, warmup_rounds: int = 1) -> LocalResult:
    """Step (5) for one sub-problem: one shuffled pass of linearized stochastic updates (8)-(9).

    Args:
        sub: this sub-problem's entries.
        state: its state after the previous round (not modified).
        consensus: ``Z``, the shared factors ``I_m x R`` for m = 1..N-1.
        round_: ADMM round number (seeds the shuffle together with ``state.seed``).
        lr: step size (unit-free, ~0.1-1).
        rho: consensus penalty per entry.
        lam: prior precision on the private rows.
        batch_size: entries per mini-batch.
        warmup_rounds: in rounds ``<= warmup_rounds`` only the private rows ``U_p`` move.

    Returns:
        :class:`LocalResult`; ``sum_squared_error`` is accumulated over the pass's batches, before
        each batch's update.
    """
    start = time.perf_counter()
    xp = array_module(sub.values)
    n_modes = sub.coords.shape[1]
    resid_in = _predict([state.u] + list(consensus), sub.coords) - sub.values
    consensus_sse = float(resid_in @ resid_in)
    factors = [state.u.copy()] + [w.copy() for w in state.w]
    target = [None] + [z - d for z, d in zip(consensus, state.dual)]  # Z - Lambda
    # Rows this sub-problem has no data for follow the consensus exactly.
    for m in range(1, n_modes - 1):
        absent = sub.row_counts[m] == 0
        factors[m][absent] = consensus[m - 1][absent]
    u_reg = lam / xp.maximum(sub.row_counts[0], 1)
    rng = np.random.default_rng([state.seed, round_])
    order = xp.asarray(np.concatenate([rng.permutation(sub.nnz) for _ in range(local_passes)]))
    sse = 0.0
    rank = factors[0].shape[1]
    iu = xp.triu_indices(rank)
    n_pairs = iu[0].size
    eye = xp.eye(rank)
    moving = range(n_modes) if round_ > warmup_rounds else range(1)
    for lo in range(0, order.size, batch_size):
        idx = order[lo:lo + batch_size]
        coords = sub.coords[idx]
        y = sub.values[idx]
        rows = [factors[m][coords[:, m]] for m in range(n_modes)]
        prod = rows[0] * rows[1]
        for m in range(2, n_modes):
            prod *= rows[m]
        resid = prod.sum(axis=1) - y
        sse += float(resid @ resid)
        for m in moving:  # Gauss-Seidel over modes: each sees the others' fresh rows
            h = None
            for m2 in range(n_modes):
                if m2 != m:
                    h = rows[m2].copy() if h is None else h * rows[m2]
            ix = coords[:, m]
            n_rows = factors[m].shape[0]
            # Batch normal equations per touched row: G_i = mean h h^T, b_i = mean y h; one
            # segmented sum over [h h^T (upper) | y h].
            stats = xp.concatenate([h[:, iu[0]] * h[:, iu[1]], y[:, None] * h], axis=1)
            touched, c, sums = _segment_sums(ix, stats, n_rows)
            sums /= c[:, None]
            gram = xp.empty((touched.size, rank, rank))
            gram[:, iu[0], iu[1]] = sums[:, :n_pairs]
            gram[:, iu[1], iu[0]] = sums[:, :n_pairs]
            rhs = sums[:, n_pairs:]
            kappa = xp.trace(gram, axis1=1, axis2=2) / rank
            # The proximal damping tames the noise of a row's batch statistics; a batch holding
            # every local entry of the row has none, so the damping fades with the coverage.
            noise = 1.0 - xp.minimum(c / xp.maximum(sub.row_counts[m][touched], 1), 1.0)
            damping = (kappa / lr * noise + 1e-12)[:, None]
            old = factors[m][touched]
            if m == 0:                                                                     # (9)
                shift = damping + u_reg[touched][:, None]
                b = rhs + damping * old
                factors[m][touched] = xp.linalg.solve(gram + shift[:, :, None] * eye, b[..., None])[..., 0]
            elif m < n_modes - 1:                                                          # (8)
                shift = damping + rho
                b = rhs + damping * old + rho * target[m][touched]
                factors[m][touched] = xp.linalg.solve(gram + shift[:, :, None] * eye, b[..., None])[..., 0]
            else:                                                                          # (8t)
                # Time rows are coupled by this sub-problem's share of the smoothness prior, so
                # they are solved jointly, in the units of the full objective: the batch
                # statistics of row k scaled to its n_k local entries.
                n_k = sub.row_counts[m].astype(np.float64)
                weight = xp.zeros(n_rows)
                weight[touched] = n_k[touched]
                full_gram = xp.zeros((n_rows, rank, rank))
                full_gram[touched] = (gram + damping[:, :, None] * eye) * weight[touched][:, None, None]
                full_rhs = xp.zeros((n_rows, rank))
                full_rhs[touched] = (rhs + damping * old) * weight[touched][:, None]
                penalty = rho * time_penalty_rows(sub)
                full_gram += penalty[:, None, None] * eye
                full_rhs += penalty[:, None] * target[m]
                factors[m] = solve_time_system(full_gram, full_rhs, lam / n_parts, lam_t / n_parts)
            rows[m] = factors[m][coords[:, m]]
    new_state = LocalState(factors[0], factors[1:], state.dual, state.seed)
    return LocalResult(new_state, sse, order.size, time.perf_counter() - start, consensus_sse)


def exact_private_rows(sub: SubTensor, state: LocalState, consensus: list[np.ndarray], lam: float) -> np.ndarray:
    """The closing step: sub-problem ``p``'s private rows ``U_p`` solved exactly at the consensus.

    :func:`~paperline.kernels.tensor.pttf.ridge_rows` of mode 0 on this sub-problem's entries,
    with the consensus as the other modes (the U-block of ALS on Eq. 4).

    Args:
        sub: this sub-problem's entries.
        state: its state after the last round (only ``state.u``'s shape is used).
        consensus: ``Z``, the shared factors.
        lam: prior precision on the private rows.

    Returns:
        ``I_p x R`` float64 rows (0, the prior mean, for a row without local entries).
    """
    return ridge_rows([state.u] + list(consensus), sub.coords, sub.values, 0, lam)


def shared_normal_equations(sub: SubTensor, u: np.ndarray, consensus: list[np.ndarray], j: int
                            ) -> tuple[np.ndarray, np.ndarray]:
    """Sub-problem ``p``'s share of the exact update of shared mode ``j + 1`` (a closing sweep).

    The ALS step of a mode solves, per row, normal equations that are sums over the row's
    entries; the entries are partitioned over the sub-problems, so the sums are too: each
    sub-problem returns its part and the driver adds the P parts and solves (the ridge system, or
    the block-tridiagonal time system with the smoothness prior).

    Args:
        sub: this sub-problem's entries.
        u: its private rows ``U_p`` (``I_p x R``).
        consensus: the shared factors.
        j: index into ``consensus`` of the mode to update.

    Returns:
        ``(gram, rhs)``: ``I_m x R x R`` and ``I_m x R`` float64 sums over this sub-problem's
        entries (zero for rows it does not touch).
    """
    h = _other_modes([u] + list(consensus), sub.coords, j + 1)
    return _row_normal_equations(sub.coords[:, j + 1], h, sub.values, consensus[j].shape[0])


def consensus_update(locals_: Sequence[LocalState], weights: Sequence[list[np.ndarray]],
                     lam: float, lam_t: float, rho: float) -> list[np.ndarray]:
    """Step (6): the consensus ``Z`` minimizing the shared priors plus the weighted penalties.

    Args:
        locals_: the P local states (their ``w`` and ``dual``).
        weights: per sub-problem, the row counts ``n_i^p`` of modes 1..N-1.
        lam, lam_t, rho: as in Eq. (4)-(6).

    Returns:
        Z: shared factors ``I_m x R`` for m = 1..N-1; the last one is the time factors.
    """
    n_shared = len(locals_[0].w)
    out = []
    for j in range(n_shared):
        wsum = sum(rho * w[j][:, None] * (s.w[j] + s.dual[j]) for s, w in zip(locals_, weights))
        wtot = sum(rho * w[j] for w in weights)[:, None]
        # Time: its priors live in the sub-problems (8t), so Z_T is the weighted average.
        out.append(wsum / (wtot + (lam if j < n_shared - 1 else 0.0)))
    return out


@dataclass
class ADMMState:
    """Everything P²T²F needs to resume: consensus, local states and the round counter."""

    consensus: list[np.ndarray]
    locals: list[LocalState]
    round: int = 0


def default_split_mode(shape: Sequence[int]) -> int:
    """The mode P²T²F splits along by default: the largest non-time mode (the first on ties).

    Its rows become the sub-problems' private factors, so the largest mode leaves the fewest
    shared rows to reach consensus on and lets P parts balance (flights' 3 origins would split 2:1;
    its 105 destinations split evenly). Measured in the README's tensor benchmark.
    """
    return int(np.argmax(np.asarray(shape[:-1])))


def _permute(tensor: COOTensor, order: list[int]) -> COOTensor:
    names = tuple(tensor.mode_names[m] for m in order) if tensor.mode_names else None
    return COOTensor(tensor.coords[:, order], tensor.values, tuple(tensor.shape[m] for m in order), names)


def p2t2f(tensor: COOTensor, rank: int, *, n_parts: int = 2, lam: float = 1.0, lam_t: float = 10.0,
          rho: float = 0.01, lr: float = 1.0, lr_decay: float = 0.03, rho_growth: float = 1.05, rho_max: float = 100.0,
          rho_balance: float = 0.0, local_passes: int = 1,
          n_epochs: int = 30, batch_size: int = 4096, seed: int = 0,
          validation: COOTensor | None = None, executor: Executor | None = None,
          callback: EpochCallback | None = None, split_mode: int | None = None,
          closing_sweeps: int = 30) -> FitResult:
    """Fit PTTF (Eq. 4) with P²T²F: data split plus stochastic consensus ADMM (steps 5-8).

    One epoch is one ADMM round: every sub-problem makes one mini-batch pass over its entries
    (in parallel through ``executor``), then the consensus and duals are updated. In the first
    round only the private rows ``U_p`` move (a warm-up fitting them to the common initial ``Z``),
    which keeps the sub-problems from drifting into different symmetric solutions before the
    first consensus.

    Args:
        tensor: training entries (COO), time last, N >= 3.
        rank: CP rank R (an integer > 0).
        n_parts: P, the number of sub-tensors (an integer, 1 <= P <= I_1).
        lam, lam_t: prior precisions of Eq. (4) (finite; ``lam`` > 0, ``lam_t`` >= 0).
        rho: initial consensus penalty per entry (finite, > 0).
        lr: unit-free step size of (8)-(9) (finite, > 0); round t uses ``lr / (1 + lr_decay (t - 1))``
            (``lr_decay`` finite, >= 0), the decaying steps stochastic ADMM needs to converge rather
            than hover.
        rho_growth, rho_max: round t uses ``min(rho rho_growth^(t-1), rho_max)``; an increasing
            penalty (with the scaled duals rescaled) tightens consensus as the fit settles.
            ``rho_growth`` finite, >= 1 (1: constant); ``rho_max`` finite, > 0 (a ``rho`` above it
            is capped from the first round).
        rho_balance: if > 1, residual balancing (Boyd et al. 2011, Sec. 3.4.1): rho doubles when
            the primal residual exceeds ``rho_balance`` times the dual one and halves in the
            opposite case. 0 (or anything <= 1) turns it off; finite, >= 0.
        local_passes: mini-batch passes of each sub-problem per round (an integer >= 1; more:
            a more exact step (5)).
        n_epochs: ADMM rounds (an integer >= 1).
        batch_size: entries per mini-batch (an integer >= 1).
        seed: seeds the initial factors and each sub-problem's shuffles (an integer >= 0; None is
            refused: a fit is reproducible and independent of the executor by design).
        validation: optional held-out entries for ``validation_rmse``, with ``tensor``'s shape.
        executor: runs the sub-problems; default :class:`SerialExecutor`.
        callback: called with each epoch's history row, one round after that epoch (the data term
            of its objective is computed by the sub-problems of the next round).
        split_mode: the (non-time) mode whose slices are split into the P sub-tensors; default
            :func:`default_split_mode`, the largest. The returned factors are in the tensor's own
            mode order either way.
        closing_sweeps: exact block-coordinate sweeps after the last round (module docstring,
            "Closing step"; 0: only the private rows' exact solve; an integer >= 0). Each costs N
            parallel calls.

    Returns:
        :class:`FitResult`: factors ``(U, Z_2, ..., Z_N)`` and the per-epoch history with
        objective (Eq. 4 at the consensus), primal residual ``sqrt(sum_p ||W^p - Z||^2)`` and dual
        residual ``rho sqrt(sum_p ||Z - Z_prev||^2)`` (Boyd et al. 2011, Sec. 3.3).

    Raises:
        InputError: ``tensor`` not a COOTensor (e.g. a dense array), a hyperparameter of the wrong
            type or out of the ranges above (NaN/inf included), a ``validation`` tensor that is not
            a COOTensor of ``tensor``'s shape, a split mode that is not a non-time mode, P
            larger than the split mode, or a fit beyond the memory available
            (:func:`~paperline.kernels.tensor.pttf.check_fit_fits_memory`, with
            :func:`working_set_bytes`). The message names the argument.
    """
    check_tensor(tensor)
    validate_hyperparameters(rank=rank, lam=lam, lam_t=lam_t, n_epochs=n_epochs)
    check_number("rho", rho, low=0.0, low_open=True)
    check_number("lr", lr, low=0.0, low_open=True)
    check_number("lr_decay", lr_decay, low=0.0)
    check_number("rho_growth", rho_growth, low=1.0)
    check_number("rho_max", rho_max, low=0.0, low_open=True)
    check_number("rho_balance", rho_balance, low=0.0)
    local_passes = check_count("local_passes", local_passes, 1)
    batch_size = check_count("batch_size", batch_size, 1, "must be a positive integer")
    seed = check_seed(seed)
    closing_sweeps = check_count("closing_sweeps", closing_sweeps, 0)
    check_count("n_parts", n_parts, 1, "P, the number of sub-tensors, must be a positive integer")
    check_held_out(validation, tensor.shape)
    check_fit_fits_memory(tensor.shape, rank, sum(working_set_bytes(tensor.shape, rank, batch_size, n_parts).values()),
                          like=tensor.values)
    n_modes = len(tensor.shape)
    mode = default_split_mode(tensor.shape) if split_mode is None else split_mode
    if isinstance(mode, (bool, np.bool_)) or not isinstance(mode, (int, np.integer)) or not 0 <= mode < n_modes - 1:
        raise InputError("split_mode", split_mode, f"must be a non-time mode, 0..{n_modes - 2}")
    if mode != 0:  # solve with the split mode first, then put the factors back in order
        order = [int(mode)] + [m for m in range(n_modes) if m != mode]
        fit = p2t2f(_permute(tensor, order), rank, n_parts=n_parts, lam=lam, lam_t=lam_t, rho=rho, lr=lr,
                    lr_decay=lr_decay, rho_growth=rho_growth, rho_max=rho_max, rho_balance=rho_balance,
                    local_passes=local_passes, n_epochs=n_epochs, batch_size=batch_size, seed=seed,
                    validation=None if validation is None else _permute(validation, order), executor=executor,
                    callback=callback, split_mode=0, closing_sweeps=closing_sweeps)
        factors = [None] * n_modes
        for i, m in enumerate(order):
            factors[m] = fit.factors.factors[i]
        return FitResult(CPFactors(factors), fit.history)
    parts = split_tensor(tensor, n_parts)
    executor = executor or SerialExecutor()
    xp = array_module(tensor.values)
    init = init_factors(tensor.shape, rank, seed, like=tensor.values)
    consensus = [f.copy() for f in init[1:]]
    states = [LocalState(init[0][sub.rows].copy(), [f.copy() for f in consensus],
                         [xp.zeros_like(f) for f in consensus], seed * 1_000_003 + p)
              for p, sub in enumerate(parts)]
    weights = [sub.row_counts[1:-1] + [time_penalty_rows(sub)] for sub in parts]
    handles = executor.place(parts)
    history = FitHistory()
    start = time.perf_counter()
    u = init[0].copy()
    rho_t = rho
    primal, dual = 0.0, 0.0
    pending: tuple[dict[str, float], float] | None = None

    def record(row: dict[str, float]) -> None:
        history.append(**row)
        if callback is not None:
            callback(row)

    for epoch in range(1, n_epochs + 1):
        new_rho = rho_t
        if epoch > 1 and rho_growth != 1.0:
            new_rho = rho_t * rho_growth
        if epoch > 2 and rho_balance > 1.0:  # residual balancing (Boyd et al. 2011, Sec. 3.4.1)
            if primal > rho_balance * dual:
                new_rho = rho_t * 2.0
            elif dual > rho_balance * primal:
                new_rho = rho_t / 2.0
        new_rho = min(new_rho, rho_max)
        if new_rho != rho_t:
            for s in states:  # scaled duals are y / rho: rescale when rho changes
                s.dual = [d * (rho_t / new_rho) for d in s.dual]
            rho_t = new_rho
        results: list[LocalResult] = executor.map(
            local_update, handles,
            [(s, consensus, epoch, lr / (1.0 + lr_decay * (epoch - 1)), rho_t, lam, lam_t, len(parts), batch_size,
              local_passes)
             for s in states])
        states = [r.state for r in results]
        if pending is not None:  # the previous round's objective: data term from the workers
            row, prior = pending
            row["objective"] = 0.5 * sum(r.consensus_sse for r in results) + prior
            record(row)
        previous = consensus
        consensus = consensus_update(states, weights, lam, lam_t, rho_t)
        primal_sq = 0.0
        for s in states:
            for j, z in enumerate(consensus):
                diff = s.w[j] - z
                s.dual[j] = s.dual[j] + diff                                             # (7)
                primal_sq += float((diff**2).sum())
        # Scale balancing (see pttf.balance_scales) applied to U, Z, W^p and Lambda^p alike: the
        # data terms and the consensus constraints are invariant, the priors cannot increase.
        primal = float(np.sqrt(primal_sq))
        dual = rho_t * float(np.sqrt(len(states) * sum(float(((z - zp) ** 2).sum())
                                                       for z, zp in zip(consensus, previous))))
        for s, sub in zip(states, parts):
            u[sub.rows] = s.u
        scales = balance_scales([u] + consensus, lam, lam_t)
        for s in states:
            s.u = s.u * scales[0]
            s.w = [w * c for w, c in zip(s.w, scales[1:])]
            s.dual = [d * c for d, c in zip(s.dual, scales[1:])]
        factors = [u] + consensus
        n_seen = sum(r.n_entries for r in results)
        row = dict(epoch=epoch, objective=float("nan"),
                   train_rmse=float(np.sqrt(sum(r.sum_squared_error for r in results) / n_seen)),
                   validation_rmse=rmse(factors, validation) if validation is not None else float("nan"),
                   primal_residual=primal, dual_residual=dual,
                   wall_seconds=time.perf_counter() - start)
        pending = (row, prior_penalty(factors, lam, lam_t))
    # Closing step: the private rows solved exactly at the final consensus, in parallel; then
    # closing sweeps of exact block coordinate descent on Eq. (4), distributed (module docstring).
    for sweep in range(closing_sweeps + 1):
        for sub, rows in zip(parts, executor.map(exact_private_rows, handles, [(s, consensus, lam) for s in states])):
            u[sub.rows] = rows
        if sweep == closing_sweeps:
            break
        for j in range(len(consensus)):
            stats = executor.map(shared_normal_equations, handles, [(u[sub.rows], consensus, j) for sub in parts])
            gram, rhs = sum(g for g, _ in stats), sum(b for _, b in stats)
            last = j == len(consensus) - 1
            consensus[j] = solve_time_system(gram, rhs, lam, lam_t) if last else solve_ridge_rows(gram, rhs, lam)
        balance_scales([u] + consensus, lam, lam_t)
    # The last round's objective has no next round to compute its data term: do it here, at the
    # returned factors (as the validation RMSE).
    row, _ = pending
    row["objective"] = objective([u] + consensus, tensor, lam, lam_t)
    if validation is not None:
        row["validation_rmse"] = rmse([u] + consensus, validation)
    row["wall_seconds"] = time.perf_counter() - start  # the closing step included
    record(row)
    return FitResult(CPFactors([u.copy()] + [z.copy() for z in consensus]), history)

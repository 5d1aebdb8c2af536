"""Pareto utilities: dominance numbers and hypervolume, in the maximization convention.

Hypervolume and non-dominated filtering are BoTorch's (``DominatedPartitioning``,
``is_non_dominated``); this module adds the dominance number LaMOO partitions by and the checks
on the reference point.

Every ``Y`` here is an ``n x m`` float64 array of objective values *to maximize* (a problem's
minimized objectives enter negated; see :meth:`Problem.to_max`).
"""

from __future__ import annotations

import numpy as np

from paperline.kernels.errors import InputError


def dominance_numbers(y: np.ndarray) -> np.ndarray:
    """For each point, how many other points dominate it (``n`` int64).

    ``y_j`` dominates ``y_i`` when ``y_j >= y_i`` in every objective and ``>`` in at least one.
    Dominance number 0 marks the Pareto front. See [Zhao2022lamoo]_, Sec. 3.1 (the "dominance
    number" that labels samples before the split).

    Raises:
        InputError: ``y`` is not 2-D (``n x m``).
    """
    y = np.asarray(y, dtype=np.float64)
    if y.ndim != 2:
        raise InputError("y", y.shape, "expected an n x m array")
    ge = (y[None, :, :] >= y[:, None, :]).all(axis=2)  # ge[i, j]: y_j >= y_i everywhere
    gt = (y[None, :, :] > y[:, None, :]).any(axis=2)
    return (ge & gt).sum(axis=1).astype(np.int64)


def pareto_mask(y: np.ndarray) -> np.ndarray:
    """Boolean mask of the non-dominated rows of ``y`` (BoTorch ``is_non_dominated``; duplicates kept once)."""
    import torch
    from botorch.utils.multi_objective.pareto import is_non_dominated

    y = np.asarray(y, dtype=np.float64)
    if y.shape[0] == 0:
        return np.zeros(0, dtype=bool)
    return is_non_dominated(torch.from_numpy(y), deduplicate=True).numpy()


def hypervolume(y: np.ndarray, ref_point: np.ndarray) -> float:
    """Hypervolume dominated by ``y`` (``n x m``) and bounded by ``ref_point`` (``m``), via BoTorch.

    Points that do not strictly dominate the reference point add nothing; NaN rows (failed
    evaluations) are ignored. Returns 0.0 for no such points.

    Raises:
        InputError: ``y`` not numbers or not 2-D (naming ``y`` and its shape); ``ref_point`` not
            ``m`` finite numbers (naming ``ref_point``).
    """
    import torch
    from botorch.utils.multi_objective.box_decompositions.dominated import DominatedPartitioning

    y, ref = _check_front(y, ref_point)
    y = y[np.isfinite(y).all(axis=1)]
    y = y[(y > ref).all(axis=1)]
    if y.shape[0] == 0:
        return 0.0
    part = DominatedPartitioning(ref_point=torch.from_numpy(ref), Y=torch.from_numpy(y))
    return float(part.compute_hypervolume())


def hypervolume_trace(y: np.ndarray, ref_point: np.ndarray) -> np.ndarray:
    """Hypervolume of the first ``i + 1`` points, for each ``i`` (``n`` float64).

    Raises:
        InputError: as :func:`hypervolume`.
    """
    y, ref_point = _check_front(y, ref_point)
    out = np.zeros(y.shape[0])
    front = np.zeros((0, y.shape[1]))
    hv = 0.0
    for i in range(y.shape[0]):
        row = y[i:i + 1]
        if np.isfinite(row).all() and (row > ref_point).all() and not _dominated_by(row[0], front):
            front = np.vstack([front, row])
            front = front[pareto_mask(front)]
            hv = hypervolume(front, ref_point)
        out[i] = hv
    return out


def _check_front(y: np.ndarray, ref_point: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(y, ref_point)`` as float64: ``y`` ``n x m``, ``ref_point`` ``m`` finite values
    (:func:`check_ref_point`)."""
    try:
        y = np.asarray(y, dtype=np.float64)
    except (TypeError, ValueError):
        shown = y.tolist() if isinstance(y, np.ndarray) else y  # an array's repr spans lines
        raise InputError("y", shown, "must be a 2-D (n_points, n_objectives) array of numbers") from None
    if y.ndim != 2:
        raise InputError("y", y.shape, "must be 2-D (n_points, n_objectives)")
    return y, check_ref_point(ref_point, y.shape[1], f" (column) of y, which is {y.shape[0]} x {y.shape[1]}")


def check_ref_point(ref_point: object, m: int, where: str = "") -> np.ndarray:
    """``ref_point`` as ``m`` finite float64 values, one per objective.

    A NaN reference point would make every hypervolume a silent 0.0, so it is refused.
    ``where`` ends the message of a wrong length (e.g. ``" (column) of y, which is 2 x 3"``).

    Raises:
        InputError: naming ``ref_point``: not numbers, not ``m`` of them, or not finite.
    """
    try:
        ref = np.asarray(ref_point, dtype=np.float64)
    except (TypeError, ValueError):
        shown = ref_point.tolist() if isinstance(ref_point, np.ndarray) else ref_point
        raise InputError("ref_point", shown, f"expected {m} finite numbers, one per objective{where}") from None
    if ref.shape != (m,):
        raise InputError("ref_point", ref.tolist(), f"expected {m} finite numbers, one per objective{where}")
    if not np.isfinite(ref).all():
        raise InputError("ref_point", ref.tolist(), "values must be finite")
    return ref


def _dominated_by(p: np.ndarray, front: np.ndarray) -> bool:
    return bool(front.shape[0]) and bool(((front >= p).all(axis=1)).any())


def check_reference_point(ref_point: np.ndarray, attainable: np.ndarray, *, argument: str = "ref_point",
                          shown: list[float] | None = None) -> None:
    """Refuse a reference point that no attainable point strictly dominates.

    Args:
        ref_point: ``m`` values (maximization convention).
        attainable: ``n x m`` objective values the problem can reach (its whole table, or a dense
            sample of the space).
        shown: the reference point in the user's units, for the message.

    Raises:
        InputError: wrong length, non-finite values, or no attainable point dominates it.
    """
    ref = np.asarray(ref_point, dtype=np.float64)
    if ref.ndim != 1 or ref.shape[0] != attainable.shape[1]:
        raise InputError(argument, shown if shown is not None else ref.tolist(),
                         f"expected {attainable.shape[1]} values, one per objective")
    if not np.isfinite(ref).all():
        raise InputError(argument, shown if shown is not None else ref.tolist(), "values must be finite")
    if not (attainable > ref).all(axis=1).any():
        raise InputError(argument, shown if shown is not None else ref.tolist(),
                         f"no point dominates the reference point (checked {attainable.shape[0]} attainable "
                         "points), so every hypervolume would be 0; pick a worse reference point")

"""The peer baseline: TensorLy's masked CP (``tensorly.decomposition.parafac`` with ``mask``).

TensorLy fits an unconstrained CP model by ALS with missing entries imputed by the current
reconstruction; it has no temporal prior, so time slices without observations (the temporal
extrapolation split) keep their initial factors. It needs the dense nominal tensor.
"""

from __future__ import annotations

import time

import numpy as np

from paperline.kernels.errors import Described, InputError, check_number
from paperline.kernels.tensor.coo import COOTensor
from paperline.kernels.tensor.pttf import check_count, check_held_out, check_seed, check_tensor, rmse

MAX_DENSE_CELLS = 50_000_000  # float64 cells: 400 MB for the tensor, as much again for the mask/reconstruction


def tensorly_cp(tensor: COOTensor, *, rank: int, n_iter_max: int = 100, l2_reg: float = 0.0, seed: int = 0,
                validation: COOTensor | None = None, tol: float = 1e-8) -> tuple[list[np.ndarray], list[dict[str, float]]]:
    """Masked CP-ALS with TensorLy on the observed entries of ``tensor``.

    Args:
        tensor: training entries; densified (``prod(shape)`` float64 cells) with a boolean mask.
        rank: CP rank R (an integer > 0).
        n_iter_max: ALS iterations (an integer >= 1).
        l2_reg: TensorLy's ridge penalty (finite, >= 0).
        seed: ``random_state`` of the random initialization (an integer >= 0).
        validation: optional held-out entries, scored every iteration; ``tensor``'s shape.
        tol: TensorLy's convergence tolerance on the relative reconstruction error (finite, > 0).

    Returns:
        ``(factors, history)``: N arrays ``I_m x R`` (weights folded into the first) and one dict
        for the random initialization (``epoch`` 0: TensorLy's callback sees it first) and one per
        ALS iteration (``epoch`` 1, 2, ...), with ``epoch``, ``objective`` (TensorLy's relative reconstruction error),
        ``train_rmse``, ``validation_rmse`` and ``wall_seconds``.

    Raises:
        InputError: ``tensor`` not a COOTensor, rank, ``n_iter_max`` or seed not an integer in
            range, ``l2_reg`` < 0, tol <= 0 (either NaN/inf), a ``validation`` tensor of another
            shape, a nominal shape too large to densify, or entries that make TensorLy's ALS
            meet a singular matrix (all 0, say).
    """
    check_tensor(tensor)
    check_count("rank", rank, 1, "CP rank must be a positive integer")
    n_iter_max = check_count("n_iter_max", n_iter_max, 1)
    check_number("l2_reg", l2_reg, low=0.0)
    seed = check_seed(seed)
    # TensorLy 0.9 only computes the error its callback reports when tol is set
    check_number("tol", tol, low=0.0, low_open=True)
    check_held_out(validation, tensor.shape)

    import tensorly as tl
    from tensorly.decomposition import parafac

    cells = int(np.prod(tensor.shape))
    if cells > MAX_DENSE_CELLS:
        raise InputError("tensor.shape", tensor.shape,
                         f"{cells} cells: too large for the dense TensorLy baseline (limit {MAX_DENSE_CELLS})")
    tl.set_backend("numpy")
    dense = tensor.to_dense(fill=0.0)
    mask = tensor.mask()
    history: list[dict[str, float]] = []
    start = time.perf_counter()

    def record(cp, rec_error):
        weights, factors = cp
        fs = [factors[0] * weights[None, :]] + list(factors[1:])
        history.append(dict(epoch=len(history), objective=float(rec_error),
                            train_rmse=rmse(fs, tensor),
                            validation_rmse=rmse(fs, validation) if validation is not None else float("nan"),
                            primal_residual=float("nan"), dual_residual=float("nan"),
                            wall_seconds=time.perf_counter() - start))

    try:
        cp = parafac(dense, rank, n_iter_max=n_iter_max, init="random", random_state=seed, l2_reg=l2_reg,
                     mask=mask, tol=tol, callback=record)
    except np.linalg.LinAlgError:  # (it failed the run as "LinAlgError: Singular matrix", retried: a trial)
        raise InputError("tensor", Described(f"{tensor.values.size} entries of shape {tensor.shape}"),
                         f"TensorLy's CP-ALS met a singular matrix: the entries do not determine a rank-{rank} CP "
                         "model (e.g. all equal to 0, or a mode with fewer distinct observed indices than the rank); "
                         "lower the rank, set l2_reg > 0, or fit without this baseline (the tensor-factorization "
                         "flow's baseline=false)") from None
    weights, factors = cp
    out = [np.asarray(factors[0]) * np.asarray(weights)[None, :]] + [np.asarray(f) for f in factors[1:]]
    return out, history


"""Sparse temporal tensors in coordinate (COO) form, validated where data enters.

Observed entries are held as coordinates and values and never densified: a tensor of nominal
shape ``I_1 x ... x I_N`` with ``nnz`` observed entries costs ``O(nnz * N)`` memory. By
convention the *last* mode is time. The arrays are NumPy (host) or CuPy (GPU) arrays, and the
kernels that fit a tensor compute where its arrays live (:meth:`COOTensor.to`).
"""

from __future__ import annotations

import decimal
import math
import numbers
import weakref
from dataclasses import dataclass, field

import numpy as np

from paperline.kernels.arrays import array_module, device_of, to_device, to_host
from paperline.kernels.errors import Described, InputError, check_int, check_number

# |value| x sqrt(nnz) above this: sums of squared errors (RMSE, the objectives) overflow float64 (~1.3e154 squared)
MAX_SCALE = 1e150


def _check_shape(shape: object) -> tuple[int, ...]:
    """The nominal shape as a tuple of ints. Raises InputError for non-integer entries."""
    try:
        entries = tuple(shape)
    except TypeError:
        raise InputError("shape", shape, "must be a tuple of integers (I_1, ..., I_N)") from None
    for s in entries:
        if isinstance(s, (bool, np.bool_)) or not isinstance(s, (int, np.integer)):
            raise InputError("shape", shape, f"entries must be integers (got {s!r}); a mode has a whole "
                                             f"number of indices")
    shape = tuple(int(s) for s in entries)
    if len(shape) < 3:
        raise InputError("shape", shape, "need a tensor with N >= 3 modes (time last)")
    if any(s <= 0 for s in shape):
        raise InputError("shape", shape, "every mode must have at least one index")
    return shape


def _is_number(x: object) -> bool:
    """An element an object array may hold: a real number (Python/NumPy int or float, Fraction) or a
    Decimal (database drivers return them), not a bool, str, None or complex."""
    return isinstance(x, (numbers.Real, decimal.Decimal)) and not isinstance(x, (bool, np.bool_))


def _check_values(xp, values: object, argument: str = "values") -> np.ndarray:
    """``values`` as an array of real numbers (not yet float64, except object arrays). Integer dtypes
    are numbers; bool, complex, string and other dtypes are not.

    Raises:
        InputError: naming ``argument`` and the dtype seen (and, for an object array, the first
            element that is not a number).
    """
    try:
        arr = xp.asarray(values)
    except (TypeError, ValueError) as exc:  # ragged lists and the like
        raise InputError(argument, values, f"must be an array of real numbers ({exc})") from None
    kind = arr.dtype.kind
    if kind == "b":  # True/False would become 1.0/0.0 observations nobody measured
        raise InputError(argument, Described(f"array of dtype {arr.dtype}"),
                         f"must be real numbers, not booleans: if 1.0/0.0 is meant, convert explicitly "
                         f"(e.g. {argument}.astype(float))")
    if kind == "c":
        raise InputError(argument, Described(f"array of dtype {arr.dtype}"),
                         "complex values are not supported: pass the real part (or the magnitude) explicitly")
    if kind == "O":  # e.g. Python numbers in an object array: astype alone would also take True and "1.5"
        for i, x in enumerate(arr.flat):
            if not _is_number(x):
                raise InputError(argument, Described(f"array of dtype {arr.dtype}"),
                                 f"must be real numbers (element {i} is {x!r:.40}, a {type(x).__name__})")
        try:
            return arr.astype(np.float64)
        except (TypeError, ValueError, OverflowError) as exc:  # 10**400, Decimal('sNaN')
            raise InputError(argument, Described(f"array of dtype {arr.dtype}"), f"must be float64 numbers ({exc})") from None
    if kind not in "iuf":
        raise InputError(argument, Described(f"array of dtype {arr.dtype}"), "must be real numbers")
    if isinstance(values, (list, tuple)):  # NumPy made [True, 2.5] floats before the dtype could tell
        for i, x in enumerate(np.asarray(values, dtype=object).flat):
            if isinstance(x, (bool, np.bool_)):
                raise InputError(argument, Described(f"a {type(values).__name__} of {len(values)}"),
                                 f"must be real numbers, not booleans (element {i} is {x!r}): if 1.0/0.0 is meant, "
                                 "convert explicitly")
    return arr


# Read-only NumPy arrays this module made (copies, or fresh results of indexing) and so knows no
# writeable view of: a COOTensor may share them instead of copying (id -> array; entries vanish
# with their arrays). A caller's read-only array may have writeable views, so it is copied.
_OWNED: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()


def _owned(a: np.ndarray, dtype) -> np.ndarray:
    """A C-contiguous ``dtype`` array nobody else can write into: ``a`` itself when this module
    made it read-only (another tensor's entries), else a copy (made read-only for NumPy)."""
    if isinstance(a, np.ndarray) and _OWNED.get(id(a)) is a and a.dtype == dtype and a.flags.c_contiguous:
        return a
    out = array_module(a).array(a, dtype=dtype, order="C", copy=True)
    return _frozen(out)


def _frozen(a: np.ndarray) -> np.ndarray:
    """Mark a freshly made NumPy array (no other reference to its memory, no views) read-only, so
    that :class:`COOTensor` can take it without a copy."""
    if isinstance(a, np.ndarray) and a.flags.owndata and a.base is None:
        a.flags.writeable = False
        _OWNED[id(a)] = a
    return a


def _check_unique(xp, coords: np.ndarray, shape: tuple[int, ...]) -> None:
    """Refuse a coordinate listed twice (which value is the observation is not knowable).

    Sorts one linear index per entry (``O(nnz log nnz)``); shapes whose cell count does not fit
    in int64 sort the rows lexicographically instead.

    Raises:
        InputError: naming the count, the first repeated coordinate and two of its rows.
    """
    n = coords.shape[0]
    if n < 2:
        return
    if math.prod(shape) < 2**63:
        linear = coords[:, 0].copy()
        for m in range(1, len(shape)):
            linear *= shape[m]
            linear += coords[:, m]
        ranked = xp.sort(linear)
        same = ranked[1:] == ranked[:-1]
    else:
        order = xp.lexsort(coords.T[::-1])
        ranked = coords[order]
        same = xp.all(ranked[1:] == ranked[:-1], axis=1)
    n_same = int(same.sum())
    if n_same == 0:
        return
    first = int(to_host(xp.flatnonzero(same))[0])
    if ranked.ndim == 1:
        rows = to_host(xp.flatnonzero(linear == ranked[first]))
    else:
        rows = to_host(xp.flatnonzero(xp.all(coords == ranked[first], axis=1)))
    where = tuple(int(i) for i in to_host(coords[int(rows[0])]))
    raise InputError("coords", Described(f"{n_same} repeated of {n}"),
                     f"a coordinate appears more than once (first: {where} at rows {int(rows[0])} and "
                     f"{int(rows[1])}); list each observed entry once")


@dataclass(frozen=True, eq=False)
class COOTensor:
    """Observed entries of an N-way tensor (N >= 3, last mode is time).

    ``values`` are real numbers: float arrays, integer arrays (converted to float64: counts and
    integer ratings are data) and object arrays of Python numbers. Bool arrays are refused, not
    read as 1.0/0.0: True/False are rarely observations, and a mask passed as values is a
    mistake; convert explicitly (``values.astype(float)``) when 1.0/0.0 is meant.

    The tensor owns its entries: the constructor copies ``coords`` and ``values`` (converted to
    int64 and float64) unless they already are another tensor's (read-only) entries, and makes
    NumPy copies read-only (``flags.writeable = False``), so neither the caller's arrays
    nor writes through ``tensor.values[i] = ...`` can change a validated tensor. (CuPy arrays have
    no read-only flag: they are copied, not protected.)

    Attributes:
        coords: ``nnz x N`` int64 indices of the observed entries (NumPy, or CuPy on a GPU).
        values: ``nnz`` float64 observed values (finite), in the same array module as ``coords``.
        shape: nominal shape ``(I_1, ..., I_N)``; ``I_N`` is the number of time slices.
        mode_names: optional names of the modes, e.g. ``("state", "variable", "year")``.

    Raises:
        InputError: NaN/inf values or values so large that their squares overflow (|value| x
            sqrt(nnz) above 1e150), bool, complex or other non-numeric values (a str, object or
            datetime dtype; an object array holding anything but numbers), values that are not 1-D, no
            observed entries, N < 3, non-integer shape entries, non-integer coordinates (float
            dtypes are refused, not truncated), coordinates out of range, a coordinate listed
            more than once, or mismatched lengths. The message names the argument and the value
            seen.
    """

    coords: np.ndarray
    values: np.ndarray
    shape: tuple[int, ...]
    mode_names: tuple[str, ...] | None = field(default=None)

    def __post_init__(self) -> None:
        xp = array_module(self.coords, self.values)
        shape = _check_shape(self.shape)
        values = _owned(_check_values(xp, self.values), xp.float64)
        if values.ndim != 1:
            raise InputError("values", Described(f"array of shape {values.shape}"),
                             "must be 1-D: one value per row of coords")
        if values.size == 0:
            raise InputError("values", Described(f"array of shape {values.shape}"),
                             "empty tensor: no observed entries")
        coords = xp.asarray(self.coords)
        if coords.dtype.kind not in "iu":  # a float index would be truncated (0.7 -> 0), a bool one is no index
            raise InputError("coords", Described(f"array of dtype {coords.dtype}"),
                             "coordinates must be integers (int64): convert integral values explicitly")
        if coords.shape != (values.size, len(shape)):
            raise InputError("coords", Described(f"array of shape {coords.shape}"),
                             f"expected ({values.size}, {len(shape)}) to match values and shape")
        bad = ~xp.isfinite(values)
        if bool(bad.any()):
            n_nan = int(xp.isnan(values).sum())
            raise InputError("values", Described(f"{n_nan} NaN and {int(bad.sum()) - n_nan} inf of {values.size}"),
                             "observed values must be finite (leave missing entries out instead)")
        largest = float(xp.abs(values).max())
        if largest * math.sqrt(values.size) > MAX_SCALE:  # finite, but squared errors would overflow
            raise InputError("values", Described(f"largest |value| {largest:.3g} of {values.size}"),
                             f"too large for float64 arithmetic (squared errors overflow): keep |value| x "
                             f"sqrt(entries) below {MAX_SCALE:.0e}; rescale the data")
        lo = to_host(coords.min(axis=0))  # in the caller's dtype: a huge uint64 does not wrap negative
        hi = to_host(coords.max(axis=0))
        for m, s in enumerate(shape):
            if lo[m] < 0 or hi[m] >= s:
                raise InputError(f"coords[:, {m}]", (int(lo[m]), int(hi[m])),
                                 f"indices must lie in [0, {s}) for mode {m}")
        coords = _owned(coords, xp.int64)
        _check_unique(xp, coords, shape)
        if self.mode_names is not None and len(self.mode_names) != len(shape):
            raise InputError("mode_names", self.mode_names, f"need {len(shape)} names")
        object.__setattr__(self, "coords", coords)
        object.__setattr__(self, "values", values)
        object.__setattr__(self, "shape", shape)

    def __setstate__(self, state: dict) -> None:
        """Unpickled (Dask, Prefect results): the arrays come back writeable; make them read-only."""
        for name in ("coords", "values"):
            a = state.get(name)
            if isinstance(a, np.ndarray):
                a.flags.writeable = False
        self.__dict__.update(state)

    @property
    def nnz(self) -> int:
        """Number of observed entries."""
        return int(self.values.size)

    @property
    def ndim(self) -> int:
        """``N``, the number of modes."""
        return len(self.shape)

    @property
    def device(self) -> str:
        """``"cuda"`` when the entries are CuPy arrays, else ``"cpu"``."""
        return device_of(self.values)

    def to(self, device: str) -> "COOTensor":
        """The same entries on ``device`` (``"cpu"`` or ``"cuda"``); ``self`` if already there.

        Raises:
            ValueError: an unknown device name.
        """
        if device == self.device:
            return self
        return COOTensor(to_device(self.coords, device), to_device(self.values, device), self.shape,
                         self.mode_names)

    @classmethod
    def from_dense(cls, dense: np.ndarray, mask: np.ndarray | None = None,
                   mode_names: tuple[str, ...] | None = None) -> "COOTensor":
        """Observed entries of a dense array (NumPy or CuPy; the result lives where ``dense`` does).

        Args:
            dense: ``I_1 x ... x I_N`` array; NaN entries count as missing.
            mask: optional boolean array of the same shape, True where observed.

        Raises:
            InputError: shape mismatch, no observed entries (an all-False ``mask``, or only NaN
                where observed: named ``dense``), bool, complex or non-numeric ``dense`` (a bool
                array is refused, not read as 1.0/0.0: pass it as ``mask``), a ``mask`` that is not
                a bool array, or inf among
                observed values.
        """
        xp = array_module(dense)
        dense = _check_values(xp, dense, "dense")
        if dense.dtype.kind == "O":
            dense = dense.astype(np.float64)
        dense = xp.asarray(dense, dtype=xp.float64)
        observed = ~xp.isnan(dense)
        if mask is not None:
            mask = xp.asarray(mask)
            if mask.dtype.kind != "b":  # 0.5 or a ratings array counted as "observed" wherever non-zero
                raise InputError("mask", Described(f"array of dtype {mask.dtype}"), "must be a bool array (True where observed); "
                                                                         "e.g. mask=ratings > 0")
            if mask.shape != dense.shape:
                raise InputError("mask", Described(f"shape {mask.shape}"), f"must match tensor shape {dense.shape}")
            if not bool(mask.any()):
                raise InputError("mask", Described(f"0 of {dense.size} observed"), "mask has no observed entries")
            observed &= mask
        if not bool(observed.any()):
            where = "every entry the mask selects is NaN" if mask is not None else "every entry is NaN"
            raise InputError("dense", Described(f"array of shape {dense.shape}"), f"{where}: no observed entries")
        coords = xp.stack(xp.nonzero(observed), axis=1)  # as argwhere, but a fresh array it can own
        return cls(_frozen(coords), _frozen(dense[observed]), dense.shape, mode_names)

    def subset(self, index: np.ndarray) -> "COOTensor":
        """The observed entries selected by an integer or boolean index (same nominal shape)."""
        index = array_module(self.values).asarray(index)
        return COOTensor(_frozen(self.coords[index]), _frozen(self.values[index]), self.shape, self.mode_names)

    def to_dense(self, fill: float = np.nan) -> np.ndarray:
        """Dense ``I_1 x ... x I_N`` array with ``fill`` where unobserved. Only for small shapes."""
        out = array_module(self.values).full(self.shape, fill, dtype=np.float64)
        out[tuple(self.coords.T)] = self.values
        return out

    def mask(self) -> np.ndarray:
        """Dense boolean observation mask (True where observed). Only for small shapes."""
        out = array_module(self.values).zeros(self.shape, dtype=bool)
        out[tuple(self.coords.T)] = True
        return out


@dataclass(frozen=True, eq=False)
class Split:
    """Seeded train/validation/test partition of one tensor's observed entries.

    Attributes:
        kind: ``"random"`` (held-out entries) or ``"temporal"`` (the last time slices held out).
        train, validation, test: disjoint subsets with the tensor's nominal shape.
    """

    kind: str
    train: COOTensor
    validation: COOTensor
    test: COOTensor


def random_split(tensor: COOTensor, *, validation_fraction: float = 0.1, test_fraction: float = 0.1,
                 seed: int = 0) -> Split:
    """Hold out random observed entries for validation and test.

    Args:
        validation_fraction, test_fraction: shares of the observed entries held out, each a real
            number in (0, 1), together < 1.
        seed: seed of the permutation, an integer >= 0. None is refused: the split is a cached,
            named artifact (its seed is part of its name), so it must be reproducible.

    Raises:
        InputError: a fraction that is not a real number, NaN, outside (0, 1), or fractions
            summing to >= 1; a seed that is not an integer (a float, str, bool or None) or < 0;
            too few entries.
    """
    # check_number, not a bare comparison: a str or None raised a raw TypeError
    validation_fraction = check_number("validation_fraction", validation_fraction, low=0.0, high=1.0,
                                       low_open=True, high_open=True)
    test_fraction = check_number("test_fraction", test_fraction, low=0.0, high=1.0, low_open=True, high_open=True)
    if validation_fraction + test_fraction >= 1.0:
        raise InputError("validation_fraction + test_fraction", validation_fraction + test_fraction,
                         "must be < 1 so that entries remain for training")
    seed = check_int("seed", seed, 0)  # default_rng's own error named no argument ("expected non-negative integer")
    n = tensor.nnz
    n_val = int(round(validation_fraction * n))
    n_test = int(round(test_fraction * n))
    if min(n_val, n_test, n - n_val - n_test) < 1:
        least = next((m for m in range(n + 1, 10 * n + 10_000)
                      if min(round(validation_fraction * m), round(test_fraction * m),
                             m - round(validation_fraction * m) - round(test_fraction * m)) >= 1), None)
        need = f": {least} at least" if least is not None else ""
        raise InputError("tensor.nnz", n, f"too few observed entries to split into training, validation and test "
                                          f"sets ({validation_fraction:g} and {test_fraction:g} of them held "
                                          f"out{need})")
    perm = np.random.default_rng(seed).permutation(n)
    return Split("random", tensor.subset(np.sort(perm[n_val + n_test:])),
                 tensor.subset(np.sort(perm[:n_val])), tensor.subset(np.sort(perm[n_val:n_val + n_test])))


def temporal_split(tensor: COOTensor, *, horizon: int | None = None) -> Split:
    """Temporal extrapolation: train on early slices, validate and test on the last ones.

    The last ``horizon`` time slices are the test set, the ``horizon`` slices before them the
    validation set, everything earlier is training.

    Args:
        horizon: number of time slices in each held-out set (an integer >= 1); default
            ``max(1, I_N // 10)``.

    Raises:
        InputError: a horizon that is not an integer (2.5 is refused, not truncated), < 1, or
            leaves fewer than 2 training slices.
    """
    n_t = tensor.shape[-1]
    if horizon is not None and (isinstance(horizon, (bool, np.bool_)) or not isinstance(horizon, (int, np.integer))):
        raise InputError("horizon", horizon, "must be an integer number of time slices")
    h = max(1, n_t // 10) if horizon is None else int(horizon)
    if h < 1:
        raise InputError("horizon", h, "must be >= 1")
    if n_t - 2 * h < 2:
        raise InputError("horizon", h, f"leaves fewer than 2 training time slices of {n_t}")
    t = tensor.coords[:, -1]
    train, val, test = t < n_t - 2 * h, (t >= n_t - 2 * h) & (t < n_t - h), t >= n_t - h
    for name, sel in (("train", train), ("validation", val), ("test", test)):
        if not bool(sel.any()):
            raise InputError("horizon", h, f"the {name} slices hold no observed entries")
    return Split("temporal", tensor.subset(train), tensor.subset(val), tensor.subset(test))


SPLIT_KINDS = ("random", "temporal")


def make_split(tensor: COOTensor, kind: str, *, seed: int = 0) -> Split:
    """Dispatch to :func:`random_split` or :func:`temporal_split` by name.

    ``seed`` (an integer >= 0) is checked for either kind, though only the random split uses it:
    the same bad seed must not pass for one kind and fail for the other.

    Raises:
        InputError: unknown split kind; a seed that is not an integer >= 0.
    """
    seed = check_int("seed", seed, 0)
    if kind == "random":
        return random_split(tensor, seed=seed)
    if kind == "temporal":
        return temporal_split(tensor)
    raise InputError("split", kind, f"unknown split kind; choose one of {list(SPLIT_KINDS)}")

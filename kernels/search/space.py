"""Search spaces: a continuous box or a product of categorical choices.

Candidates are always ``n x d`` float64 arrays in the space's natural coordinates: box variables
take their real values, categorical variables the integer index of the chosen option. Models see
:meth:`SearchSpace.features` instead: the box scaled to ``[0, 1]^d``, categorical variables one-hot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.stats import qmc

from paperline.kernels.errors import InputError


@dataclass(frozen=True)
class SearchSpace:
    """A box ``[lower, upper]^d`` (``kind="box"``) or ``d`` categorical variables (``kind="categorical"``).

    Attributes:
        kind: ``"box"`` or ``"categorical"``.
        names: ``d`` variable names.
        lower, upper: ``d`` bounds (box); for a categorical space ``0`` and ``n_options - 1``.
        choices: per variable, the option labels (categorical only).
    """

    kind: str
    names: tuple[str, ...]
    lower: np.ndarray
    upper: np.ndarray
    choices: tuple[tuple[str, ...], ...] = field(default=())

    @classmethod
    def box(cls, lower: Any, upper: Any, names: list[str] | None = None) -> SearchSpace:
        """A continuous box.

        Args:
            lower, upper: ``d`` finite bounds each, ``lower < upper``.
            names: ``d`` distinct variable names (default ``x0 .. x{d-1}``).

        Raises:
            InputError: a bound that is not a finite number, lower >= upper, bounds of different
                lengths, or names that are not ``d`` distinct strings.
        """
        try:
            lo = np.asarray(lower, dtype=np.float64).ravel()
            hi = np.asarray(upper, dtype=np.float64).ravel()
        except (TypeError, ValueError):
            raise InputError("bounds", (lower, upper), "need numbers (lower and upper, one per variable)") from None
        if lo.shape != hi.shape or lo.size == 0:
            raise InputError("bounds", (lo.shape, hi.shape), "lower and upper need the same non-empty length")
        if not (np.isfinite(lo).all() and np.isfinite(hi).all()) or np.any(lo >= hi):
            raise InputError("bounds", (lo.tolist(), hi.tolist()), "need finite bounds with lower < upper")
        if names is None:
            return cls("box", tuple(f"x{i}" for i in range(lo.size)), lo, hi)
        # a names list of another length set dim to its length: optimizers then refused the
        # points they had proposed (a trial)
        if isinstance(names, str) or len(names) != lo.size:
            raise InputError("names", names, f"need one name per bound ({lo.size})")
        _check_names(list(names))
        return cls("box", tuple(names), lo, hi)

    @classmethod
    def categorical(cls, choices: dict[str, list[str]]) -> SearchSpace:
        """A product of categorical variables ``{name: [option, ...]}``.

        Raises:
            InputError: not a non-empty dict, a variable with fewer than 2 options, options given
                as a string, or options that are the same once written as strings.
        """
        if not isinstance(choices, dict) or not choices:
            raise InputError("choices", choices, "need a dict {name: [option, ...]} with at least one variable")
        _check_names(list(choices))
        for name, options in choices.items():
            if isinstance(options, str | bytes) or not hasattr(options, "__len__"):
                raise InputError(f"choices[{name!r}]", options, "need a list of options")
            labels = [str(o) for o in options]
            if len(labels) < 2:
                raise InputError(f"choices[{name!r}]", options, "need at least 2 options")
            if len(set(labels)) != len(labels):
                raise InputError(f"choices[{name!r}]", options, "options must differ (as strings)")
        opts = tuple(tuple(str(o) for o in c) for c in choices.values())
        return cls("categorical", tuple(choices), np.zeros(len(opts)),
                   np.array([len(c) - 1 for c in opts], dtype=np.float64), opts)

    @property
    def dim(self) -> int:
        """``d``, the number of variables."""
        return len(self.names)

    @property
    def is_categorical(self) -> bool:
        """True for a categorical space."""
        return self.kind == "categorical"

    @property
    def n_features(self) -> int:
        """Width ``f`` of :meth:`features`: the total number of options (one-hot) when categorical, else ``d``."""
        return sum(len(c) for c in self.choices) if self.is_categorical else self.dim

    def size(self) -> float:
        """Number of distinct points (``inf`` for a box)."""
        return float(np.prod([len(c) for c in self.choices])) if self.is_categorical else float("inf")

    def all_points(self) -> np.ndarray:
        """Every point of a categorical space, ``size() x d`` float64 option indices (row-major).

        Raises:
            InputError: a box (it has no finite list of points).
        """
        if not self.is_categorical:
            raise InputError("space", self.kind, "only a categorical space has a finite list of points")
        grid = np.meshgrid(*[np.arange(len(c), dtype=np.float64) for c in self.choices], indexing="ij")
        return np.stack(grid, axis=-1).reshape(-1, self.dim)

    # -- sampling ---------------------------------------------------------------------------
    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n x d`` points drawn uniformly (categorical: each option equally likely)."""
        u = rng.random((n, self.dim))
        return self.from_unit(u)

    def sobol(self, n: int, seed: int) -> np.ndarray:
        """``n x d`` scrambled-Sobol points (the initial design; categorical: Sobol then binned)."""
        m = max(int(np.ceil(np.log2(max(n, 1)))), 0)  # a power of two keeps Sobol's balance
        u = qmc.Sobol(self.dim, scramble=True, seed=seed).random_base2(m)[:n]
        return self.from_unit(u)

    def from_unit(self, u: np.ndarray) -> np.ndarray:
        """Map ``n x d`` points of ``[0, 1)^d`` into the space."""
        u = np.clip(np.asarray(u, dtype=np.float64), 0.0, 1.0)
        if self.is_categorical:
            sizes = self.upper + 1
            return np.minimum(np.floor(u * sizes), self.upper)
        return self.lower + u * (self.upper - self.lower)

    def to_unit(self, x: np.ndarray) -> np.ndarray:
        """``n x d`` points scaled to ``[0, 1]^d`` (categorical: index / (options - 1))."""
        return (np.asarray(x, dtype=np.float64) - self.lower) / (self.upper - self.lower)

    def features(self, x: np.ndarray) -> np.ndarray:
        """Model inputs, ``n x n_features`` float64: the unit box, or one-hot per categorical variable."""
        x = np.atleast_2d(np.asarray(x, dtype=np.float64))
        if not self.is_categorical:
            return self.to_unit(x)
        out = np.zeros((x.shape[0], self.n_features))
        offset = 0
        for j, c in enumerate(self.choices):
            out[np.arange(x.shape[0]), offset + x[:, j].astype(np.int64)] = 1.0
            offset += len(c)
        return out

    def project(self, x: np.ndarray) -> np.ndarray:
        """Clip into the bounds (and round categorical indices)."""
        x = np.clip(np.asarray(x, dtype=np.float64), self.lower, self.upper)
        return np.rint(x) if self.is_categorical else x

    def validate(self, x: Any, argument: str = "x") -> np.ndarray:
        """``x`` as an ``n x d`` float64 array inside the space. Raises InputError naming ``argument``."""
        arr = np.atleast_2d(np.asarray(x, dtype=np.float64))
        if arr.ndim != 2 or arr.shape[1] != self.dim:
            raise InputError(argument, arr.shape, f"expected n x {self.dim} points")
        if not np.isfinite(arr).all():
            raise InputError(argument, arr.tolist()[:3], "points must be finite")
        if np.any(arr < self.lower - 1e-9) or np.any(arr > self.upper + 1e-9):
            raise InputError(argument, arr.tolist()[:3], "points outside the search space")
        if self.is_categorical and not np.array_equal(arr, np.rint(arr)):
            raise InputError(argument, arr.tolist()[:3], "categorical variables take integer option indices")
        return arr

    def neighbours(self, x: np.ndarray, rng: np.random.Generator, n: int, scale: float = 0.1) -> np.ndarray:
        """``n x d`` local perturbations of the ``k x d`` points ``x``: a Gaussian step of ``scale``
        (unit-box units) for a box, one to two changed variables for a categorical space."""
        x = np.atleast_2d(x)
        base = x[rng.integers(0, x.shape[0], n)]
        if not self.is_categorical:
            step = rng.normal(0.0, scale, base.shape) * (self.upper - self.lower)
            return self.project(base + step)
        out = base.copy()
        for i in range(n):
            for j in rng.choice(self.dim, size=int(rng.integers(1, 3)), replace=False):
                out[i, j] = rng.integers(0, int(self.upper[j]) + 1)
        return out

    def label(self, x: np.ndarray) -> dict[str, Any]:
        """One point as ``{name: value}`` (categorical: the option label)."""
        x = np.asarray(x, dtype=np.float64).ravel()
        if self.is_categorical:
            return {n: self.choices[j][int(x[j])] for j, n in enumerate(self.names)}
        return {n: float(x[j]) for j, n in enumerate(self.names)}

    def to_dict(self) -> dict[str, Any]:
        """JSON-able description: ``kind`` plus ``choices`` (categorical) or ``names``, ``lower``, ``upper`` (box)."""
        if self.is_categorical:
            return {"kind": self.kind, "choices": {n: list(c) for n, c in zip(self.names, self.choices)}}
        return {"kind": self.kind, "names": list(self.names), "lower": self.lower.tolist(),
                "upper": self.upper.tolist()}


def point_key(x: np.ndarray) -> tuple[float, ...]:
    """A hashable key of one point (to tell repeated candidates apart)."""
    return tuple(float(v) for v in np.asarray(x, dtype=np.float64).ravel())


def _check_names(names: list[Any]) -> None:
    if not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
        raise InputError("names", names, "need distinct non-empty strings")

"""The optimizer interface: batched ask/tell with a serializable, replayable state.

Every optimizer maximizes ``m`` objectives (``m = 1``: a single objective) over a
:class:`SearchSpace`. Its contract, which makes campaigns reproducible and resumable:

- ``ask(q)`` is a pure function of (seed, options, the batches told so far): its randomness comes
  from generators seeded by ``(seed, batch index)``, and it changes no state. Asking twice gives the
  same batch; a restarted process asks the same batch again.
- ``tell(x, y)`` appends one evaluated batch; all learned state (trees, trust regions, populations)
  is rebuilt from the told batches, so :meth:`Optimizer.state_dict` is just the options plus the
  batches, and :func:`load_optimizer` replays them.
- Failed evaluations are told as NaN rows: recorded, never fitted, never suggested again. An
  infinite value is refused rather than read as a failure or as an unbeatable point.

The first ``n_init`` evaluations come from one scrambled-Sobol design seeded by the campaign seed,
the same for every optimizer, so comparisons start from the same points.
"""

from __future__ import annotations

import abc
import json
import math
import time
from typing import Any, ClassVar

import numpy as np

from paperline.kernels.errors import InputError, unknown_name
from paperline.kernels.errors import check_int as _check_int
from paperline.kernels.errors import check_number as _check_number
from paperline.kernels.registry import Registry
from paperline.kernels.search.pareto import check_ref_point
from paperline.kernels.search.space import SearchSpace, point_key

MAX_BATCH = 100_000  # points asked at once (q) or in the initial design: more is a typo, not a design

OPTIMIZERS: Registry[type[Optimizer]] = Registry("optimizer")


class Optimizer(abc.ABC):
    """Base class: history, initial design, seeding and state.

    Args:
        space: the search space.
        n_objectives: ``m`` (1 for single-objective optimizers).
        seed: campaign seed.
        n_init: size of the initial Sobol design (>= 1).
        ref_point: ``m`` reference point, maximization convention (multi-objective optimizers).
        **options: optimizer hyperparameters. Each must have its default's type (an integer where
            the default is one, a finite number where it is a float, a string where a string); a
            number is >= 0, and > 0 when it is in ``positive``; subclasses check the rest.

    Raises:
        InputError: bad ``n_init`` (an integer in ``[1, MAX_BATCH]``), ``seed`` (an integer >= 0)
        or ``n_objectives`` (>= 1), a ``ref_point`` that is not ``m`` finite numbers (or none for
        a multi-objective optimizer), a multi-objective optimizer on one objective or vice versa, a
        space kind the optimizer does not support, an unknown option, an option of the wrong type
        or out of range (naming the option).
    """

    name: ClassVar[str] = ""
    multi_objective: ClassVar[bool | None] = None  # True: m >= 2 only; False: m == 1 only; None: both
    spaces: ClassVar[tuple[str, ...]] = ("box", "categorical")
    defaults: ClassVar[dict[str, Any]] = {}
    positive: ClassVar[frozenset[str]] = frozenset()  # numeric options that must be > 0 (counts: >= 1)
    # integer options with another least value (one message for every bad value: a trial saw
    # "must be an integer >= 0" for -1 and "at least 4" for 2)
    minimums: ClassVar[dict[str, int]] = {}
    option_help: ClassVar[dict[str, str]] = {}  # option -> what it does (`paperline params nas`); one per default

    def __init__(self, space: SearchSpace, n_objectives: int = 1, *, seed: int = 0, n_init: int = 10,
                 ref_point: np.ndarray | list[float] | None = None, **options: Any):
        n_init = check_count(n_init, "n_init", "points of the initial design")
        seed = check_int(seed, "seed", low=0)
        n_objectives = check_int(n_objectives, "n_objectives", low=1)
        if self.multi_objective is True and n_objectives < 2:
            raise InputError("optimizer", self.name, "is multi-objective; the problem has one objective")
        if self.multi_objective is False and n_objectives != 1:
            raise InputError("optimizer", self.name, f"is single-objective; the problem has {n_objectives} objectives")
        if space.kind not in self.spaces:
            raise InputError("optimizer", self.name, f"supports {'/'.join(self.spaces)} spaces, not {space.kind}")
        unknown = set(options) - set(self.defaults)
        if unknown:
            raise InputError("optimizer_options", sorted(unknown),
                             f"unknown for {self.name}; known: {', '.join(sorted(self.defaults)) or 'none'}")
        self.space = space
        self.n_objectives = int(n_objectives)
        self.seed = int(seed)
        self.n_init = int(n_init)
        self.ref_point = None if ref_point is None else check_ref_point(ref_point, self.n_objectives)
        if self.multi_objective and self.ref_point is None:
            raise InputError("ref_point", None, f"{self.name} needs a reference point")
        self.options = {key: check_option(key, value, self.defaults[key], key in self.positive,
                                          self.minimums.get(key))
                        for key, value in {**self.defaults, **options}.items()}
        self._x = np.zeros((0, space.dim))
        self._y = np.zeros((0, self.n_objectives))
        self.n_batches = 0
        self._batch_sizes: list[int] = []
        self._seen: set[tuple[float, ...]] = set()

    # -- history ----------------------------------------------------------------------------
    @property
    def x(self) -> np.ndarray:
        """All told points, ``n x d``."""
        return self._x

    @property
    def y(self) -> np.ndarray:
        """All told values, ``n x m`` (maximization; NaN rows failed)."""
        return self._y

    @property
    def ok(self) -> np.ndarray:
        """Mask of the evaluations that succeeded (``n`` bool)."""
        return np.isfinite(self._y).all(axis=1)

    def data(self) -> tuple[np.ndarray, np.ndarray]:
        """The successful evaluations ``(x: k x d, y: k x m)``."""
        ok = self.ok
        return self._x[ok], self._y[ok]

    def rng(self, salt: int = 0) -> np.random.Generator:
        """The generator of the next batch: seeded by (seed, batch index, salt), never by history."""
        return np.random.default_rng([self.seed, self.n_batches, salt])

    def torch_seed(self, salt: int = 0) -> int:
        """A torch seed in ``[0, 2^31 - 1)`` for the next batch, from (seed, batch index, salt) as :meth:`rng`."""
        return int(np.random.default_rng([self.seed, self.n_batches, salt, 7]).integers(0, 2**31 - 1))

    def is_new(self, x: np.ndarray) -> np.ndarray:
        """Mask of the rows of ``x`` not evaluated yet (``n`` bool)."""
        return np.array([point_key(r) not in self._seen for r in np.atleast_2d(x)], dtype=bool)

    # -- ask / tell -------------------------------------------------------------------------
    def ask(self, q: int) -> np.ndarray:
        """The next batch: ``q x d`` float64 points (distinct from each other and, for a finite
        space, from every point told so far, while such points remain).

        Raises:
            InputError: ``q`` not an integer in ``[1, MAX_BATCH]``.
        """
        q = check_count(q, "q", "the batch size")
        if self._x.shape[0] < self.n_init or self.data()[0].shape[0] == 0:
            return self._initial(q)
        x = np.atleast_2d(np.asarray(self._suggest(q), dtype=np.float64))
        return self._fill(self.space.project(x), q)

    def _initial(self, q: int) -> np.ndarray:
        n_done = self._x.shape[0]
        design = self.space.sobol(max(self.n_init, n_done + q) + 64, seed=self.seed)
        if self.space.is_categorical:
            design = design[self.is_new(design)]
            design = _unique_rows(design)
        else:
            design = design[n_done:]
        return self._fill(design[:q], q)

    def _fill(self, x: np.ndarray, q: int) -> np.ndarray:
        """Keep the first ``q`` distinct new rows of ``x``; top up with random new points."""
        x = _unique_rows(x)
        if self.space.is_categorical:
            x = x[self.is_new(x)]
        x = x[:q]
        if x.shape[0] < q:
            rng = self.rng(salt=99)
            for _ in range(50):
                extra = self.space.sample(rng, 4 * q)
                if self.space.is_categorical:
                    extra = extra[self.is_new(extra)]
                x = _unique_rows(np.vstack([x, extra]))[:q]
                if x.shape[0] >= q or (self.space.is_categorical and len(self._seen) + x.shape[0] >= self.space.size()):
                    break
        if x.shape[0] < q and self.space.is_categorical and self.space.size() <= ENUMERATE_FILL_MAX:
            # a nearly exhausted space: random draws rarely hit the few points left, so take them in
            # a seeded order from the full list (a batch would otherwise come back short or empty)
            rest = self.space.all_points()
            rest = rest[self.is_new(rest)]
            rest = rest[rng.permutation(rest.shape[0])]
            x = _unique_rows(np.vstack([x, rest]))[:q]
        return x

    def tell(self, x: np.ndarray, y: np.ndarray) -> None:
        """Record one evaluated batch: ``x`` (``n x d``) and ``y`` (``n x m``, maximization, NaN = failed;
        with one objective also ``n`` values).

        A row with a NaN is a failed evaluation (recorded, never fitted). Nothing is recorded when
        the batch is refused.

        Raises:
            InputError: ``x`` not points of the space; ``y`` not numbers, of the wrong shape, or
                holding ``inf``/``-inf`` (naming the rows; NaN, not inf, marks a failure).
        """
        x = self.space.validate(x, "x")
        try:
            given = np.asarray(y, dtype=np.float64)
        except (TypeError, ValueError):
            shown = y.tolist() if isinstance(y, np.ndarray) else y  # an array's repr spans lines
            raise InputError("y", shown, f"expected {x.shape[0]} x {self.n_objectives} numbers") from None
        # one objective: a 1-d y is one value per point (it was taken as one row, and refused)
        y = given[:, None] if given.ndim == 1 and self.n_objectives == 1 else np.atleast_2d(given)
        if y.shape != (x.shape[0], self.n_objectives):  # (the shape given, not its 2-d view: a trial)
            raise InputError("y", given.shape, f"expected {x.shape[0]} x {self.n_objectives} values")
        rows = np.flatnonzero(np.isinf(y).any(axis=1))
        if rows.size:  # checked before anything is recorded: a refused batch leaves the history as it was
            raise InputError("y", y[rows].tolist(), f"infinite objective values (row{'s' * (rows.size > 1)} "
                                                    f"{', '.join(map(str, rows.tolist()))}); values must be finite, "
                                                    "NaN marks a failed evaluation")
        y = np.where(np.isfinite(y).all(axis=1, keepdims=True), y, np.nan)
        self._x = np.vstack([self._x, x])
        self._y = np.vstack([self._y, y])
        self._seen.update(point_key(r) for r in x)
        self._batch_sizes.append(x.shape[0])
        self.n_batches += 1
        self._update(x, y)

    @abc.abstractmethod
    def _suggest(self, q: int) -> np.ndarray:
        """``q x d`` new points after the initial design (use :meth:`rng`, not global state)."""

    def _update(self, x: np.ndarray, y: np.ndarray) -> None:
        """Hook: learned state from one more told batch (default: nothing beyond the history)."""

    # -- introspection, state -----------------------------------------------------------------
    def tree(self) -> dict[str, Any] | None:
        """The partition/search tree as JSON-able nested dicts (partition-based optimizers)."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state: configuration and every told batch (see :func:`load_optimizer`)."""
        return {
            "optimizer": self.name, "space": self.space.to_dict(), "n_objectives": self.n_objectives,
            "seed": self.seed, "n_init": self.n_init, "options": self.options,
            "ref_point": None if self.ref_point is None else self.ref_point.tolist(),
            "batches": self._batches_json(),
        }

    def _batches_json(self) -> list[dict[str, Any]]:
        out, start = [], 0
        for n in self._batch_sizes:
            out.append({"x": self._x[start:start + n].tolist(),
                        "y": [[None if not np.isfinite(v) else float(v) for v in row] for row in self._y[start:start + n]]})
            start += n
        return out


ENUMERATE_FILL_MAX = 1 << 20  # categorical spaces up to this many points are listed to fill a batch


def _unique_rows(x: np.ndarray) -> np.ndarray:
    if x.shape[0] == 0:
        return x
    _, idx = np.unique(x, axis=0, return_index=True)
    return x[np.sort(idx)]


def make_optimizer(name: str, space: SearchSpace, n_objectives: int = 1, **kwargs: Any) -> Optimizer:
    """Build the registered optimizer ``name``. Raises InputError for an unknown name (listing the
    known ones) or bad arguments."""
    _register_builtin()
    if not isinstance(name, str) or name not in OPTIMIZERS:  # an unhashable name is a TypeError in `in`
        raise InputError("optimizer", name, unknown_name("optimizer", name, OPTIMIZERS.names()))
    return OPTIMIZERS[name](space, n_objectives, **kwargs)


def optimizer_names() -> list[str]:
    """The registered optimizers' names (the built-in ones registered first)."""
    _register_builtin()
    return OPTIMIZERS.names()


STATE_KEYS = ("optimizer", "n_objectives", "seed", "n_init", "options", "ref_point", "batches")


def load_optimizer(state: dict[str, Any] | str, space: SearchSpace | None = None) -> Optimizer:
    """Rebuild an optimizer from :meth:`Optimizer.state_dict` (a dict or its JSON) by replaying
    its told batches. The result asks exactly what the saved optimizer would have asked next.

    ``space`` None: the space saved in ``state`` (its ``"space"`` key).

    Raises:
        InputError: ``state`` is not valid JSON or not a dict, lacks a key, or holds a bad value:
            an unknown optimizer (listing the known ones), a value of the wrong type or out of
            range, a batch that does not fit the space. The message names ``state``, or the bad
            entry as ``state.<key>`` (``state.options.<option>``, ``state.batches[<i>].y``).
    """
    keys = STATE_KEYS + (("space",) if space is None else ())
    state = check_state(state, "state", keys, "Optimizer.state_dict()")
    if not isinstance(state["optimizer"], str):
        raise InputError("state.optimizer", state["optimizer"], "must be an optimizer name (a string)")
    if not isinstance(state["options"], dict) or not all(isinstance(k, str) for k in state["options"]):
        raise InputError("state.options", state["options"], "must be a dict {option name: value}")
    if not isinstance(state["batches"], list):
        raise InputError("state.batches", state["batches"], "must be a list of {x, y} batches")
    if space is None:
        space = _space_from_state(state["space"])
    try:
        opt = make_optimizer(state["optimizer"], space, state["n_objectives"], seed=state["seed"],
                             n_init=state["n_init"], ref_point=state["ref_point"], **state["options"])
    except InputError as exc:  # name the entry of the state, as Campaign names optimizer_options.<option>
        options = OPTIMIZERS[state["optimizer"]].defaults if state["optimizer"] in OPTIMIZERS else {}
        where = ("state.options" if exc.argument == "optimizer_options"
                 else f"state.options.{exc.argument}" if exc.argument in options else f"state.{exc.argument}")
        raise InputError(where, exc.value, exc.problem) from None
    for i, batch in enumerate(state["batches"]):
        try:
            x = np.asarray(batch["x"], dtype=np.float64)
            y = np.array([[np.nan if v is None else v for v in row] for row in batch["y"]], dtype=np.float64)
            # only an empty batch is reshaped: reshaping rows of the wrong width would hide the error
            x, y = (x.reshape(0, space.dim), y.reshape(0, opt.n_objectives)) if x.size == y.size == 0 else (x, y)
        except (KeyError, TypeError, ValueError):  # not a dict, a key missing, ragged or non-numeric rows
            raise InputError(f"state.batches[{i}]", batch, f"must be {{x: n x {space.dim} numbers, y: n x "
                                                          f"{opt.n_objectives} numbers (null: failed)}}") from None
        try:
            opt.tell(x, y)
        except InputError as exc:
            if exc.argument not in ("x", "y"):
                raise
            raise InputError(f"state.batches[{i}].{exc.argument}", exc.value, exc.problem) from None
    return opt


def check_state(state: Any, argument: str, keys: tuple[str, ...], made_by: str) -> dict[str, Any]:
    """``state`` (a dict or its JSON text) as a dict holding ``keys``.

    Raises:
        InputError: naming ``argument``: not valid JSON, not a dict, or a key missing (``made_by``
            says what writes a valid one).
    """
    if isinstance(state, str | bytes):
        try:
            state = json.loads(state)
        except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
            raise InputError(argument, state, f"not valid JSON ({exc}); expected {made_by}") from None
    if not isinstance(state, dict):
        raise InputError(argument, state, f"must be a dict (or its JSON text) from {made_by}, "
                                          f"not {type(state).__name__}")
    missing = [k for k in keys if k not in state]
    if missing:
        raise InputError(argument, state, f"missing key{'s' if len(missing) > 1 else ''} "
                                          f"{', '.join(map(repr, missing))} (written by {made_by})")
    return state


def _space_from_state(spec: Any) -> SearchSpace:
    """The :class:`SearchSpace` of ``SearchSpace.to_dict()``; InputError naming ``state.space``."""
    keys = {"box": ("lower", "upper", "names"), "categorical": ("choices",)}
    wanted = "must be SearchSpace.to_dict(): {kind: 'box', lower, upper, names} or {kind: 'categorical', choices}"
    kind = spec.get("kind") if isinstance(spec, dict) else None
    if kind not in keys or any(k not in spec for k in keys[kind]):
        raise InputError("state.space", spec, wanted)
    if kind == "categorical" and not isinstance(spec["choices"], dict):
        raise InputError("state.space.choices", spec["choices"], "must be a dict {variable: [option, ...]}")
    try:
        return (SearchSpace.categorical(spec["choices"]) if kind == "categorical"
                else SearchSpace.box(spec["lower"], spec["upper"], spec["names"]))
    except InputError as exc:
        raise InputError(f"state.space.{exc.argument}", exc.value, exc.problem) from None
    except (TypeError, ValueError):  # bounds that are not numbers, options that are not lists
        raise InputError("state.space", spec, wanted) from None


def timed_ask(opt: Optimizer, q: int) -> tuple[np.ndarray, float]:
    """``(opt.ask(q), seconds it took)``."""
    t0 = time.perf_counter()
    x = opt.ask(q)
    return x, time.perf_counter() - t0


def _register_builtin() -> None:
    from paperline.kernels.search import (  # noqa: F401  (each module registers its optimizers)
        alphax,
        botorch_opt,
        lamcts,
        lamoo,
        lanas,
        nsga2,
        random_search,
    )


def check_float(value: Any, argument: str, *, low: float, strict: bool = False) -> float:
    """``value`` as a float; InputError naming ``argument`` unless it is a finite number ``>= low``
    (``> low`` when ``strict``).

    The rule is :func:`paperline.kernels.errors.check_number`'s; the message is one for every
    failure, ``tau=nan: must be a finite number >= 0``.
    """
    try:
        return _check_number(argument, value, low=low, low_open=strict)
    except InputError:
        raise InputError(argument, value, f"must be a finite number {'>' if strict else '>='} {low:g}") from None


def check_int(value: Any, argument: str, *, low: int) -> int:
    """``value`` as an int; InputError naming ``argument`` unless it is an integer ``>= low``.

    The rule is :func:`paperline.kernels.errors.check_int`'s (integers, not bools); the message is
    one for both failures, ``seed=None: must be an integer >= 0``, which search's callers and
    tests read.
    """
    try:
        return _check_int(argument, value, low)
    except InputError:
        raise InputError(argument, value, f"must be an integer >= {low}") from None


def check_count(value: Any, argument: str, what: str) -> int:
    """``value`` as an int in ``[1, MAX_BATCH]`` (``what`` it counts, for the message).

    Raises:
        InputError: naming ``argument``, when ``value`` is not an integer (bools refused) or is
            outside ``[1, MAX_BATCH]``.
    """
    if isinstance(value, int | np.integer) and not isinstance(value, bool) and value < 1:
        raise InputError(argument, value, f"must be at least 1 ({what})")
    value = check_int(value, argument, low=1)
    if value > MAX_BATCH:
        raise InputError(argument, value, f"must be at most {MAX_BATCH:,} ({what})")
    return value


def check_option(key: str, value: Any, default: Any, positive: bool, low: int | None = None) -> Any:
    """An optimizer option checked against its default's type (see :class:`Optimizer`); an integer
    option is at least ``low`` when given (:attr:`Optimizer.minimums`), else 1 or 0 (``positive``)."""
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise InputError(key, value, "must be true or false")
        return value
    if isinstance(default, int):
        return check_int(value, key, low=low if low is not None else 1 if positive else 0)
    if isinstance(default, float):
        return check_float(value, key, low=0.0, strict=positive)
    if isinstance(default, str) and not isinstance(value, str):
        raise InputError(key, value, "must be a string")
    return value

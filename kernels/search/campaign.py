"""A search campaign: batched ask -> parallel evaluation -> tell, checkpointable after every batch.

:class:`Campaign` holds the problem, the optimizer and the record of every evaluation. Its whole
state is :meth:`Campaign.state_dict` (JSON): the optimizer's told batches plus the evaluation
records. Because an optimizer's ask depends only on (seed, told batches), a campaign rebuilt from a
checkpoint asks exactly what the uninterrupted campaign would have asked, so a killed and resumed
campaign ends identical to one that never stopped.

The flow runs the same steps with each evaluation as a cached task on the Dask workers;
:func:`run_campaign` runs them in-process (tests, benchmarks) with any ``map``.
"""

from __future__ import annotations

import math
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from paperline.kernels.errors import InputError, is_real
from paperline.kernels.search.base import (OPTIMIZERS, STATE_KEYS, Optimizer, check_count, check_int, check_state,
                                           load_optimizer, make_optimizer)
from paperline.kernels.search.deadline import EvaluationTimeout, time_limit
from paperline.kernels.search.pareto import hypervolume, pareto_mask
from paperline.kernels.search.problems import Problem, make_problem


@dataclass
class Evaluation:
    """One evaluation: its point, objective values (user units; None when failed), error, seconds."""

    index: int
    batch: int
    x: list[float]
    params: dict[str, Any]
    values: list[float] | None
    error: str | None
    seconds: float

    @property
    def ok(self) -> bool:
        """True when the evaluation succeeded (no ``error``)."""
        return self.error is None


def evaluate_point(problem: Problem, x: list[float] | np.ndarray, seed: int,
                   timeout_s: float | None = None, raise_timeout: bool = False) -> dict[str, Any]:
    """Evaluate one point, recording (not raising) what goes wrong.

    Args:
        problem: The problem.
        x: A point of its space.
        seed: The evaluation's seed.
        timeout_s: Seconds the evaluation may take (None: no limit); an evaluation that checks
            (:func:`~paperline.kernels.search.deadline.check_deadline`) stops past it and is recorded as timed out.
        raise_timeout: Raise :class:`EvaluationTimeout` instead of recording it (a cached
            task must not keep a timeout, which one busy moment may cause, as its result).

    Returns:
        ``{"values": [m floats] | None, "error": str | None, "seconds": float}``: an evaluation
        that raises, times out, or returns NaN/inf, comes back with ``values=None`` and the reason.

    Raises:
        InputError: ``x`` is not a point of the problem's space (a caller's bug, not a failure).
        EvaluationTimeout: past ``timeout_s``, with ``raise_timeout``.
    """
    point = problem.space.validate(x)[0]
    if timeout_s is not None:
        problem.prepare()  # (loading once per process is not the evaluation's time: a trial)
    t0 = time.perf_counter()
    try:
        with time_limit(timeout_s):
            y = problem.evaluate(point, seed)
    except InputError:
        raise
    except EvaluationTimeout as exc:
        if raise_timeout:
            raise
        return {"values": None, "error": str(exc), "seconds": time.perf_counter() - t0}
    except Exception as exc:  # noqa: BLE001 - an evaluation's failure is recorded, the campaign goes on
        last = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        where = f" ({last.name}:{last.lineno})" if last else ""
        return {"values": None, "error": f"{type(exc).__name__}: {exc}{where}", "seconds": time.perf_counter() - t0}
    seconds = time.perf_counter() - t0
    if not np.isfinite(y).all():
        return {"values": None, "error": f"non-finite objective values {y.tolist()}", "seconds": seconds}
    return {"values": [float(v) for v in y], "error": None, "seconds": seconds}


CAMPAIGN_KEYS = ("problem", "problem_options", "budget", "q", "seed", "n_init", "ref_point", "optimizer", "evaluations")


class Campaign:
    """A seeded campaign of ``budget`` evaluations in batches of ``q``.

    Args:
        problem: the problem (or its registry name with ``problem_options``).
        optimizer: registry name of the optimizer.
        budget: number of evaluations (>= ``n_init``).
        q: batch size (>= 1).
        seed: seeds the initial design, the optimizer and the evaluations (NAS-Bench-201 seed).
        n_init: size of the initial design.
        ref_point: hypervolume reference point in the problem's units (None: its default).
        optimizer_options: hyperparameters of the optimizer.

    Raises:
        InputError: unknown optimizer or problem, ``q < 1`` or ``q > budget``, ``budget < n_init`` or
        above the distinct points of a finite (categorical) space, a reference point that no point
        dominates (or any reference point for a single-objective problem), bad options (an
        optimizer option's error is named ``optimizer_options.<name>``).
    """

    def __init__(self, problem: Problem | str, optimizer: str, *, budget: int, q: int = 1, seed: int = 0,
                 n_init: int = 10, ref_point: list[float] | None = None,
                 optimizer_options: dict[str, Any] | None = None, problem_options: dict[str, Any] | None = None):
        if isinstance(problem, str):
            problem = make_problem(problem, **(problem_options or {}))
        q = check_count(q, "q", "the batch size")
        n_init = check_count(n_init, "n_init", "points of the initial design")
        seed = check_int(seed, "seed", low=0)
        budget = check_int(budget, "budget", low=1)
        if int(budget) < int(n_init):
            raise InputError("budget", budget, f"smaller than the initial design (n_init={n_init}); "
                                               "raise the budget or lower n_init")
        if q > budget:  # a typo, run silently with batches cut to the evaluations left (a trial)
            raise InputError("q", q, f"larger than the budget ({budget} evaluations): a batch is at most the "
                                     "evaluations left; lower q or raise the budget")
        if int(budget) > problem.space.size():  # the campaign would run out of new points and never end
            raise InputError("budget", budget, f"more than the {int(problem.space.size()):,} distinct points of "
                                               f"{problem.name}'s search space")
        self.problem = problem
        self.budget, self.q, self.seed, self.n_init = int(budget), int(q), int(seed), int(n_init)
        self.ref_point_user = None
        ref = None
        if problem.n_objectives > 1:
            ref = problem.reference_point(ref_point)
            self.ref_point_user = [float(v) for v in problem.to_max(ref)]
        elif ref_point is not None:
            raise InputError("ref_point", ref_point, f"{problem.name} has one objective; a reference point is "
                                                     "for multi-objective problems")
        self.ref_point = ref
        try:
            self.optimizer: Optimizer = make_optimizer(optimizer, problem.space, problem.n_objectives, seed=self.seed,
                                                       n_init=self.n_init, ref_point=ref, **(optimizer_options or {}))
        except InputError as exc:  # an option's own check: say where it was given, as problem options do
            known = OPTIMIZERS[optimizer].defaults if isinstance(optimizer, str) and optimizer in OPTIMIZERS else {}
            if exc.argument in known:
                raise InputError(f"optimizer_options.{exc.argument}", exc.value, exc.problem) from None
            raise
        self.evaluations: list[Evaluation] = []
        self.suggest_seconds: list[float] = []  # per told batch: seconds its ask took
        self._last_ask_s = math.nan

    # -- steps ------------------------------------------------------------------------------------
    @property
    def n_done(self) -> int:
        """Evaluations told so far (failed ones included)."""
        return len(self.evaluations)

    @property
    def done(self) -> bool:
        """True once ``budget`` evaluations have been told."""
        return self.n_done >= self.budget

    @property
    def next_batch_size(self) -> int:
        """Points the next :meth:`ask` returns: ``min(q, remaining budget)``."""
        return min(self.q, self.budget - self.n_done)

    def ask(self) -> np.ndarray:
        """The next batch, ``next_batch_size x d`` (pure: asking again gives the same batch)."""
        t0 = time.perf_counter()
        x = self.optimizer.ask(self.next_batch_size)
        self._last_ask_s = time.perf_counter() - t0
        return x

    def tell(self, x: np.ndarray, results: list[dict[str, Any]]) -> list[Evaluation]:
        """Record one evaluated batch (results from :func:`evaluate_point`, in the order of ``x``).

        Args:
            x: the ``k x d`` batch :meth:`ask` returned.
            results: ``k`` dicts of :func:`evaluate_point` (values in the problem's units).

        Returns:
            The ``k`` new :class:`Evaluation` records.

        Raises:
            InputError: ``len(results) != k``, or the optimizer refuses the batch (points outside
                the space, infinite values).
        """
        if len(results) != x.shape[0]:
            raise InputError("results", len(results), f"expected {x.shape[0]} results")
        y = np.full((x.shape[0], self.problem.n_objectives), np.nan)
        batch = self.optimizer.n_batches
        new = []
        for i, (row, r) in enumerate(zip(x, results)):
            if r["values"] is not None:
                y[i] = self.problem.to_max(np.asarray(r["values"], dtype=np.float64))
            new.append(Evaluation(self.n_done + i, batch, [float(v) for v in row], self.problem.describe(row),
                                  r["values"], r["error"], float(r["seconds"])))
        self.optimizer.tell(x, y)
        self.evaluations += new
        self.suggest_seconds.append(self._last_ask_s)
        self._last_ask_s = math.nan
        return new

    # -- results ----------------------------------------------------------------------------------
    def values_max(self) -> np.ndarray:
        """``n x m`` values in the maximization convention, NaN rows for failed evaluations."""
        return self.optimizer.y.copy()

    def hypervolume_trace(self) -> np.ndarray:
        """Hypervolume after each evaluation (multi-objective), ``n`` float64."""
        y = self.values_max()
        return np.array([hypervolume(y[: i + 1], self.ref_point) for i in range(y.shape[0])])

    def best_trace(self) -> np.ndarray:
        """Best value so far after each evaluation (single objective, user units), ``n`` float64."""
        y = self.values_max()[:, 0]
        best = np.fmax.accumulate(np.where(np.isfinite(y), y, -np.inf))
        return best * self.problem.signs[0]

    def score_trace(self) -> np.ndarray:
        """Hypervolume (multi-objective) or best-so-far in the maximization convention (single)."""
        return self.hypervolume_trace() if self.problem.n_objectives > 1 else self.best_trace() * self.problem.signs[0]

    def pareto_front(self) -> list[Evaluation]:
        """The successful evaluations on the Pareto front (all objectives), in evaluation order."""
        ok = [e for e in self.evaluations if e.ok]
        if not ok:
            return []
        mask = pareto_mask(self.problem.to_max(np.array([e.values for e in ok])))
        return [e for e, m in zip(ok, mask) if m]

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-able checkpoint: configuration, optimizer state, evaluation records."""
        return {"problem": self.problem.name, "problem_options": self.problem.options, "budget": self.budget,
                "q": self.q, "seed": self.seed, "n_init": self.n_init, "ref_point": self.ref_point_user,
                "optimizer": self.optimizer.state_dict(), "evaluations": [asdict(e) for e in self.evaluations],
                "suggest_seconds": self.suggest_seconds}

    @classmethod
    def from_state(cls, state: dict[str, Any] | str, *, budget: int | None = None) -> Campaign:
        """Rebuild a campaign from :meth:`state_dict` (a dict or its JSON; optionally with a larger
        ``budget``).

        Raises:
            InputError: ``state`` is not valid JSON or not a dict, lacks a key, or holds a bad value
                (an unknown problem or optimizer, listing the known ones; a value of the wrong type
                or out of range; evaluation records that disagree with the optimizer's history).
                The message names ``state``, or the bad entry as ``state.<key>``
                (``state.optimizer.options.<option>``, ``state.evaluations[<i>]``); a bad
                ``budget`` argument is named ``budget``.
        """
        state = check_state(state, "state", CAMPAIGN_KEYS, "Campaign.state_dict()")
        opt_state = check_state(state["optimizer"], "state.optimizer", STATE_KEYS, "Optimizer.state_dict()")
        ref = state["ref_point"]
        for key, ok, what in (  # what the constructor would otherwise meet as a raw TypeError or ValueError
                ("problem", isinstance(state["problem"], str), "a problem name (a string)"),
                ("problem_options", isinstance(state["problem_options"], dict | None), "a dict or null"),
                ("ref_point", ref is None or (isinstance(ref, list) and all(map(is_real, ref))), "numbers or null"),
                ("evaluations", isinstance(state["evaluations"], list), "a list of evaluation records"),
                ("suggest_seconds", isinstance(state.get("suggest_seconds", []), list), "a list of seconds")):
            if not ok:
                raise InputError(f"state.{key}", state[key], f"must be {what}")
        if not isinstance(opt_state["options"], dict):
            raise InputError("state.optimizer.options", opt_state["options"], "must be a dict {option name: value}")
        try:
            own = state["budget"] if budget is None else budget  # (budget=0 fell back to the saved one, unsaid)
            campaign = cls(state["problem"], opt_state["optimizer"], budget=own, q=state["q"], seed=state["seed"],
                           n_init=state["n_init"], ref_point=ref, optimizer_options=opt_state["options"],
                           problem_options=state["problem_options"])
        except InputError as exc:  # name the entry of the state (the caller's own budget keeps its name)
            if exc.argument == "budget" and budget is not None:
                raise
            where = exc.argument.replace("optimizer_options", "optimizer.options", 1)
            where = "optimizer.optimizer" if where == "optimizer" else where
            raise InputError(f"state.{where}", exc.value, exc.problem) from None
        try:
            campaign.optimizer = load_optimizer(opt_state, campaign.problem.space)
        except InputError as exc:  # a told batch that does not fit: state.batches[i].y -> state.optimizer.batches[i].y
            if not exc.argument.startswith("state"):
                raise
            raise InputError("state.optimizer" + exc.argument[len("state"):], exc.value, exc.problem) from None
        names = [f.name for f in fields(Evaluation)]
        for i, e in enumerate(state["evaluations"]):
            if not isinstance(e, dict) or set(e) != set(names):
                raise InputError(f"state.evaluations[{i}]", e, f"an evaluation record has the keys {', '.join(names)}")
        campaign.evaluations = [Evaluation(**e) for e in state["evaluations"]]
        campaign.suggest_seconds = list(state.get("suggest_seconds", []))
        if len(campaign.evaluations) != campaign.optimizer.x.shape[0]:
            raise InputError("state.evaluations", len(campaign.evaluations),
                             f"expected {campaign.optimizer.x.shape[0]} records (one per evaluation told to "
                             "state.optimizer); the checkpoint is corrupt")
        return campaign


def run_campaign(campaign: Campaign, *, map_fn: Callable[..., Iterable[dict[str, Any]]] = map,
                 on_batch: Callable[[Campaign, list[Evaluation]], None] | None = None) -> Campaign:
    """Run ``campaign`` to its budget: ask, evaluate the batch with ``map_fn`` (e.g. an executor's
    ``map``), tell, then ``on_batch`` (e.g. a checkpoint). Returns the campaign."""
    problem, seed = campaign.problem, campaign.seed
    while not campaign.done:
        x = campaign.ask()
        results = list(map_fn(lambda row: evaluate_point(problem, row, seed), list(x)))
        new = campaign.tell(x, results)
        if on_batch is not None:
            on_batch(campaign, new)
    return campaign


def samples_to_reach(trace: np.ndarray, target: float) -> float:
    """The number of samples after which ``trace`` (maximization) first reaches ``target``
    (``inf`` if never)."""
    hit = np.flatnonzero(np.asarray(trace) >= target)
    return float(hit[0] + 1) if hit.size else math.inf

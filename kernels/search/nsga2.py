"""NSGA-II from pymoo, as an ask/tell optimizer (Deb et al., "A Fast and Elitist Multiobjective
Genetic Algorithm: NSGA-II", IEEE TEVC 2002).

pymoo supplies the operators: binary tournament on (rank, crowding), SBX crossover, polynomial
mutation (with rounding repair on categorical option indices) and rank-and-crowding survival.
The parent population is a pure function of the history: in :meth:`NSGA2._update` the survivors
of (population + told batch) are kept, so a (mu + lambda) generation happens per batch and the
population is rebuilt exactly when a campaign is replayed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from paperline.kernels.errors import InputError
from paperline.kernels.search.base import OPTIMIZERS, Optimizer
from paperline.kernels.search.space import SearchSpace


def _pymoo_problem(space: SearchSpace, n_objectives: int) -> Any:
    from pymoo.core.problem import Problem

    return Problem(n_var=space.dim, n_obj=n_objectives, xl=space.lower, xu=space.upper)


def survivors(space: SearchSpace, x: np.ndarray, y: np.ndarray, n: int, seed: int) -> np.ndarray:
    """Indices of the ``n`` rows NSGA-II's rank-and-crowding survival keeps (``y`` maximized)."""
    from pymoo.core.population import Population
    from pymoo.operators.survival.rank_and_crowding import RankAndCrowding

    if x.shape[0] <= n:
        return np.arange(x.shape[0])
    pop = Population.new(X=x, F=-y, index=np.arange(x.shape[0]))
    kept = RankAndCrowding().do(_pymoo_problem(space, y.shape[1]), pop, n_survive=n,
                                random_state=np.random.default_rng(seed))
    return np.sort(np.asarray(kept.get("index"), dtype=np.int64))


def offspring(space: SearchSpace, x: np.ndarray, y: np.ndarray, n: int, rng: np.random.Generator,
              prob_mutation: float | None = None) -> np.ndarray:
    """``n x d`` children of the parents ``x`` (``k x d``, values ``y`` ``k x m`` maximized) by
    tournament selection, SBX and polynomial mutation."""
    from pymoo.core.mating import Mating
    from pymoo.core.population import Population
    from pymoo.operators.crossover.sbx import SBX
    from pymoo.operators.mutation.pm import PM
    from pymoo.operators.repair.rounding import RoundingRepair
    from pymoo.operators.selection.tournament import TournamentSelection
    from pymoo.operators.survival.rank_and_crowding.metrics import calc_crowding_distance
    from pymoo.util.nds.non_dominated_sorting import NonDominatedSorting

    problem = _pymoo_problem(space, y.shape[1])
    pop = Population.new(X=x, F=-y)
    rank = np.empty(x.shape[0], dtype=np.int64)
    crowding = np.empty(x.shape[0])
    for r, front in enumerate(NonDominatedSorting().do(-y)):
        rank[front] = r
        crowding[front] = calc_crowding_distance(-y[front])

    def binary_tournament(pop: Any, pairs: np.ndarray, random_state: Any = None, **kwargs: Any) -> np.ndarray:
        """NSGA-II's crowded comparison: lower rank wins, then larger crowding distance, then a coin."""
        a, b = pairs[:, 0], pairs[:, 1]
        coin = random_state.random(a.shape[0]) < 0.5
        better_a = (rank[a] < rank[b]) | ((rank[a] == rank[b]) & (crowding[a] > crowding[b]))
        tie = (rank[a] == rank[b]) & (crowding[a] == crowding[b])
        return np.where(tie, np.where(coin, a, b), np.where(better_a, a, b)).astype(np.int64)
    prob = prob_mutation if prob_mutation is not None else 1.0 / space.dim
    if space.is_categorical:
        mating = Mating(TournamentSelection(func_comp=binary_tournament),
                        SBX(prob=0.9, eta=15, vtype=float, repair=RoundingRepair()),
                        PM(prob=prob, eta=20, vtype=float, repair=RoundingRepair()))
    else:
        mating = Mating(TournamentSelection(func_comp=binary_tournament), SBX(prob=0.9, eta=15), PM(prob=prob, eta=20))
    children = mating.do(problem, pop, n, random_state=rng)
    return space.project(np.asarray(children.get("X"), dtype=np.float64))


@OPTIMIZERS.register("nsga2")
class NSGA2(Optimizer):
    """NSGA-II (pymoo operators); any number of objectives (``m = 1`` is a plain GA).

    Options: ``pop_size`` (parent population, default 20).

    Raises:
        InputError: as :class:`~.base.Optimizer`, or ``pop_size`` < 2.
    """

    name = "nsga2"
    defaults = {"pop_size": 20}
    option_help = {"pop_size": "parent population kept by rank-and-crowding survival (>= 2)"}

    def __init__(self, space: SearchSpace, n_objectives: int = 1, **kwargs: Any):
        super().__init__(space, n_objectives, **kwargs)
        if int(self.options["pop_size"]) < 2:
            raise InputError("pop_size", self.options["pop_size"], "NSGA-II needs a population of >= 2")
        self.population = np.zeros(0, dtype=np.int64)  # indices into the history

    def _update(self, x: np.ndarray, y: np.ndarray) -> None:
        ok = np.flatnonzero(self.ok)
        candidates = np.union1d(self.population, ok[ok >= self._x.shape[0] - x.shape[0]])
        keep = survivors(self.space, self._x[candidates], self._y[candidates], int(self.options["pop_size"]),
                         seed=self.seed + self.n_batches)
        self.population = candidates[keep]

    def _suggest(self, q: int) -> np.ndarray:
        pop = self.population
        if pop.size < 2:
            return self.space.sample(self.rng(), q)
        children = offspring(self.space, self._x[pop], self._y[pop], 2 * q, self.rng())
        if self.space.is_categorical:
            children = children[self.is_new(children)]
        return children

"""LA-MCTS: learned nonlinear partitions of the search space, chosen by UCB, sampled locally.

Alg. 1 of [Wang2020lamcts]_, per batch:

1. *Learning*: rebuild the tree from every sample; a node with >= ``leaf_size`` samples is split
   by k-means (k = 2) on ``(x, f(x))`` into a good and a bad cluster, an SVM learns the boundary,
   and the samples follow the SVM's prediction.
2. *Selection*: descend from the root to a leaf by UCB, ``mean f + 2 Cp sqrt(2 ln n_p / n)``
   (f standardized over all samples, so ``cp`` is unit-free); ``q`` picks with virtual visits.
3. *Sampling*: inside the selected region (the intersection of the SVM half-spaces on the path),
   pick points with the local sampler: ``bo`` (GP + qLogEI over in-region candidates), ``turbo``
   (Thompson sampling in a trust region around the leaf's best point, kept to the region) or
   ``random``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from paperline.kernels.errors import InputError
from paperline.kernels.search import partition as pt
from paperline.kernels.search.base import OPTIMIZERS, Optimizer
from paperline.kernels.search.botorch_opt import (
    acquisition,
    fit_gp,
    seeded_torch,
    select_discrete,
    thompson_select,
    trust_region_candidates,
)
from paperline.kernels.search.space import SearchSpace

SAMPLERS = ("bo", "turbo", "random")


def kmeans_split(kernel: str, seed: int) -> pt.Splitter:
    """LA-MCTS's splitter: k-means (k=2) on [features, standardized f]; good = higher mean f."""

    def split(features: np.ndarray, values: np.ndarray, rng: np.random.Generator):
        from sklearn.cluster import KMeans

        f = values[:, 0]
        if np.ptp(f) == 0:
            return None
        z = (f - f.mean()) / f.std()
        labels = KMeans(n_clusters=2, n_init=3, random_state=seed).fit_predict(np.column_stack([features, z]))
        if np.unique(labels).size < 2:
            return None
        good = int(np.argmax([f[labels == k].mean() for k in (0, 1)]))
        return pt.svm_split((labels == good).astype(np.int64), features, kernel)

    return split


class PartitionOptimizer(Optimizer):
    """Shared learn-select-sample loop of the partition-based optimizers (LaNAS, LA-MCTS, LaMOO;
    Alg. 1 of [Wang2020lamcts]_). Arguments as :class:`~.base.Optimizer`'s.

    Raises:
        InputError: as :class:`~.base.Optimizer`, or a ``kernel`` other than rbf/poly/linear, or an
            unknown ``sampler``.
    """

    defaults: dict[str, Any] = {"cp": 0.5, "leaf_size": 20, "kernel": "rbf", "n_candidates": 2000}
    positive = frozenset({"n_candidates", "turbo_length"})
    minimums = {"leaf_size": 4}  # a node needs at least 4 samples to split
    option_help: dict[str, str] = {
        "cp": "UCB exploration constant of the tree's selection (values standardized: unit-free)",
        "leaf_size": "a node with at least this many samples is split in two (theta; >= 4)",
        "kernel": "SVM kernel of the learned boundaries: rbf, poly or linear",
        "n_candidates": "points sampled inside the selected region per batch",
    }

    def __init__(self, space: SearchSpace, n_objectives: int = 1, **kwargs: Any):
        super().__init__(space, n_objectives, **kwargs)
        o = self.options
        if "kernel" in o and o["kernel"] not in ("rbf", "poly", "linear"):
            raise InputError("kernel", o["kernel"], "known SVM kernels: rbf, poly, linear")
        if "sampler" in o and o["sampler"] not in self.samplers:
            raise InputError("sampler", o["sampler"], f"known samplers: {', '.join(self.samplers)}")
        self._gp: tuple[Any, int] = (None, -1)  # (GP, n_batches it was fitted at): a cache, not state

    samplers: tuple[str, ...] = SAMPLERS

    # subclass hooks
    def splitter(self) -> pt.Splitter:
        """The node splitter (:data:`~.partition.Splitter`) of step 1; subclasses must override.

        Raises:
            NotImplementedError: in this base class.
        """
        raise NotImplementedError

    def node_value(self, y: np.ndarray) -> Any:
        """A node's value for selection from its samples' objectives ``y`` (``n x m``, maximization
        convention); subclasses must override.

        Raises:
            NotImplementedError: in this base class.
        """
        raise NotImplementedError

    def ucb(self) -> Any:
        """The selection score ``(child, parent) -> float`` of step 2: LA-MCTS's UCB with ``cp``
        (:func:`~.partition.uct_bonus`)."""
        return pt.uct_bonus(float(self.options["cp"]))

    def learn(self) -> pt.PartitionNode:
        """Step 1 of Alg. 1: the tree over the successful samples."""
        x, y = self.data()
        feats = self.space.features(x)
        return pt.build_tree(feats, y, self.splitter(), lambda idx: self.node_value(y[idx]), self.rng(salt=1),
                             leaf_size=int(self.options["leaf_size"]))

    def surrogate(self) -> Any:
        """The GP on every successful sample, fitted once per ask and shared by its regions."""
        if self._gp[1] != self.n_batches:
            x, y = self.data()
            with seeded_torch(self.torch_seed(5)):
                self._gp = (fit_gp(self.space.features(x), y), self.n_batches)
        return self._gp[0]

    def _suggest(self, q: int) -> np.ndarray:
        x, y = self.data()
        root = self.learn()
        paths = pt.select_paths(root, q, self.ucb())
        rng = self.rng()
        out = []
        # group the q picks by leaf: each distinct region gets as many points as it was picked
        groups: dict[int, tuple[list, int]] = {}
        for path in paths:
            leaf = pt.leaf_of(path, root)
            groups.setdefault(leaf.id, (path, 0))
            groups[leaf.id] = (groups[leaf.id][0], groups[leaf.id][1] + 1)
        for path, k in groups.values():
            leaf = pt.leaf_of(path, root)
            out.append(self.sample_region(path, x[leaf.idx], y[leaf.idx], k, rng))
        return np.vstack(out)

    def sample_region(self, path: list, x_leaf: np.ndarray, y_leaf: np.ndarray, k: int,
                      rng: np.random.Generator) -> np.ndarray:
        """Step 3: ``k`` points inside the region of ``path`` (subclasses pick the sampler)."""
        pool = pt.region_candidates(self.space, path, x_leaf, rng, int(self.options["n_candidates"]))
        pool = pool[self.is_new(pool)] if self.space.is_categorical else pool
        return pool[rng.permutation(pool.shape[0])[:k]]

    def tree(self) -> dict[str, Any] | None:
        """The partition tree learned from every successful sample so far (None before any)."""
        if self.data()[0].shape[0] == 0:
            return None
        root = self.learn()
        for node in pt.walk(root):  # visit counts as in selection
            node.visits = node.n
        return root.to_dict(self.ucb())


@OPTIMIZERS.register("lamcts")
class LAMCTS(PartitionOptimizer):
    """LA-MCTS ([Wang2020lamcts]_), single objective; see the module docstring.

    Options: ``cp`` (exploration, on standardized f), ``leaf_size`` (theta), ``kernel`` (SVM
    kernel), ``sampler`` (``bo``, ``turbo`` or ``random``), ``n_candidates`` (region samples).
    """

    name = "lamcts"
    multi_objective = False
    defaults = {**PartitionOptimizer.defaults, "sampler": "bo", "turbo_length": 0.4}
    option_help = {**PartitionOptimizer.option_help,
                   "sampler": "how points are picked in the region: bo (GP + qLogEI), turbo (Thompson sampling "
                              "in a trust region) or random",
                   "turbo_length": "sampler turbo: the trust region's side around the leaf's best point (unit box)"}

    def splitter(self) -> pt.Splitter:
        """k-means (k = 2) on ``(x, f)`` labels good/bad, an SVM of ``kernel`` learns the boundary."""
        return kmeans_split(self.options["kernel"], self.seed)

    def node_value(self, y: np.ndarray) -> float:
        """Mean of the node's ``f`` (``y``: ``n x 1``), standardized over all successful samples."""
        _, all_y = self.data()
        mu, sd = all_y[:, 0].mean(), all_y[:, 0].std() or 1.0
        return float(((y[:, 0] - mu) / sd).mean())

    def sample_region(self, path, x_leaf, y_leaf, k, rng):
        """Step 3 with ``sampler``: ``bo`` (qLogEI over in-region candidates), ``turbo``
        (continuous spaces: Thompson sampling in a trust region around the leaf's best point), or
        ``random`` (also used for a leaf of fewer than 2 samples). At most ``k x d`` float64."""
        sampler = self.options["sampler"]
        if sampler == "random" or x_leaf.shape[0] < 2:
            return super().sample_region(path, x_leaf, y_leaf, k, rng)
        x, y = self.data()
        n = int(self.options["n_candidates"])
        model = self.surrogate()
        with seeded_torch(self.torch_seed(len(path))):
            feats = self.space.features(x)
            if sampler == "turbo" and not self.space.is_categorical:
                center = self.space.features(x_leaf[np.argmax(y_leaf[:, 0])])[0]
                pool = self.space.from_unit(trust_region_candidates(center, model, float(self.options["turbo_length"]),
                                                                    n, rng))
                inside = pool[pt.in_region(path, self.space.features(pool))]
                pool = inside if inside.shape[0] >= k else pool
                return thompson_select(model, self.space, pool, k)
            pool = pt.region_candidates(self.space, path, x_leaf, rng, n)
            pool = pool[self.is_new(pool)] if self.space.is_categorical else pool
            if pool.shape[0] == 0:
                return pool
            acqf = acquisition("ei", model, feats, y, seed=self.torch_seed(2))
            return select_discrete(acqf, self.space, pool, k)

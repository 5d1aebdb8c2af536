"""LaNAS: learned linear partitions of the search space ([Wang2021lanas]_).

Each node fits a linear regressor ``w . x + b`` to its samples' values (on the model features:
one-hot for architectures) and splits by the node's mean value: the region ``w . x + b >= mean``
is the good child (Sec. 3.1). Selection descends by UCB on the mean value (Sec. 3.2), and new
points are drawn uniformly inside the selected region by rejection (Sec. 3.3).
"""

from __future__ import annotations

import numpy as np

from paperline.kernels.search import partition as pt
from paperline.kernels.search.base import OPTIMIZERS
from paperline.kernels.search.lamcts import PartitionOptimizer


class LinearBoundary:
    """The good side of a linear regressor: ``w . x + b >= threshold`` (1) or not (0)."""

    def __init__(self, features: np.ndarray, values: np.ndarray):
        from sklearn.linear_model import Ridge

        self.model = Ridge(alpha=1e-3).fit(features, values)
        self.threshold = float(values.mean())

    def predict(self, features: np.ndarray) -> np.ndarray:
        """``n x f`` features -> ``n`` int64 labels, 1 on the good side (predicted value >= the node mean)."""
        return (self.model.predict(features) >= self.threshold).astype(np.int64)


def linear_split(features: np.ndarray, values: np.ndarray, rng: np.random.Generator):
    """LaNAS's splitter ([Wang2021lanas]_ Sec. 3.1): a ridge regressor of the first objective on
    ``features`` (``n x f``), thresholded at the node's mean value.

    Returns:
        ``(labels, boundary)``: ``n`` int64 labels (1: good side) and the :class:`LinearBoundary`;
        None when every value is the same (nothing to split). ``rng`` is unused.
    """
    f = values[:, 0]
    if np.ptp(f) == 0:
        return None
    boundary = LinearBoundary(features, f)
    return boundary.predict(features), boundary


@OPTIMIZERS.register("lanas")
class LaNAS(PartitionOptimizer):
    """LaNAS ([Wang2021lanas]_), single objective; see the module docstring.

    Options: ``cp`` (exploration, on standardized values), ``leaf_size``, ``n_candidates``.
    """

    name = "lanas"
    multi_objective = False
    defaults = {"cp": 0.5, "leaf_size": 10, "n_candidates": 2000}
    option_help = {"cp": "UCB exploration constant (values standardized: unit-free)",
                   "leaf_size": "a node with at least this many samples is split by its linear regressor (>= 4)",
                   "n_candidates": "points drawn uniformly inside the selected region per batch"}
    positive = frozenset({"n_candidates"})

    def splitter(self) -> pt.Splitter:
        """:func:`linear_split`."""
        return linear_split

    def node_value(self, y: np.ndarray) -> float:
        """Mean of the node's first objective, standardized over all successful samples (``y``: ``n x 1``)."""
        _, all_y = self.data()
        mu, sd = all_y[:, 0].mean(), all_y[:, 0].std() or 1.0
        return float(((y[:, 0] - mu) / sd).mean())

    def sample_region(self, path, x_leaf, y_leaf, k, rng):
        """Sec. 3.3: ``k`` uniform samples of the space kept when inside the region (up to 20 draws of
        ``n_candidates``; unseen points only on a categorical space), else the base class's sampler.
        """
        # Sec. 3.3: uniform samples of the whole space, kept when inside the region
        n = int(self.options["n_candidates"])
        for _ in range(20):
            pool = self.space.sample(rng, n)
            pool = pool[pt.in_region(path, self.space.features(pool))]
            if self.space.is_categorical:
                pool = pool[self.is_new(pool)]
            if pool.shape[0] >= k:
                return pool[:k]
        return super().sample_region(path, x_leaf, y_leaf, k, rng)

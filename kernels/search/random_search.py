"""Random search: the baseline every optimizer must beat."""

from __future__ import annotations

import numpy as np

from paperline.kernels.search.base import OPTIMIZERS, Optimizer


@OPTIMIZERS.register("random")
class RandomSearch(Optimizer):
    """Uniform sampling of the space (new points only, on a finite space); any number of objectives."""

    name = "random"

    def _suggest(self, q: int) -> np.ndarray:
        return self.space.sample(self.rng(), 4 * q)

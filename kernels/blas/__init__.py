"""Tiled level-3 BLAS (BLASX, Wang et al. 2016): the six routines as tile tasks over k-panels.

Public entry points mirror ``scipy.linalg.blas`` (``gemm``, ``symm``, ``syrk``, ``syr2k``,
``trmm``, ``trsm``) and take arrays or tile sources (memory-mapped ``.npy`` files, seeded random
matrices, S3 objects through a source the caller builds). :mod:`.runtime` runs the tile tasks on
one process or on a Dask cluster with the paper's runtime ideas: dynamic scheduling, locality-aware
placement, a per-worker LRU tile cache (L1), peer fetch (L2) and prefetch of the next panel.
:mod:`.verify` checks results with Freivalds' random projection.
"""

from paperline.kernels.blas.api import gemm, symm, syr2k, syrk, trmm, trsm
from paperline.kernels.blas.plan import ROUTINES, Problem, make_problem, plan_tasks
from paperline.kernels.blas.sources import ArraySource, NpySource, RandomSource, TileSource

__all__ = [
    "ROUTINES", "ArraySource", "NpySource", "Problem", "RandomSource", "TileSource", "gemm", "make_problem",
    "plan_tasks", "symm", "syr2k", "syrk", "trmm", "trsm",
]

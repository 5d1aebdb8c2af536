"""Probabilistic temporal tensor factorization ([Li2017p2t2f]_): sparse COO tensors, the PTTF
model with its serial ALS reference, P²T²F (data splitting plus stochastic consensus ADMM), the
TensorLy CP baseline, and the bundled datasets.

The public names are re-exported here::

    from paperline.kernels.tensor import COOTensor, als, load_dataset, tensorly_cp

except P²T²F itself, whose function would hide its module of the same name:
``from paperline.kernels.tensor.p2t2f import p2t2f``. SciPy and TensorLy are imported when first
used, not here.
"""

from paperline.kernels.tensor.coo import COOTensor, Split, make_split, random_split, temporal_split
from paperline.kernels.tensor.pttf import CPFactors, FitHistory, FitResult, als
from paperline.kernels.tensor.baselines import tensorly_cp
from paperline.kernels.tensor.datasets import (
    dataset_info,
    dataset_names,
    load_dataset,
    load_flights,
    load_kinetic,
    load_produc,
    read_coo_parquet,
    write_coo_parquet,
)

__all__ = [
    "COOTensor",
    "CPFactors",
    "FitHistory",
    "FitResult",
    "Split",
    "als",
    "dataset_info",
    "dataset_names",
    "load_dataset",
    "load_flights",
    "load_kinetic",
    "load_produc",
    "make_split",
    "random_split",
    "read_coo_parquet",
    "tensorly_cp",
    "temporal_split",
    "write_coo_parquet",
]

"""Plots and tables of a tensor-factorization run (files written to a local directory, then
logged to MLflow, whose server stores them in S3)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def convergence_plot(fits: list[dict[str, Any]], path: Path) -> Path:
    """Validation RMSE against wall seconds, one panel per (dataset, split), one line per method."""
    plt = _plt()
    groups = sorted({(f["dataset"], f["split"]) for f in fits})
    fig, axes = plt.subplots(1, len(groups), figsize=(4 * len(groups), 3.2), squeeze=False)
    for ax, (ds, sp) in zip(axes[0], groups):
        for f in fits:
            if (f["dataset"], f["split"]) != (ds, sp) or not f["history"]:
                continue
            t = [h["wall_seconds"] for h in f["history"]]
            v = [h["validation_rmse"] for h in f["history"]]
            ax.plot(t, v, label=f["method"])
        ax.set_title(f"{ds} / {sp}")
        ax.set_xlabel("wall seconds")
        ax.set_ylabel("validation RMSE (std units)")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def temporal_factors_plot(time_factors: dict[str, np.ndarray], path: Path) -> Path:
    """The time factors ``T`` (``K x R``) of each fitted dataset, one panel per dataset."""
    plt = _plt()
    names = sorted(time_factors)
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        t = time_factors[name]
        for r in range(t.shape[1]):
            ax.plot(np.arange(t.shape[0]), t[:, r], lw=1)
        ax.set_title(f"{name}: time factors (rank {t.shape[1]})")
        ax.set_xlabel("time slice")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def results_table(rows: list[dict[str, Any]], path: Path) -> Path:
    """Write the results table as Parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path

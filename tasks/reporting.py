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


def task_timeline_plot(records: list[dict[str, Any]], workers: list[str], path: Path) -> Path:
    """One lane per worker, one bar per tile task (start to end, seconds from the run's start)."""
    plt = _plt()
    t0 = min((r["start"] for r in records), default=0.0)
    fig, ax = plt.subplots(figsize=(9, 0.6 + 0.5 * len(workers)))
    cmap = plt.get_cmap("tab20")
    for lane, w in enumerate(workers):
        bars = [(r["start"] - t0, r["end"] - r["start"]) for r in records if r["worker"] == w]
        colors = [cmap(r["out"][0] % 20) for r in records if r["worker"] == w]
        ax.broken_barh(bars, (lane - 0.4, 0.8), facecolors=colors, edgecolors="black", linewidth=0.3)
    ax.set_yticks(range(len(workers)), [f"worker {i}" for i in range(len(workers))])
    ax.set_xlabel("seconds since the first task (bar colour: output tile row)")
    ax.set_title("tile tasks per worker")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def gemm_scaling_plot(rows: list[dict[str, Any]], peer: dict[str, Any] | None, path: Path) -> Path:
    """GFLOP/s against the number of workers, with ideal linear scaling from one worker and the
    single-process peer as a horizontal line."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.4))
    w = [r["workers"] for r in rows]
    g = [r["gflops"] for r in rows]
    ax.plot(w, g, "o-", label="paperline (tiled)")
    if rows:
        ax.plot(w, [g[0] * x for x in w], "--", color="grey", label="linear from 1 worker")
    if peer is not None:
        ax.axhline(peer["gflops"], color="tab:red", linestyle=":", label=peer["name"])
    ax.set_xlabel("workers")
    ax.set_ylabel("GFLOP/s")
    ax.set_xticks(w)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def pareto_plot(values: np.ndarray, front: np.ndarray, names: list[str], title: str, path: Path) -> Path:
    """All successful evaluations and the Pareto front (user units) in the plane of the first two
    objectives; with three or more objectives, one panel per pair of the first three."""
    plt = _plt()
    pairs = [(0, 1)] if len(names) == 2 else [(0, 1), (0, 2), (1, 2)]
    fig, axes = plt.subplots(1, len(pairs), figsize=(4.4 * len(pairs), 3.6), squeeze=False)
    for ax, (i, j) in zip(axes[0], pairs):
        if values.size:
            ax.scatter(values[:, i], values[:, j], s=10, c=np.arange(values.shape[0]), cmap="viridis",
                       label="evaluations (colour: order)")
        if front.size:
            order = np.argsort(front[:, i])
            ax.plot(front[order, i], front[order, j], "o-", color="tab:red", ms=5, lw=1, label="Pareto front")
        ax.set_xlabel(names[i])
        ax.set_ylabel(names[j])
        if values.size or front.size:
            ax.legend(fontsize=7)
        else:  # every evaluation failed: an empty legend warned on the terminal (a trial)
            ax.text(0.5, 0.5, "no successful evaluation", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def trace_plot(trace: np.ndarray, ylabel: str, title: str, path: Path) -> Path:
    """A best-so-far or hypervolume curve against the number of samples."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.4))
    ax.plot(np.arange(1, trace.size + 1), trace, lw=1.5)
    ax.set_xlabel("samples (evaluations)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def tree_plot(tree: dict[str, Any] | None, title: str, path: Path) -> Path:
    """Draw a search/partition tree (nested dicts with ``children``): one box per node with its
    label, sample count and value; leaves spread evenly, parents centred over their children."""
    plt = _plt()
    nodes: list[tuple[float, int, str]] = []
    edges: list[tuple[float, int, float, int]] = []
    next_x = [0.0]

    def label(node: dict[str, Any]) -> str:
        head = node.get("action") or node.get("side") or "root"
        n = node.get("n", node.get("visits", ""))
        value = node.get("value", node.get("mean_value"))
        text = f"{head}\nn={n}"
        if isinstance(value, (int, float)):
            text += f"\nv={value:.3g}"
        return text

    def place(node: dict[str, Any], depth: int) -> float:
        kids = node.get("children") or []
        if not kids:
            x = next_x[0]
            next_x[0] += 1.0
        else:
            xs = [place(k, depth + 1) for k in kids]
            x = sum(xs) / len(xs)
            for k, kx in zip(kids, xs):
                edges.append((x, depth, kx, depth + 1))
        nodes.append((x, depth, label(node)))
        return x

    fig_w = 6.0
    if tree:
        place(tree, 0)
        fig_w = min(max(6.0, 1.3 * next_x[0]), 40.0)
    depth = max((d for _, d, _ in nodes), default=0)
    fig, ax = plt.subplots(figsize=(fig_w, 1.2 + 1.1 * (depth + 1)))
    for x0, d0, x1, d1 in edges:
        ax.plot([x0, x1], [-d0, -d1], color="grey", lw=0.8, zorder=1)
    for x, d, text in nodes:
        ax.text(x, -d, text, ha="center", va="center", fontsize=6, zorder=2,
                bbox={"boxstyle": "round", "fc": "white", "ec": "tab:blue", "lw": 0.6})
    if not nodes:
        ax.text(0.5, 0.5, "this optimizer keeps no tree", ha="center", va="center")
    ax.set_axis_off()
    ax.set_title(title, fontsize=9)
    ax.margins(0.08)
    import warnings  # noqa: PLC0415

    with warnings.catch_warnings():  # wide trees: matplotlib warns that the labels do not fit
        warnings.simplefilter("ignore", UserWarning)
        fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path

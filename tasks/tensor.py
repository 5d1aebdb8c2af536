"""Cached Prefect tasks of the tensor-factorization pipeline: S3 I/O around the kernels.

Large data moves as S3 URIs plus content hashes, never as arrays in task inputs, so the cache
key (``INPUTS + TASK_SOURCE``, the object store excluded) is cheap and stable. Multi-object
outputs (splits, fitted factors) are committed with a manifest written last, so a task that
fails half-way leaves nothing visible.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import time
from pathlib import PurePosixPath
from typing import Any

import numpy as np
from prefect import task
from prefect.cache_policies import INPUTS, TASK_SOURCE

from paperline.infra.storage import ObjectStore
from paperline.kernels.tensor.coo import COOTensor, Split, make_split
from paperline.kernels.tensor.datasets import (index_layout_hint, load_dataset, occupied_shape, read_coo_parquet,
                                               write_coo_parquet)
from paperline.kernels.tensor.p2t2f import p2t2f
from paperline.kernels.tensor.pttf import FitResult, rmse
from paperline.tasks.retry import HOUR, retry_unless_bad_input

CACHED = (INPUTS - "store") + TASK_SOURCE


def tensor_to_parquet(tensor: COOTensor) -> bytes:
    """Serialize a COO tensor as Parquet bytes (columns: mode names, ``t``, ``value``)."""
    buf = io.BytesIO()
    write_coo_parquet(tensor, buf)
    return buf.getvalue()


def _read_tensor(store: ObjectStore, uri: str, sha256: str, shape: tuple[int, ...]) -> COOTensor:
    t = read_coo_parquet(store.get_bytes(uri, sha256=sha256), argument=uri)
    # A split holds a subset of entries: restore the full nominal shape.
    return COOTensor(t.coords, t.values, tuple(shape), t.mode_names)


def user_scope(data: str) -> str:
    """The name a user's data file gets in metric names and tables: ``user-<file stem>``, e.g.
    ``user-ratings`` for ``s3://bucket/in/ratings.parquet``, so that runs on different files are
    not ranked together (MLflow metric names: letters, digits, ``_``, ``-``; others become ``_``)."""
    return "user-" + (re.sub(r"[^A-Za-z0-9_-]", "_", PurePosixPath(str(data)).stem) or "data")


@task(name="load-tensor", cache_policy=CACHED, persist_result=True, retries=1,
      retry_condition_fn=retry_unless_bad_input, timeout_seconds=HOUR)
def load_tensor(store: ObjectStore, bucket: str, dataset: str | None = None, data_uri: str | None = None,
                data_version: str | None = None) -> dict[str, Any]:
    """Load a bundled dataset (or a user's Parquet COO file) and store it content-addressed.

    Args:
        store: the S3 object store (excluded from the cache key).
        bucket: data bucket.
        dataset: bundled dataset name; or
        data_uri: a local path or ``s3://`` URI of a Parquet COO file, with
        data_version: the file's SHA-256 or the S3 object's ETag (part of the cache key: a
            changed file or a replaced object is read again).

    Returns:
        ``{"name", "uri", "sha256", "shape", "nnz", "mode_names", "layout_hint"}``, and for a
        user's tensor ``"occupied"``; ``layout_hint`` is
        :func:`~paperline.kernels.tensor.datasets.index_layout_hint` of a user's tensor (``""``
        for a bundled one, or none to say; absent from results cached before it was added);
        ``occupied`` its :func:`~paperline.kernels.tensor.datasets.occupied_shape` (the distinct
        indices per mode; for a bundled dataset it is left out, so that its result, which the
        splits' cache keys hold, stays as it was).

    Raises:
        InputError: unknown dataset, unreadable Parquet, NaN/inf values, empty tensor.
    """
    if dataset is not None:
        tensor, name = load_dataset(dataset), dataset
    else:
        raw = store.get_bytes(data_uri) if str(data_uri).startswith("s3://") else open(data_uri, "rb").read()
        tensor, name = read_coo_parquet(raw, argument="data", name=str(data_uri)), user_scope(data_uri)
    ref = store.put_bytes(tensor_to_parquet(tensor), bucket=bucket, prefix="tensors", suffix=".parquet")
    out = {"name": name, "uri": ref.uri, "sha256": ref.sha256, "shape": list(tensor.shape),
           "nnz": tensor.nnz, "mode_names": list(tensor.mode_names or []),
           "layout_hint": "" if dataset is not None else index_layout_hint(tensor).removeprefix("; ")}
    if dataset is None:  # what the flow's warning before the fits needs (mostly empty modes: a trial)
        out["occupied"] = list(occupied_shape(tensor))
    return out


@task(name="split-tensor", cache_policy=CACHED, persist_result=True, retries=1,
      retry_condition_fn=retry_unless_bad_input, timeout_seconds=HOUR)
def split_tensor(store: ObjectStore, bucket: str, tensor_ref: dict[str, Any], kind: str, seed: int) -> dict[str, Any]:
    """Make a seeded train/validation/test split and commit it as one manifest.

    Returns:
        ``{"kind", "prefix", "shape", "parts": {name: {"uri", "sha256"}}, "nnz": {...}}``.
    """
    tensor = _read_tensor(store, tensor_ref["uri"], tensor_ref["sha256"], tensor_ref["shape"])
    split = make_split(tensor, kind, seed=seed)
    parts = {name: tensor_to_parquet(getattr(split, name)) for name in ("train", "validation", "test")}
    prefix = f"s3://{bucket}/splits/{tensor_ref['sha256'][:16]}-{kind}-{seed}"
    store.commit(prefix, parts, meta={"kind": kind, "seed": seed, "tensor": tensor_ref["uri"]})
    manifest = store.read_manifest(prefix)
    return {"kind": kind, "prefix": prefix, "shape": tensor_ref["shape"],
            "parts": {k: {"uri": v["uri"], "sha256": v["sha256"]} for k, v in manifest["parts"].items()},
            "nnz": {name: getattr(split, name).nnz for name in parts}}


def read_split(store: ObjectStore, split_ref: dict[str, Any]) -> Split:
    """Load a committed split's three tensors."""
    shape = tuple(split_ref["shape"])
    parts = {k: _read_tensor(store, v["uri"], v["sha256"], shape) for k, v in split_ref["parts"].items()}
    return Split(split_ref["kind"], parts["train"], parts["validation"], parts["test"])


def _commit_fit(store: ObjectStore, bucket: str, method: str, split_ref: dict[str, Any], params: dict[str, Any],
                factors: list[np.ndarray], history: list[dict[str, float]], test_rmse: float,
                seconds: float) -> dict[str, Any]:
    buf = io.BytesIO()
    np.savez(buf, **{f"factor_{m}": f for m, f in enumerate(factors)})
    key = json.dumps({"method": method, "split": split_ref["prefix"], "params": params}, sort_keys=True)
    prefix = f"s3://{bucket}/fits/{method}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    manifest_ref = store.commit(prefix, {"factors.npz": buf.getvalue(),
                                         "history.json": json.dumps(history).encode()},
                                meta={"method": method, "split": split_ref["prefix"], "params": params,
                                      "test_rmse": test_rmse})
    last = history[-1] if history else {}
    from prefect.runtime import flow_run  # noqa: PLC0415

    # the flow run that fitted (a cached result keeps it: the flow tags a run all of whose fits
    # came from the cache as a copy of that run's)
    return {"method": method, "prefix": prefix, "manifest": manifest_ref.uri, "history": history,
            "test_rmse": test_rmse, "validation_rmse": last.get("validation_rmse", float("nan")),
            "train_rmse": last.get("train_rmse", float("nan")), "fit_seconds": seconds,
            "flow_run": {"id": str(flow_run.id or ""), "name": flow_run.name or ""}}


@task(name="fit-p2t2f", cache_policy=CACHED, persist_result=True, retries=1,
      retry_condition_fn=retry_unless_bad_input, timeout_seconds=12 * HOUR)
def fit_p2t2f(store: ObjectStore, bucket: str, split_ref: dict[str, Any], params: dict[str, Any],
              device: str = "cpu") -> dict[str, Any]:
    """Fit P²T²F on a split; its P sub-problems run as Dask tasks on the cluster's workers.

    Call it directly from the flow (not ``.submit``): it drives the ADMM rounds from the flow's
    process and submits the sub-problems through the task runner's Dask client.

    Args:
        params: keyword arguments of :func:`paperline.kernels.tensor.p2t2f.p2t2f` (rank, n_parts,
            lam, lam_t, rho, lr, lr_decay, rho_growth, n_epochs, batch_size, seed).
        device: ``"cpu"`` or ``"cuda"``: where the entries are put, so where the kernels compute
            (with ``"cuda"`` each Dask-CUDA worker receives its sub-tensor on its own GPU).

    Returns:
        fit summary with the committed factors' manifest URI, the per-epoch history and RMSEs.
    """
    from paperline.tasks.executors import cluster_executor

    split = read_split(store, split_ref)
    start = time.perf_counter()
    with cluster_executor() as executor:
        result: FitResult = p2t2f(split.train.to(device), validation=split.validation.to(device),
                                  executor=executor, **params)
    seconds = time.perf_counter() - start
    factors = result.factors.to_host()
    return _commit_fit(store, bucket, "p2t2f", split_ref, {**params, "device": device}, factors,
                       result.history.rows(), rmse(factors, split.test), seconds)


@task(name="fit-tensorly-cp", cache_policy=CACHED, persist_result=True, retries=1,
      retry_condition_fn=retry_unless_bad_input, timeout_seconds=12 * HOUR)
def fit_tensorly_cp(store: ObjectStore, bucket: str, split_ref: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """Baseline: TensorLy ``parafac`` with a mask (masked CP-ALS) on the same split.

    Args:
        params: ``rank``, ``n_iter_max``, ``l2_reg``, ``seed``.
    """
    from paperline.kernels.tensor.baselines import tensorly_cp

    split = read_split(store, split_ref)
    start = time.perf_counter()
    factors, history = tensorly_cp(split.train, validation=split.validation, **params)
    seconds = time.perf_counter() - start
    return _commit_fit(store, bucket, "tensorly_cp", split_ref, params, factors, history,
                       rmse(factors, split.test), seconds)


@task(name="render-report", cache_policy=CACHED, persist_result=True, retries=1, timeout_seconds=HOUR)
def render_report(store: ObjectStore, fits: list[dict[str, Any]], rows: list[dict[str, Any]],
                  time_split: str) -> dict[str, bytes]:
    """The run's report files, rendered from the fits (a pure function of them, so cached).

    Returns:
        file name -> bytes: ``factors_<dataset>_<split>.npz`` for every P²T²F fit (read from its
        committed manifest), ``convergence.png``, ``temporal_factors.png`` (the time factors of
        the ``time_split`` fits) and ``results.parquet``.
    """
    import tempfile
    from pathlib import Path

    from paperline.tasks import reporting

    files: dict[str, bytes] = {}
    time_factors = {}
    for f in fits:
        if f["method"] != "p2t2f":
            continue
        part = store.read_manifest(f["prefix"])["parts"]["factors.npz"]
        data = store.get_bytes(part["uri"], sha256=part["sha256"])
        files[f"factors_{f['dataset']}_{f['split']}.npz"] = data
        if f["split"] == time_split:
            with np.load(io.BytesIO(data)) as npz:
                time_factors[f["dataset"]] = npz[f"factor_{len(npz.files) - 1}"]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        reporting.convergence_plot(fits, out / "convergence.png")
        reporting.temporal_factors_plot(time_factors, out / "temporal_factors.png")
        reporting.results_table(rows, out / "results.parquet")
        for p in out.iterdir():
            files[p.name] = p.read_bytes()
    return files

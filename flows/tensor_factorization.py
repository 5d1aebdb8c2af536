"""The ``tensor-factorization`` flow: P²T²F against TensorLy CP on real temporal tensors.

For every dataset and split kind it loads the tensor into S3, commits a seeded split, fits
P²T²F (sub-problems as Dask tasks on the workers) and the TensorLy baseline as cached tasks, then
logs one MLflow run: parameters, per-epoch metrics, and artifacts (factors, convergence plot,
temporal-factor plot, results table).
"""

from __future__ import annotations

import hashlib
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import numpy as np
from prefect.logging import get_run_logger
from prefect.runtime import flow_run
from pydantic import Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from paperline.flows.pipelines import PipelineParameters
from paperline.infra.cluster import WorkerPath, configure_local_workers, default_task_runner, require_shared_paths
from paperline.infra.device import array_device
from paperline.infra.errors import InputError
from paperline.infra.pipeline_flow import pipeline_flow
from paperline.infra.regression import CACHED_FROM_TAG, Headline, check_latest
from paperline.infra.settings import get_settings
from paperline.infra.stack import require_stack
from paperline.infra.storage import ObjectStore, s3_location_problem, split_uri
from paperline.infra.summary import fmt
from paperline.infra.tracking import Tracker, prefect_run_tags
from paperline.kernels.errors import InputError as KernelInputError, unknown_name
from paperline.kernels.tensor.baselines import MAX_DENSE_CELLS
from paperline.kernels.tensor.coo import make_split
from paperline.kernels.tensor.datasets import (dataset_info, dataset_names, index_layout_hint, occupied_shape,
                                               read_coo_parquet)
from paperline.kernels.tensor.p2t2f import default_split_mode, working_set_bytes
from paperline.tasks.tensor import fit_p2t2f, fit_tensorly_cp, load_tensor, render_report, split_tensor, user_scope

EXPERIMENT = "tensor-factorization"


class TensorFactorizationParameters(PipelineParameters):
    """Parameters of the flow (rendered as a form in the Prefect UI)."""

    datasets: list[str] = Field(default_factory=lambda: ["kinetic", "produc", "flights"],
                                description="Bundled datasets (see `paperline datasets`).")
    data: str | None = Field(None, description="Your own tensor: a Parquet file (local path or s3:// URI) of "
                                               "COO rows with integer index columns, 't' (time, the last mode) among them, and 'value'. "
                                               "Replaces `datasets`.")
    splits: list[Literal["random", "temporal"]] = Field(
        default_factory=lambda: ["random", "temporal"],
        description="Train/validation/test splits each dataset is fitted on: random entries, or the last time "
                    "steps held out (temporal).")
    rank: int = Field(6, gt=0, le=512, description="CP rank R.")
    n_parts: int = Field(2, ge=1, description="P, sub-tensors solved in parallel (<= size of the largest non-time mode, "
                                            "which is split).")
    lam: float = Field(1.0, gt=0, description="Gaussian prior precision on the factors (Eq. 4).")
    lam_t: float = Field(10.0, ge=0, description="Temporal smoothness precision (Eq. 3-4).")
    rho: float = Field(0.01, gt=0, description="Initial ADMM consensus penalty per entry.")
    rho_growth: float = Field(1.05, ge=1, description="Per-epoch growth of rho.")
    lr: float = Field(1.0, gt=0, description="Unit-free step size of the stochastic ADMM updates.")
    lr_decay: float = Field(0.03, ge=0, description="lr_t = lr / (1 + lr_decay (t - 1)).")
    n_epochs: int = Field(40, gt=0, description="ADMM rounds (one pass over the data each).")
    batch_size: int = Field(4096, gt=0, description="Entries per mini-batch.")
    local_passes: int = Field(1, gt=0, description="Mini-batch passes over its data per sub-problem per round.")
    closing_sweeps: int = Field(30, ge=0, le=1000, description="Exact block-coordinate (ALS) sweeps after the last "
                                                               "round, distributed over the sub-problems.")
    rho_balance: float = Field(0.0, ge=0, description="Residual balancing: double/halve rho when the primal/dual "
                                                       "residual is this many times the other (0: off).")
    baseline: bool = Field(True, description="Also fit the TensorLy CP baseline (needs the dense tensor).")
    baseline_iterations: int = Field(100, gt=0, description="ALS iterations of the TensorLy baseline.")
    seed: int = Field(0, ge=0, description="Seed of the splits, the initial factors and the shuffles.")

    _data_warnings: list[str] = PrivateAttr(default_factory=list)  # check_data's, for data_warnings()

    @model_validator(mode="before")
    @classmethod
    def _no_default_datasets_with_data(cls, values: Any) -> Any:
        """With ``data`` and no ``datasets``, ``datasets`` is empty: the bundled default list is
        not what such a run fits (the summary and MLflow recorded it as if it were)."""
        if isinstance(values, dict) and values.get("data") is not None and "datasets" not in values:
            return {**values, "datasets": []}
        return values

    @field_validator("datasets", "splits")
    @classmethod
    def _in_default_order(cls, values: list[str], info: ValidationInfo) -> list[str]:
        """The datasets and splits in the order of the field's default, then the others by name:
        the same set in another order fits the same, and was "first finished run with these
        parameters" (a trial); taken as given, its fits (and so the first to pay a cold start,
        and the headlines) came in another order too (a review)."""
        if len(set(values)) < len(values):  # as given: validate_inputs names the one listed twice
            return values
        default = cls.model_fields[info.field_name].default_factory()  # type: ignore[misc]
        return sorted(values, key=lambda v: (default.index(v) if v in default else len(default), v))

    @field_validator("data")
    @classmethod
    def _absolute_path(cls, v: str | None) -> str | None:
        """A local file by its absolute path, so that a run given ``mine.parquet`` and one given
        ``/home/me/mine.parquet`` have the same parameters (and compare with each other)."""
        if v is None:
            return v
        if not v.strip():  # was "no such file" (gemm's and video's say this: a trial)
            raise ValueError("must not be empty: give a Parquet file's path or s3:// URI, or leave it out")
        if v.startswith("s3://"):  # a prefix was read as a 0-byte "not a Parquet file" (a trial)
            if v.endswith("/") or not split_uri(v)[1]:
                raise ValueError("an S3 prefix (a folder); give the Parquet object's URI (s3://bucket/key.parquet)")
            if problem := s3_location_problem(v):
                raise ValueError(problem)
            return v
        if v[:3].lower() == "s3:":  # s3:/bucket/x.parquet was taken for a local path (a trial)
            raise ValueError("looks like an S3 URI: start it with s3:// (e.g. s3://bucket/key.parquet)")
        if "://" in v:  # http://host/x.parquet became the local path ./http:/host/x.parquet (a trial)
            raise ValueError(f"unsupported scheme {v.split('://')[0]}://: give a local path or an s3:// URI")
        from paperline.kernels.video.sources import is_utf8, shown_name  # noqa: PLC0415

        if not is_utf8(v):  # pyarrow's UnicodeEncodeError named neither the file nor `data` (a trial)
            raise ValueError(f"{shown_name(v)} is not valid UTF-8: rename the file to a UTF-8 name")
        path = Path(v).expanduser()
        if path.is_symlink() and not path.exists():  # resolved, it was named by its missing target (a trial)
            from paperline.kernels.video.probe import missing_detail  # noqa: PLC0415

            raise ValueError(missing_detail(path))
        return str(path.resolve())

    def p2t2f_params(self) -> dict[str, Any]:
        """Keyword arguments of :func:`paperline.kernels.tensor.p2t2f.p2t2f` from these
        parameters: rank, P (``n_parts``), priors, ADMM schedule, batching, closing sweeps and
        seed."""
        return dict(rank=self.rank, n_parts=self.n_parts, lam=self.lam, lam_t=self.lam_t, rho=self.rho,
                    rho_growth=self.rho_growth, lr=self.lr, lr_decay=self.lr_decay, n_epochs=self.n_epochs,
                    batch_size=self.batch_size, local_passes=self.local_passes, rho_balance=self.rho_balance,
                    closing_sweeps=self.closing_sweeps, seed=self.seed)

    def baseline_params(self) -> dict[str, Any]:
        """Keyword arguments of the TensorLy baseline
        (:func:`paperline.kernels.tensor.baselines.tensorly_cp`): ``rank``, ``n_iter_max``
        (``baseline_iterations``) and ``seed``."""
        return dict(rank=self.rank, n_iter_max=self.baseline_iterations, seed=self.seed)

    def worker_paths(self, state_dir: str | Path) -> list[WorkerPath]:
        """A local ``data`` file, which the load task reads on a Dask worker (for
        :func:`~paperline.infra.cluster.require_shared_paths`); none for bundled or S3 data."""
        if self.data is None or self.data.startswith("s3://"):
            return []
        return [WorkerPath("data", self.data, self.data, instead="give it as an s3:// URI")]

    def validate_inputs(self) -> None:
        """Check what can be checked before anything starts: dataset names, a local data file
        (readable, splittable), P against the first mode, and memory bounds (the TensorLy
        baseline's dense tensor, P²T²F's factors). Raises InputError naming the argument and
        the value seen."""
        if self.data is not None and self.datasets:
            raise InputError("datasets", self.datasets, "give either `datasets` or `data`, not both")
        if not self.splits:
            raise InputError("splits", self.splits, "name at least one split kind")
        for name, values in (("datasets", self.datasets), ("splits", self.splits)):
            twice = sorted({v for v in values if values.count(v) > 1})
            if twice:  # fitted once, recorded twice: another comparison key than the list without it (a trial)
                raise InputError(name, values, f"{', '.join(twice)} listed twice: each is fitted once")
        shapes: dict[str, tuple[int, ...]] = {}
        if self.data is None:
            if not self.datasets:
                raise InputError("datasets", self.datasets, "name at least one dataset, or give `data`")
            known = dataset_names()
            for d in self.datasets:
                if d not in known:
                    raise InputError("datasets", d, unknown_name("dataset", d, known))
                shapes[d] = dataset_info(d).shape
        elif not self.data.startswith("s3://"):
            path = Path(self.data)
            if not self.data or not path.exists():
                raise InputError("data", self.data, "no such file")
            if not path.is_file() and not path.is_dir():  # a FIFO's open() blocked the run for good (a trial)
                raise InputError("data", self.data, "not a regular file (a FIFO, socket or device): give a Parquet file")
            self.check_data(path)
        for d, shape in shapes.items():
            self.check_shape(d, shape)

    def validate_on_stack(self, info: Any, store: ObjectStore) -> None:
        """Before the flow run is created: an ``s3://`` data object exists (its bucket named when
        that is what is missing) and holds a tensor these parameters can split and fit, as a local
        file is checked (a damaged object failed the flow run, leaving a failed MLflow run: a trial)."""
        if self.data is not None and self.data.startswith("s3://"):
            check_s3_data(store, self.data)
            self.check_data(store.get_bytes(self.data))

    def data_warnings(self) -> list[str]:
        """The warnings about the data file that the last :meth:`check_data` (called by
        :meth:`validate_inputs` for a local file, :meth:`validate_on_stack` for an ``s3://``
        object) found: its :func:`data_warning` line, if any (``[]`` before any check, and for
        the bundled datasets). `paperline run` prints them before the run starts."""
        return list(self._data_warnings)

    def check_data(self, source: Path | bytes) -> None:
        """Refuse a data file (its path, or the bytes of the ``s3://`` object ``data``) that is not
        a readable COO tensor, cannot make the requested splits, or does not fit these parameters.
        A file it accepts may still warrant a warning (indices that are not positions 0, 1, ...):
        :meth:`data_warnings` holds it. Raises InputError naming ``data``."""
        self._data_warnings = []
        tensor = read_coo_parquet(source, argument="data", name=self.data)
        layout = index_layout_hint(tensor)  # years as 't', or ids as indices (a trial): say what to renumber
        for kind in self.splits:
            try:
                make_split(tensor, kind, seed=self.seed)
            except KernelInputError as exc:
                # a way on, besides the split's internal value (horizon=1): a trial; years as 't' were
                # told only to subtract 1995, not that the random split fits them as they are (a trial)
                hint = layout
                if kind == "temporal" and _splits(tensor, "random", self.seed):
                    hint += ("; or " if layout else "; ") + "--set splits=random fits it without the temporal split" + (
                        " (counting those empty indices)" if layout else "")
                detail = str(exc)
                if getattr(exc, "argument", None) == "horizon":  # not a parameter one can set (a trial)
                    n_t = tensor.shape[-1]
                    share = "a tenth of" if n_t >= 20 else "at least 1 of"
                    need = (f"; it needs at least {2 * exc.value + 2} steps"
                            if exc.problem.startswith("leaves fewer than 2 training") else "")
                    detail = (f"{exc.problem} (its validation and test sets are the last {exc.value} time step(s) "
                              f"each, {share} the {n_t} steps of 't'{need})")
                raise InputError("data", self.data, f"cannot make the {kind} split: {detail}{hint}") from None
        try:
            self.check_shape("data", tensor.shape)
        except InputError as exc:
            if not layout:
                raise
            raise InputError(exc.argument, exc.value, exc.problem + layout) from None
        line = data_warning(user_scope(str(self.data)), layout, tensor.shape, occupied_shape(tensor), self)
        self._data_warnings = [line] if line else []

    def check_shape(self, name: str, shape: tuple[int, ...]) -> None:
        """Refuse, up front, a tensor these parameters cannot fit. Raises InputError."""
        split = shape[default_split_mode(shape)]
        if self.n_parts > split:
            raise InputError("n_parts", self.n_parts,
                             f"P larger than the number of slices along the split mode (the largest non-time "
                             f"mode) of {name!r} ({split})")
        from dask.utils import format_bytes  # noqa: PLC0415

        per_rank = 8 * sum(shape) * (2 * self.n_parts + 2)  # bytes of U, W^p, Lambda^p, Z per rank
        if per_rank > MAX_FACTOR_BYTES:  # the data's shape, not the rank (it was blamed on rank)
            raise InputError("data" if self.data else "datasets", self.data or name,
                             f"shape {shape}: its factors would take {format_bytes(per_rank)} even at rank 1 "
                             f"(limit {format_bytes(MAX_FACTOR_BYTES)})")
        if per_rank * self.rank > MAX_FACTOR_BYTES:
            fits = self._largest_rank(shape, MAX_FACTOR_BYTES // per_rank)  # whose fit fits too
            raise InputError("rank", self.rank, f"the factors of {name!r} (shape {shape}) would take "
                             f"{format_bytes(per_rank * self.rank)} (limit {format_bytes(MAX_FACTOR_BYTES)}); "
                             + (f"at most rank {fits} fits" if fits else "no rank fits in memory"))
        self.check_working_set(name, shape)
        cells = int(np.prod(shape, dtype=np.float64))
        if self.baseline and cells > MAX_DENSE_CELLS:
            raise InputError("baseline", True, f"the TensorLy baseline needs {name!r} dense: {cells:.3g} cells "
                             f"(limit {MAX_DENSE_CELLS:.3g}); use --set baseline=false for P²T²F alone")


    def _largest_rank(self, shape: tuple[int, ...], upto: int) -> int:
        """The largest rank up to ``upto`` whose fit stays within :data:`MAX_WORKING_BYTES` (0: none)."""
        return max((r for r in range(1, upto + 1)
                    if sum(working_set_bytes(shape, r, self.batch_size, self.n_parts).values()) <= MAX_WORKING_BYTES),
                   default=0)

    def check_working_set(self, name: str, shape: tuple[int, ...]) -> None:
        """Refuse a ``rank``/``batch_size`` whose fit would need more than :data:`MAX_WORKING_BYTES`
        per worker (:func:`~paperline.kernels.tensor.p2t2f.working_set_bytes`), naming the largest
        rank, and batch size, that fit. Raises InputError naming ``rank`` (or ``batch_size``)."""
        from dask.utils import format_bytes  # noqa: PLC0415

        need = sum(working_set_bytes(shape, self.rank, self.batch_size, self.n_parts).values())
        if need <= MAX_WORKING_BYTES:
            return
        fits = self._largest_rank(shape, self.rank - 1)
        one = working_set_bytes(shape, self.rank, 1, self.n_parts)  # per entry of a mini-batch, and the grams
        per_entry, grams = one["batch_statistics"], one["row_grams"]
        batch = (MAX_WORKING_BYTES - grams) // per_entry if grams < MAX_WORKING_BYTES else 0
        ways = [f"rank at most {fits}" if fits else None, f"batch_size at most {batch}" if batch >= 1 else None]
        argument, value = ("rank", self.rank) if fits or not batch else ("batch_size", self.batch_size)
        raise InputError(argument, value, f"fitting {name!r} (shape {shape}) at rank {self.rank} with mini-batches "
                                          f"of {self.batch_size} entries would take about {format_bytes(need)} per "
                                          f"worker (limit {format_bytes(MAX_WORKING_BYTES)}): set "
                                          + " or ".join(w for w in ways if w))


SLOW_DENSE_CELL_ITERATIONS = 10**9  # dense cells x baseline iterations: about 40 s of TensorLy's ALS at rank 6 here
MOSTLY_EMPTY = 10  # dense cells per cell of the occupied extent above which the modes are mostly empty indices


def data_warning(name: str, layout_hint: str, shape: tuple[int, ...] | list[int], occupied: tuple[int, ...] | list[int],
                 params: TensorFactorizationParameters) -> str:
    """The warning a user's tensor gets before it is fitted, or ``""``: what to renumber
    (``layout_hint``, from :func:`~paperline.kernels.tensor.datasets.index_layout_hint`), and,
    where ``params`` fit the TensorLy baseline on a dense ``shape`` of mostly empty indices (at
    least :data:`MOSTLY_EMPTY` times the cells of the ``occupied`` extent, the distinct indices
    per mode) that is slow to compute (its cells times ``baseline_iterations`` at least
    :data:`SLOW_DENSE_CELL_ITERATIONS`), that it may take minutes and ``--set baseline=false``.

    Both fits stay as asked (their results compare with other runs of these parameters); only
    the user is told, before the fits, not under their results (a trial waited 159 s for a
    baseline whose indices were mostly empty, the warning printed after it).

    Example: ``warning: user-spread: 'i' has 20 distinct values up to 95000: ...; renumber them
    0..19 (e.g. pandas.factorize): the fits count those empty indices; the TensorLy baseline
    computes the dense shape (95001, 15, 30), 4.28e+07 cells, in each of its 100 iterations:
    4.75e+03 times the 9e+03 cells its indices occupy (20 x 15 x 30), so it may take minutes;
    --set baseline=false fits P²T²F alone, or renumber as above``.
    """
    shape, occupied = tuple(int(n) for n in shape), tuple(int(n) for n in occupied)
    hint = layout_hint.removeprefix("; ")
    parts = [f"{hint}: the fits count those empty indices"] if hint else []
    cells = float(np.prod(shape, dtype=np.float64))
    used = float(np.prod(occupied, dtype=np.float64))
    if (params.baseline and cells >= MOSTLY_EMPTY * used
            and cells * params.baseline_iterations >= SLOW_DENSE_CELL_ITERATIONS):
        renumber = "renumber as above" if hint else "renumber each mode's indices 0, 1, ... (e.g. pandas.factorize)"
        parts.append(f"the TensorLy baseline computes the dense shape {shape}, {cells:.3g} cells, in each of its "
                     f"{params.baseline_iterations} iterations: {cells / used:.3g} times the {used:.3g} cells its "
                     f"indices occupy ({' x '.join(map(str, occupied))}), so it may take minutes; --set "
                     f"baseline=false fits P²T²F alone, or {renumber}")
    return f"warning: {name}: " + "; ".join(parts) if parts else ""


def _splits(tensor: Any, kind: str, seed: int) -> bool:
    """Whether :func:`~paperline.kernels.tensor.coo.make_split` makes the ``kind`` split of ``tensor``."""
    try:
        make_split(tensor, kind, seed=seed)
    except KernelInputError:
        return False
    return True


MAX_FACTOR_BYTES = 4 * 2**30
MAX_WORKING_BYTES = 2 * 2**30  # a fit's peak beyond its data, per worker (working_set_bytes)


PRESETS: dict[str, dict[str, Any]] = {
    "demo": {},
    "default": {},  # the flow's own defaults (the same as demo here)
    "full": {"rank": 8, "n_epochs": 150, "baseline_iterations": 300},
}


def check_s3_data(store: ObjectStore, uri: str) -> dict[str, Any]:
    """Refuse an ``s3://`` data URI whose bucket or object does not exist.

    Returns:
        The object's metadata (``ETag``, ``ContentLength``, ...).

    Raises:
        InputError: naming ``data``, and the bucket when that is what is missing.
    """
    store.require_bucket("data", uri)
    head = store.head(uri)
    if head is None:
        if store.any_under(uri.rstrip("/") + "/"):  # said only "no such object" (a trial)
            raise InputError("data", uri, "an S3 prefix (a folder) holding objects, not an object: give the Parquet "
                                          "object's URI (s3://bucket/key.parquet)")
        raise InputError("data", uri, "no such object in S3")
    return head


@pipeline_flow(name="tensor-factorization", log_prints=True, task_runner=default_task_runner())
def tensor_factorization(params: TensorFactorizationParameters | None = None) -> dict[str, Any]:
    """Run P²T²F and the TensorLy baseline on every (dataset, split) and track it in MLflow.

    A user's ``data`` whose indices are not positions 0, 1, ... (or whose baseline would compute
    mostly empty indices) gets :func:`data_warning` logged as it is loaded, before the fits, and
    its renumbering hint again under the results (``summary["lines"]``).

    Returns:
        A summary: ``rows`` (dataset, split, method, test/validation RMSE, fit seconds), the
        Prefect flow-run id and URL, the MLflow run id and URL, the artifact URIs and
        ``mlflow_params`` (the parameters as the MLflow run records them).

    Raises:
        InputError: bad parameters or data. ServiceError: the stack is not up.
    """
    params = params or TensorFactorizationParameters()
    configure_local_workers()  # before the runner's local cluster starts (at the first task)
    params.validate_inputs()
    settings = get_settings()
    info, store = require_stack(settings)
    if settings.dask_scheduler_address:  # (also for deployments' runs; `paperline run` asked before the flow run)
        require_shared_paths(settings, params.worker_paths(settings.state_dir))
    tracker = Tracker(info.mlflow_tracking_uri)
    bucket = info.data_bucket
    run_url = info.flow_run_url(flow_run.id)
    device = array_device(settings.device)
    mlflow_params = {**params.model_dump(), "device": device}
    run_id = tracker.start_run(EXPERIMENT, run_name=flow_run.name or "tensor-factorization",
                               tags=prefect_run_tags(info),
                               params=mlflow_params)
    try:
        if params.data is not None:  # what the load task's cache key holds: the file's version, not only its name
            if params.data.startswith("s3://"):
                # a replaced object was served from the cache with the old content's results (a trial)
                version = "etag:" + str(check_s3_data(store, params.data).get("ETag", "")).strip('"')
            else:
                with open(params.data, "rb") as f:
                    version = "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()
            tensors = {user_scope(params.data): load_tensor.submit(store, bucket, data_uri=params.data, data_version=version)}
        else:
            tensors = {d: load_tensor.submit(store, bucket, dataset=d) for d in params.datasets}
        for d, t in tensors.items():  # surface a load error itself, and check what S3 data holds
            params.check_shape(d, tuple(t.result()["shape"]))
            # before the fits, not only under their results: a baseline on mostly empty indices
            # ran minutes with nothing said (a fresh-user trial)
            if t.result().get("occupied") and (line := data_warning(d, t.result().get("layout_hint", ""),
                                                                    t.result()["shape"], t.result()["occupied"], params)):
                get_run_logger().warning(line)
        # what makes an earlier run comparable: for a user's file its content too, not only its
        # name (a rewritten file was compared with the old content's runs: a fresh-user trial)
        identity = dict(mlflow_params)
        if params.data is not None:
            content = next(iter(tensors.values())).result()["sha256"]
            identity["data_sha256"] = content  # the content, not where it lies: the same file
            del identity["data"]  # uploaded to S3 was "first finished run" (a trial); metric names hold the stem
            tracker.set_tags(run_id, {"paperline.data_sha256": content})
        splits = {(d, k): split_tensor.submit(store, bucket, t, k, params.seed)
                  for d, t in tensors.items() for k in params.splits}
        # The P²T²F fits one after another, each spreading its P sub-problems over all the
        # workers (called from the flow, so no worker thread blocks waiting for its own
        # sub-tasks); then the TensorLy baselines, as tasks on the workers side by side. A
        # sub-problem is bound to its worker: submitted first, the baselines held the workers
        # and each P²T²F fit's seconds counted the wait for them (a fresh-user trial: 263-316 s
        # beside a 159-s baseline, 0.54 s alone).
        p2t2f = {(d, k): fit_p2t2f(store, bucket, s.result(), params.p2t2f_params(), device)
                 for (d, k), s in splits.items()}
        baselines = {key: fit_tensorly_cp.submit(store, bucket, s, params.baseline_params())
                     for key, s in splits.items()} if params.baseline else {}
        fits = []
        for (d, k) in splits:
            fits.append({"dataset": d, "split": k, **p2t2f[(d, k)]})
            if params.baseline:
                fits.append({"dataset": d, "split": k, **baselines[(d, k)].result()})
        summary = _log_run(tracker, run_id, store, fits, params)
        copy = cached_copy_of(fits, str(flow_run.id))
        if copy is not None:  # the earlier run's very fit_s: listed, and taken as the best, as a run of its own (a trial)
            tracker.set_tags(run_id, {CACHED_FROM_TAG: copy["id"]})
        versus = check_latest(tracker, run_id, identity, _headlines(fits))
        # a user's 't' starting at a year passed the random split and was fitted with the empty
        # leading steps, nothing said (the temporal split refuses it with the same hint): a trial
        hints = [f"warning: {d}: {h}: the fit above counted those empty indices"
                 for d, t in tensors.items() if (h := t.result().get("layout_hint"))]
        summary["lines"] = [*hints, *versus.lines()]
        if copy is not None:
            summary["lines"].append(f"every fit was served from Prefect's task cache (fitted by flow run "
                                    f"{copy['name'] or copy['id']}): this MLflow run is a copy of that run's results, "
                                    "which `paperline compare` lists with --all-runs only")
        summary["versus_best_earlier"] = versus.as_dict()
        tracker.end_run(run_id, "FINISHED")
    except BaseException as exc:
        tracker.end_failed(run_id, exc)
        raise
    summary.update(prefect_flow_run_id=str(flow_run.id), prefect_flow_run_url=run_url,
                   mlflow_run_id=run_id, mlflow_run_url=tracker.run_url(run_id), mlflow_params=mlflow_params)
    return summary


def cached_copy_of(fits: list[dict[str, Any]], this_flow_run: str) -> dict[str, str] | None:
    """The flow run (``{"id", "name"}``) that fitted every one of ``fits``, when none was fitted
    by ``this_flow_run`` (each came from Prefect's task cache, which keeps the fitting run's id):
    this run then repeats that one's results, its ``fit_s`` included. None when any fit ran here,
    or a fit does not say (a result cached before fits recorded it)."""
    ids = [(f.get("flow_run") or {}).get("id") for f in fits]
    if not fits or not all(ids) or this_flow_run in ids:
        return None
    return fits[0]["flow_run"]


def _headlines(fits: list[dict[str, Any]]) -> list[Headline]:
    """Held-out RMSE of every P²T²F fit (the first ranks runs; 5% worse is a regression) and the
    fit seconds (25%: timings on a shared machine)."""
    ours = [f"{f['dataset']}.{f['split']}.{f['method']}" for f in fits if f["method"] == "p2t2f"]
    return ([Headline(f"{t}.test_rmse", higher_is_better=False, tolerance=0.05) for t in ours]
            + [Headline(f"{t}.fit_s", higher_is_better=False, tolerance=0.25, timed_by=f"{t}.fit_s") for t in ours])


MLFLOW_NAMES = {"wall_seconds": "wall_s"}  # units in MLflow names (README "MLflow names")


def _iterations(history: list[dict[str, float]]) -> int:
    """Epochs (ALS sweeps / ADMM iterations) a fit ran: its last record's ``epoch``; TensorLy's
    history also holds the initialization as epoch 0, so its length is one more."""
    return int(history[-1]["epoch"]) if history else 0


def _log_run(tracker: Tracker, run_id: str, store: ObjectStore, fits: list[dict[str, Any]],
             params: TensorFactorizationParameters) -> dict[str, Any]:
    rows, metrics, steps = [], {}, []
    for f in fits:
        tag = f"{f['dataset']}.{f['split']}.{f['method']}"
        for h in f["history"]:
            step = {f"{tag}.{MLFLOW_NAMES.get(k, k)}": float(h[k])
                    for k in ("train_rmse", "validation_rmse", "objective", "primal_residual", "dual_residual",
                              "wall_seconds") if np.isfinite(h.get(k, np.nan))}
            if f["method"] == "p2t2f":
                step[f"{tag}.consensus_residual"] = float(h["primal_residual"])
            steps.append((int(h["epoch"]), step))
        final = {f"{tag}.test_rmse": f["test_rmse"], f"{tag}.fit_s": f["fit_seconds"]}
        steps.append((0, final))
        metrics.update(final)
        rows.append({"dataset": f["dataset"], "split": f["split"], "method": f["method"],
                     "test_rmse": f["test_rmse"], "validation_rmse": f["validation_rmse"],
                     "fit_seconds": f["fit_seconds"], "epochs": _iterations(f["history"]), "factors": f["manifest"]})
    report = render_report.submit(store, fits, rows, params.splits[0])
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max_workers=4) as pool:
        metrics_logged = pool.submit(tracker.log_metric_steps, run_id, steps)  # meanwhile: the report
        out = Path(tmp)
        for name, data in report.result().items():
            (out / name).write_bytes(data)
        # Everything is rendered before anything is logged: a failure above leaves no partial set.
        list(pool.map(lambda p: tracker.log_artifact(run_id, str(p), "factors" if p.suffix == ".npz" else None),
                      sorted(out.iterdir())))
        metrics_logged.result()
    return {"rows": rows, "table": rmse_table(rows), "metrics": metrics, "artifacts": {
        "mlflow": f"runs:/{run_id}/", "fits": [f["manifest"] for f in fits]}}


def rmse_table(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary's table (``{"title", "columns", "rows"}``, cells as text) of the fits' ``rows``
    (``dataset``, ``split``, ``method``, ``test_rmse``, ``validation_rmse``, ``fit_seconds`` (None
    when not timed), ``epochs``): held-out RMSE in the bundled datasets' standardized units
    (kernels/tensor/datasets.py) or, where one is a user's file (``user-...``), the file's own."""
    units = "the file's own units" if any(str(r["dataset"]).startswith("user-") for r in rows) else "standardized units"
    return {"title": f"tensor-factorization: held-out RMSE ({units})",
            "columns": ["dataset", "split", "method", "test RMSE", "validation RMSE", "fit seconds", "epochs"],
            "rows": [[str(r["dataset"]), str(r["split"]), str(r["method"]), fmt(r["test_rmse"]),
                      fmt(r["validation_rmse"]),
                      f"{r['fit_seconds']:.2f}" if isinstance(r["fit_seconds"], float) else fmt(r["fit_seconds"]),
                      str(r["epochs"])] for r in rows]}

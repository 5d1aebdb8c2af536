"""The ``gemm`` flow: a tiled level-3 BLAS routine on the Dask cluster (BLASX), verified with
Freivalds' check, measured against the single-process NumPy/SciPy peer, tracked in MLflow.

Steps: validate the parameters and open the operands (seeded random, ``.npy`` files or S3
objects); sweep 1..W workers for the scaling plot (scratch outputs); run the peer; run the tile
plan on the workers, writing the output tile by tile to a staged file; verify it (the flow fails
and nothing is written when the check fails); commit the output (an atomic rename, or an S3
upload that is visible only once complete); log metrics and plots to one MLflow run. The output
is committed last, so that a run stopped or failed in the sweep or the peer leaves none (an
interrupted run wrote its full result, at a default S3 key nobody was told: a trial).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
from prefect.runtime import flow_run
from pydantic import Field, ValidationInfo, field_validator

from paperline.flows.pipelines import PipelineParameters
from paperline.infra.device import array_device
from paperline.infra.cluster import (
    WorkerPath,
    configure_local_workers,
    default_task_runner,
    planned_worker_count,
    planned_worker_memory,
    require_shared_paths,
)
from paperline.infra.errors import InputError
from paperline.infra.pipeline_flow import pipeline_flow
from paperline.infra.regression import Headline, check_latest
from paperline.infra.settings import get_settings
from paperline.infra.stack import require_stack
from paperline.infra.storage import (S3_BUCKET_NAME, ObjectStore, nearest_existing, require_outside_state_dir,
                                     require_writable_dir)
from paperline.infra.tracking import Tracker, prefect_run_tags
from paperline.kernels.blas.plan import Problem
from paperline.kernels.blas.runtime import check_memory_budget, missing_output_directory
from paperline.kernels.errors import InputError as KernelInputError
from paperline.tasks.gemm import (
    build_problem,
    fit_s3_bands,
    render_gemm_report,
    scaling_sweep,
    single_process_peer,
    stage_random_operands,
    tiled_multiply,
    used_operands,
)

EXPERIMENT = "gemm"
# What a run is judged by against the best earlier run of the same parameters (timings: 10%). Not
# ratio_to_peer: the peer is timed once, so on small problems its noise alone flagged regressions.
HEADLINES = [Headline("throughput_gflop_per_s", higher_is_better=True, tolerance=0.10, timed_by="wall_s")]


def parse_bytes(value: int | str) -> int:
    """``1073741824``, ``"1GiB"``, ``"512 MB"`` -> bytes. Raises InputError."""
    from dask.utils import parse_bytes as dask_parse_bytes  # noqa: PLC0415

    try:
        n = int(value) if isinstance(value, int) else dask_parse_bytes(str(value))
    except (ValueError, TypeError):
        raise InputError("memory_budget", value, "expected bytes as an integer or with a unit (e.g. 2GiB)") from None
    if n <= 0:
        raise InputError("memory_budget", value, "must be positive")
    return n


def logged_params(params: GemmParameters, problem: Problem | None) -> dict[str, Any]:
    """The parameters as the MLflow run records them: as given, except ``m``, ``n``, ``k`` and
    ``dtype``, which are ``problem``'s (result rows and columns, inner dimension, the operands'
    dtype): file or S3 operands bring their own, SYRK/SYR2K have no ``m`` (n x n) and SYMM/TRMM/TRSM
    no ``k``, and the values not used (often the defaults 4096 and float64) were recorded as if
    they were: `paperline compare` showed them. ``problem``: from :meth:`GemmParameters.validate_inputs`.
    """
    logged = params.model_dump()
    if problem is not None:
        logged.update(m=problem.out_shape[0], n=problem.out_shape[1], k=problem.inner, dtype=str(problem.dtype))
    return logged




# The operands and flags each routine reads besides a, alpha and the tile (reference BLAS semantics).
ROUTINE_USES = {
    "gemm": {"b", "c", "beta", "trans_a", "trans_b"},
    "symm": {"b", "c", "beta", "side", "uplo"},
    "syrk": {"c", "beta", "trans_a", "uplo"},
    "syr2k": {"b", "c", "beta", "trans_a", "uplo"},
    "trmm": {"b", "side", "uplo", "trans_a", "diag"},
    "trsm": {"b", "side", "uplo", "trans_a", "diag"},
}


class GemmParameters(PipelineParameters):
    """Parameters of the flow (rendered as a form in the Prefect UI)."""

    routine: Literal["gemm", "symm", "syrk", "syr2k", "trmm", "trsm"] = Field(
        "gemm", description="Level-3 BLAS routine (reference semantics, as scipy.linalg.blas).")
    m: int = Field(4096, gt=0, description="Rows of the result (random operands).")
    n: int = Field(4096, gt=0, description="Columns of the result (random operands).")
    k: int = Field(4096, gt=0, description="Inner dimension (GEMM, SYRK, SYR2K with random operands).")
    dtype: Literal["float32", "float64"] = Field("float64", description="Precision of random operands.")
    tile: int = Field(1024, gt=0, description="Tile edge (entries); one task computes one output tile.")
    alpha: float = Field(1.0, description="Scale of the product.")
    beta: float = Field(0.0, description="Scale of C (GEMM, SYMM, SYRK, SYR2K).")
    trans_a: Literal["N", "T"] = Field("N", description="op(A) (SYRK/SYR2K: their `trans`); C, the conjugate "
                                                        "transpose, is T for these real operands.")
    trans_b: Literal["N", "T"] = Field("N", description="op(B) (GEMM); C is T.")
    side: Literal["L", "R"] = Field("L", description="SYMM/TRMM/TRSM: A on the left or the right.")
    uplo: Literal["U", "L"] = Field("U", description="Stored triangle of A (SYMM/TRMM/TRSM) or C (SYRK/SYR2K).")
    diag: Literal["N", "U"] = Field("N", description="TRMM/TRSM: U = unit diagonal (not read).")
    a: str = Field("random", description="Operand A: 'random' (seeded), a local .npy path or an s3:// URI.")
    b: str = Field("random", description="Operand B (unused by SYRK): 'random', a .npy path or an s3:// URI.")
    c: str | None = Field(None, description="Operand C (optional; GEMM/SYMM/SYRK/SYR2K): like `a`.")
    seed: int = Field(0, ge=0, description="Seed of random operands and of the verification vector.")
    output: str | None = Field(None, description="Where the result goes: a local .npy path or an s3:// URI "
                                                 "(default: s3://<data bucket>/gemm/<flow run id>/result.npy).")
    memory_budget: int | str = Field("1GiB", description="Bytes of tiles each worker may cache (L1); larger "
                                                         "operands are streamed out of core.")
    check_finite: bool = Field(True, description="Refuse NaN/inf in the operands.")
    stage_random: bool = Field(True, description="Write random operands to .npy files once (kept under the state "
                                                 "directory and reused) so timings measure the multiply, not the "
                                                 "random number generator; false: generate tiles where they are read.")
    scaling: bool = Field(True, description="Also time 1..W workers for the scaling plot.")
    peer: bool = Field(True, description="Also time the single-process NumPy/SciPy peer (operands up to 4 GiB).")

    @field_validator("routine", mode="before")
    @classmethod
    def _routine_case(cls, v: Any) -> Any:
        """Either case: BLAS users type GEMM as often as gemm (routine=GEMM was refused while
        side=r was refused for the other case: a trial); the value kept, and recorded, is lower case.
        One that is none of them stays as given, so that its error names the value seen."""
        return v.lower() if isinstance(v, str) and v.lower() in ROUTINE_USES else v

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_case(cls, v: Any) -> Any:
        """Either case too (dtype=FLOAT32 was refused once routine=GEMM was taken: a trial); kept
        lower case, NumPy's name."""
        return v.lower() if isinstance(v, str) and v.lower() in ("float32", "float64") else v

    @field_validator("trans_a", "trans_b", "side", "uplo", "diag", mode="before")
    @classmethod
    def _flag_case(cls, v: Any, info: ValidationInfo) -> Any:
        """Either case, as the kernels' parse_flag takes them (side=r was refused); kept upper case.
        A transpose flag ``C`` (conjugate transpose, BLAS's third) is ``T``: the operands are real,
        as for the kernels and scipy.linalg.blas. A letter that is none of the field's stays as
        given, so that its error names the value seen."""
        transpose = info.field_name in ("trans_a", "trans_b")
        if transpose and isinstance(v, str) and v.upper() == "C":
            return "T"
        if isinstance(v, str) and v.upper() in get_args(cls.model_fields[info.field_name].annotation):
            return v.upper()
        if transpose and isinstance(v, str):  # (pydantic's "Input should be 'N' or 'T'" hid that C is taken: a trial)
            raise ValueError("expected N or T (either case), or C, taken as T for these real operands")
        return v

    @field_validator("memory_budget")
    @classmethod
    def _check_budget(cls, v: int | str) -> int | str:
        """A budget that does not read as bytes is refused as the model is built (from Python
        too, not only by the CLI); the value is kept as given (``"1GiB"``)."""
        try:
            parse_bytes(v)
        except InputError as exc:
            raise ValueError(exc.problem) from None
        return v

    @field_validator("a", "b", "c", "output")
    @classmethod
    def _check_location(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("must not be empty")
        if v is not None and v[:3].lower() == "s3:" and not v.startswith("s3://"):  # s3:/bucket/x.npy was a local path
            raise ValueError("looks like an S3 URI: start it with s3:// (e.g. s3://bucket/key.npy)")
        if v is None or not v.startswith("s3://"):
            return v
        bucket, _, key = v[len("s3://"):].partition("/")
        if not S3_BUCKET_NAME.fullmatch(bucket):
            raise ValueError("not a valid S3 bucket name (3-63 lowercase letters, digits, dots and hyphens): "
                             "expected s3://bucket/key.npy")
        if info.field_name != "output" and (not key or key.endswith("/")):  # the output's own check says more
            raise ValueError("name an object, e.g. s3://bucket/path/a.npy")
        return v

    def check_used(self) -> None:
        """Refuse an operand or flag the routine does not read, given other than its default (a
        TRSM with ``c`` and ``beta`` ran as plain TRSM, and MLflow recorded them as if used), and
        a ``beta`` without ``c`` to scale, or (GEMM/SYMM) a ``c`` that ``beta = 0`` leaves unread.
        Raises InputError."""
        uses = ROUTINE_USES[self.routine]
        for name in ("b", "c", "beta", "trans_a", "trans_b", "side", "uplo", "diag"):
            value, default = getattr(self, name), type(self).model_fields[name].default
            if name not in uses and value != default:
                raise InputError(name, value, f"{self.routine.upper()} does not use it (it takes "
                                              f"{', '.join(sorted(uses))}); leave it out")
        if self.beta != 0 and self.c is None:
            raise InputError("beta", self.beta, "scales c, which is not given: set c (e.g. c=random) or leave beta 0")
        # GEMM/SYMM read C only through beta C: with beta 0 a c was never read, yet counted as
        # given and recorded in MLflow (a trial). SYRK/SYR2K read C's other triangle regardless.
        if self.c is not None and self.beta == 0 and self.routine in ("gemm", "symm"):
            raise InputError("c", self.c, f"{self.routine.upper()} reads c only as beta * c, and beta is 0: "
                                          "set beta (e.g. beta=1) or leave c out")

    def kernel_params(self) -> dict[str, Any]:
        """The parameters :func:`paperline.tasks.gemm.build_problem` reads (routine, sizes,
        dtype, tile, scalars, flags, operands, seed, ``check_finite``), as a dict: every field but
        ``output``, ``memory_budget``, ``scaling``, ``peer`` and ``stage_random``."""
        return self.model_dump(exclude={"output", "memory_budget", "scaling", "peer", "stage_random"})

    def validate_on_stack(self, info: Any, store: ObjectStore) -> None:
        """Before the flow run is created, what :meth:`validate_inputs` left for the store: S3
        operands (their objects and headers, then the whole problem) or an S3 output's bucket.
        Local operands are not opened again. Raises InputError."""
        if any(str(v).startswith("s3://") for v in (self.a, self.b, self.c) if v):
            self.validate_inputs(store)
        elif self.output and self.output.startswith("s3://"):
            self.check_output(store)

    def validate_inputs(self, store: ObjectStore | None = None) -> Problem | None:
        """Open the local operands and check shapes, dtypes, flags, the tile and the budget before
        anything starts (S3 operands are checked in the flow, with ``store``).

        Returns:
            The problem (operands opened, nothing computed); None when S3 operands wait for a store.

        Raises:
            InputError: bad parameters or operands.
        """
        self.check_used()
        budget = parse_bytes(self.memory_budget)
        self.check_budget_fits(budget)
        self.check_output(store)
        if any(str(v).startswith("s3://") for v in (self.a, self.b, self.c) if v) and store is None:
            return None
        problem = build_problem(self.kernel_params(), store)
        try:
            check_memory_budget(problem, budget)
            fit_s3_bands(problem, budget)  # an S3 operand's reads hold whole row bands
        except KernelInputError as exc:  # name the value as given (1KiB), not in bytes
            raise InputError("memory_budget", self.memory_budget, f"{budget} bytes are {exc.problem}") from None
        self.check_sizes_given(problem)
        self.check_size(problem)
        return problem

    def check_sizes_given(self, problem: Problem) -> None:
        """Refuse ``m``, ``n``, ``k`` or ``dtype`` given (in the run's parameters or with --set; a
        preset's values do not count) other than the problem has: operand files bring their own
        shapes and dtype (``--set m=1000`` with 512 x 512 files ran a 512 x 512 GEMM, silently:
        a fresh-user trial), SYRK/SYR2K have no ``m`` (their result is n x n) and SYMM/TRMM/TRSM
        no ``k`` (their A is square). Raises InputError."""
        actual = {"m": problem.out_shape[0], "n": problem.out_shape[1], "k": problem.inner,
                  "dtype": str(problem.dtype)}
        files = [f"{name}={getattr(self, name)}" for name in used_operands(self.kernel_params())
                 if getattr(self, name) != "random"]
        routine = self.routine.upper()
        for name in ("m", "n", "k", "dtype"):
            value = getattr(self, name)
            if name not in self.model_fields_set or value == actual[name]:
                continue
            if name == "m" and self.routine in ("syrk", "syr2k"):
                why = f"{routine} does not use it (its result is n x n)"
            elif name == "k" and self.routine in ("symm", "trmm", "trsm"):
                why = f"{routine} does not use it (its A is square: m x m with side=L, n x n with side=R)"
            else:
                why = f"the operands ({', '.join(files)}) give {name}={actual[name]}"
            raise InputError(name, value, f"{why}; leave it out")

    def check_budget_fits(self, budget: int) -> None:
        """A tile cache larger than a worker's memory is refused: on a large problem it would grow
        until the nanny or the kernel killed the worker. Known for the local CPU cluster only (a
        CUDA cluster's tiles live in GPU memory; an existing cluster is known once connected).
        Raises InputError."""
        from dask.utils import format_bytes  # noqa: PLC0415

        settings = get_settings()
        limit = planned_worker_memory(settings)
        if limit is not None and budget > limit:
            workers = planned_worker_count(settings)
            raise InputError("memory_budget", self.memory_budget,
                             f"more than a worker's memory ({format_bytes(limit)}: this machine's "
                             f"{format_bytes(limit * workers)} over {workers} workers); the tile cache could outgrow it")

    def check_output(self, store: ObjectStore | None) -> None:
        """The output must name a ``.npy`` file (replaced if it exists) or an S3 object in an existing bucket,
        not one of the operands. Raises InputError."""
        out = self.output
        if out is None:
            return
        if out.startswith("s3://"):
            key = out[len("s3://"):].partition("/")[2]
            if not key or key.endswith("/"):
                raise InputError("output", out, "name an object, e.g. s3://bucket/path/result.npy")
            if not key.endswith(".npy"):
                raise InputError("output", out, "the result is written as .npy: name the object *.npy")
            if store is not None:
                store.require_bucket("output", out)
            operands = [v for v in (self.a, self.b, self.c) if v]
            if out in operands:
                raise InputError("output", out, "is also an operand: writing it would destroy the input")
            return
        path = Path(out).expanduser().resolve()
        if path.is_dir():
            raise InputError("output", out, "is a directory; name a .npy file")
        # (before the suffix: a link x.npy to the state dir's stack.json was told to name a *.npy: a trial)
        require_outside_state_dir("output", out, path, get_settings().state_dir)
        if path.suffix != ".npy":
            raise InputError("output", out, "the result is written as .npy: name the file *.npy")
        missing = missing_output_directory(path)
        if missing:
            raise InputError("output", out, missing)
        require_writable_dir("output", out, path.parent)  # the result is staged beside it, then renamed
        for name in ("a", "b", "c"):
            spec = getattr(self, name)
            if not spec or spec == "random" or spec.startswith("s3://"):
                continue
            operand = Path(spec).expanduser().resolve()
            # by path, or by file (a hard link to an operand was refused only inside the run: a trial)
            if operand == path or (path.exists() and operand.exists() and os.path.samefile(operand, path)):
                raise InputError("output", out, f"is operand {name}: writing it would destroy the input")

    def worker_paths(self, state_dir: str | Path) -> list[WorkerPath]:
        """The local paths the Dask workers read or write in this run (for
        :func:`~paperline.infra.cluster.require_shared_paths`): ``<state dir>/gemm``, where
        random operands are staged and an S3 output and the scaling sweep's results are written
        (scratch), unless none of them is; the ``.npy`` operands used; a local output's directory
        (the result is written beside it, then renamed)."""
        needs: list[WorkerPath] = []
        used = used_operands(self.kernel_params())
        to_s3 = self.output is None or self.output.startswith("s3://")
        staged = self.stage_random and any(getattr(self, n) == "random" for n in used)
        uses = [what for what, why in (("stages the random operands", staged), ("stages the result for S3", to_s3),
                                       ("writes the scaling sweep's results", self.scaling)) if why]
        if uses:  # said, with how to need none of it (a trial with .npy operands did not see why it was asked)
            needs.append(WorkerPath("PAPERLINE_STATE_DIR", str(state_dir), str(Path(state_dir) / "gemm"), writes=True,
                                    instead=f"set PAPERLINE_STATE_DIR to a directory shared with them (this run "
                                            f"{' and '.join(uses)} there; .npy or s3:// operands, a local output "
                                            "and scaling=false need nothing there)"))
        for name in used:
            spec = getattr(self, name)
            if spec and spec != "random" and not spec.startswith("s3://"):
                needs.append(WorkerPath(name, spec, str(Path(spec).expanduser().resolve()),
                                        instead=f"give {name} as an s3:// URI"))
        if not to_s3:
            assert self.output is not None
            needs.append(WorkerPath("output", self.output, str(Path(self.output).expanduser().resolve().parent),
                                    writes=True, instead="give an s3:// output"))
        return needs

    def check_size(self, problem: Any) -> None:
        """Refuse plans too fine to schedule and data that cannot fit on disk: the staged random
        operands, the staged result and, for an S3 output on the local stack, its copy in
        SeaweedFS, summed per filesystem (``st_dev``) against its free space. Raises InputError
        naming the first need on the filesystem that lacks room (``m`` for staged operands,
        ``output`` for the result, the default output by its URI pattern)."""
        from dask.utils import format_bytes  # noqa: PLC0415

        from paperline.kernels.blas.plan import check_plan_size  # noqa: PLC0415

        check_plan_size(problem)
        (m, n) = problem.out_shape
        item = problem.dtype.itemsize
        settings = get_settings()
        state_dir = Path(settings.state_dir)
        needs: list[tuple[str, object, int, Path, str]] = []  # argument, value, bytes, where, what needs them
        random_bytes = sum(int(np.prod(src.shape)) * item for name, src in problem.operands().items()
                           if getattr(self, name) == "random") if self.stage_random else 0
        if random_bytes:
            needs.append(("m", self.m, random_bytes, state_dir, "the staged random operands"))
        result = f"the {m}x{n} {problem.dtype} result"
        # the default output is not the user's: name it by where it goes, not as output=None
        output = self.output if self.output is not None else "s3://<data bucket>/gemm/<flow run id>/result.npy"
        if output.startswith("s3://"):  # staged under the state dir, then uploaded
            needs.append(("output", output, m * n * item, state_dir, f"{result}, staged for S3,"))
            if settings.s3_endpoint_url is None:  # the local SeaweedFS keeps its objects under the state dir too
                needs.append(("output", output, m * n * item, state_dir / "s3" / "data",
                              "its copy in the local SeaweedFS"))
        else:
            needs.append(("output", output, m * n * item, Path(output).expanduser().resolve().parent, result))
        # Summed per filesystem: operands staged and the result staged beside them each fitted the
        # free space alone while both together filled the disk (a trial).
        by_disk: dict[int, list[tuple[str, object, int, Path, str]]] = {}
        for need in needs:
            by_disk.setdefault(os.stat(nearest_existing(need[3])).st_dev, []).append(need)
        for group in by_disk.values():
            argument, value, _, where, _ = group[0]
            total = sum(need[2] for need in group)
            free = shutil.disk_usage(nearest_existing(where)).free
            if total <= free:
                continue
            if len(group) == 1:
                what = f"{group[0][4]} {'need' if group[0][4].endswith('operands') else 'needs'}"
            else:
                parts = [f"{need[4].rstrip(',')} ({format_bytes(need[2])})" for need in group]
                what = f"{', '.join(parts[:-1])} and {parts[-1]} need together"
            wheres = sorted({str(need[3]) for need in group})
            at = wheres[0] if len(wheres) == 1 else f"{' and '.join(wheres)} (one filesystem)"
            raise InputError(argument, value, f"{what} {format_bytes(total)} on disk at {at}, "
                                              f"{format_bytes(free)} free; lower the sizes")




PRESETS: dict[str, dict[str, Any]] = {
    "demo": {},
    "default": {},  # the flow's own defaults (the same as demo here)
    "full": {"m": 8192, "n": 8192, "k": 8192, "tile": 2048, "memory_budget": "2GiB"},
}


@pipeline_flow(name="gemm", log_prints=True, task_runner=default_task_runner())
def gemm(params: GemmParameters | None = None) -> dict[str, Any]:
    """Run one tiled level-3 BLAS routine on the cluster, verify it and track it in MLflow.

    Returns:
        A summary: GFLOP/s, ratio to the peer, verification, counters, output URI, Prefect and
        MLflow URLs, ``mlflow_params`` (the parameters as the MLflow run records them: the sizes
        that ran, the budget in bytes, the device, the output) and a table for the CLI.

    Raises:
        InputError: bad parameters or operands. VerificationError: the result failed the check
        (nothing written). ServiceError: the stack is not up.
    """
    params = params or GemmParameters()
    configure_local_workers()  # before the runner's local cluster starts (at the first task)
    settings = get_settings()
    info, store = require_stack(settings)
    problem = params.validate_inputs(store)
    if settings.dask_scheduler_address:  # (also for deployments' runs; `paperline run` asked before the flow run)
        require_shared_paths(settings, params.worker_paths(settings.state_dir))
    budget = parse_bytes(params.memory_budget)
    device = array_device(settings.device)
    output = params.output or f"s3://{info.data_bucket}/gemm/{flow_run.id}/result.npy"
    if not output.startswith("s3://"):
        output = str(Path(output).expanduser().resolve())
    tracker = Tracker(info.mlflow_tracking_uri)
    run_url = info.flow_run_url(flow_run.id)
    mlflow_params = {**logged_params(params, problem), "memory_budget_bytes": budget, "device": device, "output": output}
    run_id = tracker.start_run(EXPERIMENT, run_name=flow_run.name or "gemm",
                               tags=prefect_run_tags(info), params=mlflow_params)
    main = None
    try:
        # the sizes that run: random operands beside file ones take the files' (tasks.gemm.implied_sizes)
        kp = {**params.kernel_params(), "m": problem.out_shape[0], "n": problem.out_shape[1], "k": problem.inner,
              "dtype": str(problem.dtype)}
        if params.stage_random and "random" in (params.a, params.b, params.c):
            kp = stage_random_operands(kp, str(Path(settings.state_dir) / "gemm" / "operands"))
        scaling = scaling_sweep(kp, store, budget, device) if params.scaling else []
        peer = single_process_peer(kp, store) if params.peer else None
        replaced = store.exists(output) if output.startswith("s3://") else Path(output).exists()
        main = tiled_multiply(kp, store, output, budget, device)
        tracker.set_tags(run_id, {"problem": main["problem"], "operand_shapes": json.dumps(main["shapes"])})
        # the workers the multiply ran on, in the comparison's key: a run on one worker (a worker
        # lost before the multiply, or PAPERLINE_N_WORKERS=1) was judged against two-worker runs
        # and flagged REGRESSION (an infra trial)
        mlflow_params["dask_workers"] = len(main["workers"])
        tracker.log_params(run_id, {"dask_workers": mlflow_params["dask_workers"]})
        summary = _log_run(tracker, run_id, main, scaling, peer, replaced)
        if main["workers"] != ["local"]:  # (["local"]: no Dask cluster, the flow's own process)
            summary["lines"] += fewer_workers_lines(len(main["workers"]), planned_worker_count(settings))
        versus = check_latest(tracker, run_id, {k: v for k, v in mlflow_params.items() if k != "output"}, HEADLINES)
        summary["lines"] += versus.lines()
        summary["versus_best_earlier"] = versus.as_dict()
        tracker.end_run(run_id, "FINISHED")
    except BaseException as exc:
        if main is not None:  # stopped while logging: the result is whole and verified; say where it is
            print(f"the verified result had been written to {main['output']} before the run stopped")
        tracker.end_failed(run_id, exc)
        raise
    summary.update(prefect_flow_run_id=str(flow_run.id), prefect_flow_run_url=run_url, mlflow_run_id=run_id,
                   mlflow_run_url=tracker.run_url(run_id), mlflow_params=mlflow_params)
    return summary


def fewer_workers_lines(ran_on: int, planned: int | None) -> list[str]:
    """What to say when the multiply ran on fewer Dask workers than the local cluster was started
    with (``planned``: :func:`~paperline.infra.cluster.planned_worker_count`, None for a configured
    scheduler): a worker left the cluster before the multiply began (killed, or out of memory) and
    was not back. Nothing otherwise.

    Returns:
        One line, or none.
    """
    if planned is None or ran_on >= planned:
        return []
    return [f"the multiply ran on {ran_on} of the {planned} Dask workers the cluster was started with (a worker left "
            f"the cluster before it began): its GFLOP/s are compared only with earlier runs on {ran_on} worker(s)"]


def _log_run(tracker: Tracker, run_id: str, main: dict[str, Any], scaling: list[dict[str, Any]],
             peer: dict[str, Any] | None, replaced: bool = False) -> dict[str, Any]:
    c = main["counters"]
    metrics = {  # names: see README "MLflow names" (units in the name)
        "throughput_gflop_per_s": main["gflops"], "wall_s": main["seconds"],
        "bytes_host_to_device": c.get("bytes_host_to_device", 0), "bytes_peer": c.get("bytes_peer", 0),
        "bytes_s3": c.get("bytes_s3", 0), "bytes_source": c.get("bytes_source", 0),
        "cache_hit_rate": main["cache_hit_rate"], "verification_residual": main["verification_residual"],
        "tile_tasks": len(main["records"]),
    }
    for i, w in enumerate(main["workers"]):
        metrics[f"busy_fraction.worker_{i}"] = main["busy_fraction"][w]
    if peer is not None:
        metrics["peer_throughput_gflop_per_s"] = peer["gflops"]
        metrics["ratio_to_peer"] = main["gflops"] / peer["gflops"]
    tracker.log_metrics(run_id, {k: float(v) for k, v in metrics.items()})
    tracker.log_metric_steps(run_id, [(r["workers"], {"scaling.throughput_gflop_per_s": r["gflops"]}) for r in scaling])
    report = render_gemm_report(main, scaling, peer)
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in report.items():
            path = Path(tmp) / name
            path.write_bytes(data)
            tracker.log_artifact(run_id, str(path))
    tracker.log_dict(run_id, {"records": main["records"], "workers": main["workers"], "scaling": scaling,
                              "peer": peer, "counters": c}, "tasks.json")
    rows = [["paperline (tiled)", f"{main['gflops']:.2f}", f"{main['seconds']:.3f}",
             f"{main['gflops'] / peer['gflops']:.3f}" if peer else "-"]]
    if peer:
        rows.append([peer["name"], f"{peer['gflops']:.2f}", f"{peer['seconds']:.3f}", "1.000"])
    rows += [[f"paperline on {r['workers']} worker(s)", f"{r['gflops']:.2f}", f"{r['seconds']:.3f}",
              f"{r['gflops'] / peer['gflops']:.3f}" if peer else "-"] for r in scaling]
    lines = [f"{main['problem']}",
             f"verified (Freivalds): residual {main['verification_residual']:.3g} <= tolerance "
             f"{main['verification_tolerance']:.3g}",
             # S3's bytes are its GETs' (whole row bands, each kept for the band's other tiles), not
             # a part of the tiles' bytes (a trial read 8x the operand's size "from S3")
             f"cache hit rate {main['cache_hit_rate']:.2f}; bytes from sources {c.get('bytes_source', 0)} "
             f"(S3 GETs fetched {c.get('bytes_s3', 0)}), from peers {c.get('bytes_peer', 0)}",
             # an existing file or object is replaced, as documented: it went unsaid (a trial)
             f"output: {main['output']}" + (" (it replaced the file or object that was there)" if replaced else "")]
    if peer:
        lines.append(f"peer BLAS: {peer['blas']}")
    return {"gflops": main["gflops"], "ratio_to_peer": metrics.get("ratio_to_peer"), "metrics": metrics,
            "output": main["output"], "verification_residual": main["verification_residual"],
            "table": {"title": "gemm: throughput", "columns": ["run", "GFLOP/s", "seconds", "ratio to peer"],
                      "rows": rows},
            "lines": lines, "artifacts": {"mlflow": f"runs:/{run_id}/"}}

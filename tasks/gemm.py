"""Prefect tasks of the ``gemm`` pipeline: operands (seeded random, ``.npy`` files, S3 objects), the
tiled run on the cluster with Freivalds verification and an atomic commit of the output, the
scaling sweep, the single-process NumPy/SciPy peer, and the report.

These tasks measure, so they are not cached: a cached GFLOP/s would report an old machine state,
and a cached output would be wrong once its destination is overwritten or deleted. The operands
themselves are either regenerated from a seed or read where they are, so a re-run costs no more
than the multiply.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
from prefect import task
from prefect.cache_policies import NO_CACHE

from paperline.infra.errors import PaperlineError
from paperline.infra.storage import ObjectStore
from paperline.kernels.blas.plan import Problem, make_problem
from paperline.kernels.blas.runtime import DaskRuntime, LocalRuntime, RunResult, owner_tag, run, sweep_leftovers
from paperline.kernels.blas.sources import (NpySource, RandomSource, TileSource, check_matrix_header, check_npy_size,
                                            read_all, read_npy_header)
from paperline.kernels.blas.verify import freivalds
from paperline.kernels.errors import InputError
from paperline.tasks.retry import HOUR, retry_unless, retry_unless_bad_input

HEADER_PROBE_BYTES = 1 << 16


class VerificationError(PaperlineError, RuntimeError):
    """A result failed Freivalds' check (its output was not committed). A PaperlineError: its
    message is the whole story, shown as one line (it came with "run with --debug for the
    traceback", unlike the input errors: a trial)."""


BAND_CACHE_BYTES = 256 << 20  # per process, on top of the tile cache, at most (fit_s3_bands: the memory budget)


class S3NpySource:
    """A ``.npy`` object in S3 read tile by tile with ranged GETs (never downloaded whole).

    A tile read fetches the rows it spans (C order) or the columns (Fortran order) in one ranged
    GET, so its cost is one request and ``tile x cols`` entries.

    Args:
        store: the object store (picklable: the source travels to the workers).
        uri: ``s3://bucket/key.npy``.
        argument: the operand's name for error messages.

    Raises:
        InputError: no such object, not a ``.npy`` array, not a 2-D float32/float64 matrix, or
            shorter than its header promises.
    """

    kind = "s3"
    band_cache_bytes = BAND_CACHE_BYTES  # the bound on this process's kept bands (fit_s3_bands lowers it)

    def __init__(self, store: ObjectStore, uri: str, argument: str = "a"):
        self.store, self.uri = store, uri
        self.where = uri  # what errors about its values name
        head = store.head(uri)
        if head is None:
            store.require_bucket(argument, uri)
            raise InputError(argument, uri, "no such object in S3")
        size = int(head["ContentLength"])
        probe = store.get_range(uri, 0, min(size, HEADER_PROBE_BYTES)) if size else b""
        try:
            shape, fortran, dtype, self.offset = read_npy_header(io.BytesIO(probe))
        except (ValueError, OSError, SyntaxError, EOFError) as exc:
            raise InputError(argument, uri, f"the S3 object is not a .npy array ({exc})") from None
        self.shape = check_matrix_header(argument, uri, shape, dtype)
        self.file_dtype = np.dtype(dtype)
        self.dtype = self.file_dtype.newbyteorder("=")
        self.fortran_order = bool(fortran)
        need = self.offset + self.shape[0] * self.shape[1] * self.file_dtype.itemsize
        check_npy_size(argument, uri, size, need)
        self.key = f"s3:{uri}:{head.get('ETag', '')}"

    def read(self, rows: slice, cols: slice) -> np.ndarray:
        """``M[rows, cols]``, a new C-ordered array of :attr:`dtype` (native byte order), read by a
        ranged GET of the whole row (column, for Fortran order) band, cached per process."""
        return self.read_fetched(rows, cols)[0]

    def read_fetched(self, rows: slice, cols: slice) -> tuple[np.ndarray, int]:
        """:meth:`read`, and the bytes it fetched from S3: the band's, or 0 when the band was
        cached (the runtime's ``bytes_s3``: counting the tiles' bytes said 8x the operand's size
        for an operand read once: a trial)."""
        nrows, ncols = self.shape
        if self.fortran_order:
            c0, c1, _ = cols.indices(ncols)
            band, fetched = self._band(c0, c1, nrows)
            return np.ascontiguousarray(band.T[rows, :], dtype=self.dtype), fetched
        r0, r1, _ = rows.indices(nrows)
        band, fetched = self._band(r0, r1, ncols)
        return np.ascontiguousarray(band[:, cols], dtype=self.dtype), fetched

    def _band(self, start: int, stop: int, width: int) -> tuple[np.ndarray, int]:
        """Rows (C order) or columns (Fortran order) ``[start, stop)`` with one ranged GET, and the
        bytes fetched; the last few bands are kept per process, so the other tiles of a band cost
        no request (0 bytes)."""
        key = (self.key, start, stop)
        with _BANDS_LOCK:
            if key in _BANDS:
                _BANDS.move_to_end(key)
                return _BANDS[key], 0
        item = self.file_dtype.itemsize
        data = self.store.get_range(self.uri, self.offset + start * width * item, self.offset + stop * width * item)
        band = np.frombuffer(data, self.file_dtype).reshape(stop - start, width)
        with _BANDS_LOCK:
            _BANDS[key] = band
            while sum(b.nbytes for b in _BANDS.values()) > self.band_cache_bytes and len(_BANDS) > 1:
                _BANDS.popitem(last=False)
        return band, len(data)


def fit_s3_bands(problem: Problem, memory_budget: int) -> None:
    """Refuse S3 operands whose tile reads would hold more than ``memory_budget`` bytes, and keep
    the bands of the others within ``min(memory_budget, BAND_CACHE_BYTES)`` per process.

    A tile of an S3 operand is read with one ranged GET of its whole row band (``tile`` rows x
    the full width; columns x the full height in Fortran order) and the band is kept in a
    per-process cache beside the tile cache, so that the band's other tiles cost no request. A
    band larger than the budget made a worker's memory far exceed it (128 x 1,000,000 float32,
    tile 128, 8 MiB: 1.1 GiB RSS; 1024 x 1e7 would read 40 GB bands: a trial), so such a run is
    refused before it starts; and the cache, 256 MiB whatever the budget, is bounded by the
    budget too (a worker holds at most twice its budget in operand bytes: tiles and bands).

    Raises:
        InputError: naming ``memory_budget`` (bytes), the operand, its URI and band size, and
            what to do (raise the budget, a smaller tile, or a local ``.npy`` copy, read tile by
            tile through a memory map).
    """
    for name, src in problem.operands().items():
        if not isinstance(src, S3NpySource):
            continue
        rows, cols = src.shape
        edge, width = (min(problem.tile, cols), rows) if src.fortran_order else (min(problem.tile, rows), cols)
        band = edge * width * src.file_dtype.itemsize
        if band > memory_budget:
            order = "columns x its full height (Fortran order)" if src.fortran_order else "rows x its full width"
            raise InputError("memory_budget", memory_budget,
                             f"below the {_mib(band)} band of {name}={src.uri} ({rows}x{cols} {src.dtype}): each "
                             f"tile read fetches {edge} {order}; raise memory_budget above {_mib(band)}, lower "
                             f"the tile, or copy {name} to a local .npy file (read tile by tile)")
        src.band_cache_bytes = min(BAND_CACHE_BYTES, memory_budget)


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


_BANDS: OrderedDict[tuple[str, int, int], np.ndarray] = OrderedDict()
_BANDS_LOCK = threading.Lock()


OPERANDS = ("a", "b", "c")  # their index is the random stream


def used_operands(params: dict[str, Any]) -> list[str]:
    """The operands the routine reads and the parameters give (SYRK has no B, TRMM/TRSM no C)."""
    skip = {"syrk": {"b"}, "trmm": {"c"}, "trsm": {"c"}}.get(params["routine"], set())
    return [name for name in OPERANDS if params[name] is not None and name not in skip]


def random_sources(params: dict[str, Any]) -> dict[str, RandomSource]:
    """The seeded sources of the operands given as ``"random"``, shaped from (m, n, k): k is the
    inner dimension; SYMM/TRMM/TRSM take A's order from ``side``; SYRK/SYR2K produce n x n. A
    random TRSM triangle gets ``n`` added to its diagonal (diagonally dominant, well conditioned).

    Raises:
        InputError: a bad trans/side flag.
    """
    from paperline.kernels.blas.plan import SIDE, TRANS, parse_flag  # noqa: PLC0415

    routine, m, n, k = params["routine"], params["m"], params["n"], params["k"]
    ta, tb = parse_flag("trans_a", params["trans_a"], TRANS), parse_flag("trans_b", params["trans_b"], TRANS)
    if routine == "gemm":
        shapes = {"a": (k, m) if ta else (m, k), "b": (n, k) if tb else (k, n), "c": (m, n)}
    elif routine in ("symm", "trmm", "trsm"):
        na = m if parse_flag("side", params["side"], SIDE) == "L" else n
        shapes = {"a": (na, na), "b": (m, n), "c": (m, n)}
    else:  # syrk, syr2k
        shapes = {"a": (k, n) if ta else (n, k), "b": (k, n) if ta else (n, k), "c": (n, n)}
    return {name: RandomSource(shapes[name], params["dtype"], seed=params["seed"], stream=OPERANDS.index(name),
                               diagonal_shift=float(shapes["a"][0]) if (routine == "trsm" and name == "a") else 0.0,
                               argument=name)
            for name in used_operands(params) if params[name] == "random"}


def implied_sizes(params: dict[str, Any], files: dict[str, TileSource]) -> dict[str, Any]:
    """``m``, ``n``, ``k`` and ``dtype`` as the file (or S3) operands ``files`` fix them, in the
    conventions of :func:`random_sources`, so that random operands beside them conform; the
    first operand (a, b, c) to fix one wins (a conflict between files is make_problem's to name).
    Operands that are not 2-D fix nothing (make_problem refuses them).

    Raises:
        InputError: a bad trans/side flag.
    """
    from paperline.kernels.blas.plan import SIDE, TRANS, parse_flag  # noqa: PLC0415

    routine = params["routine"]
    ta, tb = parse_flag("trans_a", params["trans_a"], TRANS), parse_flag("trans_b", params["trans_b"], TRANS)
    sizes: dict[str, Any] = {}
    for name in OPERANDS:
        src = files.get(name)
        if src is None or len(src.shape) != 2:
            continue
        rows, cols = (int(d) for d in src.shape)
        if routine == "gemm":
            fixed = {"a": {"m": cols if ta else rows, "k": rows if ta else cols},
                     "b": {"k": cols if tb else rows, "n": rows if tb else cols}, "c": {"m": rows, "n": cols}}[name]
        elif routine in ("symm", "trmm", "trsm"):
            left = parse_flag("side", params["side"], SIDE) == "L"
            fixed = {"m" if left else "n": rows} if name == "a" else {"m": rows, "n": cols}
        else:  # syrk, syr2k: op(a) is n x k
            fixed = {"n": rows} if name == "c" else {"n": cols if ta else rows, "k": rows if ta else cols}
        if str(src.dtype) in ("float32", "float64"):  # another one is make_problem's to refuse, naming the file
            fixed["dtype"] = str(src.dtype)
        for key, value in fixed.items():
            sizes.setdefault(key, value)
    return sizes


def operand_source(spec: str, argument: str, store: ObjectStore | None) -> TileSource:
    """The source a file or S3 operand spec names: an ``s3://`` URI or a local ``.npy`` path.

    Raises:
        InputError: what the source refuses (missing, truncated, not an array, ...).
    """
    if spec.startswith("s3://"):
        if store is None:
            raise InputError(argument, spec, "an S3 operand needs the stack's object store")
        return S3NpySource(store, spec, argument)
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", spec):  # http://, gs://, ...: not "no such file"
        raise InputError(argument, spec, "expected 'random', a local .npy path or an s3:// URI")
    return NpySource(spec, argument)


def build_problem(params: dict[str, Any], store: ObjectStore | None) -> Problem:
    """Validate the flow's parameters into a :class:`Problem` (operands opened, nothing computed).

    Raises:
        InputError: bad parameters or operands.
    """
    files = {name: operand_source(params[name], name, store) for name in used_operands(params)
             if params[name] != "random"}
    # random operands take the sizes the files fix (a 300 x 200 a= with b random made b 4096 x
    # 4096, the preset's, refused as "b=(4096, 4096): shape does not conform": a trial)
    srcs: dict[str, TileSource] = {**random_sources({**params, **implied_sizes(params, files)}), **files}
    return make_problem(params["routine"], srcs["a"], srcs.get("b"), srcs.get("c"), alpha=params["alpha"],
                        beta=params["beta"], trans_a=params["trans_a"], trans_b=params["trans_b"],
                        side=params["side"], uplo=params["uplo"], diag=params["diag"], tile=params["tile"])


@task(name="stage-random-operands", cache_policy=NO_CACHE, retries=1, retry_condition_fn=retry_unless_bad_input,
      timeout_seconds=HOUR)
def stage_random_operands(params: dict[str, Any], directory: str) -> dict[str, Any]:
    """Write the ``"random"`` operands of ``params`` to ``.npy`` files under ``directory`` (kept
    and reused by later runs with the same shape, dtype, seed and stream), so that a timed run
    measures the multiply, not the random number generator. Files appear atomically (temporary
    name, then rename).

    Returns:
        ``params`` with each ``"random"`` operand replaced by its file's path.
    """
    out = dict(params)
    Path(directory).mkdir(parents=True, exist_ok=True)
    for name, src in random_sources(params).items():
        path = Path(directory) / (hashlib.sha256(src.key.encode()).hexdigest()[:24] + ".npy")
        if path.exists():
            os.utime(path)  # used now: the last to be evicted
        else:
            tmp = path.with_name(f".{path.name}.{os.getpid()}.partial.npy")
            try:
                target = np.lib.format.open_memmap(tmp, mode="w+", dtype=src.dtype, shape=src.shape)
                band = max(1, (64 << 20) // (src.shape[1] * src.dtype.itemsize))
                for r in range(0, src.shape[0], band):
                    target[r:r + band] = src.read(slice(r, r + band), slice(0, src.shape[1]))
                target.flush()
                del target
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
        out[name] = str(path)
    evict_staged(directory, STAGED_MAX_BYTES)
    return out


STAGED_MAX_BYTES = 8 << 30  # staged random operands kept under the state directory
STAGED_MIN_IDLE_S = 3600.0  # a file used this recently is never evicted (a concurrent run may be opening it)


def evict_staged(directory: str, max_bytes: int, min_idle_s: float = STAGED_MIN_IDLE_S) -> list[str]:
    """Delete the least recently used staged operands until those in ``directory`` total at most
    ``max_bytes`` (files used within ``min_idle_s`` are kept even above it).

    Returns:
        The paths deleted.
    """
    files = []
    for p in Path(directory).glob("*.npy"):
        if p.name.startswith("."):  # a file being written
            continue
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        files.append((st.st_mtime, st.st_size, p))
    total = sum(size for _, size, _ in files)
    now, deleted = time.time(), []
    for mtime, size, p in sorted(files):
        if total <= max_bytes:
            break
        if now - mtime < min_idle_s:
            continue
        p.unlink(missing_ok=True)
        total -= size
        deleted.append(str(p))
    return deleted


UPLOAD_RECORD = "upload.json"  # in a run's scratch directory: the S3 upload of its output under way


def scratch_dir(store: ObjectStore | None = None) -> str:
    """Where staged outputs are written: under the state directory, which must be shared with the
    Dask workers when they run on other hosts (the workers write the output tiles there).

    The scratch directories of runs killed outright (``kill -9``: their cleanup never ran) are
    deleted, and the S3 upload of the output each one records (:data:`UPLOAD_RECORD`) is aborted
    first, so that its parts are not kept (and, on AWS, billed) for ever (an infra trial); one
    whose upload cannot be aborted now (no ``store``, S3 unreachable) is kept for a later run.
    """
    from paperline.infra.settings import get_settings  # noqa: PLC0415

    def abort_upload(entry: Path) -> bool:
        record = entry / UPLOAD_RECORD
        if not record.exists():
            return True
        if store is None:
            return False
        try:
            return store.abort_recorded_upload(record)
        except Exception:  # noqa: BLE001 - best effort: S3 unreachable or refusing; kept for a later run
            return False

    path = Path(get_settings().state_dir) / "gemm" / "scratch"
    path.mkdir(parents=True, exist_ok=True)
    for prefix in ("run-", "scaling-"):
        sweep_leftovers(path, prefix, abort_upload)
    return str(path)


def _runtime(device: str, workers: list[str] | None = None) -> DaskRuntime | LocalRuntime:
    from paperline.tasks.executors import flow_dask_client, wait_for_cluster  # noqa: PLC0415

    client = flow_dask_client()
    if client is None:
        return LocalRuntime(device)
    wait_for_cluster(client)
    return DaskRuntime(client, workers=workers, device=device)


def _summary(result: RunResult) -> dict[str, Any]:
    return {"seconds": result.seconds, "gflops": result.gflops, "flops": result.problem.flops,
            "counters": result.counters, "cache_hit_rate": result.cache_hit_rate,
            "busy_fraction": result.busy_fraction(), "records": result.records, "workers": result.workers}


@task(name="tiled-multiply", cache_policy=NO_CACHE, retries=1,
      retry_condition_fn=retry_unless(InputError, VerificationError), timeout_seconds=12 * HOUR)
def tiled_multiply(params: dict[str, Any], store: ObjectStore | None, output: str, memory_budget: int,
                   device: str) -> dict[str, Any]:
    """Run the tile plan on the cluster (called from the flow: it drives the workers from the flow's
    process), verify it with Freivalds' check, then make the output visible.

    Args:
        params: the flow's parameters (routine, shapes, flags, operand specs, seed, tile, ...).
        store: the object store (S3 operands and outputs).
        output: a local ``.npy`` path or an ``s3://`` URI.
        memory_budget: bytes of tiles each worker may cache.
        device: ``"cpu"`` or ``"cuda"``.

    Returns:
        seconds, GFLOP/s, counters, cache hit rate, per-worker busy fraction, task records, the
        verification residual and tolerance, and the output URI.

    Raises:
        InputError: bad parameters or operand values. VerificationError: the check failed.
        Either way nothing is visible at ``output``.
    """
    problem = build_problem(params, store)
    fit_s3_bands(problem, memory_budget)
    to_s3 = output.startswith("s3://")
    with tempfile.TemporaryDirectory(prefix=f"run-{owner_tag()}-", dir=scratch_dir(store)) as tmp:
        local = os.path.join(tmp, "result.npy") if to_s3 else output
        result = run(problem, _runtime(device), output=local, memory_budget=memory_budget,
                     check_finite=params["check_finite"])
        try:
            check = freivalds(problem, result.result_source(), seed=params["seed"])
            if not check.passed:
                hint = ""
                if not np.isfinite(check.residual) and not params["check_finite"]:
                    hint = ("; the result holds NaN/inf: the operands probably do (run with check_finite=true to "
                            "find the entry)")
                elif not np.isfinite(check.residual):  # finite operands: the values overflowed (a trial)
                    hint = _overflow_hint(problem, result.result_source())
                raise VerificationError(f"Freivalds' check failed: residual {check.residual:.3g} > tolerance "
                                        f"{check.tolerance:.3g}; the output was not written{hint}")
            if to_s3:
                assert store is not None
                store.upload_file_to(result.staged_path, output, record=os.path.join(tmp, UPLOAD_RECORD))
            else:
                result.commit()
        finally:
            result.abort()
    return {**_summary(result), "verification_residual": check.residual, "verification_tolerance": check.tolerance,
            "output": output, "problem": problem.describe(),
            "shapes": {k: list(v.shape) for k, v in problem.operands().items()}}


def _overflow_hint(problem: Problem, result: TileSource) -> str:
    """What a non-finite residual means when the operands were checked finite: the result's
    first non-finite entry, which the product's magnitude (or, for TRSM, a near-zero diagonal
    entry of A) pushed past the dtype's range; or, the result finite, the float64 projection's
    own overflow. The check's bare "residual inf" read as paperline computing wrongly (a trial:
    operands scaled by 1e200; a TRSM diagonal of 1e-320)."""
    rows, cols = result.shape
    band = max(1, (64 << 20) // max(1, cols * result.dtype.itemsize))
    for r0 in range(0, rows, band):
        block = result.read(slice(r0, min(rows, r0 + band)), slice(0, cols))
        bad = ~np.isfinite(block)
        if bad.any():
            i, j = np.argwhere(bad)[0]
            why = " or a near-zero diagonal entry of a made the solve overflow" if problem.routine == "trsm" else ""
            return (f"; the result holds C[{r0 + i},{j}] = {block[i, j]} from finite operands (check_finite is on): "
                    f"the values overflowed {result.dtype}'s range (largest {np.finfo(result.dtype).max:.3g}){why}")
    return ("; the result is finite but projecting the operands overflowed float64 (operand values near "
            f"{np.finfo(np.float64).max:.3g})")


@task(name="scaling-sweep", cache_policy=NO_CACHE, retries=1, retry_condition_fn=retry_unless_bad_input,
      timeout_seconds=12 * HOUR)
def scaling_sweep(params: dict[str, Any], store: ObjectStore | None, memory_budget: int, device: str
                  ) -> list[dict[str, Any]]:
    """GFLOP/s of the same problem on 1, 2, ... W workers (the output written to a scratch file).

    Returns:
        ``[{"workers": w, "seconds": s, "gflops": g}, ...]`` (one row on a single-process runtime).
    """
    problem = build_problem(params, store)
    fit_s3_bands(problem, memory_budget)
    rt = _runtime(device)
    all_workers = rt.workers()
    rows = []
    with tempfile.TemporaryDirectory(prefix=f"scaling-{owner_tag()}-", dir=scratch_dir(store)) as tmp:
        for w in range(1, len(all_workers) + 1):
            sub = _runtime(device, all_workers[:w]) if w < len(all_workers) else rt
            # checked as the main run is: operands with NaN/inf were refused only after the sweep
            # and the peer had run on them (a trial), which costs the tile reads' isfinite alone
            res = run(problem, sub, output=os.path.join(tmp, f"r{w}.npy"), memory_budget=memory_budget,
                      check_finite=bool(params.get("check_finite", True)))
            res.abort()
            rows.append({"workers": w, "seconds": res.seconds, "gflops": res.gflops})
    return rows


PEER_MAX_BYTES = 4 << 30


@task(name="single-process-peer", cache_policy=NO_CACHE, retries=1, retry_condition_fn=retry_unless_bad_input,
      timeout_seconds=12 * HOUR)
def single_process_peer(params: dict[str, Any], store: ObjectStore | None) -> dict[str, Any] | None:
    """The peer on the same operands in this process with all cores: ``numpy.matmul`` for GEMM
    (NumPy's OpenBLAS), the ``scipy.linalg.blas`` routine otherwise (SciPy's own OpenBLAS), each
    with its BLAS set to one thread per core for the call (threadpoolctl). None when the operands
    would exceed :data:`PEER_MAX_BYTES`.

    Returns:
        ``{"name", "seconds", "gflops", "blas"}`` (``blas``: threadpoolctl's view of the library).
    """
    import scipy.linalg.blas as sblas  # noqa: PLC0415
    from threadpoolctl import threadpool_info, threadpool_limits  # noqa: PLC0415

    problem = build_problem(params, store)
    ops = problem.operands()
    if sum(int(np.prod(s.shape)) * s.dtype.itemsize for s in ops.values()) > PEER_MAX_BYTES:
        return None
    arrays = {k: read_all(s) for k, s in ops.items()}
    p = problem
    pre = "s" if p.dtype == np.float32 else "d"
    lower, side = int(p.lower), int(p.side == "R")
    calls = {
        "gemm": lambda: np.matmul(arrays["a"].T if p.trans_a else arrays["a"], arrays["b"].T if p.trans_b else arrays["b"]),
        "symm": lambda: sblas.__dict__[pre + "symm"](p.alpha, arrays["a"], arrays["b"], side=side, lower=lower),
        "syrk": lambda: sblas.__dict__[pre + "syrk"](p.alpha, arrays["a"], trans=int(p.trans_a), lower=lower),
        "syr2k": lambda: sblas.__dict__[pre + "syr2k"](p.alpha, arrays["a"], arrays["b"], trans=int(p.trans_a), lower=lower),
        "trmm": lambda: sblas.__dict__[pre + "trmm"](p.alpha, arrays["a"], arrays["b"], side=side, lower=lower,
                                                      trans_a=int(p.trans_a), diag=int(p.unit_diagonal)),
        "trsm": lambda: sblas.__dict__[pre + "trsm"](p.alpha, arrays["a"], arrays["b"], side=side, lower=lower,
                                                      trans_a=int(p.trans_a), diag=int(p.unit_diagonal)),
    }
    owner = "numpy" if p.routine == "gemm" else "scipy"  # the library whose BLAS the peer calls
    # (NaN/inf operands with check_finite off: the main run's verification says so; not NumPy's warnings)
    with threadpool_limits(limits=os.cpu_count() or 1, user_api="blas"), np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        start = time.perf_counter()
        calls[p.routine]()
        seconds = time.perf_counter() - start
        blas = [f"{i.get('internal_api')} {i.get('version')} ({i.get('num_threads')} threads, {i.get('architecture')})"
                for i in threadpool_info() if i.get("user_api") == "blas" and _bundled_by(i.get("filepath"), owner)]
    name = "numpy.matmul" if p.routine == "gemm" else f"scipy.linalg.blas.{pre}{p.routine}"
    return {"name": name, "seconds": seconds, "gflops": p.flops / seconds / 1e9, "blas": "; ".join(blas)}


def _bundled_by(filepath: object, package: str) -> bool:
    """``filepath`` is a library that wheel ``package`` bundles (``.../numpy.libs/...``) or holds.
    A substring test matched NumPy's ``libscipy_openblas64_`` for SciPy: the peer line listed
    both OpenBLAS builds, in an order that changed run to run (a trial)."""
    parts = Path(str(filepath or "")).parts
    return f"{package}.libs" in parts or package in parts


@task(name="render-gemm-report", cache_policy=NO_CACHE, retries=1, timeout_seconds=HOUR)
def render_gemm_report(run_summary: dict[str, Any], scaling: list[dict[str, Any]], peer: dict[str, Any] | None
                       ) -> dict[str, bytes]:
    """The run's plots as PNG bytes: ``timeline.png`` (tile tasks per worker over time) and
    ``scaling.png`` (GFLOP/s against workers, with linear scaling and the peer)."""
    from paperline.tasks.reporting import gemm_scaling_plot, task_timeline_plot  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        task_timeline_plot(run_summary["records"], run_summary["workers"], out / "timeline.png")
        gemm_scaling_plot(scaling, peer, out / "scaling.png")
        return {p.name: p.read_bytes() for p in sorted(out.iterdir())}

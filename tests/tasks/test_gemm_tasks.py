"""The gemm pipeline's tasks against the real S3 of the session stack: ranged reads of .npy
objects (C and Fortran order), refusing objects that are not arrays, and a result that fails
Freivalds' check is never made visible."""

import io

import numpy as np
import pytest

from paperline.infra.storage import ObjectStore
from paperline.kernels.blas import make_problem
from paperline.kernels.blas.runtime import run
from paperline.kernels.errors import InputError
from paperline.tasks.gemm import S3NpySource, build_problem

pytestmark = pytest.mark.stack


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


@pytest.fixture(scope="module")
def store(stack):
    _, info = stack
    return ObjectStore.from_stack(info), info.data_bucket


def _put(store, bucket, key, data: bytes) -> str:
    store.client.put_object(Bucket=bucket, Key=key, Body=data)
    return f"s3://{bucket}/{key}"


@pytest.mark.parametrize("order", ["C", "F"])
def test_s3_operands_stream_tiles_and_match_numpy(store, order):
    s, bucket = store
    rng = np.random.default_rng(1)
    a = np.asarray(rng.standard_normal((70, 45)), order=order)
    b = np.asarray(rng.standard_normal((45, 33)), order=order)
    ua = _put(s, bucket, f"tests/gemm/a-{order}.npy", _npy(a))
    ub = _put(s, bucket, f"tests/gemm/b-{order}.npy", _npy(b))
    problem = make_problem("gemm", S3NpySource(s, ua, "a"), S3NpySource(s, ub, "b"), tile=16)
    from paperline.tasks import gemm as gemm_tasks

    gemm_tasks._BANDS.clear()
    result = run(problem, memory_budget=6 * 16 * 16 * 8)  # one task's working set: tiles read again when evicted
    np.testing.assert_allclose(result.output, a @ b, rtol=1e-12, atol=1e-12)
    # each band fetched once and kept for its other tiles: the operands' bytes, not the tiles' (8x: a trial)
    assert result.counters["bytes_s3"] == a.nbytes + b.nbytes
    assert result.counters["bytes_source"] > a.nbytes + b.nbytes


@pytest.mark.parametrize("body, problem", [
    (b"hello, not an array", "not a .npy array"),
    (_npy(np.zeros((3, 3, 3))), "expected a 2-D matrix"),
    (_npy(np.zeros((4, 4), dtype=np.int64)), "expected float32 or float64"),
    (_npy(np.zeros((64, 64)))[:-100], "truncated"),
    (_npy(np.zeros((64, 64))) + b"junk", "4 bytes follow the array its header describes"),
])
def test_an_s3_object_that_is_not_a_float_matrix_is_refused(store, body, problem):
    s, bucket = store
    uri = _put(s, bucket, "tests/gemm/bad.npy", body)
    with pytest.raises(InputError) as err:
        S3NpySource(s, uri, "b")
    assert problem in str(err.value) and "b=" in str(err.value) and uri in str(err.value)


def test_a_missing_s3_operand_is_refused(store):
    s, bucket = store
    with pytest.raises(InputError, match="no such object"):
        S3NpySource(s, f"s3://{bucket}/tests/gemm/missing.npy", "a")
    with pytest.raises(InputError, match="no such bucket 'no-such-bucket-xyz'"):
        S3NpySource(s, "s3://no-such-bucket-xyz/a.npy", "a")


def test_a_directory_given_as_an_operand_is_named_as_such(tmp_path):
    from paperline.kernels.blas.sources import NpySource

    with pytest.raises(InputError, match="is a directory"):
        NpySource(tmp_path, "a")


def _params(**kw):
    from paperline.flows.gemm import GemmParameters

    return GemmParameters(m=90, n=70, k=50, tile=32, **kw).kernel_params()


def test_a_corrupted_result_fails_verification_and_is_not_written(store, tmp_path, monkeypatch):
    """Silent data corruption (one tile of the staged output overwritten after the tasks wrote it)
    is what Freivalds' check exists for: the task fails and the output path stays empty."""
    import paperline.tasks.gemm as tg

    real_run = tg.run

    def corrupting_run(*args, **kwargs):
        result = real_run(*args, **kwargs)
        staged = np.load(result.staged_path, mmap_mode="r+")
        staged[32:64, 0:32] += 1.0
        staged.flush()
        return result

    monkeypatch.setattr(tg, "run", corrupting_run)
    s, _ = store
    out = tmp_path / "c.npy"
    with pytest.raises(tg.VerificationError, match="Freivalds"):
        tg.tiled_multiply.fn(_params(), s, str(out), 1 << 26, "cpu")
    assert list(tmp_path.iterdir()) == []


def test_a_result_that_overflows_from_finite_operands_is_said_so(store, tmp_path):
    """Operands scaled by 1e200 (finite, checked) multiply past float64's range: the check's bare
    "residual inf > tolerance" read as paperline computing wrongly (a trial). It names the entry."""
    import paperline.tasks.gemm as tg
    from paperline.flows.gemm import GemmParameters

    s, _ = store
    np.save(tmp_path / "a.npy", np.full((40, 20), 1e200))
    np.save(tmp_path / "b.npy", np.full((20, 30), 1e200))
    params = GemmParameters(a=str(tmp_path / "a.npy"), b=str(tmp_path / "b.npy"), tile=16).kernel_params()
    out = tmp_path / "c.npy"
    with pytest.raises(tg.VerificationError, match=r"residual (inf|nan) > tolerance .*; the result holds C\[0,0\] = "
                                                   r"inf from finite operands \(check_finite is on\): the values "
                                                   r"overflowed float64's range \(largest 1\.8e\+308\)$"):
        tg.tiled_multiply.fn(params, s, str(out), 1 << 26, "cpu")
    assert not out.exists()


def test_the_task_writes_a_verified_result_to_a_local_path(store, tmp_path):
    import paperline.tasks.gemm as tg
    from paperline.kernels.blas.sources import read_all

    s, _ = store
    out = tmp_path / "c.npy"
    summary = tg.tiled_multiply.fn(_params(routine="trsm", side="R", uplo="L"), s, str(out), 1 << 26, "cpu")
    assert summary["verification_residual"] <= summary["verification_tolerance"]
    problem = build_problem(_params(routine="trsm", side="R", uplo="L"), s)
    x = np.load(out)
    np.testing.assert_allclose(x @ np.tril(read_all(problem.a)), read_all(problem.b), rtol=1e-10, atol=1e-10)
    assert [p.name for p in tmp_path.iterdir()] == ["c.npy"]


@pytest.mark.parametrize("output, problem", [
    ("s3://no-such-bucket-xyz/c.npy", "no such bucket"),
    ("s3://paperline-data", "name an object"),
    ("s3://paperline-data/out/", "name an object"),
    ("s3://paperline-data/out/c.txt", "*.npy"),
])
def test_s3_outputs_are_checked_before_anything_runs(store, output, problem):
    from paperline.flows.gemm import GemmParameters
    from paperline.infra.errors import InputError as PaperlineInputError

    s, _ = store
    with pytest.raises(PaperlineInputError) as err:
        GemmParameters(m=64, n=64, k=64, tile=32, output=output).validate_inputs(s)
    assert problem in str(err.value) and output in str(err.value)


def test_big_endian_operands_are_read_in_native_order(store, tmp_path):
    s, bucket = store
    rng = np.random.default_rng(4)
    a = rng.standard_normal((40, 30)).astype(">f8")
    b = rng.standard_normal((30, 20))
    np.save(tmp_path / "a.npy", a)
    ub = _put(s, bucket, "tests/gemm/b-be.npy", _npy(b.astype(">f8")))
    from paperline.kernels.blas.sources import NpySource

    problem = make_problem("gemm", NpySource(tmp_path / "a.npy"), S3NpySource(s, ub, "b"), tile=16)
    np.testing.assert_allclose(run(problem).output, a.astype(np.float64) @ b, rtol=1e-12, atol=1e-12)


def test_staging_writes_only_the_random_operands_the_routine_reads(tmp_path):
    import paperline.tasks.gemm as tg
    from paperline.kernels.blas.sources import RandomSource, read_all

    params = _params(routine="syrk", trans_a="T", c="random")  # SYRK reads A (k x n) and C (n x n), never B
    staged = tg.stage_random_operands.fn(params, str(tmp_path))
    assert staged["b"] == "random" and sorted(p.name for p in tmp_path.iterdir()) == sorted(
        {staged["a"].rsplit("/", 1)[1], staged["c"].rsplit("/", 1)[1]})
    np.testing.assert_array_equal(np.load(staged["a"]), read_all(RandomSource((50, 70), "float64", seed=0, stream=0)))
    assert np.load(staged["c"]).shape == (70, 70)
    again = tg.stage_random_operands.fn(params, str(tmp_path))  # reused, not rewritten
    assert again == staged and len(list(tmp_path.iterdir())) == 2


def test_staged_operands_are_evicted_least_recently_used_first(tmp_path):
    """The staged random operands would otherwise grow without bound under the state directory
    (a user found 259 MB after one session): beyond the cap the least recently used go, except
    files used within the last hour (a concurrent run may be opening them)."""
    import os
    import time

    import paperline.tasks.gemm as tg

    now = time.time()
    for i, age_h in enumerate([5, 3, 2, 0]):  # 1000 bytes each; file 3 just used
        path = tmp_path / f"f{i}.npy"
        path.write_bytes(b"x" * 1000)
        os.utime(path, (now - age_h * 3600, now - age_h * 3600))
    (tmp_path / ".f9.npy.123.partial.npy").write_bytes(b"x" * 5000)  # being written: never touched
    assert tg.evict_staged(str(tmp_path), 2500) == [str(tmp_path / "f0.npy"), str(tmp_path / "f1.npy")]
    assert tg.evict_staged(str(tmp_path), 0) == [str(tmp_path / "f2.npy")]  # f3 is too recent
    assert sorted(p.name for p in tmp_path.iterdir()) == [".f9.npy.123.partial.npy", "f3.npy"]


def test_the_peer_runs_on_every_core_whatever_the_environment_set():
    """The SYMM..TRSM peer calls SciPy's own OpenBLAS, which a flow process used to load after
    Dask's nanny had set OPENBLAS_NUM_THREADS=1: it ran on one core and paperline's ratio to it
    was inflated. The peer sets its BLAS to one thread per core for the call."""
    import os
    import subprocess
    import sys

    code = """
import os
from paperline.flows.gemm import GemmParameters
from paperline.tasks.gemm import single_process_peer
for routine in ("gemm", "syrk"):
    params = GemmParameters(routine=routine, m=300, n=300, k=200, tile=64).kernel_params()
    print(single_process_peer.fn(params, None)["blas"])
"""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    numpy_line, scipy_line = out.stdout.strip().splitlines()[-2:]
    assert f"({os.cpu_count()} threads" in scipy_line, out.stdout
    # the library the peer called, alone: both OpenBLAS builds were listed, NumPy's
    # libscipy_openblas64_ taken for SciPy's by a substring test (a trial)
    import scipy.linalg.blas  # noqa: F401 - loaded, so that threadpoolctl sees its OpenBLAS
    from threadpoolctl import threadpool_info

    versions = {lib: i["version"] for i in threadpool_info() if i.get("user_api") == "blas"
                for lib in ("numpy", "scipy") if f"/{lib}.libs/" in i["filepath"]}
    assert ";" not in numpy_line and ";" not in scipy_line, out.stdout
    if versions.get("numpy") != versions.get("scipy"):
        assert f" {versions['numpy']} (" in numpy_line and f" {versions['scipy']} (" in scipy_line, (versions, out.stdout)


def test_mlflow_records_the_operands_sizes_and_dtype_not_unused_defaults(tmp_path):
    """With .npy operands m, n, k and dtype are the operands' (a user's `paperline compare`
    showed m=n=k=4096 float64 for a 300 x 200 float32 run); random GEMM operands keep them as given."""
    from paperline.flows.gemm import GemmParameters, logged_params

    np.save(tmp_path / "a.npy", np.ones((300, 130), np.float32))
    np.save(tmp_path / "b.npy", np.ones((130, 200), np.float32))
    p = GemmParameters(a=str(tmp_path / "a.npy"), b=str(tmp_path / "b.npy"), tile=64)
    assert {k: logged_params(p, p.validate_inputs())[k] for k in ("m", "n", "k", "dtype")} == \
        {"m": 300, "n": 200, "k": 130, "dtype": "float32"}
    random = GemmParameters(m=90, n=70, k=50, tile=32)
    assert logged_params(random, random.validate_inputs()) == random.model_dump()
    # a routine's unused size is recorded as what it ran with: SYRK's m is n, TRSM's k is A's order
    syrk = GemmParameters(routine="syrk", n=70, k=50, tile=32)
    assert {k: logged_params(syrk, syrk.validate_inputs())[k] for k in "mnk"} == {"m": 70, "n": 70, "k": 50}
    trsm = GemmParameters(routine="trsm", side="R", m=90, n=70, tile=32)
    assert {k: logged_params(trsm, trsm.validate_inputs())[k] for k in "mnk"} == {"m": 90, "n": 70, "k": 70}


@pytest.mark.parametrize("routine, files, extra, shapes", [
    # a=300x200 file, b random: b was 4096 x 4096 (the preset's k, n), refused as "b=(4096, 4096)"
    ("gemm", {"a": (300, 200)}, {"n": 60}, {"a": (300, 200), "b": (200, 60)}),
    ("gemm", {"a": (200, 300)}, {"trans_a": "T", "trans_b": "T", "n": 60}, {"a": (200, 300), "b": (60, 200)}),
    ("gemm", {"a": (300, 200), "b": (200, 250)}, {"c": "random", "beta": 1.0}, {"c": (300, 250)}),
    ("syrk", {"a": (300, 200)}, {"c": "random", "beta": 1.0}, {"c": (300, 300)}),
    ("syr2k", {"b": (300, 200)}, {"trans_a": "T"}, {"a": (300, 200)}),  # B's shape fixes a random A
    ("trsm", {"b": (120, 90)}, {"side": "R"}, {"a": (90, 90)}),
    ("symm", {"a": (80, 80)}, {}, {"b": (80, 4096)}),  # n is not fixed by the files: the parameter's
])
def test_random_operands_take_the_sizes_the_files_fix(tmp_path, routine, files, extra, shapes):
    """A random operand beside file operands is shaped from the files (and their dtype), not from
    the m, n, k parameters (a fresh-user trial)."""
    from paperline.flows.gemm import GemmParameters

    rng = np.random.default_rng(0)
    params = GemmParameters(**{"routine": routine, "tile": 64, "dtype": "float64", **extra}).kernel_params()
    for name, shape in files.items():
        path = tmp_path / f"{name}.npy"
        np.save(path, rng.standard_normal(shape).astype(np.float32))
        params[name] = str(path)
    problem = build_problem(params, None)
    assert problem.dtype == np.float32
    for name, shape in shapes.items():
        assert tuple(problem.operands()[name].shape) == shape, (name, problem.describe())


class _OneObjectStore:
    """An object store holding one .npy object in memory: enough for S3NpySource's header and
    range reads, without the stack."""

    def __init__(self, data: bytes):
        self.data = data

    def head(self, uri):
        return {"ContentLength": len(self.data), "ETag": "e"}

    def get_range(self, uri, start, stop):
        return self.data[start:stop]


@pytest.mark.parametrize("fortran", [False, True], ids=["C", "F"])
def test_s3_operand_bands_above_the_memory_budget_are_refused_up_front(fortran):
    """A tile read fetches a whole band (tile rows x the full width, or columns x the full height):
    128 x 100000 float32 at tile 128 is a 48.8 MiB band, which an 8 MiB budget did not bound (a
    worker reached 1.1 GiB RSS on 128 x 1e6: a trial)."""
    from paperline.tasks.gemm import fit_s3_bands

    wide = np.zeros((128, 100_000), np.float32)
    a = S3NpySource(_OneObjectStore(_npy(np.asfortranarray(wide.T) if fortran else wide)),
                    "s3://bucket/wide.npy", "a")
    b = np.zeros((a.shape[1], 8), np.float32) if not fortran else np.zeros((128, 8), np.float32)
    problem = make_problem("gemm", a, b, tile=128)
    with pytest.raises(InputError, match=r"below the 48\.8 MiB band of a=s3://bucket/wide\.npy .* raise "
                                         r"memory_budget above 48\.8 MiB, lower the tile, or copy a") as e:
        fit_s3_bands(problem, 8 << 20)
    assert e.value.argument == "memory_budget" and e.value.value == 8 << 20
    fit_s3_bands(problem, 64 << 20)
    fit_s3_bands(make_problem("gemm", a, b, tile=16), 8 << 20)  # 6.1 MiB bands
    # and the bands kept per process fit the budget too (256 MiB whatever the budget before: a review)
    from paperline.tasks import gemm as gemm_tasks

    gemm_tasks._BANDS.clear()
    edge = (slice(0, 16), slice(0, 16))
    second = (slice(16, 32), slice(0, 16)) if not fortran else (slice(0, 16), slice(16, 32))  # the next band
    for where in (edge, second):
        a.read(*where)
    assert len(gemm_tasks._BANDS) == 1 and a.band_cache_bytes == 8 << 20
    a.band_cache_bytes = gemm_tasks.BAND_CACHE_BYTES
    a.read(*edge)
    assert len(gemm_tasks._BANDS) == 2  # (both 6.1 MiB bands kept under the default bound)
    gemm_tasks._BANDS.clear()


def test_an_s3_header_with_a_negative_dimension_is_an_invalid_header_not_an_empty_matrix():
    """As for a local file: NumPy's parser takes (-3, 5), reported as "an empty matrix" (a trial)."""
    body = _npy(np.zeros((3, 5))).replace(b"(3, 5)", b"(-3, 5)")
    with pytest.raises(InputError, match=r"^b='s3://bucket/neg\.npy': the header's shape \(-3, 5\) is invalid "
                                         r"\(a negative dimension\)$"):
        S3NpySource(_OneObjectStore(body), "s3://bucket/neg.npy", "b")

"""The tiled BLAS runtime (kernels/blas/runtime.py, worker.py): out-of-core runs from ``.npy`` files
at the smallest memory budget, staged output files, the L1 cache counters, locality-aware
scheduling, peer fetch, cleanup after failures, and the Dask runtime on a two-process LocalCluster.
"""

from __future__ import annotations

import errno
import os
import signal
import time
import uuid
import warnings
from pathlib import Path

import numpy as np
import pytest

from paperline.kernels.blas.plan import make_problem, n_tiles, plan_tasks
from paperline.kernels.blas.runtime import WORKING_SET_TILES, DaskRuntime, LocalityScheduler, OutputSource, run
from paperline.kernels.blas.sources import NpySource, RandomSource, read_all
from paperline.kernels.blas.verify import freivalds
from paperline.kernels.blas.worker import _STATES, FREE_BUFFERS, OutputFile, RunContext, execute, release_run
from paperline.kernels.errors import InputError

M, N, K, TILE = 1000, 777, 513, 256
ALPHA, BETA = 1.5, -0.75


def rand(shape, dtype, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def triangular_operand(n, dtype, seed):
    return (rand((n, n), np.float64, seed) / np.sqrt(n) + 2.0 * np.eye(n)).astype(dtype)


def min_budget(dtype):
    return WORKING_SET_TILES * TILE * TILE * np.dtype(dtype).itemsize


def loads(result):
    return result.counters["hits"] + result.counters["misses"]


def assert_same(got, want, dtype):
    """Equal up to the dtype's rounding, relative to the result's scale: the same tiles on
    another process may take another BLAS kernel or thread split (OPENBLAS_CORETYPE, one thread
    per Dask worker), which moves float32 entries near zero by a few ulps of the largest."""
    rtol = 1e-12 if np.dtype(dtype) == np.float64 else 1e-5
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * float(np.abs(want).max()))


# The cases run out of core: (routine, dtype, operands(dtype) -> dict, make_problem flags)
CASES = {
    "gemm-fp64": ("gemm", np.float64, lambda d: {"a": rand((K, M), d, 1), "b": rand((K, N), d, 2),
                                                 "c": rand((M, N), d, 3)},
                  {"alpha": ALPHA, "beta": BETA, "trans_a": "T"}),
    "syr2k-fp64": ("syr2k", np.float64, lambda d: {"a": rand((N, K), d, 1), "b": rand((N, K), d, 2),
                                                   "c": rand((N, N), d, 3)},
                   {"alpha": ALPHA, "beta": BETA, "uplo": "L"}),
    "trsm-L-fp64": ("trsm", np.float64, lambda d: {"a": triangular_operand(M, d, 1), "b": rand((M, N), d, 2)},
                    {"alpha": ALPHA, "side": "L", "uplo": "L"}),
    "trsm-R-fp32": ("trsm", np.float32, lambda d: {"a": triangular_operand(N, d, 1), "b": rand((M, N), d, 2)},
                    {"alpha": ALPHA, "side": "R", "uplo": "U", "trans_a": "T"}),
}


def _save(tmp_path, arrays):
    """The operands as .npy files (b in Fortran order: the header's fortran_order is honoured)."""
    paths = {}
    for name, arr in arrays.items():
        paths[name] = str(tmp_path / f"{name}.npy")
        np.save(paths[name], np.asfortranarray(arr) if name == "b" else arr)
    return paths


# --- 2. out of core -------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_out_of_core_run_equals_in_core(tmp_path, case):
    routine, dtype, make, flags = CASES[case]
    arrays = make(dtype)
    in_core = run(make_problem(routine, **arrays, **flags, tile=TILE))  # default budget: 1 GiB
    paths = _save(tmp_path, arrays)
    problem = make_problem(routine, **paths, **flags, tile=TILE)
    assert {s.kind for s in problem.operands().values()} == {"file"}
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    final = out_dir / "result.npy"

    res = run(problem, output=str(final), memory_budget=min_budget(dtype))

    assert res.output is None
    staged = Path(res.staged_path)
    assert res.final_path == str(final.resolve())
    assert not final.exists(), "the result is visible before commit()"
    assert staged.parent == out_dir and ".partial" in staged.name and staged.name.startswith(".")
    assert sorted(os.listdir(out_dir)) == [staged.name]
    assert freivalds(problem, res.result_source()).passed  # verifiable while staged
    assert res.commit() == str(final.resolve())
    assert final.exists() and not staged.exists()
    assert sorted(os.listdir(out_dir)) == ["result.npy"]
    assert res.commit() == str(final.resolve())  # idempotent
    got = np.load(final)
    assert got.dtype == np.dtype(dtype) and got.shape == in_core.output.shape
    assert_same(got, in_core.output, dtype)
    assert freivalds(problem, res.result_source()).passed  # and after commit
    # the same tile loads, but the small cache evicts: more of them miss
    assert loads(res) == loads(in_core)
    assert res.counters["misses"] > in_core.counters["misses"]
    assert res.cache_hit_rate < in_core.cache_hit_rate


def test_npy_tiles_are_read_only_views_of_the_map_and_big_endian_files_are_converted(tmp_path):
    a = rand((300, 200), np.float64, 5)
    np.save(tmp_path / "a.npy", a)
    src = NpySource(tmp_path / "a.npy", "a")
    tile = src.read(slice(100, 200), slice(50, 150))
    assert type(tile) is np.ndarray and not tile.flags.writeable  # BLAS reads the page cache in place
    assert np.shares_memory(tile, src.memmap())
    np.testing.assert_array_equal(tile, a[100:200, 50:150])
    np.save(tmp_path / "be.npy", a.astype(">f8"))
    big = NpySource(tmp_path / "be.npy", "a")
    tile = big.read(slice(100, 200), slice(50, 150))
    assert tile.dtype == np.dtype("=f8") and not np.shares_memory(tile, big.memmap())
    np.testing.assert_array_equal(tile, a[100:200, 50:150])


def test_array_tiles_are_read_only_views_and_the_caller_array_stays_writable():
    from paperline.kernels.blas.sources import ArraySource

    a = rand((300, 200), np.float32, 6)
    tile = ArraySource(a, "a").read(slice(100, 200), slice(50, 150))
    assert np.shares_memory(tile, a) and not tile.flags.writeable and a.flags.writeable
    np.testing.assert_array_equal(tile, a[100:200, 50:150])


@pytest.mark.parametrize("threads", [1, 3])
def test_copy_parallel_copies_strided_tiles_in_row_blocks(monkeypatch, threads):
    from paperline.kernels.blas import namespace

    monkeypatch.setattr(namespace, "COPY_THREADS", threads)
    monkeypatch.setattr(namespace, "PARALLEL_COPY_BYTES", 0)
    big = rand((301, 250), np.float64, 7)
    for src in (big[1:300:2, 3:203], big[:7, :5], big[:1, :]):  # strided, rows not a multiple, one row
        dst = np.full(src.shape, np.nan)
        namespace.copy_parallel(dst, src)
        np.testing.assert_array_equal(dst, src)
    with pytest.raises(ValueError, match="shapes differ"):
        namespace.copy_parallel(np.empty((2, 3)), np.empty((3, 2)))


def test_output_file_writes_edge_and_full_width_tiles_in_place(tmp_path):
    path = str(tmp_path / "c.npy")
    np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(70, 50)).flush()
    want = np.zeros((70, 50), np.float32)
    out = OutputFile(path)
    for r0, c0, rows, cols in [(0, 0, 32, 32), (64, 32, 6, 18), (32, 0, 32, 50)]:
        tile = rand((rows, cols), np.float32, r0 + c0)
        out.write(r0, c0, tile.T.copy().T)  # a Fortran-ordered tile is written row by row all the same
        want[r0:r0 + rows, c0:c0 + cols] = tile
    out.close()
    np.testing.assert_array_equal(np.load(path), want)
    np.save(tmp_path / "f.npy", np.asfortranarray(want))
    with pytest.raises(ValueError, match="C-ordered"):
        OutputFile(str(tmp_path / "f.npy"))


def test_scratch_buffers_are_reused_across_tasks_but_never_the_returned_tile(tmp_path):
    arrays = CASES["gemm-fp64"][2](np.float64)
    problem = make_problem("gemm", **_save(tmp_path, arrays), alpha=ALPHA, beta=BETA, trans_a="T", tile=TILE)
    ctx = RunContext("scratch-" + uuid.uuid4().hex, {**problem.operands(), "x": OutputSource(
        problem.out_shape, problem.dtype, "scratch", None)}, TILE)
    tiles = [execute(ctx, task)["tile"] for task in plan_tasks(problem)]
    try:
        state = _STATES[ctx.run_id]
        assert all(len(stack) <= FREE_BUFFERS for stack in state.free.values())
        pooled = [id(b) for stack in state.free.values() for b in stack]
        assert pooled and not any(id(t) in pooled for t in tiles)  # a returned tile is never scratch
        assert len({id(t) for t in tiles}) == len(tiles)
    finally:
        release_run(ctx.run_id)
    local = run(problem)
    for task, tile in zip(plan_tasks(problem), tiles):
        i, j = task.out
        np.testing.assert_array_equal(tile, local.output[i * TILE:i * TILE + tile.shape[0], j * TILE:j * TILE + tile.shape[1]])


def test_memory_budget_boundary():
    a, b = rand((300, 200), np.float32, 1), rand((200, 100), np.float32, 2)
    p = make_problem("gemm", a, b, tile=TILE)
    assert min_budget(np.float32) == 6 * 256 * 256 * 4
    res = run(p, memory_budget=min_budget(np.float32))
    np.testing.assert_allclose(res.output, a @ b, rtol=1e-5, atol=1e-4)
    too_small = min_budget(np.float32) - 1
    with pytest.raises(InputError, match="below the working set of one tile task") as e:
        run(p, memory_budget=too_small)
    assert e.value.argument == "memory_budget"
    assert str(e.value).startswith(f"memory_budget={too_small}: ")
    # float64 tiles are twice as big: the float32 minimum is too small for them
    p64 = make_problem("gemm", a.astype(np.float64), b.astype(np.float64), tile=TILE)
    with pytest.raises(InputError) as e:
        run(p64, memory_budget=min_budget(np.float32))
    assert e.value.argument == "memory_budget"


def test_abort_deletes_the_staged_file(tmp_path):
    p = make_problem("gemm", rand((300, 200), np.float64, 1), rand((200, 100), np.float64, 2), tile=128)
    res = run(p, output=str(tmp_path / "c.npy"))
    assert Path(res.staged_path).exists()
    res.abort()
    assert os.listdir(tmp_path) == []
    res.abort()  # idempotent


def test_output_directory_must_exist(tmp_path):
    p = make_problem("gemm", rand((30, 20), np.float64, 1), rand((20, 10), np.float64, 2), tile=8)
    where = str(tmp_path / "nowhere" / "c.npy")
    with pytest.raises(InputError, match="its directory does not exist") as e:
        run(p, output=where)
    assert str(e.value).startswith(f"output={where!r}: ")
    afile = tmp_path / "afile"  # said "its directory does not exist" too (a trial)
    afile.write_text("")
    with pytest.raises(InputError) as e:
        run(p, output=str(afile / "c.npy"))
    assert str(e.value) == f"output={str(afile / 'c.npy')!r}: {afile} is a file, not a directory"


def test_output_that_is_a_directory_or_an_operand_is_refused_and_the_operand_kept(tmp_path):
    a = rand((30, 20), np.float64, 1)
    np.save(tmp_path / "a.npy", a)
    p = make_problem("gemm", NpySource(tmp_path / "a.npy", "a"), rand((20, 20), np.float64, 2), tile=8)
    with pytest.raises(InputError, match="is a directory") as e:
        run(p, output=str(tmp_path))
    assert e.value.argument == "output"
    linked = tmp_path / "same.npy"
    os.link(tmp_path / "a.npy", linked)  # another name for the same file is the same operand
    for out in (tmp_path / "a.npy", linked):
        with pytest.raises(InputError, match="is operand a: writing it would destroy the input"):
            run(p, output=str(out))
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), a)
    assert sorted(os.listdir(tmp_path)) == ["a.npy", "same.npy"]


# --- 3. the cache ---------------------------------------------------------------------------------


def test_cache_hits_when_tiles_are_reused():
    """Default budget (everything fits): each distinct tile misses once, every other load hits."""
    a, b, c = rand((M, K), np.float64, 1), rand((K, N), np.float64, 2), rand((M, N), np.float64, 3)
    res = run(make_problem("gemm", a, b, c, alpha=ALPHA, beta=BETA, tile=TILE))
    mt, nt, kt = n_tiles(M, TILE), n_tiles(N, TILE), n_tiles(K, TILE)
    assert (mt, nt, kt) == (4, 4, 3)
    assert loads(res) == 2 * mt * nt * kt + mt * nt  # a and b tile per panel, and c, per output tile
    assert res.counters["misses"] == mt * kt + kt * nt + mt * nt
    assert res.counters["hits"] == 72
    assert res.cache_hit_rate == pytest.approx(72 / 112)
    assert res.counters["bytes_source"] == (M * K + K * N + M * N) * 8  # every entry read once
    assert res.counters["bytes_peer"] == 0 and res.counters["bytes_host_to_device"] == 0
    np.testing.assert_allclose(res.output, ALPHA * a @ b + BETA * c, rtol=1e-12, atol=1e-11)
    assert res.workers == ["local"] and {r["worker"] for r in res.records} == {"local"}
    assert sorted(r["out"] for r in res.records) == [(i, j) for i in range(mt) for j in range(nt)]
    assert set(res.busy_fraction()) == {"local"} and 0 < res.busy_fraction()["local"] <= 1.0 + 1e-6
    assert res.gflops > 0


def test_single_tile_task_never_hits():
    """One output tile, one panel: nothing is loaded twice, so the hit rate is 0 (the counter is live)."""
    res = run(make_problem("gemm", rand((100, 50), np.float64, 1), rand((50, 80), np.float64, 2), tile=128))
    assert res.counters == {**res.counters, "hits": 0, "misses": 2}
    assert res.cache_hit_rate == 0.0


# --- failures leave nothing behind ----------------------------------------------------------------


def test_failed_run_leaves_no_output_file(tmp_path):
    a, b = rand((M, K), np.float64, 1), rand((K, N), np.float64, 2)
    a[900, 500] = np.nan  # in the last tile task's panel: some tiles were written before the error
    out = tmp_path / "c.npy"
    with pytest.raises(InputError, match="non-finite") as e:
        run(make_problem("gemm", a, b, tile=TILE), output=str(out))
    assert e.value.argument == "a"
    assert os.listdir(tmp_path) == []


def test_what_a_killed_run_left_is_swept_by_the_next_one(tmp_path):
    """kill -9 of a run left its hidden .partial output (302 MB in a trial) beside the output, and
    later runs of the same command never removed it. Leftovers of a live process, another host or
    no owner tag are kept."""
    import socket
    import subprocess
    import sys

    from paperline.kernels.blas.runtime import owner_tag, sweep_leftovers

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    stale = tmp_path / f".c.npy.partial-{dead.pid}@{host}-0123456789ab.npy"
    live = tmp_path / f".c.npy.partial-{owner_tag()}-0123456789ab.npy"
    elsewhere = tmp_path / f".c.npy.partial-{dead.pid}@not-{host}-0123456789ab.npy"
    untagged = tmp_path / ".c.npy.partial-0123456789ab.npy"
    for path in (stale, live, elsewhere, untagged):
        path.write_bytes(b"x")
    scratch = tmp_path / "scratch"
    (scratch / f"run-{dead.pid}@{host}-k2j_x9ab").mkdir(parents=True)
    (scratch / f"run-{dead.pid}@{host}-k2j_x9ab" / "result.npy").write_bytes(b"x")
    assert sweep_leftovers(scratch, "run-") == [str(scratch / f"run-{dead.pid}@{host}-k2j_x9ab")]
    assert os.listdir(scratch) == []
    a, b = rand((M, K), np.float64, 1), rand((K, N), np.float64, 2)
    run(make_problem("gemm", a, b, tile=TILE), output=str(tmp_path / "c.npy")).commit()
    assert not stale.exists() and live.exists() and elsewhere.exists() and untagged.exists()
    np.testing.assert_allclose(np.load(tmp_path / "c.npy"), a @ b, rtol=1e-10, atol=1e-10)


def test_non_finite_entry_of_an_operand_file_names_the_file_and_the_entry(tmp_path):
    a = rand((M, K), np.float64, 1)
    a[900, 500] = np.inf
    np.save(tmp_path / "a.npy", a)
    with pytest.raises(InputError) as e:
        run(make_problem("gemm", NpySource(tmp_path / "a.npy", "a"), rand((K, N), np.float64, 2), tile=TILE))
    assert str(e.value) == f"a={str(tmp_path / 'a.npy')!r}: non-finite value a[900,500] = inf (check_finite is on)"


def test_an_output_larger_than_its_disk_is_refused_before_any_tile_is_computed(tmp_path):
    """The staged output's blocks are reserved up front (fallocate): a result that cannot fit
    fails at once, naming the output and the bytes, instead of a short write mid-run."""
    import shutil

    free = shutil.disk_usage(tmp_path).free
    n = int(np.sqrt(2 * free / 8)) + 1  # an n x n float64 result: twice the free space
    if n * n * 8 > 8 << 40:  # ext4's largest file is 16 TiB: the header write itself would fail
        pytest.skip(f"{free} bytes free: no result just too large for this filesystem")
    a, b = rand((n, 1), np.float64, 1), rand((1, n), np.float64, 2)
    out = tmp_path / "c.npy"
    with pytest.raises(OSError, match=r"cannot reserve \d+ bytes for the result") as e:
        run(make_problem("gemm", a, b, tile=4096), output=str(out))
    assert str(out.parent) in str(e.value) and e.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == []


def test_a_staged_output_has_its_blocks_reserved(tmp_path):
    from paperline.kernels.blas.runtime import stage_npy

    path = tmp_path / "c.npy"
    stage_npy(str(path), np.float32, (1000, 777))
    st = os.stat(path)
    assert st.st_blocks * 512 >= 1000 * 777 * 4  # allocated, not a sparse file
    np.testing.assert_array_equal(np.load(path), np.zeros((1000, 777), np.float32))


def test_failed_trsm_leaves_no_scratch_or_output_file(tmp_path):
    """An in-memory TRSM stages its result in a scratch dir (spill_dir); a worker-side error removes
    it, and with output= the staged .partial file too."""
    a = triangular_operand(M, np.float64, 1)
    a[900, 900] = 0.0

    class Generated:  # not scanned by make_problem: the zero is found by the worker
        kind, shape, dtype, key = "generated", a.shape, a.dtype, f"gen:{uuid.uuid4().hex}"

        def read(self, rows, cols):
            return np.ascontiguousarray(a[rows, cols])

    p = make_problem("trsm", Generated(), rand((M, N), np.float64, 2), uplo="L", tile=TILE)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with pytest.raises(InputError, match="nonzero diagonal"):
        run(p, spill_dir=str(scratch))
    assert os.listdir(scratch) == []
    with pytest.raises(InputError, match="nonzero diagonal"):
        run(p, output=str(tmp_path / "x.npy"), spill_dir=str(scratch))
    assert sorted(os.listdir(tmp_path)) == ["scratch"] and os.listdir(scratch) == []
    # the successful in-memory TRSM cleans its scratch too
    a[900, 900] = 2.0
    run(p, spill_dir=str(scratch))
    assert os.listdir(scratch) == []


# --- scheduling and peer fetch (driver and worker pieces, in process) -----------------------------


def _ctx(problem, run_id, peer_kinds=frozenset({"s3", "generated", "output"}), budget=1 << 30):
    sources = dict(problem.operands())
    sources["x"] = OutputSource(problem.out_shape, problem.dtype, run_id, None)
    return RunContext(run_id, sources, problem.tile, "cpu", budget, True, peer_kinds, None)


def test_scheduler_places_tasks_where_their_tiles_are():
    p = make_problem("gemm", rand((512, 256), np.float64, 1), rand((256, 512), np.float64, 2), tile=256)
    tasks = plan_tasks(p)
    assert [t.out for t in tasks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    ctx = _ctx(p, "sched")
    sched = LocalityScheduler(tasks, ctx)
    held_by_w2 = [ctx.key(r) for r in tasks[3].refs()]
    for key in held_by_w2:
        sched.directory[key].add("w2")
    assert sched.pick("w2").out == (1, 1)  # its tiles, not plan order
    assert sched.pick("w1").out == (0, 0)  # nothing held: plan order
    # (1, 0) shares a's row panel 1 with (1, 1): w2 holds it, w1 would fetch it from w2
    assert sched.peers(tasks[2], "w1") == {ctx.key(tasks[2].terms[0][0]): "w2"}
    assert sched.peers(tasks[2], "w2") == {}
    sched.complete({"worker": "w2", "index": 3, "added": [], "evicted": held_by_w2})
    assert sched.peers(tasks[2], "w1") == {}
    assert sched.done == 1


def test_scheduler_releases_trsm_tasks_after_their_dependencies():
    p = make_problem("trsm", triangular_operand(600, np.float64, 1), rand((600, 100), np.float64, 2), uplo="L",
                     tile=256)
    tasks = plan_tasks(p)
    assert [t.deps for t in tasks] == [(), (0,), (0, 1)]
    sched = LocalityScheduler(tasks, _ctx(p, "deps"))
    assert sched.pick("w").index == 0 and sched.pick("w") is None
    sched.complete({"worker": "w", "index": 0, "added": [], "evicted": []})
    assert sched.pick("w").index == 1 and sched.pick("w") is None
    sched.complete({"worker": "w", "index": 1, "added": [], "evicted": []})
    assert sched.pick("w").index == 2


def test_worker_fetches_from_the_peer_the_driver_names():
    a_src = RandomSource((300, 200), np.float64, seed=3, stream=0)
    b_src = RandomSource((200, 100), np.float64, seed=3, stream=1)
    p = make_problem("gemm", a_src, b_src, tile=128)
    task = plan_tasks(p)[0]  # out (0, 0): a(0,0) b(0,0), a(0,1) b(1,0)
    a, b = read_all(a_src), read_all(b_src)
    ref = a[:128] @ b
    a00 = task.terms[0][0]
    calls = []

    def peer_fetch(run_id, address, key):
        calls.append((run_id, address, key))
        return 2.0 * a[:128, :128]  # what the peer holds (doubled, to see that it is what was used)

    ctx = _ctx(p, "peer-" + uuid.uuid4().hex)
    try:
        res = execute(ctx, task, {ctx.key(a00): "tcp://peer"}, peer_fetch=peer_fetch, worker="w1")
    finally:
        release_run(ctx.run_id)
    assert calls == [(ctx.run_id, "tcp://peer", ctx.key(a00))]
    np.testing.assert_allclose(res["tile"], ref + a[:128, :128] @ b[:128], rtol=1e-12, atol=1e-12)
    assert res["counters"]["bytes_peer"] == 128 * 128 * 8 and res["counters"]["misses"] == 4
    assert res["counters"]["bytes_source"] == (128 * 72 + 128 * 100 + 72 * 100) * 8  # the other three tiles
    assert ctx.key(a00) in res["added"] and res["worker"] == "w1" and res["out"] == (0, 0)

    # the peer no longer holds it: counted, and the tile comes from its source
    ctx = _ctx(p, "peer-" + uuid.uuid4().hex)
    try:
        res = execute(ctx, task, {ctx.key(a00): "tcp://peer"}, peer_fetch=lambda *_: None)
    finally:
        release_run(ctx.run_id)
    np.testing.assert_allclose(res["tile"], ref, rtol=1e-12, atol=1e-12)
    assert res["counters"]["peer_misses"] == 1 and res["counters"]["bytes_peer"] == 0

    # kinds outside peer_fetch (here: generated) are read from their source, the peer is not asked
    ctx = _ctx(p, "peer-" + uuid.uuid4().hex, peer_kinds=frozenset({"s3"}))
    calls.clear()
    try:
        res = execute(ctx, task, {ctx.key(a00): "tcp://peer"}, peer_fetch=peer_fetch)
    finally:
        release_run(ctx.run_id)
    assert calls == []
    np.testing.assert_allclose(res["tile"], ref, rtol=1e-12, atol=1e-12)


def test_a_second_run_in_the_same_process_does_not_break_the_first():
    arr, b = rand((64, 128), np.float64, 1), rand((128, 64), np.float64, 2)
    other = make_problem("gemm", rand((64, 64), np.float64, 3), rand((64, 64), np.float64, 4), tile=64)
    started = []

    class StartsAnotherRun:  # a's source: while its first tile is read, another run starts here
        kind, shape, dtype, key = "memory", arr.shape, arr.dtype, f"interrupting:{uuid.uuid4().hex}"

        def read(self, rows, cols):
            if not started:
                started.append(run(other))
            return np.ascontiguousarray(arr[rows, cols])

    res = run(make_problem("gemm", StartsAnotherRun(), b, tile=64))  # two k-panels: a second prefetch
    assert started
    np.testing.assert_allclose(res.output, arr @ b, rtol=1e-12, atol=1e-12)


# --- 6. Dask --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dask_client():
    distributed = pytest.importorskip("distributed")
    with warnings.catch_warnings():  # "Port 8787 is already in use" when another cluster runs here
        warnings.filterwarnings("ignore", message="Port .* is already in use", category=UserWarning)
        cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                                           dashboard_address=None)
    with cluster, distributed.Client(cluster) as client:
        client.wait_for_workers(2, timeout=60)
        yield client


def _assert_both_workers(res, runtime):
    workers = runtime.workers()
    assert len(workers) == 2 and res.workers == workers
    assert {r["worker"] for r in res.records} == set(workers)
    busy = res.busy_fraction()
    assert set(busy) == set(workers) and all(v > 0 for v in busy.values()), busy
    assert len(res.records) == len(plan_tasks(res.problem))


@pytest.mark.parametrize("case", ["gemm-fp64", "trsm-L-fp64", "trsm-R-fp32"])
def test_dask_equals_local(dask_client, tmp_path, case):
    routine, dtype, make, flags = CASES[case]
    problem = make_problem(routine, **make(dtype), **flags, tile=TILE)
    runtime = DaskRuntime(dask_client)
    local = run(problem)
    spill = tmp_path / "spill"
    spill.mkdir()
    res = run(problem, runtime, spill_dir=str(spill))  # in-memory operands are spilled to .npy files
    assert_same(res.output, local.output, dtype)
    _assert_both_workers(res, runtime)
    assert loads(res) == loads(local)
    assert os.listdir(spill) == []  # the spilled operands are removed
    assert freivalds(problem, res.result_source()).passed


def test_dask_worker_input_error_propagates_as_input_error(dask_client, tmp_path):
    a, b = rand((M, K), np.float64, 1), rand((K, N), np.float64, 2)
    a[900, 500] = np.nan
    runtime = DaskRuntime(dask_client)
    with pytest.raises(InputError) as e:
        run(make_problem("gemm", a, b, tile=TILE), runtime, output=str(tmp_path / "c.npy"))
    assert type(e.value) is InputError  # the class survives the trip back from the worker process
    assert e.value.argument == "a" and e.value.value == "a[900,500] = nan"
    assert str(e.value) == "a='a[900,500] = nan': non-finite value (check_finite is on)"
    assert os.listdir(tmp_path) == []  # no final, no .partial file
    # the cluster is usable afterwards (the failed run's tasks were cancelled)
    a[900, 500] = 0.0
    res = run(make_problem("gemm", a, b, tile=TILE), runtime)
    np.testing.assert_allclose(res.output, a @ b, rtol=1e-12, atol=1e-11)


@pytest.mark.parametrize("case", ["gemm-fp64", "trsm-R-fp32"])
def test_dask_out_of_core_with_output_file(dask_client, tmp_path, case):
    routine, dtype, make, flags = CASES[case]
    arrays = make(dtype)
    local = run(make_problem(routine, **arrays, **flags, tile=TILE))
    problem = make_problem(routine, **_save(tmp_path, arrays), **flags, tile=TILE)
    runtime = DaskRuntime(dask_client)
    final = tmp_path / "out.npy"
    res = run(problem, runtime, output=str(final), memory_budget=min_budget(dtype))
    assert res.output is None and not final.exists() and Path(res.staged_path).exists()
    res.commit()
    assert final.exists() and not Path(res.staged_path).exists()
    assert not [f for f in os.listdir(tmp_path) if "partial" in f]
    assert_same(np.load(final), local.output, dtype)
    _assert_both_workers(res, runtime)
    assert loads(res) == loads(local)
    assert res.counters["misses"] > local.counters["misses"]
    assert freivalds(problem, NpySource(final, "result")).passed


def test_memory_budget_counts_the_tiles_that_exist_not_the_nominal_tile():
    """A tile larger than the matrices is clipped to them, and so is the working set."""
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((100, 60)), rng.standard_normal((60, 80))
    problem = make_problem("gemm", a, b, tile=8192)
    result = run(problem, memory_budget=WORKING_SET_TILES * 100 * 100 * 8)
    np.testing.assert_allclose(result.output, a @ b, rtol=1e-13)
    with pytest.raises(InputError, match="memory_budget"):
        run(problem, memory_budget=WORKING_SET_TILES * 100 * 100 * 8 - 1)


def test_input_error_survives_plain_pickle():
    import pickle

    err = pickle.loads(pickle.dumps(InputError("tile", 0, "the tile size must be a positive integer")))
    assert isinstance(err, InputError) and err.argument == "tile" and err.value == 0
    assert str(err) == "tile=0: the tile size must be a positive integer"


@pytest.mark.parametrize("prefetch", [True, False])
def test_with_and_without_prefetch_the_result_and_records_agree(prefetch):
    rng = np.random.default_rng(6)
    a, b = rng.standard_normal((90, 70)), rng.standard_normal((70, 50))
    result = run(make_problem("gemm", a, b, tile=16), prefetch=prefetch)
    np.testing.assert_allclose(result.output, a @ b, rtol=1e-12, atol=1e-12)
    for r in result.records:
        assert isinstance(r["start"], float) and r["end"] >= r["start"]
        assert r["multiply_s"] > 0 and r["wait_s"] >= 0
    assert 0 < result.busy_fraction()["local"] <= 1.0 + 1e-9


def test_a_run_state_in_use_is_neither_evicted_nor_closed_under_its_tasks(tmp_path, monkeypatch):
    """Beyond MAX_RUN_STATES the oldest *idle* state is evicted; a released state whose tasks still
    run keeps its prefetcher and output file until the last one ends."""
    from paperline.kernels.blas import worker as w

    monkeypatch.setattr(w, "MAX_RUN_STATES", 2)
    p = make_problem("gemm", rand((64, 32), np.float64, 1), rand((32, 48), np.float64, 2), tile=32)
    path = str(tmp_path / "c.npy")
    np.lib.format.open_memmap(path, mode="w+", dtype=np.float64, shape=(64, 48)).flush()
    ctxs = [_ctx(p, f"evict-{i}-" + uuid.uuid4().hex) for i in range(4)]
    states = [w.worker_state(c) for c in ctxs[:3]]  # three runs, each with a task executing
    try:
        assert all(c.run_id in w._STATES for c in ctxs[:3]), "an in-use state was evicted"
        w.task_done(states[0])
        w.worker_state(ctxs[3])  # the idle one goes
        assert ctxs[0].run_id not in w._STATES and states[0].retired
        with pytest.raises(RuntimeError):
            states[0].prefetcher.submit(int)  # closed
        states[1].output = OutputFile(path)
        w.release_run(ctxs[1].run_id)  # released while its task still runs
        assert states[1].retired and states[1].prefetcher.submit(int).result() == 0
        states[1].output.write(0, 0, np.ones((32, 32)))  # its output file is still open
        w.task_done(states[1])
        assert states[1].output.fd == -1
    finally:
        for c in ctxs:
            release_run(c.run_id)
    np.testing.assert_array_equal(np.load(path)[:32, :32], 1.0)


def test_a_file_replaced_by_rename_with_the_same_size_and_mtime_is_read_anew(tmp_path):
    a1, a2, b = rand((96, 64), np.float64, 1), rand((96, 64), np.float64, 2), rand((64, 40), np.float64, 3)
    path, fresh = tmp_path / "a.npy", tmp_path / "a2.npy"
    np.save(path, a1)
    np.save(tmp_path / "b.npy", b)
    first = run(make_problem("gemm", str(path), str(tmp_path / "b.npy"), tile=32)).output
    st = os.stat(path)
    np.save(fresh, a2)
    os.utime(fresh, ns=(st.st_atime_ns, st.st_mtime_ns))  # as cp -p or rsync -a leave it
    os.replace(fresh, path)
    assert os.stat(path).st_size == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns
    second = run(make_problem("gemm", str(path), str(tmp_path / "b.npy"), tile=32)).output
    np.testing.assert_allclose(first, a1 @ b, rtol=1e-12)
    np.testing.assert_allclose(second, a2 @ b, rtol=1e-12)


def test_one_dask_runtime_drives_one_run_at_a_time(dask_client):
    runtime = DaskRuntime(dask_client)
    p = make_problem("gemm", rand((64, 32), np.float64, 1), rand((32, 48), np.float64, 2), tile=32)
    ctx = _ctx(p, "busy-" + uuid.uuid4().hex)
    runtime.start(ctx)
    try:
        with pytest.raises(RuntimeError, match="one DaskRuntime per concurrent run"):
            runtime.start(_ctx(p, "second-" + uuid.uuid4().hex))
    finally:
        runtime.finish(ctx)
    runtime.start(ctx)  # free again after finish
    runtime.finish(ctx)


@pytest.mark.timeout(180)
def test_a_worker_lost_mid_run_fails_the_run_and_leaves_no_output(tmp_path):
    """Tile tasks are bound to their worker: when it dies the driver must not wait forever."""
    import threading

    distributed = pytest.importorskip("distributed")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Port .* is already in use", category=UserWarning)
        cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                                           dashboard_address=None)
    with cluster, distributed.Client(cluster) as client:
        client.wait_for_workers(2, timeout=60)
        runtime = DaskRuntime(client)
        runtime.liveness_s = 0.5
        victim = runtime.workers()[0]
        problem = make_problem("gemm", RandomSource((1200, 1200), np.float64, seed=1),
                               RandomSource((1200, 1200), np.float64, seed=2, stream=1), tile=60)

        pid = client.run(os.getpid, workers=[victim])[victim]

        def kill() -> None:
            time.sleep(0.5)
            os.kill(pid, signal.SIGKILL)

        threading.Thread(target=kill, daemon=True).start()
        with pytest.raises(RuntimeError, match="left the Dask cluster during the run"):
            run(problem, runtime, output=str(tmp_path / "c.npy"))
        assert os.listdir(tmp_path) == []

        # A task that finished on a worker that then died: its result is lost with the worker
        # (seen in CI: the driver waited on the lost result forever).
        first = set(runtime.workers())
        deadline = time.monotonic() + 60  # the first victim gone and its replacement up
        while time.monotonic() < deadline:
            workers = client.scheduler_info(n_workers=-1)["workers"]
            if victim not in workers and len(workers) == 2:
                break
            time.sleep(0.1)
        runtime = DaskRuntime(client)
        runtime.liveness_s = 0.5
        # the replacement: the survivor may still finish a cancelled tile of the first run
        victim = next(w for w in runtime.workers() if w not in first)
        runtime.start(_ctx(problem, "lost-" + uuid.uuid4().hex))
        done = client.submit(dict, index=0, workers=[victim], allow_other_workers=False, pure=False)
        distributed.wait(done, timeout=60)
        runtime._ac.add(done)
        os.kill(client.run(os.getpid, workers=[victim])[victim], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while victim in client.scheduler_info(n_workers=-1)["workers"] and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(RuntimeError, match="left the Dask cluster"):
            runtime.wait_any()

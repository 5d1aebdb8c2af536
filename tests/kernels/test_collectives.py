"""Linear Pipelining collectives against the backend's own, on real multi-process gloo groups.

One group of P processes per world size (1, 2, 3, 4) runs every case in :data:`CASES` once and
writes its verdicts; the tests then assert them case by case. The processes are this file run as a
script (``--worker``), since pytest's importlib mode leaves test modules unimportable by name.

References: ``dist.broadcast`` / ``dist.reduce`` / ``dist.all_reduce`` on the same inputs, and the
inputs themselves (every rank regenerates every rank's seeded input): broadcast is bit-exact;
integer dtypes, MIN/MAX and bitwise ops are exact; float sums, whose order differs, are within
``P * eps(dtype) * sum_r |x_r|`` elementwise of the backend and of the float64 sum (each order is
within ``(P - 1) * eps / 2 * sum_r |x_r|`` of the exact sum).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import traceback
from dataclasses import dataclass

import pytest

KINDS = ("broadcast", "reduce", "allreduce")
WORLD_SIZES = (1, 2, 3, 4)


@dataclass(frozen=True)
class Case:
    kind: str
    dtype: str
    shape: tuple[int, ...]
    chunk: int | str | None = "thirds"  # bytes, "thirds" (bytes making 3 chunks) or None (the cost model)
    root: str = "last"  # first | second | last: global rank 0, 1 or P-1
    op: str = "sum"
    subgroup: bool = False  # run on the group of global ranks 1..P-1
    nan: bool = False  # rank 0's input holds NaN and inf (data, not an error)

    @property
    def id(self) -> str:
        shape = "x".join(map(str, self.shape)) or "scalar"
        parts = [self.kind, self.dtype, shape, f"chunk={self.chunk}"]
        if self.kind != "allreduce":
            parts.append(f"root={self.root}")
        if self.op != "sum":
            parts.append(self.op)
        if self.subgroup:
            parts.append("subgroup")
        if self.nan:
            parts.append("nan")
        return "-".join(parts)


def _cases() -> list[Case]:
    cases = []
    for kind in KINDS:
        dtypes = ["float32", "float64", "int64", "uint8", "float16", "bfloat16"]
        if kind == "broadcast":
            dtypes += ["bool", "complex64"]
        for dtype in dtypes:
            for numel in (1, 7, 1000):  # 1, 3 (3+3+1) and 3 (334+334+332) chunks
                cases.append(Case(kind, dtype, (numel,)))
        if kind != "allreduce":
            cases += [Case(kind, "float32", (1000,), root="first"), Case(kind, "int64", (1000,), root="second")]
        cases += [
            Case(kind, "float32", (100_003,), chunk=4096),  # 98 chunks, the last one short
            Case(kind, "float64", (33, 31), chunk=100),  # 2-D, 12-element chunks, 100 not a multiple of 8
            Case(kind, "float64", (7,), chunk=1),  # less than an element: one element per chunk
            Case(kind, "float32", (300_000,), chunk=None),  # the cost model's chunk
            Case(kind, "float32", (0,)),
            Case(kind, "float32", (1000,), subgroup=True),
            Case(kind, "float32", (7,), nan=True, root="first"),
        ]
    for op in ("max", "min", "product"):
        cases += [Case("reduce", "int64", (1000,), op=op), Case("allreduce", "int64", (1000,), op=op)]
    cases += [Case("allreduce", "float32", (1000,), op="max"), Case("allreduce", "complex64", (1000,))]
    cases += [Case("allreduce", "int32", (1000,), op=op) for op in ("band", "bor", "bxor")]
    return cases


CASES = _cases()


# ----------------------------------------------------------------------------------- worker process


def _input(case: Case, rank: int, device):
    import torch

    g = torch.Generator().manual_seed(1000 * CASES.index(case) + rank)
    dtype = getattr(torch, case.dtype)
    if case.op == "product":
        x = torch.randint(-2, 3, case.shape, generator=g)
    elif dtype == torch.bool:
        x = torch.randint(0, 2, case.shape, generator=g)
    elif dtype == torch.uint8:
        x = torch.randint(0, 256, case.shape, generator=g)
    elif dtype.is_floating_point or dtype.is_complex:
        x = torch.randn(case.shape, generator=g, dtype=torch.complex64 if dtype.is_complex else torch.float64)
    else:
        x = torch.randint(-50, 50, case.shape, generator=g)
    x = x.to(dtype)
    if case.nan and rank == 0:
        x[0], x[-1] = math.nan, math.inf
    return x.to(device)


def _same_bits(a, b) -> bool:
    import torch

    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def _digest(t) -> str:
    import torch

    return hashlib.sha1(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _run_case(case: Case, world: int, rank: int, device) -> dict:
    import torch
    import torch.distributed as dist

    from paperline.kernels.comm.collectives import lp_allreduce, lp_broadcast, lp_reduce

    ranks = list(range(1, world)) if case.subgroup else list(range(world))
    group = dist.new_group(ranks) if case.subgroup else None
    root = {"first": ranks[0], "second": ranks[min(1, len(ranks) - 1)], "last": ranks[-1]}[case.root]
    x = _input(case, rank, device)
    itemsize = x.element_size()
    chunk = case.chunk
    if chunk == "thirds":
        chunk = max(1, math.ceil(x.numel() / 3)) * itemsize
    if rank not in ranks:  # not a member: both are no-ops
        lp = x.clone()
        {"broadcast": lambda: lp_broadcast(lp, root, group=group), "reduce": lambda: lp_reduce(lp, root, group=group),
         "allreduce": lambda: lp_allreduce(lp, group=group)}[case.kind]()
        return {"ok": torch.equal(lp, x), "detail": "non-member tensor changed", "digest": None}
    op = getattr(dist.ReduceOp, case.op.upper())
    lp, ref = x.clone(), x.clone()
    if case.kind == "broadcast":
        lp_broadcast(lp, root, chunk_bytes=chunk, group=group)
        dist.broadcast(ref, root, group=group)
    elif case.kind == "reduce":
        lp_reduce(lp, root, op=case.op, chunk_bytes=chunk, group=group)
        dist.reduce(ref, root, op=op, group=group)
    else:
        lp_allreduce(lp, op=op, chunk_bytes=chunk, group=group)
        dist.all_reduce(ref, op=op, group=group)
    if lp.shape != x.shape or lp.dtype != x.dtype:
        return {"ok": False, "detail": f"shape/dtype changed: {lp.shape} {lp.dtype}", "digest": None}
    inputs = [_input(case, r, device) for r in ranks]
    digest = _digest(lp)
    if case.kind == "broadcast":
        ok = _same_bits(lp, ref) and _same_bits(lp, inputs[ranks.index(root)])
        return {"ok": ok, "detail": "broadcast differs from dist.broadcast or the source's input", "digest": digest}
    if case.kind == "reduce" and rank != root:
        return {"ok": _same_bits(lp, x), "detail": "lp_reduce changed a non-root tensor", "digest": None}
    exact = not (x.dtype.is_floating_point or x.dtype.is_complex) or case.op in ("max", "min")
    if exact:
        return {"ok": torch.equal(lp, ref), "detail": f"not equal to dist.{case.kind}", "digest": digest}
    # Float sums: a stated bound against the backend and against the float64 (complex128) sum.
    wide = torch.complex128 if x.dtype.is_complex else torch.float64
    stacked = torch.stack([t.to(wide) for t in inputs])
    exact_sum = stacked.sum(0)
    bound = len(ranks) * torch.finfo(x.dtype).eps * stacked.abs().sum(0) + torch.finfo(x.dtype).tiny
    special = ~torch.isfinite(exact_sum)  # NaN/inf inputs: NaN where the backend has NaN, the same infs
    nan = exact_sum.isnan()
    if not (torch.equal(lp.isnan(), nan) and torch.equal(ref.isnan(), nan)
            and torch.equal(lp[special & ~nan], ref[special & ~nan])):
        return {"ok": False, "detail": "NaN/inf not propagated like the backend", "digest": digest}
    finite = ~special
    err_backend = (lp.to(wide) - ref.to(wide)).abs()[finite]
    err_exact = (lp.to(wide) - exact_sum).abs()[finite]
    ok = bool((err_backend <= bound[finite]).all() and (err_exact <= bound[finite]).all())
    worst = float((err_backend / bound[finite]).max()) if err_backend.numel() else 0.0
    return {"ok": ok, "detail": f"error / bound up to {worst:.3g}", "digest": digest}


def _run_errors(world: int, rank: int, device) -> dict:
    """Bad input raises InputError naming the argument, on every rank, before any communication."""
    import torch
    import torch.distributed as dist

    from paperline.kernels.comm.collectives import lp_allreduce, lp_broadcast, lp_reduce
    from paperline.kernels.errors import InputError

    x = torch.zeros(12, device=device)
    attempts = [  # (expected argument, call)
        ("src", lambda: lp_broadcast(x, world)),
        ("src", lambda: lp_broadcast(x, -1)),
        ("src", lambda: lp_broadcast(x, 0.0)),
        ("dst", lambda: lp_reduce(x, world)),
        ("op", lambda: lp_allreduce(x, op="avg")),
        ("op", lambda: lp_reduce(x, 0, op=dist.ReduceOp.AVG)),
        ("chunk_bytes", lambda: lp_allreduce(x, chunk_bytes=0)),
        ("chunk_bytes", lambda: lp_broadcast(x, 0, chunk_bytes=-8)),
        ("chunk_bytes", lambda: lp_reduce(x, 0, chunk_bytes=4.0)),
        ("tensor", lambda: lp_allreduce(torch.zeros(4, 3, device=device).t())),
        ("tensor", lambda: lp_broadcast([1.0, 2.0], 0)),
    ]
    failures = []
    for i, (argument, attempt) in enumerate(attempts):
        try:
            attempt()
        except InputError as exc:
            if exc.argument != argument:
                failures.append(f"attempt {i}: names {exc.argument!r}, not {argument!r}")
        else:
            failures.append(f"attempt {i} ({argument}): no InputError")
    return {"ok": not failures, "detail": "; ".join(failures), "digest": None}


def _run_timing(world: int, rank: int, device) -> dict:
    import torch

    from paperline.kernels.comm.collectives import lp_allreduce, time_collective

    x = torch.zeros(1000, device=device)
    seconds = time_collective(lambda: lp_allreduce(x), iters=2, warmup=1, repeats=2)
    return {"ok": 0 < seconds < 10, "detail": f"{seconds} s", "digest": repr(seconds)}  # MAX-reduced: same on all


def _run_no_garbage(world: int, rank: int, device) -> dict:
    """A call leaves no cyclic garbage: nothing holds the process group (and gloo's threads) past
    destroy_process_group() until some later GC pass."""
    import gc

    import torch

    from paperline.kernels.comm.collectives import lp_allreduce, lp_broadcast, lp_reduce

    x = torch.zeros(1000, device=device)
    found = {}
    for name, call in (("broadcast", lambda: lp_broadcast(x, world - 1, chunk_bytes=400)),
                       ("reduce", lambda: lp_reduce(x, 0, chunk_bytes=400)),
                       ("allreduce", lambda: lp_allreduce(x, chunk_bytes=400))):
        gc.collect()
        gc.disable()
        try:
            call()
            found[name] = gc.collect()
        finally:
            gc.enable()
    return {"ok": not any(found.values()), "detail": f"objects only the cyclic GC frees: {found}", "digest": None}


def _worker_main(argv: list[str]) -> None:
    from contextlib import ExitStack

    import torch
    import torch.distributed as dist

    from paperline.kernels.train.ddp import process_group

    rank, world, port, out, backend = int(argv[0]), int(argv[1]), int(argv[2]), argv[3], argv[4]
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    group = ExitStack()  # left at the end: rank 0's store and gloo listen on 127.0.0.1 only meanwhile
    group.enter_context(process_group(backend, f"tcp://127.0.0.1:{port}", rank, world, timeout_s=60))
    results = {}
    for case in CASES:
        if case.subgroup and world == 1:
            continue
        if backend == "nccl" and case.dtype not in ("float32", "int64"):
            continue
        try:
            results[case.id] = _run_case(case, world, rank, device)
        except Exception:  # an error on one rank: record it; the group may hang, the parent's timeout ends it
            results[case.id] = {"ok": False, "detail": traceback.format_exc(), "digest": None}
            break
    else:
        results["errors"] = _run_errors(world, rank, device)
        results["timing"] = _run_timing(world, rank, device)
        results["no_garbage"] = _run_no_garbage(world, rank, device)
    with open(out, "w") as f:
        json.dump(results, f)
    dist.barrier()
    group.close()


# --------------------------------------------------------------------------------------------- tests


def _launch(world: int, port: int, tmp_path, backend: str = "gloo") -> list[dict]:
    outs = [tmp_path / f"rank{r}.json" for r in range(world)]
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(r), str(world), str(port),
                               str(outs[r]), backend], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=150)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n" + "\n".join(logs[r:r + 1])[-4000:]
    return [json.loads(o.read_text()) for o in outs]


@pytest.fixture(scope="module")
def group_results(tmp_path_factory, free_port):
    cache: dict[int, list[dict]] = {}

    def get(world: int) -> list[dict]:
        if world not in cache:
            cache[world] = _launch(world, free_port(), tmp_path_factory.mktemp(f"world{world}"))
        return cache[world]

    return get


# (a subgroup of ranks 1..P-1 needs P >= 2: those cases are not generated for one rank)
@pytest.mark.parametrize(("world", "case"), [(w, c) for w in WORLD_SIZES for c in CASES if not (c.subgroup and w == 1)],
                         ids=[f"{w}-{c.id}" for w in WORLD_SIZES for c in CASES if not (c.subgroup and w == 1)])
def test_lp_matches_backend(group_results, world, case):
    per_rank = [r[case.id] for r in group_results(world)]
    for rank, res in enumerate(per_rank):
        assert res["ok"], f"rank {rank} of {world}: {res['detail']}"
    if case.kind == "allreduce":  # every rank ends with the same bits
        digests = {res["digest"] for res in per_rank if res["digest"] is not None}
        assert len(digests) <= 1, f"ranks disagree: {digests}"


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_bad_input_raises_on_every_rank(group_results, world):
    for rank, res in enumerate(group_results(world)):
        assert res["errors"]["ok"], f"rank {rank}: {res['errors']['detail']}"


@pytest.mark.parametrize("world", (2, 4))
def test_time_collective_is_the_same_on_every_rank(group_results, world):
    res = [r["timing"] for r in group_results(world)]
    assert all(r["ok"] for r in res), [r["detail"] for r in res]
    assert len({r["digest"] for r in res}) == 1


@pytest.mark.parametrize("world", (2, 3))
def test_calls_leave_no_reference_cycles(group_results, world):
    for rank, res in enumerate(group_results(world)):
        assert res["no_garbage"]["ok"], f"rank {rank}: {res['no_garbage']['detail']}"


@pytest.mark.gpu
def test_nccl_matches_backend(tmp_path, free_port):
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2 or not torch.distributed.is_nccl_available():
        pytest.skip("needs 2 CUDA devices and NCCL")
    results = _launch(2, free_port(), tmp_path, backend="nccl")
    for rank, res in enumerate(results):
        bad = {k: v["detail"] for k, v in res.items() if not v["ok"]}
        assert not bad, f"rank {rank}: {bad}"


# ---------------------------------------------------------------------- in-process (no process group)


def test_bandwidth_follows_nccl_tests():
    from paperline.kernels.comm.collectives import bandwidth

    bw = bandwidth(0.5, 1_000_000, 4, "allreduce")
    assert bw.algbw_bytes_per_s == 2e6
    assert bw.busbw_bytes_per_s == pytest.approx(2e6 * 2 * 3 / 4, rel=1e-15)
    for kind in ("broadcast", "reduce"):
        assert bandwidth(2.0, 8, 8, kind) == (4.0, 4.0)
    assert bandwidth(1.0, 100, 4, "allgather").busbw_bytes_per_s == pytest.approx(75.0)
    assert bandwidth(1.0, 100, 1, "allreduce") == (100.0, 0.0)


@pytest.mark.parametrize("args, argument", [
    ((0.0, 10, 2, "allreduce"), "seconds"), ((float("nan"), 10, 2, "allreduce"), "seconds"),
    ((1.0, -1, 2, "allreduce"), "nbytes"), ((1.0, 10, 0, "allreduce"), "world_size"),
    ((1.0, 10, 2, "gather"), "kind"), ((1.0, True, 2, "allreduce"), "nbytes"), ((True, 10, 2, "allreduce"), "seconds"),
])
def test_bandwidth_bad_input(args, argument):
    from paperline.kernels.comm.collectives import bandwidth
    from paperline.kernels.errors import InputError

    with pytest.raises(InputError) as info:
        bandwidth(*args)
    assert info.value.argument == argument


def test_chunk_bytes_minimises_the_cost_model():
    from paperline.kernels.comm.collectives import lp_chunk_bytes

    alpha, rate, n, p = 1e-4, 1e9, 64 << 20, 4
    chunk = lp_chunk_bytes(n, p, "allreduce", alpha_s=alpha, bytes_per_s=rate)
    assert chunk == int(math.sqrt(alpha * n * rate / (2 * (p - 1))))

    def cost(k: float) -> float:  # (S + K) (alpha + beta n / K)
        return (2 * (p - 1) + k) * (alpha + n / k / rate)

    k_star = n / chunk
    assert cost(k_star) <= min(cost(k_star * 0.8), cost(k_star * 1.25))
    assert lp_chunk_bytes(100, 4) == 100  # never above the message: one chunk
    assert lp_chunk_bytes(1 << 40, 2, "broadcast") == 16 << 20  # clipped
    assert lp_chunk_bytes(0, 2) == 1
    # NumPy's integers are integers (a message size from an array's nbytes), bools are not numbers here
    import numpy as np

    from paperline.kernels.comm.collectives import bandwidth
    from paperline.kernels.errors import InputError

    assert lp_chunk_bytes(np.int64(100), np.int32(4)) == 100
    assert bandwidth(np.float64(2.0), np.int64(8), np.int64(8), "allreduce") == (4.0, 7.0)  # 2(P-1)/P
    for bad in ({"alpha_s": True}, {"bytes_per_s": False}):
        with pytest.raises(InputError, match=next(iter(bad))):
            lp_chunk_bytes(100, 4, **bad)


def test_checks_before_any_communication():
    """Without a process group: tensor and chunk checks still raise InputError, not torch errors."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    from paperline.kernels.comm.collectives import lp_allreduce, lp_broadcast, lp_reduce
    from paperline.kernels.errors import InputError

    with pytest.raises(InputError, match="contiguous"):
        lp_allreduce(torch.zeros(3, 4).t())
    with pytest.raises(InputError, match="chunk_bytes"):
        lp_broadcast(torch.zeros(3), 0, chunk_bytes=0)
    with pytest.raises(InputError, match="op"):
        lp_reduce(torch.zeros(3), 0, op="mean")
    if not dist.is_initialized():
        with pytest.raises(InputError, match="not initialized"):
            lp_allreduce(torch.zeros(3))


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker_main(sys.argv[2:])

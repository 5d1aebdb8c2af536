"""Linear Pipelining (LP) collectives: broadcast, reduce and allreduce along a chain of ranks.

See [Wang2017lp]_. A message of ``n`` bytes is cut into ``K`` chunks that flow along a chain of the
``P`` ranks of a group; every rank forwards chunk ``k`` to its successor while chunk ``k + 1``
arrives from its predecessor, so after the pipeline fills each link carries one chunk per step.
Transport is :mod:`torch.distributed` point-to-point (``isend``/``irecv``), so the same code runs on
gloo (CPU tensors) and NCCL (CUDA tensors); the functions are in place and take the arguments of
their :mod:`torch.distributed` counterparts (``src``/``dst`` are global ranks, ``group`` defaults to
the default group).

Cost model (the paper's, ``alpha`` seconds per message, ``beta`` seconds per byte, ``gamma``
seconds per byte reduced, ``K`` chunks of ``n / K`` bytes):

* broadcast: ``T ~ (P - 1 + K) * (alpha + beta * n / K)``;
* reduce: ``T ~ (P - 1 + K) * (alpha + (beta + gamma) * n / K)``;
* allreduce = reduce toward the chain's last rank + broadcast back along the chain. The two phases
  use the two directions of every link, so they overlap over chunks: the final value of chunk ``k``
  travels back while the partial sum of chunk ``k + 1`` travels forward, and
  ``T ~ (2 (P - 1) + K) * (alpha + beta * n / K) + (P - 1 + K) * gamma * n / K``
  instead of twice the reduce time without overlap.

For ``K >> P`` the time tends to ``beta * n`` (``(beta + gamma) * n``), independent of ``P``: that
is the paper's point against a binomial tree (``log2(P) * beta * n``) and against bidirectional
exchange / ring allreduce (``2 (P - 1) / P * beta * n``), which LP allreduce beats by up to 2x when
links are full duplex. Minimising ``(S + K) * (alpha + beta * n / K)`` over ``K`` (``S = P - 1``, or
``2 (P - 1)`` for allreduce) gives ``K* = sqrt(S * beta * n / alpha)``, i.e. chunks of
``sqrt(alpha * n / (S * beta))`` bytes: big enough that the per-message latency ``alpha`` is
amortised, small enough that filling and draining the pipeline (``S`` steps) costs little. That is
what :func:`lp_chunk_bytes` returns and what ``chunk_bytes=None`` uses, with the backend's
constants from :data:`LINK_MODEL`.

Schedule: every rank runs the same static timetable. Step ``t`` of a rank first posts the receives
due at step ``t + lookahead`` (so the next chunks stream in while this one is being forwarded), then
waits for the receives due at ``t``, combines, and posts the sends. A receive due at step ``t``
only depends on sends another rank posted at a step before ``t``, so the timetable cannot deadlock.

All ranks must call a collective with the same ``numel``, dtype, ``chunk_bytes``, root and op, as
with :mod:`torch.distributed`; argument checks happen before any communication. NaN and inf are
data: they travel and propagate as in the backend's collectives (a caller that must not apply NaN
gradients checks before or after).

References:
    .. [Wang2017lp] L. Wang, W. Wu, G. Bosilca, R. Vuduc, Z. Xu. Efficient Communications in
       Training Large Scale Neural Networks. arXiv 2017.
    .. [ncclTests] NVIDIA nccl-tests, doc/PERFORMANCE.md: algorithm and bus bandwidth.
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from paperline.kernels.errors import Described, InputError

#: Cost-model constants ``(alpha_s, bytes_per_s)`` per backend, used by ``chunk_bytes=None``:
#: latency per point-to-point message in seconds (with Python dispatch) and link bandwidth in
#: bytes per second. gloo: measured over loopback TCP on a 2-core machine (a 1 KiB send/recv
#: round trip ~3e-4 s, 1 MiB messages in a burst ~3e9 bytes/s; the time of a chunk also holds the
#: reduction and the wake-up of a waiting rank). nccl: ~2e-5 s per launch, 5e10 bytes/s (NVLink
#: or a PCIe 4/5 x16 link; measure with ``benchmarks/collectives.py --backend nccl``). Other
#: backends use gloo's.
LINK_MODEL: dict[str, tuple[float, float]] = {
    "gloo": (2e-4, 2e9),
    "nccl": (2e-5, 5e10),
}
DEFAULT_ALPHA_S, DEFAULT_BYTES_PER_S = LINK_MODEL["gloo"]
#: Chunk bounds for ``chunk_bytes=None``, bytes.
MIN_CHUNK_BYTES = 16 * 1024
MAX_CHUNK_BYTES = 16 * 1024 * 1024

#: Receives posted ahead of the step that waits for them. The reduce scratch ring holds
#: ``_LOOKAHEAD + 2`` chunks, so a buffer is reused only after its send has had a step to finish.
_LOOKAHEAD = 2

#: Bus-bandwidth factors of nccl-tests: ``busbw = algbw * factor(P)``.
_BUSBW_FACTORS: dict[str, Callable[[int], float]] = {
    "allreduce": lambda p: 2.0 * (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
    "allgather": lambda p: (p - 1) / p,
    "alltoall": lambda p: (p - 1) / p,
    "broadcast": lambda p: 1.0,
    "reduce": lambda p: 1.0,
}

#: Chain steps to fill the pipeline (the ``S`` of the cost model) per collective.
_FILL_STEPS: dict[str, Callable[[int], int]] = {
    "broadcast": lambda p: p - 1,
    "reduce": lambda p: p - 1,
    "allreduce": lambda p: 2 * (p - 1),
}


class Bandwidth(NamedTuple):
    """Algorithm and bus bandwidth of one collective call, bytes per second."""

    algbw_bytes_per_s: float
    busbw_bytes_per_s: float


def bandwidth(seconds: float, nbytes: int, world_size: int, kind: str) -> Bandwidth:
    """Algorithm bandwidth and bus bandwidth of a collective, as nccl-tests reports them.

    ``algbw = nbytes / seconds``; ``busbw = algbw * factor`` where the factor makes the figure
    comparable with the hardware's link bandwidth whatever the algorithm or ``P``: ``2 (P - 1) / P``
    for allreduce, ``(P - 1) / P`` for reduce_scatter, allgather and alltoall, ``1`` for broadcast
    and reduce. See [ncclTests]_.

    Args:
        seconds: Time of one call, seconds (> 0, finite).
        nbytes: Message size per rank, bytes (the tensor's ``numel * element_size``; >= 0).
        world_size: Number of ranks ``P`` (>= 1).
        kind: ``"allreduce"``, ``"broadcast"``, ``"reduce"``, ``"reduce_scatter"``, ``"allgather"``
            or ``"alltoall"``.

    Returns:
        ``Bandwidth(algbw_bytes_per_s, busbw_bytes_per_s)``; for ``P = 1`` allreduce's busbw is 0,
        as in nccl-tests.

    Raises:
        InputError: on a non-positive or non-finite time, a negative size, ``world_size < 1`` or an
            unknown kind.
    """
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not math.isfinite(seconds) \
            or seconds <= 0:
        raise InputError("seconds", seconds, "must be a finite time > 0 in seconds")
    if not _is_int(nbytes) or nbytes < 0:
        raise InputError("nbytes", nbytes, "must be an int >= 0 (bytes)")
    _check_world_size(world_size)
    if kind not in _BUSBW_FACTORS:
        raise InputError("kind", kind, f"must be one of {sorted(_BUSBW_FACTORS)}")
    algbw = nbytes / seconds
    return Bandwidth(algbw, algbw * _BUSBW_FACTORS[kind](world_size))


def lp_chunk_bytes(nbytes: int, world_size: int, kind: str = "allreduce", *, alpha_s: float = DEFAULT_ALPHA_S,
                   bytes_per_s: float = DEFAULT_BYTES_PER_S) -> int:
    """Chunk size minimising the LP cost model, ``sqrt(alpha * n / (S * beta))`` bytes.

    ``S`` is the pipeline fill (``P - 1`` for broadcast and reduce, ``2 (P - 1)`` for allreduce)
    and ``beta = 1 / bytes_per_s``; see the module docstring. The result is clipped to
    [``MIN_CHUNK_BYTES``, ``MAX_CHUNK_BYTES``] and never exceeds ``nbytes`` (one chunk for small
    messages, where latency dominates and pipelining cannot pay).

    Args:
        nbytes: Message size, bytes (>= 0).
        world_size: Number of ranks ``P`` (>= 1).
        kind: ``"broadcast"``, ``"reduce"`` or ``"allreduce"``.
        alpha_s: Latency per message, seconds (> 0).
        bytes_per_s: Link bandwidth, bytes per second (> 0).

    Returns:
        Chunk size in bytes, >= 1.

    Raises:
        InputError: on a negative size, ``world_size < 1``, an unknown kind or non-positive model
            constants.
    """
    if not _is_int(nbytes) or nbytes < 0:
        raise InputError("nbytes", nbytes, "must be an int >= 0 (bytes)")
    _check_world_size(world_size)
    if kind not in _FILL_STEPS:
        raise InputError("kind", kind, f"must be one of {sorted(_FILL_STEPS)}")
    for name, value in (("alpha_s", alpha_s), ("bytes_per_s", bytes_per_s)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
            raise InputError(name, value, "must be a finite number > 0")
    fill = max(1, _FILL_STEPS[kind](world_size))
    best = math.sqrt(alpha_s * nbytes * bytes_per_s / fill)
    best = min(max(best, MIN_CHUNK_BYTES), MAX_CHUNK_BYTES)
    return max(1, min(nbytes, int(best)))


def lp_broadcast(tensor: Any, src: int = 0, *, chunk_bytes: int | None = None, group: Any = None) -> None:
    """Broadcast ``tensor`` from global rank ``src`` along the chain ``src -> src+1 -> ... (mod P)``.

    In place, like :func:`torch.distributed.broadcast`: on return every rank's ``tensor`` holds
    ``src``'s values, bit for bit. The rank at chain position ``i`` receives chunk ``k`` at step
    ``i + k`` straight into its own tensor and forwards it at once.

    Args:
        tensor: Contiguous tensor, any shape and dtype (``n`` elements), same on every rank; CPU for
            gloo, CUDA for NCCL.
        src: Global rank of the source (a member of ``group``).
        chunk_bytes: Pipeline chunk, bytes (> 0; rounded down to whole elements, at least one);
            ``None`` picks :func:`lp_chunk_bytes`.
        group: Process group; ``None`` is the default group.

    Raises:
        InputError: on a non-tensor or non-contiguous ``tensor``, ``chunk_bytes <= 0`` or ``src``
            not in the group.
    """
    flat, chunk_bytes = _check_call(tensor, chunk_bytes)
    ctx = _context(group, src, "src", flat, chunk_bytes, "broadcast")
    if ctx is None:
        return
    pos = (ctx.rank - ctx.root) % ctx.size  # position in the chain; src is position 0
    last = pos == ctx.size - 1
    sched = _Schedule(ctx)
    for k in range(ctx.num_chunks):
        chunk = ctx.chunk(flat, k)
        if pos == 0:  # step k: send chunk k to the successor
            sched.at(k, 0, lambda c=chunk: sched.send(c, ctx.next))
        else:  # step pos + k: chunk k has arrived in place; forward it unless this is the chain's end
            sched.recv(pos + k, 0, chunk, ctx.prev, None if last else (lambda c=chunk: sched.send(c, ctx.next)))
    sched.run()


def lp_reduce(tensor: Any, dst: int = 0, *, op: Any = "sum", chunk_bytes: int | None = None,
              group: Any = None) -> None:
    """Reduce ``tensor`` over the group into global rank ``dst`` along the chain ``dst+1 -> ... -> dst``.

    In place on ``dst``, like :func:`torch.distributed.reduce`; the other ranks' tensors are left
    unchanged (torch leaves them unspecified). The chain's first rank sends its chunks; each
    following rank adds its own chunk ``k`` to the incoming partial result of chunk ``k`` (in a ring
    of ``_LOOKAHEAD + 2`` chunk buffers) and forwards it, so ``dst`` receives the partial result of
    ``P - 1`` ranks and combines its own.

    Args:
        tensor: Contiguous tensor, any shape (``n`` elements), a dtype ``op`` supports.
        dst: Global rank receiving the result (a member of ``group``).
        op: ``torch.distributed.ReduceOp`` ``SUM``, ``PRODUCT``, ``MIN``, ``MAX``, ``BAND``, ``BOR``,
            ``BXOR`` or the name in lower case (``"sum"``).
        chunk_bytes: Pipeline chunk, bytes (> 0; whole elements, at least one); ``None`` picks
            :func:`lp_chunk_bytes`.
        group: Process group; ``None`` is the default group.

    Raises:
        InputError: on a non-tensor or non-contiguous ``tensor``, ``chunk_bytes <= 0``, an
            unsupported ``op`` or ``dst`` not in the group.
    """
    flat, chunk_bytes = _check_call(tensor, chunk_bytes)
    combine = _combiner(op)
    ctx = _context(group, dst, "dst", flat, chunk_bytes, "reduce")
    if ctx is None:
        return
    pos = (ctx.rank - ctx.root - 1) % ctx.size  # dst is the chain's last position
    sched = _Schedule(ctx)
    ring = _Ring(flat, ctx.chunk_elems, _LOOKAHEAD + 2) if pos > 0 else None
    for k in range(ctx.num_chunks):
        chunk = ctx.chunk(flat, k)
        if pos == 0:  # step k: send own chunk k
            sched.at(k, 0, lambda c=chunk: sched.send(c, ctx.next))
        elif pos < ctx.size - 1:  # step pos + k: partial(k) <- partial(k) op own(k); forward partial(k)
            buf = ring.slot(k, chunk.numel())

            def forward(b=buf, c=chunk, k=k):
                combine(b, c)
                ring.sent[k % ring.depth] = sched.send(b, ctx.next)

            sched.recv(pos + k, 0, buf, ctx.prev, forward, before_post=lambda k=k: ring.release(k))
        else:  # dst, step pos + k: own(k) <- own(k) op partial(k)
            buf = ring.slot(k, chunk.numel())
            sched.recv(pos + k, 0, buf, ctx.prev, lambda b=buf, c=chunk: combine(c, b))
    sched.run()


def lp_allreduce(tensor: Any, *, op: Any = "sum", chunk_bytes: int | None = None, group: Any = None) -> None:
    """Allreduce ``tensor`` over the group: LP reduce along ``0 -> ... -> P-1``, LP broadcast back.

    In place, like :func:`torch.distributed.all_reduce`; every rank ends with the same bits (the
    chain's last rank computes each chunk once and broadcasts it). The two phases overlap over
    chunks on the two directions of each link: while the partial result of chunk ``k + 1`` moves
    forward, the final chunk ``k`` moves back. Chain position ``i`` receives partial chunk ``k`` at
    step ``i + k`` and final chunk ``k`` at step ``2 (P - 1) - i + k``.

    Args:
        tensor: Contiguous tensor, any shape (``n`` elements), a dtype ``op`` supports.
        op: As in :func:`lp_reduce` (default sum).
        chunk_bytes: Pipeline chunk, bytes (> 0; whole elements, at least one); ``None`` picks
            :func:`lp_chunk_bytes`.
        group: Process group; ``None`` is the default group.

    Raises:
        InputError: on a non-tensor or non-contiguous ``tensor``, ``chunk_bytes <= 0`` or an
            unsupported ``op``.
    """
    flat, chunk_bytes = _check_call(tensor, chunk_bytes)
    combine = _combiner(op)
    ctx = _context(group, None, "dst", flat, chunk_bytes, "allreduce")
    if ctx is None:
        return
    p, pos = ctx.size, ctx.rank  # the chain is 0 -> 1 -> ... -> P-1
    sched = _Schedule(ctx)
    ring = _Ring(flat, ctx.chunk_elems, _LOOKAHEAD + 1) if pos > 0 else None
    forward_sends: dict[int, Any] = {}  # the send still reading own(k), waited before own(k) is overwritten
    for k in range(ctx.num_chunks):
        chunk = ctx.chunk(flat, k)
        # Reduce phase, step pos + k (order 0 within a step).
        if pos == 0:
            def start(c=chunk, k=k):
                forward_sends[k] = sched.send(c, ctx.next)

            sched.at(k, 0, start)
        else:
            buf = ring.slot(k, chunk.numel())
            if pos < p - 1:  # own(k) <- own(k) op partial(k); forward
                def after(b=buf, c=chunk, k=k):
                    combine(c, b)
                    forward_sends[k] = sched.send(c, ctx.next)
            else:  # the chain's end: own(k) is final; start the broadcast back
                def after(b=buf, c=chunk):
                    combine(c, b)
                    sched.send(c, ctx.prev)
            sched.recv(pos + k, 0, buf, ctx.prev, after)
        # Broadcast phase, step 2 (P - 1) - pos + k (order 1): final chunk k arrives from the
        # successor into own(k), posted only once the forward send reading own(k) has completed
        # (sent at step pos + k), and goes on to the predecessor.
        if pos < p - 1:
            sched.recv(2 * (p - 1) - pos + k, 1, chunk, ctx.next,
                       None if pos == 0 else (lambda c=chunk: sched.send(c, ctx.prev)),
                       before_post=lambda k=k: forward_sends.pop(k).wait(), earliest_post=pos + k + 1)
    sched.run()


def time_collective(fn: Callable[[], Any], *, iters: int = 10, warmup: int = 2, repeats: int = 3,
                    group: Any = None) -> float:
    """Seconds per call of a collective, the slowest rank's, best of ``repeats``.

    Each repeat: barrier, ``iters`` calls of ``fn`` (a closure over the tensor, e.g.
    ``lambda: lp_allreduce(x)``), then the per-call time of every rank reduced with MAX, as
    nccl-tests does. CUDA work is synchronised before the clock stops. Call on every rank.

    Args:
        fn: Zero-argument callable running one collective.
        iters: Calls per repeat (>= 1).
        warmup: Untimed calls first (>= 0).
        repeats: Timed repeats; the minimum is returned (>= 1).
        group: Process group for the barrier and the MAX; ``None`` is the default group.

    Returns:
        Seconds per call.

    Raises:
        InputError: ``iters``, ``warmup`` or ``repeats`` not an int (bools refused) or below its
            minimum.
    """
    import torch
    import torch.distributed as dist

    for name, value, low in (("iters", iters, 1), ("warmup", warmup, 0), ("repeats", repeats, 1)):
        if not _is_int(value) or value < low:
            raise InputError(name, value, f"must be an int >= {low}")
    cuda = torch.cuda.is_available() and dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    for _ in range(warmup):
        fn()
    best = math.inf
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        dist.barrier(group=group)
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        if cuda:
            torch.cuda.synchronize()
        elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        best = min(best, float(elapsed.item()))
    return best


def allreduce_sweep(sizes_bytes: list[int], *, device: Any = "cpu", target_s: float = 0.05, max_iters: int = 50,
                    repeats: int = 2, group: Any = None) -> list[dict[str, Any]]:
    """Linear Pipelining allreduce against the backend's ``all_reduce`` over message sizes, in the
    current process group (call on every rank; the same numbers come back on every rank).

    Args:
        sizes_bytes: Message sizes in bytes (float32 tensors of ``size // 4`` elements).
        device: Where the tensors live (``cuda`` with NCCL).
        target_s: Timed seconds per repeat (sets the calls per repeat, at most ``max_iters``).
        max_iters: Most calls per repeat.
        repeats: Timed repeats; the fastest is kept.
        group: Process group (None: the default group).

    Returns:
        One row per size: ``bytes``, ``world_size`` and, for ``backend`` and ``lp``, ``seconds``
        (per call, slowest rank), ``algbw_bytes_per_s`` and ``busbw_bytes_per_s`` (see
        :func:`bandwidth`), plus ``speedup`` = backend seconds / LP seconds.

    Raises:
        InputError: an empty or non-positive size.
    """
    import torch
    import torch.distributed as dist

    if not sizes_bytes or any(int(b) <= 0 for b in sizes_bytes):
        raise InputError("sizes_bytes", sizes_bytes, "must be positive sizes")
    world = dist.get_world_size(group)
    rows = []
    for nbytes in sizes_bytes:
        numel = max(1, int(nbytes) // 4)
        x = torch.zeros(numel, device=device, dtype=torch.float32)  # zeros: no inf/denormal slow paths
        row: dict[str, Any] = {"bytes": numel * 4, "world_size": world}
        for impl, fn in (("backend", lambda: dist.all_reduce(x, group=group)),
                         ("lp", lambda: lp_allreduce(x, group=group))):
            probe = time_collective(fn, iters=1, warmup=1, repeats=1, group=group)
            iters = max(1, min(max_iters, int(target_s / max(probe, 1e-9))))
            seconds = time_collective(fn, iters=iters, warmup=0, repeats=repeats, group=group)
            bw = bandwidth(seconds, numel * 4, world, "allreduce")
            row[impl] = {"seconds": seconds, "algbw_bytes_per_s": bw.algbw_bytes_per_s,
                         "busbw_bytes_per_s": bw.busbw_bytes_per_s}
        row["speedup"] = row["backend"]["seconds"] / row["lp"]["seconds"]
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------- internals


def _is_int(value: Any) -> bool:
    """An integer (Python's or NumPy's), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_world_size(world_size: int) -> None:
    if not _is_int(world_size) or world_size < 1:
        raise InputError("world_size", world_size, "must be an int >= 1")


def _check_call(tensor: Any, chunk_bytes: int | None) -> tuple[Any, int | None]:
    """Checks that need no communication; returns the flat view of ``tensor``."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise InputError("tensor", type(tensor).__name__, "must be a torch.Tensor")
    if tensor.layout != torch.strided:
        raise InputError("tensor", tensor.layout, "must be a dense (strided) tensor")
    if not tensor.is_contiguous():
        raise InputError("tensor", Described(f"shape {tuple(tensor.shape)} stride {tensor.stride()}"),
                         "must be contiguous (call .contiguous() and copy the result back)")
    if chunk_bytes is not None and (not _is_int(chunk_bytes) or chunk_bytes <= 0):
        raise InputError("chunk_bytes", chunk_bytes, "must be an int > 0 (bytes) or None")
    return tensor.detach().view(-1), None if chunk_bytes is None else int(chunk_bytes)


def _combiner(op: Any) -> Callable[[Any, Any], None]:
    """``combine(a, b)``: ``a <- a op b`` in place."""
    import torch
    import torch.distributed as dist

    table: dict[str, Callable[[Any, Any], Any]] = {
        "sum": lambda a, b: a.add_(b),
        "product": lambda a, b: a.mul_(b),
        "min": lambda a, b: torch.minimum(a, b, out=a),
        "max": lambda a, b: torch.maximum(a, b, out=a),
        "band": lambda a, b: a.bitwise_and_(b),
        "bor": lambda a, b: a.bitwise_or_(b),
        "bxor": lambda a, b: a.bitwise_xor_(b),
    }
    if isinstance(op, str):
        name = op.lower()
    elif isinstance(op, dist.ReduceOp.RedOpType):
        name = op.name.lower()
    else:
        name = None
    if name not in table:
        raise InputError("op", op, f"must be a ReduceOp or name among {sorted(table)} (AVG and PREMUL_SUM "
                                   "are not supported)")
    return table[name]


@dataclass
class _Context:
    """One call's group geometry and chunking."""

    group: Any
    rank: int  # this process's rank in the group
    size: int  # P
    root: int  # group rank of src/dst (0 for allreduce)
    numel: int
    chunk_elems: int

    @property
    def num_chunks(self) -> int:
        return -(-self.numel // self.chunk_elems)

    def chunk(self, flat: Any, k: int) -> Any:
        return flat[k * self.chunk_elems:min(self.numel, (k + 1) * self.chunk_elems)]

    @property
    def prev(self) -> int:
        """Group rank of the predecessor: every chain is a rotation of ``0 -> 1 -> ... -> P-1``."""
        return (self.rank - 1) % self.size

    @property
    def next(self) -> int:
        """Group rank of the successor."""
        return (self.rank + 1) % self.size


def _context(group: Any, root: int | None, root_name: str, flat: Any, chunk_bytes: int | None,
             kind: str) -> _Context | None:
    """Group checks; ``None`` when there is nothing to communicate (P = 1, empty tensor, not a member)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise InputError("group", group, "torch.distributed is not initialized (call init_process_group first)")
    pg = group if group is not None else dist.group.WORLD
    rank = dist.get_rank(pg)
    if rank < 0:  # not a member of ``group``: nothing to do, as with torch's collectives
        return None
    size = dist.get_world_size(pg)
    group_root = 0
    if root is not None:
        if not _is_int(root):
            raise InputError(root_name, root, "must be an int (a global rank)")
        try:
            group_root = dist.get_group_rank(pg, int(root))
        except (ValueError, RuntimeError) as exc:
            raise InputError(root_name, root, f"is not a rank of the group ({exc})") from None
        if group_root is None or not 0 <= group_root < size:
            raise InputError(root_name, root, f"is not a rank of the group (size {size})")
    if size == 1 or flat.numel() == 0:
        return None
    itemsize = flat.element_size()
    if chunk_bytes is None:
        alpha_s, bytes_per_s = LINK_MODEL.get(str(dist.get_backend(pg)).lower(), LINK_MODEL["gloo"])
        chunk_bytes = lp_chunk_bytes(flat.numel() * itemsize, size, kind, alpha_s=alpha_s, bytes_per_s=bytes_per_s)
    return _Context(group=pg, rank=rank, size=size, root=group_root, numel=flat.numel(),
                    chunk_elems=max(1, chunk_bytes // itemsize))


@dataclass
class _Ring:
    """``depth`` scratch chunks reused round robin; ``sent`` holds the send still reading a slot."""

    flat: Any
    chunk_elems: int
    depth: int
    sent: dict[int, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        numel = self.flat.numel()
        self.depth = max(1, min(self.depth, -(-numel // self.chunk_elems)))
        self.buffers = self.flat.new_empty((self.depth, min(self.chunk_elems, numel)))

    def slot(self, k: int, numel: int) -> Any:
        return self.buffers[k % self.depth, :numel]

    def release(self, k: int) -> None:
        """Wait until the send that last read chunk ``k``'s slot has completed."""
        work = self.sent.pop(k % self.depth, None)
        if work is not None:
            work.wait()


class _Once:
    """A send's work handle that may be waited more than once (gloo's blocks on a second wait)."""

    __slots__ = ("work",)

    def __init__(self, work: Any):
        self.work = work

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None


@dataclass(order=True)
class _Event:
    due: int
    order: int
    seq: int
    action: Callable[[], None] | None = field(compare=False)
    buf: Any = field(default=None, compare=False)
    peer: int | None = field(default=None, compare=False)
    post: int = field(default=0, compare=False)
    before_post: Callable[[], None] | None = field(default=None, compare=False)
    work: Any = field(default=None, compare=False)


class _Schedule:
    """A rank's static LP timetable: receives posted ``_LOOKAHEAD`` steps ahead, waited in due order."""

    def __init__(self, ctx: _Context):
        self.ctx = ctx
        self.events: list[_Event] = []
        self.sends: list[Any] = []

    def at(self, due: int, order: int, action: Callable[[], None]) -> None:
        self.events.append(_Event(due, order, len(self.events), action))

    def recv(self, due: int, order: int, buf: Any, peer: int, action: Callable[[], None] | None, *,
             before_post: Callable[[], None] | None = None, earliest_post: int = 0) -> None:
        post = max(earliest_post, due - _LOOKAHEAD, 0)
        self.events.append(_Event(due, order, len(self.events), action, buf, peer, post, before_post))

    def send(self, buf: Any, peer: int) -> Any:
        import torch.distributed as dist

        work = _Once(dist.isend(buf, group=self.ctx.group, group_dst=peer))
        self.sends.append(work)
        return work

    def run(self) -> None:
        import torch
        import torch.distributed as dist

        events = sorted(self.events)
        posts = sorted((e for e in events if e.buf is not None), key=lambda e: (e.post, e.due, e.order, e.seq))
        i = 0
        try:
            with torch.no_grad():
                for event in events:
                    while i < len(posts) and posts[i].post <= event.due:
                        r = posts[i]
                        if r.before_post is not None:
                            r.before_post()
                        r.work = dist.irecv(r.buf, group=self.ctx.group, group_src=r.peer)
                        i += 1
                    if event.work is not None:
                        event.work.wait()
                        event.work = None
                    if event.action is not None:
                        event.action()
                for work in self.sends:
                    work.wait()
        finally:
            # The actions close over this schedule: drop them (and every Work handle) now, so no
            # reference cycle keeps the process group alive until a later GC pass. A group that
            # outlives destroy_process_group() leaves gloo's worker threads running into
            # interpreter shutdown, where freeing a Work's tensors aborts the process
            # (pytorch/pytorch#190489).
            events.clear()
            posts.clear()
            self.events.clear()
            self.sends.clear()

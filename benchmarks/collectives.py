"""Benchmark: Linear Pipelining broadcast, reduce and allreduce against the backend's own collectives.

Run with ``.venv/bin/python benchmarks/collectives.py`` (about 100 s on 2 cores: P = 2 and 4
processes on this machine, float32 messages of 1 KiB to 64 MiB in steps of 4x). ``--max-bytes 256M``
adds the 256 MiB point (about 3 GiB of memory at P = 4); ``--world-sizes``, ``--kinds`` and
``--sizes`` narrow the run; ``--json PATH`` writes every row for plots.

Every figure is measured in this run, on the same tensors, with the same timing
(:func:`paperline.kernels.comm.collectives.time_collective`: barrier, ``iters`` calls, per-call time
of the slowest rank, best of ``--repeats``):

* ``lp``: :func:`lp_allreduce`, :func:`lp_broadcast` (from rank 0), :func:`lp_reduce` (to rank 0)
  with ``chunk_bytes`` from the cost model (``--chunk-bytes`` fixes it);
* ``backend``: ``dist.all_reduce``, ``dist.broadcast``, ``dist.reduce`` of the backend: gloo on CPU,
  NCCL when ``--backend nccl`` and one GPU per rank is present.

Printed per size and P: time (ms), algorithm bandwidth and bus bandwidth (GB/s = 1e9 bytes/s,
nccl-tests conventions, see :func:`bandwidth`) for each, and ``lp/backend`` = backend time / LP
time (> 1: LP is faster). Before timing, each size checks LP against the backend once (integer-
valued floats, so the sums are exact). The processes share one machine's cores and memory bus, so
"links" here are loopback TCP through gloo; on this machine the figures measure gloo's and Python's
per-message overheads as much as bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import sys
import time

from _args import at_least, each_once, interruptible, output_file, positive, positive_seconds  # benchmarks/_args.py

KINDS = ("allreduce", "broadcast", "reduce")


def parse_bytes(text: str, what: str = "a message") -> int:
    """A message size such as ``64M`` or ``4096``: a positive multiple of 4 bytes (float32 elements).

    Raises:
        argparse.ArgumentTypeError: anything else (``0`` and ``3`` ran a 4-byte message: a trial),
        saying what the size is of (``what``).
    """
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    raw = text
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = text[-1] if text and text[-1] in units else ""
    try:
        nbytes = int(float(text[: len(text) - len(unit)]) * units[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a size (e.g. 4096, 64K, 256M)") from None
    if nbytes < 4 or nbytes % 4:
        raise argparse.ArgumentTypeError(f"{raw!r}: {what} is a positive multiple of 4 bytes (float32)")
    return nbytes


def parse_chunk_bytes(text: str) -> int:
    """An LP chunk size, as :func:`parse_bytes` (its error said "a message": a trial)."""
    return parse_bytes(text, "a chunk")


def human(nbytes: int) -> str:
    """``nbytes`` as ``1G``, ``64M`` or ``4K`` when a whole number of that unit, else the
    plain number."""
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size}{unit}"
    return f"{nbytes}"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (bound, then released), for the ranks'
    rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    """One rank (``mp.spawn``): per size and kind, check LP against the backend once, then
    time both; rank 0 prints each row and writes all rows to ``out_path`` (JSON)."""
    import torch
    import torch.distributed as dist

    from paperline.kernels.comm.collectives import bandwidth, lp_allreduce, lp_broadcast, lp_reduce, time_collective
    from paperline.kernels.train.ddp import process_group

    torch.set_num_threads(1)
    nccl = args.backend == "nccl"
    if nccl:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if nccl else torch.device("cpu")
    # rank 0's store listens on 127.0.0.1 only, and so does gloo (torch's tcp:// rendezvous would
    # listen on every interface)
    with process_group(args.backend, f"tcp://127.0.0.1:{port}", rank, world, timeout_s=1800):
        chunk = args.chunk_bytes
        impls = {
            "allreduce": {"lp": lambda x: lp_allreduce(x, chunk_bytes=chunk), "backend": dist.all_reduce},
            "broadcast": {"lp": lambda x: lp_broadcast(x, 0, chunk_bytes=chunk),
                          "backend": lambda x: dist.broadcast(x, 0)},
            "reduce": {"lp": lambda x: lp_reduce(x, 0, chunk_bytes=chunk), "backend": lambda x: dist.reduce(x, 0)},
        }
        rows = []
        for nbytes in args.sizes:
            numel = max(1, nbytes // 4)
            for kind in args.kinds:
                # Check once: integer-valued float32, so every summation order gives the same bits.
                base = (torch.arange(numel, device=device, dtype=torch.float32) % 7) + rank
                got, want = base.clone(), base.clone()
                impls[kind]["lp"](got)
                impls[kind]["backend"](want)
                ok = torch.equal(got, want) if kind != "reduce" or rank == 0 else torch.equal(got, base)
                flag = torch.tensor([0.0 if ok else 1.0], device=device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                del base, got, want
                x = torch.zeros(numel, device=device, dtype=torch.float32)  # zeros: no inf/denormal slow paths
                row = {"world_size": world, "kind": kind, "bytes": numel * 4, "check": flag.item() == 0.0}
                for impl in ("backend", "lp"):
                    fn = impls[kind][impl]
                    probe = time_collective(lambda: fn(x), iters=1, warmup=1, repeats=1)
                    iters = max(1, min(args.max_iters, int(args.target_s / max(probe, 1e-9))))
                    seconds = time_collective(lambda: fn(x), iters=iters, warmup=0, repeats=args.repeats)
                    bw = bandwidth(seconds, numel * 4, world, kind)
                    row[impl] = {"seconds": seconds, "iters": iters, "algbw_bytes_per_s": bw.algbw_bytes_per_s,
                                 "busbw_bytes_per_s": bw.busbw_bytes_per_s}
                row["speedup"] = row["backend"]["seconds"] / row["lp"]["seconds"]
                rows.append(row)
                if rank == 0:
                    print_row(row, flush=True)
                del x
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(rows, f)
        dist.barrier()


HEADER = (f"{'P':>2} {'kind':<9} {'size':>6} | {'backend ms':>10} {'algbw':>7} {'busbw':>7} | "
          f"{'LP ms':>10} {'algbw':>7} {'busbw':>7} | {'lp/backend':>10} {'check':>5}")


def print_row(row: dict, flush: bool = False) -> None:
    """Print one row under :data:`HEADER`: ms, algbw and busbw (GB/s) of both, the
    speedup and the check."""
    b, lp = row["backend"], row["lp"]
    print(f"{row['world_size']:>2} {row['kind']:<9} {human(row['bytes']):>6} | "
          f"{b['seconds'] * 1e3:>10.3f} {b['algbw_bytes_per_s'] / 1e9:>7.3f} {b['busbw_bytes_per_s'] / 1e9:>7.3f} | "
          f"{lp['seconds'] * 1e3:>10.3f} {lp['algbw_bytes_per_s'] / 1e9:>7.3f} {lp['busbw_bytes_per_s'] / 1e9:>7.3f} | "
          f"{row['speedup']:>9.2f}x {'ok' if row['check'] else 'FAIL':>5}", flush=flush)


def main(argv: list[str] | None = None) -> int:
    """Run the sweep for each world size and print the table; returns 0 when every check
    passed, 1 when one failed, 2 when ``--backend nccl`` lacks a GPU per rank."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", type=at_least(2), nargs="+", default=[2, 4])
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--min-bytes", type=parse_bytes, default="1K")
    parser.add_argument("--max-bytes", type=parse_bytes, default="64M", help="largest message (256M for the issue's full range)")
    parser.add_argument("--sizes", type=parse_bytes, nargs="+", default=None, help="explicit sizes, e.g. 64M 256M (overrides min/max)")
    parser.add_argument("--chunk-bytes", type=parse_chunk_bytes, default=None,
                        help="LP chunk (default: the cost model's, lp_chunk_bytes)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--target-s", type=positive_seconds, default=0.2, help="timed seconds per repeat (sets iters)")
    parser.add_argument("--max-iters", type=positive, default=200)
    parser.add_argument("--repeats", type=positive, default=5)
    parser.add_argument("--json", type=output_file, default=None, help="write all rows here")
    given = sys.argv[1:] if argv is None else argv
    # argparse takes `-64M` for an option ("--sizes: expected at least one argument": a trial); no option here
    # starts with a digit, so such a word is a negative size
    at = next((i for i, word in enumerate(given) if re.fullmatch(r"-\d[\w.]*", word)), None)
    if at is not None:
        # (named after the option it follows: `--repeats -1` was said to be a bad size, a trial)
        option = next((w for w in reversed(given[:at]) if w.startswith("--")), "--sizes").split("=")[0]
        if option in ("--sizes", "--min-bytes", "--max-bytes", "--chunk-bytes"):
            parser.error(f"argument {option}: {given[at]!r}: a size is a positive multiple of 4 bytes (float32), "
                         "e.g. 64M")
        parser.error(f"argument {option}: {given[at]!r}: must be positive")
    args = parser.parse_args(argv)
    # each once, in the order given (a repeated one was measured twice: a trial)
    args.world_sizes, args.kinds = each_once(args.world_sizes), each_once(args.kinds)
    args.sizes = each_once(args.sizes) if args.sizes else args.sizes
    if not args.sizes:
        if args.min_bytes > args.max_bytes:
            parser.error(f"--min-bytes {human(args.min_bytes)} is above --max-bytes {human(args.max_bytes)}")
        lo, hi, sizes = args.min_bytes, args.max_bytes, []
        while lo <= hi:
            sizes.append(lo)
            lo *= 4
        args.sizes = sizes
    cores = os.cpu_count() or 1
    if args.backend == "gloo" and max(args.world_sizes) > 4 * cores:  # (64 ran 2 minutes: a trial)
        parser.error(f"--world-sizes {max(args.world_sizes)}: at most {4 * cores} gloo ranks on this machine's "
                     f"{cores} core(s) (one process each; their times would be the time-sharing's)")
    if args.backend == "nccl":
        import torch

        if torch.cuda.device_count() < max(args.world_sizes):
            print(f"--backend nccl needs one GPU per rank: {torch.cuda.device_count()} visible, "
                  f"P up to {max(args.world_sizes)}", file=sys.stderr)
            return 2

    import tempfile

    import torch.multiprocessing as mp

    print(f"LP collectives vs {args.backend}, float32, GB/s = 1e9 bytes/s; lp/backend = backend time / LP time")
    if args.backend == "gloo" and max(args.world_sizes) > cores:  # (64 ranks on 2 cores ran 2 minutes unsaid: a trial)
        print(f"note: P up to {max(args.world_sizes)} ranks, one process each, share {cores} core(s): those times "
              "include the ranks' time-sharing")
    print(HEADER)
    all_rows = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.world_sizes:
            out_path = os.path.join(tmp, f"rows-{world}.json")
            # the ranks start with SIGINT ignored: a terminal's Ctrl-C reached them too, each printing
            # its KeyboardInterrupt traceback (a trial); this process takes it, and interruptible()
            # stops them and says it once
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                ranks = mp.spawn(worker, args=(world, free_port(), args, out_path), nprocs=world, join=False)
            finally:
                signal.signal(signal.SIGINT, previous)
            while not ranks.join():
                pass
            with open(out_path) as f:
                all_rows.extend(json.load(f))
    print(f"total {time.perf_counter() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(all_rows, f, indent=1)
    return 0 if all(r["check"] for r in all_rows) else 1


if __name__ == "__main__":
    sys.exit(interruptible(main))

"""Argument types shared by the benchmark scripts: a bad argument is argparse's one line (exit
status 2) before anything is measured, not a traceback minutes later (fresh-user trials)."""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def positive(text: str) -> int:
    """A whole number >= 1."""
    return at_least(1)(text)


def at_least(low: int) -> Callable[[str], int]:
    """The type of a whole number >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{text!r}: at least {low}")
        return value

    parse.__name__ = f"at_least_{low}"
    return parse


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0 (``nan`` and ``inf`` ended in the ranks' tracebacks: a trial)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: a finite number of seconds > 0")
    return value


def each_once(items: Iterable[T]) -> list[T]:
    """``items`` in their order, each once: a list option's duplicate (``gemm.py --sizes 64,64``,
    ``video_curation.py --splitters content,content``) was measured twice (a trial)."""
    return list(dict.fromkeys(items))


def output_file(text: str) -> Path:
    """A file the results are written to after the measurements: a directory, or a path whose
    directory does not exist, was found only after minutes of measuring (a trial)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; name a file")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: no directory {str(path.parent)!r}")
    # ... nor one that cannot be written (/proc/x.json, a read-only mount: the results were lost to a
    # traceback at the end, a trial): opened for appending (an existing file is left as it is), and
    # a file made by the check removed again
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} cannot be written ({exc.strerror or exc})") from None
    if not existed:
        path.unlink(missing_ok=True)
    return path


def one_line_errors(parser: argparse.ArgumentParser, fn: Callable[[], Any]) -> Any:
    """Run ``fn``; paperline's own errors (bad input found later, e.g. by a kernel) end it with
    the parser's one line and exit status 2 instead of a traceback."""
    from paperline.infra.errors import PaperlineError
    from paperline.kernels.errors import InputError

    try:
        return fn()
    except (InputError, PaperlineError) as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")


def require_cuda(parser: argparse.ArgumentParser, cupy: bool = False) -> None:
    """``--device cuda``'s check: where no CUDA device is usable (or, with ``cupy``, CuPy is not
    installed) the run ends with the parser's one line naming ``--device``; the library's own
    refusal advises ``device=auto`` and ``PAPERLINE_DEVICE``, the pipelines' parameter, which no
    benchmark takes (a trial)."""
    import importlib.util

    from paperline.infra.device import gpu_usable

    if not gpu_usable():
        why = "no usable CUDA device (the GPU extra, make install-gpu, on a machine with an NVIDIA driver)"
    elif cupy and importlib.util.find_spec("cupy") is None:
        why = "CuPy is not installed (the GPU extra: make install-gpu)"
    else:
        return
    parser.exit(2, f"{parser.prog}: error: --device cuda: {why}; leave --device out to measure on the CPU\n")


def stop_children(timeout: float = 5.0, keep: frozenset[int] = frozenset()) -> list[int]:
    """Terminate every process this one started, and their children (SIGTERM, then SIGKILL for any
    left after ``timeout`` seconds), but those in ``keep``; returns their pids. A benchmark stopped
    by ``kill`` left its ranks training (compressed_training's two, collectives' spawned ones) and
    its pool's campaigns running (nas): only a Ctrl-C in a terminal reaches them too (a trial)."""
    import psutil

    def stoppable(child: psutil.Process) -> bool:
        # multiprocessing's resource tracker ignores SIGTERM (5 s lost waiting, then killed) and
        # ends by itself once this process is gone
        try:
            return not any("resource_tracker" in part for part in child.cmdline())
        except psutil.Error:
            return False

    children = [c for c in psutil.Process().children(recursive=True) if c.pid not in keep and stoppable(c)]
    for child in children:
        try:
            child.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(children, timeout=timeout)
    for child in alive:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=timeout)
    return [c.pid for c in children]


def interruptible(main: Callable[[], Any]) -> int:
    """Run a benchmark's ``main`` with SIGTERM (``kill``, ``timeout``) taken as a Ctrl-C, so that its
    ``with`` blocks remove what they made (a killed gemm run left 385 MB of operand files in
    ``TMPDIR``: a trial), then the processes it started are stopped (:func:`stop_children`; those
    running before it are left), and either one ends it with one line instead of a
    ``KeyboardInterrupt`` traceback. A second SIGTERM meanwhile is ignored (it would cut the
    clean-up short). Returns ``main``'s exit status (None: 0), or 128 + the signal's number (130
    for Ctrl-C, 143 for SIGTERM); the previous SIGTERM handler is restored."""
    import signal
    import sys

    got: list[int] = []

    def terminate(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        got.append(signum)
        raise KeyboardInterrupt

    import psutil

    # what ran before main (a test's servers, when a test calls this) is not main's to stop (a review)
    before = frozenset(c.pid for c in psutil.Process().children(recursive=True))
    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        return main() or 0
    except KeyboardInterrupt:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stop_children(keep=before)
        print("interrupted: the run stopped", file=sys.stderr)
        return 128 + (got[0] if got else signal.SIGINT)
    finally:
        signal.signal(signal.SIGTERM, previous)


def interleaved(runs: dict[str, tuple[Callable[[], Any], int]], rounds: int,
                say: Callable[[str], Any] | None = None) -> dict[str, list[tuple[float, Any]]]:
    """Time each run once per round, the runs alternating within a round (run ``name`` in the first
    ``reps`` rounds only): a host whose speed drifts over the minutes slows every row of a round
    alike, where back-to-back repeats of one row then the next put the drift into the ratio (best
    of 3 sequential repeats moved between 1.17x and 1.41x on one idle host; alternating, 1.16-1.29).
    ``say`` (e.g. print) gets a line per run timed (the default run was silent for three minutes:
    a trial). Also gemm's out-of-core step: its two runs one after the other made the ratio 1.63
    on a loaded host (a trial)."""
    import time

    times: dict[str, list[tuple[float, Any]]] = {name: [] for name in runs}
    for r in range(rounds):
        for name, (fn, reps) in runs.items():
            if r < reps:
                t = time.perf_counter()
                out = fn()
                times[name].append((time.perf_counter() - t, out))
                if say is not None:
                    say(f"  round {r + 1}/{min(rounds, max(n for _, n in runs.values()))}: {name} "
                        f"{times[name][-1][0]:.2f} s")
    return times


@contextlib.contextmanager
def quiet_dask_close() -> Iterator[None]:
    """The innermost of a ``with LocalCluster(...), Client(...)``: an interrupt there closes the client
    under a waiting ``gather``, whose waits fail with ``AllExit``, each then logged by asyncio as
    "Task exception was never retrieved" with its traceback (tensor_factorization's Ctrl-C: a
    trial); interrupted, asyncio's log is silenced, and :func:`interruptible` says it in one line."""
    try:
        yield
    except KeyboardInterrupt:
        import logging

        logging.getLogger("asyncio").setLevel(logging.CRITICAL)
        raise


def verdict(ok: bool) -> str:
    """A target's word: ``met`` or ``missed``."""
    return "met" if ok else "missed"


def as_printed(value: float, spec: str) -> float:
    """``value`` as ``format(value, spec)`` prints it: each benchmark judges a target on the number
    its line shows (0.8496 printed "0.850" was judged missed against 0.85: a review)."""
    return float(format(value, spec))


def ratio_spec(value: float, digits: int = 3) -> str:
    """The format a ratio prints with: ``digits`` decimals, or ``digits`` significant digits where
    the decimals would show fewer (gemm at n=64, tiny times, printed ratios of 0.000: a trial)."""
    return f".{digits}f" if not math.isfinite(value) or abs(value) >= 0.1 or value == 0 else f"#.{digits}g"


def ratio_text(value: float, digits: int = 3) -> str:
    """``value`` as :func:`ratio_spec` prints it: ``0.950``, ``1.234``, ``0.0123``, never ``0.000``."""
    return format(value, ratio_spec(value, digits))

"""The errors kernels raise: on bad input (:class:`InputError`, with the checks that raise it), and
when the Dask scheduler a kernel drives went away (:class:`ClusterLost`, from
:func:`scheduler_workers`). Kernels import nothing from the rest of paperline."""

from __future__ import annotations

import contextlib
import math
import numbers
import weakref


class Described(str):
    """What an :class:`InputError` saw, described where the value itself is too large or cannot be
    typed (an array, a column's statistics): shown in angle brackets, ``values=<3 NaN and 0 inf of
    100>``, where a plain string would be quoted as if the user had typed it
    (``values='3 NaN and 0 inf of 100'``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"<{self}>"


class InputError(ValueError):
    """Bad input at a public boundary: the message names the argument and the value seen (its
    ``repr``, cut at 120 characters; a :class:`Described` value in angle brackets)."""

    def __init__(self, argument: str, value: object, problem: str):
        self.argument = argument
        self.value = value
        shown = repr(value)
        if len(shown) > 120:
            shown = shown[:116] + "...>" if isinstance(value, Described) else shown[:117] + "..."
        self.problem = problem
        super().__init__(f"{argument}={shown}: {problem}")

    def __reduce__(self):  # plain pickle (Dask results, Prefect states) rebuilds it from its parts
        return (type(self), (self.argument, self.value, self.problem))


def unknown_name(kind: str, name: object, known: list[str] | tuple[str, ...]) -> str:
    """The problem text for an unknown ``kind`` (e.g. ``"optimizer"``) named ``name``: "unknown
    optimizer; did you mean lamoo? known: alphax, bo, ...", the guess where one of ``known`` is
    close (a typo got only the list: a trial)."""
    import difflib  # noqa: PLC0415

    close = difflib.get_close_matches(name.lower(), list(known), n=1) if isinstance(name, str) else []
    guess = f"did you mean {close[0]}? " if close else ""
    return f"unknown {kind}; {guess}known: {', '.join(known)}"


def is_real(value: object) -> bool:
    """A real number: a Python int or float or a NumPy integer or float scalar (``numbers.Real``),
    not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def as_float(value: object) -> float:
    """A real as a Python float; a NumPy float32/float16 scalar by its shortest decimal form, the
    number the caller wrote (``np.float32(0.1)`` -> ``0.1``, not ``0.10000000149``, which would
    e.g. turn ``ceil(0.1 * 50)`` into 6)."""
    if type(value).__module__ == "numpy" and getattr(value, "itemsize", 8) < 8:
        return float(str(value))
    return float(value)  # type: ignore[arg-type]


def check_int(argument: str, value: object, low: int, high: int | None = None, *, unit: str = "") -> int:
    """``value`` as an int in ``[low, high]`` (``high`` None: no upper bound). Python and NumPy
    integers (``numbers.Integral``) are integers; bools are not. ``unit``, e.g. ``"bytes, e.g.
    1 << 30"``, ends the message in parentheses.

    Raises:
        InputError: not an integer, or out of range.
    """
    unit = f" ({unit})" if unit else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InputError(argument, value, f"must be an integer{unit}")
    if value < low or (high is not None and value > high):
        span = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise InputError(argument, value, f"must be {span}{unit}")
    return int(value)


def check_number(argument: str, value: object, *, low: float | None = None, high: float | None = None,
                 low_open: bool = False, high_open: bool = False) -> float:
    """``value`` as a finite float in the range given by ``low``/``high`` (None: unbounded).

    ``low_open``/``high_open`` exclude the bound itself (``low=0, low_open=True``: ``> 0``). Ints
    and floats (Python or NumPy) are numbers; bools, strings and complex numbers are not.

    Raises:
        InputError: not a real number, NaN or infinite, or out of range. The message names
            ``argument`` and reads e.g. ``lr=-1.0: must be a finite number > 0``.
    """
    if not is_real(value):
        raise InputError(argument, value, "must be a real number")
    number = as_float(value)
    bounds = []
    if low is not None:
        bounds.append(f"{'>' if low_open else '>='} {low:g}")
    if high is not None:
        bounds.append(f"{'<' if high_open else '<='} {high:g}")
    wanted = "must be a finite number" + (" " + " and ".join(bounds) if bounds else "")
    if not math.isfinite(number):
        raise InputError(argument, value, wanted)
    if low is not None and (number < low or (low_open and number == low)):
        raise InputError(argument, value, wanted)
    if high is not None and (number > high or (high_open and number == high)):
        raise InputError(argument, value, wanted)
    return number


_SCHEDULER_ADDRESS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # client -> its scheduler's address


class ClusterLost(ConnectionError):
    """The Dask scheduler a run's client was connected to went away (killed, its machine lost):
    Dask then reports no workers at all, and a run failed with ``KeyError: 'workers'`` (a trial)."""


def scheduler_workers(client: object) -> list[str]:
    """The addresses of the workers ``client``'s Dask scheduler knows now, sorted: asked of the
    scheduler itself.

    Not through ``client.scheduler_info()``: that call refreshes the client's cached identity and
    returns the cache, which the client's own periodic refresh (every 2 s) overwrites with an
    identity that lists no workers; the two race, and a live cluster read as one whose workers had
    all left (a gemm run failed with "worker(s) ... left the Dask cluster" at its start under load;
    18 of 2,000 reads with the refresh every 5 ms).

    Args:
        client: a synchronous ``distributed.Client``.

    Raises:
        ClusterLost: the client has lost its scheduler (closed, or the connection to it fails:
            Dask's own connect timeout), naming the scheduler's address. A scheduler that is
            slow to answer is waited for (a busy one is not a lost one).
    """
    status = getattr(client, "status", "?")
    rpc = getattr(client, "scheduler", None)
    info: dict = {}
    if status in ("running", "connecting") and rpc is not None:
        with contextlib.suppress(OSError):  # (comm errors are OSErrors)
            info = client.sync(rpc.identity, n_workers=-1)  # type: ignore[attr-defined]
    if "address" in info:
        with contextlib.suppress(TypeError):  # (a client that takes no weak reference: its address unknown later)
            _SCHEDULER_ADDRESS[client] = info["address"]  # (a client that lost it knows it no more)
    if "workers" not in info:
        address = getattr(rpc, "address", None) or _SCHEDULER_ADDRESS.get(client, "(unknown)")
        raise ClusterLost(f"the Dask scheduler at {address} went away during the run (the run's client lost it: "
                          f"{status}); `paperline status` checks the configured one, and "
                          "the same command runs again once it is back")
    return sorted(info["workers"])

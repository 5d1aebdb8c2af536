"""The error kernels raise on bad input (kernels import nothing from the rest of paperline)."""

from __future__ import annotations


class InputError(ValueError):
    """Bad input at a public boundary: the message names the argument and the value seen."""

    def __init__(self, argument: str, value: object, problem: str):
        self.argument = argument
        self.value = value
        shown = repr(value)
        if len(shown) > 120:
            shown = shown[:117] + "..."
        self.problem = problem
        super().__init__(f"{argument}={shown}: {problem}")

    def __reduce__(self):  # plain pickle (Dask results, Prefect states) rebuilds it from its parts
        return (type(self), (self.argument, self.value, self.problem))


def check_int(argument: str, value: object, low: int, high: int | None = None) -> int:
    """``value`` as an int in ``[low, high]`` (``high`` None: no upper bound).

    Raises:
        InputError: not an integer (bools are refused), or out of range.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(argument, value, "must be an integer")
    if value < low or (high is not None and value > high):
        span = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise InputError(argument, value, f"must be in {span}")
    return int(value)

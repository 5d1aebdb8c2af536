"""A decorator registry that refuses duplicate names (datasets, solvers, ...)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> object mapping filled by a decorator.

    Example:
        >>> solvers = Registry[Callable]("solver")
        >>> @solvers.register("als")
        ... def als(...): ...

    Raises:
        ValueError: registering a name twice.
        KeyError: looking up an unknown name (the message lists the known ones).
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """A decorator that registers its object under ``name`` and returns it unchanged.

        Raises:
            ValueError: (when the decorator is applied) ``name`` is already registered.
        """
        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = obj
            return obj

        return deco

    def __getitem__(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            known = ", ".join(sorted(self._items)) or "none"
            raise KeyError(f"unknown {self.kind} {name!r}; known: {known}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._items)

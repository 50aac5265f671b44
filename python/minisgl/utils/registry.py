"""Registry: maps the names users type (`--attn torch`) to factories (chapter 5)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self._kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        if name in self._items:
            raise KeyError(f"{self._kind} {name!r} is registered twice")

        def decorator(item: T) -> T:
            self._items[name] = item
            return item

        return decorator

    def __getitem__(self, name: str) -> T:
        if name not in self._items:
            raise KeyError(f"unknown {self._kind} {name!r}; choose from: {', '.join(self.names())}")
        return self._items[name]

    def names(self) -> list[str]:
        return sorted(self._items)

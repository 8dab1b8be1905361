"""A name -> function table filled by a decorator: how the trainer's parts are chosen from a recipe."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """``@REGISTRY.register("name")`` adds a function; ``REGISTRY["name"]`` finds it or says which
    names exist. ``kind`` names the entries in messages (``advantage estimator``)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(entry: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = entry
            return entry

        return add

    def add(self, name: str, entry: T) -> T:
        return self.register(name)(entry)

    def __getitem__(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r} (known: {', '.join(sorted(self._entries))})") from None

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))

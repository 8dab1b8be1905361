"""How a recipe names code: a name -> function table filled by a decorator (how the trainer's parts
are chosen), and :func:`load_hook`, which imports a user's ``package.module:function``."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from glmpost.errors import UsageError

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


def is_hook_spec(spec: str) -> bool:
    """``package.module:function`` (a colon with a dotted module path before it)."""
    module, sep, attr = spec.partition(":")
    return bool(sep and module and attr) and all(part.isidentifier() for part in module.split(".") + attr.split("."))


def load_hook(spec: str, *, where: str) -> Any:
    """Import ``package.module:function``; ``where`` names the option or recipe key in errors.

    Raises :class:`UsageError` (one line) when the module does not import, the attribute is missing
    or is not callable.
    """
    if not is_hook_spec(spec):
        raise UsageError(f"{where}: {spec!r} is not package.module:function")
    module_name, _, attr_path = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure of user code is the user's to fix
        raise UsageError(f"{where}: cannot import {module_name} for {spec} ({_one_line(exc)})") from None
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            raise UsageError(f"{where}: {module_name} has no attribute {attr_path!r} (from {spec})")
        obj = getattr(obj, attr)
    if not callable(obj):
        raise UsageError(f"{where}: {spec} is a {type(obj).__name__}, not a function")
    return obj


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__

"""Settings defined once: a config dataclass field carries its default and its help text, and the
command-line option of a stage is derived from it (``glmpost.commands.options``).

``setting(default, help)`` is ``dataclasses.field`` with that metadata; ``flag`` spells the option
when it is not ``--field-name`` (``--deepspeed``, ``--icepop/--no-icepop``); ``min`` / ``max``
bound it on the command line. Library errors name the field (``lr = 0 is out of range``); the
command translates the name to its flag.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def setting(default: Any, help: str, *, flag: str | None = None, min: float | None = None,
            max: float | None = None) -> Any:
    return dataclasses.field(default=default, metadata={"help": help, "flag": flag, "min": min, "max": max})


def setting_of(cls: type, name: str) -> tuple[Any, dict[str, Any]]:
    """``(default, metadata)`` of field ``name`` of dataclass ``cls``."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            if "help" not in f.metadata:
                raise KeyError(f"{cls.__name__}.{name} has no help text (declare it with setting())")
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            return default, dict(f.metadata)
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def from_values(cls: type, values: dict[str, Any], **overrides: Any):
    """``cls`` built from the entries of ``values`` named after its fields (the parsed options)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names}, **overrides)


class SettingError(ValueError):
    """A config field whose value is refused: ``"<field> = <value> <problem>"``; a command says it
    with the option's flag instead (``glmpost.commands.options.flags_in_errors``)."""

    def __init__(self, field: str, value: Any, problem: str):
        super().__init__(f"{field} = {value!r} {problem}")
        self.field, self.value, self.problem = field, value, problem


def domain_assignment(value: Any, *, flag: str, example: str) -> tuple[str, str]:
    """``DOMAIN=VALUE`` (a ``--route`` / ``--verifier`` item) as ``(domain, value)``, both stripped;
    anything else is a usage error that shows ``flag`` and ``example`` (``DOMAIN=CHECKPOINT``)."""
    from glmpost.errors import UsageError

    if isinstance(value, tuple):
        return value
    domain, sep, rest = str(value).partition("=")
    if not sep or not domain.strip() or not rest.strip():
        raise UsageError(f"{flag} {value!r}: expected {example}")
    return domain.strip(), rest.strip()

"""The components of a reward mixture as specs: ``--reward`` / ``--penalty`` strings and recipe
tables parsed into :class:`ComponentSpec` (``name``, ``source``, ``weight``, source options), each
source's options typed and checked before anything runs (:mod:`glmpost.rewards.mixture` evaluates
them)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from glmpost.errors import UsageError
from glmpost.toml import tomllib

KINDS = ("reward", "penalty")
COMMON_KEYS = ("name", "source", "weight")
# source -> {option: (type, required)}
SOURCES: dict[str, dict[str, tuple[type, bool]]] = {
    "verifier": {"verifier": (str, False)},
    "format": {"pattern": (str, True)},
    "length": {"max_tokens": (int, True), "ramp_tokens": (int, False)},
    "overlong": {"cache_tokens": (int, True), "max_tokens": (int, False)},
    "truncated": {},
    "orm": {"checkpoint": (str, True), "activation": (str, False), "batch_size": (int, False), "attention": (str, False)},
    "judge": {
        "checkpoint": (str, True),
        "template": (str, False),
        "max_new_tokens": (int, False),
        "score_pattern": (str, False),
        "max_score": (float, False),
        "batch_size": (int, False),
        "attention": (str, False),
    },
}
MODEL_SOURCES = ("orm", "judge")


@dataclass(frozen=True)
class ComponentSpec:
    """One term of the mixture: ``kind`` is ``reward`` (``+ weight * value``) or ``penalty``
    (``- weight * value``); ``options`` are the source's settings (see the module docstring)."""

    name: str
    source: str
    weight: float = 1.0
    kind: str = "reward"
    options: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "weight": self.weight, **dict(self.options)}


def default_components() -> list[ComponentSpec]:
    """With no component configured: one reward ``correct`` = the domain verifier, weight 1."""
    return [ComponentSpec("correct", "verifier", 1.0, "reward")]


# --------------------------------------------------------------------------------------------
# Parsing specs: TOML tables (recipes) or "key=value,key=value" / inline-table strings (flags)


def parse_spec_string(text: str) -> dict[str, Any]:
    """``name=x,source=format,pattern="a,b"`` or a TOML inline table ``{name = "x", ...}`` as a dict.

    In the ``key=value`` form each value is read as a TOML value when it is one (numbers, booleans,
    quoted strings) and as a bare string otherwise; use the inline-table form for values with commas.
    """
    text = text.strip()
    if text.startswith("{"):
        try:
            return dict(tomllib.loads(f"spec = {text}")["spec"])
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"not a TOML inline table ({exc})") from None
    table: dict[str, Any] = {}
    for item in text.split(","):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"{item.strip()!r} is not KEY=VALUE")
        if key in table:
            raise ValueError(f"key {key!r} is given twice")
        table[key] = _toml_scalar(raw.strip())
    return table


def _toml_scalar(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def parse_component(value: Mapping[str, Any] | str, *, kind: str) -> ComponentSpec:
    """A validated :class:`ComponentSpec` from a recipe table or a flag string.

    Raises ``ValueError`` (one line) for an unknown source or key, a missing required option, a
    value of the wrong type, a negative or non-finite weight, or a regex that does not compile.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    table = parse_spec_string(value) if isinstance(value, str) else dict(value)
    source = table.get("source")
    if source not in SOURCES:
        known = ", ".join(SOURCES)
        raise ValueError(f"unknown source {source!r} (known: {known})" if source is not None else f"needs a source (one of {known})")
    allowed = SOURCES[source]
    unknown = [k for k in table if k not in COMMON_KEYS and k not in allowed]
    if unknown:
        keys = ", ".join([*COMMON_KEYS, *allowed])
        raise ValueError(f"unknown key {unknown[0]!r} for source {source!r} (known: {keys})")
    name = table.get("name", source)
    if not isinstance(name, str) or not name.strip() or name != name.strip():
        raise ValueError(f"name must be a non-empty string without surrounding spaces, got {name!r}")
    weight = table.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
        raise ValueError(f"component {name!r}: weight must be a finite number >= 0, got {weight!r} (penalties are subtracted)")
    options: dict[str, Any] = {}
    for key, (typ, required) in allowed.items():
        if key not in table:
            if required:
                raise ValueError(f"component {name!r}: source {source!r} needs {key!r}")
            continue
        options[key] = _typed(name, key, table[key], typ)
    spec = ComponentSpec(name, source, float(weight), kind, options)
    _check_options(spec)
    return spec


def _typed(name: str, key: str, value: Any, typ: type) -> Any:
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, typ) or isinstance(value, bool):
        raise ValueError(f"component {name!r}: {key} must be {typ.__name__}, got {value!r}")
    return value


def _check_options(spec: ComponentSpec) -> None:
    o, name = spec.options, spec.name
    if spec.source == "format":
        try:
            re.compile(o["pattern"])
        except re.error as exc:
            raise ValueError(f"component {name!r}: pattern {o['pattern']!r} is not a regex ({exc})") from None
    elif spec.source == "length":
        if o["max_tokens"] < 0:
            raise ValueError(f"component {name!r}: max_tokens must be >= 0")
        if o.get("ramp_tokens", 1) < 1:
            raise ValueError(f"component {name!r}: ramp_tokens must be >= 1")
    elif spec.source == "overlong":
        if o["cache_tokens"] < 1:
            raise ValueError(f"component {name!r}: cache_tokens must be >= 1")
        if "max_tokens" in o and o["max_tokens"] < o["cache_tokens"]:
            raise ValueError(f"component {name!r}: max_tokens {o['max_tokens']} must be >= cache_tokens {o['cache_tokens']}")
    elif spec.source in MODEL_SOURCES:
        if o.get("batch_size", 1) < 1:
            raise ValueError(f"component {name!r}: batch_size must be >= 1")
        if o.get("attention", "native") not in ("native", "reference"):
            raise ValueError(f"component {name!r}: attention must be native or reference, got {o['attention']!r}")
        if spec.source == "orm" and o.get("activation", "sigmoid") not in ("sigmoid", "none"):
            raise ValueError(f"component {name!r}: activation must be sigmoid or none, got {o['activation']!r}")
        if spec.source == "judge":
            # lazily: the model rewards import torch and transformers, the verifier-only mixture does not
            from glmpost.rewards.models import GenerativeJudgeConfig, check_judge_config

            try:
                check_judge_config(GenerativeJudgeConfig(**o))
            except ValueError as exc:
                raise ValueError(f"component {name!r}: {exc}") from None


def uses_domain_routing(specs: Sequence[ComponentSpec]) -> bool:
    """Whether some component routes records to a verifier by their ``domain``."""
    return any(spec.source == "verifier" and "verifier" not in spec.options for spec in specs)


def check_components(specs: Sequence[ComponentSpec]) -> list[ComponentSpec]:
    """Component names must be unique across rewards and penalties (they share ``rewards``)."""
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise UsageError(f"component name {spec.name!r} is used twice (rewards and penalties share one namespace)")
        seen.add(spec.name)
    return list(specs)


# --------------------------------------------------------------------------------------------
# The formula

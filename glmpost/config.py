"""Settings defined once: a config dataclass field carries its default and its help text, and the
command-line option of a stage is derived from it (``glmpost.commands.options``).

``setting(default, help)`` is ``dataclasses.field`` with that metadata; ``flag`` spells the option
when it is not ``--field-name`` (``--deepspeed``, ``--icepop/--no-icepop``); ``min`` / ``max``
bound it on the command line. ``shared(name)`` is one of the settings several stages have
(``device``, ``overwrite``, ``deterministic_topk``, ``attention``, ``zstd_level``, ``shard_index``, ``num_shards``),
declared once here.

Library errors name config fields, not flags: :class:`SettingError` (``lr = 0 is out of range``)
and :class:`ConfigError` (``{engine_name} sglang needs {server} URL``); the command that parsed
the options says them with the flags the user typed (``--engine sglang needs --server URL``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import string
from typing import Any, Callable

from glmpost.errors import UsageError


def setting(default: Any, help: str, *, flag: str | None = None, min: float | None = None,
            max: float | None = None, above: float | None = None, below: float | None = None,
            cli: dict[str, Any] | None = None) -> Any:
    """A config field with its default (a list or dict default is copied per instance), help text,
    flag and bounds (``min`` / ``max`` inclusive, ``above`` / ``below`` exclusive; a float option
    is finite whatever its bounds); ``cli``: how the command line takes it when that is not the
    field's type (``annotation``, and typer's ``metavar``, ``parser``, ``show_default``, ...)."""
    metadata = {"help": help, "flag": flag, "min": min, "max": max, "above": above, "below": below, "cli": cli or {}}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=functools.partial(copy.copy, default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


SHARED_SETTINGS: dict[str, dict[str, Any]] = {
    "device": dict(default="auto", help="auto (npu, else cuda, else cpu), cpu, cuda[:N] or npu[:N]; a training stage "
                   "under a launcher takes its rank's local device."),
    "overwrite": dict(default=False, help="Redo and replace what an earlier run wrote to --out (a stage that splits "
                      "its work into tasks: this task's shards; any other: the whole output directory)."),
    "deterministic_topk": dict(default=True, flag="--deterministic-topk/--torch-topk", help="DSA indexer top-k with "
                               "ties to the lower position (the same keys in rollout and training); --torch-topk "
                               "keeps torch.topk's tie order."),
    "attention": dict(default="native", help="GLM-5 attention implementation: native (glmpost's MLA over the "
                      "compressed KV cache, attention over the DSA top-k keys only: linear in context) or reference "
                      "(transformers' modules, dense masks); the same weights and checkpoints."),
    "chat_template_kwargs": dict(default="{}", help="Extra arguments of the checkpoint's chat template, a JSON object "
                                 "(GLM: '{\"enable_thinking\": false}', '{\"clear_thinking\": false}'), passed wherever "
                                 "prompts are rendered; recorded in stage.json."),
    "zstd_level": dict(default=3, help="zstd compression level of the output shards.", min=1, max=22),
    "shard_index": dict(default=0, help="This task's index among --num-shards (a Slurm array task id).", min=0),
    "num_shards": dict(default=1, help="Tasks splitting this stage's work (a Slurm array's size); each writes "
                       "only its share.", min=1),
}


def shared(name: str) -> Any:
    """The setting ``name`` of :data:`SHARED_SETTINGS` (the same default and help in every stage)."""
    return setting(**SHARED_SETTINGS[name])


def section(cls: type, *, help: dict[str, str] | None = None) -> Any:
    """A sub-config of a config tree (rollout's ``engine``, ``multi_turn``, ``context``): its settings
    are settings of the whole tree, flattened by name (each name once in a tree), so a stage's
    options and its recipe keys stay flat while the code reads ``config.engine.server``. ``help``
    words a setting for this tree where the section's own words would not fit it (a trainer's
    ``--follow`` publishes versions, not shards)."""
    return dataclasses.field(default_factory=cls, metadata={"section": cls, "help": dict(help or {})})


def leaves(cls: type) -> list[tuple[dataclasses.Field, type]]:
    """Every field of the config tree ``cls`` that is not a section, with the dataclass declaring it."""
    found = []
    for f in dataclasses.fields(cls):
        found += leaves(f.metadata["section"]) if "section" in f.metadata else [(f, cls)]
    return found


def setting_of(cls: type, name: str) -> tuple[Any, dict[str, Any]]:
    """``(default, metadata)`` of setting ``name`` of the config tree ``cls`` (its help as the
    section holding it words it)."""
    for f in dataclasses.fields(cls):
        if "section" in f.metadata:
            if any(leaf.name == name for leaf, _ in leaves(f.metadata["section"])):
                default, metadata = setting_of(f.metadata["section"], name)
                return default, {**metadata, "help": f.metadata["help"].get(name, metadata["help"])}
        elif f.name == name:
            if "help" not in f.metadata:
                raise KeyError(f"{cls.__name__}.{name} has no help text (declare it with setting())")
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            return default, dict(f.metadata)
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def from_values(cls: type, values: dict[str, Any], **overrides: Any):
    """The config tree ``cls`` built from the entries of ``values`` named after its settings (the
    parsed options; sections built the same way); ``overrides`` win."""
    given = {**values, **overrides}
    kwargs = {}
    for f in dataclasses.fields(cls):
        if "section" in f.metadata:
            kwargs[f.name] = from_values(f.metadata["section"], given)
        elif f.name in given:
            kwargs[f.name] = given[f.name]
    return cls(**kwargs)


def flat_values(config: Any) -> dict[str, Any]:
    """``{setting name: value}`` of a config tree, sections flattened (what ``from_values`` reads)."""
    values = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        values.update(flat_values(value) if "section" in f.metadata else {f.name: value})
    return values


class SettingError(ValueError):
    """A config field whose value is refused: ``"<field> = <value> <problem>"``; a command says it
    with the option's flag instead (``glmpost.commands.options.flags_in_errors``)."""

    def __init__(self, field: str, value: Any, problem: str):
        super().__init__(f"{field} = {value!r} {problem}")
        self.field, self.value, self.problem = field, value, problem


class ConfigError(UsageError):
    """A refused setting or combination of settings whose message names config fields as
    ``{field}`` placeholders; other values come as keywords (``ConfigError("{top_k} {value!r}: must
    be >= 0", value=-1)``). Read as is, a field is spelled ``--field-name`` (its recipe key with
    dashes); a command spells it with its own flag (:meth:`spelled`). Exit code 2 (the invocation
    was wrong) unless ``exit_code`` says otherwise (1: the work failed, e.g. a server that
    disagrees)."""

    def __init__(self, message: str, *, exit_code: int = 2, **values: Any):
        self.message, self.values, self.exit_code = message, values, exit_code
        super().__init__(self.spelled(lambda name: "--" + name.replace("_", "-")))

    @property
    def fields(self) -> list[str]:
        return [name for _, name, _, _ in string.Formatter().parse(self.message) if name and name not in self.values]

    def spelled(self, spell: Callable[[str], str]) -> str:
        """The message with every field spelled by ``spell(field)``."""
        return self.message.format_map({**{name: spell(name) for name in self.fields}, **self.values})


def domain_assignment(value: Any, *, flag: str, example: str) -> tuple[str, str]:
    """``DOMAIN=VALUE`` (a ``--route`` / ``--verifier`` item) as ``(domain, value)``, both stripped;
    anything else is a usage error that shows ``flag`` and ``example`` (``DOMAIN=CHECKPOINT``)."""

    if isinstance(value, tuple):
        return value
    domain, sep, rest = str(value).partition("=")
    if not sep or not domain.strip() or not rest.strip():
        raise UsageError(f"{flag} {value!r}: expected {example}")
    return domain.strip(), rest.strip()

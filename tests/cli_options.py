"""The options table of every ``glmpost`` command, as ``--help`` shows it: flags, help text,
default, type, bounds, required.

``python tests/cli_options.py > tests/data/cli_options.json`` writes the table of the code as it
is; ``tests/test_cli_options.py`` compares the CLI with the stored table (issue 29: generating the
options from the config trees changes no option but the renames it names). Add an option on
purpose, then write the table again.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def _type_name(annotation: Any) -> str:
    """An annotation as a name that does not depend on how it was spelled (``Optional[List[str]]``,
    ``list[str] | None`` -> ``list[str]?``)."""
    import types
    import typing

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return "|".join(_type_name(a) for a in rest) + ("?" if len(rest) < len(args) else "")
    if origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return getattr(annotation, "__name__", str(annotation))


def _value(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_value(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def options_table(root: Any = None) -> dict[str, dict[str, dict[str, Any]]]:
    """``{command path: {parameter name: row}}`` of every leaf command under ``root`` (the glmpost app)."""
    import typer

    if root is None:
        from glmpost.commands.app import app

        root = typer.main.get_command(app)
    table: dict[str, dict[str, dict[str, Any]]] = {}

    def walk(command: Any, path: str) -> None:
        if hasattr(command, "commands"):  # a group
            for name, sub in command.commands.items():
                walk(sub, f"{path} {name}".strip())
            return
        rows = {}
        for param in command.params:
            if param.name == "ctx":
                continue
            rows[param.name] = {
                "opts": sorted(param.opts), "secondary_opts": sorted(getattr(param, "secondary_opts", None) or []),
                "help": getattr(param, "help", None), "default": _value(param.default), "required": param.required,
                "type": _type_name(param.type_descriptor.annotation), "multiple": param.multiple,
                "hidden": bool(getattr(param, "hidden", False)),
                "min": _value(getattr(param, "min", None)), "max": _value(getattr(param, "max", None))}
        table[path] = rows

    walk(root, "")
    return table


if __name__ == "__main__":
    json.dump(options_table(), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")

"""The import graph and the size of the pieces (issue 29, issue 44; CONTRIBUTING "Layers").

Read from the source with ``ast`` (nothing is imported): every ``import`` of a glmpost module,
module-level or inside a function (``if TYPE_CHECKING:`` blocks aside: an annotation runs nothing),
is an edge between the two modules and between their packages (a top-level module such as
``glmpost.stage`` is a package of its own). The packages stand on floors (:data:`FLOORS`), each
importing only its own floor and those below:

0. foundation: errors, config, toml, fsutil, registry (names and ``package.module:function`` hooks),
   trackers, stage, locks, checkpoints, formats (records, shards, prompt sources), npu, models,
   quant; they build on one another without a cycle.
1. kernel: what every stage computes with (loading, sampling, log-probs, trust masks, the engines'
   HTTP clients).
2. services a stage builds on and that are no stage themselves: spool (the queue between stages),
   drivers (a shard stage run over inputs or between spools), envs (the environments a multi-turn
   rollout steps), memory (a process's memory and the buffer sizes the trainer and ``glmpost plan``
   share).
3. stages: rollout, rewards (the judge), rl (the trainers), diff, teachers, server, weight_sync,
   evaluation, report, model_import, pipeline. A stage imports no other stage except the
   compositions declared in :data:`COMPOSITIONS`, each with its reason.
4. commands: the command line, over every stage.

The rules:

- every package has a floor and imports nothing above it; no stage imports another stage except a
  declared composition (and every declared one is used);
- no cycle between packages, nor between the modules of one package;
- no module imports another module's underscore-private name, nor reaches one through a name it
  imported (``LocalEngine._sample`` from another module: give the owner a public function);
- an import of a glmpost module inside a function says why on its line or the line above
  (the only reason left: keeping torch out of a light module's import);
- modules of at most 400 lines and functions of at most 60, unless a function's docstring says
  why it must be one piece; the pieces not yet split are listed below, and the list may only shrink.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Where each importable package's files live (pyproject.toml's package-dir).
PACKAGE_DIRS = {"glmpost": ROOT / "glmpost", "glmpost.commands": ROOT / "commands",
                "glmpost.formats": ROOT / "formats", "glmpost.npu": ROOT / "npu"}
FOUNDATION, KERNEL, SERVICES, STAGES, COMMANDS = range(5)
FLOORS = {
    **dict.fromkeys(["glmpost", "errors", "config", "toml", "fsutil", "registry", "trackers", "stage", "locks", "checkpoints",
                     "formats", "npu", "models", "quant"], FOUNDATION),
    "kernel": KERNEL,
    **dict.fromkeys(["spool", "drivers", "envs", "memory"], SERVICES),
    **dict.fromkeys(["rollout", "rewards", "rl", "diff", "teachers", "server", "weight_sync", "evaluation", "report",
                     "model_import", "pipeline"], STAGES),
    "commands": COMMANDS,
}
STAGE_PACKAGES = {package for package, floor in FLOORS.items() if floor == STAGES}
# A stage that runs another stage's work as part of its own: (importer, imported) -> why.
COMPOSITIONS = {
    ("evaluation", "rollout"): "eval samples a benchmark's answers with the rollout runner and its settings",
    ("evaluation", "rewards"): "eval scores those answers with the judge stage and the math verifier's answers",
}
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
ONE_PIECE = "must be one piece"  # what a long function's docstring says, with the reason
# Not yet split: none left (issue 29); a module or function that grows past the limits is split, or its docstring says why it must be one piece.
LONG_MODULES: set[str] = set()
LONG_FUNCTIONS: set[str] = set()


def _modules() -> dict[str, Path]:
    found = {}
    for prefix, directory in PACKAGE_DIRS.items():
        for path in directory.rglob("*.py"):
            parts = list(path.relative_to(directory).with_suffix("").parts)
            if prefix == "glmpost" and parts[0] in ("commands", "formats", "npu"):
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([prefix, *parts])] = path
    return found


MODULES = _modules()


def package_of(module: str) -> str:
    """``glmpost.rl.trainer`` -> ``rl``; a top-level module is its own package (``glmpost.stage`` -> ``stage``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "glmpost"


class ModuleImports(ast.NodeVisitor):
    """The glmpost imports of one module, with where they sit."""

    def __init__(self, module: str, path: Path):
        self.module, self.lines = module, path.read_text().splitlines()
        self.is_package = path.name == "__init__.py"
        self.function_depth = 0
        self.imports: list[tuple[str, list[str], bool, int]] = []  # (target module, names, in a function, line)
        self.bound: dict[str, str] = {}  # a name this module binds by an import -> what it names (module.name)

    def visit_FunctionDef(self, node):
        self.function_depth += 1
        self.generic_visit(node)
        self.function_depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node):
        if "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node):
        for alias in node.names:
            if alias.name.startswith("glmpost"):
                self.imports.append((alias.name, [], self.function_depth > 0, node.lineno))
                if alias.asname:
                    self.bound[alias.asname] = alias.name

    def visit_ImportFrom(self, node):
        target = node.module or ""
        if node.level:
            base = self.module.split(".")[: len(self.module.split(".")) - node.level + (1 if self.is_package else 0)]
            target = ".".join(base + ([node.module] if node.module else []))
        if target.startswith("glmpost"):
            self.imports.append((target, [a.name for a in node.names], self.function_depth > 0, node.lineno))
            self.bound.update({a.asname or a.name: f"{target}.{a.name}" for a in node.names})


def _imports() -> dict[str, ModuleImports]:
    found = {}
    for module, path in MODULES.items():
        visitor = ModuleImports(module, path)
        visitor.visit(ast.parse(path.read_text()))
        found[module] = visitor
    return found


IMPORTS = _imports()


def _imported_modules(target: str, names: list[str]) -> list[str]:
    """The modules an import statement names: ``from glmpost.rl import trainer`` names ``glmpost.rl.trainer``."""
    submodules = [f"{target}.{name}" for name in names if f"{target}.{name}" in MODULES]
    return submodules or [target]


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for module, visitor in IMPORTS.items():
        for target, names, _, _ in visitor.imports:
            for imported in _imported_modules(target, names):
                if package_of(imported) != package_of(module):
                    graph[package_of(module)].add(package_of(imported))
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(set(graph) | {t for targets in graph.values() for t in targets}):
        if node not in index:
            visit(node)
    return found


def test_strongly_connected_finds_a_cycle_and_only_cycles():
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def test_the_scan_sees_the_whole_package():
    # The graph is only as good as the scan: every package and some known edges must be in it.
    graph = package_graph()
    assert {"kernel", "rollout", "rl", "diff", "teachers", "server", "weight_sync", "spool", "commands"} <= set(graph)
    assert {"kernel", "spool"} <= graph["rollout"] and "kernel" in graph["rl"]
    assert any(inside for v in IMPORTS.values() for _, _, inside, _ in v.imports)  # function-level ones are seen


def test_no_cycle_between_packages():
    assert strongly_connected(package_graph()) == []


def test_every_package_stands_on_a_floor():
    packages = set(package_graph()) | {package_of(module) for module in MODULES}
    assert sorted(packages - set(FLOORS)) == [], "a new package: give it a floor in FLOORS (and the docstring)"
    assert sorted(set(FLOORS) - packages) == [], "a package is gone: take it off FLOORS"


def test_no_package_imports_one_above_its_floor():
    graph = package_graph()
    assert graph["kernel"], "the kernel imports nothing: the scan is broken"
    upward = sorted(f"{package} (floor {FLOORS[package]}) imports {target} (floor {FLOORS[target]})"
                    for package, targets in graph.items() for target in targets if FLOORS[target] > FLOORS[package])
    assert upward == []


def test_a_stage_imports_another_stage_only_as_a_declared_composition():
    graph = package_graph()
    between_stages = {(package, target) for package, targets in graph.items() for target in targets
                      if package in STAGE_PACKAGES and target in STAGE_PACKAGES}
    assert sorted(between_stages - set(COMPOSITIONS)) == [], "move the shared piece down a floor, or declare the composition"
    assert sorted(set(COMPOSITIONS) - between_stages) == [], "no longer composed: take it off COMPOSITIONS"


def test_no_module_imports_another_modules_private_name():
    private = [f"{module}:{line} imports {target}.{name}"
               for module, visitor in IMPORTS.items() for target, names, _, line in visitor.imports
               for name in names if name.startswith("_") and not name.startswith("__") and target != module]
    assert private == []


def module_graph() -> dict[str, set[str]]:
    """``module -> the modules of its own package it imports`` (a package's ``__init__`` is a module too)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for module, visitor in IMPORTS.items():
        for target, names, _, _ in visitor.imports:
            for imported in _imported_modules(target, names):
                if imported in MODULES and imported != module and package_of(imported) == package_of(module):
                    graph[module].add(imported)
    return graph


def test_no_cycle_between_the_modules_of_a_package():
    graph = module_graph()
    assert "glmpost.rollout.engines" in graph["glmpost.rollout.runner"], "the module scan is broken"
    assert strongly_connected(graph) == []


def _private_attributes(module: str) -> list[str]:
    """``Name._private`` where ``Name`` is what this module imported from another module (a class, a
    function or a module): another module's private part reached from here."""
    bound = IMPORTS[module].bound
    found = []
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append(f"{module}:{node.lineno} uses {node.value.id}.{node.attr} (from {bound[node.value.id]})")
    return found


def test_private_attributes_scan_finds_a_classes_private_method(tmp_path):
    path = tmp_path / "user.py"
    path.write_text("from glmpost.kernel.engine import LocalEngine\n\nLocalEngine._sample(1, 2, 3)\nLocalEngine.generate\n")
    visitor = ModuleImports("glmpost.user", path)
    visitor.visit(ast.parse(path.read_text()))
    IMPORTS["glmpost.user"], MODULES["glmpost.user"] = visitor, path
    try:
        assert _private_attributes("glmpost.user") == ["glmpost.user:3 uses LocalEngine._sample (from glmpost.kernel.engine.LocalEngine)"]
    finally:
        del IMPORTS["glmpost.user"], MODULES["glmpost.user"]


def test_no_module_uses_a_private_attribute_of_another_modules_name():
    assert [line for module in MODULES for line in _private_attributes(module)] == []


def test_imports_inside_functions_say_why():
    unexplained = []
    for module, visitor in IMPORTS.items():
        for _, _, inside, line in visitor.imports:
            here, above = visitor.lines[line - 1], visitor.lines[line - 2] if line > 1 else ""
            if inside and "#" not in here and not above.strip().startswith("#"):
                unexplained.append(f"{module}:{line}: {here.strip()}")
    assert unexplained == []


def _docstring_lines(node: ast.AST) -> int:
    """Lines of a function's docstring: a long function is long in code (its formula, arguments and
    reasons are welcome in the docstring)."""
    first = node.body[0] if node.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first.end_lineno - first.lineno + 1
    return 0


def _long_functions() -> dict[str, int]:
    found = {}
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1 - _docstring_lines(node)
                if length > MAX_FUNCTION_LINES and ONE_PIECE not in (ast.get_docstring(node) or ""):
                    found[f"{module}.{node.name}"] = length
    return found


@pytest.mark.parametrize("kind", ["modules", "functions"])
def test_long_pieces_are_only_the_listed_ones(kind):
    if kind == "modules":
        long = {m: len(p.read_text().splitlines()) for m, p in MODULES.items()}
        long, listed, limit = {m: n for m, n in long.items() if n > MAX_MODULE_LINES}, LONG_MODULES, MAX_MODULE_LINES
    else:
        long, listed, limit = _long_functions(), LONG_FUNCTIONS, MAX_FUNCTION_LINES
    assert {name: n for name, n in long.items() if name not in listed} == {}, f"over {limit} lines: split it"
    assert sorted(listed - set(long)) == [], "split now: take it off the list"


def _usage_errors_spelling_a_flag() -> list[str]:
    """Library ``UsageError`` / ``ConfigError`` raises whose message spells a command-line flag
    (``--name``) instead of naming the config field (``{name}``) the command then spells."""
    import re

    found = []
    for module, path in MODULES.items():
        if module.startswith("glmpost.commands") or module == "glmpost.pipeline.__main__":  # the command lines
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args):
                continue
            name = getattr(node.exc.func, "id", getattr(node.exc.func, "attr", ""))
            literal = " ".join(part.value for part in ast.walk(node.exc.args[0])
                               if isinstance(part, ast.Constant) and isinstance(part.value, str))
            literal = re.sub(r"`[^`]*`", "", literal)  # a quoted command line (another command's flags)
            if name in ("UsageError", "ConfigError") and re.search(r"(?<![\w-])--[a-z]", literal):
                found.append(f"{module}:{node.lineno}")
    return found


def test_library_usage_errors_name_config_fields_not_flags():
    assert _usage_errors_spelling_a_flag() == []

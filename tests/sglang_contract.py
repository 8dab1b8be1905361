"""SGLang's own request and response classes, from the ``sglang`` package installed without its
dependencies (``sglang==0.5.23``, constraints.txt; bin/_setup installs it), for
tests/test_sglang_contract.py.

Importing ``sglang`` runs its ``__init__`` (torch, triton, FlashInfer, ...); this helper instead
registers the package by its path alone and imports only leaf modules that need nothing beyond
glmpost's own dependencies:

* ``sglang.srt.entrypoints.api_contract.generate_contract_error``: the check SGLang's ``/generate``
  runs on every body (entrypoints/http_server.py ``generate_request``: a violation is HTTP 400
  ``{"error": TEXT}``), over the generated ``sglang.api.v1.api_types`` classes (``GenerateRequest``,
  ``SamplingParams`` with unknown keys rejected, ``GenerateResponse``, ``GetModelInfoResponse``,
  ``GetServerInfoResponse``, ``AbortRequest``).
* ``sglang.srt.sampling.sampling_params.SamplingParams``: what the tokenizer manager builds from each
  request's sampling params (``__post_init__``), then ``verify(vocab_size)`` and ``normalize``.

Both need ``msgspec`` only for ``msgspec.Struct`` as a base class; where msgspec is not installed a
stand-in (:func:`_msgspec_stand_in`: a dataclass with the same keyword-only construction) is used.
``managers/io_struct.py`` (``GenerateReqInput``, ``UpdateWeightFromDiskReqInput``, ``AbortReq``)
needs zmq, triton and the runtime, so its classes are read from its source (:func:`io_struct_fields`).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import sys
import types
from pathlib import Path

SGLANG_RELEASE = "0.5.23"


def _msgspec_stand_in() -> types.ModuleType:
    """``msgspec.Struct`` as a dataclass base (``kw_only``, ``frozen``; other options ignored), and
    ``msgspec.structs.replace`` / ``fields``: all the modules imported here use of msgspec."""
    module = types.ModuleType("msgspec")

    class Struct:
        def __init_subclass__(cls, *, kw_only: bool = False, frozen: bool = False, **_: object):
            super().__init_subclass__()
            for name in list(cls.__dict__.get("__annotations__", {})):
                value = cls.__dict__.get(name, dataclasses.MISSING)
                if isinstance(value, (list, dict, set)):  # msgspec copies mutable defaults
                    setattr(cls, name, dataclasses.field(default_factory=lambda v=value: type(v)(v)))
            dataclasses.dataclass(cls, kw_only=kw_only, frozen=frozen)

    structs = types.ModuleType("msgspec.structs")
    structs.replace = dataclasses.replace
    structs.fields = dataclasses.fields
    module.Struct, module.structs = Struct, structs
    return module


def load() -> types.SimpleNamespace:
    """The SGLang modules the contract tests use. Raises ImportError when sglang is not installed
    (or is not the pinned release)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"sglang is not installed (bin/_setup installs sglang=={SGLANG_RELEASE} without dependencies)")
    root = Path(list(spec.submodule_search_locations)[0])
    if importlib.util.find_spec("msgspec") is None and "msgspec" not in sys.modules:
        stand_in = _msgspec_stand_in()
        sys.modules["msgspec"], sys.modules["msgspec.structs"] = stand_in, stand_in.structs
    if "sglang" not in sys.modules:  # the package by its path: its __init__ (torch, triton, ...) never runs
        package = types.ModuleType("sglang")
        package.__path__ = [str(root)]
        sys.modules["sglang"] = package
    version_file = root / "_version.py"
    release = version_file.read_text().split("__version__ = version = '", 1)[-1].split("'", 1)[0]
    if release != SGLANG_RELEASE:
        raise ImportError(f"sglang {release} is installed; these contracts are sglang {SGLANG_RELEASE}'s")
    api_types = importlib.import_module("sglang.api.v1.api_types")
    contract = importlib.import_module("sglang.srt.entrypoints.api_contract")
    sampling = importlib.import_module("sglang.srt.sampling.sampling_params")
    return types.SimpleNamespace(root=root, api_types=api_types,
                                 generate_contract_error=contract.generate_contract_error,
                                 SamplingParams=sampling.SamplingParams,
                                 io_struct=root / "srt/managers/io_struct.py")


def io_struct_fields(path: Path, name: str) -> dict[str, str]:
    """``{field: annotation source}`` of class ``name`` in managers/io_struct.py and its bases there
    (the dataclass fields SGLang parses a request body into)."""
    tree = ast.parse(path.read_text())
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}

    def fields(cls: ast.ClassDef) -> dict[str, str]:
        found: dict[str, str] = {}
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                found.update(fields(classes[base.id]))
        for node in cls.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                found[node.target.id] = ast.unparse(node.annotation)
        return found

    return fields(classes[name])

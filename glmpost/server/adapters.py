"""``glmpost serve --enable-lora``: LoRA adapters loaded, listed and unloaded at run time, and named per
request, as SGLang and vLLM do it (their routes and answers: :mod:`glmpost.kernel.lora_routes`).

* SGLang API: ``POST /load_lora_adapter {lora_name, lora_path}`` -> ``{"success", "error_message",
  "loaded_adapters": {name: path}}`` (HTTP 400 when refused), ``POST /unload_lora_adapter {lora_name}``
  (admin routes under ``--admin-api-key``), ``GET /v1/models`` (the served model's card and one per
  adapter: ``id`` its name, ``root`` its path, ``parent`` the served model); ``/generate`` names an
  adapter with ``lora_path`` (a name, or one per sequence of a batch), an unknown name is HTTP 400
  ``The following requested LoRA adapters are not loaded: NAME`` and the names held. Without
  ``--enable-lora``: ``LoRA is not enabled. Please set `--enable-lora` to enable LoRA.`` (400).
* vLLM API: ``POST /v1/load_lora_adapter``, ``POST /v1/unload_lora_adapter`` answering vLLM's texts and
  errors, the adapter cards in ``/v1/models``, ``model`` naming one in ``/v1/completions`` (an unknown
  name: 404 ``NotFoundError``); without ``--enable-lora`` the routes are not there (404, as a vLLM
  without ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``).

Each adapter is a model of its own: the served version's weights loaded again with the adapter applied
unmerged (:func:`~glmpost.kernel.loading.load_model` with ``adapter``, that is
:func:`glmpost.kernel.lora.apply_adapter`), the very model the embedded engine samples a LoRA version
with, so a request naming it answers what ``rollout --engine local`` computes (a stand-in for tests and
closure checks, not a memory-saving multi-LoRA server: each adapter costs the base's memory again).
Like SGLang and vLLM it applies an adapter onto whatever base it serves; ``sync-weights`` checks the
base. Unloading drops the name at once (a new request naming it is refused); a request already
received holds the adapter's model and finishes on it (SGLang's order: unregister, then wait for the
requests in flight); its memory goes with the last of them. A base update (``update_weights_from_disk``,
``reload_weights``) loads every adapter again onto the new weights, as the engines apply theirs to the
base they serve.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from glmpost.errors import GlmpostError, first_line
from glmpost.server.loading import LoadedCheckpoint
from glmpost.server.parsing import RequestError
from glmpost.stage import log

__all__ = ["NOT_ENABLED", "PlainText", "ServedAdapters", "vllm_lora_route"]

NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


class ServedAdapters:
    """The adapters of one server: ``load(name, path)`` builds the adapted model with ``build(path)``
    (the served weights with the adapter applied), ``resolve`` gives a request's model."""

    def __init__(self, build: Callable[[str], LoadedCheckpoint], *, enabled: bool):
        self.build = build
        self.enabled = enabled
        self._held: dict[str, LoadedCheckpoint] = {}
        self._lock = threading.Lock()
        self._loading = threading.Lock()  # one load at a time (each reads the base's weights)

    def paths(self) -> dict[str, str]:
        """``{name: path}`` of the adapters held, in load order."""
        with self._lock:
            return {name: str(loaded.adapter) for name, loaded in self._held.items()}

    def load(self, name: Any, path: Any) -> str | None:
        """Load ``path`` as ``name``; None when done, else why not (one line). A name already held
        is refused (vLLM and SGLang alike)."""
        if not self.enabled:
            return NOT_ENABLED
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            return "Both 'lora_name' and 'lora_path' must be provided."
        with self._loading:
            if name in self.paths():
                return f"The lora adapter '{name}' has already been loaded."
            try:
                loaded = self.build(path)
            except (GlmpostError, OSError, ValueError) as exc:
                return f"Failed to load LoRA adapter {name} from {path}: {first_line(exc)}"
            with self._lock:
                self._held[name] = loaded
        return None

    def unload(self, name: Any) -> bool:
        """Drop ``name`` (requests holding its model finish on it); False when it is not held."""
        with self._lock:
            return self._held.pop(name, None) is not None if isinstance(name, str) else False

    def holds(self, name: Any) -> bool:
        with self._lock:
            return isinstance(name, str) and name in self._held

    def resolve(self, name: Any) -> LoadedCheckpoint | None:
        """The model a request naming ``name`` runs on (None: the base), or RequestError 400 as SGLang
        refuses an adapter it does not hold."""
        if name is None:
            return None
        if not self.enabled:
            raise RequestError(NOT_ENABLED)
        with self._lock:
            loaded = self._held.get(name) if isinstance(name, str) else None
            if loaded is None:
                raise RequestError(f"The following requested LoRA adapters are not loaded: {name}\n"
                                   f"Loaded adapters: odict_keys({list(self._held)}).")
            return loaded

    def rebuild(self) -> None:
        """After a base update: every adapter loaded again onto the new weights (one that no longer
        applies is dropped, with a line in the server's log)."""
        with self._loading:
            for name, path in self.paths().items():
                try:
                    loaded = self.build(path)
                except (GlmpostError, OSError, ValueError) as exc:
                    log(f"LoRA adapter {name} ({path}) does not apply to the new weights ({first_line(exc)}): unloaded")
                    self.unload(name)
                    continue
                with self._lock:
                    if name in self._held:
                        self._held[name] = loaded

    def cards(self, parent: str, created: int, owned_by: str) -> list[dict]:
        """The ``/v1/models`` card of every adapter held (SGLang's and vLLM's ``ModelCard``)."""
        return [{"id": name, "object": "model", "created": created, "owned_by": owned_by, "root": path,
                 "parent": parent, "max_model_len": None} for name, path in self.paths().items()]


class PlainText(str):
    """An answer sent as bare text, not JSON (vLLM's LoRA routes answer so)."""


def _vllm_error(message: str, kind: str, status: int) -> tuple[int, dict]:
    return status, {"error": {"message": message, "type": kind, "param": None, "code": status}}


def vllm_lora_route(adapters: ServedAdapters, path: str, body: Any, base_name: str) -> tuple[int, Any]:
    """vLLM 0.32's ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (``entrypoints/openai/
    models/serving.py``): its success texts and ``ErrorResponse`` refusals."""
    body = body if isinstance(body, dict) else {}
    name = body.get("lora_name")
    if path == "/v1/unload_lora_adapter":
        if not name:
            return _vllm_error("'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput", 400)
        if not adapters.unload(name):
            return _vllm_error(f"The lora adapter '{name}' cannot be found.", "NotFoundError", 404)
        return 200, PlainText(f"Success: LoRA adapter '{name}' removed successfully.")
    if name == base_name:
        return _vllm_error(f"The lora adapter '{name}' conflicts with a served base model.", "InvalidUserInput", 400)
    problem = adapters.load(name, body.get("lora_path"))
    if problem is None:
        return 200, PlainText(f"Success: LoRA adapter '{name}' added successfully.")
    if problem.startswith("Both ") or "has already been loaded" in problem:
        tail = " If you want to load the adapter in place, set 'load_inplace' to True." if "already" in problem else ""
        return _vllm_error(problem + tail, "InvalidUserInput", 400)
    return _vllm_error(problem, "InternalServerError", 500)

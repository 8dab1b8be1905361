"""A server's LoRA adapters (issue 45): the name a LoRA version is served under, the routes that load,
list and unload adapters at run time, and requests that name one, as :class:`LoraRoutes`, the part of
the HTTP clients (:class:`~glmpost.kernel.sglang_client.SGLangClient`,
:class:`~glmpost.kernel.vllm_client.VLLMClient`) that deals with adapters.

**Names** (:func:`adapter_name`): the LoRA version ``ROOT/vNNNNNN`` is served as ``ROOTNAME-vNNNNNN`` (the
root directory's name, a dash, the version directory's name: ``served-v000007``), so that a rollout of
that version names what ``sync-weights`` loaded, and a root's adapters are told apart from others by
their prefix (:func:`root_adapters`).

**Routes**, as read in the engines' source:

* SGLang (``entrypoints/http_server.py``, ``managers/tokenizer_control_mixin.py``,
  ``lora/lora_registry.py``): ``POST /load_lora_adapter {lora_name, lora_path}`` answers ``{success,
  error_message, loaded_adapters}``, HTTP 400 when refused (without ``--enable-lora``: ``LoRA is not
  enabled. Please set `--enable-lora` to enable LoRA.``); ``POST /unload_lora_adapter {lora_name}``
  unregisters the name at once (a new request naming it is refused) and unloads the adapter once the
  requests holding it have finished (``LoRARegistry.wait_for_unload``). Both are admin routes
  (``--admin-api-key``). ``GET /v1/models`` lists a card per adapter (``id`` its name, ``root`` its path,
  ``parent`` the served model). A ``/generate`` names one with ``lora_path`` (its name); a name not
  loaded is HTTP 400 ``The following requested LoRA adapters are not loaded: NAME ...``.
* vLLM 0.32 (``entrypoints/serve/lora/api_router.py``, ``entrypoints/openai/models/serving.py``): the
  routes are mounted only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (404 otherwise); ``POST
  /v1/load_lora_adapter {lora_name, lora_path}`` answers the text ``Success: LoRA adapter 'NAME' added
  successfully.`` (a name already loaded: 400; a server without ``--enable-lora``: 500 ``LoRA is not
  enabled. Use --enable-lora to enable LoRA.``); ``POST /v1/unload_lora_adapter {lora_name}`` removes
  the *name* only (``OpenAIServingModels.lora_requests``; not loaded: 404): a request already admitted
  holds its ``LoRARequest``, path included, and finishes on that adapter (the engine keeps it in its
  LRU cache, or loads it again from the path), while a new request naming it is 404 ``NotFoundError``
  ``The model `NAME` does not exist.``. ``GET /v1/models`` lists the adapters as SGLang does. A
  ``/v1/completions`` names one with ``model``.

So on both engines an adapter is unloaded only after the requests in flight that name it have
finished; a request sent after the unload is refused, and :meth:`LoraRoutes.with_adapter` then
names the adapter that replaced it.

**Requests**: a client whose ``adapter`` is ``(name, policy_version)`` names it in every request and
stamps every answer's ``meta_info.weight_version`` with that version (what answered is the base and
that adapter, whatever label the base's weights carry). An answer saying the server no longer holds
the adapter asks ``on_adapter_gone(client, adapter)`` for the one to name instead and sends the
request again naming it, once; without one the error is raised.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

from glmpost.errors import first_line
from glmpost.kernel.sglang_transport import ServerError

__all__ = ["LoraDisabled", "LoraRoutes", "adapter_name", "adapter_version", "root_adapters"]

Adapter = tuple[str, int]  # (the name requests give, the policy version it serves)
_VERSIONED = re.compile(r"^(?P<root>.+)-v(?P<version>\d{6,})$")


def adapter_name(version_dir: Path | str) -> str:
    """``ROOTNAME-vNNNNNN``: the name the LoRA version ``ROOT/vNNNNNN`` is served under."""
    version_dir = Path(version_dir).resolve()
    return f"{version_dir.parent.name}-{version_dir.name}"


def adapter_version(name: str, root_name: str) -> int | None:
    """The policy version of the adapter ``name`` when it is one of ``root_name``'s, else None."""
    match = _VERSIONED.match(name)
    return int(match["version"]) if match and match["root"] == root_name else None


def root_adapters(adapters: dict[str, Any], root_name: str) -> dict[int, str]:
    """``{policy version: name}`` of the adapters among ``adapters`` (names) that are ``root_name``'s."""
    found = {}
    for name in adapters:
        version = adapter_version(name, root_name)
        if version is not None:
            found[version] = name
    return found


class LoraDisabled(ServerError):
    """A server that loads no adapter at run time (retrying cannot help)."""


class LoraRoutes:
    """The adapter routes (module docstring) of a client that has ``request`` and ``url``; SGLang's
    paths, which :class:`~glmpost.kernel.vllm_client.VLLMClient` replaces with vLLM's."""

    LOAD_ROUTE = "/load_lora_adapter"
    UNLOAD_ROUTE = "/unload_lora_adapter"
    ENABLE_HINT = "launch SGLang with --enable-lora (and --max-lora-rank, --lora-target-modules covering the adapter)"
    adapter: Adapter | None = None  # what every request names (None: the base model)
    on_adapter_gone: Callable[[Any, Adapter], Adapter | None] | None = None

    def load_lora_adapter(self, name: str, path: Path | str) -> None:
        """Load the adapter folder ``path`` as ``name``; raises :class:`LoraDisabled` for a server
        that loads no adapter at run time, ServerError for a refusal (its message says why)."""
        try:
            self.request("POST", self.LOAD_ROUTE, {"lora_name": name, "lora_path": str(path)}, text=True)
        except ServerError as exc:
            if exc.status == 404 or "LoRA is not enabled" in str(exc):
                raise LoraDisabled(f"{self.url} loads no LoRA adapter at run time ({first_line(exc)}): {self.ENABLE_HINT}",
                                   url=self.url, status=exc.status) from None
            raise

    def unload_lora_adapter(self, name: str) -> bool:
        """Unload ``name`` (module docstring: after the requests in flight that name it); False when
        the server does not hold it."""
        try:
            self.request("POST", self.UNLOAD_ROUTE, {"lora_name": name}, text=True)
        except ServerError as exc:
            if exc.status in (400, 404) and ("cannot be found" in str(exc) or "does not exist" in str(exc)):
                return False
            raise
        return True

    def lora_adapters(self) -> dict[str, str]:
        """``{name: path}`` of the adapters the server holds (``GET /v1/models``, the cards with a
        ``parent``); empty where the server has no such route."""
        try:
            answer = self.request("GET", "/v1/models")
        except ServerError as exc:
            if exc.status == 404:
                return {}
            raise
        cards = answer.get("data") if isinstance(answer, dict) else None
        return {str(card["id"]): str(card.get("root")) for card in cards or []
                if isinstance(card, dict) and card.get("parent") and card.get("id")}

    def adapter_problem(self, name: str, version_dir: Path | str) -> str | None:
        """Why the server does not serve the adapter ``name`` of the LoRA version ``version_dir``
        (it does not hold that name, or holds another folder under it, where that folder can be read
        here), or None."""
        try:
            held = self.lora_adapters()
        except ServerError as exc:
            return f"cannot list its LoRA adapters ({exc})"
        if name not in held:
            return f"holds no LoRA adapter {name} (it holds {', '.join(held) or 'none'})"
        path = Path(held[name])
        if path.exists() and path.resolve() != Path(version_dir).resolve():
            return f"holds another folder as {name} ({path})"
        return None

    def name_adapter(self, version_dir: Path | str, policy_version: int) -> str | None:
        """Name the LoRA version ``version_dir``'s adapter (:func:`adapter_name`) in every request
        from now on, stamped ``policy_version``; returns why the server cannot (nothing changed), or None."""
        name = adapter_name(version_dir)
        problem = self.adapter_problem(name, version_dir)
        if problem is None:
            self.adapter = (name, policy_version)
        return problem

    @staticmethod
    def adapter_gone(exc: ServerError) -> bool:
        """Whether ``exc`` says the server does not hold the adapter the request named."""
        text = str(exc)
        return (exc.status == 404 and "does not exist" in text) or (exc.status == 400 and "are not loaded" in text)

    def with_adapter(self, send: Callable[[str | None], Any]) -> Any:
        """``send(name)``'s answer (``name``: the adapter to name, None for the base model), each
        sequence's ``meta_info.weight_version`` the adapter's version; sent again naming the
        adapter ``on_adapter_gone`` gives when the server no longer holds this one."""
        adapter = self.adapter
        if adapter is None:
            return send(None)
        try:
            return _stamped(send(adapter[0]), adapter[1])
        except ServerError as exc:
            if not self.adapter_gone(exc) or self.on_adapter_gone is None:
                raise
            replacement = self.on_adapter_gone(self, adapter)
            if replacement is None:
                raise
        return _stamped(send(replacement[0]), replacement[1])


def _stamped(answer: Any, version: int) -> Any:
    """``answer`` (one SGLang-shaped answer or a list) with every ``meta_info.weight_version`` set to
    ``version`` and no per-token label spans (they are the base weights' labels)."""
    for one in answer if isinstance(answer, list) else [answer]:
        meta = one.get("meta_info") if isinstance(one, dict) else None
        if isinstance(meta, dict):
            meta["weight_version"] = str(version)
            meta.pop("weight_versions", None)
    return answer

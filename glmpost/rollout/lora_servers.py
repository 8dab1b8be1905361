"""A rollout through servers of a LoRA version (issue 45): every request names the adapter
``sync-weights`` loaded (``ROOTNAME-vNNNNNN``, :func:`~glmpost.kernel.lora_routes.adapter_name`; vLLM: the
``model`` field, SGLang and ``glmpost serve``: ``lora_path``), and every token carries the version of
the adapter its request named, in the ``policy_versions`` full versions fill.

* **Open** (:meth:`ServedLora.open`): every server must hold the adapter (its ``GET /v1/models`` card)
  with the version's folder as its path, where that path can be read here; otherwise one error says
  to run ``sync-weights``. No label nor fingerprint is read per call: a glmpost adapter's name is its
  version (versions are never overwritten, and ``sync-weights`` confirmed its weights by fingerprint
  when it loaded it; a full version synced later unloads the root's adapters).
* **Switch** (:meth:`ServedLora.switch`, the runner's ``switch_to_newest``, before a part and between
  the turns of a multi-turn part): to a newer LoRA version of the same root and the same base once
  every server holds it; until then (``sync-weights`` publishes ``LATEST`` before it loads the servers)
  the rollout stays on its adapter and looks again at the next turn. A new adapter's requests find no
  prefix cache of the old one (each engine keys its cache by adapter): the next turn prefills the
  whole history under the new weights.
* **An adapter unloaded under a running rollout** (``sync-weights`` loaded a newer one and unloaded
  this one, after its requests in flight finished): a request sent after that is refused, and
  :meth:`ServedLora.replacement` names the newest adapter of the root that server holds; the request
  goes again under it, its tokens stamped with that version. None newer: the request fails (aborted
  records, their reason saying so).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Optional

from glmpost.checkpoints import read_manifest
from glmpost.config import ConfigError
from glmpost.kernel.lora_routes import adapter_name, root_adapters
from glmpost.kernel.lora_versions import is_lora_version
from glmpost.kernel.sglang_client import ServerError
from glmpost.stage import log

__all__ = ["ServedLora"]


def _base_hash(version_dir: Path) -> Optional[str]:
    return (read_manifest(version_dir).lora_base or {}).get("hash")


class ServedLora:
    """The adapter a server rollout names (module docstring): the checkpoint root's name, the base's
    weights hash, and the lock under which a client's adapter is replaced."""

    def __init__(self, version_dir: Path):
        self.root_dir = Path(version_dir).resolve().parent
        self.root = self.root_dir.name
        self.base_hash = _base_hash(version_dir)
        self._lock = threading.Lock()

    @classmethod
    def open(cls, clients: list[Any], checkpoint: Any) -> "ServedLora":
        """Name ``checkpoint``'s adapter on every client, refused in one line where a server does not hold it."""
        served = cls(checkpoint.version_dir)
        name = adapter_name(checkpoint.version_dir)
        for client in clients:
            problem = served.problem(client, name, checkpoint.version_dir)
            if problem is not None:
                raise ConfigError("{server} {url} {problem}; sync-weights of {path} to that server loads it",
                                  url=client.url, problem=problem, path=checkpoint.version_dir, exit_code=1)
            client.adapter, client.on_adapter_gone = (name, checkpoint.policy_version), served.replacement
        return served

    @staticmethod
    def problem(client: Any, name: str, version_dir: Path) -> Optional[str]:
        """Why ``client``'s server does not serve the adapter ``name`` of ``version_dir``, or None."""
        return client.adapter_problem(name, version_dir)

    def switch(self, clients: list[Any], newer: Any) -> Optional[bool]:
        """Name ``newer``'s adapter from now on: True when every server holds it, False (nothing
        changed) when one does not yet; None when ``newer`` is no LoRA version of this root and base
        (then it is no adapter switch)."""
        directory = Path(newer.version_dir)
        if (not is_lora_version(directory) or directory.resolve().parent != self.root_dir
                or _base_hash(directory) != self.base_hash):
            return None
        name = adapter_name(directory)
        missing = [(client.url, problem) for client in clients
                   if (problem := self.problem(client, name, directory)) is not None]
        if missing:
            log(f"--server {missing[0][0]} {missing[0][1]} yet: the rollout stays on its adapter until it does")
            return False
        with self._lock:
            for client in clients:
                client.adapter = (name, newer.policy_version)
        return True

    def replacement(self, client: Any, gone: tuple[str, int]) -> Optional[tuple[str, int]]:
        """The adapter to name on ``client`` now that its server refused ``gone`` (unloaded): the
        newest adapter of the root it holds, newer than ``gone``; None when it holds none."""
        with self._lock:
            if client.adapter is not None and client.adapter != gone:
                return client.adapter  # another request replaced it already
            try:
                held = root_adapters(client.lora_adapters(), self.root)
            except ServerError:
                return None
            newer = [version for version in held if version > gone[1]]
            if not newer:
                return None
            client.adapter = (held[max(newer)], max(newer))
        log(f"--server {client.url} no longer holds {gone[0]}: its requests name {client.adapter[0]} from now on")
        return client.adapter

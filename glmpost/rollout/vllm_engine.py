"""``--engine vllm``: the SGLang backend's batches sent to vLLM servers (or ``glmpost serve --api vllm``)
through :class:`~glmpost.kernel.vllm_client.VLLMClient`, with what vLLM does not report confirmed here.

* The log-prob kind is the servers' ``--logprobs-mode`` (``/server_info``, dev mode): ``raw_logprobs``
  records ``raw``, ``processed_logprobs`` ``sampled``; the logits modes are refused (a logit is no
  log-prob); without dev mode the four-request probe tells the kind.
* ``seed_reproducible`` only under ``VLLM_BATCH_INVARIANT=1``.
* A LoRA version: every request names its adapter and is stamped with its version
  (:mod:`glmpost.rollout.lora_servers`); no label nor fingerprint is read.
* The weight version: a server with labels (``GET /weight_info``, dev mode; vLLM 0.27.1 on) that
  ``sync-weights`` labelled is trusted for its label (the policy version that samples), read when the
  run opens and again after every generate call (one cheap GET, no model work), or, where the server
  answers ``weight_versions`` per choice (0.34, ``return_weight_versions``), by each sequence's own
  label, with no request after the call. A server without labels, or with none set (vLLM's
  ``"default"``), is confirmed by its fingerprint (:mod:`glmpost.kernel.fingerprint`) against the
  checkpoint's (and nearer to it than to the previous version's in the same root), when the run opens
  and again after every generate call. A sequence is stamped with the checkpoint's policy version only
  when the server that answered it was confirmed before and after; a labelled server's sequence is
  stamped with the label (the version that sampled it, which ``sync-weights`` set) when the label held
  for the whole call or is the sequence's own; otherwise with
  :data:`~glmpost.formats.schema.UNKNOWN_VERSION` (-1 in ``policy_versions``, formats/SPEC.md;
  training counts such records as of unknown lag and says so) rather than a version nobody confirmed.
"""

from __future__ import annotations

from typing import Any, Optional

from tqdm import tqdm

from glmpost.config import ConfigError
from glmpost.formats.schema import UNKNOWN_VERSION
from glmpost.kernel.fingerprint import (
    DEFAULT_TOLERANCE,
    Fingerprint,
    checkpoint_fingerprint,
    confirm_server,
    previous_version_dir,
)
from glmpost.kernel.sglang_client import ServerError
from glmpost.kernel.vllm_client import LOGITS_MODES
from glmpost.rollout.records import as_version
from glmpost.rollout.servers import Outcome
from glmpost.rollout.sglang_backend import SGLangBackend
from glmpost.stage import log

__all__ = ["VLLMBackend"]


class VLLMBackend(SGLangBackend):
    """:class:`SGLangBackend` over :class:`~glmpost.kernel.vllm_client.VLLMClient` servers, each server's
    version confirmed by fingerprint (``expected``: the checkpoint's; ``policy_version`` stamped when it matches)."""

    reports_weight_version = False  # confirmed by fingerprint instead
    expected: Optional[Fingerprint] = None
    previous: Optional[Fingerprint] = None  # the root's previous version's, which a server must match less well
    policy_version: Optional[int] = None
    tolerance: float = DEFAULT_TOLERANCE

    @classmethod
    def open(cls, checkpoint: Any, config: Any, device: Any = None) -> "VLLMBackend":
        """:meth:`SGLangBackend.open`, then each server's version confirmed against the checkpoint."""
        backend = super().open(checkpoint, config, device)
        if backend.lora is not None:  # a LoRA version: each request names its adapter, whose version it is
            return backend
        backend.expected = checkpoint_fingerprint(checkpoint.version_dir)
        older = previous_version_dir(checkpoint.version_dir)
        backend.previous = checkpoint_fingerprint(older) if older is not None else None
        backend.policy_version = checkpoint.policy_version
        backend.tolerance = config.engine.fingerprint_tolerance
        for client in backend.pool.clients:
            try:
                labelled = client.read_label()
            except ServerError:
                labelled = False
            if labelled:
                if client.weight_version != str(backend.policy_version):
                    log(f"--server {client.url} does not serve {checkpoint.version_dir}: it reports weight version "
                        f"{client.weight_version}, not {backend.policy_version}, and its records say so; run "
                        "sync-weights --engine vllm to switch it")
                continue
            try:
                ok, words = confirm_server(client, backend.expected, tolerance=backend.tolerance, previous=backend.previous)
            except ServerError as exc:
                ok, words = False, str(exc)
            client.weight_version = str(backend.policy_version) if ok else None
            if not ok:
                log(f"--server {client.url} does not serve {checkpoint.version_dir} by its fingerprint ({words}): its records "
                    "get policy version -1 (unknown); run sync-weights --engine vllm to switch it")
        return backend

    def engine_name(self) -> str:
        """The name stamped in each record's engine map."""
        return "vllm"

    def _confirm(self, client: Any) -> bool:
        """Confirm (or unconfirm) ``client``'s version: a labelled server's label read again (True when
        it did not change: the label before the call held for all of it), else by fingerprint (True
        when it serves the checkpoint)."""
        if client.labelled:
            before = client.weight_version
            try:
                client.weight_version = client.weight_label()
            except ServerError:
                client.weight_version = None
            if client.weight_version != before:
                log(f"--server {client.url}: it now reports weight version {client.weight_version} (was {before}); "
                    "the records it answered meanwhile get policy version -1 (unknown)")
            return client.weight_version is not None and client.weight_version == before
        if client.has_labels is not False and self._labelled_since(client):
            return False  # sync-weights labelled it during this call: which side sampled is unknown
        try:
            ok, words = confirm_server(client, self.expected, tolerance=self.tolerance, previous=self.previous)
        except ServerError as exc:
            ok, words = False, str(exc)
        if not ok and client.has_labels and self._labelled_since(client):
            # The fingerprint waited out a sync-weights pause and saw the new weights; the label was still
            # unset when this call's last answer came, and sync-weights sets it before it resumes: the call
            # was sampled before the pause, on the weights confirmed before it.
            return True
        if not ok and client.weight_version is not None:
            log(f"--server {client.url}: its weights are no longer confirmed ({words}); its next records get policy version -1 (unknown)")
        client.weight_version = str(self.policy_version) if ok else None
        return ok

    def sampling_versions(self, checkpoint: Any) -> list[int]:
        """:meth:`SGLangBackend.sampling_versions` for vLLM: a server's label where it has one set, else
        the checkpoint's version when its fingerprint matches; unknown otherwise (and while a
        sync-weights has unset the label it had)."""
        if self.lora is not None:
            return super().sampling_versions(checkpoint)
        return [self._weight_version(client) for client in self.pool.clients]

    def _weight_version(self, client: Any) -> int:
        try:
            if client.read_label():
                version = as_version(client.weight_version)
                return UNKNOWN_VERSION if version is None else version
            if client.labelled:  # it had a label and has none now: a sync-weights in progress
                return UNKNOWN_VERSION
            ok, _ = confirm_server(client, self.expected, tolerance=self.tolerance, previous=self.previous)
        except ServerError:
            return UNKNOWN_VERSION
        return self.policy_version if ok else UNKNOWN_VERSION

    @staticmethod
    def _labelled_since(client: Any) -> bool:
        """Whether ``client``'s server took a label since it was last read (then its next calls use it)."""
        try:
            if client.read_label():
                log(f"--server {client.url}: it now reports weight version {client.weight_version}; its next records get it")
                return True
        except ServerError:
            pass
        return False

    def _server_kind(self, client: Any, settings: Any) -> str:
        """The logits modes are refused; otherwise :meth:`SGLangBackend._server_kind`."""
        mode = settings.info.get("logprobs_mode")
        if mode in LOGITS_MODES:
            raise ConfigError("{server} {url} returns logits (vLLM logprobs_mode {mode}), not log-probs: start vLLM "
                              "with logprobs_mode processed_logprobs (kind sampled) or raw_logprobs (kind raw)",
                              url=client.url, mode=mode, exit_code=1)
        return super()._server_kind(client, settings)

    def generate(self, sequences: list[list[int]], keys: list[str], progress: tqdm, **kwargs: Any) -> list[Outcome]:
        """:meth:`SGLangBackend.generate`, then every server confirmed again (not one that labels each
        choice): a sequence keeps the checkpoint's version only when its server was confirmed before
        (its answer carries it) and after, or its own label is the checkpoint's version."""
        outcomes = super().generate(sequences, keys, progress, **kwargs)
        if self.lora is not None:  # stamped with the adapter each request named (glmpost.rollout.lora_servers)
            return outcomes
        labelled = {client.url for client in self.pool.clients if client.labelled}
        own = {client.url for client in self.pool.clients if client.labelled and client.per_choice_versions}
        confirmed = own | {client.url for client in self.pool.clients if client.url not in own and self._confirm(client)}

        def stamp(key: str, version: Any) -> Any:
            url = self.served(key)
            if url not in confirmed or version is None:
                return UNKNOWN_VERSION
            # a label is the version that sampled (sync-weights sets it); a fingerprint confirms only the checkpoint's
            return version if url in labelled or version == self.policy_version else UNKNOWN_VERSION

        return [(completion, stamp(key, version), reason) for key, (completion, version, reason) in zip(keys, outcomes)]

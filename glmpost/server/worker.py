"""The worker side of ``glmpost serve``'s :class:`~glmpost.server.engine.EngineServer`: the queued
:class:`Job`, and :class:`EngineWorker` (a mixin): the worker loop, the merging of single requests
into engine batches, running a batch, and weight swaps between batches.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from glmpost.checkpoints import resolve_checkpoint, tokenizer_revision
from glmpost.errors import GlmpostError
from glmpost.kernel.engine import Scores
from glmpost.kernel.routing import model_routing_layout
from glmpost.server.answers import input_start, prompt_rows, sequence_answer
from glmpost.server.loading import LoadedCheckpoint, load_checkpoint
from glmpost.server.parsing import RequestError, SequenceRequest

__all__ = ["ARRIVAL_GAP_S", "EngineWorker", "Job"]


@dataclass
class Job:
    """One request queued for the engine worker: a generate batch or a weight update, and its answer."""

    kind: str  # "generate" or "update"
    payload: Any
    batch: bool = False  # a batch request: run as its own engine batch(es), never merged
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None
    started: float = field(default_factory=time.perf_counter)


# A pause between requests this long ends a burst of clients sending their next request.
ARRIVAL_GAP_S = 0.01


class EngineWorker:
    """The engine worker of :class:`~glmpost.server.engine.EngineServer`, which sets the queue
    (``_queue``, ``_cond``, ``_stopping``), the loaded checkpoint and the settings these methods read."""

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                job = self._queue.popleft()
            jobs = [job]
            if job.kind == "generate" and not job.batch:
                jobs = self._gather(job)
            try:
                if job.kind == "update":
                    job.result = self._update(job.payload)
                else:
                    self._run_generate([it for j in jobs for it in j.payload])
                    for j in jobs:
                        j.result = [it.result for it in j.payload]
            except RequestError as exc:
                for j in jobs:
                    j.error = exc
            except Exception as exc:  # the engine failed on this batch: answer 500, keep serving
                for j in jobs:
                    j.error = RequestError(f"engine error: {type(exc).__name__}: {exc}", 500)
            if job.kind == "generate":
                self.stats["requests"] += sum(j.error is None for j in jobs)
            for j in jobs:
                j.done.set()

    def _gather(self, first: Job) -> list[Job]:
        """Merge queued single-sequence generate jobs into ``first``'s batch, up to ``batch_size``."""
        jobs, count = [first], len(first.payload)
        with self._cond:
            # Wait up to batch_wait_s for at least as many single requests as the previous merged
            # batch had, for every one received, and for as many as were in flight at once while
            # the last batch ran (the clients just answered are sending their next request right
            # now), so clients that fell into two cohorts merge back into one batch. Answered clients
            # send again in a burst: once no request has arrived for ARRIVAL_GAP_S the burst is over
            # (clients that finished are not coming back), and the batch starts.
            started = time.perf_counter()
            deadline = started + self.batch_wait_s
            while True:
                target = min(self.batch_size, max(self._last_merged, self._inflight, self._recent_peak, 1))
                waiting = sum(len(j.payload) for j in self._queue if j.kind == "generate" and not j.batch)
                now = time.perf_counter()
                quiet = now - max(self._last_arrival, started)
                if count + waiting >= target or now >= deadline or quiet >= ARRIVAL_GAP_S or self._stopping:
                    break
                self._cond.wait(min(deadline - now, ARRIVAL_GAP_S - quiet))
            kept: deque[Job] = deque()
            while self._queue:
                job = self._queue.popleft()
                if job.kind == "generate" and not job.batch and count + len(job.payload) <= self.batch_size:
                    jobs.append(job)
                    count += len(job.payload)
                elif job.kind == "update":  # keep order: nothing queued after an update joins earlier work
                    kept.append(job)
                    kept.extend(self._queue)
                    self._queue.clear()
                else:
                    kept.append(job)
            self._queue.extendleft(reversed(kept))
            self._recent_peak, self._peak_now = max(self._peak_now, 1), self._inflight
        self._last_merged = count
        return jobs

    def _run_generate(self, items: list[SequenceRequest]) -> None:
        """Run one batch of ``items``: those naming an adapter on its model (``item.target``,
        :mod:`glmpost.server.adapters`), the others on the served weights, each model's in request order."""
        by_model: dict[int, tuple[LoadedCheckpoint, list[SequenceRequest]]] = {}
        for item in items:
            loaded = item.target or self.loaded
            by_model.setdefault(id(loaded), (loaded, []))[1].append(item)
        with self._cond:
            self._running = list(items)
        try:
            for loaded, group in by_model.values():
                self._run_on(loaded, group)
        finally:
            with self._cond:
                self._running = []

    def _run_on(self, loaded: LoadedCheckpoint, items: list[SequenceRequest]) -> None:
        engine = loaded.engine
        started = time.perf_counter()
        # Input log-probs (SGLang's input_token_logprobs): entries for positions start .. P-1, the
        # first one None (it has no prefix in the request's window), so score start+1 .. P-1.
        need_scores = [i for i, it in enumerate(items) if it.return_logprob and input_start(it) + 1 < len(it.prompt)]
        scores: dict[int, Scores] = {}
        for top_n in sorted({items[i].top_logprobs_num for i in need_scores}):
            idx = [i for i in need_scores if items[i].top_logprobs_num == top_n]
            for i, s in zip(idx, engine.score([items[i].prompt for i in idx], [input_start(items[i]) + 1 for i in idx],
                                              top_logprobs_num=top_n)):
                scores[i] = s
        # Generation: one engine call per group of identical sampling settings, in request order.
        groups: dict[tuple, list[int]] = {}
        for i, it in enumerate(items):
            if it.params.max_new_tokens > 0:
                p = it.params
                key = (p.temperature, p.top_p, p.top_k, p.max_new_tokens, tuple(p.stop_token_ids), p.log_prob_kind,
                       it.top_logprobs_num)
                groups.setdefault(key, []).append(i)
        completions, cached = {}, {}
        routed = prompt_rows(engine.model, items)
        layout = self._routing_layout() if routed else None
        for key, idx in groups.items():
            engine.record_routing = any(items[i].return_routed_experts for i in idx)
            try:
                outs = engine.generate([items[i].prompt for i in idx], None, items[idx[0]].params,
                                       seeds=[items[i].seed for i in idx], top_logprobs_num=key[-1], caches=loaded.caches,
                                       abort=lambda j, idx=idx: items[idx[j]].abort_message is not None)
            finally:
                engine.record_routing = False
            completions.update(zip(idx, outs))
            if loaded.caches is not None:
                cached.update(zip(idx, loaded.caches.last_reused))
        latency = time.perf_counter() - started
        for i, it in enumerate(items):
            it.result = sequence_answer(it, completions.get(i), scores.get(i), tokenizer=loaded.tokenizer,
                                        weight_version=self.weight_version, latency=latency, cached_tokens=cached.get(i, 0),
                                        prompt_routing=routed.get(i), routing_layout=layout)
            out_ids = it.result["output_ids"]
            self.stats["generated_tokens"] += len(out_ids)
            self.stats["cached_tokens"] += cached.get(i, 0)
        self.stats["batches"] += 1
        self.stats["sequences"] += len(items)
        self.stats["engine_busy_s"] += time.perf_counter() - started

    def _routing_layout(self):
        """The served model's :class:`~glmpost.kernel.routing.RoutingLayout` (read once per loaded
        checkpoint): which of its hidden layers ``routed_experts`` rows are MoE layers'."""
        loaded = self.loaded
        if loaded.routing_layout is None:
            loaded.routing_layout = model_routing_layout(loaded.engine.model)
        return loaded.routing_layout

    def _update(self, payload: dict) -> dict:
        """Validate and load a checkpoint; swap it in only when everything checks out."""
        old = self.loaded

        def refuse(message: str) -> dict:
            return {"success": False, "message": message, "num_paused_requests": 0, "weight_version": self.weight_version}

        try:
            target = resolve_checkpoint(payload["model_path"])
            config = json.loads((target / "config.json").read_text())
            for key in ("architectures", "model_type"):
                if config.get(key) != old.config.get(key):
                    return refuse(f"{target}: {key} {config.get(key)!r} differs from the served {old.config.get(key)!r}")
            revision = tokenizer_revision(target)
            if revision != old.revision:
                return refuse(f"{target}: tokenizer revision {revision} differs from the served {old.revision}")
            # load_model refuses a checkpoint that lacks a tensor; shapes must match the served model's.
            new = load_checkpoint(target, device=self.device, batch_size=self.batch_size, deterministic_topk=self.deterministic_topk,
                                  prefix_cache_batches=self.prefix_cache_batches, attention=self.attention)
            bad = sorted(n for n in old.tensors if new.tensors.get(n) != old.tensors[n])
            if bad:
                return refuse(f"{target}: tensor {bad[0]} has shape {list(new.tensors.get(bad[0], ()))}, the served one {list(old.tensors[bad[0]])}")
        except (GlmpostError, OSError, ValueError) as exc:
            return refuse(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        self.loaded = new
        if payload["weight_version"] is not None:
            self.weight_version = payload["weight_version"]
        del old
        self.adapters.rebuild()  # onto the new weights, as the engines apply theirs to the base they serve
        return {"success": True, "message": f"Succeeded to update model weights from {target}.",
                "num_paused_requests": 0, "weight_version": self.weight_version}

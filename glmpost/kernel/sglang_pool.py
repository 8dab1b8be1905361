"""Several SGLang-API servers behind one client interface (:class:`SGLangPool`), failing over between
them and bounding the requests in flight."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from glmpost.kernel.sglang_client import ServerError, SGLangClient, parse_server_urls


class SGLangPool:
    """Several servers behind one interface, with at most ``concurrency`` requests in flight.

    Request ``i`` goes to server ``i % len(urls)``; when that server finally fails with a connection
    error, timeout or 5xx, the next server is tried, and only when every server failed does the call
    raise :class:`ServerError`. Every server gets the same ``api_key`` and ``admin_api_key``;
    ``client_class`` talks to each (:class:`SGLangClient`, or
    :class:`~glmpost.kernel.vllm_client.VLLMClient` for vLLM servers).
    """

    def __init__(self, urls: str | Sequence[str], *, concurrency: int = 8, timeout: float = 600.0, retries: int = 3,
                 backoff: float = 0.5, api_key: str | None = None, admin_api_key: str | None = None,
                 client_class: type = SGLangClient):
        self.clients = [client_class(u, timeout=timeout, retries=retries, backoff=backoff, api_key=api_key,
                                     admin_api_key=admin_api_key) for u in parse_server_urls(urls)]
        self.concurrency = max(1, concurrency)
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    @property
    def urls(self) -> list[str]:
        return [c.url for c in self.clients]

    def call(self, index: int, fn: Callable[[SGLangClient], Any]) -> Any:
        """``fn(client)`` on server ``index % n``, failing over to the others on retryable errors."""
        last: ServerError | None = None
        for k in range(len(self.clients)):
            client = self.clients[(index + k) % len(self.clients)]
            try:
                return fn(client)
            except ServerError as exc:
                last = exc
                if not exc.retryable:
                    raise
        assert last is not None
        raise last

    def submit(self, index: int, fn: Callable[[SGLangClient], Any]) -> Future:
        """Run :meth:`call` on the pool's threads; the future raises ServerError on final failure."""
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="sglang")
        return self._executor.submit(self.call, index, fn)

    def map(self, fn: Callable[[SGLangClient, Any], Any], items: Sequence[Any]) -> list[Any]:
        """``fn(client, item)`` for every item, in order; an item whose request failed yields its
        :class:`ServerError` instead of a result (so no item is lost)."""
        futures = [self.submit(i, lambda c, item=item: fn(c, item)) for i, item in enumerate(items)]
        results = []
        for future in futures:
            try:
                results.append(future.result())
            except ServerError as exc:
                results.append(exc)
        return results

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def __enter__(self) -> "SGLangPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""The page index in Redis/Valkey (one server or a cluster): lookups, publish, eviction
and the node registry.

``PageIndex`` (redis-py, blocking) and ``AsyncPageIndex`` (redis.asyncio) share every
method: each is defined once, as a generator that yields batches of commands
(``kvstore.index.routing.Cmd``; ``kvstore.index.driver``), in the module of its job:
``lookups`` (clients' ``lookup``), ``publish`` (nodes' ``commit``/``remove``) and
``registry`` (nodes, namespaces, stats). The flavour's ``drive`` sends a batch to its
shards, all at once, and feeds the replies back.

A page becomes visible only through ``commit``, which a node calls after it has
verified the page's bytes, so a failed or abandoned put never shows. Every record names
its node's number and incarnation; a reader counts it only while the registry lists
that same incarnation (``IndexLookup.resolve``), so a superseded or dead incarnation's
records are invisible at once, even when the index lost data or restored an old
snapshot."""

from __future__ import annotations

from typing import Any, TypeVar

from kvstore.index import scripts
from kvstore.index.driver import DEFAULT_ENTRY_TTL_MS, DEFAULT_LEASE_MS, Steps
from kvstore.index.held import HeldConnections
from kvstore.index.lookups import LookupMethods
from kvstore.index.publish import MAX_PAGES_PER_KEY, PublishMethods
from kvstore.index.registry import RegistryMethods
from kvstore.index.routing import INDEX_TIMEOUT, AsyncRouter, SyncRouter

T = TypeVar("T")

# The settings read the lease's default here (kvstore.settings.config).
__all__ = [
    "DEFAULT_ENTRY_TTL_MS",
    "DEFAULT_LEASE_MS",
    "MAX_PAGES_PER_KEY",
    "AsyncPageIndex",
    "PageIndex",
]


class PageIndex(LookupMethods, PublishMethods, RegistryMethods):
    """The page index for blocking callers (redis-py): runs each method's batches in
    the calling thread (its one job, ``drive``). Thread-safe: redis-py pools connections."""

    _router: SyncRouter

    def __init__(
        self,
        url: str,
        *,
        timeout: float = INDEX_TIMEOUT,
        password: str | None = None,
        held_connections: bool = False,
        **kwargs: Any,
    ) -> None:
        """``held_connections``: connections to each server stay open between calls and
        carry them directly (``HeldConnections``: for a caller that asks after pauses,
        as the vLLM scheduler's lookups; its first call after a pause is 0.17 ms
        shorter), instead of redis-py's pool and pipelines."""
        held = HeldConnections() if held_connections else None
        super().__init__(
            url,
            SyncRouter(url, scripts.ALL, timeout=timeout, password=password, held=held),
            **kwargs,
        )

    def drive(self, steps: Steps[T]) -> T:
        """Run ``steps`` in the calling thread: its answer, or what it raised."""
        router = self._router
        router.prepare()
        try:
            batch = next(steps)
            while True:
                batch = steps.send(router.run(batch))
        except StopIteration as done:
            return done.value

    def close(self) -> None:
        self._router.close()


class AsyncPageIndex(LookupMethods, PublishMethods, RegistryMethods):
    """The page index for asyncio callers (redis.asyncio): the same methods, each
    returning an awaitable that runs its batches (its one job, ``drive``)."""

    _router: AsyncRouter

    def __init__(
        self,
        url: str,
        *,
        timeout: float = INDEX_TIMEOUT,
        password: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            url, AsyncRouter(url, scripts.ALL, timeout=timeout, password=password), **kwargs
        )

    async def drive(self, steps: Steps[T]) -> T:
        """Run ``steps`` on the caller's event loop: its answer, or what it raised."""
        # The generator is created by the caller but must not run before the topology is
        # known: it groups keys by shard while building its first batch.
        router = self._router
        await router.prepare()
        try:
            batch = next(steps)
            while True:
                batch = steps.send(await router.run(batch))
        except StopIteration as done:
            return done.value

    async def close(self) -> None:
        await self._router.close()

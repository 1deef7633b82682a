"""A storage node in the index's registry: registration, heartbeat, re-publishing.

The index is kept in step with the page table by one mechanism: whenever the node
cannot be sure the index matches what it holds (the index no longer accepts its
incarnation because it lost its data or was restored from an old snapshot, or an
eviction could not be removed from it), the node registers a new incarnation, which
hides every entry of the old one at once, and re-publishes its namespaces and every
page it holds."""

from __future__ import annotations

import asyncio
import json
import logging
import time

from kvstore.errors import Fault, FencedError, IndexUnavailableError, NodeIdInUseError
from kvstore.index import AsyncPageIndex, Registration
from kvstore.pages.keys import NamespaceKey
from server.dataplane.namespaces import NamespaceCache
from server.heap import HeapTrimmer
from server.identity import NodeIdentity
from server.metrics import NodeMetrics
from server.page import PageState, StoredPage, commit_entry
from server.store import PageStore
from server.tier import Tier

log = logging.getLogger(__name__)


class Registrar:
    """Keeps this node's registry entry alive and the index in step with its page
    table: registers (a new incarnation when needed), refreshes the entry every
    heartbeat, re-publishes what the node holds, deregisters at the end."""

    def __init__(
        self,
        identity: NodeIdentity,
        index: AsyncPageIndex,
        store: PageStore,
        namespaces: NamespaceCache,
        tier: Tier,
        metrics: NodeMetrics,
        trimmer: HeapTrimmer,
        stop: asyncio.Event,
        *,
        heartbeat_interval: float,
        node_ttl: float,
    ) -> None:
        self.identity = identity
        self.index = index
        self.store = store
        self.namespaces = namespaces
        self.tier = tier
        self.metrics = metrics
        self.trimmer = trimmer  # its turn comes after each heartbeat
        self.stop = stop  # set when the node must stop (its id is taken for good)
        self.heartbeat_interval = heartbeat_interval
        self.node_ttl = node_ttl
        self.address = ""
        self.extra: dict[str, str] = {}  # published in the entry: how to reach the node
        self.fatal: Exception | None = None  # why the node stopped by itself
        self._started = time.monotonic()
        self._last_heartbeat = 0.0

    def ready(self) -> bool:
        """Registered, and the last heartbeat reached the index within the node TTL."""
        return (
            bool(self.identity.incarnation)
            and time.monotonic() - self._last_heartbeat < self.node_ttl
        )

    def heartbeat_age(self) -> float:
        """Seconds since the last heartbeat reached the index (since start, before the first)."""
        return time.monotonic() - (self._last_heartbeat or self._started)

    def start(self, address: str, extra: dict[str, str]) -> asyncio.Task[None]:
        """Register as ``address`` (the listener's, known once it listens) with ``extra``,
        and keep the entry alive, on the running loop."""
        self.address = address
        self.extra = extra
        return asyncio.get_running_loop().create_task(self._heartbeat_loop())

    async def deregister(self) -> None:
        """At shutdown: the entry goes, so this node's pages stop matching at once."""
        if not self.identity.incarnation:
            return
        try:
            await self.index.deregister_node(self.identity.node_id, self.identity.incarnation)
        except Fault as exc:
            log.warning("could not deregister (pages expire with the node TTL): %s", exc)

    async def _heartbeat_loop(self) -> None:
        """Register until it succeeds, then refresh the registry entry (with the pages
        held per namespace), re-registering (and re-publishing) when the index says the
        incarnation is stale or an index shard restarted."""
        started = time.monotonic()
        run_ids: dict[str, str] = {}  # index shard address -> run id, as last seen
        while True:
            try:
                await self._check_shards(run_ids)
                await self._heartbeat()
                self.trimmer.tick(self._last_heartbeat)
            except NodeIdInUseError as exc:
                # A pod restarted under the same name waits for its predecessor's entry
                # to expire; a second live process with this id is refused for good.
                if time.monotonic() - started > 2 * self.node_ttl:
                    log.error("%s", exc)
                    self.fatal = exc
                    self.stop.set()
                    return
                log.warning("%s; retrying until it expires", exc)
            except Fault as exc:
                log.warning("heartbeat failed: %s", exc)
            except Exception:
                log.exception("heartbeat failed unexpectedly; retrying")
            await asyncio.sleep(self.heartbeat_interval)

    async def _check_shards(self, run_ids: dict[str, str]) -> None:
        """Flag the index stale when a shard restarted (new run id) or a new primary took
        over (new address): it may have lost what this node published there. A shard
        that is down only shortens prefixes: the heartbeat goes on."""
        for address, run_id in (await self.index.server_ids()).items():
            if run_id is None:
                continue
            if run_ids and run_ids.get(address) != run_id:
                log.warning(
                    "index shard %s restarted or took over: re-publishing under a new incarnation",
                    address,
                )
                self.identity.index_stale = True
            run_ids[address] = run_id

    async def _heartbeat(self) -> None:
        """Refresh this incarnation's registry entry, or register a new incarnation (and
        re-publish) when there is none, the index is stale, or the index fences it."""
        if not self.identity.incarnation or self.identity.index_stale:
            await self._register_new()
        else:
            try:
                await self._register(self.identity.incarnation)
            except FencedError as exc:
                log.warning(
                    "the index no longer accepts this node (%s): registering a new incarnation", exc
                )
                await self._register_new()
        self._last_heartbeat = time.monotonic()

    async def _register(self, incarnation: str | None) -> Registration:
        # the registry carries what this node holds, so `kvstore stats` needs no index scan
        pages = json.dumps(
            {ns: n for ns, n in sorted(self.store.namespace_pages.items()) if n > 0},
            separators=(",", ":"),
        )
        # After a restart the tier below names the incarnation its last run registered: the
        # directory's lock proves that process is gone, so the new one takes over at once.
        return await self.index.register_node(
            self.identity.node_id,
            self.address,
            self.store.capacity,
            int(self.node_ttl * 1000),
            incarnation,
            replaces=self.identity.incarnation or self.tier.predecessor(),
            extra={**self.extra, "pages": pages, **self._usage()},
        )

    def _usage(self) -> dict[str, str]:
        """Pool use and read counters for ``kvstore stats`` (the same figures as /metrics)."""
        sample = self.metrics.registry.get_sample_value
        return {
            "used": str(self.store.used_bytes),
            "hits": str(int(sample("kvstore_get_pages_total") or 0)),
            "misses": str(int(sample("kvstore_get_missing_pages_total") or 0)),
            **self.tier.usage(),
        }

    async def _register_new(self) -> None:
        """Register a fresh incarnation; if this node held pages under an older one,
        re-publish them (and their namespaces) under the new one."""
        registration = await self._register(None)
        republish = (
            bool(self.identity.incarnation) or self.store.ready_pages > 0
        )  # pages recovered from disk too
        self.identity.incarnation, self.identity.number = (
            registration.incarnation,
            registration.number,
        )
        incarnation = registration.incarnation
        self.identity.index_stale = False  # an eviction that fails from here on flags it again
        log.info(
            "registered as %s incarnation %s at %s",
            self.identity.node_id,
            incarnation,
            self.address,
        )
        await self.tier.record_incarnation(incarnation)
        if republish:
            try:
                await self._republish()
            except BaseException:
                self.identity.index_stale = True
                raise

    async def _republish(self) -> None:
        """Publish every ready page under the current incarnation, namespace by namespace."""
        by_ns: dict[NamespaceKey, list[StoredPage]] = {}
        for page in self.store.ready_items():
            by_ns.setdefault(NamespaceKey(page.owner, page.key[0]), []).append(page)
        inc = self.identity.incarnation
        for key, pages in by_ns.items():
            if ns := self.namespaces.get(key.digest):
                await self.index.ensure_namespace(ns)
                await self.index.announce_namespace(key)
            for start in range(0, len(pages), 4096):
                chunk = pages[start : start + 4096]
                written = await self.index.commit(
                    key, self.identity.number, inc, [commit_entry(p) for p in chunk]
                )
                if not all(written):
                    raise IndexUnavailableError(
                        f"an index shard failed while re-publishing {key.member}"
                    )
                # pages evicted while the commit was on its way must not stay advertised
                if gone := [p for p in chunk if p.state is not PageState.READY]:
                    await self.index.remove(
                        key,
                        self.identity.number,
                        [p.key[1] for p in gone],
                        [p.anchor for p in gone],
                        respect_lease=False,
                    )
        log.info(
            "re-published %d pages in %d namespaces", sum(map(len, by_ns.values())), len(by_ns)
        )

"""Eviction: LRU between the high and low watermarks, in step with the index.

Victims are removed from the index before their slots are freed, so the index never
points at a freed slot; a page the index keeps (under a reader's lease) goes back
into the LRU. Called by the data plane before it allocates slots for a PUT.

When the index cannot be reached the node evicts anyway (it must not run out of
memory) and marks its identity ``index_stale``: the heartbeat loop then re-publishes
everything the node holds under a new incarnation, which hides the stale entries."""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvstore.errors import RemoteFault
from kvstore.index import AsyncPageIndex
from kvstore.pages.keys import NamespaceKey
from server.allocator import size_class
from server.metrics import NodeMetrics
from server.store import PageStore, StoredPage

log = logging.getLogger(__name__)


@dataclass(slots=True)
class NodeIdentity:
    """Who this node is in the index. ``incarnation`` is set when it registers;
    ``index_stale`` says the index may advertise pages this node no longer holds."""

    node_id: str
    incarnation: str = ""
    number: int = 0  # the node id's number in the registry; index entries name it
    index_stale: bool = False


class Evictor:
    def __init__(self, store: PageStore, index: AsyncPageIndex, metrics: NodeMetrics, identity: NodeIdentity, high: float, low: float,
                 tenant_quota: int | None = None) -> None:
        self.store = store
        self.tenant_quota = tenant_quota if tenant_quota is not None else store.capacity
        self.index = index
        self.metrics = metrics
        self.identity = identity
        self.high = high
        self.low = low
        self.on_drop: Callable[[StoredPage], None] | None = None  # told of every page dropped (the disk tier frees its copy)
        # called before memory victims are chosen: the disk tier writes the oldest pages
        # it had not written yet, so they leave memory clean instead of being dropped
        self.before_evict: Callable[[int, int | None, str, bool], Awaitable[None]] | None = None

    async def allocate(self, pages: list[StoredPage]) -> None:
        """Assign slots to the claimed pages of one put (one tenant). A tenant over its
        quota evicts its own least-recently-used pages, never another tenant's; then the
        node evicts when the batch would pass the high watermark. A page left without a
        slot (``offset is None``) is refused."""
        store = self.store
        released = store.released_pages
        owner = pages[0].owner
        needed = sum(size_class(p.size) for p in pages)
        # both kinds of victim are chosen first and leave the index in one pass: with the
        # index down each pass waits for its timeout, and a put must not outlast the node TTL
        victims = []
        over_quota = store.tenant_bytes[owner] + needed - self.tenant_quota
        if over_quota > 0:
            await self._clean(over_quota, None, owner, True)
            victims = store.take_victims(over_quota, owner=owner, only_owner=True)
        used = store.used_bytes - sum(store.allocator.slot_size(p.offset) for p in victims)
        if used + needed > self.high * store.capacity:
            await self._clean(used + needed - int(self.low * store.capacity))
            used = store.used_bytes - sum(store.allocator.slot_size(p.offset) for p in victims)
            victims += store.take_victims(used + needed - int(self.low * store.capacity))
        if victims:
            await self._evict(victims)
        for page in pages:
            if store.tenant_bytes[owner] + size_class(page.size) > self.tenant_quota:
                self.metrics.quota_refused.inc()
                continue  # the tenant's own pages are leased: the rest of its put does not fit
            for _ in range(3):
                if store.assign_slot(page) or not await self.evict(size_class(page.size), size_class(page.size), page.owner):
                    break
            if page.offset is None and store.release_a_slab():
                store.assign_slot(page)
        self.metrics.released.inc(store.released_pages - released)

    async def evict(self, nbytes: int, slot_size: int | None = None, owner: str = "") -> int:
        """Evict least-recently-used pages worth at least ``nbytes`` (of ``slot_size`` and
        ``owner`` first, when given); returns pages evicted."""
        await self._clean(nbytes, slot_size, owner)
        released = self.store.released_pages
        victims = self.store.take_victims(nbytes, slot_size, owner)
        released = self.store.released_pages - released
        return await self._evict(victims) + released

    async def _clean(self, nbytes: int, slot_size: int | None = None, owner: str = "", only_owner: bool = False) -> None:
        """Let the disk tier write what ``take_victims`` with the same arguments will pick."""
        if self.before_evict is not None and nbytes > 0:
            await self.before_evict(nbytes, slot_size, owner, only_owner)

    async def evict_pages(self, victims: list[StoredPage]) -> int:
        """Evict pages another tier took (``take_disk_victims``): see ``_evict``."""
        return await self._evict(victims)

    async def _evict(self, victims: list[StoredPage]) -> int:
        """Remove victims (taken by ``take_victims``) from the index, one call per
        namespace, all at once; drop those removed, restore those a read lease keeps."""
        by_ns: dict[NamespaceKey, list[StoredPage]] = defaultdict(list)
        for page in victims:
            by_ns[NamespaceKey(page.owner, page.key[0])].append(page)
        outcomes = await asyncio.gather(*(self._remove(ns, pages) for ns, pages in by_ns.items()))
        evicted = 0
        for pages, gone in zip(by_ns.values(), outcomes):
            for page, removed in zip(pages, gone):
                if removed is not False:
                    self.store.drop(page)
                    if self.on_drop is not None:
                        self.on_drop(page)
                    evicted += 1
                else:
                    self.store.restore(page)
        self.metrics.evictions.inc(evicted)
        return evicted

    async def _remove(self, ns: NamespaceKey, pages: list[StoredPage]) -> list[bool | None]:
        """Per page: True (or None: its shard failed) when it may be dropped, False when a
        reader's lease keeps it."""
        try:
            gone = await self.index.remove(ns, self.identity.number, [p.key[1] for p in pages], [p.anchor for p in pages])
        except RemoteFault as exc:
            # Without the index we still must not run out of memory; readers of a
            # stale entry get "missing" because the page table no longer has it,
            # and the next heartbeat re-publishes under a new incarnation.
            log.warning("evicting without index update: %s", exc)
            self.identity.index_stale = True
            gone = [True] * len(pages)
        if None in gone:  # a shard failed: same as above for its pages
            log.warning("evicting without index update: %d pages on an unreachable index shard", gone.count(None))
            self.identity.index_stale = True
        return gone

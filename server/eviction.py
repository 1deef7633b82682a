"""Eviction: LRU between the high and low watermarks, in step with the index.

Victims are removed from the index before their slots are freed, so the index never
points at a freed slot; a page the index keeps (under a reader's lease) goes back
into the LRU. Called by the data plane before it allocates slots for a PUT.

When the index cannot be reached the node evicts anyway (it must not run out of
memory) and marks its identity ``index_stale``: the heartbeat loop then re-publishes
everything the node holds under a new incarnation, which hides the stale entries."""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass

from kvstore.errors import RemoteFault
from kvstore.index import AsyncPageIndex
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
    def __init__(self, store: PageStore, index: AsyncPageIndex, metrics: NodeMetrics, identity: NodeIdentity, high: float, low: float) -> None:
        self.store = store
        self.index = index
        self.metrics = metrics
        self.identity = identity
        self.high = high
        self.low = low

    async def allocate(self, pages: list[StoredPage]) -> None:
        """Assign slots to claimed pages, evicting first when the batch would pass the
        high watermark; a page left without a slot (``offset is None``) is refused."""
        store = self.store
        needed = sum(size_class(p.size) for p in pages)
        if store.used_bytes + needed > self.high * store.capacity:
            await self.evict(store.used_bytes + needed - int(self.low * store.capacity))
        for page in pages:
            for _ in range(3):
                if store.assign_slot(page) or not await self.evict(size_class(page.size), size_class(page.size), page.owner):
                    break

    async def evict(self, nbytes: int, slot_size: int | None = None, owner: str = "") -> int:
        """Evict least-recently-used pages worth at least ``nbytes`` (of ``slot_size`` and
        ``owner`` first, when given); returns pages evicted."""
        victims = self.store.take_victims(nbytes, slot_size, owner)
        by_ns: dict[str, list[StoredPage]] = defaultdict(list)
        for page in victims:
            by_ns[page.key[0]].append(page)
        evicted = 0
        for ns, pages in by_ns.items():
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
            for page, removed in zip(pages, gone):
                if removed is not False:
                    self.store.drop(page)
                    evicted += 1
                else:
                    self.store.restore(page)
        self.metrics.evictions.inc(evicted)
        return evicted

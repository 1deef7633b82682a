"""Eviction: LRU between the high and low watermarks, in step with the index.

Victims are removed from the index before their slots are freed, so the index never
points at a freed slot; a page the index keeps (under a reader's lease) goes back
into the LRU. Called by the data plane before it allocates slots for a PUT."""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass

from kvstore.errors import KVStoreError
from kvstore.index import AsyncPageIndex
from server.allocator import size_class
from server.metrics import NodeMetrics
from server.store import PageKey, PageStore, StoredPage

log = logging.getLogger(__name__)


@dataclass(slots=True)
class NodeIdentity:
    """Who this node is in the index; ``epoch`` is set when it registers."""

    node_id: str
    epoch: int = 0


class Evictor:
    def __init__(self, store: PageStore, index: AsyncPageIndex, metrics: NodeMetrics, identity: NodeIdentity, high: float, low: float) -> None:
        self.store = store
        self.index = index
        self.metrics = metrics
        self.identity = identity
        self.high = high
        self.low = low

    async def allocate(self, items: list[tuple[PageKey, int, int]]) -> list[StoredPage | None]:
        """Slots for incoming pages (key, size, checksum); None where even eviction
        could not make room (the put of that page is refused)."""
        store = self.store
        needed = sum(size_class(size) for _, size, _ in items)
        if store.used_bytes + needed > self.high * store.capacity:
            await self.evict(store.used_bytes + needed - int(self.low * store.capacity))
        pages: list[StoredPage | None] = []
        for key, size, checksum in items:
            page = store.begin_put(key, size, checksum)
            for _ in range(3):
                if page is not None:
                    break
                if not await self.evict(size_class(size), size_class(size)):
                    break
                page = store.begin_put(key, size, checksum)
            pages.append(page)
        return pages

    async def evict(self, nbytes: int, slot_size: int | None = None) -> int:
        """Evict least-recently-used pages worth at least ``nbytes``; returns pages evicted."""
        victims = self.store.take_victims(nbytes, slot_size)
        by_ns: dict[str, list[StoredPage]] = defaultdict(list)
        for page in victims:
            by_ns[page.key[0]].append(page)
        evicted = 0
        for ns, pages in by_ns.items():
            try:
                gone = await self.index.remove(ns, self.identity.node_id, self.identity.epoch, [p.key[1] for p in pages])
            except KVStoreError as exc:
                # Without the index we still must not run out of memory; readers of a
                # stale entry get "missing" because the page table no longer has it.
                log.warning("evicting without index update: %s", exc)
                gone = [True] * len(pages)
            for page, removed in zip(pages, gone):
                if removed:
                    self.store.drop(page)
                    evicted += 1
                else:
                    self.store.restore(page)
        self.metrics.evictions.inc(evicted)
        return evicted

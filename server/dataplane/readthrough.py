"""Disk read-through for gets: pages that are only on the tier below memory come back
into memory slots before they are sent."""

from __future__ import annotations

import asyncio

from server.eviction import Evictor
from server.metrics import NodeMetrics
from server.page import StoredPage
from server.store import PageStore
from server.tier import Tier


class ReadThrough:
    """Brings a get's pinned pages into memory: a slot from the evictor and a read from
    the tier below for each page only there, one read per page however many gets ask
    for it at once; counts the tier each page was found in."""

    def __init__(
        self, store: PageStore, evictor: Evictor, tier: Tier, metrics: NodeMetrics
    ) -> None:
        self.store = store
        self.evictor = evictor
        self.tier = tier
        self.metrics = metrics

    async def in_memory(
        self, present: list[int], pages: list[StoredPage]
    ) -> tuple[list[int], list[StoredPage]]:
        """The pinned pages of a get, in memory: those only on disk are read back first;
        one that could not be is unpinned and reads as missing."""
        needed = [p for p in pages if p.offset is None or p.loading is not None]
        from_disk = 0
        if needed:
            await self.load(needed)
            from_disk = sum(p.offset is not None for p in needed)
            kept = [(i, p) for i, p in zip(present, pages) if p.offset is not None]
            for page in needed:
                if page.offset is None:
                    self.store.unpin(page)
            present, pages = [i for i, _ in kept], [p for _, p in kept]
        self.metrics.hits.labels("disk").inc(from_disk)
        self.metrics.hits.labels("memory").inc(len(pages) - from_disk)
        return present, pages

    async def load(self, pages: list[StoredPage]) -> None:
        """Bring pinned pages that are only on disk back into memory slots (a get's, or an
        operator's prefetch: server/control/ops.py). Afterwards a
        page with ``offset`` set is in memory and verified; one without could not be
        loaded (no memory, a failed read or check: then it was dropped). A page another
        get is loading already is waited for, not read again."""
        mine = [p for p in pages if p.offset is None and p.loading is None and p.disk is not None]
        others = {p.loading for p in pages if p.loading is not None}
        self.store.start_loading(mine)
        try:
            if mine:
                await self.evictor.allocate(mine)
                await self.tier.load([p for p in mine if p.offset is not None])
        finally:
            self.store.end_loading(mine)
        if others:
            await asyncio.gather(*others)

"""How a page leaves a storage node: out of the index first, then out of the page table.

Victims are removed from the index before their slots are freed, so the index never
points at a freed slot; a page the index keeps (under a reader's lease) goes back into
the table. Both tiers evict through here: the evictor (server/eviction.py) for memory,
the disk tier's space (server/disk/space.py) for pages only on disk.

When the index cannot be reached the node drops the pages anyway (it must not run out
of room) and marks its identity ``index_stale``: the heartbeat then re-publishes
everything the node holds under a new incarnation, which hides the stale entries
(server/registry.py)."""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict

from kvstore.errors import RemoteFault
from kvstore.index import AsyncPageIndex
from kvstore.pages.keys import NamespaceKey
from server.identity import NodeIdentity
from server.metrics import NodeMetrics
from server.page import StoredPage
from server.store import PageStore

log = logging.getLogger(__name__)


class Retirer:
    """Takes pages off the node in step with the index: removes them from the index,
    then drops them from the page table (or restores those a reader's lease keeps)."""

    def __init__(
        self, store: PageStore, index: AsyncPageIndex, identity: NodeIdentity, metrics: NodeMetrics
    ) -> None:
        self.store = store
        self.index = index
        self.identity = identity
        self.metrics = metrics

    async def retire(self, victims: list[StoredPage]) -> list[StoredPage]:
        """Remove victims (*evicting*: from ``take_victims`` or ``take_disk_victims``)
        from the index, one call per namespace, all at once; drop those removed and
        restore those a read lease keeps. Returns the pages dropped: the caller frees
        what else they held (a disk copy)."""
        by_ns: dict[NamespaceKey, list[StoredPage]] = defaultdict(list)
        for page in victims:
            by_ns[NamespaceKey(page.owner, page.key[0])].append(page)
        outcomes = await asyncio.gather(*(self._remove(ns, pages) for ns, pages in by_ns.items()))
        dropped: list[StoredPage] = []
        for pages, gone in zip(by_ns.values(), outcomes):
            for page, removed in zip(pages, gone):
                if removed is not False:
                    self.store.drop(page)
                    dropped.append(page)
                else:
                    self.store.restore(page)
        self.metrics.evictions.inc(len(dropped))
        return dropped

    async def purge(self, page: StoredPage) -> None:
        """A page that must never be served again (its disk record failed its check):
        out of the table now, and out of the index whatever a reader's lease says.
        Its copies were freed by the caller."""
        self.store.drop(page)
        try:
            await self.index.remove(
                NamespaceKey(page.owner, page.key[0]),
                self.identity.number,
                [page.key[1]],
                [page.anchor],
                respect_lease=False,
            )
        except RemoteFault:
            self.identity.index_stale = True

    async def _remove(self, ns: NamespaceKey, pages: list[StoredPage]) -> list[bool | None]:
        """Per page: True (or None: its shard failed) when it may be dropped, False when a
        reader's lease keeps it."""
        try:
            gone = await self.index.remove(
                ns, self.identity.number, [p.key[1] for p in pages], [p.anchor for p in pages]
            )
        except RemoteFault as exc:
            # Without the index we still must not run out of memory; readers of a
            # stale entry get "missing" because the page table no longer has it,
            # and the next heartbeat re-publishes under a new incarnation.
            log.warning("evicting without index update: %s", exc)
            self.identity.index_stale = True
            gone = [True] * len(pages)
        if None in gone:  # a shard failed: same as above for its pages
            log.warning(
                "evicting without index update: %d pages on an unreachable index shard",
                gone.count(None),
            )
            self.identity.index_stale = True
        return gone

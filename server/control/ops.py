"""Pin, unpin, prefetch and clear on one node's page table, and where a prefix's
blocks lie in it.

``NodeControl``'s coroutines run on the node's event loop (server/control/http.py
hands them over from the HTTP threads), so each changes the table without an await
between its reads and its changes, as the data plane does. A request names page keys;
each acts on the ready pages among them and counts the rest as missing.

A clear is safe against readers: the pages leave the index at once, whatever a read
lease says (later lookups miss), and the LRUs (``PageStore.hide``); a get that looked
them up before still reads them for the clear grace (at least the clients' read
lease), then they leave the table and the disk, and the node's KV events announce
each removal (``BlockRemoved``)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from kvstore.control.requests import BlockResidency, NodeAction
from kvstore.errors import RemoteFault
from kvstore.events import MEDIUM_CPU, MEDIUM_DISK
from kvstore.index import AsyncPageIndex
from kvstore.pages.keys import NamespaceKey
from server.control.metrics import ControlMetrics
from server.control.pins import PinBook, slot_bytes
from server.dataplane.readthrough import ReadThrough
from server.identity import NodeIdentity
from server.page import PageKey, PageState, StoredPage
from server.store import PageStore
from server.tier import Tier

log = logging.getLogger(__name__)


class NodeControl:
    """The control API's actions on the page table (on the node's loop)."""

    def __init__(
        self,
        store: PageStore,
        index: AsyncPageIndex,
        identity: NodeIdentity,
        tier: Tier,
        readthrough: ReadThrough,
        pins: PinBook,
        metrics: ControlMetrics,
        clear_grace: float,
    ) -> None:
        self.store = store
        self.index = index
        self.identity = identity
        self.tier = tier
        self.readthrough = readthrough
        self.pins = pins
        self.metrics = metrics
        self.clear_grace = clear_grace
        self._tasks: set[asyncio.Task[Any]] = set()  # clears waiting out their grace, ...

    def _ready(self, blocks: list[list[PageKey]]) -> tuple[list[StoredPage], int, int]:
        """The ready pages of ``blocks`` (each block's page keys), the keys missing, and
        the blocks whose every page is ready here."""
        pages: list[StoredPage] = []
        missing = whole = 0
        for keys in blocks:
            found = [self.store.find_page(k) for k in keys]
            ready = [p for p in found if p is not None and p.state is PageState.READY]
            ready = [p for p in ready if not p.clearing]
            pages += ready
            missing += len(keys) - len(ready)
            whole += len(ready) == len(keys)
        return pages, missing, whole

    async def pin(self, blocks: list[list[PageKey]], ttl_s: float | None) -> NodeAction:
        """Pin the ready pages of ``blocks`` until ``ttl_s`` from now (None: until
        unpinned); all or none (``PinRefused``). Pages only on disk are brought into
        memory; every pinned page gets a disk copy where there is a disk tier."""
        pages, missing, whole = self._ready(blocks)
        self.pins.check(pages)
        until = math.inf if ttl_s is None else time.time() + ttl_s
        self.pins.pin(pages, until)  # before the read-back: its eviction must pass them over
        on_disk = [p for p in pages if p.offset is None]
        await self._bring_in(on_disk)
        self.tier.keep(pages)
        await self.pins.save()
        return self._action("pin", pages, missing, whole, on_disk)

    async def unpin(self, blocks: list[list[PageKey]]) -> NodeAction:
        pages, missing, _ = self._ready(blocks)
        gone = self.pins.unpin(pages)
        await self.pins.save()
        keys_gone = {p.key for p in gone}
        whole = sum(all(k in keys_gone for k in keys) for keys in blocks)
        return self._action("unpin", gone, missing, whole, [p for p in gone if p.offset is None])

    async def prefetch(self, blocks: list[list[PageKey]]) -> NodeAction:
        """Bring the prefix's pages that are only on disk into memory; ``pages``: those
        brought in."""
        pages, missing, whole = self._ready(blocks)
        on_disk = [p for p in pages if p.offset is None or p.loading is not None]
        loaded = await self._bring_in(on_disk)
        self.metrics.prefetched.inc(len(loaded))
        return self._action("prefetch", loaded, missing, whole, loaded)

    def start(self) -> None:
        """On the running loop, at the node's start: arm the pins' expiry, and bring the
        pinned pages the disk tier recovered back into memory (in the background)."""
        self.pins.start()
        recovered = [p for p in self.pins.pinned.values() if p.offset is None]
        if recovered:
            task = asyncio.get_running_loop().create_task(self._bring_in(recovered))
            self._tasks.add(task)  # held, so it is not collected while it runs
            task.add_done_callback(self._tasks.discard)

    async def _bring_in(self, pages: list[StoredPage]) -> list[StoredPage]:
        """Read pages only on disk into memory (as a get does, one read however many
        ask); returns those now in memory."""
        if not pages:
            return []
        held = [p for p in (self.store.pin_for_read(p.key) for p in pages) if p is not None]
        try:
            await self.readthrough.load(held)
        finally:
            for page in held:
                self.store.unpin(page)
        return [p for p in held if p.offset is not None]

    async def clear(self, chosen: Callable[[StoredPage], bool], scope: str) -> NodeAction:
        """Clear the ready pages ``chosen`` picks: out of the index and the LRUs now, out
        of the table after the clear grace (module docstring)."""
        pages = [
            p
            for p in list(self.store.pages.values())
            if p.state is PageState.READY and not p.clearing and chosen(p)
        ]
        memory = [p for p in pages if p.offset is not None]
        self.pins.unpin(pages)
        for page in pages:
            self.store.hide(page)
        withdrawn = await self._withdraw(pages)
        self.metrics.cleared.labels(scope).inc(len(pages))
        if pages:
            await self.pins.save()
            task = asyncio.get_running_loop().create_task(self._drop_later(pages, withdrawn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        action = self._action("clear", pages, 0, 0, [p for p in pages if p not in memory])
        action.memory = len(memory)
        return action

    async def _withdraw(self, pages: list[StoredPage]) -> bool:
        """Remove the pages' index entries, leases or not; False when the index could not
        be reached (the node then re-publishes under a new incarnation, which hides every
        old entry: server/retire.py)."""
        by_ns: dict[NamespaceKey, list[StoredPage]] = defaultdict(list)
        for page in pages:
            by_ns[NamespaceKey(page.owner, page.key[0])].append(page)
        try:
            for ns, group in by_ns.items():
                gone = await self.index.remove(
                    ns,
                    self.identity.number,
                    [p.key[1] for p in group],
                    [p.anchor for p in group],
                    respect_lease=False,
                )
                if None in gone:
                    raise RemoteFault("an index shard failed")
        except RemoteFault as exc:
            log.warning("clear: index entries not removed (%s); re-publishing afresh", exc)
            self.identity.index_stale = True
            return False
        return True

    async def _drop_later(self, pages: list[StoredPage], withdrawn: bool) -> None:
        """After the grace (at once when the index kept entries: the re-publish must not
        name them), the cleared pages leave the table and the tier below."""
        if withdrawn:
            await asyncio.sleep(self.clear_grace)
        for page in pages:
            if page.clearing and page.state is PageState.READY:
                self.store.drop(page)
                self.tier.dropped(page)

    def _action(
        self,
        action: str,
        pages: list[StoredPage],
        missing: int,
        blocks: int,
        on_disk: list[StoredPage],
    ) -> NodeAction:
        return NodeAction(
            node_id=self.identity.node_id,
            action=action,
            pages=len(pages),
            bytes=sum(slot_bytes(p) for p in pages),
            memory=len(pages) - len(on_disk),
            disk=len(on_disk),
            missing=missing,
            blocks=blocks,
        )

    def residency(self, blocks: list[list[PageKey]]) -> list[BlockResidency]:
        """Per block this node holds whole: its tier and pin. Runs on an HTTP thread:
        single reads of the table and the pages (a page that moves meanwhile is seen
        where it was)."""
        now = time.time()
        out = []
        for i, keys in enumerate(blocks):
            found = [self.store.pages.get(k) for k in keys]
            if any(p is None or p.state is not PageState.READY or p.clearing for p in found):
                continue
            held = [p for p in found if p is not None]
            pinned = all(p.pin_until is not None for p in held)
            ttls = [self.pins.ttl(p, now) for p in held] if pinned else []
            finite = [t for t in ttls if t is not None]
            out.append(
                BlockResidency(
                    block=i,
                    tier=MEDIUM_CPU if all(p.offset is not None for p in held) else MEDIUM_DISK,
                    pinned=pinned,
                    pin_ttl_s=round(min(finite), 3) if finite else None,
                )
            )
        return out

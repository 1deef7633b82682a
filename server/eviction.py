"""Eviction from memory: LRU between the high and low watermarks, each tenant within
its quota, in step with the index and with the tier below memory.

Called by the data plane before it allocates slots for a put, and before a get reads
pages back from disk (server/dataplane/). Before it picks victims it lets the tier
below write them (``Tier.before_evict``), so they leave memory clean instead of being
dropped; pages that must go leave through the retirer (server/retire.py), which keeps
the index in step, and the tier is told of each (``Tier.dropped``)."""

from __future__ import annotations

from server.allocator import size_class
from server.metrics import NodeMetrics
from server.page import PageState, StoredPage
from server.retire import Retirer
from server.store import PageStore
from server.tier import Tier


class Evictor:
    """Frees memory slots for new pages: chooses victims least recently used first and
    assigns the slots a put (or a read-back) needs."""

    def __init__(
        self,
        store: PageStore,
        retirer: Retirer,
        tier: Tier,
        metrics: NodeMetrics,
        high: float,
        low: float,
        tenant_quota: int | None = None,
    ) -> None:
        self.store = store
        self.retirer = retirer
        self.tier = tier
        self.metrics = metrics
        self.high = high
        self.low = low
        self.tenant_quota = tenant_quota if tenant_quota is not None else store.capacity

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
        victims: list[StoredPage] = []
        over_quota = store.tenant_bytes[owner] + needed - self.tenant_quota
        if over_quota > 0:
            await self._clean(over_quota, None, owner, True)
            victims = self._take(over_quota, None, owner, True)
        used = store.used_bytes - sum(store.slot_bytes(p) for p in victims)
        if used + needed > self.high * store.capacity:
            await self._clean(used + needed - int(self.low * store.capacity))
            used = store.used_bytes - sum(store.slot_bytes(p) for p in victims)
            victims += self._take(used + needed - int(self.low * store.capacity))
        if victims:
            await self._evict(victims)
        for page in pages:
            if store.tenant_bytes[owner] + size_class(page.size) > self.tenant_quota:
                self.metrics.quota_refused.inc()
                continue  # the tenant's own pages are leased: the rest of its put does not fit
            for _ in range(3):
                if store.assign_slot(page) or not await self.evict(
                    size_class(page.size), size_class(page.size), page.owner
                ):
                    break
            if page.offset is None and self._release_a_slab():
                store.assign_slot(page)
        self.metrics.released.inc(store.released_pages - released)

    def _release_a_slab(self, tries: int = 8) -> bool:
        """Free one whole slab by releasing the memory copies of its pages, when all of
        them are clean and no transfer holds them: the slabs of the oldest pages are
        tried first. The allocator's last resort for a page of a slot size no slab has
        room for (a page coming back from disk, say, when memory is full of pages of
        another size): releasing pages one by one in LRU order may free no slab."""
        store = self.store
        slab_size = store.allocator.slab_size
        lru = store.memory_lru()
        tried: set[int] = set()
        for page in lru:
            index = page.offset // slab_size  # type: ignore[operator]
            if index in tried:
                continue
            tried.add(index)
            members = [p for p in lru if p.offset // slab_size == index]  # type: ignore[operator]
            if all(
                p.disk is not None
                and not p.pins
                and not p.writing
                and p.pin_until is None
                and p.state is PageState.READY
                for p in members
            ):
                for member in members:
                    store.release_memory(member)
                store.released_pages += len(members)
                return True
            if len(tried) >= tries:
                break
        return False

    async def evict(self, nbytes: int, slot_size: int | None = None, owner: str = "") -> int:
        """Evict least-recently-used pages worth at least ``nbytes`` (of ``slot_size`` and
        ``owner`` first, when given); returns pages evicted."""
        await self._clean(nbytes, slot_size, owner)
        released = self.store.released_pages
        victims = self._take(nbytes, slot_size, owner)
        released = self.store.released_pages - released
        return await self._evict(victims) + released

    async def _clean(
        self, nbytes: int, slot_size: int | None = None, owner: str = "", only_owner: bool = False
    ) -> None:
        """Let the tier below write what ``_take`` with the same arguments will pick."""
        if nbytes > 0:
            await self.tier.before_evict(
                self.store.eviction_order(slot_size, owner, only_owner), nbytes
            )

    def _take(
        self, nbytes: int, slot_size: int | None = None, owner: str = "", only_owner: bool = False
    ) -> list[StoredPage]:
        """``PageStore.take_victims``, passing over the dirty pages the tier still writes."""
        return self.store.take_victims(
            nbytes, slot_size, owner, only_owner, demotable=self.tier.demotable
        )

    async def _evict(self, victims: list[StoredPage]) -> int:
        """Victims leave the index and the table (those a read lease keeps stay); the tier
        frees whatever it held of each page dropped."""
        dropped = await self.retirer.retire(victims)
        for page in dropped:
            self.tier.dropped(page)
        return len(dropped)

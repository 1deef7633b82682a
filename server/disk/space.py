"""The disk tier's slots: who may take one, and what makes room.

A slot holds one record (server/disk/layout.py). A tenant holds at most its quota of
the disk; past it its own least-recently-used copies make room, never another
tenant's; then anyone's least-recently-used copies go. A copy of a page that is also
in memory just goes; a page only on disk leaves the index (a reader's lease keeps it,
as in memory) and the node, through the retirer (server/retire.py). A freed slot's
header is erased first, so recovery never brings back a page that was evicted."""

from __future__ import annotations

import asyncio
from collections import Counter

from server.allocator import SlabAllocator
from server.disk.files import DiskFiles
from server.disk.layout import record_slot
from server.metrics import NodeMetrics
from server.page import StoredPage
from server.retire import Retirer
from server.store import PageStore


class DiskSpace:
    """Hands out and takes back the disk tier's slots, within each tenant's quota."""

    def __init__(
        self,
        files: DiskFiles,
        store: PageStore,
        retirer: Retirer,
        metrics: NodeMetrics,
        tenant_quota: float,
    ) -> None:
        self.files = files
        self.store = store
        self.retirer = retirer
        self.metrics = metrics
        self.allocator = SlabAllocator(files.capacity, files.slab_size, classify=record_slot)
        self.tenant_bytes: Counter[str] = Counter()  # disk slot bytes per tenant
        self.tenant_quota = int(tenant_quota * files.capacity)

    @property
    def used_bytes(self) -> int:
        return self.allocator.used_bytes

    def fits(self, page: StoredPage) -> bool:
        """Whether the page's record fits a disk slab at all."""
        return record_slot(page.size) <= self.files.slab_size

    # ---- at start (server/disk/recovery.py) -------------------------------------------

    def restore_slab(self, index: int, slot_size: int, slots: list[int]) -> None:
        """A slab found on disk, cut into ``slot_size`` slots, of which ``slots`` hold records."""
        self.allocator.restore_slab(index, slot_size, slots)

    def charge(self, tenant: str, slot_size: int) -> None:
        """A record found on disk holds a slot of ``tenant``'s."""
        self.tenant_bytes[tenant] += slot_size

    # ---- while serving ------------------------------------------------------------------

    async def take_offset(self, page: StoredPage) -> int | None:
        """A disk slot for ``page``, evicting the tenant's own disk pages past its quota,
        then anyone's least recently used; None when none can be had."""
        cls = record_slot(page.size)
        over = self.tenant_bytes[page.owner] + cls - self.tenant_quota
        if over > 0:
            await self._evict(over, cls, page.owner)
            if self.tenant_bytes[page.owner] + cls > self.tenant_quota:
                return None
        for _ in range(3):
            offset = self.allocator.allocate(page.size)  # classify: record_slot
            if offset is not None:
                self.tenant_bytes[page.owner] += cls
                return offset
            if not await self._evict(cls, cls, None):
                break
        return None

    def forget_copy(self, page: StoredPage) -> None:
        """The page keeps no disk copy (evicted, dropped, or found corrupt): free its slot."""
        offset = self.store.remove_disk_copy(page)
        if offset is not None:
            self.free(offset, record_slot(page.size), page.owner)

    def free(self, offset: int, slot_size: int, owner: str) -> None:
        """Erase the record's header, then free the slot (in that order, so the erase can
        never hit a record written into the slot after it was reused)."""
        self.tenant_bytes[owner] -= slot_size

        async def erase_then_free() -> None:
            try:
                await asyncio.get_running_loop().run_in_executor(
                    self.files.writers, self.files.erase_header, offset
                )
            except (
                OSError,
                RuntimeError,
            ):  # degraded or shutting down: the stale record is a valid page anyway
                pass
            finally:
                self.allocator.free(offset)

        asyncio.get_running_loop().create_task(erase_then_free())

    async def _evict(self, nbytes: int, slot_size: int, owner: str | None) -> int:
        """Free disk copies worth ``nbytes``: a copy of a page also in memory just goes;
        a page only on disk leaves the index (a reader's lease keeps it) and the node."""
        pages, copies = self.store.take_disk_victims(nbytes, slot_size, owner)
        for page in copies:
            self.forget_copy(page)
        evicted = 0
        if pages:
            dropped = await self.retirer.retire(pages)
            for page in dropped:
                self.forget_copy(page)
            evicted = len(dropped)
        self.metrics.disk_evicted.inc(len(copies) + evicted)
        return len(copies) + evicted

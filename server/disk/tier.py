"""The disk tier under the memory tier, behind the ``Tier`` seam (server/tier.py).

Owned by the node's event loop, like the page table (server/store.py); the file I/O
runs on ``DiskFiles``' threads. Its parts, one job each:

- server/disk/demoter.py: what goes to disk and when (write-back, write-through,
  admission), one record per page;
- server/disk/reader.py: reads back into memory, every record verified;
- server/disk/space.py: the disk's slots, tenant quotas, disk eviction;
- server/disk/health.py: the degraded state and the delayed fdatasync;
- server/disk/recovery.py: the page table rebuilt from the records at start.

``open_disk_tier`` wires them; ``DiskTier`` is what memory and the node see. The
policies, the file layout and the crash-consistency argument: docs/storage-tiers.md."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

from server.disk.demoter import Demoter, TierPolicy
from server.disk.files import DiskFiles
from server.disk.health import DiskHealth
from server.disk.reader import DiskReader
from server.disk.recovery import recover
from server.disk.space import DiskSpace
from server.metrics import NodeMetrics
from server.page import StoredPage
from server.retire import Retirer
from server.store import PageStore
from server.tier import Tier

log = logging.getLogger(__name__)


class DiskTier(Tier):
    """The disk tier as memory and the node see it: hands each call to the part that
    does it, and reports the tier's figures and health."""

    def __init__(
        self,
        store: PageStore,
        files: DiskFiles,
        space: DiskSpace,
        demoter: Demoter,
        reader: DiskReader,
        health: DiskHealth,
        metrics: NodeMetrics,
        predecessor: str,
    ) -> None:
        self.store = store
        self.files = files
        self.space = space
        self.demoter = demoter
        self.reader = reader
        self.health = health
        self.metrics = metrics
        self._predecessor = predecessor

    # ---- what memory tells the tier ------------------------------------------------------

    async def before_evict(self, order: Iterator[StoredPage], nbytes: int) -> None:
        await self.demoter.before_evict(order, nbytes)

    def demotable(self, page: StoredPage) -> bool:
        return self.demoter.demotable(page)

    def dropped(self, page: StoredPage) -> None:
        self.space.forget_copy(page)

    def committed(self, pages: list[StoredPage]) -> None:
        self.demoter.committed(pages)

    async def load(self, pages: list[StoredPage]) -> None:
        await self.reader.load(pages)

    def keep(self, pages: list[StoredPage]) -> None:
        self.demoter.keep(pages)

    # ---- what the node asks of it -------------------------------------------------------------

    def start(self) -> None:
        self.demoter.start()

    async def stop(self) -> None:
        """Stop demoting, let writes in flight end, make everything durable and close the files."""
        await self.demoter.stop()
        await asyncio.to_thread(self.files.close)

    def predecessor(self) -> str:
        return self._predecessor

    async def record_incarnation(self, incarnation: str) -> None:
        await asyncio.get_running_loop().run_in_executor(
            self.files.writers, lambda: self.files.write_state(incarnation=incarnation)
        )

    def usage(self) -> dict[str, str]:
        sample = self.metrics.registry.get_sample_value
        return {
            "disk_used": str(self.used_bytes),
            "disk_capacity": str(self.capacity),
            "disk_pages": str(self.pages),
            "memory_pages": str(self.store.memory_pages),
            "disk_hits": str(int(sample("kvstore_tier_hit_pages_total", {"tier": "disk"}) or 0)),
            "disk_degraded": "1" if self.degraded else "0",
        }

    def status_lines(self) -> list[str]:
        return [f"disk tier degraded: {self.degraded}"] if self.degraded else []

    # ---- figures (the metrics' gauges read these at scrape time) ---------------------------------

    @property
    def pages(self) -> int:
        return self.store.disk_pages

    @property
    def used_bytes(self) -> int:
        return self.space.used_bytes

    @property
    def capacity(self) -> int:
        return self.files.capacity

    @property
    def degraded(self) -> str:
        return self.health.degraded

    @property
    def direct_io(self) -> bool:
        return self.files.direct


def open_disk_tier(
    path: str,
    capacity: int,
    slab_size: int,
    policy: TierPolicy,
    store: PageStore,
    retirer: Retirer,
    metrics: NodeMetrics,
    high: float,
    low: float,
) -> DiskTier:
    """The disk tier in ``path`` under ``store``, holding the pages a previous run left
    there (recovered into the page table, ready, disk only)."""
    files = DiskFiles(path, capacity, slab_size, policy.queue_depth)
    if not files.direct:
        log.warning(
            "disk tier: %s refuses O_DIRECT (tmpfs, overlay?): using buffered I/O (kvstore_disk_direct_io 0)",
            path,
        )
    space = DiskSpace(files, store, retirer, metrics, policy.tenant_quota)
    recovered = recover(files, store, space)
    wake = asyncio.Event()  # the demoter's: a kick, or health's retry
    health = DiskHealth(files, metrics, wake)
    clean_floor = max(0.0, 2 * low - high) * store.capacity
    demoter = Demoter(
        store, files, space, health, metrics, policy, wake, clean_floor, recovered.next_sequence
    )
    reader = DiskReader(store, files, space, health, retirer, metrics)
    tier = DiskTier(
        store,
        files,
        space,
        demoter,
        reader,
        health,
        metrics,
        predecessor=str(files.state.get("incarnation", "")),
    )
    metrics.watch_disk(tier)
    return tier

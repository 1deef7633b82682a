"""Writing pages from memory to disk: which pages, when, and one record each.

The policies (docs/storage-tiers.md):

- **write-back** (default): the demoter writes the least-recently-used pages to disk
  before memory must give them up, so an eviction only frees the memory copy of a
  page that already has a disk copy (no I/O on the put's path). It keeps the oldest
  ``used - (2*low - high) * capacity`` bytes of memory clean: at the high watermark
  twice what one eviction frees. A page it did not reach in time (puts faster than
  the disk) is written when an eviction is about to take it (``before_evict``), and
  a page it cannot write at all is evicted as without a disk tier.
- **write-through**: every committed page is queued for writing at once.
- **admission**: with ``--disk-admission N`` a write-back demotion waits until the
  page was read N times.

Idle, the demoter waits on an event: no timer runs."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from server.disk.files import DiskFiles
from server.disk.health import DiskHealth
from server.disk.layout import HEADER_BYTES, RecordHeader, record_slot, round_up
from server.disk.space import DiskSpace
from server.metrics import NodeMetrics
from server.page import PageState, StoredPage
from server.store import PageStore

POLICIES = ("write-back", "write-through")


@dataclass(frozen=True, slots=True)
class TierPolicy:
    """How pages reach disk (``kvstore server --disk-policy``, ``--disk-admission``,
    ``--disk-queue-depth``, ``--tenant-quota``)."""

    policy: str = "write-back"
    admission: int = 0  # reads a page needs before write-back demotes it
    # --disk-queue-depth: the demoter holds this many pages pinned for writing at once,
    # so the writer threads (half as many, server/disk/files.py) always have the next one
    queue_depth: int = 4
    tenant_quota: float = 1.0  # largest share of the disk one tenant may hold


class Demoter:
    """Writes pages from memory to disk: picks them by policy, writes each as a record,
    and makes it the page's disk copy."""

    def __init__(
        self,
        store: PageStore,
        files: DiskFiles,
        space: DiskSpace,
        health: DiskHealth,
        metrics: NodeMetrics,
        policy: TierPolicy,
        wake: asyncio.Event,
        clean_floor: float,
        sequence: int,
    ) -> None:
        self.store = store
        self.files = files
        self.space = space
        self.health = health
        self.metrics = metrics
        self.policy = policy
        self.clean_floor = (
            clean_floor  # write-back keeps memory clean above this many bytes of the pool
        )
        self.sequence = sequence  # the next record's
        self._wake = wake
        self._through: deque[StoredPage] = deque()
        self._writing: dict[StoredPage, asyncio.Task[None]] = {}  # writes in flight
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the demoter on the running loop (after recovery)."""
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop demoting and let writes in flight end."""
        if self._task is not None:
            self._task.cancel()
        if self._writing:
            await asyncio.wait(list(self._writing.values()))

    def kick(self) -> None:
        """Memory use or the LRU changed: the demoter looks for pages to write."""
        self._wake.set()

    def committed(self, pages: list[StoredPage]) -> None:
        """Pages a put just made ready: write-through queues them."""
        if self.policy.policy == "write-through":
            self._through.extend(pages)
        self.kick()

    def keep(self, pages: list[StoredPage]) -> None:
        """Pinned pages: written to disk soon, whatever the policy, so the pins survive a
        restart (server/control/pins.py)."""
        self._through.extend(p for p in pages if p.disk is None)
        self.kick()

    def demotable(self, page: StoredPage) -> bool:
        """Whether this dirty page is written before memory may let it go (else an
        eviction drops it: the tier is degraded, write-back's admission rule skips it,
        or the page does not fit a disk slab)."""
        admitted = self.policy.policy == "write-through" or page.reads >= self.policy.admission
        return not self.health.paused() and self._writable(page) and admitted

    async def before_evict(self, order: Iterator[StoredPage], nbytes: int) -> None:
        """Before memory evicts ``nbytes`` (taking pages in ``order``): write the pages it
        will pick that are not on disk yet and wait for them, so they leave memory clean
        instead of being dropped. A put waits here only when the demoter fell behind
        (puts faster than the disk)."""
        if self.health.paused():
            return
        waits: dict[StoredPage, asyncio.Task[None]] = {}
        seen = 0
        for page in order:
            if seen >= nbytes:
                break
            if page in waits:
                continue
            seen += self.store.slot_bytes(page)
            if page in self._writing:
                waits[page] = self._writing[page]
            elif self.demotable(page):
                waits[page] = self._start_write(page)
        if waits:
            await asyncio.wait(list(waits.values()))

    # ---- the demoter ---------------------------------------------------------------------

    async def _run(self) -> None:
        """Wait for a kick, then start writes up to the queue depth; each write that ends
        kicks again. Idle, it waits on an event: no timer runs."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self.health.paused():
                continue
            for page in self._pick(self.policy.queue_depth - len(self._writing)):
                self._start_write(page)

    def _pick(self, room: int) -> list[StoredPage]:
        """Up to ``room`` pages to write: write-through's queue first, then the oldest
        dirty pages of the clean-ahead window (write-back)."""
        picked: list[StoredPage] = []
        while self._through and len(picked) < room:
            page = self._through.popleft()
            if self._writable(page):
                picked.append(page)
        target = self.store.used_bytes - self.clean_floor
        if target <= 0 or len(picked) >= room:
            return picked
        seen = 0
        for page in self.store.memory_lru():
            if seen >= target or len(picked) >= room:
                break
            seen += self.store.slot_bytes(page)
            if self._writable(page) and page.reads >= self.policy.admission and page not in picked:
                picked.append(page)
        return picked

    def _writable(self, page: StoredPage) -> bool:
        return (
            page.state is PageState.READY
            and not page.clearing
            and page.disk is None
            and not page.writing
            and page.offset is not None
            and self.space.fits(page)
        )

    # ---- one write ---------------------------------------------------------------------------

    def _start_write(self, page: StoredPage) -> asyncio.Task[None]:
        self.store.hold_for_write(page)
        task = self._writing[page] = asyncio.get_running_loop().create_task(self._demote(page))
        return task

    async def _demote(self, page: StoredPage) -> None:
        """Write one pinned page's record; on success the page is clean."""
        offset = None
        try:
            offset = await self.space.take_offset(page)
            if offset is None or page.state is not PageState.READY or page.offset is None:
                return
            sequence = self.sequence
            self.sequence += 1
            header = RecordHeader(
                record_slot(page.size),
                page.size,
                page.checksum,
                sequence,
                page.position,
                page.key[0],
                page.key[1],
                page.owner,
                page.anchor,
            ).pack()
            data = self.store.pool.view(page.offset, round_up(page.size))
            started = time.perf_counter()
            await asyncio.get_running_loop().run_in_executor(
                self.files.writers, self._write, offset, header, data
            )
            self.metrics.disk_write_seconds.observe(time.perf_counter() - started)
            self.metrics.disk_written_bytes.inc(HEADER_BYTES + len(data))
            if page.state is PageState.READY and not page.clearing:
                self.store.add_disk_copy(page, offset, sequence)
                offset = None
                self.metrics.demoted.inc()
                self.health.wrote()
        except OSError as exc:
            self.health.failed(exc, "write")
        finally:
            if offset is not None:
                self.space.free(offset, record_slot(page.size), page.owner)
            self.store.end_write(page)
            self._writing.pop(page, None)
            self.kick()

    def _write(self, offset: int, header: bytes, data: np.ndarray) -> None:
        """On a writer thread: the slab in the file and the map, then the record."""
        self.files.prepare_slab(offset // self.files.slab_size, record_slot(len(data)))
        self.files.write_record(offset, header, data.data)

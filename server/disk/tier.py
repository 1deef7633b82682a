"""The disk tier under the memory tier: what goes to disk, when, and how it comes back.

Owned by the node's event loop, like the page table (server/store.py); the file I/O
runs on ``DiskFiles``' threads. The policies (docs/storage-tiers.md):

- **write-back** (default): the demoter writes the least-recently-used pages to disk
  before memory must give them up, so an eviction only frees the memory copy of a
  page that already has a disk copy (no I/O on the put's path). It keeps the oldest
  ``used - (2*low - high) * capacity`` bytes of memory clean: at the high watermark
  twice what one eviction frees. A page it did not reach in time (puts faster than
  the disk) is evicted as without a disk tier.
- **write-through**: every committed page is queued for writing at once.
- **admission**: with ``--disk-admission N`` a write-back demotion waits until the
  page was read N times.
- **promotion**: a get of a page that is only on disk reads it into a memory slot
  (the read must land in registered memory to be sent anyway) and the page stays
  there as a clean page, so its next eviction is free and its next get is a memory hit.

Every record is verified when it is read (header fields, then the xxh3 of the page);
a mismatch drops the page (both tiers and the index) and reads as a miss. Disk
eviction frees the least-recently-used disk copies; a page that was only on disk
leaves the index with it. ENOSPC or EIO turns the tier *degraded*: an ERROR line, a
metric, /healthz says so, writes stop for ``RETRY_SECONDS`` and the node serves on."""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass

import xxhash

from kvstore.errors import RemoteFault
from kvstore.index import AsyncPageIndex
from kvstore.pages.keys import NamespaceKey
from server.allocator import SlabAllocator
from server.disk.files import DiskFiles
from server.disk.layout import HEADER_BYTES, RecordHeader, record_slot, round_up
from server.eviction import Evictor
from server.metrics import NodeMetrics
from server.store import PageState, PageStore, StoredPage

log = logging.getLogger(__name__)

# Seconds a degraded tier waits before it tries to write again.
RETRY_SECONDS = 30.0
# Seconds between a write and the fdatasync that makes it durable (docs/storage-tiers.md).
SYNC_DELAY = 5.0
POLICIES = ("write-back", "write-through")


@dataclass(frozen=True, slots=True)
class TierPolicy:
    """How pages reach disk (``kvstore server --disk-policy``, ``--disk-admission``)."""

    policy: str = "write-back"
    admission: int = 0  # reads a page needs before write-back demotes it
    queue_depth: int = 4  # writes in flight at once
    tenant_quota: float = 1.0  # largest share of the disk one tenant may hold


class DiskTier:
    def __init__(self, store: PageStore, files: DiskFiles, index: AsyncPageIndex, evictor: Evictor, metrics: NodeMetrics,
                 policy: TierPolicy, high: float, low: float) -> None:
        self.store = store
        self.files = files
        self.index = index
        self.evictor = evictor
        self.metrics = metrics
        self.policy = policy
        self.allocator = SlabAllocator(files.capacity, files.slab_size, classify=record_slot)
        self.tenant_bytes: Counter[str] = Counter()  # disk slot bytes per tenant
        self.tenant_quota = int(policy.tenant_quota * files.capacity)
        # write-back keeps memory clean above this many bytes of the pool
        self.clean_floor = max(0.0, 2 * low - high) * store.capacity
        self.degraded = ""  # why, while writes are stopped
        self._retry_at = 0.0
        self.sequence = 1
        self._through: deque[StoredPage] = deque()
        self._wake = asyncio.Event()
        self._writing: dict[StoredPage, asyncio.Task] = {}  # writes in flight
        self._sync_due = False
        self._task: asyncio.Task | None = None
        evictor.on_drop = self._forget_copy  # a page dropped from the node loses its disk copy too
        # both policies: a page still waiting for its write is written before memory lets it go
        evictor.before_evict = self.clean_oldest
        store.demotable = self._demotable

    # ---- life cycle -----------------------------------------------------------------

    def start(self) -> None:
        """Start the demoter on the running loop (after recovery)."""
        self._task = asyncio.get_running_loop().create_task(self._demoter())

    async def stop(self) -> None:
        """Stop demoting, let writes in flight end, make everything durable and close the files."""
        if self._task is not None:
            self._task.cancel()
        if self._writing:
            await asyncio.wait(list(self._writing.values()))
        await asyncio.to_thread(self.files.close)

    def kick(self) -> None:
        """Memory use or the LRU changed: the demoter looks for pages to write."""
        self._wake.set()

    def committed(self, pages: list[StoredPage]) -> None:
        """Pages a put just made ready: write-through queues them."""
        if self.policy.policy == "write-through":
            self._through.extend(pages)
        self.kick()

    # ---- demotion ---------------------------------------------------------------------

    async def _demoter(self) -> None:
        """Wait for a kick, then start writes up to the queue depth; each write that ends
        kicks again. Idle, it waits on an event: no timer runs."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._paused():
                continue
            for page in self._pick(self.policy.queue_depth - len(self._writing)):
                self._start_write(page)

    def _paused(self) -> bool:
        return bool(self.degraded) and time.monotonic() < self._retry_at

    def _start_write(self, page: StoredPage) -> asyncio.Task:
        page.writing = True
        page.pins += 1
        self.store.pins += 1
        task = self._writing[page] = asyncio.get_running_loop().create_task(self._demote(page))
        return task

    def _demotable(self, page: StoredPage) -> bool:
        """Whether this dirty page is written before memory may let it go (else an
        eviction drops it: the tier is degraded, write-back's admission rule skips it,
        or the page does not fit a disk slab)."""
        admitted = self.policy.policy == "write-through" or page.reads >= self.policy.admission
        return not self._paused() and self._writable(page) and admitted

    async def clean_oldest(self, nbytes: int, slot_size: int | None, owner: str, only_owner: bool) -> None:
        """Before memory evicts ``nbytes`` (chosen as ``PageStore.take_victims`` chooses,
        same arguments): write the pages it will pick that are not on disk yet and wait
        for them, so they leave memory clean instead of being dropped. A put waits here
        only when the demoter fell behind (puts faster than the disk)."""
        if self._paused():
            return
        waits: dict[StoredPage, asyncio.Task] = {}
        seen = 0
        for page in self.store.eviction_order(slot_size, owner, only_owner):
            if seen >= nbytes:
                break
            if page in waits:
                continue
            seen += self.store.allocator.slot_size(page.offset)
            if page in self._writing:
                waits[page] = self._writing[page]
            elif self._demotable(page):
                waits[page] = self._start_write(page)
        if waits:
            await asyncio.wait(list(waits.values()))

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
        slot_size = self.store.allocator.slot_size
        for page in self.store.memory_lru():
            if seen >= target or len(picked) >= room:
                break
            seen += slot_size(page.offset)
            if self._writable(page) and page.reads >= self.policy.admission and page not in picked:
                picked.append(page)
        return picked

    def _writable(self, page: StoredPage) -> bool:
        return (page.state is PageState.READY and page.disk is None and not page.writing and page.offset is not None
                and record_slot(page.size) <= self.files.slab_size)

    async def _demote(self, page: StoredPage) -> None:
        """Write one pinned page's record; on success the page is clean."""
        offset = None
        try:
            offset = await self._disk_slot(page)
            if offset is None or page.state is not PageState.READY:
                return
            sequence = self.sequence
            self.sequence += 1
            header = RecordHeader(record_slot(page.size), page.size, page.checksum, sequence, page.position, page.key[0], page.key[1],
                                  page.owner, page.anchor).pack()
            data = self.store.pool.view(page.offset, round_up(page.size))
            started = time.perf_counter()
            await asyncio.get_running_loop().run_in_executor(self.files.writers, self._write, offset, header, data)
            self.metrics.disk_write_seconds.observe(time.perf_counter() - started)
            self.metrics.disk_written_bytes.inc(HEADER_BYTES + len(data))
            if page.state is PageState.READY:
                self.store.add_disk_copy(page, offset, sequence)
                offset = None
                self.metrics.demoted.inc()
                self._writes_work()
        except OSError as exc:
            self._degrade(exc, "write")
        finally:
            if offset is not None:
                self._free_slot(offset, record_slot(page.size), page.owner)
            page.writing = False
            self.store.unpin(page)
            self._writing.pop(page, None)
            self.kick()

    def _write(self, offset: int, header: bytes, data) -> None:
        """On a writer thread: the slab in the file and the map, then the record."""
        self.files.prepare_slab(offset // self.files.slab_size, record_slot(len(data)))
        self.files.write_record(offset, header, memoryview(data))

    async def _disk_slot(self, page: StoredPage) -> int | None:
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

    async def _evict(self, nbytes: int, slot_size: int, owner: str | None) -> int:
        """Free disk copies worth ``nbytes``: a copy of a page also in memory just goes;
        a page only on disk leaves the index (a reader's lease keeps it) and the node."""
        pages, copies = self.store.take_disk_victims(nbytes, slot_size, owner)
        for page in copies:
            self._forget_copy(page)
        evicted = await self.evictor.evict_pages(pages) if pages else 0
        self.metrics.disk_evicted.inc(len(copies) + evicted)
        return len(copies) + evicted

    def _forget_copy(self, page: StoredPage) -> None:
        """The page keeps no disk copy (evicted, dropped, or found corrupt)."""
        if page.disk is not None:
            offset, page.disk = page.disk, None
            self.store.disk_lru.pop(page.key, None)
            self._free_slot(offset, record_slot(page.size), page.owner)

    def _free_slot(self, offset: int, slot_size: int, owner: str) -> None:
        """Erase the record's header, then free the slot (in that order, so the erase can
        never hit a record written into the slot after it was reused)."""
        self.tenant_bytes[owner] -= slot_size

        async def erase_then_free() -> None:
            try:
                await asyncio.get_running_loop().run_in_executor(self.files.writers, self.files.erase_header, offset)
            except (OSError, RuntimeError):  # degraded or shutting down: the stale record is a valid page anyway
                pass
            finally:
                self.allocator.free(offset)

        asyncio.get_running_loop().create_task(erase_then_free())

    # ---- reads --------------------------------------------------------------------------

    async def load(self, pages: list[StoredPage]) -> None:
        """Bring pinned pages that are only on disk back into memory slots (a get calls
        this). Afterwards a page with ``offset`` set is in memory and verified; one
        without could not be loaded (no memory, a failed read or check: then it was
        dropped) and reads as missing."""
        loop = asyncio.get_running_loop()
        mine = [p for p in pages if p.offset is None and p.loading is None and p.disk is not None]
        others = {p.loading for p in pages if p.loading is not None}
        for page in mine:
            page.loading = loop.create_future()
        try:
            if mine:
                await self.evictor.allocate(mine)
                await asyncio.gather(*(self._read_back(p) for p in mine))
        finally:
            for page in mine:
                page.loading.set_result(None)
                page.loading = None
        if others:
            await asyncio.gather(*others)

    async def _read_back(self, page: StoredPage) -> None:
        if page.offset is None:  # no memory slot could be had
            return
        data = self.store.pool.view(page.offset, round_up(page.size))
        started = time.perf_counter()
        try:
            raw, digest = await asyncio.get_running_loop().run_in_executor(self.files.readers, self._read, page.disk, data, page.size)
        except OSError as exc:
            self._degrade(exc, "read")
            await self._discard(page)
            return
        self.metrics.disk_read_seconds.observe(time.perf_counter() - started)
        self.metrics.disk_read_bytes.inc(HEADER_BYTES + len(data))
        if not self._matches(page, RecordHeader.unpack(raw), digest):
            self.metrics.disk_errors.labels("checksum").inc()
            log.warning("page %s of namespace %s failed its check on disk: dropped", page.key[1].hex(), page.key[0])
            await self._discard(page)
            return
        self.store.promoted(page)
        self.metrics.promoted.inc()

    def _read(self, offset: int, data, size: int) -> tuple[bytes, int]:
        """On a reader thread: the record, and the xxh3 of its page bytes."""
        raw = self.files.read_record(offset, memoryview(data))
        return raw, xxhash.xxh3_64_intdigest(memoryview(data)[:size])

    @staticmethod
    def _matches(page: StoredPage, header: RecordHeader | None, digest: int) -> bool:
        return (header is not None and header.slot_size == record_slot(page.size) and header.size == page.size
                and header.checksum == page.checksum == digest and header.namespace == page.key[0] and header.page_hash == page.key[1]
                and header.tenant == page.owner)

    async def _discard(self, page: StoredPage) -> None:
        """A page whose record cannot be read or is wrong: out of memory, disk, the index."""
        self.store.release_memory(page)
        if page.state is not PageState.READY:
            return
        self._forget_copy(page)
        self.store.drop(page)
        try:
            await self.index.remove(NamespaceKey(page.owner, page.key[0]), self.evictor.identity.number, [page.key[1]], [page.anchor], respect_lease=False)
        except RemoteFault:
            self.evictor.identity.index_stale = True

    # ---- health -------------------------------------------------------------------------

    def _degrade(self, exc: OSError, what: str) -> None:
        kind = "nospace" if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else "io"
        self.metrics.disk_errors.labels(kind).inc()
        if not self.degraded:
            log.error("disk tier degraded: %s failed in %s: %s; serving from memory, writes retried every %.0f s",
                      what, self.files.directory, exc, RETRY_SECONDS)
        self.degraded = f"{what} failed: {exc}"
        self._retry_at = time.monotonic() + RETRY_SECONDS
        asyncio.get_running_loop().call_later(RETRY_SECONDS, self.kick)

    def _writes_work(self) -> None:
        if self.degraded:
            log.info("disk tier writes again: no longer degraded")
            self.degraded = ""
        if not self._sync_due:
            self._sync_due = True
            asyncio.get_running_loop().call_later(SYNC_DELAY, self._sync)

    def _sync(self) -> None:
        self._sync_due = False
        try:
            asyncio.get_running_loop().run_in_executor(self.files.writers, self._sync_quietly)
        except RuntimeError:  # the tier was stopped (its files are closed, and were synced then)
            pass

    def _sync_quietly(self) -> None:
        try:
            self.files.sync()
        except OSError as exc:
            log.error("disk tier: fdatasync failed: %s", exc)

"""Reading pages back from disk into memory (promotion), never wrong bytes.

A get of a page that is only on disk reads it into the memory slot memory gave it
(the read must land in registered memory to be sent anyway) and the page stays there
as a clean page, so its next eviction is free and its next get is a memory hit. Every
record is verified when it is read (header fields, then the xxh3 of the page); a
mismatch drops the page (both tiers and the index) and reads as a miss."""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np
import xxhash

from server.disk.files import DiskFiles
from server.disk.health import DiskHealth
from server.disk.layout import HEADER_BYTES, RecordHeader, record_slot, round_up
from server.disk.space import DiskSpace
from server.metrics import NodeMetrics
from server.page import PageState, StoredPage
from server.retire import Retirer
from server.store import PageStore

log = logging.getLogger(__name__)


class DiskReader:
    """Reads records back into memory slots and verifies them; a page whose record cannot
    be read or is wrong leaves the node."""

    def __init__(
        self,
        store: PageStore,
        files: DiskFiles,
        space: DiskSpace,
        health: DiskHealth,
        retirer: Retirer,
        metrics: NodeMetrics,
    ) -> None:
        self.store = store
        self.files = files
        self.space = space
        self.health = health
        self.retirer = retirer
        self.metrics = metrics

    async def load(self, pages: list[StoredPage]) -> None:
        """``Tier.load``: read each page (pinned, only on disk, given a memory slot) at once,
        on the reader threads."""
        await asyncio.gather(*(self._read_back(p) for p in pages))

    async def _read_back(self, page: StoredPage) -> None:
        if page.offset is None or page.disk is None:  # no memory slot could be had
            return
        data = self.store.pool.view(page.offset, round_up(page.size))
        started = time.perf_counter()
        try:
            raw, digest = await asyncio.get_running_loop().run_in_executor(
                self.files.readers, self._read, page.disk, data, page.size
            )
        except OSError as exc:
            self.health.failed(exc, "read")
            await self._discard(page)
            return
        self.metrics.disk_read_seconds.observe(time.perf_counter() - started)
        self.metrics.disk_read_bytes.inc(HEADER_BYTES + len(data))
        if not self._matches(page, RecordHeader.unpack(raw), digest):
            self.metrics.disk_errors.labels("checksum").inc()
            log.warning(
                "page %s of namespace %s failed its check on disk: dropped",
                page.key[1].hex(),
                page.key[0],
            )
            await self._discard(page)
            return
        self.store.promoted(page)
        self.metrics.promoted.inc()

    def _read(self, offset: int, data: np.ndarray, size: int) -> tuple[bytes, int]:
        """On a reader thread: the record, and the xxh3 of its page bytes."""
        raw = self.files.read_record(offset, data.data)
        return raw, xxhash.xxh3_64_intdigest(data.data[:size])

    @staticmethod
    def _matches(page: StoredPage, header: RecordHeader | None, digest: int) -> bool:
        return (
            header is not None
            and header.slot_size == record_slot(page.size)
            and header.size == page.size
            and header.checksum == page.checksum == digest
            and header.namespace == page.key[0]
            and header.page_hash == page.key[1]
            and header.tenant == page.owner
        )

    async def _discard(self, page: StoredPage) -> None:
        """A page whose record cannot be read or is wrong: out of memory, disk, the index."""
        self.store.release_memory(page)
        if page.state is not PageState.READY:
            return
        self.space.forget_copy(page)
        await self.retirer.purge(page)

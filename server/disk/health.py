"""Whether the disk tier may write, and when what it wrote becomes durable.

ENOSPC or EIO turns the tier *degraded*: an ERROR line, a metric, /healthz says so,
writes stop for ``RETRY_SECONDS`` and the node serves on; the first write that works
again ends it. Writes are made durable by one ``fdatasync`` ``SYNC_DELAY`` seconds
after the first write since the last one (docs/storage-tiers.md)."""

from __future__ import annotations

import asyncio
import errno
import logging
import time

from server.disk.files import DiskFiles
from server.metrics import NodeMetrics

log = logging.getLogger(__name__)

# Seconds a degraded tier waits before it tries to write again.
RETRY_SECONDS = 30.0
# Seconds between a write and the fdatasync that makes it durable (docs/storage-tiers.md).
SYNC_DELAY = 5.0


class DiskHealth:
    """Tracks the tier's degraded state after I/O errors, and schedules the delayed sync."""

    def __init__(self, files: DiskFiles, metrics: NodeMetrics, wake: asyncio.Event) -> None:
        self.files = files
        self.metrics = metrics
        self._wake = wake  # the demoter's: set when writes may be tried again
        self.degraded = ""  # why, while writes are stopped
        self._retry_at = 0.0
        self._sync_due = False

    def paused(self) -> bool:
        """Writes are stopped (degraded, and the retry time has not come)."""
        return bool(self.degraded) and time.monotonic() < self._retry_at

    def failed(self, exc: OSError, what: str) -> None:
        """A read or write failed: degraded, writes paused for ``RETRY_SECONDS``."""
        kind = "nospace" if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else "io"
        self.metrics.disk_errors.labels(kind).inc()
        if not self.degraded:
            log.error(
                "disk tier degraded: %s failed in %s: %s; serving from memory, writes retried every %.0f s",
                what,
                self.files.directory,
                exc,
                RETRY_SECONDS,
            )
        self.degraded = f"{what} failed: {exc}"
        self._retry_at = time.monotonic() + RETRY_SECONDS
        asyncio.get_running_loop().call_later(RETRY_SECONDS, self._wake.set)

    def wrote(self) -> None:
        """A write worked: no longer degraded, and a sync is due ``SYNC_DELAY`` from now."""
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

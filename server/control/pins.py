"""Which pages an operator pinned, until when; the limits a new pin must keep; the pins
file that carries pins over a restart.

Owned by the node's event loop, like the page table. A pin is ``StoredPage.pin_until``
(a ``time.time()``, inf without a TTL): the page table's eviction passes over a pinned
page, in memory and on disk (server/store.py). A pinned page stays in memory, not
demoted: a pin is for a prefix that must hit at memory speed (a system prompt), and a
disk tier gets a copy too (``Tier.keep``) so that the pin survives a restart.

Expiry runs on one timer, set for the earliest TTL: no polling. The pins file
(``pins.json`` in the disk tier's directory) is rewritten on every change (a few
hundred bytes per thousand pins) by rename, so a crash leaves the old or the new one;
a restart pins again the pages the disk tier recovered that it names, while their TTL
lasts."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from collections import Counter

from server.allocator import size_class
from server.control.metrics import ControlMetrics
from server.page import PageKey, PageState, StoredPage

log = logging.getLogger(__name__)

PINS_FILE = "pins.json"


class PinRefused(Exception):
    """A pin the node's limits refuse; ``limit`` is "share" or "quota"."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit


def slot_bytes(page: StoredPage) -> int:
    """The memory a pinned page holds (or will, when brought back from disk)."""
    return size_class(page.size)


class PinBook:
    """The node's pins. ``capacity``: the node's page memory; ``tenant_quota``: the bytes
    one tenant may hold (its pins count against them); ``max_share``: the share of
    memory all pins together may hold; ``directory``: where the pins file lives (the
    disk tier's; None without a disk tier: pins end with the process, as pages do)."""

    def __init__(
        self,
        capacity: int,
        tenant_quota: int,
        max_share: float,
        directory: str | None,
        metrics: ControlMetrics,
    ) -> None:
        self.capacity = capacity
        self.tenant_quota = tenant_quota
        self.max_share = max_share
        self.path = os.path.join(directory, PINS_FILE) if directory else None
        self.metrics = metrics
        self.pinned: dict[PageKey, StoredPage] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._save_lock = asyncio.Lock()
        self._tenants: set[str] = set()  # those the gauges name (set to 0 when they end)

    # ---- figures ---------------------------------------------------------------------

    def bytes_of(self, tenant: str | None = None) -> int:
        self._prune()
        return sum(slot_bytes(p) for p in list(self.pinned.values()) if tenant in (None, p.owner))

    def check(self, pages: list[StoredPage]) -> None:
        """Raise ``PinRefused`` when pinning ``pages`` (of one tenant; those pinned
        already count once) would pass the share of memory pins may hold or the
        tenant's quota."""
        new = [p for p in pages if p.key not in self.pinned]
        if not new:
            return
        adding = sum(slot_bytes(p) for p in new)
        total = self.bytes_of() + adding
        if total > self.max_share * self.capacity:
            self.metrics.pin_refused.labels("share").inc()
            raise PinRefused(
                "share",
                f"pinning {adding} more bytes would pin {total} of this node's "
                f"{self.capacity} bytes of memory, over the {self.max_share:.0%} pins may hold "
                "(--pin-max-share)",
            )
        tenant = new[0].owner
        mine = self.bytes_of(tenant) + adding
        if mine > self.tenant_quota:
            self.metrics.pin_refused.labels("quota").inc()
            raise PinRefused(
                "quota",
                f"tenant {tenant} would pin {mine} bytes, over its quota of "
                f"{self.tenant_quota} bytes on this node (--tenant-quota)",
            )

    # ---- changes (on the loop) --------------------------------------------------------

    def pin(self, pages: list[StoredPage], until: float) -> None:
        for page in pages:
            page.pin_until = until
            self.pinned[page.key] = page
        self._changed()

    def unpin(self, pages: list[StoredPage]) -> list[StoredPage]:
        """Unpin those of ``pages`` that are pinned; returns them."""
        gone = [p for p in pages if self.pinned.pop(p.key, None) is not None]
        for page in gone:
            page.pin_until = None
        if gone:
            self._changed()
        return gone

    def ttl(self, page: StoredPage, now: float | None = None) -> float | None:
        """Seconds the page's pin has left; None without a TTL (or not pinned)."""
        until = page.pin_until
        if until is None or math.isinf(until):
            return None
        return max(0.0, until - (time.time() if now is None else now))

    def _expire(self) -> None:
        """The timer's: unpin what is due (and pages the table dropped meanwhile)."""
        self._timer = None
        now = time.time()
        due = [
            p
            for p in self.pinned.values()
            if p.state is PageState.DROPPED or (p.pin_until is not None and p.pin_until <= now)
        ]
        if due:
            self.unpin(due)
            asyncio.get_running_loop().create_task(self.save())
        else:
            self._arm()

    def _prune(self) -> None:
        """Forget pins of pages the table dropped (a disk record that failed its check)."""
        for key in [k for k, p in self.pinned.items() if p.state is PageState.DROPPED]:
            del self.pinned[key]

    def _changed(self) -> None:
        self._prune()
        self._arm()
        per_tenant: Counter[str] = Counter()
        pages: Counter[str] = Counter()
        for page in self.pinned.values():
            per_tenant[page.owner] += slot_bytes(page)
            pages[page.owner] += 1
        for tenant in set(per_tenant) | set(self._tenants):
            self.metrics.pinned_pages.labels(tenant).set(pages[tenant])
            self.metrics.pinned_bytes.labels(tenant).set(per_tenant[tenant])
        self._tenants = set(per_tenant)

    def _arm(self) -> None:
        """One timer, for the earliest TTL."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        ends = [p.pin_until for p in self.pinned.values() if p.pin_until is not None]
        first = min((u for u in ends if not math.isinf(u)), default=None)
        if first is not None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(max(0.0, first - time.time()) + 0.001, self._expire)

    # ---- the pins file ------------------------------------------------------------------

    async def save(self) -> None:
        """Write the pins file (with a disk tier), by rename; a failure is logged: the
        pins hold until the restart."""
        if self.path is None:
            return
        doc = {
            f"{key[0]}:{key[1].hex()}": (None if math.isinf(p.pin_until) else p.pin_until)
            for key, p in self.pinned.items()
            if p.pin_until is not None
        }
        async with self._save_lock:
            try:
                await asyncio.to_thread(_write_atomically, self.path, json.dumps(doc))
            except OSError as exc:
                log.warning(
                    "pins file %s not written (pins hold until a restart): %s", self.path, exc
                )

    def restore(self, pages: dict[PageKey, StoredPage]) -> list[StoredPage]:
        """At start, before the loop serves: pin again the pages the pins file names that
        the disk tier recovered, while their TTL lasts; returns them. Called with the
        page table's pages; a missing or unreadable file pins nothing (logged)."""
        if self.path is None or not os.path.exists(self.path):
            return []
        try:
            with open(self.path) as f:
                doc = json.load(f)
            entries = [(k.split(":", 1), until) for k, until in doc.items()]
            wanted = {(ns, bytes.fromhex(h)): until for (ns, h), until in entries}
        except (OSError, ValueError, AttributeError) as exc:
            log.warning("pins file %s unreadable, no pin restored: %s", self.path, exc)
            return []
        now = time.time()
        found = []
        for key, until in wanted.items():
            page = pages.get(key)
            end = math.inf if until is None else float(until)
            if page is not None and page.state is PageState.READY and end > now:
                page.pin_until = end
                self.pinned[key] = page
                found.append(page)
        log.info("pins restored: %d of %d in the pins file", len(found), len(wanted))
        return found

    def start(self) -> None:
        """On the running loop, after ``restore``: arm the expiry timer, set the gauges."""
        self._changed()


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)

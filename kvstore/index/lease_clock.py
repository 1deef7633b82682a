"""``LeaseClock``: when the read leases an index client saw fall due, by segment, so
that a lookup renews a due lease in its one round trip (``kvstore.index.lookups``)."""

from __future__ import annotations

import time


class LeaseClock:
    """Segment ``(key prefix, anchor)`` -> the ``time.monotonic()`` at which its lease,
    as this client last saw it, falls below the renewal threshold (``renew_below``). A
    hint only: a lease another reader or an expiry changed meanwhile is read again and
    renewed as before, never a wrong answer. Bounded: past ``LIMIT`` segments it
    starts over. Any thread (a dict's single operations are atomic)."""

    LIMIT = 1 << 16

    def __init__(self) -> None:
        self._due: dict[tuple[str, bytes], float] = {}

    def fresh(self, prefix: str, anchor: bytes) -> bool:
        """Whether the segment's lease is known to be above the threshold now."""
        due = self._due.get((prefix, anchor))
        return due is not None and time.monotonic() < due

    def seen(self, prefix: str, anchor: bytes, ttl_ms: int, below_ms: int) -> None:
        """The segment's lease had ``ttl_ms`` left just now (a PTTL's answer; the full
        lease after a renewal)."""
        key = (prefix, anchor)
        if ttl_ms < below_ms:
            self._due.pop(key, None)
            return
        if len(self._due) >= self.LIMIT and key not in self._due:
            self._due.clear()
        self._due[key] = time.monotonic() + (ttl_ms - below_ms) / 1000

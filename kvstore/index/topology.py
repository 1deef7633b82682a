"""Which index server holds a key: one server holds them all, a cluster's slot map
(read with ``CLUSTER SLOTS`` by ``kvstore.index.routing``) says which shard holds each
slot."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from redis.crc import key_slot

from kvstore.errors import IndexUnavailableError
from kvstore.index.urls import redact_url

SLOTS = 16384


@dataclass
class Topology:
    """Which shard holds a key: shard addresses (single-server URLs) and, for a cluster,
    each slot's shard, as the last ``CLUSTER SLOTS`` read said."""

    urls: list[str]
    slot_shard: list[int] | None = None  # None: one server holds every key

    def shard_of(self, key: str) -> int:
        return 0 if self.slot_shard is None else self.slot_shard[key_slot(key.encode())]

    @property
    def count(self) -> int:
        return len(self.urls)


def topology_from_slots(reply: Any, seed: str) -> Topology:
    """A ``Topology`` from a ``CLUSTER SLOTS`` reply; a primary announced without a host
    is reached at the seed's host."""
    seed_parts = urlsplit(seed)
    slot_shard = [-1] * SLOTS
    urls: list[str] = []
    for entry in reply:
        start, end, primary = int(entry[0]), int(entry[1]), entry[2]
        host = primary[0].decode() if isinstance(primary[0], bytes) else str(primary[0])
        netloc = f"{host or seed_parts.hostname}:{int(primary[1])}"
        creds = seed_parts.netloc.rpartition("@")[0]
        url = urlunsplit(
            (seed_parts.scheme, f"{creds}@{netloc}" if creds else netloc, "", seed_parts.query, "")
        )
        if url not in urls:
            urls.append(url)
        slot_shard[start : end + 1] = [urls.index(url)] * (end - start + 1)
    if not urls or -1 in slot_shard:
        raise IndexUnavailableError(
            f"the cluster at {redact_url(seed)} does not cover every slot yet"
        )
    return Topology(urls, slot_shard)

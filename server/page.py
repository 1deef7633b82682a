"""One page of a storage node's table: its key, where its copies lie, its state.

``PageStore`` (server/store.py) owns these records and describes the states; the
tiers, the evictor and the data plane read them, and change them only through the
store's methods."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass

from kvstore.index import CommitEntry

PageKey = tuple[str, bytes]  # (namespace digest hex, page hash)


class PageState(enum.Enum):
    """Where a page is in its life in the table (server/store.py describes each state)."""

    RECEIVING = "receiving"
    READY = "ready"
    EVICTING = "evicting"
    DROPPED = "dropped"


@dataclass(slots=True, eq=False)
class StoredPage:
    """One page's entry in the page table (states: server/store.py)."""

    key: PageKey
    size: int
    checksum: int
    owner: str = ""  # the tenant whose slabs may hold it (server/pool.py)
    anchor: bytes = b""  # its segment in the index (kvstore.pages.keys), and its place there
    position: int = 0
    offset: int | None = None  # memory slot; None until one is assigned, or while only on disk
    state: PageState = PageState.RECEIVING
    pins: int = 0
    disk: int | None = None  # disk slot, when the page has a copy on disk
    sequence: int = 0  # its disk record's sequence number (newest wins at recovery)
    reads: int = 0  # gets that found it (the disk tier's admission counts them)
    writing: bool = False  # its disk copy is being written
    loading: asyncio.Future[None] | None = (
        None  # set while it is read back from disk into its memory slot
    )
    # the token ids of its block (u32 little-endian) when the put carried them: the
    # node's KV events announce them (server/events.py); not kept on disk
    tokens: bytes = b""
    # pinned by an operator (server/control/pins.py) until this ``time.time()``, inf for
    # no TTL, None when not pinned: eviction passes over it, in memory and on disk
    pin_until: float | None = None
    # cleared (server/control/ops.py): out of the index and the LRUs, still read by
    # gets that looked it up before, dropped when the clear's grace ends
    clearing: bool = False


def commit_entry(page: StoredPage) -> CommitEntry:
    """What the index records for a verified page of this node. The slot is a hint (a
    get names pages by hash; a same-host reader copies from it first and checks what
    landed against the checksum, client/nodes/slot_reads.py): a page only on disk records
    0, since the index does not follow pages between tiers (docs/storage-tiers.md)."""
    return CommitEntry(
        page.key[1], page.anchor, page.position, page.offset or 0, page.size, page.checksum
    )

"""The storage node's page table: which page sits in which slot, LRU order, pins.

Owned by the node's event loop (no locks). At most one ``StoredPage`` exists per key,
and every state change happens without an ``await`` in between, so two requests
can never both own a key:

- *receiving*: claimed by one PUT; invisible to readers; a second PUT of the key
  finds it here and does not claim it again;
- *ready*: verified and committed; in the LRU; readers pin it;
- *evicting*: taken out of the LRU while the index removes it; it ends ``ready``
  again (a reader's lease kept it) or dropped;
- *dropped*: out of the table; its slot is freed when the last pin goes.

Pins count transfers in progress (and the claiming PUT), so eviction never frees
memory that is being sent or received."""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict
from dataclasses import dataclass

import numpy as np

from kvstore.index import CommitEntry
from server.allocator import SlabAllocator
from server.pool import MemoryPool

PageKey = tuple[str, bytes]  # (namespace digest hex, page hash)


class PageState(enum.Enum):
    RECEIVING = "receiving"
    READY = "ready"
    EVICTING = "evicting"
    DROPPED = "dropped"


@dataclass(slots=True, eq=False)
class StoredPage:
    key: PageKey
    size: int
    checksum: int
    owner: str = ""  # the tenant whose slabs may hold it (server/pool.py)
    anchor: bytes = b""  # its segment in the index (kvstore.pages.keys), and its place there
    position: int = 0
    offset: int | None = None  # None until a slot is assigned
    state: PageState = PageState.RECEIVING
    pins: int = 0


def commit_entry(page: StoredPage) -> CommitEntry:
    """What the index records for a verified page of this node."""
    assert page.offset is not None
    return CommitEntry(page.key[1], page.anchor, page.position, page.offset, page.size, page.checksum)


class PageStore:
    def __init__(self, pool: MemoryPool) -> None:
        self.pool = pool
        self.allocator = SlabAllocator(pool.capacity, pool.slab_size, pool.claim_slab)
        self.pages: dict[PageKey, StoredPage] = {}
        self._lru: OrderedDict[PageKey, StoredPage] = OrderedDict()
        self.namespace_pages: Counter[str] = Counter()
        self.tenant_bytes: Counter[str] = Counter()  # slot bytes each owner holds (quota, server/eviction.py)
        self.pins = 0  # claims and transfers in progress, over all pages

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def used_bytes(self) -> int:
        return self.allocator.used_bytes

    @property
    def ready_pages(self) -> int:
        return len(self._lru)

    def view(self, page: StoredPage) -> np.ndarray:
        assert page.offset is not None
        return self.pool.view(page.offset, page.size)

    def find(self, key: PageKey) -> StoredPage | None:
        """The page under ``key`` in any state but dropped, if any."""
        return self.pages.get(key)

    def ready_items(self) -> list[StoredPage]:
        """Every ready page, least recently used first (for re-publishing after an index loss)."""
        return list(self._lru.values())

    def claim(self, key: PageKey, size: int, checksum: int = 0, owner: str = "", anchor: bytes = b"", position: int = 0) -> StoredPage:
        """Make ``key`` *receiving* for the calling PUT. The caller checked ``find`` first
        (no await in between) and must end with ``finish_put`` or ``abort_put``."""
        assert key not in self.pages, "claim of a key that is already in the table"
        page = StoredPage(key, size, checksum, owner, anchor, position, pins=1)
        self.pins += 1
        self.pages[key] = page
        return page

    def assign_slot(self, page: StoredPage) -> bool:
        """Give a claimed page a slot; False when no slot is free (evict and retry)."""
        page.offset = self.allocator.allocate(page.size, page.owner)
        if page.offset is None:
            return False
        self.tenant_bytes[page.owner] += self.allocator.slot_size(page.offset)
        return True

    def finish_put(self, page: StoredPage) -> None:
        """The claimed page is verified and committed: it becomes ready."""
        page.state = PageState.READY
        self._lru[page.key] = page
        self.namespace_pages[page.key[0]] += 1
        self.unpin(page)

    def abort_put(self, page: StoredPage) -> None:
        """The claimed page will not be stored: forget it; its slot is freed when unpinned."""
        self._forget(page)
        self.unpin(page)

    def pin_for_read(self, key: PageKey) -> StoredPage | None:
        """Pin a ready page for sending and mark it most recently used."""
        page = self.pages.get(key)
        if page is None or page.state is not PageState.READY:
            return None
        page.pins += 1
        self.pins += 1
        self._lru.move_to_end(key)
        return page

    def unpin(self, page: StoredPage) -> None:
        page.pins -= 1
        self.pins -= 1
        if page.state is PageState.DROPPED:
            self._release_slot(page)

    def take_victims(self, nbytes: int, slot_size: int | None = None, owner: str = "", only_owner: bool = False) -> list[StoredPage]:
        """Move least-recently-used ready pages worth ``nbytes`` of slots (preferring slot
        size ``slot_size`` of ``owner`` when given: their slots are the ones a new page
        can use; only ``owner``'s pages with ``only_owner``) to *evicting*, hidden from
        readers. The caller either ``drop``s or ``restore``s each one."""
        victims: list[StoredPage] = []
        freed = 0
        alloc = self.allocator
        for pass_class in ((slot_size, None) if slot_size else (None,)):
            for page in self._lru.values():
                if freed >= nbytes:
                    break
                if only_owner and page.owner != owner:
                    continue
                if page.state is PageState.READY and (pass_class is None or (alloc.slot_size(page.offset) == pass_class and alloc.owner(page.offset) == owner)):
                    page.state = PageState.EVICTING
                    victims.append(page)
                    freed += self.allocator.slot_size(page.offset)
        for page in victims:
            del self._lru[page.key]
            self.namespace_pages[page.key[0]] -= 1
        return victims

    def drop(self, page: StoredPage) -> None:
        """Forget an evicted page; its slot is freed now or when its last transfer ends."""
        self._forget(page)
        self._release_slot(page)

    def restore(self, page: StoredPage) -> None:
        """Put back a victim the index refused to remove (it is leased by a reader)."""
        page.state = PageState.READY
        self._lru[page.key] = page
        self.namespace_pages[page.key[0]] += 1

    def _forget(self, page: StoredPage) -> None:
        if self.pages.get(page.key) is page:
            del self.pages[page.key]
        page.state = PageState.DROPPED

    def _release_slot(self, page: StoredPage) -> None:
        """Free a dropped page's slot once no transfer holds it (at most once)."""
        if page.pins == 0 and page.offset is not None:
            self.tenant_bytes[page.owner] -= self.allocator.slot_size(page.offset)
            self.allocator.free(page.offset)
            page.offset = None


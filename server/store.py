"""The storage node's page table: which page sits in which slot, LRU order, pins.

Owned by the node's event loop (no locks). A page is *receiving* until its bytes are
verified and committed, then *ready*. Pins count transfers in progress; a slot is only
returned to the allocator once its page is dropped and unpinned, so eviction can never
free memory that is being sent or received."""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

import numpy as np

from server.allocator import SlabAllocator
from server.pool import MemoryPool

PageKey = tuple[str, bytes]  # (namespace digest hex, page hash)


@dataclass(slots=True, eq=False)
class StoredPage:
    key: PageKey
    offset: int
    size: int
    checksum: int
    ready: bool = False
    pins: int = 0
    dropped: bool = False


class PageStore:
    def __init__(self, pool: MemoryPool, slab_size: int) -> None:
        self.pool = pool
        self.allocator = SlabAllocator(pool.capacity, slab_size)
        self.pages: dict[PageKey, StoredPage] = {}
        self._lru: OrderedDict[PageKey, StoredPage] = OrderedDict()
        self.namespace_pages: Counter[str] = Counter()

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
        return self.pool.view(page.offset, page.size)

    def find(self, key: PageKey) -> StoredPage | None:
        """The page under ``key`` (ready or still receiving), if any."""
        return self.pages.get(key)

    def begin_put(self, key: PageKey, size: int, checksum: int) -> StoredPage | None:
        """Allocate a slot for an incoming page; None when no slot is free."""
        offset = self.allocator.allocate(size)
        if offset is None:
            return None
        page = StoredPage(key, offset, size, checksum, pins=1)
        self.pages[key] = page
        return page

    def finish_put(self, page: StoredPage) -> None:
        page.ready = True
        self._lru[page.key] = page
        self.namespace_pages[page.key[0]] += 1
        self.unpin(page)

    def abort_put(self, page: StoredPage) -> None:
        self.pages.pop(page.key, None)
        page.dropped = True
        self.unpin(page)

    def pin_for_read(self, key: PageKey) -> StoredPage | None:
        """Pin a ready page for sending and mark it most recently used."""
        page = self.pages.get(key)
        if page is None or not page.ready:
            return None
        page.pins += 1
        self._lru.move_to_end(key)
        return page

    def unpin(self, page: StoredPage) -> None:
        page.pins -= 1
        if page.pins == 0 and page.dropped:
            self.allocator.free(page.offset)

    def take_victims(self, nbytes: int, slot_size: int | None = None) -> list[StoredPage]:
        """Remove least-recently-used ready pages worth ``nbytes`` of slots from the LRU
        (preferring slot size ``slot_size`` when given) and hide them from readers. The
        caller either ``drop``s or ``restore``s each one."""
        victims: list[StoredPage] = []
        freed = 0
        for pass_class in ((slot_size, None) if slot_size else (None,)):
            for page in self._lru.values():
                if freed >= nbytes:
                    break
                if page.ready and (pass_class is None or self.allocator.slot_size(page.offset) == pass_class):
                    page.ready = False
                    victims.append(page)
                    freed += self.allocator.slot_size(page.offset)
        for page in victims:
            del self._lru[page.key]
        return victims

    def drop(self, page: StoredPage) -> None:
        """Forget an evicted page; its slot is freed now or when its last transfer ends."""
        if self.pages.get(page.key) is page:
            del self.pages[page.key]
            self.namespace_pages[page.key[0]] -= 1
        page.dropped = True
        if page.pins == 0:
            self.allocator.free(page.offset)

    def restore(self, page: StoredPage) -> None:
        """Put back a victim the index refused to remove (it is leased by a reader)."""
        page.ready = True
        self._lru[page.key] = page

    def namespaces(self) -> list[str]:
        return [ns for ns, count in self.namespace_pages.items() if count > 0]

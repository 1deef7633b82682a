"""The storage node's page table: which page sits in which slot, LRU order, pins.

Owned by the node's event loop (no locks). At most one ``StoredPage`` (server/page.py)
exists per key, and every state change happens without an ``await`` in between, so
two requests can never both own a key:

- *receiving*: claimed by one PUT; invisible to readers; a second PUT of the key
  finds it here and does not claim it again;
- *ready*: verified and committed; readers pin it. It has a memory slot (``offset``,
  in the memory LRU), a disk slot (``disk``, in the disk LRU: server/disk/), or both;
- *evicting*: taken out of the LRUs while the index removes it; it ends ``ready``
  again (a reader's lease kept it) or dropped;
- *dropped*: out of the table; its slot is freed when the last pin goes.

Pins count transfers in progress (and the claiming PUT, and a disk write), so
eviction never frees memory that is being sent, received or written. A ready page
with a disk copy (*clean*) leaves memory without leaving the index: its memory slot
is freed at once when no transfer holds it, and a read brings it back from disk.

The table is the bottom of the node's page handling: the evictor, the data plane and
the tier below memory (server/tier.py) all change it through these methods, and it
calls none of them."""

from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator

import numpy as np

from kvstore.events import MEDIUM_CPU, MEDIUM_DISK
from server.allocator import SlabAllocator
from server.events import NoEvents, PageEvents
from server.page import PageKey, PageState, StoredPage
from server.pool import MemoryPool


class PageStore:
    """The page table of both tiers: the pages, their states, pins and LRU orders, and
    the memory slots they hold."""

    def __init__(self, pool: MemoryPool, events: PageEvents | None = None) -> None:
        self.pool = pool
        # told of every change of where a ready page's copies lie (server/events.py):
        # here, at the bottom, no path that moves a page between tiers can miss it
        self.events: PageEvents = events if events is not None else NoEvents()
        self.allocator = SlabAllocator(pool.capacity, pool.slab_size, pool.claim_slab)
        self.pages: dict[PageKey, StoredPage] = {}
        self._lru: OrderedDict[PageKey, StoredPage] = OrderedDict()  # ready pages in memory
        # ready pages with a disk copy
        self._disk_lru: OrderedDict[PageKey, StoredPage] = OrderedDict()
        self.namespace_pages: Counter[str] = Counter()  # ready pages (either tier) per namespace
        # memory slot bytes each owner holds (quota, server/eviction.py)
        self.tenant_bytes: Counter[str] = Counter()
        self.pins = 0  # claims, transfers and disk writes in progress, over all pages
        self.ready_pages = 0  # ready pages, either tier
        self.released_pages = 0  # clean pages whose memory copy was freed (their disk copy stays)

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def used_bytes(self) -> int:
        return self.allocator.used_bytes

    @property
    def memory_pages(self) -> int:
        return len(self._lru)

    @property
    def disk_pages(self) -> int:
        """Ready pages with a disk copy."""
        return len(self._disk_lru)

    def view(self, page: StoredPage) -> np.ndarray:
        assert page.offset is not None
        return self.pool.view(page.offset, page.size)

    def slot_bytes(self, page: StoredPage) -> int:
        """Bytes of the memory slot a page holds (its size class)."""
        assert page.offset is not None
        return self.allocator.slot_size(page.offset)

    def find_page(self, key: PageKey) -> StoredPage | None:
        return self.pages.get(key)  # in any state but dropped

    def ready_items(self) -> list[StoredPage]:
        """Every ready page, either tier, but those being cleared (for re-publishing after
        an index loss or a restart)."""
        return [p for p in self.pages.values() if p.state is PageState.READY and not p.clearing]

    def memory_lru(self) -> list[StoredPage]:
        """Ready pages in memory, least recently used first (the disk tier's demoter walks it)."""
        return list(self._lru.values())

    # ---- a put's pages ---------------------------------------------------------------

    def claim(
        self,
        key: PageKey,
        size: int,
        checksum: int = 0,
        owner: str = "",
        anchor: bytes = b"",
        position: int = 0,
    ) -> StoredPage:
        """Make ``key`` *receiving* for the calling PUT. The caller checked ``find`` first
        (no await in between) and must end with ``finish_put`` or ``abort_put``."""
        assert key not in self.pages, "claim of a key that is already in the table"
        page = StoredPage(key, size, checksum, owner, anchor, position, pins=1)
        self.pins += 1
        self.pages[key] = page
        return page

    def assign_slot(self, page: StoredPage) -> bool:
        """Give a claimed page (or one coming back from disk) a memory slot; False when
        no slot is free (evict and retry)."""
        page.offset = self.allocator.allocate(page.size, page.owner)
        if page.offset is None:
            return False
        self.tenant_bytes[page.owner] += self.allocator.slot_size(page.offset)
        return True

    def finish_put(self, page: StoredPage) -> None:
        """The claimed page is verified and committed: it becomes ready."""
        self._become_ready(page)
        self._lru[page.key] = page
        self.events.stored(page, MEDIUM_CPU)
        self.unpin(page)

    def abort_put(self, page: StoredPage) -> None:
        """The claimed page will not be stored: forget it; its slot is freed when unpinned."""
        self._forget(page)
        self.unpin(page)

    # ---- readers -------------------------------------------------------------------------

    def pin_for_read(self, key: PageKey) -> StoredPage | None:
        """Pin a ready page for sending (``mark_read``). A page only on disk (``offset``
        None) or still ``loading`` must be brought back first."""
        page = self.mark_read(key)
        if page is not None:
            page.pins += 1
            self.pins += 1
        return page

    def mark_read(self, key: PageKey) -> StoredPage | None:
        """A ready page counted as read, most recently used, unpinned (SLOT_READS)."""
        page = self.pages.get(key)
        if page is None or page.state is not PageState.READY:
            return None
        page.reads += 1
        if page.key in self._lru:
            self._lru.move_to_end(key)
        if page.key in self._disk_lru:
            self._disk_lru.move_to_end(key)
        return page

    def unpin(self, page: StoredPage) -> None:
        page.pins -= 1
        self.pins -= 1
        if page.state is PageState.DROPPED:
            self._release_slot(page)

    def start_loading(self, pages: list[StoredPage]) -> None:
        """These pinned pages are being read back from disk: a get that finds one waits
        on its ``loading`` future instead of reading it again."""
        loop = asyncio.get_running_loop()
        for page in pages:
            page.loading = loop.create_future()

    def end_loading(self, pages: list[StoredPage]) -> None:
        """The read-back of these pages ended (in memory now, or not): wake their waiters."""
        for page in pages:
            if page.loading is not None:
                page.loading.set_result(None)
            page.loading = None

    # ---- eviction from memory --------------------------------------------------------------

    def eviction_order(
        self, slot_size: int | None = None, owner: str = "", only_owner: bool = False
    ) -> Iterator[StoredPage]:
        """Memory-resident pages in the order eviction considers them: least recently used
        first, those of slot size ``slot_size`` in ``owner``'s slabs in a first pass when
        given (their slots are the ones a new page can use), then all; only ``owner``'s
        pages with ``only_owner``. A page of the first pass comes again in the second.
        The caller must not change the LRU while it iterates."""
        alloc = self.allocator
        for pass_class in (slot_size, None) if slot_size else (None,):
            for page in self._lru.values():
                if only_owner and page.owner != owner:
                    continue
                if pass_class is None:
                    yield page
                    continue
                offset: int = page.offset  # type: ignore[assignment]  # a page in the memory LRU holds a slot
                if alloc.slot_size(offset) == pass_class and alloc.owner(offset) == owner:
                    yield page

    def take_victims(
        self,
        nbytes: int,
        slot_size: int | None = None,
        owner: str = "",
        only_owner: bool = False,
        demotable: Callable[[StoredPage], bool] | None = None,
    ) -> list[StoredPage]:
        """Free memory slots worth ``nbytes`` in ``eviction_order``. A clean page no
        transfer holds leaves memory at once and stays ready on disk; the others that
        can go move to *evicting*, hidden from readers, and are returned: the caller
        either ``drop``s or ``restore``s each one. Pages being written to disk, and dirty
        pages the tier below will write (``demotable``, from the evictor's tier: it has
        them written first), are skipped."""
        victims: list[StoredPage] = []
        clean: list[StoredPage] = []
        taken: set[PageKey] = set()
        freed = 0
        for page in self.eviction_order(slot_size, owner, only_owner):
            if freed >= nbytes:
                break
            if (
                page.key in taken
                or page.state is not PageState.READY
                or page.writing
                or page.pin_until is not None
                or (page.disk is not None and page.pins)
            ):
                continue
            if page.disk is None and demotable is not None and demotable(page):
                continue
            taken.add(page.key)
            (victims if page.disk is None else clean).append(page)
            freed += self.slot_bytes(page)
        for page in victims:
            del self._lru[page.key]
            page.state = PageState.EVICTING
            self._left_ready(page)
        for page in clean:
            self.release_memory(page)
        self.released_pages += len(clean)
        return victims

    def release_memory(self, page: StoredPage) -> None:
        """Free the memory slot of a page no transfer holds (its copy is on disk, or its
        read from disk failed)."""
        assert page.pins == 0 or page.loading is not None
        if (
            self._lru.pop(page.key, None) is not None
        ):  # a slot given for a read-back was never announced
            self.events.removed(page, MEDIUM_CPU)
        if page.offset is not None:
            self.tenant_bytes[page.owner] -= self.allocator.slot_size(page.offset)
            self.allocator.free(page.offset)
            page.offset = None

    def drop(self, page: StoredPage) -> None:
        """Forget an evicted page; its slot is freed now or when its last transfer ends."""
        # its disk copy, if any, is announced removed when the tier frees it (remove_disk_copy)
        if (
            page.state in (PageState.READY, PageState.EVICTING)
            and page.offset is not None
            and page.loading is None
            and not page.clearing  # announced when it was cleared (``hide``)
        ):
            self.events.removed(page, MEDIUM_CPU)
        self._forget(page)
        self._release_slot(page)

    def restore(self, page: StoredPage) -> None:
        """Put back a victim the index refused to remove (it is leased by a reader)."""
        self._become_ready(page)
        if page.offset is not None:
            self._lru[page.key] = page
        if page.disk is not None:
            self._disk_lru[page.key] = page

    # ---- disk copies (the disk tier calls these) -------------------------------------------

    def recovered(self, page: StoredPage) -> None:
        """A page found on disk at start (server/disk/recovery.py) joins the table, ready."""
        assert page.key not in self.pages and page.disk is not None
        self.pages[page.key] = page
        self._become_ready(page)
        self._disk_lru[page.key] = page
        self.events.stored(page, MEDIUM_DISK)

    def hold_for_write(self, page: StoredPage) -> None:
        """A ready page's disk copy is being written: pinned (its slot stays), and
        eviction passes over it until ``end_write``."""
        page.writing = True
        page.pins += 1
        self.pins += 1

    def end_write(self, page: StoredPage) -> None:
        """The write ``hold_for_write`` announced ended, written or not."""
        page.writing = False
        self.unpin(page)

    def add_disk_copy(self, page: StoredPage, offset: int, sequence: int) -> None:
        """A ready page's record is on disk at ``offset``."""
        page.disk, page.sequence = offset, sequence
        self._disk_lru[page.key] = page
        self.events.stored(page, MEDIUM_DISK)

    def remove_disk_copy(self, page: StoredPage) -> int | None:
        """The page keeps no disk copy (evicted, dropped, or found corrupt): the disk slot
        it had, for the tier to free (None when it had none)."""
        offset, page.disk = page.disk, None
        if offset is not None:
            self._disk_lru.pop(page.key, None)
            if not page.clearing:  # else announced when it was cleared (``hide``)
                self.events.removed(page, MEDIUM_DISK)
        return offset

    def promoted(self, page: StoredPage) -> None:
        """A page read back from disk into its memory slot is in memory again (most
        recent; a cleared one stays out of the LRU)."""
        if not page.clearing:
            self._lru[page.key] = page
            self.events.stored(page, MEDIUM_CPU)

    def hide(self, page: StoredPage) -> None:
        """A cleared ready page leaves the LRUs (eviction, the demoter and disk space no
        longer see it) and is announced removed from both tiers now, as the index drops
        it; gets that found it still read it until the caller ``drop``s it."""
        page.clearing = True
        if self._lru.pop(page.key, None) is not None:
            self.events.removed(page, MEDIUM_CPU)
        if self._disk_lru.pop(page.key, None) is not None:
            self.events.removed(page, MEDIUM_DISK)

    def take_disk_victims(
        self, nbytes: int, slot_size: int, owner: str | None = None
    ) -> tuple[list[StoredPage], list[StoredPage]]:
        """Disk copies worth ``nbytes``, least recently used first (only ``owner``'s when
        given): (pages only on disk, moved to *evicting* for the caller to ``drop`` or
        ``restore``; pages also in memory, whose disk copy the caller frees)."""
        victims: list[StoredPage] = []
        copies: list[StoredPage] = []
        freed = 0
        for page in self._disk_lru.values():
            if freed >= nbytes:
                break
            if (
                (owner is not None and page.owner != owner)
                or page.pin_until is not None
                or page.pins
                or page.writing
                or page.loading is not None
            ):
                continue
            (victims if page.offset is None else copies).append(page)
            freed += slot_size
        for page in victims + copies:
            del self._disk_lru[page.key]
        for page in victims:
            page.state = PageState.EVICTING
            self._left_ready(page)
        return victims, copies

    # ---- state changes -------------------------------------------------------------------

    def _become_ready(self, page: StoredPage) -> None:
        page.state = PageState.READY
        self.ready_pages += 1
        self.namespace_pages[page.key[0]] += 1

    def _left_ready(self, page: StoredPage) -> None:
        self.ready_pages -= 1
        self.namespace_pages[page.key[0]] -= 1

    def _forget(self, page: StoredPage) -> None:
        if self.pages.get(page.key) is page:
            del self.pages[page.key]
        if page.state is PageState.READY:
            self._left_ready(page)
        if self._lru.get(page.key) is page:
            del self._lru[page.key]
        if self._disk_lru.get(page.key) is page:
            del self._disk_lru[page.key]
        page.state = PageState.DROPPED

    def _release_slot(self, page: StoredPage) -> None:
        """Free a dropped page's memory slot once no transfer holds it (at most once)."""
        if page.pins == 0 and page.offset is not None:
            self.tenant_bytes[page.owner] -= self.allocator.slot_size(page.offset)
            self.allocator.free(page.offset)
            page.offset = None

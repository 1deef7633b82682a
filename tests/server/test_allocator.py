"""Unit tests of the slab allocator and page table (pure logic, no I/O)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.allocator import SlabAllocator, size_class
from server.pool import MemoryPool
from server.store import PageStore


def test_size_classes_have_bounded_slack():
    assert size_class(1) == 4096
    assert size_class(4096) == 4096
    assert size_class(65536) == 65536
    assert size_class(2 << 20) == 2 << 20
    for n in (70_000, 1_000_000, 3_000_000, 9_999_999):
        assert n <= size_class(n) <= n * 1.25 + 4096


def test_fresh_slab_hands_out_contiguous_slots_and_empty_slabs_return():
    alloc = SlabAllocator(4 << 20, 1 << 20)
    offsets = [alloc.allocate(65536) for _ in range(16)]
    assert offsets == [i * 65536 for i in range(16)]
    assert alloc.allocate(65536) == 1 << 20  # next slab
    for off in offsets:
        alloc.free(off)
    # the first slab is empty again and can serve another class
    assert alloc.allocate(1 << 20) in (0, 2 << 20, 3 << 20)


def test_refuses_when_full_and_rejects_oversized_pages():
    alloc = SlabAllocator(2 << 20, 1 << 20)
    assert alloc.allocate(1 << 20) is not None
    assert alloc.allocate(1 << 20) is not None
    assert alloc.allocate(4096) is None
    with pytest.raises(ValueError, match="exceeds the largest slot"):
        alloc.allocate((1 << 20) + 1)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.booleans(), st.sampled_from([4096, 10_000, 65536, 300_000, 1 << 20])),
        max_size=300,
    )
)
def test_allocations_never_overlap_and_accounting_balances(ops):
    alloc = SlabAllocator(8 << 20, 1 << 20)
    live: dict[int, int] = {}
    for do_alloc, size in ops:
        if do_alloc or not live:
            off = alloc.allocate(size)
            if off is None:
                continue
            end = off + size_class(size)
            assert end <= alloc.capacity
            assert all(end <= o or o + size_class(s) <= off for o, s in live.items())
            live[off] = size
        else:
            off = next(iter(live))
            alloc.free(off)
            del live[off]
    assert alloc.used_bytes == sum(size_class(s) for s in live.values())
    for off in list(live):
        alloc.free(off)
    assert alloc.used_bytes == 0 and len(alloc._free_slabs) == alloc.num_slabs


def put(store: PageStore, key, size: int, checksum: int = 0):
    """A page through the PUT states: claimed, slotted, committed."""
    page = store.claim(key, size, checksum)
    assert store.assign_slot(page)
    store.finish_put(page)
    return page


def test_pinned_victim_is_freed_only_after_its_transfer_ends():
    store = PageStore(MemoryPool(2 << 20, 1 << 20, hugepages=False))
    page = put(store, ("ns", b"a" * 16), 65536, 1)
    reader = store.pin_for_read(page.key)
    victims = store.take_victims(65536)
    assert victims == [page]
    assert store.pin_for_read(page.key) is None  # hidden from new readers at once
    store.drop(page)
    assert store.used_bytes == 65536  # still being sent
    store.unpin(reader)
    assert store.used_bytes == 0


def test_lru_order_follows_reads():
    store = PageStore(MemoryPool(2 << 20, 1 << 20, hugepages=False))
    pages = []
    for i in range(3):
        pages.append(put(store, ("ns", bytes([i]) * 16), 4096, i))
    store.unpin(store.pin_for_read(pages[0].key))  # page 0 becomes most recent
    assert store.take_victims(4096) == [pages[1]]


def test_a_claimed_key_is_invisible_and_an_aborted_claim_frees_its_slot():
    store = PageStore(MemoryPool(2 << 20, 1 << 20, hugepages=False))
    key = ("ns", b"k" * 16)
    page = store.claim(key, 65536, 7)
    assert store.assign_slot(page)
    assert (
        store.find_page(key) is page and store.pin_for_read(key) is None
    )  # receiving: not readable
    assert store.pins == 1
    store.abort_put(page)
    assert store.find_page(key) is None and store.used_bytes == 0 and store.pins == 0
    again = put(store, key, 65536, 7)  # the key can be claimed again
    assert store.pin_for_read(key) is again and store.ready_pages == 1


def test_an_evicting_page_returns_to_the_lru_when_restored():
    store = PageStore(MemoryPool(2 << 20, 1 << 20, hugepages=False))
    key = ("ns", b"r" * 16)
    page = put(store, key, 4096, 1)
    assert store.take_victims(4096) == [page]
    assert store.pin_for_read(key) is None and store.namespace_pages["ns"] == 0
    store.restore(page)
    assert store.pin_for_read(key) is page and store.namespace_pages["ns"] == 1


def test_a_slab_changing_owner_gets_fresh_memory_and_the_old_mapping_reads_zeros():
    """Same-host clients map whole slabs: a slab must never show one tenant's bytes to
    a client of another (server/pool.py)."""
    import mmap

    store = PageStore(MemoryPool(1 << 20, 1 << 20, hugepages=False))
    page = store.claim(("ns-a", b"a" * 16), 4096, owner="tenant-a")
    assert store.assign_slot(page)
    store.view(page)[:] = 7
    region = store.pool.regions[0]
    old = mmap.mmap(region.fd, 1 << 20, prot=mmap.PROT_READ)  # what a tenant-a client maps
    generation = region.generation
    store.finish_put(page)
    store.drop(store.take_victims(4096)[0])
    other = store.claim(("ns-b", b"b" * 16), 4096, owner="tenant-b")
    assert store.assign_slot(other) and other.offset == 0
    store.view(other)[:] = 9
    assert region.generation == generation + 1
    assert old[:4096] == bytes(4096)  # the old memfd was emptied, not shared with tenant-b
    again = store.claim(("ns-b", b"c" * 16), 4096, owner="tenant-b")
    assert store.assign_slot(again) and region.generation == generation + 1  # same owner: kept


def test_the_pool_asks_for_the_configured_huge_page_size():
    """The size must reach memfd_create as a flag: without it the kernel hands out its
    default (2 MiB) pages whatever the pod reserved."""
    import os

    from kvstore.settings.config import ServerSettings
    from server.pool import _HUGE_FLAGS

    with pytest.raises(ValueError, match="2 MiB or 1 GiB"):
        MemoryPool(4 << 20, 2 << 20, hugepage_size=4 << 20)
    assert MemoryPool(2 << 20, 2 << 20, hugepage_size=2 << 20)._huge_flag == os.MFD_HUGE_2MB
    assert _HUGE_FLAGS[1 << 30] == os.MFD_HUGE_1GB
    assert (
        ServerSettings(
            hugepage_size="1GiB", slab_size="1GiB", capacity="2GiB", anonymous=True
        ).hugepage_size
        == 1 << 30
    )
    with pytest.raises(ValueError, match="multiple of the 1GiB"):
        ServerSettings(hugepage_size="1GiB", slab_size="64MiB", capacity="2GiB", anonymous=True)
    with pytest.raises(ValueError, match="2MiB or 1GiB"):
        ServerSettings(hugepage_size="4MiB", anonymous=True)

"""The disk tier's record header and allocator recovery, as pure logic (the tier
itself runs against real files and nodes in tests/server/test_disk_tier.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from server.allocator import SlabAllocator
from server.disk.layout import HEADER_BYTES, RecordHeader, record_slot

HEADER = RecordHeader(
    record_slot(2 << 20),
    2 << 20,
    0x1234_5678_9ABC_DEF0,
    7,
    3,
    "ab" * 16,
    bytes(range(16)),
    "team-a",
    bytes(range(16, 32)),
)


def test_a_header_reads_back_as_written_and_fills_one_block():
    raw = HEADER.pack()
    assert len(raw) == HEADER_BYTES and record_slot(2 << 20) == HEADER_BYTES + (2 << 20)
    assert RecordHeader.unpack(raw) == HEADER


SEALED = (
    80 + len("team-a") + 16 + 8
)  # fixed fields, tenant, anchor, seal: the rest of the block is padding


@given(st.integers(0, SEALED - 1), st.integers(0, 7))
def test_any_flipped_bit_in_a_header_makes_it_invalid(position, bit):
    raw = bytearray(HEADER.pack())
    raw[position] ^= 1 << bit
    assert RecordHeader.unpack(bytes(raw)) is None


@pytest.mark.parametrize(
    "raw", [bytes(HEADER_BYTES), b"", HEADER.pack()[:40], b"KVSPAGE1" + bytes(HEADER_BYTES - 8)]
)
def test_a_zeroed_torn_or_short_header_is_invalid(raw):
    assert RecordHeader.unpack(raw) is None


def test_allocator_rebuilt_from_recovered_slots_hands_out_only_free_ones():
    slot = record_slot(256 << 10)
    alloc = SlabAllocator(4 << 20, 1 << 20, classify=record_slot)
    alloc.restore_slab(2, slot, [0, 2])
    assert alloc.used_bytes == 2 * slot and alloc.free_slabs == 3
    taken = {alloc.allocate(256 << 10) for _ in range(1)}
    assert taken == {2 * (1 << 20) + slot}  # the one free slot of the partly used slab first
    alloc.free(2 * (1 << 20))
    alloc.free(2 * (1 << 20) + 2 * slot)
    alloc.free(2 * (1 << 20) + slot)
    assert alloc.used_bytes == 0 and alloc.free_slabs == 4

"""Warm restart: rebuild the page table and the disk slots from the records on disk.

Called once when the disk tier opens (server/disk/tier.py), before the node
registers; the node then publishes every recovered page under its new incarnation.
Only headers are read here (one 4 KiB read per slot the map names, on the reader
threads); a record's page bytes are checked when a get reads them, as every disk read
is (docs/storage-tiers.md has the crash-consistency argument). Of two valid records
of one page the newer wins and the other's header is erased."""

from __future__ import annotations

import logging
import re
import time
from collections import defaultdict
from dataclasses import dataclass

from kvstore.pages.namespace import TENANT_PATTERN
from server.disk.files import DiskFiles
from server.disk.layout import HEADER_BYTES, RecordHeader
from server.disk.space import DiskSpace
from server.page import PageKey, StoredPage
from server.store import PageStore

log = logging.getLogger(__name__)
_TENANT = re.compile(TENANT_PATTERN)


@dataclass(frozen=True, slots=True)
class Recovery:
    """What a warm restart found on disk, for the tier's log line and its next record."""

    pages: int
    bytes: int
    slots_scanned: int
    seconds: float
    next_sequence: int  # the sequence number the next record written takes


def recover(files: DiskFiles, store: PageStore, space: DiskSpace) -> Recovery:
    """Fill ``store`` with the valid records in ``files`` (ready, disk only, oldest first
    in the disk LRU) and ``space`` with their slots."""
    started = time.monotonic()
    slots = files.slot_offsets()
    raws = list(files.readers.map(files.read_header, [offset for offset, _ in slots], chunksize=64))
    newest: dict[PageKey, tuple[RecordHeader, int]] = {}
    stale: list[int] = []
    for (offset, slot_size), raw in zip(slots, raws):
        header = RecordHeader.unpack(raw)
        if (
            header is None
            or header.slot_size != slot_size
            or header.size + HEADER_BYTES > slot_size
            or not _TENANT.match(header.tenant)
        ):
            continue
        key = (header.namespace, header.page_hash)
        held = newest.get(key)
        if held is not None and held[0].sequence >= header.sequence:
            stale.append(offset)
            continue
        if held is not None:
            stale.append(held[1])
        newest[key] = (header, offset)
    taken: dict[int, list[int]] = defaultdict(list)
    for header, offset in newest.values():
        taken[offset // files.slab_size].append((offset % files.slab_size) // header.slot_size)
    for index, slot_numbers in taken.items():
        space.restore_slab(index, files.slab_classes[index], slot_numbers)
    total = 0
    sequence = 1
    for header, offset in sorted(newest.values(), key=lambda item: item[0].sequence):
        page = StoredPage(
            (header.namespace, header.page_hash),
            header.size,
            header.checksum,
            header.tenant,
            header.anchor,
            header.position,
            pins=0,
            disk=offset,
            sequence=header.sequence,
        )
        store.recovered(page)
        space.charge(header.tenant, header.slot_size)
        sequence = max(sequence, header.sequence + 1)
        total += header.size
    for offset in stale:
        files.erase_header(offset)
    took = time.monotonic() - started
    log.info(
        "disk tier: recovered %d pages (%d bytes) from %d slots in %s in %.2f s",
        len(newest),
        total,
        len(slots),
        files.directory,
        took,
    )
    return Recovery(len(newest), total, len(slots), took, sequence)

"""How a page record lies on disk: a 4 KiB header, then the page bytes, in one slot.

A slot is ``record_slot(size)`` bytes at a 4 KiB-aligned offset of the tier's data
file: the header first, the page bytes after it, padded to 4 KiB so direct I/O can
move header and page in one ``pwritev``/``preadv``. The header names everything a
read must check (docs/storage-tiers.md): the namespace digest, the page hash, the
page's size and xxh3 checksum, the tenant, the slot size of the slab it was written
for, a sequence number (newest wins at recovery) and the index placement (anchor,
position), and it ends in an xxh3 of itself, so a torn or stale header is told apart
from a valid one."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from kvstore.pages.hashing import HASH_BYTES

BLOCK = 4096  # direct I/O alignment of offsets, lengths and buffers
HEADER_BYTES = BLOCK
MAGIC = b"KVSPAGE1"
# magic, slot size, page size, checksum, sequence, position, tenant length, anchor length,
# namespace digest, page hash
_FIXED = struct.Struct(f"<8sQQQQIHH16s{HASH_BYTES}s")
_SEAL = struct.Struct("<Q")
MAX_TENANT = 64


def round_up(n: int, to: int = BLOCK) -> int:
    return -(-n // to) * to


def record_slot(size: int) -> int:
    """Disk slot bytes for a page of ``size`` bytes: header plus page, in 4 KiB blocks
    (exact, not geometric like memory slots: on disk a 25 % slack class would waste a
    quarter of a 2 MiB page's slot)."""
    return HEADER_BYTES + round_up(size)


@dataclass(frozen=True, slots=True)
class RecordHeader:
    """The header of one page record."""

    slot_size: int
    size: int
    checksum: int
    sequence: int
    position: int
    namespace: str  # digest hex
    page_hash: bytes
    tenant: str
    anchor: bytes

    def pack(self) -> bytes:
        """The header's ``HEADER_BYTES`` bytes, sealed by an xxh3 of what precedes the seal."""
        tenant = self.tenant.encode()
        if len(tenant) > MAX_TENANT or len(self.anchor) > HASH_BYTES:
            raise ValueError(f"tenant {self.tenant!r} or anchor too long for a record header")
        body = (
            _FIXED.pack(
                MAGIC,
                self.slot_size,
                self.size,
                self.checksum,
                self.sequence,
                self.position,
                len(tenant),
                len(self.anchor),
                bytes.fromhex(self.namespace),
                self.page_hash,
            )
            + tenant
            + self.anchor
        )
        body += _SEAL.pack(xxhash.xxh3_64_intdigest(body))
        return body + bytes(HEADER_BYTES - len(body))

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> RecordHeader | None:
        """The header in ``raw`` (at least its first bytes), or None when it is not a
        valid one: wrong magic, torn (its seal does not match), or never written."""
        raw = bytes(raw[: _FIXED.size + MAX_TENANT + HASH_BYTES + _SEAL.size])
        if len(raw) < _FIXED.size or raw[:8] != MAGIC:
            return None
        _magic, slot, size, checksum, seq, pos, tlen, alen, ns, page_hash = _FIXED.unpack_from(raw)
        end = _FIXED.size + tlen + alen
        if tlen > MAX_TENANT or alen > HASH_BYTES or end + _SEAL.size > len(raw):
            return None
        if _SEAL.unpack_from(raw, end)[0] != xxhash.xxh3_64_intdigest(raw[:end]):
            return None
        tenant = raw[_FIXED.size : _FIXED.size + tlen]
        try:
            text = tenant.decode()
        except UnicodeDecodeError:
            return None
        return cls(
            slot, size, checksum, seq, pos, ns.hex(), page_hash, text, raw[_FIXED.size + tlen : end]
        )

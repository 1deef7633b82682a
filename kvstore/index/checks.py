"""Checks of what the index methods take from their callers (namespaces, page hashes,
incarnations, node numbers), made before anything is sent: a wrong argument is
``InvalidInputError`` at the call, never a script error at the server.

The method modules (``lookups``, ``publish``, ``registry``) call them first thing."""

from __future__ import annotations

import struct
from collections.abc import Sequence

from kvstore.errors import InvalidInputError
from kvstore.pages import keys
from kvstore.pages._chainhash import join_hashes
from kvstore.pages.hashing import HASH_BYTES
from kvstore.pages.namespace import Namespace, check_tenant

_HEX = frozenset("0123456789abcdef")


def namespace_key(namespace: Namespace | keys.NamespaceKey) -> keys.NamespaceKey:
    """Where a namespace's keys live; clients name a namespace by its ``Namespace``,
    nodes by its tenant and digest (checked here: they come off the wire)."""
    if isinstance(namespace, Namespace):
        return namespace.key
    if not isinstance(namespace, keys.NamespaceKey):
        raise InvalidInputError(f"need a Namespace or NamespaceKey, got {type(namespace).__name__}")
    digest = namespace.digest
    if len(digest) != 2 * HASH_BYTES or any(c not in _HEX for c in digest):
        raise InvalidInputError(
            f"namespace digest must be {2 * HASH_BYTES} lowercase hex characters, got {digest!r}"
        )
    check_tenant(namespace.tenant)
    return namespace


def joined_hashes(hashes: Sequence[bytes] | bytes, what: str, joined_ok: bool = False) -> bytes:
    """The hashes joined, after checking each is 16 bytes (one C pass, join_hashes:
    this runs on every lookup of up to thousands of hashes). Where ``joined_ok``, hashes
    already joined (``block_hash_bytes``) are checked for length only."""
    if len(hashes) == 0:
        raise InvalidInputError(f"{what} needs at least one page hash, got an empty list")
    if joined_ok and isinstance(hashes, bytes):
        if len(hashes) % HASH_BYTES:
            raise InvalidInputError(
                f"{what}: joined page hashes must be a multiple of {HASH_BYTES} bytes, got {len(hashes)}"
            )
        return hashes
    items = hashes if isinstance(hashes, (list, tuple)) else list(hashes)
    joined = join_hashes(items)
    if isinstance(joined, bytes):
        return joined
    h = items[joined]
    size = f"{len(h)} bytes" if isinstance(h, (bytes, bytearray)) else type(h).__name__
    raise InvalidInputError(f"{what}: page hash #{joined} must be {HASH_BYTES} bytes, got {size}")


def incarnation(value: str) -> str:
    """``value`` when it reads as an incarnation the registry minted (register.lua)."""
    if not isinstance(value, str) or len(value) < 16 or any(c not in _HEX for c in value):
        raise InvalidInputError(
            f"incarnation must be a lowercase hex string of at least 16 digits, got {value!r}"
        )
    return value


def node_number(number: int) -> bytes:
    """A node number as the segment scripts take it (4 bytes, as in every entry)."""
    if not isinstance(number, int) or not 0 < number < 2**32:
        raise InvalidInputError(f"node number must be an int in [1, 2^32), got {number!r}")
    return struct.pack("<I", number)

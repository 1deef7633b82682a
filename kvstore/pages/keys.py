"""Redis key names and page segments; the format is documented in docs/key-format.md.

Pages are indexed by *segment*: the pages at positions [s, s + SEGMENT_PAGES) of one hash
chain share one Redis string, keyed by the chain's hash at position s (the segment's
anchor). A lookup of n pages reads n / SEGMENT_PAGES keys, and each segment key is its
own Redis Cluster hash tag, so one namespace spreads over every shard. Registry keys
share the tag {registry}; a namespace's metadata is tagged with its digest.

Every key of a tenant starts with ``kvs:t:<tenant>:`` (``tenant_keys``), so a Redis ACL
key pattern confines a tenant's clients to their own keys; the registry
(``kvs:{registry}:``) is written by storage nodes only (docs/security.md)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

REGISTRY_PREFIX = "kvs:{registry}:"
NODES_ZSET = REGISTRY_PREFIX + "nodes"
NAMESPACES_SET = REGISTRY_PREFIX + "namespaces"
NODE_NUMBERS = REGISTRY_PREFIX + "numbers"
NODE_NUMBER_COUNTER = REGISTRY_PREFIX + "next_number"
# Pages per segment: a lookup of 8,192 pages reads 128 keys.
SEGMENT_PAGES = 64


def tenant_keys(tenant: str) -> str:
    """The ACL key pattern of every key of ``tenant``."""
    return f"kvs:t:{tenant}:*"


@dataclass(frozen=True)
class NamespaceKey:
    """Where a namespace's keys live: its tenant and its digest (32 hex digits).
    ``Namespace.key`` builds it; nodes rebuild it from a page's owner and digest."""

    tenant: str
    digest: str

    @cached_property
    def prefix(self) -> str:
        """What the namespace's segment and lease keys start with."""
        return f"kvs:t:{self.tenant}:{self.digest}:"

    @property
    def meta(self) -> str:
        """The namespace's metadata hash (field ``json``: the canonical namespace)."""
        return f"kvs:t:{self.tenant}:{{{self.digest}}}:meta"

    @property
    def member(self) -> str:
        """The namespace in the registry's set of namespaces (``tenant/digest``)."""
        return f"{self.tenant}/{self.digest}"

    @staticmethod
    def from_member(member: str) -> NamespaceKey:
        tenant, _, digest = member.partition("/")
        return NamespaceKey(tenant, digest)


def segment_key(prefix: str, anchor: bytes) -> str:
    """A segment's key under a namespace's ``prefix`` (built by the scripts too,
    kvstore/index/lua/common.lua)."""
    return f"{prefix}s:{{{anchor.hex()}}}"


def lease_key(prefix: str, anchor: bytes) -> str:
    """The key that exists while a reader holds a read lease on a segment (same slot)."""
    return f"{prefix}l:{{{anchor.hex()}}}"


def node_key(node_id: str) -> str:
    return REGISTRY_PREFIX + "node:" + node_id


def incarnation_key(node_id: str) -> str:
    """The node id's current incarnation (no TTL), so a stale one is fenced even after
    its registry entry expired."""
    return REGISTRY_PREFIX + "inc:" + node_id


@dataclass(frozen=True, slots=True)
class ChainPlace:
    """Where a chain's hashes lie in the index's segments: ``span`` pages a segment, the
    first hash at position ``offset`` of a segment anchored at ``head_anchor``. Token
    chains start at 0 of 64-page segments (the default); keyed pages (an engine's own
    page keys) are asked with their chain position when the engine gives it, and else
    as one-page segments (``UNPLACED``)."""

    span: int = SEGMENT_PAGES
    offset: int = 0
    head_anchor: bytes | None = None


TOKEN_CHAIN = ChainPlace()  # a chain from position 0 (every token chain)
UNPLACED = ChainPlace(span=1)


def segments(
    count: int, breaks: Sequence[int] = (), span: int = SEGMENT_PAGES, offset: int = 0
) -> list[tuple[int, int]]:
    """``(start, end)`` of every segment of ``count`` hashes made of chains that begin at
    position 0 and at each of ``breaks`` (a select's tail parts form a second chain).
    ``span``: pages per segment (1: keyed pages asked with no chain position, each its
    own segment). ``offset``: the first hash lies at that position of its segment (a
    keyed chain asked from its middle, ``placement``); its segment ends ``span -
    offset`` hashes on."""
    if not breaks and not offset and 0 < count <= span:  # every lookup of up to 64 blocks
        return [(0, count)]
    if span == 1 and not breaks:
        return [(i, i + 1) for i in range(count)]
    starts = sorted({0, *(b for b in breaks if 0 < b < count)})
    out: list[tuple[int, int]] = []
    for first, stop in zip(starts, starts[1:] + [count]):
        lead = offset if first == 0 else 0
        for s in range(first - lead, stop, span):
            out.append((max(s, first), min(s + span, stop)))
    return out


def placement(
    hashes: Sequence[bytes],
    breaks: Sequence[int] = (),
    span: int = SEGMENT_PAGES,
    offset: int = 0,
    head_anchor: bytes | None = None,
) -> tuple[list[bytes], list[int]]:
    """Every hash's segment anchor and position within its segment (see ``segments``).
    With ``offset``, the first segment is anchored at ``head_anchor`` (the hash ``offset``
    positions before the first, which the caller has) and its hashes lie from position
    ``offset`` on."""
    if span == 1 and not breaks:
        return list(hashes), [0] * len(hashes)
    if offset and head_anchor is None:
        raise ValueError("a chain placed from the middle of a segment needs its head_anchor")
    anchors: list[bytes] = []
    positions: list[int] = []
    for start, end in segments(len(hashes), breaks, span, offset):
        lead = offset if start == 0 else 0
        anchor = head_anchor if lead and head_anchor is not None else hashes[start]
        anchors.extend([anchor] * (end - start))
        positions.extend(range(lead, lead + end - start))
    return anchors, positions

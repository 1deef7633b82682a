"""Lookups in the index: the entries of the longest stored prefix of a chain of page
hashes, read under a read lease, one round trip per shard (clients call ``lookup``, or
compose ``lookup_steps`` into steps of their own: ``client.lookups.prefix``).

Pages are indexed by segment (``kvstore.pages.keys``): a lookup of n pages reads n / 64
keys. A shard that holds several segments of a lookup is read with lookup.lua, which
stops at the first missing one; a shard that holds one is read with plain GET and PTTL,
which cost its server far less (``_plain_lookup``), while its lease is known fresh
(``LeaseClock``), else with lookup.lua too, so a due lease is renewed in the lookup's
one round trip.

The read-lease rule has one definition: ``hold_lease`` in lua/common.lua, which
lookup.lua calls for every segment it reads, and lease.lua for a segment read with
plain commands whose lease ``renew_below`` says is due; ``renew_below`` is the rule's
threshold, sent to both scripts."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore.errors import (
    IndexPermissionError,
    IndexUnavailableError,
    InvalidInputError,
    KVStoreError,
)
from kvstore.index import checks, scripts
from kvstore.index.commands import Cmd
from kvstore.index.driver import IndexDriver, Steps, driven
from kvstore.index.entry_picks import pick, pick_pages, picked
from kvstore.index.records import ENTRY, IndexLookup, NodeInfo
from kvstore.index.registry import live_nodes_cmd
from kvstore.pages import keys
from kvstore.pages._chainhash import hex_names
from kvstore.pages.hashing import HASH_BYTES
from kvstore.pages.namespace import Namespace

log = logging.getLogger(__name__)
# The registry's live nodes as read in a lookup's round trip (``lookup_with_nodes``):
# ``live_nodes``' list, or the error that read met.
NodesRead = list[NodeInfo] | KVStoreError


def renew_below(lease_ms: int) -> int:
    """The read-lease rule's threshold: a lookup renews a segment's lease once less than
    half of ``lease_ms`` is left, so repeated lookups stay read-only (common.lua's
    ``hold_lease`` applies it). In whole milliseconds, as PTTL answers: a PTTL below
    ``lease_ms / 2`` is one below this."""
    return (lease_ms + 1) // 2


def _plain_lookup(prefix: str, anchor: bytes, lease_ms: int) -> list[Cmd]:
    """A shard's part of a lookup that is a single segment (every lookup of up to 64
    blocks, and the shards of a cluster that hold one segment of it): plain ``GET`` of
    the segment and, with a lease, ``PTTL`` of its lease; a lease that is due
    (``renew_below``) is then renewed by lease.lua (``_renewal``). Measured on Valkey 9
    (INFO commandstats): a lookup.lua call costs the server 24-30 us however small, of
    which its GET is 1.5 us, so a 16-block lookup cost about 2 us of Valkey CPU per
    block; GET and PTTL cost 1.5 us in all. Longer lookups keep the script, which reads
    up to the first missing segment and saves the client packing a command per segment."""
    seg = keys.segment_key(prefix, anchor)
    if lease_ms <= 0:
        return [Cmd(("GET", seg), key=seg)]
    held = keys.lease_key(prefix, anchor)
    return [Cmd(("GET", seg), key=seg), Cmd(("PTTL", held), key=held)]


def _renewal(prefix: str, anchor: bytes, lease_ms: int, ttl_ms: int) -> Cmd:
    """The renewal of a segment's read lease that a plain lookup found due: a lease.lua
    call in the lookup's second round trip (at most once per segment and half lease),
    which holds the lease by lookup.lua's rule."""
    return scripts.segment_call(
        scripts.LEASE, prefix, anchor, [lease_ms, renew_below(lease_ms), ttl_ms], anchor.hex(), []
    )


def _lookup_batch(
    prefix: str,
    anchors: list[bytes],
    by_shard: dict[int, list[int]],
    lease_ms: int,
    ttl_ms: int,
    plain: set[int],
) -> list[Cmd]:
    """A lookup's commands: per shard, one call of the lookup script over its segments,
    or plain commands for a shard that holds a single one whose lease is known fresh
    (``plain``: its segment numbers; ``_plain_lookup``). A single segment whose lease
    may be due goes through the script too, with its lease's PTTL after it: the script
    renews a due lease in the lookup's one round trip, and the PTTL says when it falls
    due next (``LeaseClock``). Measured after 1 s pauses, a first call that renewed in
    a second round trip took 1.18 ms against 0.93 (docs/benchmarks.md)."""
    hex_all = b"".join(anchors).hex()
    head = [lease_ms, renew_below(lease_ms), ttl_ms]
    batch: list[Cmd] = []
    for js in by_shard.values():
        if len(js) == 1 and js[0] in plain:
            batch += _plain_lookup(prefix, anchors[js[0]], lease_ms)
        else:
            run = (
                hex_all
                if len(js) == len(anchors)
                else "".join(hex_all[32 * j : 32 * j + 32] for j in js)
            )
            batch.append(
                scripts.segment_call(scripts.LOOKUP, prefix, anchors[js[0]], head, run, [])
            )
            if len(js) == 1 and lease_ms > 0:
                held = keys.lease_key(prefix, anchors[js[0]])
                batch.append(Cmd(("PTTL", held), key=held))
    return batch


@dataclass
class _SegmentsRead:
    """What a lookup's replies say: which segments exist (``read``, 1 or 0 per segment,
    with a 0 sentinel after the last), their entries (``parts``: per reply, the segments
    read, their entry counts and the entries), the error of a shard that could not
    answer (its segments count as absent), and the one-segment shards whose lease is due
    and must be renewed."""

    read: bytearray
    # per reply: the segments it read, each one's entry count, and the entries
    parts: list[tuple[list[int], list[int], bytes]] = field(default_factory=list)
    unavailable: KVStoreError | None = None
    renew: list[int] = field(default_factory=list)
    ttls: dict[int, int] = field(default_factory=dict)  # one-segment shards' lease PTTLs

    @classmethod
    def from_replies(
        cls,
        replies: Iterator[Any],
        by_shard: dict[int, list[int]],
        segments: int,
        lease_ms: int,
        plain: set[int],
    ) -> _SegmentsRead:
        out = cls(bytearray(segments + 1))
        for js in by_shard.values():
            if len(js) == 1 and js[0] in plain:
                reply = out._plain_reply(replies, js[0], lease_ms)
            else:
                reply = next(replies)
                if len(js) == 1 and lease_ms > 0 and isinstance(ttl := next(replies), int):
                    # a segment not stored has no lease to renew: read it plainly for a
                    # while (a miss's GET costs Valkey about 1.5 us, the script 25-30)
                    out.ttls[js[0]] = lease_ms if reply == [] else ttl
            if isinstance(reply, KVStoreError):
                out._shard_failed(reply)
                continue
            done = js[: len(reply)]
            for j in done:
                out.read[j] = 1
            counts = [len(value) // ENTRY.itemsize for value in reply]
            out.parts.append((done, counts, reply[0] if len(reply) == 1 else b"".join(reply)))
        return out

    @property
    def contiguous(self) -> int:
        """Segments read before the first missing one (the prefix ends there)."""
        return self.read.index(0)

    def _plain_reply(self, replies: Iterator[Any], segment: int, lease_ms: int) -> Any:
        """A one-segment shard's GET (and PTTL) replies as the script's would read."""
        value = next(replies)
        ttl = next(replies) if lease_ms > 0 else None
        failed = next((r for r in (value, ttl) if isinstance(r, KVStoreError)), None)
        if failed is None and value is not None and ttl is not None and ttl < renew_below(lease_ms):
            self.renew.append(segment)  # lease.lua holds it as lookup.lua would have
        elif failed is None and value is not None and isinstance(ttl, int):
            self.ttls[segment] = ttl
        return failed or ([] if value is None else [value])

    def _shard_failed(self, error: KVStoreError) -> None:
        if not isinstance(error, IndexUnavailableError):
            raise error
        self.unavailable = error  # its segments count as absent: the prefix ends at the first

    def renewed(self, replies: Iterator[Any]) -> None:
        """Read the renewals' replies: a segment that got no lease is not read."""
        for j in self.renew:
            reply = next(replies)
            if isinstance(reply, KVStoreError):
                self._shard_failed(reply)
                self.read[j] = 0


class LookupMethods(IndexDriver):
    """Reads the longest stored prefix of a chain of page hashes under a read lease
    (its one job), for clients: ``lookup``."""

    mget_refused = False  # set once the index refused MGET (an ACL role without it)

    def lookup_steps(
        self,
        namespace: Namespace | keys.NamespaceKey,
        hashes: Sequence[bytes] | bytes,
        *,
        breaks: Sequence[int] = (),
        lease_ms: int | None = None,
        units: tuple[int, int] = (0, 1),
        sparse: bool = False,
        segment_pages: int = keys.SEGMENT_PAGES,
        offset: int = 0,
        head_anchor: bytes | None = None,
    ) -> Steps[IndexLookup]:
        """Entries for the longest stored prefix of ``hashes`` (chains start at 0 and at
        each of ``breaks``), with a read lease: an ``IndexLookup`` to ``resolve`` against
        live nodes. One round trip per shard, all shards at once (and a second one to
        renew leases of one-segment shards, ``_plain_lookup``); a shard that fails
        ends the prefix at its first segment (a shorter prefix, never an error).
        ``units`` ``(first, count)``: each hash of the first chain is a block whose head
        groups ``first`` to ``first + count - 1`` must all be stored (kvstore.pages.heads);
        hashes of later chains are whole pages. ``hashes`` may come joined
        (``block_hash_bytes``), which spares an object per block.
        ``sparse``: a chain stored at some blocks only (``PageLayout.sparse``): every
        segment is read on its own, none ends the lookup (a 64-block run with no page
        is a gap, not the end), as plain commands or one-segment script calls.
        ``segment_pages``: pages per segment (1: keyed pages asked with no chain
        position, each its own segment). ``offset``, ``head_anchor``: the chain is asked
        from position ``offset`` of a segment anchored at ``head_anchor`` (a keyed chain
        asked from its middle, ``keys.placement``)."""
        return self._lookup_steps(
            namespace,
            hashes,
            breaks,
            lease_ms,
            units,
            sparse,
            segment_pages,
            offset,
            head_anchor,
            False,
        )

    def lookup_with_nodes_steps(
        self,
        namespace: Namespace | keys.NamespaceKey,
        hashes: Sequence[bytes] | bytes,
        *,
        breaks: Sequence[int] = (),
        lease_ms: int | None = None,
        units: tuple[int, int] = (0, 1),
        sparse: bool = False,
        segment_pages: int = keys.SEGMENT_PAGES,
        offset: int = 0,
        head_anchor: bytes | None = None,
    ) -> Steps[tuple[IndexLookup, NodesRead]]:
        """``lookup_steps``, and the registry's live nodes read in the same round trip:
        ``live_nodes``' list, or the error that read met (a client whose node list went
        stale pays no second round trip for it; a node answering a query)."""
        return self._lookup_steps(
            namespace,
            hashes,
            breaks,
            lease_ms,
            units,
            sparse,
            segment_pages,
            offset,
            head_anchor,
            True,
        )

    # The methods callers use; ``client.lookups.prefix`` composes the steps instead.
    lookup = driven(lookup_steps)
    lookup_with_nodes = driven(lookup_with_nodes_steps)

    def _lookup_steps(
        self,
        namespace: Namespace | keys.NamespaceKey,
        hashes: Sequence[bytes] | bytes,
        breaks: Sequence[int],
        lease_ms: int | None,
        units: tuple[int, int],
        sparse: bool,
        segment_pages: int,
        offset: int,
        head_anchor: bytes | None,
        with_nodes: bool,
    ) -> Steps[Any]:
        """Both lookups, written once: checks the arguments now, returns the steps
        (the answer paired with the nodes read when ``with_nodes``)."""
        prefix = checks.namespace_key(namespace).prefix
        blob = checks.joined_hashes(hashes, "lookup", joined_ok=True)
        n = len(blob) // HASH_BYTES
        head_chain = min((b for b in breaks if b > 0), default=n)
        first: np.ndarray | int
        need: np.ndarray | int
        if head_chain >= n:  # one chain, the same units at every position: no arrays
            first, need = units
        else:
            first = np.zeros(n, dtype=np.int64)
            need = np.ones(n, dtype=np.int64)
            first[:head_chain], need[:head_chain] = units
        lease = self.lease_ms if lease_ms is None else lease_ms

        if offset and (head_anchor is None or len(head_anchor) != HASH_BYTES):
            raise InvalidInputError(
                f"a lookup from position {offset} of a segment needs its {HASH_BYTES}-byte head_anchor"
            )

        def steps() -> Steps[Any]:
            segs = keys.segments(n, breaks, segment_pages, offset)
            anchors = [blob[HASH_BYTES * a : HASH_BYTES * a + HASH_BYTES] for a, _ in segs]
            if offset and head_anchor is not None:
                anchors[0] = head_anchor
            by_shard, ttl_ms = self._anchors_by_shard(prefix, anchors), self.entry_ttl_ms
            if sparse:  # each segment alone (keys route by command, not by this dict)
                by_shard = {j: [j] for js in by_shard.values() for j in js}
            plain = {
                js[0]
                for js in by_shard.values()
                if len(js) == 1 and (lease <= 0 or self.leases.fresh(prefix, anchors[js[0]]))
            }
            replies = yield _lookup_batch(prefix, anchors, by_shard, lease, ttl_ms, plain) + (
                [live_nodes_cmd()] if with_nodes else []
            )
            nodes = replies.pop() if with_nodes else None
            found = _SegmentsRead.from_replies(iter(replies), by_shard, len(segs), lease, plain)
            if found.renew:
                found.renewed(
                    iter((yield [_renewal(prefix, anchors[j], lease, ttl_ms) for j in found.renew]))
                )
                found.ttls.update((j, lease) for j in found.renew if found.read[j])
            below = renew_below(lease)
            for j, left in found.ttls.items():
                self.leases.seen(prefix, anchors[j], left, below)
            read = len(segs) if sparse else found.contiguous
            result = pick(blob, segs, found.parts, read, found.unavailable, first, need, offset)
            return (result, nodes) if with_nodes else result

        if (  # pages each a segment of one chain, no lease, one server: one MGET
            segment_pages == 1
            and lease <= 0
            and n
            and isinstance(first, int)
            and isinstance(need, int)
            and not (offset or self.cluster or self.mget_refused)
        ):
            return self._each_page(prefix, blob, first, need, sparse, with_nodes, steps)
        return steps()

    def _each_page(
        self,
        prefix: str,
        blob: bytes,
        first: int,
        need: int,
        sparse: bool,
        with_nodes: bool,
        script: Callable[[], Steps[Any]],
    ) -> Steps[Any]:
        """``lookup`` of pages that are each a one-page segment, with no lease (SGLang's
        ``batch_exists``), from an index of one server: one MGET, no script (a cluster
        refuses MGET across slots), its key names made in C (``hex_names``) and its RESP
        bytes too (``kvstore.index.held``: redis-py packed it in 32-57 us). Measured on
        Valkey 9 over 128 pages: the script cost the server 188 us (INFO commandstats),
        MGET 15 us; ``find_keys`` without a lease, interleaved on the 2-core VM, medians
        0.30-0.37 ms against 0.59-0.77 through the script (2.0-2.1x)."""
        names = hex_names(f"{prefix}s:{{".encode(), blob, b"}")
        replies = yield [Cmd(("MGET", *names), shard=0)] + (
            [live_nodes_cmd()] if with_nodes else []
        )
        values = replies[0]
        if isinstance(values, IndexPermissionError):
            # an ACL user made before its role ran MGET (kvstore acl, the chart): the
            # script path from now on, which its rules allow, and one line to say so
            self.mget_refused = True
            log.warning("the index refused MGET (%s): lookups use the script; add +mget", values)
            return (yield from script())
        if isinstance(values, KVStoreError):
            if not isinstance(values, IndexUnavailableError):
                raise values
            result = picked(blob, b"", [], 0, first, need, values)
        else:
            result = pick_pages(blob, values, first, need, sparse)
        return (result, replies[1]) if with_nodes else result

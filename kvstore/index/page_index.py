"""The page index in Redis/Valkey (one server or a cluster): lookups, publish, eviction
and the node registry.

``PageIndex`` (redis-py, blocking) and ``AsyncPageIndex`` (redis.asyncio) share every
method: each is defined once, as a generator that yields batches of commands
(``kvstore.index.routing.Cmd``); the flavour's driver sends a batch to its shards, all at once,
and feeds the replies back. Clients call ``lookup``; storage nodes call
``commit``/``remove`` and the registry methods.

Pages are indexed by segment (``kvstore.pages.keys``): a lookup of n pages is one script call
per shard it touches, each reading n / 64 keys. A page becomes visible only through
``commit``, which a node calls after it has verified the page's bytes, so a failed or
abandoned put never shows. Every record names its node's number and incarnation; a
reader counts it only while the registry lists that same incarnation
(``IndexLookup.resolve``), so a superseded or dead incarnation's records are invisible at
once, even when the index lost data or restored an old snapshot."""

from __future__ import annotations

import secrets
import struct
from dataclasses import dataclass, field
from typing import Any, Generator, Sequence

import numpy as np

from kvstore.errors import (
    FencedError,
    IndexUnavailableError,
    InvalidInputError,
    KVStoreError,
    NodeIdInUseError,
)
from kvstore.index import scripts
from kvstore.index.records import (
    ENTRY,
    HASH_PAIR,
    RAW_ENTRY,
    CommitEntry,
    IndexLookup,
    IndexStats,
    NamespaceStats,
    NodeInfo,
    Registration,
    incarnation_tag,
    select_records,
)
from kvstore.index.routing import INDEX_TIMEOUT, AsyncRouter, Cmd, SyncRouter
from kvstore.pages import heads, keys
from kvstore.pages._chainhash import join_hashes
from kvstore.pages.hashing import HASH_BYTES
from kvstore.pages.namespace import Namespace, check_tenant

DEFAULT_LEASE_MS = 5_000
# A segment key expires this long after its last commit or lease renewal: records of
# nodes that are gone for good do not stay in the index forever.
DEFAULT_ENTRY_TTL_MS = 24 * 3600 * 1000
# A script call names a key's page count in one byte.
MAX_PAGES_PER_KEY = 255



def _ns_key(namespace: Namespace | keys.NamespaceKey) -> keys.NamespaceKey:
    """Where a namespace's keys live; nodes name it by tenant and digest."""
    if isinstance(namespace, Namespace):
        return namespace.key
    if not isinstance(namespace, keys.NamespaceKey):
        raise InvalidInputError(f"need a Namespace or NamespaceKey, got {type(namespace).__name__}")
    digest = namespace.digest
    if len(digest) != 2 * HASH_BYTES or any(c not in "0123456789abcdef" for c in digest):
        raise InvalidInputError(f"namespace digest must be {2 * HASH_BYTES} lowercase hex characters, got {digest!r}")
    check_tenant(namespace.tenant)
    return namespace


def _check_hashes(hashes: Sequence[bytes] | bytes, what: str, joined_ok: bool = False) -> bytes:
    """The hashes joined, after checking each is 16 bytes (one C pass, join_hashes:
    this runs on every lookup of up to thousands of hashes). Where ``joined_ok``, hashes
    already joined (``block_hash_bytes``) are checked for length only."""
    if len(hashes) == 0:
        raise InvalidInputError(f"{what} needs at least one page hash, got an empty list")
    if joined_ok and isinstance(hashes, bytes):
        if len(hashes) % HASH_BYTES:
            raise InvalidInputError(f"{what}: joined page hashes must be a multiple of {HASH_BYTES} bytes, got {len(hashes)}")
        return hashes
    items = hashes if isinstance(hashes, (list, tuple)) else list(hashes)
    joined = join_hashes(items)
    if isinstance(joined, bytes):
        return joined
    h = items[joined]
    size = f"{len(h)} bytes" if isinstance(h, (bytes, bytearray)) else type(h).__name__
    raise InvalidInputError(f"{what}: page hash #{joined} must be {HASH_BYTES} bytes, got {size}")


def _inc(incarnation: str) -> str:
    if not isinstance(incarnation, str) or len(incarnation) < 16 or any(c not in "0123456789abcdef" for c in incarnation):
        raise InvalidInputError(f"incarnation must be a lowercase hex string of at least 16 digits, got {incarnation!r}")
    return incarnation


def _number(number: int) -> bytes:
    if not isinstance(number, int) or not 0 < number < 2**32:
        raise InvalidInputError(f"node number must be an int in [1, 2^32), got {number!r}")
    return struct.pack("<I", number)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _raise_first(replies: list[Any]) -> list[Any]:
    for reply in replies:
        if isinstance(reply, KVStoreError):
            raise reply
    return replies


def _anchors_by_shard(index: _IndexMethods, prefix: str, anchors: Sequence[bytes]) -> dict[int, list[int]]:
    """Segment numbers (indexes into ``anchors``) per shard, in order."""
    topo = index._router.topology
    assert topo is not None
    if topo.count == 1:
        return {0: list(range(len(anchors)))}
    by_shard: dict[int, list[int]] = {}
    for j, anchor in enumerate(anchors):
        by_shard.setdefault(topo.shard_of(keys.segment_key(prefix, anchor)), []).append(j)
    return by_shard


def _plain_lookup(prefix: str, anchor: bytes, lease_ms: int) -> list[Cmd]:
    """A shard's part of a lookup that is a single segment (every lookup of up to 64
    blocks, and the shards of a cluster that hold one segment of it): plain ``GET`` of
    the segment and, with a lease, ``PTTL`` of its lease; a lease that is missing or
    below half is then renewed by ``_renew_lease`` (as lookup.lua does). Measured on
    Valkey 9 (INFO commandstats): a lookup.lua call costs the server 24-30 us however
    small, of which its GET is 1.5 us, so a 16-block lookup cost about 2 us of Valkey
    CPU per block; GET and PTTL cost 1.5 us in all. Longer lookups keep the script,
    which reads up to the first missing segment and saves the client packing a
    command per segment."""
    seg = keys.segment_key(prefix, anchor)
    if lease_ms <= 0:
        return [Cmd(("GET", seg), key=seg)]
    held = keys.lease_key(prefix, anchor)
    return [Cmd(("GET", seg), key=seg), Cmd(("PTTL", held), key=held)]


def _renew_lease(prefix: str, anchor: bytes, lease_ms: int, ttl_ms: int) -> list[Cmd]:
    """A segment's read lease for ``lease_ms``, and its expiry pushed back to ``ttl_ms``
    (when set), as lookup.lua grants them."""
    held, seg = keys.lease_key(prefix, anchor), keys.segment_key(prefix, anchor)
    return [Cmd(("SET", held, "1", "PX", lease_ms), key=held)] + ([Cmd(("PEXPIRE", seg, ttl_ms), key=seg)] if ttl_ms > 0 else [])


def _lookup_batch(ns: str, anchors: list[bytes], by_shard: dict[int, list[int]], lease: int, ttl_ms: int) -> list[Cmd]:
    """A lookup's commands: per shard, one call of the lookup script over its segments,
    or plain commands for a shard that holds a single one (``_plain_lookup``)."""
    hex_all = b"".join(anchors).hex()
    batch: list[Cmd] = []
    for js in by_shard.values():
        if len(js) == 1:
            batch += _plain_lookup(ns, anchors[js[0]], lease)
        else:
            run = hex_all if len(js) == len(anchors) else "".join(hex_all[32 * j : 32 * j + 32] for j in js)
            batch.append(_segment_call(scripts.LOOKUP, ns, anchors[js[0]], [lease, ttl_ms], run, []))
    return batch


@dataclass
class _SegmentsRead:
    """What a lookup's replies say: which segments exist (``read``, with a False
    sentinel after the last), their entries (``parts``: segment numbers, records), the
    error of a shard that could not answer (its segments count as absent), and the
    one-segment shards whose lease is below half and must be renewed."""

    read: np.ndarray
    parts: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    unavailable: KVStoreError | None = None
    renew: list[int] = field(default_factory=list)

    @classmethod
    def from_replies(cls, replies: Any, by_shard: dict[int, list[int]], segments: int, lease: int) -> _SegmentsRead:
        out = cls(np.zeros(segments + 1, dtype=bool))
        for js in by_shard.values():
            reply = out._plain_reply(replies, js[0], lease) if len(js) == 1 else next(replies)
            if isinstance(reply, KVStoreError):
                out._shard_failed(reply)
                continue
            done = js[: len(reply)]
            out.read[done] = True
            counts = [len(value) // ENTRY.itemsize for value in reply]
            out.parts.append((np.repeat(np.array(done, dtype=np.int64), counts), np.frombuffer(b"".join(reply), dtype=ENTRY)))
        return out

    def _plain_reply(self, replies: Any, segment: int, lease: int) -> Any:
        """A one-segment shard's GET (and PTTL) replies as the script's would read."""
        value = next(replies)
        ttl = next(replies) if lease > 0 else None
        failed = next((r for r in (value, ttl) if isinstance(r, KVStoreError)), None)
        if failed is None and value is not None and ttl is not None and ttl < lease / 2:
            self.renew.append(segment)  # as lookup.lua: a lease below half is renewed
        return failed or ([] if value is None else [value])

    def _shard_failed(self, error: KVStoreError) -> None:
        if not isinstance(error, IndexUnavailableError):
            raise error
        self.unavailable = error  # its segments count as absent: the prefix ends at the first

    def renewed(self, granted: Any, ttl_ms: int) -> None:
        """Read the renewals' replies: a segment that got no lease is not read."""
        for j in self.renew:
            reply = next(granted)
            if ttl_ms > 0:
                next(granted)  # the segment's expiry: it lives on the lease's shard
            if isinstance(reply, KVStoreError):
                self._shard_failed(reply)
                self.read[j] = False


def _segment_call(script: scripts.LuaScript, prefix: str, first: bytes, head: list[Any], anchors_hex: str, tail: list[Any]) -> Cmd:
    """A call of a segment script (lookup, commit, remove): ``head`` arguments, the key
    prefix and the segments' anchors in hex, then ``tail`` arguments. The script builds
    the key names (common.lua); only the first segment's key is declared, to route the
    call: a cluster refuses declared keys of several slots even with the script flag
    allow-cross-slot-keys (measured on Valkey 9.1), which lets the script touch them."""
    return Cmd.run_script(script, [keys.segment_key(prefix, first)], [*head, prefix, anchors_hex, *tail])


def _group_by_anchor(anchors: Sequence[bytes]) -> dict[bytes, list[int]]:
    groups: dict[bytes, list[int]] = {}
    for i, anchor in enumerate(anchors):
        groups.setdefault(anchor, []).append(i)
    return groups


def _pick(blob: bytes, segs: list[tuple[int, int]], parts: list[tuple[np.ndarray, np.ndarray]], contiguous: int, unavailable: KVStoreError | None,
          first: np.ndarray, need: np.ndarray) -> IndexLookup:
    """The entries of the asked pages out of the segments read (``parts``: per shard,
    each entry's segment number and the entries), vectorised. Only the first
    ``contiguous`` segments count (the prefix ends at the first missing one), and an
    entry counts when it is a unit in ``[first, first + need)`` (per position) of the
    hash asked at its position (kvstore.pages.heads; whole pages are unit 0 of themselves):
    other chains that share the segment's anchor hold the rest."""
    if contiguous == 0 or not parts:
        empty = np.zeros(0, dtype=np.int64)
        return IndexLookup(0, np.zeros(0, dtype=ENTRY), empty, empty, need[:0], unavailable)
    seg = np.concatenate([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
    recs = np.concatenate([p[1].view(RAW_ENTRY) for p in parts]).view(ENTRY) if len(parts) > 1 else parts[0][1]
    asked = np.frombuffer(blob, dtype=HASH_PAIR)
    starts = np.array([start for start, _ in segs])
    lengths = np.array([end - start for start, end in segs])
    inside = (seg < contiguous) & (recs["pos"] < lengths[seg])
    position = np.where(inside, starts[seg] + recs["pos"], 0)
    unit = heads.unit_of(asked[position], recs) - first[position]
    ok = inside & (unit >= 0) & (unit < need[position])
    covered = segs[contiguous - 1][1]
    return IndexLookup(covered, select_records(recs, ok), position[ok], unit[ok], need[:covered], unavailable)


class _IndexMethods:
    """Every index method, defined once as a generator of command batches.

    ``_drive`` sends the batches: ``PageIndex`` returns the result, ``AsyncPageIndex``
    returns an awaitable of it. So the two flavours cannot drift apart."""

    _router: SyncRouter | AsyncRouter
    lease_ms: int
    entry_ttl_ms: int

    def _drive(self, steps: Generator[list[Cmd], list[Any], Any]) -> Any:
        raise NotImplementedError

    def _all_shards(self, *args: Any, parse: Any = lambda raw: raw) -> list[Cmd]:
        topo = self._router.topology
        assert topo is not None
        return [Cmd(args, shard=i, parse=parse) for i in range(topo.count)]

    def ping(self) -> Any:
        """Raise ``IndexUnavailableError`` unless every shard answers."""

        def steps() -> Generator[list[Cmd], list[Any], None]:
            _raise_first((yield self._all_shards("PING")))

        return self._drive(steps())

    def ensure_namespace(self, namespace: Namespace) -> Any:
        """Record the namespace under its tenant's keys (idempotent): clients at start,
        nodes after an index loss."""
        if not isinstance(namespace, Namespace):
            raise InvalidInputError(f"ensure_namespace needs a Namespace, got {type(namespace).__name__}")
        meta = namespace.key.meta
        return self._drive(_single(Cmd(("HSETNX", meta, "json", namespace.canonical_json()), key=meta)))

    def announce_namespace(self, key: keys.NamespaceKey) -> Any:
        """List a namespace in the registry, for ``stats`` (nodes, when they first
        serve it: clients cannot write the registry)."""
        return self._drive(_single(Cmd(("SADD", keys.NAMESPACES_SET, _ns_key(key).member), key=keys.NAMESPACES_SET)))

    def server_ids(self) -> Any:
        """Each shard's run id by address, None for a shard that did not answer. A run id
        changes whenever a server restarts, and a failover puts a new address in the map:
        both tell nodes that the index may have lost or rolled back what they published.
        Raises ``IndexUnavailableError`` only when no shard answered."""

        def steps() -> Generator[list[Cmd], list[Any], dict[str, str | None]]:
            topo = self._router.topology
            assert topo is not None
            infos = yield self._all_shards("INFO", "server")
            if all(isinstance(info, KVStoreError) for info in infos):
                raise infos[0]
            return {url: None if isinstance(info, KVStoreError) else str(info.get("run_id", "")) for url, info in zip(topo.urls, infos)}

        return self._drive(steps())

    def namespace(self, key: keys.NamespaceKey) -> Any:
        """The registered ``Namespace`` at ``key``, or None (nodes learn namespaces here;
        the caller checks that it hashes to the digest)."""
        meta = _ns_key(key).meta

        def steps() -> Generator[list[Cmd], list[Any], Namespace | None]:
            raw = _raise_first((yield [Cmd(("HGET", meta, "json"), key=meta)]))[0]
            return Namespace.model_validate_json(raw) if raw else None

        return self._drive(steps())

    def lookup(self, namespace: Namespace | keys.NamespaceKey, hashes: Sequence[bytes] | bytes, *, breaks: Sequence[int] = (), lease_ms: int | None = None,
               units: tuple[int, int] = (0, 1), with_nodes: bool = False) -> Any:
        """Entries for the longest stored prefix of ``hashes`` (chains start at 0 and at
        each of ``breaks``), with a read lease: an ``IndexLookup`` to ``resolve`` against
        live nodes. One round trip per shard, all shards at once (and a second one to
        renew leases of one-segment shards, ``_plain_lookup``); a shard that fails
        ends the prefix at its first segment (a shorter prefix, never an error).
        ``units`` ``(first, count)``: each hash of the first chain is a block whose head
        groups ``first`` to ``first + count - 1`` must all be stored (kvstore.pages.heads);
        hashes of later chains are whole pages. ``hashes`` may come joined
        (``block_hash_bytes``), which spares an object per block. ``with_nodes``: the
        registry's live nodes are read in the same round trip, and the answer is
        ``(IndexLookup, nodes)``, nodes being ``live_nodes``' list or the error that
        read met (a lookup that found its node list stale pays no second round trip)."""
        ns = _ns_key(namespace).prefix
        blob = _check_hashes(hashes, "lookup", joined_ok=True)
        n = len(blob) // HASH_BYTES
        head_chain = min([b for b in breaks if b > 0], default=n)
        first = np.zeros(n, dtype=np.int64)
        need = np.ones(n, dtype=np.int64)
        first[:head_chain], need[:head_chain] = units
        lease = self.lease_ms if lease_ms is None else lease_ms
        segs = keys.segments(n, breaks)
        anchors = [blob[HASH_BYTES * start : HASH_BYTES * start + HASH_BYTES] for start, _ in segs]

        def steps() -> Generator[list[Cmd], list[Any], Any]:
            by_shard = _anchors_by_shard(self, ns, anchors)
            replies = yield _lookup_batch(ns, anchors, by_shard, lease, self.entry_ttl_ms) + ([_live_nodes_cmd()] if with_nodes else [])
            nodes = replies.pop() if with_nodes else None
            found = _SegmentsRead.from_replies(iter(replies), by_shard, len(segs), lease)
            if found.renew:
                found.renewed(iter((yield [cmd for j in found.renew for cmd in _renew_lease(ns, anchors[j], lease, self.entry_ttl_ms)])), self.entry_ttl_ms)
            result = _pick(blob, segs, found.parts, int(np.argmin(found.read)), found.unavailable, first, need)
            return (result, nodes) if with_nodes else result

        return self._drive(steps())

    def commit(self, namespace: Namespace | keys.NamespaceKey, node_number: int, incarnation: str, entries: Sequence[CommitEntry]) -> Any:
        """Make verified pages visible; per entry True when written, None where its shard
        failed. Raises ``IndexUnavailableError`` when none was."""
        ns, tag = _ns_key(namespace).prefix, incarnation_tag(_inc(incarnation))
        _number(node_number)
        blob = _check_hashes([e.page_hash for e in entries], "commit")
        _check_hashes([e.anchor for e in entries], "commit anchors")
        if any(not 0 <= e.position < keys.SEGMENT_PAGES for e in entries):
            raise InvalidInputError(f"a page's position in its segment must lie in [0, {keys.SEGMENT_PAGES})")
        recs = np.zeros(len(entries), dtype=ENTRY)
        pairs = np.frombuffer(blob, dtype=HASH_PAIR)
        recs["h0"], recs["h1"] = pairs["h0"], pairs["h1"]
        recs["node"], recs["tag"] = node_number, tag
        recs["pos"] = [e.position for e in entries]
        recs["slot"] = [e.slot for e in entries]
        recs["size"] = [e.size for e in entries]
        recs["checksum"] = [e.checksum for e in entries]
        raw = recs.tobytes()
        groups = _group_by_anchor([e.anchor for e in entries])

        def call(anchors: list[bytes], per_key: list[list[int]]) -> Cmd:
            entries_bytes = b"".join(raw[ENTRY.itemsize * p : ENTRY.itemsize * (p + 1)] for pos in per_key for p in pos)
            return _segment_call(scripts.COMMIT, ns, anchors[0], [self.entry_ttl_ms], b"".join(anchors).hex(), [bytes(map(len, per_key)), entries_bytes])

        return self._drive(self._segment_writes(ns, groups, call, len(entries), lambda reply, n: [True] * n))

    def remove(self, namespace: Namespace | keys.NamespaceKey, node_number: int, hashes: Sequence[bytes], anchors: Sequence[bytes], respect_lease: bool = True) -> Any:
        """Drop a node's entries of pages (eviction); per page True when its slot may be
        freed, False when a read lease keeps it, None when its shard failed. Raises
        ``IndexUnavailableError`` when every shard failed."""
        ns, me = _ns_key(namespace).prefix, _number(node_number)
        blob = _check_hashes(hashes, "remove")
        if len(anchors) != len(hashes):
            raise InvalidInputError(f"need one anchor per page hash, got {len(anchors)} for {len(hashes)}")
        _check_hashes(anchors, "remove anchors")
        groups = _group_by_anchor(anchors)
        flag = int(respect_lease)

        def call(anchor_list: list[bytes], per_key: list[list[int]]) -> Cmd:
            wanted = b"".join(blob[16 * p : 16 * p + 16] for pos in per_key for p in pos)
            return _segment_call(scripts.REMOVE, ns, anchor_list[0], [flag, me], b"".join(anchor_list).hex(), [bytes(map(len, per_key)), wanted])

        return self._drive(self._segment_writes(ns, groups, call, len(hashes), lambda reply, n: [c == ord("1") for c in reply]))

    def _segment_writes(self, ns: str, groups: dict[bytes, list[int]], call: Any, total: int, parse: Any) -> Generator[list[Cmd], list[Any], list[Any]]:
        """One script call per shard over its segments (``call(anchors, positions per
        anchor)``); per page the parsed result, None where its shard failed."""
        items = list(groups.items())
        by_shard = _anchors_by_shard(self, ns, [a for a, _ in items])
        # a script names a segment's count in one byte: longer groups go in pieces
        pieces = [[(items[j][0], items[j][1][i : i + MAX_PAGES_PER_KEY]) for j in js for i in range(0, len(items[j][1]), MAX_PAGES_PER_KEY)] for js in by_shard.values()]
        batch = [call([a for a, _ in piece], [pos for _, pos in piece]) for piece in pieces]
        replies = yield batch
        out: list[Any] = [None] * total
        failed = None
        for piece, reply in zip(pieces, replies):
            if isinstance(reply, KVStoreError):
                if not isinstance(reply, IndexUnavailableError):
                    raise reply
                failed = reply
                continue
            positions = [p for _, pos in piece for p in pos]
            for p, value in zip(positions, parse(reply, len(positions))):
                out[p] = value
        if failed is not None and all(v is None for v in out):
            raise failed
        return out

    def register_node(self, node_id: str, address: str, capacity: int, ttl_ms: int, incarnation: str | None = None, *, replaces: str = "", extra: dict[str, str] | None = None) -> Any:
        """Register a new incarnation (``incarnation=None``; ``replaces`` names the
        caller's own previous one) or heartbeat ``incarnation``; returns a
        ``Registration``. Raises ``NodeIdInUseError`` when another live incarnation holds
        the node id and ``FencedError`` when a heartbeat's incarnation is no longer the
        registered one."""
        if not node_id or "|" in node_id:
            raise InvalidInputError(f"node id {node_id!r} must be non-empty and contain no '|'")
        fields = {"address": address, "capacity": str(capacity), **(extra or {})}
        # The script mints a new incarnation from its clock and these random bits, so it
        # never repeats, not even after the index lost every key (a counter would).
        args: list[Any] = [node_id, "" if incarnation is None else _inc(incarnation), ttl_ms, secrets.token_hex(8), replaces]
        for k, v in fields.items():
            args += [k, v]
        key_list = [keys.NODES_ZSET, keys.node_key(node_id), keys.incarnation_key(node_id), keys.NODE_NUMBERS, keys.NODE_NUMBER_COUNTER]

        def parse(raw: list) -> Registration:
            if int(raw[0]) == 1:
                return Registration(_text(raw[1]), int(raw[2]))
            if _text(raw[1]) == "in_use":
                raise NodeIdInUseError(f"node id {node_id!r} is in use by a live node at {_text(raw[2])}; give every node its own --node-id")
            raise FencedError(f"incarnation {incarnation} of node {node_id!r} is no longer the registered one")

        return self._drive(_single(Cmd.run_script(scripts.REGISTER, key_list, args, parse)))

    def deregister_node(self, node_id: str, incarnation: str) -> Any:
        return self._drive(_single(Cmd.run_script(scripts.DEREGISTER, [keys.NODES_ZSET, keys.node_key(node_id)], [node_id, _inc(incarnation)], bool)))

    def live_nodes(self) -> Any:
        return self._drive(_single(_live_nodes_cmd()))

    def stats(self) -> Any:
        """Live nodes and, per namespace, the pages their current incarnations report."""

        def steps() -> Generator[list[Cmd], list[Any], IndexStats]:
            nodes, members = _raise_first((yield [_live_nodes_cmd(), Cmd(("SMEMBERS", keys.NAMESPACES_SET), key=keys.NAMESPACES_SET)]))
            spaces_keys = sorted((keys.NamespaceKey.from_member(_text(m)) for m in members), key=lambda k: k.member)
            metas = _raise_first((yield [Cmd(("HGET", k.meta, "json"), key=k.meta) for k in spaces_keys])) if spaces_keys else []
            spaces = []
            for key, raw in zip(spaces_keys, metas):
                digest = key.digest
                per_node = {n.node_id: n.pages[digest] for n in nodes if n.pages.get(digest)}
                ns = Namespace.model_validate_json(raw) if raw else None
                spaces.append(NamespaceStats(digest, sum(per_node.values()), ns, per_node))
            return IndexStats(nodes, spaces)

        return self._drive(steps())


def _single(cmd: Cmd) -> Generator[list[Cmd], list[Any], Any]:
    """A method of one command: its parsed reply, or its error raised."""
    return _raise_first((yield [cmd]))[0]


def _live_nodes_cmd() -> Cmd:
    def parse(raw: list) -> list[NodeInfo]:
        nodes, pos = [], 0
        while pos < len(raw):
            node_id, pos = _text(raw[pos]), pos + 1
            fields: dict[str, str] = {}
            while _text(raw[pos]) != "":
                fields[_text(raw[pos])] = _text(raw[pos + 1])
                pos += 2
            pos += 1
            address, capacity, inc, number = fields.pop("address"), fields.pop("capacity"), fields.pop("inc"), fields.pop("no", "0")
            nodes.append(NodeInfo(node_id, address, int(capacity), inc, int(number), fields))
        return nodes

    return Cmd.run_script(scripts.LIVE_NODES, [keys.NODES_ZSET], [keys.REGISTRY_PREFIX + "node:"], parse, readonly=True)


class _IndexBase(_IndexMethods):
    def __init__(self, url: str, router: Any, *, lease_ms: int = DEFAULT_LEASE_MS, entry_ttl_ms: int = DEFAULT_ENTRY_TTL_MS) -> None:
        self.url = url
        self.lease_ms = lease_ms
        self.entry_ttl_ms = entry_ttl_ms
        self._router = router

    @property
    def cluster(self) -> bool:
        """Whether the URL names a Redis/Valkey Cluster."""
        return self._router.cluster

    @property
    def shards(self) -> int:
        """Index servers (shards) as last read from the slot map; 0 before the first call."""
        return self._router.topology.count if self._router.topology else 0


class PageIndex(_IndexBase):
    """Blocking page index (redis-py). Thread-safe: redis-py pools connections."""

    def __init__(self, url: str, *, timeout: float = INDEX_TIMEOUT, password: str | None = None, **kwargs: Any) -> None:
        super().__init__(url, SyncRouter(url, scripts.ALL, timeout=timeout, password=password), **kwargs)

    def _drive(self, steps: Generator[list[Cmd], list[Any], Any]) -> Any:
        router: SyncRouter = self._router  # type: ignore[assignment]
        router.prepare()
        try:
            batch = next(steps)
            while True:
                batch = steps.send(router.run(batch))
        except StopIteration as done:
            return done.value

    def close(self) -> None:
        self._router.close()


class AsyncPageIndex(_IndexBase):
    """asyncio page index (redis.asyncio): the same methods, each returning an awaitable."""

    def __init__(self, url: str, *, timeout: float = INDEX_TIMEOUT, password: str | None = None, **kwargs: Any) -> None:
        super().__init__(url, AsyncRouter(url, scripts.ALL, timeout=timeout, password=password), **kwargs)

    def _drive(self, steps: Generator[list[Cmd], list[Any], Any]) -> Any:
        # The generator is created by the caller but must not run before the topology is
        # known: it groups keys by shard while building its first batch.
        async def run() -> Any:
            router: AsyncRouter = self._router  # type: ignore[assignment]
            await router.prepare()
            try:
                batch = next(steps)
                while True:
                    batch = steps.send(await router.run(batch))
            except StopIteration as done:
                return done.value

        return run()

    async def close(self) -> None:
        await self._router.close()

"""Publishing pages in the index: ``commit`` makes a node's verified pages visible and
``remove`` drops its entries of evicted pages, one script call per shard over the
segments it holds (commit.lua, remove.lua).

Storage nodes call both: ``commit`` after a put's bytes are verified, so a failed or
abandoned put never shows; ``remove`` before an evicted page's slot is freed."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvstore.errors import IndexUnavailableError, InvalidInputError, KVStoreError
from kvstore.index import checks, scripts
from kvstore.index.commands import Cmd
from kvstore.index.driver import IndexDriver, Steps, driven
from kvstore.index.records import ENTRY, HASH_PAIR, CommitEntry, incarnation_tag
from kvstore.pages import keys
from kvstore.pages.namespace import Namespace

# A script call names a key's page count in one byte.
MAX_PAGES_PER_KEY = 255

# Builds one shard's script call from its segments' anchors and, per anchor, the
# positions (into the caller's pages) of the pages in that segment.
SegmentCall = Callable[[list[bytes], list[list[int]]], Cmd]


def _group_by_anchor(anchors: Sequence[bytes]) -> dict[bytes, list[int]]:
    groups: dict[bytes, list[int]] = {}
    for i, anchor in enumerate(anchors):
        groups.setdefault(anchor, []).append(i)
    return groups


class PublishMethods(IndexDriver):
    """Writes a node's page entries into the segments (its one job): ``commit`` adds
    them, ``remove`` takes them out unless a reader's lease holds the segment."""

    def _commit(
        self,
        namespace: Namespace | keys.NamespaceKey,
        node_number: int,
        incarnation: str,
        entries: Sequence[CommitEntry],
    ) -> Steps[list[bool | None]]:
        """Make verified pages visible; per entry True when written, None where its shard
        failed. Raises ``IndexUnavailableError`` when none was."""
        prefix, tag = (
            checks.namespace_key(namespace).prefix,
            incarnation_tag(checks.incarnation(incarnation)),
        )
        checks.node_number(node_number)
        blob = checks.joined_hashes([e.page_hash for e in entries], "commit")
        checks.joined_hashes([e.anchor for e in entries], "commit anchors")
        if any(not 0 <= e.position < keys.SEGMENT_PAGES for e in entries):
            raise InvalidInputError(
                f"a page's position in its segment must lie in [0, {keys.SEGMENT_PAGES})"
            )
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
            entries_bytes = b"".join(
                raw[ENTRY.itemsize * p : ENTRY.itemsize * (p + 1)] for pos in per_key for p in pos
            )
            counts = bytes(map(len, per_key))
            return scripts.segment_call(
                scripts.COMMIT,
                prefix,
                anchors[0],
                [self.entry_ttl_ms],
                b"".join(anchors).hex(),
                [counts, entries_bytes],
            )

        return self._segment_writes(prefix, groups, call, len(entries), lambda reply, n: [True] * n)

    commit = driven(_commit)

    def _remove(
        self,
        namespace: Namespace | keys.NamespaceKey,
        node_number: int,
        hashes: Sequence[bytes],
        anchors: Sequence[bytes],
        respect_lease: bool = True,
    ) -> Steps[list[bool | None]]:
        """Drop a node's entries of pages (eviction); per page True when its slot may be
        freed, False when a read lease keeps it, None when its shard failed. Raises
        ``IndexUnavailableError`` when every shard failed."""
        prefix, me = checks.namespace_key(namespace).prefix, checks.node_number(node_number)
        blob = checks.joined_hashes(hashes, "remove")
        if len(anchors) != len(hashes):
            raise InvalidInputError(
                f"need one anchor per page hash, got {len(anchors)} for {len(hashes)}"
            )
        checks.joined_hashes(anchors, "remove anchors")
        groups = _group_by_anchor(anchors)
        flag = int(respect_lease)

        def call(anchor_list: list[bytes], per_key: list[list[int]]) -> Cmd:
            wanted = b"".join(blob[16 * p : 16 * p + 16] for pos in per_key for p in pos)
            counts = bytes(map(len, per_key))
            return scripts.segment_call(
                scripts.REMOVE,
                prefix,
                anchor_list[0],
                [flag, me],
                b"".join(anchor_list).hex(),
                [counts, wanted],
            )

        return self._segment_writes(
            prefix, groups, call, len(hashes), lambda reply, n: [c == ord("1") for c in reply]
        )

    remove = driven(_remove)

    def _segment_writes(
        self,
        prefix: str,
        groups: dict[bytes, list[int]],
        call: SegmentCall,
        total: int,
        parse: Callable[[Any, int], list[Any]],
    ) -> Steps[list[Any]]:
        """One script call per shard over its segments (``call(anchors, positions per
        anchor)``); per page the parsed result, None where its shard failed."""
        items = list(groups.items())
        by_shard = self._anchors_by_shard(prefix, [a for a, _ in items])
        # a script names a segment's count in one byte: longer groups go in pieces
        pieces = [
            [
                (items[j][0], items[j][1][i : i + MAX_PAGES_PER_KEY])
                for j in js
                for i in range(0, len(items[j][1]), MAX_PAGES_PER_KEY)
            ]
            for js in by_shard.values()
        ]
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

"""Prefix lookups: how much of a prompt is stored, and where (``PrefixLookup``); what a
lookup found, for fetching it later, is a ``StoredPrefix`` (``client.lookups.stored_prefix``).

One path for both clients: ``AsyncKVCacheClient`` awaits ``find`` on its event loop;
``KVCacheClient`` calls ``find_blocking`` in its caller's thread over an index
connection of its own (the hop to the loop and back cost 0.14 ms, a third of a 16-block
lookup). What is asked, how the answer is checked against the node list and how a fault
counts are written once, here. Neither reads the node registry on its way: the node
list comes from ``NodeDirectory``, which keeps it fresh in the background."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from client.log_limit import LogLimit
from client.lookups.registration import NamespaceRegistration
from client.lookups.stored_prefix import StoredPrefix
from client.nodes.directory import NodeDirectory
from client.stats import ClientStats
from kvstore.errors import (
    IndexScriptError,
    IndexTimeoutError,
    InvalidInputError,
    KVStoreError,
    RemoteFault,
)
from kvstore.index import AsyncPageIndex, IndexLookup, LookupResult, NodeInfo, PageIndex
from kvstore.pages.hashing import HASH_BYTES, block_hash_bytes, keyed_hash_bytes
from kvstore.pages.heads import RankUnits
from kvstore.pages.identity import BlockExtras, RequestIdentity, resolve
from kvstore.pages.keys import SEGMENT_PAGES, TOKEN_CHAIN, UNPLACED, ChainPlace
from kvstore.pages.namespace import Namespace

log = logging.getLogger(__name__)
# an index fault fails every lookup: a WARNING at most once a minute, then DEBUG
_LIMIT = LogLimit(log)
# What a call's ``identity`` may be: a request identity, one already resolved to blocks
# (the vLLM connector's workers get those), or None for a plain request.
Identity = RequestIdentity | BlockExtras | None


class PrefixLookup:
    """One job: answer how much of a prompt is stored and on which live replicas, in one
    index round trip. Index faults are misses: ``lookup`` and ``find`` give None when
    the index could not answer at all (counted in ``stats.index_errors``; a script the
    index rejects, a bug, in ``stats.index_script_errors`` and logged at ERROR), and a
    shorter prefix when one shard failed after others answered. The async methods run
    on the client's event loop; ``find_blocking`` in any thread."""

    def __init__(
        self,
        index: AsyncPageIndex,
        storage: Namespace,
        heads: RankUnits,
        nodes: NodeDirectory,
        registration: NamespaceRegistration,
        stats: ClientStats,
    ) -> None:
        self._index = index
        self._storage = storage
        self._units = (heads.first, heads.count)
        self._heads = heads
        self._nodes = nodes
        self._registration = registration
        self._stats = stats

    def chain_hashes(self, token_ids: Any, identity: Identity = None) -> bytes:
        """The storage chain hashes of ``token_ids``' full blocks, joined, under
        ``identity`` (``kvstore.pages.identity``)."""
        if self._storage.keyed:
            raise InvalidInputError(
                f"layout {self._storage.layout!r} keys pages by the engine's page keys, "
                "not token ids: use the keyed calls (find_keys, put_keyed)"
            )
        return block_hash_bytes(
            self._storage, token_ids, resolve(identity, self._storage.block_size, len(token_ids))
        )

    def keyed_hashes(self, page_keys: list[str]) -> bytes:
        """The storage hashes of an engine's own page keys, joined (a keyed layout's
        pages: ``kvstore.pages.hashing.keyed_hash_bytes``)."""
        return keyed_hash_bytes(self._storage, page_keys)

    def keyed_place(self, position: int | None, anchor_key: str | None) -> ChainPlace:
        """Where keyed pages from chain ``position`` lie in the index: 64-page segments
        from the chain's start, the first anchored at ``anchor_key`` (the page key at
        ``position`` rounded down to 64, needed when that is not ``position``); with no
        position, one-page segments (``UNPLACED``: found from any key, one index key a
        page)."""
        if position is None:
            return UNPLACED
        if position < 0:
            raise InvalidInputError(f"a chain position must be at least 0, got {position}")
        offset = position % SEGMENT_PAGES
        if not offset:
            return TOKEN_CHAIN
        if anchor_key is None:
            raise InvalidInputError(
                f"keys from chain position {position} need the key at "
                f"{position - offset} (anchor_key): their segment is anchored there"
            )
        return ChainPlace(offset=offset, head_anchor=self.keyed_hashes([anchor_key]))

    async def find(
        self, token_ids: Any, identity: Identity = None, *, last: bool = False
    ) -> StoredPrefix | None:
        """The stored prefix of ``token_ids`` (None on an index fault), registering the
        namespace first while that has not succeeded. ``last``: the chain's pages are
        stored at some blocks only (a hybrid model's boundary states): the prefix up to
        the last block stored, whose page alone it holds (``IndexLookup.resolve``); every
        64-block segment of the chain is read (``kvstore.pages.keys``), gaps or not."""
        return await self.find_joined(self.chain_hashes(token_ids, identity), last=last)

    async def find_joined(
        self, joined: bytes, *, last: bool = False, place: ChainPlace = TOKEN_CHAIN
    ) -> StoredPrefix | None:
        """``find`` of a chain's storage hashes, joined (``chain_hashes``, or
        ``keyed_hashes`` for a keyed layout, placed as ``place`` says)."""
        if not joined:
            return self._prefix(joined, LookupResult.empty(), last, place)
        return self._prefix(joined, await self.lookup(joined, last=last, place=place), last, place)

    def find_blocking(
        self,
        index: PageIndex,
        token_ids: Any,
        nodes: list[NodeInfo] | None,
        identity: Identity = None,
        *,
        last: bool = False,
    ) -> StoredPrefix | None:
        """``find`` in the caller's thread over ``index`` (its reads bound its wait),
        against ``nodes`` (``NodeDirectory.fresh``; None when that list is stale: the
        registry is read in the lookup's round trip), for a registered namespace."""
        return self.find_joined_blocking(
            index, self.chain_hashes(token_ids, identity), nodes, last=last
        )

    def find_joined_blocking(
        self,
        index: PageIndex,
        joined: bytes,
        nodes: list[NodeInfo] | None,
        *,
        last: bool = False,
        place: ChainPlace = TOKEN_CHAIN,
        lease: bool = True,
    ) -> StoredPrefix | None:
        """``find_joined`` in the caller's thread, as ``find_blocking``. ``lease``
        False: no read lease is taken (a question of existence, whose answer nobody
        fetches from: the prefix it returns holds a lease of 0, so a fetch from it asks
        the index again)."""
        if not joined:
            return self._prefix(joined, LookupResult.empty(), last, place)
        asked = self._ask_blocking(index, joined, nodes, last, place, None if lease else 0)
        result = None if asked is None else self._resolve(*asked, last)
        if result is None:
            return None
        return self.stored_prefix(joined, result, last, place, None if lease else 0)

    async def stored_each(self, joined: bytes) -> np.ndarray | None:
        """Per keyed page of ``joined`` (``keyed_hashes``), whether a live replica of this
        rank's share is stored, each on its own (no prefix: a page missing before it does
        not hide it), with no read lease; None on an index fault. Registers the
        namespace first while that has not succeeded."""
        asked = await self._ask_loop(joined, (), True, UNPLACED, 0)
        return None if asked is None else self._present(*asked)

    def stored_each_blocking(
        self, index: PageIndex, joined: bytes, nodes: list[NodeInfo] | None
    ) -> np.ndarray | None:
        """``stored_each`` in the caller's thread, as ``find_blocking``."""
        if not joined:
            return np.zeros(0, dtype=bool)
        asked = self._ask_blocking(index, joined, nodes, True, UNPLACED, 0)
        return None if asked is None else self._present(*asked)

    def _present(self, found: IndexLookup, nodes: list[NodeInfo]) -> np.ndarray | None:
        """``found.present``, or None when the index could not answer (``_answered``)."""
        return found.present(nodes) if self._answered(found) else None

    async def lookup(
        self,
        hashes: list[bytes] | bytes,
        breaks: Sequence[int] = (),
        *,
        last: bool = False,
        place: ChainPlace = TOKEN_CHAIN,
    ) -> LookupResult | None:
        """The index's answer for ``hashes`` (chains start at 0 and at each of
        ``breaks``, placed as ``place`` says) with replicas of stale incarnations
        dropped; None on an index fault. ``last``: as ``find``'s."""
        asked = await self._ask_loop(hashes, breaks, last, place)
        return None if asked is None else self._resolve(*asked, last)

    def stored_prefix(
        self,
        joined: bytes,
        result: LookupResult,
        last: bool = False,
        place: ChainPlace = TOKEN_CHAIN,
        lease_ms: int | None = None,
    ) -> StoredPrefix:
        """What ``find`` returns for the lookup of ``joined`` that gave ``result``
        (``lease_ms``: the read lease it holds, the index's when None)."""
        units = self._units
        return StoredPrefix(
            self._storage.digest_hex,
            self._storage.block_size,
            joined[: HASH_BYTES * result.matched],
            units,
            result,
            time.time(),
            self._index.lease_ms if lease_ms is None else lease_ms,
            last,
            place,
        )

    def check_found(self, found: StoredPrefix) -> None:
        """Raise unless ``found`` is of this client's storage namespace and covers the
        head groups this rank reads."""
        if found.storage != self._storage.digest_hex:
            raise InvalidInputError(
                f"found in storage namespace {found.storage[:12]}..., "
                f"this client reads {self._storage.digest_hex[:12]}..."
            )
        first, count = found.units
        mine = self._heads
        if not (first <= mine.first and mine.first + mine.count <= first + count):
            raise InvalidInputError(
                f"found for head groups {first}..{first + count - 1}, "
                f"this rank reads {mine.first}..{mine.first + mine.count - 1}"
            )

    async def found_result(self, found: StoredPrefix) -> LookupResult | None:
        """``found``'s replicas of this rank's head groups while at most half its read
        lease has passed (the lease keeps the pages from eviction); else the index is
        asked again."""
        age = time.time() - found.taken
        if 0 <= age < found.lease_ms / 2000:
            return found.result.narrow(self._heads.first - found.units[0], self._heads.count)
        self._stats.stale_finds += 1
        return await self.lookup(found.joined, last=found.last, place=found.place)

    def _ask(
        self,
        index: PageIndex | AsyncPageIndex,
        hashes: list[bytes] | bytes,
        breaks: Sequence[int],
        sparse: bool = False,
        place: ChainPlace = TOKEN_CHAIN,
        lease_ms: int | None = None,
        with_nodes: bool = False,
    ) -> Any:
        """The index call of a lookup: its answer, or an awaitable of it for the async
        index. ``sparse``: every segment read (a ``last`` lookup's chain has gaps).
        ``with_nodes``: the registry is read in the same round trip (``_asked``)."""
        self._stats.lookups += 1
        return index.lookup(
            self._storage,
            hashes,
            breaks=breaks,
            units=self._units,
            sparse=sparse,
            segment_pages=place.span,
            offset=place.offset,
            head_anchor=place.head_anchor,
            lease_ms=lease_ms,
            with_nodes=with_nodes,
        )

    async def _ask_loop(
        self,
        hashes: list[bytes] | bytes,
        breaks: Sequence[int],
        sparse: bool,
        place: ChainPlace,
        lease_ms: int | None = None,
    ) -> tuple[IndexLookup, list[NodeInfo]] | None:
        """``_ask`` of the client's own index on its loop, registering the namespace
        first while that has not succeeded: the index's answer and the nodes to check
        it against (``_asked``); None on an index fault (``_failed``)."""
        await self._registration.ensure()
        nodes, at = self._nodes.fresh(), time.monotonic()
        try:
            found = await self._ask(
                self._index, hashes, breaks, sparse, place, lease_ms, nodes is None
            )
        except (RemoteFault, IndexScriptError) as exc:
            self._failed(exc)
            return None
        return self._asked(found, nodes, at)

    def _ask_blocking(
        self,
        index: PageIndex,
        joined: bytes,
        nodes: list[NodeInfo] | None,
        sparse: bool,
        place: ChainPlace,
        lease_ms: int | None,
    ) -> tuple[IndexLookup, list[NodeInfo]] | None:
        """``_ask`` of ``index`` in the caller's thread (a registered namespace), against
        ``nodes`` (``NodeDirectory.fresh``: None when stale, ``_asked``); None on an
        index fault (``_failed``)."""
        at = time.monotonic()
        try:
            found = self._ask(index, joined, (), sparse, place, lease_ms, nodes is None)
        except (RemoteFault, IndexScriptError) as exc:
            self._failed(exc)
            return None
        return self._asked(found, nodes, at)

    def _asked(
        self, found: Any, nodes: list[NodeInfo] | None, at: float
    ) -> tuple[IndexLookup, list[NodeInfo]]:
        """A lookup's answer and the nodes to check it against: ``nodes``, or when the
        directory's list was stale (None: the client was idle, ``KEEP_FRESH_S``) the
        registry read in the lookup's own round trip, sent at ``at``
        (``NodeDirectory.offered``). Through the client's loop and a round trip of its
        own, that read made the first lookup after more than 5 s of quiet 2-4 ms
        (bench/lookup.py, paused lookups)."""
        if nodes is not None:
            return found, nodes
        found, read = found
        return found, self._nodes.offered(read, at)

    def _prefix(
        self,
        joined: bytes,
        result: LookupResult | None,
        last: bool = False,
        place: ChainPlace = TOKEN_CHAIN,
    ) -> StoredPrefix | None:
        return None if result is None else self.stored_prefix(joined, result, last, place)

    def _resolve(
        self, found: IndexLookup, nodes: list[NodeInfo], last: bool = False
    ) -> LookupResult | None:
        """The index's answer with replicas of stale incarnations dropped (an entry
        counts only while the registry names the same incarnation of its node). A shard
        that failed after the first segment shortens the prefix; one that failed on the
        first (a single index that cannot be reached: nothing was answered) is a fault,
        None, as an index that raised: the vLLM scheduler counts it and its circuit
        breaker opens on it."""
        return found.resolve(nodes, last=last) if self._answered(found) else None

    def _answered(self, found: IndexLookup) -> bool:
        """Whether the index answered ``found``: False (a fault, counted and logged) when
        a single index or the first segment's shard could not; a shard that failed
        after it is counted and logged, and its segments count as absent."""
        if found.unavailable is not None:
            if found.covered == 0:
                self._failed(found.unavailable)
                return False
            self._stats.index_errors += 1
            _LIMIT.warning(
                "shard failed",
                "an index shard failed, the prefix ends before its segments: %s",
                found.unavailable,
            )
        return True

    def _failed(self, exc: KVStoreError) -> None:
        """A lookup the index could not answer: counted and logged, a miss (None)."""
        if isinstance(exc, IndexScriptError):
            self._stats.index_script_errors += 1
            log.error(
                "the index rejected a lookup (a bug, not a fault), counting as a miss: %s", exc
            )
        elif isinstance(exc, IndexTimeoutError):
            self._stats.index_errors += 1
            self._stats.index_timeouts += 1
            _LIMIT.warning(
                "lookup slow",
                "a lookup ran past its time limit, counting as a miss (the prompt is "
                "computed; nothing stored is lost): %s",
                exc,
            )
        else:
            self._stats.index_errors += 1
            _LIMIT.warning("lookup failed", "lookup failed, counting as a miss: %s", exc)
        return None

"""Prefix lookups: how much of a prompt is stored, and where (``PrefixLookup``); what a
lookup found, for fetching it later, is a ``StoredPrefix`` (``client.lookups.stored_prefix``).

One path for both clients, written once: each lookup is steps (``find_steps``,
``find_joined_steps``, ``stored_each_steps``, ``lookup_steps``) that compose the index's
own (``kvstore.index.driver``: generators over batches of commands), and the caller
picks how they run at the edge: ``AsyncKVCacheClient`` awaits them on its event loop
(``on_loop``); ``KVCacheClient`` runs them in its caller's thread over an index
connection of its own (``blocking``: the hop to the loop and back cost 0.14 ms, a
third of a 16-block lookup). Neither edge adds a hop: the blocking one is the index's
own blocking driver. What is asked, how the answer is checked against the node list
and how a fault counts are written once, here. Neither reads the node registry on its
way: the node list comes from ``NodeDirectory``, which keeps it fresh in the
background."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

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
from kvstore.index.driver import Steps
from kvstore.index.lookups import LookupMethods
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
T = TypeVar("T")
P = ParamSpec("P")


@dataclass(frozen=True, slots=True)
class Ready(Generic[T]):
    """A lookup's answer known without asking the index (nothing to look up): the
    edges (``PrefixLookup.on_loop``, ``blocking``) return it as is, without driving the
    index (whose first call reads the shard map) or registering the namespace."""

    value: T


class PrefixLookup:
    """One job: answer how much of a prompt is stored and on which live replicas, in one
    index round trip. Index faults are misses: every lookup gives None when the index
    could not answer at all (counted in ``stats.index_errors``; a script the index
    rejects, a bug, in ``stats.index_script_errors`` and logged at ERROR), and a
    shorter prefix when one shard failed after others answered. The async methods run
    on the client's event loop; ``blocking`` in any thread."""

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

    # The lookups are written once, as steps over the index's command batches
    # (``kvstore.index.driver``) that compose its ``lookup_steps``; ``on_loop`` or
    # ``blocking`` drives them, and the flavour of index driving them is the only thing
    # that differs. Each takes the index first: the one whose steps it composes.

    def find_steps(
        self, index: LookupMethods, token_ids: Any, identity: Identity = None, *, last: bool = False
    ) -> Steps[StoredPrefix | None] | Ready[StoredPrefix]:
        """The stored prefix of ``token_ids`` (None on an index fault), hashed now (a
        keyed layout raises here). ``last``: the chain's pages are stored at some blocks
        only (a hybrid model's boundary states): the prefix up to the last block stored,
        whose page alone it holds (``IndexLookup.resolve``); every 64-block segment of
        the chain is read (``kvstore.pages.keys``), gaps or not."""
        return self.find_joined_steps(index, self.chain_hashes(token_ids, identity), last=last)

    def find_joined_steps(
        self,
        index: LookupMethods,
        joined: bytes,
        *,
        last: bool = False,
        place: ChainPlace = TOKEN_CHAIN,
        lease: bool = True,
    ) -> Steps[StoredPrefix | None] | Ready[StoredPrefix]:
        """``find_steps`` of a chain's storage hashes, joined (``chain_hashes``, or
        ``keyed_hashes`` for a keyed layout, placed as ``place`` says). ``lease``
        False: no read lease is taken (a question of existence, whose answer nobody
        fetches from: the prefix it returns holds a lease of 0, so a fetch from it asks
        the index again)."""
        lease_ms = None if lease else 0
        if not joined:  # nothing to ask
            return Ready(self.stored_prefix(joined, LookupResult.empty(), last, place))
        return self._found(index, joined, last, place, lease_ms)

    def _found(
        self,
        index: LookupMethods,
        joined: bytes,
        last: bool,
        place: ChainPlace,
        lease_ms: int | None,
    ) -> Steps[StoredPrefix | None]:
        asked = yield from self._asking(index, joined, (), last, place, lease_ms)
        result = None if asked is None else self._resolve(*asked, last)
        return None if result is None else self.stored_prefix(joined, result, last, place, lease_ms)

    def stored_each_steps(
        self, index: LookupMethods, joined: bytes
    ) -> Steps[np.ndarray | None] | Ready[np.ndarray]:
        """Per keyed page of ``joined`` (``keyed_hashes``), whether a live replica of this
        rank's share is stored, each on its own (no prefix: a page missing before it does
        not hide it), with no read lease; None on an index fault."""
        if not joined:  # nothing to ask
            return Ready(np.zeros(0, dtype=bool))
        return self._each(index, joined)

    def _each(self, index: LookupMethods, joined: bytes) -> Steps[np.ndarray | None]:
        asked = yield from self._asking(index, joined, (), True, UNPLACED, 0)
        return None if asked is None else self._present(*asked)

    def lookup_steps(
        self,
        index: LookupMethods,
        hashes: list[bytes] | bytes,
        breaks: Sequence[int] = (),
        *,
        last: bool = False,
        place: ChainPlace = TOKEN_CHAIN,
    ) -> Steps[LookupResult | None]:
        """The index's answer for ``hashes`` (chains start at 0 and at each of
        ``breaks``, placed as ``place`` says) with replicas of stale incarnations
        dropped; None on an index fault. ``last``: as ``find_steps``'."""
        asked = yield from self._asking(index, hashes, breaks, last, place)
        return None if asked is None else self._resolve(*asked, last)

    async def on_loop(
        self,
        steps: Callable[Concatenate[AsyncPageIndex, P], Steps[T | None] | Ready[T]],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> T | None:
        """``steps(index, *args, **kwargs)`` on the client's event loop over its own
        index, registering the namespace first while that has not succeeded. Callers:
        ``AsyncKVCacheClient``, the page reads, and ``KVCacheClient`` until the
        namespace is registered. An index fault is None (``_failed``), never raised;
        a lookup with nothing to ask (``Ready``) neither registers nor asks."""
        index = self._index
        asked = steps(index, *args, **kwargs)
        if isinstance(asked, Ready):
            return asked.value
        await self._registration.ensure()
        try:
            return await index.drive(asked)
        except (RemoteFault, IndexScriptError) as exc:
            self._failed(exc)
            return None

    def blocking(
        self,
        index: PageIndex,
        steps: Callable[Concatenate[PageIndex, P], Steps[T | None] | Ready[T]],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> T | None:
        """``on_loop`` in the caller's thread over ``index`` (its reads bound its wait),
        for a registered namespace: no hop to the client's loop and back, which cost
        0.14 ms, a third of a 16-block lookup (``KVCacheClient.find``). Any thread."""
        asked = steps(index, *args, **kwargs)
        if isinstance(asked, Ready):
            return asked.value
        try:
            return index.drive(asked)
        except (RemoteFault, IndexScriptError) as exc:
            self._failed(exc)
            return None

    def _present(self, found: IndexLookup, nodes: list[NodeInfo]) -> np.ndarray | None:
        """``found.present``, or None when the index could not answer (``_answered``)."""
        return found.present(nodes) if self._answered(found) else None

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
        return await self.on_loop(
            self.lookup_steps, found.joined, last=found.last, place=found.place
        )

    def _asking(
        self,
        index: LookupMethods,
        hashes: list[bytes] | bytes,
        breaks: Sequence[int],
        sparse: bool = False,
        place: ChainPlace = TOKEN_CHAIN,
        lease_ms: int | None = None,
    ) -> Steps[tuple[IndexLookup, list[NodeInfo]]]:
        """The index call of a lookup, composed (``index.lookup_steps``): its answer and
        the nodes to check it against. ``sparse``: every segment read (a ``last``
        lookup's chain has gaps). The nodes are the directory's list
        (``NodeDirectory.fresh``) or, when that went stale while the client was idle
        (``KEEP_FRESH_S``), the registry read in the lookup's own round trip, sent at
        ``at`` (``NodeDirectory.offered``): through the client's loop and a round trip of
        its own, that read made the first lookup after more than 5 s of quiet 2-4 ms
        (bench/lookup.py, paused lookups). Raises what the index raised (the edge,
        ``on_loop`` or ``blocking``, makes a fault None)."""
        self._stats.lookups += 1
        nodes, at = self._nodes.fresh(), time.monotonic()
        # the same question either way; only what comes back with it differs
        asked: dict[str, Any] = {
            "breaks": breaks,
            "units": self._units,
            "sparse": sparse,
            "segment_pages": place.span,
            "offset": place.offset,
            "head_anchor": place.head_anchor,
            "lease_ms": lease_ms,
        }
        if nodes is not None:
            found = yield from index.lookup_steps(self._storage, hashes, **asked)
            return found, nodes
        found, read = yield from index.lookup_with_nodes_steps(self._storage, hashes, **asked)
        return found, self._nodes.offered(read, at)

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

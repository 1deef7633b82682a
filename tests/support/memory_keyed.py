"""The memory store's keyed calls (``KeyedCalls``, mixed into
``tests.support.memory_store.MemoryClient``): pages of a keyed layout, named by an
engine's own page keys (SGLang's HiCache keys), as ``client.sglang.store.KeyedStore``
asks for them, so the HiCache backend runs against real page bytes with no storage
node and no index (tests/support/sglang_memory_checks.py).

Not a mock: a key's page is kept under the storage hash the real client gives it
(``PrefixLookup.keyed_hashes``: ``kvstore.pages.hashing.keyed_hash_bytes`` over the
namespace's storage, split as ``client.puts.writes`` splits it; a rank's unit of it,
``heads.unit_hashes``, where its head group is not the first), beside the store's
token-chained pages. ``find_keys`` answers with the longest stored prefix of the keys
(an unplaced chain: every key its own one-page segment, as the backend asks), holding
no read lease when asked without one; a get of it (``get_found_into``) runs by plan
through ``MemoryClient.read``, so a page evicted since the lookup
(``MemoryStore.evict_on_read``) ends the prefix there. ``put_keyed`` keeps each span's
bytes, a page held already unsent (its first bytes stay), as a node does.
``stored_keys`` answers key by key. The index ``down`` or slower than the caller's
timeout answers None, as for token lookups."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from client.gets.plan import spans_plan
from client.gets.views import blocking_view
from client.lookups.stored_prefix import StoredPrefix
from client.memory.buffers import Span
from kvstore.errors import InvalidInputError
from kvstore.pages.hashing import keyed_hash_bytes, split_hashes
from kvstore.pages.heads import RankUnits
from kvstore.pages.keys import UNPLACED, ChainPlace
from kvstore.pages.namespace import Namespace

if TYPE_CHECKING:
    from tests.support.memory_store import MemoryStore

LEASE_MS = 60_000  # a keyed lookup's read lease, as a token lookup's


@dataclass(frozen=True)
class Stored:
    """A put's report (``client.vllm.store.PutOutcome``, ``client.sglang.store.KeyedPut``):
    every page is stored; ``bytes_sent``: the bytes of those not held before."""

    stored: int
    refused: int
    bytes_sent: int


class KeyedCalls:
    """``MemoryClient``'s keyed calls; what they use of it is declared below."""

    _store: MemoryStore
    _storage: Namespace
    _digest: bytes
    _heads: RankUnits
    keyed_finds: list[tuple[int, bool]]

    if TYPE_CHECKING:

        def _unanswered(self, timeout: float | None) -> bool: ...

        def _keys(self, chain: list[bytes]) -> list[bytes]: ...

        def _held(self, chain: list[bytes]) -> list[bool]: ...

        def _found(
            self, chain: list[bytes], last: bool, lease_ms: int = ..., place: ChainPlace = ...
        ) -> StoredPrefix: ...

    def keyed_chain(self, page_keys: list[str]) -> list[bytes]:
        """The storage hashes of ``page_keys``, as the real client's keyed calls name
        their pages (raises ``InvalidInputError`` for a layout keyed by tokens)."""
        return split_hashes(keyed_hash_bytes(self._storage, page_keys))

    def find_keys(
        self, page_keys: list[str], timeout: float | None = None, *, lease: bool = True
    ) -> StoredPrefix | None:
        """The longest stored prefix of ``page_keys`` (as ``KVCacheClient.find_keys``
        without positions); ``lease`` False: it holds a lease of 0, as the real one."""
        chain = self.keyed_chain(page_keys)
        self.keyed_finds.append((len(chain), lease))
        if self._unanswered(timeout):
            return None
        return self._found(chain, False, LEASE_MS if lease else 0, UNPLACED)

    # the real client's own view of the spans plan, read by ``MemoryClient.read``
    get_found_into = blocking_view(spans_plan)

    def put_keyed(self, page_keys: list[str], spans: list[Span]) -> Stored:
        """Store span ``spans[i]``'s bytes under ``page_keys[i]`` (as
        ``KVCacheClient.put_keyed`` without positions), a page held already unsent."""
        if len(spans) != len(page_keys):
            raise InvalidInputError(f"{len(spans)} spans for {len(page_keys)} page keys")
        if not self._heads.identity:
            raise InvalidInputError(
                f"put_keyed needs a rank whose page is one unit; this rank holds {self._heads.count}"
            )
        sent = 0
        # the rank's one unit of each page (unit 0, the page's hash, for TP=1)
        for page_hash, span in zip(self._keys(self.keyed_chain(page_keys)), spans, strict=True):
            if not self._store._has(self._digest, page_hash):
                page = _span_bytes(span)
                self._store._put(self._digest, page_hash, page)
                sent += len(page)
        return Stored(len(page_keys), 0, sent)

    def stored_keys(self, page_keys: list[str], timeout: float | None = None) -> list[bool] | None:
        """Per key of ``page_keys``, whether its page is stored, each on its own (as
        ``KVCacheClient.stored_keys``); None when the index would not answer."""
        if not page_keys:
            return []
        if self._unanswered(timeout):
            return None
        return self._held(self.keyed_chain(page_keys))


def _span_bytes(span: Span) -> bytes:
    """A span's page: its view's bytes, or its pieces' one after another."""
    held = span.bytes()
    pieces = held if isinstance(held, tuple) else (held,)
    return b"".join(np.ascontiguousarray(p).tobytes() for p in pieces)

"""The store as the HiCache backend sees it, one namespace at a time: ``KeyedStore``,
the calls ``client.sglang.backend.KVStoreHiCache`` and ``client.sglang.pool_calls``
make of a registered pool's store (lookups, gets and puts by SGLang's own page keys,
a keyed layout's), and ``KeyedStoreOpener``, which opens one per namespace when SGLang
registers a pool.

``KVCacheClient`` satisfies it unchanged (``client_stores`` opens one per namespace,
the backend's default). An in-memory store that keeps real page bytes under the same
keyed hashes and answers by the same rules (``tests/support/memory_keyed.py``)
satisfies it too, so the backend's decisions are tested against SGLang's real host
pools with no storage node and no index.

What the backend reads of an answer (``StoredPrefix``): ``blocks``; the rest (hashes,
replicas, lease) goes back to the store's ``get_found_into``, which fetches with it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from client.lookups.stored_prefix import StoredPrefix
from client.memory.buffers import Span
from client.sync_client import KVCacheClient
from kvstore.pages.namespace import Namespace
from kvstore.settings.client import ClientOptions


class KeyedPut(Protocol):
    """What the backend reads of a put's report (``batch_set_v1``'s all or nothing)."""

    @property
    def stored(self) -> int:
        """Pages now stored (sent now, or there already)."""
        ...


class KeyedStore(Protocol):
    """One keyed namespace's pages (a registered host pool's), called from SGLang's
    prefetch and backup threads. Guarantees the backend relies on: a lookup is one
    answer for the whole batch (None when the index could not answer); a get lands the
    found prefix from its first page on and says how far it got; a put says how many
    pages are stored. A call may raise on a fault: ``PoolCalls`` makes that a miss."""

    def find_keys(self, page_keys: list[str], *, lease: bool = True) -> StoredPrefix | None:
        """The stored prefix of ``page_keys`` (SGLang's chained page hashes), each key
        its own one-page index segment; ``lease`` False: no read lease is taken (an
        existence question, never fetched from)."""
        ...

    def get_found_into(self, found: StoredPrefix, sinks: list[Span]) -> int:
        """The pages of ``found`` into ``sinks`` (one span per page, from the first),
        each checked; the tokens of the prefix that arrived (0 on a fault)."""
        ...

    def put_keyed(self, page_keys: list[str], spans: list[Span]) -> KeyedPut:
        """Store page ``spans[i]`` under ``page_keys[i]`` (pages stored already are
        not sent again)."""
        ...

    def stored_keys(self, page_keys: list[str]) -> list[bool] | None:
        """Per key, whether its page is stored, each on its own (no prefix), with no
        read lease; None when the index could not answer."""
        ...

    def close(self) -> None: ...


# Opens a registered pool's store (``KVStoreHiCache``'s ``stores``: a caller without
# storage nodes hands its own; None: ``client_stores`` with the extra config's options).
KeyedStoreOpener = Callable[[Namespace], KeyedStore]


def client_stores(options: ClientOptions) -> KeyedStoreOpener:
    """The backend's default opener: a ``KVCacheClient`` per namespace with the client
    options of SGLang's extra config (``client.sglang.options.hicache_options``)."""

    def open_client(namespace: Namespace) -> KeyedStore:
        return KVCacheClient(None, namespace, options=options)

    return open_client

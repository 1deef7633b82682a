"""The store as the connector's scheduler side sees it: ``PrefixStore``, what
``client.vllm.scheduler.ConnectorScheduler`` asks of the clients it looks up with (the
engine's pages, a speculative draft's, a state-space hybrid's boundary states).

``KVCacheClient`` satisfies it unchanged (the engine's). An in-memory store that keeps
real pages under the same chained hashes and answers by the same rules
(``tests/support/memory_store.py``) satisfies it too, so the scheduler's decisions are
tested against vLLM's real ``Scheduler`` in the fast tier, with no storage node.

What is read of an answer (``StoredPrefix``): ``blocks``, ``tokens`` and ``head``; the
rest (hashes, replicas, lease) goes to the workers, which fetch with it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from client.lookups.stored_prefix import StoredPrefix
from kvstore.pages.identity import BlockExtras, RequestIdentity
from kvstore.pages.namespace import Namespace


class PrefixStore(Protocol):
    """One storage namespace's prefix lookups, made in the caller's thread."""

    @property
    def namespace(self) -> Namespace:
        """The namespace whose pages it finds (the scheduler's: the storage view of
        every head group)."""
        ...

    def find(
        self,
        token_ids: Any,
        timeout: float | None = None,
        *,
        identity: RequestIdentity | BlockExtras | None = None,
        last: bool = False,
    ) -> StoredPrefix | None:
        """The longest stored prefix of ``token_ids``' full blocks, chained under
        ``identity``; None when the store could not answer within ``timeout`` seconds
        (the scheduler counts it a miss, and its breaker a fault). ``last``: the chain is
        stored at some blocks only (a hybrid's boundary states): the prefix up to the
        last block stored, whose page alone it holds."""
        ...

    def close(self) -> None: ...


# Opens the scheduler's store of a namespace (``KVStoreConnector``'s ``stores``: a
# caller without storage nodes hands its own; None: a ``KVCacheClient`` per namespace).
StoreOpener = Callable[[Namespace], PrefixStore]

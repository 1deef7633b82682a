"""The store as the connector sees it, one namespace at a time:

- ``PrefixStore``: what ``client.vllm.scheduler.ConnectorScheduler`` asks of the
  stores it looks up in (the engine's pages, a speculative draft's, a state-space
  hybrid's boundary states);
- ``PageStore``: what ``client.vllm.worker.ConnectorWorker`` and its parts ask of the
  stores it loads from and saves to: lookups (a P/D decode's waits), gets by plan
  (``client.paging.page_source.PageSource``, the load path's), puts, pins, counters.

``KVCacheClient`` satisfies both unchanged. An in-memory store that keeps real pages
under the same chained hashes, answers by the same rules and lands real bytes where a
get's plan says (``tests/support/memory_store.py``) satisfies both too, so the
scheduler's and the worker's decisions are tested against vLLM's real ``Scheduler`` in
the fast tier, with no storage node.

What the scheduler reads of an answer (``StoredPrefix``): ``blocks``, ``tokens`` and
``head``; the rest (hashes, replicas, lease) goes to the workers, which fetch with it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from client.lookups.stored_prefix import StoredPrefix
from client.paging.page_source import PageSource
from client.stats import ClientStats
from kvstore.control.reports import ControlReport
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


class PutOutcome(Protocol):
    """What the saver reads of a put's report (``client.vllm.saver``)."""

    @property
    def stored(self) -> int:
        """Pages now stored (sent now, or there already)."""
        ...

    @property
    def refused(self) -> int:
        """Pages no node took: a future miss."""
        ...

    @property
    def bytes_sent(self) -> int: ...


class PageStore(PrefixStore, PageSource, Protocol):
    """One namespace's pages as a worker uses them (its rank's share): ``find`` (a P/D
    decode's waits, ``client.vllm.remote_prefill``), ``read`` (loads, by plan), and the
    calls below. Called from the worker's engine, loader, saver and pin threads."""

    @property
    def stats(self) -> ClientStats:
        """The store's own counters (the worker reports the device landings')."""
        ...

    @property
    def call_limit(self) -> float:
        """Seconds within which any call returns (bounds a layer-wise load's waits)."""
        ...

    def put_pages(
        self,
        token_ids: Any,
        pages: torch.Tensor,
        *,
        identity: RequestIdentity | BlockExtras | None = None,
        start_block: int = 0,
    ) -> PutOutcome:
        """Store ``pages`` (``[n, *page_shape]``) as the full blocks ``start_block`` on
        of ``token_ids`` under ``identity``."""
        ...

    def pin(
        self,
        token_ids: Any,
        *,
        identity: RequestIdentity | BlockExtras | None = None,
        ttl_s: float | None = None,
    ) -> ControlReport:
        """Keep the stored pages of ``token_ids``' full blocks (``client.vllm.pins``)."""
        ...


# Opens a worker's store of a namespace (``KVStoreConnector``'s ``stores``, as for the
# scheduler: a caller without storage nodes hands its own; None: a ``KVCacheClient``).
PageStoreOpener = Callable[[Namespace], PageStore]

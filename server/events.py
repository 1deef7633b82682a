"""A storage node's KV events: what its page table gains and loses, per tier, in
vLLM's event format (kvstore.events), so cache-aware routers see the store.

The page table (server/store.py) tells a ``PageEvents`` of every change of where a
page's copies lie, page by page, as it makes the change:

- a put's page became ready in memory, or a page was read back from disk into memory:
  stored, medium "CPU";
- a page's record was written to disk (a demotion, write-back or write-through), or
  was found on disk at start: stored, "DISK";
- a page's memory copy was freed while its disk copy stays (the second half of a
  demotion): removed, "CPU";
- a page left the node (evicted through the retirer, purged as corrupt) or lost its
  disk copy: removed, from each tier it was in.

``NodeEvents`` gathers those calls and hands them to the publisher once per turn of
the event loop (``call_soon``), as few events as the order allows: consecutive pages of
one kind, tier and model go into one event. The table is never slowed by a subscriber:
the publisher's queue is bounded and drops (counted) instead of waiting.

Block hashes are the store's page keys (16 bytes; their last 8 as an integer under
``--kv-events-profile dynamo``, kvstore.events.profiles): for a namespace stored in head or
layer groups each unit of a block is a page of its own, and is announced as a block
(the units of a block carry the same tokens). ``token_ids`` are those the put carried
(an optional field of the put: ``KVCacheClient.put_pages`` sends them to nodes that
advertise ``put_tokens``), ``block_size`` per block; a run of pages of which one came
without them (an older client, another put path, a page recovered from disk: records
do not keep them) is announced with none. ``parent_block_hash`` is None: a put's pages
are not always one chain (docs/router-integration.md says what a router does with
such events)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Protocol

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstore.events import (
    MEDIUM_CPU,
    MEDIUM_DISK,
    PROFILES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventProfile,
    EventPublisher,
    KVCacheEvent,
    PublisherOptions,
    pool_topic,
    tenant_prefix,
)
from kvstore.events.access import CurveKeys, EventAccess
from kvstore.pages.namespace import Namespace
from kvstore.security.routers import load_key_pair, router_keys
from kvstore.settings.events import EventSettings
from server.page import StoredPage

STORED, REMOVED = True, False


class PageEvents(Protocol):
    """What the page table tells of each change of where a page's copies lie. Called
    on the node's event loop (or before it runs, at recovery), never waits."""

    def stored(self, page: StoredPage, medium: str) -> None:
        """``page`` now has a copy in ``medium``."""

    def removed(self, page: StoredPage, medium: str) -> None:
        """``page`` no longer has a copy in ``medium``."""


class NoEvents(PageEvents):
    """A node without ``--kv-events-endpoint``: the table's calls cost a method call."""

    def stored(self, page: StoredPage, medium: str) -> None:
        return None

    def removed(self, page: StoredPage, medium: str) -> None:
        return None


class NodeEvents(PageEvents):
    """Publishes the page table's changes as vLLM KV events under
    ``kv@pool:<store id>:<tenant>@<model>``, a topic per tenant and model. Built by the
    node at start when events are on (binding raises ``zmq.ZMQError`` there); ``close``
    at shutdown. With ``access`` the stream is authenticated and each router reads
    only its tenants' topics (kvstore.events.access). Blocks of a tenant outside
    ``token_tenants`` (None: every tenant) are announced with block hashes only.
    ``profile`` shapes hashes and marks for the routers that read the stream
    (kvstore.events.profiles).

    Guarantees: events come out in the order the table made the changes; a page's
    stored event for a tier comes before its removed event for that tier; events that
    do not fit the bounded queue are dropped whole, counted in
    ``kvstore_events_dropped_total``, and the sequence numbers show the gap."""

    def __init__(
        self,
        options: PublisherOptions,
        store_id: str,
        models: Callable[[str], Namespace | None],
        registry: CollectorRegistry,
        *,
        token_tenants: frozenset[str] | None = None,
        access: EventAccess | None = None,
        profile: EventProfile = PROFILES["vllm"],
    ) -> None:
        pool_topic(store_id, "m")  # the store id's own check, before anything binds
        self.publisher = EventPublisher(options, access)
        self.store_id = store_id
        self.token_tenants = token_tenants
        self.profile = profile
        self._models = models  # namespace digest -> its Namespace, when the node knows it
        self._pending: list[tuple[bool, str, StoredPage]] = []
        self._scheduled = False
        self._topics: dict[str, str] = {}  # namespace digest -> topic
        registry.register(_EventCollector(self.publisher))

    # ---- the page table's calls --------------------------------------------------------

    def stored(self, page: StoredPage, medium: str) -> None:
        self._add(STORED, medium, page)

    def removed(self, page: StoredPage, medium: str) -> None:
        self._add(REMOVED, medium, page)

    def _add(self, kind: bool, medium: str, page: StoredPage) -> None:
        self._pending.append((kind, medium, page))
        if self._scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # recovery, before the loop runs: the node flushes once it starts
        self._scheduled = True
        loop.call_soon(self.flush)

    # ---- the node's calls ---------------------------------------------------------------

    def flush(self) -> None:
        """Hand what the table told since the last flush to the publisher, grouped into
        as few events as the order allows (one ``publish`` per topic run)."""
        self._scheduled = False
        pending, self._pending = self._pending, []
        run: list[KVCacheEvent] = []
        run_topic = ""
        for digest, kind, medium, group in _groups(pending):
            topic = self._topic(digest)
            hashes = self.profile.hashes([p.key[1] for p in group])
            if run and topic != run_topic:
                self.publisher.publish(run, run_topic)
                run = []
            run_topic = topic
            if kind is STORED:
                run.append(
                    BlockStored(
                        block_hashes=hashes,
                        parent_block_hash=None,
                        token_ids=self._tokens(digest, group),
                        block_size=self._block_size(digest),
                        lora_id=None,
                        medium=medium,
                        lora_name=None,
                        ownership=self.profile.ownership,
                    )
                )
            else:
                run.append(
                    BlockRemoved(
                        block_hashes=hashes, medium=medium, ownership=self.profile.ownership
                    )
                )
        if run:
            self.publisher.publish(run, run_topic)

    def cleared(self, spaces: list[tuple[str, str]]) -> None:
        """The node started without the pages a previous run held (no disk tier, or an
        empty one): ``AllBlocksCleared`` under each (tenant, model)'s topic, so a router
        forgets what this store id announced before."""
        for tenant, model in sorted(set(spaces)):
            self.publisher.publish(
                [AllBlocksCleared()], pool_topic(self.store_id, _topic_model(model), tenant)
            )

    def close(self) -> None:
        self.flush()
        self.publisher.close()

    def _tokens(self, digest: str, pages: list[StoredPage]) -> list[int]:
        """The token ids of ``pages``' blocks when their tenant lets routers see them
        (else none: the blocks are announced by hash only)."""
        ns = self._models(digest)
        if ns is None or not (self.token_tenants is None or ns.tenant in self.token_tenants):
            return []
        return _tokens(pages, ns.block_size)

    def _block_size(self, digest: str) -> int:
        """Tokens per page of the namespace (0 while the node has not learnt it)."""
        ns = self._models(digest)
        return ns.block_size if ns is not None else 0

    def _topic(self, digest: str) -> str:
        topic = self._topics.get(digest)
        if topic is None:
            ns = self._models(digest)
            # a namespace the node has not learnt (a page recovered from disk before any
            # put of it) is published under its digest, a topic of no tenant (only
            # routers reading every tenant get it); not cached, so the tenant's topic
            # is used once the node learns it
            if ns is None:
                return pool_topic(self.store_id, digest)
            topic = self._topics[digest] = pool_topic(
                self.store_id, _topic_model(ns.model), ns.tenant
            )
        return topic


def _topic_model(model: str) -> str:
    """A model name fit for the topic: "@" separates the topic's parts."""
    return model.replace("@", "_")


def _groups(
    pending: list[tuple[bool, str, StoredPage]],
) -> Iterator[tuple[str, bool, str, list[StoredPage]]]:
    """Runs of consecutive changes of one kind, medium and namespace, as (namespace
    digest, kind, medium, pages)."""
    key: tuple[bool, str, str] | None = None
    pages: list[StoredPage] = []
    for kind, medium, page in pending:
        k = (kind, medium, page.key[0])
        if k != key:
            if key is not None:
                yield key[2], key[0], key[1], pages
            key, pages = k, []
        pages.append(page)
    if key is not None:
        yield key[2], key[0], key[1], pages


def _tokens(pages: list[StoredPage], block_size: int) -> list[int]:
    """The token ids of ``pages``' blocks, page after page, when every page has its
    block's ``block_size`` of them; else none (a partial list would name other blocks)."""
    width = 4 * block_size
    if not block_size or any(len(p.tokens) != width for p in pages):
        return []
    return np.frombuffer(b"".join(p.tokens for p in pages), dtype="<u4").tolist()


def event_access(s: EventSettings, store_id: str) -> EventAccess | None:
    """The routers' rights over the node's topics with ``--kv-events-routers-file``
    (an open stream without it). Called by the node at start; a key file that does not
    load raises ``InvalidInputError`` naming it."""
    if not s.kv_events_routers_file or not s.kv_events_key_file:
        return None
    public, secret = load_key_pair(s.kv_events_key_file, "--kv-events-key-file")
    return EventAccess(
        CurveKeys(public, secret),
        router_keys(s.kv_events_routers_file),
        lambda tenant: tenant_prefix(store_id, tenant),
    )


class _EventCollector(Collector):
    """The publisher's counts on /metrics, read at scrape time."""

    def __init__(self, publisher: EventPublisher) -> None:
        self.publisher = publisher

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s = self.publisher.stats()
        yield CounterMetricFamily(
            "kvstore_events_published", "KV events sent to subscribers", value=s.published_events
        )
        yield CounterMetricFamily(
            "kvstore_events_dropped",
            "KV events dropped because the bounded queue was full (the sequence shows the gap)",
            value=s.dropped_events,
        )
        yield CounterMetricFamily(
            "kvstore_events_batches", "KV event batches (messages) sent", value=s.published_batches
        )
        yield GaugeMetricFamily(
            "kvstore_events_queued", "KV events waiting to be sent", value=s.queued_events
        )
        refused = CounterMetricFamily(
            "kvstore_events_refused",
            "event-stream refusals: handshake (no or a broken CURVE handshake), key (a key no "
            "router holds), subscription (topics of no tenant the router reads)",
            labels=["reason"],
        )
        refused.add_metric(["handshake"], s.refused_handshakes)
        refused.add_metric(["key"], s.refused_keys)
        refused.add_metric(["subscription"], s.refused_subscriptions)
        yield refused
        yield CounterMetricFamily(
            "kvstore_events_rebinds",
            "times a narrowed routers file made every router authenticate again",
            value=s.rebinds,
        )


__all__ = ["MEDIUM_CPU", "MEDIUM_DISK", "NoEvents", "NodeEvents", "PageEvents", "event_access"]

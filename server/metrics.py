"""Prometheus metrics of one storage node, in a registry of its own.

Names follow Prometheus conventions (``_total`` counters, ``_bytes``/``_seconds`` units).
docs/operations.md ("Metrics, probes and alerts") lists every series; the chart's dashboard and alerts
(helm/kvstore/files/) use only these, which tests/deploy/test_helm.py checks."""

from __future__ import annotations

import platform
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from server.store import PageStore

_LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
)


class _Limits(Protocol):
    """The data plane's request limits, as far as a gauge reads them."""

    @property
    def connections(self) -> int: ...


class PlaneGauges(Protocol):
    """What the data plane's gauges read (server/dataplane/plane.py's DataPlane)."""

    active: int  # requests being served
    connections: dict[str, int]  # open connections, by path

    @property
    def limits(self) -> _Limits: ...


class DiskGauges(Protocol):
    """What the disk tier's gauges read (server/disk/tier.py's DiskTier)."""

    @property
    def pages(self) -> int: ...
    @property
    def used_bytes(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def degraded(self) -> str: ...
    @property
    def direct_io(self) -> bool: ...


class NodeMetrics:
    """Counters are incremented by the data plane; gauges read live state through
    ``watch`` when scraped, so they are never stale."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.capacity = Gauge("kvstore_capacity_bytes", "Bytes of page memory", registry=r)
        self.used = Gauge("kvstore_used_bytes", "Bytes of slots holding pages", registry=r)
        self.pages = Gauge("kvstore_pages", "Pages stored and visible", registry=r)
        self.pins = Gauge(
            "kvstore_pinned_pages", "Page pins held by transfers and puts in progress", registry=r
        )
        self.in_flight = Gauge("kvstore_requests_in_flight", "Requests being served", registry=r)
        self.puts = Counter("kvstore_put_pages", "Pages stored by PUT requests", registry=r)
        self.put_skipped = Counter(
            "kvstore_put_skipped_pages", "Offered pages already stored", registry=r
        )
        self.gets = Counter("kvstore_get_pages", "Pages sent by GET requests", registry=r)
        self.slot_reads = Counter(
            "kvstore_slot_read_pages",
            "Pages same-host clients copied straight from their slots, told afterwards "
            "(SLOT_READS; also in kvstore_get_pages)",
            registry=r,
        )
        self.get_missing = Counter(
            "kvstore_get_missing_pages", "Requested pages not held", registry=r
        )
        self.received_bytes = Counter(
            "kvstore_received_bytes", "Payload bytes received (puts)", registry=r
        )
        self.sent_bytes = Counter("kvstore_sent_bytes", "Payload bytes sent (gets)", registry=r)
        self.requests = Counter(
            "kvstore_transfer_requests",
            "PUT and GET requests served, and SLOT_READS notices taken, by data path",
            ["op", "path"],
            registry=r,
        )
        self.messages = Counter(
            "kvstore_payload_messages", "UCX payload messages", ["direction"], registry=r
        )
        self.evictions = Counter("kvstore_evicted_pages", "Pages evicted", registry=r)
        self.refused = Counter(
            "kvstore_refused_pages",
            "Pages refused for lack of space, over a request's byte limit, or over their tenant's quota",
            registry=r,
        )
        self.quota_refused = Counter(
            "kvstore_quota_refused_pages",
            "Pages refused because their tenant held its quota in pages it could not evict (leased)",
            registry=r,
        )
        self.corrupt = Counter(
            "kvstore_corrupt_pages", "Received pages with a wrong checksum", registry=r
        )
        self.errors = Counter("kvstore_errors", "Failed requests by kind", ["kind"], registry=r)
        self.connections = Gauge(
            "kvstore_connections", "Open client connections, by data path", ["path"], registry=r
        )
        self.connection_budget = Gauge(
            "kvstore_connection_budget",
            "Client connections admitted at once, both paths together (--max-connections)",
            registry=r,
        )
        self.connections_refused = Counter(
            "kvstore_connections_refused",
            "Client connections closed by the node: over the budget, "
            "no request within the frame timeout, or answered unauthorized",
            ["reason"],
            registry=r,
        )
        self.accept_errors = Counter(
            "kvstore_accept_errors",
            "Failed accepts on the same-host Unix socket (EMFILE and the like); the listener backs off and retries",
            registry=r,
        )
        self.handshake_failures = Counter(
            "kvstore_handshake_failures",
            "UCX connections that failed in ucxx's handshake (a client that went away while connecting)",
            registry=r,
        )
        self.latency = Histogram(
            "kvstore_request_seconds",
            "Request latency",
            ["op"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        # the disk tier (server/disk/); all zero on a node without one
        self.tier_pages = Gauge(
            "kvstore_tier_pages",
            "Ready pages with a copy in the tier (a page may be in both)",
            ["tier"],
            registry=r,
        )
        self.tier_bytes = Gauge(
            "kvstore_tier_used_bytes",
            "Bytes of slots holding pages in the tier",
            ["tier"],
            registry=r,
        )
        self.tier_capacity = Gauge(
            "kvstore_tier_capacity_bytes", "Bytes the tier may hold", ["tier"], registry=r
        )
        self.hits = Counter(
            "kvstore_tier_hit_pages",
            "Pages sent by GET requests, by the tier they were found in (disk: read back first)",
            ["tier"],
            registry=r,
        )
        self.demoted = Counter(
            "kvstore_demoted_pages",
            "Pages written to the disk tier (write-back demotion or write-through)",
            registry=r,
        )
        self.promoted = Counter(
            "kvstore_promoted_pages", "Pages read back from disk into memory for a get", registry=r
        )
        self.released = Counter(
            "kvstore_memory_released_pages", "Pages that left memory and stayed on disk", registry=r
        )
        self.disk_evicted = Counter(
            "kvstore_disk_evicted_pages",
            "Disk copies freed for space (a page only on disk also leaves the index)",
            registry=r,
        )
        self.disk_read_bytes = Counter(
            "kvstore_disk_read_bytes", "Bytes read from the disk tier", registry=r
        )
        self.disk_written_bytes = Counter(
            "kvstore_disk_written_bytes", "Bytes written to the disk tier", registry=r
        )
        self.disk_read_seconds = Histogram(
            "kvstore_disk_read_seconds",
            "Time of one record read from disk (queue included)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.disk_write_seconds = Histogram(
            "kvstore_disk_write_seconds",
            "Time of one record write to disk (queue included)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.disk_errors = Counter(
            "kvstore_disk_errors",
            "Disk tier failures: io (EIO and the like), nospace (ENOSPC, EFBIG), "
            "checksum (a record that failed its check: dropped)",
            ["kind"],
            registry=r,
        )
        self.disk_degraded = Gauge(
            "kvstore_disk_degraded",
            "1 while the disk tier's writes are stopped after an error (the node serves from memory)",
            registry=r,
        )
        self.disk_direct_io = Gauge(
            "kvstore_disk_direct_io",
            "1 when the disk tier uses O_DIRECT, 0 when the filesystem refused it (buffered I/O)",
            registry=r,
        )
        self.free_slabs = Gauge("kvstore_free_slabs", "Slabs serving no tenant yet", registry=r)
        self.index_up = Gauge(
            "kvstore_index_up",
            "1 while the last heartbeat reached the index within the node TTL",
            registry=r,
        )
        self.heartbeat_age = Gauge(
            "kvstore_heartbeat_age_seconds",
            "Seconds since the last heartbeat reached the index",
            registry=r,
        )
        self.loop_lag = Gauge(
            "kvstore_event_loop_lag_seconds",
            "How late the event loop ran its last watchdog tick",
            registry=r,
        )
        build = Gauge(
            "kvstore_build_info",
            "Versions of this node (value 1)",
            ["version", "python", "ucxx"],
            registry=r,
        )
        build.labels(_version("kvstore"), platform.python_version(), _version("ucxx-cu12")).set(1)
        ProcessCollector(
            registry=r
        )  # process_resident_memory_bytes, process_cpu_seconds_total, ...
        # Export every labelled series from the start so dashboards see zeros, not gaps.
        for op in ("put", "get"):
            self.latency.labels(op)
            for path in ("ucx", "shm"):
                self.requests.labels(op, path)
        self.requests.labels("slot_reads", "shm")  # same-host notices (SLOT_READS)
        for kind in (
            "protocol",
            "descriptors",
            "transfer",
            "auth",
            "forbidden",
            "too_large",
            "index_script",
        ):
            self.errors.labels(kind)
        for reason in ("budget", "idle", "unauthorized"):
            self.connections_refused.labels(reason)
        for direction in ("in", "out"):
            self.messages.labels(direction)
        for tier in ("memory", "disk"):
            for family in (self.hits, self.tier_pages, self.tier_bytes, self.tier_capacity):
                family.labels(tier)
        for kind in ("io", "nospace", "checksum"):
            self.disk_errors.labels(kind)

    def watch(self, store: PageStore, dataplane: PlaneGauges) -> None:
        """Read the gauges from the node's page table and data plane at scrape time
        (plain int attributes, safe to read from the HTTP thread)."""
        self.free_slabs.set_function(lambda: store.allocator.free_slabs)
        self.used.set_function(lambda: store.used_bytes)
        self.pages.set_function(lambda: store.ready_pages)
        self.pins.set_function(lambda: store.pins)
        self.in_flight.set_function(lambda: dataplane.active)
        for path in ("ucx", "shm"):
            self.connections.labels(path).set_function(_reader(dataplane.connections, path))
        self.connection_budget.set_function(lambda: dataplane.limits.connections)
        self.tier_pages.labels("memory").set_function(lambda: store.memory_pages)
        self.tier_bytes.labels("memory").set_function(lambda: store.used_bytes)
        self.tier_capacity.labels("memory").set_function(lambda: store.capacity)

    def watch_disk(self, tier: DiskGauges) -> None:
        """The disk tier's gauges (server/disk/tier.py)."""
        self.tier_pages.labels("disk").set_function(lambda: tier.pages)
        self.tier_bytes.labels("disk").set_function(lambda: tier.used_bytes)
        self.tier_capacity.labels("disk").set_function(lambda: tier.capacity)
        self.disk_degraded.set_function(lambda: float(bool(tier.degraded)))
        self.disk_direct_io.set(float(tier.direct_io))


def _reader(counts: dict[str, int], key: str) -> Callable[[], int]:
    """A gauge's function: ``counts[key]`` when scraped."""
    return lambda: counts[key]


def _version(dist: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        return "unknown"

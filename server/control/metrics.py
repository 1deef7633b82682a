"""The control API's Prometheus series, in the node's registry (docs/operations.md lists them)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class ControlMetrics:
    """Pins held, clears, prefetches and refused pins of one node."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.pinned_pages = Gauge(
            "kvstore_operator_pinned_pages",
            "Pages pinned by an operator, per tenant",
            ["tenant"],
            registry=r,
        )
        self.pinned_bytes = Gauge(
            "kvstore_operator_pinned_bytes",
            "Bytes of memory slots pinned pages hold, per tenant",
            ["tenant"],
            registry=r,
        )
        self.pin_refused = Counter(
            "kvstore_pin_refused",
            "Pin requests refused, by the limit they would pass (share, quota)",
            ["limit"],
            registry=r,
        )
        self.cleared = Counter(
            "kvstore_cleared_pages",
            "Pages removed by clear requests, by scope (tenant, model, namespace, prefix)",
            ["scope"],
            registry=r,
        )
        self.prefetched = Counter(
            "kvstore_prefetched_pages",
            "Pages brought from disk into memory by prefetch",
            registry=r,
        )

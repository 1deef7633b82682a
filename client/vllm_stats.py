"""Connector statistics for vLLM's connector-stats interface and Prometheus.

``KVStoreConnectorStats`` is what ``KVStoreConnector.get_kv_connector_stats`` returns on
both sides (the scheduler counts lookups, each worker counts loads and saves); vLLM
aggregates the objects of one interval, logs ``reduce()`` and hands ``data`` to
``KVStorePromMetrics.observe``, which the engine's Prometheus logger created through
``KVStoreConnector.build_prom_metrics``. Every value in ``data`` is a sum over the
interval except ``lookup_seconds_list`` (one entry per lookup, for the histogram)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

# counter name -> what it counts (exported as vllm:kvstore_<name>_total)
COUNTERS = {
    "lookups": "index lookups the scheduler made",
    "lookup_prompt_tokens": "prompt tokens the scheduler asked the store about",
    "lookup_hit_tokens": "prompt tokens the store held",
    "lookup_faults": "lookups that failed or passed their budget (counted as misses)",
    "lookups_skipped": "lookups not made because the circuit breaker was open (misses)",
    "loads": "requests whose blocks were loaded",
    "load_bytes": "bytes loaded into the KV cache",
    "load_seconds": "seconds spent loading (fetch and scatter, off the engine step)",
    "load_failed_blocks": "blocks that failed to load and were recomputed",
    "saves": "requests whose blocks were published",
    "save_bytes": "bytes of pages handed to the store (pages it held already are not resent)",
    "save_seconds": "seconds spent publishing, in the background",
    "save_gather_seconds": "seconds the engine step spent copying blocks out for saves",
    "save_failures": "saves that failed (a future miss, not an error)",
    "saves_dropped": "saves skipped because too many bytes were waiting to be published",
}
_LOOKUP_BUCKETS = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0]


@dataclass
class KVStoreConnectorStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {name: 0 for name in COUNTERS} | {"lookup_seconds_list": []}

    def add(self, **counts: float) -> None:
        for name, value in counts.items():
            self.data[name] = self.data.get(name, 0) + value

    def observe_lookup(self, seconds: float) -> None:
        self.data.setdefault("lookup_seconds_list", []).append(seconds)

    def aggregate(self, other: KVConnectorStats) -> KVStoreConnectorStats:
        for name, value in other.data.items():
            if isinstance(value, list):
                self.data.setdefault(name, []).extend(value)
            else:
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {name: round(d.get(name, 0), 4) for name in COUNTERS if d.get(name)}
        lookups = d.get("lookup_seconds_list") or []
        if lookups:
            out["lookup_ms_max"] = round(max(lookups) * 1000, 2)
        if d.get("lookup_prompt_tokens"):
            out["hit_rate"] = round(d.get("lookup_hit_tokens", 0) / d["lookup_prompt_tokens"], 3)
        if d.get("load_seconds"):
            out["load_GBps"] = round(d.get("load_bytes", 0) / d["load_seconds"] / 1e9, 2)
        return out

    def is_empty(self) -> bool:
        return not any(v for v in self.data.values())


class KVStorePromMetrics(KVConnectorPromMetrics):
    """``vllm:kvstore_*`` counters and a lookup-latency histogram, per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            name: create_metric_per_engine(
                self._counter_cls(name=f"vllm:kvstore_{name}", documentation=doc, labelnames=labelnames),
                per_engine_labelvalues,
            )
            for name, doc in COUNTERS.items()
        }
        self.lookup_seconds = create_metric_per_engine(
            self._histogram_cls(name="vllm:kvstore_lookup_seconds", documentation="scheduler lookup latency, faults included",
                                buckets=_LOOKUP_BUCKETS, labelnames=labelnames),
            per_engine_labelvalues,
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if name in self.counters and value:
                self.counters[name][engine_idx].inc(value)
        for seconds in transfer_stats_data.get("lookup_seconds_list") or ():
            self.lookup_seconds[engine_idx].observe(seconds)

"""Connector statistics for vLLM's connector-stats interface and Prometheus.

``KVStoreConnectorStats`` is what ``KVStoreConnector.get_kv_connector_stats`` returns on
both sides (the scheduler counts lookups, each worker counts loads and saves); vLLM
aggregates the objects of one interval, logs ``reduce()`` and hands ``data`` to
``KVStorePromMetrics.observe``, which the engine's Prometheus logger created through
``KVStoreConnector.build_prom_metrics``. Every value in ``data`` is a sum over the
interval except the ``HISTOGRAMS``, which are lists of seconds, one per lookup, load,
save or gather."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, ClassVar, cast

from prometheus_client import Counter, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from client.log_limit import LogLimit
from client.stats import ClientStats
from kvstore.errors import CredentialError

# counter name -> what it counts (exported as vllm:kvstore_<name>_total)
COUNTERS = {
    "lookups": "index lookups the scheduler made",
    "lookup_prompt_tokens": "prompt tokens the scheduler asked the store about",
    "lookup_hit_tokens": "prompt tokens the store held",
    "lookup_faults": "lookups that failed or passed their budget (counted as misses)",
    "lookups_skipped": "lookups not made because the circuit breaker was open (misses)",
    "load_bytes": "bytes loaded into the KV cache",
    "load_failed_blocks": "blocks that failed to load and were recomputed",
    "save_bytes": "bytes of pages handed to the store (pages it held already are not resent)",
    "save_failures": (
        "saves not wholly stored: no live node, nodes failing or refusing, the index down"
        " (a future miss, not an error)"
    ),
    "saves_dropped": "saves skipped because too many bytes were waiting to be published",
    "unkeyed_requests": (
        "requests neither looked up nor saved because vLLM keys them by something kvstore"
        " cannot express (logged once per reason)"
    ),
    "credential_refusals": (
        "loads and saves every node refused for the engine's token (misses; a configuration"
        " error, logged at ERROR at most once a minute)"
    ),
    "device_loads": (
        "loads whose pages went straight from a same-host node's memory into GPU memory,"
        " checked on the GPU"
    ),
    "host_register_failures": (
        "node slabs the GPU could not register: their pages copy at pageable speed"
        " (logged once per worker)"
    ),
    "slot_read_misses": (
        "pages a GPU load read straight from the slots the index named that failed their"
        " check (moved or evicted since), and came again through the node's plan"
    ),
    "remote_prefills_announced": (
        "decode requests whose prefill engine announced its KV (P/D kv_transfer_params):"
        " claimed at once and waited for, not looked up"
    ),
    "remote_prefills_in_time": "announced prefixes wholly stored within remote_prefill_wait_ms",
    "remote_prefill_deadline_misses": (
        "announced prefixes not wholly stored within remote_prefill_wait_ms: what had"
        " arrived was loaded, the rest recomputed"
    ),
    "remote_prefill_recomputed_tokens": "tokens of announced prefixes recomputed (not stored in time)",
    "remote_prefill_mismatches": (
        "announcements a decode could not wait for (another block size, prompt or identity,"
        " or malformed): looked up as any request"
    ),
    "remote_prefill_lookups": "index lookups made while waiting for announced prefixes",
    "pins": (
        "prompt prefixes pinned in the storage nodes' memory once saved (kv_transfer_params"
        " kvstore_pin), by each worker"
    ),
    "pin_failures": (
        "pins that failed (no node answered, refused, the index down): logged, the request"
        " unaffected, its pages evictable"
    ),
    "event_blocks": "blocks announced in BlockStored KV events (engines publishing KV events only)",
    "events_withheld": "saves announced in no KV event because some rank's pages were not all stored",
}
# histogram name -> (what one observation is, buckets); data[name] is a list of seconds
HISTOGRAMS = {
    "lookup_seconds": (
        "one scheduler lookup, faults included",
        [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0],
    ),
    "load_seconds": (
        "one request's load: fetch and scatter, off the engine step",
        [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0],
    ),
    "save_seconds": (
        "one request's publish, on the saver thread",
        [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0],
    ),
    "remote_prefill_wait_seconds": (
        "one announced prefix's wait: from the decode's worker getting the load to the"
        " pages stored (or the deadline)",
        [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0],
    ),
    "save_gather_seconds": (
        "the engine step's copy of one request's blocks out of the cache",
        [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1],
    ),
}


@dataclass
class KVStoreConnectorStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        # typed here too: where vLLM is not installed (README's setup) its base class is
        # unknown to mypy, which would otherwise infer the values' type from this line
        data: dict[str, Any] = {name: 0 for name in COUNTERS} | {name: [] for name in HISTOGRAMS}
        self.data = data

    def add_counts(self, **counts: float) -> None:
        for name, value in counts.items():
            self.data[name] = self.data.get(name, 0) + value

    def observe(self, name: str, seconds: float) -> None:
        self.data.setdefault(name, []).append(seconds)

    def aggregate(self, other: KVConnectorStats) -> KVStoreConnectorStats:
        for name, value in other.data.items():
            if isinstance(value, list):
                self.data.setdefault(name, []).extend(value)
            else:
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {name: d[name] for name in COUNTERS if d.get(name)}
        for name in HISTOGRAMS:
            if d.get(name):
                out[f"{name.removesuffix('_seconds')}s"] = len(d[name])
                out[f"{name.removesuffix('_seconds')}_ms_max"] = round(max(d[name]) * 1000, 2)
        if d.get("lookup_prompt_tokens"):
            out["hit_rate"] = round(d.get("lookup_hit_tokens", 0) / d["lookup_prompt_tokens"], 3)
        if d.get("load_seconds"):
            out["load_GBps"] = round(d.get("load_bytes", 0) / sum(d["load_seconds"]) / 1e9, 2)
        return out

    def is_empty(self) -> bool:
        return not any(v for v in self.data.values())


class KVStorePromMetrics(KVConnectorPromMetrics):
    """``vllm:kvstore_*`` counters and latency histograms, per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # vLLM types every metric class and child as its Gauge | Counter | Histogram union;
        # the classes it maps Counter and Histogram to (prometheus_client's or its Ray
        # wrappers) take these arguments and make children that answer inc / observe.
        counter_cls = cast(type[Counter], self._counter_cls)
        histogram_cls = cast(type[Histogram], self._histogram_cls)
        self.counters: dict[str, dict[int, Counter]] = {
            name: cast(
                dict[int, Counter],
                create_metric_per_engine(
                    counter_cls(
                        name=f"vllm:kvstore_{name}", documentation=doc, labelnames=labelnames
                    ),
                    per_engine_labelvalues,
                ),
            )
            for name, doc in COUNTERS.items()
        }
        self.histograms: dict[str, dict[int, Histogram]] = {
            name: cast(
                dict[int, Histogram],
                create_metric_per_engine(
                    histogram_cls(
                        name=f"vllm:kvstore_{name}",
                        documentation=doc,
                        buckets=buckets,
                        labelnames=labelnames,
                    ),
                    per_engine_labelvalues,
                ),
            )
            for name, (doc, buckets) in HISTOGRAMS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if name in self.counters and value:
                self.counters[name][engine_idx].inc(value)
        for name, histogram in self.histograms.items():
            for seconds in transfer_stats_data.get(name) or ():
                histogram[engine_idx].observe(seconds)


class StatsRecorder:
    """One side's statistics since vLLM last collected them, behind a lock (loader and
    saver threads count too). ``lock`` also guards what a side updates together with
    its counts."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stats = KVStoreConnectorStats()

    def count(self, **counts: float) -> None:
        with self.lock:
            self.stats.add_counts(**counts)

    def observe(self, name: str, seconds: float) -> None:
        with self.lock:
            self.stats.observe(name, seconds)

    def take_stats(self) -> KVStoreConnectorStats | None:
        """What was counted since the last call, or None when nothing was."""
        with self.lock:
            if self.stats.is_empty():
                return None
            stats, self.stats = self.stats, KVStoreConnectorStats()
        return stats


class RefusalLog:
    """A worker's answer to the store refusing its credentials: the engine goes on
    (loads recompute, saves are future misses); each refusal is counted in ``stats``,
    and logged at ERROR the first time and then at most once a minute
    (``client.log_limit``). ``refused`` is called on loader and saver threads."""

    def __init__(self, stats: StatsRecorder) -> None:
        self._stats = stats
        self._log = LogLimit(logging.getLogger("client.vllm.worker"))

    def refused(self, exc: CredentialError) -> None:
        self._stats.count(credential_refusals=1)
        self._log.error(
            "refused",
            "the store refused this engine's credentials; loads recompute and saves are dropped "
            "until it is fixed (counted in vllm:kvstore_credential_refusals_total): %s",
            exc,
        )


class DeviceCounts:
    """The worker clients' device counters (``ClientStats``), added to the connector's
    each step since they were last reported: loads that landed in GPU memory straight
    from the store, node slabs the GPU could not register, and pages read from their
    index slots that had moved. Engine thread."""

    # connector counter <- ClientStats field
    FIELDS: ClassVar[dict[str, str]] = {
        "device_loads": "device_transfers",
        "host_register_failures": "host_register_failures",
        "slot_read_misses": "slot_read_misses",
    }

    def __init__(self, stats: StatsRecorder) -> None:
        self._stats = stats
        self._seen = dict.fromkeys(self.FIELDS, 0)

    def report(self, clients: list[ClientStats]) -> None:
        seen = {k: sum(getattr(c, f) for c in clients) for k, f in self.FIELDS.items()}
        new = {k: seen[k] - self._seen[k] for k in seen}
        self._seen = seen
        if any(new.values()):
            self._stats.count(**new)

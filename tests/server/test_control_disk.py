"""The operator control API (issue 73, server/control/) with a disk tier, on real node
processes, real clients and a real Valkey: a pin outlives a kill -9 and restart (the
pins file and the pages' disk copies), and a prefetch brings a prefix from disk into
memory so that the next get reads none of it from disk."""

from __future__ import annotations

import os
import signal

from client import KVCacheClient
from server.control.pins import PINS_FILE
from tests.support.control_fixtures import (
    PAGE,
    act,
    by_hashes,
    by_tokens,
    flood,
    metrics_address,
    prompt,
    query_tiers,
    read_exact,
    residency,
)
from tests.support.helpers import metrics, namespace_for_page_size, pages_for, wait_for

MEMORY = 16 << 20
OPTS = {"lease_ms": 0}
DISK_HITS = 'kvstore_tier_hit_pages_total{tier="disk"}'


def disk_cluster(clusters, tmp_path, **kw):
    return clusters(
        capacity="16MiB",
        slab="4MiB",
        disk_path=str(tmp_path / "disk"),
        disk_capacity="128MiB",
        **kw,
    )


def put(client, ns, tokens) -> None:
    assert client.put_pages(tokens, pages_for(ns, tokens)).stored == len(tokens) // ns.block_size


def test_a_pin_survives_a_restart_and_its_pages_come_back_into_memory(clusters, tmp_path):
    """Pinned (one prefix until unpinned, one for 10 minutes), the node is killed (-9)
    once their disk copies are written and started again on the same disk: its
    residency says pinned, TTL still counting, the pages come back into memory by
    themselves, and a flood of 4 times memory after the restart leaves them there."""
    cluster = disk_cluster(clusters, tmp_path)
    ns = namespace_for_page_size(PAGE, tenant="pin-restart")
    forever, for_now = prompt(ns, 1, 8), prompt(ns, 2, 4)
    addr = metrics_address(cluster)
    with KVCacheClient(cluster.redis_url, ns, **OPTS) as client:
        put(client, ns, forever)
        put(client, ns, for_now)
    assert act(addr, "pin", by_tokens(ns, forever))["pages"] == 8
    assert act(addr, "pin", by_hashes(ns, for_now, ttl_s=600.0))["pages"] == 4
    assert os.path.exists(tmp_path / "disk" / "node-0" / PINS_FILE)
    # a pinned page gets a disk copy soon, whatever the disk policy
    wait_for(
        lambda: metrics(cluster, "node-0")['kvstore_tier_pages{tier="disk"}'] >= 12,
        20,
        "the pinned pages' disk copies",
    )
    cluster.restart_nodes(signal.SIGKILL)
    addr = metrics_address(cluster)
    after = residency(addr, ns, forever) + residency(addr, ns, for_now)
    assert [b["pinned"] for b in after] == [True] * 12, after
    assert [b.get("pin_ttl_s") for b in after[:8]] == [None] * 8
    assert all(500 < b["pin_ttl_s"] < 600 for b in after[8:]), after

    def in_memory() -> bool:
        return [b["tier"] for b in residency(addr, ns, forever)] == ["CPU"] * 8 and [
            b["tier"] for b in residency(addr, ns, for_now)
        ] == ["CPU"] * 4

    wait_for(in_memory, 20, "the recovered pinned pages back in memory", 0.2)
    assert (
        metrics(cluster, "node-0")[f'kvstore_operator_pinned_pages{{tenant="{ns.tenant}"}}'] == 12
    )
    with KVCacheClient(cluster.redis_url, ns, **OPTS) as client:
        flood(client, ns, 4 * MEMORY)
        m = metrics(cluster, "node-0")
        gone = m["kvstore_memory_released_pages_total"] + m["kvstore_evicted_pages_total"]
        assert gone >= 3 * MEMORY // PAGE, m  # the flood went through memory
        assert [(b["tier"], b["pinned"]) for b in residency(addr, ns, forever)] == [
            ("CPU", True)
        ] * 8
        assert query_tiers(addr, ns, for_now) == {"CPU": 4, "DISK": 0}
        hits = metrics(cluster, "node-0")[DISK_HITS]
        assert read_exact(client, ns, forever) == 8 and read_exact(client, ns, for_now) == 4
        assert metrics(cluster, "node-0")[DISK_HITS] == hits


def test_a_prefetch_brings_a_prefix_from_disk_and_the_next_get_reads_no_disk(clusters, tmp_path):
    cluster = disk_cluster(clusters, tmp_path)
    ns = namespace_for_page_size(PAGE, tenant="prefetch")
    tokens = prompt(ns, 1, 8)
    addr = metrics_address(cluster)
    with KVCacheClient(cluster.redis_url, ns, **OPTS) as client:
        put(client, ns, tokens)
        flood(client, ns, 2 * MEMORY)  # the prefix is the oldest: out of memory, on disk
        assert [b["tier"] for b in residency(addr, ns, tokens)] == ["DISK"] * 8
        answer = act(addr, "prefetch", by_tokens(ns, tokens))
        assert (answer["pages"], answer["disk"], answer["blocks"], answer["missing"]) == (
            8,
            8,
            8,
            0,
        ), answer
        assert [(b["tier"], b["pinned"]) for b in residency(addr, ns, tokens)] == [
            ("CPU", False)
        ] * 8
        before = metrics(cluster, "node-0")
        assert before["kvstore_prefetched_pages_total"] == 8
        assert read_exact(client, ns, tokens) == 8
        # the node counts a get once its sends complete, which may be just after the
        # client has its bytes (a run read the count in between): wait for it
        gets = "kvstore_get_pages_total"
        wait_for(lambda: metrics(cluster, "node-0")[gets] > before[gets], 10, "the get's count")
        after = metrics(cluster, "node-0")
        assert after[DISK_HITS] == before[DISK_HITS]
        assert after[gets] - before[gets] == 8
        # in memory now: a prefetch again brings nothing
        assert act(addr, "prefetch", by_hashes(ns, tokens))["pages"] == 0

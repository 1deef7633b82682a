"""The operator control API (issue 73, server/control/) on real node processes, real
clients and a real Valkey (one, or a 3-shard cluster): a pinned prefix outlives floods
of other prompts, a pin's TTL lapses, the node's limits refuse a pin whole, and each
node's residency answer names the blocks it holds.

Requests go to each node by hand (tests/support/control_fixtures.py): a node acts on
the pages it holds, and the test reads each node's own answer."""

from __future__ import annotations

import time

from client import KVCacheClient
from tests.support.control_fixtures import (
    PAGE,
    act,
    by_hashes,
    by_tokens,
    flood,
    metrics_address,
    node_metric,
    post,
    prompt,
    query_tiers,
    read_exact,
    residency,
)
from tests.support.helpers import (
    ON_BOTH_INDEXES,
    metrics,
    namespace_for_page_size,
    pages_for,
    wait_for,
)

MEMORY = 16 << 20  # each node's page memory here: 16 MiB in 4 MiB slabs
OPTS = {"lease_ms": 0}  # no read leases: a flood may evict whatever is not pinned


def put(client, ns, tokens) -> None:
    assert client.put_pages(tokens, pages_for(ns, tokens)).stored == len(tokens) // ns.block_size


@ON_BOTH_INDEXES
def test_a_pinned_prefix_survives_a_flood_of_four_times_memory(clusters, index_shards):
    """Without a disk tier: the pinned prefix still hits and reads bit-exact after 64 MiB
    of other prompts went through a 16 MiB node; the control prefix of the same length,
    put at the same time but not pinned, is gone."""
    cluster = clusters(capacity="16MiB", slab="4MiB")
    ns = namespace_for_page_size(PAGE, tenant=f"pin-flood-{index_shards}")
    pinned, control = prompt(ns, 1, 8), prompt(ns, 2, 8)
    addr = metrics_address(cluster)
    with KVCacheClient(cluster.redis_url, ns, **OPTS) as client:
        put(client, ns, pinned)
        put(client, ns, control)
        answer = act(addr, "pin", by_tokens(ns, pinned))
        assert (answer["pages"], answer["blocks"], answer["missing"]) == (8, 8, 0), answer
        assert (answer["memory"], answer["disk"], answer["bytes"]) == (8, 0, 8 * PAGE)
        assert [
            (b["block"], b["tier"], b["pinned"], b.get("pin_ttl_s"))
            for b in residency(addr, ns, pinned)
        ] == [(i, "CPU", True, None) for i in range(8)]
        assert node_metric(cluster, "node-0", pinned_pages(ns)) == 8
        assert flood(client, ns, 4 * MEMORY) >= 4 * MEMORY // PAGE - 64
        assert node_metric(cluster, "node-0", "kvstore_evicted_pages_total") >= 3 * MEMORY // PAGE
        assert client.lookup(control) == 0
        assert residency(addr, ns, control) == []
        assert client.lookup(pinned) == len(pinned)
        assert read_exact(client, ns, pinned) == 8
        assert all(b["pinned"] and b["tier"] == "CPU" for b in residency(addr, ns, pinned))
        assert act(addr, "unpin", by_hashes(ns, pinned))["pages"] == 8
        assert [b["pinned"] for b in residency(addr, ns, pinned)] == [False] * 8
        assert node_metric(cluster, "node-0", pinned_pages(ns)) == 0


def pinned_pages(ns) -> str:
    return f'kvstore_operator_pinned_pages{{tenant="{ns.tenant}"}}'


def test_a_pin_with_a_ttl_counts_down_then_lapses_and_the_prefix_is_evicted(clusters):
    cluster = clusters(capacity="16MiB", slab="4MiB")
    ns = namespace_for_page_size(PAGE, tenant="pin-ttl")
    pinned = prompt(ns, 1, 4)
    addr = metrics_address(cluster)
    with KVCacheClient(cluster.redis_url, ns, **OPTS) as client:
        put(client, ns, pinned)
        assert act(addr, "pin", by_tokens(ns, pinned, ttl_s=2.0))["pages"] == 4
        first = residency(addr, ns, pinned)
        assert [(b["tier"], b["pinned"]) for b in first] == [("CPU", True)] * 4
        assert all(0 < b["pin_ttl_s"] <= 2.0 for b in first), first
        time.sleep(0.5)
        later = residency(addr, ns, pinned)
        assert all(b["pinned"] for b in later)
        assert all(b["pin_ttl_s"] <= a["pin_ttl_s"] - 0.4 for a, b in zip(first, later)), later
        # the TTL ends (the node's timer unpins); the queries held no read lease
        wait_for(
            lambda: node_metric(cluster, "node-0", pinned_pages(ns)) == 0, 10, "the pin to lapse"
        )
        flood(client, ns, 4 * MEMORY)
        assert client.lookup(pinned) == 0
        assert residency(addr, ns, pinned) == []


def test_the_pin_limits_refuse_a_pin_whole_naming_the_limit(clusters, tmp_path):
    """Memory 16 MiB, pins may hold half of it (8 MiB), a tenant a quarter (4 MiB); with a
    disk tier the tenant holds 10 MiB of pages (those past its quota on disk). A pin past
    the share, then one past the quota, is refused (409, naming the option) and pins
    none of its pages; a pin within both holds."""
    cluster = clusters(
        capacity="16MiB",
        slab="4MiB",
        disk_path=str(tmp_path / "disk"),
        disk_capacity="64MiB",
        extra=["--pin-max-share", "0.5", "--tenant-quota", "0.25"],
    )
    ns = namespace_for_page_size(PAGE, tenant="pin-limits")
    prompts = [prompt(ns, i, 16) for i in range(10)]  # 10 x 1 MiB
    addr = metrics_address(cluster)

    def named(*chosen) -> dict:
        bodies = [by_hashes(ns, prompts[i]) for i in chosen]
        return {**bodies[0], "block_hashes": [h for b in bodies for h in b["block_hashes"]]}

    def pinned_blocks(i) -> list[bool]:
        return [b["pinned"] for b in residency(addr, ns, prompts[i])]

    with KVCacheClient(cluster.redis_url, ns, **OPTS) as client:
        for tokens in prompts:
            put(client, ns, tokens)
        assert all(len(residency(addr, ns, p)) == 16 for p in prompts)  # memory or disk
        assert query_tiers(addr, ns, prompts[0])["DISK"] == 16
        # 10 MiB: past the share (8 MiB)
        status, answer = post(addr, "/v1/kv/pin", named(*range(10)))
        assert status == 409 and "--pin-max-share" in answer["error"], answer
        assert not any(b for i in range(10) for b in pinned_blocks(i))
        # 3 MiB: within both; then 2 MiB more: within the share, past the tenant's quota
        assert act(addr, "pin", named(0, 1, 2))["pages"] == 48
        status, answer = post(addr, "/v1/kv/pin", named(3, 4))
        assert status == 409 and "--tenant-quota" in answer["error"], answer
        assert f"tenant {ns.tenant}" in answer["error"]
        assert [pinned_blocks(i) for i in range(5)] == [[True] * 16] * 3 + [[False] * 16] * 2
        m = {k: v for k, v in metrics(cluster, "node-0").items() if "pin" in k}
        assert m[pinned_pages(ns)] == 48, m
        assert m['kvstore_pin_refused_total{limit="share"}'] == 1
        assert m['kvstore_pin_refused_total{limit="quota"}'] == 1
        # a pin again of what is pinned adds nothing, so it stays within the quota
        assert act(addr, "pin", named(0, 1, 2), status=200)["pages"] == 48


def test_each_node_answers_residency_for_the_blocks_it_holds(clusters):
    """Two nodes, every page on both (replicas=2): a pin on each pins its copies, each
    node's residency names every block as it holds it, and an unpin on one node leaves
    the other's pins."""
    cluster = clusters(servers=2, capacity="16MiB", slab="4MiB")
    ns = namespace_for_page_size(PAGE, tenant="residency-two")
    tokens = prompt(ns, 1, 8)
    addrs = {n: metrics_address(cluster, n) for n in ("node-0", "node-1")}
    with KVCacheClient(cluster.redis_url, ns, replicas=2, **OPTS) as client:
        assert client.put_pages(tokens, pages_for(ns, tokens)).stored >= 8
    for node, addr in addrs.items():
        assert metrics(cluster, node)["kvstore_pages"] == 8
        assert residency(addr, ns, tokens) == [
            {"block": i, "tier": "CPU", "pinned": False} for i in range(8)
        ]
        answer = act(addr, "pin", by_tokens(ns, tokens))
        assert (answer["node_id"], answer["pages"], answer["blocks"]) == (node, 8, 8)
    for node, addr in addrs.items():
        assert residency(addr, ns, tokens) == [
            {"block": i, "tier": "CPU", "pinned": True} for i in range(8)
        ]
        assert query_tiers(addr, ns, tokens) == {"CPU": 8, "DISK": 0}
        assert metrics(cluster, node)[pinned_pages(ns)] == 8
    assert act(addrs["node-1"], "unpin", by_tokens(ns, tokens[: 3 * ns.block_size]))["pages"] == 3
    assert [b["pinned"] for b in residency(addrs["node-1"], ns, tokens)] == [False] * 3 + [True] * 5
    assert [b["pinned"] for b in residency(addrs["node-0"], ns, tokens)] == [True] * 8
    # half a prompt: the blocks it names, from block 0
    assert [
        b["block"] for b in residency(addrs["node-0"], ns, tokens[: 2 * ns.block_size + 3])
    ] == [0, 1]

"""Clears (issue 73, server/control/ops.py) on real node processes, real clients and a
real Valkey (one, or a 3-shard cluster): a clear by prefix, by model and by tenant
removes exactly the pages it names while four readers loop lookups and gets over them;
no reader ever gets wrong KV, a get of pages looked up before the clear still reads
them for the clear grace, and after it the node holds none of them. The node's KV
events announce the removals (BlockRemoved)."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field

import torch

from client import KVCacheClient
from kvstore import block_hashes
from tests.support.control_fixtures import (
    PAGE,
    act,
    by_hashes,
    by_tokens,
    metrics_address,
    prompt,
    query_tiers,
    read_exact,
    residency,
)
from tests.support.helpers import (
    ON_BOTH_INDEXES,
    as_bytes,
    metrics,
    namespace_for_page_size,
    pages_for,
    wait_for,
)

GRACE = 2.0  # --clear-grace: far longer than a reader's lookup-to-get time


@dataclass
class Reads:
    """What the readers saw of one prefix around one clear."""

    full: int = 0  # gets that read every block the lookup before them found
    misses: int = 0  # lookups that found nothing (after the clear)
    after_clear: int = 0  # lookups begun after the clear answered
    found_after_clear: int = 0  # of those, lookups that still found blocks
    late: int = 0  # gets that ended more than the grace after their lookup (not judged)
    failures: list[str] = field(default_factory=list)


def read_loop(client, ns, tokens, stop: threading.Event, cleared: list[float], reads: Reads):
    """Lookups and gets of ``tokens`` until ``stop``; each page read is compared to what
    was put, and a get of what its lookup found must read all of it within the grace."""
    want = pages_for(ns, tokens)
    out = torch.zeros_like(want)
    while not stop.is_set():
        began = time.monotonic()
        found = client.find(tokens)
        blocks = found.blocks if found else 0
        if cleared and began > cleared[0]:
            reads.after_clear += 1
            reads.found_after_clear += blocks > 0
        if not blocks:
            reads.misses += 1
            time.sleep(0.005)
            continue
        out.zero_()
        got = client.get_found(found, out) // ns.block_size
        took = time.monotonic() - began
        if not torch.equal(as_bytes(out[:got]), as_bytes(want[:got])):
            reads.failures.append(f"wrong KV in the first {got} blocks")
        if got == blocks:
            reads.full += 1
        elif took < GRACE:
            reads.failures.append(f"read {got} of {blocks} blocks found {took:.3f} s before")
        else:
            reads.late += 1


def clear_under_readers(cluster, ns, tokens, body: dict, readers: int = 4) -> tuple[dict, Reads]:
    """Four readers (a client each) loop over ``tokens`` of ``ns``; once each has read
    it whole, the clear ``body`` goes to the node; they go on past the grace. Returns
    the clear's answer and what they saw."""
    addr = metrics_address(cluster)
    clients = [KVCacheClient(cluster.redis_url, ns) for _ in range(readers)]
    reads = [Reads() for _ in clients]
    stop, cleared = threading.Event(), []
    threads = [
        threading.Thread(target=read_loop, args=(c, ns, tokens, stop, cleared, r), daemon=True)
        for c, r in zip(clients, reads)
    ]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: all(r.full for r in reads), 20, "every reader to read the prefix")
        answer = act(addr, "clear", body)
        cleared.append(time.monotonic())
        time.sleep(GRACE + 0.5)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        for c in clients:
            c.close()
    total = Reads()
    for r in reads:
        total.full += r.full
        total.misses += r.misses
        total.after_clear += r.after_clear
        total.found_after_clear += r.found_after_clear
        total.late += r.late
        total.failures += r.failures
    return answer, total


def check_readers(reads: Reads) -> None:
    assert reads.failures == [], reads.failures[:5]
    assert reads.full >= 4 and reads.after_clear > 0 and reads.misses > 0, reads
    assert reads.found_after_clear == 0, reads  # the index let them go at once


@ON_BOTH_INDEXES
def test_clear_by_prefix_model_and_tenant_removes_exactly_those_under_readers(
    clusters, index_shards
):
    cluster = clusters(capacity="32MiB", slab="4MiB", extra=["--clear-grace", str(GRACE)])
    a1 = namespace_for_page_size(PAGE, tenant=f"clear-a-{index_shards}")
    a2 = a1.model_copy(update={"model": "another-model"})
    b1 = a1.model_copy(update={"tenant": f"clear-b-{index_shards}"})
    p, q = prompt(a1, 1, 8), prompt(a1, 2, 8)
    addr = metrics_address(cluster)
    clients = {ns: KVCacheClient(cluster.redis_url, ns) for ns in (a1, a2, b1)}
    try:
        for ns, tokens in ((a1, p), (a1, q), (a2, p), (b1, p)):
            assert clients[ns].put_pages(tokens, pages_for(ns, tokens)).stored == 8
        assert metrics(cluster, "node-0")["kvstore_pages"] == 32

        def held() -> dict[str, int]:
            return {
                "a1 p": clients[a1].lookup(p),
                "a1 q": clients[a1].lookup(q),
                "a2 p": clients[a2].lookup(p),
                "b1 p": clients[b1].lookup(p),
            }

        full = 8 * a1.block_size
        # 1. by prefix: a1's p (looked up first: a get of that lookup after the clear
        # still reads it during the grace, and after it reads nothing, never wrong KV)
        before = clients[a1].find(p)
        answer, reads = clear_under_readers(cluster, a1, p, by_tokens(a1, p))
        assert (answer["pages"], answer["memory"], answer["disk"]) == (8, 8, 0), answer
        check_readers(reads)
        assert held() == {"a1 p": 0, "a1 q": full, "a2 p": full, "b1 p": full}
        stale = torch.zeros_like(pages_for(a1, p))
        assert clients[a1].get_found(before, stale) == 0  # the grace is over
        assert not as_bytes(stale).any()
        assert residency(addr, a1, p) == [] and query_tiers(addr, a1, p) == {"CPU": 0, "DISK": 0}
        assert metrics(cluster, "node-0")["kvstore_pages"] == 24
        # a get that looked up before a clear reads it within the grace
        found = clients[a1].find(q)
        last = by_hashes(a1, q)
        last["block_hashes"] = last["block_hashes"][-1:]  # q's last block alone
        assert act(addr, "clear", last)["pages"] == 1
        assert clients[a1].lookup(q) == 7 * a1.block_size
        assert read_exact_found(clients[a1], a1, q, found) == 8
        wait_for(lambda: metrics(cluster, "node-0")["kvstore_pages"] == 23, 10, "the grace")
        assert [b["block"] for b in residency(addr, a1, q)] == list(range(7))
        # 2. by model: a1's model (q's remaining 7 blocks), not a2's nor b1's
        answer, reads = clear_under_readers(
            cluster, a1, q, {"tenant": a1.tenant, "model": a1.model}
        )
        assert answer["pages"] == 7, answer
        check_readers(reads)
        assert held() == {"a1 p": 0, "a1 q": 0, "a2 p": full, "b1 p": full}
        assert residency(addr, a1, q) == [] and metrics(cluster, "node-0")["kvstore_pages"] == 16
        # 3. by tenant: all of a's (a2's p), none of b's
        answer, reads = clear_under_readers(cluster, a2, p, {"tenant": a1.tenant})
        assert answer["pages"] == 8, answer
        check_readers(reads)
        assert held() == {"a1 p": 0, "a1 q": 0, "a2 p": 0, "b1 p": full}
        assert residency(addr, a2, p) == [] and query_tiers(addr, a2, p)["CPU"] == 0
        assert [b["tier"] for b in residency(addr, b1, p)] == ["CPU"] * 8
        assert read_exact(clients[b1], b1, p) == 8
        m = metrics(cluster, "node-0")
        assert m["kvstore_pages"] == 8
        assert m['kvstore_cleared_pages_total{scope="prefix"}'] == 9
        assert m['kvstore_cleared_pages_total{scope="model"}'] == 7
        assert m['kvstore_cleared_pages_total{scope="tenant"}'] == 8
        # cleared prompts can be stored again
        assert clients[a1].put_pages(p, pages_for(a1, p)).stored == 8
        assert read_exact(clients[a1], a1, p) == 8
    finally:
        for c in clients.values():
            c.close()


def read_exact_found(client, ns, tokens, found) -> int:
    want = pages_for(ns, tokens)
    out = torch.zeros_like(want)
    got = client.get_found(found, out) // ns.block_size
    assert torch.equal(as_bytes(out[:got]), as_bytes(want[:got])), "wrong KV"
    return got


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_clear_is_announced_as_block_removed_in_the_nodes_kv_events(clusters):
    import pytest

    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    from tests.support.node_events import KEYS, replay

    pub, rep = free_port(), free_port()
    extra = [
        "--kv-events-endpoint",
        f"tcp://*:{pub}",
        "--kv-events-replay-endpoint",
        f"tcp://*:{rep}",
        *KEYS.node_args(),
        "--clear-grace",
        "1",
    ]
    cluster = clusters(capacity="32MiB", slab="4MiB", extra=extra)
    a = namespace_for_page_size(PAGE, tenant="clear-events-a")
    b = a.model_copy(update={"tenant": "clear-events-b"})
    tokens = prompt(a, 1, 8)
    for ns in (a, b):
        with KVCacheClient(cluster.redis_url, ns) as client:
            assert client.put_pages(tokens, pages_for(ns, tokens)).stored == 8
    mine, theirs = set(block_hashes(a, tokens)), set(block_hashes(b, tokens))
    assert act(metrics_address(cluster), "clear", {"tenant": a.tenant})["pages"] == 8

    def removed() -> dict[str, set[bytes]]:
        out: dict[str, set[bytes]] = {}
        for topic, _, batch in replay(rep):
            for e in batch.events:
                if isinstance(e, kv_events.BlockRemoved):
                    out.setdefault(topic, set()).update(e.block_hashes)
        return out

    wait_for(lambda: mine <= set().union(*removed().values()), 10, "BlockRemoved of the clear", 0.2)
    time.sleep(1.5)  # past the grace: the drop announces nothing more
    gone = removed()
    assert all(a.tenant in topic for topic in gone), gone.keys()
    assert set().union(*gone.values()) == mine and not mine & theirs

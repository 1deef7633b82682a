"""Faults that once corrupted a node or wedged a client (issue 9), each reproduced with
real storage-node processes, a real Valkey and real UCX on loopback."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch

from client import KVCacheClient
from kvstore import (
    block_hashes,
)
from kvstore.index import PageIndex
from kvstore.tools.procutil import free_port
from tests.support.helpers import (
    advertised_prefix,
    metrics,
    namespace_for_page_size,
    no_tracebacks,
    pages_for,
    run_worker,
    spec,
    wait_for,
    worker_result,
)

pytestmark = pytest.mark.faults  # kills, stalls, corrupt frames: part of `pytest -m faults`


def index_pages(cluster, ns) -> dict[str, int]:
    """Pages per node that ``kvstore stats`` reports for ``ns``."""
    index = PageIndex(cluster.redis_url)
    try:
        found = [s for s in index.stats().namespaces if s.digest == ns.digest_hex]
    finally:
        index.close()
    return found[0].per_node if found else {}


def node_pages(cluster) -> dict[str, int]:
    """Pages each running node says it holds (its kvstore_pages gauge)."""
    return {
        n.node_id: int(metrics(cluster, n.node_id)["kvstore_pages"])
        for n in cluster.nodes
        if n.process.poll() is None
    }


def test_concurrent_puts_of_the_same_pages_keep_the_page_table_consistent(clusters):
    """Two engines sharing a system prompt: each page must be stored once, every slot
    accounted for, and nothing left pinned."""
    cluster = clusters(capacity="256MiB", slab="16MiB")
    ns = namespace_for_page_size(256 << 10, tenant="same-pages")
    rounds = [list(range(r * 100_000, r * 100_000 + 64 * ns.block_size)) for r in range(5)]
    out = run_worker(spec(cluster, ns, "concurrent_puts", clients=3, token_lists=rounds))
    for reports in out["rounds"]:
        assert all(r["stored"] == 64 and r["refused"] == 0 for r in reports), reports
        assert sum(r["sent"] for r in reports) == 64, reports  # each page travelled once
    m = metrics(cluster, "node-0")
    assert m["kvstore_pages"] == 320
    assert m["kvstore_used_bytes"] == 320 * (256 << 10)  # no slot leaked
    assert m["kvstore_pinned_pages"] == 0
    # stats count what nodes report in their heartbeat: it may lag the puts by one
    wait_for(
        lambda: index_pages(cluster, ns) == {"node-0": 320},
        15,
        "the heartbeat to report 320 pages",
        0.2,
    )
    got = run_worker(spec(cluster, ns, "get_pages", token_lists=rounds))["results"]
    assert [(r["matched"], r["exact"]) for r in got] == [(64, True)] * 5
    no_tracebacks(cluster)


def test_a_client_that_timed_out_on_a_stalled_node_reads_from_it_again(clusters):
    """A node stopped for longer than the client timeout, twice: once it runs again,
    the same client process gets full hits within a few seconds, and never wrong bytes."""
    cluster = clusters()
    ns = namespace_for_page_size(2 << 20, tenant="stall")
    tokens = list(range(16 * ns.block_size))
    run_worker(spec(cluster, ns, "put_pages", tokens=tokens))
    reader = run_worker(
        spec(
            cluster,
            ns,
            "get_pages",
            tokens=tokens,
            loop_seconds=16,  # the two stalls end 13 s after the first read
            round_pause_s=0.05,  # 20 reads a second time the stalls; a busy loop took a core
            timestamps=True,
            options={"timeout": 1.0},
        ),
        background=True,
    )
    node = cluster.nodes[0].process
    wait_for(
        lambda: metrics(cluster, "node-0")["kvstore_get_pages_total"] > 0,
        60,
        "the reader to start",
        0.2,
    )
    resumed = []
    for _ in range(2):
        node.send_signal(signal.SIGSTOP)
        time.sleep(2.5)
        node.send_signal(signal.SIGCONT)
        resumed.append(time.time())
        time.sleep(4)
    results = worker_result(reader, timeout=120)["results"]
    assert all(r["exact"] for r in results)  # partial or missing during a stall, never wrong
    assert any(
        r["matched"] < 16 for r in results if r["t"] < resumed[0]
    )  # the stall did hit the reader
    for start in resumed:
        # from 1.5 s after each resume until the next stall (4 s after it), and to the end
        late = [
            r for r in results if start + 1.5 < r["t"] < start + 3.5 or r["t"] > resumed[-1] + 1.5
        ]
        assert late and all(r["matched"] == 16 for r in late), [
            (round(r["t"] - start, 2), r["matched"], round(r["took"], 2))
            for r in results
            if r["t"] > start - 1
        ]


def test_a_killed_node_comes_back_on_its_port_at_once(clusters):
    """Without SO_REUSEADDR a killed listener's port stays busy for about a minute; a
    restart on the same address also takes over its registration without waiting."""
    cluster = clusters()
    port = free_port()
    first = cluster.add_node("fixed", ["--port", str(port)])
    cluster.wait_registered()
    ns = namespace_for_page_size(64 << 10, tenant="same-port")
    index = PageIndex(cluster.redis_url)
    before = {n.node_id: n.incarnation for n in index.live_nodes()}["fixed"]
    first.kill()
    first.process.wait()
    started = time.monotonic()
    cluster.add_node("fixed", ["--port", str(port)])

    def back() -> bool:
        node = {n.node_id: n for n in index.live_nodes()}.get("fixed")
        return node is not None and node.incarnation != before and node.port == port

    wait_for(back, 15, "the node to come back on its port", 0.1)
    assert time.monotonic() - started < 10
    tokens = list(range(40 * ns.block_size))
    assert run_worker(spec(cluster, ns, "put_pages", tokens=tokens))["reports"][0]["stored"] == 40
    assert run_worker(spec(cluster, ns, "get_pages", tokens=tokens))["results"][0]["matched"] == 40
    index.close()


def test_index_page_counts_equal_the_pages_nodes_hold(clusters):
    """Under eviction, repeated puts of shared prefixes and a node killed: the counts
    ``kvstore stats`` shows stay equal to what the live nodes hold."""
    cluster = clusters(servers=2, capacity="24MiB", slab="4MiB")
    ns = namespace_for_page_size(1 << 20, tenant="counts")
    prefix = list(range(10 * ns.block_size))
    prompts = [
        prefix + list(range(10**6 * (k + 1), 10**6 * (k + 1) + 12 * ns.block_size))
        for k in range(3)
    ]
    for _ in range(2):
        run_worker(spec(cluster, ns, "concurrent_puts", clients=2, token_lists=prompts))
    assert sum(metrics(cluster, n)["kvstore_evicted_pages_total"] for n in ("node-0", "node-1")) > 0
    # equal once the last puts' heartbeat is in (it reports every second)
    wait_for(
        lambda: index_pages(cluster, ns) == node_pages(cluster), 15, "the counts to agree", 0.2
    )
    cluster.nodes[1].kill()
    cluster.nodes[1].process.wait()
    wait_for(
        lambda: "node-1" not in index_pages(cluster, ns),
        15,
        "the dead node's pages to stop counting",
        0.2,
    )
    assert index_pages(cluster, ns) == node_pages(cluster)
    no_tracebacks(cluster)


@pytest.mark.parametrize("keep_data", [False, True], ids=["empty", "from-snapshot"])
def test_nodes_republish_after_the_index_restarts(clusters, keep_data):
    """Valkey crashes and comes back empty, or from an older snapshot: nodes re-register
    under a new incarnation and re-publish their namespaces and pages, so stats are
    right again and a client that stayed up gets full hits without a restart."""
    cluster = clusters(servers=2)
    ns = namespace_for_page_size(256 << 10, tenant=f"index-restart-{keep_data}")
    early = list(range(12 * ns.block_size))
    late = list(range(50_000, 50_000 + 12 * ns.block_size))
    run_worker(spec(cluster, ns, "put_pages", tokens=early))
    if keep_data:
        cluster.valkey.save()  # the snapshot knows only the early pages
    run_worker(spec(cluster, ns, "put_pages", tokens=late))
    reader = run_worker(
        spec(
            cluster,
            ns,
            "get_pages",
            token_lists=[early, late],
            loop_seconds=12,  # reads from 6 s after the restart on, until the end
            round_pause_s=0.05,
            timestamps=True,
            options={"timeout": 2.0},
        ),
        background=True,
    )
    wait_for(
        lambda: (
            metrics(cluster, "node-0")["kvstore_get_pages_total"]
            + metrics(cluster, "node-1")["kvstore_get_pages_total"]
            > 0
        ),
        60,
        "the reader to start",
        0.2,
    )
    cluster.valkey.restart(keep_data=keep_data)
    restarted = time.time()
    wait_for(
        lambda: sum(index_pages(cluster, ns).values()) == 24, 15, "the nodes to re-publish", 0.2
    )
    assert index_pages(cluster, ns) == node_pages(cluster)
    index = PageIndex(cluster.redis_url)
    stats = {s.digest: s for s in index.stats().namespaces}[ns.digest_hex]
    assert stats.namespace == ns  # the namespace itself was re-published too
    index.close()
    results = worker_result(reader, timeout=120)["results"]
    assert all(r["exact"] for r in results)
    late_reads = [r for r in results if r["t"] > restarted + 6]
    assert late_reads and all(r["matched"] == 12 for r in late_reads)
    no_tracebacks(cluster)


def test_pages_evicted_while_the_index_was_unreachable_stop_matching(clusters):
    """The node must evict even when it cannot tell the index; once the index is back
    the evicted pages must stop matching (no false hits)."""
    cluster = clusters(capacity="32MiB", slab="4MiB")
    ns = namespace_for_page_size(1 << 20, tenant="evict-offline")
    first = list(range(24 * ns.block_size))
    second = list(range(90_000, 90_000 + 16 * ns.block_size))
    with KVCacheClient(cluster.redis_url, ns, timeout=20) as client:  # knows the node from now on
        assert client.put_pages(first, pages_for(ns, first)).stored == 24
        cluster.valkey.process.send_signal(signal.SIGSTOP)
        try:
            client.put_pages(
                second, pages_for(ns, second)
            )  # the node evicts, the index cannot hear of it
        finally:
            cluster.valkey.process.send_signal(signal.SIGCONT)
    assert metrics(cluster, "node-0")["kvstore_evicted_pages_total"] > 0
    wait_for(
        lambda: index_pages(cluster, ns) == node_pages(cluster),
        20,
        "the node to reconcile with the index",
        0.2,
    )
    index = PageIndex(cluster.redis_url)
    advertised = advertised_prefix(index, ns, block_hashes(ns, first), lease_ms=0)
    index.close()
    got = run_worker(spec(cluster, ns, "get_pages", tokens=first))["results"][0]
    assert got["exact"] and got["matched"] == advertised  # every advertised page is really there
    no_tracebacks(cluster)


def test_a_second_node_with_a_live_node_id_is_refused(clusters):
    # a 1.5 s TTL (heartbeats every 0.5 s): a second process with a live id is refused
    # once it waited two TTLs for a restarted predecessor's entry to expire (3 s, not 10)
    ttl = ["--node-ttl", "1.5", "--heartbeat-interval", "0.5"]
    cluster = clusters(extra=ttl)
    before = {n.node_id: n.address for n in PageIndex(cluster.redis_url).live_nodes()}
    dup = cluster.add_node("node-0")
    assert dup.process.wait(60) == 1
    assert "node id 'node-0' is in use by a live node at" in dup.log()
    assert {n.node_id: n.address for n in PageIndex(cluster.redis_url).live_nodes()} == before
    ns = namespace_for_page_size(64 << 10, tenant="dup-id")
    assert (
        run_worker(spec(cluster, ns, "put_pages", count=4 * ns.block_size))["reports"][0]["stored"]
        == 4
    )


def test_nothing_lands_in_the_callers_tensor_after_a_read_returned(clusters):
    """A node stalls mid-transfer past the client timeout: once get_pages has returned,
    the caller's tensor never changes again, even after the node resumes sending."""
    cluster = clusters(capacity="512MiB", slab="16MiB")
    ns = namespace_for_page_size(2 << 20, tenant="late-writes")
    tokens = list(range(128 * ns.block_size))
    run_worker(spec(cluster, ns, "put_pages", tokens=tokens))
    node = cluster.nodes[0].process
    with KVCacheClient(cluster.redis_url, ns, timeout=1.0) as client:
        for delay in (0.0, 0.03, 0.08):
            out = torch.full((128, *ns.page_shape), 7.0, dtype=torch.float16)
            stopper = threading.Timer(delay, node.send_signal, (signal.SIGSTOP,))
            stopper.start()
            try:
                got = client.get_pages(tokens, out) // ns.block_size
                stopper.join()
                after_return = out.clone()
            finally:
                node.send_signal(signal.SIGCONT)
            time.sleep(1.5)  # the node resumes and pushes whatever it had left to send
            assert torch.equal(out.view(torch.uint8), after_return.view(torch.uint8)), (
                f"late write after delay {delay}"
            )
            expected = pages_for(ns, tokens)
            assert torch.equal(out[:got].view(torch.uint8), expected[:got].view(torch.uint8))
            time.sleep(1.0)  # let the client forgive the node before the next round


def test_connect_and_disconnect_do_not_grow_node_memory(clusters):
    """ucxx's active-message path kept about 2.2 KiB per closed endpoint."""
    cluster = clusters(capacity="64MiB", slab="4MiB")
    ns = namespace_for_page_size(64 << 10, tenant="reconnects")
    pid = cluster.nodes[0].process.pid

    def rss_kib() -> int:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))

    run_worker(spec(cluster, ns, "reconnects", cycles=300), timeout=300)  # warm up allocator pools
    before = rss_kib()
    run_worker(spec(cluster, ns, "reconnects", cycles=1000), timeout=300)
    grown = (rss_kib() - before) * 1024
    assert grown / 1000 < 1024, f"{grown / 1000:.0f} bytes per connection"

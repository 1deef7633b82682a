"""Faults that once corrupted a node or wedged a client (issue 9), each reproduced with
real storage-node processes, a real Valkey and real UCX on loopback."""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import threading
import time

import pytest
import redis
import torch

from client import AsyncKVCacheClient, KVCacheClient
from kvstore import (
    InvalidInputError,
    Namespace,
    TransportError,
    block_hashes,
    part_hashes,
    sequence_hash,
)
from kvstore.index import PageIndex
from kvstore.pages import keys
from kvstore.settings.client import client_options
from kvstore.tools.launcher import LocalCluster
from kvstore.tools.procutil import free_port
from tests.helpers import (
    advertised_prefix,
    kv_for,
    metrics,
    namespace_for_page_size,
    pages_for,
    run_worker,
    spec,
    wait_for,
    worker_result,
)


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


def no_tracebacks(cluster) -> None:
    """No traceback through this project's code in any node's log."""
    for node in cluster.nodes:
        assert not re.search(r'File "[^"]*/(?:server|kvstore|client)/', node.log()), node.log()[
            -3000:
        ]


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
    cluster = clusters()
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


def test_a_cancelled_blocking_call_returns_only_after_it_unwound(clusters):
    cluster = clusters()
    ns = namespace_for_page_size(64 << 10, tenant="unwind")
    marks: list[str] = []

    async def slow() -> None:
        try:
            await asyncio.sleep(30)
        finally:
            await asyncio.sleep(0.3)  # unwinding (closing endpoints) takes time
            marks.append("unwound")

    with KVCacheClient(cluster.redis_url, ns) as client:
        with pytest.raises(TransportError, match="did not finish"):
            client._run(slow(), timeout=0.2)
        assert marks == ["unwound"]


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf")])
def test_bad_client_options_are_refused_naming_the_option(bad, monkeypatch):
    ns = namespace_for_page_size(64 << 10, tenant="options")
    with pytest.raises(InvalidInputError, match="timeout"):
        AsyncKVCacheClient("redis://127.0.0.1:1/0", ns, timeout=bad)
    with pytest.raises(InvalidInputError, match="timeout"):
        client_options(timeout=bad)  # the vLLM connector's extra config goes through this
    monkeypatch.setenv("KVSTORE_TIMEOUT", str(bad))
    with pytest.raises(InvalidInputError, match="KVSTORE_TIMEOUT"):
        KVCacheClient.from_env(ns)


def test_unknown_client_options_are_refused():
    ns = namespace_for_page_size(64 << 10, tenant="options")
    with pytest.raises(InvalidInputError, match="timout"):
        AsyncKVCacheClient("redis://127.0.0.1:1/0", ns, timout=3)
    with pytest.raises(InvalidInputError, match="replicas"):
        client_options(replicas=0)


def test_a_script_error_is_a_bug_logged_at_error_not_an_unavailable_index(clusters, caplog):
    cluster = clusters()
    ns = namespace_for_page_size(64 << 10, tenant="script-error")
    tokens = list(range(4 * ns.block_size))
    raw = redis.Redis.from_url(cluster.redis_url)
    with KVCacheClient(cluster.redis_url, ns) as client:
        client.put_pages(tokens, pages_for(ns, tokens))
        segment = keys.segment_key(ns.key.prefix, block_hashes(ns, tokens)[0])
        raw.delete(segment)
        raw.hset(segment, "not", "a string")  # every script that reads it now fails
        out = torch.empty(4, *ns.page_shape, dtype=torch.float16)
        with caplog.at_level(logging.ERROR):
            assert client.get_pages(tokens, out) == 0
        assert client.stats.index_script_errors == 1 and client.stats.index_errors == 0
        assert any(
            r.levelno == logging.ERROR and "rejected" in r.getMessage() for r in caplog.records
        )
        with pytest.raises(InvalidInputError):  # usage errors still propagate
            client.get_pages(tokens, out.to(torch.float32))
        # a new page in the broken segment: the node's commit is refused, it stores nothing
        more = tokens[: ns.block_size] + list(range(10_000, 10_000 + ns.block_size))
        report = client.put_pages(more, pages_for(ns, more))
        assert report.sent == 0 and report.stored == 1  # only the block it already held
    assert metrics(cluster, "node-0")['kvstore_errors_total{kind="index_script"}'] >= 1


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


@pytest.mark.process
def test_a_stopped_index_shard_shortens_prefixes_for_every_client():
    """Two storage nodes on a 3-shard index cluster; two clients (this process and a
    worker process) publish prompts long enough that their segments live on every shard,
    then select them; one shard stops in the middle: every select returns a shorter
    prefix, bit-exact, without an exception and within the timeout."""
    ns = Namespace(
        model="shard-fault",
        dtype="float16",
        num_layers=1,
        num_kv_heads=1,
        head_size=32,
        block_size=4,
    )
    per_segment = keys.SEGMENT_PAGES * ns.block_size
    first = list(range(12 * per_segment + 2))  # 12 segments and a tail part
    second = first[: 5 * per_segment] + list(range(500_000, 500_000 + 7 * per_segment + 3))
    with LocalCluster(servers=2, capacity="64MiB", slab_size="4MiB", index_shards=3) as cluster:
        with KVCacheClient(cluster.redis_url, ns, timeout=3) as mine:
            writer = run_worker(spec(cluster, ns, "insert", tokens=first, hidden=False))
            assert writer["report"]["stored"] == 12 * keys.SEGMENT_PAGES + 1
            assert insert_tokens(mine, ns, second).stored == 12 * keys.SEGMENT_PAGES + 1
            for tokens in (first, second):
                got = run_worker(spec(cluster, ns, "select", tokens=tokens))
                assert got["matched"] == len(tokens) and got["exact"]
            index = PageIndex(cluster.redis_url)
            index.ping()
            topology = index._router.topology
            shard_of = lambda tokens: [
                topology.shard_of(keys.segment_key(ns.key.prefix, block_hashes(ns, tokens)[s]))
                for s, _ in keys.segments(len(tokens) // ns.block_size)
            ]
            registry = topology.shard_of(keys.NODES_ZSET)
            victim = next(s for s in range(3) if s not in (registry, shard_of(first)[0]))
            cluster.valkey.shards[victim].stop()
            for tokens in (first, second):
                expected = (
                    shard_of(tokens).index(victim) * per_segment
                    if victim in shard_of(tokens)
                    else len(tokens)
                )
                start = time.monotonic()
                got = run_worker(
                    spec(cluster, ns, "select", tokens=tokens, options={"timeout": 3})
                )  # a new process: seeds, one dead
                assert got["matched"] == expected and got["exact"] and expected < len(tokens)
                key, value, _ = kv_for(ns, tokens)
                _, roi, k, v, h = mine.select(
                    torch.tensor(tokens), torch.ones(len(tokens), dtype=torch.bool)
                )
                assert roi is not None and int(roi.sum()) == expected and h is None, (
                    mine.stats,
                    expected,
                    shard_of(tokens),
                    victim,
                )
                assert torch.equal(
                    k.view(torch.uint8), key[:, :expected].contiguous().view(torch.uint8)
                )
                assert time.monotonic() - start < 60
            assert mine.stats.index_errors >= 2
            # writes go on: pages whose segments live on the stopped shard are not stored
            third = list(range(900_000, 900_000 + 3 * per_segment))
            report = insert_tokens(mine, ns, third)
            lost = shard_of(third).count(victim) * keys.SEGMENT_PAGES
            tail = keys.segment_key(ns.key.prefix, part_hashes(sequence_hash(ns, third), 1)[0])
            lost += topology.shard_of(tail) == victim
            assert report.stored == 3 * keys.SEGMENT_PAGES + 1 - lost
        no_tracebacks(cluster)


def insert_tokens(client, ns, tokens):
    key, value, _ = kv_for(ns, tokens)
    return client.insert(
        torch.tensor(tokens), torch.ones(len(tokens), dtype=torch.bool), key, value
    )

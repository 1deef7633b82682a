"""Storage nodes as real processes, real UCX on loopback, clients in other processes."""

from __future__ import annotations

import os

import pytest

from kvstore import block_hashes
from kvstore.index import PageIndex
from kvstore.wire import protocol as P
from tests.support.helpers import (
    ON_BOTH_INDEXES,
    advertised_prefix,
    metrics,
    namespace_for_page_size,
    run_worker,
    spec,
    wait_for,
    worker_result,
)


@pytest.mark.parametrize("page_size", [4 << 10, 64 << 10, 2 << 20, 8 << 20])
def test_put_then_get_from_another_process_is_bit_exact(clusters, page_size):
    cluster = clusters()
    ns = namespace_for_page_size(page_size, tenant=f"exact-{page_size}")
    count = ns.block_size * 6
    put = run_worker(spec(cluster, ns, "put_pages", count=count))
    assert put["reports"][0]["stored"] == 6 and put["reports"][0]["sent"] == 6
    got = run_worker(spec(cluster, ns, "get_pages", count=count))
    assert got["results"] == [{"blocks": 6, "matched": 6, "exact": True}]
    assert got["stats"]["direct_transfers"] == 1


# The tests whose node behaviour goes through the index (commit, eviction under read
# leases, deregistration) run on a single Valkey and on a 3-shard Valkey cluster.


def test_batch_of_1024_small_pages_moves_in_few_messages(clusters):
    cluster = clusters()
    ns = namespace_for_page_size(4 << 10, tenant="batch")
    count = ns.block_size * 1024
    put = run_worker(spec(cluster, ns, "put_pages", count=count))
    assert put["reports"][0]["stored"] == 1024
    got = run_worker(spec(cluster, ns, "get_pages", count=count))
    assert got["results"] == [{"blocks": 1024, "matched": 1024, "exact": True}]
    # counted once the node's sends complete, which may be after the reader has its bytes
    wait_for(
        lambda: metrics(cluster, "node-0")["kvstore_get_pages_total"] > 0, 10, "the get's count"
    )
    m = metrics(cluster, "node-0")
    assert m['kvstore_payload_messages_total{direction="in"}'] <= 4
    assert m['kvstore_payload_messages_total{direction="out"}'] <= 4
    assert m["kvstore_put_pages_total"] == 1024 and m["kvstore_get_pages_total"] == 1024


def test_large_scattered_pages_share_ucx_messages(clusters):
    """A layer-major paged cache's blocks are scattered (a piece per layer) and land
    through a scratch buffer over UCX, so large ones share messages as small ones do: a
    load of a dozen 512 KiB blocks into every other block is one message, not twelve,
    and every byte lands in its block."""
    import torch

    from client import KVCacheClient
    from client.paging.paged_cache import PagedCache
    from kvstore import Namespace

    cluster = clusters()
    ns = Namespace(
        model="scattered",
        dtype="float32",
        num_layers=4,
        num_kv_heads=8,
        head_size=128,
        block_size=16,
        tenant="scattered",
        layout="vllm_cpu",
    )
    assert ns.page_nbytes > P.PACK_BELOW
    n = 12
    tokens = list(range(n * ns.block_size))
    pages = torch.randn(n, *ns.page_shape)
    cache = PagedCache([torch.zeros((2 * n + 2, *ns.page_shape[1:])) for _ in range(ns.num_layers)])
    blocks = list(range(1, 2 * n + 1, 2))
    sent = 'kvstore_payload_messages_total{direction="out"}'
    with KVCacheClient(cluster.redis_url, ns, same_host=False) as client:
        assert client.put_pages(tokens, pages).stored == n
        before = metrics(cluster, "node-0").get(sent, 0)
        spans = cache.block_spans(blocks)
        assert all(s.pieces for s in spans)
        assert client.get_found_into(client.find(tokens), spans) == len(tokens)
    # The node counts a get's messages once its sends complete, which may be just after
    # the client has its bytes (a CI run read the counter in between): wait for the count.
    wait_for(lambda: metrics(cluster, "node-0").get(sent, 0) > before, 10, "the get's count")
    assert metrics(cluster, "node-0")[sent] - before == 1
    assert torch.equal(cache.gather(blocks).wait(), pages)


@ON_BOTH_INDEXES
def test_filling_past_capacity_evicts_least_recently_used(clusters):
    cluster = clusters(capacity="8MiB", slab="1MiB")
    ns = namespace_for_page_size(64 << 10, tenant="evict")
    batches = [list(range(b * 10_000, b * 10_000 + 32 * ns.block_size)) for b in range(4)]
    opts = {"lease_ms": 0}
    for b in batches[:3]:
        assert (
            run_worker(spec(cluster, ns, "put_pages", tokens=b, options=opts))["reports"][0][
                "stored"
            ]
            == 32
        )
    # reading batch 0 makes it recently used, so batch 1 is now the oldest
    assert (
        run_worker(spec(cluster, ns, "get_pages", tokens=batches[0], options=opts))["results"][0][
            "matched"
        ]
        == 32
    )
    assert (
        run_worker(spec(cluster, ns, "put_pages", tokens=batches[3], options=opts))["reports"][0][
            "stored"
        ]
        == 32
    )
    index = PageIndex(cluster.redis_url)
    prefixes = [advertised_prefix(index, ns, block_hashes(ns, b), lease_ms=0) for b in batches]
    assert prefixes[0] == 32 and prefixes[1] == 0 and prefixes[2] == 32 and prefixes[3] == 32
    # whatever the index shows is really there, byte for byte
    got = run_worker(spec(cluster, ns, "get_pages", token_lists=batches, options=opts))["results"]
    assert [r["matched"] for r in got] == prefixes and all(r["exact"] for r in got)
    m = metrics(cluster, "node-0")
    assert m["kvstore_used_bytes"] <= m["kvstore_capacity_bytes"] == 8 << 20
    assert m["kvstore_evicted_pages_total"] >= 24


@ON_BOTH_INDEXES
def test_put_that_cannot_fit_is_refused_cleanly(clusters):
    cluster = clusters(capacity="2MiB", slab="1MiB")
    ns = namespace_for_page_size(64 << 10, tenant="refuse")
    first = list(range(32 * ns.block_size))
    assert run_worker(spec(cluster, ns, "put_pages", tokens=first))["reports"][0]["stored"] == 32
    PageIndex(cluster.redis_url).lookup(
        ns, block_hashes(ns, first), lease_ms=60_000
    )  # readers hold every page
    second = list(range(50_000, 50_000 + 8 * ns.block_size))
    report = run_worker(spec(cluster, ns, "put_pages", tokens=second))["reports"][0]
    assert report["stored"] == 0 and report["refused"] == 8
    assert run_worker(spec(cluster, ns, "get_pages", tokens=first))["results"] == [
        {"blocks": 32, "matched": 32, "exact": True}
    ]
    assert metrics(cluster, "node-0")["kvstore_refused_pages_total"] == 8


@ON_BOTH_INDEXES
def test_four_concurrent_clients_read_only_correct_bytes(clusters):
    cluster = clusters(servers=2)
    ns = namespace_for_page_size(64 << 10, tenant="concurrent")
    common = list(range(8 * ns.block_size))
    lists = [
        common + list(range(100_000 * (w + 1), 100_000 * (w + 1) + 8 * ns.block_size))
        for w in range(4)
    ]
    procs = [
        run_worker(
            spec(cluster, ns, "put_pages", token_lists=[lists[w], lists[(w + 1) % 4]]),
            background=True,
        )
        for w in range(4)
    ]
    procs += [
        run_worker(
            spec(cluster, ns, "get_pages", token_lists=lists, loop_seconds=2), background=True
        )
        for _ in range(2)
    ]
    results = [worker_result(p) for p in procs]
    for r in results[4:]:
        assert all(x["exact"] for x in r["results"])
    final = run_worker(spec(cluster, ns, "get_pages", token_lists=lists))["results"]
    assert final == [{"blocks": 16, "matched": 16, "exact": True}] * 4


def test_page_larger_than_a_slab_is_refused(clusters):
    cluster = clusters(capacity="8MiB", slab="1MiB")
    ns = namespace_for_page_size(2 << 20, tenant="too-big")
    report = run_worker(spec(cluster, ns, "put_pages", count=2 * ns.block_size))["reports"][0]
    assert report["stored"] == 0 and report["refused"] == 2
    assert metrics(cluster, "node-0")["kvstore_refused_pages_total"] == 2


def test_more_slabs_than_one_frame_can_carry_descriptors_for(clusters):
    """A same-host get that touches more slabs than SCM_RIGHTS carries at once (253)
    gets its descriptors over several frames marked ``more``, bit-exact."""
    cluster = clusters(capacity="20MiB", slab="64KiB")  # one 64 KiB page per slab
    ns = namespace_for_page_size(64 << 10, tenant="many-slabs")
    tokens = list(range(300 * ns.block_size))
    put = run_worker(spec(cluster, ns, "put_pages", tokens=tokens))
    assert put["reports"][0]["stored"] == 300 and put["stats"]["same_host_transfers"] == 1
    got = run_worker(spec(cluster, ns, "get_pages", tokens=tokens))
    assert (
        got["results"] == [{"blocks": 300, "matched": 300, "exact": True}]
        and got["stats"]["same_host_transfers"] == 1
    )


def test_a_client_that_cannot_reach_the_socket_falls_back_to_ucx(clusters):
    """A node whose Unix socket is not reachable from the client (another container's
    directory) is served over UCX, bit-exact, instead of looking dead."""
    cluster = clusters()
    node = PageIndex(cluster.redis_url).live_nodes()[0]
    os.unlink(node.extra["shm"])
    ns = namespace_for_page_size(64 << 10, tenant="fallback")
    tokens = list(range(4 * ns.block_size))
    result = run_worker(spec(cluster, ns, "put_pages", tokens=tokens))
    assert result["reports"][0]["stored"] == 4 and result["stats"]["same_host_transfers"] == 0
    assert result["stats"]["node_errors"] == 0  # not counted as a node failure
    got = run_worker(spec(cluster, ns, "get_pages", tokens=tokens))
    assert (
        got["results"] == [{"blocks": 4, "matched": 4, "exact": True}]
        and got["stats"]["same_host_transfers"] == 0
    )
    assert metrics(cluster, "node-0")['kvstore_transfer_requests_total{op="get",path="ucx"}'] >= 1


def test_pages_scattered_in_the_pool_move_as_many_runs_bit_exact(clusters):
    """Pages put one block at a time between another prompt's blocks get slots that never
    touch: a get of them is one payload message per page, more runs than the client
    posts receives ahead (client/nodes/connection.py RECEIVES_AHEAD), with pages the node
    lacks after them, and still lands bit-exact in another process."""
    from client.nodes.connection import RECEIVES_AHEAD

    cluster = clusters()
    ns = namespace_for_page_size(64 << 10, tenant="scattered")
    blocks = 3 * RECEIVES_AHEAD
    a = list(range(blocks * ns.block_size))
    b = list(range(10**6, 10**6 + blocks * ns.block_size))
    interleaved = [t[: k * ns.block_size] for k in range(1, blocks + 1) for t in (a, b)]
    put = run_worker(
        spec(cluster, ns, "put_pages", token_lists=interleaved, options={"same_host": False})
    )
    assert sum(r["sent"] for r in put["reports"]) == 2 * blocks  # one new page per put
    before = metrics(cluster, "node-0")['kvstore_payload_messages_total{direction="out"}']
    asked = a + list(range(5 * 10**6, 5 * 10**6 + 4 * ns.block_size))  # 4 blocks no node holds
    got = run_worker(spec(cluster, ns, "get_pages", tokens=asked, options={"same_host": False}))
    assert got["results"] == [{"blocks": blocks + 4, "matched": blocks, "exact": True}]
    sent = 'kvstore_payload_messages_total{direction="out"}'
    wait_for(lambda: metrics(cluster, "node-0")[sent] > before, 10, "the get's count")
    assert metrics(cluster, "node-0")[sent] - before == blocks

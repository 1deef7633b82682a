"""The client's keyed calls (``find_keys``, ``put_keyed``): pages named by an engine's
own chained page keys, stored from and landed into that engine's memory as spans, on
both data paths, against a real node. What an engine (SGLang's HiCache backend) builds
on; its own test is tests/sglang/test_sglang_hicache.py."""

from __future__ import annotations

import hashlib
import signal
import time

import pytest
import torch

from client import KVCacheClient
from client.memory.buffers import host_bytes, scattered_span
from kvstore.errors import InvalidInputError
from kvstore.pages.namespace import Namespace
from tests.support.helpers import tenant_for

pytestmark = pytest.mark.process


def keyed_ns(name: str) -> Namespace:
    return Namespace(
        model="m", dtype="float16", num_layers=2, num_kv_heads=2, head_size=8, block_size=4,
        layout="sglang_2blhd", tenant=tenant_for(name),
    )  # fmt: skip


def pool_spans(pool: torch.Tensor) -> list:
    """A page per span over a ``[2, tokens, L, H, D]`` pool, its K and V apart (the
    way SGLang's page_first host pool holds a page)."""
    flat, half = host_bytes(pool), pool[0].nbytes
    size = pool[0, :4].nbytes
    count = pool.shape[1] // 4
    return [
        scattered_span(
            (flat[i * size : (i + 1) * size], flat[half + i * size : half + (i + 1) * size])
        )
        for i in range(count)
    ]


@pytest.mark.parametrize("same_host", [True, False], ids=["shared-memory", "ucx"])
def test_keyed_pages_are_found_from_any_key_of_a_chain(clusters, same_host):
    cluster = clusters(1)
    ns = keyed_ns(f"keyed-{same_host}")
    keys = [hashlib.sha256(f"{same_host}-{i}".encode()).hexdigest() for i in range(10)]
    pool = torch.randn(2, 40, 2, 2, 8).half()
    with KVCacheClient(cluster.redis_url, ns, same_host=same_host) as client:
        report = client.put_keyed(keys[:7], pool_spans(pool)[:7])
        assert (report.stored, report.sent) == (7, 7)
        assert client.put_keyed(keys[:7], pool_spans(pool)[:7]).sent == 0  # held already
        assert client.find_keys(keys).blocks == 7
        assert client.find_keys(keys[3:]).blocks == 4  # a chain asked from its middle
        assert client.find_keys(keys[7:]).blocks == 0
        out = torch.zeros_like(pool)
        assert client.get_found_into(client.find_keys(keys), pool_spans(out)) == 28
        assert torch.equal(out[:, :28].view(torch.int16), pool[:, :28].view(torch.int16))
        assert not out[:, 28:].any()


@pytest.mark.parametrize("index_shards", [1, 3], ids=["one-index", "cluster-of-3"])
def test_keyed_pages_with_positions_share_64_page_segments(clusters, index_shards):
    """An engine that knows its keys' chain positions (SGLang with
    hicache_storage_pass_prefix_keys) stores a chain in batches placed from their
    positions, and finds it from any position given the key its segment is anchored
    at: the index reads one key per 64 pages. Asked without positions, only the pages
    that anchor a segment are found; never another page's bytes. On a Valkey cluster a
    lookup's segments come back a reply per shard, the first one's records shifted by
    its offset wherever it lies."""
    cluster = clusters(1)
    ns = keyed_ns(f"keyed-placed-{index_shards}")
    keys = [hashlib.sha256(f"placed-{i}".encode()).hexdigest() for i in range(200)]
    pool = torch.randn(2, 800, 2, 2, 8).half()
    spans = pool_spans(pool)
    with KVCacheClient(cluster.redis_url, ns) as client:
        for at in range(0, 200, 128):  # SGLang's batches of 128
            part = slice(at, at + 128)
            placed = {"position": at, "anchor_key": keys[at - at % 64] if at % 64 else None}
            assert client.put_keyed(keys[part], spans[part], **placed).stored == len(keys[part])
        found = client.find_keys(keys[100:], position=100, anchor_key=keys[64])
        assert found.blocks == 100
        out = torch.zeros_like(pool)
        assert client.get_found_into(found, pool_spans(out)[100:200]) == 400
        assert torch.equal(out[:, 400:800].view(torch.int16), pool[:, 400:800].view(torch.int16))
        assert client.find_keys(keys[:150], position=0).blocks == 150
        assert client.find_keys(keys[64:66]).blocks == 1  # unplaced: 64 anchors its segment
        with pytest.raises(InvalidInputError, match="need the key at 64"):
            client.find_keys(keys[100:], position=100)


@pytest.mark.parametrize("index_shards", [1, 3], ids=["one-index", "cluster-of-3"])
def test_keyed_pages_asked_without_a_lease_or_each_on_their_own(clusters, index_shards):
    """Lookups with no read lease (SGLang's ``batch_exists``: one MGET on one index
    server, the lookup script on a cluster) find what leased lookups find; asked each on
    its own (``stored_keys``: SGLang's side pools), pages stored at some positions are
    found there and only there, past a missing one too. A page whose node stopped is
    neither found nor present; with the index gone, both say None and count it."""
    cluster = clusters(2)
    ns = keyed_ns(f"keyed-each-{index_shards}")
    keys = [hashlib.sha256(f"each-{index_shards}-{i}".encode()).hexdigest() for i in range(9)]
    pool = torch.randn(2, 36, 2, 2, 8).half()
    spans = pool_spans(pool)
    at = [0, 1, 2, 5, 8]
    with KVCacheClient(cluster.redis_url, ns) as client:
        assert client.put_keyed([keys[i] for i in at], [spans[i] for i in at]).stored == 5
        assert client.find_keys(keys, lease=False).blocks == 3
        assert client.find_keys(keys).blocks == 3
        assert client.find_keys(keys[5:], lease=False).blocks == 1
        assert client.stored_keys(keys) == [i in at for i in range(9)]
        assert client.stored_keys(keys[3:5]) == [False, False]
        assert client.stored_keys([]) == []
        assert client.find_keys(keys[3:], lease=False).blocks == 0
        others = KVCacheClient(cluster.redis_url, keyed_ns("keyed-each-other"))
        with others:
            assert others.stored_keys(keys) == [False] * 9  # another namespace's
            assert others.find_keys(keys, lease=False).blocks == 0
        for node in cluster.nodes:  # stopped: each deregisters as it goes
            node.kill(signal.SIGTERM)
            node.process.wait()
        with KVCacheClient(cluster.redis_url, ns) as fresh:  # its nodes read anew
            deadline = time.monotonic() + 30
            while fresh.stored_keys(keys) != [False] * 9 and time.monotonic() < deadline:
                time.sleep(0.5)
            assert fresh.stored_keys(keys) == [False] * 9
            assert fresh.find_keys(keys, lease=False).blocks == 0
            assert cluster.valkey is not None
            cluster.valkey.stop()  # the index gone: a fault is a miss (None), counted
            cluster.valkey = None
            errors = fresh.stats.index_errors
            assert fresh.find_keys(keys, timeout=1.0, lease=False) is None
            assert fresh.stored_keys(keys, timeout=1.0) is None
            assert fresh.stats.index_errors >= errors + 2  # (its node list reads count too)


def test_keyed_and_token_calls_do_not_mix(clusters):
    """A keyed namespace's pages have no token chain, and a token namespace's no keys:
    each call on the other kind is refused, naming it; so is a page of the wrong size."""
    cluster = clusters(1)
    ns = keyed_ns("keyed-mix")
    with KVCacheClient(cluster.redis_url, ns) as client:
        with pytest.raises(InvalidInputError, match="not token ids"):
            client.find(list(range(8)))
        spans = pool_spans(torch.zeros(2, 8, 2, 2, 8).half())
        with pytest.raises(InvalidInputError, match="2 pages for 1 keys"):
            client.put_keyed(["k"], spans)
        small = pool_spans(torch.zeros(2, 8, 2, 1, 8).half())
        with pytest.raises(InvalidInputError, match="page 0 holds 256 bytes"):
            client.put_keyed(["k", "l"], small)
    tokens_ns = ns.model_copy(update={"layout": "vllm_cpu"})
    with KVCacheClient(cluster.redis_url, tokens_ns) as client:
        with pytest.raises(InvalidInputError, match="keys pages by token ids"):
            client.find_keys(["k"])

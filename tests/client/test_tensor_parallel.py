"""Engines of different tensor-parallel sizes share pages (docs/key-format.md "Head
groups"): one process per rank, real nodes and Valkey, every byte checked against KV
of the whole model sliced to each rank's heads."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest
import torch

from client import KVCacheClient
from kvstore import InvalidInputError
from kvstore.tools.launcher import LocalCluster
from tests.support.helpers import metrics, rank_pages, raw_index
from tests.support.tp_fixtures import TOKENS, cluster, rank_ns, run_ranks  # noqa: F401 (fixtures)


@pytest.mark.parametrize(
    "layout", ["vllm_cpu"]
)  # heads at dimension 1; every layout is unit-tested below, kv_lbhd end to end in the other tests
def test_tp2_producers_and_a_tp1_consumer_share_pages(cluster, layout):
    """Two rank processes at TP=2 (2 of 4 heads each) put their pages; one process at
    TP=1 (4 heads) reads the whole KV, bit-exact, and a TP=2 rank reads its half."""
    kw = {"layout": layout, "tenant": f"tp2to1-{layout.replace('_', '-')}"}
    puts = run_ranks(cluster, 2, "put_pages", kw, tokens=TOKENS)
    assert [r["reports"][0]["stored"] for r in puts] == [8, 8]  # one head group per rank and block
    (whole,) = run_ranks(cluster, 1, "get_pages", kw, tokens=TOKENS)
    assert whole["results"] == [{"blocks": 8, "matched": 8, "exact": True}]
    halves = run_ranks(cluster, 2, "get_pages", kw, tokens=TOKENS)
    assert [h["results"] for h in halves] == [[{"blocks": 8, "matched": 8, "exact": True}]] * 2


@pytest.mark.process
def test_units_of_consecutive_blocks_travel_as_one_message_over_ucx():
    """Units are stored and fetched unit by unit (heads.split), so each rank's units of
    consecutive blocks lie side by side in the node's pool and a TP=1 reader's staging:
    over UCX a TP=1 get of what two TP=2 ranks stored is one message per rank's run, not
    one per unit (16 here), and a TP=2 rank reading a TP=1 writer's pages gets one."""
    ucx = {"options": {"same_host": False}}
    with LocalCluster(servers=1, capacity="64MiB", slab_size="4MiB") as one:

        def sent() -> float:
            return metrics(one, one.nodes[0].node_id)[
                'kvstore_payload_messages_total{direction="out"}'
            ]

        kw = {"tenant": "tp-runs"}
        puts = run_ranks(one, 2, "put_pages", kw, tokens=TOKENS, **ucx)
        assert [r["reports"][0]["stored"] for r in puts] == [8, 8]
        before = sent()
        (whole,) = run_ranks(one, 1, "get_pages", kw, tokens=TOKENS, **ucx)
        assert whole["results"] == [{"blocks": 8, "matched": 8, "exact": True}]
        assert sent() - before <= 2  # each rank's 8 units in one run (they are 2 KiB each)

        kw = {"tenant": "tp-runs-back"}
        (put,) = run_ranks(one, 1, "put_pages", kw, tokens=TOKENS, **ucx)
        assert put["reports"][0]["stored"] == 16
        before = sent()
        (half,) = run_ranks(one, 2, "get_pages", kw, tokens=TOKENS, **ucx)[1:]
        assert half["results"] == [{"blocks": 8, "matched": 8, "exact": True}]
        assert sent() - before <= 2  # rank 0's and rank 1's gets, one run each


def test_ranks_fetch_what_one_lookup_found_without_asking_the_index(cluster):
    """The vLLM connector's load path: one lookup of every head group (its scheduler's,
    here a TP=1 client) handed on pickled (as vLLM sends step metadata to worker
    processes) to two TP=2 rank clients, which fetch their halves from it bit-exact
    without an index lookup of their own (no PTTL reaches Valkey: a lookup of one
    segment reads its lease with one, or two when the client has not seen the lease
    yet: the lookup script's own and one after it); a find older than half its read
    lease is looked up again. tests/vllm/test_vllm.py runs the same path across engine processes."""
    kw = {"tenant": "tp-found"}
    finder = KVCacheClient(cluster.redis_url, rank_ns(1, 0, **kw))
    ranks = [KVCacheClient(cluster.redis_url, rank_ns(2, r, **kw)) for r in (0, 1)]
    valkey = raw_index(cluster.redis_url)

    def lease_reads() -> int:
        return valkey.info("commandstats").get("cmdstat_pttl", {}).get("calls", 0)

    def fetch(found) -> list[tuple[bool, int, int]]:
        """Per rank: bit-exact, lookups made, finds found stale."""
        out = []
        for rank in ranks:
            lookups, stale = rank.stats.lookups, rank.stats.stale_finds
            expected = rank_pages(rank.namespace, TOKENS)
            got = torch.empty_like(expected)
            exact = rank.get_found(pickle.loads(pickle.dumps(found)), got) == len(
                TOKENS
            ) and torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
            out.append((exact, rank.stats.lookups - lookups, rank.stats.stale_finds - stale))
        return out

    try:
        for rank in ranks:
            assert rank.put_pages(TOKENS, rank_pages(rank.namespace, TOKENS)).stored == 8
        found = finder.find(TOKENS)
        assert found is not None and found.tokens == len(TOKENS) and found.units == (0, 2)
        before = lease_reads()
        assert fetch(found) == [(True, 0, 0)] * 2
        assert lease_reads() == before
        assert fetch(replace(found, taken=found.taken - 4.0)) == [(True, 1, 1)] * 2  # lease 5 s
        assert lease_reads() == before + 4  # two rank clients that had seen no lease
        whole = torch.empty(
            (8, *finder.namespace.page_shape), dtype=torch.float16
        )  # every group: the find as it is
        assert finder.get_found(found, whole) == len(TOKENS) and finder.stats.lookups == 1
        assert torch.equal(
            whole.view(torch.uint8), rank_pages(finder.namespace, TOKENS).view(torch.uint8)
        )
        short = finder.find(TOKENS[:15])  # not one full block: nothing found, nothing fetched
        assert short is not None and short.tokens == 0 and finder.get_found(short, whole) == 0
        # the head of a find (the connector's draft and target prefixes cut to the shorter):
        # picklable, its ranks fetch only its blocks, bit-exact, still without a lookup
        head = pickle.loads(pickle.dumps(found.head(3)))
        assert (head.blocks, head.result.matched, found.head(99) is found) == (3, 3, True)
        for rank in ranks:
            lookups = rank.stats.lookups
            got = torch.zeros((8, *rank.namespace.page_shape), dtype=torch.float16)
            assert rank.get_found(head, got) == 3 * 16 and rank.stats.lookups == lookups
            expected = rank_pages(rank.namespace, TOKENS)
            assert torch.equal(got[:3].view(torch.uint8), expected[:3].view(torch.uint8))
            assert not got[3:].any()
        assert found.head(0).blocks == 0 and finder.get_found(found.head(0), whole) == 0
    finally:
        for c in (finder, *ranks):
            c.close()


def test_a_find_is_refused_by_a_client_it_does_not_fit(cluster):
    """get_found names a find made in another storage namespace, or for head groups
    that do not include the reader's, instead of reading the wrong pages."""
    kw = {"tenant": "tp-found-misuse"}
    rank0, rank1 = (KVCacheClient(cluster.redis_url, rank_ns(2, r, **kw)) for r in (0, 1))
    other = KVCacheClient(cluster.redis_url, rank_ns(2, 1, tenant="tp-found-other"))
    try:
        rank0.put_pages(TOKENS, rank_pages(rank0.namespace, TOKENS))
        found = rank0.find(TOKENS)
        assert (
            found is not None and found.units == (0, 1) and found.tokens == len(TOKENS)
        )  # rank 0's group only
        out = torch.empty((8, *rank1.namespace.page_shape), dtype=torch.float16)
        with pytest.raises(InvalidInputError, match=r"head groups 0\.\.0, this rank reads 1\.\.1"):
            rank1.get_found(found, out)
        with pytest.raises(InvalidInputError, match="storage namespace"):
            other.get_found(found, out)
    finally:
        for c in (rank0, rank1, other):
            c.close()


def test_tp2_insert_and_tp1_select(cluster):
    """The lookup-buffer API across TP sizes: blocks are shared (bit-exact KV of all heads);
    the trailing partial block and hidden states stay with the producer's TP layout."""
    kw = {"tenant": "tp-insert"}
    inserts = run_ranks(cluster, 2, "insert", kw, tokens=TOKENS + [7, 7, 7])
    assert [r["report"]["stored"] for r in inserts] == [
        8 + 1,
        8 + 1,
    ]  # 8 block units and the rank's tail
    (sel,) = run_ranks(cluster, 1, "select", kw, tokens=TOKENS + [7, 7, 7])
    assert sel["matched"] == len(TOKENS) and sel["exact"] and not sel["hidden"]
    same = run_ranks(cluster, 2, "select", kw, tokens=TOKENS + [7, 7, 7])
    assert [(s["matched"], s["exact"], s["hidden"]) for s in same] == [
        (len(TOKENS) + 3, True, True)
    ] * 2


def test_tp1_producer_and_tp2_consumers(cluster):
    kw = {"tenant": "tp1to2"}
    (put,) = run_ranks(cluster, 1, "put_pages", kw, tokens=TOKENS)
    assert put["reports"][0]["stored"] == 16  # two head groups per block
    halves = run_ranks(cluster, 2, "get_pages", kw, tokens=TOKENS)
    assert [h["results"] for h in halves] == [[{"blocks": 8, "matched": 8, "exact": True}]] * 2

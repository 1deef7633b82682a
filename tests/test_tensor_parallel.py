"""Engines of different tensor-parallel sizes share pages (docs/key-format.md "Head
groups"): one process per rank, real nodes and Valkey, every byte checked against KV
of the whole model sliced to each rank's heads."""

from __future__ import annotations

import json
import pickle
from dataclasses import replace

import pytest
import torch

from client import KVCacheClient
from kvstore import InvalidInputError, Namespace
from kvstore.tools.launcher import LocalCluster
from tests.helpers import metrics, rank_pages, raw_index, run_worker, spec

HEADS = 4
TOKENS = list(range(8 * 16))  # 8 blocks of 16 tokens


def rank_ns(
    tp_size: int,
    tp_rank: int,
    *,
    heads: int = HEADS,
    groups: int = 2,
    layout: str = "kv_lbhd",
    tenant: str = "tp",
) -> Namespace:
    """The namespace of one rank of an engine at ``tp_size`` (vLLM's head split)."""
    replicated = tp_size > heads
    return Namespace(
        model="tp-share",
        dtype="float16",
        num_layers=2,
        head_size=16,
        block_size=16,
        layout=layout,
        hidden_size=32,
        num_kv_heads=1 if replicated else heads // tp_size,
        tp_rank=tp_rank,
        tp_size=tp_size,
        total_kv_heads=heads if replicated else 0,
        head_groups=groups,
        tenant=tenant,
    )


def _result(proc) -> dict:
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def run_ranks(cluster, tp_size: int, op: str, ns_kw: dict | None = None, **kw) -> list[dict]:
    """Run ``op`` in one process per rank of an engine at ``tp_size``, all at once."""
    procs = [
        run_worker(
            spec(cluster, rank_ns(tp_size, r, **(ns_kw or {})), op, kv="model", **kw),
            background=True,
        )
        for r in range(tp_size)
    ]
    return [_result(p) for p in procs]


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(servers=2, capacity="128MiB", slab_size="4MiB") as c:
        yield c


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
    segment reads its lease with one); a find older than half its read lease is
    looked up again. tests/test_vllm.py runs the same path across engine processes."""
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
        assert lease_reads() == before + 2
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


def test_replicated_heads_tp1_to_tp4_and_back_stores_each_head_once(cluster):
    """A model with 2 KV heads at TP=4: each rank holds one replicated head. Ranks read
    their head from what a TP=1 engine stored; four TP=4 ranks storing store each head
    once (the second replica finds it present)."""
    kw = {"heads": 2, "groups": 2, "tenant": "tp1to4"}
    (put,) = run_ranks(cluster, 1, "put_pages", kw, tokens=TOKENS)
    assert put["reports"][0]["stored"] == 16
    quarters = run_ranks(cluster, 4, "get_pages", kw, tokens=TOKENS)
    assert [q["results"] for q in quarters] == [[{"blocks": 8, "matched": 8, "exact": True}]] * 4

    kw = {"heads": 2, "groups": 2, "tenant": "tp4to1"}
    before = sum(metrics(cluster, n.node_id)["kvstore_put_pages_total"] for n in _nodes(cluster))
    puts = run_ranks(cluster, 4, "put_pages", kw, tokens=TOKENS)
    assert all(p["reports"][0]["stored"] == 8 for p in puts)
    assert (
        sum(metrics(cluster, n.node_id)["kvstore_put_pages_total"] for n in _nodes(cluster))
        - before
        == 16
    )  # 8 blocks x 2 heads
    (whole,) = run_ranks(cluster, 1, "get_pages", kw, tokens=TOKENS)
    assert whole["results"] == [{"blocks": 8, "matched": 8, "exact": True}]


def test_a_missing_head_group_shortens_the_prefix_for_every_consumer(cluster):
    """Rank 1 stored only the first 5 blocks (as if its later pages were evicted): a TP=1
    consumer gets 5 blocks, never 8 blocks of which 3 lack half their heads; a TP=2 rank 1
    also gets 5; a group-1 rank reading only its own complete group gets all 8."""
    kw = {"tenant": "tp-partial"}
    run_worker(spec(cluster, rank_ns(2, 0, **kw), "put_pages", kv="model", tokens=TOKENS))
    run_worker(spec(cluster, rank_ns(2, 1, **kw), "put_pages", kv="model", tokens=TOKENS[: 5 * 16]))
    (whole,) = run_ranks(cluster, 1, "get_pages", kw, tokens=TOKENS)
    assert whole["results"] == [{"blocks": 8, "matched": 5, "exact": True}]
    halves = run_ranks(cluster, 2, "get_pages", kw, tokens=TOKENS)
    assert [h["results"][0]["matched"] for h in halves] == [8, 5] and all(
        h["results"][0]["exact"] for h in halves
    )


def test_a_rank_that_holds_part_of_a_group_reads_but_does_not_store(cluster):
    """head_groups below tp_size: a rank's heads are half a stored group. It reads the
    smallest superset (the whole group) and keeps its heads; a put is refused, naming why."""
    kw = {"groups": 1, "tenant": "tp-superset"}
    (put,) = run_ranks(cluster, 1, "put_pages", kw, tokens=TOKENS)
    assert put["reports"][0]["stored"] == 8
    halves = run_ranks(cluster, 2, "get_pages", kw, tokens=TOKENS)
    assert [h["results"] for h in halves] == [[{"blocks": 8, "matched": 8, "exact": True}]] * 2
    from client import KVCacheClient
    from kvstore import InvalidInputError
    from tests.helpers import rank_pages

    ns = rank_ns(2, 0, **kw)
    with (
        KVCacheClient(cluster.redis_url, ns) as client,
        pytest.raises(InvalidInputError, match="part of a head group"),
    ):
        client.put_pages(TOKENS, rank_pages(ns, TOKENS))


def test_a_rank_that_holds_part_of_a_group_selects_an_inserted_prefix(cluster):
    """select's merge path (``_fetch_merged``): a TP=2 rank whose heads are half of the one
    stored group receives the units into a buffer and merges its heads into key/value,
    bit-exact; the producer's tail is its own, so the match is the block-aligned prefix."""
    kw = {"groups": 1, "tenant": "tp-superset-select"}
    (ins,) = run_ranks(cluster, 1, "insert", kw, tokens=TOKENS + [7, 7, 7])
    assert ins["report"]["stored"] == 8 + 1
    halves = run_ranks(cluster, 2, "select", kw, tokens=TOKENS + [7, 7, 7])
    assert [(h["matched"], h["exact"], h["hidden"]) for h in halves] == [
        (len(TOKENS), True, False)
    ] * 2


@pytest.mark.parametrize("layout", ["kv_lbhd", "vllm_cpu", "vllm_flash"])
@pytest.mark.parametrize("tp_size,groups", [(1, 4), (2, 4), (2, 2), (4, 2), (4, 1), (8, 4)])
def test_units_split_and_merge_back_to_each_ranks_heads(layout, tp_size, groups):
    """Pure logic: the units every rank reads, merged, give exactly its heads of the whole
    model's pages, for every layout and every TP size against every group count."""
    import torch

    from kvstore.pages import heads

    full_ns = rank_ns(1, 0, heads=HEADS, groups=groups, layout=layout)
    full = torch.randn(3, *full_ns.page_shape).to(torch.float16)
    stored = heads.split(full_ns, full, heads.rank_units(full_ns))  # [groups, blocks, *unit]
    assert stored.is_contiguous() and stored.shape[:2] == (groups, 3)
    for r in range(tp_size):
        ns = rank_ns(tp_size, r, heads=HEADS, groups=groups, layout=layout)
        p = heads.rank_units(ns)
        lo, hi = ns.head_range
        out = torch.empty(3, *ns.page_shape, dtype=torch.float16)
        heads.merge(ns, stored[p.first : p.first + p.count], out, p)
        assert torch.equal(out, full.narrow(1 + ns.head_dim, lo, hi - lo))
        if p.whole:  # what this rank would store is what the full engine stored
            assert torch.equal(heads.split(ns, out, p), stored[p.first : p.first + p.count])


def test_head_group_settings_are_checked():
    with pytest.raises(ValueError, match="must divide"):
        rank_ns(1, 0, groups=3)
    with pytest.raises(ValueError, match="replicated head"):
        Namespace(
            model="m",
            dtype="float16",
            num_layers=1,
            num_kv_heads=2,
            head_size=8,
            block_size=16,
            tp_size=4,
            total_kv_heads=2,
        )
    plain = Namespace(
        model="m", dtype="float16", num_layers=1, num_kv_heads=8, head_size=8, block_size=16
    )
    assert (
        plain.storage == plain and "head_groups" not in plain.canonical_json()
    )  # TP=1 pages are what they were
    before = (
        plain.digest
    )  # cached: a copy must not carry it over (a vLLM engine's storage namespace once did)
    assert (
        plain.model_copy(update={"head_groups": 2}).digest != before
        and plain.model_copy(update={"layout": "vllm_cpu"}).digest != before
    )


def _nodes(cluster):
    from kvstore.index import PageIndex

    return PageIndex(cluster.redis_url).live_nodes()


@pytest.mark.parametrize("layout", ["kv_lbhd", "vllm_cpu", "vllm_flash"])
@pytest.mark.parametrize("tp_size,groups", [(1, 4), (2, 4), (2, 2), (4, 2), (4, 1), (8, 4)])
def test_rank_parts_place_each_ranks_heads_as_merge_does(layout, tp_size, groups):
    """Pure logic: the views ``rank_parts`` cuts from received units, each written at its
    head offset, give exactly the pages ``merge`` copies (the vLLM connector writes them
    straight into its paged cache), and none of them is a copy."""
    from kvstore.pages import heads

    full_ns = rank_ns(1, 0, heads=HEADS, groups=groups, layout=layout)
    stored = heads.split(
        full_ns, torch.randn(3, *full_ns.page_shape).to(torch.float16), heads.rank_units(full_ns)
    )
    for r in range(tp_size):
        ns = rank_ns(tp_size, r, heads=HEADS, groups=groups, layout=layout)
        p = heads.rank_units(ns)
        units = stored[p.first : p.first + p.count]
        merged = torch.empty(3, *ns.page_shape, dtype=torch.float16)
        heads.merge(ns, units, merged, p)
        placed = torch.full_like(merged, float("nan"))
        d = 1 + ns.head_dim
        for part, at, layer_at in heads.rank_parts(ns, units, p):
            assert (
                part.untyped_storage().data_ptr() == units.untyped_storage().data_ptr()
                and layer_at == 0
            )
            placed.narrow(d, at, part.shape[d]).copy_(part)
        assert torch.equal(placed, merged)


def test_get_found_units_fetches_what_get_found_merges(cluster):
    """The connector's head-group load path in the client: ``get_found_units`` lands a
    find's units in the caller's buffer (no staging of the client's), bit-exact with
    what ``get_found`` merges, from any start block; a buffer too small is refused."""
    from kvstore.pages import heads

    kw = {"tenant": "tp-units"}
    finder = KVCacheClient(cluster.redis_url, rank_ns(1, 0, **kw))
    ranks = [KVCacheClient(cluster.redis_url, rank_ns(2, r, **kw)) for r in (0, 1)]
    try:
        for rank in ranks:
            assert rank.put_pages(TOKENS, rank_pages(rank.namespace, TOKENS)).stored == 8
        found = finder.find(TOKENS)
        ns, p = finder.namespace, finder.heads
        assert found is not None and found.blocks == 8 and not p.identity
        expected = rank_pages(ns, TOKENS)
        for start in (0, 3):
            buf = torch.empty(finder.units_nbytes(8 - start), dtype=torch.uint8)
            staged = finder.stats.staged_transfers
            units, blocks = finder.get_found_units(found, buf, start_block=start)
            assert blocks == 8 - start and finder.stats.staged_transfers == staged
            assert units.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
            merged = torch.empty(blocks, *ns.page_shape, dtype=expected.dtype)
            heads.merge(ns, units, merged, p)
            assert torch.equal(merged.view(torch.uint8), expected[start:].view(torch.uint8))
        with pytest.raises(InvalidInputError, match="need"):
            finder.get_found_units(
                found, torch.empty(finder.units_nbytes(8) - 1, dtype=torch.uint8)
            )
    finally:
        for c in (finder, *ranks):
            c.close()

"""Head groups across TP sizes: replicated heads stored once, a missing group shortening
every consumer's prefix, ranks holding part of a group, units split and merged back to
each rank's heads, and the settings checked."""

from __future__ import annotations

import pytest
import torch

from client import KVCacheClient
from kvstore import InvalidInputError, Namespace
from tests.support.helpers import metrics, rank_pages, run_worker, spec
from tests.support.tp_fixtures import HEADS, TOKENS, cluster, rank_ns, run_ranks  # noqa: F401 (fixtures)


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
    from tests.support.helpers import rank_pages

    ns = rank_ns(2, 0, **kw)
    with (
        KVCacheClient(cluster.redis_url, ns) as client,
        pytest.raises(InvalidInputError, match="part of a head group"),
    ):
        client.put_pages(TOKENS, rank_pages(ns, TOKENS))


def test_a_rank_that_holds_part_of_a_group_selects_an_inserted_prefix(cluster):
    """select's merge path (``client.gets.sequence_handler``): a TP=2 rank whose heads are half of the one
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

"""Layer groups: pipeline stages store their own layers under keys every PP split shares
(docs/key-format.md "Head groups"), through real storage nodes."""

from __future__ import annotations

import pytest
import torch

from client import KVCacheClient
from kvstore import Namespace
from kvstore.pages import heads
from kvstore.tools.launcher import LocalCluster
from tests.support.helpers import tenant_for

LAYERS, BLOCK = 4, 16


def stage_ns(
    pp_size: int,
    stage: int,
    *,
    groups: int = 2,
    layout: str = "vllm_cpu",
    tp_size: int = 1,
    tp_rank: int = 0,
    head_groups: int = 0,
    tenant: str = "default",
) -> Namespace:
    """A stage of a 4-layer model split evenly in ``pp_size`` stages, stored in ``groups``
    layer groups."""
    per = LAYERS // pp_size
    return Namespace(
        model="pp-test",
        dtype="float16",
        num_layers=per,
        num_kv_heads=4 // tp_size,
        head_size=16,
        block_size=BLOCK,
        layout=layout,
        tp_size=tp_size,
        tp_rank=tp_rank,
        total_kv_heads=4,
        head_groups=head_groups,
        pp_rank=stage,
        total_layers=LAYERS,
        first_layer=stage * per,
        layer_groups=groups,
        tenant=tenant,
    )


def model_pages(blocks: int, layout: str = "vllm_cpu") -> torch.Tensor:
    """The whole model's pages (every layer and head), random."""
    ns = stage_ns(1, 0, layout=layout)
    return torch.randn(
        (blocks, *ns.page_shape), generator=torch.Generator().manual_seed(blocks)
    ).to(torch.float16)


def stage_slice(ns: Namespace, full: torch.Tensor) -> torch.Tensor:
    """The part of the model's pages ``ns``'s rank holds: its layers and heads."""
    lo, hi = ns.head_range
    return (
        full.narrow(1 + ns.layer_dim, ns.first_layer, ns.num_layers)
        .narrow(1 + ns.head_dim, lo, hi - lo)
        .contiguous()
    )


@pytest.mark.parametrize("layout", ["kv_lbhd", "vllm_cpu", "vllm_flash"])
@pytest.mark.parametrize("pp_size,groups", [(1, 2), (2, 2), (4, 4), (2, 4), (1, 4)])
def test_stages_units_are_the_models_units_and_merge_back(layout, pp_size, groups):
    """Pure logic: the units a stage splits its pages into are exactly those of the same
    layers and heads that a PP=1 engine splits the whole model into (so any split reads
    any split's pages), merge undoes split, and rank_parts places the same bytes."""
    one = stage_ns(1, 0, groups=groups, layout=layout)
    full = model_pages(3, layout)
    stored = heads.split(one, full, heads.rank_units(one))
    assert stored.shape[0] == groups * one.groups
    for stage in range(pp_size):
        ns = stage_ns(pp_size, stage, groups=groups, layout=layout)
        p = heads.rank_units(ns)
        mine = stage_slice(ns, full)
        assert torch.equal(heads.split(ns, mine, p), stored[p.first : p.first + p.count])
        back = torch.empty_like(mine)
        heads.merge(ns, stored[p.first : p.first + p.count], back, p)
        assert torch.equal(back, mine)
        placed = torch.full_like(mine, float("nan"))
        for part, head_at, layer_at in heads.rank_parts(ns, stored[p.first : p.first + p.count], p):
            placed.narrow(1 + ns.layer_dim, layer_at, part.shape[1 + ns.layer_dim]).narrow(
                1 + ns.head_dim, head_at, part.shape[1 + ns.head_dim]
            ).copy_(part)
        assert torch.equal(placed, mine)


def test_stages_and_tp_ranks_share_one_storage_namespace():
    assert len({stage_ns(pp, s).storage.digest for pp in (1, 2) for s in range(pp)}) == 1
    assert (
        len({stage_ns(pp, s, groups=4).storage.digest for pp in (1, 2, 4) for s in range(pp)}) == 1
    )
    assert (
        stage_ns(1, 0, groups=4).storage.digest != stage_ns(1, 0, groups=2).storage.digest
    )  # engines must agree on the groups
    # a rank with part of the heads and one layer group: its units are consecutive
    ns = stage_ns(2, 1, tp_size=2, tp_rank=1, head_groups=2)
    p = heads.rank_units(ns)
    assert (p.first, p.count) == (1 * 2 + 1, 1)
    with pytest.raises(ValueError, match="must hold one layer group"):
        stage_ns(1, 0, tp_size=2, tp_rank=0, head_groups=2)
    with pytest.raises(ValueError, match="layer_groups 3 must divide the model's 4 layers"):
        stage_ns(2, 0, groups=3)
    with pytest.raises(ValueError, match="holds whole"):
        stage_ns(2, 0, groups=1)  # a stage of 2 layers cannot hold half of one 4-layer group
    # no layer fields: the namespace is what it was (golden vectors), pp_rank kept
    plain = Namespace(
        model="m",
        dtype="float16",
        num_layers=4,
        num_kv_heads=2,
        head_size=16,
        block_size=16,
        pp_rank=1,
    )
    assert "total_layers" not in plain.canonical_json() and plain.storage.pp_rank == 1


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(servers=2, capacity="256MiB", slab_size="16MiB") as c:
        yield c


@pytest.mark.parametrize("writer_pp,reader_pp", [(2, 2), (2, 1), (1, 2), (4, 2)])
def test_pages_of_any_pp_split_serve_any_other(cluster, request, writer_pp, reader_pp):
    tenant = tenant_for(request.node.name)
    blocks = 5
    tokens = list(range(1000, 1000 + blocks * BLOCK + 3))
    full = model_pages(blocks)
    groups = 4 if 4 in (writer_pp, reader_pp) else 2
    writers = [
        KVCacheClient(cluster.redis_url, stage_ns(writer_pp, s, groups=groups, tenant=tenant))
        for s in range(writer_pp)
    ]
    readers = [
        KVCacheClient(cluster.redis_url, stage_ns(reader_pp, s, groups=groups, tenant=tenant))
        for s in range(reader_pp)
    ]
    everything = KVCacheClient(
        cluster.redis_url, stage_ns(1, 0, groups=groups, tenant=tenant).storage
    )  # a scheduler's view
    try:
        for w in writers[:-1]:  # all stages but the last: no block is whole yet
            w.put_pages(tokens, stage_slice(w.namespace, full))
        assert everything.lookup(tokens) == 0
        writers[-1].put_pages(tokens, stage_slice(writers[-1].namespace, full))
        found = everything.find(tokens)
        assert found.tokens == blocks * BLOCK
        for r in readers:
            out = torch.empty(blocks, *r.namespace.page_shape, dtype=torch.float16)
            assert (
                r.get_found(found, out) == blocks * BLOCK
            )  # the scheduler's lookup, every stage's worker
            assert torch.equal(
                out.view(torch.int16), stage_slice(r.namespace, full).view(torch.int16)
            )
    finally:
        for c in [*writers, *readers, everything]:
            c.close()


def test_insert_select_refuse_a_stage_namespace(cluster, request):
    ns = stage_ns(2, 1, tenant=tenant_for(request.node.name))
    with KVCacheClient(cluster.redis_url, ns) as client:
        tokens = torch.arange(40)
        roi = torch.ones(40, dtype=torch.bool)
        with pytest.raises(
            ValueError, match="pipeline stage .layers 2 to 3 of 4.: use put_pages/get_pages"
        ):
            client.select(tokens, roi)

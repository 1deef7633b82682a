"""Gets that land layer by layer (client/memory/layer_feed.py) and the loads built on them
(client/paging/layerwise.py), against a real storage node: every layer of every page
lands bit-exact, the forward pass is told when each layer is in place, and a page that
fails its check, or whose layer was not in place when the forward took it, is recomputed,
never used. With the host as the "device" here, and with CUDA's copier (2-D copies from
the node's registered memory) where a GPU is: bench/gpu_check.py runs this file there."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from client import KVCacheClient
from client.memory.layer_feed import LayerFeed
from client.paging.layerwise import LayerwiseLoads
from client.paging.loader import PageLoader
from client.paging.paged_cache import PagedCache
from client.paging.specs import LoadSpec
from client.paging.staging_pool import StagingPool
from kvstore import InvalidInputError
from tests.support.device_fixtures import (  # noqa: F401 (fixtures)
    BLOCK,
    COPIERS,
    cluster,
    copier,
    device_of,
    make_ns,
    same,
    scribbling,
)
from tests.support.helpers import pages_for


def test_a_feed_tells_each_layer_once_every_page_of_it_is_queued():
    """``take`` waits for the layer of every page (or the get's end, or its timeout);
    a row queued after its layer was taken, or never, is late."""
    feed = LayerFeed(layers=2, pages=3)
    feed.queued(0, [0, 1], "e0")
    taken: list[list] = []
    reader = threading.Thread(target=lambda: taken.append(feed.take(0, 5.0)))
    reader.start()
    reader.join(0.2)
    assert reader.is_alive()  # row 2 of layer 0 is not queued yet
    feed.queued(0, [2], "e1")
    reader.join(5)
    assert taken == [["e0", "e1"]] and feed.first_late() == 3
    assert feed.untaken() == [1]
    assert feed.take(1, 0.05) == [] and feed.first_late() == 0  # nothing of layer 1 came
    feed.queued(1, [0, 1, 2], "late")  # too late: the forward read layer 1 already
    assert feed.take(1, 0) == [] and feed.untaken() == []
    closed = LayerFeed(layers=1, pages=2)
    closed.queued(0, [1], None)
    closed.close()  # the get ended without row 0: take does not wait for it
    assert closed.take(0, 60) == [] and closed.first_late() == 0
    with pytest.raises(ValueError, match="layer"):
        LayerFeed(layers=0, pages=1)


@pytest.mark.parametrize("same_host", [True, False], ids=["shm", "ucx"])
def test_a_layerwise_get_lands_every_layer_bit_exact(cluster, copier, same_host, request):
    """A get with a feed lands the same bytes as one without, every layer of every page
    queued before the get returns; a feed whose layers were all taken before the get
    ran has every row late."""
    ns = make_ns(request.node.name, layout="vllm_cpu", num_layers=4)
    tokens = list(range(7 * BLOCK))
    pages = pages_for(ns, tokens)
    with KVCacheClient(
        cluster.redis_url, ns, timeout=10, same_host=same_host, device=COPIERS[copier]
    ) as client:
        assert client.put_pages(tokens, pages).stored == 7
        device = device_of(copier)
        assert client.lands_layers(device)
        rows = torch.zeros((5, *ns.page_shape), dtype=pages.dtype, device=device)
        feed = LayerFeed(ns.num_layers, 5)
        found = client.find(tokens)
        assert client.get_found_device(found, rows, start_block=2, feed=feed) == len(tokens)
        assert same(rows, pages[2:])
        for layer in range(ns.num_layers):  # CUDA events to wait for; none on the host
            assert bool(feed.take(layer, 0)) == (copier == "cuda")
        assert feed.first_late() == 5 and feed.untaken() == []
        early = LayerFeed(ns.num_layers, 5)
        for layer in range(ns.num_layers):
            early.take(layer, 0)
        rows.zero_()
        assert client.get_found_device(found, rows, start_block=2, feed=early) == len(tokens)
        assert same(rows, pages[2:]) and early.first_late() == 0
        with pytest.raises(InvalidInputError, match="feed of 3 layers"):
            client.get_found_device(found, rows, start_block=2, feed=LayerFeed(3, 5))


def _load(cluster, ns, tokens, make, device, block_ids, *, waits=True):
    """One layer-wise load through ``LayerwiseLoads`` into an LBNHC cache on the copier's
    device, the forward's layer waits made as vLLM makes them; the cache's layers and
    the load's outcome."""
    with KVCacheClient(cluster.redis_url, ns, timeout=10, device=make) as client:
        layers = [
            torch.zeros(
                (20, BLOCK, ns.num_kv_heads, 2 * ns.head_size), dtype=torch.float16, device=device
            ).permute(0, 2, 1, 3)
            for _ in range(ns.num_layers)
        ]
        cache = PagedCache(layers)
        loader = PageLoader(
            client,
            cache,
            StagingPool(cache, 2, 8),
            block_size=BLOCK,
            layer_groups=[],
            load_stream=None,
            credential_refused=lambda exc: None,
        )
        names = [f"model.layers.{i}.self_attn.attn" for i in range(ns.num_layers)]
        whole: list[LoadSpec] = []
        with ThreadPoolExecutor(2) as threads:
            loads = LayerwiseLoads(
                loader,
                cache,
                threads,
                lambda spec, after: whole.append(spec),  # type: ignore[func-returns-value]
                feeds=True,
                timeout=10,
                layer_index=dict(zip(names, range(len(names)))),
            )
            spec = LoadSpec("req", client.find(tokens), block_ids, start_block=1, layerwise=True)
            loads.start(spec, None)
            for name in names if waits else []:
                loads.wait_layer(name)
            loads.wait_layer("draft.layers.0")  # not the cache's: nothing to do
            done = loads.finish()
            if not waits:  # a forward that never waits: later loads are made whole
                loads.start(spec, None)
                assert whole == [spec] and loads.finish()[0][0] is spec
                whole.clear()
        if device.type == "cuda":
            torch.cuda.synchronize()
    assert not whole and [s for s, _ in done] == [spec]
    return layers, done[0][1]


def test_layerwise_loads_scatter_each_layer_and_recompute_what_failed(cluster, copier, request):
    """The connector's layer-wise load path: a clean load lands every block of every
    layer bit-exact in the cache's strided layers; with a page overwritten in the node's
    memory during the get, that block and every later one are reported failed; a forward
    that never waited for its layers has the whole load failed, and so has a load naming a
    block outside the cache (the cache untouched)."""
    ns = make_ns(request.node.name, layout="vllm_cpu", num_layers=3)
    tokens = list(range(6 * BLOCK))
    pages = pages_for(ns, tokens)
    with KVCacheClient(cluster.redis_url, ns, timeout=10) as writer:
        assert writer.put_pages(tokens, pages).stored == 6
    block_ids, device = [9, 10, 11, 3, 4, 17], device_of(copier)
    layers, outcome = _load(cluster, ns, tokens, COPIERS[copier], device, block_ids)
    assert outcome.failed == [] and outcome.nbytes == 5 * ns.page_nbytes
    for i, block in enumerate(block_ids[1:], 1):
        assert all(same(layers[layer][block], pages[i][layer]) for layer in range(3)), i
    _, outcome = _load(cluster, ns, tokens, scribbling(COPIERS[copier], 2), device, block_ids)
    assert outcome.failed == block_ids[3:]  # the third page of the get: block 3 of the prompt
    _, outcome = _load(cluster, ns, tokens, COPIERS[copier], device, block_ids, waits=False)
    assert outcome.failed == block_ids[1:] and outcome.nbytes == 0
    outside = [9, 10, 11, 3, 4, 25]  # the cache has 20 blocks: a failed load, no exception
    layers, outcome = _load(cluster, ns, tokens, COPIERS[copier], device, outside)
    assert outcome.failed == outside[1:] and outcome.nbytes == 0
    assert not any(layer.any() for layer in layers)

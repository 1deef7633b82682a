"""Gets into device memory (client/memory/device_pages.py) against real storage nodes: pages copied
from the node's memory into device rows and checked there, over shared memory and over
UCX, into ``get_pages`` and the vLLM connector's ``PageLoader``; a page overwritten in the
node's memory while a load is under way is a miss and its blocks are recomputed, never
wrong KV. Runs with the host as the "device" (``HostCopier``: the same connection code,
registrations and checks), and with CUDA's copier too where a GPU is (bench/gpu_check.py
runs this file there)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from client import KVCacheClient
from client.memory.device_pages import HostCopier
from client.memory.device_rows import DeviceRows
from client.paging.loader import PageLoader, copies_pay
from client.paging.paged_cache import PagedCache
from client.paging.staging_pool import StagingPool
from client.vllm.metadata import LoadSpec
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


@pytest.mark.parametrize("same_host", [True, False], ids=["shm", "ucx"])
def test_get_pages_lands_in_device_memory_bit_exact(cluster, copier, same_host, request):
    """``get_pages`` into a tensor of the copier's device lands every page there (counted
    as a device transfer), bit-exact, from ``start_block`` on, over shared memory (the
    node's slabs registered once each) and over UCX (through pinned host memory)."""
    ns = make_ns(request.node.name)
    tokens = list(range(7 * BLOCK))
    pages = pages_for(ns, tokens)
    with KVCacheClient(
        cluster.redis_url, ns, timeout=10, same_host=same_host, device=COPIERS[copier]
    ) as client:
        assert client.put_pages(tokens, pages).stored == 7
        out = torch.zeros((7, *ns.page_shape), dtype=pages.dtype, device=device_of(copier))
        assert client.lands_on_device(out.device)
        shm_before = client.stats.same_host_transfers
        assert client.get_pages(tokens, out, start_block=2) == len(tokens)
        assert same(out[2:], pages[2:]) and not out[:2].any()
        assert client.stats.device_transfers == 1 and client.stats.checksum_failures == 0
        assert client.stats.same_host_transfers - shm_before == (1 if same_host else 0)
        if same_host:
            assert client.stats.host_registrations >= (1 if copier == "cuda" else 0)
        rows = torch.zeros((5, *ns.page_shape), dtype=pages.dtype, device=device_of(copier))
        assert client.get_found_device(client.find(tokens), rows, start_block=2) == len(tokens)
        assert same(rows, pages[2:])


@pytest.mark.parametrize("big", [False, True], ids=["small", "3MiB"])
def test_a_page_overwritten_during_a_load_is_a_miss(cluster, copier, big, request):
    """A page overwritten in the node's memory after the node pinned it and before its
    copy landed fails its check on the device: the prefix ends before it, the pages
    before it are exact, and the failure is counted. Pages of 3 MiB land and are
    checked in segments on a GPU (``device_landing.SEGMENT_BYTES``), a whole 2 MiB and
    the last 1 MiB."""
    big_page = dict(num_layers=12, num_kv_heads=8, head_size=512) if big else {}
    ns = make_ns(request.node.name, **big_page)
    assert not big or ns.page_nbytes == 3 << 20
    tokens = list(range(6 * BLOCK))
    pages = pages_for(ns, tokens)
    with KVCacheClient(cluster.redis_url, ns, timeout=10) as writer:
        assert writer.put_pages(tokens, pages).stored == 6
    with KVCacheClient(
        cluster.redis_url, ns, timeout=10, device=scribbling(COPIERS[copier], 3)
    ) as reader:
        rows = torch.zeros((6, *ns.page_shape), dtype=pages.dtype, device=device_of(copier))
        assert reader.get_found_device(reader.find(tokens), rows) == 3 * BLOCK
        assert same(rows[:3], pages[:3])
        assert reader.stats.checksum_failures == 1


def _cache_layers(layout: str, ns, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """20 blocks of every layer of ``ns``, viewed per layer ``[blocks, heads, block, 2*hd]``
    as vLLM 0.32 hands them over, in the byte order ``layout`` names: ``LBNHC``
    (FlashAttention's default, a tensor per layer ``[blocks, block, heads, 2*hd]``) or
    ``BLHNC`` (one tensor, a block of every layer back to back: one page)."""
    L, H, C = ns.num_layers, ns.num_kv_heads, 2 * ns.head_size
    if layout == "BLHNC":
        storage = torch.zeros((20, L, H, BLOCK, C), dtype=dtype, device=device)
        return [storage[:, layer] for layer in range(L)]
    return [
        torch.zeros((20, BLOCK, H, C), dtype=dtype, device=device).permute(0, 2, 1, 3)
        for _ in range(L)
    ]


@pytest.mark.parametrize("layout", ["LBNHC", "BLHNC"])
def test_the_connector_recomputes_blocks_overwritten_during_a_load(
    cluster, copier, layout, request
):
    """The vLLM worker's load path (``PageLoader``) into a paged cache on the copier's
    device: a clean load writes every block bit-exact into the cache's (strided) layers;
    a load during which a page is overwritten in the node's memory reports that block
    and every later one as failed (vLLM recomputes them). Into FlashAttention's default
    byte order the pages go through device rows and a scatter, so the failed blocks are
    left untouched; into a block-major cache (BLHNC) each page lands in its own block,
    no scatter, so the page that failed its check is found in its block, which vLLM
    recomputes before anything reads it."""
    # pages of 768 KiB: the blocks loaded (10-11, 3-4, 17) average over 1 MiB a run, so
    # a block-major cache takes them in place (loader.copies_pay)
    ns = make_ns(request.node.name, layout="vllm_cpu", num_layers=3, num_kv_heads=8, head_size=512)
    tokens = list(range(6 * BLOCK))
    pages = pages_for(ns, tokens)  # [n, L, H, B, 2*hd]
    with KVCacheClient(cluster.redis_url, ns, timeout=10) as writer:
        assert writer.put_pages(tokens, pages).stored == 6
    device = device_of(copier)
    block_ids = [9, 10, 11, 3, 4, 17]
    blhnc = PagedCache(_cache_layers("BLHNC", ns, pages.dtype, device)).device_rows(block_ids[1:])
    assert blhnc is not None and copies_pay(blhnc)
    for scribbled in (None, 4):
        layers = _cache_layers(layout, ns, pages.dtype, device)
        cache = PagedCache(layers)
        assert (cache.device_rows(block_ids) is not None) == (layout == "BLHNC")
        make = COPIERS[copier] if scribbled is None else scribbling(COPIERS[copier], scribbled - 1)
        with KVCacheClient(cluster.redis_url, ns, timeout=10, device=make) as client:
            loader = PageLoader(
                client,
                cache,
                StagingPool(cache, 2, 8),
                block_size=BLOCK,
                layer_groups=[],
                load_stream=torch.cuda.Stream() if device.type == "cuda" else None,
                credential_refused=lambda exc: None,
            )
            after = torch.cuda.Event() if device.type == "cuda" else None
            if after is not None:
                after.record()
            outcome = loader.load(
                LoadSpec("req", client.find(tokens), block_ids, start_block=1), after
            )
            assert client.stats.device_transfers == 1
        good = 6 if scribbled is None else scribbled
        assert outcome.failed == block_ids[good:]

        def holds(block: int, page: torch.Tensor) -> bool:
            return all(same(layers[layer][block], page[layer]) for layer in range(ns.num_layers))

        for i, block in enumerate(block_ids):
            if layout == "BLHNC" and i >= good:
                continue  # in place: recomputed by vLLM, whatever landed
            want = pages[i] if 1 <= i < good else torch.zeros_like(pages[i])
            assert holds(block, want), (i, block)
        if layout == "BLHNC" and scribbled is not None:
            failed = block_ids[scribbled]
            assert not holds(failed, pages[scribbled])
            assert not holds(failed, torch.zeros_like(pages[scribbled]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="orders CUDA streams")
def test_pages_landing_in_a_cache_wait_for_the_event_they_are_given(cluster, request):
    """A get into a block-major cache's own blocks starts its copies only once the event
    it is given has passed on the device: work the engine queued before it that still
    writes those blocks (here a fill behind a 0.2 s sleep, standing for a step whose
    request freed them) is over before the pages land, so they are not overwritten."""
    ns = make_ns(request.node.name, layout="vllm_cpu", num_layers=3)
    tokens = list(range(4 * BLOCK))
    pages = pages_for(ns, tokens)
    device = torch.device("cuda")
    layers = _cache_layers("BLHNC", ns, pages.dtype, device)
    cache = PagedCache(layers)
    block_ids = [5, 6, 7, 8]
    with KVCacheClient(cluster.redis_url, ns, timeout=10, device=COPIERS["cuda"]) as client:
        assert client.put_pages(tokens, pages).stored == 4
        found = client.find(tokens)
        # a first get maps and registers the node's slabs, so the second queues at once
        assert client.get_found_device(found, cache.device_rows([1, 2, 3, 4])) == len(tokens)
        torch.cuda._sleep(400_000_000)  # about 0.2 s of the device's cycles
        for kv in layers:
            kv.fill_(7)
        after = torch.cuda.Event()
        after.record()
        got = client.get_found_device(found, cache.device_rows(block_ids), after=after)
        torch.cuda.synchronize()
    assert got == len(tokens)
    for i, block in enumerate(block_ids):
        assert all(same(layers[layer][block], pages[i][layer]) for layer in range(ns.num_layers))


def test_pages_land_in_a_cache_s_blocks_only_where_copies_average_a_mib():
    """A block-major cache takes a load's pages in place only where a copy per run of
    consecutive blocks averages at least 1 MiB (``IN_PLACE_COPY_BYTES``): scattered
    blocks of 2 MiB pages do, scattered 64 KiB pages do not (they land in rows and are
    scattered after), and 64 KiB pages in one run of 16 blocks do, unless the blocks lie
    further apart than a page."""
    from client.paging.loader import IN_PLACE_COPY_BYTES

    assert IN_PLACE_COPY_BYTES == 1 << 20

    def rows(page_kib: int, block_ids: list[int], stride_kib: int | None = None) -> DeviceRows:
        # a block-major cache's rows: a page of page_kib KiB every stride_kib KiB
        page, stride = page_kib << 10, (stride_kib or page_kib) << 10
        return DeviceRows(torch.zeros(0, dtype=torch.uint8), np.array(block_ids) * stride, page)

    scattered, run = list(range(1, 40, 3)), list(range(20, 36))
    assert copies_pay(rows(2048, scattered))
    assert not copies_pay(rows(64, scattered))
    assert copies_pay(rows(64, run))
    assert not copies_pay(rows(64, run[:15]))
    # blocks with more than a page between them (another cache's layers beside) never touch
    assert not copies_pay(rows(64, run, stride_kib=80))


def test_device_gets_refuse_what_they_cannot_do(cluster, request):
    """Misuse names the problem: rows too small, not contiguous, or memory the client's
    copier does not reach (a client without one, or asked to stage); rows placed by the
    caller (``DeviceRows``) of the wrong page size, too few, misaligned, past their
    tensor's end, or over a tensor that is not flat bytes. Nothing lands."""
    ns = make_ns(request.node.name)
    tokens = list(range(3 * BLOCK))
    with KVCacheClient(cluster.redis_url, ns, timeout=10, device=HostCopier) as client:
        client.put_pages(tokens, pages_for(ns, tokens))
        found = client.find(tokens)
        with pytest.raises(InvalidInputError, match="need"):
            client.get_found_device(found, torch.zeros((2, *ns.page_shape), dtype=torch.float16))
        with pytest.raises(InvalidInputError, match="contiguous"):
            client.get_found_device(
                found, torch.zeros((3, *ns.page_shape), dtype=torch.float16).transpose(1, 2)
            )
        page = ns.page_nbytes
        flat = torch.zeros(4 * page, dtype=torch.uint8)
        placed = {
            "a page has": DeviceRows(flat, np.arange(3) * page, page // 2),
            "2 rows for 3 pages": DeviceRows(flat, np.arange(2) * page, page),
            "8-byte aligned": DeviceRows(flat, np.arange(3) * page + 4, page),
            "inside the": DeviceRows(flat, np.arange(3) * page + 2 * page, page),
            "flat contiguous uint8": DeviceRows(flat.view(4, page), np.arange(3) * page, page),
        }
        for problem, rows in placed.items():
            with pytest.raises(InvalidInputError, match=problem):
                client.get_found_device(found, rows)
        assert client.stats.device_transfers == 0 and not flat.any()
    with KVCacheClient(cluster.redis_url, ns, timeout=10, device=lambda stats: None) as client:
        assert not client.lands_on_device(torch.device("cpu"))
        with pytest.raises(InvalidInputError, match="cannot land"):
            client.get_found_device(
                client.find(tokens), torch.zeros((3, *ns.page_shape), dtype=torch.float16)
            )
    with KVCacheClient(
        cluster.redis_url, ns, timeout=10, device=HostCopier, transfer_mode="staged"
    ) as client:
        assert not client.lands_on_device(torch.device("cpu"))

"""Gets into device memory (client/memory/device_pages.py) against real storage nodes: pages copied
from the node's memory into device rows and checked there, over shared memory and over
UCX, into ``get_pages`` and the vLLM connector's ``PageLoader``; a page overwritten in the
node's memory while a load is under way is a miss and its blocks are recomputed, never
wrong KV. Runs with the host as the "device" (``HostCopier``: the same connection code,
registrations and checks), and with CUDA's copier too where a GPU is (bench/gpu_check.py
runs this file there)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from client import KVCacheClient
from client.memory.buffers import Span
from client.memory.device_landing import POLL_AFTER, POLL_BEFORE, BusPace, settled
from client.memory.device_pages import CudaCopier, HostCopier
from client.memory.device_rows import DeviceRows, DeviceSpan
from client.paging.loader import PageLoader, copies_pay
from client.paging.paged_cache import PagedCache
from client.paging.staging_pool import StagingPool
from client.stats import ClientStats
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


def test_copies_of_pages_that_touch_are_merged():
    """Pages that lie back to back in a slab and in their rows travel as one copy (one
    DMA on a GPU: measured, 128 separate 2 MiB copies reached 0.93x of one); a page in
    another slab, or not next to the one before on either side, starts a new copy."""
    from client.memory.copy_plans import PageCopies

    slab, other = np.arange(64, dtype=np.uint8), np.arange(64, 128, dtype=np.uint8)
    rows = torch.zeros(64, dtype=torch.uint8)
    copies = PageCopies.of(
        [
            (DeviceSpan(rows, 0, 8), Span(slab, 16, 8)),
            (DeviceSpan(rows, 8, 8), Span(slab, 24, 8)),
            (DeviceSpan(rows, 16, 8), Span(slab, 40, 8)),
            (DeviceSpan(rows, 32, 8), Span(slab, 48, 8)),
            (DeviceSpan(rows, 40, 8), Span(other, 56, 8)),
        ]
    )
    merged = copies.views()
    assert [(d.numel(), int(s[0])) for d, s in merged] == [(16, 16), (8, 40), (8, 48), (8, 120)]
    assert copies.rows() == [0, 1, 2, 4, 5] and copies.source(4).base is other
    with pytest.raises(ValueError, match="one page size"):
        PageCopies.of([(DeviceSpan(rows, 0, 8), Span(slab, 0, 16))])
    with pytest.raises(ValueError, match="one tensor"):
        PageCopies.of(
            [
                (DeviceSpan(rows, 0, 8), Span(slab, 0, 8)),
                (DeviceSpan(rows.clone(), 0, 8), Span(slab, 8, 8)),
            ]
        )


def test_checks_are_queued_in_batches_with_a_small_last_one():
    """A get's checks follow its copies in batches of about 32 MiB; the last batch, what
    the get waits for once its copies are done, is at most 8 MiB or one page."""
    from client.memory.buffers import block_runs
    from client.memory.copy_plans import check_batches

    MiB = 1 << 20

    def sizes(count: int, nbytes: int) -> list[int]:
        batches = check_batches(count, nbytes)
        assert batches[0][0] == 0 and batches[-1][1] == count  # every page, in order, once
        assert all(a[1] == b[0] for a, b in zip(batches, batches[1:]))
        return [end - start for start, end in batches]

    assert sizes(64, 2 * MiB) == [16, 16, 16, 12, 4]
    assert sizes(5, 16 * MiB) == [2, 2, 1]
    assert sizes(1024, 64 << 10) == [512, 384, 128]
    assert sizes(40, 3 * MiB) == [11, 11, 11, 5, 2]
    assert sizes(2, 2 * MiB) == [1, 1]
    assert check_batches(1, MiB) == [(0, 1)] and check_batches(0, MiB) == [(0, 0)]
    assert block_runs([0, 1, 2, 5, 6, 9]) == [(0, 0, 3), (3, 5, 2), (5, 9, 1)]


class _RefusingRuntime:
    """Stands in for CUDA's runtime where no GPU is, only to answer cudaHostRegister
    as a driver does: read-only registration refused (an older driver), and every
    registration of ``refuse`` (a memlock limit). Records the calls."""

    def __init__(self, refuse: set[int]) -> None:
        self.refuse, self.calls, self.cleared = refuse, [], 0

    def cudaHostRegister(self, ptr, size, flags):
        self.calls.append((ptr, flags))
        return 1 if flags or ptr in self.refuse else 0

    def cudaGetLastError(self):
        self.cleared += 1


def test_a_failed_registration_is_counted_every_time_and_logged_once(caplog):
    """A node slab the GPU cannot register is never a silent slow copy: each failure
    counts in host_register_failures (the connector exports it), the first is logged,
    CUDA's last error is reset (else torch's next launch would raise it), and a driver
    without read-only registration is asked again with plain flags."""
    stats = ClientStats()
    copier = CudaCopier(torch.device("cuda", 0), stats)
    slabs = [np.zeros(4096, dtype=np.uint8) for _ in range(3)]
    runtime = _RefusingRuntime({slabs[1].ctypes.data, slabs[2].ctypes.data})
    copier._cudart = runtime
    with caplog.at_level("WARNING", logger="client.memory.device_pages"):
        assert copier.register(slabs[0], writable=False) == slabs[0].ctypes.data
        assert copier.register(slabs[1], writable=False) is None
        assert copier.register(slabs[2], writable=True) is None
    assert runtime.calls[:2] == [(slabs[0].ctypes.data, 8), (slabs[0].ctypes.data, 0)]
    assert (stats.host_registrations, stats.host_register_failures, runtime.cleared) == (1, 2, 2)
    assert sum("cudaHostRegister" in r.getMessage() for r in caplog.records) == 1


class _PassingAt:
    """Stands in for a CUDA event (``query``, ``synchronize``) that passes at ``at``
    (``time.perf_counter``), noting when it was asked and whether a thread waited on it."""

    def __init__(self, at: float) -> None:
        self.at = at
        self.asked: list[float] = []
        self.waited = False

    def query(self) -> bool:
        self.asked.append(time.perf_counter())
        return self.asked[-1] >= self.at

    def synchronize(self) -> None:
        self.waited = True
        time.sleep(max(0.0, self.at - time.perf_counter()))


def _settle(after: float, until: float | None) -> tuple[_PassingAt, float]:
    async def run() -> tuple[_PassingAt, float]:
        event = _PassingAt(time.perf_counter() + after)
        start = time.perf_counter()
        await settled(event, None if until is None else start + until)
        return event, time.perf_counter()

    return asyncio.run(run())


def test_a_landing_is_waited_for_asleep_then_asked_every_turn_near_its_expected_end():
    """Given when a landing should end, the loop sleeps until shortly before it (asking
    nothing meanwhile), then asks its event every turn and returns within a few turns of
    its end, with no thread; asked for far too early, it asks for ``POLL_AFTER`` past
    the estimate, then waits in a thread; with no estimate, in a thread at once. Either
    way it never returns before the event passed."""
    event, returned = _settle(0.03, 0.03)
    assert not event.waited and event.at <= returned < event.at + 0.02
    second = event.asked[1]  # the first is the check on entry
    assert second >= event.at - POLL_BEFORE - 0.002  # asleep until shortly before
    event, returned = _settle(0.05, 0.0)
    assert event.waited and returned >= event.at
    assert event.asked[-1] - event.asked[0] < POLL_AFTER + 0.01  # gave up asking in time
    event, returned = _settle(0.02, None)
    assert event.waited and returned >= event.at and len(event.asked) <= 2


def test_a_copiers_pace_is_its_fastest_recent_landing():
    """``BusPace`` has no estimate before a landing was timed, then the fastest of the
    last ``KEPT`` landings of at least ``TIMED_BYTES`` (a slow one lowers nothing, a
    small one teaches nothing, and old ones are forgotten)."""
    pace, mib = BusPace(), 1 << 20
    assert pace.end(1.0, 100) is None
    pace.measured(8 * mib, 0.5)
    assert pace.end(1.0, 8 * mib) == pytest.approx(1.5)
    pace.measured(8 * mib, 2.0)  # a slow one (contention)
    pace.measured(mib, 1e-6)  # a small one: its rate is its fixed costs'
    assert pace.rate == pytest.approx(16 * mib)
    for _ in range(BusPace.KEPT):
        pace.measured(8 * mib, 1.0)
    assert pace.rate == pytest.approx(8 * mib)

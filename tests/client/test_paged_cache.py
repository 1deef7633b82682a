"""Gather and scatter between store pages and a paged KV cache (client/paging/paged_cache.py),
bit-exact for every physical layout a vLLM backend may give the per-layer view, and
the lookup circuit breaker (client/paging/breaker.py). Runs on CPU, and on CUDA too where a
GPU is present."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from client.memory.buffers import block_runs
from client.memory.staging import ALIGN, HostBuffers
from client.paging.breaker import CircuitBreaker
from client.paging.paged_cache import PagedCache
from client.paging.staging_pool import StagingPool
from kvstore.errors import InvalidInputError
from kvstore.pages.checksum import copy_checksummed

L, B, H, N, C = 3, 40, 2, 4, 6  # layers, blocks, kv heads, block size, 2 * head size
# Every order of the logical axes [L, B, H, N] in memory, content innermost: a superset
# of vLLM 0.32's KVCacheLayout members (checked below when vLLM is installed).
PERMUTATIONS = [(*p, 4) for p in itertools.permutations(range(4))]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def strided_cache(order: tuple[int, ...], device: str, seed: int) -> torch.Tensor:
    """A logical [L, B, H, N, C] tensor whose memory follows ``order``, filled with random
    bit patterns (NaN payloads included, which a lossy copy would change)."""
    logical_shape = (L, B, H, N, C)
    physical = (
        torch.randint(
            -(2**31),
            2**31 - 1,
            [logical_shape[i] for i in order],
            dtype=torch.int32,
            generator=torch.Generator().manual_seed(seed),
        )
        .view(torch.float32)
        .to(device)
    )
    inverse = [order.index(i) for i in range(5)]
    logical = physical.permute(*inverse)
    assert logical.shape == logical_shape
    return logical


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32).cpu()


BLOCK_LISTS = {
    "one run": list(range(5, 17)),
    "three runs": [7, 8, 9, 30, 31, 2, 3, 4, 5],
    "reversed": list(range(20, 8, -1)),
    "scattered": random.Random(3).sample(range(B), 36),
}


def test_the_permutations_cover_every_vllm_layout():
    layouts = pytest.importorskip("vllm.v1.kv_cache_layout")
    assert {m.value for m in layouts.KVCacheLayout} <= set(PERMUTATIONS)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("order", PERMUTATIONS, ids=lambda o: "".join("LBHNC"[i] for i in o))
@pytest.mark.parametrize("blocks", list(BLOCK_LISTS.values()), ids=list(BLOCK_LISTS))
@pytest.mark.parametrize("max_runs", [64, 1], ids=["runs", "indexed"])
def test_gather_then_scatter_is_bit_exact(order, blocks, device, max_runs, monkeypatch):
    monkeypatch.setattr(
        "client.paging.paged_cache._MAX_RUNS", max_runs
    )  # past it: one indexed copy per layer
    source = strided_cache(order, device, seed=1)
    gathered = PagedCache(list(source.unbind(0))).gather(blocks).wait()
    assert gathered.device.type == "cpu" and gathered.shape == (len(blocks), L, H, N, C)
    for i, block in enumerate(blocks):
        assert torch.equal(bits(gathered[i]), bits(source[:, block])), (i, block)

    target = strided_cache(order, device, seed=2)
    before = bits(target)
    PagedCache(list(target.unbind(0))).scatter(gathered, blocks)
    after = bits(target)
    for block in blocks:
        assert torch.equal(after[:, block], bits(source[:, block]))
    untouched = [b for b in range(B) if b not in blocks]
    assert torch.equal(after[:, untouched], before[:, untouched])


@pytest.mark.parametrize("order", PERMUTATIONS, ids=lambda o: "".join("LBHNC"[i] for i in o))
def test_block_spans_are_the_pages_in_place_for_every_layout(order):
    """``block_spans`` views each block of a host cache as its page, whatever the
    layers' strides: reading a span gives what ``gather`` copies out, and writing one
    (as a get straight into the cache does) changes that block of every layer and
    nothing else."""
    blocks = BLOCK_LISTS["scattered"]
    source = strided_cache(order, "cpu", seed=1)
    cache = PagedCache(list(source.unbind(0)))
    spans = cache.block_spans(blocks)
    gathered = cache.gather(blocks).wait()
    for i, span in enumerate(spans):
        page = np.empty(span.nbytes, dtype=np.uint8)
        copy_checksummed([(page, span.bytes())])
        assert np.array_equal(
            page, gathered[i].contiguous().view(torch.uint8).reshape(-1).numpy()
        ), i
    target = strided_cache(order, "cpu", seed=2)
    before = bits(target)
    into = PagedCache(list(target.unbind(0))).block_spans(blocks)
    for i, span in enumerate(into):
        copy_checksummed(
            [(span.bytes(), gathered[i].contiguous().view(torch.uint8).reshape(-1).numpy())]
        )
    after = bits(target)
    for block in blocks:
        assert torch.equal(after[:, block], bits(source[:, block]))
    untouched = [b for b in range(B) if b not in blocks]
    assert torch.equal(after[:, untouched], before[:, untouched])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("order", PERMUTATIONS, ids=lambda o: "".join("LBHNC"[i] for i in o))
def test_device_rows_exist_only_where_a_page_is_one_range_of_the_cache(order, device):
    """``device_rows`` (where a device get lands pages in place) is given only for a
    block-major cache, blocks outermost and layers next (vLLM's BLHNC, the byte order
    of a page): each row is then exactly the bytes ``gather`` copies out of its block.
    Every other order gives None, so its loads go through rows and a scatter."""
    blocks = BLOCK_LISTS["scattered"]
    source = strided_cache(order, device, seed=1)
    cache = PagedCache(list(source.unbind(0)))
    rows = cache.device_rows(blocks)
    if order != (1, 0, 2, 3, 4):  # BLHNC
        assert rows is None
        return
    assert rows is not None and rows.nbytes == cache.page_nbytes
    gathered = cache.gather(blocks).wait()
    for i in range(len(blocks)):
        assert torch.equal(
            rows[i].view().cpu(), gathered[i].contiguous().view(torch.uint8).reshape(-1)
        ), i
    with pytest.raises(InvalidInputError, match="outside"):
        cache.device_rows([B])


def test_a_layer_of_another_inner_order_makes_a_cache_not_block_major():
    """Layers sharing one block-major storage whose inner orders differ (one
    token-major among head-major ones) are not a page per block: no device rows, and
    block spans still give each block's page in the page's byte order."""
    storage = strided_cache((1, 0, 2, 3, 4), "cpu", seed=4)  # BLHNC, as [L, B, H, N, C]
    flat = storage.permute(1, 0, 2, 3, 4)  # [B, L, H, N, C], contiguous
    odd = flat[:, 1].reshape(B, N, H, C).permute(0, 2, 1, 3)  # layer 1 read token-major
    layers = [flat[:, 0], odd, flat[:, 2]]
    cache = PagedCache(layers)
    assert cache.device_rows([1, 2]) is None
    spans = cache.block_spans([5])
    page = np.empty(spans[0].nbytes, dtype=np.uint8)
    copy_checksummed([(page, spans[0].bytes())])
    want = torch.stack([kv[5] for kv in layers]).contiguous().view(torch.uint8).reshape(-1)
    assert np.array_equal(page, want.numpy())


def test_a_cache_without_a_contiguous_last_dimension_has_no_block_spans():
    layers = [torch.zeros(C, B, H, N).permute(1, 2, 3, 0) for _ in range(L)]  # content outermost
    assert PagedCache(layers).block_spans([0, 1]) is None


def test_block_runs_split_at_every_gap():
    assert block_runs([4, 5, 6, 9, 10, 2]) == [(0, 4, 3), (3, 9, 2), (5, 2, 1)]
    assert block_runs([]) == []


def test_bad_arguments_are_named():
    cache = PagedCache(list(torch.zeros(L, B, H, N, C).unbind(0)))
    with pytest.raises(InvalidInputError, match="outside the cache"):
        cache.gather([0, B])
    with pytest.raises(InvalidInputError, match="pages must be"):
        cache.scatter(torch.zeros(2, L, H, N, C, dtype=torch.float16), [1, 2])
    with pytest.raises(InvalidInputError, match="layer 1"):
        PagedCache([torch.zeros(B, H, N, C), torch.zeros(B, H, N, C + 2)])


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_consecutive_faults_and_probes_after_the_cooldown():
    clock = FakeClock()
    breaker = CircuitBreaker(failures=3, cooldown=2.0, max_cooldown=5.0, clock=clock)
    for _ in range(2):
        assert breaker.allow()
        breaker.record(False)
    assert breaker.allow()
    breaker.record(True)  # a success resets the streak
    for _ in range(3):
        assert breaker.allow()
        breaker.record(False)
    assert breaker.state == "open" and not breaker.allow()
    clock.now += 2.0
    assert breaker.allow() and not breaker.allow()  # one probe at a time
    breaker.record(False)  # the probe failed: open for twice as long
    clock.now += 3.9
    assert not breaker.allow()
    clock.now += 0.2
    assert breaker.allow()
    breaker.record(False)
    assert breaker.current_cooldown == 5.0  # capped
    clock.now += 5.0
    assert breaker.allow()
    breaker.record(True)
    assert breaker.state == "closed" and breaker.allow() and breaker.opened == 3


def test_staging_pool_takes_pages_of_the_one_host_pool_and_never_waits():
    """The connector's page buffers are pages of the client's host-buffer pool: what
    staging gives back, the client's next take gets, and past the pool's bound a take
    gets fresh pages at once instead of waiting."""
    cache = PagedCache(list(torch.zeros(L, B, H, N, C).unbind(0)))
    host = HostBuffers(growth=1)  # no growth, so the bound is the reservation
    pool = StagingPool(cache, buffers=2, pages=8, pool=host)
    per_buffer = -(-8 * cache.page_nbytes // ALIGN) * ALIGN
    assert cache.page_nbytes == L * H * N * C * 4 and host.reserved == 2 * per_buffer
    a, b = pool.take_pages(8), pool.take_pages(3)
    assert (
        a.shape == (8, L, H, N, C)
        and b.shape == (3, L, H, N, C)
        and a.dtype == b.dtype == torch.float32
    )
    extra = pool.take_pages(8)  # the reservation is out: fresh pages, at once
    assert host.fresh_takes == 1 and extra.shape == (8, L, H, N, C)
    pooled = {a.data_ptr(), b.data_ptr()}
    assert extra.data_ptr() not in pooled
    for t in (extra, b):
        pool.give_pages(t)
    again = pool.take_pages(5)
    assert again.data_ptr() == b.data_ptr()  # the pool's pages came back, not fresh ones
    pool.give_pages(a)
    assert (
        host.take_buffer(per_buffer).ctypes.data == a.data_ptr()
    )  # the client's scratch gets what staging gave back


def test_staging_pages_carry_a_gather_and_scatter_bit_exact():
    src_layers = list(strided_cache((1, 0, 2, 3, 4), "cpu", seed=3))
    dst_layers = list(torch.zeros(L, B, H, N, C).unbind(0))
    src, dst = PagedCache(src_layers), PagedCache(dst_layers)
    pool = StagingPool(src, buffers=1, pages=6, pool=HostBuffers())
    ids = [3, 4, 5, 11, 20, 21]
    pages = pool.take_pages(len(ids))
    pages.view(torch.int32).fill_(-1)  # whatever the pool held before
    src.gather(ids, pages).wait()
    dst.scatter(pages, ids)
    for s_kv, d_kv in zip(src_layers, dst_layers):
        assert torch.equal(bits(d_kv)[ids], bits(s_kv)[ids])
        assert not bits(d_kv)[[0, 1, 2]].any()  # blocks not named stay untouched
    pool.give_pages(pages)


@pytest.mark.parametrize("device", DEVICES)
def test_scatter_writes_a_range_of_heads_and_leaves_the_others(device):
    """A strided view of some heads (the vLLM connector's head-group loads, cut by
    ``heads.rank_parts``) is written at its head offset only; other heads keep their
    bytes, and a range outside the cache's heads is refused."""
    layers = list(strided_cache((0, 1, 2, 3, 4), device, seed=7))
    cache = PagedCache(layers)
    before = [bits(kv) for kv in layers]
    wide = torch.randn(5, L, H + 1, N, C)  # a buffer with more heads than the cache
    part = wide[:, :, 2:3]  # one head, strided
    cache.scatter(part, [4, 5, 9, 10, 11], head_at=1)
    for layer, kv in enumerate(layers):
        got = bits(kv)
        assert torch.equal(got[[4, 5, 9, 10, 11], 1], bits(part[:, layer, 0]))
        assert torch.equal(got[:, 0], before[layer][:, 0])
        untouched = [b for b in range(B) if b not in (4, 5, 9, 10, 11)]
        assert torch.equal(got[untouched], before[layer][untouched])
    with pytest.raises(InvalidInputError, match="outside the cache"):
        cache.scatter(part, [4], head_at=H)


@pytest.mark.parametrize("device", DEVICES)
def test_hybrid_layers_gather_and_scatter_their_own_rows(device):
    """Hybrid groups (each layer its own group's blocks, a sliding layer skipping the
    positions below its window): ``gather_layers`` fills each layer's rows of the host
    pages and zeros a layer's part of the rows it skips (never a pooled buffer's stale
    bytes); rows not gathered now stay as they were (on a GPU through the save stream);
    ``scatter_layers`` writes them back into those blocks only."""
    cache = PagedCache(
        [strided_cache((0, 1, 2, 3, 4), device, seed=7)[layer] for layer in range(L)]
    )
    # layer 0: full attention, positions 0-3 in blocks 3-6; layers 1-2: a sliding group
    # whose blocks of positions 0-1 are the null block (skipped)
    rows = [([0, 1, 2, 3], [3, 4, 5, 6]), ([2, 3], [10, 11]), ([2, 3], [10, 11])]
    out = torch.full((5, *cache.page_shape), 7.0)  # row 4: gathered in an earlier step
    cache.gather_layers(rows, out).wait()
    for layer, (positions, blocks) in enumerate(rows):
        for p in range(5):
            want = (
                cache.layers[layer][blocks[positions.index(p)]]
                if p in positions
                else torch.full(cache.page_shape[1:], 7.0 if p == 4 else 0.0)
            )
            assert torch.equal(bits(out[p, layer]), bits(want)), (layer, p)
    fresh = PagedCache([torch.zeros_like(kv) for kv in cache.layers])
    assert (
        fresh.scatter_layers(out, rows)
        == sum(len(p) for p, _ in rows) * cache.layers[0][0].numel() * 4
    )
    for layer, kv in enumerate(fresh.layers):
        blocks = rows[layer][1]
        others = [b for b in range(B) if b not in blocks]
        assert (
            torch.equal(bits(kv[blocks]), bits(cache.layers[layer][blocks]))
            and not kv[others].any()
        )

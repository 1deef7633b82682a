"""The client's paged API: staged and direct gets, every data path across processes,
gets straight into a strided cache, same-host slab mapping, device memory through
checked host staging, puts from a later block, the asyncio client."""

from __future__ import annotations

import time

import pytest
import torch

from client import KVCacheClient
from kvstore import InvalidInputError, block_hashes
from tests.support.client_fixtures import (  # noqa: F401 (fixtures)
    BLOCK,
    client,
    cluster,
    make_ns,
    ns,
    same,
    single_index_cluster,
)
from tests.support.helpers import corrupt_entry_checksums, pages_for, run_worker


def test_paged_api_staged_and_direct_give_identical_tensors(cluster, ns):
    tokens = list(range(40 * BLOCK + 3))
    pages = pages_for(ns, tokens)
    with (
        KVCacheClient(cluster.redis_url, ns, transfer_mode="direct") as direct,
        KVCacheClient(cluster.redis_url, ns, transfer_mode="staged") as staged,
    ):
        assert direct.put_pages(tokens, pages).stored == 40
        out_direct = torch.full((48, *ns.page_shape), 7, dtype=torch.float16)
        out_staged = torch.full((48, *ns.page_shape), 9, dtype=torch.float16)
        assert direct.get_pages(tokens, out_direct) == 40 * BLOCK
        assert staged.get_pages(tokens, out_staged) == 40 * BLOCK
        assert same(out_direct[:40], out_staged[:40]) and same(out_direct[:40], pages)
        assert (
            direct.stats.direct_transfers == 1
            and staged.stats.staged_transfers == 1
            and direct.stats.staged_transfers == 0
        )


@pytest.mark.parametrize("same_host", [True, False], ids=["shared-memory", "ucx"])
@pytest.mark.parametrize("page_kib", [64, 2048])
def test_every_data_path_moves_pages_bit_exact_across_processes(
    single_index_cluster, same_host, page_kib
):
    """Put in one process, get in another, over shared memory (kvstore.wire.shm) and over
    UCX, straight into the caller's tensor and through staging, with pages the node
    does not hold mixed in (a shorter prefix)."""
    cluster = single_index_cluster
    from tests.support.helpers import namespace_for_page_size, spec

    ns = namespace_for_page_size(page_kib << 10, tenant=f"paths-{same_host}-{page_kib}")
    tokens = list(range(12 * ns.block_size))
    options = {"same_host": same_host}
    stored = run_worker(
        spec(cluster, ns, "put_pages", tokens=tokens[: 8 * ns.block_size], options=options)
    )
    assert (
        stored["reports"][0]["stored"] == 8
        and (stored["stats"]["same_host_transfers"] > 0) == same_host
    )
    for mode in ("direct", "staged"):
        got = run_worker(
            spec(
                cluster, ns, "get_pages", tokens=tokens, options={**options, "transfer_mode": mode}
            )
        )
        assert got["results"] == [{"blocks": 12, "matched": 8, "exact": True}]
        assert (got["stats"]["same_host_transfers"] > 0) == same_host
        assert got["stats"][f"{mode}_transfers"] == 1


def test_async_client_on_its_own_event_loop(cluster):
    import json
    import os
    import subprocess
    import sys

    from tests.support.helpers import ROOT

    env = {**os.environ, "PYTHONPATH": str(ROOT), "UCX_NET_DEVICES": "lo"}
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests" / "support" / "async_client_script.py"),
            cluster.redis_url,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # 5 full blocks + 1 tail part, each on two replicas; lookup and get_pages ran concurrently
    assert result == {
        "sent": 12,
        "matched": 83,
        "exact": True,
        "lookup": 80,
        "pages": 80,
        "pages_exact": True,
    }


@pytest.mark.parametrize("block_major", [True, False], ids=["block-major", "layer-major"])
@pytest.mark.parametrize("same_host", [True, False], ids=["shared-memory", "ucx"])
def test_get_found_into_writes_pages_straight_into_a_strided_cache(
    cluster, same_host, block_major, monkeypatch
):
    """``get_found_into`` lands every verified page in the blocks of a paged cache whose
    layers are strided views (``PagedCache.block_spans``), from ``start_block`` on;
    blocks it was not asked for stay as they were, and a corrupted page ends the prefix.
    A block-major cache (each block's layers back to back) gives contiguous spans, so
    UCX receives consecutive blocks straight into it, with no scratch buffer; a
    layer-major one lands each run in one scratch buffer first."""
    from client.memory.staging import HostBuffers
    from client.paging.paged_cache import PagedCache

    ns = make_ns(f"into-{same_host}-{block_major}", layout="vllm_cpu", num_layers=3)
    n = 6
    tokens = list(range(n * BLOCK))
    pages = pages_for(ns, tokens)  # [n, L, H, B, KV]
    L = ns.num_layers
    if (
        block_major
    ):  # per layer [blocks, H, B, KV], blocks interleaved with the other layers' in memory
        storage = torch.zeros((20, L, *ns.page_shape[1:]), dtype=pages.dtype)
        cache = PagedCache([storage[:, layer] for layer in range(L)])
    else:
        cache = PagedCache(
            [torch.zeros((20, *ns.page_shape[1:]), dtype=pages.dtype) for _ in range(L)]
        )
    block_ids = [17, 3, 6, 7, 8, 9]  # those fetched are consecutive: one message can land in place
    assert all(bool(s.pieces) != block_major for s in cache.block_spans(block_ids))
    scratch = []
    take = HostBuffers.take_buffer
    monkeypatch.setattr(
        HostBuffers,
        "take_buffer",
        lambda self, nbytes: scratch.append(nbytes) or take(self, nbytes),
    )
    with KVCacheClient(cluster.redis_url, ns, same_host=same_host) as client:
        assert client.put_pages(tokens, pages).stored == n
        found = client.find(tokens)
        assert found.blocks == n
        scratch.clear()
        assert client.get_found_into(found, cache.block_spans(block_ids[2:]), start_block=2) == len(
            tokens
        )
        assert bool(scratch) == (not same_host and not block_major), scratch
        got = cache.gather(block_ids).wait()
        assert torch.equal(got[2:].view(torch.int16), pages[2:].view(torch.int16))
        assert not got[:2].view(torch.int16).any()  # blocks before start_block untouched
        assert corrupt_entry_checksums(cluster.redis_url, ns, block_hashes(ns, tokens), 4) == 1
        fresh = client.find(tokens)
        assert (
            client.get_found_into(fresh, cache.block_spans(block_ids), start_block=0) == 4 * BLOCK
        )
        with pytest.raises(InvalidInputError, match="sinks"):
            client.get_found_into(fresh, cache.block_spans(block_ids[:2]))


def _mapped_slabs(client: KVCacheClient) -> set[int]:
    """Slabs the client's same-host connections map, once its start's probes are done."""
    deadline = time.monotonic() + 10
    while not client._async._connecting.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    return {
        region
        for conn in client._async.nodes._conns.values()
        for region in getattr(conn, "_maps", {})
    }


def test_a_fresh_same_host_client_maps_its_tenants_slabs_at_start(cluster):
    """A same-host client's start probe is lent its tenant's slabs read-only
    (server/dataplane/same_host.py PROBE_MAP_BYTES), so its first get maps nothing; another
    tenant's client is lent none of them."""
    mine, other = make_ns("probe-maps"), make_ns("probe-maps-other")
    tokens = list(range(6 * BLOCK))
    pages = pages_for(mine, tokens)
    with KVCacheClient(cluster.redis_url, mine) as writer:
        assert writer.put_pages(tokens, pages).stored == 6
        written = _mapped_slabs(writer)
    assert written
    with KVCacheClient(cluster.redis_url, mine) as reader:
        assert _mapped_slabs(reader) >= written  # before any get
        out = torch.zeros_like(pages)
        assert reader.get_pages(tokens, out) == len(tokens)
        assert torch.equal(out.view(torch.int16), pages.view(torch.int16))
    with KVCacheClient(cluster.redis_url, other) as stranger:
        assert not _mapped_slabs(stranger) & written


def test_device_memory_is_reached_through_checked_host_staging(cluster, ns):
    """A get into device memory that no device copier of the client reaches (here: the
    meta device; CUDA's is tests/client/test_device_loads.py) lands in pinned host memory,
    where each page is checked against its checksum, then moves in one copy; asking for
    it 'direct' is refused by name (a check that read host memory failed: a silent miss)."""
    with KVCacheClient(cluster.redis_url, ns, timeout=5, same_host=False) as cl:
        device = torch.empty(1, device="meta")  # any memory but the host's
        assert cl._async._mode_for(device) == "staged"
    with KVCacheClient(
        cluster.redis_url, ns, timeout=5, same_host=False, transfer_mode="direct"
    ) as cl:
        with pytest.raises(
            InvalidInputError, match="transfer_mode='direct' into meta memory needs a device copier"
        ):
            cl._async._mode_for(device)
        assert (
            cl._async._mode_for(torch.empty(1)) == "direct"
        )  # host memory: checked where it lands


def test_put_pages_from_a_later_block_extends_a_stored_prefix(client):
    """``start_block``: a caller holding only the pages past a stored prefix (the vLLM
    connector's hybrid engines after a hit) stores them as those blocks, placed in the
    segments a lookup from block 0 reads, across a segment boundary; alone they extend
    nothing (the blocks before them are not stored)."""
    tokens = list(range(70 * BLOCK + 5))  # 70 full blocks: two segments of the index
    pages = pages_for(client.namespace, tokens)
    assert client.put_pages(tokens[: 40 * BLOCK], pages[:40]).refused == 0
    assert client.put_pages(tokens, pages[40:], start_block=40).refused == 0
    out = torch.zeros_like(pages)
    assert client.get_pages(tokens, out) == 70 * BLOCK and same(out, pages)
    other = [t + 100_000 for t in tokens]  # a chain whose first 66 blocks were never stored
    assert (
        client.put_pages(other, pages_for(client.namespace, other)[66:], start_block=66).refused
        == 0
    )
    assert client.find(other).blocks == 0
    with pytest.raises(
        InvalidInputError, match="start_block 71 must lie within the 70 full blocks"
    ):
        client.put_pages(tokens, pages[:0], start_block=71)

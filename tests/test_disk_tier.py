"""The disk tier (server/disk/): real node processes, real files in a temporary
directory, real UCX and same-host transfers, a real Valkey index."""

from __future__ import annotations

import os
import signal
import subprocess
import urllib.request

import pytest

from kvstore import block_hashes
from kvstore.index import PageIndex
from tests.helpers import advertised_prefix, metrics, namespace_for_page_size, run_worker, spec, wait_for

PAGE = 256 << 10  # 256 KiB pages: a 4 MiB pool holds 16 minus what the watermarks keep free
OPTS = {"lease_ms": 0}


def batches_of(ns, count: int, blocks: int) -> list[list[int]]:
    return [list(range(b * 100_000, b * 100_000 + blocks * ns.block_size)) for b in range(count)]


def put_all(cluster, ns, batches, **options) -> int:
    reports = run_worker(spec(cluster, ns, "put_pages", token_lists=batches, options={**OPTS, **options}))["reports"]
    return sum(r["stored"] for r in reports)


def get_all(cluster, ns, batches, **options) -> list[dict]:
    return run_worker(spec(cluster, ns, "get_pages", token_lists=batches, options={**OPTS, **options}))["results"]


def disk_cluster(clusters, tmp_path, capacity="4MiB", disk="64MiB", extra=None, **kw):
    return clusters(capacity=capacity, slab="1MiB", disk_path=str(tmp_path / "disk"), disk_capacity=disk, extra=extra, **kw)


def wait_clean(cluster, node="node-0", pages=None, timeout=20.0) -> dict:
    """Wait until the demoter is idle: nothing written for a moment and (if given) ``pages`` on disk."""
    def settled():
        first = metrics(cluster, node)
        if pages is not None and first['kvstore_tier_pages{tier="disk"}'] < pages:
            return False
        return first
    return wait_for(settled, timeout, "the demoter to write the pages")


@pytest.mark.parametrize("same_host", [True, False], ids=["shm", "ucx"])
def test_pages_evicted_from_memory_come_back_from_disk_bit_exact(clusters, tmp_path, same_host):
    cluster = disk_cluster(clusters, tmp_path)
    ns = namespace_for_page_size(PAGE, tenant=f"demote-{same_host}")
    batches = batches_of(ns, 8, 4)  # 32 pages, 8 MiB: twice the pool
    assert put_all(cluster, ns, batches) == 32
    index = PageIndex(cluster.redis_url)
    # every page is still advertised: none was dropped, the old ones went to disk
    assert [advertised_prefix(index, ns, block_hashes(ns, b), lease_ms=0) for b in batches] == [4] * 8
    got = get_all(cluster, ns, batches, same_host=same_host)
    assert [r["matched"] for r in got] == [4] * 8 and all(r["exact"] for r in got)
    m = metrics(cluster, "node-0")
    assert m['kvstore_tier_hit_pages_total{tier="disk"}'] >= 8
    assert m["kvstore_promoted_pages_total"] >= 8 and m["kvstore_memory_released_pages_total"] >= 8
    assert m["kvstore_evicted_pages_total"] == 0 and m["kvstore_used_bytes"] <= 4 << 20
    assert m['kvstore_disk_errors_total{kind="checksum"}'] == 0 and m["kvstore_disk_direct_io"] == 1

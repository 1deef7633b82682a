"""The disk tier (server/disk/): real node processes, real files in a temporary
directory, real UCX and same-host transfers, a real Valkey index."""

from __future__ import annotations

import os
import signal
import subprocess
import urllib.request

import numpy as np
import pytest

from kvstore import block_hashes
from kvstore.index import PageIndex
from server.disk.files import DATA_FILE, MAP_FILE
from server.disk.layout import HEADER_BYTES, RecordHeader
from tests.support.helpers import (
    advertised_prefix,
    metrics,
    namespace_for_page_size,
    run_worker,
    spec,
    wait_for,
)

SLAB = 1 << 20
PAGE = 256 << 10  # 256 KiB pages: a 4 MiB pool holds 16 minus what the watermarks keep free
OPTS = {"lease_ms": 0}


def batches_of(ns, count: int, blocks: int) -> list[list[int]]:
    return [list(range(b * 100_000, b * 100_000 + blocks * ns.block_size)) for b in range(count)]


def put_all(cluster, ns, batches, **options) -> int:
    reports = run_worker(
        spec(cluster, ns, "put_pages", token_lists=batches, options={**OPTS, **options})
    )["reports"]
    return sum(r["stored"] for r in reports)


def get_all(cluster, ns, batches, **options) -> list[dict]:
    return run_worker(
        spec(cluster, ns, "get_pages", token_lists=batches, options={**OPTS, **options})
    )["results"]


def disk_cluster(clusters, tmp_path, capacity="4MiB", disk="64MiB", extra=None, **kw):
    return clusters(
        capacity=capacity,
        slab="1MiB",
        disk_path=str(tmp_path / "disk"),
        disk_capacity=disk,
        extra=extra,
        **kw,
    )


def disk_pages(cluster, node="node-0") -> float:
    return metrics(cluster, node)['kvstore_tier_pages{tier="disk"}']


def records_on_disk(directory) -> dict[bytes, tuple[int, RecordHeader]]:
    """Every valid record in a node's disk tier: page hash -> (file offset, header)."""
    files = str(directory)
    with open(os.path.join(files, MAP_FILE), "rb") as f:
        classes = np.frombuffer(f.read(), dtype="<u8")
    out = {}
    with open(os.path.join(files, DATA_FILE), "rb") as f:
        for slab, slot in enumerate(classes.tolist()):
            for k in range(SLAB // slot if slot else 0):
                offset = slab * SLAB + k * slot
                f.seek(offset)
                header = RecordHeader.unpack(f.read(HEADER_BYTES))
                if header is not None and header.slot_size == slot:
                    out[header.page_hash] = (offset, header)
    return out


def wait_ready(cluster, node_id="node-0") -> None:
    """Until the node's /readyz says 200: registered, and its recovered pages re-published."""

    def ready():
        node = next(n for n in PageIndex(cluster.redis_url).live_nodes() if n.node_id == node_id)
        try:
            return (
                urllib.request.urlopen(f"http://{node.extra['metrics']}/readyz", timeout=5).status
                == 200
            )
        except OSError:
            return False

    wait_for(ready, 20, "the restarted node to be ready")


def tier_bytes(directory) -> int:
    """Bytes the tier's files take: their sizes, and the blocks they hold."""
    total = blocks = 0
    for name in os.listdir(directory):
        st = os.stat(os.path.join(directory, name))
        total += st.st_size
        blocks += st.st_blocks * 512
    return max(total, blocks)


@pytest.mark.parametrize("same_host", [True, False], ids=["shm", "ucx"])
def test_pages_evicted_from_memory_come_back_from_disk_bit_exact(clusters, tmp_path, same_host):
    cluster = disk_cluster(clusters, tmp_path)
    ns = namespace_for_page_size(PAGE, tenant=f"demote-{same_host}")
    batches = batches_of(ns, 8, 4)  # 32 pages, 8 MiB: twice the pool
    assert put_all(cluster, ns, batches) == 32
    index = PageIndex(cluster.redis_url)
    # every page is still advertised: none was dropped, the old ones went to disk
    assert [advertised_prefix(index, ns, block_hashes(ns, b), lease_ms=0) for b in batches] == [
        4
    ] * 8
    got = get_all(cluster, ns, batches, same_host=same_host)
    assert [r["matched"] for r in got] == [4] * 8 and all(r["exact"] for r in got)
    m = metrics(cluster, "node-0")
    assert m['kvstore_tier_hit_pages_total{tier="disk"}'] >= 8
    assert m["kvstore_promoted_pages_total"] >= 8 and m["kvstore_memory_released_pages_total"] >= 8
    assert m["kvstore_evicted_pages_total"] == 0 and m["kvstore_used_bytes"] <= 4 << 20
    assert m['kvstore_disk_errors_total{kind="checksum"}'] == 0 and m["kvstore_disk_direct_io"] == 1


def test_kill_9_while_demoting_then_restart_serves_only_right_pages(clusters, tmp_path):
    cluster = disk_cluster(clusters, tmp_path, extra=["--disk-policy", "write-through"])
    ns = namespace_for_page_size(PAGE, tenant="crash")
    first = batches_of(ns, 8, 4)
    assert put_all(cluster, ns, first) == 32
    wait_for(lambda: disk_pages(cluster) >= 32, 20, "32 pages on disk")
    # more puts, every page written through, and the node killed in the middle of them
    more = [
        list(range(900_000 + b * 1000, 900_000 + b * 1000 + 4 * ns.block_size)) for b in range(40)
    ]
    writer = run_worker(
        spec(cluster, ns, "put_pages", token_lists=more, options=OPTS), background=True
    )
    wait_for(
        lambda: metrics(cluster, "node-0")["kvstore_demoted_pages_total"] >= 48,
        30,
        "demotion under way",
    )
    cluster.nodes[0].kill(signal.SIGKILL)
    writer.communicate(timeout=60)  # it may fail or not: the node died under it
    restarted = cluster.add_node("node-0")
    cluster.wait_registered()
    wait_ready(cluster)
    assert "recovered" in restarted.log()
    got = get_all(cluster, ns, first + more)
    assert all(r["exact"] for r in got), "a page served after the crash was wrong"
    # what was on disk before the crash is served again, from disk
    assert [r["matched"] for r in got[:8]] == [4] * 8
    m = metrics(cluster, "node-0")
    assert m['kvstore_tier_hit_pages_total{tier="disk"}'] >= 32


def test_a_flipped_byte_on_disk_is_a_counted_miss_never_wrong_kv(clusters, tmp_path):
    cluster = disk_cluster(clusters, tmp_path)
    ns = namespace_for_page_size(PAGE, tenant="flip")
    batches = batches_of(ns, 8, 4)
    assert put_all(cluster, ns, batches) == 32
    victim = block_hashes(ns, batches[0])[1]
    offset, header = records_on_disk(tmp_path / "disk" / "node-0")[victim]
    with open(tmp_path / "disk" / "node-0" / DATA_FILE, "r+b") as f:
        f.seek(offset + HEADER_BYTES + 1000)
        byte = f.read(1)
        f.seek(offset + HEADER_BYTES + 1000)
        f.write(bytes([byte[0] ^ 0x40]))
    got = get_all(cluster, ns, batches[:1])
    assert got == [{"blocks": 4, "matched": 1, "exact": True}]
    m = metrics(cluster, "node-0")
    assert m['kvstore_disk_errors_total{kind="checksum"}'] == 1
    # the page left the index with its record: the prefix now ends before it everywhere
    assert (
        advertised_prefix(
            PageIndex(cluster.redis_url), ns, block_hashes(ns, batches[0]), lease_ms=0
        )
        == 1
    )


def mounted(tmp_path, fstype: str, *options: str):
    """A fresh filesystem of ``fstype`` under ``tmp_path`` (skips where mount is not allowed)."""
    mount = tmp_path / fstype
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", fstype, *options, fstype, str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a {fstype} here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture()
def small_filesystem(tmp_path):
    """A 3 MiB tmpfs: room for the tier's first two slabs of 1 MiB, not a third."""
    yield from mounted(tmp_path, "tmpfs", "-o", "size=3m")


@pytest.fixture()
def ramfs(tmp_path):
    """A ramfs: a filesystem that refuses O_DIRECT (EINVAL at open; tmpfs takes it
    since Linux 6.6)."""
    yield from mounted(tmp_path, "ramfs")


def test_disk_full_degrades_the_tier_and_memory_keeps_serving(clusters, small_filesystem):
    cluster = clusters(
        capacity="4MiB", slab="1MiB", disk_path=str(small_filesystem), disk_capacity="64MiB"
    )
    ns = namespace_for_page_size(PAGE, tenant="full")
    batches = batches_of(ns, 8, 4)
    assert put_all(cluster, ns, batches) == 32  # every put is stored, the node never refuses
    m = metrics(cluster, "node-0")
    assert m["kvstore_disk_degraded"] == 1 and m['kvstore_disk_errors_total{kind="nospace"}'] >= 1
    node = PageIndex(cluster.redis_url).live_nodes()[0]
    body = (
        urllib.request.urlopen(f"http://{node.extra['metrics']}/healthz", timeout=5).read().decode()
    )
    assert body.startswith("ok\n") and "disk tier degraded" in body
    assert "ERROR" in cluster.nodes[0].log()
    # memory still works: the newest pages are there, bit-exact, and new puts are stored
    got = get_all(cluster, ns, batches[-2:])
    assert got == [{"blocks": 4, "matched": 4, "exact": True}] * 2
    assert put_all(cluster, ns, batches_of(ns, 10, 4)[8:]) == 8


def test_o_direct_refused_falls_back_to_buffered_io_and_says_so(clusters, ramfs):
    cluster = clusters(capacity="4MiB", slab="1MiB", disk_path=str(ramfs), disk_capacity="32MiB")
    ns = namespace_for_page_size(PAGE, tenant="buffered")
    batches = batches_of(ns, 8, 4)
    assert put_all(cluster, ns, batches) == 32
    got = get_all(cluster, ns, batches)
    assert got == [{"blocks": 4, "matched": 4, "exact": True}] * 8
    m = metrics(cluster, "node-0")
    assert m["kvstore_disk_direct_io"] == 0 and m['kvstore_tier_hit_pages_total{tier="disk"}'] >= 8
    assert m["kvstore_disk_degraded"] == 0
    assert "refuses O_DIRECT" in cluster.nodes[0].log()


def test_disk_files_stay_within_capacity_and_evicted_pages_leave_the_index(clusters, tmp_path):
    cluster = disk_cluster(
        clusters, tmp_path, disk="5MiB"
    )  # 4 slabs of 1 MiB: 12 pages of 256 KiB + headers
    ns = namespace_for_page_size(PAGE, tenant="capacity")
    batches = batches_of(ns, 24, 4)  # 96 pages, 24 MiB
    directory = tmp_path / "disk" / "node-0"
    for start in range(0, 24, 4):
        assert put_all(cluster, ns, batches[start : start + 4]) == 16
        assert tier_bytes(directory) <= 5 << 20
    m = metrics(cluster, "node-0")
    assert m["kvstore_disk_evicted_pages_total"] > 0
    assert (
        m['kvstore_tier_used_bytes{tier="disk"}']
        <= m['kvstore_tier_capacity_bytes{tier="disk"}']
        <= 4 << 20
    )
    index = PageIndex(cluster.redis_url)
    prefixes = [advertised_prefix(index, ns, block_hashes(ns, b), lease_ms=0) for b in batches]
    assert prefixes[0] == 0 and prefixes[-1] == 4  # the oldest left disk and the index
    # what the index shows is there, byte for byte (reads promote pages and may push
    # others out, so later batches can only lose pages, never gain any)
    got = get_all(cluster, ns, batches[::-1])[::-1]
    assert got[-1]["matched"] == 4 and all(r["exact"] for r in got)
    assert all(r["matched"] <= p for r, p in zip(got, prefixes))


def test_tenant_quota_holds_in_both_tiers(clusters, tmp_path):
    cluster = disk_cluster(clusters, tmp_path, disk="9MiB", extra=["--tenant-quota", "0.5"])
    heavy = namespace_for_page_size(PAGE, tenant="heavy")
    light = namespace_for_page_size(PAGE, tenant="light")
    kept = batches_of(light, 2, 4)  # 8 pages: 8 of the disk's 24 slots, under half its bytes
    assert put_all(cluster, light, kept) == 8
    for start in range(0, 16, 4):  # the heavy tenant writes 64 pages, far past both tiers' halves
        put_all(cluster, heavy, batches_of(heavy, 16, 4)[start : start + 4])
    # the light tenant's pages all survive, in one tier or the other
    got = get_all(cluster, light, kept)
    assert got == [{"blocks": 4, "matched": 4, "exact": True}] * 2
    records = records_on_disk(tmp_path / "disk" / "node-0")
    heavy_bytes = sum(h.slot_size for _, h in records.values() if h.tenant == "heavy")
    assert 0 < heavy_bytes <= 0.5 * (8 << 20)


def test_stats_show_both_tiers(clusters, tmp_path):
    import json
    import sys

    cluster = disk_cluster(clusters, tmp_path)
    ns = namespace_for_page_size(PAGE, tenant="stats-tiers")
    batches = batches_of(ns, 8, 4)
    assert put_all(cluster, ns, batches) == 32
    assert get_all(cluster, ns, batches[:1]) == [{"blocks": 4, "matched": 4, "exact": True}]
    env = {**os.environ, "UCX_NET_DEVICES": "lo"}

    def node_stats() -> dict:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvstore.tools.cli",
                "stats",
                "--json",
                "--redis-url",
                cluster.redis_url,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["nodes"][0]

    wait_for(
        lambda: node_stats().get("disk_hits") == 4, 10, "the heartbeat to carry the disk reads"
    )
    node = node_stats()
    assert (
        node["disk_capacity"] == 63 << 20
        and node["disk_pages"] >= 24
        and node["disk_used"] >= 24 * (PAGE + HEADER_BYTES)
    )
    assert node["memory_pages"] <= 16 and node["disk_degraded"] == 0
    text = subprocess.run(
        [sys.executable, "-m", "kvstore.tools.cli", "stats", "--redis-url", cluster.redis_url],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    ).stdout
    assert "disk 6" in text and "4 read from disk" in text

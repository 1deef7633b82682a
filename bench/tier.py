"""The disk tier against its ceilings, in one run.

    python bench/tier.py [--dir /var/tmp/kvstore-tier] [--repeat 3] [--restart-gib 4]

Each part compares side by side, interleaved (A B A B), medians with min-max:

1. **Reads from disk**: `fio` 2 MiB direct reads on the same directory (four `psync`
   threads, the engine the tier uses, and `io_uring` at queue depth 4) against kvstore
   gets of disk-resident 2 MiB pages end to end (the same-host path: index lookup,
   read from disk into the node's pool, verify, copy into the caller's tensor,
   verify) by two reader threads (fio runs four jobs), as GB/s and a ratio to the
   best fio figure. Reads of one get run on the node's reader threads at once; the
   copy to the caller starts when all its pages are in memory, so a second reader
   keeps the disk busy meanwhile (one reader: about 1.4 GB/s here against 1.5-1.9).
2. **Hit rate**: a node whose working set is 4x its memory (and fits on disk), against
   the same node without a disk tier: pages put, then every prefix looked up; the share
   of pages that unlimited memory would hit (all of them) that are hits.
3. **Puts while memory is full**: put throughput of a node that must evict (and, with
   the disk tier, demote) against the same node without a disk tier, as a ratio.
4. **Warm restart**: a node holding ``--restart-gib`` GiB on disk is killed (-9) and
   started again; seconds until a get of its pages hits.
5. **Idle**: the CPU of a node with a disk tier and nothing to do, over 5 s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.benchcommon.proc import cpu_seconds
from bench.transfers.worker import namespace_for
from client import KVCacheClient
from kvstore.tools.launcher import LocalCluster

PAGE = 2 << 20
GB = 1e9


def fmt(samples: list[float], unit: str = "") -> str:
    return f"{statistics.median(samples):.2f}{unit} ({min(samples):.2f}-{max(samples):.2f})"


def fio(directory: str, engine: str, size_mib: int) -> float:
    """fio's 2 MiB direct read bandwidth in GB/s on ``directory``: ``psync`` (four jobs,
    a file each), ``psync-shared`` (four jobs in quarters of one file, as kvstore's reader
    threads share its data file) or ``io_uring`` (queue depth 4, one file)."""
    common = [
        "fio",
        "--name=ceiling",
        f"--directory={directory}",
        f"--size={size_mib}M",
        "--bs=2M",
        "--direct=1",
        "--rw=read",
        "--time_based",
        "--runtime=4",
        "--output-format=json",
        "--group_reporting",
    ]
    extra = {
        "psync": ["--ioengine=psync", "--numjobs=4"],
        "psync-shared": [
            "--ioengine=psync",
            "--numjobs=4",
            "--filename=shared",
            f"--offset_increment={size_mib // 4}M",
            f"--size={size_mib // 4}M",
        ],
        "io_uring": ["--ioengine=io_uring", "--iodepth=4"],
    }[engine]
    out = subprocess.run(common + extra, capture_output=True, text=True, check=True).stdout
    return json.loads(out)["jobs"][0]["read"]["bw_bytes"] / GB


def tokens_of(ns, index: int, blocks: int) -> list[int]:
    return list(range(index * 100_000, index * 100_000 + blocks * ns.block_size))


def pages(ns, tokens) -> torch.Tensor:
    blocks = len(tokens) // ns.block_size
    g = torch.Generator().manual_seed(tokens[0])
    return torch.randint(
        -30000, 30000, (blocks, *ns.page_shape), generator=g, dtype=torch.int16
    ).view(torch.float16)


def node_metric(cluster: LocalCluster, name: str) -> float:
    import re
    import urllib.request

    from kvstore.index import PageIndex

    node = PageIndex(cluster.redis_url).live_nodes()[0]
    text = (
        urllib.request.urlopen(f"http://{node.extra['metrics']}/metrics", timeout=5).read().decode()
    )
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def disk_reads(args, root: str) -> None:
    """Part 1: fio against kvstore gets of pages that are on disk only."""
    ns = namespace_for(PAGE)
    per_get = 32
    sets = 32  # 1,024 pages, 2 GiB on disk, 512 MiB of memory
    cluster = LocalCluster(
        1, "512MiB", slab_size="64MiB", disk_path=os.path.join(root, "reads"), disk_capacity="3GiB"
    ).start()
    fio_dir = os.path.join(root, "fio")
    os.makedirs(fio_dir, exist_ok=True)
    try:
        client = KVCacheClient(cluster.redis_url, ns, lease_ms=0)
        expected = {}
        for s in range(sets):
            t = tokens_of(ns, s, per_get)
            expected[s] = pages(ns, t)
            client.put_pages(t, expected[s])
        readers = [KVCacheClient(cluster.redis_url, ns, lease_ms=0) for _ in range(2)]
        outs = [torch.empty(per_get, *ns.page_shape, dtype=torch.float16) for _ in readers]

        def read(k: int) -> None:
            for s in range(
                k, sets, len(readers)
            ):  # in put order: the oldest are on disk only, and reading pushes the next ones out
                t = tokens_of(ns, s, per_get)
                got = readers[k].get_pages(t, outs[k]) // ns.block_size
                assert got == per_get and torch.equal(
                    outs[k].view(torch.int16), expected[s].view(torch.int16)
                ), f"set {s}: {got} pages or wrong bytes"

        rows = {
            "fio psync x4": [],
            "fio psync x4, 1 file": [],
            "fio io_uring qd4": [],
            "kvstore get (disk)": [],
        }
        disk_share = []
        for _ in range(args.repeat):
            rows["fio psync x4"].append(
                fio(fio_dir, "psync", 512)
            )  # 4 files of 512 MiB: as much as kvstore holds
            rows["fio psync x4, 1 file"].append(fio(fio_dir, "psync-shared", 2048))
            rows["fio io_uring qd4"].append(fio(fio_dir, "io_uring", 2048))
            before = node_metric(cluster, 'kvstore_tier_hit_pages_total{tier="disk"}')
            started = time.perf_counter()
            threads = [threading.Thread(target=read, args=(k,)) for k in range(len(readers))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            rows["kvstore get (disk)"].append(
                sets * per_get * ns.page_nbytes / (time.perf_counter() - started) / GB
            )
            disk_share.append(
                (node_metric(cluster, 'kvstore_tier_hit_pages_total{tier="disk"}') - before)
                / (sets * per_get)
            )
        for c in [client, *readers]:
            c.close()
    finally:
        cluster.stop()
        shutil.rmtree(fio_dir, ignore_errors=True)
    ceiling = max(statistics.median(v) for k, v in rows.items() if k.startswith("fio"))
    print(
        f"\n1. reads of 2 MiB pages from disk, GB/s, median (min-max) of {args.repeat}, ratio to the fio ceiling"
    )
    print(f"{'':24} {'GB/s':>22} {'ratio':>7}")
    for name, samples in rows.items():
        print(f"{name:24} {fmt(samples):>22} {statistics.median(samples) / ceiling:>7.2f}")
    print(f"share of kvstore's pages read from disk (not memory): {fmt(disk_share)}")


def hit_rate(args, root: str) -> None:
    """Part 2: working set 4x memory; every stored prefix looked up afterwards."""
    ns = namespace_for(256 << 10)
    memory, blocks, prefixes = (
        256 << 20,
        16,
        256,
    )  # 256 prefixes of 16 pages of 256 KiB: 1 GiB, 4x memory
    results: dict[str, list[float]] = {"memory only": [], "memory + disk": []}
    for round_ in range(args.repeat):
        for name in results:
            disk = (
                dict(disk_path=os.path.join(root, f"hits-{round_}"), disk_capacity="2GiB")
                if "disk" in name
                else {}
            )
            cluster = LocalCluster(1, str(memory), slab_size="16MiB", **disk).start()
            try:
                client = KVCacheClient(cluster.redis_url, ns, lease_ms=0)
                for p in range(prefixes):
                    t = tokens_of(ns, p, blocks)
                    client.put_pages(t, pages(ns, t))
                hits = sum(
                    client.lookup(tokens_of(ns, p, blocks)) // ns.block_size
                    for p in range(prefixes)
                )
                results[name].append(hits / (prefixes * blocks))
                client.close()
            finally:
                cluster.stop()
    print(
        f"\n2. hit rate, working set 4x memory ({prefixes} prefixes of {blocks} pages of 256 KiB, 256 MiB of memory), ratio to unlimited memory"
    )
    for name, samples in results.items():
        print(f"{name:24} {fmt(samples):>22}")


def puts_while_full(args, root: str) -> None:
    """Part 3: put throughput of nodes that must evict, with and without a disk tier."""
    ns = namespace_for(PAGE)
    per_put, puts = 16, 48  # 1.5 GiB through 512 MiB of memory
    results: dict[str, list[float]] = {
        "memory only": [],
        "memory + disk": [],
        "memory + disk, admission 1": [],
    }
    for round_ in range(args.repeat):
        for name in results:
            disk = (
                dict(
                    disk_path=os.path.join(root, f"puts-{round_}-{len(name)}"), disk_capacity="3GiB"
                )
                if "disk" in name
                else {}
            )
            extra = ["--disk-admission", "1"] if "admission" in name else None
            cluster = LocalCluster(1, "512MiB", slab_size="64MiB", extra_args=extra, **disk).start()
            try:
                client = KVCacheClient(cluster.redis_url, ns, lease_ms=0)
                data = [pages(ns, tokens_of(ns, i, per_put)) for i in range(4)]
                for i in range(8):  # fill memory first: the timed puts all evict
                    client.put_pages(tokens_of(ns, 10_000 + i, per_put), data[i % 4])
                started = time.perf_counter()
                for i in range(puts):
                    report = client.put_pages(tokens_of(ns, i, per_put), data[i % 4])
                    assert report.stored == per_put, report
                results[name].append(puts * per_put * PAGE / (time.perf_counter() - started) / GB)
                client.close()
            finally:
                cluster.stop()
    base = statistics.median(results["memory only"])
    print(
        "\n3. put throughput while memory is full, GB/s, ratio to memory only (write-back writes every evicted page and"
    )
    print(
        "   a put waits when the demoter fell behind; with admission 1 pages nobody read are dropped instead)"
    )
    for name, samples in results.items():
        print(f"{name:24} {fmt(samples):>22} {statistics.median(samples) / base:>7.2f}")


def warm_restart(args, root: str) -> None:
    """Part 4: kill -9 a node holding ``--restart-gib`` on disk; time to the first hit."""
    ns = namespace_for(PAGE)
    per_put = 64
    sets = int(args.restart_gib * 1024 // (per_put * 2))
    cluster = LocalCluster(
        1,
        "512MiB",
        slab_size="64MiB",
        disk_path=os.path.join(root, "restart"),
        disk_capacity=f"{args.restart_gib + 1}GiB",
        extra_args=["--disk-policy", "write-through"],
    ).start()
    took = []
    try:
        client = KVCacheClient(cluster.redis_url, ns, lease_ms=0)
        data = pages(ns, tokens_of(ns, 0, per_put))
        for s in range(sets):
            client.put_pages(tokens_of(ns, s, per_put), data)
        while node_metric(cluster, 'kvstore_tier_pages{tier="disk"}') < sets * per_put:
            time.sleep(0.2)
        client.close()
        out = torch.empty(per_put, *ns.page_shape, dtype=torch.float16)
        for _ in range(args.repeat):
            cluster.nodes[-1].kill(signal.SIGKILL)
            cluster.nodes[-1].process.wait()
            started = time.perf_counter()
            cluster.add_node("node-0")
            probe = KVCacheClient(cluster.redis_url, ns, lease_ms=0, node_refresh=0.05, timeout=2.0)
            while probe.get_pages(tokens_of(ns, 0, per_put), out) // ns.block_size < per_put:
                time.sleep(0.02)
            took.append(time.perf_counter() - started)
            assert torch.equal(out.view(torch.int16), data.view(torch.int16))
            probe.close()
    finally:
        cluster.stop()
    print(
        f"\n4. warm restart: kill -9 of a node holding {args.restart_gib} GiB on disk ({sets * per_put} pages of 2 MiB) to its first hit, seconds"
    )
    print(f"{'restart to first hit':24} {fmt(took, ' s'):>22}")


def idle(args, root: str) -> None:
    """Part 5: CPU of an idle node with a disk tier (after it stored and served pages)."""
    ns = namespace_for(PAGE)
    cluster = LocalCluster(
        1, "256MiB", slab_size="64MiB", disk_path=os.path.join(root, "idle"), disk_capacity="1GiB"
    ).start()
    try:
        client = KVCacheClient(cluster.redis_url, ns, lease_ms=0)
        for s in range(16):
            client.put_pages(tokens_of(ns, s, 16), pages(ns, tokens_of(ns, s, 16)))
        client.close()
        time.sleep(7)  # the tier's delayed fdatasync
        pid = cluster.nodes[0].process.pid
        before, started = cpu_seconds(pid), time.monotonic()
        time.sleep(5)
        share = (cpu_seconds(pid) - before) / (time.monotonic() - started)
    finally:
        cluster.stop()
    print(f"\n5. idle node with a disk tier: {100 * share:.2f} % of a core over 5 s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--dir",
        default=None,
        help="directory on the disk to measure (default: a temporary directory under /var/tmp)",
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--restart-gib", type=float, default=4.0)
    parser.add_argument("--parts", default="1,2,3,4,5", help="which parts to run, e.g. 1,4")
    args = parser.parse_args()
    if shutil.which("fio") is None:
        print(
            "bench/tier.py needs fio (apt-get install fio) for the device ceiling", file=sys.stderr
        )
        return 2
    root = tempfile.mkdtemp(prefix="kvstore-tier-", dir=args.dir or "/var/tmp")
    parts = {"1": disk_reads, "2": hit_rate, "3": puts_while_full, "4": warm_restart, "5": idle}
    try:
        print(
            f"bench/tier.py on {root} ({subprocess.run(['df', '-T', root], capture_output=True, text=True).stdout.splitlines()[-1].split()[1]})"
        )
        for key in args.parts.split(","):
            parts[key](args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

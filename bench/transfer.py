"""Put and get throughput between a client process and a storage-node process.

    python bench/transfer.py [--total 512MiB] [--sizes 64KiB,2MiB,16MiB] [--repeat 5]

Prints GB/s (median of --repeat runs) for put_pages and get_pages at each page size,
next to a numpy memcpy of the same bytes measured in the same run."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from client import KVCacheClient  # noqa: E402
from kvstore import Namespace  # noqa: E402
from kvstore.launcher import LocalCluster  # noqa: E402
from kvstore.units import parse_size  # noqa: E402


def namespace_for(nbytes: int, tenant: str) -> Namespace:
    # float16 kv_lbhd pages of 32 layers x 8 heads x D dims x B tokens
    head, block = 128, nbytes // (2 * 32 * 8 * 128 * 2)
    if block == 0:
        head, block = 32, max(1, nbytes // (2 * 32 * 8 * 32 * 2))
    ns = Namespace(model="bench", dtype="float16", num_layers=32, num_kv_heads=8, head_size=head, block_size=block, tenant=tenant)
    if ns.page_nbytes != nbytes:
        ns = Namespace(model="bench", dtype="float16", num_layers=1, num_kv_heads=1, head_size=32, block_size=nbytes // 128, tenant=tenant)
    return ns


def memcpy_gbps(nbytes: int) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--total", default="512MiB", help="bytes moved per measurement")
    parser.add_argument("--sizes", default="64KiB,2MiB,16MiB")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    total = parse_size(args.total)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    capacity = total * (args.repeat + 1) + (256 << 20)
    print(f"one storage node, one client process, loopback; {args.total} per run, median of {args.repeat}")
    print(f"{'page size':>10} {'pages':>7} {'put GB/s':>9} {'get GB/s':>9} {'memcpy GB/s':>12}")
    with LocalCluster(servers=1, capacity=str(capacity), slab_size="64MiB") as cluster:
        for size in sizes:
            ns = namespace_for(size, tenant=f"bench-{size}")
            count = total // size
            with KVCacheClient(cluster.redis_url, ns, timeout=60, lease_ms=0) as client:
                pages = torch.randint(-1000, 1000, (count, *ns.page_shape), dtype=torch.int16).view(torch.float16)
                out = torch.empty_like(pages)
                put_t, get_t = [], []
                for r in range(args.repeat):
                    tokens = list(range(r * 10_000_000, r * 10_000_000 + count * ns.block_size))
                    t = time.perf_counter()
                    report = client.put_pages(tokens, pages)
                    put_t.append(time.perf_counter() - t)
                    assert report.stored == count, report
                    t = time.perf_counter()
                    got = client.get_pages(tokens, out)
                    get_t.append(time.perf_counter() - t)
                    assert got == count * ns.block_size
                assert torch.equal(out.view(torch.int16), pages.view(torch.int16))
            nbytes = count * size
            print(f"{size >> 10:>8}Ki {count:>7} {nbytes / statistics.median(put_t) / 1e9:>9.2f} "
                  f"{nbytes / statistics.median(get_t) / 1e9:>9.2f} {memcpy_gbps(nbytes):>12.2f}", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    sys.exit(main())

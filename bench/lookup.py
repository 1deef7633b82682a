"""Index lookup latency against the embedded Valkey.

    python bench/lookup.py [--iterations 200]

Prints p50 and p99 of one lookup (a single EVALSHA) for 16, 128, 1024 and 8192
committed blocks, each block held by one of two live nodes."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstore import Namespace, block_hashes  # noqa: E402
from kvstore.index import CommitEntry, PageIndex  # noqa: E402
from kvstore.valkey import EmbeddedValkey  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=200)
    args = parser.parse_args()
    ns = Namespace(model="bench", dtype="float16", num_layers=32, num_kv_heads=8, head_size=128, block_size=16)
    with EmbeddedValkey() as valkey:
        index = PageIndex(valkey.url)
        index.ensure_namespace(ns)
        incarnations = {n: index.register_node(n, f"127.0.0.1:{i + 1}", 1 << 30, 600_000) for i, n in enumerate(("a", "b"))}
        hashes = block_hashes(ns, list(range(8192 * ns.block_size)))
        for node, inc in incarnations.items():
            mine = [h for i, h in enumerate(hashes) if (i % 2 == 0) == (node == "a")]
            for start in range(0, len(mine), 1024):
                index.commit(ns, node, inc, [CommitEntry(h, start + k, 2 << 20, k) for k, h in enumerate(mine[start : start + 1024])], 600_000)
        print(f"lookup latency, embedded Valkey on loopback, {args.iterations} iterations each")
        print(f"{'blocks':>7} {'p50 ms':>8} {'p99 ms':>8}")
        for count in (16, 128, 1024, 8192):
            query = hashes[:count]
            assert index.lookup(ns, query).matched == count
            samples = []
            for _ in range(args.iterations):
                t = time.perf_counter()
                index.lookup(ns, query)
                samples.append((time.perf_counter() - t) * 1000)
            samples.sort()
            p99 = samples[min(len(samples) - 1, int(len(samples) * 0.99))]
            print(f"{count:>7} {statistics.median(samples):>8.3f} {p99:>8.3f}", flush=True)
        index.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Just-stored pages and lookups on a saturated host: 0, 2 and 4 CPU hogs, and memory
pressure.

    python bench/saturation.py [--rounds 5] [--pages 256] [--leave-gib 4]

One storage node (256 MiB) on the embedded Valkey and a client in this process, as
``kvstore up`` and an engine run them. Each round runs every condition in turn (A B C
D, A B C D, ...):

- ``0 hogs``: the machine as it is;
- ``2 hogs`` / ``4 hogs``: that many busy-loop processes (this VM has 2 cores: 4 hogs
  is three runnable processes per core with the node and the client);
- ``memory``: one process holding the machine's available memory down to
  ``--leave-gib`` GiB, touched page by page (no hog).

In each condition, after a second of settling: ``--pages`` pages of 64 KiB put under new
prefixes and got back at once (hits: the fraction that came back, bit-exact), then 200
lookups of those prefixes, each with the vLLM connector's 50 ms budget
(``lookup_checked(timeout=0.05)``; one over budget is a miss to the engine). Printed
per condition: hits, lookup p50 and p99 (median and min-max over rounds), lookups over
budget, and p99 as a ratio of the 0-hog p99. The client's counters at the end name
what went wrong, if anything did (``node_timeouts``: a node silent past the timeout;
``index_timeouts``: lookups over budget)."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client import KVCacheClient
from kvstore.tools.launcher import LocalCluster
from tests.support.helpers import namespace_for_page_size, pages_for

HOG = "while True: pass"
# holds all but `leave` GiB of MemAvailable, touched, then sleeps until killed
PRESSURE = """
import sys, time
leave = float(sys.argv[1]) * (1 << 30)
avail = next(int(l.split()[1]) * 1024 for l in open('/proc/meminfo') if l.startswith('MemAvailable'))
held = [bytearray(b'x') * (64 << 20) for _ in range(max(0, int((avail - leave) // (64 << 20))))]
print(len(held) * 64, flush=True)
time.sleep(3600)
"""


def start_load(condition: str, leave_gib: float) -> list[subprocess.Popen]:
    if condition == "memory":
        proc = subprocess.Popen(
            [sys.executable, "-c", PRESSURE, str(leave_gib)], stdout=subprocess.PIPE, text=True
        )
        proc.stdout.readline()  # the memory is held from here on
        return [proc]
    return [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(int(condition[0]))]


def measure(client: KVCacheClient, ns, pages: int, start: int) -> tuple[float, list[float], int]:
    """Hits of just-stored pages (fraction), lookup latencies (s) and lookups over budget."""
    per = 16
    prefixes = [
        list(range(start + k * 10_000, start + k * 10_000 + per * ns.block_size))
        for k in range(pages // per)
    ]
    got = 0
    for tokens in prefixes:
        data = pages_for(ns, tokens)
        client.put_pages(tokens, data)
        out = torch.empty_like(data)
        n = client.get_pages(tokens, out) // ns.block_size
        exact = torch.equal(out[:n].view(torch.uint8), data[:n].view(torch.uint8))
        got += n if exact else 0
    latencies, over = [], 0
    for i in range(200):
        t = time.perf_counter()
        if client.lookup_checked(prefixes[i % len(prefixes)], timeout=0.05) is None:
            over += 1
        latencies.append(time.perf_counter() - t)
    return got / pages, latencies, over


def p(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def spread(values: list[float], scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    vals = [v * scale for v in values]
    return (
        f"{fmt.format(statistics.median(vals))} ({fmt.format(min(vals))}-{fmt.format(max(vals))})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--leave-gib", type=float, default=4.0)
    args = ap.parse_args()
    conditions = ["0 hogs", "2 hogs", "4 hogs", "memory"]
    rows: dict[str, dict[str, list[float]]] = {
        c: {"hits": [], "p50": [], "p99": [], "over": []} for c in conditions
    }
    ns = namespace_for_page_size(1 << 16, tenant="saturation")
    with LocalCluster(1, "256MiB") as cluster, KVCacheClient(cluster.redis_url, ns) as client:
        start = 0
        for _ in range(args.rounds):
            for condition in conditions:
                load = start_load(condition, args.leave_gib)
                try:
                    time.sleep(1.0)
                    hits, latencies, over = measure(client, ns, args.pages, start)
                finally:
                    for proc in load:
                        proc.kill()
                        proc.wait()
                start += 1_000_000
                row = rows[condition]
                row["hits"].append(hits)
                row["p50"].append(p(latencies, 0.5))
                row["p99"].append(p(latencies, 0.99))
                row["over"].append(over)
                alive = all(n.process.poll() is None for n in cluster.nodes)
                assert alive, "the storage node died"
        stats = client.stats.as_dict()
    base = statistics.median(rows["0 hogs"]["p99"])
    print(
        f"{args.rounds} rounds, {args.pages} pages of 64 KiB per condition, 200 lookups (50 ms budget)"
    )
    print(
        "| condition | hits of just-stored pages | lookup p50 ms | lookup p99 ms | over budget /200 | p99 vs 0 hogs |"
    )
    print("|---|---|---|---|---|---|")
    for c in conditions:
        r = rows[c]
        print(
            f"| {c} | {spread(r['hits'], 100, '{:.0f}')} % | {spread(r['p50'], 1000)} | "
            f"{spread(r['p99'], 1000)} | {spread(r['over'], 1, '{:.0f}')} | "
            f"{statistics.median(r['p99']) / base:.2f}x |"
        )
    print(
        "client counters: "
        + ", ".join(f"{k}={stats[k]}" for k in ("node_errors", "node_timeouts", "index_timeouts"))
    )


if __name__ == "__main__":
    main()

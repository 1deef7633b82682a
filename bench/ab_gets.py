"""Gets into host memory, one checkout against another: is a change slower on CPU engines?

    git worktree add /tmp/old <rev>   # and build its C modules (cc, as bench/gpu_check.py does)
    python bench/ab_gets.py --old /tmp/old [--rounds 4]

One store (a node and Valkey) holds 64 MiB of pages of 64 KiB and of 2 MiB; for each size
and path (same host, UCX), reader processes of the old and the new checkout take turns
(old, new, old, new: ``--rounds`` pairs of 5 gets each) and each prints its get_pages
times. Medians, min-max, and new/old as a ratio of GB/s."""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

WORKER = r"""
import sys, json, time, torch
sys.path.insert(0, sys.argv[1])
from client import KVCacheClient
from kvstore.pages.namespace import Namespace
url, size, same_host, rounds = sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1", int(sys.argv[5])
layers = 1 if size == 64 << 10 else 32
ns = Namespace(model="ab", layout="vllm_cpu", tenant="ab", num_kv_heads=8, head_size=128, dtype="bfloat16", num_layers=layers, block_size=16)
n = (64 << 20) // ns.page_nbytes
tokens = list(range(n * 16))
with KVCacheClient(url, ns, timeout=60, same_host=same_host) as c:
    out = torch.empty((n, *ns.page_shape), dtype=torch.bfloat16)
    c.get_pages(tokens, out)
    ts = []
    for _ in range(rounds):
        t = time.perf_counter(); got = c.get_pages(tokens, out); ts.append(time.perf_counter() - t)
        assert got == len(tokens), got
    print(json.dumps(ts))
"""
ROOT = Path(__file__).resolve().parents[1]
ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--old", required=True, help="the other checkout (its C modules built)")
ap.add_argument("--rounds", type=int, default=4)
args = ap.parse_args()
sys.path.insert(0, str(ROOT))
import torch  # noqa: E402

from client import KVCacheClient  # noqa: E402
from kvstore.pages.namespace import Namespace  # noqa: E402
from kvstore.tools.launcher import LocalCluster  # noqa: E402

with LocalCluster(1, "1GiB", slab_size="32MiB") as c:
    for size in (64 << 10, 2 << 20):
        layers = 1 if size == 64 << 10 else 32
        ns = Namespace(
            model="ab",
            layout="vllm_cpu",
            tenant="ab",
            num_kv_heads=8,
            head_size=128,
            dtype="bfloat16",
            num_layers=layers,
            block_size=16,
        )
        n = (64 << 20) // ns.page_nbytes
        with KVCacheClient(c.redis_url, ns, timeout=60) as w:
            assert (
                w.put_pages(
                    list(range(n * 16)), torch.randint(0, 9, (n, *ns.page_shape)).to(torch.bfloat16)
                ).stored
                == n
            )
        for same_host in ("1", "0"):
            res = {"old": [], "new": []}
            for _ in range(args.rounds):
                for name, root in (("old", args.old), ("new", str(ROOT))):
                    out = subprocess.run(
                        [
                            sys.executable,
                            "-c",
                            WORKER,
                            root,
                            c.redis_url,
                            str(size),
                            same_host,
                            "5",
                        ],
                        capture_output=True,
                        text=True,
                        env=dict(os.environ, UCX_NET_DEVICES="lo"),
                    )
                    if out.returncode:
                        print(out.stderr[-1500:])
                        raise SystemExit(1)
                    res[name] += json.loads(out.stdout.strip().splitlines()[-1])
            mo, mn = statistics.median(res["old"]), statistics.median(res["new"])
            print(
                f"{size >> 10} KiB pages, {'shm' if same_host == '1' else 'ucx'}: old {(64 << 20) / mo / 1e9:.2f} GB/s ({min(res['old']) * 1e3:.1f}-{max(res['old']) * 1e3:.1f} ms), new {(64 << 20) / mn / 1e9:.2f} GB/s ({min(res['new']) * 1e3:.1f}-{max(res['new']) * 1e3:.1f} ms): new/old {mo / mn:.2f}x"
            )

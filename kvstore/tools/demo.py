"""``kvstore demo``: a prefill process and a decode process sharing KV through the store.

Brings up embedded Valkey and storage nodes, then runs separate processes:
prefill A inserts a long prompt; decode A selects it; decode B (a second session
sharing only the first part of the prompt) selects before and after its own prefill,
which sends only the pages the store lacks. Exits non-zero if any byte differs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tqdm import tqdm

from kvstore.settings.sizes import format_size
from kvstore.tools.launcher import LocalCluster


def _worker(role: str, redis_url: str, tokens: str) -> dict:
    args = [sys.executable, "-m", "client.demo_worker", role, "--redis-url", redis_url, "--tokens", tokens]
    proc = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "UCX_NET_DEVICES": "lo"}, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{role} process failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_demo(servers: int = 2, prompt_tokens: int = 2030, shared_tokens: int = 1000, capacity: str = "1GiB") -> int:
    prompt_a = f"0:{prompt_tokens}"
    prompt_b = f"0:{shared_tokens},{50_000}:{50_000 + prompt_tokens - shared_tokens}"
    steps = [
        ("prefill A: insert prompt A", "prefill", prompt_a),
        ("decode A: select prompt A", "decode", prompt_a),
        ("decode B: select before B's prefill", "decode", prompt_b),
        ("prefill B: insert prompt B", "prefill", prompt_b),
        ("decode B: select prompt B", "decode", prompt_b),
    ]
    rows: list[tuple[str, dict]] = []
    with tqdm(total=len(steps) + 1, desc="kvstore demo", unit="step", file=sys.stderr) as bar:
        bar.set_postfix_str(f"starting Valkey and {servers} storage nodes")
        with LocalCluster(servers=servers, capacity=capacity, slab_size="64MiB") as cluster:
            bar.update()
            for title, role, tokens in steps:
                bar.set_postfix_str(title)
                rows.append((title, _worker(role, cluster.redis_url, tokens)))
                bar.update()
            url = cluster.redis_url
    print(f"\nstore: {servers} storage nodes, Valkey at {url} (stopped)")
    print("pages: 32 layers x 8 KV heads x 128 dims, fp16, 16 tokens per page = 2.0 MiB\n")
    print(f"{'step':38} {'tokens':>15} {'moved':>11} {'time':>8} {'GB/s':>6}  result")
    ok = True
    for title, r in rows:
        if "matched" in r:
            moved = r["bytes"]
            tokens = f"{r['matched']}/{r['tokens']}"
            result = ("bit-exact" if r["exact"] else "BYTES DIFFER") + (" +hidden" if r["hidden"] else "")
            ok &= r["exact"]
        else:
            moved = r["bytes_sent"]
            tokens = str(r["tokens"])
            result = f"sent {r['sent']} pages, {r['skipped']} already stored"
        gbps = moved / r["seconds"] / 1e9 if r["seconds"] else 0
        print(f"{title:38} {tokens:>15} {format_size(moved):>11} {r['seconds']:>7.2f}s {gbps:>6.2f}  {result}")
    a, b_before, b = rows[1][1], rows[2][1], rows[4][1]
    expected_before = (int(prompt_b.split(",")[0].split(":")[1]) // 16) * 16
    ok &= a["matched"] == prompt_tokens and b["matched"] == prompt_tokens and b_before["matched"] == expected_before
    ok &= rows[3][1]["skipped"] == expected_before // 16
    print("\nall bytes verified: OK" if ok else "\nVERIFICATION FAILED")
    return 0 if ok else 1

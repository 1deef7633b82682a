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
import tempfile

from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no types; types-tqdm is not a dependency

from kvstore.settings.sizes import format_size
from kvstore.tools.launcher import LocalCluster
from kvstore.tools.programs import DEMO_WORKER


def _worker(role: str, redis_url: str, tokens: str) -> dict:
    args = DEMO_WORKER.argv(role, "--redis-url", redis_url, "--tokens", tokens)
    proc = subprocess.run(
        args,
        capture_output=True,
        text=True,
        env={**os.environ, "UCX_NET_DEVICES": "lo"},
        timeout=600,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{role} process failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_demo(
    servers: int = 2,
    prompt_tokens: int = 2030,
    shared_tokens: int = 1000,
    capacity: str = "1GiB",
    disk: bool = False,
) -> int:
    """The demo; with ``disk`` the nodes get a small memory pool over a disk tier, and two
    more steps show prompt A served from disk after other prompts pushed it out of
    memory, and again after every node was killed (-9) and restarted."""
    if disk:
        with tempfile.TemporaryDirectory(
            prefix="kvstore-demo-disk-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None
        ) as directory:
            return _run(servers, prompt_tokens, shared_tokens, "256MiB", directory)
    return _run(servers, prompt_tokens, shared_tokens, capacity, None)


def _disk_reads(cluster: LocalCluster) -> int:
    """Pages the nodes served from disk so far (their metrics)."""
    import re
    import urllib.request

    from kvstore.index import PageIndex

    total = 0
    for node in PageIndex(cluster.redis_url).live_nodes():
        text = (
            urllib.request.urlopen(f"http://{node.extra['metrics']}/metrics", timeout=5)
            .read()
            .decode()
        )
        m = re.search(r'^kvstore_tier_hit_pages_total\{tier="disk"\} ([0-9.e+]+)$', text, re.M)
        total += int(float(m.group(1))) if m else 0
    return total


def _run(
    servers: int, prompt_tokens: int, shared_tokens: int, capacity: str, disk_dir: str | None
) -> int:
    prompt_a = f"0:{prompt_tokens}"
    prompt_b = f"0:{shared_tokens},{50_000}:{50_000 + prompt_tokens - shared_tokens}"
    steps = [
        ("prefill A: insert prompt A", "prefill", prompt_a),
        ("decode A: select prompt A", "decode", prompt_a),
        ("decode B: select before B's prefill", "decode", prompt_b),
        ("prefill B: insert prompt B", "prefill", prompt_b),
        ("decode B: select prompt B", "decode", prompt_b),
    ]
    if disk_dir:  # other prompts of 1,024 tokens (128 MiB), 1.5x the nodes' memory, push A out of memory (onto disk)
        fills = 3 * servers
        steps += [
            (
                f"fill: insert {fills} other prompts",
                "prefill",
                ";".join(
                    f"{s}:{s + 1024}" for s in range(100_000, 100_000 + fills * 10_000, 10_000)
                ),
            )
        ]
        steps += [
            ("decode A: select after A left memory", "decode", prompt_a),
            ("restart: kill -9 every node, start again", "restart", ""),
            ("decode A: select after the restart", "decode", prompt_a),
        ]
    rows: list[tuple[str, dict]] = []
    disk_reads: list[int] = []
    with tqdm(total=len(steps) + 1, desc="kvstore demo", unit="step", file=sys.stderr) as bar:
        bar.set_postfix_str(f"starting Valkey and {servers} storage nodes")
        with LocalCluster(
            servers=servers,
            capacity=capacity,
            slab_size="16MiB" if disk_dir else "64MiB",
            disk_path=disk_dir,
            disk_capacity="2GiB" if disk_dir else None,
        ) as cluster:
            bar.update()
            for title, role, tokens in steps:
                bar.set_postfix_str(title)
                if role == "restart":
                    rows.append((title, {"restart": cluster.restart_nodes()}))
                else:
                    rows.append((title, _worker(role, cluster.redis_url, tokens)))
                    if disk_dir and role == "decode":
                        disk_reads.append(_disk_reads(cluster))
                bar.update()
            url = cluster.redis_url
    tier = (
        f" of {capacity} memory over a 2 GiB disk tier each ({disk_dir}, removed)"
        if disk_dir
        else ""
    )
    print(f"\nstore: {servers} storage nodes{tier}, Valkey at {url} (stopped)")
    print("pages: 32 layers x 8 KV heads x 128 dims, fp16, 16 tokens per page = 2.0 MiB\n")
    print(f"{'step':38} {'tokens':>15} {'moved':>11} {'time':>8} {'GB/s':>6}  result")
    ok = True
    for title, r in rows:
        if "restart" in r:
            print(
                f"{title:38} {'':>15} {'':>11} {r['restart']:>7.2f}s {'':>6}  all nodes ready, pages re-published"
            )
            continue
        if "matched" in r:
            moved = r["bytes"]
            tokens = f"{r['matched']}/{r['tokens']}"
            result = ("bit-exact" if r["exact"] else "BYTES DIFFER") + (
                " +hidden" if r["hidden"] else ""
            )
            ok &= r["exact"]
        else:
            moved = r["bytes_sent"]
            tokens = str(r["tokens"])
            result = f"sent {r['sent']} pages, {r['skipped']} already stored"
        gbps = moved / r["seconds"] / 1e9 if r["seconds"] else 0
        print(
            f"{title:38} {tokens:>15} {format_size(moved):>11} {r['seconds']:>7.2f}s {gbps:>6.2f}  {result}"
        )
    a, b_before, b = rows[1][1], rows[2][1], rows[4][1]
    expected_before = (int(prompt_b.split(",")[0].split(":")[1]) // 16) * 16
    ok &= (
        a["matched"] == prompt_tokens
        and b["matched"] == prompt_tokens
        and b_before["matched"] == expected_before
    )
    ok &= rows[3][1]["skipped"] == expected_before // 16
    if disk_dir:
        after_fill, after_restart = rows[-3][1], rows[-1][1]
        ok &= after_fill["matched"] == prompt_tokens and after_restart["matched"] == prompt_tokens
        from_disk = [
            disk_reads[i] - disk_reads[i - 1] for i in (len(disk_reads) - 2, len(disk_reads) - 1)
        ]
        from_disk[1] = disk_reads[-1]  # the restarted nodes count from zero
        print(
            f"\nprompt A from disk: {from_disk[0]} of its {rows[0][1]['sent']} pages "
            f"after it left memory, {from_disk[1]} after the restart"
        )
        ok &= from_disk[0] > 0 and from_disk[1] > 0
    print(
        "\ntime: the insert or select call itself, the first in a fresh process whose client "
        "has started (UCX, host buffers,"
        "\nconnections): hashing, the index round trips, the transfer and its checksums; "
        "bench/transfer.py compares it with put/get"
    )
    print("\nall bytes verified: OK" if ok else "\nVERIFICATION FAILED")
    return 0 if ok else 1

"""Fault soak: writers and readers on prompts that share prefixes, while nodes are
killed and restarted, stalled past the client timeout, and the index restarts with
and without its data.

    python bench/soak.py --minutes 10

Every received byte is checked against a generator seeded by the page's block hash
(a function of the token ids). At the end it prints reads, hits, full hits, wrong
bytes, exceptions that reached the caller, leaked slots and pins, the page-count
drift between ``kvstore stats`` and the nodes, the longest read, and how long full
hits took to resume after each fault. It exits non-zero if any figure that must be
zero is not."""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvstore import Namespace, block_hashes  # noqa: E402
from kvstore.tools.procutil import die_with_parent, free_port  # noqa: E402

PROBE_SEED = 0  # the prompt every reader reads and every writer keeps stored
FAULTS = ("kill", "stop", "index-empty", "index-snapshot")


def namespace(page_kib: int) -> Namespace:
    head = 64
    block = page_kib * 1024 // (2 * 4 * 2 * head * 2)
    return Namespace(
        model="soak",
        dtype="float16",
        num_layers=4,
        num_kv_heads=2,
        head_size=head,
        block_size=block,
        tenant="soak",
    )


def prompt(ns: Namespace, seed: int, blocks: int, prefixes: int) -> list[int]:
    """Prompt ``seed``: one of ``prefixes`` shared prefixes, then its own tail."""
    rng = random.Random(seed)
    shared = random.Random(1_000_003 * (seed % prefixes)).choices(
        range(50_000), k=blocks // 2 * ns.block_size
    )
    return shared + rng.choices(range(50_000), k=(blocks - blocks // 2) * ns.block_size)


def page_bytes(ns: Namespace, block_hash: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(block_hash[:8], "little")).integers(
        0, 256, ns.page_nbytes, dtype=np.uint8
    )


def pages(ns: Namespace, tokens: list[int]) -> torch.Tensor:
    flat = np.concatenate([page_bytes(ns, h) for h in block_hashes(ns, tokens)])
    return torch.from_numpy(flat).view(ns.torch_dtype()).reshape(-1, *ns.page_shape)


def run_client(role: str, cfg: dict) -> None:
    """A writer or reader process: loops until the deadline, one JSON line per call."""
    from client import KVCacheClient

    ns = namespace(cfg["page_kib"])
    rng = random.Random(f"{role}-{os.getpid()}")
    log = open(cfg["log"], "a", buffering=1)
    client = KVCacheClient(cfg["redis_url"], ns, timeout=cfg["timeout"])
    while time.time() < cfg["deadline"]:
        for seed in (PROBE_SEED, rng.randrange(1, cfg["prompts"])):
            tokens = prompt(ns, seed, cfg["blocks"], cfg["prefixes"])
            t = time.time()
            event = {"role": role, "t": t, "probe": seed == PROBE_SEED}
            try:
                if role == "writer":
                    event["stored"] = client.put_pages(tokens, pages(ns, tokens)).stored
                else:
                    out = torch.empty(cfg["blocks"], *ns.page_shape, dtype=torch.float16)
                    got = client.get_pages(tokens, out) // ns.block_size
                    want = pages(ns, tokens)[:got].reshape(-1).view(torch.uint8)
                    event.update(
                        matched=got,
                        blocks=cfg["blocks"],
                        wrong=int((out[:got].reshape(-1).view(torch.uint8) != want).sum()),
                    )
            except Exception as exc:
                event["exception"] = f"{type(exc).__name__}: {exc}"
            event["took"] = time.time() - t
            log.write(json.dumps(event) + "\n")
    client.close()


def metrics(address: str) -> dict[str, float]:
    import urllib.request

    values = {}
    for line in (
        urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode().splitlines()
    ):
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def settle_and_check(cluster, ns: Namespace) -> dict:
    """After the clients stopped: leaked slots/pins and page-count drift per node."""
    from kvstore.index import PageIndex
    from server.allocator import size_class

    index = PageIndex(cluster.redis_url)
    deadline = time.monotonic() + 30
    while True:
        nodes = {n.node_id: n for n in index.live_nodes()}
        stats = {s.digest: s for s in index.stats().namespaces}.get(ns.digest_hex)
        per_node = stats.per_node if stats else {}
        held, leaked, pins = {}, 0, 0
        for node_id, node in nodes.items():
            m = metrics(node.extra["metrics"])
            held[node_id] = int(m["kvstore_pages"])
            leaked += int(m["kvstore_used_bytes"]) // size_class(ns.page_nbytes) - held[node_id]
            pins += int(m["kvstore_pinned_pages"])
        drift = sum(abs(per_node.get(n, 0) - held[n]) for n in held) + sum(
            c for n, c in per_node.items() if n not in held
        )
        if (drift == 0 and leaked == 0 and pins == 0) or time.monotonic() > deadline:
            index.close()
            return {
                "leaked_slots": leaked,
                "pins": pins,
                "drift": drift,
                "held": sum(held.values()),
            }
        time.sleep(1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--writers", type=int, default=2)
    parser.add_argument("--readers", type=int, default=2)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument(
        "--capacity", default="24MiB", help="per node: small, so eviction never stops"
    )
    parser.add_argument("--page-kib", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=12, help="blocks per prompt")
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=2.0, help="client timeout (s)")
    parser.add_argument("--fault-every", type=float, default=30.0, help="seconds between faults")
    parser.add_argument(
        "--faults",
        default=",".join(FAULTS),
        help="comma-separated kinds, in turn: " + ", ".join(FAULTS),
    )
    parser.add_argument("--role", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        run_client(args.role, json.loads(Path(args.config).read_text()))
        return 0

    from kvstore.tools.launcher import LocalCluster

    ns = namespace(args.page_kib)
    ports = {f"node-{i}": free_port() for i in range(args.nodes)}
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-soak-"))
    cluster = LocalCluster(0, args.capacity, slab_size="4MiB", log_dir=str(workdir / "nodes"))
    events_log = workdir / "events.jsonl"
    procs: list[subprocess.Popen] = []
    faults: list[dict] = []
    try:
        cluster.start()
        for node_id, port in ports.items():
            cluster.add_node(node_id, ["--port", str(port)])
        cluster.wait_registered()
        start = time.time()
        deadline = start + args.minutes * 60
        cfg = {
            **vars(args),
            "redis_url": cluster.redis_url,
            "deadline": deadline,
            "log": str(events_log),
        }
        cfg_path = workdir / "config.json"
        cfg_path.write_text(json.dumps(cfg))
        env = {**os.environ, "PYTHONPATH": str(ROOT), "UCX_NET_DEVICES": "lo"}
        for role in ["writer"] * args.writers + ["reader"] * args.readers:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-X",
                        "faulthandler",
                        __file__,
                        "--role",
                        role,
                        "--config",
                        str(cfg_path),
                    ],
                    env=env,
                    preexec_fn=die_with_parent,
                )
            )
        kinds = args.faults.split(",")
        rng = random.Random(7)
        next_fault = time.time() + args.fault_every / 2
        k = 0
        while time.time() < deadline - args.fault_every / 2:
            if time.time() < next_fault:
                time.sleep(0.2)
                continue
            kind = kinds[k % len(kinds)]
            k += 1
            began = time.time()
            live = [n for n in cluster.nodes if n.process.poll() is None]
            victim = rng.choice(live)
            if kind == "kill":
                victim.kill()
                victim.process.wait()
                time.sleep(1.0)
                cluster.add_node(victim.node_id, ["--port", str(ports[victim.node_id])])
            elif kind == "stop":
                victim.kill(signal.SIGSTOP)
                time.sleep(2.5 * args.timeout)
                victim.kill(signal.SIGCONT)
            elif kind == "index-empty":
                cluster.valkey.restart(keep_data=False)
            else:
                cluster.valkey.save()
                time.sleep(2.0)
                cluster.valkey.restart(keep_data=True)
            faults.append(
                {
                    "kind": kind,
                    "node": victim.node_id if kind in ("kill", "stop") else "",
                    "began": began,
                    "ended": time.time(),
                }
            )
            print(f"[{time.time() - start:6.1f}s] {kind} {faults[-1]['node']}", flush=True)
            next_fault = time.time() + args.fault_every
        exit_codes = [p.wait(timeout=max(60, deadline - time.time() + 120)) for p in procs]
        checks = settle_and_check(cluster, ns)
        logs = "".join(n.log() for n in cluster.nodes)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        cluster.stop()
    events = [json.loads(line) for line in events_log.read_text().splitlines() if line.strip()]
    reads = [e for e in events if e["role"] == "reader" and "exception" not in e]
    probe_reads = sorted((e for e in reads if e["probe"]), key=lambda e: e["t"])
    exceptions = [e for e in events if "exception" in e]
    for f in faults:
        resumed = next(
            (e["t"] for e in probe_reads if e["t"] > f["ended"] and e["matched"] == e["blocks"]),
            None,
        )
        f["resume_s"] = None if resumed is None else resumed - f["ended"]
    summary = {
        "minutes": args.minutes,
        "reads": len(reads),
        "hits": sum(e["matched"] > 0 for e in reads),
        "full_hits": sum(e["matched"] == e["blocks"] for e in reads),
        "wrong_bytes": sum(e["wrong"] for e in reads),
        "exceptions": len(exceptions),
        "writes": sum(e["role"] == "writer" for e in events),
        "longest_read_s": max((e["took"] for e in reads), default=0.0),
        # frames of this project's code in node tracebacks (ucxx logs its own handshake
        # failures when a client gives up on a stalled node; those are not counted)
        "client_crashes": sum(code != 0 for code in exit_codes),
        "node_code_tracebacks": len(re.findall(r'File "[^"]*/(?:server|kvstore|client)/', logs)),
        **checks,
    }
    print()
    print(
        f"soak: {args.minutes:g} min, {args.writers} writers, {args.readers} readers, {args.nodes} nodes of {args.capacity}, "
        f"{args.page_kib} KiB pages, client timeout {args.timeout:g} s"
    )
    for key, value in summary.items():
        print(f"  {key:18} {value:.2f}" if isinstance(value, float) else f"  {key:18} {value}")
    print("  faults (full hits resumed after):")
    for kind in sorted({f["kind"] for f in faults}):
        times = [f["resume_s"] for f in faults if f["kind"] == kind]
        got = [t for t in times if t is not None]
        shown = f"median {statistics.median(got):.1f} s, max {max(got):.1f} s" if got else "never"
        print(
            f"    {kind:30} x{len(times)}  {shown}"
            + (f"  ({len(times) - len(got)} never)" if len(got) < len(times) else "")
        )
    for e in exceptions[:5]:
        print("  exception:", e["exception"])
    (workdir / "summary.json").write_text(
        json.dumps({"summary": summary, "faults": faults}, indent=1)
    )
    print(f"  details: {workdir}/summary.json")
    bad = any(
        summary[k]
        for k in (
            "wrong_bytes",
            "exceptions",
            "client_crashes",
            "leaked_slots",
            "pins",
            "drift",
            "node_code_tracebacks",
        )
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""A separate client process for tests: ``python tests/support/worker.py '<json spec>'|@spec.json``.

Prints one JSON line with what it did and whether every byte it read was right."""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from client import KVCacheClient
from kvstore import Namespace
from tests.support.helpers import kv_for, pages_for, rank_kv, rank_pages


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (random page bytes include NaNs, which torch.equal rejects)."""
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def tokens_of(spec: dict) -> list[int]:
    return (
        spec["tokens"]
        if "tokens" in spec
        else list(range(spec.get("start", 0), spec.get("start", 0) + spec["count"]))
    )


async def reconnect_cycles(client: KVCacheClient, ns: Namespace, cycles: int) -> int:
    from client.memory.buffers import Span
    from client.nodes.connection import NodeConnection

    inner = client._async
    node = (await inner.index.live_nodes())[0]
    sink = [Span(np.zeros(ns.page_nbytes, dtype=np.uint8), 0, ns.page_nbytes)]
    for _ in range(cycles):
        conn = NodeConnection(node, "", inner.nodes.ucxx)  # UCX on purpose: its per-connection cost
        await conn.get(ns.key, [bytes(16)], sink, [0], 10.0)
        await conn.close()
    return cycles


def main() -> int:
    arg = sys.argv[1]
    if arg.startswith("@"):  # a spec file (tests/support/helpers.py run_worker), removed once read
        path = Path(arg[1:])
        arg = path.read_text()
        path.unlink()
    spec = json.loads(arg)
    ns = Namespace(**spec["namespace"])
    options = spec.get("options", {})
    # "model": KV of the whole model, sliced to this TP rank's heads (tests of TP sharing)
    pages_for_ns = rank_pages if spec.get("kv") == "model" else pages_for
    kv_for_ns = rank_kv if spec.get("kv") == "model" else kv_for
    client = KVCacheClient(spec["redis_url"], ns, **options)
    out: dict = {"op": spec["op"]}
    t0 = time.perf_counter()
    if spec["op"] == "put_pages":
        for tokens in spec["token_lists"] if "token_lists" in spec else [tokens_of(spec)]:
            report = client.put_pages(tokens, pages_for_ns(ns, tokens))
            out.setdefault("reports", []).append(asdict(report))
    elif spec["op"] == "get_pages":
        results = []
        token_lists = spec["token_lists"] if "token_lists" in spec else [tokens_of(spec)]
        # made once: a loop's round regenerated them, 32 MiB of random bytes a round in the
        # stall test, and kept a core busy for its 16 s
        expected_pages = [pages_for_ns(ns, tokens) for tokens in token_lists]
        deadline = time.monotonic() + spec.get("loop_seconds", 0)
        while True:
            for tokens, expected in zip(token_lists, expected_pages):
                buf = torch.empty_like(expected)
                t = time.time()
                n = client.get_pages(tokens, buf) // ns.block_size
                results.append(
                    {
                        "blocks": len(expected),
                        "matched": n,
                        "exact": same_bytes(buf[:n], expected[:n]),
                    }
                )
                if spec.get("timestamps"):
                    results[-1].update(t=t, took=time.time() - t)
            # until_short: stop at the first get that came back short (a fault test's kill)
            short = results and results[-1]["matched"] < results[-1]["blocks"]
            if time.monotonic() >= deadline or (spec.get("until_short") and short):
                break
            # round_pause_s: a timed fault test needs a read every so often, not a busy loop
            time.sleep(spec.get("round_pause_s", 0))
        out["results"] = results
    elif spec["op"] == "concurrent_puts":
        # rounds of N clients putting the same pages at the same instant
        clients = [KVCacheClient(spec["redis_url"], ns, **options) for _ in range(spec["clients"])]
        for tokens in spec["token_lists"]:
            pages = pages_for_ns(ns, tokens)
            barrier = threading.Barrier(len(clients))
            reports: list = [None] * len(clients)

            def put(k: int) -> None:
                barrier.wait()
                reports[k] = asdict(clients[k].put_pages(tokens, pages))

            threads = [threading.Thread(target=put, args=(k,)) for k in range(len(clients))]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            out.setdefault("rounds", []).append(reports)
        for c in clients:
            c.close()
    elif spec["op"] == "reconnects":
        # connect, ask for one page, disconnect: over and over (per-connection leaks)
        out["cycles"] = client._run(reconnect_cycles(client, ns, spec["cycles"]))
    elif spec["op"] == "insert":
        tokens = tokens_of(spec)
        key, value, hidden = kv_for_ns(ns, tokens)
        report = client.insert(
            torch.tensor(tokens),
            torch.ones(len(tokens), dtype=torch.bool),
            key,
            value,
            hidden if spec.get("hidden", True) else None,
        )
        out["report"] = asdict(report)
    elif spec["op"] == "select":
        tokens = tokens_of(spec)
        key, value, hidden = kv_for_ns(ns, tokens)
        res = client.select(torch.tensor(tokens), torch.ones(len(tokens), dtype=torch.bool))
        if res[0] is None:
            out.update(matched=0, exact=True, hidden=False)
        else:
            m = int(res[1].sum())
            exact = same_bytes(res[2], key[:, :m]) and same_bytes(res[3], value[:, :m])
            if res[4] is not None:
                exact = exact and same_bytes(res[4], hidden)
            out.update(matched=m, exact=bool(exact), hidden=res[4] is not None)
    out["seconds"] = time.perf_counter() - t0
    out["stats"] = client.stats.as_dict()
    client.close()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Sections 4 and 5 of bench/events.py (``--node-only``): a storage node's events through
the page table's hooks, and real node processes with events on and off (idle CPU, puts,
the prefix query API). Section 6 reruns ``node_events_run``."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import time

from bench.benchcommon.proc import cpu_seconds
from bench.kvevents.common import cpu_ns, event_batches, events_namespace, spread
from kvstore import events as ev
from kvstore.tools.procutil import free_port


def _node_subscriber(endpoint: str, conn, curve: tuple[str, str] | None = None) -> None:
    """Another process: count the block hashes of every BlockStored/BlockRemoved until
    an AllBlocksCleared, then report them (``curve``: as ``event_batches``')."""
    blocks = 0
    for batch in event_batches(endpoint, conn, curve):
        blocks += sum(len(e.block_hashes) for e in batch if not isinstance(e, ev.AllBlocksCleared))
    conn.send(blocks)


def node_events_run(
    total: int,
    per_put: int,
    evict: bool,
    tenant: str = "default",
    access=None,
    curve: tuple[str, str] | None = None,
) -> dict:
    """The node's path (server/events.py): the page table's per-page calls (one
    ``stored`` per page of a put, and with ``evict`` one ``removed`` per page of an
    older put, as a full node evicts one put's worth per put), flushed once per turn
    of an asyncio loop into the real publisher, read by a subscriber process. Rate:
    block events (hashes announced) per second, until the publisher's queue is empty.
    The pages are ``tenant``'s; ``access`` and ``curve`` as in ``publisher_run`` (the
    store id is "bench")."""
    import asyncio

    from prometheus_client import CollectorRegistry

    from kvstore.pages.namespace import Namespace
    from server.events import NodeEvents
    from server.page import StoredPage

    ns = Namespace(
        model="llama-3-8b",
        dtype="bfloat16",
        num_layers=32,
        num_kv_heads=8,
        head_size=128,
        block_size=16,
        tenant=tenant,
    )
    digest = ns.digest_hex
    events = NodeEvents(
        ev.PublisherOptions(endpoint="tcp://127.0.0.1:0", mode="bind"),
        "bench",
        lambda d: ns if d == digest else None,
        CollectorRegistry(),
        access=access,
    )
    pub = events.publisher
    pages = [
        StoredPage((digest, i.to_bytes(16, "big")), 2 << 20, 0, offset=i) for i in range(total)
    ]
    topic = ev.pool_topic(
        "bench", "llama-3-8b", tenant
    )  # the pages' own: a router reading the tenant gets it
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(
        target=_node_subscriber, args=(pub.endpoint, child, curve), daemon=True
    )
    proc.start()
    assert parent.recv() == "connected"
    while not parent.poll(0.05):
        pub.publish([ev.block_removed([0])], topic)
    assert parent.recv() == "joined"
    while pub.stats().queued_events:
        time.sleep(0.01)
    before = pub.stats()
    tid = pub._thread.native_id
    thread_before = cpu_ns(os.getpid(), [tid]).get(tid, 0)

    async def run() -> float:
        started = time.perf_counter()
        for start in range(0, total, per_put):
            for page in pages[start : start + per_put]:
                events.stored(page, ev.MEDIUM_CPU)
            if evict and start >= per_put:
                for page in pages[start - per_put : start]:
                    events.removed(page, ev.MEDIUM_CPU)
            await asyncio.sleep(0)  # the loop turns between puts: the flush runs
        while pub.stats().queued_events or events._pending:
            await asyncio.sleep(0.0005)
        return time.perf_counter() - started

    seconds = asyncio.run(run())
    thread_ns = cpu_ns(os.getpid(), [tid]).get(tid, 0) - thread_before
    after = pub.stats()
    pub.publish([ev.AllBlocksCleared()], topic)
    blocks = parent.recv() if parent.poll(60) else None
    proc.join(5)
    events.close()
    announced = total + (total - per_put if evict else 0)
    return {
        "seconds": seconds,
        "blocks": announced,
        "rate": announced / seconds,
        "received": blocks,
        "dropped": after.dropped_events - before.dropped_events,
        "messages": after.published_batches - before.published_batches,
        "thread_ns": thread_ns,
    }


def bench_node_events(trials: int, total: int) -> None:
    print(
        "\n### A node's events: block events per second through the page table's hooks (server/events.py)\n"
    )
    print(
        "| puts | block events/s, median (min–max) | dropped events | messages | subscriber got every block |"
    )
    print("|---|---|---|---|---|")
    for per_put, evict in ((1, False), (32, False), (32, True)):
        runs = [node_events_run(total, per_put, evict) for _ in range(trials)]
        ok = all(r["received"] is not None and r["received"] >= r["blocks"] for r in runs)
        what = f"{per_put} page(s) per put" + (
            ", each put evicting the one before" if evict else ""
        )
        print(
            f"| {what}, {total:,} pages | {spread([r['rate'] for r in runs])} | {spread([r['dropped'] for r in runs])} | "
            f"{spread([r['messages'] for r in runs])} | {'yes' if ok else 'NO'} |"
        )


def bench_node_cost(rounds: int, query_calls: int) -> None:
    """Real nodes (one with events and one without, each with its own Valkey): idle CPU,
    the time of a put of 32 pages of 256 KiB (events on/off, interleaved), and the query
    API against KVCacheClient.lookup of the same 8,192 blocks (interleaved)."""
    import base64
    import http.client

    import numpy as np
    import torch

    from client import KVCacheClient
    from kvstore.index import PageIndex
    from kvstore.pages.namespace import Namespace
    from kvstore.tools.launcher import LocalCluster

    on = LocalCluster(
        1,
        "256MiB",
        slab_size="16MiB",
        extra_args=["--kv-events-endpoint", f"tcp://*:{free_port()}"],
    ).start()
    off = LocalCluster(1, "256MiB", slab_size="16MiB").start()
    try:
        print("\n### A node with events on and off (real node processes)\n")
        time.sleep(2)
        idle = {}
        for name, c in (("on", on), ("off", off)):
            pid = c.nodes[0].process.pid
            before, t0 = cpu_seconds(pid), time.monotonic()
            time.sleep(10)
            idle[name] = 100 * (cpu_seconds(pid) - before) / (time.monotonic() - t0)
        print(
            f"Idle CPU over 10 s: events on {idle['on']:.2f} % of a core, off {idle['off']:.2f} %.\n"
        )
        ns = events_namespace("bench-events")
        times: dict[str, list[float]] = {"on": [], "off": []}
        with KVCacheClient(on.redis_url, ns) as con, KVCacheClient(off.redis_url, ns) as coff:
            clients = {"on": con, "off": coff}
            for r in range(rounds):
                order = ("on", "off") if r % 2 == 0 else ("off", "on")
                for name in order:
                    tokens = list(range(r * 10**6, r * 10**6 + 32 * ns.block_size))
                    pages = torch.randn((32, *ns.page_shape), dtype=torch.float16)
                    t0 = time.perf_counter()
                    assert clients[name].put_pages(tokens, pages).stored == 32
                    times[name].append(1000 * (time.perf_counter() - t0))
        ratios = [a / b for a, b in zip(times["on"], times["off"])]
        print("| put of 32 pages of 256 KiB | ms, median (min–max) |")
        print("|---|---|")
        print(
            f"| events on | {statistics.median(times['on']):.2f} ({min(times['on']):.2f}–{max(times['on']):.2f}) |"
        )
        print(
            f"| events off | {statistics.median(times['off']):.2f} ({min(times['off']):.2f}–{max(times['off']):.2f}) |"
        )
        print(
            f"| on/off, ratio of medians; per round median (min–max) | {statistics.median(times['on']) / statistics.median(times['off']):.3f}; "
            f"{statistics.median(ratios):.3f} ({min(ratios):.3f}–{max(ratios):.3f}) |"
        )

        # the query API against the client's lookup, 8,192 blocks of 16 tokens
        qns = Namespace(
            model="bench-query",
            dtype="float16",
            num_layers=1,
            num_kv_heads=1,
            head_size=64,
            block_size=16,
            tenant="bench-query",
        )  # 4 KiB pages
        tokens = list(range(8192 * 16))
        with KVCacheClient(on.redis_url, qns) as client:
            pages = torch.zeros((8192, *qns.page_shape), dtype=torch.float16)
            assert client.put_pages(tokens, pages).stored == 8192
            assert client.lookup(tokens) == len(tokens)
            index = PageIndex(on.redis_url)
            address = next(n for n in index.live_nodes()).extra["metrics"]
            index.close()
            host, http_port = address.rsplit(":", 1)
            conn = http.client.HTTPConnection(host, int(http_port))
            b64 = base64.b64encode(np.asarray(tokens, dtype="<u4").tobytes()).decode()
            bodies = {
                "query, token_ids_b64": json.dumps(
                    {"model": qns.model, "tenant": qns.tenant, "token_ids_b64": b64}
                ).encode(),
                "query, token_ids list": json.dumps(
                    {"model": qns.model, "tenant": qns.tenant, "token_ids": tokens}
                ).encode(),
            }

            raw = np.asarray(tokens, dtype="<u4").tobytes()
            bodies["query, raw u32 body"] = raw

            def ask(body: bytes) -> int:
                if body is raw:
                    target = f"/v1/kv/query?model={qns.model}&tenant={qns.tenant}"
                    conn.request("POST", target, body, {"Content-Type": "application/octet-stream"})
                else:
                    conn.request("POST", "/v1/kv/query", body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                return json.loads(resp.read())["tokens"]

            for body in bodies.values():
                assert ask(body) == len(tokens)
            lat: dict[str, list[float]] = {"KVCacheClient.lookup": [], **{k: [] for k in bodies}}
            for i in range(query_calls):
                names = list(lat) if i % 2 == 0 else list(reversed(lat))
                for name in names:
                    t0 = time.perf_counter()
                    got = (
                        client.lookup(tokens)
                        if name == "KVCacheClient.lookup"
                        else ask(bodies[name])
                    )
                    lat[name].append(1000 * (time.perf_counter() - t0))
                    assert got == len(tokens)
            conn.close()
        base = statistics.median(lat["KVCacheClient.lookup"])
        print(
            f"\n| 8,192 blocks (131,072 tokens), {query_calls} calls each, interleaved | ms, median (min–max) | ratio to lookup (medians) |"
        )
        print("|---|---|---|")
        for name, values in lat.items():
            print(
                f"| {name} | {statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f}) | {statistics.median(values) / base:.2f} |"
            )
    finally:
        on.stop()
        off.stop()

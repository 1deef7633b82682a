"""bench/lookup.py's paused lookups (``--paused-only``): 16-block lookups after a second of
quiet, the client against the index call, redis-py's EXISTS pipeline and a PING, then
beside a worker thread that saves and loads pages (``busy_paused_lookups``)."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable

import redis

from bench.lookups.stores import fmt, plain_lookup, publish_plain
from client import KVCacheClient
from client.nodes.directory import KEEP_FRESH_S
from kvstore import Namespace, block_hash_bytes, block_hashes
from kvstore.index import PageIndex

PAUSE_S = 1.0  # quiet before each round of paused lookups
ROUND_CALLS = 10
BLOCK_ROUNDS = 5  # rounds of one system in a row (paused_rounds)
IDLE_S, IDLE_ROUNDS = 8.0, 5  # the first lookup after the client's background reads stopped


def paused_rounds(
    systems: list[tuple[str, Callable[[], object]]], rounds: int, pause: float = PAUSE_S
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """``rounds`` rounds per system, each ``pause`` seconds of quiet then ``ROUND_CALLS``
    calls; every call's time per system (ms), and each round's first. Systems take
    turns in blocks of ``BLOCK_ROUNDS`` rounds, each block led by one more round that is
    not counted: a round after a pause runs as the issue's pattern has it (the same
    calls, a pause before), not after another system's round, whose code its first call
    found warm or evicted (taking turns round by round, two clients alike but for their
    registry reads took 0.831 and 0.735 ms on first calls, the slower one following
    redis-py's EXISTS pipeline, the faster one the other client; in a shuffled order a
    round of the same system twice in a row took less)."""
    calls: dict[str, list[float]] = {name: [] for name, _ in systems}
    first: dict[str, list[float]] = {name: [] for name, _ in systems}
    for block in range(-(-rounds // BLOCK_ROUNDS)):
        for name, fn in systems:
            counted = min(BLOCK_ROUNDS, rounds - block * BLOCK_ROUNDS)
            for r in range(counted + 1):
                time.sleep(pause)
                times = []
                for _ in range(ROUND_CALLS):
                    t = time.perf_counter()
                    fn()
                    times.append((time.perf_counter() - t) * 1e3)
                if r:  # the lead round follows another system's block
                    calls[name] += times
                    first[name].append(times[0])
    return calls, first


def paused_lookups(
    url: str, index: PageIndex, ns: Namespace, stored: list[int], rounds: int
) -> None:
    """Lookup latency with pauses between rounds (see the module docstring): the tail
    an engine sees when requests do not come back to back."""
    tokens = stored[: 16 * ns.block_size]
    nodes = index.live_nodes()
    ping = redis.Redis.from_url(url)
    plain = redis.Redis.from_url(url)  # the redis-py floor: the same question as plain keys
    publish_plain(plain, block_hashes(ns, tokens))
    client = KVCacheClient(url, ns)  # default node_refresh (1 s): the registry ages between rounds
    try:
        systems: list[tuple[str, Callable[[], object]]] = [
            ("kvstore client", lambda: client.lookup(tokens)),
            (
                "kvstore index (no node list)",
                lambda: index.lookup(ns, block_hash_bytes(ns, tokens)).resolve(nodes).matched,
            ),
            ("redis-py EXISTS pipeline", lambda: plain_lookup(plain, ns, tokens, "EXISTS")),
            ("PING", ping.ping),
        ]
        for _, fn in systems:
            fn()
        assert client.lookup(tokens) == len(tokens)
        # As vLLM's engine core does once it started (freeze_gc_heap in
        # vllm/v1/engine/core.py), where the scheduler asks its lookups: the startup heap
        # (torch's) leaves the collector's view. Unfrozen, a full collection over it took
        # about 120 ms here, once in about 300 calls, landing on whichever call ran.
        gc.collect()
        gc.freeze()
        full = [0]
        gc.callbacks.append(
            lambda phase, info: (
                phase == "start" and info["generation"] == 2 and full.__setitem__(0, full[0] + 1)
            )
        )
        calls, first = paused_rounds(systems, rounds)
        print(
            f"\npaused lookups, 16 blocks: rounds of {ROUND_CALLS} calls, {PAUSE_S:.0f} s of quiet before each, "
            f"{rounds} rounds per system taking turns; ms"
        )
        print(
            f"{'':<30} {'all calls: median (min-max)':>28} {'p99':>8} {'first of a round':>24} "
            f"{'p99/p50':>8} {'first/p50':>10}"
        )
        for name, _ in systems:
            p50, p99 = statistics.median(calls[name]), statistics.quantiles(calls[name], n=100)[98]
            first_ratio = statistics.median(first[name]) / p50
            print(
                f"{name:<30} {fmt(calls[name]):>28} {p99:>8.2f} {fmt(first[name]):>24} "
                f"{p99 / p50:>8.2f} {first_ratio:>10.2f}",
                flush=True,
            )
        print(f"full collections during the rounds (the heap frozen before them): {full[0]}")
        floor = statistics.median(calls["redis-py EXISTS pipeline"])
        print(
            f"kvstore client / redis-py EXISTS pipeline: p50 "
            f"{statistics.median(calls['kvstore client']) / floor:.2f}x, p99 "
            f"{statistics.quantiles(calls['kvstore client'], n=100)[98] / statistics.quantiles(calls['redis-py EXISTS pipeline'], n=100)[98]:.2f}x",
            flush=True,
        )
        # Past KEEP_FRESH_S of quiet the client stops reading the registry, and its next
        # lookup reads it in its own round trip (client.nodes.directory).
        _, idle_first = paused_rounds([systems[0], systems[2]], IDLE_ROUNDS, IDLE_S)
        print(
            f"first call after {IDLE_S:.0f} s of quiet ({IDLE_ROUNDS} rounds each, longer than "
            f"the client's {KEEP_FRESH_S:.0f} s of background registry reads): "
            + ", ".join(f"{name} {fmt(idle_first[name])}" for name in idle_first),
            flush=True,
        )
    finally:
        client.close()
        ping.close()
        plain.close()


# The worker's rhythm beside paused lookups: 16 pages of 2 MiB saved then loaded, then
# WORKER_IDLE_S of quiet (an engine step's transfers, then its compute), or none at all.
WORKER_PAGES = 16
WORKER_IDLE_S = 0.05


def busy_paused_lookups(rounds: int) -> None:
    """The paused lookups with a worker in the same process loading and saving meanwhile,
    as the vLLM connector's scheduler asks while its worker moves pages (one engine
    process): a thread that saves 16 pages of 2 MiB and loads them back through a client
    of its own, same host or over UCX, with 50 ms of quiet after each or none. The
    client's lookups and redis-py's EXISTS pipeline take turns round by round under the
    same worker; one storage node and its Valkey."""
    import threading

    import torch

    from kvstore.tools.launcher import LocalCluster

    ns = Namespace(
        model="busy", layout="vllm_cpu", num_kv_heads=8, head_size=128, dtype="bfloat16",
        num_layers=32, block_size=16,
    )  # fmt: skip
    tokens = list(range(16 * ns.block_size))
    print(
        f"\npaused lookups beside a worker, 16 blocks: rounds of {ROUND_CALLS} calls after "
        f"{PAUSE_S:.0f} s of quiet, {rounds} rounds per system taking turns, while a thread "
        f"saves and loads {WORKER_PAGES} pages of {ns.page_nbytes >> 20} MiB; ms"
    )
    print(
        f"{'worker':<34} {'system':<26} {'all calls: median (min-max)':>28} {'p99':>7} "
        f"{'first of a round':>22} {'moved':>9}"
    )
    # room for every page saved within a read lease (5 s) of being loaded: a full node
    # refuses saves while all its pages are leased (docs/design.md)
    with LocalCluster(1, "8GiB", slab_size="32MiB") as cluster:
        url = cluster.redis_url
        plain = redis.Redis.from_url(url)
        publish_plain(plain, block_hashes(ns, tokens))
        pages = torch.randn((WORKER_PAGES, *ns.page_shape)).to(torch.bfloat16)
        with KVCacheClient(url, ns) as client:
            client.put_pages(tokens, pages)
            for same_host, idle in ((True, WORKER_IDLE_S), (False, WORKER_IDLE_S), (False, 0.0)):
                worker = KVCacheClient(url, ns, timeout=60, same_host=same_host)
                stop, moved = threading.Event(), [0]

                def work(worker: KVCacheClient = worker, idle: float = idle) -> None:
                    out = torch.empty_like(pages)
                    k = 0
                    while not stop.is_set():
                        k += 1  # a new prompt each time: its pages are stored, not skipped
                        start = 10**8 * (1 + same_host) + k * 4096 + int(idle * 1e6)
                        batch = list(range(start, start + WORKER_PAGES * ns.block_size))
                        stored = worker.put_pages(batch, pages).stored
                        loaded = worker.get_pages(batch, out) // ns.block_size
                        moved[0] += (stored + loaded) * ns.page_nbytes  # only what moved
                        if idle:
                            time.sleep(idle)

                systems: list[tuple[str, Callable[[], object]]] = [
                    ("kvstore client", lambda: client.lookup(tokens)),
                    ("redis-py EXISTS pipeline", lambda: plain_lookup(plain, ns, tokens, "EXISTS")),
                ]
                for _, fn in systems:
                    fn()
                thread = threading.Thread(target=work, daemon=True)
                thread.start()
                began = time.monotonic()
                try:
                    calls, first = paused_rounds(systems, rounds)
                finally:
                    stop.set()
                    thread.join()
                    worker.close()
                rate = moved[0] / (time.monotonic() - began) / 1e9
                label = f"{'same host' if same_host else 'UCX'}, " + (
                    f"{idle * 1e3:.0f} ms quiet after each" if idle else "no quiet"
                )
                for name, _ in systems:
                    p99 = statistics.quantiles(calls[name], n=100)[98]
                    print(
                        f"{label:<34} {name:<26} {fmt(calls[name]):>28} {p99:>7.2f} "
                        f"{fmt(first[name]):>22} {rate:>6.2f} GB/s",
                        flush=True,
                    )
                p50s = [statistics.median(calls[name]) for name, _ in systems]
                p99s = [statistics.quantiles(calls[name], n=100)[98] for name, _ in systems]
                print(
                    f"{'':<34} kvstore client / redis-py EXISTS pipeline: p50 "
                    f"{p50s[0] / p50s[1]:.2f}x, p99 {p99s[0] / p99s[1]:.2f}x",
                    flush=True,
                )
        plain.close()

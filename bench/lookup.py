"""Prefix lookups: kvstore's index against plain Redis commands, on the embedded Valkey.

    python bench/lookup.py [--iterations 60] [--cluster] [--paused-rounds 20] [--paused-only]

One prompt of 8,192 blocks (16 tokens each) is committed, its blocks spread over two
live nodes. Each figure is a lookup of the first 16, 128, 1,024 or 8,192 blocks of a
prompt whose first 100 %, 50 % or 0 % of blocks are stored, end to end: from a list of
token ids (as an engine hands them over) through hashing and the index round trip to
the matched length and each matched page's live replicas (node, slot, size, checksum).

- kvstore: ``block_hash_bytes`` + ``PageIndex.lookup`` + ``IndexLookup.resolve``, as
  the client's ``find`` does (one script call per shard, one key per 64 blocks,
  liveness checked against the cached registry);
- kvstore client: ``KVCacheClient.lookup``, the blocking client as a caller uses it
  (the ratio column is its figure over plain ``exists``);
- plain: the same question asked with plain commands, one key per page (a hash of
  node -> location), the prefix found client side: ``exists`` pipelines one ``EXISTS``
  per block (existence only, the baseline the ratio is taken to), ``hgetall`` one
  ``HGETALL`` per block (with locations). Neither checks liveness nor takes a lease,
  so both do less than kvstore does.

The two are interleaved (A B A B ...) and reported as median and min-max in ms, with
kvstore's figure as a ratio of plain's. Valkey CPU per looked-up block comes from
``INFO commandstats`` (usec of the commands each system sent). ``--cluster`` adds
kvstore on a 3-shard embedded Valkey cluster (shards looked up in parallel).

Last, head groups (docs/key-format.md): a prompt stored by a TP=2 engine (two head
groups per block) looked up by a TP=1 engine (both groups) and by one TP=2 rank (its
group), beside a TP=1 engine looking up its own whole pages, interleaved, with each
figure as a ratio of the same-TP one.

Then paused lookups (alone with ``--paused-only``): 16-block lookups as an engine
with gaps between requests makes them, in rounds of 10 calls with about a second of
quiet before each round, through the blocking client at its default ``node_refresh``
(1 s, so every round finds its node list a second older), beside the index call alone
(no node list at all), redis-py's pipelined ``EXISTS`` of the same 16 blocks stored as
plain keys (the floor a plain Redis client sets, issue 53) and a ``PING`` (one round
trip, nothing else: what a pause costs this machine). Systems take turns in blocks of
5 rounds, each led by a round not counted (``paused_rounds`` says why); per system the
median and min-max of every call, the p99, the first call of a round, and p99 and the
first call's median as ratios of the median (p50). On a machine whose cores sleep
between rounds, PING's ratios are the floor: the pause costs every round trip after
it. Then the client's and ``EXISTS``' first call after 8 s of quiet, longer than the
client's background registry reads last (``KEEP_FRESH_S``).

Last, the same paused lookups beside a worker (``busy_paused_lookups``): a thread of the
same process saves and loads 16 pages of 2 MiB through a client of its own, as the vLLM
connector's worker does beside its scheduler in one engine process, same host or over
UCX, with 50 ms of quiet after each batch or none; the client and redis-py's EXISTS
pipeline take turns under the same worker, on one storage node and its Valkey."""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from client import KVCacheClient
from client.nodes.directory import KEEP_FRESH_S
from kvstore import Namespace, block_hash_bytes, block_hashes
from kvstore.index import CommitEntry, PageIndex
from kvstore.pages import keys
from kvstore.pages.hashing import reference_block_hashes
from kvstore.pages.identity import MultimodalItem, RequestIdentity
from kvstore.tools.valkey import EmbeddedValkey, EmbeddedValkeyCluster

BLOCKS = 8192
COUNTS = (16, 128, 1024, 8192)
HITS = (1.0, 0.5, 0.0)
# what a kvstore lookup sends: the lookup script, or for a one-segment shard plain
# commands (kvstore/index/page_index.py, _plain_lookup)
KVSTORE_COMMANDS = ("evalsha", "get", "pttl", "set", "pexpire")


def query(ns: Namespace, stored: list[int], count: int, hit: float, salt: int) -> list[int]:
    """Token ids of ``count`` blocks whose first ``hit`` share are the stored prompt's."""
    keep = int(count * hit) * ns.block_size
    fresh = list(
        range(
            10_000_000 + salt * BLOCKS * ns.block_size,
            10_000_000 + salt * BLOCKS * ns.block_size + count * ns.block_size - keep,
        )
    )
    return stored[:keep] + fresh


def publish(index: PageIndex, ns: Namespace, hashes: list[bytes]) -> None:
    index.ensure_namespace(ns)
    anchors, positions = keys.placement(hashes)
    for node in ("a", "b"):
        reg = index.register_node(node, f"127.0.0.1:{1 + (node == 'b')}", 1 << 30, 3_600_000)
        mine = [i for i in range(len(hashes)) if (i % 2 == 0) == (node == "a")]
        for start in range(0, len(mine), 2048):
            chunk = mine[start : start + 2048]
            index.commit(
                ns,
                reg.number,
                reg.incarnation,
                [
                    CommitEntry(hashes[i], anchors[i], positions[i], i << 21, 2 << 20, i)
                    for i in chunk
                ],
            )


def publish_plain(r: redis.Redis, hashes: list[bytes]) -> None:
    pipe = r.pipeline(transaction=False)
    for i, h in enumerate(hashes):
        pipe.hset(
            b"bench:p:" + h, "a" if i % 2 == 0 else "b", f"0123456789abcdef|{i << 21}|{2 << 20}|{i}"
        )
    pipe.execute()


def publish_units(
    index: PageIndex, regs: list, storage: Namespace, hashes: list[bytes], groups: int
) -> None:
    """Commit ``groups`` units of every block (as that many TP ranks would), spread over
    the two registered nodes ``regs``."""
    from kvstore.pages.heads import unit_hashes

    index.ensure_namespace(storage)
    anchors, positions = keys.placement(hashes)
    units = unit_hashes(
        hashes, 0, groups
    )  # unit by unit: unit j of block b is units[j * len(hashes) + b]
    for j, reg in enumerate(regs):
        mine = [
            k for k in range(len(units)) if k // len(hashes) % 2 == j
        ]  # unit j on node j, as ranks would put them
        for start in range(0, len(mine), 2048):
            index.commit(
                storage,
                reg.number,
                reg.incarnation,
                [
                    CommitEntry(
                        units[k],
                        anchors[k % len(hashes)],
                        positions[k % len(hashes)],
                        k << 20,
                        (2 << 20) // groups,
                        k,
                    )
                    for k in mine[start : start + 2048]
                ],
            )


def tp_lookups(url: str, iterations: int) -> None:
    """Lookup latency with head groups against whole pages (see the module docstring)."""
    base = dict(model="bench-tp", dtype="float16", num_layers=32, head_size=128, block_size=16)
    same = Namespace(**base, num_kv_heads=8)  # TP=1, one group: whole pages
    tp1 = Namespace(**base, num_kv_heads=8, head_groups=2)  # TP=1 reading what TP=2 stored
    rank = Namespace(**base, num_kv_heads=4, tp_size=2)  # TP=2 rank 0 (two groups by default)
    assert tp1.storage == rank.storage
    pp = Namespace(
        **base, num_kv_heads=8, layer_groups=2
    )  # a PP=1 engine reading what PP=2 stages stored (2 layer groups)
    pp_tp = Namespace(
        **base, num_kv_heads=8, head_groups=2, layer_groups=2
    )  # PP=2 x TP=2 stores: 4 units per block
    index = PageIndex(url)
    stored = list(range(BLOCKS * 16))
    regs = [
        index.register_node(node, f"127.0.0.1:{3 + j}", 1 << 30, 3_600_000)
        for j, node in enumerate(("tp-a", "tp-b"))
    ]
    publish_units(index, regs, same.storage, block_hashes(same.storage, stored), 1)
    publish_units(index, regs, tp1.storage, block_hashes(tp1.storage, stored), 2)
    publish_units(index, regs, pp.storage, block_hashes(pp.storage, stored), 2)
    publish_units(index, regs, pp_tp.storage, block_hashes(pp_tp.storage, stored), 4)
    nodes = index.live_nodes()

    def ask(ns: Namespace, units: tuple[int, int]) -> Callable[[list[int]], int]:
        storage = ns.storage
        return lambda t: (
            index.lookup(storage, block_hash_bytes(storage, t), units=units).resolve(nodes).matched
        )

    systems = [
        ("same TP (TP=1, whole pages)", ask(same, (0, 1))),
        ("TP=2 -> TP=1 (2 groups)", ask(tp1, (0, 2))),
        ("TP=2 -> TP=2 rank (1 group)", ask(rank, (0, 1))),
        ("PP=2 -> PP=1 (2 layer groups)", ask(pp, (0, 2))),
        ("PP=2 x TP=2 -> any (4 units)", ask(pp_tp, (0, 4))),
    ]
    print(
        "\nhead and layer groups: lookup latency, token ids -> locations, ms, median (min-max); ratio to same TP"
    )
    for count in (1024, 8192):
        tokens = stored[: count * 16]
        for name, fn in systems:
            assert fn(tokens) == count, name
        samples: dict[str, list[float]] = {name: [] for name, _ in systems}
        for _ in range(iterations if count < 8192 else max(10, iterations // 3)):
            for name, fn in systems:
                t = time.perf_counter()
                fn(tokens)
                samples[name].append((time.perf_counter() - t) * 1e3)
        base_ms = statistics.median(samples[systems[0][0]])
        print(
            f"{count:>6} blocks | "
            + " | ".join(
                f"{name}: {fmt(samples[name])} ({statistics.median(samples[name]) / base_ms:.2f}x)"
                for name, _ in systems
            ),
            flush=True,
        )


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


def plain_lookup(r: redis.Redis, ns: Namespace, tokens: list[int], command: str) -> int:
    hashes = block_hashes(ns, tokens)
    pipe = r.pipeline(transaction=False)
    for h in hashes:
        pipe.execute_command(command, b"bench:p:" + h)
    replies = pipe.execute()
    return next((i for i, v in enumerate(replies) if not v), len(replies))


@functools.cache
def admin(url: str) -> redis.Redis:
    """One connection per server for the statistics commands, kept open: a connection
    made and dropped around every timed lookup left Valkey closing it while the next
    lookup ran."""
    return redis.Redis.from_url(url)


def server_usec(servers: list[Any], commands: tuple[str, ...]) -> float:
    total = 0.0
    for server in servers:
        stats = admin(server.url).info("commandstats")
        total += sum(stats.get(f"cmdstat_{c}", {}).get("usec", 0) for c in commands)
    return total


def reset(servers: list[Any]) -> None:
    for server in servers:
        admin(server.url).config_resetstat()


def fmt(samples: list[float]) -> str:
    return f"{statistics.median(samples):.2f} ({min(samples):.2f}-{max(samples):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument(
        "--cluster", action="store_true", help="also kvstore on a 3-shard Valkey cluster"
    )
    parser.add_argument(
        "--paused-rounds", type=int, default=20, help="rounds per system of the paused lookups"
    )
    parser.add_argument(
        "--paused-only", action="store_true", help="only the paused lookups (about 3 s a round)"
    )
    args = parser.parse_args()
    ns = Namespace(
        model="bench", dtype="float16", num_layers=32, num_kv_heads=8, head_size=128, block_size=16
    )
    stored = list(range(BLOCKS * ns.block_size))
    hashes = block_hashes(ns, stored)

    if args.paused_only:
        single = EmbeddedValkey().start()
        try:
            index = PageIndex(single.url)
            publish(index, ns, hashes)
            paused_lookups(single.url, index, ns, stored, args.paused_rounds)
        finally:
            single.stop()
        busy_paused_lookups(args.paused_rounds)
        return 0

    # hashing, interleaved; each result is dropped inside its timing, as a lookup's is
    def salted(ns: Namespace, tokens: list[int]) -> bytes:
        # a cache_salt: block 0 keyed apart, the rest in the C loop
        return block_hash_bytes(
            ns,
            tokens,
            RequestIdentity(cache_salt="user-1").block_extras(ns.block_size, len(tokens)),
        )

    def image(ns: Namespace, tokens: list[int]) -> bytes:
        # a 576-token image in the middle: 36 blocks keyed apart
        item = MultimodalItem(hash="image-0", offset=len(tokens) // 2, length=576)
        return block_hash_bytes(
            ns, tokens, RequestIdentity(multimodal=(item,)).block_extras(ns.block_size, len(tokens))
        )

    hashers: list[tuple[str, Callable[[Namespace, list[int]], object]]] = [
        ("kvstore, joined (block_hash_bytes)", block_hash_bytes),
        ("kvstore, a list (block_hashes)", block_hashes),
        ("kvstore, salted (cache_salt)", salted),
        ("kvstore, an image in the middle", image),
        ("hashlib in a Python loop", reference_block_hashes),
    ]
    hash_ms: dict[str, list[float]] = {name: [] for name, _ in hashers}
    for _ in range(30):
        for name, hasher in hashers:
            t = time.perf_counter()
            hasher(ns, stored)
            hash_ms[name].append((time.perf_counter() - t) * 1e3)
    assert reference_block_hashes(ns, stored) == hashes
    assert block_hash_bytes(ns, stored) == b"".join(hashes)
    base = statistics.median(hash_ms["hashlib in a Python loop"])
    print(
        f"hashing {BLOCKS} blocks from a token list, ms, median (min-max) over 30, interleaved; ratio to hashlib"
    )
    for name, _ in hashers:
        print(
            f"  {name:<36} {fmt(hash_ms[name]):<22} {statistics.median(hash_ms[name]) / base:.2f}"
        )
    print()

    single = EmbeddedValkey().start()
    cluster = EmbeddedValkeyCluster(3).start() if args.cluster else None
    try:
        index = PageIndex(single.url)
        publish(index, ns, hashes)
        nodes = index.live_nodes()
        plain = redis.Redis.from_url(single.url)
        publish_plain(plain, hashes)
        client = KVCacheClient(
            single.url, ns, node_refresh=60
        )  # the registered nodes are not real: no reads of the registry meanwhile
        systems: list[tuple[str, Callable[[list[int]], int], list[Any], tuple[str, ...]]] = [
            (
                "kvstore",
                lambda t: index.lookup(ns, block_hash_bytes(ns, t)).resolve(nodes).matched,
                [single],
                KVSTORE_COMMANDS,
            ),
            (
                "kvstore client",
                lambda t: client.lookup(t) // ns.block_size,
                [single],
                KVSTORE_COMMANDS,
            ),
            ("plain exists", lambda t: plain_lookup(plain, ns, t, "EXISTS"), [single], ("exists",)),
            (
                "plain hgetall",
                lambda t: plain_lookup(plain, ns, t, "HGETALL"),
                [single],
                ("hgetall",),
            ),
        ]
        if cluster is not None:
            cindex = PageIndex(cluster.url)
            publish(cindex, ns, hashes)
            cnodes = cindex.live_nodes()
            systems.append(
                (
                    "kvstore 3-shard cluster",
                    lambda t: cindex.lookup(ns, block_hash_bytes(ns, t)).resolve(cnodes).matched,
                    cluster.shards,
                    KVSTORE_COMMANDS,
                )
            )

        print(
            "lookup latency, token ids -> locations, ms, median (min-max); Valkey CPU per looked-up block, us"
        )
        head = (
            f"{'blocks':>6} {'hit':>4} | "
            + " | ".join(f"{name:^26}" for name, *_ in systems)
            + " | client/exists | "
            + " | ".join(f"{name[:13] + ' us/blk':>20}" for name, *_ in systems)
        )
        print(head)
        print("-" * len(head))
        per_call: dict[tuple[str, int, float], float] = {}
        for count in COUNTS:
            iterations = args.iterations if count < 8192 else max(10, args.iterations // 3)
            for hit in HITS:
                salt = COUNTS.index(count) * 3 + HITS.index(hit)
                tokens = query(ns, stored, count, hit, salt)
                samples: dict[str, list[float]] = {name: [] for name, *_ in systems}
                usec: dict[str, float] = {}
                for name, fn, *_ in systems:  # warm up; check every system agrees
                    assert fn(tokens) == int(count * hit), (name, count, hit)
                for name, *_ in systems:
                    usec[name] = 0.0
                for _ in range(iterations):
                    for name, fn, servers, commands in systems:
                        reset(servers)
                        t = time.perf_counter()
                        fn(tokens)
                        samples[name].append((time.perf_counter() - t) * 1e3)
                        usec[name] += server_usec(servers, commands)
                per_call.update({(name, count, hit): usec[name] / iterations for name in usec})
                ratio = statistics.median(samples["kvstore client"]) / statistics.median(
                    samples["plain exists"]
                )
                cpu = " | ".join(
                    f"{usec[name] / iterations / count:>20.3f}" for name, *_ in systems
                )
                print(
                    f"{count:>6} {int(hit * 100):>3}% | "
                    + " | ".join(f"{fmt(samples[name]):>26}" for name, *_ in systems)
                    + f" | {ratio:>14.2f} | {cpu}",
                    flush=True,
                )
        per_second = {
            name: 1e6 / per_call[(name, 8192, 1.0)]
            for name in ("kvstore", "plain exists", "plain hgetall")
        }
        print(
            f"\none Valkey core answers about {per_second['kvstore']:,.0f} kvstore lookups of 8192 stored blocks a "
            f"second (plain EXISTS: {per_second['plain exists']:,.0f}, "
            f"plain HGETALL: {per_second['plain hgetall']:,.0f})"
        )
        tp_lookups(single.url, args.iterations)
        paused_lookups(single.url, index, ns, stored, args.paused_rounds)
    finally:
        single.stop()
        if cluster is not None:
            cluster.stop()
    busy_paused_lookups(args.paused_rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.lookups.groups import tp_lookups
from bench.lookups.paused import busy_paused_lookups, paused_lookups
from bench.lookups.stores import (
    BLOCKS,
    COUNTS,
    HITS,
    KVSTORE_COMMANDS,
    fmt,
    plain_lookup,
    publish,
    publish_plain,
    query,
    reset,
    server_usec,
)
from client import KVCacheClient
from kvstore import Namespace, block_hash_bytes, block_hashes
from kvstore.index import PageIndex
from kvstore.pages.hashing import reference_block_hashes
from kvstore.pages.identity import MultimodalItem, RequestIdentity
from kvstore.tools.valkey import EmbeddedValkey, EmbeddedValkeyCluster


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

"""bench/lookup.py's prompt and its stores: the block counts and hit rates looked up,
the prompt committed to kvstore's index and stored as plain keys (one per page), a plain
client's lookup, Valkey's CPU from ``INFO commandstats``, and a figure as median (min-max).
Used by bench/lookup.py and the other bench/lookups/ modules."""

from __future__ import annotations

import functools
import statistics
from typing import Any

import redis

from kvstore import Namespace, block_hashes
from kvstore.index import CommitEntry, PageIndex
from kvstore.pages import keys

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

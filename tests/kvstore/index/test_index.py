"""The page index against a real Valkey and a real 3-shard Valkey cluster: lookup
semantics, segments, leases, registry, fencing and shard faults."""

from __future__ import annotations

import time

import pytest
import redis

from kvstore import (
    FencedError,
    NodeIdInUseError,
    block_hashes,
)
from kvstore.index import (
    CommitEntry,
    PageIndex,
)
from kvstore.pages import keys
from kvstore.tools.valkey import EmbeddedValkey, EmbeddedValkeyCluster
from tests.support.index_fixtures import (  # noqa: F401 (fixtures)
    TTL,
    chain,
    commit,
    fresh_registry,
    index,
    lookup,
    register,
    remove,
    valkey,
)


def test_lookup_returns_longest_committed_prefix_with_locations(index, namespace):
    index.ensure_namespace(namespace)
    a = register(index, "a")
    hashes = chain(namespace, 6)
    commit(index, namespace, a, hashes[:2] + hashes[3:], chain_hashes=hashes)  # hole at 2
    result = lookup(index, namespace, hashes)
    assert result.matched == 2
    assert [
        [(l.node_id, l.incarnation, l.slot, l.size, l.checksum) for l in locs]
        for locs in result.locations
    ] == [[("a", a.incarnation, 0, 100, 1000)], [("a", a.incarnation, 1, 101, 1001)]]


def test_a_long_prefix_spans_segments_and_shards(index, namespace, valkey):
    index.ensure_namespace(namespace)
    a, b = register(index, "a"), register(index, "b", "127.0.0.1:2")
    hashes = chain(namespace, 5 * keys.SEGMENT_PAGES + 7)
    commit(index, namespace, a, hashes[::2], chain_hashes=hashes)
    commit(index, namespace, b, hashes[1::2], chain_hashes=hashes, slot0=10_000)
    result = lookup(index, namespace, hashes)
    assert result.matched == len(hashes)
    assert [locs[0].node_id for locs in result.locations[:4]] == ["a", "b", "a", "b"]
    assert result.locations[129][0].slot == 10_000 + 64  # hashes[129] is b's 65th page
    joined = lookup(
        index, namespace, b"".join(hashes)
    )  # as the client's find asks (block_hash_bytes)
    assert joined.matched == len(hashes) and joined.locations == result.locations
    # asked further than it is stored, the prefix ends inside the last stored segment
    assert lookup(index, namespace, chain(namespace, 7 * keys.SEGMENT_PAGES)).matched == len(hashes)
    servers = valkey.shards if isinstance(valkey, EmbeddedValkeyCluster) else [valkey]
    per_server = [
        sum(1 for _ in redis.Redis.from_url(s.url).scan_iter(f"{namespace.key.prefix}s:*"))
        for s in servers
    ]
    assert sum(per_server) == 6
    if len(servers) > 1:  # one namespace spreads over the shards
        assert sum(n > 0 for n in per_server) >= 2


def test_chains_that_share_a_segment_only_see_their_own_pages(index, namespace):
    """Two prompts agree on 10 blocks and then differ: both live in one segment."""
    index.ensure_namespace(namespace)
    a = register(index, "a")
    first = block_hashes(namespace, list(range(20 * namespace.block_size)))
    second = block_hashes(
        namespace, list(range(10 * namespace.block_size)) + [7] * (10 * namespace.block_size)
    )
    assert first[:10] == second[:10] and first[10] != second[10]
    commit(index, namespace, a, first)
    commit(index, namespace, a, second[10:15], chain_hashes=second, slot0=500)
    assert lookup(index, namespace, first).matched == 20
    result = lookup(index, namespace, second)
    assert result.matched == 15
    assert [locs[0].slot for locs in result.locations[9:12]] == [9, 500, 501]


def test_more_than_255_pages_of_one_segment_in_one_commit(index, namespace):
    index.ensure_namespace(namespace)
    a = register(index, "a")
    root = chain(namespace, 1)
    # 300 prompts share block 0 and differ in block 1: 300 pages at position 1 of one segment
    seconds = [
        block_hashes(namespace, list(range(namespace.block_size)) + [i] * namespace.block_size)[1]
        for i in range(300)
    ]
    entries = [CommitEntry(h, root[0], 1, i, 10, 20) for i, h in enumerate(seconds)] + [
        CommitEntry(root[0], root[0], 0, 999, 10, 20)
    ]
    assert all(index.commit(namespace, a.number, a.incarnation, entries))
    for i in (0, 254, 255, 299):
        assert lookup(index, namespace, [root[0], seconds[i]]).locations[1][0].slot == i


def test_commit_is_idempotent_and_replaces_the_nodes_older_entry(index, namespace):
    index.ensure_namespace(namespace)
    a = register(index, "a")
    hashes = chain(namespace, 4)
    commit(index, namespace, a, hashes)
    commit(index, namespace, a, hashes)
    assert [len(locs) for locs in lookup(index, namespace, hashes).locations] == [1, 1, 1, 1]
    commit(index, namespace, a, hashes, slot0=50)  # the page moved to another slot
    assert [locs[0].slot for locs in lookup(index, namespace, hashes).locations] == [50, 51, 52, 53]


def test_stats_count_what_live_nodes_report(index, namespace):
    index.ensure_namespace(namespace)
    index.announce_namespace(namespace.key)  # a node does, when it first serves it
    a = register(index, "a", pages=f'{{"{namespace.digest_hex}":4}}')
    register(index, "b", "127.0.0.1:2", pages=f'{{"{namespace.digest_hex}":2}}')
    spaces = {s.digest: s for s in index.stats().namespaces}
    assert (
        spaces[namespace.digest_hex].per_node == {"a": 4, "b": 2}
        and spaces[namespace.digest_hex].pages == 6
    )
    assert spaces[namespace.digest_hex].namespace == namespace
    index.deregister_node("a", a.incarnation)
    assert {s.digest: s for s in index.stats().namespaces}[namespace.digest_hex].pages == 2


def test_pages_of_dead_or_restarted_nodes_are_absent(index, namespace):
    index.ensure_namespace(namespace)
    a = register(index, "a")
    b = register(index, "b", "127.0.0.1:2")
    hashes = chain(namespace, 3)
    commit(index, namespace, a, hashes)
    commit(index, namespace, b, hashes[:1], chain_hashes=hashes)
    # b goes away: page 0 still has a's replica
    index.deregister_node("b", b.incarnation)
    result = lookup(index, namespace, hashes)
    assert result.matched == 3 and [l.node_id for l in result.locations[0]] == ["a"]
    # a restarts: a new incarnation (same number) makes all of its old pages absent
    a2 = register(index, "a", replaces=a.incarnation)
    assert a2.incarnation != a.incarnation and a2.number == a.number
    assert lookup(index, namespace, hashes).matched == 0
    commit(index, namespace, a2, hashes[:2], chain_hashes=hashes)
    assert lookup(index, namespace, hashes).matched == 2
    # a registration that lapses makes its pages absent too
    c = register(index, "c", "127.0.0.1:3", ttl=1000)
    commit(index, namespace, c, hashes)
    index.deregister_node("a", a2.incarnation)
    assert lookup(index, namespace, hashes).matched == 3
    time.sleep(1.1)
    assert lookup(index, namespace, hashes).matched == 0


def test_remove_respects_read_leases(index, namespace):
    index.ensure_namespace(namespace)
    a = register(index, "a")
    hashes = chain(namespace, keys.SEGMENT_PAGES + 1)
    commit(index, namespace, a, hashes)
    index.lookup(namespace, hashes[:1], lease_ms=5_000)  # leases the first segment only
    assert remove(index, namespace, a, hashes[:1] + hashes[-1:], hashes) == [False, True]
    assert lookup(index, namespace, hashes, lease_ms=0).matched == keys.SEGMENT_PAGES
    assert remove(index, namespace, a, hashes[:1], hashes, respect_lease=False) == [True]
    assert lookup(index, namespace, hashes).matched == 0


def test_a_short_lookup_keeps_its_lease_read_only_until_half_is_left(index, namespace):
    """A one-segment lookup (plain GET and PTTL, not the script) grants the segment a read
    lease, leaves it alone while more than half is left (repeated lookups write nothing),
    and renews it, with the segment's expiry, once less than half is left."""
    from kvstore.index.driver import single as _single
    from kvstore.index.routing import Cmd

    def pttl(key: str) -> int:
        return index.drive(_single(Cmd(("PTTL", key), key=key)))

    index.ensure_namespace(namespace)
    a = register(index, "a")
    hashes = chain(namespace, 4)
    commit(index, namespace, a, hashes)
    held, seg = (
        keys.lease_key(namespace.key.prefix, hashes[0]),
        keys.segment_key(namespace.key.prefix, hashes[0]),
    )
    assert pttl(held) == -2  # no lease before a read
    assert index.lookup(namespace, hashes, lease_ms=1_000).resolve(index.live_nodes()).matched == 4
    granted = pttl(held)
    assert 500 < granted <= 1_000
    time.sleep(0.2)
    index.lookup(namespace, hashes, lease_ms=1_000)
    assert pttl(held) < granted - 100  # more than half left: not renewed
    time.sleep(0.4)  # now below half
    index.lookup(namespace, hashes, lease_ms=1_000)
    assert pttl(held) > 800 and pttl(seg) > index.entry_ttl_ms - 60_000
    assert remove(index, namespace, a, hashes[:1], hashes) == [
        False
    ]  # the lease holds off eviction


def test_a_live_node_id_cannot_be_registered_twice(index):
    """Finding 7: a second process with the same node id is refused while the first lives."""
    first = register(index, "dup", "127.0.0.1:7", ttl=300)
    with pytest.raises(NodeIdInUseError, match="127.0.0.1:7"):
        register(index, "dup", "127.0.0.1:8")
    # the first keeps heartbeating; once it stops, its entry expires and the id is free
    index.register_node("dup", "127.0.0.1:7", 10, 300, first.incarnation)
    time.sleep(0.35)
    second = register(index, "dup", "127.0.0.1:8")
    # the superseded incarnation is fenced: its heartbeat fails
    with pytest.raises(FencedError):
        index.register_node("dup", "127.0.0.1:7", 10, TTL, first.incarnation)
    assert {n.node_id: n.incarnation for n in index.live_nodes()}["dup"] == second.incarnation


def test_commits_of_a_superseded_incarnation_are_never_seen(index, namespace):
    index.ensure_namespace(namespace)
    old = register(index, "f")
    new = register(index, "f", replaces=old.incarnation)  # even within the same millisecond
    assert new.incarnation > old.incarnation
    commit(index, namespace, old, chain(namespace, 1))
    assert lookup(index, namespace, chain(namespace, 1)).matched == 0


def test_an_index_that_lost_its_data_fences_every_heartbeat_and_never_repeats_an_incarnation(
    namespace,
):
    """Finding 5: epochs from INCR repeated after a data loss and old entries came back."""
    with EmbeddedValkey() as server:
        idx = PageIndex(server.url)
        idx.ensure_namespace(namespace)
        n = register(idx, "n")
        commit(idx, namespace, n, chain(namespace, 2))
        redis.Redis.from_url(server.url).flushall()
        with pytest.raises(FencedError):
            idx.register_node("n", "127.0.0.1:1", 10, TTL, n.incarnation)
        again = register(idx, "n", replaces=n.incarnation)
        assert again.incarnation != n.incarnation
        # an old entry restored from a snapshot would carry the old incarnation: unseen
        commit(idx, namespace, n, chain(namespace, 2))
        assert lookup(idx, namespace, chain(namespace, 2)).matched == 0
        idx.close()

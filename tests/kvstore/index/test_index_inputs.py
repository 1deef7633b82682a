"""The index's inputs and edges: bad input, an unreachable server, URL forms, the asyncio
index, resolving locations against live incarnations and units, a stale slot map."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import redis

from kvstore import (
    IndexUnavailableError,
    InvalidInputError,
)
from kvstore.index import (
    AsyncPageIndex,
    CommitEntry,
    PageIndex,
)
from kvstore.pages import keys
from kvstore.tools.procutil import free_port
from kvstore.tools.valkey import EmbeddedValkeyCluster
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


def test_bad_input_raises_clear_errors(index, namespace):
    index.ensure_namespace(namespace)
    with pytest.raises(InvalidInputError, match=r"page hash #1 must be 16 bytes, got 15"):
        index.lookup(namespace, [bytes(16), bytes(15)])
    with pytest.raises(InvalidInputError, match=r"page hash #0 must be 16 bytes, got str"):
        index.lookup(namespace, ["0" * 16])
    with pytest.raises(InvalidInputError, match="empty list"):
        index.lookup(namespace, [])
    with pytest.raises(
        InvalidInputError, match="joined page hashes must be a multiple of 16 bytes, got 31"
    ):
        index.lookup(namespace, bytes(31))
    with pytest.raises(
        InvalidInputError, match=r"page hash #0 must be 16 bytes, got int"
    ):  # only lookups take joined hashes
        index.remove(namespace, 1, bytes(32), [bytes(16), bytes(16)])
    with pytest.raises(InvalidInputError, match="32 lowercase hex"):
        index.lookup(keys.NamespaceKey("t", "nope"), [bytes(16)])
    with pytest.raises(InvalidInputError, match="tenant 'a:b' must match"):
        index.lookup(keys.NamespaceKey("a:b", "0" * 32), [bytes(16)])
    with pytest.raises(InvalidInputError, match="need a Namespace or NamespaceKey, got str"):
        index.lookup("0" * 32, [bytes(16)])
    assert (
        index.lookup(keys.NamespaceKey("t", "0" * 32), [bytes(16)]).resolve([]).matched == 0
    )  # unknown namespace: a miss
    with pytest.raises(InvalidInputError, match="redis://"):
        PageIndex("http://localhost:6379")
    with pytest.raises(InvalidInputError, match="host:port"):
        PageIndex("redis+cluster://")
    with pytest.raises(InvalidInputError, match="position"):
        index.commit(
            namespace, 1, "0" * 28, [CommitEntry(bytes(16), bytes(16), keys.SEGMENT_PAGES, 0, 1, 1)]
        )


def test_unreachable_redis_fails_fast_with_index_unavailable(namespace):
    for url in (
        f"redis://:secret@127.0.0.1:{free_port()}/0",
        f"redis+cluster://:secret@127.0.0.1:{free_port()},127.0.0.1:{free_port()}",
    ):
        idx = PageIndex(url, timeout=0.5)
        start = time.monotonic()
        with pytest.raises(IndexUnavailableError, match="unreachable|answered") as err:
            idx.live_nodes()
        assert time.monotonic() - start < 3
        assert "secret" not in str(err.value)


def test_url_forms_password_acl_user_and_db(valkey, namespace):
    if isinstance(valkey, EmbeddedValkeyCluster):
        servers, url = (
            valkey.shards,
            "redis+cluster://kvuser:pw1@" + ",".join(f"127.0.0.1:{s.port}" for s in valkey.shards),
        )
    else:
        servers, url = [valkey], f"redis://kvuser:pw1@127.0.0.1:{valkey.port}/3"
    for s in servers:
        redis.Redis.from_url(s.url).execute_command(
            "ACL", "SETUSER", "kvuser", "on", ">pw1", "~*", "+@all"
        )
    try:
        idx = PageIndex(url)
        idx.ensure_namespace(namespace)
        assert idx.lookup(namespace, [bytes(16)]).resolve([]).matched == 0
        assert idx.namespace(namespace.key) == namespace
        with pytest.raises(Exception, match="(?i)WRONGPASS|invalid"):
            PageIndex(url.replace("pw1", "wrong")).ping()
    finally:
        for s in servers:
            redis.Redis.from_url(s.url).execute_command("ACL", "DELUSER", "kvuser")


def test_async_index_has_the_same_semantics(valkey, namespace):
    async def scenario():
        idx = AsyncPageIndex(valkey.url)
        await idx.ensure_namespace(namespace)
        reg = await idx.register_node("async-node", "127.0.0.1:5", 10, TTL)
        hashes = chain(namespace, 3)
        anchors, positions = keys.placement(hashes)
        entries = [
            CommitEntry(h, anchors[i], positions[i], 0, 1, 2) for i, h in enumerate(hashes[:2])
        ]
        assert await idx.commit(namespace, reg.number, reg.incarnation, entries) == [True, True]
        nodes = await idx.live_nodes()
        result = (await idx.lookup(namespace, hashes)).resolve(nodes)
        assert await idx.deregister_node("async-node", reg.incarnation)
        after = [n.node_id for n in await idx.live_nodes()]
        await idx.close()
        return result.matched, [n.node_id for n in nodes], after

    matched, nodes, after = asyncio.run(scenario())
    assert matched == 2 and "async-node" in nodes and "async-node" not in after


def test_resolve_is_vectorised_and_keeps_only_current_incarnations():
    """Pure logic: entries of unknown node numbers or other incarnations never count."""
    from kvstore.index import ENTRY, IndexLookup, NodeInfo

    recs = np.zeros(4, dtype=ENTRY)
    recs["node"] = [1, 2, 1, 7]
    recs["tag"] = [0xAAAA, 0xBBBB, 0x1234, 0xAAAA]
    nodes = [
        NodeInfo("x", "h:1", 1, "0" * 20 + "0000aaaa", 1),
        NodeInfo("y", "h:2", 1, "0" * 20 + "0000bbbb", 2),
    ]
    found = IndexLookup(
        3, recs, np.array([0, 1, 2, 2]), np.zeros(4, dtype=np.int64), np.ones(3, dtype=np.int64)
    )
    result = found.resolve(nodes)
    assert result.matched == 2
    assert [[l.node_id for l in locs] for locs in result.locations] == [["x"], ["y"]]


def test_resolve_needs_every_asked_unit_of_a_block_from_a_live_node():
    """Pure logic: a block whose head groups are split over nodes counts only while a live
    replica of each group asked is there; replicas of one group do not stand in for another."""
    from kvstore.index import ENTRY, IndexLookup, NodeInfo

    recs = np.zeros(7, dtype=ENTRY)
    recs["node"] = [1, 2, 1, 1, 2, 1, 7]
    recs["tag"] = [0xAAAA, 0xBBBB, 0xAAAA, 0xAAAA, 0xBBBB, 0xAAAA, 0xAAAA]
    positions = np.array([0, 0, 1, 1, 2, 2, 2])
    units = np.array(
        [0, 1, 0, 0, 0, 0, 1]
    )  # block 1: two replicas of unit 0; block 2: unit 1 only on an unknown node
    nodes = [
        NodeInfo("x", "h:1", 1, "0" * 20 + "0000aaaa", 1),
        NodeInfo("y", "h:2", 1, "0" * 20 + "0000bbbb", 2),
    ]
    result = IndexLookup(3, recs, positions, units, np.full(3, 2)).resolve(nodes)
    assert result.matched == 1
    assert sorted((l.node_id, l.unit) for l in result.locations[0]) == [("x", 0), ("y", 1)]
    assert (
        IndexLookup(3, recs, positions, units, np.full(3, 1)).resolve(nodes).matched == 3
    )  # unit 0 alone: all there


def test_a_stale_slot_map_costs_one_shorter_lookup_then_is_read_again(namespace):
    """A resharded or failed-over cluster answers MOVED to a client with an old slot map:
    that lookup is a shorter prefix, the next reads the map again and matches fully."""
    with EmbeddedValkeyCluster(3) as cluster:
        index = PageIndex(cluster.url)
        index.ensure_namespace(namespace)
        a = register(index, "a")
        hashes = chain(namespace, keys.SEGMENT_PAGES)  # one segment: one shard holds it all
        commit(index, namespace, a, hashes)
        nodes = index.live_nodes()
        topology = index._router.topology
        slot = redis.crc.key_slot(keys.segment_key(namespace.key.prefix, hashes[0]).encode())
        right = topology.slot_shard[slot]
        topology.slot_shard[slot] = (right + 1) % 3  # as if the slot had moved
        found = index.lookup(namespace, hashes)
        assert found.unavailable is not None and "MovedError" in str(found.unavailable)
        assert found.resolve(nodes).matched == 0
        time.sleep(0.6)  # the map is read again at most every 0.5 s
        assert index.lookup(namespace, hashes).resolve(nodes).matched == len(hashes)
        assert index._router.topology.slot_shard[slot] == right
        index.close()


def test_a_namespace_registered_again_by_many_callers_at_once_is_one_index_call(valkey, namespace):
    """Every node refusing a put for a namespace the index lost makes its caller
    register it again: callers at once share one registration, and a later call (the
    index lost it again) makes a new one."""
    from client.lookups.registration import NamespaceRegistration

    calls = []

    class Counting(AsyncPageIndex):
        async def ensure_namespace(self, ns):
            calls.append(ns)
            await asyncio.sleep(0.05)  # in flight while the other callers arrive
            return await super().ensure_namespace(ns)

    async def scenario():
        idx = Counting(valkey.url)
        registration = NamespaceRegistration(idx, namespace)
        await asyncio.gather(*(registration.again() for _ in range(5)))
        shared = len(calls)
        await registration.again()
        await idx.close()
        return shared, len(calls), registration.registered, namespace_stored(valkey.url)

    def namespace_stored(url):
        return PageIndex(url).namespace(namespace.key) == namespace

    shared, total, registered, stored = asyncio.run(scenario())
    assert shared == 1 and total == 2 and registered and stored

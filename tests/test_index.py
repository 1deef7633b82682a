"""The page index against a real Valkey: lookup semantics, publish phases, registry."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
import redis

from kvstore import IndexUnavailableError, InvalidInputError, UnknownNamespaceError, block_hashes
from kvstore.index import AsyncPageIndex, CommitEntry, PageIndex, ReserveStatus
from kvstore.procutil import free_port

TTL = 60_000


def commit(index, ns, node, epoch, hashes, slot0=0):
    entries = [CommitEntry(h, slot0 + i, 100 + i, 1000 + i) for i, h in enumerate(hashes)]
    return index.commit(ns, node, epoch, entries, TTL)


def chain(ns, n):
    return block_hashes(ns, list(range(n * ns.block_size)))


def test_lookup_returns_longest_committed_prefix_with_locations(index, namespace):
    index.ensure_namespace(namespace)
    epoch = index.register_node("a", "127.0.0.1:1", 10, TTL)
    hashes = chain(namespace, 6)
    commit(index, namespace, "a", epoch, hashes[:2] + hashes[3:])  # hole at 2
    result = index.lookup(namespace, hashes)
    assert result.matched == 2
    assert [[(l.node_id, l.slot, l.size, l.checksum) for l in locs] for locs in result.locations] == [
        [("a", 0, 100, 1000)], [("a", 1, 101, 1001)]
    ]


def test_reservations_are_invisible_and_expire(index, namespace, valkey):
    index.ensure_namespace(namespace)
    epoch = index.register_node("a", "127.0.0.1:1", 10, TTL)
    hashes = chain(namespace, 3)
    assert index.reserve(namespace, "a", epoch, hashes) == [ReserveStatus.RESERVED] * 3
    assert index.reserve(namespace, "a", epoch, hashes[:1]) == [ReserveStatus.IN_FLIGHT]
    assert index.lookup(namespace, hashes).matched == 0
    time.sleep(0.5)  # reserve TTL is 200 ms in this fixture; keys of bare reservations expire at 2x
    assert index.lookup(namespace, hashes).matched == 0
    raw = redis.Redis.from_url(valkey.url)
    assert not raw.keys(f"kvs:{{{namespace.digest_hex}}}:p:*")
    assert index.reserve(namespace, "a", epoch, hashes[:1]) == [ReserveStatus.RESERVED]


def test_commit_is_idempotent_and_counts_pages(index, namespace):
    index.ensure_namespace(namespace)
    epoch = index.register_node("a", "127.0.0.1:1", 10, TTL)
    hashes = chain(namespace, 4)
    index.reserve(namespace, "a", epoch, hashes)
    assert commit(index, namespace, "a", epoch, hashes) == [True] * 4
    assert commit(index, namespace, "a", epoch, hashes) == [False] * 4
    assert index.reserve(namespace, "a", epoch, hashes[:1]) == [ReserveStatus.PRESENT]
    stats = {s.digest: s for s in index.stats().namespaces}
    assert stats[namespace.digest_hex].pages == 4
    assert stats[namespace.digest_hex].namespace == namespace


def test_pages_of_dead_or_restarted_nodes_are_absent(index, namespace):
    index.ensure_namespace(namespace)
    ea = index.register_node("a", "127.0.0.1:1", 10, TTL)
    eb = index.register_node("b", "127.0.0.1:2", 10, TTL)
    hashes = chain(namespace, 3)
    commit(index, namespace, "a", ea, hashes)
    commit(index, namespace, "b", eb, hashes[:1])
    # b dies (its heartbeat mirror goes away): page 0 still has a's replica
    index.touch_namespaces([namespace], "b", eb, 0)
    result = index.lookup(namespace, hashes)
    assert result.matched == 3 and [l.node_id for l in result.locations[0]] == ["a"]
    # a restarts: a new epoch makes all of its old pages absent
    ea2 = index.register_node("a", "127.0.0.1:1", 10, TTL)
    assert ea2 == ea + 1
    index.touch_namespaces([namespace], "a", ea2, TTL)
    assert index.lookup(namespace, hashes).matched == 0
    # a heartbeat that lapses makes pages absent too
    index.touch_namespaces([namespace], "a", ea2, 1)
    commit(index, namespace, "a", ea2, hashes[:1])
    assert index.lookup(namespace, hashes).matched == 1
    index.touch_namespaces([namespace], "a", ea2, 1)
    time.sleep(0.01)
    assert index.lookup(namespace, hashes).matched == 0


def test_remove_respects_read_leases(index, namespace):
    index.ensure_namespace(namespace)
    epoch = index.register_node("a", "127.0.0.1:1", 10, TTL)
    hashes = chain(namespace, 2)
    commit(index, namespace, "a", epoch, hashes)
    index.lookup(namespace, hashes[:1], lease_ms=5_000)
    assert index.remove(namespace, "a", epoch, hashes) == [False, True]
    assert index.lookup(namespace, hashes, lease_ms=0).matched == 1
    assert index.remove(namespace, "a", epoch, hashes[:1], respect_lease=False) == [True]
    assert index.lookup(namespace, hashes).matched == 0


class Model:
    """Pure-Python model of what lookups must see."""

    def __init__(self):
        self.committed: dict[str, set[bytes]] = {}
        self.alive: dict[str, bool] = {}

    def lookup(self, hashes):
        matched, nodes = 0, []
        for h in hashes:
            holders = {n for n, pages in self.committed.items() if h in pages and self.alive[n]}
            if not holders:
                break
            matched += 1
            nodes.append(holders)
        return matched, nodes


@pytest.mark.parametrize("seed", range(6))
def test_lookup_matches_model_under_random_interleavings(index, namespace, seed):
    rng = random.Random(seed)
    index.ensure_namespace(namespace)
    universe = chain(namespace, 10)
    nodes = ["n0", "n1", "n2"]
    epochs = {n: index.register_node(n, f"127.0.0.1:{i + 1}", 10, TTL) for i, n in enumerate(nodes)}
    model = Model()
    for n in nodes:
        model.committed[n] = set()
        model.alive[n] = True
    for _ in range(120):
        node = rng.choice(nodes)
        subset = rng.sample(universe, rng.randint(1, 5))
        action = rng.choice(["reserve", "commit", "commit", "remove", "kill", "restart", "lookup", "lookup", "expire"])
        if action in ("reserve", "commit") and not model.alive[node]:
            action = "restart"
        if action == "reserve":
            index.reserve(namespace, node, epochs[node], subset)
        elif action == "commit":
            commit(index, namespace, node, epochs[node], subset)
            model.committed[node].update(subset)
        elif action == "remove":
            index.remove(namespace, node, epochs[node], subset, respect_lease=False)
            model.committed[node].difference_update(subset)
        elif action == "kill":
            index.touch_namespaces([namespace], node, epochs[node], 0)
            model.alive[node] = False
        elif action == "restart":
            epochs[node] = index.register_node(node, "127.0.0.1:9", 10, TTL)
            index.touch_namespaces([namespace], node, epochs[node], TTL)
            model.alive[node] = True
            model.committed[node] = set()
        elif action == "expire":
            time.sleep(0.21)  # every reservation made so far is now past its deadline
        else:
            query = universe[: rng.randint(1, 10)] if rng.random() < 0.7 else rng.sample(universe, 5)
            result = index.lookup(namespace, query, lease_ms=0)
            matched, holders = model.lookup(query)
            assert result.matched == matched
            assert [{l.node_id for l in locs} for locs in result.locations] == holders
    final = index.lookup(namespace, universe, lease_ms=0)
    assert final.matched == model.lookup(universe)[0]


@pytest.mark.parametrize("count", [1, 16, 1024, 8192])
def test_lookup_is_one_command_on_the_server(index, namespace, valkey, count):
    index.ensure_namespace(namespace)
    epoch = index.register_node("a", "127.0.0.1:1", 10, TTL)
    hashes = block_hashes(namespace, list(range(count * namespace.block_size)))
    commit(index, namespace, "a", epoch, hashes)
    index.lookup(namespace, hashes[:1])  # loads the script (EVALSHA miss, SCRIPT LOAD)
    admin = redis.Redis.from_url(valkey.url)
    seen: list[dict] = []
    with admin.monitor() as monitor:
        reader = threading.Thread(target=lambda: _collect(monitor, seen))
        reader.start()
        time.sleep(0.05)
        result = index.lookup(namespace, hashes)
        redis.Redis.from_url(valkey.url).echo("monitor-done")
        reader.join(10)
    by_index = [c for c in seen if c["client_type"] != "lua" and c["command"].startswith("EVALSHA")]
    assert result.matched == count
    assert len(by_index) == 1
    index_conn = by_index[0]["client_address"], by_index[0]["client_port"]
    from_index = [c["command"].split()[0] for c in seen if c["client_type"] != "lua" and (c["client_address"], c["client_port"]) == index_conn]
    assert from_index == ["EVALSHA"]
    assert sum(c["client_type"] == "lua" for c in seen) >= count  # the work ran inside the script


def _collect(monitor, seen):
    for command in monitor.listen():
        seen.append(command)
        if command["command"].startswith("ECHO"):
            return


def test_bad_input_raises_clear_errors(index, namespace):
    index.ensure_namespace(namespace)
    with pytest.raises(InvalidInputError, match=r"page hash #1 must be 16 bytes, got 15"):
        index.lookup(namespace, [bytes(16), bytes(15)])
    with pytest.raises(InvalidInputError, match="empty list"):
        index.lookup(namespace, [])
    with pytest.raises(InvalidInputError, match="32 lowercase hex"):
        index.lookup("nope", [bytes(16)])
    with pytest.raises(UnknownNamespaceError, match="not registered"):
        index.lookup("0" * 32, [bytes(16)])
    with pytest.raises(InvalidInputError, match="redis://"):
        PageIndex("http://localhost:6379")


def test_unreachable_redis_fails_fast_with_index_unavailable(namespace):
    idx = PageIndex(f"redis://:secret@127.0.0.1:{free_port()}/0", timeout=0.5)
    start = time.monotonic()
    with pytest.raises(IndexUnavailableError, match="unreachable") as err:
        idx.lookup(namespace, [bytes(16)])
    assert time.monotonic() - start < 3
    assert "secret" not in str(err.value)


def test_url_forms_password_acl_user_and_db(valkey, namespace):
    admin = redis.Redis.from_url(valkey.url)
    admin.execute_command("ACL", "SETUSER", "kvuser", "on", ">pw1", "~*", "+@all")
    try:
        port = valkey.port
        idx = PageIndex(f"redis://kvuser:pw1@127.0.0.1:{port}/3")
        idx.ensure_namespace(namespace)
        assert idx.lookup(namespace, [bytes(16)]).matched == 0
        assert redis.Redis.from_url(f"redis://127.0.0.1:{port}/3").exists(f"kvs:{{{namespace.digest_hex}}}:meta")
        with pytest.raises(Exception, match="(?i)WRONGPASS|invalid"):
            PageIndex(f"redis://kvuser:wrong@127.0.0.1:{port}/3").ping()
    finally:
        admin.execute_command("ACL", "DELUSER", "kvuser")


def test_every_namespace_key_shares_one_hash_tag(index, namespace, valkey):
    index.ensure_namespace(namespace)
    epoch = index.register_node("a", "127.0.0.1:1", 10, TTL)
    commit(index, namespace, "a", epoch, chain(namespace, 3))
    raw = redis.Redis.from_url(valkey.url)
    keys = [k.decode() for k in raw.keys(f"*{namespace.digest_hex}*")]
    assert len(keys) >= 5
    slots = {raw.execute_command("CLUSTER", "KEYSLOT", k) if False else k.split("{")[1].split("}")[0] for k in keys}
    assert slots == {namespace.digest_hex}


def test_async_index_has_the_same_semantics(valkey, namespace):
    async def scenario():
        idx = AsyncPageIndex(valkey.url)
        await idx.ensure_namespace(namespace)
        epoch = await idx.register_node("async-node", "127.0.0.1:5", 10, TTL)
        hashes = chain(namespace, 3)
        assert await idx.reserve(namespace, "async-node", epoch, hashes) == [ReserveStatus.RESERVED] * 3
        await idx.commit(namespace, "async-node", epoch, [CommitEntry(h, 0, 1, 2) for h in hashes[:2]], TTL)
        result = await idx.lookup(namespace, hashes)
        nodes = [n.node_id for n in await idx.live_nodes()]
        assert await idx.deregister_node("async-node", epoch)
        after = [n.node_id for n in await idx.live_nodes()]
        await idx.close()
        return result.matched, nodes, after

    matched, nodes, after = asyncio.run(scenario())
    assert matched == 2 and "async-node" in nodes and "async-node" not in after

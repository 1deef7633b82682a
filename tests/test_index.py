"""The page index against a real Valkey: lookup semantics, publish, counts, registry and fencing."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
import redis

from kvstore import FencedError, IndexUnavailableError, InvalidInputError, NodeIdInUseError, UnknownNamespaceError, block_hashes
from kvstore.index import AsyncPageIndex, CommitEntry, PageIndex
from kvstore.procutil import free_port
from kvstore.valkey import EmbeddedValkey

TTL = 60_000


@pytest.fixture(autouse=True)
def fresh_registry(valkey):
    """Node ids ("a", "b", ...) repeat across tests: start each test with an empty registry."""
    raw = redis.Redis.from_url(valkey.url)
    for key in raw.scan_iter("kvs:{registry}:*"):
        raw.delete(key)
    raw.close()


def commit(index, ns, node, inc, hashes, slot0=0):
    entries = [CommitEntry(h, slot0 + i, 100 + i, 1000 + i) for i, h in enumerate(hashes)]
    return index.commit(ns, node, inc, entries, TTL)


def register(index, node, address="127.0.0.1:1", replaces="", ttl=TTL):
    """Register a fresh incarnation of ``node`` and return it."""
    return index.register_node(node, address, 10, ttl, replaces=replaces)


def pages_of(index, ns):
    return {s.digest: s for s in index.stats().namespaces}[ns.digest_hex]


def chain(ns, n):
    return block_hashes(ns, list(range(n * ns.block_size)))


def test_lookup_returns_longest_committed_prefix_with_locations(index, namespace):
    index.ensure_namespace(namespace)
    inc = register(index, "a")
    hashes = chain(namespace, 6)
    commit(index, namespace, "a", inc, hashes[:2] + hashes[3:])  # hole at 2
    result = index.lookup(namespace, hashes)
    assert result.matched == 2
    assert [[(l.node_id, l.incarnation, l.slot, l.size, l.checksum) for l in locs] for locs in result.locations] == [
        [("a", inc, 0, 100, 1000)], [("a", inc, 1, 101, 1001)]
    ]


def test_commit_is_idempotent_and_counts_pages(index, namespace):
    index.ensure_namespace(namespace)
    inc = register(index, "a")
    hashes = chain(namespace, 4)
    assert commit(index, namespace, "a", inc, hashes) == 4
    assert commit(index, namespace, "a", inc, hashes) == 0
    stats = pages_of(index, namespace)
    assert stats.pages == 4 and stats.per_node == {"a": 4}
    assert stats.namespace == namespace


def test_counts_equal_pages_held_through_removes_restarts_and_deaths(index, namespace):
    """Finding 4: counts only grew. They must equal what live incarnations hold."""
    index.ensure_namespace(namespace)
    inc = register(index, "a")
    inc_b = register(index, "b", "127.0.0.1:2")
    hashes = chain(namespace, 6)
    commit(index, namespace, "a", inc, hashes)
    commit(index, namespace, "b", inc_b, hashes[:2])
    index.remove(namespace, "a", inc, hashes[:2], respect_lease=False)
    assert pages_of(index, namespace).per_node == {"a": 4, "b": 2}
    # a restarts: the new incarnation starts from zero and overwrites the old entries
    inc2 = register(index, "a", replaces=inc)
    assert pages_of(index, namespace).per_node == {"b": 2}
    commit(index, namespace, "a", inc2, hashes[:3])
    assert pages_of(index, namespace).per_node == {"a": 3, "b": 2}
    # b goes away: its pages no longer count
    index.deregister_node("b", inc_b)
    assert pages_of(index, namespace).pages == 3


def test_pages_of_dead_or_restarted_nodes_are_absent(index, namespace):
    index.ensure_namespace(namespace)
    ea = register(index, "a")
    eb = register(index, "b", "127.0.0.1:2")
    hashes = chain(namespace, 3)
    commit(index, namespace, "a", ea, hashes)
    commit(index, namespace, "b", eb, hashes[:1])
    # b dies (its heartbeat mirror goes away): page 0 still has a's replica
    index.touch_namespaces([namespace], "b", eb, 0)
    result = index.lookup(namespace, hashes)
    assert result.matched == 3 and [l.node_id for l in result.locations[0]] == ["a"]
    # a restarts: a new incarnation makes all of its old pages absent
    ea2 = register(index, "a", replaces=ea)
    assert ea2 != ea
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
    inc = register(index, "a")
    hashes = chain(namespace, 2)
    commit(index, namespace, "a", inc, hashes)
    index.lookup(namespace, hashes[:1], lease_ms=5_000)
    assert index.remove(namespace, "a", inc, hashes) == [False, True]
    assert index.lookup(namespace, hashes, lease_ms=0).matched == 1
    assert index.remove(namespace, "a", inc, hashes[:1], respect_lease=False) == [True]
    assert index.lookup(namespace, hashes).matched == 0


def test_a_live_node_id_cannot_be_registered_twice(index):
    """Finding 7: a second process with the same node id is refused while the first lives."""
    first = register(index, "dup", "127.0.0.1:7", ttl=300)
    with pytest.raises(NodeIdInUseError, match="127.0.0.1:7"):
        register(index, "dup", "127.0.0.1:8")
    # the first keeps heartbeating; once it stops, its entry expires and the id is free
    index.register_node("dup", "127.0.0.1:7", 10, 300, first)
    time.sleep(0.35)
    second = register(index, "dup", "127.0.0.1:8")
    # the superseded incarnation is fenced: its heartbeat and its commits fail
    with pytest.raises(FencedError):
        index.register_node("dup", "127.0.0.1:7", 10, TTL, first)
    assert {n.node_id: n.incarnation for n in index.live_nodes()}["dup"] == second


def test_commit_of_a_superseded_incarnation_is_fenced(index, namespace):
    index.ensure_namespace(namespace)
    old = register(index, "f")
    new = register(index, "f", replaces=old)  # even within the same millisecond
    index.touch_namespaces([namespace], "f", new, TTL)
    with pytest.raises(FencedError, match=old):
        commit(index, namespace, "f", old, chain(namespace, 1))
    assert index.lookup(namespace, chain(namespace, 1)).matched == 0


def test_an_index_that_lost_its_data_fences_every_heartbeat_and_never_repeats_an_incarnation(namespace):
    """Finding 5: epochs from INCR repeated after a data loss and old entries came back."""
    with EmbeddedValkey() as server:
        idx = PageIndex(server.url)
        idx.ensure_namespace(namespace)
        inc = register(idx, "n")
        commit(idx, namespace, "n", inc, chain(namespace, 2))
        redis.Redis.from_url(server.url).flushall()
        with pytest.raises(FencedError):
            idx.register_node("n", "127.0.0.1:1", 10, TTL, inc)
        again = register(idx, "n", replaces=inc)
        assert again != inc
        idx.close()

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
    epochs = {n: register(index, n, f"127.0.0.1:{i + 1}") for i, n in enumerate(nodes)}
    model = Model()
    for n in nodes:
        model.committed[n] = set()
        model.alive[n] = True
    for _ in range(120):
        node = rng.choice(nodes)
        subset = rng.sample(universe, rng.randint(1, 5))
        action = rng.choice(["commit", "commit", "remove", "kill", "restart", "lookup", "lookup"])
        if action == "commit" and not model.alive[node]:
            action = "restart"
        if action == "commit":
            commit(index, namespace, node, epochs[node], subset)
            model.committed[node].update(subset)
        elif action == "remove":
            index.remove(namespace, node, epochs[node], subset, respect_lease=False)
            model.committed[node].difference_update(subset)
        elif action == "kill":
            index.touch_namespaces([namespace], node, epochs[node], 0)
            model.alive[node] = False
        elif action == "restart":
            epochs[node] = register(index, node, "127.0.0.1:9", replaces=epochs[node])
            index.touch_namespaces([namespace], node, epochs[node], TTL)
            model.alive[node] = True
            model.committed[node] = set()
        else:
            query = universe[: rng.randint(1, 10)] if rng.random() < 0.7 else rng.sample(universe, 5)
            result = index.lookup(namespace, query, lease_ms=0)
            matched, holders = model.lookup(query)
            assert result.matched == matched
            assert [{l.node_id for l in locs} for locs in result.locations] == holders
    final = index.lookup(namespace, universe, lease_ms=0)
    assert final.matched == model.lookup(universe)[0]
    # every node stays registered here ("kill" only drops its liveness mirror): counts
    # must equal what each current incarnation committed and did not remove
    counts = {n: c for n, c in pages_of(index, namespace).per_node.items() if c}
    assert counts == {n: len(pages) for n, pages in model.committed.items() if pages}


@pytest.mark.parametrize("count", [1, 16, 1024, 8192])
def test_lookup_is_one_command_on_the_server(index, namespace, valkey, count):
    index.ensure_namespace(namespace)
    inc = register(index, "a")
    hashes = block_hashes(namespace, list(range(count * namespace.block_size)))
    commit(index, namespace, "a", inc, hashes)
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
    inc = register(index, "a")
    commit(index, namespace, "a", inc, chain(namespace, 3))
    raw = redis.Redis.from_url(valkey.url)
    keys = [k.decode() for k in raw.keys(f"*{namespace.digest_hex}*")]
    assert len(keys) >= 5
    slots = {raw.execute_command("CLUSTER", "KEYSLOT", k) if False else k.split("{")[1].split("}")[0] for k in keys}
    assert slots == {namespace.digest_hex}


def test_async_index_has_the_same_semantics(valkey, namespace):
    async def scenario():
        idx = AsyncPageIndex(valkey.url)
        await idx.ensure_namespace(namespace)
        inc = await idx.register_node("async-node", "127.0.0.1:5", 10, TTL)
        hashes = chain(namespace, 3)
        assert await idx.commit(namespace, "async-node", inc, [CommitEntry(h, 0, 1, 2) for h in hashes[:2]], TTL) == 2
        result = await idx.lookup(namespace, hashes)
        nodes = [n.node_id for n in await idx.live_nodes()]
        assert await idx.deregister_node("async-node", inc)
        after = [n.node_id for n in await idx.live_nodes()]
        await idx.close()
        return result.matched, nodes, after

    matched, nodes, after = asyncio.run(scenario())
    assert matched == 2 and "async-node" in nodes and "async-node" not in after

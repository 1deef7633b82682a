"""The page index against a real Valkey and a real 3-shard Valkey cluster: lookup
semantics, segments, leases, registry, fencing and shard faults."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import numpy as np
import pytest
import redis

from kvstore import (
    FencedError,
    IndexUnavailableError,
    InvalidInputError,
    NodeIdInUseError,
    block_hashes,
)
from kvstore.index import (
    ENTRY,
    AsyncPageIndex,
    CommitEntry,
    PageIndex,
    Registration,
    select_records,
)
from kvstore.pages import keys
from kvstore.tools.procutil import free_port
from kvstore.tools.valkey import EmbeddedValkey, EmbeddedValkeyCluster
from tests.helpers import raw_index

TTL = 60_000


@pytest.fixture(scope="module", params=["valkey", "cluster3"])
def valkey(request):
    """The index server: one Valkey, then a 3-shard Valkey cluster."""
    server = EmbeddedValkey() if request.param == "valkey" else EmbeddedValkeyCluster(3)
    with server:
        yield server


@pytest.fixture()
def index(valkey):
    idx = PageIndex(valkey.url)
    yield idx
    idx.close()


@pytest.fixture(autouse=True)
def fresh_registry(valkey):
    """Node ids ("a", "b", ...) repeat across tests: start each test with an empty registry."""
    raw = raw_index(valkey.url)
    for key in raw.scan_iter("kvs:{registry}:*"):
        raw.delete(key)
    raw.close()


def commit(index, ns, reg: Registration, hashes, slot0=0, chain_hashes=None):
    """Commit ``hashes`` (each at its place in ``chain_hashes``, by default the hashes
    themselves as a chain from block 0)."""
    chain_hashes = chain_hashes or hashes
    anchors, positions = keys.placement(chain_hashes)
    where = {h: i for i, h in enumerate(chain_hashes)}
    entries = [
        CommitEntry(h, anchors[where[h]], positions[where[h]], slot0 + i, 100 + i, 1000 + i)
        for i, h in enumerate(hashes)
    ]
    return index.commit(ns, reg.number, reg.incarnation, entries)


def remove(index, ns, reg, hashes, chain_hashes, respect_lease=True):
    anchors, _ = keys.placement(chain_hashes)
    where = {h: i for i, h in enumerate(chain_hashes)}
    return index.remove(
        ns, reg.number, hashes, [anchors[where[h]] for h in hashes], respect_lease=respect_lease
    )


def register(index, node, address="127.0.0.1:1", replaces="", ttl=TTL, pages=None) -> Registration:
    extra = {"pages": pages} if pages else None
    return index.register_node(node, address, 10, ttl, replaces=replaces, extra=extra)


def lookup(index, ns, hashes, **kw):
    return index.lookup(ns, hashes, **kw).resolve(index.live_nodes())


def chain(ns, n, start=0):
    return block_hashes(ns, list(range(start, start + n * ns.block_size)))


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
        return index._drive(_single(Cmd(("PTTL", key), key=key)))

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
    universe = chain(namespace, 2 * keys.SEGMENT_PAGES + 10)
    nodes = ["n0", "n1", "n2"]
    regs = {n: register(index, n, f"127.0.0.1:{i + 1}") for i, n in enumerate(nodes)}
    model = Model()
    for n in nodes:
        model.committed[n] = set()
        model.alive[n] = True
    for _ in range(120):
        node = rng.choice(nodes)
        start = rng.randrange(len(universe))
        subset = universe[start : start + rng.randint(1, 40)]
        action = rng.choice(
            ["commit", "commit", "commit", "remove", "kill", "restart", "lookup", "lookup"]
        )
        if action in ("commit", "remove") and not model.alive[node]:
            action = "restart"
        if action == "commit":
            commit(index, namespace, regs[node], subset, chain_hashes=universe)
            model.committed[node].update(subset)
        elif action == "remove":
            remove(index, namespace, regs[node], subset, universe, respect_lease=False)
            model.committed[node].difference_update(subset)
        elif action == "kill":
            index.deregister_node(node, regs[node].incarnation)
            model.alive[node] = False
        elif action == "restart":
            regs[node] = register(index, node, "127.0.0.1:9", replaces=regs[node].incarnation)
            model.alive[node] = True
            model.committed[node] = set()
        else:
            query = universe[: rng.randint(1, len(universe))]
            result = lookup(index, namespace, query, lease_ms=0)
            matched, holders = model.lookup(query)
            assert result.matched == matched
            assert [{l.node_id for l in locs} for locs in result.locations] == holders
    assert lookup(index, namespace, universe, lease_ms=0).matched == model.lookup(universe)[0]


@pytest.mark.parametrize("count", [1, 16, 200, 1024, 8192])
def test_a_lookup_is_one_round_trip_per_shard_and_one_read_per_segment(
    index, namespace, valkey, count
):
    index.ensure_namespace(namespace)
    a = register(index, "a")
    hashes = block_hashes(namespace, list(range(count * namespace.block_size)))
    for start in range(0, count, 4096):
        commit(index, namespace, a, hashes[start : start + 4096], chain_hashes=hashes)
    index.lookup(
        namespace, hashes
    )  # loads the script where needed and leases every segment: none renews below
    nodes = index.live_nodes()
    servers = valkey.shards if isinstance(valkey, EmbeddedValkeyCluster) else [valkey]
    seen: list[list[dict]] = [[] for _ in servers]
    readers = []
    for server, out in zip(servers, seen):
        monitor = redis.Redis.from_url(server.url).monitor().__enter__()
        readers.append((threading.Thread(target=_collect, args=(monitor, out)), monitor))
    for reader, _ in readers:
        reader.start()
    time.sleep(0.1)
    result = index.lookup(namespace, hashes).resolve(nodes)
    for server in servers:
        redis.Redis.from_url(server.url).echo("monitor-done")
    for reader, monitor in readers:
        reader.join(10)
        monitor.__exit__(None, None, None)
    assert result.matched == count
    per_shard = [0] * len(servers)
    for s, _ in keys.segments(count):
        per_shard[
            index._router.topology.shard_of(keys.segment_key(namespace.key.prefix, hashes[s]))
        ] += 1
    for segments, out in zip(per_shard, seen):
        sent = [
            c["command"].split()[0]
            for c in out
            if c["client_type"] != "lua"
            and c["command"].split()[0] in ("GET", "PTTL", "SET", "PEXPIRE", "EVALSHA")
        ]
        # a shard with one segment gets GET and PTTL (the lease is fresh: no renewal),
        # one with more a single script call, one with none nothing
        assert sent == (
            [] if segments == 0 else ["GET", "PTTL"] if segments == 1 else ["EVALSHA"]
        ), (segments, sent)
    # one read per segment (its lease beside it), never one per page
    reads = sum(c["command"].split()[0] == "GET" for out in seen for c in out)
    assert reads == len(keys.segments(count))


@pytest.mark.parametrize("shards", [1, 3])
def test_a_lookup_with_nodes_answers_both_in_one_round_trip(namespace, shards):
    """``with_nodes``: the lookup's own answer and the registry's live nodes, read in the
    lookup's round trip (the registry's shard is asked with the segments' shards), on a
    single server and on a cluster whose segments and registry lie on other shards."""
    server = EmbeddedValkeyCluster(shards) if shards > 1 else EmbeddedValkey()
    with server:
        index = PageIndex(server.url)
        index.ensure_namespace(namespace)
        a, b = register(index, "a"), register(index, "b")
        hashes = chain(namespace, 3 * keys.SEGMENT_PAGES + 5)
        commit(index, namespace, a, hashes[:100], chain_hashes=hashes)
        commit(index, namespace, b, hashes[100:], chain_hashes=hashes)
        plain = index.lookup(namespace, hashes, lease_ms=0)
        found, nodes = index.lookup(namespace, hashes, lease_ms=0, with_nodes=True)
        assert {n.node_id for n in nodes} == {n.node_id for n in index.live_nodes()} == {"a", "b"}
        assert found.resolve(nodes).matched == plain.resolve(nodes).matched == len(hashes)
        assert [{l.node_id for l in locs} for locs in found.resolve(nodes).locations] == [
            {"a"}
        ] * 100 + [{"b"}] * (len(hashes) - 100)
        index.close()


def _collect(monitor, seen):
    for command in monitor.listen():
        seen.append(command)
        if "monitor-done" in command["command"]:
            return


def test_a_stopped_shard_shortens_the_prefix_without_an_error(namespace):
    with EmbeddedValkeyCluster(3) as cluster:
        index = PageIndex(cluster.url, timeout=1.0)
        ns = namespace
        index.ensure_namespace(ns)
        a = register(index, "a")
        ns_hashes = chain(ns, 12 * keys.SEGMENT_PAGES)
        commit(index, ns, a, ns_hashes)
        nodes = index.live_nodes()
        assert index.lookup(ns, ns_hashes).resolve(nodes).matched == len(ns_hashes)
        plan = [
            index._router.topology.shard_of(keys.segment_key(ns.key.prefix, ns_hashes[s]))
            for s, _ in keys.segments(len(ns_hashes))
        ]
        victim = next(shard for shard in plan if shard != plan[0])  # not the first segment's
        first_lost = plan.index(victim)
        cluster.shards[victim].stop()
        start = time.monotonic()
        found = index.lookup(ns, ns_hashes)
        assert time.monotonic() - start < 5
        assert found.unavailable is not None
        assert found.resolve(nodes).matched == first_lost * keys.SEGMENT_PAGES
        # writes that span shards report the pages they could not write
        written = commit(index, ns, a, ns_hashes)
        assert (
            written.count(None) == plan.count(victim) * keys.SEGMENT_PAGES
            and written.count(True) > 0
        )
        index.close()


def test_selecting_records_as_plain_items_keeps_every_field():
    """select_records (lookups select index entries with it) gives what numpy's own
    structured selection gives, field for field."""
    rng = np.random.default_rng(7)
    records = np.frombuffer(
        rng.integers(0, 256, 300 * ENTRY.itemsize, dtype=np.uint8).tobytes(), dtype=ENTRY
    )
    mask = rng.random(300) < 0.4
    picked = select_records(records, mask)
    assert picked.dtype == ENTRY and len(picked) == mask.sum() > 0
    for name in ENTRY.names:
        assert np.array_equal(picked[name], records[name][mask])


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

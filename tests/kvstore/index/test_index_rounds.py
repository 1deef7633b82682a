"""The index's lookups against a model under random interleavings, their round trips
(one per shard, one read per segment, nodes in the same trip), a stopped shard, and
records as plain items."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
import redis

from kvstore import (
    block_hashes,
)
from kvstore.index import (
    ENTRY,
    PageIndex,
    select_records,
)
from kvstore.pages import keys
from kvstore.tools.valkey import EmbeddedValkey, EmbeddedValkeyCluster
from tests.support.index_fixtures import (  # noqa: F401 (fixtures)
    chain,
    commit,
    fresh_registry,
    index,
    lookup,
    register,
    remove,
    valkey,
)


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
    found = []
    seen = _monitored(servers, lambda: found.append(index.lookup(namespace, hashes).resolve(nodes)))
    assert found[0].matched == count
    per_shard = [0] * len(servers)
    for s, _ in keys.segments(count):
        per_shard[
            index._router.topology.shard_of(keys.segment_key(namespace.key.prefix, hashes[s]))
        ] += 1
    for segments, sent in zip(per_shard, map(_data_commands, seen)):
        # a shard with one segment gets GET and PTTL (the lease is fresh: no renewal),
        # one with more a single script call, one with none nothing
        assert sent == (
            [] if segments == 0 else ["GET", "PTTL"] if segments == 1 else ["EVALSHA"]
        ), (segments, sent)
    # one read per segment (its lease beside it), never one per page
    reads = sum(c["command"].split()[0] == "GET" for out in seen for c in out)
    assert reads == len(keys.segments(count))


def _monitored(servers, action) -> list[list[dict]]:
    """Per server of ``servers``, what MONITOR saw while ``action`` ran (scripts' own
    commands included)."""
    seen: list[list[dict]] = [[] for _ in servers]
    readers = []
    for server, out in zip(servers, seen):
        monitor = redis.Redis.from_url(server.url).monitor().__enter__()
        readers.append((threading.Thread(target=_collect, args=(monitor, out)), monitor))
    for reader, _ in readers:
        reader.start()
    time.sleep(0.1)
    action()
    for server in servers:
        redis.Redis.from_url(server.url).echo("monitor-done")
    for reader, monitor in readers:
        reader.join(10)
        monitor.__exit__(None, None, None)
    return seen


def _data_commands(out: list[dict]) -> list[str]:
    """The data commands clients sent (not a script's own), in order."""
    return [
        c["command"].split()[0]
        for c in out
        if c["client_type"] != "lua"
        and c["command"].split()[0] in ("GET", "PTTL", "SET", "PEXPIRE", "EVALSHA")
    ]


def _sent(servers, action) -> list[str]:
    """The data commands clients sent to ``servers`` while ``action`` ran, in order."""
    return [command for out in _monitored(servers, action) for command in _data_commands(out)]


def test_a_due_lease_is_renewed_in_the_lookups_one_round_trip(index, namespace, valkey):
    """A lookup of one segment reads it plainly (GET, PTTL) while its lease is known
    fresh; a lease it has not seen, or one due by the clock it keeps, goes through the
    lookup script, which renews it in the same round trip, with the lease's PTTL after
    it (before, a due lease cost a second round trip: GET, PTTL, then lease.lua). A
    segment not stored is then read plainly."""
    index.ensure_namespace(namespace)
    a = register(index, "a")
    hashes = block_hashes(namespace, list(range(16 * namespace.block_size)))
    commit(index, namespace, a, hashes, chain_hashes=hashes)
    servers = valkey.shards if isinstance(valkey, EmbeddedValkeyCluster) else [valkey]
    index.lookup(namespace, hashes[:1])  # loads the script on the segment's shard
    held = keys.lease_key(namespace.key.prefix, hashes[0])
    shard = redis.Redis.from_url(servers[index._router.topology.shard_of(held)].url)
    shard.delete(held)  # a lease nobody holds
    reader = PageIndex(valkey.url, lease_ms=600)  # has seen no lease
    assert _sent(servers, lambda: reader.lookup(namespace, hashes)) == ["EVALSHA", "PTTL"]
    assert _sent(servers, lambda: reader.lookup(namespace, hashes)) == ["GET", "PTTL"]
    time.sleep(0.35)  # past half the lease: due by the reader's clock
    assert _sent(servers, lambda: reader.lookup(namespace, hashes)) == ["EVALSHA", "PTTL"]
    assert shard.pttl(held) > 300  # renewed
    assert reader.lookup(namespace, hashes).resolve(reader.live_nodes()).matched == 16
    missing = block_hashes(namespace, list(range(10**6, 10**6 + 16 * namespace.block_size)))
    assert _sent(servers, lambda: reader.lookup(namespace, missing)) == ["EVALSHA", "PTTL"]
    assert _sent(servers, lambda: reader.lookup(namespace, missing)) == ["GET", "PTTL"]


@pytest.mark.parametrize("shards", [1, 3])
def test_a_lookup_with_nodes_answers_both_in_one_round_trip(namespace, shards):
    """``lookup_with_nodes``: the lookup's own answer and the registry's live nodes, read in the
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
        found, nodes = index.lookup_with_nodes(namespace, hashes, lease_ms=0)
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

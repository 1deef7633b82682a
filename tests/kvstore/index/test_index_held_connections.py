"""An index that holds its connections between calls (``PageIndex(...,
held_connections=True)``, kvstore.index.held.HeldConnections: what
``KVCacheClient.find`` asks through), against a real Valkey and a 3-shard cluster: the
same answers as the pooled index, a connection the server dropped is replaced within the
call, calls one after another share one connection, and closing the index closes it."""

from __future__ import annotations

import threading

import pytest

from kvstore.index import PageIndex
from kvstore.pages.namespace import Namespace
from tests.support.helpers import raw_index
from tests.support.index_fixtures import (  # noqa: F401 (fixtures)
    chain,
    commit,
    fresh_registry,
    register,
    valkey,
)

NS = Namespace(
    model="held", dtype="float16", num_layers=1, num_kv_heads=1, head_size=8, block_size=4
)


def others(url: str) -> int:
    """Client connections a single Valkey has open, besides the one asking."""
    raw = raw_index(url)
    try:
        return sum(1 for c in raw.client_list() if c.get("cmd") != "client|list")
    finally:
        raw.close()


def drop_connections(url: str) -> None:
    """Every shard of the index closes every client connection (CLIENT KILL)."""
    raw = raw_index(url)
    try:
        shards = (
            [raw.get_redis_connection(n) for n in raw.get_primaries()]
            if hasattr(raw, "get_primaries")
            else [raw]
        )
        for shard in shards:
            shard.client_kill_filter(_type="normal", skipme=True)
    finally:
        raw.close()


@pytest.fixture()
def stored(valkey):
    """12 pages of a 12-block chain committed to the index by a registered node."""
    pooled = PageIndex(valkey.url)
    reg = register(pooled, "a")
    hashes = chain(NS, 12)
    commit(pooled, NS, reg, hashes)
    yield pooled, hashes
    pooled.close()


def test_held_connections_answer_as_the_pool_does_and_survive_a_dropped_connection(valkey, stored):
    pooled, hashes = stored
    held = PageIndex(valkey.url, held_connections=True)
    try:
        nodes = pooled.live_nodes()
        want = pooled.lookup(NS, hashes).resolve(nodes).matched
        assert want == 12
        assert held.lookup(NS, hashes).resolve(nodes).matched == want
        drop_connections(valkey.url)
        assert held.lookup(NS, hashes).resolve(nodes).matched == want  # a new one, in the call
        assert held.lookup(NS, hashes[:5]).resolve(nodes).matched == 5
    finally:
        held.close()


def test_calls_one_after_another_share_one_held_connection_until_close(valkey, stored):
    """Three threads ask one after another, then this one: one connection served them
    all and stays open between calls, and none once the index is closed."""
    if "cluster" in valkey.url.split("://", 1)[0]:
        pytest.skip("counted on a single Valkey")
    pooled, hashes = stored
    nodes = pooled.live_nodes()
    held = PageIndex(valkey.url, held_connections=True)
    answers: list[int] = []

    def ask() -> None:
        answers.append(held.lookup(NS, hashes).resolve(nodes).matched)

    threads = [threading.Thread(target=ask) for _ in range(3)]
    before = others(valkey.url)
    for t in threads:
        t.start()
        t.join()
    ask()
    assert answers == [12] * 4
    assert others(valkey.url) == before + 1
    held.close()
    assert others(valkey.url) == before

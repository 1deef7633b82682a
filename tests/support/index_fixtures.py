"""Fixtures and helpers of the test_index* files: the index server (one Valkey, then a
3-shard Valkey cluster), a PageIndex on it, an empty registry per test, and commit,
remove, register and lookup helpers."""

from __future__ import annotations

import pytest

from kvstore import (
    block_hashes,
)
from kvstore.index import (
    CommitEntry,
    PageIndex,
    Registration,
)
from kvstore.pages import keys
from kvstore.tools.valkey import EmbeddedValkey, EmbeddedValkeyCluster
from tests.support.helpers import raw_index

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
